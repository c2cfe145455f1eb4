"""ragbudget.server.deadlines: a client slow to send its request is cut off (issue #42 §3).

The middleware alone first, on scripted ``receive`` calls (no server); then the app under uvicorn,
where several stalled clients at once get their 408 within a bounded time while the others are
answered, and the ``serve`` command's options.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from _fakes import corpus_index, fake_pipeline
from click.testing import CliRunner

from ragbudget.errors import ConfigError
from ragbudget.server.app import background_server, create_app, http_protocol
from ragbudget.server.deadlines import BodyDeadline, header_deadline_protocol
from ragbudget.server.metrics import Metrics
from ragbudget.server.openai_api import APIError
from ragbudget.settings import ClientTimeoutSettings

Message = dict[str, Any]

# --- the middleware alone ---------------------------------------------------------------------------


def piece(body: bytes, more: bool = True) -> Message:
    return {"type": "http.request", "body": body, "more_body": more}


def scripted(pieces: list[tuple[float, Message]]) -> Callable[[], Any]:
    """A ``receive`` that gives each message after its delay, then stalls (a client that went
    quiet without leaving)."""
    queue = list(pieces)

    async def receive() -> Message:
        if not queue:
            await asyncio.sleep(3600)
        delay, message = queue.pop(0)
        await asyncio.sleep(delay)
        return message

    return receive


async def read_body(receive: Callable[[], Any]) -> bytes:
    """The whole body, read as Starlette's ``request.stream()`` reads it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ConnectionError("client left")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def ok(send: Callable[[Message], Any], headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": headers or []})
    await send({"type": "http.response.body", "body": b"{}"})


def reads_then_answers(scope: Message, receive: Callable[[], Any], send: Callable[[Message], Any]) -> Any:
    async def app() -> None:
        await read_body(receive)
        await ok(send)

    return app()


def call(
    app: Any,
    pieces: list[tuple[float, Message]],
    *,
    idle: float = 10.0,
    total: float = 30.0,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> tuple[list[Message], Metrics, float]:
    """``app`` behind the middleware for one request: what it sent, the counters, the seconds."""
    metrics, sent = Metrics(), []
    scope = {"type": "http", "headers": [(b"content-length", b"1000")] if headers is None else headers}

    async def send(message: Message) -> None:
        sent.append(message)

    guard = BodyDeadline(app, body_idle_timeout=idle, body_timeout=total, metrics=metrics)
    t0 = time.perf_counter()
    asyncio.run(guard(scope, scripted(pieces), send))
    return sent, metrics, time.perf_counter() - t0


def answer_of(sent: list[Message]) -> tuple[int, dict[bytes, bytes], Any]:
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), json.loads(body) if body != b"{}" else {}


def test_a_body_that_pauses_past_the_idle_limit_is_a_408_that_closes_the_connection() -> None:
    sent, metrics, took = call(reads_then_answers, [(0, piece(b"hello"))], idle=0.2)
    status, headers, body = answer_of(sent)
    assert status == 408 and headers[b"connection"] == b"close"
    assert body["error"]["code"] == "body_timeout" and body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    assert "5 of 1000 bytes came, then nothing for 0.2 s" in message and "--body-idle-timeout" in message
    assert metrics.body_timeouts == 1
    assert 0.2 <= took < 2


def test_a_body_that_trickles_past_the_total_limit_is_a_408() -> None:
    # A byte every 0.1 s never pauses past the idle limit; the whole body's limit cuts it.
    sent, metrics, took = call(reads_then_answers, [(0.1, piece(b"x"))] * 100, idle=1, total=0.5)
    status, _, body = answer_of(sent)
    assert status == 408 and "did not arrive within 0.5 s" in body["error"]["message"]
    assert "--body-timeout" in body["error"]["message"]
    assert metrics.body_timeouts == 1 and 0.5 <= took < 2


def test_the_app_answers_the_408_through_its_own_handler_once() -> None:
    def app(scope: Message, receive: Callable[[], Any], send: Callable[[Message], Any]) -> Any:
        async def run() -> None:
            try:
                await read_body(receive)
            except APIError as err:  # as FastAPI's exception handler answers it
                await send({"type": "http.response.start", "status": err.status, "headers": []})
                await send({"type": "http.response.body", "body": json.dumps(err.body()).encode()})
                with pytest.raises(APIError):  # asking again is told again, not held
                    await receive()

        return run()

    sent, metrics, _ = call(app, [(0, piece(b"hello"))], idle=0.1)
    assert len(sent) == 2 and answer_of(sent)[:2] == (408, {b"connection": b"close"})
    assert metrics.body_timeouts == 1


