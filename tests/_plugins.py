"""A plugin package for a test: its files written, built and pip-installed (``--target``) into a
folder of the test's own, so the shared environment never sees it; child processes that put that
folder on their ``PYTHONPATH`` do. Used by the engine, storage and vector-store plugin tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def install_plugin(src: Path, target: Path, files: dict[str, str]) -> Path:
    """Write ``files`` (relative path → text) into ``src``, install it into ``target``; ``target``."""
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(target), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise AssertionError(f"pip could not install the plugin: {done.stdout[-1000:]}{done.stderr[-2000:]}")
    return target


def plugin_env(site: Path, **extra: str) -> dict[str, str]:
    """The environment of a child process that sees the plugin installed in ``site`` (and the
    repository and its tests)."""
    path = [str(site), str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}
