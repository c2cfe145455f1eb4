"""The generation seam: one protocol that everything above the stages talks to.

A :class:`Backend` is whatever turns a prompt into an answer under a token cap: the local
transformers :class:`~ragbudget.generation.generate.Generator` (wrapped by
:class:`~ragbudget.generation.local.LocalBackend`) or a served engine from
:mod:`ragbudget.generation.engines` (vLLM, SGLang, TGI, llama.cpp, Ollama, any OpenAI-compatible
server, or an engine kind another package registers). The pipeline, chat, the server and the
CLI ask it, and never which kind it is:

* ``warm_up()`` / ``close()`` — load the model or probe the engine (idempotent); let go of it;
* ``render(messages)`` — the prompt after the chat template, and how many tokens it is
  (``exact`` says whether the engine counted it itself); ``prompt_builder(system_prompt)`` —
  the :class:`~ragbudget.prompt.prompt.PromptBuilder` that counts prompts as this backend does;
* ``count(texts)`` — token counts of many texts at once (chunks), batched;
  ``template_overhead(system_prompt)`` — what the template adds around an empty turn;
* ``capacity(max_new_tokens=…)`` — one :class:`Capacity` record for every backend: what it can
  hold, each figure with where it came from and when it was read. An engine reports its own
  figures; the local generator's are ragbudget's memory plan for requests of
  ``max_new_tokens`` (``Capacity.plan``), which the pipeline then budgets by;
* ``tune(admission)`` / ``refresh_speed(…)`` — what admission control should know of a request's
  cost beyond its KV tokens (the local generator's activations and measured speed; an engine
  admits its own requests and adds nothing);
* ``generate(prompt, max_new_tokens=…)`` — the answer, as the same
  :class:`~ragbudget.generation.generate.Generation` record the local generator returns;
* ``kind`` / ``url`` — what generates, in a word, and where its engine answers (``""``: in this
  process, so the server has no engine health or load to watch); ``probing()`` — a block in
  which what is asked of the engine is a quick look (the server's health look);
  ``requests_sent()`` — requests sent so far by route (``/metrics``); ``prefetch(texts, chats)``
  — counts and renders fetched ahead in one request (an engine) or nothing (in process);
  ``capacity(fresh=True)`` reads the figures now instead of reusing a recent reading.

:func:`per_request_tokens` turns an engine's :class:`Capacity` into the context allowance of one
request::

    context = min(max_context − max_new_tokens − overhead,          # the window
                  free_kv ÷ sharing − max_new_tokens − overhead)     # the KV share (advisory)

and says which limit binds, with its number and source. The KV term is advisory — engine metrics
go stale between scrapes and hybrid models misreport them — so a plan prints every figure with its
source and age (:meth:`Capacity.describe`). :mod:`ragbudget.generation.allowance` decides, from the
record, whether a request is budgeted by the memory plan or by these figures.

Served-engine errors are :class:`~ragbudget.errors.EngineError` subclasses (one-line
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
import inspect
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol, Union, runtime_checkable

from ..errors import BudgetError, ConfigError, OverloadedError

if TYPE_CHECKING:  # pragma: no cover - the records these name are imported at first use
    from contextlib import AbstractContextManager

    from ..memory.admission import AdmissionController
    from ..memory.budget import BudgetPlan
    from ..prompt.prompt import Prompt, PromptBuilder
    from .generate import Generation

__all__ = [
    "Backend",
    "Capacity",
    "CountCache",
    "LOCAL_GENERATE_OPTIONS",
    "MemoryCountCache",
    "PromptInput",
    "RenderedPrompt",
    "RequestBudget",
    "SQLiteCountCache",
    "Sampling",
    "check_generate_options",
    "per_request_tokens",
    "prompt_messages",
    "render_overhead",
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
    the ``*_source`` strings name the route and field (``"GET /props n_ctx"``); ``url`` is where
    the engine answers and ``detected`` how its kind was decided (empty for a backend in this
    process).

    ``plan`` is set where ragbudget plans the memory itself (the local generator): the
    :class:`~ragbudget.memory.budget.BudgetPlan` these figures come from, for requests of the
    ``max_new_tokens`` asked, capped for time when a time-to-first-token target applies; then
    ``device`` is where the model runs and ``speed`` the prefill and decode speed measured there
    (the time cap's source). ``None`` where the engine holds its own memory and reports it: the
    figures are then the engine's now, and a request's allowance is drawn from them
    (:func:`per_request_tokens`).
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
    url: str = ""
    detected: str = ""
    plan: BudgetPlan | None = field(default=None, repr=False)
    device: str = ""
    # A mapping: not hashed or compared (it is the record the speed probe wrote).
    speed: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def memory_planned(self) -> bool:
        """Whether ragbudget planned this backend's memory (a local generator: :attr:`plan` is its
        memory plan); ``False``: an engine that holds its own memory, whose reported figures
        these are. What a caller reads instead of asking which kind of backend it has."""
        return self.plan is not None

    def age(self, now: float | None = None) -> float:
        """Seconds since the figures were read."""
        return max(0.0, (time.time() if now is None else now) - self.measured_at)

    def to_dict(self) -> dict[str, Any]:
        """The figures as JSON-ready values; the memory plan, a record of its own, by its
        ``to_dict``."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["notes"] = list(self.notes)
        d["plan"] = None if self.plan is None else self.plan.to_dict()
        d["speed"] = None if self.speed is None else dict(self.speed)
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
        return {f.name: getattr(self, f.name) for f in fields(self)}


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
    :class:`~ragbudget.errors.BudgetError` when nothing is left for context;
    :class:`~ragbudget.errors.OverloadedError` when only the engine's load now (its free KV)
    leaves nothing, and the request fits once it drains.
    """
    if max_new_tokens < 1 or overhead_tokens < 0:
        raise ConfigError("max_new_tokens must be ≥ 1 and overhead_tokens ≥ 0")
    if capacity.max_context_tokens is None and capacity.max_prompt_tokens is None:
        raise ConfigError(
            f"the {capacity.engine_kind or 'engine'} did not say its context length; pass "
            "context_tokens (Pipeline: engine_context_tokens=, CLI: --engine-context-tokens) "
            "with the window the server was started with"
        )
    sharing = _sharing(capacity, sharing)
    prompt_cap, window_source = _prompt_cap(capacity, max_new_tokens)
    window = prompt_cap - overhead_tokens
    kv_share, kv_source = _kv_share(capacity, sharing)
    kv = None if kv_share is None else kv_share - max_new_tokens - overhead_tokens

    if kv is not None and kv < window:
        context, binding, binding_tokens, source = kv, "kv", kv_share or 0, kv_source
    else:
        context, binding, binding_tokens, source = window, "window", prompt_cap, window_source
    budget = RequestBudget(
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
    if context < 1:
        raise _no_context(capacity, budget)
    return budget


def _sharing(capacity: Capacity, sharing: int | None) -> int:
    """The requests one KV pool is divided among: ``sharing``, or the engine's load now plus this one."""
    if sharing is None:
        load = [x for x in (capacity.running, capacity.waiting) if x is not None]
        sharing = sum(load) + 1 if load else 1
    if sharing < 1:
        raise ConfigError(f"sharing must be ≥ 1; got {sharing}")
    return sharing


