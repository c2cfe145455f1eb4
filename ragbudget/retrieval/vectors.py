"""Vector stores: how the index keeps its vectors and searches them.

Every store implements :class:`VectorStore`. The index always keeps the exact store
(:class:`FlatStore`, ``faiss.<gen>.index``): it is the truth that incremental runs edit, that
vectors are reused from, that hybrid search and rescoring read, and that recall is measured
against. A search store (:class:`HNSWStore`, :class:`IVFStore`) is derived from it at each commit,
written beside it in the same atomic generation and named in the manifest's ``approx`` entry.

Which store searches is ``store=``: ``"flat"``, ``"hnsw"``, ``"ivf"`` (IVF-PQ: product-quantized
codes, candidates rescored exactly), ``"ivf-flat"``, ``"auto"`` (:func:`choose_store`: exact
while a scan of the matrix meets the latency target, HNSW above that, IVF-PQ once the matrix is
too big to keep in memory twice), or the name of a store another package registers in the
``ragbudget.stores`` entry point group (:data:`STORES_GROUP`; loaded on first use, see
:func:`store_names`). An approximate store tunes its search parameter at build time
(:meth:`VectorStore.finalize`): the smallest ``efSearch``/``nprobe`` whose recall@10 against
exact search reaches its target on tuning queries. An HNSW graph given pseudo-questions (a few
words of sampled chunks embedded as queries, which the builder makes: see
:func:`~ragbudget.retrieval.recall.pseudo_questions`) tunes on them to :data:`QUESTION_TUNE_TARGET`;
otherwise a store tunes on the index's own vectors moved off by noise to :data:`TUNE_TARGET`.
The recall on the noisy own vectors is recorded in the manifest either way (with what the store
tuned on and its recall there), shown by ``stats`` and re-measured by ``verify``, which needs no
embedder for it.

faiss is imported when a store is first made or loaded, never by ``import ragbudget``.

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> x = rng.standard_normal((500, 16)).astype("float32")
>>> x /= np.linalg.norm(x, axis=1, keepdims=True)
>>> flat = FlatStore(16)
>>> flat.add(np.arange(500), x)
>>> store = make_store("hnsw", 16, exact=flat)
>>> report = store.finalize()
>>> report.kind, report.recall_at_10 >= RECALL_TARGET
('hnsw', True)
"""

from __future__ import annotations

import functools
import logging
import math
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from ..errors import ConfigError, IndexCorruptError
from .faiss_io import RowFile, read_index
from .recall import (
    PSEUDO_QUESTION_WORDS,
    QUERY_NOISE,
    QUESTION_TUNE_TARGET,
    RECALL_QUERIES,
    RECALL_TARGET,
    RECALL_TOLERANCE,
    TUNE_TARGET,
    StoreReport,
    measure_recall,
    tune,
    warn_below_target,
)

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    import numpy as np
    from numpy.typing import ArrayLike, NDArray

__all__ = [
    "APPROX_KINDS",
    "EF_LADDER",
    "PSEUDO_QUESTION_WORDS",
    "RECALL_TOLERANCE",
    "FLAT_MAX_BYTES",
    "HNSW_MAX_BYTES",
    "RECALL_QUERIES",
    "RECALL_TARGET",
    "QUERY_NOISE",
    "QUESTION_TUNE_TARGET",
    "STORES",
    "STORES_GROUP",
    "TUNE_TARGET",
    "FlatStore",
    "HNSWStore",
    "IVFStore",
    "StoreClass",
    "StoreReport",
    "VectorStore",
    "choose_store",
    "load_store",
    "make_store",
    "measure_recall",
    "store_names",
    "tune",
    "warn_below_target",
]

log = logging.getLogger(__name__)

