"""One real llama.cpp ``llama-server`` for a benchmark: the binary ``tools/build-llama-server``
builds (``$RAGBUDGET_LLAMA_SERVER``, else the script's ``--cached`` build for this CPU), serving
the packaged default generator's GGUF (or ``model``) on a free loopback port, up and healthy
before it is handed out and stopped after.

    with llama_server(Path(tmp), slots=4, slot_tokens=2048) as url:
        ...  # http://127.0.0.1:<port>
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HEALTHY_WITHIN_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def binary() -> str:
    """``$RAGBUDGET_LLAMA_SERVER``, else the build for this CPU (``make llama-server`` makes it)."""
    env = os.environ.get("RAGBUDGET_LLAMA_SERVER")
    if env:
        return env
    found = subprocess.run(
        [str(ROOT / "tools" / "build-llama-server"), "--cached"], capture_output=True, text=True, check=False
    )
    path = found.stdout.strip()
    if found.returncode or not path:
        raise SystemExit("no llama-server: run `make llama-server` or set RAGBUDGET_LLAMA_SERVER")
    return path


def packaged_gguf(name: str | None = None) -> str:
    """The GGUF of a packaged model (``None``: the packaged default generator; ``ragbudget models
    list`` names the others), assembled from its parts on first use."""
    from ragbudget.errors import ModelError
    from ragbudget.memory.models import resolve_generator

    try:
        ref = resolve_generator(name)
    except ModelError as exc:
        raise SystemExit(str(exc)) from None
    if not (ref.path and ref.gguf_file):
        raise SystemExit(f"the packaged model {name or 'default'} is not installed")
    return str(Path(ref.path) / ref.gguf_file)


@contextlib.contextmanager
def llama_server(
    folder: Path, *, model: str | None = None, slots: int = 4, slot_tokens: int = 2048, threads: int | None = None
) -> Iterator[str]:
    """``llama-server -c slots×slot_tokens -np slots`` (``-t threads``), its log in ``folder``:
    its base URL while the block runs."""
    port = free_port()
    cmd = [binary(), "-m", model or packaged_gguf(), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-c", str(slots * slot_tokens), "-np", str(slots), "--no-webui"]
    if threads:
        cmd += ["-t", str(threads)]
    with healthy_process(cmd, f"http://127.0.0.1:{port}", folder / "llama-server.log", what="llama-server") as url:
        yield url


@contextlib.contextmanager
def healthy_process(cmd: list[str], url: str, log: Path, *, what: str, **popen: Any) -> Iterator[str]:
    """``cmd`` started with its output in ``log`` (``popen``: ``cwd``, ``env``, ...), ``url`` once
    ``url/health`` answers (:func:`wait_healthy`), the process stopped after the block."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **popen)
    try:
        wait_healthy(proc, url, log, what=what)
        yield url
    finally:
        stop(proc)


def wait_healthy(
    proc: subprocess.Popen[bytes], url: str, log: Path, *, what: str, within: float = HEALTHY_WITHIN_S
) -> None:
    """Until ``url/health`` answers 200; a ``SystemExit`` naming ``what`` (with its log's tail)
    when the process exits or ``within`` seconds pass."""
    import httpx

    deadline = time.time() + within
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited {proc.returncode}: {log.read_text(errors='replace')[-1500:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise SystemExit(f"{what} not healthy after {within:g} s; log in {log}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen[bytes], wait: float = 30) -> None:
    """Terminate, then kill after ``wait`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=wait)
