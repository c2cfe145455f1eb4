"""Lexical search: the FTS5 (BM25) table over the chunk texts, and score fusion with dense search.

The table lives in each generation's SQLite file (``chunks_fts``), kept in sync with ``chunks`` by
triggers, so the same atomic generation writes it. An index built before it existed still opens:
the reader builds it in memory on first use (see :class:`~ragbudget.retrieval.index.Index`).
"""

from __future__ import annotations

import logging
import re
import sqlite3
from collections.abc import Sequence
from typing import Any

from ..settings import RetrievalSettings
from ..types import FUSIONS, QUESTION_STOPWORDS

__all__ = [
    "FTS_TOKENIZE",
    "FUSIONS",
    "bm25",
    "ensure_fts",
    "fts5_available",
    "fts_match_query",
    "fuse_checked",
    "fuse_scores",
    "query_words",
    "set_fts5",
    "warn_no_fts5",
]

log = logging.getLogger(__name__)

# BM25 over the chunk texts. A plain (content-storing) FTS5 table, not an external-content one: it
# costs a second copy of the text, but it can be checked row by row against ``chunks`` on a
# read-only connection (verify), and SQLite 3.40 (this Python's) has no contentless deletes.
# Porter stemming: questions say "founded" where the text says "founding".
FTS_TOKENIZE = "porter unicode61 remove_diacritics 2"
_FTS_SCHEMA = f"""
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5(text, tokenize='{FTS_TOKENIZE}');
CREATE TRIGGER IF NOT EXISTS chunks_fts_ai AFTER INSERT ON chunks BEGIN
    INSERT INTO chunks_fts(rowid, text) VALUES (new.id, new.text);
END;
CREATE TRIGGER IF NOT EXISTS chunks_fts_ad AFTER DELETE ON chunks BEGIN
    DELETE FROM chunks_fts WHERE rowid = old.id;
END;
CREATE TRIGGER IF NOT EXISTS chunks_fts_au AFTER UPDATE OF text ON chunks BEGIN
    UPDATE chunks_fts SET text = new.text WHERE rowid = old.id;
END;
"""

# RRF's k: 60 is the constant of the original paper and of Elasticsearch/Weaviate/LlamaIndex.
_RRF_K = 60
# Words that carry no retrieval signal in a question; OR-ing them would only make every chunk match.
_STOP = QUESTION_STOPWORDS | {"he", "her", "his", "me", "my", "our", "she", "should", "us", "we", "yours"}
_FTS_WORD = re.compile(r"\w+")
_FTS_MAX_TERMS = 64

_fts5_ok: bool | None = None
_fts5_warned = False


def fts5_available() -> bool:
    """Whether this Python's SQLite has FTS5 (checked once, on an in-memory database)."""
    global _fts5_ok
    if _fts5_ok is None:
        try:
            con = sqlite3.connect(":memory:")
            try:
                con.execute("CREATE VIRTUAL TABLE t USING fts5(x)")
                _fts5_ok = True
            finally:
                con.close()
        except sqlite3.Error:
            _fts5_ok = False
    return _fts5_ok


def set_fts5(available: bool | None) -> None:
    """Override the FTS5 probe for this process: ``False`` indexes and searches as a SQLite
    without FTS5 does (dense search only, no BM25 table written; for a SQLite whose FTS5 is
    broken, and for tests of that path), ``None`` probes again. ``True`` trusts FTS5 without
    probing — only where it is there. The once-per-process warning is said again after a change."""
    global _fts5_ok, _fts5_warned
    _fts5_ok = available
    _fts5_warned = False


def warn_no_fts5() -> None:
    global _fts5_warned
    if not _fts5_warned:
        _fts5_warned = True
        log.warning(
            "this Python's SQLite (%s) has no FTS5: lexical (BM25) search is off and hybrid "
            "search falls back to dense only; use a Python built with a full SQLite to enable it",
            sqlite3.sqlite_version,
        )


