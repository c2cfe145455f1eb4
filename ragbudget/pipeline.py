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
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import BudgetError, ConfigError, RequestCancelled

if TYPE_CHECKING:
    from .admission import AdmissionController
    from .budget import BudgetPlan
    from .embed import Embedder
    from .generate import Generator
    from .index import Hit, Index, IndexSummary
    from .prompt import Prompt, PromptBuilder
    from .select import Selection

__all__ = ["Answer", "AnswerStream", "Pipeline", "format_report", "make_embedder"]

log = logging.getLogger(__name__)

DEFAULT_INDEX_DIR = ".ragbudget"


@dataclass(frozen=True)
class Answer:
    """A generated answer with its citations and the full account of how it was budgeted.

    ``sources[i]`` is citation ``[i + 1]`` in ``text``: ``{path, start, end, page, page_end,
    score}``. ``report`` holds ``budget`` (kv_bytes_per_token, context_tokens_allowed/used,
    prompt_tokens, max_new_tokens, …), ``plan`` (the memory plan), ``selection``, ``dropped``
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


def make_embedder(spec: Any = None) -> Embedder | None:
    """An embedder from a CLI-style spec: ``None`` (the index's own, or the packaged MiniLM),
    ``"hash"`` / ``"hash:384"`` (the deterministic model-free test embedder), or a
    sentence-transformers model id or path. Embedder objects pass through."""
    if spec is None or not isinstance(spec, str):
        return spec
    from .embed import HashEmbedder, SentenceTransformerEmbedder

    if spec == "hash" or spec.startswith("hash:"):
        dim = spec.partition(":")[2]
        try:
            return HashEmbedder(int(dim) if dim else 384)
        except ValueError:
            raise ConfigError(f"embedder {spec!r}: expected hash or hash:<dim>, e.g. hash:384") from None
    return SentenceTransformerEmbedder(spec)


class Pipeline:
    """Index documents and answer questions inside a GPU memory budget.

    Everything heavy (models, the FAISS index) loads on first use, so constructing a pipeline is
    free and ``budget``-only use never loads a model. Thread-safe: concurrent :meth:`ask` calls
    are admitted only while their summed KV reservations fit the plan's capacity.

    Args:
        index_dir: folder of the index (created by :meth:`index`).
        model: generator — HF id, local folder or ``.gguf`` (default: packaged SmolLM2-135M).
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
        utilization: share of the memory the plan may use (0.9 as vLLM).
        queue_size, queue_timeout: admission control's bounded queue.
        generator: an already built :class:`~ragbudget.generate.Generator` to share.

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
        utilization: float = 0.9,
        queue_size: int = 64,
        queue_timeout: float = 30.0,
        system_prompt: str | None = None,
        generator: Generator | None = None,
    ) -> None:
        if concurrency < 1:
            raise ConfigError(f"concurrency must be ≥ 1, got {concurrency}")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if fetch_k < 1:
            raise ConfigError(f"fetch_k must be ≥ 1, got {fetch_k}")
        if not 0.0 <= lexical_weight <= 1.0:
            raise ConfigError(f"lexical_weight must be in [0, 1], got {lexical_weight}; "
                              "use 0 (or hybrid=False) for dense-only search")
        if fusion not in ("rrf", "score"):
            raise ConfigError(f"fusion must be 'rrf' or 'score', got {fusion!r}")
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
        self.utilization = utilization
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self.system_prompt = system_prompt
        self._embedder_spec = embedder
        self._embedder: Embedder | None = None
        self._generator = generator
        self._index: Index | None = None
        self._plans: dict[tuple[int, bool], BudgetPlan] = {}
        self._builder: PromptBuilder | None = None
        self._admission: AdmissionController | None = None
        self._lock = threading.RLock()

    def __repr__(self) -> str:
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
        """The generator (loaded on first use; the packaged SmolLM2 by default)."""
        with self._lock:
            if self._generator is None:
                from .generate import Generator

                self._generator = Generator(self.model)
            return self._generator

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
        """The memory plan reserving ``max_new_tokens`` (cached per value)."""
        with self._lock:
            # A loaded generator knows its real weights and dtype; before that the plan reads the
            # config. Plans made before loading are kept apart from the ones made after.
            loaded = self._generator is not None and bool(getattr(self._generator, "loaded", False))
            plan = self._plans.get((max_new_tokens, loaded))
            if plan is None:
                from .budget import plan_budget

                plan = plan_budget(
                    self._generator.model if loaded else self.model,
                    config=self._generator.config if loaded else None,
                    gpu=self.gpu,
                    concurrency=self.concurrency,
                    max_new_tokens=max_new_tokens,
                    kv_dtype=self.kv_dtype,
                    cache=self.cache,
                    utilization=self.utilization,
                )
                self._plans[(max_new_tokens, loaded)] = plan
            return plan

    @property
    def admission(self) -> AdmissionController:
        """Admission control sized from the plan's KV capacity (shared by all threads)."""
        with self._lock:
            if self._admission is None:
                from .admission import AdmissionController

                self._admission = AdmissionController(
                    self.plan.kv_capacity_tokens,
                    max_queue=self.queue_size,
                    timeout=self.queue_timeout,
                )
            return self._admission

    @property
    def prompt_builder(self) -> PromptBuilder:
        with self._lock:
            if self._builder is None:
                from .prompt import PromptBuilder

                self._builder = PromptBuilder(self.generator.tokenizer, system_prompt=self.system_prompt)
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

    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The ``k`` chunks that best match ``query``, with all their sources: hybrid (dense +
        BM25, fused; ``score`` on the cosine scale) unless the pipeline has ``hybrid=False``."""
        if not query or not query.strip():
            raise ConfigError("the query is empty")
        return self.store.search(query, k=k, embedder=self.embedder, hybrid=self.hybrid,
                                 lexical_weight=self.lexical_weight, fusion=self.fusion,
                                 candidates=max(k, self.fetch_k))

    # -- budgeted retrieval -------------------------------------------------------------------------

    def _prompt(
        self,
        question: str,
        *,
        context_tokens: int | None,
        max_new_tokens: int,
        history: Sequence[dict[str, str]] | None,
        retrieval_query: str | None,
    ) -> tuple[Prompt, BudgetPlan, dict[str, float]]:
        """Plan, retrieve, select and render: the prompt that fits, and how long each step took."""
        from .prompt import build_prompt

        if not isinstance(question, str) or not question.strip():
            raise ConfigError("the question is empty")
        if context_tokens is not None and context_tokens < 0:
            raise ConfigError(f"context_tokens must be ≥ 0, got {context_tokens}")
        timings: dict[str, float] = {}
        self.store  # noqa: B018 - a missing or damaged index fails fast, before any model loads
        t0 = time.perf_counter()
        builder = self.prompt_builder  # loads the generator first, so the plan sees its real size
        timings["load_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        plan = self.plan_for(max_new_tokens)
        timings["plan_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        builder = builder.with_history(history)
        fixed = builder.fixed_tokens(question)
        max_prompt = plan.max_prompt_tokens
        if fixed > max_prompt:
            raise BudgetError(
                f"the system prompt, history and question alone take {fixed} tokens but "
                f"{plan.model} on {plan.gpu_name} allows {max_prompt} prompt tokens per request "
                f"({plan.max_context_tokens} minus {max_new_tokens} reserved for the answer); "
                "shorten the question or history, lower max_new_tokens or concurrency, use a "
                "quantized/fp8 or offloaded KV cache, or a GPU with more memory",
                needed=fixed + max_new_tokens,
                available=plan.max_context_tokens,
            )
        if context_tokens is not None:
            max_prompt = min(max_prompt, fixed + context_tokens)
        hits = self.search(retrieval_query or question, k=self.fetch_k)
        timings["retrieve_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        prompt = build_prompt(
            question,
            hits,
            tokenizer=builder.tokenizer,
            max_prompt_tokens=max_prompt,
            builder=builder,
            order=self.order,
        )
        timings["select_s"] = time.perf_counter() - t0
        return prompt, plan, timings

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
        prompt, _, _ = self._prompt(
            question,
            context_tokens=context_tokens,
            max_new_tokens=max_new_tokens or self.max_new_tokens,
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
        new_tokens = max_new_tokens or self.max_new_tokens
        t_start = time.perf_counter()
        prompt, plan, timings = self._prompt(
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
            return _answer(nothing, prompt, plan, reserve, timings, context_tokens)

        if cancel is not None and cancel.is_set():
            return cancelled()
        t0 = time.perf_counter()
        try:
            reservation = self.admission.acquire(reserve, cancel=cancel)
        except RequestCancelled:
            timings["queue_s"] = time.perf_counter() - t0
            return cancelled()
        with reservation:  # released however generation ends
            timings["queue_s"] = time.perf_counter() - t0
            if cancel is not None and cancel.is_set():
                return cancelled()
            t0 = time.perf_counter()
            gen = self.generator.generate(
                prompt,
                max_new_tokens=new_tokens,
                cache=self.cache,
                kv_dtype=self.kv_dtype,
                on_text=on_text,
                cancel=cancel,
                **generate_options,
            )
            timings["generate_s"] = time.perf_counter() - t0
        timings["total_s"] = time.perf_counter() - t_start
        final = gen.prompt if getattr(gen, "prompt", None) is not None else prompt
        return _answer(gen, final, plan, reserve, timings, context_tokens)

    def stream(self, question: str, **options: Any) -> AnswerStream:
        """:meth:`ask`, as an iterator over the answer's text while it is generated; the
        :class:`Answer` is the stream's ``answer`` at the end. ``options`` are :meth:`ask`'s
        (but ``on_text`` and ``cancel``, which the stream owns). Breaking out of the loop or
        closing the stream cancels the generation."""
        return AnswerStream(self.ask, question, _stream_options(options))

    def astream(self, question: str, **options: Any) -> AnswerStream:
        """:meth:`stream` for asyncio (``async for piece in rb.astream(q)``): the model runs in a
        thread, pieces arrive through the running event loop, which is never blocked."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise ConfigError("astream() needs a running event loop (call it inside `async def`); "
                              "use stream() from synchronous code") from None
        return AnswerStream(self.ask, question, _stream_options(options), loop=loop)

    async def aask(self, question: str, **options: Any) -> Answer:
        """:meth:`ask` without blocking the event loop; cancelling the awaiting task cancels the
        generation (and frees its KV reservation)."""
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


