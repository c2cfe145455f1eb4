"""What storing sentence vectors adds to an index build (issue #18: span packing's cold cost moved
from the first question to the build).

For each split (the QA harness's documents, ``bench/_qa_harness.py``: the same 12 squad-test
articles and 40 Amazon products as the span tables), one file per document is indexed with
``Index.build`` and the library defaults (the embedder ``SentenceTransformerEmbedder()`` picks:
int8 ONNX on a CPU with onnxruntime) plus ``sentence_vectors=True`` (not the default since issue
#31: an index then embeds a sentence when a question first needs it). Recorded from the build's
own summary: total seconds, the chunk-embedding seconds, the sentence-vector seconds
(``sentence_seconds``: splitting, embedding, writing), sentences embedded; the bytes of the stored
sentence vectors against the whole index; then an incremental run after one paragraph is appended
to one document (what an edit costs).
With ``--switch``, two more runs with no file changed: ``sentence_vectors=False`` (the index drops
them: its bytes after) and on again (every chunk's sentences embedded again: the seconds).

    nice -n 19 python bench/spans_build.py
    nice -n 19 python bench/spans_build.py --splits amazon:40 --switch --out bench/results/spans_build_switch.json

Writes ``bench/results/spans_build.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _qa_harness as H  # noqa: E402  (sets the offline environment first)

KEYS = (
    "chunks_total",
    "chunks_embedded",
    "seconds",
    "embed_seconds",
    "sentence_seconds",
    "sentences_embedded",
    "sentences_reused",
)


def _sizes(folder: Path) -> dict[str, int]:
    m = json.loads((folder / "manifest.json").read_text())
    with sqlite3.connect(folder / m["sqlite"]["file"]) as db:
        sent = db.execute(
            "SELECT COALESCE(SUM(length(digests) + length(vectors)), 0), COUNT(*) FROM sentence_vectors"
        ).fetchone()
    total = sum(int((m.get(k) or {}).get("bytes", 0)) for k in ("faiss", "sqlite", "approx"))
    return {
        "index_bytes": total,
        "sentence_vector_bytes": int(sent[0]),
        "chunks_with_sentences": int(sent[1]),
        "faiss_bytes": int(m["faiss"]["bytes"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", default="squad-test:12,amazon:40", help="split:documents,...")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--switch", action="store_true", help="then turn sentence vectors off, and on again")
    args = ap.parse_args()

    from ragbudget.retrieval.embed import SentenceTransformerEmbedder
    from ragbudget.retrieval.index import Index

    emb = SentenceTransformerEmbedder()
    emb.warm_up()
    result: dict = {
        "embedder": emb.id,
        "backend": emb.backend,
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
        "splits": {},
    }
    for spec in args.splits.split(","):
        name, _, docs = spec.partition(":")
        split = H.load_split(name, docs=int(docs), seed=0)
        tmp = Path(tempfile.mkdtemp(prefix="rb-spans-build-"))
        try:
            root = tmp / "docs"
            root.mkdir()
            for i, (title, text) in enumerate(zip(split.titles, split.texts, strict=True)):
                safe = "".join(ch if ch.isalnum() else "_" for ch in title)[:60]
                (root / f"{i:03d}_{safe}.txt").write_text(text)
            first = Index(tmp / "idx").build([str(root)], embedder=emb, sentence_vectors=True)
            sizes = _sizes(tmp / "idx")
            edited = sorted(root.iterdir())[0]
            edited.write_text(
                edited.read_text() + "\n\nA new closing paragraph was added to this "
                "document. It names nothing else, and it ends here.\n"
            )
            again = Index(tmp / "idx").build([str(root)], embedder=emb, sentence_vectors=True)
            f, a = first.to_dict(), again.to_dict()
            r = {
                "documents": len(split.titles),
                "first_build": {k: f[k] for k in KEYS},
                "incremental_one_file": {k: a[k] for k in KEYS},
                **sizes,
            }
            fb = r["first_build"]
            r["sentence_share_of_build"] = fb["sentence_seconds"] / fb["seconds"]
            r["sentence_over_chunk_embedding"] = fb["sentence_seconds"] / max(1e-9, fb["embed_seconds"])
            r["sentence_bytes_share_of_index"] = sizes["sentence_vector_bytes"] / sizes["index_bytes"]
            if args.switch:
                before = _sizes(tmp / "idx")
                off = Index(tmp / "idx").build([str(root)], embedder=emb, sentence_vectors=False).to_dict()
                r["switch_off"] = {**{k: off[k] for k in KEYS}, **_sizes(tmp / "idx")}
                r["switch_off"]["index_bytes_before"] = before["index_bytes"]
                on = Index(tmp / "idx").build([str(root)], embedder=emb, sentence_vectors=True).to_dict()
                r["switch_on_again"] = {**{k: on[k] for k in KEYS}, **_sizes(tmp / "idx")}
            result["splits"][name] = r
            print(name, json.dumps(r), flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    result["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    from _results import write

    out = args.out or (H.ROOT / "bench" / "results" / "spans_build.json")
    write(out.stem, result, folder=out.parent, packages=("sentence-transformers", "tokenizers", "onnxruntime"))


if __name__ == "__main__":
    main()
