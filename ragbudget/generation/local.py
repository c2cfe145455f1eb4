"""The local transformers generator as a :class:`~ragbudget.generation.backend.Backend`: ragbudget
plans its memory, paces it by its measured speed and batches its requests.

A served engine holds its own memory and reports it; a local model's memory is ragbudget's to
plan. :class:`LocalBackend` keeps that plan (:func:`~ragbudget.memory.budget.plan_budget`, per
reserved answer length, capped for time by :class:`~ragbudget.generation.pacing.Pacing`) and
answers :meth:`~LocalBackend.capacity` with it, so the pipeline budgets a local request by the
same one record it reads from an engine (``Capacity.plan`` set). Admission control learns the
memory a request pins beside its KV cache and the measured speed from :meth:`LocalBackend.tune`.

>>> backend = LocalBackend(Generator(), gpu="24GiB")             # doctest: +SKIP
>>> backend.capacity(max_new_tokens=256).plan.max_context_tokens  # doctest: +SKIP
>>> backend.generate("Hi", max_new_tokens=8).finish_reason        # doctest: +SKIP
'length'
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..settings import MemorySettings
from .backend import Capacity, RenderedPrompt, Sampling, prompt_messages, render_overhead
from .pacing import Pacing

if TYPE_CHECKING:  # pragma: no cover - generate.py and batching.py load at first use
    from contextlib import AbstractContextManager

    from ..memory.admission import AdmissionController
    from ..memory.budget import BudgetPlan
    from ..prompt.prompt import PromptBuilder
    from .backend import PromptInput
    from .batching import Batcher
    from .generate import Generation, Generator

__all__ = ["LocalBackend", "local_backend", "local_generator", "paged_tokens_within"]

log = logging.getLogger(__name__)


def local_backend(generator: Generator | None, *, model: str | None, memory: MemorySettings) -> LocalBackend:
    """The backend a pipeline generates on when it names no engine: ``generator`` (or one built
    for ``model`` on first use), planned by ``memory``'s settings. Nothing loads here."""
    return LocalBackend(
        generator,
        model=model,
        gpu=memory.gpu,
        concurrency=memory.concurrency,
        max_new_tokens=memory.max_new_tokens,
        cache=memory.cache,
        kv_dtype=memory.kv_dtype,
        utilization=memory.utilization,
        ttft_target=memory.ttft_target,
    )


def local_generator(backend: object) -> Generator | None:
    """The local generator ``backend`` runs (a :class:`LocalBackend`'s, or a given backend's
    ``generator`` attribute), or ``None`` for one that generates elsewhere."""
    gen: Generator | None = getattr(backend, "generator", None)  # LocalBackend.generator among them
    return gen


