"""Where an index lives and how a generation is committed: the storage seam.

An index is a sequence of *generations*. A reader opens the current one (named by the manifest)
and keeps it as long as it likes; one writer at a time (:meth:`Storage.lock`) begins the next one
beside it (:meth:`Storage.begin`), fills it and commits it atomically: a reader sees the old
generation or the new one, never a mix, and a writer killed at any moment leaves the old one.
:class:`Storage` is that contract, :class:`Generation` what a reader gets and
:class:`GenerationWriter` what a writer fills (their chunks, sources, files and roots through
:class:`Catalog` and :class:`CatalogWriter`, their vectors through
:class:`~ragbudget.retrieval.vectors.VectorStore`); :mod:`ragbudget.retrieval.index` only reads
through it and :mod:`ragbudget.retrieval.build` only writes. :class:`LocalStorage` keeps an
index in a folder (the first storage; a database is the next, as one more module beside this).

Layout of an index folder (default ``.ragbudget/``)::

    manifest.json          names the current generation, settings, counts and sha256 checksums
    faiss.<gen>.index      exact inner-product index (IndexFlatIP in IndexIDMap2), ids = chunk ids
    <store>.<gen>.index    the search store when it is not the exact one (``hnsw``, ``ivf-flat``,
                           ``ivf-pq`` or a store from the ``ragbudget.stores`` entry points),
                           derived from the same vectors (:mod:`ragbudget.retrieval.vectors`)
    meta.<gen>.sqlite      chunks, sources, files, roots, sentence vectors and the FTS5 table
                           (:mod:`ragbudget.retrieval.catalog`)
    lock                   flock'ed by the one writer
    embed.checkpoint       vectors embedded by an unfinished run (:mod:`ragbudget.retrieval.checkpoint`)
    cache/sentences.sqlite sentence vectors embedded at question time: not part of a generation,
                           safe to delete (:mod:`ragbudget.retrieval.sentence_cache`)

**Atomicity.** A writer never modifies the files of the current generation: it copies the SQLite
file to ``meta.<gen+1>.sqlite.tmp``, edits the copy, writes the new vector files beside the old
ones, fsyncs, renames the temp files into place, and only then atomically replaces
``manifest.json`` (write temp, fsync, rename, fsync folder). The manifest rename is the commit
point: a crash at any moment leaves the old manifest naming the old, untouched files — or the new
manifest naming new, complete ones. Leftover temp files and stale generations are removed by the
next writer; the previous generation is kept so a reader that has just read the manifest can
still open its files.

**No code is executed on load**: vector files go through ``faiss.read_index``, metadata through
SQLite and JSON; there is no pickle. Every file is checked against its manifest sha256 before use,
so a truncated or bit-flipped file raises :class:`~ragbudget.errors.IndexCorruptError` naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConfigError, IndexCorruptError, IndexLockedError, IndexNotFoundError, RagBudgetError
from .catalog import SqliteCatalog, SqliteCatalogWriter
from .durable import fsync_dir, fsync_file, sha256_file, write_json_atomic
from .manifest import check_manifest, new_manifest

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence

    import numpy as np
    from numpy.typing import NDArray

    from .catalog import ChunkRow, FileRow, FileState, SourceRow
    from .roots import Root
    from .vectors import FlatStore, VectorStore

__all__ = [
    "BUILT_IN_STORAGES",
    "Catalog",
    "CatalogWriter",
    "EmbedCheckpoint",
    "MANIFEST",
    "Generation",
    "GenerationWriter",
    "LocalStorage",
    "LocalWriter",
    "Manifest",
    "STORAGES_GROUP",
    "Storage",
    "fsync_dir",
    "fsync_file",
    "open_storage",
    "sha256_file",
    "storage_class",
    "storage_name",
    "storage_names",
    "stores_sentences",
    "write_json_atomic",
]

MANIFEST = "manifest.json"
LOCK = "lock"
#: Files of one generation: ``<part>.<generation>.<index|sqlite>``, the part naming the catalog,
#: the exact store or a search store (any store name, entry points included).
_GEN_FILE = re.compile(r"^([a-z0-9][a-z0-9_.-]*?)\.(\d+)\.(index|sqlite)$")

#: A manifest: the JSON object that names a generation and records how it was written.
Manifest = dict[str, Any]


def stores_sentences(m: Mapping[str, Any]) -> bool:
    """Whether the manifest ``m`` says its generation stores every chunk's sentence vectors (no
    ``sentences`` entry: written before they were stored; ``stored: false``: left out on purpose;
    an entry without ``stored`` was written before they could be left out)."""
    entry = m.get("sentences")
    return isinstance(entry, dict) and bool(entry) and bool(entry.get("stored", True))


# --------------------------------------------------------------------------------------------------
# the contract


class Catalog(Protocol):
    """A generation's catalog, read: its chunks, sources, files, roots, sentence vectors and
    lexical search. :class:`~ragbudget.retrieval.catalog.SqliteCatalog` is the local one; another
    storage brings its own with these methods (ids are chunk ids, paths the stored absolute ones)."""

    def close(self) -> None:
        """Release the generation's catalog (a reader's file stays as it is)."""
        ...

    def chunks(self, ids: Sequence[int]) -> dict[int, ChunkRow]:
        """The chunks of ``ids`` that exist, by id."""
        ...

    def sources(self, ids: Sequence[int]) -> dict[int, list[SourceRow]]:
        """Every source of the chunks ``ids``, each chunk's in its stored order."""
        ...

    def sources_in(self, path: str) -> list[tuple[int, SourceRow]]:
        """``(chunk_id, source)`` of every chunk located in the file ``path`` (stored form), in document order."""
        ...

    def find_chunk(self, *hashes: str) -> tuple[int, int] | None:
        """``(chunk id, windows)`` of a chunk whose content hash is one of ``hashes``."""
        ...

    def chunk_ids(self) -> NDArray[np.int64]: ...

    def chunk_keys(self, ids: Sequence[int]) -> dict[int, tuple[str, bytes | None]]:
        """``{chunk id: (content hash, MinHash bytes)}`` of the chunks ``ids`` that exist (what a
        copy of the index carries over so dedup and vector reuse keep working)."""
        ...

    def files(self) -> list[FileRow]:
        """Every file the generation knows, indexed or skipped."""
        ...

    def file_states(self) -> dict[str, FileState]:
        """``{stored path: FileState}`` of every file row."""
        ...

    def page_labels(self) -> dict[str, list[str]]:
        """``{stored path: page labels}`` of the files whose format names its pages."""
        ...

    def roots(self) -> list[Root]:
        """The recorded roots (``[]`` for a generation written before they were recorded)."""
        ...

    def file_paths(self) -> list[str]: ...

    def sentence_vectors(
        self, ids: Sequence[int], *, dim: int, dtype: str
    ) -> dict[int, tuple[list[bytes], NDArray[np.float32]]]:
        """``{chunk_id: (digests, float32 rows)}`` of the chunks ``ids`` that have them."""
        ...

    def all_sentence_vectors(self, dim: int) -> dict[bytes, NDArray[np.float32]]:
        """Every stored sentence vector by digest (what a rebuild with the same embedder reuses)."""
        ...

    def has_lexical(self) -> bool:
        """Whether the file holds the FTS5 table (whether it is up to date, the manifest says)."""
        ...

    def lexical(self, query: str, k: int, *, trusted: bool) -> list[tuple[int, float]]:
        """``(chunk_id, bm25)`` best first. ``trusted``: the manifest vouches for the stored
        lexical table (otherwise one is built for this session). ``[]`` without one."""
        ...

    def check(self, chunk_ids: NDArray[np.int64], manifest: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
        """The catalog's own consistency against ``chunk_ids`` (the exact store's): every chunk
        has a source, every source a chunk and an indexed file, the lexical rows match the
        chunks. Returns ``(problems, checked)``."""
        ...


class CatalogWriter(Catalog, Protocol):
    """The catalog of the generation being written: a private copy of the base generation's (or
    an empty one), edited by the writing run and made current by the storage's commit."""

    def ensure_lexical(self, *, trusted: bool) -> str:
        """Create (and fill) the lexical table; ``trusted=False`` rebuilds one the previous
        writer did not vouch for. ``"ok"``, ``"created"`` or ``"unavailable"``."""
        ...

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
    ) -> None: ...

    def touch_file(self, path: str, mtime_ns: int) -> None:
        """A file changed its mtime only (same content): record the new one."""
        ...

    def drop_sources(self, path: str) -> None: ...

    def drop_files(self, paths: Iterable[str]) -> None:
        """Forget the files ``paths`` and their sources (their chunks are orphans until removed)."""
        ...

    def set_roots(self, roots: Iterable[Root]) -> None: ...

    def kept_chunks(self) -> Iterator[tuple[int, str, bytes | None]]:
        """``(id, content hash, MinHash bytes)`` of every chunk that still has a source."""
        ...

    def revive(self, content_hash: str, headings: Sequence[str]) -> int | None:
        """An orphan (a chunk left without a source by a changed file) with this text, given
        its new headings: its id, or ``None``."""
        ...

    def add_chunk(
        self, text: str, n_tokens: int, headings: Sequence[str], content_hash: str, minhash: bytes | None
    ) -> int: ...

    def add_source(self, chunk_id: int, src: SourceRow) -> None:
        """Another location of ``chunk_id``, after the ones it has."""
        ...

    def set_windows(self, pairs: Iterable[tuple[int, int]]) -> None:
        """``(chunk id, windows)``: how many model windows each chunk's vector pooled."""
        ...

    def remove_orphans(self) -> list[int]:
        """Delete the chunks left without any source; their ids."""
        ...

    def chunks_without_sentence_vectors(self) -> list[tuple[int, str]]: ...

    def put_sentence_vectors(self, rows: Iterable[tuple[int, bytes, bytes]]) -> None:
        """``(chunk id, 16-byte digests joined, float16 rows)`` per chunk."""
        ...

    def drop_sentence_vectors(self) -> None: ...

    def count_chunks(self) -> int: ...

    def counts(self) -> dict[str, int]:
        """The counts the manifest records (``lexical_rows`` only with an FTS table)."""
        ...

    def finish(self, generation: int, *, vacuum: bool = False) -> None:
        """Stamp the generation number, write everything and close, ready for the commit.
        ``vacuum``: compact what was dropped."""
        ...

    def discard(self) -> None:
        """Close without finishing (the storage removes the file)."""
        ...


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One committed generation, open for reading: its ``manifest``, the ``exact`` store (every
    vector: the truth for rescoring, reuse and verify), the ``search`` store that answers
    queries (``exact`` itself unless the index has an approximate one and it was asked for) and
    its ``catalog`` (chunks, sources, files, roots; :class:`~ragbudget.retrieval.catalog.SqliteCatalog`
    for a local index)."""

    manifest: Manifest
    exact: VectorStore
    search: VectorStore
    catalog: Catalog

    @property
    def number(self) -> int:
        return int(self.manifest["generation"])

    def close(self) -> None:
        self.catalog.close()


class GenerationWriter(Protocol):
    """The generation a writer fills, not visible to readers until :meth:`commit`.

    ``number`` is its generation; ``catalog`` a copy of the base generation's (or an empty one);
    ``exact`` the base generation's exact store, loaded to be edited (``None`` for a fresh
    generation: the writer creates one once it knows the dimension); ``lexical`` whether the
    catalog has its FTS5 table: ``"ok"``, ``"created"`` (this generation adds it, so the run
    writes even if no file changed) or ``"unavailable"`` (this SQLite has no FTS5)."""

    number: int
    exact: FlatStore | None
    lexical: str
    #: Whether the storage searches its own copy of the vectors (a database): for the built-in
    #: approximate kinds the writer then passes no search store to :meth:`commit`, which builds
    #: and tunes the storage's own for the ``store`` kind recorded in ``fields``; a store another
    #: package provides is built by the writer and passed, and the storage holds what it saves.
    searches_in_place: bool

    @property
    def catalog(self) -> CatalogWriter:  # read-only here: a storage's writer holds its own kind
        ...

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
        """Write everything, then the manifest naming it (the commit point); its manifest.
        ``fields`` is what the writer records (settings, embedder, counts, the last run); the
        storage adds the format, the generation and its files. ``search``: the search store,
        ``None`` when the exact one searches. ``progress(step)`` after each of 3 steps.
        ``questions``: pseudo-questions (query vectors) for a storage that builds its own search
        store at commit (:attr:`searches_in_place`) to tune it on; others ignore them."""
        ...

    def close(self) -> None:
        """Release the writer; an uncommitted generation's files are removed."""
        ...


