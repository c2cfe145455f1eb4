"""One relay for streamed text: a producer runs in a worker thread and hands its text pieces, in
order, then its result or its error, to a consumer in another thread or on an event loop.

The producer is a function ``produce(emit, cancel)``: it calls ``emit(piece)`` for each piece of
text and returns its result; it should stop soon after ``cancel`` is set (generation checks it
at every token). ``emit.queued()`` says the request is waiting for its turn (a ``"queued"``
event: a server starts its response then, and keeps it alive while it waits). The consumer reads
:class:`Event` records (``next_event`` / ``anext_event``; with ``tick_s``, a ``"tick"`` event
when nothing came for that long, for a keep-alive) or just the pieces (``next_piece`` /
``anext_piece``, which skip the other kinds and raise the producer's error at the end).
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

__all__ = ["Emitter", "Event", "Relay"]

R = TypeVar("R")


class Event(NamedTuple):
    """One thing the producer handed over: ``("text", piece)`` and ``("queued", None)`` (waiting
    for its turn) in order, then ``("done", result)`` or ``("error", exception)``. A consumer that
    waits with ``tick_s`` also gets ``("tick", None)`` when nothing came for that long. A tuple,
    so ``kind, value = event`` unpacks it."""

    kind: Literal["text", "queued", "tick", "done", "error"]
    value: Any


_TICK = Event("tick", None)


class Emitter:
    """What the producer emits with: ``emit(piece)`` for a piece of text, ``emit.queued()`` when
    its request starts waiting for its turn (admission's queue)."""

    __slots__ = ("_put",)

    def __init__(self, put: Callable[[Event], None]) -> None:
        self._put = put

    def __call__(self, piece: str) -> None:
        self._put(Event("text", piece))

    def queued(self) -> None:
        self._put(Event("queued", None))


class Relay(Generic[R]):
    """Run ``produce(emit, cancel)`` in a worker and relay what it emits; see the module docstring.

    ``cancel``: the event handed to the producer (a fresh one by default; pass one the caller
    also sets, e.g. on shutdown). ``start``: how to run the worker, a function taking a
    zero-argument callable (default: a daemon thread named ``name``); a server passes its
    bounded worker pool's submit, and whatever ``start`` returns is kept as ``started``.
    """

    def __init__(
        self,
        produce: Callable[[Emitter, threading.Event], R],
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

    def _run(self) -> None:
        try:
            self.result = self._produce(Emitter(self._put), self.cancel)
            last = Event("done", self.result)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self.error = exc
            last = Event("error", exc)
        try:
            self._put(last)
        finally:
            self._finished.set()

    # -- consumer side --

    def next_event(self, *, tick_s: float | None = None) -> Event:
        """The next event, waiting for it (a relay without ``loop``); with ``tick_s``, a
        ``"tick"`` event instead once ``tick_s`` seconds passed without one."""
        if self._async is not None:
            raise ConfigError("this relay delivers through an event loop: await anext_event()")
        try:
            return self._seen(self._sync.get(timeout=tick_s))
        except queue.Empty:
            return _TICK

    async def anext_event(self, *, tick_s: float | None = None) -> Event:
        """The next event, awaiting it (a relay with ``loop``); with ``tick_s``, a ``"tick"``
        event instead once ``tick_s`` seconds passed without one (an SSE keep-alive comment)."""
        if self._async is None:
            raise ConfigError("this relay has no event loop: call next_event()")
        try:
            # A get cancelled by the time-out takes nothing off the queue: no event is lost.
            return self._seen(await asyncio.wait_for(self._async.get(), tick_s))
        except asyncio.TimeoutError:
            return _TICK

    def _seen(self, event: Event) -> Event:
        """Handing over the end: the consumer has it, so closing cancels nothing and the error
        is not the relay's to report any more."""
        if event.kind in ("done", "error"):
            self.ended = True
            self.error = None
        return event

    def _piece(self, event: Event) -> str | None:
        """The text of a text event, None for one that carries none; the end raises."""
        if event.kind == "text":
            return str(event.value)
        if event.kind in ("queued", "tick"):
            return None
        if event.kind == "error":
            raise event.value  # handed over now (see _seen)
        raise StopIteration

    def next_piece(self) -> str:
        """The next piece of text; ``StopIteration`` at the end; the producer's error, if it
        raised one, in place of the end."""
        while True:
            if self.ended:
                raise StopIteration
            piece = self._piece(self.next_event())
            if piece is not None:
                return piece

    async def anext_piece(self) -> str:
        """:meth:`next_piece` for a relay with ``loop`` (``StopAsyncIteration`` at the end)."""
        while True:
            if self.ended:
                raise StopAsyncIteration
            try:
                piece = self._piece(await self.anext_event())
            except StopIteration:
                raise StopAsyncIteration from None
            if piece is not None:
                return piece

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the producer has returned, at most ``timeout`` seconds (``None``: as long
        as it takes), without cancelling it; whether it has."""
        return self._finished.wait(timeout)

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