class LocalBackend:
    """The local transformers :class:`~ragbudget.generation.generate.Generator` as a
    :class:`~ragbudget.generation.backend.Backend`.

    ``generator``: the generator to run; ``None`` builds one for ``model`` (a hub id or folder;
    ``None``: the packaged SmolLM2) on first use. Counts are exact (the model's own tokenizer and
    chat template). ``capacity(max_new_tokens=…)``
    is the memory plan (:meth:`plan`) for ``gpu``/``concurrency``/``cache``/``kv_dtype``
    (``plan_options`` — ``utilization``, ``weight_dtype``, … — pass through to
    :func:`~ragbudget.memory.budget.plan_budget`), with the plan's sources. ``ttft_target``: the
    time-to-first-token target the plan is capped for (``None``: the device's default, 0: none;
    see :class:`~ragbudget.generation.pacing.Pacing`). One model on one device: a ``gpu`` naming
    several is refused.

    ``batching`` (default on where the model supports it): concurrent ``generate`` calls share
    forward passes through one :class:`~ragbudget.generation.batching.Batcher` (transformers'
    continuous batching over a paged KV cache); ``False`` runs one ``generate`` per call. The
    paged cache holds ``batch_kv_tokens`` tokens (default: the plan's KV capacity, on a CPU at
    most ``concurrency`` windows of the model, since it is allocated up front), and
    ``capacity()`` then reports that cache, block-exact. Calls that need what batching does not
    do (a static, offloaded or quantized cache, a KV dtype, the OOM ladder, a custom streamer)
    run unbatched.
    """

    kind = "local"

    def __init__(
        self,
        generator: Generator | None = None,
        *,
        model: str | None = None,
        gpu: Any = None,
        concurrency: int = MemorySettings.concurrency,
        max_new_tokens: int = MemorySettings.max_new_tokens,
        cache: str = MemorySettings.cache,
        kv_dtype: str | None = None,
        batching: bool | None = None,
        batch_kv_tokens: int | None = None,
        ttft_target: float | None = None,
        **plan_options: Any,
    ) -> None:
        from ..gpus import gpu_count
        from ..settings import check_int

        if batching not in (None, True, False):
            raise ConfigError(f"batching must be True, False or None (auto); got {batching!r}")
        if batch_kv_tokens is not None and (
            isinstance(batch_kv_tokens, bool) or not isinstance(batch_kv_tokens, int) or batch_kv_tokens < 1
        ):
            raise ConfigError(f"batch_kv_tokens must be an integer >= 1; got {batch_kv_tokens!r}")
        check_int("max_new_tokens", max_new_tokens, 1)
        if gpu_count(gpu) > 1:
            # A plan over several devices would promise memory that the one model never gets.
            raise ConfigError(
                f"gpu={gpu!r} names {gpu_count(gpu)} GPUs, but a local generator runs on one: pass one "
                "GPU (e.g. 'H100'), or plan tensor-parallel serving with `ragbudget budget --gpu 2xH100` "
                "and generate on that engine (engine=URL)"
            )
        # Built on first use when not given: constructing this backend (a pipeline does it for
        # its settings) imports no generation code, so `ragbudget search` never loads it.
        self._generator = generator
        self._model = model
        self.max_new_tokens = max_new_tokens
        self.cache, self.kv_dtype = cache, kv_dtype
        self.batching, self.batch_kv_tokens = batching, batch_kv_tokens
        self.pacing = Pacing(ttft_target)
        self._batcher: Batcher | None = None
        self._batch_lock = threading.Lock()
        self._lock = threading.RLock()
        self._plans: dict[tuple[int, bool], BudgetPlan] = {}
        self._plan_args: dict[str, Any] = {
            "gpu": gpu,
            "concurrency": concurrency,
            "cache": cache,
            "kv_dtype": kv_dtype,
            "tensor_parallel": 1,
            **plan_options,
        }

    def __repr__(self) -> str:
        return f"LocalBackend({self.generator!r})"

    @property
    def generator(self) -> Generator:
        """The local generator (``model=``, the packaged SmolLM2 by default), built on first use;
        its model loads later still, on its own first use."""
        with self._lock:
            if self._generator is None:
                from .generate import Generator

                self._generator = Generator(self._model)
            return self._generator

    @property
    def model_id(self) -> str:
        return str(self.generator.model_ref.id)

    # -- where it runs: here ------------------------------------------------------------------------
    #: No engine elsewhere: nothing for the server to watch, nothing sent, nothing to fetch ahead
    #: (the tokenizer counts in this process).
    url = ""

    def probing(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def requests_sent(self) -> Mapping[str, int] | None:
        return None

    def prefetch(self, texts: Sequence[str], chats: Sequence[Sequence[Mapping[str, str]]] = ()) -> None:
        return None

    # -- the model --------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Load the model, plan for it, measure its speed (once per model and machine: cached)
        and start the batching loop, in that order: the speed probe runs before the loop's
        thread exists (its OpenMP workers would slow the probe, :mod:`ragbudget.generation.batching`),
        and the paged cache is allocated before the first request, which admission already
        counts as taken."""
        gen = self.generator
        gen.warm_up()
        plan = self.plan()
        if self.pacing.entry is None:
            self.pacing.entry = self.pacing.measure(gen, plan.model)
        if self.batched:
            self.generate("warm-up", max_new_tokens=1)
            log.info("batched generation: %s", self.capacity().kv_total_source)

    def close(self) -> None:
        """Stop the batching worker, if one runs (a later ``generate`` starts it again)."""
        if self._batcher is not None:
            self._batcher.close()

    # -- counting -------------------------------------------------------------------------------
    def render(self, messages: Sequence[Mapping[str, str]]) -> RenderedPrompt:
        """The prompt as the generator will read it (:func:`~ragbudget.tokens.render_chat`: the
        model's own chat template, or the plain layout of a model without one), counted in its own
        tokenizer: exact either way."""
        from ..tokens import render_chat

        msgs = tuple(prompt_messages(list(messages)))
        text, _folded = render_chat(self.generator.tokenizer, msgs)
        template = getattr(getattr(self.generator.tokenizer, "hf", self.generator.tokenizer), "chat_template", None)
        return RenderedPrompt(
            messages=msgs,
            n_tokens=self.generator.token_counter.count(text),
            exact=True,
            source=f"chat template of {self.model_id}"
            if template
            else f"{self.model_id}: plain layout (no chat template)",
            text=text,
        )

    def count(self, texts: Sequence[str]) -> list[int]:
        counter = self.generator.token_counter
        return [counter.count(t) for t in texts]

    def template_overhead(self, system_prompt: str | None = None) -> int:
        return render_overhead(self, system_prompt)

    def prompt_builder(self, system_prompt: str | None = None) -> PromptBuilder:
        """A builder over the model's own tokenizer: prompts are rendered to the token ids the
        generator runs (with the plain ``System:/User:`` layout when the tokenizer has no chat
        template), every part counted exactly."""
        from ..prompt.prompt import PromptBuilder

        return PromptBuilder(self.generator.tokenizer, system_prompt=system_prompt)

    # -- the plan -------------------------------------------------------------------------------
    def plan(self, max_new_tokens: int | None = None) -> BudgetPlan:
        """The memory plan for requests that reserve ``max_new_tokens`` for the answer (default:
        this backend's), capped by the time-to-first-token target where one applies. A loaded
        generator is planned with its real weights, dtype and attention; before that, from its
        config. Cached per value, plans made before loading kept apart from those after."""
        n = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        gen = self.generator
        with self._lock:
            key = (n, bool(gen.loaded))
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plans[key] = self.pacing.cap(gen, self._memory_plan(n))
            return plan

    def _memory_plan(self, max_new_tokens: int) -> BudgetPlan:
        """:meth:`plan` before any time cap."""
        from ..memory.budget import plan_budget

        gen = self.generator
        module = gen.model if gen.loaded else None
        # Before loading, the model as it was given (None: the packaged default); a stand-in
        # generator (tests, wrappers) names none and plans for the default model.
        model = module if module is not None else getattr(gen, "spec", None)
        return plan_budget(
            model,
            config=gen.config if module is not None else None,
            max_new_tokens=max_new_tokens,
            # The activations of the attention the loaded model really runs (eager materializes
            # the L×L scores); sdpa before it is loaded.
            attn_implementation=_attn_in_use(module),
            **self._plan_args,
        )

    def capacity(self, *, max_new_tokens: int | None = None, fresh: bool = False) -> Capacity:
        """The plan for ``max_new_tokens`` as the one record every backend answers: the window of
        one request is the plan's (memory, the model's window or time, whichever binds), the KV
        figures the plan's, or the paged cache's once the batching decision is made. Always
        current (``fresh`` changes nothing: nothing is read from elsewhere)."""
        plan = self.plan(max_new_tokens)
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
            max_context_tokens=plan.max_context_tokens,
            max_context_source=f"{src}, limited by {plan.limited_by}",
            kv_tokens_total=kv,
            kv_total_source=kv_src,
            kv_tokens_free=kv,
            kv_free_source=f"{kv_src}: free when planned",
            max_concurrent=plan.max_concurrency,
            max_concurrent_source=src,
            engine_kind=self.kind,
            notes=tuple(plan.notes),
            plan=plan,
            device=Pacing.device(self.generator),
            speed=self.pacing.entry,
        )

    # -- admission --------------------------------------------------------------------------------
    def tune(self, admission: AdmissionController) -> bool:
        """Once the model is loaded: count each request's KV *and* its own activation peak
        against the memory left beside the weights (and the paged cache, when batched), and its
        time by the measured prefill and decode speed. False before."""
        gen = self.generator
        if not Pacing.loaded(gen):
            return False
        batcher = self.batcher
        self.pacing.tune(admission, gen, self.plan(), paged=batcher.layout if batcher is not None else None)
        return True

    def refresh_speed(self, *, idle: Callable[[], bool], recheck_s: float) -> bool:
        """Measure the speed again when the one in use was measured on a busy host
        (``provisional``), at most every ``recheck_s`` seconds, only while ``idle()`` and after
        stopping the idle batching loop (whose threads would slow the probe); the plans then
        follow the new speed. True when it measured."""
        if not self.pacing.due(recheck_s) or not idle():
            return False
        if not self.pacing.remeasure(self.generator, self.plan(), before=self.close):
            return False
        with self._lock:
            self._plans.clear()  # the time cap follows the new speed
        return True

    # -- batching -------------------------------------------------------------------------------
    @property
    def batcher(self) -> Batcher | None:
        """The :class:`~ragbudget.generation.batching.Batcher` calls share (loads the model), or
        None when batching is off or the model cannot be batched (with ``batching=True``, that
        is a :class:`~ragbudget.errors.ConfigError`)."""
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
                    plan = self._memory_plan(self.max_new_tokens)
                    tokens = plan.kv_capacity_tokens
                    if not self.generator.device.startswith(("cuda", "xpu", "mps")):
                        # Host RAM plans are large and the paged cache is zeroed up front (it
                        # is all resident): hold `concurrency` full windows, not all of RAM.
                        tokens = min(tokens, max(1, plan.concurrency) * plan.model_max_tokens)
                    # The plan's KV bytes are the most the paged cache may take: whole pages, and
                    # the paged layout's own bytes per token (it can exceed the plan's), so the
                    # activations the plan reserved beside it still fit.
                    tokens = paged_tokens_within(
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

    # -- generation -----------------------------------------------------------------------------
    def generate(
        self,
        prompt: PromptInput | Sequence[int],
        *,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop: Sequence[str] | None = None,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        **options: Any,
    ) -> Generation:
        """:meth:`Generator.generate <ragbudget.generation.generate.Generator.generate>` with this
        backend's cache kind and KV dtype; ``options`` are the local generator's own extras
        (``do_sample``, ``top_k``, ``oom_ladder``), which no served engine takes."""
        s = sampling or Sampling()
        if isinstance(prompt, RenderedPrompt):
            prompt = list(prompt.token_ids) if prompt.token_ids else list(prompt.messages)
        # The local generator's extras that batching also honours; any other one (the OOM
        # ladder, a custom streamer) takes the unbatched path.
        batcher = self.batcher if set(options) <= {"do_sample", "top_k"} else None
        if batcher is not None:
            return batcher.generate(
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


def _attn_in_use(model: Any) -> str:
    """The attention implementation a loaded transformers model runs (``sdpa`` when unknown)."""
    cfg = getattr(model, "config", None)
    impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
    return str(impl) if isinstance(impl, str) and impl else "sdpa"


def paged_tokens_within(generator: Generator, tokens: int, budget_bytes: int, page_size: int = 32) -> int:
    """The most tokens, in whole pages of ``page_size`` (at least one page), up to ``tokens``,
    whose paged cache (:func:`~ragbudget.memory.kvcache.paged_cache_layout`, exact) takes at most
    ``budget_bytes``: how :class:`LocalBackend` sizes its batcher from the memory plan, and
    what a caller building a :class:`~ragbudget.generation.batching.Batcher` itself may pass as
    its ``kv_tokens``."""
    from ..memory.kvcache import paged_cache_layout
    from .batching import dtype_name

    model = generator.model
    blocks = max(1, tokens // page_size)
    while blocks > 1:
        layout = paged_cache_layout(model.config, num_blocks=blocks, page_size=page_size, kv_dtype=dtype_name(model))
        if layout.total_bytes <= budget_bytes:
            break
        blocks = max(1, min(blocks - 1, int(blocks * budget_bytes / max(1, layout.total_bytes))))
    return blocks * page_size
