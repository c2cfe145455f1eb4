"""Generation: capped answers, streaming, stop strings, and the OOM ladder under fault injection."""

from __future__ import annotations

import random

import pytest
from _tiny_lm import tiny_model, tiny_tokenizer

from ragbudget.errors import BudgetError, ConfigError
from ragbudget.generate import Generation, Generator, _quant_backend, is_oom
from ragbudget.prompt import build_prompt
from ragbudget.select import Candidate
from ragbudget.types import Source


@pytest.fixture(scope="module")
def gen() -> Generator:
    return Generator.from_objects(tiny_model(), tiny_tokenizer())


def corpus(n: int = 12) -> list[Candidate]:
    rnd = random.Random(0)
    return [Candidate(f"c{i}", " ".join(rnd.choice(["alpha", "beta", "gamma", "delta"])
                                        for _ in range(20)) + f" id{i}", 1.0 - i / n,
                      sources=(Source(f"f{i}.txt", 0, 100),)) for i in range(n)]


class FaultyGenerate:
    """Wraps ``model.generate``: raises an OOM on the chosen call numbers (1-based)."""

    def __init__(self, real, fail_on: set[int], exc: type[BaseException] = MemoryError) -> None:
        self.real, self.fail_on, self.exc = real, fail_on, exc
        self.calls: list[dict] = []

    def __call__(self, **kw):
        self.calls.append(kw)
        if len(self.calls) in self.fail_on:
            raise self.exc("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return self.real(**kw)


@pytest.fixture
def faulty(gen, monkeypatch):
    def install(fail_on: set[int], exc: type[BaseException] = MemoryError) -> FaultyGenerate:
        f = FaultyGenerate(gen.model.generate, fail_on, exc)
        monkeypatch.setattr(gen.model, "generate", f)
        return f

    return install


def test_capped_greedy_generation(gen) -> None:
    g = gen.generate([{"role": "user", "content": "hello"}], max_new_tokens=7)
    assert isinstance(g, Generation) and g.new_tokens <= 7 and not g.oom_steps
    assert g.finish_reason in ("length", "stop") and g.prompt_tokens > 5
    again = gen.generate([{"role": "user", "content": "hello"}], max_new_tokens=7)
    assert again.text == g.text  # greedy is deterministic
    assert g.to_dict()["new_tokens"] == g.new_tokens


def test_prompt_forms_and_streaming(gen) -> None:
    pieces: list[str] = []
    ids = gen.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                               add_special_tokens=False)
    a = gen.generate(ids, max_new_tokens=6, on_text=pieces.append)
    b = gen.generate([{"role": "user", "content": "hi"}], max_new_tokens=6)
    c = gen.generate("hi", max_new_tokens=6)
    assert a.prompt_tokens == b.prompt_tokens == c.prompt_tokens == len(ids)
    assert a.text == b.text == c.text
    assert "".join(pieces).strip() == a.text
    items = list(gen.stream("hi", max_new_tokens=6))
    assert isinstance(items[-1], Generation) and "".join(items[:-1]).strip() == a.text
    with pytest.raises(ConfigError):
        gen.generate({"bad": 1}, max_new_tokens=2)
    with pytest.raises(ConfigError, match="cache"):
        gen.generate("hi", max_new_tokens=2, cache="paged")


def test_sampling_passes_options_through(gen, faulty) -> None:
    f = faulty(set())
    gen.generate("hi", max_new_tokens=3, do_sample=True, temperature=0.7, top_p=0.9, seed=1)
    kw = f.calls[-1]
    assert kw["do_sample"] and kw["temperature"] == 0.7 and kw["top_p"] == 0.9
    gen.generate("hi", max_new_tokens=3, cache="static")
    assert f.calls[-1]["cache_implementation"] == "static"


