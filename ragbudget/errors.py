"""The one error hierarchy of ragbudget.

Every message says what was needed, what was there, and what to change. Only the CLI turns these
into exit codes (1 for any ``RagBudgetError``); the library never calls ``sys.exit``.

    RagBudgetError
    ├── ConfigError (ValueError)        bad argument, option or configuration value
    │   ├── InputPathError               a path given to index is missing or unreadable
    │   └── ArgumentTypeError (TypeError) an argument of the wrong type (bytes for str, "100" for int)
    ├── LoadError                        a document could not be read (the indexer logs and skips it)
    ├── ModelError                       a model, tokenizer or config could not be loaded
    ├── SearchIndexError (LookupError)   the on-disk index
    │   ├── IndexNotFoundError           no index in that folder yet
    │   ├── IndexCorruptError            checksum mismatch, truncated or unreadable file
    │   ├── IndexLockedError             another writer holds the lock
    │   ├── IndexMismatchError           index built with another embedder / chunking settings
    │   ├── IndexStorageError            the index's database unreachable, refusing or without pgvector
    │   └── IndexEmptyError              the index holds no chunks (an empty folder was indexed)
    ├── BudgetError                      the request cannot fit: ``limit`` names what binds
    ├── OverloadedError                  admission control: queue full or wait timed out
    ├── RequestCancelled                 the caller cancelled the request (a client left)
    ├── ExecutorError                    embedding on a cluster failed (Ray unreachable, a worker died)
    └── EngineError                      a served engine (vLLM, SGLang, TGI, llama.cpp, Ollama, …)
        ├── EngineConnectionError (ConnectionError)  refused, DNS, TLS, dropped (``cause`` says which)
        │   └── EngineTimeoutError (TimeoutError)    no answer within the time-out: hung or saturated
        ├── EngineAuthError (PermissionError)        401 / 403
        ├── EngineResponseError (ValueError)         malformed JSON, unexpected shape or status
        ├── EngineContextError (BudgetError)         the prompt did not fit the server's context
        └── EngineOverloadedError (OverloadedError)  429 / 503 still, after a bounded back-off

The server answers engine errors as a gateway does: 502 for an engine that refused the connection
or answered wrongly, 504 for one that gave no answer in time, 503 with ``Retry-After`` for one that
is overloaded or down (:func:`ragbudget.server.openai_api.error_from_exception`).

Leaves subclass the built-in they refine (``ConfigError`` is a ``ValueError``) so callers' existing
``except ValueError`` keeps working.
"""

from __future__ import annotations

import math

__all__ = [
    "ArgumentTypeError",
    "BudgetError",
    "ConfigError",
    "EngineAuthError",
    "EngineConnectionError",
    "EngineContextError",
    "EngineError",
    "EngineOverloadedError",
    "EngineResponseError",
    "EngineTimeoutError",
    "ExecutorError",
    "IndexCorruptError",
    "IndexEmptyError",
    "IndexLockedError",
    "IndexMismatchError",
    "IndexNotFoundError",
    "IndexStorageError",
    "InputPathError",
    "LoadError",
    "ModelError",
    "OverloadedError",
    "RagBudgetError",
    "RequestCancelled",
    "SearchIndexError",
    "retry_after_seconds",
]


class RagBudgetError(Exception):
    """Base class of every error ragbudget raises on purpose."""


class ConfigError(RagBudgetError, ValueError):
    """An argument, option or configuration value is invalid."""


