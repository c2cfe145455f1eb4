"""What every served engine shares: counting with a cache, OpenAI chat generation (plain or SSE
streaming, cancellable), the one too-long retry, and a local tokenizer for engines that cannot
count. Engine modules subclass :class:`ServedBackend` and fill in the engine's own figures.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ...errors import ConfigError, EngineContextError, EngineError, EngineResponseError
from ..backend import (
    Capacity,
    CountCache,
    RenderedPrompt,
    Sampling,
    prompt_messages,
    render_overhead,
    text_digest,
)
from ._http import HTTP, Reply, error_message

if TYPE_CHECKING:  # pragma: no cover
    from ...memory.admission import AdmissionController
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


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition as ``(name, labels, value)``.

    Label values may hold commas and escaped quotes; lines that do not parse are skipped.

    >>> parse_prometheus('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0')
    [('vllm:cache_config_info', {'block_size': '16', 'num_gpu_blocks': 'None'}, 1.0)]
    """
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        labels: dict[str, str] = {}
        if "{" in line:
            name, rest = line.split("{", 1)
            i = 0
            while i < len(rest) and rest[i] != "}":
                eq = rest.find("=", i)
                if eq < 0 or eq + 1 >= len(rest) or rest[eq + 1] != '"':
                    break
                key = rest[i:eq].strip().lstrip(",").strip()
                j, val = eq + 2, []
                while j < len(rest) and rest[j] != '"':
                    if rest[j] == "\\" and j + 1 < len(rest):
                        val.append({"n": "\n"}.get(rest[j + 1], rest[j + 1]))
                        j += 2
                        continue
                    val.append(rest[j])
                    j += 1
                labels[key] = "".join(val)
                i = j + 1
                while i < len(rest) and rest[i] in ", ":
                    i += 1
            if i >= len(rest) or rest[i] != "}":
                continue
            value_part = rest[i + 1 :].split()
        else:
            name, *value_part = line.split()
        try:
            out.append((name.strip(), labels, float(value_part[0])))
        except (IndexError, ValueError):
            continue
    return out


def int_or_none(value: Any) -> int | None:
    """``value`` as an int (a float or a numeric string too), or ``None`` when it is none.

    >>> int_or_none("16"), int_or_none(2.0), int_or_none("None")
    (16, 2, None)
    """
    # vLLM stringifies unset CacheConfig fields as "None" (vllm/config/cache.py metrics_info).
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None


class LocalCounter:
    """Counts for engines that cannot count (Ollama, a generic OpenAI server): a local tokenizer
    plus a stated safety ``margin`` (a fraction added to every count, rounded up).

    ``tokenizer``: ``None`` → tiktoken ``cl100k_base`` with a 15% margin (another model's
    vocabulary: Llama-family models count 3–30% differently); a Hugging Face tokenizer object or a
    local folder / hub id (loaded with transformers on first use) → that tokenizer, its chat
    template, and a 2% margin (the server may render the template differently).
    """

    def __init__(self, tokenizer: Any = None, *, margin: float | None = None) -> None:
        self._spec = tokenizer
        self._tok: Any = None
        self._hf: Any = None
        self.margin = margin if margin is not None else (0.15 if tokenizer is None else 0.02)
        self.name = (
            "tiktoken cl100k_base" if tokenizer is None else str(getattr(tokenizer, "name_or_path", None) or tokenizer)
        )
        #: What its counts are kept under (with the model): another tokenizer or margin counts
        #: differently, so counts made with one are never reused for the other.
        self.key = f"{self.name} +{self.margin:g}"

    def _load(self) -> Any:
        if self._tok is None:
            from ...tokens import HFTokenizer, get_tokenizer

            spec = self._spec
            if isinstance(spec, str):
                from transformers import AutoTokenizer

                spec = AutoTokenizer.from_pretrained(spec)
            self._tok = get_tokenizer(spec)
            if isinstance(self._tok, HFTokenizer):
                self._hf = self._tok.hf
        return self._tok

    def _pad(self, n: int) -> int:
        return math.ceil(n * (1 + self.margin))

    def count(self, texts: Sequence[str]) -> list[int]:
        tok = self._load()
        return [self._pad(tok.count(t)) for t in texts]

    def render(self, messages: Sequence[Mapping[str, str]]) -> RenderedPrompt:
        tok = self._load()
        msgs = tuple(dict(m) for m in messages)
        if self._hf is not None and getattr(self._hf, "chat_template", None):
            text = self._hf.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)
            n = len(self._hf.encode(text, add_special_tokens=False))
            how = f"local chat template of {self.name}"
        else:
            # No template known: content plus a generous 8 tokens per message for role markup.
            text = None
            n = sum(tok.count(m["content"]) + 8 for m in msgs) + 4
            how = f"local count with {self.name}, 8 tokens per message for the template"
        return RenderedPrompt(
            messages=msgs,
            n_tokens=self._pad(n),
            exact=False,
            text=text,
            source=f"{how}, +{self.margin:.0%} safety margin",
            margin=self.margin,
        )


