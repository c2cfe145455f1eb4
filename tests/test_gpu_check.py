"""The GPU check's verdict: each memory component graded on its own (runs anywhere, no CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_validate  # noqa: E402

MiB = 1 << 20


def _row(
    *,
    weights=1000 * MiB,
    act=100 * MiB,
    kv_peak=50 * MiB,
    kv=40 * MiB,
    m_weights=None,
    m_peak=None,
    m_kv=None,
    m_reserved=None,
) -> dict:
    """A measured case where, by default, every component is predicted exactly."""
    row = {
        "model": "m",
        "ctx": 512,
        "weights": weights,
        "activations": act,
        "kv_peak": kv_peak,
        "kv_steady": kv,
        "predicted": weights + act + kv_peak,
        "measured_weights": weights if m_weights is None else m_weights,
        "measured_peak": weights + act + kv_peak if m_peak is None else m_peak,
        "measured_kv": kv if m_kv is None else m_kv,
    }
    row["measured_reserved"] = row["measured_peak"] if m_reserved is None else m_reserved
    row["components"] = gpu_validate.components(row)
    return row


def test_exact_prediction_passes():
    passed, problems = gpu_validate.verdict([_row()], device="cuda", dry_run=False)
    assert passed and problems == []


def test_activation_error_hidden_by_weight_dominated_total_fails():
    # Activations really 200 MiB (predicted 100): 100% off, but under 10 GiB of weights the total
    # is off by 1%, which a total-only check would pass.
    row = _row(weights=10_000 * MiB, m_weights=10_000 * MiB, m_peak=(10_000 + 200 + 50) * MiB)
    assert abs(row["components"]["total"]["error"]) < 0.05
    passed, problems = gpu_validate.verdict([row], device="cuda", dry_run=False)
    assert not passed
    assert any("activations" in p for p in problems)


def test_kv_must_be_exact():
    passed, problems = gpu_validate.verdict([_row(m_kv=40 * MiB + 2)], device="cuda", dry_run=False)
    assert not passed and "kv" in problems[0]


def test_reserved_past_the_utilization_headroom_fails():
    row = _row(m_reserved=int((1150 * MiB) / 0.9) + MiB)
    passed, problems = gpu_validate.verdict([row], device="cuda", dry_run=False)
    assert not passed and "reserved" in problems[0]


def test_small_activation_difference_within_absolute_slack_passes():
    # 4 MiB predicted, 12 MiB measured: 200% off but under the allocator-block slack.
    row = _row(act=4 * MiB, m_peak=(1000 + 12 + 50) * MiB)
    assert row["components"]["activations"]["ok"]


@pytest.mark.parametrize(
    "row",
    [{"model": "m", "ctx": 1, "failed": "OutOfMemoryError: CUDA"}, {"model": "m", "ctx": 1, "skipped": "time budget"}],
)
def test_oom_or_nothing_measured_fails(row):
    passed, problems = gpu_validate.verdict([row], device="cuda", dry_run=False)
    assert not passed and problems
