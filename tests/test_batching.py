"""Batched generation on a tiny random Llama: the same answers as one-at-a-time, per request."""

from __future__ import annotations

import threading
import time

import pytest
from _tiny_lm import tiny_model, tiny_tokenizer

from ragbudget.backend import LocalBackend, Sampling
from ragbudget.batching import Batcher, batching_unsupported
from ragbudget.errors import BudgetError, ConfigError
from ragbudget.generate import Generator
from ragbudget.kvcache import paged_cache_layout

pytest.importorskip("transformers.generation.continuous_batching")


@pytest.fixture(scope="module")
def gen() -> Generator:
    return Generator.from_objects(tiny_model(), tiny_tokenizer())


@pytest.fixture(scope="module")
def batcher(gen):
    b = Batcher(gen, kv_tokens=600, page_size=16)
    yield b
    b.close()


def _together(fn, calls):
    """Run ``fn(**kw)`` for every kw in ``calls`` at once, each in its own thread."""
    out: list = [None] * len(calls)
    errors: list = []

    def work(i):
        try:
            out[i] = fn(**calls[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def test_greedy_answer_and_the_real_paged_cache(gen, batcher) -> None:
    alone = gen.generate("hello there", max_new_tokens=12)
    g = batcher.generate("hello there", max_new_tokens=12)
    assert (g.text, g.new_tokens, g.finish_reason) == (alone.text, 12, "length")
    assert g.cache == "paged" and g.prompt_tokens == alone.prompt_tokens
    # The KV model is the cache really allocated: 600 tokens → 38 blocks of 16, to the byte.
    layout = paged_cache_layout(gen.model.config, num_blocks=38, page_size=16, kv_dtype="float32")
    assert batcher.layout == layout and batcher.cache_tensor.nbytes == layout.total_bytes
    assert layout.capacity_tokens >= 600


def test_concurrent_requests_keep_their_own_sampling_seeds_and_caps(gen, batcher) -> None:
    calls = [{"prompt": f"question {i}?", "max_new_tokens": 6 + 3 * i,
                  "temperature": 0.9 if i % 2 else None, "seed": 100 + i} for i in range(6)]
    together = _together(batcher.generate, calls)
    for kw, g in zip(calls, together, strict=False):
        alone = gen.generate(**kw)  # the unbatched path, one request alone
        assert g.text == alone.text and g.new_tokens == alone.new_tokens == kw["max_new_tokens"]
    # A seed draws the same answer whatever shares the batch; another seed draws another.
    again = batcher.generate("question 1?", max_new_tokens=9, temperature=0.9, seed=101)
    other = batcher.generate("question 1?", max_new_tokens=9, temperature=0.9, seed=7)
    assert again.text == together[1].text != other.text


def test_streaming_and_stop_strings_per_request(gen, batcher) -> None:
    full = gen.generate("stream me", max_new_tokens=30).text
    # A stop string whose first occurrence is inside the answer (the random model repeats).
    stop = next(full[k:k + 2] for k in range(3, len(full) - 2) if full.find(full[k:k + 2]) == k)
    pieces: list[str] = []
    g, plain = _together(batcher.generate, [
        {"prompt": "stream me", "max_new_tokens": 30, "stop": [stop], "on_text": pieces.append},
        {"prompt": "stream me", "max_new_tokens": 30}])
    assert g.finish_reason == "stop" and g.text == full[:full.find(stop)].strip()
    assert g.new_tokens < 30  # the request ended there, not at the cap
    assert "".join(pieces).strip() == g.text and stop not in "".join(pieces)
    assert plain.text == full and plain.finish_reason == "length"  # its neighbour did not stop


def test_cancel_returns_at_once_and_frees_the_request(gen, batcher) -> None:
    ev = threading.Event()
    seen: list[str] = []

    def on_text(piece: str) -> None:
        seen.append(piece)
        ev.set()

    t0 = time.perf_counter()
    long, short = _together(batcher.generate, [
        {"prompt": "long one", "max_new_tokens": 500, "on_text": on_text, "cancel": ev},
        {"prompt": "short one", "max_new_tokens": 20}])
    assert long.finish_reason == "cancelled" and 1 <= long.new_tokens < 500
    assert short.finish_reason == "length" and short.new_tokens == 20
    assert time.perf_counter() - t0 < 30
    scheduler = batcher._manager.batch_processor.scheduler
    deadline = time.time() + 5
    while (scheduler.active_requests or scheduler.waiting_requests) and time.time() < deadline:
        time.sleep(0.02)
    assert not scheduler.active_requests and not scheduler.waiting_requests


def test_refusals(gen, batcher) -> None:
    with pytest.raises(BudgetError, match="paged cache"):
        batcher.generate([5] * 600, max_new_tokens=100)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        batcher.generate("hi", max_new_tokens=0)
    with pytest.raises(ConfigError, match="kv_tokens"):
        Batcher(gen, kv_tokens=0)
    with pytest.raises(ConfigError, match="temperature"):
        batcher.generate("hi", max_new_tokens=2, temperature=-1)


def test_local_backend_batches_by_default_and_can_be_switched_off(gen) -> None:
    backend = LocalBackend(gen, batch_kv_tokens=256)
    try:
        g = backend.generate("hello there", max_new_tokens=5, sampling=Sampling(temperature=0.7,
                                                                               seed=4))
        assert g.cache == "paged" and backend.batcher is not None
        assert g.text == gen.generate("hello there", max_new_tokens=5, temperature=0.7,
                                      seed=4).text
        cap = backend.capacity()
        assert cap.kv_tokens_total == backend.batcher.layout.capacity_tokens == 256
        assert "paged cache" in cap.kv_total_source
    finally:
        backend.close()
    off = LocalBackend(gen, batching=False)
    assert off.generate("hello", max_new_tokens=3).cache == "dynamic" and off.batcher is None
    static = LocalBackend(gen, cache="static")  # what batching does not do runs unbatched
    assert static.generate("hello", max_new_tokens=3).cache == "static"
    with pytest.raises(ConfigError, match="batching"):
        LocalBackend(gen, batching="yes")  # type: ignore[arg-type]


def test_an_eager_model_is_not_batched(gen) -> None:
    model = tiny_model()
    model.set_attn_implementation("eager")
    eager = Generator.from_objects(model, tiny_tokenizer())
    assert "sdpa" in (batching_unsupported(eager) or "")
    assert LocalBackend(eager).generate("hi", max_new_tokens=2).cache == "dynamic"
    with pytest.raises(ConfigError, match="batching=False"):
        LocalBackend(eager, batching=True).generate("hi", max_new_tokens=2)


def test_admission_counts_the_paged_cache_when_the_backend_batches(gen, tmp_path, monkeypatch) -> None:
    from ragbudget.pipeline import Pipeline

    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))  # the speed probe's record
    backend = LocalBackend(gen, gpu="1GiB", batch_kv_tokens=256)
    try:
        assert backend.batched is True
        rb = Pipeline(tmp_path / "index", backend=backend, gpu="1GiB")
        ctl = rb.admission
        layout, plan = backend.batcher.layout, rb.plan
        # Tokens against the paged cache; bytes: the memory beside the weights and the cache.
        assert ctl.token_capacity == layout.capacity_tokens == 256
        assert ctl.memory.capacity_bytes == plan.usable_bytes - plan.weights_bytes - layout.total_bytes
        assert ctl.throughput is not None and ctl.throughput.batched
        assert ctl.memory.request_bytes(prompt_tokens=10, tokens=100) == ctl.memory.activation_bytes(10)
    finally:
        backend.close()
    off = LocalBackend(gen, gpu="1GiB", batching=False)
    assert off.batched is False
    ctl = Pipeline(tmp_path / "index2", backend=off, gpu="1GiB").admission
    assert ctl.token_capacity is None and not ctl.throughput.batched


