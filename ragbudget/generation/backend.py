"""The generation seam: one protocol that everything above the stages talks to.

A :class:`Backend` is whatever turns a prompt into an answer under a token cap: the local
transformers :class:`~ragbudget.generation.generate.Generator` (wrapped by :class:`LocalBackend`) or a served
engine from :mod:`ragbudget.generation.engines` (vLLM, SGLang, TGI, llama.cpp, Ollama, any OpenAI-compatible
server). It answers four questions:

* ``render(messages)`` — the prompt after the chat template, and how many tokens it is
  (``exact`` says whether the engine counted it itself);
* ``count(texts)`` — token counts of many texts at once (chunks), batched;
* ``capacity()`` — what the engine says about its window and KV cache, each figure with where it
  came from and when it was read (:class:`Capacity`);
* ``generate(prompt, max_new_tokens=…)`` — the answer, as the same
  :class:`~ragbudget.generation.generate.Generation` record the local generator returns.

:func:`per_request_tokens` turns a :class:`Capacity` into the context allowance of one request::

    context = min(max_context − max_new_tokens − overhead,          # the window
                  free_kv ÷ sharing − max_new_tokens − overhead)     # the KV share (advisory)

and says which limit binds, with its number and source. The KV term is advisory — engine metrics
go stale between scrapes and hybrid models misreport them — so a plan prints every figure with its
source and age (:meth:`Capacity.describe`).

How the faces use it (one request)::

    backend = ragbudget.generation.engines.connect(url, kind=kind, api_key=api_key_from_env(var))
    #         or LocalBackend(Generator(model), gpu=gpu, concurrency=n, max_new_tokens=m)
    overhead = template_overhead(backend, system_prompt)  # measured once per model
    budget = per_request_tokens(backend.capacity(), max_new_tokens=m,
                                overhead_tokens=overhead + backend.count([question])[0])
    counts = backend.count([c.text for c in candidates])  # cached by (model, text digest)
    prompt = build_prompt(question, candidates, max_prompt_tokens=budget.context_tokens + …)
    answer = backend.generate(prompt, max_new_tokens=m, sampling=…, on_text=…, cancel=…)

Print ``capacity.describe()`` and ``budget.to_dict()`` in the plan: every figure with its source
and age. Served-engine errors are :class:`~ragbudget.errors.EngineError` subclasses (one-line
messages); a too-long answer that survives the backend's one retry arrives as
:class:`~ragbudget.errors.EngineContextError`, a :class:`~ragbudget.errors.BudgetError`.

>>> cap = Capacity(max_context_tokens=4096, kv_tokens_total=20000, kv_tokens_free=6000,
...                max_context_source="GET /v1/models max_model_len",
...                kv_free_source="GET /metrics vllm:kv_cache_usage_perc", engine_kind="vllm")
>>> b = per_request_tokens(cap, max_new_tokens=256, overhead_tokens=40, sharing=2)
>>> b.context_tokens, b.binding
(2704, 'kv')
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..errors import BudgetError, ConfigError

if TYPE_CHECKING:  # pragma: no cover - generate.py is imported lazily, at first use
    from .generate import Generation, Generator

log = logging.getLogger(__name__)

__all__ = [
    "Backend",
    "Capacity",
    "CountCache",
    "LOCAL_GENERATE_OPTIONS",
    "LocalBackend",
    "MemoryCountCache",
    "RenderedPrompt",
    "RequestBudget",
    "SQLiteCountCache",
    "Sampling",
    "per_request_tokens",
    "prompt_messages",
    "split_generate_options",
    "template_overhead",
    "text_digest",
]

Message = Mapping[str, str]


# -- records -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How to draw tokens. The OpenAI convention, as the local generator: greedy when
    ``temperature`` is ``None`` or 0; ``top_p`` shapes sampling; ``seed`` makes it reproducible
    where the engine supports seeds.

    >>> Sampling(temperature=0.7, seed=1)
    Sampling(temperature=0.7, top_p=None, seed=1)
    """

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        from ..settings import check_int, check_number

        check_number("temperature", self.temperature, 0.0, 2.0, optional=True)
        check_number("top_p", self.top_p, 0.0, 1.0, optional=True)
        check_int("seed", self.seed, -(2**63), optional=True)

    @property
    def greedy(self) -> bool:
        return not self.temperature or self.top_p == 0


