"""ragbudget.generation.local without a model: the local generator as a :class:`Backend` — counted in
its own tokenizer, planned by ragbudget's memory model (the one capacity record every backend
answers, with the plan in it), capped for time, and refusing what one device cannot hold. Its
batching over a real tiny model is in test_batching.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from _fakes import GeneratorStub
from _replay import render_count

from ragbudget.errors import ConfigError
from ragbudget.generation.backend import Backend, Sampling, template_overhead
from ragbudget.generation.local import LocalBackend

USER = [{"role": "user", "content": "How is the Project Leader elected?"}]


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


def test_capacity_is_the_memory_plan_for_the_answer_asked() -> None:
    # The pipeline budgets a local request by this record: the plan is in it, per reserved
    # answer length, and its figures are the plan's (the window of one request included).
    b = LocalBackend(GeneratorStub(), gpu="16GiB", max_new_tokens=64)  # type: ignore[arg-type]
    cap = b.capacity()
    assert cap.plan is not None and cap.plan.max_new_tokens == 64  # the backend's own default
    assert cap.max_context_tokens == cap.plan.max_context_tokens
    assert cap.kv_tokens_total == cap.plan.kv_capacity_tokens and cap.engine_kind == "local"
    other = b.capacity(max_new_tokens=500).plan
    assert other is not None and other.max_new_tokens == 500
    assert other.max_prompt_tokens == other.max_context_tokens - 500
    assert b.capacity(max_new_tokens=500).plan is other  # kept per value
    # Not loaded: the plan reads the config of the model as it was given (a stand-in names
    # none: the packaged default), and admission has nothing to add yet.
    assert cap.plan.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert b.tune(object()) is False  # type: ignore[arg-type]


@dataclass
class _OnCPU(GeneratorStub):
    device: str = "cpu"


def test_the_plan_is_capped_for_time_with_its_speed_in_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    import ragbudget.memory.calibration as calibration

    # 2 ms per prompt token: a 3 s target allows 1,500 prompt tokens.
    monkeypatch.setattr(calibration, "lookup_prefill_speed", lambda model, device: {"a": 0.002, "b": 0.0})
    cap = LocalBackend(_OnCPU(), gpu="16GiB", ttft_target=3.0).capacity()  # type: ignore[arg-type]
    assert cap.plan is not None and cap.plan.limited_by == "time" and cap.plan.max_prompt_tokens == 1500
    assert cap.device == "cpu" and cap.speed == {"a": 0.002, "b": 0.0}
    off = LocalBackend(_OnCPU(), gpu="16GiB", ttft_target=0).capacity()  # type: ignore[arg-type]
    assert off.plan is not None and off.plan.limited_by != "time"


def test_one_device_only_refused_when_built() -> None:
    with pytest.raises(ConfigError, match="a local generator runs on one"):
        LocalBackend(GeneratorStub(), gpu="2xH100")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_new_tokens"):
        LocalBackend(GeneratorStub(), max_new_tokens=0)  # type: ignore[arg-type]


def test_its_prompts_are_built_in_the_models_own_tokenizer() -> None:
    from ragbudget.prompt.prompt import EnginePromptBuilder, PromptBuilder

    stub = GeneratorStub()
    builder = LocalBackend(stub).prompt_builder("Be brief.")  # type: ignore[arg-type]
    assert type(builder) is PromptBuilder and not isinstance(builder, EnginePromptBuilder)
    assert builder.tokenizer.hf is stub.tokenizer and builder.system_prompt == "Be brief."


def test_the_old_import_path_still_works_with_a_warning() -> None:
    # LocalBackend lived in the protocol module until the seam was sealed (issue #32).
    import ragbudget.generation.backend as protocol

    with pytest.warns(DeprecationWarning, match="ragbudget.generation.local.LocalBackend"):
        old = protocol.LocalBackend
    assert old is LocalBackend
    with pytest.raises(AttributeError):
        protocol.NoSuchName  # noqa: B018
