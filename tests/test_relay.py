"""ragbudget.relay: order, errors, cancellation, event-loop delivery, the worker hook."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from ragbudget.errors import ConfigError
from ragbudget.relay import Emitter, Event, Relay


def _count(n: int) -> Callable[[Callable[[str], None], threading.Event], int]:
    def produce(emit: Callable[[str], None], cancel: threading.Event) -> int:
        for i in range(n):
            emit(str(i))
        return n

    return produce


def _until_cancelled(emitted: list[str]) -> Callable[[Callable[[str], None], threading.Event], str]:
    # Emits until told to stop, as generation does (it checks the event at every token).
    def produce(emit: Callable[[str], None], cancel: threading.Event) -> str:
        deadline = time.monotonic() + 10
        while not cancel.is_set():
            if time.monotonic() > deadline:
                return "never cancelled"
            emitted.append("x")
            emit("x")
            time.sleep(0.001)
        return "stopped"

    return produce


def test_pieces_arrive_in_order_then_the_result() -> None:
    relay = Relay(_count(500))
    pieces = []
    while True:
        try:
            pieces.append(relay.next_piece())
        except StopIteration:
            break
    assert pieces == [str(i) for i in range(500)]
    assert relay.result == 500 and relay.ended and relay.error is None
    with pytest.raises(StopIteration):  # the end stays the end
        relay.next_piece()
    relay.close()
    assert not relay.cancel.is_set()  # reached the end: nothing to cancel


def test_events_carry_kind_and_value() -> None:
    relay = Relay(_count(2))
    events = [relay.next_event() for _ in range(3)]
    assert events == [Event("text", "0"), Event("text", "1"), Event("done", 2)]
    kind, value = events[-1]
    assert (kind, value) == ("done", 2)


def test_a_producer_error_reaches_the_consumer_after_its_pieces() -> None:
    def produce(emit: Callable[[str], None], cancel: threading.Event) -> str:
        emit("partial")
        raise ValueError("boom")

    relay = Relay(produce)
    assert relay.next_piece() == "partial"
    with pytest.raises(ValueError, match="boom"):
        relay.next_piece()
    assert relay.error is None  # handed over: not reported twice
    assert relay.result is None and relay.ended


def test_an_error_after_the_consumer_left_is_kept() -> None:
    release = threading.Event()

    def produce(emit: Callable[[str], None], cancel: threading.Event) -> str:
        emit("first")
        release.wait(5)
        raise RuntimeError("late")

    relay = Relay(produce)
    assert relay.next_piece() == "first"
    release.set()
    relay.close()
    assert isinstance(relay.error, RuntimeError) and relay.cancel.is_set()


def test_close_cancels_and_frees_the_producer() -> None:
    emitted: list[str] = []
    relay = Relay(_until_cancelled(emitted))
    assert [relay.next_piece() for _ in range(3)] == ["x", "x", "x"]
    relay.close()
    assert relay.cancel.is_set()
    assert relay.result == "stopped"  # returned because it was told to, not by its deadline
    relay.started.join(1)
    assert not relay.started.is_alive()
    n = len(emitted)
    time.sleep(0.02)
    assert len(emitted) == n  # nothing is produced after close() returned


def test_a_caller_cancel_event_is_the_producers() -> None:
    mine = threading.Event()
    mine.set()
    relay = Relay(_until_cancelled([]), cancel=mine)
    with pytest.raises(StopIteration):
        relay.next_piece()
    assert relay.result == "stopped"


def test_the_worker_hook_runs_the_producer() -> None:
    with ThreadPoolExecutor(max_workers=1) as pool:
        relay = Relay(_count(3), start=pool.submit)
        assert isinstance(relay.started, Future)
        assert [relay.next_piece() for _ in range(3)] == ["0", "1", "2"]
        relay.close()
        assert relay.started.result(1) is None and relay.result == 3


def test_async_delivery_in_order_and_aclose_cancels() -> None:
    async def main() -> tuple[list[str], list[str], Relay[str]]:
        loop = asyncio.get_running_loop()
        whole = Relay(_count(50), loop=loop)
        got = []
        while True:
            try:
                got.append(await whole.anext_piece())
            except StopAsyncIteration:
                break
        early = Relay(_until_cancelled([]), loop=loop)
        first = [await early.anext_piece() for _ in range(2)]
        await early.aclose()
        assert whole.result == 50
        return got, first, early

    got, first, early = asyncio.run(main())
    assert got == [str(i) for i in range(50)] and first == ["x", "x"]
    assert early.cancel.is_set() and early.result == "stopped"


def test_async_error_is_raised_by_the_awaiting_consumer() -> None:
    def produce(emit: Callable[[str], None], cancel: threading.Event) -> str:
        raise KeyError("gone")

    async def main() -> None:
        relay = Relay(produce, loop=asyncio.get_running_loop())
        with pytest.raises(KeyError):
            await relay.anext_piece()

    asyncio.run(main())


def test_a_closed_loop_cancels_the_producer() -> None:
    loop = asyncio.new_event_loop()
    loop.close()  # nobody will ever read: the first emit finds the loop gone
    relay = Relay(_until_cancelled([]), loop=loop)
    assert relay.wait(5)
    assert relay.cancel.is_set() and relay.result == "stopped"


def test_the_wrong_side_is_a_clear_error() -> None:
    relay = Relay(_count(0))
    with pytest.raises(ConfigError, match="anext_event|no event loop"):
        asyncio.run(relay.anext_event())
    relay.close()

    async def main() -> None:
        looped = Relay(_count(0), loop=asyncio.get_running_loop())
        with pytest.raises(ConfigError, match="await anext_event"):
            looped.next_event()
        await looped.aclose()

    asyncio.run(main())


# --- the server's kinds: "queued" from the producer, "tick" while nothing comes -----------------


def _queued_then_text(go: threading.Event) -> Callable[[Emitter, threading.Event], str]:
    # As a request waiting for KV memory: "queued" at once, its text only once admitted (`go`).
    def produce(emit: Emitter, cancel: threading.Event) -> str:
        emit.queued()
        go.wait(10)
        emit("a")
        return "done"

    return produce


def test_queued_arrives_in_order_and_pieces_skip_it() -> None:
    go = threading.Event()
    go.set()
    relay = Relay(_queued_then_text(go))
    assert [relay.next_event() for _ in range(3)] == [Event("queued", None), Event("text", "a"), Event("done", "done")]
    go2 = threading.Event()
    go2.set()
    pieces = Relay(_queued_then_text(go2))
    assert pieces.next_piece() == "a"  # the text is all next_piece hands over
    with pytest.raises(StopIteration):
        pieces.next_piece()


def test_ticks_come_while_nothing_does_and_lose_no_event() -> None:
    go = threading.Event()
    relay = Relay(_queued_then_text(go))
    assert relay.next_event(tick_s=5) == Event("queued", None)
    assert relay.next_event(tick_s=0.05) == Event("tick", None)  # waiting for its turn
    assert relay.next_event(tick_s=0.05) == Event("tick", None)
    go.set()
    assert relay.next_event(tick_s=5) == Event("text", "a")
    assert relay.next_event() == Event("done", "done")
    relay.close()


def test_async_queued_and_ticks_as_the_server_streams_them() -> None:
    async def main() -> tuple[list[Event], Relay[str]]:
        go = threading.Event()
        relay = Relay(_queued_then_text(go), loop=asyncio.get_running_loop())
        events = [await relay.anext_event(tick_s=5)]
        # The producer waits for `go`: nothing comes, so each wait ends in a keep-alive tick.
        events += [await relay.anext_event(tick_s=0.05), await relay.anext_event(tick_s=0.05)]
        go.set()  # admitted
        events += [await relay.anext_event(tick_s=5), await relay.anext_event(tick_s=5)]
        await relay.aclose()
        return events, relay

    events, relay = asyncio.run(main())
    assert events == [
        Event("queued", None),
        Event("tick", None),
        Event("tick", None),
        Event("text", "a"),
        Event("done", "done"),
    ]
    assert relay.result == "done" and not relay.cancel.is_set()

    async def pieces() -> list[str]:
        go = threading.Event()
        go.set()
        relay = Relay(_queued_then_text(go), loop=asyncio.get_running_loop())
        return [await relay.anext_piece()] + [p async for p in _rest(relay)]

    assert asyncio.run(pieces()) == ["a"]


async def _rest(relay: Relay[str]) -> AsyncIterator[str]:
    while True:
        try:
            yield await relay.anext_piece()
        except StopAsyncIteration:
            return
