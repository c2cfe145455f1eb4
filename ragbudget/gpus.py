"""How much accelerator memory there is to plan against.

``resolve_gpu(None)`` / ``"auto"`` reads the free memory of ``cuda:0`` (``torch.cuda.mem_get_info``:
free, not total — other processes' memory is not ours); without a GPU it plans against the host's
available RAM and says so. A name (``"RTX 4090"``, ``"a100 80gb"``, ``"M3 Max"``) is looked up in
:data:`GPU_TABLE`; a size (``"24GiB"``, ``"24GB"``, ``"16g"``, ``25769803776``) is taken as is.
``"2xH100"`` (or ``"2 x 24GiB"``) names several identical GPUs: the plan is then tensor-parallel
over them (:mod:`ragbudget.memory.weights`), and :attr:`GPUInfo.bytes` is what *one* of them has.

A number without a unit is bytes. One under :data:`MIN_BARE_BYTES` (1 GiB) is refused rather
than read as GiB: ``gpu=24`` meant 24 GiB, and planning 24 bytes (what it used to do) fails later
with a misleading "the weights alone need …"; while a byte count, the unit ``torch`` and NVML
report, stays valid. The message names the spelling that works (``"24GiB"``).

Sizes: ``GiB``/``G``/``g`` are powers of two (2**30), ``GB`` is SI (10**9) — "24GB" is
22.35 GiB. Table entries are the marketed capacities in GiB, which is what the driver reports
up to a few hundred MiB of reserved memory.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import sys
from dataclasses import dataclass

from .errors import ConfigError

__all__ = [
    "GPU_TABLE",
    "MIN_BARE_BYTES",
    "GPUInfo",
    "check_gpu",
    "cuda_free",
    "gpu_count",
    "host_available_bytes",
    "parse_size",
    "prefer_expandable_segments",
    "resolve_gpu",
]

GiB = 1 << 30

#: The smallest memory size accepted as a bare number of bytes (see the module docstring): no
#: accelerator that can hold a model has less, so a smaller bare number is a unit left out.
MIN_BARE_BYTES = GiB

#: Marketed memory (GiB) of common accelerators. Apple entries are unified memory shared with
#: the OS: by default macOS lets the GPU wire about 75% of it (``recommendedMaxWorkingSetSize``).
GPU_TABLE: dict[str, float] = {
    # NVIDIA consumer
    "RTX 3060": 12, "RTX 3070": 8, "RTX 3080": 10, "RTX 3080 Ti": 12, "RTX 3090": 24,
    "RTX 3090 Ti": 24, "RTX 4060": 8, "RTX 4060 Ti": 16, "RTX 4070": 12, "RTX 4070 Ti": 12,
    "RTX 4070 Ti Super": 16, "RTX 4080": 16, "RTX 4080 Super": 16, "RTX 4090": 24,
    "RTX 5070": 12, "RTX 5070 Ti": 16, "RTX 5080": 16, "RTX 5090": 32,
    # NVIDIA workstation / inference
    "RTX A4000": 16, "RTX A5000": 24, "RTX A6000": 48, "RTX 6000 Ada": 48,
    "RTX PRO 6000 Blackwell": 96, "T4": 16, "A10": 24, "A10G": 24, "L4": 24, "L40": 48,
    "L40S": 48, "V100 16GB": 16, "V100 32GB": 32,
    # NVIDIA datacenter
    "A100 40GB": 40, "A100 80GB": 80, "H100 80GB": 80, "H100 NVL": 94, "H200": 141,
    "GH200": 96, "B200": 180, "B300": 288,
    # AMD
    "MI210": 64, "MI250X": 128, "MI300X": 192, "MI325X": 256, "RX 7900 XTX": 24,
    # Apple unified memory (the largest configuration of each chip)
    "M1 Max": 64, "M1 Ultra": 128, "M2 Max": 96, "M2 Ultra": 192, "M3 Max": 128,
    "M3 Ultra": 512, "M4 Pro": 64, "M4 Max": 128,
}  # fmt: skip

#: Short names that mean one table entry: "H100" is sold as 80 GB (PCIe and SXM; the 94 GB card
#: is the "H100 NVL").
_ALIASES = {"h100": "H100 80GB"}
#: Short names of GPUs sold with different memory sizes. These are an error listing the choices,
#: not a pick: the sizes differ 2×, so a guess either plans twice the memory the card has (the
#: OOM this library exists to prevent) or silently wastes half of it, while naming the exact model
#: costs one retype.
_AMBIGUOUS = {"a100": ("A100 40GB", "A100 80GB"), "v100": ("V100 16GB", "V100 32GB")}


@dataclass(frozen=True)
class GPUInfo:
    """Memory to plan against: ``bytes`` from ``source`` (``"cuda:0 free memory"``, ``"table"``,
    ``"explicit size"``, ``"host RAM (no GPU)"``), with a human ``name`` and ``notes``. ``count``
    identical GPUs (``"2xH100"``): ``bytes`` is one GPU's, ``name`` the one GPU's name."""

    name: str
    bytes: int
    source: str
    notes: tuple[str, ...] = ()
    count: int = 1


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
# A size with a sign ("-5GiB", "+8g"): still a size, never a GPU name to look up.
_SIGNED_SIZE_RE = re.compile(r"^\s*[-+]\s*[0-9]*\.?[0-9]+\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "kb": 10**3,
          "m": 1 << 20, "mi": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gi": 1 << 30, "gib": 1 << 30, "gb": 10**9,
          "t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40, "tb": 10**12}  # fmt: skip


def parse_size(text: str | float) -> int:
    """Bytes from ``"24GiB"``, ``"24GB"`` (SI), ``"16g"``, ``"512MiB"`` or a number of bytes.

    >>> parse_size("24GiB"), parse_size("24GB"), parse_size("16g"), parse_size(1024)
    (25769803776, 24000000000, 17179869184, 1024)
    """
    if isinstance(text, bool):
        raise ConfigError(f"not a memory size: {text!r}")
    if isinstance(text, (int, float)):
        if text <= 0:
            raise ConfigError(f"memory size must be positive, got {text}")
        return int(text)
    given = text
    if _SIGNED_SIZE_RE.match(text):
        if text.strip().startswith("-"):
            raise ConfigError(f"memory size must be positive, got {given!r}")
        text = text.strip()[1:]
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"not a memory size: {text!r} (use e.g. 24GiB, 24GB, 16g or bytes)")
    value, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if value <= 0:
        raise ConfigError(f"memory size must be positive, got {given!r}")
    return int(value * _UNITS[unit])


def _norm(name: str) -> str:
    name = name.lower()
    for word in ("nvidia", "geforce", "tesla", "amd", "radeon", "instinct", "apple", "quadro"):
        name = name.replace(word, "")
    name = name.replace("gib", "gb")
    return re.sub(r"[^a-z0-9]", "", name)


def _lookup(name: str) -> str:
    key = _norm(name)
    table = {_norm(k): k for k in GPU_TABLE}
    if key in table:
        return table[key]
    if key in _ALIASES:
        return _ALIASES[key]
    if key in _AMBIGUOUS:
        choices = _AMBIGUOUS[key]
        raise ConfigError(
            f"GPU {name!r} is sold with "
            + " and ".join(f"{GPU_TABLE[c]:g} GiB" for c in choices)
            + f" of memory; name one: {', '.join(repr(c) for c in choices)} (or pass a size, "
            f"e.g. --gpu {GPU_TABLE[choices[0]]:g}GiB)"
        )
    # A unique table entry that starts with what was typed ("rtx 4070 ti s" → Ti Super).
    starts = [v for k, v in table.items() if k.startswith(key)]
    if len(starts) == 1:
        return starts[0]
    close = difflib.get_close_matches(key, list(table), n=5, cutoff=0.5)
    names = [table[c] for c in close] or starts[:5]
    raise ConfigError(
        f"unknown GPU {name!r}"
        + (f"; did you mean: {', '.join(names)}?" if names else ".")
        + " Pass a size instead (e.g. --gpu 24GiB), or one of: "
        + ", ".join(GPU_TABLE)
    )


def host_available_bytes() -> int:
    """Available host RAM (psutil, else ``MemAvailable`` of /proc/meminfo)."""
    with contextlib.suppress(ImportError):
        import psutil

        return int(psutil.virtual_memory().available)
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ConfigError("cannot read the host's available memory; pass --gpu with a size")


def cuda_free() -> tuple[str, int, int] | None:
    """``(name, free bytes, total bytes)`` of ``cuda:0``, or ``None`` without a usable CUDA
    device: what :func:`resolve_gpu` sizes an ``"auto"`` budget from."""
    # Avoid importing torch (seconds) on machines that visibly have no NVIDIA driver.
    if "torch" not in sys.modules and not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")):
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info(0)
        return torch.cuda.get_device_name(0), int(free), int(total)
    except Exception:  # noqa: BLE001 - a broken CUDA setup means "no GPU", never a crash
        return None


#: The variables through which a user configures PyTorch's CUDA caching allocator themselves.
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def prefer_expandable_segments() -> bool:
    """Turn on PyTorch's expandable segments for CUDA (``expandable_segments:True``) unless the
    user configured the allocator (:data:`ALLOC_CONF_VARS`); ``True`` when it was turned on.

    Why: a plan budgets bytes *allocated*, but what runs out is what the caching allocator has
    *reserved*. With fixed-size segments, a prefill whose transients differ in size from layer to
    layer (eager attention's bf16 scores, their float32 softmax, the masks) strands freed blocks
    that the next, larger request cannot use: on an H200 a 16k-token Gemma-2 prefill reserved 40
    GiB for a 28 GiB allocated peak (``make gpu-check``). Expandable segments grow one mapping
    instead, so reserved stays near allocated — PyTorch's own advice in its OOM message. Called
    before the generator's weights reach the GPU; segments made earlier keep their kind.
    """
    if any(os.environ.get(var) for var in ALLOC_CONF_VARS):
        return False
    try:
        import torch

        # Private in every release, renamed in 2.11 (the old name warns): the new name first.
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
            torch.cuda.memory, "_set_allocator_settings", None
        )
        if setter is None or not torch.cuda.is_available():
            return False
        setter("expandable_segments:True")
    except Exception:  # noqa: BLE001 - an allocator that refuses the setting keeps its default
        return False
    return True


# "2xH100", "2 x H100", "4×24GiB", "8*A100 80GB": a count of identical GPUs, then one GPU.
_COUNT_RE = re.compile(r"^\s*([0-9]+)\s*[x×*]\s*(\S.*)$", re.IGNORECASE)


def _split_count(gpu: str) -> tuple[int, str]:
    m = _COUNT_RE.match(gpu)
    if not m:
        return 1, gpu
    count = int(m.group(1))
    if count < 1:
        raise ConfigError(f"GPU count must be ≥ 1, got {gpu!r} (e.g. --gpu 2xH100)")
    return count, m.group(2).strip()


def _explicit_size(gpu: str | float) -> int:
    """Bytes of an explicit size, refusing a bare number too small to be bytes (module docstring)."""
    size = parse_size(gpu)
    bare = isinstance(gpu, (int, float)) or not re.search(r"[a-zA-Z]", str(gpu))
    if bare and size < MIN_BARE_BYTES:
        shown = f"{gpu:g}" if isinstance(gpu, float) else str(gpu).strip()
        raise ConfigError(
            f"gpu={shown} has no unit, so it is bytes, and {size:,} bytes cannot hold a model; "
            f"for {shown} GiB pass '{shown}GiB' (or '{shown}GB' for SI gigabytes, or a GPU name "
            f"such as 'RTX 4090'); a bare number is read as bytes only from {MIN_BARE_BYTES:,} (1 GiB) up"
        )
    return size


def gpu_count(gpu: object) -> int:
    """How many identical GPUs ``gpu`` names (``"2xH100"`` → 2; anything else → 1), without
    probing a device.

    >>> gpu_count("4 x H100"), gpu_count("H100"), gpu_count(None)
    (4, 1, 1)
    """
    return _split_count(gpu)[0] if isinstance(gpu, str) else 1


def check_gpu(gpu: object) -> None:
    """Refuse a ``gpu`` value that :func:`resolve_gpu` would refuse, without probing any device
    (no torch import, no CUDA): for settings records, checked when they are built.

    >>> check_gpu("2xH100"); check_gpu("auto"); check_gpu(None)
    >>> check_gpu("potato")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ragbudget.errors.ConfigError: unknown GPU 'potato'. Pass a size instead (e.g. --gpu 24GiB), or one of: RTX 3060, ...
    """
    if gpu is None or (isinstance(gpu, str) and gpu.strip().lower() in ("", "auto")):
        return
    if isinstance(gpu, bool) or not isinstance(gpu, (str, int, float)):
        raise ConfigError(
            f"gpu must be 'auto', a GPU name, a size such as '24GiB', 'NxNAME' for N identical GPUs or "
            f"a number of bytes, got {type(gpu).__name__} {gpu!r:.60}"
        )
    _resolve_named(gpu)


def _resolve_named(gpu: str | float) -> GPUInfo:
    """A GPU given by name, size or ``NxNAME`` (never ``auto``): no device is probed."""
    count = 1
    if isinstance(gpu, str):
        count, gpu = _split_count(gpu)
    if isinstance(gpu, (int, float)) or _SIZE_RE.match(str(gpu)) or _SIGNED_SIZE_RE.match(str(gpu)):
        size = _explicit_size(gpu)
        return GPUInfo(name=f"{size / GiB:.1f} GiB", bytes=size, source="explicit size", count=count)
    name = _lookup(str(gpu))
    notes: tuple[str, ...] = ()
    if name.startswith("M") and name[1:2].isdigit():
        notes = (("Apple unified memory is shared with the OS; by default the GPU may use about 75% of it"),)
        if count > 1:
            raise ConfigError(f"{name} is one machine's unified memory; tensor parallelism needs discrete GPUs")
    return GPUInfo(name=name, bytes=int(GPU_TABLE[name] * GiB), source="table", notes=notes, count=count)


def resolve_gpu(gpu: str | int | None = None) -> GPUInfo:
    """The memory to plan against (see the module docstring).

    >>> resolve_gpu("RTX 4090").bytes == 24 * 2**30
    True
    >>> resolve_gpu("24GiB").source
    'explicit size'
    >>> resolve_gpu("2xH100").count, resolve_gpu("2xH100").name
    (2, 'H100 80GB')
    """
    if gpu is None or (isinstance(gpu, str) and gpu.strip().lower() in ("", "auto")):
        cuda = cuda_free()
        if cuda is not None:
            name, free, total = cuda
            return GPUInfo(
                name=name,
                bytes=free,
                source="cuda:0 free memory",
                notes=(f"{name}: {free / GiB:.1f} GiB free of {total / GiB:.1f} GiB",),
            )
        avail = host_available_bytes()
        return GPUInfo(
            name="host RAM",
            bytes=avail,
            source="host RAM (no GPU)",
            notes=(
                (
                    "no CUDA device: planning against available host RAM "
                    f"({avail / GiB:.1f} GiB); pass --gpu to plan for a GPU"
                ),
            ),
        )
    return _resolve_named(gpu)
