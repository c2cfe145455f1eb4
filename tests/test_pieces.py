"""Composed costs (ragbudget/packing/pieces.py): span packing on a served engine costs trial
passages from pieces counted in one batch, and those costs are the tokenizer's own counts."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_spans import LIGHTHOUSE  # the hand-written 24-sentence article span packing is tested on

from ragbudget.errors import ConfigError
from ragbudget.fitting import build_prompt
from ragbudget.packing.pieces import JOINER, span_pieces
from ragbudget.packing.select import Candidate
from ragbudget.packing.spans import select_spans
from ragbudget.types import Source


@pytest.fixture(scope="session")
def smol():
    from transformers import AutoTokenizer

    from ragbudget.memory.models import resolve_generator

    ref = resolve_generator()
    return AutoTokenizer.from_pretrained(ref.path, gguf_file=ref.gguf_file)


def words(text: str) -> int:
    return len(text.split())


SQUAD_QUESTIONS = (
    "What was Maria Curie the first female recipient of?",
    "Where is Warsaw's old town?",
    "Who discovered oxygen?",
    "What percentage of the Earth's crust is oxygen?",
    "Who invented packet switching?",
    "What is a datagram?",
)


@pytest.fixture(scope="module")
def squad_chunks() -> list[Candidate]:
    """The repo's three SQuAD articles cut into the index's 300–500-token chunks."""
    from ragbudget.input.chunking import chunk_text

    out = []
    for path in sorted((Path(__file__).resolve().parents[1] / "data" / "squad").glob("*.md")):
        text = path.read_text(encoding="utf-8")
        for c in chunk_text(text, min_tokens=300, max_tokens=500):
            out.append(Candidate(f"{path.stem}:{c.start}", c.text, 0.0, sources=(Source(path.name, c.start, c.end),)))
    return out


def ranked(question: str, chunks: list[Candidate]) -> list[Candidate]:
    """``chunks`` scored for ``question`` (BM25, as a search would rank them), best first."""
    from ragbudget.packing.spans import bm25

    scores = bm25(question, [c.text for c in chunks])
    top = max(scores) or 1.0
    order = sorted(range(len(chunks)), key=lambda i: -scores[i])
    return [Candidate(chunks[i].chunk_id, chunks[i].text, scores[i] / top, sources=chunks[i].sources) for i in order]


class CountingBackend:
    """A served engine's tokenizer and template, in process: ``counter`` counts, ``template``
    (a Hugging Face tokenizer) renders; ``batches`` lists every count request."""

    model_id = "counting"

    def __init__(self, counter, template=None) -> None:
        from _fakes import FakeBackend

        self.fake = FakeBackend(counter, template=template)
        self.batches: list[list[str]] = []

    def count(self, texts):
        self.batches.append(list(texts))
        return self.fake.count(texts)

    def render(self, messages):
        return self.fake.render(messages)

    def prefetch(self, texts, chats=()):
        pass  # every count is asked where it is used: `batches` shows each request


@pytest.mark.parametrize("which", ["smol", "cl100k"])
def test_composed_costs_are_the_tokenizers_own_counts_from_one_batch(which, request, squad_chunks) -> None:
    """SmolLM2 (GPT-2's pre-tokenizer) and tiktoken's cl100k (Llama 3's): span packing on a
    served engine counts every piece in one request, and the passage costs it composes from
    them are the tokenizer's own counts of the passages — so it packs exactly what counting each
    trial passage packs."""
    from ragbudget.prompt.prompt import EnginePromptBuilder
    from ragbudget.tokens import HFTokenizer, get_tokenizer

    if which == "smol":
        tok = request.getfixturevalue("smol")
        counter, template = HFTokenizer(tok), tok
    else:
        counter, template = get_tokenizer("cl100k_base"), None

    class Exact(EnginePromptBuilder):
        batch_counts = False

    packed = 0
    for q in SQUAD_QUESTIONS:
        cands = ranked(q, squad_chunks)
        max_id = max(9, len(cands))
        for budget in (128, 256, 512):
            engine = CountingBackend(counter, template)
            composed = EnginePromptBuilder(engine)
            fixed = composed.fixed_tokens(q)
            p = build_prompt(q, cands, builder=composed, max_prompt_tokens=fixed + budget, pack="spans")
            assert len(engine.batches) == 1, [len(b) for b in engine.batches]  # one request
            e = build_prompt(
                q,
                cands,
                builder=Exact(CountingBackend(counter, template)),
                max_prompt_tokens=fixed + budget,
                pack="spans",
            )
            assert [(c.text, c.n_tokens, c.cost) for c in p.selection.chunks] == [
                (c.text, c.n_tokens, c.cost) for c in e.selection.chunks
            ]
            for c in p.selection.chunks:
                assert c.n_tokens == counter.count(c.text)
                assert c.cost == counter.count(composed.block(c, max_id))
                packed += 1
            assert p.selection.tokens_used <= budget and p.n_tokens <= fixed + budget
    assert packed >= 30


LISTS_AND_GAPS = (
    "Keepers' duties:\n- trim the wick — every four hours, day and night;\n- wind the clockwork\n"
    "  of the lens, which turned it.\n\nThe keepers kept a log; it survives in the museum, "
    "and visitors may read it. They wrote in ink (black ink only).\tEach entry was signed."
)


def test_span_pieces_are_everything_composed_packing_counts() -> None:
    """With ``composed=True`` span packing counts nothing but the pieces :func:`span_pieces`
    lists (sentences, list items, newline and tab gaps): one batch counts them all."""

    cands = [
        Candidate("a", LIGHTHOUSE, 0.9, sources=(Source("a.txt", 0, len(LIGHTHOUSE)),)),
        Candidate("b", LISTS_AND_GAPS, 0.8, sources=(Source("b.txt", 0, len(LISTS_AND_GAPS)),)),
    ]
    primed = {c.text for c in cands}  # the candidates themselves: counted before (build_prompt)
    asked: list[str] = []

    def prime(texts) -> None:
        asked.append("batch")
        primed.update(texts)

    def count(text: str) -> int:
        assert text in primed, f"counted outside the batch: {text!r}"
        return words(text)

    pieces = span_pieces(cands)
    assert {c.text.strip() for c in cands} <= set(pieces)
    # (A budget no sentence fits, 10 here, falls back to a cut window of the best chunk, counted
    # window by window: the one path that still asks per trial.)
    for budget in (40, 80, 400):
        sel = select_spans(
            "who signed the log of the lens?",
            cands,
            budget_tokens=budget,
            count_tokens=count,
            chunk_overhead=3,
            prime=prime,
            composed=True,
        )
        assert sel.tokens_used <= budget
        # with a word counter the composed costs are the counts themselves
        assert [c.cost for c in sel.chunks] == [words(c.text) + 3 for c in sel.chunks]
    assert asked == ["batch"] * 3  # one prime a call, nothing counted one by one
    with pytest.raises(ConfigError, match="composed must be True or False"):
        select_spans("q", cands, budget_tokens=5, count_tokens=words, composed="yes")


def test_the_pieces_names_resolve_in_spans() -> None:
    # JOINER was defined in spans before pieces.py took it; both names resolve there too.
    import ragbudget.packing.spans as spans

    assert spans.JOINER is JOINER and spans.span_pieces is span_pieces
    assert {"JOINER", "span_pieces"} <= set(spans.__all__)
