"""ragbudget.server.openai_api: the OpenAI wire format, parsed and shaped without a server.

Direct unit tests of what tests/test_server.py checks end to end over HTTP: every refusal names
its field with OpenAI's status, ``param`` and ``code``; the shapes carry what clients read and no
host figure or absolute path.
"""

from __future__ import annotations

import json
from typing import Any

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
from ragbudget.packing.select import Dropped, SelectedChunk, Selection
from ragbudget.pipeline import Answer
from ragbudget.server.openai_api import (
    CLIENT_CLOSED,
    MAX_JSON_DEPTH,
    MAX_RETRIEVE_K,
    APIError,
    Completion,
    decode_json,
    engine_overloaded,
    engine_unavailable,
    error_from_exception,
    hits_body,
    models_body,
    overloaded,
    parse_chat,
    parse_retrieve,
    parse_sampling,
    public_paths,
    public_report,
    selection_body,
    sse,
)
from ragbudget.types import Hit, Source

MODELS = ["fake/model", "ragbudget"]


def chat(**fields: Any) -> dict[str, Any]:
    """A valid chat body, with ``fields`` added or replaced."""
    return {"model": "fake/model", "messages": [{"role": "user", "content": "What is KV?"}], **fields}


def refused(body: Any, *, limit: int | None = 64) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat(body, MODELS, max_tokens_limit=limit)
    return info.value


# --- chat requests --------------------------------------------------------------------------------


def test_parse_chat_reads_history_question_and_options() -> None:
    req = parse_chat(
        chat(
            messages=[
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Earlier"}, {"type": "text", "text": "question?"}],
                },
                {"role": "assistant", "content": "Earlier answer."},
                {"role": "user", "content": "Follow-up?"},
            ],
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=40,
            max_completion_tokens=32,  # the newer name wins
            context_tokens=256,
            temperature=0.7,
            seed=-(2**63),
            stop="\n\n",
            user="someone",  # bookkeeping fields pass, unused
            n=1,
        ),
        MODELS,
        max_tokens_limit=64,
    )
    assert req.model == "fake/model"
    assert req.question == "Follow-up?"
    assert req.history == [
        {"role": "system", "content": "Be brief."},  # developer is OpenAI's newer name for system
        {"role": "user", "content": "Earlier\nquestion?"},  # text parts joined by newlines
        {"role": "assistant", "content": "Earlier answer."},
    ]
    assert req.stream is True and req.include_usage is True
    assert req.max_tokens == 32 and req.context_tokens == 256
    assert req.sampling == {"temperature": 0.7, "seed": -(2**63), "stop": ["\n\n"]}


