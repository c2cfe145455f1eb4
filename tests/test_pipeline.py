"""Pipeline: plan -> retrieve -> select -> prompt -> admitted generation, end to end.

Model-free by default: a word-level fake tokenizer (no chat template, so the plain layout is used)
and a fake generator that records the prompt it was given. The real embedded models run in the
``slow`` test at the bottom (the `make demo` path).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _fakes import FakeGenerator

from ragbudget import BudgetError, ConfigError, IndexNotFoundError, Pipeline


@pytest.fixture(scope="module")
def indexed(tmp_path_factory: pytest.TempPathFactory, repo_data: Path) -> Path:
    """The repo's data/ corpus indexed once with the model-free hash embedder."""
    index_dir = tmp_path_factory.mktemp("pipe") / "idx"
    summary = Pipeline(index_dir, embedder="hash:256").index([repo_data])
    assert summary.files_indexed >= 8 and summary.chunks_total > 20
    return index_dir


def _pipe(index_dir: Path, **kw: Any) -> tuple[Pipeline, FakeGenerator]:
    gen = kw.pop("generator", None) or FakeGenerator()
    kw.setdefault("gpu", "16GiB")
    return Pipeline(index_dir, generator=gen, **kw), gen


QUESTION = "What was Maria Curie the first female recipient of?"


@pytest.mark.parametrize("hybrid", [True, False])
def test_retrieve_fits_the_context_cap_exactly(indexed: Path, hybrid: bool) -> None:
    # The default span floor leaves weak sentences out whatever room is left: never over the cap.
    pipe, _ = _pipe(indexed, hybrid=hybrid)
    for cap in (50, 300, 1200):
        sel = pipe.retrieve(QUESTION, context_tokens=cap)
        assert sel.chunks and sel.tokens_used <= sel.tokens_allowed <= cap
    # With span_floor=0 the allowance is filled.
    pipe, _ = _pipe(indexed, hybrid=hybrid, span_floor=0)
    for cap in (50, 300, 1200):
        sel = pipe.retrieve(QUESTION, context_tokens=cap)
        assert sel.tokens_allowed <= cap
        assert sel.tokens_used <= sel.tokens_allowed
        assert sel.chunks, "something fits in every cap tried here"
        # The knapsack leaves no room a dropped candidate would clearly fit in (labels < 40).
        room = sel.tokens_allowed - sel.tokens_used
        assert all(d.n_tokens > room - 40 for d in sel.dropped if d.reason == "over_budget")
        if cap >= 1200 and not hybrid:
            # Dense ranking here has a 231-token chunk to pair with the best; the hybrid one's
            # best chunk is 762 tokens and every other candidate is over 400: lower fill, no gap.
            assert sel.fill >= 0.8


def test_ask_prompt_fits_the_plan_and_keeps_the_question(indexed: Path) -> None:
    pipe, gen = _pipe(indexed, max_new_tokens=64)
    answer = pipe.ask(QUESTION)
    prompt = gen.prompts[-1]
    plan = pipe.plan_for(64)
    assert prompt.n_tokens <= plan.max_prompt_tokens
    assert prompt.n_tokens + 64 <= plan.max_context_tokens
    assert QUESTION in prompt.messages[-1]["content"]
    b = answer.report["budget"]
    assert b["prompt_tokens"] == prompt.n_tokens
    assert b["context_tokens_used"] <= b["context_tokens_allowed"]
    assert b["max_new_tokens"] == 64
    assert b["kv_bytes_per_token"] == plan.kv_bytes_per_token
    doc = answer.to_dict()
    assert set(doc) >= {"answer", "sources", "budget", "dropped"}
    assert doc["sources"] and set(doc["sources"][0]) >= {"path", "start", "end", "page", "score"}
    # The Warsaw article holds the answer; the hash embedder shares its words with the question.
    assert any("Warsaw" in s["path"] for s in doc["sources"])
    for d in doc["dropped"]:
        assert d["reason"] in {
            "duplicate",
            "below_cutoff",
            "below_relevance_floor",
            "redundant",
            "below_span_floor",
            "over_budget",
        }


