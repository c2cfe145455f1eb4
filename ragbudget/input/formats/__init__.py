"""Readers for the container and record formats: office documents, books, notebooks, tables, mail.

:func:`ragbudget.input.loaders.load_document` stays the one entry point; it hands the bytes of a file
in one of these formats to :func:`read`, which returns a :class:`Loaded` record. Every reader maps
its natural unit of provenance onto *pages*, so the existing offset → page mapping, chunking and
index storage carry it unchanged:

=========  ====================  ===========================================================
format     one page per          ``meta["page_labels"][i]``
=========  ====================  ===========================================================
docx, odt  body paragraph/table  ``paragraph 12`` / ``table 2`` (heading path: ``#`` lines)
pptx       slide                 ``slide 3``
epub       spine document        ``chapter 2``
ipynb      cell                  ``cell 12``
csv, tsv   block of rows         ``rows 40-59`` (data rows, 1-based, header not counted)
json(l)    string value          its key path: ``data[0].title`` (``line 3: text`` for JSONL)
eml, mbox  message               ``message <id@host>``
=========  ====================  ===========================================================

A chunk's ``page_start``/``page_end`` index into that list (:func:`page_label` formats a range).

Optional libraries (python-docx, python-pptx for the ``office`` extra) are imported when a file
needs them; a missing one is a ``LoadError`` with reason ``missing_dependency`` whose one-line
message says which extra to install. Options that change what is read (notebook outputs, JSON
fields, OCR) are a :class:`LoadOptions` passed to ``load_document`` or set for a block of code
with :func:`load_options`.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence

from ._base import Loaded, LoadOptions, current_options, load_options, require

__all__ = [
    "FORMATS",
    "LoadOptions",
    "Loaded",
    "available",
    "current_options",
    "join_labels",
    "load_options",
    "page_label",
    "read",
    "require",
]

#: File name ending → format name, for the formats read here (``.gz`` may be appended to any).
FORMATS = {
    ".docx": "docx",
    ".pptx": "pptx",
    ".odt": "odt",
    ".epub": "epub",
    ".ipynb": "ipynb",
    ".csv": "csv",
    ".tsv": "tsv",
    ".tab": "tsv",
    ".json": "json",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".eml": "eml",
    ".mbox": "mbox",
}

# format → (module, function); modules are imported on first use so `import ragbudget` stays light.
_READERS = {
    "docx": ("office", "read_docx"),
    "pptx": ("office", "read_pptx"),
    "odt": ("office", "read_odt"),
    "epub": ("epub", "read_epub"),
    "ipynb": ("notebook", "read_ipynb"),
    "csv": ("tabular", "read_csv"),
    "tsv": ("tabular", "read_csv"),
    "json": ("tabular", "read_json"),
    "jsonl": ("tabular", "read_jsonl"),
    "eml": ("mail", "read_eml"),
    "mbox": ("mail", "read_mbox"),
}


def read(fmt: str, data: bytes, path: str, *, options: LoadOptions, max_bytes: int) -> Loaded:
    """Read ``data`` (the file's bytes) as format ``fmt``; raises ``LoadError`` with a reason."""
    module_name, func_name = _READERS[fmt]
    module = importlib.import_module(f"{__name__}.{module_name}")
    loaded: Loaded = getattr(module, func_name)(data, path, options=options, max_bytes=max_bytes, fmt=fmt)
    return loaded


def available(needs: str) -> bool:
    """Whether a dependency a ``missing_dependency`` skip named (``LoadError.needs``) is there
    now: the module imports (a real import: a module that is found but fails to import, a
    broken install, is still missing), or ``program:<name>`` is on ``PATH``.

    >>> available("json"), available("program:no-such-program-here")
    (True, False)
    """
    kind, _, name = needs.rpartition(":")
    if kind == "program":
        import shutil

        return shutil.which(name) is not None
    try:
        importlib.import_module(needs)
    except Exception:  # ImportError, or whatever a broken module raises while it loads
        return False
    return True


def page_label(labels: Sequence[str] | None, page_start: int | None, page_end: int | None = None) -> str | None:
    """A human label for 1-based pages ``page_start..page_end`` given a file's ``page_labels``.

    Without labels it is ``page N`` / ``pages N-M``. Numbered labels of one kind merge into a
    range (``slides 2-3``, ``rows 1-40``); other labels are joined with `` - ``.

    >>> page_label(["slide 1", "slide 2", "slide 3"], 2, 3)
    'slides 2-3'
    >>> page_label(["rows 1-20", "rows 21-40"], 1, 2), page_label(["data.title", "data.body"], 1, 2)
    ('rows 1-40', 'data.title - data.body')
    >>> page_label(None, 4), page_label([], 4, 6), page_label(["cell 1"], 1, 1)
    ('page 4', 'pages 4-6', 'cell 1')
    """
    if page_start is None:
        return None
    end = page_start if page_end is None else page_end
    if not labels or not 1 <= page_start <= len(labels) or not 1 <= end <= len(labels):
        return f"page {page_start}" if end == page_start else f"pages {page_start}-{end}"
    return join_labels(labels[page_start - 1], labels[end - 1])


def join_labels(first: str | None, last: str | None) -> str | None:
    """The label of two adjacent spans joined into one (a merged passage), the way
    :func:`page_label` names a range: numbered labels of one kind become a range.

    >>> join_labels("slide 2", "slide 3"), join_labels("rows 1-20", "rows 21-40")
    ('slides 2-3', 'rows 1-40')
    >>> join_labels("cell 4", "cell 4"), join_labels(None, "cell 2"), join_labels("a.b", "c")
    ('cell 4', 'cell 2', 'a.b - c')
    """
    if first is None or last is None:
        return first if last is None else last
    if first == last:
        return first
    a, b = _NUMBERED.match(first), _NUMBERED.match(last)
    if a and b and a["kind"].rstrip("s") == b["kind"].rstrip("s"):
        return f"{a['kind'].rstrip('s')}s {a['lo']}-{b['hi'] or b['lo']}"
    return f"{first} - {last}"


_NUMBERED = re.compile(r"^(?P<kind>[a-z]+) (?P<lo>\d+)(?:-(?P<hi>\d+))?$")
