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
  (at most :data:`~ragbudget.server.openai_api.MAX_RETRIEVE_K`), the ``k`` best hits instead.
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).

Admission: every chat request goes through ``pipeline.ask``, which reserves its KV tokens with the
pipeline's :class:`~ragbudget.memory.admission.AdmissionController`. A request runs only while the summed
reservations fit the KV capacity; others wait in a bounded queue for a bounded time; beyond that
the controller raises :class:`~ragbudget.errors.OverloadedError` and the client gets ``429`` with
``Retry-After`` — never a 5xx, never an OOM. Model work runs in a bounded thread pool, off the event
loop, so ``/health`` answers throughout. A client that disconnects sets the request's cancel event,
which stops generation and frees the reservation at once.

Only the server's own faults, and a served engine's, are 5xx. An engine's are answered as a gateway
answers its upstream's (:func:`~ragbudget.server.openai_api.engine_error`): 502 for an engine that refused
or dropped the connection or answered what is not its API, 504 for no answer within the engine
time-out (a hung engine, whether the request or the server's look at the engine met it), 503 with
``Retry-After`` while it is down, loading or overloaded — then ``/health`` is 503
as well (what a load balancer reads as "out of rotation"), with an ``engine`` section naming it and
the cause (:class:`~ragbudget.server.engine_load.EngineLoad`). A malformed body, or one nested deeper than
:data:`~ragbudget.server.openai_api.MAX_JSON_DEPTH`, is a 400; a client that leaves before its answer
(even in the middle of its body) is counted as 499, without a traceback; an index that is missing
or damaged is a 503, and ``/health`` then answers 503 too. :func:`serve` refuses to start on such
an index or a port it cannot bind. A client slow to send its request is cut off with a 408
(:mod:`~ragbudget.server.deadlines`: ``--header-timeout``, ``--body-idle-timeout``,
``--body-timeout``). Responses never carry an absolute path, nor host memory
figures unless ``expose_plan``.

>>> from ragbudget.pipeline import Pipeline                  # doctest: +SKIP
>>> app = create_app(Pipeline(".ragbudget"), api_key="s3cret")  # doctest: +SKIP
>>> import uvicorn; uvicorn.run(app, host="127.0.0.1", port=8000, http=http_protocol(app))  # doctest: +SKIP

The parts: the wire format is :mod:`ragbudget.server.openai_api` (pure parsing and shaping), the work
behind the routes :mod:`ragbudget.server.endpoints` (worker pool, index health, admission figures, the
served engine's load, the chat endpoint), the counters :mod:`ragbudget.server.metrics`, the allocator
care :mod:`ragbudget.server.malloc`, the slow clients' deadlines :mod:`ragbudget.server.deadlines`.
Here: :func:`create_app` wiring them into FastAPI, the ASGI guard (API key, counting), and
:func:`serve` / :func:`background_server`.

``fastapi`` and ``uvicorn`` are the ``serve`` extra; they are imported when :func:`create_app` or
:func:`serve` is called, not when this module is imported.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route functions' annotations
# (``request: Request``) at runtime, and Request is imported lazily inside the functions that add them.
import asyncio
import contextlib
import errno
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any  # Any: FastAPI/Starlette objects (the serve extra, imported lazily)

from ..errors import ConfigError, EngineError, RagBudgetError, SearchIndexError
from ..settings import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_REQUEST_TIMEOUT,
    ClientTimeoutSettings,
    HistorySettings,
    from_keywords,
)
from .deadlines import BodyDeadline, header_deadline_protocol
from .endpoints import CLIENT_LEFT, AdmissionView, ChatEndpoint, EngineLoad, IndexHealth, Workers, read_json
from .malloc import DEFAULT_ARENAS, limit_malloc_arenas
from .metrics import Metrics, admission_gauges, metric_help
from .openai_api import (
    CLIENT_CLOSED,
    APIError,
    error_from_exception,
    hits_body,
    models_body,
    parse_retrieve,
    selection_body,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ..pipeline import Pipeline

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "LOOPBACK_HOSTS",
    "background_server",
    "create_app",
    "http_protocol",
    "serve",
]

log = logging.getLogger(__name__)

#: 1 MiB is far above any question plus a long chat history, and small enough that a hostile body
#: cannot cost memory.
DEFAULT_MAX_BODY_BYTES = 1 << 20
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
API_KEY_ENV = "RAGBUDGET_API_KEY"


# --- the app --------------------------------------------------------------------------------------


def create_app(
    pipeline: "Pipeline",
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_name: str | None = None,
    max_workers: int = 64,
    history: HistorySettings | None = None,
    history_share: float | None = None,
    summary_max_tokens: int | None = None,
    recent_turns: int | None = None,
    summary_cache_size: int = 1024,
    trim_memory: bool = True,
    disconnect_poll_s: float = 0.1,
    expose_plan: bool = False,
    keepalive_s: float = 15.0,
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
    engine_recheck_s: float = 1.0,
    client_timeouts: ClientTimeoutSettings | None = None,
    header_timeout: float | None = None,
    body_idle_timeout: float | None = None,
    body_timeout: float | None = None,
) -> Any:
    """Build the FastAPI app serving ``pipeline`` (a :class:`ragbudget.pipeline.Pipeline`, local or on a served engine).

    ``api_key`` (default ``$RAGBUDGET_API_KEY``) makes every endpoint but ``/health`` require
    ``Authorization: Bearer <key>``. ``model_name`` is the id clients send as ``model`` (default: the generator's model
    id, also accepted as ``"ragbudget"``). ``max_workers`` bounds the threads doing model work: a request arriving when
    all are busy (running or queued for admission) is answered 429 at once instead of waiting unboundedly, with
    admission's ``Retry-After`` and a kept place for the client that honours it (which may then run on up to
    ``max_workers`` more threads).

    A request's earlier messages are its history, budgeted exactly as ``ragbudget chat`` does it
    (:meth:`ragbudget.chat.Conversation.from_messages`), by ``history`` (a :class:`~ragbudget.settings.HistorySettings`,
    or its flat keywords): history may take ``history_share`` of the prompt room (retrieval gets the rest); when the
    turns do not fit, the older ones are folded into a summary of at most ``summary_max_tokens`` tokens written by the
    same generator, the last ``recent_turns`` stay verbatim, system messages and the question are never cut, and a
    follow-up question is expanded for retrieval. The response's ``ragbudget.memory`` gives the tokens of summary,
    recent turns, context and output and the number of turns summarized. Summaries are remembered across requests
    (:class:`ragbudget.chat.SummaryCache`, the ``summary_cache_size`` most recent; 0 turns that off): a client resending
    its conversation pays only for folding the turns that are new since its last request.

    ``request_timeout`` (seconds; ``None`` or 0: none) bounds one chat request from its arrival to its last token,
    whatever it does: counting and summarizing its history, retrieval, waiting for admission, generating. Past it the
    request is stopped as a client that left would be (its worker and memory free within one count or one token) and
    answered 503 ``request_timeout``, or its stream ends with that error; a history over ``max_messages`` or
    ``max_history_chars`` (``history``) is a 400 before any work. A streamed answer that has to wait for its turn after
    its first chunk (a client back at its ``Retry-After`` that claimed its place) gets an SSE comment every
    ``keepalive_s`` seconds, so that neither the client's read time-out nor a proxy closes the connection meanwhile.

    On a served engine (``Pipeline(engine=...)``) the server re-reads the engine's health and load
    (:class:`~ragbudget.server.engine_load.EngineLoad`) at most every ``engine_recheck_s`` seconds, and an engine found
    gone is refused until that long after; 0 re-reads for every request and every ``/health``, at the cost of one quick
    look at the engine each.

    A client gets a bounded time to send its request (``client_timeouts``, a
    :class:`~ragbudget.settings.ClientTimeoutSettings`, or its flat keywords): its body may pause at most
    ``body_idle_timeout`` seconds (10) and take ``body_timeout`` seconds (30) in all, then it is answered 408 and its
    connection closed (:class:`~ragbudget.server.deadlines.BodyDeadline`); ``header_timeout`` (10) bounds its headers
    when :func:`serve` or :func:`background_server` runs the app. Each cut is counted in ``/metrics``; 0 turns a limit
    off.

    ``trim_memory`` returns the heap freed by a burst of requests to the OS once the server is idle again (glibc
    ``malloc_trim``; see :func:`~ragbudget.server.malloc.release_memory`), so resident memory goes back to its baseline
    between bursts instead of ratcheting up.

    Responses carry no host memory figures (GPU name, free/total/usable bytes, weights, KV capacity; budget errors in
    tokens only) unless ``expose_plan`` is set, and never an absolute path: a source path is shown below the index's
    root, or as a file name. ``/health`` answers 503 while the index cannot be opened, as do the requests that need it.
    """
    import fastapi  # noqa: F401  (first: without the serve extra, nothing is built or checked)

    _check_limits(max_body_bytes=max_body_bytes, max_workers=max_workers, request_timeout=request_timeout)
    policy = _history_settings(history, history_share, summary_max_tokens, recent_turns)
    _check_limits(engine_recheck_s=engine_recheck_s)
    timeouts = _client_timeouts(client_timeouts, header_timeout, body_idle_timeout, body_timeout)
    _check_limits(summary_cache_size=summary_cache_size)
    server = _Server(pipeline, engine_recheck_s, model_name, max_workers, max_body_bytes, trim_memory, expose_plan)
    chat = server.chat_endpoint(policy, summary_cache_size, disconnect_poll_s, keepalive_s, request_timeout)
    return _new_app(server, chat, api_key, timeouts)


#: What :func:`create_app` accepts of its numeric options: ``{name: (out of range?, the range)}``.
_LIMITS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_body_bytes": (lambda v: v < 1, ">= 1"),
    "max_workers": (lambda v: v < 1, ">= 1"),
    "request_timeout": (lambda v: v is not None and not v >= 0, ">= 0 seconds (0: none)"),
    "engine_recheck_s": (lambda v: not v >= 0, ">= 0 seconds (0: every request)"),  # NaN included
    "summary_cache_size": (lambda v: v < 0, ">= 0 (0: no cache)"),
}


