"""Exact KV-cache memory from a model config alone (no weights).

One job: KV-cache bytes for every layer layout transformers has (one spec per layout, summed).

Every decoder layer gets a frozen *spec* (the idea of vLLM's ``kv_cache_interface.py``) that knows
how many elements it stores per token, or per sequence for recurrent state:

* :class:`FullAttentionSpec`  — MHA / GQA / MQA, ``2 × kv_heads × head_dim`` per token;
* :class:`SlidingWindowSpec`  — the same, but at most a window of tokens at steady state;
* :class:`MLAAttentionSpec`   — DeepSeek-V2/V3 multi-head latent attention;
* :class:`MambaSpec`          — conv + SSM / linear-attention state, a constant per sequence;
* :class:`HybridSpec`         — attention and a recurrent mixer in the same layer (Falcon-H1);
* :class:`NoCacheSpec`        — layers that keep nothing (KV-sharing consumers, MLP-only layers).

:func:`kv_cache_bytes` then sums them for a number of tokens, a batch, a cache kind and a dtype.
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
* DeepSeek-V3 in transformers 5.x caches the compressed latent (``kv_lora_rank`` + ``qk_rope_head_dim``,
  one "head"), like vLLM / SGLang; transformers 4.x cached the decompressed per-head K and V
  (``mla="decompressed"`` models that).
* Recurrent layers (Mamba-1/2, Jamba, Bamba, Falcon-H1, Zamba/Zamba2, Nemotron-H, GraniteMoeHybrid,
  LFM2/LFM3 short convs, Qwen3-Next / Qwen3.5 / OLMo-Hybrid / Lara gated delta nets) keep a conv
  state in the model dtype and a float32 recurrent state (``LinearAttentionLayer``); ``hybrid``
  layers (Falcon-H1, Zamba's shared attention) keep both that state and growing K/V.
* ``offloaded`` (``DynamicCache(offloading=True)``, ``Cache.update``/``prefetch``/``offload``): before
  updating an offloaded layer the next offloaded one is prefetched, and the updated one is sent back
  to the CPU afterwards, so two layers are on the device at once; linear-attention layers are never
  offloaded, sliding ones stay when ``offload_only_non_sliding`` (False for the dynamic cache,
  True for ``offloaded_static``). It needs CUDA streams, so it is checked only on a GPU.
* ``paged`` (continuous batching's ``PagedAttentionCache``, :func:`paged_cache_layout`): one flat
  byte tensor allocated up front, whatever the requests: ``num_blocks`` blocks of ``page_size``
  tokens of every layer, rounded up to whole *sectors* (the least common multiple of each
  attention group's block and 128 bytes), plus two trash sectors that padding tokens read and
  write.
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

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

from ..errors import ConfigError, ModelError
from ..settings import QUANT_BACKENDS, QuantizedCacheSettings, from_keywords
from ..types import CACHE_KINDS, DTYPE_BITS, dtype_bits as dtype_bits

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

BACKENDS = ("transformers", "vllm", "sglang")

# The dtype table is a shared constant (types.py): settings checks a kv_dtype against it without
# importing this stage.


def _ceil_bytes(elements: int, bits: int) -> int:
    # Sub-byte dtypes pack several elements per byte; a partial byte still costs a whole one.
    return (elements * bits + 7) // 8


# --------------------------------------------------------------------------------------------
# Config access: a dict or a transformers PretrainedConfig, normalized through transformers
# --------------------------------------------------------------------------------------------

ConfigLike = Mapping[str, Any] | Any


class _Cfg:
    """Uniform attribute access over a dict or a config object (missing → default)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def get(self, *names: str, default: Any = None) -> Any:
        for name in names:
            if isinstance(self.obj, Mapping):
                value = self.obj.get(name)
            else:
                try:
                    value = getattr(self.obj, name, None)
                except Exception:  # noqa: BLE001 - some configs raise on unknown attributes
                    value = None
            if value is not None:
                return value
        return default


