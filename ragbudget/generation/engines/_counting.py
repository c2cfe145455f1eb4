"""What served engines keep of their tokenizer's answers: :class:`LocalCounter`, the stated
local stand-in for engines that cannot count (Ollama, a generic OpenAI server), and the bounded
in-process memory :class:`~ragbudget.generation.engines._base.ServedBackend` keeps counts and
renders in.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from ..backend import RenderedPrompt

__all__ = ["BoundedLRU", "LocalCounter"]


class LocalCounter:
    """Counts for engines that cannot count (Ollama, a generic OpenAI server): a local tokenizer
    plus a stated safety ``margin`` (a fraction added to every count, rounded up).

    ``tokenizer``: ``None`` → tiktoken ``cl100k_base`` with a 15% margin (another model's
    vocabulary: Llama-family models count 3–30% differently); a Hugging Face tokenizer object or a
    local folder / hub id (loaded with transformers on first use) → that tokenizer, its chat
    template, and a 2% margin (the server may render the template differently).
    """

    def __init__(self, tokenizer: Any = None, *, margin: float | None = None) -> None:
        self._spec = tokenizer
        self._tok: Any = None
        self._hf: Any = None
        self.margin = margin if margin is not None else (0.15 if tokenizer is None else 0.02)
        self.name = (
            "tiktoken cl100k_base" if tokenizer is None else str(getattr(tokenizer, "name_or_path", None) or tokenizer)
        )
        #: What its counts are kept under (with the model): another tokenizer or margin counts
        #: differently, so counts made with one are never reused for the other.
        self.key = f"{self.name} +{self.margin:g}"

    def _load(self) -> Any:
        if self._tok is None:
            from ...tokens import HFTokenizer, get_tokenizer

            spec = self._spec
            if isinstance(spec, str):
                from transformers import AutoTokenizer

                spec = AutoTokenizer.from_pretrained(spec)
            self._tok = get_tokenizer(spec)
            if isinstance(self._tok, HFTokenizer):
                self._hf = self._tok.hf
        return self._tok

    def _pad(self, n: int) -> int:
        return math.ceil(n * (1 + self.margin))

    def count(self, texts: Sequence[str]) -> list[int]:
        tok = self._load()
        return [self._pad(tok.count(t)) for t in texts]

    def render(self, messages: Sequence[Mapping[str, str]]) -> RenderedPrompt:
        tok = self._load()
        msgs = tuple(dict(m) for m in messages)
        if self._hf is not None and getattr(self._hf, "chat_template", None):
            text = self._hf.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)
            n = len(self._hf.encode(text, add_special_tokens=False))
            how = f"local chat template of {self.name}"
        else:
            # No template known: content plus a generous 8 tokens per message for role markup.
            text = None
            n = sum(tok.count(m["content"]) + 8 for m in msgs) + 4
            how = f"local count with {self.name}, 8 tokens per message for the template"
        return RenderedPrompt(
            messages=msgs,
            n_tokens=self._pad(n),
            exact=False,
            text=text,
            source=f"{how}, +{self.margin:.0%} safety margin",
            margin=self.margin,
        )


class BoundedLRU:
    """A thread-safe least-recently-used map with a bound on its total ``size`` (an entry's
    size is 1 unless given): what a long-running server may keep in memory of an engine's
    answers without growing for ever."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._data: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            hit = self._data.get(key)
            if hit is None:
                return None
            self._data.move_to_end(key)
            return hit[0]

    def put(self, key: Any, value: Any, size: int = 1) -> None:
        if size > self.max_size:
            return  # would evict everything else
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._size -= old[1]
            self._data[key] = (value, size)
            self._size += size
            while self._size > self.max_size:
                _, (_, gone) = self._data.popitem(last=False)
                self._size -= gone

    def __len__(self) -> int:
        return len(self._data)
