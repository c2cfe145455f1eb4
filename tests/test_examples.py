"""The scripts in examples/ run as documented (so the README's pointers to them cannot rot)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _fakes import fake, fake_pipeline, running

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAGBUDGET_BASE_URL": "http://127.0.0.1:9/v1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.server
@pytest.mark.model
def test_openai_client_example_streams_an_answer_with_sources() -> None:
    # A real Pipeline over the shared corpus index (tests/_fakes.py), answering five scripted words.
    pipe = fake_pipeline(words=5)
    question = "How is the KV cache budget computed?"
    with running(pipe, api_key="secret") as url:
        out = _run(str(EXAMPLES / "openai_client.py"), question, "--base-url", url + "/v1", "--api-key", "secret")
    assert out.returncode == 0, out.stderr
    assert "word0 word1 word2 word3 word4" in out.stdout
    # The first source is the corpus document about the KV budget, with its page and score.
    assert re.search(r"^\[1\] docs/kv-budget\.md page \S+ score 0\.\d+", out.stdout, re.M), out.stdout
    assert fake(pipe).calls[-1]["question"] == question


def test_budgeted_qa_example_parses_its_options() -> None:
    out = _run(str(EXAMPLES / "budgeted_qa.py"), "--help")
    assert out.returncode == 0, out.stderr
    assert "--gpu" in out.stdout and "--context-tokens" in out.stdout
