"""Ollama: the trained window from ``/api/show``, the allocated one from ``/api/ps``, generation
through the native ``/api/chat`` so ``num_ctx`` and ``truncate: false`` can be sent (an overflow
is then an error, never a silent cut). Ollama has no tokenize route: counts come from a local
tokenizer with a stated margin (:class:`~ragbudget.generation.engines._counting.LocalCounter`).

Field names, checked against Ollama's sources:

* ``POST /api/show`` → ``model_info`` with ``general.architecture`` and
  ``<architecture>.context_length`` (``ShowResponse`` in ``api/types.go``; filled in
  ``server/routes.go`` ShowHandler).
* ``GET /api/ps`` → ``models[]`` with ``name``, ``model``, ``context_length`` — the context the
  loaded runner was given (``ProcessModelResponse``, api/types.go; PsHandler, routes.go).
* ``POST /api/chat`` takes ``model``, ``messages``, ``stream``, ``options`` (``num_ctx``,
  ``num_predict``, ``temperature``, ``top_p``, ``seed``, ``stop``) and ``truncate``
  (``ChatRequest``, api/types.go: "truncates the chat history messages if the rendered prompt
  exceeds the context length limit"); answers ``message.content``, ``done``, ``done_reason``,
  ``prompt_eval_count``, ``eval_count`` (``ChatResponse``/``Metrics``), one JSON object per line
  when streaming.
* errors → ``{"error": "…"}`` (``api.StatusError``); a queue that is full is 503
  (``ErrMaxQueue``, ``handleScheduleError`` in routes.go); a prompt over ``num_ctx`` with
  ``truncate: false`` is a 400 from the runner. ``GET /api/version`` → ``{"version"}``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...errors import EngineResponseError
from ..backend import Capacity, RenderedPrompt, Sampling
from ._base import ServedBackend, TooLong, int_or_none, sampling_fields
from ._counting import LocalCounter
from ._http import Reply, error_message

if TYPE_CHECKING:  # pragma: no cover
    from ..generate import Generation

__all__ = ["OllamaBackend"]

#: Sent as ``num_ctx`` when neither ``context_tokens`` nor a loaded runner says otherwise: the
#: smallest of Ollama's VRAM-dependent defaults ("4k/32k/256k", envconfig/config.go).
DEFAULT_NUM_CTX = 4096


class OllamaBackend(ServedBackend):
    """An Ollama server. ``tokenizer`` is what counts locally (see
    :class:`~ragbudget.generation.engines._counting.LocalCounter`)."""

    kind = "ollama"
    takes_tokenizer = True

    def __init__(self, http: Any, *, tokenizer: Any = None, **kw: Any) -> None:
        super().__init__(http, **kw)
        self.counter = LocalCounter(tokenizer)
        self._num_ctx: int | None = None

    @property
    def count_key(self) -> str:
        # Counted by the local stand-in, not the engine: kept under both (see LocalCounter.key).
        return f"{self.model_id} @ {self.counter.key}"

    def engine_count(self, texts: list[str]) -> list[int]:
        return self.counter.count(texts)

    def engine_render(self, messages: Sequence[Mapping[str, str]]) -> RenderedPrompt:
        return self.counter.render(messages)

    def num_ctx(self) -> int:
        """The ``num_ctx`` sent with every request (read once from the capacity)."""
        if self._num_ctx is None:
            self.capacity()
        assert self._num_ctx is not None
        return self._num_ctx

    def engine_capacity(self) -> Capacity:
        notes: list[str] = []
        version = self.route_version("/api/version")
        trained = None
        show = self.http.post("/api/show", {"model": self.model_id}).data
        info = (show or {}).get("model_info") if isinstance(show, Mapping) else None
        if isinstance(info, Mapping):
            arch = info.get("general.architecture")
            trained = int_or_none(info.get(f"{arch}.context_length"))
        allocated = None
        ps = self.http.get("/api/ps").data
        for m in (ps or {}).get("models", []) if isinstance(ps, Mapping) else []:
            if self.model_id in (m.get("name"), m.get("model")):
                allocated = int_or_none(m.get("context_length"))
        if allocated:
            window, src = allocated, "GET /api/ps context_length (allocated)"
        else:
            window = min(trained or DEFAULT_NUM_CTX, DEFAULT_NUM_CTX)
            src = f"num_ctx={window} sent with each request (model not loaded)"
            notes.append(
                f"{self.model_id} is not loaded; ragbudget sends num_ctx={window} (pass context_tokens to ask for more)"
            )
        if trained:
            notes.append(f"trained context {trained} (POST /api/show model_info)")
        if self.context_tokens is not None:
            window = self.context_tokens
        self._num_ctx = window
        notes.append(
            f"token counts are local estimates ({self.counter.name}, "
            f"+{self.counter.margin:.0%} margin): Ollama has no tokenize route"
        )
        return Capacity(
            max_context_tokens=window,
            max_context_source=src,
            engine_kind=self.kind,
            engine_version=version,
            notes=tuple(notes),
        )

    def _chat(
        self,
        messages: list[dict[str, str]],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        stop: list[str] | None,
        on_text: Callable[[str], None] | None,
        cancel: threading.Event | None,
        prompt: Any,
    ) -> Generation | TooLong:
        from ..generate import Generation

        t0 = time.perf_counter()
        if cancel is not None and cancel.is_set():
            return Generation(
                text="", prompt_tokens=0, new_tokens=0, finish_reason="cancelled", seconds=0.0, cache="served"
            )
        options: dict[str, Any] = {
            "num_ctx": self.num_ctx(),
            "num_predict": max_new_tokens,
            **sampling_fields(sampling, stop),
        }
        stream = on_text is not None or cancel is not None
        body = {"model": self.model_id, "messages": messages, "stream": stream, "options": options, "truncate": False}
        path = "/api/chat"
        timeout = self.reply_timeout(prompt, max_new_tokens)
        if stream:
            events = self.http.stream(path, body, mode="ndjson", cancel=cancel, allow={400}, timeout=timeout)
        else:
            reply = self.http.post(path, body, allow={400}, timeout=timeout)
            events = iter([reply if reply.status != 200 else reply.data])
        pieces: list[str] = []
        last: Mapping[str, Any] = {}
        for event in events:
            if isinstance(event, Reply):
                return self.too_long_or_raise(event, messages, max_new_tokens)
            if not isinstance(event, Mapping):
                raise EngineResponseError(
                    f"{self.http.url(path)} answered a non-object", url=self.http.url(path), kind=self.kind, body=event
                )
            if "error" in event:
                raise EngineResponseError(
                    f"{self.http.url(path)} failed: {error_message(event)}",
                    url=self.http.url(path),
                    kind=self.kind,
                    body=event,
                )
            piece = (event.get("message") or {}).get("content") or ""
            if piece:
                pieces.append(piece)
                if on_text is not None and stream:
                    on_text(piece)
            last = event
        finish = str(last.get("done_reason") or ("stop" if last.get("done") else "cancelled"))
        text = "".join(pieces)
        prompt_tokens = int_or_none(last.get("prompt_eval_count"))
        new_tokens = int_or_none(last.get("eval_count"))
        if last.get("done"):  # its own figures, in nanoseconds (api/types.go Metrics)
            ns = {k: int_or_none(last.get(k)) or 0 for k in ("prompt_eval_duration", "eval_duration")}
            self.speed.observe(
                {
                    "prompt_n": prompt_tokens,
                    "prompt_ms": ns["prompt_eval_duration"] / 1e6,
                    "predicted_n": new_tokens,
                    "predicted_ms": ns["eval_duration"] / 1e6,
                }
            )
        return Generation(
            text=text,
            prompt_tokens=prompt_tokens if prompt_tokens is not None else self.render(messages).n_tokens,
            new_tokens=new_tokens if new_tokens is not None else (self.count([text])[0] if text else 0),
            finish_reason=finish,
            seconds=time.perf_counter() - t0,
            cache="served",
            prompt=prompt if hasattr(prompt, "input_ids") else None,
        )

    def too_long(self, reply: Reply, messages: list[dict[str, str]], max_new_tokens: int) -> TooLong | None:
        # With truncate:false a prompt over num_ctx is a 400. Ollama's body has no figures, so
        # the local (margin-padded) estimate must agree that it does not fit before we say so.
        n_ctx = self.num_ctx()
        n = self.render(messages).n_tokens
        if n + max_new_tokens > n_ctx:
            return TooLong(
                n_prompt_tokens=n,
                n_ctx=n_ctx,
                status=reply.status,
                body=reply.data,
                source="Ollama 400 with truncate:false; prompt size is the local estimate",
            )
        return None