class _LRU:
    """A thread-safe least-recently-used map with a bound on its total ``size`` (an entry's
    size is 1 unless given): what a long-running server may keep in memory of an engine's
    answers without growing for ever."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._data: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            hit = self._data.get(key)
            if hit is None:
                return None
            self._data.move_to_end(key)
            return hit[0]

    def put(self, key: Any, value: Any, size: int = 1) -> None:
        if size > self.max_size:
            return  # would evict everything else
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._size -= old[1]
            self._data[key] = (value, size)
            self._size += size
            while self._size > self.max_size:
                _, (_, gone) = self._data.popitem(last=False)
                self._size -= gone

    def __len__(self) -> int:
        return len(self._data)


class ServedBackend(ABC):
    """A :class:`~ragbudget.generation.backend.Backend` over a served engine's HTTP API.

    Subclasses set ``kind`` and implement :meth:`_capacity`, :meth:`_render` and
    :meth:`_count_uncached` (a batch route, or one request per text through :meth:`_each`).
    Generation goes to ``POST /v1/chat/completions`` with ``max_tokens`` always set. A subclass
    that counts with a local stand-in sets :attr:`takes_tokenizer` and takes ``tokenizer=``.
    Another package adds an engine kind by registering its subclass in the
    ``ragbudget.engines`` entry-point group (:func:`ragbudget.generation.engines.backend_class`).

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
        self._count_memo = _LRU(self.COUNT_MEMO)
        self._render_memo = _LRU(self.RENDER_MEMO_TOKENS)
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
        if todo:
            fresh = self._count_uncached(list(todo.values()))
            new = dict(zip(todo, fresh, strict=True))
            known.update(new)
            for d, n in new.items():
                self._count_memo.put((key, d), n)
            if self.count_cache is not None:
                self.count_cache.put_many(key, new)
        return [known[d] for d in digests]

    @abstractmethod
    def _count_uncached(self, texts: list[str]) -> list[int]:
        """Counts of distinct ``texts`` the cache does not hold, by the engine (or its stated
        local estimate), in order."""

    def _each(self, count_one: Callable[[str], int], texts: list[str]) -> list[int]:
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
        import json

        msgs = [{"role": str(m.get("role")), "content": str(m.get("content"))} for m in messages]
        key = (self.count_key, text_digest(json.dumps(msgs, ensure_ascii=False)))
        hit = self._render_memo.get(key)
        if isinstance(hit, RenderedPrompt):
            return hit
        rendered = self._render(messages)
        self._render_memo.put(key, rendered, size=max(1, rendered.n_tokens))
        return rendered

    @abstractmethod
    def _render(self, messages: Sequence[Mapping[str, str]]) -> RenderedPrompt:
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
        return False  # the engine admits its own requests: nothing beyond their KV tokens to add

    def refresh_speed(self, *, idle: Callable[[], bool], recheck_s: float) -> bool:
        return False  # nothing measured here: the engine paces itself

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
        cap = _replace(self._capacity(), url=self.url, detected=self.detection.how)
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

    def _version(self, path: str) -> str | None:
        """The ``version`` a route reports, or ``None`` when it has none (a figure for the plan,
        never a reason to fail)."""
        try:
            data = self.http.get(path).data
        except EngineError:
            return None
        return data.get("version") if isinstance(data, Mapping) else None

    @abstractmethod
    def _capacity(self) -> Capacity:
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
        :class:`ragbudget.prompt.prompt.Prompt` loses its lowest-scored passages until it fits the
        server's count; any other prompt that fits alone gets ``max_new_tokens`` cut to what the
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
        from ...prompt.prompt import Prompt  # lazy: only a prompt that is too long gets here

        if isinstance(prompt, Prompt) and prompt.passages:
            # Scale our local count to the server's (its tokenizer may count differently), then
            # drop the lowest-scored passages until the scaled count fits.
            local = max(1, prompt.n_tokens)
            ratio = (t.n_prompt_tokens or local) / local
            p: Prompt | None = prompt
            while p is not None and p.n_tokens * ratio > room:
                p = p.without_lowest(1) if p.passages else None
            return (p, max_new_tokens) if p is not None else None
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
        if not stream:
            reply = self.http.post(path, body, allow=self.too_long_statuses)
            if reply.status != 200:
                return self._too_long_or_raise(reply, messages, max_new_tokens)
            data = reply.data
            try:
                choice = data["choices"][0]
                text = choice["message"].get("content") or ""
                finish = choice.get("finish_reason") or "stop"
            except (KeyError, IndexError, TypeError, AttributeError):
                raise self._shape_error(path, data) from None
            usage = data.get("usage") or {}
            return self._generation(text, finish, usage, messages, t0, prompt)

        pieces: list[str] = []
        finish, usage = None, {}
        for event in self.http.stream(path, body, cancel=cancel, allow=self.too_long_statuses):
            if isinstance(event, Reply):
                return self._too_long_or_raise(event, messages, max_new_tokens)
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
                usage = event["usage"]
            for choice in event.get("choices") or ():
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    pieces.append(delta)
                    if on_text is not None:
                        on_text(delta)
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
        if cancel is not None and cancel.is_set() and finish is None:
            finish = "cancelled"
        return self._generation("".join(pieces), finish or "stop", usage, messages, t0, prompt)

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

    def _too_long_or_raise(self, reply: Reply, messages: list[dict[str, str]], max_new_tokens: int) -> TooLong:
        t = self._too_long(reply, messages, max_new_tokens)
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

    def _too_long(self, reply: Reply, messages: list[dict[str, str]], max_new_tokens: int) -> TooLong | None:
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


