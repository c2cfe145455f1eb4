"""OpenAI chat-completions requests as ``ragbudget serve`` reads them: a body's bytes to JSON
(:func:`decode_json`, refusing hostile nesting and text that is none), then :func:`parse_chat` or
:func:`parse_retrieve` to a frozen record, or an :class:`~.errors.APIError` naming the field, as
OpenAI answers it. Fields ragbudget would otherwise ignore are refused, not dropped.

>>> req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "Hi?"}], "stop": "\\n"},
...                  ["m"], max_tokens_limit=64)
>>> req.question, req.history, req.sampling
('Hi?', [], {'stop': ['\\n']})
>>> parse_chat({"model": "m", "messages": [], "max_tokens": 9}, ["m"]).question
Traceback (most recent call last):
...
ragbudget.server.openai_api.errors.APIError: 'messages' must not be empty: send at least one user message
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any  # Any: JSON values (what json.loads gives, json.dumps takes)

from .errors import APIError

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_RETRIEVE_K",
    "MAX_STOP",
    "ChatRequest",
    "RetrieveRequest",
    "body_key",
    "caller_key",
    "decode_json",
    "parse_chat",
    "parse_retrieve",
    "parse_sampling",
]

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
# Everything /v1/chat/completions reads; ``context_tokens`` and ``sources`` are ragbudget's own extras.
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
        "sources",
    }
    | set(_UNSUPPORTED)
    | _NO_EFFECT
)
_RETRIEVE_FIELDS = {"query", "k", "context_tokens", "sources"}
#: The most source patterns one request may scope its search to, and the longest one: each is
#: matched against every indexed file's path once per generation.
MAX_SOURCES, MAX_SOURCE_CHARS = 16, 1024


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
    #: The files the question is scoped to (``Pipeline.ask``'s ``sources``), if the body names any.
    sources: tuple[str, ...] | None = None


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


def _sources(body: dict[str, Any]) -> tuple[str, ...] | None:
    """The body's ``sources``: a path pattern or a list of them (:mod:`ragbudget.retrieval.scope`)."""
    from ...errors import ConfigError
    from ...retrieval.scope import is_absolute, source_patterns

    value = body.get("sources")
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise APIError(
            400, "'sources' must be a path pattern or a list of them (strings)", param="sources", code="invalid_type"
        )
    if len(items) > MAX_SOURCES or any(len(v) > MAX_SOURCE_CHARS for v in items):
        raise APIError(
            400,
            f"'sources' takes at most {MAX_SOURCES} patterns of at most {MAX_SOURCE_CHARS} characters",
            param="sources",
            code="invalid_value",
        )
    try:
        patterns = source_patterns(items)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="sources", code="invalid_value") from None
    if any(is_absolute(p) for p in patterns):
        # Matched against the server's own paths, an absolute pattern would tell a client which
        # folders exist there (a 200 or a 400): a client names files as the answers show them.
        raise APIError(
            400,
            "'sources' takes display paths as the answers' sources show them (reviews/B00X.txt), "
            "folders or globs over them, never an absolute path",
            param="sources",
            code="invalid_value",
        )
    return patterns


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
    model = _chat_model(body, models)
    parsed = _chat_messages(body)
    stream, include_usage = _stream_options(body)
    sampling = parse_sampling(body)
    _check_unsupported_values(body)
    return ChatRequest(
        model=model,
        question=parsed[-1]["content"],
        history=parsed[:-1],
        stream=stream,
        include_usage=include_usage,
        max_tokens=_max_tokens(body, max_tokens_limit),
        context_tokens=_opt_int(body, "context_tokens"),
        sampling=sampling,
        key=body_key(body),
        sources=_sources(body),
    )


def _chat_model(body: dict[str, Any], models: Sequence[str]) -> str:
    """The request's ``model``: one this server serves (a 404 names them), else a 400."""
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
    return model


def _chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """The request's ``messages`` as role/content pairs (``developer`` read as ``system``),
    the last one the user's question."""
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
    return parsed


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage`` (and ``n``, which must be 1)."""
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
    return stream, bool(options.get("include_usage", False))


def _max_tokens(body: dict[str, Any], limit: int | None) -> int | None:
    """``max_completion_tokens`` (or the older ``max_tokens``), never past ``limit``."""
    max_name = "max_completion_tokens"
    max_tokens = _opt_int(body, max_name)
    if max_tokens is None:
        max_name = "max_tokens"
        max_tokens = _opt_int(body, max_name)
    if max_tokens is not None and limit is not None and max_tokens > limit:
        raise APIError(
            400,
            f"'{max_name}' is {max_tokens} but this server generates at most {limit} "
            "tokens per answer (ragbudget serve --max-new-tokens); "
            f"send at most {limit} or leave it out",
            param=max_name,
            code="invalid_value",
        )
    return max_tokens


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
    sources: tuple[str, ...] | None = None  # the files searched (every one: None)


def parse_retrieve(body: Any) -> RetrieveRequest:
    """Validate a retrieve request: a non-empty ``query``, and optionally ``k`` (at most
    :data:`MAX_RETRIEVE_K`) or ``context_tokens``, and ``sources`` (the files searched)."""
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
    return RetrieveRequest(query=query, k=k, context_tokens=_opt_int(body, "context_tokens"), sources=_sources(body))
