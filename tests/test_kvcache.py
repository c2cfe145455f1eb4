"""KV-cache estimates against the tensors transformers' caches really hold (to the byte)."""

from __future__ import annotations

import pytest

from ragbudget.errors import ConfigError, ModelError
from ragbudget.memory.kvcache import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    dtype_bits,
    estimate_kv,
    kv_bytes_per_token,
    kv_cache_bytes,
    layer_specs,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WINDOW = 8
_BASE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_SMALL = {"vocab_size": 128, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# Tiny configs of real architectures; sizes chosen so head_dim != hidden/heads where the family
# allows it (Qwen3, Gemma) and windows are crossed by the longer prompts.
ARCHS: dict[str, dict] = {
    "llama": _BASE,
    "mistral": dict(_BASE, sliding_window=WINDOW),
    "qwen2": dict(_BASE),
    "qwen3": dict(_BASE, head_dim=24),
    "gemma2": dict(_BASE, head_dim=24, sliding_window=WINDOW),
    "gemma3_text": dict(_BASE, head_dim=24, sliding_window=WINDOW, num_hidden_layers=6, sliding_window_pattern=3),
    "phi3": dict(_BASE, sliding_window=WINDOW),
    "gpt2": dict(_SMALL, n_embd=64, n_layer=3, n_head=4, n_positions=256),
    "gpt_neox": dict(
        _SMALL,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=256,
    ),
    "falcon": dict(
        _SMALL,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        multi_query=True,
        new_decoder_architecture=False,
    ),
    "opt": dict(
        _SMALL,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=64,
    ),
    "bloom": dict(_SMALL, hidden_size=64, n_layer=3, n_head=4),
    "gptj": dict(_SMALL, n_embd=64, n_layer=3, n_head=4, rotary_dim=8, n_positions=256),
    "deepseek_v3": dict(
        _BASE,
        num_hidden_layers=3,
        num_key_value_heads=4,
        moe_intermediate_size=32,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    ),
    "gpt_oss": dict(_BASE, head_dim=16, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_next": dict(
        _BASE,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        full_attention_interval=2,
    ),
    # Recurrent and hybrid families: conv + SSM states (constant per sequence) next to K/V.
    "mamba": dict(_SMALL, hidden_size=64, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2),
    "falcon_mamba": dict(_SMALL, hidden_size=64, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2),
    "mamba2": dict(
        _SMALL,
        hidden_size=64,
        num_hidden_layers=2,
        state_size=8,
        conv_kernel=4,
        expand=2,
        num_heads=8,
        head_dim=16,
        n_groups=2,
        chunk_size=16,
    ),
    "jamba": dict(
        _BASE,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
    ),
    "bamba": dict(
        _BASE,
        attn_layer_indices=[1, 3],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
    ),
    "granitemoehybrid": dict(
        _BASE,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        shared_intermediate_size=64,
    ),
    # Falcon-H1: attention and Mamba-2 in every layer; d_ssm != expand × hidden.
    "falcon_h1": dict(
        _BASE,
        num_hidden_layers=3,
        mamba_d_ssm=96,
        mamba_n_heads=6,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        head_dim=16,
    ),
    # Zamba / Zamba2: shared attention blocks on "hybrid" layers, head_dim = 2 × hidden / heads.
    "zamba": dict(
        _BASE,
        num_hidden_layers=6,
        attn_layer_period=3,
        attn_layer_offset=2,
        n_mamba_heads=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        use_mamba_kernels=False,
    ),
    "zamba2": dict(
        _BASE,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_ngroups=2,
        mamba_headdim=16,
        n_mamba_heads=8,
        num_mem_blocks=1,
        use_mem_rope=True,
        chunk_size=16,
        adapter_rank=8,
    ),
    # Nemotron-H: attention head_dim (128) differs from the Mamba head dim (16); an MLP-only layer.
    "nemotron_h": dict(
        _BASE,
        hybrid_override_pattern="M*M-",
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=8,
        conv_kernel=4,
        expand=2,
        chunk_size=16,
    ),
    "lfm2": dict(
        _BASE, layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3, block_ff_dim=128
    ),
    "lfm2_moe": dict(
        _BASE,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        conv_L_cache=3,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        num_dense_layers=1,
    ),
    "olmo_hybrid": dict(
        _BASE,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    ),
    "qwen3_5_text": dict(
        _BASE,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    ),
    "lara_mini": dict(
        _BASE,
        head_dim=16,
        sliding_window=WINDOW,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
    ),
    "lfm3": dict(
        _BASE, head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "conv", "full_attention", "conv"]
    ),
}
RECURRENT = [
    "qwen3_next",
    "mamba",
    "falcon_mamba",
    "mamba2",
    "jamba",
    "bamba",
    "granitemoehybrid",
    "falcon_h1",
    "zamba",
    "zamba2",
    "nemotron_h",
    "lfm2",
    "lfm2_moe",
    "olmo_hybrid",
    "qwen3_5_text",
    "lara_mini",
    "lfm3",
]
SLIDING = ["mistral", "gemma2", "gemma3_text", "phi3", "gpt_oss"]


