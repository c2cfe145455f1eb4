"""Admission control: a request runs only while what it pins fits the memory, and its first token
can come within the queue's time-out.

One job: deciding when a request may run — its memory and time rules share one queue, one lock
and one set of reservations, so they stay in one controller.

Memory. A request reserves its worst case: the KV cache of ``prompt + max_new_tokens`` tokens
*and* its own activation peak (the prefill of its prompt, with the attention implementation in
use), given by a :class:`MemoryModel`. Requests run together only while the sum fits. Two
resources are counted, each against its own capacity:

* *bytes* against the memory left beside the weights: each request's activations, and its KV
  bytes unless the KV lives in a pool allocated up front;
* *KV tokens* against that pool when there is one (``MemoryModel.kv_pool_tokens``: continuous
  batching's paged cache, whose bytes are already resident — counting them again per request
  would double-count), in whole pages.

Without a memory model the controller counts KV tokens alone against ``capacity_tokens`` (a
served engine's figure, or a caller that sized it itself).

Time. With a measured :class:`Throughput` (prefill ``a·n + b·n²`` seconds, decode seconds per
token; a request's decode is the share of its ``max_new_tokens`` that finished answers used, the
whole of it until one has finished), the host is modelled as one processor shared by the running
requests (threads each running their own ``generate`` share the cores; a backend that batches
shares forward passes, and then decoding sequences cost only the marginal step). Two decisions follow from the model:

* *start*: the head of the queue starts when it fits the memory and, if others run on a backend
  that does not batch, its prefill shared with them still ends within ``ttft_target`` (the
  time-to-first-token target that also caps the context on a CPU): threads sharing the cores
  gain no throughput, so running them one after another gives the same tokens/s and sooner
  first tokens. Alone it always starts; on a batching backend, whose shared forward passes
  raise the throughput of all, it starts while its first token still comes within the queue
  time-out;
* *arrival*: a request whose expected first token — after the work already running and queued,
  played forward by :func:`simulate` — lies beyond the queue time-out is refused at once with
  :class:`~ragbudget.errors.OverloadedError` and a ``retry_after`` equal to the excess (whole
  seconds). Each refusal is remembered as a *promise*: a request expected back at that time, so
  the next refusal is told a later time instead of sending every client back at the same second.

Returning clients. A refusal's promise can carry a *key* (the server uses a hash of the request
body, which a client retrying the same request sends again). A request made with that key
(:meth:`AdmissionController.returning`) from one second before the promised time until ten
seconds (or one queue time-out, if longer) after it *claims* the promise: it is never refused for
time, it joins the FIFO queue, and it waits there for its turn up to half an hour
(:attr:`AdmissionController.return_wait`) instead of one queue time-out — so a client that honoured
``Retry-After`` is served even when the host ran slower than measured, and still within a
bounded time. New arrivals are judged by the work really
running and queued (an unkeyed caller cannot be told from a returning one), so a promise never
holds the host idle.

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
import contextvars
import dataclasses
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import BudgetError, ConfigError, OverloadedError, RequestCancelled

# How often a waiter with a cancel event looks at it: threading.Event cannot wake on either of two
# events, and 50 ms is well below the latency of any request that has to queue.
CANCEL_POLL_S = 0.05

# The key of a request made under AdmissionController.returning(): read by acquire in the same
# thread (or task), so the key need not travel through every layer between the server's request
# and the pipeline's reservation.
_RETURNING: contextvars.ContextVar[str | None] = contextvars.ContextVar("ragbudget_returning", default=None)
# Called (no arguments) when a returning request claimed its place and waits in the queue: the
# server then commits a streamed answer to 200 and keeps the connection alive while it waits.
_ON_CLAIM: contextvars.ContextVar[Callable[[], Any] | None] = contextvars.ContextVar("ragbudget_on_claim", default=None)

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

    ``kv_pool_tokens``: the KV cache is a pool of that many tokens allocated up front (a paged
    cache, taken in pages of ``kv_pool_page`` tokens). Its bytes are then resident whatever
    runs, so they belong outside ``capacity_bytes`` (the caller subtracts them), a request's
    bytes are its activations alone, and its KV counts in tokens against the pool.

    >>> m = MemoryModel(capacity_bytes=10_000, kv_bytes_per_token=2, activation=lambda n: 3 * n)
    >>> m.request_bytes(prompt_tokens=100, tokens=150)
    600
    >>> paged = MemoryModel(capacity_bytes=10_000, kv_bytes_per_token=2, kv_pool_tokens=1024,
    ...                     kv_pool_page=32, activation=lambda n: 3 * n)
    >>> paged.request_bytes(prompt_tokens=100, tokens=150), paged.pool_tokens(150)
    (300, 160)
    """

    capacity_bytes: int
    kv_bytes_per_token: int
    kv_fixed_bytes: int = 0
    activation: Callable[[int], int] | None = None
    kv_pool_tokens: int | None = None
    kv_pool_page: int = 1
    #: Where the figures came from, for logs and /health (``"plan: host RAM available …"``).
    source: str = ""

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ConfigError(
                f"capacity_bytes must be > 0; got {self.capacity_bytes} (the weights leave no memory for requests)"
            )
        if self.kv_bytes_per_token < 0 or self.kv_fixed_bytes < 0:
            raise ConfigError("KV bytes per token and per sequence must be >= 0")
        if self.kv_pool_tokens is not None and self.kv_pool_tokens <= 0:
            raise ConfigError(f"kv_pool_tokens must be > 0; got {self.kv_pool_tokens} (a paged cache without blocks)")
        if self.kv_pool_page < 1:
            raise ConfigError(f"kv_pool_page must be >= 1; got {self.kv_pool_page}")

    @property
    def pooled(self) -> bool:
        """Whether the KV lives in a pool allocated up front (counted in tokens, not bytes)."""
        return self.kv_pool_tokens is not None

    def pool_tokens(self, tokens: int) -> int:
        """Pool tokens a request of ``tokens`` takes: whole pages."""
        page = self.kv_pool_page
        return -(-max(0, int(tokens)) // page) * page

    def kv_bytes(self, tokens: int) -> int:
        return self.kv_fixed_bytes + self.kv_bytes_per_token * int(tokens)

    def activation_bytes(self, prompt_tokens: int) -> int:
        return int(self.activation(int(prompt_tokens))) if self.activation is not None else 0

    def request_bytes(self, *, prompt_tokens: int, tokens: int) -> int:
        """KV of ``tokens`` (prompt + output) plus the activation peak of a ``prompt_tokens``
        prefill; the activations alone when the KV lives in a pool (already resident)."""
        kv = 0 if self.pooled else self.kv_bytes(tokens)
        return kv + self.activation_bytes(prompt_tokens)

    def tokens_for_bytes(self, nbytes: int) -> int:
        """KV tokens that ``nbytes`` holds (ignoring activations): for the token figures."""
        per = max(1, self.kv_bytes_per_token)
        return max(0, (int(nbytes) - self.kv_fixed_bytes) // per)


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """Measured speed of the loaded model (:func:`ragbudget.memory.budget.measure_prefill_speed`):
    a prefill of ``n`` tokens takes ``prefill_a·n + prefill_b·n²`` seconds, one decode step of
    one sequence ``decode_s``. ``batched``: the backend shares forward passes between running
    requests, and a step of ``k`` sequences then costs ``decode_s + (k-1)·decode_extra_s``;
    otherwise each request runs its own steps and they share the cores.

    ``slowdown``: wall seconds per modelled second now, learnt from the requests that ran (the
    controller's :meth:`~AdmissionController.observe`): a host busy with other work runs the
    model slower than it was measured, and the time rules must see the speed it has now.

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
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        if not self.slowdown > 0:
            raise ConfigError(f"slowdown must be > 0; got {self.slowdown}")
        if self.prefill_a < 0 or self.prefill_b < 0 or self.decode_s <= 0:
            raise ConfigError(
                f"throughput must be positive: prefill a={self.prefill_a}, "
                f"b={self.prefill_b}, decode {self.decode_s} s/token"
            )

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
        return {
            "prefill_a": self.prefill_a,
            "prefill_b": self.prefill_b,
            "decode_s": self.decode_s,
            "batched": self.batched,
            "decode_extra_s": self.decode_extra_s,
            "source": self.source,
            "slowdown": self.slowdown,
        }


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
    tokens: int = 0  # KV tokens held in a pool (counted only against a token capacity)
    served: float = 0.0
    credit: float = 0.0  # work the model would have credited at slowdown 1, uncapped (observe)
    ready: float = float("-inf")
    new_max: int = 0  # the answer's max_new_tokens (its decode above is the expected share)

    @property
    def work(self) -> float:
        return self.prefill + self.decode

    def in_prefill(self) -> bool:
        return self.served < self.prefill


def _rates(running: Sequence[_Job], thr: Throughput) -> list[float]:
    """Single-stream seconds of work each running job receives per second of wall time.

    Unbatched: the cores are shared equally (each thread runs its own forward passes). Batched:
    each prefill is one share and the decode batch another; a decoding job gets ``decode_s`` of
    work per batch step of ``step_seconds(k)`` in its share. Both are divided by the host's
    current ``slowdown``."""
    k = len(running)
    if k == 0:
        return []
    slow = thr.slowdown
    if not thr.batched:
        return [1.0 / (k * slow)] * k
    decoding = sum(1 for j in running if not j.in_prefill())
    shares = (k - decoding) + (1 if decoding else 0)
    dec_rate = thr.decode_s / (shares * thr.step_seconds(decoding)) if decoding else 0.0
    return [(1.0 / shares if j.in_prefill() else dec_rate) / slow for j in running]


def _first_token_if_started(job: _Job, running: Sequence[_Job], thr: Throughput) -> float:
    """Seconds to ``job``'s first token if it started now next to ``running`` (who keep
    running meanwhile: an upper bound when some of them end sooner)."""
    probe = _Job(prefill=job.prefill, decode=job.decode, cost=job.cost)
    rate = _rates([*running, probe], thr)[-1]
    return job.prefill / rate if rate > 0 else math.inf


def _may_start(
    job: _Job,
    running: Sequence[_Job],
    used: int,
    capacity: int,
    thr: Throughput | None,
    ttft_target: float | None,
    *,
    used_tokens: int = 0,
    token_capacity: int | None = None,
    batched_bound: float | None = None,
) -> bool:
    if used + job.cost > capacity:
        return False
    if token_capacity is not None and used_tokens + job.tokens > token_capacity:
        return False
    if not running or thr is None or ttft_target is None:
        return True  # alone it always starts: otherwise a long prompt would never run
    if thr.batched:
        # Sharing forward passes raises the tokens/s of all: it starts next to the others while
        # its first token still comes within ``batched_bound`` (the queue time-out), not the
        # TTFT target — with the context capped so that a prefill alone takes the whole target,
        # that rule would never let a full-length request share a batch.
        bound = ttft_target if batched_bound is None else max(ttft_target, batched_bound)
        return _first_token_if_started(job, running, thr) <= bound
    return _first_token_if_started(job, running, thr) <= ttft_target


def simulate(
    running: Sequence[_Job],
    queued: Sequence[_Job],
    *,
    throughput: Throughput,
    capacity: int,
    ttft_target: float | None,
    now: float = 0.0,
    token_capacity: int | None = None,
    batched_bound: float | None = None,
) -> list[float]:
    """Play the model forward from ``now`` with no further arrivals: when does each queued job
    (in FIFO order; a promise no earlier than its ``ready`` time) produce its first token?

    Running jobs share the host by :func:`_rates`; the head of the queue starts by the start rule
    (its bytes fit ``capacity``, its pool tokens ``token_capacity`` when given, and, next to
    others, its first token comes within ``ttft_target``). Returns absolute
    times, one per queued job. Jobs are copied: the arguments are not changed.
    """
    run = [_Job(prefill=j.prefill, decode=j.decode, cost=j.cost, tokens=j.tokens, served=j.served) for j in running]
    wait = [_Job(prefill=j.prefill, decode=j.decode, cost=j.cost, tokens=j.tokens, ready=j.ready) for j in queued]
    index = {id(j): i for i, j in enumerate(wait)}
    first: list[float] = [math.inf] * len(wait)
    ids: dict[int, int] = {}  # running job -> queued index
    t = now
    for _ in range(8 * (len(run) + len(wait)) + 8):  # each job ends two phases: bounded
        used = sum(j.cost for j in run)
        used_tokens = sum(j.tokens for j in run)
        while (
            wait
            and wait[0].ready <= t
            and _may_start(
                wait[0],
                run,
                used,
                capacity,
                throughput,
                ttft_target,
                used_tokens=used_tokens,
                token_capacity=token_capacity,
                batched_bound=batched_bound,
            )
        ):
            job = wait.pop(0)
            ids[id(job)] = index[id(job)]
            run.append(job)
            used += job.cost
            used_tokens += job.tokens
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
        for job, rate in zip(run, rates, strict=True):
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
        for job, rate in zip(run, rates, strict=True):
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
    slowdown: float | None = None  # with a throughput: wall s per measured s, learnt (observe)

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
        for key in ("capacity_bytes", "admitted_bytes", "peak_admitted_bytes", "work_ahead_s", "slowdown"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class _Waiter:
    __slots__ = (
        "arrived",
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
    )

    def __init__(self, tokens: int, prompt_tokens: int, cost: int, job: _Job | None, pool: int = 0) -> None:
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens
        self.cost = cost
        self.pool = pool  # tokens of a KV pool (paged cache) it holds, in whole pages
        self.job = job
        self.event = threading.Event()
        self.granted = False
        self.returning = False  # it claimed a refusal's promise (see the module docstring)
        self.arrived = float("-inf")  # the controller's clock when it was queued
        self.loop: asyncio.AbstractEventLoop | None = None
        self.future: asyncio.Future[None] | None = None


class Reservation:
    """An admitted reservation of ``tokens`` (and ``nbytes`` of memory); ``release()``
    (idempotent) gives them back."""

    def __init__(
        self, controller: AdmissionController, tokens: int, *, nbytes: int = 0, job: _Job | None = None, pool: int = 0
    ) -> None:
        self.controller = controller
        self.tokens = tokens
        self.nbytes = nbytes
        self.pool = pool
        self.job = job
        self.started = controller._clock()
        self._released = False
        self._first_seen = False

    def first_token(self) -> None:
        """Its first token came now: lets the controller compare its prefill with the model
        (idempotent; see :meth:`AdmissionController.observe`)."""
        if not self._first_seen and not self._released:
            self._first_seen = True
            self.controller._observe_job(self.job, done=None)

    def finish(self, new_tokens: int) -> None:
        """It ended having generated ``new_tokens`` (call before :meth:`release`): lets the
        controller compare the whole request with the model."""
        if not self._released:
            self.controller._observe_job(self.job, done=int(new_tokens))

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.controller._release(self)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _behind(sent_back: int) -> str:
    """What a time refusal's Retry-After also waits for: the clients sent back before it, who
    come first (so it says more than the first token's excess over the time-out)."""
    if not sent_back:
        return ""
    return f"; it comes back behind the {sent_back} client(s) told to come back before it"


def _resolve(fut: asyncio.Future[None]) -> None:
    """Wake an async waiter (in its loop), unless it already left."""
    if not fut.done():
        fut.set_result(None)


def _claimed(waiter: _Waiter) -> None:
    """Tell the caller (``returning(on_claim=)``) that ``waiter`` claimed its place and waits."""
    callback = _ON_CLAIM.get()
    if waiter.returning and callback is not None:
        callback()


@dataclass(eq=False)
class _Promise:
    due: float
    job: _Job | None = field(repr=False)  # None without a throughput (no time model to shape)
    key: str | None = None  # the refused request's key: its return claims the promise
    held_until: float = float("-inf")  # seen back (would_refuse): kept for its acquire until then
    made: float = float("-inf")  # when the refusal was made (see _finish_wait)


class AdmissionController:
    """Thread- and asyncio-safe FIFO admission by memory (KV tokens, or KV + activation bytes
    with a :class:`MemoryModel`, or activation bytes and the tokens of a paged KV pool) and by
    time (with a :class:`Throughput`).

    Every ``retry_after`` is the model's estimate of when the work ahead (running, queued, and
    the clients already sent back) leaves room, at the speed learnt from the requests that ran:
    a burst on a slow host honestly takes minutes to drain, and a client told less than that
    only comes back to be refused again. It is at least 1 s and at most ``RETRY_AFTER_MAX_S``
    (past half an hour the estimate says more about a speed measured on a busy host than about
    when there will be room, and a client told an hour has been refused for good). A client back
    at its time claims its place (see the module docstring) and waits for it up to
    ``RETRY_AFTER_MAX_S`` too (:attr:`return_wait`), which absorbs a model that ran fast.

    >>> ctl = AdmissionController(4096, max_queue=8, timeout=5.0)
    >>> with ctl.reserve(1500):
    ...     ctl.stats().admitted_tokens
    1500
    """

    #: The longest Retry-After, and the longest a returning client waits for its place (see the
    #: class docstring).
    RETRY_AFTER_MAX_S = 1800.0
    #: A returning client may come this many seconds before its promised time (Retry-After is
    #: whole seconds, and clients round and sleep imprecisely).
    RETURN_EARLY_S = 1.0

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
        self._lock = threading.Lock()
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._running_jobs: list[_Job] = []
        self._promises: list[_Promise] = []
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
        # The share of max_new_tokens finished answers generated (EWMA, from 1: the worst case
        # until answers are seen): the expected decode work of a request (see _job).
        self._answer_share = 1.0
        # Observations of the speed in use (observe: the first ones are provisional).
        self._observed = 0

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
                self._observed = 0  # a new measurement: provisional again (observe)
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

    @staticmethod
    @contextlib.contextmanager
    def returning(key: str | None, *, on_claim: Callable[[], Any] | None = None) -> Iterator[None]:
        """Requests made inside the block (in this thread or task) carry ``key``: refused for
        time, they leave a promise under it; coming back with it at the promised time, they claim
        it (see the module docstring). ``None`` is a request without a key. ``on_claim`` is
        called when such a request claimed its place and has to wait for it in the queue."""
        token, claim = _RETURNING.set(key), _ON_CLAIM.set(on_claim)
        try:
            yield
        finally:
            _ON_CLAIM.reset(claim)
            _RETURNING.reset(token)

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
            )

    def acquire(
        self,
        tokens: int,
        *,
        prompt_tokens: int | None = None,
        timeout: float | None = None,
        cancel: threading.Event | None = None,
    ) -> Reservation:
        """Block until ``tokens`` (prompt + output, of which ``prompt_tokens`` are the prompt;
        default: all) fit, in arrival order; return the :class:`Reservation`.

        Setting ``cancel`` while waiting leaves the queue at once (within
        ``CANCEL_POLL_S``) and raises :class:`~ragbudget.errors.RequestCancelled`: a client
        that went away must not keep its place, nor keep its thread until the timeout."""
        waiter = self._enqueue(tokens, prompt_tokens)
        if waiter.granted:
            return self._reservation(waiter)
        _claimed(waiter)
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
        timeout: float | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[Reservation]:
        """``with ctl.reserve(n):`` — hold ``n`` tokens for the duration of the block."""
        r = self.acquire(tokens, prompt_tokens=prompt_tokens, timeout=timeout, cancel=cancel)
        try:
            yield r
        finally:
            r.release()

    async def aacquire(
        self, tokens: int, *, prompt_tokens: int | None = None, timeout: float | None = None
    ) -> Reservation:
        """Async :meth:`acquire`: waits on a future, not a thread."""
        waiter = self._enqueue(tokens, prompt_tokens, loop=asyncio.get_running_loop())
        if waiter.granted:
            return self._reservation(waiter)
        _claimed(waiter)
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
        self, tokens: int, *, prompt_tokens: int | None = None, timeout: float | None = None
    ) -> AsyncIterator[Reservation]:
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
            if not self._queue and self._may_start_locked(_Waiter(tokens, prompt, cost, job, pool)):
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
        promise = self._promise_for_locked(_RETURNING.get())
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
            self._promise_locked(job, retry)
            return retry

    def _refuse_for_time_locked(self, job: _Job) -> float:
        """Count a refusal for time and promise the client a return: its ``retry_after``."""
        assert self.timeout is not None
        self._refused_time += 1
        # Whole seconds, as Retry-After carries them: the client comes back when, by the model,
        # the work ahead (and that of the clients sent back before it) has drained enough.
        later = self._first_token_locked(job, promised_first=True)
        retry = float(min(self.retry_after_max, max(1, math.ceil(later - self.timeout))))
        self._promise_locked(job, retry)
        return retry

    def _promise_locked(self, job: _Job | None, retry: float) -> None:
        """Remember a refusal told to come back in ``retry`` seconds (under the request's key).
        Without a job (nothing measured) only a keyed refusal is remembered: its return is kept
        a place, and there is no time model for it to shape."""
        key = _RETURNING.get()
        if job is not None or key is not None:
            now = self._clock()
            self._promises.append(_Promise(due=now + retry, job=job, key=key, made=now))

    def _promise_for_locked(self, key: str | None) -> _Promise | None:
        """The promise a request with ``key`` arriving now would claim: the earliest due one
        under that key whose time has come (``RETURN_EARLY_S`` early at most)."""
        if key is None:
            return None
        now = self._clock()
        self._prune_promises_locked(now)
        due = [p for p in self._promises if p.key == key and p.due - self.RETURN_EARLY_S <= now]
        return min(due, key=lambda p: p.due) if due else None

    #: A promise stays claimable this long after its time at least (or one queue time-out, if
    #: longer): a client's own work and sleep make it late by a little.
    RETURN_LATE_S = 10.0

    def _prune_promises_locked(self, now: float) -> None:
        # A client that never comes back stops shaping the others' Retry-After after the grace.
        grace = max(self.RETURN_LATE_S, self.timeout if self.timeout is not None else 0.0)
        self._promises = [p for p in self._promises if max(p.due + grace, p.held_until) > now]

    def _wait_for(self, waiter: _Waiter, timeout: float | None) -> float:
        """Seconds ``waiter`` may wait: ``timeout`` when given, else the queue time-out — or, for
        a returning client, :attr:`return_wait`."""
        if timeout is not None:
            return timeout
        if waiter.returning and self.return_wait is not None:
            return self.return_wait
        return self.timeout

    # -- internals ----------------------------------------------------------------------------
    def _reservation(self, waiter: _Waiter) -> Reservation:
        return Reservation(self, waiter.tokens, nbytes=waiter.cost, job=waiter.job, pool=waiter.pool)

    def _pool(self, tokens: int) -> int:
        """Tokens of the KV pool a request of ``tokens`` holds (0 without a pool)."""
        m = self.memory
        return m.pool_tokens(tokens) if m is not None and m.pooled else 0

    def _cost(self, tokens: int, prompt_tokens: int) -> int:
        if self.memory is None:
            return tokens
        return self.memory.request_bytes(prompt_tokens=prompt_tokens, tokens=tokens)

    def _job(self, tokens: int, prompt_tokens: int, cost: int, pool: int = 0) -> _Job | None:
        thr = self.throughput
        if thr is None:
            return None
        # Time counts the answer's expected length (memory still reserves all of it): a burst
        # judged by max_new_tokens when answers stop at a third of it sends clients back late and
        # leaves the host idle meanwhile.
        new = tokens - prompt_tokens
        return _Job(
            prefill=thr.prefill_seconds(prompt_tokens),
            decode=thr.decode_seconds(math.ceil(new * self._answer_share)),
            cost=cost,
            tokens=pool,
            new_max=new,
        )

    def _may_start_locked(self, waiter: _Waiter) -> bool:
        """The start rule for ``waiter`` now: both resources fit, and time (see the module)."""
        probe = waiter.job or _Job(prefill=0, decode=0, cost=waiter.cost, tokens=waiter.pool)
        return _may_start(
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
        for job, rate in zip(self._running_jobs, _rates(self._running_jobs, thr), strict=True):
            # A job the model thinks is done while it still runs (it decodes slower than
            # measured) keeps one decode step of work: it is still there.
            job.served = min(job.served + rate * dt, max(job.prefill, job.work - thr.decode_s))
            # At slowdown 1: the job's own slowdown is then credit / work done, whatever the
            # learnt slowdown was while it ran (applying a ratio to a slowdown learnt since would
            # overshoot when many long requests end together).
            job.credit += rate * dt * thr.slowdown

    #: How far one finished answer moves the expected share of max_new_tokens, and its floor.
    ANSWER_WEIGHT = 0.2
    MIN_ANSWER_SHARE = 0.05

    #: How far one observation moves the learnt slowdown (in log space), and its bounds.
    OBSERVE_WEIGHT = 0.5
    SLOWDOWN_RANGE = (0.1, 100.0)
    #: Observations during which a speed is provisional (see :meth:`observe`).
    PROVISIONAL_OBSERVATIONS = 3

    def observe(self, slowdown: float) -> None:
        """Learn from one request: ``slowdown`` is the wall time it took over what the measured
        speed says (above 1: the host runs slower than measured). The throughput's ``slowdown``
        moves that way in log space by ``OBSERVE_WEIGHT`` (bounded by ``SLOWDOWN_RANGE``), so a
        host that got busy after the measurement — or idle again — is followed within a few
        requests.

        A speed just measured (a new throughput, :meth:`configure`) is provisional for its first
        ``PROVISIONAL_OBSERVATIONS`` observations: each one slower than the model is taken whole,
        the slower of the two standing. The warm-up probe times bare forward passes of the model
        alone, and real requests have run 7-8 times slower than it (issue #30): blending that in
        by halves would admit the first requests on a speed the host cannot give."""
        with self._lock:
            self._observe_locked(slowdown)

    def _observe_locked(self, sample: float) -> None:
        thr = self.throughput
        if thr is None or not (sample > 0 and math.isfinite(sample)):
            return
        lo, hi = self.SLOWDOWN_RANGE
        if self._observed < self.PROVISIONAL_OBSERVATIONS:
            slow = min(hi, max(lo, thr.slowdown, sample))
        else:
            w = self.OBSERVE_WEIGHT
            slow = min(hi, max(lo, thr.slowdown ** (1 - w) * sample**w))
        self._observed += 1
        self.throughput = dataclasses.replace(thr, slowdown=slow)

    def _observe_job(self, job: _Job | None, *, done: int | None) -> None:
        """A running job's first token (``done`` None: its prefill is over) or its end with
        ``done`` new tokens: compare the model's credit with the work really done."""
        if job is None or self.throughput is None:
            return
        with self._lock:
            self._advance_locked()
            thr = self.throughput
            if done is not None and job.new_max > 0:
                share = min(1.0, max(0, done) / job.new_max)
                w = self.ANSWER_WEIGHT
                self._answer_share = max(self.MIN_ANSWER_SHARE, (1 - w) * self._answer_share + w * share)
            real = job.prefill if done is None else job.prefill + thr.decode_seconds(done)
            if real <= 0 or job.credit <= 0:
                return
            self._observe_locked(job.credit / real)

    def _first_token_locked(
        self, job: _Job, *, promised_first: bool = False, promised_before: float = float("inf")
    ) -> float:
        """Seconds to ``job``'s first token if it arrived now. ``promised_first``: behind the
        refused requests told to come back later too (for a refusal's Retry-After: the next
        one is sent back after them, not at the same second) — those refused before
        ``promised_before`` only, when given."""
        assert self.throughput is not None
        now = self._clock()
        self._prune_promises_locked(now)
        queued = [w.job for w in self._queue if w.job is not None]
        # Admission judges every new arrival by the real work only (an unkeyed returning client
        # cannot be told from a new one); promises space out the refusals, and a keyed return
        # claims its own (see the module docstring).
        promised = (
            [
                _Job(prefill=p.job.prefill, decode=p.job.decode, cost=p.job.cost, tokens=p.job.tokens, ready=p.due)
                for p in sorted(self._promises, key=lambda p: p.due)
                if p.job is not None and p.made < promised_before
            ]
            if promised_first
            else []
        )
        first = simulate(
            self._running_jobs,
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
        self, tokens: int, prompt_tokens: int | None, loop: asyncio.AbstractEventLoop | None = None
    ) -> _Waiter:
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
        if self.memory is not None and cost > self.memory.capacity_bytes:
            m = self.memory
            kv = (
                f"{tokens} KV-cache tokens in the paged cache, already allocated"
                if m.pooled
                else f"{tokens} KV-cache tokens {m.kv_bytes(tokens) / 2**20:,.1f} MiB"
            )
            raise BudgetError(
                f"this request needs {cost / 2**20:,.1f} MiB ({kv} + the activations of a {prompt}-token "
                f"prefill {m.activation_bytes(prompt) / 2**20:,.1f} MiB) but "
                f"{m.capacity_bytes / 2**20:,.1f} MiB is left beside the weights; lower "
                "max_new_tokens or the context budget, or use a GPU with more memory",
                needed=tokens,
                available=m.tokens_for_bytes(m.capacity_bytes - m.activation_bytes(prompt)),
            )
        if self.token_capacity is not None and pool > self.token_capacity:
            raise BudgetError(
                f"this request needs {tokens} KV-cache tokens ({pool} in whole pages) but the "
                f"paged cache of batched generation holds {self.token_capacity} for all requests "
                "together; lower max_new_tokens or the context budget, or give the batch cache "
                "more tokens (LocalBackend(batch_kv_tokens=...))",
                needed=pool,
                available=self.token_capacity,
            )
        with self._lock:
            self._advance_locked()
            job = self._job(tokens, prompt, cost, pool)
            waiter = _Waiter(tokens, prompt, cost, job, pool)
            promise = self._promise_for_locked(_RETURNING.get())
            if promise is not None:  # a client back when it was told: its promise is kept
                self._promises.remove(promise)
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
                self._promise_locked(job, retry)
                raise OverloadedError(
                    f"{len(self._queue)} requests already wait for KV-cache space (queue limit {self.max_queue})",
                    retry_after=retry,
                )
            if job is not None and self.timeout is not None and not waiter.returning:
                expected = self._first_token_locked(job)
                if expected > self.timeout:
                    sent_back = len(self._promises)
                    retry = self._refuse_for_time_locked(job)
                    raise OverloadedError(
                        f"the first token would come in about {expected:.{1 if expected < 10 else 0}f} s (work already "
                        f"running and queued at the measured speed: {self._running} running, "
                        f"{len(self._queue)} queued), past the queue time-out of {self.timeout:g} s"
                        + _behind(sent_back),
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

    def _grant(self, waiter: _Waiter) -> None:
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
            retry = self._retry_after_locked(waiter.job, arrived=waiter.arrived)
            self._promise_locked(waiter.job, retry)  # its return is kept a place, as for time
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

    def _retry_after_locked(self, job: _Job | None = None, *, arrived: float = float("inf")) -> float:
        if job is not None and self.throughput is not None:
            # From the measured speed: when this request, arriving now, would start — behind
            # the clients refused before it ``arrived`` (a queue time-out waited since then:
            # sending it behind every client refused while it waited puts the one that waited
            # longest last).
            start = self._first_token_locked(job, promised_first=True, promised_before=arrived) - job.prefill
            return float(min(self.retry_after_max, max(1.0, math.ceil(start))))
        # Roughly: one mean hold time per queued request ahead, spread over the running ones.
        per = self._hold * (len(self._queue) + 1) / max(1, self._running)
        return float(min(self.retry_after_max, max(0.1, round(per, 2))))
