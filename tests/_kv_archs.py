"""Tiny configs of real architectures for the memory model's tests (KV bytes, layer specs, the
paged cache), and the randomly initialized models built from them once per session."""

from __future__ import annotations

import functools
from typing import Any

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


#: Llama-3.1-8B's attention shape: 2 (K,V) × 32 layers × 8 heads × 128 dims × 2 bytes per token.
LLAMA8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}


@functools.cache
def tiny_models() -> dict[str, tuple[Any, Any]]:
    """``{model_type: (config, model)}``: every ARCHS model, randomly initialized (CPU, float32),
    built once per session (tests/test_kvcache.py, test_layers.py and test_paged.py share them)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    built = {}
    for mt, kw in ARCHS.items():
        cfg = AutoConfig.for_model(mt, **kw)
        built[mt] = (cfg, AutoModelForCausalLM.from_config(cfg).eval())
    return built


def _as_dict(mt, cfg):
    return cfg.to_dict() | {"model_type": mt}
