"""Served engines as :class:`~ragbudget.generation.backend.Backend` s: vLLM, SGLang, TGI, llama.cpp's
``llama-server``, Ollama, any other OpenAI-compatible server, and the engine kinds installed
packages add.

>>> backend = connect("http://127.0.0.1:8080")                       # doctest: +SKIP
>>> backend.detection.kind, backend.detection.how                   # doctest: +SKIP
('llamacpp', 'GET /v1/models owned_by="llamacpp"')
>>> print("\\n".join(backend.capacity().describe()))                  # doctest: +SKIP
max context: 512 tokens (GET /props default_generation_settings.n_ctx (per slot), 0.0 s old)
...
>>> backend.generate("Hi", max_new_tokens=16).text                   # doctest: +SKIP

Detection (``kind="auto"``) asks ``GET /v1/models`` first — vLLM, SGLang and llama.cpp name
themselves in ``owned_by`` — then the routes only one engine serves: ``GET /info`` (TGI's
``router``), ``GET /api/version`` (Ollama), ``GET /props`` (llama.cpp), ``GET /get_server_info``
(SGLang); a server that answers none of them is a generic OpenAI server. The probes made and the
one that decided are in ``backend.detection``.

Another package adds an engine kind the way ``llm``'s plugins add models: a
:class:`ServedBackend` subclass registered under the kind's name in the ``ragbudget.engines``
entry-point group (``[project.entry-points."ragbudget.engines"] myengine =
"my_package:MyBackend"``). Once installed it is one of :func:`kinds`, ``connect(url,
kind="myengine")`` (CLI ``--engine-kind myengine``) generates on it, and its module is imported
only when that kind is asked for. Detection probes the built-in engines only.

Every engine module cites the source files its field names were checked against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import (
    ConfigError,
    EngineAuthError,
    EngineConnectionError,
    EngineError,
    EngineResponseError,
)
from ...settings import BUILT_IN_ENGINES, ENGINE_GROUP, ENGINE_KINDS, EngineSettings, engine_kinds, from_keywords
from ..backend import Capacity, CountCache, RenderedPrompt
from ._base import Detection, ServedBackend, TooLong, sampling_fields
from ._counting import LocalCounter
from ._http import HTTP, Reply, Retry, error_message, root_url
from ._prometheus import int_or_none, iter_samples, metric_sum, parse_prometheus, queue_load

__all__ = [
    # connecting
    "KINDS",
    "Detection",
    "Retry",
    "api_key_from_env",
    "backend_class",
    "connect",
    "detect",
    "kinds",
    "root_url",
    # the engine contract (docs/engines.md, "Another engine"): what a plugin builds on
    "HTTP",
    "Capacity",
    "LocalCounter",
    "RenderedPrompt",
    "Reply",
    "ServedBackend",
    "TooLong",
    "error_message",
    "int_or_none",
    "iter_samples",
    "metric_sum",
    "parse_prometheus",
    "queue_load",
    "sampling_fields",
]

#: The built-in engine kinds (:func:`kinds` adds those installed packages register); where each
#: one's class lives is :data:`ragbudget.settings.BUILT_IN_ENGINES`, in entry-point form.
KINDS = ENGINE_KINDS  # defined once, beside EngineSettings which checks it


def kinds() -> tuple[str, ...]:
    """Every engine kind :func:`connect` accepts besides ``"auto"``: the built-in ones
    (:data:`KINDS`), then those installed packages register in the ``ragbudget.engines``
    entry-point group (named only: a plugin's module is imported when its kind is used).

    >>> kinds()[:2]
    ('vllm', 'sglang')
    """
    return engine_kinds()


# `owned_by` of /v1/models as each engine writes it: "vllm" (ModelCard default,
# vllm/entrypoints/openai/engine/protocol.py), "sglang" (ModelCard default,
# python/sglang/srt/entrypoints/openai/protocol.py), "llamacpp" (get_res_model_info,
# tools/server/server-context.cpp). TGI writes the model id there and Ollama "library", so those
# two are recognised by their own routes.
_OWNED_BY = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp"}


def api_key_from_env(var: str | None) -> str | None:
    """The API key in environment variable ``var`` (CLI ``--api-key-env VAR``), so a key never
    appears on a command line; ``None`` when ``var`` is ``None``.

    >>> api_key_from_env(None) is None
    True
    """
    if var is None:
        return None
    import os

    key = os.environ.get(var)
    if not key:
        raise ConfigError(
            f"--api-key-env names {var!r}, but that environment variable is unset "
            f"or empty: export {var}=<the engine's API key>"
        )
    return key


def backend_class(kind: str) -> type[ServedBackend]:
    """The :class:`ServedBackend` subclass for an engine kind, loaded now (on its first use) the
    one way for every kind: a built-in one from :data:`~ragbudget.settings.BUILT_IN_ENGINES`, or
    the one an installed package registers under that name in the ``ragbudget.engines``
    entry-point group — both as entry points, with the same checks.

    >>> backend_class("vllm").__name__
    'VLLMBackend'
    """
    from importlib.metadata import EntryPoint, entry_points

    if kind in BUILT_IN_ENGINES:
        entry = EntryPoint(name=kind, value=BUILT_IN_ENGINES[kind], group=ENGINE_GROUP)
    else:
        found = [ep for ep in entry_points(group=ENGINE_GROUP) if ep.name == kind]
        if not found:
            raise ConfigError(f"engine kind must be auto or one of {', '.join(kinds())}; got {kind!r}")
        entry = found[0]
    try:
        cls = entry.load()
    except Exception as exc:  # noqa: BLE001 - a broken plugin is its package's fault: say which
        raise ConfigError(
            f"engine kind {kind!r} is registered by {entry.value!r} (entry point group {ENGINE_GROUP!r}), "
            f"which failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, ServedBackend)):
        raise ConfigError(
            f"engine kind {kind!r} is registered by {entry.value!r}, which is not a "
            "ragbudget.generation.engines.ServedBackend subclass: fix or uninstall that package"
        )
    return cls


def detect(http: HTTP) -> Detection:
    """Probe ``http``'s server and say which engine it is (see the module docstring).

    Connection failures and refused credentials end the probing at once with their typed error;
    a route that is missing (404, 405, 501) or answers something unexpected just moves on.
    """
    probes: list[str] = []

    def probe(method: str, path: str, body: Any = None) -> Any:
        try:
            reply = http.call(method, path, body, allow={400, 404, 405, 422, 500, 501})
        except (EngineConnectionError, EngineAuthError):
            raise
        except EngineError as exc:  # not JSON, an odd status: not this engine
            probes.append(f"{method} {path} -> {exc.status or 'not JSON'}")
            return None
        probes.append(f"{method} {path} -> {reply.status}")
        return reply.data if reply.status == 200 and isinstance(reply.data, Mapping) else None

    models = probe("GET", "/v1/models")
    cards = [c for c in (models or {}).get("data", []) if isinstance(c, Mapping)] if models else []
    ids = tuple(str(c["id"]) for c in cards if "id" in c)

    def found(kind: str, how: str) -> Detection:
        return Detection(kind=kind, how=how, probes=tuple(probes), models=ids)

    for card in cards:
        owner = str(card.get("owned_by", ""))
        if owner in _OWNED_BY:
            return found(_OWNED_BY[owner], f'GET /v1/models owned_by="{owner}"')
    info = probe("GET", "/info")
    if info and (
        info.get("router") == "text-generation-router" or ("max_total_tokens" in info and "max_input_tokens" in info)
    ):
        return found("tgi", "GET /info router/max_total_tokens (TGI)")
    version = probe("GET", "/api/version")
    if version and "version" in version and len(version) == 1:
        return found("ollama", "GET /api/version (Ollama)")
    props = probe("GET", "/props")
    if props and "total_slots" in props:
        return found("llamacpp", "GET /props total_slots (llama.cpp)")
    server_info = probe("GET", "/get_server_info")
    if server_info and "max_total_num_tokens" in server_info:
        return found("sglang", "GET /get_server_info max_total_num_tokens (SGLang)")
    if models is not None:
        return found("openai", "GET /v1/models only (a generic OpenAI server)")
    raise EngineResponseError(
        f"{http.root} answers none of the engine routes ({'; '.join(probes)}): is this the "
        "engine's address? pass kind=… (CLI: --engine-kind) if it is",
        url=http.root,
        body=probes,
    )


def connect(
    url: str | EngineSettings,
    *,
    kind: str | None = None,
    api_key: str | None = None,
    model: str | None = None,
    tokenizer: Any = None,
    context_tokens: int | None = None,
    timeout: float | None = None,
    connect_timeout: float = 5.0,
    retry: Retry | None = None,
    count_cache: CountCache | None = None,
) -> ServedBackend:
    """A :class:`~ragbudget.generation.backend.Backend` for the engine at ``url`` (``http://host:port`` or
    ``…/v1``).

    ``kind``: ``"auto"`` (probe, see :func:`detect`) or one of :func:`kinds`. ``api_key`` is sent
    as a bearer token. ``model`` picks the served model (default: the first listed).
    ``tokenizer`` counts locally for engines that cannot (Ollama, generic OpenAI): a Hugging Face
    tokenizer, a folder or hub id; ``None`` uses tiktoken with a 15% margin. ``context_tokens``
    overrides the window the engine advertises (needed for a server that does not say).
    ``timeout`` bounds every read (``None``: a generation's is drawn from the engine's measured
    speed, :mod:`~ragbudget.generation.engines._pacing`); ``retry`` the back-off on 429/503. ``count_cache`` persists
    token counts by (model, text digest). ``url`` may be an
    :class:`~ragbudget.settings.EngineSettings` instead, holding the URL, ``kind``, the key (or
    the variable holding it), ``tokenizer``, ``context_tokens`` and ``timeout``, checked where
    it was built.
    """
    flat = {
        "kind": kind,
        "api_key": api_key,
        "tokenizer": tokenizer,
        "context_tokens": context_tokens,
        "timeout": timeout,
    }
    if isinstance(url, EngineSettings):
        settings = from_keywords(EngineSettings, url, "url", flat)
    else:
        settings = from_keywords(EngineSettings, None, "url", {"url": url, **flat})
    if settings.url is None:
        raise ConfigError("connect() needs the engine's URL, e.g. http://127.0.0.1:8000/v1")
    if connect_timeout <= 0:
        raise ConfigError(f"connect_timeout must be > 0 seconds, got {connect_timeout}")
    kind, tokenizer, context_tokens = settings.kind, settings.tokenizer, settings.context_tokens
    key = settings.api_key if settings.api_key is not None else api_key_from_env(settings.api_key_env)
    http = HTTP(settings.url, api_key=key, timeout=settings.timeout, connect_timeout=connect_timeout, retry=retry)
    try:
        detection = detect(http) if kind == "auto" else Detection(kind=kind, how=f"given: kind={kind!r}")
        cls = backend_class(detection.kind)
        extra: dict[str, Any] = {}
        if cls.takes_tokenizer:  # it counts with a local stand-in
            extra["tokenizer"] = tokenizer
        if model is None and detection.models:
            model = detection.models[0]  # the listing detection already fetched
        return cls(
            http, model=model, count_cache=count_cache, context_tokens=context_tokens, detection=detection, **extra
        )
    except BaseException:
        http.close()
        raise
