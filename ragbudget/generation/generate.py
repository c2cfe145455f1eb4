"""Capped generation with a local transformers model, and an out-of-memory fallback ladder.

One local model's generation: loading it, a capped ``generate`` with sampling, stop strings and
streaming (their rules are :mod:`ragbudget.generation.decoding`), and the ladder that retries it
after an out-of-memory error.

:class:`Generator` loads lazily (``warm_up()`` is idempotent). The default model is the packaged
SmolLM2-135M-Instruct GGUF; transformers dequantizes a GGUF on load (~40 s for SmolLM2), so the
converted model and tokenizer are saved once under ``cache_dir()/converted/`` and later loads take
seconds.

:meth:`Generator.generate` never lets an OOM kill the process. On ``torch.cuda.OutOfMemoryError``
(``MemoryError`` on CPU) it frees cached memory and walks down a bounded ladder, recording each
step in :attr:`Generation.oom_steps`:

1. ``drop_chunks`` — rebuild the prompt without the lower-scored half of its passages (twice at
   most; needs a rebuildable prompt such as :class:`ragbudget.prompt.prompt.Prompt`);
2. ``quantized_cache`` (when quanto/hqq is installed) or ``offloaded_cache`` — a smaller KV cache;
3. ``no_cache`` — ``use_cache=False``: slow, but the KV cache is gone;

then it raises :class:`~ragbudget.errors.BudgetError` listing what it tried.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import BudgetError, ConfigError, ModelError
from ..gpus import prefer_expandable_segments
from ..memory.models import ModelRef, cache_dir, resolve_generator
from ..settings import MemorySettings
from ..tokens import HFTokenizer
from ..types import CACHE_KINDS, Refittable
from .decoding import (
    REPEATED_LINE_STOP,
    CallbackStreamer,
    first_stop,
    line_repeats,
    sampling_kwargs,
    sampling_wanted,
    stop_list,
    stopping_criteria,
)

if TYPE_CHECKING:
    from ..memory.calibration import PeakMeasurement

__all__ = [
    "REPEATED_LINE_STOP",
    "CudaPeak",
    "Generation",
    "Generator",
    "OOMStep",
    "PeakMeter",
    "gguf_bar_only_on_a_terminal",
    "is_oom",
    "line_repeats",
    "quant_backend",
    "smaller_cache",
]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def gguf_bar_only_on_a_terminal() -> Iterator[None]:
    """transformers draws its one-off "Converting and de-quantizing GGUF tensors" bar with tqdm
    directly (its own progress-bar switch does not reach it): off the terminal (a log, a pipe)
    that bar is hundreds of carriage-return redraws, so it is turned off there for the call."""
    import sys

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # another transformers layout: nothing to quiet
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None or sys.stderr.isatty():
        yield
        return
    import functools

    gguf_utils.tqdm = functools.partial(bar, disable=True)  # a third-party seam: restored below
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


#: How many times the ladder halves the passages before touching the cache.
MAX_DROP_STEPS = 2


@dataclass(frozen=True)
class OOMStep:
    """One rung of the OOM ladder: what was done, why, and the prompt size before/after."""

    action: str  # "drop_chunks" | "quantized_cache" | "offloaded_cache" | "no_cache"
    reason: str  # the error that triggered it
    prompt_tokens_before: int
    prompt_tokens_after: int
    cache: str  # the cache layout of the retry
    use_cache: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "reason": self.reason,
            "prompt_tokens_before": self.prompt_tokens_before,
            "prompt_tokens_after": self.prompt_tokens_after,
            "cache": self.cache,
            "use_cache": self.use_cache,
        }


@dataclass(frozen=True)
class Generation:
    """A finished answer. ``finish_reason`` is ``"stop"`` (EOS or a stop string), ``"length"``
    (hit ``max_new_tokens``) or ``"cancelled"`` (its ``cancel`` event was set). ``prompt`` is the
    prompt finally used (fewer passages if the OOM ladder dropped some), when one was given.
    ``measurement``: on CUDA, the measured peak and its parts, for the caller that owns the memory
    plan to record (:func:`ragbudget.memory.calibration.record_measurement`); the generator records nothing."""

    text: str
    prompt_tokens: int
    new_tokens: int
    finish_reason: str
    seconds: float
    oom_steps: tuple[OOMStep, ...] = ()
    cache: str = MemorySettings.cache
    peak_memory_bytes: int | None = None
    prompt: Any = field(default=None, repr=False, compare=False)
    measurement: PeakMeasurement | None = field(default=None, repr=False)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason,
            "seconds": round(self.seconds, 4),
            "cache": self.cache,
            "peak_memory_bytes": self.peak_memory_bytes,
            "oom_steps": [s.to_dict() for s in self.oom_steps],
        }


def is_oom(exc: BaseException) -> bool:
    """True for out-of-memory errors: CUDA OOM, ``MemoryError``, and backends' RuntimeErrors."""
    if isinstance(exc, MemoryError):
        return True
    # torch missing or without CUDA bindings: then only the generic checks apply.
    with contextlib.suppress(Exception):
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


