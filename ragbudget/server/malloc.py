"""Keeping a long-running server's resident memory at its baseline under glibc's allocator.

glibc gives threads their own malloc arenas (up to 8 per core) and keeps the memory freed in them
for reuse instead of returning it to the OS. A server whose worker threads each build prompts,
embed queries and run the model ends a load burst with a few hundred MB of free-but-resident
heap per round: RSS climbs with every burst and never returns to its baseline. Two remedies,
both no-ops off glibc: fewer arenas (:func:`limit_malloc_arenas`, at serve start), and giving
the free pages back (:func:`release_memory`) once the server goes idle (:class:`IdleTrimmer`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError

__all__ = ["IdleTrimmer", "limit_malloc_arenas", "release_memory", "trimming_supported"]

_M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)


@functools.lru_cache(maxsize=1)
def _glibc() -> Any:
    """glibc through ctypes, or None (musl, macOS, Windows: their allocators need no help here)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not (hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt")):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def release_memory() -> bool:
    """Return the heap memory freed so far to the OS (glibc ``malloc_trim(0)``: the free pages of
    every arena, not only the top of the main heap). True when something was released; False
    also off glibc. Costs a few milliseconds per GB of heap; the server calls it when idle."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def limit_malloc_arenas(n: int = 2) -> bool:
    """Cap glibc's malloc arenas at ``n`` (``mallopt(M_ARENA_MAX, n)``, what ``MALLOC_ARENA_MAX=n``
    does), for the threads that allocate from now on. A thread pool doing model work otherwise
    spreads its garbage over up to 8 arenas per core. An explicit ``MALLOC_ARENA_MAX`` in the
    environment wins. Returns True when the limit was set."""
    if n < 1:
        raise ConfigError(f"the malloc arena limit must be >= 1, got {n}")
    libc = _glibc()
    if libc is None or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, n))


class IdleTrimmer:
    """One daemon thread that calls :func:`release_memory` once the server has been idle (no
    request in flight) for ``delay`` seconds after a burst; requests never wait for it."""

    def __init__(self, idle: Callable[[], bool], delay: float = 0.5) -> None:
        self.idle = idle
        self.delay = delay
        self.trims = 0
        self._poke = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def poke(self) -> None:
        """A request just ended: trim if the server is still idle ``delay`` seconds from now."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ragbudget-trim", daemon=True)
                self._thread.start()
        self._poke.set()

    def stop(self) -> None:
        """End the thread (at shutdown); a trim under way finishes first."""
        self._stop.set()
        self._poke.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poke.wait()
            self._poke.clear()
            # Debounce: within a burst the server is idle only for instants; trim after it.
            while not self._stop.wait(self.delay) and self._poke.is_set():
                self._poke.clear()
            if not self._stop.is_set() and self.idle():
                release_memory()
                self.trims += 1


def trimming_supported() -> bool:
    """Whether :func:`release_memory` can do anything here (glibc)."""
    return _glibc() is not None
