"""The on-disk index: FAISS vectors + SQLite metadata + a JSON manifest, crash-safe and incremental.

Layout of an index folder (default ``.ragbudget/``)::

    manifest.json          names the current generation, settings, counts and sha256 checksums
    faiss.<gen>.index      exact inner-product index (IndexFlatIP in IndexIDMap2), ids = chunk ids
    hnsw.<gen>.index       optional approximate index over the same vectors (``approx="hnsw"``)
    meta.<gen>.sqlite      chunks, sources (every duplicate location), files (drives incremental runs),
                           roots (the paths given to build, with their display labels),
                           chunks_fts: an FTS5 (BM25) table over the chunk texts, kept in sync with
                           ``chunks`` by triggers, so it is written by the same atomic generation
    lock                   flock'ed by the one writer
    embed.checkpoint       vectors embedded by an unfinished run (only while one is, or was killed)

**Atomicity.** A writer never modifies the files of the current generation: it copies the SQLite
file to ``meta.<gen+1>.sqlite.tmp``, edits the copy, writes the new FAISS file beside the old one,
fsyncs, renames the temp files into place, and only then atomically replaces ``manifest.json``
(write temp, fsync, rename, fsync folder). The manifest rename is the commit point: a crash at any
moment leaves the old manifest naming the old, untouched files — or the new manifest naming new,
complete ones. Leftover temp files and stale generations are removed by the next writer. The previous
generation is kept so a reader that has just read the manifest can still open its files.

**No code is executed on load**: FAISS files go through ``faiss.read_index``, metadata through
SQLite and JSON; there is no pickle. Every file is checked against its manifest sha256 before use,
so a truncated or bit-flipped file raises :class:`~ragbudget.errors.IndexCorruptError` naming it.

**Roots and removal.** ``build(paths)`` adds and updates: each path must exist (else nothing is
written), is recorded in the ``roots`` table with a short label, and only indexed files that
vanished from under a given path are removed (``prune=True`` mirrors the given paths exactly). A
run that would remove all indexed files, or more than a few and a fifth of them, needs
``allow_removal`` (see :data:`REMOVAL_GUARD_FILES`). Paths are stored absolute (the files table
drives incremental runs) and shown relative to their root, prefixed by its label.

**Resumable embedding.** Each embedded batch is appended to ``embed.checkpoint`` (fsync'ed); a
run killed before its commit leaves it, and the next run reuses those vectors; the commit removes
it.

**Incremental runs.** Files whose size and mtime_ns match the files table are not opened; if they
differ, the content sha256 decides. A changed file replaces only its own sources; chunks whose text
(content hash) is already in the index are never re-embedded; chunks left without any source are
dropped. Changed embedder, chunking or dedup settings trigger a full rebuild (vectors are still reused
by content hash when only chunking/dedup changed).

**Hybrid search.** ``search(..., hybrid=True)`` fuses the dense FAISS candidates with BM25 candidates
from the FTS5 table (normalized score fusion by default, or reciprocal rank fusion). An index built
before the table existed still opens: the table is built in memory on first lexical use (logged),
and the next ``build``/``update`` stores it. A Python whose SQLite lacks FTS5 logs that once and
searches dense only.

>>> from ragbudget.embed import HashEmbedder
>>> idx = Index("/tmp/rb-doctest-index")                      # doctest: +SKIP
>>> idx.build(["docs/"], embedder=HashEmbedder()).chunks_total  # doctest: +SKIP
42
>>> idx.search("how do I appoint a delegate?", k=3)[0].sources  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sqlite3
import stat
import struct
import threading
import zlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import (
    ConfigError,
    IndexCorruptError,
    IndexLockedError,
    IndexNotFoundError,
    InputPathError,
    LoadError,
)
from .types import Document, Source

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Self

    from .embed import Embedder

__all__ = [
    "DEFAULT_INDEX_DIR",
    "FORMAT_VERSION",
    "FUSIONS",
    "Hit",
    "Index",
    "IndexSummary",
    "IndexedFile",
    "ProgressCallback",
    "REMOVAL_GUARD_FILES",
    "REMOVAL_GUARD_SHARE",
    "VerifyReport",
    "fts5_available",
    "fts_match_query",
    "fuse_scores",
]

log = logging.getLogger(__name__)

DEFAULT_INDEX_DIR = ".ragbudget"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LOCK = "lock"
_GEN_FILE = re.compile(r"^(faiss|hnsw|meta)\.(\d+)\.(index|sqlite)$")

#: ``progress(phase, done, total)``: phases ``"files"`` (files to (re)index) then ``"embed"``
#: (chunks embedded; ``total`` grows as files are chunked), then ``"write"``.
ProgressCallback = Callable[[str, int, "int | None"], None]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY,
    text TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    headings TEXT NOT NULL DEFAULT '[]',
    content_hash TEXT NOT NULL,
    minhash BLOB,
    windows INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS chunks_hash ON chunks(content_hash);
CREATE TABLE IF NOT EXISTS sources (
    chunk_id INTEGER NOT NULL,
    path TEXT NOT NULL,
    start INTEGER NOT NULL,
    "end" INTEGER NOT NULL,
    page_start INTEGER,
    page_end INTEGER,
    ord INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS sources_chunk ON sources(chunk_id, ord);
CREATE INDEX IF NOT EXISTS sources_path ON sources(path, start);
CREATE TABLE IF NOT EXISTS files (
    path TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    sha256 TEXT,
    status TEXT NOT NULL,
    reason TEXT,
    detail TEXT,
    n_chunks INTEGER NOT NULL DEFAULT 0,
    furniture INTEGER NOT NULL DEFAULT 0,
    n_pages INTEGER,
    warning TEXT
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS roots (
    path TEXT PRIMARY KEY,
    label TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL
);
"""
# Columns added to ``files`` after the first release: an older generation gets them on copy.
_FILES_ADDED_COLUMNS = (("n_pages", "INTEGER"), ("warning", "TEXT"))

#: The removal guard: without ``allow_removal`` (``--allow-removal``) or ``prune``, a run may
#: remove at most ``REMOVAL_GUARD_FILES`` indexed files, or more only while they are at most
#: ``REMOVAL_GUARD_SHARE`` of the indexed files, and never all of them. Deleting a few notes is
#: everyday editing; a fifth of the corpus gone at once is far more often an unmounted drive, an
#: emptied or wrong folder than a real clean-up, and costs a full re-embed to undo.
REMOVAL_GUARD_FILES = 5
REMOVAL_GUARD_SHARE = 0.2

# Embedded batches of the run in progress, appended and fsync'ed per batch, so a re-run after a
# kill reuses them (see ``_Checkpoint``). Not a generation file: ``_clean_leftovers`` keeps it.
CHECKPOINT = "embed.checkpoint"

# BM25 over the chunk texts. A plain (content-storing) FTS5 table, not an external-content one: it
# costs a second copy of the text, but it can be checked row by row against ``chunks`` on a
# read-only connection (verify), and SQLite 3.40 (this Python's) has no contentless deletes.
# Porter stemming: questions say "founded" where the text says "founding".
FTS_TOKENIZE = "porter unicode61 remove_diacritics 2"
_FTS_SCHEMA = f"""
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5(text, tokenize='{FTS_TOKENIZE}');
CREATE TRIGGER IF NOT EXISTS chunks_fts_ai AFTER INSERT ON chunks BEGIN
    INSERT INTO chunks_fts(rowid, text) VALUES (new.id, new.text);
END;
CREATE TRIGGER IF NOT EXISTS chunks_fts_ad AFTER DELETE ON chunks BEGIN
    DELETE FROM chunks_fts WHERE rowid = old.id;
END;
CREATE TRIGGER IF NOT EXISTS chunks_fts_au AFTER UPDATE OF text ON chunks BEGIN
    UPDATE chunks_fts SET text = new.text WHERE rowid = old.id;
END;
"""

#: Fusion methods of hybrid search: ``rrf`` (reciprocal rank fusion, Cormack et al. 2009) and
#: ``score`` (min-max normalized scores, weighted sum).
FUSIONS = ("rrf", "score")
# RRF's k: 60 is the constant of the original paper and of Elasticsearch/Weaviate/LlamaIndex.
_RRF_K = 60
# Words that carry no retrieval signal in a question; OR-ing them would only make every chunk match.
_STOP = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "been", "but", "by", "can", "could", "did", "do",
    "does", "for", "from", "had", "has", "have", "how", "i", "if", "in", "into", "is", "it", "its",
    "of", "on", "or", "should", "so", "than", "that", "the", "their", "them", "then", "there",
    "these", "they", "this", "those", "to", "was", "were", "what", "when", "where", "which", "who",
    "whom", "whose", "why", "will", "with", "would", "you", "your", "yours", "me", "my", "we",
    "our", "us", "he", "she", "his", "her",
))
_FTS_WORD = re.compile(r"\w+")
_FTS_MAX_TERMS = 64

_fts5_ok: bool | None = None
_fts5_warned = False


def fts5_available() -> bool:
    """Whether this Python's SQLite has FTS5 (checked once, on an in-memory database)."""
    global _fts5_ok
    if _fts5_ok is None:
        try:
            con = sqlite3.connect(":memory:")
            try:
                con.execute("CREATE VIRTUAL TABLE t USING fts5(x)")
                _fts5_ok = True
            finally:
                con.close()
        except sqlite3.Error:
            _fts5_ok = False
    return _fts5_ok


def _warn_no_fts5() -> None:
    global _fts5_warned
    if not _fts5_warned:
        _fts5_warned = True
        log.warning(
            "this Python's SQLite (%s) has no FTS5: lexical (BM25) search is off and hybrid "
            "search falls back to dense only; use a Python built with a full SQLite to enable it",
            sqlite3.sqlite_version,
        )


def fts_match_query(text: str, *, max_terms: int = _FTS_MAX_TERMS) -> str:
    """An FTS5 ``MATCH`` expression for free text: its words, each quoted, joined by ``OR``.

    Every word becomes a quoted string (a ``"`` inside is doubled), so FTS5 syntax in the user's
    text — quotes, ``AND``/``NOT``/``NEAR``, ``*``, ``^``, column filters, parentheses — is matched
    as plain words and never raises. Stop words are left out unless nothing else is left; repeated
    words count once; at most ``max_terms`` words. ``""`` when the text has no word at all.

    >>> fts_match_query('Who founded "Apple" AND NOT Microsoft*?')
    '"founded" OR "apple" OR "microsoft"'
    """
    words = list(dict.fromkeys(w.lower() for w in _FTS_WORD.findall(text)))
    kept = [w for w in words if w not in _STOP and w not in ("and", "or", "not", "near")] or words
    return " OR ".join('"' + w.replace('"', '""') + '"' for w in kept[:max_terms])


def _bm25(db: sqlite3.Connection, query: str, k: int, *,
          ids: Sequence[int] | None = None) -> list[tuple[int, float]]:
    """``(chunk_id, bm25)`` best first (bm25 negated so higher is better), from ``chunks_fts``.

    With ``ids``, only those chunks are scored (their BM25 still uses whole-corpus statistics).
    A query FTS5 still refuses is logged and answers ``[]``: a question must never fail on syntax.
    """
    expr = fts_match_query(query)
    if not expr or k < 1:
        return []
    sql = "SELECT rowid, -bm25(chunks_fts) FROM chunks_fts WHERE chunks_fts MATCH ?"
    params: list[Any] = [expr]
    if ids is not None:
        ids = [int(i) for i in ids][:900]  # under every SQLite build's bound-parameter limit
        if not ids:
            return []
        sql += f" AND rowid IN ({','.join('?' * len(ids))})"
        params += ids
    sql += " ORDER BY bm25(chunks_fts) LIMIT ?"
    params.append(int(k))
    try:
        return [(int(i), float(s)) for i, s in db.execute(sql, params)]
    except sqlite3.Error as exc:
        log.warning("lexical search skipped for %r: %s", query[:80], exc)
        return []


