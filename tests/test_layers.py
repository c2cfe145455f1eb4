"""Layer specs from a config alone: each family's layers, kinds and shapes, and the heuristics for
raw dicts against transformers' own normalization."""

from __future__ import annotations

import pytest
from _kv_archs import ARCHS, _as_dict, tiny_models

from ragbudget.memory.kvcache import kv_cache_bytes
from ragbudget.memory.layers import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec, layer_specs

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models():
    """Tiny randomly initialized models (tests/_kv_archs.py), built once per session."""
    return tiny_models()


@pytest.mark.parametrize("mt", list(ARCHS))
def test_heuristics_match_transformers_normalization(models, mt):
    cfg, _ = models[mt]
    d = _as_dict(mt, cfg)
    assert layer_specs(d, normalize=False) == layer_specs(d, normalize=True)


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
