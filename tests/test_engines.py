"""ragbudget.generation.backend and ragbudget.generation.engines against replay servers (tests/_replay.py) that answer
with each engine's own bodies, metric lines and error bodies: detection, capacity figures and
their sources, counting (batched, cached), generation (plain, streamed, cancelled), the one
too-long retry, bounded back-off on overload, and one-line typed errors for everything else."""

from __future__ import annotations

import base64
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from _replay import Replay, Resp, overloaded, render_count

from ragbudget.errors import (
    BudgetError,
    ConfigError,
    EngineAuthError,
    EngineConnectionError,
    EngineContextError,
    EngineError,
    EngineOverloadedError,
    EngineResponseError,
    EngineTimeoutError,
    OverloadedError,
)
from ragbudget.fitting import build_prompt
from ragbudget.generation.backend import (
    Backend,
    MemoryCountCache,
    Sampling,
    per_request_tokens,
    text_digest,
)
from ragbudget.generation.engines import KINDS, Retry, connect
from ragbudget.generation.engines._base import parse_prometheus
from ragbudget.generation.engines._http import HTTP, root_url
from ragbudget.packing.select import Candidate
from ragbudget.prompt.prompt import Prompt
from ragbudget.settings import EngineSettings

FAST = Retry(attempts=4, base_delay=0.01, max_delay=0.05, max_wait=2.0)
USER = [{"role": "user", "content": "How is the Project Leader elected?"}]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def _connect(srv: Replay, **kw: Any) -> Any:
    kw.setdefault("retry", FAST)
    kw.setdefault("timeout", 5.0)
    return connect(srv.url, **kw)


# -- the contract ---------------------------------------------------------------------------------
def test_every_built_in_kind_keeps_the_engine_contract_a_plugin_keeps(kind: str) -> None:
    # The same checks an installed plugin passes (tests/test_engine_plugins.py): the built-ins
    # are loaded through the one table a plugin's entry point joins (settings.BUILT_IN_ENGINES).
    from _engine_contract import check_engine

    from ragbudget.generation.engines import backend_class
    from ragbudget.settings import BUILT_IN_ENGINES

    assert backend_class(kind).__module__ + ":" + backend_class(kind).__name__ == BUILT_IN_ENGINES[kind]
    with Replay(kind) as srv:
        seen = check_engine(_connect(srv, kind=kind, context_tokens=2048), kind=kind, url=srv.url)
    assert seen["text"] and seen["window"] == 2048


# -- detection ------------------------------------------------------------------------------------
def test_auto_detection_names_each_engine_and_how(kind: str) -> None:
    with Replay(kind) as srv, _connect(srv) as b:
        assert b.kind == kind and b.detection.kind == kind
        assert b.detection.probes[0] == "GET /v1/models -> 200"
        expected_route = {
            "vllm": "owned_by",
            "sglang": "owned_by",
            "llamacpp": "owned_by",
            "tgi": "GET /info",
            "ollama": "GET /api/version",
            "openai": "GET /v1/models only",
        }[kind]
        assert expected_route in b.detection.how
        n = len(srv.log)
        assert b.model_id == b.detection.models[0] and len(srv.log) == n  # no second listing
        assert isinstance(b, Backend)


def test_given_kind_does_not_probe() -> None:
    with Replay("vllm") as srv, _connect(srv, kind="vllm", model="m") as b:
        assert b.detection.how == "given: kind='vllm'"
        assert srv.log == []


def test_detection_of_a_server_that_is_no_engine() -> None:
    with Replay("openai") as srv:
        srv.routes.clear()  # every route 404s
        with pytest.raises(EngineResponseError, match="answers none of the engine routes") as e:
            _connect(srv)
        assert "GET /props -> 404" in e.value.body


def test_importing_the_engines_stays_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, ragbudget.generation.engines, ragbudget.generation.backend\n"
        "print([m for m in ('torch', 'transformers', 'faiss') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_unknown_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="auto or one of"):
        connect("http://127.0.0.1:1", kind="triton")
    with pytest.raises(ConfigError, match="http://host:port"):
        root_url("127.0.0.1:8000")
    assert root_url("https://h:1/v1/") == "https://h:1" and root_url("http://h/x") == "http://h/x"


# -- capacity --------------------------------------------------------------------------------------
EXPECTED = {
    # kind: {field: (value, source fragment)}
    "vllm": {
        "max_context_tokens": (8192, "max_model_len"),
        "kv_tokens_total": (100000, "kv_cache_size_tokens"),
        "kv_tokens_free": (75000, "kv_cache_usage_perc"),
        "running": (3, "num_requests_running"),
        "waiting": (1, "num_requests_waiting"),
    },
    "sglang": {
        "max_context_tokens": (32768, "max_model_len"),
        "max_prompt_tokens": (32762, "max_req_input_len"),
        "kv_tokens_total": (200000, "max_total_num_tokens"),
        "kv_tokens_free": (150000, "num_used_tokens"),
        "running": (2, "num_running_reqs"),
        "waiting": (0, "num_queue_reqs"),
        "max_concurrent": (48, "max_running_requests"),
    },
    "tgi": {
        "max_context_tokens": (4096, "max_total_tokens"),
        "max_prompt_tokens": (4095, "max_input_tokens"),
        "kv_tokens_total": (40000, "tgi_batch_max_total_tokens"),
        "kv_tokens_free": (37000, "tgi_batch_current_max_tokens"),
        "running": (2, "tgi_batch_current_size"),
        "waiting": (1, "tgi_queue_size"),
        "max_concurrent": (128, "max_concurrent_requests"),
    },
    "llamacpp": {
        "max_context_tokens": (512, "n_ctx"),
        "kv_tokens_total": (2048, "total_slots"),
        "kv_tokens_free": (1536, "idle slots"),
        "running": (1, "is_processing"),
        "max_concurrent": (4, "total_slots"),
    },
    "ollama": {"max_context_tokens": (8192, "/api/ps context_length")},
    "openai": {},
}
SOURCE_OF = {
    "max_context_tokens": "max_context_source",
    "max_prompt_tokens": "max_prompt_source",
    "kv_tokens_total": "kv_total_source",
    "kv_tokens_free": "kv_free_source",
    "running": "load_source",
    "waiting": "load_source",
    "max_concurrent": "max_concurrent_source",
}


