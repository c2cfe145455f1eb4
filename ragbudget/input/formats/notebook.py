"""Jupyter notebooks (``.ipynb``, nbformat 4) read as plain JSON: no Jupyter install needed."""

from __future__ import annotations

import json
from typing import Any

from ...errors import LoadError
from ..decode import decode_bytes
from ._base import Loaded, LoadOptions

__all__ = ["read_ipynb"]

# Output MIME types that are text, best first; everything else (images, widgets, PDFs) is binary
# for the index and only counted.
_TEXT_MIMES = ("text/markdown", "text/plain")
#: Characters kept from one output: a loop printing a million lines is a log, not a passage.
MAX_OUTPUT_CHARS = 20_000


def _source(value: object) -> str:
    if isinstance(value, list):
        return "".join(str(v) for v in value)
    return value if isinstance(value, str) else ""


def read_ipynb(data: bytes, path: str, *, options: LoadOptions, max_bytes: int, fmt: str) -> Loaded:
    """One page per cell with text, labelled ``cell N`` (N = the cell's 1-based position in the
    notebook, so it matches what Jupyter shows). Markdown cells as they are; code cells fenced in
    the kernel's language; raw cells as text. With ``options.ipynb_outputs`` the text outputs of a
    code cell (stream, results, errors) follow its code; binary outputs are never indexed and are
    counted in ``meta["binary_outputs"]``."""
    text, _, _ = decode_bytes(data, path=path)
    try:
        nb = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise LoadError(
            f"{path}: not a notebook (invalid JSON: {str(exc)[:120]})", path=path, reason="malformed"
        ) from exc
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        version = nb.get("nbformat") if isinstance(nb, dict) else None
        hint = "; upgrade it: jupyter nbconvert --to notebook --nbformat 4" if version and version < 4 else ""
        raise LoadError(f"{path}: not an nbformat 4 notebook (no cells list){hint}", path=path, reason="unsupported")
    meta = nb.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
    lang = ""
    for key in ("kernelspec", "language_info"):
        info = meta.get(key)
        if isinstance(info, dict) and isinstance(info.get("language") or info.get("name"), str):
            lang = str(info.get("language") or info.get("name"))
            break
    pages: list[str] = []
    labels: list[str] = []
    binary = outputs_kept = 0
    for n, cell in enumerate(nb["cells"], 1):
        if not isinstance(cell, dict):
            continue
        kind = cell.get("cell_type")
        src = _source(cell.get("source")).strip("\n")
        parts: list[str] = []
        if kind == "code":
            if src.strip():
                parts.append(f"```{lang}\n{src}\n```")
            for out in cell.get("outputs") or []:
                if not isinstance(out, dict):
                    continue
                shown = _output_text(out)
                if shown is None:
                    binary += 1
                elif options.ipynb_outputs and shown.strip():
                    outputs_kept += 1
                    parts.append(shown[:MAX_OUTPUT_CHARS].rstrip("\n"))
        elif src.strip():
            parts.append(src)
        if parts:
            pages.append("\n".join(parts))
            labels.append(f"cell {n}")
    return Loaded(
        pages,
        labels,
        meta={"cells": len(nb["cells"]), "binary_outputs": binary, "outputs_indexed": outputs_kept, "language": lang},
    )


def _output_text(out: dict[str, Any]) -> str | None:
    """An output's text, ``""`` for an empty one, None when it is binary only."""
    kind = out.get("output_type")
    if kind == "stream":
        return _source(out.get("text"))
    if kind == "error":
        return f"{out.get('ename', 'Error')}: {out.get('evalue', '')}"
    data = out.get("data")
    if isinstance(data, dict):
        for mime in _TEXT_MIMES:
            if mime in data:
                text = _source(data[mime])
                # A plot's text/plain is its repr ("<Figure size 640x480>"): the binary is the
                # output, so it counts as binary and its repr is not indexed.
                if any(not m.startswith("text/") for m in data) and text.startswith("<") and text.endswith(">"):
                    return None
                return text
        return None if data else ""
    return ""