@pytest.fixture(scope="module")
def models():
    """Tiny randomly initialized models, built once per module (CPU, float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    built = {}
    for mt, kw in ARCHS.items():
        cfg = AutoConfig.for_model(mt, **kw)
        built[mt] = (cfg, AutoModelForCausalLM.from_config(cfg).eval())
    return built


def _leaves(obj):
    """Plain tensors inside a quantized state: quanto tensor subclasses are flattened, HQQ's
    ``(W_q, meta)`` and fp8's ``(data, scale)`` tuples walked (meta holds scale and zero)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            for name in obj.__tensor_flatten__()[0]:
                yield from _leaves(getattr(obj, name))
        else:
            yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _leaves(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _leaves(x)


def _tensors(cache):
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None:
                yield t
        for d in ("conv_states", "recurrent_states"):
            for t in (getattr(layer, d, None) or {}).values():
                if t is not None:
                    yield t
        for name in ("_quantized_keys", "_quantized_values"):
            yield from _leaves(getattr(layer, name, None))


def cache_nbytes(cache) -> int:
    """Bytes of every tensor the cache holds (logical sizes)."""
    return sum(t.nbytes for t in _tensors(cache))


def cache_storage_bytes(cache) -> int:
    """Bytes of the storages the cache pins (a view of a larger tensor pins all of it)."""
    seen = {}
    for t in _tensors(cache):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _generate(model, prompt: int, new: int, batch: int = 1, **kw):
    ids = torch.randint(3, 128, (batch, prompt))
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kw,
    )
    # transformers 5.x names it `cache` (`past_key_values` is a deprecated alias).
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def _as_dict(mt, cfg):
    return cfg.to_dict() | {"model_type": mt}


# Below and beyond the sliding window; recurrent families once (their state does not grow, and
# test_recurrent_state_is_constant covers the attention part's growth).
DYNAMIC_CASES = [(mt, p) for mt in ARCHS for p in ((13,) if mt in RECURRENT else (5, 13))]


@pytest.mark.parametrize(("mt", "prompt"), DYNAMIC_CASES)
def test_dynamic_cache_exact(models, mt, prompt):
    cfg, model = models[mt]
    new = 4
    cache = _generate(model, prompt, new, batch=2)
    tokens = prompt + new - 1  # the last generated token is never fed back
    measured = cache_nbytes(cache)
    assert kv_cache_bytes(cfg, tokens, batch_size=2, kv_dtype="float32") == measured
    assert kv_cache_bytes(_as_dict(mt, cfg), tokens, batch_size=2, kv_dtype="float32") == measured


