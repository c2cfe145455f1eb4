"""Sentence vectors embedded at question time, kept beside the index for every later question.

A small on-disk map from a sentence's digest (:func:`ragbudget.packing.spans.sentence_digest`)
to its vector, so that span packing embeds each sentence of the corpus at most once — in this
process or in any other that asks the same index (``ragbudget ask`` runs one process per
question) — without the index having to embed every chunk's sentences at build time.

The file is ``<index>/cache/sentences.sqlite`` (SQLite, float16 vectors as the index stores its
own): outside the index's generation files, which stay immutable and checksummed, and outside the
folder's top level, where the writer removes stray journals. It holds one embedder's vectors: its
identity is recorded, and a cache written for another embedder is never read and is emptied by
the first write under the new one. A vector depends on its sentence's text alone, so the cache
stays valid across generations, rebuilds and file changes; sentences of removed files stay until
the cache is deleted (safe to delete at any time).

Best effort, never in the way of an answer: a folder that cannot be written (a read-only index)
is read if the file is there and never written; a locked, busy or damaged file makes a read
return nothing and a write be skipped (logged once); span packing then embeds as it would
without a cache.

>>> import tempfile, numpy as np
>>> c = SentenceCache(tempfile.mkdtemp(), identity={"kind": "hash", "id": "hash-4"}, dim=4)
>>> c.put({b"k" * 16: np.array([1.0, 0.0, 0.0, 0.0])})
1
>>> c.get([b"k" * 16, b"x" * 16])[b"k" * 16].tolist()
[1.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

__all__ = ["CACHE_DIR", "SentenceCache"]

#: The cache's folder inside an index folder, and its file there.
CACHE_DIR = "cache"
_FILE = "sentences.sqlite"
#: Seconds a reader or writer waits for another process's write before giving up on this call.
_BUSY_S = 2.0
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS vectors (digest BLOB PRIMARY KEY, vector BLOB NOT NULL) WITHOUT ROWID;
"""


class SentenceCache:
    """The sentence vectors of one index folder's cache (see the module docstring).

    ``identity`` is the embedder's identity as the index records it (its manifest's ``embedder``
    entry: kind, id, pooling, …); ``dim`` its vector size. Thread-safe (one connection, a lock).
    """

    def __init__(self, index_dir: str | os.PathLike[str], *, identity: Mapping[str, Any], dim: int) -> None:
        self.path = Path(index_dir) / CACHE_DIR / _FILE
        # The parts of an embedder spec that decide its vectors (a manifest also records dim etc.).
        self.identity = json.dumps(
            {k: identity.get(k) for k in ("kind", "id", "pooling", "window_overlap") if identity.get(k) is not None},
            sort_keys=True,
        )
        self.dim = int(dim)
        self._db: sqlite3.Connection | None = None
        self._writable = False
        self._matches = False  # the file holds this embedder's vectors
        self._failed = False  # a read or write failed: stop trying in this process
        self._lock = threading.Lock()

    # -- connection ------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection | None:
        if self._db is not None or self._failed:
            return self._db
        try:
            try:
                self.path.parent.mkdir(exist_ok=True)
                db = sqlite3.connect(self.path, timeout=_BUSY_S, check_same_thread=False)
                db.executescript(_SCHEMA)
                self._writable = True
            except (OSError, sqlite3.OperationalError) as exc:
                if not self.path.is_file():
                    # Nothing to read, nowhere to write (a read-only index): not a problem.
                    log.info("no sentence cache beside the index (%s): sentences are embedded without it", exc)
                    self._failed = True
                    return None
                # A read-only index folder: read what earlier writers left, write nothing.
                db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=_BUSY_S, check_same_thread=False)
            self._matches = self._holds_this_embedder(db)
        except (sqlite3.Error, OSError, ValueError) as exc:
            self._give_up("open", exc)
            return None
        self._db = db
        return db

    def _holds_this_embedder(self, db: sqlite3.Connection) -> bool:
        """Whether the file holds this embedder's vectors (its identity and size recorded)."""
        row = db.execute("SELECT value FROM meta WHERE key='identity'").fetchone()
        dim = db.execute("SELECT value FROM meta WHERE key='dim'").fetchone()
        return row is not None and row[0] == self.identity and dim is not None and int(dim[0]) == self.dim

    def _give_up(self, what: str, exc: BaseException) -> None:
        if not self._failed:
            log.warning("the sentence cache %s could not %s (%s): embedding without it", self.path, what, exc)
        self._failed = True
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None

    # -- public ----------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Sentence vectors the cache holds for this embedder (0: none, another embedder's, or a
        cache that cannot be read)."""
        with self._lock:
            db = self._open()
            if db is None or not self._matches:
                return 0
            try:
                return int(db.execute("SELECT COUNT(*) FROM vectors").fetchone()[0])
            except sqlite3.Error as exc:
                self._give_up("be read", exc)
                return 0

    def get(self, digests: Sequence[bytes]) -> dict[bytes, np.ndarray]:
        """The cached vectors (float32, ``(dim,)``) of those of ``digests`` the cache holds."""
        import numpy as np

        keys = list(dict.fromkeys(bytes(d) for d in digests))
        out: dict[bytes, np.ndarray] = {}
        with self._lock:
            db = self._open()
            if db is None or not self._matches or not keys:
                return out
            try:
                for lo in range(0, len(keys), 900):  # SQLite's host-parameter limit
                    part = keys[lo : lo + 900]
                    for d, blob in db.execute(
                        f"SELECT digest, vector FROM vectors WHERE digest IN ({','.join('?' * len(part))})", part
                    ):
                        out[bytes(d)] = np.frombuffer(blob, dtype="<f2").astype(np.float32)
            except sqlite3.Error as exc:
                self._give_up("be read", exc)
                return {}
        return {d: v for d, v in out.items() if v.shape == (self.dim,)}

    def put(self, vectors: Mapping[bytes, Any]) -> int:
        """Keep ``vectors`` (digest → vector); returns how many were written (0: not writable,
        or a write failed)."""
        import numpy as np

        rows = [
            (bytes(d), np.asarray(v, dtype="<f2").tobytes())
            for d, v in vectors.items()
            if np.asarray(v).shape == (self.dim,)
        ]
        with self._lock:
            db = self._open()
            if db is None or not self._writable or not rows:
                return 0
            try:
                with db:  # one transaction: a reader sees all of it or none
                    if not self._matches:
                        # The write lock first, then a second look: another process may have
                        # started this embedder's cache since this one opened the file, and
                        # starting over then would delete what it just wrote.
                        db.execute("BEGIN IMMEDIATE")
                        self._matches = self._holds_this_embedder(db)
                    if not self._matches:
                        # Another embedder's vectors (or a new file): start over under this one.
                        db.execute("DELETE FROM vectors")
                        db.executemany(
                            "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                            [("identity", self.identity), ("dim", str(self.dim)), ("dtype", "float16")],
                        )
                    db.executemany("INSERT OR IGNORE INTO vectors (digest, vector) VALUES (?, ?)", rows)
                self._matches = True
            except (sqlite3.Error, ValueError) as exc:
                self._give_up("be written", exc)
                return 0
        return len(rows)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._db.close()
                self._db = None

    def __repr__(self) -> str:
        return f"SentenceCache({str(self.path)!r})"
