"""Budgeted retrieve-then-generate: the one object most users need.

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

Its settings are records (:mod:`ragbudget.settings`); what one request may hold, and admission
control, :mod:`ragbudget.planning` (the pipeline's base, which asks the backend); the rules are
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

from .answer import Answer, AnswerStream, build_answer, cancelled_answer, declined_answer
from .calls import (
    check_call,
    check_options,
    check_parts,
    check_paths,
    check_question,
    index_location,
    settings_records,
    stream_options,
)
from .errors import ArgumentTypeError, ConfigError, IndexEmptyError, RequestCancelled
from .evidence import DECLINED_TEXT, Evidence, evidence_floor
from .generation.allowance import EnginePlan, prompt_room, request_allowance
from .packing.packer import Packer, SpanPacker, make_packer
from .planning import Planning
from .request import RequestContext
from .retrieval.embed import make_embedder
from .retrieval.scope import Sources, scope_of
from .settings import (
    DEFAULT_RELEVANCE_FLOOR,
    EngineSettings,
    MemorySettings,
    QueueSettings,
    RecordField,
    RetrievalSettings,
    check_int,
    check_text,
    shown,
)
from .types import DEFAULT_INDEX_DIR

if TYPE_CHECKING:
    from .generation.backend import Backend
    from .generation.generate import Generation, Generator
    from .packing.select import Selection
    from .packing.spans import SpanScorer
    from .prompt.prompt import Prompt, PromptBuilder
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


class Pipeline(Planning):
    """Index documents and answer questions inside a GPU memory budget.

    Everything heavy (models, the FAISS index) loads on first use, so constructing a pipeline is
    free and ``budget``-only use never loads a model. Thread-safe: concurrent :meth:`ask` calls
    are admitted only while their summed KV reservations fit the plan's capacity.

    Args:
        index_dir: folder of the index (created by :meth:`index`), a PostgreSQL database (a
            ``postgresql://`` URL or a libpq keyword/value string: docs/postgres.md), or a URL
            of an installed storage's scheme (docs/storage.md).
        model: generator — HF id, local folder or ``.gguf`` (default: the packaged
            Qwen2.5-Coder-0.5B-Instruct, or ``$RAGBUDGET_MODEL``);
            with ``engine``, which of the engine's served models (default: the first listed).
        embedder: embedder for indexing (default: the index's own, else packaged MiniLM).
        system_prompt: the chat's system prompt (default:
            :data:`ragbudget.prompt.prompt.DEFAULT_SYSTEM_PROMPT`).
        generator: an already built :class:`~ragbudget.generation.generate.Generator` to share.
        backend: any :class:`~ragbudget.generation.backend.Backend` (overrides ``engine`` and ``generator``).
        retrieval: a :class:`~ragbudget.settings.RetrievalSettings` — ``fetch_k``, ``hybrid``,
            ``lexical_weight``, ``fusion``, ``order``, ``pack``, ``fill_remainder``,
            ``relevance_floor``, ``span_floor``, ``evidence_floor``.
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
        span_floor: float | None = None,
        evidence_floor: float | None = None,
        queue_size: int | None = None,
        queue_timeout: float | None = None,
        engine_kind: str | None = None,
        api_key: str | None = None,
        api_key_env: str | None = None,
        tokenizer: Any = None,
        engine_context_tokens: int | None = None,
        engine_timeout: float | None = None,
    ) -> None:
        check_text("model", model, optional=True)
        check_text("system_prompt", system_prompt, optional=True)
        check_parts(embedder, generator, backend)
        self.retrieval, self.memory, self.queue, self.engine = settings_records(locals())
        if self.engine.url is not None and generator is not None:
            raise ConfigError("pass engine= (generate on a served engine) or generator= (a local model), not both")
        self.index_dir, self._index_shown = index_location(index_dir)
        self.model = model
        super().__init__(memory=self.memory, queue=self.queue, system_prompt=system_prompt)
        self._span_scorer: Any = None
        self._packer_made: Packer | None = None
        self._embedder_spec = embedder
        self._embedder: Embedder | None = None
        if backend is None and self.engine.url is None:
            # The settings ask for the local generator: built now (nothing loads until first
            # use), so its memory settings are checked with the rest. An engine is connected to
            # on first use (:attr:`backend`).
            from .generation.local import local_backend

            backend = local_backend(generator, model=model, memory=self.memory)
        self._backend: Backend | None = backend
        self._index: Index | None = None
        self._lock = threading.RLock()
        # Searches made by prime() for the ask that follows: (generation, query, scope) -> hits, vector.
        self._primed: dict[tuple[int, str, tuple[str, ...] | None], tuple[list[Hit], Any]] = {}

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
    span_floor = RecordField("retrieval")
    evidence_floor = RecordField("retrieval")
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
            return f"Pipeline({self._index_shown!r}, engine={url!r}, engine_kind={self.engine.kind!r})"
        return (
            f"Pipeline({self._index_shown!r}, model={self.model!r}, gpu={self.memory.gpu!r}, "
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
        pipeline that generates on a served engine, or on a given backend without one, has
        none: :attr:`backend` is what generates."""
        from .generation.local import local_generator

        backend = self.backend
        gen = local_generator(backend)  # a backend over a local generator shares it; no other has one
        if gen is None:
            raise ConfigError(
                f"this pipeline generates on {backend!r}: it has no local generator (use pipeline.backend)"
            )
        return gen

    @property
    def backend(self) -> Backend:
        """What generates: the local generator's backend
        (:func:`~ragbudget.generation.local.local_backend`), a given ``backend=``, or the served engine's
        :class:`~ragbudget.generation.backend.Backend` (connected on first use; token counts
        cached in ``<index_dir>/counts.sqlite``)."""
        with self._lock:
            if self._backend is None:
                from .generation.backend import CountCache, MemoryCountCache, SQLiteCountCache
                from .generation.engines import connect

                # Counts persist next to the index (outside its generations: a cache); with
                # no index folder yet (``budget --engine``), in memory.
                cache: CountCache = MemoryCountCache()
                if isinstance(self.index_dir, Path) and self.index_dir.is_dir():
                    cache = SQLiteCountCache(self.index_dir / "counts.sqlite")
                self._backend = connect(self.engine, model=self.model, count_cache=cache)
            return self._backend

    def backend_if_ready(self) -> Backend | None:
        """The backend when it is built or connected already (``None``: an engine not connected
        yet); connects to nothing."""
        return self._backend

    def warm_up(self) -> None:
        """Load the model or connect to the engine (:meth:`Backend.warm_up
        <ragbudget.generation.backend.Backend.warm_up>`), size admission control and open the
        index with its embedder, so the first request pays for none of it. What ``serve`` does
        before it listens."""
        self.backend.warm_up()
        _ = self.admission
        self.search("warm-up", k=1)

    @property
    def store(self) -> Index:
        """The opened index (raises :class:`~ragbudget.errors.IndexNotFoundError` if none)."""
        with self._lock:
            if self._index is None:
                from .retrieval.index import Index

                self._index = Index.open(self.index_dir)
            return self._index

    def close(self) -> None:
        """Stop what the pipeline started — the batching loop of a local model, an engine's
        connections — and close the index. Idempotent; a later call opens them again. Also
        ``with Pipeline(...) as rb:``. A process that exits without it is still safe (the batching
        loop is stopped at exit), but a long-lived program that drops pipelines should close them."""
        # Both keep their objects: a Backend and an Index reopen what they need on next use.
        with self._lock:
            backend, index = self._backend, self._index
        if backend is not None:
            backend.close()
        if index is not None:
            index.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        if self._evidence_floor()[0] is not None and self.evidence(question).declined:
            # Declined, it would measure nothing: the opening words of the passage it finds instead.
            question = " ".join(self.search(question, k=1)[0].text.split()[:40]) or question
        return self.ask(question, max_new_tokens=max_new_tokens, on_text=lambda _piece: None)

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
        check_options("index", options, Index.build, taken=("paths", "embedder"))
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
                f"the index in {self._index_shown} has no chunks ({files} file(s) indexed, "
                f"{skipped} skipped): there is nothing to search; run `ragbudget index PATH "
                f"--index-dir {self._index_shown}` on a folder with documents first"
            )
        return store

    def search(self, query: str, k: int = 5, *, sources: Sources | None = None) -> list[Hit]:
        """The ``k`` chunks that best match ``query``, with all their sources: hybrid (dense +
        BM25, fused; ``score`` on the cosine scale) unless the pipeline has ``hybrid=False``;
        ``sources`` as in :meth:`ask`. Raises :class:`~ragbudget.errors.IndexEmptyError` on an
        index without chunks."""
        query = check_question(query, "query")
        k = check_int("k", k, 1)  # type: ignore[assignment]
        scope = scope_of(sources)
        with self.store.pinned():  # the newest committed generation, one for the whole call
            return self._search(query, k, scope)[0]

    def _search(self, query: str, k: int, sources: tuple[str, ...] | None = None) -> tuple[list[Hit], Any]:
        """:meth:`search`, and the query's vector it searched with (for the span scorer)."""
        store = self._searchable()
        vector = store.embed_query(query, embedder=self.embedder)
        hits = store.search(
            query, k=k, embedder=self.embedder, retrieval=self.retrieval, query_vector=vector, sources=sources
        )
        return hits, vector

    # -- budgeted retrieval -------------------------------------------------------------------------

    def _request(
        self,
        question: str,
        *,
        context_tokens: int | None,
        max_new_tokens: int,
        history: Sequence[dict[str, str]] | None,
        retrieval_query: str | None,
        sources: Sources | None = None,
    ) -> RequestContext:
        """A new request's context, once what the caller passed is checked (before anything runs)."""
        question = check_question(question)
        check_int("context_tokens", context_tokens, 0, optional=True)
        check_int("max_new_tokens", max_new_tokens, 1)
        check_text("retrieval_query", retrieval_query, optional=True)
        if history is not None and (
            isinstance(history, (str, bytes)) or not all(isinstance(m, Mapping) for m in history)
        ):
            raise ArgumentTypeError(
                f"history must be a list of {{'role': ..., 'content': ...}} dicts or None, got {shown(history)}"
            )
        query = check_question(retrieval_query or question, "query")
        scope = scope_of(sources)
        return RequestContext(question=question, query=query, max_new_tokens=max_new_tokens, sources=scope)

    def _to_prompt(
        self,
        ctx: RequestContext,
        *,
        context_tokens: int | None,
        history: Sequence[dict[str, str]] | None,
        found: tuple[list[Hit], Any] | None = None,
    ) -> Prompt:
        """A question's way up to its prompt, each stage once: search (unless ``found`` holds it)
        → plan (the backend ready, its capacity read once, the fixed part of the prompt counted
        once, the allowance) → pack → render (:func:`~ragbudget.fitting.fit_prompt`: pack and
        render again only when a render came out over)."""
        from .fitting import fit_prompt

        # A missing, damaged or empty index fails fast, before any model loads.
        self._searchable()
        hits, vector = found if found is not None else self._timed_search(ctx)
        packer = self._packer()
        ctx.enter("plan")
        builder = self._loaded_builder(ctx, history)  # its own load_s
        if builder.batch_counts:
            # Counting costs requests to the engine: the candidates and the question's fixed part
            # go in one request (issue #42 §5).
            builder.prime(packer.texts_to_count(hits, builder), questions=[ctx.question])
        with ctx.timed(None, "plan_s"):
            ctx.capacity = self.backend.capacity(max_new_tokens=ctx.max_new_tokens)
            ctx.fixed_tokens = builder.fixed_tokens(ctx.question)
            allowance = request_allowance(
                self.backend,
                ctx.capacity,
                fixed=ctx.fixed_tokens,
                max_new_tokens=ctx.max_new_tokens,
                context_tokens=context_tokens,
            )
            ctx.plan, ctx.limit = allowance.plan, allowance.limit
        t0 = time.perf_counter()
        if isinstance(packer, SpanPacker) and packer.scorer is not None and ctx.query == ctx.question:
            # The search embedded this very text with the index's embedder, as the scorer would:
            # one embedder call per question, not two. (A rewritten retrieval query is not the
            # question the sentences are scored against: the scorer embeds that one itself.)
            packer.scorer.remember_query(ctx.question, vector)
        prompt = fit_prompt(
            ctx.question,
            hits,
            packer=packer,
            builder=builder,
            max_prompt_tokens=allowance.max_prompt_tokens,
            fixed_tokens=ctx.fixed_tokens,
            on_step=ctx.enter,
        )
        ctx.timings["select_s"] = time.perf_counter() - t0
        return prompt

    def evidence(self, question: str, *, hits: Sequence[Hit] | None = None) -> Evidence:
        """How well the documents answer ``question`` (:mod:`ragbudget.evidence`), against the
        floor under which :meth:`ask` declines; ``hits``: a search already made."""
        from .evidence import Evidence, measure_evidence

        question = check_question(question)
        if hits is None:
            with self.store.pinned():
                hits = self._search(question, self.retrieval.fetch_k)[0]
        floor, source = self._evidence_floor()
        return Evidence(score=measure_evidence(question, hits, self._scorer()), floor=floor, source=source)

    def _evidence_floor(self) -> tuple[float | None, str]:
        return evidence_floor(self.retrieval.evidence_floor, self.store.embedder.id)

    def _loaded_builder(self, ctx: RequestContext, history: Sequence[dict[str, str]] | None) -> PromptBuilder:
        """The builder with the history, the backend connected or loaded first."""
        t0 = time.perf_counter()
        if not self.builder_ready:
            # The first request: before any model loads, the capacity alone refuses a request
            # the model's window or the memory can never hold (a local plan from the config),
            # and connects to an engine. Later requests read it once, in the plan.
            self.backend.capacity(max_new_tokens=ctx.max_new_tokens)
        builder = self.prompt_builder.with_history(history)  # loads a local generator first
        ctx.timings["load_s"] = time.perf_counter() - t0
        return builder

    def _timed_search(self, ctx: RequestContext) -> tuple[list[Hit], Any]:
        """The ``search`` stage: :meth:`_search` for ``fetch_k`` candidates (the one :meth:`prime`
        made, when it made it on this generation), its seconds in ``retrieve_s``."""
        with ctx.timed("search", "retrieve_s"):
            with self.store.pinned() as gen, self._lock:
                primed = self._primed.pop((gen.number, ctx.query, ctx.sources), None)
            found = primed if primed is not None else self._search(ctx.query, self.retrieval.fetch_k, ctx.sources)
            self._read_sentence_vectors(found[0])
            return found

    def _read_sentence_vectors(self, hits: Sequence[Hit]) -> None:
        """Part of the search: the candidates' sentence vectors stored at build time, read from
        the index in one lookup while its generation is pinned, into the scorer's cache — so
        neither the evidence measure nor span packing reaches back into the index. Nothing when
        the index stores none (the default: sentences are embedded at question time) or nothing
        scores sentences (whole chunks, no evidence floor)."""
        if not self.store.has_sentence_vectors:
            return
        if self.retrieval.pack == "spans" or self._evidence_floor()[0] is not None:
            self._scorer().preload(h.chunk_id for h in hits)

    def prime(self, question: str, *, retrieval_query: str | None = None, sources: Sources | None = None) -> None:
        """Count ahead, in one request to a served engine, what answering ``question`` will count
        first: its prompt without passages and its candidates (searched now, on the newest
        generation, by ``retrieval_query`` if given; the :meth:`ask` that follows on the same
        generation takes this search). For a caller that needs the question's count before it
        asks (:class:`~ragbudget.chat.Conversation` fits the history to it); nothing where
        counting costs no request (a local tokenizer)."""
        question = check_question(question)
        builder = self.prompt_builder
        if not builder.batch_counts:
            return
        query = check_question(retrieval_query or question, "query")
        scope = scope_of(sources)
        with self.store.pinned() as gen:
            found = self._search(query, self.retrieval.fetch_k, scope)
        with self._lock:
            self._primed[(gen.number, query, scope)] = found
            while len(self._primed) > 16:  # primed, never asked (refused, cancelled): dropped
                self._primed.pop(next(iter(self._primed)))
        builder.prime(self._packer().texts_to_count(found[0], builder), questions=[question])

    @property
    def span_scorer(self) -> SpanScorer | None:
        """The :class:`~ragbudget.packing.spans.SpanScorer` this pipeline packs spans with (made
        on first use, shared by every question: its sentence vectors are cached across them);
        ``None`` when whole chunks are packed."""
        packer = self._packer()
        return packer.scorer if isinstance(packer, SpanPacker) else None

    def _packer(self) -> Packer:
        """The pipeline's one packer (:mod:`ragbudget.packing.packer`), from its settings: whole
        chunks, or spans with the pipeline's one :class:`~ragbudget.packing.spans.SpanScorer`
        (:meth:`_scorer`), so sentence vectors are cached across questions."""
        with self._lock:
            if self._packer_made is None:
                options: dict[str, Any] = {
                    "order": self.retrieval.order,
                    "relevance_floor": self.retrieval.relevance_floor,
                }
                if self.retrieval.pack == "chunks":
                    if self.retrieval.fill_remainder:
                        options["fill_remainder"] = True
                    self._packer_made = make_packer("chunks", **options)
                else:
                    options["span_floor"] = self.retrieval.span_floor
                    self._packer_made = make_packer(self.retrieval.pack, scorer=self._scorer(), **options)
            return self._packer_made

    def _scorer(self) -> SpanScorer:
        """The pipeline's one :class:`~ragbudget.packing.spans.SpanScorer`: span packing scores
        sentences with it, :meth:`evidence` measures with it; its cache serves both."""
        with self._lock:
            if self._span_scorer is None:
                self._span_scorer = self.store.span_scorer(self.embedder)
            scorer: SpanScorer = self._span_scorer
            return scorer

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
        sources: Sources | None = None,
    ) -> Selection:
        """The chunks that best answer ``question`` and fit this request's context allowance.

        ``context_tokens`` caps the context below what memory allows. ``Selection.tokens_allowed``
        is the allowance in the generator's tokens, ``tokens_used`` what the chosen passages cost
        (labels included), ``dropped`` every candidate left out with its reason; ``sources`` as in :meth:`ask`."""
        ctx = self._request(
            question,
            context_tokens=context_tokens,
            max_new_tokens=self.memory.max_new_tokens if max_new_tokens is None else max_new_tokens,
            history=history,
            retrieval_query=retrieval_query,
            sources=sources,
        )
        with self.store.pinned():
            prompt = self._to_prompt(ctx, context_tokens=context_tokens, history=history)
        return prompt.selection

    def ask(
        self,
        question: str,
        *,
        context_tokens: int | None = None,
        max_new_tokens: int | None = None,
        history: Sequence[dict[str, str]] | None = None,
        retrieval_query: str | None = None,
        sources: Sources | None = None,
        on_text: Callable[[str], Any] | None = None,
        cancel: threading.Event | None = None,
        **generate_options: Any,
    ) -> Answer:
        """Retrieve, select within the budget, and generate an answer citing its sources.

        ``on_text`` receives the answer as it streams; setting ``cancel`` stops generation early
        (and frees the KV reservation). ``sources`` scopes the question to some files (display paths,
        folders or globs: :mod:`ragbudget.retrieval.scope`); only their chunks are searched, packed,
        cited and weighed by the evidence floor. ``generate_options`` (``do_sample``, ``temperature``,
        ``top_p``, …) go to :meth:`ragbudget.generation.generate.Generator.generate`.
        Raises :class:`~ragbudget.errors.BudgetError` when the question cannot fit, and
        :class:`~ragbudget.errors.OverloadedError` when admission control's queue is full.
        """
        # ``None`` means the pipeline's default; any other value is checked and honored (0 used to
        # fall back to the default silently).
        new_tokens = self.memory.max_new_tokens if max_new_tokens is None else max_new_tokens
        check_call(on_text, cancel)
        from .generation.backend import check_generate_options, split_generate_options

        # Checked before anything runs: a misspelt option used to fail after retrieval.
        sampling, stop, extra = split_generate_options(generate_options)
        check_generate_options(self.backend, extra)
        ctx = self._request(
            question,
            context_tokens=context_tokens,
            max_new_tokens=new_tokens,
            history=history,
            retrieval_query=retrieval_query,
            sources=sources,
        )
        self.refresh_speed()
        # The newest committed generation (a writer elsewhere may have committed since the last
        # question), one for the search, the chunks and the sentences: the one the answer cites.
        with self.store.pinned() as searched:
            found = self._timed_search(ctx)
            cited: dict[str, Any] = {"generation": searched.number}
            if ctx.sources is not None:  # resolved by the search just made (kept per generation)
                cited.update(sources=list(ctx.sources), chunks_in_scope=len(self.store.chunks_in(ctx.sources)))
            evidence = self._floored_evidence(ctx, found[0], history)
            if evidence is not None and evidence.declined:  # nothing to read: no model call, no prefill, no KV
                ctx.enter("answer")
                if on_text is not None:
                    on_text(DECLINED_TEXT)
                return declined_answer(evidence, new_tokens, ctx.finish(), index=cited, stages=ctx.stages)
            prompt = self._to_prompt(ctx, context_tokens=context_tokens, history=history, found=found)
        assert ctx.plan is not None and ctx.capacity is not None  # the plan stage sets both
        reserve = prompt.n_tokens + new_tokens
        said: dict[str, Any] = {"sentence_vectors": self._sentence_vectors_path(), "index": cited, "stages": ctx.stages}
        gen = self._admit_and_generate(
            ctx, prompt, reserve, sampling=sampling, stop=stop, on_text=on_text, cancel=cancel, **extra
        )
        if gen is None:
            # Left before generation began (while queued, or just as it was admitted): nothing to
            # generate, but the answer still says what the request would have been.
            return cancelled_answer(prompt, ctx.plan, reserve, ctx.finish(), ctx.limit, new_tokens, **said)
        ctx.enter("answer")
        ctx.finish()
        final = gen.prompt if gen.prompt is not None else prompt  # smaller after an OOM or "too long"
        answer = build_answer(
            gen, final, ctx.plan, reserve, ctx.timings, ctx.limit, evidence=evidence, cite=not stop, **said
        )
        added = answer.report["citations"]["added"]  # a citation placed after the text: streamed too
        if on_text is not None and added:
            on_text(added.lstrip() if str(gen.text)[-1:].isspace() else added)
        return answer

    def _floored_evidence(
        self, ctx: RequestContext, hits: Sequence[Hit], history: Sequence[dict[str, str]] | None
    ) -> Evidence | None:
        """The evidence the search found for the question, where a floor applies: measured only
        then (no question pays for a figure nothing reads), and not in a conversation (its
        history is something to read too)."""
        if self._evidence_floor()[0] is None or history:
            return None
        return self.evidence(ctx.query, hits=hits)

    def _admit_and_generate(
        self,
        ctx: RequestContext,
        prompt: Prompt,
        reserve: int,
        *,
        on_text: Callable[[str], Any] | None,
        cancel: threading.Event | None,
        **options: Any,
    ) -> Generation | None:
        """The ``admit`` and ``generate`` stages: a reservation of ``reserve`` KV tokens (a whole
        slot on an engine of fixed slots), the generation inside it, and what it measured kept;
        ``None`` when the request was cancelled before generation began."""
        assert ctx.capacity is not None  # the plan stage read it
        if cancel is not None and cancel.is_set():
            return None
        ctx.enter("admit")
        t0 = time.perf_counter()
        # On an engine of fixed request slots a request holds a whole slot: admission then lets
        # no more requests through than the engine has slots, and the rest wait here, bounded by
        # the queue, instead of inside the engine, bounded only by the engine time-out.
        held = max(reserve, ctx.capacity.slot_tokens or 0)
        try:
            reservation = self.admission.acquire(
                held, prompt_tokens=prompt.n_tokens, new_tokens=reserve - prompt.n_tokens, cancel=cancel
            )
        except RequestCancelled:
            ctx.timings["queue_s"] = time.perf_counter() - t0
            return None
        with reservation:  # released however generation ends
            ctx.timings["queue_s"] = time.perf_counter() - t0
            if cancel is not None and cancel.is_set():
                return None
            ctx.enter("generate")
            t0 = time.perf_counter()
            emit = on_text
            if on_text is not None:

                def emit(piece: str) -> Any:
                    # The first token tells admission how fast the prefill really was.
                    reservation.first_token()
                    return on_text(piece)

            gen = self.backend.generate(
                prompt, max_new_tokens=ctx.max_new_tokens, on_text=emit, cancel=cancel, **options
            )
            # And the whole request how fast it decoded: the time model follows the host.
            reservation.finish(gen.new_tokens)
            ctx.timings["generate_s"] = time.perf_counter() - t0
        if gen.measurement is not None:
            # A CUDA run measured its peak: the plan's owner keeps it, so the next plan for this
            # GPU and model uses the measured activations (the generator itself writes nothing).
            from .memory.calibration import record_measurement

            record_measurement(gen.measurement)
        return gen

    def stream(self, question: str, **options: Any) -> AnswerStream:
        """:meth:`ask`, as an iterator over the answer's text while it is generated; the
        :class:`Answer` is the stream's ``answer`` at the end. ``options`` are :meth:`ask`'s
        (but ``on_text`` and ``cancel``, which the stream owns). Breaking out of the loop or
        closing the stream cancels the generation."""
        check_question(question)
        return AnswerStream(self.ask, question, stream_options(options))

    def astream(self, question: str, **options: Any) -> AnswerStream:
        """:meth:`stream` for asyncio (``async for piece in rb.astream(q)``): the model runs in a
        thread, pieces arrive through the running event loop, which is never blocked."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise ConfigError(
                "astream() needs a running event loop (call it inside `async def`); use stream() from synchronous code"
            ) from None
        check_question(question)
        return AnswerStream(self.ask, question, stream_options(options), loop=loop)

    async def aask(self, question: str, **options: Any) -> Answer:
        """:meth:`ask` without blocking the event loop; cancelling the awaiting task cancels the
        generation (and frees its KV reservation)."""
        check_question(question)
        cancel = threading.Event()
        work = asyncio.ensure_future(asyncio.to_thread(self.ask, question, cancel=cancel, **stream_options(options)))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            # The request stops at its next token (or leaves the admission queue); wait for that,
            # so its KV memory is free when the cancellation reaches the caller.
            cancel.set()
            with contextlib.suppress(BaseException):
                await work
            raise
