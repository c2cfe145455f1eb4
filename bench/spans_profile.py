"""Where the cold time of span packing goes: cProfile over ``build_prompt(pack="spans")`` with a
fresh :class:`ragbudget.packing.spans.SpanScorer` (every pool sentence embedded, as for a chunk seen the
first time), per embedder backend.

The QA harness's split, index and hybrid candidates (``bench/_qa_harness.py``) for the first
``--questions`` sampled questions; for each backend (``torch``: sentence-transformers, what the
committed span runs used; ``onnx-int8``: what ``SentenceTransformerEmbedder()`` picks on a CPU with
onnxruntime installed; ``onnx``: float32 ONNX) one warm-up call, then the profiled cold calls at
each budget. Reported per backend: total cold seconds and the cumulative seconds of the parts —
sentence splitting, token counting (the exact per-sentence and per-passage counts), BM25, the
embedder call (split into tokenization and the model's forward pass where the backend exposes
them), everything else. Also the same calls with the scorer already holding every vector (the
"cached" path an index with stored sentence vectors gives every question).

    nice -n 19 python bench/spans_profile.py --split squad-test --questions 6

Writes ``bench/results/spans_profile.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _qa_harness as H  # noqa: E402  (sets the offline environment first)

# The parts of a cold call, by (file suffix, function name) of the frames cProfile records.
PARTS = {
    "split_sentences": [("sentences.py", "split_sentences")],
    "token_counts": [("prompt.py", "count"), ("prompt.py", "prime")],
    "bm25": [("spans.py", "bm25")],
    "embed_total": [("spans.py", "similarities")],
    "embed_tokenize": [
        ("tokenization_utils_base.py", "__call__"),
        ("tokenization_utils_fast.py", "__call__"),
        ("tokenizers", "encode_batch"),
    ],
    "embed_forward": [("onnxruntime_inference_collection.py", "run"), ("module.py", "_call_impl")],
}


def _cum(stats: pstats.Stats, keys: list[tuple[str, str]]) -> float:
    """Cumulative seconds of the outermost frames matching ``keys`` (recursion not double-counted:
    cProfile's cumulative time already includes nested calls of the same function)."""
    total = 0.0
    for (file, _line, name), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if any(file.endswith(f) or f in file for f, n in keys if n == name):
            total += ct
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=H.SPLITS, default="squad-test")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--budgets", default="256,1024")
    ap.add_argument("--backends", default="torch,onnx-int8,onnx")
    ap.add_argument("--top", type=int, default=25, help="functions listed per backend (by own time)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    load_start = os.getloadavg()[0]

    from ragbudget.generation.generate import Generator
    from ragbudget.packing.spans import SpanScorer
    from ragbudget.retrieval.embed import SentenceTransformerEmbedder

    gen = Generator()
    split = H.load_split(args.split, docs=args.docs, seed=0)
    questions = H.sample_questions(split, args.questions, seed=0)
    corpus = H.Corpus.build(split, questions)
    packer = H.Packer(gen.tokenizer)
    cands = {q.qid: corpus.candidates(q, **H.DEFAULT_RETRIEVAL) for q in questions}
    for q in questions:  # token counts memoized first: the profile is of span work, as in the library
        for b in budgets:
            packer.pack("ragbudget", q.text, cands[q.qid], b, fill_remainder=False)

    result: dict = {
        "split": args.split,
        "questions": len(questions),
        "budgets": budgets,
        "load_average_1m_at_start": round(load_start, 2),
        "backends": {},
    }
    for backend in args.backends.split(","):
        emb = SentenceTransformerEmbedder(backend=backend)
        emb.warm_up()
        SpanScorer(emb).similarities("warm up", ["One sentence.", "Two sentences here."])
        prof = cProfile.Profile()
        calls = 0
        sentences = 0
        t = time.perf_counter()
        for q in questions:
            for b in budgets:
                p = H.Packer(packer.tok, span_scorer=SpanScorer(emb))
                p.builder = packer.builder
                prof.enable()
                packed = p.pack("ragbudget_spans", q.text, cands[q.qid], b)
                prof.disable()
                calls += 1
                sel = packed.prompt.selection
                sentences += sum(len(c.spans) for c in sel.chunks) + len(sel.spans_dropped)
        cold_s = time.perf_counter() - t
        # The cached path: one scorer that has seen every sentence (what stored vectors give).
        warm = H.Packer(packer.tok, span_scorer=SpanScorer(emb))
        warm.builder = packer.builder
        for q in questions:
            for b in budgets:
                warm.pack("ragbudget_spans", q.text, cands[q.qid], b)
        t = time.perf_counter()
        for q in questions:
            for b in budgets:
                warm.pack("ragbudget_spans", q.text, cands[q.qid], b)
        cached_s = time.perf_counter() - t
        stats = pstats.Stats(prof)
        parts = {k: round(_cum(stats, v) / calls, 4) for k, v in PARTS.items()}
        total = stats.total_tt / calls  # type: ignore[attr-defined]
        parts["other"] = round(
            total - parts["split_sentences"] - parts["token_counts"] - parts["bm25"] - parts["embed_total"], 4
        )
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: args.top]  # type: ignore[attr-defined]
        result["backends"][backend] = {
            "embedder_id": emb.id,
            "calls": calls,
            "mean_sentences_per_call": sentences / calls,
            "mean_cold_s_per_call": round(cold_s / calls, 4),
            "mean_cold_profiled_s_per_call": round(total, 4),
            "mean_cached_s_per_call": round(cached_s / calls, 4),
            "parts_s_per_call": parts,
            "top_own_time": [
                {
                    "function": f"{Path(f).name}:{line}:{name}",
                    "calls": nc,
                    "own_s": round(tt, 4),
                    "cumulative_s": round(ct, 4),
                }
                for (f, line, name), (_cc, nc, tt, ct, _c) in top
            ],
        }
        r = result["backends"][backend]
        print(
            f"{backend:>10} ({emb.id}): cold {r['mean_cold_s_per_call']:.3f} s/call "
            f"({r['mean_sentences_per_call']:.0f} sentences), cached {r['mean_cached_s_per_call']:.3f} s; "
            f"parts {parts}",
            flush=True,
        )
    result["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    from _results import write

    out = args.out or (H.ROOT / "bench" / "results" / "spans_profile.json")
    write(out.stem, result, folder=out.parent, packages=("sentence-transformers", "tokenizers", "onnxruntime"))


if __name__ == "__main__":
    main()
