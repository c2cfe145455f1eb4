"""SGLang: the window and KV pool from ``/get_server_info``, load from ``/metrics``, batched
counts from ``/v1/tokenize``.

Field names, checked against SGLang's sources:

* ``GET /get_server_info`` → ``{**server_args, **scheduler_info, "internal_states", "version"}``
  (``get_server_info`` in ``python/sglang/srt/entrypoints/http_server.py``); the scheduler's part
  is ``{"status", "max_total_num_tokens", "max_req_input_len"}`` (``Scheduler.get_init_info`` in
  ``python/sglang/srt/managers/scheduler.py``); server args carry ``context_length`` (``None``
  unless set) and ``max_running_requests``.
* ``GET /v1/models`` → ``data[].max_model_len`` (``ModelCard``,
  ``python/sglang/srt/entrypoints/openai/protocol.py``).
* ``POST /v1/tokenize`` takes ``prompt: str | list[str]`` and answers ``count: int | list[int]``
  and ``max_model_len`` (``python/sglang/srt/entrypoints/openai/serving_tokenize.py``) — a real
  batch route. There is no chat-template route, so :meth:`render` adds a template overhead
  measured once per role layout from ``usage.prompt_tokens`` of a one-token completion.
* ``GET /metrics`` (with ``--enable-metrics``): ``sglang:num_used_tokens``,
  ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``
  (``SchedulerMetricsCollector``, ``python/sglang/srt/metrics/collector.py``).
* errors → ``{"object": "error", "message", "type", "param", "code"}`` (``ErrorResponse``,
  protocol.py); too long is a 400 without figures (recounted), overload 503.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...errors import EngineResponseError
from ..backend import Capacity, RenderedPrompt
from ._base import ServedBackend
from ._prometheus import int_or_none, metric_sum, queue_load

__all__ = ["SGLangBackend"]


class SGLangBackend(ServedBackend):
    """An SGLang server (``python -m sglang.launch_server``)."""

    kind = "sglang"

    def engine_count(self, texts: list[str]) -> list[int]:
        body = {"model": self.model_id, "prompt": texts, "add_special_tokens": False}
        reply = self.http.post("/v1/tokenize", body, allow={404})
        if reply.status == 404:  # older servers route it without the /v1 prefix
            reply = self.http.post("/tokenize", body)
        counts = reply.data.get("count") if isinstance(reply.data, Mapping) else None
        if not isinstance(counts, list) or len(counts) != len(texts):
            raise EngineResponseError(
                f"{self.http.url('/v1/tokenize')} did not answer one count per text",
                url=self.http.url("/v1/tokenize"),
                kind=self.kind,
                body=reply.data,
            )
        return [int(c) for c in counts]

    def _role_overhead(self, roles: tuple[str, ...]) -> int:
        key = ("roles", self.model_id, *roles)
        with self._lock:
            if key in self._overheads:
                return self._overheads[key]
        probe = [{"role": r, "content": "x"} for r in roles]
        data = self.http.post(
            "/v1/chat/completions",
            {
                "model": self.model_id,
                "messages": probe,
                "max_tokens": 1,
                "temperature": 0.0,
            },
        ).data
        used = int_or_none(((data or {}).get("usage") or {}).get("prompt_tokens"))
        if used is None:
            raise EngineResponseError(
                "SGLang answered the template probe without usage",
                url=self.http.url("/v1/chat/completions"),
                kind=self.kind,
                body=data,
            )
        n = max(0, used - len(roles) * self.count(["x"])[0])
        with self._lock:
            self._overheads[key] = n
        return n

    def engine_render(self, messages: Sequence[Mapping[str, str]]) -> RenderedPrompt:
        msgs = tuple(dict(m) for m in messages)
        content = sum(self.count([m["content"] for m in msgs]))
        n = content + self._role_overhead(tuple(m["role"] for m in msgs))
        return RenderedPrompt(
            messages=msgs,
            n_tokens=n,
            exact=False,
            source="POST /v1/tokenize per message + template overhead from a usage probe",
        )

    def engine_capacity(self) -> Capacity:
        info = self.http.get("/get_server_info").data or {}
        if not isinstance(info, Mapping):
            raise EngineResponseError(
                "GET /get_server_info did not answer an object",
                url=self.http.url("/get_server_info"),
                kind=self.kind,
                body=info,
            )
        max_len, src = None, ""
        models = self.http.get("/v1/models").data
        for card in (models or {}).get("data", []) if isinstance(models, Mapping) else []:
            max_len = int_or_none(card.get("max_model_len"))
            if max_len is not None:
                src = "GET /v1/models max_model_len"
                break
        if max_len is None and int_or_none(info.get("context_length")) is not None:
            max_len = int_or_none(info.get("context_length"))
            src = "GET /get_server_info context_length"
        total = int_or_none(info.get("max_total_num_tokens"))
        max_prompt = int_or_none(info.get("max_req_input_len"))
        max_running = int_or_none(info.get("max_running_requests"))
        free = running = waiting = None
        free_src = load_src = ""
        notes: list[str] = []
        reply = self.http.get("/metrics", expect="text", allow={404})
        if reply.status == 200 and total is not None:
            used = metric_sum(reply.text, "sglang:num_used_tokens")
            if used is not None:
                free = max(0, total - int(used))
                free_src = "GET /metrics max_total_num_tokens − sglang:num_used_tokens"
            running, waiting, load_src = queue_load(reply.text, "sglang:num_running_reqs", "sglang:num_queue_reqs")
        else:
            notes.append(
                "no /metrics (start SGLang with --enable-metrics): free KV and load "
                "unknown, the total pool is used instead"
            )
        return Capacity(
            max_context_tokens=max_len,
            max_context_source=src,
            max_prompt_tokens=max_prompt,
            max_prompt_source="GET /get_server_info max_req_input_len" if max_prompt else "",
            kv_tokens_total=total,
            kv_total_source="GET /get_server_info max_total_num_tokens" if total else "",
            kv_tokens_free=free,
            kv_free_source=free_src,
            running=running,
            waiting=waiting,
            load_source=load_src,
            max_concurrent=max_running,
            max_concurrent_source="GET /get_server_info max_running_requests" if max_running else "",
            engine_kind=self.kind,
            engine_version=info.get("version"),
            notes=tuple(notes),
        )