def fts_match_query(text: str, *, max_terms: int = _FTS_MAX_TERMS) -> str:
    """An FTS5 ``MATCH`` expression for free text: its words, each quoted, joined by ``OR``.

    Every word becomes a quoted string (a ``"`` inside is doubled), so FTS5 syntax in the user's
    text — quotes, ``AND``/``NOT``/``NEAR``, ``*``, ``^``, column filters, parentheses — is matched
    as plain words and never raises. Stop words are left out unless nothing else is left; repeated
    words count once; at most ``max_terms`` words. ``""`` when the text has no word at all.

    >>> fts_match_query('Who founded "Apple" AND NOT Microsoft*?')
    '"founded" OR "apple" OR "microsoft"'
    """
    return match_expression(query_words(text, max_terms=max_terms))


def match_expression(words: Sequence[str]) -> str:
    """``words`` (from :func:`query_words`) as the ``MATCH`` expression of :func:`fts_match_query`:
    each quoted, joined by ``OR`` (PostgreSQL's ``websearch_to_tsquery`` reads it alike).

    >>> match_expression(["say", 'a"b'])
    '"say" OR "a""b"'
    """
    return " OR ".join('"' + w.replace('"', '""') + '"' for w in words)


def query_words(text: str, *, max_terms: int = _FTS_MAX_TERMS) -> list[str]:
    """The words of free text a lexical search matches (any of them): lower-cased, each once,
    stop words left out unless nothing else is left, at most ``max_terms``.

    >>> query_words("Who founded Apple, and who founded IBM?")
    ['founded', 'apple', 'ibm']
    """
    words = list(dict.fromkeys(w.lower() for w in _FTS_WORD.findall(text)))
    kept = [w for w in words if w not in _STOP and w not in ("and", "or", "not", "near")] or words
    return kept[:max_terms]


def bm25(db: sqlite3.Connection, query: str, k: int, *, ids: Sequence[int] | None = None) -> list[tuple[int, float]]:
    """``(chunk_id, bm25)`` best first (bm25 negated so higher is better), from ``chunks_fts``.

    With ``ids``, only those chunks are scored (their BM25 still uses whole-corpus statistics).
    A query FTS5 still refuses is logged and answers ``[]``: a question must never fail on syntax.
    """
    expr = fts_match_query(query)
    if not expr or k < 1:
        return []
    sql = "SELECT rowid, -bm25(chunks_fts) FROM chunks_fts WHERE chunks_fts MATCH ?"
    params: list[Any] = [expr]
    if ids is not None:
        ids = [int(i) for i in ids][:900]  # under every SQLite build's bound-parameter limit
        if not ids:
            return []
        sql += f" AND rowid IN ({','.join('?' * len(ids))})"
        params += ids
    sql += " ORDER BY bm25(chunks_fts) LIMIT ?"
    params.append(int(k))
    try:
        return [(int(i), float(s)) for i, s in db.execute(sql, params)]
    except sqlite3.Error as exc:
        log.warning("lexical search skipped for %r: %s", query[:80], exc)
        return []


_FTS_TRIGGERS = ("chunks_fts_ai", "chunks_fts_ad", "chunks_fts_au")


def ensure_fts(db: sqlite3.Connection, *, trusted: bool = True) -> str:
    """Create the FTS table and its triggers on a writable connection and fill it if it was missing.

    ``trusted=False`` says an existing table may be stale (the generation was written by a Python
    without FTS5, which had to drop the triggers): it is rebuilt from ``chunks``. Returns ``"ok"``
    (was there), ``"created"`` (created and back-filled) or ``"unavailable"`` (no FTS5 here; the
    triggers are dropped so that writing ``chunks`` does not need the missing module).
    """
    had = db.execute("SELECT 1 FROM sqlite_master WHERE name='chunks_fts'").fetchone() is not None
    if not fts5_available():
        warn_no_fts5()
        for t in _FTS_TRIGGERS:
            db.execute(f"DROP TRIGGER IF EXISTS {t}")
        return "unavailable"
    if had and not trusted:
        db.execute("DROP TABLE chunks_fts")
        had = False
    db.executescript(_FTS_SCHEMA)
    if had:
        return "ok"
    db.execute("INSERT INTO chunks_fts(rowid, text) SELECT id, text FROM chunks")
    return "created"


