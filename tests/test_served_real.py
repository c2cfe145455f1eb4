"""ragbudget's faces against the real llama.cpp ``llama-server`` (conftest.py ``llama_server``:
the packaged SmolLM2-135M GGUF, ``-c 2048 -np 4``, 512 tokens a slot): ``Pipeline(engine=…)``,
``ragbudget ask --engine`` and ``budget --engine`` as commands, and ``ragbudget serve --engine``
driven by the official ``openai`` client. The index is the repo's data/ with the model-free hash
embedder, so only the engine is real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
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
    pipe = Pipeline(index_dir, engine=llama_server, max_new_tokens=32, relevance_floor=0, engine_timeout=300)
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
    """``ragbudget serve --engine`` in front of the llama-server, on a free loopback port."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Its log goes to a file, not a pipe: `-v` logs every request, and a pipe read only at the
    # end fills (64 KiB) and blocks the server in a write mid-request (a client then waits for
    # its answer until its own time-out, 10 minutes for the openai client).
    log = tmp_path_factory.mktemp("gateway") / "serve.log"
    with open(log, "wb") as out:
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
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"serve --engine exited {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
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
        # Stopped the way a user does: Ctrl-C, then a kill after 20 s.
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err = log.read_text(errors="replace")
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
