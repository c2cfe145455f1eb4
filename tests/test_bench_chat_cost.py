"""bench/chat_cost.py: the follow-up rewrite's cost read from paired turns (no model, no engine)."""

from __future__ import annotations

import pytest
from _bench import load_bench

cost = load_bench("chat_cost.py", "bench_chat_cost", shadowed=("_llama",))


def cell(round_: int, qid: str, row: str, seconds: float, rewrite_s: float = 0.0) -> dict[str, object]:
    return {
        "round": round_,
        "qid": qid,
        "row": row,
        "seconds": seconds,
        "rewrite_s": rewrite_s,
        "answer_words": 4,
        "rewritten": rewrite_s > 0,
    }


def test_the_ratio_is_taken_per_question_and_the_rewrite_share_over_the_rewritten_turns() -> None:
    cells = [
        cell(0, "a", "rewritten", 3.0, 1.0),
        cell(0, "a", "terms", 2.0),
        cell(0, "b", "terms", 4.0),
        cell(0, "b", "rewritten", 4.0, 0.0),  # not taken for a follow-up: no rewrite asked
        cell(1, "a", "terms", 1.0),
        cell(1, "a", "rewritten", 2.0, 1.0),
    ]
    s = cost.summarize(cells)
    assert s["median_ratio_rewritten_over_terms"] == pytest.approx(1.5)  # of 1.5, 1.0, 2.0
    assert s["rewrite_share_of_turn"] == pytest.approx(2.0 / 9.0)
    assert s["rewritten"]["median_s"] == 3.0 and s["terms"]["median_s"] == 2.0
    assert s["rewritten"]["rewritten_pct"] == pytest.approx(200 / 3) and s["terms"]["n"] == 3
