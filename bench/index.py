"""Index benchmark: overhead over the bare embedding model, windowed pooling vs truncation,
incremental re-runs, exact search latency and the machine's scan floor, peak memory at 1x and 4x
a corpus (approximate stores by size: bench/index_scale.py).

    .venv/bin/python bench/index.py            # ~5 min on 2 cores
    .venv/bin/python bench/index.py --quick    # ~1 min
    .venv/bin/python bench/index.py --part latency --n 100000

Writes bench/results/index.json (``bench/_results.py``: command, machine, versions, commit); a
single ``--part`` or ``--quick`` run goes to the ignored bench/out/index.json unless ``--out``
says otherwise, so a partial run never replaces the committed one. Corpus: SQuAD dev articles
(one file per article, paragraphs joined), Linux man2 pages and a Debian manual PDF from
../shared/data.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# The ragbudget of this checkout, not whichever one the environment has installed.
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("RAGBUDGET_SHARED_DATA", REPO.parent / "shared" / "data"))
OUT = REPO / "bench" / "out"


def squad() -> list[dict]:
    return json.loads((SHARED / "squad" / "squaddev_v1.1.json").read_text())["data"]


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", s)[:40]


def make_corpus(root: Path, *, articles: int, manpages: int, pdf: bool, copy: int = 0) -> dict:
    """Write the corpus; ``copy`` > 0 makes a distinct variant (for the 4x memory run)."""
    root.mkdir(parents=True, exist_ok=True)
    files = {}
    for i, art in enumerate(squad()[:articles]):
        paras = [p["context"] for p in art["paragraphs"]]
        if copy:
            paras = [f"(copy {copy}) {p}" for p in paras]
        text = f"# {art['title'].replace('_', ' ')}\n\n" + "\n\n".join(paras) + "\n"
        p = root / f"squad_{i:02d}_{slug(art['title'])}.txt"
        p.write_text(text, encoding="utf-8")
        files[str(p.resolve())] = art["title"]
    for src in sorted((SHARED / "manpages").glob("*.txt"))[:manpages]:
        dst = root / src.name
        if copy:
            dst.write_text(f"copy {copy}\n" + src.read_text(encoding="utf-8"), encoding="utf-8")
        else:
            shutil.copyfile(src, dst)
    if pdf and not copy:
        shutil.copyfile(SHARED / "pdf" / "maint-guide.en.pdf", root / "maint-guide.en.pdf")
    return files


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q))


# --- 1. full index vs the model alone; windows vs truncation ------------------------------------


def part_embed(args: argparse.Namespace, tmp: Path) -> dict:
    from ragbudget.retrieval.embed import SentenceTransformerEmbedder
    from ragbudget.retrieval.index import Index

    # Sized for a few minutes on 2 idle cores (the model dominates; each round runs it three
    # times: index, windows alone, truncation alone). The quick run takes a minute or two.
    articles, manpages, pdf = (4, 2, False) if args.quick else (16, 12, True)
    corpus = tmp / "corpus"
    titles = make_corpus(corpus, articles=articles, manpages=manpages, pdf=pdf)
    # The default embedder (on a CPU with onnxruntime: int8 ONNX MiniLM), and as "the model alone"
    # the very call the index makes into it (``_encode``: ONNX session or sentence-transformers),
    # so the ratio is what indexing adds around the model, whichever backend runs.
    emb = SentenceTransformerEmbedder()
    t = time.perf_counter()
    emb.warm_up()
    load_s = time.perf_counter() - t
    # Warm the model once so neither side pays first-call costs.
    emb._encode(["warm up"] * 8)

    # Interleaved rounds, all in this one warm process: build a fresh index, then the model alone
    # on exactly the windows the build embedded, then the truncated chunks alone. On a host shared
    # with other jobs the share of the cores this process gets drifts over minutes; run as two
    # sequential phases (before 2026-12-03) the model alone once took 2.3x the build's own model
    # time. Interleaved, a drift slows both sides of a round alike, and the ratio is the median
    # of the per-round ratios (the ratio of the medians is recorded beside it).
    rounds: list[dict] = []
    flat: list[str] = []
    for r in range(args.rounds):
        ix = Index(tmp / f"ix{r}")
        load_before = os.getloadavg()[0]
        t = time.perf_counter()
        summary = ix.build([str(corpus)], embedder=emb)
        build_s = time.perf_counter() - t
        if r == 0:
            idx = Index.open(ix.path)
            hits = idx.get_chunks(range(1, summary.chunks_total * 4 + 10))
            texts = [h.text for h in hits]
            windows = emb.windows_of(texts)
            flat = [w for ws in windows for w in ws]
            win_vecs = np.array(idx._generation().exact.vectors([h.chunk_id for h in hits]))
            idx.close()
        t = time.perf_counter()
        emb._encode(flat)
        model_windows_s = time.perf_counter() - t
        t = time.perf_counter()
        trunc = emb._encode(texts)  # cut to the model's max_seq_length, as sentence-transformers does
        model_trunc_s = time.perf_counter() - t
        rounds.append(
            {
                "build_wall_s": round(build_s, 3),
                "build_summary_s": round(summary.seconds, 3),
                "model_alone_windows_s": round(model_windows_s, 3),
                "model_truncate_s": round(model_trunc_s, 3),
                "index_over_model": round(build_s / model_windows_s, 4),
                "loadavg_1m_before": round(load_before, 2),
                "loadavg_1m_after": round(os.getloadavg()[0], 2),
            }
        )
        print(f"[embed] round {r}: {rounds[-1]}", file=sys.stderr, flush=True)
        shutil.rmtree(ix.path, ignore_errors=True)

    # Retrieval on SQuAD questions: a hit is a top-5 chunk from the right article file that
    # contains a gold answer. "tail" questions have their answer only past the first window.
    by_path: dict[str, list[int]] = {}
    for j, h in enumerate(hits):
        for s in h.sources:
            # Sources are shown relative to the indexed folder (never absolute): key by file name.
            by_path.setdefault(Path(s.path).name, []).append(j)
    title_to_path = {v: Path(k).name for k, v in titles.items()}
    rnd = random.Random(0)
    qs = []
    for art in squad()[:articles]:
        path = title_to_path[art["title"]]
        for p in art["paragraphs"]:
            for qa in p["qas"]:
                answers = {a["text"] for a in qa["answers"]}
                gold = [j for j in by_path.get(path, []) if any(a in texts[j] for a in answers)]
                if gold:
                    tail = all(not any(a in windows[j][0] for a in answers) for j in gold)
                    qs.append((qa["question"], set(gold), tail))
    rnd.shuffle(qs)
    qs = qs[: (150 if args.quick else 600)]
    qv = emb._encode([q for q, _, _ in qs])

    def recall(mat: np.ndarray, only_tail: bool) -> tuple[float, int]:
        top = np.argsort(-(qv @ mat.T), axis=1)[:, :5]
        sel = [(set(top[i]), g) for i, (_, g, tl) in enumerate(qs) if tl or not only_tail]
        return (sum(1 for t5, g in sel if t5 & g) / max(1, len(sel)), len(sel))

    r_win, n_all = recall(win_vecs, False)
    r_tr, _ = recall(np.asarray(trunc), False)
    r_win_t, n_tail = recall(win_vecs, True)
    r_tr_t, _ = recall(np.asarray(trunc), True)
    med = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
    return {
        "embedder": {"id": emb.id, "backend": emb.backend},
        "corpus": {
            "squad_articles": articles,
            "manpages": manpages,
            "pdf": pdf,
            "files": summary.files_seen,
            "chunks": summary.chunks_total,
        },
        "summary": summary.to_dict(),
        "model_load_s": round(load_s, 2),
        "method": (
            f"{args.rounds} interleaved rounds in one warm process (build a fresh index, the model "
            "alone on the same windows, the model alone on the truncated chunks); medians"
        ),
        "rounds": rounds,
        "index_wall_s": round(med["build_wall_s"], 2),
        "model_alone_windows_s": round(med["model_alone_windows_s"], 2),
        # The headline ratio: the median of the per-round ratios (each round's two sides ran
        # back to back, at about the same share of the cores).
        "index_over_model": round(med["index_over_model"], 3),
        "index_over_model_of_medians": round(med["build_wall_s"] / med["model_alone_windows_s"], 3),
        "index_over_model_range": [
            round(min(x["index_over_model"] for x in rounds), 3),
            round(max(x["index_over_model"] for x in rounds), 3),
        ],
        "non_model_overhead_pct": round(100 * (med["index_over_model"] - 1), 1),
        "windows_fed": len(flat),
        "chunks_needing_windows": sum(1 for w in windows if len(w) > 1),
        "model_truncate_s": round(med["model_truncate_s"], 2),
        "windows_extra_model_time_pct": round(
            100 * (statistics.median(x["model_alone_windows_s"] / x["model_truncate_s"] for x in rounds) - 1), 1
        ),
        "recall@5_windows": round(r_win, 3),
        "recall@5_truncate": round(r_tr, 3),
        "questions": n_all,
        "tail_questions": n_tail,
        "recall@5_tail_windows": round(r_win_t, 3),
        "recall@5_tail_truncate": round(r_tr_t, 3),
    }


# --- 2. incremental re-runs on 1,000 files --------------------------------------------------------


def part_rerun(args: argparse.Namespace, tmp: Path) -> dict:
    from ragbudget.retrieval.embed import SentenceTransformerEmbedder
    from ragbudget.retrieval.index import Index

    corpus = tmp / "thousand"
    corpus.mkdir()
    paras = [p["context"] for a in squad() for p in a["paragraphs"]][:1000]
    for i, p in enumerate(paras):
        # --quick keeps the first sentence only: the embedding is setup, not what is measured.
        text = p.split(". ")[0] + "." if args.quick else p
        (corpus / f"p{i:04d}.txt").write_text(text + "\n", encoding="utf-8")
    ix = Index(tmp / "ix1000")
    first = ix.build([str(corpus)], embedder=SentenceTransformerEmbedder())
    # A fresh, unloaded embedder: an unchanged re-run must not even load the model.
    again = ix.build([str(corpus)], embedder=SentenceTransformerEmbedder())
    victim = corpus / "p0500.txt"
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = ix.build([str(corpus)], embedder=SentenceTransformerEmbedder())
    victim.write_text(victim.read_text() + "One more sentence about nothing.\n")
    edited = ix.build([str(corpus)], embedder=SentenceTransformerEmbedder())
    return {
        "files": len(paras),
        "first_s": round(first.seconds, 2),
        "unchanged_rerun_s": round(again.seconds, 3),
        "unchanged_rerun_embedded": again.chunks_embedded,
        "touched_rerun_s": round(touched.seconds, 3),
        "touched_rerun_embedded": touched.chunks_embedded,
        "edited_one_file_s": round(edited.seconds, 3),
        "edited_one_file_embedded": edited.chunks_embedded,
    }


# --- 3. search latency at N chunks ----------------------------------------------------------------


def synthetic_vectors(n: int, dim: int, *, clustered: bool) -> np.ndarray:
    """``n`` unit vectors: uniform random, or a mixture of 2,000 topics (real embeddings cluster)."""
    rng = np.random.default_rng(0)
    if clustered:
        centers = rng.standard_normal((2000, dim)).astype(np.float32)
        x = centers[rng.integers(0, 2000, n)] + 0.6 * rng.standard_normal((n, dim)).astype(np.float32)
    else:
        x = rng.standard_normal((n, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def part_latency(args: argparse.Namespace, tmp: Path) -> dict:
    """Exact (flat) search through ``Index.search_vector`` at N synthetic chunks, and what a bare
    scan of this machine's memory can do (:func:`scan_variants`). The index is written in the
    builder's format by ``bench/index_scale.py``'s writer; approximate stores at 10k-1M chunks on
    real vectors are that script's subject (``bench/results/index_scale.json``), not this one's."""
    import faiss

    sys.path.insert(0, str(REPO / "bench"))
    from index_scale import write_index

    from ragbudget.retrieval.index import Index

    n = args.n or (20_000 if args.quick else 100_000)
    dim = 384
    out: dict = {
        "n": n,
        "dim": dim,
        "faiss_threads": faiss.omp_get_max_threads(),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }
    rng = np.random.default_rng(1)
    for name, clustered in (("flat_random", False), ("flat_clustered", True)):
        folder = tmp / f"lat_{name}"
        t = time.perf_counter()
        x = synthetic_vectors(n, dim, clustered=clustered)
        write_index(folder, x, "flat")
        build_s = time.perf_counter() - t
        # Queries: perturbed corpus vectors (realistic: a query lands near some chunks).
        qi = rng.integers(0, n, 300)
        q = x[qi] + 0.5 * rng.standard_normal((300, dim)).astype(np.float32) / np.sqrt(dim) * 4
        q /= np.linalg.norm(q, axis=1, keepdims=True)
        idx = Index.open(folder)
        t = time.perf_counter()
        idx.search_vector(q[0], 10)  # opens the stores, warms
        open_s = time.perf_counter() - t
        lat = []
        for v in q:
            t = time.perf_counter()
            idx.search_vector(v, 10)
            lat.append((time.perf_counter() - t) * 1e3)
        res: dict = {
            "build_s": round(build_s, 1),
            "open_s": round(open_s, 3),
            "flat": {"p50_ms": round(pct(lat, 50), 2), "p99_ms": round(pct(lat, 99), 2), "queries": len(q)},
        }
        if not clustered:
            res["encodings"] = scan_variants(x, q)
        out[name] = res
        idx.close()
        shutil.rmtree(folder, ignore_errors=True)
    return out


def scan_variants(x: np.ndarray, q: np.ndarray, k: int = 10) -> dict:
    """What an exhaustive scan can do on this machine: the memory-read floor of the fp32 scan,
    and bare faiss scans over smaller encodings of the same vectors (no metadata lookup), with
    their recall@k against the exact fp32 result."""
    import faiss

    faiss.omp_set_num_threads(1)
    best = min(_timed(x.sum) for _ in range(5))
    out: dict = {
        "read_gb_s": round(x.nbytes / best / 1e9, 2),
        "fp32_floor_ms": round(best * 1e3, 2),
        "fp32_mb": round(x.nbytes / 1e6, 1),
    }
    flat = faiss.IndexFlatIP(x.shape[1])
    flat.add(x)
    truth = flat.search(q, k)[1]
    binary = np.packbits(x > 0, axis=1)
    bidx = faiss.IndexBinaryFlat(x.shape[1])
    bidx.add(binary)
    qbin = np.packbits(q > 0, axis=1)

    def binary_rescored(i: int) -> np.ndarray:
        # Hamming prefilter over 1-bit codes, then exact fp32 scores of 40*k candidates.
        cand = np.sort(bidx.search(qbin[i : i + 1], 40 * k)[1][0])
        return cand[np.argsort(-(x[cand] @ q[i]))[:k]]

    variants: dict = {"fp32 (faiss IndexFlatIP)": lambda i: flat.search(q[i : i + 1], k)[1][0]}
    for name, qt in (("fp16", faiss.ScalarQuantizer.QT_fp16), ("int8", faiss.ScalarQuantizer.QT_8bit)):
        sq = faiss.IndexScalarQuantizer(x.shape[1], qt, faiss.METRIC_INNER_PRODUCT)
        sq.train(x)
        sq.add(x)
        variants[f"{name} (faiss IndexScalarQuantizer)"] = lambda i, sq=sq: sq.search(q[i : i + 1], k)[1][0]
    variants["1-bit + fp32 rescoring of 400"] = binary_rescored
    for name, fn in variants.items():
        lat, rec = [], []
        for i in range(len(q)):
            t = time.perf_counter()
            got = fn(i)
            lat.append((time.perf_counter() - t) * 1e3)
            rec.append(len(set(got.tolist()) & set(truth[i].tolist())) / k)
        out[name] = {
            "p50_ms": round(pct(lat, 50), 2),
            "p99_ms": round(pct(lat, 99), 2),
            "recall@10": round(statistics.mean(rec), 4),
        }
    return out


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# --- 4. peak RSS at 1x and 4x a corpus --------------------------------------------------------------

_RSS_CHILD = """
import resource, sys, json
sys.path.insert(0, {repo!r})
from ragbudget.retrieval.index import Index
from ragbudget.retrieval.embed import HashEmbedder
import faiss, ragbudget.input.chunking, ragbudget.input.dedup, ragbudget.input.loaders
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
# Reset the high-water mark after the imports (clear_refs 5): ru_maxrss would keep the imports'
# transient peak, and a build that stays under it would show no growth at all.
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
s = Index({ix!r}).build({paths!r}, embedder=HashEmbedder(dim=384), dedup="exact")
peak = status("VmHWM")
print(json.dumps({{"base_mb": base, "peak_mb": peak, "chunks": s.chunks_total,
                  "files": s.files_indexed}}))
