"""Replay servers: one in-process HTTP server per engine kind that answers with the bodies, metric
lines and error bodies the engine's current sources produce (each shape cites its source file),
so every branch of :mod:`ragbudget.generation.engines` runs without a GPU or a model.

Tokenization is a stand-in (one token per whitespace-separated word, a fixed cost per chat turn),
the same on every route of a server, so counts agree across routes exactly as a real engine's do.
Error *messages* are the engines' wording where the source gives it; the client never parses
them — it branches on status codes and structured fields only.

    with Replay("vllm") as srv:
        backend = connect(srv.url)
        srv.push("POST", "/v1/chat/completions", overloaded("vllm", retry_after=0.1))
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Replay", "Resp", "overloaded", "render_count", "words"]

CREATED = 1764547200
#: The stand-in chat template costs this many tokens per turn, plus GEN_PROMPT for the
#: assistant's opening (ChatML-like: `<|im_start|>role\n … <|im_end|>\n`).
PER_TURN, GEN_PROMPT = 4, 3


def words(text: str) -> int:
    return len(text.split())


def render_count(messages: list[dict[str, str]]) -> int:
    return sum(words(m["content"]) + PER_TURN for m in messages) + GEN_PROMPT


def render_text(messages: list[dict[str, str]]) -> str:
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + "<|im_start|>assistant\n"


@dataclass
class Resp:
    """A scripted answer: a JSON body, a text body, or a stream of lines (``sse``/``ndjson``,
    ``gap`` seconds apart); ``delay`` seconds of silence first (a hung server)."""

    status: int = 200
    json: Any = None
    text: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    lines: list[str] | None = None
    content_type: str = "application/json"
    gap: float = 0.0
    delay: float = 0.0


# -- per-engine shapes ----------------------------------------------------------------------------
ANSWER = ["The", "Project", "Leader", "is", "elected", "by", "the", "developers", "every", "year"]


def _answer(max_tokens: int, stop: list[str] | None = None) -> tuple[list[str], str]:
    out = ANSWER[:max_tokens]
    finish = "length" if max_tokens < len(ANSWER) else "stop"
    if stop:
        for i, w in enumerate(out):
            if w in stop:
                return out[:i], "stop"
    return out, finish


class Engine:
    """Routes of one engine kind. Subclasses fill in the shapes."""

    kind = "openai"
    model = "acme/chat-1"
    max_len = 2048

    def __init__(self, server: Replay) -> None:
        self.s = server

    def routes(self) -> dict[tuple[str, str], Callable[[Any], Resp]]:
        return {("GET", "/v1/models"): lambda b: Resp(json=self.models()), ("POST", "/v1/chat/completions"): self.chat}

    def models(self) -> Any:
        return {
            "object": "list",
            "data": [{"id": self.model, "object": "model", "created": CREATED, "owned_by": "acme"}],
        }

    def error(self, status: int, message: str) -> Resp:
        # The OpenAI error shape: {"error": {"message", "type", "param", "code"}}.
        return Resp(
            status, {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
        )

    def too_long(self, n_prompt: int, max_tokens: int) -> Resp | None:
        if n_prompt + max_tokens > self.max_len:
            return self.error(
                400,
                f"This model's maximum context length is {self.max_len} "
                f"tokens. However, you requested {n_prompt + max_tokens}.",
            )
        return None

    def chat(self, body: Any) -> Resp:
        msgs = body["messages"]
        n_prompt = render_count(msgs)
        max_tokens = int(body.get("max_tokens") or 16)
        err = self.too_long(n_prompt, max_tokens)
        if err is not None:
            return err
        out, finish = _answer(max_tokens, body.get("stop"))
        usage = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + len(out), "completion_tokens": len(out)}
        if body.get("stream"):
            return self.chat_stream(out, finish, usage, bool((body.get("stream_options") or {}).get("include_usage")))
        return Resp(json=self.chat_body(" ".join(out), finish, usage))

    def final_fields(self, usage: dict[str, int]) -> dict[str, Any]:
        """Fields an engine adds to its answer's last event (or whole answer) beside OpenAI's."""
        return {}

    def chat_body(self, text: str, finish: str, usage: dict[str, int]) -> Any:
        return {
            **self.final_fields(usage),
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": CREATED,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish,
                }
            ],
            "usage": usage,
        }

    def chunk(self, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    def chat_stream(self, out: list[str], finish: str, usage: dict[str, int], include_usage: bool) -> Resp:
        events = [self.chunk({"role": "assistant", "content": ""}, None)]
        events += [self.chunk({"content": (" " if i else "") + w}, None) for i, w in enumerate(out)]
        events.append({**self.chunk({}, finish), **self.final_fields(usage)})
        if include_usage:  # an empty `choices` and the usage, as the OpenAI spec says
            events.append(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "created": CREATED,
                    "model": self.model,
                    "choices": [],
                    "usage": usage,
                }
            )
        lines = [f"data: {json.dumps(e)}" for e in events] + ["data: [DONE]"]
        return Resp(lines=lines, content_type="text/event-stream", gap=self.s.stream_gap)


class VLLM(Engine):
    kind, model, max_len = "vllm", "Qwen/Qwen3-8B", 8192
    # KV: 100000 tokens (group-aware), 25% in use → 75000 free; blocks × size would say 102400.
    kv_tokens, blocks, block_size, usage = 100000, 6400, 16, 0.25

    def routes(self) -> dict[tuple[str, str], Callable[[Any], Resp]]:
        r = super().routes()
        r.update(
            {
                ("GET", "/version"): lambda b: Resp(json={"version": "0.11.2"}),
                ("GET", "/metrics"): lambda b: Resp(text=self.metrics(), content_type="text/plain"),
                ("POST", "/tokenize"): self.tokenize,
                ("GET", "/health"): lambda b: Resp(text=""),
            }
        )
        return r

    def models(self) -> Any:
        # ModelCard / ModelPermission, vllm/entrypoints/openai/engine/protocol.py
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model,
                    "object": "model",
                    "created": CREATED,
                    "owned_by": "vllm",
                    "root": self.model,
                    "parent": None,
                    "max_model_len": self.max_len,
                    "permission": [
                        {
                            "id": "modelperm-1",
                            "object": "model_permission",
                            "created": CREATED,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }

    def metrics(self) -> str:
        # PrometheusStatLogger (vllm/v1/metrics/loggers.py): labels model_name, engine. The
        # cache_config_info labels are CacheConfig.metrics_info() — every field as str, "None"
        # when unset (vllm/config/cache.py); a subset of the fields is replayed here.
        lab = f'engine="0",model_name="{self.model}"'
        size = "None" if self.s.options.get("no_kv_size") else str(self.kv_tokens)
        info = (
            f'block_size="{self.block_size}",cache_dtype="auto",'
            f'enable_prefix_caching="True",gpu_memory_utilization="0.9",'
            f'kv_cache_max_concurrency="12.2",kv_cache_memory_bytes="None",'
            f'kv_cache_size_tokens="{size}",mamba_block_size="None",'
            f'num_cpu_blocks="None",num_gpu_blocks="{self.blocks}",'
            f'prefix_caching_hash_algo="sha256",engine="0"'
        )
        return (
            "\n".join(
                [
                    "# HELP vllm:num_requests_running Number of requests in model execution batches.",
                    "# TYPE vllm:num_requests_running gauge",
                    f"vllm:num_requests_running{{{lab}}} 3.0",
                    "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
                    "# TYPE vllm:num_requests_waiting gauge",
                    f"vllm:num_requests_waiting{{{lab}}} 1.0",
                    "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
                    "# TYPE vllm:kv_cache_usage_perc gauge",
                    f"vllm:kv_cache_usage_perc{{{lab}}} {self.usage}",
                    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                    "# TYPE vllm:cache_config_info gauge",
                    f"vllm:cache_config_info{{{info}}} 1.0",
                    "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
                    "# TYPE vllm:prompt_tokens_total counter",
                    f"vllm:prompt_tokens_total{{{lab}}} 5120.0",
                ]
            )
            + "\n"
        )

    def tokenize(self, body: Any) -> Resp:
        # TokenizeResponse {count, max_model_len, tokens, token_strs}
        n = render_count(body["messages"]) if "messages" in body else words(body["prompt"])
        return Resp(json={"count": n, "max_model_len": self.max_len, "tokens": list(range(n)), "token_strs": None})

    def error(self, status: int, message: str) -> Resp:
        # ErrorResponse {"error": ErrorInfo{message, type, param, code:int}}
        kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(status, "Error")
        return Resp(status, {"error": {"message": message, "type": kind, "param": None, "code": status}})


class SGLang(Engine):
    kind, model, max_len = "sglang", "qwen/qwen2.5-0.5b-instruct", 32768
    total, used = 200000, 50000

    def routes(self) -> dict[tuple[str, str], Callable[[Any], Resp]]:
        r = super().routes()
        r.update(
            {
                ("GET", "/get_server_info"): lambda b: Resp(json=self.server_info()),
                ("POST", "/v1/tokenize"): self.tokenize,
                ("GET", "/metrics"): lambda b: Resp(text=self.metrics(), content_type="text/plain"),
            }
        )
        return r

    def models(self) -> Any:
        # ModelCard, python/sglang/srt/entrypoints/openai/protocol.py
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model,
                    "object": "model",
                    "created": CREATED,
                    "owned_by": "sglang",
                    "root": self.model,
                    "parent": None,
                    "max_model_len": self.max_len,
                }
            ],
        }

    def server_info(self) -> Any:
        # {**server_args, **scheduler_info, "internal_states", "version"} (http_server.py);
        # scheduler_info = Scheduler.get_init_info() {status, max_total_num_tokens,
        # max_req_input_len}. A few of the many server args are replayed.
        return {
            "model_path": self.model,
            "tokenizer_path": self.model,
            "context_length": None,
            "mem_fraction_static": 0.85,
            "max_running_requests": 48,
            "max_total_tokens": None,
            "chunked_prefill_size": 8192,
            "tp_size": 1,
            "dp_size": 1,
            "enable_metrics": True,
            "status": "ready",
            "max_total_num_tokens": self.total,
            "max_req_input_len": self.max_len - 6,
            "internal_states": [{"last_gen_throughput": 0.0, "memory_usage": {}}],
            "version": "0.5.6",
        }

    def tokenize(self, body: Any) -> Resp:
        # serving_tokenize.py: prompt str → tokens/count ints, list → lists
        p = body["prompt"]
        if isinstance(p, list):
            return Resp(
                json={
                    "tokens": [list(range(words(t))) for t in p],
                    "count": [words(t) for t in p],
                    "max_model_len": self.max_len,
                }
            )
        return Resp(json={"tokens": list(range(words(p))), "count": words(p), "max_model_len": self.max_len})

    def metrics(self) -> str:
        # SchedulerMetricsCollector, python/sglang/srt/metrics/collector.py
        lab = f'model_name="{self.model}"'
        return (
            "\n".join(
                [
                    "# HELP sglang:num_running_reqs The number of running requests.",
                    "# TYPE sglang:num_running_reqs gauge",
                    f"sglang:num_running_reqs{{{lab}}} 2.0",
                    "# HELP sglang:num_used_tokens The number of used tokens.",
                    "# TYPE sglang:num_used_tokens gauge",
                    f"sglang:num_used_tokens{{{lab}}} {float(self.used)}",
                    "# HELP sglang:token_usage The token usage.",
                    "# TYPE sglang:token_usage gauge",
                    f"sglang:token_usage{{{lab}}} 0.25",
                    "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
                    "# TYPE sglang:num_queue_reqs gauge",
                    f"sglang:num_queue_reqs{{{lab}}} 0.0",
                ]
            )
            + "\n"
        )

    def error(self, status: int, message: str) -> Resp:
        # ErrorResponse {object: "error", message, type, param, code}
        kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(status, "Error")
        return Resp(status, {"object": "error", "message": message, "type": kind, "param": None, "code": status})


class TGI(Engine):
    kind, model, max_len = "tgi", "HuggingFaceH4/zephyr-7b-beta", 4096
    max_input = 4095

    def routes(self) -> dict[tuple[str, str], Callable[[Any], Resp]]:
        r = super().routes()
        r.update(
            {
                ("GET", "/info"): lambda b: Resp(json=self.info()),
                ("POST", "/tokenize"): self.tokenize,
                ("POST", "/chat_tokenize"): self.chat_tokenize,
                ("GET", "/metrics"): lambda b: Resp(text=self.metrics(), content_type="text/plain"),
                ("GET", "/health"): lambda b: Resp(text=""),
            }
        )
        return r

    def info(self) -> Any:
        # Info, router/src/lib.rs
        return {
            "model_id": self.model,
            "model_sha": None,
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": 128,
            "max_best_of": 2,
            "max_stop_sequences": 4,
            "max_input_tokens": self.max_input,
            "max_total_tokens": self.max_len,
            "validation_workers": 2,
            "max_client_batch_size": 4,
            "router": "text-generation-router",
            "version": "3.3.6",
            "sha": None,
            "docker_label": None,
        }

    def models(self) -> Any:
        # openai_get_model_info, router/src/server.rs: owned_by is the model id
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": self.model}]}

    def _tokens(self, text: str) -> list[dict[str, Any]]:
        # SimpleToken {id, text, start, stop}
        out, pos = [], 0
        for i, w in enumerate(text.split()):
            start = text.index(w, pos)
            pos = start + len(w)
            out.append({"id": 1000 + i, "text": w, "start": start, "stop": pos})
        return out

    def tokenize(self, body: Any) -> Resp:
        return Resp(json=self._tokens(body["inputs"]))

    def chat_tokenize(self, body: Any) -> Resp:
        # ChatTokenizeResponse {tokenize_response, templated_text}
        text = render_text(body["messages"])
        n = render_count(body["messages"])
        toks = [{"id": i, "text": "t", "start": 0, "stop": 0} for i in range(n)]
        return Resp(json={"tokenize_response": toks, "templated_text": text})

    def metrics(self) -> str:
        # gauges set in backends/v3/src/lib.rs and backends/v3/src/backend.rs, described in
        # router/src/server.rs; metrics-exporter-prometheus text format
        return (
            "\n".join(
                [
                    "# TYPE tgi_batch_max_total_tokens gauge",
                    "tgi_batch_max_total_tokens 40000",
                    "# TYPE tgi_batch_current_max_tokens gauge",
                    "tgi_batch_current_max_tokens 3000",
                    "# TYPE tgi_batch_current_size gauge",
                    "tgi_batch_current_size 2",
                    "# TYPE tgi_queue_size gauge",
                    "tgi_queue_size 1",
                ]
            )
            + "\n"
        )

    def too_long(self, n_prompt: int, max_tokens: int) -> Resp | None:
        # ValidationError::MaxTotalTokens → 422 error_type "validation" (router/src/validation.rs,
        # server.rs `impl From<InferError>`)
        if n_prompt + max_tokens > self.max_len or n_prompt > self.max_input:
            return Resp(
                422,
                {
                    "error": "Input validation error: `inputs` tokens + "
                    f"`max_new_tokens` must be <= {self.max_len}. Given: "
                    f"{n_prompt} `inputs` tokens and {max_tokens} "
                    "`max_new_tokens`",
                    "error_type": "validation",
                },
            )
        return None

    def error(self, status: int, message: str) -> Resp:
        return Resp(status, {"error": message, "error_type": "validation"})

    def chat_body(self, text: str, finish: str, usage: dict[str, int]) -> Any:
        return {
            "object": "chat.completion",
            "id": "",
            "created": CREATED,
            "model": self.model,
            "system_fingerprint": "3.3.6-sha-0000000",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish,
                }
            ],
            "usage": usage,
        }


class LlamaCpp(Engine):
    kind, model, max_len = "llamacpp", "SmolLM2-135M-Instruct-Q4_1.gguf", 512

    @property
    def slots(self) -> int:
        """``-np``: 4, or the ``slots`` option."""
        return int(self.s.options.get("slots", 4))

    def final_fields(self, usage: dict[str, int]) -> dict[str, Any]:
        # result_timings::to_json (server-task.cpp), on the final response and the stream's last
        # chunk: the speed the options say (``prefill_ms``, ``decode_ms`` a token).
        prefill, decode = float(self.s.options.get("prefill_ms", 1.0)), float(self.s.options.get("decode_ms", 10.0))
        n, m = usage["prompt_tokens"], usage["completion_tokens"]
        return {
            "timings": {
                "cache_n": 0,
                "prompt_n": n,
                "prompt_ms": n * prefill,
                "prompt_per_token_ms": prefill,
                "prompt_per_second": 1e3 / prefill,
                "predicted_n": m,
                "predicted_ms": m * decode,
                "predicted_per_token_ms": decode,
                "predicted_per_second": 1e3 / decode,
            }
        }

    def routes(self) -> dict[tuple[str, str], Callable[[Any], Resp]]:
        r = super().routes()
        r.update(
            {
                ("GET", "/props"): lambda b: Resp(json=self.props()),
                ("GET", "/slots"): lambda b: Resp(json=self.slot_list()),
                ("POST", "/apply-template"): lambda b: Resp(json={"prompt": render_text(b["messages"])}),
                ("POST", "/tokenize"): self.tokenize,
                ("GET", "/health"): lambda b: Resp(json={"status": "ok"}),
            }
        )
        return r

    def models(self) -> Any:
        # get_res_models / get_res_model_info, tools/server/server-context.cpp
        return {
            "models": [
                {
                    "name": self.model,
                    "model": self.model,
                    "modified_at": "",
                    "size": "",
                    "digest": "",
                    "type": "model",
                    "description": "",
                    "tags": [""],
                    "capabilities": ["completion"],
                    "parameters": "",
                    "details": {
                        "parent_model": "",
                        "format": "gguf",
                        "family": "",
                        "families": [""],
                        "parameter_size": "",
                        "quantization_level": "",
                    },
                }
            ],
            "object": "list",
            "data": [
                {
                    "id": self.model,
                    "aliases": [],
                    "tags": [],
                    "object": "model",
                    "created": CREATED,
                    "owned_by": "llamacpp",
                    "meta": {
                        "vocab_type": 2,
                        "n_vocab": 49152,
                        "n_ctx": self.max_len,
                        "n_ctx_train": 8192,
                        "n_embd": 576,
                        "n_params": 134515008,
                        "size": 91736064,
                        "ftype": 3,
                    },
                }
            ],
        }

    def props(self) -> Any:
        # get_res_props, server-context.cpp (the sampling `params` object is abridged)
        return {
            "default_generation_settings": {"params": {"n_predict": -1, "temperature": 0.8}, "n_ctx": self.max_len},
            "total_slots": self.slots,
            "model_alias": self.model,
            "model_ftype": "Q4_1",
            "model_path": f"/models/{self.model}",
            "modalities": {"vision": False, "video": False, "audio": False},
            "media_marker": "<__media__>",
            "endpoint_slots": True,
            "endpoint_props": False,
            "endpoint_metrics": False,
            "ui": True,
            "ui_settings": {},
            "chat_template": "{% for message in messages %}…{% endfor %}",
            "chat_template_caps": {},
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "build_info": "b6870-0000000",
            "is_sleeping": False,
            "cors_proxy_enabled": False,
        }

    def slot_list(self) -> Any:
        # server_slot::to_json: id, n_ctx, speculative, is_processing (+ task fields)
        # ``busy_slots`` are another client's (one task each, for ever); then this server's
        # generations in progress, each in a slot of its own while there is one.
        busy = self.s.options.get("busy_slots", 1)
        with self.s._lock:
            tasks = sorted(self.s.tasks)
        ids = [-1 - i for i in range(busy)] + tasks
        return [
            {"id": i, "n_ctx": self.max_len, "speculative": False, "is_processing": i < len(ids)}
            | ({"id_task": ids[i]} if i < len(ids) else {})
            for i in range(self.slots)
        ]

    def tokenize(self, body: Any) -> Resp:
        # `content` is a string, or an array of strings (each tokenized alone) and token ids
        # (passed through): tokenize_mixed, tools/server/server-common.cpp.
        content = body["content"]
        tokens: list[int] = []
        for part in content if isinstance(content, list) else [content]:
            if isinstance(part, int):
                tokens.append(part)
                continue
            # A rendered template is counted as the chat route counts it; plain text word by word.
            n = self._rendered_count(part) if part.startswith("<|im_start|>") else words(part)
            tokens += list(range(1000, 1000 + n))  # ids a vocabulary would give (never -1)
        return Resp(json={"tokens": tokens})

    @staticmethod
    def _rendered_count(text: str) -> int:
        n = 0
        for t in text.split("<|im_start|>")[1:]:
            role, _, rest = t.partition("\n")
            if rest == "":  # the generation prompt
                n += GEN_PROMPT
            else:
                n += words(rest.replace("<|im_end|>", " ")) + PER_TURN
        return n

    def too_long(self, n_prompt: int, max_tokens: int) -> Resp | None:
        # ERROR_TYPE_EXCEED_CONTEXT_SIZE: 400, format_error_response + n_prompt_tokens, n_ctx
        # (server-common.cpp, server-task.cpp); raised when the prompt alone reaches n_ctx
        # (server-context.cpp), the answer is not counted.
        if n_prompt >= self.max_len:
            return Resp(
                400,
                {
                    "error": {
                        "code": 400,
                        "message": f"request ({n_prompt} tokens) exceeds the available "
                        f"context size ({self.max_len} tokens), try increasing it",
                        "type": "exceed_context_size_error",
                        "n_prompt_tokens": n_prompt,
                        "n_ctx": self.max_len,
                    }
                },
            )
        return None

    def error(self, status: int, message: str) -> Resp:
        kind = {400: "invalid_request_error", 401: "authentication_error", 503: "unavailable_error"}.get(
            status, "server_error"
        )
        return Resp(status, {"error": {"code": status, "message": message, "type": kind}})


class Ollama(Engine):
    kind, model, max_len = "ollama", "llama3.2:1b", 8192
    trained = 131072

    def routes(self) -> dict[tuple[str, str], Callable[[Any], Resp]]:
        r = super().routes()
        r.update(
            {
                ("GET", "/api/version"): lambda b: Resp(json={"version": "0.13.0"}),
                ("POST", "/api/show"): lambda b: Resp(json=self.show()),
                ("GET", "/api/ps"): lambda b: Resp(json=self.ps()),
                ("POST", "/api/chat"): self.native_chat,
            }
        )
        del r[("POST", "/v1/chat/completions")]
        r[("POST", "/v1/chat/completions")] = self.chat
        return r

    def models(self) -> Any:
        return {
            "object": "list",
            "data": [{"id": self.model, "object": "model", "created": CREATED, "owned_by": "library"}],
        }

    def show(self) -> Any:
        # ShowResponse, api/types.go (abridged); model_info keys from ShowHandler, routes.go
        return {
            "modelfile": "FROM llama3.2:1b",
            "parameters": 'stop "<|eot_id|>"',
            "template": "{{ .Prompt }}",
            "details": {"format": "gguf", "family": "llama", "parameter_size": "1.2B", "quantization_level": "Q8_0"},
            "model_info": {
                "general.architecture": "llama",
                "general.basename": "Llama-3.2",
                "llama.context_length": self.trained,
                "llama.embedding_length": 2048,
            },
            "capabilities": ["completion", "tools"],
            "modified_at": "2025-11-30T12:00:00Z",
        }

    def ps(self) -> Any:
        # ProcessResponse / ProcessModelResponse, api/types.go
        if self.s.options.get("not_loaded"):
            return {"models": []}
        return {
            "models": [
                {
                    "name": self.model,
                    "model": self.model,
                    "size": 2019393189,
                    "digest": "baf6a787fdff",
                    "details": {"format": "gguf", "family": "llama"},
                    "expires_at": "2025-11-30T12:05:00Z",
                    "size_vram": 2019393189,
                    "context_length": self.max_len,
                }
            ]
        }

    def native_chat(self, body: Any) -> Resp:
        msgs = body["messages"]
        opts = body.get("options") or {}
        n_ctx = int(opts.get("num_ctx") or self.max_len)
        n_prompt = render_count(msgs)
        if body.get("truncate") is False and n_prompt + int(opts.get("num_predict", 0)) > n_ctx:
            # StatusError {"error": …} with the runner's 400
            return Resp(400, {"error": "the input length exceeds the context length"})
        out, finish = _answer(int(opts.get("num_predict") or 16), opts.get("stop"))
        tail = {
            "done": True,
            "done_reason": finish,
            "total_duration": 5_000_000,
            "load_duration": 1_000_000,
            "prompt_eval_count": n_prompt,
            "prompt_eval_duration": 1_000_000,
            "eval_count": len(out),
            "eval_duration": 2_000_000,
        }
        head = {"model": self.model, "created_at": "2025-11-30T12:00:00.000000Z"}
        if body.get("stream") is False:
            return Resp(json={**head, "message": {"role": "assistant", "content": " ".join(out)}, **tail})
        lines = [
            json.dumps({**head, "message": {"role": "assistant", "content": (" " if i else "") + w}, "done": False})
            for i, w in enumerate(out)
        ]
        lines.append(json.dumps({**head, "message": {"role": "assistant", "content": ""}, **tail}))
        return Resp(lines=lines, content_type="application/x-ndjson", gap=self.s.stream_gap)

    def error(self, status: int, message: str) -> Resp:
        return Resp(status, {"error": message})


class OpenAI(Engine):
    """A generic OpenAI-compatible server: /v1/models and chat only."""


ENGINES: dict[str, type[Engine]] = {e.kind: e for e in (VLLM, SGLang, TGI, LlamaCpp, Ollama, OpenAI)}


def overloaded(kind: str, *, retry_after: float | None = None) -> Resp:
    """The engine's own overload answer: TGI 429 ``overloaded``; llama.cpp 503
    ``unavailable_error``; vLLM/SGLang 503 in their error shapes; Ollama 503 ``ErrMaxQueue``."""
    headers = {} if retry_after is None else {"Retry-After": f"{retry_after:g}"}
    if kind == "tgi":
        r = Resp(429, {"error": "Model is overloaded", "error_type": "overloaded"})
    elif kind == "ollama":
        r = Resp(503, {"error": "server busy, please try again.  maximum pending requests exceeded"})
    elif kind == "llamacpp":
        r = Resp(503, {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}})
    else:
        r = Resp(
            503,
            {
                "error": {
                    "message": "The server is overloaded",
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": 503,
                }
            },
        )
    r.headers.update(headers)
    return r


# -- the server -----------------------------------------------------------------------------------
class _Server(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5: the client's 8 concurrent /tokenize connections
    # (``Backend.each_text``) overflow it while the accepting thread waits for a busy CPU, and
    # Linux answered the overflow with a reset ("Connection reset by peer": one flaky CLI test;
    # 17 of 4,800 requests in 16-way bursts on a busy 2-core host, none at 2,048). The engines
    # that are asked one text a request serve through uvicorn, whose backlog is 2,048.
    request_queue_size = 2048


class Replay:
    """An engine replay on ``127.0.0.1`` (a free port), serving in a daemon thread."""

    def __init__(
        self, kind: str, *, api_key: str | None = None, stream_gap: float = 0.0, port: int = 0, **options: Any
    ) -> None:
        """``port``: 0 for a free one; a given one brings an engine back where it was (restart)."""
        self.kind = kind
        self.api_key = api_key
        self.stream_gap = stream_gap
        self.options = options
        self.engine = ENGINES[kind](self)
        self.routes = self.engine.routes()
        self.script: dict[tuple[str, str], deque[Resp]] = {}
        self.log: list[tuple[str, str, Any]] = []
        self.aborted_streams = 0
        self.tasks: set[int] = set()  # generations in progress (llama.cpp's processing slots)
        self._next_task = 0
        self.authorization: list[str | None] = []  # each request's Authorization header
        self.dead = False
        self._connections: set[Any] = set()  # the sockets of the connections open now
        self._lock = threading.Lock()
        replay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out in two writes: with Nagle's algorithm the body waits for
            # the client's delayed ACK of the headers, 40 ms a request on Linux — 35 s of a test
            # that counts hundreds of texts on the engine. Real engines (uvicorn, llama.cpp's
            # httplib) answer without that wait.
            disable_nagle_algorithm = True

            def log_message(self, *a: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with replay._lock:
                    replay._connections.add(self.connection)

            def finish(self) -> None:
                with replay._lock:
                    replay._connections.discard(self.connection)
                super().finish()

            def _serve(self, method: str) -> None:
                if replay.dead:  # killed: a connection kept alive from before gets no answer
                    self.close_connection = True
                    return
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                path = self.path.split("?")[0]
                with replay._lock:
                    replay.log.append((method, path, body))
                    replay.authorization.append(self.headers.get("Authorization"))
                    queued = replay.script.get((method, path))
                    resp = queued.popleft() if queued else None
                if (
                    resp is None
                    and replay.api_key
                    and path != "/health"
                    and (self.headers.get("Authorization") != f"Bearer {replay.api_key}")
                ):
                    resp = replay.engine.error(401, "Invalid API Key")
                if resp is None:
                    route = replay.routes.get((method, path))
                    resp = route(body) if route else replay.engine.error(404, "File Not Found")
                if (method, path) != ("POST", "/v1/chat/completions"):
                    self._write(resp)
                    return
                # A generation holds a task (llama.cpp's /slots shows it processing) until its
                # answer is written or its client has gone.
                with replay._lock:
                    replay._next_task += 1
                    task = replay._next_task
                    replay.tasks.add(task)
                try:
                    self._write(resp)
                finally:
                    with replay._lock:
                        replay.tasks.discard(task)

            def _client_gone(self, seconds: float) -> bool:
                """Wait ``seconds``, looking at the connection every 50 ms as an engine does (llama.cpp:
                every second): True as soon as the client closed it."""
                deadline = time.monotonic() + seconds
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    readable, _, _ = select.select([self.connection], [], [], min(0.05, left))
                    if readable:
                        try:
                            if self.connection.recv(1, socket.MSG_PEEK) == b"":
                                return True
                        except OSError:
                            return True

            def _write(self, r: Resp) -> None:
                if r.delay and self._client_gone(r.delay):
                    with replay._lock:
                        replay.aborted_streams += 1
                    self.close_connection = True
                    return
                try:
                    self.send_response(r.status)
                    self.send_header("Content-Type", "application/json" if r.json is not None else r.content_type)
                    for k, v in r.headers.items():
                        self.send_header(k, v)
                    if r.lines is not None:
                        self.send_header("Transfer-Encoding", "chunked")
                        self.send_header("Connection", "close")
                        self.end_headers()
                        for line in r.lines:
                            payload = (line + "\n\n" if r.content_type == "text/event-stream" else line + "\n").encode()
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
                            self.wfile.flush()
                            if r.gap and self._client_gone(r.gap):
                                raise ConnectionResetError("the client closed the stream")
                        self.wfile.write(b"0\r\n\r\n")
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    data = (json.dumps(r.json) if r.json is not None else r.text or "").encode()
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    with replay._lock:
                        replay.aborted_streams += 1
                    self.close_connection = True

            def do_GET(self) -> None:  # noqa: N802
                self._serve("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

        self._server = _Server(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def push(self, method: str, path: str, *responses: Resp) -> None:
        """Answer the next requests to ``method path`` with ``responses``, in order."""
        with self._lock:
            self.script.setdefault((method, path), deque()).extend(responses)

    def calls(self, method: str, path: str) -> list[Any]:
        with self._lock:
            return [b for m, p, b in self.log if (m, p) == (method, path)]

    def __enter__(self) -> Replay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.dead:
            return
        self._server.shutdown()
        self._server.server_close()

    def kill(self) -> None:
        """Stop as a killed engine does: new connections are refused, and the open ones are
        closed by the system (a client reading one sees it dropped)."""
        import socket

        self.__exit__()
        self.dead = True
        with self._lock:
            open_now = list(self._connections)
        for conn in open_now:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])
