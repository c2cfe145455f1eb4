"""Embedders: text → unit-length float32 vectors, with no text silently dropped.

A 300–500 token chunk is longer than all-MiniLM-L6-v2's 256 word-piece window, and
sentence-transformers would quietly truncate its tail. :class:`Embedder` therefore splits an
over-long text by the embedding model's *own* tokenizer into windows that fit, embeds every window,
and pools them (mean of the unit window vectors weighted by window length, re-normalized), so a fact
that only appears at the end of a chunk still moves its vector. ``pooling="truncate"`` keeps the
plain behaviour, for comparison.

Two implementations:

* :class:`SentenceTransformerEmbedder` — any sentence-transformers model (default: the packaged
  all-MiniLM-L6-v2), loaded lazily on first use or by :meth:`~Embedder.warm_up`; for a plain BERT
  model with mean pooling (the packaged one) it can run on ONNX Runtime instead of torch
  (``backend="onnx"``: the same vectors to 1e-6; ``"onnx-int8"``: int8 weights, other vectors,
  another embedder identity), exported once from the local model files into a cache folder
  (:mod:`ragbudget.retrieval.onnx`); a query runs on numpy without torch
  (:class:`~ragbudget.retrieval.encoders.LightBert`);
* :class:`HashEmbedder` — a deterministic, model-free bag-of-words hasher for tests (like
  Haystack's mock embedders): texts sharing words get similar vectors.

>>> e = HashEmbedder(dim=64)
>>> v = e.embed_documents(["the cat sat", "a dog ran"])
>>> v.shape, v.dtype.name
((2, 64), 'float32')
"""

from __future__ import annotations

import abc
import hashlib
import itertools
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ModelError, RagBudgetError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import numpy as np

    from .encoders import LightBert, TorchBert
    from .onnx import OnnxBert

__all__ = [
    "BACKENDS",
    "EmbedResult",
    "Embedder",
    "HashEmbedder",
    "SentenceTransformerEmbedder",
    "cuda_visible",
    "embedder_from_spec",
    "embedder_identity",
    "make_embedder",
    "split_backend",
]

_POOLINGS = ("windows", "truncate")
#: How :class:`SentenceTransformerEmbedder` runs its model. ``auto`` picks the CPU default.
BACKENDS = ("auto", "torch", "onnx", "onnx-int8")


@dataclass(frozen=True)
class EmbedResult:
    """Vectors for a list of texts plus how many windows each text needed.

    ``vectors`` is ``(n, dim)`` float32 with unit rows; ``windows[i]`` is 1 for a text that fit the
    model's window (or was truncated), more for a text embedded window by window and pooled.
    ``texts_fed`` is exactly what was handed to the model (the window texts), for benchmarks.
    ``spans``: with :meth:`Embedder.embed`'s ``spans=`` on an embedder that pools them, per text
    one unit float32 row per span, pooled from the same forward pass; ``None`` otherwise.
    """

    vectors: np.ndarray
    windows: tuple[int, ...]
    texts_fed: int = 0
    spans: tuple[np.ndarray, ...] | None = None

    @property
    def pooled(self) -> int:
        """How many texts needed more than one window."""
        return sum(1 for w in self.windows if w > 1)


