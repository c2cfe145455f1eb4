"""One frozen *spec* per decoder layer, from a model config alone (no weights): what the layer's
cache keeps, the idea of vLLM's ``kv_cache_interface.py``. Each spec knows how many elements it
stores per token, or per sequence for recurrent state:

* :class:`FullAttentionSpec`  — MHA / GQA / MQA, ``2 × kv_heads × head_dim`` per token;
* :class:`SlidingWindowSpec`  — the same, but at most a window of tokens at steady state;
* :class:`MLAAttentionSpec`   — DeepSeek-V2/V3 multi-head latent attention;
* :class:`MambaSpec`          — conv + SSM / linear-attention state, a constant per sequence;
* :class:`HybridSpec`         — attention and a recurrent mixer in the same layer (Falcon-H1);
* :class:`NoCacheSpec`        — layers that keep nothing (KV-sharing consumers, MLP-only layers).

:func:`layer_specs` reads every family's attribute names and layer patterns;
:mod:`ragbudget.memory.kvcache` sums the specs into bytes, and :mod:`ragbudget.memory.paged` lays
them out in continuous batching's paged cache.

What the specs model of transformers 5.x (read from ``transformers/cache_utils.py``):

* DeepSeek-V3 in transformers 5.x caches the compressed latent (``kv_lora_rank`` + ``qk_rope_head_dim``,
  one "head"), like vLLM / SGLang; transformers 4.x cached the decompressed per-head K and V
  (``mla="decompressed"`` models that).
* Recurrent layers (Mamba-1/2, Jamba, Bamba, Falcon-H1, Zamba/Zamba2, Nemotron-H, GraniteMoeHybrid,
  LFM2/LFM3 short convs, Qwen3-Next / Qwen3.5 / OLMo-Hybrid / Lara gated delta nets) keep a conv
  state in the model dtype and a float32 recurrent state (``LinearAttentionLayer``); ``hybrid``
  layers (Falcon-H1, Zamba's shared attention) keep both that state and growing K/V.

>>> [s.kind for s in layer_specs({"model_type": "jamba", "num_hidden_layers": 2, "hidden_size": 64,
...     "num_attention_heads": 4, "layer_types": ["mamba", "full_attention"]}, normalize=False)]
['mamba', 'full_attention']
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, ModelError
from ..settings import MemorySettings
from .model_config import ConfigLike, ConfigView, normalize_config

__all__ = [
    "FullAttentionSpec",
    "HybridSpec",
    "LayerSpec",
    "MLAAttentionSpec",
    "MambaSpec",
    "NoCacheSpec",
    "SlidingWindowSpec",
    "layer_specs",
]

#: The engines a cache layout is modelled for (vLLM and SGLang page it: see ``estimate_kv``).
BACKENDS = ("transformers", "vllm", "sglang")


def ceil_bytes(elements: int, bits: int) -> int:
    # Sub-byte dtypes pack several elements per byte; a partial byte still costs a whole one.
    return (elements * bits + 7) // 8


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
        cache: str = MemorySettings.cache,
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
        cache: str = MemorySettings.cache,
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
        cache: str = MemorySettings.cache,
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

    def tokens_held(self, tokens: int, **_: object) -> int:
        return 0  # no token slots (the cache's keywords do not matter)

    @property
    def state_elements(self) -> int:
        return self.conv_elements + self.ssm_elements

    def state_bytes(self, bits: int) -> int:
        ssm_bits = self.ssm_dtype_bits or bits
        return ceil_bytes(self.conv_elements, bits) + ceil_bytes(self.ssm_elements, ssm_bits)


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

    def tokens_held(
        self,
        tokens: int,
        *,
        cache: str = MemorySettings.cache,
        max_cache_len: int | None = None,
        peak: bool = False,
        prefill_tokens: int | None = None,
    ) -> int:
        return self.attention.tokens_held(
            tokens, cache=cache, max_cache_len=max_cache_len, peak=peak, prefill_tokens=prefill_tokens
        )

    def state_bytes(self, bits: int) -> int:
        return self.state.state_bytes(bits)


@dataclass(frozen=True)
class NoCacheSpec:
    """A layer that stores nothing (KV-sharing consumer, MLP/MoE-only layer)."""

    kind = "none"
    elements_per_token = 0
    state_elements = 0

    def tokens_held(self, tokens: int, **_: object) -> int:
        return 0  # no token slots (the cache's keywords do not matter)


LayerSpec = FullAttentionSpec | SlidingWindowSpec | MLAAttentionSpec | MambaSpec | HybridSpec | NoCacheSpec


def _attention_shape(c: ConfigView) -> tuple[int, int, int]:
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


def _num_layers(c: ConfigView) -> int:
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


def _default_layer_types(c: ConfigView, n: int) -> list[str]:
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
    c: ConfigView,
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


def _mamba_spec(c: ConfigView, layer_type: str) -> MambaSpec:
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
    cfg = normalize_config(config, normalize)
    c = ConfigView(cfg)
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
