"""Every command the README shows runs, so the README cannot drift from the code.

A fenced ``bash`` or ``python`` block in README.md is marked on the line before its fence, either
``<!-- runnable -->`` (this test runs it) or ``<!-- not-runnable: REASON -->`` (a GPU, a server left
running, a cluster or an install; the reason is required). Runnable blocks run in README order in
one temporary folder whose ``data/`` is a small extract of the repository's ``data/`` (two
Constitution versions and two man pages), with the packaged MiniLM and SmolLM2: bash blocks line by
line under ``set -e`` with ``ragbudget`` meaning this checkout's ``python -m ragbudget``, python
blocks as scripts. The convention is in CONTRIBUTING.md ("README commands").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
#: The languages whose blocks must carry a marker (shell and Python: what a reader pastes).
CHECKED = {"bash", "sh", "shell", "console", "python", "py"}
_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_MARK = re.compile(r"^<!--\s*(runnable|not-runnable)\s*(?::\s*(.*?))?\s*-->$")


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    mark: str | None  # "runnable", "not-runnable" or None
    reason: str


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, each with the marker on the line before its fence."""
    lines = text.splitlines()
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = lines[line - 2].strip() if line >= 2 else ""
        mark = _MARK.match(before)
        out.append(
            Block(
                lang=m.group(1).lower(),
                code=m.group(2),
                line=line,
                mark=mark.group(1) if mark else None,
                reason=(mark.group(2) or "") if mark else "",
            )
        )
    return out


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {
        **env,
        "PYTHONPATH": str(REPO),  # this checkout's package, whatever the venv has installed
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def run_block(
    block: Block, cwd: Path, timeout: float = 900, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run one block as a reader would paste it; a failing line stops a bash block (``set -e``).
    ``env``: variables an earlier, not runnable block of the page sets (``DB``, ``DOCS``)."""
    if block.lang in {"python", "py"}:
        args = [sys.executable, "-c", block.code]
    else:
        prelude = f'set -euo pipefail\nragbudget() {{ "{sys.executable}" -m ragbudget "$@"; }}\n'
        args = ["bash", "-c", prelude + block.code]
    return subprocess.run(args, cwd=cwd, env={**_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout)


def _fixture(tmp_path: Path) -> Path:
    """A folder laid out as the repository root is for the README: a small ``data/``."""
    data = tmp_path / "data"
    for sub in ("versions", "manpages"):
        shutil.copytree(REPO / "data" / sub, data / sub)
    shutil.copy(REPO / "data" / "README.md", data / "README.md")
    return tmp_path


def test_every_shell_and_python_block_is_marked_runnable_or_says_why_not() -> None:
    found = [b for b in blocks(README.read_text()) if b.lang in CHECKED]
    unmarked = [f"README.md:{b.line} ({b.lang})" for b in found if b.mark is None]
    assert not unmarked, f"mark these blocks <!-- runnable --> or <!-- not-runnable: REASON -->: {unmarked}"
    no_reason = [f"README.md:{b.line}" for b in found if b.mark == "not-runnable" and not b.reason]
    assert not no_reason, f"a not-runnable block needs its reason: {no_reason}"
    # Blocks in other languages would escape the check: the README has none.
    others = [f"README.md:{b.line} ({b.lang or 'no language'})" for b in blocks(README.read_text())]
    assert all(b.lang in CHECKED for b in blocks(README.read_text())), others
    runnable = {b.lang for b in found if b.mark == "runnable"}
    assert {"bash", "python"} <= runnable


def test_the_first_screen_has_the_two_commands_an_example_and_the_headline_table() -> None:
    text = README.read_text()
    first = "\n".join(text.splitlines()[:45])
    assert "make demo" in first and "make test" in first
    assert "all-MiniLM-L6-v2" in first  # which embedder a fresh install uses
    example = next(b for b in blocks(text) if b.lang == "python")
    assert example.mark == "runnable" and example.line < 30 and len(example.code.splitlines()) <= 12
    assert "<!-- headline:end -->" in first  # the generated table (tests/test_bench_report.py)


def test_a_broken_readme_command_fails_the_runner(tmp_path: Path) -> None:
    # What the slow test would meet if the README misspelled an option: click refuses it (exit 2).
    text = README.read_text().replace("ragbudget index data/ --exclude", "ragbudget index data/ --exclud", 1)
    broken = next(b for b in blocks(text) if b.mark == "runnable" and "--exclud " in b.code)
    out = run_block(broken, _fixture(tmp_path), timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "No such option '--exclud'" in out.stderr
    # and a Python block that no longer imports
    text = README.read_text().replace("import ragbudget\n", "import ragbudgett\n", 1)
    broken = next(b for b in blocks(text) if b.mark == "runnable" and "ragbudgett" in b.code)
    assert run_block(broken, tmp_path, timeout=300).returncode != 0


@pytest.mark.slow
def test_every_runnable_readme_block_runs(tmp_path: Path) -> None:
    root = _fixture(tmp_path)
    ran = []
    for block in blocks(README.read_text()):
        if block.mark != "runnable":
            continue
        out = run_block(block, root)
        assert out.returncode == 0, (
            f"README.md:{block.line} failed:\n{block.code}\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
        ran.append((block, out.stdout))
    assert len(ran) >= 4
    # A glance at what they printed: an answer with its sources, and a plan.
    outputs = "\n".join(stdout for _, stdout in ran)
    assert "data/versions/constitution" in outputs
    assert "kv per token" in outputs and "index OK" in outputs


def _anchors(page: Path) -> set[str]:
    # GitHub's heading anchors (lower case, punctuation dropped, spaces to hyphens) and explicit ids.
    text = page.read_text()
    found = set(re.findall(r'id="([^"]+)"', text))
    for line in text.splitlines():
        if line.startswith("#"):
            found.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return found


def test_links_between_the_readme_benchmarks_and_docs_resolve() -> None:
    pages = [README, REPO / "BENCHMARKS.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path) if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken
