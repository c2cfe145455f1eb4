"""Any other OpenAI-compatible server: the window from ``context_tokens`` (CLI
``--context-tokens``) or the model card, counts from a local tokenizer (``tokenizer=``, CLI
``--tokenizer NAME_OR_PATH``) with a stated safety margin, no KV figures.

The model card is ``GET /v1/models``; ``data[].max_model_len`` is read where present (the field
vLLM and SGLang publish: ``ModelCard`` in ``vllm/entrypoints/openai/engine/protocol.py`` and
``python/sglang/srt/entrypoints/openai/protocol.py``). Errors follow the OpenAI shape
``{"error": {"message", "type", "param", "code"}}``; without a tokenize route a 400 is taken for
a too-long prompt only when the local estimate agrees it does not fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..backend import Capacity, RenderedPrompt
from ._base import ServedBackend, int_or_none
from ._counting import LocalCounter

__all__ = ["OpenAIBackend"]


class OpenAIBackend(ServedBackend):
    """A generic OpenAI-compatible chat server."""

    kind = "openai"
    takes_tokenizer = True

    def __init__(self, http: Any, *, tokenizer: Any = None, **kw: Any) -> None:
        super().__init__(http, **kw)
        self.counter = LocalCounter(tokenizer)

    @property
    def count_key(self) -> str:
        # Counted by the local stand-in, not the engine: kept under both (see LocalCounter.key).
        return f"{self.model_id} @ {self.counter.key}"

    def engine_count(self, texts: list[str]) -> list[int]:
        return self.counter.count(texts)

    def engine_render(self, messages: Sequence[Mapping[str, str]]) -> RenderedPrompt:
        return self.counter.render(messages)

    def engine_capacity(self) -> Capacity:
        window, src = None, ""
        data = self.http.get("/v1/models").data
        for card in (data or {}).get("data", []) if isinstance(data, Mapping) else []:
            if card.get("id") == self.model_id:
                window = int_or_none(card.get("max_model_len"))
                src = "GET /v1/models max_model_len" if window is not None else ""
        notes: tuple[str, ...] = (
            f"token counts are local estimates ({self.counter.name}, "
            f"+{self.counter.margin:.0%} margin): the server has no tokenize route",
        )
        if window is None and self.context_tokens is None:
            notes += ("the server does not say its context length: pass context_tokens (--engine-context-tokens)",)
        return Capacity(max_context_tokens=window, max_context_source=src, engine_kind=self.kind, notes=notes)
