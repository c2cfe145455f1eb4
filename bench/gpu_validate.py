"""Predicted vs measured peak GPU memory during ``generate`` (random weights, bf16, CUDA).

For each architecture (built at its real size from ragbudget's shipped configs, random weights:
memory does not depend on the values) and each context length, it runs ``model.generate`` on
``cuda:0`` and compares ``torch.cuda.max_memory_allocated`` with ragbudget's prediction:

    predicted = weights (parameter count × bf16) + activations (prefill estimate)
                + KV peak (exact per layer type)

It also checks that the cache tensors after ``generate`` hold exactly ``kv_cache_bytes`` bytes.
A 5% error on a weight-dominated total can hide a 100% activation error, so each component is
graded on its own (:data:`TOLERANCES`, :func:`verdict`):

    weights      measured: allocated after the model is built, before the prompt, less cuBLAS's
                 workspace (allocated by a warm-up product before the first model, measured
                 then, and counted with the activations, as the estimate counts it)
    kv           measured: bytes of the cache tensors after ``generate`` — must be exact
    activations  measured: peak allocated − measured weights − predicted KV peak (the KV peak
                 itself is not observable; its steady part is checked exactly above and its
                 prefill peak to the byte by tests/test_kvcache.py)
    total        predicted vs ``max_memory_allocated``
    reserved     ``max_memory_reserved`` (what really runs out) must stay inside the
                 predicted total ÷ 0.9, the utilization headroom the plan keeps (as vLLM); the
                 allocator is set up as ragbudget's generator sets it (expandable segments,
                 :func:`ragbudget.gpus.prefer_expandable_segments`)

Prints one table (a failed case prints its error in its row and the run goes on); writes
bench/out/gpu_validate.json; exits 1 when any component misses its tolerance, any case fails
or OOMs, or a CUDA run measured nothing.

    .venv/bin/python bench/gpu_validate.py            # needs CUDA; exits 0 with a message otherwise
    .venv/bin/python bench/gpu_validate.py --quick    # 2 context lengths
    .venv/bin/python bench/gpu_validate.py --dry-run  # predictions only (no torch model, any machine)
    .venv/bin/python bench/gpu_validate.py --device cpu --quick
        # the whole measuring path on tiny versions of the same architectures, on the CPU
        # (cache bytes checked exactly; no peak: CPU memory has no allocator statistics)

About a minute on one H200 (three 0.6-2.6B models, four lengths up to 16k); a time guard skips
the remaining cases past 4 minutes so the run always ends under 5.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragbudget.gpus import prefer_expandable_segments
from ragbudget.memory.budget import estimate_activation_bytes, estimate_weights_bytes
from ragbudget.memory.kvcache import kv_cache_bytes
from ragbudget.memory.models import load_model_config

MiB = 1 << 20
NEW_TOKENS = 16
UTILIZATION = 0.9  # the plan's default share of the device (budget.plan_budget)
#: |predicted − measured| / measured allowed per component. Activations get an absolute floor
#: too: at short contexts they are a few MiB, where the allocator's 2 MiB blocks alone exceed 25%.
TOLERANCES = {"weights": 0.02, "activations": 0.25, "total": 0.05}
ACTIVATION_SLACK = 16 * MiB
TIME_BUDGET_S = 240.0  # leave a margin under the 5-minute promise
CONTEXTS = {"full": [512, 2048, 8192, 16384], "quick": [512, 8192]}
CPU_CONTEXTS = {"full": [24, 48, 96], "quick": [24, 48]}  # cross the tiny sliding window (16)


def architectures() -> dict[str, dict]:
    """Realistic sizes from the shipped configs (Gemma-2-2B from the 9B snapshot + 2B shape)."""
    gemma2 = load_model_config("google/gemma-2-9b-it") | {
        "_name_or_path": "gemma-2-2b-like",
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "tie_word_embeddings": True,
        # Gemma-2 stops at 8192 positions; the 16k case measures memory, not quality.
        "max_position_embeddings": 32768,
    }
    return {
        "Llama-3.2-1B": load_model_config("meta-llama/Llama-3.2-1B-Instruct"),
        "Qwen3-0.6B": load_model_config("Qwen/Qwen3-0.6B"),
        "Gemma-2-2B-like": gemma2,
    }


def tiny(cfg: dict) -> dict:
    """The same architecture at toy size, for the CPU run (same layer types, window crossed)."""
    small = {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "vocab_size": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    if cfg.get("sliding_window") is not None:
        small["sliding_window"] = 16
    return cfg | small


def attn_impl(cfg: dict) -> str:
    # Gemma 2's logit soft-capping is not supported by SDPA kernels: transformers runs it eager.
    return "eager" if cfg.get("model_type") == "gemma2" else "sdpa"


def predict(cfg: dict, ctx: int, dtype: str) -> dict[str, int]:
    tokens = ctx + NEW_TOKENS - 1  # the last generated token is never fed back
    weights = estimate_weights_bytes(cfg, weight_dtype=dtype)
    act = estimate_activation_bytes(cfg, ctx, dtype=dtype, attn_implementation=attn_impl(cfg))
    kv_peak = kv_cache_bytes(cfg, tokens, kv_dtype=dtype, peak=True, prefill_tokens=ctx)
    kv_steady = kv_cache_bytes(cfg, tokens, kv_dtype=dtype)
    return {
        "weights": weights,
        "activations": act,
        "kv_peak": kv_peak,
        "kv_steady": kv_steady,
        "predicted": weights + act + kv_peak,
    }


def cache_bytes(cache) -> int:
    """Bytes of every tensor the cache holds: K/V, and conv/recurrent states if any."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None:
                total += t.nbytes
        for states in ("conv_states", "recurrent_states"):
            for t in (getattr(layer, states, None) or {}).values():
                if t is not None:
                    total += t.nbytes
    return total


