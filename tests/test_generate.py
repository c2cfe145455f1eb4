"""Generation: capped answers, streaming, stop strings, and the OOM ladder under fault injection."""

from __future__ import annotations

import random

import pytest
from _fakes import printable_stop
from _tiny_lm import CUDA_NAME, CUDA_PEAK, as_on_cuda, tiny_model, tiny_tokenizer

from ragbudget.errors import BudgetError, ConfigError
from ragbudget.fitting import build_prompt
from ragbudget.generation import generate as generate_mod
from ragbudget.generation.generate import Generation, Generator, is_oom, quant_backend, smaller_cache
from ragbudget.packing.select import Candidate
from ragbudget.types import Source

# Nearly every test generates with the tiny random Llama (tests/_needs.py).
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def gen() -> Generator:
    return Generator.from_objects(tiny_model(), tiny_tokenizer())


def corpus(n: int = 12) -> list[Candidate]:
    rnd = random.Random(0)
    return [
        Candidate(
            f"c{i}",
            " ".join(rnd.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(20)) + f" id{i}",
            1.0 - i / n,
            sources=(Source(f"f{i}.txt", 0, 100),),
        )
        for i in range(n)
    ]


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
    ids = gen.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
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
    gen.generate("hi", max_new_tokens=3, temperature=0.7, top_p=0.9, top_k=20)
    kw = f.calls[-1]
    assert kw["do_sample"] and kw["temperature"] == 0.7 and kw["top_p"] == 0.9 and kw["top_k"] == 20
    # Absent or zero temperature is greedy (the OpenAI convention), whatever top_p says.
    for options in ({}, {"temperature": 0}, {"temperature": 0.0, "top_p": 0.5}, {"temperature": 1.0, "top_p": 0}):
        gen.generate("hi", max_new_tokens=3, **options)
        kw = f.calls[-1]
        assert kw["do_sample"] is False and kw["temperature"] is None and "logits_processor" not in kw, options
    # A seed samples with a private generator inside a logits processor (greedy then takes its pick).
    gen.generate("hi", max_new_tokens=3, temperature=0.7, seed=1)
    kw = f.calls[-1]
    assert kw["do_sample"] is False and len(kw["logits_processor"]) == 1
    gen.generate("hi", max_new_tokens=3, cache="static")
    assert f.calls[-1]["cache_implementation"] == "static"


def test_seed_makes_sampling_reproducible_and_leaves_the_global_rng_alone(gen) -> None:
    import torch

    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = gen.generate("hi", max_new_tokens=12, temperature=1.0, seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = gen.generate("hi", max_new_tokens=12, temperature=1.0, seed=7)
    others = {gen.generate("hi", max_new_tokens=12, temperature=1.0, seed=s).text for s in (8, 9, 10)}
    greedy = gen.generate("hi", max_new_tokens=12)
    assert a.text == b.text and a.new_tokens == b.new_tokens
    assert others - {a.text}, "other seeds must sample other answers"
    assert a.text != greedy.text
    # Top-k 1 and a tiny top_p leave only the best token: sampling then equals greedy decoding.
    for options in ({"top_k": 1}, {"top_p": 1e-6}):
        assert gen.generate("hi", max_new_tokens=12, temperature=1.5, seed=3, **options).text == greedy.text


def test_seeded_sampling_is_independent_of_other_threads(gen) -> None:
    import threading

    alone = gen.generate("hi", max_new_tokens=10, temperature=1.0, seed=42).text
    results: list[str] = []

    def noise() -> None:
        for s in range(4):
            gen.generate("hello", max_new_tokens=10, temperature=1.0, seed=s)
            gen.generate("hello", max_new_tokens=10, temperature=1.0)  # transformers' own sampling

    t = threading.Thread(target=noise)
    t.start()
    for _ in range(3):
        results.append(gen.generate("hi", max_new_tokens=10, temperature=1.0, seed=42).text)
    t.join()
    assert results == [alone] * 3


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": -1},
        {"temperature": float("nan")},
        {"top_p": 1.5},
        {"top_p": -0.1},
        {"top_k": -2},
        {"seed": 1.5},
        {"seed": True},
        {"stop": [3]},
    ],
)
def test_invalid_sampling_options_are_config_errors(gen, options) -> None:
    with pytest.raises(ConfigError):
        gen.generate("hi", max_new_tokens=2, **options)


