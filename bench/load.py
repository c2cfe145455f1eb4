"""Bounded loopback load test of ``ragbudget serve``: admission control under overload.

Many concurrent clients hit ``/v1/chat/completions`` (half of them streaming) on a server whose KV
budget admits only a few requests at once. What must hold: no 5xx, no OOM, every answer is a 200 or
a 429 with ``Retry-After``, ``/health`` answers throughout, admitted KV tokens never exceed the
capacity, and the process memory returns to its baseline. Reported: throughput, p50/p99 latency,
queue wait, health latency.

    .venv/bin/python bench/load.py --quick             # simulated generator, ~10 s
    .venv/bin/python bench/load.py                     # 64 clients x 4 requests, admits 3
    .venv/bin/python bench/load.py --index-dir .ragbudget --admit 2   # the real default models
    .venv/bin/python bench/load.py --index-dir DIR --gpu 0.7GiB --clients 16 --requests 2 \
        --max-queue 8 --queue-timeout 60 --rounds 5 --max-new-tokens 8 --max-workers 16 [--no-trim --malloc-arenas 0]

Memory: the server's RSS is read after a garbage collection and 1.5 s of idleness, at baseline
(after one warm-up request) and after every round; it must plateau, not climb round after round.
``--no-trim --malloc-arenas 0`` runs the server as it was before the fix (glibc keeps the freed
heap of every worker thread's arena), for the before/after comparison.

The simulated pipeline sleeps per token (no model) but uses ragbudget's real AdmissionController
when it is importable, so the admission path is the production one. Loopback addresses only; every
run is bounded in requests and time. There is no peer library for this check, so no ratio column.
Writes ``bench/out/load.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without relying on the editable install
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


# --- the simulated pipeline -----------------------------------------------------------------------


class _LocalAdmission:
    """Fallback when ragbudget.memory.admission is not available: summed reservations under a capacity,
    a bounded wait queue and a wait timeout."""

    def __init__(self, capacity_tokens: int, *, max_queue: int, timeout: float) -> None:
        from ragbudget.errors import OverloadedError

        self._overloaded = OverloadedError
        self.capacity_tokens = capacity_tokens
        self.max_queue = max_queue
        self.timeout = timeout
        self.admitted_tokens = 0
        self.running = 0
        self.queued = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def reserve(self, tokens: int) -> Iterator[None]:
        with self._cond:
            if self.admitted_tokens + tokens > self.capacity_tokens:
                if self.queued >= self.max_queue:
                    raise self._overloaded("queue full", retry_after=1.0)
                self.queued += 1
                try:
                    ok = self._cond.wait_for(
                        lambda: self.admitted_tokens + tokens <= self.capacity_tokens, self.timeout
                    )
                finally:
                    self.queued -= 1
                if not ok:
                    raise self._overloaded("wait timed out", retry_after=1.0)
            self.admitted_tokens += tokens
            self.running += 1
        try:
            yield
        finally:
            with self._cond:
                self.admitted_tokens -= tokens
                self.running -= 1
                self._cond.notify_all()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "running": self.running,
                "queued": self.queued,
                "admitted_tokens": self.admitted_tokens,
                "capacity_tokens": self.capacity_tokens,
            }


def _admission(capacity: int, max_queue: int, timeout: float) -> tuple[Any, str]:
    try:
        from ragbudget.memory.admission import AdmissionController

        return AdmissionController(capacity, max_queue=max_queue, timeout=timeout), "ragbudget.memory.admission"
    except ImportError:
        return _LocalAdmission(capacity, max_queue=max_queue, timeout=timeout), "bench-local"


@dataclass
class _Answer:
    text: str
    sources: list[dict[str, Any]]
    report: dict[str, Any]


class SimulatedPipeline:
    """A pipeline surface (``ask``/``retrieve``/``search``/``admission``/``generator``) whose
    generation is ``words`` sleeps of ``token_delay`` seconds, each request reserving
    ``per_request`` KV tokens. Allocates a small buffer per request so that a leak would show in
    the memory check."""

    def __init__(
        self,
        *,
        admit: int,
        per_request: int = 2048,
        max_queue: int = 8,
        timeout: float = 2.0,
        words: int = 32,
        token_delay: float = 0.01,
    ) -> None:
        self.per_request = per_request
        self.words = words
        self.token_delay = token_delay
        self.admission, self.admission_kind = _admission(admit * per_request, max_queue, timeout)
        self.generator = type("Gen", (), {"model_id": "simulated", "token_counter": None})()

    def ask(
        self,
        question: str,
        *,
        context_tokens: int | None = None,
        max_new_tokens: int | None = None,
        on_text: Any = None,
        cancel: threading.Event | None = None,
        history: Any = None,
    ) -> _Answer:
        t0 = time.perf_counter()
        with self.admission.reserve(self.per_request):
            waited = time.perf_counter() - t0
            scratch = bytearray(256 * 1024)  # stands in for per-request buffers
            out = []
            for i in range(min(self.words, max_new_tokens or self.words)):
                if cancel is not None and cancel.wait(self.token_delay):
                    break
                piece = f"w{i} "
                out.append(piece)
                if on_text is not None:
                    on_text(piece)
            del scratch
        return _Answer(
            "".join(out),
            [{"path": "sim.txt", "start": 0, "end": 1, "page": None, "score": 1.0}],
            {
                "budget": {
                    "prompt_tokens": 100,
                    "context_tokens_used": 50,
                    "context_tokens_allowed": 60,
                    "max_new_tokens": max_new_tokens or self.words,
                    "kv_bytes_per_token": 0,
                    "new_tokens": len(out),
                },
                "oom_steps": [],
                "timings": {"queue_s": waited},
            },
        )

    def retrieve(self, question: str, *, context_tokens: int | None = None) -> Any:
        return type("Sel", (), {"chunks": (), "tokens_used": 0, "tokens_allowed": context_tokens or 0})()

    def search(self, query: str, k: int = 5) -> list[Any]:
        return []


# --- the load -------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    idx = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[idx]


def _one_request(http: httpx.Client, url: str, model: str, stream: bool, max_tokens: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "What does the budget allow?"}],
        "stream": stream,
    }
    if max_tokens:
        body["max_tokens"] = max_tokens
    t0 = time.perf_counter()
    out: dict[str, Any] = {"stream": stream}
    if stream:
        with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            out["status"] = r.status_code
            out["retry_after"] = r.headers.get("retry-after")
            final = None
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    data = json.loads(line[6:])
                    if "error" in data:
                        out["stream_error"] = data["error"]
                    elif data.get("choices") and data["choices"][0].get("finish_reason"):
                        final = data
            if final is not None:
                out["queue_wait"] = ((final.get("ragbudget") or {}).get("timings") or {}).get("queue_s")
    else:
        r = http.post(url + "/v1/chat/completions", json=body)
        out["status"] = r.status_code
        out["retry_after"] = r.headers.get("retry-after")
        if r.status_code == 200:
            out["queue_wait"] = ((r.json().get("ragbudget") or {}).get("timings") or {}).get("queue_s")
    out["latency"] = time.perf_counter() - t0
    return out


def run_load(
    url: str,
    *,
    clients: int = 64,
    requests_per_client: int = 4,
    stream_share: float = 0.5,
    model: str = "ragbudget",
    max_tokens: int | None = None,
    time_limit: float = 120.0,
    api_key: str | None = None,
    health_interval: float = 0.05,
    seed: int = 0,
) -> dict[str, Any]:
    """Drive ``clients`` concurrent clients, each sending up to ``requests_per_client`` requests
    (no new request after ``time_limit`` seconds), while a poller checks ``/health``. Returns the
    counts and latency figures. Refuses non-loopback URLs."""
    host = urlparse(url).hostname or ""
    if host not in LOOPBACK:
        raise SystemExit(f"refusing to load-test {host!r}: loopback addresses only")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    plan = [[rng.random() < stream_share for _ in range(requests_per_client)] for _ in range(clients)]
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    deadline = time.monotonic() + time_limit
    done = threading.Event()
    health = {"ok": 0, "failed": 0, "latencies": [], "max_admitted": 0, "max_queued": 0, "max_running": 0}

    def poll_health() -> None:
        with httpx.Client(timeout=10, headers=headers) as http:
            while not done.is_set():
                t0 = time.perf_counter()
                try:
                    r = http.get(url + "/health")
                    ok = r.status_code == 200
                    data = r.json() if ok else {}
                except httpx.HTTPError:
                    ok, data = False, {}
                health["latencies"].append(time.perf_counter() - t0)
                health["ok" if ok else "failed"] += 1
                for key, field in (
                    ("max_admitted", "admitted_tokens"),
                    ("max_queued", "queued"),
                    ("max_running", "running"),
                ):
                    if isinstance(data.get(field), (int, float)):
                        health[key] = max(health[key], data[field])
                done.wait(health_interval)

    def client(streams: list[bool]) -> None:
        with httpx.Client(timeout=httpx.Timeout(120, connect=10), headers=headers) as http:
            for stream in streams:
                if time.monotonic() > deadline:
                    return
                try:
                    res = _one_request(http, url, model, stream, max_tokens)
                except httpx.HTTPError as exc:
                    res = {"status": None, "transport_error": type(exc).__name__, "stream": stream}
                with lock:
                    results.append(res)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(streams,), daemon=True) for streams in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, deadline - time.monotonic() + 60))
    wall = time.perf_counter() - t0
    done.set()
    poller.join(timeout=10)

    statuses: dict[str, int] = {}
    for r in results:
        key = str(r.get("status"))
        statuses[key] = statuses.get(key, 0) + 1
    ok = [r for r in results if r.get("status") == 200 and "stream_error" not in r]
    rejected = [r for r in results if r.get("status") == 429]
    waits = [r["queue_wait"] for r in ok if isinstance(r.get("queue_wait"), (int, float))]
    return {
        "clients": clients,
        "requests": len(results),
        "statuses": statuses,
        "errors_5xx": sum(1 for r in results if (r.get("status") or 0) >= 500),
        "stream_errors": sum(1 for r in results if "stream_error" in r),
        "transport_errors": sum(1 for r in results if r.get("transport_error")),
        "missing_retry_after": sum(1 for r in rejected if not r.get("retry_after")),
        "wall_s": round(wall, 3),
        "throughput_rps": round(len(ok) / wall, 3) if wall else None,
        "latency_ok_p50_s": _pct([r["latency"] for r in ok], 0.5),
        "latency_ok_p99_s": _pct([r["latency"] for r in ok], 0.99),
        "latency_429_p50_s": _pct([r["latency"] for r in rejected], 0.5),
        "latency_429_p99_s": _pct([r["latency"] for r in rejected], 0.99),
        "queue_wait_p50_s": _pct(waits, 0.5),
        "queue_wait_p99_s": _pct(waits, 0.99),
        "queue_wait_mean_s": statistics.fmean(waits) if waits else None,
        "health": {
            "ok": health["ok"],
            "failed": health["failed"],
            "p50_s": _pct(health["latencies"], 0.5),
            "max_s": max(health["latencies"], default=None),
            "max_admitted_tokens": health["max_admitted"],
            "max_queued": health["max_queued"],
            "max_running": health["max_running"],
        },
    }


def _rss(pid: int | None = None) -> int | None:
    try:
        import psutil

        return int(psutil.Process(pid or os.getpid()).memory_info().rss)
    except Exception:
        return None


def _settle_rss(pid: int | None = None) -> int | None:
    gc.collect()
    time.sleep(1.5)  # let the server close connections, free request state and trim when idle
    return _rss(pid)


def _make_pipeline(opts: dict[str, Any]) -> tuple[Any, str, str]:
    if opts.get("index_dir"):
        from ragbudget.pipeline import Pipeline

        pipe: Any = Pipeline(
            opts["index_dir"],
            concurrency=opts["admit"],
            max_new_tokens=opts["max_new_tokens"],
            gpu=opts.get("gpu"),
            queue_size=opts["max_queue"],
            queue_timeout=opts["queue_timeout"],
        )
        pipe.ask("warm up", max_new_tokens=2)  # load the models before the baseline
        return pipe, "real", f"ragbudget.memory.admission (capacity {pipe.admission.stats().capacity_tokens} tokens)"
    pipe = SimulatedPipeline(
        admit=opts["admit"],
        max_queue=opts["max_queue"],
        timeout=opts["queue_timeout"],
        words=opts["words"],
        token_delay=opts["token_delay"],
    )
    return pipe, "simulated", pipe.admission_kind


def _serve_child(opts: dict[str, Any]) -> None:
    """Child process: serve the pipeline on an ephemeral loopback port, print the URL, and run
    until the parent closes stdin."""
    from ragbudget.server.app import background_server, create_app
    from ragbudget.server.malloc import limit_malloc_arenas

    # As `ragbudget serve` does, before the models load and any worker thread starts.
    if opts.get("malloc_arenas"):
        limit_malloc_arenas(opts["malloc_arenas"])
    pipe, mode, kind = _make_pipeline(opts)
    app = create_app(pipe, model_name="bench", max_workers=opts["max_workers"], trim_memory=opts["trim"])
    with background_server(app) as url:
        print(json.dumps({"url": url, "mode": mode, "admission": kind}), flush=True)
        # "rss" on stdin: collect garbage (an idle server may hold cyclic garbage, e.g. exception
        # frames, that the automatic GC has not reached yet) and answer the resident memory.
        for line in sys.stdin:
            if line.strip() == "rss":
                gc.collect()
                time.sleep(1.5)  # past the server's idle-trim delay (0.5 s after the last request)
                print(json.dumps({"rss": _rss()}), flush=True)


@contextlib.contextmanager
def _server(opts: dict[str, Any], *, in_process: bool) -> Iterator[tuple[str, Any, str, str]]:
    """Yield (url, a function returning the server's RSS after a garbage collection, mode,
    admission kind)."""
    if in_process:
        from ragbudget.server.app import background_server, create_app

        pipe, mode, kind = _make_pipeline(opts)
        app = create_app(pipe, model_name="bench", max_workers=opts["max_workers"], trim_memory=opts["trim"])
        with background_server(app) as url:
            yield url, _settle_rss, mode, kind
        return
    import subprocess

    # A separate process: the 64 client threads must not share the server's GIL, and its memory
    # is measured on its own.
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve-child", json.dumps(opts)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line:
            raise SystemExit("the server process did not start")
        info = json.loads(line)

        def child_rss() -> int | None:
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write("rss\n")
            child.stdin.flush()
            return json.loads(child.stdout.readline())["rss"]

        yield info["url"], child_rss, info["mode"], info["admission"]
    finally:
        if child.stdin:
            child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--defaults",
        action="store_true",
        help="Issue #14: the default `ragbudget serve` on six man pages, bursts of --bursts "
        "clients with the openai client; writes bench/results/load.json.",
    )
    ap.add_argument("--bursts", default="32,64", help="--defaults: burst sizes, comma-separated.")
    ap.add_argument("--quick", action="store_true", help="32 clients x 2 requests, short generations, 3 rounds.")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="Requests per client.")
    ap.add_argument(
        "--admit", type=int, default=3, help="Requests the KV budget admits at once (simulated / --concurrency)."
    )
    ap.add_argument("--max-queue", type=int, default=8)
    ap.add_argument("--queue-timeout", type=float, default=2.0)
    ap.add_argument("--words", type=int, default=32, help="Simulated tokens per answer.")
    ap.add_argument("--token-delay", type=float, default=0.01, help="Simulated seconds per token.")
    ap.add_argument("--index-dir", default=None, help="Serve a real Pipeline on this index instead of the simulation.")
    ap.add_argument("--gpu", default=None, help="Real mode: GPU to plan for (default: auto).")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="Real mode: output tokens per request.")
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--stream-share", type=float, default=0.5)
    ap.add_argument("--max-workers", type=int, default=64, help="Server threads for model work (create_app).")
    ap.add_argument("--rounds", type=int, default=3, help="Load rounds (memory must plateau, not grow).")
    ap.add_argument(
        "--no-trim",
        action="store_true",
        help="Server does not return freed heap to the OS when idle (create_app trim_memory=False).",
    )
    ap.add_argument(
        "--malloc-arenas",
        type=int,
        default=2,
        help="Cap glibc malloc arenas in the server as `ragbudget serve` does (0: leave the allocator alone).",
    )
    ap.add_argument("--in-process", action="store_true", help="Run the server in this process (shares the GIL).")
    ap.add_argument("--serve-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_child:
        _serve_child(json.loads(args.serve_child))
        return 0
    if args.defaults:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _results import write
        from load_defaults import main as defaults

        bursts = tuple(int(x) for x in args.bursts.split(",") if x)

        def save(out: dict[str, Any]) -> None:
            write("load", out, packages=("openai", "fastapi", "uvicorn"))

        save(defaults(bursts, on_burst=save))
        return 0
    if args.quick:
        args.clients, args.requests, args.words, args.rounds = 32, 2, 16, 3
    opts = {
        "index_dir": args.index_dir,
        "admit": args.admit,
        "max_queue": args.max_queue,
        "queue_timeout": args.queue_timeout,
        "words": args.words,
        "token_delay": args.token_delay,
        "max_new_tokens": args.max_new_tokens,
        "gpu": args.gpu,
        "max_workers": args.max_workers,
        "trim": not args.no_trim,
        "malloc_arenas": args.malloc_arenas,
    }

    with _server(opts, in_process=args.in_process) as (url, server_rss, mode, admission_kind):
        # Baseline once the server is up and one request has been served (lazy imports done).
        httpx.post(
            url + "/v1/chat/completions",
            json={"model": "bench", "messages": [{"role": "user", "content": "hi"}]},
            timeout=300,
        )
        rss_base = server_rss()
        rounds, rss_rounds = [], []
        for _ in range(args.rounds):
            rounds.append(
                run_load(
                    url,
                    clients=args.clients,
                    requests_per_client=args.requests,
                    stream_share=args.stream_share,
                    model="bench",
                    time_limit=args.time_limit,
                    max_tokens=args.max_new_tokens if args.index_dir else None,
                )
            )
            rss_rounds.append(server_rss())
        rss_after = rss_rounds[-1]
        # The figures are the first round's; later rounds only show whether memory keeps growing
        # (a leak) or plateaus (allocator high-water mark), and must keep the contract too.
        result = rounds[0]
        for later in rounds[1:]:
            for key in ("errors_5xx", "transport_errors", "stream_errors", "missing_retry_after"):
                result[key] += later[key]
            result["health"]["failed"] += later["health"]["failed"]
            for status, n in later["statuses"].items():
                result.setdefault("later_rounds_statuses", {})
                result["later_rounds_statuses"][status] = result["later_rounds_statuses"].get(status, 0) + n
        result["rss_after_each_round_mb"] = [r and round(r / 2**20, 1) for r in rss_rounds]
        metrics = httpx.get(url + "/metrics").text
    result.update(
        {
            "mode": mode,
            "admission": admission_kind,
            "admit": args.admit,
            "max_queue": args.max_queue,
            "queue_timeout_s": args.queue_timeout,
            "server": "in-process" if args.in_process else "subprocess",
            "rss_baseline_mb": rss_base and round(rss_base / 2**20, 1),
            "rss_after_mb": rss_after and round(rss_after / 2**20, 1),
            "rss_delta_mb": (rss_after - rss_base) / 2**20 if rss_after and rss_base else None,
            # Growth per round: a leak keeps it positive round after round; a plateau goes to ~0.
            "rss_growth_per_round_mb": [
                round((b - a) / 2**20, 1) for a, b in zip([rss_base, *rss_rounds], rss_rounds, strict=False)
            ]
            if rss_base and all(rss_rounds)
            else None,
            "trim_memory": not args.no_trim,
            "malloc_arenas": args.malloc_arenas or None,
            "oom_steps_total": next(
                (
                    int(line.split()[-1])
                    for line in metrics.splitlines()
                    if line.startswith("ragbudget_oom_steps_total ")
                ),
                None,
            ),
            "command": "bench/load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
    )
    ok_contract = (
        result["errors_5xx"] == 0
        and result["transport_errors"] == 0
        and result["stream_errors"] == 0
        and result["missing_retry_after"] == 0
        and result["health"]["failed"] == 0
        and set(result["statuses"]) <= {"200", "429"}
        and set(result.get("later_rounds_statuses", {})) <= {"200", "429"}
    )
    result["contract_ok"] = ok_contract

    def f(v: Any, unit: str = "") -> str:
        return "-" if v is None else (f"{v:.3f}{unit}" if isinstance(v, float) else f"{v}{unit}")

    rows = [
        (
            "mode / admission",
            f"{mode} / {admission_kind}, admits {args.admit}, queue {args.max_queue}, wait {args.queue_timeout}s "
            f"({result['server']} server)",
        ),
        (
            "clients x requests",
            f"{args.clients} x {args.requests} = {result['requests']} sent in {f(result['wall_s'], ' s')}",
        ),
        ("statuses", ", ".join(f"{k}: {v}" for k, v in sorted(result["statuses"].items()))),
        (
            "5xx / transport / stream errors",
            f"{result['errors_5xx']} / {result['transport_errors']} / {result['stream_errors']}",
        ),
        ("429 without Retry-After", str(result["missing_retry_after"])),
        ("throughput (200/s)", f(result["throughput_rps"])),
        ("latency 200 p50 / p99", f"{f(result['latency_ok_p50_s'], ' s')} / {f(result['latency_ok_p99_s'], ' s')}"),
        ("latency 429 p50 / p99", f"{f(result['latency_429_p50_s'], ' s')} / {f(result['latency_429_p99_s'], ' s')}"),
        ("queue wait p50 / p99", f"{f(result['queue_wait_p50_s'], ' s')} / {f(result['queue_wait_p99_s'], ' s')}"),
        (
            "/health ok / failed, max latency",
            f"{result['health']['ok']} / {result['health']['failed']}, {f(result['health']['max_s'], ' s')}",
        ),
        (
            "max running / queued / admitted tokens",
            f"{result['health']['max_running']} / {result['health']['max_queued']} / "
            f"{result['health']['max_admitted_tokens']}",
        ),
        ("OOM-ladder steps", f(result["oom_steps_total"])),
        (
            "RSS baseline -> after each round (MB)",
            f"{f(result['rss_baseline_mb'])} -> {result['rss_after_each_round_mb']}",
        ),
        (
            "RSS growth per round (MB)",
            f"{result['rss_growth_per_round_mb']} (trim {'on' if not args.no_trim else 'off'}, "
            f"malloc arenas {args.malloc_arenas or 'default'})",
        ),
        ("contract (only 200/429+Retry-After, health up)", "OK" if ok_contract else "VIOLATED"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    sys.path.insert(0, str(ROOT / "bench"))
    from _results import write

    write("load", result, packages=("fastapi", "uvicorn", "httpx", "psutil"))
    return 0 if ok_contract else 1


if __name__ == "__main__":
    sys.exit(main())
