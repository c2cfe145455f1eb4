"""Each CLI command imports only what it needs (issue #19 §6): run the real command in a fresh
interpreter and look at ``sys.modules`` afterwards.

``stats``, ``verify`` and ``sources``-style reads import no model stack; ``index`` with nothing to
embed does not load the embedder; ``search`` embeds its query without torch, transformers or
sentence-transformers and never touches the generator.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

MODEL_STACK = ("torch", "transformers", "sentence_transformers", "sklearn", "scipy", "gguf", "llama_cpp")
GENERATOR = ("ragbudget.generation.generate", "ragbudget.memory.budget", "ragbudget.memory.kvcache")

_RUN = """
import json, sys
from ragbudget.cli.commands import main
code = 0
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code or 0
print("\\nMODULES " + json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def run_cli(*args: str, cwd: Path = REPO) -> tuple[int, set[str], str]:
    """Run ``ragbudget *args`` in a new interpreter (the checkout's package); return its exit code,
    the modules it ended with, and its output."""
    out = subprocess.run(
        [sys.executable, "-c", _RUN, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)},
    )
    text = out.stdout + out.stderr
    assert "MODULES " in out.stdout, text
    data = json.loads(out.stdout.rsplit("MODULES ", 1)[1])
    return int(data["code"]), set(data["modules"]), text


def loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return [n for n in names if n in modules]


@pytest.fixture(scope="module")
def minilm_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-file index built with the packaged MiniLM (the real embedder, loaded once here)."""
    from ragbudget.retrieval.embed import SentenceTransformerEmbedder
    from ragbudget.retrieval.index import Index

    root = tmp_path_factory.mktemp("lazy")
    docs = root / "docs"
    docs.mkdir()
    (docs / "pipes.txt").write_text(
        "A pipe is a unidirectional data channel. Writing to a pipe whose read end is closed raises "
        "SIGPIPE and the write fails with EPIPE.\n\nThe close call releases a file descriptor.\n"
    )
    Index(root / "idx").build([str(docs)], embedder=SentenceTransformerEmbedder())
    return root


def test_stats_verify_and_sources_import_no_model_stack(minilm_index: Path) -> None:
    from ragbudget.cli.commands import cli

    for command in ("stats", "verify", "sources"):
        if command not in cli.commands:  # `sources` arrives with the index work (issue #19)
            continue
        code, modules, out = run_cli(command, "--index-dir", str(minilm_index / "idx"))
        assert code == 0, out
        assert loaded(modules, MODEL_STACK) == [], command
        assert loaded(modules, GENERATOR) == [], command


def test_index_with_nothing_to_embed_does_not_load_the_embedder(minilm_index: Path, tmp_path: Path) -> None:
    # An unchanged folder: every file costs a stat.
    code, modules, out = run_cli("index", str(minilm_index / "docs"), "--index-dir", str(minilm_index / "idx"))
    assert code == 0 and "0 embedded" in out, out
    assert loaded(modules, MODEL_STACK) == []
    # A new index of an empty folder: its manifest needs the embedder's dimension, read from the
    # model's config files (this loaded sentence-transformers and torch, ~10 s, before).
    empty = tmp_path / "empty"
    empty.mkdir()
    code, modules, out = run_cli("index", str(empty), "--index-dir", str(tmp_path / "idx"))
    assert code == 0 and "0 in index" in out, out
    assert loaded(modules, MODEL_STACK) == []
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["dim"] == 384 and manifest["embedder"]["max_tokens"] == 252
    assert manifest["embedder"]["kind"] == "sentence-transformers"


def test_search_embeds_the_query_without_torch_and_never_loads_the_generator(minilm_index: Path) -> None:
    code, modules, out = run_cli(
        "search", "what happens when the read end is closed", "--json", "--index-dir", str(minilm_index / "idx")
    )
    assert code == 0, out
    assert loaded(modules, MODEL_STACK) == []
    assert loaded(modules, GENERATOR) == []
    hits: list[dict[str, Any]] = json.loads(out[: out.rindex("\nMODULES")])
    assert hits and "SIGPIPE" in hits[0]["text"]
    # Dense only: the score is the cosine with the query vector the light path computed, equal to
    # what sentence-transformers gives for the same query (to float32 rounding).
    code, modules, out = run_cli(
        "search",
        "what happens when the read end is closed",
        "--json",
        "--retrieval",
        "dense",
        "--index-dir",
        str(minilm_index / "idx"),
    )
    assert code == 0 and loaded(modules, MODEL_STACK) == [], out
    from ragbudget.retrieval.embed import SentenceTransformerEmbedder

    full = SentenceTransformerEmbedder(light=False)
    q = full.embed_query("what happens when the read end is closed")
    import numpy as np

    from ragbudget.retrieval.index import Index

    idx = Index.open(minilm_index / "idx")
    want = idx.search("what happens when the read end is closed", k=1, embedder=full, hybrid=False)[0]
    got = json.loads(out[: out.rindex("\nMODULES")])[0]
    assert got["chunk_id"] == want.chunk_id
    assert abs(got["score"] - want.score) < 1e-5
    assert np.isclose(np.linalg.norm(q), 1.0, atol=1e-6)