def test_oom_ladder_drops_chunks_then_cache_then_no_cache(gen, faulty, monkeypatch) -> None:
    # As on a GPU with a quantization backend (the rung's choice per device is tested below).
    monkeypatch.setattr(generate_mod, "smaller_cache", lambda device: "quantized")
    prompt = build_prompt("which id?", corpus(), tokenizer=gen.tokenizer, max_prompt_tokens=3000, redundancy=1.01)
    n0 = len(prompt.passages)
    assert n0 >= 8
    f = faulty({1, 2, 3, 4})
    g = gen.generate(prompt, max_new_tokens=4)
    actions = [s.action for s in g.oom_steps]
    cache = "quantized"
    assert actions == ["drop_chunks", "drop_chunks", f"{cache}_cache", "no_cache"]
    s1, s2 = g.oom_steps[:2]
    assert s1.prompt_tokens_before == prompt.n_tokens > s1.prompt_tokens_after
    assert s2.prompt_tokens_before == s1.prompt_tokens_after > s2.prompt_tokens_after
    assert "out of memory" in s1.reason and "MemoryError" in s1.reason
    # Each drop packs the same candidates again, with the packer that chose them, into half the
    # context tokens (issue #44: generation asks for a smaller prompt, it never drops passages).
    fixed = prompt.fixed_tokens
    assert s1.prompt_tokens_after <= fixed + (s1.prompt_tokens_before - fixed) // 2
    assert s2.prompt_tokens_after <= fixed + (s2.prompt_tokens_before - fixed) // 2
    assert 0 < len(g.prompt.passages) < n0 // 2
    # The lowest-scored passages went first.
    kept = {p.chunk_id for p in g.prompt.passages}
    assert kept == {p.chunk_id for p in sorted(prompt.passages, key=lambda p: -p.score)[: len(kept)]}
    assert f.calls[2]["input_ids"].shape[1] == g.oom_steps[1].prompt_tokens_after
    assert f.calls[3]["cache_implementation"] == cache
    assert f.calls[4]["use_cache"] is False and "cache_implementation" not in f.calls[4]
    assert g.cache == "none" and g.prompt_tokens == s2.prompt_tokens_after and g.new_tokens <= 4


def test_oom_ladder_gives_up_with_budget_error_and_stays_usable(gen, faulty, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(generate_mod, "smaller_cache", lambda device: "offloaded")
    f = faulty(set(range(1, 10)), exc=torch.cuda.OutOfMemoryError)
    with pytest.raises(BudgetError) as err:
        gen.generate([1, 2, 3, 4, 5], max_new_tokens=3)
    assert "offloaded_cache, no_cache" in str(err.value) and "Lower max_new_tokens" in str(err.value)
    assert len(f.calls) == 3  # plain ids cannot be rebuilt: cache rung, no-cache rung, give up
    f.fail_on = set()
    assert gen.generate([1, 2, 3, 4, 5], max_new_tokens=3).new_tokens <= 3  # still usable


def test_oom_ladder_skips_the_cache_rung_where_no_smaller_cache_runs(gen, faulty, monkeypatch) -> None:
    """On a CPU without hqq (quanto would compile kernels for minutes; offloading needs CUDA)
    the ladder goes straight from the prompt to use_cache=False."""
    monkeypatch.setattr(generate_mod, "quant_backend", lambda device=None: None)
    f = faulty({1})
    g = gen.generate([1, 2, 3, 4, 5], max_new_tokens=3)
    assert [s.action for s in g.oom_steps] == ["no_cache"] and g.cache == "none"
    assert f.calls[1]["use_cache"] is False


@pytest.mark.parametrize(
    ("device", "installed", "want"),
    [
        ("cuda:0", {"optimum.quanto", "hqq"}, "quantized"),
        ("cuda:0", set(), "offloaded"),
        ("cpu", {"optimum.quanto"}, None),
        ("cpu", {"optimum.quanto", "hqq"}, "quantized"),
        ("cpu", set(), None),
    ],
)
def test_smaller_cache_per_device(monkeypatch, device, installed, want) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in installed else None)
    assert smaller_cache(device) == want
    backend = quant_backend(device)
    if want == "quantized":
        # transformers only accepts the lower-case spellings.
        assert backend == ("quanto" if device.startswith("cuda") else "hqq")