def test_capacity_figures_and_their_sources(kind: str) -> None:
    with Replay(kind) as srv, _connect(srv) as b:
        before = time.time()
        cap = b.capacity()
        assert cap.engine_kind == kind and before - 1 <= cap.measured_at <= time.time()
        for name, (value, src) in EXPECTED[kind].items():
            assert getattr(cap, name) == value, name
            assert src in getattr(cap, SOURCE_OF[name]), (name, getattr(cap, SOURCE_OF[name]))
        for name in set(SOURCE_OF) - set(EXPECTED[kind]):
            assert getattr(cap, name) is None, name  # unknown stays unknown, never guessed
        lines = cap.describe()
        assert all("s old" in line for line in lines if not line.startswith("note"))


def test_a_recent_reading_answers_again_and_an_old_one_is_read_afresh() -> None:
    with Replay("vllm") as srv, _connect(srv) as b:
        first = b.capacity()
        assert b.capacity() is first and len(srv.calls("GET", "/metrics")) == 1  # one request's 2-3 looks
        fresh = b.capacity(fresh=True)  # a caller keeping its own interval (the server's look)
        assert fresh is not first and len(srv.calls("GET", "/metrics")) == 2
        assert b.capacity() is fresh  # the fresh reading is the one reused
        b.CAPACITY_TTL_S = 0  # every reading is old at once: no test waits for one to age
        assert b.capacity() is not fresh and len(srv.calls("GET", "/metrics")) == 3


def test_vllm_without_kv_cache_size_tokens_falls_back_with_a_warning() -> None:
    with Replay("vllm", no_kv_size=True) as srv, _connect(srv) as b:
        cap = b.capacity()
        assert cap.kv_tokens_total == 6400 * 16 and "num_gpu_blocks × block_size" in cap.kv_total_source
        assert any("hybrid" in n for n in cap.notes)


@pytest.mark.parametrize("kind", ["vllm", "sglang", "tgi"])
def test_without_metrics_the_kv_figures_are_unknown_and_said_so(kind: str) -> None:
    with Replay(kind) as srv, _connect(srv) as b:
        srv.push("GET", "/metrics", Resp(404, {"error": "Not Found"}))
        cap = b.capacity()
        assert cap.kv_tokens_free is None and cap.running is None and cap.waiting is None
        assert any("metrics" in n for n in cap.notes)
        assert cap.max_context_tokens is not None


def test_sglang_tokenize_falls_back_to_the_unprefixed_route() -> None:
    with Replay("sglang") as srv, _connect(srv) as b:
        srv.routes[("POST", "/tokenize")] = srv.routes.pop(("POST", "/v1/tokenize"))
        assert b.count(["a b", "c"]) == [2, 1]
        assert len(srv.calls("POST", "/tokenize")) == 1


def test_context_tokens_overrides_the_advertised_window() -> None:
    with Replay("vllm") as srv, _connect(srv, context_tokens=4000) as b:
        cap = b.capacity()
        assert cap.max_context_tokens == 4000 and cap.max_context_source == "context_tokens (given)"
        assert any("8192" in n for n in cap.notes)


def test_ollama_not_loaded_sends_its_smallest_default_num_ctx() -> None:
    with Replay("ollama", not_loaded=True) as srv, _connect(srv) as b:
        assert b.capacity().max_context_tokens == 4096
        b.generate(USER, max_new_tokens=3)
        body = srv.calls("POST", "/api/chat")[-1]
        assert body["options"]["num_ctx"] == 4096 and body["options"]["num_predict"] == 3
        assert body["truncate"] is False


# -- per_request_tokens ----------------------------------------------------------------------------


def test_served_capacity_feeds_per_request_tokens(kind: str) -> None:
    if kind == "openai":
        pytest.skip("a generic server needs context_tokens, tested above")
    with Replay(kind) as srv, _connect(srv) as b:
        overhead = b.template_overhead("Answer from the sources.")
        budget = per_request_tokens(b.capacity(), max_new_tokens=64, overhead_tokens=overhead)
        assert budget.context_tokens > 0 and budget.binding_source


# -- counting ----------------------------------------------------------------------------------------
def test_counts_are_exact_where_the_engine_counts(kind: str) -> None:
    with Replay(kind) as srv, _connect(srv) as b:
        texts = ["one two three", "four five", "one two three"]
        counts = b.count(texts)
        rendered = b.render(USER)
        if kind in ("ollama", "openai"):
            assert not rendered.exact and rendered.margin == 0.15 and "margin" in rendered.source
            assert counts[0] >= 3 and counts[0] == counts[2]
        else:
            assert counts == [3, 2, 3]
            assert rendered.n_tokens == render_count(USER)
            assert rendered.exact == (kind != "sglang")


