"""The question's evidence for each sentence (ragbudget.packing.scoring): BM25 on content terms,
the embedder's cosine with vectors cached by content. How span packing uses it: test_spans.py."""

from __future__ import annotations

from ragbudget.packing import spans
from ragbudget.packing.scoring import SpanScorer, bm25, content_terms
from ragbudget.retrieval.embed import HashEmbedder


def test_bm25_ranks_the_sentence_with_the_questions_rare_words_first() -> None:
    docs = ["The lighthouse was lit in 1847.", "The keepers left the lighthouse.", "Gulls nest on the rock."]
    scores = bm25("When was the lighthouse lit?", docs)
    assert scores.index(max(scores)) == 0
    assert scores[2] == 0.0  # no term of the question
    assert bm25("anything", []) == []


def test_content_terms_drop_question_words_and_meet_plurals() -> None:
    assert "when" not in content_terms("When did the boats sail?")
    assert set(content_terms("boats")) == set(content_terms("boat"))


def test_the_names_still_resolve_from_spans() -> None:
    # Moved from packing/spans.py (where callers have imported them since #32): one object each.
    assert spans.SpanScorer is SpanScorer and spans.bm25 is bm25 and spans.content_terms is content_terms


def test_span_scorer_caches_vectors_by_content() -> None:
    class Counting(HashEmbedder):
        calls = 0

        def embed_documents(self, texts):
            Counting.calls += len(texts)
            return super().embed_documents(texts)

    s = SpanScorer(Counting(dim=32))
    first = s.similarities("q", ["one", "two"])
    again = s.similarities("q", ["two", "one", "three"])
    assert again[:2] == [first[1], first[0]]
    assert Counting.calls == 3  # "one", "two", then only "three"
