"""ragbudget.cli.options: option groups reach a command as one settings record (a bad combination
is a usage error, exit code 2, in one line), and the error boundary turns library errors into one
line and exit code 1."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import click
import pytest
from click.testing import CliRunner

from ragbudget.cli.options import (
    missing_module,
    retrieval_options,
    sampling_options,
    search_options,
    setting,
    user_errors,
)
from ragbudget.errors import BudgetError
from ragbudget.settings import (
    DEFAULT_RELEVANCE_FLOOR,
    ClientTimeoutSettings,
    EngineSettings,
    HistorySettings,
    MemorySettings,
    RetrievalSettings,
)

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


# --- every default is stated once -------------------------------------------------------------------

#: The options that set a field of a settings record (by parameter name): ``(record, field)``, or
#: ``(record, field, CLI value -> field value)``. Their default must be the field's.
SETTINGS_OPTIONS: dict[str, tuple[Any, ...]] = {
    **{n: (HistorySettings, n) for n in ("history_share", "summary_max_tokens", "recent_turns", "rewrite_with_model")},
    **{n: (HistorySettings, n) for n in ("max_messages", "max_history_chars")},
    **{n: (ClientTimeoutSettings, n) for n in ("header_timeout", "body_idle_timeout", "body_timeout")},
    "retrieval": (RetrievalSettings, "hybrid", lambda v: v == "hybrid"),
    **{n: (RetrievalSettings, n) for n in ("lexical_weight", "fusion", "fetch_k", "order", "pack")},
    **{n: (RetrievalSettings, n) for n in ("fill_remainder", "relevance_floor", "span_floor")},
    "engine": (EngineSettings, "url"),
    "engine_kind": (EngineSettings, "kind"),
    "api_key_env": (EngineSettings, "api_key_env"),
    "tokenizer": (EngineSettings, "tokenizer"),
    "engine_context_tokens": (EngineSettings, "context_tokens"),
    "engine_timeout": (EngineSettings, "timeout"),
    **{n: (MemorySettings, n) for n in ("gpu", "concurrency", "max_new_tokens", "kv_dtype", "cache")},
    **{n: (MemorySettings, n) for n in ("utilization", "ttft_target")},
}


def _parameter(fn: Callable[..., Any], name: str) -> Any:
    return inspect.signature(fn).parameters[name].default


def _library_defaults() -> dict[tuple[str, str], Any]:
    """``{(command, option): default}`` for the options with a default that no settings record
    holds: the library's own, from the signature or constant of what the option is handed to."""
    from ragbudget.input.loaders import DEFAULT_MAX_BYTES
    from ragbudget.pipeline import Pipeline
    from ragbudget.retrieval.index import Index
    from ragbudget.server.app import create_app, serve
    from ragbudget.types import DEFAULT_INDEX_DIR

    return {
        **{(c, "index_dir"): DEFAULT_INDEX_DIR for c in ("index", "search", "stats", "sources", "verify")},
        **{(c, "index_dir"): DEFAULT_INDEX_DIR for c in ("budget", "ask", "chat", "serve")},
        ("index", "max_file_mb"): DEFAULT_MAX_BYTES / 2**20,
        ("index", "store"): _parameter(Index.build, "store"),
        ("index", "executor"): _parameter(Index.build, "executor"),
        ("search", "k"): _parameter(Pipeline.search, "k"),
        ("serve", "host"): _parameter(serve, "host"),
        ("serve", "port"): _parameter(serve, "port"),
        ("serve", "request_timeout"): _parameter(create_app, "request_timeout"),
    }


#: Options whose unset value (``None``) means "what the index records" (index_settings): the
#: record's default applies to a new index only, and the help says so.
INDEX_RECORDED = {("index", n) for n in ("min_tokens", "max_tokens", "dedup", "sentence_vectors")}


def _unset(default: Any) -> bool:
    """No default: ``None``, a flag's ``False``, empty, or click's own marker (click >= 8.2)."""
    return default is None or default is False or default == () or default == "" or default is _UNSET


_UNSET = getattr(click.core, "UNSET", None)


def default_findings(commands: dict[str, click.Command]) -> list[str]:
    """A line for each option of ``commands`` whose default differs from its settings record's
    field (or the library's, for the few no record holds), and for each option with a default
    that neither states."""
    library = _library_defaults()
    out = []
    for name, command in sorted(commands.items()):
        for param in command.params:
            if not isinstance(param, click.Option) or param.name is None:
                continue
            key, default = (name, param.name), param.default
            if param.name in SETTINGS_OPTIONS and key not in INDEX_RECORDED:
                record, field, *convert = SETTINGS_OPTIONS[param.name]
                value = convert[0](default) if convert else default
                want = getattr(record(), field)
                if value != want or type(value) is not type(want):
                    out.append(f"{name} --{param.name}: {default!r}, but {record.__name__}.{field} is {want!r}")
            elif key in library:
                if default != library[key]:
                    out.append(f"{name} --{param.name}: {default!r}, but the library's default is {library[key]!r}")
            elif not _unset(default) and not param.count:
                out.append(f"{name} --{param.name}: {default!r} is a default no settings record or library states")
    return out


