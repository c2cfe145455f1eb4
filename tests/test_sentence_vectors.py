"""Sentence vectors stored at index build time for span packing (issue #18's cold cost): written in
the same generation as the chunk vectors, kept in step by incremental runs, read by
:class:`~ragbudget.packing.spans.SpanScorer` so a question embeds no sentence; an index without them still
works (sentences embedded on first use) and gains them on its next write.

Model-free: :class:`HashEmbedder`, small chunks.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from _corpus import OPTS, make_text, write_corpus
from _fakes import FakeBackend
from _tiny_lm import tiny_tokenizer

from ragbudget.fitting import build_prompt
from ragbudget.packing.spans import SpanScorer, sentence_digest, sentence_texts
from ragbudget.pipeline import Pipeline
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Index

DIM = 64


class Counting(HashEmbedder):
    """A HashEmbedder (same id, same vectors) that counts the document texts it embeds."""

    def __init__(self) -> None:
        super().__init__(dim=DIM)
        self.documents = 0

    def embed_documents(self, texts, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.documents += len(texts)
        return super().embed_documents(texts, *args, **kwargs)


class Calls(HashEmbedder):
    """A HashEmbedder (same id, same vectors) that records every call made to it."""

    def __init__(self) -> None:
        super().__init__(dim=DIM)
        self.calls: list[tuple[str, int]] = []

    def embed_query(self, text):  # type: ignore[no-untyped-def]
        self.calls.append(("query", 1))
        return super().embed_query(text)

    def embed_documents(self, texts, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls.append(("documents", len(texts)))
        return super().embed_documents(texts, *args, **kwargs)


def build(ix: Index, corpus: Path, emb: HashEmbedder | None = None, **kw: object):
    """A build that stores sentence vectors (``sentence_vectors=True``, not the default any more:
    see the question-time cache tests at the bottom) unless ``kw`` says otherwise."""
    opts = {**OPTS, "sentence_vectors": True, **kw}
    return ix.build([str(corpus)], embedder=emb or HashEmbedder(dim=DIM), **opts)  # type: ignore[arg-type]


def rows(ix: Index) -> dict[int, tuple[bytes, bytes]]:
    m = json.loads((ix.path / "manifest.json").read_text())
    with sqlite3.connect(ix.path / m["sqlite"]["file"]) as db:
        return {cid: (d, v) for cid, d, v in db.execute("SELECT chunk_id, digests, vectors FROM sentence_vectors")}


def chunk_texts(ix: Index) -> dict[int, str]:
    m = json.loads((ix.path / "manifest.json").read_text())
    with sqlite3.connect(ix.path / m["sqlite"]["file"]) as db:
        return dict(db.execute("SELECT id, text FROM chunks"))


def strip_sentence_vectors(ix: Index) -> None:
    """Make ``ix`` look written before sentence vectors existed: no table, no manifest entry
    (checksums re-sealed, as that writer would have left them)."""
    m = json.loads((ix.path / "manifest.json").read_text())
    f = ix.path / m["sqlite"]["file"]
    con = sqlite3.connect(f)
    con.execute("DROP TRIGGER chunks_sentences_ad")
    con.execute("DROP TABLE sentence_vectors")
    con.commit()
    con.execute("VACUUM")
    con.close()
    m.pop("sentences")
    m["counts"].pop("sentence_vectors")
    m["sqlite"].update(bytes=f.stat().st_size, sha256=hashlib.sha256(f.read_bytes()).hexdigest())
    (ix.path / "manifest.json").write_text(json.dumps(m))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture
def ix(tmp_path: Path) -> Index:
    return Index(tmp_path / "ix")


def test_build_stores_every_chunks_sentences_with_the_index_embedder(ix: Index, corpus: Path) -> None:
    s = build(ix, corpus)
    texts, stored = chunk_texts(ix), rows(ix)
    assert set(stored) == set(texts) and s.sentences_embedded > 0
    emb = HashEmbedder(dim=DIM)
    got = Index.open(ix.path).sentence_vectors(list(texts))
    for cid, text in texts.items():
        sents = sentence_texts(text)
        digests, vecs = got[cid]
        assert digests == [sentence_digest(x) for x in sents]
        # float16 on disk: the same vectors to ~1e-3.
        np.testing.assert_allclose(vecs, np.asarray(emb.embed_documents(sents)), atol=2e-3)
    m = json.loads((ix.path / "manifest.json").read_text())
    assert m["sentences"]["dtype"] == "float16" and m["counts"]["sentence_vectors"] == len(texts)
    # A sentence in several chunks (the build's own sentences overlap nowhere here) is embedded once.
    assert s.sentences_embedded <= sum(len(sentence_texts(t)) for t in texts.values())
    assert Index.open(ix.path).verify().ok


def test_a_question_embeds_no_sentence_when_the_index_stored_them(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    question = "Which marker appears only in the third document, marker2zz?"
    # Through the pipeline, as ask/chat/serve run it: its scorer reads the index's vectors.
    emb = Counting()
    pipe = Pipeline(ix.path, backend=FakeBackend(), embedder=emb, pack="spans")
    sel = pipe.retrieve(question, context_tokens=60)
    assert sel.pack == "spans" and sel.chunks and "marker2zz" in sel.text
    assert emb.documents == 0
    # The same selection as embedding every sentence at question time.
    hits = Index.open(ix.path).search(question, k=20, embedder=HashEmbedder(dim=DIM), hybrid=True)
    cold = Counting()
    kw = dict(tokenizer=tiny_tokenizer(), max_prompt_tokens=600, pack="spans", relevance_floor=0.5)
    a = build_prompt(question, hits, span_scorer=SpanScorer(cold), **kw)  # type: ignore[arg-type]
    warm = Counting()
    b = build_prompt(question, hits, span_scorer=SpanScorer(warm, stored=Index.open(ix.path).sentence_vectors), **kw)  # type: ignore[arg-type]
    assert a.selection.chunks and cold.documents > 0 and warm.documents == 0
    assert [c.text for c in a.selection.chunks] == [c.text for c in b.selection.chunks]


def test_a_question_costs_one_embedder_call_the_search_s_vector_scores_the_sentences(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    question = "Which marker appears only in the third document, marker2zz?"
    emb = Calls()
    pipe = Pipeline(ix.path, backend=FakeBackend(), embedder=emb, pack="spans")
    sel = pipe.retrieve(question, context_tokens=60)
    assert sel.pack == "spans" and "marker2zz" in sel.text
    # One query embedding, shared by the search and the span scorer; no sentence embedded.
    assert emb.calls == [("query", 1)]
    # The dense evidence is the same as the scorer embedding the question itself.
    cold = Pipeline(ix.path, backend=FakeBackend(), embedder=HashEmbedder(dim=DIM), pack="spans")
    scorer = cold.span_scorer
    assert scorer is not None
    scorer.remember_query = lambda *a: None  # type: ignore[method-assign]  # it embeds the question itself
    assert cold.retrieve(question, context_tokens=60).text == sel.text
    # A rewritten retrieval query is not the question the sentences are scored against.
    emb.calls.clear()
    pipe.retrieve("an unseen question naming marker2zz", context_tokens=60, retrieval_query="marker2zz")
    assert emb.calls == [("query", 1), ("query", 1)]


def test_an_index_without_sentence_vectors_still_works_and_gains_them_on_its_next_write(
    ix: Index, corpus: Path
) -> None:
    build(ix, corpus)
    strip_sentence_vectors(ix)
    old = Index.open(ix.path)
    assert old.verify().ok and old.sentence_vectors([1, 2]) == {}
    emb = Counting()
    sel = Pipeline(ix.path, backend=FakeBackend(), embedder=emb, pack="spans").retrieve("marker4zz", context_tokens=60)
    assert "marker4zz" in sel.text and emb.documents > 0  # embedded on first use
    # The next write adds them, even with no file changed ...
    s = build(ix, corpus)
    assert s.committed and s.chunks_embedded == 0 and s.sentences_embedded > 0
    assert set(rows(ix)) == set(chunk_texts(ix))
    # ... and the one after that has nothing to do.
    again = build(ix, corpus)
    assert not again.committed and again.sentences_embedded == 0


def test_incremental_runs_keep_sentence_vectors_in_step_with_the_chunks(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    before = rows(ix)
    # A changed file: only its new chunks' sentences are embedded; other rows are untouched.
    text = (corpus / "doc1.txt").read_text()
    (corpus / "doc1.txt").write_text(text + "\nA new closing paragraph names quokkazz. It ends here.\n")
    s = build(ix, corpus)
    after, texts = rows(ix), chunk_texts(ix)
    assert set(after) == set(texts)
    new = set(texts) - set(before)
    assert new and s.sentences_embedded == len({x for c in new for x in sentence_texts(texts[c])})
    assert all(after[c] == before[c] for c in set(after) & set(before))
    # A deleted file: its chunks' rows go with them (no stale vectors left behind).
    (corpus / "doc3.txt").unlink()
    s = build(ix, corpus)
    assert s.chunks_removed > 0 and s.sentences_embedded == 0
    assert set(rows(ix)) == set(chunk_texts(ix))
    # Unchanged: nothing to commit, nothing embedded.
    s = build(ix, corpus)
    assert not s.committed and s.sentences_embedded == 0


def test_a_rebuild_for_new_chunking_reuses_sentence_vectors(ix: Index, tmp_path: Path) -> None:
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "a.txt").write_text(make_text(7, n_paragraphs=8))
    first = build(ix, corpus)
    s = build(ix, corpus, max_tokens=90, rechunk=True)
    assert s.rebuilt and set(rows(ix)) == set(chunk_texts(ix))
    # The same sentences, cut into other chunks: their vectors come from the old generation.
    assert s.sentences_embedded < first.sentences_embedded


def manifest(ix: Index) -> dict:  # type: ignore[type-arg]
    return json.loads((ix.path / "manifest.json").read_text())


def index_bytes(ix: Index) -> int:
    """The current generation's files (the folder also keeps the previous one for readers)."""
    return int(Index.open(ix.path).stats()["bytes"])


