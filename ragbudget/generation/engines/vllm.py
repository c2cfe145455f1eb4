"""vLLM: the window from ``/v1/models``, the KV cache from ``/metrics``, exact counts from
``/tokenize`` (the chat template applied by the server itself).

Field names, checked against vLLM's sources:

* ``GET /v1/models`` → ``data[].max_model_len`` — ``ModelCard`` in
  ``vllm/entrypoints/openai/engine/protocol.py``.
* ``GET /metrics`` → ``vllm:cache_config_info`` is an info gauge whose labels are every
  ``CacheConfig`` field stringified (``metrics_info()`` in ``vllm/config/cache.py``; the gauge is
  built in ``vllm/v1/metrics/loggers.py`` ``log_metrics_info``): ``num_gpu_blocks``,
  ``block_size`` and, in current versions, ``kv_cache_size_tokens`` — "group-aware capacity since
  num_gpu_blocks * block_size can be wrong for hybrid models" (vllm/config/cache.py). Unset fields
  read ``"None"``. One series per DP engine (label ``engine``), so figures are summed.
  ``vllm:kv_cache_usage_perc`` (0–1), ``vllm:num_requests_running``, ``vllm:num_requests_waiting``
  — ``PrometheusStatLogger`` in ``vllm/v1/metrics/loggers.py``.
* ``POST /tokenize`` → ``{"count", "max_model_len", "tokens", "token_strs"}`` —
  ``TokenizeResponse``; the request takes ``prompt`` + ``add_special_tokens`` or ``messages`` +
  ``add_generation_prompt`` (``TokenizeCompletionRequest`` / ``TokenizeChatRequest``). One text
  per request, so chunks are counted concurrently.
* errors → ``{"error": {"message", "type", "param", "code"}}`` (``ErrorResponse``/``ErrorInfo``,
  vllm/entrypoints/openai/engine/protocol.py); a too-long prompt is a 400 whose body has no
  figures, so it is confirmed by recounting against ``max_model_len``. Overload is 503.
* ``GET /version`` → ``{"version"}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...errors import EngineResponseError
from ..backend import Capacity, RenderedPrompt
from ._base import ServedBackend
from ._prometheus import int_or_none, iter_samples, metric_sum, queue_load

__all__ = ["VLLMBackend"]


class VLLMBackend(ServedBackend):
    """A vLLM OpenAI-compatible server (``vllm serve``)."""

    kind = "vllm"

    def engine_count(self, texts: list[str]) -> list[int]:
        return self.each_text(self._count_one, texts)

    def _count_one(self, text: str) -> int:
        data = self.http.post("/tokenize", {"model": self.model_id, "prompt": text, "add_special_tokens": False}).data
        n = int_or_none(data.get("count") if isinstance(data, Mapping) else None)
        if n is None:
            raise EngineResponseError(
                f"{self.http.url('/tokenize')} answered without `count`",
                url=self.http.url("/tokenize"),
                kind=self.kind,
                body=data,
            )
        return n

    def engine_render(self, messages: Sequence[Mapping[str, str]]) -> RenderedPrompt:
        msgs = tuple(dict(m) for m in messages)
        data = self.http.post(
            "/tokenize", {"model": self.model_id, "messages": list(msgs), "add_generation_prompt": True}
        ).data
        n = int_or_none(data.get("count") if isinstance(data, Mapping) else None)
        if n is None:
            raise EngineResponseError(
                f"{self.http.url('/tokenize')} answered without `count`",
                url=self.http.url("/tokenize"),
                kind=self.kind,
                body=data,
            )
        tokens = data.get("tokens")
        return RenderedPrompt(
            messages=msgs,
            n_tokens=n,
            exact=True,
            source="POST /tokenize messages (vLLM's chat template)",
            token_ids=tuple(tokens) if isinstance(tokens, list) else None,
        )

    def engine_capacity(self) -> Capacity:
        models = self.http.get("/v1/models").data
        max_len, src = None, ""
        for card in (models or {}).get("data", []) if isinstance(models, Mapping) else []:
            if card.get("id") == self.model_id or max_len is None:
                max_len = int_or_none(card.get("max_model_len"))
                src = "GET /v1/models max_model_len"
        version = self.route_version("/version")
        notes: list[str] = []
        kv_total = kv_free = running = waiting = None
        kv_total_src = kv_free_src = load_src = ""
        reply = self.http.get("/metrics", expect="text", allow={404})
        if reply.status == 200:
            text = reply.text
            sized, blocks = [], []
            for labels, _ in iter_samples(text, "vllm:cache_config_info"):
                sized.append(int_or_none(labels.get("kv_cache_size_tokens")))
                nb, bs = int_or_none(labels.get("num_gpu_blocks")), int_or_none(labels.get("block_size"))
                blocks.append(nb * bs if nb is not None and bs is not None else None)
            if sized and all(s is not None for s in sized):
                kv_total = sum(s for s in sized if s is not None)
                kv_total_src = "GET /metrics vllm:cache_config_info kv_cache_size_tokens"
            elif blocks and all(b is not None for b in blocks):
                kv_total = sum(b for b in blocks if b is not None)
                kv_total_src = "GET /metrics vllm:cache_config_info num_gpu_blocks × block_size"
                notes.append(
                    "this vLLM publishes no kv_cache_size_tokens: blocks × block size "
                    "overstates the KV cache of hybrid (sliding-window, Mamba) models"
                )
            usage = metric_sum(text, "vllm:kv_cache_usage_perc")
            n_usage = len(list(iter_samples(text, "vllm:kv_cache_usage_perc")))
            if kv_total is not None and usage is not None and n_usage:
                frac = min(1.0, max(0.0, usage / n_usage))  # mean over DP engines
                kv_free = int(kv_total * (1.0 - frac))
                kv_free_src = "GET /metrics vllm:kv_cache_usage_perc × KV total"
            running, waiting, load_src = queue_load(text, "vllm:num_requests_running", "vllm:num_requests_waiting")
        else:
            notes.append("GET /metrics answered 404: KV figures unknown (the window alone limits)")
        return Capacity(
            max_context_tokens=max_len,
            max_context_source=src,
            kv_tokens_total=kv_total,
            kv_total_source=kv_total_src,
            kv_tokens_free=kv_free,
            kv_free_source=kv_free_src,
            running=running,
            waiting=waiting,
            load_source=load_src,
            engine_kind=self.kind,
            engine_version=version,
            notes=tuple(notes),
        )
