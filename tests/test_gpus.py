"""GPU memory resolution: sizes, table lookups, auto detection."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from ragbudget.errors import ConfigError
from ragbudget.gpus import GPU_TABLE, GiB, parse_size, resolve_gpu


def test_table_is_large_enough_and_positive():
    assert len(GPU_TABLE) >= 25
    assert all(v > 0 for v in GPU_TABLE.values())


@pytest.mark.parametrize(
    "name,expected",
    [
        ("RTX 4090", "RTX 4090"),
        ("nvidia geforce rtx 4090", "RTX 4090"),
        ("rtx4090", "RTX 4090"),
        ("A100-80GB", "A100 80GB"),
        ("a100 40gb", "A100 40GB"),
        ("H100", "H100 80GB"),
        ("l40s", "L40S"),
        ("Apple M3 Max", "M3 Max"),
        ("rtx 4070 ti su", "RTX 4070 Ti Super"),
        ("MI300X", "MI300X"),
    ],
)
def test_lookup(name, expected):
    info = resolve_gpu(name)
    assert info.name == expected and info.source == "table"
    assert info.bytes == int(GPU_TABLE[expected] * GiB)


def test_unknown_gpu_lists_close_names():
    with pytest.raises(ConfigError, match="RTX 4090"):
        resolve_gpu("RTX 4909")


@pytest.mark.parametrize(
    "name,choices", [("A100", ("A100 40GB", "A100 80GB")), ("nvidia v100", ("V100 16GB", "V100 32GB"))]
)
def test_ambiguous_short_name_is_an_error_listing_the_sizes(name, choices):
    # "A100" used to plan 80 GB silently: on a 40 GB card that is twice the memory there is.
    with pytest.raises(ConfigError) as e:
        resolve_gpu(name)
    assert all(repr(c) in str(e.value) for c in choices)


@pytest.mark.parametrize("bad", ["-5GiB", "-5", "- 3 GB", "0GB", "0", "-0.5g"])
def test_negative_or_zero_size_is_a_size_error_not_a_gpu_name(bad):
    with pytest.raises(ConfigError, match="memory size must be positive") as e:
        resolve_gpu(bad)
    assert "unknown GPU" not in str(e.value)
    with pytest.raises(ConfigError, match="must be positive"):
        parse_size(bad)


def test_sizes():
    assert parse_size("24GiB") == 24 * GiB
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("16g") == 16 * GiB
    assert parse_size("512MiB") == 512 << 20
    assert parse_size(12345) == 12345
    assert resolve_gpu("24GiB").source == "explicit size"
    assert resolve_gpu(24 * GiB).bytes == 24 * GiB
    for bad in ("lots", "-3GB", "0", True):
        with pytest.raises(ConfigError):
            parse_size(bad)


@given(st.integers(min_value=1, max_value=4096), st.sampled_from(["GiB", "G", "g", "gib"]))
def test_size_roundtrip(n, unit):
    assert parse_size(f"{n}{unit}") == n * GiB


def test_auto_without_gpu_uses_host_ram(monkeypatch):
    import ragbudget.gpus as g

    monkeypatch.setattr(g, "cuda_free", lambda: None)
    info = resolve_gpu(None)
    assert info.source == "host RAM (no GPU)" and info.bytes > 0
    assert any("no CUDA" in n for n in info.notes)


def test_auto_with_cuda(monkeypatch):
    import ragbudget.gpus as g

    monkeypatch.setattr(g, "cuda_free", lambda: ("Fake GPU", 10 * GiB, 24 * GiB))
    info = resolve_gpu("auto")
    assert (info.name, info.bytes, info.source) == ("Fake GPU", 10 * GiB, "cuda:0 free memory")
