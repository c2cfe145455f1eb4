"""bench/answers.py --peers-from: the peers' answers of an earlier raw result are taken only when
nothing they depend on changed (their script and environment in git, the split, documents, model,
answer cap). No model, no engine: the raw result and a git repository are written here."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _bench import load_bench

answers = load_bench("answers.py", "bench_answers_peers_from", shadowed=("_llama",))


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A repository holding the peers' code, committed once; the bench reads git there."""
    root = tmp_path / "repo"
    for rel in answers.PEER_CODE:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("peers v1\n", encoding="utf-8")
    _git(root.parent, "init", "-q", str(root))
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "peers")
    monkeypatch.setattr(answers.H, "ROOT", root)
    return root


def _raw(tmp_path: Path, commit: str, **over: Any) -> Path:
    cells = [
        {"system": "langchain", "budget": 256, "qid": "q1", "answer": "Warsaw", "contexts": []},
        {"system": "llamaindex", "budget": 2048, "qid": "q1", "answer": None, "error": "time-out"},
        {"system": "ragbudget", "budget": 256, "qid": "q1", "answer": "Warsaw [1]", "contexts": []},
    ]
    raw = {
        "versions": {"ragbudget_commit": commit},
        "split": "squad-test",
        "documents_indexed": ["Warsaw", "Nobel Prize"],
        "model": "qwen.gguf",
        "max_new_tokens": 64,
        "cells": cells,
        **over,
    }
    path = tmp_path / "raw.json"
    path.write_text(json.dumps(raw), encoding="utf-8")
    return path


def _docs(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    for title in ("Warsaw", "Nobel Prize"):
        (docs / f"{answers.doc_stem(title)}.md").write_text(f"# {title}\n", encoding="utf-8")
    return docs


ARGS = argparse.Namespace(split="squad-test", max_new_tokens=64)


def test_the_peers_answers_are_taken_when_nothing_they_depend_on_changed(repo: Path, tmp_path: Path) -> None:
    raw = _raw(tmp_path, _git(repo, "rev-parse", "--short", "HEAD"))
    got = answers.earlier_peer_cells(raw, ARGS, _docs(tmp_path), "/models/qwen.gguf")
    # The peers' answered cells only: not ragbudget's, not a failed one.
    assert [(c["system"], c["budget"], c["qid"]) for c in got] == [("langchain", 256, "q1")]


def test_changed_peer_code_or_other_material_is_refused(repo: Path, tmp_path: Path) -> None:
    commit = _git(repo, "rev-parse", "--short", "HEAD")
    docs = _docs(tmp_path)
    for other in ({"max_new_tokens": 32}, {"model": "other.gguf"}, {"documents_indexed": ["Warsaw"]}):
        with pytest.raises(SystemExit, match="other split, documents, model"):
            answers.earlier_peer_cells(_raw(tmp_path, commit, **other), ARGS, docs, "/models/qwen.gguf")
    with pytest.raises(SystemExit, match="other split"):  # a chat run's peers answer with history
        answers.earlier_peer_cells(_raw(tmp_path, commit), ARGS, docs, "/models/qwen.gguf", chat=True)
    # answers_chat.py's raw result: its documents are story files, its mode says chat
    chat_raw = _raw(tmp_path, commit, mode="chat: CoQA follow-ups", documents_indexed=["Warsaw.md", "Nobel_Prize.md"])
    with pytest.raises(SystemExit, match="other split"):
        answers.earlier_peer_cells(chat_raw, ARGS, docs, "/models/qwen.gguf")
    assert answers.earlier_peer_cells(chat_raw, ARGS, docs, "/models/qwen.gguf", chat=True)  # was always refused
    with pytest.raises(SystemExit, match="uncommitted changes"):
        answers.earlier_peer_cells(_raw(tmp_path, commit + "+dirty"), ARGS, docs, "/models/qwen.gguf")
    (repo / answers.PEER_CODE[0]).write_text("peers v2\n", encoding="utf-8")  # changed, not committed
    with pytest.raises(SystemExit, match=r"peers' code changed since .*answers_peers\.py"):
        answers.earlier_peer_cells(_raw(tmp_path, commit), ARGS, docs, "/models/qwen.gguf")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", "v2")  # and committed
    with pytest.raises(SystemExit, match="peers' code changed"):
        answers.earlier_peer_cells(_raw(tmp_path, commit), ARGS, docs, "/models/qwen.gguf")
    with pytest.raises(SystemExit, match="peers' code changed"):  # a commit git does not know
        answers.earlier_peer_cells(_raw(tmp_path, "0000000"), ARGS, docs, "/models/qwen.gguf")


def test_a_scoped_run_and_an_unscoped_one_never_share_answers(repo: Path, tmp_path: Path) -> None:
    # --scoped asks each question of its own file: the peers' (and ragbudget's) answers differ.
    commit = _git(repo, "rev-parse", "--short", "HEAD")
    docs = _docs(tmp_path)
    scoped = argparse.Namespace(**vars(ARGS), scoped=True)
    with pytest.raises(SystemExit, match="scope"):
        answers.earlier_peer_cells(_raw(tmp_path, commit), scoped, docs, "/models/qwen.gguf")
    with pytest.raises(SystemExit, match="scope"):
        answers.earlier_peer_cells(_raw(tmp_path, commit, scoped=True), ARGS, docs, "/models/qwen.gguf")
    assert answers.earlier_peer_cells(_raw(tmp_path, commit, scoped=True), scoped, docs, "/models/qwen.gguf")
    gguf = tmp_path / "qwen.gguf"
    gguf.write_bytes(b"GGUF")
    run = {"split": "amazon", "model": str(gguf), "max_new_tokens": 64, "threads": 2, "slots": 1, "timeout": 600}
    keys = {answers.ragbudget_cache(argparse.Namespace(**run, scoped=flag), ["a"], answers.ask_once) for flag in (0, 1)}
    assert len(keys) == 2 or keys == {None}  # None: ragbudget/ has uncommitted changes, nothing kept