def test_oom_ladder_drops_chunks_then_cache_then_no_cache(gen, faulty) -> None:
    prompt = build_prompt("which id?", corpus(), tokenizer=gen.tokenizer, max_prompt_tokens=3000,
                          redundancy=1.01)
    n0 = len(prompt.passages)
    assert n0 >= 8
    f = faulty({1, 2, 3, 4})
    g = gen.generate(prompt, max_new_tokens=4)
    actions = [s.action for s in g.oom_steps]
    cache = "quantized" if _quant_backend() else "offloaded"
    assert actions == ["drop_chunks", "drop_chunks", f"{cache}_cache", "no_cache"]
    s1, s2 = g.oom_steps[:2]
    assert s1.prompt_tokens_before == prompt.n_tokens > s1.prompt_tokens_after
    assert s2.prompt_tokens_before == s1.prompt_tokens_after > s2.prompt_tokens_after
    assert "out of memory" in s1.reason and "MemoryError" in s1.reason
    assert len(g.prompt.passages) == n0 - (n0 + 1) // 2 - ((n0 - (n0 + 1) // 2) + 1) // 2
    # The lowest-scored passages went first.
    kept = {p.chunk_id for p in g.prompt.passages}
    assert kept == {p.chunk_id for p in sorted(prompt.passages, key=lambda p: -p.score)[:len(kept)]}
    assert f.calls[2]["input_ids"].shape[1] == g.oom_steps[1].prompt_tokens_after
    assert f.calls[3]["cache_implementation"] == cache
    assert f.calls[4]["use_cache"] is False and "cache_implementation" not in f.calls[4]
    assert g.cache == "none" and g.prompt_tokens == s2.prompt_tokens_after and g.new_tokens <= 4


def test_oom_ladder_gives_up_with_budget_error_and_stays_usable(gen, faulty) -> None:
    import torch

    f = faulty(set(range(1, 10)), exc=torch.cuda.OutOfMemoryError)
    with pytest.raises(BudgetError) as err:
        gen.generate([1, 2, 3, 4, 5], max_new_tokens=3)
    cache = "quantized" if _quant_backend() else "offloaded"
    assert f"{cache}_cache, no_cache" in str(err.value) and "Lower max_new_tokens" in str(err.value)
    assert len(f.calls) == 3  # plain ids cannot be rebuilt: cache rung, no-cache rung, give up
    f.fail_on = set()
    assert gen.generate([1, 2, 3, 4, 5], max_new_tokens=3).new_tokens <= 3  # still usable


def test_non_oom_errors_are_not_swallowed(gen, faulty) -> None:
    faulty({1}, exc=KeyError)
    with pytest.raises(KeyError):
        gen.generate("hi", max_new_tokens=2)


def test_is_oom() -> None:
    import torch

    assert is_oom(MemoryError()) and is_oom(torch.cuda.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("MPS backend out of memory"))
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))


def test_stop_strings(gen) -> None:
    full = gen.generate("hi", max_new_tokens=12)
    if len(full.text) < 3:
        pytest.skip("random model produced too little text to cut")
    stop = full.text[2:4]
    cut = gen.generate("hi", max_new_tokens=12, stop=[stop])
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert full.text.startswith(cut.text)


def test_generator_is_lazy() -> None:
    g = Generator("some/unloaded-model")
    assert "not loaded" in repr(g) and g._model is None


@pytest.mark.slow
def test_smollm2_short_capped_answer() -> None:
    gen = Generator()
    hits = [Candidate("1", "The Eiffel Tower is in Paris. It was completed in 1889.", 0.9,
                      sources=(Source("paris.txt", 0, 55),))]
    prompt = build_prompt("When was the Eiffel Tower completed?", hits, tokenizer=gen.tokenizer,
                          max_prompt_tokens=400)
    g = gen.generate(prompt, max_new_tokens=24)
    assert g.new_tokens <= 24 and g.prompt_tokens == prompt.n_tokens <= 400
    assert "1889" in g.text


def test_cancel_stops_early(gen) -> None:
    import threading

    ev = threading.Event()
    pieces: list[str] = []

    def on_text(s: str) -> None:
        pieces.append(s)
        ev.set()  # cancel as soon as the first text arrives

    g = gen.generate("hi", max_new_tokens=40, on_text=on_text, cancel=ev)
    assert g.finish_reason in ("cancelled", "stop") and g.new_tokens < 40


def test_calibration_hook_records_measured_peak(gen, monkeypatch) -> None:
    import torch

    from ragbudget import budget

    seen: dict = {}
    monkeypatch.setattr(budget, "record_calibration", lambda **kw: seen.update(kw))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "FakeGPU 80GB")
    g = Generation(text="x", prompt_tokens=100, new_tokens=5, finish_reason="length", seconds=1.0)
    gen._calibrate(g, 123_456_789, None)
    assert seen["gpu_name"] == "FakeGPU 80GB" and seen["measured_peak_bytes"] == 123_456_789
    assert seen["tokens"] == 100 and seen["batch_size"] == 1 and seen["cache"] == "dynamic"
    assert seen["weights_bytes"] > 0 and seen["kv_bytes"] > 0
