"""What a test needs, said by its markers, and the guard that holds every test to them.

=========  ==========================================================================================
marker     the test ...
=========  ==========================================================================================
server     serves ragbudget's app with uvicorn (``background_server``, ``ragbudget serve`` in process
           or in a subprocess)
ray        starts or joins a Ray cluster (the ``ray_cluster`` fixture)
model      builds or loads a neural model: transformers (a real one or a tiny random one; one
           built on the meta device, shapes without weights, is not one),
           sentence-transformers, ONNX Runtime or numpy (the packaged MiniLM's two light paths)
engine     talks to the real llama.cpp ``llama-server`` (the ``llama_server`` fixture)
gpu        needs a CUDA device (skipped without one)
=========  ==========================================================================================

``make test-fast`` runs the tests that need none of them (:data:`FAST`); ``make test`` runs them all.
``slow``, the old name of ``model``, is still accepted and means ``model``.

Markers come from three places: a fixture a test uses (:data:`FIXTURE_MARKS`, applied in
``conftest.py``), a module's ``pytestmark`` when every test in it needs the same thing, and a
decorator on the test otherwise. A test that slips through is caught: while a test runs (its
fixtures included), starting a uvicorn server, calling ``ray.init`` or building a model fails it
unless it carries the marker, with the marker to add — in every run, so CI catches a new test that
``make test-fast`` would have run without what it needs. The checks wrap the libraries' own entry
points as each library is imported (:data:`PATCHES`), so a run that never imports one pays nothing.
A child process is seen only when it is ``ragbudget serve``: a test whose child process loads a
model (``ragbudget ask`` without ``--engine``) is marked by hand.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import pytest

#: The markers that say what a test needs beyond the Python process.
NEEDS = ("server", "ray", "model", "engine", "gpu", "postgres")
#: ``-m`` of ``make test-fast``: the tests that need none of them.
FAST = "not (" + " or ".join(NEEDS) + ")"
#: Fixtures that bring a need with them, and the marker each gives a test that uses it: the shared
#: ones of conftest.py, and those of one test module that hold a model or a server for its tests
#: (a name used elsewhere for something light only costs that test its place in the fast tier).
FIXTURE_MARKS = {
    "llama_server": "engine",
    "ray_cluster": "ray",
    "gen": "model",  # test_generate, test_batching: a Generator over the tiny random Llama
    "batcher": "model",  # test_batching
    "models": "model",  # test_kvcache: tiny random models of every architecture
    "minilm": "model",  # test_embed: the packaged MiniLM under sentence-transformers
    "minilm_index": "model",  # test_lazy_imports: an index built with it
    "real_pipeline": "model",  # test_chat: MiniLM and SmolLM2
    "chat_server": "server",  # test_chat: the app under uvicorn
    "pg_server": "postgres",  # a PostgreSQL server with pgvector (pgserver), one per worker
    "pg_url": "postgres",
    "pg_password_server": "postgres",
    "pg_password_db": "postgres",
    "pg_secret_db": "postgres",
}
#: Needs whose tests run on one pytest-xdist worker (``make test``'s ``--dist loadgroup``): the
#: session fixture behind each (a Ray cluster, a llama-server) is per worker and costs CPU seconds
#: to start and cores while it runs, so it starts once, not on every worker.
ONE_WORKER = ("ray", "engine")
#: Old marker names and the one each now means.
ALIASES = {"slow": "model"}

#: ``RAGBUDGET_NEEDS_RECORD=<file>``: instead of failing, append ``<test id>\t<marker>`` to the
#: file for each unmarked need (a survey, e.g. before marking a folder of new tests).
RECORD = os.environ.get("RAGBUDGET_NEEDS_RECORD")

_VIOLATIONS = pytest.StashKey[list[str]]()


class Guard:
    """Which test runs now, and the checks the wrapped entry points call."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None

    def need(self, marker: str, what: str) -> None:
        """The running test does ``what``: fine when it carries ``marker``; else, in the test's
        own thread, a failure at once (``pytest.fail`` is not an ``Exception``, so no ``except``
        in the code under test swallows it), and in another thread (a server's worker, a load in
        the background) one recorded for the test to fail with when it ends."""
        item = self.item
        if item is None or item.get_closest_marker(marker) is not None:
            return
        if RECORD:  # a survey of what each test needs: noted, not failed
            with open(RECORD, "a", encoding="utf-8") as out:
                out.write(f"{item.nodeid}\t{marker}\n")
            return
        message = (
            f"{item.nodeid} {what} but is not marked {marker!r}: add @pytest.mark.{marker} (or the "
            f"module's pytestmark) so `make test-fast` leaves it out; see tests/_needs.py"
        )
        if threading.current_thread() is threading.main_thread():
            pytest.fail(message, pytrace=False)
        found = item.stash.setdefault(_VIOLATIONS, [])
        if message not in found:
            found.append(message)

    def violations(self, item: pytest.Item) -> list[str]:
        return item.stash.get(_VIOLATIONS, [])


