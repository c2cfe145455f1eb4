"""Durable local files: sha256 of a file, fsync of a file or a folder, a JSON file replaced
atomically. What a local index (:mod:`ragbudget.retrieval.storage`) and the embedding checkpoint
(:mod:`ragbudget.retrieval.checkpoint`) write with; a module of its own so that neither imports
the other for them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "fsync_file", "sha256_file", "write_json_atomic"]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
        fsync_file(path)


def write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
