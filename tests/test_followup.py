"""Follow-up questions (:mod:`ragbudget.prompt.followup`): which questions lean on earlier turns, and
the retrieval query they get. The whole conversation path is in tests/test_chat.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from ragbudget.prompt.followup import expand_query, is_follow_up


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


@settings(max_examples=80, deadline=None)
@given(st.text(min_size=1, max_size=80), st.lists(st.text(max_size=80), max_size=3))
def test_expand_query_keeps_the_question_intact(question: str, previous: list[str]) -> None:
    out = expand_query(question, previous, max_terms=10)
    assert out.startswith(question)
    assert len(out.split()) <= len(question.split()) + 10
