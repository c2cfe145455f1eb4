"""The catalogs' shared row encodings: page labels and sentence vectors read back as written,
damaged labels skipped, digests kept with their rows."""

from __future__ import annotations

import numpy as np

from ragbudget.retrieval.rows import (
    DIGEST_BYTES,
    decode_page_labels,
    decode_sentence_rows,
    encode_page_labels,
    encode_sentence_rows,
    sentence_vectors_by_digest,
)


def test_page_labels_round_trip_and_a_damaged_row_loses_only_its_labels() -> None:
    assert encode_page_labels(None) is None and encode_page_labels([]) is None
    rows = [
        ("a.pdf", encode_page_labels(["i", "ii", "1"])),
        ("b.pdf", "[broken"),
        ("c.pdf", None),
        ("d.pdf", '{"x": 1}'),
    ]
    assert decode_page_labels(rows) == {"a.pdf": ["i", "ii", "1"]}


def test_sentence_rows_round_trip_in_float16_and_by_digest() -> None:
    rng = np.random.default_rng(0)
    digests = [bytes([i]) * DIGEST_BYTES for i in range(3)]
    vecs = rng.standard_normal((3, 8)).astype(np.float32)
    joined, blob = encode_sentence_rows(digests, vecs)
    assert len(joined) == 3 * DIGEST_BYTES and len(blob) == 3 * 8 * 2  # float16
    keys, back = decode_sentence_rows(memoryview(joined), memoryview(blob), dim=8)
    assert keys == digests and back.dtype == np.float32
    np.testing.assert_allclose(back, vecs, atol=2e-3)
    both = sentence_vectors_by_digest([(joined, blob), encode_sentence_rows([b"z" * 16], vecs[:1])], dim=8)
    assert set(both) == {*digests, b"z" * 16}
    np.testing.assert_allclose(both[b"z" * 16], vecs[0], atol=2e-3)
    empty = encode_sentence_rows([], np.zeros((0, 8), np.float32))
    assert decode_sentence_rows(*empty, dim=8)[0] == []
