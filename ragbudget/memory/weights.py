"""Weight bytes: which tensors a checkpoint holds, how each one is stored, and what one GPU of a
tensor-parallel group keeps.

Three steps, each exact where the checkpoint says enough:

1. :func:`parameters` lists every parameter of a decoder-only model from its config alone, under
   transformers' own names (``model.layers.0.self_attn.q_proj.weight``), with its shape, its role
   (a linear layer, a stack of MoE experts, the router, the embeddings, the head, a vector) and
   how tensor parallelism cuts it. The names and sizes are checked against the model transformers
   builds (``tests/test_weights.py``).
2. :func:`weight_format` reads how the checkpoint stores them from its ``quantization_config``
   (GPTQ, AWQ, bitsandbytes, FP8, compressed-tensors, MXFP4), or takes ``weight_dtype`` as an
   override; :meth:`WeightFormat.tensor_bytes` is the bytes of one weight in that format, with
   the scales, zero points and indices the format keeps beside the values:

   =================  ==========================================================================
   format             bytes of an ``out × in`` weight
   =================  ==========================================================================
   gptq (b bits, g)   packed values ``out·in·b/8`` + fp16 scales and packed zeros per group of
                      ``g`` inputs + an int32 ``g_idx`` per input (AutoGPTQ's layout)
   awq (b bits, g)    packed values + fp16 scales and packed zeros per group (AutoAWQ's GEMM)
   bnb 4-bit          ``out·in/2`` + an fp32 absmax per block of 64 (8-bit absmax and an fp32
                      per 256 blocks with double quantization) + the 16-entry code book
   bnb 8-bit          ``out·in`` + an fp32 scale per output row (LLM.int8)
   fp8                ``out·in`` + fp32 scales: one per ``weight_block_size`` block, else one
                      per tensor (+ one input scale for a static activation scheme)
   compressed-tensors ``num_bits`` per value (int32-packed for ``pack-quantized``) + a scale
                      (and a zero point if asymmetric) per tensor, channel, group or block
   mxfp4              ``out·in/2`` + one E8M0 scale byte per 32 values (OCP microscaling)
   =================  ==========================================================================

   Modules a format leaves alone stay in the model dtype: the embeddings, the norms and biases,
   the MoE router, the head unless the config quantizes it, and whatever
   ``modules_to_not_convert`` / ``ignore`` names.
3. :func:`weight_bytes` sums them for one GPU of ``tensor_parallel`` — vLLM's sharding: the
   attention heads, the MLP and every expert's intermediate dimension, and the vocabulary (padded
   to a multiple of 64) are split; KV heads are split while there are at least as many as GPUs,
   else each GPU keeps a replica of one; norms, the router and the row-parallel layers' biases
   are replicated.

What is not modelled, and its direction: kernels that repack or pad at load time (Marlin, the
MXFP4 Triton kernels pad the expert dimensions; a few percent more), and vLLM's unquantized
copies of nothing else. A GGUF file's own tensor types are read exactly from its tensor table
(:func:`ragbudget.memory.models.gguf_metadata`), on one device.

>>> cfg = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
...     "intermediate_size": 11008, "num_attention_heads": 32, "torch_dtype": "float16"}
>>> weight_bytes(cfg) == 2 * sum(p.numel for p in parameters(cfg))
True
>>> weight_format(cfg, "int4").label
'int4: 4-bit, groups of 128, float16 scales and zero points (AWQ layout; --weight-dtype)'
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, ModelError
from ..types import WEIGHT_DTYPES as WEIGHT_DTYPES, dtype_bits
from .layers import layer_specs
from .model_config import ConfigLike, ConfigView, model_dtype, normalize_config, text_config

__all__ = [
    "COMM_RESERVE_BYTES",
    "WEIGHT_DTYPES",
    "Param",
    "WeightFormat",
    "comm_reserve_bytes",
    "parameters",
    "rank_config",
    "weight_bytes",
    "weight_format",
]

# WEIGHT_DTYPES (the names --weight-dtype takes) lives in types: the CLI offers them without
# importing the memory model.

#: Per GPU, the memory tensor parallelism costs outside PyTorch's allocator, taken off the usable
#: memory: NCCL's communicator buffers, measured at 544 MiB for a group of 2 GPUs and 688 MiB for
#: more (A100s over NVLink, NVIDIA/nccl#964; we read MB as MiB, the larger), plus vLLM's custom
#: all-reduce: an 8 MiB IPC buffer and 8 MiB of metadata and scratch (``CustomAllreduce(max_size=
#: 8192 * 1024)``). Topologies differ (more channels, more memory): a floor, not a measurement of
#: your machine.
COMM_RESERVE_BYTES = {2: (544 + 16) << 20, "more": (688 + 16) << 20}


def comm_reserve_bytes(tensor_parallel: int) -> int:
    """:data:`COMM_RESERVE_BYTES` for a group of ``tensor_parallel`` GPUs (0 on one GPU).

    >>> comm_reserve_bytes(1), comm_reserve_bytes(2) >> 20, comm_reserve_bytes(8) >> 20
    (0, 560, 704)
    """
    if tensor_parallel <= 1:
        return 0
    return COMM_RESERVE_BYTES[2] if tensor_parallel == 2 else COMM_RESERVE_BYTES["more"]


# --------------------------------------------------------------------------------------------
# The parameters of a model, from its config
# --------------------------------------------------------------------------------------------

#: How tensor parallelism cuts a parameter (vLLM's layers): ``column`` splits the output rows
#: (QKV, gate/up projections, column-parallel biases, attention sinks), ``row`` the input columns
#: (o/down projections), ``vocab`` the vocabulary rows, ``replicated`` keeps it whole.
SPLITS = ("column", "row", "vocab", "replicated")


@dataclass(frozen=True)
class Param:
    """One parameter: ``out_features × in_features`` (``in_features`` 1 for a vector), ``experts``
    stacked copies of it (MoE), its ``role`` and how tensor parallelism splits it; ``kv_rows`` of
    its rows belong to KV heads (replicated, not split, when there are fewer KV heads than GPUs).
    Expert weights are described as ``out × in`` of one expert (``gate_up``: ``2·I × H``), the
    orientation quantizers group along, whatever the orientation transformers stores."""

    name: str
    out_features: int
    in_features: int = 1
    experts: int = 1
    role: str = "vector"
    split: str = "replicated"
    kv_rows: int = 0

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features * self.experts

    @property
    def module(self) -> str:
        """The module the parameter belongs to (the name without ``.weight``/``.bias``)."""
        head, _, tail = self.name.rpartition(".")
        return head if tail in ("weight", "bias") else self.name


_NON_GATED = ("gpt2", "gpt_neox", "opt", "bloom", "gptj", "falcon", "phi", "starcoder2")


def has_recurrent(config: ConfigLike) -> bool:
    try:
        specs = layer_specs(config, normalize=False)
    except (ModelError, ConfigError):
        return False
    return any(s.kind in ("mamba", "hybrid") for s in specs)


def parameters(config: ConfigLike) -> tuple[Param, ...]:
    """Every parameter of a decoder-only LM from its config, under transformers' names: embeddings,
    attention (incl. MLA, QK norms, sinks), dense or MoE MLP (router, experts, shared experts),
    norms and the untied head. Exact for Llama/Mistral/Qwen2/Qwen3/Gemma/Phi-3/Mixtral/Qwen3-MoE/
    DeepSeek-V3/gpt-oss (checked against transformers in tests); other families get the same
    layout under these names (biases and norm details may differ). Recurrent and hybrid models
    (Mamba mixers) are not described: :class:`~ragbudget.errors.ModelError`.

    >>> [p.name for p in parameters({"model_type": "llama", "vocab_size": 8, "hidden_size": 4,
    ...     "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})][:3]
    ['model.embed_tokens.weight', 'model.layers.0.self_attn.q_proj.weight', 'model.layers.0.self_attn.k_proj.weight']
    """
    c = ConfigView(text_config(config) if isinstance(config, Mapping) else normalize_config(config, False))
    mt = str(c.get("model_type", default="")).lower()
    if c.get("num_attention_heads", "n_head", "num_heads") is None or has_recurrent(config):
        raise ModelError(
            f"a {mt or 'model'} config with recurrent (Mamba-style) layers: its parameters are "
            "counted by building it (ragbudget.memory.budget.count_parameters), not listed by role"
        )
    H = int(c.get("hidden_size", "n_embd", "d_model"))
    n_layers = int(c.get("num_hidden_layers", "n_layer", "num_layers"))
    heads = int(c.get("num_attention_heads", "n_head", "num_heads"))
    V = int(c.get("vocab_size", default=32000))
    hd = c.get("head_dim")
    s = _Shape(
        mt=mt,
        H=H,
        heads=heads,
        kv=int(c.get("num_key_value_heads", "num_kv_heads", default=heads)),
        hd=int(hd) if isinstance(hd, int) and hd > 0 else H // heads,
        inter=int(c.get("intermediate_size", "ffn_dim", "n_inner", default=0) or 4 * H),
        bias=bool(c.get("attention_bias", default=mt in ("qwen2", "qwen2_moe", "gpt_oss"))),
        gated=mt not in _NON_GATED,
    )
    experts = c.get("num_local_experts", "n_routed_experts", "num_experts")
    first_dense = int(c.get("first_k_dense_replace", default=0))
    ps = _Params([Param("model.embed_tokens.weight", V, H, role="embedding", split="vocab")])
    for layer in range(n_layers):
        pre = f"model.layers.{layer}"
        if c.get("kv_lora_rank") is not None:
            _mla_attention(ps, c, f"{pre}.self_attn", s)
        else:
            _attention(ps, f"{pre}.self_attn", s)
        if experts and layer >= first_dense:
            _moe_mlp(ps, c, f"{pre}.mlp", s, int(experts))
        else:
            _mlp(ps.linear, f"{pre}.mlp", H, s.inter, s.gated, mt)
        ps.vector(f"{pre}.input_layernorm.weight", H)
        ps.vector(f"{pre}.post_attention_layernorm.weight", H)
        if mt.startswith(("gemma2", "gemma3")):
            ps.vector(f"{pre}.pre_feedforward_layernorm.weight", H)
            ps.vector(f"{pre}.post_feedforward_layernorm.weight", H)
    ps.vector("model.norm.weight", H)
    if not c.get("tie_word_embeddings", default=mt.startswith("gemma")):
        ps.out.append(Param("lm_head.weight", V, H, role="lm_head", split="vocab"))
    return tuple(ps.out)


@dataclass(frozen=True, kw_only=True)
class _Shape:
    """What a decoder layer's parameters are sized by: the model type, hidden size, attention
    and KV heads, head size, MLP width, and whether attention has biases and the MLP a gate."""

    mt: str
    H: int
    heads: int
    kv: int
    hd: int
    inter: int
    bias: bool
    gated: bool


@dataclass
class _Params:
    """The parameter list :func:`parameters` builds, a linear layer's weight or a vector at a time."""

    out: list[Param]

    def linear(
        self, name: str, o: int, i: int, split: str, *, kv_rows: int = 0, experts: int = 1, role: str = ""
    ) -> None:
        self.out.append(
            Param(f"{name}.weight", o, i, experts, role or ("expert" if experts > 1 else "linear"), split, kv_rows)
        )

    def vector(self, name: str, n: int, split: str = "replicated", *, kv_rows: int = 0, experts: int = 1) -> None:
        self.out.append(Param(name, n, 1, experts, "vector", split, kv_rows))


def _mla_attention(ps: _Params, c: ConfigView, a: str, s: _Shape) -> None:
    """Multi-head latent attention (DeepSeek): low-rank query and key/value projections."""
    q_lora = c.get("q_lora_rank")
    nope, rope = int(c.get("qk_nope_head_dim")), int(c.get("qk_rope_head_dim"))
    vhd, kvr = int(c.get("v_head_dim")), int(c.get("kv_lora_rank"))
    # vLLM: the low-rank down projections are replicated, the per-head up projections split.
    if q_lora is None:
        ps.linear(f"{a}.q_proj", s.heads * (nope + rope), s.H, "column")
    else:
        ps.linear(f"{a}.q_a_proj", int(q_lora), s.H, "replicated")
        ps.vector(f"{a}.q_a_layernorm.weight", int(q_lora))
        ps.linear(f"{a}.q_b_proj", s.heads * (nope + rope), int(q_lora), "column")
    ps.linear(f"{a}.kv_a_proj_with_mqa", kvr + rope, s.H, "replicated")
    ps.vector(f"{a}.kv_a_layernorm.weight", kvr)
    ps.linear(f"{a}.kv_b_proj", s.heads * (nope + vhd), kvr, "column")
    ps.linear(f"{a}.o_proj", s.H, s.heads * vhd, "row")


def _attention(ps: _Params, a: str, s: _Shape) -> None:
    """Multi-head or grouped-query attention: projections, biases, sinks and QK norms."""
    mt, H, heads, kv, hd, bias = s.mt, s.H, s.heads, s.kv, s.hd, s.bias
    if mt == "gpt_oss":
        ps.vector(f"{a}.sinks", heads, "column")
    if mt == "phi3":  # fused QKV
        ps.linear(f"{a}.qkv_proj", (heads + 2 * kv) * hd, H, "column", kv_rows=2 * kv * hd)
    else:
        ps.linear(f"{a}.q_proj", heads * hd, H, "column")
        if bias:
            ps.vector(f"{a}.q_proj.bias", heads * hd, "column")
        for name in ("k_proj", "v_proj"):
            ps.linear(f"{a}.{name}", kv * hd, H, "column", kv_rows=kv * hd)
            if bias:
                ps.vector(f"{a}.{name}.bias", kv * hd, "column", kv_rows=kv * hd)
    ps.linear(f"{a}.o_proj", H, heads * hd, "row")
    if bias and mt == "gpt_oss":
        ps.vector(f"{a}.o_proj.bias", H)  # row-parallel: added once, kept whole
    if mt in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"):
        ps.vector(f"{a}.q_norm.weight", hd)
        ps.vector(f"{a}.k_norm.weight", hd)
    elif mt == "olmo2":  # OLMo 2 normalizes the whole projections
        ps.vector(f"{a}.q_norm.weight", heads * hd)
        ps.vector(f"{a}.k_norm.weight", kv * hd)


def _moe_mlp(ps: _Params, c: ConfigView, m: str, s: _Shape, E: int) -> None:
    """A mixture-of-experts MLP: router, experts, and shared experts where the model has them."""
    mt, H = s.mt, s.H
    mI = int(c.get("moe_intermediate_size", default=s.inter))
    router = "router" if mt == "gpt_oss" else "gate"
    ps.linear(f"{m}.{router}", E, H, "replicated", role="router")
    if mt == "gpt_oss":
        ps.vector(f"{m}.router.bias", E)
        ps.out.append(Param(f"{m}.experts.gate_up_proj", 2 * mI, H, E, "expert", "column"))
        ps.vector(f"{m}.experts.gate_up_proj_bias", 2 * mI, "column", experts=E)
        ps.out.append(Param(f"{m}.experts.down_proj", H, mI, E, "expert", "row"))
        ps.vector(f"{m}.experts.down_proj_bias", H, experts=E)
    else:
        ps.out.append(Param(f"{m}.experts.gate_up_proj", (2 if s.gated else 1) * mI, H, E, "expert", "column"))
        ps.out.append(Param(f"{m}.experts.down_proj", H, mI, E, "expert", "row"))
    shared = c.get("n_shared_experts")
    if shared:
        _mlp(ps.linear, f"{m}.shared_experts", H, mI * int(shared), s.gated, mt)
    sh_i = c.get("shared_expert_intermediate_size")
    if sh_i:
        _mlp(ps.linear, f"{m}.shared_expert", H, int(sh_i), s.gated, mt)
        ps.linear(f"{m}.shared_expert_gate", 1, H, "replicated", role="router")


def _mlp(linear: Callable[..., None], m: str, H: int, inter: int, gated: bool, mt: str) -> None:
    if mt == "phi3":  # fused gate and up
        linear(f"{m}.gate_up_proj", 2 * inter, H, "column")
    elif gated:
        linear(f"{m}.gate_proj", inter, H, "column")
        linear(f"{m}.up_proj", inter, H, "column")
    else:
        linear(f"{m}.up_proj", inter, H, "column")
    linear(f"{m}.down_proj", H, inter, "row")


# --------------------------------------------------------------------------------------------
# How the weights are stored
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WeightFormat:
    """How a checkpoint stores its weights: ``method`` (``"dtype"`` for unquantized, else the
    quantizer), the ``dtype`` of whatever it leaves unquantized, and the layout parameters.
    ``skip`` are module patterns left unquantized (``modules_to_not_convert`` / ``ignore``);
    ``label`` says it in words for the plan, with where it was read."""

    method: str
    dtype: str
    label: str
    bits: int = 16
    group_size: int = 0  #: inputs sharing a scale (0: per output row or per tensor, by method)
    block: tuple[int, int] | None = None  #: fp8 / compressed-tensors block scales (rows, columns)
    zero_points: bool = False
    double_quant: bool = False  #: bitsandbytes 4-bit: absmax quantized again
    static_input_scale: bool = False  #: fp8 with a static activation scheme
    strategy: str = ""  #: compressed-tensors: tensor, channel, group or block
    packed: bool = False  #: compressed-tensors pack-quantized (int32 words)
    quantize_lm_head: bool = False
    experts_only: bool = False
    skip: tuple[str, ...] = field(default_factory=tuple)

    def quantizes(self, p: Param) -> bool:
        """Whether ``p`` is stored quantized (else in :attr:`dtype`)."""
        if self.method == "dtype" or p.role in ("vector", "embedding"):
            return False
        if p.role == "router" and self.method != "bnb":  # bitsandbytes replaces every nn.Linear
            return False
        if p.role == "lm_head" and not self.quantize_lm_head:
            return False
        if self.experts_only and p.role != "expert":
            return False
        return not any(_matches(p.module, pattern) for pattern in self.skip)

    def tensor_bytes(self, out: int, inp: int) -> int:
        """Bytes of one quantized ``out × inp`` weight, everything the format keeps for it.

        >>> WeightFormat(method="awq", dtype="float16", label="", bits=4, group_size=128,
        ...     zero_points=True).tensor_bytes(4096, 4096)   # 8 MiB + scales 256 KiB + zeros 32 KiB
        8716288
        """
        n = out * inp
        half = dtype_bits(self.dtype) // 8
        if self.method == "gptq":
            g = self.group_size or inp
            groups = math.ceil(inp / g)
            packed_cols = math.ceil(out * self.bits / 32) * 4  # zeros, packed along the outputs
            return math.ceil(inp * self.bits / 32) * 4 * out + groups * packed_cols + groups * out * 2 + inp * 4
        if self.method == "awq":
            g = self.group_size or inp
            groups = math.ceil(inp / g)
            packed_cols = math.ceil(out * self.bits / 32) * 4
            return inp * packed_cols + (groups * packed_cols if self.zero_points else 0) + groups * out * 2
        if self.method == "bnb":
            if self.bits == 8:
                return n + 4 * out
            blocks = math.ceil(n / 64)
            absmax = blocks + 4 * math.ceil(blocks / 256) + 4 + 64 if self.double_quant else 4 * blocks
            return math.ceil(n / 2) + absmax + 64  # + the 16-entry float32 code book
        if self.method == "fp8":
            if self.block is not None:
                scales = math.ceil(out / self.block[0]) * math.ceil(inp / self.block[1])
            else:
                scales = 1
            return n + 4 * scales + (4 if self.static_input_scale else 0)
        if self.method == "mxfp4":
            blocks = math.ceil(inp / 32)
            return out * blocks * 16 + out * blocks
        if self.method == "compressed-tensors":
            if self.packed:
                values = out * math.ceil(inp * self.bits / 32) * 4 + 16  # + the int64 weight_shape
            else:
                values = math.ceil(n * self.bits / 8)
            if self.strategy == "channel":
                scales = out
            elif self.strategy == "group":
                scales = out * math.ceil(inp / (self.group_size or inp))
            elif self.strategy == "block" and self.block is not None:
                scales = math.ceil(out / self.block[0]) * math.ceil(inp / self.block[1])
            else:
                scales = 1
            zeros = math.ceil(scales * self.bits / 8) if self.zero_points else 0
            return values + scales * half + zeros
        return n * half


def _matches(module: str, pattern: str) -> bool:
    """Whether ``pattern`` (a ``modules_to_not_convert`` / ``ignore`` entry) names ``module``:
    ``re:``-prefixed patterns are regular expressions (compressed-tensors); ones with ``*`` are
    globs over the module or a module above it; a plain one must appear as whole dotted
    components — so ``"gate"`` (Mixtral's router) does not swallow ``gate_proj``, as a raw
    substring test would."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if "*" in pattern or "?" in pattern:
        parts = module.split(".")
        return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))
    mod, pat = module.split("."), [x for x in pattern.split(".") if x]
    return any(mod[i : i + len(pat)] == pat for i in range(len(mod) - len(pat) + 1))


def _qconfig(config: ConfigLike) -> Mapping[str, Any] | None:
    for cfg in (config, text_config(config)):
        qc = ConfigView(cfg).get("quantization_config")
        if qc is not None and not isinstance(qc, Mapping):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        if isinstance(qc, Mapping) and qc:
            return qc
    return None


def _skips(qc: Mapping[str, Any], *keys: str) -> tuple[str, ...]:
    found: list[str] = []
    for key in keys:
        value = qc.get(key)
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, Sequence):
            found.extend(str(v) for v in value)
    return tuple(found)


def weight_format(config: ConfigLike, weight_dtype: str | None = None) -> WeightFormat:
    """How the weights of ``config`` are stored: ``weight_dtype`` when given (one of
    :data:`WEIGHT_DTYPES`), else the checkpoint's ``quantization_config``, else the model dtype.
    A quantization method it does not know is planned at the model dtype — an over-estimate —
    and says so in the label.

    >>> weight_format({"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "mxfp4",
    ...     "modules_to_not_convert": ["model.layers.*.self_attn"]}}).label
    'mxfp4: MoE experts in 4-bit with an 8-bit scale per 32 values, the rest bfloat16 (quantization_config)'
    """
    base = model_dtype(config)
    if weight_dtype is not None and weight_dtype != "auto":
        return _override(config, weight_dtype, base)
    qc = _qconfig(config)
    if qc is None:
        return WeightFormat(method="dtype", dtype=base, label=base)
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    src = "(quantization_config)"
    if method in ("gptq", "awq"):
        return _gptq_awq(qc, method, base, src)
    if method == "bitsandbytes" or qc.get("load_in_4bit") or qc.get("load_in_8bit"):
        return _bitsandbytes(qc, base, src)
    if method in ("fp8", "fbgemm-fp8"):
        return _fp8(qc, base, src)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, base, src)
    if method == "mxfp4":
        return WeightFormat(
            method="mxfp4",
            dtype=base,
            bits=4,
            experts_only=True,
            skip=_skips(qc, "modules_to_not_convert"),
            label=f"mxfp4: MoE experts in 4-bit with an 8-bit scale per 32 values, the rest {base} {src}",
        )
    return WeightFormat(
        method="dtype",
        dtype=base,
        label=f"{base}: quant_method {method or '?'!r} is not modelled, planned unquantized (an over-estimate; "
        "pass weight_dtype / --weight-dtype for its storage)",
    )


def _gptq_awq(qc: Mapping[str, Any], method: str, base: str, src: str) -> WeightFormat:
    """GPTQ or AWQ: n-bit weights in groups, float16 scales (and zero points)."""
    bits, g = int(qc.get("bits", 4)), int(qc.get("group_size", 128))
    group = f"groups of {g}" if g > 0 else "per output channel"
    zeros = method == "gptq" or bool(qc.get("zero_point", True))
    fmt = WeightFormat(
        method=method,
        dtype=base,
        bits=bits,
        group_size=max(g, 0),
        zero_points=zeros,
        quantize_lm_head=bool(qc.get("lm_head", False)),
        skip=_skips(qc, "modules_to_not_convert"),
        label=f"{method}: {bits}-bit, {group}, float16 scales"
        + (" and zero points" if zeros else "")
        + (", g_idx" if method == "gptq" else "")
        + f"; the rest {base} {src}",
    )
    return fmt


def _bitsandbytes(qc: Mapping[str, Any], base: str, src: str) -> WeightFormat:
    """bitsandbytes: LLM.int8 or 4-bit (fp4/nf4, optionally double-quantized)."""
    if qc.get("load_in_8bit"):
        return WeightFormat(
            method="bnb",
            dtype=base,
            bits=8,
            skip=_skips(qc, "llm_int8_skip_modules"),
            label=f"bitsandbytes 8-bit (LLM.int8: int8 + a float32 scale per row); the rest {base} {src}",
        )
    double = bool(qc.get("bnb_4bit_use_double_quant", False))
    kind = str(qc.get("bnb_4bit_quant_type", "fp4"))
    return WeightFormat(
        method="bnb",
        dtype=base,
        bits=4,
        double_quant=double,
        skip=_skips(qc, "llm_int8_skip_modules"),
        label=f"bitsandbytes 4-bit {kind}, blocks of 64"
        + (", double quantization" if double else "")
        + f"; the rest {base} {src}",
    )


def _fp8(qc: Mapping[str, Any], base: str, src: str) -> WeightFormat:
    """fp8 weights, with float32 scales per tensor or per block."""
    block = qc.get("weight_block_size")
    blk = (int(block[0]), int(block[1])) if isinstance(block, Sequence) and len(block) == 2 else None
    return WeightFormat(
        method="fp8",
        dtype=base,
        bits=8,
        block=blk,
        static_input_scale=str(qc.get("activation_scheme", "dynamic")) == "static",
        skip=_skips(qc, "modules_to_not_convert", "ignored_layers"),
        label="fp8: 8-bit, float32 scales "
        + (f"per {blk[0]}×{blk[1]} block" if blk else "per tensor")
        + f"; the rest {base} {src}",
    )


def _compressed_tensors(qc: Mapping[str, Any], base: str, src: str) -> WeightFormat:
    groups = qc.get("config_groups") or {}
    weights: Mapping[str, Any] = {}
    for group in groups.values() if isinstance(groups, Mapping) else ():
        if isinstance(group, Mapping) and isinstance(group.get("weights"), Mapping):
            weights = group["weights"]
            break
    if not weights:
        return WeightFormat(method="dtype", dtype=base, label=f"{base}: compressed-tensors without weight quantization")
    bits = int(weights.get("num_bits", 8))
    strategy = str(weights.get("strategy", "tensor"))
    block = weights.get("block_structure")
    blk = (int(block[0]), int(block[1])) if isinstance(block, Sequence) and len(block) == 2 else None
    fmt = str(qc.get("format", ""))
    ignore = _skips(qc, "ignore")
    kind = "float" if str(weights.get("type", "int")) == "float" else "int"
    return WeightFormat(
        method="compressed-tensors",
        dtype=base,
        bits=bits,
        group_size=int(weights.get("group_size") or 0),
        block=blk,
        strategy=strategy,
        packed=fmt == "pack-quantized",
        zero_points=not bool(weights.get("symmetric", True)),
        # Its targets are Linear modules: the head is one unless ignored.
        quantize_lm_head=not any(_matches("lm_head", p) for p in ignore),
        skip=ignore,
        label=f"compressed-tensors {kind}{bits}, {strategy} scales ({base})"
        + (", packed" if fmt == "pack-quantized" else "")
        + f"; the rest {base} {src}",
    )


def _override(config: ConfigLike, weight_dtype: str, base: str) -> WeightFormat:
    w = str(weight_dtype).lower().removeprefix("torch.")
    src = "(--weight-dtype)"
    plain = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    if w in plain or w in ("float32", "float16", "bfloat16"):
        name = plain.get(w, w)
        return WeightFormat(method="dtype", dtype=name, label=f"{name} {src}")
    # Quantized storage leaves the embeddings, head and norms in a 16-bit dtype: the model's, or
    # bfloat16 when the config names float32 (no quantizer keeps float32 beside 4-bit values).
    rest = base if dtype_bits(base) == 16 else "bfloat16"
    if w == "fp8":
        return WeightFormat(
            method="fp8", dtype=rest, bits=8, label=f"fp8: 8-bit, one float32 scale per tensor; the rest {rest} {src}"
        )
    if w == "int8":
        return WeightFormat(
            method="bnb",
            dtype=rest,
            bits=8,
            label=f"int8: int8 + a float32 scale per row (LLM.int8); the rest {rest} {src}",
        )
    if w == "nf4":
        return WeightFormat(
            method="bnb", dtype=rest, bits=4, label=f"nf4: bitsandbytes 4-bit, blocks of 64; the rest {rest} {src}"
        )
    if w == "int4":
        return WeightFormat(
            method="awq",
            dtype="float16",
            bits=4,
            group_size=128,
            zero_points=True,
            label="int4: 4-bit, groups of 128, float16 scales and zero points (AWQ layout; --weight-dtype)",
        )
    if w == "mxfp4":
        if not any(p.role == "expert" for p in parameters(config)):
            raise ConfigError(
                "weight_dtype 'mxfp4' quantizes MoE experts (as gpt-oss ships them, and as vLLM and transformers "
                "run it); this model has none: use int4, nf4, int8 or fp8"
            )
        return WeightFormat(
            method="mxfp4",
            dtype=rest,
            bits=4,
            experts_only=True,
            label=f"mxfp4: MoE experts in 4-bit with an 8-bit scale per 32 values, the rest {rest} {src}",
        )
    if w == "gguf":
        return WeightFormat(method="gguf", dtype=base, label="the GGUF file's own tensor types (--weight-dtype gguf)")
    raise ConfigError(
        f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)} (CLI: --weight-dtype), got {weight_dtype!r}"
    )


# --------------------------------------------------------------------------------------------
# One GPU of a tensor-parallel group
# --------------------------------------------------------------------------------------------


def _shape_per_rank(p: Param, tp: int, kv_heads: int) -> tuple[int, int]:
    """``(out, in)`` of ``p`` on one of ``tp`` GPUs."""
    out, inp = p.out_features, p.in_features
    if tp == 1 or p.split == "replicated":
        return out, inp
    if p.split == "row":
        return out, math.ceil(inp / tp)
    if p.split == "vocab":
        return math.ceil(math.ceil(out / 64) * 64 / tp), inp  # vLLM pads the vocabulary to 64s
    kv_part = 0
    if p.kv_rows:
        # Fewer KV heads than GPUs: each GPU keeps one whole KV head (vLLM replicates them).
        per_head = p.kv_rows // kv_heads
        kv_part = max(1, kv_heads // tp) * per_head
    return (out - p.kv_rows) // tp + kv_part, inp


def check_tensor_parallel(config: ConfigLike, tensor_parallel: int) -> None:
    """Refuse a tensor-parallel degree vLLM would refuse for this model: it must divide the
    attention heads, and the KV heads must divide it or be divisible by it."""
    if tensor_parallel <= 1:
        return
    c = ConfigView(text_config(config) if isinstance(config, Mapping) else normalize_config(config, False))
    heads = int(c.get("num_attention_heads", "n_head", "num_heads", default=0) or 0)
    kv = int(c.get("num_key_value_heads", "num_kv_heads", default=heads) or heads)
    if heads and heads % tensor_parallel:
        ok = [t for t in (2, 4, 8, 16) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
        raise ConfigError(
            f"tensor_parallel {tensor_parallel} does not divide the model's {heads} attention heads, which vLLM "
            f"requires; use {' or '.join(map(str, ok)) if ok else 'one GPU'}"
        )
    if c.get("kv_lora_rank") is None and kv and kv % tensor_parallel and tensor_parallel % kv:
        raise ConfigError(
            f"tensor_parallel {tensor_parallel} and the model's {kv} KV heads: one must divide the other "
            "(vLLM splits or replicates whole KV heads)"
        )


def weight_bytes(
    config: ConfigLike,
    fmt: WeightFormat | None = None,
    *,
    tensor_parallel: int = 1,
    params: Sequence[Param] | None = None,
) -> int:
    """Bytes of the weights of ``config`` stored as ``fmt`` (default: :func:`weight_format`) on one
    of ``tensor_parallel`` GPUs (module docstring).

    >>> cfg = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 1,
    ...     "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    ...     "torch_dtype": "bfloat16"}
    >>> weight_bytes(cfg), weight_bytes(cfg, tensor_parallel=2)
    (106880, 53632)
    """
    fmt = fmt or weight_format(config)
    if fmt.method == "gguf":
        raise ConfigError("a GGUF's bytes are its file's tensor table: use ragbudget.memory.models.gguf_metadata")
    check_tensor_parallel(config, tensor_parallel)
    params = parameters(config) if params is None else params
    c = ConfigView(text_config(config) if isinstance(config, Mapping) else normalize_config(config, False))
    heads = int(c.get("num_attention_heads", "n_head", "num_heads", default=1) or 1)
    kv_heads = int(c.get("num_key_value_heads", "num_kv_heads", default=heads) or heads)
    half = dtype_bits(fmt.dtype)
    total = 0
    for p in params:
        out, inp = _shape_per_rank(p, tensor_parallel, kv_heads)
        if fmt.quantizes(p):
            total += p.experts * fmt.tensor_bytes(out, inp)
        else:
            total += (p.experts * out * inp * half + 7) // 8
    return total


def rank_config(config: ConfigLike, tensor_parallel: int) -> ConfigLike:
    """The text config one of ``tensor_parallel`` GPUs runs: attention heads, KV heads (at least
    one: replicated below the degree), the MLP and expert intermediate sizes divided; ``head_dim``
    pinned to the whole model's. ``config`` itself on one GPU. For the KV cache and the
    activations of one GPU (:mod:`ragbudget.memory.kvcache`, :func:`ragbudget.memory.budget.estimate_activation_bytes`).

    >>> r = rank_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8,
    ...     "num_key_value_heads": 2, "intermediate_size": 128}, 4)
    >>> r["num_attention_heads"], r["num_key_value_heads"], r["head_dim"], r["intermediate_size"]
    (2, 1, 8, 32)
    """
    if tensor_parallel <= 1:
        return config
    check_tensor_parallel(config, tensor_parallel)
    if not isinstance(config, Mapping):
        d = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
        d.setdefault("model_type", getattr(config, "model_type", None))
        config = d
    d = dict(text_config(config))
    c = ConfigView(d)
    heads = int(c.get("num_attention_heads", "n_head", "num_heads"))
    kv = int(c.get("num_key_value_heads", "num_kv_heads", default=heads))
    hidden = int(c.get("hidden_size", "n_embd", "d_model"))
    hd = c.get("head_dim")
    d["head_dim"] = int(hd) if isinstance(hd, int) and hd > 0 else hidden // heads
    d["num_attention_heads"] = heads // tensor_parallel
    if c.get("kv_lora_rank") is None:  # MLA caches one latent per token: the same on every GPU
        d["num_key_value_heads"] = max(1, kv // tensor_parallel)
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if isinstance(d.get(key), int) and d[key] > 0:
            d[key] = max(1, d[key] // tensor_parallel)
    return d