def _stream_options(options: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(k for k in ("on_text", "cancel") if k in options)
    if taken:
        raise ConfigError(f"a stream delivers the text and cancels itself; drop {', '.join(taken)} "
                          "(use ask() to pass your own)")
    return options


_DONE = object()  # end-of-stream marker in an AnswerStream's queue


@dataclass(frozen=True)
class _Cancelled:
    """What :func:`_answer` needs of a generation that never started."""

    max_new_tokens: int
    text: str = ""
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
        self.answer: Answer | None = None
        self._error: BaseException | None = None
        self._cancel = threading.Event()
        self._loop = loop
        self._sync: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._async: asyncio.Queue[Any] | None = asyncio.Queue() if loop is not None else None
        self._ended = False
        self._thread = threading.Thread(target=self._run, args=(ask, question, options),
                                        name="rb-stream", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> None:
        if self._async is None:
            self._sync.put(item)
        else:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, item)  # type: ignore[union-attr]
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self._cancel.set()

    def _run(self, ask: Callable[..., Answer], question: str, options: dict[str, Any]) -> None:
        try:
            self.answer = ask(question, on_text=self._put, cancel=self._cancel, **options)
        except BaseException as e:  # handed to the iterating thread, raised there
            self._error = e
        finally:
            self._put(_DONE)

    def _item(self, item: Any) -> str:
        if item is _DONE:
            self._ended = True
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            raise StopIteration
        return str(item)

    @property
    def error(self) -> BaseException | None:
        """An error the request raised that the iteration did not (it was left before the end)."""
        return self._error

    @property
    def cancelled(self) -> bool:
        """Whether the stream was left before its end (the generation was told to stop)."""
        return self._cancel.is_set()

    # -- sync --

    def __iter__(self) -> Iterator[str]:
        # A generator, not ``self``: a ``for`` loop left by ``break`` or an exception drops it,
        # and its ``finally`` cancels the generation then and there.
        if self._async is not None:
            raise ConfigError("this stream came from astream(): iterate it with `async for`")
        try:
            while True:
                try:
                    yield self.__next__()
                except StopIteration:
                    return
        finally:
            self.close()

    def __next__(self) -> str:
        if self._async is not None:
            raise ConfigError("this stream came from astream(): iterate it with `async for`")
        if self._ended:
            raise StopIteration
        return self._item(self._sync.get())

    def close(self) -> None:
        """Stop the generation (if it still runs) and wait for its thread to end."""
        if not self._ended:
            self._cancel.set()
        self._thread.join()
        self._ended = True

    def __enter__(self) -> AnswerStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- async --

    def __aiter__(self) -> AsyncIterator[str]:
        if self._async is None:
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
        if self._async is None:
            raise ConfigError("this stream came from stream(): iterate it with `for`")
        if self._ended:
            raise StopAsyncIteration
        try:
            return self._item(await self._async.get())
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """Stop the generation (if it still runs) and wait for its thread without blocking the loop."""
        if not self._ended:
            self._cancel.set()
        await asyncio.to_thread(self._thread.join)
        self._ended = True

    async def __aenter__(self) -> AnswerStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


def _answer(gen: Any, prompt: Prompt, plan: BudgetPlan, reserved: int, timings: dict[str, float],
            context_cap: int | None) -> Answer:
    sel = prompt.selection
    sources = []
    for passage in prompt.passages:
        src = passage.sources[0].to_dict() if passage.sources else {}
        src["score"] = round(float(passage.score), 6)
        src["chunk_ids"] = list(passage.chunk_ids)
        src["duplicates"] = [s.to_dict() for s in passage.sources[1:]]
        sources.append(src)
    budget = {
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "kv_capacity_tokens": plan.kv_capacity_tokens,
        "max_context_tokens": plan.max_context_tokens,
        "max_prompt_tokens": plan.max_prompt_tokens,
        "context_tokens_allowed": sel.tokens_allowed,
        "context_tokens_used": sel.tokens_used,
        "context_tokens_cap": context_cap,
        "fixed_prompt_tokens": prompt.fixed_tokens,
        "prompt_tokens": prompt.n_tokens,
        "max_new_tokens": getattr(gen, "max_new_tokens", None) or plan.max_new_tokens,
        "new_tokens": getattr(gen, "new_tokens", None),
        "kv_tokens_reserved": reserved,
        "limited_by": plan.limited_by,
        "fill": round(sel.fill, 4),
    }
    report = {
        "budget": budget,
        "plan": plan.to_dict(),
        "selection": [p.to_dict() | {"text": None} for p in prompt.passages],
        "dropped": [d.to_dict() for d in sel.dropped],
        "oom_steps": [s.to_dict() if hasattr(s, "to_dict") else s for s in getattr(gen, "oom_steps", ())],
        "timings": {k: round(v, 4) for k, v in timings.items()},
    }
    return Answer(
        text=str(getattr(gen, "text", "")).strip(),
        sources=sources,
        report=report,
        finish_reason=str(getattr(gen, "finish_reason", "stop")),
    )


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
    width = max(len(k) for k, _ in rows)
    lines = ["Budget", *(f"  {k.ljust(width)}  {v}" for k, v in rows)]
    sel = report.get("selection", [])
    lines.append(f"Context: {len(sel)} passage(s)")
    for i, s in enumerate(sel, 1):
        src = (s.get("sources") or [{}])[0]
        page = f" p.{src.get('page')}" if src.get("page") else ""
        lines.append(f"  [{i}] {src.get('path', '?')}{page}  score {s.get('score', 0):.3f}  "
                     f"{s.get('cost', 0)} tokens{'  (truncated)' if s.get('truncated') else ''}")
    dropped = report.get("dropped", [])
    if dropped:
        counts: dict[str, int] = {}
        for d in dropped:
            counts[d["reason"]] = counts.get(d["reason"], 0) + 1
        lines.append("Dropped: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    for step in report.get("oom_steps", []):
        lines.append(f"OOM step: {step}")
    t = report.get("timings", {})
    if t:
        lines.append("Timings: " + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in t.items()))
    return "\n".join(lines)
