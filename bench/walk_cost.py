"""What a change to the library's own path costs where users feel it: ``ragbudget index`` and
``ask`` time on the code before and after, with LangChain's stuff chain timed in the same run as
the peer (issue #44: "the cost of the change is measured").

Ground: squad-test's 12 seeded articles written as Markdown and ``--questions`` answerable
questions of the same seeded draw (``bench/answers.py``'s); one ``llama-server`` serving the
packaged default model (Qwen2.5-Coder-0.5B; answers capped short so the library's own time is not
lost in generation), one slot, ``--threads`` threads, greedy, ``--max-new-tokens`` new tokens, 256 context tokens.

* **A version** is a git commit checked out as a worktree (``--before``: the commit before the
  change) or the working tree (``after``). Each runs in a process of its own on its own code: it
  indexes the folder into a fresh index (``Pipeline(dir).index``, every default: the packaged
  MiniLM, chunking, BM25), timed; then ``Pipeline(dir, engine=URL)`` asks one warm-up question
  and every question, each ``ask`` timed whole, and its report's ``generate_s`` taken out for the
  library's own share (search, plan, packing, render, admission).
* **The peer**: ``bench/answers_peers.py``'s LangChain chain (the tutorial's 400-token splitter,
  MiniLM, FAISS, top 4, its prompt, the context cut to 256 tokens) on the same engine and
  questions, in the peers' environment (``--peers-python``), each question timed.

``--rounds`` rounds, the versions' order alternating from round to round, the peer after them;
each round asks questions of its own (``--questions`` split between the rounds), so every figure
is a first-time question's. A repeated question is not what it costs a user: llama-server keeps
past prompts' KV in RAM (``--cache-ram``, 8 GiB by default) and serves an identical prompt again
without prefill -- but it saves a slot's prompt there only when the next request would discard
more than half of it, so whether a repeat is served from the cache depends on how much of a
prompt the next one shares (the system prompt's share of a short prompt is over half). Runs up to
commit 5c64467 asked the same questions every round; their medians were mostly repeats'.

Per question the seconds, the library's share, and the prompt and new tokens the report gives.
Writes ``bench/results/walk_cost.json``: per round, version and peer the seconds; the medians and
the ratios after/before and each against LangChain.

    python bench/walk_cost.py --before fe67e78 --questions 72 --rounds 3 --peers-python /path/to/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _qa_harness as H  # noqa: E402  (sets the offline environment first)
from _llama import llama_server, packaged_gguf  # noqa: E402
from answers import question_set, write_docs  # noqa: E402

#: Not one of the questions: a question asked twice is a repeat that llama-server may serve from
#: its prompt cache (below), which no first-time question gets.
WARM_UP = "What are these documents about?"

# What one version runs, on its own code (PYTHONPATH): index, then ask every question.
CHILD = """
import json, sys, time
import ragbudget
from ragbudget import Pipeline
docs, index_dir, url, budget, cap = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
questions = json.loads(sys.stdin.read())
t = time.perf_counter()
Pipeline(index_dir).index([docs])
index_s = time.perf_counter() - t
asks, own, prompt, new = [], [], [], []
with Pipeline(index_dir, engine=url) as pipe:
    pipe.ask(WARM_UP, context_tokens=budget, max_new_tokens=cap)  # warm-up: embedder, engine figures
    for q in questions:
        t = time.perf_counter()
        a = pipe.ask(q, context_tokens=budget, max_new_tokens=cap)
        asks.append(time.perf_counter() - t)
        own.append(asks[-1] - a.report["timings"].get("generate_s", 0.0))
        prompt.append(a.report["budget"].get("prompt_tokens"))
        new.append(a.report["budget"].get("new_tokens"))
print(json.dumps({"index_s": index_s, "ask_s": asks, "library_s": own, "prompt_tokens": prompt, "new_tokens": new,
                  "code": ragbudget.__file__}))
