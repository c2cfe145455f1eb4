"""Tuning a search store (ragbudget.retrieval.recall): recall@10 against exact search on the
queries a build makes, and the ladder walk to a target."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Index
from ragbudget.retrieval.recall import (
    QUESTION_TUNE_TARGET,
    TUNE_TARGET,
    StoreReport,
    measure_recall,
    pseudo_questions,
    warn_below_target,
)
from ragbudget.retrieval.vectors import EF_LADDER, FlatStore, load_store, make_store
from tests.test_vectors import OPTS, clustered, corpus

EMB = OPTS["embedder"]
assert isinstance(EMB, HashEmbedder)


@pytest.fixture(scope="module")
def exact() -> FlatStore:
    flat = FlatStore(32)
    flat.add(np.arange(3000) * 7 + 3, clustered(3000))  # ids are not row numbers
    return flat


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return corpus(tmp_path_factory.mktemp("docs") / "c")


def test_hnsw_tunes_on_pseudo_questions_to_their_own_target(exact: FlatStore, tmp_path: Path) -> None:
    """Given question vectors, the graph climbs the ladder until they get 0.99 (the rung below
    really gave less), records both that and the noisy-own-vector recall verify re-measures."""
    questions = clustered(200, seed=5)  # not the stored vectors: queries from elsewhere
    store = make_store("hnsw", 32, exact=exact)
    report = store.finalize(questions=questions)  # type: ignore[call-arg]
    assert report.tuned_on == "pseudo-questions" and report.target == QUESTION_TUNE_TARGET
    ef, ladder = report.params["ef_search"], EF_LADDER
    assert ef > ladder[0] and report.questions_recall is not None
    assert report.questions_recall == measure_recall(store, exact, questions=questions)[0] >= 0.99
    assert report.recall_at_10 == measure_recall(store, exact)[0]
    entry = store.save(tmp_path / "s.index")
    assert entry["tuned_on"] == "pseudo-questions" and entry["recall_target"] == 0.99
    assert entry["recall_at_10_questions"] == round(report.questions_recall, 4)
    # the rung below, as an index whose manifest names it opens the store
    below = load_store(tmp_path / "s.index", {**entry, "ef_search": ladder[ladder.index(ef) - 1]}, exact=exact)
    assert measure_recall(below, exact, questions=questions)[0] < 0.99
    # An IVF store keeps tuning on its own vectors (its target was chosen there).
    ivf = make_store("ivf-flat", 32, exact=exact).finalize(questions=questions)  # type: ignore[call-arg]
    assert ivf.tuned_on == "own vectors" and ivf.target == TUNE_TARGET and ivf.questions_recall is None


def test_measure_recall_on_given_questions_counts_every_answer(exact: FlatStore) -> None:
    """With questions nothing is left out: the exact store against itself is 1.0, and a store
    that finds nothing 0.0."""
    q = clustered(20, seed=3)
    assert measure_recall(exact, exact, questions=q) == (1.0, 20)
    empty = make_store("hnsw", 32, exact=FlatStore(32))  # never finalized: finds nothing
    assert measure_recall(empty, exact, questions=q) == (0.0, 20)


def test_pseudo_questions_are_windows_of_sampled_chunks_embedded_as_queries(docs: Path, tmp_path: Path) -> None:
    asked: list[str] = []

    class Recording(HashEmbedder):
        def embed_query(self, text: str) -> np.ndarray:
            asked.append(text)
            return super().embed_query(text)

    ix = Index(tmp_path / "ix")
    ix.build([str(docs)], **OPTS)
    gen = Index.open(ix.path).generation
    ids = gen.exact.ids()
    texts = [h.text for h in Index.open(ix.path).get_chunks(ids.tolist())]
    q = pseudo_questions(gen.catalog, ids, Recording(dim=EMB.dim), n=30, words=5)
    assert q.shape == (30, EMB.dim) and q.dtype == np.float32 and len(asked) == 30
    for text, row in zip(asked, q, strict=True):
        assert 1 <= len(text.split()) <= 5 and any(text in " ".join(t.split()) for t in texts)  # one chunk's
        assert np.allclose(row, EMB.embed_query(text))
    assert np.array_equal(q, pseudo_questions(gen.catalog, ids, EMB, n=30, words=5))  # seeded
    many = pseudo_questions(gen.catalog, ids, EMB, n=10_000)
    assert len(many) == len(ids)  # at most one a chunk


def test_a_store_below_its_target_at_the_top_of_its_ladder_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """One warning line naming the queries and the target; none when the target was reached,
    and a store of another package that says no target is held to the questions' 0.98."""
    low = StoreReport("hnsw", 10, recall_at_10=0.999, tuned_on="pseudo-questions", target=0.99, questions_recall=0.95)
    with caplog.at_level(logging.WARNING, logger="ragbudget.retrieval.recall"):
        warn_below_target(low, "the hnsw store", {"ef_search": 1024})
        warn_below_target(StoreReport("hnsw", 10, recall_at_10=0.9, target=0.85), "ok", {})
        warn_below_target(StoreReport("annoy", 10, recall_at_10=0.97), "the annoy store", {})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "0.950" in lines[0] and "pseudo-questions" in lines[0] and "0.990" in lines[0] and "1024" in lines[0]
    assert "0.970" in lines[1] and "0.980" in lines[1]
    assert low.tuned_recall == 0.95 and low.to_dict()["recall_at_10_questions"] == 0.95
