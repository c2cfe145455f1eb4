"""The docs site says what the code does: every option, settings field, metric, exported name,
HTTP route and report key is on its reference page, the generated pages are current, and the
commands the guides show run and print what the page says.

The pages are built by ``make docs`` (``mkdocs build --strict``: a broken link or anchor fails
it); these tests hold what a build cannot see. The conventions are in CONTRIBUTING.md ("Docs").
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from test_readme import CHECKED, Block, _env, _fixture, blocks, run_block

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
REFERENCE = DOCS / "reference"
sys.path.insert(0, str(REPO / "tools"))

import docs_reference  # noqa: E402  (tools/, after the path is set)

#: Pages whose code blocks are not held to the markers: the archive of the benchmarks page.
UNCHECKED = {"benchmark-history.md"}


def pages() -> list[Path]:
    """The docs pages in the order of mkdocs.yml's nav (the tutorial first), then any other."""
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    ordered = [DOCS / p for p in nav if (DOCS / p).exists()]
    return ordered + sorted(p for p in DOCS.rglob("*.md") if p not in ordered)


def section(page: str, heading: str) -> str:
    """The text of ``page`` under the heading ``heading`` (up to the next heading of its level)."""
    text = page
    start = text.index(heading + "\n")
    level = heading.split(" ")[0]
    after = text.find(f"\n{level} ", start + len(heading))
    return text[start : after if after != -1 else len(text)]


# -- generated pages --------------------------------------------------------------------------------


def test_the_generated_reference_pages_are_current() -> None:
    assert docs_reference.stale() == [], "run `python tools/docs_reference.py --write` and commit the pages"


def test_every_option_of_every_command_is_in_the_cli_reference() -> None:
    page = (REFERENCE / "cli.md").read_text()
    commands = docs_reference.command_names()
    assert {"ragbudget models list", "ragbudget models fetch", "ragbudget serve", "ragbudget ask"} <= set(commands)
    assert [c for c in commands if f"\n## `{c}`\n" not in page] == []
    found = docs_reference.cli_options()
    missing = [f"{command} {option}" for command, option in found if option not in section(page, f"## `{command}`")]
    assert missing == []
    # The options the issue named, each in its own command's section.
    for command, option in (
        ("ragbudget serve", "--header-timeout"),
        ("ragbudget serve", "--body-idle-timeout"),
        ("ragbudget serve", "--body-timeout"),
        ("ragbudget serve", "--host"),
        ("ragbudget ask", "--evidence-floor"),
        ("ragbudget budget", "--tensor-parallel"),
        ("ragbudget ask", "--kv-dtype"),
        ("ragbudget ask", "--utilization"),
    ):
        assert f"`{option}" in section(page, f"## `{command}`"), (command, option)


def test_every_option_has_help() -> None:
    from ragbudget.cli.commands import cli

    def walk(cmd: click.Command, path: str) -> list[str]:
        out = [f"{path} {'/'.join(p.opts)}" for p in cmd.params if isinstance(p, click.Option) and not p.help]
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                out += walk(sub, f"{path} {name}")
        return out

    assert walk(cli, "ragbudget") == [], "give these options help=: the reference prints it"


def test_an_undocumented_option_makes_the_cli_reference_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    from ragbudget.cli.commands import cli

    serve = cli.commands["serve"]
    added = click.Option(["--brand-new"], help="An option added without regenerating the page.")
    monkeypatch.setattr(serve, "params", [*serve.params, added])
    assert "--brand-new" in section(docs_reference.cli_reference(), "## `ragbudget serve`")
    assert "docs/reference/cli.md" in docs_reference.stale()
    assert ("ragbudget serve", "--brand-new") in docs_reference.cli_options()


def test_every_settings_field_is_documented_in_its_record_and_on_the_page() -> None:
    import dataclasses

    page = (REFERENCE / "settings.md").read_text()
    records = docs_reference.settings_records()
    import ragbudget.settings as settings

    assert {r.__name__ for r in records} == {n for n in settings.__all__ if n.endswith("Settings")}
    for record in records:
        _, described = docs_reference.attributes(record.__doc__ or "")
        names = [f.name for f in dataclasses.fields(record)]
        # Every field has its line in the record's "Attributes:" (the page takes it from there).
        assert set(names) <= set(described), (record.__name__, set(names) - set(described))
        text = section(page, f"## `{record.__name__}`")
        assert all(f"| `{n}` |" in text for n in names), record.__name__


def test_the_attributes_parser_reads_continuation_lines() -> None:
    text, fields = docs_reference.attributes(
        "A record.\n\n    Attributes:\n        a: the first,\n            on two lines.\n        b: the second.\n"
    )
    assert text == "A record." and fields == {"a": "the first, on two lines.", "b": "the second."}


