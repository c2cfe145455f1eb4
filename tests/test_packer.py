"""The packer interface: one for whole chunks and spans, packing into an allowance at exact cost
and shrinking after a render came out over — never rendering."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from ragbudget.errors import ConfigError
from ragbudget.packing.packer import REPACKS, ChunkPacker, SpanPacker, make_packer, without_lowest
from ragbudget.packing.select import Candidate, SelectedChunk, Selection


class Words:
    """A counter: a word a token, a label two; ``batch_counts`` as a served engine's."""

    def __init__(self, batch: bool = False) -> None:
        self.batch_counts = batch
        self.primed: list[str] = []

    def count(self, text: str) -> int:
        return len(text.split())

    def block(self, passage: object, source_id: int | str) -> str:
        return f"[{source_id}] {getattr(passage, 'text', '')}"

    def overhead(self, passage: object, *, max_id: int = 99) -> int:
        return 2

    def prime(self, texts: Sequence[str], questions: Sequence[str] = ()) -> None:
        self.primed += list(texts)


CANDS = [
    Candidate("a", "Paris is the capital of France. It has two million people.", 0.9),
    Candidate("b", "Bread is cheap in Lyon. Lyon is on the Rhone.", 0.6),
    Candidate("c", "Nice has a beach. The beach is pebbles.", 0.3),
]


def test_make_packer_names_the_two_and_refuses_the_rest() -> None:
    assert isinstance(make_packer("chunks", order="document"), ChunkPacker)
    assert isinstance(make_packer("spans"), SpanPacker) and make_packer("spans").name == "spans"
    with pytest.raises(ConfigError, match="pack must be one of"):
        make_packer("clause")
    with pytest.raises(ConfigError, match="pack='spans'"):
        make_packer("chunks", scorer=object())  # type: ignore[arg-type]


@pytest.mark.parametrize("pack", ["chunks", "spans"])
def test_a_packer_fits_the_budget_exactly_with_labels(pack: str) -> None:
    packer, counter = make_packer(pack), Words()
    for budget in (0, 7, 13, 40):
        sel = packer.pack("How many people live in Paris?", CANDS, budget_tokens=budget, counter=counter)
        assert sel.tokens_used <= budget and sel.tokens_allowed == budget
        assert sel.tokens_used == sum(counter.count(c.text) + 2 for c in sel.chunks)


def test_what_each_packer_counts_ahead() -> None:
    texts = make_packer("chunks").texts_to_count(CANDS, Words())
    assert texts[:3] == [c.text for c in CANDS] and texts[3].startswith("[9] Paris")  # labels at the widest id
    assert make_packer("spans").texts_to_count(CANDS, Words()) == texts  # a local counter: no pieces
    pieces = make_packer("spans").texts_to_count(CANDS, Words(batch=True))
    assert len(pieces) > len(texts) and "Lyon is on the Rhone." in pieces  # sentences, counted in one batch


def test_without_lowest_keeps_the_order_of_the_rest() -> None:
    chunks = tuple(
        SelectedChunk(chunk_ids=(i,), text="x", score=s, n_tokens=1, cost=3) for i, s in ((1, 0.5), (2, 0.9), (3, 0.1))
    )
    sel = without_lowest(Selection(chunks=chunks, tokens_used=9, tokens_allowed=9), 2)
    assert [c.chunk_ids for c in sel.chunks] == [(2,)] and sel.tokens_used == 3
    assert sorted(d.chunk_id for d in sel.dropped) == [1, 3]


def test_shrinking_drops_a_passage_or_packs_spans_tighter_on_a_batch_counter() -> None:
    q = "How many people live in Paris, and is bread cheap?"
    chunks = make_packer("chunks")
    sel = chunks.pack(q, CANDS, budget_tokens=40, counter=Words())
    smaller = chunks.shrink(q, CANDS, sel, over=1, attempt=0, counter=Words())
    assert len(smaller.chunks) == len(sel.chunks) - 1
    spans, batch = make_packer("spans"), Words(batch=True)
    sel = spans.pack(q, CANDS, budget_tokens=20, counter=batch)
    tighter = spans.shrink(q, CANDS, sel, over=3, attempt=0, counter=batch)
    assert tighter.tokens_used <= sel.tokens_used - 3 and tighter.tokens_allowed == sel.tokens_allowed
    # After REPACKS repacks, a whole passage goes, as for chunks.
    last = spans.shrink(q, CANDS, sel, over=1, attempt=REPACKS, counter=batch)
    assert len(last.chunks) == len(sel.chunks) - 1
