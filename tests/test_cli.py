"""The CLI contract: commands, JSON keys, exit codes (0 ok, 1 user error, 2 usage error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ragbudget.cli import cli


@pytest.fixture()
def runner() -> CliRunner:
    return CliRunner()


def test_help_lists_the_contract_commands(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["--help"])
    assert result.exit_code == 0
    for command in ("index", "search", "budget", "ask", "stats", "verify"):
        assert command in result.output


def test_budget_json_offline_for_a_shipped_model(runner: CliRunner) -> None:
    result = runner.invoke(
        cli, ["budget", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "RTX 4090", "--json"]
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    for key in ("kv_bytes_per_token", "weights_bytes", "activation_bytes", "gpu_bytes",
                "kv_capacity_tokens", "max_context_tokens", "max_concurrency", "limited_by"):
        assert key in plan, key
    # Llama 3.1 8B: 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes (bf16).
    assert plan["kv_bytes_per_token"] == 32 * 8 * 128 * 2 * 2
    assert plan["gpu_bytes"] == 24 * 1024**3
    assert plan["limited_by"] in ("memory", "model")
    assert 0 < plan["max_context_tokens"] <= 131072


def test_budget_concurrency_divides_the_capacity(runner: CliRunner) -> None:
    args = ["budget", "--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "24GiB", "--json"]
    one = json.loads(runner.invoke(cli, args).output)
    four = json.loads(runner.invoke(cli, [*args, "--concurrency", "4"]).output)
    assert one["limited_by"] == "model" and one["max_context_tokens"] == 32768
    assert four["limited_by"] == "memory"
    # Four requests share the same KV memory: each may hold at most a quarter of it.
    assert 4 * four["max_context_tokens"] <= one["kv_capacity_tokens"]
    assert four["max_context_tokens"] < one["max_context_tokens"]


def test_budget_plot_writes_a_png(runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "plan.png"
    result = runner.invoke(cli, ["budget", "--model", "meta-llama/Llama-3.2-1B-Instruct",
                                 "--gpu", "8GiB", "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_user_error_is_one_line_exit_1(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["budget", "--gpu", "RTX 9999"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: ")
    assert "Traceback" not in result.output
    assert "RTX 4090" in result.output  # says what would have worked


def test_model_that_does_not_fit_is_a_user_error(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["budget", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "RTX 4090"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output


def test_usage_error_exits_2(runner: CliRunner) -> None:
    assert runner.invoke(cli, ["budget", "--no-such-option"]).exit_code == 2
    assert runner.invoke(cli, ["budget", "--concurrency", "0"]).exit_code == 2


def test_search_without_an_index_is_a_user_error(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(cli, ["search", "anything", "--index-dir", str(tmp_path / "none")])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