def _check_limits(**values: Any) -> None:
    """Raise a :class:`~ragbudget.errors.ConfigError` for the first of ``values`` outside its :data:`_LIMITS`."""
    for name, value in values.items():
        out_of_range, bound = _LIMITS[name]
        if out_of_range(value):
            raise ConfigError(f"{name} must be {bound}, got {value}")


def _history_settings(
    history: HistorySettings | None,
    history_share: float | None,
    summary_max_tokens: int | None,
    recent_turns: int | None,
) -> HistorySettings:
    """The history policy: ``history``, or one built from its flat keywords."""
    return from_keywords(
        HistorySettings,
        history,
        "history",
        {"history_share": history_share, "summary_max_tokens": summary_max_tokens, "recent_turns": recent_turns},
    )


def _client_timeouts(
    client_timeouts: ClientTimeoutSettings | None,
    header_timeout: float | None,
    body_idle_timeout: float | None,
    body_timeout: float | None,
) -> ClientTimeoutSettings:
    """The slow clients' deadlines: ``client_timeouts``, or one built from its flat keywords."""
    return from_keywords(
        ClientTimeoutSettings,
        client_timeouts,
        "client_timeouts",
        {"header_timeout": header_timeout, "body_idle_timeout": body_idle_timeout, "body_timeout": body_timeout},
    )


