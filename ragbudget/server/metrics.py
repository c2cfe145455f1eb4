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
from dataclasses import dataclass

__all__ = ["METRICS", "Metric", "Metrics", "admission_gauges", "metric_help"]


@dataclass(frozen=True)
class Metric:
    """One series ``GET /metrics`` may show: its Prometheus type, help line and labels, and when it
    is there (``shown``: empty for always)."""

    kind: str  # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ()
    shown: str = ""


_ENGINE = "with a served engine (`--engine`)"
_ADMITS_BYTES = "when admission counts bytes (a local model's memory plan)"
_TIMED = "when admission knows the model's speed"

#: Every metric the server exposes, by name: the one place its help text is written (the
#: reference page ``docs/reference/metrics.md`` is generated from it, and a test checks that every
#: ``ragbudget_*`` name under ``ragbudget/server`` is here).
METRICS: dict[str, Metric] = {
    # counters
    "ragbudget_requests_total": Metric(
        "counter", "HTTP requests answered, by endpoint and status.", ("endpoint", "status")
    ),
    "ragbudget_rejected_total": Metric("counter", "Requests refused with 429 by admission control."),
    "ragbudget_refused_before_retrieval_total": Metric(
        "counter",
        "429s answered before any retrieval or prompt building (queue full, or the first token would come "
        "past the queue time-out).",
    ),
    "ragbudget_cancelled_total": Metric("counter", "Requests whose client disconnected before the end."),
    "ragbudget_timed_out_total": Metric(
        "counter", "Chat requests stopped at the request time-out (answered 503, or their stream ended)."
    ),
    "ragbudget_request_body_timeouts_total": Metric(
        "counter", "Requests whose body paused or took too long to arrive (answered 408, connection closed)."
    ),
    "ragbudget_request_header_timeouts_total": Metric(
        "counter", "Connections whose request headers did not arrive in time (closed, with a 408 if any had come)."
    ),
    "ragbudget_oom_steps_total": Metric("counter", "Steps taken down the OOM fallback ladder."),
    "ragbudget_declined_total": Metric(
        "counter", "Questions answered 'not in the documents' without generating (under the evidence floor)."
    ),
    "ragbudget_prompt_tokens_total": Metric("counter", "Prompt tokens processed."),
    "ragbudget_completion_tokens_total": Metric("counter", "Tokens generated."),
    "ragbudget_summary_cache_turns_total": Metric(
        "counter", "History turns whose summary came from the summary cache instead of a generate call."
    ),
    # gauges: the server's own, then admission's (AdmissionStats), then a served engine's
    "ragbudget_requests_in_flight": Metric("gauge", "Chat/retrieve requests being served (running or queued)."),
    "ragbudget_running_requests": Metric("gauge", "Requests holding a KV reservation."),
    "ragbudget_queue_depth": Metric("gauge", "Requests waiting for KV admission."),
    "ragbudget_admitted_kv_tokens": Metric("gauge", "KV tokens reserved by running requests."),
    "ragbudget_kv_capacity_tokens": Metric("gauge", "KV tokens the budget admits at once."),
    "ragbudget_admission_capacity_bytes": Metric(
        "gauge", "Bytes admission counts requests against (KV + activations).", shown=_ADMITS_BYTES
    ),
    "ragbudget_admitted_bytes": Metric(
        "gauge", "KV + activation bytes reserved by running requests.", shown=_ADMITS_BYTES
    ),
    "ragbudget_peak_admitted_bytes": Metric("gauge", "Most bytes reserved at once since start.", shown=_ADMITS_BYTES),
    "ragbudget_refused_for_time_total": Metric(
        "gauge", "Requests refused because their first token would come past the queue time-out."
    ),
    "ragbudget_work_ahead_seconds": Metric(
        "gauge", "Estimated single-stream seconds of work admitted and queued.", shown=_TIMED
    ),
    "ragbudget_admission_slowdown": Metric(
        "gauge",
        "Wall seconds per measured second of model work, learnt from the requests that ran.",
        shown=_TIMED,
    ),
    "ragbudget_admission_answer_share": Metric(
        "gauge",
        "Generated over allowed new tokens of the last answers: the decode work admission expects of a request.",
        shown=_TIMED,
    ),
    "ragbudget_engine_up": Metric(
        "gauge",
        "1: the served engine answers; 0: it is unavailable (gone, loading, overloaded or broken).",
        shown=_ENGINE,
    ),
    "ragbudget_engine_admission_open": Metric(
        "gauge",
        "1: the served engine reports neither its queue nor its free KV (or they cannot be read), so requests "
        "are not refused for its load (fail open); 0: they are.",
        shown=_ENGINE,
    ),
    "ragbudget_engine_running_requests": Metric(
        "gauge", "Requests the engine runs (its metrics).", shown=_ENGINE + ", when the engine reports it"
    ),
    "ragbudget_engine_waiting_requests": Metric(
        "gauge", "Requests the engine queues (its metrics).", shown=_ENGINE + ", when the engine reports it"
    ),
    "ragbudget_engine_kv_free_tokens": Metric(
        "gauge", "Free KV tokens the engine reports.", shown=_ENGINE + ", when the engine reports it"
    ),
    "ragbudget_engine_tokenizer_requests": Metric(
        "gauge",
        "Requests sent to the engine's tokenizer and chat-template routes since start (counts are cached by "
        "text digest).",
        shown=_ENGINE + " that counts tokens itself",
    ),
    # histograms (seconds; shown once observed)
    "ragbudget_request_duration_seconds": Metric(
        "histogram", "Time from request to the last byte of the answer.", ("endpoint",), shown="once observed"
    ),
    "ragbudget_time_to_first_token_seconds": Metric(
        "histogram", "Streaming: time from request to the first text.", shown="once observed"
    ),
    "ragbudget_queue_wait_seconds": Metric(
        "histogram", "Time a request waited for KV admission.", shown="once observed"
    ),
}


