"""The checks :class:`~ragbudget.pipeline.Pipeline` runs on what a caller passes, before any
work: each names the argument, what it got and what it takes, in one line
(:class:`~ragbudget.errors.ArgumentTypeError` or :class:`~ragbudget.errors.ConfigError`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from .errors import ArgumentTypeError, ConfigError
from .settings import (
    EngineSettings,
    MemorySettings,
    QueueSettings,
    RetrievalSettings,
    check_text,
    from_keywords,
    shown,
)

__all__ = [
    "check_call",
    "check_options",
    "check_parts",
    "check_paths",
    "check_question",
    "index_location",
    "settings_records",
    "stream_options",
]


def check_question(question: Any, name: str = "question") -> str:
    text = check_text(name, question)
    assert text is not None
    if not text.strip():
        raise ConfigError(f"the {name} is empty")
    return text


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


def check_options(where: str, options: Mapping[str, Any], target: Callable[..., Any], *, taken: Sequence[str]) -> None:
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


def check_parts(embedder: Any, generator: Any, backend: Any) -> None:
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


def check_call(on_text: Any, cancel: Any) -> None:
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


def stream_options(options: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(k for k in ("on_text", "cancel") if k in options)
    if taken:
        raise ConfigError(
            f"a stream delivers the text and cancels itself; drop {', '.join(taken)} (use ask() to pass your own)"
        )
    return options


def settings_records(
    given: Mapping[str, Any],
) -> tuple[RetrievalSettings, MemorySettings, QueueSettings, EngineSettings]:
    """The four settings records :class:`Pipeline` runs by, from its keywords (``given``: its
    ``__init__``'s locals): each record passed whole, or built from the flat keywords that are
    sugar for its fields — never both (:func:`~ragbudget.settings.from_keywords` says which)."""
    # Every field of these two records has a flat keyword of its own name.
    retrieval = from_keywords(
        RetrievalSettings,
        given["retrieval"],
        "retrieval",
        {f.name: given[f.name] for f in fields(RetrievalSettings)},
    )
    memory = from_keywords(
        MemorySettings, given["memory"], "memory", {f.name: given[f.name] for f in fields(MemorySettings)}
    )
    queue = from_keywords(
        QueueSettings,
        given["queue"],
        "queue",
        {"queue_size": given["queue_size"], "queue_timeout": given["queue_timeout"]},
        {"queue_size": "size", "queue_timeout": "timeout"},
    )
    # engine= is the URL (sugar, with engine_kind & co) or the whole record, as httpx's
    # timeout= takes a number or a Timeout.
    engine = given["engine"]
    record = engine if isinstance(engine, EngineSettings) else None
    renamed = {"engine": "url", "engine_kind": "kind", "engine_context_tokens": "context_tokens"}
    flat = ("engine_kind", "api_key", "api_key_env", "tokenizer", "engine_context_tokens", "engine_timeout")
    engine_settings = from_keywords(
        EngineSettings,
        record,
        "engine",
        {"engine": None if record is not None else engine, **{k: given[k] for k in flat}},
        {**renamed, "engine_timeout": "timeout"},
    )
    return retrieval, memory, queue, engine_settings


def index_location(index_dir: Any) -> tuple[Path | str, str]:
    """Where the index lives as :class:`Pipeline` keeps it, and as its messages show it.

    A location other than a folder (a PostgreSQL URL or keyword/value string, another storage's
    URL) stays a string as given: a path would collapse a URL's empty host (postgresql:///db)
    into postgresql:/db. Messages and the repr show it masked. A URL no storage takes is refused
    here, before anything is built."""
    if not isinstance(index_dir, (str, os.PathLike)):
        raise ArgumentTypeError(
            f"index_dir must be a path (str or os.PathLike), got {type(index_dir).__name__} {shown(index_dir)}"
        )
    from .retrieval.locations import mask_location
    from .retrieval.storage import LOCAL, storage_name

    if storage_name(index_dir) == LOCAL:
        return Path(index_dir), str(Path(index_dir))
    return os.fspath(index_dir), mask_location(index_dir)
