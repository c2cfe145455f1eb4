"""Admission control: capacity never exceeded, FIFO order, bounded queue, timeouts, asyncio."""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from typing import Any

import pytest

from ragbudget.errors import BudgetError, ConfigError, OverloadedError, RequestCancelled
from ragbudget.memory.admission import AdmissionController


def wait_until(pred, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.002)


def test_never_exceeds_capacity_with_16_threads() -> None:
    ctl = AdmissionController(1000, max_queue=64, timeout=30)
    lock = threading.Lock()
    held, peak, errors = [0], [0], []

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        for _ in range(25):
            n = rnd.randint(1, 600)
            try:
                with ctl.reserve(n):
                    with lock:
                        held[0] += n
                        peak[0] = max(peak[0], held[0])
                        if held[0] > 1000:
                            errors.append(held[0])
                    time.sleep(rnd.random() * 0.002)
                    with lock:
                        held[0] -= n
            except Exception as exc:  # noqa: BLE001 - any error fails the test below
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = ctl.stats()
    assert s.admitted_total == 16 * 25 and s.running == 0 and s.admitted_tokens == 0
    assert s.queued == 0 and 600 < peak[0] <= 1000


def test_fifo_order_and_head_of_line() -> None:
    ctl = AdmissionController(100, max_queue=16, timeout=30)
    blocker = ctl.acquire(30)
    big = threading.Thread(target=lambda: ctl.acquire(80).release())
    big.start()
    wait_until(lambda: ctl.stats().queued == 1)
    small = threading.Thread(target=lambda: ctl.acquire(10).release())
    small.start()
    wait_until(lambda: ctl.stats().queued == 2)
    # The 10 would fit next to the 30, but it does not overtake the 80 queued before it.
    time.sleep(0.05)
    assert ctl.stats().running == 1 and ctl.stats().queued == 2
    blocker.release()
    big.join()
    small.join()
    assert ctl.stats().admitted_total == 3


def test_fifo_admission_order_with_8_threads() -> None:
    ctl = AdmissionController(100, max_queue=16, timeout=30)
    blocker = ctl.acquire(100)
    order: list[int] = []
    sizes = [80, 60, 70, 55, 90, 51, 99, 75]  # each > half: they run one at a time
    threads = []
    for i, n in enumerate(sizes):

        def run(i: int = i, n: int = n) -> None:
            with ctl.reserve(n):
                order.append(i)

        t = threading.Thread(target=run)
        t.start()
        threads.append(t)
        wait_until(lambda i=i: ctl.stats().queued == i + 1)  # arrival order is known
    blocker.release()
    for t in threads:
        t.join()
    assert order == list(range(len(sizes)))


def test_queue_full_is_overloaded_with_retry_after() -> None:
    ctl = AdmissionController(10, max_queue=1, timeout=30)
    r = ctl.acquire(10)
    t = threading.Thread(target=lambda: ctl.acquire(5).release())
    t.start()
    wait_until(lambda: ctl.stats().queued == 1)
    with pytest.raises(OverloadedError) as err:
        ctl.acquire(1)
    assert err.value.retry_after > 0 and "queue limit 1" in str(err.value)
    assert ctl.stats().rejected_total == 1
    r.release()
    t.join()
    assert ctl.stats().admitted_tokens == 0


def test_wait_timeout_leaves_queue_and_unblocks_next() -> None:
    ctl = AdmissionController(10, max_queue=4, timeout=30)
    r = ctl.acquire(6)
    with pytest.raises(OverloadedError, match="waited"):
        ctl.acquire(8, timeout=0.05)
    s = ctl.stats()
    assert s.timed_out_total == 1 and s.queued == 0
    with ctl.reserve(4):  # the timed-out head no longer blocks anybody
        assert ctl.stats().admitted_tokens == 10
    r.release()


def test_cancel_leaves_the_queue_before_the_timeout() -> None:
    ctl = AdmissionController(100, max_queue=1, timeout=60.0)
    held = ctl.acquire(100)
    cancel = threading.Event()
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            ctl.acquire(50, cancel=cancel)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            outcome.append(e)

    t = threading.Thread(target=wait)
    t.start()
    while ctl.stats().queued == 0:
        time.sleep(0.005)
    cancel.set()
    t.join(timeout=10)  # the 60 s timeout would fail the assertions below, not hang the suite
    assert not t.is_alive() and isinstance(outcome[0], RequestCancelled)
    assert ctl.stats().queued == 0 and ctl.stats().timed_out_total == 0
    # Its place is free again: another request can queue (max_queue=1) and is admitted in turn.
    later = threading.Thread(target=lambda: ctl.acquire(50, cancel=threading.Event()).release())
    later.start()
    held.release()
    later.join(timeout=10)
    assert not later.is_alive() and ctl.stats().admitted_tokens == 0


def test_an_interrupted_waiter_leaves_the_queue() -> None:
    """A KeyboardInterrupt (or any exception) in the wait must not leave a waiter at the head of
    the queue, blocking everyone behind it, nor tokens granted to nobody."""
    ctl = AdmissionController(100, max_queue=4, timeout=60.0)
    held = ctl.acquire(100)

    class Interrupting(threading.Event):
        def is_set(self) -> bool:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ctl.acquire(60, cancel=Interrupting())
    assert ctl.stats().queued == 0
    held.release()
    with ctl.reserve(100, timeout=1.0):  # nobody is left holding or blocking tokens
        assert ctl.stats().admitted_tokens == 100


