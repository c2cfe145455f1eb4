"""The index writer: files in, one atomic generation out.

:func:`build_index` (what :meth:`Index.build <ragbudget.retrieval.index.Index.build>` runs) checks
its paths and settings before anything is written, takes the storage's writer lock
(:mod:`ragbudget.retrieval.storage`) and runs one :class:`_Builder` through its phases, in order:
**open** (the current generation, the embedder, the settings, the new generation begun on top),
**roots** (what the index held and which part of it this run may remove), **scan** (what
changed), **read** (load, clean, chunk, dedup and embed the changed files, in batches),
**finish** (orphans, sentence vectors, roots) and **commit** (the storage writes the generation
and then the manifest naming it). Embedding runs through an executor
(:mod:`ragbudget.retrieval.executors`: in process or on Ray) and is checkpointed
(:mod:`ragbudget.retrieval.checkpoint`).

**Roots and removal.** A run adds and updates: each path must exist (else nothing is written), is
recorded as a root with a short label (:mod:`ragbudget.retrieval.roots`), and only indexed files
that vanished from under a given path are removed (``prune=True`` mirrors the given paths
exactly). A run that would remove all indexed files, or more than a few and a fifth of them,
needs ``allow_removal`` (:mod:`ragbudget.retrieval.changes`).

**Resumable embedding.** Each embedded batch is appended to the checkpoint (fsync'ed); a run
killed before its commit leaves it, and the next run reuses those vectors; the commit removes it.

**Incremental runs.** Files whose size and mtime_ns match the files table are not opened; if they
differ, the content sha256 decides. A changed file replaces only its own sources; chunks whose text
(content hash) is already in the index are never re-embedded; chunks left without any source are
dropped. Changed embedder, chunking, dedup or cleaning settings trigger a full rebuild (vectors are
still reused by content hash when only those settings changed); a run not given a setting keeps the
recorded one, and one changing chunking, dedup or cleaning needs ``rechunk=True``
(:mod:`ragbudget.retrieval.index_settings`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, IndexCorruptError, IndexNotFoundError, LoadError
from ..settings import ChunkSettings, DedupSettings
from ..types import Document, IndexSummary
from .catalog import SourceRow
from .changes import final_roots, plan_changes
from .chunk_vectors import ChunkVectors
from .recall import pseudo_questions, warn_below_target
from .roots import Root, Roots, check_roots
from .storage import Manifest, sha256_file, stores_sentences
from .vectors import APPROX_KINDS, STORES_GROUP, FlatStore, choose_store, is_installed_store, make_store, store_names

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from ..input.dedup import Deduplicator
    from ..tokens import Tokenizer
    from .embed import Embedder
    from .executors import EmbedExecutor
    from .storage import CatalogWriter, EmbedCheckpoint, Generation, GenerationWriter, Storage
    from .vectors import VectorStore

__all__ = ["ProgressCallback", "build_index"]

log = logging.getLogger(__name__)

#: ``progress(phase, done, total)``: phases ``"files"`` (files to (re)index) then ``"embed"``
#: (chunks embedded; ``total`` grows as files are chunked), ``"sentences"`` (chunks whose sentence
#: vectors are embedded, for span packing; only when some lack them), then ``"write"``.
ProgressCallback = Callable[[str, int, "int | None"], None]

_STATS = (
    "files_indexed",
    "files_unchanged",
    "files_removed",
    "chunks_added",
    "chunks_removed",
    "chunks_embedded",
    "chunks_reused",
    "exact_duplicates",
    "near_duplicates",
    "furniture_lines_removed",
    "contents_lines_removed",
    "windows_pooled",
    "windows_embedded",
    "files_added",
    "files_updated",
    "files_kept",
    "chunks_resumed",
    "sentences_embedded",
    "sentences_reused",
)


def _no_progress(phase: str, done: int, total: int | None = None) -> None:
    """Default progress callback: nothing to report to."""


def _count(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return len(value)
    except TypeError:
        return 0


def _store_kind(manifest: Manifest) -> str:
    """The kind of search store a manifest names (``flat`` when the exact store searches)."""
    return str((manifest.get("approx") or {}).get("kind") or "flat")


def _recorded(storage: Storage) -> Manifest | None:
    """The manifest whose settings a writing run keeps: ``None`` for no index, or for one whose
    manifest is unreadable (the run rebuilds it: there is nothing to keep)."""
    try:
        return storage.read_manifest()
    except (IndexNotFoundError, IndexCorruptError):
        return None


def build_index(
    storage: Storage,
    paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    *,
    embedder: Embedder | None,
    chunking: ChunkSettings | None,
    min_tokens: int | None,
    max_tokens: int | None,
    overlap: int | None,
    sentence_vectors: bool | None,
    tokenizer: Any,
    dedup: str | DedupSettings | None,
    near_threshold: float | None,
    num_perm: int | None,
    include: Sequence[str] | None,
    exclude: Sequence[str] | None,
    max_bytes: int | None,
    clean: bool | None,
    store: str,
    rebuild: bool,
    rechunk: bool,
    prune: bool,
    allow_removal: bool,
    batch_files: int,
    embed_batch: int,
    progress: ProgressCallback | None,
    executor: str | EmbedExecutor,
) -> IndexSummary:
    """Index ``paths`` into ``storage``, incrementally; see :meth:`Index.build
    <ragbudget.retrieval.index.Index.build>` for every option (the defaults live there only:
    every option is passed here)."""
    from .executors import make_executor

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
    _check_before_writing(storage, wanted, store)
    run_on = make_executor(executor)
    given = [os.fspath(p) for p in paths]
    # Before the folder or the lock file is created.
    roots = check_roots(given, where=storage.where, exists=storage.exists(), own_dir=storage.folder)
    with storage.lock():
        settings, tok = _settings_to_write(storage, wanted, allowed=rechunk or rebuild)
        builder = _Builder(
            storage,
            given,
            embedder=embedder,
            tokenizer=tok,
            settings=settings,
            include=include,
            exclude=exclude,
            max_bytes=max_bytes,
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


def _check_before_writing(storage: Storage, wanted: dict[str, Any], store: str) -> None:
    """Check the settings against the record, and the store's name, before anything is written."""
    from .index_settings import resolve

    # Checked against the record before anything is written (a bad value creates no folder),
    # and again under the lock (_settings_to_write), where it counts: another writer may commit
    # in between.
    resolve(_recorded(storage), **wanted)
    if store not in store_names():
        raise ConfigError(
            f"store must be one of {', '.join(store_names())}; got {store!r} (another store needs the package "
            "that registers it under the ragbudget.stores entry points installed)"
        )


