"""An index in PostgreSQL (pgvector) against the same index in a local folder, on the targets of
issue #34, each part on the same files with the same embedder in the same run:

* ``build``: whole-index wall time in interleaved rounds (local and database alternating, a fresh
  folder and a fresh schema each round), an unchanged re-run, and search latency (exact and HNSW);
* ``equality``: the SQuAD reporting split (``squad-test``, ``bench/_qa_harness.py``) indexed both
  ways with the packaged MiniLM; on every sampled question, exact vector search's top 10 (ids and
  scores) against the local index's, hybrid search's top 10, and lexical ranking — PostgreSQL
  full-text search against the local FTS5 BM25 — by overlap and by answer hit@k (a chunk holds a
  gold answer, SQuAD's normalisation), with bootstrap intervals and the paired difference;
* ``scale``: about ``--scale-chunks`` (100,000) distinct chunks, locally and in the database, with
  ``store="hnsw"``: build time, the recall each build tuned to, recall@10 against exact search
  measured again here on squad-test questions (queries the build never saw), and p50/p99 of
  vector, lexical and hybrid search. Embedding 100k chunks with MiniLM would take about 25 minutes
  on two cores, so ``--scale-embedder`` picks the vectors: ``minilm-mean`` (the default: 300-500-token
  chunks of 12 shuffled sentences of one SQuAD article each, a chunk's vector the mean of its
  sentences' real MiniLM vectors: real chunk sizes, but 48 tight topic clusters), ``minilm-copies``
  (one-sentence chunks: real MiniLM vectors of every real sentence, then perturbed copies, as
  ``bench/index_scale.py`` fills its 100k index) or ``hash`` (the model-free hash embedder);
  ``--ladder`` adds recall@10 and p50 at every rung of each store's search ladder, on noisy own
  vectors, pseudo-questions of 8/12/16 words and squad-tune/squad-test/Amazon questions: what the
  HNSW tuning target was chosen on (``ladder_copies.json``, ``ladder_mean.json``);
* ``burst``: two ``ragbudget serve`` processes on one database, a real ``llama-server`` behind
  them, answer ``--burst`` concurrent chat requests (clients honour ``Retry-After``) while a third
  process, ``ragbudget index``, commits a changed folder: status counts, and for every answer
  whether all the chunks it cites are rows of the one generation it reports.

The server is pgserver's (PostgreSQL 16 + pgvector in a wheel, a Unix socket, on this machine):
what the database costs, not a network. Query vectors are embedded once beforehand, so the
latencies are the storage's alone (``Index.search_vector``: the vector search plus reading the
hits' chunks and sources).

    python bench/postgres.py                      # every part -> bench/results/postgres.json
    python bench/postgres.py --parts scale --scale-embedder minilm-copies --name postgres_scale_copies

Raw result: bench/results/postgres.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

import _qa_harness as H  # noqa: E402  (sets the offline environment first)
from _llama import free_port, healthy_process, llama_server, packaged_gguf  # noqa: E402
from _results import write  # noqa: E402

PARTS = ("build", "equality", "scale", "burst")
QUESTIONS = [
    "What is the largest city of Poland?",
    "Who discovered oxygen?",
    "What is packet switching?",
    "What happens when a pipe is closed?",
    "Which error does close return for a bad file descriptor?",
    "Who may appoint a delegate under the Debian constitution?",
    "What does a new maintainer do first?",
    "When was Warsaw founded?",
]


def with_schema(url: str, schema: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}ragbudget_schema={schema}"


def percentiles(times: list[float]) -> dict[str, Any]:
    times = sorted(times)
    at = lambda q: round(1000 * times[min(len(times) - 1, int(q * len(times)))], 2)  # noqa: E731
    return {
        "p50_ms": round(1000 * statistics.median(times), 2),
        "p95_ms": at(0.95),
        "p99_ms": at(0.99),
        "queries": len(times),
    }


def timed_searches(ix: Any, vectors: list[Any], repeats: int, k: int = 5) -> dict[str, Any]:
    ix.search_vector(vectors[0], k)  # open the generation first
    times = []
    for _ in range(repeats):
        for v in vectors:
            t = time.perf_counter()
            ix.search_vector(v, k)
            times.append(time.perf_counter() - t)
    return percentiles(times)


def timed(call: Callable[[str], Any], queries: list[str]) -> dict[str, Any]:
    """Latency of ``call`` on each query text once (the first call, which opens the generation, untimed)."""
    call(queries[0])
    times = []
    for q in queries:
        t = time.perf_counter()
        call(q)
        times.append(time.perf_counter() - t)
    return percentiles(times)


def copies_of_data(folder: Path, copies: int) -> Path:
    """data/ ``copies`` times (indexed with dedup off, so every copy's chunks are stored)."""
    out = folder / "docs"
    for c in range(copies):
        for src in (REPO / "data").rglob("*"):
            if src.is_file() and src.suffix in (".md", ".txt", ".pdf"):
                dst = out / f"copy{c}" / src.relative_to(REPO / "data")
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, dst)
    return out


