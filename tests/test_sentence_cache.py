"""The sentence cache beside an index (:mod:`ragbudget.retrieval.sentence_cache`): a new index stores no
sentence vectors (issue #31: half the embedding at build time), and span packing embeds each
sentence once — in this process or any other asking the same index — then reads it back.

Model-free: :class:`HashEmbedder`, the corpus of tests/_corpus.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _corpus import OPTS, write_corpus
from _fakes import FakeBackend

from ragbudget.pipeline import Pipeline
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Index
from ragbudget.retrieval.sentence_cache import SentenceCache

DIM = 64
QUESTION = "Which marker appears only in the third document, marker2zz?"


class Counting(HashEmbedder):
    """A HashEmbedder (same id, same vectors) that counts the document texts it embeds."""

    def __init__(self) -> None:
        super().__init__(dim=DIM)
        self.documents = 0

    def embed_documents(self, texts, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.documents += len(texts)
        return super().embed_documents(texts, *args, **kwargs)


@pytest.fixture
def ix(tmp_path: Path) -> Index:
    ix = Index(tmp_path / "ix")
    ix.build([str(write_corpus(tmp_path / "corpus"))], embedder=HashEmbedder(dim=DIM), **OPTS)  # type: ignore[arg-type]
    return ix


def retrieve(ix: Index, emb: HashEmbedder) -> str:
    pipe = Pipeline(ix.path, backend=FakeBackend(), embedder=emb, pack="spans")
    sel = pipe.retrieve(QUESTION, context_tokens=60)
    assert sel.pack == "spans" and "marker2zz" in sel.text
    return sel.text


def test_a_new_index_stores_no_sentence_vectors_and_a_question_embeds_each_sentence_once(ix: Index) -> None:
    opened = Index.open(ix.path)
    m = json.loads((ix.path / "manifest.json").read_text())
    assert not opened.has_sentence_vectors and m["sentences"] == {"stored": False}
    assert m["last_run"]["sentences_embedded"] == 0
    first = Counting()
    text = retrieve(ix, first)
    assert first.documents > 0  # the pool's sentences, embedded on first use ...
    cache = SentenceCache(ix.path, identity=m["embedder"], dim=DIM)
    assert (ix.path / "cache" / "sentences.sqlite").is_file()
    # ... and kept beside the index: a new pipeline (a new `ragbudget ask`) embeds none of them.
    again = Counting()
    assert retrieve(ix, again) == text and again.documents == 0
    assert len(cache) == first.documents
    # The index itself is untouched by a question: same files, still verified.
    assert Index.open(ix.path).verify().ok


_OTHER_PROCESS = """
import json, sys
sys.path.insert(0, {tests!r})
from _fakes import FakeBackend
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.pipeline import Pipeline

class Counting(HashEmbedder):
    documents = 0
    def embed_documents(self, texts, *a, **k):
        Counting.documents += len(texts)
        return super().embed_documents(texts, *a, **k)

sel = Pipeline({ix!r}, backend=FakeBackend(), embedder=Counting(dim={dim}), pack="spans").retrieve(
    {question!r}, context_tokens=60)
print(json.dumps({{"embedded": Counting.documents, "text": sel.text}}))
"""


def test_another_process_reads_what_a_question_embedded(ix: Index) -> None:
    def ask() -> dict:
        code = _OTHER_PROCESS.format(tests=str(Path(__file__).parent), ix=str(ix.path), dim=DIM, question=QUESTION)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    first, second = ask(), ask()
    assert first["embedded"] > 0 and second["embedded"] == 0 and first["text"] == second["text"]


def test_a_cache_written_for_another_embedder_is_never_read(tmp_path: Path) -> None:
    a = SentenceCache(tmp_path, identity={"kind": "hash", "id": "hash-4"}, dim=4)
    assert a.put({b"s" * 16: np.array([0.0, 1.0, 0.0, 0.0])}) == 1
    b = SentenceCache(tmp_path, identity={"kind": "hash", "id": "hash-4-other"}, dim=4)
    assert b.get([b"s" * 16]) == {}  # another embedder's vector is not this one's
    b.put({b"t" * 16: np.array([1.0, 0.0, 0.0, 0.0])})
    # The first write under the new embedder replaced the old contents.
    assert SentenceCache(tmp_path, identity={"kind": "hash", "id": "hash-4"}, dim=4).get([b"s" * 16]) == {}
    again = SentenceCache(tmp_path, identity={"kind": "hash", "id": "hash-4-other"}, dim=4)
    assert list(again.get([b"s" * 16, b"t" * 16])) == [b"t" * 16]
    # Float16 on disk, as the index's own sentence vectors.
    v = np.array([0.1234567, -0.5, 0.25, 0.0])
    again.put({b"u" * 16: v})
    np.testing.assert_allclose(again.get([b"u" * 16])[b"u" * 16], v, atol=1e-3)


def test_an_unusable_cache_changes_no_answer(ix: Index, caplog: pytest.LogCaptureFixture) -> None:
    (ix.path / "cache").write_text("not a folder")  # the cache cannot be created here
    first, second = Counting(), Counting()
    with caplog.at_level("INFO", logger="ragbudget.retrieval.sentence_cache"):
        assert retrieve(ix, first) == retrieve(ix, second)
    assert first.documents == second.documents > 0  # embedded each time, nothing kept, no error
    assert "no sentence cache beside the index" in caplog.text


_WRITER = """
import sys
import numpy as np
from ragbudget.retrieval.sentence_cache import SentenceCache
c = SentenceCache({folder!r}, identity={{"kind": "hash", "id": "hash-8"}}, dim=8)
rng = np.random.default_rng({seed})
for i in range(40):
    n = c.put({{bytes([{seed}, i, j]) + bytes(13): rng.standard_normal(8) for j in range(25)}})
    assert n == 25, n
