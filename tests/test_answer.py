"""ragbudget.answer: the :class:`Answer` document and :class:`AnswerStream`, the answer piece by
piece from a worker thread — ended, left early (cancelling the request), or failed. The ``ask``
here is a plain function with Pipeline.ask's calling convention; the pipeline's own streams are
in test_pipeline.py."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from ragbudget.answer import Answer, AnswerStream
from ragbudget.errors import BudgetError, ConfigError

WORDS = [f"w{i} " for i in range(50)]


def _ask(question: str, *, on_text: Any, cancel: threading.Event, delay: float = 0.0, **options: Any) -> Answer:
    """Stream ``WORDS`` (stopping when cancelled) and answer with what was sent."""
    sent = []
    for w in WORDS:
        if cancel.is_set():
            break
        on_text(w)
        sent.append(w)
        if delay:
            cancel.wait(delay)
    reason = "cancelled" if cancel.is_set() else "stop"
    report = {"budget": {"max_new_tokens": options.get("max_new_tokens")}, "dropped": [], "timings": {}}
    return Answer(text="".join(sent).strip(), sources=[{"path": question}], report=report, finish_reason=reason)


def test_answer_document_keeps_budget_and_dropped_at_the_top() -> None:
    a = Answer(text="t", sources=[], report={"budget": {"n": 1}, "dropped": [{"r": 1}], "timings": {"x": 0.1}})
    assert a.to_dict() == {
        "answer": "t",
        "declined": False,
        "sources": [],
        "budget": {"n": 1},
        "dropped": [{"r": 1}],
        "finish_reason": "stop",
        "report": {"timings": {"x": 0.1}},
    }


def test_a_stream_yields_every_piece_then_holds_the_answer() -> None:
    with AnswerStream(_ask, "q.txt", {"max_new_tokens": 9}) as stream:
        pieces = list(stream)
    assert pieces == WORDS and not stream.cancelled and stream.error is None
    assert stream.answer is not None and stream.answer.text == "".join(WORDS).strip()
    assert stream.answer.sources == [{"path": "q.txt"}] and stream.answer.report["budget"]["max_new_tokens"] == 9
    assert list(stream) == []  # an ended stream stays ended


def test_leaving_a_stream_early_cancels_the_request() -> None:
    stream = AnswerStream(_ask, "q", {"delay": 0.01})
    for _piece in stream:
        break
    assert stream.cancelled
    assert stream.answer is not None and stream.answer.finish_reason == "cancelled"
    assert len(stream.answer.text.split()) < len(WORDS)


def test_an_error_of_the_request_is_raised_by_the_iteration() -> None:
    def failing(question: str, *, on_text: Any, cancel: threading.Event, **options: Any) -> Answer:
        on_text("a ")
        raise BudgetError("the question alone is over the budget", needed=9, available=3)

    stream = AnswerStream(failing, "q", {})
    with pytest.raises(BudgetError, match="over the budget"):
        list(stream)
    assert stream.answer is None


def test_an_async_stream_does_not_block_the_loop_and_refuses_a_for_loop() -> None:
    async def main() -> tuple[list[str], int, AnswerStream]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.002)

        t = asyncio.create_task(ticker())
        async with AnswerStream(_ask, "q", {"delay": 0.005}, loop=asyncio.get_running_loop()) as stream:
            pieces = [p async for p in stream]
        t.cancel()
        with pytest.raises(ConfigError, match="async for"):
            next(stream)
        return pieces, ticks, stream

    pieces, ticks, stream = asyncio.run(main())
    assert pieces == WORDS and ticks > 10 and stream.answer is not None
    with pytest.raises(ConfigError, match="`for`"):
        AnswerStream(_ask, "q", {}).__aiter__()