def text_config(config: ConfigLike) -> ConfigLike:
    """The decoder text config: ``text_config`` of multimodal configs (Gemma 3, Llava, …), else
    the config itself. Works on dicts and on transformers configs."""
    if not isinstance(config, Mapping):
        getter = getattr(config, "get_text_config", None)
        if getter is not None:
            try:
                return getter(decoder=True)
            except TypeError:
                return getter()
        return config
    for key in ("text_config", "language_config", "llm_config"):
        sub = config.get(key)
        if isinstance(sub, Mapping) and sub:
            merged = dict(sub)
            # Multimodal configs often keep the dtype on the outer config only.
            for k in ("torch_dtype", "dtype"):
                if k not in merged and k in config:
                    merged[k] = config[k]
            return merged
    return config


def model_dtype(config: ConfigLike, default: str = "float32") -> str:
    """The model's dtype name (``dtype``, or the deprecated ``torch_dtype``, of the config),
    ``default`` if absent.

    An absent dtype plans for float32 because that is what transformers allocates then:
    ``from_config`` and ``from_pretrained(dtype="auto")`` on a config without a dtype fall back to
    ``torch.get_default_dtype()`` (transformers ``modeling_utils._get_dtype``). Guessing bf16 would
    halve the estimate — the direction that runs out of memory; a model really loaded in bf16 is
    planned with ``kv_dtype``/``weight_dtype`` (or its loaded dtype) instead.

    >>> model_dtype({"torch_dtype": "bfloat16"}), model_dtype({"dtype": "float16"}), model_dtype({})
    ('bfloat16', 'float16', 'float32')
    """
    for cfg in (config, text_config(config)):
        value = _Cfg(cfg).get("dtype", "torch_dtype")
        if value is not None:
            name = str(value).removeprefix("torch.")
            if name in DTYPE_BITS:
                return name
    return default


@lru_cache(maxsize=64)
def _normalized_from_json(blob: str) -> Any:
    from transformers import AutoConfig  # lazy: heavy import

    d = json.loads(blob)
    model_type = d.pop("model_type")
    for k in ("architectures", "auto_map", "transformers_version", "_name_or_path"):
        d.pop(k, None)
    return AutoConfig.for_model(model_type, **d)


def _normalize(config: ConfigLike, normalize: bool) -> ConfigLike:
    """Let transformers apply its per-family defaults (``layer_types``, ``head_dim``, windows) when
    it knows the model type; fall back to the raw dict (with ragbudget's own heuristics)."""
    if not normalize or not isinstance(config, Mapping) or "model_type" not in config:
        return text_config(config)
    try:
        obj = _normalized_from_json(json.dumps(dict(config), sort_keys=True, default=str))
    except Exception:  # noqa: BLE001 - unknown model type or a rejected dict: use heuristics
        return text_config(config)
    return text_config(obj)


# --------------------------------------------------------------------------------------------
# Layer specs
# --------------------------------------------------------------------------------------------


def _every_token_held(tokens: int, *, cache: str, max_cache_len: int | None) -> int:
    # A layer attending to every token holds them all; a static cache allocates its whole length.
    if cache == "static":
        return max_cache_len if max_cache_len is not None else tokens
    return tokens