def test_every_metric_the_server_names_is_in_the_catalogue_and_on_the_page() -> None:
    from ragbudget.server.metrics import METRICS, Metrics, admission_gauges

    named = set()
    for path in (REPO / "ragbudget" / "server").rglob("*.py"):
        tree = ast.parse(path.read_text())
        # Docstrings are prose (a doctest's prefix, say), not the names the server writes.
        docs = {id(ast.get_docstring(n, clean=False) and n.body[0].value) for n in ast.walk(tree) if _has_body(n)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                named |= set(re.findall(r"\bragbudget_[a-z_]+\b", node.value))
    # Series names, not the histograms' suffixed samples.
    named = {n for n in named if not n.endswith(("_bucket", "_sum", "_count"))}
    assert named - set(METRICS) == set()
    # What a scrape shows with every counter, histogram and admission gauge there.
    m = Metrics()
    m.count_request("/v1/chat/completions", 200)
    for name, metric in METRICS.items():
        if metric.kind == "histogram":
            m.observe(name, 0.1)
    keys = ("running", "queued", "admitted_tokens", "capacity_tokens", "capacity_bytes", "admitted_bytes")
    stats = {k: 1.0 for k in (*keys, "peak_admitted_bytes", "refused_for_time_total", "work_ahead_s", "slowdown")}
    shown = set(re.findall(r"^# TYPE (\S+)", m.render(admission_gauges(stats)), re.M))
    assert shown <= set(METRICS)
    page = (REFERENCE / "metrics.md").read_text()
    assert [n for n in METRICS if f"| `{n}` |" not in page] == []


def _has_body(node: ast.AST) -> bool:
    return isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))


# -- the hand-written reference ---------------------------------------------------------------------


def _directives() -> set[str]:
    return {m for page in REFERENCE.glob("*.md") for m in re.findall(r"^::: ([\w.]+)$", page.read_text(), re.M)}


def test_every_exported_name_is_in_the_api_reference() -> None:
    import ragbudget

    directives = _directives()
    settings_page = (REFERENCE / "settings.md").read_text()
    # A module rendered whole (``::: ragbudget.errors``) documents every name of its __all__.
    whole = {name for d in directives for name in getattr(_module(d), "__all__", [])}
    missing = [
        name
        for name in ragbudget.__all__
        if name != "__version__"
        and f"ragbudget.{name}" not in directives
        and name not in whole
        and f"## `{name}`" not in settings_page
    ]
    assert missing == []


def _module(dotted: str) -> object:
    try:
        return importlib.import_module(dotted)
    except ImportError:
        return None


def test_every_http_route_is_in_the_http_reference() -> None:
    source = (REPO / "ragbudget" / "server" / "app.py").read_text()
    routes = re.findall(r'@app\.(get|post)\("([^"]+)"\)', source)
    assert len(routes) >= 5
    page = (REFERENCE / "http.md").read_text()
    assert [f"{m.upper()} {p}" for m, p in routes if f"## `{m.upper()} {p}`" not in page] == []


def _report_keys() -> set[str]:
    """The keys ragbudget/answer.py writes into a report and its budget, the sources' keys, and
    the keys of the records the report holds (evidence, citations, an OOM step)."""
    keys: set[str] = set()
    tree = ast.parse((REPO / "ragbudget" / "answer.py").read_text())
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(fn):
            if isinstance(node, ast.Dict):
                keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            stored = isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
            if stored and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                keys.add(node.slice.value)
    from ragbudget.citations import attribute
    from ragbudget.evidence import Evidence
    from ragbudget.generation.generate import OOMStep
    from ragbudget.packing.select import DROP_REASONS

    keys |= set(Evidence(score=0.5, floor=0.45, source="x").to_dict())
    keys |= set(attribute("x [1]", ["x"]).to_dict())
    keys |= set(OOMStep("drop_chunks", "x", 2, 1, "dynamic").to_dict())
    return keys | set(DROP_REASONS)


def test_every_report_key_is_in_the_answer_reference() -> None:
    keys = _report_keys()
    assert {"budget", "evidence", "citations", "kv_tokens_reserved", "context_limit", "below_relevance_floor"} <= keys
    page = (REFERENCE / "answer.md").read_text()
    assert sorted(k for k in keys if f"`{k}`" not in page) == []


# -- the code blocks of the guides ------------------------------------------------------------------


def test_every_shell_and_python_block_of_the_docs_is_marked() -> None:
    unmarked, no_reason = [], []
    for page in pages():
        if page.name in UNCHECKED:
            continue
        for b in blocks(page.read_text()):
            where = f"{page.relative_to(REPO)}:{b.line}"
            if b.lang in CHECKED and b.mark is None:
                unmarked.append(where)
            if b.mark == "not-runnable" and not b.reason:
                no_reason.append(where)
    assert unmarked == [], "mark these blocks <!-- runnable --> or <!-- not-runnable: REASON -->"
    assert no_reason == []


