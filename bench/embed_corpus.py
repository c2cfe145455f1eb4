"""Embed real text (sentences, questions and paragraphs) with the packaged MiniLM and cache the
vectors, for the vector-store benchmark (``bench/index_scale.py``).

Texts, in a fixed interleaved order so that a run cut short by ``--seconds`` still holds every
kind: SQuAD v1.1 dev and SQuAD-shifts (Amazon reviews) paragraphs, their sentences and their
questions; CoQA stories, sentences and questions; the man pages and the plain-text manuals
split into paragraphs. Duplicated texts are embedded once. Writes ``bench/out/real_vectors.npy``
(float32, unit length) and ``bench/out/real_texts.json``; a second run resumes after what is
cached.

    python bench/embed_corpus.py --seconds 600
    python bench/embed_corpus.py --seconds 3600 --texts 43008   # index_scale.json's corpus
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import time
from pathlib import Path

import numpy as np

DATA = Path("/work/shared/data")
OUT = Path(__file__).parent / "out"
_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def _squad(path: Path) -> tuple[list[str], list[str], list[str]]:
    d = json.loads(path.read_text(encoding="utf-8"))
    paras, sents, qs = [], [], []
    for art in d["data"]:
        for p in art["paragraphs"]:
            paras.append(p["context"])
            sents += [s for s in _SENT.split(p["context"]) if len(s) > 20]
            qs += [q["question"] for q in p["qas"]]
    return paras, sents, qs


def _coqa(path: Path) -> tuple[list[str], list[str], list[str]]:
    d = json.loads(path.read_text(encoding="utf-8"))
    paras, sents, qs = [], [], []
    for item in d["data"]:
        story = item["story"]
        paras += [p for p in story.split("\n\n") if len(p) > 40]
        sents += [s for s in _SENT.split(story.replace("\n", " ")) if len(s) > 20]
        qs += [q["input_text"] for q in item.get("questions", [])]
    return paras, sents, qs


def _plain(folder: Path, pattern: str) -> list[str]:
    out = []
    for f in sorted(folder.glob(pattern)):
        text = f.read_text(encoding="utf-8", errors="replace")
        out += [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    return [p for p in out if len(p) > 40]


def texts() -> list[str]:
    streams: list[list[str]] = []
    for f in (DATA / "squad/squaddev_v1.1.json", DATA / "squadshifts/amazon_reviews_v1.0.json"):
        streams += list(_squad(f))
    streams += list(_coqa(DATA / "coqa/coqa.test.json"))
    streams.append(_plain(DATA / "manpages", "**/*.txt") + _plain(DATA / "pdf", "*.txt"))
    seen: set[str] = set()
    out = []
    for t in itertools.chain.from_iterable(itertools.zip_longest(*streams)):
        if t and t not in seen:
            seen.add(t)
            out.append(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--texts", type=int, default=None, help="stop after this many texts (a corpus of a known size on any host)"
    )
    args = ap.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    from ragbudget.memory.models import resolve_embedder

    torch.set_num_threads(args.threads)
    OUT.mkdir(exist_ok=True)
    all_texts = texts()[: args.texts]
    vec_path, txt_path = OUT / "real_vectors.npy", OUT / "real_texts.json"
    done = np.load(vec_path) if vec_path.exists() else np.zeros((0, 384), np.float32)
    print(f"{len(all_texts)} distinct texts; {len(done)} cached", flush=True)
    model = SentenceTransformer(resolve_embedder(None), device="cpu")
    model.max_seq_length = 256
    t0 = time.perf_counter()
    parts = [done]
    n = len(done)
    while n < len(all_texts) and time.perf_counter() - t0 < args.seconds:
        batch = all_texts[n : n + 2048]
        parts.append(
            model.encode(batch, batch_size=64, normalize_embeddings=True, convert_to_numpy=True).astype(np.float32)
        )
        n += len(batch)
        np.save(vec_path, np.concatenate(parts))
        txt_path.write_text(json.dumps(all_texts[:n]), encoding="utf-8")
        print(f"{n} embedded, {time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