@pytest.mark.parametrize(
    "mt", ["llama", "gemma2", "mistral", "qwen3", "deepseek_v3", "gpt_oss", "jamba", "falcon_h1", "zamba2", "lfm2"]
)
def test_static_cache_exact(models, mt):
    cfg, model = models[mt]
    prompt, new = 11, 3
    cache = _generate(model, prompt, new, cache_implementation="static")
    # generate() sizes the static cache to prompt + max_new_tokens - 1 (the last token is never fed).
    est = kv_cache_bytes(cfg, prompt + new - 1, kv_dtype="float32", cache="static", max_cache_len=prompt + new - 1)
    assert est == cache_nbytes(cache)


@pytest.mark.parametrize("mt", SLIDING)
def test_sliding_prefill_peak_pins_full_prompt(models, mt):
    """Right after an un-chunked prefill, sliding layers pin storage for the whole prompt."""
    cfg, model = models[mt]
    prompt = 3 * WINDOW
    ids = torch.randint(3, 128, (1, prompt))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    assert cache_storage_bytes(cache) == kv_cache_bytes(cfg, prompt, kv_dtype="float32", peak=True)
    assert cache_nbytes(cache) == kv_cache_bytes(cfg, prompt, kv_dtype="float32")
    assert cache_nbytes(cache) < cache_storage_bytes(cache)


def test_fp8_quantized_cache_exact(models):
    cfg, model = models["llama"]
    prompt, new = 9, 4
    cache = _generate(model, prompt, new, cache_implementation="quantized", cache_config={"backend": "fp8"})
    est = kv_cache_bytes(cfg, prompt + new - 1, cache="quantized", quant_backend="fp8")
    assert est == cache_nbytes(cache)