def ask_report(ix: Index, emb: HashEmbedder) -> dict:  # type: ignore[type-arg]
    pipe = Pipeline(ix.path, backend=FakeBackend(), embedder=emb, pack="spans")
    answer = pipe.ask("Which marker appears only in the third document, marker2zz?", context_tokens=60)
    assert answer.report["pack"] == "spans" and answer.report["selection"]
    return answer.report


def test_sentence_vectors_off_drops_them_and_on_again_fills_them_for_every_chunk(ix: Index, corpus: Path) -> None:
    from ragbudget.cli.display import format_report

    build(ix, corpus)
    on_bytes, on_rows = index_bytes(ix), rows(ix)
    assert set(on_rows) == set(chunk_texts(ix)) and Index.open(ix.path).has_sentence_vectors
    # Off, no file changed: a new generation without them, smaller on disk; nothing re-chunked.
    off = build(ix, corpus, sentence_vectors=False)
    assert off.committed and not off.rebuilt and off.chunks_embedded == 0 and off.sentences_embedded == 0
    assert rows(ix) == {} and manifest(ix)["sentences"] == {"stored": False}
    assert manifest(ix)["counts"]["sentence_vectors"] == 0
    # The file is rewritten without their pages (deleted rows alone would leave its size).
    payload = sum(len(d) + len(v) for d, v in on_rows.values())
    assert on_bytes - index_bytes(ix) >= 0.9 * payload, (on_bytes, index_bytes(ix), payload)
    opened = Index.open(ix.path)
    assert not opened.has_sentence_vectors and opened.sentence_vectors(list(on_rows)) == {} and opened.verify().ok
    # A question then embeds the pool's sentences (the cold path), and --explain says so.
    emb = Counting()
    report = ask_report(ix, emb)
    assert emb.documents > 0 and report["sentence_vectors"] == "embedded at query time"
    assert "sentence vectors: embedded at query time" in format_report(report)
    # Still off: nothing to do, and a plain run keeps the recorded "off" (it is not told
    # otherwise); a changed file adds chunks without sentence vectors.
    assert not build(ix, corpus, sentence_vectors=False).committed
    assert not build(ix, corpus, sentence_vectors=None).committed and rows(ix) == {}
    (corpus / "doc1.txt").write_text((corpus / "doc1.txt").read_text() + "\nA closing line names quokkazz.\n")
    s = build(ix, corpus, sentence_vectors=None)
    assert s.committed and s.chunks_embedded > 0 and s.sentences_embedded == 0 and rows(ix) == {}
    # On again, no file changed: every chunk gets them, no chunk is embedded again.
    again = build(ix, corpus, sentence_vectors=True)
    texts = chunk_texts(ix)
    assert again.committed and not again.rebuilt and again.chunks_embedded == 0
    assert again.sentences_embedded > 0 and set(rows(ix)) == set(texts)
    assert manifest(ix)["sentences"]["stored"] is True and manifest(ix)["counts"]["sentence_vectors"] == len(texts)
    assert Index.open(ix.path).has_sentence_vectors and Index.open(ix.path).verify().ok
    emb = Counting()
    report = ask_report(ix, emb)
    assert emb.documents == 0 and report["sentence_vectors"] == "stored"
    assert "sentence vectors: stored in the index" in format_report(report)
    assert not build(ix, corpus).committed


def test_a_new_index_without_sentence_vectors(ix: Index, corpus: Path) -> None:
    from ragbudget.settings import ChunkSettings

    s = build(ix, corpus, sentence_vectors=False)
    assert s.committed and s.sentences_embedded == 0 and rows(ix) == {}
    assert not Index.open(ix.path).has_sentence_vectors
    # The record is what the keyword builds; whole-chunk packing reports no sentence vectors.
    assert ChunkSettings(sentence_vectors=False).sentence_vectors is False
    pipe = Pipeline(ix.path, backend=FakeBackend(), embedder=HashEmbedder(dim=DIM), pack="chunks")
    assert pipe.ask("marker2zz", context_tokens=60).report["sentence_vectors"] is None


def test_an_index_from_before_the_switch_counts_as_storing_them(ix: Index, corpus: Path) -> None:
    # A manifest entry without "stored" (written before sentence vectors could be left out).
    build(ix, corpus)
    m = manifest(ix)
    m["sentences"].pop("stored")
    (ix.path / "manifest.json").write_text(json.dumps(m))
    assert Index.open(ix.path).has_sentence_vectors
    assert not build(ix, corpus).committed
