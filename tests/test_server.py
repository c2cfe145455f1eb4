"""``ragbudget serve``: OpenAI compatibility, admission (429, never 5xx), disconnects, bad input.

A real uvicorn server on 127.0.0.1 (ephemeral port, background thread) serves a real
:class:`~ragbudget.pipeline.Pipeline` over a small real index (tests/_fakes.py ``corpus_index``),
generating on the shared model-free ``FakeBackend`` (fast, deterministic, scripted); admission is
the pipeline's own controller. The official ``openai`` client and httpx talk to it over loopback
only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _fakes import (
    WINDOW,
    FakeGenerator,
    GeneratorStub,
    corpus_index,
    fake,
    fake_pipeline,
    printable_stop,
    running,
    stop_server,
)

from ragbudget.errors import BudgetError, OverloadedError
from ragbudget.generation.backend import Sampling
from ragbudget.pipeline import Pipeline
from ragbudget.server.app import background_server, create_app

MODEL = "fake/model"

# Every test serves the app with uvicorn, nearly all over the packaged MiniLM's index (tests/_needs.py).
pytestmark = [pytest.mark.server, pytest.mark.model]


def history_of(call: dict[str, Any]) -> list[dict[str, str]]:
    """The history a generation call's prompt carried: its messages between the pipeline's
    system prompt and the question (with the context)."""
    return call["messages"][1:-1]


def reserved(pipe: Pipeline) -> int:
    return pipe.admission.stats().admitted_tokens


def client(url: str, key: str = "unused") -> openai.OpenAI:
    # The time-out only guards against a hang: a real-model answer on a CPU shared with the
    # whole parallel suite took over 30 s once (test_real_models_through_the_openai_client).
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def user(text: str = "How is the KV cache budget computed?") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def burst_with_one_retry(
    url: str, bodies: list[dict[str, Any]], *, timeout: float
) -> list[tuple[int, str | None, Any]]:
    """Send ``bodies`` at once, one client thread each; a client answered 429 sleeps its
    Retry-After (whole seconds) and asks once more with the same body. Per client: its first
    status, the Retry-After it was given, and its second status (the error text if not 200)."""
    start = threading.Barrier(len(bodies))
    rows: list[tuple[int, str | None, Any]] = []
    lock = threading.Lock()

    def one(body: dict[str, Any]) -> None:
        start.wait()
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
        retry, second = r.headers.get("retry-after"), None
        if r.status_code == 429 and retry is not None:
            time.sleep(int(retry))
            again = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
            second = again.status_code if again.status_code == 200 else again.text
        with lock:
            rows.append((r.status_code, retry, second))

    threads = [threading.Thread(target=one, args=(body,)) for body in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * timeout + 60)
    return rows


#: The source the default question retrieves first.
SOURCE_PATH = "docs/kv-budget.md"


# --- OpenAI compatibility -------------------------------------------------------------------------


def test_openai_client_non_streaming_with_sources() -> None:
    pipe = fake_pipeline()
    question = user()[0]["content"]
    with running(pipe) as url:
        resp = client(url).chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Earlier question?"},
                {"role": "assistant", "content": "Earlier answer."},
                {"role": "user", "content": question},
            ],
            max_tokens=4,
        )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == "word0 word1 word2 word3"
    assert resp.choices[0].finish_reason == "length"
    extra = resp.model_extra or {}
    prompt_tokens = extra["ragbudget"]["budget"]["prompt_tokens"]
    assert resp.usage is not None and resp.usage.completion_tokens == 4
    assert resp.usage.prompt_tokens == prompt_tokens > 0
    assert extra["sources"][0]["path"] == SOURCE_PATH
    call = fake(pipe).calls[-1]
    assert call["question"] == question and call["max_new_tokens"] == 4
    assert history_of(call) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Earlier question?"},
        {"role": "assistant", "content": "Earlier answer."},
    ]


def test_sources_in_the_request_scope_the_answer_and_the_retrieval() -> None:
    pipe = fake_pipeline()
    with running(pipe) as url:
        resp = client(url).chat.completions.create(
            model=MODEL, messages=user(), max_tokens=4, extra_body={"sources": ["leader.md"]}
        )
        retrieved = httpx.post(url + "/v1/retrieve", json={"query": "footers", "k": 3, "sources": "docs/pdf-*"}).json()
        fitted = httpx.post(
            url + "/v1/retrieve", json={"query": "footers", "context_tokens": 100, "sources": "html-footer.md"}
        ).json()
        typo = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user(), "sources": "nope.md"})
        wrong = httpx.post(url + "/v1/retrieve", json={"query": "footers", "k": 3, "sources": [1]})
    extra = resp.model_extra or {}
    assert {s["path"] for s in extra["sources"]} == {"docs/leader.md"}  # the question is about the KV budget
    assert extra["ragbudget"]["index"]["sources"] == ["leader.md"]
    assert {h["sources"][0]["path"] for h in retrieved["data"]} == {"docs/pdf-headers.md", "docs/pdf-footer.md"}
    assert fitted["data"] and {h["sources"][0]["path"] for h in fitted["data"]} == {"docs/html-footer.md"}
    assert typo.status_code == 400 and typo.json()["error"]["code"] == "invalid_value"
    assert "no indexed file matches the source 'nope.md'" in typo.json()["error"]["message"]
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "sources"


def test_openai_client_streaming_with_sources_in_final_chunk() -> None:
    pipe = fake_pipeline(words=5)
    with running(pipe) as url:
        stream = client(url).chat.completions.create(
            model=MODEL, messages=user(), stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "word0 word1 word2 word3 word4"
    assert chunks[0].choices[0].delta.role == "assistant"
    final = chunks[-1]
    assert final.choices[0].finish_reason == "stop"
    assert (final.model_extra or {})["sources"][0]["path"] == SOURCE_PATH
    assert final.usage is not None and final.usage.completion_tokens == 5
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_openai_client_sampling_options_reach_the_pipeline() -> None:
    pipe = fake_pipeline()
    with running(pipe) as url:
        c = client(url)
        c.chat.completions.create(model=MODEL, messages=user(), temperature=0.7, top_p=0.9, seed=42, stop="END")
        list(
            c.chat.completions.create(
                model=MODEL,
                messages=user(),
                stream=True,
                temperature=0,
                seed=1,
                stop=["a", "b", "c", "d"],
                presence_penalty=0,
                max_completion_tokens=3,
            )
        )
        c.chat.completions.create(model=MODEL, messages=user())
    calls = fake(pipe).calls
    assert (calls[0]["sampling"], calls[0]["stop"]) == (Sampling(temperature=0.7, top_p=0.9, seed=42), ["END"])
    assert (calls[1]["sampling"], calls[1]["stop"]) == (Sampling(temperature=0, seed=1), ["a", "b", "c", "d"])
    assert calls[1]["max_new_tokens"] == 3
    assert (calls[2]["sampling"], calls[2]["stop"]) == (Sampling(), None)  # nothing sent: greedy


def test_openai_client_validation_errors_are_typed() -> None:
    pipe = fake_pipeline()
    with running(pipe) as url:
        for options in ({"temperature": -1}, {"stop": ["1", "2", "3", "4", "5"]}, {"top_p": 2}):
            with pytest.raises(openai.BadRequestError) as err:
                client(url).chat.completions.create(model=MODEL, messages=user(), **options)
            assert err.value.status_code == 400 and err.value.param == next(iter(options))
    assert fake(pipe).calls == []


@pytest.fixture(scope="module")
def tiny_url() -> Iterator[str]:
    """A real Pipeline on a real :class:`~ragbudget.generation.generate.Generator` with the tiny random
    Llama: the sampling and stop options go all the way to transformers ``generate``."""
    from _tiny_lm import tiny_model, tiny_tokenizer

    from ragbudget.generation.generate import Generator

    pipe = Pipeline(
        corpus_index(),
        generator=Generator.from_objects(tiny_model(), tiny_tokenizer()),
        gpu="16GiB",
        max_new_tokens=20,
        ttft_target=0,
    )
    with running(pipe, model_name=MODEL) as url:
        yield url


#: A question whose prompt makes the tiny random model write some ASCII (a stop string to cut at).
TINY_QUESTION = "What does the PDF cleaner strip?"


def _stream_text(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_stop_trims_the_answer_streaming_or_not(tiny_url: str) -> None:
    c = client(tiny_url)
    full = c.chat.completions.create(model=MODEL, messages=user(TINY_QUESTION), max_tokens=20)
    text = full.choices[0].message.content or ""
    assert full.choices[0].finish_reason == "length"
    stop = printable_stop(text)
    expected = text[: text.index(stop)].strip()
    cut = c.chat.completions.create(model=MODEL, messages=user(TINY_QUESTION), max_tokens=20, stop=[stop, "zzz"])
    assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
    assert cut.usage is not None and full.usage is not None
    assert cut.usage.completion_tokens < full.usage.completion_tokens  # generation really stopped
    chunks = list(
        c.chat.completions.create(model=MODEL, messages=user(TINY_QUESTION), max_tokens=20, stop=stop, stream=True)
    )
    streamed = _stream_text(chunks)
    assert stop not in streamed and streamed.strip() == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_temperature_and_seed_reach_the_generator(tiny_url: str) -> None:
    c = client(tiny_url)

    def answer(**options: Any) -> str:
        return (
            c.chat.completions.create(model=MODEL, messages=user(TINY_QUESTION), max_tokens=12, **options)
            .choices[0]
            .message.content
            or ""
        )

    greedy = answer()
    assert answer(temperature=0) == greedy == answer(temperature=0, seed=5)  # 0 or absent: greedy
    sampled = answer(temperature=1.0, seed=5)
    assert sampled == answer(temperature=1.0, seed=5) != greedy  # a seed reproduces the sample
    assert {answer(temperature=1.0, seed=s) for s in (6, 7, 8)} - {sampled}
    streamed = _stream_text(
        list(
            c.chat.completions.create(
                model=MODEL, messages=user(TINY_QUESTION), max_tokens=12, temperature=1.0, seed=5, stream=True
            )
        )
    )
    assert streamed.strip() == sampled


def test_raw_stream_ends_with_done() -> None:
    with running(fake_pipeline(words=2)) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user(), "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["sources"][0]["path"] == SOURCE_PATH


def test_models_health_metrics_and_retrieve() -> None:
    pipe = fake_pipeline()
    with running(pipe) as url:
        models = [m.id for m in client(url).models.list()]
        client(url).chat.completions.create(model="ragbudget", messages=user())
        health = httpx.get(url + "/health").json()
        retrieved = httpx.post(url + "/v1/retrieve", json={"query": "footers", "context_tokens": 100}).json()
        searched = httpx.post(url + "/v1/retrieve", json={"query": "footers", "k": 3}).json()
        metrics = httpx.get(url + "/metrics")
    assert models == [MODEL, "ragbudget"]
    assert health["status"] == "ok" and health["admitted_tokens"] == 0 and health["queued"] == 0
    assert "footer" in retrieved["data"][0]["text"] and retrieved["tokens_allowed"] == 100
    assert 0 < retrieved["tokens_used"] <= 100
    assert len(searched["data"]) == 3 and "footer" in searched["data"][0]["text"]
    text = metrics.text
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in (
        "ragbudget_requests_total",
        "ragbudget_queue_depth",
        "ragbudget_admitted_kv_tokens",
        "ragbudget_oom_steps_total",
        "ragbudget_request_duration_seconds_bucket",
        "ragbudget_queue_wait_seconds_count",
        "ragbudget_kv_capacity_tokens",
    ):
        assert name in text, name
    assert 'ragbudget_requests_total{endpoint="/v1/chat/completions",status="200"} 1' in text
    assert 'ragbudget_request_duration_seconds_bucket{endpoint="/v1/chat/completions",le="+Inf"} 1' in text


# --- bad requests ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "messages"),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 5}]}).encode(),
            400,
            "messages[0].content",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}).encode(),
            400,
            "messages[0].role",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "  "}]}).encode(),
            400,
            "messages[0].content",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "assistant", "content": "x"}]}).encode(),
            400,
            "messages[0].role",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
            400,
            "messages[0].content",
        ),
        (json.dumps({"model": MODEL, "messages": user(), "stream": "yes"}).encode(), 400, "stream"),
        (json.dumps({"model": MODEL, "messages": user(), "max_tokens": "10"}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "messages": user(), "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "messages": user(), "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({"model": MODEL, "messages": user(), "temperature": -1}).encode(), 400, "temperature"),
        (json.dumps({"model": MODEL, "messages": user(), "temperature": 2.5}).encode(), 400, "temperature"),
        (json.dumps({"model": MODEL, "messages": user(), "top_p": 1.5}).encode(), 400, "top_p"),
        (json.dumps({"model": MODEL, "messages": user(), "seed": 1.5}).encode(), 400, "seed"),
        (json.dumps({"model": MODEL, "messages": user(), "seed": True}).encode(), 400, "seed"),
        (json.dumps({"model": MODEL, "messages": user(), "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, "stop"),
        (json.dumps({"model": MODEL, "messages": user(), "stop": [""]}).encode(), 400, "stop"),
        (json.dumps({"model": MODEL, "messages": user(), "stop": 3}).encode(), 400, "stop"),
        (json.dumps({"model": MODEL, "messages": user(), "presence_penalty": 3}).encode(), 400, "presence_penalty"),
        (json.dumps({"model": MODEL, "messages": user(), "n": 2}).encode(), 400, "n"),
        (json.dumps({"model": 7, "messages": user()}).encode(), 400, "model"),
        (json.dumps({"messages": user()}).encode(), 400, "model"),
        (json.dumps({"model": "gpt-4o", "messages": user()}).encode(), 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors_and_never_reach_the_model(body: bytes, status: int, param: str | None) -> None:
    pipe = fake_pipeline()
    with running(pipe) as url:
        r = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert fake(pipe).calls == []


def test_hostile_values_are_400_not_a_server_error() -> None:
    pipe = fake_pipeline()
    with running(pipe) as url:
        big_int = b'{"model": "fake-model", "messages": [], "seed": ' + b"9" * 5000 + b"}"
        r = httpx.post(url + "/v1/chat/completions", content=big_int, headers={"content-type": "application/json"})
        r2 = httpx.post(url + "/v1/retrieve", json={"query": "footers", "k": 10**12})
        lone = [
            httpx.post(url + endpoint, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            for endpoint, body in (
                ("/v1/retrieve", {"query": "\ud800"}),
                ("/v1/chat/completions", {"model": MODEL, "messages": user("a \udfff")}),
            )
        ]
    for resp in lone:  # valid JSON, but no text to echo or tokenize (was a 500 from the serializer)
        assert resp.status_code == 400 and "surrogate" in resp.json()["error"]["message"], resp.text
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert r2.status_code == 400 and r2.json()["error"]["param"] == "k"
    assert fake(pipe).calls == []


def test_oversized_body_is_413() -> None:
    pipe = fake_pipeline()
    with running(pipe, max_body_bytes=2000) as url:
        big = {"model": MODEL, "messages": user("x" * 5000)}
        r = httpx.post(url + "/v1/chat/completions", json=big)

        def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
            yield json.dumps(big).encode()

        r2 = httpx.post(url + "/v1/chat/completions", content=chunked())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert r2.status_code == 413
    assert fake(pipe).calls == []


def test_unknown_route_and_method_are_openai_errors() -> None:
    with running(fake_pipeline()) as url:
        r = httpx.get(url + "/v1/nothing")
        r2 = httpx.get(url + "/v1/chat/completions")
    assert r.status_code == 404 and "error" in r.json()
    assert r2.status_code == 405 and "error" in r2.json()


def test_openai_client_raises_typed_errors() -> None:
    with running(fake_pipeline()) as url:
        with pytest.raises(openai.NotFoundError):
            client(url).chat.completions.create(model="nope", messages=user())
        with pytest.raises(openai.BadRequestError):
            client(url).chat.completions.create(model=MODEL, messages=[])


def test_budget_error_is_400_and_unexpected_error_is_500_without_traceback() -> None:
    with running(fake_pipeline(fail=BudgetError("question too long", needed=9000, available=2048))) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user()})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    with running(fake_pipeline(fail=RuntimeError("secret internals"))) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user()})
    assert r.status_code == 500 and "secret" not in r.text and r.json()["error"]["type"] == "server_error"


# --- authentication -------------------------------------------------------------------------------


def test_api_key_required_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = fake_pipeline()
    with running(pipe, api_key="s3cret") as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user()})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").chat.completions.create(model=MODEL, messages=user())
        ok = client(url, "s3cret").chat.completions.create(model=MODEL, messages=user())
        assert ok.choices[0].message.content
    assert len(fake(pipe).calls) == 1
    monkeypatch.setenv("RAGBUDGET_API_KEY", "from-env")
    with running(fake_pipeline()) as url:
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200


# --- admission ------------------------------------------------------------------------------------


def test_overload_is_429_with_retry_after_streaming_or_not() -> None:
    with running(fake_pipeline(fail=OverloadedError("queue full", retry_after=2.2))) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user()})
        rs = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user(), "stream": True})
        with pytest.raises(openai.RateLimitError):
            client(url).chat.completions.create(model=MODEL, messages=user())
    for resp in (r, rs):
        assert resp.status_code == 429
        assert resp.headers["retry-after"] == "3"
        assert resp.json()["error"]["type"] == "rate_limit_error"
        assert resp.json()["error"]["message"] == "queue full; retry after 3 s"  # the header's number


def test_worker_pool_full_is_429_not_an_unbounded_queue() -> None:
    pipe = fake_pipeline(slots=1, words=2000, token_delay=0.02, max_queue=10, timeout=10)
    body = {"model": MODEL, "messages": user(), "stream": True}
    with running(pipe, max_workers=1) as url, httpx.stream("POST", url + "/v1/chat/completions", json=body) as first:
        lines = first.iter_lines()  # keep a reference: dropping it would close the stream
        next(lines)  # the one worker is now busy
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user()})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"


def test_a_client_refused_for_a_full_worker_pool_that_honours_retry_after_gets_in() -> None:
    """The one worker is held by a long stream; a second client is refused for threads, waits
    its Retry-After and asks once more while the worker is still busy: its place was promised
    (admission's refusal, not a bare "try in 1 s"), so it waits for its turn and gets its 200
    instead of a second 429. A third, new client is still refused."""
    pipe = fake_pipeline(slots=1, words=60, token_delay=0.05, max_queue=10, timeout=10)
    body = {"model": MODEL, "messages": user("second")}
    with running(pipe, max_workers=1) as url:
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json={"model": MODEL, "messages": user(), "stream": True}
        ) as first:
            lines = first.iter_lines()
            next(lines)  # the one worker is now busy, for ~3 s
            refused = httpx.post(url + "/v1/chat/completions", json=body)
            assert refused.status_code == 429, refused.text
            assert "1 requests already in progress" in refused.json()["error"]["message"]
            time.sleep(int(refused.headers["retry-after"]))
            back: list[httpx.Response] = []
            returning = threading.Thread(
                target=lambda: back.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=30))
            )
            returning.start()
            assert _wait_until(lambda: pipe.admission.stats().queued == 1)  # in, behind the stream
            newcomer = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user("third")})
            assert newcomer.status_code == 429
            for _ in lines:  # the stream runs to its end, freeing the worker and the cache
                pass
        returning.join(timeout=30)
        metrics = httpx.get(url + "/metrics").text
    assert [r.status_code for r in back] == [200], [r.text for r in back]
    assert 'status="5' not in metrics and reserved(pipe) == 0


def _wait_until(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_disconnect_mid_stream_frees_the_reservation() -> None:
    pipe = fake_pipeline(words=500, token_delay=0.02, max_new_tokens=500)  # ~10 s if nobody cancels
    with running(pipe) as url:
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json={"model": MODEL, "messages": user("stream me"), "stream": True}
        ) as r:
            lines = r.iter_lines()
            next(lines)
            next(lines)
            assert reserved(pipe) > 500  # the prompt and the 500 tokens of answer
        # Closing the response closed the connection: the server must cancel and free at once.
        assert _wait_until(lambda: reserved(pipe) == 0 and fake(pipe).cancelled == ["stream me"])
        assert "ragbudget_cancelled_total 1" in httpx.get(url + "/metrics").text
        # The 200 had been sent, but the answer never reached its client: a 499, not a 200.
        assert _wait_until(
            lambda: 'endpoint="/v1/chat/completions",status="499"} 1' in httpx.get(url + "/metrics").text
        )
        assert 'endpoint="/v1/chat/completions",status="200"' not in httpx.get(url + "/metrics").text


def test_disconnect_while_waiting_non_streaming_frees_the_reservation() -> None:
    pipe = fake_pipeline(words=500, token_delay=0.02, max_new_tokens=500)
    with running(pipe) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user("slow")}, timeout=1.5)
        assert _wait_until(lambda: reserved(pipe) == 0 and fake(pipe).cancelled == ["slow"])
        # Counted as the client's doing (499), not as an answered request.
        assert _wait_until(
            lambda: 'endpoint="/v1/chat/completions",status="499"} 1' in httpx.get(url + "/metrics").text
        )


# --- a hostile history (issue #30): bounded, timed out, cancelled -----------------------------------


def hostile_history(n_messages: int = 2047, words: int = 25) -> list[dict[str, str]]:
    """A history at the default limits (2,047 messages before the question, ~460,000
    characters): each message is counted, and the older turns must be summarized."""
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": " ".join(f"m{i}w{j}" for j in range(words))}
        for i in range(n_messages)
    ]


def in_flight(url: str) -> int:
    return int(httpx.get(url + "/health", timeout=5).json()["in_flight"])


def test_a_history_over_the_limits_is_a_400_naming_the_limit_before_any_work() -> None:
    from ragbudget.settings import HistorySettings

    pipe = fake_pipeline()
    with running(pipe, history=HistorySettings(max_messages=8, max_history_chars=1000)) as url:
        r = httpx.post(
            url + "/v1/chat/completions", json={"model": MODEL, "messages": hostile_history(8, words=1) + user()}
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and err["code"] == "history_too_long"
        assert "has 9 messages, more than the limit of 8 (max_messages; serve --max-messages)" in err["message"]
        long = [{"role": "user", "content": "x" * 1001}]
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": long + user()})
        assert r.status_code == 400 and "1,001 characters, more than the limit of 1,000" in r.json()["error"]["message"]
        assert in_flight(url) == 0
        ok = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": hostile_history(7, 1) + user()})
        assert ok.status_code == 200
    assert len(fake(pipe).calls) == 1  # the refused ones reached no worker, no model


def test_a_hostile_history_never_holds_a_worker_past_the_request_timeout() -> None:
    # The summary the history needs would take 128 tokens x 0.3 s = 38 s; the request time-out is 3 s.
    pipe = fake_pipeline(words=200, token_delay=0.3)
    body = {"model": MODEL, "messages": hostile_history() + user()}
    with running(pipe, request_timeout=3) as url:
        for stream in (False, True):
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
            took = time.monotonic() - t0
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "request_timeout" and "request time-out of 3 s" in err["message"]
            assert 3 <= took < 6
            assert _wait_until(lambda: in_flight(url) == 0, timeout=1.0)  # its worker is free at once
        assert reserved(pipe) == 0
        assert "ragbudget_timed_out_total 2" in httpx.get(url + "/metrics").text
        # A question with a short history still gets its answer under the same time-out.
        short = {"model": MODEL, "messages": user(), "max_tokens": 4}  # 1.2 s of answer
        ok = httpx.post(url + "/v1/chat/completions", json=short, timeout=30)
        assert ok.status_code == 200, ok.text


def test_a_stream_cut_by_the_request_timeout_ends_with_the_error() -> None:
    pipe = fake_pipeline(words=500, token_delay=0.05, max_new_tokens=500)  # 25 s of answer
    with running(pipe, request_timeout=2) as url:
        body = {"model": MODEL, "messages": user("stream me"), "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        assert any("word1" in e for e in events)  # it had started
        assert _wait_until(lambda: in_flight(url) == 0 and reserved(pipe) == 0, timeout=1.0)


def test_a_client_leaving_during_a_hostile_history_frees_its_worker_at_once() -> None:
    pipe = fake_pipeline(words=200, token_delay=0.3)
    with running(pipe) as url:  # the default request time-out: only the client's leaving stops it
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                url + "/v1/chat/completions", json={"model": MODEL, "messages": hostile_history() + user()}, timeout=1.0
            )
        assert _wait_until(lambda: in_flight(url) == 0, timeout=2.0)
        assert reserved(pipe) == 0
        assert _wait_until(
            lambda: 'endpoint="/v1/chat/completions",status="499"} 1' in httpx.get(url + "/metrics").text
        )


def _load_bench() -> Any:
    path = Path(__file__).resolve().parents[1] / "bench" / "load.py"
    spec = importlib.util.spec_from_file_location("ragbudget_bench_load", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being created
    spec.loader.exec_module(module)
    return module


def test_short_load_only_200_or_429_and_health_throughout() -> None:
    """24 concurrent clients against a budget that admits 2 requests and queues 3."""
    bench = _load_bench()
    pipe = fake_pipeline(slots=2, words=10, token_delay=0.005, max_queue=3, timeout=0.5)
    with running(pipe) as url:
        result = bench.run_load(url, clients=24, requests_per_client=3, stream_share=0.5, model=MODEL, time_limit=60)
    statuses = result["statuses"]
    assert set(statuses) <= {"200", "429"}, statuses
    assert statuses.get("200", 0) > 0
    assert result["errors_5xx"] == 0 and result["transport_errors"] == 0
    assert result["missing_retry_after"] == 0
    assert result["health"]["failed"] == 0 and result["health"]["ok"] > 0
    assert fake(pipe).peak_running <= 2  # never more admitted than the capacity
    assert _wait_until(lambda: reserved(pipe) == 0 and pipe.admission.stats().queued == 0)


def test_idle_server_returns_freed_memory_to_the_os(monkeypatch: pytest.MonkeyPatch) -> None:
    from ragbudget.server import malloc

    if not malloc.trimming_supported():
        pytest.skip("malloc_trim is glibc's")
    trims: list[int] = []
    real = malloc.release_memory
    monkeypatch.setattr(malloc, "release_memory", lambda: trims.append(1) or real())
    app = create_app(fake_pipeline(words=3))
    with background_server(app) as url:
        assert trims == []  # nothing before the first request
        for _ in range(3):
            httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user()})
        # One trim once the burst is over and the server stayed idle (not one per request).
        assert _wait_until(lambda: app.state.trimmer.trims >= 1)
    assert 1 <= len(trims) <= 3
    assert create_app(fake_pipeline(), trim_memory=False).state.trimmer is None


def test_serve_command_passes_options_and_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from ragbudget.cli.commands import cli
    from ragbudget.settings import ClientTimeoutSettings, HistorySettings

    made: list[dict[str, Any]] = []
    served: list[dict[str, Any]] = []
    pipe = fake_pipeline()
    monkeypatch.setattr("ragbudget.pipeline.Pipeline", lambda *a, **kw: made.append(kw) or pipe)
    monkeypatch.setattr("ragbudget.server.app.serve", lambda pipe, **kw: served.append(kw))
    monkeypatch.setenv("RAGBUDGET_API_KEY", "env-key")
    result = CliRunner().invoke(
        cli,
        [
            "serve",
            "--port",
            "0",
            "--concurrency",
            "3",
            "--gpu",
            "24GiB",
            "--history-share",
            "0.5",
            "--recent-turns",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert served == [
        {
            "host": "127.0.0.1",
            "port": 0,
            "api_key": "env-key",
            "model_name": None,
            "history": HistorySettings(history_share=0.5, summary_max_tokens=128, recent_turns=1),
            "request_timeout": 300.0,
            "client_timeouts": ClientTimeoutSettings(),
            "expose_plan": False,
        }
    ]
    assert made[0]["memory"].concurrency == 3 and made[0]["memory"].gpu == "24GiB"
    result = CliRunner().invoke(cli, ["serve", "--port", "0", "--expose-plan"])
    assert result.exit_code == 0, result.output
    assert served[-1]["expose_plan"] is True
    limits = ["--max-messages", "64", "--max-history-chars", "10000", "--request-timeout", "45"]
    result = CliRunner().invoke(cli, ["serve", "--port", "0", *limits])
    assert result.exit_code == 0, result.output
    assert served[-1]["history"] == HistorySettings(max_messages=64, max_history_chars=10_000)
    assert served[-1]["request_timeout"] == 45
    result = CliRunner().invoke(cli, ["serve", "--port", "0", "--max-messages", "0"])
    assert result.exit_code == 2
    result = CliRunner().invoke(cli, ["serve", "--port", "70000"])
    assert result.exit_code == 2


# --- the real default models (slow) ----------------------------------------------------------------


@pytest.mark.model
def test_real_models_through_the_openai_client(tmp_path: Path, repo_data: Path) -> None:
    from ragbudget.pipeline import Pipeline

    index_dir = tmp_path / "idx"
    Pipeline(index_dir).index([repo_data / "manpages"])  # packaged MiniLM; a small corpus
    pipe = Pipeline(index_dir, gpu="651MiB", max_new_tokens=8)  # short CPU prefills
    with running(pipe) as url:
        models = [m.id for m in client(url).models.list()]
        resp = client(url).chat.completions.create(
            model="ragbudget", messages=[{"role": "user", "content": "Which system call creates a pipe?"}], max_tokens=8
        )
        chunks = list(
            client(url).chat.completions.create(
                # A question the two man pages answer (dup2's is not among them: it is declined).
                model=models[0],
                messages=[{"role": "user", "content": "What does close do?"}],
                stream=True,
                max_tokens=8,
            )
        )
        metrics = httpx.get(url + "/metrics").text
    assert "SmolLM2" in models[0]
    assert resp.choices[0].message.content and (resp.model_extra or {})["sources"]
    assert resp.usage is not None and 0 < resp.usage.completion_tokens <= 8
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and (chunks[-1].model_extra or {})["sources"]
    assert 'ragbudget_requests_total{endpoint="/v1/chat/completions",status="200"} 2' in metrics
    assert pipe.admission.stats().admitted_tokens == 0
    # Sampling and stop strings reach SmolLM2 through the same path.
    with running(pipe) as url:
        c = client(url)
        ask = [{"role": "user", "content": "What does the pipe system call return?"}]

        def answer(**options: Any) -> Any:
            return c.chat.completions.create(model="ragbudget", messages=ask, max_tokens=8, **options).choices[0]

        greedy = answer().message.content or ""
        words = greedy.split()
        assert len(words) >= 3, greedy
        stop = " " + words[2]
        cut = answer(stop=[stop])
        assert cut.finish_reason == "stop" and cut.message.content == greedy[: greedy.index(stop)].strip()
        sampled = answer(temperature=1.0, seed=11).message.content
        assert sampled == answer(temperature=1.0, seed=11).message.content


@pytest.mark.model
def test_a_burst_on_the_real_model_gets_200_or_429_and_honoured_retries_get_in(tmp_path: Path, repo_data: Path) -> None:
    """Issue #14 with the packaged SmolLM2 and MiniLM, the real AdmissionController and its
    measured speed: 8 streamed clients at once against a 2 s queue time-out. Every first answer
    is a 200 or a 429 with Retry-After, and each client that sleeps its Retry-After and asks once
    more with the same body gets its 200."""
    from ragbudget.pipeline import Pipeline

    index_dir = tmp_path / "idx"
    Pipeline(index_dir).index([repo_data / "manpages"])
    pipe = Pipeline(index_dir, gpu="651MiB", max_new_tokens=8, queue_timeout=2.0)
    pipe.generator.warm_up()  # as `serve` does before listening: the model, then admission
    pipe.admission_note()  # sized from the loaded model's plan and its measured speed
    assert pipe.admission.throughput is not None  # the time rule is on
    questions = [
        "Which system call creates a pipe?",
        "What does dup2 do?",
        "What does close return?",
        "What is a file descriptor?",
    ]
    bodies = [
        {
            "model": "ragbudget",
            "stream": True,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": questions[i % 4] + f" ({i})"}],
        }
        for i in range(8)
    ]
    with running(pipe) as url:
        rows = burst_with_one_retry(url, bodies, timeout=600)
        metrics = httpx.get(url + "/metrics").text
    assert len(rows) == 8 and all(first in (200, 429) for first, _, _ in rows), rows
    refused = [row for row in rows if row[0] == 429]
    assert all(retry is not None and int(retry) >= 1 for _, retry, _ in refused), rows
    assert [second for _, _, second in refused] == [200] * len(refused), rows
    assert 'status="5' not in metrics and pipe.admission.stats().admitted_tokens == 0


def test_max_tokens_past_the_planned_output_is_400_not_clamped() -> None:
    # One rule, as on the CLI and on OpenAI: a value past the limit is an error naming both.
    pipe = fake_pipeline(words=50, max_new_tokens=3)  # what the server planned for
    with running(pipe) as url:
        for name in ("max_tokens", "max_completion_tokens"):
            for value in (4, 1_000_000_000):
                with pytest.raises(openai.BadRequestError) as err:
                    client(url).chat.completions.create(model=MODEL, messages=user(), **{name: value})
                assert err.value.param == name
                assert str(value) in err.value.message and "at most 3" in err.value.message
        resp = client(url).chat.completions.create(model=MODEL, messages=user(), max_tokens=3)
        resp2 = client(url).chat.completions.create(model=MODEL, messages=user(), max_tokens=2)
    assert [c["max_new_tokens"] for c in fake(pipe).calls] == [3, 2]
    assert resp.usage is not None and resp.usage.completion_tokens == 3
    assert resp2.choices[0].finish_reason == "length"


def test_full_queue_is_refused_before_any_retrieval_work() -> None:
    pipe = fake_pipeline(slots=1, words=2000, token_delay=0.02, max_queue=1, timeout=30)
    with running(pipe) as url:
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json={"model": MODEL, "messages": user("runs"), "stream": True}
        ) as first:
            lines = first.iter_lines()
            next(lines)  # running

            def wait_in_queue() -> None:
                # Admitted once "runs" is cancelled, then cut short when the server stops.
                with contextlib.suppress(httpx.HTTPError):
                    httpx.post(
                        url + "/v1/chat/completions", json={"model": MODEL, "messages": user("waits")}, timeout=5
                    )

            waiting = threading.Thread(target=wait_in_queue)
            waiting.start()
            assert _wait_until(lambda: pipe.admission.stats().queued == 1)
            n_counts = fake(pipe).counted
            r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user("refused")})
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert fake(pipe).counted == n_counts  # refused before its prompt was even measured
        waiting.join(timeout=30)


def test_a_request_whose_first_token_would_miss_the_timeout_is_429_before_retrieval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the controller saturated for time, the 429 (with a bounded Retry-After) comes back
    before retrieval and prompt building, which on a loaded host take longer than the answer."""
    from ragbudget.memory.admission import Throughput

    pipe = fake_pipeline(timeout=5.0, index_dir=corpus_index("hash:256"))
    ctl = pipe.admission  # the real controller; a measured speed: 1 ms/prompt token, 1 s/token
    ctl.configure(throughput=Throughput(prefill_a=0.001, decode_s=1.0), ttft_target=1.0)
    searched: list[str] = []
    search = pipe.store.search  # the opened index ask() retrieves from
    monkeypatch.setattr(pipe.store, "search", lambda q, **kw: searched.append(q) or search(q, **kw))
    # One running request with ~14 s of work left: a 3,840-token prompt (the 4,096 window less
    # 256 of answer) cannot start next to it within the 1 s target, nor get its first token
    # within 5 s after it.
    seen = ctl.acquire(4096, prompt_tokens=4086)  # an answer that used its whole 10 tokens: the
    seen.finish(new_tokens=10)  # Retry-After then prices answers whole (Learning.expected_new_tokens)
    seen.release()
    held = ctl.acquire(4096, prompt_tokens=4086)
    with running(pipe) as url:
        n_counts, t0 = fake(pipe).counted, time.perf_counter()
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user()})
        assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
        # ~14 s of work ahead, less the 5 s time-out: told to come back when it is done.
        assert 5 <= int(r.headers["retry-after"]) <= 14
        assert "past the queue time-out" in r.json()["error"]["message"]
        assert r.json()["error"]["message"].endswith(f"; retry after {r.headers['retry-after']} s")
        assert searched == [] and fake(pipe).counted == n_counts  # no retrieval, no counting
        assert ctl.stats().refused_for_time_total == 1  # counted, its return promised
        again = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user()})
        # The next refused client is sent back after the first one, not at the same second.
        assert int(again.headers["retry-after"]) > int(r.headers["retry-after"])
        assert "ragbudget_refused_before_retrieval_total 2" in httpx.get(url + "/metrics").text
        held.release()  # the host is free: the same request runs
        ok = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user()}, timeout=30)
        assert ok.status_code == 200 and len(searched) == 1, ok.text  # promises never block
        assert time.perf_counter() - t0 < 30


