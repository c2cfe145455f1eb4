"""The GPU check in one call (``make gpu-check``): predicted vs measured memory, then the CUDA tests.

Made for the lent GPU machine, which has python3 with torch, CUDA, transformers and pytest but no
package registry: nothing is installed, the repo is imported from its folder. Two parts, each
bounded so the whole check ends in under 5 minutes:

1. ``bench/gpu_validate.py`` (three real-size architectures, random weights, bf16): each memory
   component — weights, activations, KV cache, total, reserved — graded against its tolerance;
2. ``pytest -m gpu`` (the CUDA-only tests, e.g. the offloaded cache's two layers in flight).

Writes one JSON (``gpu_check.json``) and one table (``gpu_check.md``) to ``--out`` (default
``bench/out``; also to ``$OUT`` when that is set, as on the device machine) and exits 1 when any
component misses its tolerance, anything OOMs or fails, or no CUDA device is there (``--device
cpu`` runs the same path on tiny models without CUDA, for checking the script itself).

    python3 bench/gpu_check.py            # on the GPU machine; make gpu-check
    python3 bench/gpu_check.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_validate  # noqa: E402  (bench/ sibling, after the path is set)

PYTEST_TIMEOUT_S = 120
MiB = 1 << 20


def has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def run_gpu_tests(timeout: float) -> dict:
    """``pytest -m gpu`` in a child process: its counts, its tail, and whether it passed."""
    # Only the files that hold CUDA tests: collecting the others would import what the GPU
    # machine lacks (faiss, fastapi, the packaged models).
    files = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").glob("test_*.py")
        if "mark.gpu" in p.read_text(encoding="utf-8")
    )
    if not files:
        return {
            "passed": False,
            "returncode": None,
            "seconds": 0.0,
            "summary": "no test file carries the gpu marker",
            "tail": "",
        }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=--strict-markers -ra",
        *files,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {
            "passed": False,
            "returncode": None,
            "seconds": timeout,
            "summary": f"timed out after {timeout:.0f} s",
            "tail": out[-4000:],
        }
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else ""
    # pytest exits 5 when every test was deselected/none collected: no CUDA test ran.
    passed = proc.returncode == 0
    return {
        "passed": passed,
        "returncode": proc.returncode,
        "seconds": round(time.time() - t0, 1),
        "summary": summary,
        "tail": (proc.stdout + proc.stderr)[-4000:],
    }


def table(report: dict) -> str:
    """The Markdown table of the check: one row per case and component, then the verdicts."""
    rows = [
        "| model | ctx | component | predicted MiB | measured MiB | error | ok |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for r in report["validate"]["rows"]:
        comps = r.get("components") or {}
        if not comps:
            why = r.get("failed") or r.get("skipped") or "not measured"
            rows.append(f"| {r['model']} | {r['ctx']} | — | — | — | — | {why} |")
        for name, c in comps.items():
            rows.append(
                f"| {r['model']} | {r['ctx']} | {name} | {c['predicted'] / MiB:,.1f} | "
                f"{c['measured'] / MiB:,.1f} | {c['error']:+.1%} | "
                f"{'yes' if c['ok'] else '**NO**'} |"
            )
    tests = report["gpu_tests"]
    lines = [
        "\n".join(rows),
        "",
        f"gpu tests: {tests['summary'] or 'no output'} ({'passed' if tests['passed'] else 'FAILED'})",
        f"verdict: {'PASS' if report['passed'] else 'FAIL'}",
    ]
    lines += [f"- {p}" for p in report["problems"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="two context lengths per model")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not has_cuda():
        print(
            "gpu-check: no CUDA device here (torch.cuda.is_available() is False); run it on the "
            "GPU machine, or pass --device cpu to check the script on tiny models",
            file=sys.stderr,
        )
        return 2
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = gpu_validate.run(device=args.device, quick=args.quick, dry_run=False, out=args.out / "gpu_validate.json")
    passed_v, problems = gpu_validate.verdict(rows, device=args.device, dry_run=False)
    validate = json.loads((args.out / "gpu_validate.json").read_text())
    tests = run_gpu_tests(PYTEST_TIMEOUT_S)
    print(tests["tail"][-1500:])
    if args.device == "cuda" and not tests["passed"]:
        problems.append(f"gpu tests: {tests['summary'] or 'failed'}")
    report = {
        "command": "make gpu-check" if args.device == "cuda" else " ".join(["python3", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": platform.node(),
        "python": platform.python_version(),
        "seconds": round(time.time() - t0, 1),
        "passed": not problems,
        "problems": problems,
        "validate": validate,
        "gpu_tests": tests,
    }
    text = table(report)
    targets = [args.out] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for folder in targets:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "gpu_check.json").write_text(json.dumps(report, indent=1))
        (folder / "gpu_check.md").write_text(text)
    print()
    print(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
