"""Predicted vs measured peak GPU memory during ``generate`` (random weights, bf16, CUDA).

For each architecture (built at its real size from ragbudget's shipped configs, random weights)
and each context length, it runs ``model.generate`` on ``cuda:0`` and compares
``torch.cuda.max_memory_allocated`` with ragbudget's prediction:

    predicted = weights (parameter count × bf16) + activations (prefill estimate)
                + KV peak (exact per layer type)

It also checks that the cache tensors after ``generate`` hold exactly ``kv_cache_bytes`` bytes.
Target: |error| ≤ 5% of the measured peak. Prints one table; writes bench/out/gpu_validate.json.

    .venv/bin/python bench/gpu_validate.py            # needs CUDA; exits 0 with a message otherwise
    .venv/bin/python bench/gpu_validate.py --dry-run  # predictions only (no torch model, any machine)
    .venv/bin/python bench/gpu_validate.py --quick    # 2 context lengths

Runs in well under 5 minutes on one datacenter GPU (three ~1-2.6B models, four lengths).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Keep measurements out of the user's calibration file (predictions must be the raw estimate).
os.environ["RAGBUDGET_CACHE"] = tempfile.mkdtemp(prefix="ragbudget-gpu-validate-")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragbudget.budget import estimate_activation_bytes, estimate_weights_bytes
from ragbudget.kvcache import kv_cache_bytes
from ragbudget.models import load_model_config

MiB = 1 << 20
NEW_TOKENS = 16


def architectures() -> dict[str, dict]:
    """Realistic sizes from the shipped configs (Gemma-2-2B from the 9B snapshot + 2B shape)."""
    gemma2 = load_model_config("google/gemma-2-9b-it") | {
        "_name_or_path": "gemma-2-2b-like", "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "tie_word_embeddings": True,
    }
    return {
        "Llama-3.2-1B": load_model_config("meta-llama/Llama-3.2-1B-Instruct"),
        "Qwen3-0.6B": load_model_config("Qwen/Qwen3-0.6B"),
        "Gemma-2-2B-like": gemma2,
    }


def attn_impl(cfg: dict) -> str:
    # Gemma 2's logit soft-capping is not supported by SDPA kernels: transformers runs it eager.
    return "eager" if cfg.get("model_type") == "gemma2" else "sdpa"


def predict(cfg: dict, ctx: int) -> dict[str, int]:
    tokens = ctx + NEW_TOKENS - 1
    weights = estimate_weights_bytes(cfg, weight_dtype="bfloat16")
    act = estimate_activation_bytes(cfg, ctx, dtype="bfloat16", attn_implementation=attn_impl(cfg))
    kv_peak = kv_cache_bytes(cfg, tokens, kv_dtype="bfloat16", peak=True, prefill_tokens=ctx)
    kv_steady = kv_cache_bytes(cfg, tokens, kv_dtype="bfloat16")
    return {"weights": weights, "activations": act, "kv_peak": kv_peak, "kv_steady": kv_steady,
            "predicted": weights + act + kv_peak}


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None:
                total += t.nbytes
    return total


def measure(cfg: dict, contexts: list[int]) -> list[dict]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(cfg)
    mt = d.pop("model_type")
    for k in ("architectures", "_name_or_path", "quantization_config"):
        d.pop(k, None)
    conf = AutoConfig.for_model(mt, **d)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16,
                                                 attn_implementation=attn_impl(cfg)).eval()
    rows = []
    for ctx in contexts:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(10, conf.vocab_size - 10, (1, ctx), device="cuda")
        base = torch.cuda.memory_allocated()  # weights + buffers + the input ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, return_dict_in_generate=True, pad_token_id=0)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        rows.append({"ctx": ctx, "measured_peak": peak, "measured_weights": base,
                     "measured_kv": cache_bytes(out.past_key_values)})
        del out, ids
    del model
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description="predicted vs measured peak GPU memory")
    ap.add_argument("--dry-run", action="store_true", help="print predictions only")
    ap.add_argument("--quick", action="store_true", help="two context lengths")
    args = ap.parse_args()
    contexts = [512, 8192] if args.quick else [512, 2048, 8192, 16384]
    archs = architectures()
    if not args.dry_run:
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        if not has_cuda:
            print("gpu_validate: no CUDA device; skipping (use --dry-run to print predictions)")
            return 0
    t0 = time.time()
    results = []
    hdr = (f"{'model':<16} {'ctx':>6} {'weights':>9} {'act':>8} {'kv peak':>8} {'predicted':>10} "
           f"{'measured':>10} {'error':>7} {'kv exact':>8}")
    print(hdr)
    print("-" * len(hdr))
    for name, cfg in archs.items():
        preds = {ctx: predict(cfg, ctx) for ctx in contexts}
        meas = {} if args.dry_run else {r["ctx"]: r for r in measure(cfg, contexts)}
        for ctx in contexts:
            p = preds[ctx]
            m = meas.get(ctx)
            row = {"model": name, "ctx": ctx, **p}
            line = (f"{name:<16} {ctx:>6} {p['weights'] / MiB:>8.0f}M {p['activations'] / MiB:>7.0f}M "
                    f"{p['kv_peak'] / MiB:>7.0f}M {p['predicted'] / MiB:>9.0f}M")
            if m is not None:
                err = (p["predicted"] - m["measured_peak"]) / m["measured_peak"]
                exact = m["measured_kv"] == p["kv_steady"]
                row |= m | {"error": err, "kv_exact": exact}
                line += f" {m['measured_peak'] / MiB:>9.0f}M {err:>+7.1%} {'yes' if exact else 'NO':>8}"
            else:
                line += f" {'—':>10} {'—':>7} {'—':>8}"
            print(line)
            results.append(row)
    errs = [abs(r["error"]) for r in results if "error" in r]
    if errs:
        print(f"\nmax |error| {max(errs):.1%} (target ≤ 5%); "
              f"kv exact in {sum(r['kv_exact'] for r in results)}/{len(results)}")
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / "gpu_validate.json").write_text(json.dumps(
        {"dry_run": args.dry_run, "new_tokens": NEW_TOKENS, "rows": results}, indent=1))
    print(f"({time.time() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
