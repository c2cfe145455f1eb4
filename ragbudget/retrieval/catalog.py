"""A local generation's catalog: its chunks, sources, files, roots and sentence vectors in SQLite.

Each generation of a local index has one SQLite file (``meta.<gen>.sqlite``) beside its vector
files. :class:`SqliteCatalog` reads it (opened read-only and ``immutable``: a committed file never
changes, so SQLite takes no locks); :class:`SqliteCatalogWriter` edits a private copy that the
storage renames into place at commit (:mod:`ragbudget.retrieval.storage`). Every SQL statement of
the index is here: the reader (:mod:`ragbudget.retrieval.index`) and the writer
(:mod:`ragbudget.retrieval.build`) call these methods, so another storage (a database) is
another catalog with the same methods.

Tables: ``chunks`` (text, tokens, headings, content hash, MinHash, windows), ``sources`` (every
location of a chunk, duplicates included), ``files`` (what drives incremental runs), ``roots``
(the paths given to build, with their labels), ``meta`` (the generation number),
``sentence_vectors`` (each chunk's sentences embedded, float16, removed with their chunk by a
trigger) and ``chunks_fts``, the FTS5 table over the chunk texts (:mod:`ragbudget.retrieval.lexical`).
Files of generations written before a column or table existed still open: a missing column reads
as ``NULL``, a missing table as empty, and the next writer adds them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import IndexCorruptError
from .lexical import FTS_TOKENIZE, bm25, ensure_fts, fts5_available, warn_no_fts5
from .roots import Root
from .rows import decode_page_labels, decode_sentence_rows, encode_page_labels, sentence_vectors_by_digest

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = [
    "ChunkRow",
    "FileRow",
    "FileState",
    "SourceRow",
    "SqliteCatalog",
    "SqliteCatalogWriter",
]

log = logging.getLogger(__name__)

SCHEMA = """
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
# Columns added to ``files`` after its first layout: an older generation gains them on its next
# write. page_labels: JSON list naming each page in the format's unit ("slide 3"), or NULL.
# needs: what a file skipped for a missing dependency lacked (LoadError.needs), so a later run
# retries it once that is installed, even with the file unchanged.
_FILES_ADDED_COLUMNS = (("n_pages", "INTEGER"), ("warning", "TEXT"), ("page_labels", "TEXT"), ("needs", "TEXT"))

#: SQLite caps bound parameters per statement; 900 stays under every build's limit.
_BATCH = 900


class ChunkRow(NamedTuple):
    id: int
    text: str
    n_tokens: int
    headings: tuple[str, ...]
    windows: int


class SourceRow(NamedTuple):
    """Where a chunk is: the stored (absolute) ``path``, character range and pages."""

    path: str
    start: int
    end: int
    page_start: int | None
    page_end: int | None


class FileRow(NamedTuple):
    """A file as :meth:`Index.sources` lists it (``size`` -1 for a skipped entry)."""

    path: str
    status: str
    n_chunks: int
    size: int
    reason: str | None
    detail: str | None
    n_pages: int | None
    warning: str | None
    #: Furniture and boilerplate lines its cleaning removed (a copy carries it over).
    furniture: int = 0


class FileState(NamedTuple):
    """What a writer compares a scanned file with: its recorded size, mtime, content hash and
    status (``indexed`` or ``skipped``, with the reason, detail and missing dependency)."""

    size: int
    mtime_ns: int
    sha256: str | None
    status: str
    reason: str | None
    detail: str | None
    needs: str | None


