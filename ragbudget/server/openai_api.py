"""The OpenAI chat-completions wire format as ``ragbudget serve`` speaks it: request parsing and
validation, response shaping, and the error objects. Pure: no FastAPI, Starlette or asyncio,
no I/O; :mod:`ragbudget.server.app` reads bodies off the socket and hands them here.

One job: the OpenAI chat-completions wire format, both directions.

* Requests: :func:`decode_json` (a body's bytes to JSON, refusing hostile nesting), then
  :func:`parse_chat` or :func:`parse_retrieve` to a frozen record, or an :class:`APIError`
  naming the field, as OpenAI answers it (status, ``type``, ``param``, ``code``).
* Responses: :class:`Completion` shapes an answer as a ``chat.completion`` object or as
  ``chat.completion.chunk`` server-sent events (:func:`sse`); :func:`public_report` and
  :func:`public_paths` keep host memory figures and absolute paths out of what clients see.
* Errors: :func:`error_from_exception` maps a library exception to its HTTP answer (only the
  server's own faults are 5xx, and their text stays in the server's log).

>>> req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "Hi?"}], "stop": "\\n"},
...                  ["m"], max_tokens_limit=64)
>>> req.question, req.history, req.sampling
('Hi?', [], {'stop': ['\\n']})
>>> parse_chat({"model": "m", "messages": [], "max_tokens": 9}, ["m"]).question
Traceback (most recent call last):
...
ragbudget.server.openai_api.APIError: 'messages' must not be empty: send at least one user message
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import (
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

if TYPE_CHECKING:
    from ..pipeline import Answer
    from ..prompt.select import Selection
    from ..types import Hit

__all__ = [
    "CLIENT_CLOSED",
    "MAX_JSON_DEPTH",
    "MAX_RETRIEVE_K",
    "MAX_STOP",
    "APIError",
    "ChatRequest",
    "Completion",
    "RetrieveRequest",
    "decode_json",
    "engine_error",
    "engine_overloaded",
    "engine_unavailable",
    "error_from_exception",
    "finish_reason_of",
    "hits_body",
    "index_unavailable",
    "is_client_disconnect",
    "models_body",
    "overloaded",
    "parse_chat",
    "parse_retrieve",
    "parse_sampling",
    "public_paths",
    "public_report",
    "selection_body",
    "sse",
    "usage_of",
]

# The server's logger: what this module logs (5xx causes) belongs with the server's lines.
log = logging.getLogger("ragbudget.server")


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
_CHAT_FIELDS = (
    {
        "model",
        "messages",
        "stream",
        "stream_options",
        "n",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "max_tokens",
        "max_completion_tokens",
        "context_tokens",
    }
    | set(_UNSUPPORTED)
    | _NO_EFFECT
)
_RETRIEVE_FIELDS = {"query", "k", "context_tokens"}


# --- errors ---------------------------------------------------------------------------------------


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
        status, code, cause = 503, "engine_overloaded", "overloaded"
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
    """The 503 of a request made while the server knows its engine is unavailable (gone,
    overloaded, or answering wrongly: see :class:`ragbudget.server.engine_load.EngineLoad`), answered
    before any work, with ``Retry-After`` (the engine's own hint when it gave one)."""
    where, info = _engine_named(exc)
    if isinstance(exc, EngineTimeoutError) and exc.timeout is not None:
        cause, why = "timeout", f"gave no answer within {exc.timeout:g} s"
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
        503,
        _scrub_text(_with_retry(f"{where} is unavailable: it {why}", retry_after)),
        type="server_error",
        code="engine_unavailable",
        headers={"Retry-After": _retry_after(retry_after)},
        extra={"engine": {**info, "cause": cause}},
    )


