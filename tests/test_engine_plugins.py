"""An engine kind from another package: a real wheel built and pip-installed (``--target``, into a
temporary folder: the shared environment never sees it) that registers a
:class:`~ragbudget.generation.engines.ServedBackend` subclass in the ``ragbudget.engines``
entry-point group, then used by a fresh interpreter — ``connect(kind=…)``, the settings record
and the CLI's ``--engine-kind`` — against a replay engine, with no edit in ragbudget."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _plugins import install_plugin, plugin_env
from _replay import Replay

ROOT = Path(__file__).resolve().parents[1]

PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "ragbudget-tiny-engine"
version = "0.1"

[project.entry-points."ragbudget.engines"]
tiny = "tiny_engine:TinyBackend"
broken = "tiny_engine:NOT_A_BACKEND"
"""

MODULE = '''\
"""A third-party engine, written only against ragbudget's public engine contract (the names
``ragbudget.generation.engines`` exports; docs/engines.md, "Another engine"): a generic
OpenAI-compatible server under its own kind name, counting with a local stand-in."""
from ragbudget.generation.engines import Capacity, LocalCounter, ServedBackend, int_or_none

NOT_A_BACKEND = object()


class TinyBackend(ServedBackend):
    kind = "tiny"
    takes_tokenizer = True

    def __init__(self, http, *, tokenizer=None, **kw):
        super().__init__(http, **kw)
        self.counter = LocalCounter(tokenizer)

    @property
    def count_key(self):
        return f"{self.model_id} @ {self.counter.key}"

    def engine_count(self, texts):
        return self.counter.count(texts)

    def engine_render(self, messages):
        return self.counter.render(messages)

    def engine_capacity(self):
        window = None
        for card in self.http.get("/v1/models").data.get("data", []):
            window = int_or_none(card.get("max_model_len")) or window
        source = "GET /v1/models max_model_len" if window else ""
        return Capacity(max_context_tokens=window, max_context_source=source, engine_kind=self.kind)
'''

# What the fresh interpreter does with the installed plugin: nothing of it is imported until its
# kind is asked for; then it generates on the replay engine as any built-in kind would.
SCRIPT = """\
import json, sys
import ragbudget
from ragbudget.errors import ConfigError
from ragbudget.generation.engines import connect, kinds
from ragbudget.settings import EngineSettings

out = {"kinds": list(kinds()), "imported_early": "tiny_engine" in sys.modules}
EngineSettings(url=sys.argv[1], kind="tiny")  # accepted by the settings record
backend = connect(sys.argv[1], kind="tiny", context_tokens=2048)
from _engine_contract import check_engine  # the checks every built-in kind passes too

# Read before check_engine closes the backend: a capacity older than CAPACITY_TTL_S is asked of
# the engine again, on a closed client when the host was slow enough (seen once in CI-like load).
out.update(cls=type(backend).__name__, kind=backend.capacity().engine_kind)
seen = check_engine(backend, kind="tiny", url=sys.argv[1])
out["text"] = seen["text"]
try:
    connect(sys.argv[1], kind="broken")
except ConfigError as exc:
    out["broken"] = str(exc)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin package, built and installed into a folder of its own (its ``sys.path``)."""
    files = {"pyproject.toml": PYPROJECT, "tiny_engine.py": MODULE}
    return install_plugin(tmp_path_factory.mktemp("plugin-src"), tmp_path_factory.mktemp("plugin-site"), files)


def _env(plugin: Path) -> dict[str, str]:
    return plugin_env(plugin)


def test_an_installed_package_adds_an_engine_kind(plugin: Path) -> None:
    with Replay("openai") as srv:
        run = subprocess.run(
            [sys.executable, "-c", SCRIPT, srv.url], capture_output=True, text=True, env=_env(plugin), timeout=300
        )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["kinds"][:6] == ["vllm", "sglang", "tgi", "llamacpp", "ollama", "openai"]
    assert {"tiny", "broken"} <= set(out["kinds"])
    assert out["imported_early"] is False  # named by its entry point, imported on use only
    assert out["cls"] == "TinyBackend" and out["kind"] == "tiny"
    assert out["text"].startswith("The Project Leader")  # and the whole contract held (_engine_contract)
    # A plugin that registers something else is its package's fault, said in one line.
    assert "not a ragbudget.generation.engines.ServedBackend subclass" in out["broken"]
    assert "tiny_engine:NOT_A_BACKEND" in out["broken"]


def test_the_cli_accepts_a_registered_kind_and_still_refuses_an_unknown_one(plugin: Path) -> None:
    code = textwrap.dedent(
        """\
        import sys
        from ragbudget.cli.options import _EngineKind
        import click
        kind = _EngineKind()
        print(kind.convert("tiny", None, None))
        try:
            kind.convert("nosuch", None, None)
        except click.BadParameter as exc:
            print("refused:", exc)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(plugin), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == "tiny"
    assert lines[1].startswith("refused:") and "nosuch" in lines[1]