def test_offloaded_cache_on_cpu_is_a_clear_error(gen) -> None:
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        gen.generate("hi", max_new_tokens=2, cache="offloaded")


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
    full = gen.generate("hi", max_new_tokens=20)
    assert full.finish_reason == "length"
    stop = printable_stop(full.text)
    cut = gen.generate("hi", max_new_tokens=20, stop=[stop, "never-appears"])
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert cut.text == full.text[: full.text.index(stop)].strip()
    # transformers' stop_strings ended the generation itself, not just our trimming.
    assert cut.new_tokens < full.new_tokens
    assert gen.generate("hi", max_new_tokens=20, stop=stop).text == cut.text  # a bare string works too


def test_streamed_text_never_shows_a_stop_string(gen) -> None:
    full = gen.generate("hi", max_new_tokens=20)
    stop = printable_stop(full.text)
    pieces: list[str] = []
    cut = gen.generate("hi", max_new_tokens=20, stop=[stop], on_text=pieces.append)
    assert "".join(pieces).strip() == cut.text and stop not in "".join(pieces)
    items = list(gen.stream("hi", max_new_tokens=20, stop=[stop]))
    assert "".join(items[:-1]).strip() == cut.text and items[-1].finish_reason == "stop"


def test_generation_stops_at_a_line_repeated_three_times(gen) -> None:
    """A model that loops on one line (here the tiny model, biased to write "ab" forever through
    its own generation_config): the generation stops at the third copy, the answer and the
    stream keep it once."""
    import copy

    tok = gen.tokenizer
    a, b, nl = (tok.encode(c, add_special_tokens=False)[0] for c in ("a", "b", "\n"))
    looping = Generator.from_objects(copy.deepcopy(gen.model), tok)
    looping.model.generation_config.sequence_bias = {(nl, a): 100.0, (a, b): 100.0, (b, nl): 100.0}
    pieces: list[str] = []
    out = looping.generate("hi", max_new_tokens=30, on_text=pieces.append)
    assert (out.text, out.finish_reason, out.new_tokens) == ("ab", "stop", 9)  # three "ab\n", not 30 tokens
    assert "".join(pieces) == "ab"


def test_the_models_repetition_penalty_is_its_generation_configs(gen) -> None:
    import copy

    assert gen.repetition_penalty == 1.0  # the tiny model's config sets none
    penalized = Generator.from_objects(copy.deepcopy(gen.model), gen.tokenizer)
    penalized.model.generation_config.repetition_penalty = 1e4
    assert penalized.repetition_penalty == 1e4
    plain, once = gen.generate("hello there", max_new_tokens=16), penalized.generate("hello there", max_new_tokens=16)
    assert once.text != plain.text  # generate applies the checkpoint's penalty (batching: test_batching)


def test_generator_is_lazy() -> None:
    g = Generator("some/unloaded-model")
    assert "not loaded" in repr(g) and not g.loaded


@pytest.mark.model
def test_smollm2_short_capped_answer() -> None:
    gen = Generator()
    hits = [
        Candidate(
            "1", "The Eiffel Tower is in Paris. It was completed in 1889.", 0.9, sources=(Source("paris.txt", 0, 55),)
        )
    ]
    prompt = build_prompt("When was the Eiffel Tower completed?", hits, tokenizer=gen.tokenizer, max_prompt_tokens=400)
    g = gen.generate(prompt, max_new_tokens=24)
    assert g.new_tokens <= 24 and g.prompt_tokens == prompt.n_tokens <= 400
    assert "1889" in g.text


