"""One interface for packing: whole chunks or the question's sentences, into an allowance.

A question's way is search → plan → pack → render → admit → generate → answer (the pipeline
calls each once; pack and render again only after a render that came out over).
The packer is the *pack* step: it takes the candidates the search found and the tokens the
context may hold, and returns the :class:`~ragbudget.packing.select.Selection` that fits, each
passage costed exactly by the counter it is given (the prompt builder's: its tokenizer or the
served engine's, labels included). It never renders: the render is the prompt's step, and when a
render comes out over the allowance (a BPE merge across two blocks, a composed span cost one
token short), the pipeline asks the packer to :meth:`~Packer.shrink` and renders again.

>>> class Words:  # a stand-in counter: a word a token, a label 2 tokens
...     batch_counts = False
...     def count(self, text): return len(text.split())
...     def block(self, passage, source_id): return f"[{source_id}] {passage.text}"
...     def overhead(self, passage, *, max_id=99): return 2
...     def prime(self, texts, questions=()): pass
>>> hits = [type("H", (), dict(chunk_id=i, score=s, sources=(), text=t))()
...         for i, s, t in ((1, 0.9, "Paris is the capital of France."), (2, 0.5, "Bread is cheap."))]
>>> packer = make_packer("chunks")
>>> sel = packer.pack("capital?", hits, budget_tokens=8, counter=Words())
>>> [c.chunk_ids for c in sel.chunks], sel.tokens_used
([(1,)], 8)
>>> packer.shrink("capital?", hits, sel, over=1, attempt=0, counter=Words()).chunks
()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConfigError
from ..types import PACKS
from .select import Dropped, Retrieved, Selection, select_chunks

if TYPE_CHECKING:
    from .spans import SpanScorer

__all__ = ["REPACKS", "ChunkPacker", "Counter", "Packer", "SpanPacker", "make_packer", "without_lowest"]

#: How many times a packer that costs passages from pieces packs anew after a render came out
#: over (each time on a budget smaller by the excess) before it drops whole passages: each try
#: is one render.
REPACKS = 2


class Counter(Protocol):
    """What a packer costs passages with: exact counts of a text and of a passage's label, and a
    batch counter to warm them (:class:`~ragbudget.prompt.prompt.PromptBuilder` is one, over
    the generator's tokenizer or a served engine's ``/tokenize``)."""

    @property
    def batch_counts(self) -> bool:
        """Whether counting costs a request (a served engine): then counts are asked in batches."""
        ...

    def count(self, text: str) -> int: ...

    def block(self, passage: Retrieved, source_id: int | str) -> str:
        """The numbered block ``passage`` goes into the prompt as (counted, never rendered here)."""
        ...

    def overhead(self, passage: Retrieved, *, max_id: int = 99) -> int:
        """The label and separator tokens ``passage`` costs when numbered up to ``max_id``."""
        ...

    def prime(self, texts: Sequence[str], questions: Sequence[str] = ()) -> None: ...


class Packer(Protocol):
    """Packs candidates into a context allowance (:func:`make_packer` makes the built-in two)."""

    @property
    def name(self) -> str:
        """``"chunks"`` or ``"spans"`` (:data:`~ragbudget.types.PACKS`)."""
        ...

    def texts_to_count(self, candidates: Sequence[Retrieved], counter: Counter) -> list[str]:
        """What :meth:`pack` will count of ``candidates``: asked of the counter ahead, in one
        batch, where a count costs a request."""
        ...

    def pack(
        self, question: str, candidates: Sequence[Retrieved], *, budget_tokens: int, counter: Counter
    ) -> Selection:
        """The passages of ``candidates`` that fit ``budget_tokens`` (labels included)."""
        ...

    def shrink(
        self,
        question: str,
        candidates: Sequence[Retrieved],
        selection: Selection,
        *,
        over: int,
        attempt: int,
        counter: Counter,
    ) -> Selection:
        """A smaller selection than ``selection``, whose render came out ``over`` tokens past the
        allowance (``attempt``: how many times it was shrunk already); an empty one when there
        is nothing left to take out."""
        ...


def without_lowest(selection: Selection, n: int = 1, *, reason: str = "over_budget") -> Selection:
    """``selection`` less its ``n`` lowest-scored passages (the order of the rest kept), each
    recorded as dropped with ``reason``.

    >>> from ragbudget.packing.select import SelectedChunk, Selection
    >>> a, b = (SelectedChunk(chunk_ids=(i,), text="x", score=s, n_tokens=3, cost=5) for i, s in ((1, .9), (2, .4)))
    >>> s = without_lowest(Selection(chunks=(a, b), tokens_used=10, tokens_allowed=10, dropped=()))
    >>> [c.chunk_ids for c in s.chunks], s.tokens_used, [d.chunk_id for d in s.dropped]
    ([(1,)], 5, [2])
    """
    passages = selection.chunks
    keep_n = max(0, len(passages) - max(1, n))
    ranked = sorted(range(len(passages)), key=lambda i: -passages[i].score)
    kept = tuple(passages[i] for i in sorted(ranked[:keep_n]))  # the configured order of the survivors
    gone = [passages[i] for i in ranked[keep_n:]]
    dropped = selection.dropped + tuple(Dropped(cid, reason, p.score, p.n_tokens) for p in gone for cid in p.chunk_ids)
    return replace(selection, chunks=kept, tokens_used=sum(p.cost for p in kept), dropped=dropped)


def _max_id(candidates: Sequence[Retrieved]) -> int:
    # Every label costed at the widest number it could get, so renumbering never adds a token.
    return max(9, len(candidates))


@dataclass(frozen=True, kw_only=True)
class ChunkPacker:
    """Whole chunks (:func:`~ragbudget.packing.select.select_chunks`); ``options`` are its keywords
    (``order``, ``relevance_floor``, ``fill_remainder``, …). A render over the allowance drops the
    lowest-scored passage."""

    options: Mapping[str, Any] = field(default_factory=dict)
    name: str = "chunks"

    def texts_to_count(self, candidates: Sequence[Retrieved], counter: Counter) -> list[str]:
        return _texts_and_blocks(candidates, counter)

    def pack(
        self, question: str, candidates: Sequence[Retrieved], *, budget_tokens: int, counter: Counter
    ) -> Selection:
        max_id = _max_id(candidates)
        return select_chunks(
            question,
            candidates,
            budget_tokens=budget_tokens,
            count_tokens=counter.count,
            chunk_overhead=lambda p: counter.overhead(p, max_id=max_id),
            **self.options,
        )

    def shrink(
        self,
        question: str,
        candidates: Sequence[Retrieved],
        selection: Selection,
        *,
        over: int,
        attempt: int,
        counter: Counter,
    ) -> Selection:
        return without_lowest(selection)


@dataclass(frozen=True, kw_only=True)
class SpanPacker:
    """The question's sentences inside the best chunks (:func:`~ragbudget.packing.spans.select_spans`),
    scored with ``scorer`` (a :class:`~ragbudget.packing.spans.SpanScorer`: embedding evidence;
    ``None``: lexical and chunk evidence only); ``options`` are its keywords. On a counter that
    counts in batches (a served engine), a passage's cost is composed from pieces counted in one
    request (:mod:`ragbudget.packing.pieces`): a render over the allowance then packs anew on a
    budget smaller by the excess, :data:`REPACKS` times, before dropping whole passages."""

    scorer: SpanScorer | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    name: str = "spans"

    def texts_to_count(self, candidates: Sequence[Retrieved], counter: Counter) -> list[str]:
        texts = _texts_and_blocks(candidates, counter)
        if counter.batch_counts:
            from .pieces import span_pieces

            texts += span_pieces(candidates)
        return texts

    def pack(
        self, question: str, candidates: Sequence[Retrieved], *, budget_tokens: int, counter: Counter
    ) -> Selection:
        from .spans import select_spans

        max_id = _max_id(candidates)
        return select_spans(
            question,
            candidates,
            budget_tokens=budget_tokens,
            count_tokens=counter.count,
            chunk_overhead=lambda p: counter.overhead(p, max_id=max_id),
            scorer=self.scorer,
            prime=counter.prime,
            composed=counter.batch_counts,
            **self.options,
        )

    def shrink(
        self,
        question: str,
        candidates: Sequence[Retrieved],
        selection: Selection,
        *,
        over: int,
        attempt: int,
        counter: Counter,
    ) -> Selection:
        if counter.batch_counts and attempt < REPACKS:
            # Keep the best sentences rather than drop a whole passage: one more render.
            budget = max(0, selection.tokens_used - over)
            smaller = self.pack(question, candidates, budget_tokens=budget, counter=counter)
            return replace(smaller, tokens_allowed=selection.tokens_allowed)
        return without_lowest(selection)


def _texts_and_blocks(candidates: Sequence[Retrieved], counter: Counter) -> list[str]:
    """Each candidate's text and its numbered block: what either packer counts of it. A candidate
    counted once (by any question) costs no request again, so a new question asks the tokenizer
    for its render and the final one only."""
    max_id = _max_id(candidates)
    return [c.text for c in candidates] + [counter.block(c, max_id) for c in candidates]


def make_packer(pack: str = "chunks", *, scorer: SpanScorer | None = None, **options: Any) -> Packer:
    """The packer ``pack`` names (:data:`~ragbudget.types.PACKS`): ``options`` go to its select
    function, ``scorer`` to span packing."""
    if pack not in PACKS:
        raise ConfigError(f"pack must be one of {', '.join(PACKS)}; got {pack!r}")
    if pack == "spans":
        return SpanPacker(scorer=scorer, options=options)
    if scorer is not None:
        raise ConfigError("a span scorer packs sentences: pass pack='spans' with it")
    return ChunkPacker(options=options)
