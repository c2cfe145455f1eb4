"""QA under a context budget: ragbudget's selection against top-k-then-truncate and greedy fill,
all given the same hybrid-ranked candidates from one multi-document index per split.

The harness (splits, index, systems, scores) is ``bench/_qa_harness.py``. One run measures one
split and writes ``bench/results/qa_<split>.json``:

* answer-in-context recall (a gold answer in a selected passage of the question's own document),
  the share of the allowance filled, and the share of prompts where a retrieved chunk holding the
  answer was left out although it would have fit whole in the unused room — at 128, 256, 512,
  1,024 and 2,048 generator (SmolLM2) tokens, for ``topk_truncate`` (top 4, LangChain's default
  ``k``), ``greedy_fill`` and ``ragbudget`` (the library's defaults);
* ``--dense``: the same for ``greedy_fill`` and ``ragbudget`` over dense-only candidates (what
  hybrid retrieval adds, apart from packing);
* ``--ablate``: ragbudget with one selection stage turned off at a time (:data:`ABLATIONS`:
  ``fill_remainder``, the relevance floor, the oversize window, MMR, merging; and both cuts), with
  the paired difference to the full ``ragbudget`` row and its bootstrap 95% interval;
* ``--sweep`` (tuning split only): ragbudget's recall for both fusion methods × lexical weights
  0.3 / 0.5 / 0.7, to check the library's default on data it is not reported on;
* ``--gen-n N``: SmolLM2-135M-Instruct (CPU, greedy) answers a seeded sample of N questions with
  ragbudget's and greedy fill's context at ``--gen-budget``: EM / F1 with bootstrap 95% intervals
  and the paired difference.

    python bench/qa.py --split squad-tune --docs 12 --questions 150 --sweep
    python bench/qa.py --split squad-test --docs 12 --questions 300 --dense --gen-n 100
    python bench/qa.py --split amazon --docs 40 --questions 300
    python bench/qa.py --split coqa --docs 200 --questions 0
    python bench/qa.py --split squad-test --docs 12 --questions 200 --ablate \
        --out bench/results/qa_squad_test_ablate.json
    python bench/qa.py --split squad-test --docs 12 --questions 200 --chunk-min 40 --chunk-max 160 \
        --out bench/results/qa_squad_test_small_chunks.json      # the non-default small chunks

Paired differences between any two rows of a committed result: ``bench/qa_report.py``.
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

# bench/floor.py and bench/engines.py import the SQuAD scoring and paths from here.
from _qa_harness import OUT, ROOT, SQUAD, contains_answer, exact_match, f1_score, normalize_answer  # noqa: E402,F401

from ragbudget.retrieval.index import FUSIONS  # noqa: E402


def embed(texts: list[str], cache: Path) -> np.ndarray:
    """Unit vectors of ``texts`` (packaged MiniLM), cached at ``cache`` (bench/floor.py's cache)."""
    if cache.is_file():
        arr = np.load(cache)
        if arr.shape[0] == len(texts):
            return arr
    arr = H._embedder().encode(texts, batch_size=32, normalize_embeddings=True, show_progress_bar=False)
    np.save(cache, arr)
    return arr


LABELS = {
    "topk_truncate": "top-4 then truncate",
    "greedy_fill": "greedy fill, last cut",
    "ragbudget": "ragbudget --fill-remainder",
    "greedy_fill_dense": "greedy fill, dense only",
    "ragbudget_dense": "ragbudget, dense only",
}


#: ``--ablate``: each stage of ``select_chunks`` turned off on its own, everything else as the
#: ``ragbudget`` row (library defaults plus ``fill_remainder``), so the loss against that row is
#: what the stage adds on top of the others. ``no_cuts`` turns off both stages that cut a chunk,
#: because each one alone is partly covered by the other (with no window for an oversize best
#: chunk, ``fill_remainder`` windows that same chunk as "the best one left out").
ABLATIONS: dict[str, tuple[dict, str]] = {
    "no_fill": (
        {"fill_remainder": False},
        "no fill_remainder (the library default): the room after whole chunks stays empty",
    ),
    "no_floor": ({"relevance_floor": 0.0}, "no relevance floor"),
    "no_window": ({"truncate_oversize": False}, "no window for an oversize best chunk (it is skipped, not cut)"),
    # redundancy > 1 never drops a near-copy, lambda_ 1 never discounts one; exact duplicates
    # (same normalized text) still go: that is dedup, not MMR.
    "no_mmr": ({"lambda_": 1.0, "redundancy": 1.01}, "no redundancy penalty or drop (MMR off)"),
    "no_merge": ({"merge_adjacent": False}, "no merging of neighbouring chunks"),
    "no_cuts": (
        {"truncate_oversize": False, "fill_remainder": False},
        "whole chunks only: neither the oversize window nor fill_remainder",
    ),
}


def configs(args: argparse.Namespace) -> dict[str, dict]:
    cfg: dict[str, dict] = {s: {"system": s} for s in H.SYSTEMS}
    if args.dense:
        cfg["greedy_fill_dense"] = {"system": "greedy_fill", "retrieval": {"hybrid": False}}
        cfg["ragbudget_dense"] = {"system": "ragbudget", "retrieval": {"hybrid": False}}
    if args.ablate:
        cfg.update(
            {f"ragbudget_{name}": {"system": "ragbudget", "select": opts} for name, (opts, _) in ABLATIONS.items()}
        )
    if args.sweep:
        for f in FUSIONS:
            for w in (0.3, 0.5, 0.7):
                if (f, w) != ("score", 0.5):  # the default is ``ragbudget`` itself
                    cfg[f"ragbudget_{f}@{w}"] = {"system": "ragbudget", "retrieval": {"fusion": f, "lexical_weight": w}}
    return cfg


def generate(args: argparse.Namespace, corpus: H.Corpus, packer: H.Packer, questions: list, gen: object) -> dict:
    """EM/F1 of SmolLM2's answers with ragbudget's and greedy fill's contexts (same questions)."""
    rows: list[dict] = []
    t0 = time.time()
    for q in questions[: args.gen_n]:
        if time.time() - t0 > args.gen_seconds:
            break
        cands = corpus.candidates(q, **H.DEFAULT_RETRIEVAL)
        row: dict = {"qid": q.qid, "question": q.text, "answers": list(q.answers)}
        for system in ("ragbudget", "greedy_fill"):
            packed = packer.pack(system, q.text, cands, args.gen_budget)
            prompt = packer.prompt_of(q.text, packed, cands)
            g = gen.generate(prompt, max_new_tokens=args.max_new_tokens)
            pred = re.sub(r"\[\d+\]", "", g.text).strip()
            row[system] = {
                "prediction": pred,
                "em": max(H.exact_match(pred, a) for a in q.answers),
                "f1": max(H.f1_score(pred, a) for a in q.answers),
                "recall": H.score(corpus, q, packed)["recall"],
                "prompt_tokens": g.prompt_tokens,
                "seconds": round(g.seconds, 2),
            }
        rows.append(row)
        if len(rows) % 10 == 0:
            print(f"  answered {len(rows)} ({time.time() - t0:.0f}s)", flush=True)
    summary: dict = {"n": len(rows), "budget": args.gen_budget, "max_new_tokens": args.max_new_tokens}
    for system in ("ragbudget", "greedy_fill"):
        for m in ("em", "f1", "recall"):
            v = [100 * r[system][m] for r in rows]
            summary[f"{system}_{m}"] = float(np.mean(v)) if v else None
            summary[f"{system}_{m}_ci95"] = H.bootstrap_ci(v)
        summary[f"{system}_mean_prompt_tokens"] = float(np.mean([r[system]["prompt_tokens"] for r in rows]))
        summary[f"{system}_mean_seconds"] = float(np.mean([r[system]["seconds"] for r in rows]))
    diff = [100 * (r["ragbudget"]["f1"] - r["greedy_fill"]["f1"]) for r in rows]
    summary["f1_diff_ragbudget_minus_greedy"] = float(np.mean(diff)) if diff else None
    summary["f1_diff_ci95"] = H.bootstrap_ci(diff)
    return {"summary": summary, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=H.SPLITS, default="squad-test")
    ap.add_argument(
        "--quick", action="store_true", help="4 documents, 20 questions, result in the ignored bench/out/qa_quick.json"
    )
    ap.add_argument("--docs", type=int, default=12, help="documents in the split's one index")
    ap.add_argument("--questions", type=int, default=300, help="seeded sample (0: all)")
    ap.add_argument("--chunk-min", type=int, default=300)
    ap.add_argument("--chunk-max", type=int, default=500)
    ap.add_argument("--dense", action="store_true", help="also dense-only candidates")
    ap.add_argument("--sweep", action="store_true", help="fusion x lexical weight (tuning split)")
    ap.add_argument(
        "--ablate", action="store_true", help="also ragbudget with each selection stage turned off, one at a time"
    )
    ap.add_argument("--gen-n", type=int, default=0, help="questions answered by SmolLM2")
    ap.add_argument("--gen-budget", type=int, default=512)
    ap.add_argument("--gen-seconds", type=float, default=1800, help="stop generating after this")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="result file (default bench/results/qa_<split>.json)")
    args = ap.parse_args()
    if args.quick:
        args.docs, args.questions = min(args.docs, 4), 20
        args.gen_n = min(args.gen_n, 2)
        args.out = args.out or H.OUT / "qa_quick.json"
    if args.sweep and args.split != "squad-tune":
        raise SystemExit("--sweep chooses defaults: run it on --split squad-tune only")
    t_start = time.time()

    from ragbudget.generation.generate import Generator

    gen = Generator()
    packer = H.Packer(gen.tokenizer)
    split = H.load_split(args.split, docs=args.docs, seed=args.seed)
    questions = H.sample_questions(split, args.questions, seed=args.seed)
    corpus = H.Corpus.build(split, questions, chunk_min=args.chunk_min, chunk_max=args.chunk_max)
    answerable = 100 * float(np.mean([H.answerable(corpus, q) for q in questions]))
    print(
        f"{args.split}: {len(split.titles)} documents, {len(corpus.texts)} chunks in one index, "
        f"{len(questions)} of {len(split.questions)} questions ({time.time() - t_start:.0f}s)",
        flush=True,
    )

    cfg = configs(args)
    t0 = time.time()
    grid = H.run_grid(
        corpus,
        packer,
        questions,
        cfg,
        H.BUDGETS,
        progress=lambda i: (
            print(f"  {i}/{len(questions)} ({time.time() - t0:.0f}s)", flush=True) if i % 50 == 0 else None
        ),
    )
    table, per_question = H.grid_tables(grid)

    print(f"\nanswer in context (%) / fill (%) / answer left out though it fit (%), {len(questions)} questions")
    print(f"{'system':<26}" + "".join(f"{b:>18}" for b in H.BUDGETS))
    for name, by_b in table.items():
        print(
            f"{LABELS.get(name, name):<26}"
            + "".join(f"{v['recall']:>7.1f} /{v['fill']:>4.0f} /{v['answer_left_fit']:>3.1f}" for v in by_b.values())
        )

    ablation = None
    if args.ablate:
        # Paired over the same questions: full ragbudget minus the row with one stage off.
        ablation = {}
        print("\nwhat each stage adds: ragbudget minus ragbudget without it, points (95% interval)")
        for name, (opts, what) in ABLATIONS.items():
            row = per_question[f"ragbudget_{name}"]
            by_b = {}
            for b in H.BUDGETS:
                d = [100 * (full - off) for full, off in zip(per_question["ragbudget"][b], row[b], strict=True)]
                by_b[b] = {
                    "mean": float(np.mean(d)),
                    "ci95": H.bootstrap_ci(d),
                    "gained": sum(x > 0 for x in d),
                    "lost": sum(x < 0 for x in d),
                }
            ablation[name] = {"select": opts, "what": what, "full_minus_off": by_b}
            print(
                f"  {name:<10}"
                + "".join(
                    f"  {b}: {v['mean']:+5.1f} ({v['ci95'][0]:+.1f}, {v['ci95'][1]:+.1f})" for b, v in by_b.items()
                )
            )

    result = {
        "split": args.split,
        "note": split.note,
        "documents": list(split.titles),
        "chunks": len(corpus.texts),
        "questions": len(questions),
        "questions_in_split": len(split.questions),
        "answer_in_own_document_chunks": answerable,
        "setup": (
            f"all {len(split.titles)} documents in one index; chunk_text {args.chunk_min}-{args.chunk_max} "
            "tokens; packaged MiniLM + FTS5 BM25 fused as Index.search(hybrid=True) "
            f"({H.DEFAULT_RETRIEVAL}); every system gets the same candidate list; budgets in "
            "SmolLM2 tokens, labeled blocks charged alike"
        ),
        "budgets": list(H.BUDGETS),
        "systems": cfg,
        "table": table,
        "per_question_recall": per_question,
        **({"ablation": ablation} if ablation is not None else {}),
        "question_ids": [q.qid for q in questions],
        "args": vars(args),
    }
    if args.gen_n:
        print(f"\nSmolLM2-135M-Instruct answers {args.gen_n} questions at {args.gen_budget} tokens", flush=True)
        result["generation"] = generate(args, corpus, packer, questions, gen)
        s = result["generation"]["summary"]
        for system in ("ragbudget", "greedy_fill"):
            print(
                f"  {system:<12} n={s['n']} EM {s[f'{system}_em']:.1f} {s[f'{system}_em_ci95']} "
                f"F1 {s[f'{system}_f1']:.1f} {s[f'{system}_f1_ci95']} "
                f"answer in context {s[f'{system}_recall']:.1f}%"
            )
        print(f"  F1 ragbudget - greedy: {s['f1_diff_ragbudget_minus_greedy']:+.1f} {s['f1_diff_ci95']}")
    result["seconds"] = round(time.time() - t_start, 1)
    from _results import write

    out = args.out or (H.ROOT / "bench" / "results" / f"qa_{args.split.replace('-', '_')}.json")
    write(out.stem, result, folder=out.parent)


if __name__ == "__main__":
    main()
