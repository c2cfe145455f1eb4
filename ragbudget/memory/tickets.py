"""A request's place at admission control and what it holds once admitted.

:class:`Ticket` is a place in :class:`~ragbudget.memory.admission.AdmissionController`'s queue
(admitted at once or waiting), :class:`Reservation` the memory an admitted request holds until it
is released, :class:`AdmissionStats` what the controller reports of them. They live apart from
the controller so that its module stays one job (the decisions); they reach the controller only
through :class:`TicketOwner`, the few calls a place makes on it.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import ConfigError
from .schedule import Job

__all__ = ["AdmissionStats", "Reservation", "Ticket", "TicketOwner"]


@dataclass(frozen=True)
class AdmissionStats:
    """A snapshot of the controller: what runs, what waits, and what was refused."""

    capacity_tokens: int
    running: int  # admitted reservations not yet released
    queued: int  # waiters
    admitted_tokens: int  # tokens held by running reservations
    admitted_total: int
    rejected_total: int  # queue full
    timed_out_total: int
    refused_for_time_total: int = 0  # expected first token past the queue time-out
    capacity_bytes: int | None = None  # with a memory model: KV + activations of all requests
    admitted_bytes: int | None = None
    peak_admitted_bytes: int | None = None
    work_ahead_s: float | None = None  # with a throughput: single-stream seconds still to do
    slowdown: float | None = None  # with a throughput: wall s per measured s, learnt (observe)
    #: With a throughput: generated over allowed new tokens of the last answers (schedule.Learning),
    #: the decode work the time model expects of a request.
    answer_share: float | None = None

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.admitted_tokens

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "capacity_tokens": self.capacity_tokens,
            "running": self.running,
            "queued": self.queued,
            "admitted_tokens": self.admitted_tokens,
            "free_tokens": self.free_tokens,
            "admitted_total": self.admitted_total,
            "rejected_total": self.rejected_total,
            "timed_out_total": self.timed_out_total,
            "refused_for_time_total": self.refused_for_time_total,
        }
        timed = ("work_ahead_s", "slowdown", "answer_share")
        for key in ("capacity_bytes", "admitted_bytes", "peak_admitted_bytes", *timed):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class TicketOwner(Protocol):
    """What a :class:`Ticket` and a :class:`Reservation` ask of the controller that made them: the
    controller hands each one its desk (``ragbudget.memory.admission``), which answers these
    calls and nothing else, so neither reaches into the controller's private state."""

    def clock(self) -> float:
        """The controller's clock now."""
        ...

    def wait_for(self, waiter: Ticket, timeout: float | None) -> float:
        """Wait until ``waiter`` is admitted or ``timeout`` passes; the seconds waited."""
        ...

    def finish_wait(self, waiter: Ticket, wait: float | None) -> Reservation:
        """Settle a wait: the reservation of an admitted ``waiter``, else the refusal raised."""
        ...

    def observe_job(self, job: Job | None, *, done: int | None) -> None:
        """A request's first token (``done`` None) or its end (``done`` new tokens) came now."""
        ...

    def release(self, r: Reservation) -> None:
        """``r`` is given back."""
        ...


class Ticket:
    """A request's place at the controller, from :meth:`AdmissionController.enqueue`: admitted at
    once (:attr:`granted`) or waiting in the FIFO queue. :meth:`wait` waits for its turn and
    :meth:`reservation` is what it holds once admitted. :meth:`AdmissionController.acquire` is
    ``enqueue`` then ``wait``; a caller that holds several places from one thread (a simulation,
    a test of the queue's order) uses the two halves itself."""

    __slots__ = (
        "arrived",
        "controller",
        "cost",
        "event",
        "future",
        "granted",
        "job",
        "loop",
        "pool",
        "prompt_tokens",
        "returning",
        "tokens",
        "_held",
    )

    def __init__(
        self,
        tokens: int,
        prompt_tokens: int,
        cost: int,
        job: Job | None,
        pool: int = 0,
        *,
        controller: TicketOwner | None = None,
    ) -> None:
        self.controller = controller
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens
        self.cost = cost
        self.pool = pool  # tokens of a KV pool (paged cache) it holds, in whole pages
        self.job = job
        self.event = threading.Event()
        self.granted = False
        self.returning = False  # it claimed a refusal's promise (ragbudget.memory.promises)
        self.arrived = float("-inf")  # the controller's clock when it was queued
        self.loop: asyncio.AbstractEventLoop | None = None
        self.future: asyncio.Future[None] | None = None
        self._held: Reservation | None = None

    def _owner(self) -> TicketOwner:
        if self.controller is None:  # pragma: no cover - only enqueue's tickets are handed out
            raise ConfigError("this ticket was not made by AdmissionController.enqueue(); it holds no place")
        return self.controller

    @property
    def max_wait(self) -> float | None:
        """Seconds :meth:`wait` waits by default: the queue time-out, or for a returning client
        (one that claimed a refusal's promise) :attr:`AdmissionController.return_wait`."""
        return self._owner().wait_for(self, None)

    def reservation(self) -> Reservation:
        """What this admitted request holds (the same :class:`Reservation` on every call;
        ``release()`` it when done). Raises :class:`~ragbudget.errors.ConfigError` while it is
        still queued: :meth:`wait` for it first."""
        if not self.granted:
            raise ConfigError(
                f"this request for {self.tokens} KV-cache tokens is still queued, so it holds no "
                "reservation yet; call wait() (or use acquire()) to wait for its turn"
            )
        if self._held is None:
            self._held = Reservation(self._owner(), self.tokens, nbytes=self.cost, job=self.job, pool=self.pool)
        return self._held

    def wait(self, timeout: float | None = None) -> Reservation:
        """Wait up to ``timeout`` seconds (default :attr:`max_wait`) for its turn and return its
        :class:`Reservation`; past that, leave the queue and raise
        :class:`~ragbudget.errors.OverloadedError` with a ``retry_after`` (its return kept a
        place, as :meth:`AdmissionController.acquire` does)."""
        if self.granted:
            return self.reservation()
        ctl = self._owner()
        wait = ctl.wait_for(self, timeout)
        self.event.wait(wait)
        return ctl.finish_wait(self, wait)


class Reservation:
    """An admitted reservation of ``tokens`` (and ``nbytes`` of memory); ``release()``
    (idempotent) gives them back."""

    def __init__(
        self, controller: TicketOwner, tokens: int, *, nbytes: int = 0, job: Job | None = None, pool: int = 0
    ) -> None:
        self.controller = controller
        self.tokens = tokens
        self.nbytes = nbytes
        self.pool = pool
        self.job = job
        self.started = controller.clock()
        self._released = False
        self._first_seen = False

    def first_token(self) -> None:
        """Its first token came now: lets the controller compare its prefill with the model
        (idempotent; see :meth:`AdmissionController.observe`)."""
        if not self._first_seen and not self._released:
            self._first_seen = True
            self.controller.observe_job(self.job, done=None)

    def finish(self, new_tokens: int) -> None:
        """It ended having generated ``new_tokens`` (call before :meth:`release`): lets the
        controller compare the whole request with the model."""
        if not self._released:
            self.controller.observe_job(self.job, done=int(new_tokens))

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.controller.release(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
