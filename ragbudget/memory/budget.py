"""The GPU memory budget: how many tokens one request may hold, at what concurrency.

One job: the memory plan of one model on one device (weights, activations, KV, concurrency), with
the measurements that refine it (calibration, prefill speed) stored next to the plan that reads them.

    usable   = gpu_bytes × utilization            (0.9 by default, like vLLM)
    needed   = weights + activations(prefill) + KV(peak, concurrency × context)
    max_context_tokens = the largest context (prompt + generated) per request with needed ≤ usable,
                         capped by the model's max_position_embeddings

Weights come from a loaded model (parameter + buffer bytes), local safetensors headers, or the
parameter count implied by the config × the weight dtype. Activations are a prefill-peak
estimate (see :func:`estimate_activation_bytes`), replaced by a measured value once a real CUDA run
was recorded with :func:`record_calibration`. KV is exact per layer type (:mod:`ragbudget.memory.kvcache`).

>>> plan = plan_budget("meta-llama/Llama-3.1-8B-Instruct", gpu="RTX 4090")
>>> plan.kv_bytes_per_token, plan.limited_by
(131072, 'memory')
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BudgetError, ConfigError, ModelError, RagBudgetError
from ..gpus import GiB, GPUInfo, resolve_gpu
from .kvcache import (
    _Cfg,
    _normalize,
    dtype_bits,
    estimate_kv,
    kv_bytes_per_token,
    layer_specs,
    model_dtype,
    text_config,
)

if TYPE_CHECKING:
    from .admission import MemoryModel, Throughput
    from .kvcache import PagedCacheLayout

log = logging.getLogger(__name__)

__all__ = [
    "BudgetPlan",
    "PeakMeasurement",
    "cap_plan_for_time",
    "count_parameters",
    "estimate_activation_bytes",
    "estimate_weights_bytes",
    "context_tokens_for_time",
    "lookup_calibration",
    "lookup_prefill_speed",
    "measure_prefill_speed",
    "plan_budget",
    "record_calibration",
    "record_measurement",
    "request_memory",
    "throughput_from_speed",
]

# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _meta_parameter_count(config: Any) -> int:
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


def count_parameters(config: Any) -> int:
    """Parameters of a decoder-only LM from its config: the sum of
    :func:`ragbudget.memory.weights.parameters` (embeddings, attention incl. MLA, dense or MoE MLP, norms,
    untied head). Exact for Llama/Mistral/Qwen2/Qwen3/Gemma/Mixtral-style models (checked in
    tests); an estimate for other families (biases and norm details differ). Recurrent/hybrid
    models are counted exactly by building them on the meta device.

    >>> count_parameters({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
    ...     "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32})
    6738415616
    """
    from .weights import _has_recurrent, parameters

    c = _Cfg(text_config(config) if isinstance(config, Mapping) else _normalize(config, False))
    if c.get("num_attention_heads", "n_head", "num_heads") is None or _has_recurrent(config):
        # Recurrent and hybrid families (Mamba, Jamba, Falcon-H1, Nemotron-H, …) have mixers
        # the role list does not know: count what transformers would build.
        return _meta_parameter_count(config)
    return sum(p.numel for p in parameters(config))


def estimate_weights_bytes(config: Any, *, weight_dtype: str | None = None, tensor_parallel: int = 1) -> int:
    """Weight bytes of ``config`` on one of ``tensor_parallel`` GPUs, stored as the checkpoint
    says (its ``quantization_config``, else the model dtype) or as ``weight_dtype`` overrides
    (:data:`ragbudget.memory.weights.WEIGHT_DTYPES`: ``"bf16"``, ``"int4"``, ``"nf4"``, ``"fp8"``, …),
    scales, zero points and unquantized modules included (:mod:`ragbudget.memory.weights`).

    >>> from ragbudget.memory.models import load_model_config
    >>> round(estimate_weights_bytes(load_model_config("openai/gpt-oss-20b")) / 2**30, 2)  # MXFP4 experts
    12.82
    """
    from .weights import _has_recurrent, weight_bytes, weight_format

    fmt = weight_format(config, weight_dtype)
    if _has_recurrent(config):  # no role list: every parameter at the format's unquantized width
        if tensor_parallel > 1:
            raise ConfigError("tensor-parallel planning covers attention models; this one has recurrent layers")
        return (count_parameters(config) * dtype_bits(fmt.dtype) + 7) // 8
    return weight_bytes(config, fmt, tensor_parallel=tensor_parallel)


def _module_bytes(model: Any) -> int:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return int(params + sum(b.numel() * b.element_size() for b in model.buffers()))


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------


def estimate_activation_bytes(
    config: Any,
    tokens: int,
    *,
    batch_size: int = 1,
    dtype: str | None = None,
    attn_implementation: str = "sdpa",
    logits: str = "last",
) -> int:
    """Peak transient memory of one prefill forward of ``tokens`` tokens × ``batch_size``.

    A layer-local model of what is alive at once: the residual stream and its normed copy, the
    Q/K/V projections, either the attention scores (``"eager"`` materializes ``heads × L × L``
    in the model dtype plus a float32 softmax; ``"sdpa"``/flash kernels do not) or the MLP
    intermediates (gate, up, product), whichever is larger, plus the logits (``"last"``: one
    float32 row per sequence, what ``generate`` keeps; ``"all"``: every position). It is an
    estimate; :func:`record_calibration` replaces it with measurements.
    """
    c = _Cfg(_normalize(config, True))
    d = dtype_bits(dtype or model_dtype(config)) // 8 or 1
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
    stream = 3 * bt * H * d  # residual, normed input, layer output
    # Q/K/V projections, plus the new K/V copied into the cache by the first concatenation.
    qkv = bt * (heads + 2 * kv) * hd * d + 2 * bt * kv * hd * d
    sliding = any(s.kind == "sliding_attention" for s in layer_specs(c.obj, normalize=False))
    l2 = batch_size * tokens * tokens
    if attn_implementation == "eager":
        # `softmax(scores, dtype=float32).to(dtype)` holds the scores, the float32 softmax and the
        # cast copy at once; K/V are repeated to all heads (repeat_kv); the additive float masks
        # (one per attention type: full, sliding) live for the whole forward.
        attn = l2 * heads * (2 * d + 4) + 2 * bt * heads * hd * d
        masks = l2 * d * (2 if sliding else 1)
    else:
        attn = bt * heads * hd * d  # output only; kernels tile the scores
        # Causal full attention needs no mask (is_causal); sliding layers get a boolean one.
        masks = l2 if sliding else 0
    mlp = 3 * bt * inter * d
    logit_rows = batch_size if logits == "last" else bt
    logits_bytes = logit_rows * V * (d + 4)  # lm_head output + float32 copy in generate
    return int(stream + qkv + max(attn, mlp) + masks + logits_bytes)


# --------------------------------------------------------------------------------------------
# Calibration (measured peaks after real CUDA runs)
# --------------------------------------------------------------------------------------------

_CAL_LOCK = threading.Lock()


def _calibration_path() -> Path:
    from .models import cache_dir

    return cache_dir() / "calibration.json"


def _cal_key(gpu_name: str, model: str, dtype: str, cache: str) -> str:
    return "|".join(str(x).lower() for x in (gpu_name, model, dtype, cache))


def _read_entry(path: Path, key: str) -> dict[str, Any] | None:
    """``key``'s entry of a small JSON measurement file (calibration, prefill speed), or ``None``;
    a missing or corrupt file reads as empty, never fatal."""
    if not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):  # AttributeError: JSON that is not an object
        return None
    return entry if isinstance(entry, dict) else None


def _merge_entry(path: Path, key: str, merge: Callable[[dict[str, Any] | None], dict[str, Any]]) -> dict[str, Any]:
    """Replace ``key``'s entry by ``merge(old entry)`` under the process lock, atomically: a
    concurrent reader sees the old file or the new one (temp file + ``os.replace``); a corrupt
    file is rebuilt. Returns the entry written."""
    with _CAL_LOCK:
        data: dict[str, Any] = {}
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                data = {}
        entry = data[key] = merge(data.get(key))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    return entry


def record_calibration(
    *,
    gpu_name: str,
    model: str,
    dtype: str,
    cache: str,
    tokens: int,
    batch_size: int,
    measured_peak_bytes: int,
    weights_bytes: int,
    kv_bytes: int,
) -> dict[str, Any]:
    """Record a measured peak (``torch.cuda.max_memory_allocated`` during ``generate``) so the
    next plan for the same (GPU, model, dtype, cache) uses the measured activation overhead.

    Stored in ``cache_dir()/calibration.json`` as activation bytes per prefill token; the largest
    ratio seen is kept, so the budget stays on the safe side.
    """
    if tokens <= 0 or batch_size <= 0:
        raise ConfigError("record_calibration needs tokens > 0 and batch_size > 0")
    residual = max(0, int(measured_peak_bytes) - int(weights_bytes) - int(kv_bytes))
    per_token = residual / (tokens * batch_size)

    def merge(old: dict[str, Any] | None) -> dict[str, Any]:
        old = old or {}
        return {
            "activation_bytes_per_token": max(per_token, old.get("activation_bytes_per_token", 0)),
            "measured_peak_bytes": int(measured_peak_bytes),
            "tokens": int(tokens),
            "batch_size": int(batch_size),
            "runs": int(old.get("runs", 0)) + 1,
        }

    return _merge_entry(_calibration_path(), _cal_key(gpu_name, model, dtype, cache), merge)


@dataclass(frozen=True, kw_only=True)
class PeakMeasurement:
    """A generation's measured CUDA peak and what it consisted of: the arguments of
    :func:`record_calibration`. The generator measures (it holds the model and the device); the
    pipeline, which owns the plan, records it with :func:`record_measurement` — a stage never
    writes the planner's files itself."""

    gpu_name: str
    model: str
    dtype: str
    cache: str
    tokens: int  #: prefill tokens of the measured run
    batch_size: int
    measured_peak_bytes: int
    weights_bytes: int
    kv_bytes: int


def record_measurement(measurement: PeakMeasurement) -> dict[str, Any] | None:
    """:func:`record_calibration` of a measured peak, best effort: calibration makes the next
    plan tighter but is not needed to answer, so a cache folder that cannot be written (read-only
    home, full disk) only logs. The entry written, or ``None``."""
    try:
        return record_calibration(**asdict(measurement))
    except (OSError, RagBudgetError) as exc:
        log.debug("calibration not recorded: %s", exc)
        return None


def lookup_calibration(gpu_name: str, model: str, dtype: str, cache: str) -> dict[str, Any] | None:
    """The recorded calibration for (GPU, model, dtype, cache), or ``None``."""
    return _read_entry(_calibration_path(), _cal_key(gpu_name, model, dtype, cache))


# --------------------------------------------------------------------------------------------
# Prefill speed (the time limit of a CPU host)
# --------------------------------------------------------------------------------------------

#: Default time-to-first-token target (seconds of prefill) for a generator on the CPU. Two shared
#: cores prefill SmolLM2-135M at about 630 tokens/s when idle (measured: 1,024 tokens in 1.6 s):
#: 2 s allows about 1,250 prompt tokens, ~1,140 of context, where `make demo` capped by hand at
#: 1,024 — and the packaged model answers better from ~1k tokens than from 8k (BENCHMARKS.md).
CPU_TTFT_TARGET = 2.0
# Probe lengths: long enough that the quadratic (attention) term shows, short enough that the
# one-time probe takes seconds.
_PREFILL_PROBES = (256, 1024)
# Decode probe: steps after a short prefill (the cost of a step grows slowly with the context),
# at one sequence and at a small batch (the marginal cost of a sequence in a shared step).
_DECODE_CONTEXT = 256
_DECODE_STEPS = 8
_DECODE_BATCH = 4


def _prefill_path() -> Path:
    from .models import cache_dir

    return cache_dir() / "prefill.json"


def _prefill_key(model: str, device: str) -> str:
    import platform

    threads = os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count())
    return "|".join(str(x).lower() for x in (model, device, platform.machine(), platform.processor(), threads))


#: Load (1-minute load average per core) above which a prefill measurement is provisional: other
#: work shared the cores, so the speed it recorded is too slow. Below ``_IDLE_LOAD`` a provisional
#: entry is measured again (the faster is kept), so a first probe on a busy host does not cap
#: every later request for good.
_BUSY_LOAD = 0.75
_IDLE_LOAD = 0.5


def _load_per_core() -> float:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):  # no load average on this platform: assume idle
        return 0.0