@dataclass
class _Ladder:
    """The out-of-memory ladder of one :meth:`Generator.generate` call: the prompt it runs now,
    its ids, the cache layout and the rungs stepped down so far."""

    device: str
    ids_of: Callable[[Any], list[int]]
    current: Any
    ids: list[int]
    cache: str
    use_cache: bool = True
    drops: int = 0
    steps: list[OOMStep] = field(default_factory=list)

    def down(self, exc: BaseException, max_new_tokens: int) -> None:
        """One rung down after ``exc`` (an out-of-memory error); a BudgetError when none is left."""
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        before = len(self.ids)
        # Rung 1: half the context, packed again by the packer that chose it (a prompt
        # from ragbudget.fitting; plain ids or messages cannot be packed again).
        smaller = None
        if self.drops < MAX_DROP_STEPS and isinstance(self.current, Refittable):
            context = self.current.n_tokens - self.current.fixed_tokens
            smaller = self.current.fewer(self.current.fixed_tokens + context // 2) if context > 0 else None
            if smaller is not None and smaller.n_tokens >= self.current.n_tokens:
                smaller = None  # nothing came out: the next rung
        if smaller is not None:
            self.drops += 1
            self.current, self.ids = smaller, self.ids_of(smaller)
            self.steps.append(OOMStep("drop_chunks", reason, before, len(self.ids), self.cache, self.use_cache))
            return
        # Rung 2: a smaller KV cache.
        smaller_kv = smaller_cache(self.device)
        if self.use_cache and self.cache not in ("quantized", "offloaded") and smaller_kv:
            self.cache = smaller_kv
            self.steps.append(OOMStep(f"{self.cache}_cache", reason, before, before, self.cache))
            return
        # Rung 3: no KV cache at all.
        if self.use_cache:
            self.use_cache, self.cache = False, "dynamic"
            self.steps.append(OOMStep("no_cache", reason, before, before, "none", False))
            return
        tried = ", ".join(s.action for s in self.steps) or "nothing"
        raise BudgetError(
            f"out of memory generating {max_new_tokens} tokens after a {before}-token "
            f"prompt, even after the fallback ladder ({tried}): {reason}. Lower "
            "max_new_tokens or the context budget, lower concurrency, or free GPU memory",
            needed=before + max_new_tokens,
            available=None,
        ) from exc


def _free_memory() -> None:
    gc.collect()
    with contextlib.suppress(Exception):  # freeing memory is best effort
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def quant_backend(device: str | None = None) -> str | None:
    """The installed quantized-cache backend transformers should use (its spelling), or None.

    On a CPU, quanto compiles its C++ kernels at the first decode step (minutes), so only hqq
    (pure torch) is offered there.
    """
    on_cpu = device is not None and not str(device).startswith(("cuda", "xpu", "mps"))
    for mod, name in (("optimum.quanto", "quanto"), ("hqq", "hqq")):
        if on_cpu and name == "quanto":
            continue
        try:
            if importlib.util.find_spec(mod) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def smaller_cache(device: str) -> str | None:
    """The OOM ladder's second rung on ``device``: a quantized cache where a backend runs there,
    else an offloaded one on CUDA (transformers' offloading calls ``torch.cuda`` streams), else
    None (the rung is skipped)."""
    if quant_backend(device):
        return "quantized"
    return "offloaded" if str(device).startswith("cuda") else None


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    name = names.get(str(dtype).lower(), str(dtype).lower().removeprefix("torch."))
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return value


class PeakMeter(Protocol):
    """Measures a run's peak device memory: :meth:`reset` before it, :meth:`read` after it
    (bytes, or ``None`` where not measured)."""

    def reset(self, device: str) -> None: ...

    def read(self, device: str) -> int | None: ...


class CudaPeak:
    """How a :class:`Generator` measures a run's peak device memory: :meth:`reset` before the
    run, :meth:`read` after it. This one reads torch's CUDA statistics and measures nothing on
    another device; set a generator's :attr:`~Generator.peak_meter` to another object with the
    same two methods for another accelerator's statistics (or a figure of one's own)."""

    def reset(self, device: str) -> None:
        if device.startswith("cuda"):
            import torch

            torch.cuda.reset_peak_memory_stats(device)

    def read(self, device: str) -> int | None:
        """Peak bytes allocated since :meth:`reset`, or ``None`` where not measured."""
        if not device.startswith("cuda"):
            return None
        import torch

        return int(torch.cuda.max_memory_allocated(device))


class Generator:
    """A local causal LM that answers prompts under a token cap.

    ``model``: ``None``/``"default"`` for the default packaged model (Qwen2.5-Coder-0.5B-Instruct,
    or ``$RAGBUDGET_MODEL``), a local folder, a
    ``.gguf`` file, a hub id (only when the hub is reachable), or a :class:`ModelRef`.
    ``device``: ``"cuda"``, ``"cpu"``, ``"cuda:1"``… (default: CUDA when available).
    ``dtype``: default float32 on CPU, bfloat16 on CUDA.

    >>> gen = Generator()                                    # doctest: +SKIP
    >>> gen.generate([{"role": "user", "content": "Hi"}], max_new_tokens=8).finish_reason  # doctest: +SKIP
    'length'
    """

    def __init__(
        self,
        model: str | ModelRef | None = None,
        *,
        device: str | None = None,
        dtype: Any = None,
        attn_implementation: str | None = None,
    ) -> None:
        self._spec = model
        self._device_arg = device
        self._dtype_arg = dtype
        self._attn = attn_implementation
        self._model: Any = None
        self._tokenizer: Any = None
        self._counter: HFTokenizer | None = None
        self._ref: ModelRef | None = model if isinstance(model, ModelRef) else None
        self._device: str | None = None
        self._lock = threading.Lock()
        #: What measures a run's peak device memory (the figure calibration learns from).
        self.peak_meter: PeakMeter = CudaPeak()

    @classmethod
    def from_objects(cls, model: Any, tokenizer: Any, *, model_ref: ModelRef | None = None) -> Generator:
        """Wrap an already loaded transformers model and tokenizer (tests, custom loading)."""
        g = cls(model_ref)
        g._model, g._tokenizer = model, tokenizer
        g._counter = HFTokenizer(tokenizer)
        g._ref = model_ref or ModelRef(id=str(getattr(model.config, "_name_or_path", "") or type(model).__name__))
        g._device = str(next(model.parameters()).device)
        return g

    def __repr__(self) -> str:
        state = "loaded" if self._model is not None else "not loaded"
        return f"Generator({self.model_ref.id!r}, device={self._device or self._device_arg!r}, {state})"

    # -- loading ------------------------------------------------------------------------------
    @property
    def model_ref(self) -> ModelRef:
        if self._ref is None:
            self._ref = resolve_generator(self._spec if isinstance(self._spec, str) else None)
        return self._ref

    @property
    def spec(self) -> str | None:
        """The model as it was given, what a memory plan reads before the model is loaded
        (``None``: the packaged default; a :class:`ModelRef`: its id)."""
        return self._spec.id if isinstance(self._spec, ModelRef) else self._spec

    @property
    def loaded(self) -> bool:
        """Whether the model is in memory (then a budget can use its real size and dtype)."""
        return self._model is not None

    def warm_up(self) -> Generator:
        """Load the model and tokenizer (once; later calls return at once)."""
        if self._model is not None:
            return self
        with self._lock:
            if self._model is None:
                self._load()
        return self

    def _load(self) -> None:
        import torch

        ref = self.model_ref
        device = self._device_arg or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = _torch_dtype(self._dtype_arg) or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        kwargs: dict[str, Any] = {"dtype": dtype}
        if self._attn:
            kwargs["attn_implementation"] = self._attn
        try:
            if ref.gguf_file:
                model, tok = self._load_gguf(ref, kwargs)
            else:
                from transformers import AutoModelForCausalLM, AutoTokenizer

                tok = AutoTokenizer.from_pretrained(ref.source)
                model = AutoModelForCausalLM.from_pretrained(ref.source, **kwargs)
        except (OSError, ValueError, ImportError) as exc:
            raise ModelError(
                f"could not load generator {ref.id!r} from {ref.source!r}: {exc}. Pass --model "
                "with a local transformers folder or .gguf file (the hub is only used when "
                "reachable and HF_HUB_OFFLINE is unset)"
            ) from exc
        if device.startswith("cuda"):
            prefer_expandable_segments()  # before the weights: see its docstring
        model = model.to(device).eval()
        if ref.gguf_file:
            # A converted GGUF would otherwise be named after its cache folder in plans,
            # errors and calibration records: keep the name the user knows.
            model.config._name_or_path = ref.id
        if tok.pad_token_id is None and tok.eos_token_id is not None:
            tok.pad_token = tok.eos_token  # generate() wants a pad id even for one sequence
        self._model, self._tokenizer = model, tok
        self._counter = HFTokenizer(tok, name=ref.id)
        self._device = device

    def _load_gguf(self, ref: ModelRef, kwargs: dict[str, Any]) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        assert ref.path is not None and ref.gguf_file is not None
        gguf = Path(ref.path) / ref.gguf_file
        st = gguf.stat()
        # Size + mtime identify the file cheaply; a replaced GGUF gets a fresh conversion.
        key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
        target = cache_dir() / "converted" / f"{Path(ref.gguf_file).stem}-{key[:12]}"
        if (target / "config.json").is_file():
            try:
                tok = AutoTokenizer.from_pretrained(target)
                model = AutoModelForCausalLM.from_pretrained(target, **kwargs)
                return model, tok
            except (OSError, ValueError) as exc:
                log.warning("converted cache %s unusable (%s); converting again", target, exc)
        t0 = time.perf_counter()
        with gguf_bar_only_on_a_terminal():
            tok = AutoTokenizer.from_pretrained(ref.path, gguf_file=ref.gguf_file)
            model = AutoModelForCausalLM.from_pretrained(ref.path, gguf_file=ref.gguf_file, **kwargs)
        log.info("converted %s in %.1fs", gguf.name, time.perf_counter() - t0)
        q = getattr(model, "hf_quantizer", None)
        if q is not None:
            if getattr(q, "packed_modules", None):
                # Weights kept in GGUF blocks with matmul kernels (a GPU): smaller in memory, but
                # transformers cannot save them; keep this load, skip the cache.
                return model, tok
            # Fully dequantized (the CPU fallback): a plain dense model; forget the quantizer so
            # save_pretrained writes ordinary safetensors.
            # torch types Module.__setattr__'s value as Tensor | Module; a plain attribute takes any.
            model.hf_quantizer = None  # type: ignore[assignment]
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            for attr in ("is_quantized", "quantization_method"):
                if attr in vars(model):
                    delattr(model, attr)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.parent / f".{target.name}.tmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            try:
                os.rename(tmp, target)  # atomic; a concurrent converter may have won the race
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as exc:  # a read-only cache only costs the next load its speed
            log.warning("could not cache the converted model in %s: %s", target, exc)
        return model, tok

    @property
    def model(self) -> Any:
        return self.warm_up()._model

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (``apply_chat_template``)."""
        return self.warm_up()._tokenizer

    @property
    def token_counter(self) -> HFTokenizer:
        """The generator's tokenizer as a :class:`~ragbudget.tokens.HFTokenizer` (budgets count in it)."""
        self.warm_up()
        assert self._counter is not None
        return self._counter

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def repetition_penalty(self) -> float:
        """The repetition penalty of the model's own ``generation_config`` (its checkpoint's
        ``generation_config.json``; what transformers builds for a GGUF), 1.0 when it sets none.
        ``generate`` applies it as transformers does; batched generation too
        (:mod:`ragbudget.generation.batching`)."""
        cfg = getattr(self.model, "generation_config", None)
        value = getattr(cfg, "repetition_penalty", None)
        return float(value) if isinstance(value, (int, float)) and value > 0 else 1.0

    @property
    def device(self) -> str:
        return self.warm_up()._device or "cpu"

    # -- generation ---------------------------------------------------------------------------
    def _check_cache(self, cache: str) -> None:
        """A ConfigError when ``cache`` is no layout, or one this host cannot run."""
        if cache not in CACHE_KINDS:
            raise ConfigError(f"cache must be one of {', '.join(CACHE_KINDS)}; got {cache!r}")
        if cache == "quantized" and quant_backend() is None:
            raise ConfigError(
                "cache='quantized' needs a quantization backend: "
                "`pip install optimum-quanto` (or hqq), or use another cache"
            )
        if cache == "offloaded" and not self.device.startswith("cuda"):
            raise ConfigError(
                f"cache='offloaded' needs a CUDA device (transformers moves layers "
                f"with CUDA streams); the model is on {self.device!r}: use the "
                "dynamic, static or quantized cache there"
            )

    def prompt_ids(self, prompt: Any) -> list[int]:
        """The token ids a prompt is run as: a rendered prompt's own ids, chat messages (or a
        string, as one user message) through the model's chat template, or ids as given. The
        batcher (:mod:`ragbudget.generation.batching`) feeds requests through this, as
        :meth:`generate` does."""
        if hasattr(prompt, "input_ids") and not isinstance(prompt, dict):
            return list(prompt.input_ids)
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], dict):
            text = self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ConfigError(
            "prompt must be token ids, chat messages [{'role', 'content'}], a string, or a "
            f"ragbudget.prompt.prompt.Prompt; got {type(prompt).__name__}"
        )

    def generate(
        self,
        prompt: Any,
        *,
        max_new_tokens: int = MemorySettings.max_new_tokens,
        cache: str = MemorySettings.cache,
        kv_dtype: str | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        on_text: Callable[[str], None] | None = None,
        streamer: Any = None,
        cancel: threading.Event | None = None,
        oom_ladder: bool = True,
    ) -> Generation:
        """Generate at most ``max_new_tokens`` tokens for ``prompt``.

        ``prompt``: a :class:`ragbudget.prompt.prompt.Prompt` (rebuildable with fewer passages on OOM),
        token ids (chat template already applied), chat messages, or a plain user string.
        Sampling follows the OpenAI convention: greedy when ``temperature`` is absent or 0,
        sampling when it is > 0 (``do_sample`` forces either; ``top_p``/``top_k`` shape the
        sampling and are ignored by greedy decoding; ``top_p=0`` is greedy). ``seed`` makes sampling
        reproducible: it seeds a generator private to this call, so concurrent requests do not
        disturb each other's draws (torch's global RNG is left alone). Without a seed, sampling is
        transformers' own (``do_sample=True`` with the warpers passed through).

        ``on_text`` receives decoded text pieces as they are produced (``streamer`` takes any
        transformers streamer instead). ``stop`` (a string or a list of strings) ends the answer at
        the first stop string, which ``text`` and the streamed pieces exclude
        (``finish_reason="stop"``). Setting ``cancel`` (a ``threading.Event``) stops after the
        current token (``finish_reason="cancelled"``). Text already streamed is not taken back if
        an OOM retry restarts the answer.
        """
        self._check_cache(cache)
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be ≥ 1; got {max_new_tokens}")
        stop = stop_list(stop)
        do_sample = sampling_wanted(do_sample, temperature, top_p, top_k, seed)
        self.warm_up()
        ladder = _Ladder(
            device=self.device, ids_of=self.prompt_ids, current=prompt, ids=self.prompt_ids(prompt), cache=cache
        )
        # What every rung's retry decodes with (the ladder changes the prompt and the cache only).
        decoding: dict[str, Any] = {"kv_dtype": kv_dtype, "do_sample": do_sample, "temperature": temperature}
        decoding |= {"top_p": top_p, "top_k": top_k, "seed": seed, "stop": stop}
        decoding |= {"on_text": on_text, "streamer": streamer, "cancel": cancel}
        t0 = time.perf_counter()
        out, peak = self._run_on_ladder(ladder, max_new_tokens, oom_ladder, decoding)
        seconds = time.perf_counter() - t0
        new = out[len(ladder.ids) :]
        text, finish = self.finish_answer(new, max_new_tokens, stop, cancelled=cancel is not None and cancel.is_set())
        gen = Generation(
            text=text,
            prompt_tokens=len(ladder.ids),
            new_tokens=len(new),
            finish_reason=finish,
            seconds=seconds,
            oom_steps=tuple(ladder.steps),
            cache=ladder.cache if ladder.use_cache else "none",
            peak_memory_bytes=peak,
            prompt=ladder.current if hasattr(ladder.current, "input_ids") else None,
        )
        if peak is not None:
            gen = replace(gen, measurement=self._measure(gen, peak, kv_dtype))
        return gen

    def _run_on_ladder(
        self, ladder: _Ladder, max_new_tokens: int, oom_ladder: bool, decoding: dict[str, Any]
    ) -> tuple[list[int], int | None]:
        """Run the ladder's current prompt; on an out-of-memory error step one rung down (fewer
        passages, a leaner cache) and retry, until it fits or no rung is left."""
        while True:
            try:
                return self._run(
                    ladder.ids,
                    max_new_tokens=max_new_tokens,
                    cache=ladder.cache,
                    use_cache=ladder.use_cache,
                    **decoding,
                )
            except Exception as exc:
                if not (oom_ladder and is_oom(exc)):
                    raise
                _free_memory()
                ladder.down(exc, max_new_tokens)

    def stream(self, prompt: Any, **options: Any) -> Iterator[str | Generation]:
        """Yield text pieces as they are generated, then the final :class:`Generation`.

        Generation runs in a worker thread; iterate to the end (the last item is the
        ``Generation``). Errors from the worker are re-raised here. Leaving the loop early stops
        the generation at its next token (``options`` may carry a ``cancel`` event of its own).
        """
        from ..relay import Relay

        cancel = options.pop("cancel", None)
        relay: Relay[Generation] = Relay(
            lambda emit, stop: self.generate(prompt, on_text=emit, cancel=stop, **options),
            cancel=cancel,
            name="ragbudget-generate",
        )
        try:
            while True:
                try:
                    yield relay.next_piece()
                except StopIteration:
                    break
            assert relay.result is not None  # the producer returned: "done" carried it
            yield relay.result
        finally:
            relay.close()

    def finish_answer(
        self, new: list[int], max_new_tokens: int, stop: Sequence[str] | None, cancelled: bool = False
    ) -> tuple[str, str]:
        """The answer's text and why it ended: EOS or a stop string (``"stop"``), the cap
        (``"length"``), else a cancellation (``"cancelled"``) when ``cancelled``. One place for
        both ways to generate (:meth:`generate` and the batcher), so their answers end alike."""
        tok = self._tokenizer
        eos = self.eos_ids()
        text = tok.decode(new, skip_special_tokens=True)
        finish = "length" if len(new) >= max_new_tokens else ("cancelled" if cancelled else "stop")
        if new and new[-1] in eos:
            finish = "stop"
        cut = first_stop(text, stop or ())
        if cut is not None:
            text, finish = text[:cut], "stop"
        cut, _ = line_repeats(text)
        if cut is not None:  # a decoding loop: the line once, and the answer ends there
            text, finish = text[:cut], "stop"
        return text.strip(), finish

    def eos_ids(self) -> set[int]:
        """The token ids that end an answer: the model's ``generation_config`` and the
        tokenizer's ``eos_token_id`` together (a chat model's end-of-turn token among them)."""
        ids: set[int] = set()
        for src in (getattr(self._model, "generation_config", None), self._tokenizer):
            e = getattr(src, "eos_token_id", None)
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, (list, tuple)):
                ids.update(int(x) for x in e)
        return ids

    def _run(
        self,
        ids: list[int],
        *,
        max_new_tokens: int,
        cache: str,
        kv_dtype: str | None,
        use_cache: bool,
        do_sample: bool,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        seed: int | None,
        stop: Sequence[str],
        on_text: Callable[[str], None] | None,
        streamer: Any,
        cancel: threading.Event | None = None,
    ) -> tuple[list[int], int | None]:
        import torch

        model, tok = self._model, self._tokenizer
        device = self._device or "cpu"
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        kw: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "max_new_tokens": max_new_tokens,
            "do_sample": do_sample,
            "use_cache": use_cache,
            "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        }
        kw.update(sampling_kwargs(do_sample, temperature, top_p, top_k, seed))
        if use_cache and cache != "dynamic":
            kw["cache_implementation"] = cache
            if cache == "quantized":
                bits = {"int2": 2, "int4": 4, "int8": 8}.get(str(kv_dtype or "int4").lower(), 4)
                kw["cache_config"] = {
                    "backend": quant_backend(self.device) or quant_backend() or "quanto",
                    "nbits": bits,
                }
        if stop:
            kw["stop_strings"] = list(stop)
            kw["tokenizer"] = tok
        kw["stopping_criteria"] = stopping_criteria(len(ids), tok, cancel)
        if on_text is not None:
            kw["streamer"] = CallbackStreamer(tok, on_text, len(ids), stop or ())
        elif streamer is not None:
            kw["streamer"] = streamer
        self.peak_meter.reset(device)
        with torch.inference_mode():
            out = model.generate(**kw)
        seq = out.sequences if hasattr(out, "sequences") else out
        return list(seq[0].tolist()), self.peak_meter.read(device)

    def _measure(self, gen: Generation, peak: int, kv_dtype: str | None) -> PeakMeasurement | None:
        """What a measured CUDA peak consisted of (weights, KV of the run's tokens), for the
        planner's calibration; ``None`` when it cannot be told (best effort, never fails a
        request). Recording it is the plan owner's job, not the generator's."""
        try:
            import torch

            from ..memory import kvcache
            from ..memory.calibration import PeakMeasurement

            model = self._model
            tokens = gen.prompt_tokens + gen.new_tokens
            dtype = kv_dtype or str(model.dtype).removeprefix("torch.")
            weights = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
                b.numel() * b.element_size() for b in model.buffers()
            )
            kv = kvcache.kv_cache_bytes(
                model.config, tokens, kv_dtype=dtype, cache=gen.cache if gen.cache in CACHE_KINDS else "dynamic"
            )
            name = getattr(model.config, "_name_or_path", None) or type(model).__name__
            return PeakMeasurement(
                gpu_name=torch.cuda.get_device_name(self._device),
                model=str(name),
                dtype=dtype,
                cache=gen.cache,
                tokens=gen.prompt_tokens,
                batch_size=1,
                measured_peak_bytes=peak,
                weights_bytes=weights,
                kv_bytes=kv,
            )
        except Exception as exc:  # noqa: BLE001 - calibration is an optimization, not a requirement
            log.debug("peak not measured for calibration: %s", exc)
            return None
