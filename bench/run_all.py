"""Run every benchmark in this folder, one after the other, and list where their JSON went.

    python bench/run_all.py            # full runs (tens of minutes on 2 cores)
    python bench/run_all.py --quick    # short runs of each

Each script prints its own table with ratios against the peer libraries measured in the same run
and writes its raw result to ``bench/results/<name>.json`` (``--quick`` runs of qa.py and index.py
go to the ignored ``bench/out/`` instead); BENCHMARKS.md records the figures with these commands.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ["clean", "chunking", "dedup", "index", "kv_compare", "qa", "load", "gpu_validate"]


def main(argv: list[str]) -> int:
    failed = []
    for name in ORDER:
        script = HERE / f"{name}.py"
        if not script.exists():
            continue
        print(f"\n=== bench/{name}.py {' '.join(argv)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, str(script), *argv])
        print(f"=== bench/{name}.py exited {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    print("\nresults: bench/results/*.json" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
