"""The on-disk index: FAISS vectors + SQLite metadata + a JSON manifest, crash-safe and incremental.

One job: the on-disk index as one object — its layout, roots and lock, opening a generation,
verifying and searching it (dense, lexical, fused); the writing run itself is :mod:`ragbudget.retrieval.build`.

Layout of an index folder (default ``.ragbudget/``)::

    manifest.json          names the current generation, settings, counts and sha256 checksums
    faiss.<gen>.index      exact inner-product index (IndexFlatIP in IndexIDMap2), ids = chunk ids
    <store>.<gen>.index    the search store when it is not the exact one: ``hnsw``, ``ivf-flat`` or
                           ``ivf-pq``, derived from the same vectors (:mod:`ragbudget.retrieval.vectors`;
                           ``store="auto"`` picks by size and records the recall it measured)
    meta.<gen>.sqlite      chunks, sources (every duplicate location), files (drives incremental runs),
                           roots (the paths given to build, with their display labels),
                           chunks_fts: an FTS5 (BM25) table over the chunk texts, kept in sync with
                           ``chunks`` by triggers, so it is written by the same atomic generation;
                           sentence_vectors: each chunk's sentences embedded (float16, one row per
                           chunk, keyed by sentence digest) for span packing, removed with their
                           chunk by a trigger (rows only with ``sentence_vectors=True``)
    lock                   flock'ed by the one writer
    embed.checkpoint       vectors embedded by an unfinished run (only while one is, or was killed)
    cache/sentences.sqlite sentence vectors embedded at question time, for later questions: not part
                           of a generation, safe to delete (:mod:`ragbudget.retrieval.sentence_cache`)

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
dropped. Changed embedder, chunking, dedup or cleaning settings trigger a full rebuild (vectors are
still reused by content hash when only those settings changed); a run not given a setting keeps the
recorded one, and one changing chunking, dedup or cleaning needs ``rechunk=True``
(:mod:`ragbudget.retrieval.index_settings`).

**Hybrid search.** ``search(..., hybrid=True)`` fuses the dense FAISS candidates with BM25 candidates
from the FTS5 table (normalized score fusion by default, or reciprocal rank fusion). An index built
before the table existed still opens: the table is built in memory on first lexical use (logged),
and the next ``build``/``update`` stores it. A Python whose SQLite lacks FTS5 logs that once and
searches dense only.

>>> from ragbudget.retrieval.embed import HashEmbedder
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
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import (
    ConfigError,
    IndexCorruptError,
    IndexLockedError,
    IndexNotFoundError,
    InputPathError,
)
from ..settings import DEDUP_MODES, ChunkSettings, DedupSettings, RetrievalSettings, from_keywords
from ..types import DEFAULT_INDEX_DIR, Hit, IndexedFile, IndexSummary, Source, VerifyReport
from .lexical import (
    FTS_TOKENIZE,
    FUSIONS,
    _bm25,
    _fuse,
    _warn_no_fts5,
    fts5_available,
    fts_match_query,
    fuse_scores,
)
from .vectors import FlatStore

if TYPE_CHECKING:
    from typing_extensions import Self

    from .embed import Embedder
    from .executors import EmbedExecutor

__all__ = [
    "DEDUP_MODES",
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

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LOCK = "lock"
_GEN_FILE = re.compile(r"^(faiss|hnsw|ivf-flat|ivf-pq|meta)\.(\d+)\.(index|sqlite)$")

#: ``progress(phase, done, total)``: phases ``"files"`` (files to (re)index) then ``"embed"``
#: (chunks embedded; ``total`` grows as files are chunked), ``"sentences"`` (chunks whose sentence
#: vectors are embedded, for span packing; only when some lack them), then ``"write"``.
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
    warning TEXT,
    page_labels TEXT,
    needs TEXT
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sentence_vectors (
    chunk_id INTEGER PRIMARY KEY,
    digests BLOB NOT NULL,
    vectors BLOB NOT NULL
);
CREATE TRIGGER IF NOT EXISTS chunks_sentences_ad AFTER DELETE ON chunks BEGIN
    DELETE FROM sentence_vectors WHERE chunk_id = old.id;
END;
CREATE TABLE IF NOT EXISTS roots (
    path TEXT PRIMARY KEY,
    label TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL
);
"""
# Columns added to ``files`` after its first format: an older index gains them on its next write.
# page_labels: JSON list naming each page in the format's unit ("slide 3"), or NULL. needs: what a
# file skipped for a missing dependency lacked (LoadError.needs), so a later run retries it once
# that is installed, even with the file unchanged.
_FILES_ADDED_COLUMNS = (("n_pages", "INTEGER"), ("warning", "TEXT"), ("page_labels", "TEXT"), ("needs", "TEXT"))

