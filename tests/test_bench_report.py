"""bench/report.py: BENCHMARKS.md's summary table is generated from the raw results, and a figure on
BENCHMARKS.md, the README or a docs page that is not its raw result's fails the check: a summary row
against its row's pointers, any other figure against the pointer in the comment beside it
(bench/_figures.py), and a measured-looking number with no pointer fails too."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _bench import load_bench

REPO = Path(__file__).resolve().parents[1]


report = load_bench("report.py", "bench_report")


#: What `make docs` (so `make test`) runs: `python bench/report.py --check BENCHMARKS.md README.md docs`.
CHECKED = [REPO / "BENCHMARKS.md", REPO / "README.md", REPO / "docs"]


def test_the_committed_pages_pass_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main(["--check", *map(str, CHECKED)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "marked figures on" in out
    # every docs page but the generated ones and the archive is read for figures
    _, reports = report.check_pages(CHECKED)
    assert "docs/answers.md" in reports and "docs/engines.md" in reports and "README.md" in reports
    assert "docs/benchmark-history.md" not in reports and "docs/reference/cli.md" not in reports
    assert len(reports["BENCHMARKS.md"].figures) > 500


def test_benchmarks_first_table_is_the_generated_summary() -> None:
    text = (REPO / "BENCHMARKS.md").read_text()
    block = text.split(report.SUMMARY_BEGIN, 1)[1].split(report.SUMMARY_END, 1)[0].strip("\n")
    assert block == report.summary()
    # The summary is the page's first table: no other table comes before it.
    first_table = next(n for n, line in enumerate(text.splitlines()) if line.startswith("|"))
    assert text.splitlines()[first_table] == report.summary().splitlines()[0]
    # Each row names its raw file, and every figure comes from that file.
    for row in report.ROWS:
        assert (REPO / "bench" / "results" / row.raw).is_file(), row.raw
        assert f"bench/results/{row.raw}" in block


def test_the_readme_headline_rows_come_from_the_summary() -> None:
    text = (REPO / "README.md").read_text()
    block = text.split(report.HEADLINE_BEGIN, 1)[1].split(report.HEADLINE_END, 1)[0].strip("\n")
    assert block == report.headline()
    headline = [r for r in report.ROWS if r.headline]
    assert 1 <= len(headline) <= 6
    for row in headline:
        assert f"BENCHMARKS.md#{row.id}" in block


def _page_with(tmp_path: Path, old: str, new: str) -> Path:
    text = (REPO / "BENCHMARKS.md").read_text()
    assert old in text
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(text.replace(old, new, 1))
    return page


def test_a_figure_not_in_its_raw_result_fails(tmp_path: Path) -> None:
    # 94.0 is shown as 94.0; 94.1 is outside the rounding shown.
    page = _page_with(tmp_path, "| **94.0% (at 256: 89.3%)** |", "| **94.1% (at 256: 89.3%)** |")
    problems = report.check([page])
    assert any(
        "sum-spans-squad" in p and "94.1" in p and "qa_spans_squad_test.json" in p and "/table/ragbudget_spans/512" in p
        for p in problems
    ), problems
    assert report.main(["--check", str(page)]) == 1


def test_a_ratio_rounded_differently_passes_the_figure_check_but_not_the_generated_block(tmp_path: Path) -> None:
    page = _page_with(tmp_path, "| 0.96× |", "| 1.0× |")
    problems = report.check([page])
    assert not [p for p in problems if "column" in p], problems  # 0.964 rounds to 1.0: a true figure
    assert any("is not what `--write` writes" in p for p in problems)  # but the table is generated


def test_a_ratio_that_is_wrong_fails(tmp_path: Path) -> None:
    page = _page_with(tmp_path, "| 0.96× |", "| 1.3× |")
    assert any("sum-spans-squad, column 'ratio'" in p for p in report.check([page]))


def test_an_unknown_or_missing_row_fails(tmp_path: Path) -> None:
    page = _page_with(tmp_path, 'id="sum-chunking"', 'id="sum-chunkers"')
    problems = report.check([page])
    assert any("'sum-chunkers' is not in bench/report.py's ROWS" in p for p in problems), problems
    assert any("summary row 'sum-chunking' is missing" in p for p in problems), problems


def test_a_readme_figure_is_checked_too(tmp_path: Path) -> None:
    text = (REPO / "README.md").read_text()
    page = tmp_path / "README.md"
    # The chat row's bold figure as the page shows it today, moved by 20 points.
    row = next(line for line in text.splitlines() if "(BENCHMARKS.md#sum-chat)" in line)
    found = re.search(r"\| \*\*(\d+\.\d)% \(", row)
    assert found, row
    old = found.group(0)
    page.write_text(text.replace(old, f"| **{(float(found.group(1)) + 20) % 100:.1f}% (", 1))
    assert any("sum-chat, column 'ragbudget'" in p for p in report.check([page]))


def test_pointers_and_numbers() -> None:
    data = {"a/b": [{"x": 1.5}], "levels": {"2%": 0.99}}
    assert report.resolve(data, "/a~1b/0/x") == 1.5
    assert report.resolve(data, "/levels/2%") == 0.99
    with pytest.raises(KeyError):
        report.resolve(data, "/missing")
    assert report.numbers("97.3% of 1,024 tokens, −1.0 (−3.3, +1.3)") == [
        (97.3, 1),
        (1024.0, 0),
        (-1.0, 1),
        (-3.3, 1),
        (1.3, 1),
    ]


def test_a_mutated_figure_in_the_sections_fails(tmp_path: Path) -> None:
    # "70% fewer context tokens" is 1 - 2,275 / 7,677 (floor_test.json), 70.4%: 80% is not it.
    page = _page_with(tmp_path, "**70%<!--", "**80%<!--")
    problems = report.check([page])
    assert any("the page says 80, its raw result 70.3" in p for p in problems), problems
    # a ratio and a table cell read through a relative pointer, each one digit off
    page = _page_with(tmp_path, "**2.47×**<!--", "**3.47×**<!--")
    problems = report.check([page])
    assert any(
        "the page says 3.47, its raw result 2.47 (batching_smollm2_135m_instruct.json#/rows/2/batched_vs_serial)" in p
        for p in problems
    ), problems
    page = _page_with(tmp_path, "| 74.0<!-- ragbudget_chunks/128/recall", "| 75.0<!-- ragbudget_chunks/128/recall")
    assert any("the page says 75.0, its raw result 74" in p for p in report.check([page]))
    # within the rounding shown passes: 88.33... is 88.3 and 88 (97.3 stands for [97.25, 97.35]); a
    # historical run's figure (coqa_chat_engine_163316f.json), which no re-run changes
    page = _page_with(tmp_path, "88.3%<!-- ragbudget_in_context --> →", "88%<!-- ragbudget_in_context --> →")
    assert report.check([page]) == []


def test_an_unmarked_measured_looking_number_fails(tmp_path: Path) -> None:
    page = _page_with(tmp_path, "88.3%<!-- ragbudget_in_context --> →", "88.3% →")
    problems = report.check([page])
    assert any("88.3 is not marked" in p for p in problems), problems
    # what counts as measured-looking: decimals, %, ×, a unit of time, size or throughput;
    # not a plain integer, a name's number, a code span, a link target, a confidence level
    text = (
        "A run took 12 s on 3 files (4 MB), 2× the other, at 95% interval, "
        "with Qwen2.5-Coder-0.5B, Llama-3.1-8B, p50, `--top-k 0.5`, [x](a/1.5.md) and 7 questions.\n"
    )
    found = [p.split(": ")[1] for p in report._figures.check_page(text, "x.md").problems]
    assert found == [f"{x} is not marked" for x in ("12", "4", "2")], found


def test_a_pointer_that_does_not_resolve_fails(tmp_path: Path) -> None:
    page = _page_with(
        tmp_path, "<!-- LlamaIndex SentenceSplitter/ragbudget_x -->", "<!-- LlamaIndex SentenceSplitter/ragbudget_y -->"
    )
    problems = report.check([page])
    assert any(
        "bench/results/chunking.json has no /results/1 thread/LlamaIndex SentenceSplitter/ragbudget_y" in p
        for p in problems
    )
    page = _page_with(tmp_path, "<!-- raw: chunking.json#", "<!-- raw: chunking2.json#")
    assert any("bench/results/chunking2.json does not exist" in p for p in report.check([page]))
    # a pointer at something that is not a number, a marker after no number, '--' in a marker
    f = report._figures
    assert "not a number" in f.check_page("on 12<!-- abstain.json#/command --> splits", "x.md").problems[0]
    assert "follows no number" in f.check_page("a `x`<!-- abstain.json#/max_wrong_pct --> b", "x.md").problems[0]
    assert "holds '--'" in f.check_page("2%<!-- not measured: see --max-wrong -->", "x.md").problems[0]


def test_the_not_measured_marker_passes_with_its_reason() -> None:
    f = report._figures
    ok = f.check_page("a floor of 0.5<!-- not measured: the default --> and 2 s<!-- not measured: a target -->", "x.md")
    assert ok.problems == [] and ok.not_measured == 2 and ok.figures == []
    bare = f.check_page("a floor of 0.5<!-- not measured -->", "x.md")
    assert "needs its reason" in bare.problems[0]


def test_scales_formulas_and_bases() -> None:
    f = report._figures
    text = (
        "<!-- raw: engines_1024.json#/summary -->"
        "94.5%<!-- ragbudget/recall_in_prompt as % --> and 59.5%<!-- llamaindex/recall_in_prompt as % -->; "
        "1,729 MB<!-- load_bdfe804.json#/bursts/1/predicted_peak_rss_bytes as MB -->; "
        "1.59×<!-- = {ragbudget/recall_in_prompt} / {llamaindex/recall_in_prompt} -->; "
        "200<!-- /settings/questions --> questions"
    )
    result = f.check_page(text, "x.md")
    assert result.problems == [] and len(result.figures) == 5, result.problems
    wrong = f.check_page(text.replace("94.5%<!--", "0.945%<!--"), "x.md")
    assert any("the page says 0.945, its raw result 94.5" in p for p in wrong.problems), wrong.problems


def test_a_raw_directive_applies_from_where_it_stands() -> None:
    f = report._figures
    answers = "answers_squad_test_qwen2_5_coder_0_5b_instruct_q4_k_m.json"
    # on one line: the first marker reads the answers run, the second abstain.json
    text = (
        f"<!-- raw: {answers} -->12<!-- /args/docs --> articles, "
        "then <!-- raw: abstain.json -->150<!-- /args/questions -->"
    )
    assert f.check_page(text, "x.md").problems == []
    # a directive on a line of its own inside a paragraph would split it on GitHub (an HTML block)
    split = f.check_page("a line of prose\n<!-- raw: abstain.json -->\nwith 150<!-- /args/questions -->", "x.md")
    assert any("starts an HTML block" in p for p in split.problems), split.problems
    assert f.check_page("a paragraph\n\n<!-- raw: abstain.json -->\n150<!-- /args/questions -->", "x.md").problems == []


def test_a_docs_page_is_checked(tmp_path: Path) -> None:
    page = tmp_path / "engines.md"
    text = (REPO / "docs" / "engines.md").read_text()
    page.write_text(text)
    assert [p for p in report.check([tmp_path]) if "engines.md" in p] == []
    marked = next(m for m in ("93.5%<!--", "2.08<!--") if m in text)
    page.write_text(text.replace(marked, "9" + marked, 1))
    assert any("engines.md" in p and "the page says 9" in p for p in report.check([tmp_path]))
    page.write_text(text.replace(marked, marked.split("<")[0] + " <!-- -->", 1))
    assert any("engines.md" in p and "is not marked" in p for p in report.check([tmp_path]))


def test_the_archive_is_held_to_its_fingerprint(tmp_path: Path) -> None:
    text = (REPO / "docs" / "benchmark-history.md").read_text()
    page = tmp_path / "benchmark-history.md"
    page.write_text(text)
    assert report.check([page]) == []
    page.write_text(text.replace("99.62%", "99.63%", 1))
    assert any("a number on the archive changed" in p for p in report.check([page]))
    page.write_text(text.replace("Historical record", "A historical record", 1))  # words may change
    assert report.check([page]) == []


def test_generated_reference_pages_are_left_to_their_own_check() -> None:
    generated = [p for p in (REPO / "docs" / "reference").glob("*.md") if report._figures.GENERATED in p.read_text()]
    assert {p.name for p in generated} >= {"cli.md", "settings.md", "metrics.md"}
    assert report.check(generated) == []


def _git(*args: str) -> str:
    import subprocess

    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def _commit_before_change(path: str) -> str:
    """The commit before the last one that changed ``path`` (the test skips in a shallow clone)."""
    import subprocess

    try:
        last = _git("log", "-n", "1", "--format=%H", "--", path)
        return _git("rev-parse", "--short", last + "~1")
    except subprocess.CalledProcessError:
        pytest.skip(f"a shallow clone: no commit before {path}'s last change")


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs the repository's history")
def test_a_result_older_than_the_code_it_measures_is_flagged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """#45 §3: a row whose raw result was measured before a change to the files it exercises is
    listed by --check (and fails it with --stale); one measured at today's code is not."""
    head = _git("rev-parse", "--short", "HEAD")
    before = _commit_before_change("bench/report.py")  # report.py changed since
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    report._raw.cache_clear()
    try:
        for name, commit in (("now.json", head), ("old.json", before), ("dirty.json", head + "+dirty")):
            raw = {"date": "2026-12-06", "command": "python bench/x.py", "versions": {"ragbudget_commit": commit}}
            (tmp_path / name).write_text(json.dumps(raw))
        (tmp_path / "undated.json").write_text(json.dumps({"versions": {"ragbudget_commit": head}}))

        def row(raw: str) -> object:
            return report.Row(
                id="sum-t",
                figure="",
                short="",
                section="",
                raw=raw,
                values={},
                rb="",
                peer="",
                ratio=None,
                data="",
                exercises=("bench/report.py",),
            )

        assert report.staleness(row("now.json")) is None  # measured at HEAD: current
        assert "changed since " + before in (report.staleness(row("old.json")) or "")
        assert "bench/report.py" in (report.staleness(row("old.json")) or "")
        assert "uncommitted" in (report.staleness(row("dirty.json")) or "")
        assert "no commit or no date" in (report.staleness(row("undated.json")) or "")
        # A row declares the commits that cannot move its figure (with why): only those since
        # its commit changed what it exercises → current; one undeclared → stale again.
        from dataclasses import replace

        since = _git("log", "--format=%H", f"{before}..HEAD", "--", "bench/report.py").split()
        assert since
        declared = replace(row("old.json"), unaffected_by={c[:10]: "why" for c in since})
        assert report.staleness(declared) is None
        if len(since) > 1:
            partly = replace(row("old.json"), unaffected_by={c[:10]: "why" for c in since[1:]})
            assert "changed since " + before in (report.staleness(partly) or "")
            # Declared for every row (_EVERY_ROW_UNAFFECTED), together with the row's own.
            monkeypatch.setattr(report, "_EVERY_ROW_UNAFFECTED", {since[0][:10]: "why"})
            assert report.staleness(partly) is None
            monkeypatch.setattr(report, "_EVERY_ROW_UNAFFECTED", {})
            # Declared for every row but those that converse (_UNLESS_A_CONVERSATION).
            monkeypatch.setattr(report, "_UNLESS_A_CONVERSATION", {since[0][:10]: "why"})
            assert report.staleness(partly) is None
            assert "changed since " + before in (report.staleness(replace(partly, converses=True)) or "")
            monkeypatch.setattr(report, "_UNLESS_A_CONVERSATION", {})
        rows = (row("old.json"),)
        monkeypatch.setattr(report, "ROWS", rows)
        monkeypatch.setattr(report, "check_pages", lambda paths: ([], {}))
        assert report.main(["--check", "X.md"]) == 0  # listed, not failed
        assert "stale: sum-t" in capsys.readouterr().err
        assert report.main(["--check", "X.md", "--stale"]) == 1
    finally:
        report._raw.cache_clear()


