"""ragbudget.retrieval.catalog: a generation's SQLite catalog, its FTS5 table (absent, stale, or
without FTS5 in this Python) and its consistency checks."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from _corpus import (
    _current,
    _tamper_sqlite,
    build,
    make_text,
    write_corpus,
)

from ragbudget.retrieval.index import Index
from ragbudget.retrieval.lexical import set_fts5


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture
def ix(tmp_path: Path) -> Index:
    return Index(tmp_path / "ix")


def _strip_fts(ix: Index) -> None:
    """Make the current generation look like one written before the FTS table existed."""
    import sqlite3

    f = _current(ix, "sqlite")
    con = sqlite3.connect(f)
    for t in ("chunks_fts_ai", "chunks_fts_ad", "chunks_fts_au"):
        con.execute(f"DROP TRIGGER {t}")
    con.execute("DROP TABLE chunks_fts")
    con.commit()
    con.execute("VACUUM")
    con.close()
    m = json.loads((ix.path / "manifest.json").read_text())
    m["sqlite"].update(bytes=f.stat().st_size, sha256=hashlib.sha256(f.read_bytes()).hexdigest())
    m.pop("lexical", None)
    m["counts"].pop("lexical_rows", None)
    (ix.path / "manifest.json").write_text(json.dumps(m))


def test_index_without_fts_table_opens_and_is_upgraded(
    ix: Index, corpus: Path, caplog: pytest.LogCaptureFixture
) -> None:
    build(ix, corpus)
    _strip_fts(ix)
    o = Index.open(ix.path)
    assert not o.has_lexical
    assert o.verify().ok and o.verify().checked["lexical_rows"] is None
    with caplog.at_level("WARNING", logger="ragbudget.retrieval.index"):
        hits = o.search("marker2zz", k=3, hybrid=True)
    assert "marker2zz" in hits[0].text
    assert "without the lexical (FTS5) table" in caplog.text and "ragbudget index" in caplog.text
    assert "marker2zz" in o.search_lexical("marker2zz", k=1)[0].text
    o.close()
    # The next run stores the table even though no file changed; nothing is re-embedded.
    s = build(ix, corpus)
    assert s.committed and s.chunks_embedded == 0 and s.generation == 2
    o = Index.open(ix.path)
    assert o.has_lexical and o.verify().ok
    assert o.verify().checked["lexical_rows"] == o.stats()["chunks"]


@pytest.fixture
def probe_again() -> Iterator[None]:
    """The FTS5 probe overridden by a test (:func:`set_fts5`) is this Python's own again after it."""
    yield
    set_fts5(None)


def test_no_fts5_falls_back_to_dense(
    ix: Index, corpus: Path, probe_again: None, caplog: pytest.LogCaptureFixture
) -> None:
    set_fts5(False)
    with caplog.at_level("WARNING", logger="ragbudget.retrieval.index"):
        build(ix, corpus)
    assert "has no FTS5" in caplog.text
    o = Index.open(ix.path)
    assert o.stats()["lexical"] is None and not o.has_lexical
    assert [h.chunk_id for h in o.search("marker1zz", k=5, hybrid=True)] == [
        h.chunk_id for h in o.search("marker1zz", k=5)
    ]
    assert o.search_lexical("marker1zz") == [] and o.verify().ok
    o.close()


def test_index_updated_without_fts5_is_repaired_by_the_next_run(ix: Index, corpus: Path, probe_again: None) -> None:
    build(ix, corpus)
    set_fts5(False)
    (corpus / "doc0.txt").write_text(make_text(99, unique="fresh7zz"))
    (corpus / "doc1.txt").unlink()
    s = build(ix, corpus)  # a Python without FTS5: triggers dropped, the table goes stale
    assert s.committed and Index.open(ix.path).stats()["lexical"] is None
    set_fts5(None)  # this Python's own SQLite again: FTS5
    o = Index.open(ix.path)
    assert not o.has_lexical  # the stale table is not trusted: built in memory instead
    assert "fresh7zz" in o.search_lexical("fresh7zz", k=1)[0].text
    assert not o.search_lexical("marker1zz", k=1)
    o.close()
    (corpus / "doc2.txt").write_text(make_text(98))
    build(ix, corpus)  # FTS5 again: the table is rebuilt from the chunks
    o = Index.open(ix.path)
    report = o.verify()
    assert o.has_lexical and report.ok and report.checked["lexical_rows"] == report.checked["chunks"]
    assert "fresh7zz" in o.search_lexical("fresh7zz", k=1)[0].text