def test_small_gpu_shrinks_the_context(indexed: Path) -> None:
    # SmolLM2-135M (bf16 estimate ~260 MiB weights, 22.5 KiB KV per token) on 357 MiB (320 + the
    # cuBLAS workspace's 33 ÷ 0.9): memory, not the model's 8k window, limits the request, and the
    # context shrinks to match.
    big, _ = _pipe(indexed, gpu="16GiB")
    small, gen = _pipe(indexed, gpu="357MiB")
    assert small.plan.limited_by == "memory"
    assert small.plan.max_context_tokens < big.plan.max_context_tokens
    small.ask(QUESTION)
    assert gen.prompts[-1].n_tokens <= small.plan.max_prompt_tokens


def test_question_that_cannot_fit_is_a_budget_error(indexed: Path) -> None:
    pipe, _ = _pipe(indexed, gpu="357MiB")
    long_question = "why " * (pipe.plan.max_prompt_tokens + 10)
    with pytest.raises(BudgetError) as err:
        pipe.ask(long_question)
    assert "question" in str(err.value) and err.value.needed > err.value.available


def test_streaming_and_bad_input(indexed: Path) -> None:
    pipe, _ = _pipe(indexed)
    pieces: list[str] = []
    answer = pipe.ask(QUESTION, on_text=pieces.append)
    assert "".join(pieces).strip() == answer.text
    with pytest.raises(ConfigError):
        pipe.ask("   ")
    with pytest.raises(ConfigError):
        Pipeline(indexed, concurrency=0)


def test_stream_yields_the_answer_text_and_then_the_answer(indexed: Path) -> None:
    pipe, gen = _pipe(indexed)
    with pipe.stream(QUESTION, max_new_tokens=32) as stream:
        pieces = list(stream)
    assert "".join(pieces).strip() == stream.answer.text == gen.answer
    assert stream.answer.sources == pipe.ask(QUESTION, max_new_tokens=32).sources
    assert stream.answer.report["budget"]["max_new_tokens"] == 32 and not stream.cancelled
    assert list(stream) == []  # an ended stream stays ended


def test_leaving_a_stream_early_cancels_and_frees_the_reservation(indexed: Path) -> None:
    gen = FakeGenerator(answer=" ".join(f"w{i}" for i in range(200)), word_delay=0.01)
    pipe, _ = _pipe(indexed, generator=gen)
    for _piece in (stream := pipe.stream(QUESTION)):
        assert pipe.admission.stats().admitted_tokens > 0  # the request holds its KV tokens
        break
    stream.close()
    assert stream.cancelled and gen.cancelled == 1 and stream.answer.finish_reason == "cancelled"
    assert pipe.admission.stats().admitted_tokens == 0
    assert pipe.ask(QUESTION).text  # the pipeline serves the next request


def test_break_alone_cancels_a_stream(indexed: Path) -> None:
    gen = FakeGenerator(answer=" ".join(f"w{i}" for i in range(500)), word_delay=0.01)
    pipe, _ = _pipe(indexed, generator=gen)
    stream = pipe.stream(QUESTION)
    for _piece in stream:
        break  # no close(), no with: leaving the loop is enough
    assert stream.cancelled and gen.cancelled == 1
    assert stream.answer.finish_reason == "cancelled" and pipe.admission.stats().admitted_tokens == 0


def test_closing_a_queued_stream_leaves_the_queue_without_generating(indexed: Path) -> None:
    gen = FakeGenerator()
    pipe, _ = _pipe(indexed, generator=gen, queue_timeout=60.0)
    capacity = pipe.admission.stats().capacity_tokens
    held = pipe.admission.acquire(capacity)  # the GPU is busy
    try:
        stream = pipe.stream(QUESTION)
        while pipe.admission.stats().queued == 0:
            time.sleep(0.005)
        stream.close()
        # Had close() waited for the 60 s queue timeout, the answer would be an OverloadedError.
        assert stream.error is None and stream.answer.finish_reason == "cancelled"
        assert stream.answer.text == "" and stream.answer.report["budget"]["prompt_tokens"] > 0
        assert pipe.admission.stats().queued == 0 and not gen.prompts
    finally:
        held.release()


