"""Presentation (:mod:`ragbudget.cli.display`): the plan table and plot, an answer's ``--explain``
report, a chat turn's sources and memory line, an index run's summary."""

from __future__ import annotations

import os

import pytest

from ragbudget.cli.display import (
    SOURCES_ORDER,
    format_index_summary,
    format_plan,
    format_report,
    format_sources,
    plot_plan,
)
from ragbudget.memory.budget import plan_budget


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# --- a plan ---------------------------------------------------------------------------------------


def test_plan_table_has_a_row_per_figure() -> None:
    p = plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="RTX 4090")
    text = format_plan(p)
    assert "max context" in text
    lines = text.splitlines()
    assert lines[0].split() == ["model", "meta-llama/Llama-3.1-8B-Instruct"]
    assert next(x for x in lines if x.startswith("kv per token")).split("  ")[-1] == "128.0 KiB"


def test_plan_text_has_no_sliding_window_figure_without_sliding_layers() -> None:
    llama = format_plan(plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="RTX 4090"))
    assert "sliding" not in llama
    gemma = format_plan(plan_budget("google/gemma-3-4b-it", gpu="RTX 4090"))
    assert "below sliding windows" in gemma


def test_plan_text_never_says_max_0_requests() -> None:
    plan = plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="RTX 4090", concurrency=4)
    assert plan.max_concurrency == 0  # one 131,072-token request does not fit 24 GiB
    line = next(x for x in format_plan(plan).splitlines() if x.startswith("concurrency"))
    assert "max 0" not in line
    assert f"4 request(s) of {plan.max_context_tokens:,} tokens each" in line
    assert "131,072" in line and "does not fit" in line


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    p = plan_budget("Qwen/Qwen3-4B", gpu="RTX 4090")
    out = plot_plan(p, tmp_path / "plan.png")
    assert os.path.getsize(out) > 1000


# --- an answer's report ---------------------------------------------------------------------------


def _report(**extra: object) -> dict:
    return {
        "plan": {
            "model": "m",
            "gpu_name": "RTX 4090",
            "gpu_source": "RTX 4090 (table)",
            "gpu_bytes": 24 * 1024**3,
            "utilization": 0.9,
            "cache": "dynamic",
            "kv_dtype": "bf16",
        },
        "budget": {
            "max_new_tokens": 64,
            "max_prompt_tokens": 960,
            "fixed_prompt_tokens": 40,
            "context_tokens_used": 300,
            "context_tokens_allowed": 920,
            "fill": 0.326,
            "prompt_tokens": 340,
            "new_tokens": 12,
            "kv_bytes_per_token": 131072,
            "limited_by": "memory",
            "max_context_tokens": 1024,
        },
        "selection": [
            {
                "sources": [{"path": "docs/a.md", "page": 3}],
                "score": 0.81234,
                "cost": 120,
                "chunk_ids": [7],
                "truncated": True,
            }
        ],
        "dropped": [{"reason": "budget"}, {"reason": "budget"}, {"reason": "floor"}],
        "timings": {"retrieve_s": 0.25, "generate_s": 1.5},
        **extra,
    }


def test_report_table_reads_the_records_figures() -> None:
    text = format_report(_report())
    lines = text.splitlines()
    assert lines[0] == "Budget"
    assert "  memory           RTX 4090 (table): 24.00 GiB × 0.9" in lines
    assert "  context          300 / 920 tokens (32.6% filled)" in lines
    assert "Context: 1 passage(s)" in lines
    assert "  [1] docs/a.md p.3  score 0.812  120 tokens  (truncated)" in lines
    assert "Dropped: 2 budget, 1 floor" in lines
    assert lines[-1] == "Timings: retrieve 0.25s, generate 1.50s"


def test_report_of_a_served_engine_says_what_the_engine_counted() -> None:
    report = _report(engine={"lines": ["vllm at http://x:8000", "window 4096 tokens"]})
    report["budget"]["engine_prompt_tokens"] = 342
    text = format_report(report)
    assert text.startswith("Engine\n  vllm at http://x:8000\n  window 4096 tokens\nBudget\n")
    assert "(engine counted 342)" in text and "KV bytes/token" not in text


# --- a chat turn ----------------------------------------------------------------------------------


def test_sources_block_numbers_them_as_the_answer_cites_them() -> None:
    sources = [
        {"path": "/idx/docs/a.md", "label": "slide 2", "start": 0, "end": 10, "score": 0.5},
        {"path": "/idx/docs/b.md", "page": 4, "start": 5, "end": 9},
    ]
    assert format_sources(sources, lambda p: p.removeprefix("/idx/")) == (
        f"Sources: {SOURCES_ORDER}\n  [1] docs/a.md, slide 2 [0:10] score 0.500\n  [2] docs/b.md, page 4 [5:9]"
    )
    # The numbers are the prompt's order, not a ranking: the header says so (issue #42 §7).
    assert "prompt order" in SOURCES_ORDER and "not sorted by score" in SOURCES_ORDER
    assert format_sources(sources[:1]) == "Sources:\n  [1] /idx/docs/a.md, slide 2 [0:10] score 0.500"


# --- an index run ---------------------------------------------------------------------------------


def test_index_summary_says_what_the_cleaner_removed() -> None:
    # Contents and index pages go like running heads, and the summary says how many lines.
    lines = format_index_summary({"furniture_lines_removed": 522, "contents_lines_removed": 917}).splitlines()
    assert "header/footer lines removed: 522; contents/index lines: 917" in lines
    assert "header/footer lines removed: 5" in format_index_summary({"furniture_lines_removed": 5}).splitlines()