def test_oversize_and_bad_config() -> None:
    ctl = AdmissionController(10)
    with pytest.raises(BudgetError) as err:
        ctl.acquire(11)
    assert err.value.needed == 11 and err.value.available == 10
    with pytest.raises(ConfigError):
        AdmissionController(0)
    with pytest.raises(ConfigError):
        ctl.acquire(-1)


def test_asyncio_waiters_share_the_capacity_with_threads() -> None:
    ctl = AdmissionController(100, max_queue=32, timeout=10)

    async def main() -> list[int]:
        held, peak, order = [0], [0], []

        async def job(i: int, n: int) -> None:
            async with ctl.areserve(n):
                held[0] += n
                peak[0] = max(peak[0], held[0])
                order.append(i)
                await asyncio.sleep(0.005)
                held[0] -= n

        blocker = ctl.acquire(100)
        tasks = []
        for i in range(10):
            tasks.append(asyncio.create_task(job(i, 40)))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert ctl.stats().queued == 10
        # Release from another thread, as a finished generation in a worker thread would.
        threading.Thread(target=blocker.release).start()
        await asyncio.gather(*tasks)
        assert peak[0] <= 100
        return order

    assert asyncio.run(main()) == list(range(10))
    assert ctl.stats().admitted_tokens == 0


def test_asyncio_timeout_and_cancel() -> None:
    ctl = AdmissionController(10, max_queue=4, timeout=10)

    async def main() -> None:
        r = ctl.acquire(10)
        with pytest.raises(OverloadedError):
            await ctl.aacquire(5, timeout=0.02)
        task = asyncio.create_task(ctl.aacquire(5))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ctl.stats().queued == 0
        r.release()

    asyncio.run(main())
    s = ctl.stats()
    assert s.admitted_tokens == 0 and s.timed_out_total == 1


# --- memory and time (issue #14) ---------------------------------------------------------------

