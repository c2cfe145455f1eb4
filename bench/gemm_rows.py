"""What a decoding step's matrix products cost on this CPU when a batch holds M requests: the
shapes of Qwen2.5-Coder-0.5B's projections (the default local model) in float32, ``torch`` with 2
threads, one ``F.linear`` over M rows against M one-row calls. Explains why batched generation
on a CPU gains little below some batch size (BENCHMARKS.md, "Batched generation"): a one-row
product takes the matrix-vector path, and a product over a few rows costs several times as much.

    python bench/gemm_rows.py       # writes bench/results/gemm_rows.json
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (out, in) of Qwen2.5-Coder-0.5B's weights: attention query, the MLP's up and down, the LM head.
SHAPES = {"q_proj": (896, 896), "mlp_up": (4864, 896), "mlp_down": (896, 4864), "lm_head": (151936, 896)}
ROWS = (1, 2, 4, 8)


def _ms(fn: Any, n: int) -> float:
    fn()
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1000


def main() -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(2)
    load_before = os.getloadavg()[0]
    rows: dict[str, dict[str, Any]] = {}
    for name, (out, inp) in SHAPES.items():
        w = torch.randn(out, inp)
        n = 5 if name == "lm_head" else 50
        rows[name] = {}
        for m in ROWS:
            x = torch.randn(m, inp)
            batched = _ms(lambda x=x, w=w: F.linear(x, w), n)
            one_by_one = _ms(lambda x=x, m=m, w=w: [F.linear(x[j : j + 1], w) for j in range(m)], n)
            one = rows[name]["1"]["batched_ms"] if m > 1 else batched  # ROWS starts at one row
            rows[name][str(m)] = {
                "batched_ms": batched,
                "rows_one_by_one_ms": one_by_one,
                "batched_over_one_row": batched / one,
            }
            print(f"{name} M={m}: one product {batched:.2f} ms, {m} one-row products {one_by_one:.2f} ms", flush=True)
    from _results import write

    write(
        "gemm_rows",
        {
            "dtype": "float32",
            "torch_threads": torch.get_num_threads(),
            "blas": "mkl" if torch.backends.mkl.is_available() else "other",
            "load_1m_before": load_before,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