def lookup_prefill_speed(model: str, device: str) -> dict[str, Any] | None:
    """The recorded prefill fit ``{"a": s/token, "b": s/token², ...}`` for (model, device,
    machine, threads), or ``None`` — also when the recorded one was measured on a busy host
    (``provisional``) and the host is idle now, so that the caller measures again."""
    entry = _read_entry(_prefill_path(), _prefill_key(model, device))
    if entry and entry.get("provisional") and device == "cpu" and _load_per_core() < _IDLE_LOAD:
        return None
    return entry


def measure_prefill_speed(
    model: Any,
    *,
    name: str,
    device: str = "cpu",
    lengths: tuple[int, ...] = _PREFILL_PROBES,
    decode_context: int = _DECODE_CONTEXT,
    decode_steps: int = _DECODE_STEPS,
) -> dict[str, Any]:
    """Time one prefill forward of ``model`` (a transformers causal LM) at each of ``lengths``
    tokens, fit ``seconds = a·n + b·n²`` (the MLP is linear in the tokens, attention quadratic),
    time ``decode_steps`` decode steps after a ``decode_context``-token prefill at batch 1 and at
    batch ``_DECODE_BATCH`` (``decode_s`` seconds per step of one sequence, ``decode_extra_s``
    per further sequence in a shared step), and record it in ``cache_dir()/prefill.json`` under
    (``name``, ``device``, machine, threads). Measured once per key (delete the file to measure
    again). A host busy with other work while it is measured records a slower speed, so the cap
    errs short: such an entry is marked ``provisional`` (load above ``_BUSY_LOAD`` per core) and
    measured again once the host is idle; of two measurements the faster is kept (other load is
    transient, the machine's speed is not).
    """
    import time

    import torch  # lazy: heavy imports

    load = _load_per_core()
    cfg = getattr(model, "config", None)
    vocab = int(getattr(cfg, "vocab_size", 32000) or 32000)
    dev = next(model.parameters()).device
    times: list[tuple[int, float]] = []

    def forward(ids: Any) -> None:
        try:  # only the last position's logits, as generate computes them
            model(ids, use_cache=False, logits_to_keep=1)
        except TypeError:  # a model whose forward has no logits_to_keep
            model(ids, use_cache=False)

    def ids_of(n: int, batch: int = 1) -> Any:
        return torch.arange(n, device=dev).remainder(vocab - 1).add(1).unsqueeze(0).repeat(batch, 1)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def decode_step(batch: int) -> float:
        """Seconds of one decode step of ``batch`` sequences after a ``decode_context`` prefill:
        the fastest of ``decode_steps`` (a spike of other load is not the speed)."""
        past = forward_cached(ids_of(decode_context, batch), None)
        step = ids_of(1, batch)
        best = float("inf")
        for _ in range(decode_steps):
            sync()
            t0 = time.perf_counter()
            past = forward_cached(step, past)
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    def forward_cached(ids: Any, past: Any) -> Any:
        """One forward with the KV cache, returning the cache (transformers 5 names it
        ``cache``, 4 ``past_key_values``)."""
        try:
            out = model(ids, cache=past, use_cache=True, logits_to_keep=1)
        except TypeError:
            out = model(ids, past_key_values=past, use_cache=True)
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values

    with torch.no_grad():
        forward(ids_of(16))  # warm-up
        for n in lengths:
            ids = ids_of(n)
            best = float("inf")
            for _ in range(2):  # the faster of two: a spike of other load is not the speed
                sync()
                t0 = time.perf_counter()
                forward(ids)
                sync()
                best = min(best, time.perf_counter() - t0)
            times.append((n, best))
        decode: dict[str, Any] = {}
        if decode_steps > 0:
            one = decode_step(1)
            many = decode_step(_DECODE_BATCH)
            decode = {
                "decode_s": one,
                "decode_extra_s": max(0.0, (many - one) / (_DECODE_BATCH - 1)),
                "decode_context": decode_context,
                "decode_tokens_per_second": round(1 / one, 1) if one > 0 else None,
            }
    # Least squares through the origin for (a, b); clamp at zero (noise can make one negative).
    import numpy as np

    x = np.array([[n, n * n] for n, _ in times], dtype=float)
    y = np.array([t for _, t in times])
    a, b = (float(v) for v in np.linalg.lstsq(x, y, rcond=None)[0])
    if b < 0 or a < 0:
        # Noise (a busy host) made the curve bend the wrong way: the longest probe, linear.
        a, b = times[-1][1] / times[-1][0], 0.0
    load = max(load, _load_per_core())
    entry = {
        "a": a,
        "b": b,
        "probes": [[n, round(t, 4)] for n, t in times],
        "tokens_per_second": round(lengths[-1] / times[-1][1], 1),
        **decode,
        "load_per_core": round(load, 2),
        "provisional": device == "cpu" and load > _BUSY_LOAD,
    }

    def merge(old: dict[str, Any] | None) -> dict[str, Any]:
        if old and old.get("a", 0) * 1024 + old.get("b", 0) * 1024**2 < a * 1024 + b * 1024**2:
            # The faster measurement stands; it stops being provisional once either was idle.
            kept = dict(old, provisional=bool(old.get("provisional")) and entry["provisional"])
            if "decode_s" in decode and decode["decode_s"] < old.get("decode_s", float("inf")):
                kept.update(decode)  # and the faster decode, wherever it came from; taken on a
                # busy host it is provisional too: measured again once the host is idle
                kept["provisional"] = bool(kept["provisional"] or entry["provisional"])
            return kept
        if old and "decode_s" in old and old["decode_s"] < entry.get("decode_s", float("inf")):
            return dict(
                entry,
                **{
                    k: old[k]
                    for k in ("decode_s", "decode_extra_s", "decode_context", "decode_tokens_per_second")
                    if k in old
                },
            )
        return entry

    return _merge_entry(_prefill_path(), _prefill_key(name, device), merge)


