"""Admission control: a request runs only while what it pins fits the memory, and its first token
can come within the queue's time-out.

:class:`AdmissionController` keeps one FIFO queue, one lock and the reservations of the running
requests, and decides by the models of :mod:`ragbudget.memory.schedule`: what a request pins (a
:class:`~ragbudget.memory.schedule.MemoryModel`: bytes beside the weights, and KV tokens of a
paged pool when there is one) and, with a measured
:class:`~ragbudget.memory.schedule.Throughput`, when it may start next to the others. Without a
memory model it counts KV tokens alone against ``capacity_tokens`` (a served engine's figure, or
a caller that sized it itself).

Time. A request's decode counts the share of its ``max_new_tokens`` that finished answers used
(the whole of it until one has finished; memory still reserves all of it), at the speed the
requests that ran really had (:meth:`AdmissionController.observe`). On *arrival*, a request whose
expected first token — after the work already running and queued, played forward by
:func:`~ragbudget.memory.schedule.simulate` — lies beyond the queue time-out is refused at once
with :class:`~ragbudget.errors.OverloadedError` and a ``retry_after`` equal to the excess (whole
seconds). Each refusal is remembered as a promise (:mod:`ragbudget.memory.promises`): the next
refusal is told a later time, and the client that comes back at its time claims its place.

Requests are admitted strictly in arrival order (FIFO): a large request at the head is not starved
by small ones behind it, at the cost of head-of-line blocking. The queue is bounded; a full queue
or a wait longer than ``timeout`` raises :class:`~ragbudget.errors.OverloadedError` with a
``retry_after`` hint (the HTTP ``Retry-After`` header). A single request larger than the whole
memory can never run and raises :class:`~ragbudget.errors.BudgetError` at once.

Usable from threads (``with ctl.reserve(n):``) and from asyncio (``async with ctl.areserve(n):``);
both share one lock, and an async waiter does not hold a thread while it waits. Everything time
based reads ``clock`` (``time.monotonic`` by default), so the decisions can be tested exactly.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from ..errors import BudgetError, ConfigError, OverloadedError, RequestCancelled
from .promises import Promise, Promises, claimed, current_key, returning
from .schedule import (
    Job,
    Learning,
    MemoryModel as MemoryModel,
    Throughput as Throughput,
    decode_now,
    job_rates,
    may_start,
    simulate as simulate,
)
from .tickets import AdmissionStats as AdmissionStats, Reservation as Reservation, Ticket as Ticket

# How often a waiter with a cancel event looks at it: threading.Event cannot wake on either of two
# events, and 50 ms is well below the latency of any request that has to queue.
CANCEL_POLL_S = 0.05

__all__ = [
    "AdmissionController",
    "AdmissionStats",
    "MemoryModel",
    "Reservation",
    "Throughput",
    "Ticket",
    "simulate",
]


# --------------------------------------------------------------------------------------------
# The controller
# --------------------------------------------------------------------------------------------


def _resolve(fut: asyncio.Future[None]) -> None:
    """Wake an async waiter (in its loop), unless it already left."""
    if not fut.done():
        fut.set_result(None)


class AdmissionController:
    """Thread- and asyncio-safe FIFO admission by memory (KV tokens, or KV + activation bytes
    with a :class:`MemoryModel`, or activation bytes and the tokens of a paged KV pool) and by
    time (with a :class:`Throughput`).

    Every ``retry_after`` is the model's estimate of when the work ahead (running, queued, and
    the clients already sent back) leaves room, at the speed learnt from the requests that ran:
    a burst on a slow host honestly takes minutes to drain. Until answers as long as the refused
    one's were seen, every answer is priced at the floor share (``Learning.expected_new_tokens``:
    a client told too soon waits for its kept place). It is at least 1 s and at most ``RETRY_AFTER_MAX_S``
    (past half an hour the estimate says more about a speed measured on a busy host than about
    when there will be room, and a client told an hour has been refused for good). A client back
    at its time claims its place (:mod:`ragbudget.memory.promises`) and waits for it up to
    ``RETRY_AFTER_MAX_S`` too (:attr:`return_wait`), which absorbs a model that ran fast.

    >>> ctl = AdmissionController(4096, max_queue=8, timeout=5.0)
    >>> with ctl.reserve(1500):
    ...     ctl.stats().admitted_tokens
    1500
    """

    #: The longest Retry-After, and the longest a returning client waits for its place (see the
    #: class docstring).
    RETRY_AFTER_MAX_S = 1800.0

    def __init__(
        self,
        capacity_tokens: int,
        *,
        max_queue: int = 64,
        timeout: float = 30.0,
        memory: MemoryModel | None = None,
        throughput: Throughput | None = None,
        ttft_target: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_tokens <= 0:
            raise ConfigError(f"capacity_tokens must be > 0; got {capacity_tokens}")
        if max_queue < 0:
            raise ConfigError(f"max_queue must be ≥ 0; got {max_queue}")
        if ttft_target is not None and ttft_target <= 0:
            ttft_target = None  # 0 turns the target off, as for the context cap
        self.capacity_tokens = int(capacity_tokens)
        self.max_queue = int(max_queue)
        self.timeout = timeout
        self.memory = memory
        self.throughput = throughput
        self.ttft_target = ttft_target
        self._clock = clock
        self._desk = _Desk(self)
        self._lock = threading.Lock()
        self._queue: collections.deque[Ticket] = collections.deque()
        self._running_jobs: list[Job] = []
        self._promises = Promises()
        self._admitted = 0
        self._admitted_bytes = 0
        self._admitted_pool = 0
        self._peak_bytes = 0
        self._running = 0
        self._admitted_total = 0
        self._rejected = 0
        self._timed_out = 0
        self._refused_time = 0
        self._last = clock()
        # Mean seconds a reservation is held (EWMA), for the retry_after hint without a throughput.
        self._hold = 1.0
        # The slowdown and the answers' share of max_new_tokens, learnt from the requests that ran.
        self._learning = Learning()

    def configure(
        self,
        *,
        memory: MemoryModel | None = None,
        throughput: Throughput | None = None,
        ttft_target: float | None = None,
    ) -> None:
        """Replace the memory model, the throughput and the target (once the model is loaded and
        measured): requests already running keep what they reserved."""
        with self._lock:
            self._advance_locked()
            if memory is not None:
                self.memory = memory
            if throughput is not None:
                self.throughput = throughput
                self._learning.measured()  # a new measurement: provisional again
            self.ttft_target = ttft_target if ttft_target and ttft_target > 0 else None
            self._admit_locked()

    @property
    def capacity(self) -> int:
        """What reservations are counted against: bytes with a memory model, else KV tokens."""
        return self.memory.capacity_bytes if self.memory is not None else self.capacity_tokens

    @property
    def token_capacity(self) -> int | None:
        """The KV pool's tokens, when the memory model has one (a paged cache), else ``None``:
        the second resource, counted beside :attr:`capacity`."""
        m = self.memory
        return m.kv_pool_tokens if m is not None and m.pooled else None

    @property
    def retry_after_max(self) -> float:
        """The most any ``retry_after`` says: :attr:`RETRY_AFTER_MAX_S`."""
        return float(self.RETRY_AFTER_MAX_S)

    @property
    def return_wait(self) -> float | None:
        """How long a returning client (one that claimed its promise) may wait in the queue
        for its turn: :attr:`RETRY_AFTER_MAX_S`, or the queue time-out if longer; ``None``
        without a time-out. It was promised a place: a model that ran fast delays its answer
        instead of refusing it twice, and a client that leaves frees the place at once."""
        if self.timeout is None:
            return None
        return max(float(self.timeout), self.retry_after_max)

    #: ``with AdmissionController.returning(key, on_claim=None):`` — the requests made inside
    #: carry ``key``: refused, they leave a promise under it, and back at the promised time they
    #: claim it (:func:`ragbudget.memory.promises.returning`).
    returning = staticmethod(returning)

    # -- public API ---------------------------------------------------------------------------
    def stats(self) -> AdmissionStats:
        with self._lock:
            self._advance_locked()
            ahead = None
            if self.throughput is not None:
                ahead = round(
                    sum(max(0.0, j.work - j.served) for j in self._running_jobs)
                    + sum(w.job.work for w in self._queue if w.job is not None),
                    3,
                )
            mem = self.memory is not None
            pool = self.token_capacity
            return AdmissionStats(
                capacity_tokens=pool if pool is not None else self.capacity_tokens,
                running=self._running,
                queued=len(self._queue),
                # Against the paged cache: the pages held, which is what its capacity counts.
                admitted_tokens=self._admitted_pool if pool is not None else self._admitted,
                admitted_total=self._admitted_total,
                rejected_total=self._rejected,
                timed_out_total=self._timed_out,
                refused_for_time_total=self._refused_time,
                capacity_bytes=self.memory.capacity_bytes if self.memory is not None else None,
                admitted_bytes=self._admitted_bytes if mem else None,
                peak_admitted_bytes=self._peak_bytes if mem else None,
                work_ahead_s=ahead,
                slowdown=(round(self.throughput.slowdown, 3) if self.throughput is not None else None),
                answer_share=(round(self._learning.answer_share, 3) if self.throughput is not None else None),
            )

    def enqueue(self, tokens: int, *, prompt_tokens: int | None = None, new_tokens: int | None = None) -> Ticket:
        """Take a place for ``tokens`` (``prompt_tokens`` of prompt; default: all; ``new_tokens``
        as :meth:`acquire` takes it) without waiting: admitted at once when nothing waits and it
        fits (``ticket.granted``), else queued — or refused at once, as :meth:`acquire` refuses
        it (``OverloadedError``: a full queue, or a first token past the time-out;
        ``BudgetError``: more than the whole capacity). The :class:`Ticket`'s ``wait()`` then waits for its turn.

        >>> ctl = AdmissionController(1000, timeout=0.01)
        >>> first, second = ctl.enqueue(800), ctl.enqueue(800)
        >>> first.granted, second.granted, ctl.stats().queued
        (True, False, 1)
        >>> first.reservation().release()
        >>> second.granted
        True
        """
        return self._enqueue(tokens, prompt_tokens, new_tokens=new_tokens)

    def promises(self) -> list[tuple[str | None, float]]:
        """The refusals still expected back, earliest first: each one's key (see
        :meth:`returning`; ``None`` for an unkeyed one) and the controller's clock time it was
        told to come back at. Lapsed ones (past their grace) are dropped first."""
        with self._lock:
            self._promises.prune(self._clock(), self._promise_grace)
            return [(p.key, p.due) for p in sorted(self._promises, key=lambda p: p.due)]

    @property
    def answer_share(self) -> float:
        """The share of ``max_new_tokens`` that finished answers generated (over the last
        ``Learning.ANSWER_WINDOW``; 1, the worst case, until answers are seen): the decode work the
        time model expects of a request (memory still reserves its whole ``max_new_tokens``)."""
        with self._lock:
            return self._learning.answer_share

    def acquire(
        self,
        tokens: int,
        *,
        prompt_tokens: int | None = None,
        new_tokens: int | None = None,
        timeout: float | None = None,
        cancel: threading.Event | None = None,
    ) -> Reservation:
        """Block until ``tokens`` (prompt + output, of which ``prompt_tokens`` are the prompt;
        default: all) fit, in arrival order; return the :class:`Reservation`. ``new_tokens``:
        the most the answer may generate, for time (default: the rest of ``tokens``) — less
        where a request holds more memory than it can fill (a whole slot of an engine of fixed
        slots: its decode is priced by its answer, not by the slot).

        Setting ``cancel`` while waiting leaves the queue at once (within
        ``CANCEL_POLL_S``) and raises :class:`~ragbudget.errors.RequestCancelled`: a client
        that went away must not keep its place, nor keep its thread until the timeout."""
        waiter = self.enqueue(tokens, prompt_tokens=prompt_tokens, new_tokens=new_tokens)
        if waiter.granted:
            return self._reservation(waiter)
        if waiter.returning:
            claimed()
        wait = self._wait_for(waiter, timeout)
        try:
            if cancel is None:
                waiter.event.wait(wait)
            else:
                deadline = time.monotonic() + wait
                while not waiter.event.wait(max(0.0, min(CANCEL_POLL_S, deadline - time.monotonic()))):
                    if cancel.is_set():
                        raise RequestCancelled(f"cancelled while waiting for {waiter.tokens} KV-cache tokens")
                    if time.monotonic() >= deadline:
                        break
        except BaseException:
            # Cancelled, or interrupted (KeyboardInterrupt): leave the queue — a waiter left at
            # its head would block everyone — and give back tokens granted meanwhile.
            if self._abandon(waiter):
                self._release(self._reservation(waiter))
            raise
        return self._finish_wait(waiter, wait)

    @contextlib.contextmanager
    def reserve(
        self,
        tokens: int,
        *,
        prompt_tokens: int | None = None,
        new_tokens: int | None = None,
        timeout: float | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[Reservation]:
        """``with ctl.reserve(n):`` — hold ``n`` tokens for the duration of the block."""
        r = self.acquire(tokens, prompt_tokens=prompt_tokens, new_tokens=new_tokens, timeout=timeout, cancel=cancel)
        try:
            yield r
        finally:
            r.release()

    async def aacquire(
        self,
        tokens: int,
        *,
        prompt_tokens: int | None = None,
        new_tokens: int | None = None,
        timeout: float | None = None,
    ) -> Reservation:
        """Async :meth:`acquire`: waits on a future, not a thread."""
        waiter = self._enqueue(tokens, prompt_tokens, loop=asyncio.get_running_loop(), new_tokens=new_tokens)
        if waiter.granted:
            return self._reservation(waiter)
        if waiter.returning:
            claimed()
        wait = self._wait_for(waiter, timeout)
        assert waiter.future is not None
        try:
            # A timeout is settled below by _finish_wait (granted meanwhile, or refused).
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(waiter.future), wait)
        except asyncio.CancelledError:
            # The caller went away: leave the queue, or give back what was granted meanwhile.
            if self._abandon(waiter):
                self._release(self._reservation(waiter))
            raise
        return self._finish_wait(waiter, wait)

    @contextlib.asynccontextmanager
    async def areserve(
        self,
        tokens: int,
        *,
        prompt_tokens: int | None = None,
        new_tokens: int | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[Reservation]:
        """``async with ctl.areserve(n):`` — the asyncio twin of :meth:`reserve`."""
        r = await self.aacquire(tokens, prompt_tokens=prompt_tokens, new_tokens=new_tokens, timeout=timeout)
        try:
            yield r
        finally:
            r.release()

    def expected_first_token(self, tokens: int, *, prompt_tokens: int | None = None) -> float | None:
        """Seconds a request arriving now would wait for its first token under the model
        (``None`` without a throughput)."""
        with self._lock:
            self._advance_locked()
            prompt = int(tokens if prompt_tokens is None else prompt_tokens)
            job = self._job(int(tokens), prompt, self._cost(int(tokens), prompt), self._pool(int(tokens)))
            return None if job is None else self._first_token_locked(job)

    def would_refuse(self, tokens: int, *, prompt_tokens: int | None = None, refuse: bool = False) -> float | None:
        """The ``retry_after`` a request of ``tokens`` (``prompt_tokens`` of prompt) arriving now
        is refused with for time — its first token past the queue time-out — or ``None`` when it
        would not be (or nothing is measured). A cheap look before building a prompt (the
        server's early 429); :meth:`acquire` still decides for the requests that pass.

        ``refuse=False`` changes nothing. ``refuse=True`` makes it a refusal, as :meth:`acquire`
        would: counted, and remembered as a promise (under the key of :meth:`returning`), so the
        next refused client is told a later time instead of the same second. A request that
        would claim a promise is never refused for time."""
        if self.throughput is None or self.timeout is None:
            return None
        tokens = int(tokens)
        prompt = int(tokens if prompt_tokens is None else prompt_tokens)
        with self._lock:
            self._advance_locked()
            if self._hold_return_locked():
                return None
            cost, pool = self._cost(tokens, prompt), self._pool(tokens)
            job = self._job(tokens, prompt, cost, pool)
            if job is None:
                return None
            if not self._queue and self._may_start_locked(Ticket(tokens, prompt, cost, job, pool)):
                return None  # it would start at once, as acquire starts it: never refused idle
            expected = self._first_token_locked(job)
            if expected <= self.timeout:
                return None
            if refuse:
                return self._refuse_for_time_locked(job)
            return float(min(self.retry_after_max, max(1, math.ceil(expected - self.timeout))))

    def hold_return(self) -> bool:
        """Whether a request made now (under the key of :meth:`returning`) comes back for a
        refusal's promise — the client honoured its ``Retry-After``. Its place is then kept for
        it until its :meth:`acquire` claims it (after the prompt is built), and the server lets
        it past the bounds that refuse newcomers (the early checks, a full worker pool)."""
        with self._lock:
            return self._hold_return_locked()

    def _hold_return_locked(self) -> bool:
        promise = self._promise_for_locked(current_key())
        if promise is None:
            return False
        # A returning client: its acquire, after the prompt is built (seconds on a busy host),
        # claims the promise — kept for it until then.
        promise.held_until = max(promise.held_until, self._clock() + (self.return_wait or 0.0))
        return True

    def refuse_busy(self, tokens: int | None = None, *, prompt_tokens: int | None = None) -> float:
        """Refuse a request because something in front of the controller is full (its queue,
        or the server's worker threads) and return the ``retry_after`` to tell it: when, by the
        model, a request of ``tokens`` (``prompt_tokens`` of prompt) arriving now would start
        behind the work running, queued and already sent back — or, without a throughput or a
        size, the mean hold time per request ahead. Counted as a rejection and remembered as a
        promise under the key of :meth:`returning`, as the controller's own refusals are, so
        the client that honours it is let in (:meth:`hold_return`) instead of refused again."""
        with self._lock:
            self._advance_locked()
            job = None
            if tokens is not None:
                t = int(tokens)
                prompt = int(t if prompt_tokens is None else prompt_tokens)
                job = self._job(t, prompt, self._cost(t, prompt), self._pool(t))
            self._rejected += 1
            retry = self._retry_after_locked(job)
            if job is None:
                retry = float(max(1, math.ceil(retry)))  # whole seconds, as Retry-After says
            self._promises.make(job, retry, self._clock())
            return retry

    def _refuse_for_time_locked(self, job: Job) -> float:
        """Count a refusal for time and promise the client a return: its ``retry_after``."""
        assert self.timeout is not None
        self._refused_time += 1
        # Whole seconds, as Retry-After carries them: the client comes back when, by the model,
        # the work ahead (and that of the clients sent back before it) has drained enough.
        later = self._first_token_locked(job, promised_first=True, soonest=True)
        retry = float(min(self.retry_after_max, max(1, math.ceil(later - self.timeout))))
        self._promises.make(job, retry, self._clock())
        return retry

    def _promise_for_locked(self, key: str | None) -> Promise | None:
        """The promise a request with ``key`` arriving now would claim (:meth:`Promises.claimable`)."""
        return self._promises.claimable(key, self._clock(), self._promise_grace)

    @property
    def _promise_grace(self) -> float:
        """How long past its time a promise stays claimable: ``Promises.LATE_S``, or one queue
        time-out if longer."""
        return max(Promises.LATE_S, self.timeout if self.timeout is not None else 0.0)

    def _wait_for(self, waiter: Ticket, timeout: float | None) -> float:
        """Seconds ``waiter`` may wait: ``timeout`` when given, else the queue time-out — or, for
        a returning client, :attr:`return_wait`."""
        if timeout is not None:
            return timeout
        if waiter.returning and self.return_wait is not None:
            return self.return_wait
        return self.timeout

    # -- internals ----------------------------------------------------------------------------
    def _reservation(self, waiter: Ticket) -> Reservation:
        return waiter.reservation()

    def _pool(self, tokens: int) -> int:
        """Tokens of the KV pool a request of ``tokens`` holds (0 without a pool)."""
        m = self.memory
        return m.pool_tokens(tokens) if m is not None and m.pooled else 0

    def _cost(self, tokens: int, prompt_tokens: int) -> int:
        if self.memory is None:
            return tokens
        return self.memory.request_bytes(prompt_tokens=prompt_tokens, tokens=tokens)

    def _job(
        self, tokens: int, prompt_tokens: int, cost: int, pool: int = 0, new_tokens: int | None = None
    ) -> Job | None:
        thr = self.throughput
        if thr is None:
            return None
        # Time counts the answer's expected length, memory all of it (see Learning). A request
        # holding a whole engine slot generates no more than its answer: pricing the rest of the
        # slot as decode (2026-12-07: 1,848 of 2,048 tokens where answers were capped at 16) made
        # the work ahead of four running requests over 1,100 s with the engine idle soon after.
        new = tokens - prompt_tokens if new_tokens is None else min(max(0, new_tokens), tokens - prompt_tokens)
        return Job(
            prefill=thr.prefill_seconds(prompt_tokens),
            decode=thr.decode_seconds(self._learning.expected_new_tokens(new)),
            cost=cost,
            tokens=pool,
            new_max=new,
        )

    def _may_start_locked(self, waiter: Ticket) -> bool:
        """The start rule for ``waiter`` now: both resources fit, and time (see the module)."""
        probe = waiter.job or Job(prefill=0, decode=0, cost=waiter.cost, tokens=waiter.pool)
        return may_start(
            probe,
            self._running_jobs if waiter.job is not None else [],
            self._admitted_cost_locked(),
            self.capacity,
            self.throughput,
            self.ttft_target,
            used_tokens=self._admitted_pool,
            token_capacity=self.token_capacity,
            batched_bound=self.timeout,
        )

    def _advance_locked(self) -> None:
        """Credit the running jobs with the work the model says they did since the last event."""
        now = self._clock()
        dt, self._last = max(0.0, now - self._last), now
        thr = self.throughput
        if thr is None or not self._running_jobs or dt == 0:
            return
        for job, rate in zip(self._running_jobs, job_rates(self._running_jobs, thr), strict=True):
            # A job the model thinks is done while it still runs (it decodes slower than
            # measured) keeps one decode step of work: it is still there.
            job.served = min(job.served + rate * dt, max(job.prefill, job.work - thr.decode_s))
            # At slowdown 1: the job's own slowdown is then credit / work done, whatever the
            # learnt slowdown was while it ran (applying a ratio to a slowdown learnt since would
            # overshoot when many long requests end together).
            job.credit += rate * dt * thr.slowdown

    def observe(self, slowdown: float) -> None:
        """Learn from one request: ``slowdown`` is the wall time it took over what the measured
        speed says (above 1: the host runs slower than measured). The throughput's ``slowdown``
        follows it (:meth:`~ragbudget.memory.schedule.Learning.slowed`), so a host that got busy
        after the measurement — or idle again — is followed within a few requests."""
        with self._lock:
            self._observe_locked(slowdown)

    def _observe_locked(self, sample: float) -> None:
        if self.throughput is not None:
            self.throughput = self._learning.slowed(self.throughput, sample)

    def _observe_job(self, job: Job | None, *, done: int | None) -> None:
        """A running job's first token (``done`` None: its prefill is over) or its end with
        ``done`` new tokens: compare the model's credit with the work really done."""
        if job is None or self.throughput is None:
            return
        with self._lock:
            self._advance_locked()
            thr = self.throughput
            if done is not None:
                self._learning.answered(done, job.new_max)
                self._reprice_locked()
            real = job.prefill if done is None else job.prefill + thr.decode_seconds(done)
            if real <= 0 or job.credit <= 0:
                return
            self._observe_locked(job.credit / real)

    def _reprice_locked(self) -> None:
        """An answer ended and the expected share moved: every answer not yet ended (running,
        queued, promised) is priced again at it. Priced once at arrival, the first requests of a
        burst kept the worst case (the whole max_new_tokens) until they ended, and the work ahead
        read 775 s while the host drained it in about a minute (2026-12-07)."""
        if self.throughput is None:
            return
        jobs = [*self._running_jobs, *(w.job for w in self._queue), *(p.job for p in self._promises)]
        for job in jobs:
            if job is not None:
                job.decode = decode_now(job, self.throughput, self._learning)

    def _first_token_locked(
        self, job: Job, *, promised_first: bool = False, promised_before: float = float("inf"), soonest: bool = False
    ) -> float:
        """Seconds to ``job``'s first token if it arrived now. ``promised_first``: behind the
        refused requests told to come back later too (for a refusal's Retry-After: the next
        one is sent back after them, not at the same second) — those refused before
        ``promised_before`` only, when given. ``soonest``: every answer priced as a Retry-After
        prices it (:func:`~ragbudget.memory.schedule.decode_now`), for when to tell a refused client to come back."""
        assert self.throughput is not None
        now = self._clock()
        self._promises.prune(now, self._promise_grace)
        running = self._running_jobs
        queued = [w.job for w in self._queue if w.job is not None]
        # Admission judges every new arrival by the real work only (an unkeyed returning client
        # cannot be told from a new one); promises space out the refusals, and a keyed return
        # claims its own (ragbudget.memory.promises).
        promised = self._promises.jobs_ahead(promised_before) if promised_first else []
        if soonest:
            running, queued, promised, (job,) = (
                [
                    dataclasses.replace(j, decode=decode_now(j, self.throughput, self._learning, soonest=True))
                    for j in jobs
                ]
                for jobs in (running, queued, promised, [job])
            )
        first = simulate(
            running,
            [*queued, *promised, job],
            throughput=self.throughput,
            capacity=self.capacity,
            ttft_target=self.ttft_target,
            now=now,
            token_capacity=self.token_capacity,
            batched_bound=self.timeout,
        )
        return first[-1] - now

    def _enqueue(
        self,
        tokens: int,
        prompt_tokens: int | None,
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        new_tokens: int | None = None,
    ) -> Ticket:
        tokens = int(tokens)
        if tokens < 0:
            raise ConfigError(f"cannot reserve a negative number of tokens ({tokens})")
        prompt = tokens if prompt_tokens is None else int(prompt_tokens)
        if not 0 <= prompt <= tokens:
            raise ConfigError(f"prompt_tokens must be between 0 and the {tokens} tokens reserved; got {prompt}")
        cost = self._cost(tokens, prompt)
        pool = self._pool(tokens)
        if self.memory is None and tokens > self.capacity_tokens:
            raise BudgetError(
                f"this request needs {tokens} KV-cache tokens but the whole cache holds "
                f"{self.capacity_tokens}; lower max_new_tokens or the context budget, or use a "
                "GPU with more memory",
                needed=tokens,
                available=self.capacity_tokens,
            )
        if self.memory is not None:
            self.memory.check_fits(prompt_tokens=prompt, tokens=tokens)
        with self._lock:
            self._advance_locked()
            job = self._job(tokens, prompt, cost, pool, new_tokens)
            waiter = Ticket(tokens, prompt, cost, job, pool, controller=self._desk)
            promise = self._promise_for_locked(current_key())
            if promise is not None:  # a client back when it was told: its promise is kept
                self._promises.claim(promise)
                waiter.returning = True
            # Nothing waits and it may start: it runs at once (work conserving — promised returns
            # shape later refusals and their Retry-After, they never hold the host idle).
            if not self._queue and self._may_start_locked(waiter):
                self._grant(waiter)
                return waiter
            # A returning client was promised this place: the queue bound is for newcomers (the
            # promises are bounded by the refusals that made them).
            if len(self._queue) >= self.max_queue and not waiter.returning:
                self._rejected += 1
                retry = self._retry_after_locked(job)
                self._promises.make(job, retry, self._clock())
                raise OverloadedError(
                    f"{len(self._queue)} requests already wait for KV-cache space (queue limit {self.max_queue})",
                    retry_after=retry,
                )
            if job is not None and self.timeout is not None and not waiter.returning:
                expected = self._first_token_locked(job)
                if expected > self.timeout:
                    behind = self._promises.behind()
                    retry = self._refuse_for_time_locked(job)
                    # One figure of waiting in the text, the Retry-After's (issue #42 §5: "about
                    # 34 s" beside a Retry-After of 280 s read as a contradiction; the first
                    # token's own estimate is not when to come back, the work ahead is).
                    raise OverloadedError(
                        f"the first token would come past the queue time-out of {self.timeout:g} s (work "
                        f"already running and queued at the measured speed: {self._running} running, "
                        f"{len(self._queue)} queued)" + behind,
                        retry_after=retry,
                    )
            if loop is not None:
                waiter.loop = loop
                waiter.future = loop.create_future()
            waiter.arrived = self._clock()
            self._queue.append(waiter)
        return waiter

    def _admitted_cost_locked(self) -> int:
        return self._admitted_bytes if self.memory is not None else self._admitted

    def _grant(self, waiter: Ticket) -> None:
        # Called with the lock held.
        waiter.granted = True
        self._admitted += waiter.tokens
        self._admitted_pool += waiter.pool
        if self.memory is not None:
            self._admitted_bytes += waiter.cost
            self._peak_bytes = max(self._peak_bytes, self._admitted_bytes)
        if waiter.job is not None:
            self._running_jobs.append(waiter.job)
        self._running += 1
        self._admitted_total += 1
        waiter.event.set()
        if waiter.loop is not None and waiter.future is not None:
            waiter.loop.call_soon_threadsafe(_resolve, waiter.future)

    def _admit_locked(self) -> None:
        # Strict FIFO: only the head may go; it waits until it fits (memory, and time next to
        # the running requests).
        self._advance_locked()
        while self._queue:
            if not self._may_start_locked(self._queue[0]):
                break
            self._grant(self._queue.popleft())

    def _abandon(self, waiter: Ticket) -> bool:
        """Take ``waiter`` out of the queue; True when it had been granted meanwhile."""
        with self._lock:
            if waiter.granted:
                return True
            with contextlib.suppress(ValueError):
                self._queue.remove(waiter)
            # Removing the head may let the next one in.
            self._admit_locked()
            return False

    def _finish_wait(self, waiter: Ticket, wait: float | None) -> Reservation:
        if self._abandon(waiter):
            return self._reservation(waiter)
        with self._lock:
            self._timed_out += 1
            retry = self._retry_after_locked(waiter.job, arrived=waiter.arrived)
            self._promises.make(waiter.job, retry, self._clock())  # its return is kept a place, as for time
        held = (
            f"{self.capacity_tokens} in all, all in use"
            if self.memory is None
            else f"{self._admitted_bytes / 2**20:,.1f} of {self.memory.capacity_bytes / 2**20:,.1f} "
            f"MiB held by {self._running} running"
        )
        if self.token_capacity is not None:
            held += f", {self._admitted_pool} of the paged cache's {self.token_capacity} tokens"
        raise OverloadedError(
            f"waited {wait:.1f}s for {waiter.tokens} KV-cache tokens ({held}), the queue time-out",
            retry_after=retry,
        )

    def _release(self, r: Reservation) -> None:
        with self._lock:
            self._advance_locked()
            self._admitted -= r.tokens
            self._admitted_pool -= r.pool
            if self.memory is not None:
                self._admitted_bytes -= r.nbytes
            if r.job is not None:
                with contextlib.suppress(ValueError):
                    self._running_jobs.remove(r.job)
            self._running -= 1
            held = self._clock() - r.started
            self._hold = 0.8 * self._hold + 0.2 * held
            self._admit_locked()

    def _retry_after_locked(self, job: Job | None = None, *, arrived: float = float("inf")) -> float:
        if job is not None and self.throughput is not None:
            # From the measured speed: when this request, arriving now, would start — behind
            # the clients refused before it ``arrived`` (a queue time-out waited since then:
            # sending it behind every client refused while it waited puts the one that waited
            # longest last).
            start = (
                self._first_token_locked(job, promised_first=True, promised_before=arrived, soonest=True) - job.prefill
            )
            return float(min(self.retry_after_max, max(1.0, math.ceil(start))))
        # Roughly: one mean hold time per queued request ahead, spread over the running ones.
        per = self._hold * (len(self._queue) + 1) / max(1, self._running)
        return float(min(self.retry_after_max, max(0.1, round(per, 2))))


class _Desk:
    """The controller's side of :class:`~ragbudget.memory.tickets.TicketOwner`: what a ticket or a
    reservation may ask of the controller that made it, and nothing else."""

    __slots__ = ("_ctl",)

    def __init__(self, ctl: AdmissionController) -> None:
        self._ctl = ctl

    def clock(self) -> float:
        return self._ctl._clock()

    def wait_for(self, waiter: Ticket, timeout: float | None) -> float:
        return self._ctl._wait_for(waiter, timeout)

    def finish_wait(self, waiter: Ticket, wait: float | None) -> Reservation:
        return self._ctl._finish_wait(waiter, wait)

    def observe_job(self, job: Job | None, *, done: int | None) -> None:
        self._ctl._observe_job(job, done=done)

    def release(self, r: Reservation) -> None:
        self._ctl._release(r)
