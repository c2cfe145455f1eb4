"""Settings as records: frozen, keyword-only, validated once where they are built.

Each record groups the settings one part of ragbudget reads, with their defaults and their checks
in one place (vLLM's ``CacheConfig``/``SchedulerConfig`` pattern):

* :class:`RetrievalSettings` — what is fetched from the index and how it is packed;
* :class:`MemorySettings` — the memory plan (GPU, concurrency, reserved output, KV cache);
* :class:`QueueSettings` — admission control's bounded queue;
* :class:`EngineSettings` — generating on a served engine instead of a local model;
* :class:`HistorySettings` — how a conversation's history shares the prompt;
* :class:`ClientTimeoutSettings` — how long the server waits for a client's request to arrive;
* :class:`ChunkSettings` and :class:`DedupSettings` — how :meth:`ragbudget.retrieval.index.Index.build`
  cuts and deduplicates;
* :class:`QuantizedCacheSettings` — transformers' quantized KV cache, for
  :func:`ragbudget.memory.kvcache.estimate_kv`.

A bad value is refused when the record is built, with the library's own error naming the field,
what it got and what it needs (:class:`~ragbudget.errors.ArgumentTypeError` for a wrong type,
:class:`~ragbudget.errors.ConfigError` for a wrong value); whatever reads a record trusts it.
The flat keywords of :class:`~ragbudget.pipeline.Pipeline`, ``Conversation`` and the server are
sugar that builds these records (:func:`from_keywords`), so a setting is checked in one place.

>>> RetrievalSettings(fetch_k=20, fusion="rrf").fusion
'rrf'
>>> RetrievalSettings(lexical_weight=1.5)
Traceback (most recent call last):
...
ragbudget.errors.ConfigError: lexical_weight must be in [0, 1], got 1.5; use 0 (or hybrid=False) for dense-only search
>>> import dataclasses; dataclasses.replace(MemorySettings(), concurrency=4).concurrency
4
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from .errors import ArgumentTypeError, ConfigError
from .types import CACHE_KINDS, DEFAULT_PACK, DEFAULT_SPAN_FLOOR, FUSIONS, ORDERS, PACKS, dtype_bits

__all__ = [
    "DEDUP_MODES",
    "DEFAULT_HOST",
    "DEFAULT_MAX_HISTORY_CHARS",
    "DEFAULT_MAX_MESSAGES",
    "DEFAULT_PORT",
    "DEFAULT_RELEVANCE_FLOOR",
    "DEFAULT_REQUEST_TIMEOUT",
    "BUILT_IN_ENGINES",
    "ENGINE_GROUP",
    "ENGINE_KINDS",
    "QUANT_BACKENDS",
    "SUMMARY_ROLES",
    "ChunkSettings",
    "ClientTimeoutSettings",
    "DedupSettings",
    "EngineSettings",
    "HistorySettings",
    "MemorySettings",
    "QuantizedCacheSettings",
    "QueueSettings",
    "RecordField",
    "RetrievalSettings",
    "engine_kinds",
    "from_keywords",
]

#: Default ``relevance_floor``: candidates scoring under half the best one's fused score are left
#: out. Chosen on SQuAD dev tuning articles (bench/floor.py, BENCHMARKS.md "Relevance floor"):
#: answer recall at the default allowance stays at its maximum from 0.3 to 0.5 and falls from 0.6
#: on, while the context shrinks from 7,667 to 2,689 tokens.
DEFAULT_RELEVANCE_FLOOR = 0.5

#: The entry-point group through which an installed package adds an engine kind: the entry's name
#: is the kind, its value a :class:`~ragbudget.generation.engines.ServedBackend` subclass.
ENGINE_GROUP = "ragbudget.engines"
#: The built-in engines, in the form a package registers one in :data:`ENGINE_GROUP` (kind →
#: ``"module:Class"``) and loaded the same way (:func:`ragbudget.generation.engines.backend_class`):
#: one table, read by the settings' checks and by the loader alike.
BUILT_IN_ENGINES: Mapping[str, str] = MappingProxyType(
    {
        "vllm": "ragbudget.generation.engines.vllm:VLLMBackend",
        "sglang": "ragbudget.generation.engines.sglang:SGLangBackend",
        "tgi": "ragbudget.generation.engines.tgi:TGIBackend",
        "llamacpp": "ragbudget.generation.engines.llamacpp:LlamaCppBackend",
        "ollama": "ragbudget.generation.engines.ollama:OllamaBackend",
        "openai": "ragbudget.generation.engines.openai:OpenAIBackend",
    }
)
#: Served engines ragbudget knows by name (``"auto"`` probes and says which).
ENGINE_KINDS = tuple(BUILT_IN_ENGINES)


def engine_kinds() -> tuple[str, ...]:
    """Every engine kind: :data:`ENGINE_KINDS`, then those installed packages register in
    :data:`ENGINE_GROUP` (their names only: nothing is imported).

    >>> engine_kinds()[: len(ENGINE_KINDS)] == ENGINE_KINDS
    True
    """
    from importlib.metadata import entry_points

    added = sorted({ep.name for ep in entry_points(group=ENGINE_GROUP)} - set(ENGINE_KINDS))
    return (*ENGINE_KINDS, *added)


#: Duplicate removal of :meth:`ragbudget.retrieval.index.Index.build`: content hash + MinHash, hash only, none.
DEDUP_MODES = ("near", "exact", "none")

#: Backends of transformers' quantized KV cache (``cache="quantized"``).
QUANT_BACKENDS = ("quanto", "hqq", "fp8")

#: Roles a conversation's rolling summary may be sent as.
SUMMARY_ROLES = ("system", "user", "assistant")

#: Default ``max_messages`` of a history: 2,048, the longest array OpenAI's API takes in a list
#: parameter (its "array too long" error, e.g. for embeddings' ``input``); a chat of a thousand
#: exchanges is far past any window, and each message is counted before anything is folded.
DEFAULT_MAX_MESSAGES = 2048

#: Default ``max_history_chars``: about 128k tokens at ~4 characters a token, the window of the
#: largest models commonly served (Llama 3.1, Qwen 2.5); a longer history fits no such model
#: verbatim, and counting it costs seconds of tokenizer time before the answer starts.
DEFAULT_MAX_HISTORY_CHARS = 512_000

#: Seconds one chat request may take in all on the server (``serve --request-timeout``). On this
#: project's 2-core CPU the slowest answers of a 32-client burst took 93 s, a returning client's
#: wait for its place included (bench/results/load.json, p99); three times that is a request no
#: host should keep running.
DEFAULT_REQUEST_TIMEOUT = 300.0

#: Address the server binds by default (``serve --host``): loopback, since anyone who can reach the
#: port can use the GPU; another address without an API key is served with a warning.
DEFAULT_HOST = "127.0.0.1"

#: Port the server listens on by default (``serve --port``): 8000, uvicorn's and vLLM's, so a
#: client written against a vLLM server's default base URL needs no change.
DEFAULT_PORT = 8000


# -- the checks, one per kind of value ------------------------------------------------------------
# Each names the field, what was given and what is expected (a TypeError from deep inside a stage
# says none of that). Also used by the public entry points for their per-call arguments.


def shown(value: Any) -> str:
    """``repr(value)``, cut to 60 characters for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_text(name: str, value: Any, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise ArgumentTypeError(
            f"{name} must be str, got {type(value).__name__} "
            f"({len(bytes(value))} bytes): decode it first, e.g. "
            f"{name}.decode('utf-8')"
        )
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be str, got {type(value).__name__} {shown(value)}")
    return value


def check_int(name: str, value: Any, minimum: int, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        hint = " (convert it with int())" if isinstance(value, str) else ""
        raise ArgumentTypeError(
            f"{name} must be an int ≥ {minimum}"
            f"{' or None' if optional else ''}, got "
            f"{type(value).__name__} {shown(value)}{hint}"
        )
    if value < minimum:
        raise ConfigError(f"{name} must be ≥ {minimum}, got {value}")
    return int(value)


def check_number(
    name: str,
    value: Any,
    lo: float,
    hi: float | None = None,
    *,
    optional: bool = False,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number, got {type(value).__name__} {shown(value)}")
    x = float(value)
    bad = x <= lo if lo_open else x < lo
    if hi is not None:
        bad = bad or (x >= hi if hi_open else x > hi)
    if bad or x != x:  # NaN fails every comparison
        where = (
            f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
            if hi is not None
            else f"{'>' if lo_open else '≥'} {lo:g}"
        )
        raise ConfigError(f"{name} must be {where}, got {value}")
    return x


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {shown(value)}")
    return str(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be True or False, got {type(value).__name__} {shown(value)}")
    return value


def check_fusion(fusion: Any, lexical_weight: Any) -> tuple[str, float]:
    """The fusion method and the lexical weight, checked: the one rule
    :class:`RetrievalSettings` and :func:`ragbudget.retrieval.lexical.fuse_scores` share."""
    weight = check_number("lexical_weight", lexical_weight, 0.0)
    assert weight is not None
    if weight > 1.0:
        raise ConfigError(
            f"lexical_weight must be in [0, 1], got {lexical_weight}; use 0 (or hybrid=False) for dense-only search"
        )
    return check_choice("fusion", fusion, FUSIONS), weight


def check_near_dedup(threshold: Any, num_perm: Any, *, threshold_name: str = "near_threshold") -> tuple[float, int]:
    """The near-duplicate threshold (Jaccard, in (0, 1]) and the MinHash permutations (≥ 2),
    checked: the one rule :class:`DedupSettings` and :class:`ragbudget.input.dedup.NearDupIndex` share.
    ``threshold_name`` is the caller's name for the threshold (``NearDupIndex`` calls it
    ``threshold``), so the message names what was passed.

    >>> check_near_dedup(1, 64)
    (1.0, 64)
    """
    t = check_number(threshold_name, threshold, 0.0, 1.0, lo_open=True)
    n = check_int("num_perm", num_perm, 2)
    assert t is not None and n is not None
    return t, n


def check_sizes(min_tokens: int, max_tokens: int, overlap: int) -> None:
    """The chunk sizes, checked: the one rule :class:`ChunkSettings` and the chunker
    (:func:`ragbudget.input.chunking.chunk_text`) share."""
    # One character can take up to 4 byte-level tokens; below 8 a chunk might not fit one.
    if not isinstance(max_tokens, int) or max_tokens < 8:
        raise ConfigError(f"max_tokens must be an integer >= 8, got {max_tokens!r}")
    if not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_tokens:
        raise ConfigError(
            f"min_tokens must be between 0 and max_tokens ({max_tokens}), got {min_tokens!r}; "
            "lower min_tokens or raise max_tokens"
        )
    if not isinstance(overlap, int) or overlap < 0 or overlap > max_tokens // 2:
        raise ConfigError(f"overlap must be between 0 and max_tokens // 2 ({max_tokens // 2}), got {overlap!r}")


def _set(record: Any, name: str, value: Any) -> None:
    # A frozen record normalizes its own fields once, while it is being built (an int given for a
    # float field is stored as the float it means).
    object.__setattr__(record, name, value)


# -- the records ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RetrievalSettings:
    """What is fetched from the index for a question, and how it is packed into the context.

    Attributes:
        fetch_k: candidates fetched from the index before selection.
        hybrid: fuse dense (FAISS) and lexical (BM25, SQLite FTS5) candidates; ``False``
            searches dense only.
        lexical_weight: weight of the lexical ranking in the fusion, in [0, 1] (0 = dense only).
        fusion: ``"score"`` (normalized scores) or ``"rrf"`` (reciprocal rank fusion).
        order: context order — ``relevance``, ``document`` or ``lost_in_middle``.
        pack: ``"spans"`` (the question's sentences inside the best chunks, citations with exact
            offsets per sentence) or ``"chunks"`` (whole chunks).
        fill_remainder: with ``pack="chunks"``, give the room the whole chunks leave to the best
            window of the best chunk left out.
        relevance_floor: leave out candidates scoring under this fraction of the best one's score
            (0 disables; :data:`DEFAULT_RELEVANCE_FLOOR`, measured in bench/floor.py).
        span_floor: with ``pack="spans"``, leave out sentences whose evidence is under this
            fraction of the best sentence's, however much room is left (0 fills the allowance;
            :data:`~ragbudget.types.DEFAULT_SPAN_FLOOR`).
        evidence_floor: decline a question, without generating, when no sentence of the top
            chunks reaches this cosine to it (:mod:`ragbudget.evidence`). ``None``: the floor
            measured for the index's embedder (the packaged MiniLM's), none for another; 0: off.
    """

    fetch_k: int = 50
    hybrid: bool = True
    lexical_weight: float = 0.5
    fusion: str = "score"
    order: str = "relevance"
    pack: str = DEFAULT_PACK
    fill_remainder: bool = False
    relevance_floor: float = DEFAULT_RELEVANCE_FLOOR
    span_floor: float = DEFAULT_SPAN_FLOOR
    evidence_floor: float | None = None

    def __post_init__(self) -> None:
        check_int("fetch_k", self.fetch_k, 1)
        check_bool("hybrid", self.hybrid)
        fusion, weight = check_fusion(self.fusion, self.lexical_weight)
        _set(self, "lexical_weight", weight)
        check_choice("order", self.order, ORDERS)
        check_choice("pack", self.pack, PACKS)
        check_bool("fill_remainder", self.fill_remainder)
        if self.fill_remainder and self.pack != "chunks":
            # Span packing fills the room with sentences already; silently ignoring the option
            # would leave a user believing it applied.
            raise ConfigError(
                "fill_remainder applies to whole-chunk packing only; pass "
                "pack='chunks' with it (CLI: --pack chunks --fill-remainder)"
            )
        _set(self, "relevance_floor", check_number("relevance_floor", self.relevance_floor, 0.0, 1.0))
        _set(self, "span_floor", check_number("span_floor", self.span_floor, 0.0, 1.0))
        if self.evidence_floor is not None:
            _set(self, "evidence_floor", check_number("evidence_floor", self.evidence_floor, 0.0, 1.0))


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """What the memory plan (:func:`ragbudget.memory.budget.plan_budget`) is made for. Local generation
    only: a served engine reports its own memory.

    Attributes:
        gpu: ``"auto"``/``None`` (free CUDA memory, else host RAM), a GPU name, a size such as
            ``"24GiB"``, ``"NxNAME"`` for N identical GPUs (``"2xH100"``: a tensor-parallel plan,
            :func:`ragbudget.memory.budget.plan_budget` only), or a number of bytes. A bare number under
            1 GiB is refused, not read as GiB: ``gpu=24`` asks for ``"24GiB"``
            (:mod:`ragbudget.gpus`).
        concurrency: requests planned to share the KV memory.
        max_new_tokens: output tokens reserved per request.
        kv_dtype: KV cache dtype (default: the model's).
        cache: KV cache kind — ``dynamic``, ``static``, ``offloaded`` or ``quantized``.
        utilization: share of the memory the plan may use, in (0, 1] (0.9, as vLLM).
        ttft_target: seconds of prefill a request may take when no ``context_tokens`` is given:
            the context is capped to what the measured prefill speed allows in that time.
            ``None``: 2 s on a host without CUDA, no cap on a GPU; 0 disables.
    """

    gpu: str | int | None = None
    concurrency: int = 1
    max_new_tokens: int = 256
    kv_dtype: str | None = None
    cache: str = "dynamic"
    utilization: float = 0.9
    ttft_target: float | None = None

    def __post_init__(self) -> None:
        gpu = self.gpu
        if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, (str, int, float))):
            raise ArgumentTypeError(
                f"gpu must be 'auto', a GPU name, a size such as '24GiB' or a "
                f"number of bytes, got {type(gpu).__name__} {shown(gpu)}"
            )
        # The GPU's name or size now, not at the first plan (no device is probed for "auto").
        from .gpus import check_gpu

        check_gpu(gpu)
        _set(self, "concurrency", check_int("concurrency", self.concurrency, 1))
        _set(self, "max_new_tokens", check_int("max_new_tokens", self.max_new_tokens, 1))
        if check_text("kv_dtype", self.kv_dtype, optional=True) is not None:
            try:
                dtype_bits(self.kv_dtype)
            except ConfigError:
                raise ConfigError(
                    "kv_dtype must be a dtype such as fp16, bf16, fp32 or fp8 (CLI: --kv-dtype), "
                    f"got {shown(self.kv_dtype)}"
                ) from None
        check_choice("cache", self.cache, CACHE_KINDS)
        _set(self, "utilization", check_number("utilization", self.utilization, 0.0, 1.0, lo_open=True))
        _set(self, "ttft_target", check_number("ttft_target", self.ttft_target, 0.0, optional=True))


@dataclass(frozen=True, kw_only=True)
class QueueSettings:
    """Admission control's bounded queue (:class:`~ragbudget.memory.admission.AdmissionController`).

    Attributes:
        size: requests that may wait for KV memory at once (0: refuse at once when full).
        timeout: seconds a request may wait before it is refused.
    """

    size: int = 64
    timeout: float = 30.0

    def __post_init__(self) -> None:
        _set(self, "size", check_int("queue_size", self.size, 0))
        _set(self, "timeout", check_number("queue_timeout", self.timeout, 0.0))


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """Generating on a served engine (:func:`ragbudget.generation.engines.connect`) instead of a local model.

    Attributes:
        url: the engine's URL (``http://host:8000/v1``); ``None``: generate locally.
        kind: ``"auto"`` (probe and say which) or one of :func:`engine_kinds` (the built-in
            :data:`ENGINE_KINDS` and those installed packages add).
        api_key: the engine's API key (never shown in the record's repr).
        api_key_env: the environment variable holding the API key instead.
        tokenizer: for engines that cannot count (Ollama, a generic OpenAI server): a Hugging
            Face tokenizer, folder or id counted with a 2% safety margin (default: tiktoken
            with 15%).
        context_tokens: the engine's window, for a server that does not report it.
        timeout: seconds any one engine reply may take (a whole answer, when not streamed);
            ``None``: 30 s for the routes that answer at once, and for a generation what it
            should take at the engine's measured speed, three times over, at least 30 s (300 s
            before the engine's first answer; see
            :mod:`ragbudget.generation.engines._pacing`).
    """

    url: str | None = None
    kind: str = "auto"
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str | None = None
    tokenizer: Any = None
    context_tokens: int | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        check_text("engine", self.url, optional=True)
        # A built-in kind is checked without reading the installed packages' entry points.
        if self.kind != "auto" and self.kind not in ENGINE_KINDS and self.kind not in (kinds := engine_kinds()):
            raise ConfigError(f"engine_kind must be auto or one of {', '.join(kinds)}; got {shown(self.kind)}")
        check_text("api_key", self.api_key, optional=True)
        check_text("api_key_env", self.api_key_env, optional=True)
        if self.api_key is not None and self.api_key_env is not None:
            raise ConfigError("pass api_key or api_key_env, not both")
        _set(self, "context_tokens", check_int("engine_context_tokens", self.context_tokens, 2, optional=True))
        _set(self, "timeout", check_number("engine_timeout", self.timeout, 0.0, lo_open=True, optional=True))

    def __repr__(self) -> str:
        # As api_key: a password in the URL (http://user:pass@host) is never shown.
        fields: dict[str, Any] = {"url": _masked_url(self.url), "kind": self.kind, "api_key_env": self.api_key_env}
        fields.update(tokenizer=self.tokenizer, context_tokens=self.context_tokens, timeout=self.timeout)
        return f"EngineSettings({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


def _masked_url(url: str | None) -> str | None:
    """``url`` with the password of any ``user:pass@`` masked.

    >>> _masked_url("http://bob:s3cret@engine:8000/v1")
    'http://bob:***@engine:8000/v1'
    """
    if url is None or "@" not in url:
        return url
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


@dataclass(frozen=True, kw_only=True)
class HistorySettings:
    """How a conversation's history shares the prompt (:class:`~ragbudget.chat.Conversation`,
    and the server's chat requests).

    Attributes:
        history_share: share of the prompt room the history may take, in [0, 1); retrieval
            gets the rest, and whatever history leaves unused.
        summary_max_tokens: cap of the rolling summary older turns are folded into.
        recent_turns: turns kept verbatim when they fit.
        expand_follow_ups: rewrite follow-up questions for retrieval
            (:func:`~ragbudget.chat.expand_query`).
        rewrite_with_model: have the generator rewrite a follow-up into a question that stands
            alone, and search by that (one more short request a follow-up, in the same budget);
            the terms of ``expand_follow_ups`` when it writes no usable question. Needs
            ``expand_follow_ups``.
        summary_role: the role the summary is sent as (one of :data:`SUMMARY_ROLES`).
        max_messages: the most messages a history loaded from a client may hold, the question
            included (:data:`DEFAULT_MAX_MESSAGES`).
        max_history_chars: the most characters the messages before the question may hold
            together (:data:`DEFAULT_MAX_HISTORY_CHARS`).

    Every message of a history is counted through the chat template before any is folded, so
    these two bound the work one request can ask for before its answer starts.

    >>> HistorySettings(max_messages=4).check_size(messages=5, chars=10)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ragbudget.errors.ConfigError: the conversation has 5 messages, more than the limit of 4 (max_messages; ...
    """

    history_share: float = 0.3
    summary_max_tokens: int = 128
    recent_turns: int = 2
    expand_follow_ups: bool = True
    rewrite_with_model: bool = True
    summary_role: str = "system"
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_history_chars: int = DEFAULT_MAX_HISTORY_CHARS

    def __post_init__(self) -> None:
        share = check_number("history_share", self.history_share, 0.0, 1.0, hi_open=True)
        _set(self, "history_share", share)
        _set(self, "summary_max_tokens", check_int("summary_max_tokens", self.summary_max_tokens, 1))
        _set(self, "recent_turns", check_int("recent_turns", self.recent_turns, 0))
        check_bool("expand_follow_ups", self.expand_follow_ups)
        check_bool("rewrite_with_model", self.rewrite_with_model)
        check_choice("summary_role", self.summary_role, SUMMARY_ROLES)
        _set(self, "max_messages", check_int("max_messages", self.max_messages, 1))
        _set(self, "max_history_chars", check_int("max_history_chars", self.max_history_chars, 0))

    def check_size(self, *, messages: int, chars: int) -> None:
        """Refuse a history of ``messages`` messages (the question included) holding ``chars``
        characters before the question, when either is over its limit: a
        :class:`~ragbudget.errors.ConfigError` naming the limit, the value and how to change it."""
        if messages > self.max_messages:
            raise ConfigError(
                f"the conversation has {messages} messages, more than the limit of {self.max_messages} "
                "(max_messages; serve --max-messages): send fewer, e.g. with the older turns left out or summarized"
            )
        if chars > self.max_history_chars:
            raise ConfigError(
                f"the messages before the question hold {chars:,} characters, more than the limit of "
                f"{self.max_history_chars:,} (max_history_chars; serve --max-history-chars): send fewer "
                "or shorter messages, e.g. with the older turns left out or summarized"
            )


@dataclass(frozen=True, kw_only=True)
class ClientTimeoutSettings:
    """How long ``ragbudget serve`` waits for a client to send its request
    (:mod:`ragbudget.server.deadlines`); past a limit the client gets 408 and its connection is
    closed. 0 turns a limit off (for a server behind a proxy that enforces its own).

    Attributes:
        header_timeout: seconds from a connection's opening, or from the first byte of a
            kept-alive connection's next request, to the end of the request's headers (nginx's
            ``client_header_timeout``, Node's ``headersTimeout``).
        body_idle_timeout: seconds the body may pause between two of its pieces (nginx's
            ``client_body_timeout``).
        body_timeout: seconds the whole body may take, from the end of the headers.

    Without them a client announcing ``Content-Length: 1000`` that sends 5 bytes, or half a
    request line, holds its connection for as long as it likes (issue #42).

    >>> ClientTimeoutSettings(body_timeout=0).body_timeout
    0.0
    """

    # A request's headers come in one packet; 10 s is a lost packet retransmitted three times
    # (1 + 2 + 4 s at Linux's initial retransmission time-out) with room to spare.
    header_timeout: float = 10.0
    # The same reasoning for a pause inside a body.
    body_idle_timeout: float = 10.0
    # The largest body the server takes (1 MiB, create_app's max_body_bytes) in 30 s is 35 kB/s,
    # slower than any link an API client calls from.
    body_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_idle_timeout", "body_timeout"):
            _set(self, name, check_number(name, getattr(self, name), 0.0))


@dataclass(frozen=True, kw_only=True)
class ChunkSettings:
    """How :meth:`ragbudget.retrieval.index.Index.build` cuts documents (:func:`ragbudget.input.chunking.chunk_text`),
    and whether it keeps each chunk's sentences embedded.

    Attributes:
        min_tokens, max_tokens: the size of a chunk in tokens (``0 ≤ min ≤ max``, ``max ≥ 8``).
        overlap: tokens repeated between neighbouring chunks (at most ``max_tokens // 2``).
        sentence_vectors: ``True`` stores every chunk's sentence vectors, so span packing
            embeds no sentence at question time (a second pass over the text at build time,
            about 1.1× the chunk embedding, and roughly double the index on disk; BENCHMARKS.md
            "Index throughput"). ``False`` leaves them out (an existing index drops them on its
            next run): span packing embeds a sentence the first time a question needs it and
            keeps it in the cache beside the index (:mod:`ragbudget.retrieval.sentence_cache`); an index
            used only with ``pack="chunks"`` never needs them. ``None`` (the default): what the
            index has — none for a new one. Changing it re-chunks and re-embeds nothing.
    """

    min_tokens: int = 300
    max_tokens: int = 500
    overlap: int = 0
    sentence_vectors: bool | None = None

    def __post_init__(self) -> None:
        for name in ("min_tokens", "max_tokens", "overlap"):
            check_int(name, getattr(self, name), 0)
        if self.sentence_vectors is not None:
            check_bool("sentence_vectors", self.sentence_vectors)
        check_sizes(self.min_tokens, self.max_tokens, self.overlap)


@dataclass(frozen=True, kw_only=True)
class DedupSettings:
    """Duplicate chunk removal of :meth:`ragbudget.retrieval.index.Index.build`.

    Attributes:
        mode: ``"near"`` (content hash + MinHash), ``"exact"`` (content hash) or ``"none"``.
        near_threshold: Jaccard similarity at which two chunks are near duplicates, in (0, 1].
        num_perm: MinHash permutations (≥ 2).
        shingle: words per MinHash shingle (≥ 1). 1 compares the two chunks' sets of words:
            chosen with the threshold by ``bench/dedup_sweep.py`` on a tuning split (it catches
            a paragraph with 10% of its words edited where 3-word shingles caught none, with no
            false merge); an index built before this field existed used 3.
    """

    mode: str = "near"
    near_threshold: float = 0.8
    num_perm: int = 128
    shingle: int = 1

    def __post_init__(self) -> None:
        check_choice("dedup", self.mode, DEDUP_MODES)
        threshold, num_perm = check_near_dedup(self.near_threshold, self.num_perm)
        _set(self, "near_threshold", threshold)
        _set(self, "num_perm", num_perm)
        _set(self, "shingle", check_int("shingle", self.shingle, 1))


@dataclass(frozen=True, kw_only=True)
class QuantizedCacheSettings:
    """transformers' ``QuantizedCache`` (``cache="quantized"``), as
    :func:`ragbudget.memory.kvcache.estimate_kv` sizes it.

    Attributes:
        quant_backend: ``"quanto"`` (2 or 4 bits), ``"hqq"`` (1, 2, 3, 4 or 8 bits) or ``"fp8"``.
        nbits: bits per quantized value (ignored by fp8).
        q_group_size: values sharing one scale and zero point.
        residual_length: the most recent tokens kept in full precision.
        q_axis: the axis quantized along (quanto: 0 or -1; hqq: 0 or 1).
    """

    quant_backend: str = "quanto"
    nbits: int = 4
    q_group_size: int = 64
    residual_length: int = 128
    q_axis: int = 0

    #: Bit widths each integer backend quantizes to (fp8 has its own).
    BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
    #: The axes each integer backend groups along (optimum-quanto: 0 or -1; HQQ: 0 or 1).
    AXES = {"quanto": (0, -1), "hqq": (0, 1)}

    def __post_init__(self) -> None:
        check_choice("quant_backend", self.quant_backend, QUANT_BACKENDS)
        check_int("nbits", self.nbits, 1)
        allowed = self.BITS.get(self.quant_backend)
        if allowed is not None and self.nbits not in allowed:
            raise ConfigError(
                f"{self.quant_backend} quantizes the KV cache to "
                f"{', '.join(map(str, allowed))} bits, got nbits={self.nbits}; "
                f"pick one of those, or another quant_backend"
            )
        check_int("q_group_size", self.q_group_size, 1)
        check_int("residual_length", self.residual_length, 0)
        check_int("q_axis", self.q_axis, -1)
        axes = self.AXES.get(self.quant_backend)
        if axes is not None and self.q_axis not in axes:
            raise ConfigError(
                f"{self.quant_backend} groups along axis {' or '.join(map(str, axes))}, got q_axis={self.q_axis}"
            )


class RecordField:
    """A flat setting read from the record its object holds: :class:`~ragbudget.pipeline.Pipeline`'s
    ``pipe.fetch_k`` is ``pipe.retrieval.fetch_k``. Read-only, as the record is: the settings of
    a pipeline or a conversation are fixed when it is built."""

    def __init__(self, record: str, attr: str | None = None) -> None:
        self.record, self.field = record, attr or ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.field = name, self.field or name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.record), self.field)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(
            f"{self.name} is read from the {self.record} settings, fixed when "
            f"{type(obj).__name__} was built: build a new one with {self.record}="
            f"dataclasses.replace(old.{self.record}, {self.field}=...)"
        )


