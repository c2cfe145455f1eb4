"""Batched generation: requests running at once share forward passes.

:class:`Batcher` owns one transformers ``ContinuousBatchingManager`` over a
:class:`~ragbudget.generation.generate.Generator`'s model: a background thread that puts every running
request into each forward pass (new prompts are prefilled while others decode) over a paged KV
cache allocated once, whose size :func:`ragbudget.memory.kvcache.paged_cache_layout` gives to the byte.
Each caller's thread blocks in :meth:`Batcher.generate` on a queue of its own, so many threads
calling it at once (the server's) are batched without knowing it.

What stays per request:

* ``max_new_tokens`` and EOS — the manager's own per-request limits;
* stop strings, and a line produced three times in a row
  (:data:`~ragbudget.generation.decoding.REPEATED_LINE_STOP`) — checked here on the decoded text after each
  token; the first one ends the answer (``finish_reason="stop"``, the text cut before it, a
  repeated line kept once) and the request is cancelled in the manager, which frees its blocks
  at its next step;
* the model's ``generation_config`` — its stop tokens, and its repetition penalty, applied per
  request by the row processor below;
* sampling and seeds — one logits processor samples each sampled request's row with that
  request's own ``torch.Generator`` (temperature, top-k, top-p as in
  :meth:`Generator.generate <ragbudget.generation.generate.Generator.generate>`) and leaves only the drawn
  token, which the manager's greedy argmax then takes; greedy rows are left alone. A seed
  therefore gives the same draws whatever else shares the batch;
* streaming (``on_text``) and cancellation (``cancel``, a ``threading.Event`` looked at every
  :attr:`Batcher.POLL_S` seconds: a client that leaves returns at once and its blocks are freed).

>>> b = Batcher(Generator(), kv_tokens=8192)                       # doctest: +SKIP
>>> b.generate("Hi", max_new_tokens=8).finish_reason               # doctest: +SKIP
'length'
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import BudgetError, ConfigError, ModelError
from ..settings import MemorySettings

if TYPE_CHECKING:  # pragma: no cover - torch and transformers load at first use
    from ..memory.kvcache import PagedCacheLayout
    from .generate import Generation, Generator

__all__ = ["Batcher", "batching_unsupported", "in_own_thread"]

log = logging.getLogger(__name__)

#: The logits-processor keyword that carries a request's sampler slot (-1: greedy).
_SLOT = "ragbudget_slot"
#: Attention implementations continuous batching runs without switching the model's own (an
#: eager model would be switched to ``paged|eager``, which plain ``generate`` cannot use).
_ATTN_OK = ("sdpa", "flash_attention_2", "flash_attention_3", "paged|sdpa")


def batching_unsupported(generator: Generator) -> str | None:
    """Why ``generator``'s model cannot be batched (None when it can). Loads the model."""
    from .generate import Generator

    if not isinstance(generator, Generator):  # a stand-in with no transformers model behind it
        return f"{type(generator).__name__} is not a ragbudget Generator"
    model = generator.model
    if model is None:  # a stand-in (the CLI tests swap ragbudget.generation.generate.Generator for one)
        return f"{type(generator).__name__} has no transformers model to batch"
    attn = str(getattr(model.config, "_attn_implementation", None))
    if attn not in _ATTN_OK:
        return (
            f"continuous batching needs sdpa or flash attention; the model uses {attn!r} "
            "(load it with attn_implementation='sdpa')"
        )
    if not callable(getattr(model, "init_continuous_batching", None)):
        return "this transformers version has no continuous batching (5.x has)"
    import dataclasses

    from transformers import ContinuousBatchingConfig

    # Before pages (transformers 5.17 has ``block_size``), the paged cache is laid out otherwise
    # than paged_cache_layout computes to the byte, and Batcher's config would be refused at
    # warm-up, so that `ragbudget serve` did not start: such a version generates unbatched.
    if "page_size" not in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}:
        import transformers

        return (
            f"transformers {transformers.__version__}'s continuous batching has no page_size (its "
            "paged cache is laid out otherwise); upgrade transformers to batch"
        )
    from ..memory.kvcache import paged_cache_layout

    try:
        paged_cache_layout(model.config, num_blocks=1, kv_dtype=dtype_name(model))
    except (ConfigError, ModelError) as exc:
        return str(exc)
    return None


