"""The models admission control decides by: what a request pins, how long its work takes on a
host shared by the running requests (the processor-sharing simulator, checked by hand), and what
the requests that ran teach the time model."""

from __future__ import annotations

import math

import pytest

from ragbudget.errors import BudgetError, ConfigError
from ragbudget.memory.schedule import Job, Learning, MemoryModel, Throughput, first_token_if_started, simulate

# 1 ms per prompt token, 10 ms per generated token: a 1,000 + 100 request is 2 s of work.
THR = Throughput(prefill_a=0.001, decode_s=0.01)


def test_simulate_processor_sharing_by_hand() -> None:
    a = Job(prefill=1.0, decode=1.0, cost=1)
    b = Job(prefill=1.0, decode=1.0, cost=1)
    # Both queued, no target: both start at once and share the host: first tokens at 2 s.
    assert simulate([], [a, b], throughput=THR, capacity=10, ttft_target=None) == [2.0, 2.0]
    # With a 1.5 s target b cannot start next to a (its prefill would take 2 s): it waits for a
    # to finish (2 s) and then prefills alone (1 s).
    assert simulate([], [a, b], throughput=THR, capacity=10, ttft_target=1.5) == [1.0, 3.0]
    # Memory for one at a time: the same, whatever the target.
    assert simulate([], [a, b], throughput=THR, capacity=1, ttft_target=None) == [1.0, 3.0]
    # A running job with 0.5 s of decode left, and a promise that can arrive only at t=5.
    r = Job(prefill=1.0, decode=1.0, cost=1, served=1.5)
    p = Job(prefill=1.0, decode=0.0, cost=1, ready=5.0)
    assert simulate([r], [p], throughput=THR, capacity=1, ttft_target=None) == [6.0]


def test_batched_backend_admits_more_next_to_decoding_requests() -> None:
    job = Job(prefill=0.5, decode=1.0, cost=1)
    decoding = [Job(prefill=0.1, decode=5.0, cost=1, served=1.0) for _ in range(6)]
    alone = Throughput(prefill_a=0.001, decode_s=0.01)
    shared = Throughput(prefill_a=0.001, decode_s=0.01, batched=True, decode_extra_s=0.001)
    # Threads share the cores: 7 ways. A batch shares forward passes: prefill + one batch.
    assert first_token_if_started(job, decoding, alone) == pytest.approx(3.5)
    assert first_token_if_started(job, decoding, shared) == pytest.approx(1.0)


def test_simulate_counts_the_paged_cache_as_a_second_resource() -> None:
    a = Job(prefill=1.0, decode=1.0, cost=1, tokens=600)
    b = Job(prefill=1.0, decode=1.0, cost=1, tokens=600)
    # Memory for both, but the 1,000-token cache for one at a time: b starts when a ends.
    assert simulate([], [a, b], throughput=THR, capacity=10, ttft_target=None) == [2.0, 2.0]
    assert simulate([], [a, b], throughput=THR, capacity=10, ttft_target=None, token_capacity=1000) == [1.0, 3.0]


def test_memory_model_counts_pages_of_a_pool_and_refuses_what_can_never_fit() -> None:
    # 2 B per KV token + 16 B per sequence; activations 3 B per prompt token.
    m = MemoryModel(capacity_bytes=1_000, kv_bytes_per_token=2, kv_fixed_bytes=16, activation=lambda n: 3 * n)
    assert m.request_bytes(prompt_tokens=100, tokens=150) == 16 + 300 + 300
    assert m.tokens_for_bytes(216) == 100
    m.check_fits(prompt_tokens=100, tokens=150)  # 616 of 1,000 B: fits
    with pytest.raises(BudgetError, match="the activations of a 1000-token prefill") as err:
        m.check_fits(prompt_tokens=1000, tokens=1000)  # 2,016 + 3,000 B
    assert err.value.needed == 1000
    # A pool of 64 tokens in pages of 16: a 40-token request takes 48; one of 70 can never run.
    paged = MemoryModel(capacity_bytes=1_000, kv_bytes_per_token=2, kv_pool_tokens=64, kv_pool_page=16)
    assert paged.pool_tokens(40) == 48 and paged.request_bytes(prompt_tokens=40, tokens=40) == 0
    paged.check_fits(prompt_tokens=10, tokens=64)
    with pytest.raises(BudgetError, match=r"needs 70 KV-cache tokens \(80 in whole pages\)"):
        paged.check_fits(prompt_tokens=10, tokens=70)
    for bad in (
        {"capacity_bytes": 0, "kv_bytes_per_token": 1},
        {"capacity_bytes": 1, "kv_bytes_per_token": -1},
        {"capacity_bytes": 1, "kv_bytes_per_token": 1, "kv_pool_tokens": 0},
        {"capacity_bytes": 1, "kv_bytes_per_token": 1, "kv_pool_page": 0},
    ):
        with pytest.raises(ConfigError):
            MemoryModel(**bad)


def test_throughput_step_costs_and_its_checks() -> None:
    t = Throughput(prefill_a=0.001, prefill_b=1e-6, decode_s=0.02, batched=True, decode_extra_s=0.005)
    assert t.prefill_seconds(1000) == pytest.approx(1.0 + 1.0)  # a·n + b·n²
    assert t.step_seconds(1) == 0.02 and t.step_seconds(5) == pytest.approx(0.02 + 4 * 0.005)
    assert Throughput(prefill_a=0.0, decode_s=0.02).step_seconds(3) == pytest.approx(0.06)  # no extra: whole steps
    assert t.to_dict()["decode_extra_s"] == 0.005
    for bad in ({"prefill_a": -1.0, "decode_s": 0.1}, {"prefill_a": 0.0, "decode_s": 0.0}):
        with pytest.raises(ConfigError, match="throughput must be positive"):
            Throughput(**bad)
    with pytest.raises(ConfigError, match="slowdown"):
        Throughput(prefill_a=0.0, decode_s=0.1, slowdown=0.0)


def test_learning_takes_a_provisional_speed_whole_then_blends_in_log_space() -> None:
    learnt, thr = Learning(), Throughput(prefill_a=0.001, decode_s=0.01)
    # Provisional (three observations): the slower of the model and the sample stands.
    thr = learnt.slowed(thr, 4.0)
    thr = learnt.slowed(thr, 2.0)
    assert thr.slowdown == 4.0
    thr = learnt.slowed(thr, 1000.0)
    assert thr.slowdown == 100.0  # bounded by SLOWDOWN_RANGE
    # Then each sample moves it half-way in log space: √(100 × 1) = 10.
    thr = learnt.slowed(thr, 1.0)
    assert thr.slowdown == pytest.approx(10.0)
    for nothing in (0.0, -1.0, math.inf, math.nan):  # samples that mean nothing change nothing
        assert learnt.slowed(thr, nothing) is thr
    learnt.measured()  # a new measurement: provisional again
    assert learnt.slowed(thr, 20.0).slowdown == 20.0


def test_learning_expects_the_share_of_max_new_tokens_answers_used() -> None:
    learnt = Learning()
    assert learnt.expected_new_tokens(100) == 100  # nothing seen yet: the whole of it
    for _ in range(60):
        learnt.answered(0, 100)
    assert learnt.answer_share == Learning.MIN_ANSWER_SHARE  # never below the floor
    learnt.answered(100, 0)  # no max_new_tokens: nothing to learn
    assert learnt.expected_new_tokens(100) == 5
