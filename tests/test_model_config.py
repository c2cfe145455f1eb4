"""A model config read alike as a dict or a transformers config: the decoder's text config, its
dtype, and the errors a config without an attention shape gives."""

from __future__ import annotations

import pytest
from _kv_archs import LLAMA8B

from ragbudget.errors import ConfigError, ModelError
from ragbudget.memory.kvcache import kv_cache_bytes
from ragbudget.memory.layers import layer_specs
from ragbudget.memory.model_config import ConfigView, model_dtype, normalize_config, text_config
from ragbudget.types import dtype_bits


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


def test_text_config_of_multimodal_dicts_and_config_objects():
    # The decoder config sits under one of three keys; the outer dtype carries over when the inner
    # one has none, and an inner dtype wins.
    for key in ("text_config", "language_config", "llm_config"):
        assert text_config({"dtype": "float16", key: {"hidden_size": 8}}) == {"hidden_size": 8, "dtype": "float16"}
    inner = {"text_config": {"hidden_size": 8, "torch_dtype": "bfloat16"}, "torch_dtype": "float16"}
    assert model_dtype(inner) == "float16"  # the outer config is read first, as transformers does
    assert text_config(inner)["torch_dtype"] == "bfloat16"
    assert text_config({"text_config": {}, "hidden_size": 8}) == {"text_config": {}, "hidden_size": 8}

    class Multimodal:  # transformers' get_text_config, with and without the decoder keyword
        def get_text_config(self, decoder: bool = False) -> str:
            return f"decoder={decoder}"

    class OldMultimodal:
        def get_text_config(self) -> str:
            return "old"

    assert text_config(Multimodal()) == "decoder=True"
    assert text_config(OldMultimodal()) == "old"


def test_model_dtype_names_and_the_float32_fallback():
    assert model_dtype({"torch_dtype": "torch.bfloat16"}) == "bfloat16"
    assert model_dtype({"dtype": "not-a-dtype"}) == "float32"  # unknown: what transformers allocates
    assert model_dtype({}, default="") == ""


def test_a_config_object_that_raises_on_unknown_attributes_reads_as_missing():
    class Strict:
        hidden_size = 64

        def __getattr__(self, name: str) -> object:
            raise KeyError(name)  # some remote-code configs raise anything but AttributeError

    assert ConfigView(Strict()).get("n_embd", "hidden_size") == 64
    assert ConfigView(Strict()).get("n_embd", default=7) == 7


def test_normalize_lets_transformers_fill_in_a_known_family_and_keeps_an_unknown_one():
    pytest.importorskip("transformers")
    raw = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    assert ConfigView(normalize_config(raw, True)).get("head_dim") == 128  # Qwen3's own default, not 64 / 4
    assert normalize_config(raw, False) == raw
    unknown = {"model_type": "no-such-family", "hidden_size": 64}
    assert normalize_config(unknown, True) == unknown
