"""OpenAI error objects as ``ragbudget serve`` answers them: :class:`APIError` (status, ``type``,
``param``, ``code``, headers), and the mapping of a library exception to its HTTP answer
(:func:`error_from_exception`). Only the server's own faults, and a served engine's, are 5xx; their
text stays in the server's log, and no message a client sees names an absolute path.

>>> err = overloaded("8 requests are queued", 2.5)
>>> err.status, err.headers, err.body()["error"]["code"]
(429, {'Retry-After': '3'}, 'overloaded')
"""

from __future__ import annotations

import logging
import re
from typing import Any  # Any: JSON values (what json.loads gives, json.dumps takes)

from ...errors import (
    BudgetError,
    ConfigError,
    EngineAuthError,
    EngineConnectionError,
    EngineContextError,
    EngineError,
    EngineOverloadedError,
    EngineTimeoutError,
    ModelError,
    OverloadedError,
    RagBudgetError,
    RequestCancelled,
    SearchIndexError,
    retry_after_seconds,
)

__all__ = [
    "CLIENT_CLOSED",
    "APIError",
    "engine_error",
    "engine_overloaded",
    "engine_unavailable",
    "error_from_exception",
    "index_unavailable",
    "is_client_disconnect",
    "overloaded",
]

# The server's logger: what this module logs (5xx causes) belongs with the server's lines.
log = logging.getLogger("ragbudget.server")

# The status answered (and counted in /metrics) when the client left before its answer: nginx's
# "client closed request". Nobody reads it; it keeps client disconnects apart from server errors.
CLIENT_CLOSED = 499


class APIError(Exception):
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
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        # Fields beside OpenAI's four in the error object (clients ignore what they do not
        # know): ``engine`` — which served engine failed and how, on an engine error.
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": {**error, **self.extra}}


def _retry_after(seconds: float) -> str:
    # Retry-After takes whole seconds; round up so that a client honoring it does not come back
    # before the queue had a chance to drain. The message says the same number (one function).
    return str(retry_after_seconds(seconds))


def _with_retry(message: str, seconds: float) -> str:
    """``message`` ending with "retry after N s", N the Retry-After header's number: an
    :class:`~ragbudget.errors.OverloadedError` already ends so; a served engine's own refusal
    (which said what the engine asked) gets it added."""
    said = f"; retry after {retry_after_seconds(seconds)} s"
    return message if message.endswith(said) else message + said


