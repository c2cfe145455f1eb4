"""ragbudget.server.openai_api.parsing: OpenAI requests read without a server. Every refusal names
its field with OpenAI's status, ``param`` and ``code`` (tests/test_server.py checks the same end
to end over HTTP).
"""

from __future__ import annotations

from typing import Any

import pytest

from ragbudget.server.openai_api.errors import APIError
from ragbudget.server.openai_api.parsing import (
    MAX_JSON_DEPTH,
    MAX_RETRIEVE_K,
    decode_json,
    parse_chat,
    parse_retrieve,
    parse_sampling,
)

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
