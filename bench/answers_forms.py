"""An answers run read again by the form of each question, from a hand-written label.

SQuADShifts Amazon questions were written beside one review: many ask about "the product", "it"
or "the reviewer" and name nothing (``bench/truth/amazon_question_forms.tsv``, labelled by hand
from the question alone). Over 40 products' reviews in one index such a question has an answer in
many reviews, so a question about a product that is not indexed still finds sentences that answer
it, and an answerable one finds other products' answers. This splits a finished run's cells
(``bench/answers.py`` / ``answers_floor.py``, nothing asked again) by that label and scores each
part as the run did: F1, the declines, the paired differences with their intervals.

    python bench/answers_forms.py bench/results/answers_amazon_0_5b_120q.json \\
        --truth bench/truth/amazon_question_forms.tsv --name answers_amazon_0_5b_120q_forms
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import answers  # noqa: E402
import answers_floor  # noqa: E402, F401  (registers the floor-off row, so its cells score as ragbudget's)
from _results import write  # noqa: E402


def read_forms(path: Path) -> dict[str, str]:
    with path.open(encoding="utf-8", newline="") as f:
        return {row["qid"]: row["form"] for row in csv.DictReader(f, delimiter="\t")}


def by_form(raw: dict[str, Any], forms: dict[str, str]) -> dict[str, Any]:
    """``raw``'s summary and paired differences again over each form's questions."""
    missing = [q["qid"] for q in raw["questions"] if q["qid"] not in forms]
    if missing:
        raise SystemExit(f"{len(missing)} of the run's questions have no label (first: {missing[0]})")
    out: dict[str, Any] = {}
    for form in sorted(set(forms.values())):
        questions = [q for q in raw["questions"] if forms[q["qid"]] == form]
        qids = {q["qid"] for q in questions}
        cells = [c for c in raw["cells"] if c["qid"] in qids]
        summary, diffs = answers.summarize(cells, questions, raw["systems"], raw["budgets"])
        out[form] = {
            "questions_answerable": sum(q["answerable"] for q in questions),
            "questions_unanswerable": sum(not q["answerable"] for q in questions),
            "summary": summary,
            "paired_f1_differences": diffs,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", type=Path, help="a raw result of bench/answers.py (its cells)")
    ap.add_argument("--truth", type=Path, default=HERE / "truth" / "amazon_question_forms.tsv")
    ap.add_argument("--name", required=True, help="bench/results/NAME.json")
    args = ap.parse_args()
    raw = json.loads(args.raw.read_text(encoding="utf-8"))
    forms = by_form(raw, read_forms(args.truth))
    for form, part in forms.items():
        print(f"{form}: {part['questions_answerable']} answerable, {part['questions_unanswerable']} unanswerable")
        answers.print_summary(part["summary"], part["paired_f1_differences"])
    write(
        args.name,
        {
            "source": str(args.raw.resolve().relative_to(HERE.parent)),
            "source_commit": (raw.get("versions") or {}).get("ragbudget_commit"),
            "truth": str(args.truth.resolve().relative_to(HERE.parent)),
            "forms": forms,
        },
    )


if __name__ == "__main__":
    main()