def error_from_exception(exc: BaseException, *, expose_plan: bool = False) -> APIError:
    """Map an exception to the HTTP answer. Only the server's own faults are 5xx: overload is 429,
    a request that can never fit the budget or a bad value is 400, a client that left is 499; an
    index or model the server cannot use is 503, a served engine's failure 502/503/504 as a
    gateway answers it (:func:`engine_error`), anything else 500. The 5xx messages name the
    error's type only: its text (paths, memory figures) goes to the server's log, not the client.
    ``expose_plan`` keeps host memory figures in a budget error's message (``--expose-plan``)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError) and not isinstance(exc, EngineContextError):
        return engine_error(exc)
    if isinstance(exc, OverloadedError):
        return APIError(
            429,
            _with_retry(str(exc), exc.retry_after),
            type="rate_limit_error",
            code="overloaded",
            headers={"Retry-After": _retry_after(exc.retry_after)},
        )
    if isinstance(exc, BudgetError):
        return APIError(
            400, str(exc) if expose_plan else _budget_message(exc), code="context_length_exceeded", param="messages"
        )
    if isinstance(exc, ConfigError):
        return APIError(400, _scrub_text(str(exc)), code="invalid_value")
    if isinstance(exc, RequestCancelled) or is_client_disconnect(exc):
        return APIError(CLIENT_CLOSED, "the client disconnected before its answer", code="client_disconnected")
    if isinstance(exc, SearchIndexError):
        log.error("the index is unavailable: %s", exc)
        return index_unavailable(exc)
    if isinstance(exc, ModelError):
        log.error("the model is unavailable: %s", exc)
        return APIError(
            503,
            f"the server's model is unavailable ({type(exc).__name__}); details in the server log",
            type="server_error",
            code="model_unavailable",
        )
    if isinstance(exc, RagBudgetError):
        log.error("error while serving a request: %s: %s", type(exc).__name__, exc)
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")
    log.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")


def engine_error(exc: EngineError, *, retry_after: float | None = None) -> APIError:
    """The gateway's answer to a served engine's failure, as a reverse proxy answers its upstream's:
    502 for an engine that refused the connection, dropped it, refused the server's credentials
    or answered with something it should not; 504 for no answer within the engine time-out; 503
    with ``Retry-After`` for an engine that is overloaded (it kept answering 429/503) — the
    client may retry, and nothing it could change in the request would help. The message names
    the engine (its kind and URL, never credentials: see :func:`ragbudget.generation.engines.root_url`) and
    the cause; the error object's ``engine`` field says the same for code (``url``, ``kind``,
    ``cause``, the engine's ``status`` when it answered one). ``retry_after`` overrides the
    engine's own hint."""
    where, info = _engine_named(exc)
    headers: dict[str, str] = {}
    if isinstance(exc, EngineTimeoutError):
        status, code, cause = 504, "engine_timeout", "timeout"
        within = f" within {exc.timeout:g} s" if exc.timeout is not None else " in time"
        text = f"{where} gave no answer{within}; retry later, or ask the server's operator to raise --engine-timeout"
    elif isinstance(exc, EngineConnectionError):
        status, code, cause = 502, "engine_unreachable", exc.cause
        text = f"{where} {EngineConnectionError.CAUSES[exc.cause]}; retry later"
    elif isinstance(exc, EngineOverloadedError):
        # The engine's own class of refusal, relayed: its 429 (load: TGI's "overloaded") stays a
        # 429 the client retries; a 503 (vLLM, or llama.cpp loading its model) stays a 503.
        status, code, cause = (429 if exc.status == 429 else 503), "engine_overloaded", "overloaded"
        wait = exc.retry_after if retry_after is None else retry_after
        headers["Retry-After"] = _retry_after(wait)
        answered = f"answered {exc.status}" if exc.status is not None else "refused the request"
        text = _with_retry(f"{where} is overloaded (it {answered} after {exc.attempts} attempt(s))", wait)
    elif isinstance(exc, EngineAuthError):
        status, code, cause = 502, "engine_auth", "auth"
        text = f"{where} refused this server's credentials ({exc.status}); the server's operator must fix its key"
    else:  # EngineResponseError, or any other engine error
        status, code, cause = 502, "engine_error", "bad_response"
        said = f"answered {exc.status}" if exc.status is not None else "answered something that is not its API"
        text = f"{where} {said}; details in the server log"
    if exc.status is not None:
        info["status"] = exc.status
    info["cause"] = cause
    log.error("engine error (%d to the client): %s", status, exc)
    return APIError(status, _scrub_text(text), type="server_error", code=code, headers=headers, extra={"engine": info})


def engine_unavailable(exc: EngineError, retry_after: float = 2.0) -> APIError:
    """The answer to a request made while the server knows its engine is unavailable (gone,
    overloaded, hung, or answering wrongly: see :class:`ragbudget.server.engine_load.EngineLoad`),
    before any work, with ``Retry-After`` (the engine's own hint when it gave one): 504 for an
    engine that gave no answer within the engine time-out (up but hung: a frozen process, a full
    accept queue), as :func:`engine_error` answers a request it timed out on — what a gateway
    answers for an upstream that did not answer in time — and 503 for one that is down,
    unreachable, loading or broken."""
    where, info = _engine_named(exc)
    status, code = 503, "engine_unavailable"
    if isinstance(exc, EngineTimeoutError):
        status, code, cause = 504, "engine_timeout", "timeout"
        why = f"gave no answer within {exc.timeout:g} s" if exc.timeout is not None else "gave no answer in time"
    elif isinstance(exc, EngineConnectionError):
        cause, why = exc.cause, EngineConnectionError.CAUSES[exc.cause]
    elif isinstance(exc, EngineOverloadedError):
        cause, why = "overloaded", f"answers {exc.status} (overloaded or still loading)"
        retry_after = max(retry_after, exc.retry_after)
    elif isinstance(exc, EngineAuthError):
        cause, why = "auth", f"refuses this server's credentials ({exc.status})"
    else:
        cause, why = "bad_response", "answers with something that is not its API"
    return APIError(
        status,
        _scrub_text(_with_retry(f"{where} is unavailable: it {why}", retry_after)),
        type="server_error",
        code=code,
        headers={"Retry-After": _retry_after(retry_after)},
        extra={"engine": {**info, "cause": cause}},
    )


