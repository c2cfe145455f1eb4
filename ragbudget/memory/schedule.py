"""What a request costs and when it would run: the models admission control
(:class:`~ragbudget.memory.admission.AdmissionController`) decides by, as pure functions of them.

Memory. A request reserves its worst case: the KV cache of ``prompt + max_new_tokens`` tokens
*and* its own activation peak (the prefill of its prompt, with the attention implementation in
use), given by a :class:`MemoryModel`. Requests run together only while the sum fits. Two
resources are counted, each against its own capacity:

* *bytes* against the memory left beside the weights: each request's activations, and its KV
  bytes unless the KV lives in a pool allocated up front;
* *KV tokens* against that pool when there is one (``MemoryModel.kv_pool_tokens``: continuous
  batching's paged cache, whose bytes are already resident — counting them again per request
  would double-count), in whole pages.

Time. With a measured :class:`Throughput` (prefill ``a·n + b·n²`` seconds, decode seconds per
token), the host is modelled as one processor shared by the running requests (threads each
running their own ``generate`` share the cores; a backend that batches shares forward passes,
and then decoding sequences cost only the marginal step). The *start* rule follows from it: the
head of the queue starts when it fits the memory and, if others run on a backend that does not
batch, its prefill shared with them still ends within ``ttft_target`` (the time-to-first-token
target that also caps the context on a CPU): threads sharing the cores gain no throughput, so
running them one after another gives the same tokens/s and sooner first tokens. Alone it always
starts; on a batching backend, whose shared forward passes raise the throughput of all, it starts
while its first token still comes within the queue time-out. :func:`simulate` plays that forward
to tell when each queued request would produce its first token.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import BudgetError, ConfigError

__all__ = ["Job", "Learning", "MemoryModel", "Throughput", "first_token_if_started", "simulate"]


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

    def check_fits(self, *, prompt_tokens: int, tokens: int) -> None:
        """Raise :class:`~ragbudget.errors.BudgetError` when a request of ``tokens`` (``prompt_tokens``
        of prompt) can never run, whatever else runs: its bytes exceed the whole capacity, or its
        pages the whole pool."""
        cost = self.request_bytes(prompt_tokens=prompt_tokens, tokens=tokens)
        if cost > self.capacity_bytes:
            kv = (
                f"{tokens} KV-cache tokens in the paged cache, already allocated"
                if self.pooled
                else f"{tokens} KV-cache tokens {self.kv_bytes(tokens) / 2**20:,.1f} MiB"
            )
            raise BudgetError(
                f"this request needs {cost / 2**20:,.1f} MiB ({kv} + the activations of a {prompt_tokens}-token "
                f"prefill {self.activation_bytes(prompt_tokens) / 2**20:,.1f} MiB) but "
                f"{self.capacity_bytes / 2**20:,.1f} MiB is left beside the weights; lower "
                "max_new_tokens or the context budget, or use a GPU with more memory",
                needed=tokens,
                available=self.tokens_for_bytes(self.capacity_bytes - self.activation_bytes(prompt_tokens)),
            )
        pool = self.pool_tokens(tokens)
        if self.kv_pool_tokens is not None and pool > self.kv_pool_tokens:
            raise BudgetError(
                f"this request needs {tokens} KV-cache tokens ({pool} in whole pages) but the "
                f"paged cache of batched generation holds {self.kv_pool_tokens} for all requests "
                "together; lower max_new_tokens or the context budget, or give the batch cache "
                "more tokens (LocalBackend(batch_kv_tokens=...))",
                needed=pool,
                available=self.kv_pool_tokens,
            )


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """Measured speed of the loaded model (:func:`ragbudget.memory.calibration.measure_prefill_speed`):
    a prefill of ``n`` tokens takes ``prefill_a·n + prefill_b·n²`` seconds, one decode step of
    one sequence ``decode_s``. ``batched``: the backend shares forward passes between running
    requests, and a step of ``k`` sequences then costs ``decode_s + (k-1)·decode_extra_s``;
    otherwise each request runs its own steps and they share the cores.

    ``slowdown``: wall seconds per modelled second now, learnt from the requests that ran (the
    controller's :meth:`~AdmissionController.observe`): a host busy with other work runs the
    model slower than it was measured, and the time rules must see the speed it has now.

    >>> t = Throughput(prefill_a=0.001, prefill_b=0.0, decode_s=0.02)
    >>> t.prefill_seconds(1000), t.decode_seconds(100), t.step_seconds(4)   # s: 1,000-token prefill, 100 steps
    (1.0, 2.0, 0.08)
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
class Job:
    """One request in the model (:func:`simulate` plays running and queued ones forward): its
    work in single-stream seconds, what it has received, its memory, and (for a promise) the
    time it can arrive."""

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


def job_rates(running: Sequence[Job], thr: Throughput) -> list[float]:
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


def first_token_if_started(job: Job, running: Sequence[Job], thr: Throughput) -> float:
    """Seconds to ``job``'s first token if it started now next to ``running`` (who keep
    running meanwhile: an upper bound when some of them end sooner)."""
    probe = Job(prefill=job.prefill, decode=job.decode, cost=job.cost)
    rate = job_rates([*running, probe], thr)[-1]
    return job.prefill / rate if rate > 0 else math.inf


def may_start(
    job: Job,
    running: Sequence[Job],
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
        return first_token_if_started(job, running, thr) <= bound
    return first_token_if_started(job, running, thr) <= ttft_target


def simulate(
    running: Sequence[Job],
    queued: Sequence[Job],
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

    Running jobs share the host by :func:`job_rates`; the head of the queue starts by the start rule
    (its bytes fit ``capacity``, its pool tokens ``token_capacity`` when given, and, next to
    others, its first token comes within ``ttft_target``). Returns absolute
    times, one per queued job. Jobs are copied: the arguments are not changed.
    """
    run = [Job(prefill=j.prefill, decode=j.decode, cost=j.cost, tokens=j.tokens, served=j.served) for j in running]
    wait = [Job(prefill=j.prefill, decode=j.decode, cost=j.cost, tokens=j.tokens, ready=j.ready) for j in queued]
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
            and may_start(
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
        rates = job_rates(run, throughput)
        step = _next_event(run, rates, wait, t)
        if not math.isfinite(step):
            break
        t += step
        run = _advance(run, rates, step, t, lambda job: ids.get(id(job)), first)
        if all(math.isfinite(x) for x in first):
            break
    return first


class Learning:
    """What the requests that ran teach the time model, kept between them (not locked: the
    controller calls it under its own lock): how much slower than measured the host runs now,
    and the share of ``max_new_tokens`` finished answers use.

    The slowdown moves towards each observation in log space by ``OBSERVE_WEIGHT`` (bounded by
    ``SLOWDOWN_RANGE``). A speed just measured (:meth:`measured`) is provisional for its first
    ``PROVISIONAL_OBSERVATIONS`` observations: each one slower than the model is taken whole, the
    slower of the two standing. The warm-up probe times bare forward passes of the model alone,
    and real requests have run 7-8 times slower than it (issue #30): blending that in by halves
    would admit the first requests on a speed the host cannot give.

    Time counts an answer's expected length (memory still reserves all of it): a burst judged by
    ``max_new_tokens`` when answers stop at a third of it sends clients back late and leaves the
    host idle meanwhile. The share is the new tokens the last ``ANSWER_WINDOW`` answers generated
    over the ``max_new_tokens`` they were allowed: an answer allowed 16 tokens (the server's
    warm-up) weighs a sixteenth of one allowed 256, and every answer of a burst alike — in a burst
    the longest answers end last, and a moving average weighted to the latest took the five of
    30 that ran to 256 tokens for the rule (0.69, where the burst's was 0.2: 2026-12-07). Before any
    answer it is 1 (the worst case, for the start rule); :meth:`expected_new_tokens` prices a
    refused client's return at the floor until the answers seen were allowed, in all, as many
    tokens as its own (see there).

    >>> learnt, thr = Learning(), Throughput(prefill_a=0.001, decode_s=0.02)
    >>> learnt.slowed(thr, 8.0).slowdown                 # provisional: a slower request is taken whole
    8.0
    >>> learnt.answered(16, 16)                           # the warm-up used its 16 tokens
    >>> learnt.answered(10, 256)                          # a real answer used 10 of its 256
    >>> round(learnt.answer_share, 3)
    0.096
    """

    #: How many of the latest answers the expected share of max_new_tokens is taken over, and its floor.
    ANSWER_WINDOW = 64
    MIN_ANSWER_SHARE = 0.05
    #: How far one observation moves the learnt slowdown (in log space), and its bounds.
    OBSERVE_WEIGHT = 0.5
    SLOWDOWN_RANGE = (0.1, 100.0)
    #: Observations during which a speed is provisional.
    PROVISIONAL_OBSERVATIONS = 3

    def __init__(self) -> None:
        self.answer_share = 1.0  # generated / allowed new tokens over the last ANSWER_WINDOW answers
        self._answers: collections.deque[tuple[int, int]] = collections.deque(maxlen=self.ANSWER_WINDOW)
        self.allowed_seen = 0  # max_new_tokens of every answer seen, summed (not averaged)
        self.observed = 0  # observations of the speed in use

    def measured(self) -> None:
        """A new speed was measured: the next observations are provisional again."""
        self.observed = 0

    def slowed(self, thr: Throughput, sample: float) -> Throughput:
        """``thr`` with its slowdown moved by one observed ``sample`` (wall seconds per modelled
        second); ``thr`` itself when the sample means nothing (zero, negative, not finite)."""
        if not (sample > 0 and math.isfinite(sample)):
            return thr
        lo, hi = self.SLOWDOWN_RANGE
        if self.observed < self.PROVISIONAL_OBSERVATIONS:
            slow = min(hi, max(lo, thr.slowdown, sample))
        else:
            w = self.OBSERVE_WEIGHT
            slow = min(hi, max(lo, thr.slowdown ** (1 - w) * sample**w))
        self.observed += 1
        return dataclasses.replace(thr, slowdown=slow)

    def answered(self, done: int, new_max: int) -> None:
        """An answer ended after ``done`` of its ``new_max`` new tokens."""
        if new_max > 0:
            self._answers.append((min(new_max, max(0, done)), new_max))
            generated, allowed = (sum(x) for x in zip(*self._answers, strict=True))
            self.allowed_seen += new_max
            self.answer_share = max(self.MIN_ANSWER_SHARE, generated / allowed)

    def expected_new_tokens(self, new_max: int, *, soonest: bool = False) -> int:
        """The new tokens a request of ``new_max`` is expected to generate (for its time).

        ``soonest``: for when a refused client is told to come back, the fewest the model can
        defend — the floor share while the answers seen were allowed fewer tokens in all than
        ``new_max`` (the warm-up's 16 say nothing of a 256-token answer). A Retry-After cannot be
        taken back: a client told too soon claims its kept place and waits in the queue, one told
        too late waits while the host idles (2026-12-07: 64 clients, the first answers 6 tokens
        of 256, clients told to come back after 674 s of a burst that drained in about a minute)."""
        share = self.answer_share
        if soonest and self.allowed_seen < new_max:
            share = self.MIN_ANSWER_SHARE
        return math.ceil(new_max * share)


def decode_now(job: Job, thr: Throughput, learning: Learning, *, soonest: bool = False) -> float:
    """``job``'s decode as the model prices it now: its answer's expected length
    (:meth:`Learning.expected_new_tokens`, ``soonest`` as there), and a started job never below
    the decode already credited plus one step (it is still there)."""
    expected = thr.decode_seconds(learning.expected_new_tokens(job.new_max, soonest=soonest))
    if job.served <= 0:
        return expected
    return max(expected, max(0.0, job.served - job.prefill) + thr.decode_s)


def _next_event(run: Sequence[Job], rates: Sequence[float], wait: Sequence[Job], t: float) -> float:
    """Seconds to the next event: a running job ends its prefill or its work, or the queue
    head's promise arrives (``inf``: nothing will happen)."""
    step = math.inf
    for job, rate in zip(run, rates, strict=True):
        edge = job.prefill if job.in_prefill() else job.work
        if rate > 0:
            step = min(step, (edge - job.served) / rate)
    if wait and wait[0].ready > t:
        step = min(step, wait[0].ready - t)
    return max(step, 0.0) if math.isfinite(step) else step


def _advance(
    run: Sequence[Job],
    rates: Sequence[float],
    step: float,
    t: float,
    queued_index: Callable[[Job], int | None],
    first: list[float],
) -> list[Job]:
    """Serve each running job ``step`` seconds at its rate; a queued job (``queued_index``) that
    ends its prefill has its first token at ``t``. Returns the jobs still running."""
    still: list[Job] = []
    for job, rate in zip(run, rates, strict=True):
        was_prefill = job.in_prefill()
        job.served += rate * step
        if was_prefill and job.served >= job.prefill - 1e-9:
            job.served = max(job.served, job.prefill)
            k = queued_index(job)
            if k is not None and not math.isfinite(first[k]):
                first[k] = t
        if job.served < job.work - 1e-9:
            still.append(job)
    return still
