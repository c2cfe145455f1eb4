"""ragbudget.retrieval.checkpoint: the vectors a killed writing run leaves for the next one. (A killed
build resuming from it end to end is in test_build.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ragbudget.retrieval.checkpoint import Checkpoint


def test_checkpoint_keeps_whole_records_and_drops_a_torn_tail(tmp_path: Path) -> None:
    ident = {"kind": "hash", "id": "hash-4"}
    ck = Checkpoint(tmp_path, ident)
    ck.add(["a", "b"], np.eye(2, 4, dtype=np.float32), [1, 2])
    ck.add(["c"], np.ones((1, 4), dtype=np.float32), [1])
    ck.close()
    path = tmp_path / "embed.checkpoint"
    data = path.read_bytes()
    path.write_bytes(data[:-5])  # killed in the middle of the last record
    again = Checkpoint(tmp_path, ident)
    assert sorted(again.vectors) == sorted(Checkpoint.key(t) for t in "ab")
    vec, windows = again.get("b")  # type: ignore[misc]
    assert windows == 2 and vec.tolist() == [0.0, 1.0, 0.0, 0.0]
    again.add(["c"], np.ones((1, 4), dtype=np.float32), [1])  # appends after the last whole one
    again.close()
    assert len(Checkpoint(tmp_path, ident).vectors) == 3
    flipped = bytearray(path.read_bytes())
    flipped[-10] ^= 0xFF  # a damaged record fails its crc and is not used
    path.write_bytes(bytes(flipped))
    assert Checkpoint(tmp_path, ident).get("c") is None
    Checkpoint(tmp_path, {"kind": "hash", "id": "hash-8"})  # another embedder: dropped
    assert not path.exists()