# --- never a 5xx for a client's doing, never healthy when it cannot serve (issue #19) ---------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("functions", [{"name": "f"}]),
        ("function_call", {"name": "f"}),
        ("logprobs", True),
        ("top_logprobs", 3),
        ("response_format", {"type": "json_object"}),
        ("logit_bias", {"50256": -100}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("reasoning_effort", "high"),
        ("not_an_openai_field", 1),
    ],
)
def test_fields_ragbudget_would_ignore_are_400_naming_them(field: str, value: Any) -> None:
    pipe = fake_pipeline()
    with running(pipe) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user(), field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]
    assert err["code"] in ("unsupported_parameter", "unknown_parameter")
    assert fake(pipe).calls == []


def test_default_values_of_unsupported_fields_pass() -> None:
    pipe = fake_pipeline()
    with running(pipe) as url:
        resp = client(url).chat.completions.create(
            model=MODEL,
            messages=user(),
            n=1,
            logprobs=False,
            response_format={"type": "text"},
            presence_penalty=0,
            frequency_penalty=0.0,
            tool_choice="none",
            user="u-1",
            store=False,
            logit_bias={},
            metadata={"run": "1"},
        )
        raw = httpx.post(
            url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": user(),
                "tools": [],
                "top_logprobs": 0,
                "parallel_tool_calls": False,
                "functions": None,
                "audio": None,
            },
        )
        bad = httpx.post(url + "/v1/retrieve", json={"query": "footers", "top_k": 3})
    assert resp.choices[0].message.content and raw.status_code == 200, raw.text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k"
    assert len(fake(pipe).calls) == 2


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/retrieve"])
def test_deeply_nested_json_is_400_not_a_recursion_error(endpoint: str) -> None:
    pipe = fake_pipeline()
    deep = b"[" * 50_000 + b"]" * 50_000
    deep_obj = b'{"a":' * 50_000 + b"1" + b"}" * 50_000
    nested = {"model": MODEL, "messages": user(), "metadata": {}}
    inner = nested["metadata"]
    for _ in range(40):  # valid JSON, well under the interpreter's limit, over the server's
        inner["x"] = {}
        inner = inner["x"]
    with running(pipe) as url:
        responses = [
            httpx.post(url + endpoint, content=body, headers={"content-type": "application/json"})
            for body in (deep, deep_obj, json.dumps(nested).encode())
        ]
        metrics = httpx.get(url + "/metrics").text
    for r in responses:
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["code"] == "invalid_json" and "nested too deep" in err["message"] and "32" in err["message"]
    assert 'status="500"' not in metrics
    assert fake(pipe).calls == []


