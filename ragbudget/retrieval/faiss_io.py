"""FAISS files read back: whole with ``faiss.read_index`` (no pickle), or the exact store's rows by id.

:func:`read_index` is the one way a vector file is loaded (a malformed file is an
:class:`~ragbudget.errors.IndexCorruptError` naming it, never a crash). :class:`RowFile` reads rows
of a written exact store (``IndexIDMap2(IndexFlatIP)``) with ``pread``, parsing just enough of
FAISS's own layout to find them: what a reader whose searches go to another store needs for
rescoring, without loading or mapping the matrix.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import IndexCorruptError

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["RowFile", "read_index"]


def read_index(path: Path, flags: int = 0) -> Any:  # Any: faiss.Index, whose stub types little of it
    """The FAISS index in ``path`` (``flags``: e.g. ``faiss.IO_FLAG_MMAP_IFC`` to map it)."""
    import faiss

    try:
        return faiss.read_index(str(path), flags)
    except Exception as exc:  # faiss raises RuntimeError on a malformed file
        raise IndexCorruptError(f"index file {path} could not be read by faiss: {exc}") from exc


class RowFile:
    """Rows of a written flat store read with ``pread``, by id, without mapping the file.

    Mapped, every page fault also maps its neighbours (the kernel's fault-around), so rescoring
    a few rows per query had brought most of the file into the process within 1,000 queries
    (RssFile 1.38 GB of 1.54 GB at 1M); a read only goes through the page cache. Layout of an
    ``IndexIDMap2(IndexFlatIP)`` file: ``IxM2`` header, ``IxFI`` header (d, ntotal, 2 dummies,
    is_trained, metric), the float count, the floats, the id count, the int64 ids.
    """

    # -1 until ``os.open`` succeeds: ``__del__`` also runs on an instance whose ``__init__``
    # raised (a corrupt file), and must not close a descriptor it never had.
    fd: int = -1

    def __init__(self, path: Path) -> None:
        import numpy as np

        with open(path, "rb") as f:
            head = f.read(256)
        at = head.find(b"IxFI")
        if not head.startswith(b"IxM2") or at < 0:
            raise IndexCorruptError(f"{path} is not an exact (IndexIDMap2(IndexFlatIP)) store")
        self.dim, ntotal = struct.unpack_from("<iq", head, at + 4)
        metric = struct.unpack_from("<i", head, at + 4 + 29)[0]
        off = at + 4 + 33 + (4 if metric > 1 else 0)
        (count,) = struct.unpack_from("<Q", head, off)
        if count not in (ntotal * self.dim, ntotal * self.dim * 4):
            raise IndexCorruptError(f"{path}: {count} values stored for {ntotal} × {self.dim}")
        self.data = off + 8
        ids = np.fromfile(path, dtype="<i8", count=ntotal, offset=self.data + ntotal * self.dim * 4 + 8)
        self.order = np.argsort(ids, kind="stable")
        self.sorted = ids[self.order]
        self.ntotal = int(ntotal)
        self.fd = os.open(path, os.O_RDONLY)

    def rows(self, ids: NDArray[np.int64]) -> NDArray[np.float32]:
        """The rows of ``ids`` (int64), in that order; ``KeyError`` names an id not stored."""
        import numpy as np

        pos = np.minimum(np.searchsorted(self.sorted, ids), max(0, self.ntotal - 1))
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        size = self.dim * 4
        for j, (i, p) in enumerate(zip(ids.tolist(), pos.tolist(), strict=True)):
            if not self.ntotal or int(self.sorted[p]) != i:
                raise KeyError(i)
            out[j] = np.frombuffer(os.pread(self.fd, size, self.data + int(self.order[p]) * size), dtype="<f4")
        return out

    def __del__(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
