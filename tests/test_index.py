"""ragbudget.retrieval.index, the reader: search (dense, lexical, hybrid; hostile queries), chunks and
their neighbours, sources, stats, verify. (Writing runs are in test_build.py, test_changes.py and
test_chunk_vectors.py; generations, locks and corruption in test_storage.py.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from _corpus import (
    _tamper_sqlite,
    build,
    write_corpus,
)
from hypothesis import settings, strategies as st

from ragbudget.errors import (
    ConfigError,
    IndexMismatchError,
    IndexNotFoundError,
)
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Hit, Index


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture
def ix(tmp_path: Path) -> Index:
    return Index(tmp_path / "ix")


def test_build_search_and_summary(ix: Index, corpus: Path) -> None:
    s = build(ix, corpus)
    assert s.committed and s.generation == 1 and not s.rebuilt
    assert s.files_seen == 6 and s.files_indexed == 6
    assert s.chunks_total == s.chunks_added == s.chunks_embedded > 6
    json.dumps(s.to_dict())  # JSON-able for the CLI
    hits = Index.open(ix.path).search("marker3zz", k=3)
    assert hits and isinstance(hits[0], Hit)
    assert hits[0].sources[0].path == "corpus/doc3.txt"  # relative to the root, labelled by it
    assert "marker3zz" in hits[0].text
    src = hits[0].sources[0]
    file = Index.open(ix.path).absolute_path(src.path)
    assert file == str((corpus / "doc3.txt").resolve())
    assert Path(file).read_text()[src.start : src.end] == hits[0].text
    assert hits[0].score >= hits[-1].score
    d = hits[0].to_dict()
    assert d["sources"][0]["path"] == src.path and json.dumps(d)
    assert Index.open(ix.path).verify().ok


def test_stats_and_manifest_record_settings(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    st_ = Index.open(ix.path).stats()
    assert st_["embedder"] == "hash-256" and st_["dim"] == 256 and st_["pooling"] == "windows"
    assert st_["chunking"] == {"min_tokens": 20, "max_tokens": 60, "overlap": 0, "tokenizer": "cl100k_base"}
    m = json.loads((ix.path / "manifest.json").read_text())
    for key in ("faiss", "sqlite"):
        f = ix.path / m[key]["file"]
        assert hashlib.sha256(f.read_bytes()).hexdigest() == m[key]["sha256"]
    assert m["format_version"] == 1 and m["counts"]["chunks"] == st_["chunks"]


def test_open_missing_index_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(IndexNotFoundError, match="ragbudget index"):
        Index.open(tmp_path / "nothing")


def test_search_with_other_embedder_is_refused(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    with pytest.raises(IndexMismatchError, match="hash-256"):
        Index.open(ix.path).search("x", embedder=HashEmbedder(dim=32))
    with pytest.raises(ConfigError, match="dimension"):
        Index.open(ix.path).search_vector(np.ones(8, dtype=np.float32))


def test_neighbors_and_chunks_of(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    idx = Index.open(ix.path)
    path = str((corpus / "doc0.txt").resolve())
    seq = idx.chunks_of(path)
    assert len(seq) >= 3 and [s.start for s, _ in seq] == sorted(s.start for s, _ in seq)
    prev, nxt = idx.neighbors(seq[1][1])
    assert prev is not None and prev.chunk_id == seq[0][1]
    assert nxt is not None and nxt.chunk_id == seq[2][1]
    assert idx.neighbors(seq[0][1])[0] is None


def test_hnsw_option_matches_flat_on_small_index(ix: Index, corpus: Path) -> None:
    build(ix, corpus, store="hnsw")
    approx = Index.open(ix.path)
    flat = Index.open(ix.path, use_approx=False)
    assert approx.stats()["approx"] == "hnsw" and approx.verify().ok
    for q in ("marker1zz", "kaba lode mifi", "unique marker"):
        a, f = approx.search(q, k=3), flat.search(q, k=3)
        assert a[0].chunk_id == f[0].chunk_id
        # Lower ranks may tie (hash vectors); the scores must still agree.
        assert np.allclose([h.score for h in a], [h.score for h in f], atol=1e-5)


def test_sources_lists_files_with_chunk_counts(ix: Index, corpus: Path) -> None:
    (corpus / "blob.bin").write_bytes(b"\x00\x01" * 50)
    (corpus / "paged.txt").write_text("first page text here\fsecond page text here\f")
    build(ix, corpus)
    files = {f.path: f for f in Index.open(ix.path).sources()}
    assert files["corpus/doc0.txt"].status == "indexed" and files["corpus/doc0.txt"].chunks >= 3
    assert files["corpus/doc0.txt"].pages is None
    assert files["corpus/paged.txt"].pages == 2
    assert files["corpus/blob.bin"].status == "skipped" and files["corpus/blob.bin"].reason == "unsupported"


def test_verify_detects_id_mapping_problems(ix: Index, corpus: Path) -> None:
    """Checksums pass but the content is inconsistent (a buggy writer): verify says so."""
    build(ix, corpus)
    _tamper_sqlite(ix, "DELETE FROM chunks WHERE id = (SELECT MIN(id) FROM chunks)")
    report = Index.open(ix.path).verify()
    assert not report.ok
    assert any("without a chunk row" in p for p in report.problems)
    assert any("pointing at no chunk" in p for p in report.problems)


HOSTILE = [
    '"',
    '""',
    "'",
    'he said "hi',
    "AND",
    "OR NOT",
    "NEAR(a b, 2)",
    "*",
    "a*",
    "^start",
    "text: foo",
    "col:x OR",
    "(((",
    ")",
    "- -",
    "\\",
    "\x00",
    "",
    "   ",
    "?!",
    "🙂 émigré",
    'marker3zz" OR "x',
    "SELECT * FROM chunks; --",
    "{a b}",
    "a + b",
    "NOT marker3zz",
]


def test_hostile_queries_never_raise(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    o = Index.open(ix.path)
    for q in HOSTILE:
        assert isinstance(o.search_lexical(q, k=3), list)
        if q.strip():
            assert isinstance(o.search(q, k=3, hybrid=True), list)
    assert o.search_lexical('NOT marker3zz"', k=1)[0].text.count("marker3zz") == 1


@pytest.mark.parametrize("fusion", ["rrf", "score"])
def test_random_text_queries_never_raise(tmp_path_factory: pytest.TempPathFactory, fusion: str) -> None:
    import math

    from hypothesis import given

    root = tmp_path_factory.mktemp("fz")
    ix = Index(root / "ix")
    build(ix, write_corpus(root / "c", n=2))
    o = Index.open(ix.path)

    @settings(max_examples=200, deadline=None)
    @given(st.text(max_size=60))
    def run(q: str) -> None:
        hits = o.search_lexical(q, k=3)
        assert all(math.isfinite(h.score) for h in hits)
        if q.strip():
            assert all(math.isfinite(h.score) for h in o.search(q, k=3, hybrid=True, fusion=fusion))

    run()


def test_hybrid_search_finds_and_scores(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    o = Index.open(ix.path)
    assert o.has_lexical and o.stats()["lexical"] == "sqlite-fts5"
    lex = o.search_lexical("marker4zz", k=3)
    assert lex and "marker4zz" in lex[0].text and lex[0].score > 0
    dense = o.search("marker4zz", k=10)
    for fusion in ("rrf", "score"):
        hyb = o.search("marker4zz", k=10, hybrid=True, fusion=fusion)
        assert "marker4zz" in hyb[0].text
        assert [h.score for h in hyb] == sorted((h.score for h in hyb), reverse=True)
        # Fused scores stay on the dense cosine scale (selection's temperature assumes it).
        lo, hi = min(h.score for h in dense), max(h.score for h in dense)
        assert all(lo - 1e-6 <= h.score <= hi + 1e-6 for h in hyb)
    # lexical_weight=0 or hybrid=False: the dense search exactly.
    assert [h.chunk_id for h in o.search("marker4zz", k=10, hybrid=True, lexical_weight=0)] == [
        h.chunk_id for h in dense
    ]
    with pytest.raises(ConfigError):
        o.search("x", hybrid=True, fusion="max")
    with pytest.raises(ConfigError):
        o.search("x", hybrid=True, lexical_weight=1.5)
