"""What one request of a pipeline may hold, and the admission control sized from it: the plan a
request is budgeted by and the gate it waits at, as the backend's capacity record says.

:class:`Planning` is the half of :class:`~ragbudget.pipeline.Pipeline` that asks the backend —
its :class:`~ragbudget.generation.backend.Capacity` record (with a memory plan where ragbudget
plans the memory, an engine's figures otherwise), what it adds to admission control, its speed —
and never which kind of backend it is; the pipeline runs the stages around it (index, retrieval,
selection, generation). Split from the pipeline along that seam: what decides the numbers here,
what uses them there.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .errors import ConfigError
from .generation.allowance import UNLIMITED_TOKENS, EnginePlan, RequestPlan, admission_size, request_plan
from .settings import MemorySettings, QueueSettings, check_int

if TYPE_CHECKING:
    from .generation.backend import Backend
    from .memory.admission import AdmissionController
    from .memory.budget import BudgetPlan
    from .prompt.prompt import PromptBuilder

__all__ = ["Planning"]

log = logging.getLogger("ragbudget.pipeline")


class Planning(abc.ABC):
    """The plans and admission control of a :class:`~ragbudget.pipeline.Pipeline` (its base). It
    keeps its own state — the prompt builder and the admission controller, made on first use,
    under a lock of its own — and asks the pipeline for two things only: :attr:`backend` (built or
    connected on first use) and :meth:`backend_if_ready` (the one there is, connecting to nothing)."""

    def __init__(self, *, memory: MemorySettings, queue: QueueSettings, system_prompt: str | None) -> None:
        self.memory = memory
        self.queue = queue
        self.system_prompt = system_prompt
        self._planning_lock = threading.RLock()
        self._builder: PromptBuilder | None = None
        self._admission: AdmissionController | None = None
        self._admission_tuned = False

    @property
    @abc.abstractmethod
    def backend(self) -> Backend:
        """What generates (the pipeline builds or connects it)."""

    @abc.abstractmethod
    def backend_if_ready(self) -> Backend | None:
        """The backend when one is built or connected already, else ``None``; connects to nothing."""

    @property
    def builder_ready(self) -> bool:
        """Whether :attr:`prompt_builder` was made (a local model is loaded by then)."""
        return self._builder is not None

    @property
    def served(self) -> bool:
        """Whether generation runs on an engine that holds its own memory and reports it (its
        capacity has no memory plan: :meth:`engine_plan` applies, not :meth:`plan_for`). Asked of
        the backend; an engine not connected yet is one without connecting."""
        backend = self.backend_if_ready()
        if backend is None:
            return True  # only an engine (engine=) is connected to on first use
        return not backend.capacity(max_new_tokens=self.memory.max_new_tokens).memory_planned

    # -- plans --------------------------------------------------------------------------------------

    def request_plan(
        self, max_new_tokens: int | None = None, *, question: str = "", history: Sequence[dict[str, str]] | None = None
    ) -> RequestPlan:
        """The plan one request reserving ``max_new_tokens`` (default: the pipeline's) is budgeted
        by now: the memory plan where ragbudget plans the backend's memory (the local generator,
        :meth:`plan_for`), else the engine's figures with what they leave after the template,
        system prompt, ``history`` and ``question`` (:meth:`engine_plan`)."""
        new_tokens = self.memory.max_new_tokens if max_new_tokens is None else max_new_tokens
        check_int("max_new_tokens", new_tokens, 1)
        backend = self.backend
        return request_plan(
            backend,
            backend.capacity(max_new_tokens=new_tokens),
            max_new_tokens=new_tokens,
            overhead=lambda: self.prompt_builder.with_history(history).fixed_tokens(question),
        )

    def engine_plan(
        self, max_new_tokens: int | None = None, *, question: str = "", history: Sequence[dict[str, str]] | None = None
    ) -> EnginePlan:
        """The served engine's allowance for one request now: its capacity (each figure with
        source and age) and the context tokens left after the template, system prompt,
        ``history``, ``question`` and ``max_new_tokens`` (default: the pipeline's)."""
        plan = self.request_plan(max_new_tokens, question=question, history=history)
        if not isinstance(plan, EnginePlan):
            raise ConfigError(
                "engine_plan() is for a pipeline on a served engine; a local one plans from memory: use plan_for()"
            )
        return plan

    @property
    def plan(self) -> BudgetPlan:
        """The memory plan for the configured ``max_new_tokens``."""
        return self.plan_for(self.memory.max_new_tokens)

    def plan_for(self, max_new_tokens: int) -> BudgetPlan:
        """The memory plan reserving ``max_new_tokens`` (the backend keeps one per value). Where
        ragbudget plans the memory only: a pipeline on a served engine plans from the engine's
        figures (:meth:`engine_plan`)."""
        plan = self.backend.capacity(max_new_tokens=max_new_tokens).plan
        if plan is None:
            raise ConfigError(
                "a pipeline on a served engine has no memory plan; its allowance "
                "comes from the engine's own figures: use engine_plan()"
            )
        return plan

    #: What :meth:`calibrate` asks: any index has an answer to it.

    #: Seconds between two looks at whether a provisional speed can be measured again.
    SPEED_RECHECK_S = 30.0

    def refresh_speed(self) -> bool:
        """Measure the prefill and decode speed again when the one in use was taken on a busy
        host (``provisional``) and both the host and this pipeline are idle now; then plan
        again (the time cap) and give admission the new speed. True when it measured.

        A server measures at warm-up, often while the host is busy: without this, a speed
        several times too slow would cap every context and size every Retry-After for the
        server's life. The backend looks at most every :attr:`SPEED_RECHECK_S` seconds, and
        measures only with nothing running or queued (a few seconds, paid by the request that
        finds the host idle), so requests never compete with the probe. A backend that measures
        nothing (an engine) never does."""
        backend = self.backend_if_ready()
        if backend is None:  # not connected yet: nothing was measured
            return False
        with self._planning_lock:
            ctl = self._admission

            def idle() -> bool:
                s = ctl.stats() if ctl is not None else None
                return s is None or not (s.running or s.queued)

            if not backend.refresh_speed(idle=idle, recheck_s=self.SPEED_RECHECK_S):
                return False
            if ctl is not None and self._admission_tuned:
                backend.tune(ctl)
        return True

    @property
    def admission(self) -> AdmissionController:
        """Admission control sized from the backend's capacity (shared by all threads): the
        memory plan's KV capacity, or on a served engine the KV tokens it reports, else its
        window × request slots; an engine that reports neither is not limited here (fail open —
        the engine queues and refuses itself). The backend then adds what it knows of a
        request's cost beyond its KV tokens (the local model's activations and measured speed,
        once it is loaded)."""
        with self._planning_lock:
            if self._admission is None:
                from .memory.admission import AdmissionController

                self._admission = AdmissionController(
                    self._admission_tokens(),
                    max_queue=self.queue.size,
                    timeout=self.queue.timeout,
                )
            if not self._admission_tuned:
                self._admission_tuned = self.backend.tune(self._admission)
            return self._admission

    def admission_estimate(self, max_new_tokens: int | None = None) -> tuple[int, int]:
        """``(tokens, prompt_tokens)`` a request is expected to reserve, known before its prompt
        is built: the prompt one request may hold (the plan's allowance, capped for time on a
        CPU; an engine's window) and the answer. For a cheap look at admission (the server's
        early 429) — the real prompt, usually shorter, is what :meth:`ask` reserves."""
        new = self.memory.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        window = self.backend.capacity(max_new_tokens=new).max_context_tokens or new
        prompt = max(0, window - new)
        return prompt + new, prompt

    def _admission_tokens(self) -> int:
        tokens, note = admission_size(self.backend.capacity(max_new_tokens=self.memory.max_new_tokens))
        if tokens == UNLIMITED_TOKENS:
            log.warning("%s", note)
        return tokens

    def admission_note(self) -> str:
        """What admission control is sized from, in one line (``serve`` logs it)."""
        note = admission_size(self.backend.capacity(max_new_tokens=self.memory.max_new_tokens))[1]
        ctl = self.admission
        parts = [note]
        if ctl.memory is not None:
            gib = ctl.memory.capacity_bytes / 2**30
            parts = [f"KV + activations per request in {gib:.2f} GiB ({ctl.memory.source})"]
        if ctl.throughput is not None:
            t = ctl.throughput
            parts.append(
                f"time: prefill {t.prefill_a * 1e3:.2f} ms/token, decode "
                f"{t.decode_s * 1e3:.1f} ms/token ({t.source}); first token within "
                f"the queue time-out {self.queue.timeout:g} s, started next to "
                "others only within the TTFT target "
                f"{ctl.ttft_target if ctl.ttft_target is not None else 'none'}"
            )
        return "; ".join(parts)

    @property
    def prompt_builder(self) -> PromptBuilder:
        """The builder that renders and counts this pipeline's prompts as its backend will see
        them (the local model's tokenizer, or the engine's)."""
        with self._planning_lock:
            if self._builder is None:
                self._builder = self.backend.prompt_builder(self.system_prompt)
            return self._builder
