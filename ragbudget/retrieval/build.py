"""The index writer: files in, one atomic generation out.

One job: one index-writing run, from the scan to the committed generation (its steps share the
lock, the copied SQLite file and the checkpoint, and only make sense in that order).

One :class:`_Builder` run holds the index lock (taken by :meth:`Index.build`), copies the current
generation's SQLite file, scans the roots, loads/cleans/chunks the changed files, drives
deduplication and the vector store, embeds through an executor (:mod:`ragbudget.retrieval.executors`: in
process or on Ray; checkpointed, so a killed or failed run resumes), and commits by
renaming the new files into place and then the manifest. See :mod:`ragbudget.retrieval.index` for the layout
and the atomicity argument.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sqlite3
import struct
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import (
    ConfigError,
    ExecutorError,
    IndexCorruptError,
    IndexNotFoundError,
    InputPathError,
    LoadError,
)
from ..types import Document, IndexSummary
from .index import (
    _FILES_ADDED_COLUMNS,
    _GEN_FILE,
    _SCHEMA,
    FORMAT_VERSION,
    MANIFEST,
    REMOVAL_GUARD_FILES,
    REMOVAL_GUARD_SHARE,
    ProgressCallback,
    _canon,
    _count,
    _fallback_root,
    _fsync_dir,
    _fsync_file,
    _new_label,
    _read_roots,
    _Root,
    _Roots,
    _sha256_file,
    _stores_sentences,
    _write_json_atomic,
)
from .lexical import FTS_TOKENIZE, _ensure_fts
from .vectors import FlatStore, choose_store, make_store

if TYPE_CHECKING:
    from .embed import Embedder
    from .executors import EmbedExecutor
    from .index import Index

log = logging.getLogger(__name__)

# Embedded batches of the run in progress, appended and fsync'ed per batch, so a re-run after a
# kill reuses them (see ``_Checkpoint``). Not a generation file: ``_clean_leftovers`` keeps it.
CHECKPOINT = "embed.checkpoint"


def _store_kind(manifest: dict[str, Any]) -> str:
    """The kind of search store a manifest names (``flat`` when the exact store searches)."""
    return str((manifest.get("approx") or {}).get("kind") or "flat")


def _no_progress(phase: str, done: int, total: int | None = None) -> None:
    """Default progress callback: nothing to report to."""


_EMBEDDER_IDENTITY = ("kind", "id", "pooling", "max_tokens", "window_overlap")


def _identity(spec: dict[str, Any]) -> dict[str, Any]:
    # Compared without loading the model: a re-run on an unchanged corpus must cost a stat per file.
    return {k: spec.get(k) for k in _EMBEDDER_IDENTITY if k != "max_tokens" or spec.get("kind") == "hash"}


def _light_spec(emb: Embedder) -> dict[str, Any]:
    from .embed import HashEmbedder, SentenceTransformerEmbedder

    if isinstance(emb, SentenceTransformerEmbedder):
        return {
            "kind": "sentence-transformers",
            "id": emb.id,
            "model": emb.model_name,
            "pooling": emb.pooling,
            "window_overlap": emb.window_overlap,
        }
    if isinstance(emb, HashEmbedder):
        return emb.spec()
    return {"kind": "custom", "id": emb.id, "pooling": emb.pooling}


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
            log.info("resuming from %d embedded chunks checkpointed by an interrupted run", len(self.vectors))

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
        for text, vec, w in zip(texts, vecs, windows, strict=True):
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

    def __init__(
        self,
        idx: Index,
        paths: list[str],
        *,
        embedder: Embedder | None,
        tokenizer: Any,
        settings: dict[str, Any],
        include: Any,
        exclude: Any,
        max_bytes: int | None,
        clean: bool,
        store: str,
        rebuild: bool,
        batch_files: int,
        embed_batch: int,
        progress: ProgressCallback | None,
        roots: Sequence[tuple[str, str]] = (),
        prune: bool = False,
        allow_removal: bool = False,
        executor: EmbedExecutor | None = None,
    ) -> None:
        from .executors import LocalExecutor

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
        self.store = store
        self.store_report: dict[str, Any] | None = None
        self.rebuild = rebuild
        self.batch_files = batch_files
        self.embed_batch = embed_batch
        # Where embedding runs (the one seam between local and Ray): chunks to embed are gathered
        # into rounds of the executor's size, one embed_batch by default, as before.
        self.executor: EmbedExecutor = executor or LocalExecutor()
        self.flush_at = self.executor.round_size or embed_batch
        self.progress: ProgressCallback = progress or _no_progress
        self.t0 = time.perf_counter()
        self.stats: dict[str, Any] = {
            k: 0
            for k in (
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
                "windows_pooled",
                "windows_embedded",
                "files_added",
                "files_updated",
                "files_kept",
                "chunks_resumed",
                "sentences_embedded",
                "sentences_reused",
            )
        }
        self.embed_seconds = 0.0
        self.sentence_seconds = 0.0
        self.n_seen = 0  # files and skipped entries the scan found (set by the scan)
        self.counts: dict[str, int] | None = None  # the committed generation's counts
        self.skipped: list[tuple[str, str, str]] = []
        self.available: dict[str, bool] = {}  # missing dependencies checked in this run
        self.db: sqlite3.Connection | None = None
        self.flat: FlatStore | None = None
        self.tmp_db: Path | None = None
        self.pending: list[tuple[int, str]] = []
        self.embed_total = 0
        self.dedup: Any = None  # the Deduplicator, loaded from the kept chunks on first use
        self.sig_dtype: str | None = None
        self.reuse: tuple[sqlite3.Connection, Any] | None = None
        self.old: dict[str, Any] | None = None
        self.changed = False
        self.lexical = "unavailable"

    # -- setup ---------------------------------------------------------------------------------

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.executor.close()
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
            reasons.append(
                f"embedder changed: {old['embedder'].get('id')} -> {self.embedder.id}"
                f" (pooling {old['embedder'].get('pooling')} -> {self.embedder.pooling})"
            )
        from .index_settings import changes

        reasons += [f"{section} settings changed: {', '.join(c)}" for section, c in changes(old, self.settings).items()]
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
            flat, _, db = self.idx._open_generation(self.old, writable=True)
            db.close()
        except IndexCorruptError as exc:
            self.old = None
            return None, None, f"previous index damaged: {exc}"
        return flat, self.dir / self.old["sqlite"]["file"], ""

    def run(self) -> IndexSummary:
        from ..input.loaders import scan

        self.executor.check()  # an unreachable cluster fails here, before a file is read
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
        if self.settings["sentences"] is None:
            # Not asked either way: what the index has. A new index stores none (span packing
            # embeds a sentence when a question first needs it, kept in the cache beside the
            # index): half the embedding work at build time, and sentences no question reaches
            # are never embedded.
            self.settings["sentences"] = bool(self.old is not None and _stores_sentences(self.old))
        self.rebuilt = bool(reason) or (self.rebuild and self.old is not None)
        self.reason = reason
        if self.old and not reason:
            self.sig_dtype = self.old.get("dedup_signature_dtype")

        self.tmp_db = self.dir / f"meta.{gen}.sqlite.tmp"
        if self.old and not reason:
            assert old_db_path is not None
            shutil.copyfile(old_db_path, self.tmp_db)
            self.flat = old_flat
        else:
            if (
                self.old
                and old_db_path is not None
                and old_flat is not None
                and (_identity(self.old["embedder"]) == _identity(_light_spec(emb)))
            ):
                # Only chunking/dedup changed: old vectors are still valid for identical texts.
                rdb = sqlite3.connect(f"file:{old_db_path}?mode=ro&immutable=1", uri=True)
                self.reuse = (rdb, old_flat)
            self.flat = None
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
        self.lexical = _ensure_fts(self.db, trusted=bool(self.old and not reason and self.old.get("lexical")))
        self.changed = bool(reason) or self.old is None
        if self.old is not None and _store_kind(self.old) != choose_store(
            self.store, int(self.old.get("counts", {}).get("vectors", 0)), int(self.old["dim"])
        ):
            # Another search store: derived from the same vectors, so written without a rebuild.
            self.changed = True
        if self.lexical == "created" and self.old is not None and not reason:
            # An index from before the FTS table: this run stores it even if no file changed.
            log.info("adding the lexical (FTS5) table to the index in %s", self.dir)
            self.changed = True
        if self.old is not None and not reason and self.settings["sentences"] != _stores_sentences(self.old):
            # Turned on (or an index from before they were stored): this run embeds them for every
            # chunk, once, so span packing embeds no sentence at question time; turned off: this
            # run drops them. Either even if no file changed.
            if self.settings["sentences"]:
                log.info("adding sentence vectors (span packing) to the index in %s", self.dir)
            else:
                log.info("dropping the sentence vectors from the index in %s (sentence_vectors off)", self.dir)
            self.changed = True
        self.checkpoint = _Checkpoint(self.dir, _identity(_light_spec(emb)))

        # -- 0. roots: what the index held before, and which part of it this run may remove.
        rebuilding = bool(reason)
        # (size, mtime_ns, sha256, status, reason, detail, needs) by path; a rebuild reads the old
        # generation, which may predate the needs column (and re-reads every file anyway).
        if rebuilding and old_db_path is not None:
            with contextlib.closing(sqlite3.connect(f"file:{old_db_path}?mode=ro&immutable=1", uri=True)) as odb:
                before_roots = _read_roots(odb)
                before = {
                    r[0]: r[1:]
                    for r in odb.execute("SELECT path, size, mtime_ns, sha256, status, reason, detail, NULL FROM files")
                }
        else:
            before_roots = _read_roots(self.db)
            before = {
                r[0]: r[1:]
                for r in self.db.execute(
                    "SELECT path, size, mtime_ns, sha256, status, reason, detail, needs FROM files"
                )
            }
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
                log.warning(
                    "the index in %s records no roots (written by an older ragbudget); "
                    "recording %s as the root of its files",
                    self.dir,
                    fallback.label,
                )
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
                    paths=tuple(r.label for r in missing),
                )
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
        # The index never reads its own folder (manifest, SQLite, lock, temp files), wherever it is.
        found = scan(scan_paths, include=self.include, exclude=self.exclude, leave_out=[self.dir], **scan_opts)
        shielded += [
            _Root(_canon(str(s.path)), "", "dir") for s in found.skipped if s.reason in ("unreadable", "missing")
        ]
        known = {} if rebuilding else before
        self.old_indexed = {p for p, v in before.items() if v[3] == "indexed"}
        seen: set[str] = set()
        self.n_seen = len(found.files) + len(found.skipped)
        for s in found.skipped:
            path, why, detail = _canon(str(s.path)), str(s.reason), s.detail
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
        retried = 0
        for f in found.files:
            path = str(f.path)
            seen.add(path)
            prev = known.get(path)
            if prev is not None and prev[3] == "skipped" and prev[4] == "missing_dependency" and self._back(prev[6]):
                # Skipped for want of a library or program that is installed now: read it again,
                # even unchanged (its size, mtime and hash say nothing about the dependency).
                todo.append((path, f.size, f.mtime_ns, None))
                retried += 1
                continue
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
        if retried:
            log.info("retrying %d file(s) skipped for a missing dependency that is installed now", retried)
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
            (r.path, r.label, r.kind) for r in _read_roots(self.db)
        }:
            self.changed = True

        # -- 2. load, clean, chunk, dedup, embed; files stream in batches.
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

        if not self.changed:
            # Nothing to commit: no new generation, the current one stays.
            self.checkpoint.remove()
            return self._summary(committed=False)

        # -- 3. chunks left without any source disappear, from SQLite and FAISS alike.
        orphans = [
            r[0] for r in self.db.execute("SELECT id FROM chunks WHERE id NOT IN (SELECT chunk_id FROM sources)")
        ]
        if orphans:
            import numpy as np

            self.db.executemany("DELETE FROM chunks WHERE id=?", [(i,) for i in orphans])
            if self.flat is not None:
                self.flat.remove(np.array(orphans, dtype=np.int64))
            self.stats["chunks_removed"] += len(orphans)
        if self.settings["sentences"]:
            self._embed_sentences()
        else:
            self.db.execute("DELETE FROM sentence_vectors")
        self.roots = self._final_roots()
        self.db.execute("DELETE FROM roots")
        self.db.executemany(
            "INSERT INTO roots (path, label, kind) VALUES (?,?,?)", [(r.path, r.label, r.kind) for r in self.roots]
        )
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

    def _back(self, needs: str | None) -> bool:
        """Whether the dependency a skipped file lacked is there now (checked once a run). A skip
        recorded before ``needs`` was (``None``) is retried once, and records it then."""
        if needs is None:
            return True
        if needs not in self.available:
            from ..input.formats import available

            self.available[needs] = available(needs)
        return self.available[needs]

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
        from ..input.loaders import load_document

        needs = None
        try:
            if digest is None:
                digest = _sha256_file(Path(path))
            return load_document(path, clean=self.clean), digest
        except LoadError as exc:
            reason, detail, needs = exc.reason, str(exc), exc.needs
        except OSError as exc:
            reason, detail = "unreadable", str(exc)
        self._record_file(path, size, mtime_ns, digest, "skipped", reason, detail, needs=needs)
        self.skipped.append((path, reason, detail))
        return None, digest

    def _index_doc(self, doc: Document, path: str, size: int, mtime_ns: int, digest: str | None) -> None:
        from ..input.chunking import chunk_document

        assert self.db is not None
        furniture = _count(doc.meta.get("furniture_removed", 0)) + _count(doc.meta.get("boilerplate_removed", 0))
        self.stats["furniture_lines_removed"] += furniture
        ch = self.settings["chunking"]
        chunks = chunk_document(
            doc, min_tokens=ch["min_tokens"], max_tokens=ch["max_tokens"], overlap=ch["overlap"], tokenizer=self.tok
        )
        chunks = [c for c in chunks if c.text.strip()]
        mode = self.settings["dedup"]["mode"]
        # Hashes and signatures for a whole file at once: the batch functions vectorise. Every
        # mode stores the same hash (dedup.content_hash): vector reuse and orphan revival look
        # chunks up by it, whatever mode wrote them.
        from ..input.dedup import content_hashes

        hashes = content_hashes([c.text for c in chunks])
        sigs: Any = [None] * len(chunks)
        if mode == "near" and chunks:
            from ..input.dedup import minhash_signatures

            sigs = minhash_signatures([c.text for c in chunks], num_perm=self.settings["dedup"]["num_perm"])
        for c, h, sig in zip(chunks, hashes, sigs, strict=True):
            self._add_chunk(path, c, h, sig)
        warning = doc.meta.get("encoding_warning") or None
        if warning:
            self.warnings.append((path, str(warning)))
        pages = int(doc.meta.get("n_pages") or len(doc.pages)) if doc.paginated else None
        labels = doc.meta.get("page_labels")
        self._record_file(
            path,
            size,
            mtime_ns,
            digest,
            "indexed",
            None,
            None,
            len(chunks),
            furniture,
            pages,
            warning,
            json.dumps(list(labels)) if labels else None,
        )
        self.stats["files_indexed"] += 1
        self.stats["files_updated" if path in self.old_indexed else "files_added"] += 1

    def _record_file(
        self,
        path: str,
        size: int,
        mtime_ns: int,
        digest: str | None,
        status: str,
        reason: str | None,
        detail: str | None,
        n_chunks: int = 0,
        furniture: int = 0,
        pages: int | None = None,
        warning: str | None = None,
        page_labels: str | None = None,
        *,
        needs: str | None = None,
    ) -> None:
        assert self.db is not None
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
                page_labels,
                needs,
            ),
        )

    def _dedup(self) -> Any:
        """The :class:`~ragbudget.input.dedup.Deduplicator` of this run, holding every chunk that still
        has a source (built from the stored hashes and signatures: no text is re-read)."""
        if self.dedup is None:
            import numpy as np

            from ..input.dedup import DEFAULT_NUM_PERM, DEFAULT_THRESHOLD, DedupDecision, Deduplicator

            d = self.settings["dedup"]
            mode = d["mode"]
            self.dedup = Deduplicator(
                threshold=d["threshold"] or DEFAULT_THRESHOLD,
                num_perm=d["num_perm"] or DEFAULT_NUM_PERM,
                near=mode == "near",
                exact=mode != "none",
            )
            if mode != "none":  # "none" never looks a chunk up: nothing to load
                assert self.db is not None
                dtype = self.sig_dtype
                for cid, h, blob in self.db.execute(
                    "SELECT id, content_hash, minhash FROM chunks WHERE EXISTS "
                    "(SELECT 1 FROM sources WHERE chunk_id = chunks.id)"
                ):
                    sig = np.frombuffer(blob, dtype=dtype) if mode == "near" and blob is not None and dtype else None
                    # Kept chunks are distinct by construction: placed as they are, not re-decided.
                    self.dedup.add(cid, decision=DedupDecision("new", None, 0.0, sig, h))
        return self.dedup

    def _add_chunk(self, path: str, c: Any, h: str, sig: Any) -> None:
        assert self.db is not None
        src = (path, c.start, c.end, c.page_start, c.page_end)
        if sig is not None:
            self.sig_dtype = str(sig.dtype)
        dd = self._dedup()
        decision = dd.check(digest=h, signature=sig)
        if decision.kind != "new":
            # Exact: same normalized text; near: most similar first (ties: earliest inserted).
            self.stats["exact_duplicates" if decision.kind == "exact" else "near_duplicates"] += 1
            self._add_source(int(decision.duplicate_of), src)
            return
        row = self.db.execute(
            "SELECT id, minhash FROM chunks WHERE content_hash=? AND NOT EXISTS "
            "(SELECT 1 FROM sources WHERE chunk_id = chunks.id) LIMIT 1",
            (h,),
        ).fetchone()
        if row is not None:
            # An orphan of a changed file, same text again: revive it, no re-embedding.
            cid = int(row[0])
            self.stats["chunks_reused"] += 1
            self.db.execute("UPDATE chunks SET headings=? WHERE id=?", (json.dumps(list(c.headings)), cid))
        else:
            cur = self.db.execute(
                "INSERT INTO chunks (text, n_tokens, headings, content_hash, minhash, windows) VALUES (?,?,?,?,?,0)",
                (c.text, int(c.n_tokens), json.dumps(list(c.headings)), h, sig.tobytes() if sig is not None else None),
            )
            assert cur.lastrowid is not None
            cid = int(cur.lastrowid)
        dd.add(cid, decision=decision)
        self._add_source(cid, src)
        if row is not None:
            return
        self.stats["chunks_added"] += 1
        self.pending.append((cid, c.text))
        self.embed_total += 1
        if len(self.pending) >= self.flush_at:
            self._flush()

    def _add_source(self, cid: int, src: tuple[Any, ...]) -> None:
        assert self.db is not None
        n = self.db.execute("SELECT COALESCE(MAX(ord), -1) + 1 FROM sources WHERE chunk_id=?", (cid,)).fetchone()[0]
        self.db.execute(
            'INSERT INTO sources (chunk_id, path, start, "end", page_start, page_end, ord) VALUES (?,?,?,?,?,?,?)',
            (cid, *src, n),
        )

    # -- vectors -------------------------------------------------------------------------------

    def _ensure_flat(self, dim: int) -> None:
        if self.flat is None:
            self.flat = FlatStore(dim)

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
            vecs = self._embed(batch, todo, vecs, windows)
        assert vecs is not None
        vecs = np.ascontiguousarray(vecs, dtype=np.float32)
        self._ensure_flat(vecs.shape[1])
        assert self.flat is not None
        if self.flat.dim != vecs.shape[1]:
            raise ConfigError(
                f"embedder {self.embedder and self.embedder.id!r} gives {vecs.shape[1]}-d vectors, "
                f"the index holds {self.flat.dim}-d; rebuild with --rebuild"
            )
        self.flat.add(ids, vecs)
        self.db.executemany(
            "UPDATE chunks SET windows=? WHERE id=?", [(w, int(i)) for w, i in zip(windows, ids, strict=True)]
        )
        self.progress("embed", self.stats["chunks_embedded"] + self.stats["chunks_reused"], self.embed_total)

    def _embed(
        self, batch: list[tuple[int, str]], todo: list[int], vecs: Any, windows: list[int], *, what: str = "chunks"
    ) -> Any:
        """Embed the texts of ``batch`` at ``todo`` through the executor; fill ``vecs`` and
        ``windows`` at those rows. Each shard is checkpointed as it arrives, so a failed job
        keeps what came back. ``what="sentences"``: the sentence pass (its own counters and
        time; a vector is a vector of its text, so the checkpoint serves both)."""
        import numpy as np

        emb = self.embedder
        assert emb is not None
        texts = [batch[j][1] for j in todo]
        done = np.zeros(len(todo), dtype=bool)
        t = time.perf_counter()
        if what == "chunks":  # the phase starts now (its rate and ETA count from here)
            self.progress("embed", self.stats["chunks_embedded"] + self.stats["chunks_reused"], self.embed_total)
        try:
            for shard in self.executor.embed(emb, texts, batch_size=self.embed_batch):
                if vecs is None:
                    vecs = np.zeros((len(batch), shard.vectors.shape[1]), dtype=np.float32)
                rows = [todo[p] for p in shard.positions]
                vecs[rows] = shard.vectors
                for j, w in zip(rows, shard.windows, strict=True):
                    windows[j] = w
                done[shard.positions] = True
                if self.checkpoint is not None:
                    self.checkpoint.add([batch[j][1] for j in rows], shard.vectors, shard.windows)
                if what == "sentences":
                    continue
                self.stats["chunks_embedded"] += len(rows)
                self.stats["windows_pooled"] += sum(1 for w in shard.windows if w > 1)
                self.stats["windows_embedded"] += shard.texts_fed
                self.progress("embed", self.stats["chunks_embedded"] + self.stats["chunks_reused"], self.embed_total)
        except ExecutorError as exc:
            kept = len(self.checkpoint.vectors) if self.checkpoint is not None else 0
            raise ExecutorError(
                f"{exc}. {self._unchanged_note()}; {self.stats['chunks_embedded'] + kept} embedded "
                "chunk(s) are checkpointed, so a re-run resumes after them"
            ) from None
        finally:
            if what == "chunks":
                self.embed_seconds += time.perf_counter() - t
        if not done.all():
            raise ExecutorError(
                f"the {self.executor.name} executor returned vectors for {int(done.sum())} of "
                f"{len(todo)} {what}. {self._unchanged_note()}"
            )
        return vecs

    def _unchanged_note(self) -> str:
        if self.old is None:
            return "No index was written"
        return f"The index was not changed (generation {self.gen - 1} stays)"

    def _reuse_vectors(self, batch: list[tuple[int, str]], windows: list[int]) -> tuple[Any, list[int]]:
        import numpy as np

        from ..input.dedup import content_hash

        rdb, old_flat = self.reuse  # type: ignore[misc]
        vecs = np.zeros((len(batch), old_flat.dim), dtype=np.float32)
        todo = []
        for j, (_, text) in enumerate(batch):
            # Indexes written with dedup="none" before it used content_hash stored the sha256
            # of the raw text: look for either, so their vectors are reused too.
            raw = hashlib.sha256(text.encode()).hexdigest()
            row = rdb.execute(
                "SELECT id, windows FROM chunks WHERE content_hash IN (?, ?) LIMIT 1", (content_hash(text), raw)
            ).fetchone()
            if row is None:
                todo.append(j)
                continue
            try:
                vecs[j] = old_flat.vectors([int(row[0])])[0]
                windows[j] = int(row[1])
                self.stats["chunks_reused"] += 1
            except KeyError:
                todo.append(j)
        return vecs, todo

    # -- sentence vectors ----------------------------------------------------------------------

    def _embed_sentences(self) -> None:
        """Every chunk without stored sentence vectors gets them: its sentences (as span packing
        cuts them) embedded with the index's embedder, float16, one row per chunk. Incremental
        like the chunk vectors: rows of unchanged chunks were copied with the generation, rows of
        removed chunks went with them (trigger), a sentence already embedded — in this run, in
        the previous generation when a rebuild may reuse its vectors, or in the checkpoint of a
        killed run — is not embedded again."""
        import numpy as np

        from ..prompt.spans import sentence_digest, sentence_texts

        assert self.db is not None
        todo = self.db.execute(
            "SELECT id, text FROM chunks WHERE id NOT IN (SELECT chunk_id FROM sentence_vectors) ORDER BY id"
        ).fetchall()
        if not todo:
            return
        t = time.perf_counter()
        known = self._old_sentence_vectors()
        total = len(todo)
        self.progress("sentences", 0, total)
        step = max(1, self.embed_batch // 4)  # chunks per round: ~8-30 sentences each
        for lo in range(0, total, step):
            part = todo[lo : lo + step]
            sents = [sentence_texts(text) for _, text in part]
            keys = [[sentence_digest(x) for x in ss] for ss in sents]
            need: dict[bytes, str] = {}
            for ss, ks in zip(sents, keys, strict=True):
                for x, k in zip(ss, ks, strict=True):
                    if k in known or k in need:
                        continue
                    got = self.checkpoint.get(x) if self.checkpoint is not None else None
                    if got is not None and self.flat is not None and got[0].shape[0] == self.flat.dim:
                        known[k] = got[0]
                        self.stats["sentences_reused"] += 1
                    else:
                        need[k] = x
            if need:
                texts = list(need.values())
                vecs = self._embed(
                    [(0, x) for x in texts], list(range(len(texts))), None, [1] * len(texts), what="sentences"
                )
                known.update(zip(need, np.asarray(vecs, dtype=np.float32), strict=True))
                self.stats["sentences_embedded"] += len(texts)
            dim = self.flat.dim if self.flat is not None else None
            rows = []
            for (cid, _), ks in zip(part, keys, strict=True):
                mat = np.stack([known[k] for k in ks]) if ks else np.zeros((0, dim or 0), dtype=np.float32)
                rows.append((cid, b"".join(ks), mat.astype("<f2").tobytes()))
            self.db.executemany(
                "INSERT OR REPLACE INTO sentence_vectors (chunk_id, digests, vectors) VALUES (?,?,?)", rows
            )
            self.progress("sentences", min(lo + step, total), total)
        self.sentence_seconds += time.perf_counter() - t

    def _old_sentence_vectors(self) -> dict[bytes, Any]:
        """Sentence vectors of the previous generation by digest, when a rebuild may reuse them
        (only chunking/dedup changed: same embedder); empty otherwise."""
        import numpy as np

        if self.reuse is None:
            return {}
        rdb, old_flat = self.reuse
        out: dict[bytes, Any] = {}
        try:
            for digests, blob in rdb.execute("SELECT digests, vectors FROM sentence_vectors"):
                n = len(digests) // 16
                mat = np.frombuffer(blob, dtype="<f2").reshape(n, old_flat.dim).astype(np.float32)
                for j in range(n):
                    out[digests[16 * j : 16 * j + 16]] = mat[j]
        except sqlite3.OperationalError:  # written before sentence vectors were stored
            return {}
        return out

    # -- commit --------------------------------------------------------------------------------

    def _commit(self) -> None:
        assert self.db is not None and self.tmp_db is not None
        gen = self.gen
        emb = self.embedder
        assert emb is not None
        if self.flat is None:  # nothing was ever embedded: an empty index still needs its dim
            self._ensure_flat(emb.dim)
        assert self.flat is not None
        self.progress("write", 0, 3)
        self.db.execute("INSERT OR REPLACE INTO meta VALUES ('generation', ?)", (str(gen),))
        self.db.commit()
        if self.old is not None and not self.reason and _stores_sentences(self.old) and not self.settings["sentences"]:
            # The rows are gone but their pages stay in the file copied from the previous
            # generation until it is rewritten: without this the index would not shrink (the
            # vectors were about half its bytes). Once, on the run that drops them.
            self.db.execute("VACUUM")
        counts = {
            "chunks": self.db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0],
            "sources": self.db.execute("SELECT COUNT(*) FROM sources").fetchone()[0],
            "files": self.db.execute("SELECT COUNT(*) FROM files WHERE status='indexed'").fetchone()[0],
            "files_skipped": self.db.execute("SELECT COUNT(*) FROM files WHERE status!='indexed'").fetchone()[0],
            "vectors": self.flat.ntotal,
            "windowed_chunks": self.db.execute("SELECT COUNT(*) FROM chunks WHERE windows>1").fetchone()[0],
        }
        if self.lexical != "unavailable":
            counts["lexical_rows"] = self.db.execute("SELECT COUNT(*) FROM chunks_fts").fetchone()[0]
        counts["sentence_vectors"] = self.db.execute("SELECT COUNT(*) FROM sentence_vectors").fetchone()[0]
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
        flat_entry = self.flat.save(ftmp)
        _fsync_file(ftmp)
        os.replace(ftmp, fpath)
        approx_entry = self._write_search_store(gen)
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
            "dim": self.flat.dim,
            "pooling": spec.get("pooling"),
            "chunking": self.settings["chunking"],
            "dedup": self.settings["dedup"],
            "cleaning": self.settings["cleaning"],
            "dedup_signature_dtype": self.sig_dtype,
            "faiss": {**flat_entry, "file": fpath.name, "bytes": fpath.stat().st_size, "sha256": _sha256_file(fpath)},
            "approx": approx_entry,
            "store": self.store_report,
            "lexical": (
                {"kind": "sqlite-fts5", "table": "chunks_fts", "tokenize": FTS_TOKENIZE}
                if self.lexical != "unavailable"
                else None
            ),
            # Every chunk's sentences embedded for span packing (build.py _embed_sentences), or
            # none (sentence_vectors off); an index without this entry gets them on its next write.
            "sentences": (
                {"stored": True, "table": "sentence_vectors", "dtype": "float16", "splitter": 1}
                if self.settings["sentences"]
                else {"stored": False}
            ),
            "sqlite": {"file": spath.name, "bytes": spath.stat().st_size, "sha256": _sha256_file(spath)},
            "counts": counts,
            "roots": [{"label": r.label, "kind": r.kind} for r in sorted(self.roots, key=lambda r: r.label)],
            "last_run": self._summary(committed=True).to_dict(),
        }
        _fsync_dir(self.dir)
        _write_json_atomic(self.dir / MANIFEST, manifest)  # the commit point
        self.progress("write", 3, 3)
        self._clean_leftovers(keep={gen, gen - 1})

    def _write_search_store(self, gen: int) -> dict[str, Any] | None:
        """Build, tune and write the search store ``store=`` asks for (``None``: the exact one
        searches). Records the choice and the recall measured in :attr:`store_report`."""
        assert self.flat is not None
        n, d = self.flat.ntotal, self.flat.dim
        kind = choose_store(self.store, n, d)
        self.store_report = {"requested": self.store, "kind": kind, "recall_at_10": None}
        if kind == "flat":
            self.store_report["recall_at_10"] = 1.0
            return None
        store = make_store(kind, d, exact=self.flat)
        report = store.finalize()
        path = self.dir / f"{kind}.{gen}.index"
        tmp = path.with_name(path.name + ".tmp")
        entry = store.save(tmp)
        _fsync_file(tmp)
        os.replace(tmp, path)
        self.store_report.update(
            recall_at_10=entry.get("recall_at_10"),
            recall_queries=report.queries,
            build_seconds=round(report.seconds, 3),
        )
        if report.recall_at_10 is not None and report.recall_at_10 < store.target:
            log.warning(
                "the %s store reaches recall@10 %.3f against exact search, below the %.2f "
                "target, at its largest search setting (%s)",
                kind,
                report.recall_at_10,
                store.target,
                report.params,
            )
        return {**entry, "file": path.name, "bytes": path.stat().st_size, "sha256": _sha256_file(path)}

    def _summary(self, *, committed: bool) -> IndexSummary:
        if committed and self.counts is not None:
            total = self.counts["chunks"]
        else:
            total = self._count_chunks()
        shown = _Roots(self.roots)
        return IndexSummary(
            files_seen=self.n_seen,
            skipped=tuple((shown.display(p), r, shown.scrub(d) or "") for p, r, d in self.skipped),
            warnings=tuple((shown.display(p), m) for p, m in self.warnings),
            chunks_total=total,
            seconds=time.perf_counter() - self.t0,
            embed_seconds=self.embed_seconds,
            sentence_seconds=self.sentence_seconds,
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