@pytest.fixture(scope="module")
def quanto():
    """optimum-quanto, with its CPU unpack kernel replaced by the library's own pure-torch
    reference (``optimum/quanto/library/unpack.py``): the C++ kernel is JIT-compiled with ninja on
    first use, which takes minutes on a small machine. Unpacking only dequantizes; the storage
    layout under test does not depend on it."""
    pytest.importorskip("optimum.quanto")
    from optimum.quanto.library.extensions.cpp import ext

    def unpack(packed, bits):
        return torch.cat([(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]).to(
            torch.uint8
        )

    saved = ext._lib
    if saved is None:
        ext._lib = type("PureTorchUnpack", (), {"unpack": staticmethod(unpack)})()
    yield
    ext._lib = saved


# (backend, nbits, axis_key/value, group): every packing of each backend, both grouping axes.
# quanto's axis -1 groups across batch × heads × tokens (4 × tokens here), hence the group of 4.
QUANT_CASES = [
    ("quanto", 2, 0, 16),
    ("quanto", 4, 0, 16),
    ("quanto", 4, -1, 4),
    ("hqq", 1, 0, 16),
    ("hqq", 2, 0, 16),
    ("hqq", 3, 0, 16),
    ("hqq", 4, 0, 16),
    ("hqq", 8, 0, 16),
    ("hqq", 4, 1, 16),
]
# (hqq 0.2.8 cannot dequantize its own 3-bit packing on axis 1 when the rows are not a multiple
# of 10, so that case is left out.)


@pytest.mark.parametrize(("backend", "nbits", "axis", "group"), QUANT_CASES)
@pytest.mark.parametrize("new", [7])
def test_quantized_cache_exact(models, request, backend, nbits, axis, group, new):
    """n-bit K/V + scales/zeros + the full-precision residual window, to the byte.

    6 decode tokens: the residual window (4) is flushed once, then holds 2 tokens."""
    if backend == "quanto":
        request.getfixturevalue("quanto")
    else:
        pytest.importorskip("hqq")
    cfg, model = models["llama"]
    prompt, residual = 9, 4
    cache = _generate(
        model,
        prompt,
        new,
        batch=2,
        cache_implementation="quantized",
        cache_config={
            "backend": backend,
            "nbits": nbits,
            "q_group_size": group,
            "residual_length": residual,
            "axis_key": axis,
            "axis_value": axis,
        },
    )
    est = kv_cache_bytes(
        cfg,
        prompt + new - 1,
        batch_size=2,
        kv_dtype="float32",
        cache="quantized",
        quant_backend=backend,
        nbits=nbits,
        q_group_size=group,
        residual_length=residual,
        q_axis=axis,
        prefill_tokens=prompt,
    )
    assert est == cache_nbytes(cache)
    assert est <= kv_cache_bytes(
        cfg,
        prompt + new - 1,
        batch_size=2,
        kv_dtype="float32",
        cache="quantized",
        quant_backend=backend,
        nbits=nbits,
        q_group_size=group,
        residual_length=residual,
        q_axis=axis,
        prefill_tokens=prompt,
        peak=True,
    )


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_quantized_cache_bf16_scales(models, request, backend):
    """Scales and zero-points are stored in the model dtype."""
    if backend == "quanto":
        request.getfixturevalue("quanto")
    else:
        pytest.importorskip("hqq")
    cfg, model = models["llama"]
    m16 = model.to(torch.bfloat16)
    try:
        cache = _generate(
            m16,
            7,
            4,
            cache_implementation="quantized",
            cache_config={"backend": backend, "nbits": 4, "q_group_size": 32, "residual_length": 2},
        )
        d = _as_dict("llama", cfg) | {"torch_dtype": "bfloat16"}
        assert kv_cache_bytes(
            d,
            10,
            cache="quantized",
            quant_backend=backend,
            nbits=4,
            q_group_size=32,
            residual_length=2,
            prefill_tokens=7,
        ) == cache_nbytes(cache)
    finally:
        model.to(torch.float32)


def test_quantized_cache_rejects_sliding_and_bad_bits():
    gemma = {
        "model_type": "gemma2",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "head_dim": 32,
        "sliding_window": 4,
    }
    with pytest.raises(ConfigError, match="full-attention"):
        kv_cache_bytes(gemma, 10, cache="quantized", normalize=False)
    with pytest.raises(ConfigError, match="bits"):
        kv_cache_bytes(LLAMA8B, 10, cache="quantized", quant_backend="quanto", nbits=3, normalize=False)
    with pytest.raises(ConfigError):
        kv_cache_bytes(LLAMA8B, 10, cache="quantized", quant_backend="int4", normalize=False)


def test_bf16_model_uses_config_dtype(models):
    cfg, model = models["qwen3"]
    m16 = model.to(torch.bfloat16)
    try:
        cache = _generate(m16, 7, 3)
        d = _as_dict("qwen3", cfg) | {"torch_dtype": "bfloat16"}
        assert kv_cache_bytes(d, 9) == cache_nbytes(cache)
    finally:
        model.to(torch.float32)


# One family per code path (Mamba-1, Mamba-2, hybrid, short conv, delta net): bf16 on CPU is slow.
@pytest.mark.parametrize("mt", ["mamba", "bamba", "falcon_h1", "lfm2", "olmo_hybrid"])
def test_bf16_recurrent_state_dtypes(models, mt):
    """Conv states follow the model dtype; gated-delta-net recurrent states stay float32."""
    cfg, model = models[mt]
    m16 = model.to(torch.bfloat16)
    try:
        cache = _generate(m16, 4, 2)  # bf16 scans are slow on CPU: keep it short
        d = _as_dict(mt, cfg) | {"torch_dtype": "bfloat16"}
        assert kv_cache_bytes(d, 5) == cache_nbytes(cache)
    finally:
        model.to(torch.float32)


@pytest.mark.parametrize("mt", RECURRENT)
def test_recurrent_state_is_constant(models, mt):
    """Only full-attention layers grow: the recurrent part is the same at every length."""
    cfg, _ = models[mt]
    specs = layer_specs(cfg)
    assert any(s.state_elements for s in specs)
    per_tok = kv_bytes_per_token(cfg, kv_dtype="float32")  # past every sliding window (8)
    assert kv_cache_bytes(cfg, 50, kv_dtype="float32") - kv_cache_bytes(cfg, 10, kv_dtype="float32") == 40 * per_tok


@pytest.mark.parametrize("mt", list(ARCHS))
def test_heuristics_match_transformers_normalization(models, mt):
    cfg, _ = models[mt]
    d = _as_dict(mt, cfg)
    assert layer_specs(d, normalize=False) == layer_specs(d, normalize=True)


def _cuda_cache_bytes(cache) -> int:
    """Device storage the cache pins (a sliding layer's view pins its whole concatenation)."""
    seen = {}
    for t in _tensors(cache):
        if t.device.type == "cuda":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.gpu
@pytest.mark.parametrize("mt", ["llama", "mistral", "jamba"])
def test_offloaded_cache_keeps_two_layers_in_flight(mt):
    """transformers' offloaded cache needs CUDA streams (``Cache.update`` calls
    ``torch.cuda.default_stream``), so this runs on a GPU only. Before each offloaded layer's
    update the next offloaded layer is prefetched and the updated one is sent back afterwards:
    the most the device holds is two offloaded layers plus the never-offloaded recurrent state;
    after ``generate`` the first offloaded layer (prefetched again) stays."""
    import inspect

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.cache_utils import Cache

    # The spy wraps `Cache.offload(layer_idx, only_non_sliding)`, the hook transformers 5.17 and
    # 5.24 both call per layer; a version without it cannot be measured this way.
    params = list(inspect.signature(getattr(Cache, "offload", lambda: None)).parameters)
    if params[:3] != ["self", "layer_idx", "only_non_sliding"]:
        pytest.skip(
            f"transformers {transformers.__version__} has no Cache.offload(layer_idx, "
            f"only_non_sliding) to spy on (found {params})"
        )
    kw = dict(ARCHS[mt], num_hidden_layers=8)
    cfg = AutoConfig.for_model(mt, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval().to("cuda")
    seen: list[int] = []
    original = Cache.offload

    def spy(self, layer_idx, only_non_sliding=True):
        seen.append(_cuda_cache_bytes(self))  # updated layer + prefetched next, before offload
        return original(self, layer_idx, only_non_sliding)

    Cache.offload = spy
    try:
        prompt, new = 13, 5
        ids = torch.randint(3, 128, (2, prompt), device="cuda")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
            cache_implementation="offloaded",
        )
    finally:
        Cache.offload = original
    torch.cuda.synchronize()
    est = estimate_kv(cfg, prompt + new - 1, batch_size=2, kv_dtype="float32", cache="offloaded", prefill_tokens=prompt)
    assert max(seen) == est.peak_bytes
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    assert _cuda_cache_bytes(cache) == est.steady_bytes
    assert cache_nbytes(cache) == kv_cache_bytes(cfg, prompt + new - 1, batch_size=2, kv_dtype="float32")


# ---- pure unit tests (no model) -------------------------------------------------------------

LLAMA8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}


