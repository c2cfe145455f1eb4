"""The measurements that refine the plan: a measured CUDA peak recorded as calibration, and the
prefill/decode speed probe (measured once per machine, provisional on a busy host)."""

from __future__ import annotations

import json

import pytest

import ragbudget.memory.calibration
from ragbudget.memory.budget import plan_budget
from ragbudget.memory.calibration import (
    PeakMeasurement,
    context_tokens_for_time,
    lookup_calibration,
    lookup_prefill_speed,
    measure_prefill_speed,
    record_calibration,
    record_measurement,
    throughput_from_speed,
)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_calibration_roundtrip():
    assert lookup_calibration("H100 80GB", "m", "bfloat16", "dynamic") is None
    e = record_calibration(
        gpu_name="H100 80GB",
        model="m",
        dtype="bfloat16",
        cache="dynamic",
        tokens=1000,
        batch_size=1,
        measured_peak_bytes=3000 + 10**6,
        weights_bytes=1000,
        kv_bytes=2000,
    )
    assert e["activation_bytes_per_token"] == 1000
    got = lookup_calibration("h100 80gb", "M", "bfloat16", "dynamic")
    assert got is not None and got["runs"] == 1
    p = plan_budget("HuggingFaceTB/SmolLM2-135M-Instruct", gpu="H100", kv_dtype="bfloat16")
    assert p.activation_source.startswith("estimate")
    record_calibration(
        gpu_name="H100 80GB",
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        dtype="bfloat16",
        cache="dynamic",
        tokens=100,
        batch_size=1,
        measured_peak_bytes=10**9,
        weights_bytes=0,
        kv_bytes=0,
    )
    q = plan_budget("HuggingFaceTB/SmolLM2-135M-Instruct", gpu="H100", kv_dtype="bfloat16")
    assert q.activation_source.startswith("calibrated")
    assert q.activation_bytes == int(10**7 * q.max_context_tokens)


def test_a_measurement_is_recorded_best_effort(tmp_path, monkeypatch):
    m = PeakMeasurement(
        gpu_name="H100 80GB",
        model="m",
        dtype="bfloat16",
        cache="dynamic",
        tokens=1000,
        batch_size=1,
        measured_peak_bytes=3000 + 10**6,
        weights_bytes=1000,
        kv_bytes=2000,
    )
    entry = record_measurement(m)
    assert entry is not None and entry["activation_bytes_per_token"] == 1000
    assert lookup_calibration("H100 80GB", "m", "bfloat16", "dynamic") == entry
    # A cache folder that cannot be written costs the calibration, never the request.
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("RAGBUDGET_CACHE", str(blocked / "cache"))
    assert record_measurement(m) is None


@pytest.mark.model
def test_prefill_speed_is_measured_once_and_turns_seconds_into_tokens(tmp_path, monkeypatch) -> None:
    from _tiny_lm import tiny_model

    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ragbudget.memory.calibration, "load_per_core", lambda: 0.1)  # an idle host
    assert lookup_prefill_speed("tiny", "cpu") is None
    speed = measure_prefill_speed(tiny_model(), name="tiny", device="cpu", lengths=(32, 128))
    assert speed["provisional"] is False
    assert speed["a"] > 0 and speed["b"] >= 0 and [n for n, _ in speed["probes"]] == [32, 128]
    assert lookup_prefill_speed("tiny", "cpu") == speed
    assert lookup_prefill_speed("tiny", "cuda:0") is None  # per device
    # Decode is measured with it: a step of one sequence, and the extra of a shared batch.
    assert speed["decode_s"] > 0 and speed["decode_extra_s"] >= 0
    thr = throughput_from_speed(speed)
    assert thr is not None and thr.decode_s == speed["decode_s"] and not thr.batched
    assert throughput_from_speed({"a": 0.001, "b": 0.0}) is None  # an entry from before: measure
    # seconds = a·n + b·n²: the cap is the positive root, monotone in the time allowed.
    fit = {"a": 0.001, "b": 1e-6}
    n = context_tokens_for_time(fit, 5.0)
    assert 0.001 * n + 1e-6 * n * n <= 5.0 < 0.001 * (n + 1) + 1e-6 * (n + 1) ** 2
    assert context_tokens_for_time(fit, 1.0) < n and context_tokens_for_time(fit, 0) == 0


@pytest.mark.model
def test_prefill_measured_on_a_busy_host_is_measured_again_when_idle(tmp_path, monkeypatch) -> None:
    """A first probe taken while other work shared the cores must not cap every later request:
    it is provisional, re-measured once the host is idle, and the faster measurement is kept."""
    from _tiny_lm import tiny_model

    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))
    load = {"now": 3.0}
    monkeypatch.setattr(ragbudget.memory.calibration, "load_per_core", lambda: load["now"])
    model = tiny_model()
    busy = measure_prefill_speed(model, name="tiny", device="cpu", lengths=(32, 128))
    assert busy["provisional"] is True
    assert lookup_prefill_speed("tiny", "cpu") == busy  # still busy: use what we have
    load["now"] = 0.1
    assert lookup_prefill_speed("tiny", "cpu") is None  # idle now: the caller measures again
    # Pretend the busy probe was 1,000x slower than the machine really is. (Not 10x: two probes of
    # a tiny model take milliseconds, and a fit through them extrapolated to 1,024 tokens swings
    # by more than 10x between two runs on a shared host; the merge ranks by that extrapolation.)
    slow = dict(busy, a=busy["a"] * 1000, b=busy["b"] * 1000)
    path = tmp_path / "cache" / "prefill.json"
    data = json.loads(path.read_text())
    data = {k: slow for k in data}
    path.write_text(json.dumps(data))
    again = measure_prefill_speed(model, name="tiny", device="cpu", lengths=(32, 128))

    def at_1k(e: dict) -> float:  # what the merge ranks by: the fitted time of a 1,024-token prefill
        return e["a"] * 1024 + e["b"] * 1024**2

    # The fit's (a, b) split is noisy on a loaded host; the predicted time is what must improve.
    assert again["provisional"] is False and at_1k(again) < at_1k(slow)
    assert lookup_prefill_speed("tiny", "cpu") == again