def test_vllm_counts_each_distinct_text_once_concurrently() -> None:
    with Replay("vllm") as srv, _connect(srv) as b:
        texts = [f"word {i} " * (i + 1) for i in range(20)] + ["word 0 "]
        assert b.count(texts)[:3] == [2, 4, 6]
        assert len(srv.calls("POST", "/tokenize")) == 20  # the duplicate is not sent


def test_sglang_counts_a_batch_in_one_request() -> None:
    with Replay("sglang") as srv, _connect(srv) as b:
        assert b.count(["a b", "c", "d e f"]) == [2, 1, 3]
        calls = srv.calls("POST", "/v1/tokenize")
        assert len(calls) == 1 and calls[0]["prompt"] == ["a b", "c", "d e f"]


def test_count_cache_means_a_rerun_counts_nothing_twice() -> None:
    cache = MemoryCountCache()
    with Replay("vllm") as srv:
        with _connect(srv, count_cache=cache) as b:
            b.count(["a b c", "d"])
        n = len(srv.calls("POST", "/tokenize"))
        with _connect(srv, count_cache=cache) as b2:  # a new process would reopen the store
            assert b2.count(["d", "a b c", "e f"]) == [1, 3, 2]
        assert len(srv.calls("POST", "/tokenize")) == n + 1  # only "e f" was new
    assert cache.get_many("Qwen/Qwen3-8B", [text_digest("e f")]) == {text_digest("e f"): 2}
    assert cache.get_many("other-model", [text_digest("e f")]) == {}


def test_llamacpp_counts_many_texts_in_one_request() -> None:
    """llama-server tokenizes each string of an array alone (tokenize_mixed): the texts of a
    prompt are counted in one request, split by the id -1, after a one-time check that a batched
    count agrees with a single one."""
    texts = [f"chunk number {i} of the corpus" for i in range(40)] + ["", "<|im_end|> a"]
    with Replay("llamacpp") as srv, _connect(srv) as b:
        assert b.count(texts) == [len(t.split()) for t in texts]
        assert len(srv.calls("POST", "/tokenize")) == 2  # the batch, and the one-time check
        assert b.count([t + "!" for t in texts]) == [len(t.split()) + (1 if not t else 0) for t in texts]
        assert len(srv.calls("POST", "/tokenize")) == 3  # one request for 42 new texts
        assert b.http.sent["/tokenize"] == 3


def test_llamacpp_without_array_tokenize_counts_one_text_a_request() -> None:
    """An older llama-server refuses an array: counted one text a request from then on."""
    with Replay("llamacpp") as srv, _connect(srv) as b:
        srv.push("POST", "/tokenize", Resp(500, {"error": {"code": 500, "message": "[json.exception.type_error.302]"}}))
        assert b.count(["a b", "c d e", "f"]) == [2, 3, 1]
        assert b.count(["g h", "i"]) == [2, 1]
    assert len(srv.calls("POST", "/tokenize")) == 1 + 3 + 2  # the refused batch, then one by one


def test_counts_and_renders_are_kept_in_memory_without_a_count_cache() -> None:
    """No count_cache (budget --engine without an index): a text is still counted once, and the
    same messages rendered once (the question alone is measured three times a request)."""
    with Replay("llamacpp") as srv, _connect(srv) as b:
        b.count(["a b c"])
        b.count(["a b c"])
        first = b.render(USER)
        assert b.render([dict(m) for m in USER]) is first  # equal messages, not the same object
        other = b.render([{"role": "user", "content": "Something else?"}])
        assert other.n_tokens != first.n_tokens
        assert len(srv.calls("POST", "/apply-template")) == 2
        assert len(srv.calls("POST", "/tokenize")) == 1 + 2


def test_local_counters_keep_their_counts_under_their_tokenizer() -> None:
    """An engine that cannot count is counted by a local stand-in: its counts are kept under
    the model *and* that tokenizer and margin, so another --tokenizer never reuses them."""
    cache = MemoryCountCache()
    with Replay("openai") as srv, _connect(srv, count_cache=cache, context_tokens=2048) as b:
        assert b.count_key == "acme/chat-1 @ tiktoken cl100k_base +0.15"
        b.count(["a b c"])
    assert cache.get_many("acme/chat-1 @ tiktoken cl100k_base +0.15", [text_digest("a b c")])
    assert cache.get_many("acme/chat-1", [text_digest("a b c")]) == {}


def test_in_memory_caches_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from ragbudget.generation.engines import backend_class

    # Bounds a subclass (or a test) may set: 10 counted texts, 5 rendered tokens.
    monkeypatch.setattr(backend_class("llamacpp"), "COUNT_MEMO", 10)
    monkeypatch.setattr(backend_class("llamacpp"), "RENDER_MEMO_TOKENS", 5)
    with Replay("llamacpp") as srv, _connect(srv) as b:
        texts = [f"text number {i}" for i in range(30)]
        b.count(texts)
        asked = len(srv.log)
        b.count(texts[-10:])  # the ten most recent are held
        assert len(srv.log) == asked
        b.count(texts[:1])  # the oldest were let go: the engine is asked again
        assert len(srv.log) > asked
        b.render(USER)
        asked = len(srv.log)
        b.render(USER)  # a prompt bigger than the whole bound is not kept
        assert len(srv.log) > asked
    cache = MemoryCountCache(max_entries=100)
    cache.put_many("m", {str(i): i for i in range(1000)})
    assert len(cache) == 100 and cache.get_many("m", ["999", "0"]) == {"999": 999}


def test_template_overhead_is_measured_once_per_model() -> None:
    with Replay("llamacpp") as srv, _connect(srv) as b:
        first = b.template_overhead("Be brief.")
        n = len(srv.log)
        assert b.template_overhead("Be brief.") == first and len(srv.log) == n
        # system turn + empty user turn + generation prompt, in the replay's template
        assert first == 2 + 4 + 4 + 3