class _Records(logging.Handler):
    """Collects log records of the server (ragbudget) and of uvicorn, tracebacks included."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @contextlib.contextmanager
    def attached(self) -> Iterator[_Records]:
        # After uvicorn configured its loggers (its dictConfig drops the handlers they had).
        loggers = [logging.getLogger(n) for n in ("ragbudget", "uvicorn", "uvicorn.error", "uvicorn.access")]
        for lg in loggers:
            lg.addHandler(self)
        try:
            yield self
        finally:
            for lg in loggers:
                lg.removeHandler(self)


def _send_raw(url: str, data: bytes) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(data)
    # closed: the server's next receive() is an http.disconnect


def test_short_body_then_disconnect_is_499_without_traceback() -> None:
    pipe = fake_pipeline()
    body = json.dumps({"model": MODEL, "messages": user()}).encode()
    with running(pipe) as url, _Records().attached() as log:
        for endpoint in ("/v1/chat/completions", "/v1/retrieve"):
            _send_raw(
                url,
                f"POST {endpoint} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body) + 500}\r\n\r\n".encode()
                + body[:20],
            )

        def counted() -> bool:
            text = httpx.get(url + "/metrics").text
            return all(
                f'ragbudget_requests_total{{endpoint="{e}",status="499"}} 1' in text
                for e in ("/v1/chat/completions", "/v1/retrieve")
            )

        assert _wait_until(counted), httpx.get(url + "/metrics").text
        metrics = httpx.get(url + "/metrics").text
        ok = client(url).chat.completions.create(model=MODEL, messages=user())  # the server carries on
    assert 'status="500"' not in metrics
    assert "ragbudget_cancelled_total 2" in metrics
    tracebacks = [r.getMessage() for r in log.records if r.exc_info or r.levelno >= logging.ERROR]
    assert tracebacks == []
    assert ok.choices[0].message.content and len(fake(pipe).calls) == 1


def test_every_client_caused_failure_maps_to_4xx_or_499() -> None:
    from starlette.requests import ClientDisconnect

    from ragbudget.errors import (
        ConfigError,
        IndexCorruptError,
        IndexNotFoundError,
        ModelError,
        RagBudgetError,
        RequestCancelled,
    )
    from ragbudget.server.openai_api import APIError, error_from_exception

    client_faults = {
        ConfigError("context_tokens must be >= 1"): 400,
        BudgetError("x on RTX 4090: needs 30.00 GiB but 21.60 GiB is usable", needed=9000, available=2048): 400,
        BudgetError("weights need 9 GiB", needed=9 << 30, available=1 << 30, unit="bytes"): 400,
        OverloadedError("queue full", retry_after=1.0): 429,
        RequestCancelled("left the queue"): 499,
        ClientDisconnect(): 499,
        APIError(413, "too large"): 413,
    }
    for exc, status in client_faults.items():
        err = error_from_exception(exc)
        assert err.status == status, (exc, err.status)
        assert "GiB" not in err.message and "RTX" not in err.message
    assert "9000" in error_from_exception(BudgetError("a", needed=9000, available=2048)).message
    assert "GiB" in error_from_exception(BudgetError("9 GiB", needed=1, available=0), expose_plan=True).message
    # Only the server's own faults are 5xx, and their text (paths) stays in the server's log.
    server_faults = {
        IndexNotFoundError("no index in /srv/private/idx"): 503,
        IndexCorruptError("index file /srv/private/idx/x.faiss is truncated"): 503,
        ModelError("cannot load /srv/private/model"): 503,
        RagBudgetError("odd /srv/private"): 500,
        RuntimeError("/srv/private"): 500,
    }
    for exc, status in server_faults.items():
        err = error_from_exception(exc)
        assert err.status == status and err.type == "server_error" and "/srv" not in err.message
    assert "/srv" not in error_from_exception(ConfigError("bad file /srv/private/x.md")).message


def test_health_and_requests_are_503_while_the_index_is_unavailable(tmp_path: Path) -> None:
    from ragbudget.errors import IndexCorruptError

    index_dir = tmp_path / "private" / "idx"
    shutil.copytree(corpus_index(), index_dir)
    pipe = fake_pipeline(index_dir=index_dir)
    with running(pipe) as url:
        assert httpx.get(url + "/health").json()["status"] == "ok"
        index_dir.rename(tmp_path / "gone")  # someone moved the index folder away
        health = httpx.get(url + "/health")
        chat = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user()})
        retrieve = httpx.post(url + "/v1/retrieve", json={"query": "footers"})
        (tmp_path / "gone").rename(index_dir)
        assert httpx.get(url + "/health").status_code == 200
        # Damage met by a request (not by the probe): 503, and /health unready until one succeeds.
        fake(pipe).fail = IndexCorruptError("index file /srv/private/idx/a.faiss fails its checksum")
        broken = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user()})
        unready = httpx.get(url + "/health")
        fake(pipe).fail = None
        fixed = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user()})
        ready = httpx.get(url + "/health")
        metrics = httpx.get(url + "/metrics").text
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    for r in (chat, retrieve, broken):
        assert r.status_code == 503 and r.json()["error"]["code"] == "index_unavailable", r.text
    assert unready.status_code == 503 and fixed.status_code == 200 and ready.json()["status"] == "ok"
    for r in (health, chat, retrieve, broken, unready):
        assert "/srv" not in r.text and str(tmp_path) not in r.text
    assert 'endpoint="/v1/chat/completions",status="500"' not in metrics


def test_a_pipeline_without_an_index_is_not_healthy(tmp_path: Path) -> None:
    from ragbudget.pipeline import Pipeline

    pipe = Pipeline(tmp_path / "none", generator=GeneratorStub(), gpu="16GiB")  # type: ignore[arg-type]
    with running(pipe) as url:  # type: ignore[arg-type]
        health = httpx.get(url + "/health")
        chat = httpx.post(url + "/v1/chat/completions", json={"model": "ragbudget", "messages": user()})
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "index_unavailable"
    assert str(tmp_path) not in health.text + chat.text


def _cli(*args: str) -> Any:
    from click.testing import CliRunner

    from ragbudget.cli.commands import cli

    return CliRunner().invoke(cli, list(args))


def test_serve_refuses_to_start_without_a_usable_index(tmp_path: Path) -> None:
    missing = _cli("serve", "--index-dir", str(tmp_path / "nonexistent"), "--port", "0")
    damaged_dir = tmp_path / "damaged"
    damaged_dir.mkdir()
    (damaged_dir / "manifest.json").write_text("{not json")
    damaged = _cli("serve", "--index-dir", str(damaged_dir), "--port", "0")
    for result in (missing, damaged):
        assert result.exit_code == 1, result.output
        assert result.output.startswith("Error: ") and result.output.count("\n") == 1, result.output
        assert "Traceback" not in result.output
    assert "no index in" in missing.output and "unreadable" in damaged.output


def test_serve_on_a_port_in_use_exits_1_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from ragbudget.errors import ConfigError
    from ragbudget.server.app import serve

    pipe = fake_pipeline()
    monkeypatch.setattr("ragbudget.pipeline.Pipeline", lambda *a, **kw: pipe)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _cli("serve", "--port", str(port))
        with pytest.raises(ConfigError, match="in use"):
            serve(pipe, port=port)
    assert result.exit_code == 1, result.output
    assert result.output == f"Error: port {port} on 127.0.0.1 is in use; pass --port or stop the other server\n"


# A real index built under tmp_path, a real Pipeline (model-free generator): what clients see.

_HOST_FIGURES = (
    "gpu_bytes",
    "usable_bytes",
    "free_bytes",
    "weights_bytes",
    "gpu_name",
    "GiB",
    "kv_capacity_tokens",
    "kv_bytes_per_token",
)


@pytest.fixture(scope="module")
def tmp_index(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from ragbudget.pipeline import Pipeline

    root = tmp_path_factory.mktemp("private-home")
    docs = root / "docs" / "guides"
    docs.mkdir(parents=True)
    (docs / "guide.md").write_text("# Guide\n\nThe page footer of the guide is removed by the cleaner. " * 20)
    (docs / "leader.md").write_text("# Leader\n\nThe Project Leader is elected every year by the developers. " * 20)
    Pipeline(root / "idx", embedder="hash:256").index([root / "docs"])
    return root, root / "idx"


def _real_pipeline(index_dir: Path) -> Any:
    from types import SimpleNamespace

    from ragbudget.pipeline import Pipeline

    gen = FakeGenerator(answer="Elected [1].")
    gen.model_ref = SimpleNamespace(id="fake/generator")  # type: ignore[attr-defined]  # what the server names
    return Pipeline(index_dir, generator=gen, gpu="16GiB", max_new_tokens=32)  # type: ignore[arg-type]


def _bodies(url: str) -> list[str]:
    ask = {"model": "ragbudget", "messages": [{"role": "user", "content": "Who elects the Project Leader?"}]}
    too_long = {"model": "ragbudget", "messages": user("word " * 12_000)}
    with httpx.stream("POST", url + "/v1/chat/completions", json={**ask, "stream": True}) as streamed:
        stream_text = streamed.read().decode()
    responses = [
        httpx.post(url + "/v1/chat/completions", json=ask),
        httpx.post(url + "/v1/retrieve", json={"query": "page footer", "context_tokens": 200}),
        httpx.post(url + "/v1/retrieve", json={"query": "page footer", "k": 3}),
        httpx.get(url + "/health"),
        httpx.post(url + "/v1/chat/completions", json=too_long),
    ]
    assert [r.status_code for r in responses] == [200, 200, 200, 200, 400], [r.text[:200] for r in responses]
    assert "Elected" in responses[0].text and "guide.md" in responses[1].text
    return [stream_text, *(r.text for r in responses)]


def test_responses_carry_no_private_path_nor_host_memory_figures(tmp_index: tuple[Path, Path]) -> None:
    root, index_dir = tmp_index
    with running(_real_pipeline(index_dir)) as url:
        bodies = _bodies(url)
        answer = httpx.post(url + "/v1/chat/completions", json={"model": "ragbudget", "messages": user()}).json()
    for body in bodies:
        assert str(root) not in body and "private-home" not in body
        for figure in _HOST_FIGURES:
            assert figure not in body, (figure, body[:300])
    assert answer["ragbudget"]["budget"]["prompt_tokens"] > 0 and "plan" not in answer["ragbudget"]
    assert all(not Path(src["path"]).is_absolute() for src in answer["sources"])


def test_expose_plan_sends_the_memory_plan_but_still_no_private_path(tmp_index: tuple[Path, Path]) -> None:
    root, index_dir = tmp_index
    with running(_real_pipeline(index_dir), expose_plan=True) as url:
        bodies = _bodies(url)
        answer = httpx.post(url + "/v1/chat/completions", json={"model": "ragbudget", "messages": user()}).json()
    assert all(str(root) not in body for body in bodies)
    assert answer["ragbudget"]["plan"]["gpu_bytes"] > 0 and "kv_bytes_per_token" in answer["ragbudget"]["budget"]
    # The budget error as the library words it (it names the binding limit: here the model's
    # window), not the server's token-only rewording.
    assert "window" in bodies[-1] and "this server allows" not in bodies[-1]


_SERVE_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[3])
from _fakes import FakeBackend
from ragbudget.pipeline import Pipeline
from ragbudget.server.app import serve

serve(Pipeline(sys.argv[2], backend=FakeBackend(), max_new_tokens=8), port=int(sys.argv[1]),
      log_level="warning", malloc_arenas=None)
"""


