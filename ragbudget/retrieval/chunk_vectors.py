"""The vectors a writing run adds: reused, resumed or embedded, for chunks and their sentences.

A writing run (:mod:`ragbudget.retrieval.build`) hands :class:`ChunkVectors` the chunks it added,
a round at a time; each gets its vector from the cheapest place that has it: the previous
generation (a rebuild with the same embedder finds unchanged texts there by content hash), the
embedding checkpoint of a killed run (:mod:`ragbudget.retrieval.checkpoint`), or the embedder,
through an executor (:mod:`ragbudget.retrieval.executors`: in process or on Ray). Every embedded
shard is checkpointed as it arrives, so a failed or killed run keeps what came back. The vectors
go into the generation's exact store in chunk-id order, whichever executor embedded them; sentence
vectors (span packing) go through the same path and the same checkpoint.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..errors import ConfigError, ExecutorError
from .rows import encode_sentence_rows
from .vectors import FlatStore

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from .embed import Embedder
    from .executors import EmbedExecutor
    from .storage import CatalogWriter, EmbedCheckpoint, Generation

__all__ = ["ChunkVectors"]


class ChunkVectors:
    """The vectors of one writing run: ``exact`` (the generation's exact store, ``None`` until
    the first vector gives its dimension), filled by :meth:`add` and :meth:`embed_sentences`.

    ``stats`` is the run's counter dict (``chunks_embedded``, ``chunks_reused``,
    ``chunks_resumed``, ``windows_pooled``, ``windows_embedded``, ``sentences_embedded``,
    ``sentences_reused``), updated in place; ``progress(phase, done, total)`` hears about the
    ``embed`` and ``sentences`` phases; ``unchanged`` says, in an error, what stays of the index
    when embedding fails."""

    def __init__(
        self,
        *,
        embedder: Embedder,
        executor: EmbedExecutor,
        catalog: CatalogWriter,
        exact: FlatStore | None,
        checkpoint: EmbedCheckpoint,
        reuse: Generation | None,
        stats: dict[str, int],
        progress: Callable[[str, int, int | None], None],
        embed_batch: int,
        unchanged: str,
    ) -> None:
        self.embedder = embedder
        self.executor = executor
        self.catalog = catalog
        self.exact = exact
        self.checkpoint = checkpoint
        self.reuse = reuse
        self.stats = stats
        self.progress = progress
        self.embed_batch = embed_batch
        self.unchanged = unchanged
        #: Chunks this run has to give a vector (grows as files are chunked: the embed phase's total).
        self.total = 0
        self.embed_seconds = 0.0
        self.sentence_seconds = 0.0

    def _report(self) -> None:
        self.progress("embed", self.stats["chunks_embedded"] + self.stats["chunks_reused"], self.total)

    def add(self, batch: Sequence[tuple[int, str]]) -> None:
        """Vectors for the chunks ``batch`` (``(chunk id, text)``), added to the exact store and
        their window counts to the catalog."""
        if not batch:
            return
        import numpy as np

        ids = np.array([i for i, _ in batch], dtype=np.int64)
        vecs: NDArray[np.float32] | None = None
        windows = [1] * len(batch)
        todo = list(range(len(batch)))
        if self.reuse is not None:
            vecs, todo = self._reuse_vectors(batch, windows)
        if todo and self.checkpoint.vectors:
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
        if self.exact is None:
            self.exact = FlatStore(vecs.shape[1])
        if self.exact.dim != vecs.shape[1]:
            raise ConfigError(
                f"embedder {self.embedder.id!r} gives {vecs.shape[1]}-d vectors, "
                f"the index holds {self.exact.dim}-d; rebuild with --rebuild"
            )
        self.exact.add(ids, vecs)
        self.catalog.set_windows(zip(ids.tolist(), windows, strict=True))
        self._report()

    def _embed(
        self,
        batch: Sequence[tuple[int, str]],
        todo: list[int],
        vecs: NDArray[np.float32] | None,
        windows: list[int],
        *,
        what: str = "chunks",
    ) -> NDArray[np.float32]:
        """Embed the texts of ``batch`` at ``todo`` through the executor; fill ``vecs`` and
        ``windows`` at those rows. Each shard is checkpointed as it arrives, so a failed job
        keeps what came back. ``what="sentences"``: the sentence pass (its own counters and
        time; a vector is a vector of its text, so the checkpoint serves both)."""
        import numpy as np

        texts = [batch[j][1] for j in todo]
        done = np.zeros(len(todo), dtype=bool)
        t = time.perf_counter()
        if what == "chunks":  # the phase starts now (its rate and ETA count from here)
            self._report()
        try:
            for shard in self.executor.embed(self.embedder, texts, batch_size=self.embed_batch):
                if vecs is None:
                    vecs = np.zeros((len(batch), shard.vectors.shape[1]), dtype=np.float32)
                rows = [todo[p] for p in shard.positions]
                vecs[rows] = shard.vectors
                for j, w in zip(rows, shard.windows, strict=True):
                    windows[j] = w
                done[shard.positions] = True
                self.checkpoint.add([batch[j][1] for j in rows], shard.vectors, shard.windows)
                if what == "sentences":
                    continue
                self.stats["chunks_embedded"] += len(rows)
                self.stats["windows_pooled"] += sum(1 for w in shard.windows if w > 1)
                self.stats["windows_embedded"] += shard.texts_fed
                self._report()
        except ExecutorError as exc:
            raise ExecutorError(
                f"{exc}. {self.unchanged}; {self.stats['chunks_embedded'] + len(self.checkpoint.vectors)} "
                "embedded chunk(s) are checkpointed, so a re-run resumes after them"
            ) from None
        finally:
            if what == "chunks":
                self.embed_seconds += time.perf_counter() - t
        if not done.all():
            raise ExecutorError(
                f"the {self.executor.name} executor returned vectors for {int(done.sum())} of "
                f"{len(todo)} {what}. {self.unchanged}"
            )
        assert vecs is not None
        return vecs

    def _reuse_vectors(
        self, batch: Sequence[tuple[int, str]], windows: list[int]
    ) -> tuple[NDArray[np.float32], list[int]]:
        """Vectors of the previous generation for the texts it holds; the rows still to embed."""
        import numpy as np

        from ..input.dedup import content_hash

        assert self.reuse is not None
        old = self.reuse.exact
        vecs = np.zeros((len(batch), old.dim), dtype=np.float32)
        todo = []
        for j, (_, text) in enumerate(batch):
            # Indexes written with dedup="none" before it used content_hash stored the sha256
            # of the raw text: look for either, so their vectors are reused too.
            raw = hashlib.sha256(text.encode()).hexdigest()
            row = self.reuse.catalog.find_chunk(content_hash(text), raw)
            if row is None:
                todo.append(j)
                continue
            try:
                vecs[j] = old.vectors(np.array([row[0]], dtype=np.int64))[0]
                windows[j] = row[1]
                self.stats["chunks_reused"] += 1
            except KeyError:
                todo.append(j)
        return vecs, todo

    def embed_sentences(self) -> None:
        """Every chunk without stored sentence vectors gets them: its sentences (as span packing
        cuts them) embedded with the index's embedder, float16, one row per chunk. Incremental
        like the chunk vectors: rows of unchanged chunks were copied with the generation, rows of
        removed chunks went with them (trigger), a sentence already embedded — in this run, in
        the previous generation when a rebuild may reuse its vectors, or in the checkpoint of a
        killed run — is not embedded again."""
        import numpy as np

        from ..packing.spans import sentence_digest, sentence_texts

        todo = self.catalog.chunks_without_sentence_vectors()
        if not todo:
            return
        t = time.perf_counter()
        # Sentence vectors of the previous generation by digest, when a rebuild may reuse them
        # (only chunking/dedup changed: same embedder).
        known = self.reuse.catalog.all_sentence_vectors(self.reuse.exact.dim) if self.reuse is not None else {}
        dim = self.exact.dim if self.exact is not None else None
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
                    got = self.checkpoint.get(x)
                    if got is not None and got[0].shape[0] == dim:
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
            rows = []
            for (cid, _), ks in zip(part, keys, strict=True):
                mat = np.stack([known[k] for k in ks]) if ks else np.zeros((0, dim or 0), dtype=np.float32)
                rows.append((cid, *encode_sentence_rows(ks, mat)))
            self.catalog.put_sentence_vectors(rows)
            self.progress("sentences", min(lo + step, total), total)
        self.sentence_seconds += time.perf_counter() - t
