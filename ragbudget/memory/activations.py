"""Activations: the transient memory of a prefill forward, beside the weights
(:mod:`.weights`) and the KV cache (:mod:`.kvcache`), and cuBLAS's workspace.

Graded component by component against an H200's measurements by ``make gpu-check``
(bench/gpu_validate.py; BENCHMARKS.md, GPU validation); :func:`ragbudget.memory.budget.plan_budget`
sums the three, and a recorded calibration (:mod:`.calibration`) replaces this estimate.
"""

from __future__ import annotations

from ..types import dtype_bits
from .layers import layer_specs
from .model_config import ConfigLike, ConfigView, model_dtype, normalize_config

__all__ = ["CUBLAS_WORKSPACE_BYTES", "estimate_activation_bytes", "workspace_for"]


#: cuBLAS's workspaces: PyTorch allocates them through its caching allocator at the first matrix
#: products on a stream and keeps them for the life of the process, so they are part of every
#: forward's footprint: 32 MiB for cuBLAS on Hopper and later (cuBLAS's recommendation, PyTorch's
#: default there; about 8 MiB before Hopper) and 1 MiB for cuBLASLt (biased products). Measured
#: 33.0 MiB on an H200 by ``make gpu-check``; the Hopper figure is counted on every GPU.
CUBLAS_WORKSPACE_BYTES = 33 << 20


def _score_bytes(d: int, dtype: str) -> int:
    """Bytes alive per attention score at eager attention's peak, ``softmax(scores,
    dtype=float32).to(dtype)``: the scores stay referenced while the softmax runs. CUDA fuses the
    float16→float32 upcast into the softmax kernel, but not bfloat16's: a bfloat16 input is first
    copied to float32, so three tensors are alive (2 + 4 + 4 bytes; measured to 0.1% on an H200).
    float16 peaks at the cast back (2 + 4 + 2), float32 in the softmax (4 + 4)."""
    if dtype.lower() in ("bfloat16", "bf16"):
        return d + 4 + 4
    return d + 4 + (d if d < 4 else 0)


def estimate_activation_bytes(
    config: ConfigLike,
    tokens: int,
    *,
    batch_size: int = 1,
    dtype: str | None = None,
    attn_implementation: str = "sdpa",
    logits: str = "last",
    workspace_bytes: int = CUBLAS_WORKSPACE_BYTES,
) -> int:
    """Peak transient memory of one prefill forward of ``tokens`` tokens × ``batch_size``.

    A layer-local model of what is alive at once, at the larger of a layer's two peaks:

    - the MLP: four hidden-size streams (the embeddings, which the model's forward keeps until
      the last layer; the layer's input; the residual; its normed copy) and three intermediates
      (activated gate, up, their product);
    - attention: three streams, Q/K/V, and either the rotary embedding's transient copies of Q
      (``sdpa``/flash kernels tile the scores) or, ``"eager"``, K/V repeated to every head and
      the ``heads × L × L`` scores at the softmax's peak (:func:`_score_bytes`) with the additive
      float masks (one per attention type: full, sliding) that live for the whole forward;

    plus the rotary cos/sin, the logits (``"last"``: one float32 row per sequence, what
    ``generate`` keeps; ``"all"``: every position) and ``workspace_bytes``, cuBLAS's workspace
    (:data:`CUBLAS_WORKSPACE_BYTES`; 0 for a per-request share, since a process holds one, or off
    CUDA: :func:`workspace_for`). KV cache bytes are not included (:mod:`.kvcache`). Graded
    per component against measured peaks by ``make gpu-check`` (bench/gpu_validate.py);
    :func:`record_calibration` replaces the estimate with measurements of the model in use.
    """
    c = ConfigView(normalize_config(config, True))
    dtype_name = dtype or model_dtype(config)
    d = dtype_bits(dtype_name) // 8 or 1
    H = int(c.get("hidden_size", "n_embd", "d_model"))
    # Pure recurrent models (Mamba) have no attention: their mixer is sized like an MLP below.
    heads = int(c.get("num_attention_heads", "n_head", "num_heads", default=0))
    kv = int(c.get("num_key_value_heads", "num_kv_heads", default=heads))
    hd = c.get("head_dim")
    hd = int(hd) if isinstance(hd, int) and hd > 0 else (H // heads if heads else 0)
    inter = int(c.get("intermediate_size", "ffn_dim", default=0) or 4 * H)
    experts = c.get("num_local_experts", "n_routed_experts", "num_experts")
    if experts:
        mI = int(c.get("moe_intermediate_size", default=inter))
        topk = int(c.get("num_experts_per_tok", default=2))
        inter = max(mI * topk, inter if c.get("first_k_dense_replace") else 0)
    V = int(c.get("vocab_size", default=32000))
    bt = batch_size * tokens
    stream = bt * H * d
    q = bt * heads * hd * d
    qkv = bt * (heads + 2 * kv) * hd * d
    sliding = any(s.kind == "sliding_attention" for s in layer_specs(c.obj, normalize=False))
    l2 = batch_size * tokens * tokens
    mlp = 4 * stream + 3 * bt * inter * d
    if attn_implementation == "eager":
        attn = 3 * stream + qkv + 2 * q + l2 * heads * _score_bytes(d, dtype_name)
        masks = l2 * d * (2 if sliding else 1)
    else:
        attn = 3 * stream + qkv + 3 * q  # q, k, v and the rotary embedding's copies of q
        # Causal full attention needs no mask (is_causal); sliding layers get a boolean one.
        masks = l2 if sliding else 0
    rotary = 2 * bt * hd * d  # cos and sin, shared by every layer
    logit_rows = batch_size if logits == "last" else bt
    logits_bytes = logit_rows * V * (d + 4)  # lm_head output + float32 copy in generate
    return int(max(attn, mlp) + masks + rotary + logits_bytes + workspace_bytes)


def workspace_for(gpu_source: str) -> int:
    """cuBLAS's workspace for a plan against memory from ``gpu_source``
    (:attr:`~ragbudget.gpus.GPUInfo.source`): none when it is host RAM (no cuBLAS there)."""
    return 0 if gpu_source.startswith("host RAM") else CUBLAS_WORKSPACE_BYTES
