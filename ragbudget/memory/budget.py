"""The GPU memory budget: how many tokens one request may hold, at what concurrency.

    usable   = gpu_bytes × utilization            (0.9 by default, like vLLM)
    needed   = weights + activations(prefill) + KV(peak, concurrency × context)
    max_context_tokens = the largest context (prompt + generated) per request with needed ≤ usable,
                         capped by the model's max_position_embeddings

Weights come from a loaded model (parameter + buffer bytes), local safetensors headers, or the
parameter count implied by the config × the weight dtype. Activations are a prefill-peak
estimate (see :func:`estimate_activation_bytes`), replaced by a measured value once a real CUDA run
was recorded (:mod:`ragbudget.memory.calibration`). KV is exact per layer type
(:mod:`ragbudget.memory.kvcache`). On a CPU host the prompt is further capped to what the measured
prefill speed allows within a time-to-first-token target (:func:`cap_plan_for_time`).

>>> plan = plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="RTX 4090")
>>> plan.kv_bytes_per_token, plan.limited_by
(131072, 'memory')
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BudgetError, ConfigError, ModelError
from ..gpus import GiB, GPUInfo, resolve_gpu
from ..settings import MemorySettings, check_int, check_number
from ..types import dtype_bits
from . import calibration as _calibration
from .activations import CUBLAS_WORKSPACE_BYTES, estimate_activation_bytes, workspace_for
from .kvcache import estimate_kv, kv_bytes_per_token
from .layers import LayerSpec, layer_specs
from .model_config import ConfigLike, ConfigView, model_dtype, normalize_config, text_config
from .schedule import MemoryModel


# The measurements lived here before the memory model was split along its seams (issue #32).
# The package imports them from their owner, ragbudget.memory.calibration; code outside that
# imported them from here still gets the very same objects, with a DeprecationWarning (as
# ragbudget/_compat.py does for moved modules).
def __getattr__(name: str) -> Any:
    if name in _calibration.__all__:  # the names that lived here are calibration's public ones
        import warnings

        warnings.warn(
            f"ragbudget.memory.budget.{name} moved to ragbudget.memory.calibration.{name}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_calibration, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from .paged import PagedCacheLayout
    from .weights import WeightFormat

__all__ = [
    "BudgetPlan",
    "cap_plan_for_time",
    "count_parameters",
    "CUBLAS_WORKSPACE_BYTES",
    "estimate_activation_bytes",
    "workspace_for",
    "estimate_weights_bytes",
    "plan_budget",
    "request_memory",
]

# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _meta_parameter_count(config: ConfigLike) -> int:
    """Parameters of the model transformers builds from ``config``, on the meta device (no
    memory, no weights); shared (tied) parameters count once."""
    import torch  # lazy: heavy imports
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if isinstance(config, Mapping):
        d = dict(config)
        model_type = d.pop("model_type", None)
        for k in ("architectures", "auto_map", "transformers_version", "_name_or_path", "quantization_config"):
            d.pop(k, None)
        try:
            config = AutoConfig.for_model(model_type, **d)
        except Exception as exc:  # unknown model type or fields it rejects
            raise ModelError(
                f"cannot count the parameters of a {model_type!r} config ({exc}); pass "
                "weights_bytes= or a model whose weights can be read"
            ) from exc
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # transformers ships it untyped
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # untyped in transformers
    except Exception as exc:  # transformers cannot build it
        raise ModelError(
            f"cannot build {type(config).__name__} to count its parameters ({exc}); pass weights_bytes= instead"
        ) from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    return sum(p.numel() for p in model.parameters())


def count_parameters(config: ConfigLike) -> int:
    """Parameters of a decoder-only LM from its config: the sum of
    :func:`ragbudget.memory.weights.parameters` (embeddings, attention incl. MLA, dense or MoE MLP, norms,
    untied head). Exact for Llama/Mistral/Qwen2/Qwen3/Gemma/Mixtral-style models (checked in
    tests); an estimate for other families (biases and norm details differ). Recurrent/hybrid
    models are counted exactly by building them on the meta device.

    >>> count_parameters({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
    ...     "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32})
    6738415616
    """
    from .weights import has_recurrent, parameters

    c = ConfigView(text_config(config) if isinstance(config, Mapping) else normalize_config(config, False))
    if c.get("num_attention_heads", "n_head", "num_heads") is None or has_recurrent(config):
        # Recurrent and hybrid families (Mamba, Jamba, Falcon-H1, Nemotron-H, …) have mixers
        # the role list does not know: count what transformers would build.
        return _meta_parameter_count(config)
    return sum(p.numel for p in parameters(config))


def estimate_weights_bytes(config: ConfigLike, *, weight_dtype: str | None = None, tensor_parallel: int = 1) -> int:
    """Weight bytes of ``config`` on one of ``tensor_parallel`` GPUs, stored as the checkpoint
    says (its ``quantization_config``, else the model dtype) or as ``weight_dtype`` overrides
    (:data:`ragbudget.memory.weights.WEIGHT_DTYPES`: ``"bf16"``, ``"int4"``, ``"nf4"``, ``"fp8"``, …),
    scales, zero points and unquantized modules included (:mod:`ragbudget.memory.weights`).

    >>> from ragbudget.memory.models import load_model_config
    >>> round(estimate_weights_bytes(load_model_config("openai/gpt-oss-20b")) / 2**30, 2)  # MXFP4 experts
    12.82
    """
    from .weights import has_recurrent, weight_bytes, weight_format

    fmt = weight_format(config, weight_dtype)
    if has_recurrent(config):  # no role list: every parameter at the format's unquantized width
        if tensor_parallel > 1:
            raise ConfigError("tensor-parallel planning covers attention models; this one has recurrent layers")
        return (count_parameters(config) * dtype_bits(fmt.dtype) + 7) // 8
    return weight_bytes(config, fmt, tensor_parallel=tensor_parallel)


def _module_bytes(model: Any) -> int:  # Any: a torch module (torch loads lazily)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return int(params + sum(b.numel() * b.element_size() for b in model.buffers()))


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetPlan:
    """What fits: bytes, tokens and concurrency for one model on one GPU. Sizes are bytes."""

    model: str
    gpu_name: str
    gpu_source: str
    gpu_bytes: int
    usable_bytes: int
    utilization: float
    weights_bytes: int
    weights_source: str
    activation_bytes: int
    activation_source: str
    kv_bytes_per_token: int
    kv_bytes_per_token_peak: int
    kv_fixed_bytes_per_sequence: int
    kv_capacity_tokens: int
    max_context_tokens: int
    max_prompt_tokens: int
    max_new_tokens: int
    concurrency: int
    max_concurrency: int
    concurrency_context_tokens: int
    model_max_tokens: int
    limited_by: str
    cache: str
    kv_dtype: str
    backend: str
    kv_bytes_at_max: int
    free_bytes_at_max: int
    concurrency_curve: tuple[tuple[int, int], ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: The attention implementation the activations were estimated for.
    attn_implementation: str = "sdpa"
    #: Set by :func:`cap_plan_for_time`: the time-to-first-token target and the prompt tokens
    #: the measured prefill speed allows in it; ``memory_max_context_tokens`` is what memory and
    #: the window alone allow (the figure before the time cap).
    ttft_target_s: float | None = None
    time_prompt_tokens: int | None = None
    memory_max_context_tokens: int | None = None
    #: GPUs the model is split over (vLLM's tensor parallelism); byte figures are one GPU's.
    tensor_parallel: int = 1
    #: Bytes per GPU set aside for NCCL and the custom all-reduce (0 on one GPU).
    comm_reserve_bytes: int = 0
    #: How the weights are stored, in words (:attr:`ragbudget.memory.weights.WeightFormat.label`).
    weight_format: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples become lists)."""
        d = asdict(self)
        d["concurrency_curve"] = [list(x) for x in self.concurrency_curve]
        d["notes"] = list(self.notes)
        return d


def _model_max(cfg: ConfigLike) -> int:
    c = ConfigView(text_config(cfg) if isinstance(cfg, Mapping) else cfg)
    v = c.get("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx", default=None)
    return int(v) if v else 4096


def _resolve_model(model: Any, config: ConfigLike) -> tuple[str, ConfigLike, Any]:
    """(name, config, loaded module or None). ``Any``: a model is a name, a path or a loaded
    transformers module (torch and transformers load lazily and type their modules loosely)."""
    module = None
    if model is not None and not isinstance(model, (str, os.PathLike)):
        module = model
        config = config if config is not None else getattr(model, "config", None)
        name = getattr(config, "_name_or_path", None) or type(model).__name__
        if config is None:
            raise ConfigError("a loaded model without .config: pass config=")
        return str(name), config, module
    if config is not None:
        name = str(model) if model is not None else str(ConfigView(config).get("_name_or_path", default="config"))
        return name, config, None
    from .models import load_model_config

    cfg = load_model_config(None if model is None else str(model))
    name = str(model) if model is not None else str(cfg.get("_name_or_path", "default"))
    return name, cfg, None


def plan_budget(
    model: Any = None,  # a name, a path or a loaded transformers module (see _resolve_model)
    *,
    # The memory settings' defaults, read from their one definition (MemorySettings), so the
    # library, the pipeline and the CLI plan alike when nothing is given.
    gpu: str | int | None = MemorySettings.gpu,
    concurrency: int = MemorySettings.concurrency,
    max_new_tokens: int = MemorySettings.max_new_tokens,
    context_tokens: int | None = None,
    kv_dtype: str | None = MemorySettings.kv_dtype,
    cache: str = MemorySettings.cache,
    weights_bytes: int | None = None,
    weight_dtype: str | None = None,
    utilization: float = MemorySettings.utilization,
    backend: str = "transformers",
    config: ConfigLike = None,
    attn_implementation: str = "sdpa",
    max_cache_len: int | None = None,
    tensor_parallel: int | None = None,
) -> BudgetPlan:
    """Plan the memory budget of ``model`` (hub id, shipped name, local path, loaded module, or
    ``None`` for the default generator) on ``gpu`` (see :func:`ragbudget.gpus.resolve_gpu`).

    Weights are stored as the checkpoint's ``quantization_config`` says (GPTQ, AWQ, bitsandbytes,
    FP8, compressed-tensors, MXFP4), or as ``weight_dtype`` overrides (``"int4"``, ``"nf4"``,
    ``"fp8"``, ``"bf16"``, ``"gguf"``, …: :data:`ragbudget.memory.weights.WEIGHT_DTYPES`).
    ``tensor_parallel`` GPUs (default: as many as ``gpu`` names, ``"2xH100"``) are planned the way
    vLLM shards a model: every figure in bytes is one GPU's (its share of the weights, of the KV
    heads and of the activations, less a reserve for NCCL and the custom all-reduce), every
    figure in tokens the whole group's.

    Raises :class:`~ragbudget.errors.BudgetError` when not even ``max_new_tokens`` + 1 tokens fit
    for ``concurrency`` requests, saying what was needed, what is available and what to change.

    >>> p = plan_budget("Qwen/Qwen3-8B", gpu="24GiB", concurrency=4, max_new_tokens=512)
    >>> p.max_prompt_tokens == p.max_context_tokens - 512
    True
    >>> plan_budget("meta-llama/Llama-3.1-70B-Instruct", gpu="2xH100").tensor_parallel
    2
    """
    # The settings' own checks (one definition of each): a wrong type is a one-line
    # ArgumentTypeError naming the argument, not a comparison's TypeError, and a fractional
    # max_new_tokens is refused rather than planned with.
    u = check_number("utilization", utilization, 0.0, 1.0, lo_open=True)
    c, m = check_int("concurrency", concurrency, 1), check_int("max_new_tokens", max_new_tokens, 1)
    assert u is not None and c is not None and m is not None  # None only where optional=True
    utilization, concurrency, max_new_tokens = u, c, m
    s = _size_gpu(model, config, gpu, tensor_parallel, kv_dtype, weights_bytes, weight_dtype, utilization, backend)
    # A calibration was measured on one GPU holding the whole model: not a shard's activations.
    cal = _calibration.lookup_calibration(s.gpu.name, s.name, s.kv_dtype, cache) if s.tp == 1 else None
    d = _Demand(s, cache, backend, attn_implementation, max_cache_len, cal)
    if s.weights >= s.usable:
        where = f"{s.gpu.name}" if s.tp == 1 else f"each of {s.tp} × {s.gpu.name} (tensor parallel)"
        raise BudgetError(
            f"{s.name}: the weights alone need {s.weights / GiB:.2f} GiB ({s.weights_source}) but only "
            f"{s.usable / GiB:.2f} GiB is usable ({utilization:.0%} of {s.gpu.bytes / GiB:.2f} GiB on {where}"
            + (f", less {s.reserve / GiB:.2f} GiB for NCCL" if s.reserve else "")
            + "); plan quantized storage (weight_dtype='int4', 'fp8', 'nf4'; CLI --weight-dtype int4), "
            "split it over several GPUs (tensor_parallel=2; CLI --gpu 2xNAME), or use a smaller model "
            "or a larger GPU",
            needed=s.weights,
            available=max(0, s.usable),
            unit="bytes",
            limit="memory",
        )
    t_mem = d.max_tokens(concurrency, 1 << 24)
    max_ctx = min(t_mem, s.model_max)
    limited_by = "model" if t_mem >= s.model_max else "memory"
    d.check_new_tokens_fit(concurrency, max_new_tokens, max_ctx)
    return d.budget_plan(concurrency, max_new_tokens, context_tokens, max_ctx, limited_by)


@dataclass(frozen=True)
class _GpuSizing:
    """One GPU's share of a plan: its memory (``gpu.bytes`` as planned against), weights, model, notes."""

    name: str
    config: ConfigLike
    gpu: GPUInfo
    utilization: float
    reserve: int
    usable: int
    tp: int
    weights: int
    weights_source: str
    weight_format: str
    model_max: int
    norm: ConfigLike
    specs: tuple[LayerSpec, ...]
    kv_dtype: str
    notes: tuple[str, ...]


def _size_gpu(
    model: Any,  # as plan_budget's: a name, a path or a loaded transformers module
    config: ConfigLike,
    gpu: str | int | None,
    tensor_parallel: int | None,
    kv_dtype: str | None,
    weights_bytes: int | None,
    weight_dtype: str | None,
    utilization: float,
    backend: str,
) -> _GpuSizing:
    """Resolve the model and the GPU, and size one GPU's share: KV dtype, weights, usable memory."""
    from .weights import comm_reserve_bytes, rank_config, weight_format

    name, cfg, module = _resolve_model(model, config)
    info: GPUInfo = resolve_gpu(gpu)
    tp = _tensor_parallel(tensor_parallel, info, module)
    notes = list(info.notes)
    kvd = kv_dtype or model_dtype(cfg)
    if module is not None and kv_dtype is None:
        kvd = str(getattr(module, "dtype", kvd)).removeprefix("torch.")
    elif kv_dtype is None and not model_dtype(cfg, default=""):
        # Over-estimate rather than under: without a dtype transformers allocates float32.
        notes.append(
            "the model config names no dtype: planned at float32, what transformers "
            "allocates without one (pass kv_dtype/weight_dtype, or --kv-dtype, for the "
            "dtype you load it in)"
        )
    # One GPU of a tensor-parallel group runs its share of the heads and of the MLP: its KV cache
    # and its activations are those of that narrower model (the token figures stay the group's).
    norm = normalize_config(rank_config(cfg, tp), True)
    specs = layer_specs(norm, backend=backend, normalize=False)
    fmt = weight_format(cfg, weight_dtype) if module is None or weight_dtype is not None else None
    if weights_bytes is not None:
        wbytes, wsrc = -(-int(weights_bytes) // tp), ("explicit" if tp == 1 else f"explicit ÷ {tp} GPUs")
    elif module is not None:
        wbytes, wsrc = _module_bytes(module), "loaded model (parameters + buffers)"
    else:
        assert fmt is not None
        wbytes, wsrc = _planned_weights(model, cfg, fmt, weight_dtype, tp, notes)
    gpu_bytes = _gpu_bytes_with_model(info, module, notes)
    # vLLM sizes its KV cache from utilization × memory less what its profile run saw outside
    # PyTorch; with several GPUs that includes NCCL's and the custom all-reduce's buffers.
    reserve = comm_reserve_bytes(tp)
    return _GpuSizing(
        name=name,
        config=cfg,
        gpu=replace(info, bytes=gpu_bytes),
        utilization=utilization,
        reserve=reserve,
        usable=int(gpu_bytes * utilization) - reserve,
        tp=tp,
        weights=wbytes,
        weights_source=wsrc,
        weight_format="loaded model" if fmt is None or module is not None else fmt.label,
        model_max=_model_max(cfg),
        norm=norm,
        specs=specs,
        kv_dtype=kvd,
        notes=tuple(notes),
    )


def _gpu_bytes_with_model(info: GPUInfo, module: Any, notes: list[str]) -> int:  # Any: torch module
    """The GPU's bytes to plan against, a loaded model's own bytes added back where they were read."""
    gpu_bytes = info.bytes
    # Free CUDA memory, like available host RAM, was read with the model loaded: add its own
    # bytes on that device back, or they would be subtracted twice (as weights and as used).
    resident = {
        "cuda:0 free memory": ("cuda", "on the GPU", "free memory"),
        "host RAM (no GPU)": ("cpu", "in RAM", "available memory"),
    }.get(info.source)
    if module is not None and resident is not None:
        device, where, figure = resident
        loaded = sum(
            t.numel() * t.element_size()
            for t in list(module.parameters()) + list(module.buffers())
            if t.device.type == device
        )
        if loaded:
            gpu_bytes += loaded
            notes.append(
                f"the loaded model's {loaded / GiB:.2f} GiB {where} counted as available to it ({figure} excludes them)"
            )
    return gpu_bytes


@dataclass(frozen=True)
class _Demand:
    """What requests need on a sized GPU (activation and KV bytes), what fits of them, and the plan."""

    sizing: _GpuSizing
    cache: str
    backend: str
    attn_implementation: str
    max_cache_len: int | None
    cal: dict[str, Any] | None

    def act(self, tokens: int, batch: int) -> int:
        """Activation bytes of a prefill of ``batch`` × ``tokens``: calibrated, else estimated."""
        if self.cal is not None:
            return int(self.cal["activation_bytes_per_token"] * tokens * batch)
        return estimate_activation_bytes(
            self.sizing.norm,
            tokens,
            batch_size=batch,
            dtype=self.sizing.kv_dtype,
            attn_implementation=self.attn_implementation,
            workspace_bytes=workspace_for(self.sizing.gpu.source),
        )

    def kv(self, tokens: int, batch: int) -> int:
        """Peak KV bytes of ``batch`` sequences of ``tokens``."""
        mcl = self.max_cache_len if self.cache == "static" and self.max_cache_len else tokens
        return estimate_kv(
            self.sizing.norm,
            tokens,
            batch_size=batch,
            kv_dtype=self.sizing.kv_dtype,
            cache=self.cache,
            backend=self.backend,
            max_cache_len=mcl,
            normalize=False,
        ).peak_bytes

    def needed(self, tokens: int, batch: int) -> int:
        """Weights, activations and KV of ``batch`` requests of ``tokens`` each."""
        return self.sizing.weights + self.act(tokens, batch) + self.kv(tokens, batch)

    def max_tokens(self, batch: int, cap: int) -> int:
        """The most tokens per request, at most ``cap``, for ``batch`` requests (0: not one)."""
        if self.needed(1, batch) > self.sizing.usable:
            return 0
        lo, hi = 1, cap
        if self.needed(hi, batch) <= self.sizing.usable:
            return hi
        while lo < hi:  # largest t with needed(t) <= usable
            mid = (lo + hi + 1) // 2
            if self.needed(mid, batch) <= self.sizing.usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def max_concurrency(self, target: int) -> int:
        """The most requests of ``target`` tokens each that fit together (0: not one)."""
        if self.needed(target, 1) > self.sizing.usable:
            return 0
        lo, hi = 1, 1
        while self.needed(target, hi * 2) <= self.sizing.usable and hi < (1 << 20):
            hi *= 2
        lo, hi = hi, hi * 2
        while lo < hi - 1:
            mid = (lo + hi) // 2
            if self.needed(target, mid) <= self.sizing.usable:
                lo = mid
            else:
                hi = mid
        return lo

    def curve(self, concurrency: int, max_new_tokens: int) -> tuple[tuple[int, int], ...]:
        """(requests, context tokens) at 1, 2, 4, … requests while ``max_new_tokens`` + 1 fit."""
        curve = []
        n = 1
        while n <= max(concurrency, 1 << 10):
            t = min(self.max_tokens(n, 1 << 24), self.sizing.model_max)
            if t < max_new_tokens + 1:
                break
            curve.append((n, t))
            n *= 2
        return tuple(curve)

    def check_new_tokens_fit(self, concurrency: int, max_new_tokens: int, max_ctx: int) -> None:
        """Raise :class:`BudgetError` when ``max_new_tokens`` + 1 exceed the window or the memory."""
        s = self.sizing
        if max_new_tokens + 1 > s.model_max:
            # The window binds whatever the memory: say so, and not "buy a bigger GPU".
            raise BudgetError(
                f"max_new_tokens {max_new_tokens:,} does not fit the model window: {s.name} reads at "
                f"most {s.model_max:,} tokens (max_position_embeddings), prompt and answer together; "
                f"lower max_new_tokens (--max-new-tokens) to at most {s.model_max - 1:,} minus the "
                "prompt, or use a model with a longer window",
                needed=max_new_tokens + 1,
                available=s.model_max,
                unit="tokens",
                limit="window",
            )
        if max_ctx < max_new_tokens + 1:
            need = self.needed(max_new_tokens + 1, concurrency)
            raise BudgetError(
                f"{s.name} on {s.gpu.name}: {concurrency} request(s) of {max_new_tokens + 1} tokens need "
                f"{need / GiB:.2f} GiB (weights {s.weights / GiB:.2f} + activations "
                f"{self.act(max_new_tokens + 1, concurrency) / GiB:.2f} + KV "
                f"{self.kv(max_new_tokens + 1, concurrency) / GiB:.2f}) but {s.usable / GiB:.2f} GiB is "
                f"usable, so memory holds {max_ctx:,} tokens per request; lower max_new_tokens or "
                "concurrency, use kv_dtype='fp8' or a quantized/offloaded cache, or a smaller model",
                needed=max_new_tokens + 1,
                available=max_ctx,
                unit="tokens",
                limit="memory",
            )

    def budget_plan(
        self, concurrency: int, max_new_tokens: int, context_tokens: int | None, max_ctx: int, limited_by: str
    ) -> BudgetPlan:
        """The :class:`BudgetPlan` at ``max_ctx`` tokens per request: capacity, concurrency, KV, notes."""
        s = self.sizing
        t_one = self.max_tokens(1, 1 << 24)
        # Concurrency at the target context (or at the model maximum).
        target = context_tokens if context_tokens is not None else s.model_max
        max_conc = self.max_concurrency(target)
        curve = self.curve(concurrency, max_new_tokens)
        norm, kvd, backend, attn = s.norm, s.kv_dtype, self.backend, self.attn_implementation
        est_max = estimate_kv(
            norm,
            max_ctx,
            batch_size=concurrency,
            kv_dtype=kvd,
            cache=self.cache,
            backend=backend,
            max_cache_len=self.max_cache_len or max_ctx,
            normalize=False,
        )
        act_at_max = self.act(max_ctx, concurrency)
        act_src = "calibrated (measured on this GPU)" if self.cal is not None else f"estimate ({attn} prefill)"
        per_tok = kv_bytes_per_token(norm, kv_dtype=kvd, backend=backend, normalize=False)
        per_tok_peak = kv_bytes_per_token(norm, kv_dtype=kvd, backend=backend, normalize=False, include_sliding=True)
        fixed = estimate_kv(norm, 0, kv_dtype=kvd, cache="dynamic", backend=backend, normalize=False).steady_bytes
        notes = list(s.notes)
        if any(spec.kind == "sliding_attention" for spec in s.specs) and self.cache == "dynamic":
            notes.append(
                "sliding-window layers pin the whole prefill until the first decode step "
                "(transformers DynamicSlidingWindowLayer): the budget uses that peak"
            )
        if self.cache == "quantized":
            notes.append("quantized cache (quanto/hqq): an upper bound, the residual window is counted full")
        if limited_by == "model":
            notes.append(f"context capped by the model's max_position_embeddings ({s.model_max})")
        if s.tp > 1:
            notes.append(_tp_note(s.config, s.tp, s.reserve))
        return BudgetPlan(
            model=s.name,
            gpu_name=s.gpu.name,
            gpu_source=s.gpu.source,
            gpu_bytes=s.gpu.bytes,
            usable_bytes=s.usable,
            utilization=s.utilization,
            weights_bytes=s.weights,
            weights_source=s.weights_source,
            activation_bytes=act_at_max,
            activation_source=act_src,
            kv_bytes_per_token=per_tok,
            kv_bytes_per_token_peak=per_tok_peak,
            kv_fixed_bytes_per_sequence=fixed,
            kv_capacity_tokens=t_one,
            max_context_tokens=max_ctx,
            max_prompt_tokens=max_ctx - max_new_tokens,
            max_new_tokens=max_new_tokens,
            concurrency=concurrency,
            max_concurrency=max_conc,
            concurrency_context_tokens=target,
            model_max_tokens=s.model_max,
            limited_by=limited_by,
            cache=self.cache,
            kv_dtype=kvd,
            backend=backend,
            kv_bytes_at_max=est_max.peak_bytes,
            free_bytes_at_max=max(0, s.usable - s.weights - act_at_max - est_max.peak_bytes),
            concurrency_curve=curve,
            notes=tuple(notes),
            attn_implementation=attn,
            tensor_parallel=s.tp,
            comm_reserve_bytes=s.reserve,
            weight_format=s.weight_format,
        )


def _tensor_parallel(tensor_parallel: int | None, info: GPUInfo, module: Any) -> int:  # Any: torch module
    """The tensor-parallel degree: as given, else as many GPUs as ``gpu`` names; the two must
    agree, and a loaded model (one device) has none."""
    if tensor_parallel is None:
        tp = info.count
    else:
        tp = int(check_int("tensor_parallel", tensor_parallel, 1) or 1)
        if info.count > 1 and info.count != tp:
            raise ConfigError(
                f"gpu names {info.count} × {info.name} but tensor_parallel is {tp}; give one of them "
                f"(--gpu '{tp}x{info.name}' alone, or --tensor-parallel {info.count})"
            )
    if tp > 1 and module is not None:
        raise ConfigError(
            f"a loaded model runs on one device: plan tensor parallelism ({tp} GPUs) from its name or config"
        )
    return tp


def _planned_weights(
    model: object, cfg: ConfigLike, fmt: WeightFormat, weight_dtype: str | None, tp: int, notes: list[str]
) -> tuple[int, str]:
    """Weight bytes on one GPU, and where they come from: a local checkpoint's safetensors headers
    (exact, quantized or not), a GGUF's tensor table (``weight_dtype="gguf"``), else the
    parameters stored as ``fmt`` (:mod:`ragbudget.memory.weights`)."""
    gguf = isinstance(cfg, Mapping) and bool(cfg.get("_gguf_file"))
    per_gpu = "" if tp == 1 else f", per GPU of {tp}"
    if fmt.method == "gguf":
        if not gguf:
            raise ConfigError(
                "weight_dtype 'gguf' plans a .gguf file's own tensor types; this model is not a GGUF "
                "(pass --model FILE.gguf, or another --weight-dtype)"
            )
        if tp > 1:
            raise ConfigError(
                "a GGUF is planned on one device (llama.cpp splits layers, not tensors): drop tensor_parallel"
            )
        return int(cfg["_gguf_tensor_bytes"]), "GGUF tensor table (its own quantized types, as llama.cpp keeps them)"
    local = Path(str(model)).expanduser() if isinstance(model, (str, os.PathLike)) else None
    if local is not None and local.exists() and weight_dtype in (None, "auto") and not gguf:
        from .models import weights_bytes_from_files

        files = weights_bytes_from_files(local)
        if files is not None:
            if tp == 1:
                return files, "safetensors headers"
            # The files are the whole model; one GPU's share follows the shard of the format.
            share = estimate_weights_bytes(cfg, weight_dtype=weight_dtype, tensor_parallel=tp)
            whole = estimate_weights_bytes(cfg, weight_dtype=weight_dtype)
            return -(-files * share // max(1, whole)), f"safetensors headers × this GPU's share{per_gpu}"
    wbytes = estimate_weights_bytes(cfg, weight_dtype=weight_dtype, tensor_parallel=tp)
    if gguf:
        notes.append(
            f"GGUF weights are dequantized by transformers when loaded: planned at {fmt.dtype}, not the GGUF "
            "file size (weight_dtype='gguf', --weight-dtype gguf, plans the file's own types, as llama.cpp keeps them)"
        )
    if "not modelled" in fmt.label:
        notes.append(f"weights: {fmt.label}")
    return wbytes, f"parameter count × {fmt.label}{per_gpu}"


def _tp_note(cfg: ConfigLike, tp: int, reserve: int) -> str:
    c = ConfigView(text_config(cfg) if isinstance(cfg, Mapping) else cfg)
    heads = int(c.get("num_attention_heads", "n_head", default=0) or 0)
    kv = int(c.get("num_key_value_heads", "num_kv_heads", default=heads) or heads)
    if c.get("kv_lora_rank") is not None:
        kv_text = "the MLA latent cache whole on each (it has no heads to split)"
    elif kv < tp:
        kv_text = f"1 of the {kv} KV heads on each, replicated {tp // kv}× (fewer KV heads than GPUs)"
    else:
        kv_text = f"{kv // tp} of the {kv} KV heads each"
    return (
        f"tensor parallel over {tp} GPUs (vLLM's sharding): bytes are per GPU, tokens the whole group's; "
        f"{heads // tp if heads else '?'} of {heads} attention heads and {kv_text}; "
        f"{reserve / 2**20:,.0f} MiB per GPU set aside for NCCL and the custom all-reduce"
    )


def cap_plan_for_time(plan: BudgetPlan, speed: Mapping[str, Any], ttft_target: float) -> BudgetPlan:
    """``plan`` with its prompt capped to what a prefill of ``ttft_target`` seconds allows at the
    measured ``speed`` (:func:`measure_prefill_speed`), when that is less than memory and the
    window allow: ``limited_by`` becomes ``"time"`` and a note says so, and
    ``memory_max_context_tokens`` keeps the memory figure. A cap above the memory one only
    records the target and its tokens.

    >>> p = plan_budget("Qwen/Qwen3-8B", gpu="24GiB", max_new_tokens=256)
    >>> q = cap_plan_for_time(p, {"a": 0.001, "b": 0.0}, 2.0)
    >>> q.limited_by, q.max_prompt_tokens, q.max_context_tokens
    ('time', 2000, 2256)
    """
    from dataclasses import replace

    if ttft_target <= 0:
        return plan
    prompt = _calibration.context_tokens_for_time(speed, float(ttft_target))
    if prompt >= plan.max_prompt_tokens:  # the target does not bind: memory or the window does
        return replace(plan, ttft_target_s=float(ttft_target), time_prompt_tokens=prompt)
    rate = prompt / ttft_target
    note = (
        f"prompt capped at {prompt:,} tokens for time: {ttft_target:g} s to the first token at "
        f"the measured prefill speed (~{rate:,.0f} tokens/s); memory allows "
        f"{plan.max_prompt_tokens:,} (ttft_target / --ttft-target to change)"
    )
    return replace(
        plan,
        max_context_tokens=prompt + plan.max_new_tokens,
        max_prompt_tokens=prompt,
        limited_by="time",
        ttft_target_s=float(ttft_target),
        time_prompt_tokens=prompt,
        memory_max_context_tokens=plan.max_context_tokens,
        notes=(*plan.notes, note),
    )


def request_memory(
    plan: BudgetPlan, config: ConfigLike = None, *, paged: PagedCacheLayout | None = None
) -> MemoryModel:
    """What one request pins by ``plan``, for :class:`~ragbudget.memory.admission.AdmissionController`:
    the memory left beside the weights, the KV bytes per token at their peak (sliding-window
    layers hold the whole prefill until the first decode step) plus per sequence, and the
    activation peak of a prefill of the request's own prompt — measured per token when a
    calibration was recorded, else :func:`estimate_activation_bytes` with the plan's attention
    implementation (``eager`` materializes the L×L scores, so a long prompt costs far more).

    ``paged``: generation is batched over this paged cache (allocated up front, so resident
    whatever runs). Its bytes leave the memory beside the weights, and the model counts each
    request's KV in tokens against the cache (whole pages) and only its activations in bytes."""
    cfg = config
    if cfg is None:
        from .models import load_model_config

        cfg = load_model_config(plan.model)
    norm = normalize_config(cfg, True)
    cal = _calibration.lookup_calibration(plan.gpu_name, plan.model, plan.kv_dtype, plan.cache)
    attn = plan.attn_implementation

    def activation(tokens: int) -> int:
        if tokens <= 0:
            return 0
        if cal is not None:
            return int(cal["activation_bytes_per_token"] * tokens)
        # The process's one cuBLAS workspace is taken out of the capacity below, not per request.
        return estimate_activation_bytes(norm, tokens, dtype=plan.kv_dtype, attn_implementation=attn, workspace_bytes=0)

    source = (
        f"{plan.gpu_source}: {plan.usable_bytes / GiB:.2f} GiB usable − weights "
        f"{plan.weights_bytes / GiB:.2f} GiB; per request KV "
        f"{plan.kv_bytes_per_token_peak:,} B/token + activations of its own prefill "
        f"({'calibrated' if cal is not None else f'{attn} estimate'})"
    )
    free = plan.usable_bytes - plan.weights_bytes - (0 if cal is not None else workspace_for(plan.gpu_source))
    if paged is None:
        return MemoryModel(
            capacity_bytes=max(1, free),
            kv_bytes_per_token=plan.kv_bytes_per_token_peak,
            kv_fixed_bytes=plan.kv_fixed_bytes_per_sequence,
            activation=activation,
            source=source,
        )
    source = (
        f"{plan.gpu_source}: {plan.usable_bytes / GiB:.2f} GiB usable − weights "
        f"{plan.weights_bytes / GiB:.2f} GiB − paged KV cache {paged.total_bytes / GiB:.2f} "
        f"GiB; per request its KV in the paged cache ({paged.capacity_tokens:,} tokens, "
        f"pages of {paged.page_size}) + activations of its own prefill "
        f"({'calibrated' if cal is not None else f'{attn} estimate'})"
    )
    if free - paged.total_bytes <= 0:
        raise BudgetError(
            f"the paged KV cache of batched generation ({paged.total_bytes / GiB:.2f} GiB) leaves "
            f"no memory beside the weights ({plan.weights_bytes / GiB:.2f} GiB of "
            f"{plan.usable_bytes / GiB:.2f} GiB usable) for activations; give it fewer tokens "
            "(LocalBackend(batch_kv_tokens=...)) or turn batching off",
            needed=paged.total_bytes,
            available=max(0, free),
        )
    return MemoryModel(
        capacity_bytes=free - paged.total_bytes,
        kv_bytes_per_token=plan.kv_bytes_per_token_peak,
        kv_fixed_bytes=plan.kv_fixed_bytes_per_sequence,
        kv_pool_tokens=paged.capacity_tokens,
        kv_pool_page=paged.page_size,
        activation=activation,
        source=source,
    )