def _keep(prompt: Any) -> Any:
    return prompt if hasattr(prompt, "input_ids") else None


def _replace(cap: Capacity, **changes: Any) -> Capacity:
    import dataclasses

    return dataclasses.replace(cap, **changes)


def iter_samples(text: str, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """``(labels, value)`` of every sample of metric ``name``."""
    for n, labels, value in parse_prometheus(text):
        if n == name:
            yield labels, value


def metric_sum(text: str, name: str) -> float | None:
    """The sum of a metric over its label sets (engines publish one series per DP engine)."""
    vals = [v for _, v in iter_samples(text, name)]
    return sum(vals) if vals else None


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


def queue_load(text: str, running: str, waiting: str) -> tuple[int | None, int | None, str]:
    """``(running, waiting, source)`` from an engine's Prometheus gauges of requests running and
    queued (each ``None`` when the engine does not publish it; ``source`` empty when neither).

    >>> queue_load('r{engine="0"} 2\\nr{engine="1"} 1\\nw 0\\n', "r", "w")
    (3, 0, 'GET /metrics r / w')
    >>> queue_load("", "r", "w")
    (None, None, '')
    """
    r, w = metric_sum(text, running), metric_sum(text, waiting)
    source = f"GET /metrics {running} / {waiting}" if r is not None or w is not None else ""
    return (None if r is None else int(r)), (None if w is None else int(w)), source
