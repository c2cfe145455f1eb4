"""An index in PostgreSQL with pgvector: the second storage, for many machines sharing one index.

``Index("postgresql://user@host/db")`` (or ``--index-dir`` / ``--index`` with such a URL on the
command line) keeps the whole index in a database; libpq's keyword/value form
(``host=/run/postgresql dbname=rag user=rag``) is the same, wherever a URL is taken
(:mod:`ragbudget.retrieval.locations` tells the forms apart). One schema per index
(``ragbudget`` unless the location says ``ragbudget_schema=name``: that parameter is removed before
connecting, everything else — ``sslmode``, ``connect_timeout``, a service name, an empty host —
goes to libpq untouched, and so does the password: from the location, ``PGPASSWORD``,
``PGPASSFILE`` or a service file). The location is shown only masked
(``postgresql://user:***@host/db``, ``password=***``): never a password in a message, a log or a
manifest.

**Generations as versioned rows.** Every row carries ``gen_from``/``gen_to``
(:mod:`ragbudget.retrieval.postgres_catalog`): generations share rows instead of copying tables,
so an incremental run writes only what changed. A writer fills generation ``n`` inside **one
transaction** and its last statement, before ``COMMIT``, replaces the ``manifest`` row: the
commit is the commit point. A writer killed, or whose connection drops, at any moment is rolled
back by PostgreSQL: nothing of ``n`` is ever visible, the current generation is untouched (one
transaction is simpler than many small ones plus a clean-up of a dead writer's rows, and MVCC keeps
readers unblocked). A reader of generation ``g`` filters every query to ``g``'s rows, so a commit
of ``g + 1`` does not change what it sees; rows no longer visible to the current or the previous
generation are deleted after each commit (the previous is kept for a reader that just read the
manifest, as a local index keeps its files).

**Vectors.** A ``vectors`` table (``vector`` column, pgvector). Exact search is a scan ordered by
``<#>`` (negative inner product) under the generation filter, inside a transaction that turns
index scans off, so its scores equal a local flat index's (float32 inner products). The writer
loads the base generation's vectors into a :class:`~ragbudget.retrieval.vectors.FlatStore` (what
the build edits, as locally) and at commit inserts the ids that are new and retires the ids that
are gone: an unchanged re-run writes no vector.

**Lock and checkpoint.** One writer at a time: ``pg_try_advisory_lock`` on a key derived from the
schema, held by a dedicated connection for the writer's life (released by the server if the
process dies). The embedding checkpoint is the ``pending_vectors`` table, written through that
connection as batches finish (outside the writer's transaction, so a kill keeps them) and read by
the next run; the commit clears it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import IndexCorruptError, IndexLockedError, IndexNotFoundError, IndexStorageError
from .locations import DEFAULT_SCHEMA, hide_secrets, mask_location, split_location
from .manifest import check_manifest, new_manifest
from .postgres_catalog import PgCatalog, db_errors, first_line
from .storage import Generation, Manifest

if TYPE_CHECKING:
    import numpy as np
    import psycopg
    from numpy.typing import ArrayLike, NDArray

    from .postgres_catalog import PgCatalogWriter
    from .recall import StoreReport
    from .vectors import FlatStore, VectorStore

__all__ = ["DEFAULT_SCHEMA", "PgCheckpoint", "PgExactStore", "PostgresStorage", "db_errors"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def _as_array(value: Any) -> NDArray[np.float32]:
    """A ``vector`` value as pgvector's adapter returns it, as float32 numpy."""
    import numpy as np

    arr = value.to_numpy() if hasattr(value, "to_numpy") else value
    return np.asarray(arr, dtype=np.float32)


