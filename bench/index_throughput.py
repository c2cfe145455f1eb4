"""Whole-index throughput (issue #31): ``ragbudget index`` as a new user runs it against the
pipeline that user would write with LangChain, on the same files, in the same run.

Both sides are cold processes (imports and model load in the clock), timed from start to the
index written, on the same cores with the same model (the packaged all-MiniLM-L6-v2):

* ``ragbudget``: ``python -m ragbudget index DIR`` with its defaults — the default install's
  embedder (int8 ONNX on a CPU), chunks of 300–500 cl100k tokens, **every token embedded**
  (over-long chunks as several 256-word-piece windows), span packing on (the default ``pack``:
  its sentence vectors are embedded when a question first needs them and kept beside the index);
* ``ragbudget --sentence-vectors``: the same, also storing every chunk's sentence vectors at
  build time (a second pass: the default before issue #31), for reference;
* ``langchain``: ``TextLoader`` (``PyPDFLoader`` for a PDF) → ``RecursiveCharacterTextSplitter``
  (400 cl100k tokens, no overlap: ``from_tiktoken_encoder``'s length function, on the bundled
  offline cl100k) → ``HuggingFaceEmbeddings`` (sentence-transformers on torch, the packaged
  MiniLM, batch 32, normalized) → ``FAISS.from_documents`` (flat) → ``save_local``. MiniLM
  **truncates every chunk at 256 word pieces**: what that drops is counted after the clock stops
  and reported beside the peer's time;
* ``langchain-onnx-int8``: the same chain for the user who tunes, as sentence-transformers' docs
  say to speed up a CPU: ``HuggingFaceEmbeddings(model_kwargs={"backend": "onnx", "model_kwargs":
  {"file_name": "onnx/model_q…_<isa>.onnx"}})`` on the model exported to ONNX and dynamically
  quantized to int8 with ``export_dynamic_quantized_onnx_model`` (optimum; the quantization config
  for this CPU: ``avx512_vnni``, ``avx512`` or ``avx2``, by its flags). The export, like
  ragbudget's, is done once before the timed runs.

The peers run in ``--peer-python`` (a virtual environment of their own: optimum pins transformers
and sentence-transformers to other versions than ragbudget's; default: this interpreter), the
peers' package versions recorded from it.

Rounds interleave the systems (order reversed every other round) so that load from other users
of a shared host falls on each alike; each corpus reports min and median wall seconds, CPU seconds
(the child's rusage) and the load average around every run. After each ragbudget build the same
command runs again on the unchanged folder (a cold process too): its seconds and that it embedded
nothing are recorded (``unchanged_rerun``). The one-off ONNX export of the model
(``make install`` does it) is done before the timed runs.

Corpora (``--corpora``, from ``../shared/data``):

* ``manpages`` — many short lines: 30 Linux man(2) pages and the Debian New Maintainers' Guide
  (plain text, a question-and-answer style guide);
* ``squad`` — prose: 16 SQuAD dev articles, one text file each;
* ``pdf50`` — a 50-file folder with a 113-page PDF (``R-intro.pdf``), the 40 man pages and 9
  SQuAD articles (issue target: indexed in ≤ 1 minute on 2 idle cores).

    python bench/index_throughput.py                       # all three corpora, 3 rounds
    python bench/index_throughput.py --corpora squad --rounds 2
    python bench/index_throughput.py --background-load 2 --out bench/results/index_throughput_load2.json

Writes ``bench/results/index_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
SHARED = Path(os.environ.get("RAGBUDGET_SHARED_DATA", REPO.parent / "shared" / "data"))
if not SHARED.is_dir():  # a worktree beside the main checkout: the data sits next to that
    SHARED = REPO.parents[1] / "shared" / "data"

SYSTEMS = ("ragbudget", "ragbudget-stored", "langchain", "langchain-onnx-int8")
PEERS = ("langchain", "langchain-onnx-int8")
CORPORA = ("manpages", "squad", "pdf50")
PEER_CHUNK_TOKENS = 400
PEER_BATCH = 32
MINILM_PIECES = 254  # 256 minus [CLS] and [SEP]


# --- corpora ---------------------------------------------------------------------------------------


def _squad_articles(n: int) -> list[tuple[str, str]]:
    data = json.loads((SHARED / "squad" / "squaddev_v1.1.json").read_text(encoding="utf-8"))["data"]
    return [
        (a["title"], a["title"].replace("_", " ") + "\n\n" + "\n\n".join(p["context"] for p in a["paragraphs"]) + "\n")
        for a in data[:n]
    ]


def write_corpus(name: str, folder: Path) -> dict:
    folder.mkdir(parents=True)
    pages = sorted((SHARED / "manpages").glob("*.txt"))
    if name == "manpages":
        for p in pages[:30]:
            shutil.copy(p, folder / p.name)
        shutil.copy(SHARED / "pdf" / "twins" / "maint-guide.en.txt", folder / "maint-guide.en.txt")
    elif name == "squad":
        for title, text in _squad_articles(16):
            (folder / f"{title}.txt").write_text(text, encoding="utf-8")
    elif name == "pdf50":
        shutil.copy(SHARED / "pdf" / "R-intro.pdf", folder / "R-intro.pdf")
        for p in pages[:40]:
            shutil.copy(p, folder / p.name)
        for title, text in _squad_articles(9):
            (folder / f"{title}.txt").write_text(text, encoding="utf-8")
    else:
        raise SystemExit(f"unknown corpus {name!r}; one of {', '.join(CORPORA)}")
    files = sorted(folder.iterdir())
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "names": [f.name for f in files]}


# --- the peer --------------------------------------------------------------------------------------


def model_path() -> str:
    from ragbudget.memory.models import resolve_embedder

    return resolve_embedder(None)


def onnx_int8_config(cpuinfo: str = "/proc/cpuinfo") -> str:
    """sentence-transformers' quantization config for this CPU, as its docs choose one."""
    from _results import cpu

    isa = set(cpu(cpuinfo).get("isa", []))
    if "avx512_vnni" in isa:
        return "avx512_vnni"
    return "avx512" if "avx512f" in isa else "avx2"


