"""Answer EM/F1 with the packaged SmolLM2-135M-Instruct: span packing against whole-chunk packing
at the same context budgets, on the same questions (issue #18's "span packing must not be worse
than whole-chunk packing"; issue #16's "EM/F1 with a confidence interval").

Ground as ``bench/spans_qa.py`` (``bench/_qa_harness.py``): one multi-document index per split,
the library's chunking (300–500 tokens), one hybrid candidate list per question given to both
packers. The two rows:

* ``chunks``: ``build_prompt`` with the library's defaults (``pack="chunks"``, relevance floor 0.5,
  ``fill_remainder`` off) — what ``Pipeline()``/``ragbudget ask`` packs today;
* ``spans``: the same with ``pack="spans"`` and one ``SpanScorer`` per split over the index's
  MiniLM — what ``Pipeline(pack="spans")`` packs.

Each prompt goes to ``Generator().generate(prompt, max_new_tokens=32)`` (packaged SmolLM2-135M-
Instruct on the CPU, greedy: no temperature), the harness's QA system prompt ("reply with only
the answer") for both rows. Scores are SQuAD v1.1's official ones (``_qa_harness.exact_match`` and
``f1_score``, written from its ``evaluate-v1.1.py``: lower-case, drop punctuation, drop a/an/the, collapse white space;
EM and token F1, the max over the gold answers), with a percentile bootstrap 95% interval over
questions and the interval of the paired difference (spans − chunks, the same questions).

    python bench/spans_f1.py --split squad-test --docs 12 --questions 150 --budgets 256 --seconds 2700
    python bench/spans_f1.py --split squad-test --docs 12 --questions 150 --budgets 1024 --seconds 2700

(one process per budget, run side by side: the same seeded questions in the same order, so the
first n of each are the same questions). Writes ``bench/results/spans_f1_<split>_<budgets>.json``
(per-question predictions included); ``--time N`` answers N questions and only prints the seconds
per answer (to size the sample).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _qa_harness as H  # noqa: E402  (sets the offline environment first)
import numpy as np  # noqa: E402

PACKS = ("chunks", "spans")


# -- SQuAD v1.1's evaluate script: bench/_qa_harness.py's exact_match and f1_score ---------------
def best(metric, prediction: str, truths) -> float:  # metric_max_over_ground_truths
    return max(metric(prediction, t) for t in truths)


def clean_answer(text: str) -> str:
    """The model's answer without citation markers ("[1]"), which no gold answer has."""
    return re.sub(r"\[\d+\]", "", text).strip()


