"""The evidence floor and the model's own declines together, measured through ``ask`` (issue #43 §3).

``bench/abstain.py`` measures the floor alone: which questions it declines without calling the
model. This one asks what a user gets at each floor, the model included. For every question of
``bench/answers.py``'s question sets (answerable: about an indexed article or product; unanswerable:
about one of the same split that is not indexed):

* the library's evidence (``Pipeline.evidence``: the best sentence cosine among the top hits);
* ``ask``'s answer at ``--budget`` context tokens with the floor **off** (``evidence_floor=0``):
  the model reads the passages of every question, and its prompt tells it to say it does not know
  when they do not hold the answer (``DEFAULT_SYSTEM_PROMPT``).

A floor ``f`` only decides whether the model is called (the passages and the prompt do not depend
on it), so ``ask`` with ``evidence_floor=f`` answers each question exactly as: declined without
generating when its evidence is under ``f``, else the floor-off answer. **That is checked, not
assumed**: ``--check`` questions over the library's default floor are asked again through a
pipeline with every default, and their answers must equal the floor-off ones (the count that
differ is recorded; a run with any is not a measurement of the default).

Per split and floor: unanswerable questions declined (by the floor or by the model: the reply
matches ``answers.DECLINE``, the pattern every system is graded by), answerable ones wrongly
declined, F1 over the answerable questions (a decline scores 0, as in ``answers.py``), and the
model calls the floor saves. ``--choose`` (a tuning split): the floor with the best F1 among those
that wrongly decline at most ``--max-wrong`` percent; the other splits report it.
``--system-prompt`` puts another system turn in place of the library's (``Pipeline(system_prompt=
...)``): whether other words make the model decline what its passages do not hold.

    python bench/abstain_answers.py --splits squad-tune,squad-test,amazon --choose squad-tune \\
        --questions 60 --unanswerable 30 --model qwen2.5-coder-0.5b-instruct
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
import _qa_harness as H  # noqa: E402  (sets the offline environment first)
import numpy as np  # noqa: E402
from _llama import llama_server  # noqa: E402
from answers import best, clean, declines, gguf_path, question_set, write_docs  # noqa: E402

FLOORS = [round(x, 3) for x in np.arange(0.0, 0.601, 0.025)]
#: Articles indexed per split, as ``answers.py``'s runs of each split index.
DOCS = {"squad-tune": 12, "squad-test": 12, "amazon": 40}


def split_cells(split: str, args: argparse.Namespace, url: str, tmp: Path) -> dict[str, Any]:
    """Each question's evidence and floor-off answer on ``split``, and the default pipeline's
    answers to ``--check`` questions over the default floor."""
    from ragbudget import Pipeline

    pool, indexed, questions = question_set(split, DOCS[split], args.questions, args.unanswerable, args.seed)
    docs = tmp / split / "docs"
    write_docs(pool, indexed, docs)
    index_dir = tmp / split / "index"
    Pipeline(index_dir).index([docs])
    cells = []
    t0 = time.perf_counter()
    prompt = {"system_prompt": args.system_prompt} if args.system_prompt else {}
    with Pipeline(index_dir, engine=url, engine_timeout=args.timeout, evidence_floor=0.0, **prompt) as pipe:
        for q in questions:
            evidence = pipe.evidence(q["text"]).score
            a = pipe.ask(q["text"], context_tokens=args.budget, max_new_tokens=args.max_new_tokens)
            cells.append({**q, "evidence": round(float(evidence), 6), "answer": a.text})
            if len(cells) % 20 == 0:
                print(f"  {split}: {len(cells)} of {len(questions)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    checked = []
    with Pipeline(index_dir, engine=url, engine_timeout=args.timeout, **prompt) as pipe:
        floor = pipe.evidence(questions[0]["text"]).floor
        over = [c for c in cells if floor is not None and c["evidence"] >= floor][: args.check]
        for c in over:
            a = pipe.ask(c["text"], context_tokens=args.budget, max_new_tokens=args.max_new_tokens)
            checked.append({"qid": c["qid"], "same": a.text == c["answer"], "answer": a.text})
    return {
        "documents_indexed": [pool.titles[d] for d in indexed],
        "default_floor": floor,
        "check": {"asked": len(checked), "differ": sum(not c["same"] for c in checked), "cells": checked},
        "cells": cells,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def at_floor(cells: list[dict[str, Any]], floor: float) -> dict[str, Any]:
    """What ``ask`` with ``evidence_floor=floor`` gives on these questions (module docstring)."""
    ans = [c for c in cells if c["answerable"]]
    una = [c for c in cells if not c["answerable"]]

    def declined(c: dict[str, Any]) -> bool:
        return c["evidence"] < floor or declines(c["answer"])

    def f1(c: dict[str, Any]) -> float:
        return 0.0 if declined(c) else 100 * best(H.f1_score, clean(c["answer"]), tuple(c["answers"]))

    return {
        "declined_unanswerable_pct": round(100 * float(np.mean([declined(c) for c in una])), 1),
        "wrongly_declined_pct": round(100 * float(np.mean([declined(c) for c in ans])), 1),
        "by_floor_pct": round(100 * float(np.mean([c["evidence"] < floor for c in cells])), 1),
        "by_model_unanswerable_pct": round(
            100 * float(np.mean([c["evidence"] >= floor and declines(c["answer"]) for c in una])), 1
        ),
        "f1": round(float(np.mean([f1(c) for c in ans])), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", default="squad-tune,squad-test,amazon")
    ap.add_argument("--choose", default="squad-tune", help="the split the floor is chosen on")
    ap.add_argument("--questions", type=int, default=60, help="answerable questions per split")
    ap.add_argument("--unanswerable", type=int, default=30, help="unanswerable questions per split")
    ap.add_argument("--budget", type=int, default=256, help="context tokens of each ask")
    ap.add_argument("--max-wrong", type=float, default=5.0, help="percent of answerable questions wrongly declined")
    ap.add_argument("--check", type=int, default=10, help="questions asked again with every default")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="packaged model name or GGUF path")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--system-prompt", default=None, help="the chat's system prompt (default: the library's, DEFAULT_SYSTEM_PROMPT)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    splits = [s for s in args.splits.split(",") if s]
    if args.choose not in splits:
        raise SystemExit(f"--choose {args.choose}: not among --splits {args.splits}")
    unknown = [s for s in splits if s not in DOCS]
    if unknown:
        raise SystemExit(f"--splits: unknown {', '.join(unknown)} (known: {', '.join(DOCS)})")
    gguf = gguf_path(args.model)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="abstain-answers-") as tmp:
        slot = args.budget + 1024 + args.max_new_tokens
        with llama_server(Path(tmp), model=gguf, slots=1, slot_tokens=slot, threads=args.threads) as url:
            for s in splits:
                runs[s] = split_cells(s, args, url, Path(tmp))
                print(f"{s}: {len(runs[s]['cells'])} questions, check {runs[s]['check']}", flush=True)
    curves = {s: {str(f): at_floor(r["cells"], f) for f in FLOORS} for s, r in runs.items()}
    ok = [f for f in FLOORS if curves[args.choose][str(f)]["wrongly_declined_pct"] <= args.max_wrong]
    chosen = max(ok, key=lambda f: (curves[args.choose][str(f)]["f1"], f)) if ok else None
    default = runs[splits[0]]["default_floor"]
    # What each named floor gives on each split (None: no such floor, no default or none chosen).
    named = {"off": 0.0, "default": default, "chosen": chosen}
    at = {k: {s: at_floor(r["cells"], f) for s, r in runs.items()} if f is not None else None for k, f in named.items()}
    for s in splits:
        for name, f in named.items():
            if f is not None:
                print(f"{s:>10} {name:>8} floor {f:<6} {at[name][s]}")
    from _results import write

    result = {
        "model": Path(gguf).name,
        "engine": {"server": "llama.cpp llama-server", "slots": 1, "threads": args.threads},
        "budget": args.budget,
        "max_new_tokens": args.max_new_tokens,
        "splits": splits,
        "chosen_on": args.choose,
        "max_wrong_pct": args.max_wrong,
        "default_floor": default,
        "chosen": chosen,
        "at_default": at["default"],
        "at_off": at["off"],
        "at_chosen": at["chosen"],
        "curves": curves,
        "runs": runs,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    out = args.out or (H.ROOT / "bench" / "results" / "abstain_answers.json")
    write(out.stem, result, folder=out.parent, packages=("sentence-transformers", "tokenizers"))


if __name__ == "__main__":
    main()
