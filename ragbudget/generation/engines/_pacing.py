"""How fast a served engine answers, read off the answers it gave, and what follows from it: the
time-out of each generation and admission control's time model (issue #42 §5: a fixed 30 s
time-out failed requests on CPU engines that were merely slow, and admission knew nothing of the
engine's speed).

Each answer is a reading: the engine's own figures where it gives them (llama.cpp's
``timings``: ``prompt_n``/``prompt_ms`` of prefill, ``predicted_n``/``predicted_ms`` of decode,
``server_task_result_cmpl_final::to_json`` in tools/server/server-task.cpp), else the clock on a
streamed answer (the first token, then the rest). :class:`EngineSpeed` keeps the last few:

* a generation's time-out, where none was given (``--engine-timeout``), is what the request
  should take at the *slowest* recent speed (a busy engine is slow for every request on it),
  times :attr:`EngineSpeed.SAFETY`, never below :attr:`EngineSpeed.FLOOR_S`;
  :attr:`EngineSpeed.UNMEASURED_S` before the engine answered at all;
* admission control's :class:`~ragbudget.memory.schedule.Throughput` is the *fastest* recent
  speed — one request alone; the time model shares the engine among the requests it runs, and
  learns how much slower they really go (its ``slowdown``) — so a refusal's ``Retry-After`` and
  the early refusals for time follow the engine's measured speed.

>>> s = EngineSpeed()
>>> s.timeout(1000, 100)
300.0
>>> s.observe({"prompt_n": 1000, "prompt_ms": 40000.0, "predicted_n": 100, "predicted_ms": 10000.0})
>>> s.timeout(1000, 100), s.timeout(10, 10)   # 3 × (40 s + 10 s) on a slow CPU; never below 30 s
(150.0, 30.0)
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...memory.schedule import Throughput

__all__ = ["EngineSpeed"]


class EngineSpeed:
    """The prefill and decode speed of one served engine, in seconds a token, from its last
    :attr:`WINDOW` answers (see the module docstring). Thread-safe."""

    #: Readings kept (the speed follows the engine's load within a few answers).
    WINDOW = 8
    #: How many times the expected time a generation may take before it is an engine time-out.
    SAFETY = 3.0
    #: The shortest time-out drawn from the speed: what it was before it was drawn from the speed
    #: (a fast engine keeps it; it only grows for a slow one).
    FLOOR_S = 30.0
    #: The time-out before any reading: long enough for a slow CPU engine's first answer.
    UNMEASURED_S = 300.0
    #: Readings below these sizes say more about overheads (a cached prompt) than about speed.
    MIN_PROMPT_TOKENS = 16
    MIN_NEW_TOKENS = 3

    def __init__(self) -> None:
        self._prefill: deque[float] = deque(maxlen=self.WINDOW)
        self._decode: deque[float] = deque(maxlen=self.WINDOW)
        self._lock = threading.Lock()
        self.source = ""

    def observe(
        self,
        timings: Mapping[str, Any] | None = None,
        *,
        prompt_tokens: int = 0,
        new_tokens: int = 0,
        first_s: float | None = None,
        total_s: float | None = None,
    ) -> None:
        """One answer's reading: the engine's ``timings`` when it gave them, else the clock of a
        streamed answer — ``first_s`` to its first token for ``prompt_tokens`` (what waited in
        the engine's queue counts as prefill: a busy engine is slow to answer), ``total_s`` for
        all of its ``new_tokens``."""
        prefill = decode = None
        source = ""
        if timings:
            prefill = _per_token(timings.get("prompt_ms"), timings.get("prompt_n"), self.MIN_PROMPT_TOKENS)
            decode = _per_token(timings.get("predicted_ms"), timings.get("predicted_n"), self.MIN_NEW_TOKENS)
            source = "the engine's timings"
        elif first_s is not None:
            prefill = _per_token(first_s * 1e3, prompt_tokens, self.MIN_PROMPT_TOKENS)
            if total_s is not None:
                decode = _per_token((total_s - first_s) * 1e3, new_tokens - 1, self.MIN_NEW_TOKENS)
            source = "the clock of streamed answers"
        with self._lock:
            if prefill is not None:
                self._prefill.append(prefill)
            if decode is not None:
                self._decode.append(decode)
            if prefill is not None or decode is not None:
                self.source = source

    @property
    def measured(self) -> bool:
        """Whether both speeds have been read."""
        with self._lock:
            return bool(self._prefill) and bool(self._decode)

    def timeout(self, prompt_tokens: int, max_new_tokens: int) -> float:
        """Seconds one generation of ``prompt_tokens`` and up to ``max_new_tokens`` may wait on
        the engine (see the module docstring)."""
        with self._lock:
            if not (self._prefill and self._decode):
                return self.UNMEASURED_S
            expected = max(0, prompt_tokens) * max(self._prefill) + max(1, max_new_tokens) * max(self._decode)
        return round(max(self.FLOOR_S, self.SAFETY * expected), 3)

    def throughput(self) -> Throughput | None:
        """Admission control's time model at the fastest recent speed (``None`` before both
        speeds are read)."""
        from ...memory.schedule import Throughput

        with self._lock:
            if not (self._prefill and self._decode):
                return None
            prefill, decode = min(self._prefill), min(self._decode)
        return Throughput(
            prefill_a=prefill, decode_s=decode, source=f"measured on the engine's answers ({self.source})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The speeds in use, for a plan or /health: seconds a token, fastest and slowest."""
        with self._lock:
            out: dict[str, Any] = {"source": self.source, "readings": max(len(self._prefill), len(self._decode))}
            for name, values in (("prefill_s_per_token", self._prefill), ("decode_s_per_token", self._decode)):
                if values:
                    out[name] = {"fastest": min(values), "slowest": max(values)}
        return out


def _per_token(ms: Any, n: Any, least: int) -> float | None:
    """Seconds a token from ``ms`` milliseconds for ``n`` tokens, or ``None`` for too few tokens
    or figures that are not numbers."""
    try:
        ms_f, n_i = float(ms), int(n)
    except (TypeError, ValueError):
        return None
    if n_i < least or ms_f <= 0:
        return None
    return ms_f / 1e3 / n_i
