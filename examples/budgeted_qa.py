"""Budgeted retrieve-then-generate on the repo's data/ corpus, as in the README.

    python examples/budgeted_qa.py ["your question"] [--gpu "RTX 4090"] [--concurrency 4]

Indexes data/ (incrementally) into .ragbudget/, plans the KV budget for the packaged SmolLM2 on the
given GPU, then answers within it and prints every budget decision.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the packaged defaults need no hub

import ragbudget  # noqa: E402
from ragbudget.cli.display import format_report  # noqa: E402


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("question", nargs="?", default="What was Maria Curie the first female recipient of?")
    ap.add_argument("--gpu", default=None, help='"auto", a GPU name or a size (default: this machine)')
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--context-tokens", type=int, default=1024)
    args = ap.parse_args()

    rb = ragbudget.Pipeline(".ragbudget", gpu=args.gpu, concurrency=args.concurrency, max_new_tokens=64)
    summary = rb.index([os.path.join(here, "..", "data")], exclude=["model_configs"])
    print(
        f"index: {summary.chunks_total} chunks, {summary.exact_duplicates} exact and "
        f"{summary.near_duplicates} near duplicates removed"
    )
    answer = rb.ask(args.question, context_tokens=args.context_tokens)
    print(f"\n{answer.text}\n")
    for i, src in enumerate(answer.sources, 1):
        print(f"[{i}] {src['path']} [{src['start']}:{src['end']}] score {src['score']:.3f}")
    print()
    print(format_report(answer.report))


if __name__ == "__main__":
    main()