def test_serve_listens_on_the_socket_it_bound_and_stops_on_sigint() -> None:
    import os
    import subprocess

    with socket.socket() as probe:  # a free port (tiny race with other processes; loopback only)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE_SCRIPT, str(port), str(corpus_index()), str(Path(__file__).parent)],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return proc.poll() is not None  # stop waiting if it died

        assert _wait_until(up, timeout=30) and proc.poll() is None, proc.communicate(timeout=5)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [MODEL, "ragbudget"]
    finally:
        err = stop_server(proc)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


# --- a burst larger than the capacity (issue #13) ----------------------------------------------------


def test_a_burst_past_capacity_gets_200_or_429_with_retry_after_and_retrying_clients_get_in() -> None:
    """Admission holds 2 requests and queues 1; 8 clients at once, each answer ~0.3 s. Every
    response is a 200 or a 429 with Retry-After, and a client that waits what Retry-After says
    and asks again gets its 200. The index's embedder is the model-free hash one: with MiniLM,
    embedding 8 queries on two busy cores takes longer than the answers, and the requests would
    reach admission one by one."""
    pipe = fake_pipeline(
        slots=2, max_queue=1, timeout=30, words=6, token_delay=0.05, index_dir=corpus_index("hash:256")
    )
    assert pipe.admission.capacity_tokens == 2 * WINDOW  # the real controller, sized from the backend
    first: list[httpx.Response] = []
    attempts: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def one_client(url: str) -> None:
        start.wait()
        body = {"model": MODEL, "messages": user()}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        with lock:
            first.append(r)
        tries = 1
        while r.status_code == 429 and tries < 6:
            time.sleep(int(r.headers["retry-after"]))  # as the header says: whole seconds
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
            tries += 1
        assert r.status_code == 200, r.text
        with lock:
            attempts.append(tries)

    with running(pipe) as url:
        clients = [threading.Thread(target=one_client, args=(url,)) for _ in range(8)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(timeout=60)
        metrics = httpx.get(url + "/metrics").text
    statuses = sorted(r.status_code for r in first)
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= 3  # two ran at once, one waited its turn in the queue
    for r in first:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "overloaded"
    assert len(attempts) == 8 and max(attempts) > 1  # every client got in, some after waiting
    assert fake(pipe).peak_running <= 2 and reserved(pipe) == 0
    assert 'status="5' not in metrics


def test_a_client_that_honours_retry_after_once_gets_its_200_on_a_host_slower_than_measured() -> None:
    """Issue #14's contract with the real controller and its time model: the model was measured
    faster than the host really runs (each answer takes about twice what it says), so a client
    sent back "when there will be room" finds none yet. A client that waits exactly its
    Retry-After and asks ONCE more with the same body still gets its 200: the server knows the
    body it refused and keeps that client's place (it queues, and may wait past the time-out)."""
    from ragbudget.memory.admission import Throughput

    pipe = fake_pipeline(
        slots=2, max_queue=16, timeout=1.0, words=10, token_delay=0.1, index_dir=corpus_index("hash:256")
    )
    # Modelled: ~0.5 s a request alone (a ~300-token prefill 0.15 s, its 700 answer tokens
    # reserved at 0.5 ms); really ~1 s (10 words 0.1 s apart).
    pipe.admission.configure(throughput=Throughput(prefill_a=0.0005, decode_s=0.0005))
    bodies = [{"model": MODEL, "messages": user(f"How is the KV cache budget computed? ({i})")} for i in range(8)]
    with running(pipe) as url:
        rows = burst_with_one_retry(url, bodies, timeout=60)
        metrics = httpx.get(url + "/metrics").text
    assert len(rows) == 8
    refused = [row for row in rows if row[0] == 429]
    assert refused, rows  # the burst was larger than the time allows: some were sent back
    assert all(row[0] in (200, 429) for row in rows), rows
    assert all(retry is not None and int(retry) >= 1 for _, retry, _ in refused), rows
    assert [second for _, _, second in refused] == [200] * len(refused), rows
    assert fake(pipe).peak_running <= 2 and reserved(pipe) == 0
    assert 'status="5' not in metrics


def test_a_streamed_return_that_claimed_its_place_starts_at_once_and_is_kept_alive() -> None:
    """A client back at its Retry-After while the work ahead is still running (the host was
    slower than measured): its stream answers 200 at once and sends SSE comments while it waits
    for its turn, then the answer — where a non-keyed wait would hit the time-out and a 429."""
    from ragbudget.memory.admission import Throughput

    pipe = fake_pipeline(slots=2, max_queue=4, timeout=0.5, words=3, index_dir=corpus_index("hash:256"))
    ctl = pipe.admission
    ctl.configure(throughput=Throughput(prefill_a=0.0005, decode_s=0.0005))
    held = ctl.acquire(2 * WINDOW, prompt_tokens=2 * WINDOW - 1)  # the whole cache, ~1 s of work
    body = {"model": MODEL, "messages": user(), "stream": True}
    with running(pipe, keepalive_s=0.2) as url:
        first = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert first.status_code == 429, first.text
        time.sleep(int(first.headers["retry-after"]))
        lines: list[str] = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200  # while the cache is still held: its place is kept
            for line in r.iter_lines():
                lines.append(line)
                if sum(1 for x in lines if x.startswith(":")) == 3:
                    held.release()  # the work ahead ends: its turn comes
        metrics = httpx.get(url + "/metrics").text
    lines = [x for x in lines if x]
    comments = [x for x in lines if x.startswith(":")]
    assert len(comments) >= 3 and lines[-1] == "data: [DONE]"
    assert "word0" in "".join(lines) and reserved(pipe) == 0
    assert 'status="5' not in metrics


def test_the_same_body_from_another_client_does_not_take_a_returning_clients_place() -> None:
    """Byte-identical requests from two callers (a canned question): the promise made to the
    one refused is claimed by it coming back, not by the other arriving at that moment."""
    from ragbudget.memory.admission import Throughput

    pipe = fake_pipeline(slots=2, max_queue=4, timeout=0.5, words=3, index_dir=corpus_index("hash:256"))
    ctl = pipe.admission
    ctl.configure(throughput=Throughput(prefill_a=0.0005, decode_s=0.0005))
    held = ctl.acquire(2 * WINDOW, prompt_tokens=2 * WINDOW - 1)  # the whole cache
    body = {"model": MODEL, "messages": user()}
    # Another caller: the same loopback server reached from another local address.
    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=10)
    with running(pipe) as url, other:
        first = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert first.status_code == 429, first.text
        time.sleep(int(first.headers["retry-after"]))
        newcomer = other.post(url + "/v1/chat/completions", json=body)
        assert newcomer.status_code == 429, newcomer.text  # judged afresh: the work still runs
        threading.Timer(0.5, held.release).start()
        back = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert back.status_code == 200, back.text  # its place was kept for it
    assert reserved(pipe) == 0


