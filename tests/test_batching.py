"""Batched generation on a tiny random Llama: the same answers as one-at-a-time, per request."""

from __future__ import annotations

import threading
import time

import pytest
from _tiny_lm import tiny_model, tiny_tokenizer

from ragbudget.errors import BudgetError, ConfigError
from ragbudget.generation.backend import Sampling
from ragbudget.generation.batching import Batcher, batching_unsupported
from ragbudget.generation.generate import Generator
from ragbudget.generation.local import LocalBackend
from ragbudget.memory.kvcache import paged_cache_layout

pytest.importorskip("transformers.generation.continuous_batching")

# Every test generates with the tiny random Llama (tests/_needs.py).
pytestmark = pytest.mark.model


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
    calls = [
        {
            "prompt": f"question {i}?",
            "max_new_tokens": 6 + 3 * i,
            "temperature": 0.9 if i % 2 else None,
            "seed": 100 + i,
        }
        for i in range(6)
    ]
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
    stop = next(full[k : k + 2] for k in range(3, len(full) - 2) if full.find(full[k : k + 2]) == k)
    pieces: list[str] = []
    g, plain = _together(
        batcher.generate,
        [
            {"prompt": "stream me", "max_new_tokens": 30, "stop": [stop], "on_text": pieces.append},
            {"prompt": "stream me", "max_new_tokens": 30},
        ],
    )
    assert g.finish_reason == "stop" and g.text == full[: full.find(stop)].strip()
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
    long, short = _together(
        batcher.generate,
        [
            {"prompt": "long one", "max_new_tokens": 500, "on_text": on_text, "cancel": ev},
            {"prompt": "short one", "max_new_tokens": 20},
        ],
    )
    assert long.finish_reason == "cancelled" and 1 <= long.new_tokens < 500
    assert short.finish_reason == "length" and short.new_tokens == 20
    assert time.perf_counter() - t0 < 30
    deadline = time.time() + 5
    while batcher.active and time.time() < deadline:
        time.sleep(0.02)
    assert batcher.active == 0


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
        g = backend.generate("hello there", max_new_tokens=5, sampling=Sampling(temperature=0.7, seed=4))
        assert g.cache == "paged" and backend.batcher is not None
        assert g.text == gen.generate("hello there", max_new_tokens=5, temperature=0.7, seed=4).text
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


def test_a_transformers_without_pages_is_not_batched(gen, monkeypatch) -> None:
    # transformers 5.17 (the GPU image's) names it block_size: Batcher's config would raise
    # TypeError at warm-up and `ragbudget serve` would not start; it generates unbatched instead.
    import dataclasses

    import transformers

    @dataclasses.dataclass
    class OldConfig:
        block_size: int = 256
        num_blocks: int | None = None

    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", OldConfig)
    assert "page_size" in (batching_unsupported(gen) or "")
    assert LocalBackend(gen).generate("hi", max_new_tokens=2).cache == "dynamic"