@dataclass(frozen=True, kw_only=True)
class RenderedPrompt:
    """Chat messages after the chat template. ``n_tokens`` is the prompt's size; ``exact`` is
    ``True`` when the engine (or the local model's own tokenizer) counted the rendered text
    itself, ``False`` for an estimate (``margin`` is then the safety margin already added).
    ``text`` and ``token_ids`` are set when the engine returns them. ``source`` names the route or
    tokenizer that produced the count."""

    messages: tuple[Mapping[str, str], ...]
    n_tokens: int
    exact: bool
    source: str
    text: str | None = field(default=None, repr=False)
    token_ids: tuple[int, ...] | None = field(default=None, repr=False)
    margin: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """What an engine says it can hold, figure by figure, each with its source.

    ``max_context_tokens`` — the window of one request (prompt + answer);
    ``max_prompt_tokens`` — a separate cap on the prompt where the engine has one (TGI's
    ``max_input_tokens``, SGLang's ``max_req_input_len``);
    ``kv_tokens_total`` / ``kv_tokens_free`` — the KV cache in tokens, all and now free;
    ``running`` / ``waiting`` — requests in the engine now; ``max_concurrent`` — its request cap;
    ``slot_tokens`` — the KV tokens every request holds whatever its length, on an engine that
    gives each request a fixed slot (llama.cpp's ``-np``: one slot's ``n_ctx``), which admission
    then reserves per request. ``None`` means the engine does not say (or has no such slots).
    ``measured_at`` is ``time.time()`` of the reading;
    the ``*_source`` strings name the route and field (``"GET /props n_ctx"``).
    """

    max_context_tokens: int | None = None
    max_prompt_tokens: int | None = None
    kv_tokens_total: int | None = None
    kv_tokens_free: int | None = None
    running: int | None = None
    waiting: int | None = None
    max_concurrent: int | None = None
    slot_tokens: int | None = None
    max_context_source: str = ""
    max_prompt_source: str = ""
    kv_total_source: str = ""
    kv_free_source: str = ""
    load_source: str = ""  # running and waiting
    max_concurrent_source: str = ""
    measured_at: float = field(default_factory=time.time)
    engine_kind: str = ""
    engine_version: str | None = None
    notes: tuple[str, ...] = ()

    def age(self, now: float | None = None) -> float:
        """Seconds since the figures were read."""
        return max(0.0, (time.time() if now is None else now) - self.measured_at)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        d["age_s"] = round(self.age(), 3)
        return d

    def describe(self, now: float | None = None) -> list[str]:
        """One line per known figure: value, source and age (what a plan prints).

        >>> Capacity(max_context_tokens=512, max_context_source="GET /props n_ctx",
        ...          measured_at=0.0).describe(now=2.0)
        ['max context: 512 tokens (GET /props n_ctx, 2.0 s old)']
        """
        age = f"{self.age(now):.1f} s old"
        rows = [
            ("max context", self.max_context_tokens, "tokens", self.max_context_source),
            ("max prompt", self.max_prompt_tokens, "tokens", self.max_prompt_source),
            ("KV total", self.kv_tokens_total, "tokens", self.kv_total_source),
            ("KV free", self.kv_tokens_free, "tokens", self.kv_free_source),
            ("running", self.running, "requests", self.load_source),
            ("waiting", self.waiting, "requests", self.load_source),
            ("max concurrent", self.max_concurrent, "requests", self.max_concurrent_source),
        ]
        out = [
            f"{name}: {value} {unit} ({src or 'unknown source'}, {age})"
            for name, value, unit, src in rows
            if value is not None
        ]
        return out + [f"note: {n}" for n in self.notes]


