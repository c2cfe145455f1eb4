"""Span packing on a served engine: tokenizer requests per question, and composed costs against
exact counting.

A real llama.cpp ``llama-server`` (the packaged SmolLM2-135M GGUF) counts and renders; the QA
harness's index of one SQuAD split gives every question its hybrid-ranked candidates
(``bench/_qa_harness.py``), packed with the library's span defaults (``pack="spans"``, its
relevance floor, one :class:`~ragbudget.spans.SpanScorer` for the split). Each question is one
request at one context budget (256, 512, 1,024 tokens in turn) and is packed twice, over two
connections to the engine that share no counts:

* ``composed`` — :class:`~ragbudget.prompt.EnginePromptBuilder` as ``Pipeline(engine=…)`` uses it:
  every piece of every candidate counted in one batch, trial passages costed from the pieces, the
  rendered prompt checked (and packed again, tighter, when over);
* ``exact`` — the same builder counting every trial passage with the engine, as before.

Recorded per question: ``/tokenize`` requests each way (the question's render included; the first
questions find nothing counted, later ones find their candidates counted by earlier ones: a
question is ``warm`` when every candidate it retrieved was a candidate of an earlier one), whether
both packed the same passages at the same costs, each composed passage cost against the engine's
count of the passage's block, the composed context against the render (and the repacks), the
answer in the context each way. Summaries by warm/cold; raw rows too.

    python bench/spans_counts.py --split squad-tune --docs 4 --questions 120

starts a ``llama-server`` (``$RAGBUDGET_LLAMA_SERVER`` or ``tools/build-llama-server --cached``)
on a free port and stops it at the end; ``--engine URL`` uses a running one instead. Writes
``bench/results/spans_counts.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _qa_harness as H  # noqa: E402  (sets the offline environment first)
from _llama import llama_server  # noqa: E402
from _results import write  # noqa: E402

from ragbudget.fitting import build_prompt  # noqa: E402
from ragbudget.generation.engines import connect  # noqa: E402
from ragbudget.packing.select import Selection  # noqa: E402
from ragbudget.packing.spans import SpanScorer  # noqa: E402
from ragbudget.pipeline import DEFAULT_RELEVANCE_FLOOR  # noqa: E402
from ragbudget.prompt.prompt import EnginePromptBuilder, Prompt  # noqa: E402

BUDGETS = (256, 512, 1024)


class Composed(EnginePromptBuilder):
    """The library's engine builder, noting how often a prompt was rendered: each render after a
    question's first is a repack (the packer asked for less after a render came out over)."""

    renders = 0

    def render(
        self, question: str, selection: Selection, *, max_prompt_tokens: int, fixed_tokens: int | None = None
    ) -> Prompt:
        self.renders += 1
        return super().render(question, selection, max_prompt_tokens=max_prompt_tokens, fixed_tokens=fixed_tokens)


class Exact(EnginePromptBuilder):
    """The same builder counting every trial passage with the engine (the behaviour before
    composed costs)."""

    batch_counts = False