from ragbudget.memory.schedule import MemoryModel, Throughput  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_each_request_pins_its_kv_and_its_own_activation_peak() -> None:
    # 10 B per KV token; activations grow with the prompt (n²/100 bytes).
    mem = MemoryModel(capacity_bytes=110_000, kv_bytes_per_token=10, activation=lambda n: n * n // 100)
    ctl = AdmissionController(10_000, memory=mem, max_queue=4, timeout=0.05)
    # A 1,000-token prompt + 500 new: KV 15,000 + activations 10,000 = 25,000 bytes.
    held = [ctl.acquire(1500, prompt_tokens=1000)]
    assert ctl.stats().admitted_bytes == 25_000
    held += [ctl.acquire(1500, prompt_tokens=1000) for _ in range(3)]
    # KV tokens alone (7,500 of 10,000) would admit a fifth; KV + activations (125,000 B) do not.
    with pytest.raises(OverloadedError, match="waited"):
        ctl.acquire(1500, prompt_tokens=1000)
    # A short request pins little (KV 5,000 + activations 100 B): it fits the 10,000 B left.
    with ctl.reserve(500, prompt_tokens=100):
        assert ctl.stats().admitted_bytes == 105_100
    assert ctl.stats().peak_admitted_bytes == 105_100
    for r in held:
        r.release()
    assert ctl.stats().admitted_bytes == 0 and ctl.stats().admitted_tokens == 0


def test_a_request_whose_activations_alone_exceed_memory_is_a_budget_error() -> None:
    mem = MemoryModel(capacity_bytes=1000, kv_bytes_per_token=1, activation=lambda n: 2 * n)
    ctl = AdmissionController(1000, memory=mem)
    with pytest.raises(BudgetError, match="activations of a 600-token prefill"):
        ctl.acquire(700, prompt_tokens=600)  # 700 KV + 1,200 activations
    ctl.acquire(700, prompt_tokens=100).release()  # 700 + 200 fits


# 1 ms per prompt token, 10 ms per generated token: a 1,000 + 100 request is 2 s of work.
THR = Throughput(prefill_a=0.001, decode_s=0.01)


def _whole_answers_seen(ctl: AdmissionController, tokens: int = 1100, prompt: int = 1000) -> None:
    """One answer that used its whole max_new_tokens, seen before the test (no time passes, so
    the speed learns nothing): the time model then prices a refused client's return by whole
    answers too (Learning.expected_new_tokens prices it at the floor share until answers as
    long as its own were allowed: tests/test_admission_answers.py)."""
    r = ctl.acquire(tokens, prompt_tokens=prompt)
    r.finish(new_tokens=tokens - prompt)
    r.release()


def test_time_refusal_with_retry_after_that_gets_in_when_honoured() -> None:
    clock = Clock()
    ctl = AdmissionController(10**6, max_queue=64, timeout=5.0, throughput=THR, ttft_target=1.5, clock=clock)
    _whole_answers_seen(ctl)
    admitted, refused = [], []
    for _ in range(8):
        try:
            admitted.append(ctl.enqueue(1100, prompt_tokens=1000))
        except OverloadedError as exc:
            refused.append(exc.retry_after)
    # Serial (a second prefill next to a running one would take 2 s > 1.5 s): first tokens at
    # 1, 3, 5 s are within 5 s; the fourth's (7 s) is not.
    assert len(admitted) == 3 and [w.granted for w in admitted] == [True, False, False]
    assert len(refused) == 5 and ctl.stats().refused_for_time_total == 5
    # Each refusal is promised a later time, 2 s (one request's work) apart: no thundering herd.
    assert refused == [2.0, 4.0, 6.0, 8.0, 10.0]
    # Honour the first Retry-After with the work done as modelled: the first request finished
    # and the second has run 1 s of its 2 s, so the returning request gets in.
    reservations = [admitted[0].reservation()]
    clock.t += 2.0
    reservations[0].release()
    assert admitted[1].granted
    back = ctl.enqueue(1100, prompt_tokens=1000)
    assert not back.granted and ctl.stats().queued == 2
    # A newcomer now (not one of the promised) is told to come after the promised returns.
    with pytest.raises(OverloadedError) as err:
        ctl.enqueue(1100, prompt_tokens=1000)
    assert err.value.retry_after > 10.0 - 2.0


def test_every_refusal_says_the_retry_after_it_carries() -> None:
    """Issue #30: a 429 said "first token in about 32 s ... retry after 2 s" beside its header.
    Whatever the refusal, its message ends with the one number a Retry-After header carries
    (whole seconds, rounded up), and a refusal behind clients sent back before says so."""
    from ragbudget.errors import retry_after_seconds

    clock = Clock()
    ctl = AdmissionController(10**6, max_queue=64, timeout=5.0, throughput=THR, ttft_target=1.5, clock=clock)
    refused = []
    for _ in range(8):  # as above: three admitted, five refused for time
        try:
            ctl.enqueue(1100, prompt_tokens=1000)
        except OverloadedError as exc:
            refused.append(exc)
    assert len(refused) == 5
    for e in refused:
        assert "past the queue time-out of 5 s" in str(e)
        assert str(e).endswith(f"; retry after {retry_after_seconds(e.retry_after)} s")
        # Issue #42 §5: "about 34 s" beside a Retry-After of 280 s. The one figure of waiting a
        # refusal states is its Retry-After (the other, the time-out it is measured against).
        seconds = re.findall(r"(\d+(?:\.\d+)?) s\b", str(e))
        assert sorted(seconds) == sorted(["5", str(retry_after_seconds(e.retry_after))]), str(e)
    assert "behind" not in str(refused[0])
    assert "; it comes back behind the 4 client(s) told to come back before it;" in str(refused[4])
    full = AdmissionController(10, max_queue=0, timeout=30)
    with full.reserve(10), pytest.raises(OverloadedError) as err:
        full.acquire(1)
    assert str(err.value).endswith(f"(queue limit 0); retry after {retry_after_seconds(err.value.retry_after)} s")
    waited = AdmissionController(10, max_queue=4, timeout=0.05)
    with waited.reserve(10), pytest.raises(OverloadedError) as err:
        waited.acquire(1)
    assert str(err.value).endswith(f"the queue time-out; retry after {retry_after_seconds(err.value.retry_after)} s")


def test_start_rule_lets_short_prompts_share_the_host() -> None:
    clock = Clock()
    ctl = AdmissionController(10**6, timeout=60.0, throughput=THR, ttft_target=1.5, clock=clock)
    # 200-token prompts (0.2 s alone): next to 5 running ones a prefill takes 1.2 s ≤ 1.5 s.
    rs = [ctl.acquire(300, prompt_tokens=200) for _ in range(7)]
    assert ctl.stats().running == 7  # 7th: 0.2 × 7 = 1.4 s
    w = ctl.enqueue(300, prompt_tokens=200)
    assert not w.granted  # 8th: 1.6 s > 1.5 s: it waits
    rs[0].release()
    assert w.granted
    for r in rs[1:]:
        r.release()


def test_with_a_paged_cache_tokens_count_against_it_and_activations_against_memory() -> None:
    # KV at 100 B/token would make a 600-token request 60,000 B, far past the 6,000 B of memory:
    # with the KV in a paged cache allocated up front (1,024 tokens, pages of 32) those bytes are
    # already resident, so only the activations (8 B per prompt token) count against memory.
    mem = MemoryModel(
        capacity_bytes=6_000, kv_bytes_per_token=100, kv_pool_tokens=1024, kv_pool_page=32, activation=lambda n: 8 * n
    )
    ctl = AdmissionController(10**6, memory=mem, max_queue=4, timeout=0.05)
    a = ctl.acquire(600, prompt_tokens=500)  # 608 pool tokens (19 pages), 4,000 B
    s = ctl.stats()
    assert (s.capacity_tokens, s.admitted_tokens, s.admitted_bytes) == (1024, 608, 4000)
    # Fits memory (4,000 + 800 B) but not the paged cache (608 + 512 > 1,024 tokens): it queues.
    with pytest.raises(OverloadedError, match="paged cache's 1024 tokens"):
        ctl.acquire(500, prompt_tokens=100)
    # Fits the paged cache (608 + 320 tokens) but not memory (4,000 + 2,400 > 6,000 B): queues.
    with pytest.raises(OverloadedError, match="waited"):
        ctl.acquire(300, prompt_tokens=300)
    a.release()
    with ctl.reserve(500, prompt_tokens=100), ctl.reserve(300, prompt_tokens=300):
        assert ctl.stats().admitted_tokens == 512 + 320
    # More than the whole cache can never run.
    with pytest.raises(BudgetError, match="paged cache of batched generation holds 1024"):
        ctl.acquire(1100, prompt_tokens=10)
    assert ctl.stats().admitted_tokens == 0 and ctl.stats().admitted_bytes == 0


def test_retry_after_is_the_honest_estimate_up_to_half_an_hour() -> None:
    # A 100-token answer at 10 s a token is 1,000 s of work: once answers that long were seen,
    # Retry-After says when the work ahead leaves room (a client told less would wait for its
    # place past its HTTP time-out).
    slow = Throughput(prefill_a=0.001, decode_s=10.0)
    clock = Clock()
    ctl = AdmissionController(10**6, max_queue=1, timeout=5.0, throughput=slow, ttft_target=0.5, clock=clock)
    _whole_answers_seen(ctl)
    assert ctl.retry_after_max == 1800.0 and ctl.return_wait == 1800.0
    ctl.acquire(1100, prompt_tokens=1000)
    # A second cannot start next to it (its prefill would pass 0.5 s); its first token comes
    # when the first ends, ~1,001 s from now: refused for time, back in ~1,000 - 5 s.
    with pytest.raises(OverloadedError) as err:
        ctl.enqueue(1100, prompt_tokens=1000)
    assert 990.0 <= err.value.retry_after <= 1001.0 and ctl.stats().refused_for_time_total == 1
    # Past half an hour (a speed measured on a very busy host) it is bounded.
    ctl.configure(throughput=Throughput(prefill_a=0.001, decode_s=100.0), ttft_target=0.5)
    with pytest.raises(OverloadedError) as err:
        ctl.enqueue(1100, prompt_tokens=1000)
    assert err.value.retry_after == 1800.0
    # The queue-full refusal is bounded the same way.
    ctl.timeout = 10**6
    ctl.enqueue(1100, prompt_tokens=1000)
    with pytest.raises(OverloadedError, match="queue limit") as err:
        ctl.enqueue(1100, prompt_tokens=1000)
    assert 1.0 <= err.value.retry_after <= ctl.retry_after_max


def test_would_refuse_looks_without_changing_anything() -> None:
    clock = Clock()
    ctl = AdmissionController(10**6, max_queue=64, timeout=5.0, throughput=THR, ttft_target=1.5, clock=clock)
    _whole_answers_seen(ctl)
    assert ctl.would_refuse(1100, prompt_tokens=1000) is None  # idle: it would start at once
    for _ in range(3):  # first tokens at 1, 3, 5 s
        ctl.enqueue(1100, prompt_tokens=1000)
    before = ctl.stats()
    retry = ctl.would_refuse(1100, prompt_tokens=1000)  # the fourth's at 7 s: 2 s past
    assert retry == 2.0
    assert ctl.would_refuse(1100, prompt_tokens=1000) == 2.0  # no promise was made
    assert ctl.stats() == before  # nothing counted, nothing queued
    # As a refusal (the server's early 429): counted, and the next one is sent back later.
    first = ctl.would_refuse(1100, prompt_tokens=1000, refuse=True)
    assert first == 2.0 and ctl.stats().refused_for_time_total == 1
    assert ctl.would_refuse(1100, prompt_tokens=1000, refuse=True) == 4.0


@pytest.mark.model
def test_a_speed_measured_on_a_busy_host_is_measured_again_once_idle(tmp_path, monkeypatch) -> None:
    """A server that warmed up on a busy host must not keep that slow speed (its time cap and its
    Retry-After) for life: once the host and the pipeline are idle it measures again."""
    from _tiny_lm import tiny_model, tiny_tokenizer

    import ragbudget.memory.calibration
    from ragbudget.generation.generate import Generator
    from ragbudget.pipeline import Pipeline

    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))
    load = {"now": 3.0}
    monkeypatch.setattr(ragbudget.memory.calibration, "load_per_core", lambda: load["now"])
    pipe = Pipeline(
        tmp_path / "index",
        gpu="16GiB",
        ttft_target=1.0,
        generator=Generator.from_objects(tiny_model(), tiny_tokenizer()),
    )
    ctl = pipe.admission
    assert ctl.throughput is not None and "provisional" in ctl.throughput.source
    pipe.SPEED_RECHECK_S = 0.0
    # The probe runs alone: an idle batching loop is stopped first (its thread's OpenMP workers
    # would slow the probe's forward passes), and only when it will measure.
    stopped: list[bool] = []
    monkeypatch.setattr(type(pipe.backend), "close", lambda self: stopped.append(True))
    assert pipe.refresh_speed() is False  # still busy: nothing measured
    load["now"] = 0.1
    held = ctl.acquire(100, prompt_tokens=50)
    assert pipe.refresh_speed() is False  # a request runs: it would compete with the probe
    held.release()
    assert stopped == []
    assert pipe.refresh_speed() is True
    assert stopped == [True]
    assert "provisional" not in ctl.throughput.source and pipe.admission is ctl
    assert pipe.refresh_speed() is False  # measured once: no longer provisional