def test_verify_detects_fts_out_of_sync(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    _tamper_sqlite(
        ix,
        "DELETE FROM chunks_fts WHERE rowid = (SELECT MIN(id) FROM chunks)",
        "INSERT INTO chunks_fts(rowid, text) VALUES (999999, 'stray')",
        "UPDATE chunks_fts SET text = 'changed' WHERE rowid = (SELECT MAX(id) FROM chunks)",
    )
    problems = " | ".join(Index.open(ix.path).verify().problems)
    assert "without a lexical (FTS) row" in problems
    assert "lexical (FTS) row(s) without a chunk row" in problems
    assert "text differs" in problems


def test_a_catalog_written_before_later_columns_and_tables_reads_and_is_upgraded(tmp_path: Path) -> None:
    """A generation's file from before roots, page labels, missing-dependency notes and sentence
    vectors were stored: read as NULLs and empty tables, and a writer's copy gains them."""
    import sqlite3

    from ragbudget.retrieval.catalog import SourceRow, SqliteCatalog, SqliteCatalogWriter

    old = tmp_path / "meta.1.sqlite"
    con = sqlite3.connect(old)
    con.executescript(
        """
        CREATE TABLE chunks (id INTEGER PRIMARY KEY, text TEXT NOT NULL, n_tokens INTEGER NOT NULL,
            headings TEXT NOT NULL DEFAULT '[]', content_hash TEXT NOT NULL, minhash BLOB,
            windows INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE sources (chunk_id INTEGER NOT NULL, path TEXT NOT NULL, start INTEGER NOT NULL,
            "end" INTEGER NOT NULL, page_start INTEGER, page_end INTEGER, ord INTEGER NOT NULL);
        CREATE TABLE files (path TEXT PRIMARY KEY, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL,
            sha256 TEXT, status TEXT NOT NULL, reason TEXT, detail TEXT,
            n_chunks INTEGER NOT NULL DEFAULT 0, furniture INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO chunks VALUES (1, 'the tide tables', 3, '["Harbour"]', 'h1', NULL, 1);
        INSERT INTO sources VALUES (1, '/docs/tides.txt', 0, 15, NULL, NULL, 0);
        INSERT INTO files VALUES ('/docs/tides.txt', 15, 7, 'x', 'indexed', NULL, NULL, 1, 0);
        INSERT INTO meta VALUES ('generation', '1');
        """
    )
    con.commit()
    con.close()
    cat = SqliteCatalog.open(old, 1)
    assert cat.roots() == [] and cat.page_labels() == {}
    assert cat.sentence_vectors([1], dim=4, dtype="float16") == {} and cat.all_sentence_vectors(4) == {}
    (row,) = cat.files()
    assert (row.path, row.n_chunks, row.n_pages, row.warning) == ("/docs/tides.txt", 1, None, None)
    assert cat.file_states()["/docs/tides.txt"].needs is None
    assert cat.sources([1]) == {1: [SourceRow("/docs/tides.txt", 0, 15, None, None)]}
    assert cat.find_chunk("nope", "h1") == (1, 1)
    cat.close()
    with pytest.raises(Exception, match="generation 1, the manifest names 2"):
        SqliteCatalog.open(old, 2)
    new = SqliteCatalogWriter.create(tmp_path / "meta.2.sqlite.tmp", copy_of=old)
    new.record_file("/docs/new.docx", 9, 9, None, "skipped", "missing_dependency", "no docx", needs="docx")
    assert new.file_states()["/docs/new.docx"].needs == "docx"
    assert new.kept_chunks().__next__() == (1, "h1", None)
    new.finish(2)
    assert SqliteCatalog.open(tmp_path / "meta.2.sqlite.tmp", 2).roots() == []
