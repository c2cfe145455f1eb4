"""ragbudget.retrieval.copy: an index copied between a local folder and PostgreSQL (a real
server, tests/_postgres.py) answers as the original does in exact mode, with nothing re-embedded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _corpus import EMB, build, write_corpus

from ragbudget.retrieval.copy import copy_index
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Index
from ragbudget.retrieval.storage import open_storage

QUESTIONS = ["marker1zz", "marker4zz ka", "lolo suba zefi", "the unique marker appears"]


class Refuses(HashEmbedder):
    """An embedder that must not be asked: a copy embeds nothing."""

    def embed(self, texts, **kw):  # type: ignore[no-untyped-def]
        raise AssertionError("the copy embedded something")


def answers(ix: Index) -> list[list[tuple[float, str, tuple[str, ...]]]]:
    """Each question's hits (score, text, sources); hits of equal score in text order (the hash
    embedder gives many exact ties, which two stores may list in either order)."""
    out = []
    for q in QUESTIONS:
        found = [
            (round(h.score, 5), h.text, tuple(s.path for s in h.sources)) for h in ix.search(q, k=60, embedder=EMB)
        ]
        out.append(sorted(found, key=lambda t: (-t[0], t[1])))
    return out


@pytest.mark.parametrize("direction", ["local-to-pg", "pg-to-local"])
def test_a_copy_answers_as_the_original_and_embeds_nothing(direction: str, pg_url: str, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=6)
    local = str(tmp_path / "ix")
    src, dst = (local, pg_url) if direction == "local-to-pg" else (pg_url, local)
    build(Index(src), corpus, sentence_vectors=True)
    (corpus / "doc5.txt").unlink()
    build(Index(src), corpus)  # a second generation, with a gap in the chunk ids
    m = copy_index(open_storage(src), open_storage(dst))
    assert m["copied_from"]["generation"] == 2
    a, b = Index.open(src), Index.open(dst)
    assert answers(a) == answers(b)
    assert [f.path for f in a.sources()] == [f.path for f in b.sources()] and a.roots() == b.roots()
    assert b.verify().ok and b.stats()["chunks"] == a.stats()["chunks"]
    assert b.has_sentence_vectors
    ids_a = a.generation.catalog.chunk_ids()
    assert sum(len(v[0]) for v in b.sentence_vectors(b.generation.catalog.chunk_ids()).values()) == sum(
        len(v[0]) for v in a.sentence_vectors(ids_a).values()
    )
    # The copy is a real index: an unchanged run over it embeds nothing and writes nothing.
    again = Index(dst).build([str(corpus)], embedder=Refuses(dim=256), min_tokens=20, max_tokens=60)
    assert not again.committed and again.chunks_embedded == 0
    # ...and a changed file re-embeds its chunks only.
    (corpus / "doc0.txt").write_text((corpus / "doc1.txt").read_text() + "\nExtra line zzextrazz here.\n")
    third = build(Index(dst), corpus)
    assert third.committed and 0 < third.chunks_embedded < third.chunks_total
    assert np.isfinite([h.score for h in Index(dst).search("zzextrazz", k=1, embedder=EMB)]).all()


def test_cli_copy_keeps_the_destinations_previous_generation(pg_url: str, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=3)
    other = write_corpus(tmp_path / "other", n=2, start_seed=40)
    build(Index(tmp_path / "ix"), corpus)
    build(Index(pg_url), other)
    reader = Index.open(pg_url)
    before = [f.path for f in reader.sources()]
    run = subprocess.run(
        [sys.executable, "-m", "ragbudget", "copy", str(tmp_path / "ix"), pg_url, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["generation"] == 2 and out["copied_from"]["generation"] == 1
    assert [f.path for f in reader.sources()] == before  # an open reader keeps generation 1
    assert [f.path for f in Index.open(pg_url).sources()] == ["corpus/doc0.txt", "corpus/doc1.txt", "corpus/doc2.txt"]


@pytest.mark.parametrize("direction", ["to-db", "from-db"])
def test_a_copy_keeps_each_files_furniture_count(direction: str, pg_url: str, tmp_path: Path) -> None:
    """The man pages and the PDF of data/ lose header/footer lines to cleaning: their file rows
    count them, and a copy carries each count over (it re-reads no file to count them again)."""
    data = Path(__file__).resolve().parents[1] / "data"
    local = tmp_path / "ix"
    src, dst = (local, pg_url) if direction == "to-db" else (pg_url, str(tmp_path / "back"))
    build(Index(src), data)
    want = {f.path: f.furniture for f in Index.open(src).generation.catalog.files()}
    assert sum(1 for n in want.values() if n > 0) >= 2, want
    copy_index(open_storage(src), open_storage(dst))
    got = {f.path: f.furniture for f in Index.open(dst).generation.catalog.files()}
    assert got == want