def test_llama8b_bytes_per_token():
    # 2 (K,V) × 32 layers × 8 heads × 128 dims × 2 bytes = 128 KiB per token.
    assert kv_bytes_per_token(LLAMA8B, normalize=False) == 131072
    assert kv_cache_bytes(LLAMA8B, 1000, normalize=False) == 131072 * 1000
    assert kv_cache_bytes(LLAMA8B, 1000, kv_dtype="fp8", normalize=False) == 65536 * 1000


def test_specs_kinds():
    g = layer_specs(
        {
            "model_type": "gemma2",
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "head_dim": 32,
            "sliding_window": 4,
        },
        normalize=False,
    )
    assert g == (SlidingWindowSpec(4, 32, 32, sliding_window=4), FullAttentionSpec(4, 32, 32))
    ds = layer_specs(
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 1,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
        },
        normalize=False,
    )
    assert ds[0] == MLAAttentionSpec(512, 64, 128, 128, 4, latent=True)
    assert ds[0].elements_per_token == 576
    dec = layer_specs(
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 1,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
        },
        normalize=False,
        mla="decompressed",
    )
    assert dec[0].elements_per_token == 4 * (128 + 64 + 128)


def test_mamba_state_is_constant():
    cfg = {
        "model_type": "jamba",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "layer_types": ["mamba", "full_attention"],
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "torch_dtype": "float32",
    }
    specs = layer_specs(cfg, normalize=False)
    assert specs[0] == MambaSpec(conv_elements=128 * 4, ssm_elements=128 * 16, ssm_dtype_bits=32)
    a = kv_cache_bytes(cfg, 10, normalize=False)
    b = kv_cache_bytes(cfg, 20, normalize=False)
    assert b - a == 10 * 2 * 64 * 4  # only the attention layer grows


