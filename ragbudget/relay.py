"""One relay for streamed text: a producer runs in a worker thread and hands its text pieces, in
order, then its result or its error, to a consumer in another thread or on an event loop.

The producer is a function ``produce(emit, cancel)``: it calls ``emit(piece)`` for each piece of
text and returns its result; it should stop soon after ``cancel`` is set (generation checks it
at every token). The consumer reads :class:`Event` records (``next_event`` / ``anext_event``) or
just the pieces (``next_piece`` / ``anext_piece``, which raise the producer's error at the end).
``close()`` / ``aclose()`` sets ``cancel`` when the consumer leaves before the end and waits until
the producer has returned, so whatever it holds (a KV reservation, a worker) is free afterwards.

A relay built with ``loop`` delivers through that asyncio loop (never blocking it); without one,
through a thread-safe queue. If the loop is closed while the producer still emits, nobody is
listening any more: the relay sets ``cancel``.

>>> relay = Relay(lambda emit, cancel: [emit(w) for w in ("a", "b")] and "done")
>>> [relay.next_piece(), relay.next_piece()]
['a', 'b']
>>> relay.next_piece()
Traceback (most recent call last):
StopIteration
>>> relay.result
'done'
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, Literal, NamedTuple, TypeVar

from .errors import ConfigError

__all__ = ["Event", "Relay"]

R = TypeVar("R")


class Event(NamedTuple):
    """One thing the producer handed over: ``("text", piece)``, then ``("done", result)`` or
    ``("error", exception)``. A tuple, so ``kind, value = event`` unpacks it."""

    kind: Literal["text", "done", "error"]
    value: Any


class Relay(Generic[R]):
    """Run ``produce(emit, cancel)`` in a worker and relay what it emits; see the module docstring.

    ``cancel``: the event handed to the producer (a fresh one by default; pass one the caller
    also sets, e.g. on shutdown). ``start``: how to run the worker, a function taking a
    zero-argument callable (default: a daemon thread named ``name``); a server passes its
    bounded worker pool's submit, and whatever ``start`` returns is kept as ``started``.
    """

    def __init__(
        self,
        produce: Callable[[Callable[[str], None], threading.Event], R],
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        cancel: threading.Event | None = None,
        start: Callable[[Callable[[], None]], Any] | None = None,
        name: str = "ragbudget-relay",
    ) -> None:
        self.cancel = cancel if cancel is not None else threading.Event()
        #: The producer's return value once it has returned (``None`` before, or after an error).
        self.result: R | None = None
        #: An error the producer raised that the consumer has not been handed (it left early).
        self.error: BaseException | None = None
        #: Whether the consumer has seen the end (or closed the relay).
        self.ended = False
        #: The event loop the relay delivers through (``None``: a thread-safe queue).
        self.loop = loop
        self._produce = produce
        self._sync: queue.SimpleQueue[Event] = queue.SimpleQueue()
        # asyncio.Queue binds to the running loop on first use, so it may be created here.
        self._async: asyncio.Queue[Event] | None = asyncio.Queue() if loop is not None else None
        self._finished = threading.Event()
        if start is None:
            thread = threading.Thread(target=self._run, name=name, daemon=True)
            thread.start()
            self.started: Any = thread
        else:
            self.started = start(self._run)

    # -- producer side (the worker thread) --

    def _put(self, event: Event) -> None:
        if self.loop is None or self._async is None:
            self._sync.put(event)
            return
        try:
            self.loop.call_soon_threadsafe(self._async.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel.set()

    def _emit(self, piece: str) -> None:
        self._put(Event("text", piece))

    def _run(self) -> None:
        try:
            self.result = self._produce(self._emit, self.cancel)
            last = Event("done", self.result)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self.error = exc
            last = Event("error", exc)
        try:
            self._put(last)
        finally:
            self._finished.set()

    # -- consumer side --

    def next_event(self) -> Event:
        """The next event, waiting for it (a relay without ``loop``)."""
        if self._async is not None:
            raise ConfigError("this relay delivers through an event loop: await anext_event()")
        return self._sync.get()

    async def anext_event(self) -> Event:
        """The next event, awaiting it (a relay with ``loop``)."""
        if self._async is None:
            raise ConfigError("this relay has no event loop: call next_event()")
        return await self._async.get()

    def _piece(self, event: Event) -> str:
        if event.kind == "text":
            return str(event.value)
        self.ended = True
        if event.kind == "error":
            self.error = None  # handed over now
            raise event.value
        raise StopIteration

    def next_piece(self) -> str:
        """The next piece of text; ``StopIteration`` at the end; the producer's error, if it
        raised one, in place of the end."""
        if self.ended:
            raise StopIteration
        return self._piece(self.next_event())

    async def anext_piece(self) -> str:
        """:meth:`next_piece` for a relay with ``loop`` (``StopAsyncIteration`` at the end)."""
        if self.ended:
            raise StopAsyncIteration
        try:
            return self._piece(await self.anext_event())
        except StopIteration:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Cancel the producer if the end was not reached, and wait until it has returned."""
        if not self.ended:
            self.cancel.set()
        self._finished.wait()
        self.ended = True

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop."""
        if not self.ended:
            self.cancel.set()
        if not self._finished.is_set():
            await asyncio.to_thread(self._finished.wait)
        self.ended = True