# -- build ----------------------------------------------------------------------------------------
def part_build(args: argparse.Namespace, url: str, folder: Path) -> dict[str, Any]:
    from ragbudget.retrieval.embed import HashEmbedder, SentenceTransformerEmbedder
    from ragbudget.retrieval.index import Index

    emb = SentenceTransformerEmbedder() if args.embedder == "minilm" else HashEmbedder(dim=384)
    docs = copies_of_data(folder, args.copies)
    dedup = "near" if args.copies == 1 else "none"
    out: dict[str, Any] = {"corpus": f"data/ x{args.copies}", "embedder": emb.id, "dedup": dedup, "rounds": args.rounds}
    # Interleaved rounds, so a neighbour's load on the shared cores falls on both alike; the
    # ratio is of the medians. The last round's index is the one searched below.
    walls: dict[str, list[float]] = {"local": [], "postgres": []}
    for r in range(args.rounds):
        for name, where in (("local", str(folder / f"ix{r}")), ("postgres", with_schema(url, f"r{r}"))):
            t = time.perf_counter()
            s = Index(where).build([str(docs)], embedder=emb, dedup=dedup)
            walls[name].append(round(time.perf_counter() - t, 2))
            if r < args.rounds - 1:
                continue
            t = time.perf_counter()
            again = Index(where).build([str(docs)], embedder=emb)
            rerun = time.perf_counter() - t
            out[name] = {
                "chunks": s.chunks_total,
                "build_s": statistics.median(walls[name]),
                "build_s_rounds": walls[name],
                "embed_s": round(s.embed_seconds, 2),
                "unchanged_rerun_s": round(rerun, 3),
                "rerun_committed": again.committed,
            }
    out["build_ratio_postgres_to_local"] = round(out["postgres"]["build_s"] / out["local"]["build_s"], 2)
    out["build_ratio_target"] = 1.2
    last = with_schema(url, f"r{args.rounds - 1}")
    vectors = [emb.embed_query(q) for q in QUESTIONS]
    local, pg_exact = Index.open(str(folder / f"ix{args.rounds - 1}")), Index.open(last, use_approx=False)
    out["local"]["search_flat"] = timed_searches(local, vectors, args.repeats)
    out["postgres"]["search_exact"] = timed_searches(pg_exact, vectors, args.repeats)
    t = time.perf_counter()
    Index(last).build([str(docs)], embedder=emb, store="hnsw")
    out["postgres"]["hnsw_build_and_tune_s"] = round(time.perf_counter() - t, 2)
    pg_hnsw = Index.open(last)
    out["postgres"]["hnsw"] = {
        k: pg_hnsw.manifest["approx"][k] for k in ("ef_search", "recall_at_10", "recall_queries")
    }
    out["postgres"]["search_hnsw"] = timed_searches(pg_hnsw, vectors, args.repeats)
    for ix in (local, pg_exact, pg_hnsw):
        ix.close()
    return out


# -- equality -------------------------------------------------------------------------------------
def hit_at(hits: list[Any], answers: tuple[str, ...], k: int) -> float:
    return float(any(H.contains_answer(h.text, answers) for h in hits[:k]))


def cell(values: list[float]) -> dict[str, Any]:
    lo, hi = H.bootstrap_ci(values)
    return {"mean": round(100 * statistics.fmean(values), 1), "ci95": [round(100 * lo, 1), round(100 * hi, 1)]}