def test_a_body_in_time_passes_untouched_and_what_follows_it_has_no_limit() -> None:
    def app(scope: Message, receive: Callable[[], Any], send: Callable[[Message], Any]) -> Any:
        async def run() -> None:
            assert await read_body(receive) == b"hello world"
            # Listening for a disconnect once the body is in waits as long as it likes.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(receive(), 0.3)
            await ok(send, [(b"connection", b"keep-alive")])

        return run()

    sent, metrics, _ = call(app, [(0.05, piece(b"hello ")), (0.05, piece(b"world", more=False))], idle=0.1, total=1)
    assert answer_of(sent)[:2] == (200, {b"connection": b"keep-alive"})
    assert metrics.body_timeouts == 0


@pytest.mark.parametrize(
    ("headers", "idle"),
    [([], 0.1), ([(b"content-length", b"0")], 0.1), ([(b"content-length", b"1000")], 0)],
    ids=["no body", "empty body", "limits off"],
)
def test_a_request_without_a_body_or_limits_gets_the_servers_own_receive(
    headers: list[tuple[bytes, bytes]], idle: float
) -> None:
    seen = []

    async def app(scope: Message, receive: Callable[[], Any], send: Callable[[Message], Any]) -> None:
        seen.append(receive)
        await ok(send)

    metrics = Metrics()
    guard = BodyDeadline(app, body_idle_timeout=idle, body_timeout=idle, metrics=metrics)
    receive = scripted([])
    asyncio.run(guard({"type": "http", "headers": headers}, receive, lambda m: asyncio.sleep(0)))
    assert seen == [receive]


def test_an_answer_sent_before_the_body_is_in_closes_the_connection() -> None:
    # A 401 (or 404, 413) that never reads the body: uvicorn would read the rest at the client's pace.
    async def refuses(scope: Message, receive: Callable[[], Any], send: Callable[[Message], Any]) -> None:
        await send({"type": "http.response.start", "status": 401, "headers": [(b"Connection", b"keep-alive")]})
        await send({"type": "http.response.body", "body": b"{}"})

    sent, metrics, took = call(refuses, [])
    assert sent[0]["status"] == 401 and sent[0]["headers"] == [(b"connection", b"close")]
    assert metrics.body_timeouts == 0 and took < 1


def test_a_client_that_leaves_mid_body_is_no_time_out() -> None:
    left = []

    async def app(scope: Message, receive: Callable[[], Any], send: Callable[[Message], Any]) -> None:
        try:
            await read_body(receive)
        except ConnectionError:  # Starlette's ClientDisconnect: nobody to answer
            left.append(scope)

    sent, metrics, _ = call(app, [(0, piece(b"hello")), (0, {"type": "http.disconnect"})], idle=0.2)
    assert len(left) == 1 and sent == [] and metrics.body_timeouts == 0


# --- the records, the keywords and the protocol ----------------------------------------------------


@pytest.fixture(scope="module")
def light_pipeline() -> Any:
    # The corpus index with the hash embedder: no model anywhere.
    return fake_pipeline(index_dir=corpus_index("hash:256"))


def test_create_app_takes_the_record_or_its_keywords_not_both(light_pipeline: Any) -> None:
    app = create_app(light_pipeline, body_timeout=5)
    assert app.state.client_timeouts == ClientTimeoutSettings(body_timeout=5)
    record = ClientTimeoutSettings(header_timeout=2)
    assert create_app(light_pipeline, client_timeouts=record).state.client_timeouts is record
    with pytest.raises(ConfigError, match="not both"):
        create_app(light_pipeline, client_timeouts=record, body_timeout=5)
    with pytest.raises(ConfigError, match="body_idle_timeout must be ≥ 0, got -1"):
        create_app(light_pipeline, body_idle_timeout=-1)


def test_the_header_deadline_is_the_apps_and_zero_leaves_uvicorns_own(light_pipeline: Any) -> None:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    protocol = http_protocol(create_app(light_pipeline))
    assert issubclass(protocol, H11Protocol) and protocol is not H11Protocol
    assert http_protocol(create_app(light_pipeline, header_timeout=0)) == "auto"
    assert http_protocol(object()) == "auto"  # an app not built by create_app
    assert header_deadline_protocol(0, lambda: None) is H11Protocol