class InputPathError(ConfigError):
    """A file or folder given to index is missing, unreadable, or not a file or folder.

    Raised before anything is written: the index is left exactly as it was. ``paths`` lists the
    offending paths as given.
    """

    def __init__(self, message: str, *, paths: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.paths = paths


class ArgumentTypeError(ConfigError, TypeError):
    """An argument of a public entry point has the wrong type. Both a ``ConfigError`` (so one
    ``except`` catches every bad argument) and a ``TypeError`` (what Python itself would raise)."""


class LoadError(RagBudgetError):
    """A document could not be loaded. ``reason`` is a short machine-friendly tag; for
    ``missing_dependency``, ``needs`` names what was missing: a module to import (``"docx"``) or
    ``"program:<name>"`` for a program on ``PATH``, so an index can retry the file once it is there."""

    def __init__(self, message: str, *, path: str = "", reason: str = "unreadable", needs: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason
        self.needs = needs


class ModelError(RagBudgetError):
    """A model, tokenizer or model config could not be found or loaded."""


class SearchIndexError(RagBudgetError, LookupError):
    """Base class of on-disk index problems. (Not ``IndexError``: that would shadow the built-in
    raised for a sequence index out of range.)"""


class IndexNotFoundError(SearchIndexError):
    """There is no index in the given folder."""


class IndexCorruptError(SearchIndexError):
    """An index file is truncated, unreadable or fails its checksum."""


class IndexLockedError(SearchIndexError):
    """Another process is writing the index."""


class IndexMismatchError(SearchIndexError):
    """The index was built with settings incompatible with the ones asked for."""


class IndexStorageError(SearchIndexError):
    """The database holding an index could not be reached or refused a statement (server down,
    wrong password, no pgvector, connection dropped): the message names the index by its URL with
    the password masked."""


class IndexEmptyError(SearchIndexError):
    """The index exists but holds no chunks (it was built from a folder with nothing indexable):
    a search would answer from nothing."""


class BudgetError(RagBudgetError):
    """The request does not fit its budget.

    ``needed`` and ``available`` are in the unit named by ``unit`` (``"tokens"`` or ``"bytes"``).
    ``limit`` names the limit that binds — ``"window"`` (the model's context window,
    ``max_position_embeddings``), ``"memory"`` (KV/weights memory), ``"time"`` or ``"engine"`` (a
    served engine's own limit) — and the message gives its number, so the fix it suggests is the
    one that helps (a bigger GPU does not lengthen a model's window).
    """

    def __init__(
        self,
        message: str,
        *,
        needed: int | None = None,
        available: int | None = None,
        unit: str = "tokens",
        limit: str = "memory",
    ) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available
        self.unit = unit
        self.limit = limit


def retry_after_seconds(seconds: float) -> int:
    """A retry delay as HTTP's ``Retry-After`` carries it: whole seconds, rounded up (a client
    honouring it must not come back before the time it was given), at least 1 (never 0: no
    hammering). Every refusal's message states this same number.

    >>> retry_after_seconds(2.1), retry_after_seconds(0.01)
    (3, 1)
    """
    return max(1, math.ceil(seconds))


class OverloadedError(RagBudgetError):
    """Admission control refused a request: the wait queue is full or the wait timed out. The
    message ends with "retry after N s", N being :func:`retry_after_seconds` of ``retry_after``:
    the very number a server's ``Retry-After`` header carries."""

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(f"{message}; retry after {retry_after_seconds(retry_after)} s")
        self.retry_after = retry_after


class RequestCancelled(RagBudgetError):
    """A request's ``cancel`` event was set while it waited for admission: it left the queue
    without holding any KV memory. (:meth:`ragbudget.pipeline.Pipeline.ask` turns this into an
    answer with ``finish_reason="cancelled"``.)"""


class ExecutorError(RagBudgetError):
    """The executor that embeds an index build could not run it: the Ray cluster is unreachable,
    Ray is not installed, or the job failed (a worker died more often than it may be restarted).
    The build stops before its commit point, so the index keeps its previous generation; vectors
    already returned stay in the embedding checkpoint and a re-run resumes after them."""


# -- served engines (ragbudget.generation.engines) ---------------------------------------------------------
#
# Each message is one line naming the URL and what to check; the CLI prints it without a
# traceback. The structured fields (``url``, ``kind``, ``status`` and the leaves' figures) are
# what code should branch on, never the message text.


class EngineError(RagBudgetError):
    """A served engine could not be used. ``url`` is the route that failed, ``kind`` the engine
    kind (``"vllm"``, ``"llamacpp"``, … or ``""`` before detection), ``status`` the HTTP status
    when there was one; ``body`` the server's structured error (a dict) or the start of its body."""

    def __init__(
        self, message: str, *, url: str = "", kind: str = "", status: int | None = None, body: object = None
    ) -> None:
        Exception.__init__(self, message)
        self.url = url
        self.kind = kind
        self.status = status
        self.body = body


class EngineConnectionError(EngineError, ConnectionError):
    """No usable answer at all: connection refused, unknown host, TLS failure, a connection dropped
    mid-request, or (:class:`EngineTimeoutError`) no answer within the timeout. Never retried
    forever: the message says what to check. ``cause`` names the failure for code that branches on
    it: ``"refused"``, ``"dns"``, ``"tls"``, ``"dropped"``, ``"timeout"`` or ``"unreachable"``
    (anything else on the way)."""

    #: The causes, each as a gateway's answer says it ("the engine … refused the connection").
    CAUSES = {
        "refused": "refused the connection (it is not running or not listening there)",
        "dns": "has a host name that does not resolve",
        "tls": "failed the TLS handshake",
        "dropped": "closed the connection mid-request (it may have crashed or restarted)",
        "timeout": "gave no answer in time",
        "unreachable": "could not be reached",
    }

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        kind: str = "",
        status: int | None = None,
        body: object = None,
        cause: str = "unreachable",
    ) -> None:
        EngineError.__init__(self, message, url=url, kind=kind, status=status, body=body)
        self.cause = cause if cause in self.CAUSES else "unreachable"


class EngineTimeoutError(EngineConnectionError, TimeoutError):
    """The engine gave no answer within ``timeout`` seconds (the engine time-out, CLI
    ``--engine-timeout``; or the connect time-out): hung, still loading, or busy with other
    requests. The server answers 504."""

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        kind: str = "",
        status: int | None = None,
        body: object = None,
        timeout: float | None = None,
    ) -> None:
        EngineConnectionError.__init__(self, message, url=url, kind=kind, status=status, body=body, cause="timeout")
        self.timeout = timeout


