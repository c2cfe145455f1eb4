"""A served engine's health and live load, as ``ragbudget serve --engine`` admits against it
(:class:`EngineLoad`, wired by :func:`ragbudget.server.app.create_app`; the chat endpoint refuses
early by it, ``/health`` and ``/metrics`` show it).

It knows, at most a second late and without ever waiting on the engine, whether the engine can
take a request now — up (and how loaded) or unavailable (and why).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar  # Any: JSON for /health

from ..errors import EngineConnectionError, EngineError, EngineOverloadedError, EngineTimeoutError
from .metrics import metric_help
from .openai_api import engine_unavailable

if TYPE_CHECKING:
    from ..generation.backend import Backend, Capacity
    from ..pipeline import Pipeline

__all__ = ["EngineLoad", "quick_look"]

# The server's logger: the engine coming and going belongs with the server's lines.
log = logging.getLogger("ragbudget.server")

T = TypeVar("T")


def quick_look(pipeline: Pipeline, fn: Callable[[], T]) -> T:
    """``fn()``, with what it asks the engine asked as a quick look (:meth:`Backend.probing
    <ragbudget.generation.backend.Backend.probing>`: an overloaded or loading engine says so at once,
    without the back-off a request gets). For what /health and the early refusals read: they must
    answer now. Blocks: call it off the event loop."""
    with pipeline.backend.probing():
        return fn()


class EngineLoad:
    """The served engine's health and live load, as the gateway admits against it.

    Its figures — requests running and waiting, and free KV tokens, where the engine reports them
    (:meth:`Backend.capacity <ragbudget.generation.backend.Backend.capacity>`) — are read at most every
    ``ttl`` seconds, as a quick look (:meth:`HTTP.probing <ragbudget.generation.engines.HTTP.probing>`: an
    overloaded engine says so at once, without the back-off a request gets). One reading at a
    time, and nobody waits for it: a request or a /health arriving meanwhile takes the last
    figures, so an engine that hangs cannot hang the gateway.

    Health: a reading that fails (the engine refused the connection, timed out, answered 503
    while loading, or answered what is not its API) makes the engine *unavailable* (:attr:`error`)
    until a reading succeeds again; so does a request that finds it gone (:meth:`failed`) — until
    the next reading, one ``ttl`` later. Meanwhile chat requests are answered before any work, with
    ``Retry-After``: 504 when the engine gave no answer within the engine time-out (hung), 503
    otherwise (down, loading, broken); /health answers 503 (what a load balancer reads as "take
    this one out of rotation"), naming the engine and the cause.

    Load fails open: an engine that reports neither its queue nor its free KV is not limited here
    (the gateway's own admission still is, and the engine queues and refuses itself); /health and
    /metrics say so."""

    def __init__(self, pipeline: Pipeline, ttl: float = 1.0) -> None:
        self.pipeline, self.ttl = pipeline, ttl
        self._reading = threading.Lock()
        self._read_at = -math.inf
        self._figures: tuple[Capacity | None, str] = (None, "not read yet")
        self.error: EngineError | None = None  # why the engine is unavailable now (None: it is not)
        # The backend of the last reading: /metrics reads its counters without ever connecting.
        self._backend: Backend | None = None
        # Which engine, for /health, before the first connection names it: the URL as given
        # (credentials dropped) and the kind asked for.
        from ..generation.engines import root_url

        given = pipeline.engine.url
        self.url: str | None = root_url(given) if given else None
        self.kind: str | None = pipeline.engine.kind if given and pipeline.engine.kind != "auto" else None

    def read(self) -> tuple[Capacity | None, str]:
        """``(capacity, "")``, or ``(None, why)`` when the engine's figures cannot be read.
        When the last reading is ``ttl`` old, reads afresh — blocking for the engine's reply
        (call it off the event loop) unless another thread is reading, whose result is not
        waited for."""
        if time.monotonic() - self._read_at >= self.ttl and self._reading.acquire(blocking=False):
            try:
                if time.monotonic() - self._read_at >= self.ttl:  # not read while we got here
                    self._read()
            finally:
                self._reading.release()
        return self._figures

    def _read(self) -> None:
        try:
            backend = self.pipeline.backend  # connects on first use: a server down then fails here
            self.url, self.kind, self._backend = backend.url or self.url, backend.kind or self.kind, backend
            # Fresh: this look keeps its own interval (ttl), which a backend's reuse of a recent
            # reading (for the calls within one request) must not lengthen.
            with backend.probing():
                cap = backend.capacity(fresh=True)
        except EngineError as exc:
            if self.error is None:
                log.error("the engine is unavailable: %s", exc)
            self._figures, self.error = (None, str(exc)), exc
        else:
            if self.error is not None:
                log.info("the engine is available again")
            self._figures, self.error = (cap, ""), None
        self._read_at = time.monotonic()

    def failed(self, exc: BaseException) -> None:
        """A request met the engine failing: if it is gone (connection refused, dropped, unknown
        host, TLS) or overloaded, it is unavailable until the next reading (one ``ttl`` later)
        says otherwise. A time-out or an odd answer may be that request's alone: not counted."""
        if not isinstance(exc, (EngineConnectionError, EngineOverloadedError)) or isinstance(exc, EngineTimeoutError):
            return
        if self.error is None:
            log.error("the engine is unavailable: %s", exc)
        self.error = exc
        self._figures = (None, str(exc))
        self._read_at = time.monotonic()

    def sent(self) -> dict[str, int] | None:
        """Requests sent to the engine so far, by route (``None`` before it is connected, or for
        a backend with no engine to send to)."""
        backend = self._backend  # the one the last reading used: /metrics never waits on a connection
        sent = backend.requests_sent() if backend is not None else None
        return dict(sent) if sent is not None else None

    @classmethod
    def watching(cls, pipeline: Pipeline, ttl: float = 1.0) -> EngineLoad | None:
        """An :class:`EngineLoad` for a pipeline that generates on an engine elsewhere — one it
        is configured to connect to (``engine=``), or a given backend with a :attr:`url
        <ragbudget.generation.backend.Backend.url>` — else ``None``: a backend in this process
        has no health or load of its own to watch."""
        if pipeline.engine.url is None and not pipeline.backend.url:
            return None
        return cls(pipeline, ttl=ttl)

    def state(self) -> dict[str, Any]:
        """What /health shows of the engine: its kind and URL, and whether it is available (with
        the cause when not)."""
        out: dict[str, Any] = {"kind": self.kind, "url": self.url}
        if self.error is None:
            return {**out, "status": "ok"}
        err = engine_unavailable(self.error)
        # The engine's root URL stays "url"; the route that failed is in the message.
        return {**out, "status": "unavailable", "cause": err.extra["engine"]["cause"], "error": err.message}

    @staticmethod
    def refusal(figures: tuple[Capacity | None, str], max_new_tokens: int) -> str | None:
        """Why the engine cannot take a request now, or None. Its waiting queue is non-empty only
        when it cannot schedule more (vLLM and SGLang schedule while KV blocks are free), so a
        request sent now would only queue there, past any timeout the client has."""
        cap, _ = figures
        if cap is None:
            return None
        if cap.waiting:
            return f"the engine has {cap.waiting} request(s) waiting ({cap.load_source})"
        if cap.kv_tokens_free is not None and cap.kv_tokens_free < max_new_tokens:
            return (
                f"the engine has {cap.kv_tokens_free} free KV tokens, fewer than the "
                f"{max_new_tokens} of one answer ({cap.kv_free_source})"
            )
        return None

    @staticmethod
    def describe(figures: tuple[Capacity | None, str]) -> dict[str, Any]:
        """What /health shows of the figures: the engine's load, or why admission is open."""
        cap, error = figures
        if cap is None or (cap.waiting is None and cap.kv_tokens_free is None):
            why = error or f"the {cap.engine_kind if cap else 'engine'} reports neither its queue nor its free KV"
            return {"open": True, "note": f"open: {why}; only the gateway's own admission limits requests"}
        return {
            "open": False,
            "running": cap.running,
            "waiting": cap.waiting,
            "kv_tokens_free": cap.kv_tokens_free,
            "age_s": round(cap.age(), 3),
            "sources": [s for s in (cap.load_source, cap.kv_free_source) if s],
        }

    @classmethod
    def gauges(cls, figures: tuple[Capacity | None, str]) -> dict[str, tuple[str, float]]:
        """What /metrics shows of the figures (:meth:`ragbudget.server.metrics.Metrics.render` gauges)."""
        cap, _ = figures
        out: dict[str, tuple[str, float]] = {
            "ragbudget_engine_admission_open": (
                metric_help("ragbudget_engine_admission_open"),
                1 if cls.describe(figures)["open"] else 0,
            )
        }
        if cap is not None:
            for name, value in (
                ("ragbudget_engine_running_requests", cap.running),
                ("ragbudget_engine_waiting_requests", cap.waiting),
                ("ragbudget_engine_kv_free_tokens", cap.kv_tokens_free),
            ):
                if value is not None:
                    out[name] = (metric_help(name), value)
        return out
