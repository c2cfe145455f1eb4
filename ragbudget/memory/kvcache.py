"""Exact KV-cache memory from a model config alone (no weights).

Every decoder layer's frozen spec (:mod:`ragbudget.memory.layers`) says how many elements it
stores per token, or per sequence for recurrent state; :func:`kv_cache_bytes` sums them for a
number of tokens, a batch, a cache kind and a dtype.
The numbers are checked to the byte against the tensors transformers' caches really hold
(``tests/test_kvcache.py``).

What transformers 5.x really keeps (read from ``transformers/cache_utils.py``):

* ``DynamicLayer`` concatenates, so a full-attention layer holds exactly the tokens seen.
* ``DynamicSlidingWindowLayer`` keeps the *last ``sliding_window - 1``* tokens (the current token
  makes the window), but as a **view** of the concatenated tensor: right after an un-chunked
  prefill of ``P`` tokens every sliding layer still pins storage for all ``P`` tokens, and only the
  next decode step shrinks it to ``window`` tokens. The budget therefore uses the *peak*.
* ``StaticLayer`` pre-allocates ``max_cache_len``; ``StaticSlidingWindowLayer`` ``min(max_cache_len,
  window)``.
* ``offloaded`` (``DynamicCache(offloading=True)``, ``Cache.update``/``prefetch``/``offload``): before
  updating an offloaded layer the next offloaded one is prefetched, and the updated one is sent back
  to the CPU afterwards, so two layers are on the device at once; linear-attention layers are never
  offloaded, sliding ones stay when ``offload_only_non_sliding`` (False for the dynamic cache,
  True for ``offloaded_static``). It needs CUDA streams, so it is checked only on a GPU.
* Continuous batching's ``PagedAttentionCache`` is one tensor allocated up front, whatever the
  requests: :mod:`ragbudget.memory.paged` lays it out.
* ``quantized`` (``QuantizedLayer``): the prefill is quantized at once, decode tokens wait in a
  full-precision residual that is re-quantized with everything when it would reach
  ``residual_length``; quanto and HQQ pack the n-bit values and keep a scale and a zero-point per
  group in the model dtype (exact layouts in :func:`_quantized_tensor_bytes`); fp8 keeps every
  token in float8 plus one float32 scale for K and one for V.

>>> cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
...        "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "bfloat16"}
>>> kv_cache_bytes(cfg, 10, normalize=False)   # 2 layers × 2 (K,V) × 2 heads × 16 dims × 10 × 2 bytes
2560
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TypedDict

from ..errors import ConfigError
from ..settings import QUANT_BACKENDS, QuantizedCacheSettings, from_keywords
from ..types import CACHE_KINDS, dtype_bits as dtype_bits

# The specs, the config readers and the paged layout lived here before the memory model was split
# along its seams (issue #32): their public names keep this import path.
from .layers import (
    FullAttentionSpec as FullAttentionSpec,
    HybridSpec as HybridSpec,
    LayerSpec as LayerSpec,
    MambaSpec as MambaSpec,
    MLAAttentionSpec as MLAAttentionSpec,
    NoCacheSpec as NoCacheSpec,
    SlidingWindowSpec as SlidingWindowSpec,
    ceil_bytes,
    layer_specs as layer_specs,
)
from .model_config import ConfigLike, dtype_for, model_dtype as model_dtype, text_config as text_config
from .paged import PagedCacheLayout as PagedCacheLayout, paged_cache_layout as paged_cache_layout

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is 3.11+; only mypy reads it here

__all__ = [
    "CACHE_KINDS",
    "FullAttentionSpec",
    "HybridSpec",
    "KVEstimate",
    "LayerSpec",
    "MLAAttentionSpec",
    "MambaSpec",
    "NoCacheSpec",
    "PagedCacheLayout",
    "QUANT_BACKENDS",
    "QuantizedCacheSettings",
    "SlidingWindowSpec",
    "dtype_bits",
    "estimate_kv",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "layer_specs",
    "model_dtype",
    "paged_cache_layout",
    "text_config",
]


@dataclass(frozen=True)
class KVEstimate:
    """KV memory of one configuration: ``steady`` (after the tokens are in the cache) and
    ``peak`` (the most the cache pins at any time, e.g. the full prefill on sliding layers);
    ``per_layer`` is the steady bytes of each layer."""

    steady_bytes: int
    peak_bytes: int
    per_layer: tuple[int, ...]
    kv_dtype: str
    cache: str


@dataclass(frozen=True)
class _Sizing:
    """What every layer of one estimate shares: element bits, sequences, static length, paging."""

    bits: int
    batch_size: int
    max_cache_len: int | None
    backend: str
    block_size: int


def _layer_bytes(
    spec: LayerSpec, tokens: int, sz: _Sizing, *, cache: str, peak: bool, prefill_tokens: int | None
) -> int:
    if isinstance(spec, NoCacheSpec):
        return 0
    if isinstance(spec, MambaSpec):
        return sz.batch_size * spec.state_bytes(sz.bits)
    state = sz.batch_size * spec.state_bytes(sz.bits) if isinstance(spec, HybridSpec) else 0
    held = spec.tokens_held(
        tokens, cache=cache, max_cache_len=sz.max_cache_len, peak=peak, prefill_tokens=prefill_tokens
    )
    if sz.backend in ("vllm", "sglang") and sz.block_size > 1:
        # Paged caches allocate whole blocks of `block_size` tokens per sequence.
        held = math.ceil(held / sz.block_size) * sz.block_size
    return state + sz.batch_size * ceil_bytes(spec.elements_per_token * held, sz.bits)


def _quantized_tensor_bytes(
    elements: int, *, batch_size: int, nbits: int, q_group_size: int, axis: int, backend: str, bits: int
) -> int:
    """Bytes of one quantized K or V tensor of ``elements`` values, as the backend stores it.

    quanto (``optimum/quanto/tensor/grouped.py``, ``packed.py``): axis 0 groups the values into
    ``(G, group)`` rows (``G = elements / group``), packs ``8 // nbits`` rows per uint8 row
    (``ceil(G / (8 // nbits)) × group`` bytes) and keeps a float scale and a float shift per
    group in the model dtype (``MaxOptimizer``); axis -1 groups ``(group, G)``.
    HQQ (``hqq/core/quantize.py``, ``bitpack.py``): axis 0 groups ``(group, G)``, axis 1
    ``(G, group)``; the first dimension is packed — 8-bit 1 row per row, 4-bit ``rows // 2``,
    2-bit ``rows // 4``, 1-bit ``rows // 8`` (uint8), 3-bit ``ceil(rows / 10)`` int32 rows — plus
    a scale and a zero per group in the compute (model) dtype.
    """
    if elements == 0:
        return 0
    groups = math.ceil(elements / q_group_size)
    meta = 2 * groups * ceil_bytes(1, bits)
    if backend == "quanto":
        per_row = 8 // nbits
        if axis == 0:
            return math.ceil(groups / per_row) * q_group_size + meta
        return math.ceil(q_group_size / per_row) * groups + meta
    rows, cols = (q_group_size, groups) if axis == 0 else (groups, q_group_size)
    if nbits == 3:
        return math.ceil(rows / 10) * 4 * cols + meta
    pack = {8: 1, 6: 1, 5: 1, 4: 2, 2: 4, 1: 8}[nbits]  # 5/6-bit are stored as 8-bit by HQQ
    return (rows // pack) * cols + meta


def _quantized_layer_bytes(
    spec: LayerSpec,
    tokens: int,
    *,
    bits: int,
    batch_size: int,
    nbits: int,
    q_group_size: int,
    residual_length: int,
    axis: int,
    quant_backend: str,
    prefill_tokens: int | None,
    worst_residual: bool = False,
) -> int:
    """transformers' ``QuantizedCache`` (``QuantizedLayer`` / ``Fp8QuantizedLayer`` in
    ``cache_utils.py``), full-attention layers only.

    ``fp8``: every token in float8 plus one float32 scale for K and one for V.
    ``quanto``/``hqq``: the prefill is quantized at once; each decode token goes to a
    full-precision residual, and when the residual would reach ``residual_length`` everything
    (dequantized + residual + new) is re-quantized and the residual emptied. After ``d`` decode
    tokens the residual therefore holds ``d mod residual_length`` tokens and the rest is
    quantized. ``worst_residual`` counts every token quantized *and* a full residual window
    (an upper bound for any flush phase).
    """
    if isinstance(spec, NoCacheSpec):
        return 0
    if not isinstance(spec, (FullAttentionSpec, MLAAttentionSpec)) or isinstance(spec, SlidingWindowSpec):
        raise ConfigError(
            f"transformers' QuantizedCache supports only full-attention layers, found a "
            f"{spec.kind} layer; use cache='dynamic' or 'offloaded' for this model"
        )
    if isinstance(spec, MLAAttentionSpec):
        k_per_token, v_per_token = spec.elements_per_token, 0
    else:
        k_per_token = spec.num_kv_heads * spec.head_size
        v_per_token = spec.num_kv_heads * spec.v_head_size
    if quant_backend == "fp8":
        return (k_per_token + v_per_token) * tokens * batch_size + 2 * 4
    prefill = tokens if prefill_tokens is None else min(prefill_tokens, tokens)
    if worst_residual:
        quantized, residual = tokens, min(residual_length - 1, tokens - prefill)
    else:
        residual = (tokens - prefill) % residual_length
        quantized = tokens - residual
    tensor_bytes = partial(
        _quantized_tensor_bytes,
        batch_size=batch_size,
        nbits=nbits,
        q_group_size=q_group_size,
        axis=axis,
        backend=quant_backend,
        bits=bits,
    )
    return (
        tensor_bytes(k_per_token * quantized * batch_size)
        + tensor_bytes(v_per_token * quantized * batch_size)
        + ceil_bytes((k_per_token + v_per_token) * residual * batch_size, bits)
    )


def _offloaded(
    specs: tuple[LayerSpec, ...],
    tokens: int,
    per: tuple[int, ...],
    per_peak: tuple[int, ...],
    sz: _Sizing,
    prefill: int | None,
    name: str,
    *,
    only_non_sliding: bool,
) -> KVEstimate:
    """Device bytes of transformers' offloaded cache (``Cache.update``, ``prefetch``, ``offload``
    in ``cache_utils.py``, 5.x).

    Before an offloaded layer is updated the *next* offloaded layer (circularly) is prefetched;
    after the update the layer goes back to the CPU. So the device holds the resident layers
    (linear-attention layers are never offloaded; sliding ones stay when ``only_non_sliding``)
    plus one pair (updated layer, prefetched next layer):

    * first forward (``prefill_tokens``): the next layer is still empty, so one layer with its
      prefill storage, and at the end the last layer with the first one prefetched back;
    * decode: the updated layer (a sliding one pins ``window`` tokens through its view) plus the
      next one, compact after its CPU round trip (``window - 1`` tokens for a sliding layer).

    ``steady`` is what stays after ``generate``: the resident layers and the first offloaded
    layer, prefetched for a next step that never comes.
    """
    p = tokens if prefill is None else min(prefill, tokens)

    def size(i: int, t: int, *, peak: bool, prefill_tokens: int | None = None) -> int:
        return _layer_bytes(specs[i], t, sz, cache="dynamic", peak=peak, prefill_tokens=prefill_tokens)

    def stays(s: LayerSpec) -> bool:
        return isinstance(s, MambaSpec) or (only_non_sliding and isinstance(s, SlidingWindowSpec))

    res = [i for i, s in enumerate(specs) if stays(s)]
    off = [i for i, s in enumerate(specs) if not stays(s) and not isinstance(s, NoCacheSpec)]
    res_steady, res_peak = sum(per[i] for i in res), sum(per_peak[i] for i in res)
    if not off:
        return KVEstimate(res_steady, res_peak, per, name, "offloaded")
    nxt = {i: off[(k + 1) % len(off)] for k, i in enumerate(off)}
    first = off[0]
    candidates = [max(size(i, p, peak=True, prefill_tokens=p) for i in off)]
    if len(off) > 1:
        candidates.append(size(off[-1], p, peak=True, prefill_tokens=p) + size(first, p, peak=False))
    if tokens > p:
        candidates.append(
            max(size(i, tokens, peak=True, prefill_tokens=1) + (per[nxt[i]] if nxt[i] != i else 0) for i in off)
        )
    return KVEstimate(res_steady + per[first], res_peak + max(candidates), per, name, "offloaded")


def estimate_kv(
    config: ConfigLike,
    tokens: int,
    *,
    batch_size: int = 1,
    kv_dtype: str | None = None,
    cache: str = "dynamic",
    backend: str = "transformers",
    max_cache_len: int | None = None,
    prefill_tokens: int | None = None,
    block_size: int = 16,
    mla: str = "auto",
    quantized: QuantizedCacheSettings | None = None,
    quant_backend: str | None = None,
    nbits: int | None = None,
    q_group_size: int | None = None,
    residual_length: int | None = None,
    q_axis: int | None = None,
    offload_only_non_sliding: bool = False,
    normalize: bool = True,
) -> KVEstimate:
    """Steady and peak KV bytes on the accelerator for ``batch_size`` sequences of ``tokens``.

    ``cache``: ``"dynamic"`` (grows), ``"static"`` (pre-allocates ``max_cache_len``, default
    ``tokens``), ``"offloaded"`` (only the layers in flight stay on the GPU: the one being updated
    plus the one prefetched; recurrent layers, and sliding layers when
    ``offload_only_non_sliding``, stay resident), ``"quantized"`` (``quantized``, a
    :class:`~ragbudget.settings.QuantizedCacheSettings`, or its keywords ``quant_backend``
    quanto, hqq or fp8, ``nbits``, ``q_group_size``, ``residual_length`` and ``q_axis``, as in
    transformers' ``QuantizedCache``; exact for a ``generate`` whose prompt of ``prefill_tokens`` tokens is
    prefilled at once, the peak an upper bound for any flush phase). ``kv_dtype`` defaults to the
    model dtype (bf16 if the config has none).
    ``prefill_tokens``: the largest single forward (default: all ``tokens`` at once).
    ``backend="vllm"``/``"sglang"`` rounds token slots up to whole ``block_size`` pages.
    """
    if cache not in CACHE_KINDS:
        raise ConfigError(f"cache must be one of {CACHE_KINDS}, got {cache!r}")
    if tokens < 0 or batch_size < 1:
        raise ConfigError(f"need tokens >= 0 and batch_size >= 1, got {tokens} and {batch_size}")
    if cache == "static" and max_cache_len is not None and tokens > max_cache_len:
        raise ConfigError(f"{tokens} tokens do not fit a static cache of max_cache_len={max_cache_len}")
    specs = layer_specs(config, backend=backend, mla=mla, normalize=normalize)
    name, bits = dtype_for(config, kv_dtype)
    sz = _Sizing(bits=bits, batch_size=batch_size, max_cache_len=max_cache_len, backend=backend, block_size=block_size)
    q = from_keywords(
        QuantizedCacheSettings,
        quantized,
        "quantized",
        {
            "quant_backend": quant_backend,
            "nbits": nbits,
            "q_group_size": q_group_size,
            "residual_length": residual_length,
            "q_axis": q_axis,
        },
    )
    if cache == "quantized":
        return _quantized_estimate(specs, tokens, q, bits=bits, batch_size=batch_size, prefill_tokens=prefill_tokens)
    base = "static" if cache == "static" else "dynamic"
    per = tuple(_layer_bytes(s, tokens, sz, cache=base, peak=False, prefill_tokens=prefill_tokens) for s in specs)
    per_peak = tuple(_layer_bytes(s, tokens, sz, cache=base, peak=True, prefill_tokens=prefill_tokens) for s in specs)
    if cache == "offloaded":
        return _offloaded(
            specs, tokens, per, per_peak, sz, prefill_tokens, name, only_non_sliding=offload_only_non_sliding
        )
    return KVEstimate(sum(per), sum(per_peak), per, name, cache)


class _EstimateOptions(TypedDict, total=False):
    """The keywords of :func:`estimate_kv` that :func:`kv_cache_bytes` passes on."""

    prefill_tokens: int | None
    block_size: int
    mla: str
    quantized: QuantizedCacheSettings | None
    quant_backend: str | None
    nbits: int | None
    q_group_size: int | None
    residual_length: int | None
    q_axis: int | None
    offload_only_non_sliding: bool
    normalize: bool


def _quantized_estimate(
    specs: Sequence[LayerSpec],
    tokens: int,
    q: QuantizedCacheSettings,
    *,
    bits: int,
    batch_size: int,
    prefill_tokens: int | None,
) -> KVEstimate:
    """:func:`estimate_kv` for transformers' ``QuantizedCache``: the quantized layers, and at the
    peak the worst residual plus the full-precision copies an update makes of one layer."""
    quant_backend = q.quant_backend
    layer_bytes = partial(
        _quantized_layer_bytes,
        bits=bits,
        batch_size=batch_size,
        nbits=q.nbits,
        q_group_size=q.q_group_size,
        residual_length=q.residual_length,
        axis=q.q_axis,
        quant_backend=quant_backend,
        prefill_tokens=prefill_tokens,
    )
    per = tuple(layer_bytes(s, tokens) for s in specs)
    worst = sum(layer_bytes(s, tokens, worst_residual=True) for s in specs)
    # Each update dequantizes the layer and concatenates dequantized + residual + new states
    # in full precision (two full-precision copies of one layer at once); fp8 dequantizes once.
    copies = 1 if quant_backend == "fp8" else 2
    transient = copies * max((batch_size * ceil_bytes(s.elements_per_token * tokens, bits) for s in specs), default=0)
    return KVEstimate(
        sum(per), worst + transient, per, f"int{q.nbits}" if quant_backend != "fp8" else "fp8", "quantized"
    )


def kv_cache_bytes(
    config: ConfigLike,
    tokens: int,
    *,
    batch_size: int = 1,
    kv_dtype: str | None = None,
    cache: str = "dynamic",
    backend: str = "transformers",
    max_cache_len: int | None = None,
    peak: bool = False,
    **kwargs: Unpack[_EstimateOptions],
) -> int:
    """Bytes of KV cache (plus recurrent state) for ``batch_size`` sequences of ``tokens`` tokens.

    ``peak=False`` gives the steady size (what the cache tensors hold after the tokens are in);
    ``peak=True`` the most they pin at once. Other keywords as in :func:`estimate_kv`.

    >>> cfg = {"model_type": "mistral", "num_hidden_layers": 1, "hidden_size": 32,
    ...        "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 4,
    ...        "torch_dtype": "float32"}
    >>> kv_cache_bytes(cfg, 100, normalize=False), kv_cache_bytes(cfg, 100, peak=True, normalize=False)
    (384, 12800)
    """
    est = estimate_kv(
        config,
        tokens,
        batch_size=batch_size,
        kv_dtype=kv_dtype,
        cache=cache,
        backend=backend,
        max_cache_len=max_cache_len,
        **kwargs,
    )
    return est.peak_bytes if peak else est.steady_bytes


def kv_bytes_per_token(
    config: ConfigLike,
    *,
    kv_dtype: str | None = None,
    backend: str = "transformers",
    include_sliding: bool = False,
    mla: str = "auto",
    normalize: bool = True,
) -> int:
    """Bytes the cache grows by per token per sequence once past every sliding window (only
    full-attention and MLA layers grow); ``include_sliding=True`` gives the rate below the
    windows (every attention layer grows).

    >>> kv_bytes_per_token({"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
    ...     "num_attention_heads": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16"},
    ...     normalize=False)
    131072
    """
    specs = layer_specs(config, backend=backend, mla=mla, normalize=normalize)
    _, bits = dtype_for(config, kv_dtype)
    total = 0
    for s in specs:
        attention = s.attention if isinstance(s, HybridSpec) else s
        if isinstance(attention, SlidingWindowSpec) and not include_sliding:
            continue
        total += s.elements_per_token
    return ceil_bytes(total, bits)
