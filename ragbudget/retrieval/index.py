"""The index, read: open the current generation, search it (dense, lexical, fused), verify it.

:class:`Index` is the one object callers hold. It reads through a storage
(:mod:`ragbudget.retrieval.storage`: where the index lives, its layout, generations and
checksums; a local folder today) and writes through :mod:`ragbudget.retrieval.build`
(:meth:`Index.build`). A reader loads the generation the manifest names, checks every file
against its sha256, keeps the vectors in memory (or, behind an approximate store, the exact
matrix read by row) and the catalog open read-only; a writer committing a newer generation never
disturbs it, and the reader's next search follows it (:meth:`Index.follow`), while a call in
flight keeps the one it pinned (:meth:`Index.pinned`, :mod:`ragbudget.retrieval.reader`).

**Hybrid search.** ``search(..., hybrid=True)`` fuses the dense candidates with BM25 candidates
from the catalog's FTS5 table (normalized score fusion by default, or reciprocal rank fusion). An
index built without the table still opens: the table is built in memory on first lexical use
(logged), and the next ``build`` stores it. A Python whose SQLite lacks FTS5 logs that once and
searches dense only.

>>> from ragbudget.retrieval.embed import HashEmbedder
>>> idx = Index("/tmp/rb-doctest-index")                      # doctest: +SKIP
>>> idx.build(["docs/"], embedder=HashEmbedder()).chunks_total  # doctest: +SKIP
42
>>> idx.search("how do I appoint a delegate?", k=3)[0].sources  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, IndexCorruptError, IndexMismatchError, IndexNotFoundError
from ..settings import DEDUP_MODES, ChunkSettings, DedupSettings, RetrievalSettings, from_keywords
from ..types import DEFAULT_INDEX_DIR, Hit, IndexedFile, IndexSummary, Source, VerifyReport
from .build import ProgressCallback, build_index
from .changes import REMOVAL_GUARD_FILES, REMOVAL_GUARD_SHARE
from .lexical import FUSIONS, fts5_available, fts_match_query, fuse_checked, fuse_scores
from .manifest import FORMAT_VERSION
from .reader import Opened, Reader
from .roots import Roots, fallback_root
from .scope import Sources, cached_scope, dense_in, in_scope_first, lexical_in, query_row, scope_of, source_patterns
from .storage import open_storage, stores_sentences

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import ArrayLike, NDArray
    from typing_extensions import Self

    from ..packing.spans import SpanScorer
    from .catalog import SourceRow
    from .embed import Embedder
    from .executors import EmbedExecutor
    from .storage import Generation, Manifest, Storage

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


class Index:
    """An index: open it to search, or build/update it from files.

    ``Index(path)`` never touches the disk until used; :meth:`open` requires an existing index.
    ``search_threads`` is the OpenMP thread count for one query (default 1, see the comment in
    ``__init__``); ``use_approx=False`` searches the exact store even when the index has an
    approximate one. Reading loads the manifest-named generation, checks sha256 checksums
    (``verify_checksums``), and keeps the vectors in memory and the catalog open read-only.

    **Paths.** The index records the roots it was given (each folder or file passed to
    :meth:`build`, labelled by its base name). Every path it returns (``Source.path``,
    :meth:`sources`, summaries) is a *display path*: the root's label, then the path below it
    (``notes/deep/guide.pdf``), never an absolute filesystem path, so nothing private reaches a
    prompt, a log or an HTTP client. ``absolute_paths=True`` (a local CLI's opt-in) returns the
    absolute paths instead; :meth:`absolute_path` maps one display path back. Methods taking a
    path accept either form.

    **Building.** :meth:`build` reads files and folders into the index. ``chunking`` (a
    :class:`~ragbudget.settings.ChunkSettings`, or its keywords ``min_tokens``, ``max_tokens``,
    ``overlap``, ``sentence_vectors``) sizes the chunks and says whether every chunk's sentence vectors
    are stored for span packing (by default what the index has, none for a new one: span packing then
    embeds a sentence the first time a question needs it; turning it off drops them from the index,
    turning it on embeds them for every chunk, with no file changed). ``dedup`` is ``"near"`` (content hash +
    MinHash at ``near_threshold``), ``"exact"`` or ``"none"``, or a
    :class:`~ragbudget.settings.DedupSettings` holding those and the MinHash ``shingle`` (words per
    shingle; an index records it, and one built before it did keeps 3). ``clean`` strips page furniture
    and corpus boilerplate (on by default). Settings that change the vectors or the chunks (embedder,
    chunking, dedup, cleaning) trigger a full rebuild, reported in ``rebuild_reason``.

    ``store`` picks the vector store that answers searches (:mod:`ragbudget.retrieval.vectors`):
    ``"auto"`` (exact while the vectors are small enough to scan within the latency target, then HNSW,
    then IVF-PQ; see :func:`~ragbudget.retrieval.vectors.choose_store`), ``"flat"``, ``"hnsw"``,
    ``"ivf"`` (IVF-PQ with exact rescoring), ``"ivf-flat"``, or the name of a store another package
    registers in the ``ragbudget.stores`` entry point group; an approximate store is tuned against exact
    search (HNSW on pseudo-questions made from the chunks, IVF on the index's own vectors) and its recall
    recorded in the manifest. ``executor`` says where chunks are embedded
    (:mod:`ragbudget.retrieval.executors`): ``"local"`` (this process), ``"ray"`` (Ray Data on the
    cluster ``RAY_ADDRESS`` names, or a local one) or an executor object such as
    ``RayExecutor(address=..., workers=...)``; the index it writes is the same (vectors equal within
    float rounding). Files stream through in batches of ``batch_files``; chunks are embedded
    ``embed_batch`` at a time, so memory grows with the batch, not the corpus — except for what every
    chunk keeps in memory during a build: its vector (4·dim bytes, 1.5 KB for MiniLM) and, with
    ``dedup="near"``, its MinHash signature in the LSH index (4·num_perm bytes + buckets).

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
        #: Where the index lives and how its generations are read and committed: a folder, a
        #: PostgreSQL database for a URL or keyword/value string, or an installed storage for a
        #: URL of its scheme (:func:`~ragbudget.retrieval.storage.open_storage`).
        self.storage: Storage = open_storage(path)
        #: The index's folder (``None`` for an index in a database or another storage without one).
        self.path: Path | None = self.storage.folder
        #: Where the index lives, as messages show it (a URL's password masked).
        self.where = self.storage.where
        self.absolute_paths = absolute_paths
        self.verify_checksums = verify_checksums
        self.use_approx = use_approx
        # One query is memory-bound: extra OpenMP threads barely help, and on busy cores their
        # spin-waits made a 20k-vector flat search 10x slower (82 ms vs 7 ms measured on 2 cores).
        # None leaves FAISS's global thread setting alone.
        self.search_threads = search_threads
        self._manifest: Manifest | None = None
        # The generations open: the newest, and older ones that calls in flight still pin.
        self._reader = Reader(self.storage, self._open_current)
        self._embedder: Embedder | None = None

    def __repr__(self) -> str:
        return f"Index({self.where!r})"

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str] = DEFAULT_INDEX_DIR, **kwargs: Any) -> Index:
        """Open an existing index (raises :class:`IndexNotFoundError` when there is none)."""
        idx = cls(path, **kwargs)
        idx._read_manifest()
        return idx

    @property
    def exists(self) -> bool:
        return self.storage.exists()

    @property
    def manifest(self) -> Manifest:
        """The manifest of the generation in use: this thread's pinned one (:meth:`pinned`), else
        the one open, else the current one (read on first access)."""
        opened = self._reader.held()
        if opened is not None:
            return opened.gen.manifest
        if self._manifest is None:
            self._read_manifest()
        assert self._manifest is not None
        return self._manifest

    def _read_manifest(self) -> Manifest:
        data = self.storage.read_manifest()
        self._manifest = data
        return data

    @property
    def generation(self) -> Generation:
        """The generation in use, open on first access: its ``manifest``, its ``exact`` and
        ``search`` vector stores and its ``catalog`` (:class:`~ragbudget.retrieval.storage.Generation`),
        for tools that read an index's parts directly. Read it, never write it: a writing run
        commits a new generation (:meth:`build`), which :meth:`follow`, :meth:`pinned` and
        :meth:`reload` open."""
        return self._generation()

    def _opened(self) -> Opened:
        """This thread's pinned generation, else the one open, else the current one, opened."""
        return self._reader.opened()

    def _open_current(self) -> Opened:
        """The generation the manifest names, open (retrying if a writer just swapped it)."""
        for attempt in range(3):
            m = self.storage.read_manifest()
            try:
                gen = self.storage.open(m, verify_checksums=self.verify_checksums, search_store=self.use_approx)
            except IndexCorruptError:
                # The writer may have committed a newer generation and removed this one
                # between our manifest read and the file opens; re-read once or twice.
                if attempt == 2 or self.storage.read_manifest().get("generation") == m["generation"]:
                    raise
                continue
            return Opened(gen, self._load_roots(gen))
        raise AssertionError("unreachable")

    def _generation(self) -> Generation:
        return self._opened().gen

    def _load(self) -> None:
        """Open the generation in use now (it opens on first use anyway)."""
        self._generation()

    def follow(self) -> bool:
        """Open the newest committed generation if a writer committed one since this index opened
        its own (one manifest read: a ``stat`` locally, one small row in a database), so that a
        long-running reader — ``ragbudget serve``, a notebook — answers from what the last
        ``ragbudget index`` wrote. Calls in flight keep the generation they pinned; the old one
        closes when the last of them ends. Returns whether it moved. A generation written with
        another embedder or dimension is not followed (logged once; :meth:`reload` opens it).
        :meth:`search` and :meth:`pinned` call it (:mod:`ragbudget.retrieval.reader`)."""
        return self._reader.follow()

    def pinned(self) -> contextlib.AbstractContextManager[Generation]:
        """Follow the newest commit (:meth:`follow`), then read that one generation for the whole
        block in this thread, however many commits land meanwhile: what a request needs, so that
        its search, its chunks and its sentence vectors all come from one generation (the answer
        cites it). Nested blocks share the outer one's generation.

        >>> with idx.pinned() as gen:                      # doctest: +SKIP
        ...     hits = idx.search("delegate"); gen.number
        3
        """
        return self._reader.pinned()

    def _load_roots(self, gen: Generation) -> Roots:
        roots = gen.catalog.roots()
        if not roots:
            fallback = fallback_root(gen.catalog.file_paths())
            if fallback is not None:
                log.warning(
                    "the index in %s records no roots (written by an older ragbudget): paths are "
                    "shown relative to their common folder, as %s/...; the next `ragbudget index` "
                    "run records the roots",
                    self.storage.where,
                    fallback.label,
                )
                roots = [fallback]
        return Roots(roots)

    def _paths(self) -> Roots:
        return self._opened().roots

    def _show(self, path: str) -> str:
        return path if self.absolute_paths else self._paths().display(path)

    def absolute_path(self, path: str) -> str | None:
        """The absolute filesystem path of a display path (``Source.path``), for local tools
        that open the file; ``None`` when no recorded root matches. Never send it to a client.

        >>> idx.absolute_path("notes/deep/guide.pdf")        # doctest: +SKIP
        '/home/me/notes/deep/guide.pdf'
        """
        return self._paths().absolute(path)

    def roots(self) -> list[str]:
        """The labels of the recorded roots (the first part of every display path)."""
        return self._paths().labels()

    def sources(self) -> list[IndexedFile]:
        """Every file the index knows, indexed or skipped, by display path."""
        rows = self._generation().catalog.files()
        roots = self._paths()
        out = [
            IndexedFile(
                self._show(f.path),
                f.status,
                f.n_chunks,
                f.n_pages,
                f.size if f.size >= 0 else None,
                f.reason,
                f.detail if self.absolute_paths else roots.scrub(f.detail),
                f.warning,
            )
            for f in rows
        ]
        return sorted(out, key=lambda f: f.path)

    def close(self) -> None:
        """Release the generation in use (reopened on next use; calls pinning it keep it until
        they end)."""
        self._reader.release()  # under the reader's own lock
        self._manifest = None

    def reload(self) -> None:
        """Open the newest committed generation, whatever it was written with (:meth:`follow`
        refuses another embedder's)."""
        self.close()
        self._generation()

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
        query_vector: ArrayLike | None = None,
        sources: Sources | None = None,
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
        so that it is not embedded again (a pipeline reuses it to score sentences). ``sources``
        scopes the search to some files: a display path, a folder or a glob over them, or a list
        of those (:mod:`ragbudget.retrieval.scope`); only chunks from those files are returned.

        >>> idx.search("who founded the guild?", k=5, hybrid=True)[0].score   # doctest: +SKIP
        >>> idx.search("is it loud?", sources="reviews/B00X*.txt")            # doctest: +SKIP
        """
        scope = scope_of(sources)
        with self.pinned():  # one generation for the dense, lexical and chunk reads alike
            hits = self._search(
                query, k, embedder, retrieval, hybrid, lexical_weight, fusion, candidates, query_vector, scope
            )
            return hits if scope is None else in_scope_first(hits, scope, self._paths())

    def _search(
        self,
        query: str,
        k: int,
        embedder: Embedder | None,
        retrieval: RetrievalSettings | None,
        hybrid: bool | None,
        lexical_weight: float | None,
        fusion: str | None,
        candidates: int | None,
        query_vector: ArrayLike | None,
        patterns: tuple[str, ...] | None = None,
    ) -> list[Hit]:
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
        vector = emb.embed_query(query) if query_vector is None else query_vector
        scope = None if patterns is None else cached_scope(self._opened(), patterns)
        if not settings.hybrid or settings.lexical_weight == 0.0:
            return self._dense(vector, k, scope)
        pool = max(k, candidates or settings.fetch_k)
        lexical = dict(self._lexical(query, pool, scope))
        if not lexical:  # no FTS5, or no query word in any chunk: the dense search, unchanged
            return self._dense(vector, k, scope)
        dense_hits = self._dense(vector, pool, scope)
        dense = {h.chunk_id: h.score for h in dense_hits}
        missing = [i for i in lexical if i not in dense]
        # A chunk found only by BM25 still gets its real cosine (vectors are in the exact store),
        # so score fusion normalizes true similarities, not a guess.
        dense.update(self._cosines(vector, missing))
        fused = fuse_checked(dense, lexical, settings.fusion, settings.lexical_weight)[:k]
        known = {h.chunk_id: h for h in dense_hits}
        need = [i for i, _ in fused if i not in known]
        known.update({h.chunk_id: h for h in self.get_chunks(need)})
        return [_with_score(known[i], s) for i, s in fused if i in known]

    def embed_query(self, query: str, *, embedder: Embedder | None = None) -> NDArray[np.float32]:
        """``query``'s vector as :meth:`search` embeds it: with ``embedder`` (default: the index's
        own), refused when that is not the embedder the index was built with."""
        emb = embedder or self.embedder
        self._check_embedder(emb)
        return emb.embed_query(query)

    def sentence_vectors(self, ids: Iterable[int]) -> dict[int, tuple[list[bytes], NDArray[np.float32]]]:
        """The stored sentence vectors of chunks ``ids``: ``{chunk_id: (digests, vectors)}``,
        one :func:`~ragbudget.packing.spans.sentence_digest` and one float32 row per sentence of the
        chunk (as :func:`~ragbudget.packing.spans.split_sentences` cuts it at build time), embedded with
        the index's embedder. What :class:`~ragbudget.packing.spans.SpanScorer` reads (``stored=``) so a
        question embeds no sentence. Chunks without them (an index written before they were
        stored, or by an older writer) are left out: the scorer embeds those on first use."""
        want = [int(i) for i in ids]
        if not want or not self.has_sentence_vectors:
            return {}
        m = self.manifest
        dtype = str((m.get("sentences") or {}).get("dtype", "float16"))
        return self._generation().catalog.sentence_vectors(want, dim=int(m["dim"]), dtype=dtype)

    def span_scorer(self, embedder: Embedder | None = None) -> SpanScorer:
        """A :class:`~ragbudget.packing.spans.SpanScorer` over this index's sentences: the vectors
        stored at build time first, then the :class:`~ragbudget.retrieval.sentence_cache.SentenceCache`
        beside a local index (sentences embedded at question time, kept for later questions and
        processes; an index in a database has no folder: embedded per process)."""
        from ..packing.spans import SpanScorer
        from .sentence_cache import SentenceCache

        m = self.manifest
        persist = SentenceCache(self.path, identity=m["embedder"], dim=int(m["dim"])) if self.path is not None else None
        return SpanScorer(embedder or self.embedder, stored=self.sentence_vectors, persist=persist)

    @property
    def has_sentence_vectors(self) -> bool:
        """Whether the generation in use stores every chunk's sentence vectors: built with
        ``sentence_vectors=True`` by a version that stores them. ``False``: span
        packing embeds the pool's sentences at question time."""
        return stores_sentences(self.manifest)

    def search_lexical(self, query: str, k: int = 5) -> list[Hit]:
        """The ``k`` chunks with the best BM25 score for ``query`` (``score`` = BM25, higher is
        better). Any text is safe: FTS5 syntax in it is matched as plain words
        (:func:`fts_match_query`). ``[]`` without FTS5 (logged once)."""
        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        with self.pinned():
            pairs = self._lexical(query, k)
            by_id = {h.chunk_id: h for h in self.get_chunks([i for i, _ in pairs])}
        return [_with_score(by_id[i], s) for i, s in pairs if i in by_id]

    @property
    def has_lexical(self) -> bool:
        """Whether the generation in use stores an up-to-date FTS5 table (older indexes, and ones
        written by a Python without FTS5, do not)."""
        gen = self._generation()
        return bool(gen.manifest.get("lexical")) and gen.catalog.has_lexical()

    def _lexical(self, query: str, k: int, scope: frozenset[int] | None = None) -> list[tuple[int, float]]:
        gen = self._generation()
        if scope is not None:
            return lexical_in(gen, query, k, scope)
        return gen.catalog.lexical(query, k, trusted=bool(gen.manifest.get("lexical")))

    def chunks_in(self, sources: Sources) -> frozenset[int]:
        """The ids of the chunks located in the files ``sources`` names (a display path, a
        folder or a glob over them, or a list of those: :mod:`ragbudget.retrieval.scope`), what a
        search with ``sources=`` is limited to. Raises :class:`~ragbudget.errors.ConfigError`
        when a pattern names no indexed file."""
        patterns = source_patterns(sources)
        with self.pinned():
            return cached_scope(self._opened(), patterns)

    def _dense(self, vector: ArrayLike, k: int, scope: frozenset[int] | None) -> list[Hit]:
        """The dense search, within ``scope`` when there is one."""
        if scope is None:
            pairs = self._store_top(query_row(vector, self.manifest), k)
        else:
            pairs = dense_in(self._generation(), vector, k, scope)
        by_id = {h.chunk_id: h for h in self.get_chunks([i for i, _ in pairs])}
        return [_with_score(by_id[i], s) for i, s in pairs if i in by_id]

    def _cosines(self, vector: ArrayLike, ids: Sequence[int]) -> dict[int, float]:
        import numpy as np

        if not ids:
            return {}
        exact = self._generation().exact
        q = np.asarray(vector, dtype=np.float32).reshape(-1)
        out = {}
        for i in ids:
            try:
                out[int(i)] = float(exact.vectors([int(i)])[0] @ q)
            except KeyError:  # no vector for this id (verify reports such an index)
                continue
        return out

    def _check_embedder(self, emb: Embedder) -> None:
        want = self.manifest["embedder"]
        if emb.id != want.get("id"):
            raise IndexMismatchError(
                f"the index was built with embedder {want.get('id')!r}, the query would be embedded "
                f"with {emb.id!r}; search with the same embedder or rebuild the index"
            )

    def search_vector(self, vector: ArrayLike, k: int = 5) -> list[Hit]:
        """Search with a ready query vector (unit length, the index's dimension)."""
        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        with self.pinned():
            return self._dense(vector, k, None)

    def _store_top(self, q: NDArray[np.float32], k: int) -> list[tuple[int, float]]:
        """``(chunk_id, score)`` of the store's own top ``k`` for the one-row query ``q``, on
        ``search_threads`` threads when set."""
        store = self._generation().search
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
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]

    def get_chunks(self, ids: Iterable[int]) -> list[Hit]:
        """Chunks by id, in the order given (unknown ids are left out); ``score`` is 0."""
        want = [int(i) for i in ids]
        if not want:
            return []
        catalog = self._generation().catalog
        rows, srcs = catalog.chunks(want), catalog.sources(want)
        return [
            Hit(
                r.id,
                0.0,
                r.text,
                r.n_tokens,
                r.headings,
                tuple(self._source(s) for s in srcs.get(r.id, ())),
                r.windows,
            )
            for r in (rows[i] for i in want if i in rows)
        ]

    def chunks_of(self, path: str) -> list[tuple[Source, int]]:
        """Every ``(source, chunk_id)`` located in file ``path`` (a display path, as in
        ``Source.path``, or an absolute one), in document order."""
        stored = self._paths().absolute(str(path))
        if stored is None:
            return []
        return [(self._source(src), cid) for cid, src in self._generation().catalog.sources_in(stored)]

    def _source(self, src: SourceRow) -> Source:
        """A stored source as a :class:`Source`: display path, and the label of its pages where
        the file's format names them (slide, cell, rows, chapter, message)."""
        labels = self._labels_of().get(src.path)
        label = None
        if labels:
            from ..input.formats import page_label

            label = page_label(labels, src.page_start, src.page_end)
        return Source(self._show(src.path), src.start, src.end, src.page_start, src.page_end, label)

    def _labels_of(self) -> dict[str, list[str]]:
        """``{stored path: page labels}`` of the files whose format names its pages, read once
        per loaded generation (few files have them; the rest cost nothing)."""
        opened = self._opened()
        if opened.page_labels is None:
            opened.page_labels = opened.gen.catalog.page_labels()
        return opened.page_labels

    def neighbors(self, chunk_id: int, *, path: str | None = None) -> tuple[Hit | None, Hit | None]:
        """The chunks just before and after ``chunk_id`` in the same document (its first source,
        or the source in ``path``); ``None`` at either end. Lets a selector merge adjacent chunks
        (compare ``Source.end``/``start`` to see whether they touch)."""
        hit = next(iter(self.get_chunks([chunk_id])), None)
        if hit is None or not hit.sources:
            return None, None
        roots = self._paths()
        want = None if path is None else roots.absolute(str(path))
        src = next((s for s in hit.sources if want is None or roots.absolute(s.path) == want), hit.sources[0])
        seq = self.chunks_of(src.path)
        pos = next(i for i, (s, c) in enumerate(seq) if c == chunk_id and s.start == src.start)
        prev = seq[pos - 1][1] if pos > 0 else None
        nxt = seq[pos + 1][1] if pos + 1 < len(seq) else None
        got = {h.chunk_id: h for h in self.get_chunks([i for i in (prev, nxt) if i is not None])}
        return (got.get(prev) if prev is not None else None, got.get(nxt) if nxt is not None else None)

    def stats(self) -> dict[str, Any]:
        """Counts and settings, from the manifest (no file is read beyond it; a database index
        asks the database for its tables' size)."""
        m = self.manifest
        return {
            "index_dir": self.where,
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
            # What the search store was tuned on, and its recall there (pseudo-questions: HNSW).
            "recall_tuned_on": (m.get("approx") or {}).get("tuned_on"),
            "recall_at_10_questions": (m.get("approx") or {}).get("recall_at_10_questions"),
            "lexical": (m.get("lexical") or {}).get("kind"),
            "roots": [r.get("label") for r in m.get("roots") or ()],
            **m.get("counts", {}),
            "bytes": self.storage.size_bytes(m),
        }

    def verify(self) -> VerifyReport:
        """Check everything: checksums, vector ids ↔ chunk rows one-to-one, every chunk has a
        source, every source names an indexed file, counts match the manifest."""
        import numpy as np

        problems: list[str] = []
        checked: dict[str, Any] = {}
        try:
            self.close()
            gen = self._generation()
        except (IndexCorruptError, IndexNotFoundError) as exc:
            return VerifyReport(False, (str(exc),), checked)
        m = gen.manifest
        flat, search = gen.exact, gen.search
        ids = flat.ids()
        checked["vectors"] = flat.ntotal
        if len(ids) != len(np.unique(ids)):
            problems.append("a vector id appears more than once")
        chunk_ids = gen.catalog.chunk_ids()
        checked["chunks"] = len(chunk_ids)
        only_vectors = np.setdiff1d(ids, chunk_ids)
        only_db = np.setdiff1d(chunk_ids, ids)
        if len(only_vectors):
            problems.append(f"{len(only_vectors)} vector id(s) without a chunk row, e.g. {only_vectors[:5].tolist()}")
        if len(only_db):
            problems.append(f"{len(only_db)} chunk row(s) without a vector, e.g. {only_db[:5].tolist()}")
        if flat.dim != int(m["dim"]):
            problems.append(f"vector dimension {flat.dim} != manifest dim {m['dim']}")
        if search is not flat:
            problems += self._verify_search_store(gen, checked)
        more, found = gen.catalog.check(chunk_ids, m)
        problems += more
        checked.update(found)
        counts = m.get("counts", {})
        if counts.get("chunks") not in (None, checked["chunks"]):
            problems.append(f"manifest counts {counts['chunks']} chunks, the catalog has {checked['chunks']}")
        checked["generation"] = m["generation"]
        return VerifyReport(not problems, tuple(problems), checked)

    def _verify_search_store(self, gen: Generation, checked: dict[str, Any]) -> list[str]:
        """The search store holds every vector and still reaches the recall the manifest records."""
        from .recall import RECALL_TOLERANCE, measure_recall

        entry = gen.manifest["approx"]
        kind = entry.get("kind")
        problems = []
        if gen.search.ntotal != gen.exact.ntotal:
            problems.append(f"the {kind} store has {gen.search.ntotal} vectors, flat has {gen.exact.ntotal}")
        recorded = entry.get("recall_at_10")
        if recorded is not None:
            # Same seed, same sample of queries as at build time: only a changed store moves it.
            recall, nq = measure_recall(gen.search, gen.exact, queries=int(entry.get("recall_queries") or 200))
            checked["recall_at_10"] = round(recall, 4)
            checked["recall_recorded"] = recorded
            if recall < float(recorded) - RECALL_TOLERANCE:
                problems.append(
                    f"the {kind} store's recall@10 is {recall:.3f} on {nq} queries, the "
                    f"manifest records {recorded}; rebuild the index (`ragbudget index PATH --rebuild`)"
                )
        return problems

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
        """Index ``paths`` (files or folders), incrementally. Returns an :class:`IndexSummary`; the options are
        described under **Building** in the :class:`Index` docstring.

        A run **adds and updates**: new and changed files under ``paths`` are (re)indexed, files under other roots
        indexed earlier are kept, and only indexed files that vanished from under one of ``paths`` (a folder: anything
        below it; a file: that file) are removed. ``prune=True`` mirrors ``paths`` exactly: every indexed file not found
        under them now is removed. Every path must exist and be readable, else :class:`InputPathError` is raised before
        anything is written (a typo never empties an index). A run that would remove all indexed files, or more than
        :data:`REMOVAL_GUARD_FILES` files and more than :data:`REMOVAL_GUARD_SHARE` of them, raises :class:`ConfigError`
        and changes nothing, unless ``allow_removal`` or ``prune`` says the removal is meant. ``rebuild=True`` re-reads
        and re-embeds every file of every recorded root (and of ``paths``); with ``prune``, of ``paths`` only. Embedded
        batches are checkpointed, so a run that was killed resumes without embedding them again.

        **Recorded settings** (:mod:`ragbudget.retrieval.index_settings`). The index records its chunking (with
        ``tokenizer``), dedup and cleaning settings and whether it stores sentence vectors; a setting left out
        (``None``) is the recorded one, so a plain update keeps how the index was built. A given chunking, dedup or
        cleaning setting that differs from the record re-chunks every file, so it raises
        :class:`~ragbudget.errors.IndexMismatchError` (naming each change, old -> new, and the chunks it would re-embed)
        and changes nothing, unless ``rechunk=True`` (or ``rebuild=True``) says it is meant.
        """
        _refuse_no_paths(paths, rebuild=rebuild)
        self.close()  # a writer reads the current generation itself
        try:
            return build_index(
                self.storage,
                paths,
                embedder=embedder,
                chunking=chunking,
                min_tokens=min_tokens,
                max_tokens=max_tokens,
                overlap=overlap,
                sentence_vectors=sentence_vectors,
                tokenizer=tokenizer,
                dedup=dedup,
                near_threshold=near_threshold,
                num_perm=num_perm,
                include=include,
                exclude=exclude,
                max_bytes=max_bytes,
                clean=clean,
                store=store,
                rebuild=rebuild,
                rechunk=rechunk,
                prune=prune,
                allow_removal=allow_removal,
                batch_files=batch_files,
                embed_batch=embed_batch,
                progress=progress,
                executor=executor,
            )
        finally:
            self.close()


def _refuse_no_paths(paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str], *, rebuild: bool) -> None:
    """Refuse an empty list of paths to index (unless the run rebuilds the recorded roots)."""
    if not rebuild and isinstance(paths, (list, tuple)) and not paths:
        # An empty list is a caller's slip (a glob that matched nothing, a filter too tight),
        # not a request: say so rather than return a summary of nothing done.
        raise ConfigError(
            "nothing to index: no paths given; pass files or folders (rebuild=True re-reads the recorded roots)"
        )


def _recorded_recall(m: Manifest) -> float | None:
    """The recall@10 the manifest records for its search store (1.0 for exact search; ``None``
    for an approximate store written before recall was measured)."""
    if not m.get("approx"):
        return 1.0
    r = m["approx"].get("recall_at_10")
    return None if r is None else float(r)


def _with_score(hit: Hit, score: float) -> Hit:
    return Hit(hit.chunk_id, score, hit.text, hit.n_tokens, hit.headings, hit.sources, hit.windows)