def console(code: str) -> list[tuple[str, str]]:
    """A console block's ``(command, expected output)`` pairs: each ``$ `` line and the lines up
    to the next one."""
    out: list[tuple[str, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line)
    return [(cmd, "\n".join(lines).strip("\n")) for cmd, lines in out]


def matches(expected: str, got: str) -> bool:
    """Whether ``got`` is what ``expected`` shows, line for line, ``…`` standing for any text
    (trailing blanks ignored)."""
    want = [line.rstrip() for line in expected.strip("\n").splitlines()]
    have = [line.rstrip() for line in got.strip("\n").splitlines()]
    pattern = [re.escape(line).replace("…", ".*") for line in want]
    return len(want) == len(have) and all(re.fullmatch(p, h) for p, h in zip(pattern, have, strict=True))


def run_command(cmd: str, cwd: Path) -> str:
    """What ``cmd`` prints (stdout and stderr, as a terminal shows them), run in ``cwd``. A
    ``ragbudget`` command runs in this process through click's runner — torch and transformers
    are imported once for all of them, not once a command — with the environment and the working
    folder it changes put back; anything else runs in bash."""
    import os
    import shlex

    from click.testing import CliRunner

    args = shlex.split(cmd)
    if args[:1] != ["ragbudget"] or any(a in {"|", "&&", ";", ">"} for a in args):
        prelude = f'ragbudget() {{ "{sys.executable}" -m ragbudget "$@"; }}\n'
        out = subprocess.run(
            ["bash", "-c", prelude + cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600
        )
        return out.stdout + out.stderr
    from ragbudget.cli.commands import cli

    saved, here = dict(os.environ), os.getcwd()
    try:
        os.chdir(cwd)
        result = CliRunner().invoke(cli, args[1:], prog_name="ragbudget")
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.output


def run_console(block: Block, cwd: Path) -> list[str]:
    """Each command of a console block run as a reader would type it; the problems found."""
    problems = []
    for cmd, expected in console(block.code):
        got = run_command(cmd, cwd)
        if not matches(expected, got):
            problems.append(f"$ {cmd}\n--- the page says:\n{expected}\n--- it printed:\n{got}")
    return problems


def test_the_console_runner_reads_commands_and_matches_with_ellipses() -> None:
    assert console("$ a\none\n\ntwo\n$ b\n") == [("a", "one\n\ntwo"), ("b", "")]
    assert matches("Error: re-embeds … chunk(s)", "Error: re-embeds 36 chunk(s)  \n")
    assert not matches("Error: re-embeds … chunk(s)", "Error: re-embeds 36 chunk(s)\nmore")
    assert not matches("kv per token  128.0 KiB", "kv per token  64.0 KiB")


def test_a_console_block_that_prints_otherwise_fails(tmp_path: Path) -> None:
    # Model-free and quick: a usage error is click's, before anything loads.
    wrong = Block("console", "$ ragbudget search\nthe page promised something else\n", 1, "runnable", "")
    problems = run_console(wrong, tmp_path)
    assert len(problems) == 1 and "Missing argument 'QUERY'" in problems[0]


@pytest.mark.model
def test_every_runnable_docs_block_runs_and_prints_what_the_page_says(tmp_path: Path) -> None:
    """In nav order, in one folder laid out as the README's (so the tutorial's index serves the
    pages after it): bash and python blocks must succeed, console blocks print what they show."""
    root = _fixture(tmp_path)
    ran, problems = 0, []
    for page in pages():
        if page.name in UNCHECKED:
            continue
        for block in blocks(page.read_text()):
            if block.mark != "runnable" or block.reason == POSTGRES:
                continue
            where = f"{page.relative_to(REPO)}:{block.line}"
            ran += 1
            if block.lang == "console":
                problems += [f"{where}: {p}" for p in run_console(block, root)]
                continue
            out = run_block(block, root)
            if out.returncode != 0:
                problems.append(f"{where} failed:\n{block.code}\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    assert problems == [], "\n\n".join(problems)
    assert ran >= 15


#: The marker reason of a block that needs a PostgreSQL database in ``$DB`` (``<!-- runnable:
#: postgres -->``): run by the test below, on a fresh database of the test server.
POSTGRES = "postgres"


@pytest.mark.postgres
@pytest.mark.model
def test_the_guides_database_commands_run_as_written(tmp_path: Path, pg_url: str) -> None:
    """The deployment guide's commands on a database run as a reader pastes them, with ``$DB`` a
    fresh database of the test's PostgreSQL server (tests/_postgres.py) and ``$DOCS`` a folder of
    documents (the variables the guide's first block sets): the index is built, an unchanged
    run commits nothing, and stats reads it back."""
    root = _fixture(tmp_path)
    env = {"DB": pg_url, "DOCS": str(root / "data" / "manpages")}
    found = [
        (page, block)
        for page in pages()
        for block in blocks(page.read_text())
        if block.mark == "runnable" and block.reason == POSTGRES
    ]
    assert any(page.name == "deployment.md" for page, _ in found)
    for page, block in found:
        out = run_block(block, root, env=env)
        assert out.returncode == 0, f"{page.relative_to(REPO)}:{block.line}\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
        if page.name == "deployment.md":
            assert "generation" in (out.stdout + out.stderr).lower()