#: What ``store=`` accepts besides the stores of the ``ragbudget.stores`` entry points (see
#: :func:`store_names`). ``"ivf"`` is IVF-PQ with exact rescoring.
STORES = ("auto", "flat", "hnsw", "ivf", "ivf-flat", "ivf-pq")
#: The entry point group through which another package adds a store: ``name = "module:Class"``,
#: the class a :class:`StoreClass`, its instances :class:`VectorStore` s whose ``kind`` is ``name``.
STORES_GROUP = "ragbudget.stores"
#: The kinds of search store written beside the exact one.
APPROX_KINDS = ("hnsw", "ivf-flat", "ivf-pq")

#: ``auto`` keeps exact search while the fp32 matrix is at most this big. An exact scan is bound by
#: memory bandwidth: 153.6 MB (100k × 384-d) took p50 16.7 ms on one core of the reference
#: machine (BENCHMARKS.md), 10.9 GB/s; the 5 ms target allows about 50 MB, less the spread under
#: load, so 40 MB: 26k MiniLM vectors.
FLAT_MAX_BYTES = 40_000_000
#: Above this the matrix is not kept twice (flat + HNSW graph with its own copy): ``auto`` picks
#: IVF-PQ, whose codes take 1/32 of it, and rescores its candidates from the exact file mapped
#: read-only (pages touched by rescoring only). 600 MB: 390k MiniLM vectors.
HNSW_MAX_BYTES = 600_000_000
#: HNSW graph parameters of every HNSW this package builds (FAISS locally, pgvector in a
#: database: ragbudget.retrieval.postgres.create_hnsw): links per node and the candidate list
#: while building. pgvector's defaults (16, 64) made a graph that needed ef_search 1000 to reach
#: the tuning target on ~100k chunks (bench/postgres.py --parts scale).
HNSW_M = 32
HNSW_EF_CONSTRUCTION = 80

# Search-parameter ladders tried by finalize, cheapest first.
# HNSW goes to 1024: on 107k chunks that are means of one article's sentences (tight clusters)
# questions still gained at 512 (0.968 on squad-test), where a search took 1.3 ms against 13.5 ms
# exact (bench/results/ladder_mean.json).
EF_LADDER = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
_NPROBE_LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# IVF-PQ: the PQ codes propose _RESCORE × k candidates, the SQ8 copy keeps _EXACT_TOP × k of
# them, and the exact cosines of those pick and order the final k. Many candidates because a
# question far from every chunk sees its neighbours at nearly equal scores, closer together than
# 48-byte PQ codes can tell apart (1M vectors: recall 0.96 with 200 candidates, at any nprobe).
_RESCORE = 100
_EXACT_TOP = 10


@runtime_checkable
class VectorStore(Protocol):
    """The interface every vector store implements. Ids are int64 chunk ids; vectors are
    unit-length float32 rows; scores are inner products (cosines), higher is better.

    ``save(path)`` writes one file (the storage renames it into the generation atomically) and
    returns the store's manifest fields (``kind`` among them); its class reads it back
    (``load(path, entry, exact=...)``, :class:`StoreClass`) with ``faiss.read_index`` or another
    reader that executes no code (no pickle). ``finalize()`` trains (IVF), builds (HNSW) and
    tunes the store before it is saved, and reports the recall measured. A store whose class
    sets ``tunes_on_questions = True`` is called ``finalize(questions=...)`` with the builder's
    pseudo-questions (query vectors) to tune on.
    """

    kind: str
    dim: int

    @property
    def ntotal(self) -> int: ...
    def add(self, ids: ArrayLike, vectors: ArrayLike) -> None: ...
    def remove(self, ids: ArrayLike) -> int: ...
    def search(self, queries: ArrayLike, k: int) -> tuple[NDArray[np.float32], NDArray[np.int64]]: ...
    def vectors(self, ids: ArrayLike) -> NDArray[np.float32]: ...
    def ids(self) -> NDArray[np.int64]: ...
    def finalize(self) -> StoreReport: ...
    def save(self, path: Path) -> dict[str, Any]: ...


