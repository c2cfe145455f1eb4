"""Admission control: capacity never exceeded, FIFO order, bounded queue, timeouts, asyncio."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from ragbudget.admission import AdmissionController
from ragbudget.errors import BudgetError, ConfigError, OverloadedError, RequestCancelled


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
