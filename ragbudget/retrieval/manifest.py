"""The manifest: the JSON object that names a generation and records how it was written, made and
checked the same way by every storage (a local folder's ``manifest.json``, PostgreSQL's manifest
row, another storage's own place for it).

>>> m = new_manifest({"dim": 384}, generation=3, faiss={"file": "faiss.3.index"})
>>> m["format"], m["format_version"], m["generation"], m["dim"]
('ragbudget-index', 1, 3, 384)
>>> check_manifest(m, "manifest.json")["generation"]
3
>>> check_manifest({**m, "format_version": 2}, "manifest.json")
Traceback (most recent call last):
ragbudget.errors.IndexCorruptError: manifest.json has format version 2, this ragbudget reads 1; upgrade ragbudget
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import IndexCorruptError

__all__ = ["FORMAT", "FORMAT_VERSION", "check_manifest", "new_manifest"]

#: What every manifest says it is.
FORMAT = "ragbudget-index"
#: The format this version reads and writes. A manifest of another version is refused (a newer
#: one: upgrade ragbudget; an older one never existed).
FORMAT_VERSION = 1


def new_manifest(fields: Mapping[str, Any], *, generation: int, **parts: Any) -> dict[str, Any]:
    """The manifest of generation ``generation``: what the writer records (``fields``: settings,
    embedder, counts, the last run), the format, and the storage's own ``parts`` (its files or
    tables, the search store's entry, the lexical index)."""
    return {**fields, "format": FORMAT, "format_version": FORMAT_VERSION, "generation": generation, **parts}


def check_manifest(data: object, where: str, *, generation: int | None = None) -> dict[str, Any]:
    """``data`` when it is a manifest this ragbudget reads (of generation ``generation``, when
    the storage keeps the number apart); else :class:`~ragbudget.errors.IndexCorruptError` naming
    ``where`` and what to do."""
    try:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a ragbudget manifest")
        number = int(data["generation"])
        if generation is not None and number != generation:
            raise ValueError(f"it names generation {number}, the storage {generation}")
        version = int(data["format_version"])
    except (ValueError, KeyError, TypeError) as exc:
        raise IndexCorruptError(
            f"{where} is unreadable ({exc}); rebuild the index with `ragbudget index PATH --rebuild`"
        ) from None
    if version != FORMAT_VERSION:
        raise IndexCorruptError(
            f"{where} has format version {version}, this ragbudget reads {FORMAT_VERSION}; "
            + ("upgrade ragbudget" if version > FORMAT_VERSION else "rebuild the index")
        )
    return data