def throughput_from_speed(speed: Mapping[str, Any], *, batched: bool = False) -> Throughput | None:
    """The admission model's :class:`~ragbudget.memory.admission.Throughput` from a recorded speed
    entry, or ``None`` when it has no decode figure (recorded before decode was measured: the
    caller measures again)."""
    from .admission import Throughput

    if not speed.get("decode_s"):
        return None
    return Throughput(
        prefill_a=float(speed.get("a", 0.0)),
        prefill_b=float(speed.get("b", 0.0)),
        decode_s=float(speed["decode_s"]),
        batched=batched,
        decode_extra_s=(float(speed["decode_extra_s"]) if speed.get("decode_extra_s") is not None else None),
        source="measured at warm-up" + (" (provisional: the host was busy)" if speed.get("provisional") else ""),
    )


def context_tokens_for_time(speed: Mapping[str, Any], seconds: float) -> int:
    """The most prompt tokens a prefill of ``seconds`` allows under the fit ``speed``.

    >>> context_tokens_for_time({"a": 0.002, "b": 0.0}, 5.0)
    2500
    """
    a, b = float(speed.get("a", 0.0)), float(speed.get("b", 0.0))
    if seconds <= 0:
        return 0
    if b <= 0:
        return int(seconds / a) if a > 0 else 1 << 30
    # b·n² + a·n − seconds = 0, the positive root.
    return int((-a + (a * a + 4 * b * seconds) ** 0.5) / (2 * b))


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


