"""A PostgreSQL index's catalog: chunks, sources, files, roots and sentence vectors as versioned rows.

The PostgreSQL counterpart of :mod:`ragbudget.retrieval.catalog` (same methods, see
:class:`~ragbudget.retrieval.storage.Catalog`), for :mod:`ragbudget.retrieval.postgres`. Every row
carries ``gen_from`` (the generation that wrote it) and ``gen_to`` (the first generation that no
longer has it; ``NULL``: still live), so generations share their rows instead of copying tables: a
reader of generation ``g`` sees ``gen_from <= g AND (gen_to IS NULL OR gen_to > g)``, and a writer
of ``n`` inserts rows with ``gen_from = n`` and retires rows by setting ``gen_to = n`` (an edit
copies the row into ``n`` and retires the old one), all invisible to readers of ``n - 1``.

Lexical search is PostgreSQL full-text search: a ``tsvector`` column generated from the text
(``english`` configuration: stemming, as the local FTS5 table's porter tokenizer) with a GIN
index, ranked by BM25 as FTS5 ranks it (:meth:`PgCatalog.lexical`) over the same OR-of-words query
the local index builds (:func:`~ragbudget.retrieval.lexical.query_words`); the fusion with dense
scores is the local one (``Index.search``). Every statement is parameterised; PostgreSQL text
cannot hold a NUL byte, so NULs are removed from stored text (logged once per run).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import IndexStorageError
from .catalog import ChunkRow, FileRow, FileState, SourceRow
from .lexical import match_expression, query_words
from .roots import Root
from .rows import decode_page_labels, decode_sentence_rows, encode_page_labels, sentence_vectors_by_digest

if TYPE_CHECKING:
    import numpy as np
    import psycopg
    from numpy.typing import NDArray

__all__ = ["PgCatalog", "PgCatalogWriter", "TS_CONFIG", "db_errors", "first_line", "schema_sql"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The text search configuration of the ``tsv`` column (stemming English, as FTS5's porter).
TS_CONFIG = "english"
#: BM25's parameters, FTS5's ``bm25()`` defaults, so that fusion weighs the lexical scores of a
#: database index as it weighs a local one's.
BM25_K1, BM25_B = 1.2, 0.75
#: A reader's document frequencies remembered, by word, before the memory is cleared.
DF_CACHE_WORDS = 50_000
#: Chunks a lexical search's first pass may match: those holding its rarest words, as many of
#: them as fit (at least one word); the rest are matched only when the scores found cannot
#: rule them out (:meth:`PgCatalog.lexical`).
LEXICAL_FIRST_PASS_CHUNKS = 2_000
#: One query word as a tsquery: its lexemes (a phrase when it has several; empty for a stop word),
#: never a syntax error, whatever the word holds.
_WORD_QUERY = f"websearch_to_tsquery('{TS_CONFIG}', '\"' || replace(w.word, '\"', '') || '\"')"


def _idf(n: int, df: int) -> float:
    """FTS5's idf: ``ln((N - df + 0.5) / (df + 0.5))``, at least 1e-6 (a word in most chunks)."""
    return max(1e-6, math.log((n - df + 0.5) / (df + 0.5)))


#: Columns of each versioned table (``gen_from``/``gen_to`` and generated ones aside), in the
#: order rows are copied.
_COLUMNS = {
    "chunks": ("id", "text", "n_tokens", "headings", "content_hash", "minhash", "windows"),
    "sources": ("chunk_id", "path", "start", '"end"', "page_start", "page_end", "ord"),
    "files": (
        "path",
        "size",
        "mtime_ns",
        "sha256",
        "status",
        "reason",
        "detail",
        "n_chunks",
        "furniture",
        "n_pages",
        "warning",
        "page_labels",
        "needs",
    ),
    "roots": ("path", "label", "kind"),
    "sentence_vectors": ("chunk_id", "digests", "vectors"),
    "vectors": ("chunk_id", "embedding"),
}
VERSIONED = tuple(_COLUMNS)


