"""``ragbudget serve``: an OpenAI-compatible HTTP server whose admission follows the KV budget.

Endpoints (all JSON; errors are OpenAI-style ``{"error": {"message", "type", "param", "code"}}``):

* ``POST /v1/chat/completions`` — the OpenAI chat schema; ``stream: true`` sends server-sent events
  in OpenAI chunk format ending with ``data: [DONE]``. The retrieved sources come back in an extra
  top-level ``sources`` field (and in the final chunk when streaming), the budget report in
  ``ragbudget``. The last message is the question; earlier messages are the history, budgeted
  as ``ragbudget chat`` does (older turns folded into a summary when they do not fit).
  ``temperature`` (absent or 0: greedy), ``top_p``, ``seed``, ``stop`` (up to 4 strings, excluded
  from the answer, streaming or not) and ``max_tokens`` reach the generator. A ``max_tokens``
  above the server's ``max_new_tokens`` is a 400 naming both (OpenAI's rule past a model's limit),
  and so is any field the server would otherwise ignore: unknown ones, and the OpenAI features
  ragbudget does not implement (``tools``, ``logprobs``, ``response_format`` other than text, …)
  unless sent with their do-nothing default.
* ``POST /v1/retrieve`` — the chunks that fit the budget for a query (no generation); with ``k``
  (at most :data:`MAX_RETRIEVE_K`), the ``k`` best hits instead.
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).

Admission: every chat request goes through ``pipeline.ask``, which reserves its KV tokens with the
pipeline's :class:`~ragbudget.admission.AdmissionController`. A request runs only while the summed
reservations fit the KV capacity; others wait in a bounded queue for a bounded time; beyond that
the controller raises :class:`~ragbudget.errors.OverloadedError` and the client gets ``429`` with
``Retry-After`` — never a 5xx, never an OOM. Model work runs in a bounded thread pool, off the event
loop, so ``/health`` answers throughout. A client that disconnects sets the request's cancel event,
which stops generation and frees the reservation at once.

Only the server's own faults are 5xx. A malformed body, or one nested deeper than
:data:`MAX_JSON_DEPTH`, is a 400; a client that leaves before its answer (even in the middle of
its body) is counted as 499, without a traceback; an index that is missing or damaged is a 503,
and ``/health`` then answers 503 too. :func:`serve` refuses to start on such an index or a port it
cannot bind. Responses never carry an absolute path, nor host memory figures unless
``expose_plan``.

>>> from ragbudget.pipeline import Pipeline                  # doctest: +SKIP
>>> app = create_app(Pipeline(".ragbudget"), api_key="s3cret")  # doctest: +SKIP
>>> import uvicorn; uvicorn.run(app, host="127.0.0.1", port=8000)  # doctest: +SKIP

``fastapi`` and ``uvicorn`` are the ``serve`` extra; they are imported when :func:`create_app` or
:func:`serve` is called, not when this module is imported.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route functions' annotations
# (``request: Request``) at runtime, and Request is imported lazily inside create_app.
import asyncio
import contextlib
import ctypes
import errno
import functools
import hashlib
import hmac
import json
import logging
import math
import os
import platform
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .admission import AdmissionController
from .errors import (
    BudgetError,
    ConfigError,
    IndexNotFoundError,
    ModelError,
    OverloadedError,
    RagBudgetError,
    RequestCancelled,
    SearchIndexError,
)

if TYPE_CHECKING:
    from .backend import Capacity
    from .index import Index
    from .pipeline import Answer, Pipeline

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "LOOPBACK_HOSTS",
    "MAX_JSON_DEPTH",
    "MAX_RETRIEVE_K",
    "Metrics",
    "background_server",
    "create_app",
    "limit_malloc_arenas",
    "release_memory",
    "serve",
]

log = logging.getLogger(__name__)

#: 1 MiB is far above any question plus a long chat history, and small enough that a hostile body
#: cannot cost memory.
DEFAULT_MAX_BODY_BYTES = 1 << 20
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
API_KEY_ENV = "RAGBUDGET_API_KEY"

# Roles accepted in ``messages``; ``developer`` is the newer OpenAI name for ``system``.
_ROLES = {"system", "developer", "user", "assistant"}
# OpenAI sampling fields that reach the generator, with their accepted ranges (OpenAI's own).
_SAMPLING_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}
# Range-checked as OpenAI does, then refused unless 0 (see _UNSUPPORTED): the generator has no
# equivalent. The OpenAI penalties are additive on token counts, transformers'
# repetition_penalty is multiplicative, and passing one off as the other would change answers in
# ways the client did not ask for.
_PENALTY_RANGES = {"presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}
#: OpenAI accepts up to 4 stop sequences.
MAX_STOP = 4
#: Deepest nesting of arrays/objects a request body may have. A chat request needs 5 (body,
#: messages, message, content parts, part); the limit leaves room for clients' extra fields while
#: a hostile 50,000-deep body is refused before anything recurses over it.
MAX_JSON_DEPTH = 32
#: Most chunks ``/v1/retrieve`` returns for ``k``.
MAX_RETRIEVE_K = 1000
# The status answered (and counted in /metrics) when the client left before its answer: nginx's
# "client closed request". Nobody reads it; it keeps client disconnects apart from server errors.
CLIENT_CLOSED = 499

# OpenAI request fields ragbudget does not implement, with the values that ask for nothing (they
# pass, since clients send them as defaults); any other value is a 400 naming the field, rather
# than an answer that silently ignores what the client asked for.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
# Fields with no effect on the answer (bookkeeping on OpenAI's side), accepted and not used.
_NO_EFFECT = {"user", "metadata", "store", "service_tier"}
# Everything /v1/chat/completions reads; ``context_tokens`` is ragbudget's own extra.
_CHAT_FIELDS = {"model", "messages", "stream", "stream_options", "n", "temperature", "top_p", "seed", "stop",
                "max_tokens", "max_completion_tokens", "context_tokens"} | set(_UNSUPPORTED) | _NO_EFFECT
_RETRIEVE_FIELDS = {"query", "k", "context_tokens"}

# Latency buckets (seconds): from a cached answer on a GPU to a long CPU generation.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


# --- errors ---------------------------------------------------------------------------------------


class _APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - the OpenAI field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _retry_after(seconds: float) -> str:
    # Retry-After takes whole seconds; round up so that a client honoring it does not come back
    # before the queue had a chance to drain.
    return str(max(1, math.ceil(seconds)))


def _error_from_exception(exc: BaseException, *, expose_plan: bool = False) -> _APIError:
    """Map an exception to the HTTP answer. Only the server's own faults are 5xx: overload is 429,
    a request that can never fit the budget or a bad value is 400, a client that left is 499; an
    index or model the server cannot use is 503, anything else 500. The 5xx messages name the
    error's type only: its text (paths, memory figures) goes to the server's log, not the client.
    ``expose_plan`` keeps host memory figures in a budget error's message (``--expose-plan``)."""
    if isinstance(exc, _APIError):
        return exc
    if isinstance(exc, OverloadedError):
        return _APIError(
            429,
            f"{exc} (retry after the Retry-After header)",
            type="rate_limit_error",
            code="overloaded",
            headers={"Retry-After": _retry_after(exc.retry_after)},
        )
    if isinstance(exc, BudgetError):
        return _APIError(400, str(exc) if expose_plan else _budget_message(exc), code="context_length_exceeded",
                         param="messages")
    if isinstance(exc, ConfigError):
        return _APIError(400, _scrub_text(str(exc)), code="invalid_value")
    if isinstance(exc, RequestCancelled) or _is_client_disconnect(exc):
        return _APIError(CLIENT_CLOSED, "the client disconnected before its answer", code="client_disconnected")
    if isinstance(exc, SearchIndexError):
        log.error("the index is unavailable: %s", exc)
        return _index_unavailable(exc)
    if isinstance(exc, ModelError):
        log.error("the model is unavailable: %s", exc)
        return _APIError(503, f"the server's model is unavailable ({type(exc).__name__}); details in the server "
                         "log", type="server_error", code="model_unavailable")
    if isinstance(exc, RagBudgetError):
        log.error("error while serving a request: %s: %s", type(exc).__name__, exc)
        return _APIError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")
    log.exception("unexpected error while serving a request", exc_info=exc)
    return _APIError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")


