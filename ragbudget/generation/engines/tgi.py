"""Hugging Face TGI: limits from ``/info``, the KV pool from ``/metrics``, exact chat counts
from ``/chat_tokenize``.

Field names, checked against TGI's sources (``router/src/``):

* ``GET /info`` → ``Info`` (``router/src/lib.rs``): ``model_id``, ``max_concurrent_requests``,
  ``max_input_tokens``, ``max_total_tokens``, ``router`` (``"text-generation-router"``),
  ``version``.
* ``GET /metrics`` → ``tgi_batch_max_total_tokens`` (set in ``backends/v3/src/lib.rs``: the
  batch's token budget, i.e. the KV pool), ``tgi_batch_current_max_tokens`` (tokens reserved by
  the running batch), ``tgi_batch_current_size``, ``tgi_queue_size`` (described in
  ``router/src/server.rs``).
* ``POST /tokenize`` with ``{"inputs"}`` → a list of ``{"id", "text", "start", "stop"}``;
  ``POST /chat_tokenize`` with a chat request → ``{"tokenize_response": [...],
  "templated_text"}`` (``ChatTokenizeResponse``, lib.rs; routes in server.rs). One text per
  request, so chunks are counted concurrently.
* errors → ``{"error", "error_type"}`` (``ErrorResponse``, lib.rs): overload is 429
  (``InferError::Overloaded``), validation — including a too-long input — 422
  (``InferError::ValidationError``), so a 422 is recounted against ``max_input_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...errors import EngineResponseError
from ..backend import Capacity, RenderedPrompt
from ._base import ServedBackend
from ._prometheus import int_or_none, metric_sum, queue_load

__all__ = ["TGIBackend"]


class TGIBackend(ServedBackend):
    """A text-generation-inference server (``text-generation-launcher``)."""

    kind = "tgi"
    too_long_statuses = frozenset({422})

    def engine_count(self, texts: list[str]) -> list[int]:
        return self.each_text(self._count_one, texts)

    def _count_one(self, text: str) -> int:
        data = self.http.post("/tokenize", {"inputs": text}).data
        if not isinstance(data, list):
            raise EngineResponseError(
                f"{self.http.url('/tokenize')} did not answer a token list",
                url=self.http.url("/tokenize"),
                kind=self.kind,
                body=data,
            )
        return len(data)

    def engine_render(self, messages: Sequence[Mapping[str, str]]) -> RenderedPrompt:
        msgs = tuple(dict(m) for m in messages)
        data = self.http.post("/chat_tokenize", {"model": self.model_id, "messages": list(msgs)}).data
        toks = data.get("tokenize_response") if isinstance(data, Mapping) else None
        if not isinstance(toks, list):
            raise EngineResponseError(
                f"{self.http.url('/chat_tokenize')} answered without tokenize_response",
                url=self.http.url("/chat_tokenize"),
                kind=self.kind,
                body=data,
            )
        return RenderedPrompt(
            messages=msgs,
            n_tokens=len(toks),
            exact=True,
            source="POST /chat_tokenize (TGI's chat template)",
            text=data.get("templated_text"),
            token_ids=tuple(int(t["id"]) for t in toks if "id" in t),
        )

    def engine_capacity(self) -> Capacity:
        info = self.http.get("/info").data
        if not isinstance(info, Mapping):
            raise EngineResponseError(
                "GET /info did not answer an object", url=self.http.url("/info"), kind=self.kind, body=info
            )
        total_tokens = int_or_none(info.get("max_total_tokens"))
        input_tokens = int_or_none(info.get("max_input_tokens"))
        concurrent = int_or_none(info.get("max_concurrent_requests"))
        kv_total = kv_free = running = waiting = None
        kv_total_src = kv_free_src = load_src = ""
        notes: list[str] = []
        reply = self.http.get("/metrics", expect="text", allow={404})
        if reply.status == 200:
            t = metric_sum(reply.text, "tgi_batch_max_total_tokens")
            if t is not None:
                kv_total = int(t)
                kv_total_src = "GET /metrics tgi_batch_max_total_tokens"
                cur = metric_sum(reply.text, "tgi_batch_current_max_tokens")
                if cur is not None:
                    kv_free = max(0, kv_total - int(cur))
                    kv_free_src = "GET /metrics tgi_batch_max_total_tokens − tgi_batch_current_max_tokens"
            running, waiting, load_src = queue_load(reply.text, "tgi_batch_current_size", "tgi_queue_size")
        else:
            notes.append("GET /metrics answered 404: KV figures unknown")
        return Capacity(
            max_context_tokens=total_tokens,
            max_context_source="GET /info max_total_tokens" if total_tokens else "",
            max_prompt_tokens=input_tokens,
            max_prompt_source="GET /info max_input_tokens" if input_tokens else "",
            kv_tokens_total=kv_total,
            kv_total_source=kv_total_src,
            kv_tokens_free=kv_free,
            kv_free_source=kv_free_src,
            running=running,
            waiting=waiting,
            load_source=load_src,
            max_concurrent=concurrent,
            max_concurrent_source="GET /info max_concurrent_requests" if concurrent else "",
            engine_kind=self.kind,
            engine_version=info.get("version"),
            notes=tuple(notes),
        )
