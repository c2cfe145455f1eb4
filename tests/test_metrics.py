"""ragbudget.server.metrics: the Prometheus text the server's /metrics answers (format 0.0.4)."""

from __future__ import annotations

import threading

from ragbudget.server.metrics import Metrics, admission_gauges


def samples(text: str) -> dict[str, str]:
    """The exposition's sample lines, ``name{labels}`` -> value (comments left out)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = value
    return out


def test_metrics_exposition_format() -> None:
    m = Metrics()
    m.count_request("/v1/chat/completions", 200)
    m.count_request("/v1/chat/completions", 429)
    m.observe("ragbudget_queue_wait_seconds", 0.3)
    m.observe("ragbudget_queue_wait_seconds", 99.0)
    text = m.render({"ragbudget_queue_depth": ("Requests waiting.", 2)})
    assert "# TYPE ragbudget_queue_wait_seconds histogram" in text
    assert 'ragbudget_queue_wait_seconds_bucket{le="0.25"} 0' in text
    assert 'ragbudget_queue_wait_seconds_bucket{le="0.5"} 1' in text
    assert 'ragbudget_queue_wait_seconds_bucket{le="+Inf"} 2' in text
    assert "ragbudget_queue_wait_seconds_count 2" in text
    assert "ragbudget_rejected_total 1" in text
    assert "ragbudget_queue_depth 2" in text
    assert text.endswith("\n")


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    m = Metrics()
    # A value on a bound falls in that bucket (le = "less or equal"); one past the last bound
    # only in +Inf.
    for value in (0.005, 0.0051, 1.0, 120.0, 500.0):
        m.observe("ragbudget_request_duration_seconds", value, endpoint="/v1/retrieve")
    got = samples(m.render({}))
    bucket = 'ragbudget_request_duration_seconds_bucket{endpoint="/v1/retrieve",le="%s"}'
    assert got[bucket % "0.005"] == "1"
    assert got[bucket % "0.01"] == "2"
    assert got[bucket % "0.5"] == "2"
    assert got[bucket % "1"] == "3"  # whole bounds without ".0"
    assert got[bucket % "120"] == "4"
    assert got[bucket % "+Inf"] == "5"
    assert got['ragbudget_request_duration_seconds_count{endpoint="/v1/retrieve"}'] == "5"
    assert float(got['ragbudget_request_duration_seconds_sum{endpoint="/v1/retrieve"}']) == sum(
        (0.005, 0.0051, 1.0, 120.0, 500.0)
    )
    # Bucket counts never go down along the bounds.
    counts = [int(v) for k, v in got.items() if k.startswith("ragbudget_request_duration_seconds_bucket")]
    assert counts == sorted(counts)


def test_label_sets_are_kept_apart_and_values_escaped() -> None:
    m = Metrics()
    m.observe("ragbudget_request_duration_seconds", 0.1, endpoint="/v1/retrieve")
    m.observe("ragbudget_request_duration_seconds", 0.1, endpoint='a"b\\c')
    m.count_request("other", 404)
    text = m.render({})
    got = samples(text)
    assert got['ragbudget_request_duration_seconds_count{endpoint="/v1/retrieve"}'] == "1"
    assert got['ragbudget_request_duration_seconds_count{endpoint="a\\"b\\\\c"}'] == "1"
    # Labels in name order; one HELP/TYPE per metric, not per label set.
    assert got['ragbudget_requests_total{endpoint="other",status="404"}'] == "1"
    assert text.count("# TYPE ragbudget_request_duration_seconds histogram") == 1
    assert "# HELP ragbudget_request_duration_seconds Time from request to the last byte" in text


def test_counters_gauges_and_in_flight() -> None:
    m = Metrics()
    m.add("tokens_prompt", 120)
    m.add("tokens_prompt", 30)
    m.add("in_flight", 2)
    m.add("in_flight", -1)
    got = samples(m.render({"ragbudget_kv_capacity_tokens": ("KV tokens.", 2048.0), "ragbudget_slowdown": ("x", 1.5)}))
    assert got["ragbudget_prompt_tokens_total"] == "150"
    assert got["ragbudget_requests_in_flight"] == "1"
    assert got["ragbudget_kv_capacity_tokens"] == "2048"
    assert got["ragbudget_slowdown"] == "1.5"
    assert got["ragbudget_rejected_total"] == "0"  # every counter is exposed from the start


def test_slow_clients_cut_off_are_counted_apart() -> None:
    m = Metrics()
    m.add("body_timeouts")
    m.add("body_timeouts")
    m.add("header_timeouts")
    got = samples(m.render({}))
    assert got["ragbudget_request_body_timeouts_total"] == "2"
    assert got["ragbudget_request_header_timeouts_total"] == "1"


def test_counting_from_many_threads_loses_nothing() -> None:
    m = Metrics()

    def hammer() -> None:
        for _ in range(2000):
            m.count_request("/v1/chat/completions", 200)
            m.add("tokens_completion", 1)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = samples(m.render({}))
    assert got['ragbudget_requests_total{endpoint="/v1/chat/completions",status="200"}'] == "8000"
    assert got["ragbudget_completion_tokens_total"] == "8000"


def test_admission_gauges_take_the_figures_present() -> None:
    gauges = admission_gauges({"queued": 3, "capacity_tokens": 4096, "not_a_figure": 1})
    assert set(gauges) == {"ragbudget_queue_depth", "ragbudget_kv_capacity_tokens"}
    assert gauges["ragbudget_queue_depth"] == ("Requests waiting for KV admission.", 3)
    assert admission_gauges({}) == {}