def test_the_model_learns_the_speed_the_host_has_now() -> None:
    """Measured idle, run busy: each request takes twice what the model says. Observing the
    requests that ran brings the model's slowdown to 2, and with it the first-token estimate."""
    clock = Clock()
    ctl = AdmissionController(10**6, timeout=60.0, throughput=THR, clock=clock)
    assert ctl.expected_first_token(1100, prompt_tokens=1000) == pytest.approx(1.0)
    for _ in range(12):
        r = ctl.acquire(1100, prompt_tokens=1000)  # 1 s prefill + 1 s decode, by the model
        clock.t += 4.0  # ... took 4 s: prefill 2 s, decode 2 s
        r.finish(new_tokens=100)
        r.release()
    assert ctl.stats().slowdown == pytest.approx(2.0, abs=0.01)
    assert ctl.expected_first_token(1100, prompt_tokens=1000) == pytest.approx(2.0, abs=0.02)
    # The first token alone is a sample too: a prefill that took as long as modelled pulls back.
    r = ctl.acquire(1100, prompt_tokens=1000)
    clock.t += 2.0
    r.first_token()
    r.first_token()  # counted once
    r.release()
    assert ctl.stats().slowdown == pytest.approx(2.0, abs=0.01)
    fast = ctl.acquire(1100, prompt_tokens=1000)
    clock.t += 0.5  # the host got idle: the prefill took 0.5 s where the model said 2
    fast.first_token()
    fast.release()
    assert ctl.stats().slowdown == pytest.approx(1.0, abs=0.01)