class PostgresStorage:
    """An index in the PostgreSQL database ``url`` names (see the module docstring).

    >>> PostgresStorage("postgresql://me:pw@db/rag?ragbudget_schema=docs").where
    'postgresql://me:***@db/rag?ragbudget_schema=docs'
    """

    def __init__(self, url: str) -> None:
        self._conninfo, self.schema = split_location(url)
        self.where = mask_location(url)
        self.folder: Path | None = None
        self._s = f'"{self.schema}"'  # checked against _SCHEMA_NAME: a safe identifier
        #: The writer lock's connection while this storage holds it (the checkpoint writes through it).
        self._held: psycopg.Connection[Any] | None = None
        #: The connection :meth:`exists` and :meth:`read_manifest` share: a server asks whether its
        #: index is still there on every request, and a new connection each time cost a backend
        #: process start on the database's host per request (and one more slot of
        #: ``max_connections`` while it lived).
        self._probe_conn: psycopg.Connection[Any] | None = None
        self._probe_lock = threading.Lock()
        #: How many connections this storage has opened (readers, writers, the lock, the probe).
        self.connections_opened = 0

    def __repr__(self) -> str:
        return f"PostgresStorage({self.where!r})"

    # -- connections -----------------------------------------------------------------------------

    def connect(self, *, autocommit: bool = True, vectors: bool = True) -> psycopg.Connection[Any]:
        """A new connection (``vectors``: with pgvector's types registered, so numpy arrays go
        in and out as ``vector``)."""
        import psycopg

        # libpq quotes the piece of a location it cannot parse, password and all: its message
        # goes out with the location's secrets masked.
        with db_errors(self.where, hide=self._hide):
            conn = psycopg.connect(self._conninfo, autocommit=autocommit)
        self.connections_opened += 1
        if vectors:
            try:
                from pgvector.psycopg import register_vector

                with db_errors(self.where, hide=self._hide):
                    register_vector(conn)
                    if not autocommit:
                        conn.commit()
            except (IndexStorageError, psycopg.ProgrammingError) as exc:
                conn.close()
                raise IndexStorageError(
                    f"the index database {self.where} has no pgvector (`vector` type): "
                    f"{self._hide(first_line(exc))}; run `CREATE EXTENSION vector` as a user allowed to, "
                    "or install pgvector"
                ) from None
        return conn

    def _hide(self, message: str) -> str:
        return hide_secrets(message, self._conninfo)

    def _has_schema(self, conn: psycopg.Connection[Any]) -> bool:
        row = conn.execute("SELECT to_regclass(%s)", (f"{self._s}.manifest",)).fetchone()
        return row is not None and row[0] is not None

    # -- the Storage protocol --------------------------------------------------------------------

    def _probe(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """``fn`` on the shared probe connection (autocommit: each call sees the latest commit),
        opened on first use and once more when the server dropped it (a restart, an idle cut)."""
        with self._probe_lock:
            conn = self._probe_conn
            if conn is not None and not (conn.closed or conn.broken):
                try:
                    with db_errors(self.where):
                        return fn(conn)
                except IndexStorageError:
                    if not (conn.closed or conn.broken):
                        raise
                    log.info("the connection to %s was lost: reconnecting", self.where)
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
            self._probe_conn = None
            conn = self.connect(vectors=False)
            self._probe_conn = conn
            with db_errors(self.where):
                return fn(conn)

    def close(self) -> None:
        """Close the probe connection (reopened on next use); a generation closes its own."""
        with self._probe_lock:
            if self._probe_conn is not None:
                with contextlib.suppress(Exception):
                    self._probe_conn.close()
                self._probe_conn = None

    def exists(self) -> bool:
        def run(conn: psycopg.Connection[Any]) -> bool:
            if not self._has_schema(conn):
                return False
            return conn.execute(f"SELECT 1 FROM {self._s}.manifest WHERE id = 1").fetchone() is not None

        return self._probe(run)

    def size_bytes(self, manifest: Manifest) -> int:
        """The schema's tables with their indexes and TOAST (``pg_total_relation_size``): every
        generation the rows still hold, as a local index's files hold theirs."""
        name = self.schema

        def run(conn: psycopg.Connection[Any]) -> int:
            row = conn.execute(
                "SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'm')",
                (name,),
            ).fetchone()
            return int(row[0]) if row else 0

        return self._probe(run)

    def read_manifest(self) -> Manifest:
        def run(conn: psycopg.Connection[Any]) -> tuple[Any, ...] | None:
            if not self._has_schema(conn):
                return None
            return conn.execute(f"SELECT generation, body FROM {self._s}.manifest WHERE id = 1").fetchone()

        row = self._probe(run)
        if row is None:
            raise IndexNotFoundError(
                f"no index in schema {self.schema} of {self.where}; build one with "
                f"`ragbudget index PATH --index-dir '{self.where}'` (with the password given as for any libpq client)"
            )
        return check_manifest(row[1], f"the manifest row in schema {self.schema} of {self.where}", generation=row[0])

    def current_generation(self) -> int:
        """One small row on the shared probe connection (not the manifest's body)."""

        def run(conn: psycopg.Connection[Any]) -> tuple[Any, ...] | None:
            import psycopg

            try:
                return conn.execute(f"SELECT generation FROM {self._s}.manifest WHERE id = 1").fetchone()
            except psycopg.errors.UndefinedTable:  # no schema (autocommit: the connection is fine)
                return None

        row = self._probe(run)
        if row is None:
            return int(self.read_manifest()["generation"])  # raises the one-line error
        return int(row[0])

    def open(self, manifest: Manifest, *, verify_checksums: bool = True, search_store: bool = True) -> Generation:

        g = int(manifest["generation"])
        catalog = PgCatalog(self.connect(), self._s, g, where=self.where, reconnect=self.connect)
        exact = PgExactStore(catalog, int(manifest["dim"]))
        search: VectorStore = exact
        approx = manifest.get("approx") or {}
        if search_store and approx.get("held"):
            try:
                search = self._held_store(catalog, exact, approx, g, verify_checksums)
            except BaseException:
                catalog.close()  # the generation is not handed out: its connection goes back
                raise
        elif search_store and approx.get("kind") == "hnsw":
            search = PgHnswStore(catalog, int(manifest["dim"]), int(approx["ef_search"]))
        return Generation(manifest=manifest, exact=exact, search=search, catalog=catalog)

    def _held_store(
        self, catalog: PgCatalog, exact: PgExactStore, entry: Mapping[str, Any], generation: int, checksum: bool
    ) -> VectorStore:
        """The installed store generation ``generation`` keeps as bytes, loaded as its class
        loads it from a file; it gets the exact vectors in memory (a store may read them). The
        file is removed once ``load`` returns: a store's ``load`` reads what it needs then (the
        ``ragbudget.stores`` contract: no mapping of the file kept past ``load``)."""
        import hashlib
        import tempfile

        from .vectors import FlatStore, load_store

        with db_errors(self.where):
            row = catalog.conn.execute(
                f"SELECT data, sha256 FROM {self._s}.search_stores WHERE generation = %s", (generation,)
            ).fetchone()
        if row is None or (checksum and hashlib.sha256(bytes(row[0])).hexdigest() != entry["sha256"]):
            what = "is missing" if row is None else "fails its sha256 checksum"
            raise IndexCorruptError(
                f"the {entry['kind']} store of generation {generation} in {self.where} {what}; "
                "rebuild the index (--rebuild) or search the exact store (use_approx=False)"
            )
        with tempfile.TemporaryDirectory(prefix="rb-store-") as tmp:
            path = Path(tmp) / f"{entry['kind']}.index"
            path.write_bytes(bytes(row[0]))
            return load_store(path, entry, exact=FlatStore.of(exact))

    def open_for_writing(self, manifest: Manifest) -> Generation:
        import numpy as np

        from .vectors import FlatStore

        g, dim = int(manifest["generation"]), int(manifest["dim"])
        conn = self.connect()
        flat = FlatStore(dim)
        with db_errors(self.where):
            rows = conn.execute(
                f"SELECT chunk_id, embedding FROM {self._s}.vectors WHERE gen_from <= %(g)s "
                "AND (gen_to IS NULL OR gen_to > %(g)s) ORDER BY chunk_id",
                {"g": g},
            ).fetchall()
        if rows:
            flat.add(np.array([r[0] for r in rows], dtype=np.int64), np.stack([_as_array(r[1]) for r in rows]))
        return Generation(
            manifest=manifest, exact=flat, search=flat, catalog=PgCatalog(conn, self._s, g, where=self.where)
        )

    def lock(self) -> _AdvisoryLock:
        return _AdvisoryLock(self)

    def begin(self, base: Generation | None, *, keep: bool) -> PgWriter:
        return PgWriter(self, base, keep=keep)

    def checkpoint(self, identity: Mapping[str, Any]) -> PgCheckpoint:
        return PgCheckpoint(self, identity)

    def _lock_conn(self) -> psycopg.Connection[Any]:
        if self._held is None:
            raise IndexStorageError(f"writing the index in {self.where} needs its writer lock")
        return self._held

    def ensure_schema(self, conn: psycopg.Connection[Any]) -> None:
        """Create pgvector (when allowed and missing) and the index's tables, under the lock."""
        import psycopg

        with db_errors(self.where):
            have = conn.execute("SELECT 1 FROM pg_type WHERE typname = 'vector'").fetchone()
        if have is None:
            try:
                conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
            except psycopg.Error as exc:
                raise IndexStorageError(
                    f"the index database {self.where} has no pgvector and it could not be created "
                    f"({first_line(exc)}); ask its administrator for `CREATE EXTENSION vector`"
                ) from None
        from .postgres_catalog import schema_sql

        with db_errors(self.where):
            for stmt in schema_sql(self._s):
                conn.execute(stmt)


class _AdvisoryLock:
    """The writer lock: ``pg_try_advisory_lock`` held by a dedicated autocommit connection."""

    def __init__(self, storage: PostgresStorage) -> None:
        self.storage = storage
        self.conn: psycopg.Connection[Any] | None = None

    def __enter__(self) -> _AdvisoryLock:
        st = self.storage
        conn = st.connect(vectors=False)
        with db_errors(st.where):
            got = conn.execute(
                "SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (f"ragbudget-index:{st.schema}",)
            ).fetchone()
        if not got or not got[0]:
            conn.close()
            raise IndexLockedError(
                f"another process is writing the index in schema {st.schema} of {st.where}; wait for it to "
                "finish or use another ragbudget_schema (readers are not blocked)"
            )
        st.ensure_schema(conn)
        self.conn = conn
        st._held = conn
        return self

    def __exit__(self, *exc: object) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()  # the session ends: the server releases the advisory lock
            self.conn = None
        self.storage._held = None


class PgWriter:
    """Generation ``n`` of a :class:`PostgresStorage`, written in one transaction (see
    :class:`~ragbudget.retrieval.storage.GenerationWriter`)."""

    def __init__(self, storage: PostgresStorage, base: Generation | None, *, keep: bool) -> None:
        from .postgres_catalog import PgCatalogWriter
        from .vectors import FlatStore

        self.storage = storage
        s = storage._s
        self.conn = storage.connect(autocommit=False)
        with db_errors(storage.where):
            row = self.conn.execute(f"SELECT generation FROM {s}.manifest WHERE id = 1").fetchone()
            current = int(row[0]) if row else 0
            self.number = current + 1
            # Rows of a generation never committed (none, with one transaction per writer; kept
            # as a guard) are removed before this one reuses its number.
            for table in ("chunks", "sources", "files", "roots", "sentence_vectors", "vectors"):
                self.conn.execute(f"DELETE FROM {s}.{table} WHERE gen_from > %s", (current,))
                self.conn.execute(f"UPDATE {s}.{table} SET gen_to = NULL WHERE gen_to > %s", (current,))
            self.conn.execute(f"DELETE FROM {s}.search_stores WHERE generation > %s", (current,))
            next_id = int(self.conn.execute(f"SELECT COALESCE(MAX(id), 0) + 1 FROM {s}.chunks").fetchone()[0])  # type: ignore[index]
        self._catalog = PgCatalogWriter(self.conn, s, self.number, where=storage.where, next_id=next_id)
        self.exact: FlatStore | None = FlatStore.of(base.exact) if (keep and base is not None) else None
        if not keep:
            self._catalog.retire_all()
        self.lexical = "ok"
        # Pipeline mode until the commit: the catalog's inserts (a chunk, its source, its
        # sentence vectors) go out without waiting for each answer; a read syncs. Measured on
        # 3,390 chunks: one round trip waited per statement was most of the database's cost.
        # An error surfaces at the next sync, still as the one-line IndexStorageError.
        self._pipeline = contextlib.ExitStack()
        with db_errors(storage.where):
            self._pipeline.enter_context(self.conn.pipeline())
        #: The database searches its own rows: the build makes no FAISS search store; the commit
        #: builds pgvector's HNSW index when the store kind asks for one, and tunes it.
        self.searches_in_place = True
        self._done = False

    @property
    def catalog(self) -> PgCatalogWriter:
        return self._catalog

    def commit(
        self,
        fields: Mapping[str, Any],
        *,
        exact: VectorStore,
        search: VectorStore | None,
        vacuum: bool = False,
        progress: Callable[[int], None] | None = None,
        questions: NDArray[np.float32] | None = None,
    ) -> Manifest:
        import numpy as np

        step = progress or (lambda _: None)
        st, s, n = self.storage, self.storage._s, self.number
        step(1)
        with db_errors(st.where):
            self._pipeline.close()  # every queued statement answered (or its error raised) first
            live = np.array(
                [r[0] for r in self.conn.execute(f"SELECT chunk_id FROM {s}.vectors WHERE gen_to IS NULL").fetchall()],
                dtype=np.int64,
            )
            ids = exact.ids()
            gone = np.setdiff1d(live, ids)
            new = np.setdiff1d(ids, live)
            if len(gone):
                self._catalog.retire_rows("vectors", "chunk_id = ANY(%(ids)s)", {"ids": gone.tolist()})
            if len(new):
                vecs = exact.vectors(new)
                with self.conn.cursor() as cur:
                    cur.executemany(
                        f"INSERT INTO {s}.vectors (chunk_id, gen_from, embedding) VALUES (%s, %s, %s)",
                        [(int(i), n, v) for i, v in zip(new.tolist(), vecs, strict=True)],
                    )
            store = dict(fields.get("store") or {})
            approx = None
            if store.get("kind") == "hnsw":
                t = time.perf_counter()
                index = create_hnsw(self.conn, s, exact.dim)
                from .recall import warn_below_target

                tuned, report = tune_hnsw(self._catalog, exact, exact.dim, questions)
                hnsw = {
                    # an empty generation has nothing to miss
                    "recall_at_10": 1.0 if report.recall_at_10 is None else round(report.recall_at_10, 4),
                    "recall_queries": report.queries,
                    **report.tuning(),
                    "ef_search": tuned.ef_search,
                }
                approx = {"kind": "hnsw", "engine": "pgvector", "index": index, **hnsw}
                store.update(hnsw, build_seconds=round(time.perf_counter() - t, 3))
                warn_below_target(report, "pgvector's HNSW", f"ef_search {tuned.ef_search}")
            else:
                create_hnsw(self.conn, s, None)
            if search is not None:  # an installed store (ragbudget.stores): held as its saved bytes
                approx = self._hold_store(search)
            step(2)
            manifest: Manifest = new_manifest(
                {**fields, "store": store},
                generation=n,
                storage={"kind": "postgres", "schema": st.schema, "vectors": "pgvector", "table": "vectors"},
                approx=approx,
                lexical={"kind": "postgres-fts", "column": "tsv", "config": "english", "rank": "bm25"},
            )
            from psycopg.types.json import Jsonb

            self.conn.execute(
                f"INSERT INTO {s}.manifest (id, generation, body) VALUES (1, %s, %s) "
                "ON CONFLICT (id) DO UPDATE SET generation = EXCLUDED.generation, body = EXCLUDED.body",
                (n, Jsonb(json.loads(json.dumps(manifest)))),
            )
            self.conn.commit()  # the commit point
            self._done = True
            step(3)
            # Rows neither the new generation nor the previous one sees.
            for table in ("chunks", "sources", "files", "roots", "sentence_vectors", "vectors"):
                self.conn.execute(f"DELETE FROM {s}.{table} WHERE gen_to IS NOT NULL AND gen_to <= %s", (n - 1,))
            self.conn.execute(f"DELETE FROM {s}.search_stores WHERE generation < %s", (n - 1,))
            self.conn.commit()
        return manifest

    def _hold_store(self, search: VectorStore) -> dict[str, Any]:
        """Save ``search`` (a store another package provides) and keep its bytes in this
        generation's row of ``search_stores``; its manifest entry, checksum included."""
        import hashlib
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rb-store-") as tmp:
            path = Path(tmp) / f"{search.kind}.index"
            entry = dict(search.save(path))
            data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        self.conn.execute(
            f"INSERT INTO {self.storage._s}.search_stores (generation, kind, data, sha256) VALUES (%s, %s, %s, %s)",
            (self.number, search.kind, data, digest),
        )
        return {**entry, "kind": search.kind, "held": "search_stores", "bytes": len(data), "sha256": digest}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._pipeline.close()
        with contextlib.suppress(Exception):
            if not self._done:
                self.conn.rollback()
        with contextlib.suppress(Exception):
            self.conn.close()


class PgExactStore:
    """A generation's vectors in the ``vectors`` table, searched exactly by SQL (read-only: a
    writer edits a :class:`~ragbudget.retrieval.vectors.FlatStore` loaded from it)."""

    kind = "flat"

    def __init__(self, catalog: PgCatalog, dim: int) -> None:
        self.catalog = catalog  # its connection and lock (closed with the generation's catalog)
        self.g = catalog.g
        self.dim = dim
        self._vis = "gen_from <= %(g)s AND (gen_to IS NULL OR gen_to > %(g)s)"

    def _query(
        self, sql: str, params: Mapping[str, Any], *, exact_scan: bool = False, ef_search: int | None = None
    ) -> list[tuple[Any, ...]]:
        query = sql.replace("{s}", self.catalog.s)
        values = {"g": self.g, **params}

        def run(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
            with conn.transaction():
                if exact_scan:
                    # A sequential scan even where an ANN index exists: this is the exact store.
                    conn.execute("SET LOCAL enable_indexscan = off")
                if ef_search is not None:
                    conn.execute(f"SET LOCAL hnsw.ef_search = {int(ef_search)}")
                return conn.execute(query, values).fetchall()  # type: ignore[arg-type]

        return self.catalog.use(run)

    @property
    def ntotal(self) -> int:
        return int(self._query(f"SELECT COUNT(*) FROM {{s}}.vectors WHERE {self._vis}", {})[0][0])

    def search(self, queries: ArrayLike, k: int) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
        import numpy as np

        q = np.asarray(queries, dtype=np.float32).reshape(-1, self.dim)
        scores = np.full((len(q), k), -np.inf, dtype=np.float32)
        ids = np.full((len(q), k), -1, dtype=np.int64)
        for row, vec in enumerate(q):
            found = self._query(
                f"SELECT chunk_id, -(embedding <#> %(q)s) FROM {{s}}.vectors WHERE {self._vis} "
                "ORDER BY embedding <#> %(q)s, chunk_id LIMIT %(k)s",
                {"q": vec, "k": int(k)},
                exact_scan=True,
            )
            for j, (cid, score) in enumerate(found):
                ids[row, j], scores[row, j] = int(cid), float(score)
        return scores, ids

    def vectors(self, ids: ArrayLike) -> NDArray[np.float32]:
        import numpy as np

        want = np.asarray(ids, dtype=np.int64).reshape(-1)
        got = {
            int(i): _as_array(v)
            for i, v in self._query(
                f"SELECT chunk_id, embedding FROM {{s}}.vectors WHERE chunk_id = ANY(%(ids)s) AND {self._vis}",
                {"ids": want.tolist()},
            )
        }
        missing = [int(i) for i in want if int(i) not in got]
        if missing:
            raise KeyError(f"no vector for chunk id(s) {missing[:5]}")
        return np.stack([got[int(i)] for i in want]) if len(want) else np.zeros((0, self.dim), dtype=np.float32)

    def ids(self) -> NDArray[np.int64]:
        import numpy as np

        rows = self._query(f"SELECT chunk_id FROM {{s}}.vectors WHERE {self._vis} ORDER BY chunk_id", {})
        return np.array([r[0] for r in rows], dtype=np.int64)

    def _read_only(self) -> IndexStorageError:
        return IndexStorageError(f"the vectors of generation {self.g} in {self.catalog.where} are read-only")

    def add(self, ids: ArrayLike, vectors: ArrayLike) -> None:
        raise self._read_only()

    def remove(self, ids: ArrayLike) -> int:
        raise self._read_only()

    def finalize(self) -> StoreReport:
        raise self._read_only()

    def save(self, path: Path) -> dict[str, Any]:
        raise self._read_only()


class PgHnswStore(PgExactStore):
    """pgvector's HNSW index over a generation's vectors: the search store of a database index
    built with ``store="hnsw"`` (or ``auto`` past the flat size). ``ef_search`` is the one tuned
    at build time (:func:`tune_hnsw`). HNSW in pgvector 0.6 filters *after* the graph search:
    rows of other generations (the previous one, until the next commit collects it) take some
    of the ``ef_search`` candidates, so a query may see fewer than ``ef_search`` of its own;
    the recall recorded is measured under that same filter."""

    kind = "hnsw"

    def __init__(self, catalog: PgCatalog, dim: int, ef_search: int) -> None:
        super().__init__(catalog, dim)
        self.ef_search = int(ef_search)

    def search(self, queries: ArrayLike, k: int) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
        import numpy as np

        d = int(self.dim)  # an int, inlined: the partial index's predicate must be a constant
        q = np.asarray(queries, dtype=np.float32).reshape(-1, d)
        scores = np.full((len(q), k), -np.inf, dtype=np.float32)
        ids = np.full((len(q), k), -1, dtype=np.int64)
        for row, vec in enumerate(q):
            found = self._query(
                f"SELECT chunk_id, -(embedding::vector({d}) <#> %(q)s::vector({d})) FROM {{s}}.vectors "
                f"WHERE vector_dims(embedding) = {d} AND {self._vis} "
                f"ORDER BY embedding::vector({d}) <#> %(q)s::vector({d}) LIMIT %(k)s",
                {"q": vec, "k": int(k)},
                ef_search=self.ef_search,
            )
            for j, (cid, score) in enumerate(found):
                ids[row, j], scores[row, j] = int(cid), float(score)
        return scores, ids


#: ``hnsw.ef_search`` values tried in order until the recall target is met (pgvector's maximum is 1000).
EF_SEARCH_LADDER = (40, 64, 100, 160, 250, 400, 640, 1000)


def create_hnsw(conn: psycopg.Connection[Any], schema: str, dim: int | None) -> str | None:
    """Create (once) the HNSW index of ``dim``-dimensional vectors with the local store's graph
    parameters (:data:`~ragbudget.retrieval.vectors.HNSW_M`, ``HNSW_EF_CONSTRUCTION``), a
    partial expression index (the ``vector`` column has no fixed dimension, and an index of
    another embedder's dimension may still cover the previous generation), and drop the others;
    ``dim=None`` drops them all (an index searched exactly need not maintain one). Its name."""
    from .vectors import HNSW_EF_CONSTRUCTION, HNSW_M

    d = int(dim or 0)
    # The graph's parameters are in the name: an index built with others (pgvector's defaults
    # before) is dropped below and rebuilt with these.
    name = f"vectors_hnsw_{d}_m{HNSW_M}_ef{HNSW_EF_CONSTRUCTION}" if dim else None
    listed = conn.execute("SELECT indexname FROM pg_indexes WHERE schemaname = %s", (schema.strip('"'),))
    indexes = [i for (i,) in listed.fetchall()]
    for other in indexes:
        if other.startswith("vectors_hnsw_") and other != name:
            conn.execute(f'DROP INDEX {schema}."{other}"')
    if name is None:
        return None
    if name not in indexes:
        _room_for_the_graph(conn, schema, d)
    conn.execute(
        f"CREATE INDEX IF NOT EXISTS {name} ON {schema}.vectors USING hnsw ((embedding::vector({d})) vector_ip_ops) "
        f"WITH (m = {HNSW_M}, ef_construction = {HNSW_EF_CONSTRUCTION}) WHERE vector_dims(embedding) = {d}"
    )
    return name


#: The most ``maintenance_work_mem`` a build asks for, for its own transaction only.
HNSW_BUILD_MEMORY_CAP = 1 << 30


def _room_for_the_graph(conn: psycopg.Connection[Any], schema: str, dim: int) -> None:
    """Raise ``maintenance_work_mem`` for this transaction to what the HNSW graph of the rows
    to index needs (at most :data:`HNSW_BUILD_MEMORY_CAP`; never lowered): a graph that outgrows
    it is built on disk, pgvector says so in a notice, and a 109k-chunk build took 505.8 s against
    223.6 s with pgvector's sparser default graph (``bench/postgres.py --parts scale``). A value
    set through the URL's ``options`` above it stands."""
    from .vectors import HNSW_M

    counted = conn.execute(f"SELECT COUNT(*) FROM {schema}.vectors WHERE vector_dims(embedding) = %s", (dim,))
    rows = counted.fetchone()[0]  # type: ignore[index]  # COUNT(*) always returns its one row
    # Per element: the vector, its tuple header and 2·m neighbours on layer 0 (m above, rarely).
    need = int(rows) * (4 * dim + 64 + 2 * HNSW_M * 10) * 5 // 4
    setting = conn.execute("SELECT setting::bigint * 1024 FROM pg_settings WHERE name = 'maintenance_work_mem'")
    have = setting.fetchone()[0]  # type: ignore[index]  # a built-in setting: always there
    if need > int(have):
        kib = min(need, HNSW_BUILD_MEMORY_CAP) // 1024
        conn.execute("SELECT set_config('maintenance_work_mem', %s, true)", (f"{kib}kB",))


def tune_hnsw(
    catalog: PgCatalog, exact: VectorStore, dim: int, questions: NDArray[np.float32] | None = None
) -> tuple[PgHnswStore, StoreReport]:
    """The smallest ``ef_search`` of :data:`EF_SEARCH_LADDER` whose recall@10 against ``exact``
    reaches the target, as a local HNSW graph tunes (:func:`~ragbudget.retrieval.recall.tune`):
    on the builder's pseudo-questions when given (0.99), else on noisy own vectors (0.998); the
    largest when none does. ``(store, report)``.

    Tuned to 0.998 on noisy own vectors, pgvector climbed to ef_search 400 at ~109k chunks, 15.7
    ms a search, where 64 (3.6 ms) already gave unseen questions 0.9875 (``bench/postgres.py
    --ladder``)."""
    from .recall import tune

    store = PgHnswStore(catalog, dim, EF_SEARCH_LADDER[0])

    def set_ef(ef: int) -> None:
        store.ef_search = ef

    report = tune(EF_SEARCH_LADDER, set_ef, store, exact, questions)
    return store, report


class PgCheckpoint:
    """The embedding checkpoint of a PostgreSQL index: ``pending_vectors`` rows keyed by the
    text's sha256 (as :class:`~ragbudget.retrieval.checkpoint.Checkpoint`), written through the
    lock's connection, each batch in its own transaction, so a killed writer keeps them."""

    def __init__(self, storage: PostgresStorage, identity: Mapping[str, Any]) -> None:
        import numpy as np

        from .checkpoint import Checkpoint

        self.storage = storage
        self.key = Checkpoint.key
        self.identity = json.dumps(identity, sort_keys=True)
        self.vectors: dict[bytes, tuple[Any, int]] = {}
        conn = storage._lock_conn()
        s = storage._s
        with db_errors(storage.where):
            gone = conn.execute(f"DELETE FROM {s}.pending_vectors WHERE identity <> %s", (self.identity,)).rowcount
            if gone:
                log.info("removed %d checkpointed vectors written for another embedder", gone)
            for key, windows, blob in conn.execute(
                f"SELECT key, windows, vector FROM {s}.pending_vectors WHERE identity = %s", (self.identity,)
            ):
                self.vectors[bytes(key)] = (np.frombuffer(bytes(blob), dtype="<f4").copy(), int(windows))
        if self.vectors:
            log.info("resuming from %d embedded chunks checkpointed by an interrupted run", len(self.vectors))

    def get(self, text: str) -> tuple[Any, int] | None:
        return self.vectors.get(self.key(text))

    def add(self, texts: Sequence[str], vectors: Any, windows: Sequence[int]) -> None:
        import numpy as np

        vecs = np.ascontiguousarray(vectors, dtype="<f4")
        conn = self.storage._lock_conn()
        rows = [(self.key(t), self.identity, int(w), v.tobytes()) for t, v, w in zip(texts, vecs, windows, strict=True)]
        with db_errors(self.storage.where), conn.transaction(), conn.cursor() as cur:
            cur.executemany(
                f"INSERT INTO {self.storage._s}.pending_vectors (key, identity, windows, vector) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (key) DO NOTHING",
                rows,
            )

    def close(self) -> None:
        """Nothing held: every batch was committed as it was added."""

    def remove(self) -> None:
        """The run committed (or had nothing to commit): the checkpoint is spent."""
        conn = self.storage._lock_conn()
        with db_errors(self.storage.where):
            conn.execute(f"DELETE FROM {self.storage._s}.pending_vectors")
        self.vectors = {}
