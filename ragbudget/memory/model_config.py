"""A model's config read alike whether it is a dict (``config.json``, the shipped configs) or a
transformers ``PretrainedConfig``: the decoder's text config of a multimodal model, the dtype it
is stored in, and transformers' own per-family defaults where transformers knows the family.

Every estimate of the memory model (:mod:`~ragbudget.memory.layers`, :mod:`~ragbudget.memory.kvcache`,
:mod:`~ragbudget.memory.weights`, :mod:`~ragbudget.memory.budget`) reads its config through here.

>>> model_dtype({"text_config": {"num_hidden_layers": 2}, "torch_dtype": "bfloat16"})
'bfloat16'
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from ..types import DTYPE_BITS, dtype_bits

__all__ = ["ConfigLike", "ConfigView", "model_dtype", "normalize_config", "text_config"]

#: A config dict or a transformers config object (``Any``: transformers ships no usable types
#: for its config classes, and it is imported lazily).
ConfigLike = Mapping[str, Any] | Any


class ConfigView:
    """Uniform attribute access over a dict or a config object (missing → default)."""

    def __init__(self, obj: ConfigLike) -> None:
        self.obj = obj

    # Any: a field holds whatever the config's JSON or transformers' attribute holds; the callers
    # convert it (int(), str()) where they read it.
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
        value = ConfigView(cfg).get("dtype", "torch_dtype")
        if value is not None:
            name = str(value).removeprefix("torch.")
            if name in DTYPE_BITS:
                return name
    return default


@lru_cache(maxsize=64)
def _normalized_from_json(blob: str) -> ConfigLike:
    from transformers import AutoConfig  # lazy: heavy import

    d = json.loads(blob)
    model_type = d.pop("model_type")
    for k in ("architectures", "auto_map", "transformers_version", "_name_or_path"):
        d.pop(k, None)
    return AutoConfig.for_model(model_type, **d)


def normalize_config(config: ConfigLike, normalize: bool) -> ConfigLike:
    """Let transformers apply its per-family defaults (``layer_types``, ``head_dim``, windows) when
    it knows the model type; fall back to the raw dict (with ragbudget's own heuristics)."""
    if not normalize or not isinstance(config, Mapping) or "model_type" not in config:
        return text_config(config)
    try:
        obj = _normalized_from_json(json.dumps(dict(config), sort_keys=True, default=str))
    except Exception:  # noqa: BLE001 - unknown model type or a rejected dict: use heuristics
        return text_config(config)
    return text_config(obj)


def dtype_for(config: ConfigLike, kv_dtype: str | None) -> tuple[str, int]:
    """The KV cache's dtype name and bits: ``kv_dtype`` as given, else the model's."""
    name = kv_dtype or model_dtype(config)
    return name, dtype_bits(name)
