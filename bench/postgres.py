"""An index in PostgreSQL (pgvector) against the same index in a local folder: build, an unchanged
re-run, and search latency (exact and HNSW), on the same files with the same embedder.

The server is pgserver's (PostgreSQL 16 + pgvector in a wheel, a Unix socket, on this machine):
what the database costs, not a network. Query vectors are embedded once beforehand, so the
latencies are the storage's alone (``Index.search_vector``: the vector search plus reading the
hits' chunks and sources).

    python bench/postgres.py                      # data/ with the packaged MiniLM
    python bench/postgres.py --embedder hash --copies 30 --name postgres_hash_x30   # more vectors

Raw result: bench/results/postgres.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from _results import write  # noqa: E402

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


def corpus(folder: Path, copies: int) -> Path:
    """data/ ``copies`` times (indexed with dedup off, so every copy's chunks are stored)."""
    out = folder / "docs"
    for c in range(copies):
        for src in (REPO / "data").rglob("*"):
            if src.is_file() and src.suffix in (".md", ".txt", ".pdf"):
                dst = out / f"copy{c}" / src.relative_to(REPO / "data")
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, dst)
    return out


def timed_searches(ix: Any, vectors: list[Any], repeats: int) -> dict[str, float]:
    ix.search_vector(vectors[0], 5)  # open the generation first
    times = []
    for _ in range(repeats):
        for v in vectors:
            t = time.perf_counter()
            ix.search_vector(v, 5)
            times.append(time.perf_counter() - t)
    times.sort()
    return {
        "p50_ms": round(1000 * statistics.median(times), 2),
        "p95_ms": round(1000 * times[int(0.95 * (len(times) - 1))], 2),
        "queries": len(times),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--embedder", choices=("minilm", "hash"), default="minilm")
    ap.add_argument("--copies", type=int, default=1, help="copies of data/ to index (more vectors)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved build rounds (local, postgres, ...)")
    ap.add_argument("--name", default="postgres")
    ap.add_argument("--note", default="", help="history to keep in the raw result (what changed since the last run)")
    args = ap.parse_args(argv)

    import pgserver

    from ragbudget.retrieval.embed import HashEmbedder, SentenceTransformerEmbedder
    from ragbudget.retrieval.index import Index

    emb = SentenceTransformerEmbedder() if args.embedder == "minilm" else HashEmbedder(dim=384)
    with tempfile.TemporaryDirectory(prefix="rb-bench-pg-") as tmp:
        folder = Path(tmp)
        docs = corpus(folder, args.copies)
        srv = pgserver.get_server(str(folder / "pg"), cleanup_mode="stop")
        try:
            url = srv.get_uri()
            dedup = "near" if args.copies == 1 else "none"
            out: dict[str, Any] = {"embedder": emb.id, "copies": args.copies, "dedup": dedup, "rounds": args.rounds}
            if args.note:
                out["note"] = args.note
            # Whole-index wall time in interleaved rounds, local and PostgreSQL alternating (a
            # fresh folder and a fresh schema each round), so a neighbour's load on the shared
            # cores falls on both alike; the ratio is of the medians. The last round's index is
            # the one searched below.
            walls: dict[str, list[float]] = {"local": [], "postgres": []}
            for r in range(args.rounds):
                for name, where in (
                    ("local", str(folder / f"ix{r}")),
                    ("postgres", f"{url}&ragbudget_schema=r{r}" if "?" in url else f"{url}?ragbudget_schema=r{r}"),
                ):
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
            last = args.rounds - 1
            url = f"{url}&ragbudget_schema=r{last}" if "?" in url else f"{url}?ragbudget_schema=r{last}"
            vectors = [emb.embed_query(q) for q in QUESTIONS]
            local, pg_exact = Index.open(str(folder / f"ix{last}")), Index.open(url, use_approx=False)
            out["local"]["search_flat"] = timed_searches(local, vectors, args.repeats)
            out["postgres"]["search_exact"] = timed_searches(pg_exact, vectors, args.repeats)
            pairs = [(local.search_vector(v, 5), pg_exact.search_vector(v, 5)) for v in vectors]
            same_ids = sum([h.chunk_id for h in a] == [h.chunk_id for h in b] for a, b in pairs)
            # With copies of the same files, equal chunks tie: the scores are what must agree.
            same_scores = sum(all(abs(x.score - y.score) <= 1e-5 for x, y in zip(a, b, strict=True)) for a, b in pairs)
            out["postgres"]["exact_top5_ids_equal_to_local"] = f"{same_ids}/{len(vectors)}"
            out["postgres"]["exact_top5_scores_equal_to_local"] = f"{same_scores}/{len(vectors)}"
            t = time.perf_counter()
            Index(url).build([str(docs)], embedder=emb, store="hnsw")
            out["postgres"]["hnsw_build_and_tune_s"] = round(time.perf_counter() - t, 2)
            pg_hnsw = Index.open(url)
            out["postgres"]["hnsw"] = {
                k: pg_hnsw.manifest["approx"][k] for k in ("ef_search", "recall_at_10", "recall_queries")
            }
            out["postgres"]["search_hnsw"] = timed_searches(pg_hnsw, vectors, args.repeats)
            for ix in (local, pg_exact, pg_hnsw):
                ix.close()
        finally:
            srv.cleanup()
    print(out)
    write(args.name, out, packages=("psycopg", "pgvector", "pgserver"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
