"""A conversation's tokens (:mod:`ragbudget.meter`): counts after the chat template, the history's
cost before a question, a text cut to a count, and the newest exchanges that fit a side request.
Over the model-free ``FakeBackend`` (one token per word, a ChatML-like template)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from _fakes import FakeBackend, WordCounter

from ragbudget.meter import Meter
from ragbudget.summaries import Turn


class Template:
    chat_template = "chatml"

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, tokenize: bool, add_generation_prompt: bool
    ) -> str:
        out = "".join(f"<s> {m['role']} {m['content']} </s>\n" for m in messages)
        return out + ("<s> assistant" if add_generation_prompt else "")


@pytest.fixture
def meter() -> Meter:
    backend = FakeBackend(WordCounter(), template=Template())
    return Meter(SimpleNamespace(backend=backend, prompt_builder=backend.prompt_builder("Answer.")))  # type: ignore[arg-type]


def build(lines: list[str]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "Summarize."}, {"role": "user", "content": "\n".join(lines)}]


def test_counts_are_after_the_template_and_a_history_costs_what_it_adds(meter: Meter) -> None:
    assert meter.count("one two three") == 3
    one = [{"role": "user", "content": "a b c"}]
    assert meter.render(one) == 3 + 3 + 2  # the content, "<s> user </s>", the generation prompt
    assert meter.cost([], "Why?") == 0
    turn = [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "d e"}]
    assert meter.cost(turn, "Why?") == (3 + 3) + (2 + 3)  # each message's words and its markers


def test_truncate_keeps_whole_words_within_the_count(meter: Meter) -> None:
    text = " ".join(f"w{i}" for i in range(1000))
    assert meter.truncate(text, 10) == " ".join(f"w{i}" for i in range(10))
    assert meter.truncate("short text", 10) == "short text"
    assert meter.truncate(text, 0) == ""


def test_exchanges_keeps_the_newest_that_fit_each_cut_short(meter: Meter) -> None:
    turns = [Turn(question=f"q{i} " + "x " * 300, answer=f"a{i} " + "y " * 300) for i in range(6)]
    calls = []
    messages, n = meter.exchanges(turns, build, 700, check=lambda: calls.append(1))
    text = messages[-1]["content"]
    assert n == meter.render(messages) <= 700
    # Each exchange is 192 + 96 tokens and its labels: two fit 700, the newest two.
    assert "q5" in text and "q4" in text and "q3" not in text
    assert all(len(line.split()) <= 192 + 1 for line in text.splitlines())  # "User:" + 192 tokens at most
    assert calls  # looked at between counts
    # However small the room, one exchange is kept: the caller compares the count with the room.
    messages, n = meter.exchanges(turns, build, 10)
    assert "q5" in messages[-1]["content"] and n > 10
    # No turns: the frame alone.
    assert meter.exchanges([], build, 100) == (build([]), meter.render(build([])))
