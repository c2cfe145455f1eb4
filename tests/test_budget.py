"""The memory budget: weights, activations, capacity, errors, offline configs (calibration: test_calibration.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ragbudget.errors import ArgumentTypeError, BudgetError, ConfigError, ModelError
from ragbudget.memory.budget import (
    count_parameters,
    estimate_activation_bytes,
    plan_budget,
)
from ragbudget.memory.kvcache import kv_cache_bytes
from ragbudget.memory.models import list_model_configs, load_model_config

REQUIRED_KEYS = {
    "kv_bytes_per_token",
    "weights_bytes",
    "activation_bytes",
    "gpu_bytes",
    "kv_capacity_tokens",
    "max_context_tokens",
    "max_concurrency",
    "limited_by",
}


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_llama8b_on_4090_offline():
    p = plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="RTX 4090")
    assert p.kv_bytes_per_token == 131072
    assert p.weights_bytes == 8_030_261_248 * 2  # published parameter count × bf16
    assert p.limited_by == "memory"
    assert p.max_prompt_tokens == p.max_context_tokens - p.max_new_tokens
    # The plan fits, and one more token would not.
    used = p.weights_bytes + p.activation_bytes + p.kv_bytes_at_max
    assert used <= p.usable_bytes
    d = p.to_dict()
    assert set(d) >= REQUIRED_KEYS
    json.dumps(d)


def test_context_decreases_with_concurrency():
    p = plan_budget("Qwen/Qwen3-8B", gpu="24GiB", concurrency=1)
    q = plan_budget("Qwen/Qwen3-8B", gpu="24GiB", concurrency=8)
    assert q.max_context_tokens < p.max_context_tokens
    curve = [t for _, t in p.concurrency_curve]
    assert curve == sorted(curve, reverse=True)


def test_model_limit_and_max_concurrency():
    p = plan_budget("HuggingFaceTB/SmolLM2-135M-Instruct", gpu="H100", concurrency=2)
    assert p.limited_by == "model" and p.max_context_tokens == 8192
    assert p.max_concurrency > 2
    q = plan_budget("HuggingFaceTB/SmolLM2-135M-Instruct", gpu="H100", context_tokens=1024)
    assert q.max_concurrency > p.max_concurrency


def test_fp8_kv_doubles_capacity_roughly():
    a = plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="RTX 4090", max_new_tokens=64)
    b = plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="RTX 4090", max_new_tokens=64, kv_dtype="fp8")
    assert b.kv_bytes_per_token * 2 == a.kv_bytes_per_token
    assert b.max_context_tokens > a.max_context_tokens


def test_budget_error_says_need_have_fix():
    with pytest.raises(BudgetError) as e:
        plan_budget("meta-llama/Llama-3.1-70B-Instruct", gpu="RTX 4090")
    assert "GiB" in str(e.value) and "smaller" in str(e.value)
    with pytest.raises(BudgetError) as e:
        plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="RTX 4090", concurrency=512, max_new_tokens=1024)
    assert e.value.unit == "tokens" and "concurrency" in str(e.value)


def test_weights_sources(tmp_path):
    p = plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="H100", weights_bytes=10**9)
    assert p.weights_bytes == 10**9
    q = plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="H100", weight_dtype="int4")
    # int4 is stored with its scales and zero points (4 bits + float16 scale and 4-bit zero per
    # 128 values: 133/256 byte a value) and leaves the embeddings, head and norms in float16; it
    # used to be every parameter at 4 bits, (8_030_261_248 * 4 + 7) // 8, 1.1 GiB short.
    linear = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
    assert q.weights_bytes == linear * 133 // 256 + 2 * (8_030_261_248 - linear) == 5_727_854_592
    # Local folder: config.json + safetensors header
    cfg = load_model_config("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [10, 10], "data_offsets": [0, 200]}})
    raw = header.encode()
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"\0" * 200)
    r = plan_budget(str(tmp_path), gpu="H100")
    assert r.weights_bytes == 200 and r.weights_source == "safetensors headers"


@pytest.mark.model
def test_loaded_model_weights():
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    m = LlamaForCausalLM(cfg)
    p = plan_budget(m, gpu="1GiB", max_new_tokens=8)
    real = sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
    assert p.weights_bytes == real
    assert p.kv_dtype == "float32"
    assert p.kv_bytes_per_token == kv_cache_bytes(cfg, 1, kv_dtype="float32")
    del torch


def test_eager_activations_grow_quadratically():
    cfg = load_model_config("meta-llama/Llama-3.2-1B-Instruct")
    s1 = estimate_activation_bytes(cfg, 1000, attn_implementation="eager")
    s2 = estimate_activation_bytes(cfg, 2000, attn_implementation="eager")
    f1 = estimate_activation_bytes(cfg, 1000)
    f2 = estimate_activation_bytes(cfg, 2000)
    assert s2 / s1 > 3 and f2 / f1 < 2.2


def test_shipped_configs_are_complete():
    ids = list_model_configs()
    assert len(ids) >= 15
    for hub in ids:
        cfg = load_model_config(hub)
        assert cfg["_name_or_path"] == hub
        assert count_parameters(cfg) > 10**8
    for hub in ("google/gemma-3-4b-it", "openai/gpt-oss-20b", "mistralai/Mixtral-8x7B-Instruct-v0.1"):
        assert plan_budget(hub, gpu="B300", max_new_tokens=16).max_context_tokens > 16


def test_model_config_resolution(tmp_path):
    assert load_model_config("llama-3.1-8b")["_name_or_path"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert load_model_config("qwen3-8B")["num_hidden_layers"] == 36
    assert load_model_config(None)["hidden_size"] == 576
    with pytest.raises(ModelError, match="Shipped"):
        load_model_config("no-such-model-xyz")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    assert load_model_config(str(tmp_path))["hidden_size"] == 8


def test_gguf_default_generator_config():
    from ragbudget.memory.models import resolve_generator

    try:
        ref = resolve_generator()
    except ModelError:
        pytest.skip("default generator not installed")
    cfg = load_model_config(os.path.join(ref.path, ref.gguf_file))
    snap = load_model_config("HuggingFaceTB/SmolLM2-135M-Instruct")
    for k in (
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
        "vocab_size",
    ):
        assert cfg[k] == snap[k], k
    assert cfg["_gguf_tensor_bytes"] > 0


def test_bad_arguments():
    with pytest.raises(ConfigError):
        plan_budget("Qwen/Qwen3-4B", gpu="RTX 4090", utilization=1.5)
    with pytest.raises(ConfigError):
        plan_budget("Qwen/Qwen3-4B", gpu="RTX 4090", concurrency=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # A string from a config file or a form: one line naming the argument, not the
        # comparison's "'<' not supported between instances of 'str' and 'int'".
        ({"concurrency": "4"}, r"concurrency must be an int ≥ 1, got str '4' \(convert it with int\(\)\)"),
        ({"utilization": "0.9"}, r"utilization must be a number, got str '0.9'"),
        # Planned with before: a fractional answer length or a bool concurrency is a mistake.
        ({"max_new_tokens": 2.5}, r"max_new_tokens must be an int ≥ 1, got float 2.5"),
        ({"concurrency": True}, r"concurrency must be an int ≥ 1, got bool True"),
    ],
)
def test_plan_budget_checks_its_arguments_as_the_memory_settings_do(kwargs, message):
    with pytest.raises(ArgumentTypeError, match=message):
        plan_budget("Qwen/Qwen3-4B", gpu="RTX 4090", **kwargs)


def test_import_stays_light():
    code = (
        "import sys, ragbudget.memory.budget, ragbudget.memory.kvcache, ragbudget.gpus; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


_TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
}
PARAM_CASES = {
    "llama": _TINY,
    "mistral": dict(_TINY, sliding_window=8),
    "qwen2": _TINY,
    "qwen3": dict(_TINY, head_dim=24),
    "gemma2": dict(_TINY, head_dim=24),
    "gemma3_text": dict(_TINY, head_dim=24),
    "phi3": _TINY,
    "mixtral": dict(_TINY, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "deepseek_v3": dict(
        _TINY,
        num_key_value_heads=4,
        moe_intermediate_size=32,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    ),
    "gpt_oss": dict(_TINY, head_dim=16, num_local_experts=4, num_experts_per_tok=2),
}


@pytest.mark.model
@pytest.mark.parametrize("mt", list(PARAM_CASES))
@pytest.mark.parametrize("tied", [False, True])
def test_count_parameters_exact(mt, tied):
    pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(mt, **PARAM_CASES[mt], tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(cfg)
    real = sum(p.numel() for p in model.parameters())
    assert count_parameters(cfg.to_dict() | {"model_type": mt}) == real


_SMALL = {"vocab_size": 128, "hidden_size": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
RECURRENT_CASES = {
    "mamba": dict(_SMALL, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2),
    "jamba": dict(
        _SMALL,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=8,
    ),
    "nemotron_h": dict(
        _SMALL,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        hybrid_override_pattern="M*M-",
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=8,
        conv_kernel=4,
        expand=2,
        chunk_size=16,
    ),
}


@pytest.mark.model
@pytest.mark.parametrize("mt", list(RECURRENT_CASES))
def test_recurrent_models_are_counted_and_planned(mt):
    """Mamba/hybrid mixers are counted by building the model on the meta device (exact), and
    their constant state enters the plan as fixed bytes per sequence."""
    pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(mt, **RECURRENT_CASES[mt])
    real = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    d = cfg.to_dict() | {"model_type": mt, "torch_dtype": "bfloat16"}
    assert count_parameters(d) == real
    plan = plan_budget(config=d, gpu="1GiB", max_new_tokens=16)
    assert plan.kv_fixed_bytes_per_sequence == kv_cache_bytes(d, 0) > 0
    assert plan.max_context_tokens > 16


# ---- bench/gpu_validate.py: its measuring path on the CPU -------------------------------------


@pytest.fixture(scope="module")
def gpu_validate():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_validate.py"
    spec = importlib.util.spec_from_file_location("gpu_validate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_validate_dry_run(gpu_validate, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))
    assert gpu_validate.main(["--dry-run", "--quick", "--out", str(tmp_path / "gv.json")]) == 0
    out = capsys.readouterr().out
    assert "Llama-3.2-1B" in out and "Gemma-2-2B-like" in out and "predicted" in out
    p = gpu_validate.predict(gpu_validate.architectures()["Llama-3.2-1B"], 512, "bfloat16")
    assert p["predicted"] == p["weights"] + p["activations"] + p["kv_peak"]


@pytest.mark.model
def test_gpu_validate_cpu_dry_run_measures_exact_cache(gpu_validate, tmp_path, monkeypatch, capsys):
    """`--device cpu --quick`: tiny versions of the same architectures go through build, generate
    and the cache-bytes check, and the table and JSON come out."""
    pytest.importorskip("torch")
    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))  # run() points it elsewhere
    out = tmp_path / "gv.json"
    assert gpu_validate.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 * len(gpu_validate.CPU_CONTEXTS["quick"])
    assert all(r["kv_exact"] for r in rows), [r.get("failed") for r in rows]
    text = capsys.readouterr().out
    assert "kv exact in 6/6" in text and "FAILED" not in text


def test_gpu_validate_reports_failed_cases_in_the_table(gpu_validate, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))

    def broken(cfg, device, dtype):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(gpu_validate, "build", broken)
    rows = gpu_validate.run(device="cpu", quick=True, dry_run=False, out=tmp_path / "gv.json")
    assert rows and all("build: RuntimeError: CUDA out of memory" in r["failed"] for r in rows)
    assert all(r["predicted"] > 0 for r in rows)  # predictions still printed
    text = capsys.readouterr().out
    assert text.count("FAILED") == len(rows) and f"{len(rows)} failed" in text


def test_gpu_validate_without_cuda_skips_with_a_message(gpu_validate, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the real run is not a unit test")
    assert gpu_validate.main([]) == 0
    assert "no CUDA device; skipping" in capsys.readouterr().out


# -- honest errors: every budget error names the limit that binds, with its number ---------------


def test_max_new_tokens_over_the_window_blames_the_window_not_memory() -> None:
    # SmolLM2-135M on 20+ GiB: memory would hold 100k tokens, its 8,192-token window does not.
    with pytest.raises(BudgetError) as e:
        plan_budget("HuggingFaceTB/SmolLM2-135M-Instruct", gpu="24GiB", max_new_tokens=100_000)
    msg = str(e.value)
    assert e.value.limit == "window" and e.value.available == 8192
    assert "8,192" in msg and "window" in msg and "max_new_tokens" in msg
    assert "GPU" not in msg and "GiB" not in msg and "fp8" not in msg


def test_memory_error_names_memory_and_its_token_number() -> None:
    with pytest.raises(BudgetError) as e:
        plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="16GiB", max_new_tokens=4096)
    assert e.value.limit == "memory"
    assert "GiB" in str(e.value) and "usable" in str(e.value)


def test_config_without_dtype_plans_float32_and_says_so() -> None:
    """Never under-estimate: a config that names no dtype is planned at float32 (what
    transformers allocates then), twice a bf16 guess, and the plan says why."""
    base = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
    }
    plain = plan_budget(config=base, gpu="1GiB", max_new_tokens=16)
    typed = plan_budget(config=base | {"torch_dtype": "bfloat16"}, gpu="1GiB", max_new_tokens=16)
    assert plain.kv_dtype == "float32" and typed.kv_dtype == "bfloat16"
    assert plain.kv_bytes_per_token == 2 * typed.kv_bytes_per_token
    assert any("names no dtype" in n and "float32" in n for n in plain.notes)
    assert not any("names no dtype" in n for n in typed.notes)
    chosen = plan_budget(config=base, gpu="1GiB", max_new_tokens=16, kv_dtype="bfloat16")
    assert chosen.kv_bytes_per_token == typed.kv_bytes_per_token
    assert not any("names no dtype" in n for n in chosen.notes)


def test_time_cap_on_the_plan_and_request_memory_with_its_own_activations() -> None:
    from ragbudget.memory.budget import (
        CUBLAS_WORKSPACE_BYTES,
        cap_plan_for_time,
        estimate_activation_bytes,
        request_memory,
    )

    cfg = {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 8192,
        "torch_dtype": "float32",
    }
    plan = plan_budget(config=cfg, gpu="8GiB", max_new_tokens=256)
    assert plan.limited_by == "model" and plan.max_prompt_tokens == 8192 - 256
    # 1 ms a token: a 2 s target allows 2,000 prompt tokens, below the window: time binds.
    capped = cap_plan_for_time(plan, {"a": 0.001, "b": 0.0}, 2.0)
    assert (capped.limited_by, capped.max_prompt_tokens, capped.max_context_tokens) == ("time", 2000, 2256)
    assert capped.memory_max_context_tokens == 8192 and capped.ttft_target_s == 2.0
    assert any("capped at 2,000 tokens for time" in n for n in capped.notes)
    # A target above what memory allows records itself and changes nothing else.
    loose = cap_plan_for_time(plan, {"a": 2.0**-17, "b": 0.0}, 2.0)
    assert loose.limited_by == "model" and loose.max_context_tokens == 8192
    assert loose.time_prompt_tokens == 2**18

    # Per request: the memory beside the weights and the process's one cuBLAS workspace, KV per
    # token, and the prefill activations of its own prompt with the plan's attention (eager
    # holds the L×L scores: far more), without a workspace of its own.
    mem = request_memory(plan, cfg)
    assert mem.capacity_bytes == plan.usable_bytes - plan.weights_bytes - CUBLAS_WORKSPACE_BYTES
    assert mem.kv_bytes_per_token == plan.kv_bytes_per_token_peak
    assert mem.activation_bytes(1000) == estimate_activation_bytes(cfg, 1000, dtype="float32", workspace_bytes=0)
    assert estimate_activation_bytes(cfg, 1000, dtype="float32") == mem.activation_bytes(1000) + CUBLAS_WORKSPACE_BYTES
    eager = request_memory(plan_budget(config=cfg, gpu="8GiB", attn_implementation="eager"), cfg)
    assert eager.activation_bytes(4000) > 4 * mem.activation_bytes(4000)
    assert mem.request_bytes(prompt_tokens=1000, tokens=1256) == (
        mem.kv_fixed_bytes + 1256 * mem.kv_bytes_per_token + mem.activation_bytes(1000)
    )


# ---- what people actually run: quantized checkpoints, several GPUs (issue #30 §4) ----------------


def test_quantized_checkpoints_are_planned_at_their_storage() -> None:
    # gpt-oss-20b ships MXFP4 experts: 12.8 GiB, not the 38.96 GiB of bfloat16 it was planned at.
    p = plan_budget("openai/gpt-oss-20b", gpu="RTX 4090", max_new_tokens=64)
    assert p.weights_bytes == 13_761_264_768 and "mxfp4" in p.weights_source
    assert p.weight_format.startswith("mxfp4")
    # A 70B in AWQ int4 fits one 80 GB GPU; the bf16 one does not, and the error says what to pass.
    awq = plan_budget("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4", gpu="H100", max_new_tokens=64)
    assert awq.weights_bytes == 39_767_785_472 and awq.max_context_tokens > 1024
    with pytest.raises(BudgetError) as e:
        plan_budget("meta-llama/Llama-3.1-70B-Instruct", gpu="H100")
    assert "--weight-dtype int4" in str(e.value) and "--gpu 2x" in str(e.value)
    assert plan_budget("meta-llama/Llama-3.1-70B-Instruct", gpu="H100", weight_dtype="int4").weights_bytes == (
        awq.weights_bytes
    )


def test_tensor_parallel_plan_by_hand() -> None:
    p = plan_budget("meta-llama/Llama-3.1-70B-Instruct", gpu="2xH100", max_new_tokens=64)
    q = plan_budget("meta-llama/Llama-3.1-70B-Instruct", gpu="H100", tensor_parallel=2, max_new_tokens=64)
    assert p == q and p.tensor_parallel == 2
    # Per GPU: half of every linear and of the vocabulary, the 161 norms whole, bf16.
    linear = 80 * (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192)
    assert p.weights_bytes == 2 * (linear // 2 + 128256 * 8192 + 80 * 2 * 8192 + 8192) == 70_555_025_408
    # 4 of the 8 KV heads: 80 layers × K and V × 4 heads × 128 dims × 2 bytes.
    assert p.kv_bytes_per_token == 80 * 2 * 4 * 128 * 2 == 163_840
    # 90% of 80 GiB, less NCCL's communicator (544 MiB) and the custom all-reduce (16 MiB).
    assert p.comm_reserve_bytes == 560 * 2**20
    assert p.usable_bytes == int(80 * 2**30 * 0.9) - 560 * 2**20
    # The activations of one GPU's shard: 32 heads, 4 KV heads of 128, an MLP of 14,336.
    shard = dict(load_model_config("meta-llama/Llama-3.1-70B-Instruct"))
    shard.update(num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=14336)
    assert p.activation_bytes == estimate_activation_bytes(shard, p.max_context_tokens, dtype="bfloat16")
    # And what is left holds the KV of the whole group's tokens.
    assert p.weights_bytes + p.activation_bytes + p.kv_bytes_at_max <= p.usable_bytes
    assert p.max_context_tokens == p.kv_capacity_tokens
    assert p.kv_bytes_at_max == p.max_context_tokens * 163_840


def test_tensor_parallel_and_the_gpu_count_must_agree() -> None:
    with pytest.raises(ConfigError, match="names 2 × H100 80GB but tensor_parallel is 4"):
        plan_budget("meta-llama/Llama-3.1-70B-Instruct", gpu="2xH100", tensor_parallel=4)
    with pytest.raises(ConfigError, match="tensor_parallel is 1"):  # what LocalBackend plans with
        plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="2xH100", tensor_parallel=1)
    with pytest.raises(ConfigError, match="28 attention heads"):
        plan_budget("Qwen/Qwen2.5-7B-Instruct", gpu="8xL4")
    with pytest.raises(ConfigError, match="weight_dtype must be one of"):
        plan_budget("Qwen/Qwen2.5-7B-Instruct", gpu="L4", weight_dtype="int3")


def test_a_gguf_is_planned_at_its_own_tensor_types_on_request() -> None:
    from ragbudget.memory.models import resolve_generator

    try:
        ref = resolve_generator()
    except ModelError:
        pytest.skip("default generator not installed")
    path = os.path.join(ref.path, ref.gguf_file)
    size = os.path.getsize(path)
    stored = plan_budget(path, gpu="1GiB", weight_dtype="gguf", max_new_tokens=16)
    # Q4_1 tensors: the file less its header and vocabulary, not transformers' dequantized copy.
    assert 0.8 * size < stored.weights_bytes < size and "GGUF tensor table" in stored.weights_source
    loaded = plan_budget(path, gpu="1GiB", max_new_tokens=16)
    assert loaded.weights_bytes > 3 * stored.weights_bytes
    assert any("--weight-dtype gguf" in n for n in loaded.notes)
    with pytest.raises(ConfigError, match="not a GGUF"):
        plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="H100", weight_dtype="gguf")


def test_the_measurements_keep_their_old_import_path() -> None:
    # They moved to ragbudget.memory.calibration (issue #32); code that imported them from the
    # plan's module gets the very same objects, and is told where they live now (issue #44 §4:
    # the package itself imports them from their owner).
    import ragbudget.memory.budget as budget
    import ragbudget.memory.calibration as calibration

    for name in calibration.__all__:
        with pytest.warns(DeprecationWarning, match=f"moved to ragbudget.memory.calibration.{name}"):
            assert getattr(budget, name) is getattr(calibration, name), name


def test_the_cublas_workspace_is_counted_once_on_a_gpu_and_not_against_host_ram(monkeypatch) -> None:
    from ragbudget import gpus
    from ragbudget.memory.budget import CUBLAS_WORKSPACE_BYTES, estimate_activation_bytes

    cfg = {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }

    def act(plan, workspace: int) -> int:
        return estimate_activation_bytes(
            cfg, plan.max_context_tokens, batch_size=plan.concurrency, dtype=plan.kv_dtype, workspace_bytes=workspace
        )

    on_gpu = plan_budget(config=cfg, gpu="8GiB", concurrency=2)
    assert on_gpu.activation_bytes == act(on_gpu, CUBLAS_WORKSPACE_BYTES)  # once, not per request
    monkeypatch.setattr(gpus, "cuda_free", lambda: None)  # a machine without CUDA: host RAM
    in_ram = plan_budget(config=cfg, gpu="auto", concurrency=2)
    assert in_ram.gpu_source.startswith("host RAM")
    assert in_ram.activation_bytes == act(in_ram, 0)
