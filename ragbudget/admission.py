"""Admission control: a request runs only while what it pins fits the memory, and its first token
can come within the queue's time-out.

Memory. A request reserves its worst case: the KV cache of ``prompt + max_new_tokens`` tokens
*and* its own activation peak (the prefill of its prompt, with the attention implementation in
use), given by a :class:`MemoryModel`. Requests run together only while the sum fits. Without a
memory model the controller counts KV tokens alone against ``capacity_tokens`` (a served engine's
figure, or a caller that sized it itself).

Time. With a measured :class:`Throughput` (prefill ``a·n + b·n²`` seconds, decode seconds per
token), the host is modelled as one processor shared by the running requests (threads each running
their own ``generate`` share the cores; a backend that batches shares forward passes, and then
decoding sequences cost only the marginal step). Two decisions follow from the model:

* *start*: the head of the queue starts when it fits the memory and, if others run, its prefill
  shared with them still ends within ``ttft_target`` (the time-to-first-token target that also
  caps the context on a CPU); alone, it always starts;
* *arrival*: a request whose expected first token — after the work already running and queued,
  played forward by :func:`simulate` — lies beyond the queue time-out is refused at once with
  :class:`~ragbudget.errors.OverloadedError` and a ``retry_after`` equal to the excess (whole
  seconds). Each refusal is remembered as a *promise*: a request expected back at that time, so
  the next refusal is told a later time instead of sending every client back at the same second.

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
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import BudgetError, ConfigError, OverloadedError, RequestCancelled

# How often a waiter with a cancel event looks at it: threading.Event cannot wake on either of two
# events, and 50 ms is well below the latency of any request that has to queue.
CANCEL_POLL_S = 0.05

__all__ = [
    "AdmissionController",
    "AdmissionStats",
    "MemoryModel",
    "Reservation",
    "Throughput",
    "simulate",
]


# --------------------------------------------------------------------------------------------
# What a request costs: memory and compute
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """The memory a running request pins, against ``capacity_bytes`` (usable memory minus the
    weights): ``kv_fixed_bytes + kv_bytes_per_token × tokens`` of KV cache plus
    ``activation(prompt_tokens)`` bytes, its own prefill peak (``None``: no activations counted).

    >>> m = MemoryModel(capacity_bytes=10_000, kv_bytes_per_token=2, activation=lambda n: 3 * n)
    >>> m.request_bytes(prompt_tokens=100, tokens=150)
    600
    """

    capacity_bytes: int
    kv_bytes_per_token: int
    kv_fixed_bytes: int = 0
    activation: Callable[[int], int] | None = None
    #: Where the figures came from, for logs and /health (``"plan: host RAM available …"``).
    source: str = ""

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be > 0; got {self.capacity_bytes} (the "
                              "weights leave no memory for requests)")
        if self.kv_bytes_per_token < 0 or self.kv_fixed_bytes < 0:
            raise ConfigError("KV bytes per token and per sequence must be >= 0")

    def kv_bytes(self, tokens: int) -> int:
        return self.kv_fixed_bytes + self.kv_bytes_per_token * int(tokens)

    def activation_bytes(self, prompt_tokens: int) -> int:
        return int(self.activation(int(prompt_tokens))) if self.activation is not None else 0

    def request_bytes(self, *, prompt_tokens: int, tokens: int) -> int:
        """KV of ``tokens`` (prompt + output) plus the activation peak of a ``prompt_tokens``
        prefill."""
        return self.kv_bytes(tokens) + self.activation_bytes(prompt_tokens)

    def tokens_for_bytes(self, nbytes: int) -> int:
        """KV tokens that ``nbytes`` holds (ignoring activations): for the token figures."""
        per = max(1, self.kv_bytes_per_token)
        return max(0, (int(nbytes) - self.kv_fixed_bytes) // per)


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """Measured speed of the loaded model (:func:`ragbudget.budget.measure_prefill_speed`):
    a prefill of ``n`` tokens takes ``prefill_a·n + prefill_b·n²`` seconds, one decode step of
    one sequence ``decode_s``. ``batched``: the backend shares forward passes between running
    requests, and a step of ``k`` sequences then costs ``decode_s + (k-1)·decode_extra_s``;
    otherwise each request runs its own steps and they share the cores.

    >>> t = Throughput(prefill_a=0.001, prefill_b=0.0, decode_s=0.02)
    >>> round(t.request_seconds(prompt_tokens=1000, new_tokens=100), 3)
    3.0
    """

    prefill_a: float
    prefill_b: float = 0.0
    decode_s: float
    batched: bool = False
    decode_extra_s: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.prefill_a < 0 or self.prefill_b < 0 or self.decode_s <= 0:
            raise ConfigError(f"throughput must be positive: prefill a={self.prefill_a}, "
                              f"b={self.prefill_b}, decode {self.decode_s} s/token")

    def prefill_seconds(self, tokens: int) -> float:
        n = max(0, int(tokens))
        return self.prefill_a * n + self.prefill_b * n * n

    def decode_seconds(self, tokens: int) -> float:
        """Single-stream seconds for ``tokens`` decode steps (the work they add)."""
        return self.decode_s * max(0, int(tokens))

    def request_seconds(self, *, prompt_tokens: int, new_tokens: int) -> float:
        """Seconds the request takes alone on the host."""
        return self.prefill_seconds(prompt_tokens) + self.decode_seconds(new_tokens)

    def step_seconds(self, sequences: int) -> float:
        """Seconds of one batched decode step over ``sequences`` sequences."""
        extra = self.decode_s if self.decode_extra_s is None else self.decode_extra_s
        return self.decode_s + max(0, sequences - 1) * extra

    def to_dict(self) -> dict[str, Any]:
        return {"prefill_a": self.prefill_a, "prefill_b": self.prefill_b,
                "decode_s": self.decode_s, "batched": self.batched,
                "decode_extra_s": self.decode_extra_s, "source": self.source}


# --------------------------------------------------------------------------------------------
# The processor-sharing model (pure)
# --------------------------------------------------------------------------------------------


@dataclass(eq=False, kw_only=True)
class _Job:
    """One request in the model: its work in single-stream seconds, what it has received, its
    memory, and (for a promise) the time it can arrive."""

    prefill: float
    decode: float
    cost: int
    served: float = 0.0
    ready: float = float("-inf")

    @property
    def work(self) -> float:
        return self.prefill + self.decode

    def in_prefill(self) -> bool:
        return self.served < self.prefill


def _rates(running: Sequence[_Job], thr: Throughput) -> list[float]:
    """Single-stream seconds of work each running job receives per second of wall time.

    Unbatched: the cores are shared equally (each thread runs its own forward passes). Batched:
    each prefill is one share and the decode batch another; a decoding job gets ``decode_s`` of
    work per batch step of ``step_seconds(k)`` in its share."""
    k = len(running)
    if k == 0:
        return []
    if not thr.batched:
        return [1.0 / k] * k
    decoding = sum(1 for j in running if not j.in_prefill())
    shares = (k - decoding) + (1 if decoding else 0)
    dec_rate = thr.decode_s / (shares * thr.step_seconds(decoding)) if decoding else 0.0
    return [1.0 / shares if j.in_prefill() else dec_rate for j in running]


def _first_token_if_started(job: _Job, running: Sequence[_Job], thr: Throughput) -> float:
    """Seconds to ``job``'s first token if it started now next to ``running`` (who keep
    running meanwhile: an upper bound when some of them end sooner)."""
    probe = _Job(prefill=job.prefill, decode=job.decode, cost=job.cost)
    rate = _rates([*running, probe], thr)[-1]
    return job.prefill / rate if rate > 0 else math.inf


def _may_start(job: _Job, running: Sequence[_Job], used: int, capacity: int,
               thr: Throughput | None, ttft_target: float | None) -> bool:
    if used + job.cost > capacity:
        return False
    if not running or thr is None or ttft_target is None:
        return True  # alone it always starts: otherwise a long prompt would never run
    return _first_token_if_started(job, running, thr) <= ttft_target


def simulate(running: Sequence[_Job], queued: Sequence[_Job], *, throughput: Throughput,
             capacity: int, ttft_target: float | None, now: float = 0.0) -> list[float]:
    """Play the model forward from ``now`` with no further arrivals: when does each queued job
    (in FIFO order; a promise no earlier than its ``ready`` time) produce its first token?

    Running jobs share the host by :func:`_rates`; the head of the queue starts by the start rule
    (memory fits and, next to others, its first token within ``ttft_target``). Returns absolute
    times, one per queued job. Jobs are copied: the arguments are not changed.
    """
    run = [_Job(prefill=j.prefill, decode=j.decode, cost=j.cost, served=j.served) for j in running]
    wait = [_Job(prefill=j.prefill, decode=j.decode, cost=j.cost, ready=j.ready) for j in queued]
    index = {id(j): i for i, j in enumerate(wait)}
    first: list[float] = [math.inf] * len(wait)
    ids: dict[int, int] = {}  # running job -> queued index
    t = now
    for _ in range(8 * (len(run) + len(wait)) + 8):  # each job ends two phases: bounded
        used = sum(j.cost for j in run)
        while wait and wait[0].ready <= t and _may_start(wait[0], run, used, capacity,
                                                          throughput, ttft_target):
            job = wait.pop(0)
            ids[id(job)] = index[id(job)]
            run.append(job)
            used += job.cost
            if job.prefill <= 0:
                first[index[id(job)]] = t
        if not run:
            if not wait:
                break
            t = max(t, wait[0].ready)  # idle until the next promise can arrive
            continue
        rates = _rates(run, throughput)
        # The next event: a job ends its prefill or its work, or the head's promise arrives.
        step = math.inf
        for job, rate in zip(run, rates):
            edge = job.prefill if job.in_prefill() else job.work
            if rate > 0:
                step = min(step, (edge - job.served) / rate)
        if wait and wait[0].ready > t:
            step = min(step, wait[0].ready - t)
        if not math.isfinite(step):
            break
        step = max(step, 0.0)
        t += step
        still: list[_Job] = []
        for job, rate in zip(run, rates):
            was_prefill = job.in_prefill()
            job.served += rate * step
            if was_prefill and job.served >= job.prefill - 1e-9:
                job.served = max(job.served, job.prefill)
                if id(job) in ids and not math.isfinite(first[ids[id(job)]]):
                    first[ids[id(job)]] = t
            if job.served < job.work - 1e-9:
                still.append(job)
        run = still
        if all(math.isfinite(x) for x in first):
            break
    return first


# --------------------------------------------------------------------------------------------
# The controller
# --------------------------------------------------------------------------------------------


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
        for key in ("capacity_bytes", "admitted_bytes", "peak_admitted_bytes", "work_ahead_s"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class _Waiter:
    __slots__ = ("cost", "event", "future", "granted", "job", "loop", "prompt_tokens", "tokens")

    def __init__(self, tokens: int, prompt_tokens: int, cost: int, job: _Job | None) -> None:
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens
        self.cost = cost
        self.job = job
        self.event = threading.Event()
        self.granted = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.future: asyncio.Future[None] | None = None


class Reservation:
    """An admitted reservation of ``tokens`` (and ``nbytes`` of memory); ``release()``
    (idempotent) gives them back."""

    def __init__(self, controller: AdmissionController, tokens: int, *, nbytes: int = 0,
                 job: _Job | None = None) -> None:
        self.controller = controller
        self.tokens = tokens
        self.nbytes = nbytes
        self.job = job
        self.started = controller._clock()
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.controller._release(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(eq=False)
class _Promise:
    due: float
    job: _Job = field(repr=False)


class AdmissionController:
    """Thread- and asyncio-safe FIFO admission by memory (KV tokens, or KV + activation bytes
    with a :class:`MemoryModel`) and by time (with a :class:`Throughput`).

    >>> ctl = AdmissionController(4096, max_queue=8, timeout=5.0)
    >>> with ctl.reserve(1500):
    ...     ctl.stats().admitted_tokens
    1500
    """

    def __init__(self, capacity_tokens: int, *, max_queue: int = 64, timeout: float = 30.0,
                 memory: MemoryModel | None = None, throughput: Throughput | None = None,
                 ttft_target: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
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
        self._lock = threading.Lock()
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._running_jobs: list[_Job] = []
        self._promises: list[_Promise] = []
        self._admitted = 0
        self._admitted_bytes = 0
        self._peak_bytes = 0
        self._running = 0
        self._admitted_total = 0
        self._rejected = 0
        self._timed_out = 0
        self._refused_time = 0
        self._last = clock()
        # Mean seconds a reservation is held (EWMA), for the retry_after hint without a throughput.
        self._hold = 1.0

    def configure(self, *, memory: MemoryModel | None = None,
                  throughput: Throughput | None = None,
                  ttft_target: float | None = None) -> None:
        """Replace the memory model, the throughput and the target (once the model is loaded and
        measured): requests already running keep what they reserved."""
        with self._lock:
            self._advance_locked()
            if memory is not None:
                self.memory = memory
            if throughput is not None:
                self.throughput = throughput
            self.ttft_target = ttft_target if ttft_target and ttft_target > 0 else None
            self._admit_locked()

    @property
    def capacity(self) -> int:
        """What reservations are counted against: bytes with a memory model, else KV tokens."""
        return self.memory.capacity_bytes if self.memory is not None else self.capacity_tokens

    # -- public API ---------------------------------------------------------------------------
    def stats(self) -> AdmissionStats:
        with self._lock:
            self._advance_locked()
            ahead = None
            if self.throughput is not None:
                ahead = round(sum(max(0.0, j.work - j.served) for j in self._running_jobs)
                              + sum(w.job.work for w in self._queue if w.job is not None), 3)
            mem = self.memory is not None
            return AdmissionStats(
                capacity_tokens=self.capacity_tokens,
                running=self._running,
                queued=len(self._queue),
                admitted_tokens=self._admitted,
                admitted_total=self._admitted_total,
                rejected_total=self._rejected,
                timed_out_total=self._timed_out,
                refused_for_time_total=self._refused_time,
                capacity_bytes=self.memory.capacity_bytes if self.memory is not None else None,
                admitted_bytes=self._admitted_bytes if mem else None,
                peak_admitted_bytes=self._peak_bytes if mem else None,
                work_ahead_s=ahead,
            )

    def acquire(self, tokens: int, *, prompt_tokens: int | None = None,
                timeout: float | None = None,
                cancel: threading.Event | None = None) -> Reservation:
        """Block until ``tokens`` (prompt + output, of which ``prompt_tokens`` are the prompt;
        default: all) fit, in arrival order; return the :class:`Reservation`.

        Setting ``cancel`` while waiting leaves the queue at once (within
        ``CANCEL_POLL_S``) and raises :class:`~ragbudget.errors.RequestCancelled`: a client
        that went away must not keep its place, nor keep its thread until the timeout."""
        waiter = self._enqueue(tokens, prompt_tokens)
        if waiter.granted:
            return self._reservation(waiter)
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
                self._release(self._reservation(waiter))
            raise
        return self._finish_wait(waiter, wait)

    @contextlib.contextmanager
    def reserve(self, tokens: int, *, prompt_tokens: int | None = None,
                timeout: float | None = None,
                cancel: threading.Event | None = None) -> Iterator[Reservation]:
        """``with ctl.reserve(n):`` — hold ``n`` tokens for the duration of the block."""
        r = self.acquire(tokens, prompt_tokens=prompt_tokens, timeout=timeout, cancel=cancel)
        try:
            yield r
        finally:
            r.release()

    async def aacquire(self, tokens: int, *, prompt_tokens: int | None = None,
                       timeout: float | None = None) -> Reservation:
        """Async :meth:`acquire`: waits on a future, not a thread."""
        waiter = self._enqueue(tokens, prompt_tokens, loop=asyncio.get_running_loop())
        if waiter.granted:
            return self._reservation(waiter)
        wait = self.timeout if timeout is None else timeout
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
    async def areserve(self, tokens: int, *, prompt_tokens: int | None = None,
                       timeout: float | None = None) -> AsyncIterator[Reservation]:
        """``async with ctl.areserve(n):`` — the asyncio twin of :meth:`reserve`."""
        r = await self.aacquire(tokens, prompt_tokens=prompt_tokens, timeout=timeout)
        try:
            yield r
        finally:
            r.release()

    def expected_first_token(self, tokens: int, *, prompt_tokens: int | None = None) -> float | None:
        """Seconds a request arriving now would wait for its first token under the model
        (``None`` without a throughput)."""
        with self._lock:
            self._advance_locked()
            job = self._job(int(tokens), int(tokens if prompt_tokens is None else prompt_tokens),
                            self._cost(int(tokens), int(tokens if prompt_tokens is None
                                                        else prompt_tokens)))
            return None if job is None else self._first_token_locked(job)

    # -- internals ----------------------------------------------------------------------------
    def _reservation(self, waiter: _Waiter) -> Reservation:
        return Reservation(self, waiter.tokens, nbytes=waiter.cost, job=waiter.job)

    def _cost(self, tokens: int, prompt_tokens: int) -> int:
        if self.memory is None:
            return tokens
        return self.memory.request_bytes(prompt_tokens=prompt_tokens, tokens=tokens)

    def _job(self, tokens: int, prompt_tokens: int, cost: int) -> _Job | None:
        thr = self.throughput
        if thr is None:
            return None
        return _Job(prefill=thr.prefill_seconds(prompt_tokens),
                    decode=thr.decode_seconds(tokens - prompt_tokens), cost=cost)

    def _advance_locked(self) -> None:
        """Credit the running jobs with the work the model says they did since the last event."""
        now = self._clock()
        dt, self._last = max(0.0, now - self._last), now
        thr = self.throughput
        if thr is None or not self._running_jobs or dt == 0:
            return
        for job, rate in zip(self._running_jobs, _rates(self._running_jobs, thr)):
            # A job the model thinks is done while it still runs (it decodes slower than
            # measured) keeps one decode step of work: it is still there.
            job.served = min(job.served + rate * dt, max(job.prefill, job.work - thr.decode_s))

    def _first_token_locked(self, job: _Job, *, promised_first: bool = False) -> float:
        """Seconds to ``job``'s first token if it arrived now. ``promised_first``: behind the
        refused requests told to come back later too (for a refusal's Retry-After: the next
        one is sent back after them, not at the same second)."""
        assert self.throughput is not None
        now = self._clock()
        self._promises = [p for p in self._promises if p.due > now]
        queued = [w.job for w in self._queue if w.job is not None]
        # A returning client cannot be told from a new one, so admission itself judges every
        # arrival by the real work only; promises only space out the refusals.
        promised = [_Job(prefill=p.job.prefill, decode=p.job.decode, cost=p.job.cost, ready=p.due)
                    for p in sorted(self._promises, key=lambda p: p.due)] if promised_first else []
        first = simulate(self._running_jobs, [*queued, *promised, job],
                         throughput=self.throughput, capacity=self.capacity,
                         ttft_target=self.ttft_target, now=now)
        return first[-1] - now

    def _enqueue(self, tokens: int, prompt_tokens: int | None,
                 loop: asyncio.AbstractEventLoop | None = None) -> _Waiter:
        tokens = int(tokens)
        if tokens < 0:
            raise ConfigError(f"cannot reserve a negative number of tokens ({tokens})")
        prompt = tokens if prompt_tokens is None else int(prompt_tokens)
        if not 0 <= prompt <= tokens:
            raise ConfigError(f"prompt_tokens must be between 0 and the {tokens} tokens reserved; "
                              f"got {prompt}")
        cost = self._cost(tokens, prompt)
        if self.memory is None and tokens > self.capacity_tokens:
            raise BudgetError(
                f"this request needs {tokens} KV-cache tokens but the whole cache holds "
                f"{self.capacity_tokens}; lower max_new_tokens or the context budget, or use a "
                "GPU with more memory",
                needed=tokens,
                available=self.capacity_tokens,
            )
        if self.memory is not None and cost > self.memory.capacity_bytes:
            m = self.memory
            raise BudgetError(
                f"this request needs {cost / 2**20:,.1f} MiB ({tokens} KV-cache tokens "
                f"{m.kv_bytes(tokens) / 2**20:,.1f} MiB + the activations of a {prompt}-token "
                f"prefill {m.activation_bytes(prompt) / 2**20:,.1f} MiB) but "
                f"{m.capacity_bytes / 2**20:,.1f} MiB is left beside the weights; lower "
                "max_new_tokens or the context budget, or use a GPU with more memory",
                needed=tokens,
                available=m.tokens_for_bytes(m.capacity_bytes - m.activation_bytes(prompt)),
            )
        with self._lock:
            self._advance_locked()
            job = self._job(tokens, prompt, cost)
            waiter = _Waiter(tokens, prompt, cost, job)
            running = self._running_jobs if job is not None else []
            # Nothing waits and it may start: it runs at once (work conserving — promised returns
            # shape later refusals and their Retry-After, they never hold the host idle).
            if (not self._queue
                    and _may_start(job or _Job(prefill=0, decode=0, cost=cost), running,
                                   self._admitted_cost_locked(), self.capacity,
                                   self.throughput, self.ttft_target)):
                self._grant(waiter)
                return waiter
            if len(self._queue) >= self.max_queue:
                self._rejected += 1
                raise OverloadedError(
                    f"{len(self._queue)} requests already wait for KV-cache space "
                    f"(queue limit {self.max_queue}); retry later",
                    retry_after=self._retry_after_locked(job),
                )
            if job is not None and self.timeout is not None:
                expected = self._first_token_locked(job)
                if expected > self.timeout:
                    self._refused_time += 1
                    # Whole seconds, as Retry-After carries them: the client comes back when,
                    # by the model, the work ahead (and that of the clients sent back before
                    # it) has drained enough.
                    later = self._first_token_locked(job, promised_first=True)
                    retry = float(max(1, math.ceil(later - self.timeout)))
                    self._promises.append(_Promise(due=self._clock() + retry, job=job))
                    raise OverloadedError(
                        f"the first token would come in about {expected:.0f} s (work already "
                        f"running and queued at the measured speed: {self._running} running, "
                        f"{len(self._queue)} queued), past the queue time-out of "
                        f"{self.timeout:g} s; retry after {retry:.0f} s",
                        retry_after=retry,
                    )
            if loop is not None:
                waiter.loop = loop
                waiter.future = loop.create_future()
            self._queue.append(waiter)
        return waiter

    def _admitted_cost_locked(self) -> int:
        return self._admitted_bytes if self.memory is not None else self._admitted

    def _grant(self, waiter: _Waiter) -> None:
        # Called with the lock held.
        waiter.granted = True
        self._admitted += waiter.tokens
        if self.memory is not None:
            self._admitted_bytes += waiter.cost
            self._peak_bytes = max(self._peak_bytes, self._admitted_bytes)
        if waiter.job is not None:
            self._running_jobs.append(waiter.job)
        self._running += 1
        self._admitted_total += 1
        waiter.event.set()
        if waiter.loop is not None and waiter.future is not None:
            fut = waiter.future
            waiter.loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

    def _admit_locked(self) -> None:
        # Strict FIFO: only the head may go; it waits until it fits (memory, and time next to
        # the running requests).
        self._advance_locked()
        while self._queue:
            head = self._queue[0]
            probe = head.job or _Job(prefill=0, decode=0, cost=head.cost)
            if not _may_start(probe, self._running_jobs if head.job is not None else [],
                              self._admitted_cost_locked(), self.capacity,
                              self.throughput, self.ttft_target):
                break
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
            return self._reservation(waiter)
        with self._lock:
            self._timed_out += 1
            retry = self._retry_after_locked(waiter.job)
        held = (f"{self.capacity_tokens} in all, all in use" if self.memory is None else
                f"{self._admitted_bytes / 2**20:,.1f} of {self.memory.capacity_bytes / 2**20:,.1f} "
                f"MiB held by {self._running} running")
        raise OverloadedError(
            f"waited {wait:.1f}s for {waiter.tokens} KV-cache tokens ({held}); retry later or "
            "raise the timeout",
            retry_after=retry,
        )

    def _release(self, r: Reservation) -> None:
        with self._lock:
            self._advance_locked()
            self._admitted -= r.tokens
            if self.memory is not None:
                self._admitted_bytes -= r.nbytes
            if r.job is not None:
                with contextlib.suppress(ValueError):
                    self._running_jobs.remove(r.job)
            self._running -= 1
            held = self._clock() - r.started
            self._hold = 0.8 * self._hold + 0.2 * held
            self._admit_locked()

    def _retry_after_locked(self, job: _Job | None = None) -> float:
        if job is not None and self.throughput is not None:
            # From the measured speed: when this request, arriving now, would start.
            start = self._first_token_locked(job, promised_first=True) - job.prefill
            return float(min(600.0, max(1.0, math.ceil(start))))
        # Roughly: one mean hold time per queued request ahead, spread over the running ones.
        per = self._hold * (len(self._queue) + 1) / max(1, self._running)
        return float(min(60.0, max(0.1, round(per, 2))))