@pytest.mark.model
def test_smollm2_stops_at_a_line_it_repeats_and_keeps_its_generation_config() -> None:
    """The packaged SmolLM2 (its GGUF, converted): the stop on a repeated line works on its real
    BPE tokens (a newline may share a token with other text), streamed or not, batched or not.
    Its loop is forced through its own generation_config (a sequence bias writing "pipe" lines
    forever): greedy SmolLM2 loops on long RAG answers (issue #30), not on any short prompt."""
    from ragbudget.generation.batching import Batcher

    gen = Generator()
    tok = gen.tokenizer
    # Its own generation_config, as the GGUF gives it: the stop token <|im_end|>, no penalty.
    assert tok.convert_ids_to_tokens(sorted(gen.eos_ids())) == ["<|im_end|>"] and gen.repetition_penalty == 1.0
    pipe, nl = tok.encode("pipe", add_special_tokens=False), tok.encode("\n", add_special_tokens=False)
    assert len(pipe) == len(nl) == 1
    gen.model.generation_config.sequence_bias = {(nl[0], pipe[0]): 100.0, (pipe[0], nl[0]): 100.0}
    try:
        pieces: list[str] = []
        out = gen.generate("Say something.", max_new_tokens=64, on_text=pieces.append)
        assert (out.text, out.finish_reason, out.new_tokens) == ("pipe", "stop", 6)  # 3 x "pipe\n", not 64
        assert "".join(pieces) == "pipe"
    finally:
        gen.model.generation_config.sequence_bias = None
    # Batched, the row processor does not apply a sequence bias: the repeated-line stop is the
    # streamer's (test_a_stream_never_shows_a_repeated_line_and_stops_at_the_third); here the
    # batched answer to a plain prompt equals the unbatched one.
    b = Batcher(gen, kv_tokens=512)
    try:
        batched = b.generate("Say something.", max_new_tokens=12)
        assert batched.text == gen.generate("Say something.", max_new_tokens=12).text
    finally:
        b.close()


def test_cancel_stops_early(gen) -> None:
    import threading

    ev = threading.Event()
    pieces: list[str] = []

    def on_text(s: str) -> None:
        pieces.append(s)
        ev.set()  # cancel as soon as the first text arrives

    g = gen.generate("hi", max_new_tokens=40, on_text=on_text, cancel=ev)
    assert g.finish_reason in ("cancelled", "stop") and g.new_tokens < 40


def test_generator_measures_its_cuda_peak_and_writes_nothing(gen, tmp_path, monkeypatch) -> None:
    # Calibration is the planner's file: the generator hands its measurement back in the
    # Generation and leaves recording it to the caller that owns the plan (the pipeline).
    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path))
    as_on_cuda(gen, monkeypatch)
    g = gen.generate("hi", max_new_tokens=3)
    m = g.measurement
    assert m is not None
    assert m.gpu_name == CUDA_NAME and m.measured_peak_bytes == CUDA_PEAK
    assert m.tokens == g.prompt_tokens and m.batch_size == 1 and m.cache == g.cache == "dynamic"
    assert m.weights_bytes > 0 and m.kv_bytes > 0
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_cpu_generation_has_no_measurement(gen) -> None:
    assert gen.generate("hi", max_new_tokens=2).measurement is None


def test_the_gguf_conversion_bar_is_off_away_from_a_terminal(monkeypatch) -> None:
    import io
    import sys

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from ragbudget.generation.generate import gguf_bar_only_on_a_terminal

    # transformers' own conversion loop draws this bar with tqdm (not its own switch); off a
    # terminal it is hundreds of carriage-return redraws in a log.
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)  # not a terminal
    original = gguf_utils.tqdm
    with gguf_bar_only_on_a_terminal():
        for _ in gguf_utils.tqdm(range(50), desc="Converting and de-quantizing GGUF tensors...", file=out):
            pass
    assert out.getvalue() == "" and gguf_utils.tqdm is original  # quiet, and put back after
    for _ in gguf_utils.tqdm(range(3), file=out):
        pass
    assert "\r" in out.getvalue()  # outside the call the bar is transformers' own again
