"""Tables and paired differences from committed ``bench/qa.py`` results, without re-running them.

A qa.py run stores each system's 0/1 answer-in-context per question and budget
(``per_question_recall``), so a paired difference between two systems on the same questions, with
a bootstrap 95% interval, can be read off the committed file at any time::

    python bench/qa_report.py bench/results/qa_coqa.json
    python bench/qa_report.py bench/results/qa_squad_test_small_chunks.json --base ragbudget --vs greedy_fill

Nothing is measured here: every figure printed is a function of the JSON named on the command line
(:func:`_qa_harness.bootstrap_ci`, seeded, so the intervals are the same on every run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _qa_harness import bootstrap_ci  # noqa: E402


def paired(per_question: dict, base: str, other: str) -> dict[str, dict]:
    """``base`` minus ``other``, points, per budget: mean, 95% interval, questions gained / lost."""
    out = {}
    for b, rows in per_question[base].items():
        d = [100 * (x - y) for x, y in zip(rows, per_question[other][b], strict=True)]
        out[b] = {
            "mean": float(np.mean(d)),
            "ci95": bootstrap_ci(d),
            "gained": sum(v > 0 for v in d),
            "lost": sum(v < 0 for v in d),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", type=Path, help="a bench/results/qa_*.json written by bench/qa.py")
    ap.add_argument("--base", default="ragbudget", help="the system the others are subtracted from")
    ap.add_argument("--vs", nargs="*", default=None, help="systems to compare (default: all others)")
    args = ap.parse_args()
    try:
        r = json.loads(args.result.read_text(encoding="utf-8"))
        table, per_q = r["table"], r["per_question_recall"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{args.result}: not a bench/qa.py result ({e}); pass a bench/results/qa_*.json") from e
    if args.base not in per_q:
        raise SystemExit(f"--base {args.base!r} is not in {args.result.name}; systems: {', '.join(per_q)}")
    others = args.vs if args.vs is not None else [s for s in per_q if s != args.base]
    unknown = [s for s in others if s not in per_q]
    if unknown:
        raise SystemExit(f"--vs {', '.join(unknown)}: not in {args.result.name}; systems: {', '.join(per_q)}")

    budgets = list(table[args.base])
    print(
        f"{r.get('command', '')}\n{r['split']}: {r['chunks']} chunks, {r['questions']} questions; "
        f"answer in own document's chunks {r['answer_in_own_document_chunks']:.1f}%"
    )
    print("\nanswer in context % (filled %; answer left out though it fit %)")
    print(f"{'system':<22}" + "".join(f"{b:>22}" for b in budgets))
    for name, by_b in table.items():
        print(
            f"{name:<22}"
            + "".join(f"{v['recall']:>9.1f} ({v['fill']:>3.0f}; {v['answer_left_fit']:>4.1f})" for v in by_b.values())
        )
    print(f"\n{args.base} minus each, points (95% bootstrap interval) [questions gained/lost]")
    for other in others:
        p = paired(per_q, args.base, other)
        print(
            f"{other:<22}"
            + "".join(
                f"  {b}: {v['mean']:+.1f} ({v['ci95'][0]:+.1f}, {v['ci95'][1]:+.1f}) [{v['gained']}/{v['lost']}]"
                for b, v in p.items()
            )
        )


if __name__ == "__main__":
    main()
