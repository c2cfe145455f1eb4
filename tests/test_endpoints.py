"""ragbudget.server.endpoints: the state the server's routes share, without HTTP (tests/test_server.py
drives the same classes through a real server)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from _fakes import fake_pipeline

from ragbudget.errors import ConfigError
from ragbudget.generation.backend import Capacity
from ragbudget.server.endpoints import EngineLoad, IndexHealth, Workers
from ragbudget.server.metrics import Metrics
from ragbudget.server.openai_api import APIError, error_from_exception


def bad_value() -> None:
    raise ConfigError("k must be >= 1")


def test_workers_refuse_past_the_pool_and_always_free_their_slot() -> None:
    async def scenario() -> None:
        metrics = Metrics()
        workers = Workers(2, metrics, trim_memory=False)
        gate = threading.Event()
        try:
            running = [workers.submit(gate.wait), workers.submit(gate.wait)]
            assert metrics.in_flight == 2
            with pytest.raises(APIError) as info:  # a third waits nowhere: 429 at once
                workers.submit(gate.wait)
            assert (info.value.status, info.value.code, info.value.headers) == (429, "overloaded", {"Retry-After": "1"})
            assert metrics.in_flight == 2  # the refused one took no slot
            # Clients back for a refusal's promise may run on up to max_workers more threads,
            # at once (not queued behind the busy ones), and no further.
            back = threading.Event()
            returning = [workers.submit(lambda: (back.set(), gate.wait()), returning=True) for _ in range(2)]
            assert await asyncio.to_thread(back.wait, 5) and metrics.in_flight == 4
            with pytest.raises(APIError):
                workers.submit(gate.wait, returning=True)
            gate.set()
            await asyncio.gather(*running, *returning)
            assert metrics.in_flight == 0
            # A failing job frees its slot too, and its error is the HTTP answer it maps to.
            for _ in range(3):
                with pytest.raises(APIError) as info:
                    await workers.run(bad_value, error_from_exception)
                assert info.value.status == 400
            assert metrics.in_flight == 0
            assert await workers.run(lambda: 42, error_from_exception) == 42
        finally:
            workers.shutdown()

    asyncio.run(scenario())


def test_index_health_probe_and_sticky_failures() -> None:
    health = IndexHealth(fake_pipeline())
    assert health.check() is None
    health.require()  # no error
    # A request met a damaged index: /health says so, and a probe that opens the index fine
    # does not clear it; only a request that succeeds does.
    err = APIError(503, "the server's index is unavailable (IndexCorruptError)", code="index_unavailable")
    health.failed(err)
    assert health.check() == err.message and health.sticky
    health.require()  # requests still try (one may succeed and clear it)
    health.ok()
    assert health.check() is None and not health.sticky


def test_index_health_without_an_index(tmp_path: Path) -> None:
    health = IndexHealth(fake_pipeline(index_dir=tmp_path / "nothing-here"))
    problem = health.check()
    assert problem is not None and "IndexNotFoundError" in problem and str(tmp_path) not in problem
    with pytest.raises(APIError) as info:
        health.require()
    assert (info.value.status, info.value.code) == (503, "index_unavailable")


def test_engine_load_refusal_and_description() -> None:
    unread = (None, "cannot reach http://127.0.0.1:9/metrics")
    assert EngineLoad.refusal(unread, 64) is None  # fail open
    assert EngineLoad.describe(unread)["open"] is True and "cannot reach" in EngineLoad.describe(unread)["note"]
    assert {name: value for name, (_, value) in EngineLoad.gauges(unread).items()} == {
        "ragbudget_engine_admission_open": 1
    }
    silent = (Capacity(engine_kind="llamacpp"), "")
    assert EngineLoad.refusal(silent, 64) is None
    assert "llamacpp reports neither" in EngineLoad.describe(silent)["note"]

    queued = (Capacity(running=4, waiting=2, load_source="GET /metrics"), "")
    assert EngineLoad.refusal(queued, 64) == "the engine has 2 request(s) waiting (GET /metrics)"
    full = (Capacity(running=1, waiting=0, kv_tokens_free=10, kv_free_source="GET /metrics kv"), "")
    assert "10 free KV tokens" in str(EngineLoad.refusal(full, 64))
    assert EngineLoad.refusal(full, 8) is None  # room for an answer of 8
    described = EngineLoad.describe(full)
    assert described["open"] is False and described["kv_tokens_free"] == 10
    assert described["sources"] == ["GET /metrics kv"]
    gauges = EngineLoad.gauges(full)
    assert gauges["ragbudget_engine_admission_open"][1] == 0
    assert gauges["ragbudget_engine_kv_free_tokens"][1] == 10
    assert "ragbudget_engine_waiting_requests" in gauges and gauges["ragbudget_engine_waiting_requests"][1] == 0
