"""What served engines read from each other's figures: Prometheus text (``GET /metrics``) and the
numbers inside it, as the engine modules need them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["int_or_none", "iter_samples", "metric_sum", "parse_prometheus", "queue_load"]


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition as ``(name, labels, value)``.

    Label values may hold commas and escaped quotes; lines that do not parse are skipped.

    >>> parse_prometheus('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0')
    [('vllm:cache_config_info', {'block_size': '16', 'num_gpu_blocks': 'None'}, 1.0)]
    """
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        labels: dict[str, str] = {}
        if "{" in line:
            name, rest = line.split("{", 1)
            i = 0
            while i < len(rest) and rest[i] != "}":
                eq = rest.find("=", i)
                if eq < 0 or eq + 1 >= len(rest) or rest[eq + 1] != '"':
                    break
                key = rest[i:eq].strip().lstrip(",").strip()
                j, val = eq + 2, []
                while j < len(rest) and rest[j] != '"':
                    if rest[j] == "\\" and j + 1 < len(rest):
                        val.append({"n": "\n"}.get(rest[j + 1], rest[j + 1]))
                        j += 2
                        continue
                    val.append(rest[j])
                    j += 1
                labels[key] = "".join(val)
                i = j + 1
                while i < len(rest) and rest[i] in ", ":
                    i += 1
            if i >= len(rest) or rest[i] != "}":
                continue
            value_part = rest[i + 1 :].split()
        else:
            name, *value_part = line.split()
        try:
            out.append((name.strip(), labels, float(value_part[0])))
        except (IndexError, ValueError):
            continue
    return out


def int_or_none(value: Any) -> int | None:
    """``value`` as an int (a float or a numeric string too), or ``None`` when it is none.

    >>> int_or_none("16"), int_or_none(2.0), int_or_none("None")
    (16, 2, None)
    """
    # vLLM stringifies unset CacheConfig fields as "None" (vllm/config/cache.py metrics_info).
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None


def iter_samples(text: str, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """``(labels, value)`` of every sample of metric ``name``."""
    for n, labels, value in parse_prometheus(text):
        if n == name:
            yield labels, value


def metric_sum(text: str, name: str) -> float | None:
    """The sum of a metric over its label sets (engines publish one series per DP engine)."""
    vals = [v for _, v in iter_samples(text, name)]
    return sum(vals) if vals else None


def queue_load(text: str, running: str, waiting: str) -> tuple[int | None, int | None, str]:
    """``(running, waiting, source)`` from an engine's Prometheus gauges of requests running and
    queued (each ``None`` when the engine does not publish it; ``source`` empty when neither).

    >>> queue_load('r{engine="0"} 2\\nr{engine="1"} 1\\nw 0\\n', "r", "w")
    (3, 0, 'GET /metrics r / w')
    >>> queue_load("", "r", "w")
    (None, None, '')
    """
    r, w = metric_sum(text, running), metric_sum(text, waiting)
    source = f"GET /metrics {running} / {waiting}" if r is not None or w is not None else ""
    return (None if r is None else int(r)), (None if w is None else int(w)), source
