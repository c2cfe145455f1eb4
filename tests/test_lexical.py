"""ragbudget.retrieval.lexical: the FTS5 query built from free text, BM25 over a chunks table kept in step
by triggers, and the fusion of dense and lexical scores."""

from __future__ import annotations

import sqlite3

import pytest

from ragbudget.errors import ConfigError
from ragbudget.retrieval.lexical import _bm25, _ensure_fts, fts5_available, fts_match_query, fuse_scores


def test_fts_match_query_quotes_every_word() -> None:
    assert fts_match_query('Who founded "Apple" AND NOT Microsoft*?') == '"founded" OR "apple" OR "microsoft"'
    assert fts_match_query("the of and") == '"the" OR "of" OR "and"'  # only stop words: kept
    assert fts_match_query("?!") == ""
    assert fts_match_query(" ".join(f"w{i}" for i in range(100))).count(" OR ") == 63


def test_fuse_scores_orders() -> None:
    dense = {"a": 0.9, "b": 0.8, "c": 0.7, "d": 0.6}
    lexical = {"d": 20.0, "c": 10.0, "e": 5.0}
    for method in ("rrf", "score"):
        assert [i for i, _ in fuse_scores(dense, lexical, method=method, lexical_weight=0.0)][:4] == [
            "a",
            "b",
            "c",
            "d",
        ]
        assert [i for i, _ in fuse_scores(dense, lexical, method=method, lexical_weight=1.0)][:3] == ["d", "c", "e"]
        fused = fuse_scores(dense, lexical, method=method, lexical_weight=0.5)
        assert sorted(i for i, _ in fused) == ["a", "b", "c", "d", "e"]
        assert fused[0][1] == 0.9 and fused[-1][1] == 0.6  # mapped onto the dense range
    # RRF: found by both beats first in one only (c: ranks 3 and 2; a: rank 1 dense only).
    rrf = [i for i, _ in fuse_scores(dense, lexical, method="rrf", lexical_weight=0.5)]
    assert rrf.index("c") < rrf.index("a") and rrf.index("d") < rrf.index("a")
    # Ties keep dense order.
    assert [i for i, _ in fuse_scores({"x": 0.5, "y": 0.5}, {}, method="score")] == ["x", "y"]
    assert fuse_scores({}, {}) == []
    with pytest.raises(ConfigError):
        fuse_scores(dense, lexical, method="nope")


@pytest.mark.skipif(not fts5_available(), reason="this Python's SQLite has no FTS5")
def test_bm25_follows_the_chunks_table_and_stems_words() -> None:
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE chunks (id INTEGER PRIMARY KEY, text TEXT)")
    db.executemany(
        "INSERT INTO chunks VALUES (?, ?)",
        [(1, "The founding of the society in 1902."), (2, "Weather and tides."), (3, "Founded, founded again.")],
    )
    assert _ensure_fts(db) == "created"  # back-filled from the rows already there
    assert _ensure_fts(db) == "ok"
    hits = _bm25(db, "Who founded it?", 5)  # porter: "founded" matches "founding" too
    assert sorted(i for i, _ in hits) == [1, 3] and all(s > 0 for _, s in hits)
    assert [i for i, _ in hits] == [3, 1]  # the word twice in a shorter chunk ranks first
    db.execute("UPDATE chunks SET text = 'Tides only.' WHERE id = 3")  # the triggers follow edits
    db.execute("DELETE FROM chunks WHERE id = 1")
    assert _bm25(db, "Who founded it?", 5) == []
    assert [i for i, _ in _bm25(db, "tides", 5, ids=[3])] == [3]  # restricted to the ids given
    assert _bm25(db, "?!", 5) == [] and _bm25(db, "tides", 0) == []
