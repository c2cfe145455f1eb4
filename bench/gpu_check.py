"""The GPU check in one call (``make gpu-check``): predicted vs measured memory, then the CUDA tests.

Made for the lent GPU machine, which has python3 with torch, CUDA, transformers and pytest but no
package registry: the repo is imported from its folder, and what the server needs beyond the image
(fastapi, uvicorn, openai, faiss, …) comes as wheels in ``.gpu_wheels/`` (``make gpu-wheels`` here,
``carry=[".gpu_wheels"]`` in the call), installed into ``--site`` (``/tmp/gpu_site``) with pip or,
without pip, by unzipping. Three parts, each bounded so the whole check ends in under 5 minutes:

1. ``bench/gpu_validate.py`` (three real-size architectures, random weights, bf16): each memory
   component — weights, activations, KV cache, total, reserved — graded against its tolerance;
2. ``pytest -m gpu`` (the CUDA-only tests, e.g. the offloaded cache's two layers in flight);
3. ``bench/gpu_load.py`` (issue #14): the real ``ragbudget serve`` stack on CUDA under bursts of
   64 and 256 clients, in what is left of :data:`TOTAL_BUDGET_S` (at most
   :data:`gpu_load.TIME_BUDGET_S`); skipped, with the reason recorded, when the wheels are absent
   or too little time is left.

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

import gpu_load  # noqa: E402  (bench/ siblings, after the path is set)
import gpu_validate  # noqa: E402
import gpu_wheels  # noqa: E402

PYTEST_TIMEOUT_S = 120
#: The whole check's promise is 5 minutes; the load part gets what the first two left of this.
TOTAL_BUDGET_S = 285.0
#: Below this, the load part is skipped (starting the server and one burst need about a minute).
MIN_LOAD_BUDGET_S = 60.0
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


def run_load(
    *, device: str, budget: float, wheels: Path, site: Path, out: Path, max_workers: int | None = None
) -> dict:
    """``bench/gpu_load.py`` in a child process, with the carried wheels on its ``PYTHONPATH``;
    its raw result (``{"skipped": why}`` when it could not run)."""
    if budget < MIN_LOAD_BUDGET_S:
        return {"device": device, "skipped": f"time budget: {budget:.0f} s left of the check's {TOTAL_BUDGET_S:.0f} s"}
    env = dict(os.environ)
    installed = None
    if any(wheels.glob("*.whl")):
        t0 = time.time()
        how = gpu_wheels.install(wheels, site)
        installed = {"wheels": str(wheels), "site": str(site), "how": how, "seconds": round(time.time() - t0, 1)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(ROOT), env.get("PYTHONPATH")]))
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_load.py"), "--device", device, "--budget", str(int(budget))]
    if max_workers:
        cmd += ["--max-workers", str(max_workers)]
    killed = False
    try:
        # Its own bound is the budget; a minute more for the server's shutdown, then it is killed.
        proc = subprocess.run(
            [*cmd, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget + 60
        )
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        killed, tail = True, f"killed after {budget + 60:.0f} s"
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = {"device": device, "failed": f"bench/gpu_load.py wrote no result ({tail[-500:]})", "bursts": []}
    if killed and "passed" not in result:  # the bursts it saved so far are kept
        result["failed"] = f"bench/gpu_load.py {tail}"
    result["installed"] = installed
    result["tail"] = tail
    return result


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
        "",
        gpu_load.table(report["load"]) if report.get("load") else "load check: not run",
        f"verdict: {'PASS' if report['passed'] else 'FAIL'}",
    ]
    lines += [f"- {p}" for p in report["problems"]]
    lines += [f"- note: {n}" for n in report.get("notes", [])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="two context lengths per model")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    ap.add_argument("--wheels", type=Path, default=gpu_wheels.DEST, help="the carried wheels (make gpu-wheels)")
    ap.add_argument("--site", type=Path, default=Path("/tmp/gpu_site"), help="where the wheels are installed")
    ap.add_argument("--no-load", action="store_true", help="skip the load part (issue #14)")
    ap.add_argument(
        "--load-max-workers", type=int, default=None, help="the served stack's worker threads (default: serve's 64)"
    )
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
    notes: list[str] = []
    load = None
    if not args.no_load:
        load = run_load(
            device=args.device,
            budget=min(gpu_load.TIME_BUDGET_S, TOTAL_BUDGET_S - (time.time() - t0)),
            wheels=args.wheels,
            site=args.site,
            out=args.out / "gpu_load.json",
            max_workers=args.load_max_workers,
        )
        _, load_problems, notes = gpu_load.verdict(load)
        problems += [f"load: {p}" for p in load_problems]
    report = {
        "command": "make gpu-check" if args.device == "cuda" else " ".join(["python3", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": platform.node(),
        "python": platform.python_version(),
        "seconds": round(time.time() - t0, 1),
        "passed": not problems,
        "problems": problems,
        "notes": notes,
        "validate": validate,
        "gpu_tests": tests,
        "load": load,
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
