"""The OpenAI chat-completions wire format as ``ragbudget serve`` speaks it, in both directions.
Pure: no FastAPI, Starlette or asyncio, no I/O; :mod:`ragbudget.server.app` reads bodies off the
socket and hands them here. Three modules, one per direction and one for failures:

* :mod:`.parsing` — requests: :func:`decode_json` (a body's bytes to JSON, refusing hostile
  nesting), then :func:`parse_chat` or :func:`parse_retrieve` to a frozen record, or an
  :class:`APIError` naming the field, as OpenAI answers it (status, ``type``, ``param``, ``code``).
* :mod:`.answers` — responses: :class:`Completion` shapes an answer as a ``chat.completion``
  object or as ``chat.completion.chunk`` server-sent events (:func:`sse`); :func:`public_report`
  and :func:`public_paths` keep host memory figures and absolute paths out of what clients see.
* :mod:`.errors` — :func:`error_from_exception` maps a library exception to its HTTP answer (only
  the server's own faults are 5xx, and their text stays in the server's log).

Every name is importable from here, where the server and the tests take them.

>>> req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "Hi?"}]}, ["m"])
>>> Completion(id="chatcmpl-1", created=0, model=req.model).chunk({"content": "Hi"})[:6]
b'data: '
"""

from .answers import (
    Completion,
    finish_reason_of,
    hits_body,
    models_body,
    public_paths,
    public_report,
    selection_body,
    sse,
    usage_of,
)
from .errors import (
    CLIENT_CLOSED,
    APIError,
    engine_error,
    engine_overloaded,
    engine_unavailable,
    error_from_exception,
    index_unavailable,
    is_client_disconnect,
    overloaded,
)
from .parsing import (
    MAX_JSON_DEPTH,
    MAX_RETRIEVE_K,
    MAX_STOP,
    ChatRequest,
    RetrieveRequest,
    body_key,
    caller_key,
    decode_json,
    parse_chat,
    parse_retrieve,
    parse_sampling,
)

__all__ = [
    "CLIENT_CLOSED",
    "MAX_JSON_DEPTH",
    "MAX_RETRIEVE_K",
    "MAX_STOP",
    "APIError",
    "ChatRequest",
    "Completion",
    "RetrieveRequest",
    "body_key",
    "caller_key",
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