def part_equality(args: argparse.Namespace, url: str, folder: Path) -> dict[str, Any]:
    from ragbudget.retrieval.embed import SentenceTransformerEmbedder
    from ragbudget.retrieval.index import Index

    split = H.load_split("squad-test", docs=args.docs)
    questions = H.sample_questions(split, args.questions)
    docs = folder / "squad"
    docs.mkdir()
    for title, text in zip(split.titles, split.texts, strict=True):
        (docs / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', title)}.md").write_text(f"# {title}\n\n{text}\n", encoding="utf-8")
    emb = SentenceTransformerEmbedder()
    where = {"local": str(folder / "ix-squad"), "postgres": with_schema(url, "squad")}
    built = {name: Index(w).build([str(docs)], embedder=emb) for name, w in where.items()}
    local, pg = Index.open(where["local"]), Index.open(where["postgres"], use_approx=False)
    k = 10
    same_ids = same_scores = same_hybrid = 0
    max_diff = 0.0
    overlap_lex: list[float] = []
    overlap_hybrid: list[float] = []
    hits: dict[str, list[float]] = {}
    for q in questions:
        v = emb.embed_query(q.text)
        a, b = local.search_vector(v, k), pg.search_vector(v, k)
        same_ids += [h.chunk_id for h in a] == [h.chunk_id for h in b]
        diffs = [abs(x.score - y.score) for x, y in zip(a, b, strict=True)] if len(a) == len(b) else [1.0]
        same_scores += max(diffs) <= 1e-5
        max_diff = max(max_diff, *diffs)
        la, lb = local.search_lexical(q.text, k), pg.search_lexical(q.text, k)
        overlap_lex.append(len({h.chunk_id for h in la} & {h.chunk_id for h in lb}) / k)
        ha, hb = local.search(q.text, k, hybrid=True), pg.search(q.text, k, hybrid=True)
        same_hybrid += [h.chunk_id for h in ha] == [h.chunk_id for h in hb]
        overlap_hybrid.append(len({h.chunk_id for h in ha} & {h.chunk_id for h in hb}) / k)
        for name, got in (
            ("vector", a),
            ("fts5_bm25", la),
            ("postgres_fts", lb),
            ("hybrid_local", ha),
            ("hybrid_postgres", hb),
        ):
            for n in (1, 5, 10):
                hits.setdefault(f"{name}@{n}", []).append(hit_at(got, q.answers, n))
    local.close()
    pg.close()
    n = len(questions)
    lexical = {key: cell(v) for key, v in hits.items() if key.split("@")[0] in ("fts5_bm25", "postgres_fts")}
    for at in (1, 5, 10):
        d = [x - y for x, y in zip(hits[f"postgres_fts@{at}"], hits[f"fts5_bm25@{at}"], strict=True)]
        lexical[f"postgres_minus_fts5@{at}"] = cell(d)
    return {
        "split": "squad-test (reporting split)",
        "documents": len(split.titles),
        "chunks": {name: s.chunks_total for name, s in built.items()},
        "embedder": emb.id,
        "questions": n,
        "k": k,
        "vector_exact": {
            "top10_ids_equal": f"{same_ids}/{n}",
            "top10_scores_equal_1e-5": f"{same_scores}/{n}",
            "max_score_difference": float(f"{max_diff:.3g}"),
            "answer_hit": {key: cell(v) for key, v in hits.items() if key.startswith("vector@")},
        },
        "lexical": {
            "how": "answer hit@k: a returned chunk contains a gold answer (SQuAD normalisation); "
            "postgres_fts = the database index's BM25 over to_tsvector('english') (PgCatalog.lexical), "
            "fts5_bm25 = SQLite FTS5 bm25() (porter tokenizer)",
            "top10_overlap_mean": round(statistics.fmean(overlap_lex), 3),
            **lexical,
        },
        "hybrid": {
            "top10_ids_equal": f"{same_hybrid}/{n}",
            "top10_overlap_mean": round(statistics.fmean(overlap_hybrid), 3),
            **{key: cell(v) for key, v in hits.items() if key.startswith("hybrid_")},
        },
    }


# -- scale ----------------------------------------------------------------------------------------
SENTENCE = re.compile(r"(?<=[.!?])\s+")


def squad_sentences() -> list[list[str]]:
    """The sentences (4 words or more) of each SQuAD dev article."""
    return [[x for x in SENTENCE.split(text) if len(x.split()) >= 4] for _, text, _ in H._squad_docs(H.SQUAD)]


def scale_corpus(folder: Path, chunks: int, seed: int = 0) -> tuple[Path, int]:
    """Distinct documents enough for about ``chunks`` chunks: each section draws 12 sentences of
    one SQuAD dev article in a seeded order, so documents are topical (48 topics) and no two
    chunks are the same text. Returns the folder and the words written."""
    articles = squad_sentences()
    rng = random.Random(seed)
    out = folder / "scale"
    out.mkdir()
    words_needed = chunks * 330  # ~440 tokens per chunk at ~1.33 tokens per word (cl100k on SQuAD)
    words = f = 0
    while words < words_needed:
        parts = []
        for _ in range(12):
            art = articles[rng.randrange(len(articles))]
            para = " ".join(rng.sample(art, min(12, len(art))))
            parts.append(para)
            words += len(para.split())
        (out / f"d{f:05d}.md").write_text("\n\n".join(parts) + "\n", encoding="utf-8")
        f += 1
    return out, words


def minilm_vectors(texts: list[str], tag: str) -> tuple[Any, Any]:
    """The packaged MiniLM (the library's embedder) and its vectors of ``texts``, cached in
    bench/out/ under ``tag``, the embedder and the count (each text embedded once, ever)."""
    import numpy as np

    from ragbudget.retrieval.embed import SentenceTransformerEmbedder

    model = SentenceTransformerEmbedder()
    cache = H.OUT / f"{tag}_{model.id.replace('/', '_')}_{len(texts)}.npy"
    if cache.is_file():
        return model, np.load(cache)
    H.OUT.mkdir(parents=True, exist_ok=True)
    vecs = np.asarray(model.embed_documents(texts), dtype=np.float32)
    np.save(cache, vecs)
    return model, vecs


def lookup_embedder(model: Any, table: dict[str, Any], pieces: Callable[[str], list[str]], name: str) -> Any:
    """An embedder whose vector of a text is the normalised mean of ``table``'s vectors of its
    ``pieces`` (a text with none keeps the hash embedder's vector: rare, a cut piece), and whose
    query vector is ``model``'s own."""
    import numpy as np

    from ragbudget.retrieval.embed import HashEmbedder

    class Lookup(HashEmbedder):
        def __init__(self) -> None:
            super().__init__(dim=model.dim, pool_spans=False)
            self.id = name

        def _encode(self, texts: Any) -> Any:
            out = super()._encode(texts)
            for i, text in enumerate(texts):
                found = [table[x] for x in pieces(text) if x in table]
                if found:
                    v = np.mean(found, axis=0)
                    out[i] = v / np.linalg.norm(v)
            return out

        def embed_query(self, text: str) -> Any:
            return model.embed_query(text)

    return Lookup()


def sentence_mean_embedder() -> Any:
    """Real MiniLM geometry at 100k chunks without embedding 100k chunks (about 25 minutes on
    two cores): a chunk's vector is the normalised mean of the packaged MiniLM's vectors of its
    whole sentences (each SQuAD sentence embedded once, cached in bench/out/), and a query is
    embedded by MiniLM itself. Stated as such in the raw result."""

    sentences = sorted({x for art in squad_sentences() for x in art})
    model, vecs = minilm_vectors(sentences, "scale_sentences")
    table = dict(zip(sentences, vecs, strict=True))

    return lookup_embedder(model, table, SENTENCE.split, f"squad-sentence-mean:{model.id}")


def real_sentences(max_words: int = 24) -> list[str]:
    """Every distinct sentence (4 to ``max_words`` words) of SQuAD dev, SQuADShifts Amazon and CoQA."""
    import json

    texts = [t for _, t, _ in H._squad_docs(H.SQUAD)] + [t for _, t, _ in H._squad_docs(H.AMAZON)]
    texts += [item["story"] for item in json.loads(H.COQA.read_text(encoding="utf-8"))["data"]]
    found = {x.strip() for t in texts for para in t.split("\n") for x in SENTENCE.split(para.strip())}
    return sorted(x for x in found if 4 <= len(x.split()) <= max_words)


def copies_corpus(folder: Path, chunks: int) -> tuple[Path, int, dict[str, Any]]:
    """About ``chunks`` one-sentence chunks: every real sentence once, then copies marked `` [j]``
    until the count is reached; 500 paragraphs a file. Returns the folder, the paragraphs written
    and the embedder that gives a real sentence the packaged MiniLM's vector and copy ``j`` that
    vector plus Gaussian noise (sigma 0.0316 a dimension: cosine ≈ 0.85 to the original, as
    ``bench/index_scale.py`` fills its 100k and 1M indexes)."""
    import numpy as np

    real = real_sentences()
    model, vecs = minilm_vectors(real, "scale_real_sentences")
    rng = np.random.default_rng(0)
    pieces: list[str] = []
    table: dict[str, Any] = {}
    j = 0
    while len(pieces) < chunks:
        for x, v in zip(real, vecs, strict=True):
            if len(pieces) >= chunks:
                break
            if j:
                x = f"{x} [{j}]"
                v = v + 0.0316 * rng.standard_normal(v.shape).astype(np.float32)
                v = v / np.linalg.norm(v)
            pieces.append(x)
            table[x] = v
        j += 1
    out = folder / "scale"
    out.mkdir()
    for f in range(0, len(pieces), 500):
        (out / f"s{f // 500:05d}.md").write_text("\n\n".join(pieces[f : f + 500]) + "\n", encoding="utf-8")

    info = {"real_sentences": len(real), "pieces": len(pieces), "copies_of_each": j}
    emb = lookup_embedder(model, table, lambda text: text.split("\n\n"), f"real-sentences-and-copies:{model.id}")
    return out, len(pieces), {"embedder": emb, **info}


def recall_on_questions(approx: Any, exact: Any, vectors: list[Any], k: int = 10) -> float:
    """recall@k of ``approx`` against ``exact`` on these query vectors, tie-aware as the build's
    own measurement: a hit scoring as high as the k-th true neighbour is as good as it."""
    found = total = 0
    for v in vectors:
        truth, got = exact.search_vector(v, k), approx.search_vector(v, k)
        ids, kth = {h.chunk_id for h in truth}, truth[-1].score
        found += sum(1 for h in got if h.chunk_id in ids or h.score >= kth - 1e-6)
        total += len(truth)
    return round(found / total, 4)


def windows(ix: Any, emb: Any, words: int) -> Any:
    """The library's pseudo-questions (what an HNSW graph tunes on: 12-word windows) of ``words`` words."""
    from ragbudget.retrieval.build import pseudo_questions

    gen = ix._generation()
    return pseudo_questions(gen.catalog, gen.exact.ids(), emb, words=words)


def ladder_sweep(ix: Any, queries: dict[str, Any], timing: list[Any], k: int = 10) -> list[dict[str, Any]]:
    """At each rung of the search store's own ladder: recall@k against exact on every named query
    set (own noisy vectors at each noise level, as the build's tuning measures; pseudo-questions;
    the question splits) and the p50 of ``Index.search_vector`` on ``timing``."""
    from ragbudget.retrieval.postgres import EF_SEARCH_LADDER, PgHnswStore
    from ragbudget.retrieval.vectors import EF_LADDER, measure_recall

    gen = ix._generation()
    store, exact = gen.search, gen.exact
    pg = isinstance(store, PgHnswStore)
    was = store.ef_search if pg else store.params["ef_search"]
    rows = []
    for ef in EF_SEARCH_LADDER if pg else EF_LADDER:
        if pg:
            store.ef_search = ef
        else:
            store._set_param(ef)
        row: dict[str, Any] = {"ef_search": ef}
        for noise in (1.0, 1.37, 1.8):
            row[f"own_noise_{noise}"] = round(measure_recall(store, exact, noise=noise)[0], 4)
        for name, q in queries.items():
            row[name] = round(measure_recall(store, exact, k=k, questions=q)[0], 4)
        row["p50_ms"] = timed_searches(ix, timing, 2, k)["p50_ms"]
        rows.append(row)
        print(row, flush=True)
    if pg:
        store.ef_search = was
    else:
        store._set_param(was)
    return rows


def lexical(ix: Any, k: int, query: str) -> Any:
    return ix.search_lexical(query, k)


def hybrid(ix: Any, emb: Any, vectors: dict[str, Any], k: int, query: str) -> Any:
    return ix.search(query, k, hybrid=True, embedder=emb, query_vector=vectors[query])


def part_scale(args: argparse.Namespace, url: str, folder: Path) -> dict[str, Any]:
    from ragbudget.retrieval.embed import HashEmbedder
    from ragbudget.retrieval.index import Index

    sizes: dict[str, Any] = {"dedup": "none", "store": "hnsw"}
    if args.scale_embedder == "minilm-copies":
        docs, n, info = copies_corpus(folder, args.scale_chunks)
        emb = info.pop("embedder")
        corpus = f"{n:,} one-sentence paragraphs, 500 a file ({info})"
        sizes.update(min_tokens=8, max_tokens=48)  # one sentence a chunk, so each keeps its own vector
    else:
        docs, words = scale_corpus(folder, args.scale_chunks)
        emb = sentence_mean_embedder() if args.scale_embedder == "minilm-mean" else HashEmbedder(dim=384)
        corpus = (
            f"{len(list(docs.iterdir()))} documents, {words:,} words: sections of 12 shuffled sentences of one "
            "SQuAD dev article each (distinct chunks, 48 topics), the library's 300-500-token chunks"
        )
    qs = [q.text for q in H.sample_questions(H.load_split("squad-test", docs=24), args.scale_queries)]
    vectors = [emb.embed_query(q) for q in qs]
    k = 10
    ladder_queries: dict[str, Any] = {}
    if args.ladder:
        import numpy as np

        # The tuning split chooses the build's tuning rule; squad-test and amazon report it.
        for split in ("squad-tune", "squad-test", "amazon"):
            picked = H.sample_questions(H.load_split(split, docs=24), args.scale_queries, seed=1)
            ladder_queries[f"questions_{split}"] = np.stack([emb.embed_query(q.text) for q in picked])
    out: dict[str, Any] = {
        "corpus": corpus,
        "embedder": emb.id,
        "vectors": {
            "minilm-mean": "each chunk: the normalised mean of the packaged MiniLM's vectors of its whole "
            "sentences (a stand-in for embedding 100k chunks); each question: MiniLM itself",
            "hash": "the model-free hash embedder (bag of words): near-random directions, HNSW's hard case",
            "minilm-copies": "real MiniLM vectors of real sentences, then perturbed copies (cosine 0.85 to their "
            "original), as bench/index_scale.py; each question: MiniLM itself",
        }[args.scale_embedder],
        "queries": f"{len(qs)} squad-test questions (queries the build never saw)",
        "recall_target": 0.98,
        "p50_target_ms": 10,
    }
    # The same files, store="hnsw" both ways: FAISS HNSW + FTS5 locally, pgvector HNSW + FTS in
    # the database, each tuned by its own build.
    for name, where in (("local", str(folder / "ix-scale")), ("postgres", with_schema(url, "scale"))):
        t = time.perf_counter()
        s = Index(where).build([str(docs)], embedder=emb, **sizes)
        build_s = time.perf_counter() - t
        approx, exact = Index.open(where), Index.open(where, use_approx=False)
        built = approx.manifest["approx"]
        out[name] = {
            "chunks": s.chunks_total,
            "build_s": round(build_s, 1),
            "hnsw_as_built": {
                key: built[key]
                for key in (
                    "ef_search",
                    "params",
                    "tuned_on",
                    "recall_at_10_questions",
                    "recall_target",
                    "recall_at_10",
                    "recall_queries",
                )
                if key in built
            },
            "recall_at_10_on_questions": recall_on_questions(approx, exact, vectors, k),
            "search_hnsw_k10": timed_searches(approx, vectors, args.repeats, k),
            "search_exact_k10": timed_searches(exact, vectors, 1, k),
            "search_lexical_k10": timed(functools.partial(lexical, approx, k), qs),
            "search_hybrid_k10": timed(
                functools.partial(hybrid, approx, emb, dict(zip(qs, vectors, strict=True)), k), qs
            ),
        }
        if args.ladder:
            out[name]["ladder"] = ladder_sweep(
                approx,
                {**ladder_queries, **{f"windows_{w}": windows(approx, emb, w) for w in (8, 12, 16)}},
                vectors,
                k,
            )
        approx.close()
        exact.close()
        print(name, out[name], flush=True)
    return out


# -- burst ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def serve(url: str, engine: str, port: int, log: Path) -> Iterator[str]:

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # --engine-timeout 120: a CPU llama-server shared by two servers takes longer than the 30 s
    # default to start answering a 1,500-token prompt when all its slots are busy.
    cmd = [sys.executable, "-m", "ragbudget", "serve", "--index", url, "--engine", engine, "--port", str(port)]
    cmd += ["--engine-timeout", "120"]
    with healthy_process(cmd, f"http://127.0.0.1:{port}", log, what="ragbudget serve", cwd=REPO, env=env) as base:
        yield base


def part_burst(args: argparse.Namespace, url: str, folder: Path) -> dict[str, Any]:
    import httpx
    import psycopg

    from ragbudget.retrieval.embed import SentenceTransformerEmbedder
    from ragbudget.retrieval.index import Index

    docs = folder / "burst"
    shutil.copytree(REPO / "data", docs, ignore=shutil.ignore_patterns("model_configs"))
    where = with_schema(url, "burst")
    Index(where).build([str(docs)], embedder=SentenceTransformerEmbedder())
    # Questions the indexed files answer: data/squad holds three SQuAD dev articles (two in
    # squad-tune, one in squad-test; no tuning here, only load). A question about an article that
    # is not indexed is declined by the evidence floor without the engine: the run of 2026-12-07
    # that sent squad-test questions got 4 of 40 answers citing a passage, in 0.2 s at the median
    # (postgres_1207_declined.json): most were declined, and the burst loaded no engine.
    held = {p.stem for p in (docs / "squad").glob("*.md")}
    pool = [
        q.text
        for split in (H.load_split(name, docs=24) for name in ("squad-tune", "squad-test"))
        for q in split.questions
        if split.titles[q.doc] in held
    ]
    questions = random.Random(0).sample(pool, args.burst)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(llama_server(folder, slots=4, slot_tokens=2048))
        bases = [stack.enter_context(serve(where, engine, free_port(), folder / f"serve{i}.log")) for i in range(2)]
        go = threading.Barrier(args.burst + 1)

        def client(i: int) -> None:
            body = {"model": "ragbudget", "messages": [{"role": "user", "content": questions[i]}], "max_tokens": 16}
            go.wait()
            time.sleep(i * args.burst_spread / args.burst)  # arrivals spread so some come after the commit
            t, refusals = time.perf_counter(), []
            r = httpx.post(bases[i % 2] + "/v1/chat/completions", json=body, timeout=300)
            while r.status_code == 429 and time.perf_counter() - t < 600:  # a client's 10-minute deadline
                # Each refusal as the client met it: when, what it was told to wait, and why (the
                # run of 2026-12-07 had Retry-After values of over 1,300 s with the engine idle).
                wait = float(r.headers.get("retry-after", "1"))
                why = r.json().get("error", {}).get("message", "")
                refusals.append({"at_s": round(time.perf_counter() - t, 1), "retry_after_s": wait, "why": why[:200]})
                time.sleep(wait)
                r = httpx.post(bases[i % 2] + "/v1/chat/completions", json=body, timeout=300)
            row: dict[str, Any] = {
                "status": r.status_code,
                "retries": len(refusals),
                "seconds": time.perf_counter() - t,
                "refusals": refusals,
            }
            if r.status_code != 200:
                row["error"] = r.text[:300]
            if r.status_code == 200:
                a = r.json()
                row["generation"] = a["ragbudget"]["index"]["generation"]
                row["declined"] = bool(a["ragbudget"].get("declined"))
                row["chunk_ids"] = sorted({c for src in a["sources"] for c in src["chunk_ids"]})
            with lock:
                results.append(row)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.burst)]
        for th in threads:
            th.start()
        (docs / "squad" / "added.md").write_text("# Added\n\nOxygen was also studied by Lavoisier in Paris.\n")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        go.wait()
        time.sleep(args.burst_spread / 4)  # the first requests are in the servers before the writer starts
        t = time.perf_counter()
        indexer = subprocess.run(
            [sys.executable, "-m", "ragbudget", "index", str(docs), "--index", where],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        index_s = time.perf_counter() - t
        for th in threads:
            th.join(timeout=900)
    one_generation = 0
    with psycopg.connect(url, autocommit=True) as conn:
        for row in results:
            if row["status"] != 200:
                continue
            g, ids = row["generation"], row["chunk_ids"]
            seen = conn.execute(
                "SELECT COUNT(DISTINCT id) FROM burst.chunks WHERE id = ANY(%s) AND gen_from <= %s "
                "AND (gen_to IS NULL OR gen_to > %s)",
                (ids, g, g),
            ).fetchone()
            row["all_cited_chunks_in_its_generation"] = bool(ids) and seen == (len(ids),)
            # Why an answer is not counted: it cites nothing (a declined answer has no source),
            # or it cites a chunk its generation does not hold (a mixed read: the defect).
            row["cited_in_its_generation"] = f"{seen[0] if seen else 0}/{len(ids)}"
            one_generation += row["all_cited_chunks_in_its_generation"]
    statuses: dict[str, int] = {}
    for row in results:
        statuses[str(row["status"])] = statuses.get(str(row["status"]), 0) + 1
    answered = [r for r in results if r["status"] == 200]
    gens: dict[str, int] = {}
    for r in answered:
        gens[str(r["generation"])] = gens.get(str(r["generation"]), 0) + 1
    return {
        "setup": "data/ indexed with the packaged MiniLM; 2 x `ragbudget serve --index URL --engine <llama-server> "
        "--engine-timeout 120` "
        f"({Path(packaged_gguf()).name}, the packaged default generator, -np 4, 2,048 tokens a slot); "
        "clients: one chat request each, max_tokens 16, "
        "Retry-After honoured until a 10-minute deadline; "
        f"requests sent over {args.burst_spread:g} s; `ragbudget index` of the folder with one file added, "
        f"started {args.burst_spread / 4:g} s in",
        "requests": args.burst,
        "statuses": statuses,
        "5xx": sum(n for s, n in statuses.items() if s.startswith("5")),
        "retries_429": sum(r["retries"] for r in results),
        "answers_by_generation": gens,
        "errors": sorted({r["error"] for r in results if "error" in r}),
        "answers_citing_one_generation": f"{one_generation}/{len(answered)}",
        # The answers not counted above, each with why: declined (no source) or chunks cited
        # outside its generation.
        "answers_not_citing_one_generation": [
            {k: r[k] for k in ("generation", "declined", "cited_in_its_generation")}
            for r in answered
            if not r.get("all_cited_chunks_in_its_generation")
        ],
        "retry_after_s": {
            "refusals": sum(len(r["refusals"]) for r in results),
            "max": max((f["retry_after_s"] for r in results for f in r["refusals"]), default=None),
            "p50": statistics.median(f["retry_after_s"] for r in results for f in r["refusals"])
            if any(r["refusals"] for r in results)
            else None,
        },
        "clients": [
            {k: r.get(k) for k in ("status", "seconds", "refusals", "declined", "cited_in_its_generation")}
            for r in results
        ],
        "latency_s": {
            "p50": round(statistics.median(r["seconds"] for r in answered), 1) if answered else None,
            "max": round(max(r["seconds"] for r in answered), 1) if answered else None,
        },
        "reindex": {
            "returncode": indexer.returncode,
            "seconds": round(index_s, 1),
            "stderr_tail": indexer.stderr[-300:],
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--embedder", choices=("minilm", "hash"), default="hash", help="build part's embedder")
    ap.add_argument("--copies", type=int, default=30, help="build part: copies of data/ to index")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="build part: interleaved rounds (local, postgres, ...)")
    ap.add_argument("--docs", type=int, default=24, help="equality part: squad-test articles")
    ap.add_argument("--questions", type=int, default=200, help="equality part: sampled questions")
    ap.add_argument(
        "--scale-chunks", type=int, default=100_000, help="scale part: chunks (minilm-copies: sentences, ~2 a chunk)"
    )
    ap.add_argument("--scale-queries", type=int, default=200)
    ap.add_argument("--scale-embedder", choices=("minilm-copies", "minilm-mean", "hash"), default="minilm-mean")
    ap.add_argument(
        "--ladder", action="store_true", help="scale part: recall and p50 at every ef_search of each store's ladder"
    )
    ap.add_argument("--burst", type=int, default=40, help="burst part: chat requests")
    ap.add_argument("--burst-spread", type=float, default=20, help="burst part: seconds over which they are sent")
    ap.add_argument("--name", default="postgres")
    ap.add_argument("--note", default="", help="history to keep in the raw result (what changed since the last run)")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        raise SystemExit(f"unknown parts {sorted(unknown)}; of {', '.join(PARTS)}")

    import pgserver

    run: dict[str, Callable[[argparse.Namespace, str, Path], dict[str, Any]]] = {
        "build": part_build,
        "equality": part_equality,
        "scale": part_scale,
        "burst": part_burst,
    }
    out: dict[str, Any] = {"parts": parts}
    if args.note:
        out["note"] = args.note
    with tempfile.TemporaryDirectory(prefix="rb-bench-pg-") as tmp:
        folder = Path(tmp)
        srv = pgserver.get_server(str(folder / "pg"), cleanup_mode="stop")
        try:
            for part in parts:
                t = time.perf_counter()
                (folder / part).mkdir()
                out[part] = run[part](args, srv.get_uri(), folder / part)
                out[part]["seconds"] = round(time.perf_counter() - t, 1)
                print(part, out[part], flush=True)
        finally:
            srv.cleanup()
    write(args.name, out, packages=("psycopg", "pgvector", "pgserver"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