@dataclass(frozen=True)
class FullAttentionSpec:
    """A layer that keeps K and V for every token: ``num_kv_heads × (head_size + v_head_size)``
    elements per token."""

    num_kv_heads: int
    head_size: int
    v_head_size: int

    kind = "full_attention"

    @property
    def elements_per_token(self) -> int:
        return self.num_kv_heads * (self.head_size + self.v_head_size)

    def tokens_held(
        self,
        tokens: int,
        *,
        cache: str = "dynamic",
        max_cache_len: int | None = None,
        peak: bool = False,
        prefill_tokens: int | None = None,
    ) -> int:
        """Token slots this layer holds for one sequence after ``tokens`` tokens entered it."""
        return _every_token_held(tokens, cache=cache, max_cache_len=max_cache_len)

    state_elements = 0


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Sliding-window (or chunked) attention: at most a window of tokens is needed.

    transformers' ``DynamicSlidingWindowLayer`` keeps ``window - 1`` tokens (a view of the last
    concatenation, so its storage is larger right after a multi-token update — see ``peak``);
    ``StaticSlidingWindowLayer`` allocates ``min(max_cache_len, window)``.
    """

    sliding_window: int = 0

    kind = "sliding_attention"

    def tokens_held(
        self,
        tokens: int,
        *,
        cache: str = "dynamic",
        max_cache_len: int | None = None,
        peak: bool = False,
        prefill_tokens: int | None = None,
    ) -> int:
        w = self.sliding_window
        if cache == "static":
            return min(max_cache_len if max_cache_len is not None else tokens, w)
        if not peak:
            return min(tokens, w - 1)
        # Storage pinned by the view: the whole prefill right after it, then at most `w` tokens
        # (w - 1 kept + the token being decoded) at each decode step.
        prefill = tokens if prefill_tokens is None else min(prefill_tokens, tokens)
        return max(prefill, min(tokens, w))


@dataclass(frozen=True)
class MLAAttentionSpec:
    """DeepSeek-V2/V3 multi-head latent attention.

    ``latent=True``: one compressed vector of ``kv_lora_rank + qk_rope_head_dim`` per token (vLLM,
    SGLang, transformers ≥ 5). ``latent=False``: decompressed per-head K (``qk_nope + qk_rope``)
    and V (``v_head_dim``), as transformers 4.x cached it.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    num_heads: int
    latent: bool = True

    kind = "mla_attention"

    @property
    def elements_per_token(self) -> int:
        if self.latent:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)

    def tokens_held(
        self,
        tokens: int,
        *,
        cache: str = "dynamic",
        max_cache_len: int | None = None,
        peak: bool = False,
        prefill_tokens: int | None = None,
    ) -> int:
        # MLA layers attend to every token: they hold what a full-attention layer holds.
        return _every_token_held(tokens, cache=cache, max_cache_len=max_cache_len)

    state_elements = 0


@dataclass(frozen=True)
class MambaSpec:
    """A recurrent layer (Mamba, Mamba-2, gated delta net, short conv): a fixed state per
    sequence, ``conv_elements`` in the model dtype and ``ssm_elements`` in ``ssm_dtype_bits``
    (``0`` = model dtype)."""

    conv_elements: int
    ssm_elements: int
    ssm_dtype_bits: int = 0

    kind = "mamba"
    elements_per_token = 0

    def tokens_held(self, tokens: int, **_: Any) -> int:
        return 0

    @property
    def state_elements(self) -> int:
        return self.conv_elements + self.ssm_elements

    def state_bytes(self, bits: int) -> int:
        ssm_bits = self.ssm_dtype_bits or bits
        return _ceil_bytes(self.conv_elements, bits) + _ceil_bytes(self.ssm_elements, ssm_bits)


@dataclass(frozen=True)
class HybridSpec:
    """A layer that runs attention *and* a recurrent mixer (Falcon-H1 in parallel, Zamba/Zamba2 with
    their shared attention block): transformers' ``LinearAttentionAndFullAttentionLayer`` keeps both
    the per-token K/V of ``attention`` and the fixed ``state`` of the mixer."""

    attention: FullAttentionSpec
    state: MambaSpec

    kind = "hybrid"

    @property
    def elements_per_token(self) -> int:
        return self.attention.elements_per_token

    @property
    def state_elements(self) -> int:
        return self.state.state_elements

    def tokens_held(self, tokens: int, **kw: Any) -> int:
        return self.attention.tokens_held(tokens, **kw)

    def state_bytes(self, bits: int) -> int:
        return self.state.state_bytes(bits)


@dataclass(frozen=True)
class NoCacheSpec:
    """A layer that stores nothing (KV-sharing consumer, MLP/MoE-only layer)."""

    kind = "none"
    elements_per_token = 0
    state_elements = 0

    def tokens_held(self, tokens: int, **_: Any) -> int:
        return 0


LayerSpec = FullAttentionSpec | SlidingWindowSpec | MLAAttentionSpec | MambaSpec | HybridSpec | NoCacheSpec