"""


def test_two_writers_that_opened_a_new_cache_together_keep_each_others_vectors(tmp_path: Path) -> None:
    # Both opened the file before either wrote (each saw no embedder recorded): the second writer
    # must not start the cache over and delete what the first just wrote.
    identity = {"kind": "hash", "id": "hash-8"}
    a, b = (SentenceCache(tmp_path, identity=identity, dim=8) for _ in range(2))
    assert len(a) == len(b) == 0  # both open, neither has written
    assert a.put({b"a" * 16: np.ones(8)}) == 1
    assert b.put({b"b" * 16: np.ones(8)}) == 1
    assert sorted(SentenceCache(tmp_path, identity=identity, dim=8).get([b"a" * 16, b"b" * 16])) == [
        b"a" * 16,
        b"b" * 16,
    ]
    # A cache another embedder wrote is still started over by the first write under this one.
    other = SentenceCache(tmp_path, identity={"kind": "hash", "id": "hash-other"}, dim=8)
    assert other.put({b"c" * 16: np.ones(8)}) == 1
    assert SentenceCache(tmp_path, identity=identity, dim=8).get([b"a" * 16]) == {}


def test_processes_write_the_same_cache_at_once(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER.format(folder=str(tmp_path), seed=s)], stderr=subprocess.PIPE)
        for s in (1, 2, 3)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    c = SentenceCache(tmp_path, identity={"kind": "hash", "id": "hash-8"}, dim=8)
    keys = [bytes([s, i, j]) + bytes(13) for s in (1, 2, 3) for i in range(40) for j in range(25)]
    assert len(c.get(keys)) == 3 * 40 * 25  # every write of every process kept


def test_a_question_scores_the_same_whether_its_sentences_were_just_embedded_or_cached(ix: Index) -> None:
    from ragbudget.packing.spans import SpanScorer, sentence_digest

    m = json.loads((ix.path / "manifest.json").read_text())
    sentences = ["Harbour tides move the ships at dawn.", "Marker two sits in the third document.", "x"]
    fresh = SpanScorer(HashEmbedder(dim=DIM), persist=SentenceCache(ix.path, identity=m["embedder"], dim=DIM))
    first = fresh.similarities(QUESTION, sentences)
    later = SpanScorer(HashEmbedder(dim=DIM), persist=SentenceCache(ix.path, identity=m["embedder"], dim=DIM))
    assert later.similarities(QUESTION, sentences) == first and later.embedded == 0 and later.persisted == 3
    # The cache holds the float16 vectors the index would store (the first question scored with
    # those too: its scores are the later ones, read back from the cache).
    held = SentenceCache(ix.path, identity=m["embedder"], dim=DIM).get([sentence_digest(sentences[0])])
    embedded = HashEmbedder(dim=DIM).embed_documents(sentences[:1])[0]
    assert np.array_equal(held[sentence_digest(sentences[0])], embedded.astype(np.float16).astype(np.float32))


def test_after_a_file_changes_a_question_embeds_only_the_sentences_it_has_not_seen(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    ix = Index(tmp_path / "ix")
    ix.build([str(corpus)], embedder=HashEmbedder(dim=DIM), **OPTS)  # type: ignore[arg-type]
    first = Counting()
    retrieve(ix, first)
    seen = first.documents
    # The question's document gains a sentence: its chunks are new chunks of the index, but
    # their other sentences are the ones already embedded, read back from the cache.
    doc = corpus / "doc2.txt"
    doc.write_text(doc.read_text().replace("marker2zz", "marker2zz. Quokkas nest in the third document", 1))
    s = ix.build([str(corpus)], embedder=HashEmbedder(dim=DIM), **OPTS)  # type: ignore[arg-type]
    assert s.chunks_embedded >= 1 and s.sentences_embedded == 0
    again = Counting()
    retrieve(ix, again)
    assert 0 < again.documents < seen
