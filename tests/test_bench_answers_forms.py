"""bench/answers_forms.py: a finished answers run read again by a hand-written label of each
question's form; each part scored as the run scores, no question missing a label."""

from __future__ import annotations

import pytest
from _bench import REPO, load_bench

forms = load_bench("answers_forms.py", "bench_answers_forms", shadowed=("_llama", "answers"))


def raw() -> dict:
    questions = [
        {"qid": "n1", "answers": ["wine chiller"], "answerable": True},
        {"qid": "u1", "answers": ["white"], "answerable": True},
        {"qid": "n2", "answers": ["pulse"], "answerable": False},
        {"qid": "u2", "answers": ["five"], "answerable": False},
    ]
    cells = []
    for qid, rb, peer in (
        ("n1", "The wine chiller. [1]", "A fridge."),
        ("u1", "The documents do not contain an answer to this question.", "White."),
        ("n2", "The documents do not contain an answer to this question.", "Pulse."),
        ("u2", "Five seconds. [1]", "Ten."),
    ):
        cells.append({"system": "ragbudget", "budget": 256, "qid": qid, "answer": rb, "contexts": []})
        cells.append({"system": "langchain", "budget": 2048, "qid": qid, "answer": peer, "contexts": []})
    return {"questions": questions, "cells": cells, "systems": ["ragbudget", "langchain"], "budgets": [256, 2048]}


def test_each_form_is_scored_over_its_own_questions() -> None:
    got = forms.by_form(raw(), {"n1": "names", "n2": "names", "u1": "unnamed", "u2": "unnamed"})
    names, unnamed = got["names"], got["unnamed"]
    assert (names["questions_answerable"], names["questions_unanswerable"]) == (1, 1)
    assert names["summary"]["ragbudget@256"]["f1"] == 100.0
    assert names["summary"]["ragbudget@256"]["declined_unanswerable_pct"] == 100.0
    assert names["summary"]["ragbudget@256"]["wrongly_declined_pct"] == 0.0
    assert unnamed["summary"]["ragbudget@256"]["f1"] == 0.0
    assert unnamed["summary"]["ragbudget@256"]["declined_unanswerable_pct"] == 0.0
    assert unnamed["summary"]["ragbudget@256"]["wrongly_declined_pct"] == 100.0
    assert unnamed["summary"]["langchain@2048"]["f1"] == 100.0
    assert names["paired_f1_differences"]["ragbudget@256 - langchain@2048"]["f1_diff"] == 100.0


def test_a_question_without_a_label_stops_the_run() -> None:
    with pytest.raises(SystemExit, match="1 of the run's questions have no label"):
        forms.by_form(raw(), {"n1": "names", "n2": "names", "u1": "unnamed"})


def test_the_truth_labels_every_question_of_the_review_run_once() -> None:
    truth = forms.read_forms(REPO / "bench" / "truth" / "amazon_question_forms.tsv")
    assert len(truth) == 150 and set(truth.values()) == {"names", "unnamed"}