def metric_help(name: str) -> str:
    """The help line of the metric ``name`` (:data:`METRICS`)."""
    return METRICS[name].help


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
            metric("ragbudget_requests_total", "counter", metric_help("ragbudget_requests_total"))
            for (endpoint, status), n in sorted(self.requests.items()):
                out.append(f"ragbudget_requests_total{_labels({'endpoint': endpoint, 'status': status})} {n}")
            for name, value in (
                ("ragbudget_rejected_total", self.rejected),
                ("ragbudget_refused_before_retrieval_total", self.refused_early),
                ("ragbudget_cancelled_total", self.cancelled),
                ("ragbudget_timed_out_total", self.timed_out),
                ("ragbudget_request_body_timeouts_total", self.body_timeouts),
                ("ragbudget_request_header_timeouts_total", self.header_timeouts),
                ("ragbudget_oom_steps_total", self.oom_steps),
                ("ragbudget_declined_total", self.declined),
                ("ragbudget_prompt_tokens_total", self.tokens_prompt),
                ("ragbudget_completion_tokens_total", self.tokens_completion),
                ("ragbudget_summary_cache_turns_total", self.summary_turns_cached),
            ):
                metric(name, "counter", metric_help(name))
                out.append(f"{name} {value}")
            metric("ragbudget_requests_in_flight", "gauge", metric_help("ragbudget_requests_in_flight"))
            out.append(f"ragbudget_requests_in_flight {self.in_flight}")
            for name, (help_, reading) in sorted(gauges.items()):
                metric(name, "gauge", help_)
                out.append(f"{name} {_fmt(reading)}")
            by_name: dict[str, list[tuple[tuple[tuple[str, str], ...], _Histogram]]] = {}
            for (name, labels), hist in self.histograms.items():
                by_name.setdefault(name, []).append((labels, hist))
            for name in sorted(by_name):
                metric(name, "histogram", METRICS[name].help if name in METRICS else name)
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


def _fmt(value: float) -> str:
    # Whole numbers without a fraction (counts, le="1"); other values in full precision (repr).
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


# The admission controller's figures (keys of ``AdmissionStats.to_dict``) exposed as gauges.
_ADMISSION_GAUGES = {
    "running": "ragbudget_running_requests",
    "queued": "ragbudget_queue_depth",
    "admitted_tokens": "ragbudget_admitted_kv_tokens",
    "capacity_tokens": "ragbudget_kv_capacity_tokens",
    "capacity_bytes": "ragbudget_admission_capacity_bytes",
    "admitted_bytes": "ragbudget_admitted_bytes",
    "peak_admitted_bytes": "ragbudget_peak_admitted_bytes",
    "refused_for_time_total": "ragbudget_refused_for_time_total",
    "work_ahead_s": "ragbudget_work_ahead_seconds",
    "slowdown": "ragbudget_admission_slowdown",
    "answer_share": "ragbudget_admission_answer_share",
}


def admission_gauges(stats: Mapping[str, float]) -> dict[str, tuple[str, float]]:
    """The gauges :meth:`Metrics.render` takes, from the admission controller's figures (those
    present in ``stats``)."""
    return {name: (metric_help(name), stats[key]) for key, name in _ADMISSION_GAUGES.items() if key in stats}