def test_parse_chat_defaults() -> None:
    req = parse_chat(chat(stream=None), ["fake/model"])
    assert (req.stream, req.include_usage, req.max_tokens, req.context_tokens, req.sampling, req.history) == (
        False,
        False,
        None,
        None,
        {},
        [],
    )
    # Without a server limit any positive max_tokens passes; the served name "ragbudget" too.
    assert parse_chat(chat(model="ragbudget", max_tokens=10**6), MODELS).max_tokens == 10**6


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ([], 400, None, "invalid_type"),
        (chat(temprature=0.5), 400, "temprature", "unknown_parameter"),
        ({"messages": [{"role": "user", "content": "q"}]}, 400, "model", "missing_required_parameter"),
        (chat(model=7), 400, "model", "invalid_type"),
        (chat(model="gpt-4o"), 404, "model", "model_not_found"),
        ({"model": "fake/model"}, 400, "messages", "missing_required_parameter"),
        (chat(messages={"role": "user"}), 400, "messages", "invalid_type"),
        (chat(messages=[]), 400, "messages", "empty_array"),
        (chat(messages=["hi"]), 400, "messages[0]", "invalid_type"),
        (chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages[0].role", "invalid_value"),
        (chat(messages=[{"role": "user"}]), 400, "messages[0].content", "missing_required_parameter"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            400,
            "messages[0].content",
            "invalid_type",
        ),
        (chat(messages=[{"role": "user", "content": 3}]), 400, "messages[0].content", "invalid_type"),
        (
            chat(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]),
            400,
            "messages[1].role",
            "invalid_value",
        ),
        (chat(messages=[{"role": "user", "content": "  \n"}]), 400, "messages[0].content", "invalid_value"),
        (chat(stream="yes"), 400, "stream", "invalid_type"),
        (chat(stream_options="usage"), 400, "stream_options", "invalid_type"),
        (chat(stream_options={"include_usage": "yes"}), 400, "stream_options", "invalid_type"),
        (chat(n=2), 400, "n", "invalid_value"),
        (chat(n=True), 400, "n", "invalid_type"),
        (chat(temperature=2.5), 400, "temperature", "invalid_value"),
        (chat(temperature=float("nan")), 400, "temperature", "invalid_value"),
        (chat(temperature=True), 400, "temperature", "invalid_type"),
        (chat(top_p=-0.1), 400, "top_p", "invalid_value"),
        (chat(seed=1.5), 400, "seed", "invalid_type"),
        (chat(seed=2**64), 400, "seed", "invalid_value"),
        (chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", "invalid_value"),
        (chat(stop=[""]), 400, "stop", "invalid_value"),
        (chat(stop=[1]), 400, "stop", "invalid_type"),
        (chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
        (chat(max_tokens="64"), 400, "max_tokens", "invalid_type"),
        (chat(max_tokens=65), 400, "max_tokens", "invalid_value"),  # past the server's limit of 64
        (chat(max_completion_tokens=65), 400, "max_completion_tokens", "invalid_value"),
        (chat(context_tokens=0), 400, "context_tokens", "invalid_value"),
        (chat(presence_penalty=3), 400, "presence_penalty", "invalid_value"),  # OpenAI's range first
        (chat(presence_penalty=0.5), 400, "presence_penalty", "unsupported_parameter"),
        (chat(tools=[{"type": "function"}]), 400, "tools", "unsupported_parameter"),
        (chat(logprobs=True), 400, "logprobs", "unsupported_parameter"),
        (chat(logprobs=0), 400, "logprobs", "unsupported_parameter"),  # 0 is not false
        (chat(top_logprobs=False), 400, "top_logprobs", "unsupported_parameter"),  # false is not 0
        (chat(response_format={"type": "json_object"}), 400, "response_format", "unsupported_parameter"),
    ],
)
def test_parse_chat_refusals_name_the_field(body: Any, status: int, param: str | None, code: str) -> None:
    err = refused(body)
    assert (err.status, err.param, err.code) == (status, param, code), err.message
    assert err.body() == {
        "error": {"message": err.message, "type": "invalid_request_error", "param": param, "code": code}
    }


def test_max_tokens_past_the_limit_names_both_figures() -> None:
    message = refused(chat(max_tokens=65)).message
    assert "65" in message and "64" in message and "--max-new-tokens" in message


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [], "tool_choice": "none", "parallel_tool_calls": True, "functions": None},
        {"logprobs": False, "top_logprobs": 0, "logit_bias": {}},
        {"response_format": {"type": "text"}, "modalities": ["text"], "audio": None},
        {"presence_penalty": 0, "frequency_penalty": 0.0},
        {"metadata": {"k": "v"}, "store": False, "service_tier": "auto"},
    ],
)
def test_the_do_nothing_defaults_of_unsupported_fields_pass(fields: dict[str, Any]) -> None:
    assert parse_chat(chat(**fields), MODELS).question == "What is KV?"


def test_parse_sampling_keeps_only_what_was_sent() -> None:
    assert parse_sampling({}) == {}
    assert parse_sampling({"temperature": 0, "top_p": 1}) == {"temperature": 0, "top_p": 1}  # 0 is greedy
    assert parse_sampling({"stop": ["</s>", "\n"], "seed": 7}) == {"seed": 7, "stop": ["</s>", "\n"]}
    assert parse_sampling({"stop": []}) == {}  # no stop sequence
    assert parse_sampling({"presence_penalty": 0}) == {}  # range-checked, never passed on


# --- retrieve requests ----------------------------------------------------------------------------


def test_parse_retrieve() -> None:
    req = parse_retrieve({"query": "page footer", "k": MAX_RETRIEVE_K})
    assert (req.query, req.k, req.context_tokens) == ("page footer", MAX_RETRIEVE_K, None)
    assert parse_retrieve({"query": "q", "context_tokens": 300}).context_tokens == 300
    for body, param, code in [
        ({"query": "q", "k": MAX_RETRIEVE_K + 1}, "k", "invalid_value"),
        ({"query": "q", "k": 0}, "k", "invalid_value"),
        ({"k": 3}, "query", "missing_required_parameter"),
        ({"query": "  "}, "query", "invalid_value"),
        ({"query": ["q"]}, "query", "invalid_value"),
        ({"query": "q", "top_k": 3}, "top_k", "unknown_parameter"),
        ("q", None, "invalid_type"),
    ]:
        with pytest.raises(APIError) as info:
            parse_retrieve(body)
        assert (info.value.status, info.value.param, info.value.code) == (400, param, code), body