class Embedder(abc.ABC):
    """Base class: windowing and pooling over two model-specific primitives.

    Subclasses set ``id``, ``dim``, ``max_tokens`` (content tokens per window, special tokens
    excluded) and implement :meth:`_token_spans` (character spans of the model's tokens) and
    :meth:`_encode` (one vector per text, each text already within ``max_tokens``). One that can
    also hand back its tokens' final states implements :meth:`_encode_tokens` and says so in
    :attr:`pools_spans`; :meth:`embed` then pools span vectors from the same pass.
    """

    id: str = "embedder"
    pooling: str = "windows"
    #: Tokens shared by consecutive windows so a sentence cut at a boundary is seen whole once.
    window_overlap: int = 16

    # -- to implement -------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def dim(self) -> int:
        """Vector dimension."""

    @property
    @abc.abstractmethod
    def max_tokens(self) -> int:
        """Content tokens per window (special tokens excluded)."""

    @abc.abstractmethod
    def _token_spans(self, texts: Sequence[str]) -> list[list[tuple[int, int]]]:
        """Character spans of the model's tokens, per text."""

    @abc.abstractmethod
    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        """One unit vector per text, each text already within ``max_tokens``."""

    @property
    def pools_spans(self) -> bool:
        """Whether :meth:`embed` pools ``spans=`` from the token states of its own forward pass
        (:meth:`_encode_tokens`); ``False``: the caller embeds span texts itself."""
        return False

    def _encode_tokens(self, texts: Sequence[str]) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        """:meth:`_encode`'s vectors, and per text its content tokens' character offsets ``(T, 2)``
        (in the text as given, sorted, not overlapping) and final states ``(T, dim)``, pooled
        (mean, then unit length) as the model pools a whole text. Only called when
        :attr:`pools_spans`."""
        raise NotImplementedError(f"{type(self).__name__} does not pool spans")

    # -- public -------------------------------------------------------------------------------
    def warm_up(self) -> None:  # noqa: B027 - an optional hook: model-free embedders load nothing
        """Load the model now (idempotent). Embedding calls do it on first use anyway."""

    def spec(self) -> dict[str, Any]:
        """JSON-able description stored in the index manifest (and used to rebuild the embedder)."""
        return {"kind": "custom", "id": self.id, "dim": self.dim, "pooling": self.pooling}

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        """Unit float32 vectors, one row per text, every token of every text taken into account."""
        return self.embed(texts).vectors

    def embed_query(self, text: str) -> np.ndarray:
        """One unit float32 vector of shape ``(dim,)``."""
        row: np.ndarray = self.embed([text]).vectors[0]  # numpy types a row of an ndarray as Any
        return row

    def window_bounds(self, texts: Sequence[str]) -> list[list[tuple[int, int]]]:
        """The character ranges of the windows each text is embedded as (``[(0, len(text))]``
        when it fits the model)."""
        spans_list = self._token_spans(texts) if self.pooling == "windows" else [[] for _ in texts]
        out: list[list[tuple[int, int]]] = []
        size = self.max_tokens
        # The step keeps an overlap, but never less than half a window of progress.
        step = max(size - self.window_overlap, max(1, size // 2))
        for text, spans in zip(texts, spans_list, strict=True):
            if len(spans) <= size:
                out.append([(0, len(text))])
                continue
            wins = []
            i = 0
            while True:
                j = min(i + size, len(spans))
                wins.append((spans[i][0], spans[j - 1][1]))
                if j >= len(spans):
                    break
                i += step
            out.append(wins)
        return out

    def windows_of(self, texts: Sequence[str]) -> list[list[str]]:
        """The window texts each text is embedded as (one window when it fits the model)."""
        return [[t[a:b] for a, b in bs] for t, bs in zip(texts, self.window_bounds(texts), strict=True)]

    def embed(self, texts: Sequence[str], *, spans: Sequence[Sequence[tuple[int, int]]] | None = None) -> EmbedResult:
        """Embed ``texts``; see :class:`EmbedResult`. All windows go to the model in one call, so
        its own length-sorted batching applies across texts.

        ``spans`` (per text, ``(start, end)`` character ranges, e.g. its sentences): on an
        embedder that :attr:`pools_spans`, each span's vector is pooled from the same forward
        pass — the mean of the final states of the tokens inside it, made unit length, as the
        model pools a whole text ("late chunking") — and returned in ``EmbedResult.spans``; a
        token in two overlapping windows is taken from the window that holds it furthest from
        an edge (the first one up to the middle of the overlap). A span with no token of its own
        (nothing the tokenizer keeps) is embedded as a text. Other embedders return
        ``spans=None``: the caller embeds span texts itself."""
        import numpy as np

        texts = list(texts)
        if spans is not None and len(spans) != len(texts):
            raise ValueError(f"spans: one list per text, got {len(spans)} for {len(texts)} texts")
        pool = spans is not None and self.pools_spans
        if not texts:
            return EmbedResult(np.zeros((0, self.dim), dtype=np.float32), (), spans=() if pool else None)
        bounds = self.window_bounds(texts)
        flat = [t[a:b] for t, bs in zip(texts, bounds, strict=True) for a, b in bs]
        states: list[tuple[np.ndarray, np.ndarray]] = []
        if pool:
            raw, states = self._encode_tokens(flat)
        else:
            raw = self._encode(flat)
        vecs = _normalize(np.asarray(raw, dtype=np.float32))
        span_vecs = self._pool_spans(texts, bounds, states, spans) if pool and spans is not None else None
        if len(flat) == len(texts):
            return EmbedResult(vecs, tuple(1 for _ in texts), len(flat), span_vecs)
        out = np.empty((len(texts), vecs.shape[1]), dtype=np.float32)
        pos = 0
        for i, bs in enumerate(bounds):
            if len(bs) == 1:
                out[i] = vecs[pos]
            else:
                # Weight by window length in characters: the short last window of a chunk should
                # not count as much as a full one (characters track tokens closely enough here).
                w = np.array([b - a for a, b in bs], dtype=np.float32)
                out[i] = (vecs[pos : pos + len(bs)] * w[:, None]).sum(axis=0)
            pos += len(bs)
        return EmbedResult(_normalize(out), tuple(len(bs) for bs in bounds), len(flat), span_vecs)

    def _pool_spans(
        self,
        texts: list[str],
        bounds: list[list[tuple[int, int]]],
        states: list[tuple[np.ndarray, np.ndarray]],
        spans: Sequence[Sequence[tuple[int, int]]],
    ) -> tuple[np.ndarray, ...]:
        """Per text, one unit vector per span: the mean of its tokens' states (see :meth:`embed`)."""
        import numpy as np

        out: list[np.ndarray] = []
        missing: list[tuple[int, int, str]] = []  # (text, span, span text) without a token
        pos = 0
        for i, bs in enumerate(bounds):
            offs, sts = [], []
            for k, (a, _) in enumerate(bs):
                o, h = states[pos + k]
                start = o[:, 0] + a
                # Overlapping windows: each keeps its tokens up to the middle of the overlap with
                # the next, so every token counts once, with the more context of the two.
                lo = (bs[k - 1][1] + a) / 2 if k > 0 else -1.0
                hi = (bs[k + 1][0] + bs[k][1]) / 2 if k + 1 < len(bs) else float("inf")
                keep = (start >= lo) & (start < hi)
                offs.append(o[keep] + a)
                sts.append(h[keep])
            pos += len(bs)
            dim = self.dim
            off = np.concatenate(offs) if offs else np.zeros((0, 2), dtype=np.int64)
            st = np.concatenate(sts).astype(np.float64) if sts else np.zeros((0, dim))
            # Prefix sums over the tokens: each span's sum is one subtraction.
            csum = np.zeros((len(st) + 1, st.shape[1] if st.ndim == 2 else dim))
            np.cumsum(st, axis=0, out=csum[1:])
            rows = np.zeros((len(spans[i]), csum.shape[1]), dtype=np.float64)
            for j, (s, e) in enumerate(spans[i]):
                # Tokens overlapping [s, e): ends after s, starts before e (both sorted).
                first = int(np.searchsorted(off[:, 1], s, side="right"))
                last = int(np.searchsorted(off[:, 0], e, side="left"))
                if last > first:
                    rows[j] = (csum[last] - csum[first]) / (last - first)
                else:
                    missing.append((i, j, texts[i][s:e]))
            out.append(rows)
        if missing:
            vecs = _normalize(np.asarray(self._encode([t for _, _, t in missing]), dtype=np.float32))
            for (i, j, _), v in zip(missing, vecs, strict=True):
                out[i][j] = v
        return tuple(_normalize(r.astype(np.float32)) if len(r) else r.astype(np.float32) for r in out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, pooling={self.pooling!r})"


def _normalize(x: np.ndarray) -> np.ndarray:
    import numpy as np

    norms = np.linalg.norm(x, axis=1, keepdims=True)
    # An all-zero vector (empty text in HashEmbedder) stays zero rather than becoming NaN.
    return (x / np.where(norms == 0, 1.0, norms)).astype(np.float32, copy=False)


class SentenceTransformerEmbedder(Embedder):
    """A sentence-transformers model (default: packaged all-MiniLM-L6-v2), loaded on first use.

    ``model`` is ``None``/``"default"`` (the packaged MiniLM), a hub id or a local folder;
    ``device`` defaults to CPU unless CUDA is available; ``pooling`` is ``"windows"`` (embed every
    window of an over-long text and pool) or ``"truncate"`` (the model's own truncation).

    ``backend`` (one of :data:`BACKENDS`) says what runs the model: ``"torch"`` (sentence-
    transformers), ``"onnx"`` (ONNX Runtime on a float32 export: the same vectors as torch to
    ~1e-7, so it reads and extends an index built with torch), ``"onnx-int8"`` (int8 dynamic
    quantization of that export: faster on CPU, slightly different vectors, so its ``id`` gets a
    ``+int8`` suffix and an index built with torch is rebuilt rather than mixed), or ``"auto"``:
    the CPU default (see :data:`AUTO_CPU_BACKEND`) when ``onnxruntime`` is installed, the model
    has the layout the export covers and no CUDA device is visible, else ``"torch"``. The ONNX
    backends need ``pip install ragbudget[onnx]``; the export (torch, once per model) goes to
    ``~/.cache/ragbudget/onnx/<digest of the model files>/`` (``RAGBUDGET_CACHE`` moves it).

    >>> e = SentenceTransformerEmbedder()          # doctest: +SKIP
    >>> e.embed_query("where is the cat?").shape   # doctest: +SKIP
    (384,)
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        device: str | None = None,
        batch_size: int = 32,
        pooling: str = "windows",
        window_overlap: int = 16,
        light: bool = True,
        backend: str = "auto",
    ) -> None:
        if pooling not in _POOLINGS:
            raise ConfigError(f"pooling must be one of {_POOLINGS}, got {pooling!r}")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.model_name = model
        self.device = device
        self.batch_size = batch_size
        self.pooling = pooling
        self.window_overlap = window_overlap
        self.light = light
        self._model: Any = None
        self._layout: LightBert | None | bool = None  # False: read, not a covered layout
        self._onnx: OnnxBert | None = None
        self._torch: TorchBert | None = None  # the torch runner over the loaded model (covered layouts)
        self.backend = self._choose_backend(backend)
        # int8 vectors are other vectors: a different id keeps them out of a float index (the
        # builder compares ids and rebuilds instead of mixing); float32 ONNX keeps the torch id.
        self.id = _model_id(model) + ("+int8" if self.backend == "onnx-int8" else "")

    def _choose_backend(self, backend: str) -> str:
        if backend in ("onnx", "onnx-int8"):
            if self.device is not None and self.device != "cpu":
                raise ConfigError(
                    f"backend {backend!r} runs on the CPU; got device={self.device!r} (use backend='torch' for a GPU)"
                )
            if not _onnx_available():
                raise ConfigError(
                    f"backend {backend!r} needs onnxruntime and onnx: "
                    "pip install 'ragbudget[onnx]' (or use backend='torch')"
                )
            if self._onnx_layout() is None:
                raise ConfigError(
                    f"backend {backend!r} covers local BERT models with mean pooling "
                    f"(like the packaged MiniLM); {self.model_name!r} is not one: "
                    "use backend='torch'"
                )
            return backend
        if backend == "torch":
            return backend
        # auto: ONNX only where it is known to hold (CPU, the covered layout, the runtime there).
        if (
            self.device in (None, "cpu")
            and not cuda_visible()
            and _onnx_available()
            and self._onnx_layout() is not None
        ):
            return AUTO_CPU_BACKEND
        if self.device in (None, "cpu") and not _onnx_available() and self._onnx_layout() is not None:
            log.info("embedding with torch: pip install 'ragbudget[onnx]' for the faster ONNX Runtime backend")
        return "torch"

    def _onnx_layout(self) -> LightBert | None:
        """The config/tokenizer reader of a model the ONNX export covers (``None``: not one);
        read once, whatever ``light`` says (that only turns the numpy query path off)."""
        if self._layout is None:
            self._layout = _open_light(self.model_name) or False
        return None if isinstance(self._layout, bool) else self._layout

    def _lite(self) -> LightBert | None:
        """The model read without torch (:class:`~ragbudget.retrieval.encoders.LightBert`) while the
        full one is not loaded; ``None`` for a layout it does not cover, or with ``light=False``."""
        if self._model is not None or not self.light:
            return None
        return self._onnx_layout()

    def warm_up(self) -> None:
        if self.backend != "torch":
            if self._onnx is None:
                layout = self._onnx_layout()
                assert layout is not None  # checked when the backend was chosen
                from .onnx import OnnxBert

                self._onnx = OnnxBert.load(layout, quantized=self.backend == "onnx-int8", max_rows=self.batch_size)
            return
        if self._model is not None:
            return
        from ..memory.models import resolve_embedder

        path = resolve_embedder(self.model_name)
        try:
            from sentence_transformers import SentenceTransformer

            device = self.device
            if device is None:
                import torch

                device = "cuda" if torch.cuda.is_available() else "cpu"
            self._model = SentenceTransformer(path, device=device)
        except Exception as exc:
            raise ModelError(
                f"could not load embedding model {self.id!r} from {path!r}: {exc}; pass a "
                "sentence-transformers model id or local folder (offline: a local folder)"
            ) from exc

    @property
    def loaded(self) -> bool:
        """Whether a model is loaded: the ``SentenceTransformer`` (torch) or the ONNX Runtime
        session. False until the first documents are embedded or :meth:`warm_up`: reading
        ``dim``, ``max_tokens`` or ``spec()``, and embedding queries by the light path, load
        nothing."""
        return self._model is not None or self._onnx is not None

    @property
    def model(self) -> Any:
        """The loaded ``SentenceTransformer`` (loads it on first access; the torch backend)."""
        if self._model is None:
            if self.backend != "torch":
                raise ConfigError(
                    f"this embedder runs on {self.backend!r}: it has no "
                    "sentence-transformers model (construct it with backend='torch')"
                )
            self.warm_up()
        return self._model

    @property
    def dim(self) -> int:
        lite = self._lite() or (self._onnx_layout() if self.backend != "torch" else None)
        if lite is not None:  # from the config files: no model load for an index's manifest
            return lite.dim
        m = self.model
        get = getattr(m, "get_embedding_dimension", None) or m.get_sentence_embedding_dimension
        return int(get())

    @property
    def max_tokens(self) -> int:
        # max_seq_length counts [CLS] and [SEP]; two more tokens of slack absorb re-tokenization
        # differences at window edges (a window cut inside a word re-tokenizes its first piece).
        lite = self._lite() or (self._onnx_layout() if self.backend != "torch" else None)
        if lite is not None:
            return max(8, lite.max_seq_length - lite.specials - 2)
        specials = self.model.tokenizer.num_special_tokens_to_add(pair=False)
        return max(8, int(self.model.max_seq_length) - int(specials) - 2)

    def embed_query(self, text: str) -> np.ndarray:
        """One unit vector; a query (a few windows at most) is embedded by the light path when the
        model allows it and the full model is not loaded: no torch import for a search. An int8
        embedder embeds queries with its own int8 model, as its documents were."""
        lite = self._lite() if self.backend != "onnx-int8" else None
        if lite is None:
            return super().embed_query(text)
        import numpy as np

        windows = self.windows_of([text])[0]
        vecs = _normalize(np.asarray(lite.encode(windows), dtype=np.float32))  # as embed() does
        if len(windows) > 1:
            w = np.array([len(s) for s in windows], dtype=np.float32)
            vecs = _normalize(((vecs * w[:, None]).sum(axis=0))[None, :])
        row: np.ndarray = vecs[0]  # numpy types a row of an ndarray as Any
        return row

    def spec(self) -> dict[str, Any]:
        return {
            "kind": "sentence-transformers",
            "id": self.id,
            "model": self.model_name,
            "backend": self.backend,
            "dim": self.dim,
            "max_tokens": self.max_tokens,
            "pooling": self.pooling,
            "window_overlap": self.window_overlap,
        }

    def _token_spans(self, texts: Sequence[str]) -> list[list[tuple[int, int]]]:
        lite = self._lite() or (self._onnx_layout() if self.backend != "torch" else None)
        if lite is not None:  # the same tokenizer.json, without loading transformers
            return lite.token_spans(texts)
        tok = self.model.tokenizer
        enc = tok(
            list(texts),
            add_special_tokens=False,
            return_offsets_mapping=True,
            return_attention_mask=False,
            return_token_type_ids=False,
            truncation=False,
            verbose=False,
        )
        return [[(int(a), int(b)) for a, b in offs] for offs in enc["offset_mapping"]]

    @property
    def pools_spans(self) -> bool:
        # Mean pooling over the tokens is what this layout's model does to a whole text, so the
        # mean over a sentence's tokens is the same pooling, over a part of the text.
        return self._onnx_layout() is not None

    def _runner(self) -> OnnxBert | TorchBert | None:
        """What runs the model: ONNX Runtime, torch for the covered layout (one schedule with
        token states), or ``None`` (another layout: sentence-transformers' own ``encode``)."""
        if self.backend != "torch":
            self.warm_up()
            return self._onnx
        if self._torch is None and self._onnx_layout() is not None:
            from .encoders import TorchBert

            layout = self._onnx_layout()
            assert layout is not None
            self._torch = TorchBert(layout, self.model, max_rows=self.batch_size)
        return self._torch

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        runner = self._runner()
        if runner is not None:
            return runner.encode(texts)[0]
        # encode() sorts by length internally, so one call over all windows batches well.
        # sentence-transformers is the seam: its encode() is untyped (Any), its result an ndarray.
        out: np.ndarray = self.model.encode(
            list(texts),
            batch_size=self.batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        return out

    def _encode_tokens(self, texts: Sequence[str]) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        runner = self._runner()
        if runner is None:
            raise ConfigError(f"{self.id!r} is not a mean-pooled BERT model: it cannot pool spans")
        vecs, states = runner.encode(texts, tokens=True)
        assert states is not None
        return vecs, states


#: What ``backend="auto"`` runs on a CPU: chosen by bench/embed_speed.py (BENCHMARKS.md, "Embedding
#: speed"), where int8 kept SQuAD recall@5 within 0.5 points of torch on held-out articles.
AUTO_CPU_BACKEND = "onnx-int8"


def split_backend(spec: str) -> tuple[str, str | None]:
    """``"model@backend"`` → ``("model", "backend")``; a spec without a known backend suffix is
    returned whole (a model path may hold an ``@``).

    >>> split_backend("default@onnx-int8"), split_backend("all-MiniLM-L6-v2")
    (('default', 'onnx-int8'), ('all-MiniLM-L6-v2', None))
    """
    head, sep, tail = spec.rpartition("@")
    if sep and tail in BACKENDS:
        return head, tail
    return spec, None


def _onnx_available() -> bool:
    from .onnx import available

    return available()


def _open_light(model: str | None) -> LightBert | None:
    import os

    from ..memory.models import resolve_embedder

    try:
        path = resolve_embedder(model)
    except RagBudgetError:
        return None
    from .encoders import LightBert

    return LightBert.open(path) if path and os.path.isdir(path) else None


def cuda_visible() -> bool:
    """Whether a CUDA device is visible, asked cheaply (importing torch to ask would cost seconds
    on every CPU run): what ``backend="auto"`` decides by (a GPU: torch; none: ONNX Runtime)."""
    import os
    import sys

    if "torch" in sys.modules:
        return bool(sys.modules["torch"].cuda.is_available())
    return os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")


def _model_id(model: str | None) -> str:
    from ..memory.models import DEFAULT_EMBEDDER, EMBEDDER_ALIASES

    if model is None or model.lower() in EMBEDDER_ALIASES:
        return DEFAULT_EMBEDDER
    return model


_WORD = re.compile(r"\w+", re.UNICODE)


class HashEmbedder(Embedder):
    """Deterministic model-free embedder for tests: hashed bag of lower-cased words.

    Each word adds ±1 at a position chosen by its BLAKE2 hash, so texts sharing words score
    higher. ``max_tokens`` (words per window) enables the same windowing as a real model; ``None``
    means one window of any length. ``pool_spans``: :meth:`embed` pools span vectors from its
    words, as a real model pools them from its token states (``False``: it does not, like a
    custom embedder, and an index embeds sentences one by one).

    >>> e = HashEmbedder(dim=32)
    >>> round(float(e.embed_query("red apple") @ e.embed_query("apple, red")), 4)
    1.0
    """

    def __init__(
        self, dim: int = 64, *, max_tokens: int | None = None, pooling: str = "windows", pool_spans: bool = True
    ) -> None:
        if dim < 2:
            raise ConfigError(f"dim must be >= 2, got {dim}")
        if pooling not in _POOLINGS:
            raise ConfigError(f"pooling must be one of {_POOLINGS}, got {pooling!r}")
        self._dim = dim
        self._max = max_tokens
        self.pooling = pooling
        self.window_overlap = 0 if max_tokens is None else min(4, max_tokens // 4)
        self.id = f"hash-{dim}" + (f"-w{max_tokens}" if max_tokens else "")
        self._pools = bool(pool_spans)

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def max_tokens(self) -> int:
        return self._max if self._max is not None else 1 << 30

    def spec(self) -> dict[str, Any]:
        return {
            "kind": "hash",
            "id": self.id,
            "dim": self._dim,
            "max_tokens": self._max,
            "pooling": self.pooling,
        }

    def _token_spans(self, texts: Sequence[str]) -> list[list[tuple[int, int]]]:
        return [[m.span() for m in _WORD.finditer(t)] for t in texts]

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        import numpy as np

        out = np.zeros((len(texts), self._dim), dtype=np.float32)
        limit = self.max_tokens
        for i, text in enumerate(texts):
            for n, m in enumerate(_WORD.finditer(text.lower())):
                if n >= limit:  # like a real model: tokens past the window are ignored
                    break
                h = hashlib.blake2b(m.group().encode(), digest_size=8).digest()
                v = int.from_bytes(h, "little")
                out[i, v % self._dim] += 1.0 if (v >> 63) else -1.0
        return out

    @property
    def pools_spans(self) -> bool:
        return self._pools

    def _encode_tokens(self, texts: Sequence[str]) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        # A word's "state" is its ±1 hash position: the window's vector is their sum, and a span's
        # pooled vector is exactly the vector of the span's text embedded alone. Offsets are the
        # lower-cased text's, the text's own for every character whose lower case is one character.
        import numpy as np

        vecs = np.zeros((len(texts), self._dim), dtype=np.float32)
        states = []
        limit = self.max_tokens
        for i, text in enumerate(texts):
            words = list(itertools.islice(_WORD.finditer(text.lower()), limit))
            st = np.zeros((len(words), self._dim), dtype=np.float32)
            for n, m in enumerate(words):
                v = int.from_bytes(hashlib.blake2b(m.group().encode(), digest_size=8).digest(), "little")
                st[n, v % self._dim] = 1.0 if (v >> 63) else -1.0
            vecs[i] = st.sum(axis=0)
            states.append((np.array([m.span() for m in words], dtype=np.int64).reshape(-1, 2), st))
        return vecs, states


#: The parts of an embedder's spec that decide its vectors (``max_tokens`` only for the hasher:
#: a model's window comes with its id).
_IDENTITY = ("kind", "id", "pooling", "max_tokens", "window_overlap")


def embedder_identity(embedder: Embedder | Mapping[str, Any]) -> dict[str, Any]:
    """What decides an embedder's vectors, from the embedder or from the spec an index records:
    equal identities, interchangeable vectors (an index reuses its stored vectors, a checkpoint
    its embedded ones). Read from an embedder without loading its model: a re-run on an
    unchanged corpus must cost a stat per file.

    >>> embedder_identity(HashEmbedder(dim=16)) == embedder_identity(HashEmbedder(dim=16).spec())
    True
    """
    if isinstance(embedder, Mapping):
        spec: Mapping[str, Any] = embedder
    elif isinstance(embedder, SentenceTransformerEmbedder):
        spec = {
            "kind": "sentence-transformers",
            "id": embedder.id,
            "pooling": embedder.pooling,
            "window_overlap": embedder.window_overlap,
        }
    elif isinstance(embedder, HashEmbedder):
        spec = embedder.spec()
    else:  # a custom embedder: its id and pooling are all that is known without embedding
        spec = {"kind": "custom", "id": embedder.id, "pooling": embedder.pooling}
    return {k: spec.get(k) for k in _IDENTITY if k != "max_tokens" or spec.get("kind") == "hash"}


def embedder_from_spec(spec: dict[str, Any], **kwargs: Any) -> Embedder:
    """Rebuild the embedder an index was built with, from its manifest ``spec``.

    >>> embedder_from_spec(HashEmbedder(dim=16).spec()).id
    'hash-16'
    """
    kind = spec.get("kind")
    if kind == "hash":
        return HashEmbedder(int(spec["dim"]), max_tokens=spec.get("max_tokens"), pooling=spec.get("pooling", "windows"))
    if kind == "sentence-transformers":
        # An index written before backends existed was embedded with torch.
        backend = kwargs.pop("backend", None) or spec.get("backend") or "torch"
        if backend in ("onnx", "onnx-int8") and not _onnx_available():
            if backend == "onnx-int8":  # its vectors come from that model only
                raise ConfigError(
                    "this index was embedded with the int8 ONNX model: pip install "
                    "'ragbudget[onnx]' to search or extend it (or rebuild it)"
                )
            backend = "torch"  # float32 ONNX and torch give the same vectors
        return SentenceTransformerEmbedder(
            spec.get("model"),
            backend=backend,
            pooling=spec.get("pooling", "windows"),
            window_overlap=int(spec.get("window_overlap", 16)),
            **kwargs,
        )
    raise ConfigError(f"the index was built with a custom embedder ({spec.get('id')!r}); pass embedder= to search")


def make_embedder(spec: Any = None) -> Embedder | None:
    """An embedder from a CLI-style spec: ``None`` (the index's own, or the packaged MiniLM),
    ``"hash"`` / ``"hash:384"`` (the deterministic model-free test embedder), or a
    sentence-transformers model id or path, optionally with ``@backend`` (``default@onnx-int8``,
    ``all-MiniLM-L6-v2@torch``; see :data:`ragbudget.retrieval.embed.BACKENDS`). Embedder objects pass
    through."""
    if spec is None or not isinstance(spec, str):
        return spec
    if spec == "hash" or spec.startswith("hash:"):
        dim = spec.partition(":")[2]
        try:
            return HashEmbedder(int(dim) if dim else 384)
        except ValueError:
            raise ConfigError(f"embedder {spec!r}: expected hash or hash:<dim>, e.g. hash:384") from None
    model, backend = split_backend(spec)
    return SentenceTransformerEmbedder(model, backend=backend or "auto")