"""


def run_version(
    tree: Path, docs: Path, work: Path, url: str, questions: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    index_dir = Path(tempfile.mkdtemp(prefix="idx-", dir=work))
    child = CHILD.replace("WARM_UP", repr(WARM_UP))
    cmd = [sys.executable, "-c", child, str(docs), str(index_dir), url, str(args.budget), str(args.max_new_tokens)]
    # Run from the work folder: ``python -c`` puts the current folder ahead of PYTHONPATH, so
    # from the repository root both versions would import the working tree's code.
    done = subprocess.run(
        cmd, input=json.dumps(questions), capture_output=True, text=True, env=env, cwd=work, timeout=3600
    )
    if done.returncode:
        raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
    got: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(got["code"]).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"the {tree} run imported ragbudget from {got['code']}")
    return got


def run_peer(docs: Path, url: str, gguf: str, questions: list[dict[str, Any]], args: argparse.Namespace) -> list[float]:
    job = {
        "docs": str(docs),
        "engine": url,
        "gguf": gguf,
        "cells": [["langchain", args.budget]],
        "known": [],
        "questions": questions,
        "max_new_tokens": args.max_new_tokens,
        "timeout_s": 600,
        "chat": False,
    }
    done = subprocess.run(
        [args.peers_python, str(HERE / "answers_peers.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode:
        raise SystemExit(f"the peers' process failed: {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in rows if "error" in r]
    if failed:
        raise SystemExit(f"LangChain failed {len(failed)} questions: {failed[0]['error']}")
    return [float(r["seconds"]) for r in rows]


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p90": xs[int(0.9 * (len(xs) - 1))], "mean": statistics.fmean(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the commit before the change (checked out as a worktree)")
    ap.add_argument("--questions", type=int, default=72, help="in all, split between the rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers-python", required=True)
    ap.add_argument("--out", type=Path, default=H.ROOT / "bench" / "results" / "walk_cost.json")
    args = ap.parse_args()
    before = subprocess.run(
        ["git", "rev-parse", "--short", args.before], cwd=H.ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    pool, indexed, qs = question_set("squad-test", 12, args.questions, 0)
    questions = [q for q in qs if q["answerable"]]
    per_round = len(questions) // args.rounds
    if per_round < 1:
        raise SystemExit(f"--questions {args.questions} gives no question to each of {args.rounds} rounds")
    rounds_qs = [questions[r * per_round : (r + 1) * per_round] for r in range(args.rounds)]
    gguf = packaged_gguf()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="walk-cost-") as tmp:
        work = Path(tmp)
        docs = work / "docs"
        write_docs(pool, indexed, docs)
        old = work / "before"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(old), before], cwd=H.ROOT, check=True)
        try:
            trees = {"before": old, "after": H.ROOT}
            with llama_server(work, model=gguf, slots=1, slot_tokens=2048, threads=args.threads) as url:
                for r in range(args.rounds):
                    order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                    got: dict[str, Any] = {"order": order}
                    for name in order:
                        t = time.perf_counter()
                        texts = [q["text"] for q in rounds_qs[r]]
                        got[name] = run_version(trees[name], docs, work, url, texts, args)
                        print(f"round {r + 1} {name}: {time.perf_counter() - t:.0f} s", flush=True)
                    got["langchain"] = {"ask_s": run_peer(docs, url, gguf, rounds_qs[r], args)}
                    rounds.append(got)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=H.ROOT, check=False)
    summary: dict[str, Any] = {}
    for name in ("before", "after"):
        summary[name] = {
            "index_s": _stats([r[name]["index_s"] for r in rounds]),
            "ask_s": _stats([x for r in rounds for x in r[name]["ask_s"]]),
            "library_s": _stats([x for r in rounds for x in r[name]["library_s"]]),
            "prompt_tokens": _stats([x for r in rounds for x in r[name]["prompt_tokens"] if x is not None]),
            "new_tokens": _stats([x for r in rounds for x in r[name]["new_tokens"] if x is not None]),
        }
    summary["langchain"] = {"ask_s": _stats([x for r in rounds for x in r["langchain"]["ask_s"]])}
    med = {k: summary[k]["ask_s"]["median"] for k in summary}
    summary["ratios"] = {
        "index_after_over_before": summary["after"]["index_s"]["median"] / summary["before"]["index_s"]["median"],
        "ask_after_over_before": med["after"] / med["before"],
        "library_after_over_before": summary["after"]["library_s"]["median"] / summary["before"]["library_s"]["median"],
        "ask_before_over_langchain": med["before"] / med["langchain"],
        "ask_after_over_langchain": med["after"] / med["langchain"],
    }
    for k, v in summary.items():
        print(k, json.dumps(v))
    from _results import write

    result = {
        "before": before,
        "questions": per_round * args.rounds,
        "questions_per_round": per_round,
        "rounds": args.rounds,
        "budget": args.budget,
        "max_new_tokens": args.max_new_tokens,
        "engine": {"server": "llama.cpp llama-server", "model": Path(gguf).name, "slots": 1, "threads": args.threads},
        "summary": summary,
        "runs": rounds,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    write(args.out.stem, result, folder=args.out.parent, packages=("sentence-transformers", "tokenizers"))


if __name__ == "__main__":
    main()
