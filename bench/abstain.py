"""The evidence floor under which ``ask`` declines without generating (issue #43 §3), chosen on a
tuning split and reported on others.

For each question of ``bench/answers.py``'s question sets (answerable: about an indexed article;
unanswerable: about an article of the same split that is not indexed), the library's own
``Pipeline.evidence(question)`` (the best sentence's cosine to the question among the top
retrieved chunks; the top hit's own score beside it) on an index of the folder ``answers.py`` writes, with every
default. A floor declines a question whose evidence is under it; for each candidate floor the
share of unanswerable questions declined and of answerable ones wrongly declined.

``--choose`` (on the tuning split only): the highest floor that wrongly declines at most
``--max-wrong`` of the answerable questions. The other splits report the chosen floor's rates.

**A floor per index** (``probe`` beside the fixed floors): an index of informal text (product
reviews) scores every question lower than an encyclopedia does, so one fixed cosine declines too
many of its answerable questions. The probe rule measures each index's own scale: the evidence of
60 off-topic questions written by hand for this benchmark (``abstain_probes.txt``, no benchmark
question among them) on that index, and declines under their median plus a margin; the margin is
chosen on the tuning split by the same rule as the fixed floor.

**A floor scaled per index** (``scaled``): the same probes, but the index's scale multiplies the
floor instead of shifting it — a question is declined under ``floor × (probe median ÷
PROBE_ORIGIN)``, read here as the signal ``sentence × PROBE_ORIGIN ÷ probe median`` on the fixed
floors' grid. An index whose every question scores lower (reviews) gets a proportionally lower
floor. Not the library's rule (yet): measured here to decide whether it should be.

**Scoped** (``--scoped``, written to ``abstain_scoped.json``): each question asked of one file, as
a product page asks of its product's reviews (``Pipeline.search(..., sources=FILE)``). Answerable:
the question limited to its own article's file; unanswerable: the same question limited to
another indexed article's file (the next one in the indexed order), which does not hold its
answer. The fixed floors' rates only (the probes are not scoped).

    python bench/abstain.py --splits squad-tune,squad-test,amazon --choose squad-tune
    python bench/abstain.py --splits squad-tune,squad-test,amazon --choose squad-tune --scoped
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import numpy as np  # noqa: E402
from answers import question_set, write_docs  # noqa: E402

FLOORS = [round(x, 3) for x in np.arange(0.0, 0.701, 0.025)]
#: Off-topic questions whose evidence on an index gives that index's own scale (the probe rule).
PROBES = [q for q in (HERE / "abstain_probes.txt").read_text(encoding="utf-8").splitlines() if q.strip()]
#: The probe signal is shifted by this so its floors read on the same grid as the fixed ones:
#: a probe floor f declines under the index's probe median + (f - PROBE_ORIGIN).
PROBE_ORIGIN = 0.3


def signals(split: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from ragbudget import Pipeline

    pool, indexed, questions = question_set(
        split, args.docs, args.questions, args.unanswerable, args.seed, scoped=args.scoped
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="abstain-") as tmp:
        docs = Path(tmp) / "docs"
        write_docs(pool, indexed, docs)
        with Pipeline(Path(tmp) / "index") as pipe:
            pipe.index([docs])
            t0 = time.perf_counter()
            for q in questions:
                if args.scoped:
                    for answerable, source in ((True, q["source"]), (False, other_file(q["source"], docs))):
                        got = evidence(pipe, q["text"], sources=source)
                        rows.append({"qid": q["qid"], "answerable": answerable, "source": source, **got})
                else:
                    rows.append({"qid": q["qid"], "answerable": q["answerable"], **evidence(pipe, q["text"])})
            print(f"{split}: {len(rows)} questions, {time.perf_counter() - t0:.1f} s", flush=True)
            probes = [pipe.evidence(p).score for p in PROBES]
    # The probe rule's signal: the question's evidence above its index's off-topic median.
    median = float(np.median(probes))
    for r in rows:
        r["probe"] = round(r["sentence"] - median + PROBE_ORIGIN, 6)
        r["scaled"] = round(r["sentence"] * PROBE_ORIGIN / median, 6)
    return rows, probes


def evidence(pipe: Any, question: str, sources: str | None = None) -> dict[str, float]:
    """The library's evidence (``Pipeline.evidence``: the best sentence cosine among the top
    hits, within ``sources`` when given) and, for comparison, the top hit's own score."""
    hits = pipe.search(question, k=pipe.retrieval.fetch_k, sources=sources)
    return {"hit": float(hits[0].score) if hits else 0.0, "sentence": pipe.evidence(question, hits=hits).score}


def other_file(source: str, docs: Path) -> str:
    """The indexed file after ``source`` in name order (the first after the last): a scope that
    does not hold the answer to a question about ``source``."""
    names = sorted(p.name for p in docs.glob("*.md"))
    return names[(names.index(source) + 1) % len(names)]


def rates(rows: list[dict[str, Any]], key: str, floor: float) -> tuple[float, float]:
    ans = [r[key] for r in rows if r["answerable"]]
    una = [r[key] for r in rows if not r["answerable"]]
    wrong = 100 * float(np.mean([v < floor for v in ans])) if ans else float("nan")
    right = 100 * float(np.mean([v < floor for v in una])) if una else float("nan")
    return right, wrong


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", default="squad-tune,squad-test,amazon")
    ap.add_argument("--choose", default="squad-tune", help="the split the floor is chosen on")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--unanswerable", type=int, default=200)
    ap.add_argument("--max-wrong", type=float, default=2.0, help="percent of answerable questions wrongly declined")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scoped", action="store_true", help="each question asked of one file (see the docstring)")
    args = ap.parse_args()
    splits = [s for s in args.splits.split(",") if s]
    data, probes = {}, {}
    for s in splits:
        data[s], probes[s] = signals(s, args)
    # The probes are asked of the whole index, so their rules do not apply to a scoped question.
    keys = ("sentence", "hit") if args.scoped else ("sentence", "hit", "probe", "scaled")
    table: dict[str, Any] = {}
    for s, rows in data.items():
        table[s] = {k: {str(f): rates(rows, k, f) for f in FLOORS} for k in keys}
    chosen: dict[str, float] = {}
    for k in keys:
        ok = [f for f in FLOORS if table[args.choose][k][str(f)][1] <= args.max_wrong]
        chosen[k] = max(ok) if ok else 0.0
    for k in keys:
        f = chosen[k]
        print(f"\n{k} floor {f} (chosen on {args.choose}: at most {args.max_wrong}% wrongly declined)")
        for s in splits:
            right, wrong = table[s][k][str(f)]
            median = float(np.median(probes[s]))
            floors = {"probe": median + f - PROBE_ORIGIN, "scaled": f * median / PROBE_ORIGIN}
            at = f" (floor {floors[k]:.3f})" if k in floors else ""
            print(f"  {s:>10}: unanswerable declined {right:5.1f}%, answerable wrongly declined {wrong:5.1f}%{at}")
    from _results import write

    write(
        "abstain_scoped" if args.scoped else "abstain",
        {
            "splits": splits,
            "chosen_on": args.choose,
            "max_wrong_pct": args.max_wrong,
            "chosen": chosen,
            "rates": table,
            "signals": data,
            "probe_origin": PROBE_ORIGIN,
            "probe_evidence": {s: [round(v, 6) for v in probes[s]] for s in splits},
            "probe_median": {s: round(float(np.median(probes[s])), 6) for s in splits},
            "args": vars(args),
        },
        packages=("sentence-transformers",),
    )


if __name__ == "__main__":
    main()