@dataclass(frozen=True, kw_only=True)
class RequestBudget:
    """The context allowance of one request and why. ``binding`` is ``"window"`` or ``"kv"``;
    ``binding_tokens``/``binding_source`` the limit that decided it. ``kv_tokens`` is ``None``
    when the engine reports no KV figure (the window alone decides). ``advisory`` is ``True``
    when the KV term bound: it comes from metrics that may be stale."""

    context_tokens: int
    binding: str
    binding_tokens: int
    binding_source: str
    window_tokens: int
    kv_tokens: int | None
    kv_share: int | None
    sharing: int
    max_new_tokens: int
    overhead_tokens: int
    advisory: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def per_request_tokens(
    capacity: Capacity,
    *,
    max_new_tokens: int,
    overhead_tokens: int,
    sharing: int | None = None,
) -> RequestBudget:
    """Tokens one request may spend on retrieved context.

    ``window = min(max_context − max_new_tokens, max_prompt) − overhead`` and, where the engine
    reports its KV cache, ``kv = free_kv ÷ sharing − max_new_tokens − overhead`` (the whole
    request lives in its KV share, so the answer and the template come off it too). ``sharing``
    defaults to the requests in the engine now plus this one (``running + waiting + 1``), or 1.
    Free KV falls back to total KV when only the total is known.

    Raises :class:`~ragbudget.errors.ConfigError` when the window is unknown (pass
    ``context_tokens`` to :func:`ragbudget.generation.engines.connect`) and
    :class:`~ragbudget.errors.BudgetError` when nothing is left for context.
    """
    if max_new_tokens < 1 or overhead_tokens < 0:
        raise ConfigError("max_new_tokens must be ≥ 1 and overhead_tokens ≥ 0")
    if capacity.max_context_tokens is None and capacity.max_prompt_tokens is None:
        raise ConfigError(
            f"the {capacity.engine_kind or 'engine'} did not say its context length; pass "
            "context_tokens (Pipeline: engine_context_tokens=, CLI: --engine-context-tokens) "
            "with the window the server was started with"
        )
    if sharing is None:
        load = [x for x in (capacity.running, capacity.waiting) if x is not None]
        sharing = sum(load) + 1 if load else 1
    if sharing < 1:
        raise ConfigError(f"sharing must be ≥ 1; got {sharing}")

    limits = []  # (prompt tokens allowed, source)
    if capacity.max_context_tokens is not None:
        limits.append((capacity.max_context_tokens - max_new_tokens, capacity.max_context_source))
    if capacity.max_prompt_tokens is not None:
        limits.append((capacity.max_prompt_tokens, capacity.max_prompt_source))
    prompt_cap, window_source = min(limits, key=lambda t: t[0])
    window = prompt_cap - overhead_tokens

    kv_pool, kv_source = capacity.kv_tokens_free, capacity.kv_free_source
    if kv_pool is None:
        kv_pool, kv_source = capacity.kv_tokens_total, capacity.kv_total_source
    kv_share = None if kv_pool is None else kv_pool // sharing
    kv = None if kv_share is None else kv_share - max_new_tokens - overhead_tokens

    if kv is not None and kv < window:
        context, binding, binding_tokens, source = kv, "kv", kv_share or 0, kv_source
    else:
        context, binding, binding_tokens, source = window, "window", prompt_cap, window_source
    if context < 1:
        raise BudgetError(
            f"no room for context on the {capacity.engine_kind or 'engine'}: the {binding} limit "
            f"({binding_tokens} tokens, {source or 'unknown source'}) minus {max_new_tokens} new "
            f"tokens and {overhead_tokens} tokens of template and question leaves {context}. "
            "Lower max_new_tokens, shorten the question, or wait for the engine to drain",
            needed=max_new_tokens + overhead_tokens + 1,
            available=binding_tokens,
        )
    return RequestBudget(
        context_tokens=context,
        binding=binding,
        binding_tokens=binding_tokens,
        binding_source=source,
        window_tokens=window,
        kv_tokens=kv,
        kv_share=kv_share,
        sharing=sharing,
        max_new_tokens=max_new_tokens,
        overhead_tokens=overhead_tokens,
        advisory=binding == "kv",
    )


