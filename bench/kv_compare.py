"""KV bytes per token and max context on a 24 GiB GPU: ragbudget next to peer estimators.

Peers, re-implemented from their source (computed here from ragbudget's shipped configs, so
every tool sees the same config.json):

* hf-mem (alvarobartt/hf-mem, src/hf_mem/safetensors/kv_cache.py,
  ``compute_safetensors_kv_cache_size``): ``2 × n_full_layers × num_key_value_heads × head_dim ×
  max_model_len × dtype_bytes``; sliding layers are dropped entirely (``sliding_window_pattern``
  → ``L // pattern`` full layers; ``layer_types`` → count of full ones); the KV dtype follows
  ``quantization_config`` (fp8 → 1 byte) and other quant methods are rejected (``n/a``).
  ``head_dim`` falls back to ``hidden/heads``; no MLA handling.
* gpu_poor (RahulSChand/gpu_poor, src/App.js, inference branch of ``getAllComputedData``):
  KV MB = ``2 × ctx × 2 × 2 × hidden × layers / 2**20`` (no GQA, an extra ×2); weights =
  ``(V·H·2 + L·4·H² + L·3·I·H) × 2`` bytes; activations = ``ctx·H·5·2 + ctx²·heads·2``; 650 MB
  overhead.
* accelerate estimate-memory (huggingface/accelerate, ``calculate_maximum_sizes`` on a model built
  with ``init_empty_weights``): weights only, no KV — reported as weights.

Run: ``.venv/bin/python bench/kv_compare.py [--quick]``; writes bench/out/kv_compare.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragbudget.errors import BudgetError
from ragbudget.gpus import GiB
from ragbudget.memory.budget import plan_budget
from ragbudget.memory.kvcache import kv_bytes_per_token, text_config
from ragbudget.memory.models import load_model_config

MODELS = [
    "meta-llama/Llama-3.2-3B-Instruct",
    "meta-llama/Llama-3.1-8B-Instruct",
    "Qwen/Qwen3-8B",
    "mistralai/Mistral-7B-Instruct-v0.3",
    "microsoft/Phi-3-mini-4k-instruct",
    "google/gemma-2-9b-it",
    "google/gemma-3-12b-it",
    "openai/gpt-oss-20b",
    "deepseek-ai/DeepSeek-V3",
]
GPU = 24 * GiB
MiB = 1 << 20


# ---- hf-mem (faithful re-implementation) -----------------------------------------------------
def hfmem_kv_per_token(cfg: dict) -> int | None:
    c = text_config(cfg)
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method"):
        if qc["quant_method"] in ("fp8", "modelopt"):
            dtype_bytes = 1
        elif qc["quant_method"] == "compressed-tensors":
            dtype_bytes = 2
        else:
            return None  # hf-mem raises: unsupported quant_method without --kv-cache-dtype
    else:
        dtype_bytes = 4 if str(cfg.get("torch_dtype", c.get("torch_dtype"))) == "float32" else 2
    n = c["num_hidden_layers"]
    if "sliding_window_pattern" in c:
        n_full = n // c["sliding_window_pattern"]
    elif "layer_types" in c:
        n_full = sum(1 for t in c["layer_types"] if t in {"attention", "full_attention", "global_attention"})
    else:
        n_full = n
    kv = c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return 2 * n_full * kv * hd * dtype_bytes


# ---- gpu_poor (faithful re-implementation, inference "HF/vLLM" branch) -------------------------
def gpupoor(cfg: dict) -> dict:
    c = text_config(cfg)
    V, H = c.get("vocab_size", 32000), c.get("hidden_size", 768)
    heads, L = c.get("num_attention_heads", 12), c.get("num_hidden_layers", 12)
    inter = c.get("intermediate_size", 4 * H)
    weights = (V * H * 2 + L * 4 * H * H + L * 3 * inter * H) * 2
    per_token = 2 * 2 * 2 * H * L  # 2 × ctx × 2 × 2 × H × L bytes

    def total(ctx: int) -> float:
        act = ctx * H * 5 * 2 + ctx * ctx * heads * 2
        return weights + per_token * ctx + act + 650 * MiB

    if total(1) > GPU:
        return {"kv_per_token": per_token, "weights": weights, "max_ctx": 0}
    lo, hi = 1, 1 << 22
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if total(mid) <= GPU else (lo, mid - 1)
    return {"kv_per_token": per_token, "weights": weights, "max_ctx": lo}


# ---- accelerate estimate-memory (weights only) ---------------------------------------------
def accelerate_weights(cfg: dict) -> int | None:
    try:
        from accelerate import init_empty_weights
        from accelerate.utils import calculate_maximum_sizes
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    d = dict(cfg)
    mt = d.pop("model_type")
    for k in ("architectures", "_name_or_path", "quantization_config"):
        d.pop(k, None)
    conf = AutoConfig.for_model(mt, **d)
    with init_empty_weights():
        try:
            model = AutoModelForCausalLM.from_config(conf, dtype="bfloat16")
        except ValueError:  # multimodal configs: accelerate builds the full model
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_config(conf, dtype="bfloat16")
    total, _largest = calculate_maximum_sizes(model)
    return int(total)


def fmt_tokens(n: int | None) -> str:
    return "n/a" if n is None else f"{n:,}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="skip the accelerate meta-model builds")
    args = ap.parse_args()
    t0 = time.time()
    rows = []
    for m in MODELS:
        cfg = load_model_config(m)
        ours = kv_bytes_per_token(cfg)
        ours_peak = kv_bytes_per_token(cfg, include_sliding=True)
        try:
            p = plan_budget(m, gpu=GPU, max_new_tokens=256)
            ctx, limited, weights = p.max_context_tokens, p.limited_by, p.weights_bytes
        except BudgetError:
            ctx, limited = 0, "weights"
            from ragbudget.memory.budget import estimate_weights_bytes

            weights = estimate_weights_bytes(cfg)
        hm = hfmem_kv_per_token(cfg)
        # hf-mem reports KV for max_model_len; the tokens that fit = (GPU − weights) / per token.
        hm_ctx = None if hm is None else max(0, (GPU - weights) // hm)
        gp = gpupoor(cfg)
        acc = None if args.quick else accelerate_weights(cfg)
        rows.append(
            {
                "model": m,
                "ragbudget_kv_per_token": ours,
                "ragbudget_kv_per_token_below_window": ours_peak,
                "ragbudget_max_context_24GiB": ctx,
                "ragbudget_limited_by": limited,
                "ragbudget_weights": weights,
                "hfmem_kv_per_token": hm,
                "hfmem_max_context_24GiB": hm_ctx,
                "gpupoor_kv_per_token": gp["kv_per_token"],
                "gpupoor_max_context_24GiB": gp["max_ctx"],
                "gpupoor_weights": gp["weights"],
                "accelerate_weights": acc,
            }
        )
        print(f"{m}: done ({time.time() - t0:.1f}s)", file=sys.stderr)
    head = (
        "| model | ragbudget KV B/token (below window) | hf-mem B/token | gpu_poor B/token | "
        "gpu_poor ÷ ours (below window) | ragbudget max ctx @24GiB | hf-mem | gpu_poor | weights GiB: "
        "ragbudget / gpu_poor / accelerate |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        ours = r["ragbudget_kv_per_token"]
        below = r["ragbudget_kv_per_token_below_window"]
        hm = r["hfmem_kv_per_token"]
        acc = r["accelerate_weights"]
        lines.append(
            f"| {r['model']} | {ours:,}"
            + (f" ({below:,})" if below != ours else "")
            + f" | {'n/a' if hm is None else f'{hm:,}'} | {r['gpupoor_kv_per_token']:,} | "
            f"{r['gpupoor_kv_per_token'] / below:.1f}× | {fmt_tokens(r['ragbudget_max_context_24GiB'])}"
            f" ({r['ragbudget_limited_by']}) | {fmt_tokens(r['hfmem_max_context_24GiB'])} | "
            f"{fmt_tokens(r['gpupoor_max_context_24GiB'])} | {r['ragbudget_weights'] / GiB:.2f} / "
            f"{r['gpupoor_weights'] / GiB:.2f} / {'—' if acc is None else f'{acc / GiB:.2f}'} |"
        )
    table = "\n".join(lines)
    print(table)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import write

    write(
        "kv_compare",
        {"gpu_bytes": GPU, "rows": rows, "table": table, "seconds": round(time.time() - t0, 1)},
        packages=("hf-mem",),
    )


if __name__ == "__main__":
    main()