def _index_unavailable(exc: BaseException) -> _APIError:
    return _APIError(503, f"the server's index is unavailable ({type(exc).__name__}); its operator must build, "
                     "rebuild or restore it (details in the server log)", type="server_error",
                     code="index_unavailable")


def _is_client_disconnect(exc: BaseException) -> bool:
    # starlette.requests.ClientDisconnect, matched by name so this module imports no starlette.
    return type(exc).__name__ == "ClientDisconnect" and type(exc).__module__.startswith("starlette")


def _budget_message(exc: BudgetError) -> str:
    """A budget error in tokens only: the library's message names the GPU and its free/usable
    bytes, which a client has no business knowing (``--expose-plan`` sends it as is)."""
    fix = "shorten the question or the history, or ask for fewer max_tokens"
    if exc.unit == "tokens" and exc.needed is not None and exc.available is not None:
        return f"the request needs {exc.needed} tokens but this server allows {exc.available} per request; {fix}"
    return f"the request does not fit this server's memory budget; {fix}"


# --- metrics --------------------------------------------------------------------------------------


class _Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count) for one label set."""

    def __init__(self, buckets: Sequence[float] = _BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last slot is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value
        self.count += 1


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    def escaped(v: str) -> str:  # Prometheus label values: backslash and double quote escaped
        return str(v).replace("\\", "\\\\").replace('"', '\\"')

    inner = ",".join(f'{k}="{escaped(v)}"' for k, v in sorted(pairs.items()))
    return "{" + inner + "}"


class Metrics:
    """Counters and histograms of the server, rendered in the Prometheus text format (0.0.4).

    Thread-safe: observations come from the event loop and from worker threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.oom_steps = 0
        self.cancelled = 0
        self.rejected = 0
        self.refused_early = 0  # of those, refused before their prompt was built
        self.tokens_prompt = 0
        self.tokens_completion = 0
        self.summary_turns_cached = 0
        self.in_flight = 0
        self.histograms: dict[tuple[str, tuple[tuple[str, str], ...]], _Histogram] = {}

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1
            if status == 429:
                self.rejected += 1

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            hist = self.histograms.get(key)
            if hist is None:
                hist = self.histograms[key] = _Histogram()
            hist.observe(value)

    def add(self, field: str, value: int = 1) -> None:
        with self._lock:
            setattr(self, field, getattr(self, field) + value)

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """The exposition text; ``gauges`` maps metric name to (help, value) read at scrape time."""
        out: list[str] = []

        def metric(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        with self._lock:
            metric("ragbudget_requests_total", "counter", "HTTP requests answered, by endpoint and status.")
            for (endpoint, status), n in sorted(self.requests.items()):
                out.append(f"ragbudget_requests_total{_labels({'endpoint': endpoint, 'status': status})} {n}")
            for name, help_, value in (
                ("ragbudget_rejected_total", "Requests refused with 429 by admission control.", self.rejected),
                (
                    "ragbudget_refused_before_retrieval_total",
                    (
                        "429s answered before any retrieval or prompt building (queue full, or the "
                        "first token would come past the queue time-out)."
                    ),
                    self.refused_early,
                ),
                ("ragbudget_cancelled_total", "Requests whose client disconnected before the end.", self.cancelled),
                ("ragbudget_oom_steps_total", "Steps taken down the OOM fallback ladder.", self.oom_steps),
                ("ragbudget_prompt_tokens_total", "Prompt tokens processed.", self.tokens_prompt),
                ("ragbudget_completion_tokens_total", "Tokens generated.", self.tokens_completion),
                (
                    "ragbudget_summary_cache_turns_total",
                    "History turns whose summary came from the summary cache instead of a generate call.",
                    self.summary_turns_cached,
                ),
            ):
                metric(name, "counter", help_)
                out.append(f"{name} {value}")
            metric("ragbudget_requests_in_flight", "gauge", "Chat/retrieve requests being served (running or queued).")
            out.append(f"ragbudget_requests_in_flight {self.in_flight}")
            for name, (help_, value) in sorted(gauges.items()):
                metric(name, "gauge", help_)
                out.append(f"{name} {_fmt(value)}")
            by_name: dict[str, list[tuple[tuple[tuple[str, str], ...], _Histogram]]] = {}
            for (name, labels), hist in self.histograms.items():
                by_name.setdefault(name, []).append((labels, hist))
            for name in sorted(by_name):
                metric(name, "histogram", _HISTOGRAM_HELP.get(name, name))
                for labels, hist in sorted(by_name[name], key=lambda x: x[0]):
                    base = dict(labels)
                    cumulative = 0
                    for bound, n in zip(hist.buckets, hist.counts, strict=False):  # counts may add +Inf
                        cumulative += n
                        out.append(f"{name}_bucket{_labels({**base, 'le': _fmt(bound)})} {cumulative}")
                    cumulative += hist.counts[-1]
                    out.append(f"{name}_bucket{_labels({**base, 'le': '+Inf'})} {cumulative}")
                    out.append(f"{name}_sum{_labels(base)} {_fmt(hist.sum)}")
                    out.append(f"{name}_count{_labels(base)} {hist.count}")
        return "\n".join(out) + "\n"


_HISTOGRAM_HELP = {
    "ragbudget_request_duration_seconds": "Time from request to the last byte of the answer.",
    "ragbudget_time_to_first_token_seconds": "Streaming: time from request to the first text.",
    "ragbudget_queue_wait_seconds": "Time a request waited for KV admission.",
}


def _fmt(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


# What /health and /metrics show of the admission controller's stats.
# With a memory model admission counts bytes (KV + activations of each request) and, with a
# measured throughput, refuses for time as well (issue #14).
_ADMISSION_FIGURES = (
    "running",
    "queued",
    "admitted_tokens",
    "capacity_tokens",
    "capacity_bytes",
    "admitted_bytes",
    "peak_admitted_bytes",
    "refused_for_time_total",
    "work_ahead_s",
    "slowdown",
)


class _EngineLoad:
    """The served engine's live load, as the gateway admits against it: requests running and
    waiting, and free KV tokens, where the engine reports them (:meth:`Backend.capacity
    <ragbudget.backend.Backend.capacity>`), read at most every ``ttl`` seconds (requests in
    between share the figures; one reading at a time). Fails open: an engine that reports
    neither its queue nor its free KV, or whose metrics cannot be read, is not limited here (the
    gateway's own admission still is, and the engine queues and refuses itself); /health and
    /metrics say so."""

    def __init__(self, pipeline: "Pipeline", ttl: float = 1.0) -> None:
        self.pipeline, self.ttl = pipeline, ttl
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._figures: tuple[Capacity | None, str] = (None, "not read yet")

    def read(self) -> "tuple[Capacity | None, str]":
        """``(capacity, "")``, or ``(None, why)`` when the engine's figures cannot be read.
        Blocks for the engine's reply (at most once per ``ttl``): call it off the event loop."""
        from .errors import EngineError

        with self._lock:
            if time.monotonic() - self._read_at >= self.ttl:
                try:
                    self._figures = (self.pipeline.backend.capacity(), "")
                except EngineError as exc:  # generation will say what is wrong; admission stays open
                    self._figures = (None, str(exc))
                self._read_at = time.monotonic()
            return self._figures

    @staticmethod
    def refusal(figures: "tuple[Capacity | None, str]", max_new_tokens: int) -> str | None:
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
    def describe(figures: "tuple[Capacity | None, str]") -> dict[str, Any]:
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
    def gauges(cls, figures: "tuple[Capacity | None, str]") -> dict[str, tuple[str, float]]:
        cap, _ = figures
        help_open = (
            "1: the served engine reports neither its queue nor its free KV (or they cannot be "
            "read), so requests are not refused for its load (fail open); 0: they are."
        )
        out = {"ragbudget_engine_admission_open": (help_open, 1 if cls.describe(figures)["open"] else 0)}
        if cap is not None:
            for name, value, help_ in (
                ("ragbudget_engine_running_requests", cap.running, "Requests the engine runs (its metrics)."),
                ("ragbudget_engine_waiting_requests", cap.waiting, "Requests the engine queues (its metrics)."),
                ("ragbudget_engine_kv_free_tokens", cap.kv_tokens_free, "Free KV tokens the engine reports."),
            ):
                if value is not None:
                    out[name] = (help_, value)
        return out


# --- memory ---------------------------------------------------------------------------------------
#
# glibc gives threads their own malloc arenas (up to 8 per core) and keeps the memory freed in them
# for reuse instead of returning it to the OS. A server whose worker threads each build prompts,
# embed queries and run the model ends a load burst with a few hundred MB of free-but-resident
# heap per round: RSS climbs with every burst and never returns to its baseline. Two remedies,
# both no-ops off glibc: fewer arenas (mallopt M_ARENA_MAX, at serve start), and giving the free
# pages back (malloc_trim) once the server goes idle.

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


class _IdleTrimmer:
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


# --- request parsing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _ChatRequest:
    model: str
    question: str
    history: list[dict[str, str]]
    stream: bool
    include_usage: bool
    max_tokens: int | None
    context_tokens: int | None
    sampling: dict[str, Any]  # temperature / top_p / seed / stop as sent (absent ones left out)
    # The body's digest: a client retrying after a 429 sends the same body again, and admission
    # keeps the place it promised that client (AdmissionController.returning).
    key: str = ""


def _content_text(content: Any, where: str) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _APIError(
                    400,
                    f"{where}.content[{i}] must be a text part {{'type': 'text', 'text': str}}; "
                    "images, audio and files are not supported",
                    param=f"{where}.content",
                    code="invalid_type",
                )
            parts.append(part["text"])
        return "\n".join(parts)
    raise _APIError(
        400,
        f"{where}.content must be a string or a list of text parts, got {type(content).__name__}",
        param=f"{where}.content",
        code="invalid_type",
    )


def _opt_int(body: dict[str, Any], name: str, *, minimum: int = 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _APIError(
            400, f"'{name}' must be an integer, got {type(value).__name__}", param=name, code="invalid_type"
        )
    if value < minimum:
        raise _APIError(400, f"'{name}' must be >= {minimum}, got {value}", param=name, code="invalid_value")
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _APIError(400, f"'{name}' must be a number, got {type(value).__name__}", param=name, code="invalid_type")
    if not low <= value <= high:  # also refuses NaN
        raise _APIError(
            400, f"'{name}' must be between {low:g} and {high:g}, got {value}", param=name, code="invalid_value"
        )
    return value


def _parse_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling options for ``generate``: temperature (absent or 0 is greedy), top_p, seed and
    stop (a string or up to :data:`MAX_STOP` strings), validated as OpenAI does."""
    out: dict[str, Any] = {}
    for name, (low, high) in _SAMPLING_RANGES.items():
        value = _number(body, name, low, high)
        if value is not None:
            out[name] = value
    for name, (low, high) in _PENALTY_RANGES.items():
        _number(body, name, low, high)
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise _APIError(
                400, f"'seed' must be an integer, got {type(seed).__name__}", param="seed", code="invalid_type"
            )
        if not -(2**63) <= seed < 2**64:
            raise _APIError(400, f"'seed' must fit in 64 bits, got {seed}", param="seed", code="invalid_value")
        out["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise _APIError(400, "'stop' must be a string or a list of strings", param="stop", code="invalid_type")
        if len(items) > MAX_STOP:
            raise _APIError(
                400, f"'stop' takes at most {MAX_STOP} sequences, got {len(items)}", param="stop", code="invalid_value"
            )
        if any(not s for s in items):
            raise _APIError(400, "'stop' sequences must not be empty strings", param="stop", code="invalid_value")
        if items:
            out["stop"] = list(items)
    return out


def _check_fields(body: dict[str, Any], known: set[str]) -> None:
    """Refuse unknown fields, as OpenAI does, rather than answer as if they had not been sent."""
    for name in body:
        if name not in known:
            raise _APIError(
                400, f"unrecognized request argument supplied: {name!r}", param=name, code="unknown_parameter"
            )


def _neutral(value: Any, ok: Any) -> bool:
    if ok is None or isinstance(ok, bool):
        return value is ok
    if isinstance(ok, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == ok
    return type(value) is type(ok) and value == ok


def _check_unsupported_values(body: dict[str, Any]) -> None:
    """The OpenAI features ragbudget does not implement are a 400 naming the field, unless sent
    with the value that asks for nothing (``logprobs: false``, ``tools: []``,
    ``response_format: {"type": "text"}``, a 0 penalty, …)."""
    for name, neutral in _UNSUPPORTED.items():
        value = body.get(name)
        if not any(_neutral(value, ok) for ok in neutral):
            raise _APIError(
                400,
                f"'{name}' is not supported by ragbudget (got {json.dumps(value)[:80]}); leave it out",
                param=name,
                code="unsupported_parameter",
            )


def _parse_chat(body: Any, models: Sequence[str], *, max_tokens_limit: int | None = None) -> _ChatRequest:
    """Validate a chat completion request. ``max_tokens_limit`` is the most output tokens the
    server reserves per answer: a larger ``max_tokens`` is a 400 naming both (as OpenAI answers
    a value past the model's limit), never silently lowered."""
    if not isinstance(body, dict):
        raise _APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_type")
    _check_fields(body, _CHAT_FIELDS)
    model = body.get("model")
    if model is None:
        raise _APIError(400, "missing required parameter 'model'", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise _APIError(
            400, f"'model' must be a string, got {type(model).__name__}", param="model", code="invalid_type"
        )
    if model not in models:
        raise _APIError(
            404,
            f"the model {model!r} does not exist; this server serves {', '.join(map(repr, models))}",
            param="model",
            code="model_not_found",
        )
    messages = body.get("messages")
    if messages is None:
        raise _APIError(
            400, "missing required parameter 'messages'", param="messages", code="missing_required_parameter"
        )
    if not isinstance(messages, list):
        raise _APIError(
            400, f"'messages' must be a list, got {type(messages).__name__}", param="messages", code="invalid_type"
        )
    if not messages:
        raise _APIError(
            400, "'messages' must not be empty: send at least one user message", param="messages", code="empty_array"
        )
    parsed: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _APIError(
                400, f"{where} must be an object, got {type(msg).__name__}", param=where, code="invalid_type"
            )
        role = msg.get("role")
        if role not in _ROLES:
            raise _APIError(
                400,
                f"{where}.role must be one of system, developer, user, assistant; got {role!r}"
                " (tool calls are not supported)",
                param=f"{where}.role",
                code="invalid_value",
            )
        content = msg.get("content")
        if content is None:
            raise _APIError(
                400, f"{where}.content is required", param=f"{where}.content", code="missing_required_parameter"
            )
        parsed.append({"role": "system" if role == "developer" else role, "content": _content_text(content, where)})
    last = parsed[-1]
    if last["role"] != "user":
        raise _APIError(
            400,
            f"the last message must be the user's question, got role {last['role']!r}",
            param=f"messages[{len(parsed) - 1}].role",
            code="invalid_value",
        )
    if not last["content"].strip():
        raise _APIError(
            400,
            "the last user message is empty: there is no question to answer",
            param=f"messages[{len(parsed) - 1}].content",
            code="invalid_value",
        )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _APIError(
            400, f"'stream' must be a boolean, got {type(stream).__name__}", param="stream", code="invalid_type"
        )
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _APIError(400, "'stream_options' must be an object", param="stream_options", code="invalid_type")
    n = _opt_int(body, "n")
    if n not in (None, 1):
        raise _APIError(400, f"'n' must be 1 (one answer per request), got {n}", param="n", code="invalid_value")
    if not isinstance(options.get("include_usage", False), bool):
        raise _APIError(
            400, "'stream_options.include_usage' must be a boolean", param="stream_options", code="invalid_type"
        )
    sampling = _parse_sampling(body)
    _check_unsupported_values(body)
    max_name = "max_completion_tokens"
    max_tokens = _opt_int(body, max_name)
    if max_tokens is None:
        max_name = "max_tokens"
        max_tokens = _opt_int(body, max_name)
    if max_tokens is not None and max_tokens_limit is not None and max_tokens > max_tokens_limit:
        raise _APIError(
            400,
            f"'{max_name}' is {max_tokens} but this server generates at most {max_tokens_limit} "
            "tokens per answer (ragbudget serve --max-new-tokens); "
            f"send at most {max_tokens_limit} or leave it out",
            param=max_name,
            code="invalid_value",
        )
    return _ChatRequest(
        model=model,
        question=last["content"],
        history=parsed[:-1],
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        max_tokens=max_tokens,
        context_tokens=_opt_int(body, "context_tokens"),
        sampling=sampling,
        key=_body_key(body),
    )


def _body_key(body: dict[str, Any]) -> str:
    """A digest of a request body, the same for the same JSON whatever its key order."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


# --- answers --------------------------------------------------------------------------------------


# What of an answer's report a client sees without ``expose_plan``: the budget figures of the
# request itself (tokens allowed, used, reserved), never the host's (GPU name, free/total/usable
# bytes, weights, KV capacity and bytes per token: together they describe the machine).
_PUBLIC_BUDGET = (
    "max_context_tokens",
    "max_prompt_tokens",
    "context_tokens_allowed",
    "context_tokens_used",
    "context_tokens_cap",
    "fixed_prompt_tokens",
    "prompt_tokens",
    "max_new_tokens",
    "new_tokens",
    "kv_tokens_reserved",
    "limited_by",
    "fill",
)
# An OOM step's "reason" is the allocator's message (total, free and reserved bytes of the GPU).
_PUBLIC_OOM_STEP = ("action", "prompt_tokens_before", "prompt_tokens_after", "cache", "use_cache")
_PUBLIC_REPORT = ("selection", "dropped", "timings", "memory", "history_summary")


def _public_report(report: dict[str, Any], *, expose_plan: bool, roots: Sequence[str] = ()) -> dict[str, Any]:
    """The ``ragbudget`` field of a response: the whole report with ``expose_plan``, otherwise
    only the figures describing the request (a whitelist: a field added to the report later stays
    private until it is added here). Paths are made relative either way (:func:`_public_paths`)."""
    if expose_plan:
        return _public_paths(report, roots)
    out: dict[str, Any] = {k: report[k] for k in _PUBLIC_REPORT if k in report}
    budget = report.get("budget")
    if isinstance(budget, dict):
        out["budget"] = {k: budget[k] for k in _PUBLIC_BUDGET if k in budget}
    steps = report.get("oom_steps")
    if isinstance(steps, (list, tuple)):
        out["oom_steps"] = [
            {k: v for k, v in step.items() if k in _PUBLIC_OOM_STEP} if isinstance(step, dict) else {} for step in steps
        ]
    return _public_paths(out, roots)


def _public_path(path: str, roots: Sequence[str] = ()) -> str:
    """``path`` as a client may see it: unchanged when relative; an absolute path becomes the
    part below the index's root that holds it, or its file name. The server never tells a
    client where its files live."""
    if not (os.path.isabs(path) or (len(path) > 2 and path[1] == ":" and path[2] in "/\\")):
        return path
    for root in roots:
        root = root.rstrip("/\\")
        if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("/", "\\"):
            rel = path[len(root) + 1 :]
            if rel:
                return rel
    return path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


# Keys whose string values are filesystem paths in ragbudget's records.
_PATH_KEYS = {"path", "file", "index_dir", "source_path"}


def _public_paths(obj: Any, roots: Sequence[str] = ()) -> Any:
    """A copy of a JSON-ready ``obj`` with every path-valued field made public (:func:`_public_path`)."""
    if isinstance(obj, dict):
        return {
            k: _public_path(v, roots) if k in _PATH_KEYS and isinstance(v, str) else _public_paths(v, roots)
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [_public_paths(v, roots) for v in obj]
    return obj


# An absolute POSIX path of two or more components inside a message (``/home/ann/idx/x.md``).
_ABS_PATH = re.compile(r"(?<![\w.~/-])/(?:[\w.@+-]+/)+[\w.@+-]*")


def _scrub_text(text: str) -> str:
    """A message for a client with any absolute path in it reduced to its last component."""
    return _ABS_PATH.sub(lambda m: m.group(0).rstrip("/").rsplit("/", 1)[-1] or "/", text)


def _usage(answer: "Answer") -> dict[str, int]:
    budget = answer.report["budget"]
    prompt, completion = int(budget["prompt_tokens"]), int(budget["new_tokens"])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(answer: "Answer") -> str:
    # OpenAI knows stop/length/content_filter/tool_calls; ragbudget's "cancelled" maps to stop.
    return "length" if answer.finish_reason == "length" else "stop"


def _result(fut: "asyncio.Future[Any]", to_error: Callable[[BaseException], _APIError] = _error_from_exception) -> Any:
    """``fut``'s result, with any exception turned into the HTTP error it maps to, inside the
    route (errors that escape a route reach Starlette's 500 middleware, which also re-raises)."""
    try:
        return fut.result()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise to_error(exc) from None


def _sse(data: Any) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


# --- the app --------------------------------------------------------------------------------------


def create_app(
    pipeline: "Pipeline",
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_name: str | None = None,
    max_workers: int = 64,
    history_share: float = 0.3,
    summary_max_tokens: int = 128,
    recent_turns: int = 2,
    summary_cache_size: int = 1024,
    trim_memory: bool = True,
    disconnect_poll_s: float = 0.1,
    expose_plan: bool = False,
    keepalive_s: float = 15.0,
) -> Any:
    """Build the FastAPI app serving ``pipeline`` (a :class:`ragbudget.pipeline.Pipeline`, local
    or on a served engine).

    ``api_key`` (default ``$RAGBUDGET_API_KEY``) makes every endpoint but ``/health`` require
    ``Authorization: Bearer <key>``. ``model_name`` is the id clients send as ``model`` (default:
    the generator's model id, also accepted as ``"ragbudget"``). ``max_workers`` bounds the threads
    doing model work: a request arriving when all are busy (running or queued for admission) is
    answered 429 at once instead of waiting unboundedly.

    A request's earlier messages are its history, budgeted exactly as ``ragbudget chat`` does it
    (:meth:`ragbudget.chat.Conversation.from_messages`): history may take ``history_share`` of the
    prompt room (retrieval gets the rest); when the turns do not fit, the older ones are folded
    into a summary of at most ``summary_max_tokens`` tokens written by the same generator, the
    last ``recent_turns`` stay verbatim, system messages and the question are never cut, and a
    follow-up question is expanded for retrieval. The response's ``ragbudget.memory`` gives the
    tokens of summary, recent turns, context and output and the number of turns summarized.
    Summaries are remembered across requests (:class:`ragbudget.chat.SummaryCache`, the
    ``summary_cache_size`` most recent; 0 turns that off): a client resending its conversation
    pays only for folding the turns that are new since its last request.

    A streamed answer that has to wait for its turn after its first chunk (a client back at its
    ``Retry-After`` that claimed its place) gets an SSE comment every ``keepalive_s`` seconds, so
    that neither the client's read time-out nor a proxy closes the connection meanwhile.

    ``trim_memory`` returns the heap freed by a burst of requests to the OS once the server is
    idle again (glibc ``malloc_trim``; see :func:`release_memory`), so resident memory goes back
    to its baseline between bursts instead of ratcheting up.

    Responses carry no host memory figures (GPU name, free/total/usable bytes, weights, KV
    capacity; budget errors in tokens only) unless ``expose_plan`` is set, and never an absolute
    path: a source path is shown below the index's root, or as a file name. ``/health`` answers
    503 while the index cannot be opened, and so do the requests that need it.

    >>> app = create_app(pipeline)  # doctest: +SKIP
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    class _ClosingStream(StreamingResponse):
        """A streaming response that calls ``on_close`` when it is over, even when the client
        disconnected before the body iterator ever started (its ``finally`` would not run)."""

        def __init__(self, content: Any, *, on_close: Callable[[], None], **kwargs: Any) -> None:
            super().__init__(content, **kwargs)
            self._on_close = on_close

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                self._on_close()

    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    if max_body_bytes < 1:
        raise ConfigError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if max_workers < 1:
        raise ConfigError(f"max_workers must be >= 1, got {max_workers}")
    if not 0.0 <= history_share < 1.0:
        raise ConfigError(f"history_share must be in [0, 1), got {history_share}")
    if summary_max_tokens < 1 or recent_turns < 0:
        raise ConfigError(
            f"summary_max_tokens must be >= 1 and recent_turns >= 0, got {summary_max_tokens} and {recent_turns}"
        )
    if summary_cache_size < 0:
        raise ConfigError(f"summary_cache_size must be >= 0 (0: no cache), got {summary_cache_size}")
    served = model_name or _default_model_name(pipeline)
    models = [served] if served == "ragbudget" else [served, "ragbudget"]
    metrics = Metrics()
    executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ragbudget-serve")
    slots = threading.BoundedSemaphore(max_workers)
    started = time.time()
    active: set[threading.Event] = set()  # cancel events of the requests in progress
    trimmer = _IdleTrimmer(lambda: metrics.in_flight == 0) if trim_memory and _glibc() is not None else None
    hold = {"seconds": 1.0}  # EWMA of answered chat requests' duration, for Retry-After
    # Why the index cannot serve (None: it can); "sticky" when a request met the failure rather
    # than the probe in index_problem(), which cannot clear it.
    health_state: dict[str, Any] = {"problem": None, "sticky": False, "store": None}
    engine_load = _EngineLoad(pipeline) if pipeline.served else None

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        # Shutting down: stop running generations (frees their reservations) and queued work.
        for event in list(active):
            event.set()
        executor.shutdown(wait=False, cancel_futures=True)
        if trimmer is not None:
            trimmer.stop()

    app = FastAPI(
        title="ragbudget", version=_version(), docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.pipeline = pipeline
    app.state.metrics = metrics
    app.state.executor = executor
    app.state.trimmer = trimmer

    def error_response(err: _APIError) -> Any:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(_APIError)
    async def _api_error(request: Request, exc: _APIError) -> Any:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Any:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = _APIError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Any:
        return error_response(_APIError(400, str(exc), code="invalid_request"))

    @app.exception_handler(RagBudgetError)
    async def _library_error(request: Request, exc: RagBudgetError) -> Any:
        return error_response(to_api_error(exc))

    @app.exception_handler(Exception)
    async def _any_error(request: Request, exc: Exception) -> Any:  # last resort (ServerErrorMiddleware)
        return error_response(to_api_error(exc))

    app.add_middleware(_Guard, api_key=api_key, metrics=metrics)

    def to_api_error(exc: BaseException) -> _APIError:
        err = _error_from_exception(exc, expose_plan=expose_plan)
        if isinstance(exc, SearchIndexError):  # /health says so until a request succeeds again
            health_state["problem"], health_state["sticky"] = err.message, True
        return err

    async def read_json(request: Request) -> Any:
        """The body as JSON, refusing more than ``max_body_bytes`` before reading it all."""
        length = request.headers.get("content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                raise _APIError(400, f"invalid Content-Length {length!r}", code="invalid_request") from None
            if declared > max_body_bytes:
                raise _APIError(
                    413,
                    f"request body of {declared} bytes exceeds the limit of {max_body_bytes} bytes",
                    code="request_too_large",
                )
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise _APIError(
                        413, f"request body exceeds the limit of {max_body_bytes} bytes", code="request_too_large"
                    )
                chunks.append(chunk)
        except Exception as exc:
            if not _is_client_disconnect(exc):
                raise
            # The client left before sending the body its Content-Length promised: nobody will
            # read an answer; counted as 499 (client closed request), not as a server error.
            metrics.add("cancelled", 1)
            raise _APIError(
                CLIENT_CLOSED, "the client disconnected before sending its whole body", code="client_disconnected"
            ) from None
        raw = b"".join(chunks)
        if not raw.strip():
            raise _APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
        too_deep = _APIError(
            400,
            f"the request body is nested too deep (more than {MAX_JSON_DEPTH} levels of arrays and objects)",
            code="invalid_json",
        )
        try:
            value = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
            raise _APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:  # deeper than the interpreter's recursion limit
            raise too_deep from None
        problem = _json_problem(value, MAX_JSON_DEPTH)
        if problem is not None:
            raise _APIError(400, problem, code="invalid_json")
        return value

    def acquire_slot() -> None:
        if not slots.acquire(blocking=False):
            # Every worker is busy (running or already waiting for admission): queueing here too
            # would be an unbounded queue in front of the bounded one.
            raise _APIError(
                429,
                f"server busy: {max_workers} requests already in progress",
                type="rate_limit_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        metrics.add("in_flight", 1)

    def release_slot() -> None:
        metrics.add("in_flight", -1)
        slots.release()
        if trimmer is not None:
            trimmer.poke()

    def submit(fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``fn`` on the worker pool; the slot is released when it ends, however it ends."""
        acquire_slot()

        def run() -> Any:
            try:
                return fn()
            finally:
                release_slot()

        try:
            return asyncio.get_running_loop().run_in_executor(executor, run)
        except BaseException:
            release_slot()
            raise

    async def run_blocking(fn: Callable[[], Any]) -> Any:
        fut = submit(fn)
        await asyncio.wait({fut})
        return _result(fut, to_api_error)

    async def wait_or_cancel(request: Request, fut: asyncio.Future[Any], cancel: threading.Event) -> Any:
        """Await ``fut``; if the client goes away meanwhile, set ``cancel`` (frees the KV
        reservation) and still wait for the worker to wind down."""
        while True:
            done, _ = await asyncio.wait({fut}, timeout=disconnect_poll_s)
            if done:
                return _result(fut, to_api_error)
            if not cancel.is_set() and await request.is_disconnected():
                cancel.set()
                metrics.add("cancelled", 1)

    def record_answer(answer: "Answer") -> dict[str, int]:
        report = answer.report
        hold["seconds"] = 0.8 * hold["seconds"] + 0.2 * float(report["timings"]["total_s"])
        usage = _usage(answer)
        metrics.add("tokens_prompt", usage["prompt_tokens"])
        metrics.add("tokens_completion", usage["completion_tokens"])
        metrics.add("oom_steps", len(report["oom_steps"]))
        if "queue_s" in report["timings"]:  # absent when the request never reached the queue
            metrics.observe("ragbudget_queue_wait_seconds", report["timings"]["queue_s"])
        return usage

    max_tokens_limit = pipeline.max_new_tokens
    summary_cache = None
    if summary_cache_size > 0:
        from .chat import SummaryCache

        summary_cache = SummaryCache(summary_cache_size)

    def run_ask(
        req: _ChatRequest,
        cancel: threading.Event,
        on_text: Callable[[str], Any] | None = None,
        on_claim: Callable[[], Any] | None = None,
    ) -> "Answer":
        """The model work of one chat request (in a worker thread: fitting the history renders
        chat templates and may summarize, and the first call may load the tokenizer)."""
        from .chat import Conversation

        # max_tokens can lower the reserved output, not raise it past what the server planned for
        # (each distinct value is also a memory plan the pipeline caches): _parse_chat refused more.
        conversation = Conversation.from_messages(
            pipeline,
            req.history,
            history_share=history_share,
            summary_max_tokens=summary_max_tokens,
            recent_turns=recent_turns,
            max_new_tokens=req.max_tokens,
            context_tokens=req.context_tokens,
            summary_cache=summary_cache,
        )
        # In this worker thread: the reservation made inside claims a promise under this key.
        with AdmissionController.returning(req.key or None, on_claim=on_claim):
            turn = conversation.ask(req.question, on_text=on_text, cancel=cancel, **req.sampling)
        if turn.budget.summary_cached:
            metrics.add("summary_turns_cached", turn.budget.summary_cached)
        if turn.summary:
            turn.answer.report["history_summary"] = turn.summary
        return turn.answer

    # --- routes ---

    def current_store() -> "Index":
        """The pipeline's opened index, kept once opened: later checks are a stat of its
        manifest, and never wait on the pipeline's lock (held while it plans or loads a model) on
        the event loop. Raises what opening it raises."""
        if health_state["store"] is None:
            health_state["store"] = pipeline.store
        return health_state["store"]

    def index_problem() -> str | None:
        """Why the index cannot serve right now, or None. Cheap enough for every request. A
        request that met a damaged index also makes /health unready until one succeeds again."""
        try:
            store = current_store()
            if not store.exists:
                raise IndexNotFoundError(f"the index in {store.path} is gone")
        except RagBudgetError as exc:
            if health_state["problem"] is None or health_state["sticky"]:
                log.error("the index is unavailable: %s", exc)
            health_state["problem"] = _index_unavailable(exc).message
            health_state["sticky"] = False
            return health_state["problem"]
        if health_state["problem"] is not None and not health_state["sticky"]:
            log.info("the index is available again")
            health_state["problem"] = None
        return health_state["problem"]

    # Open the index now, off any request: a later first /health then never waits on the
    # pipeline's lock (a worker may hold it for seconds while it loads the model).
    with contextlib.suppress(RagBudgetError):
        current_store()

    # The index stores display paths (below a root's label); an absolute one (an index built
    # with absolute paths) is shown by its file name.
    def public(obj: Any) -> Any:
        return _public_paths(obj)

    def report_for(answer: "Answer") -> dict[str, Any]:
        return _public_report(answer.report, expose_plan=expose_plan)

    def require_index() -> None:
        """Refuse a request up front (503) while the index cannot be opened at all."""
        if index_problem() is not None and not health_state["sticky"]:
            raise _APIError(503, str(health_state["problem"]), type="server_error", code="index_unavailable")

    def index_ok() -> None:
        health_state["problem"], health_state["sticky"] = None, False

    async def admission() -> AdmissionController | None:
        """The pipeline's admission controller, kept once built (sizing it plans from memory or
        asks the engine: done once, off the event loop); None while it cannot be built (the
        requests then get the error)."""
        if health_state.get("admission_ctl") is None:
            with contextlib.suppress(RagBudgetError):
                health_state["admission_ctl"] = await asyncio.to_thread(lambda: pipeline.admission)
        return health_state.get("admission_ctl")

    async def admission_stats() -> dict[str, float]:
        ctl = await admission()
        stats = ctl.stats().to_dict() if ctl is not None else {}
        return {k: stats[k] for k in _ADMISSION_FIGURES if k in stats}

    @app.get("/health")
    async def health() -> Any:
        stats = await admission_stats()
        problem = index_problem()
        body = {
            "status": "ok" if problem is None else "unavailable",
            "model": served,
            "uptime_s": round(time.time() - started, 3),
            "in_flight": metrics.in_flight,
            **stats,
        }
        if engine_load is not None:
            # Generation on a served engine: say what admission is sized from, and that it is
            # open when the engine reports no capacity (read once: the engine's shape is fixed).
            if "admission" not in health_state:
                health_state["admission"] = await asyncio.to_thread(pipeline.admission_note)
            body["admission"] = health_state["admission"]
            if str(health_state["admission"]).startswith("open"):
                body.pop("capacity_tokens", None)
            body["engine_load"] = engine_load.describe(await asyncio.to_thread(engine_load.read))
        if problem is not None:
            body["error"] = problem
            return JSONResponse(body, status_code=503)
        return body

    @app.get("/metrics")
    async def metrics_endpoint() -> Any:
        stats = await admission_stats()
        gauges = {}
        help_ = {
            "running": ("ragbudget_running_requests", "Requests holding a KV reservation."),
            "queued": ("ragbudget_queue_depth", "Requests waiting for KV admission."),
            "admitted_tokens": ("ragbudget_admitted_kv_tokens", "KV tokens reserved by running requests."),
            "capacity_tokens": ("ragbudget_kv_capacity_tokens", "KV tokens the budget admits at once."),
            "capacity_bytes": (
                "ragbudget_admission_capacity_bytes",
                "Bytes admission counts requests against (KV + activations).",
            ),
            "admitted_bytes": ("ragbudget_admitted_bytes", "KV + activation bytes reserved by running requests."),
            "peak_admitted_bytes": ("ragbudget_peak_admitted_bytes", "Most bytes reserved at once since start."),
            "refused_for_time_total": (
                "ragbudget_refused_for_time_total",
                "Requests refused because their first token would come past the queue time-out.",
            ),
            "work_ahead_s": (
                "ragbudget_work_ahead_seconds",
                "Estimated single-stream seconds of work admitted and queued.",
            ),
            "slowdown": (
                "ragbudget_admission_slowdown",
                "Wall seconds per measured second of model work, learnt from the requests that ran.",
            ),
        }
        for key, (name, text) in help_.items():
            if key in stats:
                gauges[name] = (text, stats[key])
        if engine_load is not None:
            gauges.update(engine_load.gauges(await asyncio.to_thread(engine_load.read)))
        return PlainTextResponse(metrics.render(gauges), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models() -> Any:
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": int(started), "owned_by": "ragbudget"} for m in models],
        }

    @app.post("/v1/retrieve")
    async def retrieve(request: Request) -> Any:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise _APIError(400, "the request body must be a JSON object", code="invalid_type")
        _check_fields(body, _RETRIEVE_FIELDS)
        query = body.get("query")
        if not isinstance(query, str) or not query.strip():
            raise _APIError(
                400,
                "'query' must be a non-empty string",
                param="query",
                code="missing_required_parameter" if query is None else "invalid_value",
            )
        k = _opt_int(body, "k")
        if k is not None and k > MAX_RETRIEVE_K:
            # The search allocates k scores up front: a huge k is a memory error, not an answer.
            raise _APIError(400, f"'k' must be <= {MAX_RETRIEVE_K}, got {k}", param="k", code="invalid_value")
        context_tokens = _opt_int(body, "context_tokens")
        require_index()
        if k is not None:
            hits = await run_blocking(lambda: pipeline.search(query, k=k))
            index_ok()
            return {"object": "list", "query": query, "data": public([h.to_dict() for h in hits])}
        selection = await run_blocking(lambda: pipeline.retrieve(query, context_tokens=context_tokens))
        index_ok()
        return {
            "object": "list",
            "query": query,
            "data": public([c.to_dict() for c in selection.chunks]),
            "tokens_used": selection.tokens_used,
            "tokens_allowed": selection.tokens_allowed,
            "dropped": public([d.to_dict() for d in selection.dropped]),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        t0 = time.perf_counter()
        req = _parse_chat(await read_json(request), models, max_tokens_limit=max_tokens_limit)
        require_index()
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        cancel = threading.Event()
        active.add(cancel)
        try:
            response = await _chat(request, req, cancel, t0, completion_id, created)
        except BaseException:
            active.discard(cancel)
            raise
        if not isinstance(response, StreamingResponse):
            active.discard(cancel)
        return response  # a stream leaves `active` when it is closed (see _closing)

    def overloaded(why: str, retry_after: float | None = None) -> _APIError:
        retry = hold["seconds"] if retry_after is None else retry_after
        return _APIError(
            429,
            f"server overloaded: {why}; retry after the Retry-After header",
            type="rate_limit_error",
            code="overloaded",
            headers={"Retry-After": _retry_after(retry)},
        )

    async def reject_if_overloaded(req: _ChatRequest) -> None:
        """Answer 429 before any retrieval work when admission's queue is already full, when the
        first token of a request of the plan's per-request size would come past the queue
        time-out (admission's time rule, :meth:`AdmissionController.would_refuse`), or when the
        served engine says it is full (its own queue, or no free KV for even the answer).

        A shortcut: building the prompt (embedding, retrieval, selection) costs seconds of CPU on
        a loaded host, and under overload every refused request would pay it first. Racy by
        nature and judged on an estimate of the prompt; the controller still decides when the
        real prompt is admitted. The engine's figures are the only word on load from others
        sharing it."""
        ctl = await admission()
        if ctl is not None:
            queued = ctl.stats().queued
            if queued >= ctl.max_queue:
                metrics.add("refused_early", 1)
                raise overloaded(f"{queued} requests already wait for KV memory")
            if ctl.throughput is not None:
                max_new = pipeline.max_new_tokens if req.max_tokens is None else req.max_tokens
                tokens, prompt = await asyncio.to_thread(pipeline.admission_estimate, max_new)
                with ctl.returning(req.key or None):
                    retry = ctl.would_refuse(tokens, prompt_tokens=prompt, refuse=True)
                if retry is not None:
                    metrics.add("refused_early", 1)
                    raise overloaded(
                        f"the first token of a {prompt}-token prompt would come past the queue "
                        f"time-out of {ctl.timeout:g} s at the measured speed",
                        retry,
                    )
        if engine_load is not None:
            max_new = pipeline.max_new_tokens if req.max_tokens is None else req.max_tokens
            why = engine_load.refusal(await asyncio.to_thread(engine_load.read), max_new)
            if why is not None:
                raise overloaded(why)

    async def _chat(
        request: Request, req: _ChatRequest, cancel: threading.Event, t0: float, completion_id: str, created: int
    ) -> Any:
        await reject_if_overloaded(req)
        if not req.stream:
            fut = submit(lambda: run_ask(req, cancel))
            answer = await wait_or_cancel(request, fut, cancel)
            if cancel.is_set():  # the client left: nobody reads the answer (counted as 499)
                return Response(status_code=CLIENT_CLOSED)
            index_ok()
            usage = record_answer(answer)
            return {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": req.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": answer.text},
                        "finish_reason": _finish_reason(answer),
                        "logprobs": None,
                    }
                ],
                "usage": usage,
                "sources": public(answer.sources),
                "ragbudget": report_for(answer),
            }

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def put(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, value))
            except RuntimeError:  # the loop is gone (server shutting down): nobody is listening
                cancel.set()

        def work() -> None:
            try:
                answer = run_ask(req, cancel, lambda piece: put("text", piece), lambda: put("queued", None))
            except BaseException as exc:  # handed to the event loop, which answers the client
                put("error", exc)
            else:
                put("done", answer)

        fut = submit(work)
        # Wait for the first event before committing to a 200 stream: admission happens inside
        # ask(), so an overloaded server must still be able to answer 429 with Retry-After. A
        # client back at its Retry-After that claimed its place ("queued") is never refused for
        # time: its 200 starts now, kept alive while it waits for its turn.
        getter = asyncio.ensure_future(events.get())
        while True:
            done, _ = await asyncio.wait({getter}, timeout=disconnect_poll_s)
            if done:
                first = getter.result()
                break
            if await request.is_disconnected():
                cancel.set()
                metrics.add("cancelled", 1)
                getter.cancel()
                await asyncio.wait({fut})
                return Response(status_code=499)
        if first[0] == "error":
            raise to_api_error(first[1])

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            return _sse(
                {
                    "id": completion_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": req.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                    **extra,
                }
            )

        state = {"finished": False}

        def closed() -> None:
            """The response is over, whichever way: if the answer did not reach its end (client
            gone, even before the body started, or server stopping), stop generating now so the
            KV reservation is freed at once."""
            active.discard(cancel)
            if not state["finished"] and not cancel.is_set():
                cancel.set()
                metrics.add("cancelled", 1)
                # The 200 is sent, but the client left before the end: /metrics counts a 499.
                request.scope[_CLIENT_LEFT] = True

        async def body_iter() -> AsyncIterator[bytes]:
            event = first
            first_token_seen = False
            try:
                yield chunk({"role": "assistant", "content": ""})
                while True:
                    kind, value = event
                    if kind == "text":
                        if value:
                            if not first_token_seen:
                                first_token_seen = True
                                metrics.observe("ragbudget_time_to_first_token_seconds", time.perf_counter() - t0)
                            yield chunk({"content": value})
                    elif kind == "queued":
                        pass  # the role chunk above started the stream; the wait is kept alive below
                    elif kind == "error":
                        err = to_api_error(value)
                        yield _sse(err.body())
                        yield _sse("[DONE]")
                        state["finished"] = True
                        return
                    else:  # done
                        index_ok()
                        usage = record_answer(value)
                        extra: dict[str, Any] = {"sources": public(value.sources), "ragbudget": report_for(value)}
                        if req.include_usage:
                            extra["usage"] = usage
                        yield chunk({}, _finish_reason(value), **extra)
                        yield _sse("[DONE]")
                        state["finished"] = True
                        return
                    while True:
                        try:
                            event = await asyncio.wait_for(events.get(), keepalive_s)
                            break
                        except asyncio.TimeoutError:
                            # An SSE comment: clients skip it, and their read time-out restarts.
                            yield b": waiting for a turn\n\n"
            finally:
                closed()

        return _ClosingStream(
            body_iter(),
            on_close=closed,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app


# Set in the ASGI scope by a streamed answer whose client left before its end (see _Guard).
_CLIENT_LEFT = "ragbudget.client_left"
_ENDPOINTS = {"/health", "/metrics", "/v1/models", "/v1/retrieve", "/v1/chat/completions"}


class _Guard:
    """Pure ASGI middleware: bearer-token check, then counting and timing of every request.

    Pure ASGI (not ``BaseHTTPMiddleware``) so that streaming responses and client-disconnect
    detection pass through untouched; the duration covers a streamed answer to its last byte.
    """

    def __init__(self, app: Any, *, api_key: str | None, metrics: Metrics) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"
        if self.api_key is not None and path != "/health":
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            # compare_digest: the comparison time does not reveal how much of the key matched.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                err = _APIError(
                    401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                body = json.dumps(err.body()).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                self.metrics.count_request(endpoint, 401)
                return
        status = 500
        started = False

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status = message["status"]
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            # Whatever escaped the routes' handlers ends here, answered once and logged once
            # (re-raising would add uvicorn's "Exception in ASGI application" traceback). A client
            # that left mid-request is no server error: 499, no traceback.
            err = _error_from_exception(exc)
            status = err.status
            if not started and status != CLIENT_CLOSED:
                body = json.dumps(err.body()).encode()
                with contextlib.suppress(Exception):  # the connection may be gone too
                    await send(
                        {
                            "type": "http.response.start",
                            "status": status,
                            "headers": [
                                (b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                            ],
                        }
                    )
                    await send({"type": "http.response.body", "body": body})
        finally:
            if scope.get(_CLIENT_LEFT):
                status = CLIENT_CLOSED
            self.metrics.count_request(endpoint, status)
            if endpoint not in ("/health", "/metrics", "other"):
                self.metrics.observe("ragbudget_request_duration_seconds", time.perf_counter() - t0, endpoint=endpoint)


def _json_problem(value: Any, limit: int) -> str | None:
    """What makes parsed JSON unfit to serve, or None: arrays/objects nested more than ``limit``
    deep, or a string holding an unpaired UTF-16 surrogate (``"\\ud800"`` is valid JSON but no
    text: echoing it, or tokenizing it, fails). Iterative: no recursion for a hostile body to
    exhaust."""
    stack = [(value, 1)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, str):
            if not obj.isascii():
                try:
                    obj.encode("utf-8")
                except UnicodeEncodeError:
                    return (
                        "the request body holds an unpaired UTF-16 surrogate escape (such as \\ud800), which is no text"
                    )
        elif isinstance(obj, (dict, list)):
            if depth > limit:
                return f"the request body is nested too deep (more than {limit} levels of arrays and objects)"
            if isinstance(obj, dict):
                stack.extend((k, depth + 1) for k in obj)
                stack.extend((v, depth + 1) for v in obj.values())
            else:
                stack.extend((v, depth + 1) for v in obj)
    return None


def _default_model_name(pipeline: "Pipeline") -> str:
    # The engine's model id, or the local model's (its ref: ``generator.model`` would load it).
    value = pipeline.backend.model_id if pipeline.served else pipeline.generator.model_ref.id
    if not value:
        return "ragbudget"
    # A local path is no name to show clients; a hub id ("org/name") is.
    return os.path.basename(value.rstrip("/\\")) if os.path.isabs(value) or value.startswith(".") else value


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("ragbudget")
    except Exception:  # not installed (a bare checkout on sys.path)
        return "0"


def serve(
    pipeline: "Pipeline",
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    warm_up: bool = True,
    malloc_arenas: int | None = 2,
    expose_plan: bool = False,
    **app_options: Any,
) -> None:
    """Run the server with uvicorn until interrupted. Loopback by default; binding another address
    without an API key logs a warning, since anyone who can reach the port can use the GPU.

    Refuses to start rather than serve errors: an index that is missing or damaged raises its
    :class:`~ragbudget.errors.SearchIndexError`, a port that cannot be bound (in use, not allowed) a
    :class:`~ragbudget.errors.ConfigError` saying which, both before any model is loaded (the
    CLI turns them into one line and exit code 1).

    ``warm_up`` loads the generator and computes the memory plan before listening, so a broken
    model fails at start and the first request is not the slow one. ``malloc_arenas`` caps glibc's
    malloc arenas before any worker thread starts (see :func:`limit_malloc_arenas`; ``None``
    leaves the allocator alone). ``expose_plan`` sends the memory plan and host memory figures
    in responses (see :func:`create_app`); off by default."""
    import uvicorn

    _check_ready(pipeline)
    sock = _bind_socket(host, port)
    try:
        if malloc_arenas is not None:
            limit_malloc_arenas(malloc_arenas)

        if api_key is None:
            api_key = os.environ.get(API_KEY_ENV) or None
        if host not in LOOPBACK_HOSTS and not api_key:
            log.warning(
                "serving on %s without an API key: anyone who can reach port %d can use the model "
                "(pass --api-key or set %s)",
                host,
                port,
                API_KEY_ENV,
            )
        if warm_up and pipeline.served:
            # Connect now, so a wrong URL, key or engine is one line before listening.
            for line in pipeline.engine_plan().lines():
                log.info("engine plan: %s", line)
            log.info("admission: %s", pipeline.admission_note())
        elif warm_up:
            pipeline.generator.warm_up()
            plan = pipeline.plan
            log.info(
                "memory plan: %s tokens per request, KV capacity %s tokens",
                plan.max_context_tokens,
                plan.kv_capacity_tokens,
            )
            # Size admission now, from the loaded model's plan and its measured prefill/decode
            # speed, so the first request does not pay for the measurement.
            log.info("admission: %s", pipeline.admission_note())
            # Open the index and load its embedder too: the first request does not pay for them,
            # and the RSS after warm-up is what requests add to.
            pipeline.search("warm-up", k=1)
            from .backend import LocalBackend

            backend = pipeline.backend
            if isinstance(backend, LocalBackend) and backend.batched:
                # Start the batching loop now: its paged cache is allocated (and resident) before
                # the first request, which admission already counts as taken (see admission).
                backend.generate("warm-up", max_new_tokens=1)
                log.info("batched generation: %s", backend.capacity().kv_total_source)
        app = create_app(pipeline, api_key=api_key, expose_plan=expose_plan, **app_options)
        # Bounded graceful shutdown: open streams are cancelled by the app's lifespan, not awaited forever.
        config = uvicorn.Config(
            app, host=host, port=sock.getsockname()[1], log_level=log_level, timeout_graceful_shutdown=10
        )
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:
            # uvicorn shut down gracefully on Ctrl-C/SIGINT, then re-raised the signal: a stop
            # asked for is a normal end (exit 0 on the CLI), not an "Aborted!".
            log.info("server stopped")
    finally:
        sock.close()


def _check_ready(pipeline: "Pipeline") -> None:
    """Raise what keeps ``pipeline`` from serving: its index missing (``IndexNotFoundError``) or
    damaged (``IndexCorruptError``: the manifest or a file it names unreadable, truncated or
    gone). Loads the index, not the models."""
    # Opening the index, then reading the generation's files: a truncated or missing one fails
    # here, not per request.
    pipeline.store.reload()


def _bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (what uvicorn would bind, handed to it), or a
    :class:`~ragbudget.errors.ConfigError` in one line when the port is taken or not allowed."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ConfigError(
            f"cannot bind to {host!r}: {exc.strerror}; pass --host 127.0.0.1 or a local address"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn: a port left in TIME_WAIT by a previous run can be reused at once, but one
        # another process listens on cannot.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            msg = f"port {port} on {host} is in use; pass --port or stop the other server"
        elif exc.errno == errno.EACCES:
            msg = f"no permission to bind port {port} on {host}; pass a --port above 1023"
        elif exc.errno == errno.EADDRNOTAVAIL:
            msg = f"{host} is not an address of this machine; pass --host 127.0.0.1 or a local address"
        else:
            msg = f"cannot bind port {port} on {host}: {exc.strerror or exc}"
        raise ConfigError(msg) from None
    sock.set_inheritable(True)
    return sock


@contextlib.contextmanager
def background_server(
    app: Any, *, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 30.0
) -> Iterator[str]:
    """Run ``app`` with uvicorn in a daemon thread (an ephemeral port by default) and yield its base
    URL, e.g. ``http://127.0.0.1:53412``; the server is stopped on exit. For tests and benchmarks.

    >>> with background_server(create_app(pipeline)) as url:  # doctest: +SKIP
    ...     httpx.get(url + "/health").json()
    """
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="ragbudget-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.01)
    sock = server.servers[0].sockets[0]
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    try:
        yield f"http://{shown}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