_FTS_TRIGGERS = ("chunks_fts_ai", "chunks_fts_ad", "chunks_fts_au")


def _ensure_fts(db: sqlite3.Connection, *, trusted: bool = True) -> str:
    """Create the FTS table and its triggers on a writable connection and fill it if it was missing.

    ``trusted=False`` says an existing table may be stale (the generation was written by a Python
    without FTS5, which had to drop the triggers): it is rebuilt from ``chunks``. Returns ``"ok"``
    (was there), ``"created"`` (created and back-filled) or ``"unavailable"`` (no FTS5 here; the
    triggers are dropped so that writing ``chunks`` does not need the missing module).
    """
    had = db.execute("SELECT 1 FROM sqlite_master WHERE name='chunks_fts'").fetchone() is not None
    if not fts5_available():
        _warn_no_fts5()
        for t in _FTS_TRIGGERS:
            db.execute(f"DROP TRIGGER IF EXISTS {t}")
        return "unavailable"
    if had and not trusted:
        db.execute("DROP TABLE chunks_fts")
        had = False
    db.executescript(_FTS_SCHEMA)
    if had:
        return "ok"
    db.execute("INSERT INTO chunks_fts(rowid, text) SELECT id, text FROM chunks")
    return "created"


def fuse_scores(
    dense: dict[Any, float],
    lexical: dict[Any, float],
    *,
    method: str = "score",
    lexical_weight: float = 0.5,
) -> list[tuple[Any, float]]:
    """Fuse dense and lexical scores of the same items; ``(id, score)`` best first.

    ``dense`` maps ids to similarities (higher is better), ``lexical`` ids to BM25 scores (higher
    is better); an id missing from one mapping did not come up in that search. ``method``:

    * ``"rrf"``: ``(1 - w) / (60 + dense rank) + w / (60 + lexical rank)`` (ranks from 1);
    * ``"score"``: ``(1 - w) · d + w · l``, the dense scores min-max normalized over the
      candidates, the lexical ones divided by their maximum (BM25 is ≥ 0 and an absent chunk
      matched no query word: 0, not merely the lowest candidate); a missing score counts as 0.

    ``w = lexical_weight`` (0: dense order only, 1: lexical only). The fused value is then mapped
    linearly onto the range of the dense scores given, so the result keeps the units of a cosine
    similarity — what ``select_chunks``'s ``temperature`` is tuned for. Ties keep dense order, then
    lexical order.

    ``score`` is the default: on SQuAD (``bench/qa.py --sweep``) it gave the best answer recall
    at small context budgets, where the order of the first few chunks decides.

    >>> fuse_scores({"a": 0.9, "b": 0.8, "c": 0.5}, {"b": 12.0, "c": 3.0})
    [('b', 0.9), ('a', 0.7), ('c', 0.5)]
    >>> fuse_scores({"a": 0.9, "b": 0.8}, {"b": 12.0}, method="rrf")
    [('b', 0.9), ('a', 0.8)]
    """
    if method not in FUSIONS:
        raise ConfigError(f"fusion must be one of {', '.join(FUSIONS)}; got {method!r}")
    if not 0.0 <= lexical_weight <= 1.0:
        raise ConfigError(f"lexical_weight must be in [0, 1]; got {lexical_weight}")
    d_order = sorted(dense, key=lambda i: -dense[i])
    l_order = sorted(lexical, key=lambda i: -lexical[i])
    ids = list(dict.fromkeys(d_order + l_order))
    if not ids:
        return []
    w = lexical_weight
    fused: dict[Any, float] = {}
    if method == "rrf":
        d_rank = {i: r for r, i in enumerate(d_order, 1)}
        l_rank = {i: r for r, i in enumerate(l_order, 1)}
        for i in ids:
            f = 0.0
            if i in d_rank:
                f += (1.0 - w) / (_RRF_K + d_rank[i])
            if i in l_rank:
                f += w / (_RRF_K + l_rank[i])
            fused[i] = f
    else:
        def normalized(m: dict[Any, float], *, from_zero: bool) -> dict[Any, float]:
            if not m:
                return {}
            lo, hi = min(m.values()), max(m.values())
            if from_zero and lo >= 0 and hi > 0:
                return {i: v / hi for i, v in m.items()}
            return {i: (v - lo) / (hi - lo) if hi > lo else 1.0 for i, v in m.items()}

        dn = normalized(dense, from_zero=False)
        ln = normalized(lexical, from_zero=True)
        for i in ids:
            fused[i] = (1.0 - w) * dn.get(i, 0.0) + w * ln.get(i, 0.0)
    pos = {i: n for n, i in enumerate(ids)}
    ranked = sorted(ids, key=lambda i: (-fused[i], pos[i]))
    if dense:
        lo, hi = min(dense.values()), max(dense.values())
    else:
        lo, hi = 0.0, 1.0
    f_lo, f_hi = min(fused.values()), max(fused.values())
    span = f_hi - f_lo
    return [(i, round(hi if span <= 0 else lo + (fused[i] - f_lo) / span * (hi - lo), 9))
            for i in ranked]


# --------------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class Hit:
    """A chunk returned by search (``score`` = cosine similarity) or fetched by id (``score`` 0).

    ``sources`` lists every place the text appears (exact and near duplicates), first the one whose
    text is stored.
    """

    chunk_id: int
    score: float
    text: str
    n_tokens: int
    headings: tuple[str, ...] = ()
    sources: tuple[Source, ...] = ()
    windows: int = 1

    @property
    def source(self) -> Source | None:
        """The first (text-owning) source."""
        return self.sources[0] if self.sources else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "chunk_id": self.chunk_id,
            "score": round(float(self.score), 6),
            "text": self.text,
            "n_tokens": self.n_tokens,
            "headings": list(self.headings),
            "sources": [s.to_dict() for s in self.sources],
            "windows": self.windows,
        }


