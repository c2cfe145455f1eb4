"""Follow-up questions (:mod:`ragbudget.prompt.followup`): which questions lean on earlier turns, and
the retrieval query they get (terms added, or the model's standalone question read back). The whole
conversation path is in tests/test_chat.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from ragbudget.prompt.followup import expand_query, is_follow_up, standalone_messages, standalone_query


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("what about its footer?", True),
        ("And the R manual?", True),
        ("Why is that?", True),
        ("How are they removed?", True),
        ("footers?", True),
        ("How does the chunker split long Markdown sections into pieces?", False),
        ("Which system calls return EINTR when interrupted by a signal handler?", False),
    ],
)
def test_is_follow_up(question: str, expected: bool) -> None:
    assert is_follow_up(question) is expected


def test_expand_query_uses_newest_previous_question_first() -> None:
    q = expand_query("what about its footer?", ["KV budget basics?", "How are PDF page headers stripped?"])
    assert q.startswith("what about its footer? pdf page headers stripped")
    assert expand_query("Which system calls return EINTR on signals?", ["PDF headers?"]) == (
        "Which system calls return EINTR on signals?"
    )
    assert expand_query("what about it?", []) == "what about it?"


def test_a_standalone_rewrite_leads_and_keeps_the_terms_neither_holds() -> None:
    previous = ["Are lions and tigers the same genus?"]
    # The model only repeated the question: the earlier question's terms still reach the index.
    assert expand_query("Which is?", previous, standalone="Which is?") == "Which is? lions tigers genus"
    got = expand_query("Where do they live?", previous, standalone="Where do lions and tigers live?")
    assert got == "Where do lions and tigers live? genus"
    # A rewrite is used even when the question alone would not be taken for a follow-up.
    assert expand_query("Where do lions and tigers live in the wild?", [], standalone="Where do wild lions live?") == (
        "Where do wild lions live?"
    )


@settings(max_examples=80, deadline=None)
@given(st.text(min_size=1, max_size=80), st.lists(st.text(max_size=80), max_size=3))
def test_expand_query_keeps_the_question_intact(question: str, previous: list[str]) -> None:
    out = expand_query(question, previous, max_terms=10)
    assert out.startswith(question)
    assert len(out.split()) <= len(question.split()) + 10


@pytest.mark.parametrize(
    ("written", "question", "expected"),
    [
        ("When was Jane Austen born?", "When was she born?", "When was Jane Austen born?"),
        ('Standalone question: "When was Jane Austen born?"', "When was she born?", "When was Jane Austen born?"),
        ("**Rewritten question:** When was Jane Austen born?", "When was she born?", "When was Jane Austen born?"),
        ("\n\nWhen was Jane Austen born?\nShe was born in 1775.", "When was she born?", "When was Jane Austen born?"),
        ("  ", "When was she born?", ""),
        # An answer, not a question: refused (the terms stand in).
        ("Jane Austen was born in 1775.", "When was she born?", ""),
        ("Why " + "very " * 30 + "long?", "Why?", ""),
        # A request without a question mark may be rewritten without one.
        ("Tell me about Jane Austen's birth", "tell me about her birth", "Tell me about Jane Austen's birth"),
    ],
)
def test_standalone_query_reads_the_models_question_back_or_refuses_it(
    written: str, question: str, expected: str
) -> None:
    assert standalone_query(written, question) == expected


def test_a_rewrite_that_copies_the_transcript_or_an_earlier_question_is_refused() -> None:
    earlier = ["What connects them?", "Who wrote Emma?"]
    for written in ("User: How old was he?", "The user asked: Did she like school?", "assistant: Yes."):
        assert standalone_query(written, "Who did they find upstairs?", earlier) == ""
    # The previous question back, instead of this one (what small models often write).
    assert standalone_query("What connects them?", "Where were they in the afternoon?", earlier) == ""
    assert standalone_query("who wrote  EMMA?", "When was she born?", earlier) == ""
    # This question itself repeated is kept (the terms are added to it); so is a new question.
    assert standalone_query("What connects them?", "What connects them?", earlier) == "What connects them?"
    assert standalone_query("When was Jane Austen born?", "When was she born?", earlier) == "When was Jane Austen born?"


def test_standalone_messages_carry_the_summary_the_turns_and_the_question() -> None:
    system, user = standalone_messages(["User: Who wrote Emma?", "Assistant: Jane Austen."], "When?", summary="Books.")
    assert system["role"] == "system" and "Do not answer" in system["content"]
    text = user["content"]
    assert text.index("Books.") < text.index("Who wrote Emma?") < text.index("Jane Austen.") < text.index("When?")