def test_serve_takes_the_three_time_outs(monkeypatch: pytest.MonkeyPatch) -> None:
    from ragbudget.cli.commands import cli

    class Pipe:
        def __enter__(self) -> Pipe:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    served: list[dict[str, Any]] = []
    monkeypatch.setattr("ragbudget.pipeline.Pipeline", lambda *a, **kw: Pipe())
    monkeypatch.setattr("ragbudget.server.app.serve", lambda pipe, **kw: served.append(kw))
    assert CliRunner().invoke(cli, ["serve", "--port", "0"]).exit_code == 0
    assert served[-1]["client_timeouts"] == ClientTimeoutSettings()
    args = ["--header-timeout", "0", "--body-idle-timeout", "2", "--body-timeout", "5"]
    result = CliRunner().invoke(cli, ["serve", "--port", "0", *args])
    assert result.exit_code == 0, result.output
    assert served[-1]["client_timeouts"] == ClientTimeoutSettings(header_timeout=0, body_idle_timeout=2, body_timeout=5)
    assert CliRunner().invoke(cli, ["serve", "--body-timeout", "-1"]).exit_code == 2


# --- under uvicorn ------------------------------------------------------------------------------------


def raw(url: str, data: bytes, out: dict[str, Any], *, hold: float = 15.0) -> None:
    """Send ``data`` and stall: what the server answers before it closes, and when it closed
    (``None`` if it was still open after ``hold`` seconds)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    t0 = time.monotonic()
    got = b""
    with socket.create_connection((host, int(port)), timeout=hold) as sock:
        sock.sendall(data)
        try:
            while chunk := sock.recv(4096):
                got += chunk
            out["closed_after"] = time.monotonic() - t0
        except TimeoutError:
            out["closed_after"] = None
    out["answer"] = got


def stalled_body(endpoint: str) -> bytes:
    return (
        f"POST {endpoint} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        'Content-Length: 1000\r\n\r\n{"mod'
    ).encode()


@pytest.mark.server
def test_stalled_clients_are_cut_off_with_408_while_the_others_are_answered(light_pipeline: Any) -> None:
    limit = 2.0
    app = create_app(light_pipeline, header_timeout=limit, body_idle_timeout=limit, body_timeout=3 * limit)
    stalls = [stalled_body(e) for e in ("/v1/chat/completions", "/v1/retrieve") for _ in range(3)]
    stalls += [b"GET /heal", b"POST /v1/retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le", b""]
    outs: list[dict[str, Any]] = [{} for _ in stalls]
    with background_server(app) as url:
        threads = [threading.Thread(target=raw, args=(url, data, out)) for data, out in zip(stalls, outs, strict=True)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(0.2)  # every stalled client connected and sent what it will send
        # Meanwhile the others are answered, while the stalled ones are still held.
        answered = []
        with httpx.Client(base_url=url, timeout=10) as client:
            while time.monotonic() - t0 < limit - 0.5:
                for r in (client.get("/health"), client.post("/v1/retrieve", json={"query": "KV cache budget"})):
                    answered.append((r.request.url.path, r.status_code, time.monotonic() - t0))
                time.sleep(0.05)
        for t in threads:
            t.join(timeout=20)
        metrics = httpx.get(url + "/metrics").text
    assert all(status == 200 for _, status, _ in answered), answered
    first_cut = min(out["closed_after"] or 15.0 for out in outs)
    assert {path for path, _, at in answered if at < first_cut} == {"/health", "/v1/retrieve"}, (answered, first_cut)
    for data, out in zip(stalls, outs, strict=True):
        # Each cut off at its limit (not before), within a bounded time, not held forever.
        assert out["closed_after"] is not None, f"{data[:30]!r} was still held after 15 s"
        assert limit - 0.1 <= out["closed_after"] < limit + 5, (data[:30], out)
        if data:  # a client that sent nothing is closed without a word
            assert out["answer"].startswith(b"HTTP/1.1 408 "), (data[:30], out["answer"][:200])
            assert b"connection: close" in out["answer"].lower()
            error = json.loads(out["answer"].split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == ("body_timeout" if b"\r\n\r\n" in data else "header_timeout")
        else:
            assert out["answer"] == b""
    assert "ragbudget_request_body_timeouts_total 6" in metrics
    assert "ragbudget_request_header_timeouts_total 3" in metrics
    for endpoint in ("/v1/chat/completions", "/v1/retrieve"):
        assert f'ragbudget_requests_total{{endpoint="{endpoint}",status="408"}} 3' in metrics


@pytest.mark.server
def test_a_kept_alive_connections_next_request_is_held_to_the_header_limit(light_pipeline: Any) -> None:
    app = create_app(light_pipeline, header_timeout=1)
    with background_server(app) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            first = sock.recv(65536)
            # The second request, slower than the first (uvicorn's keep-alive time-out ends once a byte comes).
            time.sleep(0.5)
            sock.sendall(b"GET /hea")
            t0, rest = time.monotonic(), b""
            while chunk := sock.recv(4096):
                rest += chunk
            took = time.monotonic() - t0
    assert first.startswith(b"HTTP/1.1 200 ")
    assert b"HTTP/1.1 408 " in rest and 0.9 <= took < 5