def _cache_of(out):
    # transformers 5.x names it `cache` (`past_key_values` is a deprecated alias).
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"


def build(cfg: dict, device: str, dtype: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(cfg)
    mt = d.pop("model_type")
    for k in ("architectures", "_name_or_path", "quantization_config", "torch_dtype", "dtype"):
        d.pop(k, None)
    conf = AutoConfig.for_model(mt, **d)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(conf, dtype=getattr(torch, dtype), attn_implementation=attn_impl(cfg))
    return conf, model.eval()


def workspace_bytes(device: str) -> int:
    """Bytes the first matrix products leave allocated: cuBLAS's workspace (and cuBLASLt's, for
    the bias epilogue), which PyTorch keeps for the process. Measured before any model exists,
    so that no model's weights are charged for it (0 off CUDA)."""
    if device != "cuda":
        return 0
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    a = torch.ones(256, 256, device=device, dtype=torch.bfloat16)
    b = torch.nn.functional.linear(a @ a, a, a[0])
    torch.cuda.synchronize()
    del a, b
    return int(torch.cuda.memory_allocated() - before)


def measure_one(model, conf, ctx: int, device: str, workspace: int = 0) -> dict:
    """One ``generate`` of ``NEW_TOKENS`` after a ``ctx``-token prompt: its peak (CUDA only) and
    the bytes its cache holds. ``workspace``: :func:`workspace_bytes`, taken out of the weights."""
    import torch

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else None  # weights + buffers
    ids = torch.randint(10, conf.vocab_size - 10, (1, ctx), device=device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    if cuda:
        torch.cuda.synchronize()
    row = {
        "measured_peak": torch.cuda.max_memory_allocated() if cuda else None,
        "measured_reserved": torch.cuda.max_memory_reserved() if cuda else None,
        "measured_weights": None if base is None else base - workspace,
        "measured_workspace": workspace if cuda else None,
        "measured_kv": cache_bytes(_cache_of(out)),
    }
    del out, ids
    return row


def components(row: dict) -> dict[str, dict]:
    """Per-component ``{predicted, measured, error, ok}`` of one measured case (see the module
    docstring for what each measured figure is). ``kv`` is exact or it fails."""
    comps: dict[str, dict] = {}

    def grade(name: str, predicted: int, measured: int, slack: int = 0) -> None:
        err = (predicted - measured) / measured if measured else float("inf")
        ok = abs(err) <= TOLERANCES[name] or abs(predicted - measured) <= slack
        comps[name] = {"predicted": predicted, "measured": measured, "error": err, "ok": ok}

    if row.get("measured_kv") is not None:
        comps["kv"] = {
            "predicted": row["kv_steady"],
            "measured": row["measured_kv"],
            "error": (row["kv_steady"] - row["measured_kv"]) / max(1, row["measured_kv"]),
            "ok": row["kv_steady"] == row["measured_kv"],
        }
    if row.get("measured_peak"):
        weights = row["measured_weights"]
        grade("weights", row["weights"], weights)
        grade(
            "activations", row["activations"], max(1, row["measured_peak"] - weights - row["kv_peak"]), ACTIVATION_SLACK
        )
        grade("total", row["predicted"], row["measured_peak"])
        allowed = int(row["predicted"] / UTILIZATION)
        comps["reserved"] = {
            "predicted": allowed,
            "measured": row["measured_reserved"],
            "error": (allowed - row["measured_reserved"]) / row["measured_reserved"],
            "ok": row["measured_reserved"] <= allowed,
        }
    return comps


def verdict(rows: list[dict], *, device: str, dry_run: bool) -> tuple[bool, list[str]]:
    """``(passed, reasons it did not)`` over every case: a failed/OOM case, a component past its
    tolerance, or a CUDA run in which nothing was measured (all cases skipped) fails."""
    problems = []
    for r in rows:
        where = f"{r['model']} ctx {r['ctx']}"
        if "failed" in r:
            problems.append(f"{where}: {r['failed']}")
        for name, c in r.get("components", {}).items():
            if not c["ok"]:
                problems.append(
                    f"{where}: {name} predicted {c['predicted']:,} B, measured {c['measured']:,} B ({c['error']:+.1%})"
                )
    if device == "cuda" and not dry_run and not any(r.get("components") for r in rows):
        problems.append("no case was measured")
    return not problems, problems


def run(*, device: str, quick: bool, dry_run: bool, out: Path) -> list[dict]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # Keep measurements out of the user's calibration file (predictions must be the raw estimate).
    os.environ["RAGBUDGET_CACHE"] = tempfile.mkdtemp(prefix="ragbudget-gpu-validate-")
    on_cpu = device == "cpu"
    cuda = device == "cuda" and not dry_run
    expandable = prefer_expandable_segments() if cuda else False
    workspace = workspace_bytes(device) if cuda else 0
    contexts = (CPU_CONTEXTS if on_cpu else CONTEXTS)["quick" if quick else "full"]
    dtype = "float32" if on_cpu else "bfloat16"
    archs = {name: tiny(cfg) if on_cpu else cfg for name, cfg in architectures().items()}
    t0 = time.time()
    results: list[dict] = []
    hdr = (
        f"{'model':<16} {'ctx':>6} {'weights':>9} {'act':>8} {'kv peak':>8} {'predicted':>10} "
        f"{'measured':>10} {'error':>7} {'kv exact':>8}"
    )
    if cuda:
        print(f"cuBLAS workspace {workspace / MiB:.1f} MiB (counted as activations); expandable segments: {expandable}")
    print(hdr)
    print("-" * len(hdr))
    unit, scale = ("K", 1024) if on_cpu else ("M", MiB)
    for name, cfg in archs.items():
        model = conf = None
        build_error = None
        for ctx in contexts:
            row: dict = {"model": name, "ctx": ctx, "device": device}
            line = f"{name:<16} {ctx:>6}"
            try:
                p = predict(cfg, ctx, dtype)
                row |= p
                line += (
                    f" {p['weights'] / scale:>8.0f}{unit} {p['activations'] / scale:>7.0f}"
                    f"{unit} {p['kv_peak'] / scale:>7.0f}{unit} "
                    f"{p['predicted'] / scale:>9.0f}{unit}"
                )
                if dry_run:
                    line += f" {'—':>10} {'—':>7} {'—':>8}"
                elif time.time() - t0 > TIME_BUDGET_S:
                    row["skipped"] = "time budget"
                    line += "  skipped (time budget)"
                else:
                    if model is None and build_error is None:
                        try:
                            conf, model = build(cfg, device, dtype)
                        except Exception as exc:  # noqa: BLE001 - report in the table, go on
                            build_error = f"build: {_error(exc)}"
                    if build_error is not None:
                        raise RuntimeError(build_error)
                    m = measure_one(model, conf, ctx, device, workspace)
                    exact = m["measured_kv"] == p["kv_steady"]
                    row |= m | {"kv_exact": exact}
                    row["components"] = components(row)
                    if m["measured_peak"]:
                        err = (p["predicted"] - m["measured_peak"]) / m["measured_peak"]
                        row["error"] = err
                        line += f" {m['measured_peak'] / scale:>9.0f}{unit} {err:>+7.1%}"
                    else:
                        line += f" {'n/a':>10} {'n/a':>7}"
                    line += f" {'yes' if exact else 'NO':>8}"
            except Exception as exc:  # noqa: BLE001 - one failed case must not end the run
                row["failed"] = _error(exc)
                line += f"  FAILED {row['failed']}"
                if device == "cuda":
                    import torch

                    torch.cuda.empty_cache()
            print(line, flush=True)
            results.append(row)
        del model
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()
    errs = [abs(r["error"]) for r in results if "error" in r]
    exact = [r["kv_exact"] for r in results if "kv_exact" in r]
    failed = sum("failed" in r for r in results)
    if errs or exact or failed:
        summary = []
        if errs:
            summary.append(f"max |error| {max(errs):.1%} (target ≤ 5%)")
        if exact:
            summary.append(f"kv exact in {sum(exact)}/{len(exact)}")
        if failed:
            summary.append(f"{failed} failed")
        print("\n" + "; ".join(summary))
    worst: dict[str, float] = {}
    for r in results:
        for name, c in r.get("components", {}).items():
            worst[name] = max(worst.get(name, 0.0), abs(c["error"]))
    if worst:
        print(
            "worst |error| per component: "
            + ", ".join(
                f"{name} {err:.1%}" + (f" (≤ {TOLERANCES[name]:.0%})" if name in TOLERANCES else "")
                for name, err in worst.items()
            )
        )
    passed, problems = verdict(results, device=device, dry_run=dry_run)
    for problem in problems:
        print(f"MISS {problem}")
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {"torch": _version("torch"), "transformers": _version("transformers")}
    if device == "cuda" and not dry_run:
        import torch

        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
        env["expandable_segments"] = expandable
        env["cublas_workspace_bytes"] = workspace
    out.write_text(
        json.dumps(
            {
                "device": device,
                "dry_run": dry_run,
                "quick": quick,
                "new_tokens": NEW_TOKENS,
                "tolerances": TOLERANCES,
                "utilization": UTILIZATION,
                "passed": passed,
                "problems": problems,
                "env": env,
                "rows": results,
            },
            indent=1,
        )
    )
    print(f"({time.time() - t0:.1f}s)")
    return results


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="predicted vs measured peak GPU memory")
    ap.add_argument("--dry-run", action="store_true", help="print predictions only")
    ap.add_argument("--quick", action="store_true", help="two context lengths")
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: tiny models, cache bytes only (exercises the measuring path)",
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "gpu_validate.json")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not args.dry_run:
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        if not has_cuda:
            print(
                "gpu_validate: no CUDA device; skipping (use --dry-run to print predictions, "
                "or --device cpu to exercise the measuring path on tiny models)"
            )
            return 0
    rows = run(device=args.device, quick=args.quick, dry_run=args.dry_run, out=args.out)
    passed, _ = verdict(rows, device=args.device, dry_run=args.dry_run)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
