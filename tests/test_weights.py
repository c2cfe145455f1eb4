"""Weight bytes: every parameter by role (checked against the model transformers builds), the
quantized layouts read from real ``quantization_config`` shapes, and one GPU of a tensor-parallel
group. Expected bytes are written out by hand from the formats' layouts, not from the code."""

from __future__ import annotations

import pytest

from ragbudget.errors import ConfigError, ModelError
from ragbudget.memory.models import load_model_config
from ragbudget.memory.weights import (
    Param,
    WeightFormat,
    comm_reserve_bytes,
    parameters,
    rank_config,
    weight_bytes,
    weight_format,
)
from tests.test_budget import PARAM_CASES

# ---- the parameters, by name, against transformers -----------------------------------------------


@pytest.mark.parametrize("mt", list(PARAM_CASES))
@pytest.mark.parametrize("tied", [False, True])
def test_parameters_are_transformers_own(mt: str, tied: bool) -> None:
    """Every parameter transformers builds, under its name and with its size: the names are what
    ``modules_to_not_convert`` patterns match, the sizes what each format stores."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(mt, **PARAM_CASES[mt], tie_word_embeddings=tied)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    real = {n: p.numel() for n, p in model.named_parameters()}
    ours = {p.name: p.numel for p in parameters(cfg.to_dict() | {"model_type": mt})}
    assert ours == real


def test_recurrent_models_are_not_listed() -> None:
    cfg = {"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128, "state_size": 8}
    with pytest.raises(ModelError, match="recurrent"):
        parameters(cfg)


# ---- storage formats, by hand ------------------------------------------------------------------
# Llama-3.1-8B: per layer q, o 4096×4096; k, v 1024×4096; gate, up 14336×4096; down 4096×14336.
L8_LINEAR = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)  # values in the linears
L8_OTHER = 2 * 128256 * 4096 + 32 * 2 * 4096 + 4096  # embeddings + untied head + norms
L8 = load_model_config("meta-llama/Llama-3.1-8B-Instruct")


def test_the_llama_8b_linears_and_the_rest_add_up_to_its_published_size() -> None:
    assert L8_LINEAR + L8_OTHER == 8_030_261_248
    assert weight_bytes(L8) == 2 * 8_030_261_248


def test_int4_is_awq_layout_with_scales_zeros_and_a_16_bit_rest() -> None:
    # Per out×in weight: 4-bit values in/2·out, a float16 scale and a 4-bit zero per 128 inputs:
    # out·in·(1/2 + 2/128 + 1/256) = out·in·133/256; embeddings, head and norms stay float16.
    assert weight_bytes(L8, weight_format(L8, "int4")) == L8_LINEAR * 133 // 256 + 2 * L8_OTHER == 5_727_854_592


def test_bitsandbytes_nf4_from_the_config() -> None:
    cfg = dict(
        L8, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    )
    fmt = weight_format(cfg)
    assert fmt.method == "bnb" and "nf4" in fmt.label
    # 4 bits a value, a float32 absmax per 64 values, a 16-entry float32 code book per weight
    # (7 weights a layer); the rest stays bfloat16.
    assert weight_bytes(cfg) == L8_LINEAR * 9 // 16 + 64 * 7 * 32 + 2 * L8_OTHER == 6_027_761_664
    cfg8 = dict(L8, quantization_config={"quant_method": "bitsandbytes", "load_in_8bit": True})
    rows = 32 * (2 * 4096 + 2 * 1024 + 2 * 14336 + 4096)  # output rows of the 7 weights a layer
    assert weight_bytes(cfg8) == L8_LINEAR + 4 * rows + 2 * L8_OTHER


def test_gpt_oss_20b_is_mxfp4_experts_and_bf16_rest() -> None:
    cfg = load_model_config("openai/gpt-oss-20b")
    # 32 experts × 24 layers; gate_up 5760×2880 and down 2880×2880, 90 blocks of 32 a row, each
    # 16 bytes of values + 1 scale byte.
    experts = 24 * 32 * (5760 * 90 * 17 + 2880 * 90 * 17)
    per_layer = (
        64  # sinks
        + 4096 * 2880
        + 4096  # q + bias
        + 2 * (512 * 2880 + 512)  # k, v + biases
        + 2880 * 4096
        + 2880  # o + bias
        + 32 * 2880
        + 32  # router + bias
        + 32 * 5760
        + 32 * 2880  # expert biases
        + 2 * 2880  # norms
    )
    rest = 24 * per_layer + 2 * 201088 * 2880 + 2880
    assert weight_bytes(cfg) == experts + 2 * rest == 13_761_264_768  # 12.8 GiB, the published checkpoint
    assert weight_format(cfg).label.startswith("mxfp4: MoE experts")


L70_LINEAR = 80 * (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192)
L70_OTHER = 2 * 128256 * 8192 + 80 * 2 * 8192 + 8192


def test_awq_and_gptq_70b_checkpoints_plan_their_int4_storage() -> None:
    awq = load_model_config("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4")
    assert weight_bytes(awq) == L70_LINEAR * 133 // 256 + 2 * L70_OTHER == 39_767_785_472
    gptq = load_model_config("hugging-quants/Meta-Llama-3.1-70B-Instruct-GPTQ-INT4")
    # GPTQ adds an int32 g_idx per input of each weight: 6 × 8192 + 28672 inputs a layer.
    assert weight_bytes(gptq) == 39_767_785_472 + 4 * 80 * (6 * 8192 + 28672)


# A small llama for the block-scaled formats: q, o 256×256; k, v 128×256; gate, up 512×256;
# down 256×512; a 1024-token vocabulary, untied; bfloat16.
TINY = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 512,
    "vocab_size": 1024,
    "torch_dtype": "bfloat16",
}
TINY_REST = 2 * (2 * 1024 * 256 + 2 * 256 + 256)


def test_fp8_block_scales() -> None:
    cfg = dict(TINY, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    # One byte a value + a float32 scale per 128×128 block: q, o 4 blocks; k, v 2; gate, up, down 8.
    linears = (65536 + 4 * 4) * 2 + (32768 + 4 * 2) * 2 + (131072 + 4 * 8) * 3
    assert weight_bytes(cfg) == linears + TINY_REST == 1_640_080


def test_compressed_tensors_w4a16_group_128() -> None:
    cfg = dict(
        TINY,
        quantization_config={
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": 128,
                    },
                }
            },
            "ignore": ["lm_head"],
        },
    )
    # Values packed in int32 (out·in/2 bytes) + a 16-byte weight_shape + a bfloat16 scale per 128 inputs.
    linears = (32768 + 16 + 256 * 2 * 2) * 2 + (16384 + 16 + 128 * 2 * 2) * 2 + (65536 + 16 + 512 * 2 * 2) * 2
    linears += 65536 + 16 + 256 * 4 * 2  # down: 512 inputs, 4 groups
    assert weight_bytes(cfg) == linears + TINY_REST == 1_354_352


def test_modules_left_unquantized_by_name() -> None:
    # A plain pattern matches whole dotted components: Mixtral's "gate" is its router, not gate_proj.
    fmt = WeightFormat(method="awq", dtype="float16", label="", bits=4, group_size=128, skip=("gate", "layers.0."))
    assert not fmt.quantizes(Param("model.layers.1.mlp.gate.weight", 8, 64, role="linear"))
    assert fmt.quantizes(Param("model.layers.1.mlp.gate_proj.weight", 96, 64, role="linear"))
    assert not fmt.quantizes(Param("model.layers.0.mlp.up_proj.weight", 96, 64, role="linear"))
    assert fmt.quantizes(Param("model.layers.10.mlp.up_proj.weight", 96, 64, role="linear"))
    glob = WeightFormat(method="mxfp4", dtype="bfloat16", label="", skip=("model.layers.*.self_attn",))
    assert not glob.quantizes(Param("model.layers.3.self_attn.q_proj.weight", 64, 64, role="linear"))
    regex = WeightFormat(method="fp8", dtype="bfloat16", label="", skip=("re:.*mlp\\.gate$",))
    assert not regex.quantizes(Param("model.layers.3.mlp.gate.weight", 8, 64, role="linear"))
    assert regex.quantizes(Param("model.layers.3.mlp.gate_proj.weight", 8, 64, role="linear"))


def test_an_unknown_method_is_planned_unquantized_and_says_so() -> None:
    fmt = weight_format(dict(L8, quantization_config={"quant_method": "exl3"}))
    assert fmt.method == "dtype" and "not modelled" in fmt.label
    assert weight_bytes(dict(L8, quantization_config={"quant_method": "exl3"})) == 2 * 8_030_261_248


def test_bad_overrides_are_refused() -> None:
    with pytest.raises(ConfigError, match="weight_dtype must be one of"):
        weight_format(L8, "int3")
    with pytest.raises(ConfigError, match="MoE experts"):
        weight_format(L8, "mxfp4")


# ---- one GPU of a tensor-parallel group, by hand -----------------------------------------------


def test_llama_70b_over_two_gpus() -> None:
    cfg = load_model_config("meta-llama/Llama-3.1-70B-Instruct")
    # Every linear and the (64-padded, here already) vocabulary halve; the 161 norms stay whole.
    per_gpu = L70_LINEAR // 2 + 2 * 128256 * 8192 // 2 + (80 * 2 * 8192 + 8192)
    assert weight_bytes(cfg, tensor_parallel=2) == 2 * per_gpu == 70_555_025_408
    assert comm_reserve_bytes(2) == (544 + 16) * 2**20


def test_fewer_kv_heads_than_gpus_are_replicated() -> None:
    cfg = load_model_config("google/gemma-3-4b-it")  # 8 heads, 4 KV heads of 256, tied embeddings
    r = rank_config(cfg, 8)
    assert (r["num_attention_heads"], r["num_key_value_heads"], r["head_dim"]) == (1, 1, 256)
    # Per GPU and layer: q 256×2560, k and v one whole KV head 256×2560, o 2560×256, q/k norms,
    # gate/up 1280×2560, down 2560×1280, 4 norms; the 262,208-row vocabulary ÷ 8; the final norm.
    layer = 4 * 256 * 2560 + 2 * 256 + 3 * 1280 * 2560 + 4 * 2560
    assert weight_bytes(cfg, tensor_parallel=8) == 2 * (34 * layer + 262208 // 8 * 2560 + 2560) == 1_015_274_496


def test_a_degree_vllm_refuses_is_refused() -> None:
    qwen = load_model_config("Qwen/Qwen2.5-7B-Instruct")  # 28 heads, 4 KV heads
    with pytest.raises(ConfigError, match="does not divide the model's 28 attention heads.*use 2 or 4"):
        weight_bytes(qwen, tensor_parallel=8)
    with pytest.raises(ConfigError, match="one must divide the other"):
        rank_config(dict(TINY, num_attention_heads=6, num_key_value_heads=4), 3)
