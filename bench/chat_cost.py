"""What the follow-up's rewrite costs a chat turn: seconds a CoQA follow-up takes through
:class:`~ragbudget.chat.Conversation` with the model rewriting it (the default) and with the terms
alone (``rewrite_with_model=False``), on one ``llama-server`` and model, the two asked one after
the other for each question, in alternating order (ABBA), so that the engine's state and the
host's load fall on both alike.

Ground: the CoQA tuning stories of ``bench/answers_chat.py`` (``--stories`` indexed, the
follow-ups of the first ``--ask-stories``, ``--questions`` of them), each asked after its gold
history at ``--budget`` context tokens, the answer capped at 64 tokens, greedy; ``--rounds``
passes over them after one untimed warm-up question. Per question and row: the turn's wall
seconds (``Conversation.ask``, rewrite included), the rewrite's own seconds
(``timings["rewrite_s"]``) and the answer's words. Reports medians, the median of the
per-question ratio (rewritten / terms) and the rewrite's share of a turn.

    python bench/chat_cost.py --model qwen2.5-coder-0.5b-instruct

Writes ``bench/results/chat_cost_<model>.json``. Run it alone on an idle host: it is a timing.
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
import _qa_harness as H  # noqa: E402, F401  (sets the offline environment first)
import answers as A  # noqa: E402
import numpy as np  # noqa: E402
from _llama import llama_server  # noqa: E402
from answers_chat import HISTORY_ROOM, chat_questions, write_stories  # noqa: E402
from coqa_chat import load_stories  # noqa: E402

ROWS = {"rewritten": True, "terms": False}


def turn(pipe: Any, q: dict[str, Any], budget: int, rewrite: bool) -> dict[str, Any]:
    """One follow-up asked after its gold history: the turn's seconds and what it spent them on."""
    from ragbudget.chat import Conversation

    conv = Conversation.from_messages(
        pipe, q["history"], context_tokens=budget, max_new_tokens=64, rewrite_with_model=rewrite
    )
    t0 = time.perf_counter()
    ct = conv.ask(q["text"])
    seconds = time.perf_counter() - t0
    timings = ct.answer.report.get("timings") or {}
    return {
        "seconds": seconds,
        "rewrite_s": float(timings.get("rewrite_s") or 0.0),
        "answer_words": len(ct.text.split()),
        "rewritten": (ct.answer.report.get("follow_up") or {}).get("written_by") == "model",
    }


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r: [c for c in cells if c["row"] == r] for r in ROWS}
    out: dict[str, Any] = {
        r: {
            "median_s": float(np.median([c["seconds"] for c in cs])),
            "mean_s": float(np.mean([c["seconds"] for c in cs])),
            "median_rewrite_s": float(np.median([c["rewrite_s"] for c in cs])),
            "mean_answer_words": float(np.mean([c["answer_words"] for c in cs])),
            "rewritten_pct": 100.0 * float(np.mean([c["rewritten"] for c in cs])),
            "n": len(cs),
        }
        for r, cs in by.items()
    }
    pair = {(c["round"], c["qid"]): {} for c in cells}
    for c in cells:
        pair[(c["round"], c["qid"])][c["row"]] = c["seconds"]
    ratios = [p["rewritten"] / p["terms"] for p in pair.values() if len(p) == 2 and p["terms"] > 0]
    out["median_ratio_rewritten_over_terms"] = float(np.median(ratios))
    out["rewrite_share_of_turn"] = float(
        np.sum([c["rewrite_s"] for c in by["rewritten"]]) / np.sum([c["seconds"] for c in by["rewritten"]])
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--stories", type=int, default=60)
    ap.add_argument("--ask-stories", type=int, default=30)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from ragbudget import Pipeline

    gguf = A.gguf_path(args.model)
    stories = load_stories(args.stories, args.seed)
    questions = chat_questions(stories[: args.ask_stories], args.turns, args.questions + 1)
    warm, questions = questions[0], questions[1:]
    cells: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="chat-cost-") as tmp:
        docs = Path(tmp) / "docs"
        write_stories(stories, docs)
        Pipeline(Path(tmp) / "index").index([docs])
        slot = args.budget + 1024 + HISTORY_ROOM + 64
        server = llama_server(Path(tmp), model=gguf, slots=1, slot_tokens=slot, threads=args.threads)
        with server as url, Pipeline(Path(tmp) / "index", engine=url, engine_timeout=600) as pipe:
            for rewrite in ROWS.values():
                turn(pipe, warm, args.budget, rewrite)  # the engine and the embedder warm
            for r in range(args.rounds):
                for i, q in enumerate(questions):
                    order = list(ROWS) if (i + r) % 2 == 0 else list(reversed(ROWS))
                    for row in order:
                        cell = turn(pipe, q, args.budget, ROWS[row])
                        cells.append({"round": r, "qid": q["qid"], "row": row, **cell})
                print(f"round {r + 1}/{args.rounds}: {len(cells)} turns", flush=True)
    summary = summarize(cells)
    for row in ROWS:
        s = summary[row]
        print(f"{row:>10}: median {s['median_s']:.2f} s a follow-up (rewrite {s['median_rewrite_s']:.2f} s)")
    print(f"rewritten / terms, median of per-question ratios: {summary['median_ratio_rewritten_over_terms']:.2f}x")
    from _results import write

    model = Path(gguf).stem.lower().replace("-", "_").replace(".", "_")
    write(
        f"chat_cost_{model}",
        {"model": Path(gguf).name, "summary": summary, "cells": cells, "args": vars(args)},
        packages=("sentence-transformers",),
    )


if __name__ == "__main__":
    main()