@dataclass(frozen=True)
class IndexSummary:
    """What one :meth:`Index.build` run did. ``skipped`` holds ``(path, reason, detail)`` triples,
    ``warnings`` ``(path, message)`` pairs (e.g. a file decoded by a guessed legacy encoding); paths
    are display paths (see :attr:`Index.absolute_paths`).

    ``files_indexed`` = ``files_added`` (new to the index) + ``files_updated`` (changed, or
    re-read by a rebuild); ``files_removed`` counts indexed files that left the index;
    ``files_kept`` the indexed files under other roots, left untouched. ``chunks_reused`` counts
    vectors not embedded again, ``chunks_resumed`` the part of them taken from the checkpoint of
    an interrupted run.
    """

    files_seen: int = 0
    files_indexed: int = 0
    files_unchanged: int = 0
    files_removed: int = 0
    skipped: tuple[tuple[str, str, str], ...] = ()
    chunks_total: int = 0
    chunks_added: int = 0
    chunks_removed: int = 0
    chunks_embedded: int = 0
    chunks_reused: int = 0
    exact_duplicates: int = 0
    near_duplicates: int = 0
    furniture_lines_removed: int = 0
    windows_pooled: int = 0
    windows_embedded: int = 0
    seconds: float = 0.0
    embed_seconds: float = 0.0
    rebuilt: bool = False
    rebuild_reason: str = ""
    generation: int = 0
    committed: bool = False
    files_added: int = 0
    files_updated: int = 0
    files_kept: int = 0
    chunks_resumed: int = 0
    warnings: tuple[tuple[str, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["skipped"] = [{"path": p, "reason": r, "detail": x} for p, r, x in self.skipped]
        d["warnings"] = [{"path": p, "message": m} for p, m in self.warnings]
        d["seconds"] = round(self.seconds, 3)
        d["embed_seconds"] = round(self.embed_seconds, 3)
        return d


@dataclass(frozen=True)
class IndexedFile:
    """One file the index knows (:meth:`Index.sources`): ``path`` is its display path,
    ``status`` ``"indexed"`` or ``"skipped"`` (``reason``/``detail`` say why), ``chunks`` the
    chunks cut from it (before dedup), ``pages`` its page count when it has real pages,
    ``warning`` e.g. a guessed text encoding."""

    path: str
    status: str
    chunks: int = 0
    pages: int | None = None
    size: int | None = None
    reason: str | None = None
    detail: str | None = None
    warning: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class VerifyReport:
    """Result of :meth:`Index.verify`: ``ok`` when ``problems`` is empty."""

    ok: bool
    problems: tuple[str, ...] = ()
    checked: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "problems": list(self.problems), "checked": dict(self.checked)}


# --------------------------------------------------------------------------------------------------
# small file helpers


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
        _fsync_file(path)


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _count(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return len(value)
    except TypeError:
        return 0


def _under(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies below it (both absolute, resolved)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _canon(path: str) -> str:
    """An absolute path whose folder is resolved but whose last part is kept (a broken link or a
    skipped entry keeps its own name): the key of a ``files`` row."""
    path = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


@dataclass(frozen=True)
class _Root:
    """A path given to :meth:`Index.build`: resolved absolute ``path``, short unique ``label``
    (its base name, ``-2``… on a clash) shown instead of the path, ``kind`` ``dir`` or ``file``."""

    path: str
    label: str
    kind: str

    def covers(self, path: str) -> bool:
        return path == self.path or (self.kind == "dir" and _under(path, self.path))


class _Roots:
    """Maps stored absolute paths to display paths (``<root label>/<path below the root>``) and
    back. The most specific root wins when roots nest."""

    def __init__(self, roots: Iterable[_Root] = ()) -> None:
        self.roots = sorted(roots, key=lambda r: (-len(r.path), r.path))
        self.by_label = {r.label: r for r in self.roots}
        self._shown: dict[str, str] = {}

    def root_of(self, path: str) -> _Root | None:
        return next((r for r in self.roots if r.covers(path)), None)

    def display(self, path: str) -> str:
        shown = self._shown.get(path)
        if shown is None:
            r = self.root_of(path)
            if r is None:  # not under any root (never expected): the name alone, never the path
                shown = os.path.basename(path) or path
            elif path == r.path:
                shown = r.label
            else:
                shown = r.label + "/" + os.path.relpath(path, r.path).replace(os.sep, "/")
            self._shown[path] = shown
        return shown

    def absolute(self, path: str) -> str | None:
        """The stored absolute path of a display path (an absolute path is returned as is)."""
        if os.path.isabs(path):
            return path
        label, _, rest = path.partition("/")
        r = self.by_label.get(label)
        if r is None or (rest and r.kind != "dir"):
            return None
        return os.path.join(r.path, *rest.split("/")) if rest else r.path

    def labels(self) -> list[str]:
        return sorted(self.by_label)

    def scrub(self, text: str | None) -> str | None:
        """``text`` (an error detail) with every root's absolute path replaced by its label."""
        if text:
            for r in self.roots:
                text = text.replace(r.path, r.label)
        return text


def _new_label(path: str, taken: set[str]) -> str:
    base = os.path.basename(path.rstrip(os.sep)) or "root"
    label, n = base, 1
    while label in taken:
        n += 1
        label = f"{base}-{n}"
    return label


def _fallback_root(paths: Iterable[str]) -> _Root | None:
    """For an index written before roots were recorded: the common folder of its files."""
    files = [p for p in paths if os.path.isabs(p)]
    if not files:
        return None
    common = os.path.commonpath(files)
    if common in files:  # a single file (or one file and a path below it, impossible): its folder
        common = os.path.dirname(common)
    return _Root(common, _new_label(common, set()), "dir")


def _read_roots(db: sqlite3.Connection) -> list[_Root]:
    try:
        return [_Root(p, lab, kind) for p, lab, kind in db.execute("SELECT path, label, kind FROM roots")]
    except sqlite3.OperationalError:  # a generation written before the table existed
        return []


def _check_roots(paths: Sequence[str], index_dir: Path) -> list[tuple[str, str]]:
    """``(resolved path, kind)`` of every path given to index; raises :class:`InputPathError`
    naming each one that is missing, unreadable, or not a file or folder (before anything is
    written)."""
    good: list[tuple[str, str]] = []
    bad: list[tuple[str, str]] = []
    for p in paths:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            bad.append((p, "no such file or folder"))
            continue
        except OSError as exc:
            bad.append((p, exc.strerror or str(exc)))
            continue
        if stat.S_ISDIR(st.st_mode):
            kind, mode = "dir", os.R_OK | os.X_OK
        elif stat.S_ISREG(st.st_mode):
            kind, mode = "file", os.R_OK
        else:
            bad.append((p, "not a file or folder"))
            continue
        if not os.access(p, mode):
            bad.append((p, "permission denied"))
            continue
        good.append((os.path.realpath(p), kind))
    if bad:
        what = "; ".join(f"{p!r}: {why}" for p, why in bad)
        state = ("the index in {} is unchanged".format(index_dir) if (index_dir / MANIFEST).exists()
                 else f"no index was created in {index_dir}")
        raise InputPathError(
            f"cannot index {what}. Nothing was indexed or removed ({state}); check the "
            "path, or pass only the files and folders that exist",
            paths=tuple(p for p, _ in bad),
        )
    return good


class _Lock:
    """Exclusive, non-blocking ``flock`` on ``<dir>/lock``; released by the kernel if we die."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK
        self.fd: int | None = None

    def __enter__(self) -> Self:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise IndexLockedError(
                f"another process (pid {holder}) is writing the index in {self.path.parent}; wait "
                "for it to finish or use another --index-dir (readers are not blocked)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        import fcntl

        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# --------------------------------------------------------------------------------------------------
# the index


class Index:
    """An index folder: open it to search, or build/update it from files.

    ``Index(path)`` never touches the disk until used; :meth:`open` requires an existing index.
    ``search_threads`` is the OpenMP thread count for one query (default 1, see the comment in
    ``__init__``); ``use_approx=False`` searches the exact index even when an HNSW one exists.
    Reading loads the manifest-named generation, checks sha256 checksums (``verify_checksums``),
    and keeps the FAISS index in memory and the SQLite file open read-only.

    **Paths.** The index records the roots it was given (each folder or file passed to
    :meth:`build`, labelled by its base name). Every path it returns (``Source.path``,
    :meth:`sources`, summaries) is a *display path*: the root's label, then the path below it
    (``notes/deep/guide.pdf``), never an absolute filesystem path, so nothing private reaches a
    prompt, a log or an HTTP client. ``absolute_paths=True`` (a local CLI's opt-in) returns the
    absolute paths instead; :meth:`absolute_path` maps one display path back. Methods taking a
    path accept either form.

    >>> idx = Index.open(".ragbudget")            # doctest: +SKIP
    >>> [h.sources[0].path for h in idx.search("delegate", k=2)]  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str] = DEFAULT_INDEX_DIR, *,
                 verify_checksums: bool = True, use_approx: bool = True,
                 search_threads: int | None = 1, absolute_paths: bool = False) -> None:
        self.path = Path(path)
        self.absolute_paths = absolute_paths
        self._roots: _Roots | None = None
        self.verify_checksums = verify_checksums
        self.use_approx = use_approx
        # One query is memory-bound: extra OpenMP threads barely help, and on busy cores their
        # spin-waits made a 20k-vector flat search 10x slower (82 ms vs 7 ms measured on 2 cores).
        # None leaves FAISS's global thread setting alone.
        self.search_threads = search_threads
        self._manifest: dict[str, Any] | None = None
        self._faiss: Any = None
        self._approx: Any = None
        self._db: sqlite3.Connection | None = None
        # Where BM25 queries go: the generation's SQLite file, or an in-memory FTS table built
        # on demand for an index written before the table existed; False: no FTS5 here.
        self._lex_db: sqlite3.Connection | bool | None = None
        self._embedder: Embedder | None = None
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"Index({str(self.path)!r})"

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str] = DEFAULT_INDEX_DIR, **kwargs: Any) -> Index:
        """Open an existing index (raises :class:`IndexNotFoundError` when there is none)."""
        idx = cls(path, **kwargs)
        idx._read_manifest()
        return idx

    @property
    def exists(self) -> bool:
        return (self.path / MANIFEST).is_file()

    @property
    def manifest(self) -> dict[str, Any]:
        """The manifest of the generation in use (read on first access)."""
        if self._manifest is None:
            self._read_manifest()
        assert self._manifest is not None
        return self._manifest

    def _read_manifest(self) -> dict[str, Any]:
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise IndexNotFoundError(
                f"no index in {self.path} (no {MANIFEST}); build one with `ragbudget index PATH "
                f"--index-dir {self.path}`"
            )
        try:
            data = json.loads(mpath.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != "ragbudget-index":
                raise ValueError("not a ragbudget manifest")
            int(data["generation"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise IndexCorruptError(
                f"index manifest {mpath} is unreadable ({exc}); rebuild the index with "
                "`ragbudget index PATH --rebuild`"
            ) from exc
        if int(data.get("format_version", 0)) > FORMAT_VERSION:
            raise IndexCorruptError(
                f"{mpath} has format version {data.get('format_version')}, this ragbudget reads "
                f"up to {FORMAT_VERSION}; upgrade ragbudget or rebuild the index"
            )
        self._manifest = data
        return data

    def _check_file(self, entry: dict[str, Any]) -> Path:
        p = self.path / entry["file"]
        if not p.is_file():
            raise IndexCorruptError(f"index file {p} is missing; rebuild the index")
        size = p.stat().st_size
        if size != int(entry.get("bytes", size)):
            raise IndexCorruptError(
                f"index file {p} is {size} bytes, the manifest says {entry['bytes']} "
                "(truncated or overwritten); rebuild the index"
            )
        if self.verify_checksums and _sha256_file(p) != entry["sha256"]:
            raise IndexCorruptError(
                f"index file {p} fails its sha256 checksum (corrupted); rebuild the index"
            )
        return p

    def _load(self) -> None:
        """Load the manifest-named generation into memory (retrying if a writer just swapped it)."""
        if self._faiss is not None:
            return
        with self._lock:
            if self._faiss is not None:
                return
            for attempt in range(3):
                m = self._read_manifest()
                try:
                    self._faiss, self._approx, self._db = self._open_generation(m)
                    self._roots = self._load_roots(self._db)
                    return
                except IndexCorruptError:
                    # The writer may have committed a newer generation and removed this one
                    # between our manifest read and the file opens; re-read once or twice.
                    if attempt == 2 or self._read_manifest().get("generation") == m["generation"]:
                        raise

    def _open_generation(self, m: dict[str, Any]) -> tuple[Any, Any, sqlite3.Connection]:
        import faiss

        fpath = self._check_file(m["faiss"])
        spath = self._check_file(m["sqlite"])
        try:
            flat = faiss.read_index(str(fpath))
        except Exception as exc:  # faiss raises RuntimeError on a malformed file
            raise IndexCorruptError(f"index file {fpath} could not be read by faiss: {exc}") from exc
        approx = None
        if self.use_approx and m.get("approx"):
            apath = self._check_file(m["approx"])
            try:
                approx = faiss.read_index(str(apath))
                faiss.ParameterSpace().set_index_parameter(
                    approx, "efSearch", int(m["approx"].get("ef_search", 128)))
            except Exception as exc:
                raise IndexCorruptError(f"index file {apath} could not be read: {exc}") from exc
        # immutable=1: generation files never change after commit, so SQLite needs no locks.
        try:
            db = sqlite3.connect(f"file:{spath}?mode=ro&immutable=1", uri=True,
                                 check_same_thread=False)
            gen = db.execute("SELECT value FROM meta WHERE key='generation'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise IndexCorruptError(f"index file {spath} is not a readable SQLite file: {exc}") from exc
        if gen is None or int(gen[0]) != int(m["generation"]):
            db.close()
            raise IndexCorruptError(
                f"{spath} belongs to generation {gen and gen[0]}, the manifest names "
                f"{m['generation']}; rebuild the index"
            )
        return flat, approx, db

    def _load_roots(self, db: sqlite3.Connection) -> _Roots:
        roots = _read_roots(db)
        if not roots:
            fallback = _fallback_root(r[0] for r in db.execute("SELECT path FROM files"))
            if fallback is not None:
                log.warning(
                    "the index in %s records no roots (written by an older ragbudget): paths are "
                    "shown relative to their common folder, as %s/...; the next `ragbudget index` "
                    "run records the roots", self.path, fallback.label)
                roots = [fallback]
        return _Roots(roots)

    def _show(self, path: str) -> str:
        if self.absolute_paths:
            return path
        assert self._roots is not None
        return self._roots.display(path)

    def absolute_path(self, path: str) -> str | None:
        """The absolute filesystem path of a display path (``Source.path``), for local tools
        that open the file; ``None`` when no recorded root matches. Never send it to a client.

        >>> idx.absolute_path("notes/deep/guide.pdf")        # doctest: +SKIP
        '/home/me/notes/deep/guide.pdf'
        """
        self._load()
        assert self._roots is not None
        return self._roots.absolute(path)

    def roots(self) -> list[str]:
        """The labels of the recorded roots (the first part of every display path)."""
        self._load()
        assert self._roots is not None
        return self._roots.labels()

    def sources(self) -> list[IndexedFile]:
        """Every file the index knows, indexed or skipped, by display path."""
        self._load()
        assert self._db is not None
        with self._lock:
            cols = {r[1] for r in self._db.execute("PRAGMA table_info(files)")}
            extra = ", ".join(c if c in cols else "NULL" for c, _ in _FILES_ADDED_COLUMNS)
            rows = self._db.execute(
                f"SELECT path, status, n_chunks, size, reason, detail, {extra} FROM files").fetchall()
        scrub = (lambda t: t) if self.absolute_paths else self._roots.scrub  # type: ignore[union-attr]
        out = [IndexedFile(self._show(p), st_, int(n or 0), pages, size if size >= 0 else None,
                           reason, scrub(detail), warning)
               for p, st_, n, size, reason, detail, pages, warning in rows]
        return sorted(out, key=lambda f: f.path)

    def close(self) -> None:
        """Release the in-memory index and the SQLite handle (reopened on next use)."""
        with self._lock:
            if isinstance(self._lex_db, sqlite3.Connection) and self._lex_db is not self._db:
                self._lex_db.close()
            self._lex_db = None
            if self._db is not None:
                self._db.close()
            self._db = self._faiss = self._approx = None
            self._manifest = None
            self._roots = None

    def reload(self) -> None:
        """Pick up the newest committed generation."""
        self.close()
        self._load()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------------

    @property
    def embedder(self) -> Embedder:
        """The embedder the index was built with (rebuilt from the manifest, loaded lazily)."""
        if self._embedder is None:
            from .embed import embedder_from_spec

            self._embedder = embedder_from_spec(self.manifest["embedder"])
        return self._embedder

    def search(self, query: str, k: int = 5, *, embedder: Embedder | None = None,
               hybrid: bool = False, lexical_weight: float = 0.5, fusion: str = "score",
               candidates: int | None = None) -> list[Hit]:
        """The ``k`` chunks that best match ``query``, best first.

        Dense by default: ``score`` is the cosine similarity. With ``hybrid=True`` the top
        ``candidates`` (default ``max(k, 50)``) of the dense search and of a BM25 search over the
        chunk texts are fused with :func:`fuse_scores` (``fusion``: ``"score"`` or ``"rrf"``,
        ``lexical_weight`` 0 = dense only), and ``score`` is the fused value on the dense
        candidates' cosine scale. Without FTS5 in this SQLite, hybrid search logs that once and
        returns the dense hits.

        >>> idx.search("who founded the guild?", k=5, hybrid=True)[0].score   # doctest: +SKIP
        """
        emb = embedder or self.embedder
        self._check_embedder(emb)
        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        if fusion not in FUSIONS:
            raise ConfigError(f"fusion must be one of {', '.join(FUSIONS)}; got {fusion!r}")
        if not 0.0 <= lexical_weight <= 1.0:
            raise ConfigError(f"lexical_weight must be in [0, 1]; got {lexical_weight}")
        vector = emb.embed_query(query)
        if not hybrid or lexical_weight == 0.0:
            return self.search_vector(vector, k)
        pool = max(k, candidates or 50)
        lexical = dict(self._lexical(query, pool))
        if not lexical:  # no FTS5, or no query word in any chunk: the dense search, unchanged
            return self.search_vector(vector, k)
        dense_hits = self.search_vector(vector, pool)
        dense = {h.chunk_id: h.score for h in dense_hits}
        missing = [i for i in lexical if i not in dense]
        # A chunk found only by BM25 still gets its real cosine (vectors are in the flat index),
        # so score fusion normalizes true similarities, not a guess.
        dense.update(self._cosines(vector, missing))
        fused = fuse_scores(dense, lexical, method=fusion, lexical_weight=lexical_weight)[:k]
        known = {h.chunk_id: h for h in dense_hits}
        need = [i for i, _ in fused if i not in known]
        known.update({h.chunk_id: h for h in self.get_chunks(need)})
        return [_with_score(known[i], s) for i, s in fused if i in known]

    def search_lexical(self, query: str, k: int = 5) -> list[Hit]:
        """The ``k`` chunks with the best BM25 score for ``query`` (``score`` = BM25, higher is
        better). Any text is safe: FTS5 syntax in it is matched as plain words
        (:func:`fts_match_query`). ``[]`` without FTS5 (logged once)."""
        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        pairs = self._lexical(query, k)
        by_id = {h.chunk_id: h for h in self.get_chunks([i for i, _ in pairs])}
        return [_with_score(by_id[i], s) for i, s in pairs if i in by_id]

    @property
    def has_lexical(self) -> bool:
        """Whether the generation in use stores an up-to-date FTS5 table (older indexes, and ones
        written by a Python without FTS5, do not)."""
        self._load()
        assert self._db is not None
        if not (self._manifest or {}).get("lexical"):
            return False
        with self._lock:
            return self._db.execute(
                "SELECT 1 FROM sqlite_master WHERE name='chunks_fts'").fetchone() is not None

    def _lexical(self, query: str, k: int) -> list[tuple[int, float]]:
        db = self._lexical_db()
        if db is None:
            return []
        with self._lock:
            return _bm25(db, query, k)

    def _lexical_db(self) -> sqlite3.Connection | None:
        self._load()
        with self._lock:
            if self._lex_db is None:
                if not fts5_available():
                    _warn_no_fts5()
                    self._lex_db = False
                elif self.has_lexical:
                    self._lex_db = self._db
                else:
                    self._lex_db = self._build_lexical_in_memory()
            return self._lex_db if isinstance(self._lex_db, sqlite3.Connection) else None

    def _build_lexical_in_memory(self) -> sqlite3.Connection:
        """BM25 for an index written before the FTS table: built from the chunk texts, kept for
        this session only (the generation files are immutable; the next writer run stores it)."""
        assert self._db is not None
        t = time.perf_counter()
        mem = sqlite3.connect(":memory:", check_same_thread=False)
        mem.execute(f"CREATE VIRTUAL TABLE chunks_fts USING fts5(text, tokenize='{FTS_TOKENIZE}')")
        n = 0
        cur = self._db.execute("SELECT id, text FROM chunks")
        while rows := cur.fetchmany(2048):
            mem.executemany("INSERT INTO chunks_fts(rowid, text) VALUES (?, ?)", rows)
            n += len(rows)
        log.warning(
            "the index in %s was built without the lexical (FTS5) table; built it in memory for "
            "this session (%d chunks, %.2fs). Re-run `ragbudget index` on the same folders to "
            "store it (nothing is re-embedded)", self.path, n, time.perf_counter() - t)
        return mem

    def _cosines(self, vector: Any, ids: Sequence[int]) -> dict[int, float]:
        import numpy as np

        if not ids:
            return {}
        q = np.asarray(vector, dtype=np.float32).reshape(-1)
        out = {}
        for i in ids:
            try:
                out[int(i)] = float(self._faiss.reconstruct(int(i)) @ q)
            except RuntimeError:  # no vector for this id (verify reports such an index)
                continue
        return out

    def _check_embedder(self, emb: Embedder) -> None:
        from .errors import IndexMismatchError

        want = self.manifest["embedder"]
        if emb.id != want.get("id"):
            raise IndexMismatchError(
                f"the index was built with embedder {want.get('id')!r}, the query would be embedded "
                f"with {emb.id!r}; search with the same embedder or rebuild the index"
            )

    def search_vector(self, vector: Any, k: int = 5) -> list[Hit]:
        """Search with a ready query vector (unit length, the index's dimension)."""
        import numpy as np

        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        self._load()
        q = np.ascontiguousarray(np.asarray(vector, dtype=np.float32).reshape(1, -1))
        d = int(self.manifest["dim"])
        if q.shape[1] != d:
            raise ConfigError(f"query vector has dimension {q.shape[1]}, the index has {d}")
        index = self._approx if self._approx is not None else self._faiss
        if self.search_threads:
            import faiss

            before = faiss.omp_get_max_threads()
            faiss.omp_set_num_threads(self.search_threads)
            try:
                scores, ids = index.search(q, k)
            finally:
                faiss.omp_set_num_threads(before)
        else:
            scores, ids = index.search(q, k)
        pairs = [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]
        by_id = {h.chunk_id: h for h in self.get_chunks([i for i, _ in pairs])}
        return [_with_score(by_id[i], s) for i, s in pairs if i in by_id]

    def get_chunks(self, ids: Iterable[int]) -> list[Hit]:
        """Chunks by id, in the order given (unknown ids are left out); ``score`` is 0."""
        ids = [int(i) for i in ids]
        if not ids:
            return []
        self._load()
        assert self._db is not None
        rows: list[tuple[Any, ...]] = []
        srcs: dict[int, list[Source]] = {}
        with self._lock:
            # SQLite caps bound parameters per statement; 900 stays under every build's limit.
            for lo in range(0, len(ids), 900):
                part = ids[lo : lo + 900]
                marks = ",".join("?" * len(part))
                rows += self._db.execute(
                    f"SELECT id, text, n_tokens, headings, windows FROM chunks WHERE id IN ({marks})",
                    part,
                ).fetchall()
                for cid, path, start, end, ps, pe in self._db.execute(
                    f'SELECT chunk_id, path, start, "end", page_start, page_end FROM sources '
                    f"WHERE chunk_id IN ({marks}) ORDER BY chunk_id, ord",
                    part,
                ):
                    srcs.setdefault(cid, []).append(Source(self._show(path), start, end, ps, pe))
        found = {
            r[0]: Hit(r[0], 0.0, r[1], r[2], tuple(json.loads(r[3])), tuple(srcs.get(r[0], ())), r[4])
            for r in rows
        }
        return [found[i] for i in ids if i in found]

    def chunks_of(self, path: str) -> list[tuple[Source, int]]:
        """Every ``(source, chunk_id)`` located in file ``path`` (a display path, as in
        ``Source.path``, or an absolute one), in document order."""
        self._load()
        assert self._db is not None and self._roots is not None
        stored = self._roots.absolute(str(path))
        if stored is None:
            return []
        with self._lock:
            rows = self._db.execute(
                'SELECT chunk_id, path, start, "end", page_start, page_end FROM sources '
                "WHERE path = ? ORDER BY start, \"end\"",
                (stored,),
            ).fetchall()
        return [(Source(self._show(p), s, e, ps, pe), cid) for cid, p, s, e, ps, pe in rows]

    def neighbors(self, chunk_id: int, *, path: str | None = None) -> tuple[Hit | None, Hit | None]:
        """The chunks just before and after ``chunk_id`` in the same document (its first source,
        or the source in ``path``); ``None`` at either end. Lets a selector merge adjacent chunks
        (compare ``Source.end``/``start`` to see whether they touch)."""
        hit = next(iter(self.get_chunks([chunk_id])), None)
        if hit is None or not hit.sources:
            return None, None
        assert self._roots is not None
        want = None if path is None else self._roots.absolute(str(path))
        src = next((s for s in hit.sources
                    if want is None or self._roots.absolute(s.path) == want), hit.sources[0])
        seq = self.chunks_of(src.path)
        pos = next(i for i, (s, c) in enumerate(seq) if c == chunk_id and s.start == src.start)
        prev = seq[pos - 1][1] if pos > 0 else None
        nxt = seq[pos + 1][1] if pos + 1 < len(seq) else None
        got = {h.chunk_id: h for h in self.get_chunks([i for i in (prev, nxt) if i is not None])}
        return (got.get(prev) if prev is not None else None, got.get(nxt) if nxt is not None else None)

    def stats(self) -> dict[str, Any]:
        """Counts and settings, from the manifest (no file is read beyond it)."""
        m = self.manifest
        return {
            "index_dir": str(self.path),
            "generation": m["generation"],
            "updated": m.get("updated"),
            "embedder": m["embedder"].get("id"),
            "dim": m["dim"],
            "pooling": m["embedder"].get("pooling"),
            "chunking": m.get("chunking"),
            "dedup": m.get("dedup"),
            "approx": (m.get("approx") or {}).get("kind"),
            "lexical": (m.get("lexical") or {}).get("kind"),
            "roots": [r.get("label") for r in m.get("roots") or ()],
            **m.get("counts", {}),
            "bytes": sum(int((m.get(k) or {}).get("bytes", 0)) for k in ("faiss", "sqlite", "approx")),
        }

    def verify(self) -> VerifyReport:
        """Check everything: checksums, FAISS ids ↔ chunk rows one-to-one, every chunk has a
        source, every source names an indexed file, counts match the manifest."""
        import faiss
        import numpy as np

        problems: list[str] = []
        checked: dict[str, Any] = {}
        try:
            m = self._read_manifest()
            self.close()
            self._manifest = m
            self._load()
        except (IndexCorruptError, IndexNotFoundError) as exc:
            return VerifyReport(False, (str(exc),), checked)
        assert self._db is not None
        db = self._db
        ids = faiss.vector_to_array(self._faiss.id_map).astype(np.int64)
        checked["vectors"] = int(self._faiss.ntotal)
        if len(ids) != len(np.unique(ids)):
            problems.append("a FAISS id appears more than once")
        chunk_ids = np.array([r[0] for r in db.execute("SELECT id FROM chunks")], dtype=np.int64)
        checked["chunks"] = len(chunk_ids)
        only_faiss = np.setdiff1d(ids, chunk_ids)
        only_db = np.setdiff1d(chunk_ids, ids)
        if len(only_faiss):
            problems.append(f"{len(only_faiss)} FAISS id(s) without a chunk row, e.g. {only_faiss[:5].tolist()}")
        if len(only_db):
            problems.append(f"{len(only_db)} chunk row(s) without a vector, e.g. {only_db[:5].tolist()}")
        if self._faiss.d != int(m["dim"]):
            problems.append(f"FAISS dimension {self._faiss.d} != manifest dim {m['dim']}")
        if self._approx is not None and self._approx.ntotal != self._faiss.ntotal:
            problems.append(f"approximate index has {self._approx.ntotal} vectors, flat has {self._faiss.ntotal}")
        orphans = db.execute(
            "SELECT COUNT(*) FROM chunks WHERE id NOT IN (SELECT chunk_id FROM sources)"
        ).fetchone()[0]
        if orphans:
            problems.append(f"{orphans} chunk(s) without any source")
        dangling = db.execute(
            "SELECT COUNT(*) FROM sources WHERE chunk_id NOT IN (SELECT id FROM chunks)"
        ).fetchone()[0]
        if dangling:
            problems.append(f"{dangling} source(s) pointing at no chunk")
        unknown = db.execute(
            "SELECT COUNT(*) FROM sources WHERE path NOT IN "
            "(SELECT path FROM files WHERE status='indexed')"
        ).fetchone()[0]
        if unknown:
            problems.append(f"{unknown} source(s) naming a file that is not indexed")
        checked["sources"] = db.execute("SELECT COUNT(*) FROM sources").fetchone()[0]
        checked["files"] = db.execute("SELECT COUNT(*) FROM files").fetchone()[0]
        counts = m.get("counts", {})
        if counts.get("chunks") not in (None, checked["chunks"]):
            problems.append(f"manifest counts {counts['chunks']} chunks, SQLite has {checked['chunks']}")
        if not fts5_available():
            checked["lexical_rows"] = "unchecked: no FTS5 in this SQLite"
        elif m.get("lexical") and db.execute(
                "SELECT 1 FROM sqlite_master WHERE name='chunks_fts'").fetchone():
            fts_ids = np.array([r[0] for r in db.execute("SELECT rowid FROM chunks_fts")],
                               dtype=np.int64)
            checked["lexical_rows"] = len(fts_ids)
            if len(fts_ids) != len(np.unique(fts_ids)):
                problems.append("a chunk id has more than one lexical (FTS) row")
            only_fts = np.setdiff1d(fts_ids, chunk_ids)
            no_fts = np.setdiff1d(chunk_ids, fts_ids)
            if len(only_fts):
                problems.append(f"{len(only_fts)} lexical (FTS) row(s) without a chunk row, "
                                f"e.g. {only_fts[:5].tolist()}")
            if len(no_fts):
                problems.append(f"{len(no_fts)} chunk(s) without a lexical (FTS) row, "
                                f"e.g. {no_fts[:5].tolist()}")
            stale = db.execute("SELECT COUNT(*) FROM chunks c JOIN chunks_fts f ON f.rowid = c.id "
                               "WHERE f.text != c.text").fetchone()[0]
            if stale:
                problems.append(f"{stale} lexical (FTS) row(s) whose text differs from the chunk")
        else:
            checked["lexical_rows"] = None  # an older index: built in memory on demand
        integrity = db.execute("PRAGMA quick_check").fetchone()[0]
        if integrity != "ok":
            problems.append(f"SQLite quick_check: {integrity}")
        checked["generation"] = m["generation"]
        return VerifyReport(not problems, tuple(problems), checked)

    # -- writing -------------------------------------------------------------------------------

    def build(
        self,
        paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
        *,
        embedder: Embedder | None = None,
        min_tokens: int = 300,
        max_tokens: int = 500,
        overlap: int = 0,
        tokenizer: Any = None,
        dedup: str = "near",
        near_threshold: float = 0.8,
        num_perm: int = 128,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        max_bytes: int | None = None,
        clean: bool = True,
        approx: str | None = None,
        rebuild: bool = False,
        prune: bool = False,
        allow_removal: bool = False,
        batch_files: int = 16,
        embed_batch: int = 256,
        progress: ProgressCallback | None = None,
    ) -> IndexSummary:
        """Index ``paths`` (files or folders), incrementally. Returns an :class:`IndexSummary`.

        A run **adds and updates**: new and changed files under ``paths`` are (re)indexed, files
        under other roots indexed earlier are kept, and only indexed files that vanished from
        under one of ``paths`` (a folder: anything below it; a file: that file) are removed.
        ``prune=True`` mirrors ``paths`` exactly: every indexed file not found under them now is
        removed. Every path must exist and be readable, else :class:`InputPathError` is raised
        before anything is written (a typo never empties an index). A run that would remove all
        indexed files, or more than :data:`REMOVAL_GUARD_FILES` files and more than
        :data:`REMOVAL_GUARD_SHARE` of them, raises :class:`ConfigError` and changes nothing,
        unless ``allow_removal`` or ``prune`` says the removal is meant. ``rebuild=True`` re-reads
        and re-embeds every file of every recorded root (and of ``paths``); with ``prune``, of
        ``paths`` only. Embedded batches are checkpointed, so a run that was killed resumes
        without embedding them again. ``dedup`` is ``"near"`` (content hash +
        MinHash at ``near_threshold``), ``"exact"`` or ``"none"``; ``approx="hnsw"`` also writes
        an HNSW index used by search. Settings that change the vectors or the chunks (embedder,
        chunking, dedup) trigger a full rebuild, reported in ``rebuild_reason``.
        Files stream through in batches of ``batch_files``; chunks are embedded ``embed_batch`` at a
        time, so memory grows with the batch, not the corpus — except for what every chunk keeps in
        memory during a build: its vector (4·dim bytes, 1.5 KB for MiniLM) and, with
        ``dedup="near"``, its MinHash signature in the LSH index (4·num_perm bytes + buckets).
        """
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if dedup not in ("near", "exact", "none"):
            raise ConfigError(f"dedup must be 'near', 'exact' or 'none', got {dedup!r}")
        if approx not in (None, "hnsw"):
            raise ConfigError(f"approx must be None or 'hnsw', got {approx!r}")
        if not 0 <= min_tokens <= max_tokens:
            raise ConfigError(
                f"need 0 <= min_tokens <= max_tokens, got min_tokens={min_tokens}, "
                f"max_tokens={max_tokens}; lower min_tokens or raise max_tokens")
        from .tokens import get_tokenizer

        tok = get_tokenizer(tokenizer)
        settings = {
            "chunking": {"min_tokens": min_tokens, "max_tokens": max_tokens, "overlap": overlap,
                         "tokenizer": tok.name},
            "dedup": {"mode": dedup, "threshold": near_threshold if dedup == "near" else None,
                      "num_perm": num_perm if dedup == "near" else None},
        }
        given = [os.fspath(p) for p in paths]
        roots = _check_roots(given, self.path)  # before the folder or the lock file is created
        self.path.mkdir(parents=True, exist_ok=True)
        with _Lock(self.path):
            self.close()
            builder = _Builder(
                self, given, embedder=embedder, tokenizer=tok, settings=settings,
                include=include, exclude=exclude, max_bytes=max_bytes, clean=clean, approx=approx,
                rebuild=rebuild, batch_files=max(1, batch_files), embed_batch=max(1, embed_batch),
                progress=progress, roots=roots, prune=prune, allow_removal=allow_removal,
            )
            try:
                return builder.run()
            finally:
                builder.cleanup()
                self.close()

    update = build


def _no_progress(phase: str, done: int, total: int | None = None) -> None:
    """Default progress callback: nothing to report to."""


def _with_score(hit: Hit, score: float) -> Hit:
    return Hit(hit.chunk_id, score, hit.text, hit.n_tokens, hit.headings, hit.sources, hit.windows)


# --------------------------------------------------------------------------------------------------
# the writer


_EMBEDDER_IDENTITY = ("kind", "id", "pooling", "max_tokens", "window_overlap")


def _identity(spec: dict[str, Any]) -> dict[str, Any]:
    # Compared without loading the model: a re-run on an unchanged corpus must cost a stat per file.
    return {k: spec.get(k) for k in _EMBEDDER_IDENTITY if k != "max_tokens" or spec.get("kind") == "hash"}


def _light_spec(emb: Embedder) -> dict[str, Any]:
    from .embed import HashEmbedder, SentenceTransformerEmbedder

    if isinstance(emb, SentenceTransformerEmbedder):
        return {"kind": "sentence-transformers", "id": emb.id, "model": emb.model_name,
                "pooling": emb.pooling, "window_overlap": emb.window_overlap}
    if isinstance(emb, HashEmbedder):
        return emb.spec()
    return {"kind": "custom", "id": emb.id, "pooling": getattr(emb, "pooling", None)}


class _Checkpoint:
    """Vectors embedded by the run in progress, kept across a kill so a re-run resumes.

    ``embed.checkpoint`` in the index folder: a header (magic, length, JSON: embedder identity and
    dimension), then fixed-size records ``sha256(text) | windows (u32) | vector (dim × f32) |
    crc32``, appended and fsync'ed once per embedded batch. Loading keeps the records up to the
    first torn or damaged one; a file written for another embedder is deleted. The writer removes
    it once its vectors are committed (or when a run had nothing to commit). Keyed by the text
    itself, so it holds whatever chunking, dedup or file order the re-run has.
    """

    MAGIC = b"RBEMBCK1"

    def __init__(self, folder: Path, identity: dict[str, Any]) -> None:
        self.path = folder / CHECKPOINT
        self.identity = json.loads(json.dumps(identity))  # as it reads back from JSON
        self.vectors: dict[bytes, tuple[Any, int]] = {}
        self.dim: int | None = None
        self.valid_bytes = 0
        self.fd: int | None = None
        self._load()

    @staticmethod
    def key(text: str) -> bytes:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()

    def _record_size(self) -> int:
        assert self.dim is not None
        return 32 + 4 + 4 * self.dim + 4

    def _load(self) -> None:
        import numpy as np

        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("ignoring the embedding checkpoint %s: %s", self.path, exc)
            return
        try:
            if not data.startswith(self.MAGIC):
                raise ValueError("not a checkpoint")
            (n,) = struct.unpack_from("<I", data, len(self.MAGIC))
            start = len(self.MAGIC) + 4
            header = json.loads(data[start : start + n])
            pos = start + n
        except (ValueError, struct.error) as exc:
            log.warning("removing an unreadable embedding checkpoint %s (%s)", self.path, exc)
            self._unlink()
            return
        if header.get("identity") != self.identity:
            log.info("removing the embedding checkpoint %s: written for another embedder", self.path)
            self._unlink()
            return
        self.dim = int(header["dim"])
        size = self._record_size()
        while pos + size <= len(data):
            rec = data[pos : pos + size]
            if zlib.crc32(rec[:-4]) != struct.unpack("<I", rec[-4:])[0]:
                break  # a torn or damaged tail: keep what came before
            (windows,) = struct.unpack_from("<I", rec, 32)
            self.vectors[rec[:32]] = (np.frombuffer(rec[36:-4], dtype="<f4").copy(), int(windows))
            pos += size
        self.valid_bytes = pos
        if self.vectors:
            log.info("resuming from %d embedded chunks checkpointed by an interrupted run",
                     len(self.vectors))

    def get(self, text: str) -> tuple[Any, int] | None:
        return self.vectors.get(self.key(text))

    def add(self, texts: Sequence[str], vectors: Any, windows: Sequence[int]) -> None:
        """Append one embedded batch and fsync it."""
        import numpy as np

        vecs = np.ascontiguousarray(vectors, dtype="<f4")
        if self.fd is None:
            if self.dim is not None and self.dim != vecs.shape[1]:
                self._unlink()
            if self.dim is None or self.valid_bytes == 0:
                self.dim = int(vecs.shape[1])
                header = json.dumps({"identity": self.identity, "dim": self.dim}).encode()
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.write(self.fd, self.MAGIC + struct.pack("<I", len(header)) + header)
            else:
                self.fd = os.open(self.path, os.O_WRONLY)
                os.ftruncate(self.fd, self.valid_bytes)  # drop a torn tail before appending
                os.lseek(self.fd, 0, os.SEEK_END)
        out = bytearray()
        for text, vec, w in zip(texts, vecs, windows):
            rec = self.key(text) + struct.pack("<I", int(w)) + vec.tobytes()
            out += rec + struct.pack("<I", zlib.crc32(rec))
        os.write(self.fd, bytes(out))
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def _unlink(self) -> None:
        self.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        self.vectors, self.dim, self.valid_bytes = {}, None, 0

    def remove(self) -> None:
        """The run committed (or had nothing to commit): the checkpoint is spent."""
        self._unlink()
        _fsync_dir(self.path.parent)


class _Builder:
    """One writer run. Holds the new generation's SQLite connection and FAISS index."""

    def __init__(self, idx: Index, paths: list[str], *, embedder: Embedder | None, tokenizer: Any,
                 settings: dict[str, Any], include: Any, exclude: Any, max_bytes: int | None,
                 clean: bool, approx: str | None, rebuild: bool, batch_files: int, embed_batch: int,
                 progress: ProgressCallback | None, roots: Sequence[tuple[str, str]] = (),
                 prune: bool = False, allow_removal: bool = False) -> None:
        self.idx = idx
        self.given = list(roots)
        self.prune = prune
        self.allow_removal = allow_removal
        self.roots: list[_Root] = []
        self.warnings: list[tuple[str, str]] = []
        self.old_indexed: set[str] = set()
        self.checkpoint: _Checkpoint | None = None
        self.dir = idx.path
        self.paths = paths
        self.embedder = embedder
        self.tok = tokenizer
        self.settings = settings
        self.include, self.exclude, self.max_bytes, self.clean = include, exclude, max_bytes, clean
        self.approx = approx
        self.rebuild = rebuild
        self.batch_files = batch_files
        self.embed_batch = embed_batch
        self.progress: ProgressCallback = progress or _no_progress
        self.t0 = time.perf_counter()
        self.stats: dict[str, Any] = {k: 0 for k in (
            "files_indexed", "files_unchanged", "files_removed", "chunks_added", "chunks_removed",
            "chunks_embedded", "chunks_reused", "exact_duplicates", "near_duplicates",
            "furniture_lines_removed", "windows_pooled", "windows_embedded", "files_added",
            "files_updated", "files_kept", "chunks_resumed")}
        self.embed_seconds = 0.0
        self.skipped: list[tuple[str, str, str]] = []
        self.db: sqlite3.Connection | None = None
        self.faiss: Any = None
        self.tmp_db: Path | None = None
        self.pending: list[tuple[int, str]] = []
        self.embed_total = 0
        self.near: Any = None
        self.sig_dtype: str | None = None
        self.reuse: tuple[sqlite3.Connection, Any] | None = None
        self.old: dict[str, Any] | None = None
        self.changed = False
        self.lexical = "unavailable"

    # -- setup ---------------------------------------------------------------------------------

    def cleanup(self) -> None:
        if self.db is not None:
            with contextlib.suppress(Exception):
                self.db.close()
        if self.reuse is not None:
            with contextlib.suppress(Exception):
                self.reuse[0].close()
        if self.checkpoint is not None:
            self.checkpoint.close()
        if self.tmp_db is not None and self.tmp_db.exists():
            self.tmp_db.unlink()

    def _clean_leftovers(self, keep: set[int]) -> None:
        """Remove temp files of crashed writers and generations older than the previous one."""
        for p in self.dir.iterdir():
            if p.name.endswith(".tmp") or p.name.endswith("-journal"):
                with contextlib.suppress(OSError):
                    p.unlink()
                continue
            mt = _GEN_FILE.match(p.name)
            if mt and int(mt.group(2)) not in keep:
                with contextlib.suppress(OSError):
                    p.unlink()

    def _resolve_embedder(self) -> tuple[Embedder, str]:
        """Pick the embedder and say why a full rebuild is needed (``""`` when not)."""
        from .embed import SentenceTransformerEmbedder, embedder_from_spec

        old = self.old
        if self.embedder is None:
            self.embedder = embedder_from_spec(old["embedder"]) if old else SentenceTransformerEmbedder()
        if old is None:
            return self.embedder, ""
        reasons = []
        if self.rebuild:
            reasons.append("rebuild requested")
        if int(old.get("format_version", 0)) != FORMAT_VERSION:
            reasons.append(f"index format {old.get('format_version')} -> {FORMAT_VERSION}")
        if _identity(old["embedder"]) != _identity(_light_spec(self.embedder)):
            reasons.append(f"embedder changed: {old['embedder'].get('id')} -> {self.embedder.id}"
                           f" (pooling {old['embedder'].get('pooling')} -> {self.embedder.pooling})")
        for key in ("chunking", "dedup"):
            if old.get(key) != self.settings[key]:
                reasons.append(f"{key} settings changed: {old.get(key)} -> {self.settings[key]}")
        return self.embedder, "; ".join(reasons)

    def _open_old(self) -> tuple[Any, Path | None, str]:
        """Load the current generation for copying; a damaged one means a rebuild."""
        try:
            self.old = self.idx._read_manifest()
        except IndexNotFoundError:
            return None, None, ""
        except IndexCorruptError as exc:
            return None, None, f"previous index unreadable: {exc}"
        try:
            flat, _, db = self.idx._open_generation(self.old)
            db.close()
        except IndexCorruptError as exc:
            self.old = None
            return None, None, f"previous index damaged: {exc}"
        return flat, self.dir / self.old["sqlite"]["file"], ""

    def run(self) -> IndexSummary:
        from .loaders import scan

        old_flat, old_db_path, damaged = self._open_old()
        gen = int(self.old["generation"]) + 1 if self.old else 1
        if not self.old and (self.dir / MANIFEST).exists():
            # Damaged manifest: continue after the highest generation number on disk.
            gens = [int(m.group(2)) for p in self.dir.iterdir() if (m := _GEN_FILE.match(p.name))]
            gen = max(gens, default=0) + 1
        self.gen = gen
        self._clean_leftovers(keep={gen - 1} if self.old else set())
        emb, reason = self._resolve_embedder()
        reason = reason or damaged
        self.rebuilt = bool(reason) or (self.rebuild and self.old is not None)
        self.reason = reason
        if self.old and not reason:
            self.sig_dtype = self.old.get("dedup_signature_dtype")

        self.tmp_db = self.dir / f"meta.{gen}.sqlite.tmp"
        if self.old and not reason:
            assert old_db_path is not None
            shutil.copyfile(old_db_path, self.tmp_db)
            self.faiss = old_flat
        else:
            if self.old and old_db_path is not None and old_flat is not None and (
                _identity(self.old["embedder"]) == _identity(_light_spec(emb))
            ):
                # Only chunking/dedup changed: old vectors are still valid for identical texts.
                rdb = sqlite3.connect(f"file:{old_db_path}?mode=ro&immutable=1", uri=True)
                self.reuse = (rdb, old_flat)
            self.faiss = None
        self.db = sqlite3.connect(self.tmp_db)
        self.db.executescript(_SCHEMA)
        have = {r[1] for r in self.db.execute("PRAGMA table_info(files)")}
        for col, decl in _FILES_ADDED_COLUMNS:
            if col not in have:
                self.db.execute(f"ALTER TABLE files ADD COLUMN {col} {decl}")
        # The temp copy is private until renamed: no journal needed; the rename commits it.
        self.db.execute("PRAGMA journal_mode=OFF")
        self.db.execute("PRAGMA synchronous=OFF")
        # A table the previous writer did not vouch for in its manifest may be stale: rebuild it.
        self.lexical = _ensure_fts(
            self.db, trusted=bool(self.old and not reason and self.old.get("lexical")))
        self.changed = bool(reason) or self.old is None
        if self.lexical == "created" and self.old is not None and not reason:
            # An index from before the FTS table: this run stores it even if no file changed.
            log.info("adding the lexical (FTS5) table to the index in %s", self.dir)
            self.changed = True
        self.checkpoint = _Checkpoint(self.dir, _identity(_light_spec(emb)))

        # -- 0. roots: what the index held before, and which part of it this run may remove.
        rebuilding = bool(reason)
        if rebuilding and old_db_path is not None:
            with contextlib.closing(sqlite3.connect(
                    f"file:{old_db_path}?mode=ro&immutable=1", uri=True)) as odb:
                before_roots = _read_roots(odb)
                before = {r[0]: r[1:] for r in odb.execute(
                    "SELECT path, size, mtime_ns, sha256, status, reason, detail FROM files")}
        else:
            before_roots = _read_roots(self.db)
            before = {r[0]: r[1:] for r in self.db.execute(
                "SELECT path, size, mtime_ns, sha256, status, reason, detail FROM files")}
        legacy = [p for p in before if not os.path.isabs(p)]
        if legacy:
            # Skipped entries of older versions were keyed by the path as typed (relative to
            # wherever that run started); they hold no chunks and are found again by a scan.
            self.db.executemany("DELETE FROM files WHERE path=?", [(p,) for p in legacy])
            before = {p: v for p, v in before.items() if os.path.isabs(p)}
            self.changed = True
        if not before_roots and before:
            fallback = _fallback_root(before)
            if fallback is not None:
                log.warning("the index in %s records no roots (written by an older ragbudget); "
                            "recording %s as the root of its files", self.dir, fallback.label)
                before_roots = [fallback]
        roots = list(before_roots)
        for real, kind in self.given:
            if not any(r.covers(real) for r in roots):
                roots.append(_Root(real, _new_label(real, {r.label for r in roots}), kind))
        self.roots = roots
        scope = [_Root(real, "", kind) for real, kind in self.given]
        scan_paths = list(self.paths)
        if rebuilding and not self.prune:
            # A rebuild re-reads every recorded root, not only the ones named this time.
            extra = [r for r in before_roots if not any(g.covers(r.path) for g in scope)]
            missing = [r for r in extra if not os.path.exists(r.path)]
            if missing:
                raise InputPathError(
                    f"a rebuild re-reads every root of the index, and {len(missing)} of them are "
                    f"missing: {', '.join(repr(r.label) for r in missing)} (its files are in the "
                    "index). Nothing was changed; restore them, or pass prune=True (--prune) to "
                    "rebuild from the given paths only",
                    paths=tuple(r.label for r in missing))
            extra.sort(key=lambda r: len(r.path))  # outer folders first: nested ones are walked once
            scan_paths += [r.path for r in extra]
            scope += extra

        shielded: list[_Root] = []  # folders the walk could not read: their files are kept

        def in_scope(path: str) -> bool:
            if any(r.covers(path) for r in shielded):
                return False
            return self.prune or any(r.covers(path) for r in scope)

        # -- 1. what changed: one stat per file, content sha256 only when the stat differs.
        scan_opts: dict[str, Any] = {"max_bytes": self.max_bytes} if self.max_bytes else {}
        found = scan(scan_paths, include=self.include, exclude=self.exclude, **scan_opts)
        shielded += [_Root(_canon(str(s.path)), "", "dir") for s in found.skipped
                     if s.reason in ("unreadable", "missing")]
        known = {} if rebuilding else before
        self.old_indexed = {p for p, v in before.items() if v[3] == "indexed"}
        seen: set[str] = set()
        self.n_seen = len(found.files) + len(found.skipped)
        for s in found.skipped:
            path, why, detail = _canon(str(s.path)), str(s.reason), str(getattr(s, "detail", "") or "")
            self.skipped.append((path, why, detail))
            seen.add(path)
            prev = known.get(path)
            if prev is None or prev[3] != "skipped" or prev[4] != why:
                if prev is not None and prev[3] == "indexed":
                    self._drop_sources(path)
                self._record_file(path, -1, -1, None, "skipped", why, detail)
                self.changed = True
        todo: list[tuple[str, int, int, str | None]] = []
        digest: str | None
        for f in found.files:
            path = str(f.path)
            seen.add(path)
            prev = known.get(path)
            if prev is not None and prev[0] == f.size and prev[1] == f.mtime_ns:
                self._unchanged(path, prev)
                continue
            if prev is not None and prev[0] == f.size:
                try:
                    digest = _sha256_file(Path(path))
                except OSError as exc:
                    self.skipped.append((path, "unreadable", str(exc)))
                    continue
                if digest == prev[2]:
                    # Touched but identical: record the new mtime, re-read nothing.
                    self.db.execute("UPDATE files SET mtime_ns=? WHERE path=?", (f.mtime_ns, path))
                    self.changed = True
                    self._unchanged(path, prev)
                    continue
                todo.append((path, f.size, f.mtime_ns, digest))
            else:
                todo.append((path, f.size, f.mtime_ns, None))
        found_paths = {str(f.path) for f in found.files}
        leaving = sorted(p for p in self.old_indexed if p not in found_paths and in_scope(p))
        self._guard_removal(leaving)
        self.stats["files_removed"] = len(leaving)
        self.stats["files_kept"] = sum(1 for p in self.old_indexed if not in_scope(p))
        gone = [p for p in known if p not in seen and in_scope(p)]
        for path in gone:
            self._drop_file(path)
        for path, *_ in todo:
            if path in known:
                self._drop_sources(path)
        if gone or todo:
            self.changed = True
        if {(r.path, r.label, r.kind) for r in self._final_roots()} != {
                (r.path, r.label, r.kind) for r in _read_roots(self.db)}:
            self.changed = True

        # -- 2. load, clean, chunk, dedup, embed; files stream in batches.
        # Corpus boilerplate (a navigation line on every HTML page, a licence footer on every
        # note) is learned from the documents loaded in this run, batch after batch. Documents
        # indexed in earlier runs are not re-stripped when a pattern first appears later.
        from .loaders import BoilerplateFilter

        corpus = BoilerplateFilter() if self.clean else None
        self.progress("files", 0, len(todo))
        for start in range(0, len(todo), self.batch_files):
            loaded = []
            for path, size, mtime_ns, digest in todo[start : start + self.batch_files]:
                doc, digest = self._load_file(path, size, mtime_ns, digest)
                if doc is not None:
                    loaded.append((doc, path, size, mtime_ns, digest))
            if corpus is not None:
                corpus.observe(doc for doc, *_ in loaded)
            for doc, *facts in loaded:
                self._index_doc(corpus.strip(doc) if corpus else doc, *facts)
            self.progress("files", min(start + self.batch_files, len(todo)), len(todo))
            if len(self.pending) >= self.embed_batch:
                self._flush()
        self._flush()

        if not self.changed:
            # Nothing to commit: no new generation, the current one stays.
            self.checkpoint.remove()
            return self._summary(committed=False)

        # -- 3. chunks left without any source disappear, from SQLite and FAISS alike.
        orphans = [r[0] for r in self.db.execute(
            "SELECT id FROM chunks WHERE id NOT IN (SELECT chunk_id FROM sources)")]
        if orphans:
            import numpy as np

            self.db.executemany("DELETE FROM chunks WHERE id=?", [(i,) for i in orphans])
            if self.faiss is not None:
                self.faiss.remove_ids(np.array(orphans, dtype=np.int64))
            self.stats["chunks_removed"] += len(orphans)
        self.roots = self._final_roots()
        self.db.execute("DELETE FROM roots")
        self.db.executemany("INSERT INTO roots (path, label, kind) VALUES (?,?,?)",
                            [(r.path, r.label, r.kind) for r in self.roots])
        self._commit()
        self.checkpoint.remove()  # after the commit point: its vectors are in the index now
        return self._summary(committed=True)

    def _final_roots(self) -> list[_Root]:
        """The roots to record: the ones given to this run, and earlier ones still holding a file."""
        assert self.db is not None
        given = {real for real, _ in self.given}
        paths = [r[0] for r in self.db.execute("SELECT path FROM files")]
        return [r for r in self.roots if r.path in given or any(r.covers(p) for p in paths)]

    def _guard_removal(self, leaving: list[str]) -> None:
        """Refuse (before anything is written) a run that would remove much of the index,
        unless the caller said removal is meant."""
        n, total = len(leaving), len(self.old_indexed)
        if not n or self.allow_removal or self.prune:
            return
        if n < total and (n <= REMOVAL_GUARD_FILES or n <= REMOVAL_GUARD_SHARE * total):
            return
        shown = _Roots(self.roots)
        examples = ", ".join(shown.display(p) for p in leaving[:3]) + (", ..." if n > 3 else "")
        what = "all" if n == total else f"{n} of the"
        raise ConfigError(
            f"this run would remove {what} {total} indexed file(s) ({examples}): they are no "
            "longer found under the given paths. Nothing was changed. If they were really "
            "deleted, run again with --allow-removal (allow_removal=True); check that the "
            "folder is the right one and is mounted"
        )

    def _unchanged(self, path: str, prev: tuple[Any, ...]) -> None:
        if prev[3] == "indexed":
            self.stats["files_unchanged"] += 1
        else:
            self.skipped.append((path, prev[4] or "skipped", prev[5] or ""))

    # -- per file ------------------------------------------------------------------------------

    def _drop_sources(self, path: str) -> None:
        assert self.db is not None
        self.db.execute("DELETE FROM sources WHERE path=?", (path,))

    def _drop_file(self, path: str) -> None:
        assert self.db is not None
        self._drop_sources(path)
        self.db.execute("DELETE FROM files WHERE path=?", (path,))

    def _load_file(self, path: str, size: int, mtime_ns: int, digest: str | None) -> tuple[Document | None, str | None]:
        """Load one file (and hash it when not hashed yet), or record why it was skipped."""
        from .loaders import load_document

        try:
            if digest is None:
                digest = _sha256_file(Path(path))
            return load_document(path, clean=self.clean), digest
        except LoadError as exc:
            reason, detail = exc.reason, str(exc)
        except OSError as exc:
            reason, detail = "unreadable", str(exc)
        self._record_file(path, size, mtime_ns, digest, "skipped", reason, detail)
        self.skipped.append((path, reason, detail))
        return None, digest

    def _index_doc(self, doc: Document, path: str, size: int, mtime_ns: int, digest: str | None) -> None:
        from .chunking import chunk_document

        assert self.db is not None
        furniture = _count(doc.meta.get("furniture_removed", 0)) + _count(doc.meta.get("boilerplate_removed", 0))
        self.stats["furniture_lines_removed"] += furniture
        ch = self.settings["chunking"]
        chunks = chunk_document(doc, min_tokens=ch["min_tokens"], max_tokens=ch["max_tokens"],
                                overlap=ch["overlap"], tokenizer=self.tok)
        chunks = [c for c in chunks if c.text.strip()]
        mode = self.settings["dedup"]["mode"]
        # Hashes and signatures for a whole file at once: the batch functions vectorise.
        if mode == "none":
            hashes = [hashlib.sha256(c.text.encode()).hexdigest() for c in chunks]
        else:
            from .dedup import content_hashes

            hashes = content_hashes([c.text for c in chunks])
        sigs: Any = [None] * len(chunks)
        if mode == "near" and chunks:
            from .dedup import minhash_signatures

            sigs = minhash_signatures([c.text for c in chunks],
                                      num_perm=self.settings["dedup"]["num_perm"])
        for c, h, sig in zip(chunks, hashes, sigs):
            self._add_chunk(path, c, h, sig)
        warning = doc.meta.get("encoding_warning") or None
        if warning:
            self.warnings.append((path, str(warning)))
        pages = int(doc.meta.get("n_pages") or len(doc.pages)) if doc.paginated else None
        self._record_file(path, size, mtime_ns, digest, "indexed", None, None, len(chunks), furniture,
                          pages, warning)
        self.stats["files_indexed"] += 1
        self.stats["files_updated" if path in self.old_indexed else "files_added"] += 1

    def _record_file(self, path: str, size: int, mtime_ns: int, digest: str | None, status: str,
                     reason: str | None, detail: str | None, n_chunks: int = 0,
                     furniture: int = 0, pages: int | None = None, warning: str | None = None) -> None:
        assert self.db is not None
        self.db.execute(
            "INSERT OR REPLACE INTO files (path, size, mtime_ns, sha256, status, reason, detail, "
            "n_chunks, furniture, n_pages, warning) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (path, size, mtime_ns, digest, status, reason, detail, n_chunks, furniture, pages,
             warning),
        )

    def _near_index(self) -> Any:
        """MinHash LSH over the chunks that still have a source, built from stored signatures."""
        if self.near is None:
            import numpy as np

            from .dedup import NearDupIndex

            d = self.settings["dedup"]
            self.near = NearDupIndex(threshold=d["threshold"], num_perm=d["num_perm"])
            dtype = self.sig_dtype
            assert self.db is not None
            for cid, blob in self.db.execute(
                "SELECT id, minhash FROM chunks WHERE minhash IS NOT NULL AND id IN "
                "(SELECT chunk_id FROM sources)"
            ):
                if dtype:
                    self.near.insert(cid, np.frombuffer(blob, dtype=dtype))
        return self.near

    def _add_chunk(self, path: str, c: Any, h: str, sig: Any) -> None:
        assert self.db is not None
        mode = self.settings["dedup"]["mode"]
        src = (path, c.start, c.end, c.page_start, c.page_end)
        row = self.db.execute("SELECT id FROM chunks WHERE content_hash=? LIMIT 1", (h,)).fetchone()
        if row is not None:
            has_src = self.db.execute("SELECT 1 FROM sources WHERE chunk_id=? LIMIT 1",
                                      (row[0],)).fetchone()
            if has_src:
                self.stats["exact_duplicates"] += 1
            else:
                # An orphan of a changed file, same text again: revive it, no re-embedding.
                self.stats["chunks_reused"] += 1
                self.db.execute("UPDATE chunks SET headings=? WHERE id=?",
                                (json.dumps(list(c.headings)), row[0]))
                if mode == "near":
                    sig_row = self.db.execute("SELECT minhash FROM chunks WHERE id=?", (row[0],)).fetchone()
                    if sig_row[0] is not None and self.sig_dtype:
                        import numpy as np

                        self._near_index().insert(row[0], np.frombuffer(sig_row[0], dtype=self.sig_dtype))
            self._add_source(row[0], src)
            return
        if sig is not None:
            self.sig_dtype = str(sig.dtype)
            match = self._near_index().query(sig)
            if match:
                # Most similar first (ties: earliest inserted), so the pick is deterministic.
                self.stats["near_duplicates"] += 1
                self._add_source(int(match[0]), src)
                return
        cur = self.db.execute(
            "INSERT INTO chunks (text, n_tokens, headings, content_hash, minhash, windows) "
            "VALUES (?,?,?,?,?,0)",
            (c.text, int(c.n_tokens), json.dumps(list(c.headings)), h,
             sig.tobytes() if sig is not None else None),
        )
        assert cur.lastrowid is not None
        cid = int(cur.lastrowid)
        if sig is not None:
            self._near_index().insert(cid, sig)
        self._add_source(cid, src)
        self.stats["chunks_added"] += 1
        self.pending.append((cid, c.text))
        self.embed_total += 1
        if len(self.pending) >= self.embed_batch:
            self._flush()

    def _add_source(self, cid: int, src: tuple[Any, ...]) -> None:
        assert self.db is not None
        n = self.db.execute("SELECT COALESCE(MAX(ord), -1) + 1 FROM sources WHERE chunk_id=?",
                            (cid,)).fetchone()[0]
        self.db.execute(
            'INSERT INTO sources (chunk_id, path, start, "end", page_start, page_end, ord) '
            "VALUES (?,?,?,?,?,?,?)", (cid, *src, n))

    # -- vectors -------------------------------------------------------------------------------

    def _ensure_faiss(self, dim: int) -> None:
        if self.faiss is None:
            import faiss

            self.faiss = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))

    def _flush(self) -> None:
        if not self.pending:
            return
        import numpy as np

        assert self.db is not None
        batch, self.pending = self.pending, []
        ids = np.array([i for i, _ in batch], dtype=np.int64)
        vecs: np.ndarray | None = None
        windows = [1] * len(batch)
        todo = list(range(len(batch)))
        if self.reuse is not None:
            vecs, todo = self._reuse_vectors(batch, windows)
        if todo and self.checkpoint is not None and self.checkpoint.vectors:
            left = []
            for j in todo:
                got = self.checkpoint.get(batch[j][1])
                if got is None or (vecs is not None and got[0].shape[0] != vecs.shape[1]):
                    left.append(j)
                    continue
                if vecs is None:
                    vecs = np.zeros((len(batch), got[0].shape[0]), dtype=np.float32)
                vecs[j], windows[j] = got
                self.stats["chunks_reused"] += 1
                self.stats["chunks_resumed"] += 1
            todo = left
        if todo:
            emb = self.embedder
            assert emb is not None
            t = time.perf_counter()
            res = emb.embed([batch[i][1] for i in todo])
            self.embed_seconds += time.perf_counter() - t
            if vecs is None:
                vecs = np.zeros((len(batch), res.vectors.shape[1]), dtype=np.float32)
            vecs[todo] = res.vectors
            for j, w in zip(todo, res.windows):
                windows[j] = w
            if self.checkpoint is not None:
                self.checkpoint.add([batch[j][1] for j in todo], res.vectors, res.windows)
            self.stats["chunks_embedded"] += len(todo)
            self.stats["windows_pooled"] += res.pooled
            self.stats["windows_embedded"] += res.texts_fed
        assert vecs is not None
        vecs = np.ascontiguousarray(vecs, dtype=np.float32)
        self._ensure_faiss(vecs.shape[1])
        if self.faiss.d != vecs.shape[1]:
            raise ConfigError(
                f"embedder {self.embedder and self.embedder.id!r} gives {vecs.shape[1]}-d vectors, "
                f"the index holds {self.faiss.d}-d; rebuild with --rebuild"
            )
        self.faiss.add_with_ids(vecs, ids)
        self.db.executemany("UPDATE chunks SET windows=? WHERE id=?",
                            [(w, int(i)) for w, i in zip(windows, ids)])
        self.progress("embed", self.stats["chunks_embedded"] + self.stats["chunks_reused"],
                      self.embed_total)

    def _reuse_vectors(self, batch: list[tuple[int, str]], windows: list[int]) -> tuple[Any, list[int]]:
        import numpy as np

        from .dedup import content_hash

        rdb, old_flat = self.reuse  # type: ignore[misc]
        vecs = np.zeros((len(batch), old_flat.d), dtype=np.float32)
        todo = []
        for j, (_, text) in enumerate(batch):
            row = rdb.execute("SELECT id, windows FROM chunks WHERE content_hash=? LIMIT 1",
                              (content_hash(text),)).fetchone()
            if row is None:
                todo.append(j)
                continue
            try:
                vecs[j] = old_flat.reconstruct(int(row[0]))
                windows[j] = int(row[1])
                self.stats["chunks_reused"] += 1
            except RuntimeError:
                todo.append(j)
        return vecs, todo

    # -- commit --------------------------------------------------------------------------------

    def _commit(self) -> None:
        import faiss

        assert self.db is not None and self.tmp_db is not None
        gen = self.gen
        emb = self.embedder
        assert emb is not None
        if self.faiss is None:  # nothing was ever embedded: an empty index still needs its dim
            self._ensure_faiss(emb.dim)
        self.progress("write", 0, 3)
        self.db.execute("INSERT OR REPLACE INTO meta VALUES ('generation', ?)", (str(gen),))
        self.db.commit()
        counts = {
            "chunks": self.db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0],
            "sources": self.db.execute("SELECT COUNT(*) FROM sources").fetchone()[0],
            "files": self.db.execute(
                "SELECT COUNT(*) FROM files WHERE status='indexed'").fetchone()[0],
            "files_skipped": self.db.execute(
                "SELECT COUNT(*) FROM files WHERE status!='indexed'").fetchone()[0],
            "vectors": int(self.faiss.ntotal),
            "windowed_chunks": self.db.execute(
                "SELECT COUNT(*) FROM chunks WHERE windows>1").fetchone()[0],
        }
        if self.lexical != "unavailable":
            counts["lexical_rows"] = self.db.execute("SELECT COUNT(*) FROM chunks_fts").fetchone()[0]
        self.counts = counts
        self.db.close()
        self.db = None
        _fsync_file(self.tmp_db)
        spath = self.dir / f"meta.{gen}.sqlite"
        os.replace(self.tmp_db, spath)
        self.tmp_db = None
        self.progress("write", 1, 3)

        fpath = self.dir / f"faiss.{gen}.index"
        ftmp = fpath.with_name(fpath.name + ".tmp")
        faiss.write_index(self.faiss, str(ftmp))
        _fsync_file(ftmp)
        os.replace(ftmp, fpath)
        approx_entry = None
        if self.approx == "hnsw":
            approx_entry = self._write_hnsw(gen)
        self.progress("write", 2, 3)

        # Asking a model-backed embedder for its full spec loads the model: skip that when this
        # run embedded nothing (a touched file, a deletion) and the old spec still holds.
        if self.old is not None and not self.rebuilt and not self.stats["chunks_embedded"]:
            spec = self.old["embedder"]
        else:
            spec = emb.spec()
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        manifest = {
            "format": "ragbudget-index",
            "format_version": FORMAT_VERSION,
            "generation": gen,
            "created": (self.old or {}).get("created", now) if not self.rebuilt else now,
            "updated": now,
            "embedder": spec,
            "dim": int(self.faiss.d),
            "pooling": spec.get("pooling"),
            "chunking": self.settings["chunking"],
            "dedup": self.settings["dedup"],
            "dedup_signature_dtype": self.sig_dtype,
            "faiss": {"kind": "IndexIDMap2(IndexFlatIP)", "file": fpath.name,
                      "bytes": fpath.stat().st_size, "sha256": _sha256_file(fpath)},
            "approx": approx_entry,
            "lexical": ({"kind": "sqlite-fts5", "table": "chunks_fts", "tokenize": FTS_TOKENIZE}
                        if self.lexical != "unavailable" else None),
            "sqlite": {"file": spath.name, "bytes": spath.stat().st_size,
                       "sha256": _sha256_file(spath)},
            "counts": counts,
            "roots": [{"label": r.label, "kind": r.kind} for r in sorted(self.roots, key=lambda r: r.label)],
            "last_run": self._summary(committed=True).to_dict(),
        }
        _fsync_dir(self.dir)
        _write_json_atomic(self.dir / MANIFEST, manifest)  # the commit point
        self.progress("write", 3, 3)
        self._clean_leftovers(keep={gen, gen - 1})

    def _write_hnsw(self, gen: int) -> dict[str, Any]:
        import faiss

        n, d = int(self.faiss.ntotal), int(self.faiss.d)
        ids = faiss.vector_to_array(self.faiss.id_map)
        m, ef_c, ef_s = 32, 80, 128
        hnsw = faiss.IndexHNSWFlat(d, m, faiss.METRIC_INNER_PRODUCT)
        hnsw.hnsw.efConstruction = ef_c
        wrapped = faiss.IndexIDMap(hnsw)
        if n:  # the flat index stores vectors in id_map order
            wrapped.add_with_ids(self.faiss.index.reconstruct_n(0, n), ids)
        path = self.dir / f"hnsw.{gen}.index"
        tmp = path.with_name(path.name + ".tmp")
        faiss.write_index(wrapped, str(tmp))
        _fsync_file(tmp)
        os.replace(tmp, path)
        return {"kind": "hnsw", "file": path.name, "bytes": path.stat().st_size,
                "sha256": _sha256_file(path), "M": m, "ef_construction": ef_c, "ef_search": ef_s}

    def _summary(self, *, committed: bool) -> IndexSummary:
        if committed and hasattr(self, "counts"):
            total = self.counts["chunks"]
        else:
            total = self._count_chunks()
        shown = _Roots(self.roots)
        return IndexSummary(
            files_seen=getattr(self, "n_seen", 0),
            skipped=tuple((shown.display(p), r, shown.scrub(d) or "") for p, r, d in self.skipped),
            warnings=tuple((shown.display(p), m) for p, m in self.warnings),
            chunks_total=total,
            seconds=time.perf_counter() - self.t0,
            embed_seconds=self.embed_seconds,
            rebuilt=self.rebuilt,
            rebuild_reason=self.reason,
            generation=self.gen if committed else self.gen - 1,
            committed=committed,
            **self.stats,
        )

    def _count_chunks(self) -> int:
        if self.db is not None:
            return int(self.db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0])
        return 0