# -- which thread runs the model ------------------------------------------------------------------
# torch on a CPU parallelizes each op with OpenMP (GNU libgomp in the PyPI wheels), and libgomp
# keeps a pool of worker threads for every thread that has run a parallel region, for that
# thread's whole life. Once the pools together hold more threads than the host has cores, libgomp
# stops letting idle workers spin between regions (its "throttled" spin, 100 turns), so every op
# of a forward pass waits for a sleeping worker to wake and the caller does most of the work
# alone. Measured on this project's 2-core CPU (8 requests of 1,200 tokens, 48 new tokens each):
# the batching loop took 58-70 s after the main thread had run one generate, against 42-47 s when
# no other thread had, its OpenMP worker doing 3,300 against 3,900-4,400 ticks of the loop's
# 4,100-4,700; and one request at a time took ~25% longer while a batcher's loop was alive.
# A thread that exits takes its pool with it: model work outside the batching loop (the speed
# probe at warm-up, a re-measure) runs in a thread of its own that ends when it is done.


def in_own_thread(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a new thread that ends when it returns (its value, or its
    exception raised here), so the OpenMP worker pool the call makes goes with it (see above)."""
    from concurrent.futures import ThreadPoolExecutor

    # Leaving the block joins the executor's one thread: the pool's owner is gone on return.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragbudget-apart") as one:
        return one.submit(fn, *args, **kwargs).result()


# -- stopping at exit ------------------------------------------------------------------------------
# The manager's loop is a daemon thread that spends its life inside torch with the GIL released.
# A process that exits while that loop is still in a step (the answer has ended, but the loop has
# not yet seen the request's cancel, or runs another request) has its C++ runtime torn down under
# the running op: libstdc++ destroys a joinable thread and calls std::terminate ("terminate called
# without an active exception", exit status 134). So every batcher with a running loop is stopped
# (its loop joined) by an atexit hook, which runs before the interpreter finalizes and before any
# static destructor; :meth:`Batcher.close` stops it earlier for callers that close what they open.
_RUNNING: weakref.WeakSet[Batcher] = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for batcher in list(_RUNNING):
        batcher.close()


def dtype_name(model: Any) -> str:
    return str(model.dtype).removeprefix("torch.")


# -- attention per request ------------------------------------------------------------------------
# transformers' continuous batching packs every running request's new tokens into one row and, with
# SDPA, attends that row to the keys of *all* of them through one dense block-diagonal mask: each
# step costs (tokens in the step) x (keys of every request in it), so work grows with the square of
# the batch. Flash attention's varlen kernel avoids that by attending sequence by sequence, but it
# needs CUDA. Measured on this project's 2-core CPU with 1,200-token prompts, 8 requests batched
# that way took 102 s against 60 s one at a time (bench/batching.py --context-tokens 1200). What
# flash varlen does is done here with one SDPA call per request: the same arithmetic as one
# request alone, so a batch costs the sum of its requests' attention, not the square.

#: Keyword arguments only continuous batching passes to an attention function.
_CB_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "read_index", "write_index")
_installed: dict[str, Any] = {}


def per_request_sdpa(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' ``"sdpa"`` attention, except in a continuous-batching step: there each
    request's queries attend only its own keys (bottom-right causal, and its sliding window if
    the layer has one), one ``scaled_dot_product_attention`` per request, like flash attention's
    varlen kernel. Anything else goes to transformers' own SDPA function, unchanged."""
    if (
        not all(kwargs.get(k) is not None for k in _CB_KWARGS)
        or query.shape[0] != 1
        or kwargs.get("softcap") is not None
    ):  # SDPA's own refusal of softcap stands
        # transformers' own attention function: untyped at that seam, its (output, weights) as is.
        own: tuple[Any, None] = _installed["sdpa"](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return own
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    starts_q = kwargs["cu_seq_lens_q"].tolist()
    starts_k = kwargs["cu_seq_lens_k"].tolist()
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    outs = []
    for i in range(len(starts_q) - 1):
        q = query[:, :, starts_q[i] : starts_q[i + 1]]
        q_len = q.shape[2]
        if q_len == 0:  # a padding slot
            continue
        k = key[:, :, starts_k[i] : starts_k[i + 1]]
        v = value[:, :, starts_k[i] : starts_k[i + 1]]
        k_len = k.shape[2]
        # The queries are the last q_len positions of the k_len keys (chunked prefill or decode).
        mask = None
        # Built on the queries' device: a mask left on the CPU fails every CUDA step
        # ("attn_bias is on cpu"), as the first GPU run of the batched server showed.
        if window is not None and k_len > window:
            rows = torch.arange(k_len - q_len, k_len, device=query.device).unsqueeze(1)
            cols = torch.arange(k_len, device=query.device).unsqueeze(0)
            mask = (cols <= rows) & (cols > rows - window)
        elif 1 < q_len < k_len:
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
        outs.append(sdpa(q, k, v, attn_mask=mask, is_causal=mask is None and q_len > 1, scale=scaling, enable_gqa=gqa))
    out = torch.cat(outs, dim=2) if outs else query[:, :, :0]
    # Pad slots (if any) keep the query row count the model expects.
    if out.shape[2] < query.shape[2]:
        out = torch.cat([out, query.new_zeros(*out.shape[:2], query.shape[2] - out.shape[2], out.shape[3])], dim=2)
    return out.transpose(1, 2).contiguous(), None


def _install_per_request_sdpa() -> None:
    """Route transformers' ``"sdpa"`` name to :func:`per_request_sdpa`, once per process.

    The name is looked up at every forward pass, so this reaches the running model; outside a
    continuous-batching step the original function runs, so other models and the unbatched
    path see no change."""
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching import input_outputs
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if "sdpa" not in _installed:
        _installed["sdpa"] = ALL_ATTENTION_FUNCTIONS["sdpa"]
        AttentionInterface.register("sdpa", per_request_sdpa)
        # For SDPA, continuous batching allocates one dense additive mask of (the step's tokens)
        # × (every cached token + the step's tokens) in the model's dtype, up front and for the
        # life of the loop: 2,048 × 1.33M tokens × 2 B = 5.4 GB beside a 43 GB paged cache of
        # Llama-3.2-1B on an H200, eight times the cache itself on a small one, and none of it in
        # the plan. per_request_sdpa never reads it (each request's mask is built from its own
        # lengths), so the batch processor is told none is needed, as for flash attention.
        needed = input_outputs.attn_mask_is_needed
        _installed["attn_mask_is_needed"] = needed
        input_outputs.attn_mask_is_needed = lambda config: needed(config) and config._attn_implementation != "sdpa"


class _Slot:
    """One sampled request's draw settings and its private generator (made on the scores'
    device at the first draw: multinomial needs a generator there)."""

    def __init__(self, seed: int, temperature: float | None, top_p: float | None, top_k: int | None) -> None:
        self.seed, self.temperature, self.top_p, self.top_k = seed, temperature, top_p, top_k
        self.rng: Any = None


def _row_sampler(slots: dict[int, _Slot], repetition_penalty: float = 1.0) -> Any:
    """A continuous-batching logits-processor list whose one processor samples each sampled
    request's row with its own generator (see the module docstring), after applying the model's
    ``repetition_penalty`` (its ``generation_config``'s, as ``generate`` applies it: each token
    of the prompt or the answer so far has its logit divided by it if positive, multiplied if
    negative) to every row. transformers drops its own repetition penalty from continuous
    batching, which keeps no per-request token history for it; the requests here have theirs."""
    import torch
    from transformers import LogitsProcessorList
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
        ContinuousBatchingLogitsProcessorList,
    )

    from .decoding import draw

    class _RowSampler(ContinuousBatchingLogitsProcessor):
        supported_kwargs = {_SLOT: int}  # instance attributes in the base class, shared here
        ignored_kwargs = ()

        def __init__(self) -> None:
            self.seen: list[list[int]] = []  # per row of the next call: its prompt and answer so far

        def fill_defaults(self, int32_tensor: Any) -> None:
            int32_tensor.fill_(-1)

        def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> Any:
            if repetition_penalty != 1.0:
                self.seen = [r.state.initial_tokens + r.state.generated_tokens for r in requests_with_new_token]
            return torch.tensor(
                [r.state.logit_processor_kwargs.get(_SLOT, -1) for r in requests_with_new_token], dtype=torch.int32
            )

        def __call__(self, scores: Any, tensor_arg: Any) -> Any:
            if repetition_penalty != 1.0:
                for row, seen in enumerate(self.seen[: scores.size(0)]):
                    if seen:
                        ids = torch.tensor(sorted(set(seen)), dtype=torch.long, device=scores.device)
                        picked = scores[row, ids]
                        scores[row, ids] = torch.where(
                            picked < 0, picked * repetition_penalty, picked / repetition_penalty
                        )
            for row, n in enumerate(tensor_arg[: scores.size(0)].tolist()):
                slot = slots.get(n) if n >= 0 else None
                if slot is None:  # greedy, or a request that left (its token is dropped)
                    continue
                if slot.rng is None:
                    slot.rng = torch.Generator(device=scores.device)
                    slot.rng.manual_seed(slot.seed % 2**64)
                choice = draw(scores[row : row + 1], slot.rng, slot.temperature, slot.top_p, slot.top_k)
                only = torch.full_like(scores[row], float("-inf"))
                scores[row] = only.scatter(-1, choice[0], 0.0)
            return scores

    processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([_RowSampler()]))
    # transformers counts argument rows only for the processors it converts itself.
    processors.tensors_required = 1
    return processors


