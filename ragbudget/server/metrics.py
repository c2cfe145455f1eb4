"""The server's counters and latency histograms, rendered in the Prometheus text format (0.0.4)
for ``GET /metrics``. No client library: a handful of counters and three histograms do not
justify one, and the text format is a few lines.

>>> m = Metrics()
>>> m.count_request("/v1/chat/completions", 429)
>>> m.observe("ragbudget_queue_wait_seconds", 0.3)
>>> text = m.render({"ragbudget_queue_depth": ("Requests waiting for KV admission.", 2)})
>>> [line for line in text.splitlines() if line.startswith(("ragbudget_rejected", "ragbudget_queue_depth"))]
['ragbudget_rejected_total 1', 'ragbudget_queue_depth 2']
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

__all__ = ["Metrics", "admission_gauges"]

# Latency buckets (seconds): from a cached answer on a GPU to a long CPU generation.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count) for one label set."""

    def __init__(self, buckets: Sequence[float] = _BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last slot is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value
        self.count += 1


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""

    def escaped(v: str) -> str:  # Prometheus label values: backslash and double quote escaped
        return str(v).replace("\\", "\\\\").replace('"', '\\"')

    inner = ",".join(f'{k}="{escaped(v)}"' for k, v in sorted(pairs.items()))
    return "{" + inner + "}"


class Metrics:
    """Counters and histograms of the server, rendered in the Prometheus text format (0.0.4).

    Thread-safe: observations come from the event loop and from worker threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.oom_steps = 0
        self.declined = 0
        self.cancelled = 0
        self.timed_out = 0
        self.body_timeouts = 0
        self.header_timeouts = 0
        self.rejected = 0
        self.refused_early = 0  # of those, refused before their prompt was built
        self.tokens_prompt = 0
        self.tokens_completion = 0
        self.summary_turns_cached = 0
        self.in_flight = 0
        self.histograms: dict[tuple[str, tuple[tuple[str, str], ...]], _Histogram] = {}

    def count_request(self, endpoint: str, status: int) -> None:
        """One HTTP answer; a 429 also counts as rejected."""
        with self._lock:
            key = (endpoint, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1
            if status == 429:
                self.rejected += 1

    def observe(self, name: str, value: float, **labels: str) -> None:
        """One observation of histogram ``name`` for the label set ``labels``."""
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            hist = self.histograms.get(key)
            if hist is None:
                hist = self.histograms[key] = _Histogram()
            hist.observe(value)

    def add(self, field: str, value: int = 1) -> None:
        """Add ``value`` to the counter (or the ``in_flight`` gauge) named ``field``."""
        with self._lock:
            setattr(self, field, getattr(self, field) + value)

    def render(self, gauges: Mapping[str, tuple[str, float]]) -> str:
        """The exposition text; ``gauges`` maps metric name to (help, value) read at scrape time."""
        out: list[str] = []

        def metric(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        with self._lock:
            metric("ragbudget_requests_total", "counter", "HTTP requests answered, by endpoint and status.")
            for (endpoint, status), n in sorted(self.requests.items()):
                out.append(f"ragbudget_requests_total{_labels({'endpoint': endpoint, 'status': status})} {n}")
            for name, help_, value in (
                ("ragbudget_rejected_total", "Requests refused with 429 by admission control.", self.rejected),
                (
                    "ragbudget_refused_before_retrieval_total",
                    (
                        "429s answered before any retrieval or prompt building (queue full, or the "
                        "first token would come past the queue time-out)."
                    ),
                    self.refused_early,
                ),
                ("ragbudget_cancelled_total", "Requests whose client disconnected before the end.", self.cancelled),
                (
                    "ragbudget_timed_out_total",
                    "Chat requests stopped at the request time-out (answered 503, or their stream ended).",
                    self.timed_out,
                ),
                (
                    "ragbudget_request_body_timeouts_total",
                    "Requests whose body paused or took too long to arrive (answered 408, connection closed).",
                    self.body_timeouts,
                ),
                (
                    "ragbudget_request_header_timeouts_total",
                    "Connections whose request headers did not arrive in time (closed, with a 408 if any had come).",
                    self.header_timeouts,
                ),
                ("ragbudget_oom_steps_total", "Steps taken down the OOM fallback ladder.", self.oom_steps),
                (
                    "ragbudget_declined_total",
                    "Questions answered 'not in the documents' without generating (under the evidence floor).",
                    self.declined,
                ),
                ("ragbudget_prompt_tokens_total", "Prompt tokens processed.", self.tokens_prompt),
                ("ragbudget_completion_tokens_total", "Tokens generated.", self.tokens_completion),
                (
                    "ragbudget_summary_cache_turns_total",
                    "History turns whose summary came from the summary cache instead of a generate call.",
                    self.summary_turns_cached,
                ),
            ):
                metric(name, "counter", help_)
                out.append(f"{name} {value}")
            metric("ragbudget_requests_in_flight", "gauge", "Chat/retrieve requests being served (running or queued).")
            out.append(f"ragbudget_requests_in_flight {self.in_flight}")
            for name, (help_, reading) in sorted(gauges.items()):
                metric(name, "gauge", help_)
                out.append(f"{name} {_fmt(reading)}")
            by_name: dict[str, list[tuple[tuple[tuple[str, str], ...], _Histogram]]] = {}
            for (name, labels), hist in self.histograms.items():
                by_name.setdefault(name, []).append((labels, hist))
            for name in sorted(by_name):
                metric(name, "histogram", _HISTOGRAM_HELP.get(name, name))
                for labels, hist in sorted(by_name[name], key=lambda x: x[0]):
                    base = dict(labels)
                    cumulative = 0
                    for bound, n in zip(hist.buckets, hist.counts, strict=False):  # counts may add +Inf
                        cumulative += n
                        out.append(f"{name}_bucket{_labels({**base, 'le': _fmt(bound)})} {cumulative}")
                    cumulative += hist.counts[-1]
                    out.append(f"{name}_bucket{_labels({**base, 'le': '+Inf'})} {cumulative}")
                    out.append(f"{name}_sum{_labels(base)} {_fmt(hist.sum)}")
                    out.append(f"{name}_count{_labels(base)} {hist.count}")
        return "\n".join(out) + "\n"


_HISTOGRAM_HELP = {
    "ragbudget_request_duration_seconds": "Time from request to the last byte of the answer.",
    "ragbudget_time_to_first_token_seconds": "Streaming: time from request to the first text.",
    "ragbudget_queue_wait_seconds": "Time a request waited for KV admission.",
}


def _fmt(value: float) -> str:
    # Whole numbers without a fraction (counts, le="1"); other values in full precision (repr).
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


# The admission controller's figures (keys of ``AdmissionStats.to_dict``) exposed as gauges.
_ADMISSION_GAUGES = {
    "running": ("ragbudget_running_requests", "Requests holding a KV reservation."),
    "queued": ("ragbudget_queue_depth", "Requests waiting for KV admission."),
    "admitted_tokens": ("ragbudget_admitted_kv_tokens", "KV tokens reserved by running requests."),
    "capacity_tokens": ("ragbudget_kv_capacity_tokens", "KV tokens the budget admits at once."),
    "capacity_bytes": (
        "ragbudget_admission_capacity_bytes",
        "Bytes admission counts requests against (KV + activations).",
    ),
    "admitted_bytes": ("ragbudget_admitted_bytes", "KV + activation bytes reserved by running requests."),
    "peak_admitted_bytes": ("ragbudget_peak_admitted_bytes", "Most bytes reserved at once since start."),
    "refused_for_time_total": (
        "ragbudget_refused_for_time_total",
        "Requests refused because their first token would come past the queue time-out.",
    ),
    "work_ahead_s": (
        "ragbudget_work_ahead_seconds",
        "Estimated single-stream seconds of work admitted and queued.",
    ),
    "slowdown": (
        "ragbudget_admission_slowdown",
        "Wall seconds per measured second of model work, learnt from the requests that ran.",
    ),
}


def admission_gauges(stats: Mapping[str, float]) -> dict[str, tuple[str, float]]:
    """The gauges :meth:`Metrics.render` takes, from the admission controller's figures (those
    present in ``stats``)."""
    return {name: (help_, stats[key]) for key, (name, help_) in _ADMISSION_GAUGES.items() if key in stats}
