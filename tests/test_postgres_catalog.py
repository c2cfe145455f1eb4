"""ragbudget.retrieval.postgres_catalog: an index's catalog as versioned rows in PostgreSQL, on a
real server (tests/_postgres.py): hostile file names and texts stored as they are (every statement
parameterised), NUL bytes removed with a note, edits copied into the new generation."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from _corpus import EMB, build, make_text, write_corpus

from ragbudget.retrieval.index import Index

HOSTILE = [
    "it's",
    "back\\slash",
    "'; DROP TABLE ragbudget.chunks; --",
    '"; DROP SCHEMA ragbudget CASCADE; --',
    "$$ dollar $$",
    "%s %(g)s {s}",
]


def rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql).fetchall()  # type: ignore[arg-type]


def test_hostile_file_names_and_texts_are_stored_as_they_are(pg_url: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for n, word in enumerate(HOSTILE):
        (corpus / f"{word.replace('/', '_')}.txt").write_text(
            f"{make_text(n, n_paragraphs=2)}\nThe token zz{n}zz says {word} here.\n"
        )
    pg, local = Index(pg_url), Index(tmp_path / "ix")
    build(pg, corpus)
    build(local, corpus)
    assert [f.path for f in pg.sources()] == [f.path for f in local.sources()]
    assert len(pg.sources()) == len(HOSTILE)
    for n, word in enumerate(HOSTILE):
        (hit,) = pg.search_lexical(f"zz{n}zz", k=1)
        assert word in hit.text and hit.sources[0].path.endswith(f"{word}.txt")
        # Lexical search treats the hostile text as words, never as SQL or query syntax.
        pg.search_lexical(word, k=2)
        pg.search(word, k=2, embedder=EMB, hybrid=True)
    assert rows(pg_url, "SELECT COUNT(*) FROM ragbudget.chunks")[0][0] > 0
    assert pg.verify().ok


def test_nul_bytes_are_removed_with_a_note(pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The loaders already drop NUL bytes (a text file with one early is skipped as binary); the
    catalog removes any that reach it, with a note, since PostgreSQL text cannot hold them."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "nul.txt").write_text(make_text(1, n_paragraphs=60) + "\nA nul\x00byte sits in zznulzz.\n")
    s = build(Index(pg_url), corpus)
    assert s.committed and not s.skipped
    (hit,) = Index(pg_url).search_lexical("zznulzz", k=1)
    assert "nulbyte" in hit.text
    storage = Index(pg_url).storage
    with storage.lock(), caplog.at_level(logging.WARNING, logger="ragbudget.retrieval.postgres_catalog"):
        writer = storage.begin(None, keep=False)
        try:
            cid = writer.catalog.add_chunk("one\x00two", 2, ["head\x00ing"], "h", None)
            writer.catalog.record_file("/x/f.txt", 1, 1, None, "skipped", "binary", "NUL\x00 here")
            assert writer.catalog.chunks([cid])[cid].text == "onetwo"
            # Headings are stored as JSON, which escapes a NUL: kept as it was.
            assert writer.catalog.chunks([cid])[cid].headings == ("head\x00ing",)
        finally:
            writer.close()  # rolled back: nothing of it is visible
    assert "removed NUL bytes from a chunk text" in caplog.text
    assert Index(pg_url).search_lexical("onetwo", k=1) == []


def test_an_edit_copies_the_row_into_the_new_generation_and_old_rows_are_collected(pg_url: str, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=3)
    build(Index(pg_url), corpus)
    doc = corpus / "doc0.txt"
    doc.write_text(doc.read_text())  # same content, new mtime: the files row is edited
    import os

    os.utime(doc, ns=(1, 1))
    s = build(Index(pg_url), corpus)
    assert s.committed and s.generation == 2 and s.chunks_embedded == 0
    got = rows(pg_url, "SELECT gen_from, gen_to, mtime_ns FROM ragbudget.files WHERE path LIKE '%doc0.txt' ORDER BY 1")
    assert got[0][:2] == (1, 2) and got[1] == (2, None, 1)  # generation 1 still has its row
    os.utime(doc, ns=(2, 2))
    build(Index(pg_url), corpus)
    got = rows(pg_url, "SELECT gen_from, gen_to, mtime_ns FROM ragbudget.files WHERE path LIKE '%doc0.txt' ORDER BY 1")
    assert got == [(2, 3, 1), (3, None, 2)]  # generation 1's row is gone: neither 3 nor 2 sees it
    assert Index(pg_url).verify().ok