class _Server:
    """The state the routes share: the pipeline, its workers, index health, admission, the engine's load, counters."""

    def __init__(
        self,
        pipeline: "Pipeline",
        engine_recheck_s: float,
        model_name: str | None,
        max_workers: int,
        max_body_bytes: int,
        trim_memory: bool,
        expose_plan: bool,
    ) -> None:
        # Asked before anything connects: an engine not connected yet is one without a reading of its
        # figures (which the first request would then reuse for up to engine_recheck_s).
        self.engine_load = EngineLoad.watching(pipeline, ttl=engine_recheck_s)
        self.pipeline = pipeline
        self.model_id = model_name or _default_model_name(pipeline)
        self.models = [self.model_id] if self.model_id == "ragbudget" else [self.model_id, "ragbudget"]
        self.metrics = Metrics()
        self.workers = Workers(max_workers, self.metrics, trim_memory=trim_memory)
        self.started = time.time()
        self.health = IndexHealth(pipeline)
        self.admission = AdmissionView(pipeline, expose_plan=expose_plan)
        self.max_body_bytes = max_body_bytes
        self.expose_plan = expose_plan

    def to_api_error(self, exc: BaseException) -> APIError:
        """The API error answering ``exc``, noting a broken index or a gone engine for ``/health``."""
        err = error_from_exception(exc, expose_plan=self.expose_plan)
        if isinstance(exc, SearchIndexError):  # /health says so until a request succeeds again
            self.health.failed(err)
        if self.engine_load is not None and isinstance(exc, EngineError):  # gone: 503 until it is back
            self.engine_load.failed(exc)
        return err

    def chat_endpoint(
        self,
        history: HistorySettings,
        summary_cache_size: int,
        disconnect_poll_s: float,
        keepalive_s: float,
        request_timeout: float | None,
    ) -> ChatEndpoint:
        """The ``/v1/chat/completions`` endpoint on this server's workers, with its summary cache."""
        summary_cache = None
        if summary_cache_size > 0:
            from ..chat import SummaryCache

            summary_cache = SummaryCache(summary_cache_size)
        return ChatEndpoint(
            self.pipeline,
            models=self.models,
            workers=self.workers,
            health=self.health,
            admission=self.admission,
            engine_load=self.engine_load,
            to_error=self.to_api_error,
            max_body_bytes=self.max_body_bytes,
            history=history,
            summary_cache=summary_cache,
            disconnect_poll_s=disconnect_poll_s,
            expose_plan=self.expose_plan,
            keepalive_s=keepalive_s,
            request_timeout=request_timeout,
        )

    async def health_response(self) -> Any:
        """The ``/health`` answer: status, model, uptime, admission figures, and a served engine's state."""
        from fastapi.responses import JSONResponse

        figures = await self.admission.figures()
        problem = self.health.check()
        body: dict[str, Any] = {
            "status": "ok" if problem is None else "unavailable",
            "model": self.model_id,
            "uptime_s": round(time.time() - self.started, 3),
            "in_flight": self.metrics.in_flight,
            **figures,
        }
        engine_load = self.engine_load
        if engine_load is not None:
            # Generation on a served engine: say what admission is sized from, and that it is
            # open when the engine reports no capacity. The engine is looked at first (a quick
            # look, at most every engine_recheck_s): while it is unavailable nothing else asks it.
            load = await asyncio.to_thread(engine_load.read)
            if engine_load.error is None:
                note = await self.admission.note()
                body["admission"] = note
                if note.startswith("open"):
                    body.pop("capacity_tokens", None)
            body["engine_load"] = engine_load.describe(load)
            # The engine's own health: a gateway whose engine is gone cannot answer a question,
            # so /health is 503 then, as for a missing index (a load balancer takes it out).
            body["engine"] = engine_load.state()
            if problem is None and engine_load.error is not None:
                problem = body["engine"]["error"]
                body["status"] = "unavailable"
        if problem is not None:
            body["error"] = problem
            return JSONResponse(body, status_code=503)
        return body

    async def metrics_response(self) -> Any:
        """The ``/metrics`` answer: the counters, with admission's and a served engine's gauges."""
        from fastapi.responses import PlainTextResponse

        gauges = admission_gauges(await self.admission.figures())
        engine_load = self.engine_load
        if engine_load is not None:
            gauges.update(engine_load.gauges(await asyncio.to_thread(engine_load.read)))
            gauges["ragbudget_engine_up"] = (
                metric_help("ragbudget_engine_up"),
                0 if engine_load.error is not None else 1,
            )
            sent = engine_load.sent()
            if sent is not None:
                gauges["ragbudget_engine_tokenizer_requests"] = (
                    metric_help("ragbudget_engine_tokenizer_requests"),
                    sum(n for route, n in sent.items() if "tokenize" in route or "template" in route),
                )
        return PlainTextResponse(self.metrics.render(gauges), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def retrieve(self, request: Any) -> Any:
        """The ``/v1/retrieve`` answer: the ``k`` best hits when asked for, else the chunks that fit the budget."""
        pipeline = self.pipeline
        req = parse_retrieve(await read_json(request, limit=self.max_body_bytes, metrics=self.metrics))
        self.health.require()
        if req.k is not None:
            k, scope = req.k, req.sources
            hits = await self.workers.run(lambda: pipeline.search(req.query, k=k, sources=scope), self.to_api_error)
            self.health.ok()
            return hits_body(req.query, hits)
        selection = await self.workers.run(
            lambda: pipeline.retrieve(req.query, context_tokens=req.context_tokens, sources=req.sources),
            self.to_api_error,
        )
        self.health.ok()
        return selection_body(req.query, selection)


def _new_app(server: _Server, chat: ChatEndpoint, api_key: str | None, timeouts: ClientTimeoutSettings) -> "FastAPI":
    """The FastAPI app around ``server`` and ``chat``: lifespan, state, error handlers, middleware, routes."""
    from fastapi import FastAPI

    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        # Shutting down: stop running generations (frees their reservations) and queued work.
        chat.cancel_all()
        server.workers.shutdown()

    app = FastAPI(
        title="ragbudget", version=_version(), docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.pipeline = server.pipeline
    app.state.metrics = server.metrics
    app.state.executor = server.workers.executor
    app.state.trimmer = server.workers.trimmer
    app.state.client_timeouts = timeouts  # the header deadline is the server's (serve, background_server)
    _add_error_handlers(app, server.to_api_error)
    app.add_middleware(_Guard, api_key=api_key, metrics=server.metrics)
    # Added last, so outermost: the 401 the guard answers before reading a body closes too.
    app.add_middleware(
        BodyDeadline,
        body_idle_timeout=timeouts.body_idle_timeout,
        body_timeout=timeouts.body_timeout,
        metrics=server.metrics,
    )

    # Open the index now, off any request: a later first /health then never waits on the
    # pipeline's lock (a worker may hold it for seconds while it loads the model).
    with contextlib.suppress(RagBudgetError):
        server.health.store()
    _add_routes(app, server, chat)
    return app


def _add_error_handlers(app: "FastAPI", to_api_error: Callable[[BaseException], APIError]) -> None:
    """Answer every error on ``app`` as an OpenAI-style JSON error."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    def error_response(err: APIError) -> Any:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Any:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Any:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = APIError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Any:
        return error_response(APIError(400, str(exc), code="invalid_request"))

    @app.exception_handler(RagBudgetError)
    async def _library_error(request: Request, exc: RagBudgetError) -> Any:
        return error_response(to_api_error(exc))

    @app.exception_handler(Exception)
    async def _any_error(request: Request, exc: Exception) -> Any:  # last resort (ServerErrorMiddleware)
        return error_response(to_api_error(exc))


def _add_routes(app: "FastAPI", server: _Server, chat: ChatEndpoint) -> None:
    """Route the five endpoints of ``app`` to ``server`` and ``chat``."""
    from fastapi import Request

    @app.get("/health")
    async def health_endpoint() -> Any:
        return await server.health_response()

    @app.get("/metrics")
    async def metrics_endpoint() -> Any:
        return await server.metrics_response()

    @app.get("/v1/models")
    async def list_models() -> Any:
        return models_body(server.models, int(server.started))

    @app.post("/v1/retrieve")
    async def retrieve(request: Request) -> Any:
        return await server.retrieve(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await chat(request)


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
                err = APIError(
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
            err = error_from_exception(exc)
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
            if scope.get(CLIENT_LEFT):
                status = CLIENT_CLOSED
            self.metrics.count_request(endpoint, status)
            if endpoint not in ("/health", "/metrics", "other"):
                self.metrics.observe("ragbudget_request_duration_seconds", time.perf_counter() - t0, endpoint=endpoint)


def _default_model_name(pipeline: "Pipeline") -> str:
    # The backend's model id: the engine's, or the local model's ref (no model is loaded).
    from ..generation.allowance import model_name

    value = pipeline.backend.model_id
    # A local path is no name to show clients; a hub id ("org/name") is.
    return model_name(value) if value else "ragbudget"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("ragbudget")
    except Exception:  # not installed (a bare checkout on sys.path)
        return "0"


def serve(
    pipeline: "Pipeline",
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    log_level: str = "info",
    warm_up: bool = True,
    malloc_arenas: int | None = DEFAULT_ARENAS,
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
    # Both halves of the ``serve`` extra now, before the model loads: a missing one is one line
    # at once, not after minutes of warm-up (create_app imports fastapi again when it builds).
    import fastapi  # noqa: F401
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
        if warm_up:
            # Load the model (and start its batching loop) or connect to the engine, size
            # admission from the loaded model's plan and measured speed or from the engine's
            # figures, and open the index with its embedder: a wrong URL, key or model is one
            # line before listening, the first request pays for none of it, and the RSS after
            # warm-up is what requests add to.
            pipeline.warm_up()
            from ..generation.allowance import plan_lines

            for line in plan_lines(pipeline.request_plan()):
                log.info("plan: %s", line)
            log.info("admission: %s", pipeline.admission_note())
            _calibrate(pipeline)
        app = create_app(pipeline, api_key=api_key, expose_plan=expose_plan, **app_options)
        # Bounded graceful shutdown: open streams are cancelled by the app's lifespan, not awaited forever.
        config = uvicorn.Config(
            app,
            host=host,
            port=sock.getsockname()[1],
            log_level=log_level,
            timeout_graceful_shutdown=10,
            http=http_protocol(app),
        )
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:
            # uvicorn shut down gracefully on Ctrl-C/SIGINT, then re-raised the signal: a stop
            # asked for is a normal end (exit 0 on the CLI), not an "Aborted!".
            log.info("server stopped")
    finally:
        sock.close()


def _calibrate(pipeline: "Pipeline") -> None:
    """One real request before listening (:meth:`~ragbudget.pipeline.Pipeline.calibrate`), so the
    first clients are not admitted on the speed probe's bare forward passes; in a thread of its
    own, whose OpenMP pool ends with it (:func:`~ragbudget.generation.batching.in_own_thread`). A failure
    is logged: the server still starts, the probe's speed provisional until requests correct it."""
    from ..generation.batching import in_own_thread

    t0 = time.perf_counter()
    try:
        answer = in_own_thread(pipeline.calibrate)
    except RagBudgetError as exc:
        log.warning("calibration request failed (%s): the first requests are admitted at the probe's speed", exc)
        return
    if answer is not None:
        stats = pipeline.admission.stats()
        log.info(
            "calibration request: %d prompt tokens in %.1f s; admission's slowdown (wall s per probe s) is now %.2f",
            answer.report["budget"].get("prompt_tokens", 0),
            time.perf_counter() - t0,
            stats.slowdown or 1.0,
        )


def http_protocol(app: Any) -> Any:
    """uvicorn's ``http`` option for ``app``: for an app of :func:`create_app`, h11 with the
    deadline on a request's headers (:func:`~ragbudget.server.deadlines.header_deadline_protocol`),
    even where httptools is installed; uvicorn's own choice for any other app, or with
    ``header_timeout=0``."""
    timeouts = getattr(getattr(app, "state", None), "client_timeouts", None)
    if not isinstance(timeouts, ClientTimeoutSettings) or not timeouts.header_timeout:
        return "auto"
    metrics: Metrics = app.state.metrics
    return header_deadline_protocol(timeouts.header_timeout, lambda: metrics.add("header_timeouts"))


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
    app: Any, *, host: str = DEFAULT_HOST, port: int = 0, startup_timeout: float = 30.0
) -> Iterator[str]:
    """Run ``app`` with uvicorn in a daemon thread (an ephemeral port by default) and yield its base
    URL, e.g. ``http://127.0.0.1:53412``; the server is stopped on exit. For tests and benchmarks.

    >>> with background_server(create_app(pipeline)) as url:  # doctest: +SKIP
    ...     httpx.get(url + "/health").json()
    """
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=5,
        http=http_protocol(app),
    )
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