class EmbedCheckpoint(Protocol):
    """Vectors embedded by a writing run not yet committed, kept across a kill so a re-run
    resumes (:class:`~ragbudget.retrieval.checkpoint.Checkpoint` in a local folder,
    :class:`~ragbudget.retrieval.postgres.PgCheckpoint` in a database). ``vectors``: by key."""

    vectors: dict[bytes, tuple[Any, int]]

    def get(self, text: str) -> tuple[Any, int] | None:
        """``(vector, windows)`` of ``text`` if a run embedded it."""
        ...

    def add(self, texts: Sequence[str], vectors: Any, windows: Sequence[int]) -> None:
        """Keep one embedded batch, durably."""
        ...

    def close(self) -> None: ...

    def remove(self) -> None:
        """The run committed (or had nothing to commit): the checkpoint is spent."""
        ...


class Storage(Protocol):
    """Where an index lives: what :class:`~ragbudget.retrieval.index.Index` reads through and
    :mod:`ragbudget.retrieval.build` writes through.

    ``where`` names it in messages; ``folder`` is a local folder that is the index's own (the
    index never reads its own files as input; a writer keeps its embedding checkpoint there, the
    reader its sentence cache), or ``None``."""

    where: str
    folder: Path | None

    def exists(self) -> bool:
        """Whether an index has been committed here."""
        ...

    def size_bytes(self, manifest: Manifest) -> int:
        """What the generation ``manifest`` names takes where it is stored (``stats``' ``bytes``)."""
        ...

    def read_manifest(self) -> Manifest:
        """The current manifest; :class:`~ragbudget.errors.IndexNotFoundError` when there is none,
        :class:`~ragbudget.errors.IndexCorruptError` when it is unreadable or of another format."""
        ...

    def current_generation(self) -> int:
        """The number of the generation committed now, read as cheaply as the storage allows: a
        reader asks before each request whether to follow a writer
        (:meth:`~ragbudget.retrieval.index.Index.follow`). Raises as :meth:`read_manifest`."""
        ...

    def open(self, manifest: Manifest, *, verify_checksums: bool = True, search_store: bool = True) -> Generation:
        """Open the generation ``manifest`` names for reading (``search_store=False``: the exact
        store searches). :class:`~ragbudget.errors.IndexCorruptError` names a damaged part."""
        ...

    def lock(self) -> contextlib.AbstractContextManager[object]:
        """Exclusive, non-blocking: a second writer gets :class:`~ragbudget.errors.IndexLockedError`
        at once; readers are never blocked."""
        ...

    def begin(self, base: Generation | None, *, keep: bool) -> GenerationWriter:
        """Under the lock: the next generation, on top of ``base`` (the current one, opened with
        :meth:`open_for_writing`; ``None`` when there is none or it is unreadable). ``keep``:
        start from ``base``'s catalog and exact store (an incremental run); otherwise from
        nothing (a rebuild, which may still read ``base``)."""
        ...

    def open_for_writing(self, manifest: Manifest) -> Generation:
        """The generation ``manifest`` names, as a writer's base: the exact store loaded whole
        (to be edited), no search store (the writer derives its own)."""
        ...

    def checkpoint(self, identity: Mapping[str, Any]) -> EmbedCheckpoint:
        """Under the lock: the embedding checkpoint for the embedder ``identity`` (what an
        interrupted run left, for this embedder only)."""
        ...