class EngineAuthError(EngineError, PermissionError):
    """The engine refused the credentials (401) or the action (403)."""


class EngineResponseError(EngineError, ValueError):
    """The engine answered, but not with what its API promises: not JSON, a missing field, or an
    error status that is neither overload nor a too-long prompt."""


class EngineContextError(EngineError, BudgetError):
    """The prompt did not fit the engine's context, even after the one retry with a budget cut by
    the server's own figures. ``n_prompt_tokens`` and ``n_ctx`` are the server's numbers where it
    gives them (llama.cpp does), or the client's recount with the server's tokenizer against the
    server's advertised window otherwise (``source`` says which); ``max_new_tokens`` is what was
    reserved for the answer. ``needed``/``available`` mirror them for ``except BudgetError``."""

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        kind: str = "",
        status: int | None = None,
        body: object = None,
        n_prompt_tokens: int | None = None,
        n_ctx: int | None = None,
        max_new_tokens: int | None = None,
        source: str = "",
    ) -> None:
        EngineError.__init__(self, message, url=url, kind=kind, status=status, body=body)
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx
        self.max_new_tokens = max_new_tokens
        self.source = source
        self.needed = None if n_prompt_tokens is None else n_prompt_tokens + (max_new_tokens or 0)
        self.available = n_ctx
        self.unit = "tokens"
        self.limit = "engine"  # BudgetError's field (its __init__ is not run here)


class EngineOverloadedError(EngineError, OverloadedError):
    """The engine kept answering 429/503 through the bounded back-off. ``retry_after`` is the
    server's last ``Retry-After`` in seconds (or the client's next delay); ``attempts`` how many
    requests were made."""

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        kind: str = "",
        status: int | None = None,
        body: object = None,
        retry_after: float = 1.0,
        attempts: int = 1,
    ) -> None:
        EngineError.__init__(self, message, url=url, kind=kind, status=status, body=body)
        self.retry_after = retry_after
        self.attempts = attempts