class StoreClass(Protocol):
    """A search store's class, as the ``ragbudget.stores`` entry points name it (and as the
    built-in ones are): ``Class(dim, exact=flat, **params)`` is a new store derived from the
    exact one (:meth:`VectorStore.finalize` builds it), ``Class.load(path, entry, exact=flat)``
    reads a saved one back from its file and manifest entry."""

    def __call__(self, dim: int, *, exact: FlatStore | None, **params: Any) -> VectorStore: ...
    def load(self, path: Path, entry: Mapping[str, Any], *, exact: FlatStore | None = None) -> VectorStore: ...


def _as_ids(ids: ArrayLike) -> NDArray[np.int64]:
    import numpy as np

    return np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))


def _as_rows(x: ArrayLike, dim: int) -> NDArray[np.float32]:
    import numpy as np

    a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if a.ndim == 1:
        a = a.reshape(1, -1)
    if a.shape[1] != dim:
        raise ConfigError(f"vectors have dimension {a.shape[1]}, the store has {dim}")
    return a


class FlatStore:
    """Exact inner-product search over every vector (``IndexIDMap2(IndexFlatIP)``).

    ``mmap=True`` (when loading) is for a reader whose searches go to another store: rows are
    read by id from the file (:class:`~ragbudget.retrieval.faiss_io.RowFile`) for rescoring, and the matrix is mapped
    read-only only when an exact search or the id list is asked for (``verify``).
    """

    kind = "flat"

    # index: a faiss.IndexIDMap2, Any at faiss's seam (its stub types few of its methods).
    def __init__(self, dim: int, *, index: Any = None, path: Path | None = None) -> None:
        self.dim = int(dim)
        self._index = index
        self._path = path
        self._rows: RowFile | None = None
        if index is None and path is None:
            import faiss

            self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))

    @classmethod
    def of(cls, store: VectorStore) -> FlatStore:
        """``store`` as an exact store a writer can edit: itself when it is one, else a new one
        holding its every vector (what another storage's exact store gives a writer).

        >>> import numpy as np
        >>> flat = FlatStore(2); flat.add(np.array([7]), np.array([[0.6, 0.8]], dtype="float32"))
        >>> FlatStore.of(flat) is flat
        True
        """
        if isinstance(store, cls):
            return store
        ids = store.ids()
        flat = cls(store.dim)
        if len(ids):
            flat.add(ids, store.vectors(ids))
        return flat

    @property
    def loaded(self) -> bool:
        """Whether the FAISS index is in memory: a store loaded with ``mmap=True`` reads rows by
        id without it, until an exact search or the id list needs it."""
        return self._index is not None

    @property
    def index(self) -> Any:
        if self._index is None:
            import faiss

            assert self._path is not None
            self._index = read_index(self._path, faiss.IO_FLAG_MMAP_IFC)
        return self._index

    @property
    def ntotal(self) -> int:
        if self._index is None and self._rows is not None:
            return self._rows.ntotal
        return int(self.index.ntotal)

    def add(self, ids: ArrayLike, vectors: ArrayLike) -> None:
        self.index.add_with_ids(_as_rows(vectors, self.dim), _as_ids(ids))

    def remove(self, ids: ArrayLike) -> int:
        return int(self.index.remove_ids(_as_ids(ids)))

    def search(self, queries: ArrayLike, k: int) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
        scores, ids = self.index.search(_as_rows(queries, self.dim), int(k))
        return scores, ids

    def vectors(self, ids: ArrayLike) -> NDArray[np.float32]:
        """The stored rows of ``ids`` (raises ``KeyError`` naming an unknown id)."""
        import numpy as np

        want = _as_ids(ids)
        if not len(want):
            return np.zeros((0, self.dim), dtype=np.float32)
        if self._rows is not None:
            return self._rows.rows(want)
        try:
            rows: NDArray[np.float32] = self.index.reconstruct_batch(want)
            return rows
        except RuntimeError:
            for i in want:  # find which one is missing, to say so
                try:
                    self.index.reconstruct(int(i))
                except RuntimeError:
                    raise KeyError(int(i)) from None
            raise

    def ids(self) -> NDArray[np.int64]:
        import faiss
        import numpy as np

        return faiss.vector_to_array(self.index.id_map).astype(np.int64)

    def matrix(self) -> NDArray[np.float32]:
        """All rows, in :meth:`ids` order."""
        import numpy as np

        n = self.ntotal
        if not n:
            return np.zeros((0, self.dim), dtype=np.float32)
        rows: NDArray[np.float32] = self.index.index.reconstruct_n(0, n)
        return rows

    def finalize(self) -> StoreReport:
        return StoreReport("flat", self.ntotal)

    def save(self, path: Path) -> dict[str, Any]:
        import faiss

        faiss.write_index(self.index, str(path))
        return {"kind": "IndexIDMap2(IndexFlatIP)"}

    @classmethod
    def load(cls, path: Path, entry: Mapping[str, Any] | None = None, *, mmap: bool = False) -> FlatStore:
        """Read a saved exact store (``mmap``: rows by id from the file, see the class doc)."""
        if mmap:
            rows = RowFile(path)
            store = cls(rows.dim, path=path)
            store._rows = rows
            return store
        index = read_index(path)
        return cls(int(index.d), index=index)


