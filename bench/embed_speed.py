"""Embedding speed: whole-index throughput of ragbudget's embedding backends against LlamaIndex and
LangChain on the same files, and what int8 quantization does to SQuAD recall@5.

    nice -n 10 .venv/bin/python bench/embed_speed.py                 # both parts
    nice -n 10 .venv/bin/python bench/embed_speed.py --part recall   # recall only
    nice -n 10 .venv/bin/python bench/embed_speed.py --part speed --articles 6 --rounds 2

**speed** — files in, searchable index out, each system in a fresh process timed by the wall clock
(imports and model load included), the systems interleaved round by round so that load from
other users of a shared host hits each of them alike:

* ``ragbudget@torch`` (sentence-transformers on torch: ragbudget before this change),
  ``ragbudget@onnx`` (float32 ONNX Runtime), ``ragbudget@onnx-int8`` (int8 weights): ``python -m
  ragbudget.cli.commands index`` with its defaults (chunks of up to 500 cl100k tokens; every token of every
  chunk embedded, over-long chunks as several 256-word-piece windows). The ONNX exports are
  cached before the timed runs (the one-off export time is reported apart).
* ``llamaindex``: ``SimpleDirectoryReader`` → ``IngestionPipeline([SentenceSplitter(500, 0),
  HuggingFaceEmbedding(<the packaged MiniLM>)])`` → ``VectorStoreIndex(nodes)``.
* ``langchain``: ``TextLoader`` per file → ``RecursiveCharacterTextSplitter(500, 0)`` →
  ``FAISS.from_documents(HuggingFaceEmbeddings(<the packaged MiniLM>))``.

The peers get ragbudget's chunk size measured with the same tokenizer (cl100k, the bundled
offline copy), the same local model and batch size 32. Both embed through sentence-transformers,
which **truncates each chunk at 256 word pieces**: the peers' figures exclude the tail of every
longer chunk (how much is counted after the clock stops and reported).

**recall** — SQuAD dev, every paragraph a passage, recall@5 of the gold paragraph for each
question, for torch, float32 ONNX and int8 ONNX vectors. Split by article, deterministically: the
quantization settings were chosen by cosine to the float vectors on the first 6 dev articles
(``tune``); recall is reported on the articles at odd positions from 7 on (``test``: 7, 9, …).

Raw results: bench/results/embed_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
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
SQUAD = SHARED / "squad" / "squaddev_v1.1.json"

SYSTEMS = ("ragbudget@torch", "ragbudget@onnx", "ragbudget@onnx-int8", "llamaindex", "langchain")
CHUNK_TOKENS = 500  # ragbudget's default max_tokens, given to the peers too
BATCH = 32


def squad() -> list[dict]:
    return json.loads(SQUAD.read_text())["data"]


def tune_articles(data: list[dict]) -> list[dict]:
    return data[:6]


def test_articles(data: list[dict]) -> list[dict]:
    return [a for i, a in enumerate(data) if i >= 7 and i % 2 == 1]


def model_path() -> str:
    from ragbudget.memory.models import resolve_embedder

    return resolve_embedder(None)


# --- recall ----------------------------------------------------------------------------------------


def part_recall(max_articles: int) -> dict:
    import numpy as np

    from ragbudget.retrieval.embed import SentenceTransformerEmbedder

    arts = test_articles(squad())[:max_articles]
    passages, questions, gold = [], [], []
    for a in arts:
        for p in a["paragraphs"]:
            for q in p["qas"]:
                questions.append(q["question"])
                gold.append(len(passages))
            passages.append(p["context"])
    gold_a = np.array(gold)
    out: dict = {
        "split": "test: SQuAD dev articles at odd positions from 7 on (0-based)",
        "articles": [a["title"] for a in arts],
        "passages": len(passages),
        "questions": len(questions),
        "k": 5,
        "backends": {},
    }
    ref = None
    for backend in ("torch", "onnx", "onnx-int8"):
        e = SentenceTransformerEmbedder(backend=backend)
        t = time.perf_counter()
        docs = e.embed_documents(passages)
        t_docs = time.perf_counter() - t
        qv = (
            np.stack([e.embed_query(q) for q in questions]) if backend == "onnx-int8" else e.embed_documents(questions)
        )  # short questions: one window each, the same vectors
        scores = qv @ docs.T
        top = np.argsort(-scores, axis=1)[:, :5]
        hit = (top == gold_a[:, None]).any(axis=1)
        row = {"recall_at_5": round(100.0 * float(hit.mean()), 2), "doc_seconds": round(t_docs, 1)}
        if ref is None:
            ref = (docs, hit)
        else:
            cos = (docs * ref[0]).sum(axis=1)
            row.update(
                cos_to_torch_mean=round(float(cos.mean()), 5),
                cos_to_torch_min=round(float(cos.min()), 5),
                max_abs_diff_to_torch=float(np.abs(docs - ref[0]).max()),
                questions_gained=int((hit & ~ref[1]).sum()),
                questions_lost=int((~hit & ref[1]).sum()),
            )
        out["backends"][backend] = row
        print(backend, row, flush=True)
    return out


# --- speed -----------------------------------------------------------------------------------------


def write_corpus(folder: Path, n_articles: int) -> dict:
    """One text file per SQuAD dev article (paragraphs joined by blank lines), from the tune side
    of the list and onward: the first ``n_articles`` articles not in the recall test split."""
    folder.mkdir(parents=True, exist_ok=True)
    data = squad()
    test = {a["title"] for a in test_articles(data)}
    arts = [a for a in data if a["title"] not in test][:n_articles]
    size = 0
    for a in arts:
        text = a["title"].replace("_", " ") + "\n\n" + "\n\n".join(p["context"] for p in a["paragraphs"]) + "\n"
        (folder / f"{a['title']}.txt").write_text(text, encoding="utf-8")
        size += len(text.encode())
    return {"files": len(arts), "bytes": size, "articles": [a["title"] for a in arts]}


def _cl100k():
    from ragbudget.tokens import _load_tiktoken

    return _load_tiktoken("cl100k_base")


def _truncation(texts: list[str]) -> dict:
    """How many of the peers' chunks pass 256 word pieces, and how many pieces that drops."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_path(), "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    n = [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]
    limit = 254  # 256 minus [CLS] and [SEP]
    return {
        "chunks": len(n),
        "chunks_over_256_pieces": sum(1 for x in n if x > limit),
        "pieces": sum(n),
        "pieces_dropped": sum(max(0, x - limit) for x in n),
    }


