"""One request's context on its way through the stages: what it asked, the capacity read once,
the plan it is budgeted by, the stages it went through in order and how long each took.

``Pipeline.ask`` makes one per question and fills it as the question walks search → plan → pack →
render → admit → generate → answer; each stage reads what the earlier ones left here instead of
asking again (the capacity is read once, the fixed part of the prompt counted once). It belongs
to one request and one thread, so it is a plain mutable record, not a shared one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .generation.allowance import RequestPlan
    from .generation.backend import Capacity

__all__ = ["STAGES", "RequestContext"]

#: A question's stages, in the order it walks them (``pack`` and ``render`` again only when a
#: render came out over the allowance, ``answer`` without ``generate`` when it is declined).
STAGES = ("search", "plan", "pack", "render", "admit", "generate", "answer")


@dataclass(kw_only=True)
class RequestContext:
    """What one request carries from stage to stage (see the module docstring)."""

    question: str
    #: What the search was made with (the question, or a rewritten retrieval query).
    query: str
    max_new_tokens: int
    #: The source patterns the search is scoped to (:mod:`ragbudget.retrieval.scope`), if any.
    sources: tuple[str, ...] | None = None
    #: The backend's capacity record, read once in the ``plan`` stage.
    capacity: Capacity | None = None
    #: The plan the request is budgeted by (a memory plan locally, the engine's figures served).
    plan: RequestPlan | None = None
    #: Tokens of the prompt without passages (template, system prompt, history, question).
    fixed_tokens: int | None = None
    #: The cap set on the context (``context_tokens`` asked, or the time target), if any.
    limit: dict[str, Any] | None = None
    #: Each stage as it started, in order.
    stages: list[str] = field(default_factory=list)
    #: Seconds per step (``retrieve_s``, ``plan_s``, ``select_s``, ``queue_s``, ``generate_s``, …).
    timings: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def enter(self, stage: str) -> None:
        """``stage`` begins (recorded in :attr:`stages`)."""
        self.stages.append(stage)

    @contextmanager
    def timed(self, stage: str | None, key: str) -> Iterator[None]:
        """Enter ``stage`` (``None``: a step of the stage entered last) and record the block's
        seconds under ``timings[key]``."""
        if stage is not None:
            self.enter(stage)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[key] = time.perf_counter() - t0

    def finish(self) -> dict[str, float]:
        """The timings with ``total_s`` since the request began."""
        self.timings["total_s"] = time.perf_counter() - self.started
        return self.timings
