"""What a question gets back: :class:`Answer` (the text, its citations and the full budget
report) and :class:`AnswerStream` (the same answer, piece by piece, from a worker thread).

:func:`build_answer` writes the report from the prompt that was sent, the plan it was budgeted
by (local memory or a served engine's figures) and the generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .citations import attribute
from .errors import ConfigError
from .evidence import DECLINED_TEXT, Evidence
from .generation.allowance import RequestPlan, plan_report

if TYPE_CHECKING:
    from .prompt.prompt import Prompt

__all__ = ["Answer", "AnswerStream", "build_answer", "cancelled_answer", "declined_answer"]


@dataclass(frozen=True)
class Answer:
    """A generated answer with its citations and the full account of how it was budgeted.

    ``sources[i]`` is citation ``[i + 1]`` in ``text``: ``{path, start, end, page, page_end,
    score}``. ``report`` holds ``budget`` (kv_bytes_per_token, context_tokens_allowed/used,
    prompt_tokens, max_new_tokens, ``context_limit`` — what capped the context: ``{"limit":
    "time", "tokens": …, "ttft_target_s": …}`` or ``{"limit": "context_tokens", …}`` or
    ``None`` —, …), ``plan`` (the memory plan), ``selection``, ``dropped``
    (every candidate not used, with its reason), ``oom_steps`` and ``timings``.
    """

    text: str
    sources: list[dict[str, Any]]
    report: dict[str, Any]
    finish_reason: str = "stop"

    @property
    def declined(self) -> bool:
        """Whether the question was declined without generating: no retrieved sentence reached the
        evidence floor (``report["evidence"]`` says by how much; :mod:`ragbudget.evidence`)."""
        return bool((self.report.get("evidence") or {}).get("declined"))

    def to_dict(self) -> dict[str, Any]:
        """The ``ask --json`` document: ``answer``, ``declined``, ``sources``, ``budget``,
        ``dropped``, ``finish_reason``, ``report``."""
        return {
            "answer": self.text,
            "declined": self.declined,
            "sources": self.sources,
            "budget": self.report.get("budget", {}),
            "dropped": self.report.get("dropped", []),
            "finish_reason": self.finish_reason,
            "report": {k: v for k, v in self.report.items() if k not in ("budget", "dropped")},
        }


@dataclass(frozen=True)
class _Cancelled:
    """What :func:`_answer` needs of a generation that never started."""

    max_new_tokens: int
    text: str = ""
    prompt_tokens: int = 0  # nothing reached the engine
    new_tokens: int = 0
    finish_reason: str = "cancelled"
    oom_steps: tuple[Any, ...] = ()


class AnswerStream:
    """The text of one answer as it is generated, from :meth:`Pipeline.stream` (``for piece in
    stream``) or :meth:`Pipeline.astream` (``async for piece in stream``).

    Generation runs in its own thread; ``answer`` holds the :class:`Answer` (sources, report)
    once the iteration has ended, and an error the request raised (a
    :class:`~ragbudget.errors.BudgetError`, say) is raised by the iteration. Leaving early —
    ``break``, an exception in the loop, ``close()``/``aclose()`` or the end of a
    ``with``/``async with`` block — cancels the request: it leaves the admission queue if it was
    waiting there, or stops at the next token and frees its KV reservation (as a disconnecting
    HTTP client does); ``answer`` then holds what was generated so far (``finish_reason
    "cancelled"``), and ``error`` an error the request raised after it was left.

    A ``for`` loop owns the stream: dropping its iterator (``next(iter(stream))``,
    ``itertools.islice``) cancels it too; to take pieces one at a time, call ``next(stream)``.
    After ``break`` in an ``async for``, the cancel runs in a task the event loop schedules;
    ``async with`` cancels before the block is left.

    >>> with rb.stream("How is the Project Leader elected?") as stream:  # doctest: +SKIP
    ...     for piece in stream:
    ...         print(piece, end="", flush=True)
    >>> stream.answer.sources                                          # doctest: +SKIP
    """

    def __init__(
        self,
        ask: Callable[..., Answer],
        question: str,
        options: dict[str, Any],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        from .relay import Relay

        self._relay: Relay[Answer] = Relay(
            lambda emit, cancel: ask(question, on_text=emit, cancel=cancel, **options),
            loop=loop,
            name="rb-stream",
        )

    @property
    def answer(self) -> Answer | None:
        """The :class:`Answer` once the request has returned (``None`` before, or after an error)."""
        return self._relay.result

    @property
    def error(self) -> BaseException | None:
        """An error the request raised that the iteration did not (it was left before the end)."""
        return self._relay.error

    @property
    def cancelled(self) -> bool:
        """Whether the stream was left before its end (the generation was told to stop)."""
        return self._relay.cancel.is_set()

    # -- sync --

    def __iter__(self) -> Iterator[str]:
        # A generator, not ``self``: a ``for`` loop left by ``break`` or an exception drops it,
        # and its ``finally`` cancels the generation then and there.
        if self._relay.loop is not None:
            raise ConfigError("this stream came from astream(): iterate it with `async for`")
        try:
            while True:
                try:
                    yield self._relay.next_piece()
                except StopIteration:
                    return
        finally:
            self.close()

    def __next__(self) -> str:
        if self._relay.loop is not None:
            raise ConfigError("this stream came from astream(): iterate it with `async for`")
        return self._relay.next_piece()

    def close(self) -> None:
        """Stop the generation (if it still runs) and wait for its thread to end."""
        self._relay.close()

    def __enter__(self) -> AnswerStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- async --

    def __aiter__(self) -> AsyncIterator[str]:
        if self._relay.loop is None:
            raise ConfigError("this stream came from stream(): iterate it with `for`")
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[str]:
        # As __iter__, but later: an ``async for`` left early has this generator finalized by a
        # task the event loop's async-generator hooks schedule, which then cancels.
        try:
            while True:
                try:
                    yield await self.__anext__()
                except StopAsyncIteration:
                    return
        finally:
            await self.aclose()

    async def __anext__(self) -> str:
        if self._relay.loop is None:
            raise ConfigError("this stream came from stream(): iterate it with `for`")
        return await self._relay.anext_piece()

    async def aclose(self) -> None:
        """Stop the generation (if it still runs) and wait for its thread without blocking the loop."""
        await self._relay.aclose()

    async def __aenter__(self) -> AnswerStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def build_answer(
    gen: Any,
    prompt: Prompt,
    plan: RequestPlan,
    reserved: int,
    timings: dict[str, float],
    cap: dict[str, Any] | None,
    *,
    sentence_vectors: str | None = None,
    index: dict[str, Any] | None = None,
    stages: Sequence[str] = (),
    evidence: Evidence | None = None,
    cite: bool = True,
) -> Answer:
    sel = prompt.selection
    sources = []
    for passage in prompt.passages:
        src = passage.sources[0].to_dict() if passage.sources else {}
        src["score"] = round(float(passage.score), 6)
        src["chunk_ids"] = list(passage.chunk_ids)
        src["duplicates"] = [s.to_dict() for s in passage.sources[1:]]
        if passage.spans:  # span packing: each sentence's exact place in its file
            src["spans"] = [
                sp.source.to_dict() if sp.source else {"chunk_id": sp.chunk_id, "start": sp.start, "end": sp.end}
                for sp in passage.spans
            ]
        sources.append(src)
    # The same budget keys wherever they mean the same thing; what only one kind of plan knows
    # (the local memory plan's bytes, or the engine's figures with sources and ages) besides.
    part = plan_report(plan, engine_prompt_tokens=gen.prompt_tokens)
    oom_steps = [s.to_dict() for s in gen.oom_steps] if part.oom_ladder else []
    budget = {
        **part.before,
        "max_context_tokens": plan.max_context_tokens,
        "max_prompt_tokens": plan.max_prompt_tokens,
        "context_tokens_allowed": sel.tokens_allowed,
        "context_tokens_used": sel.tokens_used,
        "context_tokens_cap": cap["tokens"] if cap else None,
        # What capped the context below the prompt allowance: "context_tokens" (asked for) or
        # "time" (the time-to-first-token target on a CPU), with its numbers; None: nothing did.
        "context_limit": cap,
        "fixed_prompt_tokens": prompt.fixed_tokens,
        "prompt_tokens": prompt.n_tokens,
        **part.after,
        "max_new_tokens": part.max_new_tokens,
        "new_tokens": gen.new_tokens,
        "kv_tokens_reserved": reserved,
        "limited_by": part.limited_by,
        "planned_by": part.planned_by,
        "fill": round(sel.fill, 4),
    }
    report = {
        "budget": budget,
        **part.entry,
        "selection": [p.to_dict() | {"text": None} for p in prompt.passages],
        "dropped": [d.to_dict() for d in sel.dropped],
        "pack": sel.pack,
        "spans_dropped": [s.to_dict() | {"text": None} for s in sel.spans_dropped],
        # Span packing's sentence vectors: "stored" (the index's, embedded at build time) or
        # "embedded at query time" (an index without them); None for whole chunks.
        "sentence_vectors": sentence_vectors if sel.pack == "spans" else None,
        "oom_steps": oom_steps,
        "timings": {k: round(v, 4) for k, v in timings.items()},
        "stages": list(stages),
        # The index generation the chunks come from (servers sharing a database index answer
        # across a re-index's commit: a client can tell which one each answer cites).
        "index": index,
        # How well the documents answer the question, against the floor it cleared.
        "evidence": evidence.to_dict() if evidence is not None else None,
    }
    # Citations checked against the passages and placed where the model left none
    # (ragbudget.citations); a cancelled or empty answer cites nothing, and an answer the caller's
    # stop strings ended gets nothing after its stop.
    citations = attribute(
        str(gen.text).strip(), [p.text for p in prompt.passages], question=prompt.question, place=cite
    )
    report["citations"] = citations.to_dict()
    return Answer(text=citations.text, sources=sources, report=report, finish_reason=str(gen.finish_reason))


def cancelled_answer(
    prompt: Prompt,
    plan: RequestPlan,
    reserved: int,
    timings: dict[str, float],
    cap: dict[str, Any] | None,
    max_new_tokens: int,
    *,
    sentence_vectors: str | None = None,
    index: dict[str, Any] | None = None,
    stages: Sequence[str] = (),
) -> Answer:
    """The answer of a request left before generation began (while queued, or just as it was
    admitted): no text, ``finish_reason "cancelled"``, and the report of what it would have been."""
    return build_answer(
        _Cancelled(max_new_tokens=max_new_tokens),
        prompt,
        plan,
        reserved,
        timings,
        cap,
        sentence_vectors=sentence_vectors,
        index=index,
        stages=stages,
    )


def declined_answer(
    evidence: Evidence,
    max_new_tokens: int,
    timings: dict[str, float],
    *,
    index: dict[str, Any] | None = None,
    stages: Sequence[str] = (),
) -> Answer:
    """The answer to a question the documents do not hold (``evidence.declined``): the fixed
    :data:`~ragbudget.evidence.DECLINED_TEXT`, no sources, and a report saying why — nothing was
    admitted or generated, so every token figure is 0."""
    budget = {
        "context_tokens_allowed": 0,
        "context_tokens_used": 0,
        "prompt_tokens": 0,
        "max_new_tokens": max_new_tokens,
        "new_tokens": 0,
        "kv_tokens_reserved": 0,
        "limited_by": "evidence",
        "planned_by": "the evidence floor (nothing generated)",
    }
    report: dict[str, Any] = {
        "budget": budget,
        "evidence": evidence.to_dict(),
        "selection": [],
        "dropped": [],
        "oom_steps": [],
        "timings": {k: round(v, 4) for k, v in timings.items()},
        "stages": list(stages),
        "index": index,
    }
    return Answer(text=DECLINED_TEXT, sources=[], report=report, finish_reason="stop")