"""


def part_rss(args: argparse.Namespace, tmp: Path) -> dict:
    articles, manpages = (8, 8) if args.quick else (48, 40)
    roots = []
    for c in range(4):
        root = tmp / f"rss{c}"
        make_corpus(root, articles=articles, manpages=manpages, pdf=False, copy=c + 1)
        roots.append(str(root))
    out = {}
    for label, paths in (("1x", roots[:1]), ("4x", roots)):
        code = _RSS_CHILD.format(repo=str(REPO), ix=str(tmp / f"rssix_{label}"), paths=paths)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        d = json.loads(res.stdout.strip().splitlines()[-1])
        d["growth_mb"] = round(d["peak_mb"] - d["base_mb"], 1)
        out[label] = {k: round(v, 1) if isinstance(v, float) else v for k, v in d.items()}
    out["note"] = (
        "HashEmbedder(384), dedup=exact; growth = VmHWM after the build - VmRSS after the "
        "imports, the high-water mark reset after the imports"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--part", choices=["all", "embed", "rerun", "latency", "rss"], default="all")
    ap.add_argument("--n", type=int, default=0, help="chunks for the latency part")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds of build / model alone in the embed part (at least 3: medians)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="result file (default: bench/results/index.json for a full run, "
        "bench/out/index.json for --quick or one --part)",
    )
    args = ap.parse_args()
    full = args.part == "all" and not args.quick
    out_path = (
        Path(args.out) if args.out else (REPO / "bench" / "results" / "index.json" if full else OUT / "index.json")
    )
    results: dict = {"quick": args.quick, "cpus": os.cpu_count()}
    if out_path.exists() and args.part != "all":
        # One part re-run: keep the other parts of that file (the provenance is this run's).
        old = json.loads(out_path.read_text())
        results = {**{k: v for k, v in old.items() if k in ("embed", "rerun", "latency", "rss")}, **results}
    parts = ["embed", "rerun", "latency", "rss"] if args.part == "all" else [args.part]
    sys.path.insert(0, str(REPO / "bench"))
    from _results import write

    with tempfile.TemporaryDirectory(prefix="rb-bench-index-") as d:
        for part in parts:
            t = time.perf_counter()
            results[part] = globals()[f"part_{part}"](args, Path(d))
            results[part]["part_seconds"] = round(time.perf_counter() - t, 1)
            print(f"[{part}] done in {results[part]['part_seconds']} s", file=sys.stderr, flush=True)
            # Written after every part, so a part that fails does not lose the ones before it
            # (``"done"`` lists what the file holds).
            results["done"] = [p for p in parts if p in results]
            write(
                out_path.stem,
                results,
                folder=out_path.parent,
                packages=("faiss-cpu", "sentence-transformers", "onnxruntime"),
            )
    report(results)


def report(r: dict) -> None:
    rows = []
    if "embed" in r:
        e = r["embed"]
        rows += [
            (
                "index wall / model alone (same windows)",
                f"{e['index_over_model']:.3f}x (median of {len(e['rounds'])} interleaved rounds; "
                f"{e['index_over_model_range'][0]:.3f}-{e['index_over_model_range'][1]:.3f})",
                "<= 1.15x",
            ),
            ("non-model overhead", f"{e['non_model_overhead_pct']}%", "<= 15%"),
            ("chunks needing windows", f"{e['chunks_needing_windows']}/{e['corpus']['chunks']}", ""),
            ("extra model time, windows vs truncation", f"+{e['windows_extra_model_time_pct']}%", ""),
            (
                "SQuAD recall@5 windows vs truncate",
                f"{e['recall@5_windows']} vs {e['recall@5_truncate']} (n={e['questions']})",
                "",
            ),
            (
                "  tail-answer questions",
                f"{e['recall@5_tail_windows']} vs {e['recall@5_tail_truncate']} (n={e['tail_questions']})",
                "",
            ),
        ]
    if "rerun" in r:
        x = r["rerun"]
        rows += [
            (
                "unchanged re-run, 1,000 files",
                f"{x['unchanged_rerun_s']} s, {x['unchanged_rerun_embedded']} embedded",
                "<= 2 s, 0",
            ),
            ("one file touched (mtime only)", f"{x['touched_rerun_s']} s, {x['touched_rerun_embedded']} embedded", "0"),
            ("one file edited", f"{x['edited_one_file_s']} s, {x['edited_one_file_embedded']} embedded", ""),
        ]
    if "latency" in r:
        lt = r["latency"]
        f, c = lt["flat_random"]["flat"], lt["flat_clustered"]["flat"]
        rows += [
            (f"flat search @{lt['n']} (random)", f"p50 {f['p50_ms']} ms, p99 {f['p99_ms']} ms", "<= 5 / 20 ms"),
            (f"flat search @{lt['n']} (clustered)", f"p50 {c['p50_ms']} ms, p99 {c['p99_ms']} ms", ""),
        ]
        enc = lt["flat_random"].get("encodings")
        if enc:
            rows.append(
                (
                    f"fp32 scan read floor ({enc['fp32_mb']} MB at {enc['read_gb_s']} GB/s)",
                    f"{enc['fp32_floor_ms']} ms",
                    f"p50 <= 5 ms needs >= {enc['fp32_mb'] / 5:.0f} GB/s",
                )
            )
            for name, v in enc.items():
                if isinstance(v, dict):
                    rows.append(
                        (
                            f"  bare scan, {name}",
                            f"p50 {v['p50_ms']} ms, p99 {v['p99_ms']} ms, recall@10 {v['recall@10']}",
                            "",
                        )
                    )
    if "rss" in r:
        s = r["rss"]
        growth = (
            f"{s['1x']['growth_mb']} / {s['4x']['growth_mb']} MB ({s['1x']['chunks']} / {s['4x']['chunks']} chunks)"
        )
        rows += [("peak RSS growth 1x / 4x corpus", growth, "grows with batch")]
    w = max(len(a) for a, _, _ in rows)
    print(f"{'metric':<{w}}  {'measured':<48}  target")
    for a, b, c in rows:
        print(f"{a:<{w}}  {b:<48}  {c}")


if __name__ == "__main__":
    main()