def test_admission_counts_the_paged_cache_when_the_backend_batches(gen, tmp_path, monkeypatch) -> None:
    from ragbudget.memory.budget import CUBLAS_WORKSPACE_BYTES
    from ragbudget.pipeline import Pipeline

    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))  # the speed probe's record
    backend = LocalBackend(gen, gpu="1GiB", batch_kv_tokens=256)
    try:
        assert backend.batched is True
        rb = Pipeline(tmp_path / "index", backend=backend, gpu="1GiB")
        ctl = rb.admission
        layout, plan = backend.batcher.layout, rb.plan
        # Tokens against the paged cache; bytes: the memory beside the weights, the cache and
        # the process's one cuBLAS workspace.
        assert ctl.token_capacity == layout.capacity_tokens == 256
        assert ctl.memory.capacity_bytes == (
            plan.usable_bytes - plan.weights_bytes - layout.total_bytes - CUBLAS_WORKSPACE_BYTES
        )
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
    import ragbudget.generation.local as backend_mod

    def size(blocks: int) -> int:
        return paged_cache_layout(
            gen.model.config, num_blocks=blocks, page_size=32, kv_dtype=str(gen.model.dtype).removeprefix("torch.")
        ).total_bytes

    budget = size(10) + 1
    tokens = backend_mod.paged_tokens_within(gen, 100_000, budget)
    # Whole pages, within the bytes, and the most that fit (one page more would not).
    assert tokens % 32 == 0 and size(tokens // 32) <= budget < size(tokens // 32 + 1)
    assert backend_mod.paged_tokens_within(gen, 100, budget) == 96  # never above what was asked
    assert backend_mod.paged_tokens_within(gen, 100_000, 1) == 32  # at least one page

    monkeypatch.setattr(backend_mod, "paged_tokens_within", lambda *a, **k: 32)
    tight = LocalBackend(gen, gpu="1GiB")
    assert tight.batcher is None and tight.batched is False
    assert tight.generate("hello", max_new_tokens=3).cache == "dynamic"
    with pytest.raises(ConfigError, match="less than one request"):
        _ = LocalBackend(gen, gpu="1GiB", batching=True).batcher


# -- per-request attention in a batched step ---------------------------------------------------


def _packed(lengths, heads=4, kv_heads=2, dim=8, seed=0):
    """Random q/k/v packed as continuous batching packs them: per request (q_len, k_len), its
    q_len new queries being the last positions of its k_len keys."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(q for q, _ in lengths), sum(k for _, k in lengths)
    q = torch.randn(1, heads, tq, dim, generator=g)
    k = torch.randn(1, kv_heads, tk, dim, generator=g)
    v = torch.randn(1, kv_heads, tk, dim, generator=g)
    cq, ck = [0], [0]
    for ql, kl in lengths:
        cq.append(cq[-1] + ql)
        ck.append(ck[-1] + kl)
    return q, k, v, torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32)


def _dense_reference(q, k, v, cq, ck, window=None):
    """The block-diagonal mask transformers builds for SDPA, written out independently: query
    row r of request i sees key c of the same request when c <= its position (and, with a
    window, c > position - window)."""
    import torch

    tq, tk = q.shape[2], k.shape[2]
    mask = torch.zeros(tq, tk, dtype=torch.bool)
    for i in range(len(cq) - 1):
        q0, q1, k0, k1 = int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])
        for r in range(q0, q1):
            pos = (k1 - k0) - (q1 - q0) + (r - q0)  # this query's position among its keys
            for c in range(k0, k1):
                if c - k0 <= pos and (window is None or c - k0 > pos - window):
                    mask[r, c] = True
    rep = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask
    )
    return out.transpose(1, 2)


class _Layer:
    num_key_value_groups = 2

    def __init__(self, sliding_window=None):
        self.sliding_window = sliding_window


@pytest.mark.parametrize("window", [None, 5])
def test_per_request_attention_equals_the_dense_block_mask(window) -> None:
    import torch

    from ragbudget.generation.batching import per_request_sdpa

    # a decode step, a chunked prefill (queries in the middle of a longer read), a whole prompt,
    # and a one-token prompt, in one packed step
    q, k, v, cq, ck = _packed([(1, 9), (4, 11), (6, 6), (1, 1)])
    cb = {"cu_seq_lens_q": cq, "cu_seq_lens_k": ck, "read_index": [torch.arange(1)], "write_index": [torch.arange(1)]}
    got, _ = per_request_sdpa(_Layer(window), q, k, v, None, **cb)
    want = _dense_reference(q, k, v, cq.tolist(), ck.tolist(), window)
    assert got.shape == want.shape == (1, q.shape[2], q.shape[1], q.shape[3])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_per_request_masks_are_made_on_the_queries_device(window) -> None:
    """The first GPU run of the batched server failed every request: the per-request masks were
    made on the CPU beside CUDA queries. The meta device reproduces that here (it refuses a CPU
    tensor beside its own as CUDA does) without a GPU."""
    import torch

    from ragbudget.generation.batching import per_request_sdpa

    q, k, v, cq, ck = _packed([(1, 9), (4, 11), (6, 6), (1, 1)])
    cb = {"cu_seq_lens_q": cq, "cu_seq_lens_k": ck, "read_index": [torch.arange(1)], "write_index": [torch.arange(1)]}
    got, _ = per_request_sdpa(_Layer(window), q.to("meta"), k.to("meta"), v.to("meta"), None, **cb)
    assert got.device.type == "meta" and got.shape == (1, q.shape[2], q.shape[1], q.shape[3])


def test_the_batch_loop_allocates_no_dense_mask_beside_the_paged_cache(gen, batcher) -> None:
    """For SDPA, transformers' batch processor would hold a (step tokens) × (cache tokens + step
    tokens) mask in the model's dtype for the whole loop (here 48 MiB beside a 6 MiB cache),
    which per_request_sdpa never reads and no plan counts: none is allocated."""
    import torch

    assert batcher.generate([5] * 8, max_new_tokens=2).new_tokens == 2
    # Everything the step buffers hold together is less than that mask alone would be.
    itemsize = torch.empty(0, dtype=gen.model.dtype).element_size()
    mask_bytes = batcher.max_batch_tokens * (batcher.layout.capacity_tokens + batcher.max_batch_tokens) * itemsize
    assert 0 < batcher.step_buffer_bytes < mask_bytes


def test_outside_a_batched_step_sdpa_is_transformers_own(gen, batcher) -> None:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ragbudget.generation import batching

    assert batcher.generate([5] * 8, max_new_tokens=1).new_tokens == 1  # a batched run installs it
    q, k, v, _, _ = _packed([(5, 5)])
    got, _ = batching.per_request_sdpa(_Layer(), q, k, v, None, scaling=0.3)
    want, _ = sdpa_attention_forward(_Layer(), q, k, v, None, scaling=0.3)
    torch.testing.assert_close(got, want)
    # and the unbatched generator still gives its answer with it installed
    assert gen.generate("hello there", max_new_tokens=8).new_tokens == 8


def test_chunked_prefills_of_different_lengths_batch_to_the_same_answers(gen) -> None:
    # max_batch_tokens 24: the longer prompts are prefilled in chunks next to others' decodes,
    # the case where a query must see only the earlier part of its own keys.
    b = Batcher(gen, kv_tokens=2048, page_size=16, max_batch_tokens=24)
    try:
        calls = [{"prompt": "word " * n + "?", "max_new_tokens": 10} for n in (3, 40, 17, 70)]
        together = _together(b.generate, calls)
        for kw, g in zip(calls, together, strict=True):
            assert g.text == gen.generate(**kw).text
    finally:
        b.close()


def test_in_own_thread_runs_apart_and_hands_back_the_value_or_the_error() -> None:
    """Model work outside the batching loop runs in a thread that ends with it, so its OpenMP
    pool does not live on beside the loop's (ragbudget.generation.batching, "which thread runs the model")."""
    from ragbudget.generation.batching import in_own_thread

    caller = threading.get_ident()
    seen: list[int] = []

    def work(x: int, *, y: int) -> int:
        seen.append(threading.get_ident())
        return x + y

    assert in_own_thread(work, 2, y=3) == 5
    assert seen and seen[0] != caller
    alive = {t.ident for t in threading.enumerate()}
    assert seen[0] not in alive  # it ended with the call

    def fail() -> None:
        raise BudgetError("too long", needed=2, available=1)

    with pytest.raises(BudgetError, match="too long"):
        in_own_thread(fail)