def schema_sql(schema: str) -> list[str]:
    """The statements creating an index's tables in ``schema`` (a quoted identifier), each
    idempotent. The ``vector`` column has no fixed dimension: one index holds one embedder's
    vectors, and the dimension is the manifest's."""
    s = schema
    gen = "gen_from bigint NOT NULL, gen_to bigint"
    return [
        f"CREATE SCHEMA IF NOT EXISTS {s}",
        f"CREATE TABLE IF NOT EXISTS {s}.manifest (id int PRIMARY KEY CHECK (id = 1), "
        "generation bigint NOT NULL, body jsonb NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {s}.chunks (id bigint NOT NULL, {gen}, text text NOT NULL, "
        "n_tokens int NOT NULL, headings text NOT NULL, content_hash text NOT NULL, minhash bytea, "
        f"windows int NOT NULL DEFAULT 0, tsv tsvector GENERATED ALWAYS AS (to_tsvector('{TS_CONFIG}', text)) STORED)",
        f"CREATE INDEX IF NOT EXISTS chunks_id ON {s}.chunks (id)",
        f"CREATE INDEX IF NOT EXISTS chunks_hash ON {s}.chunks (content_hash)",
        f"CREATE INDEX IF NOT EXISTS chunks_tsv ON {s}.chunks USING gin (tsv)",
        f"CREATE TABLE IF NOT EXISTS {s}.sources (chunk_id bigint NOT NULL, {gen}, path text NOT NULL, "
        'start int NOT NULL, "end" int NOT NULL, page_start int, page_end int, ord int NOT NULL)',
        f"CREATE INDEX IF NOT EXISTS sources_chunk ON {s}.sources (chunk_id, ord)",
        f"CREATE INDEX IF NOT EXISTS sources_path ON {s}.sources (path, start)",
        f"CREATE TABLE IF NOT EXISTS {s}.files (path text NOT NULL, {gen}, size bigint NOT NULL, "
        "mtime_ns bigint NOT NULL, sha256 text, status text NOT NULL, reason text, detail text, "
        "n_chunks int NOT NULL DEFAULT 0, furniture int NOT NULL DEFAULT 0, n_pages int, warning text, "
        "page_labels text, needs text)",
        f"CREATE INDEX IF NOT EXISTS files_path ON {s}.files (path)",
        f"CREATE TABLE IF NOT EXISTS {s}.roots (path text NOT NULL, {gen}, label text NOT NULL, kind text NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {s}.sentence_vectors (chunk_id bigint NOT NULL, {gen}, "
        "digests bytea NOT NULL, vectors bytea NOT NULL)",
        f"CREATE INDEX IF NOT EXISTS sentence_vectors_chunk ON {s}.sentence_vectors (chunk_id)",
        f"CREATE TABLE IF NOT EXISTS {s}.vectors (chunk_id bigint NOT NULL, {gen}, embedding vector NOT NULL)",
        f"CREATE INDEX IF NOT EXISTS vectors_chunk ON {s}.vectors (chunk_id)",
        # A search store another package provides (ragbudget.stores), as the bytes its save()
        # wrote: one row per generation, removed with the generation's other rows.
        f"CREATE TABLE IF NOT EXISTS {s}.search_stores (generation bigint PRIMARY KEY, kind text NOT NULL, "
        "data bytea NOT NULL, sha256 text NOT NULL)",
        # The embedding checkpoint: written as batches finish, outside the writer's transaction.
        f"CREATE TABLE IF NOT EXISTS {s}.pending_vectors (key bytea PRIMARY KEY, identity text NOT NULL, "
        "windows int NOT NULL, vector bytea NOT NULL)",
    ]


