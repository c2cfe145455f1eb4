"""ragbudget.retrieval.chunk_vectors: a run's vectors come from the cheapest place that has them — the
previous generation (a rebuild with the same embedder), the checkpoint of a killed run — before
the embedder."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _corpus import OPTS, _twin_corpus, build, write_corpus

from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Index


@pytest.fixture
def ix(tmp_path: Path) -> Index:
    return Index(tmp_path / "ix")


_KILLED_CHILD = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import _corpus as t
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Index

class Dies(HashEmbedder):
    calls = 0
    def embed(self, texts, **kw):
        Dies.calls += 1
        if Dies.calls == 3:  # two batches are embedded and checkpointed, the third never ends
            os.kill(os.getpid(), signal.SIGKILL)
        return super().embed(texts, **kw)

Index({ix!r}).build([{corpus!r}], embedder=Dies(dim=256), embed_batch=8, **t.OPTS)
"""


def test_killed_first_build_resumes_without_re_embedding(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=12)
    ixdir = tmp_path / "ix"
    code = _KILLED_CHILD.format(tests=str(Path(__file__).parent), ix=str(ixdir), corpus=str(corpus))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert not (ixdir / "manifest.json").exists() and (ixdir / "embed.checkpoint").is_file()
    s = build(Index(ixdir), corpus, embed_batch=8)
    assert s.chunks_resumed == 16 and s.chunks_reused == 16
    assert s.chunks_embedded == s.chunks_total - 16 > 0
    assert not (ixdir / "embed.checkpoint").exists()  # spent once committed
    clean = tmp_path / "clean"
    ref = build(Index(clean), corpus, embed_batch=8)
    assert ref.chunks_total == s.chunks_total
    got, want = Index.open(ixdir), Index.open(clean)
    assert got.verify().ok
    ids = range(1, s.chunks_total + 1)
    assert [h.to_dict() for h in got.get_chunks(ids)] == [h.to_dict() for h in want.get_chunks(ids)]
    for i in ids:
        assert np.array_equal(got.generation.exact.vectors([i]), want.generation.exact.vectors([i]))


def test_checkpoint_of_another_embedder_is_dropped(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=3)
    ixdir = tmp_path / "ix"
    code = _KILLED_CHILD.format(tests=str(Path(__file__).parent), ix=str(ixdir), corpus=str(corpus))
    code = code.replace("embed_batch=8", "embed_batch=2")
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (ixdir / "embed.checkpoint").is_file()
    s = Index(ixdir).build([str(corpus)], embedder=HashEmbedder(dim=64), embed_batch=2, **OPTS)
    assert s.chunks_resumed == 0 and s.chunks_embedded == s.chunks_total
    assert not (ixdir / "embed.checkpoint").exists()


@pytest.mark.parametrize(("first", "then"), [("none", "exact"), ("exact", "none"), ("none", "near")])
def test_changing_dedup_reuses_every_vector(ix: Index, tmp_path: Path, first: str, then: str) -> None:
    corpus = _twin_corpus(tmp_path / "c")
    build(ix, corpus, dedup=first)
    s = build(ix, corpus, dedup=then, rechunk=True)
    assert s.rebuilt and "dedup" in s.rebuild_reason
    assert s.chunks_embedded == 0 and s.chunks_reused == s.chunks_added
    assert Index.open(ix.path).verify().ok