# --- `serve --engine`: admission from the engine's own queue and free KV ------------------------------


def _engine_app(srv: Any, tmp_path: Path, **app: Any) -> Any:
    """A test client of the app over the replayed engine ``srv``; ``app``: create_app's keywords
    (``engine_recheck_s=0`` looks at the engine afresh for every request: no test waits a timer)."""
    from fastapi.testclient import TestClient

    index_dir = tmp_path / "idx"
    if not index_dir.exists():  # a second app over the same engine shares the first one's copy
        shutil.copytree(corpus_index(), index_dir)  # the engine's token counts are cached in it
    kw = {"engine_context_tokens": 2048} if srv.kind == "openai" else {}
    return TestClient(create_app(Pipeline(index_dir, engine=srv.url, max_new_tokens=32, **kw), **app))


def _ask(client: Any) -> Any:
    return client.post("/v1/chat/completions", json={"model": "ragbudget", "messages": user()})


@pytest.mark.parametrize(
    ("kind", "options", "why"),
    [
        ("vllm", {}, "1 request(s) waiting"),  # the replay's vllm:num_requests_waiting is 1
        ("llamacpp", {"busy_slots": 4}, "0 free KV tokens"),  # every slot is processing
    ],
)
def test_engine_with_a_queue_or_no_free_kv_is_429_before_any_work(
    tmp_path: Path, kind: str, options: dict[str, Any], why: str
) -> None:
    """The engine's own figures say it is saturated: 429 with Retry-After, naming the engine —
    load, as this server's own full queue is, not the 5xx of an engine that is down."""
    from _replay import Replay

    with Replay(kind, **options) as srv, _engine_app(srv, tmp_path) as client:
        r = _ask(client)
        metrics = client.get("/metrics").text
        health = client.get("/health").json()
        sent = srv.calls("POST", "/v1/chat/completions")
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "engine_overloaded"
    assert why in r.json()["error"]["message"] and f"the {kind} engine at {srv.url}" in r.json()["error"]["message"]
    assert r.json()["error"]["engine"] == {"url": srv.url, "kind": kind, "cause": "saturated"}
    assert sent == []  # nothing reached the engine
    assert "ragbudget_engine_admission_open 0" in metrics
    assert health["engine_load"]["open"] is False and health["engine_load"]["sources"]