GUARD = Guard()


def _wrap(owner: Any, name: str, marker: str, what: str, *, when: Callable[..., bool] | None = None) -> None:
    """Make ``owner.name`` (a function, or a class's ``__init__``) call the guard first — for
    every call, or those for which ``when(*args, **kwargs)`` is true."""
    original = getattr(owner, name)
    if getattr(original, "_ragbudget_guarded", False):
        return

    @functools.wraps(original)  # keeps the signature that transformers and ray inspect
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if when is None or when(*args, **kwargs):
            GUARD.need(marker, what)
        return original(*args, **kwargs)

    guarded._ragbudget_guarded = True  # type: ignore[attr-defined]
    setattr(owner, name, guarded)


def _uvicorn(module: ModuleType) -> None:
    _wrap(module.Server, "__init__", "server", "starts a uvicorn server")


def _ray(module: ModuleType) -> None:
    _wrap(module, "init", "ray", "starts or joins a Ray cluster (ray.init)")


def _off_meta(*args: Any, **kwargs: Any) -> bool:
    import torch

    return bool(torch.get_default_device().type != "meta")


def _transformers(module: ModuleType) -> None:
    # A model built on the meta device has shapes and no weights: that is how the budget counts
    # parameters exactly (tens of milliseconds, once torch is imported), not a model to run.
    _wrap(module.PreTrainedModel, "__init__", "model", "builds a transformers model", when=_off_meta)


def _sentence_transformers(module: ModuleType) -> None:
    _wrap(module.SentenceTransformer, "__init__", "model", "loads a sentence-transformers model")


def _onnxruntime(module: ModuleType) -> None:
    _wrap(module.InferenceSession, "__init__", "model", "opens an ONNX Runtime model")


def _safetensors_numpy(module: ModuleType) -> None:
    # The packaged MiniLM's query path (ragbudget.retrieval.embed's numpy BERT) reads its weights here.
    _wrap(module, "load_file", "model", "reads model weights (safetensors, in numpy)")


#: The modules whose import installs a check, and the check: each wraps the entry point that
#: starts the expensive thing, whoever calls it (the library, a test, a fixture).
PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "uvicorn.server": _uvicorn,
    "ray": _ray,
    "transformers.modeling_utils": _transformers,
    "sentence_transformers.SentenceTransformer": _sentence_transformers,
    "onnxruntime": _onnxruntime,
    "safetensors.numpy": _safetensors_numpy,
}


class _Loader(importlib.abc.Loader):
    """The module's own loader, then its patch."""

    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches :data:`PATCHES`' modules as they are imported (a post-import hook)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


def _serves(popen: Any, args: Any = (), *rest: Any, **kwargs: Any) -> bool:
    """Whether a ``subprocess.Popen`` starts ``ragbudget serve`` (``python -m ragbudget [-v] serve``
    or the ``ragbudget`` script): a server in a child process, which the uvicorn check cannot see."""
    args = kwargs.get("args", args)
    if isinstance(args, bytes):
        args = args.decode(errors="replace")
    argv = shlex.split(args) if isinstance(args, str) else [str(a) for a in args]
    for i, word in enumerate(argv):
        if word == "ragbudget" or word.endswith("/ragbudget"):
            command = next((a for a in argv[i + 1 :] if not a.startswith("-")), None)
            return command == "serve"
    return False


def _install() -> None:
    """Patch what is imported already, and the rest as it is imported."""
    _wrap(subprocess.Popen, "__init__", "server", "starts `ragbudget serve` in a child process", when=_serves)
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


# -- the hooks (conftest.py imports them) -----------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    _install()


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the markers given here count for it
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    xdist = config.pluginmanager.hasplugin("xdist")
    for item in items:
        for fixture, marker in FIXTURE_MARKS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)
        for old, marker in ALIASES.items():
            if item.get_closest_marker(old) is not None:
                item.add_marker(marker)
        for marker in ONE_WORKER:
            # `--dist loadgroup` sends a group to one worker: one cluster, one llama-server.
            if xdist and item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.xdist_group(marker))
                break
        if item.get_closest_marker("gpu") is not None and not _has_cuda():
            item.add_marker(skip_gpu)


@functools.cache
def _has_cuda() -> bool:
    # Asked only when a gpu test is collected: importing torch costs seconds.
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # torch missing or broken: no GPU tests either way
        return False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    GUARD.item = item  # its fixtures' setup and teardown included
    try:
        return (yield)
    finally:
        GUARD.item = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[object]:
    try:
        return (yield)
    finally:
        # A need met in another thread (a server's worker, a background load) fails it here.
        found = GUARD.violations(item)
        if found:
            pytest.fail("\n".join(found), pytrace=False)
