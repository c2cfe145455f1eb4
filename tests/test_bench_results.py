"""bench/_results.py: a raw result names the commit its run began on. A long benchmark outlives
commits made beside it; the figures are the code's it started on, and `bench/report.py --stale`
decides from that commit whether a figure is older than the code it measures."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from _bench import load_bench

REPO = Path(__file__).resolve().parents[1]


results = load_bench("_results.py", "bench_results")


def _commit(repo: Path, name: str, when: int) -> str:
    (repo / "ragbudget").mkdir(exist_ok=True)
    (repo / "ragbudget" / name).write_text(name)
    env = {
        **os.environ,
        "GIT_AUTHOR_DATE": f"@{when} +0000",
        "GIT_COMMITTER_DATE": f"@{when} +0000",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
    }
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "commit", "-q", "-m", name], check=True, env=env)
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.setattr(results, "REPO", tmp_path)
    return tmp_path


def test_a_run_names_the_commit_it_began_on_and_the_one_it_ended_on(repo: Path) -> None:
    first = _commit(repo, "a.py", 1_700_000_000)
    second = _commit(repo, "b.py", 1_700_000_600)  # made while the run went on
    assert results.commits(started=1_700_000_300) == (first, second)
    assert results.commits(started=1_700_000_900) == (second, second)


def test_uncommitted_library_changes_mark_both(repo: Path) -> None:
    first = _commit(repo, "a.py", 1_700_000_000)
    (repo / "ragbudget" / "a.py").write_text("changed")
    assert results.commits(started=1_700_000_300) == (first + "+dirty", first + "+dirty")


def test_provenance_records_the_end_commit_only_when_it_moved(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _commit(repo, "a.py", 1_700_000_000)
    monkeypatch.setattr(results, "process_started", lambda: 1_700_000_300.0)
    versions = results.provenance()["versions"]
    assert versions["ragbudget_commit"] == first and "ragbudget_commit_at_end" not in versions
    second = _commit(repo, "b.py", 1_700_000_600)
    versions = results.provenance()["versions"]
    assert (versions["ragbudget_commit"], versions["ragbudget_commit_at_end"]) == (first, second)