def test_stream_errors_reach_the_caller(indexed: Path) -> None:
    pipe, _ = _pipe(indexed, gpu="357MiB")
    with pytest.raises(BudgetError, match="question"):
        list(pipe.stream("why " * (pipe.plan.max_prompt_tokens + 10)))
    with pytest.raises(ConfigError, match="on_text"):
        pipe.stream(QUESTION, on_text=print)
    with pytest.raises(ConfigError, match="running event loop"):
        pipe.astream(QUESTION)


def test_astream_and_aask_do_not_block_the_event_loop(indexed: Path) -> None:
    import asyncio

    gen = FakeGenerator(answer=" ".join(f"w{i}" for i in range(20)), word_delay=0.01)
    pipe, _ = _pipe(indexed, generator=gen)

    async def main() -> tuple[list[str], Any, Any, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        t = asyncio.create_task(ticker())
        pieces = []
        seen = []  # the ticker's count at each piece: it must move while the model "generates"
        async with pipe.astream(QUESTION) as stream:
            async for piece in stream:
                pieces.append(piece)
                seen.append(ticks)
        with pytest.raises(ConfigError, match="async for"):
            next(stream)
        answers = await asyncio.gather(*(pipe.aask(QUESTION) for _ in range(3)))
        t.cancel()
        return pieces, stream.answer, answers, seen

    pieces, answer, answers, seen = asyncio.run(main())
    assert "".join(pieces).strip() == answer.text == gen.answer
    assert [a.text for a in answers] == [gen.answer] * 3
    assert seen[-1] > seen[0]  # the loop kept running between the pieces


def test_cancelling_aask_cancels_the_generation(indexed: Path) -> None:
    import asyncio

    gen = FakeGenerator(answer=" ".join(f"w{i}" for i in range(500)), word_delay=0.01)
    pipe, _ = _pipe(indexed, generator=gen)

    async def main() -> None:
        task = asyncio.create_task(pipe.aask(QUESTION))
        while not gen.prompts:  # generating
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    # The generation stopped before its 500 words, and its KV tokens went back.
    assert gen.cancelled == 1 and pipe.admission.stats().admitted_tokens == 0


def test_missing_index_is_a_clear_error(tmp_path: Path) -> None:
    pipe, _ = _pipe(tmp_path / "nothing-here")
    with pytest.raises(IndexNotFoundError):
        pipe.search("anything")


def test_concurrent_asks_never_oversubscribe_the_kv_capacity(indexed: Path) -> None:
    gen = FakeGenerator(delay=0.05)
    pipe, _ = _pipe(indexed, generator=gen, gpu="337MiB", max_new_tokens=32)
    capacity = pipe.admission.stats().capacity_tokens
    assert capacity == pipe.plan.kv_capacity_tokens
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, pipe.admission.stats().admitted_tokens)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=pipe.ask, args=(QUESTION,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert len(gen.prompts) == 8
    assert 0 < peak <= capacity


def test_ask_without_an_index_fails_before_loading_a_model(tmp_path: Path) -> None:
    class Untouchable:
        loaded = False

        @property
        def tokenizer(self) -> Any:
            raise AssertionError("the generator was loaded before the index was checked")

    pipe = Pipeline(tmp_path / "nothing-here", generator=Untouchable())  # type: ignore[arg-type]
    with pytest.raises(IndexNotFoundError):
        pipe.ask(QUESTION)


def test_hybrid_search_is_default_and_can_be_turned_off(indexed: Path) -> None:
    pipe, _ = _pipe(indexed)
    dense, _ = _pipe(indexed, hybrid=False)
    assert pipe.hybrid and pipe.fusion == "score"
    hyb = pipe.search(QUESTION, k=8)
    only = dense.search(QUESTION, k=8)
    assert only == pipe.store.search(QUESTION, k=8)  # hybrid=False: the dense search exactly
    assert any("Warsaw" in h.sources[0].path for h in hyb[:3])
    # Fused scores stay on the cosine scale of the dense candidates.
    assert hyb[0].score <= max(h.score for h in pipe.store.search(QUESTION, k=50)) + 1e-6
    off, _ = _pipe(indexed, lexical_weight=0.0)
    assert [h.chunk_id for h in off.search(QUESTION, k=8)] == [h.chunk_id for h in only]
    with pytest.raises(ConfigError):
        Pipeline(indexed, lexical_weight=2.0)
    with pytest.raises(ConfigError):
        Pipeline(indexed, fusion="sum")


def test_questions_with_search_syntax_are_answered(indexed: Path) -> None:
    pipe, _ = _pipe(indexed)
    for q in ('Who was "Maria Curie', "NOT Curie AND (Warsaw OR *", "Curie NEAR(prize, 2) ^first"):
        sel = pipe.retrieve(q, context_tokens=300)
        assert sel.chunks and sel.tokens_used <= sel.tokens_allowed


# -- honest errors and sensible defaults (issue #19, section 4) ---------------------------------


def test_budget_errors_name_the_binding_limit(indexed: Path) -> None:
    from ragbudget.errors import BudgetError

    # 16 GiB holds far more than SmolLM2's 8,192-token window: the window binds, not memory.
    pipe, gen = _pipe(indexed, gpu="16GiB")
    with pytest.raises(BudgetError) as e:
        pipe.ask(QUESTION, max_new_tokens=100_000)
    assert e.value.limit == "window" and "8,192" in str(e.value)
    assert "GPU" not in str(e.value) and "fp8" not in str(e.value)
    with pytest.raises(BudgetError) as e:
        pipe.ask("why " * 9000)
    msg = str(e.value)
    assert e.value.limit == "window" and e.value.available == 8192
    assert "model window is 8,192 tokens" in msg and "shorten the question" in msg
    assert "GPU with more memory" not in msg
    assert not gen.prompts  # nothing was generated
    # On 357 MiB memory binds, and the message says how many tokens it holds.
    small, _ = _pipe(indexed, gpu="357MiB")
    with pytest.raises(BudgetError) as e:
        small.ask("why " * (small.plan.max_prompt_tokens + 10))
    assert e.value.limit == "memory"
    assert f"{small.plan.max_context_tokens:,} tokens per request" in str(e.value)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda p: p.ask(QUESTION, context_tokens="100"), "context_tokens must be an int"),
        (lambda p: p.ask(QUESTION, max_new_tokens="64"), "max_new_tokens must be an int"),
        (lambda p: p.ask(b"hi"), "decode it"),
        (lambda p: p.ask(42), "question must be str, got int"),
        (lambda p: p.search(QUESTION, k="3"), "k must be an int"),
        (lambda p: p.retrieve(QUESTION, context_tokens=1.5), "context_tokens must be an int"),
        (lambda p: p.ask(QUESTION, on_text="print"), "on_text must be a callable"),
        (lambda p: p.stream(b"hi"), "decode it"),
        (lambda p: Pipeline(p.index_dir, concurrency="4"), "concurrency must be an int"),
        (lambda p: Pipeline(p.index_dir, hybrid="no"), "hybrid must be True or False"),
        (lambda p: Pipeline(p.index_dir, relevance_floor="high"), "relevance_floor must be a number"),
        # Checked at the door (issue #30 §6): each was a bare TypeError, or an error at first use.
        (lambda p: p.index([42]), "paths must be a path .* got item 0: int 42"),
        (lambda p: p.index(None), "paths must be a path .* got NoneType None"),
        (lambda p: p.index(["data", 3]), "got item 1: int 3"),
        (lambda p: p.ask(QUESTION, temperature="hot"), "temperature must be a number, got str 'hot'"),
        (lambda p: Pipeline(p.index_dir, embedder=5), "embedder must be a model name"),
        (
            lambda p: Pipeline(p.index_dir, generator="gpt"),
            "generator must be a ragbudget.generation.generate.Generator",
        ),
        (lambda p: Pipeline(p.index_dir, backend=3), "backend must implement ragbudget.generation.backend.Backend"),
    ],
)
def test_wrong_argument_types_are_the_librarys_own_errors(indexed: Path, call: Any, match: str) -> None:
    from ragbudget.errors import ArgumentTypeError

    pipe, gen = _pipe(indexed)
    with pytest.raises(ArgumentTypeError, match=match) as e:
        call(pipe)
    # One except catches it as a bad argument, another as Python's own TypeError.
    assert isinstance(e.value, ConfigError) and isinstance(e.value, TypeError)
    assert not gen.prompts


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda p: p.ask(QUESTION, max_new_tokens=0), "max_new_tokens must be ≥ 1, got 0"),
        (lambda p: p.ask(QUESTION, context_tokens=-1), "context_tokens must be ≥ 0"),
        (lambda p: Pipeline(p.index_dir, order="random"), "order must be one of"),
        (lambda p: Pipeline(p.index_dir, utilization=0), "utilization must be in"),
        (lambda p: Pipeline(p.index_dir, relevance_floor=1.5), "relevance_floor must be in"),
        (lambda p: Pipeline(p.index_dir, cache="paged"), "cache must be one of"),
        # gpu: a bare int under 1 GiB is refused, not read as bytes (documented in MemorySettings).
        (lambda p: Pipeline(p.index_dir, gpu=24), "gpu=24 has no unit.*pass '24GiB'"),
        (lambda p: Pipeline(p.index_dir, gpu="potato"), "unknown GPU 'potato'"),
        (lambda p: Pipeline(p.index_dir, gpu="2xH100"), "a local generator runs on one"),
        (lambda p: Pipeline(p.index_dir, kv_dtype="potato"), "kv_dtype must be a dtype"),
        (lambda p: p.ask(QUESTION, max_tokens=8), "max_tokens is not an option of ask.*did you mean max_new_tokens"),
        (lambda p: p.ask(QUESTION, stop=5), "stop must be a string or a list"),
        (lambda p: p.index("data", chunk_size=100), "chunk_size: not an option of index.*max_tokens"),
    ],
)
def test_out_of_range_arguments_are_config_errors(indexed: Path, call: Any, match: str) -> None:
    pipe, gen = _pipe(indexed)
    with pytest.raises(ConfigError, match=match):
        call(pipe)
    assert not gen.prompts