def run_one(system: str, corpus: Path, out: Path) -> dict:
    """Runs in the child process; the parent's clock is the figure, this adds counts."""
    if system.startswith("ragbudget@"):
        from ragbudget.cli.commands import main

        try:
            main(["index", str(corpus), "--index-dir", str(out), "--embedder", "default@" + system.split("@", 1)[1]])
        except SystemExit as exc:
            if exc.code:
                raise
        manifest = json.loads((out / "manifest.json").read_text())
        last = manifest["last_run"]
        return {
            "chunks": manifest["counts"]["chunks"],
            "windows_embedded": last.get("windows_embedded"),
            "embedder": manifest["embedder"]["id"],
            "backend": manifest["embedder"].get("backend"),
        }
    enc = _cl100k()
    if system == "llamaindex":
        from llama_index.core import SimpleDirectoryReader, VectorStoreIndex
        from llama_index.core.ingestion import IngestionPipeline
        from llama_index.core.node_parser import SentenceSplitter
        from llama_index.embeddings.huggingface import HuggingFaceEmbedding

        docs = SimpleDirectoryReader(str(corpus)).load_data()
        embed = HuggingFaceEmbedding(model_name=model_path(), device="cpu", embed_batch_size=BATCH)
        pipe = IngestionPipeline(
            transformations=[SentenceSplitter(chunk_size=CHUNK_TOKENS, chunk_overlap=0, tokenizer=enc.encode), embed]
        )
        nodes = pipe.run(documents=docs)
        index = VectorStoreIndex(nodes=nodes, embed_model=embed)
        index.storage_context.persist(str(out))
        return {"chunks": len(nodes), "_texts": [n.get_content() for n in nodes]}
    if system == "langchain":
        from langchain_community.document_loaders import TextLoader
        from langchain_community.vectorstores import FAISS
        from langchain_huggingface import HuggingFaceEmbeddings
        from langchain_text_splitters import RecursiveCharacterTextSplitter

        docs = [d for p in sorted(corpus.glob("*.txt")) for d in TextLoader(str(p), encoding="utf-8").load()]
        splitter = RecursiveCharacterTextSplitter(
            chunk_size=CHUNK_TOKENS, chunk_overlap=0, length_function=lambda t: len(enc.encode(t))
        )
        chunks = splitter.split_documents(docs)
        embed = HuggingFaceEmbeddings(
            model_name=model_path(),
            model_kwargs={"device": "cpu"},
            encode_kwargs={"batch_size": BATCH, "normalize_embeddings": True},
        )
        store = FAISS.from_documents(chunks, embed)
        store.save_local(str(out))
        return {"chunks": len(chunks), "_texts": [c.page_content for c in chunks]}
    raise SystemExit(f"unknown system {system!r}")


