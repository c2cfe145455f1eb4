"""A chunk's sentences: exact offsets, list items, the neighbour rule's test, the vector digest."""

from __future__ import annotations

from hypothesis import given, strategies as st

from ragbudget.packing.sentences import (
    NEEDS_PREVIOUS,
    needs_previous,
    sentence_digest,
    sentence_texts,
    split_sentences,
)


def test_split_sentences_abbreviations_initials_and_lines() -> None:
    t = "Mr. Brodie (b. 1799) met J. Smith on St. Kilda. Costs rose, e.g. for stone. Done!\nNext"
    got = [t[a:b] for a, b, _ in split_sentences(t)]
    assert got == ["Mr. Brodie (b. 1799) met J. Smith on St. Kilda.", "Costs rose, e.g. for stone.", "Done!", "Next"]


def test_list_items_closing_quotes_and_cjk_stops() -> None:
    t = "You need:\n- a cloth\n  a) soft\n• a brush\nHe said “yes.” Then left.\n雨が降った。家にいた。"
    assert [(t[a:b], item) for a, b, item in split_sentences(t)] == [
        ("You need:", False),
        ("- a cloth", True),
        ("a) soft", True),
        ("• a brush", True),
        ("He said “yes.”", False),
        ("Then left.", False),
        ("雨が降った。", False),
        ("家にいた。", False),
    ]
    assert sentence_texts(t) == [t[a:b] for a, b, _ in split_sentences(t)]


@given(st.text(alphabet=st.sampled_from(list("ab. \n-!?\t1)”")), max_size=80))
def test_sentences_are_trimmed_ordered_and_exact(text: str) -> None:
    # Whatever the text: each unit is a non-empty, trimmed slice of it, in order, never
    # overlapping, never across a line break.
    prev = 0
    for a, b, _ in split_sentences(text):
        piece = text[a:b]
        assert piece and piece == piece.strip() and prev <= a < b and "\n" not in piece
        prev = b


def test_needs_previous_reads_the_first_word_or_phrase() -> None:
    assert needs_previous("However, the plan failed.") and needs_previous("It used a lamp.")
    assert needs_previous("As a result, it fell.") and needs_previous("“However it rained.")
    assert needs_previous("On the other hand, no.")
    # a word that only starts with one ("Italy", "Onwards") does not lean
    assert not needs_previous("Italy is large.") and not needs_previous("Onwards we go.")
    assert not needs_previous("The lens turned.") and not needs_previous("")
    assert {"he", "however", "as a result"} <= NEEDS_PREVIOUS


def test_sentence_digest_is_the_16_byte_key_of_the_text() -> None:
    # What an index stores beside each sentence vector and what the scorer looks up: the same
    # text gives the same key in any process; a lone surrogate (bad input) still has one.
    assert sentence_digest("It rained.") == sentence_digest("It rained.")
    assert len(sentence_digest("It rained.")) == 16
    assert sentence_digest("It rained.") != sentence_digest("It rained!")
    # pinned: indexes on disk hold these keys, so a change would orphan every stored vector
    assert sentence_digest("It rained.").hex() == "5c9f067ee305237f91a194516513c1b4"
    assert len(sentence_digest("\ud800")) == 16
