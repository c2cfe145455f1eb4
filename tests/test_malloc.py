"""ragbudget.server.malloc: glibc's arena cap and malloc_trim, and the idle trimmer of the server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from ragbudget.errors import ConfigError
from ragbudget.server import malloc


def test_allocator_helpers() -> None:
    if not malloc.trimming_supported():
        assert malloc.release_memory() is False  # nothing to trim off glibc
    else:
        # Freed pages below a live allocation cannot go back by themselves (only the top of the
        # heap shrinks on free); release_memory must hand them back and say so.
        psutil = pytest.importorskip("psutil")
        me = psutil.Process()
        held = [bytes(4096) for _ in range(20_000)]  # ~80 MB of malloc'ed (not pymalloc) blocks
        pin = [bytes(4096) for _ in range(8)]  # allocated after, above them
        del held
        before = me.memory_info().rss
        assert malloc.release_memory() is True
        assert before - me.memory_info().rss > 40 * 2**20  # most of the 80 MB went back
        del pin
    with pytest.raises(ConfigError):
        malloc.limit_malloc_arenas(0)


def test_an_explicit_malloc_arena_max_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    # The operator's MALLOC_ARENA_MAX is left alone (glibc read it at start).
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert malloc.limit_malloc_arenas(2) is False


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_idle_trimmer_trims_once_after_a_burst_and_never_while_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    monkeypatch.setattr(malloc, "release_memory", lambda: calls.append(time.monotonic()) or True)
    busy = threading.Event()
    trimmer = malloc.IdleTrimmer(lambda: not busy.is_set(), delay=0.05)
    try:
        assert calls == [] and trimmer.trims == 0  # no thread, no trim before the first poke
        t0 = time.monotonic()
        for _ in range(20):  # a burst: pokes closer together than the delay
            trimmer.poke()
            time.sleep(0.005)
        assert wait_until(lambda: trimmer.trims == 1)
        assert calls[0] - t0 >= 0.05  # debounced: after the burst, not during it
        time.sleep(0.2)
        assert trimmer.trims == 1  # one trim per burst, not one per request
        busy.set()  # a request is in flight when the delay ends: no trim
        trimmer.poke()
        time.sleep(0.2)
        assert trimmer.trims == 1
    finally:
        trimmer.stop()
