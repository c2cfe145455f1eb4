"""What the server's endpoints do, below FastAPI's routing (:func:`ragbudget.server.app.create_app`
wires them): the state the routes share, as small classes instead of closures over dict cells,
and the chat endpoint.

* :class:`Workers` — the bounded thread pool doing model work off the event loop (a full pool is
  429 at once), with the idle allocator trim.
* :class:`IndexHealth` — whether the index can serve; what ``/health`` and the 503s say.
* :class:`AdmissionView` — the pipeline's admission controller and its figures, built once.
* :class:`~ragbudget.server.engine_load.EngineLoad` (re-exported here) — a served engine's health and
  live load, read at most once a second (``create_app(engine_recheck_s=...)``).
* :class:`ChatEndpoint` — ``POST /v1/chat/completions``: early 429s, the conversation on the
  pool, the whole or streamed answer, cancellation when the client leaves or the request
  time-out passes (:class:`RequestCancel`).

Starlette is imported where a response is built, not when this module is imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any  # Any: Starlette requests and responses (imported lazily), JSON

from ..errors import ConfigError, EngineError, IndexNotFoundError, RagBudgetError
from ..memory.admission import AdmissionController
from ..relay import Relay
from .engine_load import EngineLoad, quick_look
from .malloc import IdleTrimmer, trimming_supported
from .metrics import Metrics
from .openai_api import (
    CLIENT_CLOSED,
    APIError,
    ChatRequest,
    Completion,
    caller_key,
    decode_json,
    engine_overloaded,
    engine_unavailable,
    error_from_exception,
    index_unavailable,
    is_client_disconnect,
    overloaded,
    parse_chat,
    sse,
    usage_of,
)

if TYPE_CHECKING:
    from ..chat import SummaryCache
    from ..memory.admission import AdmissionController
    from ..pipeline import Answer, Pipeline
    from ..retrieval.index import Index
    from ..settings import HistorySettings

__all__ = [
    "CLIENT_LEFT",
    "AdmissionView",
    "ChatEndpoint",
    "EngineLoad",
    "IndexHealth",
    "RequestCancel",
    "Workers",
    "read_json",
]

# The server's logger: the index coming and going belongs with the server's lines.
log = logging.getLogger("ragbudget.server")

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
    "answer_share",
)
# Of those, the host memory figures (the memory left beside the weights, and how much of it
# requests hold): shown only with ``expose_plan``, like the plan itself.
_HOST_MEMORY_FIGURES = frozenset({"capacity_bytes", "admitted_bytes", "peak_admitted_bytes"})


# --- what the routes share ------------------------------------------------------------------------


def _result(fut: asyncio.Future[Any], to_error: Callable[[BaseException], APIError] = error_from_exception) -> Any:
    """``fut``'s result, with any exception turned into the HTTP error it maps to, inside the
    route (errors that escape a route reach Starlette's 500 middleware, which also re-raises)."""
    try:
        return fut.result()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise to_error(exc) from None


async def read_json(request: Any, *, limit: int, metrics: Metrics) -> Any:
    """``request``'s body as JSON (:func:`~ragbudget.server.openai_api.decode_json`), refusing more
    than ``limit`` bytes before reading it all."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise APIError(400, f"invalid Content-Length {length!r}", code="invalid_request") from None
        if declared > limit:
            raise APIError(
                413, f"request body of {declared} bytes exceeds the limit of {limit} bytes", code="request_too_large"
            )
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
    except Exception as exc:
        if not is_client_disconnect(exc):
            raise
        # The client left before sending the body its Content-Length promised: nobody will
        # read an answer; counted as 499 (client closed request), not as a server error.
        metrics.add("cancelled", 1)
        raise APIError(
            CLIENT_CLOSED, "the client disconnected before sending its whole body", code="client_disconnected"
        ) from None
    return decode_json(b"".join(chunks))


class WorkersBusy(APIError):
    """Every worker thread is taken: a 429. Its ``Retry-After`` of 1 s is a fallback; the chat
    endpoint asks admission instead (:meth:`AdmissionController.refuse_busy`), which says when by
    its time model and keeps the client's place for its return."""

    def __init__(self, max_workers: int) -> None:
        super().__init__(
            429,
            f"server busy: {max_workers} requests already in progress; retry after 1 s",
            type="rate_limit_error",
            code="overloaded",
            headers={"Retry-After": "1"},
        )


class Workers:
    """The bounded thread pool doing model work off the event loop, so ``/health`` answers
    throughout. A request arriving when all ``max_workers`` are busy (running, or queued for
    admission) is answered 429 at once (:class:`WorkersBusy`): queueing here too would be an
    unbounded queue in front of admission's bounded one. A *returning* request — a client back
    at the ``Retry-After`` a refusal promised it — may run past that bound, on up to
    ``max_workers`` more threads: it was promised a place, and refusing it again for threads
    would break the promise (the promises are bounded by the refusals that made them).
    ``trimmer`` (None when off or off glibc) returns the heap freed by a burst to the OS once no
    request is in flight."""

    def __init__(self, max_workers: int, metrics: Metrics, *, trim_memory: bool) -> None:
        self.max_workers = max_workers
        self.metrics = metrics
        # Threads start on demand: the returning requests' extra ones cost nothing until used.
        self.executor = ThreadPoolExecutor(max_workers=2 * max_workers, thread_name_prefix="ragbudget-serve")
        self._lock = threading.Lock()
        self._busy = 0
        self.trimmer = IdleTrimmer(lambda: metrics.in_flight == 0) if trim_memory and trimming_supported() else None

    def _acquire(self, returning: bool) -> None:
        with self._lock:
            if self._busy >= (2 if returning else 1) * self.max_workers:
                raise WorkersBusy(self.max_workers)
            self._busy += 1
        self.metrics.add("in_flight", 1)

    def _release(self) -> None:
        self.metrics.add("in_flight", -1)
        with self._lock:
            self._busy -= 1
        if self.trimmer is not None:
            self.trimmer.poke()

    def submit(self, fn: Callable[[], Any], *, returning: bool = False) -> asyncio.Future[Any]:
        """Run ``fn`` on the pool; its slot is released when it ends, however it ends.
        ``returning``: a client back for its promise (see the class docstring)."""
        self._acquire(returning)

        def run() -> Any:
            try:
                return fn()
            finally:
                self._release()

        try:
            return asyncio.get_running_loop().run_in_executor(self.executor, run)
        except BaseException:
            self._release()
            raise

    async def run(self, fn: Callable[[], Any], to_error: Callable[[BaseException], APIError]) -> Any:
        """``fn()`` on the pool, awaited; what it raises becomes its HTTP error."""
        fut = self.submit(fn)
        await asyncio.wait({fut})
        return _result(fut, to_error)

    def shutdown(self) -> None:
        """Server stopping: drop the queued work, stop the trimmer (running work is cancelled by
        its cancel event, see :meth:`ChatEndpoint.cancel_all`)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.trimmer is not None:
            self.trimmer.stop()


class IndexHealth:
    """Whether the pipeline's index can serve: ``problem`` says why not (None: it can).
    ``sticky`` when a request met the failure rather than the probe in :meth:`check`, which
    cannot clear it: /health then stays unready until a request succeeds again (:meth:`ok`)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.problem: str | None = None
        self.sticky = False
        self._store: Index | None = None

    def store(self) -> Index:
        """The pipeline's opened index, kept once opened: later checks are a stat of its
        manifest, and never wait on the pipeline's lock (held while it plans or loads a model) on
        the event loop. Raises what opening it raises."""
        if self._store is None:
            self._store = self.pipeline.store
        return self._store

    def check(self) -> str | None:
        """Why the index cannot serve right now, or None. Cheap enough for every request."""
        try:
            store = self.store()
            if not store.exists:
                raise IndexNotFoundError(f"the index in {store.where} is gone")
        except RagBudgetError as exc:
            if self.problem is None or self.sticky:
                log.error("the index is unavailable: %s", exc)
            self.problem, self.sticky = index_unavailable(exc).message, False
            return self.problem
        if self.problem is not None and not self.sticky:
            log.info("the index is available again")
            self.problem = None
        return self.problem

    def require(self) -> None:
        """Refuse a request up front (503) while the index cannot be opened at all."""
        if self.check() is not None and not self.sticky:
            raise APIError(503, str(self.problem), type="server_error", code="index_unavailable")

    def failed(self, err: APIError) -> None:
        """A request met an index error (``err`` is its answer): unready until one succeeds."""
        self.problem, self.sticky = err.message, True

    def ok(self) -> None:
        """A request was served from the index."""
        self.problem, self.sticky = None, False


class AdmissionView:
    """The pipeline's admission controller and its one-line description, each built once, off
    the event loop (sizing the controller plans from memory or asks the engine)."""

    def __init__(self, pipeline: Pipeline, *, expose_plan: bool = False) -> None:
        self.pipeline = pipeline
        self.expose_plan = expose_plan
        self._controller: AdmissionController | None = None
        self._note: str | None = None

    async def controller(self) -> AdmissionController | None:
        """The controller, or None while it cannot be built (the requests then get the error)."""
        if self._controller is None:
            with contextlib.suppress(RagBudgetError):  # sized from an engine that is not there yet
                self._controller = await asyncio.to_thread(quick_look, self.pipeline, lambda: self.pipeline.admission)
        return self._controller

    async def figures(self) -> dict[str, float]:
        """What /health and /metrics show of its stats (host memory figures only with
        ``expose_plan``)."""
        ctl = await self.controller()
        stats = ctl.stats().to_dict() if ctl is not None else {}
        shown = [k for k in _ADMISSION_FIGURES if self.expose_plan or k not in _HOST_MEMORY_FIGURES]
        return {k: stats[k] for k in shown if k in stats}

    async def note(self) -> str:
        """What admission is sized from (read once: an engine's shape is fixed; an engine that
        cannot say now is asked again next time)."""
        if self._note is None:
            try:
                note: str = await asyncio.to_thread(quick_look, self.pipeline, self.pipeline.admission_note)
            except EngineError as exc:
                return f"unknown until the engine answers ({type(exc).__name__})"
            self._note = note
            return note
        return self._note


@functools.lru_cache(maxsize=1)
def _closing_stream() -> Any:
    """The StreamingResponse subclass of a streamed answer (a class made on first use, since
    starlette is imported lazily)."""
    from starlette.responses import StreamingResponse

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

    return _ClosingStream


# Set in the ASGI scope by a streamed answer whose client left before its end: the server's
# middleware then counts a 499, not the 200 it had sent.
CLIENT_LEFT = "ragbudget.client_left"


# --- the chat endpoint ----------------------------------------------------------------------------


def _moving(previous: float | None, value: float) -> float:
    """An average of answered requests weighted to the recent ones (a fifth to the newest), as
    the early checks and Retry-After read a request's duration and prompt."""
    return value if previous is None else 0.8 * previous + 0.2 * value


class RequestCancel(threading.Event):
    """A chat request's cancel event (what ``pipeline.ask`` and admission look at), set when its
    client leaves or when its request time-out passes: ``timed_out`` says which, and ``clock``
    is the event loop's timer that sets it at the time-out (stopped when the request ends)."""

    def __init__(self) -> None:
        super().__init__()
        self.timed_out = False
        self.clock: asyncio.TimerHandle | None = None

    def time_out(self, metrics: Metrics) -> None:
        """The request time-out passed: stop the request (every loop it runs looks at this
        event: history counting, the summary, the admission queue, each generated token)."""
        if not self.is_set():
            self.timed_out = True
            metrics.add("timed_out", 1)
            self.set()

    def stop_clock(self) -> None:
        if self.clock is not None:
            self.clock.cancel()
            self.clock = None


class ChatEndpoint:
    """``POST /v1/chat/completions``: parse, refuse early when overloaded, run the conversation
    on the worker pool (admission happens inside ``pipeline.ask``), answer whole or streamed.
    Keeps the cancel events of the requests in progress (``active``), the moving average of
    answered requests' duration (``hold_s``) that an early 429's Retry-After suggests, and that of
    their prompts (``prompt_mean``) that the early checks price a request at."""

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        models: list[str],
        workers: Workers,
        health: IndexHealth,
        admission: AdmissionView,
        engine_load: EngineLoad | None,
        to_error: Callable[[BaseException], APIError],
        max_body_bytes: int,
        history: HistorySettings,
        summary_cache: SummaryCache | None,
        disconnect_poll_s: float,
        expose_plan: bool,
        keepalive_s: float,
        request_timeout: float | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.models = models
        self.workers = workers
        self.metrics = workers.metrics
        self.health = health
        self.admission = admission
        self.engine_load = engine_load
        self.to_error = to_error
        self.max_body_bytes = max_body_bytes
        self.history = history
        self.summary_cache = summary_cache
        self.disconnect_poll_s = disconnect_poll_s
        self.keepalive_s = keepalive_s
        self.request_timeout = request_timeout or None  # 0: none
        self.expose_plan = expose_plan
        self.max_tokens_limit = pipeline.memory.max_new_tokens
        self.hold_s = 1.0  # EWMA of answered chat requests' duration, for Retry-After
        # EWMA of answered requests' prompt tokens (a declined one's 0: it reached no engine);
        # None until one is answered. The early checks judge a request before its prompt exists.
        self.prompt_mean: float | None = None
        self.active: set[RequestCancel] = set()  # cancel events of the requests in progress

    async def __call__(self, request: Any) -> Any:
        """Answer one request (a Starlette ``Request``): a JSON body, a stream, or an APIError."""
        from starlette.responses import StreamingResponse

        t0 = time.perf_counter()
        body = await read_json(request, limit=self.max_body_bytes, metrics=self.metrics)
        req = parse_chat(body, self.models, max_tokens_limit=self.max_tokens_limit)
        client = request.client  # None when the transport gives no address
        req = replace(
            req,
            key=caller_key(
                req.key, host=client.host if client else "", authorization=request.headers.get("authorization", "")
            ),
        )
        self.check_history(req)
        self.health.require()
        completion = Completion.new(req.model, expose_plan=self.expose_plan)
        cancel = RequestCancel()
        self.active.add(cancel)
        if self.request_timeout is not None:
            cancel.clock = asyncio.get_running_loop().call_later(self.request_timeout, cancel.time_out, self.metrics)
        try:
            response = await self._chat(request, req, cancel, t0, completion)
        except BaseException:
            self.active.discard(cancel)
            cancel.stop_clock()
            raise
        if not isinstance(response, StreamingResponse):
            self.active.discard(cancel)
            cancel.stop_clock()
        return response  # a stream leaves `active` when it is closed (see _stream)

    def check_history(self, req: ChatRequest) -> None:
        """A 400 naming the limit for a history over ``max_messages`` or ``max_history_chars``,
        before any worker is taken (every message would be counted through the chat template)."""
        try:
            self.history.check_size(messages=len(req.history) + 1, chars=sum(len(m["content"]) for m in req.history))
        except ConfigError as exc:
            raise APIError(400, str(exc), param="messages", code="history_too_long") from None

    def timed_out(self) -> APIError:
        """The answer of a request stopped at the request time-out before its answer was whole."""
        return APIError(
            503,
            f"the request ran past the request time-out of {self.request_timeout:g} s and was stopped "
            "(its memory is free again); send a shorter history or a lower max_tokens, or raise "
            "serve --request-timeout",
            type="server_error",
            code="request_timeout",
        )

    def cancel_all(self) -> None:
        """Server stopping: stop running generations (frees their reservations)."""
        for event in list(self.active):
            event.set()

    def overloaded(self, why: str, retry_after: float | None = None) -> APIError:
        return overloaded(why, self.hold_s if retry_after is None else retry_after)

    async def reject_if_overloaded(self, req: ChatRequest) -> bool:
        """Answer 429 before any retrieval work when admission's queue is already full, or when the
        first token of a request of the plan's per-request size would come past the queue
        time-out (admission's time rule, :meth:`AdmissionController.would_refuse`); 429 too when
        the served engine says it is full (its own queue, or no free KV for even the answer:
        load, often a sibling server's on the same engine); 503 when it is unavailable
        (:class:`EngineLoad`: down, loading or broken).
        Returns whether the request is a client back for a refusal's promise
        (:meth:`AdmissionController.hold_return`): it skips admission's early checks, and may
        take a worker past the pool's bound (:meth:`submit`).

        A shortcut: building the prompt (embedding, retrieval, selection) costs seconds of CPU on
        a loaded host, and under overload every refused request would pay it first. Racy by
        nature and judged on an estimate of the prompt; the controller still decides when the
        real prompt is admitted. The engine's figures are the only word on load from others
        sharing it."""
        returning = False
        ctl = await self.admission.controller()
        if ctl is not None:
            with ctl.returning(req.key or None):
                returning = ctl.hold_return()
                if not returning:
                    await self._refuse_early(ctl, req)
        if self.engine_load is not None:
            load = self.engine_load
            figures = await asyncio.to_thread(load.read)
            if load.error is not None:  # gone, loading or broken: nothing to send it yet
                raise engine_unavailable(load.error, retry_after=max(1.0, 2 * load.ttl))
            why = load.refusal(figures, self._max_new(req))
            if why is not None:
                raise engine_overloaded(load.kind, load.url, why, self.hold_s)
        return returning

    async def _refuse_early(self, ctl: AdmissionController, req: ChatRequest) -> None:
        """Admission's early checks for a newcomer (under its key): a full queue, then time."""
        queued = ctl.stats().queued
        if queued >= ctl.max_queue:
            self.metrics.add("refused_early", 1)
            retry = self._refuse_busy(ctl, await self._estimate(ctl, req))
            raise self.overloaded(f"{queued} requests already wait for KV memory", retry)
        estimate = await self._estimate(ctl, req)
        if estimate is None:
            return
        tokens, prompt = estimate
        late = ctl.would_refuse(tokens, prompt_tokens=prompt, refuse=True)
        if late is not None:
            self.metrics.add("refused_early", 1)
            basis = "the most one request may hold" if self.prompt_mean is None else "the mean answered here"
            raise self.overloaded(
                f"the first token of a {prompt}-token prompt ({basis}) would come past the queue "
                f"time-out of {ctl.timeout:g} s at the measured speed",
                late,
            )

    def _max_new(self, req: ChatRequest) -> int:
        """The answer tokens ``req`` reserves: its ``max_tokens``, else the server's planned one."""
        return self.pipeline.memory.max_new_tokens if req.max_tokens is None else req.max_tokens

    async def _estimate(self, ctl: AdmissionController, req: ChatRequest) -> tuple[int, int] | None:
        """``(tokens, prompt_tokens)`` admission expects of ``req`` before its prompt is built:
        its answer, and the mean prompt of the requests answered so far (:meth:`expected`); or
        ``None`` without a measured speed, where no time model would use it (planning a new
        ``max_tokens`` is work an overloaded server should not do)."""
        if ctl.throughput is None:
            return None
        tokens, prompt = await asyncio.to_thread(self.pipeline.admission_estimate, self._max_new(req))
        return self.expected(tokens, prompt)

    def expected(self, tokens: int, prompt: int) -> tuple[int, int]:
        """``(tokens, prompt_tokens)`` of a request whose prompt may hold at most ``prompt`` of
        its ``tokens``, priced at the mean prompt answered here (``prompt_mean``), never more
        than that most; the most until a request is answered.

        Why not the most: the span packer and the evidence floor fill a prompt only with what is
        relevant, so real prompts are a fraction of the window (2026-12-07: two servers on one
        CPU engine with a 2,048-token window, real prompts a median of 114 tokens); each early
        refusal's promise priced a whole-window prefill. (The long Retry-Afters of that burst
        came mostly from admission pricing a whole engine slot as the answer: see
        ``AdmissionController.acquire``'s ``new_tokens``.) Only these early looks (and their
        Retry-After and promises) use the mean: memory and time are decided on the real prompt
        when it is admitted."""
        if self.prompt_mean is None:
            return tokens, prompt
        typical = min(prompt, math.ceil(self.prompt_mean))
        return tokens - prompt + typical, typical

    @staticmethod
    def _refuse_busy(ctl: AdmissionController, estimate: tuple[int, int] | None) -> float:
        if estimate is None:
            return ctl.refuse_busy()
        return ctl.refuse_busy(estimate[0], prompt_tokens=estimate[1])

    async def busy(self, req: ChatRequest, busy: WorkersBusy) -> APIError:
        """The 429 for a full worker pool, decided by admission: its ``Retry-After`` from the
        time model and a promise under the caller's key, so the client that honours it gets in
        (a returning client may run past the pool's bound, see :class:`Workers`)."""
        ctl = await self.admission.controller()
        if ctl is None:
            return busy
        estimate = await self._estimate(ctl, req)
        with ctl.returning(req.key or None):
            retry = self._refuse_busy(ctl, estimate)
        return self.overloaded(f"{self.workers.max_workers} requests already in progress", retry)

    def run_ask(
        self,
        req: ChatRequest,
        cancel: threading.Event,
        on_text: Callable[[str], Any] | None = None,
        on_claim: Callable[[], Any] | None = None,
    ) -> Answer:
        """The model work of one chat request (in a worker thread: fitting the history renders
        chat templates and may summarize, and the first call may load the tokenizer)."""
        from ..chat import Conversation

        # max_tokens can lower the reserved output, not raise it past what the server planned for
        # (each distinct value is also a memory plan the pipeline caches): parse_chat refused more.
        conversation = Conversation.from_messages(
            self.pipeline,
            req.history,
            history=self.history,
            max_new_tokens=req.max_tokens,
            context_tokens=req.context_tokens,
            summary_cache=self.summary_cache,
            sources=req.sources,
        )
        # In this worker thread: the reservation made inside claims a promise under this key.
        with AdmissionController.returning(req.key or None, on_claim=on_claim):
            turn = conversation.ask(req.question, on_text=on_text, cancel=cancel, **req.sampling)
        if turn.budget.summary_cached:
            self.metrics.add("summary_turns_cached", turn.budget.summary_cached)
        if turn.summary:
            turn.answer.report["history_summary"] = turn.summary
        return turn.answer

    def record_answer(self, answer: Answer) -> None:
        report = answer.report
        self.hold_s = _moving(self.hold_s, float(report["timings"]["total_s"]))
        usage = usage_of(answer)
        self.prompt_mean = _moving(self.prompt_mean, float(usage["prompt_tokens"]))
        self.metrics.add("tokens_prompt", usage["prompt_tokens"])
        self.metrics.add("tokens_completion", usage["completion_tokens"])
        self.metrics.add("oom_steps", len(report["oom_steps"]))
        self.metrics.add("declined", int(answer.declined))
        if "queue_s" in report["timings"]:  # absent when the request never reached the queue
            self.metrics.observe("ragbudget_queue_wait_seconds", report["timings"]["queue_s"])

    async def wait_or_cancel(self, request: Any, fut: asyncio.Future[Any], cancel: RequestCancel) -> Any:
        """Await ``fut``; if the client goes away meanwhile, set ``cancel`` (frees the KV
        reservation) and still wait for the worker to wind down. A request stopped by its
        time-out is a 503 (:meth:`timed_out`), whatever the worker raised on its way out."""
        while True:
            done, _ = await asyncio.wait({fut}, timeout=self.disconnect_poll_s)
            if done:
                try:
                    return _result(fut, self.to_error)
                except APIError:
                    if cancel.timed_out:
                        raise self.timed_out() from None
                    raise
            if not cancel.is_set() and await request.is_disconnected():
                cancel.set()
                self.metrics.add("cancelled", 1)

    async def _chat(
        self, request: Any, req: ChatRequest, cancel: RequestCancel, t0: float, completion: Completion
    ) -> Any:
        from starlette.responses import Response

        returning = await self.reject_if_overloaded(req)
        if not req.stream:
            try:
                fut = self.workers.submit(lambda: self.run_ask(req, cancel), returning=returning)
            except WorkersBusy as full:
                raise await self.busy(req, full) from full
            answer = await self.wait_or_cancel(request, fut, cancel)
            if cancel.timed_out and answer.finish_reason == "cancelled":
                raise self.timed_out()  # (an answer whole just before the time-out is sent)
            if cancel.is_set() and not cancel.timed_out:
                return Response(status_code=CLIENT_CLOSED)  # the client left: nobody reads it (499)
            self.health.ok()
            self.record_answer(answer)
            return completion.body(answer)
        return await self._stream(request, req, cancel, t0, completion, returning)

    async def _stream(
        self,
        request: Any,
        req: ChatRequest,
        cancel: RequestCancel,
        t0: float,
        completion: Completion,
        returning: bool,
    ) -> Any:
        from starlette.responses import Response

        # The answer runs on the worker pool (a full pool is a 429 from here); its text, its
        # "queued" (a returning client claimed its place), then its end reach this loop in order.
        try:
            relay: Relay[Answer] = Relay(
                lambda emit, stop: self.run_ask(req, stop, emit, emit.queued),
                loop=asyncio.get_running_loop(),
                cancel=cancel,
                start=functools.partial(self.workers.submit, returning=returning),
            )
        except WorkersBusy as full:
            raise await self.busy(req, full) from full
        # Wait for the first event before committing to a 200 stream: admission happens inside
        # ask(), so an overloaded server must still be able to answer 429 with Retry-After. A
        # client back at its Retry-After that claimed its place ("queued") is never refused for
        # time: its 200 starts now, kept alive while it waits for its turn.
        first = await self._first_event(request, relay, cancel)
        if first is None:  # the client left before anything was sent
            return Response(status_code=CLIENT_CLOSED)
        if cancel.timed_out and (
            first.kind == "error" or (first.kind == "done" and first.value.finish_reason == "cancelled")
        ):
            raise self.timed_out()  # nothing sent yet: a plain 503
        if first.kind == "error":
            raise self.to_error(first.value)
        return self._sse_response(request, req, cancel, t0, completion, relay, first)

    async def _first_event(self, request: Any, relay: Relay[Answer], cancel: RequestCancel) -> Any:
        """The answer's first event, polling for the client's leaving meanwhile (``None``: it
        left; the answer is cancelled and its worker has started, so it frees what it holds)."""
        getter = asyncio.ensure_future(relay.anext_event())
        while True:
            done, _ = await asyncio.wait({getter}, timeout=self.disconnect_poll_s)
            if done:
                return getter.result()
            if await request.is_disconnected():
                cancel.set()
                self.metrics.add("cancelled", 1)
                getter.cancel()
                await asyncio.wait({relay.started})
                return None

    def _sse_response(
        self,
        request: Any,
        req: ChatRequest,
        cancel: RequestCancel,
        t0: float,
        completion: Completion,
        relay: Relay[Answer],
        first: Any,
    ) -> Any:
        """The 200 event stream of an answer whose ``first`` event came: its text as chunks,
        keep-alive comments while it waits for its turn, then its end or its error."""
        metrics = self.metrics
        finished = False

        def closed() -> None:
            """The response is over, whichever way: if the answer did not reach its end (client
            gone, even before the body started, or server stopping), stop generating now so the
            KV reservation is freed at once."""
            self.active.discard(cancel)
            cancel.stop_clock()
            if not finished and not cancel.is_set():
                cancel.set()
                metrics.add("cancelled", 1)
                # The 200 is sent, but the client left before the end: /metrics counts a 499.
                request.scope[CLIENT_LEFT] = True

        async def body_iter() -> AsyncIterator[bytes]:
            nonlocal finished
            event = first
            first_token_seen = False
            try:
                yield completion.chunk({"role": "assistant", "content": ""})
                while True:
                    kind, value = event
                    if kind == "text":
                        if value:
                            if not first_token_seen:
                                first_token_seen = True
                                metrics.observe("ragbudget_time_to_first_token_seconds", time.perf_counter() - t0)
                            yield completion.chunk({"content": value})
                    elif kind == "queued":
                        pass  # the role chunk above started the stream; "tick"s keep the wait alive
                    elif kind == "tick":
                        # An SSE comment: clients skip it, and their read time-out restarts.
                        yield b": waiting for a turn\n\n"
                    elif kind == "error" or (cancel.timed_out and value.finish_reason == "cancelled"):
                        # An error, or the request time-out cut the answer: the stream says so.
                        err = self.timed_out() if cancel.timed_out else self.to_error(value)
                        yield sse(err.body())
                        yield sse("[DONE]")
                        finished = True
                        return
                    else:  # done
                        self.health.ok()
                        self.record_answer(value)
                        yield completion.last_chunk(value, include_usage=req.include_usage)
                        yield sse("[DONE]")
                        finished = True
                        return
                    event = await relay.anext_event(tick_s=self.keepalive_s)
            finally:
                closed()

        return _closing_stream()(
            body_iter(),
            on_close=closed,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