# -- token-count cache -----------------------------------------------------------------------------
def text_digest(text: str) -> str:
    """The key a :class:`CountCache` stores a text's count under (SHA-256 of its UTF-8).

    >>> text_digest("hi")[:12]
    '8f434346648f'
    """
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@runtime_checkable
class CountCache(Protocol):
    """Where token counts persist between runs, keyed by ``(model_id, text_digest(text))``.

    The index's SQLite store implements it so a re-run counts no chunk twice;
    :class:`MemoryCountCache` is the in-process one. Both methods are batched.
    """

    def get_many(self, model_id: str, digests: Sequence[str]) -> dict[str, int]: ...

    def put_many(self, model_id: str, counts: Mapping[str, int]) -> None: ...


class MemoryCountCache:
    """A thread-safe in-memory :class:`CountCache` of at most ``max_entries`` counts, the least
    recently used given up first (a server that runs for weeks does not grow for ever).

    >>> c = MemoryCountCache(max_entries=2)
    >>> c.put_many("m", {"a": 1, "b": 2}); _ = c.get_many("m", ["a"]); c.put_many("m", {"c": 3})
    >>> sorted(c.get_many("m", ["a", "b", "c"]))
    ['a', 'c']
    """

    def __init__(self, max_entries: int = 1_000_000) -> None:
        if max_entries < 1:
            raise ConfigError(f"max_entries must be >= 1; got {max_entries}")
        self.max_entries = max_entries
        self._data: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._lock = threading.Lock()

    def get_many(self, model_id: str, digests: Sequence[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        with self._lock:
            for d in digests:
                n = self._data.get((model_id, d))
                if n is not None:
                    self._data.move_to_end((model_id, d))
                    out[d] = n
        return out

    def put_many(self, model_id: str, counts: Mapping[str, int]) -> None:
        with self._lock:
            for d, n in counts.items():
                self._data[(model_id, d)] = int(n)
                self._data.move_to_end((model_id, d))
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


class SQLiteCountCache:
    """A :class:`CountCache` in a small SQLite file (WAL), by default ``<index_dir>/counts.sqlite``.

    It lives *outside* the index's atomic generations on purpose: it is a cache that can always
    be rebuilt (delete the file and the next run counts again), so it needs none of the index's
    crash safety, and a rebuilt index keeps the counts of chunks whose text did not change (the
    key is the text's digest, not a chunk id). Safe to share between threads and processes.

    >>> import tempfile, os
    >>> c = SQLiteCountCache(os.path.join(tempfile.mkdtemp(), "counts.sqlite"))
    >>> c.put_many("m", {"d1": 3}); c.get_many("m", ["d1", "d2"])
    {'d1': 3}
    """

    def __init__(self, path: str | Any) -> None:
        import sqlite3
        from pathlib import Path

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), timeout=10.0, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS counts (model TEXT NOT NULL, digest TEXT NOT "
            "NULL, n INTEGER NOT NULL, PRIMARY KEY (model, digest)) WITHOUT ROWID"
        )

    def __repr__(self) -> str:
        return f"SQLiteCountCache({str(self.path)!r})"

    def get_many(self, model_id: str, digests: Sequence[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        digests = list(dict.fromkeys(digests))
        with self._lock:
            for i in range(0, len(digests), 500):  # SQLite's bound-parameter limit
                part = digests[i : i + 500]
                rows = self._db.execute(
                    f"SELECT digest, n FROM counts WHERE model = ? AND digest IN ({','.join('?' * len(part))})",
                    [model_id, *part],
                ).fetchall()
                out.update((d, int(n)) for d, n in rows)
        return out

    def put_many(self, model_id: str, counts: Mapping[str, int]) -> None:
        if not counts:
            return
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "INSERT OR REPLACE INTO counts VALUES (?, ?, ?)", [(model_id, d, int(n)) for d, n in counts.items()]
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM counts").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


# -- the protocol ----------------------------------------------------------------------------------
@runtime_checkable
class Backend(Protocol):
    """What the pipeline, chat, server and CLI need of a generator (see the module docstring).

    ``generate``'s ``prompt`` is chat messages, a :class:`RenderedPrompt`, a plain user string,
    or a :class:`ragbudget.prompt.prompt.Prompt` (which a backend may rebuild with fewer passages when
    the engine says it is too long). ``on_text`` receives text pieces as they stream; setting
    ``cancel`` stops the answer (``finish_reason="cancelled"``) and frees the engine's slot.
    """

    @property
    def model_id(self) -> str: ...

    def render(self, messages: Sequence[Message]) -> RenderedPrompt: ...

    def count(self, texts: Sequence[str]) -> list[int]: ...

    def capacity(self) -> Capacity: ...

    def generate(
        self,
        prompt: Any,
        *,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop: Sequence[str] | None = None,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Generation: ...


def prompt_messages(prompt: Any) -> list[dict[str, str]]:
    """Chat messages of any prompt a :class:`Backend` accepts (a string is one user turn).

    >>> prompt_messages("Hi")
    [{'role': 'user', 'content': 'Hi'}]
    """
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    from ..prompt.prompt import Prompt  # lazy: prompt building is not needed to talk to a backend

    msgs = prompt.messages if isinstance(prompt, RenderedPrompt | Prompt) else prompt
    if isinstance(msgs, Sequence) and msgs and all(isinstance(m, Mapping) for m in msgs):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in msgs]
    raise ConfigError(
        "a served engine needs chat messages [{'role', 'content'}], a string, a RenderedPrompt "
        f"or a ragbudget.prompt.prompt.Prompt; got {type(prompt).__name__} (token ids cannot be sent)"
    )


def template_overhead(backend: Backend, system_prompt: str | None = None) -> int:
    """Tokens the chat template and ``system_prompt`` add around an empty user turn — the part of
    every prompt that is neither context nor question. Uses the backend's own cached
    ``template_overhead`` when it has one (served engines measure it once per model), else
    renders once.
    """
    # Asked of the backend rather than checked with isinstance(ServedBackend): the engines import
    # this module, so importing theirs here would be a cycle (tests/test_layout.py).
    own = getattr(backend, "template_overhead", None)
    if callable(own):
        return int(own(system_prompt))
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return backend.render([*msgs, {"role": "user", "content": ""}]).n_tokens


# -- the local generator as a Backend ------------------------------------------------------------
class LocalBackend:
    """The local transformers :class:`~ragbudget.generation.generate.Generator` as a :class:`Backend`.

    Counts are exact (the model's own tokenizer and chat template); ``capacity()`` is today's
    :func:`~ragbudget.memory.budget.plan_budget` for ``gpu``/``concurrency``/``max_new_tokens``
    (``plan_options`` pass through), with the plan's sources.

    ``batching`` (default on where the model supports it): concurrent ``generate`` calls share
    forward passes through one :class:`~ragbudget.generation.batching.Batcher` (transformers' continuous
    batching over a paged KV cache); ``False`` runs one ``generate`` per call. The paged cache
    holds ``batch_kv_tokens`` tokens (default: the plan's KV capacity, on a CPU at most
    ``concurrency`` windows of the model, since it is allocated up front), and ``capacity()``
    then reports that cache, block-exact. Calls that need what batching does not do (a static,
    offloaded or quantized cache, a KV dtype, the OOM ladder, a custom streamer) run unbatched.

    >>> backend = LocalBackend(Generator(), gpu="auto")            # doctest: +SKIP
    >>> backend.generate("Hi", max_new_tokens=8).finish_reason      # doctest: +SKIP
    'length'
    """

    kind = "local"

    def __init__(
        self,
        generator: Generator | None = None,
        *,
        gpu: Any = None,
        concurrency: int = 1,
        max_new_tokens: int = 256,
        cache: str = "dynamic",
        kv_dtype: str | None = None,
        batching: bool | None = None,
        batch_kv_tokens: int | None = None,
        **plan_options: Any,
    ) -> None:
        if generator is None:
            from .generate import Generator

            generator = Generator()
        if batching not in (None, True, False):
            raise ConfigError(f"batching must be True, False or None (auto); got {batching!r}")
        if batch_kv_tokens is not None and (
            isinstance(batch_kv_tokens, bool) or not isinstance(batch_kv_tokens, int) or batch_kv_tokens < 1
        ):
            raise ConfigError(f"batch_kv_tokens must be an integer >= 1; got {batch_kv_tokens!r}")
        self.generator = generator
        self.cache, self.kv_dtype = cache, kv_dtype
        self.batching, self.batch_kv_tokens = batching, batch_kv_tokens
        self._batcher: Any = None
        self._batch_lock = threading.Lock()
        self._plan_args = dict(
            gpu=gpu,
            concurrency=concurrency,
            max_new_tokens=max_new_tokens,
            cache=cache,
            kv_dtype=kv_dtype,
            **plan_options,
        )
        # One local model on one device: a gpu naming several ("2xH100") is refused by the plan.
        self._plan_args.setdefault("tensor_parallel", 1)

    def __repr__(self) -> str:
        return f"LocalBackend({self.generator!r})"

    @property
    def model_id(self) -> str:
        return self.generator.model_ref.id

    #: Tokens a message costs around its content when the tokenizer has no chat template (a base
    #: model): ChatML-style wrappers cost about 4-6, so 8 errs on the safe side.
    FALLBACK_OVERHEAD = 8

    def render(self, messages: Sequence[Message]) -> RenderedPrompt:
        """The model's own chat template, counted in its own tokenizer (exact); a tokenizer
        without a template counts each message's content plus :attr:`FALLBACK_OVERHEAD`."""
        from ..tokens import HFTokenizer

        msgs = tuple(prompt_messages(list(messages)))
        hf = self.generator.tokenizer
        hf = hf.hf if isinstance(hf, HFTokenizer) else hf
        counter = self.generator.token_counter
        if getattr(hf, "chat_template", None):  # a transformers tokenizer attribute, may be unset
            text = hf.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)
            return RenderedPrompt(
                messages=msgs,
                n_tokens=counter.count(text),
                exact=True,
                source=f"chat template of {self.model_id}",
                text=text,
            )
        n = sum(counter.count(m["content"]) + self.FALLBACK_OVERHEAD for m in msgs)
        return RenderedPrompt(
            messages=msgs,
            n_tokens=n,
            exact=False,
            source=f"{self.model_id} has no chat template: content + {self.FALLBACK_OVERHEAD} tokens per message",
        )

    def count(self, texts: Sequence[str]) -> list[int]:
        counter = self.generator.token_counter
        return [counter.count(t) for t in texts]

    def _plan(self) -> Any:
        from ..memory.budget import plan_budget

        g = self.generator
        return plan_budget(g.model if g.loaded else self.model_id, **self._plan_args)

    @property
    def batcher(self) -> Any:
        """The :class:`~ragbudget.generation.batching.Batcher` calls share (loads the model), or None when
        batching is off or the model cannot be batched (with ``batching=True``, that is a
        :class:`~ragbudget.errors.ConfigError`)."""
        if self.batching is False or self.cache != "dynamic" or self.kv_dtype is not None:
            if self.batching:
                raise ConfigError(
                    "batching uses a paged cache in the model's dtype: drop cache="
                    f"{self.cache!r}/kv_dtype={self.kv_dtype!r} or batching=True"
                )
            return None
        with self._batch_lock:
            if self._batcher is None:
                from .batching import Batcher, batching_unsupported

                reason = batching_unsupported(self.generator)
                if reason:
                    if self.batching:
                        raise ConfigError(f"cannot batch {self.model_id!r}: {reason}; pass batching=False")
                    self.batching = False
                    return None
                tokens = self.batch_kv_tokens
                if tokens is None:
                    plan = self._plan()
                    tokens = plan.kv_capacity_tokens
                    if not self.generator.device.startswith(("cuda", "xpu", "mps")):
                        # Host RAM plans are large and the paged cache is zeroed up front (it
                        # is all resident): hold `concurrency` full windows, not all of RAM.
                        tokens = min(tokens, max(1, plan.concurrency) * plan.model_max_tokens)
                    # The plan's KV bytes are the most the paged cache may take: whole pages, and
                    # the paged layout's own bytes per token (it can exceed the plan's), so the
                    # activations the plan reserved beside it still fit.
                    tokens = _paged_tokens_within(
                        self.generator, int(tokens), plan.kv_capacity_tokens * plan.kv_bytes_per_token_peak
                    )
                    if tokens < plan.max_context_tokens:
                        # Too tight to batch: the paged cache could not hold the one full-size
                        # request the plan allows, so generation runs one request at a time.
                        why = (
                            f"the paged cache that fits the plan's KV memory holds {tokens:,} "
                            f"tokens, less than one request's {plan.max_context_tokens:,}"
                        )
                        if self.batching:
                            raise ConfigError(
                                f"cannot batch {self.model_id!r}: {why}; give it more memory or pass batching=False"
                            )
                        log.info("generation not batched: %s", why)
                        self.batching = False
                        return None
                self._batcher = Batcher(self.generator, kv_tokens=max(1, int(tokens)))
            return self._batcher

    @property
    def batched(self) -> bool:
        """Whether plain ``generate`` calls go through the :attr:`batcher` (continuous batching
        over its paged cache) — what admission needs to know: running requests then share
        forward passes, and their KV lives in the paged cache allocated up front. Decided, and
        the model loaded, on first use."""
        return self.batcher is not None

    def close(self) -> None:
        """Stop the batching worker, if one runs (a later ``generate`` starts it again)."""
        if self._batcher is not None:
            self._batcher.close()

    def capacity(self) -> Capacity:
        plan = self._plan()
        src = f"plan_budget ({plan.gpu_name}: {plan.gpu_source})"
        kv, kv_src = plan.kv_capacity_tokens, src
        batcher = self.batcher if self.generator.loaded else self._batcher
        if batcher is not None:
            lay = batcher.layout
            kv = lay.capacity_tokens
            kv_src = (
                f"paged cache of continuous batching: {lay.num_blocks} blocks × "
                f"{lay.page_size} tokens, {lay.total_bytes} bytes"
            )
        return Capacity(
            max_context_tokens=plan.model_max_tokens,
            max_context_source=f"{plan.model} config",
            kv_tokens_total=kv,
            kv_total_source=kv_src,
            kv_tokens_free=kv,
            kv_free_source=f"{kv_src}: free when planned",
            max_concurrent=plan.max_concurrency,
            max_concurrent_source=src,
            engine_kind="local",
            notes=tuple(plan.notes),
        )

    def generate(
        self,
        prompt: Any,
        *,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop: Sequence[str] | None = None,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        **options: Any,
    ) -> Generation:
        """:meth:`Generator.generate <ragbudget.generation.generate.Generator.generate>` with this backend's
        cache kind and KV dtype; ``options`` are the local generator's own extras (``do_sample``,
        ``top_k``, ``oom_ladder``), which no served engine takes."""
        s = sampling or Sampling()
        if isinstance(prompt, RenderedPrompt):
            prompt = list(prompt.token_ids) if prompt.token_ids else list(prompt.messages)
        # The local generator's extras that batching also honours; any other one (the OOM
        # ladder, a custom streamer) takes the unbatched path.
        batcher = self.batcher if set(options) <= {"do_sample", "top_k"} else None
        if batcher is not None:
            return batcher.generate(  # type: ignore[no-any-return]
                prompt,
                max_new_tokens=max_new_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                seed=s.seed,
                stop=list(stop) if stop else None,
                on_text=on_text,
                cancel=cancel,
                **options,
            )
        return self.generator.generate(
            prompt,
            max_new_tokens=max_new_tokens,
            cache=self.cache,
            kv_dtype=self.kv_dtype,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            stop=list(stop) if stop else None,
            on_text=on_text,
            cancel=cancel,
            **options,
        )


def _paged_tokens_within(generator: Generator, tokens: int, budget_bytes: int, page_size: int = 32) -> int:
    """The most tokens, in whole pages of ``page_size`` (at least one page), up to ``tokens``,
    whose paged cache (:func:`~ragbudget.memory.kvcache.paged_cache_layout`, exact) takes at most
    ``budget_bytes``."""
    from ..memory.kvcache import paged_cache_layout
    from .batching import _dtype_name

    model = generator.model
    blocks = max(1, tokens // page_size)
    while blocks > 1:
        layout = paged_cache_layout(model.config, num_blocks=blocks, page_size=page_size, kv_dtype=_dtype_name(model))
        if layout.total_bytes <= budget_bytes:
            break
        blocks = max(1, min(blocks - 1, int(blocks * budget_bytes / max(1, layout.total_bytes))))
    return blocks * page_size


#: ``ask``'s generate options a local generator takes beyond :class:`Sampling` and ``stop``.
LOCAL_GENERATE_OPTIONS = ("do_sample", "top_k", "oom_ladder", "streamer")
#: Names other APIs use for ragbudget's own arguments: a hint, not an alias.
_OTHER_NAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "n_ctx": "context_tokens"}


def split_generate_options(options: Mapping[str, Any], *, served: bool) -> tuple[Any, list[str] | None, dict[str, Any]]:
    """``ask``'s generate options as the protocol's ``Sampling`` and ``stop``, and the local
    generator's own extras (``do_sample``, ``top_k``, …), which a served engine refuses. Every
    option is checked here, so a misspelt or mistyped one is refused before retrieval runs.

    >>> split_generate_options({"max_tokens": 8}, served=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ragbudget.errors.ConfigError: max_tokens is not an option of ask(); did you mean max_new_tokens? (...)
    """
    from ..settings import check_bool, check_int

    rest = dict(options)
    sampling = Sampling(
        temperature=rest.pop("temperature", None), top_p=rest.pop("top_p", None), seed=rest.pop("seed", None)
    )
    stop = rest.pop("stop", None)
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop) or len(stop) > 16
    ):
        raise ConfigError(
            f"stop must be a string or a list of at most 16 strings, got {str(options.get('stop'))[:60]!r}"
        )
    known = ("temperature", "top_p", "seed", "stop", *LOCAL_GENERATE_OPTIONS)
    unknown = sorted(k for k in rest if k not in LOCAL_GENERATE_OPTIONS)
    if unknown:
        hint = "; ".join(f"did you mean {_OTHER_NAMES[k]}?" for k in unknown if k in _OTHER_NAMES)
        raise ConfigError(
            f"{', '.join(unknown)} {'is not an option' if len(unknown) == 1 else 'are not options'} of ask()"
            + (f"; {hint}" if hint else "")
            + f" (the generate options are {', '.join(known)})"
        )
    if rest and served:
        raise ConfigError(
            f"{', '.join(sorted(rest))}: not an option of a served engine (it takes temperature, top_p, seed and stop)"
        )
    if rest.get("do_sample") is not None:
        check_bool("do_sample", rest["do_sample"])
    if "oom_ladder" in rest:
        check_bool("oom_ladder", rest["oom_ladder"])
    check_int("top_k", rest.get("top_k"), 0, optional=True)
    return sampling, (list(stop) if stop else None), rest