def test_static_and_offloaded_and_vllm_blocks():
    assert kv_cache_bytes(LLAMA8B, 10, cache="static", max_cache_len=100, normalize=False) == 131072 * 100
    est = estimate_kv(LLAMA8B, 100, cache="offloaded", normalize=False)
    assert est.peak_bytes == 2 * 4096 * 100  # two layers in flight
    assert est.steady_bytes == 4096 * 100  # the first layer, prefetched again after the last
    dec = estimate_kv(LLAMA8B, 100, cache="offloaded", prefill_tokens=60, normalize=False)
    assert dec.peak_bytes == 2 * 4096 * 100
    sw = {
        "model_type": "mistral",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 8,
        "torch_dtype": "float32",
    }
    per_tok = 2 * 2 * 16 * 4
    # End of a 13-token prefill: the last layer pins all 13 while the first comes back compact
    # (7); a decode step holds only 8 (view) + 7.
    assert (
        kv_cache_bytes(sw, 17, cache="offloaded", prefill_tokens=13, peak=True, normalize=False) == (13 + 7) * per_tok
    )
    assert kv_cache_bytes(sw, 17, cache="offloaded", prefill_tokens=5, peak=True, normalize=False) == (8 + 7) * per_tok
    assert kv_cache_bytes(sw, 17, cache="offloaded", prefill_tokens=13, normalize=False) == 7 * per_tok
    jamba = {
        "model_type": "jamba",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "layer_types": ["mamba", "full_attention"],
        "torch_dtype": "float32",
    }
    state = kv_cache_bytes(jamba, 0, normalize=False)
    assert state > 0  # the Mamba layer stays resident, the single attention layer is in flight
    assert kv_cache_bytes(jamba, 10, cache="offloaded", peak=True, normalize=False) == state + 10 * 2 * 4 * 16 * 4
    assert kv_cache_bytes(LLAMA8B, 17, backend="vllm", normalize=False) == 131072 * 32
    with pytest.raises(ConfigError):
        kv_cache_bytes(LLAMA8B, 200, cache="static", max_cache_len=100, normalize=False)


def test_text_config_nesting_and_errors():
    outer = {
        "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "gemma3_text",
            "num_hidden_layers": 6,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "sliding_window": 4,
        },
    }
    specs = layer_specs(outer, normalize=False)
    assert [s.kind for s in specs].count("full_attention") == 1
    assert kv_cache_bytes(outer, 2, normalize=False) == 6 * 2 * 32 * 2 * 2
    with pytest.raises(ModelError):
        layer_specs({"model_type": "x"}, normalize=False)
    with pytest.raises(ConfigError):
        dtype_bits("float7")
    with pytest.raises(ConfigError):
        kv_cache_bytes(LLAMA8B, 1, cache="paged", normalize=False)


# ---- the dtype a config-only estimate assumes: never below what transformers allocates ----------

_DT_BASE = dict(_BASE, num_hidden_layers=2)


