"""ragbudget.generation.backend without a server: the per-request budget from an engine's capacity figures,
the prompt forms a backend accepts, and the options a backend's ``generate`` takes (the local
generator behind the protocol is in test_local.py, the served engines in test_engines.py)."""

from __future__ import annotations

from typing import Any

import pytest

from ragbudget.errors import BudgetError, ConfigError
from ragbudget.generation.backend import (
    Capacity,
    RenderedPrompt,
    check_generate_options,
    per_request_tokens,
    prompt_messages,
    split_generate_options,
)

USER = [{"role": "user", "content": "How is the Project Leader elected?"}]


def test_per_request_tokens_window_binds_when_kv_is_ample() -> None:
    cap = Capacity(
        max_context_tokens=4096, max_context_source="w", kv_tokens_free=10**6, kv_free_source="k", running=0, waiting=0
    )
    b = per_request_tokens(cap, max_new_tokens=256, overhead_tokens=40)
    assert (b.binding, b.context_tokens, b.binding_tokens, b.binding_source) == ("window", 4096 - 256 - 40, 3840, "w")
    assert b.sharing == 1 and not b.advisory


def test_per_request_tokens_kv_binds_and_is_advisory() -> None:
    cap = Capacity(max_context_tokens=8192, kv_tokens_free=9000, kv_free_source="metrics", running=2, waiting=0)
    b = per_request_tokens(cap, max_new_tokens=100, overhead_tokens=20)
    assert b.sharing == 3 and b.kv_share == 3000
    assert (b.binding, b.context_tokens, b.binding_source, b.advisory) == ("kv", 3000 - 120, "metrics", True)
    # an explicit share count wins over the engine's load figures
    assert per_request_tokens(cap, max_new_tokens=100, overhead_tokens=20, sharing=1).binding == "window"


def test_per_request_tokens_uses_the_prompt_cap_and_total_kv_fallback() -> None:
    cap = Capacity(
        max_context_tokens=4096,
        max_prompt_tokens=1000,
        max_prompt_source="p",
        kv_tokens_total=50000,
        kv_total_source="t",
    )
    b = per_request_tokens(cap, max_new_tokens=100, overhead_tokens=10)
    assert (b.binding, b.context_tokens, b.binding_source) == ("window", 990, "p")
    assert b.kv_share == 50000


def test_per_request_tokens_errors_say_what_to_change() -> None:
    with pytest.raises(ConfigError, match="context_tokens"):
        per_request_tokens(Capacity(engine_kind="openai"), max_new_tokens=1, overhead_tokens=0)
    with pytest.raises(BudgetError, match="Lower max_new_tokens") as e:
        per_request_tokens(Capacity(max_context_tokens=100), max_new_tokens=90, overhead_tokens=20)
    assert e.value.available == 10 and e.value.needed == 111


def test_no_free_kv_now_is_overload_not_a_request_too_big() -> None:
    """Every slot busy: the engine's free KV is 0 but its window holds the request, so it is
    load (a server's 429, retried), not a BudgetError (a 400 telling the client to shorten);
    a request the engine's whole KV could never hold stays a BudgetError."""
    from ragbudget.errors import OverloadedError

    busy = Capacity(max_context_tokens=2048, kv_tokens_free=0, kv_free_source="slots", kv_tokens_total=8192, running=4)
    with pytest.raises(OverloadedError, match="once the engine drains"):
        per_request_tokens(busy, max_new_tokens=16, overhead_tokens=98)
    tiny = Capacity(max_context_tokens=2048, kv_tokens_free=0, kv_free_source="slots", kv_tokens_total=100)
    with pytest.raises(BudgetError):
        per_request_tokens(tiny, max_new_tokens=16, overhead_tokens=98)


def test_prompt_messages_accepts_what_backends_take() -> None:
    assert prompt_messages(USER) == USER
    assert prompt_messages(RenderedPrompt(messages=tuple(USER), n_tokens=1, exact=True, source="s")) == USER
    with pytest.raises(ConfigError, match="token ids cannot be sent"):
        prompt_messages([1, 2, 3])


def test_prompt_messages_of_a_real_prompt_are_its_rendered_messages() -> None:
    from _fakes import WordTokenizer

    from ragbudget.fitting import build_prompt
    from ragbudget.packing.select import Candidate

    prompt = build_prompt(
        "Who leads?", [Candidate("c0", "The leader is elected.", 0.9)], tokenizer=WordTokenizer(), max_prompt_tokens=500
    )
    msgs = prompt_messages(prompt)
    assert msgs == [dict(m) for m in prompt.messages] and "Who leads?" in msgs[-1]["content"]
    assert "The leader is elected." in msgs[-1]["content"]


def test_a_backend_takes_the_generate_options_its_generate_takes() -> None:
    # Asked of the backend's own signature, not of its class: the local generator's extras pass
    # a generate that takes **options, and a generate that takes Sampling and stop refuses them
    # by name, before any work.
    class Plain:
        def generate(self, prompt: Any, *, max_new_tokens: int, sampling: Any = None, stop: Any = None) -> None: ...

    class Extras:
        def generate(self, prompt: Any, *, max_new_tokens: int, **options: Any) -> None: ...

    sampling, stop, extras = split_generate_options({"temperature": 0.5, "stop": "\n", "top_k": 5})
    assert sampling.temperature == 0.5 and stop == ["\n"] and extras == {"top_k": 5}
    check_generate_options(Extras(), extras)  # type: ignore[arg-type]
    check_generate_options(Plain(), {})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="top_k: not an option of Plain"):
        check_generate_options(Plain(), extras)  # type: ignore[arg-type]