def export_onnx_int8(folder: Path) -> str:
    """The tuning user's one-off step: a copy of the model with an int8 ONNX file; its file name."""
    from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model

    shutil.copytree(model_path(), folder)
    config = onnx_int8_config()
    export_dynamic_quantized_onnx_model(
        SentenceTransformer(str(folder), backend="onnx", device="cpu"), config, str(folder)
    )
    (name,) = [p.name for p in (folder / "onnx").glob(f"model_*{config}.onnx")]
    return f"onnx/{name}"


def peer(corpus: Path, out: Path, onnx_model: str = "") -> list[str]:
    """The LangChain pipeline; returns its chunk texts (for the truncation count, off the clock).

    ``onnx_model``: ``FOLDER:FILE`` of an exported int8 ONNX model to embed with instead of torch."""
    from langchain_community.document_loaders import PyPDFLoader, TextLoader
    from langchain_community.vectorstores import FAISS
    from langchain_huggingface import HuggingFaceEmbeddings
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    from ragbudget.tokens import _load_tiktoken  # the bundled offline cl100k (no network here)

    enc = _load_tiktoken("cl100k_base")
    docs = []
    for p in sorted(corpus.iterdir()):
        loader = PyPDFLoader(str(p)) if p.suffix == ".pdf" else TextLoader(str(p), encoding="utf-8")
        docs += loader.load()
    # from_tiktoken_encoder's own length function, on the offline encoding.
    splitter = RecursiveCharacterTextSplitter(
        chunk_size=PEER_CHUNK_TOKENS,
        chunk_overlap=0,
        length_function=lambda t: len(enc.encode(t, allowed_special=set(), disallowed_special="all")),
    )
    chunks = splitter.split_documents(docs)
    folder, _, file_name = onnx_model.partition(":")
    model_kwargs: dict = {"device": "cpu"}
    if file_name:
        model_kwargs.update(backend="onnx", model_kwargs={"file_name": file_name})
    embed = HuggingFaceEmbeddings(
        model_name=folder or model_path(),
        model_kwargs=model_kwargs,
        encode_kwargs={"batch_size": PEER_BATCH, "normalize_embeddings": True},
    )
    FAISS.from_documents(chunks, embed).save_local(str(out))
    return [c.page_content for c in chunks]