@pytest.mark.parametrize(
    "given, load_dtype, expect",
    [
        ({}, None, torch.float32),  # no dtype anywhere: torch's default
        ({"dtype": "bfloat16"}, "auto", torch.bfloat16),  # the config's dtype, as "auto" reads it
        ({"torch_dtype": "float16"}, "auto", torch.float16),  # the deprecated spelling, same rule
        ({"torch_dtype": "bfloat16"}, torch.float32, torch.float32),  # a load-time dtype wins
    ],
)
def test_config_only_estimate_never_below_the_allocated_cache(given, load_dtype, expect, tmp_path):
    """``kv_cache_bytes(config)`` without ``kv_dtype`` must plan the dtype transformers really
    allocates (float32 when the config names none), and a load-time ``dtype`` is planned by
    passing it as ``kv_dtype`` — checked against the cache tensors of a real ``generate``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", **_DT_BASE)
    cfg.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    import json

    on_disk = json.loads((tmp_path / "config.json").read_text())
    on_disk.pop("dtype", None)
    on_disk.pop("torch_dtype", None)
    on_disk.update(given)
    (tmp_path / "config.json").write_text(json.dumps(on_disk))
    model.save_pretrained(tmp_path)  # weights in float32; the config decides what "auto" loads
    (tmp_path / "config.json").write_text(json.dumps(on_disk))
    kwargs = {} if load_dtype is None else {"dtype": load_dtype}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs).eval()
    assert loaded.dtype == expect
    ids = torch.randint(3, 128, (1, 9))
    out = loaded.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    planned_dtype = None if load_dtype in (None, "auto") else str(load_dtype).removeprefix("torch.")
    assert kv_cache_bytes(on_disk, 9 + 4 - 1, kv_dtype=planned_dtype) == cache_nbytes(cache)


# -- the paged cache of continuous batching ----------------------------------------------------
PAGED = ["llama", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "gpt_oss"]


def _paged_cache(cfg, *, num_blocks, page_size, dtype=None):
    """transformers' own PagedAttentionCache for ``cfg``, built as its continuous batching does."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    cb = ContinuousBatchingConfig(
        num_blocks=num_blocks, page_size=page_size, max_batch_tokens=64, max_memory_percent=0.5
    )
    return PagedAttentionCache(
        config=cfg,
        continuous_batching_config=cb,
        device="cpu",
        distributed_helper=DistributedHelper(None, None),
        dtype=dtype or torch.float32,
    )


@pytest.mark.parametrize("mt", PAGED)
@pytest.mark.parametrize(("num_blocks", "page_size"), [(1, 4), (7, 16), (40, 32)])
def test_paged_cache_exact(models, mt, num_blocks, page_size):
    from ragbudget.memory.kvcache import paged_cache_layout

    cfg, _ = models[mt]
    real = _paged_cache(cfg, num_blocks=num_blocks, page_size=page_size)
    layout = paged_cache_layout(cfg, num_blocks=num_blocks, page_size=page_size, kv_dtype="float32")
    assert layout.total_bytes == real.cache_tensor.nbytes  # block size × blocks, to the byte
    assert layout.bytes_per_sector == real.bytes_per_sector
    assert layout.num_blocks == real.num_blocks >= num_blocks
    assert layout.capacity_tokens == real.num_blocks * page_size
    # The same from the config dict alone (normalized through transformers).
    assert (
        paged_cache_layout(
            _as_dict(mt, cfg), num_blocks=num_blocks, page_size=page_size, kv_dtype="float32"
        ).total_bytes
        == real.cache_tensor.nbytes
    )


def test_paged_cache_bf16_and_refusals(models):
    from ragbudget.memory.kvcache import paged_cache_layout

    cfg, _ = models["gemma3_text"]
    real = _paged_cache(cfg, num_blocks=5, page_size=8, dtype=torch.bfloat16)
    assert (
        paged_cache_layout(cfg, num_blocks=5, page_size=8, kv_dtype="bfloat16").total_bytes == real.cache_tensor.nbytes
    )
    for mt in ("mamba", "deepseek_v3", "qwen3_next"):  # no paged cache for these layers
        with pytest.raises(ConfigError, match="paged"):
            paged_cache_layout(models[mt][0], num_blocks=4)
    with pytest.raises(ConfigError, match="num_blocks"):
        paged_cache_layout(models["llama"][0], num_blocks=0)
    with pytest.raises(ConfigError, match="page_size"):
        paged_cache_layout(models["llama"][0], num_blocks=4, page_size=2)