def _settings_to_write(storage: Storage, wanted: dict[str, Any], *, allowed: bool) -> tuple[dict[str, Any], Tokenizer]:
    """The settings (and tokenizer) this run writes, checked against the record read under the lock."""
    from .index_settings import check_changes, resolve

    recorded = _recorded(storage)
    settings, tok = resolve(recorded, **wanted)
    check_changes(recorded, settings, allowed=allowed)
    return settings, tok


class _Builder:
    """One writer run: holds the generation being written (its catalog and exact store)."""

    questions: NDArray[np.float32] | None = None  # the pseudo-questions a database's HNSW tunes on

    def __init__(
        self,
        storage: Storage,
        paths: list[str],
        *,
        embedder: Embedder | None,
        tokenizer: Tokenizer,
        settings: dict[str, Any],
        include: Sequence[str] | None,
        exclude: Sequence[str] | None,
        max_bytes: int | None,
        store: str,
        rebuild: bool,
        batch_files: int,
        embed_batch: int,
        progress: ProgressCallback | None,
        roots: Sequence[tuple[str, str]],
        prune: bool,
        allow_removal: bool,
        executor: EmbedExecutor,
    ) -> None:
        self.storage = storage
        self.paths = paths
        self.given = list(roots)
        self.embedder = embedder
        self.tok = tokenizer
        self.settings = settings
        self.include, self.exclude, self.max_bytes = include, exclude, max_bytes
        self.clean = bool(settings["cleaning"]["clean"])
        self.store = store
        self.rebuild = rebuild
        self.prune = prune
        self.allow_removal = allow_removal
        self.batch_files = batch_files
        self.embed_batch = embed_batch
        # Where embedding runs (the one seam between local and Ray): chunks to embed are gathered
        # into rounds of the executor's size, one embed_batch by default.
        self.executor = executor
        self.flush_at = executor.round_size or embed_batch
        self.progress: ProgressCallback = progress or _no_progress
        self.t0 = time.perf_counter()
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)
        self.roots: list[Root] = []
        self.warnings: list[tuple[str, str]] = []
        self.skipped: list[tuple[str, str, str]] = []
        self.old_indexed: set[str] = set()
        self.todo: list[tuple[str, int, int, str | None]] = []  # files to (re)read
        self.n_seen = 0  # files and skipped entries the scan found
        self.counts: dict[str, int] | None = None  # the committed generation's counts
        self.old: Manifest | None = None  # the current generation's manifest
        self.base: Generation | None = None  # the current generation, open (None: none or damaged)
        self.writer: GenerationWriter | None = None
        self.checkpoint: EmbedCheckpoint | None = None
        self._vectors: ChunkVectors | None = None
        self.pending: list[tuple[int, str]] = []  # chunks added, waiting for their vectors
        self.dedup: Deduplicator | None = None  # loaded from the kept chunks on first use
        self.sig_dtype: str | None = None
        self.changed = False
        self.reason = ""
        self.rebuilt = False
        self.gen = 1

    @property
    def db(self) -> CatalogWriter:
        assert self.writer is not None
        return self.writer.catalog

    @property
    def vectors(self) -> ChunkVectors:
        assert self._vectors is not None
        return self._vectors

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.executor.close()
        if self.writer is not None:
            self.writer.close()
        if self.base is not None:
            self.base.close()
        if self.checkpoint is not None:
            self.checkpoint.close()

    def run(self) -> IndexSummary:
        self.executor.check()  # an unreachable cluster fails here, before a file is read
        self._open()
        self._plan()
        self._read(self.todo)
        assert self.checkpoint is not None
        if not self.changed:
            # Nothing to commit: no new generation, the current one stays.
            self.checkpoint.remove()
            return self._summary(committed=False)
        self._finish()
        self._commit()
        self.checkpoint.remove()  # after the commit point: its vectors are in the index now
        return self._summary(committed=True)

    # -- open: the current generation, the embedder, the next generation -----------------------

    def _open(self) -> None:
        """Open the current generation, pick the embedder and settings, begin the next generation."""
        from .embed import embedder_identity

        damaged = self._open_base()
        emb, reason = self._resolve_embedder()
        self.reason = reason = reason or damaged
        if self.settings["sentences"] is None:
            # Not asked either way: what the index has. A new index stores none (span packing
            # embeds a sentence when a question first needs it, kept in the cache beside the
            # index): half the embedding work at build time, and sentences no question reaches
            # are never embedded.
            self.settings["sentences"] = bool(self.old is not None and stores_sentences(self.old))
        self.rebuilt = bool(reason) or (self.rebuild and self.old is not None)
        old = self.old if not reason else None  # the generation this one continues, if any
        if old is not None:
            self.sig_dtype = old.get("dedup_signature_dtype")
        self.writer = writer = self.storage.begin(self.base, keep=old is not None)
        self.gen = writer.number
        self._check_store_in_place()
        identity = embedder_identity(emb)
        # Only chunking/dedup changed: the old vectors are still valid for identical texts.
        same_vectors = self.base is not None and embedder_identity(self.base.manifest["embedder"]) == identity
        self.changed = bool(reason) or self.old is None
        if self._rewrites_anyway(old):
            self.changed = True
        self.checkpoint = self.storage.checkpoint(identity)
        self._vectors = self._chunk_vectors(emb, reuse=self.base if old is None and same_vectors else None)

    def _open_base(self) -> str:
        """Read the current manifest and open its generation; why it cannot be continued (``""``: it can)."""
        damaged = ""
        try:
            self.old = self.storage.read_manifest()
        except IndexNotFoundError:
            self.old = None
        except IndexCorruptError as exc:
            damaged = f"previous index unreadable: {exc}"
        if self.old is not None:
            try:
                self.base = self.storage.open_for_writing(self.old)
            except IndexCorruptError as exc:
                self.old = None
                damaged = f"previous index damaged: {exc}"
        return damaged

    def _check_store_in_place(self) -> None:
        """Refuse a store that an index searching in place (a database) cannot hold."""
        assert self.writer is not None
        if (
            self.writer.searches_in_place
            and self.store not in ("auto", "flat", "hnsw")
            and not is_installed_store(self.store)
        ):
            raise ConfigError(
                f"an index in {self.storage.where} searches exactly, with pgvector's HNSW or with an installed "
                f"store ({STORES_GROUP} entry points): --store auto, flat, hnsw or one of those, not {self.store!r}"
            )

    def _rewrites_anyway(self, old: Manifest | None) -> bool:
        """Whether this run writes a new generation even if no file changed (each check runs, and logs)."""
        assert self.writer is not None
        rewrite = False
        if self.old is not None and _store_kind(self.old) != self._store_for(
            int(self.old.get("counts", {}).get("vectors", 0)), int(self.old["dim"])
        ):
            # Another search store: derived from the same vectors, so written without a rebuild.
            rewrite = True
        if self.writer.lexical == "created" and old is not None:
            # An index from before the FTS table: this run stores it even if no file changed.
            log.info("adding the lexical (FTS5) table to the index in %s", self.storage.where)
            rewrite = True
        if old is not None and self.settings["sentences"] != stores_sentences(old):
            # Turned on (or an index from before they were stored): this run embeds them for every
            # chunk, once, so span packing embeds no sentence at question time; turned off: this
            # run drops them. Either even if no file changed.
            if self.settings["sentences"]:
                log.info("adding sentence vectors (span packing) to the index in %s", self.storage.where)
            else:
                log.info(
                    "dropping the sentence vectors from the index in %s (sentence_vectors off)", self.storage.where
                )
            rewrite = True
        return rewrite

    def _chunk_vectors(self, emb: Embedder, *, reuse: Generation | None) -> ChunkVectors:
        """The :class:`ChunkVectors` that embeds this run's chunks into the new generation."""
        assert self.writer is not None and self.checkpoint is not None
        unchanged = (
            "No index was written"
            if self.old is None
            else f"The index was not changed (generation {self.gen - 1} stays)"
        )
        return ChunkVectors(
            embedder=emb,
            executor=self.executor,
            catalog=self.writer.catalog,
            exact=self.writer.exact,
            checkpoint=self.checkpoint,
            reuse=reuse,
            stats=self.stats,
            progress=self.progress,
            embed_batch=self.embed_batch,
            unchanged=unchanged,
        )

    def _resolve_embedder(self) -> tuple[Embedder, str]:
        """Pick the embedder and say why a full rebuild is needed (``""`` when not)."""
        from .embed import SentenceTransformerEmbedder, embedder_from_spec, embedder_identity
        from .index_settings import changes

        old = self.old
        if self.embedder is None:
            self.embedder = embedder_from_spec(old["embedder"]) if old else SentenceTransformerEmbedder()
        if old is None:
            return self.embedder, ""
        reasons = []
        if self.rebuild:
            reasons.append("rebuild requested")
        if embedder_identity(old["embedder"]) != embedder_identity(self.embedder):
            reasons.append(
                f"embedder changed: {old['embedder'].get('id')} -> {self.embedder.id}"
                f" (pooling {old['embedder'].get('pooling')} -> {self.embedder.pooling})"
            )
        reasons += [f"{section} settings changed: {', '.join(c)}" for section, c in changes(old, self.settings).items()]
        return self.embedder, "; ".join(reasons)

    # -- roots and scan: what changed (changes.py) ----------------------------------------------

    def _plan(self) -> None:
        # A rebuild starts from an empty catalog: what the index held is in the previous one.
        previous = self.base.catalog if self.reason and self.base is not None else None
        plan = plan_changes(
            self.db,
            previous=previous,
            given=self.given,
            paths=self.paths,
            prune=self.prune,
            allow_removal=self.allow_removal,
            include=self.include,
            exclude=self.exclude,
            max_bytes=self.max_bytes,
            own_dir=self.storage.folder,
            where=self.storage.where,
        )
        self.roots, self.todo, self.old_indexed, self.n_seen = plan.roots, plan.todo, plan.old_indexed, plan.seen
        self.skipped += plan.skipped
        if not plan.seen:  # an empty folder (or one left wholly out): say so, not a silent no-op
            self.warnings += [(real, "no files found here: nothing to index") for real, _kind in self.given]
        self.stats.update(files_unchanged=plan.unchanged, files_removed=plan.removed, files_kept=plan.kept)
        self.changed = self.changed or plan.changed

    # -- read: load, clean, chunk, dedup, embed; files stream in batches -----------------------

    def _read(self, todo: list[tuple[str, int, int, str | None]]) -> None:
        # Corpus boilerplate (a navigation line on every HTML page, a licence footer on every
        # note) is learned from the documents loaded in this run, batch after batch. Documents
        # indexed in earlier runs are not re-stripped when a pattern first appears later.
        from ..input.loaders import BoilerplateFilter

        corpus = BoilerplateFilter() if self.clean else None
        self.progress("files", 0, len(todo))
        for start in range(0, len(todo), self.batch_files):
            loaded: list[tuple[Document, str, int, int, str | None]] = []
            for path, size, mtime_ns, digest in todo[start : start + self.batch_files]:
                doc, digest = self._load_file(path, size, mtime_ns, digest)
                if doc is not None:
                    loaded.append((doc, path, size, mtime_ns, digest))
            if corpus is not None:
                corpus.observe(doc for doc, *_ in loaded)
            for doc, path, size, mtime_ns, digest in loaded:
                self._index_doc(corpus.strip(doc) if corpus else doc, path, size, mtime_ns, digest)
            self.progress("files", min(start + self.batch_files, len(todo)), len(todo))
            if len(self.pending) >= self.flush_at:
                self._flush()
        self._flush()

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        self.vectors.add(batch)

    def _load_file(self, path: str, size: int, mtime_ns: int, digest: str | None) -> tuple[Document | None, str | None]:
        """Load one file (and hash it when not hashed yet), or record why it was skipped."""
        from ..input.loaders import load_document

        needs = None
        try:
            if digest is None:
                digest = sha256_file(Path(path))
            return load_document(path, clean=self.clean), digest
        except LoadError as exc:
            reason, detail, needs = exc.reason, str(exc), exc.needs
        except OSError as exc:
            reason, detail = "unreadable", str(exc)
        self.db.record_file(path, size, mtime_ns, digest, "skipped", reason, detail, needs=needs)
        self.skipped.append((path, reason, detail))
        return None, digest

    def _index_doc(self, doc: Document, path: str, size: int, mtime_ns: int, digest: str | None) -> None:
        from ..input.chunking import chunk_document
        from ..input.dedup import content_hashes, minhash_signatures

        furniture = _count(doc.meta.get("furniture_removed", 0)) + _count(doc.meta.get("boilerplate_removed", 0))
        self.stats["furniture_lines_removed"] += furniture
        self.stats["contents_lines_removed"] += _count(doc.meta.get("contents_removed", 0))
        ch = self.settings["chunking"]
        chunks = chunk_document(
            doc, min_tokens=ch["min_tokens"], max_tokens=ch["max_tokens"], overlap=ch["overlap"], tokenizer=self.tok
        )
        chunks = [c for c in chunks if c.text.strip()]
        # Hashes and signatures for a whole file at once: the batch functions vectorise. Every
        # mode stores the same hash (dedup.content_hash): vector reuse and orphan revival look
        # chunks up by it, whatever mode wrote them.
        hashes = content_hashes([c.text for c in chunks])
        sigs: Sequence[Any] = [None] * len(chunks)
        if self.settings["dedup"]["mode"] == "near" and chunks:
            d = self.settings["dedup"]
            sigs = list(minhash_signatures([c.text for c in chunks], num_perm=d["num_perm"], shingle=d["shingle"]))
        for c, h, sig in zip(chunks, hashes, sigs, strict=True):
            self._add_chunk(SourceRow(path, c.start, c.end, c.page_start, c.page_end), c, h, sig)
        warning = doc.meta.get("encoding_warning") or None
        if warning:
            self.warnings.append((path, str(warning)))
        labels = doc.meta.get("page_labels")
        self.db.record_file(
            path,
            size,
            mtime_ns,
            digest,
            "indexed",
            n_chunks=len(chunks),
            furniture=furniture,
            pages=int(doc.meta.get("n_pages") or len(doc.pages)) if doc.paginated else None,
            warning=str(warning) if warning else None,
            page_labels=list(labels) if labels else None,
        )
        self.stats["files_indexed"] += 1
        self.stats["files_updated" if path in self.old_indexed else "files_added"] += 1

    def _deduplicator(self) -> Deduplicator:
        """The :class:`~ragbudget.input.dedup.Deduplicator` of this run, holding every chunk that
        still has a source (built from the stored hashes and signatures: no text is re-read)."""
        if self.dedup is None:
            import numpy as np

            from ..input.dedup import DEFAULT_NUM_PERM, DEFAULT_SHINGLE, DEFAULT_THRESHOLD, DedupDecision, Deduplicator

            d = self.settings["dedup"]
            mode = d["mode"]
            self.dedup = Deduplicator(
                threshold=d["threshold"] or DEFAULT_THRESHOLD,
                num_perm=d["num_perm"] or DEFAULT_NUM_PERM,
                shingle=d["shingle"] or DEFAULT_SHINGLE,
                near=mode == "near",
                exact=mode != "none",
            )
            if mode != "none":  # "none" never looks a chunk up: nothing to load
                dtype = self.sig_dtype
                for cid, h, blob in self.db.kept_chunks():
                    sig = np.frombuffer(blob, dtype=dtype) if mode == "near" and blob is not None and dtype else None
                    # Kept chunks are distinct by construction: placed as they are, not re-decided.
                    self.dedup.add(cid, decision=DedupDecision("new", None, 0.0, sig, h))
        return self.dedup

    def _add_chunk(self, src: SourceRow, c: Any, h: str, sig: Any) -> None:
        if sig is not None:
            self.sig_dtype = str(sig.dtype)
        dd = self._deduplicator()
        decision = dd.check(digest=h, signature=sig)
        if decision.kind != "new":
            # Exact: same normalized text; near: most similar first (ties: earliest inserted).
            self.stats["exact_duplicates" if decision.kind == "exact" else "near_duplicates"] += 1
            dup = decision.duplicate_of
            assert isinstance(dup, int)  # this run's deduplicator is keyed by chunk id
            self.db.add_source(dup, src)
            return
        # An orphan of a changed file, same text again: revive it, no re-embedding.
        cid = self.db.revive(h, c.headings)
        revived = cid is not None
        if cid is None:
            cid = self.db.add_chunk(c.text, int(c.n_tokens), c.headings, h, sig.tobytes() if sig is not None else None)
        dd.add(cid, decision=decision)
        self.db.add_source(cid, src)
        if revived:
            self.stats["chunks_reused"] += 1
            return
        self.stats["chunks_added"] += 1
        self.pending.append((cid, c.text))
        self.vectors.total += 1
        if len(self.pending) >= self.flush_at:
            self._flush()

    # -- finish: orphans, sentence vectors, roots ----------------------------------------------

    def _finish(self) -> None:
        import numpy as np

        # Chunks left without any source disappear, from the catalog and the vectors alike.
        orphans = self.db.remove_orphans()
        if orphans:
            if self.vectors.exact is not None:
                self.vectors.exact.remove(np.array(orphans, dtype=np.int64))
            self.stats["chunks_removed"] += len(orphans)
        if self.settings["sentences"]:
            self.vectors.embed_sentences()
        else:
            self.db.drop_sentence_vectors()
        self.roots = final_roots(self.db, self.roots, self.given)
        self.db.set_roots(self.roots)

    # -- commit ----------------------------------------------------------------------------------

    def _commit(self) -> None:
        emb = self.embedder
        assert emb is not None and self.writer is not None
        if self.vectors.exact is None:  # nothing was ever embedded: an empty index still needs its dim
            self.vectors.exact = FlatStore(emb.dim)
        exact = self.vectors.exact
        self.progress("write", 0, 3)
        self.counts = {**self.db.counts(), "vectors": exact.ntotal}
        search = self._search_store(exact)
        # Asking a model-backed embedder for its full spec loads the model: skip that when this
        # run embedded nothing (a touched file, a deletion) and the old spec still holds.
        if self.old is not None and not self.rebuilt and not self.stats["chunks_embedded"]:
            spec = self.old["embedder"]
        else:
            spec = emb.spec()
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        fields = {
            "created": (self.old or {}).get("created", now) if not self.rebuilt else now,
            "updated": now,
            "embedder": spec,
            "dim": exact.dim,
            "pooling": spec.get("pooling"),
            "chunking": self.settings["chunking"],
            "dedup": self.settings["dedup"],
            "cleaning": self.settings["cleaning"],
            "dedup_signature_dtype": self.sig_dtype,
            "store": self.store_report,
            # Every chunk's sentences embedded for span packing (ChunkVectors.embed_sentences), or none
            # (sentence_vectors off); an index without this entry gets them on its next write.
            "sentences": (
                {"stored": True, "table": "sentence_vectors", "dtype": "float16", "splitter": 1}
                if self.settings["sentences"]
                else {"stored": False}
            ),
            "counts": self.counts,
            "roots": [{"label": r.label, "kind": r.kind} for r in sorted(self.roots, key=lambda r: r.label)],
            "last_run": self._summary(committed=True).to_dict(),
        }
        # The rows are gone but their pages stay in the file copied from the previous generation
        # until it is rewritten: without this the index would not shrink (the vectors were about
        # half its bytes). Once, on the run that drops them.
        vacuum = self.old is not None and not self.reason and stores_sentences(self.old)
        self.writer.commit(
            fields,
            exact=exact,
            search=search,
            vacuum=vacuum and not self.settings["sentences"],
            progress=lambda step: self.progress("write", step, 3),
            questions=self.questions,
        )

    def _store_for(self, n: int, dim: int) -> str:
        """The search store kind ``store=`` means for ``n`` vectors of ``dim`` here: ``auto``'s
        rule, except that a database's one approximate store is pgvector's HNSW, so every
        approximate kind resolves to it — the same answer at each run, or an unchanged re-run
        past IVF's size would see the recorded ``hnsw`` as a change and rewrite it."""
        kind = choose_store(self.store, n, dim)
        assert self.writer is not None
        return "hnsw" if self.writer.searches_in_place and kind in APPROX_KINDS else kind

    def _search_store(self, exact: FlatStore) -> VectorStore | None:
        """Build and tune the search store ``store=`` asks for (``None``: the exact one searches).
        Records the choice and the recall measured in :attr:`store_report`."""
        n, d = exact.ntotal, exact.dim
        kind = self._store_for(n, d)
        self.store_report: dict[str, Any] = {"requested": self.store, "kind": kind, "recall_at_10": None}
        self.questions = None
        if kind == "flat":
            self.store_report["recall_at_10"] = 1.0
            return None
        assert self.writer is not None and self.embedder is not None
        if self.writer.searches_in_place and kind == "hnsw":
            # A database builds its own (pgvector's HNSW) at commit, tunes it on these and
            # records the recall it measures there. An installed store is built here, as for a
            # folder, and the database holds what it saves.
            self.questions = pseudo_questions(self.db, exact.ids(), self.embedder)
            return None
        store = make_store(kind, d, exact=exact)
        if getattr(store, "tunes_on_questions", False):
            report = store.finalize(questions=pseudo_questions(self.db, exact.ids(), self.embedder))  # type: ignore[call-arg]
        else:
            report = store.finalize()
        self.store_report.update(
            {k: v for k, v in report.to_dict().items() if k.startswith(("recall", "tuned"))},
            build_seconds=round(report.seconds, 3),
        )
        warn_below_target(report, f"the {kind} store", report.params)
        return store

    def _summary(self, *, committed: bool) -> IndexSummary:
        if committed and self.counts is not None:
            total = self.counts["chunks"]
        else:
            total = self.db.count_chunks() if self.writer is not None else 0
        shown = Roots(self.roots)
        return IndexSummary(
            files_seen=self.n_seen,
            skipped=tuple((shown.display(p), r, shown.scrub(d) or "") for p, r, d in self.skipped),
            warnings=tuple((shown.display(p), m) for p, m in self.warnings),
            chunks_total=total,
            seconds=time.perf_counter() - self.t0,
            embed_seconds=self._vectors.embed_seconds if self._vectors is not None else 0.0,
            sentence_seconds=self._vectors.sentence_seconds if self._vectors is not None else 0.0,
            rebuilt=self.rebuilt,
            rebuild_reason=self.reason,
            generation=self.gen if committed else self.gen - 1,
            committed=committed,
            **self.stats,
        )
