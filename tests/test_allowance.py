"""What one request may hold: the room a plan leaves a question, the time cap, and how admission
is sized on a served engine from what it reports."""

from __future__ import annotations

import pytest

from ragbudget.errors import BudgetError
from ragbudget.generation.allowance import (
    MIN_TIME_CONTEXT,
    UNLIMITED_TOKENS,
    engine_admission,
    memory_max_prompt,
    prompt_room,
    question_too_long,
    time_cap,
)
from ragbudget.generation.backend import Capacity
from ragbudget.memory.budget import cap_plan_for_time, plan_budget


@pytest.fixture(scope="module")
def plan():  # type: ignore[no-untyped-def]
    return plan_budget("Qwen/Qwen3-8B", gpu="24GiB", max_new_tokens=256)


def test_prompt_room_is_memory_without_a_time_target(plan) -> None:  # type: ignore[no-untyped-def]
    assert plan.time_prompt_tokens is None
    assert prompt_room(plan, 100, 256) == memory_max_prompt(plan) == plan.max_context_tokens - 256
    assert time_cap(plan, 100, device="cuda", speed=None) is None


def test_the_time_cap_shortens_the_context_but_never_below_one_passage(plan) -> None:  # type: ignore[no-untyped-def]
    timed = cap_plan_for_time(plan, {"a": 0.001, "b": 0.0}, 1.0)  # 1,000 prompt tokens in a second
    cap = time_cap(timed, 100, device="cpu", speed={"a": 0.001, "b": 0.0, "decode_s": 0.05})
    assert cap is not None and cap["limit"] == "time" and cap["tokens"] == 900
    assert cap["prefill_fit"] == {"a": 0.001, "b": 0.0} and cap["device"] == "cpu"
    long_question = time_cap(timed, 950, device="cpu", speed=None)
    assert long_question is not None and long_question["tokens"] == MIN_TIME_CONTEXT


def test_a_question_memory_cannot_hold_names_the_limit(plan) -> None:  # type: ignore[no-untyped-def]
    window = plan.model_max_tokens
    with pytest.raises(BudgetError, match="model window") as e:
        prompt_room(plan, window, 256)
    assert e.value.limit == "window"
    err = question_too_long(plan, window - 100, 256)
    assert "lower max_new_tokens" in str(err) and f"at most {100:,}" in str(err)


def test_engine_admission_uses_what_the_engine_reports() -> None:
    assert engine_admission(Capacity(kv_tokens_total=5000, kv_total_source="vllm metrics")) == (
        5000,
        "5000 KV tokens (vllm metrics)",
    )
    tokens, note = engine_admission(
        Capacity(max_context_tokens=4096, max_concurrent=4, max_context_source="props", max_concurrent_source="slots")
    )
    assert tokens == 4096 * 4 and "× 4 requests" in note
    tokens, note = engine_admission(Capacity(engine_kind="ollama"))
    assert tokens == UNLIMITED_TOKENS and note.startswith("open: the ollama reports no KV cache size")