# -- generation ------------------------------------------------------------------------------------
def test_generate_always_sends_max_tokens_and_greedy_by_default(kind: str) -> None:
    with Replay(kind) as srv, _connect(srv) as b:
        g = b.generate(USER, max_new_tokens=4)
        assert (g.text, g.finish_reason, g.new_tokens) == ("The Project Leader is", "length", 4)
        assert g.prompt_tokens == render_count(USER) and g.cache == "served"
        if kind == "ollama":
            body = srv.calls("POST", "/api/chat")[-1]
            assert body["options"]["num_predict"] == 4 and body["options"]["temperature"] == 0
        else:
            body = srv.calls("POST", "/v1/chat/completions")[-1]
            assert body["max_tokens"] == 4 and body["temperature"] == 0 and not body["stream"]


def test_sampling_and_stop_reach_the_engine() -> None:
    with Replay("vllm") as srv, _connect(srv) as b:
        g = b.generate("Hi", max_new_tokens=20, stop=["elected"], sampling=Sampling(temperature=0.7, top_p=0.9, seed=3))
        body = srv.calls("POST", "/v1/chat/completions")[-1]
        assert (body["temperature"], body["top_p"], body["seed"], body["stop"]) == (0.7, 0.9, 3, ["elected"])
        assert g.text == "The Project Leader is" and g.finish_reason == "stop"
    with pytest.raises(ConfigError):
        Sampling(temperature=3)


def test_streaming_pieces_make_the_text(kind: str) -> None:
    with Replay(kind) as srv, _connect(srv) as b:
        pieces: list[str] = []
        g = b.generate(USER, max_new_tokens=32, on_text=pieces.append)
        assert "".join(pieces) == g.text == "The Project Leader is elected by the developers every year"
        assert g.finish_reason == "stop" and g.new_tokens == 10
        if kind != "ollama":
            body = srv.calls("POST", "/v1/chat/completions")[-1]
            assert body["stream"] and body["stream_options"] == {"include_usage": True}


def test_cancel_closes_the_stream_and_frees_the_slot(kind: str) -> None:
    with Replay(kind, stream_gap=0.2) as srv, _connect(srv) as b:
        cancel = threading.Event()
        pieces: list[str] = []

        def on_text(piece: str) -> None:
            pieces.append(piece)
            cancel.set()

        t0 = time.perf_counter()
        g = b.generate(USER, max_new_tokens=32, on_text=on_text, cancel=cancel)
        assert g.finish_reason == "cancelled" and len(pieces) <= 2
        assert time.perf_counter() - t0 < 1.5  # not the ~2 s the whole answer takes
        deadline = time.time() + 3
        while srv.aborted_streams == 0 and time.time() < deadline:  # the engine sees it
            time.sleep(0.05)
        assert srv.aborted_streams >= 1


def test_a_cancel_while_the_engine_is_silent_closes_the_request_there_at_once() -> None:
    """Issue #42 §5: a request abandoned while the engine had sent nothing yet (reading a long
    prompt, queueing it, or frozen) was closed at the engine's next byte only, and kept its slot
    until then: the next request found "no free KV". Now the cancel closes the connection at
    once, the engine sees it, and its slot is free before ``generate`` returns."""
    with Replay("llamacpp", busy_slots=1) as srv, _connect(srv) as b:
        b.capacity()  # the plan's look at the slots before a request: another client's task runs
        srv.push("POST", "/v1/chat/completions", Resp(delay=20.0, json={}))  # silent for 20 s
        cancel = threading.Event()
        threading.Timer(0.5, cancel.set).start()
        t0 = time.perf_counter()
        g = b.generate(USER, max_new_tokens=32, cancel=cancel)
        took = time.perf_counter() - t0
        assert g.finish_reason == "cancelled" and took < 3.0, took
        assert srv.aborted_streams == 1 and not srv.tasks  # the engine let go of it already
        assert b.capacity().running == 1  # read afresh: only the other client's task is left


def test_a_generation_may_take_what_the_engines_measured_speed_says_and_no_more() -> None:
    """Issue #42 §5: a fixed 30 s engine time-out failed requests on CPU engines that were
    merely slow. Without a given time-out, a generation may wait three times what the engine's
    speed (read off its own timings) says it should take, never less than a floor (30 s; scaled
    down here so that the test waits seconds), and the long wait before the first answer; a
    hung engine is still found out, its connection closed; a given time-out bounds every reply
    as before."""
    with Replay("llamacpp", busy_slots=0, prefill_ms=20.0, decode_ms=20.0) as srv, _connect(srv, timeout=None) as b:
        b.speed.FLOOR_S = 0.5
        prompt = b.render([{"role": "user", "content": "How is the Project Leader of Debian elected? " * 4}])
        assert b.reply_timeout(prompt, 32) == b.speed.UNMEASURED_S > 30  # nothing measured yet
        b.generate(prompt, max_new_tokens=32)  # its timings: 20 ms a prompt token and a new one
        limit = b.reply_timeout(prompt, 32)
        assert limit == pytest.approx(3 * (prompt.n_tokens + 32) * 0.020, rel=0.01)
        usage = {"prompt_tokens": prompt.n_tokens, "completion_tokens": 2, "total_tokens": prompt.n_tokens + 2}
        slow = Resp(delay=0.6 * limit, json=srv.engine.chat_body("Slow but here", "stop", usage))
        srv.push("POST", "/v1/chat/completions", slow)
        assert b.generate(prompt, max_new_tokens=32).text == "Slow but here"
        srv.push("POST", "/v1/chat/completions", Resp(delay=limit + 10, json={}))
        b.capacity(fresh=True)  # the plan's look at the slots before a request
        t0 = time.perf_counter()
        with pytest.raises(EngineTimeoutError) as hung:
            b.generate(prompt, max_new_tokens=32)
        assert hung.value.timeout == pytest.approx(limit, rel=0.05) and time.perf_counter() - t0 < limit + 3
        assert not srv.tasks  # closed there too
    with Replay("llamacpp", busy_slots=0) as srv, _connect(srv, timeout=1.0) as b:
        assert b.reply_timeout(b.render(USER), 32) is None  # the client's: 1 s for every reply
        srv.push("POST", "/v1/chat/completions", Resp(delay=3.0, json={}))
        with pytest.raises(EngineTimeoutError) as given:
            b.generate(USER, max_new_tokens=32)
        assert given.value.timeout == 1.0