def test_a_new_speed_is_provisional_the_slower_of_probe_and_observed_stands() -> None:
    """Issue #30: the warm-up probe said 0.95 ms/token and requests ran 7-8x slower. The first
    observations of a new speed are taken whole when slower (not halfway in log space, which
    would have left the first requests admitted at ~2.8x for 8x); after them, the learnt
    slowdown moves by halves again, down as well as up."""
    clock = Clock()
    ctl = AdmissionController(10**6, timeout=60.0, throughput=THR, clock=clock)
    r = ctl.acquire(1100, prompt_tokens=1000)
    clock.t += 8.0  # the 1 s prefill the model expects took 8 s
    r.first_token()
    r.release()
    assert ctl.stats().slowdown == pytest.approx(8.0, abs=0.01)
    # A faster one while still provisional: the slower stands.
    ctl.observe(2.0)
    assert ctl.stats().slowdown == pytest.approx(8.0, abs=0.01)
    ctl.observe(4.0)  # the third: still provisional
    assert ctl.stats().slowdown == pytest.approx(8.0, abs=0.01)
    ctl.observe(2.0)  # past them, halfway in log space: sqrt(8 x 2)
    assert ctl.stats().slowdown == pytest.approx(4.0, abs=0.01)
    # A new measurement (configure) is provisional again.
    ctl.configure(throughput=THR)
    ctl.observe(3.0)
    assert ctl.stats().slowdown == pytest.approx(3.0, abs=0.01)


def test_a_batching_backend_starts_whatever_fits_and_still_refuses_for_time() -> None:
    """Batched, sharing raises everyone's tokens/s: a full-length request (its prefill alone
    takes the whole 1 s target) starts next to the running ones instead of waiting for them all
    to end; the arrival rule still refuses what would miss the queue time-out."""
    batched = Throughput(prefill_a=0.001, decode_s=0.01, batched=True, decode_extra_s=0.001)
    clock = Clock()
    ctl = AdmissionController(10**6, timeout=8.0, throughput=batched, ttft_target=1.0, clock=clock)
    held = [ctl.acquire(1100, prompt_tokens=1000) for _ in range(4)]  # none waits
    assert ctl.stats().running == 4 and ctl.stats().queued == 0
    # Prefills share the host: the n-th starts while n × 1 s ≤ 8 s; the 9th is refused.
    waiting = [ctl.enqueue(1100, prompt_tokens=1000) for _ in range(4)]
    assert [w.granted for w in waiting] == [True] * 4 and ctl.stats().running == 8
    with pytest.raises(OverloadedError, match="past the queue time-out"):
        for _ in range(20):
            waiting.append(ctl.enqueue(1100, prompt_tokens=1000))
    held += [w.reservation() for w in waiting if w.granted]
    assert ctl.stats().running == 8 and ctl.stats().refused_for_time_total == 1
    # Unbatched, the same requests run one at a time (the second would share the cores).
    serial = AdmissionController(10**6, timeout=8.0, throughput=THR, ttft_target=1.0, clock=clock)
    serial.acquire(1100, prompt_tokens=1000)
    assert not serial.enqueue(1100, prompt_tokens=1000).granted
    for r in held:
        r.release()


def test_many_requests_ending_together_do_not_overshoot_the_slowdown() -> None:
    """Four requests that ran side by side on a host twice as slow as measured end at once: each
    says "2×", so the learnt slowdown approaches 2 and never passes it (each request's own
    slowdown is taken at the speed it ran at, not against one learnt since)."""
    clock = Clock()
    ctl = AdmissionController(10**6, timeout=60.0, throughput=THR, clock=clock)
    held = [ctl.acquire(1100, prompt_tokens=1000) for _ in range(4)]  # 2 s of work each
    clock.t += 16.0  # sharing 4 ways the model says 8 s; it took 16
    for r in held:
        r.finish(new_tokens=100)
        r.release()
    assert 1.8 < ctl.stats().slowdown <= 2.0


def test_an_idle_controller_never_refuses_for_time() -> None:
    """However slow the host has become (a learnt slowdown of 100: a prefill alone takes 100 s,
    past the 30 s time-out), a request that finds nothing running starts — the early look says
    so too — else an idle server would refuse every request and never learn the host is fast
    again."""
    slow = Throughput(prefill_a=0.001, decode_s=0.01, slowdown=100.0)
    ctl = AdmissionController(10**6, timeout=30.0, throughput=slow, ttft_target=1.0, clock=Clock())
    assert ctl.would_refuse(1100, prompt_tokens=1000, refuse=True) is None
    r = ctl.acquire(1100, prompt_tokens=1000)
    assert ctl.would_refuse(1100, prompt_tokens=1000, refuse=True) is not None  # now busy
    r.release()


