"""The paged cache of continuous batching, to the byte against transformers' own
``PagedAttentionCache``."""

from __future__ import annotations

import pytest
from _kv_archs import _as_dict, tiny_models

from ragbudget.errors import ConfigError
from ragbudget.memory.paged import paged_cache_layout

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models():
    """Tiny randomly initialized models (tests/_kv_archs.py), built once per session."""
    return tiny_models()


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
