"""ragbudget.retrieval.build, the index builder's own parts: the embedding checkpoint a killed build resumes
from, and the embedder identity that decides whether stored vectors can be reused. (Builds end to
end — incremental updates, kills, dedup modes — are in test_index.py, through ``Index.build``.)"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ragbudget.retrieval.build import _Checkpoint, _identity, _light_spec
from ragbudget.retrieval.embed import Embedder, HashEmbedder


class _Letters(Embedder):
    """A custom embedder (not one ragbudget knows by kind): one dimension per letter a-h."""

    id = "letters-8"

    def __init__(self, pooling: str = "windows") -> None:
        self.pooling = pooling

    @property
    def dim(self) -> int:
        return 8

    @property
    def max_tokens(self) -> int:
        return 32

    def _token_spans(self, texts: Sequence[str]) -> list[list[tuple[int, int]]]:
        return [[(i, i + 1) for i in range(len(t))] for t in texts]

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), 8), dtype=np.float32)
        for row, t in zip(out, texts, strict=True):
            for c in t:
                if "a" <= c <= "h":
                    row[ord(c) - ord("a")] += 1
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def test_a_custom_embedders_identity_holds_its_id_and_pooling() -> None:
    # Vectors pooled another way are other vectors: changing pooling must not reuse stored ones.
    windows, mean = _light_spec(_Letters()), _light_spec(_Letters(pooling="mean"))
    assert windows == {"kind": "custom", "id": "letters-8", "pooling": "windows"}
    assert _identity(windows) != _identity(mean)
    assert _light_spec(HashEmbedder(dim=16)) == HashEmbedder(dim=16).spec()
    assert _identity(_light_spec(HashEmbedder(dim=16))) != _identity(_light_spec(HashEmbedder(dim=32)))


def test_checkpoint_keeps_whole_records_and_drops_a_torn_tail(tmp_path: Path) -> None:

    ident = {"kind": "hash", "id": "hash-4"}
    ck = _Checkpoint(tmp_path, ident)
    ck.add(["a", "b"], np.eye(2, 4, dtype=np.float32), [1, 2])
    ck.add(["c"], np.ones((1, 4), dtype=np.float32), [1])
    ck.close()
    path = tmp_path / "embed.checkpoint"
    data = path.read_bytes()
    path.write_bytes(data[:-5])  # killed in the middle of the last record
    again = _Checkpoint(tmp_path, ident)
    assert sorted(again.vectors) == sorted(_Checkpoint.key(t) for t in "ab")
    vec, windows = again.get("b")  # type: ignore[misc]
    assert windows == 2 and vec.tolist() == [0.0, 1.0, 0.0, 0.0]
    again.add(["c"], np.ones((1, 4), dtype=np.float32), [1])  # appends after the last whole one
    again.close()
    assert len(_Checkpoint(tmp_path, ident).vectors) == 3
    flipped = bytearray(path.read_bytes())
    flipped[-10] ^= 0xFF  # a damaged record fails its crc and is not used
    path.write_bytes(bytes(flipped))
    assert _Checkpoint(tmp_path, ident).get("c") is None
    _Checkpoint(tmp_path, {"kind": "hash", "id": "hash-8"})  # another embedder: dropped
    assert not path.exists()