def test_the_speed_probe_runs_in_a_thread_of_its_own(gen, tmp_path, monkeypatch) -> None:
    """The warm-up's prefill/decode probe (forward passes) must not run in the caller's thread,
    the server's main thread, whose OpenMP pool would then slow the batching loop for the
    server's life."""
    import ragbudget.memory.calibration
    from ragbudget.generation.pacing import Pacing

    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))
    ran: list[int] = []

    def probe(model, *, name, device):  # type: ignore[no-untyped-def]
        ran.append(threading.get_ident())
        return {"a": 1e-3, "b": 0.0, "decode_s": 0.01}

    monkeypatch.setattr(ragbudget.memory.calibration, "measure_prefill_speed", probe)
    speed = Pacing(None).measure(gen.warm_up(), "tiny")
    assert speed == {"a": 1e-3, "b": 0.0, "decode_s": 0.01}
    assert ran and ran[0] != threading.get_ident()


def test_the_models_repetition_penalty_applies_batched_as_unbatched() -> None:
    """transformers drops its repetition penalty from continuous batching; the row processor
    applies the model's own (generation_config) per request, so a batched answer is the one
    ``generate`` gives."""
    model = tiny_model()
    model.generation_config.repetition_penalty = 1e4
    penalized = Generator.from_objects(model, tiny_tokenizer())
    plain = Generator.from_objects(tiny_model(), tiny_tokenizer()).generate("hello there", max_new_tokens=24)
    alone = penalized.generate("hello there", max_new_tokens=24)
    assert alone.text != plain.text
    b = Batcher(penalized, kv_tokens=600, page_size=16)
    try:
        calls = [{"prompt": "hello there", "max_new_tokens": 24}, {"prompt": "question 1?", "max_new_tokens": 9}]
        together = _together(b.generate, calls)
    finally:
        b.close()
    assert together[0].text == alone.text
    assert together[1].text == penalized.generate("question 1?", max_new_tokens=9).text


# A process that exits while the batching loop is inside a forward pass: before the loop was
# stopped at exit, libstdc++ tore the runtime down under the running op and the process died with
# "terminate called without an active exception" (exit status 134) — what `ragbudget ask` did
# whenever an answer ended (a stop string, a repeated line) while the loop still ran (issue #42).
_EXIT_WHILE_BUSY = """
import sys, threading
from ragbudget.generation.batching import Batcher
from ragbudget.generation.generate import Generator

batcher = Batcher(Generator(), kv_tokens=2048)
flowing = threading.Event()
threading.Thread(
    target=lambda: batcher.generate(
        "Tell me a long story about a lighthouse keeper.", max_new_tokens=500, on_text=lambda _: flowing.set()
    ),
    daemon=True,
).start()
if not flowing.wait(120):
    sys.exit("no token in 120 s")
"""


def test_a_process_exiting_while_the_loop_runs_exits_cleanly() -> None:
    import subprocess
    import sys

    for attempt in range(2):  # the race is nearly certain (500 tokens to go); twice to be sure
        done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_BUSY], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (attempt, done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr
