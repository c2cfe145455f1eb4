"""Where a benchmark's raw result goes, and what it records about the run that made it.

Every figure in README.md and BENCHMARKS.md points at a committed ``bench/results/<name>.json``;
:func:`write` stamps it with the command, the machine, the package versions and the commit of the
library that produced it, so a figure can be traced to one run::

    from _results import write
    write("dedup", {"quality": ..., "scale": ...}, packages=("datasketch",))
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
#: Always recorded: what every benchmark's figures depend on.
BASE_PACKAGES = ("torch", "transformers", "sentence-transformers", "faiss-cpu", "numpy", "tiktoken")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


#: Instruction sets that change a CPU figure several-fold (int8 inference above all): machines
#: differ between runs, so a result says which the one that measured it had.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8")


def cpu(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU's model name and which of :data:`ISA_FLAGS` it has (Linux; empty elsewhere)."""
    model, flags = "", set()
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        return {}
    return {"cpu_model": model, "isa": [f for f in ISA_FLAGS if f in flags]}


def process_started() -> float:
    """When this process began (Unix time): its /proc entry's time, else now."""
    try:
        return os.stat(f"/proc/{os.getpid()}").st_ctime
    except OSError:
        return time.time()


def commits(started: float | None = None) -> tuple[str, str]:
    """The library's commit when the run began and now, ``+dirty`` when ragbudget/ has
    uncommitted changes now. A long run outlives commits made beside it: its figures are the
    code's it started on (the last commit of HEAD's history made before the process began), not
    the code's when the result is written."""
    dirty = "+dirty" if _git("status", "--porcelain", "ragbudget") else ""
    now = _git("rev-parse", "--short", "HEAD")
    before = _git("rev-list", "-1", "--abbrev-commit", f"--before={int(started or process_started())}", "HEAD") or now
    return before + dirty, now + dirty


def provenance(packages: tuple[str, ...] = ()) -> dict[str, Any]:
    """Command, date, machine, versions and the library's commit when the run began (``+dirty``
    when ragbudget/ had uncommitted changes, so a figure from unreleased code is marked as such;
    ``ragbudget_commit_at_end`` too when the tree changed during the run)."""
    at_start, at_end = commits()
    try:
        load = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        load = None
    return {
        "command": "python " + shlex.join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            **cpu(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_1m_at_end": load,
        },
        "versions": {
            "ragbudget_commit": at_start,
            **({"ragbudget_commit_at_end": at_end} if at_end != at_start else {}),
            **{p: _version(p) for p in (*BASE_PACKAGES, *packages)},
        },
    }


def write(name: str, data: dict[str, Any], *, packages: tuple[str, ...] = (), folder: Path | None = None) -> Path:
    """Write ``data`` with its :func:`provenance` to ``bench/results/<name>.json``; returns the path."""
    folder = folder or RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps({**provenance(packages), **data}, indent=1, ensure_ascii=False, default=str) + "\n")
    print(f"raw result written to {os.path.relpath(path)}")
    return path
