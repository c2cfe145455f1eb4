"""llama.cpp's ``llama-server``: per-slot context and slots from ``/props`` and ``/slots``, exact
counts from ``/apply-template`` + ``/tokenize``, and too-long errors that carry the server's
own figures.

Field names, checked against ``tools/server/`` of the llama.cpp that llama-cpp-python 0.3.36
vendors (the version CI builds):

* ``GET /props`` → ``default_generation_settings.n_ctx`` (the context of *one slot*:
  ``-c`` ÷ ``-np``), ``total_slots``, ``build_info``, ``model_alias``, ``endpoint_slots``
  (``get_res_props`` in ``server-context.cpp``).
* ``GET /slots`` → one object per slot: ``id``, ``n_ctx``, ``is_processing`` (``server_slot::
  to_json`` in server-context.cpp); answers 501 ``not_supported_error`` when started with
  ``--no-slots``.
* ``POST /apply-template`` with ``{"messages"}`` → ``{"prompt"}``; ``POST /tokenize`` with
  ``{"content", "add_special", "parse_special", "with_pieces"}`` → ``{"tokens"}``
  (``post_apply_template`` / ``post_tokenize``, server-context.cpp). The chat route tokenizes
  its rendered prompt with special tokens added and parsed, so :meth:`render` does the same.
  ``content`` may be an array of strings and token ids (``tokenize_mixed`` in
  ``server-common.cpp``): each string is tokenized on its own, exactly as if sent alone, and
  each id is passed through as is. So many texts are counted in one request, separated by the
  id -1 (no tokenizer yields it): see :meth:`LlamaCppBackend.engine_count`.
* The chat template, learnt once per system prompt: ``/apply-template`` renders the system turn
  and a user turn holding a sentinel, which splits the text into the template's head and tail;
  a second render, of a probe with edge whitespace, markup and quotes, checks that the template
  writes a user turn as it is (no trimming, escaping or rewriting). Then a chat of that system
  prompt and one user turn is head + content + tail, the text ``/apply-template`` and the chat
  route make of it, and counting it takes one ``/tokenize`` (issue #42 §5: a new question cost
  two ``/apply-template`` calls). A template that fails the check, and a chat with history, are
  rendered by ``/apply-template`` each time.
* errors → ``{"error": {"code", "message", "type"}}`` with the HTTP status taken from ``code``
  (``format_error_response`` in ``server-common.cpp``). A too-long prompt is 400
  ``exceed_context_size_error`` with ``n_prompt_tokens`` and ``n_ctx`` beside them
  (``server_task_result_error::to_json`` in ``server-task.cpp``; raised when the prompt alone
  reaches the slot's ``n_ctx``); in streaming mode that first error is sent as a plain response
  (``handle_completions_impl``). ``unavailable_error`` is 503 (loading model, no slot).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import EngineError, EngineResponseError
from ..backend import Capacity, RenderedPrompt
from ._base import ServedBackend, TooLong, int_or_none
from ._http import HTTP, Reply

__all__ = ["LlamaCppBackend"]

log = logging.getLogger("ragbudget.engines")

#: Between the texts of a batched /tokenize: passed through as a token, and no tokenizer yields it.
_SEPARATOR = -1
#: The user turn a template's frame is learnt with (invisible separators around a word no
#: question holds), and the probe that checks the template writes a user turn as it is: edge
#: whitespace (a trimming template), markup, an entity and quotes (an escaping one), Jinja braces.
_SENTINEL = "\u2063ragbudget-user-turn\u2063"
_PROBE = ' \n<p>&amp; "it\'s" {{ x }} [1]\n\n '


class LlamaCppBackend(ServedBackend):
    """A llama.cpp ``llama-server``."""

    kind = "llamacpp"
    #: System prompts whose template frame (head, tail) is kept.
    FRAMES = 64

    def __init__(self, http: HTTP, **kwargs: Any) -> None:
        super().__init__(http, **kwargs)
        self._frames: OrderedDict[str, tuple[str, str] | None] = OrderedDict()
        self._frames_lock = threading.Lock()
        # The tasks the last GET /slots showed processing (None: not read, or --no-slots).
        self._tasks_seen: frozenset[object] | None = None

    def _tokenize(self, content: str, *, add_special: bool) -> list[int]:
        return self._tokens(content, add_special=add_special)

    def _tokens(self, content: str | list[str | int], *, add_special: bool) -> list[int]:
        data = self.http.post("/tokenize", {"content": content, "add_special": add_special}).data
        toks = data.get("tokens") if isinstance(data, Mapping) else None
        if not isinstance(toks, list):
            raise EngineResponseError(
                f"{self.http.url('/tokenize')} answered without `tokens`",
                url=self.http.url("/tokenize"),
                kind=self.kind,
                body=data,
            )
        return [int(t) for t in toks]

    #: Characters of text sent in one batched ``/tokenize`` request (a few hundred chunks).
    BATCH_CHARS = 256_000
    # Whether batched counting holds on this server: None until checked on first use.
    _batched: bool | None = None

    def engine_count(self, texts: list[str]) -> list[int]:
        """Counts of ``texts``: many in one ``/tokenize`` request (see the module docstring),
        one request per text on a server that does not take an array (an older llama.cpp) or
        whose batched counts differ from the single ones — checked once, on first use."""
        if len(texts) > 1 and self._batched is not False:
            try:
                counts = self._count_batched(texts)
                if self._batched is None:  # the first batch: the first text alone must agree
                    self._batched = counts[0] == self._count_one(texts[0])
                    if not self._batched:
                        log.warning("llama.cpp: batched /tokenize counts differ from single ones: one text a request")
                if self._batched:
                    return counts
            except EngineResponseError as exc:
                self._batched = False
                log.warning("llama.cpp: /tokenize takes no array here (%s): one text a request", exc)
        return self.each_text(self._count_one, texts)

    def _count_batched(self, texts: list[str]) -> list[int]:
        out: list[int] = []
        start = 0
        while start < len(texts):
            end, size = start, 0
            while end < len(texts) and (end == start or size + len(texts[end]) <= self.BATCH_CHARS):
                size += len(texts[end])
                end += 1
            batch = texts[start:end]
            content: list[str | int] = []
            for text in batch:
                content += [text, _SEPARATOR]
            counts: list[int] = []
            n = 0
            for t in self._tokens(content, add_special=False):
                if t == _SEPARATOR:
                    counts.append(n)
                    n = 0
                else:
                    n += 1
            if len(counts) != len(batch) or n:
                raise EngineResponseError(
                    f"{self.http.url('/tokenize')} answered {len(counts)} separated counts for {len(batch)} texts",
                    url=self.http.url("/tokenize"),
                    kind=self.kind,
                )
            out += counts
            start = end
        return out

    def _count_one(self, text: str) -> int:
        return len(self._tokenize(text, add_special=False))

    def engine_render(self, messages: Sequence[Mapping[str, str]]) -> RenderedPrompt:
        msgs = tuple(dict(m) for m in messages)
        text = self._template(msgs)
        return self._rendered(msgs, text, self._tokenize(text, add_special=True))

    def render_and_count(
        self, messages: Sequence[Mapping[str, str]], texts: list[str]
    ) -> tuple[RenderedPrompt, list[int]]:
        """One ``/tokenize`` for the chat and the texts: the rendered chat first (the only part
        ``add_special`` applies to, as the chat route tokenizes it), then each text after a
        separator (see the module docstring). The batch's counts are checked against single ones
        once, as :meth:`engine_count` does; a server that fails it renders and counts apart."""
        msgs = tuple(dict(m) for m in messages)
        text = self._template(msgs)
        if self._batched is False:
            return self._rendered(msgs, text, self._tokenize(text, add_special=True)), self.engine_count(texts)
        content: list[str | int] = [text]
        for t in texts:
            content += [_SEPARATOR, t]
        try:
            ids = self._tokens(content, add_special=True)
        except EngineResponseError as exc:
            self._batched = False
            log.warning("llama.cpp: /tokenize takes no array here (%s): one text a request", exc)
            return self.engine_render(msgs), self.engine_count(texts)
        parts: list[list[int]] = [[]]
        for token in ids:
            if token == _SEPARATOR:
                parts.append([])
            else:
                parts[-1].append(token)
        if len(parts) != len(texts) + 1:
            raise EngineResponseError(
                f"{self.http.url('/tokenize')} answered {len(parts) - 1} separated counts for {len(texts)} texts",
                url=self.http.url("/tokenize"),
                kind=self.kind,
            )
        counts = [len(p) for p in parts[1:]]
        if self._batched is None and texts:  # the first batch: the first text alone must agree
            self._batched = counts[0] == self._count_one(texts[0])
            if not self._batched:
                log.warning("llama.cpp: batched /tokenize counts differ from single ones: one text a request")
                return self.engine_render(msgs), self.engine_count(texts)
        return self._rendered(msgs, text, parts[0]), counts

    def _rendered(self, msgs: tuple[dict[str, str], ...], text: str, ids: Sequence[int]) -> RenderedPrompt:
        return RenderedPrompt(
            messages=msgs,
            n_tokens=len(ids),
            exact=True,
            text=text,
            token_ids=tuple(ids),
            source="the server's chat template (POST /apply-template) + POST /tokenize (the server's own)",
        )

    # -- the chat template ------------------------------------------------------------------------
    def _template(self, msgs: Sequence[Mapping[str, str]]) -> str:
        """The text the chat route makes of ``msgs``: head + content + tail of the frame learnt
        for its system prompt (see the module docstring), else ``/apply-template``'s."""
        last = msgs[-1] if msgs else None
        framed = last is not None and last.get("role") == "user" and len(msgs) <= 2
        if framed and len(msgs) == 2 and msgs[0].get("role") != "system":
            framed = False
        frame = self._frame(list(msgs[:-1])) if framed and last is not None else None
        if frame is None or last is None:
            return self._apply_template(msgs)
        head, tail = frame
        return head + str(last["content"]) + tail

    def _frame(self, prefix: list[Mapping[str, str]]) -> tuple[str, str] | None:
        """``(head, tail)`` of the template around a user turn after ``prefix`` (none, or one
        system turn), learnt on first use; ``None`` when the template does not write a user turn
        as it is (it is then rendered by the server every time)."""
        key = json.dumps([[m.get("role"), m.get("content")] for m in prefix], ensure_ascii=False)
        frames = self._frames
        with self._frames_lock:
            if key in frames:
                frames.move_to_end(key)
                return frames[key]
        frame = None
        text = self._apply_template([*prefix, {"role": "user", "content": _SENTINEL}])
        if text.count(_SENTINEL) == 1:
            head, tail = text.split(_SENTINEL)
            probe = self._apply_template([*prefix, {"role": "user", "content": _PROBE}])
            if probe == head + _PROBE + tail:
                frame = (head, tail)
        if frame is None:
            log.info("llama.cpp: the chat template rewrites a user turn: /apply-template renders every prompt")
        with self._frames_lock:
            frames[key] = frame
            while len(frames) > self.FRAMES:
                frames.popitem(last=False)
        return frame

    def _apply_template(self, msgs: Sequence[Mapping[str, str]]) -> str:
        data = self.http.post("/apply-template", {"messages": [dict(m) for m in msgs]}).data
        text = data.get("prompt") if isinstance(data, Mapping) else None
        if not isinstance(text, str):
            raise EngineResponseError(
                f"{self.http.url('/apply-template')} answered without `prompt`",
                url=self.http.url("/apply-template"),
                kind=self.kind,
                body=data,
            )
        return text

    #: Seconds an abandoned request waits for llama.cpp to stop it: it looks at a request's
    #: connection every second (``HTTP_POLLING_SECONDS``, server-context.cpp).
    LET_GO_S = 3.0

    def running_tasks(self) -> frozenset[object] | None:
        return self._tasks_seen

    def let_go(self, before: frozenset[object] | None) -> None:
        """Wait (at most :attr:`LET_GO_S`) until every task running on the engine was running
        before the abandoned request was sent — its own has left its slot, unless another
        request began meanwhile — so that the next request does not find its slot still held
        (issue #42 §5: "no free KV … 0 tokens" on a one-slot engine). Nothing to wait for when
        the slots were never read (``--no-slots``, or no plan read them first)."""
        super().let_go(before)
        if before is None:
            return
        deadline = time.monotonic() + self.LET_GO_S
        while time.monotonic() < deadline:
            now = self._busy()
            if now is None or now <= before:
                break
            time.sleep(0.1)
        self._recent = None

    def _busy(self) -> frozenset[object] | None:
        """``(slot, task)`` of every slot processing now, by ``GET /slots`` (a quick look);
        ``None`` when it cannot be read."""
        try:
            with self.http.probing(timeout=2.0):
                reply = self.http.get("/slots", allow={501})
        except EngineError:
            return None
        return _processing(reply)

    def engine_capacity(self) -> Capacity:
        props = self.http.get("/props").data
        if not isinstance(props, Mapping):
            raise EngineResponseError(
                "GET /props did not answer an object", url=self.http.url("/props"), kind=self.kind, body=props
            )
        n_ctx = int_or_none((props.get("default_generation_settings") or {}).get("n_ctx"))
        slots_n = int_or_none(props.get("total_slots"))
        kv_total = n_ctx * slots_n if n_ctx is not None and slots_n is not None else None
        kv_free = running = None
        kv_free_src = load_src = ""
        # With -np N each slot owns n_ctx = -c ÷ N tokens of KV. llama-server's default (-np
        # auto: 4 slots, kv_unified, tools/server/server.cpp) instead gives every slot the whole
        # -c over one shared cache, and no route says which: the per-slot reading is an upper
        # bound there, so it is labelled as an assumption.
        notes: list[str] = [
            "KV total assumes per-slot caches (-np N); with a unified cache "
            "(--kv-unified, the default without -np) the slots share n_ctx tokens"
        ]
        reply = self.http.get("/slots", allow={501})
        self._tasks_seen = _processing(reply)
        if reply.status == 200 and isinstance(reply.data, list):
            busy = [s for s in reply.data if isinstance(s, Mapping) and s.get("is_processing")]
            running = len(busy)
            load_src = "GET /slots is_processing"
            if n_ctx is not None:
                kv_free = n_ctx * (len(reply.data) - running)
                kv_free_src = "GET /slots n_ctx × idle slots"
        else:
            notes.append("GET /slots is disabled (--no-slots): load unknown")
        return Capacity(
            max_context_tokens=n_ctx,
            max_context_source="GET /props default_generation_settings.n_ctx (per slot)" if n_ctx is not None else "",
            kv_tokens_total=kv_total,
            kv_total_source="GET /props n_ctx × total_slots (per-slot caches assumed)" if kv_total is not None else "",
            kv_tokens_free=kv_free,
            kv_free_source=kv_free_src,
            running=running,
            load_source=load_src,
            max_concurrent=slots_n,
            max_concurrent_source="GET /props total_slots" if slots_n is not None else "",
            # A request takes one slot, however short its prompt: a fifth request on four
            # slots waits inside the server (deferred), where only the engine time-out bounds it.
            slot_tokens=n_ctx if slots_n is not None else None,
            engine_kind=self.kind,
            engine_version=props.get("build_info"),
            notes=tuple(notes),
        )

    def too_long(self, reply: Reply, messages: list[dict[str, str]], max_new_tokens: int) -> TooLong | None:
        err = reply.data.get("error") if isinstance(reply.data, Mapping) else None
        if isinstance(err, Mapping) and err.get("type") == "exceed_context_size_error":
            return TooLong(
                n_prompt_tokens=int_or_none(err.get("n_prompt_tokens")),
                n_ctx=int_or_none(err.get("n_ctx")),
                status=reply.status,
                body=reply.data,
                source="llama.cpp exceed_context_size_error",
            )
        return None


def _processing(reply: Reply) -> frozenset[object] | None:
    """``(slot, task)`` of every slot a ``GET /slots`` reply shows processing (``None`` for a
    reply without slots: ``--no-slots``)."""
    if reply.status != 200 or not isinstance(reply.data, list):
        return None
    return frozenset(
        (s.get("id"), s.get("id_task")) for s in reply.data if isinstance(s, Mapping) and s.get("is_processing")
    )