# --------------------------------------------------------------------------------------------------
# a local folder


class _FolderLock:
    """Exclusive, non-blocking ``flock`` on ``<dir>/lock``; released by the kernel if we die."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK
        self.fd: int | None = None

    def __enter__(self) -> _FolderLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
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


class LocalStorage:
    """An index in a local folder (see the module docstring for its layout and commit).

    >>> LocalStorage("/tmp/rb-doctest-absent").exists()
    False
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.folder: Path | None = self.path
        self.where = str(self.path)
        # The manifest file's identity when last read, and its generation: a commit renames a new
        # file into place, so an unchanged (inode, mtime, size) means an unchanged generation.
        self._seen: tuple[tuple[int, int, int], int] | None = None

    def __repr__(self) -> str:
        return f"LocalStorage({self.where!r})"

    def current_generation(self) -> int:
        try:
            st = os.stat(self.path / MANIFEST)
        except OSError:
            return int(self.read_manifest()["generation"])  # raises the one-line error
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        seen = self._seen
        if seen is not None and seen[0] == key:
            return seen[1]
        number = int(self.read_manifest()["generation"])
        self._seen = (key, number)
        return number

    def exists(self) -> bool:
        return (self.path / MANIFEST).is_file()

    def size_bytes(self, manifest: Manifest) -> int:
        # The sizes the writer recorded: stats reads no file beyond the manifest.
        return sum(int((manifest.get(k) or {}).get("bytes", 0)) for k in ("faiss", "sqlite", "approx"))

    def read_manifest(self) -> Manifest:
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise IndexNotFoundError(
                f"no index in {self.path} (no {MANIFEST}); build one with `ragbudget index PATH "
                f"--index-dir {self.path}`"
            )
        try:
            data = json.loads(mpath.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise IndexCorruptError(
                f"index manifest {mpath} is unreadable ({exc}); rebuild the index with `ragbudget index PATH --rebuild`"
            ) from exc
        return check_manifest(data, f"index manifest {mpath}")

    def lock(self) -> _FolderLock:
        return _FolderLock(self.path)

    def checkpoint(self, identity: Mapping[str, Any]) -> EmbedCheckpoint:
        from .checkpoint import Checkpoint

        return Checkpoint(self.path, identity)

    def _check_file(self, entry: Mapping[str, Any], *, checksum: bool) -> Path:
        p: Path = self.path / str(entry["file"])
        if not p.is_file():
            raise IndexCorruptError(f"index file {p} is missing; rebuild the index")
        size = p.stat().st_size
        if size != int(entry.get("bytes", size)):
            raise IndexCorruptError(
                f"index file {p} is {size} bytes, the manifest says {entry['bytes']} "
                "(truncated or overwritten); rebuild the index"
            )
        if checksum and sha256_file(p) != entry["sha256"]:
            raise IndexCorruptError(f"index file {p} fails its sha256 checksum (corrupted); rebuild the index")
        return p

    def open(self, manifest: Manifest, *, verify_checksums: bool = True, search_store: bool = True) -> Generation:
        return self._open(manifest, checksum=verify_checksums, search_store=search_store, writable=False)

    def open_for_writing(self, manifest: Manifest) -> Generation:
        return self._open(manifest, checksum=True, search_store=False, writable=True)

    def _open(self, m: Manifest, *, checksum: bool, search_store: bool, writable: bool) -> Generation:
        # A reader with a search store maps the exact matrix read-only instead of loading it
        # (rescoring touches a few rows per query); a writer loads it whole, to edit it.
        from .vectors import FlatStore, load_store

        fpath = self._check_file(m["faiss"], checksum=checksum)
        spath = self._check_file(m["sqlite"], checksum=checksum)
        approx = search_store and not writable and bool(m.get("approx"))
        flat = FlatStore.load(fpath, m["faiss"], mmap=approx)
        search: VectorStore = flat
        if approx:
            search = load_store(self._check_file(m["approx"], checksum=checksum), m["approx"], exact=flat)
        catalog = SqliteCatalog.open(spath, int(m["generation"]))
        return Generation(manifest=m, exact=flat, search=search, catalog=catalog)

    def _generations_on_disk(self) -> list[int]:
        if not self.path.is_dir():
            return []
        return [int(m.group(2)) for p in self.path.iterdir() if (m := _GEN_FILE.match(p.name))]

    def begin(self, base: Generation | None, *, keep: bool) -> LocalWriter:
        if base is not None:
            number = base.number + 1
        else:  # no index, or one whose manifest or files are damaged: after every number on disk
            number = max(self._generations_on_disk(), default=0) + 1
        self.clean_leftovers(keep={base.number} if base is not None else set())
        return LocalWriter(self, number, base if keep else None)

    def clean_leftovers(self, keep: set[int]) -> None:
        """Remove temp files of crashed writers and every generation's files but ``keep``'s."""
        if not self.path.is_dir():
            return
        for p in self.path.iterdir():
            if p.name.endswith(".tmp") or p.name.endswith("-journal"):
                with contextlib.suppress(OSError):
                    p.unlink()
                continue
            mt = _GEN_FILE.match(p.name)
            if mt and int(mt.group(2)) not in keep:
                with contextlib.suppress(OSError):
                    p.unlink()


class LocalWriter:
    """The next generation of a :class:`LocalStorage`: its catalog is ``meta.<n>.sqlite.tmp``
    until :meth:`commit` renames it (see :class:`GenerationWriter`)."""

    def __init__(self, storage: LocalStorage, number: int, base: Generation | None) -> None:
        from .vectors import FlatStore

        self.storage = storage
        self.number = number
        self._tmp: Path | None = storage.path / f"meta.{number}.sqlite.tmp"
        copy_of = storage.path / str(base.manifest["sqlite"]["file"]) if base is not None else None
        self.catalog = SqliteCatalogWriter.create(self._tmp, copy_of=copy_of)
        self.exact: FlatStore | None = FlatStore.of(base.exact) if base is not None else None
        # A table the previous writer did not vouch for in its manifest may be stale: rebuilt.
        trusted = base is not None and bool(base.manifest.get("lexical"))
        #: ``"ok"``, ``"created"`` (this generation adds the FTS table) or ``"unavailable"``.
        self.lexical = self.catalog.ensure_lexical(trusted=trusted)
        self.searches_in_place = False  # FAISS files derived from the exact store

    def _place(self, write: Callable[[Path], Mapping[str, Any]], name: str) -> dict[str, Any]:
        """Write a file through a temp name, fsync and rename it; its manifest entry."""
        path = self.storage.path / name
        tmp = path.with_name(path.name + ".tmp")
        entry = dict(write(tmp))
        fsync_file(tmp)
        os.replace(tmp, path)
        return {**entry, "file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}

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
        del questions  # the search store came finalized, tuned on them
        step = progress or (lambda _: None)
        n = self.number
        self.catalog.finish(n, vacuum=vacuum)
        assert self._tmp is not None
        spath = self.storage.path / f"meta.{n}.sqlite"
        fsync_file(self._tmp)
        os.replace(self._tmp, spath)
        self._tmp = None
        sqlite_entry = {"file": spath.name, "bytes": spath.stat().st_size, "sha256": sha256_file(spath)}
        step(1)
        faiss_entry = self._place(exact.save, f"faiss.{n}.index")
        approx = self._place(search.save, f"{search.kind}.{n}.index") if search is not None else None
        step(2)
        from .lexical import FTS_TOKENIZE

        manifest: Manifest = new_manifest(
            fields,
            generation=n,
            faiss=faiss_entry,
            approx=approx,
            sqlite=sqlite_entry,
            lexical=(
                {"kind": "sqlite-fts5", "table": "chunks_fts", "tokenize": FTS_TOKENIZE}
                if self.lexical != "unavailable"
                else None
            ),
        )
        fsync_dir(self.storage.path)
        write_json_atomic(self.storage.path / MANIFEST, manifest)  # the commit point
        step(3)
        self.storage.clean_leftovers(keep={n, n - 1})
        return manifest

    def close(self) -> None:
        self.catalog.discard()
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.unlink()
            self._tmp = None


# --------------------------------------------------------------------------------------------------
# the registry: which storage a location names

#: The entry-point group another package registers a storage in (``[project.entry-points.
#: "ragbudget.storages"] scratch = "my_pkg:ScratchStorage"``): the entry's name is the URL scheme
#: it takes (``scratch://…``), its object a class called with the location string that fulfils
#: :class:`Storage` (docs/storage.md, "Another storage").
STORAGES_GROUP = "ragbudget.storages"
#: The built-in storages besides a local folder, in the form an entry point takes (loaded the
#: same way as an installed one, so PostgreSQL's module is imported only for its locations):
#: PostgreSQL takes ``postgresql://`` and ``postgres://`` URLs and libpq keyword/value strings
#: (:func:`~ragbudget.retrieval.locations.is_db_location`).
BUILT_IN_STORAGES = {"postgresql": "ragbudget.retrieval.postgres:PostgresStorage"}
#: A local folder: every location that is neither a URL nor a PostgreSQL string.
LOCAL = "local"
_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
#: What a class must have to be taken as a storage: :class:`Storage`'s methods.
_STORAGE_MEMBERS = tuple(n for n, v in vars(Storage).items() if callable(v) and not n.startswith("_"))


def _installed_storages() -> dict[str, Any]:
    """The ``ragbudget.storages`` entry points by name (lower-cased: URL schemes are)."""
    from importlib.metadata import entry_points

    return {ep.name.lower(): ep for ep in entry_points(group=STORAGES_GROUP)}


def storage_names() -> list[str]:
    """Every storage this installation can open: ``local``, the built-ins, then the installed
    ones (by the URL scheme each takes).

    >>> storage_names()[:2]
    ['local', 'postgresql']
    """
    return [LOCAL, *BUILT_IN_STORAGES, *sorted(n for n in _installed_storages() if n not in BUILT_IN_STORAGES)]


def storage_name(where: str | os.PathLike[str]) -> str:
    """Which storage holds the index at ``where``: ``"postgresql"`` for a PostgreSQL URL or
    keyword/value string, an installed storage's name for a URL of its scheme, ``"local"`` for
    anything else (a folder). A URL that no storage takes is refused in one line rather than
    taken for a folder named ``scheme:``.

    >>> storage_name(".ragbudget"), storage_name("postgresql:///rag"), storage_name("host=db dbname=rag")
    ('local', 'postgresql', 'postgresql')
    """
    from .locations import is_db_location, mask_location

    if is_db_location(where):
        return "postgresql"
    m = _URL_SCHEME.match(os.fspath(where)) if isinstance(where, (str, os.PathLike)) else None
    if m is None:
        return LOCAL
    scheme = m.group(1).lower()
    if scheme in _installed_storages():
        return scheme
    raise ConfigError(
        f"the index location {mask_location(where)} is a {scheme}:// URL and no installed storage takes it "
        f"(installed: {', '.join(storage_names())}); install the package that registers {scheme!r} in the "
        f"{STORAGES_GROUP} entry points, or write a folder of that name as ./NAME"
    )


def storage_class(name: str) -> type[Storage]:
    """The class of the storage ``name`` (:func:`storage_name`): a built-in one from
    :data:`BUILT_IN_STORAGES`, or the one an installed package registers under that name in the
    ``ragbudget.storages`` entry points. A registration that does not load or names no storage
    class is refused in one line naming its package."""
    from importlib.metadata import EntryPoint

    if name == LOCAL:
        return LocalStorage
    if name in BUILT_IN_STORAGES:
        entry = EntryPoint(name=name, value=BUILT_IN_STORAGES[name], group=STORAGES_GROUP)
    else:
        found = _installed_storages().get(name)
        if found is None:
            raise ConfigError(f"no storage {name!r}: installed are {', '.join(storage_names())}")
        entry = found
    package = getattr(getattr(entry, "dist", None), "name", None) or entry.value.partition(":")[0]
    try:
        cls = entry.load()
    except Exception as exc:  # noqa: BLE001 - any import failure of a plugin is the plugin's, said in one line
        raise ConfigError(
            f"the storage {name!r} (registered by {package}) failed to load: {type(exc).__name__}: {exc}"
        ) from None
    missing = [m for m in _STORAGE_MEMBERS if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ConfigError(
            f"the storage {name!r} (registered by {package}) is {entry.value}, which is not a storage class"
            + (f" (it lacks {', '.join(missing)})" if isinstance(cls, type) else "")
            + f"; a {STORAGES_GROUP} entry point names a class that fulfils ragbudget.retrieval.storage.Storage"
        )
    return cls  # type: ignore[no-any-return]


def open_storage(where: str | os.PathLike[str]) -> Storage:
    """The storage ``where`` names (:func:`storage_name`), opened: nothing is read or connected
    to yet.

    >>> open_storage(".ragbudget")
    LocalStorage('.ragbudget')
    >>> open_storage("postgresql://me:pw@db/rag")
    PostgresStorage('postgresql://me:***@db/rag')
    >>> open_storage("host=db dbname=rag user=me password=pw")
    PostgresStorage('host=db dbname=rag user=me password=***')
    """
    name = storage_name(where)
    if name == LOCAL:
        return LocalStorage(where)
    cls = storage_class(name)
    try:
        return cls(os.fspath(where))  # type: ignore[call-arg]
    except RagBudgetError:
        raise
    except Exception as exc:  # noqa: BLE001 - a plugin's constructor failing is said in one line, masked
        from .locations import mask_location

        raise ConfigError(
            f"the storage {name!r} refused {mask_location(where)}: {type(exc).__name__}: {mask_location(str(exc))}"
        ) from None


def __getattr__(name: str) -> Any:  # FORMAT_VERSION lived here: one release more, with a warning
    from .._compat import moved_attribute

    if name != "FORMAT_VERSION":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return moved_attribute(__name__, "ragbudget.retrieval.manifest", name)