def test_generate_options_are_checked_before_retrieval(indexed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pipe, gen = _pipe(indexed)
    searched: list[str] = []
    real = pipe.store.search  # the opened index ask() retrieves from
    monkeypatch.setattr(pipe.store, "search", lambda query, **kw: searched.append(query) or real(query, **kw))
    with pytest.raises(ConfigError, match="max_tokens"):
        pipe.ask(QUESTION, max_tokens=8)
    assert searched == [] and not gen.prompts
    pipe.ask(QUESTION, max_new_tokens=8, top_k=5)  # the local generator's own extras still pass
    assert searched == [QUESTION]


def test_a_given_max_new_tokens_is_honored(indexed: Path) -> None:
    pipe, gen = _pipe(indexed, max_new_tokens=64)
    seen: list[int] = []
    real = gen.generate

    def spy(prompt: Any, *, max_new_tokens: int, **kw: Any) -> Any:
        seen.append(max_new_tokens)
        return real(prompt, max_new_tokens=max_new_tokens, **kw)

    gen.generate = spy  # type: ignore[method-assign]
    answer = pipe.ask(QUESTION, max_new_tokens=1)
    assert seen == [1] and answer.report["budget"]["max_new_tokens"] == 1
    pipe.ask(QUESTION)
    assert seen == [1, 64]


def test_an_empty_index_is_an_error_not_an_answer_from_nothing(tmp_path: Path) -> None:
    from ragbudget.errors import IndexEmptyError

    (tmp_path / "empty").mkdir()
    index_dir = tmp_path / "idx"
    assert Pipeline(index_dir, embedder="hash:64").index([tmp_path / "empty"]).chunks_total == 0
    pipe, gen = _pipe(index_dir)
    for call in (lambda: pipe.search("anything"), lambda: pipe.ask("anything"), lambda: pipe.retrieve("anything")):
        with pytest.raises(IndexEmptyError, match="has no chunks") as e:
            call()
        assert str(index_dir) in str(e.value) and "ragbudget index" in str(e.value)
    assert not gen.prompts


def test_indexing_nothing_says_so(tmp_path: Path) -> None:
    """Issue #42 §7: ``index([])`` was a silent no-op; an empty folder is a warning."""
    from ragbudget.errors import ConfigError

    pipe = Pipeline(tmp_path / "idx", embedder="hash:64")
    with pytest.raises(ConfigError, match="nothing to index: no paths given"):
        pipe.index([])
    assert not (tmp_path / "idx").exists()  # refused before anything was written
    (tmp_path / "empty").mkdir()
    summary = pipe.index([tmp_path / "empty"])
    assert [m for _p, m in summary.warnings] == ["no files found here: nothing to index"]
    assert summary.warnings[0][0].endswith("empty")
    # rebuild=True with no paths re-reads the recorded roots: that is a request, not a slip.
    assert pipe.index([], rebuild=True).committed is not None


def test_relevance_floor_stops_the_context_where_passages_stop_helping(indexed: Path) -> None:
    # Whole chunks: the floor shortens the context itself.
    floored, _ = _pipe(indexed, pack="chunks")  # the default floor
    full, _ = _pipe(indexed, pack="chunks", relevance_floor=0)
    a = floored.retrieve(QUESTION)
    b = full.retrieve(QUESTION)
    best = max(c.score for c in a.chunks)
    below = [d for d in a.dropped if d.reason == "below_relevance_floor"]
    assert below and all(d.score < 0.5 * best for d in below)
    assert all(c.score >= 0.5 * best for c in a.chunks)
    assert a.tokens_used < b.tokens_used
    assert not any(d.reason == "below_relevance_floor" for d in b.dropped)
    # Spans (the default) fill the room with sentences, but only from chunks above the floor.
    spans = _pipe(indexed)[0].retrieve(QUESTION)
    assert spans.pack == "spans"
    floor_out = {d.chunk_id for d in spans.dropped if d.reason == "below_relevance_floor"}
    assert floor_out and not floor_out & {cid for c in spans.chunks for cid in c.chunk_ids}


@pytest.mark.model
def test_the_pipeline_records_the_generators_measured_peak(
    indexed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The generator only measures (tests/test_generate.py); the pipeline owns the plan, so it is
    # what writes the measurement to the planner's calibration file.
    import json

    from _tiny_lm import CUDA_NAME, CUDA_PEAK, as_on_cuda, tiny_model, tiny_tokenizer

    from ragbudget.generation.generate import Generator
    from ragbudget.generation.local import LocalBackend

    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path))
    generator = Generator.from_objects(tiny_model(), tiny_tokenizer())
    as_on_cuda(generator, monkeypatch)
    # Unbatched: the generator's own run is the one that measures a peak (continuous batching
    # shares one paged cache between requests and measures none).
    backend = LocalBackend(generator, gpu="16GiB", batching=False)
    pipe = Pipeline(indexed, backend=backend, ttft_target=0, max_new_tokens=3)
    answer = pipe.ask(QUESTION, context_tokens=100)
    entries = json.loads((tmp_path / "calibration.json").read_text())
    [(key, entry)] = entries.items()
    assert key.startswith(CUDA_NAME.lower() + "|")
    assert entry["measured_peak_bytes"] == CUDA_PEAK and entry["runs"] == 1
    assert entry["tokens"] == answer.report["budget"]["prompt_tokens"]