def tokenizer_requests(backend: Any) -> int:
    return sum(n for route, n in backend.http.sent.items() if "tokenize" in route)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {"questions": 0}
    out: dict[str, Any] = {"questions": len(rows)}
    for way in ("composed", "exact"):
        calls = [r[f"{way}_requests"] for r in rows]
        out[f"{way}_requests"] = {
            "mean": round(statistics.mean(calls), 2),
            "max": max(calls),
            "total": sum(calls),
            "at_most_2": sum(c <= 2 for c in calls),
        }
        out[f"{way}_ms_mean"] = round(statistics.mean(r[f"{way}_ms"] for r in rows), 1)
        out[f"{way}_recall"] = round(100 * statistics.mean(r[f"{way}_recall"] for r in rows), 1)
    out["same_passages"] = sum(r["same"] for r in rows)
    diffs = Counter(d for r in rows for d in r["passage_cost_minus_exact"])
    out["passages"] = sum(diffs.values())
    out["passage_cost_minus_exact"] = {str(k): v for k, v in sorted(diffs.items())}
    ctx = Counter(r["context_minus_render"] for r in rows)
    out["context_cost_minus_rendered"] = {str(k): v for k, v in sorted(ctx.items())}
    out["repacked"] = sum(r["repacks"] > 0 for r in rows)
    out["over_budget"] = sum(r["composed_prompt_tokens"] > r["max_prompt_tokens"] for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", default="squad-tune", choices=H.SPLITS)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--questions", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", help="a running llama-server's URL (default: start one)")
    ap.add_argument("--out", default="spans_counts")
    args = ap.parse_args()

    split = H.load_split(args.split, docs=args.docs, seed=args.seed)
    qs = H.sample_questions(split, args.questions, seed=args.seed)
    corpus = H.Corpus.build(split, qs)
    scorer = SpanScorer(corpus.sentence_embedder())

    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        url = args.engine
        if url is None:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rb-spans-counts-")))
            url = stack.enter_context(llama_server(tmp, slots=4, slot_tokens=2048))
        # Two connections, two in-memory count caches, no counts.sqlite: each way starts cold.
        bc, be = connect(url), connect(url)
        composed, exact = Composed(bc, system_prompt=H.QA_SYSTEM), Exact(be, system_prompt=H.QA_SYSTEM)
        seen: set[int] = set()
        opts = {"relevance_floor": DEFAULT_RELEVANCE_FLOOR, "pack": "spans", "span_scorer": scorer}
        for i, q in enumerate(qs):
            cands = corpus.candidates(q)
            budget = BUDGETS[i % len(BUDGETS)]
            warm = {c.chunk_id for c in cands} <= seen
            seen |= {c.chunk_id for c in cands}
            row: dict[str, Any] = {"qid": q.qid, "budget": budget, "warm": warm}
            prompts = {}
            for way, b in (("composed", composed), ("exact", exact)):
                before, renders = tokenizer_requests(b.backend), getattr(b, "renders", 0)
                t0 = time.perf_counter()
                # One request: the question's render (the allowance), then packing and the check.
                max_prompt = b.fixed_tokens(q.text) + budget
                p = build_prompt(q.text, cands, builder=b, max_prompt_tokens=max_prompt, **opts)
                row[f"{way}_ms"] = round(1e3 * (time.perf_counter() - t0), 1)
                row[f"{way}_requests"] = tokenizer_requests(b.backend) - before
                own = [c.text for c in p.selection.chunks if corpus.docs[c.chunk_ids[0]] == q.doc]
                row[f"{way}_recall"] = float(H.contains_answer("\n\n".join(own), q.answers))
                row[f"{way}_prompt_tokens"] = p.n_tokens
                row["max_prompt_tokens"] = max_prompt
                if way == "composed":
                    row["repacks"] = composed.renders - renders - 1  # the first render is no repack
                prompts[way] = p
            pc, pe = prompts["composed"], prompts["exact"]
            row["same"] = [(c.text, c.cost) for c in pc.selection.chunks] == [
                (c.text, c.cost) for c in pe.selection.chunks
            ]
            # The engine's own count of each composed passage's block (the exact connection:
            # not part of either request's figures).
            max_id = max(9, len(cands))
            blocks = [exact.block(c, max_id) for c in pc.selection.chunks]
            truth = be.count(blocks) if blocks else []
            row["passage_cost_minus_exact"] = [c.cost - t for c, t in zip(pc.selection.chunks, truth, strict=True)]
            row["context_minus_render"] = pc.selection.tokens_used - (pc.n_tokens - pc.fixed_tokens)
            rows.append(row)
            print(
                f"{i:3d} {'warm' if warm else 'cold'} {budget:5d}  requests composed {row['composed_requests']:3d}"
                f" exact {row['exact_requests']:4d}  same {row['same']!s:5}  repacks {row['repacks']}",
                flush=True,
            )
    result = {
        "split": args.split,
        "docs": args.docs,
        "questions": len(qs),
        "budgets": list(BUDGETS),
        "engine": "llama.cpp llama-server, packaged SmolLM2-135M GGUF" + (" (given)" if args.engine else ""),
        "all": summary(rows),
        "cold": summary([r for r in rows if not r["warm"]]),
        "warm": summary([r for r in rows if r["warm"]]),
        "rows": rows,
    }
    for part in ("cold", "warm"):
        s = result[part]
        if s["questions"]:
            print(
                f"{part}: {s['questions']} questions, tokenizer requests a question composed "
                f"{s['composed_requests']['mean']} (max {s['composed_requests']['max']}), exact "
                f"{s['exact_requests']['mean']} (max {s['exact_requests']['max']}); same passages "
                f"{s['same_passages']}; repacked {s['repacked']}"
            )
    print("passage cost − engine's count:", result["all"]["passage_cost_minus_exact"])
    write(args.out, result)


if __name__ == "__main__":
    main()
