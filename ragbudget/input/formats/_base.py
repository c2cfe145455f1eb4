"""The readers' contract: what to read (:class:`LoadOptions`, and the options in effect for a
block of code), what a reader returns (:class:`Loaded`), and how it asks for an optional library
(:func:`require`).

A module of its own, below both the readers and the package's :func:`~ragbudget.input.formats.read`
that dispatches to them, so that neither imports the other (``formats/__init__`` imports every
reader by name)."""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ...errors import ConfigError, LoadError

__all__ = ["LoadOptions", "Loaded", "current_options", "load_options", "require"]


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """What to read from formats that hold more than prose; the defaults read the prose only.

    ``ipynb_outputs``: include the text outputs of notebook code cells (binary outputs such as
    images are never indexed, only counted). ``json_fields``: key names (or dotted key paths,
    ``fnmatch`` globs allowed) whose string values are indexed; empty means every string value.
    ``ocr``: run Tesseract on PDF pages without a text layer (needs ``ragbudget[ocr]`` and the
    ``tesseract-ocr`` program); ``ocr_lang`` its language code(s), e.g. ``"eng+deu"``.

    >>> LoadOptions(json_fields=("title", "body"))
    LoadOptions(ipynb_outputs=False, json_fields=('title', 'body'), ocr=False, ocr_lang='eng')
    """

    ipynb_outputs: bool = False
    json_fields: tuple[str, ...] = ()
    ocr: bool = False
    ocr_lang: str = "eng"

    def __post_init__(self) -> None:
        if isinstance(self.json_fields, str):
            raise ConfigError(
                f"json_fields must be a sequence of key names, not one string; pass ({self.json_fields!r},)"
            )
        object.__setattr__(self, "json_fields", tuple(str(f) for f in self.json_fields if str(f)))
        if not self.ocr_lang or not all(p.isalnum() or p == "_" for p in self.ocr_lang.split("+")):
            raise ConfigError(
                f"ocr_lang must be Tesseract language codes like 'eng' or 'eng+deu', got {self.ocr_lang!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "ipynb_outputs": self.ipynb_outputs,
            "json_fields": list(self.json_fields),
            "ocr": self.ocr,
            "ocr_lang": self.ocr_lang,
        }


# LoadOptions is a frozen dataclass: one shared default cannot be changed through any context.
_OPTIONS: contextvars.ContextVar[LoadOptions] = contextvars.ContextVar("ragbudget_load_options", default=LoadOptions())  # noqa: B039


def current_options() -> LoadOptions:
    """The :class:`LoadOptions` in effect (set by :func:`load_options`, else the defaults)."""
    return _OPTIONS.get()


@contextlib.contextmanager
def load_options(options: LoadOptions) -> Iterator[LoadOptions]:
    """Make ``options`` the default of every ``load_document`` call inside the ``with`` block.

    This is how callers that do not pass options through (``Index.build`` today) are reached:

    >>> with load_options(LoadOptions(ipynb_outputs=True)):
    ...     current_options().ipynb_outputs
    True
    >>> current_options().ipynb_outputs
    False
    """
    token = _OPTIONS.set(options)
    try:
        yield options
    finally:
        _OPTIONS.reset(token)


@dataclass(frozen=True)
class Loaded:
    """What a reader returns: pages with one label each, and facts for ``Document.meta``.

    ``furniture`` counts header/footer/master lines the format itself marks and the reader left
    out (DOCX section headers, slide-number placeholders). ``clean`` says whether the pages are
    layout pages on which the repeated-line detector should run (slides, chapters, messages) or
    logical records where a repeated line is content (rows, cells, paragraphs).
    ``warnings`` are one-line notes for the index summary (e.g. a broken message skipped).
    """

    pages: list[str]
    labels: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    furniture: int = 0
    clean: bool = False
    warnings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.pages) != len(self.labels):
            raise ValueError(f"{len(self.pages)} pages but {len(self.labels)} labels")


def require(module: str, extra: str, path: str, what: str) -> ModuleType:
    """Import an optional library or raise the one-line ``missing_dependency`` LoadError."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise LoadError(
            f"{path}: reading {what} needs {module.split('.')[0]}; pip install 'ragbudget[{extra}]'",
            path=path,
            reason="missing_dependency",
            needs=module,
        ) from exc
