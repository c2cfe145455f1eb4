"""The embedding checkpoint: vectors a writing run embedded, kept across a kill so a re-run resumes.

A writer appends each embedded batch to ``embed.checkpoint`` (in the storage's scratch folder,
the index folder for a local index) and fsyncs it; a run killed before its commit leaves it, and
the next run reuses those vectors; the commit removes it. Keyed by the text itself, so it serves
whatever chunking, dedup or file order the re-run has, and sentence vectors as well as chunk ones.

>>> import tempfile, numpy as np
>>> folder = Path(tempfile.mkdtemp())
>>> ck = Checkpoint(folder, {"kind": "hash", "id": "hash-2"})
>>> ck.add(["a cat"], np.array([[1.0, 0.0]]), [1])
>>> ck.close()
>>> Checkpoint(folder, {"kind": "hash", "id": "hash-2"}).get("a cat")[0].tolist()
[1.0, 0.0]
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .durable import fsync_dir

__all__ = ["CHECKPOINT", "Checkpoint"]

log = logging.getLogger(__name__)

#: The checkpoint's file name. Not a generation file: a writer's clean-up of leftovers keeps it.
CHECKPOINT = "embed.checkpoint"


class Checkpoint:
    """Vectors embedded by the run in progress, kept across a kill so a re-run resumes.

    ``embed.checkpoint`` in the index folder: a header (magic, length, JSON: embedder identity and
    dimension), then fixed-size records ``sha256(text) | windows (u32) | vector (dim × f32) |
    crc32``, appended and fsync'ed once per embedded batch. Loading keeps the records up to the
    first torn or damaged one; a file written for another embedder is deleted. The writer removes
    it once its vectors are committed (or when a run had nothing to commit). Keyed by the text
    itself, so it holds whatever chunking, dedup or file order the re-run has.
    """

    MAGIC = b"RBEMBCK1"

    def __init__(self, folder: Path, identity: Mapping[str, Any]) -> None:
        self.path = folder / CHECKPOINT
        self.identity = json.loads(json.dumps(identity))  # as it reads back from JSON
        self.vectors: dict[bytes, tuple[Any, int]] = {}
        self.dim: int | None = None
        self.valid_bytes = 0
        self.fd: int | None = None
        self._load()

    @staticmethod
    def key(text: str) -> bytes:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()

    def _record_size(self) -> int:
        assert self.dim is not None
        return 32 + 4 + 4 * self.dim + 4

    def _load(self) -> None:
        import numpy as np

        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("ignoring the embedding checkpoint %s: %s", self.path, exc)
            return
        try:
            if not data.startswith(self.MAGIC):
                raise ValueError("not a checkpoint")
            (n,) = struct.unpack_from("<I", data, len(self.MAGIC))
            start = len(self.MAGIC) + 4
            header = json.loads(data[start : start + n])
            pos = start + n
        except (ValueError, struct.error) as exc:
            log.warning("removing an unreadable embedding checkpoint %s (%s)", self.path, exc)
            self._unlink()
            return
        if header.get("identity") != self.identity:
            log.info("removing the embedding checkpoint %s: written for another embedder", self.path)
            self._unlink()
            return
        self.dim = int(header["dim"])
        size = self._record_size()
        while pos + size <= len(data):
            rec = data[pos : pos + size]
            if zlib.crc32(rec[:-4]) != struct.unpack("<I", rec[-4:])[0]:
                break  # a torn or damaged tail: keep what came before
            (windows,) = struct.unpack_from("<I", rec, 32)
            self.vectors[rec[:32]] = (np.frombuffer(rec[36:-4], dtype="<f4").copy(), int(windows))
            pos += size
        self.valid_bytes = pos
        if self.vectors:
            log.info("resuming from %d embedded chunks checkpointed by an interrupted run", len(self.vectors))

    def get(self, text: str) -> tuple[Any, int] | None:
        return self.vectors.get(self.key(text))

    def add(self, texts: Sequence[str], vectors: Any, windows: Sequence[int]) -> None:
        """Append one embedded batch and fsync it."""
        import numpy as np

        vecs = np.ascontiguousarray(vectors, dtype="<f4")
        if self.fd is None:
            if self.dim is not None and self.dim != vecs.shape[1]:
                self._unlink()
            if self.dim is None or self.valid_bytes == 0:
                self.dim = int(vecs.shape[1])
                header = json.dumps({"identity": self.identity, "dim": self.dim}).encode()
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.write(self.fd, self.MAGIC + struct.pack("<I", len(header)) + header)
            else:
                self.fd = os.open(self.path, os.O_WRONLY)
                os.ftruncate(self.fd, self.valid_bytes)  # drop a torn tail before appending
                os.lseek(self.fd, 0, os.SEEK_END)
        out = bytearray()
        for text, vec, w in zip(texts, vecs, windows, strict=True):
            rec = self.key(text) + struct.pack("<I", int(w)) + vec.tobytes()
            out += rec + struct.pack("<I", zlib.crc32(rec))
        os.write(self.fd, bytes(out))
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def _unlink(self) -> None:
        self.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        self.vectors, self.dim, self.valid_bytes = {}, None, 0

    def remove(self) -> None:
        """The run committed (or had nothing to commit): the checkpoint is spent."""
        self._unlink()
        fsync_dir(self.path.parent)