def summarize(rows: list[dict], budgets: list[int]) -> dict:
    out: dict = {}
    for b in budgets:
        cell: dict = {"n": len(rows)}
        for pack in PACKS:
            for m in ("em", "f1", "recall"):
                H.mean_cell(cell, f"{pack}_{m}", [100 * r[str(b)][pack][m] for r in rows])
            cell[f"{pack}_mean_prompt_tokens"] = float(np.mean([r[str(b)][pack]["prompt_tokens"] for r in rows]))
            cell[f"{pack}_mean_seconds"] = float(np.mean([r[str(b)][pack]["seconds"] for r in rows]))
        for m in ("f1", "em"):
            d = [100 * (r[str(b)]["spans"][m] - r[str(b)]["chunks"][m]) for r in rows]
            H.mean_cell(cell, f"{m}_diff_spans_minus_chunks", d, ci_key=f"{m}_diff_ci95")
        out[str(b)] = cell
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=H.REPORT_SPLITS, default="squad-test")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--questions", type=int, default=150, help="seeded sample answered")
    ap.add_argument("--budgets", default="256,1024", help="context tokens, comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--time", type=int, default=0, help="only time N answers per cell and exit")
    ap.add_argument(
        "--seconds",
        type=float,
        default=0,
        help="stop answering after this many seconds (0: never) and report the questions answered",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: on this shared 2-core host one thread answered 4-7x "
        "faster than two, which spin against the other jobs)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        raise SystemExit(f"--budgets {args.budgets!r}: expected integers separated by commas") from None
    t_start = time.time()

    import torch

    from ragbudget.generation.generate import Generator
    from ragbudget.packing.spans import SpanScorer

    torch.set_num_threads(args.threads)
    gen = Generator()
    split = H.load_split(args.split, docs=args.docs, seed=args.seed)
    n = args.time or args.questions
    questions = H.sample_questions(split, n, seed=args.seed)
    corpus = H.Corpus.build(split, questions)
    packer = H.Packer(gen.tokenizer, span_scorer=SpanScorer(corpus.sentence_embedder()))
    print(f"{args.split}: {len(corpus.texts)} chunks, {len(questions)} questions, budgets {budgets}", flush=True)

    rows: list[dict] = []
    t0 = time.time()
    for q in questions:
        if args.seconds and time.time() - t0 > args.seconds:
            break
        cands = corpus.candidates(q, **H.DEFAULT_RETRIEVAL)
        row: dict = {"qid": q.qid, "question": q.text, "answers": list(q.answers)}
        for b in budgets:
            row[str(b)] = {}
            for pack in PACKS:
                system, opts = ("ragbudget_spans", {}) if pack == "spans" else ("ragbudget", {"fill_remainder": False})
                packed = packer.pack(system, q.text, cands, b, **opts)
                g = gen.generate(packed.prompt, max_new_tokens=args.max_new_tokens)
                pred = clean_answer(g.text)
                row[str(b)][pack] = {
                    "prediction": pred,
                    "em": best(H.exact_match, pred, q.answers),
                    "f1": best(H.f1_score, pred, q.answers),
                    "recall": H.score(corpus, q, packed)["recall"],
                    "prompt_tokens": g.prompt_tokens,
                    "seconds": round(g.seconds, 2),
                }
        rows.append(row)
        if len(rows) % 10 == 0 or args.time:
            print(f"  answered {len(rows)} ({time.time() - t0:.0f}s)", flush=True)
    summary = summarize(rows, budgets)
    if args.time:
        per = (time.time() - t0) / (len(rows) * len(budgets) * len(PACKS))
        print(f"{per:.2f} s per answer; {150 * len(budgets) * len(PACKS) * per / 60:.0f} min for 150 questions")
        return
    print(f"\n{len(rows)} questions; EM / F1 (95% interval); spans − chunks F1 (95% interval)")
    for b, c in summary.items():
        print(
            f"  {b:>5}: chunks EM {c['chunks_em']:.1f} F1 {c['chunks_f1']:.1f} {c['chunks_f1_ci95']}; "
            f"spans EM {c['spans_em']:.1f} F1 {c['spans_f1']:.1f} {c['spans_f1_ci95']}; "
            f"diff {c['f1_diff_spans_minus_chunks']:+.1f} {c['f1_diff_ci95']}"
        )
    result = {
        "split": args.split,
        "documents": list(split.titles),
        "chunks": len(corpus.texts),
        "questions": len(rows),
        "budgets": budgets,
        "max_new_tokens": args.max_new_tokens,
        "setup": (
            "one index per split (chunk_text 300-500), hybrid candidates as Index.search; "
            "chunks = build_prompt defaults (relevance floor 0.5, fill_remainder off); spans = "
            "pack='spans' with one SpanScorer over the index's MiniLM; Generator() packaged "
            "SmolLM2-135M-Instruct, CPU, greedy; system prompt bench/_qa_harness.QA_SYSTEM; "
            "SQuAD v1.1 EM/F1 (max over gold answers), citation markers removed"
        ),
        "summary": summary,
        "rows": rows,
        "seconds": round(time.time() - t_start, 1),
        "args": vars(args),
    }
    from _results import write

    name = f"spans_f1_{args.split.replace('-', '_')}_{'_'.join(map(str, budgets))}"
    out = args.out or (H.ROOT / "bench" / "results" / f"{name}.json")
    write(out.stem, result, folder=out.parent, packages=("sentence-transformers", "tokenizers"))


if __name__ == "__main__":
    main()
