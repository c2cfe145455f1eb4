"""The test tiers: markers given by fixture and alias, and the guard that fails a test which starts
a server or a model without its marker (tests/_needs.py), run on a small suite in a child pytest;
``make test-fast`` selects by the same markers and runs no lint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _needs import FAST, NEEDS

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

CONFTEST = """\
import pytest
from _needs import (
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_call,
    pytest_runtest_protocol,
)


@pytest.fixture(scope="session")
def ray_cluster():
    return "a stand-in: only its name matters"
"""

SUITE = """\
import threading

import pytest


def serve():
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app=None))  # built, never run: the guard sees __init__


def open_onnx():
    import onnxruntime

    with pytest.raises(Exception):  # noqa: B017 - not a model: the runtime refuses it
        onnxruntime.InferenceSession(b"not a model")


def test_pure():
    assert 1 + 1 == 2


def test_unmarked_server():
    serve()


@pytest.mark.server
def test_marked_server():
    serve()


def test_unmarked_server_in_a_thread():
    errors = []

    def run():
        try:
            serve()
        except BaseException as exc:  # as a worker thread of the code under test would
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert errors == []  # the guard does not raise in another thread: the test fails at its end


def test_unmarked_onnx():
    open_onnx()


@pytest.mark.slow
def test_slow_is_the_old_name_of_model():
    open_onnx()


def test_uses_the_ray_fixture(ray_cluster):
    assert ray_cluster


def test_unmarked_serve_in_a_child_process():
    import subprocess
    import sys

    # Failed before the child starts: nothing to clean up.
    subprocess.Popen([sys.executable, "-m", "ragbudget", "-v", "serve", "--port", "0"])
"""


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = --strict-markers -p no:cacheprovider -p no:xdist\nmarkers =\n"
        + "".join(f"    {m}: m\n" for m in (*NEEDS, "slow"))
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("RAGBUDGET_NEEDS_RECORD", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _outcomes(out: str) -> dict[str, str]:
    """``{test name: PASSED/FAILED}`` from ``-rA``'s short summary."""
    found = {}
    for line in out.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR") and "::" in rest:
            found[rest.split("::")[1].split(" ")[0]] = word
    return found


def test_an_unmarked_server_or_model_fails_with_the_marker_to_add(tmp_path: Path) -> None:
    run = _pytest(tmp_path)
    assert _outcomes(run.stdout) == {
        "test_pure": "PASSED",
        "test_unmarked_server": "FAILED",
        "test_marked_server": "PASSED",
        "test_unmarked_server_in_a_thread": "FAILED",
        "test_unmarked_onnx": "FAILED",
        "test_slow_is_the_old_name_of_model": "PASSED",
        "test_uses_the_ray_fixture": "PASSED",
        "test_unmarked_serve_in_a_child_process": "FAILED",
    }, run.stdout
    for name, marker, what in (
        ("test_unmarked_server", "server", "starts a uvicorn server"),
        ("test_unmarked_server_in_a_thread", "server", "starts a uvicorn server"),
        ("test_unmarked_onnx", "model", "opens an ONNX Runtime model"),
        ("test_unmarked_serve_in_a_child_process", "server", "starts `ragbudget serve` in a child process"),
    ):
        said = f"test_suite.py::{name} {what} but is not marked {marker!r}: add @pytest.mark.{marker}"
        assert said in run.stdout, run.stdout
    assert "Traceback" not in run.stdout  # one line that says what to add


def test_the_fast_tier_leaves_out_every_need_given_by_marker_fixture_or_alias(tmp_path: Path) -> None:
    assert FAST == "not (server or ray or model or engine or gpu or postgres)"
    run = _pytest(tmp_path, "-m", FAST, "--collect-only", "-q")
    selected = {line.split("::")[1] for line in run.stdout.splitlines() if "::" in line}
    assert selected == {
        "test_pure",
        "test_unmarked_server",
        "test_unmarked_server_in_a_thread",
        "test_unmarked_onnx",
        "test_unmarked_serve_in_a_child_process",
    }, run.stdout


def test_make_test_fast_selects_the_fast_tier_without_lint_and_make_test_runs_everything_in_parallel() -> None:
    def commands(target: str) -> str:
        # -n: print, run nothing; the venv's stamps made up to date so only the target's own
        # recipe is printed, whatever this checkout has installed.
        # Not the variables of a make this test may run under (`make test VENV=...`): its
        # command-line variables reach us in MAKEFLAGS and the environment.
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
        made = subprocess.run(
            ["make", "-n", "--no-print-directory", "-o", ".venv/.dev", "-o", ".venv/.installed", "-o", "lint"]
            + ["VENV=.venv", "PYTEST_WORKERS=auto", target],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, made.stderr
        return made.stdout

    fast = commands("test-fast")
    assert f'pytest -q -n auto -m "{FAST}"' in fast and "ruff" not in fast and "mypy" not in fast
    assert "build-llama-server" not in fast
    full = commands("test")
    assert full.rstrip().endswith("python -m pytest -q -n auto --dist loadgroup")  # no -m: everything
    rules = dict(line.split(":", 1) for line in (REPO / "Makefile").read_text().splitlines() if line.startswith("test"))
    assert "lint" in rules["test"].split() and "lint" not in rules["test-fast"].split()
