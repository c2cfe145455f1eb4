"""A question's evidence for each sentence: what span packing (:mod:`ragbudget.packing.spans`)
ranks sentences by.

* **lexical**: :func:`bm25` over the pool's sentences, on :func:`content_terms` (stop words out,
  a crude stem), so a sentence with the question's rare words ranks high;
* **dense**: :class:`SpanScorer`, the cosine of each sentence to the question with the index's
  embedder, vectors cached by content hash (in memory, then a persistent :class:`VectorCache`
  beside the index; an index's stored sentence vectors are read first).

Moved out of :mod:`ragbudget.packing.spans` (which resolves these names too) so that the packing
module holds the packing: how sentences are scored is one seam, how they are packed another.
"""

from __future__ import annotations

import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from ..errors import ConfigError
from ..types import QUESTION_STOPWORDS
from .sentences import sentence_digest

if TYPE_CHECKING:  # numpy is imported where vectors are handled, not with the module
    import numpy as np
    import numpy.typing as npt

    Vector = npt.NDArray[np.float32]

__all__ = ["SentenceEmbedder", "SpanScorer", "VectorCache", "bm25", "content_terms"]

_WORD = re.compile(r"\w+")
# Question words that say nothing about where the answer is (as select's _QSTOP, plus a few).
_STOP = QUESTION_STOPWORDS | {"he", "her", "his", "our", "she", "we"}


def _stem(word: str) -> str:
    # A crude stemmer: plural and -ed/-ing endings off, then a 6-character prefix (as select's
    # oversize-chunk cut), so "supplies"/"supply", "boats"/"boat", "founded"/"founding" meet.
    if len(word) > 4:
        if word.endswith("ies"):
            word = word[:-3] + "y"
        elif word.endswith("s") and not word.endswith(("ss", "us", "is")):
            word = word[:-1]
        elif word.endswith("ing") and len(word) > 5:
            word = word[:-3]
        elif word.endswith("ed") and len(word) > 5:
            word = word[:-2]
    return word[:6]


def content_terms(text: str) -> list[str]:
    """``text``'s content words, stemmed as span packing compares them (stop words and short
    words out, digits kept).

    >>> content_terms("The boats were founded in 1932")
    ['boat', 'found', '1932']
    """
    return [_stem(w) for w in _WORD.findall(text.lower()) if w not in _STOP and (len(w) > 2 or w.isdigit())]


def bm25(question: str, docs: Sequence[str], *, k1: float = 1.2, b: float = 0.75) -> list[float]:
    """Okapi BM25 of ``question`` against each of ``docs``, the docs themselves the collection
    (so a word in every sentence of the pool weighs almost nothing).

    >>> [round(x, 3) for x in bm25("capital of France", ["Paris is the capital.", "Lyon is big."])]
    [0.693, 0.0]
    """
    q = set(content_terms(question))
    terms = [content_terms(d) for d in docs]
    if not q or not docs:
        return [0.0] * len(docs)
    n = len(docs)
    avg = max(1e-9, sum(len(t) for t in terms) / n)
    df = {w: sum(1 for t in terms if w in t) for w in q}
    idf = {w: math.log(1.0 + (n - d + 0.5) / (d + 0.5)) for w, d in df.items()}
    out = []
    for t in terms:
        s = 0.0
        for w in q:
            tf = t.count(w)
            if tf:
                s += idf[w] * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(t) / avg))
        out.append(s)
    return out


class SentenceEmbedder(Protocol):
    """What :class:`SpanScorer` asks of an embedder: any
    :class:`~ragbudget.retrieval.embed.Embedder` (retrieval sits above this package, so the two
    methods are spelled out here). Vectors are unit length."""

    def embed_query(self, text: str) -> Vector: ...

    def embed_documents(self, texts: Sequence[str]) -> Vector: ...


class VectorCache(Protocol):
    """Sentence vectors kept across processes, by :func:`sentence_digest`: a
    :class:`~ragbudget.retrieval.sentence_cache.SentenceCache`."""

    def get(self, digests: Sequence[bytes]) -> Mapping[bytes, Vector]: ...

    def put(self, vectors: Mapping[bytes, Vector]) -> object: ...