class _Derived(ABC):
    """Shared part of the search stores built from the exact one: a subclass builds its faiss
    index (:meth:`_build`), names the search settings to try (:meth:`_ladder`) and applies one
    (:meth:`_set_param`); :meth:`finalize` tunes with them."""

    kind = ""
    param = ""  # the search parameter finalize tunes
    #: Whether :meth:`finalize` tunes on pseudo-questions when given them (chosen for HNSW on
    #: measurements; IVF keeps its own-vector target, see TUNE_TARGET).
    tunes_on_questions = False

    def __init__(
        self,
        dim: int,
        *,
        exact: FlatStore | None,
        target: float = RECALL_TARGET,
        tune_target: float = TUNE_TARGET,
        **params: Any,
    ) -> None:
        self.dim = int(dim)
        self.exact = exact
        self.target = target
        self.tune_target = max(target, tune_target)
        self.params: dict[str, Any] = dict(params)
        self.index: Any = None  # the faiss index, Any at faiss's seam
        self.report: StoreReport | None = None

    @property
    def ntotal(self) -> int:
        return 0 if self.index is None else int(self.index.ntotal)

    def vectors(self, ids: ArrayLike) -> NDArray[np.float32]:
        """Exact rows, from the exact store (the search store may hold only codes)."""
        if self.exact is None:
            raise ConfigError(f"the {self.kind} store was loaded without its exact store")
        return self.exact.vectors(ids)

    def ids(self) -> NDArray[np.int64]:
        return self.exact.ids() if self.exact is not None else _as_ids([])

    def add(self, ids: ArrayLike, vectors: ArrayLike) -> None:
        """Vectors reach a search store through its exact store: add them there, then
        :meth:`finalize` (re)builds this one from it."""
        if self.exact is None:
            raise ConfigError(f"the {self.kind} store needs its exact store to add to")
        self.exact.add(ids, vectors)
        self.index = None

    def remove(self, ids: ArrayLike) -> int:
        if self.exact is None:
            raise ConfigError(f"the {self.kind} store needs its exact store to remove from")
        n = self.exact.remove(ids)
        self.index = None
        return n

    @abstractmethod
    def _set_param(self, value: int) -> None:
        """Search with ``value`` of :attr:`param` (efSearch, nprobe) from now on."""

    @abstractmethod
    def _build(self) -> None:
        """(Re)build ``self.index`` from the exact store's vectors."""

    @abstractmethod
    def _ladder(self) -> tuple[int, ...]:
        """Values of :attr:`param` to try, cheapest first."""

    def search(self, queries: ArrayLike, k: int) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
        import numpy as np

        q = _as_rows(queries, self.dim)
        if self.index is None or not self.index.ntotal:
            return (np.full((len(q), k), -np.inf, dtype=np.float32), np.full((len(q), k), -1, dtype=np.int64))
        scores, ids = self.index.search(q, int(k))
        return scores, ids

    def finalize(self, *, questions: ArrayLike | None = None) -> StoreReport:
        """Build the store from the exact one, then tune: the smallest search parameter whose
        recall@10 reaches its target (the largest tried when none does; the builder warns) —
        on ``questions`` (pseudo-questions) to :data:`QUESTION_TUNE_TARGET` if this store
        :attr:`tunes_on_questions`, else on noisy own vectors to ``tune_target``."""
        t = time.perf_counter()
        assert self.exact is not None
        self._build()
        if not self.tunes_on_questions:
            questions = None
        tuned = tune(self._ladder(), self._set_param, self, self.exact, questions, self.tune_target)
        if tuned.params:
            self.params[self.param] = tuned.params["value"]
        self.report = replace(tuned, kind=self.kind, params=dict(self.params), seconds=time.perf_counter() - t)
        return self.report

    def save(self, path: Path) -> dict[str, Any]:
        import faiss

        assert self.index is not None, "finalize() before save()"
        faiss.write_index(self.index, str(path))
        entry = {"kind": self.kind, **self.params}
        if self.report is not None:
            entry.update(
                recall_at_10=self.report.to_dict()["recall_at_10"],
                recall_queries=self.report.queries,
                **self.report.tuning(),
            )
        return entry