def engine_overloaded(kind: str | None, url: str | None, why: str, retry_after: float) -> APIError:
    """The 429 of a request refused before any work because the engine's own figures say it is
    saturated (``why``: its queue, or no free KV for even the answer), with ``Retry-After``.

    A 429, not a 503: the engine is up and busy — often with this server's own requests or a
    sibling server's on the same engine — so the client is told to come back, as for this
    server's own full queue, and a 5xx stays for an engine that is down, loading or broken
    (:func:`engine_unavailable`). Two ``ragbudget serve`` on one ``llama-server`` answered 26 of
    a 40-request burst with this refusal (``bench/postgres.py --parts burst``); as a 503, clients
    that retry only 429s gave up on them."""
    where = f"the {kind or 'served'} engine at {url or 'its URL'}"
    return APIError(
        429,
        _scrub_text(_with_retry(f"{where} is saturated: {why}", retry_after)),
        type="server_error",
        code="engine_overloaded",
        headers={"Retry-After": _retry_after(retry_after)},
        extra={"engine": {"url": url, "kind": kind, "cause": "saturated"}},
    )


def _engine_named(exc: EngineError) -> tuple[str, dict[str, Any]]:
    """ "the llamacpp engine at http://…" and the ``engine`` field of an engine error's body."""
    where = f"the {exc.kind or 'served'} engine at {exc.url or 'its URL'}"
    return where, {"url": exc.url or None, "kind": exc.kind or None}


def index_unavailable(exc: BaseException) -> APIError:
    """The 503 of a request the index cannot serve (missing, damaged): the error's type only."""
    return APIError(
        503,
        f"the server's index is unavailable ({type(exc).__name__}); its operator must build, rebuild or restore it "
        "(details in the server log)",
        type="server_error",
        code="index_unavailable",
    )


def is_client_disconnect(exc: BaseException) -> bool:
    # starlette.requests.ClientDisconnect, matched by name so this module imports no starlette.
    return type(exc).__name__ == "ClientDisconnect" and type(exc).__module__.startswith("starlette")


def _budget_message(exc: BudgetError) -> str:
    """A budget error in tokens only: the library's message names the GPU and its free/usable
    bytes, which a client has no business knowing (``--expose-plan`` sends it as is)."""
    fix = "shorten the question or the history, or ask for fewer max_tokens"
    if exc.unit == "tokens" and exc.needed is not None and exc.available is not None:
        return f"the request needs {exc.needed} tokens but this server allows {exc.available} per request; {fix}"
    return f"the request does not fit this server's memory budget; {fix}"


def overloaded(why: str, retry_after: float) -> APIError:
    """The 429 of a request refused before any work, with a ``Retry-After`` of ``retry_after``
    seconds (rounded up)."""
    return APIError(
        429,
        _with_retry(f"server overloaded: {why}", retry_after),
        type="rate_limit_error",
        code="overloaded",
        headers={"Retry-After": _retry_after(retry_after)},
    )


# An absolute POSIX path of two or more components inside a message (``/home/ann/idx/x.md``).
_ABS_PATH = re.compile(r"(?<![\w.~/-])/(?:[\w.@+-]+/)+[\w.@+-]*")


def _scrub_text(text: str) -> str:
    """A message for a client with any absolute path in it reduced to its last component."""
    return _ABS_PATH.sub(lambda m: m.group(0).rstrip("/").rsplit("/", 1)[-1] or "/", text)
