"""Tables and records: CSV/TSV (stdlib :mod:`csv`, dialect sniffed) and JSON/JSONL.

A row is rendered with its header names (``question: Where …; answer: Nobel Prize``) so a chunk
cut from the middle of a table still says what each value is.
"""

from __future__ import annotations

import csv
import fnmatch
import json
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ...errors import LoadError
from ..decode import decode_bytes
from ._base import Loaded, LoadOptions

if TYPE_CHECKING:  # the type csv.reader returns (its line_num is read on errors)
    from _csv import Reader

__all__ = ["MAX_FIELD_CHARS", "ROWS_PER_PAGE", "read_csv", "read_json", "read_jsonl"]

#: Largest CSV field accepted (characters). csv's own default is 128 KiB; a bigger field is a blob
#: (an embedded file, a log) and the file is skipped with this reason rather than read unbounded.
MAX_FIELD_CHARS = 1 << 20
#: Rows per page: the unit a citation names ("rows 41-60"); small enough to point at, large
#: enough that a 500-token chunk spans only one or two.
ROWS_PER_PAGE = 20
_SNIFF_BYTES = 64 * 1024


def read_csv(data: bytes, path: str, *, options: LoadOptions, max_bytes: int, fmt: str) -> Loaded:
    """Rows as ``header: value; …`` lines, :data:`ROWS_PER_PAGE` rows a page labelled
    ``rows A-B`` (data rows, 1-based, the header row not counted). The first row is the header.
    The dialect is sniffed (``,`` ``;`` ``|`` tab) unless the file is ``.tsv``."""
    text, _, _ = decode_bytes(data, path=path)
    if fmt == "tsv":
        dialect: type[csv.Dialect] = csv.excel_tab
    else:
        try:
            dialect = csv.Sniffer().sniff(text[:_SNIFF_BYTES], delimiters=",;\t|")
        except csv.Error:
            dialect = csv.excel
    old_limit = csv.field_size_limit()
    csv.field_size_limit(MAX_FIELD_CHARS)
    try:
        rows = list(_rows(csv.reader(text.splitlines(keepends=True), dialect), path))
    finally:
        csv.field_size_limit(old_limit)
    if not rows:
        raise LoadError(f"{path}: the table has no rows", path=path, reason="empty")
    header = [h.strip() or f"column {i + 1}" for i, h in enumerate(rows[0])]
    pages: list[str] = []
    labels: list[str] = []
    body = rows[1:]
    for start in range(0, len(body), ROWS_PER_PAGE):
        block = body[start : start + ROWS_PER_PAGE]
        lines = []
        for row in block:
            pairs = [
                f"{header[i] if i < len(header) else f'column {i + 1}'}: {' '.join(v.split())}"
                for i, v in enumerate(row)
                if v.strip()
            ]
            lines.append("; ".join(pairs))
        pages.append("\n".join(lines))
        end = start + len(block)
        labels.append(f"rows {start + 1}-{end}" if end > start + 1 else f"row {start + 1}")
    if not pages:  # a header alone is still the table's text
        pages, labels = ["; ".join(header)], ["header"]
    return Loaded(
        pages, labels, meta={"rows": len(body), "columns": header, "delimiter": getattr(dialect, "delimiter", ",")}
    )


def _rows(reader: Reader, path: str) -> Iterator[list[str]]:
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            if "field larger than field limit" in str(exc):
                raise LoadError(
                    f"{path}: a field is over {MAX_FIELD_CHARS} characters (line {reader.line_num}): "
                    "a blob, not a table cell; skipped",
                    path=path,
                    reason="too_large",
                ) from exc
            raise LoadError(
                f"{path}: damaged CSV at line {reader.line_num} ({exc})",
                path=path,
                reason="malformed",
            ) from exc
        if any(v.strip() for v in row):
            yield row


# --------------------------------------------------------------------------------------------------
# JSON

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _key_path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    part = key if _IDENT.match(key) else json.dumps(key, ensure_ascii=False)
    return f"{parent}.{part}" if parent else part


def _strings(value: object, path: str, key: str, depth: int = 0) -> Iterator[tuple[str, str, str]]:
    """``(key path, last key name, string)`` for every string value, depth-first in file order."""
    if depth > 200:
        return  # deeper than any export; json.loads' own recursion limit is near 1000
    if isinstance(value, str):
        yield path or "$", key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, _key_path(path, str(k)), str(k), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, _key_path(path, i), key, depth + 1)


def _wanted(fields: tuple[str, ...], path: str, key: str) -> bool:
    if not fields:
        return True
    bare = re.sub(r"\[\d+\]", "", path)  # "data[0].title" is chosen by "data.title" too
    return any(
        fnmatch.fnmatchcase(key, f) or fnmatch.fnmatchcase(path, f) or fnmatch.fnmatchcase(bare, f) for f in fields
    )


def _parse(text: str, path: str, where: str = "") -> object:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise LoadError(f"{path}: invalid JSON{where} ({str(exc)[:120]})", path=path, reason="malformed") from exc


def _pages_of(value: object, options: LoadOptions, prefix: str, pages: list[str], labels: list[str]) -> None:
    for key_path, key, s in _strings(value, "", ""):
        if s.strip() and _wanted(options.json_fields, key_path, key):
            pages.append(s.strip())
            labels.append(prefix + key_path)


def read_json(data: bytes, path: str, *, options: LoadOptions, max_bytes: int, fmt: str) -> Loaded:
    """One page per chosen string value, labelled by its key path (``data[0].paragraphs[1].context``).
    ``options.json_fields`` picks values by key name or key path (globs; ``[i]`` may be left out);
    without it every non-blank string value is read."""
    text, _, _ = decode_bytes(data, path=path)
    pages: list[str] = []
    labels: list[str] = []
    _pages_of(_parse(text, path), options, "", pages, labels)
    return _finish(pages, labels, options, path, {})


def read_jsonl(data: bytes, path: str, *, options: LoadOptions, max_bytes: int, fmt: str) -> Loaded:
    """JSON Lines: like :func:`read_json` per line, labels ``line N: key.path``. A line that is
    not JSON is skipped and reported (the rest of the file is still read)."""
    text, _, _ = decode_bytes(data, path=path)
    pages: list[str] = []
    labels: list[str] = []
    bad: list[int] = []
    n = 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            bad.append(n)
            continue
        _pages_of(value, options, f"line {n}: ", pages, labels)
    if bad and len(bad) == sum(1 for ln in text.splitlines() if ln.strip()):
        raise LoadError(f"{path}: no line is valid JSON", path=path, reason="malformed")
    warnings = [f"{len(bad)} of {n} lines are not valid JSON and were skipped (line {bad[0]} first)"] if bad else []
    return _finish(pages, labels, options, path, {"bad_lines": len(bad)}, warnings)


def _finish(
    pages: list[str],
    labels: list[str],
    options: LoadOptions,
    path: str,
    meta: dict[str, Any],
    warnings: list[str] | None = None,
) -> Loaded:
    if not pages:
        fields = f" in the fields {', '.join(options.json_fields)}" if options.json_fields else ""
        raise LoadError(f"{path}: no string values{fields}", path=path, reason="empty")
    meta["values"] = len(pages)
    return Loaded(pages, labels, meta=meta, warnings=list(warnings or []))