def child(system: str, corpus: Path, out: Path, report: Path) -> None:
    got = run_one(system, corpus, out)
    # The clock stopped when the index was written; the child now reports (in the parent's clock
    # only as process exit, a few ms).
    print("DONE", time.time(), flush=True)
    texts = got.pop("_texts", None)
    if texts is not None:
        got.update(_truncation(texts))
    report.write_text(json.dumps(got))


def part_speed(n_articles: int, rounds: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="embed_speed_"))
    corpus_info = write_corpus(tmp / "corpus", n_articles)
    print("corpus", {k: v for k, v in corpus_info.items() if k != "articles"}, flush=True)
    # The one-off ONNX exports, cached before the timed runs.
    from ragbudget.retrieval.embed import SentenceTransformerEmbedder
    from ragbudget.retrieval.onnx import INT8_FILE, cache_root, model_digest

    export = {}
    cache = Path(cache_root()) / model_digest(model_path())
    for backend, name in (("onnx", "model.onnx"), ("onnx-int8", INT8_FILE)):
        cached = (cache / name).is_file()
        t = time.perf_counter()
        SentenceTransformerEmbedder(backend=backend).warm_up()
        export[backend] = {"seconds": round(time.perf_counter() - t, 1), "was_cached": cached}
    print("export", export, flush=True)
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for r in range(rounds):
        # Alternate the order each round so no system always follows the same neighbour.
        order = SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS))
        for system in order:
            out = tmp / f"out-{r}-{system.replace('@', '_')}"
            report = tmp / "report.json"
            t = time.time()
            proc = subprocess.run(
                [sys.executable, __file__, "--child", system, str(tmp / "corpus"), str(out), str(report)],
                capture_output=True,
                text=True,
            )
            t_end = time.time()
            if proc.returncode != 0:
                raise SystemExit(f"{system} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            done = [ln for ln in proc.stdout.splitlines() if ln.startswith("DONE ")]
            wall = (float(done[-1].split()[1]) if done else t_end) - t
            row = {
                "round": r,
                "seconds": round(wall, 2),
                **json.loads(report.read_text()),
                "load_1m": round(os.getloadavg()[0], 2),
            }
            runs[system].append(row)
            print(system, row, flush=True)
            shutil.rmtree(out, ignore_errors=True)
    summary = {}
    base = statistics.median(x["seconds"] for x in runs["ragbudget@torch"])
    for system, rows in runs.items():
        med = statistics.median(x["seconds"] for x in rows)
        summary[system] = {
            "median_seconds": round(med, 2),
            "chunks": rows[0]["chunks"],
            "chunks_per_second": round(rows[0]["chunks"] / med, 2),
            "bytes_per_second": round(corpus_info["bytes"] / med),
            "speedup_vs_ragbudget_torch": round(base / med, 3),
        }
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "corpus": corpus_info,
        "rounds": rounds,
        "export": export,
        "runs": runs,
        "summary": summary,
        "host": f"shared: {os.cpu_count()} vCPUs used by several engineers at once; runs under "
        "nice -n 10, systems interleaved per round",
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "speed", "recall"], default="all")
    ap.add_argument("--articles", type=int, default=6, help="SQuAD articles in the speed corpus")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--recall-articles", type=int, default=8, help="test-split articles for recall")
    args = ap.parse_args()
    from _results import write

    result: dict = {}
    results_file = REPO / "bench" / "results" / "embed_speed.json"
    if results_file.exists():  # a part run alone keeps the other part's last figures
        old = json.loads(results_file.read_text())
        result = {k: old[k] for k in ("recall", "speed") if k in old}
    if args.part in ("all", "recall"):
        result["recall"] = part_recall(args.recall_articles)
    if args.part in ("all", "speed"):
        result["speed"] = part_speed(args.articles, args.rounds)
    write(
        "embed_speed",
        result,
        packages=(
            "onnxruntime",
            "onnx",
            "llama-index-core",
            "llama-index-embeddings-huggingface",
            "langchain-community",
            "langchain-huggingface",
            "tokenizers",
        ),
    )


if __name__ == "__main__":
    main()
