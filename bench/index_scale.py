"""Search cost as the index grows (10k → 100k → 1M chunks), per vector store, on real embeddings.

Vectors: MiniLM (all-MiniLM-L6-v2, 384-d, unit length) embeddings of real text cached by
``bench/embed_corpus.py`` (SQuAD dev / SQuAD-shifts / CoQA paragraphs, sentences and questions,
man pages and manual paragraphs). The last ``--queries`` of them are held out as the queries;
the rest are the chunks. Sizes beyond the real vectors are filled with **perturbed copies** of
them (a real vector plus Gaussian noise, renormalized, cosine ≈ 0.85 to its original), stated as
such in the results: the 100k and 1M indexes are real vectors plus synthetic copies.

Each index is written in the index's own on-disk format (flat store + search store + SQLite +
manifest, through ``ragbudget.retrieval.vectors``), then a fresh child process opens it with
:class:`ragbudget.retrieval.index.Index` and times ``search_vector`` (one query at a time, one thread, the
SQLite chunk fetch included), measures recall@10 against exact search on the held-out queries,
and reads its own memory (``/proc/self/status``: RssAnon = private memory, RssFile = mapped file
pages touched) before and after opening and after the queries.

    python bench/index_scale.py --sizes 10000 100000 1000000 --out bench/results/index_scale.json
    python bench/index_scale.py --plot bench/results/index_scale.json bench/index_scale.png
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
OUT = HERE / "out"
sys.path.insert(0, str(HERE.parent))


def perturbed(real: np.ndarray, n: int, *, seed: int = 0, sigma: float = 0.0316) -> np.ndarray:
    """``n`` unit vectors: real ones first, then copies of random real ones plus noise
    (sigma 0.0316 per dimension: cosine ≈ 0.85 to the original at 384-d)."""
    if n <= len(real):
        return real[:n].copy()
    rng = np.random.default_rng(seed)
    out = np.empty((n, real.shape[1]), dtype=np.float32)
    out[: len(real)] = real
    for lo in range(len(real), n, 200_000):
        hi = min(n, lo + 200_000)
        src = real[rng.integers(0, len(real), hi - lo)]
        x = src + sigma * rng.standard_normal(src.shape).astype(np.float32)
        out[lo:hi] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def write_index(folder: Path, x: np.ndarray, kind: str) -> dict:
    """An index folder over ``x`` (ids 1..n) whose search store is ``kind``, committed through the
    storage seam the builder writes through (same files, manifest entries and checksums; chunk
    texts are placeholders). ``build_s``: making and tuning the search store."""
    from ragbudget.retrieval.roots import Root
    from ragbudget.retrieval.storage import LocalStorage
    from ragbudget.retrieval.vectors import FlatStore, make_store

    n, dim = x.shape
    ids = np.arange(1, n + 1, dtype=np.int64)
    flat = FlatStore(dim)
    flat.add(ids, x)
    storage = LocalStorage(folder)
    with storage.lock():
        writer = storage.begin(None, keep=False)
        db = writer.catalog.db  # a million rows: bulk statements, not a call per chunk
        db.executemany(
            "INSERT INTO chunks (id, text, n_tokens, headings, content_hash, windows) VALUES (?,?,?,?,?,1)",
            ((int(i), f"chunk {i}", 3, "[]", f"h{i}") for i in ids),
        )
        db.executemany(
            "INSERT INTO sources VALUES (?,?,?,?,?,?,0)",
            ((int(i), f"/b/doc{i // 50}.txt", (i % 50) * 100, (i % 50) * 100 + 99, None, None) for i in ids),
        )
        for j in range(n // 50 + 1):
            writer.catalog.record_file(f"/b/doc{j}.txt", 1, 1, "x", "indexed", n_chunks=50)
        writer.catalog.set_roots([Root("/b", "b", "dir")])
        store, report, search = {"requested": kind, "kind": kind, "recall_at_10": 1.0}, None, None
        t = time.perf_counter()
        if kind != "flat":
            search = make_store(kind, dim, exact=flat)
            report = search.finalize()
            store.update(recall_at_10=report.to_dict()["recall_at_10"], recall_queries=report.queries)
        build_s = time.perf_counter() - t
        fields = {
            "dim": dim,
            "embedder": {"kind": "hash", "id": f"hash-{dim}", "dim": dim, "pooling": "windows"},
            "store": store,
            "sentences": {"stored": False},
            "counts": {"chunks": n, "vectors": n},
            "roots": [{"label": "b", "kind": "dir"}],
        }
        writer.commit(fields, exact=flat, search=search)
        writer.close()
    return {
        "build_s": round(build_s, 1),
        "params": report.params if report else {},
        "recall_at_10_own_chunks": store["recall_at_10"],
        "store_file_mb": round((folder / f"{kind}.1.index").stat().st_size / 1e6, 1) if kind != "flat" else None,
    }


_CHILD = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, {root!r})
def mem():
    out = {{}}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) / 1024
    return out
from ragbudget.retrieval.index import Index
import faiss
q = np.load({q!r}); truth = np.load({truth!r})
m0 = mem()
idx = Index.open({folder!r}, verify_checksums=False)
t = time.perf_counter(); idx._load(); open_s = time.perf_counter() - t
m1 = mem()
idx.search_vector(q[0], 10)
lat, hits = [], 0
for i, v in enumerate(q[: {nq}]):
    t = time.perf_counter()
    got = idx.search_vector(v, 10)
    lat.append((time.perf_counter() - t) * 1e3)
    hits += len({{h.chunk_id for h in got}} & set(truth[i].tolist()))
m2 = mem()
lat.sort()
pct = lambda p: lat[min(len(lat) - 1, int(p / 100 * len(lat)))]
print(json.dumps({{"queries": len(lat), "p50_ms": round(pct(50), 2), "p99_ms": round(pct(99), 2),
    "recall_at_10_heldout": round(hits / (10 * len(lat)), 4), "open_s": round(open_s, 2),
    "mem_before_mb": m0, "mem_open_mb": m1, "mem_after_queries_mb": m2,
    "loadavg": open("/proc/loadavg").read().split()[:3]}}))
"""


