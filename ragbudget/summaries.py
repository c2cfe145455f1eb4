"""Conversation summaries: the record of a finished turn, the rolling summary written over
older turns (its prompt, and the extractive fallback when the generator writes nothing), and the
:class:`SummaryCache` that lets the requests of one server share them.

Split from :mod:`ragbudget.chat` along its seam: this is what a summary *is* and how it is kept,
with no pipeline or budget in it; :class:`~ragbudget.chat.Conversation` decides when to fold and
how much room a summary gets.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["SUMMARY_PREFIX", "Summarizer", "SummaryCache", "Turn", "extractive_summary", "summary_messages"]

Message = dict[str, str]

SUMMARY_PREFIX = "Summary of the earlier conversation: "

_SUMMARY_SYSTEM = (
    "You keep a running summary of a conversation between a user and an assistant that answers "
    "from documents. Write a short factual summary: the topics and names the user asked about and "
    "the key facts of the answers. No preamble."
)


@dataclass(frozen=True)
class Turn:
    """One finished exchange kept in memory: the question, the answer text, and what was
    retrieved for it."""

    question: str
    answer: str
    retrieval_query: str = ""


Summarizer = Callable[[str, Sequence[Turn], int], str]


class SummaryCache:
    """Rolling summaries of conversation prefixes, shared by the requests of one server.

    An HTTP client resends its whole history with every request, so without memory between
    requests each over-long one would summarize all of its older turns again. The cache maps a
    prefix (the summary it started from plus the turns folded into it, chained through SHA-256)
    to the summary written for it: the next request of the same conversation starts from the
    longest cached prefix and folds only the turns that are new, exactly as an in-memory
    :class:`Conversation` would, and a retried request costs no generation at all. A cached
    summary is the one that conversation, held in memory, would have at that point: written
    greedily by an earlier request, in the room that request had. One cut short by a client that
    left is never kept, and a summary cut to fit a request with less room than its writer's starts
    a chain of its own. Thread-safe; the least recently used of more than ``max_entries``
    summaries are forgotten.
    """

    def __init__(self, max_entries: int = 1024) -> None:
        if max_entries < 1:
            raise ConfigError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._data: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def root(summary: str, summary_max_tokens: int) -> str:
        """The key of a conversation before any fold: the summary it starts from (a client may
        send one back) and the summary's length cap."""
        return _digest("root", str(summary_max_tokens), summary)

    @staticmethod
    def extend(key: str, turn: Turn) -> str:
        """The key of the prefix ``key`` with ``turn`` folded in after it."""
        return _digest(key, turn.question, turn.answer)

    def get(self, key: str) -> str | None:
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
                self._data.move_to_end(key)
            return value

    def longest(self, keys: Sequence[str]) -> tuple[int, str] | None:
        """``(j, summary)`` for the longest cached ``keys[:j]`` (``keys[j - 1]`` cached), or
        None; one lookup in the hit/miss counts."""
        if not keys:
            return None
        with self._lock:
            for j in range(len(keys), 0, -1):
                value = self._data.get(keys[j - 1])
                if value is not None:
                    self.hits += 1
                    self._data.move_to_end(keys[j - 1])
                    return j, value
            self.misses += 1
            return None

    def put(self, key: str, summary: str) -> None:
        with self._lock:
            self._data[key] = summary
            self._data.move_to_end(key)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        # Length-prefixed, so ("ab", "c") and ("a", "bc") never collide.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def summary_messages(previous: str, lines: Sequence[str], cap: int) -> list[Message]:
    words = max(10, int(cap * 0.6))  # ~0.75 words per token, with slack so the cap rarely cuts
    user = ""
    if previous:
        user += f"Summary so far: {previous}\n\n"
    user += "New exchanges:\n" + "\n".join(lines)
    user += f"\n\nWrite the updated summary in at most {words} words."
    return [{"role": "system", "content": _SUMMARY_SYSTEM}, {"role": "user", "content": user}]


def extractive_summary(previous: str, turns: Sequence[Turn]) -> str:
    """Fallback summary when the generator produced nothing: the questions asked and the first
    sentence of each answer."""
    parts = [previous] if previous else []
    for t in turns:
        first = re.split(r"(?<=[.!?])\s", t.answer.strip(), maxsplit=1)[0] if t.answer.strip() else ""
        parts.append(f"Asked: {t.question.strip()} Answer: {first}".strip())
    return " ".join(parts)
