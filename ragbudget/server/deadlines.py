"""Slow clients cut off: how long a request's headers and body may take to arrive (issue #42 §3).

uvicorn waits for a request as long as its client likes: h11 has no read deadline, and
uvicorn's ``timeout_keep_alive`` runs only between two requests. A client that announces
``Content-Length: 1000`` and sends 5 bytes, one that sends half a request line, or one that
connects and sends nothing holds its connection (a file descriptor, and for a body a task) until
it leaves; enough of them (Slowloris) take every descriptor the process has. Two guards, after
nginx's ``client_header_timeout`` / ``client_body_timeout`` and Node's ``headersTimeout`` /
``requestTimeout``, with the limits of :class:`~ragbudget.settings.ClientTimeoutSettings`:

* :class:`BodyDeadline` — pure ASGI middleware around ``receive``: a body that pauses longer than
  ``body_idle_timeout`` between two pieces, or takes longer than ``body_timeout`` in all, makes
  the route's ``receive`` raise :func:`body_timed_out`'s 408 (the OpenAI error object, with
  ``Connection: close``), which the app answers as any other error; ``/metrics`` counts it
  (``ragbudget_request_body_timeouts_total``). Any response sent while the body is still
  incomplete (a 401, 404 or 413 that did not read it) closes the connection too: uvicorn would
  otherwise go on reading the rest of that body at the client's pace.
* :func:`header_deadline_protocol` — uvicorn's h11 protocol with a watchdog from a connection's
  opening, or from the first byte of a kept-alive connection's next request, to the end of the
  request's headers; past ``header_timeout`` the client gets a 408 (nothing, if it sent nothing)
  and the connection is closed (``ragbudget_request_header_timeouts_total``). Headers are parsed
  before any ASGI app runs, so no middleware can see them; the guard is a protocol class, which
  uvicorn takes as its ``http`` option (its documented way to swap the HTTP implementation).

>>> import asyncio
>>> async def app(scope, receive, send):
...     await receive()  # the body's first piece
...     await receive()  # the rest, which never comes
>>> async def stalled():
...     await asyncio.sleep(3600)
...     return {"type": "http.disconnect"}
>>> scope = {"type": "http", "headers": [(b"content-length", b"1000")]}
>>> async def first():
...     return {"type": "http.request", "body": b"hello", "more_body": True}
>>> pieces = iter([first, stalled])
>>> sent = []
>>> async def send(message):
...     sent.append(message)
>>> guard = BodyDeadline(app, body_idle_timeout=0.05, body_timeout=30, metrics=Metrics())
>>> asyncio.run(guard(scope, lambda: next(pieces)(), send))
>>> sent[0]["status"], (b"connection", b"close") in sent[0]["headers"]
(408, True)
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any  # Any: ASGI scopes and messages, and uvicorn's protocol (the serve extra, imported lazily)

from .metrics import Metrics
from .openai_api import APIError

__all__ = ["BodyDeadline", "body_timed_out", "header_deadline_protocol", "header_timed_out"]

# The server's logger: a client cut off belongs with the server's lines.
log = logging.getLogger("ragbudget.server")

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Message, Receive, Send], Awaitable[None]]


def _limit(seconds: float) -> float | None:
    """A limit in seconds, or ``None`` for none (0 turns a limit off; so does infinity)."""
    return seconds if 0 < seconds < math.inf else None


def body_timed_out(received: int, declared: int | None, *, paused: float | None = None, total: float) -> APIError:
    """The 408 of a request whose body did not arrive in time: ``received`` bytes of ``declared``
    (``None``: a chunked body, of no announced length) after a pause of ``paused`` seconds, or
    ``total`` seconds after its headers when ``paused`` is ``None``.

    >>> err = body_timed_out(5, 1000, paused=10, total=30)
    >>> err.status, err.headers
    (408, {'Connection': 'close'})
    >>> print(err.message)  # doctest: +ELLIPSIS
    the request body stopped arriving: 5 of 1000 bytes came, then nothing for 10 s (...
    """
    came = f"{received} of {declared} bytes" if declared is not None else f"{received} bytes of a chunked body"
    if paused is not None:
        text = (
            f"the request body stopped arriving: {came} came, then nothing for {paused:g} s (the server's "
            "limit on a pause, serve --body-idle-timeout); send the body without pausing"
        )
    else:
        text = (
            f"the request body did not arrive within {total:g} s: {came} came (the server's limit on a "
            "whole body, serve --body-timeout); send it faster, or a smaller one"
        )
    return APIError(408, text, code="body_timeout", headers={"Connection": "close"})


def header_timed_out(seconds: float) -> APIError:
    """The 408 of a request whose headers did not arrive within ``seconds``."""
    return APIError(
        408,
        f"the request's headers did not arrive within {seconds:g} s (the server's limit, serve "
        "--header-timeout); send the request line and headers at once",
        code="header_timeout",
    )


def _announced(scope: Message) -> tuple[bool, int | None]:
    """Whether the request announces a body, and its length (``None``: chunked, or not a number)."""
    headers = dict(scope.get("headers") or [])
    length = headers.get(b"content-length")
    if length is not None:
        # Under uvicorn h11 has answered 400 to a Content-Length that is not a number before any
        # app runs; another server's is taken as a body of unknown length.
        declared = int(length) if length.strip().isdigit() else None
        return declared != 0, declared
    return b"transfer-encoding" in headers, None


async def _answer(send: Send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _Body:
    """One request's body under its two limits: the ``receive`` and ``send`` the app is given."""

    def __init__(self, receive: Receive, send: Send, declared: int | None, guard: BodyDeadline) -> None:
        self.inner_receive, self.inner_send = receive, send
        self.declared, self.guard = declared, guard
        self.loop = asyncio.get_running_loop()
        # The whole body's clock starts with its headers parsed (this middleware's call).
        self.deadline = self.loop.time() + guard.total if guard.total is not None else None
        self.received = 0
        self.whole = False  # the last piece has come (or the client left): no limit any more
        self.expired: APIError | None = None
        self.started = False  # a response has started

    async def receive(self) -> Message:
        if self.whole:  # the app listening for a disconnect once the body is in: no limit
            return await self.inner_receive()
        if self.expired is not None:  # an app that asks again after the 408 is told again
            raise self.expired
        wait, paused = self.guard.idle, self.guard.idle
        if self.deadline is not None:
            left = self.deadline - self.loop.time()
            if wait is None or left < wait:
                wait, paused = max(left, 0.0), None
        try:
            message = await asyncio.wait_for(self.inner_receive(), wait)
        except asyncio.TimeoutError:
            raise self.expire(paused) from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.whole = not message.get("more_body", False)
        else:  # http.disconnect: nothing more will come
            self.whole = True
        return message

    def expire(self, paused: float | None) -> APIError:
        total = self.guard.total if self.guard.total is not None else math.inf
        self.expired = body_timed_out(self.received, self.declared, paused=paused, total=total)
        self.guard.metrics.add("body_timeouts")
        # Info, not a warning: a flood of slow clients must not flood the log with alarms.
        log.info("cut off a slow client: %s", self.expired.message)
        return self.expired

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            if not self.whole:
                # Answered before the body is in: close the connection after the answer, or
                # uvicorn would read (and drop) the rest of the body for as long as it trickles.
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await self.inner_send(message)


class BodyDeadline:
    """Pure ASGI middleware bounding the time a request's body takes to arrive: at most
    ``body_idle_timeout`` seconds between two pieces and ``body_timeout`` seconds in all (0: no
    limit), then a 408 with ``Connection: close`` (:func:`body_timed_out`), counted in
    ``metrics`` as ``body_timeouts``.

    Pure ASGI, not ``BaseHTTPMiddleware``, which would read the whole body itself (a stalled one
    included) before the app saw a byte. The 408 is raised inside the app as its ``receive``
    returns, so the app answers it through its own error handlers (and counts it); one that
    escapes them is answered here. A request without a body passes untouched.
    """

    def __init__(self, app: App, *, body_idle_timeout: float, body_timeout: float, metrics: Metrics) -> None:
        self.app = app
        self.idle, self.total = _limit(body_idle_timeout), _limit(body_timeout)
        self.metrics = metrics

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        expects, declared = _announced(scope) if scope["type"] == "http" else (False, None)
        if not expects or (self.idle is None and self.total is None):
            await self.app(scope, receive, send)
            return
        body = _Body(receive, send, declared, self)
        try:
            await self.app(scope, body.receive, body.send)
        except APIError as exc:
            if exc is not body.expired or body.started:
                raise
            await _answer(body.send, exc)  # the 408 escaped the app's handlers


def header_deadline_protocol(header_timeout: float, on_timeout: Callable[[], None]) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a deadline on a request's headers: ``header_timeout`` seconds
    from a connection's opening, or from the first byte of a kept-alive connection's next request
    (the time between requests stays uvicorn's ``timeout_keep_alive``), to the end of the headers.
    Past it, ``on_timeout()`` is called, a client that sent part of a request gets
    :func:`header_timed_out`'s 408, and the connection is closed. For uvicorn's ``http`` option;
    0 gives uvicorn's own (``"h11"``'s class, without the deadline).

    The class reads h11's state of the connection (``conn.their_state``), the one thing that
    says the headers are in: a subclass of uvicorn's protocol, not a patch of it."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    limit = _limit(header_timeout)
    if limit is None:
        return H11Protocol
    seconds: float = limit  # narrowed for the class below
    err = header_timed_out(seconds)
    body = json.dumps(err.body()).encode()
    answer = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )

    class HeaderDeadline(H11Protocol):
        header_clock: asyncio.TimerHandle | None = None
        partial = False  # some of the next request has come

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's
            super().connection_made(transport)
            self.header_clock = self.loop.call_later(seconds, self.headers_late)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # a request begun, its headers not all in
                self.partial = True
                if self.header_clock is None and not self.transport.is_closing():
                    self.header_clock = self.loop.call_later(seconds, self.headers_late)
            else:
                self.stop_clock()

        def connection_lost(self, exc: Exception | None) -> None:
            self.stop_clock()
            super().connection_lost(exc)

        def stop_clock(self) -> None:
            if self.header_clock is not None:
                self.header_clock.cancel()
                self.header_clock = None
            self.partial = False

        def headers_late(self) -> None:
            self.header_clock = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            on_timeout()
            if self.partial:
                log.info("cut off a slow client: %s", err.message)
                self.transport.write(answer)
            self.transport.close()

    return HeaderDeadline
