"""A conversation's tokens, counted as the model will see them.

:class:`Meter` counts chat messages after the chat template, the tokens a history adds before a
question, and cuts a text to a count: what :class:`~ragbudget.chat.Conversation` fits its history
and its side requests (the summary, the follow-up's rewrite) by. Split from :mod:`ragbudget.chat`
along its seam: counting, with no policy of what to keep.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .generation.backend import Backend
    from .pipeline import Pipeline
    from .summaries import Turn

__all__ = ["Meter"]

Message = dict[str, str]


class Meter:
    """Token counts of chat messages after the chat template, by the pipeline's generation
    backend (:class:`~ragbudget.generation.backend.Backend`: the local model's own tokenizer, or the served
    engine's — exact where the engine counts, a stated estimate where it cannot) and its prompt
    builder: measuring with the builder *is* measuring the prompt the model will get (same system
    prompt, layout and template).
    """

    def __init__(self, pipeline: Pipeline) -> None:
        self.backend: Backend = pipeline.backend
        self._builder = pipeline.prompt_builder

    def fixed(self, question: str) -> int:
        """Prompt tokens of ``question`` with no history and no context: the part never cut (the
        prompt builder's own count: system prompt, sources wrapper, question, template)."""
        return int(self._builder.fixed_tokens(question))

    def count(self, text: str) -> int:
        """Tokens of ``text`` alone."""
        return int(self.backend.count([text])[0])

    def render(self, messages: Sequence[Message]) -> int:
        """Tokens of ``messages`` as the model sees them, with the generation prompt."""
        return int(self.backend.render(list(messages)).n_tokens)

    def cost(self, messages: Sequence[Message], question: str) -> int:
        """Exact tokens ``messages`` add when placed before ``question`` (0 for none)."""
        if not messages:
            return 0
        return int(self._builder.with_history(list(messages)).fixed_tokens(question)) - self.fixed(question)

    def truncate(self, text: str, max_tokens: int) -> str:
        """``text`` cut to at most ``max_tokens`` tokens (at a token boundary; whole text if it fits)."""
        if max_tokens <= 0:
            return ""
        # A token is rarely longer than 16 characters: when the first max_tokens * 16 characters
        # already hold more tokens than that, the cut lies inside them, and the search below
        # counts prefixes of that head instead of the whole text (a 100,000-character message
        # would otherwise be counted whole ~17 times).
        head = max_tokens * 16
        if len(text) > head and self.count(text[:head]) > max_tokens:
            text = text[:head]
        elif self.count(text) <= max_tokens:
            return text
        # At a word boundary: the protocol counts, it does not decode (a served engine's ids are
        # not ours to decode), and a word prefix keeps the text readable.
        words = text.split()
        lo, hi = 0, len(words)  # largest word prefix that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count(" ".join(words[:mid])) <= max_tokens:
                lo = mid
            else:
                hi = mid - 1
        return " ".join(words[:lo])

    def exchanges(
        self,
        turns: Sequence[Turn],
        build: Callable[[list[str]], list[Message]],
        room: int,
        *,
        check: Callable[[], None] = lambda: None,
    ) -> tuple[list[Message], int]:
        """The prompt ``build(lines)`` makes of the newest of ``turns`` that fit ``room`` tokens
        (at least one exchange: the caller compares the count with the room), and its tokens.
        Each exchange is cut short ("User: " 192 tokens, "Assistant: " 96): a summary or a
        rewrite needs their gist, not their length. ``check`` is called between counts (it
        raises to stop)."""
        # Walking back from the newest and stopping once the room is full, older turns are never
        # counted (counting every turn of a 10,000-message history and dropping the oldest two
        # lines at a time took minutes).
        pairs: list[tuple[str, str]] = []
        used = self.render(build([]))
        for t in reversed(turns):
            check()
            pair = (f"User: {self.truncate(t.question, 192)}", f"Assistant: {self.truncate(t.answer, 96)}")
            pairs.append(pair)
            used += self.count(pair[0]) + self.count(pair[1]) + 2  # a newline each
            if used > room:
                break
        pairs.reverse()

        def lines_of(k: int) -> list[str]:
            return [line for pair in pairs[len(pairs) - k :] for line in pair]

        # The estimate above is close: the exact render decides, by bisection on the exchanges kept.
        lo, hi = 1, len(pairs)
        while lo < hi:
            check()
            mid = (lo + hi + 1) // 2
            if self.render(build(lines_of(mid))) <= room:
                lo = mid
            else:
                hi = mid - 1
        messages = build(lines_of(lo))
        return messages, self.render(messages)
