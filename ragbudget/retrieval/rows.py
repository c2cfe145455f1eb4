"""How a catalog's rows hold what is not plain text, for every storage alike: a file's page labels
as a JSON list, a chunk's sentence vectors as its sentences' 16-byte digests joined and their
rows as little-endian float16 (``sentence_vectors``). The SQLite catalog and PostgreSQL's read and
write these columns through this module, so an index copied between them (``ragbudget copy``)
reads back the same.

>>> import numpy as np
>>> digests, blob = encode_sentence_rows([b"a" * 16, b"b" * 16], np.eye(2, 3, dtype="float32"))
>>> keys, rows = decode_sentence_rows(digests, blob, dim=3)
>>> keys == [b"a" * 16, b"b" * 16], rows.tolist()
(True, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
>>> decode_page_labels([("deck.pptx", '["1", "2"]'), ("bad.pdf", "{oops")])
{'deck.pptx': ['1', '2']}
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import ArrayLike, NDArray

__all__ = [
    "DIGEST_BYTES",
    "SENTENCE_DTYPE",
    "decode_page_labels",
    "decode_sentence_rows",
    "encode_page_labels",
    "encode_sentence_rows",
    "sentence_vectors_by_digest",
]

#: Bytes of one sentence's digest (:func:`~ragbudget.packing.sentences.sentence_digest`).
DIGEST_BYTES = 16
#: How sentence vectors are stored: float16, little-endian (half the bytes; cosine ranks unchanged).
SENTENCE_DTYPE = "<f2"


def encode_page_labels(labels: Sequence[str] | None) -> str | None:
    """A file's page labels as the column holds them (``None``: the format names no pages)."""
    return json.dumps(list(labels)) if labels else None


def decode_page_labels(rows: Iterable[tuple[str, Any]]) -> dict[str, list[str]]:
    """``{path: labels}`` of ``(path, column)`` rows; a damaged row loses its labels, never the source."""
    labels: dict[str, list[str]] = {}
    for path, blob in rows:
        try:
            value = json.loads(blob)
        except (TypeError, ValueError):
            continue
        if isinstance(value, list):
            labels[path] = [str(x) for x in value]
    return labels


def encode_sentence_rows(
    digests: Sequence[bytes], vectors: ArrayLike, dtype: str = SENTENCE_DTYPE
) -> tuple[bytes, bytes]:
    """One chunk's sentence vectors as its row holds them: ``(digests joined, rows as dtype)``."""
    import numpy as np

    return b"".join(digests), np.asarray(vectors).astype(dtype).tobytes()


def decode_sentence_rows(
    digests: bytes | memoryview, blob: bytes | memoryview, *, dim: int, dtype: str = SENTENCE_DTYPE
) -> tuple[list[bytes], NDArray[np.float32]]:
    """One chunk's row back: its sentences' digests and their vectors as float32 rows."""
    import numpy as np

    digests = bytes(digests)
    n = len(digests) // DIGEST_BYTES
    rows = np.frombuffer(bytes(blob), dtype=dtype).reshape(n, dim).astype(np.float32)
    return [digests[DIGEST_BYTES * j : DIGEST_BYTES * (j + 1)] for j in range(n)], rows


def sentence_vectors_by_digest(
    rows: Iterable[tuple[bytes | memoryview, bytes | memoryview]], dim: int
) -> dict[bytes, NDArray[np.float32]]:
    """Every stored sentence vector by its digest, from ``(digests, vectors)`` rows (what a rebuild
    with the same embedder reuses)."""
    out: dict[bytes, NDArray[np.float32]] = {}
    for digests, blob in rows:
        keys, mat = decode_sentence_rows(digests, blob, dim=dim)
        out.update(zip(keys, mat, strict=True))
    return out