def _attention_shape(c: _Cfg) -> tuple[int, int, int]:
    """(num_kv_heads, head_dim, v_head_dim) under every family's attribute names."""
    heads = c.get("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads")
    hidden = c.get("hidden_size", "n_embd", "d_model", "dim", "model_dim")
    if heads is None or hidden is None:
        raise ModelError(
            "the config has no attention shape (num_attention_heads/n_head and hidden_size/n_embd); "
            "pass a decoder-only model config"
        )
    mt = str(c.get("model_type", default="")).lower()
    # Falcon: new_decoder_architecture uses num_kv_heads; else multi_query means one KV head.
    if mt == "falcon":
        if c.get("new_decoder_architecture", default=False):
            kv = c.get("num_kv_heads", "num_key_value_heads", default=heads)
        elif c.get("multi_query", default=True):
            kv = 1
        else:
            kv = heads
    elif c.get("multi_query", default=False) is True:  # GPT-BigCode / StarCoder
        kv = 1
    else:
        kv = c.get(
            "num_key_value_heads",
            "num_kv_heads",
            "n_head_kv",
            "multi_query_group_num",
            "num_key_value_groups_",
            default=heads,
        )
    head_dim = c.get("head_dim", "attention_head_dim", "attention_head_size", "kv_channels", default=None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        head_dim = int(hidden) // int(heads)
    v_head_dim = c.get("v_head_dim", default=None) if mt.startswith("deepseek") else None
    return int(kv), int(head_dim), int(v_head_dim or head_dim)


def _num_layers(c: _Cfg) -> int:
    n = c.get("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
    if n is None:
        # Nemotron-H derives its depth from the layer pattern.
        lt = c.get("layer_types", "layers_block_type", "hybrid_override_pattern")
        if isinstance(lt, (list, tuple, str)) and lt:
            return len(lt)
        raise ModelError("the config has no number of layers (num_hidden_layers / n_layer)")
    return int(n)


# Nemotron-H's `hybrid_override_pattern`: one character per layer (configuration_nemotron_h.py).
_PATTERN_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _default_layer_types(c: _Cfg, n: int) -> list[str]:
    """transformers' per-family ``layer_types`` defaults, for raw dicts it could not normalize."""
    lt = c.get("layer_types", "layers_block_type")
    if isinstance(lt, (list, tuple)) and len(lt) == n:
        return [str(x) for x in lt]
    mt = str(c.get("model_type", default="")).lower()
    window = c.get("sliding_window")
    pattern = c.get("hybrid_override_pattern")
    if isinstance(pattern, str) and len(pattern) == n:
        return [_PATTERN_TYPES.get(ch, "full_attention") for ch in pattern]
    if mt in ("mamba", "mamba2", "falcon_mamba"):
        return ["linear_attention"] * n
    if mt == "falcon_h1":  # attention and Mamba-2 run in parallel in every layer
        return ["hybrid"] * n
    if mt in ("jamba", "zamba"):
        period = int(c.get("attn_layer_period", default=8 if mt == "jamba" else 6))
        offset = int(c.get("attn_layer_offset", default=4 if mt == "jamba" else 5))
        attn = "full_attention" if mt == "jamba" else "hybrid"
        return [attn if i % period == offset else "linear_attention" for i in range(n)]
    if mt == "bamba":
        idx = set(c.get("attn_layer_indices", default=()) or ())
        return ["full_attention" if i in idx else "linear_attention" for i in range(n)]
    if mt == "granitemoehybrid":
        return ["linear_attention"] * n
    if mt in ("gemma2", "gpt_oss"):
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if mt in ("gemma3", "gemma3_text", "cohere2"):
        pattern = int(c.get("sliding_window_pattern", "_sliding_window_pattern", default=6 if mt != "cohere2" else 4))
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if mt in ("olmo3",):
        return ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    if mt.startswith(("qwen2", "qwen3")):
        if not c.get("use_sliding_window", default=False) or window is None:
            return ["full_attention"] * n
        mwl = int(c.get("max_window_layers", default=n))
        return ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]
    if window is not None:
        return ["sliding_attention"] * n
    if c.get("attention_chunk_size") is not None:
        return ["chunked_attention"] * n
    return ["full_attention"] * n


# transformers keeps every SSM / delta-rule recurrent state in float32 whatever the model dtype
# (A = -exp(A_log.float()) makes the scan float32; checked on bf16 models of all 14 recurrent
# families, one per code path kept in tests/test_kvcache.py). Conv states follow the model dtype.
# Fused CUDA kernels (mamba-ssm, causal-conv1d) are not exercised here.
_SSM_BITS = 32


def _mamba2(
    c: _Cfg,
    heads: str,
    head_dim: str,
    groups: str,
    d_state: str,
    d_conv: str,
    d_inner: int | None = None,
    expand: str = "mamba_expand",
) -> MambaSpec:
    """Mamba-2 mixer under one family's attribute names.

    transformers caches a conv state over ``x, B, C`` — ``(intermediate + 2 × n_groups × d_state)``
    channels × ``d_conv`` — and an SSM state ``(n_heads, head_dim, d_state)``
    (``conv_dim`` / ``ssm_state_size`` in modeling_mamba2/bamba/falcon_h1/nemotron_h/zamba2.py).
    """
    n_heads, hd = int(c.get(heads)), int(c.get(head_dim))
    ds, dc = int(c.get(d_state)), int(c.get(d_conv))
    if d_inner is None:
        d_inner = int(c.get(expand) * int(c.get("hidden_size")))
    conv = (d_inner + 2 * int(c.get(groups, default=1)) * ds) * dc
    return MambaSpec(conv_elements=conv, ssm_elements=n_heads * hd * ds, ssm_dtype_bits=_SSM_BITS)


def _mamba_spec(c: _Cfg, layer_type: str) -> MambaSpec:
    """The recurrent state of one linear-attention layer, per family (read from each family's
    modeling file in transformers 5.x; tests/test_kvcache.py checks every one to the byte)."""
    mt = str(c.get("model_type", default="")).lower()
    if c.get("linear_num_value_heads") is not None:  # Qwen3-Next gated delta net
        kh, kd = int(c.get("linear_num_key_heads")), int(c.get("linear_key_head_dim"))
        vh, vd = int(c.get("linear_num_value_heads")), int(c.get("linear_value_head_dim"))
        conv = (2 * kh * kd + vh * vd) * int(c.get("linear_conv_kernel_dim", default=4))
        # The delta-rule recurrence runs and stores its state in float32 (modeling_qwen3_next.py).
        return MambaSpec(conv_elements=conv, ssm_elements=vh * kd * vd, ssm_dtype_bits=_SSM_BITS)
    hidden = int(c.get("hidden_size", "d_model"))
    if mt.startswith("lfm2") or c.get("conv_L_cache") is not None:
        # LFM2 short convolution: a (hidden, L_cache) conv state and no SSM state.
        return MambaSpec(conv_elements=hidden * int(c.get("conv_L_cache", default=3)), ssm_elements=0)
    if mt in ("mamba", "falcon_mamba"):
        d_inner = int(c.get("intermediate_size", default=0) or int(c.get("expand", default=2)) * hidden)
        return MambaSpec(
            conv_elements=d_inner * int(c.get("conv_kernel", default=4)),
            ssm_elements=d_inner * int(c.get("state_size", default=16)),
            ssm_dtype_bits=_SSM_BITS,
        )
    if mt in ("jamba", "zamba"):
        # Mamba-1: conv over x only, state (d_inner, d_state) (Zamba splits it in heads; same size).
        d_inner = int(c.get("mamba_expand", default=2)) * hidden
        return MambaSpec(
            conv_elements=d_inner * int(c.get("mamba_d_conv", default=4)),
            ssm_elements=d_inner * int(c.get("mamba_d_state", default=16)),
            ssm_dtype_bits=_SSM_BITS,
        )
    if mt == "mamba2":
        return _mamba2(c, "num_heads", "head_dim", "n_groups", "state_size", "conv_kernel", expand="expand")
    if mt in ("bamba", "granitemoehybrid"):
        return _mamba2(c, "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv")
    if mt == "falcon_h1":
        d_ssm = c.get("mamba_d_ssm")
        return _mamba2(
            c,
            "mamba_n_heads",
            "mamba_d_head",
            "mamba_n_groups",
            "mamba_d_state",
            "mamba_d_conv",
            d_inner=int(d_ssm) if d_ssm is not None else None,
        )
    if mt == "nemotron_h":
        d_inner = int(c.get("mamba_num_heads")) * int(c.get("mamba_head_dim"))
        return _mamba2(
            c, "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel", d_inner=d_inner
        )
    if mt == "zamba2":
        return _mamba2(c, "n_mamba_heads", "mamba_headdim", "mamba_ngroups", "mamba_d_state", "mamba_d_conv")
    # Unknown family: Mamba-1 (Mamba-2 when it names mamba heads) under the common names.
    d_conv = int(c.get("mamba_d_conv", "conv_kernel", "d_conv", default=4))
    d_state = int(c.get("mamba_d_state", "state_size", "ssm_state_size", "d_state", default=16))
    expand = int(c.get("mamba_expand", "expand", default=2))
    d_inner = int(c.get("mamba_d_ssm", "intermediate_size_mamba", default=0) or expand * hidden)
    n_heads = c.get("mamba_n_heads", "num_heads_mamba", "n_mamba_heads", "mamba_num_heads")
    if n_heads is not None:
        groups = int(c.get("mamba_n_groups", "n_groups", default=1))
        d_head = c.get("mamba_d_head", "mamba_head_dim", "mamba_headdim", default=None)
        d_head = int(d_head) if isinstance(d_head, int) else d_inner // int(n_heads)
        conv = (d_inner + 2 * groups * d_state) * d_conv
        return MambaSpec(conv_elements=conv, ssm_elements=int(n_heads) * d_head * d_state, ssm_dtype_bits=_SSM_BITS)
    return MambaSpec(conv_elements=d_inner * d_conv, ssm_elements=d_inner * d_state, ssm_dtype_bits=_SSM_BITS)


_LINEAR_TYPES = {"linear_attention", "conv", "mamba", "mamba2", "ssm", "recurrent"}
_SLIDING_TYPES = {"sliding_attention", "chunked_attention", "local", "local_attention", "reference_sliding_attention"}
_NONE_TYPES = {"dummy", "moe", "mlp", "none"}


def layer_specs(
    config: ConfigLike,
    *,
    backend: str = "transformers",
    mla: str = "auto",
    normalize: bool = True,
) -> tuple[LayerSpec, ...]:
    """One frozen spec per decoder layer, from a config dict or a transformers config.

    ``backend`` matters for MLA only (all backends named here cache the latent; ``mla=
    "decompressed"`` models transformers 4.x). ``normalize`` lets transformers fill in per-family
    defaults for a raw dict (slower the first time: it imports transformers).

    >>> specs = layer_specs({"model_type": "gemma2", "num_hidden_layers": 4, "hidden_size": 64,
    ...     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    ...     "sliding_window": 8}, normalize=False)
    >>> [s.kind for s in specs]
    ['sliding_attention', 'full_attention', 'sliding_attention', 'full_attention']
    """
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if mla not in ("auto", "latent", "decompressed"):
        raise ConfigError(f"mla must be 'auto', 'latent' or 'decompressed', got {mla!r}")
    cfg = _normalize(config, normalize)
    c = _Cfg(cfg)
    n = _num_layers(c)
    types = _default_layer_types(c, n)
    kv_lora = c.get("kv_lora_rank")
    if kv_lora is not None:
        heads = int(c.get("num_attention_heads"))
        spec: LayerSpec = MLAAttentionSpec(
            kv_lora_rank=int(kv_lora),
            qk_rope_head_dim=int(c.get("qk_rope_head_dim", default=64)),
            qk_nope_head_dim=int(c.get("qk_nope_head_dim", default=128)),
            v_head_dim=int(c.get("v_head_dim", default=128)),
            num_heads=heads,
            latent=(mla != "decompressed"),
        )
        return tuple(NoCacheSpec() if t in _NONE_TYPES else spec for t in types)
    window = c.get("sliding_window", "attention_chunk_size")
    specs: list[LayerSpec] = []
    sharing = c.get("kv_sharing_modes")
    shape: tuple[int, int, int] | None = None

    def attention(t: str, i: int) -> FullAttentionSpec:
        nonlocal shape
        # Pure-recurrent models (Mamba) have no attention shape: read it only when a layer needs it.
        kv, hd, vd = shape = shape or _attention_shape(c)
        if t in _SLIDING_TYPES:
            w = c.get("attention_chunk_size") if t == "chunked_attention" else window
            if w is None:
                raise ModelError(f"layer {i} is {t} but the config has no sliding_window")
            return SlidingWindowSpec(num_kv_heads=kv, head_size=hd, v_head_size=vd, sliding_window=int(w))
        return FullAttentionSpec(num_kv_heads=kv, head_size=hd, v_head_size=vd)

    for i, t in enumerate(types):
        t = t.lower()
        if t in _NONE_TYPES or (isinstance(sharing, (list, tuple)) and sharing[i] == "reuse"):
            specs.append(NoCacheSpec())
        elif t in _LINEAR_TYPES:
            specs.append(_mamba_spec(c, t))
        elif t in ("hybrid", "hybrid_sliding"):
            specs.append(
                HybridSpec(
                    attention=attention("sliding_attention" if t == "hybrid_sliding" else "full", i),
                    state=_mamba_spec(c, t),
                )
            )
        elif t in _SLIDING_TYPES or t in ("attention", "full_attention", "global", "global_attention"):
            specs.append(attention(t, i))
        else:
            raise ModelError(
                f"layer {i} has an unknown layer type {t!r}; ragbudget knows full/sliding/chunked "
                "attention, MLA and mamba/linear-attention/hybrid layers"
            )
    return tuple(specs)


# --------------------------------------------------------------------------------------------
# Bytes
# --------------------------------------------------------------------------------------------


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


def _dtype_for(config: ConfigLike, kv_dtype: str | None) -> tuple[str, int]:
    name = kv_dtype or model_dtype(config)
    return name, dtype_bits(name)


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
    return state + sz.batch_size * _ceil_bytes(spec.elements_per_token * held, sz.bits)


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
    meta = 2 * groups * _ceil_bytes(1, bits)
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
        + _ceil_bytes((k_per_token + v_per_token) * residual * batch_size, bits)
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
    name, bits = _dtype_for(config, kv_dtype)
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
        transient = copies * max(
            (batch_size * _ceil_bytes(s.elements_per_token * tokens, bits) for s in specs), default=0
        )
        return KVEstimate(sum(per), worst + transient, per, f"int{q.nbits}" if quant_backend != "fp8" else "fp8", cache)
    base = "static" if cache == "static" else "dynamic"
    per = tuple(_layer_bytes(s, tokens, sz, cache=base, peak=False, prefill_tokens=prefill_tokens) for s in specs)
    per_peak = tuple(_layer_bytes(s, tokens, sz, cache=base, peak=True, prefill_tokens=prefill_tokens) for s in specs)
    if cache == "offloaded":
        return _offloaded(
            specs, tokens, per, per_peak, sz, prefill_tokens, name, only_non_sliding=offload_only_non_sliding
        )
    return KVEstimate(sum(per), sum(per_peak), per, name, cache)


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
    **kwargs: Any,
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
    _, bits = _dtype_for(config, kv_dtype)
    total = 0
    for s in specs:
        attention = s.attention if isinstance(s, HybridSpec) else s
        if isinstance(attention, SlidingWindowSpec) and not include_sliding:
            continue
        total += s.elements_per_token
    return _ceil_bytes(total, bits)


# --------------------------------------------------------------------------------------------
# The paged cache of continuous batching
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PagedCacheLayout:
    """The one tensor transformers' continuous batching allocates for its KV cache
    (``transformers/generation/continuous_batching/cache.py``, ``PagedAttentionCache``).

    A *page* is ``page_size`` tokens of K and V for one layer; a *block* is one page of every
    layer (what ``num_blocks`` counts); the tensor is cut into *sectors*, each a whole number of
    blocks of every attention group (full and sliding layers are allocated separately), and two
    more sectors are trash for padding tokens. ``total_bytes`` is the tensor, exactly;
    ``capacity_tokens`` the tokens of full attention it holds for all requests together (a
    request takes whole pages: ``ceil(tokens / page_size)`` of them).
    """

    page_size: int
    groups: tuple[tuple[str, int], ...]  # (layer kind, number of layers)
    bytes_per_page: int
    bytes_per_block: int
    bytes_per_sector: int
    num_sectors: int
    kv_dtype: str

    @property
    def total_bytes(self) -> int:
        return (self.num_sectors + 2) * self.bytes_per_sector

    @property
    def num_blocks(self) -> int:
        """Whole-model blocks the data sectors hold (at least the ``num_blocks`` asked for)."""
        return self.num_sectors * self.bytes_per_sector // self.bytes_per_block

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.page_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks one request of ``tokens`` tokens (prompt + answer) takes."""
        return -(-tokens // self.page_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "page_size": self.page_size,
            "groups": [list(g) for g in self.groups],
            "bytes_per_page": self.bytes_per_page,
            "bytes_per_block": self.bytes_per_block,
            "bytes_per_sector": self.bytes_per_sector,
            "num_sectors": self.num_sectors,
            "num_blocks": self.num_blocks,
            "capacity_tokens": self.capacity_tokens,
            "total_bytes": self.total_bytes,
            "kv_dtype": self.kv_dtype,
        }


def paged_cache_layout(
    config: ConfigLike,
    *,
    num_blocks: int,
    page_size: int = 32,
    kv_dtype: str | None = None,
    normalize: bool = True,
) -> PagedCacheLayout:
    """The paged cache continuous batching allocates for ``num_blocks`` blocks of ``page_size``
    tokens (``kv_dtype``: the model's dtype, which the paged cache always uses).

    Only models whose layers are all full or sliding attention with equal K and V head sizes
    have one (transformers refuses the others); anything else is a
    :class:`~ragbudget.errors.ConfigError`.

    >>> cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
    ...        "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}
    >>> p = paged_cache_layout(cfg, num_blocks=10, page_size=16, normalize=False)
    >>> p.bytes_per_block, p.capacity_tokens, p.total_bytes   # 2 layers × K,V × 2 heads × 16 × 4 B × 16
    (8192, 160, 98304)
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ConfigError(f"num_blocks must be an integer >= 1; got {num_blocks!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 4:
        raise ConfigError(f"page_size must be an integer >= 4 (transformers' minimum); got {page_size!r}")
    specs = layer_specs(config, normalize=normalize)
    name, bits = _dtype_for(config, kv_dtype)
    counts: dict[str, int] = {}
    shapes = set()
    for i, s in enumerate(specs):
        # isinstance admits exactly full and sliding attention (the one subclass of full).
        if not isinstance(s, FullAttentionSpec) or s.head_size != s.v_head_size:
            raise ConfigError(
                f"layer {i} is {s.kind}: continuous batching's paged "
                "cache holds full and sliding attention layers with equal K and V head sizes only; "
                "generate without batching for this model (LocalBackend(batching=False))"
            )
        counts[s.kind] = counts.get(s.kind, 0) + 1
        shapes.add((s.num_kv_heads, s.head_size))
    if len(shapes) != 1:
        raise ConfigError(
            f"layers of different KV shapes {sorted(shapes)} cannot share a paged "
            "cache; generate without batching for this model"
        )
    ((heads, head_dim),) = shapes
    # K and V of page_size tokens for one layer (FullAttentionCacheAllocator.get_bytes_per_page).
    page = _ceil_bytes(2 * heads * head_dim * page_size, bits)
    group_blocks = [n * page for n in counts.values()]
    # A sector must split into whole blocks of every group, and stays 128-byte aligned.
    sector = math.lcm(*group_blocks, 128)
    block = len(specs) * page
    sectors = max(1, math.ceil(num_blocks * block / sector))
    return PagedCacheLayout(
        page_size=page_size,
        groups=tuple(counts.items()),
        bytes_per_page=page,
        bytes_per_block=block,
        bytes_per_sector=sector,
        num_sectors=sectors,
        kv_dtype=name,
    )
