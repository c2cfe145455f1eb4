"""Dedup quality and cost: Disfl-QA recall, SQuAD false merges, Constitution versions, 100k scale.

    .venv/bin/python bench/dedup.py            # full: 100k synthetic chunks, 200-chunk embedder sample
    .venv/bin/python bench/dedup.py --quick    # 20k chunks, 50-chunk embedder sample

1. Quality on real data: the 1,204 Disfl-QA contexts (re-tokenised copies of SQuAD paragraphs)
   must land with their SQuAD dev paragraph (recall), and no two of the 2,067 distinct SQuAD
   paragraphs may merge (false merges). Measured for the full pipeline (exact + near) and for
   the near path alone (every text given a distinct digest). Peer: datasketch MinHash/MinHashLSH
   at the same threshold and num_perm (time for the same texts, same shingles).
2. Constitution v1.0-v1.9 chunked with chunk_text(min_tokens=50, max_tokens=400): chunks kept,
   how many carry all ten sources.
3. Cost: N chunks made by resampling real sentences (SQuAD + the manuals + man pages) into
   chunk-sized texts whose token lengths follow ragbudget's own chunk sizes on the corpus, with
   10% exact copies (re-spaced) and 10% near copies (~1.7% of the words replaced). dedup() time at N/4,
   N/2 and N (linear growth), against the time all-MiniLM-L6-v2 needs to embed the same chunks
   (timed on a sample, extrapolated). Raw result: bench/results/dedup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chunking import SHARED, load_corpus

from ragbudget.chunking import chunk_text
from ragbudget.dedup import (
    DEFAULT_NUM_PERM,
    DEFAULT_SHINGLE,
    DEFAULT_THRESHOLD,
    Deduplicator,
    dedup,
)
from ragbudget.types import Chunk, Source


def squad_and_disfl() -> tuple[list[str], list[str], list[int]]:
    squad = json.loads((SHARED / "squad" / "squaddev_v1.1.json").read_text(encoding="utf-8"))
    paras = [p["context"] for art in squad["data"] for p in art["paragraphs"]]
    task = json.loads((SHARED / "disflqa" / "task.json").read_text(encoding="utf-8"))
    contexts = sorted({ex["input"].split("context: ", 1)[1] for ex in task["examples"]})
    by_letters = {"".join(p.split()): i for i, p in enumerate(paras)}
    gold = [by_letters["".join(c.split())] for c in contexts]
    return paras, contexts, gold


def quality() -> dict[str, object]:
    paras, contexts, gold = squad_and_disfl()
    pairs = [(Chunk(p, 0, len(p), 0), f"s{i}") for i, p in enumerate(paras)]
    pairs += [(Chunk(c, 0, len(c), 0), f"d{j}") for j, c in enumerate(contexts)]
    t0 = time.perf_counter()
    r = dedup(pairs)
    t_full = time.perf_counter() - t0
    home: dict[str, str] = {}
    false_merges = 0
    for it in r.items:
        squad_srcs = [s.path for s in it.sources if s.path.startswith("s")]
        false_merges += max(0, len(squad_srcs) - 1)
        for s in it.sources:
            home[s.path] = squad_srcs[0] if squad_srcs else s.path
    recall = sum(home[f"d{j}"] == f"s{g}" for j, g in enumerate(gold)) / len(contexts)
    # Near path alone: distinct digests disable the exact match.
    d = Deduplicator()
    t0 = time.perf_counter()
    near_false = sum(d.add(f"s{i}", p, digest=f"s{i}").kind != "new" for i, p in enumerate(paras))
    near_recall = sum(
        d.add(f"d{j}", c, digest=f"d{j}").duplicate_of == f"s{g}"
        for j, (c, g) in enumerate(zip(contexts, gold))
    ) / len(contexts)
    t_near = time.perf_counter() - t0
    out: dict[str, object] = {
        "squad_paragraphs": len(paras),
        "disfl_contexts": len(contexts),
        "recall": recall,
        "false_merges": false_merges,
        "exact_removed": r.exact_removed,
        "near_removed": r.near_removed,
        "near_only_recall": near_recall,
        "near_only_false_merges": near_false,
        "ragbudget_batch_s": t_full,
        "ragbudget_incremental_near_s": t_near,
    }
    # Peer: datasketch with the same shingles (word 3-grams of the same words).
    try:
        from datasketch import MinHash, MinHashLSH

        from ragbudget.dedup import _analyse

        def shingles(text: str) -> set[bytes]:
            an = _analyse([text])
            words = [text_of(an, a, b) for a, b in zip(an.word_starts, an.word_ends)]
            k = DEFAULT_SHINGLE
            return {" ".join(words[i : i + k]).encode() for i in range(max(1, len(words) - k + 1))}

        def text_of(an, a: int, b: int) -> str:  # type: ignore[no-untyped-def]
            return an.cp[a:b].tobytes().decode("utf-32-le")

        texts = paras + contexts
        sh = [shingles(t) for t in texts]  # not timed: only the MinHash + LSH part is compared
        t0 = time.perf_counter()
        lsh = MinHashLSH(threshold=DEFAULT_THRESHOLD, num_perm=DEFAULT_NUM_PERM)
        ds_false = 0
        for i, s in enumerate(sh):
            m = MinHash(num_perm=DEFAULT_NUM_PERM)
            m.update_batch(list(s))
            hits = lsh.query(m)
            if i < len(paras) and hits:
                ds_false += 1
            lsh.insert(str(i), m)
        t_ds = time.perf_counter() - t0
        out["datasketch_s"] = t_ds
        out["datasketch_squad_false_candidates"] = ds_false
    except ImportError as exc:
        print(f"datasketch not installed: {exc}", file=sys.stderr)
    return out


def constitution() -> dict[str, object]:
    files = [SHARED / "versions" / f"constitution.1.{i}.txt" for i in range(10)]
    pairs = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        pairs += [(c, Source(f.name, c.start, c.end)) for c in chunk_text(text, min_tokens=50, max_tokens=400)]
    r = dedup(pairs)
    return {
        "chunks_in": len(pairs),
        "kept": len(r.items),
        "exact_removed": r.exact_removed,
        "near_removed": r.near_removed,
        "kept_with_all_10_sources": sum(len(it.sources) == 10 for it in r.items),
    }


def synthetic(n: int, seed: int = 0) -> list[str]:
    """n chunk-sized texts resampled from real sentences, 10% exact + 10% near copies."""
    rng = random.Random(seed)
    docs = [t for _, t in load_corpus(False)]
    sentences = [s.strip() for t in docs for s in re.split(r"(?<=[.!?])\s+", t) if len(s.split()) >= 4]
    sizes = [c.n_tokens for t in docs[:60] for c in chunk_text(t)]
    out: list[str] = []
    while len(out) < n:
        r = rng.random()
        if out and r < 0.1:  # exact copy, re-spaced
            out.append(re.sub(r" ", "  ", rng.choice(out), count=3))
        elif out and r < 0.2:  # near copy: replace ~1.7% of the words
            words = rng.choice(out).split()
            for _ in range(max(1, len(words) // 60)):
                words[rng.randrange(len(words))] = rng.choice(["alpha", "beta", "gamma", "delta"])
            out.append(" ".join(words))
        else:
            target = rng.choice(sizes) * 0.75  # ~0.75 words per cl100k token
            words: list[str] = []
            parts = []
            while len(words) < target:
                s = rng.choice(sentences)
                parts.append(s)
                words += s.split()
            out.append(" ".join(parts))
    return out


def embedder_seconds_per_chunk(texts: list[str]) -> float:
    from sentence_transformers import SentenceTransformer

    from ragbudget.models import resolve_embedder

    model = SentenceTransformer(resolve_embedder(), device="cpu")
    model.encode(texts[:8], batch_size=32)  # warm-up
    t0 = time.perf_counter()
    model.encode(texts, batch_size=32)
    return (time.perf_counter() - t0) / len(texts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="20k chunks, 50-chunk embedder sample")
    ap.add_argument("--n", type=int, default=None, help="number of synthetic chunks")
    ap.add_argument("--no-embedder", action="store_true", help="skip the embedder timing")
    args = ap.parse_args()
    n = args.n or (20_000 if args.quick else 100_000)
    results: dict[str, object] = {
        "threshold": DEFAULT_THRESHOLD,
        "num_perm": DEFAULT_NUM_PERM,
        "shingle": DEFAULT_SHINGLE,
        "cpu_count": os.cpu_count(),
    }

    q = quality()
    results["quality"] = q
    print(f"Disfl-QA recall {q['recall']:.2%} (near path alone {q['near_only_recall']:.2%}); "
          f"false merges among {q['squad_paragraphs']} SQuAD paragraphs: {q['false_merges']} "
          f"(near alone {q['near_only_false_merges']})")
    if "datasketch_s" in q:
        print(f"MinHash+LSH over {q['squad_paragraphs'] + q['disfl_contexts']} texts: ragbudget "
              f"batch dedup {q['ragbudget_batch_s']:.2f}s (incl. normalising and hashing), "
              f"datasketch {q['datasketch_s']:.2f}s (MinHash+LSH only) -> "
              f"{q['datasketch_s'] / q['ragbudget_batch_s']:.1f}x")
    c = constitution()
    results["constitution"] = c
    print(f"Constitution v1.0-v1.9: {c['chunks_in']} chunks -> {c['kept']} kept "
          f"({c['exact_removed']} exact, {c['near_removed']} near), "
          f"{c['kept_with_all_10_sources']} with all ten sources")

    texts = synthetic(n)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    scale = []
    for m in (n // 4, n // 2, n):
        pairs = [(Chunk(t, 0, len(t), 0), f"doc{i // 20}") for i, t in enumerate(texts[:m])]
        t0 = time.perf_counter()
        r = dedup(pairs)
        dt = time.perf_counter() - t0
        scale.append({"chunks": m, "seconds": dt, "us_per_chunk": dt / m * 1e6,
                      "exact_removed": r.exact_removed, "near_removed": r.near_removed})
        print(f"dedup {m:>7} chunks: {dt:6.1f}s ({dt / m * 1e6:.0f} us/chunk), "
              f"exact {r.exact_removed}, near {r.near_removed}")
    results["scale"] = scale
    results["synthetic_mb"] = mb
    if not args.no_embedder:
        sample = random.Random(1).sample(texts, 50 if args.quick else 200)
        per = embedder_seconds_per_chunk(sample)
        est = per * n
        share = scale[-1]["seconds"] / est
        results["embedder"] = {"sample": len(sample), "s_per_chunk": per, "estimated_s": est,
                               "dedup_share": share, "threads": os.cpu_count()}
        print(f"all-MiniLM-L6-v2: {per * 1000:.1f} ms/chunk -> {est:.0f}s for {n} chunks; "
              f"dedup is {share:.1%} of that")
    from _results import write

    write("dedup", results, packages=("datasketch",))


if __name__ == "__main__":
    main()
