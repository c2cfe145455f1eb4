"""What the index tests share: a model-free embedder, small chunk sizes, a synthetic corpus, and
helpers that build an index from it or tamper with one. (Run by children of the kill tests too,
as ``import _corpus``.)

Everything runs with the model-free :class:`HashEmbedder`; chunk sizes are kept small so a few
short files give many chunks.
"""

from __future__ import annotations

import hashlib
import json
import random
import sqlite3
from pathlib import Path

from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Index, IndexSummary

EMB = HashEmbedder(dim=256)

OPTS = {"min_tokens": 20, "max_tokens": 60}

VOCAB = [
    f"{a}{b}"
    for a in ("ka", "lo", "mi", "nu", "pe", "ra", "su", "ti", "vo", "ze")
    for b in ("ba", "de", "fi", "go", "hu", "ja", "ke", "li", "mo", "ny")
]


def make_text(seed: int, n_paragraphs: int = 4, unique: str | None = None) -> str:
    rnd = random.Random(seed)
    paras = []
    for _ in range(n_paragraphs):
        words = [rnd.choice(VOCAB) for _ in range(rnd.randint(25, 45))]
        paras.append(" ".join(words).capitalize() + ".")
    if unique:
        paras.append(f"The unique marker {unique} appears only here.")
    return "\n\n".join(paras) + "\n"


def write_corpus(root: Path, n: int = 6, start_seed: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"doc{i}.txt").write_text(make_text(start_seed + i, unique=f"marker{i}zz"))
    return root


def build(ix: Index, corpus: Path, **kw: object) -> IndexSummary:
    opts = {"embedder": EMB, **OPTS, **kw}
    return ix.build([str(corpus)], **opts)  # type: ignore[arg-type]


def paths_in_index(ix: Index) -> set[str]:
    db = ix.generation.catalog.db
    return {r[0] for r in db.execute("SELECT DISTINCT path FROM sources")}


def chunk_count(ix: Index) -> int:
    return int(Index.open(ix.path).stats()["chunks"])


def _current(ix: Index, key: str) -> Path:
    m = json.loads((ix.path / "manifest.json").read_text())
    return ix.path / m[key]["file"]


def _tamper_sqlite(ix: Index, *statements: str) -> None:
    """Run SQL on the current metadata file and re-seal its manifest checksum, as a buggy writer
    would: the checksums pass, the content does not."""

    f = _current(ix, "sqlite")
    con = sqlite3.connect(f)
    for sql in statements:
        con.execute(sql)
    con.commit()
    con.close()
    m = json.loads((ix.path / "manifest.json").read_text())
    m["sqlite"].update(bytes=f.stat().st_size, sha256=hashlib.sha256(f.read_bytes()).hexdigest())
    (ix.path / "manifest.json").write_text(json.dumps(m))


def _twin_corpus(root: Path) -> Path:
    """Two files sharing one byte-identical paragraph, plus a file of their own each."""
    root.mkdir(parents=True, exist_ok=True)
    shared = make_text(77, n_paragraphs=1)
    (root / "a.txt").write_text(make_text(1, n_paragraphs=2) + "\n" + shared)
    (root / "b.txt").write_text(make_text(2, n_paragraphs=2) + "\n" + shared)
    return root