def test_a_row_whose_data_cell_names_another_split_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    # #45 §3: split labels are read from the raw file, not trusted as typed.
    row = next(r for r in report.ROWS if r.id == "sum-spans-squad")
    assert report.split_problems() == []
    from dataclasses import replace

    wrong = replace(row, data=row.data.replace("squad-test", "squad-tune"))
    monkeypatch.setattr(report, "ROWS", (wrong,))
    assert report.split_problems() == [
        f"sum-spans-squad: bench/results/{row.raw} ran on split 'squad-test', the row says {wrong.data!r}"
    ]


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs the repository's history")
def test_a_script_is_as_old_as_the_bench_scripts_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of bench/answers_floor.py measures with bench/answers.py's code: a change to
    answers.py after the run's commit flags it, though the command names only answers_floor.py.
    The _-prefixed helpers (provenance, engines) are not followed."""
    assert report.bench_scripts(["bench/answers_floor.py"]) == ["bench/answers_floor.py", "bench/answers.py"]
    followed = report.bench_scripts(["bench/abstain_answers.py"])
    assert "bench/answers.py" in followed and not any("/_" in s for s in followed)
    before = _commit_before_change("bench/answers.py")
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "_EVERY_ROW_UNAFFECTED", {})  # whatever that change was declared
    report._raw.cache_clear()
    try:
        command = "python bench/answers_floor.py"
        raw = {"date": "2026-12-07", "command": command, "versions": {"ragbudget_commit": before}}
        (tmp_path / "floor.json").write_text(json.dumps(raw))
        row = report.Row(
            id="sum-f", figure="", short="", section="", raw="floor.json", values={}, rb="", peer="",
            ratio=None, data="", exercises=(),
        )  # fmt: skip
        assert "bench/answers.py" in (report.staleness(row) or "")
    finally:
        report._raw.cache_clear()


def test_a_missing_raw_result_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A page or row pointing at a raw file that is not there (moved before its re-run wrote it)
    fails the check with one line naming the file, not a traceback."""
    monkeypatch.setattr(report, "RESULTS", tmp_path)  # no raw result in it
    report._raw.cache_clear()
    try:
        assert report.main(["--check", str(REPO / "BENCHMARKS.md")]) == 1
    finally:
        report._raw.cache_clear()
    err = capsys.readouterr().err
    assert "no such file" in err and str(tmp_path) in err and "Traceback" not in err