def engine_overloaded(kind: str | None, url: str | None, why: str, retry_after: float) -> APIError:
    """The 503 of a request refused before any work because the engine's own figures say it is
    saturated (``why``: its queue, or no free KV for even the answer), with ``Retry-After``."""
    where = f"the {kind or 'served'} engine at {url or 'its URL'}"
    return APIError(
        503,
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


# --- request parsing -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body: the last message is the question, the
    earlier ones its history (``developer`` read as ``system``)."""

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
                raise APIError(
                    400,
                    f"{where}.content[{i}] must be a text part {{'type': 'text', 'text': str}}; "
                    "images, audio and files are not supported",
                    param=f"{where}.content",
                    code="invalid_type",
                )
            parts.append(part["text"])
        return "\n".join(parts)
    raise APIError(
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
        raise APIError(400, f"'{name}' must be an integer, got {type(value).__name__}", param=name, code="invalid_type")
    if value < minimum:
        raise APIError(400, f"'{name}' must be >= {minimum}, got {value}", param=name, code="invalid_value")
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"'{name}' must be a number, got {type(value).__name__}", param=name, code="invalid_type")
    if not low <= value <= high:  # also refuses NaN
        raise APIError(
            400, f"'{name}' must be between {low:g} and {high:g}, got {value}", param=name, code="invalid_value"
        )
    return value


def parse_sampling(body: dict[str, Any]) -> dict[str, Any]:
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
            raise APIError(
                400, f"'seed' must be an integer, got {type(seed).__name__}", param="seed", code="invalid_type"
            )
        if not -(2**63) <= seed < 2**64:
            raise APIError(400, f"'seed' must fit in 64 bits, got {seed}", param="seed", code="invalid_value")
        out["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise APIError(400, "'stop' must be a string or a list of strings", param="stop", code="invalid_type")
        if len(items) > MAX_STOP:
            raise APIError(
                400, f"'stop' takes at most {MAX_STOP} sequences, got {len(items)}", param="stop", code="invalid_value"
            )
        if any(not s for s in items):
            raise APIError(400, "'stop' sequences must not be empty strings", param="stop", code="invalid_value")
        if items:
            out["stop"] = list(items)
    return out


def _check_fields(body: dict[str, Any], known: set[str]) -> None:
    """Refuse unknown fields, as OpenAI does, rather than answer as if they had not been sent."""
    for name in body:
        if name not in known:
            raise APIError(
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
            raise APIError(
                400,
                f"'{name}' is not supported by ragbudget (got {json.dumps(value)[:80]}); leave it out",
                param=name,
                code="unsupported_parameter",
            )


def parse_chat(body: Any, models: Sequence[str], *, max_tokens_limit: int | None = None) -> ChatRequest:
    """Validate a chat completion request. ``max_tokens_limit`` is the most output tokens the
    server reserves per answer: a larger ``max_tokens`` is a 400 naming both (as OpenAI answers
    a value past the model's limit), never silently lowered."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_type")
    _check_fields(body, _CHAT_FIELDS)
    model = body.get("model")
    if model is None:
        raise APIError(400, "missing required parameter 'model'", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise APIError(400, f"'model' must be a string, got {type(model).__name__}", param="model", code="invalid_type")
    if model not in models:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {', '.join(map(repr, models))}",
            param="model",
            code="model_not_found",
        )
    messages = body.get("messages")
    if messages is None:
        raise APIError(
            400, "missing required parameter 'messages'", param="messages", code="missing_required_parameter"
        )
    if not isinstance(messages, list):
        raise APIError(
            400, f"'messages' must be a list, got {type(messages).__name__}", param="messages", code="invalid_type"
        )
    if not messages:
        raise APIError(
            400, "'messages' must not be empty: send at least one user message", param="messages", code="empty_array"
        )
    parsed: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise APIError(
                400, f"{where} must be an object, got {type(msg).__name__}", param=where, code="invalid_type"
            )
        role = msg.get("role")
        if role not in _ROLES:
            raise APIError(
                400,
                f"{where}.role must be one of system, developer, user, assistant; got {role!r}"
                " (tool calls are not supported)",
                param=f"{where}.role",
                code="invalid_value",
            )
        content = msg.get("content")
        if content is None:
            raise APIError(
                400, f"{where}.content is required", param=f"{where}.content", code="missing_required_parameter"
            )
        parsed.append({"role": "system" if role == "developer" else role, "content": _content_text(content, where)})
    last = parsed[-1]
    if last["role"] != "user":
        raise APIError(
            400,
            f"the last message must be the user's question, got role {last['role']!r}",
            param=f"messages[{len(parsed) - 1}].role",
            code="invalid_value",
        )
    if not last["content"].strip():
        raise APIError(
            400,
            "the last user message is empty: there is no question to answer",
            param=f"messages[{len(parsed) - 1}].content",
            code="invalid_value",
        )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError(
            400, f"'stream' must be a boolean, got {type(stream).__name__}", param="stream", code="invalid_type"
        )
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options", code="invalid_type")
    n = _opt_int(body, "n")
    if n not in (None, 1):
        raise APIError(400, f"'n' must be 1 (one answer per request), got {n}", param="n", code="invalid_value")
    if not isinstance(options.get("include_usage", False), bool):
        raise APIError(
            400, "'stream_options.include_usage' must be a boolean", param="stream_options", code="invalid_type"
        )
    sampling = parse_sampling(body)
    _check_unsupported_values(body)
    max_name = "max_completion_tokens"
    max_tokens = _opt_int(body, max_name)
    if max_tokens is None:
        max_name = "max_tokens"
        max_tokens = _opt_int(body, max_name)
    if max_tokens is not None and max_tokens_limit is not None and max_tokens > max_tokens_limit:
        raise APIError(
            400,
            f"'{max_name}' is {max_tokens} but this server generates at most {max_tokens_limit} "
            "tokens per answer (ragbudget serve --max-new-tokens); "
            f"send at most {max_tokens_limit} or leave it out",
            param=max_name,
            code="invalid_value",
        )
    return ChatRequest(
        model=model,
        question=last["content"],
        history=parsed[:-1],
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        max_tokens=max_tokens,
        context_tokens=_opt_int(body, "context_tokens"),
        sampling=sampling,
        key=body_key(body),
    )


def body_key(body: dict[str, Any]) -> str:
    """A digest of a request body, the same for the same JSON whatever its key order.

    >>> body_key({"a": 1, "b": [2]}) == body_key({"b": [2], "a": 1})
    True
    """
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def caller_key(key: str, *, host: str = "", authorization: str = "") -> str:
    """``key`` (a :func:`body_key`) for one caller: the client's address and credentials.

    A refused request's promise is claimed by the same key coming back; byte-identical bodies
    from different users (a canned question) would otherwise share it, and a newcomer could take
    the place of the client that was told to return. The address and the API key are what a
    standard client sends again unchanged; clients behind one address with one key stay one
    caller unless their bodies differ (OpenAI's ``user`` field, which is in the body, tells end
    users apart).

    >>> caller_key("k", host="10.0.0.1") == caller_key("k", host="10.0.0.2")
    False
    >>> a = caller_key("k", host="10.0.0.1", authorization="Bearer a")
    >>> a == caller_key("k", host="10.0.0.1", authorization="Bearer a") != caller_key("k", host="10.0.0.1")
    True
    """
    if not key:
        return key
    return hashlib.sha256(f"{host}\n{authorization}\n{key}".encode()).hexdigest()


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


def public_report(report: dict[str, Any], *, expose_plan: bool) -> dict[str, Any]:
    """The ``ragbudget`` field of a response: the whole report with ``expose_plan``, otherwise
    only the figures describing the request (a whitelist: a field added to the report later stays
    private until it is added here). Paths are made relative either way (:func:`public_paths`)."""
    shown: dict[str, Any]  # public_paths keeps a dict a dict
    if expose_plan:
        shown = public_paths(report)
        return shown
    out: dict[str, Any] = {k: report[k] for k in _PUBLIC_REPORT if k in report}
    budget = report.get("budget")
    if isinstance(budget, dict):
        out["budget"] = {k: budget[k] for k in _PUBLIC_BUDGET if k in budget}
    steps = report.get("oom_steps")
    if isinstance(steps, (list, tuple)):
        out["oom_steps"] = [
            {k: v for k, v in step.items() if k in _PUBLIC_OOM_STEP} if isinstance(step, dict) else {} for step in steps
        ]
    shown = public_paths(out)
    return shown


def _public_path(path: str) -> str:
    """``path`` as a client may see it: unchanged when relative (the index stores display paths,
    below a root's label); an absolute one (an index built with absolute paths) becomes its file
    name. The server never tells a client where its files live."""
    if not (os.path.isabs(path) or (len(path) > 2 and path[1] == ":" and path[2] in "/\\")):
        return path
    return path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


# Keys whose string values are filesystem paths in ragbudget's records.
_PATH_KEYS = {"path", "file", "index_dir", "source_path"}


def public_paths(obj: Any) -> Any:
    """A copy of a JSON-ready ``obj`` with every path-valued field made public (:func:`_public_path`)."""
    if isinstance(obj, dict):
        return {
            k: _public_path(v) if k in _PATH_KEYS and isinstance(v, str) else public_paths(v) for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [public_paths(v) for v in obj]
    return obj


# An absolute POSIX path of two or more components inside a message (``/home/ann/idx/x.md``).
_ABS_PATH = re.compile(r"(?<![\w.~/-])/(?:[\w.@+-]+/)+[\w.@+-]*")


def _scrub_text(text: str) -> str:
    """A message for a client with any absolute path in it reduced to its last component."""
    return _ABS_PATH.sub(lambda m: m.group(0).rstrip("/").rsplit("/", 1)[-1] or "/", text)


def usage_of(answer: Answer) -> dict[str, int]:
    budget = answer.report["budget"]
    prompt, completion = int(budget["prompt_tokens"]), int(budget["new_tokens"])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish_reason_of(answer: Answer) -> str:
    # OpenAI knows stop/length/content_filter/tool_calls; ragbudget's "cancelled" maps to stop.
    return "length" if answer.finish_reason == "length" else "stop"


def sse(data: Any) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


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


def decode_json(raw: bytes) -> Any:
    """A request body's bytes as JSON, or a 400: empty, not JSON, nested more than
    :data:`MAX_JSON_DEPTH` deep, or holding a string that is no text."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        value = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # deeper than the interpreter's recursion limit
        raise APIError(
            400,
            f"the request body is nested too deep (more than {MAX_JSON_DEPTH} levels of arrays and objects)",
            code="invalid_json",
        ) from None
    problem = _json_problem(value, MAX_JSON_DEPTH)
    if problem is not None:
        raise APIError(400, problem, code="invalid_json")
    return value


@dataclass(frozen=True, kw_only=True)
class RetrieveRequest:
    """A validated ``POST /v1/retrieve`` body."""

    query: str
    k: int | None  # the k best hits; None: the chunks that fit the budget
    context_tokens: int | None


def parse_retrieve(body: Any) -> RetrieveRequest:
    """Validate a retrieve request: a non-empty ``query``, and optionally ``k`` (at most
    :data:`MAX_RETRIEVE_K`) or ``context_tokens``."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_type")
    _check_fields(body, _RETRIEVE_FIELDS)
    query = body.get("query")
    if not isinstance(query, str) or not query.strip():
        raise APIError(
            400,
            "'query' must be a non-empty string",
            param="query",
            code="missing_required_parameter" if query is None else "invalid_value",
        )
    k = _opt_int(body, "k")
    if k is not None and k > MAX_RETRIEVE_K:
        # The search allocates k scores up front: a huge k is a memory error, not an answer.
        raise APIError(400, f"'k' must be <= {MAX_RETRIEVE_K}, got {k}", param="k", code="invalid_value")
    return RetrieveRequest(query=query, k=k, context_tokens=_opt_int(body, "context_tokens"))


def hits_body(query: str, hits: Sequence[Hit]) -> dict[str, Any]:
    """The ``/v1/retrieve`` answer for ``k``: the hits, best first."""
    return {"object": "list", "query": query, "data": public_paths([h.to_dict() for h in hits])}


def selection_body(query: str, selection: Selection) -> dict[str, Any]:
    """The ``/v1/retrieve`` answer without ``k``: the chunks that fit, and those dropped."""
    return {
        "object": "list",
        "query": query,
        "data": public_paths([c.to_dict() for c in selection.chunks]),
        "tokens_used": selection.tokens_used,
        "tokens_allowed": selection.tokens_allowed,
        "dropped": public_paths([d.to_dict() for d in selection.dropped]),
    }


def models_body(models: Sequence[str], created: int) -> dict[str, Any]:
    """The ``/v1/models`` answer: every name the server accepts as ``model``."""
    return {
        "object": "list",
        "data": [{"id": m, "object": "model", "created": created, "owned_by": "ragbudget"} for m in models],
    }


@dataclass(frozen=True, kw_only=True)
class Completion:
    """One chat completion's identity, shared by all its frames: ``id``, ``created`` (Unix
    seconds) and the ``model`` name the client sent. ``expose_plan`` keeps the whole budget report
    (host memory figures) in the ``ragbudget`` field (see :func:`public_report`).

    >>> frame = Completion(id="chatcmpl-1", created=0, model="m").chunk({"content": "Hi"})
    >>> frame[:6], frame[-2:]
    (b'data: ', b'\\n\\n')
    >>> json.loads(frame[6:])["choices"]
    [{'index': 0, 'delta': {'content': 'Hi'}, 'finish_reason': None, 'logprobs': None}]
    """

    id: str
    created: int
    model: str
    expose_plan: bool = False

    @classmethod
    def new(cls, model: str, *, expose_plan: bool = False) -> Completion:
        """A fresh id, created now."""
        return cls(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model, expose_plan=expose_plan)

    def body(self, answer: Answer) -> dict[str, Any]:
        """The ``chat.completion`` object of a whole answer, with its ``sources`` and the
        ``ragbudget`` report as extra top-level fields."""
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer.text},
                    "finish_reason": finish_reason_of(answer),
                    "logprobs": None,
                }
            ],
            "usage": usage_of(answer),
            "sources": public_paths(answer.sources),
            "ragbudget": public_report(answer.report, expose_plan=self.expose_plan),
        }

    def chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        """One ``chat.completion.chunk`` event carrying ``delta``; ``extra`` adds top-level fields."""
        return sse(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                **extra,
            }
        )

    def last_chunk(self, answer: Answer, *, include_usage: bool) -> bytes:
        """The chunk that ends a streamed answer: its finish reason, ``sources`` and ``ragbudget``
        report, and ``usage`` when the client asked (``stream_options.include_usage``)."""
        extra: dict[str, Any] = {
            "sources": public_paths(answer.sources),
            "ragbudget": public_report(answer.report, expose_plan=self.expose_plan),
        }
        if include_usage:
            extra["usage"] = usage_of(answer)
        return self.chunk({}, finish_reason_of(answer), **extra)