def measure(folder: Path, q: Path, truth: Path, nq: int) -> dict:
    code = _CHILD.format(root=str(HERE.parent), q=str(q), truth=str(truth), folder=str(folder), nq=nq)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--flat-queries-1m", type=int, default=200, help="fewer for exact search at 1M")
    ap.add_argument("--stores", nargs="+", default=["flat", "hnsw", "ivf-pq"])
    ap.add_argument("--hnsw-max", type=int, default=200_000, help="skip HNSW builds above this")
    ap.add_argument("--work", type=Path, default=OUT / "scale")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "index_scale.json")
    args = ap.parse_args()
    import faiss

    from ragbudget.retrieval.vectors import FlatStore, choose_store

    faiss.omp_set_num_threads(1)
    real = np.load(OUT / "real_vectors.npy")
    nq = args.queries
    queries, base = real[-nq:], real[:-nq]
    args.work.mkdir(parents=True, exist_ok=True)
    qpath = args.work / "queries.npy"
    np.save(qpath, queries)
    sys.path.insert(0, str(HERE))
    from _results import write

    results: dict = {
        "vectors": {
            "model": "all-MiniLM-L6-v2",
            "dim": int(real.shape[1]),
            "real": int(len(base)),
            "queries": f"{nq} held-out real texts (SQuAD/CoQA questions, sentences, paragraphs), not in the index",
            "synthetic": "beyond the real vectors, copies of random real vectors plus "
            "Gaussian noise (sigma 0.0316/dim, cosine ~0.85 to the original)",
        },
        "sizes": {},
    }
    # Every size and store is measured by this run (a raw result carries one commit and date).
    for n in args.sizes:
        x = perturbed(base, n)
        flat = FlatStore(x.shape[1])
        flat.add(np.arange(1, n + 1), x)
        faiss.omp_set_num_threads(2)
        t = time.perf_counter()
        _, truth = flat.search(queries, 10)
        truth_s = time.perf_counter() - t
        faiss.omp_set_num_threads(1)
        del flat
        tpath = args.work / f"truth_{n}.npy"
        np.save(tpath, truth)
        auto = choose_store("auto", n, x.shape[1])
        row: dict = {
            "n": n,
            "real": min(n, len(base)),
            "synthetic": max(0, n - len(base)),
            "auto_picks": auto,
            "flat_fp32_mb": round(n * x.shape[1] * 4 / 1e6, 1),
            "truth_s": round(truth_s, 1),
            "stores": {},
        }
        for kind in args.stores:
            if kind == "hnsw" and n > args.hnsw_max:
                row["stores"][kind] = {
                    "skipped": f"HNSW build over {args.hnsw_max} vectors does not fit this run's time on 2 cores"
                }
                continue
            folder = args.work / f"{kind}_{n}"
            import shutil

            shutil.rmtree(folder, ignore_errors=True)  # left by an interrupted run
            print(f"n={n} {kind}: building", flush=True)
            faiss.omp_set_num_threads(2)  # builds may use both cores; searches use one
            built = write_index(folder, x, kind)
            faiss.omp_set_num_threads(1)
            k_q = args.flat_queries_1m if kind == "flat" and n >= 1_000_000 else nq
            print(f"n={n} {kind}: built {built}; measuring", flush=True)
            r = {**built, **measure(folder, qpath, tpath, k_q)}
            row["stores"][kind] = r
            print(f"n={n} {kind}: {r}", flush=True)
            results["sizes"][str(n)] = row
            write(args.out.stem, results, packages=("faiss-cpu",), folder=args.out.parent)  # a cut run keeps its rows
            import shutil

            shutil.rmtree(folder)
        results["sizes"][str(n)] = row
    write(args.out.stem, results, packages=("faiss-cpu",), folder=args.out.parent)


def plot(results: Path, png: Path) -> None:
    """p50 latency and recall@10 against index size, one line per store."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results.read_text())["sizes"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, style, color in (("flat", "o-", "C0"), ("hnsw", "s-", "C1"), ("ivf-pq", "^-", "C2")):
        pts = [
            (int(n), r["stores"][kind])
            for n, r in sorted(data.items(), key=lambda t: int(t[0]))
            if "p50_ms" in r["stores"].get(kind, {})
        ]
        if not pts:
            continue
        ns = [n for n, _ in pts]
        a.plot(ns, [r["p50_ms"] for _, r in pts], style, color=color, label=f"{kind} p50")
        a.plot(ns, [r["p99_ms"] for _, r in pts], style, color=color, alpha=0.35, label=f"{kind} p99")
        b.plot(ns, [r["recall_at_10_heldout"] for _, r in pts], style, color=color, label=kind)
    a.axhline(5, color="grey", ls=":", lw=1)
    a.axhline(10, color="grey", ls=":", lw=1)
    a.set(
        xscale="log",
        yscale="log",
        xlabel="chunks",
        ylabel="ms per query (1 thread)",
        title="search latency, Index.search_vector",
    )
    b.axhline(0.98, color="grey", ls=":", lw=1)
    b.set(
        xscale="log",
        xlabel="chunks",
        ylabel="recall@10 vs exact (held-out questions)",
        title="recall",
        ylim=(0.9, 1.001),
    )
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot"]:
        plot(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
