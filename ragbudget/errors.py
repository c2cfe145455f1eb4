"""The one error hierarchy of ragbudget.

Every message says what was needed, what was there, and what to change. Only the CLI turns these
into exit codes (1 for any ``RagBudgetError``); the library never calls ``sys.exit``.

    RagBudgetError
    ├── ConfigError (ValueError)        bad argument, option or configuration value
    │   └── ArgumentTypeError (TypeError) an argument of the wrong type (bytes for str, "100" for int)
    ├── LoadError                        a document could not be read (the indexer logs and skips it)
    ├── ModelError                       a model, tokenizer or config could not be loaded
    ├── IndexError_ (LookupError)        the on-disk index
    │   ├── IndexNotFoundError           no index in that folder yet
    │   ├── IndexCorruptError            checksum mismatch, truncated or unreadable file
    │   ├── IndexLockedError             another writer holds the lock
    │   └── IndexMismatchError           index built with another embedder / chunking settings
    ├── BudgetError                      the request cannot fit: ``limit`` names what binds
    └── OverloadedError                  admission control: queue full or wait timed out

Leaves subclass the built-in they refine (``ConfigError`` is a ``ValueError``) so callers' existing
``except ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError",
    "BudgetError",
    "ConfigError",
    "IndexCorruptError",
    "IndexEmptyError",
    "IndexError_",
    "IndexLockedError",
    "IndexMismatchError",
    "IndexNotFoundError",
    "LoadError",
    "ModelError",
    "OverloadedError",
    "RagBudgetError",
    "RequestCancelled",
]


class RagBudgetError(Exception):
    """Base class of every error ragbudget raises on purpose."""


class ConfigError(RagBudgetError, ValueError):
    """An argument, option or configuration value is invalid."""


class ArgumentTypeError(ConfigError, TypeError):
    """An argument of a public entry point has the wrong type. Both a ``ConfigError`` (so one
    ``except`` catches every bad argument) and a ``TypeError`` (what Python itself would raise)."""


class LoadError(RagBudgetError):
    """A document could not be loaded. ``reason`` is a short machine-friendly tag."""

    def __init__(self, message: str, *, path: str = "", reason: str = "unreadable") -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason


class ModelError(RagBudgetError):
    """A model, tokenizer or model config could not be found or loaded."""


class IndexError_(RagBudgetError, LookupError):  # noqa: N801 - avoid shadowing builtins.IndexError
    """Base class of on-disk index problems."""


class IndexNotFoundError(IndexError_):
    """There is no index in the given folder."""


class IndexCorruptError(IndexError_):
    """An index file is truncated, unreadable or fails its checksum."""


class IndexLockedError(IndexError_):
    """Another process is writing the index."""


class IndexMismatchError(IndexError_):
    """The index was built with settings incompatible with the ones asked for."""


class IndexEmptyError(IndexError_):
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


class OverloadedError(RagBudgetError):
    """Admission control refused a request: the wait queue is full or the wait timed out."""

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestCancelled(RagBudgetError):
    """A request's ``cancel`` event was set while it waited for admission: it left the queue
    without holding any KV memory. (:meth:`ragbudget.pipeline.Pipeline.ask` turns this into an
    answer with ``finish_reason="cancelled"``.)"""