def test_a_cancel_set_before_the_request_sends_nothing() -> None:
    with Replay("vllm") as srv, _connect(srv, model="m") as b:
        cancel = threading.Event()
        cancel.set()
        g = b.generate(USER, max_new_tokens=8, cancel=cancel)
        assert g.finish_reason == "cancelled" and srv.calls("POST", "/v1/chat/completions") == []


def test_an_error_in_mid_stream_is_typed() -> None:
    with Replay("vllm") as srv, _connect(srv) as b:
        srv.push(
            "POST",
            "/v1/chat/completions",
            Resp(
                lines=[
                    'data: {"choices": [{"index": 0, "delta": {"content": "The"}, "finish_reason": null}]}',
                    'data: {"error": {"message": "engine died", "type": "InternalServerError", '
                    '"param": null, "code": 500}}',
                ],
                content_type="text/event-stream",
            ),
        )
        with pytest.raises(EngineResponseError, match="mid-stream: engine died"):
            b.generate(USER, max_new_tokens=8, on_text=lambda s: None)


# -- too long ---------------------------------------------------------------------------------------
def _four_passage_prompt() -> Prompt:
    """A real :class:`~ragbudget.prompt.prompt.Prompt` of 4 passages of 120 distinct words (scores
    0.9, 0.1, 0.5, 0.7): 560 tokens as the replayed llama.cpp counts, over its 512-token slot; any
    three are 439."""
    from _fakes import WordTokenizer

    cands = [
        Candidate(f"c{i}", " ".join(f"p{i}w{j}" for j in range(120)), score)
        for i, score in enumerate((0.9, 0.1, 0.5, 0.7))
    ]
    prompt = build_prompt("who?", cands, tokenizer=WordTokenizer(chatml=True), max_prompt_tokens=4000)
    assert len(prompt.passages) == 4
    return prompt


def test_llamacpp_too_long_retries_once_with_fewer_passages() -> None:
    with Replay("llamacpp") as srv, _connect(srv) as b:
        # 4 passages of 150 "tokens": 600 + question > the 512-token slot
        prompt = _four_passage_prompt()
        g = b.generate(prompt, max_new_tokens=16)
        calls = srv.calls("POST", "/v1/chat/completions")
        assert len(calls) == 2  # the first refused with the server's figures, one retry
        assert g.prompt is not None and g.prompt_tokens < 512 - 16
        kept = g.prompt.passages
        assert sorted(p.score for p in kept) == [0.5, 0.7, 0.9]  # the lowest-scored went


def test_llamacpp_too_long_without_room_to_cut_carries_the_servers_figures() -> None:
    with Replay("llamacpp") as srv, _connect(srv) as b:
        words = " ".join(["w"] * 700)
        with pytest.raises(EngineContextError) as e:
            b.generate(words, max_new_tokens=16)
        err = e.value
        assert (err.n_prompt_tokens, err.n_ctx, err.status) == (700 + 4 + 3, 512, 400)
        assert err.source == "llama.cpp exceed_context_size_error"
        assert err.body["error"]["type"] == "exceed_context_size_error"
        assert isinstance(err, BudgetError) and err.needed == 707 + 16 and err.available == 512
        assert "\n" not in str(err) and b.url in str(err)
        assert len(srv.calls("POST", "/v1/chat/completions")) == 1


def test_vllm_too_long_is_confirmed_by_recount_and_cut_to_what_the_window_leaves() -> None:
    with Replay("vllm") as srv, _connect(srv) as b:
        prompt = " ".join(["w"] * 8000)  # 8007 tokens rendered; + 1000 > 8192
        g = b.generate(prompt, max_new_tokens=1000)
        first, second = srv.calls("POST", "/v1/chat/completions")
        assert first["max_tokens"] == 1000 and second["max_tokens"] == 8192 - 8007
        assert g.new_tokens <= 185 and g.text


def test_tgi_422_too_long_raises_after_one_retry() -> None:
    with Replay("tgi") as srv, _connect(srv) as b:
        prompt = " ".join(["w"] * 4100)  # over max_input_tokens: no answer budget helps
        with pytest.raises(EngineContextError) as e:
            b.generate(prompt, max_new_tokens=10)
        assert e.value.status == 422 and e.value.body["error_type"] == "validation"
        assert e.value.n_prompt_tokens == 4107 and "recount" in e.value.source


def test_a_400_that_is_not_too_long_is_a_response_error() -> None:
    with Replay("vllm") as srv, _connect(srv) as b:
        srv.push(
            "POST",
            "/v1/chat/completions",
            Resp(
                400,
                {
                    "error": {
                        "message": "temperature must be non-negative",
                        "type": "BadRequestError",
                        "param": "temperature",
                        "code": 400,
                    }
                },
            ),
        )
        with pytest.raises(EngineResponseError, match="temperature must be") as e:
            b.generate(USER, max_new_tokens=8)
        assert e.value.status == 400 and not isinstance(e.value, EngineContextError)


