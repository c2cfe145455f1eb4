"""How fast the local generator runs on this host, and what follows from it.

The prefill and decode speed is measured once per model and machine
(:func:`~ragbudget.memory.calibration.measure_prefill_speed`, cached in ``cache_dir()/prefill.json``). From it
:class:`Pacing` gives the time-to-first-token target in force (``ttft_target``, else
:data:`~ragbudget.memory.calibration.CPU_TTFT_TARGET` on a CPU and none on an accelerator), the memory plan
capped for that target, and admission control's memory and time rules
(:meth:`~ragbudget.memory.admission.AdmissionController.configure`). A speed measured on a busy host is
``provisional``: :meth:`Pacing.due` says when to look again.
:class:`~ragbudget.generation.local.LocalBackend` holds one per local generator.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..memory.admission import AdmissionController
    from ..memory.budget import BudgetPlan
    from ..memory.kvcache import PagedCacheLayout

__all__ = ["Pacing"]

log = logging.getLogger("ragbudget.pipeline")


class Pacing:
    """The measured speed of one pipeline's generator and the time rules drawn from it.

    ``ttft_target``: seconds of prefill a request may take (``None``: the default for the
    device; 0: no target). ``entry`` is the speed in use (``{"a", "b", "decode_s", …}``, as
    :func:`~ragbudget.memory.calibration.lookup_prefill_speed` records it), ``None`` before it is known.
    """

    def __init__(self, ttft_target: float | None) -> None:
        self.ttft_target = ttft_target
        self.entry: dict[str, Any] | None = None
        self._checked = float("-inf")

    @staticmethod
    def device(gen: Any) -> str:
        """The generator's device when known without loading a model: a loaded generator's, or
        a stand-in's (which has no model to load); ``""`` otherwise."""
        if gen is None:
            return ""
        from .generate import Generator

        if isinstance(gen, Generator) and not gen.loaded:
            return ""
        return str(gen.device or "")

    def target(self, gen: Any) -> float | None:
        """The time-to-first-token target in force: ``ttft_target`` when given (0: none), else
        ``CPU_TTFT_TARGET`` for a generator on the CPU and none on an accelerator; ``None`` too
        while the generator's device is not known without loading it."""
        from ..memory.calibration import CPU_TTFT_TARGET

        device = self.device(gen)
        if not device:
            return None
        if self.ttft_target is not None:
            return self.ttft_target or None
        return CPU_TTFT_TARGET if device == "cpu" else None

    def measure(self, gen: Any, name: str) -> dict[str, Any] | None:
        """The generator's prefill and decode speed on its device: recorded once per model and
        machine, measured now when missing (a few seconds; ``serve`` does it at warm-up).
        ``None`` when there is nothing to measure."""
        from ..memory.calibration import lookup_prefill_speed, measure_prefill_speed
        from .batching import in_own_thread

        device = self.device(gen)
        if not device:
            return None
        speed = lookup_prefill_speed(name, device)
        model = gen.model if gen is not None else None
        if (speed is None or "decode_s" not in speed) and model is not None:
            log.info("measuring the prefill and decode speed of %s on %s once (cached)", name, device)
            try:
                # In a thread of its own: the probe's OpenMP pool must not outlive it beside the
                # batching loop's (ragbudget.generation.batching, "which thread runs the model").
                speed = in_own_thread(measure_prefill_speed, model, name=name, device=device)
            except Exception as exc:  # noqa: BLE001 - a speed probe must never fail a question
                log.warning("prefill speed not measured (%s): no time cap on the context", exc)
        return speed

    def cap(self, gen: Any, plan: BudgetPlan) -> BudgetPlan:
        """``plan`` capped by the time-to-first-token target, when one applies and the speed is
        known (:func:`~ragbudget.memory.budget.cap_plan_for_time`)."""
        from ..memory.budget import cap_plan_for_time

        target = self.target(gen)
        if target is None:
            return plan
        speed = self.measure(gen, plan.model)
        if speed is None:
            return plan
        self.entry = speed
        return cap_plan_for_time(plan, speed, target)

    @staticmethod
    def loaded(gen: Any) -> bool:
        """Whether there is a loaded model to tune admission for (not a stand-in, nor a model
        not loaded yet: admission then counts KV tokens only, as sized)."""
        return gen is not None and bool(gen.loaded) and gen.model is not None

    def tune(
        self, ctl: AdmissionController, gen: Any, plan: BudgetPlan, *, paged: PagedCacheLayout | None = None
    ) -> None:
        """For a :meth:`loaded` generator: count each request's KV *and* its own activation peak
        against the memory left beside the weights, and its time by the measured prefill and
        decode speed (the start and refusal rules of :mod:`ragbudget.memory.admission`).
        ``paged``: generation is batched over this paged cache, allocated up front — running
        requests share forward passes, their tokens count against the cache, and only their
        activations against the memory left beside the weights and the cache."""
        from ..memory.budget import request_memory
        from ..memory.calibration import throughput_from_speed

        speed = self.entry = self.entry or self.measure(gen, plan.model)
        throughput = throughput_from_speed(speed, batched=paged is not None) if speed else None
        memory = request_memory(plan, gen.config, paged=paged)
        ctl.configure(memory=memory, throughput=throughput, ttft_target=self.target(gen))

    def due(self, recheck_s: float) -> bool:
        """Whether to look again at a speed measured on a busy host (``provisional``): at most
        every ``recheck_s`` seconds."""
        if not self.entry or not self.entry.get("provisional"):
            return False
        now = time.monotonic()
        if now - self._checked < recheck_s:
            return False
        self._checked = now
        return True

    def remeasure(self, gen: Any, plan: BudgetPlan, *, before: Callable[[], None] | None = None) -> bool:
        """Measure again now, unless the host still looks busy (the lookup keeps the provisional
        entry, :func:`~ragbudget.memory.calibration.lookup_prefill_speed`); ``before`` runs first when it
        will measure. True when it measured."""
        from ..memory.calibration import lookup_prefill_speed

        device = self.device(gen)
        if not device or lookup_prefill_speed(plan.model, device) is not None:
            return False
        if before is not None:
            before()
        self.entry = None
        self.entry = self.measure(gen, plan.model)
        log.info(
            "measured the speed again on an idle host: %s",
            {k: self.entry.get(k) for k in ("a", "b", "decode_s", "provisional")} if self.entry else None,
        )
        return True