def test_a_question_asked_through_pipeline_ask_never_imports_the_server_or_the_cli(tmp_path: Path) -> None:
    """The answers, abstention and engine rows exercise ``_ASK``: the library but the server and
    the CLI. That holds while ``Pipeline.ask`` (on an engine, as those benchmarks ask) imports
    neither: a change there then leaves their figures current, and one anywhere else stales them."""
    import shutil
    import subprocess
    import sys

    from _fakes import corpus_index
    from _replay import Replay

    assert {r.id: r.exercises for r in report.ROWS}["sum-answers"] == report._ASK
    index_dir = tmp_path / "idx"
    shutil.copytree(corpus_index("hash:256"), index_dir)
    code = (
        "import sys, ragbudget\n"
        "p = ragbudget.Pipeline(sys.argv[1], engine=sys.argv[2], max_new_tokens=16)\n"
        "a = p.ask('How do I reset my password?')\n"
        "print(sorted({m for m in sys.modules if m.startswith(('ragbudget.server', 'ragbudget.cli'))}))\n"
        "print(a.text != '')\n"
    )
    with Replay("llamacpp") as srv:
        out = subprocess.run(
            [sys.executable, "-c", code, str(index_dir), srv.url], capture_output=True, text=True, timeout=120
        )
        asked = srv.calls("POST", "/v1/chat/completions")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["[]", "True"], out.stdout
    assert asked  # the engine answered: the whole way, not a declined question