def fuse_scores(
    dense: dict[Any, float],
    lexical: dict[Any, float],
    *,
    method: str = RetrievalSettings.fusion,
    lexical_weight: float = RetrievalSettings.lexical_weight,
) -> list[tuple[Any, float]]:
    """Fuse dense and lexical scores of the same items; ``(id, score)`` best first.

    ``dense`` maps ids to similarities (higher is better), ``lexical`` ids to BM25 scores (higher
    is better); an id missing from one mapping did not come up in that search. ``method``:

    * ``"rrf"``: ``(1 - w) / (60 + dense rank) + w / (60 + lexical rank)`` (ranks from 1);
    * ``"score"``: ``(1 - w) · d + w · l``, the dense scores min-max normalized over the
      candidates, the lexical ones divided by their maximum (BM25 is ≥ 0 and an absent chunk
      matched no query word: 0, not merely the lowest candidate); a missing score counts as 0.

    ``w = lexical_weight`` (0: dense order only, 1: lexical only). The fused value is then mapped
    linearly onto the range of the dense scores given, so the result keeps the units of a cosine
    similarity — what ``select_chunks``'s ``temperature`` is tuned for. Ties keep dense order, then
    lexical order.

    ``score`` is the default: on SQuAD (``bench/qa.py --sweep``) it gave the best answer recall
    at small context budgets, where the order of the first few chunks decides.

    >>> fuse_scores({"a": 0.9, "b": 0.8, "c": 0.5}, {"b": 12.0, "c": 3.0})
    [('b', 0.9), ('a', 0.7), ('c', 0.5)]
    >>> fuse_scores({"a": 0.9, "b": 0.8}, {"b": 12.0}, method="rrf")
    [('b', 0.9), ('a', 0.8)]
    """
    from ..settings import check_fusion  # the rule RetrievalSettings checks, written once

    method, lexical_weight = check_fusion(method, lexical_weight)
    return fuse_checked(dense, lexical, method, lexical_weight)


def fuse_checked(
    dense: dict[Any, float], lexical: dict[Any, float], method: str, lexical_weight: float
) -> list[tuple[Any, float]]:
    """:func:`fuse_scores` for settings already checked (a :class:`RetrievalSettings`)."""
    d_order = sorted(dense, key=lambda i: -dense[i])
    l_order = sorted(lexical, key=lambda i: -lexical[i])
    ids = list(dict.fromkeys(d_order + l_order))
    if not ids:
        return []
    w = lexical_weight
    fused: dict[Any, float] = {}
    if method == "rrf":
        d_rank = {i: r for r, i in enumerate(d_order, 1)}
        l_rank = {i: r for r, i in enumerate(l_order, 1)}
        for i in ids:
            f = 0.0
            if i in d_rank:
                f += (1.0 - w) / (_RRF_K + d_rank[i])
            if i in l_rank:
                f += w / (_RRF_K + l_rank[i])
            fused[i] = f
    else:

        def normalized(m: dict[Any, float], *, from_zero: bool) -> dict[Any, float]:
            if not m:
                return {}
            lo, hi = min(m.values()), max(m.values())
            if from_zero and lo >= 0 and hi > 0:
                return {i: v / hi for i, v in m.items()}
            return {i: (v - lo) / (hi - lo) if hi > lo else 1.0 for i, v in m.items()}

        dn = normalized(dense, from_zero=False)
        ln = normalized(lexical, from_zero=True)
        for i in ids:
            fused[i] = (1.0 - w) * dn.get(i, 0.0) + w * ln.get(i, 0.0)
    pos = {i: n for n, i in enumerate(ids)}
    ranked = sorted(ids, key=lambda i: (-fused[i], pos[i]))
    if dense:
        lo, hi = min(dense.values()), max(dense.values())
    else:
        lo, hi = 0.0, 1.0
    f_lo, f_hi = min(fused.values()), max(fused.values())
    span = f_hi - f_lo
    return [(i, round(hi if span <= 0 else lo + (fused[i] - f_lo) / span * (hi - lo), 9)) for i in ranked]
