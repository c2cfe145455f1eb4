"""Admission control: reserve KV-cache tokens before generating, so concurrent requests never
sum to more than the cache the budget planned for.

A request reserves its worst case (prompt + ``max_new_tokens``). Requests are admitted strictly in
arrival order (FIFO): a large request at the head of the queue is not starved by a stream of small
ones behind it, at the cost of head-of-line blocking. The queue is bounded; a full queue or a wait
longer than ``timeout`` raises :class:`~ragbudget.errors.OverloadedError` with a ``retry_after``
hint (for an HTTP 503/429 ``Retry-After`` header). A single request larger than the whole capacity
can never run and raises :class:`~ragbudget.errors.BudgetError` at once.

Usable from threads (``with ctl.reserve(n):``) and from asyncio (``async with ctl.areserve(n):``);
both share one lock, and an async waiter does not hold a thread while it waits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from .errors import BudgetError, ConfigError, OverloadedError, RequestCancelled

# How often a waiter with a cancel event looks at it: threading.Event cannot wake on either of two
# events, and 50 ms is well below the latency of any request that has to queue.
CANCEL_POLL_S = 0.05

__all__ = ["AdmissionController", "AdmissionStats", "Reservation"]


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

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.admitted_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacity_tokens": self.capacity_tokens,
            "running": self.running,
            "queued": self.queued,
            "admitted_tokens": self.admitted_tokens,
            "free_tokens": self.free_tokens,
            "admitted_total": self.admitted_total,
            "rejected_total": self.rejected_total,
            "timed_out_total": self.timed_out_total,
        }


class _Waiter:
    __slots__ = ("event", "future", "granted", "loop", "tokens")

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.event = threading.Event()
        self.granted = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.future: asyncio.Future[None] | None = None


class Reservation:
    """An admitted reservation of ``tokens``; ``release()`` (idempotent) gives them back."""

    def __init__(self, controller: AdmissionController, tokens: int) -> None:
        self.controller = controller
        self.tokens = tokens
        self.started = time.monotonic()
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.controller._release(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class AdmissionController:
    """Thread- and asyncio-safe FIFO reservation of ``capacity_tokens`` KV-cache tokens.

    >>> ctl = AdmissionController(4096, max_queue=8, timeout=5.0)
    >>> with ctl.reserve(1500):
    ...     ctl.stats().admitted_tokens
    1500
    """

    def __init__(self, capacity_tokens: int, *, max_queue: int = 64, timeout: float = 30.0) -> None:
        if capacity_tokens <= 0:
            raise ConfigError(f"capacity_tokens must be > 0; got {capacity_tokens}")
        if max_queue < 0:
            raise ConfigError(f"max_queue must be ≥ 0; got {max_queue}")
        self.capacity_tokens = int(capacity_tokens)
        self.max_queue = int(max_queue)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._admitted = 0
        self._running = 0
        self._admitted_total = 0
        self._rejected = 0
        self._timed_out = 0
        # Mean seconds a reservation is held (EWMA), for the retry_after hint.
        self._hold = 1.0

    # -- public API ---------------------------------------------------------------------------
    def stats(self) -> AdmissionStats:
        with self._lock:
            return AdmissionStats(
                capacity_tokens=self.capacity_tokens,
                running=self._running,
                queued=len(self._queue),
                admitted_tokens=self._admitted,
                admitted_total=self._admitted_total,
                rejected_total=self._rejected,
                timed_out_total=self._timed_out,
            )

    def acquire(self, tokens: int, *, timeout: float | None = None,
                cancel: threading.Event | None = None) -> Reservation:
        """Block until ``tokens`` fit, in arrival order; return the :class:`Reservation`.

        Setting ``cancel`` while waiting leaves the queue at once (within
        ``CANCEL_POLL_S``) and raises :class:`~ragbudget.errors.RequestCancelled`: a client
        that went away must not keep its place, nor keep its thread until the timeout."""
        waiter = self._enqueue(tokens)
        if waiter.granted:
            return Reservation(self, waiter.tokens)
        wait = self.timeout if timeout is None else timeout
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
                self._release(Reservation(self, waiter.tokens))
            raise
        return self._finish_wait(waiter, wait)

    @contextlib.contextmanager
    def reserve(self, tokens: int, *, timeout: float | None = None,
                cancel: threading.Event | None = None) -> Iterator[Reservation]:
        """``with ctl.reserve(n):`` — hold ``n`` tokens for the duration of the block."""
        r = self.acquire(tokens, timeout=timeout, cancel=cancel)
        try:
            yield r
        finally:
            r.release()

    async def aacquire(self, tokens: int, *, timeout: float | None = None) -> Reservation:
        """Async :meth:`acquire`: waits on a future, not a thread."""
        waiter = self._enqueue(tokens, loop=asyncio.get_running_loop())
        if waiter.granted:
            return Reservation(self, waiter.tokens)
        wait = self.timeout if timeout is None else timeout
        assert waiter.future is not None
        try:
            # A timeout is settled below by _finish_wait (granted meanwhile, or refused).
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(waiter.future), wait)
        except asyncio.CancelledError:
            # The caller went away: leave the queue, or give back what was granted meanwhile.
            if self._abandon(waiter):
                self._release(Reservation(self, waiter.tokens))
            raise
        return self._finish_wait(waiter, wait)

    @contextlib.asynccontextmanager
    async def areserve(self, tokens: int, *, timeout: float | None = None) -> AsyncIterator[Reservation]:
        """``async with ctl.areserve(n):`` — the asyncio twin of :meth:`reserve`."""
        r = await self.aacquire(tokens, timeout=timeout)
        try:
            yield r
        finally:
            r.release()

    # -- internals ----------------------------------------------------------------------------
    def _enqueue(self, tokens: int, loop: asyncio.AbstractEventLoop | None = None) -> _Waiter:
        tokens = int(tokens)
        if tokens < 0:
            raise ConfigError(f"cannot reserve a negative number of tokens ({tokens})")
        if tokens > self.capacity_tokens:
            raise BudgetError(
                f"this request needs {tokens} KV-cache tokens but the whole cache holds "
                f"{self.capacity_tokens}; lower max_new_tokens or the context budget, or use a "
                "GPU with more memory",
                needed=tokens,
                available=self.capacity_tokens,
            )
        waiter = _Waiter(tokens)
        with self._lock:
            if not self._queue and self._admitted + tokens <= self.capacity_tokens:
                self._grant(waiter)
                return waiter
            if len(self._queue) >= self.max_queue:
                self._rejected += 1
                raise OverloadedError(
                    f"{len(self._queue)} requests already wait for KV-cache space "
                    f"(queue limit {self.max_queue}); retry later",
                    retry_after=self._retry_after_locked(),
                )
            if loop is not None:
                waiter.loop = loop
                waiter.future = loop.create_future()
            self._queue.append(waiter)
        return waiter

    def _grant(self, waiter: _Waiter) -> None:
        # Called with the lock held.
        waiter.granted = True
        self._admitted += waiter.tokens
        self._running += 1
        self._admitted_total += 1
        waiter.event.set()
        if waiter.loop is not None and waiter.future is not None:
            fut = waiter.future
            waiter.loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

    def _admit_locked(self) -> None:
        # Strict FIFO: only the head may go; it waits until it fits.
        while self._queue and self._admitted + self._queue[0].tokens <= self.capacity_tokens:
            self._grant(self._queue.popleft())

    def _abandon(self, waiter: _Waiter) -> bool:
        """Take ``waiter`` out of the queue; True when it had been granted meanwhile."""
        with self._lock:
            if waiter.granted:
                return True
            with contextlib.suppress(ValueError):
                self._queue.remove(waiter)
            # Removing the head may let the next one in.
            self._admit_locked()
            return False

    def _finish_wait(self, waiter: _Waiter, wait: float | None) -> Reservation:
        if self._abandon(waiter):
            return Reservation(self, waiter.tokens)
        with self._lock:
            self._timed_out += 1
            retry = self._retry_after_locked()
        raise OverloadedError(
            f"waited {wait:.1f}s for {waiter.tokens} KV-cache tokens "
            f"({self.capacity_tokens} in all, all in use); retry later or raise the timeout",
            retry_after=retry,
        )

    def _release(self, r: Reservation) -> None:
        with self._lock:
            self._admitted -= r.tokens
            self._running -= 1
            held = time.monotonic() - r.started
            self._hold = 0.8 * self._hold + 0.2 * held
            self._admit_locked()

    def _retry_after_locked(self) -> float:
        # Roughly: one mean hold time per queued request ahead, spread over the running ones.
        per = self._hold * (len(self._queue) + 1) / max(1, self._running)
        return float(min(60.0, max(0.1, round(per, 2))))
