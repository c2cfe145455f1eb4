"""What span packing adds per question, against the generator's prefill of the same prompt.

One SQuAD dev article (default ``Normans``, a *test* article of bench/floor.py's splits, never
tuned on) is indexed with :class:`ragbudget.retrieval.index.Index` and the library defaults — chunking, and
the embedder ``SentenceTransformerEmbedder()`` picks (``--backend auto``: int8 ONNX on a CPU with
onnxruntime; ``torch`` is what the first runs of this script used) — with ``sentence_vectors=True``
so that the stored path can be timed too (``build.py`` ``_embed_sentences``). Each question takes
the top ``--fetch-k`` chunks by cosine (``Index.search``). For each context budget, the prompt is
built with :func:`ragbudget.prompt.prompt.build_prompt` — ``pack="chunks"``, then ``pack="spans"`` four
ways:

* *cold*: a fresh :class:`ragbudget.packing.spans.SpanScorer` over an empty sentence cache, so every pool
  sentence is embedded (and written to the cache): the first question on these chunks of an
  index built with the defaults (no stored sentence vectors);
* *cached*: a fresh scorer over that cache, as a later question — in another process too — takes:
  a read of the cache file, no sentence embedded;
* *stored*: a fresh scorer reading the index's stored sentence vectors (``stored=
  Index.sentence_vectors``, as ``Pipeline`` does): a SQLite read and the question's embedding, no
  sentence embedded — every question on an index built with ``--sentence-vectors``;
* *warm*: the stored scorer again (vectors already in its memory cache);

and SmolLM2-135M's prefill of the span prompt is timed (one forward pass, no generation). Added
time = spans − chunks, per question; medians reported. Answer-in-context (official SQuAD
normalization) is recorded alongside as a sanity check, not a result. The build's own time and
the part of it the sentence vectors take are recorded too.

    nice -n 19 .venv/bin/python bench/spans_speed.py --questions 8

Writes ``bench/results/spans_speed.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _results import write  # noqa: E402
from qa import normalize_answer  # noqa: E402

from ragbudget.fitting import build_prompt  # noqa: E402
from ragbudget.memory.models import resolve_generator  # noqa: E402
from ragbudget.packing.spans import SpanScorer  # noqa: E402
from ragbudget.prompt.prompt import PromptBuilder  # noqa: E402
from ragbudget.retrieval.embed import SentenceTransformerEmbedder  # noqa: E402
from ragbudget.retrieval.index import Index  # noqa: E402
from ragbudget.retrieval.sentence_cache import SentenceCache  # noqa: E402

SQUAD = Path(os.environ.get("RAGBUDGET_SHARED_DATA", ROOT.parent / "shared" / "data")) / "squad" / "squaddev_v1.1.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--article", default="Normans")
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--budgets", default="256,1024")
    ap.add_argument("--fetch-k", type=int, default=50)
    ap.add_argument("--backend", default="auto", help="SentenceTransformerEmbedder(backend=...)")
    ap.add_argument("--out", default="spans_speed")
    args = ap.parse_args()

    data = json.loads(SQUAD.read_text())["data"]
    art = next(a for a in data if a["title"] == args.article)
    text = "\n\n".join(p["context"] for p in art["paragraphs"])
    qs = [(q["question"], [a["text"] for a in q["answers"]]) for p in art["paragraphs"] for q in p["qas"]][
        : args.questions
    ]

    ref = resolve_generator()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref.path, gguf_file=ref.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(ref.path, gguf_file=ref.gguf_file, torch_dtype=torch.float32).eval()
    emb = SentenceTransformerEmbedder(backend=args.backend)
    emb.warm_up()
    tmp = Path(tempfile.mkdtemp(prefix="rb-spans-speed-"))
    (tmp / "docs").mkdir()
    (tmp / "docs" / f"{args.article}.txt").write_text(text)
    idx = Index(tmp / "idx")
    built = idx.build([str(tmp / "docs")], embedder=emb, sentence_vectors=True)
    idx = Index.open(tmp / "idx")
    print(
        f"index: {built.chunks_total} chunks in {built.seconds:.1f} s, chunk vectors "
        f"{built.embed_seconds:.1f} s, sentence vectors {built.sentence_seconds:.1f} s "
        f"({built.sentences_embedded} sentences)",
        flush=True,
    )
    builder = PromptBuilder(tok)

    def prefill(ids: tuple[int, ...]) -> float:
        with torch.inference_mode():
            t = time.perf_counter()
            model(torch.tensor([ids]))
            return time.perf_counter() - t

    prefill(tuple(tok.encode("warm up", add_special_tokens=False)))
    rows = []
    for q, answers in qs:
        cands = idx.search(q, k=args.fetch_k, embedder=emb)
        fixed = builder.fixed_tokens(q)
        for budget in [int(b) for b in args.budgets.split(",")]:
            common = dict(tokenizer=tok, max_prompt_tokens=fixed + budget, builder=builder, relevance_floor=0.5)
            t = time.perf_counter()
            pc = build_prompt(q, cands, **common)
            chunks_s = time.perf_counter() - t
            # An empty cache per question and budget: cold is the first question on these chunks.
            where = Path(tempfile.mkdtemp(dir=tmp))
            scorer = SpanScorer(emb, persist=SentenceCache(where, identity=idx.manifest["embedder"], dim=emb.dim))
            t = time.perf_counter()
            ps = build_prompt(q, cands, pack="spans", span_scorer=scorer, **common)
            spans_cold_s = time.perf_counter() - t
            cached = SpanScorer(emb, persist=SentenceCache(where, identity=idx.manifest["embedder"], dim=emb.dim))
            t = time.perf_counter()
            pca = build_prompt(q, cands, pack="spans", span_scorer=cached, **common)
            spans_cached_s = time.perf_counter() - t
            stored = SpanScorer(emb, stored=idx.sentence_vectors)
            t = time.perf_counter()
            pst = build_prompt(q, cands, pack="spans", span_scorer=stored, **common)
            spans_stored_s = time.perf_counter() - t
            t = time.perf_counter()
            build_prompt(q, cands, pack="spans", span_scorer=stored, **common)
            spans_warm_s = time.perf_counter() - t
            gold = [normalize_answer(a) for a in answers]
            rows.append(
                {
                    "question": q,
                    "budget": budget,
                    "chunks_s": chunks_s,
                    "spans_cold_s": spans_cold_s,
                    "spans_cached_s": spans_cached_s,
                    "spans_stored_s": spans_stored_s,
                    "spans_warm_s": spans_warm_s,
                    "added_cold_s": spans_cold_s - chunks_s,
                    "added_cached_s": spans_cached_s - chunks_s,
                    "added_stored_s": spans_stored_s - chunks_s,
                    "added_warm_s": spans_warm_s - chunks_s,
                    "sentences_embedded_cold": scorer.embedded,
                    "sentences_embedded_cached": cached.embedded,
                    "sentences_embedded_stored": stored.embedded,
                    "same_context_cached_vs_cold": pca.selection.text == ps.selection.text,
                    "same_context_stored_vs_cold": pst.selection.text == ps.selection.text,
                    "prefill_s": prefill(ps.input_ids),
                    "prompt_tokens": ps.n_tokens,
                    "sentences_considered": sum(len(p.spans) for p in ps.selection.chunks)
                    + len(ps.selection.spans_dropped),
                    "in_context_chunks": any(g in normalize_answer(pc.selection.text) for g in gold),
                    "in_context_spans": any(g in normalize_answer(ps.selection.text) for g in gold),
                }
            )
            r = rows[-1]
            print(
                f"{budget:5d} added cold {1000 * r['added_cold_s']:7.1f} ms  cached "
                f"{1000 * r['added_cached_s']:6.1f} ms  stored "
                f"{1000 * r['added_stored_s']:6.1f} ms  warm {1000 * r['added_warm_s']:6.1f} ms  "
                f"prefill {1000 * r['prefill_s']:7.1f} ms  {r['sentences_considered']} sentences",
                flush=True,
            )
    summary = {}
    for budget in sorted({r["budget"] for r in rows}):
        rs = [r for r in rows if r["budget"] == budget]

        def med(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(r[key] for r in rs)

        summary[str(budget)] = {
            "n": len(rs),
            "median_added_cold_ms": 1000 * med("added_cold_s"),
            "median_added_cached_ms": 1000 * med("added_cached_s"),
            "median_added_stored_ms": 1000 * med("added_stored_s"),
            "median_added_warm_ms": 1000 * med("added_warm_s"),
            "median_prefill_ms": 1000 * med("prefill_s"),
            "median_ratio_cold": med("added_cold_s") / med("prefill_s"),
            "median_ratio_cached": med("added_cached_s") / med("prefill_s"),
            "median_ratio_stored": med("added_stored_s") / med("prefill_s"),
            "sentences_embedded_cold": sum(r["sentences_embedded_cold"] for r in rs),
            "sentences_embedded_cached": sum(r["sentences_embedded_cached"] for r in rs),
            "same_context_cached_vs_cold": sum(r["same_context_cached_vs_cold"] for r in rs) / len(rs),
            "sentences_embedded_stored": sum(r["sentences_embedded_stored"] for r in rs),
            "same_context_stored_vs_cold": sum(r["same_context_stored_vs_cold"] for r in rs) / len(rs),
            "median_sentences": med("sentences_considered"),
            "in_context_chunks": sum(r["in_context_chunks"] for r in rs) / len(rs),
            "in_context_spans": sum(r["in_context_spans"] for r in rs) / len(rs),
        }
        print(budget, json.dumps(summary[str(budget)]))
    build = {
        k: v
        for k, v in built.to_dict().items()
        if k
        in ("chunks_total", "seconds", "embed_seconds", "sentence_seconds", "sentences_embedded", "chunks_embedded")
    }
    write(
        args.out,
        {
            "article": args.article,
            "chunks": built.chunks_total,
            "fetch_k": args.fetch_k,
            "embedder": emb.id,
            "backend": emb.backend,
            "build": build,
            "summary": summary,
            "rows": rows,
        },
        packages=("torch", "transformers", "sentence-transformers", "tokenizers", "onnxruntime"),
    )


if __name__ == "__main__":
    main()
