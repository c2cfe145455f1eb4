"""The paged KV cache of continuous batching (transformers' ``PagedAttentionCache``), exactly:
one flat byte tensor allocated up front, whatever the requests — ``num_blocks`` blocks of
``page_size`` tokens of every layer, rounded up to whole *sectors* (the least common multiple of
each attention group's block and 128 bytes), plus two trash sectors that padding tokens read and
write. Its bytes are resident from the start, so the admission model counts a request's KV in
pages of it rather than in bytes (:meth:`ragbudget.memory.budget.request_memory`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .layers import FullAttentionSpec, ceil_bytes, layer_specs
from .model_config import ConfigLike, dtype_for

__all__ = ["PagedCacheLayout", "paged_cache_layout"]


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
    name, bits = dtype_for(config, kv_dtype)
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
    page = ceil_bytes(2 * heads * head_dim * page_size, bits)
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