class SqliteCatalog:
    """A generation's SQLite file, read. Thread-safe: one connection, one lock (queries are
    short; the server's threads share an index)."""

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self.db = db
        self.path = path
        self._lock = threading.RLock()
        self._columns: set[str] | None = None
        # Where BM25 queries go: this file, or an in-memory FTS table built on demand for a
        # generation written without one; False: no FTS5 in this Python.
        self._lex: sqlite3.Connection | bool | None = None

    @classmethod
    def open(cls, path: Path, generation: int) -> SqliteCatalog:
        """Open the committed file ``path`` read-only, checking that it is ``generation``'s."""
        # immutable=1: generation files never change after commit, so SQLite needs no locks.
        try:
            db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True, check_same_thread=False)
            gen = db.execute("SELECT value FROM meta WHERE key='generation'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise IndexCorruptError(f"index file {path} is not a readable SQLite file: {exc}") from exc
        if gen is None or int(gen[0]) != generation:
            db.close()
            raise IndexCorruptError(
                f"{path} belongs to generation {gen and gen[0]}, the manifest names {generation}; rebuild the index"
            )
        return cls(db, path)

    def close(self) -> None:
        with self._lock:
            if isinstance(self._lex, sqlite3.Connection) and self._lex is not self.db:
                self._lex.close()
            self._lex = None
            self.db.close()

    def _has_column(self, name: str) -> bool:
        if self._columns is None:
            self._columns = {str(r[1]) for r in self.db.execute("PRAGMA table_info(files)")}
        return name in self._columns

    def _has_table(self, name: str) -> bool:
        return self.db.execute("SELECT 1 FROM sqlite_master WHERE name=?", (name,)).fetchone() is not None

    # -- chunks and sources ----------------------------------------------------------------------

    def chunks(self, ids: Sequence[int]) -> dict[int, ChunkRow]:
        """The chunks of ``ids`` that exist, by id."""
        out: dict[int, ChunkRow] = {}
        with self._lock:
            for lo in range(0, len(ids), _BATCH):
                part = [int(i) for i in ids[lo : lo + _BATCH]]
                for cid, text, n, headings, windows in self.db.execute(
                    "SELECT id, text, n_tokens, headings, windows FROM chunks "
                    f"WHERE id IN ({','.join('?' * len(part))})",
                    part,
                ):
                    out[int(cid)] = ChunkRow(int(cid), text, int(n), tuple(json.loads(headings)), int(windows))
        return out

    def sources(self, ids: Sequence[int]) -> dict[int, list[SourceRow]]:
        """Every source of the chunks ``ids``, each chunk's in its stored order."""
        out: dict[int, list[SourceRow]] = {}
        with self._lock:
            for lo in range(0, len(ids), _BATCH):
                part = [int(i) for i in ids[lo : lo + _BATCH]]
                for cid, *src in self.db.execute(
                    'SELECT chunk_id, path, start, "end", page_start, page_end FROM sources '
                    f"WHERE chunk_id IN ({','.join('?' * len(part))}) ORDER BY chunk_id, ord",
                    part,
                ):
                    out.setdefault(int(cid), []).append(SourceRow(*src))
        return out

    def sources_in(self, path: str) -> list[tuple[int, SourceRow]]:
        """``(chunk_id, source)`` of every chunk located in the file ``path`` (stored form), in
        document order."""
        with self._lock:
            rows = self.db.execute(
                'SELECT chunk_id, path, start, "end", page_start, page_end FROM sources '
                'WHERE path = ? ORDER BY start, "end"',
                (path,),
            ).fetchall()
        return [(int(cid), SourceRow(*src)) for cid, *src in rows]

    def find_chunk(self, *hashes: str) -> tuple[int, int] | None:
        """``(chunk id, windows)`` of a chunk whose content hash is one of ``hashes``."""
        with self._lock:
            row = self.db.execute(
                f"SELECT id, windows FROM chunks WHERE content_hash IN ({','.join('?' * len(hashes))}) LIMIT 1",
                hashes,
            ).fetchone()
        return None if row is None else (int(row[0]), int(row[1]))

    def chunk_keys(self, ids: Sequence[int]) -> dict[int, tuple[str, bytes | None]]:
        """``{chunk id: (content hash, MinHash bytes)}`` of the chunks ``ids`` that exist."""
        out: dict[int, tuple[str, bytes | None]] = {}
        with self._lock:
            for lo in range(0, len(ids), _BATCH):
                part = [int(i) for i in ids[lo : lo + _BATCH]]
                for cid, h, blob in self.db.execute(
                    f"SELECT id, content_hash, minhash FROM chunks WHERE id IN ({','.join('?' * len(part))})", part
                ):
                    out[int(cid)] = (str(h), blob)
        return out

    def chunk_ids(self) -> NDArray[np.int64]:
        import numpy as np

        with self._lock:
            return np.array([r[0] for r in self.db.execute("SELECT id FROM chunks")], dtype=np.int64)

    # -- files and roots -------------------------------------------------------------------------

    def files(self) -> list[FileRow]:
        """Every file the generation knows, indexed or skipped."""
        extra = ", ".join(c if self._has_column(c) else "NULL" for c in ("n_pages", "warning", "furniture"))
        with self._lock:
            rows = self.db.execute(f"SELECT path, status, n_chunks, size, reason, detail, {extra} FROM files")
            return [
                FileRow(p, st, int(n or 0), int(size), r, d, pages, w, int(fu or 0))
                for p, st, n, size, r, d, pages, w, fu in rows
            ]

    def file_states(self) -> dict[str, FileState]:
        """``{stored path: FileState}`` of every file row."""
        needs = "needs" if self._has_column("needs") else "NULL"
        with self._lock:
            rows = self.db.execute(f"SELECT path, size, mtime_ns, sha256, status, reason, detail, {needs} FROM files")
            return {r[0]: FileState(*r[1:]) for r in rows}

    def page_labels(self) -> dict[str, list[str]]:
        """``{stored path: page labels}`` of the files whose format names its pages."""
        if not self._has_column("page_labels"):
            return {}
        with self._lock:
            rows = self.db.execute("SELECT path, page_labels FROM files WHERE page_labels IS NOT NULL").fetchall()
        return decode_page_labels(rows)

    def roots(self) -> list[Root]:
        """The recorded roots (``[]`` for a generation written before they were recorded)."""
        with self._lock:
            try:
                return [Root(p, lab, kind) for p, lab, kind in self.db.execute("SELECT path, label, kind FROM roots")]
            except sqlite3.OperationalError:  # a generation written before the table existed
                return []

    def file_paths(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self.db.execute("SELECT path FROM files")]

    # -- sentence vectors ------------------------------------------------------------------------

    def sentence_vectors(
        self, ids: Sequence[int], *, dim: int, dtype: str
    ) -> dict[int, tuple[list[bytes], NDArray[np.float32]]]:
        """``{chunk_id: (digests, float32 rows)}`` of the chunks ``ids`` that have them."""

        out: dict[int, tuple[list[bytes], NDArray[np.float32]]] = {}
        with self._lock:
            try:
                for lo in range(0, len(ids), _BATCH):
                    part = [int(i) for i in ids[lo : lo + _BATCH]]
                    for cid, digests, blob in self.db.execute(
                        "SELECT chunk_id, digests, vectors FROM sentence_vectors "
                        f"WHERE chunk_id IN ({','.join('?' * len(part))})",
                        part,
                    ):
                        out[int(cid)] = decode_sentence_rows(digests, blob, dim=dim, dtype=dtype)
            except sqlite3.OperationalError:  # no such table: a generation from before they were stored
                return {}
        return out

    def all_sentence_vectors(self, dim: int) -> dict[bytes, NDArray[np.float32]]:
        """Every stored sentence vector by digest (what a rebuild with the same embedder reuses)."""

        with self._lock:
            try:
                rows = self.db.execute("SELECT digests, vectors FROM sentence_vectors").fetchall()
            except sqlite3.OperationalError:  # written before sentence vectors were stored
                return {}
        return sentence_vectors_by_digest(rows, dim)

    # -- lexical ---------------------------------------------------------------------------------

    def has_lexical(self) -> bool:
        """Whether the file holds the FTS5 table (whether it is up to date, the manifest says)."""
        with self._lock:
            return self._has_table("chunks_fts")

    def lexical(self, query: str, k: int, *, trusted: bool) -> list[tuple[int, float]]:
        """``(chunk_id, bm25)`` best first. ``trusted``: the manifest vouches for the file's FTS
        table; otherwise (a generation written without FTS5, or before the table existed) the
        table is built in memory from the chunk texts on first use, for this session only (the
        file is immutable; the next writer stores it). ``[]`` without FTS5 (logged once)."""
        with self._lock:
            if self._lex is None:
                if not fts5_available():
                    warn_no_fts5()
                    self._lex = False
                elif trusted and self._has_table("chunks_fts"):
                    self._lex = self.db
                else:
                    self._lex = self._lexical_in_memory()
            if not isinstance(self._lex, sqlite3.Connection):
                return []
            return bm25(self._lex, query, k)

    def _lexical_in_memory(self) -> sqlite3.Connection:
        t = time.perf_counter()
        mem = sqlite3.connect(":memory:", check_same_thread=False)
        mem.execute(f"CREATE VIRTUAL TABLE chunks_fts USING fts5(text, tokenize='{FTS_TOKENIZE}')")
        n = 0
        cur = self.db.execute("SELECT id, text FROM chunks")
        while rows := cur.fetchmany(2048):
            mem.executemany("INSERT INTO chunks_fts(rowid, text) VALUES (?, ?)", rows)
            n += len(rows)
        log.warning(
            "the index in %s was built without the lexical (FTS5) table; built it in memory for "
            "this session (%d chunks, %.2fs). Re-run `ragbudget index` on the same folders to "
            "store it (nothing is re-embedded)",
            self.path.parent,
            n,
            time.perf_counter() - t,
        )
        return mem

    # -- verify ----------------------------------------------------------------------------------

    def check(self, chunk_ids: NDArray[np.int64], manifest: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
        """The catalog's own consistency (``chunk_ids`` read once by the caller): every chunk has
        a source, every source a chunk and an indexed file, the FTS rows match the chunks one to
        one (when the manifest vouches for the table), SQLite's ``quick_check``. Returns
        ``(problems, checked)``."""
        import numpy as np

        problems: list[str] = []
        checked: dict[str, Any] = {}
        with self._lock:
            db = self.db

            def one(sql: str) -> int:
                return int(db.execute(sql).fetchone()[0])

            if orphans := one("SELECT COUNT(*) FROM chunks WHERE id NOT IN (SELECT chunk_id FROM sources)"):
                problems.append(f"{orphans} chunk(s) without any source")
            if dangling := one("SELECT COUNT(*) FROM sources WHERE chunk_id NOT IN (SELECT id FROM chunks)"):
                problems.append(f"{dangling} source(s) pointing at no chunk")
            if unknown := one(
                "SELECT COUNT(*) FROM sources WHERE path NOT IN (SELECT path FROM files WHERE status='indexed')"
            ):
                problems.append(f"{unknown} source(s) naming a file that is not indexed")
            checked["sources"] = one("SELECT COUNT(*) FROM sources")
            checked["files"] = one("SELECT COUNT(*) FROM files")
            if not fts5_available():
                checked["lexical_rows"] = "unchecked: no FTS5 in this SQLite"
            elif manifest.get("lexical") and self._has_table("chunks_fts"):
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
                if stale := one(
                    "SELECT COUNT(*) FROM chunks c JOIN chunks_fts f ON f.rowid = c.id WHERE f.text != c.text"
                ):
                    problems.append(f"{stale} lexical (FTS) row(s) whose text differs from the chunk")
            else:
                checked["lexical_rows"] = None  # built in memory on demand
            integrity = db.execute("PRAGMA quick_check").fetchone()[0]
            if integrity != "ok":
                problems.append(f"SQLite quick_check: {integrity}")
        return problems, checked


class SqliteCatalogWriter(SqliteCatalog):
    """The catalog of the generation being written: a private copy of the previous one (or a new
    file), edited without a journal (nothing reads it until the storage renames it into place)."""

    @classmethod
    def create(cls, path: Path, *, copy_of: Path | None = None) -> SqliteCatalogWriter:
        """A writable catalog at ``path``: a copy of ``copy_of`` (the previous generation's
        file), or an empty one; missing tables and columns are added."""
        if copy_of is not None:
            shutil.copyfile(copy_of, path)
        db = sqlite3.connect(path, check_same_thread=False)
        db.executescript(SCHEMA)
        have = {r[1] for r in db.execute("PRAGMA table_info(files)")}
        for col, decl in _FILES_ADDED_COLUMNS:
            if col not in have:
                db.execute(f"ALTER TABLE files ADD COLUMN {col} {decl}")
        # The temp copy is private until renamed: no journal needed; the rename commits it.
        db.execute("PRAGMA journal_mode=OFF")
        db.execute("PRAGMA synchronous=OFF")
        return cls(db, path)

    def ensure_lexical(self, *, trusted: bool) -> str:
        """Create (and fill) the FTS table; ``trusted=False`` rebuilds one the previous writer did
        not vouch for. ``"ok"``, ``"created"`` or ``"unavailable"`` (no FTS5 here)."""
        with self._lock:
            return ensure_fts(self.db, trusted=trusted)

    # -- files and roots -------------------------------------------------------------------------

    def record_file(
        self,
        path: str,
        size: int,
        mtime_ns: int,
        digest: str | None,
        status: str,
        reason: str | None = None,
        detail: str | None = None,
        *,
        n_chunks: int = 0,
        furniture: int = 0,
        pages: int | None = None,
        warning: str | None = None,
        page_labels: Sequence[str] | None = None,
        needs: str | None = None,
    ) -> None:
        labels = encode_page_labels(page_labels)
        with self._lock:
            self.db.execute(
                "INSERT OR REPLACE INTO files (path, size, mtime_ns, sha256, status, reason, detail, "
                "n_chunks, furniture, n_pages, warning, page_labels, needs) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    path,
                    size,
                    mtime_ns,
                    digest,
                    status,
                    reason,
                    detail,
                    n_chunks,
                    furniture,
                    pages,
                    warning,
                    labels,
                    needs,
                ),
            )

    def touch_file(self, path: str, mtime_ns: int) -> None:
        """A file changed its mtime only (same content): record the new one."""
        with self._lock:
            self.db.execute("UPDATE files SET mtime_ns=? WHERE path=?", (mtime_ns, path))

    def drop_sources(self, path: str) -> None:
        with self._lock:
            self.db.execute("DELETE FROM sources WHERE path=?", (path,))

    def drop_files(self, paths: Iterable[str]) -> None:
        """Forget the files ``paths`` and their sources (their chunks are orphans until removed)."""
        rows = [(p,) for p in paths]
        with self._lock:
            self.db.executemany("DELETE FROM sources WHERE path=?", rows)
            self.db.executemany("DELETE FROM files WHERE path=?", rows)

    def set_roots(self, roots: Iterable[Root]) -> None:
        with self._lock:
            self.db.execute("DELETE FROM roots")
            self.db.executemany(
                "INSERT INTO roots (path, label, kind) VALUES (?,?,?)", [(r.path, r.label, r.kind) for r in roots]
            )

    # -- chunks ----------------------------------------------------------------------------------

    def kept_chunks(self) -> Iterator[tuple[int, str, bytes | None]]:
        """``(id, content hash, MinHash bytes)`` of every chunk that still has a source."""
        with self._lock:
            rows = self.db.execute(
                "SELECT id, content_hash, minhash FROM chunks WHERE EXISTS "
                "(SELECT 1 FROM sources WHERE chunk_id = chunks.id)"
            ).fetchall()
        for cid, h, blob in rows:
            yield int(cid), str(h), blob

    def revive(self, content_hash: str, headings: Sequence[str]) -> int | None:
        """An orphan (a chunk left without a source by a changed file) with this text, given its
        new headings: its id, or ``None``."""
        with self._lock:
            row = self.db.execute(
                "SELECT id FROM chunks WHERE content_hash=? AND NOT EXISTS "
                "(SELECT 1 FROM sources WHERE chunk_id = chunks.id) LIMIT 1",
                (content_hash,),
            ).fetchone()
            if row is None:
                return None
            self.db.execute("UPDATE chunks SET headings=? WHERE id=?", (json.dumps(list(headings)), row[0]))
        return int(row[0])

    def add_chunk(
        self, text: str, n_tokens: int, headings: Sequence[str], content_hash: str, minhash: bytes | None
    ) -> int:
        with self._lock:
            cur = self.db.execute(
                "INSERT INTO chunks (text, n_tokens, headings, content_hash, minhash, windows) VALUES (?,?,?,?,?,0)",
                (text, int(n_tokens), json.dumps(list(headings)), content_hash, minhash),
            )
        assert cur.lastrowid is not None
        return int(cur.lastrowid)

    def add_source(self, chunk_id: int, src: SourceRow) -> None:
        """Another location of ``chunk_id``, after the ones it has."""
        with self._lock:
            n = self.db.execute(
                "SELECT COALESCE(MAX(ord), -1) + 1 FROM sources WHERE chunk_id=?", (chunk_id,)
            ).fetchone()[0]
            self.db.execute(
                'INSERT INTO sources (chunk_id, path, start, "end", page_start, page_end, ord) VALUES (?,?,?,?,?,?,?)',
                (chunk_id, *src, n),
            )

    def set_windows(self, pairs: Iterable[tuple[int, int]]) -> None:
        """``(chunk id, windows)``: how many model windows each chunk's vector pooled."""
        with self._lock:
            self.db.executemany("UPDATE chunks SET windows=? WHERE id=?", [(w, i) for i, w in pairs])

    def remove_orphans(self) -> list[int]:
        """Delete the chunks left without any source; their ids."""
        with self._lock:
            ids = [
                int(r[0])
                for r in self.db.execute("SELECT id FROM chunks WHERE id NOT IN (SELECT chunk_id FROM sources)")
            ]
            self.db.executemany("DELETE FROM chunks WHERE id=?", [(i,) for i in ids])
        return ids

    # -- sentence vectors ------------------------------------------------------------------------

    def chunks_without_sentence_vectors(self) -> list[tuple[int, str]]:
        with self._lock:
            rows = self.db.execute(
                "SELECT id, text FROM chunks WHERE id NOT IN (SELECT chunk_id FROM sentence_vectors) ORDER BY id"
            ).fetchall()
        return [(int(i), str(t)) for i, t in rows]

    def put_sentence_vectors(self, rows: Iterable[tuple[int, bytes, bytes]]) -> None:
        """``(chunk id, 16-byte digests joined, float16 rows)`` per chunk."""
        with self._lock:
            self.db.executemany(
                "INSERT OR REPLACE INTO sentence_vectors (chunk_id, digests, vectors) VALUES (?,?,?)", list(rows)
            )

    def drop_sentence_vectors(self) -> None:
        with self._lock:
            self.db.execute("DELETE FROM sentence_vectors")

    # -- commit ----------------------------------------------------------------------------------

    def count_chunks(self) -> int:
        with self._lock:
            return int(self.db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0])

    def counts(self) -> dict[str, int]:
        """The counts the manifest records (``lexical_rows`` only with an FTS table)."""
        with self._lock:

            def one(sql: str) -> int:
                return int(self.db.execute(sql).fetchone()[0])

            out = {
                "chunks": one("SELECT COUNT(*) FROM chunks"),
                "sources": one("SELECT COUNT(*) FROM sources"),
                "files": one("SELECT COUNT(*) FROM files WHERE status='indexed'"),
                "files_skipped": one("SELECT COUNT(*) FROM files WHERE status!='indexed'"),
                "windowed_chunks": one("SELECT COUNT(*) FROM chunks WHERE windows>1"),
            }
            if self._has_table("chunks_fts") and fts5_available():
                out["lexical_rows"] = one("SELECT COUNT(*) FROM chunks_fts")
            out["sentence_vectors"] = one("SELECT COUNT(*) FROM sentence_vectors")
        return out

    def finish(self, generation: int, *, vacuum: bool = False) -> None:
        """Stamp the generation number, write everything and close: the file is ready to be
        renamed into place. ``vacuum``: rewrite the file (after dropping much of it)."""
        with self._lock:
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('generation', ?)", (str(generation),))
            self.db.commit()
            if vacuum:
                self.db.execute("VACUUM")
            self.db.close()

    def discard(self) -> None:
        """Close without finishing (the storage removes the file)."""
        with contextlib.suppress(Exception), self._lock:
            self.db.close()