def test_ollama_too_long_with_truncate_false() -> None:
    with Replay("ollama") as srv, _connect(srv) as b:
        with pytest.raises(EngineContextError) as e:
            b.generate(" ".join(["w"] * 9000), max_new_tokens=10)
        assert e.value.n_ctx == 8192 and e.value.status == 400


# -- overload ----------------------------------------------------------------------------------------
def test_overload_backs_off_honouring_retry_after_then_succeeds(kind: str) -> None:
    path = "/api/chat" if kind == "ollama" else "/v1/chat/completions"
    with Replay(kind) as srv, _connect(srv) as b:
        slept: list[float] = []
        b.http.sleep = slept.append
        srv.push("POST", path, overloaded(kind, retry_after=0.3), overloaded(kind))
        g = b.generate(USER, max_new_tokens=4)
        assert g.text == "The Project Leader is"
        assert len(srv.calls("POST", path)) == 3
        assert 0.3 <= slept[0] <= 0.3 * 1.1 + 0.05  # at least what the server asked, + jitter
        assert 0 <= slept[1] <= FAST.base_delay * 2  # exponential step with full jitter


def test_overload_gives_up_after_bounded_attempts(kind: str) -> None:
    path = "/api/chat" if kind == "ollama" else "/v1/chat/completions"
    with Replay(kind) as srv, _connect(srv) as b:
        slept: list[float] = []
        b.http.sleep = slept.append
        srv.push("POST", path, *[overloaded(kind, retry_after=0.2)] * 10)
        with pytest.raises(EngineOverloadedError) as e:
            b.generate(USER, max_new_tokens=4)
        assert e.value.attempts == FAST.attempts == len(srv.calls("POST", path))
        assert e.value.retry_after == 0.2 and isinstance(e.value, OverloadedError)
        assert sum(slept) <= FAST.max_wait and "\n" not in str(e.value)


def test_a_retry_after_beyond_the_wait_budget_fails_at_once() -> None:
    with Replay("tgi") as srv, _connect(srv) as b:
        b.http.sleep = lambda s: pytest.fail("must not sleep")
        srv.push("POST", "/v1/chat/completions", overloaded("tgi", retry_after=120))
        with pytest.raises(EngineOverloadedError, match="retry after 120 s") as e:
            b.generate(USER, max_new_tokens=4)
        assert e.value.attempts == 1 and e.value.status == 429


def test_retry_after_accepts_seconds_and_http_dates() -> None:
    """The back-off waits at least the ``Retry-After`` the engine sent, as delta-seconds or as an
    HTTP date (RFC 9110 §10.2.3); one it cannot read is ignored (the jittered step alone)."""
    from email.utils import formatdate

    when = overloaded("tgi")
    when.headers["Retry-After"] = formatdate(time.time() + 10, usegmt=True)
    junk = overloaded("tgi")
    junk.headers["Retry-After"] = "junk"
    patient = Retry(attempts=4, base_delay=0.01, max_delay=0.01, max_wait=60)
    with Replay("tgi") as srv, _connect(srv, retry=patient) as b:
        slept: list[float] = []
        b.http.sleep = slept.append
        srv.push("POST", "/v1/chat/completions", overloaded("tgi", retry_after=2), when, junk)
        assert b.generate(USER, max_new_tokens=4).text
    assert 2 <= slept[0] <= 2 * 1.1 + 0.05
    assert 8 <= slept[1] <= 10 * 1.1 + 0.05
    assert 0 <= slept[2] <= 0.01


# -- connection, auth, malformed, hang ------------------------------------------------------------------
def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _one_line(err: EngineError, url_part: str) -> None:
    assert "\n" not in str(err) and url_part in str(err)


def test_refused_connection() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(EngineConnectionError, match="refused: is the engine running") as e:
        connect(url)
    _one_line(e.value, url)
    assert isinstance(e.value, ConnectionError)


def test_unknown_host() -> None:
    with pytest.raises(EngineConnectionError, match="cannot resolve host") as e:
        connect("http://no-such-engine.invalid:8000", connect_timeout=2)
    _one_line(e.value, "no-such-engine.invalid")


def test_tls_to_a_plain_http_server() -> None:
    with Replay("vllm") as srv:
        url = srv.url.replace("http://", "https://")
        with pytest.raises(EngineConnectionError, match="TLS handshake") as e:
            connect(url, connect_timeout=2)
        _one_line(e.value, "https:// and the server certificate")


def test_missing_and_wrong_api_keys() -> None:
    with Replay("llamacpp", api_key="s3cret") as srv:
        with pytest.raises(EngineAuthError, match="wants an API key: pass api_key") as e:
            _connect(srv)
        assert e.value.status == 401 and isinstance(e.value, PermissionError)
        _one_line(e.value, srv.url)
        with pytest.raises(EngineAuthError, match="--api-key-env"):
            _connect(srv, api_key="wrong")
        with _connect(srv, api_key="s3cret") as b:
            assert b.kind == "llamacpp" and b.generate("Hi", max_new_tokens=2).new_tokens == 2


def test_api_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from ragbudget.generation.engines import api_key_from_env

    monkeypatch.setenv("ENGINE_KEY", "k1")
    assert api_key_from_env("ENGINE_KEY") == "k1" and api_key_from_env(None) is None
    monkeypatch.delenv("ENGINE_KEY")
    with pytest.raises(ConfigError, match="export ENGINE_KEY="):
        api_key_from_env("ENGINE_KEY")