@dataclass
class CPUGenerator(FakeGenerator):
    device: str = "cpu"


def test_cpu_default_context_is_capped_by_measured_prefill_time(indexed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ragbudget.memory.calibration as calibration

    # 2 ms per prompt token: a 3 s target allows 1,500 prompt tokens.
    monkeypatch.setattr(calibration, "lookup_prefill_speed", lambda model, device: {"a": 0.002, "b": 0.0})
    pipe, _ = _pipe(indexed, generator=CPUGenerator(), ttft_target=3.0, relevance_floor=0)
    answer = pipe.ask(QUESTION)
    b = answer.report["budget"]
    assert b["context_limit"]["limit"] == "time" and b["context_limit"]["ttft_target_s"] == 3.0
    assert b["context_tokens_cap"] == 1500 - b["fixed_prompt_tokens"]
    assert b["context_tokens_allowed"] <= b["context_tokens_cap"]
    from ragbudget.cli.display import format_report

    assert "limit time: 3 s to the first token" in format_report(answer.report)
    # The default target applies on a CPU with no ttft_target given; context_tokens overrides it;
    # 0 disables it; a GPU generator is not capped by default.
    default, _ = _pipe(indexed, generator=CPUGenerator())
    assert default.ask(QUESTION).report["budget"]["context_limit"]["ttft_target_s"] == calibration.CPU_TTFT_TARGET
    given = pipe.ask(QUESTION, context_tokens=2000).report["budget"]["context_limit"]
    assert given == {"limit": "context_tokens", "tokens": 2000}
    off, _ = _pipe(indexed, generator=CPUGenerator(), ttft_target=0)
    assert off.ask(QUESTION).report["budget"]["context_limit"] is None
    gpu, _ = _pipe(indexed, generator=CPUGenerator(device="cuda:0"))
    assert gpu.ask(QUESTION).report["budget"]["context_limit"] is None


def test_fill_remainder_is_an_option_that_reaches_the_selector(tmp_path: Path) -> None:
    """``Pipeline(fill_remainder=True)`` (CLI ``ask --fill-remainder``) gives the room the whole
    chunks leave to a cut of the next chunk; the default leaves it empty (issue #16: more answer
    in the context, but answers with it are not yet measured, so it is opt-in)."""
    from _fakes import FakeBackend

    docs = tmp_path / "docs"
    docs.mkdir()
    # Two documents of ~420 words, one chunk each at the default chunk size.
    (docs / "hall.txt").write_text(
        "The guild met in the old hall by the river every spring. " * 35
        + "The hall burned down in 1871 after a lamp fell over."
    )
    (docs / "tides.txt").write_text("The guild recorded tides along the harbour walls each day. " * 35)
    Pipeline(tmp_path / "idx", embedder="hash:64").index([docs])
    sizes = []
    for fill in (False, True):
        pipe = Pipeline(
            tmp_path / "idx", backend=FakeBackend(), pack="chunks", fill_remainder=fill, relevance_floor=0.0
        )
        sel = pipe.retrieve("When did the guild's hall burn down?", context_tokens=700)
        assert sel.tokens_used <= sel.tokens_allowed
        sizes.append((len(sel.chunks), [c.truncated for c in sel.chunks]))
    (n_off, cut_off), (n_on, cut_on) = sizes
    assert not any(cut_off) and any(cut_on) and n_on == n_off + 1
    from ragbudget.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError):
        Pipeline(tmp_path / "idx", backend=FakeBackend(), fill_remainder="yes")
    # The option is whole-chunk packing's: with spans (the default) it is an error, not ignored.
    with pytest.raises(ConfigError, match="pack='chunks'"):
        Pipeline(tmp_path / "idx", backend=FakeBackend(), fill_remainder=True)


@pytest.mark.model
def test_calibrate_runs_one_real_request_and_admission_learns_the_host_speed() -> None:
    """Issue #30: warm-up measured 0.95 ms/token and requests ran 7-8x slower, so the first
    ones were admitted on a speed the host could not give. One real request at warm-up, slower
    than modelled, sets the slowdown at once (a new speed is provisional: the slower stands)."""
    from _fakes import fake, fake_pipeline

    from ragbudget.memory.admission import Throughput

    pipe = fake_pipeline(words=8, token_delay=0.05)  # 8 tokens, 0.05 s each
    assert pipe.calibrate() is None  # no time model: nothing to calibrate
    ctl = pipe.admission
    ctl.configure(throughput=Throughput(prefill_a=1e-5, decode_s=0.005))  # what a probe said: 10x faster
    answer = pipe.calibrate()
    assert answer is not None and answer.finish_reason == "stop" and fake(pipe).calls
    assert fake(pipe).calls[-1]["question"] == Pipeline.CALIBRATION_QUESTION
    slowdown = ctl.stats().slowdown
    assert slowdown is not None and slowdown > 5  # not the halfway blend of one observation
    assert ctl.stats().running == 0 and ctl.stats().admitted_tokens == 0
