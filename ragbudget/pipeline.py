"""Budgeted retrieve-then-generate: the one object most users need.

One job: one question from retrieval to answer, each stage called in order under the plan.

:class:`Pipeline` ties the stages together — index, memory plan, selection, prompt, generation —
so that every request's prompt provably fits the KV memory it was planned for:

1. the memory plan (:func:`ragbudget.memory.budget.plan_budget`) gives the tokens one request may hold
   (``max_context_tokens``) for this model, GPU, cache kind and concurrency;
2. ``max_new_tokens`` is reserved for the answer; the rest is the prompt allowance;
3. the chat template, system prompt, history and question are measured in the generator's own
   tokenizer; what remains is the context allowance (optionally capped by ``context_tokens``);
4. the selector packs the best retrieved chunks into that allowance exactly, and the rendered
   prompt is counted once more before it reaches ``generate``;
5. admission control reserves ``prompt + max_new_tokens`` KV tokens for the duration of the call,
   so concurrent requests never oversubscribe the capacity the plan computed.

Its settings are records (:mod:`ragbudget.settings`); what one request may hold is
:mod:`ragbudget.generation.allowance`, the measured speed and its time rules :mod:`ragbudget.generation.pacing`, and
what a question gets back :mod:`ragbudget.answer` (``Answer``, ``AnswerStream`` and
``EnginePlan`` are importable from here too).

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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .answer import Answer, AnswerStream, build_answer, cancelled_answer
from .errors import (
    ArgumentTypeError,
    ConfigError,
    IndexEmptyError,
    RequestCancelled,
)
from .generation.allowance import (
    UNLIMITED_TOKENS,
    EnginePlan,
    engine_admission,
    memory_max_prompt,
    model_name,
    prompt_room,
    time_cap,
)
from .generation.pacing import Pacing
from .retrieval.embed import make_embedder
from .settings import (
    DEFAULT_RELEVANCE_FLOOR,
    EngineSettings,
    MemorySettings,
    QueueSettings,
    RecordField,
    RetrievalSettings,
    check_int,
    check_text,
    from_keywords,
    shown,
)
from .types import DEFAULT_INDEX_DIR

if TYPE_CHECKING:
    from .generation.backend import Backend, Capacity, RequestBudget
    from .generation.generate import Generator
    from .memory.admission import AdmissionController
    from .memory.budget import BudgetPlan
    from .prompt.prompt import Prompt, PromptBuilder
    from .prompt.select import Selection
    from .retrieval.embed import Embedder
    from .retrieval.index import Hit, Index, IndexSummary

__all__ = [
    "DEFAULT_RELEVANCE_FLOOR",
    "Answer",
    "AnswerStream",
    "EnginePlan",
    "Pipeline",
    "make_embedder",
    "prompt_room",
]

log = logging.getLogger(__name__)


def _check_question(question: Any, name: str = "question") -> str:
    text = check_text(name, question)
    assert text is not None
    if not text.strip():
        raise ConfigError(f"the {name} is empty")
    return text


class Pipeline:
    """Index documents and answer questions inside a GPU memory budget.

    Everything heavy (models, the FAISS index) loads on first use, so constructing a pipeline is
    free and ``budget``-only use never loads a model. Thread-safe: concurrent :meth:`ask` calls
    are admitted only while their summed KV reservations fit the plan's capacity.

    Args:
        index_dir: folder of the index (created by :meth:`index`).
        model: generator — HF id, local folder or ``.gguf`` (default: packaged SmolLM2-135M);
            with ``engine``, which of the engine's served models (default: the first listed).
        embedder: embedder for indexing (default: the index's own, else packaged MiniLM).
        system_prompt: the chat's system prompt (default:
            :data:`ragbudget.prompt.prompt.DEFAULT_SYSTEM_PROMPT`).
        generator: an already built :class:`~ragbudget.generation.generate.Generator` to share.
        backend: any :class:`~ragbudget.generation.backend.Backend` (overrides ``engine`` and ``generator``).
        retrieval: a :class:`~ragbudget.settings.RetrievalSettings` — ``fetch_k``, ``hybrid``,
            ``lexical_weight``, ``fusion``, ``order``, ``pack``, ``fill_remainder``,
            ``relevance_floor``.
        memory: a :class:`~ragbudget.settings.MemorySettings` — ``gpu``, ``concurrency``,
            ``max_new_tokens``, ``kv_dtype``, ``cache``, ``utilization``, ``ttft_target``.
            They do not apply on a served engine, which reports its own memory.
        queue: a :class:`~ragbudget.settings.QueueSettings` — admission control's bounded queue
            (flat: ``queue_size``, ``queue_timeout``).
        engine: the URL of a served engine (``http://host:8000/v1``) to generate on instead of
            a local model — vLLM, SGLang, TGI, llama.cpp, Ollama or any OpenAI-compatible
            server; counting, the chat template and the capacity then come from the engine
            (:func:`ragbudget.generation.engines.connect`) — or a whole
            :class:`~ragbudget.settings.EngineSettings` (flat: ``engine_kind``, ``api_key``,
            ``api_key_env``, ``tokenizer``, ``engine_context_tokens``, ``engine_timeout``).

    Every field of these records may be given as a flat keyword of the same name instead
    (``Pipeline(d, fetch_k=20, concurrency=4)``); they only build the records, and a record with
    any of its flat keywords is a :class:`~ragbudget.errors.ConfigError`. The pipeline reads
    its settings from the records (``pipe.retrieval.fetch_k``; ``pipe.fetch_k`` reads the same).

    >>> rb = Pipeline(".ragbudget", gpu="RTX 4090", concurrency=4)   # doctest: +SKIP
    >>> rb.plan.max_context_tokens                                  # doctest: +SKIP
    >>> Pipeline(".ragbudget", memory=MemorySettings(gpu="RTX 4090", concurrency=4)).memory.concurrency
    4
    """

    def __init__(
        self,
        index_dir: str | os.PathLike[str] = DEFAULT_INDEX_DIR,
        *,
        model: str | None = None,
        embedder: Any = None,
        system_prompt: str | None = None,
        generator: Generator | None = None,
        backend: Backend | None = None,
        retrieval: RetrievalSettings | None = None,
        memory: MemorySettings | None = None,
        queue: QueueSettings | None = None,
        engine: str | EngineSettings | None = None,
        # The flat keywords below are sugar: each is the field of the same name of one record
        # (engine_kind -> EngineSettings.kind, queue_size -> QueueSettings.size, ...); None is
        # "not given", the record's default. They only build the records.
        gpu: str | int | None = None,
        concurrency: int | None = None,
        max_new_tokens: int | None = None,
        kv_dtype: str | None = None,
        cache: str | None = None,
        utilization: float | None = None,
        ttft_target: float | None = None,
        fetch_k: int | None = None,
        hybrid: bool | None = None,
        lexical_weight: float | None = None,
        fusion: str | None = None,
        order: str | None = None,
        pack: str | None = None,
        fill_remainder: bool | None = None,
        relevance_floor: float | None = None,
        queue_size: int | None = None,
        queue_timeout: float | None = None,
        engine_kind: str | None = None,
        api_key: str | None = None,
        api_key_env: str | None = None,
        tokenizer: Any = None,
        engine_context_tokens: int | None = None,
        engine_timeout: float | None = None,
    ) -> None:
        if not isinstance(index_dir, (str, os.PathLike)):
            raise ArgumentTypeError(
                f"index_dir must be a path (str or os.PathLike), got {type(index_dir).__name__} {shown(index_dir)}"
            )
        check_text("model", model, optional=True)
        check_text("system_prompt", system_prompt, optional=True)
        _check_parts(embedder, generator, backend)
        self.retrieval = from_keywords(
            RetrievalSettings,
            retrieval,
            "retrieval",
            {
                "fetch_k": fetch_k,
                "hybrid": hybrid,
                "lexical_weight": lexical_weight,
                "fusion": fusion,
                "order": order,
                "pack": pack,
                "fill_remainder": fill_remainder,
                "relevance_floor": relevance_floor,
            },
        )
        self.memory = from_keywords(
            MemorySettings,
            memory,
            "memory",
            {
                "gpu": gpu,
                "concurrency": concurrency,
                "max_new_tokens": max_new_tokens,
                "kv_dtype": kv_dtype,
                "cache": cache,
                "utilization": utilization,
                "ttft_target": ttft_target,
            },
        )
        self.queue = from_keywords(
            QueueSettings,
            queue,
            "queue",
            {"queue_size": queue_size, "queue_timeout": queue_timeout},
            {"queue_size": "size", "queue_timeout": "timeout"},
        )
        # engine= is the URL (sugar, with engine_kind & co) or the whole record, as httpx's
        # timeout= takes a number or a Timeout.
        record = engine if isinstance(engine, EngineSettings) else None
        self.engine = from_keywords(
            EngineSettings,
            record,
            "engine",
            {
                "engine": None if record is not None else engine,
                "engine_kind": engine_kind,
                "api_key": api_key,
                "api_key_env": api_key_env,
                "tokenizer": tokenizer,
                "engine_context_tokens": engine_context_tokens,
                "engine_timeout": engine_timeout,
            },
            {
                "engine": "url",
                "engine_kind": "kind",
                "engine_context_tokens": "context_tokens",
                "engine_timeout": "timeout",
            },
        )
        if self.engine.url is not None and generator is not None:
            raise ConfigError("pass engine= (generate on a served engine) or generator= (a local model), not both")
        from .gpus import gpu_count

        if backend is None:
            local = self.engine.url is None
        else:
            from .generation.backend import LocalBackend

            local = isinstance(backend, LocalBackend)
        if local and gpu_count(self.memory.gpu) > 1:
            # A local generator runs on one device: a plan over several would promise memory that
            # the one model never gets.
            raise ConfigError(
                f"gpu={self.memory.gpu!r} names {gpu_count(self.memory.gpu)} GPUs, but a local generator "
                "runs on one: pass one GPU (e.g. 'H100'), or plan tensor-parallel serving with "
                "`ragbudget budget --gpu 2xH100` and generate on that engine (engine=URL)"
            )
        self.index_dir = Path(index_dir)
        self.model = model
        self.system_prompt = system_prompt
        self._span_scorer: Any = None
        self._embedder_spec = embedder
        self._embedder: Embedder | None = None
        self._generator = generator
        self._backend: Backend | None = backend
        if backend is not None:
            from .generation.backend import LocalBackend

            if isinstance(backend, LocalBackend):
                self._generator = backend.generator
        self._index: Index | None = None
        self._plans: dict[tuple[int, bool], BudgetPlan] = {}
        self._builder: PromptBuilder | None = None
        self._admission: AdmissionController | None = None
        self._admission_tuned = False
        self._pacing = Pacing(self.memory.ttft_target)
        self._lock = threading.RLock()

    # The flat names of the settings, read from their records (``pipe.fetch_k`` is
    # ``pipe.retrieval.fetch_k``); read-only: a pipeline's settings are fixed when it is built.
    fetch_k = RecordField("retrieval")
    hybrid = RecordField("retrieval")
    lexical_weight = RecordField("retrieval")
    fusion = RecordField("retrieval")
    order = RecordField("retrieval")
    pack = RecordField("retrieval")
    fill_remainder = RecordField("retrieval")
    relevance_floor = RecordField("retrieval")
    gpu = RecordField("memory")
    concurrency = RecordField("memory")
    max_new_tokens = RecordField("memory")
    kv_dtype = RecordField("memory")
    cache = RecordField("memory")
    utilization = RecordField("memory")
    ttft_target = RecordField("memory")
    queue_size = RecordField("queue", "size")
    queue_timeout = RecordField("queue", "timeout")

    def __repr__(self) -> str:
        if self.engine.url is not None:
            from .generation.engines import root_url  # the URL without any credentials in it

            url = root_url(self.engine.url)
            return f"Pipeline({str(self.index_dir)!r}, engine={url!r}, engine_kind={self.engine.kind!r})"
        return (
            f"Pipeline({str(self.index_dir)!r}, model={self.model!r}, gpu={self.memory.gpu!r}, "
            f"concurrency={self.memory.concurrency})"
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
                    raise ConfigError(
                        f"this pipeline generates on {self.backend!r}: it has no local generator (use pipeline.backend)"
                    )
                from .generation.generate import Generator

                self._generator = Generator(self.model)
            return self._generator

    @property
    def served(self) -> bool:
        """Whether generation runs on a served engine (``engine=`` or a non-local ``backend=``),
        decided without connecting."""
        from .generation.backend import LocalBackend

        if self._backend is not None:
            return not isinstance(self._backend, LocalBackend)
        return self.engine.url is not None

    @property
    def backend(self) -> Backend:
        """What generates: the served engine's :class:`~ragbudget.generation.backend.Backend` (connected on
        first use; token counts cached in ``<index_dir>/counts.sqlite``), or a
        :class:`~ragbudget.generation.backend.LocalBackend` over :attr:`generator`."""
        with self._lock:
            if self._backend is None:
                if self.engine.url is not None:
                    from .generation.backend import CountCache, MemoryCountCache, SQLiteCountCache
                    from .generation.engines import connect

                    # Counts persist next to the index (outside its generations: a cache); with
                    # no index folder yet (``budget --engine``), in memory.
                    cache: CountCache = (
                        SQLiteCountCache(self.index_dir / "counts.sqlite")
                        if self.index_dir.is_dir()
                        else MemoryCountCache()
                    )
                    self._backend = connect(self.engine, model=self.model, count_cache=cache)
                else:
                    from .generation.backend import LocalBackend

                    m = self.memory
                    self._backend = LocalBackend(
                        self.generator,
                        gpu=m.gpu,
                        concurrency=m.concurrency,
                        max_new_tokens=m.max_new_tokens,
                        cache=m.cache,
                        kv_dtype=m.kv_dtype,
                        utilization=m.utilization,
                    )
            return self._backend

    def engine_plan(
        self, max_new_tokens: int | None = None, *, question: str = "", history: Sequence[dict[str, str]] | None = None
    ) -> EnginePlan:
        """The served engine's allowance for one request now: its capacity (each figure with
        source and age) and the context tokens left after the template, system prompt,
        ``history``, ``question`` and ``max_new_tokens`` (default: the pipeline's)."""
        from .generation.backend import per_request_tokens

        new_tokens = self.memory.max_new_tokens if max_new_tokens is None else max_new_tokens
        check_int("max_new_tokens", new_tokens, 1)
        backend = self.backend
        if not self.served:
            raise ConfigError(
                "engine_plan() is for a pipeline on a served engine; a local one plans from memory: use plan_for()"
            )
        builder = self.prompt_builder.with_history(history)
        fixed = builder.fixed_tokens(question)
        capacity = backend.capacity()
        budget = per_request_tokens(capacity, max_new_tokens=new_tokens, overhead_tokens=fixed)
        return self._engine_plan(capacity, budget)

    def _engine_plan(self, capacity: Capacity, budget: RequestBudget) -> EnginePlan:
        from .generation.engines import ServedBackend

        backend = self.backend
        if isinstance(backend, ServedBackend):
            url, detected = backend.url, backend.detection.how
        else:
            url, detected = repr(backend), "given: backend="
        return EnginePlan(
            capacity=capacity,
            budget=budget,
            url=url,
            kind=capacity.engine_kind or "engine",
            detected=detected,
            model=model_name(backend.model_id),
        )

    @property
    def store(self) -> Index:
        """The opened index (raises :class:`~ragbudget.errors.IndexNotFoundError` if none)."""
        with self._lock:
            if self._index is None:
                from .retrieval.index import Index

                self._index = Index.open(self.index_dir)
            return self._index

    @property
    def plan(self) -> BudgetPlan:
        """The memory plan for the configured ``max_new_tokens``."""
        return self.plan_for(self.memory.max_new_tokens)

    def plan_for(self, max_new_tokens: int) -> BudgetPlan:
        """The memory plan reserving ``max_new_tokens`` (cached per value). Local generation
        only: a pipeline on a served engine plans from the engine's figures
        (:meth:`engine_plan`)."""
        if self.served:
            raise ConfigError(
                "a pipeline on a served engine has no memory plan; its allowance "
                "comes from the engine's own figures: use engine_plan()"
            )
        with self._lock:
            # A loaded generator knows its real weights and dtype; before that the plan reads the
            # config. Plans made before loading are kept apart from the ones made after.
            live = self._generator if self._generator is not None and self._generator.loaded else None
            loaded = live is not None
            plan = self._plans.get((max_new_tokens, loaded))
            if plan is None:
                from .memory.budget import plan_budget

                module = live.model if live is not None else None
                plan = plan_budget(
                    module if live is not None else self.model,
                    config=live.config if live is not None else None,
                    gpu=self.memory.gpu,
                    concurrency=self.memory.concurrency,
                    max_new_tokens=max_new_tokens,
                    kv_dtype=self.memory.kv_dtype,
                    cache=self.memory.cache,
                    utilization=self.memory.utilization,
                    # The activations of the attention the loaded model really runs (eager
                    # materializes the L×L scores); sdpa before it is loaded.
                    attn_implementation=_attn_in_use(module),
                )
                plan = self._pacing.cap(self._generator, plan)
                self._plans[(max_new_tokens, loaded)] = plan
            return plan

    #: What :meth:`calibrate` asks: any index has an answer to it.
    CALIBRATION_QUESTION = "What is this about?"

    def calibrate(self, question: str = CALIBRATION_QUESTION, *, max_new_tokens: int = 16) -> Answer | None:
        """Answer one real ``question`` — retrieval, a prompt as long as the plan allows,
        admission, ``max_new_tokens`` streamed tokens — so that admission's time model learns the
        speed a request gets on this host before the first client comes: the speed probe times
        bare forward passes of the model alone, and real requests have run several times slower
        (issue #30). Its first token and its end are observed as any request's are
        (:meth:`~ragbudget.memory.admission.AdmissionController.observe`: a new speed is provisional,
        and the slower one stands). ``serve`` does it at warm-up. ``None`` without a time model
        (a served engine, a model not loaded): nothing to calibrate."""
        if self.admission.throughput is None:
            return None
        return self.ask(question, max_new_tokens=max_new_tokens, on_text=lambda _piece: None)

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
        if self.served or not self._pacing.due(self.SPEED_RECHECK_S):
            return False
        with self._lock:
            ctl = self._admission
            if ctl is not None:
                s = ctl.stats()
                if s.running or s.queued:
                    return False
            if not self._pacing.remeasure(self._generator, self.plan, before=self._stop_batching):
                return False
            self._plans.clear()  # the time cap follows the new speed
            if ctl is not None and self._admission_tuned:
                self._pacing.tune(ctl, self._generator, self.plan, self.backend)
        return True

    def _stop_batching(self) -> None:
        """Stop the batching loop (idle: refresh_speed measures only then) so that a speed probe
        runs alone: while the loop's thread lives, its OpenMP workers slow any other thread's
        forward passes (:mod:`ragbudget.generation.batching`), and the probe would record that. The next
        request starts the loop again."""
        from .generation.backend import LocalBackend

        if isinstance(self._backend, LocalBackend):  # none built yet: no loop to stop
            self._backend.close()

    @property
    def admission(self) -> AdmissionController:
        """Admission control sized from the plan's KV capacity (shared by all threads). On a
        served engine: the KV tokens it reports, else its window × request slots; an engine that
        reports neither is not limited here (fail open — the engine queues and refuses itself)."""
        with self._lock:
            if self._admission is None:
                from .memory.admission import AdmissionController

                self._admission = AdmissionController(
                    self._admission_tokens(),
                    max_queue=self.queue.size,
                    timeout=self.queue.timeout,
                )
            if not self.served and not self._admission_tuned and Pacing.loaded(self._generator):
                self._pacing.tune(self._admission, self._generator, self.plan, self.backend)
                self._admission_tuned = True
            return self._admission

    def admission_estimate(self, max_new_tokens: int | None = None) -> tuple[int, int]:
        """``(tokens, prompt_tokens)`` a request is expected to reserve, known before its prompt
        is built: the plan's per-request prompt allowance (capped for time on a CPU) and the
        answer; on a served engine, its window. For a cheap look at admission (the server's early
        429) — the real prompt, usually shorter, is what :meth:`ask` reserves."""
        new = self.memory.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if self.served:
            window = self.backend.capacity().max_context_tokens or new
            prompt = max(0, window - new)
        else:
            prompt = self.plan_for(new).max_prompt_tokens
        return prompt + new, prompt

    def _admission_tokens(self) -> int:
        if not self.served:
            return self.plan.kv_capacity_tokens
        tokens, note = engine_admission(self.backend.capacity())
        if tokens == UNLIMITED_TOKENS:
            log.warning("%s", note)
        return tokens

    def admission_note(self) -> str:
        """What admission control is sized from, in one line (``serve`` logs it)."""
        if not self.served:
            ctl = self.admission
            parts = [f"{self.plan.kv_capacity_tokens} KV tokens (memory plan)"]
            if ctl.memory is not None:
                parts = [
                    f"KV + activations per request in {ctl.memory.capacity_bytes / 2**30:.2f} GiB ({ctl.memory.source})"
                ]
            if ctl.throughput is not None:
                t = ctl.throughput
                parts.append(
                    f"time: prefill {t.prefill_a * 1e3:.2f} ms/token, decode "
                    f"{t.decode_s * 1e3:.1f} ms/token ({t.source}); first token within "
                    f"the queue time-out {self.queue.timeout:g} s, started next to "
                    "others only within the TTFT target "
                    f"{ctl.ttft_target if ctl.ttft_target is not None else 'none'}"
                )
            return "; ".join(parts)
        return engine_admission(self.backend.capacity())[1]

    @property
    def prompt_builder(self) -> PromptBuilder:
        with self._lock:
            if self._builder is None:
                from .prompt.prompt import EnginePromptBuilder, PromptBuilder

                if self.served:
                    self._builder = EnginePromptBuilder(self.backend, system_prompt=self.system_prompt)
                else:
                    self._builder = PromptBuilder(self.generator.tokenizer, system_prompt=self.system_prompt)
            return self._builder

    # -- indexing and search ----------------------------------------------------------------------

    def index(self, paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], **options: Any) -> IndexSummary:
        """Index files and folders into ``index_dir`` (incremental). ``options`` go to
        :meth:`ragbudget.retrieval.index.Index.build` (``include``, ``exclude``, ``max_bytes``,
        ``min_tokens``, ``max_tokens``, ``rebuild``, ``rechunk``, ``progress``, …); settings left
        out keep what the index records. ``paths`` and the option names are checked before anything
        is read.

        >>> Pipeline("/tmp/rb").index([42])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ragbudget.errors.ArgumentTypeError: paths must be a path ... or a list of them, got item 0: int 42
        """
        from .retrieval.index import Index

        paths = check_paths(paths)
        _check_options("index", options, Index.build, taken=("paths", "embedder"))
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
                f"--index-dir {self.index_dir}` on a folder with documents first"
            )
        return store

    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The ``k`` chunks that best match ``query``, with all their sources: hybrid (dense +
        BM25, fused; ``score`` on the cosine scale) unless the pipeline has ``hybrid=False``.
        Raises :class:`~ragbudget.errors.IndexEmptyError` on an index without chunks."""
        query = _check_question(query, "query")
        k = check_int("k", k, 1)  # type: ignore[assignment]
        return self._search(query, k)[0]

    def _search(self, query: str, k: int) -> tuple[list[Hit], Any]:
        """:meth:`search`, and the query's vector it searched with (for the span scorer)."""
        store = self._searchable()
        vector = store.embed_query(query, embedder=self.embedder)
        hits = store.search(query, k=k, embedder=self.embedder, retrieval=self.retrieval, query_vector=vector)
        return hits, vector

    # -- budgeted retrieval -------------------------------------------------------------------------

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
        from .prompt.prompt import build_prompt

        question = _check_question(question)
        context_tokens = check_int("context_tokens", context_tokens, 0, optional=True)
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)  # type: ignore[assignment]
        check_text("retrieval_query", retrieval_query, optional=True)
        if history is not None and (
            isinstance(history, (str, bytes)) or not all(isinstance(m, Mapping) for m in history)
        ):
            raise ArgumentTypeError(
                f"history must be a list of {{'role': ..., 'content': ...}} dicts or None, got {shown(history)}"
            )
        timings: dict[str, float] = {}
        # A missing, damaged or empty index fails fast, before any model loads.
        self._searchable()
        allowance = self._engine_allowance if self.served else self._local_allowance
        builder, plan, max_prompt, cap = allowance(question, context_tokens, max_new_tokens, history, timings)
        t0 = time.perf_counter()
        query = _check_question(retrieval_query or question, "query")
        hits, vector = self._search(query, self.retrieval.fetch_k)
        timings["retrieve_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        options = self._pack_options()
        scorer = options.get("span_scorer")
        if scorer is not None and query == question:
            # The search embedded this very text with the index's embedder, as the scorer would:
            # one embedder call per question, not two. (A rewritten retrieval query is not the
            # question the sentences are scored against: the scorer embeds that one itself.)
            scorer.remember_query(question, vector)
        prompt = build_prompt(
            question,
            hits,
            max_prompt_tokens=max_prompt,
            builder=builder,
            order=self.retrieval.order,
            relevance_floor=self.retrieval.relevance_floor,
            **options,
        )
        timings["select_s"] = time.perf_counter() - t0
        return prompt, plan, timings, cap

    def _local_allowance(
        self,
        question: str,
        context_tokens: int | None,
        max_new_tokens: int,
        history: Sequence[dict[str, str]] | None,
        timings: dict[str, float],
    ) -> tuple[PromptBuilder, BudgetPlan, int, dict[str, Any] | None]:
        """The builder with the history, the memory plan, the prompt tokens this question may
        hold and the cap set on its context (``context_tokens``, or the time target)."""
        if not (self._generator is not None and self._generator.loaded):
            # So does a request the model's window or the memory can never hold (config only).
            self.plan_for(max_new_tokens)
        t0 = time.perf_counter()
        builder = self.prompt_builder  # loads the generator first, so the plan sees its real size
        timings["load_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        plan = self.plan_for(max_new_tokens)
        builder = builder.with_history(history)
        fixed = builder.fixed_tokens(question)
        # What memory and the window allow: a time cap shortens the context, never refuses a
        # question, and an explicit context_tokens pins the context whatever the time.
        max_prompt = memory_max_prompt(plan)
        prompt_room(plan, fixed, max_new_tokens)  # refuses a question memory cannot hold
        cap: dict[str, Any] | None = None
        if context_tokens is not None:
            cap = {"limit": "context_tokens", "tokens": context_tokens}
        else:
            cap = time_cap(plan, fixed, device=Pacing.device(self._generator), speed=self._pacing.entry)
        if cap is not None:
            max_prompt = min(max_prompt, fixed + cap["tokens"])
        timings["plan_s"] = time.perf_counter() - t0
        return builder, plan, max_prompt, cap

    def _engine_allowance(
        self,
        question: str,
        context_tokens: int | None,
        max_new_tokens: int,
        history: Sequence[dict[str, str]] | None,
        timings: dict[str, float],
    ) -> tuple[PromptBuilder, EnginePlan, int, dict[str, Any] | None]:
        """:meth:`_local_allowance` on a served engine: the allowance from the engine's capacity
        (:func:`~ragbudget.generation.backend.per_request_tokens`), counting and the template by the
        engine."""
        from .generation.backend import per_request_tokens

        t0 = time.perf_counter()
        backend = self.backend  # connects (and detects the engine kind) on first use
        builder = self.prompt_builder.with_history(history)
        timings["load_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        fixed = builder.fixed_tokens(question)
        capacity = backend.capacity()
        budget = per_request_tokens(capacity, max_new_tokens=max_new_tokens, overhead_tokens=fixed)
        plan = self._engine_plan(capacity, budget)
        max_prompt = plan.max_prompt_tokens
        cap: dict[str, Any] | None = None
        if context_tokens is not None:
            cap = {"limit": "context_tokens", "tokens": context_tokens}
            max_prompt = min(max_prompt, fixed + context_tokens)
        timings["plan_s"] = time.perf_counter() - t0
        return builder, plan, max_prompt, cap

    def _pack_options(self) -> dict[str, Any]:
        """``build_prompt``'s packing keywords: with ``pack="spans"``, one
        :class:`~ragbudget.prompt.spans.SpanScorer` per pipeline over the index's embedder, so sentence
        vectors are cached across questions, reading the sentence vectors the index stored at
        build time first, then the :class:`~ragbudget.retrieval.sentence_cache.SentenceCache` beside the
        index, which keeps every sentence embedded at question time for later questions and
        processes (search already refused an embedder other than the index's)."""
        if self.retrieval.pack == "chunks":
            return {"fill_remainder": True} if self.retrieval.fill_remainder else {}
        with self._lock:
            if self._span_scorer is None:
                from .prompt.spans import SpanScorer
                from .retrieval.sentence_cache import SentenceCache

                store = self.store
                persist = SentenceCache(store.path, identity=store.manifest["embedder"], dim=int(store.manifest["dim"]))
                self._span_scorer = SpanScorer(
                    self.embedder or store.embedder, stored=store.sentence_vectors, persist=persist
                )
        return {"pack": self.retrieval.pack, "span_scorer": self._span_scorer}

    def _sentence_vectors_path(self) -> str | None:
        """Where span packing's sentence vectors come from, for the report: ``"stored"`` (the
        index's, embedded at build time) or ``"embedded at query time"`` (an index built without
        them, the default: each sentence embedded the first time a question needs it and kept in
        the cache beside the index). ``None``: whole chunks are packed."""
        if self.retrieval.pack != "spans":
            return None
        return "stored" if self.store.has_sentence_vectors else "embedded at query time"

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
            max_new_tokens=self.memory.max_new_tokens if max_new_tokens is None else max_new_tokens,
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
        ``top_p``, …) go to :meth:`ragbudget.generation.generate.Generator.generate`.
        Raises :class:`~ragbudget.errors.BudgetError` when the question cannot fit, and
        :class:`~ragbudget.errors.OverloadedError` when admission control's queue is full.
        """
        # ``None`` means the pipeline's default; any other value is checked and honored (0 used to
        # fall back to the default silently).
        new_tokens = self.memory.max_new_tokens if max_new_tokens is None else max_new_tokens
        _check_call(on_text, cancel)
        from .generation.backend import split_generate_options

        # Checked before anything runs: a misspelt option used to fail after retrieval.
        sampling, stop, extra = split_generate_options(generate_options, served=self.served)
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
        vectors = self._sentence_vectors_path()

        def cancelled() -> Answer:
            # Left before generation began (while queued, or just as it was admitted): nothing to
            # generate, but the answer still says what the request would have been.
            timings["total_s"] = time.perf_counter() - t_start
            return cancelled_answer(prompt, plan, reserve, timings, cap, new_tokens, sentence_vectors=vectors)

        if cancel is not None and cancel.is_set():
            return cancelled()
        t0 = time.perf_counter()
        backend = self.backend
        # On an engine of fixed request slots a request holds a whole slot: admission then lets
        # no more requests through than the engine has slots, and the rest wait here, bounded by
        # the queue, instead of inside the engine, bounded only by the engine time-out.
        slot = backend.capacity().slot_tokens if self.served else None
        held = max(reserve, slot or 0)
        try:
            reservation = self.admission.acquire(held, prompt_tokens=prompt.n_tokens, cancel=cancel)
        except RequestCancelled:
            timings["queue_s"] = time.perf_counter() - t0
            return cancelled()
        with reservation:  # released however generation ends
            timings["queue_s"] = time.perf_counter() - t0
            if cancel is not None and cancel.is_set():
                return cancelled()
            t0 = time.perf_counter()
            emit = on_text
            if on_text is not None:

                def emit(piece: str) -> Any:
                    # The first token tells admission how fast the prefill really was.
                    reservation.first_token()
                    return on_text(piece)

            gen = backend.generate(
                prompt, max_new_tokens=new_tokens, sampling=sampling, stop=stop, on_text=emit, cancel=cancel, **extra
            )
            # And the whole request how fast it decoded: the time model follows the host.
            reservation.finish(gen.new_tokens)
            timings["generate_s"] = time.perf_counter() - t0
        if gen.measurement is not None:
            # A CUDA run measured its peak: the plan's owner keeps it, so the next plan for this
            # GPU and model uses the measured activations (the generator itself writes nothing).
            from .memory.budget import record_measurement

            record_measurement(gen.measurement)
        timings["total_s"] = time.perf_counter() - t_start
        final = gen.prompt if gen.prompt is not None else prompt
        return build_answer(gen, final, plan, reserve, timings, cap, sentence_vectors=vectors)

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
            raise ConfigError(
                "astream() needs a running event loop (call it inside `async def`); use stream() from synchronous code"
            ) from None
        _check_question(question)
        return AnswerStream(self.ask, question, _stream_options(options), loop=loop)

    async def aask(self, question: str, **options: Any) -> Answer:
        """:meth:`ask` without blocking the event loop; cancelling the awaiting task cancels the
        generation (and frees its KV reservation)."""
        _check_question(question)
        cancel = threading.Event()
        work = asyncio.ensure_future(asyncio.to_thread(self.ask, question, cancel=cancel, **_stream_options(options)))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            # The request stops at its next token (or leaves the admission queue); wait for that,
            # so its KV memory is free when the cancellation reaches the caller.
            cancel.set()
            with contextlib.suppress(BaseException):
                await work
            raise


def _attn_in_use(model: Any) -> str:
    """The attention implementation a loaded transformers model runs (``sdpa`` when unknown)."""
    cfg = getattr(model, "config", None)
    impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
    return str(impl) if isinstance(impl, str) and impl else "sdpa"


def check_paths(paths: Any) -> list[str | os.PathLike[str]]:
    """``paths`` as a list of paths: one path (str or ``os.PathLike``) or a list/tuple of them."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    if isinstance(items, (list, tuple)):
        for i, item in enumerate(items):
            if not isinstance(item, (str, os.PathLike)):
                raise ArgumentTypeError(
                    "paths must be a path (str or os.PathLike) or a list of them, got item "
                    f"{i}: {type(item).__name__} {shown(item)}"
                )
        return list(items)
    raise ArgumentTypeError(
        f"paths must be a path (str or os.PathLike) or a list of them, got {type(paths).__name__} {shown(paths)}"
    )


def _check_options(where: str, options: Mapping[str, Any], target: Callable[..., Any], *, taken: Sequence[str]) -> None:
    """Refuse keyword options that ``target`` does not take (or that ``where`` sets itself), by
    name, before any work: a bare ``TypeError`` from deep inside says neither where nor what."""
    import inspect

    accepted = [
        n
        for n, p in inspect.signature(target).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in taken
    ]
    unknown = sorted(k for k in options if k not in accepted)
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: not an option of {where}(); it takes {', '.join(accepted)}")


def _check_parts(embedder: Any, generator: Any, backend: Any) -> None:
    """The pipeline's parts given as objects: each the kind it must be, checked when it is built
    (not at first use, after an index was read)."""
    from .retrieval.embed import Embedder

    if embedder is not None and not isinstance(embedder, (str, Embedder)):
        raise ArgumentTypeError(
            "embedder must be a model name or path (str), 'hash' or a ragbudget.retrieval.embed.Embedder, got "
            f"{type(embedder).__name__} {shown(embedder)}"
        )
    # A generator is duck-typed (tests and wrappers stand in for it); a name or a number is not one.
    if generator is not None and isinstance(generator, (str, bytes, os.PathLike, int, float)):
        raise ArgumentTypeError(
            f"generator must be a ragbudget.generation.generate.Generator, got {type(generator).__name__} "
            f"{shown(generator)}"
            + ("; to name a model, pass model=" if isinstance(generator, (str, os.PathLike)) else "")
        )
    if backend is not None and isinstance(backend, (str, bytes, os.PathLike, int, float)):
        raise ArgumentTypeError(
            "backend must implement ragbudget.generation.backend.Backend (warm_up, render, count, capacity, "
            f"generate, ...), got {type(backend).__name__} {shown(backend)}"
            + ("; to generate on a served engine, pass engine=URL" if isinstance(backend, str) else "")
        )


def _check_call(on_text: Any, cancel: Any) -> None:
    if on_text is not None and not callable(on_text):
        raise ArgumentTypeError(
            f"on_text must be a callable taking each piece of text, got {type(on_text).__name__} {shown(on_text)}"
        )
    # ``cancel`` is the caller's object, duck-typed on purpose (a threading.Event, an asyncio-side
    # flag, a web framework's disconnect signal): probing it for ``is_set`` is the check.
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise ArgumentTypeError(
            f"cancel must be a threading.Event (anything with is_set()), got {type(cancel).__name__} {shown(cancel)}"
        )


def _stream_options(options: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(k for k in ("on_text", "cancel") if k in options)
    if taken:
        raise ConfigError(
            f"a stream delivers the text and cancels itself; drop {', '.join(taken)} (use ask() to pass your own)"
        )
    return options
