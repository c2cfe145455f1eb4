"""ragbudget.retrieval.faiss_io: vector files read back whole, or the exact store's rows by id without
loading it; a damaged file is an IndexCorruptError naming it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ragbudget.errors import IndexCorruptError
from ragbudget.retrieval.faiss_io import RowFile, read_index
from ragbudget.retrieval.vectors import FlatStore, make_store


@pytest.fixture(scope="module")
def exact() -> FlatStore:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 32)).astype(np.float32)
    flat = FlatStore(32)
    flat.add(np.arange(3000) * 7 + 3, x / np.linalg.norm(x, axis=1, keepdims=True))  # ids are not row numbers
    return flat


def test_mapped_flat_store_reads_rows_by_id(exact: FlatStore, tmp_path: Path) -> None:
    exact.save(tmp_path / "f.index")
    mapped = FlatStore.load(tmp_path / "f.index", mmap=True)
    ids = exact.ids()[[5, 0, 2999, 17]]
    assert mapped.ntotal == 3000 and not mapped.loaded  # rows come without loading faiss
    assert np.array_equal(mapped.vectors(ids), exact.vectors(ids))
    with pytest.raises(KeyError):
        mapped.vectors([4])  # ids are 7·i + 3
    q = exact.vectors(ids)
    assert np.array_equal(mapped.search(q, 3)[1], exact.search(q, 3)[1])  # maps on demand
    assert np.array_equal(mapped.ids(), exact.ids())


def test_row_file_reads_what_faiss_wrote(exact: FlatStore, tmp_path: Path) -> None:
    exact.save(tmp_path / "f.index")
    rows = RowFile(tmp_path / "f.index")
    assert (rows.dim, rows.ntotal) == (32, 3000)
    ids = np.array([3, 10, 20996], dtype=np.int64)
    assert np.array_equal(rows.rows(ids), exact.vectors(ids))
    assert read_index(tmp_path / "f.index").ntotal == 3000


def test_damaged_or_foreign_files_are_corrupt_errors(exact: FlatStore, tmp_path: Path) -> None:
    (tmp_path / "junk.index").write_bytes(b"not a faiss file at all")
    with pytest.raises(IndexCorruptError, match="junk.index"):
        read_index(tmp_path / "junk.index")
    with pytest.raises(IndexCorruptError, match="junk.index"):
        RowFile(tmp_path / "junk.index")
    hnsw = make_store("hnsw", 32, exact=exact)
    hnsw.finalize()
    hnsw.save(tmp_path / "hnsw.index")
    with pytest.raises(IndexCorruptError, match="not an exact"):  # another store's file
        RowFile(tmp_path / "hnsw.index")