def test_malformed_json() -> None:
    with Replay("vllm") as srv:
        srv.push("GET", "/v1/models", Resp(text="<html>login</html>", content_type="text/html"))
        with _connect(srv, kind="vllm") as b, pytest.raises(EngineResponseError, match="not JSON") as e:
            b.capacity()
        _one_line(e.value, "/v1/models")
        assert e.value.body == "<html>login</html>"


def test_a_hung_server_times_out() -> None:
    # 1.5 s, not less: the connect probe shares the timeout, and a replay thread on a loaded
    # 2-core host can take a few hundred ms to answer /v1/models.
    with Replay("vllm") as srv:
        srv.push("POST", "/v1/chat/completions", Resp(delay=8.0, json={}))
        t0 = time.perf_counter()
        with (
            _connect(srv, model="m", timeout=1.5) as b,
            pytest.raises(EngineConnectionError, match="gave no answer within 1.5 s") as e,
        ):
            b.generate(USER, max_new_tokens=4)
        assert time.perf_counter() - t0 < 6
        _one_line(e.value, "/v1/chat/completions")


def test_a_hung_stream_times_out_too() -> None:
    with Replay("vllm") as srv:
        srv.push(
            "POST", "/v1/chat/completions", Resp(delay=8.0, lines=["data: [DONE]"], content_type="text/event-stream")
        )
        with _connect(srv, model="m", timeout=1.5) as b, pytest.raises(EngineConnectionError, match="gave no answer"):
            b.generate(USER, max_new_tokens=4, on_text=lambda s: None)


def test_a_time_out_is_its_own_type_with_its_seconds() -> None:
    """An engine time-out is an EngineTimeoutError (still an EngineConnectionError, and a
    TimeoutError) with the seconds it waited: the server answers it 504, a refused engine 502."""
    with Replay("vllm") as srv:
        srv.push("POST", "/v1/chat/completions", Resp(delay=4.0, json={}))
        with _connect(srv, model="m", timeout=1.0) as b, pytest.raises(EngineTimeoutError) as e:
            b.generate(USER, max_new_tokens=4)
    assert isinstance(e.value, EngineConnectionError) and isinstance(e.value, TimeoutError)
    assert e.value.cause == "timeout" and e.value.timeout == 1.0 and e.value.kind == "vllm"
    assert "--engine-timeout" in str(e.value)
    with pytest.raises(EngineConnectionError) as refused:
        connect(f"http://127.0.0.1:{_free_port()}")
    assert refused.value.cause == "refused" and not isinstance(refused.value, EngineTimeoutError)


def test_credentials_in_the_url_are_sent_as_basic_auth_and_never_shown() -> None:
    """``http://user:pass@host`` authenticates (HTTP basic auth) but the password is in no URL,
    message or error field: those reach logs, reports and the server's clients."""
    with Replay("llamacpp") as srv:
        host = srv.url.removeprefix("http://")
        with connect(f"http://bob:s%40cret@{host}/v1", retry=FAST, timeout=5.0) as b:
            assert b.url == srv.url and "s@cret" not in repr(b)
            b.capacity()
        assert srv.authorization[-1] == "Basic " + base64.b64encode(b"bob:s@cret").decode()
    with pytest.raises(EngineConnectionError) as e:
        connect(f"http://bob:s3cret@127.0.0.1:{_free_port()}")
    assert "s3cret" not in str(e.value) and "bob" not in e.value.url
    assert root_url("https://bob:s3cret@engine.example:8443/v1") == "https://engine.example:8443"
    assert "s3cret" not in repr(EngineSettings(url="http://bob:s3cret@engine.example/v1"))
    with pytest.raises(ConfigError) as bad:
        root_url("ftp://bob:s3cret@engine.example")
    assert "s3cret" not in str(bad.value)


def test_a_probe_says_overloaded_at_once_without_backing_off() -> None:
    """Inside ``http.probing()`` a 503 (overloaded, or llama.cpp loading its model) raises at
    once: the server's look at the engine's health must not spend the back-off a request gets."""
    slow = Retry(attempts=4, base_delay=5.0, max_delay=5.0, max_wait=20.0)
    with Replay("llamacpp") as srv, connect(srv.url, retry=slow, timeout=5.0) as b:
        srv.push("GET", "/props", *[overloaded("llamacpp")] * 4)
        t0 = time.perf_counter()
        with b.http.probing(), pytest.raises(EngineOverloadedError) as e:
            b.capacity()
        assert time.perf_counter() - t0 < 2 and e.value.attempts == 1
        assert len(srv.calls("GET", "/props")) == 1


def test_http_client_maps_other_statuses_with_the_structured_body() -> None:
    with Replay("tgi") as srv:
        http = HTTP(srv.url, retry=FAST, kind="tgi")
        srv.push("GET", "/info", Resp(500, {"error": "Request failed during generation", "error_type": "generation"}))
        with pytest.raises(EngineResponseError, match="500: Request failed") as e:
            http.get("/info")
        assert e.value.body == {"error": "Request failed during generation", "error_type": "generation"}
        http.close()


# -- records and helpers -----------------------------------------------------------------------------
def test_prometheus_parsing_handles_escapes_and_series() -> None:
    text = '# HELP x y\nm{a="1,2",b="say \\"hi\\""} 3.5\nm{a="3"} 1\nbare 2e3\nbroken{a=1} 2\n'
    assert parse_prometheus(text) == [
        ("m", {"a": "1,2", "b": 'say "hi"'}, 3.5),
        ("m", {"a": "3"}, 1.0),
        ("bare", {}, 2000.0),
    ]