def test_engine_with_room_admits_and_figures_are_reread_once_engine_recheck_s_has_passed(tmp_path: Path) -> None:
    """The engine's figures are read at most every ``engine_recheck_s``: within it a request takes
    the last reading (an engine filling up meanwhile is not seen, and not asked again); past it
    (0 here: always) they are read afresh and a full engine refuses the next request."""
    from _replay import Replay, Resp

    with Replay("vllm") as srv:
        idle = (
            srv.engine.metrics()
            .replace("vllm:num_requests_waiting{", "x{")
            .replace(
                "# TYPE vllm:num_requests_waiting gauge",
                '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 0.0',
            )
        )
        # The engine fills up (another client) after a first request.
        full = idle.replace(
            'vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.25',
            'vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 1.0',
        )
        assert full != idle
        answered = {}
        for recheck in (3600.0, 0.0):
            srv.routes[("GET", "/metrics")] = lambda b: Resp(text=idle, content_type="text/plain")
            with _engine_app(srv, tmp_path, engine_recheck_s=recheck) as client:
                ok = _ask(client)
                metrics = client.get("/metrics").text
                srv.routes[("GET", "/metrics")] = lambda b: Resp(text=full, content_type="text/plain")
                read = len(srv.calls("GET", "/metrics"))
                answered[recheck] = (ok, metrics, _ask(client), len(srv.calls("GET", "/metrics")) - read)
    for ok, metrics, _, _ in answered.values():
        assert ok.status_code == 200, ok.text
        assert "ragbudget_engine_waiting_requests 0" in metrics and "ragbudget_engine_kv_free_tokens 75000" in metrics
    _, _, within, read_within = answered[3600.0]
    assert within.status_code == 200 and read_within == 0  # the last reading, the engine not asked
    _, _, refused, read_past = answered[0.0]
    assert refused.status_code == 429 and "0 free KV tokens" in refused.json()["error"]["message"]
    assert read_past >= 1