class HNSWStore(_Derived):
    """HNSW graph (``IndexIDMap(IndexHNSWFlat)``, inner product): ``M`` links per node,
    ``ef_construction`` at build, ``ef_search`` tuned by :meth:`finalize`. Fast at any size, but
    it keeps its own copy of the vectors plus the graph."""

    kind = "hnsw"
    param = "ef_search"
    tunes_on_questions = True

    def __init__(
        self,
        dim: int,
        *,
        exact: FlatStore | None,
        M: int = HNSW_M,
        ef_construction: int = HNSW_EF_CONSTRUCTION,
        ef_search: int = 128,
        **kw: Any,
    ) -> None:
        super().__init__(
            dim, exact=exact, M=int(M), ef_construction=int(ef_construction), ef_search=int(ef_search), **kw
        )

    def _ladder(self) -> tuple[int, ...]:
        return EF_LADDER

    def _set_param(self, value: int) -> None:
        import faiss

        self.params["ef_search"] = int(value)
        if self.index is not None:
            # downcast_index returns the concrete class, which its stub can only call Index.
            hnsw = cast("faiss.IndexHNSW", faiss.downcast_index(self.index.index))
            hnsw.hnsw.efSearch = int(value)

    def _build(self) -> None:
        import faiss

        assert self.exact is not None
        hnsw = faiss.IndexHNSWFlat(self.dim, self.params["M"], faiss.METRIC_INNER_PRODUCT)
        hnsw.hnsw.efConstruction = self.params["ef_construction"]
        self.index = faiss.IndexIDMap(hnsw)
        if self.exact.ntotal:
            self.index.add_with_ids(self.exact.matrix(), self.exact.ids())
        self._set_param(self.params["ef_search"])

    @classmethod
    def load(cls, path: Path, entry: Mapping[str, Any], *, exact: FlatStore | None = None) -> HNSWStore:
        # Indexes written before stores existed have the same file and entry (M,
        # ef_construction, ef_search), without the recall fields.
        index = read_index(path)
        s = cls(
            int(index.d),
            exact=exact,
            M=entry.get("M", HNSW_M),
            ef_construction=entry.get("ef_construction", HNSW_EF_CONSTRUCTION),
            ef_search=entry.get("ef_search", 128),
        )
        s.index = index
        s._set_param(s.params["ef_search"])
        return s