def first_line(exc: BaseException) -> str:
    """A database error as one line: its lines joined, each said once (libpq repeats its message
    for every address it tried)."""
    lines = dict.fromkeys(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    return " ".join(lines) or type(exc).__name__


@contextlib.contextmanager
def db_errors(where: str, *, hide: Callable[[str], str] | None = None) -> Iterator[None]:
    """Turn a database error into one :class:`~ragbudget.errors.IndexStorageError` line naming
    the (masked) index: never a traceback, never the password. ``hide`` masks the secrets of a
    connection's location in libpq's message (which quotes a piece it cannot parse, password
    and all); a query's messages hold none."""
    import psycopg

    try:
        yield
    except psycopg.Error as exc:
        line = first_line(exc) if hide is None else hide(first_line(exc))
        raise IndexStorageError(
            f"the index database {where} failed: {line}; check that the server is up, the location and "
            "credentials are right (password from the location, PGPASSWORD or PGPASSFILE) and that pgvector is "
            "installed"
        ) from None


def _no_nul(text: str, what: str, noted: set[str]) -> str:
    """``text`` without NUL bytes (PostgreSQL text cannot hold one), noted once per kind."""
    if "\x00" not in text:
        return text
    if what not in noted:
        noted.add(what)
        log.warning("removed NUL bytes from a %s: PostgreSQL text cannot hold them", what)
    return text.replace("\x00", "")


class PgCatalog:
    """Generation ``generation`` of the index in ``schema``, read through ``conn`` (autocommit:
    each query sees committed rows, and the generation filter keeps it to one generation).
    Thread-safe: one connection, one lock, as :class:`~ragbudget.retrieval.catalog.SqliteCatalog`."""

    #: Whether this generation's rows may still change (a writer's): then nothing counted is kept.
    mutable = False

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        schema: str,
        generation: int,
        *,
        where: str,
        reconnect: Callable[[], psycopg.Connection[Any]] | None = None,
    ) -> None:
        self.conn = conn
        self.s = schema
        self.g = generation
        self.where = where
        # A reader's queries are idempotent: a connection lost (a server restart, a failover, an
        # idle connection cut) is opened again once, so a long-lived server keeps answering.
        self._reconnect = reconnect
        self._lock = threading.RLock()
        # BM25's statistics of this generation, counted once (a writer's rows change: it never keeps them).
        self._stats: tuple[int, float] | None = None
        self._df: dict[str, int] = {}

    def use(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """``fn(connection)`` under the lock, a database error as one line; a reader whose
        connection broke reconnects and runs ``fn`` once more."""
        import psycopg

        with self._lock:
            try:
                with db_errors(self.where):
                    return fn(self.conn)
            except IndexStorageError:
                if self._reconnect is None or not (self.conn.closed or self.conn.broken):
                    raise
            log.info("the connection to %s was lost: reconnecting", self.where)
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
            with db_errors(self.where):
                self.conn = self._reconnect()
                return fn(self.conn)

    # The rows of table alias ``a`` this reader sees; ``%(g)s`` is the generation.
    def _vis(self, a: str) -> str:
        return f"({a}.gen_from <= %(g)s AND ({a}.gen_to IS NULL OR {a}.gen_to > %(g)s))"

    def _rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        query = sql.replace("{s}", self.s)
        values = {"g": self.g, **(params or {})}
        return self.use(lambda conn: conn.execute(query, values).fetchall())  # type: ignore[arg-type]

    def _one(self, sql: str, params: Mapping[str, Any] | None = None) -> Any:
        rows = self._rows(sql, params)
        return rows[0][0] if rows else None

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    # -- chunks and sources ----------------------------------------------------------------------

    def chunks(self, ids: Sequence[int]) -> dict[int, ChunkRow]:
        rows = self._rows(
            "SELECT c.id, c.text, c.n_tokens, c.headings, c.windows FROM {s}.chunks c "
            f"WHERE c.id = ANY(%(ids)s) AND {self._vis('c')}",
            {"ids": [int(i) for i in ids]},
        )
        return {int(i): ChunkRow(int(i), t, int(n), tuple(json.loads(h)), int(w)) for i, t, n, h, w in rows}

    def sources(self, ids: Sequence[int]) -> dict[int, list[SourceRow]]:
        out: dict[int, list[SourceRow]] = {}
        for cid, *src in self._rows(
            'SELECT s.chunk_id, s.path, s.start, s."end", s.page_start, s.page_end FROM {s}.sources s '
            f"WHERE s.chunk_id = ANY(%(ids)s) AND {self._vis('s')} ORDER BY s.chunk_id, s.ord",
            {"ids": [int(i) for i in ids]},
        ):
            out.setdefault(int(cid), []).append(SourceRow(*src))
        return out

    def sources_in(self, path: str) -> list[tuple[int, SourceRow]]:
        rows = self._rows(
            'SELECT s.chunk_id, s.path, s.start, s."end", s.page_start, s.page_end FROM {s}.sources s '
            f'WHERE s.path = %(p)s AND {self._vis("s")} ORDER BY s.start, s."end"',
            {"p": path},
        )
        return [(int(cid), SourceRow(*src)) for cid, *src in rows]

    def find_chunk(self, *hashes: str) -> tuple[int, int] | None:
        rows = self._rows(
            f"SELECT c.id, c.windows FROM {{s}}.chunks c WHERE c.content_hash = ANY(%(h)s) AND {self._vis('c')} "
            "ORDER BY c.id LIMIT 1",
            {"h": list(hashes)},
        )
        return (int(rows[0][0]), int(rows[0][1])) if rows else None

    def chunk_keys(self, ids: Sequence[int]) -> dict[int, tuple[str, bytes | None]]:
        rows = self._rows(
            "SELECT c.id, c.content_hash, c.minhash FROM {s}.chunks c "
            f"WHERE c.id = ANY(%(ids)s) AND {self._vis('c')}",
            {"ids": [int(i) for i in ids]},
        )
        return {int(i): (str(h), None if b is None else bytes(b)) for i, h, b in rows}

    def chunk_ids(self) -> NDArray[np.int64]:
        import numpy as np

        rows = self._rows(f"SELECT c.id FROM {{s}}.chunks c WHERE {self._vis('c')}")
        return np.array([r[0] for r in rows], dtype=np.int64)

    # -- files and roots -------------------------------------------------------------------------

    def files(self) -> list[FileRow]:
        rows = self._rows(
            "SELECT f.path, f.status, f.n_chunks, f.size, f.reason, f.detail, f.n_pages, f.warning, f.furniture "
            f"FROM {{s}}.files f WHERE {self._vis('f')}"
        )
        return [
            FileRow(p, st, int(n or 0), int(size), r, d, pg, w, int(fu or 0))
            for p, st, n, size, r, d, pg, w, fu in rows
        ]

    def file_states(self) -> dict[str, FileState]:
        rows = self._rows(
            "SELECT f.path, f.size, f.mtime_ns, f.sha256, f.status, f.reason, f.detail, f.needs "
            f"FROM {{s}}.files f WHERE {self._vis('f')}"
        )
        return {r[0]: FileState(int(r[1]), int(r[2]), *r[3:]) for r in rows}

    def page_labels(self) -> dict[str, list[str]]:
        return decode_page_labels(
            self._rows(
                f"SELECT f.path, f.page_labels FROM {{s}}.files f WHERE f.page_labels IS NOT NULL AND {self._vis('f')}"
            )
        )

    def roots(self) -> list[Root]:
        return [
            Root(p, lab, kind)
            for p, lab, kind in self._rows(f"SELECT r.path, r.label, r.kind FROM {{s}}.roots r WHERE {self._vis('r')}")
        ]

    def file_paths(self) -> list[str]:
        return [r[0] for r in self._rows(f"SELECT f.path FROM {{s}}.files f WHERE {self._vis('f')}")]

    # -- sentence vectors ------------------------------------------------------------------------

    def sentence_vectors(
        self, ids: Sequence[int], *, dim: int, dtype: str
    ) -> dict[int, tuple[list[bytes], NDArray[np.float32]]]:

        out: dict[int, tuple[list[bytes], NDArray[np.float32]]] = {}
        for cid, digests, blob in self._rows(
            "SELECT v.chunk_id, v.digests, v.vectors FROM {s}.sentence_vectors v "
            f"WHERE v.chunk_id = ANY(%(ids)s) AND {self._vis('v')}",
            {"ids": [int(i) for i in ids]},
        ):
            out[int(cid)] = decode_sentence_rows(digests, blob, dim=dim, dtype=dtype)
        return out

    def all_sentence_vectors(self, dim: int) -> dict[bytes, NDArray[np.float32]]:

        rows = self._rows(f"SELECT v.digests, v.vectors FROM {{s}}.sentence_vectors v WHERE {self._vis('v')}")
        return sentence_vectors_by_digest(rows, dim)

    # -- lexical ---------------------------------------------------------------------------------

    def has_lexical(self) -> bool:
        return True  # the tsvector column is part of the table

    def lexical(self, query: str, k: int, *, trusted: bool) -> list[tuple[int, float]]:
        """``(chunk_id, BM25)`` best first (ties by id) for the words of ``query`` OR-ed as the
        local index does (:func:`~ragbudget.retrieval.lexical.query_words`), scored as FTS5's
        ``bm25()``: ``k1`` 1.2, ``b`` 0.75, each word's idf ``ln((N - df + 0.5) / (df + 0.5))``
        (at least 1e-6) over this generation's chunks, a chunk's length its token count. ``[]``
        when the query has no word.

        PostgreSQL's own ``ts_rank_cd`` weighs every word alike, so a word in half the chunks
        counts as much as a name in one: on the SQuAD tuning split it put an answer-bearing
        chunk first for 46.7% of the questions against 83.7% for FTS5 BM25; this scoring gives
        83.0% (``bench/postgres.py --parts equality`` reports it on the test split). A word's
        term frequency is the positions its lexemes hold in the chunk's ``tsvector``
        (``setweight``/``ts_filter`` keep only the word's lexemes), so only matching chunks are
        read and the GIN index finds them."""
        words = query_words(query)
        if not words or k < 1:
            return []
        n, avgdl = self._lexical_stats()
        dfs = self._document_frequencies(words)
        idf = [_idf(n, df) for df in dfs]
        # MaxScore (Turtle & Flood), exact: score the chunks holding the rarest words first; a
        # chunk holding none of them scores less than the sum of its words' upper bounds
        # (idf × (k1 + 1): BM25's term saturates below it), so once the k-th score found is above
        # what the commonest words could add, they need not be matched at all. At 100k chunks
        # the common words of a question match most of them, which is what a full pass reads.
        order = sorted(range(len(words)), key=lambda i: (dfs[i], i))
        first: list[int] = []
        matched = 0  # chunks the first pass's words hold, at most
        for i in order:
            if first and matched + dfs[i] > LEXICAL_FIRST_PASS_CHUNKS:
                break
            first.append(i)
            matched += dfs[i]
        rows = self.bm25(words, idf, [words[i] for i in first], k, avgdl)
        if len(first) == len(words):
            return rows
        theta = rows[-1][1] if len(rows) == k else 0.0
        bound, skipped = 0.0, set()
        for i in reversed(order):  # the commonest first, while their bounds stay below theta
            if bound + idf[i] * (BM25_K1 + 1) >= theta:
                break
            bound += idf[i] * (BM25_K1 + 1)
            skipped.add(i)
        needed = [i for i in order if i not in skipped]
        if set(needed) <= set(first):
            return rows
        return self.bm25(words, idf, [words[i] for i in needed], k, avgdl)

    def bm25(
        self, words: list[str], idf: list[float], match: list[str], k: int, avgdl: float
    ) -> list[tuple[int, float]]:
        """The top ``k`` by BM25 over all of ``words`` among the chunks holding any of ``match``."""
        rows = self._rows(
            # One pass over each matching chunk's tsvector for all the query's lexemes
            # (setweight marks them, ts_filter keeps them), not one a word: the tsvector is read
            # (and detoasted) once a chunk, which is what a lexical search at 100k chunks costs.
            f"WITH t AS (SELECT w.word, w.idf, tsvector_to_array(to_tsvector('{TS_CONFIG}', w.word)) AS lex "
            "FROM unnest(%(words)s::text[], %(idf)s::float8[]) AS w(word, idf)), "
            "a AS (SELECT array_agg(DISTINCT l) AS lex FROM t, unnest(t.lex) AS l), "
            f"oq AS (SELECT websearch_to_tsquery('{TS_CONFIG}', %(q)s) AS q) "
            "SELECT c.id, SUM(x.idf * x.tf * %(k1p1)s / "
            "(x.tf + %(k1)s * (1 - %(b)s + %(b)s * c.n_tokens / %(avgdl)s))) AS score "
            "FROM {s}.chunks c CROSS JOIN oq CROSS JOIN a, "
            "LATERAL (SELECT t.idf, SUM(cardinality(u.positions))::float8 AS tf "
            "FROM unnest(ts_filter(setweight(c.tsv, 'A', a.lex), '{a}')) u JOIN t ON u.lexeme = ANY(t.lex) "
            "GROUP BY t.word, t.idf) x "
            f"WHERE c.tsv @@ oq.q AND {self._vis('c')} "
            "GROUP BY c.id ORDER BY score DESC, c.id LIMIT %(k)s",
            {
                "words": words,
                "idf": idf,
                "q": match_expression(match),
                "k": int(k),
                "k1": BM25_K1,
                "k1p1": BM25_K1 + 1,
                "b": BM25_B,
                "avgdl": max(avgdl, 1.0),
            },
        )
        return [(int(i), float(r)) for i, r in rows]

    def _lexical_stats(self) -> tuple[int, float]:
        """This generation's chunk count and mean length in tokens (a generation's rows never
        change, so a reader counts once)."""
        if self._stats is None or self.mutable:
            n, avgdl = self._rows(
                f"SELECT COUNT(*), COALESCE(AVG(c.n_tokens), 0) FROM {{s}}.chunks c WHERE {self._vis('c')}"
            )[0]
            self._stats = (int(n), float(avgdl))
        return self._stats

    def _document_frequencies(self, words: list[str]) -> list[int]:
        """How many of this generation's chunks hold each word (its lexemes), through the GIN
        index; a reader remembers them (up to :data:`DF_CACHE_WORDS` words)."""
        cache = self._df
        missing = [w for w in words if w not in cache or self.mutable]
        if missing:
            if len(cache) + len(missing) > DF_CACHE_WORDS:
                cache.clear()
            rows = self._rows(
                f"SELECT w.word, (SELECT COUNT(*) FROM {{s}}.chunks c, (SELECT {_WORD_QUERY} AS q) t "
                f"WHERE c.tsv @@ t.q AND {self._vis('c')}) FROM unnest(%(words)s::text[]) AS w(word)",
                {"words": missing},
            )
            fresh = {str(w): int(df) for w, df in rows}
            if self.mutable:
                return [fresh[w] for w in words]
            cache.update(fresh)
        return [cache[w] for w in words]

    # -- verify ----------------------------------------------------------------------------------

    def check(self, chunk_ids: NDArray[np.int64], manifest: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
        problems: list[str] = []
        checked: dict[str, Any] = {}
        vc, vs, vf = self._vis("c"), self._vis("s"), self._vis("f")
        if orphans := self._one(
            f"SELECT COUNT(*) FROM {{s}}.chunks c WHERE {vc} AND NOT EXISTS "
            f"(SELECT 1 FROM {{s}}.sources s WHERE s.chunk_id = c.id AND {vs})"
        ):
            problems.append(f"{orphans} chunk(s) without any source")
        if dangling := self._one(
            f"SELECT COUNT(*) FROM {{s}}.sources s WHERE {vs} AND NOT EXISTS "
            f"(SELECT 1 FROM {{s}}.chunks c WHERE c.id = s.chunk_id AND {vc})"
        ):
            problems.append(f"{dangling} source(s) pointing at no chunk")
        if unknown := self._one(
            f"SELECT COUNT(*) FROM {{s}}.sources s WHERE {vs} AND NOT EXISTS "
            f"(SELECT 1 FROM {{s}}.files f WHERE f.path = s.path AND f.status = 'indexed' AND {vf})"
        ):
            problems.append(f"{unknown} source(s) naming a file that is not indexed")
        checked["sources"] = int(self._one(f"SELECT COUNT(*) FROM {{s}}.sources s WHERE {vs}"))
        checked["files"] = int(self._one(f"SELECT COUNT(*) FROM {{s}}.files f WHERE {vf}"))
        checked["lexical_rows"] = int(
            self._one(f"SELECT COUNT(*) FROM {{s}}.chunks c WHERE {vc} AND c.tsv IS NOT NULL")
        )
        return problems, checked


class PgCatalogWriter(PgCatalog):
    """The catalog of generation ``generation`` being written, inside the writer's one
    transaction on ``conn`` (the storage commits it together with the manifest). ``gen_to IS
    NULL`` is what the writer sees: every older row is retired at or before this generation."""

    mutable = True

    def __init__(
        self, conn: psycopg.Connection[Any], schema: str, generation: int, *, where: str, next_id: int
    ) -> None:
        super().__init__(conn, schema, generation, where=where)
        self._next_id = next_id
        self._noted: set[str] = set()
        # The content hashes an orphan may have: the live chunks' when the first chunk is added
        # (read once, lazily, after a rebuild has retired them all). A chunk this run adds gets
        # its source at once, so it is never an orphan; without this set every chunk cost one
        # more round trip to ask (3 s of a 10.5 s build of 3,390 chunks).
        self._revivable: set[str] | None = None

    def _vis(self, a: str) -> str:
        return f"({a}.gen_to IS NULL)"

    def _run(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        with self._lock, db_errors(self.where):
            self.conn.execute(sql.replace("{s}", self.s), {"g": self.g, **(params or {})})  # type: ignore[arg-type]

    def _edit(self, table: str, where: str, params: Mapping[str, Any], assign: str) -> None:
        """Set ``assign`` on the live rows of ``table`` matching ``where``: a row of an older
        generation is copied into this one and retired (its readers keep it), a row this
        generation wrote is edited in place."""
        cols = ", ".join(_COLUMNS[table])
        t = f"{{s}}.{table}"
        self._run(
            f"INSERT INTO {t} ({cols}, gen_from) SELECT {cols}, %(g)s FROM {t} "
            f"WHERE ({where}) AND gen_to IS NULL AND gen_from < %(g)s",
            params,
        )
        self._run(f"UPDATE {t} SET gen_to = %(g)s WHERE ({where}) AND gen_to IS NULL AND gen_from < %(g)s", params)
        self._run(f"UPDATE {t} SET {assign} WHERE ({where}) AND gen_from = %(g)s AND gen_to IS NULL", params)

    def retire_rows(self, table: str, where: str, params: Mapping[str, Any] | None = None) -> None:
        """Remove the live rows of ``table`` matching ``where`` from this generation (rows an
        earlier generation made are retired, kept for its readers; this generation's are deleted)."""
        t = f"{{s}}.{table}"
        self._run(f"DELETE FROM {t} WHERE ({where}) AND gen_from = %(g)s", params)
        self._run(f"UPDATE {t} SET gen_to = %(g)s WHERE ({where}) AND gen_to IS NULL", params)

    def retire_all(self) -> None:
        """Start this generation empty (a rebuild): every live row is retired."""
        for table in VERSIONED:
            self.retire_rows(table, "TRUE")

    def ensure_lexical(self, *, trusted: bool) -> str:
        return "ok"  # generated by PostgreSQL from the text, always in step

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
        self.retire_rows("files", "path = %(p)s", {"p": path})
        clean = None if detail is None else _no_nul(detail, "skip detail", self._noted)
        self._run(
            "INSERT INTO {s}.files (path, gen_from, size, mtime_ns, sha256, status, reason, detail, n_chunks, "
            "furniture, n_pages, warning, page_labels, needs) VALUES (%(p)s, %(g)s, %(size)s, %(m)s, %(d)s, "
            "%(st)s, %(r)s, %(det)s, %(n)s, %(fu)s, %(pg)s, %(w)s, %(l)s, %(ne)s)",
            {
                "p": path,
                "size": int(size),
                "m": int(mtime_ns),
                "d": digest,
                "st": status,
                "r": reason,
                "det": clean,
                "n": int(n_chunks),
                "fu": int(furniture),
                "pg": pages,
                "w": None if warning is None else _no_nul(warning, "warning", self._noted),
                "l": labels,
                "ne": needs,
            },
        )

    def touch_file(self, path: str, mtime_ns: int) -> None:
        self._edit("files", "path = %(p)s", {"p": path, "m": int(mtime_ns)}, "mtime_ns = %(m)s")

    def drop_sources(self, path: str) -> None:
        self.retire_rows("sources", "path = %(p)s", {"p": path})

    def drop_files(self, paths: Iterable[str]) -> None:
        ps = list(paths)
        self.retire_rows("sources", "path = ANY(%(ps)s)", {"ps": ps})
        self.retire_rows("files", "path = ANY(%(ps)s)", {"ps": ps})

    def set_roots(self, roots: Iterable[Root]) -> None:
        new = {(r.path, r.label, r.kind) for r in roots}
        if new == {(r.path, r.label, r.kind) for r in self.roots()}:
            return  # unchanged: no row is rewritten
        self.retire_rows("roots", "TRUE")
        for path, label, kind in sorted(new):
            self._run(
                "INSERT INTO {s}.roots (path, gen_from, label, kind) VALUES (%(p)s, %(g)s, %(l)s, %(k)s)",
                {"p": path, "l": label, "k": kind},
            )

    # -- chunks ----------------------------------------------------------------------------------

    def kept_chunks(self) -> Iterator[tuple[int, str, bytes | None]]:
        rows = self._rows(
            "SELECT c.id, c.content_hash, c.minhash FROM {s}.chunks c WHERE c.gen_to IS NULL AND EXISTS "
            "(SELECT 1 FROM {s}.sources s WHERE s.chunk_id = c.id AND s.gen_to IS NULL) ORDER BY c.id"
        )
        for cid, h, blob in rows:
            yield int(cid), str(h), None if blob is None else bytes(blob)

    def revive(self, content_hash: str, headings: Sequence[str]) -> int | None:
        if self._revivable is None:
            self._revivable = {
                str(r[0]) for r in self._rows("SELECT DISTINCT c.content_hash FROM {s}.chunks c WHERE c.gen_to IS NULL")
            }
        if content_hash not in self._revivable:
            return None
        cid = self._one(
            "SELECT c.id FROM {s}.chunks c WHERE c.content_hash = %(h)s AND c.gen_to IS NULL AND NOT EXISTS "
            "(SELECT 1 FROM {s}.sources s WHERE s.chunk_id = c.id AND s.gen_to IS NULL) ORDER BY c.id LIMIT 1",
            {"h": content_hash},
        )
        if cid is None:
            return None
        heads = json.dumps(list(headings))  # JSON escapes a NUL: nothing to remove
        self._edit("chunks", "id = %(i)s", {"i": int(cid), "hd": heads}, "headings = %(hd)s")
        return int(cid)

    def add_chunk(
        self, text: str, n_tokens: int, headings: Sequence[str], content_hash: str, minhash: bytes | None
    ) -> int:
        cid, self._next_id = self._next_id, self._next_id + 1
        self._run(
            "INSERT INTO {s}.chunks (id, gen_from, text, n_tokens, headings, content_hash, minhash, windows) "
            "VALUES (%(i)s, %(g)s, %(t)s, %(n)s, %(hd)s, %(h)s, %(mh)s, 0)",
            {
                "i": cid,
                "t": _no_nul(text, "chunk text", self._noted),
                "n": int(n_tokens),
                "hd": json.dumps(list(headings)),
                "h": content_hash,
                "mh": minhash,
            },
        )
        return cid

    def add_source(self, chunk_id: int, src: SourceRow) -> None:
        self._run(
            'INSERT INTO {s}.sources (chunk_id, gen_from, path, start, "end", page_start, page_end, ord) '
            "SELECT %(c)s, %(g)s, %(p)s, %(a)s, %(b)s, %(ps)s, %(pe)s, COALESCE(MAX(ord), -1) + 1 "
            "FROM {s}.sources WHERE chunk_id = %(c)s AND gen_to IS NULL",
            {"c": int(chunk_id), "p": src.path, "a": src.start, "b": src.end, "ps": src.page_start, "pe": src.page_end},
        )

    def set_windows(self, pairs: Iterable[tuple[int, int]]) -> None:
        by_windows: dict[int, list[int]] = {}
        for i, w in pairs:
            by_windows.setdefault(int(w), []).append(int(i))
        for w, ids in by_windows.items():
            # Only rows whose value changes are copied into this generation.
            self._edit("chunks", "id = ANY(%(ids)s) AND windows <> %(w)s", {"ids": ids, "w": w}, "windows = %(w)s")

    def remove_orphans(self) -> list[int]:
        ids = [
            int(r[0])
            for r in self._rows(
                "SELECT c.id FROM {s}.chunks c WHERE c.gen_to IS NULL AND NOT EXISTS "
                "(SELECT 1 FROM {s}.sources s WHERE s.chunk_id = c.id AND s.gen_to IS NULL)"
            )
        ]
        if ids:
            self.retire_rows("chunks", "id = ANY(%(ids)s)", {"ids": ids})
            self.retire_rows("sentence_vectors", "chunk_id = ANY(%(ids)s)", {"ids": ids})
        return ids

    # -- sentence vectors ------------------------------------------------------------------------

    def chunks_without_sentence_vectors(self) -> list[tuple[int, str]]:
        rows = self._rows(
            "SELECT c.id, c.text FROM {s}.chunks c WHERE c.gen_to IS NULL AND NOT EXISTS "
            "(SELECT 1 FROM {s}.sentence_vectors v WHERE v.chunk_id = c.id AND v.gen_to IS NULL) ORDER BY c.id"
        )
        return [(int(i), str(t)) for i, t in rows]

    def put_sentence_vectors(self, rows: Iterable[tuple[int, bytes, bytes]]) -> None:
        for cid, digests, blob in rows:
            self.retire_rows("sentence_vectors", "chunk_id = %(c)s", {"c": int(cid)})
            self._run(
                "INSERT INTO {s}.sentence_vectors (chunk_id, gen_from, digests, vectors) "
                "VALUES (%(c)s, %(g)s, %(d)s, %(v)s)",
                {"c": int(cid), "d": digests, "v": blob},
            )

    def drop_sentence_vectors(self) -> None:
        self.retire_rows("sentence_vectors", "TRUE")

    # -- commit ----------------------------------------------------------------------------------

    def count_chunks(self) -> int:
        return int(self._one("SELECT COUNT(*) FROM {s}.chunks WHERE gen_to IS NULL"))

    def counts(self) -> dict[str, int]:
        def one(sql: str) -> int:
            return int(self._one(sql))

        return {
            "chunks": one("SELECT COUNT(*) FROM {s}.chunks WHERE gen_to IS NULL"),
            "sources": one("SELECT COUNT(*) FROM {s}.sources WHERE gen_to IS NULL"),
            "files": one("SELECT COUNT(*) FROM {s}.files WHERE gen_to IS NULL AND status = 'indexed'"),
            "files_skipped": one("SELECT COUNT(*) FROM {s}.files WHERE gen_to IS NULL AND status <> 'indexed'"),
            "windowed_chunks": one("SELECT COUNT(*) FROM {s}.chunks WHERE gen_to IS NULL AND windows > 1"),
            "lexical_rows": one("SELECT COUNT(*) FROM {s}.chunks WHERE gen_to IS NULL"),
            "sentence_vectors": one("SELECT COUNT(*) FROM {s}.sentence_vectors WHERE gen_to IS NULL"),
        }

    def finish(self, generation: int, *, vacuum: bool = False) -> None:
        """Nothing to stamp: every row already names its generation (the storage commits)."""

    def discard(self) -> None:
        """The storage rolls the writer's transaction back."""
