"""Span packing with sentence vectors made other ways (issue #31): the sentence vectors an index
stores, pooled from the chunk's own forward pass ("late chunking") or embedded one sentence at a
time, on each embedder backend, everything else of ``build_prompt(pack="spans")`` unchanged.

The QA harness of ``bench/spans_qa.py`` (``bench/_qa_harness.py``): one index per split, the same
hybrid candidate list per question for every variant, answer in context at 128 … 1,024 tokens.
Each variant gives the :class:`~ragbudget.packing.spans.SpanScorer` every chunk's sentence vectors as an
index stores them (``stored=``, float16) and embeds the question with the same backend:

* ``separate@torch`` — each sentence embedded alone by sentence-transformers on torch: the
  harness's own vectors, what every span-packing table in BENCHMARKS.md was measured with;
* ``separate@onnx-int8`` — each sentence alone, int8 ONNX (the CPU default embedder);
* ``pooled@<backend>`` — pooled from the chunk pass: ``Embedder.embed(chunks, spans=sentences)``,
  the mean of the sentence's token states in the chunk's windows;
* ``pooled-centered<λ>@<backend>`` — a pooled vector minus λ × the mean of its chunk's pooled
  sentence vectors, made unit length again (the context every sentence of a chunk shares, taken
  partly out).

Won/lost are against ``--baseline`` (default ``separate@torch``), question by question.

    nice -n 19 python bench/spans_pooled.py --split squad-tune --docs 12 --questions 150 \
        --variants separate@torch,pooled@torch,separate@onnx-int8,pooled@onnx-int8

Choose on ``squad-tune``; ``squad-test`` and ``amazon`` report. Writes
``bench/results/spans_pooled_<split>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _qa_harness as H  # noqa: E402  (sets the offline environment first)
import numpy as np  # noqa: E402

BUDGETS = (128, 256, 512, 1024)


class QueryEmbedder:
    """A library embedder behind the two calls :class:`SpanScorer` makes, counting what it embeds."""

    def __init__(self, emb: object) -> None:
        self.emb = emb
        self.embedded = 0

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        self.embedded += len(texts)
        return self.emb.embed_documents(texts)  # type: ignore[attr-defined]

    def embed_query(self, text: str) -> np.ndarray:
        return self.emb.embed_query(text)  # type: ignore[attr-defined]


def sentence_vectors(corpus: H.Corpus, kind: str, backend: str) -> tuple[dict, object, float]:
    """``{chunk id: (digests, float16-rounded vectors)}`` of every chunk, the scorer's embedder,
    and the seconds the vectors took."""
    from ragbudget.packing.spans import sentence_digest, split_sentences
    from ragbudget.retrieval.embed import SentenceTransformerEmbedder

    spans = [[(a, b) for a, b, _ in split_sentences(t)] for t in corpus.texts]
    t0 = time.perf_counter()
    if backend == "torch" and kind == "separate":
        emb = corpus.sentence_embedder()  # the harness's cached vectors: today's tables
        mats = [emb.embed_documents([t[a:b] for a, b in sp]) for t, sp in zip(corpus.texts, spans, strict=True)]
        scorer_emb: object = emb
    else:
        lib = SentenceTransformerEmbedder(backend=backend)
        if kind == "separate":
            flat = [t[a:b] for t, sp in zip(corpus.texts, spans, strict=True) for a, b in sp]
            vecs = lib.embed_documents(flat)
            mats, pos = [], 0
            for sp in spans:
                mats.append(vecs[pos : pos + len(sp)])
                pos += len(sp)
        else:
            res = lib.embed(corpus.texts, spans=spans)
            assert res.spans is not None
            mats = list(res.spans)
        scorer_emb = QueryEmbedder(lib)
    seconds = time.perf_counter() - t0
    if kind.startswith("pooled-centered"):
        lam = float(kind.removeprefix("pooled-centered"))
        out = []
        for m in mats:
            c = m - lam * m.mean(axis=0, keepdims=True)
            out.append(c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-12))
        mats = out
    stored = {
        j: ([sentence_digest(t[a:b]) for a, b in sp], np.asarray(m, dtype=np.float16).astype(np.float32))
        for j, (t, sp, m) in enumerate(zip(corpus.texts, spans, mats, strict=True))
    }
    return stored, scorer_emb, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=H.SPLITS, default="squad-tune")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--questions", type=int, default=150)
    ap.add_argument("--variants", default="separate@torch,pooled@torch,separate@onnx-int8,pooled@onnx-int8")
    ap.add_argument("--baseline", default="separate@torch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.baseline not in variants:
        variants.insert(0, args.baseline)
    for v in variants:
        kind, _, backend = v.partition("@")
        if backend not in ("torch", "onnx", "onnx-int8") or not (
            kind in ("separate", "pooled") or kind.startswith("pooled-centered")
        ):
            raise SystemExit(f"--variants: {v!r} is not <separate|pooled|pooled-centered<λ>>@<torch|onnx|onnx-int8>")
    t_start = time.time()

    from ragbudget.generation.generate import Generator
    from ragbudget.packing.spans import SpanScorer

    gen = Generator()
    split = H.load_split(args.split, docs=args.docs, seed=args.seed)
    questions = H.sample_questions(split, args.questions, seed=args.seed)
    corpus = H.Corpus.build(split, questions)
    print(f"{args.split}: {len(corpus.texts)} chunks, {len(questions)} questions", flush=True)
    cfg = {"ragbudget_spans": {"system": "ragbudget_spans", "budgets": BUDGETS}}
    results: dict[str, dict] = {}
    cos_to_baseline: dict[str, float] = {}
    base_vecs = None
    for v in variants:
        kind, _, backend = v.partition("@")
        stored, emb, seconds = sentence_vectors(corpus, kind, backend)
        flat = np.concatenate([m for _, m in stored.values()])
        if v == args.baseline:
            base_vecs = flat
        elif base_vecs is not None:
            cos_to_baseline[v] = float((flat * base_vecs).sum(axis=1).mean())
        scorer = SpanScorer(emb, stored=lambda ids, s=stored: {i: s[i] for i in ids if i in s})
        packer = H.Packer(gen.tokenizer, span_scorer=scorer)
        grid = H.run_grid(corpus, packer, questions, cfg, BUDGETS)
        table, per_q = H.grid_tables(grid)
        results[v] = {
            "recall": {b: round(table["ragbudget_spans"][b]["recall"], 2) for b in BUDGETS},
            "per_question": per_q["ragbudget_spans"],
            "vector_seconds": round(seconds, 1),
            "sentences_embedded_at_question_time": getattr(emb, "embedded", None),
        }
        print(v, results[v]["recall"], f"(vectors {seconds:.0f}s)", flush=True)
    base = results[args.baseline]["per_question"]
    for v, r in results.items():
        r["vs_baseline"] = {}
        for b in BUDGETS:
            a, x = np.array(base[b]), np.array(r["per_question"][b])
            r["vs_baseline"][b] = {
                "points": round(100 * float(x.mean() - a.mean()), 2),
                "won": int(((x == 1) & (a == 0)).sum()),
                "lost": int(((x == 0) & (a == 1)).sum()),
            }
        r["cos_to_baseline_mean"] = cos_to_baseline.get(v)
        print(v, {b: (d["points"], d["won"], d["lost"]) for b, d in r["vs_baseline"].items()})
    from _results import write

    out = args.out or (H.ROOT / "bench" / "results" / f"spans_pooled_{args.split.replace('-', '_')}.json")
    write(
        out.stem,
        {
            "split": args.split,
            "documents": list(split.titles),
            "chunks": len(corpus.texts),
            "questions": len(questions),
            "question_ids": [q.qid for q in questions],
            "baseline": args.baseline,
            "variants": results,
            "seconds": round(time.time() - t_start, 1),
            "args": vars(args),
        },
        folder=out.parent,
        packages=("sentence-transformers", "tokenizers", "onnxruntime"),
    )


if __name__ == "__main__":
    main()