def test_a_commit_reverted_in_the_range_and_its_revert_need_no_declaration() -> None:
    """A row's staleness passes over commits it declares harmless; a commit undone by a revert
    in the same range changes nothing the row measures, so neither it nor its revert counts.
    A revert whose commit is older than the range still counts (it changed the code since)."""
    log = "".join(
        f"{sha}\0{body}\1"
        for sha, body in (
            ("c" * 40, "Revert the change\n\nThis reverts commit " + "a" * 40 + ".\n"),
            ("b" * 40, "Something else\n"),
            ("a" * 40, "The change\n"),
            ("d" * 40, "Revert an older one\n\nThis reverts commit " + "e" * 12 + ".\n"),
        )
    )
    assert report._unreverted(log) == ["b" * 40, "d" * 40]
    assert report._unreverted(None) == [] and report._unreverted("") == []


def test_a_commit_that_changes_only_comments_and_docstrings_changes_no_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row's figure cannot move with a comment or a docstring: such a commit is passed over
    without a declaration. A change to the code, a new file, or a file that is not Python is a
    change."""
    import subprocess

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            text=True,
        )
        return done.stdout.strip()

    def commit(path: str, text: str) -> str:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text, encoding="utf-8")
        git("add", path)
        git("commit", "-q", "-m", path)
        return git("rev-parse", "HEAD")

    git("init", "-q")
    commit("pkg/a.py", 'def f(x):\n    """Twice."""\n    return 2 * x  # doubled\n')
    monkeypatch.setattr(report, "REPO", tmp_path)
    words = commit("pkg/a.py", 'def f(x):\n    """Twice x, said otherwise."""\n    # why: doubled\n    return 2 * x\n')
    code = commit("pkg/a.py", 'def f(x):\n    """Twice x, said otherwise."""\n    return 3 * x\n')
    new = commit("pkg/b.py", "X = 1\n")
    data = commit("pkg/c.json", "{}\n")
    assert report._same_code(words, ("pkg",))
    assert not report._same_code(code, ("pkg",))
    assert not report._same_code(new, ("pkg",))  # no parent version: new code
    assert not report._same_code(data, ("pkg",))
    assert not report._same_code(words, ("elsewhere",))  # nothing under the paths: not a proof