class Batcher:
    """Continuous batching of concurrent :meth:`generate` calls over one local model.

    ``kv_tokens``: tokens of KV the paged cache holds for all running requests together (rounded
    up to whole blocks of ``page_size`` tokens and whole sectors: :attr:`layout`); a request
    longer than that is refused, others wait inside the manager for free blocks.
    ``max_batch_tokens``: tokens one forward pass takes at most (a long prompt is prefilled in
    chunks of it), which bounds the activation memory of a step and how long a step keeps the
    running requests' next tokens waiting. 2,048, vLLM's long-standing chunked-prefill default:
    on this project's 2-core CPU, 8 requests of 1,200 tokens took 37 s with it against 41-44 s
    with 512 (fewer, larger prefill steps). Admission reserves each request's activations for a
    prefill of its whole prompt, which covers any chunk of it.
    The manager starts at the first :meth:`generate` and runs until :meth:`close`. While it
    runs, forward passes in another long-lived thread (a plain ``Generator.generate`` there)
    slow both it and the loop on a CPU: run such work through :func:`in_own_thread`, or close
    the batcher first (see "which thread runs the model" above).
    """

    #: Seconds between looks at a request's ``cancel`` event while it waits for tokens.
    POLL_S = 0.02

    def __init__(
        self, generator: Generator, *, kv_tokens: int, page_size: int = 32, max_batch_tokens: int = 2048
    ) -> None:
        for name, value, low in (
            ("kv_tokens", kv_tokens, 1),
            ("page_size", page_size, 4),
            ("max_batch_tokens", max_batch_tokens, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}; got {value!r}")
        self.generator = generator
        self.kv_tokens, self.page_size, self.max_batch_tokens = kv_tokens, page_size, max_batch_tokens
        self._lock = threading.Lock()
        self._manager: Any = None
        self._routes: dict[str, queue.Queue[Any]] = {}
        self._slots: dict[int, _Slot] = {}
        self._ids = itertools.count()
        self._layout: PagedCacheLayout | None = None

    def __repr__(self) -> str:
        state = "running" if self.running else "idle"
        return f"Batcher({self.generator!r}, kv_tokens={self.kv_tokens}, {state})"

    @property
    def running(self) -> bool:
        return self._manager is not None and self._manager.is_running()

    @property
    def active(self) -> int:
        """Requests in the batch now, generating or waiting there for cache blocks (0 before the
        first :meth:`generate` and after :meth:`close`). A request cancelled or finished leaves
        it within a step: what a caller draining the batcher waits on."""
        manager = self._manager
        if manager is None:
            return 0
        scheduler = manager.batch_processor.scheduler  # transformers' continuous-batching scheduler
        return len(scheduler.active_requests) + len(scheduler.waiting_requests)

    @property
    def layout(self) -> PagedCacheLayout:
        """The paged cache this batcher allocates (exact bytes, blocks and token capacity)."""
        if self._layout is None:
            from ..memory.kvcache import paged_cache_layout

            model = self.generator.model
            self._layout = paged_cache_layout(
                model.config,
                num_blocks=math.ceil(self.kv_tokens / self.page_size),
                page_size=self.page_size,
                kv_dtype=dtype_name(model),
            )
        return self._layout

    @property
    def cache_tensor(self) -> Any:
        """The paged cache's one tensor while the manager runs (None otherwise)."""
        proc = getattr(self._manager, "batch_processor", None)
        return getattr(getattr(proc, "cache", None), "cache_tensor", None)

    @property
    def step_buffer_bytes(self) -> int:
        """Bytes of the per-step tensors the loop holds beside the paged cache (token ids,
        positions, indices, outputs; 0 while no manager runs): sized by ``max_batch_tokens``, not
        by the cache, since no dense attention mask is kept (see :func:`_install_per_request_sdpa`)."""
        import torch

        proc = getattr(self._manager, "batch_processor", None)
        io = getattr(proc, "inputs_and_outputs", None)
        if io is None:
            return 0
        total = 0
        for value in vars(io).values():
            tensors = value.values() if isinstance(value, dict) else [value]
            total += sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
        return total

    # -- the manager ----------------------------------------------------------------------------
    def _start(self) -> Any:
        with self._lock:
            manager = self._manager
            if manager is not None and manager.is_running():
                return manager
            if manager is not None:  # its loop died (a fatal error): start afresh
                self._stop(manager)
            manager = self._manager = self._new_manager()
            return manager

    def _new_manager(self) -> Any:
        import torch
        from transformers import ContinuousBatchingConfig, GenerationConfig

        gen = self.generator.warm_up()
        model, tok = gen.model, gen.tokenizer
        reason = batching_unsupported(gen)
        if reason:
            raise ConfigError(f"cannot batch {gen.model_ref.id!r}: {reason}")
        # The model's own stop tokens (its generation_config's and its tokenizer's); sampling is
        # the row sampler's, and so is the checkpoint's repetition penalty (see _row_sampler).
        eos = sorted(gen.eos_ids()) or -1
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        config = GenerationConfig(  # type: ignore[no-untyped-call]  # transformers' config is untyped
            do_sample=False, eos_token_id=eos, pad_token_id=pad
        )
        cb = ContinuousBatchingConfig(
            num_blocks=self.layout.num_blocks,
            page_size=self.page_size,
            max_batch_tokens=self.max_batch_tokens,
            auto_switch_to_flash=False,
        )
        if str(model.config._attn_implementation).removeprefix("paged|") == "sdpa":
            _install_per_request_sdpa()
        manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
        manager.logit_processor = _row_sampler(self._slots, gen.repetition_penalty)

        def start() -> None:
            with torch.inference_mode():  # the loop runs in its starter's inference mode
                manager.start()

        # A thread inherits daemon-ness from the thread that creates it: start the manager's
        # loop from a daemon thread so an idle loop never keeps the interpreter from exiting.
        starter = threading.Thread(target=start, daemon=True, name="ragbudget-batch-start")
        starter.start()
        starter.join()
        threading.Thread(target=self._pump, args=(manager,), daemon=True, name="ragbudget-batch-results").start()
        _RUNNING.add(self)
        return manager

    def _pump(self, manager: Any) -> None:
        """Hand each output of ``manager`` to the queue of the request it belongs to."""
        while True:
            out = manager.get_result(timeout=0.1)
            if out is None:
                if not manager.is_running():
                    return
                continue
            q = self._routes.get(out.request_id)
            if q is not None:
                q.put(out)

    @staticmethod
    def _stop(manager: Any) -> None:
        try:
            manager.stop(block=True, timeout=10, hard_stop=True)
        except Exception as exc:  # noqa: BLE001 - a dead loop may refuse a clean stop
            log.debug("batching manager did not stop cleanly: %s", exc)

    def close(self) -> None:
        """Stop the manager (requests still running fail) and free its cache; a later
        :meth:`generate` starts a new one."""
        with self._lock:
            manager, self._manager = self._manager, None
        _RUNNING.discard(self)
        if manager is not None:
            self._stop(manager)

    # -- generation -----------------------------------------------------------------------------
    def generate(
        self,
        prompt: Any,
        *,
        max_new_tokens: int = MemorySettings.max_new_tokens,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Generation:
        """:meth:`Generator.generate <ragbudget.generation.generate.Generator.generate>`'s contract
        (prompt kinds, sampling, ``stop``, ``on_text``, ``cancel``, the returned
        :class:`~ragbudget.generation.generate.Generation`, whose ``cache`` is ``"paged"``), batched with
        every other call running at the same time. No OOM ladder: the cache is allocated once."""
        from .decoding import CallbackStreamer, sampling_wanted, stop_list
        from .generate import Generation

        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be ≥ 1; got {max_new_tokens!r}")
        stops = stop_list(stop)
        sample = sampling_wanted(do_sample, temperature, top_p, top_k, seed)
        gen = self.generator.warm_up()
        ids = gen.prompt_ids(prompt)
        self._check_fits(len(ids), max_new_tokens)
        manager = self._start()
        n = next(self._ids)
        rid = f"ragbudget-{n}"
        route: queue.Queue[Any] = queue.Queue()
        self._routes[rid] = route
        extra: dict[str, int] = {}
        if sample:
            # Unseeded sampling still gets a private generator (fresh entropy): no request ever
            # draws from torch's global RNG, which the others would disturb.
            self._slots[n] = _Slot(
                seed if seed is not None else random.SystemRandom().getrandbits(63), temperature, top_p, top_k
            )
            extra[_SLOT] = n
        # Always a streamer: it ends the answer at a stop string or a line repeated in a row.
        streamer = CallbackStreamer(gen.tokenizer, on_text or (lambda _s: None), 0, stops)
        tokens: list[int] = []
        finished = cancelled = False
        t0 = time.perf_counter()
        try:
            if manager.add_request(ids, request_id=rid, max_new_tokens=max_new_tokens, streaming=True, **extra) is None:
                raise ModelError("the batching worker refused the request (it is stopping); retry")
            tokens, finished, cancelled = self._receive(manager, route, streamer, cancel)
        finally:
            self._routes.pop(rid, None)
            self._slots.pop(n, None)
            if not finished:  # cancelled, stopped, or failed: free its blocks at the next step
                manager.cancel_request(rid)
        streamer.end()
        text, finish = gen.finish_answer(tokens, max_new_tokens, stops, cancelled=cancelled)
        return Generation(
            text=text,
            prompt_tokens=len(ids),
            new_tokens=len(tokens),
            finish_reason=finish,
            seconds=time.perf_counter() - t0,
            cache="paged",
            prompt=prompt if hasattr(prompt, "input_ids") else None,
        )

    def _check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        """A BudgetError when one request would need more KV than the whole paged cache."""
        capacity = self.layout.capacity_tokens
        if n_prompt + max_new_tokens > capacity:
            raise BudgetError(
                f"a {n_prompt}-token prompt and {max_new_tokens} new tokens need "
                f"{n_prompt + max_new_tokens} tokens of KV, more than the whole paged cache "
                f"({capacity} tokens); shorten the prompt or raise the batch cache "
                "(LocalBackend(batch_kv_tokens=...))",
                needed=n_prompt + max_new_tokens,
                available=capacity,
            )

    def _receive(
        self, manager: Any, route: queue.Queue[Any], streamer: Any, cancel: threading.Event | None
    ) -> tuple[list[int], bool, bool]:
        """One request's tokens as the worker hands them over, fed to ``streamer``, until it
        finishes, stops (a stop string or a repeated line) or is cancelled: the tokens, whether it
        finished, whether it was cancelled. A worker that stopped or failed is a ModelError."""
        tokens: list[int] = []
        while True:
            if cancel is not None and cancel.is_set():
                return tokens, False, True
            try:
                out = route.get(timeout=self.POLL_S)
            except queue.Empty:
                if not manager.is_running():
                    error = manager.background_thread_status.fatal_error
                    raise ModelError(f"the batching worker stopped: {error or 'no reason given'}") from None
                continue
            if out.error is not None:
                raise ModelError(f"batched generation failed: {out.error}")
            new, tokens = out.generated_tokens[len(tokens) :], list(out.generated_tokens)
            streamer.feed(new)
            if out.is_finished():
                return tokens, True, False
            if streamer.stopped:  # a stop string or a repeated line: done here
                return tokens, False, False
