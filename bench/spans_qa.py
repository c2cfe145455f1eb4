"""Span packing on the QA harness: ``pack="spans"`` against whole-chunk packing and the baselines,
all given the same hybrid-ranked candidates from one multi-document index per split.

The harness (splits, index, candidate lists, the labeled-block costs in SmolLM2 tokens, recall of
a gold answer inside a passage of the question's own document) is ``bench/_qa_harness.py``; this
script adds ``ragbudget_spans``: ``build_prompt(pack="spans", span_scorer=SpanScorer(...))`` as
``Pipeline(pack="spans")`` runs it — the library's relevance floor, one :class:`SpanScorer` per
split over the index's own embedder (packaged MiniLM), so sentence vectors are shared across
questions and budgets. Rows:

* ``topk_truncate``, ``greedy_fill`` (the baselines), ``ragbudget_chunks`` (whole-chunk packing
  with the library's defaults: ``fill_remainder`` off) and ``ragbudget`` (the same with
  ``--fill-remainder``, the row ``bench/qa.py`` reports) at 128 … 2,048 tokens;
* ``ragbudget_spans`` at 128 … 1,024 tokens;
* ``--sweep`` (``squad-tune`` only): span packing's hand-set knobs one at a time — the evidence
  weights (dense, lexical, chunk), ``pool`` (chunk text considered, × the budget) and
  ``max_chunks`` — to check the defaults on data nothing is reported on;
* ``--timing N``: for the first N sampled questions, the time ``build_prompt`` takes with span
  packing against whole-chunk packing at 256 and 1,024 tokens, with a fresh scorer (every
  sentence embedded: the first time a chunk is seen) and again with the same scorer (cached), and
  SmolLM2's prefill of the span prompt (one generated token) for scale.

    python bench/spans_qa.py --split squad-tune --docs 12 --questions 150 --sweep
    python bench/spans_qa.py --split squad-test --docs 12 --questions 150 --timing 20
    python bench/spans_qa.py --split amazon --docs 40 --questions 150 --timing 20

Writes ``bench/results/qa_spans_<split>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _qa_harness as H  # noqa: E402  (sets the offline environment first)
import numpy as np  # noqa: E402

LABELS = {
    "topk_truncate": "top-4 then truncate",
    "greedy_fill": "greedy fill, last cut",
    "ragbudget_chunks": "ragbudget --pack chunks",
    "ragbudget": "ragbudget --fill-remainder",
    "ragbudget_spans": "ragbudget --pack spans",
}
SPAN_BUDGETS = (128, 256, 512, 1024)
#: One knob at a time around the first defaults (weights 0.4/0.4/0.2, pool 3, max 12 chunks),
#: stated explicitly so a rerun measures the same settings whatever the library's defaults are.
#: The committed sweep (bench/results/qa_spans_squad_tune.json) ran these when pool 3 was the
#: default (its ``ragbudget_spans`` row is pool 3); pool 4 / 8 and pool 5 with 20 chunks followed
#: (``--extra``, qa_spans_squad_tune_followup.json), and pool 8 became the default.
SWEEP = {
    "w0.6/0.2/0.2": {"weights": (0.6, 0.2, 0.2), "pool": 3.0},
    "w0.2/0.6/0.2": {"weights": (0.2, 0.6, 0.2), "pool": 3.0},
    "w0.5/0.5/0": {"weights": (0.5, 0.5, 0.0), "pool": 3.0},
    "w0.3/0.3/0.4": {"weights": (0.3, 0.3, 0.4), "pool": 3.0},
    "pool2": {"pool": 2.0},
    "pool3": {"pool": 3.0},
    "pool5": {"pool": 5.0},
    "max6": {"max_chunks": 6, "pool": 3.0},
}


def configs(args: argparse.Namespace) -> dict[str, dict]:
    cfg: dict[str, dict] = {
        "topk_truncate": {"system": "topk_truncate"},
        "greedy_fill": {"system": "greedy_fill"},
        "ragbudget_chunks": {"system": "ragbudget", "select": {"fill_remainder": False}},
        "ragbudget": {"system": "ragbudget"},
        "ragbudget_spans": {"system": "ragbudget_spans", "budgets": SPAN_BUDGETS},
    }
    if args.sweep:
        for name, opts in SWEEP.items():
            cfg[f"ragbudget_spans_{name}"] = {"system": "ragbudget_spans", "budgets": SPAN_BUDGETS, "select": opts}
    for extra in args.extra:  # e.g. "pool=5,max_chunks=20" (tune split only)
        opts = {}
        for kv in extra.split(","):
            k, _, v = kv.partition("=")
            try:
                opts[k] = {
                    "weights": lambda v: tuple(float(x) for x in v.split("/")),
                    "pool": float,
                    "max_chunks": int,
                }[k](v)
            except (KeyError, ValueError):
                raise SystemExit(
                    f"--extra {extra!r}: expected comma-separated pool=<number>, "
                    "max_chunks=<integer> or weights=<dense>/<lexical>/<chunk>"
                ) from None
        cfg[f"ragbudget_spans_{extra}"] = {"system": "ragbudget_spans", "budgets": SPAN_BUDGETS, "select": opts}
    return cfg


def timing(
    corpus: H.Corpus, packer: H.Packer, questions: list, gen: object, budgets: tuple[int, ...] = (256, 1024)
) -> dict:
    """Seconds ``build_prompt`` takes per question: chunks vs spans cold (fresh scorer, every
    sentence embedded) and warm (the same scorer again), and the generator's prefill for scale."""
    from ragbudget.packing.spans import SpanScorer

    rows = []
    for q in questions:
        cands = corpus.candidates(q, **H.DEFAULT_RETRIEVAL)
        for b in budgets:
            t = time.perf_counter()
            packer.pack("ragbudget", q.text, cands, b, fill_remainder=False)
            chunks_s = time.perf_counter() - t
            emb = corpus.sentence_embedder(cached=False)
            cold = H.Packer(packer.tok, span_scorer=SpanScorer(emb))
            cold.builder = packer.builder  # the same token counts memo: only span work is timed
            t = time.perf_counter()
            cold.pack("ragbudget_spans", q.text, cands, b)
            cold_s = time.perf_counter() - t
            t = time.perf_counter()
            p = cold.pack("ragbudget_spans", q.text, cands, b)
            warm_s = time.perf_counter() - t
            t = time.perf_counter()
            gen.generate(p.prompt, max_new_tokens=1)
            prefill_s = time.perf_counter() - t
            rows.append(
                {
                    "qid": q.qid,
                    "budget": b,
                    "chunks_s": chunks_s,
                    "spans_cold_s": cold_s,
                    "spans_warm_s": warm_s,
                    "prefill_s": prefill_s,
                    "sentences_embedded": emb.embedded,
                    "prompt_tokens": p.prompt.n_tokens,
                }
            )
    summary = {}
    for b in budgets:
        rs = [r for r in rows if r["budget"] == b]

        def med(key: str, rs: list = rs) -> float:
            return statistics.median(r[key] for r in rs)

        summary[str(b)] = {
            "n": len(rs),
            "median_added_cold_ms": 1000 * statistics.median(r["spans_cold_s"] - r["chunks_s"] for r in rs),
            "median_added_warm_ms": 1000 * statistics.median(r["spans_warm_s"] - r["chunks_s"] for r in rs),
            "median_chunks_ms": 1000 * med("chunks_s"),
            "median_prefill_ms": 1000 * med("prefill_s"),
            "median_sentences_embedded": med("sentences_embedded"),
        }
        s = summary[str(b)]
        s["cold_over_prefill"] = s["median_added_cold_ms"] / s["median_prefill_ms"]
        s["warm_over_prefill"] = s["median_added_warm_ms"] / s["median_prefill_ms"]
    return {"summary": summary, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=H.SPLITS, default="squad-test")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="4 documents, 10 questions, result in the ignored bench/out/qa_spans_quick.json",
    )
    ap.add_argument("--docs", type=int, default=12, help="documents in the split's one index")
    ap.add_argument("--questions", type=int, default=150, help="seeded sample (0: all)")
    ap.add_argument("--sweep", action="store_true", help="span packing's knobs (tuning split only)")
    ap.add_argument(
        "--extra",
        action="append",
        default=[],
        help="another span setting, e.g. pool=5,max_chunks=20 (tuning split only)",
    )
    ap.add_argument("--timing", type=int, default=0, help="questions timed cold/warm (see above)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.docs, args.questions, args.timing = min(args.docs, 4), 10, min(args.timing, 2)
        args.out = args.out or H.OUT / "qa_spans_quick.json"
    if (args.sweep or args.extra) and args.split != "squad-tune":
        raise SystemExit("--sweep/--extra choose defaults: run them on --split squad-tune only")
    cfg = configs(args)  # before any loading: a bad --extra fails at once
    t_start = time.time()

    from ragbudget.generation.generate import Generator
    from ragbudget.packing.spans import SpanScorer

    gen = Generator()
    split = H.load_split(args.split, docs=args.docs, seed=args.seed)
    questions = H.sample_questions(split, args.questions, seed=args.seed)
    corpus = H.Corpus.build(split, questions)
    packer = H.Packer(gen.tokenizer, span_scorer=SpanScorer(corpus.sentence_embedder()))
    print(
        f"{args.split}: {len(split.titles)} documents, {len(corpus.texts)} chunks in one index, "
        f"{len(questions)} of {len(split.questions)} questions ({time.time() - t_start:.0f}s)",
        flush=True,
    )

    t0 = time.time()
    grid = H.run_grid(
        corpus,
        packer,
        questions,
        cfg,
        H.BUDGETS,
        progress=lambda i: (
            print(f"  {i}/{len(questions)} ({time.time() - t0:.0f}s)", flush=True) if i % 25 == 0 else None
        ),
    )
    grid_s = time.time() - t0
    table, per_question = H.grid_tables(grid)

    print(f"\nanswer in context (%) / fill (%) / answer left out though it fit (%), {len(questions)} questions")
    print(f"{'system':<34}" + "".join(f"{b:>18}" for b in H.BUDGETS))
    for name, by_b in table.items():
        cells = [
            f"{by_b[b]['recall']:>7.1f} /{by_b[b]['fill']:>4.0f} /{by_b[b]['answer_left_fit']:>3.1f}"
            if b in by_b
            else f"{'—':>18}"
            for b in H.BUDGETS
        ]
        print(f"{LABELS.get(name, name):<34}" + "".join(cells))

    # Paired differences (spans − the others), with a bootstrap interval, at each span budget.
    paired = {}
    for other in ("greedy_fill", "ragbudget_chunks", "ragbudget"):
        paired[other] = {}
        for b in SPAN_BUDGETS:
            pairs = zip(per_question["ragbudget_spans"][b], per_question[other][b], strict=True)
            d = [100 * (s - o) for s, o in pairs]  # the same questions, paired
            paired[other][b] = {"mean": float(np.mean(d)), "ci95": H.bootstrap_ci(d)}
    best_2048 = max(table[s][2048]["recall"] for s in ("topk_truncate", "greedy_fill"))
    targets = {
        "best_baseline_at_2048": best_2048,
        "spans_at_256": table["ragbudget_spans"][256]["recall"],
        "spans_256_ge_best_baseline_2048": table["ragbudget_spans"][256]["recall"] >= best_2048,
        "spans_at_1024": table["ragbudget_spans"][1024]["recall"],
        "spans_1024_ge_97": table["ragbudget_spans"][1024]["recall"] >= 97.0,
    }
    print("\nspans − other, points (95% interval):")
    for other, by_b in paired.items():
        print(
            f"  vs {other:<18}"
            + "  ".join(f"{b}: {v['mean']:+.1f} ({v['ci95'][0]:+.1f}, {v['ci95'][1]:+.1f})" for b, v in by_b.items())
        )
    print("targets:", targets)

    result = {
        "split": args.split,
        "note": split.note,
        "documents": list(split.titles),
        "chunks": len(corpus.texts),
        "questions": len(questions),
        "questions_in_split": len(split.questions),
        "answer_in_own_document_chunks": 100 * float(np.mean([H.answerable(corpus, q) for q in questions])),
        "setup": (
            f"all {len(split.titles)} documents in one index; chunk_text 300-500 tokens; packaged "
            f"MiniLM + FTS5 BM25 fused as Index.search(hybrid=True) ({H.DEFAULT_RETRIEVAL}); every "
            "system gets the same candidate list; budgets in SmolLM2 tokens, labeled blocks "
            "charged alike; span packing: build_prompt(pack='spans') with one SpanScorer per "
            "split over the index's MiniLM, relevance floor 0.5 as every ragbudget row"
        ),
        "budgets": list(H.BUDGETS),
        "span_budgets": list(SPAN_BUDGETS),
        "systems": cfg,
        "table": table,
        "paired_spans_minus": paired,
        "targets": targets,
        "per_question_recall": per_question,
        "question_ids": [q.qid for q in questions],
        "grid_seconds": round(grid_s, 1),
        "args": vars(args),
    }
    if args.timing:
        print(f"\ntiming {args.timing} questions (cold: fresh scorer; warm: the same again)", flush=True)
        result["timing"] = timing(corpus, packer, questions[: args.timing], gen)
        for b, s in result["timing"]["summary"].items():
            print(
                f"  {b:>5}: added cold {s['median_added_cold_ms']:.0f} ms, warm "
                f"{s['median_added_warm_ms']:.0f} ms; prefill {s['median_prefill_ms']:.0f} ms "
                f"(cold/prefill {s['cold_over_prefill']:.2f}); "
                f"{s['median_sentences_embedded']:.0f} sentences embedded"
            )
    result["seconds"] = round(time.time() - t_start, 1)
    from _results import write

    out = args.out or (H.ROOT / "bench" / "results" / f"qa_spans_{args.split.replace('-', '_')}.json")
    write(out.stem, result, folder=out.parent, packages=("sentence-transformers", "tokenizers"))


if __name__ == "__main__":
    main()
