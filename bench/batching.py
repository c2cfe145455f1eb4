"""Batched generation vs one request at a time, on a packaged model on this CPU.

``--model``: the generator (default: the library's default local model, Qwen2.5-Coder-0.5B-Instruct
since issue #43; the summary rows measure ``--model smollm2-135m-instruct``, as they always have).

For each concurrency c in {1, 4, 8}, c requests (distinct short chat questions, greedy,
``--new`` tokens each, EOS allowed) are sent and the wall time until the last one finishes is
measured, in three ways:

* ``serial`` — one request after another through ``Generator.generate`` (one-at-a-time);
* ``threads`` — c threads each calling ``Generator.generate`` at once (what the server did before
  batching: one ``generate`` per thread, competing for the same cores);
* ``batched`` — c threads calling ``Batcher.generate`` at once (one continuous-batching loop
  shares every forward pass; attention per request, :func:`ragbudget.generation.batching.per_request_sdpa`);
* ``batched_dense`` — the same, with transformers' own SDPA for the batched step (every query
  masked against the keys of the whole batch): what ragbudget ran before, for the ratio.

``prefill_only``: the serial run again with one new token per request, so the prefill's share
of the serial time is known; ``ceiling_vs_serial`` is what perfect batching could reach at that
share — every prefill still paid in full, the decode steps shared c ways:
serial ÷ (prefill + (serial − prefill) ÷ c).

tokens/s = new tokens of all c answers ÷ wall time; the best of ``--reps`` repetitions is kept
(other engineers share this machine's two cores: the best run is the least disturbed). The
batched answers are checked to be the same text as the serial ones (greedy decoding).

``--context-tokens N`` gives each request a RAG-sized prompt instead: N tokens of a man page
(``../shared/data/manpages``, a different stretch per request) before the question — the prefill
then dominates, which is where batching on a CPU helps least.

Run: ``nice -n 10 .venv/bin/python bench/batching.py``; writes bench/results/batching.json
(``batching_ctxN.json`` with ``--context-tokens N``, ``_newK`` appended with ``--new K`` other than 48,
the model's name with ``--model``).

Each way runs with no other thread of the process holding an OpenMP pool from forward passes
(the unbatched ways in a thread of their own, with the batcher closed): before 2026-12-03 the
serial runs shared the process with a live batcher, and the batched runs with a main thread that
had run the serial ones, which slowed both (see ``ragbudget.generation.batching``).

``ceiling_tail_vs_serial`` is the tighter bound when answers differ in length (``--new 256``, the
server's default cap, lets some answers run long): the batched run cannot end before every prefill
is paid and the longest answer has taken its own decode steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write

from ragbudget.generation import batching
from ragbudget.generation.batching import Batcher, in_own_thread
from ragbudget.generation.generate import Generator

TOPICS = ["tides", "volcanoes", "bread yeast", "honeybees", "rainbows", "glaciers", "comets", "coral reefs"]


def run(fn, prompts, new, concurrent):
    out = [None] * len(prompts)
    each: list[float] = []  # serial: each request's own seconds
    t0 = time.perf_counter()
    if concurrent:

        def work(i):
            out[i] = fn(prompts[i], max_new_tokens=new)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i, p in enumerate(prompts):
            t = time.perf_counter()
            out[i] = fn(p, max_new_tokens=new)
            each.append(round(time.perf_counter() - t, 3))
    wall = time.perf_counter() - t0
    tokens = sum(g.new_tokens for g in out)
    return {
        "wall_s": round(wall, 3),
        "new_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2),
        "per_request_new_tokens": [g.new_tokens for g in out],
        **({"per_request_s": each} if each else {}),
        "texts": [g.text for g in out],
    }


def ceiling(best, c):
    """Perfect batching at this prefill share: serial ÷ (prefill + decode ÷ c)."""
    serial, prefill = best["serial"]["wall_s"], best["prefill_only"]["wall_s"]
    return round(serial / (prefill + max(0.0, serial - prefill) / c), 2)


def ceiling_tail(best, c):
    """A bound that also counts the longest answer: batched steps cannot end before every
    prefill is paid and the longest request has taken its decode steps, each at least as long
    as a step of that request alone: serial ÷ (prefill + the longest request's own decode time).
    Equal to :func:`ceiling`'s premise only when every answer has the same length."""
    serial, prefill = best["serial"], best["prefill_only"]
    decode = [s - p for s, p in zip(serial["per_request_s"], prefill["per_request_s"], strict=True)]
    return round(serial["wall_s"] / (prefill["wall_s"] + max(0.0, *decode)), 2)


def warm_then_run(batcher, fn, prompts, new, concurrent):
    """Start ``batcher``'s loop outside the clock, then :func:`run`."""
    batcher.generate(prompts[0], max_new_tokens=4)
    return run(fn, prompts, new, concurrent)


def dense(fn):
    """``fn`` with transformers' own SDPA for batched steps (the dense block mask, which the batch
    processor then allocates again: ragbudget tells it none is needed)."""
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching import input_outputs

    def call(*a, **kw):
        AttentionInterface.register("sdpa", batching._installed["sdpa"])
        ours, input_outputs.attn_mask_is_needed = (
            input_outputs.attn_mask_is_needed,
            batching._installed["attn_mask_is_needed"],
        )
        try:
            return fn(*a, **kw)
        finally:
            AttentionInterface.register("sdpa", batching.per_request_sdpa)
            input_outputs.attn_mask_is_needed = ours

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=48, help="max new tokens per request")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--levels", default="1,4,8")
    ap.add_argument(
        "--context-tokens",
        type=int,
        default=0,
        help="tokens of man page before each question (0: short questions alone)",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="the generator: a packaged name (smollm2-135m-instruct), an HF id or a path; default: the library's",
    )
    ap.add_argument("--dtype", default=None, help="the generator's dtype (default: the library's, float32 on a CPU)")
    args = ap.parse_args()
    import torch

    gen = Generator(args.model, dtype=args.dtype).warm_up()
    batcher = Batcher(gen, kv_tokens=8192)
    prompts = [[{"role": "user", "content": f"In two sentences, what are {t}?"}] for t in TOPICS]
    if args.context_tokens:
        page = (
            Path(__file__).resolve().parents[2] / "shared" / "data" / "manpages" / "fanotify_mark.2.txt"
        ).read_text()
        ids = gen.tokenizer(page)["input_ids"]
        step = max(1, (len(ids) - args.context_tokens) // len(TOPICS))
        prompts = [
            [
                {
                    "role": "user",
                    "content": gen.tokenizer.decode(ids[i * step : i * step + args.context_tokens])
                    + "\n\nIn two sentences, what does this manual page describe?",
                }
            ]
            for i in range(len(TOPICS))
        ]
    in_own_thread(gen.generate, prompts[0], max_new_tokens=4)  # warm-up (the batcher's: before each batched way)
    rows = []
    for c in (int(x) for x in args.levels.split(",")):
        ps = prompts[:c]
        best: dict[str, dict] = {}
        for _ in range(args.reps):
            for mode, fn, conc in (
                ("serial", gen.generate, False),
                ("threads", gen.generate, True),
                ("batched", batcher.generate, True),
                ("batched_dense", batcher.generate, True),
                ("prefill_only", gen.generate, False),
            ):
                # Every thread that runs forward passes keeps an OpenMP pool for its life, and
                # pools beside each other slow each other (ragbudget.generation.batching, "which thread runs
                # the model"): the unbatched modes run in a thread of their own with the batcher
                # closed, the batched ones with the batcher's loop the only such thread, started
                # before the clock.
                new = 1 if mode == "prefill_only" else args.new
                if mode == "batched_dense":
                    # A loop started with ragbudget's attention has no dense mask: start one that
                    # has (warmed, as the other batched runs, before run()'s clock).
                    batcher.close()
                    r = dense(warm_then_run)(batcher, fn, ps, new, conc)
                elif mode.startswith("batched"):
                    if not batcher.running:
                        batcher.generate(prompts[0], max_new_tokens=4)
                    r = run(fn, ps, new, conc)
                else:
                    batcher.close()
                    r = in_own_thread(run, fn, ps, new, conc)
                if mode not in best or r["tokens_per_s"] > best[mode]["tokens_per_s"]:
                    best[mode] = r
                print(
                    f"c={c} {mode:8s} {r['tokens_per_s']:7.2f} tok/s ({r['new_tokens']} tokens in {r['wall_s']:.1f} s)",
                    flush=True,
                )
        row = {
            "concurrency": c,
            **{m: {k: v for k, v in r.items() if k != "texts"} for m, r in best.items()},
            "batched_vs_serial": round(best["batched"]["tokens_per_s"] / best["serial"]["tokens_per_s"], 2),
            "batched_vs_threads": round(best["batched"]["tokens_per_s"] / best["threads"]["tokens_per_s"], 2),
            "batched_vs_batched_dense": round(
                best["batched"]["tokens_per_s"] / best["batched_dense"]["tokens_per_s"], 2
            ),
            "ceiling_vs_serial": ceiling(best, c),
            "ceiling_tail_vs_serial": ceiling_tail(best, c),
            "same_text_as_serial": sum(
                a == b for a, b in zip(best["batched"]["texts"], best["serial"]["texts"], strict=True)
            ),
            "dense_same_text_as_serial": sum(
                a == b for a, b in zip(best["batched_dense"]["texts"], best["serial"]["texts"], strict=True)
            ),
        }
        rows.append(row)
        print(row, flush=True)
    layout = batcher.layout
    batcher.close()
    name = f"batching_ctx{args.context_tokens}" if args.context_tokens else "batching"
    if args.new != 48:
        name += f"_new{args.new}"
    if args.dtype:
        name += f"_{args.dtype}"
    if args.model:
        name += "_" + "".join(c if c.isalnum() else "_" for c in Path(args.model).name.lower())
    write(
        name,
        {
            "model": gen.model_ref.id,
            "dtype": str(gen.model.dtype).removeprefix("torch."),
            "max_new_tokens": args.new,
            "reps": args.reps,
            "context_tokens": args.context_tokens,
            "torch_threads": torch.get_num_threads(),
            "paged_cache": layout.to_dict(),
            "rows": rows,
            "attention": "per_request_sdpa (batched) vs transformers' sdpa (batched_dense)",
            "target": "batched tokens/s at 8 concurrent >= 2x serial (one at a time)",
        },
    )


if __name__ == "__main__":
    main()