def test_engine_recheck_s_must_be_a_non_negative_number(tmp_path: Path) -> None:
    from ragbudget.errors import ConfigError

    pipe = Pipeline(corpus_index(), engine="http://127.0.0.1:9", max_new_tokens=32)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match=r"engine_recheck_s must be >= 0 seconds \(0: every request\), got"):
            create_app(pipe, engine_recheck_s=bad)


def test_engine_without_metrics_admits_and_says_admission_is_open(tmp_path: Path) -> None:
    from _replay import Replay

    with Replay("openai") as srv, _engine_app(srv, tmp_path) as client:
        r = _ask(client)
        metrics = client.get("/metrics").text
        health = client.get("/health").json()
    assert r.status_code == 200, r.text
    assert "ragbudget_engine_admission_open 1" in metrics
    assert "ragbudget_engine_waiting_requests" not in metrics
    assert health["engine_load"]["open"] is True and health["engine_load"]["note"].startswith("open")


# --- `serve --engine`: the engine's trouble answered as a gateway answers it ---------------------


def test_an_engine_that_dies_is_502_or_503_health_503_then_back_when_it_returns(tmp_path: Path) -> None:
    """The engine is killed between requests: the request that finds it gone is a 502 (or, when
    the server's look at the engine came first, a 503), never a 500; /health is 503 and names the
    engine and the cause; requests meanwhile are 503 with Retry-After before any work. Brought
    back on its port, the engine is used again at the server's next look at it (every request here:
    ``engine_recheck_s=0``), with nothing restarted here."""
    from _replay import Replay

    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(Replay("llamacpp"))
        client = stack.enter_context(_engine_app(srv, tmp_path, engine_recheck_s=0))
        assert _ask(client).status_code == 200
        health_up = client.get("/health")
        srv.kill()
        first = _ask(client)
        health_down = client.get("/health")
        metrics_down = client.get("/metrics").text
        sent = len(srv.log)
        second = _ask(client)
        assert len(srv.log) == sent  # refused before any work: nothing tried the engine
        stack.enter_context(Replay("llamacpp", port=srv.port))
        health_back = client.get("/health")
        back = _ask(client)
    assert health_up.status_code == 200 and health_up.json()["engine"] == {
        "kind": "llamacpp",
        "url": srv.url,
        "status": "ok",
    }
    assert first.status_code in (502, 503), first.text
    assert first.json()["error"]["code"] in ("engine_unreachable", "engine_unavailable")
    assert first.json()["error"]["engine"]["url"].startswith(srv.url)
    assert health_down.status_code == 503 and health_down.json()["status"] == "unavailable"
    engine = health_down.json()["engine"]
    assert engine["status"] == "unavailable" and engine["cause"] in ("refused", "dropped")
    assert f"the llamacpp engine at {srv.url}" in health_down.json()["error"]
    assert "ragbudget_engine_up 0" in metrics_down
    assert second.status_code == 503 and second.json()["error"]["code"] == "engine_unavailable"
    assert int(second.headers["retry-after"]) >= 1
    assert health_back.status_code == 200 and health_back.json()["engine"]["status"] == "ok"
    assert back.status_code == 200, back.text


def test_an_engine_time_out_is_504_and_does_not_take_the_engine_out(tmp_path: Path) -> None:
    """An answer past the engine time-out is a 504 naming the engine and the seconds; one slow
    answer says nothing about the next, so /health stays ok."""
    import shutil

    from _replay import Replay, Resp
    from fastapi.testclient import TestClient

    index_dir = tmp_path / "idx"
    shutil.copytree(corpus_index(), index_dir)
    with Replay("llamacpp") as srv:
        pipe = Pipeline(index_dir, engine=srv.url, max_new_tokens=32, engine_timeout=1.5)
        with TestClient(create_app(pipe)) as client:
            srv.push("POST", "/v1/chat/completions", Resp(delay=4.0, json={}))
            r = _ask(client)
            health = client.get("/health")
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "engine_timeout" and "gave no answer within 1.5 s" in err["message"]
    assert err["engine"] == {"url": f"{srv.url}/v1/chat/completions", "kind": "llamacpp", "cause": "timeout"}
    assert health.status_code == 200 and health.json()["engine"]["status"] == "ok"


def test_on_an_engine_admission_refuses_for_time_at_its_measured_speed_with_one_figure(tmp_path: Path) -> None:
    """Issue #42 §5: on a CPU engine, admission knew nothing of its speed — the admitted
    requests took 88 s against the targets — and the 429s' Retry-After disagreed with their
    text. The engine's answers now give admission its speed (llama.cpp's timings), so a request
    whose first token would come past the queue time-out behind the work on the engine is
    refused at once, before any retrieval, not after waiting out the queue time-out; its
    Retry-After comes from that speed and is the one figure of waiting its message states."""
    import re

    from _replay import Replay
    from fastapi.testclient import TestClient

    from ragbudget.errors import retry_after_seconds

    index_dir = tmp_path / "idx"
    shutil.copytree(corpus_index(), index_dir)
    with Replay("llamacpp", busy_slots=0, prefill_ms=20.0, decode_ms=500.0) as srv:
        pipe = Pipeline(index_dir, engine=srv.url, max_new_tokens=32, queue_timeout=4.0)
        with TestClient(create_app(pipe)) as client:
            assert _ask(client).status_code == 200  # its timings: 20 ms a prompt token, 0.5 s a new one
            ctl = pipe.admission
            assert ctl.throughput is not None and ctl.throughput.decode_s == pytest.approx(0.5)
            assert ctl.throughput.prefill_a == pytest.approx(0.02) and "engine" in ctl.throughput.source
            held = [ctl.acquire(512, prompt_tokens=480) for _ in range(4)]  # the engine's four slots
            try:
                t0 = time.perf_counter()
                r = _ask(client)
                took = time.perf_counter() - t0
            finally:
                for h in held:
                    h.release()
    assert r.status_code == 429, r.text
    assert took < 2.0, took  # not the 4 s of the queue time-out
    message, header = r.json()["error"]["message"], r.headers["retry-after"]
    assert "measured speed" in message and message.endswith(f"; retry after {header} s")
    assert sorted(re.findall(r"(\d+(?:\.\d+)?) s\b", message)) == sorted(["4", header]), message
    assert int(header) == retry_after_seconds(float(header)) >= 10  # the work ahead: 4 × 16 s of answers