def test_the_auto_sized_paged_cache_stays_within_the_plans_kv_bytes(gen, monkeypatch) -> None:
    """The paged cache may cost more per token than the plan's KV model (its own layout): sized
    automatically, it takes whole pages within the plan's KV bytes, so the activations the plan
    reserved beside it still fit; when that cannot hold one full request, generation runs
    unbatched (or, with batching=True, a ConfigError says why)."""
    import ragbudget.backend as backend_mod
    from ragbudget.batching import _dtype_name

    def size(blocks: int) -> int:
        return paged_cache_layout(gen.model.config, num_blocks=blocks, page_size=32,
                                  kv_dtype=_dtype_name(gen.model)).total_bytes

    budget = size(10) + 1
    tokens = backend_mod._paged_tokens_within(gen, 100_000, budget)
    # Whole pages, within the bytes, and the most that fit (one page more would not).
    assert tokens % 32 == 0 and size(tokens // 32) <= budget < size(tokens // 32 + 1)
    assert backend_mod._paged_tokens_within(gen, 100, budget) == 96  # never above what was asked
    assert backend_mod._paged_tokens_within(gen, 100_000, 1) == 32  # at least one page

    monkeypatch.setattr(backend_mod, "_paged_tokens_within", lambda *a, **k: 32)
    tight = LocalBackend(gen, gpu="1GiB")
    assert tight.batcher is None and tight.batched is False
    assert tight.generate("hello", max_new_tokens=3).cache == "dynamic"
    with pytest.raises(ConfigError, match="less than one request"):
        _ = LocalBackend(gen, gpu="1GiB", batching=True).batcher