def _model_max(cfg: Any) -> int:
    c = _Cfg(text_config(cfg) if isinstance(cfg, Mapping) else cfg)
    v = c.get("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx", default=None)
    return int(v) if v else 4096


def _resolve_model(model: Any, config: Any) -> tuple[str, Any, Any]:
    """(name, config, loaded module or None)."""
    module = None
    if model is not None and not isinstance(model, (str, os.PathLike)):
        module = model
        config = config if config is not None else getattr(model, "config", None)
        name = getattr(config, "_name_or_path", None) or type(model).__name__
        if config is None:
            raise ConfigError("a loaded model without .config: pass config=")
        return str(name), config, module
    if config is not None:
        name = str(model) if model is not None else str(_Cfg(config).get("_name_or_path", default="config"))
        return name, config, None
    from .models import load_model_config

    cfg = load_model_config(None if model is None else str(model))
    name = str(model) if model is not None else str(cfg.get("_name_or_path", "default"))
    return name, cfg, None


def plan_budget(
    model: Any = None,
    *,
    gpu: str | int | None = None,
    concurrency: int = 1,
    max_new_tokens: int = 256,
    context_tokens: int | None = None,
    kv_dtype: str | None = None,
    cache: str = "dynamic",
    weights_bytes: int | None = None,
    weight_dtype: str | None = None,
    utilization: float = 0.9,
    backend: str = "transformers",
    config: Any = None,
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
    from .weights import comm_reserve_bytes, rank_config, weight_format

    if not 0 < utilization <= 1:
        raise ConfigError(f"utilization must be in (0, 1], got {utilization}")
    if concurrency < 1 or max_new_tokens < 1:
        raise ConfigError("concurrency and max_new_tokens must be >= 1")
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
    norm = _normalize(rank_config(cfg, tp), True)
    specs = layer_specs(norm, backend=backend, normalize=False)

    # Weights
    fmt = weight_format(cfg, weight_dtype) if module is None or weight_dtype is not None else None
    if weights_bytes is not None:
        wbytes = -(-int(weights_bytes) // tp)
        wsrc = "explicit" if tp == 1 else f"explicit ÷ {tp} GPUs"
    elif module is not None:
        wbytes, wsrc = _module_bytes(module), "loaded model (parameters + buffers)"
    else:
        assert fmt is not None
        wbytes, wsrc = _planned_weights(model, cfg, fmt, weight_dtype, tp, notes)
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
    # vLLM sizes its KV cache from utilization × memory less what its profile run saw outside
    # PyTorch; with several GPUs that includes NCCL's and the custom all-reduce's buffers.
    reserve = comm_reserve_bytes(tp)
    usable = int(gpu_bytes * utilization) - reserve
    model_max = _model_max(cfg)

    # A calibration was measured on one GPU holding the whole model: not a shard's activations.
    cal = lookup_calibration(info.name, name, kvd, cache) if tp == 1 else None

    def act(tokens: int, batch: int) -> int:
        if cal is not None:
            return int(cal["activation_bytes_per_token"] * tokens * batch)
        return estimate_activation_bytes(
            norm, tokens, batch_size=batch, dtype=kvd, attn_implementation=attn_implementation
        )

    act_src = "calibrated (measured on this GPU)" if cal is not None else f"estimate ({attn_implementation} prefill)"

    def kv(tokens: int, batch: int) -> int:
        mcl = max_cache_len if cache == "static" and max_cache_len else tokens
        return estimate_kv(
            norm,
            tokens,
            batch_size=batch,
            kv_dtype=kvd,
            cache=cache,
            backend=backend,
            max_cache_len=mcl,
            normalize=False,
        ).peak_bytes

    def needed(tokens: int, batch: int) -> int:
        return wbytes + act(tokens, batch) + kv(tokens, batch)

    def max_tokens(batch: int, cap: int) -> int:
        if needed(1, batch) > usable:
            return 0
        lo, hi = 1, cap
        if needed(hi, batch) <= usable:
            return hi
        while lo < hi:  # largest t with needed(t) <= usable
            mid = (lo + hi + 1) // 2
            if needed(mid, batch) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    if wbytes >= usable:
        where = f"{info.name}" if tp == 1 else f"each of {tp} × {info.name} (tensor parallel)"
        raise BudgetError(
            f"{name}: the weights alone need {wbytes / GiB:.2f} GiB ({wsrc}) but only "
            f"{usable / GiB:.2f} GiB is usable ({utilization:.0%} of {gpu_bytes / GiB:.2f} GiB on {where}"
            + (f", less {reserve / GiB:.2f} GiB for NCCL" if reserve else "")
            + "); plan quantized storage (weight_dtype='int4', 'fp8', 'nf4'; CLI --weight-dtype int4), "
            "split it over several GPUs (tensor_parallel=2; CLI --gpu 2xNAME), or use a smaller model "
            "or a larger GPU",
            needed=wbytes,
            available=max(0, usable),
            unit="bytes",
            limit="memory",
        )
    t_mem = max_tokens(concurrency, 1 << 24)
    max_ctx = min(t_mem, model_max)
    limited_by = "model" if t_mem >= model_max else "memory"
    if max_new_tokens + 1 > model_max:
        # The window binds whatever the memory: say so, and not "buy a bigger GPU".
        raise BudgetError(
            f"max_new_tokens {max_new_tokens:,} does not fit the model window: {name} reads at "
            f"most {model_max:,} tokens (max_position_embeddings), prompt and answer together; "
            f"lower max_new_tokens (--max-new-tokens) to at most {model_max - 1:,} minus the "
            "prompt, or use a model with a longer window",
            needed=max_new_tokens + 1,
            available=model_max,
            unit="tokens",
            limit="window",
        )
    if max_ctx < max_new_tokens + 1:
        need = needed(max_new_tokens + 1, concurrency)
        raise BudgetError(
            f"{name} on {info.name}: {concurrency} request(s) of {max_new_tokens + 1} tokens need "
            f"{need / GiB:.2f} GiB (weights {wbytes / GiB:.2f} + activations "
            f"{act(max_new_tokens + 1, concurrency) / GiB:.2f} + KV "
            f"{kv(max_new_tokens + 1, concurrency) / GiB:.2f}) but {usable / GiB:.2f} GiB is "
            f"usable, so memory holds {max_ctx:,} tokens per request; lower max_new_tokens or "
            "concurrency, use kv_dtype='fp8' or a quantized/offloaded cache, or a smaller model",
            needed=max_new_tokens + 1,
            available=max_ctx,
            unit="tokens",
            limit="memory",
        )
    t_one = max_tokens(1, 1 << 24)

    # Concurrency at the target context (or at the model maximum).
    target = context_tokens if context_tokens is not None else model_max
    max_conc = 0
    if needed(target, 1) <= usable:
        lo, hi = 1, 1
        while needed(target, hi * 2) <= usable and hi < (1 << 20):
            hi *= 2
        lo, hi = hi, hi * 2
        while lo < hi - 1:
            mid = (lo + hi) // 2
            if needed(target, mid) <= usable:
                lo = mid
            else:
                hi = mid
        max_conc = lo

    curve = []
    n = 1
    while n <= max(concurrency, 1 << 10):
        t = min(max_tokens(n, 1 << 24), model_max)
        if t < max_new_tokens + 1:
            break
        curve.append((n, t))
        n *= 2

    est_max = estimate_kv(
        norm,
        max_ctx,
        batch_size=concurrency,
        kv_dtype=kvd,
        cache=cache,
        backend=backend,
        max_cache_len=max_cache_len or max_ctx,
        normalize=False,
    )
    act_at_max = act(max_ctx, concurrency)
    per_tok = kv_bytes_per_token(norm, kv_dtype=kvd, backend=backend, normalize=False)
    per_tok_peak = kv_bytes_per_token(norm, kv_dtype=kvd, backend=backend, normalize=False, include_sliding=True)
    fixed = estimate_kv(norm, 0, kv_dtype=kvd, cache="dynamic", backend=backend, normalize=False).steady_bytes
    if any(s.kind == "sliding_attention" for s in specs) and cache == "dynamic":
        notes.append(
            "sliding-window layers pin the whole prefill until the first decode step "
            "(transformers DynamicSlidingWindowLayer): the budget uses that peak"
        )
    if cache == "quantized":
        notes.append("quantized cache (quanto/hqq): an upper bound, the residual window is counted full")
    if limited_by == "model":
        notes.append(f"context capped by the model's max_position_embeddings ({model_max})")
    if tp > 1:
        notes.append(_tp_note(cfg, tp, reserve))
    return BudgetPlan(
        model=name,
        gpu_name=info.name,
        gpu_source=info.source,
        gpu_bytes=gpu_bytes,
        usable_bytes=usable,
        utilization=utilization,
        weights_bytes=wbytes,
        weights_source=wsrc,
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
        model_max_tokens=model_max,
        limited_by=limited_by,
        cache=cache,
        kv_dtype=kvd,
        backend=backend,
        kv_bytes_at_max=est_max.peak_bytes,
        free_bytes_at_max=max(0, usable - wbytes - act_at_max - est_max.peak_bytes),
        concurrency_curve=tuple(curve),
        notes=tuple(notes),
        attn_implementation=attn_implementation,
        tensor_parallel=tp,
        comm_reserve_bytes=reserve,
        weight_format="loaded model" if fmt is None or module is not None else fmt.label,
    )


def _tensor_parallel(tensor_parallel: int | None, info: GPUInfo, module: Any) -> int:
    """The tensor-parallel degree: as given, else as many GPUs as ``gpu`` names; the two must
    agree, and a loaded model (one device) has none."""
    from ..settings import check_int

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
    model: Any, cfg: Any, fmt: Any, weight_dtype: str | None, tp: int, notes: list[str]
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


def _tp_note(cfg: Any, tp: int, reserve: int) -> str:
    c = _Cfg(text_config(cfg) if isinstance(cfg, Mapping) else cfg)
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
    prompt = context_tokens_for_time(speed, float(ttft_target))
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


def request_memory(plan: BudgetPlan, config: Any = None, *, paged: PagedCacheLayout | None = None) -> MemoryModel:
    """What one request pins by ``plan``, for :class:`~ragbudget.memory.admission.AdmissionController`:
    the memory left beside the weights, the KV bytes per token at their peak (sliding-window
    layers hold the whole prefill until the first decode step) plus per sequence, and the
    activation peak of a prefill of the request's own prompt — measured per token when a
    calibration was recorded, else :func:`estimate_activation_bytes` with the plan's attention
    implementation (``eager`` materializes the L×L scores, so a long prompt costs far more).

    ``paged``: generation is batched over this paged cache (allocated up front, so resident
    whatever runs). Its bytes leave the memory beside the weights, and the model counts each
    request's KV in tokens against the cache (whole pages) and only its activations in bytes."""
    from .admission import MemoryModel

    cfg = config
    if cfg is None:
        from .models import load_model_config

        cfg = load_model_config(plan.model)
    norm = _normalize(cfg, True)
    cal = lookup_calibration(plan.gpu_name, plan.model, plan.kv_dtype, plan.cache)
    attn = plan.attn_implementation

    def activation(tokens: int) -> int:
        if tokens <= 0:
            return 0
        if cal is not None:
            return int(cal["activation_bytes_per_token"] * tokens)
        return estimate_activation_bytes(norm, tokens, dtype=plan.kv_dtype, attn_implementation=attn)

    source = (
        f"{plan.gpu_source}: {plan.usable_bytes / GiB:.2f} GiB usable − weights "
        f"{plan.weights_bytes / GiB:.2f} GiB; per request KV "
        f"{plan.kv_bytes_per_token_peak:,} B/token + activations of its own prefill "
        f"({'calibrated' if cal is not None else f'{attn} estimate'})"
    )
    free = plan.usable_bytes - plan.weights_bytes
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
