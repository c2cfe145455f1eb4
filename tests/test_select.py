"""Budgeted chunk selection: the hard cap (property), fill, merge, order, dropped reasons."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ragbudget.errors import ConfigError
from ragbudget.packing.select import DROP_REASONS, Candidate, select_chunks
from ragbudget.types import Source


def words(text: str) -> int:
    """A fast model-free counter: one token per whitespace-separated word."""
    return len(text.split())


def cand(cid: str, n: int, score: float, path: str = "doc", start: int | None = None) -> Candidate:
    # Distinct vocabulary per chunk so the redundancy filter never fires by accident.
    text = " ".join(f"{cid}word{i}" for i in range(n))
    src = (Source(path, start, start + len(text)),) if start is not None else ()
    return Candidate(cid, text, score, sources=src)


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[Candidate], int, int, bool]:
    # Few draws per example (sizes and scores come from a seeded Random) keep 10,000 cases fast.
    n = draw(st.integers(0, 25))
    budget = draw(st.integers(0, 1500))
    overhead = draw(st.integers(0, 12))
    adjacent = draw(st.booleans())
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    cands, pos = [], 0
    for i in range(n):
        c = cand(f"c{i}", rnd.randint(1, 120), rnd.uniform(-1, 1), path="p", start=pos if adjacent else None)
        pos += len(c.text) + rnd.randint(0, 3)
        cands.append(c)
    return cands, budget, overhead, adjacent


@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases(), st.sampled_from(["relevance", "document", "lost_in_middle"]), st.booleans())
def test_never_over_budget_and_every_candidate_accounted(case, order, fill_remainder) -> None:
    cands, budget, overhead, _ = case
    sel = select_chunks(
        "q",
        cands,
        budget_tokens=budget,
        count_tokens=words,
        chunk_overhead=overhead,
        order=order,
        fill_remainder=fill_remainder,
    )
    assert sel.tokens_used <= budget
    assert sel.tokens_used == sum(words(c.text) + overhead for c in sel.chunks)
    used = [cid for c in sel.chunks for cid in c.chunk_ids]
    assert len(used) == len(set(used))
    assert sorted(used + [d.chunk_id for d in sel.dropped]) == sorted(c.chunk_id for c in cands)
    best = max(cands, key=lambda x: x.score) if cands else None
    cut = [c for c in sel.chunks if c.truncated]
    if not fill_remainder:
        # Only the best chunk may be truncated, and only when it alone exceeds the budget.
        for c in cut:
            assert c.chunk_ids == (best.chunk_id,) or words(best.text) + overhead > budget
        return
    # With fill_remainder: at most the oversize best chunk and one chunk cut into the room the
    # whole ones left, and that one is the best-scored candidate not used whole.
    assert len(cut) <= 2
    whole = {cid for c in sel.chunks if not c.truncated for cid in c.chunk_ids}
    for c in cut:
        if c.chunk_ids != (best.chunk_id,):
            (cid,) = c.chunk_ids
            better = [x for x in cands if x.score > next(y.score for y in cands if y.chunk_id == cid)]
            assert all(x.chunk_id in whole or x.chunk_id == best.chunk_id for x in better)


@settings(max_examples=2_000, deadline=None)
@given(
    st.lists(st.integers(1, 20), min_size=1, max_size=40),
    st.integers(0, 8),
    st.integers(400, 1200),
)
def test_fills_at_least_95_percent_when_candidates_allow(sizes, overhead, budget) -> None:
    cands = [cand(f"c{i}", s, 1.0 - i / 100) for i, s in enumerate(sizes)]
    total = sum(s + overhead for s in sizes)
    sel = select_chunks("q", cands, budget_tokens=budget, count_tokens=words, chunk_overhead=overhead)
    if total >= budget:
        # Every chunk costs ≤ 28 ≤ 5% of a 560+ budget; below that, allow one chunk of slack.
        assert sel.tokens_used >= budget - max(s + overhead for s in sizes)
        if budget >= 560:
            assert sel.fill >= 0.95
    else:
        assert sel.tokens_used == total


def test_knapsack_beats_top_k_then_truncate() -> None:
    # The best chunk (60) fits; the second (50) does not; three small ones fill the rest.
    cands = [cand("a", 60, 0.9), cand("b", 50, 0.8), cand("c", 12, 0.7), cand("d", 12, 0.6), cand("e", 12, 0.5)]
    sel = select_chunks("q", cands, budget_tokens=100, count_tokens=words, fill_remainder=False)
    ids = [c.chunk_id for c in sel.chunks]
    assert ids == ["a", "c", "d", "e"]
    assert sel.tokens_used == 96 and not any(c.truncated for c in sel.chunks)
    assert [(d.chunk_id, d.reason) for d in sel.dropped] == [("b", "over_budget")]


def test_dropped_reasons() -> None:
    base = cand("a", 10, 0.9)
    cands = [
        base,
        Candidate("dup", "  " + base.text.upper() + " ", 0.8),  # same text up to case/space
        Candidate("red", base.text + " extra", 0.7),  # contains all of a's words
        cand("low", 5, 0.05),
        cand("big", 95, 0.6),
    ]
    sel = select_chunks("q", cands, budget_tokens=40, count_tokens=words, min_score=0.1, fill_remainder=False)
    reasons = {d.chunk_id: d.reason for d in sel.dropped}
    assert reasons == {"dup": "duplicate", "red": "redundant", "low": "below_cutoff", "big": "over_budget"}
    assert [c.chunk_id for c in sel.chunks] == ["a"]


def test_merges_adjacent_chunks_of_one_file_and_counts_exactly() -> None:
    a = cand("a", 10, 0.9, path="f", start=0)
    b = cand("b", 10, 0.5, path="f", start=a.sources[0].end + 1)
    c = cand("c", 10, 0.8, path="g", start=0)
    sel = select_chunks("q", [a, c, b], budget_tokens=100, count_tokens=words, chunk_overhead=5)
    merged = [p for p in sel.chunks if len(p.chunk_ids) > 1]
    assert len(merged) == 1 and merged[0].chunk_ids == ("a", "b")
    assert merged[0].text == a.text + "\n" + b.text
    assert merged[0].sources == (Source("f", 0, b.sources[0].end),)
    assert merged[0].cost == 20 + 5
    assert sel.tokens_used == 25 + 15


def test_merge_frees_tokens_for_another_chunk() -> None:
    # Apart, a+b+c cost 3*(10+10)=60 > 50; merged a+b cost 30 and c then fits.
    a = cand("a", 10, 0.9, path="f", start=0)
    b = cand("b", 10, 0.8, path="f", start=a.sources[0].end + 1)
    c = cand("c", 10, 0.1, path="g", start=0)
    sel = select_chunks("q", [a, b, c], budget_tokens=50, count_tokens=words, chunk_overhead=10)
    assert sorted(cid for p in sel.chunks for cid in p.chunk_ids) == ["a", "b", "c"]
    assert sel.tokens_used == 50 and not sel.dropped


def test_orders() -> None:
    cands = [cand(f"c{i}", 5, 1 - i / 10, path="f", start=100 * (5 - i)) for i in range(5)]
    kw = {"budget_tokens": 100, "count_tokens": words, "merge_adjacent": False}
    rel = select_chunks("q", cands, order="relevance", **kw)
    assert [c.chunk_id for c in rel.chunks] == ["c0", "c1", "c2", "c3", "c4"]
    doc = select_chunks("q", cands, order="document", **kw)
    assert [c.chunk_id for c in doc.chunks] == ["c4", "c3", "c2", "c1", "c0"]
    lim = select_chunks("q", cands, order="lost_in_middle", **kw)
    assert [c.chunk_id for c in lim.chunks] == ["c0", "c2", "c4", "c3", "c1"]


def test_truncates_only_the_single_oversize_best_chunk_at_a_sentence() -> None:
    text = "One two three. Four five six. Seven eight nine ten. Eleven twelve."
    big = Candidate("big", text, 0.9, sources=(Source("f", 0, len(text)),))
    small = cand("s", 2, 0.5)
    sel = select_chunks("q", [big, small], budget_tokens=9, count_tokens=words, fill_remainder=False)
    first = sel.chunks[0]
    assert first.truncated and first.text == "One two three. Four five six."
    assert first.sources[0].end == len(first.text)
    assert [c.chunk_id for c in sel.chunks] == ["big", "s"] and sel.tokens_used == 8
    # Without fill_remainder a non-best oversize chunk is dropped, never cut.
    sel2 = select_chunks(
        "q", [small, Candidate("big", text, 0.1)], budget_tokens=9, count_tokens=words, fill_remainder=False
    )
    assert [c.chunk_id for c in sel2.chunks] == ["s"]
    assert [d.reason for d in sel2.dropped] == ["over_budget"]


def test_fill_remainder_cuts_the_next_best_chunk_to_the_window_that_answers() -> None:
    # The 2nd chunk (22 words) does not fit the 12 words the 1st leaves; the knapsack gives 3 of
    # them to the small weak chunk and, before fill_remainder, left the other 9 empty (greedy fill
    # reads the 2nd chunk's beginning there). Now they hold the window of the 2nd chunk that
    # holds the question's words.
    text = (
        "The guild met in the old hall. Members paid dues every spring. "
        "The hall burned down in 1871. Afterwards the guild moved away."
    )
    first = cand("a", 38, 0.9, path="f", start=0)
    second = Candidate("b", text, 0.85, sources=(Source("g", 50, 50 + len(text)),))
    weak = cand("c", 3, 0.1)
    sel = select_chunks(
        "When did the hall burn down?", [first, second, weak], budget_tokens=50, count_tokens=words, fill_remainder=True
    )
    by_id = {c.chunk_id: c for c in sel.chunks}
    assert set(by_id) == {"a", "b", "c"} and not by_id["a"].truncated
    assert by_id["b"].truncated and "burned down in 1871." in by_id["b"].text
    assert sel.tokens_used <= 50 and words(by_id["b"].text) <= 9
    start = by_id["b"].sources[0].start - 50
    assert text[start : start + len(by_id["b"].text)] == by_id["b"].text
    assert sel.dropped == ()
    # Off: the 9 tokens stay empty and the 2nd chunk is dropped (the old behaviour).
    off = select_chunks(
        "When did the hall burn down?",
        [first, second, weak],
        budget_tokens=50,
        count_tokens=words,
        fill_remainder=False,
    )
    assert [c.chunk_id for c in off.chunks] == ["a", "c"] and off.tokens_used == 41
    assert [(d.chunk_id, d.reason) for d in off.dropped] == [("b", "over_budget")]


def test_oversize_best_chunk_keeps_the_window_that_answers_the_question() -> None:
    text = (
        "The guild met in the old hall. Members paid dues every spring. "
        "The hall burned down in 1871. Afterwards the guild moved to the harbour office."
    )
    big = Candidate("big", text, 0.9, sources=(Source("f", 100, 100 + len(text)),))
    sel = select_chunks("When did the hall burn down?", [big], budget_tokens=12, count_tokens=words)
    (c,) = sel.chunks
    assert c.truncated and "burned down in 1871." in c.text
    assert words(c.text) <= 12 and sel.tokens_used <= 12
    # The shortened source points at the kept window in the original text.
    start = c.sources[0].start - 100
    assert text[start : start + len(c.text)] == c.text
    assert c.sources[0].end - c.sources[0].start == len(c.text)
    # No word in common with the question: the beginning is kept, as before.
    sel = select_chunks("xyzzy?", [big], budget_tokens=12, count_tokens=words)
    assert sel.chunks[0].text.startswith("The guild met")


def test_oversize_window_falls_back_to_words_and_weights_rare_terms() -> None:
    # One long "sentence": the cut is a window of words around the rare question word.
    text = " ".join(["river"] * 30 + ["zeppelin", "landed"] + ["river"] * 30)
    sel = select_chunks(
        "Where did the zeppelin land by the river?", [Candidate("x", text, 1.0)], budget_tokens=10, count_tokens=words
    )
    (c,) = sel.chunks
    assert c.truncated and "zeppelin" in c.text and words(c.text) <= 10


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(
        st.sampled_from(
            ["Alpha beta.", "Gamma delta epsilon!", "Zeta", "eta?", "\n", "theta iota kappa lambda.", "  "]
        ),
        min_size=1,
        max_size=40,
    ),
    st.text(max_size=40),
    st.integers(0, 30),
    st.integers(0, 5),
)
def test_best_window_cut_never_overruns(parts, question, budget, overhead) -> None:
    text = " ".join(parts)
    if not text.strip():
        return
    sel = select_chunks(
        question,
        [Candidate("x", text, 1.0, sources=(Source("f", 0, len(text)),))],
        budget_tokens=budget,
        count_tokens=words,
        chunk_overhead=overhead,
    )
    assert sel.tokens_used <= budget
    for c in sel.chunks:
        assert c.text and c.text in text
        assert text[c.sources[0].start : c.sources[0].end] == c.text


def test_mmr_prefers_diverse_chunks() -> None:
    a = Candidate("a", "alpha beta gamma delta epsilon zeta", 0.9)
    near = Candidate("near", "alpha beta gamma delta epsilon eta", 0.85)  # 5/6 overlap
    other = Candidate("other", "seven eight nine ten eleven twelve", 0.84)
    sel = select_chunks("q", [a, near, other], budget_tokens=12, count_tokens=words, lambda_=0.5, temperature=0.1)
    assert [c.chunk_id for c in sel.chunks] == ["a", "other"]


def test_to_dict_and_fill() -> None:
    sel = select_chunks("q", [cand("a", 5, 1.0)], budget_tokens=10, count_tokens=words, chunk_overhead=1)
    d = sel.to_dict()
    assert d["tokens_used"] == 6 and d["fill"] == 0.6 and d["chunks"][0]["chunk_ids"] == ["a"]


def test_bad_config() -> None:
    with pytest.raises(ConfigError, match="order"):
        select_chunks("q", [], budget_tokens=1, count_tokens=words, order="random")
    with pytest.raises(ConfigError, match="budget_tokens"):
        select_chunks("q", [], budget_tokens=-1, count_tokens=words)


def test_relevance_floor_drops_weak_candidates_with_their_reason() -> None:
    hits = [
        Candidate("a", "Paris is the capital of France.", 0.80),
        Candidate("b", "France borders Spain and Italy.", 0.45),
        Candidate("c", "Bananas are yellow.", -0.005),
    ]
    count = lambda s: len(s.split())  # noqa: E731
    full = select_chunks("capital?", hits, budget_tokens=100, count_tokens=count)
    assert [c.chunk_id for c in full.chunks] == ["a", "b", "c"]  # no floor: the budget is filled
    sel = select_chunks("capital?", hits, budget_tokens=100, count_tokens=count, relevance_floor=0.5)
    assert [c.chunk_id for c in sel.chunks] == ["a", "b"]
    assert [(d.chunk_id, d.reason) for d in sel.dropped] == [("c", "below_relevance_floor")]
    assert "below_relevance_floor" in DROP_REASONS
    for bad in (-0.1, 1.5, "0.5"):
        with pytest.raises(ConfigError, match="relevance_floor"):
            select_chunks("q", hits, budget_tokens=100, count_tokens=count, relevance_floor=bad)
