"""``bench/load.py --defaults``: the default ``ragbudget serve`` under a burst (issue #14).

Indexes six man pages from ``../shared/data/manpages`` into a temporary index, starts ``python -m
ragbudget.cli.commands serve`` with no tuning flags (packaged models, the plan and admission a user gets;
``--expose-plan`` only so that ``/health`` shows the bytes admission holds, which the RSS is
compared with), then fires bursts of concurrent chat completions with the official ``openai`` client (600 s
time-out, no client retries; each client from its own loopback address, as separate users are: six
questions repeat among them, and the server tells identical bodies apart by caller). Each client
that gets a 429 sleeps its ``Retry-After`` and tries once more; whether that second try gets a 200
is recorded. Recorded per burst: counts of 200/429/5xx/time-outs, every Retry-After, p50/p99
latency and time to first token (streamed), the server's peak RSS (VmHWM) against the plan's
prediction (RSS after warm-up, which holds the weights and the paged KV cache allocated before
listening, + the peak of the bytes admission held, polled from ``/health``), and the host's load
average while it ran (other engineers share the cores: a busy host makes every figure slower).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
MANPAGES = ROOT.parent / "shared" / "data" / "manpages"
PAGES = (
    "clock_nanosleep.2.txt",
    "close.2.txt",
    "flock.2.txt",
    "getrlimit.2.txt",
    "gettimeofday.2.txt",
    "fanotify_mark.2.txt",
)
QUESTIONS = (
    "What does flock do when the lock is already held?",
    "How is the resource limit set?",
    "What does close return on error?",
    "Which clocks can clock_nanosleep use?",
    "What is the timezone argument of gettimeofday for?",
    "What does fanotify_mark mark?",
)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def _hwm(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _one(client: Any, i: int, max_tokens: int | None) -> dict[str, Any]:
    import openai

    t0 = time.perf_counter()
    out: dict[str, Any] = {"client": i}
    try:
        kw: dict[str, Any] = {"max_tokens": max_tokens} if max_tokens else {}
        stream = client.chat.completions.create(
            model="ragbudget", stream=True, messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], **kw
        )
        first = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - t0
        out.update(status=200, ttft_s=first)
    except openai.APITimeoutError:
        out.update(status="timeout")
    except openai.APIStatusError as exc:
        out.update(status=exc.status_code, retry_after=exc.response.headers.get("retry-after"), message=str(exc)[:300])
    except openai.APIConnectionError as exc:
        out.update(status="connection_error", message=str(exc)[:300])
    except openai.APIError as exc:  # an error event inside a 200 stream: the answer failed
        out.update(status="stream_error", message=str(exc)[:300])
    out["latency_s"] = round(time.perf_counter() - t0, 3)
    return out


def burst(
    base: str,
    n: int,
    *,
    pid: int | None,
    max_tokens: int | None,
    timeout: float = 600.0,
    retry_deadline: float | None = None,
) -> dict[str, Any]:
    """``n`` concurrent streamed chat completions, each client refused with 429 sleeping its
    ``Retry-After`` and asking once more. ``timeout``: each request's time-out (a time-out is
    recorded, never retried). ``retry_deadline`` (``time.monotonic()``): a client whose
    ``Retry-After`` ends past it does not come back and is counted in ``retries_past_deadline``
    (a bounded run, e.g. the GPU check, cannot wait for every promise)."""
    import openai

    # Each client is its own caller, as separate users are: its own loopback address (the
    # server keys a refused request's promise by caller and body, and the questions repeat).
    clients = [
        openai.OpenAI(
            base_url=f"{base}/v1",
            api_key="none",
            timeout=timeout,
            max_retries=0,
            http_client=httpx.Client(
                transport=httpx.HTTPTransport(local_address=f"127.0.{1 + i // 250}.{1 + i % 250}")
            ),
        )
        for i in range(n)
    ]
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    health: list[dict[str, Any]] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                health.append(
                    httpx.get(f"{base}/health", timeout=5).json() | {"t": time.time(), "load_1m": os.getloadavg()[0]}
                )
            except Exception as exc:  # noqa: BLE001 - recorded: /health must answer throughout
                health.append({"error": str(exc), "t": time.time(), "load_1m": os.getloadavg()[0]})
            done.wait(0.5)

    def run(i: int) -> None:
        first = _one(clients[i], i, max_tokens)
        results[i] = {"first": first}
        if first.get("status") == 429 and first.get("retry_after"):
            wait = float(first["retry_after"])
            if retry_deadline is not None and time.monotonic() + wait > retry_deadline:
                results[i]["retry_past_deadline"] = wait
                return
            time.sleep(wait)
            results[i]["retry"] = _one(clients[i], i, max_tokens)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    poller.join()
    firsts = [r["first"] for r in results]
    retries = [r["retry"] for r in results if "retry" in r]

    def counts(rs: list[dict[str, Any]]) -> dict[str, int]:
        c: dict[str, int] = {}
        for r in rs:
            s = r.get("status")
            key = "5xx" if isinstance(s, int) and s >= 500 else str(s)
            c[key] = c.get(key, 0) + 1
        return c

    ok = [r for r in firsts + retries if r.get("status") == 200]
    loads = [h["load_1m"] for h in health if "load_1m" in h]
    return {
        "clients": n,
        "wall_s": round(time.perf_counter() - t0, 1),
        "first_try": counts(firsts),
        "retries": counts(retries),
        "retry_after_s": [r.get("retry_after") for r in firsts if r.get("status") == 429],
        "honoured_retry_got_200": sum(1 for r in retries if r.get("status") == 200),
        "honoured_retries": len(retries),
        "retries_past_deadline": sum(1 for r in results if "retry_past_deadline" in r),
        "latency_p50_s": _pct([r["latency_s"] for r in ok], 0.5),
        "latency_p99_s": _pct([r["latency_s"] for r in ok], 0.99),
        "ttft_p50_s": _pct([r["ttft_s"] for r in ok if r.get("ttft_s")], 0.5),
        "ttft_p99_s": _pct([r["ttft_s"] for r in ok if r.get("ttft_s")], 0.99),
        "health_errors": sum(1 for h in health if "error" in h),
        "load_1m_during": {
            "min": round(min(loads), 2),
            "mean": round(statistics.mean(loads), 2),
            "max": round(max(loads), 2),
        }
        if loads
        else None,
        "refused_for_time_total": max((h.get("refused_for_time_total", 0) for h in health), default=0),
        "capacity_bytes": next((h["capacity_bytes"] for h in health if "capacity_bytes" in h), None),
        "capacity_tokens": next((h["capacity_tokens"] for h in health if "capacity_tokens" in h), None),
        "peak_running": max((h.get("running", 0) for h in health), default=0),
        "peak_admitted_tokens": max((h.get("admitted_tokens", 0) for h in health), default=0),
        "peak_admitted_bytes": max((h.get("peak_admitted_bytes", 0) or 0 for h in health), default=0),
        "peak_rss_bytes": _hwm(pid) if pid is not None else None,
        "rows": results,
    }


def main(bursts: tuple[int, ...] = (32, 64), max_tokens: int | None = None, on_burst: Any = None) -> dict[str, Any]:
    """Run the bursts; ``on_burst(out)`` after each one (the caller writes the partial result, so
    a run stopped half-way still leaves its raw figures)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        docs = Path(tmp) / "docs"
        docs.mkdir()
        for p in PAGES:
            (docs / p).write_bytes((MANPAGES / p).read_bytes())
        index = Path(tmp) / "index"
        subprocess.run(
            [py, "-m", "ragbudget.cli.commands", "index", str(docs), "--index-dir", str(index)],
            check=True,
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(Path(tmp) / "serve.log", "w")  # noqa: SIM115 - the server's stdout for its whole life
        server = subprocess.Popen(
            [
                py,
                "-m",
                "ragbudget.cli.commands",
                "serve",
                "--index-dir",
                str(index),
                "--port",
                str(port),
                "--expose-plan",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 600
            while time.time() < deadline:
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    raise SystemExit(Path(tmp, "serve.log").read_text()[-3000:])
                time.sleep(1)
            baseline = _rss(server.pid)
            # The high-water mark after warm-up (the speed probe's prefills pass through it): a
            # burst's peak RSS below it is the warm-up's, not the burst's.
            out: dict[str, Any] = {
                "baseline_rss_bytes": baseline,
                "warmup_peak_rss_bytes": _hwm(server.pid),
                "load_1m_at_start": os.getloadavg()[0],
                "cpu_count": os.cpu_count(),
                "bursts": [],
            }
            for n in bursts:
                r = burst(base, n, pid=server.pid, max_tokens=max_tokens)
                r["predicted_peak_rss_bytes"] = (baseline or 0) + r["peak_admitted_bytes"]
                if r["peak_rss_bytes"] and r["predicted_peak_rss_bytes"]:
                    r["rss_vs_prediction"] = round(r["peak_rss_bytes"] / r["predicted_peak_rss_bytes"], 3)
                out["bursts"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "rows"}), flush=True)
                if on_burst is not None:
                    on_burst(dict(out, partial=len(out["bursts"]) < len(bursts)))
        finally:
            server.terminate()
            server.wait(30)
            log.close()
            out_log = Path(tmp, "serve.log").read_text()
        out["serve_log_tail"] = out_log[-4000:]
        return out