@dataclass
class _Hit:
    chunk_id: str
    text: str
    score: float


def test_a_real_prompt_is_rebuilt_with_fewer_passages_on_too_long() -> None:
    from _fakes import WordTokenizer

    from ragbudget.fitting import build_prompt

    hits = [_Hit(f"c{i}", " ".join(f"t{i}x{j}" for j in range(150)), s) for i, s in enumerate((0.9, 0.8, 0.7, 0.6))]
    prompt = build_prompt("Who leads?", hits, tokenizer=WordTokenizer(chatml=True), max_prompt_tokens=5000)
    assert len(prompt.passages) == 4
    with Replay("llamacpp") as srv, _connect(srv) as b:
        g = b.generate(prompt, max_new_tokens=16)
        first, second = srv.calls("POST", "/v1/chat/completions")
        assert g.prompt is not None and 0 < len(g.prompt.passages) < 4
        kept = sorted(p.score for p in g.prompt.passages)
        assert kept == sorted((0.9, 0.8, 0.7, 0.6))[-len(kept) :]  # the best survive
        assert g.prompt_tokens < 512 and second["messages"] == list(g.prompt.messages)


def test_docstring_examples_run() -> None:
    import doctest

    import ragbudget.generation.backend
    import ragbudget.generation.engines._base
    import ragbudget.generation.engines._http

    for module in (
        ragbudget.generation.backend,
        ragbudget.generation.engines,
        ragbudget.generation.engines._base,
        ragbudget.generation.engines._http,
    ):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_a_closed_backend_says_so_in_a_ragbudget_error_not_httpx_runtime_error() -> None:
    """After close(), asking the engine anything is an EngineError naming the engine and what to
    do, as every other engine failure is: httpx's "client has been closed" RuntimeError escaped
    every caller's handling (found when a test read capacity() after check_engine closed it)."""
    with Replay("llamacpp") as srv:
        backend = connect(srv.url)
        assert backend.capacity(fresh=True).max_context_tokens
        backend.close()
        with pytest.raises(EngineError, match=r"closed .*connect again") as closed:
            backend.capacity(fresh=True)
        assert srv.url in str(closed.value) and closed.value.kind == "llamacpp"
        with pytest.raises(EngineError, match="closed"):
            list(backend.http.stream("/v1/chat/completions", {"messages": []}))


def _resetting(resets: dict[str, int], error: type[httpx.HTTPError] = httpx.ReadError) -> httpx.MockTransport:
    """A transport whose first ``resets[path]`` requests to ``path`` fail as a reset connection
    does (the rest answer 200 with a token list); ``resets`` counts down, and ``transport.seen``
    counts what was sent."""
    seen: Counter[str] = Counter()

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        seen[path] += 1
        if resets.get(path, 0) > 0:
            resets[path] -= 1
            raise error("connection reset by peer", request=request)
        return httpx.Response(200, json={"tokens": [1, 2, 3]})

    transport = httpx.MockTransport(handler)
    transport.seen = seen  # type: ignore[attr-defined]
    return transport


@pytest.mark.parametrize("error", [httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError])
def test_a_reset_count_is_sent_again_but_never_a_generation(error: type[httpx.HTTPError]) -> None:
    """llama.cpp's HTTP server listens with a backlog of 5: a burst of token counts on a busy
    host can find its connection reset. A request that changes nothing on the engine is sent
    again (up to RESET_RETRIES times, after a short pause); a generation is not — the engine may
    have started it, and a second one would generate twice."""
    from ragbudget.generation.engines import _http

    pauses: list[float] = []
    transport = _resetting({"/tokenize": _http.RESET_RETRIES}, error)
    http = HTTP("http://engine.test", transport=transport, sleep=pauses.append, kind="llamacpp")
    assert http.call("POST", "/tokenize", {"content": "hi"}).data == {"tokens": [1, 2, 3]}
    assert transport.seen["/tokenize"] == _http.RESET_RETRIES + 1  # type: ignore[attr-defined]
    assert pauses == [_http.RESET_PAUSE_S * 2**i for i in range(_http.RESET_RETRIES)]

    # One reset more than it retries: the error reaches the caller, a typed engine error.
    transport = _resetting({"/tokenize": _http.RESET_RETRIES + 1}, error)
    http = HTTP("http://engine.test", transport=transport, sleep=lambda s: None, kind="llamacpp")
    with pytest.raises(EngineError):
        http.call("POST", "/tokenize", {"content": "hi"})
    assert transport.seen["/tokenize"] == _http.RESET_RETRIES + 1  # type: ignore[attr-defined]

    # A generation reset once is not sent again.
    transport = _resetting({"/v1/chat/completions": 1}, error)
    http = HTTP("http://engine.test", transport=transport, sleep=lambda s: None, kind="llamacpp")
    with pytest.raises(EngineError):
        http.call("POST", "/v1/chat/completions", {"messages": []})
    assert transport.seen["/v1/chat/completions"] == 1  # type: ignore[attr-defined]


def test_a_timed_out_count_is_not_sent_again() -> None:
    """A time-out is not a reset: the engine may be busy with the request still, and sending it
    again would only queue a second copy behind the first."""
    transport = _resetting({"/tokenize": 1}, httpx.ReadTimeout)
    http = HTTP("http://engine.test", transport=transport, sleep=lambda s: None, kind="llamacpp")
    with pytest.raises(EngineError):
        http.call("POST", "/tokenize", {"content": "hi"})
    assert transport.seen["/tokenize"] == 1  # type: ignore[attr-defined]