# --- returning clients claim their promise ---------------------------------------------------


def _keyed(ctl: AdmissionController, key: str | None, tokens: int = 1100, prompt: int = 1000):
    """Enqueue under ``key``: the waiter, or the OverloadedError it was refused with."""
    with ctl.returning(key):
        try:
            return ctl.enqueue(tokens, prompt_tokens=prompt)
        except OverloadedError as exc:
            return exc


def _claims(ctl: AdmissionController, key: str | None) -> bool:
    """Whether a request made now under ``key`` would claim a refusal's promise."""
    with ctl.returning(key):
        return ctl.hold_return()


def test_a_client_back_at_its_retry_after_is_queued_even_when_the_host_ran_slow() -> None:
    clock = Clock()
    ctl = AdmissionController(10**6, max_queue=64, timeout=5.0, throughput=THR, ttft_target=1.5, clock=clock)
    _whole_answers_seen(ctl)
    out = {k: _keyed(ctl, k) for k in "abcdefgh"}
    refused = {k: v.retry_after for k, v in out.items() if isinstance(v, OverloadedError)}
    assert list(refused) == ["d", "e", "f", "g", "h"] and refused["d"] == 2.0
    # The host runs 3× slower than measured: after 2 s nothing has finished, so by the model
    # (which has not learnt it yet) new work still lies past the time-out.
    clock.t += refused["d"]
    assert isinstance(_keyed(ctl, None), OverloadedError)  # a newcomer: refused
    back = _keyed(ctl, "d")  # the client told to come back now: queued, not refused
    assert not isinstance(back, OverloadedError) and back.returning
    assert ctl.stats().queued == 3
    # ... and it may wait for its turn up to half an hour, not one queue time-out.
    assert back.max_wait == ctl.return_wait == 1800.0
    assert out["a"].max_wait == 5.0
    # Its promise is spent: the same key again is a newcomer.
    assert isinstance(_keyed(ctl, "d"), OverloadedError)


def test_a_promise_is_claimed_only_in_its_window_and_once_per_refusal() -> None:
    clock = Clock()
    ctl = AdmissionController(10**6, max_queue=64, timeout=5.0, throughput=THR, ttft_target=1.5, clock=clock)
    _whole_answers_seen(ctl)
    for k in ("a", "b", "c", "same", "same", "late"):
        _keyed(ctl, k)
    assert sorted({key for key, _ in ctl.promises()}) == ["late", "same"]
    same = sorted(due for key, due in ctl.promises() if key == "same")
    # Two seconds before its time a key claims nothing (it is judged, and refused, as new).
    clock.t = same[0] - 2.0
    assert not _claims(ctl, "same")
    clock.t = same[1]
    # The same body refused twice holds two promises: two returns claim one each.
    first, second = _keyed(ctl, "same"), _keyed(ctl, "same")
    assert not isinstance(first, OverloadedError) and first.returning
    assert not isinstance(second, OverloadedError) and second.returning
    # A promise not claimed within its grace (10 s, or one queue time-out if longer) lapses.
    clock.t += 60.0
    assert not _claims(ctl, "late") and ctl.promises() == []
    # An unkeyed request never claims anything.
    assert not _claims(ctl, None)


def test_would_refuse_lets_a_returning_client_through_and_acquire_claims() -> None:
    clock = Clock()
    ctl = AdmissionController(10**6, max_queue=64, timeout=5.0, throughput=THR, ttft_target=1.5, clock=clock)
    for k in "abc":
        _keyed(ctl, k)
    with ctl.returning("x"):
        retry = ctl.would_refuse(1100, prompt_tokens=1000, refuse=True)
    assert retry is not None
    clock.t += retry
    with ctl.returning("x"):
        assert ctl.would_refuse(1100, prompt_tokens=1000, refuse=True) is None
    with ctl.returning("y"):
        assert ctl.would_refuse(1100, prompt_tokens=1000) is not None
    # The server looks (would_refuse) before building the prompt and acquires after: on a busy
    # host that can take longer than the promise's grace, and the client keeps its place.
    clock.t += 15.0  # past the grace (10 s): retrieval and selection were slow
    assert _keyed(ctl, "x").returning


def test_a_returning_client_waits_past_the_queue_timeout_for_room() -> None:
    """Real threads and clock: the host is slower than the model, so the room the returning
    client was promised comes later than the queue time-out; it still gets in, where an unkeyed
    request in its place times out."""
    slow = Throughput(prefill_a=0.0005, decode_s=0.0001)  # a 1,000-token prompt: 0.5 s
    ctl = AdmissionController(1000, max_queue=4, timeout=0.3, throughput=slow)
    running = ctl.acquire(1000, prompt_tokens=1000)  # holds the whole cache
    with ctl.returning("k"), pytest.raises(OverloadedError) as err:
        ctl.acquire(1000, prompt_tokens=1000)
    time.sleep(err.value.retry_after)
    with pytest.raises(OverloadedError):
        ctl.acquire(1000, prompt_tokens=1000)  # unkeyed, in the same place: a 429 again
    got: list[Any] = []

    def back() -> None:
        with ctl.returning("k"):  # the key is the thread's own (threads do not inherit it)
            got.append(ctl.acquire(1000, prompt_tokens=1000))

    t = threading.Thread(target=back)
    t.start()
    time.sleep(0.6)  # twice the queue time-out
    assert not got and ctl.stats().queued == 1
    running.release()
    t.join(5)
    assert got and ctl.stats().running == 1
    got[0].release()


