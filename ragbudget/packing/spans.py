"""Pack sentences, not whole chunks: the question's spans inside the best retrieved chunks.

A 300–500-token chunk does not fit a 256-token allowance at all, and in a larger one most of a
chunk is not about the question. :func:`select_spans` keeps chunks as the unit of retrieval and
provenance but packs at sentence granularity inside the best of them:

1. the chunks are filtered exactly as :func:`~ragbudget.packing.select.select_chunks` filters them (cut-off,
   duplicates, relevance floor, redundancy), and the best few — until their whole text is
   ``pool`` × the budget — are split into sentences (and list items) with exact offsets
   (:mod:`ragbudget.packing.sentences`, as the index split them to store their vectors);
2. each sentence gets evidence for the question: BM25 over the pool's sentences (lexical), cosine
   to the question with the index's embedder (dense; vectors cached by content hash, see
   :class:`SpanScorer`), and its chunk's retrieval value (a sentence of the best chunk starts
   ahead);
3. sentences are taken greedily by that evidence, discounted by MMR against what is already in
   (word overlap ≥ ``redundancy`` drops a sentence as ``redundant``; evidence under ``span_floor``
   × the best sentence's, ``below_span_floor``, however much room is left), each admission counted
   exactly: the passage it joins is re-rendered and re-counted in the generator's tokens, label
   included, so the sum of passage costs never exceeds the budget — the same contract as whole
   chunks, which :func:`~ragbudget.fitting.fit_prompt` then checks on the rendered chat template
   (on a served engine the passage's cost is composed from counted pieces instead:
   ``composed=True``, :mod:`ragbudget.packing.pieces`);
4. a sentence that cannot stand alone brings its neighbour (the *neighbour rule*, below);
5. one passage per chunk: its chosen sentences in document order, consecutive ones as the document
   has them, gaps shown as `` … ``; passages of one file stay in document order.

**Neighbour rule** (simple on purpose, so it can be predicted): a sentence whose first word is a
pronoun or a connective (``He``, ``It``, ``This``, ``They``, ``However``, ``But``, ``Also``, ``As a
result``, … — :data:`NEEDS_PREVIOUS`) comes with the sentence before it in the same chunk, and
that one with its own if it needs it too, up to :data:`MAX_CHAIN` sentences back; a list item
(a line starting ``-``, ``*``, ``•``, ``1.``, ``a)``) comes with its lead-in, the nearest sentence
before the list. Not covered: a pronoun later in a sentence, a lead-in in the previous chunk.

Cost: splitting, BM25 and the exact counts are milliseconds; embedding the pool's sentences is the
part that costs (the embedder's forward pass: 78–95% of a cold call, bench/spans_profile.py;
0.2–0.34× the generator's prefill of the same prompt on a 2-core CPU). So an index embeds every
chunk's sentences at build time (:meth:`ragbudget.retrieval.index.Index.sentence_vectors`) and
:class:`SpanScorer` reads them first: a question then embeds no sentence and span packing adds a
few milliseconds (bench/spans_speed.py). On a served engine, costs are composed
(:mod:`ragbudget.packing.pieces`): no admission asks the engine anything.

Citations stay exact: every :class:`Span` has its offsets in the chunk's text (``chunk.text[start:
end] == span.text``) and in its file (``span.source``), and the page(s) of the chunk it came from
(exact when the chunk lies on one page; the index keeps no page breaks inside a chunk, so a chunk
over a page break gives its page range).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..types import DEFAULT_PACK, DEFAULT_SPAN_FLOOR, PACKS, Source
from .pieces import JOINER, composed_tokens, label_tokens, span_pieces, unit_edges
from .scoring import SentenceEmbedder, SpanScorer, VectorCache, bm25, content_terms
from .select import (
    Dropped,
    PackItem,
    Retrieved,
    SelectedChunk,
    Selection,
    Span,
    block_overhead,
    check_select_options,
    long_words,
    order_items,
    prepare_items,
    truncate_item,
)
from .sentences import NEEDS_PREVIOUS, needs_previous, sentence_digest, sentence_texts, split_sentences

# Span (a record of a Selection: select.py's) and the sentence names (split_sentences,
# needs_previous, sentence_digest...) were defined here until issue #32: they resolve here too,
# as do JOINER and span_pieces (pieces.py's: composed costs).
__all__ = [
    "DEFAULT_PACK",
    "JOINER",
    "MAX_CHAIN",
    "NEEDS_PREVIOUS",
    "PACKS",
    "Span",
    "SentenceEmbedder",
    "SpanScorer",
    "VectorCache",
    "bm25",
    "content_terms",
    "needs_previous",
    "select_spans",
    "sentence_digest",
    "sentence_texts",
    "span_pieces",
    "split_sentences",
]

#: How many sentences back the neighbour rule may reach from one chosen sentence.
MAX_CHAIN = 3

# Defaults of the evidence mix; the weights are renormalized over the parts that are present
# (no embedder: lexical and chunk only). Checked on the QA harness's tuning split (bench/
# spans_qa.py --split squad-tune --sweep, bench/results/qa_spans_squad_tune.json): 0.6/0.2/0.2,
# 0.2/0.6/0.2, 0.5/0.5/0 and 0.3/0.3/0.4 were none better on the mean over 128-1,024 tokens,
# so they stay.
_W_DENSE, _W_LEXICAL, _W_CHUNK = 0.4, 0.4, 0.2
#: Default ``pool`` of :func:`select_spans`: chunk text considered, as a multiple of the budget.
#: 8, not the first guess 3: at 128 tokens a pool of 3 budgets (384) is one 300-500-token chunk,
#: so an answer in the second-ranked chunk could never be packed. On the tuning split (150 questions, squad-tune;
#: bench/results/qa_spans_squad_tune*.json) recall at 128/256/512/1,024 tokens rose with the pool
#: — 2: 73.3/84.0/92.0/95.3, 3: 73.3/86.7/93.3/95.3, 4: 76.0/88.7/94.7/95.3, 5: 78.7/88.0/94.0/
#: 95.3, 8: 81.3/90.0/94.7/95.3 — at the price of more sentences embedded the first time.
#: ``max_chunks`` (12) caps it at large budgets; 6 (pool 3) or 20 (pool 5) changed nothing.
DEFAULT_POOL = 8.0
# Default ``span_floor`` of select_spans: ragbudget.types.DEFAULT_SPAN_FLOOR (how it was chosen).
# A sentence's own token count ± the BPE merge at each end and the joiner: an admission whose
# estimate is further over the room than this is not counted exactly (it cannot fit).
_SLACK = 4
# Word sets this small say nothing about redundancy ("He died." is not a repeat of every other
# sentence with "died" in it).
_MIN_REDUNDANCY_WORDS = 3


@dataclass(eq=False)
class _Unit:
    chunk: int  # index into the pool
    pos: int  # index among its chunk's units
    start: int
    end: int
    text: str
    item: bool
    n_tokens: int
    deps: tuple[int, ...] = ()  # positions in the same chunk it brings along
    words: frozenset[str] = frozenset()
    leans: bool = False  # needs the unit before it (the neighbour rule)
    # With composed costs: what reading it after the unit before it adds to the two counted
    # apart (the gap, and a merge across it), after a joiner's space, and before the block's
    # closing newline (pieces.unit_edges; see _passage).
    joined: int = 0
    spaced: int = 0
    closed: int = 0
    score: float = 0.0
    red: float = 0.0  # max overlap with what is already chosen
    why: str = "over_budget"


def select_spans(
    question: str,
    candidates: Iterable[Retrieved],
    *,
    budget_tokens: int,
    count_tokens: Callable[[str], int],
    chunk_overhead: int | Callable[[SelectedChunk], int] = 0,
    scorer: SpanScorer | None = None,
    pool: float = DEFAULT_POOL,
    max_chunks: int = 12,
    weights: tuple[float, float, float] = (_W_DENSE, _W_LEXICAL, _W_CHUNK),
    prime: Callable[[Sequence[str]], object] | None = None,
    composed: bool = False,
    lambda_: float = 0.7,
    temperature: float = 0.02,
    order: str = "relevance",
    min_score: float | None = None,
    relevance_floor: float = 0.0,
    redundancy: float = 0.9,
    similarity: Callable[[SelectedChunk, SelectedChunk], float] | None = None,
    truncate_oversize: bool = True,
    span_floor: float = DEFAULT_SPAN_FLOOR,
) -> Selection:
    """Pack the question's sentences from the best ``candidates`` under a hard token cap.

    Takes what :func:`~ragbudget.packing.select.select_chunks` takes (same filtering, same costs:
    ``count_tokens(text) + chunk_overhead`` per passage, ``tokens_used <= budget_tokens``), and:
    ``scorer`` (a :class:`SpanScorer`; ``None``: lexical and chunk evidence only), ``pool`` (the
    chunks considered, in score order, stop once their summed cost reaches ``pool`` × the budget;
    at most ``max_chunks``), ``weights`` (dense, lexical, chunk) of the evidence and ``prime`` (a
    batch counter to warm ``count_tokens``, e.g. a served engine's), ``composed`` (cost trial
    passages from their pieces, :func:`~ragbudget.packing.pieces.span_pieces`, counted in one
    ``prime`` batch, instead of counting each: see :mod:`ragbudget.packing.pieces`; the caller
    checks the rendered prompt), ``span_floor`` (a sentence whose evidence is under this fraction of
    the best sentence's is left out as ``below_span_floor``, however much room is left; 0 fills the
    budget). Passages are one per chunk: adjacent chunks are not merged as
    :func:`~ragbudget.packing.select.select_chunks` merges them.

    >>> hits = [type("H", (), dict(chunk_id=1, score=0.9, sources=(), text=(
    ...     "Paris is the capital of France. It has 2 million people. Bread is cheap there.")))()]
    >>> sel = select_spans("How many million people?", hits, budget_tokens=11,
    ...                    count_tokens=lambda s: len(s.split()))
    >>> sel.chunks[0].text, [s.why for s in sel.chunks[0].spans]
    ('Paris is the capital of France. It has 2 million people.', ['neighbour', 'question'])
    """
    check_select_options(
        order=order,
        budget_tokens=budget_tokens,
        temperature=temperature,
        lambda_=lambda_,
        relevance_floor=relevance_floor,
    )
    _check_span_options(pool, max_chunks, weights, composed, span_floor)
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
    chunks = _take_pool(kept, max_chunks, pool * budget_tokens)
    units = _units(chunks, count_tokens, prime, composed=composed)
    compose = _composed_costs(chunks, count_tokens) if composed else None
    if scorer is not None and units:
        # Vectors stored at build time (an index's sentence vectors) before anything is embedded.
        scorer.preload(i for it in chunks for i in it.ids)
    _score(question, chunks, units, scorer, weights)
    chosen = _pack(
        units, chunks, budget_tokens, count_tokens, overhead_of, lambda_, redundancy, span_floor, compose=compose
    )
    passages = _passages(
        question, chunks, units, chosen, budget_tokens, count_tokens, overhead_of, compose, truncate_oversize
    )
    return _span_selection(passages, kept, chunks, units, chosen, dropped, budget_tokens, order, len(cands))


def _check_span_options(
    pool: float, max_chunks: int, weights: tuple[float, float, float], composed: bool, span_floor: float
) -> None:
    """The settings of :func:`select_spans` that :func:`check_select_options` does not check."""
    if not (isinstance(pool, (int, float)) and not isinstance(pool, bool) and pool > 0):
        raise ConfigError(f"pool must be a number > 0 (the budget multiple of chunk text to consider); got {pool!r}")
    if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
        raise ConfigError(f"max_chunks must be an integer ≥ 1; got {max_chunks!r}")
    if len(weights) != 3 or any(w < 0 for w in weights) or not any(weights):
        raise ConfigError(f"weights must be three numbers ≥ 0 (dense, lexical, chunk), not all 0; got {weights!r}")
    if not isinstance(composed, bool):
        raise ConfigError(f"composed must be True or False; got {composed!r}")
    if isinstance(span_floor, bool) or not isinstance(span_floor, (int, float)) or not 0 <= span_floor <= 1:
        raise ConfigError(
            f"span_floor must be a number from 0 to 1 (a fraction of the best sentence's evidence); got {span_floor!r}"
        )


def _take_pool(kept: Sequence[PackItem], max_chunks: int, limit: float) -> list[PackItem]:
    """The pool: the best chunks, until their whole text is ``limit`` tokens (a few budgets' worth)."""
    chunks: list[PackItem] = []
    total = 0
    for it in kept:
        if len(chunks) >= max_chunks or (chunks and total >= limit):
            break
        chunks.append(it)
        total += it.cost
    return chunks


def _composed_costs(chunks: Sequence[PackItem], count_tokens: Callable[[str], int]) -> list[tuple[int, int]]:
    """Each chunk's label tokens and the joiner's " …" (:func:`_units` counted them with the pieces)."""
    return [(label_tokens(it.text, it.cost, count_tokens), count_tokens(JOINER.rstrip())) for it in chunks]


def _passages(
    question: str,
    chunks: Sequence[PackItem],
    units: Sequence[_Unit],
    chosen: Mapping[int, set[int]],
    budget: int,
    count_tokens: Callable[[str], int],
    overhead_of: Callable[[SelectedChunk], int],
    compose: Sequence[tuple[int, int]] | None,
    truncate_oversize: bool,
) -> list[tuple[PackItem, SelectedChunk]]:
    """One passage per chunk that has chosen units; if none has, the best chunk's oversize cut."""
    passages: list[tuple[PackItem, SelectedChunk]] = []
    for ci, it in enumerate(chunks):
        mine = [u for u in units if u.chunk == ci and u.pos in chosen.get(ci, ())]
        if mine:
            passages.append((it, _passage(it, mine, count_tokens, overhead_of, compose[ci] if compose else None)))
    if not passages and chunks and budget > 0 and truncate_oversize:
        # Not even one sentence fits: the oversize-chunk cut (a window of words) of the best one.
        cut = truncate_item(chunks[0], budget, count_tokens, overhead_of, question)
        if cut is not None:
            passages.append((chunks[0], _cut_passage(chunks[0], cut)))
            for u in units:
                if u.chunk == 0:
                    u.why = "over_budget"
    return passages


def _span_selection(
    passages: list[tuple[PackItem, SelectedChunk]],
    kept: Sequence[PackItem],
    chunks: Sequence[PackItem],
    units: Sequence[_Unit],
    chosen: Mapping[int, set[int]],
    dropped: list[Dropped],
    budget: int,
    order: str,
    n_candidates: int,
) -> Selection:
    """The :class:`Selection` of ``passages``, every kept chunk unused and every unit left out listed."""
    used_ids = {cid for _, p in passages for cid in p.chunk_ids}
    # A pooled chunk none of whose sentences cleared the span floor was left out for that, not
    # for want of room.
    weak = {chunks[ci].ids[0] for ci in {u.chunk for u in units}}
    weak -= {chunks[u.chunk].ids[0] for u in units if u.why not in ("below_span_floor", "duplicate")}
    for it in kept:
        if it.ids[0] not in used_ids:
            why = "below_span_floor" if it.ids[0] in weak else "over_budget"
            dropped.append(Dropped(it.ids[0], why, it.score, it.n_tokens))
    left_out = tuple(
        _span(chunks[u.chunk], u, u.why)
        for u in units
        if not (u.pos in chosen.get(u.chunk, ()) and chunks[u.chunk].ids[0] in used_ids)
    )
    used = sum(p.cost for _, p in passages)
    # The invariant the whole library rests on; a violation is a bug here, not a user error.
    assert used <= budget, (used, budget)
    return Selection(
        chunks=tuple(_ordered(passages, order)),
        tokens_used=used,
        tokens_allowed=budget,
        dropped=tuple(dropped),
        order=order,
        n_candidates=n_candidates,
        pack="spans",
        spans_dropped=left_out,
    )


def _units(
    chunks: Sequence[PackItem],
    count_tokens: Callable[[str], int],
    prime: Callable[[Sequence[str]], object] | None,
    *,
    composed: bool = False,
) -> list[_Unit]:
    """Every chunk's sentences with their neighbour dependencies; a sentence repeated from a better
    chunk (chunk overlap, quoted text) is marked ``duplicate`` and never packed. ``composed``: each
    unit's pieces are counted too (:func:`~ragbudget.packing.pieces.span_pieces`, in one ``prime``
    batch)."""
    split = [split_sentences(it.text) for it in chunks]
    if prime is not None and composed:
        prime(span_pieces(chunks))
    elif prime is not None:
        prime([it.text[a:b] for it, parts in zip(chunks, split, strict=True) for a, b, _ in parts])
    out: list[_Unit] = []
    seen: set[str] = set()
    for ci, (it, parts) in enumerate(zip(chunks, split, strict=True)):
        mine: list[_Unit] = []
        for pos, (a, b, item) in enumerate(parts):
            text = it.text[a:b]
            u = _Unit(ci, pos, a, b, text, item, count_tokens(text), words=long_words(text), leans=needs_previous(text))
            key = " ".join(text.split()).lower()
            if key in seen:
                u.why = "duplicate"
            seen.add(key)
            mine.append(u)
        for u in mine:
            u.deps = _deps(mine, u.pos)
            if composed:
                prev = (mine[u.pos - 1].start, mine[u.pos - 1].end) if u.pos else None
                u.joined, u.spaced, u.closed = unit_edges(it.text, prev, u.start, u.end, count_tokens)
        out += mine
    return out


def _deps(units: Sequence[_Unit], pos: int) -> tuple[int, ...]:
    """The positions ``units[pos]`` brings along under the neighbour rule (nearest first), at
    most :data:`MAX_CHAIN` sentences back."""
    deps: list[int] = []
    cur = pos
    while len(deps) < MAX_CHAIN and cur > 0:
        u = units[cur]
        if u.item:
            # A list item's lead-in: the nearest unit before the list (not the items between).
            lead = cur - 1
            while lead >= 0 and units[lead].item:
                lead -= 1
            if lead < 0:
                break
            cur = lead
        elif u.leans:
            cur -= 1
        else:
            break
        deps.append(cur)
    return tuple(deps)


def _score(
    question: str,
    chunks: Sequence[PackItem],
    units: list[_Unit],
    scorer: SpanScorer | None,
    weights: tuple[float, float, float],
) -> None:
    """Each unit's evidence in [0, 1]: a weighted mean of dense (cosine over the pool's best),
    lexical (BM25 over the pool's sentences) and its chunk's value (already relative to the best)."""
    if not units:
        return
    w_dense, w_lex, w_chunk = weights
    texts = [u.text for u in units]
    lex = bm25(question, texts)
    top_lex = max(lex)
    dense = [0.0] * len(units)
    if scorer is not None and w_dense > 0:
        dense = [max(0.0, d) for d in scorer.similarities(question, texts)]
    else:
        w_dense = 0.0
    top_dense = max(dense)
    if top_lex <= 0:
        w_lex = 0.0
    if top_dense <= 0:
        w_dense = 0.0
    norm = (w_dense + w_lex + w_chunk) or 1.0
    for u, d, x in zip(units, dense, lex, strict=True):
        parts = (
            w_dense * (d / top_dense if top_dense > 0 else 0.0)
            + w_lex * (x / top_lex if top_lex > 0 else 0.0)
            + w_chunk * chunks[u.chunk].value
        )
        u.score = parts / norm


def _pack(
    units: list[_Unit],
    chunks: Sequence[PackItem],
    budget: int,
    count_tokens: Callable[[str], int],
    overhead_of: Callable[[SelectedChunk], int],
    lambda_: float,
    redundancy: float,
    span_floor: float,
    *,
    compose: Sequence[tuple[int, int]] | None = None,
) -> dict[int, set[int]]:
    """Greedy MMR over the units, every admission counted exactly (or, with ``compose``, costed
    from its pieces: see :func:`_passage`); ``{chunk: chosen positions}``.

    Greedy, not a knapsack: a unit's cost depends on what its chunk already holds (a gap costs a
    joiner, a neighbour may already be in), and best-first is what a tight budget needs."""
    by_chunk: dict[int, list[_Unit]] = {}
    for u in units:
        by_chunk.setdefault(u.chunk, []).append(u)
    chosen: dict[int, set[int]] = {}
    cost: dict[int, int] = {}
    room = budget
    todo = [u for u in units if u.why != "duplicate"]
    floor = span_floor * max((u.score for u in todo), default=0.0)
    for u in todo:
        if u.score < floor:
            u.why = "below_span_floor"
    todo = [u for u in todo if u.why != "below_span_floor"]
    while todo:
        # The MMR value: evidence, less a share of the overlap with what is already chosen.
        def value(u: _Unit) -> tuple[float, int, int]:
            penalty = max(0.0, (u.red - 0.5) / 0.5)
            v = u.score * (1.0 - (1.0 - lambda_) * penalty)
            return (v, -u.chunk, -u.pos)

        best = max(todo, key=value)
        todo.remove(best)
        if best.red >= redundancy:
            best.why = "redundant"
            continue
        have = chosen.get(best.chunk, set())
        new = [p for p in (best.pos, *best.deps) if p not in have]
        mine = by_chunk[best.chunk]
        if sum(mine[p].n_tokens for p in new) > room + _SLACK:
            continue  # stays over_budget: the room only shrinks
        trial = sorted(have | set(new))
        passage = _passage(
            chunks[best.chunk],
            [mine[p] for p in trial],
            count_tokens,
            overhead_of,
            compose[best.chunk] if compose is not None else None,
        )
        delta = passage.cost - cost.get(best.chunk, 0)
        if delta > room:
            continue
        room -= delta
        cost[best.chunk] = passage.cost
        chosen[best.chunk] = set(trial)
        for p in new:
            mine[p].why = "question" if p == best.pos else "neighbour"
        added = [mine[p] for p in new]
        todo = [u for u in todo if u not in added]
        for u in todo:
            for a in added:
                if min(len(u.words), len(a.words)) >= _MIN_REDUNDANCY_WORDS:
                    u.red = max(u.red, _containment(u.words, a.words))
        if todo and room + _SLACK < min(u.n_tokens for u in todo):
            break
    return chosen


def _containment(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / min(len(a), len(b))


def _passage(
    it: PackItem,
    units: Sequence[_Unit],
    count_tokens: Callable[[str], int],
    overhead_of: Callable[[SelectedChunk], int],
    compose: tuple[int, int] | None = None,
) -> SelectedChunk:
    """The passage of chunk ``it`` holding ``units`` (document order): consecutive units as the
    chunk has them, runs joined by :data:`JOINER`; counted exactly, label included. With
    ``compose`` (the chunk's label tokens and the joiner's ``" …"``), costed from the units'
    pieces instead (:func:`~ragbudget.packing.pieces.composed_tokens`), nothing counted here: the
    label and the block's closing newline after the last unit are added."""
    units = sorted(units, key=lambda u: u.pos)
    runs: list[tuple[int, int]] = []
    prev = -2
    for u in units:
        if runs and u.pos == prev + 1:
            runs[-1] = (runs[-1][0], u.end)
        else:
            runs.append((u.start, u.end))
        prev = u.pos
    text = JOINER.join(it.text[a:b] for a, b in runs)
    sources = (_narrow(it.sources[0], runs[0][0], runs[-1][1]),) + it.sources[1:] if it.sources else ()
    spans = tuple(_span(it, u, u.why) for u in units)
    if compose is not None:
        label, joiner = compose
        n = composed_tokens(units, joiner)
        cost = n + label + units[-1].closed
        return SelectedChunk(it.ids, text, it.score, n, cost, sources, it.headings, spans=spans)
    probe = SelectedChunk(it.ids, text, it.score, 0, 0, sources, it.headings, spans=spans)
    n = count_tokens(text)
    return SelectedChunk(it.ids, text, it.score, n, n + int(overhead_of(probe)), sources, it.headings, spans=spans)


def _cut_passage(it: PackItem, cut: PackItem) -> SelectedChunk:
    """The oversize cut of :func:`~ragbudget.packing.select.truncate_item` as a passage with its one span."""
    if it.sources and cut.sources:
        start = cut.sources[0].start - it.sources[0].start
    else:
        start = it.text.find(cut.text)
    span = Span(
        it.ids[0],
        start,
        start + len(cut.text),
        cut.text,
        it.value,
        cut.n_tokens,
        cut.sources[0] if cut.sources else None,
        "question",
    )
    return SelectedChunk(
        cut.ids, cut.text, cut.score, cut.n_tokens, cut.cost, cut.sources, cut.headings, truncated=True, spans=(span,)
    )


def _span(it: PackItem, u: _Unit, why: str) -> Span:
    src = _narrow(it.sources[0], u.start, u.end) if it.sources else None
    return Span(it.ids[0], u.start, u.end, u.text, u.score, u.n_tokens, src, why)


def _narrow(s: Source, start: int, end: int) -> Source:
    """``s`` (a chunk's place in its file) narrowed to chunk offsets ``[start, end)``."""
    a = min(s.end, s.start + start)
    return Source(s.path, a, min(s.end, s.start + end), s.page_start, s.page_end, s.label)


def _ordered(passages: list[tuple[PackItem, SelectedChunk]], order: str) -> list[SelectedChunk]:
    """``order`` over files (a file ranks by its best passage), document order inside a file."""
    groups: dict[str, list[tuple[PackItem, SelectedChunk]]] = {}
    for it, p in passages:
        key = p.sources[0].path if p.sources else f"\x00{it.rank}"
        groups.setdefault(key, []).append((it, p))
    heads = []
    for members in groups.values():
        members.sort(key=lambda m: (m[1].sources[0].start if m[1].sources else 0, m[0].rank))
        best = min(members, key=lambda m: m[0].rank)[0]
        heads.append(
            PackItem(
                best.ids,
                "",
                max(m[0].score for m in members),
                best.sources if order == "document" else (),
                (),
                0,
                0,
                best.rank,
            )
        )
    out: list[SelectedChunk] = []
    by_head = dict(zip((id(h) for h in heads), groups.values(), strict=True))
    for h in order_items(heads, order):
        out += [p for _, p in by_head[id(h)]]
    return out
