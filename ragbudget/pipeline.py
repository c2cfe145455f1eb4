"""Budgeted retrieve-then-generate: the one object most users need.

:class:`Pipeline` ties the stages together — index, memory plan, selection, prompt, generation —
so that every request's prompt provably fits the KV memory it was planned for:

1. the memory plan (:func:`ragbudget.budget.plan_budget`) gives the tokens one request may hold
   (``max_context_tokens``) for this model, GPU, cache kind and concurrency;
2. ``max_new_tokens`` is reserved for the answer; the rest is the prompt allowance;
3. the chat template, system prompt, history and question are measured in the generator's own
   tokenizer; what remains is the context allowance (optionally capped by ``context_tokens``);
4. the selector packs the best retrieved chunks into that allowance exactly, and the rendered
   prompt is counted once more before it reaches ``generate``;
5. admission control reserves ``prompt + max_new_tokens`` KV tokens for the duration of the call,
   so concurrent requests never oversubscribe the capacity the plan computed.

>>> rb = Pipeline(".ragbudget")                          # doctest: +SKIP
>>> rb.index(["data/"]).chunks_total                    # doctest: +SKIP
>>> a = rb.ask("What was Maria Curie the first female recipient of?")  # doctest: +SKIP
>>> a.text, a.report["budget"]["context_tokens_used"]   # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import (
    ArgumentTypeError,
    BudgetError,
    ConfigError,
    IndexEmptyError,
    RequestCancelled,
)
from .lexical import FUSIONS
from .spans import DEFAULT_PACK, PACKS
from .types import CACHE_KINDS, DEFAULT_INDEX_DIR

if TYPE_CHECKING:
    from .admission import AdmissionController
    from .backend import Backend, Capacity, RequestBudget
    from .budget import BudgetPlan
    from .embed import Embedder
    from .generate import Generator
    from .index import Hit, Index, IndexSummary
    from .prompt import Prompt, PromptBuilder
    from .select import Selection

__all__ = ["Answer", "AnswerStream", "EnginePlan", "Pipeline", "format_report", "make_embedder"]

log = logging.getLogger(__name__)

#: Default ``relevance_floor``: candidates scoring under half the best one's fused score are left
#: out. Chosen on SQuAD dev tuning articles (bench/floor.py, BENCHMARKS.md "Relevance floor"):
#: answer recall at the default allowance stays at its maximum from 0.3 to 0.5 and falls from 0.6
#: on, while the context shrinks from 7,667 to 2,689 tokens.
DEFAULT_RELEVANCE_FLOOR = 0.5


# -- argument checks at the public entry points -------------------------------------------------
# One place for each: the library's own errors, naming the argument, what was given and what is
# expected (a TypeError traceback from deep inside a stage says none of that).


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_text(name: str, value: Any, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"{name} must be str, got {type(value).__name__} "
                                f"({len(bytes(value))} bytes): decode it first, e.g. "
                                f"{name}.decode('utf-8')")
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be str, got {type(value).__name__} {_shown(value)}")
    return value


def _check_int(name: str, value: Any, minimum: int, *, optional: bool = False) -> int | None:
    import numbers

    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        hint = " (convert it with int())" if isinstance(value, str) else ""
        raise ArgumentTypeError(f"{name} must be an int ≥ {minimum}"
                                f"{' or None' if optional else ''}, got "
                                f"{type(value).__name__} {_shown(value)}{hint}")
    if value < minimum:
        raise ConfigError(f"{name} must be ≥ {minimum}, got {value}")
    return int(value)


def _check_number(name: str, value: Any, lo: float, hi: float | None = None, *,
                  optional: bool = False, lo_open: bool = False) -> float | None:
    import numbers

    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number, got {type(value).__name__} {_shown(value)}")
    x = float(value)
    bad = x <= lo if lo_open else x < lo
    if bad or (hi is not None and x > hi) or x != x:  # NaN fails every comparison
        where = (f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi is not None
                 else f"{'>' if lo_open else '≥'} {lo:g}")
        raise ConfigError(f"{name} must be {where}, got {value}")
    return x


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {_shown(value)}")
    return str(value)


def _check_question(question: Any, name: str = "question") -> str:
    text = _check_text(name, question)
    assert text is not None
    if not text.strip():
        raise ConfigError(f"the {name} is empty")
    return text


@dataclass(frozen=True)
class Answer:
    """A generated answer with its citations and the full account of how it was budgeted.

    ``sources[i]`` is citation ``[i + 1]`` in ``text``: ``{path, start, end, page, page_end,
    score}``. ``report`` holds ``budget`` (kv_bytes_per_token, context_tokens_allowed/used,
    prompt_tokens, max_new_tokens, ``context_limit`` — what capped the context: ``{"limit":
    "time", "tokens": …, "ttft_target_s": …}`` or ``{"limit": "context_tokens", …}`` or
    ``None`` —, …), ``plan`` (the memory plan), ``selection``, ``dropped``
    (every candidate not used, with its reason), ``oom_steps`` and ``timings``.
    """

    text: str
    sources: list[dict[str, Any]]
    report: dict[str, Any]
    finish_reason: str = "stop"

    def to_dict(self) -> dict[str, Any]:
        """The ``ask --json`` document: ``answer``, ``sources``, ``budget``, ``dropped``, ``report``."""
        return {
            "answer": self.text,
            "sources": self.sources,
            "budget": self.report.get("budget", {}),
            "dropped": self.report.get("dropped", []),
            "finish_reason": self.finish_reason,
            "report": {k: v for k, v in self.report.items() if k not in ("budget", "dropped")},
        }


@dataclass(frozen=True)
class EnginePlan:
    """The allowance of one request on a served engine: the engine's ``capacity`` (every figure
    with its source and age) and what :func:`~ragbudget.backend.per_request_tokens` made of it
    (``budget``: the context tokens, and which limit binds). What :class:`Pipeline` plans with
    when it generates on an engine, where the local path has a
    :class:`~ragbudget.budget.BudgetPlan`."""

    capacity: Capacity
    budget: RequestBudget
    url: str
    kind: str
    detected: str
    model: str

    @property
    def max_new_tokens(self) -> int:
        return self.budget.max_new_tokens

    @property
    def max_prompt_tokens(self) -> int:
        """Prompt tokens one request may send (template, question, history and context)."""
        return self.budget.overhead_tokens + self.budget.context_tokens

    @property
    def max_context_tokens(self) -> int:
        """Prompt and answer of one request."""
        return self.max_prompt_tokens + self.budget.max_new_tokens

    def lines(self) -> list[str]:
        """The plan as printed by ``budget --engine`` and ``ask --explain``: every figure with
        its source and age, then the allowance and the limit that binds."""
        b = self.budget
        out = [f"engine: {self.kind} at {self.url} ({self.detected}); model {self.model}"]
        out += self.capacity.describe()
        kv = (f"KV share {b.kv_share} tokens (÷ {b.sharing} sharing) → {b.kv_tokens} for context"
              if b.kv_share is not None else "KV: not reported (the window alone decides)")
        out.append(f"window: {b.window_tokens + b.overhead_tokens} prompt tokens → "
                   f"{b.window_tokens} for context; {kv}")
        out.append(f"per request: {b.context_tokens} context tokens + {b.overhead_tokens} template "
                   f"and question + {b.max_new_tokens} answer; limited by {b.binding} "
                   f"({b.binding_tokens} tokens, {b.binding_source or 'unknown source'})"
                   + (" — advisory: engine metrics may be stale" if b.advisory else ""))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"engine": {"url": self.url, "kind": self.kind, "detected": self.detected,
                           "model": self.model},
                "capacity": self.capacity.to_dict(), "request": self.budget.to_dict(),
                "lines": self.lines()}


def make_embedder(spec: Any = None) -> Embedder | None:
    """An embedder from a CLI-style spec: ``None`` (the index's own, or the packaged MiniLM),
    ``"hash"`` / ``"hash:384"`` (the deterministic model-free test embedder), or a
    sentence-transformers model id or path, optionally with ``@backend`` (``default@onnx-int8``,
    ``all-MiniLM-L6-v2@torch``; see :data:`ragbudget.embed.BACKENDS`). Embedder objects pass
    through."""
    if spec is None or not isinstance(spec, str):
        return spec
    from .embed import HashEmbedder, SentenceTransformerEmbedder, split_backend

    if spec == "hash" or spec.startswith("hash:"):
        dim = spec.partition(":")[2]
        try:
            return HashEmbedder(int(dim) if dim else 384)
        except ValueError:
            raise ConfigError(f"embedder {spec!r}: expected hash or hash:<dim>, e.g. hash:384") from None
    model, backend = split_backend(spec)
    return SentenceTransformerEmbedder(model, backend=backend or "auto")


class Pipeline:
    """Index documents and answer questions inside a GPU memory budget.

    Everything heavy (models, the FAISS index) loads on first use, so constructing a pipeline is
    free and ``budget``-only use never loads a model. Thread-safe: concurrent :meth:`ask` calls
    are admitted only while their summed KV reservations fit the plan's capacity.

    Args:
        index_dir: folder of the index (created by :meth:`index`).
        model: generator — HF id, local folder or ``.gguf`` (default: packaged SmolLM2-135M);
            with ``engine``, which of the engine's served models (default: the first listed).
        gpu: ``"auto"``/``None`` (free CUDA memory, else host RAM), a GPU name or a size.
        embedder: embedder for indexing (default: the index's own, else packaged MiniLM).
        concurrency: requests planned to share the KV memory.
        max_new_tokens: output tokens reserved per request.
        kv_dtype, cache: KV cache dtype and kind (dynamic, static, offloaded, quantized).
        fetch_k: candidates fetched from the index before selection.
        hybrid: fuse dense (FAISS) and lexical (BM25, SQLite FTS5) candidates (default on);
            ``False`` searches dense only.
        lexical_weight: weight of the lexical ranking in the fusion (0 = dense only).
        fusion: ``"score"`` (normalized scores, default) or ``"rrf"`` (reciprocal rank fusion).
        order: context order — ``relevance``, ``document`` or ``lost_in_middle``.
        pack: ``"spans"`` (default, :data:`ragbudget.spans.DEFAULT_PACK`): the question's
            sentences inside the best chunks, scored with BM25 and the index's embedder
            (:func:`ragbudget.spans.select_spans`), citations with exact offsets per sentence; or
            ``"chunks"``: whole chunks (:func:`ragbudget.select.select_chunks`).
        fill_remainder: with ``pack="chunks"``, give the room the whole chunks leave to the best
            window of the best chunk left out (more answer recall in the context, bench/qa.py;
            off by default until answer quality is measured with it).
        utilization: share of the memory the plan may use (0.9 as vLLM).
        queue_size, queue_timeout: admission control's bounded queue.
        generator: an already built :class:`~ragbudget.generate.Generator` to share.
        relevance_floor: leave out candidates scoring under this fraction of the best one's
            score (0 disables; default 0.5, measured in bench/floor.py): the context stops where
            more passages stop helping instead of filling the whole allowance.
        ttft_target: seconds of prefill a request may take when no ``context_tokens`` is given:
            the context is capped to what the generator's measured prefill speed allows in that
            time (``limited_by: "time"`` in the report). Default ``None``: 2 s on a host without
            CUDA (measured once per model and machine, cached), no cap on a GPU; 0 disables.
        engine: the URL of a served engine (``http://host:8000/v1``) to generate on instead of
            a local model: vLLM, SGLang, TGI, llama.cpp, Ollama or any OpenAI-compatible server.
            Counting, the chat template and the capacity then come from the engine
            (:func:`ragbudget.engines.connect`); the memory options (``gpu``, ``kv_dtype``,
            ``cache``, ``utilization``, ``ttft_target``) do not apply.
        engine_kind: ``"auto"`` (probe and say which) or ``vllm``, ``sglang``, ``tgi``,
            ``llamacpp``, ``ollama``, ``openai``.
        api_key, api_key_env: the engine's API key, or the environment variable holding it.
        tokenizer: for engines that cannot count (Ollama, a generic OpenAI server): a Hugging
            Face tokenizer, folder or id counted with a 2% safety margin (default: tiktoken with
            15%).
        engine_context_tokens: the engine's window, for a server that does not report it.
        engine_timeout: seconds any one engine reply may take (a whole answer, when not
            streamed: raise it for long answers on a slow engine).
        backend: any :class:`~ragbudget.backend.Backend` (overrides ``engine`` and ``generator``).

    >>> rb = Pipeline(".ragbudget", gpu="RTX 4090", concurrency=4)   # doctest: +SKIP
    >>> rb.plan.max_context_tokens                                  # doctest: +SKIP
    """

    def __init__(
        self,
        index_dir: str | os.PathLike[str] = DEFAULT_INDEX_DIR,
        *,
        model: str | None = None,
        gpu: str | int | None = None,
        embedder: Any = None,
        concurrency: int = 1,
        max_new_tokens: int = 256,
        kv_dtype: str | None = None,
        cache: str = "dynamic",
        fetch_k: int = 50,
        hybrid: bool = True,
        lexical_weight: float = 0.5,
        fusion: str = "score",
        order: str = "relevance",
        pack: str = DEFAULT_PACK,
        fill_remainder: bool = False,
        utilization: float = 0.9,
        queue_size: int = 64,
        queue_timeout: float = 30.0,
        system_prompt: str | None = None,
        generator: Generator | None = None,
        relevance_floor: float = DEFAULT_RELEVANCE_FLOOR,
        ttft_target: float | None = None,
        engine: str | None = None,
        engine_kind: str = "auto",
        api_key: str | None = None,
        api_key_env: str | None = None,
        tokenizer: Any = None,
        engine_context_tokens: int | None = None,
        engine_timeout: float = 30.0,
        backend: Backend | None = None,
    ) -> None:
        from .select import ORDERS

        if not isinstance(index_dir, (str, os.PathLike)):
            raise ArgumentTypeError(f"index_dir must be a path (str or os.PathLike), got "
                                    f"{type(index_dir).__name__} {_shown(index_dir)}")
        _check_text("model", model, optional=True)
        if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, (str, int, float))):
            raise ArgumentTypeError(f"gpu must be 'auto', a GPU name, a size such as '24GiB' or a "
                                    f"number of bytes, got {type(gpu).__name__} {_shown(gpu)}")
        concurrency = _check_int("concurrency", concurrency, 1)  # type: ignore[assignment]
        max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)  # type: ignore[assignment]
        fetch_k = _check_int("fetch_k", fetch_k, 1)  # type: ignore[assignment]
        _check_text("kv_dtype", kv_dtype, optional=True)
        _check_choice("cache", cache, CACHE_KINDS)
        if not isinstance(hybrid, bool):
            raise ArgumentTypeError(f"hybrid must be True or False, got {type(hybrid).__name__} "
                                    f"{_shown(hybrid)}")
        _check_number("lexical_weight", lexical_weight, 0.0)
        if lexical_weight > 1.0:
            raise ConfigError(f"lexical_weight must be in [0, 1], got {lexical_weight}; "
                              "use 0 (or hybrid=False) for dense-only search")
        _check_choice("fusion", fusion, FUSIONS)
        _check_choice("order", order, ORDERS)
        _check_choice("pack", pack, PACKS)
        _check_number("utilization", utilization, 0.0, 1.0, lo_open=True)
        _check_int("queue_size", queue_size, 0)
        _check_number("queue_timeout", queue_timeout, 0.0)
        _check_text("system_prompt", system_prompt, optional=True)
        _check_number("relevance_floor", relevance_floor, 0.0, 1.0)
        _check_number("ttft_target", ttft_target, 0.0, optional=True)
        _check_text("engine", engine, optional=True)
        _check_text("api_key", api_key, optional=True)
        _check_text("api_key_env", api_key_env, optional=True)
        _check_int("engine_context_tokens", engine_context_tokens, 2, optional=True)
        _check_number("engine_timeout", engine_timeout, 0.0, lo_open=True)
        if engine is not None or backend is not None:
            from .engines import KINDS

            _check_choice("engine_kind", engine_kind, ("auto", *KINDS))
        if engine is not None and generator is not None:
            raise ConfigError("pass engine= (generate on a served engine) or generator= (a local "
                              "model), not both")
        if api_key is not None and api_key_env is not None:
            raise ConfigError("pass api_key or api_key_env, not both")
        self.index_dir = Path(index_dir)
        self.model = model
        self.gpu = gpu
        self.concurrency = concurrency
        self.max_new_tokens = max_new_tokens
        self.kv_dtype = kv_dtype
        self.cache = cache
        self.fetch_k = fetch_k
        self.hybrid = hybrid
        self.lexical_weight = lexical_weight
        self.fusion = fusion
        self.order = order
        self.pack = pack
        if not isinstance(fill_remainder, bool):
            raise ArgumentTypeError(f"fill_remainder must be True or False; got {fill_remainder!r}")
        if fill_remainder and pack != "chunks":
            # Span packing fills the room with sentences already; silently ignoring the option
            # would leave a user believing it applied.
            raise ConfigError("fill_remainder applies to whole-chunk packing only; pass "
                              "pack='chunks' with it (CLI: --pack chunks --fill-remainder)")
        self.fill_remainder = fill_remainder
        self._span_scorer: Any = None
        self.utilization = utilization
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self.system_prompt = system_prompt
        self.relevance_floor = float(relevance_floor)
        self.ttft_target = ttft_target
        self._embedder_spec = embedder
        self._embedder: Embedder | None = None
        self._generator = generator
        self.engine = engine
        self.engine_kind = engine_kind
        self._api_key, self._api_key_env = api_key, api_key_env
        self._tokenizer = tokenizer
        self.engine_context_tokens = engine_context_tokens
        self.engine_timeout = float(engine_timeout)
        self._backend: Backend | None = backend
        if backend is not None:
            from .backend import LocalBackend

            if isinstance(backend, LocalBackend):
                self._generator = backend.generator
        self._index: Index | None = None
        self._plans: dict[tuple[int, bool], BudgetPlan] = {}
        self._builder: PromptBuilder | None = None
        self._admission: AdmissionController | None = None
        self._admission_tuned = False
        self._speed_entry: dict[str, Any] | None = None
        self._speed_checked = float("-inf")
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        if self.engine is not None:
            return (f"Pipeline({str(self.index_dir)!r}, engine={self.engine!r}, "
                    f"engine_kind={self.engine_kind!r})")
        return (
            f"Pipeline({str(self.index_dir)!r}, model={self.model!r}, gpu={self.gpu!r}, "
            f"concurrency={self.concurrency})"
        )

    # -- lazily built parts ---------------------------------------------------------------------

    @property
    def embedder(self) -> Embedder | None:
        """The embedder given at construction (``None``: the index decides)."""
        if self._embedder is None and self._embedder_spec is not None:
            self._embedder = make_embedder(self._embedder_spec)
        return self._embedder

    @property
    def generator(self) -> Generator:
        """The local generator (loaded on first use; the packaged SmolLM2 by default). A
        pipeline that generates on a served engine has none: :attr:`backend` is what generates."""
        with self._lock:
            if self._generator is None:
                if self.served:
                    raise ConfigError(f"this pipeline generates on {self.backend!r}: it has no "
                                      "local generator (use pipeline.backend)")
                from .generate import Generator

                self._generator = Generator(self.model)
            return self._generator

    @property
    def served(self) -> bool:
        """Whether generation runs on a served engine (``engine=`` or a non-local ``backend=``),
        decided without connecting."""
        from .backend import LocalBackend

        if self._backend is not None:
            return not isinstance(self._backend, LocalBackend)
        return self.engine is not None

    @property
    def backend(self) -> Backend:
        """What generates: the served engine's :class:`~ragbudget.backend.Backend` (connected on
        first use; token counts cached in ``<index_dir>/counts.sqlite``), or a
        :class:`~ragbudget.backend.LocalBackend` over :attr:`generator`."""
        with self._lock:
            if self._backend is None:
                if self.engine is not None:
                    from .backend import CountCache, MemoryCountCache, SQLiteCountCache
                    from .engines import api_key_from_env, connect

                    key = self._api_key if self._api_key is not None else api_key_from_env(
                        self._api_key_env)
                    # Counts persist next to the index (outside its generations: a cache); with
                    # no index folder yet (``budget --engine``), in memory.
                    cache: CountCache = (SQLiteCountCache(self.index_dir / "counts.sqlite")
                                         if self.index_dir.is_dir() else MemoryCountCache())
                    self._backend = connect(
                        self.engine, kind=self.engine_kind, api_key=key, model=self.model,
                        tokenizer=self._tokenizer, context_tokens=self.engine_context_tokens,
                        timeout=self.engine_timeout, count_cache=cache)
                else:
                    from .backend import LocalBackend

                    self._backend = LocalBackend(
                        self.generator, gpu=self.gpu, concurrency=self.concurrency,
                        max_new_tokens=self.max_new_tokens, cache=self.cache,
                        kv_dtype=self.kv_dtype, utilization=self.utilization)
            return self._backend

    def engine_plan(self, max_new_tokens: int | None = None, *, question: str = "",
                    history: Sequence[dict[str, str]] | None = None) -> EnginePlan:
        """The served engine's allowance for one request now: its capacity (each figure with
        source and age) and the context tokens left after the template, system prompt,
        ``history``, ``question`` and ``max_new_tokens`` (default: the pipeline's)."""
        from .backend import per_request_tokens

        new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        _check_int("max_new_tokens", new_tokens, 1)
        backend = self.backend
        if not self.served:
            raise ConfigError("engine_plan() is for a pipeline on a served engine; a local one "
                              "plans from memory: use plan_for()")
        builder = self.prompt_builder.with_history(history)
        fixed = builder.fixed_tokens(question)
        capacity = backend.capacity()
        budget = per_request_tokens(capacity, max_new_tokens=new_tokens, overhead_tokens=fixed)
        return self._engine_plan(capacity, budget)

    def _engine_plan(self, capacity: Capacity, budget: RequestBudget) -> EnginePlan:
        from .engines import ServedBackend

        backend = self.backend
        if isinstance(backend, ServedBackend):
            url, detected = backend.url, backend.detection.how
        else:
            url, detected = repr(backend), "given: backend="
        return EnginePlan(capacity=capacity, budget=budget, url=url,
                          kind=capacity.engine_kind or "engine", detected=detected,
                          model=backend.model_id)

    @property
    def store(self) -> Index:
        """The opened index (raises :class:`~ragbudget.errors.IndexNotFoundError` if none)."""
        with self._lock:
            if self._index is None:
                from .index import Index

                self._index = Index.open(self.index_dir)
            return self._index

    @property
    def plan(self) -> BudgetPlan:
        """The memory plan for the configured ``max_new_tokens``."""
        return self.plan_for(self.max_new_tokens)

    def plan_for(self, max_new_tokens: int) -> BudgetPlan:
        """The memory plan reserving ``max_new_tokens`` (cached per value). Local generation
        only: a pipeline on a served engine plans from the engine's figures
        (:meth:`engine_plan`)."""
        if self.served:
            raise ConfigError("a pipeline on a served engine has no memory plan; its allowance "
                              "comes from the engine's own figures: use engine_plan()")
        with self._lock:
            # A loaded generator knows its real weights and dtype; before that the plan reads the
            # config. Plans made before loading are kept apart from the ones made after.
            live = self._generator if self._generator is not None and self._generator.loaded else None
            loaded = live is not None
            plan = self._plans.get((max_new_tokens, loaded))
            if plan is None:
                from .budget import plan_budget

                module = live.model if live is not None else None
                plan = plan_budget(
                    module if live is not None else self.model,
                    config=live.config if live is not None else None,
                    gpu=self.gpu,
                    concurrency=self.concurrency,
                    max_new_tokens=max_new_tokens,
                    kv_dtype=self.kv_dtype,
                    cache=self.cache,
                    utilization=self.utilization,
                    # The activations of the attention the loaded model really runs (eager
                    # materializes the L×L scores); sdpa before it is loaded.
                    attn_implementation=_attn_in_use(module),
                )
                plan = self._cap_for_time(plan)
                self._plans[(max_new_tokens, loaded)] = plan
            return plan

    def _ttft_target(self) -> float | None:
        """The time-to-first-token target in force: ``ttft_target`` when given (0: none), else
        ``CPU_TTFT_TARGET`` for a generator on the CPU and none on an accelerator; ``None`` too
        while the generator's device is not known without loading it."""
        from .budget import CPU_TTFT_TARGET

        device = self._device_known()
        if not device:
            return None
        if self.ttft_target is not None:
            return float(self.ttft_target) or None
        return CPU_TTFT_TARGET if device == "cpu" else None

    def _device_known(self) -> str:
        """The generator's device when known without loading a model: a loaded generator's, or
        a stand-in's (which has no model to load); ``""`` otherwise."""
        gen = self._generator
        if gen is None:
            return ""
        from .generate import Generator

        if isinstance(gen, Generator) and not gen.loaded:
            return ""
        return str(gen.device or "")

    def _speed(self, name: str) -> dict[str, Any] | None:
        """The generator's measured prefill and decode speed on its device: recorded once per
        model and machine (``cache_dir()/prefill.json``), measured now when missing (a few
        seconds; ``serve`` does it at warm-up). ``None`` when there is nothing to measure."""
        from .budget import lookup_prefill_speed, measure_prefill_speed

        device = self._device_known()
        if not device:
            return None
        gen = self._generator
        speed = lookup_prefill_speed(name, device)
        model = gen.model if gen is not None else None
        if (speed is None or "decode_s" not in speed) and model is not None:
            log.info("measuring the prefill and decode speed of %s on %s once (cached)", name, device)
            try:
                speed = measure_prefill_speed(model, name=name, device=device)
            except Exception as exc:  # noqa: BLE001 - a speed probe must never fail a question
                log.warning("prefill speed not measured (%s): no time cap on the context", exc)
        return speed

    #: Seconds between two looks at whether a provisional speed can be measured again.
    SPEED_RECHECK_S = 30.0

    def refresh_speed(self) -> bool:
        """Measure the prefill and decode speed again when the one in use was taken on a busy
        host (``provisional``) and both the host and this pipeline are idle now; then plan
        again (the time cap) and give admission the new speed. True when it measured.

        A server measures at warm-up, often while the host is busy: without this, a speed
        several times too slow would cap every context and size every Retry-After for the
        server's life. It looks at most every :attr:`SPEED_RECHECK_S` seconds, and measures
        only with nothing running or queued (a few seconds, paid by the request that finds the
        host idle), so requests never compete with the probe."""
        entry = self._speed_entry
        if not entry or not entry.get("provisional") or self.served:
            return False
        now = time.monotonic()
        if now - self._speed_checked < self.SPEED_RECHECK_S:
            return False
        self._speed_checked = now
        from .budget import lookup_prefill_speed

        with self._lock:
            ctl = self._admission
            if ctl is not None:
                s = ctl.stats()
                if s.running or s.queued:
                    return False
            plan = self.plan
            device = self._device_known()
            if not device or lookup_prefill_speed(plan.model, device) is not None:
                return False  # still busy: the lookup keeps the provisional entry
            self._speed_entry = None
            self._speed_entry = self._speed(plan.model)
            self._plans.clear()  # the time cap follows the new speed
            if ctl is not None and self._admission_tuned:
                self._tune_admission(ctl)
            log.info("measured the speed again on an idle host: %s",
                     {k: self._speed_entry.get(k) for k in ("a", "b", "decode_s", "provisional")}
                     if self._speed_entry else None)
        return True

    def _cap_for_time(self, plan: BudgetPlan) -> BudgetPlan:
        """``plan`` capped by the time-to-first-token target, when one applies and the speed is
        known (:func:`~ragbudget.budget.cap_plan_for_time`)."""
        from .budget import cap_plan_for_time

        target = self._ttft_target()
        if target is None:
            return plan
        speed = self._speed(plan.model)
        if speed is None:
            return plan
        self._speed_entry = speed
        return cap_plan_for_time(plan, speed, target)

    @property
    def admission(self) -> AdmissionController:
        """Admission control sized from the plan's KV capacity (shared by all threads). On a
        served engine: the KV tokens it reports, else its window × request slots; an engine that
        reports neither is not limited here (fail open — the engine queues and refuses itself)."""
        with self._lock:
            if self._admission is None:
                from .admission import AdmissionController

                self._admission = AdmissionController(
                    self._admission_tokens(),
                    max_queue=self.queue_size,
                    timeout=self.queue_timeout,
                )
            if not self.served and not self._admission_tuned:
                self._tune_admission(self._admission)
            return self._admission

    def _tune_admission(self, ctl: AdmissionController) -> None:
        """Once the generator is loaded: count each request's KV *and* its own activation peak
        against the memory left beside the weights, and its time by the measured prefill and
        decode speed (the start and refusal rules of :mod:`ragbudget.admission`)."""
        gen = self._generator
        if gen is None or not (gen.loaded and gen.model is not None):
            return  # a stand-in or a model not loaded yet: KV tokens only, as sized
        from .backend import LocalBackend
        from .budget import request_memory, throughput_from_speed

        plan = self.plan
        speed = self._speed_entry = self._speed_entry or self._speed(plan.model)
        backend = self.backend
        # Batched generation shares forward passes between running requests, and holds their KV
        # in its paged cache, allocated up front: tokens count against that cache, and only the
        # activations against the memory left beside the weights and the cache.
        batcher = backend.batcher if isinstance(backend, LocalBackend) and backend.batched else None
        throughput = throughput_from_speed(speed, batched=batcher is not None) if speed else None
        memory = request_memory(plan, gen.config,
                                paged=batcher.layout if batcher is not None else None)
        ctl.configure(memory=memory, throughput=throughput, ttft_target=self._ttft_target())
        self._admission_tuned = True

    def admission_estimate(self, max_new_tokens: int | None = None) -> tuple[int, int]:
        """``(tokens, prompt_tokens)`` a request is expected to reserve, known before its prompt
        is built: the plan's per-request prompt allowance (capped for time on a CPU) and the
        answer; on a served engine, its window. For a cheap look at admission (the server's early
        429) — the real prompt, usually shorter, is what :meth:`ask` reserves."""
        new = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if self.served:
            window = self.backend.capacity().max_context_tokens or new
            prompt = max(0, window - new)
        else:
            prompt = self.plan_for(new).max_prompt_tokens
        return prompt + new, prompt

    #: Admission capacity when a served engine says nothing of its KV cache or slots.
    UNLIMITED_TOKENS = 2**62

    def _admission_tokens(self) -> int:
        if not self.served:
            return self.plan.kv_capacity_tokens
        tokens, note = self._engine_admission()
        if tokens == self.UNLIMITED_TOKENS:
            log.warning("%s", note)
        return tokens

    def _engine_admission(self) -> tuple[int, str]:
        cap = self.backend.capacity()
        if cap.kv_tokens_total:
            return cap.kv_tokens_total, (f"{cap.kv_tokens_total} KV tokens "
                                         f"({cap.kv_total_source})")
        if cap.max_context_tokens and cap.max_concurrent:
            return cap.max_context_tokens * cap.max_concurrent, (
                f"{cap.max_context_tokens} tokens × {cap.max_concurrent} requests "
                f"({cap.max_context_source}; {cap.max_concurrent_source})")
        return self.UNLIMITED_TOKENS, (
            f"open: the {cap.engine_kind or 'engine'} reports no KV cache size nor request slots, "
            "so ragbudget admits every request (the engine queues and refuses them itself)")

    def admission_note(self) -> str:
        """What admission control is sized from, in one line (``serve`` logs it)."""
        if not self.served:
            ctl = self.admission
            parts = [f"{self.plan.kv_capacity_tokens} KV tokens (memory plan)"]
            if ctl.memory is not None:
                parts = [f"KV + activations per request in {ctl.memory.capacity_bytes / 2**30:.2f} "
                         f"GiB ({ctl.memory.source})"]
            if ctl.throughput is not None:
                t = ctl.throughput
                parts.append(f"time: prefill {t.prefill_a * 1e3:.2f} ms/token, decode "
                             f"{t.decode_s * 1e3:.1f} ms/token ({t.source}); first token within "
                             f"the queue time-out {self.queue_timeout:g} s, started next to "
                             "others only within the TTFT target "
                             f"{ctl.ttft_target if ctl.ttft_target is not None else 'none'}")
            return "; ".join(parts)
        return self._engine_admission()[1]

    @property
    def prompt_builder(self) -> PromptBuilder:
        with self._lock:
            if self._builder is None:
                from .prompt import EnginePromptBuilder, PromptBuilder

                if self.served:
                    self._builder = EnginePromptBuilder(self.backend,
                                                        system_prompt=self.system_prompt)
                else:
                    self._builder = PromptBuilder(self.generator.tokenizer,
                                                  system_prompt=self.system_prompt)
            return self._builder

    # -- indexing and search ----------------------------------------------------------------------

    def index(self, paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], **options: Any) -> IndexSummary:
        """Index files and folders into ``index_dir`` (incremental). ``options`` go to
        :meth:`ragbudget.index.Index.build` (``include``, ``exclude``, ``max_bytes``,
        ``min_tokens``, ``max_tokens``, ``rebuild``, ``progress``, …)."""
        from .index import Index

        with self._lock:
            if self._index is not None:
                self._index.close()
                self._index = None
            return Index(self.index_dir).build(paths, embedder=self.embedder, **options)

    def _searchable(self) -> Index:
        """The opened index, refusing one that holds no chunks: searching it would answer from
        nothing, silently (a missing index already raises ``IndexNotFoundError``)."""
        store = self.store
        counts = store.manifest.get("counts") or {}
        if int(counts.get("chunks", 1)) == 0:
            files, skipped = counts.get("files", 0), counts.get("files_skipped", 0)
            raise IndexEmptyError(
                f"the index in {self.index_dir} has no chunks ({files} file(s) indexed, "
                f"{skipped} skipped): there is nothing to search; run `ragbudget index PATH "
                f"--index-dir {self.index_dir}` on a folder with documents first")
        return store

    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The ``k`` chunks that best match ``query``, with all their sources: hybrid (dense +
        BM25, fused; ``score`` on the cosine scale) unless the pipeline has ``hybrid=False``.
        Raises :class:`~ragbudget.errors.IndexEmptyError` on an index without chunks."""
        query = _check_question(query, "query")
        k = _check_int("k", k, 1)  # type: ignore[assignment]
        return self._searchable().search(query, k=k, embedder=self.embedder, hybrid=self.hybrid,
                                 lexical_weight=self.lexical_weight, fusion=self.fusion,
                                 candidates=max(k, self.fetch_k))

    # -- budgeted retrieval -------------------------------------------------------------------------

    def _time_cap(self, plan: BudgetPlan, fixed: int) -> dict[str, Any] | None:
        """The context cap the plan's time-to-first-token target sets (see :meth:`plan_for`), or
        ``None`` when there is none: on a generator running on the CPU (default target
        ``CPU_TTFT_TARGET``) or when ``ttft_target`` was given. The prefill speed is measured
        once per model and machine."""
        if plan.time_prompt_tokens is None or plan.ttft_target_s is None:
            return None
        prompt_tokens = plan.time_prompt_tokens
        # A question is never cut, and a context too small for one passage answers from nothing:
        # the cap keeps room for at least a cut best chunk.
        cap = max(_MIN_TIME_CONTEXT, prompt_tokens - fixed)
        speed = self._speed_entry or {}
        return {"limit": "time", "tokens": cap, "ttft_target_s": plan.ttft_target_s,
                "device": self._device_known(), "prefill_tokens_in_target": prompt_tokens,
                "prefill_fit": {k: speed[k] for k in ("a", "b") if k in speed}}

    def _prompt(
        self,
        question: str,
        *,
        context_tokens: int | None,
        max_new_tokens: int,
        history: Sequence[dict[str, str]] | None,
        retrieval_query: str | None,
    ) -> tuple[Prompt, BudgetPlan | EnginePlan, dict[str, float], dict[str, Any] | None]:
        """Plan, retrieve, select and render: the prompt that fits, how long each step took, and
        the cap set on the context (by ``context_tokens`` or by time), if any."""
        from .prompt import build_prompt

        question = _check_question(question)
        context_tokens = _check_int("context_tokens", context_tokens, 0, optional=True)
        max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)  # type: ignore[assignment]
        _check_text("retrieval_query", retrieval_query, optional=True)
        if history is not None and (isinstance(history, (str, bytes)) or not all(
                isinstance(m, Mapping) for m in history)):
            raise ArgumentTypeError("history must be a list of {'role': ..., 'content': ...} "
                                    f"dicts or None, got {_shown(history)}")
        timings: dict[str, float] = {}
        # A missing, damaged or empty index fails fast, before any model loads.
        self._searchable()
        if self.served:
            return self._engine_prompt(question, context_tokens=context_tokens,
                                       max_new_tokens=max_new_tokens, history=history,
                                       retrieval_query=retrieval_query, timings=timings)
        if not (self._generator is not None and self._generator.loaded):
            # So does a request the model's window or the memory can never hold (config only).
            self.plan_for(max_new_tokens)
        t0 = time.perf_counter()
        builder = self.prompt_builder  # loads the generator first, so the plan sees its real size
        timings["load_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        plan = self.plan_for(max_new_tokens)
        timings["plan_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        builder = builder.with_history(history)
        fixed = builder.fixed_tokens(question)
        # What memory and the window allow: a time cap shortens the context, never refuses a
        # question, and an explicit context_tokens pins the context whatever the time.
        max_prompt = _memory_max_prompt(plan)
        prompt_room(plan, fixed, max_new_tokens)  # refuses a question memory cannot hold
        cap: dict[str, Any] | None = None
        if context_tokens is not None:
            cap = {"limit": "context_tokens", "tokens": context_tokens}
        else:
            cap = self._time_cap(plan, fixed)
        if cap is not None:
            max_prompt = min(max_prompt, fixed + cap["tokens"])
        hits = self.search(retrieval_query or question, k=self.fetch_k)
        timings["retrieve_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        prompt = build_prompt(
            question,
            hits,
            max_prompt_tokens=max_prompt,
            builder=builder,
            order=self.order,
            relevance_floor=self.relevance_floor,
            **self._pack_options(),
        )
        timings["select_s"] = time.perf_counter() - t0
        return prompt, plan, timings, cap

    def _engine_prompt(self, question: str, *, context_tokens: int | None, max_new_tokens: int,
                       history: Sequence[dict[str, str]] | None, retrieval_query: str | None,
                       timings: dict[str, float]) -> tuple[Prompt, EnginePlan, dict[str, float],
                                                           dict[str, Any] | None]:
        """:meth:`_prompt` on a served engine: the allowance from the engine's capacity
        (:func:`~ragbudget.backend.per_request_tokens`), counting and the template by the
        engine."""
        from .backend import per_request_tokens
        from .prompt import build_prompt

        t0 = time.perf_counter()
        backend = self.backend  # connects (and detects the engine kind) on first use
        builder = self.prompt_builder.with_history(history)
        timings["load_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        fixed = builder.fixed_tokens(question)
        capacity = backend.capacity()
        budget = per_request_tokens(capacity, max_new_tokens=max_new_tokens, overhead_tokens=fixed)
        plan = self._engine_plan(capacity, budget)
        timings["plan_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        max_prompt = plan.max_prompt_tokens
        cap: dict[str, Any] | None = None
        if context_tokens is not None:
            cap = {"limit": "context_tokens", "tokens": context_tokens}
            max_prompt = min(max_prompt, fixed + context_tokens)
        hits = self.search(retrieval_query or question, k=self.fetch_k)
        timings["retrieve_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        prompt = build_prompt(question, hits, tokenizer=None, max_prompt_tokens=max_prompt,
                              builder=builder, order=self.order,
                              relevance_floor=self.relevance_floor, **self._pack_options())
        timings["select_s"] = time.perf_counter() - t0
        return prompt, plan, timings, cap

    def _pack_options(self) -> dict[str, Any]:
        """``build_prompt``'s packing keywords: with ``pack="spans"``, one
        :class:`~ragbudget.spans.SpanScorer` per pipeline over the index's embedder, so sentence
        vectors are cached across questions, reading the sentence vectors the index stored at
        build time first (search already refused an embedder other than the index's)."""
        if self.pack == "chunks":
            return {"fill_remainder": True} if self.fill_remainder else {}
        with self._lock:
            if self._span_scorer is None:
                from .spans import SpanScorer

                store = self.store
                self._span_scorer = SpanScorer(self.embedder or store.embedder,
                                               stored=store.sentence_vectors)
        return {"pack": self.pack, "span_scorer": self._span_scorer}

    def retrieve(
        self,
        question: str,
        *,
        context_tokens: int | None = None,
        max_new_tokens: int | None = None,
        history: Sequence[dict[str, str]] | None = None,
        retrieval_query: str | None = None,
    ) -> Selection:
        """The chunks that best answer ``question`` and fit this request's context allowance.

        ``context_tokens`` caps the context below what memory allows. ``Selection.tokens_allowed``
        is the allowance in the generator's tokens, ``tokens_used`` what the chosen passages cost
        (labels included), ``dropped`` every candidate left out with its reason.
        """
        prompt, _, _, _ = self._prompt(
            question,
            context_tokens=context_tokens,
            max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            history=history,
            retrieval_query=retrieval_query,
        )
        return prompt.selection

    def ask(
        self,
        question: str,
        *,
        context_tokens: int | None = None,
        max_new_tokens: int | None = None,
        history: Sequence[dict[str, str]] | None = None,
        retrieval_query: str | None = None,
        on_text: Callable[[str], Any] | None = None,
        cancel: threading.Event | None = None,
        **generate_options: Any,
    ) -> Answer:
        """Retrieve, select within the budget, and generate an answer citing its sources.

        ``on_text`` receives the answer as it streams; setting ``cancel`` stops generation early
        (and frees the KV reservation). ``generate_options`` (``do_sample``, ``temperature``,
        ``top_p``, …) go to :meth:`ragbudget.generate.Generator.generate`.
        Raises :class:`~ragbudget.errors.BudgetError` when the question cannot fit, and
        :class:`~ragbudget.errors.OverloadedError` when admission control's queue is full.
        """
        # ``None`` means the pipeline's default; any other value is checked and honored (0 used to
        # fall back to the default silently).
        new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        _check_call(on_text, cancel)
        t_start = time.perf_counter()
        self.refresh_speed()
        prompt, plan, timings, cap = self._prompt(
            question,
            context_tokens=context_tokens,
            max_new_tokens=new_tokens,
            history=history,
            retrieval_query=retrieval_query,
        )
        reserve = prompt.n_tokens + new_tokens

        def cancelled() -> Answer:
            # Left before generation began (while queued, or just as it was admitted): nothing to
            # generate, but the answer still says what the request would have been.
            timings["total_s"] = time.perf_counter() - t_start
            nothing = _Cancelled(max_new_tokens=new_tokens)
            return _answer(nothing, prompt, plan, reserve, timings, cap)

        if cancel is not None and cancel.is_set():
            return cancelled()
        t0 = time.perf_counter()
        sampling, stop, extra = _split_options(generate_options, served=self.served)
        backend = self.backend
        try:
            reservation = self.admission.acquire(reserve, prompt_tokens=prompt.n_tokens,
                                                 cancel=cancel)
        except RequestCancelled:
            timings["queue_s"] = time.perf_counter() - t0
            return cancelled()
        with reservation:  # released however generation ends
            timings["queue_s"] = time.perf_counter() - t0
            if cancel is not None and cancel.is_set():
                return cancelled()
            t0 = time.perf_counter()
            shown = on_text
            if on_text is not None:
                def shown(piece: str) -> Any:
                    # The first token tells admission how fast the prefill really was.
                    reservation.first_token()
                    return on_text(piece)

            gen = backend.generate(prompt, max_new_tokens=new_tokens, sampling=sampling, stop=stop,
                                   on_text=shown, cancel=cancel, **extra)
            # And the whole request how fast it decoded: the time model follows the host.
            reservation.finish(gen.new_tokens)
            timings["generate_s"] = time.perf_counter() - t0
        timings["total_s"] = time.perf_counter() - t_start
        final = gen.prompt if gen.prompt is not None else prompt
        return _answer(gen, final, plan, reserve, timings, cap)

    def stream(self, question: str, **options: Any) -> AnswerStream:
        """:meth:`ask`, as an iterator over the answer's text while it is generated; the
        :class:`Answer` is the stream's ``answer`` at the end. ``options`` are :meth:`ask`'s
        (but ``on_text`` and ``cancel``, which the stream owns). Breaking out of the loop or
        closing the stream cancels the generation."""
        _check_question(question)
        return AnswerStream(self.ask, question, _stream_options(options))

    def astream(self, question: str, **options: Any) -> AnswerStream:
        """:meth:`stream` for asyncio (``async for piece in rb.astream(q)``): the model runs in a
        thread, pieces arrive through the running event loop, which is never blocked."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise ConfigError("astream() needs a running event loop (call it inside `async def`); "
                              "use stream() from synchronous code") from None
        _check_question(question)
        return AnswerStream(self.ask, question, _stream_options(options), loop=loop)

    async def aask(self, question: str, **options: Any) -> Answer:
        """:meth:`ask` without blocking the event loop; cancelling the awaiting task cancels the
        generation (and frees its KV reservation)."""
        _check_question(question)
        cancel = threading.Event()
        work = asyncio.ensure_future(
            asyncio.to_thread(self.ask, question, cancel=cancel, **_stream_options(options)))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            # The request stops at its next token (or leaves the admission queue); wait for that,
            # so its KV memory is free when the cancellation reaches the caller.
            cancel.set()
            with contextlib.suppress(BaseException):
                await work
            raise


#: Context tokens a time cap always leaves: room for (a cut window of) the best chunk.
_MIN_TIME_CONTEXT = 256


def prompt_room(plan: BudgetPlan, fixed: int, max_new_tokens: int) -> int:
    """The prompt tokens a request may hold when its question (with the system prompt, history
    and chat template) costs ``fixed``, by ``plan``: what memory and the model's window allow —
    a question past that is a :class:`~ragbudget.errors.BudgetError` naming the limit — cut to
    the plan's time cap when there is one, which never refuses a question and always leaves room
    for (a cut window of) the best passage. :meth:`Pipeline.ask` and
    :class:`~ragbudget.chat.Conversation` both decide by it.

    >>> from ragbudget.budget import cap_plan_for_time, plan_budget
    >>> plan = cap_plan_for_time(plan_budget("Qwen/Qwen3-8B", gpu="24GiB", max_new_tokens=256),
    ...                          {"a": 0.001, "b": 0.0}, 1.0)
    >>> prompt_room(plan, 100, 256), prompt_room(plan, 1500, 256)   # 1,000 in time; +256 past it
    (1000, 1756)
    """
    memory = _memory_max_prompt(plan)
    if fixed > memory:
        raise _question_too_long(plan, fixed, max_new_tokens)
    if plan.time_prompt_tokens is None or plan.ttft_target_s is None:
        return memory
    return min(memory, fixed + max(_MIN_TIME_CONTEXT, plan.time_prompt_tokens - fixed))


def _memory_max_prompt(plan: BudgetPlan) -> int:
    """The prompt tokens memory and the window allow, before any time cap."""
    total = plan.memory_max_context_tokens or plan.max_context_tokens
    return total - plan.max_new_tokens


def _attn_in_use(model: Any) -> str:
    """The attention implementation a loaded transformers model runs (``sdpa`` when unknown)."""
    cfg = getattr(model, "config", None)
    impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
    return str(impl) if isinstance(impl, str) and impl else "sdpa"


def _split_options(options: Mapping[str, Any], *, served: bool
                   ) -> tuple[Any, list[str] | None, dict[str, Any]]:
    """``ask``'s generate options as the protocol's ``Sampling`` and ``stop``, and the local
    generator's own extras (``do_sample``, ``top_k``, …), which a served engine refuses."""
    from .backend import Sampling

    rest = dict(options)
    sampling = Sampling(temperature=rest.pop("temperature", None), top_p=rest.pop("top_p", None),
                        seed=rest.pop("seed", None))
    stop = rest.pop("stop", None)
    if isinstance(stop, str):
        stop = [stop]
    if rest and served:
        raise ConfigError(f"{', '.join(sorted(rest))}: not an option of a served engine (it takes "
                          "temperature, top_p, seed and stop)")
    return sampling, (list(stop) if stop else None), rest


def _check_call(on_text: Any, cancel: Any) -> None:
    if on_text is not None and not callable(on_text):
        raise ArgumentTypeError(f"on_text must be a callable taking each piece of text, got "
                                f"{type(on_text).__name__} {_shown(on_text)}")
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise ArgumentTypeError(f"cancel must be a threading.Event (anything with is_set()), got "
                                f"{type(cancel).__name__} {_shown(cancel)}")


def _question_too_long(plan: BudgetPlan, fixed: int, max_new_tokens: int) -> BudgetError:
    """The error for a question (with system prompt, history and chat template: ``fixed``
    tokens) that leaves no room: it names the limit that binds — the model's window, whatever
    the memory, or the KV memory of this GPU at this concurrency — with its number."""
    window = plan.model_max_tokens
    what = "the question (with the system prompt, history and chat template)"
    if fixed + max_new_tokens > window:
        if fixed >= window:
            fix = "shorten the question or history"
        else:
            fix = (f"shorten the question or history, or lower max_new_tokens (--max-new-tokens) "
                   f"to at most {window - fixed:,}")
        return BudgetError(
            f"{what} is {fixed:,} tokens and {max_new_tokens:,} are reserved for the answer, but "
            f"the model window is {window:,} tokens ({plan.model}: max_position_embeddings); "
            f"{fix}",
            needed=fixed + max_new_tokens, available=window, limit="window")
    return BudgetError(
        f"{what} is {fixed:,} tokens and {max_new_tokens:,} are reserved for the answer, but the "
        f"KV memory holds {_memory_max_prompt(plan) + plan.max_new_tokens:,} tokens per request ({plan.model} on "
        f"{plan.gpu_name}, {plan.usable_bytes / 2**30:.2f} GiB usable, concurrency "
        f"{plan.concurrency}); shorten the question or history, lower max_new_tokens or "
        "concurrency, use a quantized/fp8 or offloaded KV cache, or a GPU with more memory",
        needed=fixed + max_new_tokens, available=_memory_max_prompt(plan) + plan.max_new_tokens,
        limit="memory")


def _stream_options(options: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(k for k in ("on_text", "cancel") if k in options)
    if taken:
        raise ConfigError(f"a stream delivers the text and cancels itself; drop {', '.join(taken)} "
                          "(use ask() to pass your own)")
    return options


@dataclass(frozen=True)
class _Cancelled:
    """What :func:`_answer` needs of a generation that never started."""

    max_new_tokens: int
    text: str = ""
    prompt_tokens: int = 0  # nothing reached the engine
    new_tokens: int = 0
    finish_reason: str = "cancelled"
    oom_steps: tuple[Any, ...] = ()


class AnswerStream:
    """The text of one answer as it is generated, from :meth:`Pipeline.stream` (``for piece in
    stream``) or :meth:`Pipeline.astream` (``async for piece in stream``).

    Generation runs in its own thread; ``answer`` holds the :class:`Answer` (sources, report)
    once the iteration has ended, and an error the request raised (a
    :class:`~ragbudget.errors.BudgetError`, say) is raised by the iteration. Leaving early —
    ``break``, an exception in the loop, ``close()``/``aclose()`` or the end of a
    ``with``/``async with`` block — cancels the request: it leaves the admission queue if it was
    waiting there, or stops at the next token and frees its KV reservation (as a disconnecting
    HTTP client does); ``answer`` then holds what was generated so far (``finish_reason
    "cancelled"``), and ``error`` an error the request raised after it was left.

    A ``for`` loop owns the stream: dropping its iterator (``next(iter(stream))``,
    ``itertools.islice``) cancels it too; to take pieces one at a time, call ``next(stream)``.
    After ``break`` in an ``async for``, the cancel runs in a task the event loop schedules;
    ``async with`` cancels before the block is left.

    >>> with rb.stream("How is the Project Leader elected?") as stream:  # doctest: +SKIP
    ...     for piece in stream:
    ...         print(piece, end="", flush=True)
    >>> stream.answer.sources                                          # doctest: +SKIP
    """

    def __init__(self, ask: Callable[..., Answer], question: str, options: dict[str, Any],
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        from .relay import Relay

        self._relay: Relay[Answer] = Relay(
            lambda emit, cancel: ask(question, on_text=emit, cancel=cancel, **options),
            loop=loop, name="rb-stream",
        )

    @property
    def answer(self) -> Answer | None:
        """The :class:`Answer` once the request has returned (``None`` before, or after an error)."""
        return self._relay.result

    @property
    def error(self) -> BaseException | None:
        """An error the request raised that the iteration did not (it was left before the end)."""
        return self._relay.error

    @property
    def cancelled(self) -> bool:
        """Whether the stream was left before its end (the generation was told to stop)."""
        return self._relay.cancel.is_set()

    # -- sync --

    def __iter__(self) -> Iterator[str]:
        # A generator, not ``self``: a ``for`` loop left by ``break`` or an exception drops it,
        # and its ``finally`` cancels the generation then and there.
        if self._relay.loop is not None:
            raise ConfigError("this stream came from astream(): iterate it with `async for`")
        try:
            while True:
                try:
                    yield self._relay.next_piece()
                except StopIteration:
                    return
        finally:
            self.close()

    def __next__(self) -> str:
        if self._relay.loop is not None:
            raise ConfigError("this stream came from astream(): iterate it with `async for`")
        return self._relay.next_piece()

    def close(self) -> None:
        """Stop the generation (if it still runs) and wait for its thread to end."""
        self._relay.close()

    def __enter__(self) -> AnswerStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- async --

    def __aiter__(self) -> AsyncIterator[str]:
        if self._relay.loop is None:
            raise ConfigError("this stream came from stream(): iterate it with `for`")
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[str]:
        # As __iter__, but later: an ``async for`` left early has this generator finalized by a
        # task the event loop's async-generator hooks schedule, which then cancels.
        try:
            while True:
                try:
                    yield await self.__anext__()
                except StopAsyncIteration:
                    return
        finally:
            await self.aclose()

    async def __anext__(self) -> str:
        if self._relay.loop is None:
            raise ConfigError("this stream came from stream(): iterate it with `for`")
        return await self._relay.anext_piece()

    async def aclose(self) -> None:
        """Stop the generation (if it still runs) and wait for its thread without blocking the loop."""
        await self._relay.aclose()

    async def __aenter__(self) -> AnswerStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _answer(gen: Any, prompt: Prompt, plan: BudgetPlan | EnginePlan, reserved: int,
            timings: dict[str, float], cap: dict[str, Any] | None) -> Answer:
    sel = prompt.selection
    sources = []
    for passage in prompt.passages:
        src = passage.sources[0].to_dict() if passage.sources else {}
        src["score"] = round(float(passage.score), 6)
        src["chunk_ids"] = list(passage.chunk_ids)
        src["duplicates"] = [s.to_dict() for s in passage.sources[1:]]
        if passage.spans:  # span packing: each sentence's exact place in its file
            src["spans"] = [sp.source.to_dict() if sp.source else {"chunk_id": sp.chunk_id,
                            "start": sp.start, "end": sp.end} for sp in passage.spans]
        sources.append(src)
    # The same budget keys wherever they mean the same thing; what only one kind of plan knows
    # (the local memory plan's bytes, or the engine's figures with sources and ages) besides.
    if isinstance(plan, EnginePlan):
        b = plan.budget
        memory: dict[str, Any] = {}
        counted = {"engine_prompt_tokens": gen.prompt_tokens or None}
        max_new, limited_by, oom_steps = b.max_new_tokens, b.binding, []
        plan_part = {"engine": plan.to_dict()}
    else:
        memory = {"kv_bytes_per_token": plan.kv_bytes_per_token,
                  "kv_capacity_tokens": plan.kv_capacity_tokens}
        counted = {}
        max_new, limited_by = plan.max_new_tokens, plan.limited_by
        oom_steps = [s.to_dict() for s in gen.oom_steps]
        plan_part = {"plan": plan.to_dict()}
    budget = {
        **memory,
        "max_context_tokens": plan.max_context_tokens,
        "max_prompt_tokens": plan.max_prompt_tokens,
        "context_tokens_allowed": sel.tokens_allowed,
        "context_tokens_used": sel.tokens_used,
        "context_tokens_cap": cap["tokens"] if cap else None,
        # What capped the context below the prompt allowance: "context_tokens" (asked for) or
        # "time" (the time-to-first-token target on a CPU), with its numbers; None: nothing did.
        "context_limit": cap,
        "fixed_prompt_tokens": prompt.fixed_tokens,
        "prompt_tokens": prompt.n_tokens,
        **counted,
        "max_new_tokens": max_new,
        "new_tokens": gen.new_tokens,
        "kv_tokens_reserved": reserved,
        "limited_by": limited_by,
        "fill": round(sel.fill, 4),
    }
    report = {
        "budget": budget,
        **plan_part,
        "selection": [p.to_dict() | {"text": None} for p in prompt.passages],
        "dropped": [d.to_dict() for d in sel.dropped],
        "pack": sel.pack,
        "spans_dropped": [s.to_dict() | {"text": None} for s in sel.spans_dropped],
        "oom_steps": oom_steps,
        "timings": {k: round(v, 4) for k, v in timings.items()},
    }
    return Answer(text=str(gen.text).strip(), sources=sources, report=report,
                  finish_reason=str(gen.finish_reason))


def _where(plan: dict[str, Any]) -> str:
    """``RTX 4090 (table)``, ``host RAM (no GPU)``: the name, and where it came from if that adds."""
    name, source = str(plan.get("gpu_name", "")), str(plan.get("gpu_source", ""))
    return source if source.startswith(name) else f"{name} ({source})" if source else name


def format_report(report: dict[str, Any]) -> str:
    """The ``ask --explain`` table: the plan, the budget arithmetic, and every selection decision."""
    b = report.get("budget", {})
    p = report.get("plan", {})

    def n(x: Any) -> str:
        return f"{x:,}" if isinstance(x, int) else str(x)

    gib = 1024**3
    engine = report.get("engine")
    if engine:
        lines = ["Engine", *(f"  {line}" for line in engine.get("lines", []))]
        rows = [
            ("reserved output", f"{n(b.get('max_new_tokens'))} tokens (sent as max_tokens)"),
            ("prompt allowed", f"{n(b.get('max_prompt_tokens'))} tokens"),
            ("fixed prompt", f"{n(b.get('fixed_prompt_tokens'))} tokens (template, system, question)"),
            ("context", f"{n(b.get('context_tokens_used'))} / {n(b.get('context_tokens_allowed'))} "
                        f"tokens ({100 * float(b.get('fill', 0)):.1f}% filled)"),
            ("prompt used", f"{n(b.get('prompt_tokens'))} tokens (engine counted "
                            f"{n(b.get('engine_prompt_tokens'))}); generated {n(b.get('new_tokens'))}"),
        ]
        return _report_tail(report, lines, rows)
    rows = [
        ("model", p.get("model", "")),
        ("memory", f"{_where(p)}: {p.get('gpu_bytes', 0) / gib:.2f} GiB × {p.get('utilization', 0.9)}"),
        ("weights", f"{p.get('weights_bytes', 0) / gib:.3f} GiB ({p.get('weights_source', '')})"),
        ("activations", f"{p.get('activation_bytes', 0) / gib:.3f} GiB ({p.get('activation_source', '')})"),
        ("KV bytes/token", f"{n(b.get('kv_bytes_per_token'))} ({p.get('cache', '')}, {p.get('kv_dtype', '')})"),
        ("KV capacity", f"{n(b.get('kv_capacity_tokens'))} tokens"),
        ("per request", f"{n(b.get('max_context_tokens'))} tokens (limited by {b.get('limited_by')}, "
                        f"concurrency {p.get('concurrency', 1)})"),
        ("reserved output", f"{n(b.get('max_new_tokens'))} tokens"),
        ("prompt allowed", f"{n(b.get('max_prompt_tokens'))} tokens"),
        ("fixed prompt", f"{n(b.get('fixed_prompt_tokens'))} tokens (template, system, question)"),
        ("context", f"{n(b.get('context_tokens_used'))} / {n(b.get('context_tokens_allowed'))} tokens "
                    f"({100 * float(b.get('fill', 0)):.1f}% filled)"),
        ("prompt used", f"{n(b.get('prompt_tokens'))} tokens; generated {n(b.get('new_tokens'))}"),
    ]
    limit = b.get("context_limit")
    if limit:
        why = (f"time: {limit.get('ttft_target_s', 0):g} s to the first token at the prefill speed "
               f"measured on {limit.get('device', '?')} (ttft_target; --context-tokens overrides)"
               if limit.get("limit") == "time" else "asked for (context_tokens)")
        rows.insert(-2, ("context cap", f"{n(limit.get('tokens'))} tokens, limit {why}"))
    return _report_tail(report, [], rows)


def _span_line(sp: dict[str, Any]) -> str:
    """One span of ``--explain``: where it is, what it cost, why it went in, how it starts."""
    src = sp.get("source") or {}
    where = (f"{src.get('start')}:{src.get('end')}" if src else f"{sp.get('start')}:{sp.get('end')}")
    page = f" p.{src['page']}" if src.get("page") else ""
    text = " ".join(str(sp.get("text") or "").split())
    preview = f"  {text[:60]!r}{'…' if len(text) > 60 else ''}" if text else ""
    return (f"      [{where}]{page}  {sp.get('n_tokens', 0)} tokens  {sp.get('why', '')}  "
            f"score {float(sp.get('score', 0)):.2f}{preview}")


def _report_tail(report: dict[str, Any], lines: list[str], rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [*lines, "Budget", *(f"  {k.ljust(width)}  {v}" for k, v in rows)]
    sel = report.get("selection", [])
    lines.append(f"Context: {len(sel)} passage(s)")
    for i, s in enumerate(sel, 1):
        src = (s.get("sources") or [{}])[0]
        page = f" ({src['label']})" if src.get("label") else f" p.{src.get('page')}" if src.get("page") else ""
        lines.append(f"  [{i}] {src.get('path', '?')}{page}  score {s.get('score', 0):.3f}  "
                     f"{s.get('cost', 0)} tokens{'  (truncated)' if s.get('truncated') else ''}")
        spans = s.get("spans") or []
        if spans:
            label = s.get("cost", 0) - s.get("n_tokens", 0)
            lines.append(f"      chunk {', '.join(map(str, s.get('chunk_ids', [])))}: "
                         f"{len(spans)} span(s), {s.get('n_tokens', 0)} tokens of text + "
                         f"{label} label")
            lines += [_span_line(sp) for sp in spans]
    dropped = report.get("dropped", [])
    if dropped:
        counts: dict[str, int] = {}
        for d in dropped:
            counts[d["reason"]] = counts.get(d["reason"], 0) + 1
        lines.append("Dropped: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    left = report.get("spans_dropped", [])
    if left:
        per: dict[tuple[Any, str], list[int]] = {}
        for sp in left:
            per.setdefault((sp["chunk_id"], sp["why"]), []).append(int(sp["n_tokens"]))
        lines.append(f"Spans left out: {len(left)} sentence(s), "
                     f"{sum(int(sp['n_tokens']) for sp in left):,} tokens")
        lines += [f"  chunk {cid}: {len(ns)} {why} ({sum(ns):,} tokens)"
                  for (cid, why), ns in per.items()]
    for step in report.get("oom_steps", []):
        lines.append(f"OOM step: {step}")
    t = report.get("timings", {})
    if t:
        lines.append("Timings: " + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in t.items()))
    return "\n".join(lines)