def test_a_queue_time_out_also_keeps_the_client_a_place() -> None:
    ctl = AdmissionController(
        1000, max_queue=4, timeout=0.1, throughput=Throughput(prefill_a=0.00001, decode_s=0.00001)
    )
    held = ctl.acquire(1000, prompt_tokens=900)
    with ctl.returning("q"), pytest.raises(OverloadedError, match="waited") as err:
        ctl.acquire(1000, prompt_tokens=900)  # expected soon by the model, but nothing ends
    assert [key for key, _ in ctl.promises()] == ["q"]
    assert ctl.promises()[0][1] == pytest.approx(time.monotonic() + err.value.retry_after, abs=0.5)
    held.release()


def test_on_claim_is_called_when_a_returning_client_waits_for_its_place() -> None:
    clock = Clock()
    ctl = AdmissionController(10**6, max_queue=64, timeout=5.0, throughput=THR, ttft_target=1.5, clock=clock)
    calls: list[str] = []
    running = _keyed(ctl, "a")
    # Queued as a newcomer (its first token within the time-out): no claim, no call.
    with ctl.returning("b", on_claim=lambda: calls.append("b")), pytest.raises(OverloadedError):
        ctl.acquire(1100, prompt_tokens=1000, timeout=0.01)
    for k in "cdef":
        _keyed(ctl, k)
    refused = [due for key, due in ctl.promises() if key == "f"]
    assert refused and running.granted
    clock.t = refused[0]
    with ctl.returning("f", on_claim=lambda: calls.append("f")), pytest.raises(OverloadedError):
        ctl.acquire(1100, prompt_tokens=1000, timeout=0.01)  # claimed, then waited 0.01 s
    assert calls == ["f"]


def test_time_counts_the_expected_answer_length_memory_the_whole() -> None:
    """Answers that stop at a fifth of max_new_tokens: after a few of them the time model expects
    the same of the next one (first tokens and Retry-After come sooner), while each request
    still reserves its whole max_new_tokens of KV."""
    clock = Clock()
    # Room for one request at a time: the next one's first token comes after this one ends.
    ctl = AdmissionController(1100, timeout=60.0, throughput=THR, clock=clock)
    busy = ctl.acquire(1100, prompt_tokens=1000)  # 1 s prefill + 100 tokens (1 s) of decode
    before = ctl.expected_first_token(1100, prompt_tokens=1000)
    busy.release()
    for _ in range(20):
        r = ctl.acquire(1100, prompt_tokens=1000)
        clock.t += 1.2
        r.finish(new_tokens=20)
        r.release()
    assert ctl.answer_share == pytest.approx(0.2, abs=0.01)
    # What /health and /metrics show of it (ragbudget_admission_answer_share).
    assert ctl.stats().answer_share == ctl.stats().to_dict()["answer_share"] == pytest.approx(0.2, abs=0.01)
    assert AdmissionController(1100).stats().answer_share is None  # no time model, nothing to show
    busy = ctl.acquire(1100, prompt_tokens=1000)
    assert busy.job is not None and busy.job.decode == pytest.approx(0.2, abs=0.011)
    assert ctl.stats().admitted_tokens == 1100  # memory: the whole answer
    after = ctl.expected_first_token(1100, prompt_tokens=1000)
    assert before == pytest.approx(3.0) and after == pytest.approx(2.2, abs=0.02)
    busy.release()


def test_refuse_busy_says_when_by_the_model_and_keeps_the_returning_clients_place() -> None:
    """Something in front of the controller is full (the server's worker threads, its queue):
    the refusal's Retry-After is the model's start time behind the work ahead (not a constant),
    it is counted and promised, and the client back at that time is let past the bounds that
    refuse newcomers — the queue limit included."""
    clock = Clock()
    ctl = AdmissionController(10**6, max_queue=1, timeout=60.0, throughput=THR, ttft_target=1.5, clock=clock)
    _whole_answers_seen(ctl)
    running = ctl.enqueue(1100, prompt_tokens=1000)  # 1 s prefill + 1 s decode, alone
    queued = ctl.enqueue(1100, prompt_tokens=1000)  # starts when the first ends (2 s)
    assert running.granted and not queued.granted
    with ctl.returning("busy"):
        retry = ctl.refuse_busy(1100, prompt_tokens=1000)
    # It would start after both (4 s): told 4 s, and the next refusal is told after it.
    assert retry == 4.0 and ctl.stats().rejected_total == 1
    with ctl.returning("later"):
        assert ctl.refuse_busy(1100, prompt_tokens=1000) == 6.0
    with ctl.returning("newcomer"):
        assert not ctl.hold_return()  # never refused: nothing to come back for
    clock.t += retry
    with ctl.returning("busy"):
        assert ctl.hold_return()
    # The host ran slower than modelled: nothing ended and the queue is still full. A newcomer
    # is refused for the full queue; the returning client queues behind the work ahead.
    with pytest.raises(OverloadedError, match="queue limit"):
        ctl.enqueue(1100, prompt_tokens=1000)
    with ctl.returning("busy"):
        back = ctl.enqueue(1100, prompt_tokens=1000)
    assert back.returning and not back.granted and ctl.stats().queued == 2
    running.reservation().release()
    queued.reservation().release()
    assert back.granted


