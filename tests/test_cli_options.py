"""ragbudget.cli.options: option groups reach a command as one settings record (a bad combination
is a usage error, exit code 2, in one line), and the error boundary turns library errors into one
line and exit code 1."""

from __future__ import annotations

from typing import Any

import click
import pytest
from click.testing import CliRunner

from ragbudget.cli.options import missing_module, retrieval_options, sampling_options, search_options, user_errors
from ragbudget.errors import BudgetError
from ragbudget.settings import DEFAULT_RELEVANCE_FLOOR, RetrievalSettings

SEEN: dict[str, Any] = {}  # what the last command invocation was handed


@click.command()
@retrieval_options
@sampling_options
def _ask(retrieval: RetrievalSettings, sampling: dict[str, Any]) -> None:
    SEEN.update(retrieval=retrieval, sampling=sampling)


@click.command()
@search_options
def _search(retrieval: RetrievalSettings) -> None:
    SEEN.update(retrieval=retrieval)


def test_the_options_reach_the_command_as_one_record() -> None:
    args = ["--retrieval", "dense", "--fusion", "rrf", "--lexical-weight", "0.25", "--fetch-k", "7"]
    result = CliRunner().invoke(_ask, [*args, "--pack", "chunks", "--fill-remainder", "--seed", "3", "--stop", "\n"])
    assert result.exit_code == 0, result.output
    r = SEEN["retrieval"]
    assert r == RetrievalSettings(
        hybrid=False, fusion="rrf", lexical_weight=0.25, fetch_k=7, pack="chunks", fill_remainder=True
    )
    assert r.relevance_floor == DEFAULT_RELEVANCE_FLOOR  # not given: the record's default
    assert SEEN["sampling"] == {"seed": 3, "stop": ["\n"]}  # only what was given
    assert CliRunner().invoke(_search, []).exit_code == 0
    assert SEEN["retrieval"] == RetrievalSettings()  # the defaults of both agree


def test_a_bad_combination_is_a_usage_error_in_one_line() -> None:
    SEEN.clear()
    result = CliRunner().invoke(_ask, ["--pack", "spans", "--fill-remainder"])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "fill_remainder applies to whole-chunk packing only" in errors[0]
    assert "Traceback" not in result.output and not SEEN  # the command itself never ran


def test_cli_option_groups_refuse_a_bad_combination_in_one_line() -> None:
    from click.testing import CliRunner

    from ragbudget.cli.commands import cli

    result = CliRunner().invoke(cli, ["ask", "q", "--pack", "spans", "--fill-remainder"])
    assert result.exit_code == 2
    assert "fill_remainder applies to whole-chunk packing only" in result.output
    assert "Traceback" not in result.output


@click.command()
@click.argument("what")
@user_errors
def _fails(what: str) -> None:
    if what == "budget":
        raise BudgetError("the question alone is 900 tokens; the budget allows 500")
    if what == "extra":
        import matplotlib_not_here  # type: ignore[import-not-found]  # noqa: F401
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize(
    ("what", "line"),
    [
        ("budget", "Error: the question alone is 900 tokens; the budget allows 500"),
        ("extra", "Error: this needs the package 'matplotlib_not_here', which is not installed"),
        ("disk", "Error: OSError: [Errno 28] No space left on device"),
    ],
)
def test_library_errors_are_one_line_and_exit_code_1(what: str, line: str) -> None:
    result = CliRunner().invoke(_fails, [what])
    assert result.exit_code == 1
    assert result.output.startswith(line) and result.output.count("\n") == 1
    assert "Traceback" not in result.output


def test_missing_module_names_the_extra_of_a_submodule_or_the_package_itself() -> None:
    assert missing_module(ModuleNotFoundError(name="matplotlib.pyplot")).endswith("pip install 'ragbudget[plot]'")
    assert missing_module(ModuleNotFoundError(name="fastapi")).endswith("pip install 'ragbudget[serve]'")
    assert missing_module(ModuleNotFoundError(name="foo")).endswith("pip install foo")
