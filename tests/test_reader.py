"""ragbudget.retrieval.reader: a long-running reader follows a writer's commits (the next search
answers from the newest generation, no restart, no reload), a call in flight keeps the one
generation it pinned across any number of commits, an old generation closes when its last call
ends, and a generation written with another embedder is not followed."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

import pytest
from _corpus import build, make_text, write_corpus
from _fakes import fake_pipeline

from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Index


def texts(ix: Index, query: str) -> list[str]:
    return [h.text for h in ix.search(query, k=3)]


def test_a_reader_follows_two_commits_without_reload(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=4)
    build(Index(tmp_path / "ix"), corpus)
    reader = Index.open(tmp_path / "ix")
    assert any("marker1zz" in t for t in texts(reader, "marker1zz"))
    assert reader.follow() is False  # nothing committed since: it stays

    for n, word in ((2, "second2zz"), (3, "third3zz")):
        (corpus / "doc1.txt").write_text(make_text(100 + n, unique=word))
        assert build(Index(tmp_path / "ix"), corpus).generation == n
        assert any(word in t for t in texts(reader, word)), n  # the next search follows
        assert reader.manifest["generation"] == reader.generation.number == n
    assert not any("marker1zz" in t for t in texts(reader, "marker1zz"))


def test_a_pinned_call_keeps_its_generation_while_others_follow(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=4)
    build(Index(tmp_path / "ix"), corpus)
    reader = Index.open(tmp_path / "ix")
    before = texts(reader, "marker2zz")
    pinned, release, seen = threading.Event(), threading.Event(), {}

    def long_request() -> None:
        with reader.pinned() as gen:
            seen["first"] = texts(reader, "marker2zz")
            pinned.set()
            assert release.wait(30)
            seen["last"] = texts(reader, "marker2zz")  # after two commits, same generation
            seen["number"] = gen.number
            seen["gen"] = gen

    t = threading.Thread(target=long_request)
    t.start()
    assert pinned.wait(30)
    (corpus / "doc2.txt").unlink()
    build(Index(tmp_path / "ix"), corpus)
    (corpus / "doc0.txt").write_text(make_text(7, unique="fresh0zz"))
    build(Index(tmp_path / "ix"), corpus)
    # Meanwhile this thread follows: generation 3, without doc2.
    assert any("fresh0zz" in x for x in texts(reader, "fresh0zz"))
    assert not any("marker2zz" in x for x in texts(reader, "marker2zz"))
    release.set()
    t.join(30)
    assert seen["first"] == seen["last"] == before and seen["number"] == 1
    # The pinned generation closed when its call ended (its files are the writer's to remove).
    with pytest.raises(sqlite3.ProgrammingError):
        seen["gen"].catalog.chunks([1])


def test_another_embedders_generation_is_not_followed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=3)
    build(Index(tmp_path / "ix"), corpus)
    reader = Index.open(tmp_path / "ix")
    before = texts(reader, "marker0zz")
    build(Index(tmp_path / "ix"), corpus, embedder=HashEmbedder(dim=128), rebuild=True)
    with caplog.at_level(logging.WARNING, logger="ragbudget"):
        assert texts(reader, "marker0zz") == before  # queries embedded for the space it opened
        assert texts(reader, "marker0zz") == before
    warned = [r.getMessage() for r in caplog.records if "restart it" in r.getMessage()]
    assert len(warned) == 1 and "generation 2" in warned[0], warned  # said once, not per request
    assert reader.manifest["generation"] == 1
    reader.reload()  # an explicit reload opens it
    assert reader.manifest["generation"] == 2 and reader.manifest["dim"] == 128


def test_a_pipelines_answers_cite_the_generation_they_searched_across_reindexes(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=4)
    build(Index(tmp_path / "ix"), corpus)
    pipe = fake_pipeline(index_dir=tmp_path / "ix")
    first = pipe.ask("marker3zz", max_new_tokens=4)
    assert first.report["index"] == {"generation": 1}
    for n, word in ((2, "second3zz"), (3, "third3zz")):
        (corpus / "doc3.txt").write_text(make_text(200 + n, unique=word))
        build(Index(tmp_path / "ix"), corpus)
        answer = pipe.ask(word, max_new_tokens=4)
        assert answer.report["index"] == {"generation": n}
        assert any(word in h.text for h in pipe.retrieve(word).chunks), n
        assert any(word in h.text for h in pipe.search(word, k=2)), n