#: The removal guard: without ``allow_removal`` (``--allow-removal``) or ``prune``, a run may
#: remove at most ``REMOVAL_GUARD_FILES`` indexed files, or more only while they are at most
#: ``REMOVAL_GUARD_SHARE`` of the indexed files, and never all of them. Deleting a few notes is
#: everyday editing; a fifth of the corpus gone at once is far more often an unmounted drive, an
#: emptied or wrong folder than a real clean-up, and costs a full re-embed to undo.
REMOVAL_GUARD_FILES = 5
REMOVAL_GUARD_SHARE = 0.2

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
    naming each one that is missing, unreadable, not a file or folder, or the index's own folder
    (or inside it) (before anything is written)."""
    good: list[tuple[str, str]] = []
    bad: list[tuple[str, str]] = []
    own = os.path.realpath(index_dir)
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
        real = os.path.realpath(p)
        if _under(real, own):
            bad.append(
                (
                    p,
                    "it is the index's own folder or inside it (an index never reads its own "
                    "files; use another --index-dir)",
                )
            )
            continue
        good.append((real, kind))
    if bad:
        what = "; ".join(f"{p!r}: {why}" for p, why in bad)
        state = (
            f"the index in {index_dir} is unchanged"
            if (index_dir / MANIFEST).exists()
            else f"no index was created in {index_dir}"
        )
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
    ``__init__``); ``use_approx=False`` searches the exact store even when the index has an approximate one.
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

    def __init__(
        self,
        path: str | os.PathLike[str] = DEFAULT_INDEX_DIR,
        *,
        verify_checksums: bool = True,
        use_approx: bool = True,
        search_threads: int | None = 1,
        absolute_paths: bool = False,
    ) -> None:
        self.path = Path(path)
        self.absolute_paths = absolute_paths
        self._roots: _Roots | None = None
        self._page_labels: dict[str, list[str]] | None = None
        self.verify_checksums = verify_checksums
        self.use_approx = use_approx
        # One query is memory-bound: extra OpenMP threads barely help, and on busy cores their
        # spin-waits made a 20k-vector flat search 10x slower (82 ms vs 7 ms measured on 2 cores).
        # None leaves FAISS's global thread setting alone.
        self.search_threads = search_threads
        self._manifest: dict[str, Any] | None = None
        self._flat: FlatStore | None = None  # the exact store: truth, rescoring, verify
        self._search: Any = None  # the store that answers queries (the flat one by default)
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
                f"index manifest {mpath} is unreadable ({exc}); rebuild the index with `ragbudget index PATH --rebuild`"
            ) from exc
        if int(data.get("format_version", 0)) > FORMAT_VERSION:
            raise IndexCorruptError(
                f"{mpath} has format version {data.get('format_version')}, this ragbudget reads "
                f"up to {FORMAT_VERSION}; upgrade ragbudget or rebuild the index"
            )
        self._manifest = data
        return data

    def _check_file(self, entry: dict[str, Any]) -> Path:
        p: Path = self.path / str(entry["file"])
        if not p.is_file():
            raise IndexCorruptError(f"index file {p} is missing; rebuild the index")
        size = p.stat().st_size
        if size != int(entry.get("bytes", size)):
            raise IndexCorruptError(
                f"index file {p} is {size} bytes, the manifest says {entry['bytes']} "
                "(truncated or overwritten); rebuild the index"
            )
        if self.verify_checksums and _sha256_file(p) != entry["sha256"]:
            raise IndexCorruptError(f"index file {p} fails its sha256 checksum (corrupted); rebuild the index")
        return p

    def _load(self) -> None:
        """Load the manifest-named generation into memory (retrying if a writer just swapped it)."""
        if self._flat is not None:
            return
        with self._lock:
            if self._flat is not None:
                return
            for attempt in range(3):
                m = self._read_manifest()
                try:
                    self._flat, approx, self._db = self._open_generation(m)
                    self._search = approx if approx is not None else self._flat
                    self._roots = self._load_roots(self._db)
                    self._page_labels = None
                    return
                except IndexCorruptError:
                    # The writer may have committed a newer generation and removed this one
                    # between our manifest read and the file opens; re-read once or twice.
                    if attempt == 2 or self._read_manifest().get("generation") == m["generation"]:
                        raise

    def _open_generation(
        self, m: dict[str, Any], *, writable: bool = False
    ) -> tuple[FlatStore, Any, sqlite3.Connection]:
        """The exact store, the search store (``None``: the exact one searches) and the SQLite
        handle of generation ``m``. ``writable``: for a writer, which edits the exact store and
        derives its own search store (not loaded); a reader with a search store maps the exact
        matrix read-only instead of loading it (rescoring touches a few rows per query)."""
        from .vectors import FlatStore, load_store

        fpath = self._check_file(m["faiss"])
        spath = self._check_file(m["sqlite"])
        want_approx = not writable and self.use_approx and bool(m.get("approx"))
        flat = FlatStore.load(fpath, m["faiss"], mmap=want_approx)
        approx = None
        if want_approx:
            approx = load_store(self._check_file(m["approx"]), m["approx"], exact=flat)
        # immutable=1: generation files never change after commit, so SQLite needs no locks.
        try:
            db = sqlite3.connect(f"file:{spath}?mode=ro&immutable=1", uri=True, check_same_thread=False)
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
                    "run records the roots",
                    self.path,
                    fallback.label,
                )
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
            extra = ", ".join(c if c in cols else "NULL" for c in ("n_pages", "warning"))
            rows = self._db.execute(
                f"SELECT path, status, n_chunks, size, reason, detail, {extra} FROM files"
            ).fetchall()
        scrub = (lambda t: t) if self.absolute_paths else self._roots.scrub  # type: ignore[union-attr]
        out = [
            IndexedFile(
                self._show(p), st_, int(n or 0), pages, size if size >= 0 else None, reason, scrub(detail), warning
            )
            for p, st_, n, size, reason, detail, pages, warning in rows
        ]
        return sorted(out, key=lambda f: f.path)

    def close(self) -> None:
        """Release the in-memory index and the SQLite handle (reopened on next use)."""
        with self._lock:
            if isinstance(self._lex_db, sqlite3.Connection) and self._lex_db is not self._db:
                self._lex_db.close()
            self._lex_db = None
            if self._db is not None:
                self._db.close()
            self._db = self._flat = self._search = None
            self._manifest = None
            self._roots = None
            self._page_labels = None

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

    def search(
        self,
        query: str,
        k: int = 5,
        *,
        embedder: Embedder | None = None,
        retrieval: RetrievalSettings | None = None,
        hybrid: bool | None = None,
        lexical_weight: float | None = None,
        fusion: str | None = None,
        candidates: int | None = None,
        query_vector: Any = None,
    ) -> list[Hit]:
        """The ``k`` chunks that best match ``query``, best first.

        Dense by default: ``score`` is the cosine similarity. With ``hybrid=True`` the top
        ``candidates`` (default ``fetch_k``, 50) of the dense search and of a BM25 search over the
        chunk texts are fused with :func:`fuse_scores` (``fusion``: ``"score"`` or ``"rrf"``,
        ``lexical_weight`` 0 = dense only), and ``score`` is the fused value on the dense
        candidates' cosine scale. Without FTS5 in this SQLite, hybrid search logs that once and
        returns the dense hits. ``retrieval`` (a :class:`~ragbudget.settings.RetrievalSettings`)
        gives ``hybrid``, ``lexical_weight``, ``fusion`` and ``fetch_k`` at once, instead of the
        keywords. ``query_vector``: ``query`` already embedded by the caller (:meth:`embed_query`),
        so that it is not embedded again (a pipeline reuses it to score sentences).

        >>> idx.search("who founded the guild?", k=5, hybrid=True)[0].score   # doctest: +SKIP
        """
        emb = embedder or self.embedder
        self._check_embedder(emb)
        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        if retrieval is None and hybrid is None:
            hybrid = False  # the index alone searches dense unless asked (a Pipeline fuses)
        settings = from_keywords(
            RetrievalSettings,
            retrieval,
            "retrieval",
            {"hybrid": hybrid, "lexical_weight": lexical_weight, "fusion": fusion},
        )
        hybrid, lexical_weight, fusion = settings.hybrid, settings.lexical_weight, settings.fusion
        vector = emb.embed_query(query) if query_vector is None else query_vector
        if not hybrid or lexical_weight == 0.0:
            return self.search_vector(vector, k)
        pool = max(k, candidates or settings.fetch_k)
        lexical = dict(self._lexical(query, pool))
        if not lexical:  # no FTS5, or no query word in any chunk: the dense search, unchanged
            return self.search_vector(vector, k)
        dense_hits = self.search_vector(vector, pool)
        dense = {h.chunk_id: h.score for h in dense_hits}
        missing = [i for i in lexical if i not in dense]
        # A chunk found only by BM25 still gets its real cosine (vectors are in the flat index),
        # so score fusion normalizes true similarities, not a guess.
        dense.update(self._cosines(vector, missing))
        fused = _fuse(dense, lexical, fusion, lexical_weight)[:k]
        known = {h.chunk_id: h for h in dense_hits}
        need = [i for i, _ in fused if i not in known]
        known.update({h.chunk_id: h for h in self.get_chunks(need)})
        return [_with_score(known[i], s) for i, s in fused if i in known]

    def embed_query(self, query: str, *, embedder: Embedder | None = None) -> Any:
        """``query``'s vector as :meth:`search` embeds it: with ``embedder`` (default: the index's
        own), refused when that is not the embedder the index was built with."""
        emb = embedder or self.embedder
        self._check_embedder(emb)
        return emb.embed_query(query)

    def sentence_vectors(self, ids: Iterable[int]) -> dict[int, tuple[list[bytes], Any]]:
        """The stored sentence vectors of chunks ``ids``: ``{chunk_id: (digests, vectors)}``,
        one :func:`~ragbudget.prompt.spans.sentence_digest` and one float32 row per sentence of the
        chunk (as :func:`~ragbudget.prompt.spans.split_sentences` cuts it at build time), embedded with
        the index's embedder. What :class:`~ragbudget.prompt.spans.SpanScorer` reads (``stored=``) so a
        question embeds no sentence. Chunks without them (an index written before they were
        stored, or by an older writer) are left out: the scorer embeds those on first use."""
        import numpy as np

        ids = [int(i) for i in ids]
        if not ids or not self.has_sentence_vectors:
            return {}
        self._load()
        assert self._db is not None
        m = self.manifest
        dtype = (m.get("sentences") or {}).get("dtype", "float16")
        dim = int(m["dim"])
        out: dict[int, tuple[list[bytes], Any]] = {}
        with self._lock:
            try:
                for lo in range(0, len(ids), 900):
                    part = ids[lo : lo + 900]
                    rows = self._db.execute(
                        "SELECT chunk_id, digests, vectors FROM sentence_vectors "
                        f"WHERE chunk_id IN ({','.join('?' * len(part))})",
                        part,
                    ).fetchall()
                    for cid, digests, blob in rows:
                        n = len(digests) // 16
                        vecs = np.frombuffer(blob, dtype=dtype).reshape(n, dim).astype(np.float32)
                        out[int(cid)] = ([digests[16 * j : 16 * j + 16] for j in range(n)], vecs)
            except sqlite3.OperationalError:  # no such table: an index from before they were stored
                return {}
        return {cid: (list(d), v) for cid, (d, v) in out.items()}

    @property
    def has_sentence_vectors(self) -> bool:
        """Whether the generation in use stores every chunk's sentence vectors: built with
        ``sentence_vectors=True`` by a version that stores them. ``False``: span
        packing embeds the pool's sentences at question time."""
        return _stores_sentences(self.manifest)

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
            return self._db.execute("SELECT 1 FROM sqlite_master WHERE name='chunks_fts'").fetchone() is not None

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
            "store it (nothing is re-embedded)",
            self.path,
            n,
            time.perf_counter() - t,
        )
        return mem

    def _cosines(self, vector: Any, ids: Sequence[int]) -> dict[int, float]:
        import numpy as np

        if not ids:
            return {}
        assert self._flat is not None  # the dense search before this opened the generation
        q = np.asarray(vector, dtype=np.float32).reshape(-1)
        out = {}
        for i in ids:
            try:
                out[int(i)] = float(self._flat.vectors([int(i)])[0] @ q)
            except KeyError:  # no vector for this id (verify reports such an index)
                continue
        return out

    def _check_embedder(self, emb: Embedder) -> None:
        from ..errors import IndexMismatchError

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
        store = self._search
        if self.search_threads:
            import faiss

            before = faiss.omp_get_max_threads()
            faiss.omp_set_num_threads(self.search_threads)
            try:
                scores, ids = store.search(q, k)
            finally:
                faiss.omp_set_num_threads(before)
        else:
            scores, ids = store.search(q, k)
        pairs = [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]
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
                    srcs.setdefault(cid, []).append(self._source(path, start, end, ps, pe))
        found = {
            r[0]: Hit(r[0], 0.0, r[1], r[2], tuple(json.loads(r[3])), tuple(srcs.get(r[0], ())), r[4]) for r in rows
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
                'WHERE path = ? ORDER BY start, "end"',
                (stored,),
            ).fetchall()
        return [(self._source(p, s, e, ps, pe), cid) for cid, p, s, e, ps, pe in rows]

    def _source(self, path: str, start: int, end: int, ps: int | None, pe: int | None) -> Source:
        """A stored source row as a :class:`Source`: display path, and the label of its pages
        where the file's format names them (slide, cell, rows, chapter, message)."""
        labels = self._labels_of().get(path)
        label = None
        if labels:
            from ..input.formats import page_label

            label = page_label(labels, ps, pe)
        return Source(self._show(path), start, end, ps, pe, label)

    def _labels_of(self) -> dict[str, list[str]]:
        """``{stored path: page labels}`` of the files whose format names its pages, read once
        per loaded generation (few files have them; the rest cost nothing)."""
        if self._page_labels is None:
            assert self._db is not None
            cols = {r[1] for r in self._db.execute("PRAGMA table_info(files)")}
            rows = (
                self._db.execute("SELECT path, page_labels FROM files WHERE page_labels IS NOT NULL").fetchall()
                if "page_labels" in cols
                else []
            )
            labels: dict[str, list[str]] = {}
            for path, blob in rows:
                try:
                    value = json.loads(blob)
                except ValueError:
                    continue  # a damaged row loses its labels, never the source
                if isinstance(value, list):
                    labels[path] = [str(x) for x in value]
            self._page_labels = labels
        return self._page_labels

    def neighbors(self, chunk_id: int, *, path: str | None = None) -> tuple[Hit | None, Hit | None]:
        """The chunks just before and after ``chunk_id`` in the same document (its first source,
        or the source in ``path``); ``None`` at either end. Lets a selector merge adjacent chunks
        (compare ``Source.end``/``start`` to see whether they touch)."""
        hit = next(iter(self.get_chunks([chunk_id])), None)
        if hit is None or not hit.sources:
            return None, None
        assert self._roots is not None
        want = None if path is None else self._roots.absolute(str(path))
        src = next((s for s in hit.sources if want is None or self._roots.absolute(s.path) == want), hit.sources[0])
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
            "cleaning": m.get("cleaning"),
            "approx": (m.get("approx") or {}).get("kind"),
            "store": (m.get("store") or {}).get("kind") or (m.get("approx") or {}).get("kind", "flat"),
            "store_requested": (m.get("store") or {}).get("requested"),
            "recall_at_10": _recorded_recall(m),
            "lexical": (m.get("lexical") or {}).get("kind"),
            "roots": [r.get("label") for r in m.get("roots") or ()],
            **m.get("counts", {}),
            "bytes": sum(int((m.get(k) or {}).get("bytes", 0)) for k in ("faiss", "sqlite", "approx")),
        }

    def verify(self) -> VerifyReport:
        """Check everything: checksums, FAISS ids ↔ chunk rows one-to-one, every chunk has a
        source, every source names an indexed file, counts match the manifest."""
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
        assert self._flat is not None
        flat, search = self._flat, self._search
        ids = flat.ids()
        checked["vectors"] = flat.ntotal
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
        if flat.dim != int(m["dim"]):
            problems.append(f"FAISS dimension {flat.dim} != manifest dim {m['dim']}")
        if search is not flat:
            kind = m["approx"].get("kind")
            if search.ntotal != flat.ntotal:
                problems.append(f"the {kind} store has {search.ntotal} vectors, flat has {flat.ntotal}")
            recorded = m["approx"].get("recall_at_10")
            if recorded is not None:
                from .vectors import RECALL_TOLERANCE, measure_recall

                # Same seed, same sample of queries as at build time: only a changed store moves it.
                recall, nq = measure_recall(search, flat, queries=int(m["approx"].get("recall_queries") or 200))
                checked["recall_at_10"] = round(recall, 4)
                checked["recall_recorded"] = recorded
                if recall < float(recorded) - RECALL_TOLERANCE:
                    problems.append(
                        f"the {kind} store's recall@10 is {recall:.3f} on {nq} queries, the "
                        f"manifest records {recorded}; rebuild the index (`ragbudget index PATH "
                        "--rebuild`)"
                    )
        orphans = db.execute("SELECT COUNT(*) FROM chunks WHERE id NOT IN (SELECT chunk_id FROM sources)").fetchone()[0]
        if orphans:
            problems.append(f"{orphans} chunk(s) without any source")
        dangling = db.execute("SELECT COUNT(*) FROM sources WHERE chunk_id NOT IN (SELECT id FROM chunks)").fetchone()[
            0
        ]
        if dangling:
            problems.append(f"{dangling} source(s) pointing at no chunk")
        unknown = db.execute(
            "SELECT COUNT(*) FROM sources WHERE path NOT IN (SELECT path FROM files WHERE status='indexed')"
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
        elif m.get("lexical") and db.execute("SELECT 1 FROM sqlite_master WHERE name='chunks_fts'").fetchone():
            fts_ids = np.array([r[0] for r in db.execute("SELECT rowid FROM chunks_fts")], dtype=np.int64)
            checked["lexical_rows"] = len(fts_ids)
            if len(fts_ids) != len(np.unique(fts_ids)):
                problems.append("a chunk id has more than one lexical (FTS) row")
            only_fts = np.setdiff1d(fts_ids, chunk_ids)
            no_fts = np.setdiff1d(chunk_ids, fts_ids)
            if len(only_fts):
                problems.append(
                    f"{len(only_fts)} lexical (FTS) row(s) without a chunk row, e.g. {only_fts[:5].tolist()}"
                )
            if len(no_fts):
                problems.append(f"{len(no_fts)} chunk(s) without a lexical (FTS) row, e.g. {no_fts[:5].tolist()}")
            stale = db.execute(
                "SELECT COUNT(*) FROM chunks c JOIN chunks_fts f ON f.rowid = c.id WHERE f.text != c.text"
            ).fetchone()[0]
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
        chunking: ChunkSettings | None = None,
        min_tokens: int | None = None,
        max_tokens: int | None = None,
        overlap: int | None = None,
        sentence_vectors: bool | None = None,
        tokenizer: Any = None,
        dedup: str | DedupSettings | None = None,
        near_threshold: float | None = None,
        num_perm: int | None = None,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        max_bytes: int | None = None,
        clean: bool | None = None,
        approx: str | None = None,
        store: str = "auto",
        rebuild: bool = False,
        rechunk: bool = False,
        prune: bool = False,
        allow_removal: bool = False,
        batch_files: int = 16,
        embed_batch: int = 256,
        progress: ProgressCallback | None = None,
        executor: str | EmbedExecutor = "local",
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
        without embedding them again. ``chunking`` (a :class:`~ragbudget.settings.ChunkSettings`,
        or its keywords ``min_tokens``, ``max_tokens``, ``overlap``, ``sentence_vectors``) sizes the
        chunks and says whether every chunk's sentence vectors are stored for span packing (on by
        default; turning it off drops them from the index, turning it on again embeds them for
        every chunk, with no file changed). ``dedup``
        is ``"near"`` (content hash + MinHash at ``near_threshold``), ``"exact"`` or ``"none"``,
        or a :class:`~ragbudget.settings.DedupSettings` holding all three. ``clean`` strips page
        furniture and corpus boilerplate (on by default).

        **Recorded settings.** The index records its chunking (with ``tokenizer``), dedup and
        cleaning settings and whether it stores sentence vectors; a setting left out (``None``)
        is the recorded one, so a plain update keeps how the index was built. A given chunking,
        dedup or cleaning setting that differs from the record re-chunks every file, so it raises
        :class:`~ragbudget.errors.IndexMismatchError` (naming each change, old -> new, and the
        chunks it would re-embed) and changes nothing, unless ``rechunk=True`` (or
        ``rebuild=True``) says it is meant (:mod:`ragbudget.retrieval.index_settings`).

        ``store`` picks the vector store
        that answers searches (:mod:`ragbudget.retrieval.vectors`): ``"auto"`` (exact while the vectors are
        small enough to scan within the latency target, then HNSW, then IVF-PQ; see
        :func:`~ragbudget.retrieval.vectors.choose_store`), ``"flat"``, ``"hnsw"``, ``"ivf"`` (IVF-PQ with
        exact rescoring) or ``"ivf-flat"``; an approximate store is tuned to recall@10
        :data:`~ragbudget.retrieval.vectors.RECALL_TARGET` against exact search, measured on the index's
        own vectors and recorded in the manifest. ``executor`` says where chunks are embedded
        (:mod:`ragbudget.retrieval.executors`): ``"local"`` (this process), ``"ray"`` (Ray Data on the
        cluster ``RAY_ADDRESS`` names, or a local one) or an executor object such as
        ``RayExecutor(address=..., workers=...)``; the index it writes is the same (vectors equal
        within float rounding). ``approx="hnsw"`` is the older spelling of
        ``store="hnsw"``. Settings that change the vectors or the chunks (embedder,
        chunking, dedup, cleaning) trigger a full rebuild, reported in ``rebuild_reason``.
        Files stream through in batches of ``batch_files``; chunks are embedded ``embed_batch`` at a
        time, so memory grows with the batch, not the corpus — except for what every chunk keeps in
        memory during a build: its vector (4·dim bytes, 1.5 KB for MiniLM) and, with
        ``dedup="near"``, its MinHash signature in the LSH index (4·num_perm bytes + buckets).
        """
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        wanted: dict[str, Any] = {
            "chunking": chunking,
            "min_tokens": min_tokens,
            "max_tokens": max_tokens,
            "overlap": overlap,
            "sentence_vectors": sentence_vectors,
            "tokenizer": tokenizer,
            "dedup": dedup,
            "near_threshold": near_threshold,
            "num_perm": num_perm,
            "clean": clean,
        }
        from .index_settings import check_changes, resolve

        # Checked against the record before anything is written (a bad value creates no folder),
        # and again under the lock below, where it counts: another writer may commit in between.
        resolve(self._recorded_manifest(), **wanted)
        if approx not in (None, "hnsw"):
            raise ConfigError(f"approx must be None or 'hnsw', got {approx!r}")
        if approx is not None:
            store = approx  # the older spelling of store="hnsw"
        from .vectors import STORES

        if store not in STORES:
            raise ConfigError(f"store must be one of {', '.join(STORES)}; got {store!r}")
        from .executors import make_executor

        run_on = make_executor(executor)
        given = [os.fspath(p) for p in paths]
        roots = _check_roots(given, self.path)  # before the folder or the lock file is created
        self.path.mkdir(parents=True, exist_ok=True)
        with _Lock(self.path):
            self.close()
            recorded = self._recorded_manifest()
            settings, tok = resolve(recorded, **wanted)
            check_changes(recorded, settings, allowed=rechunk or rebuild)
            from .build import _Builder

            builder = _Builder(
                self,
                given,
                embedder=embedder,
                tokenizer=tok,
                settings=settings,
                include=include,
                exclude=exclude,
                max_bytes=max_bytes,
                clean=settings["cleaning"]["clean"],
                store=store,
                rebuild=rebuild,
                batch_files=max(1, batch_files),
                embed_batch=max(1, embed_batch),
                progress=progress,
                roots=roots,
                prune=prune,
                allow_removal=allow_removal,
                executor=run_on,
            )
            try:
                return builder.run()
            finally:
                builder.cleanup()
                self.close()

    update = build

    def _recorded_manifest(self) -> dict[str, Any] | None:
        """The manifest whose settings a writing run keeps: ``None`` for no index, or for one
        whose manifest is unreadable (the run rebuilds it: there is nothing to keep)."""
        try:
            return dict(Index(self.path)._read_manifest())
        except (IndexNotFoundError, IndexCorruptError):
            return None


def _stores_sentences(m: dict[str, Any]) -> bool:
    """Whether the manifest ``m`` says its generation stores every chunk's sentence vectors (no
    ``sentences`` entry: written before they were stored; ``stored: false``: left out on purpose;
    an entry without ``stored`` was written before they could be left out)."""
    entry = m.get("sentences")
    return isinstance(entry, dict) and bool(entry) and bool(entry.get("stored", True))


def _recorded_recall(m: dict[str, Any]) -> float | None:
    """The recall@10 the manifest records for its search store (1.0 for exact search; ``None``
    for an approximate store written before recall was measured)."""
    if not m.get("approx"):
        return 1.0
    r = m["approx"].get("recall_at_10")
    return None if r is None else float(r)


def _with_score(hit: Hit, score: float) -> Hit:
    return Hit(hit.chunk_id, score, hit.text, hit.n_tokens, hit.headings, hit.sources, hit.windows)