def truncation(texts: list[str]) -> dict:
    """How many of the peer's chunks pass MiniLM's 256 word pieces, and what that drops."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_path(), "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    n = [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]
    return {
        "chunks": len(n),
        "chunks_over_256_pieces": sum(1 for x in n if x > MINILM_PIECES),
        "pieces": sum(n),
        "pieces_dropped": sum(max(0, x - MINILM_PIECES) for x in n),
        "pieces_dropped_share": round(sum(max(0, x - MINILM_PIECES) for x in n) / max(1, sum(n)), 4),
    }


# --- one timed run ---------------------------------------------------------------------------------


def run(system: str, corpus: Path, out: Path, *, peer_python: str = sys.executable, onnx_model: str = "") -> dict:
    """One cold process; wall seconds until its index is written, and its CPU seconds."""
    if system in PEERS:
        report = out.with_suffix(".json")
        argv = [peer_python, __file__, "--peer", str(corpus), str(out), str(report)]
        if system == "langchain-onnx-int8":
            argv.append(onnx_model)
    else:
        argv = [sys.executable, "-m", "ragbudget", "index", str(corpus), "--index-dir", str(out), "--json"]
        if system == "ragbudget-stored":
            argv.append("--sentence-vectors")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    t = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=str(REPO))
    t_end = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{system} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    done = [ln for ln in proc.stdout.splitlines() if ln.startswith("DONE ")]
    row = {
        # The peer prints DONE when its index is saved, before counting its truncation.
        "seconds": round((float(done[-1].split()[1]) if done else t_end) - t, 2),
        "cpu_seconds": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2),
        "load_1m_before": round(load, 2),
        "load_1m_after": round(os.getloadavg()[0], 2),
    }
    if system in PEERS:
        row.update(json.loads(out.with_suffix(".json").read_text()))
    else:
        s = json.loads(proc.stdout)
        # Incremental stays incremental: the same command again on the unchanged folder.
        t = time.time()
        again = subprocess.run(argv, capture_output=True, text=True, cwd=str(REPO))
        if again.returncode != 0:
            raise SystemExit(f"{system} re-run failed:\n{again.stderr[-4000:]}")
        a = json.loads(again.stdout)
        row["unchanged_rerun"] = {
            "seconds": round(time.time() - t, 2),
            "chunks_embedded": a.get("chunks_embedded"),
            "committed": a.get("committed"),
        }
        row.update(
            {
                k: s.get(k)
                for k in (
                    "chunks_total",
                    "windows_embedded",
                    "sentences_embedded",
                    "embed_seconds",
                    "sentence_seconds",
                )
            }
        )
    return row


def summarize(rows: dict[str, list[dict]]) -> dict:
    out: dict = {}
    for system, rs in rows.items():
        secs = [r["seconds"] for r in rs]
        out[system] = {
            "min_seconds": min(secs),
            "median_seconds": round(statistics.median(secs), 2),
            "median_cpu_seconds": round(statistics.median(r["cpu_seconds"] for r in rs), 2),
        }
    for system in ("ragbudget", "ragbudget-stored"):
        # × a peer: the peer's seconds over ragbudget's (above 1: ragbudget is faster). ``x_peer``
        # is the torch chain (LangChain's documented setup), ``x_onnx_peer`` the int8 ONNX one.
        for peer_name, key in (("langchain", "x_peer"), ("langchain-onnx-int8", "x_onnx_peer")):
            peer = out.get(peer_name)
            if peer and system in out:
                out[system][f"{key}_min"] = round(peer["min_seconds"] / out[system]["min_seconds"], 3)
                out[system][f"{key}_median"] = round(peer["median_seconds"] / out[system]["median_seconds"], 3)
                out[system][f"{key}_cpu"] = round(peer["median_cpu_seconds"] / out[system]["median_cpu_seconds"], 3)
    return out


def peer_versions(python: str) -> dict:
    """The peers' package versions, read from the interpreter that runs them."""
    code = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        f"for p in {PEER_PACKAGES!r}:\n"
        "    try: out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