def test_refuse_busy_without_a_measured_speed_still_promises_the_keyed_caller() -> None:
    clock = Clock()
    ctl = AdmissionController(1000, max_queue=0, timeout=5.0, clock=clock)
    held = ctl.enqueue(1000, prompt_tokens=900)
    assert held.granted
    with ctl.returning("k"):
        retry = ctl.refuse_busy()  # no size, no time model: the mean hold per request ahead
    assert retry == 1.0 and float(retry).is_integer()
    assert ctl.refuse_busy() == 1.0 and [key for key, _ in ctl.promises()] == ["k"]  # unkeyed: none
    clock.t += retry
    with ctl.returning("k"):
        assert ctl.hold_return()
        back = ctl.enqueue(1000, prompt_tokens=900)  # past the queue limit of 0: it was promised a place
    assert back.returning and not back.granted
    held.reservation().release()
    assert back.granted


def test_a_queue_time_out_is_not_sent_behind_the_clients_refused_while_it_waited() -> None:
    """A queued request that times out (the host ran slower than modelled) had been waiting
    since before the clients refused meanwhile: its Retry-After puts it behind the work running
    and queued, not behind every one of them (in load.json's 64-client burst such clients were
    told 959-985 s while every other return was due within 290 s, and the burst's wall time was
    theirs)."""
    clock = Clock()
    ctl = AdmissionController(10**6, max_queue=64, timeout=5.0, throughput=THR, ttft_target=1.5, clock=clock)
    _whole_answers_seen(ctl)
    first = ctl.enqueue(1100, prompt_tokens=1000)  # runs: first token at 1 s, ends at 2 s
    second = ctl.enqueue(1100, prompt_tokens=1000)  # queued: starts at 2 s
    third = ctl.enqueue(1100, prompt_tokens=1000)  # queued: starts at 4 s, first token at 5 s
    assert first.granted and not second.granted and not third.granted
    refused = []
    for _ in range(5):
        with pytest.raises(OverloadedError) as err:
            ctl.enqueue(1100, prompt_tokens=1000)
        refused.append(err.value.retry_after)
    assert refused == [2.0, 4.0, 6.0, 8.0, 10.0]  # first tokens 7-15 s: spaced behind each other
    # Nothing moved (a host slower than the model): the third times out of the queue. It goes
    # back behind the two ahead of it (start at 4 s), not after the five refused (14 s).
    with pytest.raises(OverloadedError, match="waited") as err:
        third.wait(0)
    assert err.value.retry_after == 4.0
    # A newcomer refused now (a full worker pool, say) is sent after everyone promised, the
    # timed-out one included.
    assert ctl.refuse_busy(1100, prompt_tokens=1000) >= 14.0


def test_the_models_keep_their_old_import_path() -> None:
    # The cost models and the simulator moved to ragbudget.memory.schedule, returning() to
    # ragbudget.memory.promises (issue #32): the old names are the very same objects.
    import ragbudget.memory.admission as admission
    from ragbudget.memory import promises, schedule

    for name in ("MemoryModel", "Throughput", "simulate"):
        assert name in admission.__all__ and getattr(admission, name) is getattr(schedule, name)
    with AdmissionController.returning("k"):
        assert promises.current_key() == "k"


def test_a_request_holding_a_whole_engine_slot_is_timed_by_its_answer_not_the_slot() -> None:
    """On an engine of fixed slots a request reserves a whole slot (2,048 tokens) for a prompt of
    200 and an answer of at most 16: its decode is 16 tokens of work, not 1,848. Priced by the
    slot, four such requests were over 1,100 s of work ahead on a 2-core llama-server
    (2026-12-07, the PostgreSQL burst), and the clients refused behind them were told to come
    back after up to 1,800 s while the engine went idle."""
    thr = Throughput(prefill_a=0.01, decode_s=0.05)
    by_answer = AdmissionController(8192, timeout=30.0, throughput=thr)
    by_slot = AdmissionController(8192, timeout=30.0, throughput=thr)
    _whole_answers_seen(by_answer, 2048, 2032)  # answers of 16 used whole
    _whole_answers_seen(by_slot, 2048, 200)  # and slot-long ones
    held = [by_answer.acquire(2048, prompt_tokens=200, new_tokens=16) for _ in range(4)]
    held += [by_slot.acquire(2048, prompt_tokens=200) for _ in range(4)]
    ahead, slot_ahead = by_answer.stats().work_ahead_s, by_slot.stats().work_ahead_s
    assert ahead is not None and slot_ahead is not None
    assert ahead == pytest.approx(4 * (200 * 0.01 + 16 * 0.05), abs=0.5)  # ~11 s
    assert slot_ahead > 30 * ahead  # 4 x (2 s + 1,848 x 0.05 s): ~378 s
    assert by_answer.stats().admitted_tokens == by_slot.stats().admitted_tokens == 4 * 2048  # memory: the slots
    # A fifth request finds every slot held: told to come back when the answers are done.
    waits = []
    for ctl in (by_answer, by_slot):
        with pytest.raises(OverloadedError) as refused:
            ctl.acquire(2048, prompt_tokens=200, new_tokens=16, timeout=0.01)
        waits.append(refused.value.retry_after)
    assert waits[0] is not None and waits[1] is not None
    assert waits[0] <= 15 < 300 < waits[1], waits
    for h in held:
        h.release()
    with pytest.raises(ConfigError):
        by_answer.acquire(100, prompt_tokens=200)  # a prompt larger than what is reserved
