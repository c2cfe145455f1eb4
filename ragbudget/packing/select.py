"""Choose the retrieved chunks that fit a hard token budget, exactly.

``select_chunks`` turns the top ``fetch_k`` retrieval hits into the context of one prompt:

1. drop hits under ``min_score`` (``below_cutoff``), exact repeats of a better hit (``duplicate``)
   and hits scoring under ``relevance_floor`` × the best hit's score (``below_relevance_floor``:
   past that point more passages stop helping, they only cost prefill time and distract a small
   model);
2. drop near-repeats of a better hit (``redundant``: word-set overlap ≥ ``redundancy``) and give the
   rest an MMR value ``lambda_ * relevance - (1 - lambda_) * max overlap with a better hit``;
3. solve a 0/1 knapsack over the exact cost of each chunk in the *generator's* tokens (text +
   its label/separator overhead) — a DP over tokens, so a small chunk further down the list fills
   the space a top-k-then-truncate strategy would waste;
4. merge chunks that are adjacent in the same file into one passage (one label instead of two; the
   merged passage is recounted exactly), then spend the tokens this frees on the next best chunks;
5. order the passages (``relevance``, ``document`` or ``lost_in_middle``).

A chunk is cut in two cases only, each time to the window of whole sentences (words, if no sentence
fits) that fits and covers the question's words best — not just its beginning — and marked
``truncated``: the single best chunk when it alone is larger than the whole budget, and
(``fill_remainder``) the best chunk left out, cut to the room the whole chunks leave. Without the
second, a budget a few hundred tokens short of the next chunk leaves that room empty or to a
small weak chunk, where a top-k-then-cut pipeline reads the next chunk's beginning: on the SQuAD
tuning split (``bench/qa.py --split squad-tune``, 300–500-token chunks) it raised answer recall at
512 / 1,024 tokens from 82.7% / 91.3% (below greedy fill's 82.7% / 92.7%) to 87.3% / 94.0%. The cap
is never exceeded; every candidate not used is listed in ``dropped`` with its reason.

The module only needs ``count_tokens: Callable[[str], int]``; numpy speeds up the DP.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

from ..errors import ConfigError
from ..input.formats import join_labels
from ..types import ORDERS, QUESTION_STOPWORDS, Source

__all__ = [
    "ORDERS",
    "Candidate",
    "ChunkId",
    "Dropped",
    "Retrieved",
    "SelectedChunk",
    "Selection",
    "Span",
    "select_chunks",
]

DROP_REASONS = ("duplicate", "below_cutoff", "below_relevance_floor", "redundant", "below_span_floor", "over_budget")

# Above this many budget tokens the exact DP table (items x tokens booleans) gets large; the greedy
# density pass alone is used instead (its gap to optimal is at most one chunk's value).
_DP_MAX_CELLS = 20_000_000
# Values are kept strictly positive so that the DP always prefers adding a chunk that fits: that is
# what guarantees the fill (unused tokens < the largest unused candidate's cost).
_MIN_VALUE = 1e-3


#: A chunk's id: the index's row id, or whatever a caller names its own candidates by; kept as given.
ChunkId: TypeAlias = int | str


class Retrieved(Protocol):
    """What selection reads of a retrieval hit: a :class:`~ragbudget.types.Hit`, a
    :class:`Candidate`, a :class:`SelectedChunk`, or any object with these attributes (its
    ``sources`` and ``headings`` are read when it has them)."""

    @property
    def chunk_id(self) -> ChunkId: ...

    @property
    def text(self) -> str: ...

    @property
    def score(self) -> float: ...


@dataclass(frozen=True)
class Candidate:
    """A retrieval hit as the selector sees it (anything with these attributes works, e.g. a
    ``ragbudget.retrieval.index.Hit``)."""

    chunk_id: ChunkId
    text: str
    score: float
    sources: tuple[Source, ...] = ()
    headings: tuple[str, ...] = ()


@dataclass(frozen=True)
class SelectedChunk:
    """One passage of the context: a chunk, or several adjacent chunks of one file merged.

    ``n_tokens`` counts ``text`` in the generator's tokenizer; ``cost`` adds the label/separator
    overhead and is what the budget is charged.
    """

    chunk_ids: tuple[ChunkId, ...]
    text: str
    score: float
    n_tokens: int
    cost: int
    sources: tuple[Source, ...] = ()
    headings: tuple[str, ...] = ()
    truncated: bool = False
    #: With span packing (:mod:`ragbudget.packing.spans`): the sentences of the chunk(s) that went in, in
    #: document order, each a :class:`Span` with its exact offsets and cost. Empty for a whole chunk.
    spans: tuple[Span, ...] = ()

    @property
    def chunk_id(self) -> ChunkId:
        return self.chunk_ids[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "chunk_ids": list(self.chunk_ids),
            "score": round(self.score, 6),
            "n_tokens": self.n_tokens,
            "cost": self.cost,
            "truncated": self.truncated,
            "headings": list(self.headings),
            "sources": [s.to_dict() for s in self.sources],
            "spans": [s.to_dict() for s in self.spans],
            "text": self.text,
        }


@dataclass(frozen=True)
class Span:
    """One sentence (or list item) of a chunk, chosen for the context or left out.

    ``start``/``end`` are offsets in the chunk's text (``chunk.text[start:end] == text``);
    ``source`` is the same text's place in its file (offsets and page(s)). ``score`` is the
    question's evidence for it (0–1), ``n_tokens`` its own count in the generator's tokens.
    ``why``: ``question`` (chosen on its own evidence) or ``neighbour`` (kept for a chosen
    sentence that needs it, see :mod:`ragbudget.packing.spans`' neighbour rule); for a span left out,
    ``over_budget``, ``redundant``, ``duplicate`` or ``below_span_floor`` (its evidence under
    ``span_floor`` × the best sentence's).
    """

    chunk_id: ChunkId
    start: int
    end: int
    text: str
    score: float
    n_tokens: int
    source: Source | None = None
    why: str = "question"

    def to_dict(self) -> dict[str, Any]:
        return {
            "chunk_id": self.chunk_id,
            "start": self.start,
            "end": self.end,
            "score": round(self.score, 6),
            "n_tokens": self.n_tokens,
            "why": self.why,
            "source": self.source.to_dict() if self.source else None,
            "text": self.text,
        }


@dataclass(frozen=True)
class Dropped:
    """A candidate left out, and why: one of ``duplicate``, ``below_cutoff``,
    ``below_relevance_floor``, ``redundant``, ``below_span_floor`` (span packing: none of its
    sentences reached the span floor), ``over_budget``."""

    chunk_id: ChunkId
    reason: str
    score: float
    n_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "chunk_id": self.chunk_id,
            "reason": self.reason,
            "score": round(self.score, 6),
            "n_tokens": self.n_tokens,
        }


@dataclass(frozen=True)
class Selection:
    """The chosen context. ``tokens_used`` (sum of passage costs) never exceeds ``tokens_allowed``."""

    chunks: tuple[SelectedChunk, ...]
    tokens_used: int
    tokens_allowed: int
    dropped: tuple[Dropped, ...] = ()
    order: str = "relevance"
    n_candidates: int = 0
    #: ``"chunks"`` (whole chunks) or ``"spans"`` (sentences inside the best chunks).
    pack: str = "chunks"
    #: With span packing: the sentences of the considered chunks that were left out, each a
    #: :class:`Span` whose ``why`` says why (``over_budget``, ``redundant``, ``duplicate``,
    #: ``below_span_floor``).
    spans_dropped: tuple[Span, ...] = ()

    @property
    def fill(self) -> float:
        """``tokens_used / tokens_allowed`` (1.0 for a zero budget)."""
        return self.tokens_used / self.tokens_allowed if self.tokens_allowed else 1.0

    @property
    def text(self) -> str:
        """The passages joined by blank lines (for recall checks; prompts use their own layout)."""
        return "\n\n".join(c.text for c in self.chunks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "order": self.order,
            "pack": self.pack,
            "tokens_used": self.tokens_used,
            "tokens_allowed": self.tokens_allowed,
            "fill": round(self.fill, 4),
            "n_candidates": self.n_candidates,
            "chunks": [c.to_dict() for c in self.chunks],
            "dropped": [d.to_dict() for d in self.dropped],
            "spans_dropped": [s.to_dict() for s in self.spans_dropped],
        }


@dataclass(eq=False)
class PackItem:
    ids: tuple[ChunkId, ...]
    text: str
    score: float
    sources: tuple[Source, ...]
    headings: tuple[str, ...]
    n_tokens: int
    cost: int
    rank: int  # position in the candidate list (score order); tie-break
    value: float = 0.0
    words: frozenset[str] = field(default_factory=frozenset)
    truncated: bool = False


_WORD = re.compile(r"\w+")
_SENTENCE_END = re.compile(r"(?<=[.!?。！？])[\"')\]]*\s+|\n\s*")


def long_words(text: str) -> frozenset[str]:
    # Words of 4+ characters (and numbers): a cheap, language-agnostic stand-in for dropping
    # stop words, so "the/of/and" do not make every pair of chunks look redundant.
    return frozenset(w for w in _WORD.findall(text.lower()) if len(w) > 3 or w.isdigit())


def _overlap(a: frozenset[str], b: frozenset[str]) -> float:
    """Containment of the smaller word set in the larger: 1.0 when one chunk repeats the other."""
    if not a or not b:
        return 0.0
    return len(a & b) / min(len(a), len(b))


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


def select_chunks(
    question: str,
    candidates: Iterable[Retrieved],
    *,
    budget_tokens: int,
    count_tokens: Callable[[str], int],
    chunk_overhead: int | Callable[[SelectedChunk], int] = 0,
    lambda_: float = 0.7,
    temperature: float = 0.02,
    order: str = "relevance",
    min_score: float | None = None,
    relevance_floor: float = 0.0,
    redundancy: float = 0.9,
    merge_adjacent: bool = True,
    max_merge_gap: int = 2,
    truncate_oversize: bool = True,
    fill_remainder: bool = False,
    similarity: Callable[[SelectedChunk, SelectedChunk], float] | None = None,
) -> Selection:
    """Pick the subset of ``candidates`` that maximizes relevance minus redundancy under a hard cap.

    ``candidates`` are retrieval hits in score order (objects with ``chunk_id``, ``text``,
    ``score``, optional ``sources``/``headings``). ``budget_tokens`` is what the passages may cost
    in total; each passage costs ``count_tokens(text) + chunk_overhead`` (an int, or a function of
    the passage giving its label/separator tokens). ``question`` does not change the ranking (the
    scores already carry it); it picks which window of sentences of an oversize best chunk is kept.

    A chunk's value is ``exp((score - best_score) / temperature)`` (``temperature`` in score units:
    0.02 suits cosine similarities), times ``1 - (1 - lambda_) * penalty`` where ``penalty`` grows
    from 0 to 1 as its word overlap with a better hit goes from 0.5 to 1 (``redundancy`` and above
    drops it). ``similarity(a, b) -> [0, 1]`` replaces the word overlap (e.g. embedding cosine).

    ``fill_remainder`` gives the tokens the whole chunks leave unused to the best window of the
    best chunk left out (above the floor, not redundant), cut to fit; ``False`` (the default)
    leaves them empty. It raises answer recall in the context (bench/qa.py) but is off by default
    until answers are measured with it: on the demo question SmolLM2-135M answered correctly
    without the filler and wrongly with it (tests/test_cli.py's demo test).

    ``relevance_floor`` (0 disables) drops every candidate scoring below that fraction of the best
    candidate's score (when the best is positive): the value above only makes a weak chunk
    *cheap*, never *absent*, so without a floor a large budget is filled down to unrelated text.

    >>> hits = [Candidate("a", "Paris is the capital of France.", 0.9),
    ...         Candidate("b", "Lyon is a city in France.", 0.5)]
    >>> sel = select_chunks("capital?", hits, budget_tokens=8, count_tokens=lambda s: len(s.split()),
    ...                     fill_remainder=True)
    >>> [c.text for c in sel.chunks], sel.tokens_used    # the 2 words left go to "b", cut
    (['Paris is the capital of France.', 'Lyon is'], 8)
    >>> sel = select_chunks("capital?", hits, budget_tokens=8, count_tokens=lambda s: len(s.split()))
    >>> [c.chunk_id for c in sel.chunks], sel.tokens_used, [d.reason for d in sel.dropped]
    (['a'], 6, ['over_budget'])
    """
    check_select_options(
        order=order,
        budget_tokens=budget_tokens,
        temperature=temperature,
        lambda_=lambda_,
        relevance_floor=relevance_floor,
    )
    overhead_of = block_overhead(chunk_overhead)
    cands = list(candidates)
    kept, dropped = prepare_items(
        cands,
        count_tokens,
        overhead_of,
        lambda_=lambda_,
        temperature=temperature,
        min_score=min_score,
        relevance_floor=relevance_floor,
        redundancy=redundancy,
        similarity=similarity,
    )

    chosen, rest = _cut_oversize(kept, budget_tokens, count_tokens, overhead_of, question, truncate_oversize)
    chosen += _knapsack(rest, budget_tokens - sum(c.cost for c in chosen))
    if merge_adjacent and len(chosen) > 1:
        chosen = _merge_and_refill(chosen, rest, budget_tokens, count_tokens, overhead_of, max_merge_gap)
    if fill_remainder:
        chosen += _remainder_cut(chosen, kept, budget_tokens, count_tokens, overhead_of, question)
    return _chunk_selection(chosen, kept, dropped, budget_tokens, order, len(cands))


def _cut_oversize(
    kept: list[PackItem],
    budget: int,
    count_tokens: Callable[[str], int],
    overhead_of: Callable[[SelectedChunk], int],
    question: str,
    truncate_oversize: bool,
) -> tuple[list[PackItem], list[PackItem]]:
    """The best chunk cut to ``budget`` if it alone is larger (and may be cut), and the candidates left to pack."""
    if kept and kept[0].cost > budget and truncate_oversize:
        cut = truncate_item(kept[0], budget, count_tokens, overhead_of, question)
        if cut is not None:
            return [cut], kept[1:]
    return [], kept


def _merge_and_refill(
    chosen: list[PackItem],
    rest: Sequence[PackItem],
    budget: int,
    count_tokens: Callable[[str], int],
    overhead_of: Callable[[SelectedChunk], int],
    max_gap: int,
) -> list[PackItem]:
    """Merge adjacent passages, fill the room that frees with the best of ``rest``, and merge again."""
    chosen = _merge(chosen, count_tokens, overhead_of, max_gap)
    # Merging saves a label per pair: spend the freed tokens on the best leftovers.
    chosen_ids = {cid for c in chosen for cid in c.ids}
    room = budget - sum(c.cost for c in chosen)
    for it in sorted(rest, key=lambda x: (-x.value / max(1, x.cost), x.rank)):
        if it.ids[0] not in chosen_ids and it.cost <= room:
            chosen.append(it)
            chosen_ids.add(it.ids[0])
            room -= it.cost
    return _merge(chosen, count_tokens, overhead_of, max_gap)


def _remainder_cut(
    chosen: Sequence[PackItem],
    kept: Sequence[PackItem],
    budget: int,
    count_tokens: Callable[[str], int],
    overhead_of: Callable[[SelectedChunk], int],
    question: str,
) -> list[PackItem]:
    """``fill_remainder``: the best chunk left out, cut to the room left (``[]`` if none or nothing fits)."""
    room = budget - sum(c.cost for c in chosen)
    chosen_ids = {cid for c in chosen for cid in c.ids}
    nxt = next((it for it in kept if it.ids[0] not in chosen_ids), None)
    cut = truncate_item(nxt, room, count_tokens, overhead_of, question) if nxt and room > 0 else None
    return [cut] if cut is not None else []


def _chunk_selection(
    chosen: list[PackItem], kept: Sequence[PackItem], dropped: list[Dropped], budget: int, order: str, n_candidates: int
) -> Selection:
    """The :class:`Selection` of ``chosen`` in ``order``, every kept chunk not in it dropped as ``over_budget``."""
    used_ids = {cid for c in chosen for cid in c.ids}
    for it in kept:
        if it.ids[0] not in used_ids:
            dropped.append(Dropped(it.ids[0], "over_budget", it.score, it.n_tokens))

    used = sum(c.cost for c in chosen)
    # The invariant the whole library rests on; a violation is a bug here, not a user error.
    assert used <= budget, (used, budget)
    passages = tuple(_as_chunk(c) for c in order_items(chosen, order))
    return Selection(
        chunks=passages,
        tokens_used=used,
        tokens_allowed=budget,
        dropped=tuple(dropped),
        order=order,
        n_candidates=n_candidates,
    )


def block_overhead(chunk_overhead: int | Callable[[SelectedChunk], int]) -> Callable[[SelectedChunk], int]:
    # The per-passage overhead as one function of the chunk, whether given as a function or a number.
    if callable(chunk_overhead):
        return chunk_overhead
    fixed = int(chunk_overhead)
    return lambda _chunk: fixed


def check_select_options(
    *, order: str, budget_tokens: int, temperature: float, lambda_: float, relevance_floor: float
) -> None:
    """The settings :func:`select_chunks` and span packing share, checked once."""
    if order not in ORDERS:
        raise ConfigError(f"order must be one of {', '.join(ORDERS)}; got {order!r}")
    if budget_tokens < 0:
        raise ConfigError(f"budget_tokens must be ≥ 0; got {budget_tokens}")
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0; got {temperature}")
    if not 0.0 <= lambda_ <= 1.0:
        raise ConfigError(f"lambda_ must be in [0, 1]; got {lambda_}")
    if (
        isinstance(relevance_floor, bool)
        or not isinstance(relevance_floor, (int, float))
        or not 0.0 <= relevance_floor <= 1.0
    ):
        raise ConfigError(
            f"relevance_floor must be a number in [0, 1] (a fraction of the best "
            f"candidate's score; 0 disables); got {relevance_floor!r}"
        )


def prepare_items(
    cands: Sequence[Retrieved],
    count_tokens: Callable[[str], int],
    overhead_of: Callable[[SelectedChunk], int],
    *,
    lambda_: float,
    temperature: float,
    min_score: float | None,
    relevance_floor: float,
    redundancy: float,
    similarity: Callable[[SelectedChunk, SelectedChunk], float] | None,
) -> tuple[list[PackItem], list[Dropped]]:
    """Steps 1-2 of :func:`select_chunks`: the candidates worth packing, best first, each with its
    exact cost and MMR value, and the ones left out with their reasons. Span packing
    (:mod:`ragbudget.packing.spans`) starts from the same list."""
    # Stable sort by score: ties keep retrieval order, so results are deterministic.
    ranked = sorted(range(len(cands)), key=lambda i: -float(cands[i].score))
    dropped: list[Dropped] = []
    items: list[PackItem] = []
    seen_text: set[str] = set()
    for rank, i in enumerate(ranked):
        c = cands[i]
        cid, text, score = c.chunk_id, str(c.text), float(c.score)
        sources = tuple(getattr(c, "sources", ()) or ())
        headings = tuple(getattr(c, "headings", ()) or ())
        if min_score is not None and score < min_score:
            dropped.append(Dropped(cid, "below_cutoff", score, count_tokens(text)))
            continue
        key = _norm(text)
        n = count_tokens(text)
        if key in seen_text or not key:
            dropped.append(Dropped(cid, "duplicate", score, n))
            continue
        seen_text.add(key)
        item = PackItem((cid,), text, score, sources, headings, n, 0, rank, words=long_words(text))
        item.cost = n + int(overhead_of(_as_chunk(item)))
        items.append(item)

    # MMR against better-ranked kept items. Exact MMR is sequential over the *selected* set; scoring
    # against every better candidate instead is a static approximation that lets a knapsack choose
    # the subset (a redundant pair is still never both worth full value).
    #
    # Relevance is exp((score - best) / temperature), not a linear rescale: retrieval quality is
    # concentrated in the first few hits, and with flat values a knapsack would happily trade the
    # 2nd-best chunk for two small 20th-ranked ones. Overlap below 0.5 is ordinary topical overlap
    # (same article, same entities) and costs nothing; above it the penalty grows linearly.
    hi = max((it.score for it in items), default=0.0)
    if relevance_floor > 0 and hi > 0:
        floor = relevance_floor * hi
        for it in [it for it in items if it.score < floor]:
            dropped.append(Dropped(it.ids[0], "below_relevance_floor", it.score, it.n_tokens))
        items = [it for it in items if it.score >= floor]
    kept: list[PackItem] = []
    for it in items:
        rel = math.exp(max(-50.0, (it.score - hi) / temperature))
        red = 0.0
        for k in kept:
            sim = similarity(_as_chunk(it), _as_chunk(k)) if similarity else _overlap(it.words, k.words)
            red = max(red, sim)
        if red >= redundancy:
            dropped.append(Dropped(it.ids[0], "redundant", it.score, it.n_tokens))
            continue
        penalty = max(0.0, (red - 0.5) / 0.5)
        it.value = max(_MIN_VALUE, rel * (1.0 - (1.0 - lambda_) * penalty))
        kept.append(it)
    return kept, dropped


def _as_chunk(it: PackItem) -> SelectedChunk:
    return SelectedChunk(
        chunk_ids=it.ids,
        text=it.text,
        score=it.score,
        n_tokens=it.n_tokens,
        cost=it.cost,
        sources=it.sources,
        headings=it.headings,
        truncated=it.truncated,
    )


def _knapsack(items: Sequence[PackItem], capacity: int) -> list[PackItem]:
    """Exact 0/1 knapsack over integer token costs (numpy DP), greedy by density when too big."""
    fits = [it for it in items if it.cost <= capacity]
    if not fits or capacity <= 0:
        return [it for it in fits if it.cost <= 0]
    if sum(it.cost for it in fits) <= capacity:
        return list(fits)
    if len(fits) * (capacity + 1) > _DP_MAX_CELLS:
        return _greedy(fits, capacity)
    import numpy as np

    dp = np.zeros(capacity + 1)
    take = np.zeros((len(fits), capacity + 1), dtype=bool)
    for i, it in enumerate(fits):
        c = it.cost
        if c == 0:
            dp += it.value
            take[i, :] = True
            continue
        cand = dp[:-c] + it.value
        better = cand > dp[c:] + 1e-12
        take[i, c:] = better
        dp[c:] = np.where(better, cand, dp[c:])
    out, w = [], capacity
    for i in range(len(fits) - 1, -1, -1):
        if take[i, w]:
            out.append(fits[i])
            w -= fits[i].cost
    out.reverse()
    # The DP maximizes value; a greedy top-up can only add (values > 0 means the DP already left
    # nothing that fits, but float ties can), so run it for safety.
    room = capacity - sum(it.cost for it in out)
    taken = {id(x) for x in out}
    for it in fits:
        if id(it) not in taken and it.cost <= room:
            out.append(it)
            room -= it.cost
    return out


def _greedy(items: Sequence[PackItem], capacity: int) -> list[PackItem]:
    out, room = [], capacity
    for it in sorted(items, key=lambda x: (-x.value / max(1, x.cost), x.rank)):
        if it.cost <= room:
            out.append(it)
            room -= it.cost
    return out


# Question words that say nothing about where the answer is.
_QSTOP = QUESTION_STOPWORDS


def _terms(text: str) -> set[str]:
    # A 6-character prefix is a crude, language-agnostic stemmer: "founded"/"founding" meet.
    return {w[:6] for w in _WORD.findall(text.lower()) if w not in _QSTOP and (len(w) > 2 or w.isdigit())}


def truncate_item(
    it: PackItem,
    budget: int,
    count_tokens: Callable[[str], int],
    overhead_of: Callable[[SelectedChunk], int],
    question: str = "",
) -> PackItem | None:
    """The window of whole sentences of ``it`` (else of words) that fits ``budget`` and best covers
    the question's words; ties (and a question sharing no word) keep the earliest window.

    Coverage weights each question word by how rare it is among the chunk's sentences (a word in
    every sentence says nothing about where the answer is). Every candidate window is counted
    exactly, so the result always fits.
    """

    def cost_of(piece: str) -> int:
        probe = PackItem(it.ids, piece, it.score, it.sources, it.headings, 0, 0, it.rank)
        return count_tokens(piece) + int(overhead_of(_as_chunk(probe)))

    text = it.text
    qterms = _terms(question)
    for pattern in (_SENTENCE_END, re.compile(r"\s+")):
        units = _text_units(text, pattern)
        window = _best_window(text, units, qterms, cost_of, budget) if units else None
        if window is None:
            continue
        cut = _cut_window(it, units[window[0]][0], units[window[1]][1], count_tokens, overhead_of)
        if cut.cost <= budget:
            return cut
    return None


def _text_units(text: str, pattern: re.Pattern[str]) -> list[tuple[int, int]]:
    """Units: the text between consecutive separators (a sentence, or a word), as offsets; blank ones out."""
    seps = [m for m in pattern.finditer(text) if m.start() > 0 and m.end() < len(text)]
    starts = [0] + [m.end() for m in seps]
    ends = [m.start() for m in seps] + [len(text)]
    return [(a, b) for a, b in zip(starts, ends, strict=True) if text[a:b].strip()]


def _best_window(
    text: str, units: list[tuple[int, int]], qterms: set[str], cost_of: Callable[[str], int], budget: int
) -> tuple[int, int] | None:
    """The first and last unit of the window that fits ``budget`` and best covers ``qterms`` (ties: the earliest)."""
    unit_terms = [_terms(text[a:b]) & qterms for a, b in units]
    df: dict[str, int] = {}
    for ts in unit_terms:
        for t in ts:
            df[t] = df.get(t, 0) + 1
    weight = {t: math.log(1.0 + len(units) / d) for t, d in df.items()}
    fits: dict[tuple[int, int], int] = {}

    def ok(i: int, j: int) -> bool:
        if (i, j) not in fits:
            fits[(i, j)] = cost_of(text[units[i][0] : units[j][1]].strip())
        return fits[(i, j)] <= budget

    # Two pointers: the longest fitting window for each start. The end never needs to move
    # back by more than BPE noise, so this costs O(units) exact counts, not O(units²).
    best: tuple[float, int, int] | None = None
    j = 0
    for i in range(len(units)):
        j = max(j, i)
        while j >= i and not ok(i, j):
            j -= 1
        if j < i:
            j = i
            continue
        while j + 1 < len(units) and ok(i, j + 1):
            j += 1
        covered: set[str] = set().union(*unit_terms[i : j + 1])
        value = sum(weight[t] for t in covered)
        if best is None or value > best[0] + 1e-12:
            best = (value, i, j)
    return None if best is None else (best[1], best[2])


def _cut_window(
    it: PackItem, start: int, end: int, count_tokens: Callable[[str], int], overhead_of: Callable[[SelectedChunk], int]
) -> PackItem:
    """``it`` cut to its text's ``[start, end)`` (stripped), its first source narrowed to match, counted exactly."""
    text = it.text
    kept = text[start:end].strip()
    offset = start + (len(text[start:]) - len(text[start:].lstrip()))
    src = tuple(_shorten(s, offset, len(kept)) for s in it.sources[:1]) + it.sources[1:]
    cut = PackItem(
        it.ids,
        kept,
        it.score,
        src,
        it.headings,
        count_tokens(kept),
        0,
        it.rank,
        value=it.value,
        words=it.words,
        truncated=True,
    )
    # Recount with the shortened source: a label that names offsets or pages may change.
    cut.cost = cut.n_tokens + int(overhead_of(_as_chunk(cut)))
    return cut


def _shorten(s: Source, offset: int, length: int) -> Source:
    start = min(s.end, s.start + offset)
    return Source(s.path, start, min(s.end, start + length), s.page_start, s.page_end, s.label)


def _merge(
    chosen: list[PackItem],
    count_tokens: Callable[[str], int],
    overhead_of: Callable[[SelectedChunk], int],
    max_gap: int,
) -> list[PackItem]:
    """Merge passages whose (single-source) spans touch in the same file; recount exactly and keep
    a merge only if it does not cost more than the two passages apart."""
    mergeable = [c for c in chosen if len(c.sources) == 1 and not c.truncated]
    others = [c for c in chosen if len(c.sources) != 1 or c.truncated]
    mergeable.sort(key=lambda c: (c.sources[0].path, c.sources[0].start))
    out: list[PackItem] = []
    for c in mergeable:
        prev = out[-1] if out else None
        if prev is not None:
            a, b = prev.sources[0], c.sources[0]
            if a.path == b.path and 0 <= b.start - a.end <= max_gap:
                sep = "\n" if b.start > a.end else ""
                text = prev.text + sep + c.text
                src = Source(
                    a.path,
                    a.start,
                    b.end,
                    a.page_start if a.page_start is not None else b.page_start,
                    b.page_end if b.page_end is not None else a.page_end,
                    join_labels(a.label, b.label),
                )
                merged = PackItem(
                    prev.ids + c.ids,
                    text,
                    max(prev.score, c.score),
                    (src,),
                    prev.headings or c.headings,
                    0,
                    0,
                    min(prev.rank, c.rank),
                    value=prev.value + c.value,
                    words=prev.words | c.words,
                )
                merged.n_tokens = count_tokens(text)
                merged.cost = merged.n_tokens + int(overhead_of(_as_chunk(merged)))
                if merged.cost <= prev.cost + c.cost:
                    out[-1] = merged
                    continue
        out.append(c)
    return out + others


def order_items(chosen: list[PackItem], order: str) -> list[PackItem]:
    by_rel = sorted(chosen, key=lambda c: (-c.score, c.rank))
    if order == "relevance":
        return by_rel
    if order == "document":

        def key(c: PackItem) -> tuple[str, int, int]:
            s = c.sources[0] if c.sources else None
            return (s.path if s else "\uffff", s.start if s else 0, c.rank)

        return sorted(chosen, key=key)
    # lost_in_middle: ranks 1, 3, 5, ... from the front, 2, 4, 6, ... from the back.
    front = by_rel[0::2]
    back = by_rel[1::2]
    return front + back[::-1]