def _prompt_cap(capacity: Capacity, max_new_tokens: int) -> tuple[int, str]:
    """The prompt tokens the window allows (the tighter of the context window less the answer
    and the engine's own prompt cap), with its source."""
    limits = []  # (prompt tokens allowed, source)
    if capacity.max_context_tokens is not None:
        limits.append((capacity.max_context_tokens - max_new_tokens, capacity.max_context_source))
    if capacity.max_prompt_tokens is not None:
        limits.append((capacity.max_prompt_tokens, capacity.max_prompt_source))
    return min(limits, key=lambda t: t[0])


def _kv_share(capacity: Capacity, sharing: int) -> tuple[int | None, str]:
    """One request's share of the engine's KV (free KV, else total), with its source; ``None``
    when the engine does not say."""
    kv_pool, kv_source = capacity.kv_tokens_free, capacity.kv_free_source
    if kv_pool is None:
        kv_pool, kv_source = capacity.kv_tokens_total, capacity.kv_total_source
    return (None if kv_pool is None else kv_pool // sharing), kv_source


def _no_context(capacity: Capacity, b: RequestBudget) -> Exception:
    """Why ``b`` leaves no context: load (the engine's free KV now; it fits once the engine
    drains) or the request itself (the window or the KV it could ever have)."""
    new, overhead, source = b.max_new_tokens, b.overhead_tokens, b.binding_source or "unknown source"
    engine = capacity.engine_kind or "engine"
    drains = capacity.kv_tokens_total is None or capacity.kv_tokens_total - new - overhead >= 1
    if b.binding == "kv" and capacity.kv_tokens_free is not None and b.window_tokens >= 1 and drains:
        # Free KV is the engine's load now, not the request's size: the window holds it, so it
        # fits once the engine drains. Load, answered as load (a server's 429), not a 400: two
        # servers on one llama-server met this with every slot busy (bench/postgres.py --parts burst).
        return OverloadedError(
            f"no free KV on the {engine} now: {b.binding_tokens} tokens "
            f"({source}) for {b.sharing} request(s), fewer than {new} new "
            f"tokens and {overhead} of template and question; the {b.window_tokens}-token window holds "
            "this request once the engine drains"
        )
    return BudgetError(
        f"no room for context on the {engine}: the {b.binding} limit "
        f"({b.binding_tokens} tokens, {source}) minus {new} new "
        f"tokens and {overhead} tokens of template and question leaves {b.context_tokens}. "
        "Lower max_new_tokens, shorten the question, or wait for the engine to drain",
        needed=new + overhead + 1,
        available=b.binding_tokens,
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

#: What ``generate`` takes as its prompt: chat messages, a plain user string, a
#: :class:`RenderedPrompt`, or a :class:`ragbudget.prompt.prompt.Prompt` (which a backend may
#: ask for a smaller one, :class:`~ragbudget.types.Refittable`, when the engine says it is too long or memory ran out).
PromptInput = Union["Prompt", RenderedPrompt, Sequence[Message], str]


@runtime_checkable
class Backend(Protocol):
    """What the pipeline, chat, the server and the CLI need of a generator (see the module
    docstring); none of them asks which kind of backend it is.

    ``generate``: ``on_text`` receives text pieces as they stream; setting ``cancel`` stops the
    answer (``finish_reason="cancelled"``) and frees the engine's slot. ``capacity``: the figures
    for requests that reserve ``max_new_tokens`` for the answer (``None``: the backend's own
    default) — a memory plan depends on it, an engine's report does not.

    Built in: :class:`~ragbudget.generation.local.LocalBackend` and the served engines of
    :mod:`ragbudget.generation.engines`, which other packages extend through the
    ``ragbudget.engines`` entry-point group.
    """

    @property
    def model_id(self) -> str: ...

    @property
    def kind(self) -> str:
        """What generates, in a word (``"local"``, ``"vllm"``, ``"llamacpp"``, …), for messages,
        ``/health`` and logs; callers never branch on it."""

    @property
    def url(self) -> str:
        """Where the engine answers (its root URL, without credentials); ``""`` for a backend
        that generates in this process. A backend with a URL is one whose health and live load
        the server watches (:class:`~ragbudget.server.engine_load.EngineLoad`)."""

    def probing(self) -> AbstractContextManager[None]:
        """A block in which what this backend asks its engine is a quick look: an engine that is
        loading or overloaded says so at once, without the back-off a request gets (what the
        server's health look and early refusals need). A backend in this process: nothing."""

    def requests_sent(self) -> Mapping[str, int] | None:
        """Requests sent to the engine so far, by route (``/metrics``); ``None`` where there is
        no engine to send to. Never waits on a connection."""

    def prefetch(self, texts: Sequence[str], chats: Sequence[Sequence[Mapping[str, str]]] = ()) -> None:
        """Count ``texts`` and render ``chats`` ahead of the calls that will ask for them, in as
        few requests as the backend can (a served engine: one); a backend whose counts cost
        nothing to ask does nothing."""

    def warm_up(self) -> None:
        """Load the model or probe the engine, so the first request pays for neither
        (idempotent)."""

    def close(self) -> None:
        """Let go of what ``warm_up`` or the first request started (a later call starts it
        again)."""

    def render(self, messages: Sequence[Message]) -> RenderedPrompt: ...

    def count(self, texts: Sequence[str]) -> list[int]: ...

    def template_overhead(self, system_prompt: str | None = None) -> int: ...

    def prompt_builder(self, system_prompt: str | None = None) -> PromptBuilder:
        """The builder that renders and counts prompts as this backend will see them."""

    def capacity(self, *, max_new_tokens: int | None = None, fresh: bool = False) -> Capacity:
        """The figures for requests reserving ``max_new_tokens``; ``fresh``: read them now, not
        a recent reading reused (for a caller that keeps its own interval)."""

    def tune(self, admission: AdmissionController) -> bool:
        """Tell ``admission`` what this backend knows of a request's cost beyond its KV tokens
        (memory beside them, the measured speed); False while it knows nothing (yet)."""

    def refresh_speed(self, *, idle: Callable[[], bool], recheck_s: float) -> bool:
        """Measure the speed again when the one in use was taken on a busy host, at most every
        ``recheck_s`` seconds and only while ``idle()``; True when it measured."""

    def generate(
        self,
        prompt: PromptInput,
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


def render_overhead(backend: Backend, system_prompt: str | None = None) -> int:
    """Tokens the chat template and ``system_prompt`` add around an empty user turn, by one
    render (what a backend's ``template_overhead`` measures, however it keeps the result)."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return backend.render([*msgs, {"role": "user", "content": ""}]).n_tokens


def template_overhead(backend: Backend, system_prompt: str | None = None) -> int:
    """Tokens the chat template and ``system_prompt`` add around an empty user turn — the part of
    every prompt that is neither context nor question (the backend's own measure: served engines
    keep it per model)."""
    return int(backend.template_overhead(system_prompt))


#: ``ask``'s generate options a local generator takes beyond :class:`Sampling` and ``stop``.
LOCAL_GENERATE_OPTIONS = ("do_sample", "top_k", "oom_ladder", "streamer")
#: Names other APIs use for ragbudget's own arguments: a hint, not an alias.
_OTHER_NAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "n_ctx": "context_tokens"}


def split_generate_options(options: Mapping[str, Any]) -> tuple[Sampling, list[str] | None, dict[str, Any]]:
    """``ask``'s generate options as the protocol's ``Sampling`` and ``stop``, and the local
    generator's own extras (``do_sample``, ``top_k``, …), which only a backend whose ``generate``
    takes them accepts (:func:`check_generate_options`). Every option is checked here, so a
    misspelt or mistyped one is refused before retrieval runs.

    >>> split_generate_options({"max_tokens": 8})  # doctest: +ELLIPSIS
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
    if rest.get("do_sample") is not None:
        check_bool("do_sample", rest["do_sample"])
    if "oom_ladder" in rest:
        check_bool("oom_ladder", rest["oom_ladder"])
    check_int("top_k", rest.get("top_k"), 0, optional=True)
    return sampling, (list(stop) if stop else None), rest


def check_generate_options(backend: Backend, extras: Mapping[str, Any]) -> None:
    """Refuse the local generator's extras (``top_k``, ``do_sample``, …) that ``backend``'s
    ``generate`` does not take — asked of its signature, so a backend says what it takes by
    what it accepts (a served engine takes ``Sampling`` and ``stop`` only)."""
    if not extras:
        return
    params = inspect.signature(backend.generate).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    taken = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    refused = sorted(k for k in extras if k not in taken)
    if refused:
        raise ConfigError(
            f"{', '.join(refused)}: not an option of {type(backend).__name__} "
            "(it takes temperature, top_p, seed and stop)"
        )


def __getattr__(name: str) -> Any:
    # LocalBackend lived here until the seam was sealed (issue #32): the old path works for one
    # release, with a DeprecationWarning naming the new one.
    if name != "LocalBackend":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .._compat import moved_attribute

    return moved_attribute(__name__, "ragbudget.generation.local", name)