# -- flat keywords -> records ---------------------------------------------------------------------

R = TypeVar("R")


def from_keywords(
    cls: type[R], record: R | None, keyword: str, flat: Mapping[str, Any], rename: Mapping[str, str] | None = None
) -> R:
    """The record a public entry point uses: ``record`` when given, else one built from the flat
    keywords that were given (``None``: not given, the record's default). ``rename`` maps a flat
    keyword to its field where the names differ (``engine_kind`` → ``kind``). A record together
    with any of its flat keywords is refused: which one should win is a guess.

    >>> from_keywords(QueueSettings, None, "queue", {"queue_size": 8, "queue_timeout": None},
    ...               {"queue_size": "size", "queue_timeout": "timeout"})
    QueueSettings(size=8, timeout=30.0)
    """
    given = {name: value for name, value in flat.items() if value is not None}
    if record is None:
        names = rename or {}
        return cls(**{names.get(name, name): value for name, value in given.items()})
    if not isinstance(record, cls):
        raise ArgumentTypeError(f"{keyword} must be a {cls.__name__}, got {type(record).__name__} {shown(record)}")
    if given:
        raise ConfigError(
            f"pass {keyword}={cls.__name__}(...) or its keywords "
            f"({', '.join(sorted(given))}), not both; to change a field of a record, "
            f"use dataclasses.replace({keyword}, ...)"
        )
    return record
