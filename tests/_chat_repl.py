"""Runs the real ``ragbudget chat`` command over a fake, slow pipeline (for the terminal tests in
tests/test_chat.py, which drive it through a pseudo-terminal).

``python tests/_chat_repl.py chat [options]``: everything after the script name is the command
line of ``ragbudget``; only ``ragbudget.pipeline.Pipeline`` is replaced, by a real Pipeline on a
FakeBackend that streams its answer a word at a time, checks ``cancel`` before each word as a real
engine does, and takes its time when the question says "slowly", so a test can press Ctrl-C in
the middle. When the
command exits, the questions the "model" was asked to answer are printed as ``ASKED: [...]`` (JSON).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fakes import FakeBackend, _Pipeline, corpus_index  # noqa: E402

from ragbudget.generation.backend import Capacity  # noqa: E402

BACKENDS: list[FakeBackend] = []


def slow_reply(messages: list[dict[str, str]], max_new_tokens: int) -> Any:
    """``You asked.``, ``word0`` …, ``[1]``: a word at a time, 50 ms apart when the question
    says "slowly"."""
    slow = "slowly" in messages[-1]["content"]
    yield "You asked."
    for i in range(min(60 if slow else 3, max_new_tokens - 2)):
        if slow:
            time.sleep(0.05)
        yield f"word{i}"
    yield "[1]"


def SlowPipeline(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - stands in for the class
    """A real Pipeline over the corpus index (hash embedder: no model to load here) whose
    FakeBackend streams :func:`slow_reply` and checks ``cancel`` before each word, as a real
    engine stops. The command's own index options are ignored."""
    backend = FakeBackend(
        reply=slow_reply,
        model_id="fake/slow-model",
        capacity=Capacity(max_context_tokens=4000, max_context_source="fake"),
    )
    BACKENDS.append(backend)
    return _Pipeline(corpus_index("hash:256"), backend=backend, max_new_tokens=64)


def _report() -> None:
    asked = [c["question"] for b in BACKENDS for c in b.answer_calls]
    sys.stdout.write("\nASKED: " + json.dumps(asked) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    import ragbudget.pipeline
    from ragbudget.cli.commands import main

    ragbudget.pipeline.Pipeline = SlowPipeline  # type: ignore[misc,assignment]
    atexit.register(_report)
    main(sys.argv[1:])