class SpanScorer:
    """Dense evidence for sentences: cosine to the question with ``embedder`` (any
    :class:`~ragbudget.retrieval.embed.Embedder`), the sentences embedded in one batch per question and
    their vectors kept by content hash (up to ``cache_size``), so a chunk seen by an earlier
    question costs nothing again. Thread-safe.

    ``stored`` (e.g. :meth:`ragbudget.retrieval.index.Index.sentence_vectors`, which an index built with
    ``sentence_vectors=True`` holds for every chunk) maps chunk ids to ``(digests, vectors)`` —
    each sentence's :func:`sentence_digest` and its vector, embedded at build time with the same
    embedder — and is asked first (:meth:`preload`): a sentence found there is never embedded at
    question time. It must come from the same embedder as ``embedder`` (the caller's check: the
    pipeline passes the index's own). A chunk it does not know (an index built without them, the
    default) falls back to embedding on first use, through ``persist`` when given (the
    :class:`~ragbudget.retrieval.sentence_cache.SentenceCache` beside the index: a sentence any earlier
    question embedded, in any process, is read from there).

    >>> from ragbudget.retrieval.embed import HashEmbedder
    >>> s = SpanScorer(HashEmbedder())
    >>> sims = s.similarities("where is Paris", ["Paris is in France.", "Bread is baked."])
    >>> len(sims), s.cached, s.embedded
    (2, 3, 2)
    """

    def __init__(
        self,
        embedder: SentenceEmbedder | None,
        *,
        cache_size: int = 50_000,
        stored: Callable[[list[int]], Mapping[int, tuple[Sequence[bytes], npt.ArrayLike]]] | None = None,
        persist: VectorCache | None = None,
    ) -> None:
        if embedder is None:
            raise ConfigError("SpanScorer needs an embedder (e.g. the index's own: Index.embedder)")
        self.embedder: SentenceEmbedder = embedder
        self.cache_size = int(cache_size)
        self.stored = stored
        #: Vectors kept across processes (a :class:`~ragbudget.retrieval.sentence_cache.SentenceCache`:
        #: ``get(digests)`` and ``put({digest: vector})``): asked before a sentence is embedded,
        #: given every sentence embedded.
        self.persist = persist
        #: Sentences sent to the embedder so far (questions not counted): 0 when every sentence
        #: came from ``stored`` or a cache.
        self.embedded = 0
        #: Sentences found in ``persist`` instead of being embedded.
        self.persisted = 0
        self._cache: OrderedDict[bytes, Vector] = OrderedDict()
        # Chunk ids already asked of ``stored`` (cleared when the cache evicts: their vectors may
        # be gone, so they are asked again rather than embedded).
        self._asked: set[int] = set()
        self._lock = threading.Lock()

    @property
    def cached(self) -> int:
        """Vectors held."""
        return len(self._cache)

    def preload(self, chunk_ids: Iterable[int | str]) -> int:
        """Take the sentence vectors of ``chunk_ids`` from ``stored`` into the cache (one lookup
        per chunk per scorer); returns how many vectors came in. No ``stored``: nothing. Stored
        vectors are an index's, by its integer row ids: a caller's own (string) ids are never
        asked."""
        import numpy as np

        if self.stored is None:
            return 0
        with self._lock:
            ids = [i for i in dict.fromkeys(chunk_ids) if isinstance(i, int) and i not in self._asked]
        if not ids:
            return 0
        got = self.stored(ids)
        n = 0
        with self._lock:
            self._asked.update(ids)
            for digests, vectors in got.values():
                mat = np.asarray(vectors, dtype=np.float32)
                for d, v in zip(digests, mat, strict=True):
                    key = b"d" + bytes(d)
                    if key not in self._cache:
                        self._cache[key] = v
                        n += 1
            self._evict()
        return n

    def _evict(self) -> None:
        if len(self._cache) > self.cache_size:
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self._asked.clear()

    def remember_query(self, question: str, vector: npt.ArrayLike) -> None:
        """Keep ``question``'s vector, embedded by the caller with the same embedder (the search's
        query vector), so :meth:`similarities` does not embed the question again."""
        import numpy as np

        key = b"q" + sentence_digest(question)
        with self._lock:
            self._cache[key] = np.asarray(vector, dtype=np.float32).reshape(-1)
            self._cache.move_to_end(key)  # the newest entry: the last one eviction reaches
            self._evict()

    def similarities(self, question: str, texts: Sequence[str]) -> list[float]:
        """Cosine of each of ``texts`` to ``question`` (vectors are unit length)."""
        import numpy as np

        keys = [b"q" + sentence_digest(question)] + [b"d" + sentence_digest(t) for t in texts]
        with self._lock:
            have = {k: self._cache[k] for k in keys if k in self._cache}
        todo = [i for i, k in enumerate(keys) if k not in have]
        if todo:
            qi = [i for i in todo if i == 0]
            di = list(dict.fromkeys(i for i in todo if i > 0 and keys[i] not in have))
            if qi:
                have[keys[0]] = np.asarray(self.embedder.embed_query(question), dtype=np.float32)
            # One text per digest: a sentence repeated in the pool is embedded once.
            first: dict[bytes, int] = {}
            for i in di:
                first.setdefault(keys[i], i)
            if first and self.persist is not None:
                # Embedded by an earlier question, maybe in another process: taken from there.
                found = self.persist.get([k[1:] for k in first])
                for k in [k for k in first if k[1:] in found]:
                    have[k] = found[k[1:]]
                    del first[k]
                self.persisted += len(found)
            if first:
                # Documents, not queries: the same side of the embedder the index's chunks used.
                vecs = self.embedder.embed_documents([texts[i - 1] for i in first.values()])
                self.embedded += len(first)
                for k, v in zip(first, vecs, strict=True):
                    # Rounded as an index and the cache keep them (float16), so a question scores
                    # the same whether its sentences were just embedded, cached or stored.
                    have[k] = np.asarray(v, dtype=np.float16).astype(np.float32)
                if self.persist is not None:
                    self.persist.put({k[1:]: have[k] for k in first})
            with self._lock:
                for i in todo:
                    self._cache[keys[i]] = have[keys[i]]
                self._evict()
        qv = have[keys[0]]
        return [float(np.dot(qv, have[k])) for k in keys[1:]]
