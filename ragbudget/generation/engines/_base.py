"""What every served engine shares: counting with a cache, OpenAI chat generation (plain or SSE
streaming, cancellable), the one too-long retry, and a local tokenizer for engines that cannot
count. Engine modules subclass :class:`ServedBackend` and fill in the engine's own figures.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ...errors import ConfigError, EngineContextError, EngineError, EngineResponseError, EngineTimeoutError
from ...types import Refittable
from ..backend import (
    Capacity,
    CountCache,
    RenderedPrompt,
    Sampling,
    prompt_messages,
    render_overhead,
    text_digest,
)
from ._counting import BoundedLRU, LocalCounter as LocalCounter
from ._http import HTTP, Reply, error_message
from ._pacing import EngineSpeed
from ._prometheus import int_or_none as int_or_none, parse_prometheus as parse_prometheus

if TYPE_CHECKING:  # pragma: no cover
    from contextlib import AbstractContextManager

    from ...memory.admission import AdmissionController
    from ...memory.schedule import Throughput
    from ...prompt.prompt import PromptBuilder
    from ..backend import PromptInput
    from ..generate import Generation

__all__ = ["Detection", "LocalCounter", "ServedBackend", "TooLong", "parse_prometheus"]

log = logging.getLogger("ragbudget.engines")


@dataclass(frozen=True, kw_only=True)
class Detection:
    """How a backend's engine kind was decided: ``kind``, ``how`` (one line: the route and the
    field that gave it away, or ``"given: kind=…"``), every ``probes`` made, as
    ``"GET /route -> 200"``, and the ``models`` that ``GET /v1/models`` listed."""

    kind: str
    how: str
    probes: tuple[str, ...] = ()
    models: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "how": self.how, "probes": list(self.probes), "models": list(self.models)}


@dataclass(frozen=True, kw_only=True)
class TooLong:
    """A too-long answer, with the figures that prove it (the server's own, or a recount with the
    server's tokenizer against its advertised window)."""

    n_prompt_tokens: int | None
    n_ctx: int | None
    source: str
    status: int
    body: Any


class ServedBackend(ABC):
    """A :class:`~ragbudget.generation.backend.Backend` over a served engine's HTTP API.

    **The engine contract** (what a built-in engine and a plugin alike implement, all public):
    set ``kind`` and implement :meth:`engine_capacity` (the engine's figures as a
    :class:`~ragbudget.generation.backend.Capacity`), :meth:`engine_render` (messages after the
    engine's chat template, counted) and :meth:`engine_count` (a batch route, or one request per
    text through :meth:`each_text`). Optional: :meth:`too_long` (which error replies mean a
    too-long prompt; :attr:`too_long_statuses`), :meth:`running_tasks` / :meth:`let_go` (free
    an abandoned request's slot), :attr:`takes_tokenizer` with ``tokenizer=`` for an engine that
    cannot count (:class:`~ragbudget.generation.engines.LocalCounter` stands in). Helpers:
    :attr:`http` (the engine's client: ``get``, ``call``, ``stream``), :meth:`route_version`,
    and what :mod:`ragbudget.generation.engines` exports for reading replies and Prometheus
    metrics. Generation goes to ``POST /v1/chat/completions`` with ``max_tokens`` always set.
    Another package adds an engine kind by registering its subclass in the
    ``ragbudget.engines`` entry-point group (:func:`ragbudget.generation.engines.backend_class`);
    the built-ins are registered the same way (:data:`ragbudget.settings.BUILT_IN_ENGINES`), and
    ``tests/_engine_contract.py`` holds the checks both pass.

    The engine holds its own memory: :meth:`capacity` is its report (no memory plan), and it
    admits its own requests (:meth:`tune` and :meth:`refresh_speed` add nothing).

    The engine's tokenizer is asked as little as possible (each ask is an HTTP request, and a
    request's prompt is counted passage by passage): counts are kept by text digest and
    :attr:`count_key` (the engine's tokenizer: its model, or the local counter it stands in
    for) in a bounded in-process LRU of :attr:`COUNT_MEMO` texts, in front of ``count_cache``
    (the index's SQLite file, kept between runs); renders of the same messages — the question
    alone is measured three times a request, a repeated question's whole prompt again — in a
    bounded LRU of :attr:`RENDER_MEMO_TOKENS` token ids.
    """

    #: Texts whose counts are kept in memory (about 20 MB at most: a digest and a number each).
    COUNT_MEMO = 100_000
    #: Token ids of the renders kept in memory (about 40 MB at most), least recently used out.
    RENDER_MEMO_TOKENS = 1_000_000

    kind: ClassVar[str] = "openai"
    #: Statuses this engine answers a too-long prompt with.
    too_long_statuses: ClassVar[frozenset[int]] = frozenset({400})
    #: Whether the engine cannot count, so a local tokenizer stands in (``tokenizer=`` of
    #: :func:`~ragbudget.generation.engines.connect`).
    takes_tokenizer: ClassVar[bool] = False

    def __init__(
        self,
        http: HTTP,
        *,
        model: str | None = None,
        count_cache: CountCache | None = None,
        context_tokens: int | None = None,
        detection: Detection | None = None,
        workers: int = 8,
    ) -> None:
        self.http = http
        http.kind = self.kind
        self._model = model
        self.count_cache = count_cache
        self.context_tokens = context_tokens
        self.detection = detection or Detection(kind=self.kind, how=f"given: kind={self.kind!r}")
        self.workers = max(1, workers)
        self._lock = threading.Lock()
        self._overheads: dict[tuple[str, ...], int] = {}
        self._window: tuple[int | None, int | None] | None = None  # (max_context, max_prompt)
        self._recent: tuple[float, Capacity] | None = None  # (monotonic time, figures)
        self._count_memo = BoundedLRU(self.COUNT_MEMO)
        self._render_memo = BoundedLRU(self.RENDER_MEMO_TOKENS)
        #: The engine's speed, read off its answers: each generation's time-out and admission's
        #: time model (:meth:`reply_timeout`, :meth:`tune`).
        self.speed = EngineSpeed()
        self._tuned: Throughput | None = None
        if context_tokens is not None and context_tokens < 2:
            raise ConfigError(f"context_tokens must be ≥ 2; got {context_tokens}")

    def __repr__(self) -> str:
        model = self._model or "?"
        return f"{type(self).__name__}({self.http.root!r}, model={model!r}, kind={self.kind!r})"

    def __enter__(self) -> ServedBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def warm_up(self) -> None:
        """Ask the engine its model and figures now: a wrong model or an engine that cannot
        answer is an error before the first request."""
        _ = self.model_id
        self.capacity()

    def close(self) -> None:
        self.http.close()

    @property
    def url(self) -> str:
        return self.http.root

    def probing(self) -> AbstractContextManager[None]:
        """What is asked of the engine within is a quick look (:meth:`HTTP.probing`)."""
        return self.http.probing()

    def requests_sent(self) -> Mapping[str, int] | None:
        return dict(self.http.sent)

    # -- model ------------------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        """The served model's name (``model=`` if given, else the first of ``GET /v1/models``)."""
        if self._model is None:
            self._model = self._discover_model()
        return self._model

    def _discover_model(self) -> str:
        # OpenAI schema, served by all six kinds: {"object": "list", "data": [{"id": …}]}.
        data = self.http.get("/v1/models").data
        try:
            return str(data["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise EngineResponseError(
                f"{self.http.url('/v1/models')} lists no model; pass model=… (CLI: --model)",
                url=self.http.url("/v1/models"),
                kind=self.kind,
                body=data,
            ) from None

    # -- counting ---------------------------------------------------------------------------------
    @property
    def count_key(self) -> str:
        """Whose tokenizer counts here, the key counts are kept under: the served model's (the
        engine counts with it). Engines that count with a local stand-in say which."""
        return self.model_id

    def count(self, texts: Sequence[str]) -> list[int]:
        """Token counts of ``texts`` (no template, no special tokens), batched, cached (in
        memory, then ``count_cache``) by text digest and :attr:`count_key`."""
        texts = list(texts)
        digests = [text_digest(t) for t in texts]
        known, todo = self._known(texts, digests)
        if todo:
            known.update(self._keep_counts(todo, self.engine_count(list(todo.values()))))
        return [known[d] for d in digests]

    def _known(self, texts: list[str], digests: list[str]) -> tuple[dict[str, int], dict[str, str]]:
        """The counts of ``texts`` kept (in memory, then in ``count_cache``) by digest, and the
        distinct texts still to count, by digest."""
        key = self.count_key
        known: dict[str, int] = {}
        for d in digests:
            n = self._count_memo.get((key, d))
            if n is not None:
                known[d] = n
        missing = [d for d in dict.fromkeys(digests) if d not in known]
        if self.count_cache is not None and missing:
            stored = dict(self.count_cache.get_many(key, missing))
            for d, n in stored.items():
                self._count_memo.put((key, d), n)
            known.update(stored)
        todo: dict[str, str] = {}
        for d, t in zip(digests, texts, strict=True):
            if d not in known:
                todo.setdefault(d, t)  # each distinct text once
        return known, todo

    def _keep_counts(self, todo: Mapping[str, str], counts: Sequence[int]) -> dict[str, int]:
        """Keep fresh counts of ``todo``'s texts (in memory and in ``count_cache``); by digest."""
        key = self.count_key
        new = dict(zip(todo, counts, strict=True))
        for d, n in new.items():
            self._count_memo.put((key, d), n)
        if self.count_cache is not None:
            self.count_cache.put_many(key, new)
        return new

    def prefetch(self, texts: Sequence[str], chats: Sequence[Sequence[Mapping[str, str]]] = ()) -> None:
        """Count ``texts`` and render ``chats`` ahead — what :meth:`count` and :meth:`render`
        answer then from memory — in as few engine requests as the engine allows: a new
        question's prompt without passages (its fixed part) and its candidates' texts, counted
        before the selection needs them (llama.cpp: one ``/tokenize`` for one chat and every
        text not counted yet). The counts are the engine's own, as :meth:`count` and
        :meth:`render` would have them."""
        texts = list(texts)
        _, todo = self._known(texts, [text_digest(t) for t in texts])
        pending = [list(c) for c in chats if self._render_memo.get(self._render_key(c)) is None]
        if pending and todo:
            rendered, counts = self.render_and_count(pending.pop(0), list(todo.values()))
            self._keep_render(rendered)
            self._keep_counts(todo, counts)
        elif todo:
            self._keep_counts(todo, self.engine_count(list(todo.values())))
        for chat in pending:
            self.render(chat)

    def render_and_count(
        self, messages: Sequence[Mapping[str, str]], texts: list[str]
    ) -> tuple[RenderedPrompt, list[int]]:
        """:meth:`engine_render` of ``messages`` and :meth:`engine_count` of ``texts`` (distinct,
        none counted yet): one request where the engine can do both at once (llama.cpp), two
        otherwise."""
        return self.engine_render(messages), self.engine_count(texts)

    @abstractmethod
    def engine_count(self, texts: list[str]) -> list[int]:
        """Counts of distinct ``texts`` the cache does not hold, by the engine (or its stated
        local estimate), in order."""

    def each_text(self, count_one: Callable[[str], int], texts: list[str]) -> list[int]:
        """``count_one`` over ``texts`` for an engine with one text per request: concurrently,
        ``workers`` at a time."""
        if len(texts) == 1:
            return [count_one(texts[0])]
        with ThreadPoolExecutor(max_workers=min(self.workers, len(texts))) as pool:
            return list(pool.map(count_one, texts))

    # -- rendering --------------------------------------------------------------------------------
    def render(self, messages: Sequence[Mapping[str, str]]) -> RenderedPrompt:
        """The prompt after the engine's chat template, with its token count (the same messages
        rendered before are answered from memory: the engine's template and tokenizer give the
        same prompt every time)."""
        hit = self._render_memo.get(self._render_key(messages))
        if isinstance(hit, RenderedPrompt):
            return hit
        rendered = self.engine_render(messages)
        self._keep_render(rendered)
        return rendered

    def _render_key(self, messages: Sequence[Mapping[str, str]]) -> tuple[str, str]:
        import json

        msgs = [{"role": str(m.get("role")), "content": str(m.get("content"))} for m in messages]
        return (self.count_key, text_digest(json.dumps(msgs, ensure_ascii=False)))

    def _keep_render(self, rendered: RenderedPrompt) -> None:
        self._render_memo.put(self._render_key(rendered.messages), rendered, size=max(1, rendered.n_tokens))

    @abstractmethod
    def engine_render(self, messages: Sequence[Mapping[str, str]]) -> RenderedPrompt:
        """:meth:`render`, asked of the engine (or its local stand-in)."""

    def template_overhead(self, system_prompt: str | None = None) -> int:
        """Tokens the chat template and ``system_prompt`` add around an empty user turn (the
        part of every prompt that is not context or question), measured once per model."""
        key = (self.model_id, text_digest(system_prompt or ""))
        with self._lock:
            if key in self._overheads:
                return self._overheads[key]
        n = render_overhead(self, system_prompt)
        with self._lock:
            self._overheads[key] = n
        return n

    def prompt_builder(self, system_prompt: str | None = None) -> PromptBuilder:
        """A builder that counts and renders through the engine (its tokenizer and chat template,
        or its stated local stand-in), every candidate counted in one batch."""
        from ...prompt.prompt import EnginePromptBuilder

        return EnginePromptBuilder(self, system_prompt=system_prompt)

    def tune(self, admission: AdmissionController) -> bool:
        """Give admission the engine's speed, once its answers have shown it (its time model:
        refusals for time and their ``Retry-After``); the engine holds its own memory, so nothing
        beyond the KV tokens there. False before the speed is known."""
        throughput = self.speed.throughput()
        if throughput is None:
            return False
        admission.configure(throughput=throughput, ttft_target=admission.ttft_target)
        self._tuned = throughput
        return True

    def refresh_speed(self, *, idle: Callable[[], bool], recheck_s: float) -> bool:
        """True when the speed the engine's answers show has moved by more than a quarter since
        admission was given it (:meth:`tune` then gives the new one); nothing is measured here."""
        now, then = self.speed.throughput(), self._tuned
        if now is None or then is None:
            return False
        moved = max(now.prefill_a / max(then.prefill_a, 1e-9), now.decode_s / then.decode_s)
        return moved > 1.25 or moved < 0.8

    # -- capacity ---------------------------------------------------------------------------------
    #: Seconds a reading of the engine's figures answers :meth:`capacity` again. One request asks
    #: two or three times within milliseconds (the server's early look at admission, the plan,
    #: the prompt); each reading is one to three HTTP calls, and a figure that old is as current
    #: as the engine's own metrics, which it updates on a similar interval. 0: read every time.
    CAPACITY_TTL_S = 1.0

    def capacity(self, *, max_new_tokens: int | None = None, fresh: bool = False) -> Capacity:
        """The engine's figures now (each with its source; a reading less than
        :attr:`CAPACITY_TTL_S` old is reused unless ``fresh``); ``context_tokens=`` overrides
        the window when given. They do not depend on ``max_new_tokens``: the engine reports what
        it holds, and :func:`~ragbudget.generation.backend.per_request_tokens` takes the answer
        off it. ``fresh`` is for a caller keeping its own interval (the server's look at the
        engine, every ``engine_recheck_s``): the reading it gets is the one reused after it."""
        now = time.monotonic()
        recent = self._recent
        if not fresh and recent is not None and now - recent[0] < self.CAPACITY_TTL_S:
            return recent[1]
        cap = _replace(self.engine_capacity(), url=self.url, detected=self.detection.how)
        if self.context_tokens is not None:
            notes = cap.notes
            if cap.max_context_tokens is not None and cap.max_context_tokens != self.context_tokens:
                notes += (
                    f"context_tokens={self.context_tokens} given; the engine says "
                    f"{cap.max_context_tokens} ({cap.max_context_source})",
                )
            cap = _replace(
                cap, max_context_tokens=self.context_tokens, max_context_source="context_tokens (given)", notes=notes
            )
        self._window = (cap.max_context_tokens, cap.max_prompt_tokens)
        self._recent = (now, cap)
        return cap

    def route_version(self, path: str) -> str | None:
        """The ``version`` a route reports, or ``None`` when it has none (a figure for the plan,
        never a reason to fail)."""
        try:
            data = self.http.get(path).data
        except EngineError:
            return None
        return data.get("version") if isinstance(data, Mapping) else None

    @abstractmethod
    def engine_capacity(self) -> Capacity:
        """The engine's own figures (before ``context_tokens`` overrides the window)."""

    def _window_figures(self) -> tuple[int | None, int | None]:
        if self._window is None:
            self.capacity()
        assert self._window is not None
        return self._window

    # -- generation -------------------------------------------------------------------------------
    def generate(
        self,
        prompt: PromptInput,
        *,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop: Sequence[str] | None = None,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Generation:
        """Answer ``prompt`` with at most ``max_new_tokens`` tokens (always sent as
        ``max_tokens``). Streams when ``on_text`` or ``cancel`` is given.

        A too-long prompt gets one retry with the budget cut by the server's own figures: a
        :class:`ragbudget.prompt.prompt.Prompt` is packed again by the packer that chose its
        passages (:meth:`~ragbudget.prompt.prompt.Prompt.fewer`) into what the server's count
        leaves; any other prompt that fits alone gets ``max_new_tokens`` cut to what the
        window leaves. If that is impossible or the retry is refused too,
        :class:`~ragbudget.errors.EngineContextError` carries the server's numbers.
        """
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be ≥ 1; got {max_new_tokens}")
        current, new_tokens = prompt, max_new_tokens
        for attempt in (1, 2):
            messages = prompt_messages(current)
            result = self._chat(
                messages,
                max_new_tokens=new_tokens,
                sampling=sampling or Sampling(),
                stop=list(stop) if stop else None,
                on_text=on_text,
                cancel=cancel,
                prompt=current,
            )
            if not isinstance(result, TooLong):
                return result
            smaller = None if attempt == 2 else self._shrink(current, result, new_tokens)
            if smaller is None:
                raise self._context_error(result, new_tokens, retried=attempt == 2)
            log.info(
                "%s: prompt too long (%s prompt tokens, window %s); retrying once smaller",
                self.kind,
                result.n_prompt_tokens,
                result.n_ctx,
            )
            current, new_tokens = smaller
        raise AssertionError("unreachable")  # pragma: no cover

    def _context_error(self, t: TooLong, max_new_tokens: int, *, retried: bool) -> EngineContextError:
        what = "even after one retry with a smaller budget" if retried else "and cannot be cut"
        return EngineContextError(
            f"{self.http.url('/v1/chat/completions')}: the prompt does not fit the "
            f"{self.kind} context ({t.n_prompt_tokens} prompt tokens + {max_new_tokens} new vs a "
            f"window of {t.n_ctx}; {t.source}) {what}: lower context_tokens or max_new_tokens, or "
            "start the engine with a larger context",
            url=self.http.url("/v1/chat/completions"),
            kind=self.kind,
            status=t.status,
            body=t.body,
            n_prompt_tokens=t.n_prompt_tokens,
            n_ctx=t.n_ctx,
            max_new_tokens=max_new_tokens,
            source=t.source,
        )

    def _shrink(self, prompt: Any, t: TooLong, max_new_tokens: int) -> tuple[Any, int] | None:
        if t.n_ctx is None:
            return None
        room = t.n_ctx - max_new_tokens  # prompt tokens the server can take
        if isinstance(prompt, Refittable):
            # Scale our count to the server's (its tokenizer may count differently), then ask the
            # packer that chose the passages for a prompt whose scaled count fits the window.
            local = max(1, prompt.n_tokens)
            ratio = (t.n_prompt_tokens or local) / local
            smaller = prompt.fewer(int(room / ratio))
            if smaller is not None:  # None: no passage to take out (the answer may still be cut)
                fits = smaller.n_tokens < prompt.n_tokens and smaller.n_tokens * ratio <= room
                return (smaller, max_new_tokens) if fits else None  # not even the fixed part fits: no retry
        if t.n_prompt_tokens is not None and t.n_prompt_tokens < t.n_ctx:
            return prompt, t.n_ctx - t.n_prompt_tokens  # the answer gets what the window leaves
        return None

    def _body(
        self,
        messages: list[dict[str, str]],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        stop: list[str] | None,
        stream: bool,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_id,
            "messages": messages,
            "max_tokens": max_new_tokens,
            **sampling_fields(sampling, stop),
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

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

        stream = on_text is not None or cancel is not None
        body = self._body(messages, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop, stream=stream)
        path = "/v1/chat/completions"
        t0 = time.perf_counter()
        if cancel is not None and cancel.is_set():
            return Generation(
                text="",
                prompt_tokens=0,
                new_tokens=0,
                finish_reason="cancelled",
                seconds=0.0,
                cache="served",
                prompt=_keep(prompt),
            )
        timeout = self.reply_timeout(prompt, max_new_tokens)
        before = self.running_tasks()  # what ran before this request was sent (see let_go)
        if not stream:
            try:
                reply = self.http.post(path, body, allow=self.too_long_statuses, timeout=timeout)
            except EngineTimeoutError:
                self.let_go(before)  # the time-out closed the connection: the engine stops the task
                raise
            if reply.status != 200:
                return self.too_long_or_raise(reply, messages, max_new_tokens)
            data = reply.data
            try:
                choice = data["choices"][0]
                text = choice["message"].get("content") or ""
                finish = choice.get("finish_reason") or "stop"
            except (KeyError, IndexError, TypeError, AttributeError):
                raise self._shape_error(path, data) from None
            usage = data.get("usage") or {}
            if isinstance(data.get("timings"), Mapping):  # llama.cpp's own figures
                self.speed.observe(data["timings"])
            return self._generation(text, finish, usage, messages, t0, prompt)

        got = _Streamed()
        try:
            events = self.http.stream(path, body, cancel=cancel, allow=self.too_long_statuses, timeout=timeout)
            for event in events:
                if isinstance(event, Reply):
                    return self.too_long_or_raise(event, messages, max_new_tokens)
                self._streamed(event, path, got, on_text)
        except EngineTimeoutError:
            self.let_go(before)  # the time-out closed the connection: the engine stops the task
            raise
        finish = got.finish
        if cancel is not None and cancel.is_set() and finish is None:
            finish = "cancelled"
            self.let_go(before)  # the stream was closed before its end: the engine stops the task
        elif got.first_at is not None:
            self.speed.observe(
                got.timings,
                prompt_tokens=int(got.usage.get("prompt_tokens") or 0),
                new_tokens=int(got.usage.get("completion_tokens") or 0),
                first_s=got.first_at - t0,
                total_s=time.perf_counter() - t0,
            )
        return self._generation("".join(got.pieces), finish or "stop", got.usage, messages, t0, prompt)

    def reply_timeout(self, prompt: Any, max_new_tokens: int) -> float | None:
        """Seconds a generation of ``prompt`` may wait on the engine: ``None`` (the client's)
        where a time-out was given (``--engine-timeout``), else drawn from the engine's measured
        speed (:class:`~ragbudget.generation.engines._pacing.EngineSpeed`): long enough for a
        slow engine's answer, short for a fast one's."""
        if self.http.timeout_given:
            return None
        n = getattr(prompt, "n_tokens", None)
        if not isinstance(n, int):  # chat messages or a string: counted by the window at most
            n = self._window[0] if self._window is not None and self._window[0] is not None else 0
        return self.speed.timeout(n, max_new_tokens)

    def _streamed(self, event: Any, path: str, got: _Streamed, on_text: Callable[[str], None] | None) -> None:
        """One streamed event: its text added to ``got.pieces`` (and passed to ``on_text``), its
        finish reason, usage and timings kept."""
        if not isinstance(event, Mapping):
            raise self._shape_error(path, event)
        if "error" in event:  # an error after the stream began (vLLM, llama.cpp, TGI shapes)
            raise EngineResponseError(
                f"{self.http.url(path)} failed mid-stream: {error_message(event)}",
                url=self.http.url(path),
                kind=self.kind,
                body=event,
            )
        if event.get("usage"):
            got.usage = event["usage"]
        if isinstance(event.get("timings"), Mapping):  # llama.cpp's own figures, on the last event
            got.timings = event["timings"]
        for choice in event.get("choices") or ():
            delta = (choice.get("delta") or {}).get("content")
            if delta:
                if got.first_at is None:
                    got.first_at = time.perf_counter()
                got.pieces.append(delta)
                if on_text is not None:
                    on_text(delta)
            if choice.get("finish_reason"):
                got.finish = choice["finish_reason"]

    def running_tasks(self) -> frozenset[object] | None:
        """The engine's tasks running as last read (before a request is sent), for
        :meth:`let_go`; ``None`` where the engine does not say (the default)."""
        return None

    def let_go(self, before: frozenset[object] | None) -> None:
        """A request was abandoned (cancelled, or past the time-out) and its connection closed,
        which makes the engine stop it: forget the engine's figures read while it ran, so the
        next request reads them afresh. An engine that frees its slot a moment later (llama.cpp)
        waits here until it has — until no task runs there that did not run ``before`` — so
        that the next request finds it free."""
        self._recent = None

    def _generation(
        self, text: str, finish: str, usage: Mapping[str, Any], messages: list[dict[str, str]], t0: float, prompt: Any
    ) -> Generation:
        from ..generate import Generation

        prompt_tokens = usage.get("prompt_tokens")
        new_tokens = usage.get("completion_tokens")
        if prompt_tokens is None and finish != "cancelled":
            prompt_tokens = self.render(messages).n_tokens
        if new_tokens is None:
            new_tokens = self.count([text])[0] if text else 0
        return Generation(
            text=text,
            prompt_tokens=int(prompt_tokens or 0),
            new_tokens=int(new_tokens),
            finish_reason=str(finish),
            seconds=time.perf_counter() - t0,
            cache="served",
            prompt=_keep(prompt),
        )

    def _shape_error(self, path: str, data: Any) -> EngineResponseError:
        return EngineResponseError(
            f"{self.http.url(path)} answered without the OpenAI chat fields (choices[0]"
            f".message): is this an OpenAI-compatible engine? (kind={self.kind})",
            url=self.http.url(path),
            kind=self.kind,
            body=data,
        )

    def too_long_or_raise(self, reply: Reply, messages: list[dict[str, str]], max_new_tokens: int) -> TooLong:
        t = self.too_long(reply, messages, max_new_tokens)
        if t is None:
            url = self.http.url("/v1/chat/completions")
            raise EngineResponseError(
                f"{url} answered {reply.status}: {error_message(reply.data, reply.text)}",
                url=url,
                kind=self.kind,
                status=reply.status,
                body=reply.data,
            )
        return t

    def too_long(self, reply: Reply, messages: list[dict[str, str]], max_new_tokens: int) -> TooLong | None:
        """Whether an error reply is a too-long prompt. Default (engines whose error bodies carry
        no figures: vLLM, SGLang, TGI): recount the prompt with the server's own tokenizer and
        compare with its advertised window — structured figures, not the message text."""
        max_context, max_prompt = self._window_figures()
        n = self.render(messages).n_tokens
        limits = []
        if max_context is not None:
            limits.append(max_context)
            if n + max_new_tokens > max_context:
                return TooLong(
                    n_prompt_tokens=n,
                    n_ctx=max_context,
                    status=reply.status,
                    body=reply.data,
                    source=f"recount {self.kind} tokenizer vs advertised window",
                )
        if max_prompt is not None and n > max_prompt:
            return TooLong(
                n_prompt_tokens=n,
                n_ctx=max_prompt + max_new_tokens,
                status=reply.status,
                body=reply.data,
                source=f"recount {self.kind} tokenizer vs max prompt {max_prompt}",
            )
        return None


@dataclass
class _Streamed:
    """What a streamed answer brought so far: its text pieces, finish reason, usage, the
    engine's timings, and when its first text came (``time.perf_counter``)."""

    pieces: list[str] = field(default_factory=list)
    finish: str | None = None
    usage: Mapping[str, Any] = field(default_factory=dict)
    timings: Mapping[str, Any] | None = None
    first_at: float | None = None


def _keep(prompt: Any) -> Any:
    return prompt if hasattr(prompt, "input_ids") else None


def _replace(cap: Capacity, **changes: Any) -> Capacity:
    import dataclasses

    return dataclasses.replace(cap, **changes)


def sampling_fields(sampling: Sampling, stop: Sequence[str] | None) -> dict[str, Any]:
    """The OpenAI-named sampling fields of a request (also Ollama's ``options``): greedy unless
    asked otherwise, as the local generator; ``top_p`` only when sampling.

    >>> sampling_fields(Sampling(), ["\\n\\n"])
    {'temperature': 0.0, 'stop': ['\\n\\n']}
    """
    fields: dict[str, Any] = {"temperature": 0.0 if sampling.greedy else sampling.temperature}
    if sampling.top_p is not None and not sampling.greedy:
        fields["top_p"] = sampling.top_p
    if sampling.seed is not None:
        fields["seed"] = sampling.seed
    if stop:
        fields["stop"] = list(stop)
    return fields
