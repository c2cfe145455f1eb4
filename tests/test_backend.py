"""ragbudget.generation.backend without a server: the per-request budget from an engine's capacity figures,
the prompt forms a backend accepts, and the local generator as a :class:`Backend` (the served
engines behind the same protocol are in test_engines.py)."""

from __future__ import annotations

from typing import Any

import pytest
from _replay import render_count

from ragbudget.errors import BudgetError, ConfigError
from ragbudget.generation.backend import (
    Backend,
    Capacity,
    LocalBackend,
    RenderedPrompt,
    Sampling,
    per_request_tokens,
    prompt_messages,
    template_overhead,
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


def test_prompt_messages_accepts_what_backends_take() -> None:
    assert prompt_messages(USER) == USER
    assert prompt_messages(RenderedPrompt(messages=tuple(USER), n_tokens=1, exact=True, source="s")) == USER
    with pytest.raises(ConfigError, match="token ids cannot be sent"):
        prompt_messages([1, 2, 3])


class _StubGenerator:
    """The Generator surface LocalBackend uses, model-free."""

    class _Ref:
        id = "stub-model"

    model_ref = _Ref()
    loaded = False

    class token_counter:  # noqa: N801
        @staticmethod
        def count(text: str) -> int:
            return len(text.split())

    class tokenizer:  # noqa: N801 - a chat template rendering as many words as the replay counts
        chat_template = "stub"

        @staticmethod
        def apply_chat_template(messages: Any, tokenize: bool = False, add_generation_prompt: bool = False) -> str:
            return " ".join(["tok"] * render_count(list(messages)))

    def generate(self, prompt: Any, **kw: Any) -> Any:
        from ragbudget.generation.generate import Generation

        self.kw = kw
        return Generation(text="ok", prompt_tokens=3, new_tokens=1, finish_reason="stop", seconds=0.0)


def test_local_backend_is_a_backend() -> None:
    stub = _StubGenerator()
    b = LocalBackend(stub)  # type: ignore[arg-type]
    assert isinstance(b, Backend) and b.model_id == "stub-model"
    assert b.count(["a b", "c"]) == [2, 1]
    r = b.render(USER)
    assert r.exact and r.n_tokens == render_count(USER)
    g = b.generate("Hi", max_new_tokens=5, sampling=Sampling(temperature=0.5, seed=2), stop=["\n"])
    assert g.text == "ok" and stub.kw["max_new_tokens"] == 5 and stub.kw["seed"] == 2
    assert stub.kw["stop"] == ["\n"] and stub.kw["temperature"] == 0.5
    assert template_overhead(b, "Be brief.") == 2 + 4 + 0 + 4 + 3


def test_prompt_messages_of_a_real_prompt_are_its_rendered_messages() -> None:
    from _fakes import WordTokenizer

    from ragbudget.prompt.prompt import build_prompt
    from ragbudget.prompt.select import Candidate

    prompt = build_prompt(
        "Who leads?", [Candidate("c0", "The leader is elected.", 0.9)], tokenizer=WordTokenizer(), max_prompt_tokens=500
    )
    msgs = prompt_messages(prompt)
    assert msgs == [dict(m) for m in prompt.messages] and "Who leads?" in msgs[-1]["content"]
    assert "The leader is elected." in msgs[-1]["content"]


def test_template_overhead_renders_an_empty_turn_for_a_backend_without_its_own() -> None:
    # Only the served engines measure (and cache) the overhead themselves; any other Backend is
    # asked to render the system prompt around an empty user turn.
    b = LocalBackend(_StubGenerator())  # type: ignore[arg-type]
    assert template_overhead(b) == render_count([{"role": "user", "content": ""}])
    assert template_overhead(b, "Be brief.") - template_overhead(b) == 2 + 4


def test_template_overhead_asks_any_backend_that_measures_its_own() -> None:
    # A backend's own template_overhead wins whatever its class (not only a ServedBackend's): the
    # protocol module does not know the engines (tests/test_layout.py checks it imports none).
    class Measuring(LocalBackend):
        def template_overhead(self, system_prompt: str | None = None) -> int:
            return 7 if system_prompt else 5

    b = Measuring(_StubGenerator())  # type: ignore[arg-type]
    assert (template_overhead(b), template_overhead(b, "Be brief.")) == (5, 7)