def test_every_cli_default_is_its_settings_records() -> None:
    # A default is stated once, in the settings record (or, for the few options no record holds,
    # by the library function the option is handed to); the CLI reads it from there.
    from ragbudget.cli.commands import cli

    assert isinstance(cli, click.Group)
    assert default_findings(dict(cli.commands)) == []
    # what a command is handed when its options are left out is the record itself
    SEEN.clear()
    assert CliRunner().invoke(_ask, []).exit_code == 0
    assert SEEN["retrieval"] == RetrievalSettings()
    assert setting(EngineSettings, "timeout") == EngineSettings().timeout


def test_the_default_check_sees_a_restated_or_unknown_default() -> None:
    # The check itself: a default restated with another value, and one with no home, are reported.
    @click.command()
    @click.option("--fetch-k", default=40)
    @click.option("--relevance-floor", default=None)
    @click.option("--port", default=8001)
    @click.option("--sizes", default=3)
    def serve(**_: Any) -> None: ...

    assert default_findings({"serve": serve}) == [
        "serve --fetch_k: 40, but RetrievalSettings.fetch_k is 50",
        f"serve --relevance_floor: None, but RetrievalSettings.relevance_floor is {DEFAULT_RELEVANCE_FLOOR!r}",
        "serve --port: 8001, but the library's default is 8000",
        "serve --sizes: 3 is a default no settings record or library states",
    ]


def test_an_engine_option_given_without_an_engine_is_refused_even_at_its_default() -> None:
    # The engine options take the record's defaults; what makes one "given" is the command line,
    # not a value that differs from the default (which would let --engine-timeout 30 pass unseen).
    from ragbudget.cli.commands import cli

    # The time-out's default (None: drawn from the engine's speed) cannot be typed: the old one is.
    assert EngineSettings().timeout is None
    for option in (["--engine-timeout", "30"], ["--engine-kind", EngineSettings().kind]):
        result = CliRunner().invoke(cli, ["ask", "q", *option])
        assert result.exit_code == 2 and f"{option[0]} need --engine URL" in result.output, result.output
    help_text = " ".join(CliRunner().invoke(cli, ["ask", "--help"]).output.split())
    assert f"the allowance). [default: {DEFAULT_RELEVANCE_FLOOR};" in help_text  # the record's, shown by click


#: Options whose default is still a literal in ragbudget/cli, each with the library default it
#: matches (test_every_cli_default_is_its_settings_records compares them): no settings record holds
#: them, and the constant the CLI could read lives in another stage. Remove an entry when the
#: library states it as a constant the CLI can import cheaply.
LITERAL_DEFAULTS = {
    "--max-file-mb": "input.loaders.DEFAULT_MAX_BYTES: importing loaders costs ~130 ms at every CLI start",
    "--store": "the store= default of retrieval.index.Index.build's signature",
    "--executor": "the executor= default of retrieval.index.Index.build's signature",
    "-k": "the k= default of pipeline.Pipeline.search's signature",
}


def literal_defaults(source: str) -> list[str]:
    """The options of ``click.option(...)`` calls in ``source`` whose ``default=`` is a literal
    other than "unset" (``None``, ``False``, ``""``), by their first name."""
    import ast

    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "option"):
            continue
        for kw in node.keywords:
            value = kw.value
            if isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.USub):
                value = value.operand  # -1 is a literal too
            if kw.arg == "default" and isinstance(value, ast.Constant) and value.value not in (None, False, ""):
                first = node.args[0]
                out.append(first.value if isinstance(first, ast.Constant) else ast.unparse(first))
    return out


def test_no_cli_default_is_a_literal() -> None:
    # A default the CLI writes as a literal is a second statement of it: a change to the record
    # would leave --help (and the command) on the old value. They read the record (or constant).
    from pathlib import Path

    import ragbudget.cli

    folder = Path(ragbudget.cli.__file__).parent
    found = sorted(o for p in sorted(folder.glob("*.py")) for o in literal_defaults(p.read_text(encoding="utf-8")))
    assert found == sorted(LITERAL_DEFAULTS)
    # The check itself: a literal default is seen, an unset one and one read from a record are not.
    sample = (
        '@click.option("--fetch-k", default=50)\n@click.option("--port", default=-1)\n'
        '@click.option("--tokenizer", default=None)\n@click.option("--x", default=setting(R, "x"))\ndef f(): ...\n'
    )
    assert literal_defaults(sample) == ["--fetch-k", "--port"]