PEER_PACKAGES = (
    "torch",
    "transformers",
    "sentence-transformers",
    "optimum",
    "optimum-onnx",
    "onnxruntime",
    "langchain-core",
    "langchain-community",
    "langchain-huggingface",
    "langchain-text-splitters",
    "faiss-cpu",
    "pypdf",
)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        corpus, out, report = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
        texts = peer(corpus, out, sys.argv[5] if len(sys.argv) > 5 else "")
        print("DONE", time.time(), flush=True)
        report.write_text(json.dumps(truncation(texts)))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--export-onnx-int8":
        print(export_onnx_int8(Path(sys.argv[2])))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpora", default=",".join(CORPORA))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--peer-python",
        default=sys.executable,
        help="the interpreter that runs the peers (a virtual environment with LangChain, and optimum for "
        "langchain-onnx-int8)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "index_throughput.json")
    ap.add_argument(
        "--background-load",
        type=int,
        default=0,
        metavar="N",
        help="keep N busy processes running for the whole run (a fixed load from other users, the same "
        "for every system and round: issue #31's 'a busy host slows ragbudget no more than the peer')",
    )
    args = ap.parse_args()
    corpora = [c for c in args.corpora.split(",") if c]
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"unknown system {s!r}; one of {', '.join(SYSTEMS)}")

    from ragbudget.retrieval.embed import SentenceTransformerEmbedder

    default = SentenceTransformerEmbedder()
    t = time.perf_counter()
    default.warm_up()  # the one-off ONNX export `make install` does, off the clock
    export_s = time.perf_counter() - t
    tmp = Path(tempfile.mkdtemp(prefix="index_throughput_"))
    onnx_model = ""
    if "langchain-onnx-int8" in systems:
        # The peer's one-off export, like ragbudget's above, off the clock.
        folder = tmp / "minilm-onnx-int8"
        t = time.perf_counter()
        done = subprocess.run(
            [args.peer_python, __file__, "--export-onnx-int8", str(folder)], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"the peer's ONNX export failed:\n{done.stderr[-4000:]}")
        onnx_model = f"{folder}:{done.stdout.split()[-1]}"
        print(f"peer's int8 ONNX model: {onnx_model} ({time.perf_counter() - t:.1f} s)", flush=True)
    # Each burner is a plain busy loop in its own process (one core's worth of demand each).
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(0, args.background_load))
    ]
    result: dict = {
        "background_load": args.background_load,
        "embedder": default.spec(),
        "export_seconds_if_not_cached": round(export_s, 1),
        "peer_onnx_model": onnx_model.rpartition(":")[2] or None,
        "peer_python": args.peer_python,
        "peer_versions": peer_versions(args.peer_python),
        "cpus": len(os.sched_getaffinity(0)),
        "rounds": args.rounds,
        "corpora": {},
    }
    try:
        for name in corpora:
            info = write_corpus(name, tmp / name)
            print(f"{name}: {info['files']} files, {info['bytes']:,} bytes", flush=True)
            rows: dict[str, list[dict]] = {s: [] for s in systems}
            for r in range(args.rounds):
                order = systems if r % 2 == 0 else list(reversed(systems))
                for system in order:
                    out = tmp / f"out-{name}-{r}-{system}"
                    row = run(system, tmp / name, out, peer_python=args.peer_python, onnx_model=onnx_model)
                    rows[system].append({"round": r, **row})
                    print(
                        f"  {system:<16} {row['seconds']:>7.1f} s  cpu {row['cpu_seconds']:>6.1f} s  "
                        f"load {row['load_1m_before']:.1f}",
                        flush=True,
                    )
                    shutil.rmtree(out, ignore_errors=True)
            summary = summarize(rows)
            result["corpora"][name] = {"corpus": info, "runs": rows, "summary": summary}
            for system, s in summary.items():
                print(f"  {system}: {s}", flush=True)
    finally:
        for b in burners:
            b.kill()
            b.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    from _results import write

    write(
        args.out.stem,
        result,
        folder=args.out.parent,
        packages=(
            "onnxruntime",
            "onnx",
            "tokenizers",
            "langchain-core",
            "langchain-community",
            "langchain-huggingface",
            "langchain-text-splitters",
            "pypdf",
        ),
    )


if __name__ == "__main__":
    main()
