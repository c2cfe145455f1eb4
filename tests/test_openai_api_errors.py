"""ragbudget.server.openai_api.errors: a library exception mapped to its HTTP answer. Only the
server's own faults and a served engine's are 5xx, a retry's wait is in its message and its
``Retry-After``, and no message names a host path (tests/test_server.py checks the same over HTTP).
"""

from __future__ import annotations

import json

import pytest

from ragbudget.errors import (
    BudgetError,
    ConfigError,
    EngineAuthError,
    EngineConnectionError,
    EngineError,
    EngineOverloadedError,
    EngineResponseError,
    EngineTimeoutError,
    OverloadedError,
)
from ragbudget.server.openai_api.errors import (
    CLIENT_CLOSED,
    engine_overloaded,
    engine_unavailable,
    error_from_exception,
    overloaded,
)

# --- errors ---------------------------------------------------------------------------------------


def test_overload_answers_carry_a_rounded_up_retry_after() -> None:
    err = overloaded("3 requests already wait", 2.1)
    assert (err.status, err.type, err.code, err.headers) == (
        429,
        "rate_limit_error",
        "overloaded",
        {"Retry-After": "3"},
    )
    assert overloaded("x", 0.01).headers == {"Retry-After": "1"}  # never 0: no hammering
    mapped = error_from_exception(OverloadedError("queue full", retry_after=0.4))
    assert mapped.status == 429 and mapped.headers == {"Retry-After": "1"}


def test_a_429_or_503_message_says_the_number_its_retry_after_header_carries() -> None:
    from ragbudget.errors import EngineConnectionError, EngineOverloadedError

    busy = EngineOverloadedError("busy; it asked to retry after 0.5 s", retry_after=0.5, status=503)
    for err, status in (
        (overloaded("3 requests already wait", 2.1), 429),
        (error_from_exception(OverloadedError("queue full", retry_after=97.2)), 429),
        # A served engine that kept refusing is the gateway's 503 (the engine is saturated, not the
        # gateway's queue); its message says the same number as the header, once.
        (error_from_exception(busy), 503),
        (engine_unavailable(EngineConnectionError("refused", cause="refused"), retry_after=2.5), 503),
        (engine_overloaded("llamacpp", "http://127.0.0.1:8080", "4 requests wait", 3.2), 503),
    ):
        assert err.status == status
        assert err.message.endswith(f"; retry after {err.headers['Retry-After']} s"), err.message
        assert err.message.count("retry after") == 1, err.message
        assert "Retry-After header" not in err.message


def test_error_messages_keep_the_host_to_itself() -> None:
    budget = BudgetError("Llama on RTX 4090: 30 GiB needed", needed=9000, available=2048)
    err = error_from_exception(budget)
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "messages")
    assert "9000" in err.message and "2048" in err.message and "RTX" not in err.message
    no_tokens = error_from_exception(BudgetError("weights need 9 GiB", needed=9 << 30, available=1, unit="bytes"))
    assert "GiB" not in no_tokens.message and "does not fit" in no_tokens.message
    config = error_from_exception(ConfigError("cannot read /home/ann/private/notes.md: denied"))
    assert config.status == 400 and "/home" not in config.message and "notes.md" in config.message


URL = "http://127.0.0.1:8080/v1/chat/completions"


@pytest.mark.parametrize(
    ("exc", "status", "code", "cause", "says"),
    [
        (
            EngineConnectionError("connection to … refused", url=URL, kind="llamacpp", cause="refused"),
            502,
            "engine_unreachable",
            "refused",
            "refused the connection",
        ),
        (
            EngineConnectionError("… closed the connection", url=URL, kind="llamacpp", cause="dropped"),
            502,
            "engine_unreachable",
            "dropped",
            "closed the connection mid-request",
        ),
        (
            EngineTimeoutError("… gave no answer within 30 s", url=URL, kind="vllm", timeout=30.0),
            504,
            "engine_timeout",
            "timeout",
            "gave no answer within 30 s",
        ),
        (
            EngineOverloadedError("… overloaded", url=URL, kind="vllm", status=503, retry_after=2.5, attempts=4),
            503,
            "engine_overloaded",
            "overloaded",
            "is overloaded (it answered 503 after 4 attempt(s))",
        ),
        (
            EngineAuthError("… 401", url=URL, kind="tgi", status=401),
            502,
            "engine_auth",
            "auth",
            "refused this server's credentials (401)",
        ),
        (
            EngineResponseError("… 500: /srv/models/x.gguf", url=URL, kind="sglang", status=500),
            502,
            "engine_error",
            "bad_response",
            "answered 500",
        ),
    ],
)
def test_engine_errors_are_answered_as_a_gateway_answers_them(
    exc: EngineError, status: int, code: str, cause: str, says: str
) -> None:
    """Not a 500: 502 for a refused or broken engine, 504 for its time-out, 503 + Retry-After
    for its overload; the message and the ``engine`` field name the engine and the cause."""
    err = error_from_exception(exc)
    body = err.body()["error"]
    assert (err.status, err.type, err.code) == (status, "server_error", code)
    assert says in err.message and f"the {exc.kind} engine at {URL}" in err.message
    assert body["engine"]["url"] == URL and body["engine"]["kind"] == exc.kind and body["engine"]["cause"] == cause
    assert "/srv/models" not in json.dumps(err.body())  # the engine's own text stays in the log
    assert ("Retry-After" in err.headers) is (status == 503)
    if status == 503:
        assert err.headers["Retry-After"] == "3"


def test_an_engine_context_error_stays_a_400() -> None:
    from ragbudget.errors import EngineContextError

    err = error_from_exception(EngineContextError("too long", url=URL, kind="llamacpp", n_prompt_tokens=600, n_ctx=512))
    assert (err.status, err.code) == (400, "context_length_exceeded")


def test_a_client_disconnect_is_recognised_by_starlette_type_only() -> None:
    from starlette.requests import ClientDisconnect

    assert error_from_exception(ClientDisconnect()).status == CLIENT_CLOSED

    class ClientDisconnect2(Exception):
        pass

    ClientDisconnect2.__name__ = "ClientDisconnect"  # same name, not starlette's: a server fault
    assert error_from_exception(ClientDisconnect2()).status == 500