def _pq_shape(dim: int, n: int) -> tuple[int, int]:
    """``(M, nbits)`` for product quantization: 8-dimensional sub-vectors (48 codes of one byte
    for 384-d), and fewer bits when there are too few vectors to train 256 centroids each."""
    m = next(m for m in range(max(1, dim // 8), dim + 1) if dim % m == 0)
    nbits = max(1, min(8, int(math.log2(max(n, 2))) - 2))
    return m, nbits


def _nlist(n: int) -> int:
    """Inverted lists: about √n (a power of two), each list trained on ≥ 39 points."""
    if n < 2:
        return 1
    return int(max(1, min(2 ** round(math.log2(math.sqrt(n))), n // 39 or 1)))


class IVFStore(_Derived):
    """Inverted file: vectors assigned to ``nlist`` k-means cells, a query scans ``nprobe`` of
    them (tuned by :meth:`finalize`). ``kind="ivf-flat"`` keeps full vectors in the cells.

    ``kind="ivf-pq"`` keeps product-quantized codes (``pq_m`` bytes per vector) to find
    ``rescore × k`` candidates, re-ranks them with an 8-bit scalar-quantized copy of the vectors
    (``IndexRefine``, 1 byte per dimension: a quarter of fp32) down to ``4 × k``, whose exact
    cosines (from the exact store) pick and order the final ``k``. What it keeps in memory is
    about 30% of the fp32 matrix; the exact store stays mapped read-only, touched only for the
    ``4 × k`` rows rescored per query.
    """

    param = "nprobe"

    def __init__(
        self,
        dim: int,
        *,
        exact: FlatStore | None,
        kind: str = "ivf-pq",
        nlist: int | None = None,
        nprobe: int = 16,
        rescore: int = _RESCORE,
        **kw: Any,
    ) -> None:
        if kind not in ("ivf-flat", "ivf-pq"):
            raise ConfigError(f"IVF kind must be 'ivf-flat' or 'ivf-pq', got {kind!r}")
        params: dict[str, Any] = {"nlist": nlist, "nprobe": int(nprobe)}
        if kind == "ivf-pq":
            params["rescore"] = int(rescore)
        super().__init__(dim, exact=exact, **params, **kw)
        self.kind = kind
        self._ivf: Any = None  # the IndexIVF inside (nprobe is set there)

    def _ladder(self) -> tuple[int, ...]:
        nlist = int(self.params["nlist"] or 1)
        return tuple(p for p in _NPROBE_LADDER if p < nlist) + (nlist,)

    def _set_param(self, value: int) -> None:
        self.params["nprobe"] = int(value)
        if self._ivf is not None:
            self._ivf.nprobe = int(value)

    def _attach(self, index: Any) -> None:  # Any: a faiss index, at faiss's seam
        """Find the IVF (and the refine stage) inside a built or loaded index."""
        import faiss

        self.index = index
        if self.kind == "ivf-pq":
            # downcast_index returns the concrete class, which its stub can only call Index.
            refine = cast("faiss.IndexRefine", faiss.downcast_index(index.index))
            refine.k_factor = float(self.params["rescore"]) / _EXACT_TOP  # of the 4k it returns
            self._refine = refine
            self._ivf = faiss.downcast_index(refine.base_index)
        else:
            self._ivf = index

    def _build(self) -> None:
        import faiss
        import numpy as np

        assert self.exact is not None
        n = self.exact.ntotal
        nlist = int(self.params.get("nlist") or _nlist(n))
        self.params["nlist"] = nlist
        quantizer = faiss.IndexFlatIP(self.dim)
        index: faiss.Index
        if self.kind == "ivf-flat":
            index = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
            self._parts: tuple[Any, ...] = (quantizer,)
        else:
            m, nbits = _pq_shape(self.dim, n)
            self.params.update(pq_m=m, pq_nbits=nbits, refine="SQ8")
            ivf = faiss.IndexIVFPQ(quantizer, self.dim, nlist, m, nbits, faiss.METRIC_INNER_PRODUCT)
            # 64 points per PQ centroid and 15 k-means rounds: the codes only pick the
            # candidates (the refine stage orders them), and PQ training was 3/4 of the build.
            ivf.pq.cp.max_points_per_centroid = 64
            ivf.pq.cp.niter = 15
            ivf.cp.seed = 1234
            sq = faiss.IndexScalarQuantizer(self.dim, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
            refine = faiss.IndexRefine(ivf, sq)
            index = faiss.IndexIDMap(refine)
            self._parts = (quantizer, ivf, sq, refine)  # python owns these until written
        if hasattr(index, "cp"):
            index.cp.seed = 1234
        self._attach(index)
        if not n:
            return
        x, ids = self.exact.matrix(), self.exact.ids()
        # Training on a sample: k-means cost grows with it, and 64 points per cell (and 256 per
        # PQ centroid) are plenty; a fixed seed keeps builds reproducible.
        want = max(64 * nlist, 256 * 64 if self.kind == "ivf-pq" else 0)
        if n > want:
            sample = x[np.sort(np.random.default_rng(0).choice(n, want, replace=False))]
        else:
            sample = x
        need = max(nlist, 2 ** int(self.params.get("pq_nbits", 0)))
        if len(sample) < need:  # a handful of vectors: repeat them so k-means can run
            sample = np.tile(sample, (-(-need // len(sample)), 1))
        index.train(sample)
        index.add_with_ids(x, ids)
        self._set_param(min(int(self.params["nprobe"]), nlist))

    def search(self, queries: ArrayLike, k: int) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
        if self.kind != "ivf-pq" or self.exact is None or self.index is None:
            return super().search(queries, k)
        import numpy as np

        # The refine stage (SQ8) keeps _EXACT_TOP × k; their exact cosines pick and order the
        # final k (a few rows of the mapped exact store per query).
        q = _as_rows(queries, self.dim)
        _, cand = super().search(q, _EXACT_TOP * k)
        scores = np.full((len(q), k), -np.inf, dtype=np.float32)
        ids = np.full((len(q), k), -1, dtype=np.int64)
        for r in range(len(q)):
            c = cand[r][cand[r] >= 0]
            if len(c):
                exact = self.exact.vectors(c) @ q[r]
                top = np.argsort(-exact, kind="stable")[:k]
                scores[r, : len(top)], ids[r, : len(top)] = exact[top], c[top]
        return scores, ids

    @classmethod
    def load(cls, path: Path, entry: Mapping[str, Any], *, exact: FlatStore | None = None) -> IVFStore:
        index = read_index(path)  # read_index gives the concrete classes back
        s = cls(
            int(index.d),
            exact=exact,
            kind=entry["kind"],
            nlist=entry.get("nlist"),
            nprobe=entry.get("nprobe", 16),
            rescore=entry.get("rescore", _RESCORE),
        )
        for key in ("pq_m", "pq_nbits", "refine"):
            if key in entry:
                s.params[key] = entry[key]
        s._attach(index)
        s._set_param(s.params["nprobe"])
        return s


#: Names a ``ragbudget.stores`` entry point may take: they also name the store's file
#: (``<name>.<generation>.index``), which a writer's clean-up must recognise.
_STORE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


@functools.lru_cache(maxsize=1)
def _entry_points() -> dict[str, EntryPoint]:
    """The ``ragbudget.stores`` entry points by name (read once per process: listing the
    installed distributions costs milliseconds, and nothing asks before a build or a load)."""
    from importlib.metadata import entry_points

    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=STORES_GROUP):
        if ep.name in STORES or not _STORE_NAME.match(ep.name):
            # A built-in name keeps its meaning; an odd one could not name a file safely.
            log.warning(
                "ignoring the %s entry point %r (%s): that name is taken or not allowed",
                STORES_GROUP,
                ep.name,
                ep.value,
            )
            continue
        found.setdefault(ep.name, ep)
    return found


def store_names() -> tuple[str, ...]:
    """Every name ``store=`` accepts: :data:`STORES`, then the stores other packages register
    in the ``ragbudget.stores`` entry point group (:data:`STORES_GROUP`), sorted.

    >>> store_names()[:6]
    ('auto', 'flat', 'hnsw', 'ivf', 'ivf-flat', 'ivf-pq')
    """
    return STORES + tuple(sorted(_entry_points()))


def is_installed_store(kind: str) -> bool:
    """Whether ``kind`` is a store another package registers (a ``ragbudget.stores`` entry point,
    not one of :data:`STORES`): a storage that searches its own rows (a database) still holds
    such a store, as the bytes its ``save`` writes.

    >>> is_installed_store("hnsw")
    False
    """
    return kind not in STORES and kind in _entry_points()


def _plugin(kind: str) -> StoreClass | None:
    """The class a ``ragbudget.stores`` entry point names, loaded (``None``: no such entry point)."""
    ep = _entry_points().get(kind)
    if ep is None:
        return None
    try:
        cls: StoreClass = ep.load()
    except Exception as exc:  # noqa: BLE001 - an installed package's import may fail any way
        raise ConfigError(
            f"the vector store {kind!r} ({STORES_GROUP} entry point {ep.value}) could not be loaded: "
            f"{type(exc).__name__}: {exc}; reinstall the package that provides it"
        ) from exc
    return cls


def make_store(kind: str, dim: int, *, exact: FlatStore | None = None, **params: Any) -> VectorStore:
    """A new, empty store of ``kind`` (``flat``, ``hnsw``, ``ivf`` = ``ivf-pq``, ``ivf-flat``, or
    a ``ragbudget.stores`` entry point's name); search stores are built from ``exact`` by
    :meth:`~VectorStore.finalize`."""
    if kind == "flat":
        return FlatStore(dim)
    if kind == "hnsw":
        return HNSWStore(dim, exact=exact, **params)
    if kind in ("ivf", "ivf-pq", "ivf-flat"):
        return IVFStore(dim, exact=exact, kind="ivf-pq" if kind == "ivf" else kind, **params)
    cls = _plugin(kind)
    if cls is None:
        raise ConfigError(f"store must be one of {', '.join(store_names())}; got {kind!r}")
    store = cls(dim, exact=exact, **params)
    if store.kind != kind:  # the name the manifest records is how load_store finds the class again
        raise ConfigError(f"the vector store registered as {kind!r} calls itself {store.kind!r}; they must agree")
    return store


def load_store(path: Path, entry: Mapping[str, Any], *, exact: FlatStore | None = None) -> VectorStore:
    """Read a search store back from its file and manifest entry."""
    kind = str(entry.get("kind"))
    if kind == "hnsw":
        return HNSWStore.load(path, entry, exact=exact)
    if kind in ("ivf-flat", "ivf-pq"):
        return IVFStore.load(path, entry, exact=exact)
    cls = _plugin(kind)
    if cls is None:
        raise IndexCorruptError(
            f"the manifest names a vector store {kind!r} that no installed package provides; install the "
            f"one that registers it ({STORES_GROUP} entry point), upgrade ragbudget, or search the exact "
            "store (use_approx=False)"
        )
    return cls.load(path, entry, exact=exact)


def choose_store(store: str, n: int, dim: int) -> str:
    """The store kind that ``store=`` means for ``n`` vectors of ``dim`` (``auto``'s rule; an
    entry point's store is itself).

    >>> choose_store("auto", 20_000, 384), choose_store("auto", 100_000, 384)
    ('flat', 'hnsw')
    >>> choose_store("auto", 1_000_000, 384), choose_store("ivf", 10, 384)
    ('ivf-pq', 'ivf-pq')
    """
    if store not in STORES and store not in _entry_points():
        raise ConfigError(f"store must be one of {', '.join(store_names())}; got {store!r}")
    if store == "ivf":
        return "ivf-pq"
    if store != "auto":
        return store
    size = n * dim * 4
    if size <= FLAT_MAX_BYTES:
        return "flat"
    return "hnsw" if size <= HNSW_MAX_BYTES else "ivf-pq"
