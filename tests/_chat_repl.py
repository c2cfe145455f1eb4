"""Runs the real ``ragbudget chat`` command over a fake, slow pipeline (for the terminal tests in
tests/test_chat.py, which drive it through a pseudo-terminal).

``python tests/_chat_repl.py chat [options]``: everything after the script name is the command
line of ``ragbudget``; only ``ragbudget.pipeline.Pipeline`` is replaced. The fake streams its
answer a word at a time, checks ``cancel`` before each word as the real generator does, and takes
its time when the question says "slowly", so a test can press Ctrl-C in the middle. When the
command exits, the questions the "model" received are printed as ``ASKED: [...]`` (JSON).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fakes import FakeBackend  # noqa: E402


class Words:
    def count(self, text: str) -> int:
        return len(text.split())


@dataclass
class Plan:
    model: str = "fake/slow-model"
    max_context_tokens: int = 4000
    max_new_tokens: int = 64
    kv_bytes_per_token: int = 1234


@dataclass
class Generator:
    token_counter: Words = field(default_factory=Words)
    tokenizer: Any = None


@dataclass
class Answer:
    text: str
    sources: list[dict[str, Any]]
    report: dict[str, Any]


ASKED: list[str] = []


class SlowPipeline:
    model = "fake/slow-model"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.plan = Plan()
        self.generator = Generator()
        self.backend = FakeBackend(self.generator.token_counter)

    def ask(self, question: str, *, context_tokens: int | None = None, max_new_tokens: int | None = None,
            on_text: Any = None, cancel: Any = None, history: Any = None, retrieval_query: str | None = None,
            **options: Any) -> Answer:
        ASKED.append(question)
        slow = "slowly" in question
        words = [f"You asked: {question}."] + [f"word{i}" for i in range(400 if slow else 3)] + ["[1]"]
        out = []
        for w in words:
            if cancel is not None and cancel.is_set():
                break
            piece = (" " if out else "") + w
            out.append(piece)
            if on_text is not None:
                on_text(piece)
            if slow:
                time.sleep(0.05)
        src = {"path": f"/docs/{len(ASKED)}.md", "page": None, "start": 0, "end": 10, "score": 0.5}
        return Answer(text="".join(out), sources=[src],
                      report={"budget": {"context_tokens_used": 10, "prompt_tokens": 20}})


def _report() -> None:
    sys.stdout.write("\nASKED: " + json.dumps(ASKED) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    import ragbudget.pipeline
    from ragbudget.cli import main

    ragbudget.pipeline.Pipeline = SlowPipeline  # type: ignore[misc,assignment]
    atexit.register(_report)
    main(sys.argv[1:])
