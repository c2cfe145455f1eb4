"""The measurements that refine the memory plan, recorded per machine in the cache folder:

* *calibration* (``cache_dir()/calibration.json``): the measured CUDA peak of a real generation,
  kept as activation bytes per prefill token, so the next plan for the same (GPU, model, dtype,
  cache) uses it instead of the estimate (:func:`record_calibration`, :func:`lookup_calibration`);
* *speed* (``cache_dir()/prefill.json``): a prefill fit ``seconds = a·n + b·n²`` and the decode
  step times of the loaded model (:func:`measure_prefill_speed`), from which a CPU host's context
  is capped for time (:func:`context_tokens_for_time`) and admission control's
  :class:`~ragbudget.memory.schedule.Throughput` is built (:func:`throughput_from_speed`).

Both files are small JSON maps written atomically under a process lock; a missing or corrupt one
reads as empty, never fatal.

>>> context_tokens_for_time({"a": 0.001, "b": 1e-7}, 2.0)   # the n with a·n + b·n² = 2 s
1708
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, RagBudgetError
from .schedule import Throughput

log = logging.getLogger(__name__)

__all__ = [
    "CPU_TTFT_TARGET",
    "PeakMeasurement",
    "context_tokens_for_time",
    "lookup_calibration",
    "lookup_prefill_speed",
    "measure_prefill_speed",
    "record_calibration",
    "record_measurement",
    "throughput_from_speed",
]

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


def load_per_core() -> float:
    """The host's one-minute load average per core (0 where the platform keeps none): above 0.5
    a speed measured now is provisional (other work shared the cores), and is measured again
    once this falls below it. Replace it (``monkeypatch``) to play a busy or an idle host."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):  # no load average on this platform: assume idle
        return 0.0


def lookup_prefill_speed(model: str, device: str) -> dict[str, Any] | None:
    """The recorded prefill fit ``{"a": s/token, "b": s/token², ...}`` for (model, device,
    machine, threads), or ``None`` — also when the recorded one was measured on a busy host
    (``provisional``) and the host is idle now, so that the caller measures again."""
    entry = _read_entry(_prefill_path(), _prefill_key(model, device))
    if entry and entry.get("provisional") and device == "cpu" and load_per_core() < _IDLE_LOAD:
        return None
    return entry


def measure_prefill_speed(
    model: Any,  # a transformers causal LM: torch and transformers load lazily, their types loosely
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
    import torch  # lazy: heavy imports

    load = load_per_core()
    cfg = getattr(model, "config", None)
    vocab = int(getattr(cfg, "vocab_size", 32000) or 32000)
    probe = _Probe(model, next(model.parameters()).device, vocab)
    with torch.no_grad():
        probe.forward(probe.ids(16))  # warm-up
        times = probe.prefill_times(lengths)
        decode = probe.decode_speed(decode_context, decode_steps) if decode_steps > 0 else {}
    a, b = _prefill_fit(times)
    load = max(load, load_per_core())
    entry: dict[str, Any] = {
        "a": a,
        "b": b,
        "probes": [[n, round(t, 4)] for n, t in times],
        "tokens_per_second": round(lengths[-1] / times[-1][1], 1),
        **decode,
        "load_per_core": round(load, 2),
        "provisional": device == "cpu" and load > _BUSY_LOAD,
    }
    return _merge_entry(_prefill_path(), _prefill_key(name, device), lambda old: _kept_speed(old, entry, decode))


@dataclass(frozen=True)
class _Probe:
    """Timed forwards of a causal LM on its own device, over synthetic token ids."""

    # Any: torch tensors and devices, transformers models and caches (torch is imported lazily).
    model: Any
    device: Any
    vocab: int

    def ids(self, n: int, batch: int = 1) -> Any:
        """``batch`` rows of ``n`` token ids on the model's device, none of them 0."""
        import torch

        return torch.arange(n, device=self.device).remainder(self.vocab - 1).add(1).unsqueeze(0).repeat(batch, 1)

    def sync(self) -> None:
        """Wait for the device's queued work, so that a timer reads the work done."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def forward(self, ids: Any) -> None:
        """One prefill forward of ``ids``, without the KV cache."""
        try:  # only the last position's logits, as generate computes them
            self.model(ids, use_cache=False, logits_to_keep=1)
        except TypeError:  # a model whose forward has no logits_to_keep
            self.model(ids, use_cache=False)

    def forward_cached(self, ids: Any, past: Any) -> Any:
        """One forward with the KV cache, returning the cache (transformers 5 names it
        ``cache``, 4 ``past_key_values``)."""
        try:
            out = self.model(ids, cache=past, use_cache=True, logits_to_keep=1)
        except TypeError:
            out = self.model(ids, past_key_values=past, use_cache=True)
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values

    def prefill_times(self, lengths: tuple[int, ...]) -> list[tuple[int, float]]:
        """``(tokens, seconds)`` of one prefill forward at each of ``lengths``."""
        times: list[tuple[int, float]] = []
        for n in lengths:
            ids = self.ids(n)
            best = float("inf")
            for _ in range(2):  # the faster of two: a spike of other load is not the speed
                self.sync()
                t0 = time.perf_counter()
                self.forward(ids)
                self.sync()
                best = min(best, time.perf_counter() - t0)
            times.append((n, best))
        return times

    def decode_step(self, batch: int, context: int, steps: int) -> float:
        """Seconds of one decode step of ``batch`` sequences after a ``context`` prefill:
        the fastest of ``steps`` (a spike of other load is not the speed)."""
        past = self.forward_cached(self.ids(context, batch), None)
        step = self.ids(1, batch)
        best = float("inf")
        for _ in range(steps):
            self.sync()
            t0 = time.perf_counter()
            past = self.forward_cached(step, past)
            self.sync()
            best = min(best, time.perf_counter() - t0)
        return best

    def decode_speed(self, context: int, steps: int) -> dict[str, Any]:
        """The entry's decode figures: a step of one sequence, and each further one in a batch."""
        one = self.decode_step(1, context, steps)
        many = self.decode_step(_DECODE_BATCH, context, steps)
        return {
            "decode_s": one,
            "decode_extra_s": max(0.0, (many - one) / (_DECODE_BATCH - 1)),
            "decode_context": context,
            "decode_tokens_per_second": round(1 / one, 1) if one > 0 else None,
        }


def _prefill_fit(times: list[tuple[int, float]]) -> tuple[float, float]:
    """``(a, b)`` of ``seconds = a·n + b·n²`` through the probe ``times``, neither negative."""
    # Least squares through the origin for (a, b); clamp at zero (noise can make one negative).
    import numpy as np

    x = np.array([[n, n * n] for n, _ in times], dtype=float)
    y = np.array([t for _, t in times])
    a, b = (float(v) for v in np.linalg.lstsq(x, y, rcond=None)[0])
    if b < 0 or a < 0:
        # Noise (a busy host) made the curve bend the wrong way: the longest probe, linear.
        a, b = times[-1][1] / times[-1][0], 0.0
    return a, b


def _kept_speed(old: dict[str, Any] | None, entry: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    """What ``prefill.json`` keeps of the ``old`` entry and the new one: the faster of each figure."""
    a, b = entry["a"], entry["b"]
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


def throughput_from_speed(speed: Mapping[str, Any], *, batched: bool = False) -> Throughput | None:
    """The admission model's :class:`~ragbudget.memory.schedule.Throughput` from a recorded speed
    entry, or ``None`` when it has no decode figure (recorded before decode was measured: the
    caller measures again)."""
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