def test_early_refusals_price_a_request_at_the_prompts_answered_not_the_whole_window(tmp_path: Path) -> None:
    """The burst of 2026-12-07 (BENCHMARKS, PostgreSQL burst): before its prompt is built, the
    early time check priced each request at the whole window (2,032 of llama-server's 2,048
    tokens) while the prompts the engine evaluated had a median of 114 tokens, so every
    refusal's promise stacked one more whole-window prefill (the rest of that burst's long waits
    came from the slot pricing that test_on_an_engine_of_fixed_slots_... covers). The early
    checks now price a request at the mean prompt answered here: ten refusals in a row are
    spaced by that prompt's prefill."""
    from _replay import Replay
    from fastapi.testclient import TestClient

    index_dir = tmp_path / "idx"
    shutil.copytree(corpus_index(), index_dir)
    with Replay("llamacpp", busy_slots=0, prefill_ms=20.0, decode_ms=1.0) as srv:
        srv.engine.max_len = 4096  # one slot's window: the most one request may hold
        pipe = Pipeline(index_dir, engine=srv.url, max_new_tokens=32, queue_timeout=4.0)
        with TestClient(create_app(pipe)) as client:
            first = _ask(client)
            assert first.status_code == 200, first.text
            answered = first.json()["usage"]["prompt_tokens"]
            ctl = pipe.admission
            most = pipe.admission_estimate(32)[1]
            assert 0 < answered * 4 < most, (answered, most)  # the window is far above a real prompt
            # The engine's four slots held by long requests: 4 x 40 s of modelled prefill ahead.
            held = [ctl.acquire(4096, prompt_tokens=2000) for _ in range(4)]
            try:
                refused = [_ask(client) for _ in range(10)]
            finally:
                for h in held:
                    h.release()
    assert [r.status_code for r in refused] == [429] * 10, [r.text for r in refused]
    message = refused[0].json()["error"]["message"]
    assert f"a {answered}-token prompt (the mean answered here)" in message, message
    waits = [int(r.headers["retry-after"]) for r in refused]
    assert waits == sorted(waits) and waits[0] < waits[-1]  # each sent back behind the one before
    # Behind the held work (4 x ~42 s) each return adds its own prefill: at the mean prompt
    # 20 ms x answered tokens (~2 s); at the window it would be ~80 s each (over 700 s for ten).
    step = (waits[-1] - waits[0]) / 9
    assert step < 0.02 * most / 4, (waits, answered, most)


def test_on_an_engine_of_fixed_slots_a_request_holds_the_slot_and_is_timed_by_its_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's slots: a request holds a whole slot in admission (no more in flight than the
    engine has slots), while the time model prices its decode by the answer it may generate,
    not by the rest of the slot (tests/test_admission.py has the figures)."""
    from _replay import Replay

    index_dir = tmp_path / "idx"
    shutil.copytree(corpus_index(), index_dir)
    with Replay("llamacpp", busy_slots=0) as srv:
        pipe = Pipeline(index_dir, engine=srv.url, max_new_tokens=32)
        ctl = pipe.admission
        calls: list[tuple[int, dict[str, Any]]] = []
        acquire = ctl.acquire
        monkeypatch.setattr(ctl, "acquire", lambda tokens, **kw: calls.append((tokens, kw)) or acquire(tokens, **kw))
        answer = pipe.ask("How is the KV cache budget computed?")
    assert not answer.declined and len(calls) == 1
    tokens, kw = calls[0]
    assert tokens == 512  # the replayed llama-server's slot
    assert kw["new_tokens"] == 32 and kw["prompt_tokens"] == answer.report["budget"]["prompt_tokens"]


def test_a_hung_engine_is_504_with_cause_timeout_not_503(tmp_path: Path) -> None:
    """Issue #42 §5: an engine that is up but gives no answer (a frozen process) was answered 503
    ``cause: timeout`` once the server's look at it had timed out, while the docs said 504. It is
    a 504 ``engine_timeout`` whichever way the time-out is met — the request's own call, or the
    look before any work — and /health is 503 naming the cause (a load balancer takes it out)."""
    from _replay import Replay, Resp

    index_dir = tmp_path / "idx"
    shutil.copytree(corpus_index(), index_dir)
    with Replay("llamacpp") as srv:
        pipe = Pipeline(index_dir, engine=srv.url, max_new_tokens=32, engine_timeout=1.0)
        from fastapi.testclient import TestClient

        with TestClient(create_app(pipe, engine_recheck_s=0)) as client:
            assert _ask(client).status_code == 200
            # Frozen: every look at the engine, and any request, waits past the time-out.
            srv.push("GET", "/props", *[Resp(delay=3.0, json={})] * 4)
            r = _ask(client)
            health = client.get("/health")
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "engine_timeout" and err["engine"]["cause"] == "timeout"
    assert "gave no answer within 1 s" in err["message"]
    assert health.status_code == 503 and health.json()["engine"]["cause"] == "timeout"


def test_an_engine_loading_its_model_is_503_with_retry_after_and_health_503(tmp_path: Path) -> None:
    """llama-server answers 503 while it loads its model: the server's look at it says so at
    once (no back-off), /health is 503, and a request is 503 with Retry-After before any work."""
    from _replay import Replay, overloaded

    with Replay("llamacpp") as srv, _engine_app(srv, tmp_path, engine_recheck_s=0) as client:
        assert _ask(client).status_code == 200
        srv.push("GET", "/props", *[overloaded("llamacpp")] * 20)
        health = client.get("/health")
        r = _ask(client)
        sent = srv.calls("POST", "/v1/chat/completions")
    assert health.status_code == 503 and health.json()["engine"]["cause"] == "overloaded"
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert int(r.headers["retry-after"]) >= 1 and "still loading" in r.json()["error"]["message"]
    assert len(sent) == 1  # only the first, answered request reached the engine


def test_an_engine_that_answers_500_is_a_502_naming_it(tmp_path: Path) -> None:
    from _replay import Replay, Resp

    with Replay("llamacpp") as srv, _engine_app(srv, tmp_path) as client:
        srv.push(
            "POST",
            "/v1/chat/completions",
            Resp(500, {"error": {"code": 500, "message": "failed to open /opt/models/x.gguf", "type": "server_error"}}),
        )
        r = _ask(client)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "engine_error" and "answered 500" in r.json()["error"]["message"]
    assert "/opt/models" not in r.text


def test_a_request_on_an_engine_of_slots_holds_a_whole_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp gives each request one slot of n_ctx tokens whatever its prompt: admission
    reserves the slot, so no more requests reach the engine than it has slots (the rest wait in
    this server's bounded queue, not in the engine's, where only the engine time-out bounds them)."""
    from _replay import Replay

    from ragbudget.memory.admission import AdmissionController

    held: list[int] = []
    acquire = AdmissionController.acquire

    def spy(self: AdmissionController, tokens: int, **kw: Any) -> Any:
        held.append(tokens)
        return acquire(self, tokens, **kw)

    monkeypatch.setattr(AdmissionController, "acquire", spy)
    with Replay("llamacpp") as srv, _engine_app(srv, tmp_path) as client:
        r = client.post("/v1/chat/completions", json={"model": "ragbudget", "max_tokens": 8, "messages": user()})
        ctl = client.app.state.pipeline.admission
    assert r.status_code == 200, r.text
    prompt = r.json()["usage"]["prompt_tokens"]
    assert prompt + 8 < 512 and held == [512]  # the slot (GET /props n_ctx), not prompt + answer
    assert ctl.capacity_tokens // 512 == 4  # four slots: four requests at once


# --- a context cut for time says so, and a long question is handled alike by ask and chat ---------


def test_time_capped_plan_is_named_in_memory_and_a_long_question_is_answered_by_ask_and_chat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a host where prefill runs 1 ms a token, a 0.2 s target caps the prompt at 200 tokens.
    A question longer than that is not refused by either path (memory and the window allow it;
    time only shortens the context), and the response's ``ragbudget.memory`` says the per-request
    budget was set by time."""
    from _tiny_lm import tiny_model, tiny_tokenizer
    from fastapi.testclient import TestClient

    import ragbudget.memory.calibration
    from ragbudget.chat import Conversation
    from ragbudget.generation.generate import Generator

    monkeypatch.setattr(
        ragbudget.memory.calibration,
        "lookup_prefill_speed",
        lambda model, device: {"a": 0.001, "b": 0.0, "decode_s": 0.01},
    )
    pipe = Pipeline(
        corpus_index("hash:256"),
        max_new_tokens=4,
        gpu="16GiB",
        ttft_target=0.2,
        generator=Generator.from_objects(tiny_model(), tiny_tokenizer()),
    )
    assert pipe.plan.limited_by == "time" and pipe.plan.max_prompt_tokens == 200
    question = "How is the KV cache budget computed? " + "Answer with care. " * 20  # ~400 tokens
    answer = pipe.ask(question)
    turn = Conversation(pipe).ask(question)
    assert answer.report["budget"]["fixed_prompt_tokens"] > 200
    for budget in (answer.report["budget"], turn.answer.report["budget"]):
        # Room for the best passage past the question, as the time cap always leaves.
        assert budget["limited_by"] == "time" and budget["context_tokens_used"] > 0
    assert turn.budget.limited_by == "time" and not turn.budget.overrun
    from ragbudget.generation.allowance import MIN_TIME_CONTEXT

    assert turn.budget.prompt_allowed == answer.report["budget"]["fixed_prompt_tokens"] + MIN_TIME_CONTEXT
    r = TestClient(create_app(pipe, model_name=MODEL)).post(
        "/v1/chat/completions", json={"model": MODEL, "messages": user(question)}
    )
    assert r.status_code == 200, r.text
    assert r.json()["ragbudget"]["memory"]["limited_by"] == "time"
    assert r.json()["ragbudget"]["budget"]["limited_by"] == "time"


# --- host memory figures stay private without --expose-plan -------------------------------------


@pytest.mark.parametrize("expose_plan", [False, True])
def test_health_and_metrics_show_admission_bytes_only_with_expose_plan(expose_plan: bool) -> None:
    """With a memory model admission counts bytes (the memory left beside the weights): those
    figures are the host's, kept out of /health and /metrics unless the plan is exposed."""
    from fastapi.testclient import TestClient

    from ragbudget.memory.admission import MemoryModel

    pipe = fake_pipeline(slots=2)
    pipe.admission.configure(memory=MemoryModel(capacity_bytes=7_340_032_000, kv_bytes_per_token=1024))
    with TestClient(create_app(pipe, expose_plan=expose_plan)) as client:
        health = client.get("/health").json()
        metrics = client.get("/metrics").text
    assert "capacity_tokens" in health and "ragbudget_kv_capacity_tokens" in metrics  # tokens: always
    for figure in ("capacity_bytes", "admitted_bytes", "7340032000"):
        assert (figure in json.dumps(health)) is expose_plan, figure
        assert (figure in metrics) is expose_plan, figure