# --- bodies ---------------------------------------------------------------------------------------


def nested(depth: int) -> bytes:
    return b"[" * (depth - 1) + b"{}" + b"]" * (depth - 1)


def test_decode_json() -> None:
    assert decode_json(b' {"a": [1, "\xc3\xa9"]} ') == {"a": [1, "é"]}
    assert decode_json(nested(MAX_JSON_DEPTH)) is not None  # the limit itself passes
    for raw, words in [
        (b"", "empty"),
        (b"  \n", "empty"),
        (b'{"a": ', "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"1" * 5000, "not valid JSON"),  # past Python's int-string conversion limit
        (nested(MAX_JSON_DEPTH + 1), "nested too deep"),
        (nested(100_000), "nested too deep"),  # past the interpreter's recursion limit
        (b'{"q": "\\ud800"}', "surrogate"),
        (b'{"\\udfff": 1}', "surrogate"),  # in a key too
    ]:
        with pytest.raises(APIError) as info:
            decode_json(raw)
        assert info.value.status == 400 and info.value.code == "invalid_json", raw[:20]
        assert words in info.value.message, (raw[:20], info.value.message)


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
        # A served engine that kept refusing is relayed in its own class (its 503: a 503, its
        # 429: a 429); an engine whose own figures say it is saturated is load, a 429. Each
        # message says the same number as the header, once.
        (error_from_exception(busy), 503),
        (error_from_exception(EngineOverloadedError("busy", retry_after=0.5, status=429)), 429),
        (engine_unavailable(EngineConnectionError("refused", cause="refused"), retry_after=2.5), 503),
        (engine_overloaded("llamacpp", "http://127.0.0.1:8080", "4 requests wait", 3.2), 429),
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


def test_an_engine_known_hung_is_504_and_one_known_down_503_before_any_work() -> None:
    """Issue #42 §5: the server's look at the engine timed out (a frozen process): requests
    refused before any work are 504 ``engine_timeout``, as a request that timed out itself is
    (:func:`engine_error`), not 503; an engine that refuses connections stays a 503."""
    hung = engine_unavailable(EngineTimeoutError("… no answer", url=URL, kind="llamacpp", timeout=10.0))
    down = engine_unavailable(EngineConnectionError("… refused", url=URL, kind="llamacpp", cause="refused"))
    assert (hung.status, hung.code, hung.body()["error"]["engine"]["cause"]) == (504, "engine_timeout", "timeout")
    assert "gave no answer within 10 s" in hung.message
    assert (down.status, down.code, down.body()["error"]["engine"]["cause"]) == (503, "engine_unavailable", "refused")


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


# --- responses ------------------------------------------------------------------------------------


REPORT = {
    "budget": {
        "prompt_tokens": 300,
        "new_tokens": 12,
        "max_new_tokens": 64,
        "gpu": "RTX 4090",
        "free_bytes": 21 << 30,
        "kv_bytes_per_token": 131072,
    },
    "plan": {"gpu": "RTX 4090", "usable_bytes": 20 << 30},
    "selection": {"chunks": [{"path": "/home/ann/corpus/docs/kv.md"}]},
    "oom_steps": [{"action": "halve_context", "reason": "CUDA out of memory; 21.6 GiB total", "cache": "dynamic"}],
    "timings": {"total_s": 0.5},
}


def answer(finish_reason: str = "stop") -> Answer:
    return Answer(
        text="KV is [1].",
        sources=[
            {"path": "/home/ann/corpus/docs/kv.md", "start": 0, "end": 9},
            {"path": "docs/rel.md", "start": 3, "end": 4},
        ],
        report=REPORT,
        finish_reason=finish_reason,
    )


def test_completion_body() -> None:
    body = Completion(id="chatcmpl-1", created=1700000000, model="fake/model").body(answer())
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-1" and body["model"] == "fake/model"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "KV is [1]."},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ]
    assert body["usage"] == {"prompt_tokens": 300, "completion_tokens": 12, "total_tokens": 312}
    assert [s["path"] for s in body["sources"]] == ["kv.md", "docs/rel.md"]  # no absolute path
    shown = json.dumps(body["ragbudget"])
    assert "RTX" not in shown and "free_bytes" not in shown and "GiB" not in shown and "plan" not in body["ragbudget"]
    assert body["ragbudget"]["budget"] == {"prompt_tokens": 300, "new_tokens": 12, "max_new_tokens": 64}
    assert body["ragbudget"]["oom_steps"] == [{"action": "halve_context", "cache": "dynamic"}]
    assert body["ragbudget"]["selection"] == {"chunks": [{"path": "kv.md"}]}
    # OpenAI's finish reasons: "length" stays, ragbudget's "cancelled" is a stop.
    assert Completion(id="c", created=0, model="m").body(answer("length"))["choices"][0]["finish_reason"] == "length"
    assert Completion(id="c", created=0, model="m").body(answer("cancelled"))["choices"][0]["finish_reason"] == "stop"


def test_expose_plan_sends_the_whole_report_but_no_absolute_path() -> None:
    report = Completion(id="c", created=0, model="m", expose_plan=True).body(answer())["ragbudget"]
    assert report["budget"]["gpu"] == "RTX 4090" and report["plan"]["usable_bytes"] == 20 << 30
    assert report["selection"] == {"chunks": [{"path": "kv.md"}]}
    assert public_report(REPORT, expose_plan=False)["budget"]["prompt_tokens"] == 300


def test_stream_frames() -> None:
    c = Completion.new("fake/model")
    assert c.id.startswith("chatcmpl-") and len(c.id) > len("chatcmpl-") + 16 and c.created > 1_600_000_000
    assert Completion.new("m").id != c.id
    frame = c.chunk({"content": "é"})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and "é".encode() in frame  # UTF-8, not \\u
    event = json.loads(frame[len(b"data: ") :])
    assert event["object"] == "chat.completion.chunk" and event["id"] == c.id
    assert event["choices"] == [{"index": 0, "delta": {"content": "é"}, "finish_reason": None, "logprobs": None}]
    last = json.loads(c.last_chunk(answer("length"), include_usage=True)[6:])
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["delta"] == {}
    assert last["usage"]["total_tokens"] == 312 and last["sources"][0]["path"] == "kv.md"
    assert "RTX" not in json.dumps(last["ragbudget"])
    assert "usage" not in json.loads(c.last_chunk(answer(), include_usage=False)[6:])
    assert sse("[DONE]") == b"data: [DONE]\n\n"


def test_public_paths() -> None:
    doc = {
        "path": "/srv/idx/a/b.md",
        "file": "C:\\corpus\\c.pdf",
        "index_dir": "/srv/idx/",
        "source_path": "rel/d.md",
        "text": "/etc/passwd is quoted text, not a path field",
        "nested": [{"path": "/x/y/z.txt"}, ("tuple", {"path": "/q.md"})],
    }
    assert public_paths(doc) == {
        "path": "b.md",
        "file": "c.pdf",
        "index_dir": "idx",
        "source_path": "rel/d.md",
        "text": "/etc/passwd is quoted text, not a path field",
        "nested": [{"path": "z.txt"}, ["tuple", {"path": "q.md"}]],
    }


def test_retrieve_and_models_bodies() -> None:
    src = Source(path="/home/ann/corpus/kv.md", start=0, end=40, page_start=2, page_end=2)
    hits = [Hit(chunk_id=7, score=0.91234567, text="KV cache", n_tokens=3, sources=(src,))]
    body = hits_body("kv", hits)
    assert body["object"] == "list" and body["query"] == "kv"
    assert body["data"][0]["chunk_id"] == 7 and body["data"][0]["sources"][0]["path"] == "kv.md"
    selection = Selection(
        chunks=(SelectedChunk(chunk_ids=(7,), text="KV cache", score=0.9, n_tokens=3, cost=5, sources=(src,)),),
        tokens_used=5,
        tokens_allowed=100,
        dropped=(Dropped(chunk_id=8, reason="over_budget", score=0.2, n_tokens=90),),
    )
    body = selection_body("kv", selection)
    assert (body["tokens_used"], body["tokens_allowed"]) == (5, 100)
    assert body["data"][0]["sources"][0]["path"] == "kv.md"
    assert body["dropped"] == [{"chunk_id": 8, "reason": "over_budget", "score": 0.2, "n_tokens": 90}]
    assert models_body(MODELS, 5) == {
        "object": "list",
        "data": [
            {"id": "fake/model", "object": "model", "created": 5, "owned_by": "ragbudget"},
            {"id": "ragbudget", "object": "model", "created": 5, "owned_by": "ragbudget"},
        ],
    }
