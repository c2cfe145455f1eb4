"""bench/abstain_answers.py and bench/answers_floor.py: what a floor gives, read from floor-off
answers (a decline by the floor or by the model, F1 0 for a declined answerable question), and the
floor-off row registered beside the default so that the paired differences include it. No model,
no engine: the cells are written here."""

from __future__ import annotations

from typing import Any

from _bench import load_bench

abstain = load_bench("abstain_answers.py", "bench_abstain_answers", shadowed=("_llama", "answers"))
floor_off = load_bench("answers_floor.py", "bench_answers_floor", shadowed=("_llama", "answers"))


def cell(qid: str, answerable: bool, evidence: float, answer: str, gold: str = "Nobel Prize") -> dict[str, Any]:
    return {"qid": qid, "answerable": answerable, "evidence": evidence, "answer": answer, "answers": [gold]}


CELLS = [
    cell("a1", True, 0.70, "She was the first woman to win the Nobel Prize. [1]"),
    cell("a2", True, 0.40, "The Nobel Prize."),  # right, but under a floor of 0.45
    cell("a3", True, 0.60, "I don't know."),  # the model declines an answerable question
    cell("u1", False, 0.30, "The Fields Medal."),
    cell("u2", False, 0.50, "The sources do not mention it."),  # declined by the model
    cell("u3", False, 0.55, "A gold medal."),
]


def test_floor_off_counts_only_the_models_declines() -> None:
    got = abstain.at_floor(CELLS, 0.0)
    assert got["by_floor_pct"] == 0.0
    assert got["declined_unanswerable_pct"] == round(100 / 3, 1)
    assert got["by_model_unanswerable_pct"] == round(100 / 3, 1)
    assert got["wrongly_declined_pct"] == round(100 / 3, 1)  # a3
    assert got["f1"] > 0


def test_a_floor_declines_under_it_and_a_declined_answer_scores_nothing() -> None:
    off, on = abstain.at_floor(CELLS, 0.0), abstain.at_floor(CELLS, 0.45)
    # u1 is now declined by the floor; u2 still by the model (over the floor); u3 answered.
    assert on["declined_unanswerable_pct"] == round(200 / 3, 1)
    assert on["by_model_unanswerable_pct"] == round(100 / 3, 1)
    assert on["by_floor_pct"] == round(200 / 6, 1)  # a2 and u1
    # a2's right answer is lost to the floor: F1 falls by its share of the answerable questions.
    assert on["wrongly_declined_pct"] == round(200 / 3, 1)
    assert abs(on["f1"] - (off["f1"] - 100 / 3)) < 0.02  # each rounded to 2 places


def test_the_floor_off_row_is_registered_and_paired_against_the_peers() -> None:
    answers = floor_off.answers
    assert answers.RAGBUDGET_ROWS["ragbudget_floor_off"] == {"evidence_floor": 0.0}
    assert answers.RAGBUDGET_ROWS["ragbudget"] == {}
    questions = [{"qid": "q1", "answers": ["Nobel Prize"], "answerable": True}]
    cells = [
        {"system": "ragbudget_floor_off", "budget": 256, "qid": "q1", "answer": "The Nobel Prize. [1]"},
        {"system": "langchain", "budget": 2048, "qid": "q1", "answer": "A medal."},
    ]
    summary, diffs = answers.summarize(cells, questions, ["ragbudget_floor_off", "langchain"], [256, 2048])
    assert summary["ragbudget_floor_off@256"]["f1"] == 100.0
    assert diffs["ragbudget_floor_off@256 - langchain@2048"]["f1_diff"] == 100.0
    assert "the floor off" in answers.LABELS["ragbudget_floor_off"]


def test_a_cell_records_a_decline_by_the_library() -> None:
    from ragbudget.answer import declined_answer
    from ragbudget.evidence import Evidence

    answers = floor_off.answers
    low = Evidence(score=0.3, floor=0.45, source="calibrated")
    got = answers.answer_fields(declined_answer(low, 64, {}), {})
    assert got["declined_by_library"] is True and got["contexts"] == [] and got["context_tokens"] == 0
    high = Evidence(score=0.6, floor=0.45, source="calibrated")
    assert answers.answer_fields(declined_answer(high, 64, {}), {})["declined_by_library"] is False
