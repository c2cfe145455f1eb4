"""Span packing: exact fit after the chat template, exact offsets, document order, the neighbour
rule, redundancy, the answer sentence on hand-written cases, clause units, and the --explain
output."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from _tiny_lm import tiny_tokenizer
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from ragbudget.cli.display import format_report
from ragbudget.errors import ConfigError
from ragbudget.prompt.prompt import PromptBuilder, build_prompt
from ragbudget.prompt.select import Candidate
from ragbudget.prompt.spans import (
    JOINER,
    SpanScorer,
    needs_previous,
    select_spans,
    split_clauses,
    split_sentences,
)
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.types import Source

# A hand-written article of 24 sentences (about 400 SmolLM2 tokens): one chunk that can never fit
# a 128- or 256-token context whole.
LIGHTHOUSE = (
    "The Skerry Point lighthouse stands on a granite ledge two miles off the northern coast. "
    "Construction began in 1841 under the engineer Alan Brodie. "
    "He chose granite from the Dalbeattie quarries because it resisted the salt spray. "
    "The tower is 48 metres tall and tapers from 13 metres at the base to 5 metres at the gallery. "
    "Its walls are more than two metres thick near the foundation. "
    "Workers lived on a barracks ship moored in the sound during the summers. "
    "In winter the sea made landing impossible, so work stopped from October to April. "
    "The light was first lit on 1 February 1847. "
    "It used a paraffin lamp behind a revolving lens made in Paris. "
    "The lens completed one turn every thirty seconds. "
    "Three keepers served on the rock at a time, working in shifts of four hours. "
    "Their families lived in cottages at the shore station in the village of Ardmore. "
    "Supplies came by boat every two weeks when the weather allowed. "
    "During the great storm of 1881 waves broke over the gallery and cracked two panes of the lantern. "
    "However, the light stayed lit through the whole night. "
    "The keepers later reported that the tower swayed like a tree. "
    "A foghorn was added in 1902 after the steamer Halcyon ran aground nearby. "
    "The horn sounded two blasts every minute in fog. "
    "Electric power replaced the paraffin lamp in 1966. "
    "The station was automated in 1988 and the last keepers left the rock that year. "
    "Today the light is monitored from the harbour office at Ardmore. "
    "The old shore cottages now house a small museum about the keepers. "
    "Visitors can see the original lens, which was removed in 1966. "
    "Boat trips to the rock run on calm days in July and August."
)


@pytest.fixture(scope="module")
def tiny():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def smol():
    from transformers import AutoTokenizer

    from ragbudget.memory.models import resolve_generator

    ref = resolve_generator()
    return AutoTokenizer.from_pretrained(ref.path, gguf_file=ref.gguf_file)


def ids_of(tok, messages) -> list[int]:
    out = tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def words(text: str) -> int:
    return len(text.split())


def doc_with(text: str, at: int = 700, path: str = "guide.pdf", page: int | None = 3):
    """A file's text holding ``text`` at offset ``at``, and the candidate of that chunk."""
    filler = "x" * (at - 1) + "\n"
    doc = filler + text + "\nTrailer text of the file."
    cand = Candidate("c1", text, 0.8, sources=(Source(path, at, at + len(text), page_start=page, page_end=page),))
    return doc, cand


# -- exact fit after the chat template ------------------------------------------------------------


@pytest.mark.parametrize("context", [128, 256])
@pytest.mark.parametrize("which", ["tiny", "smol"])
def test_exact_fit_after_chat_template_where_the_chunk_never_fits(which, context, request) -> None:
    tok = request.getfixturevalue(which)
    b = PromptBuilder(tok)
    q = "When was the foghorn added to the lighthouse?"
    _, cand = doc_with(LIGHTHOUSE)
    other = Candidate(
        "c2", "Ardmore is a fishing village with a harbour and a church.", 0.7, sources=(Source("village.txt", 0, 57),)
    )
    assert b.count(b.block(cand, 9)) > 256 + 100  # the whole chunk could never fit
    fixed = b.fixed_tokens(q)
    p = build_prompt(q, [cand, other], tokenizer=tok, max_prompt_tokens=fixed + context, builder=b, pack="spans")
    ref = ids_of(tok, p.messages)
    assert list(p.input_ids) == ref and len(ref) <= fixed + context
    # Fixed cost + each block's own count is the rendered length, exactly, and what was charged
    # never undercounts it.
    blocks = sum(b.count(b.block(x, i + 1)) for i, x in enumerate(p.passages))
    assert p.fixed_tokens + blocks == len(ref)
    assert p.selection.tokens_used <= context and p.fixed_tokens + p.selection.tokens_used >= len(ref)
    assert p.selection.pack == "spans"
    assert "A foghorn was added in 1902" in p.selection.text
    # Packing sentences fills the allowance the whole-chunk packer leaves empty or cuts.
    assert p.selection.tokens_used >= context - 60
    whole = build_prompt(q, [cand, other], tokenizer=tok, max_prompt_tokens=fixed + context, builder=b)
    assert whole.selection.pack == "chunks" and not whole.selection.chunks[0].spans


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**32 - 1), st.integers(0, 400), st.integers(0, 9))
def test_never_over_budget_and_every_chunk_accounted(seed, budget, overhead) -> None:
    rnd = random.Random(seed)
    sentences = [s + "." for s in LIGHTHOUSE.split(". ")]
    cands = []
    for i in range(rnd.randint(0, 8)):
        picked = rnd.sample(sentences, rnd.randint(1, 8))
        cands.append(
            Candidate(
                f"c{i}", " ".join(picked), rnd.uniform(0.3, 0.9), sources=(Source(f"f{i % 3}", 100 * i, 100 * i + 5),)
            )
        )
    sel = select_spans(
        "when did the keepers leave the rock", cands, budget_tokens=budget, count_tokens=words, chunk_overhead=overhead
    )
    assert sel.tokens_used <= budget
    assert sel.tokens_used == sum(words(c.text) + overhead for c in sel.chunks)
    used = [cid for c in sel.chunks for cid in c.chunk_ids]
    assert sorted(used + [d.chunk_id for d in sel.dropped]) == sorted(c.chunk_id for c in cands)
    for c in sel.chunks:
        assert c.spans and all(s.chunk_id == c.chunk_id for s in c.spans)


# -- citations: offsets and pages ---------------------------------------------------------------


def test_span_offsets_map_back_to_the_exact_source_text() -> None:
    doc, cand = doc_with(LIGHTHOUSE, at=1234, page=7)
    sel = select_spans(
        "How tall is the tower and how thick are its walls?", [cand], budget_tokens=60, count_tokens=words
    )
    spans = sel.chunks[0].spans
    assert len(spans) >= 2
    for s in spans + sel.spans_dropped:
        assert cand.text[s.start : s.end] == s.text
        assert doc[s.source.start : s.source.end] == s.text
        assert s.source.path == "guide.pdf" and s.source.page == 7
    # The passage's own source runs from its first span to its last.
    src = sel.chunks[0].sources[0]
    assert (src.start, src.end) == (spans[0].source.start, spans[-1].source.end)


def test_span_offsets_through_a_real_index(tmp_path: Path) -> None:
    from ragbudget.retrieval.index import Index

    path = tmp_path / "lighthouse.txt"
    path.write_text("Skerry Point\n\n" + LIGHTHOUSE + "\n")
    idx = Index(tmp_path / "idx")
    idx.build([path], embedder=HashEmbedder(dim=64))
    hits = idx.search("When was the station automated?", k=5, hybrid=False)
    sel = select_spans(
        "When was the station automated?", hits, budget_tokens=40, count_tokens=words, scorer=SpanScorer(idx.embedder)
    )
    text = path.read_text()
    assert sel.chunks and "automated in 1988" in sel.text
    for c in sel.chunks:
        for s in c.spans:
            assert text[s.source.start : s.source.end] == s.text


# -- document order, neighbours, redundancy ------------------------------------------------------


def test_spans_in_document_order_within_a_passage_and_a_file() -> None:
    first = "The museum opened in 1990. It shows the original lens. The cafe serves tea."
    second = "The lens was made in Paris. The harbour office monitors the light. Gulls nest there."
    a = Candidate("a", first, 0.70, sources=(Source("f.txt", 0, len(first)),))
    b = Candidate("b", second, 0.75, sources=(Source("f.txt", 500, 500 + len(second)),))
    c = Candidate("c", "Boat trips to the lens museum run in July.", 0.72, sources=(Source("g.txt", 0, 42),))
    sel = select_spans(
        "Where was the lens made and where is the lens shown?", [a, b, c], budget_tokens=60, count_tokens=words
    )
    # File f.txt ranks first (its best chunk, b, scores highest) but its passages go in file
    # order: a (offset 0) before b (offset 500); g.txt after.
    paths = [(p.sources[0].path, p.sources[0].start) for p in sel.chunks]
    assert paths[:2] == [("f.txt", 0), ("f.txt", 500)]
    for p in sel.chunks:
        starts = [s.start for s in p.spans]
        assert starts == sorted(starts)


def test_gap_between_runs_is_marked_and_adjacent_sentences_are_kept_as_written() -> None:
    text = "Alpha one is red. Beta two is blue.  Gamma three is green. Delta four is gold."
    c = Candidate("c", text, 0.9)
    # The joiner is counted too: 4 + 1 + 4 words.
    sel = select_spans("alpha red delta gold", [c], budget_tokens=9, count_tokens=words)
    assert sel.chunks[0].text == f"Alpha one is red.{JOINER}Delta four is gold."
    sel = select_spans("alpha red beta blue", [c], budget_tokens=8, count_tokens=words)
    assert sel.chunks[0].text == "Alpha one is red. Beta two is blue."


def test_neighbour_rule_pronoun_connective_and_list_lead_in() -> None:
    assert needs_previous("It used a paraffin lamp.") and needs_previous("As a result, it fell.")
    assert not needs_previous("Italy is large.") and not needs_previous("The lens turned.")
    q = "What kind of lamp did it use?"
    _, cand = doc_with(LIGHTHOUSE)
    sel = select_spans(q, [cand], budget_tokens=30, count_tokens=words)
    spans = {s.text: s.why for s in sel.chunks[0].spans}
    # "It used a paraffin lamp ..." starts with a pronoun: the sentence before it comes along.
    assert spans["It used a paraffin lamp behind a revolving lens made in Paris."] == "question"
    assert spans["The light was first lit on 1 February 1847."] == "neighbour"

    steps = (
        "Intro line about the kit. To replace the lens you need:\n- a soft cloth\n"
        "- two gaskets\n- the torque wrench\nAfter that, polish the brass."
    )
    # 6 + 1 (the joiner) + 4 words.
    sel = select_spans("torque wrench", [Candidate("k", steps, 0.9)], budget_tokens=11, count_tokens=words)
    got = [(s.text, s.why) for s in sel.chunks[0].spans]
    # The third list item brings its lead-in, not the items between.
    assert got == [("To replace the lens you need:", "neighbour"), ("- the torque wrench", "question")]
    assert sel.chunks[0].text == f"To replace the lens you need:{JOINER}- the torque wrench"
    # A sentence that stands alone brings nothing.
    sel = select_spans("intro kit", [Candidate("k", steps, 0.9)], budget_tokens=5, count_tokens=words)
    assert [(s.text, s.why) for s in sel.chunks[0].spans] == [("Intro line about the kit.", "question")]


def test_redundancy_across_spans_of_different_chunks() -> None:
    a = Candidate(
        "a",
        "The light was first lit on 1 February 1847 at dusk. Gulls nest on the rock.",
        0.9,
        sources=(Source("a.txt", 0, 80),),
    )
    b = Candidate(
        "b",
        "On 1 February 1847 at dusk, the light was first lit. Seals rest nearby.",
        0.89,
        sources=(Source("b.txt", 0, 80),),
    )
    c = Candidate(
        "c",
        "The light was first lit on 1 February 1847 at dusk. Terns fly here.",
        0.88,
        sources=(Source("c.txt", 0, 80),),
    )
    sel = select_spans("When was the light first lit?", [a, b, c], budget_tokens=200, count_tokens=words)
    assert sel.text.count("1847") == 1
    why = {(s.chunk_id, s.text[:6]): s.why for s in sel.spans_dropped}
    assert why[("b", "On 1 F")] == "redundant"
    assert why[("c", "The li")] == "duplicate"
    # With the redundancy filter off (threshold above 1), the reworded one goes in too.
    sel = select_spans("When was the light first lit?", [a, b], budget_tokens=200, count_tokens=words, redundancy=1.01)
    assert sel.text.count("1847") == 2


def test_default_pool_reaches_past_the_best_chunk_at_a_small_budget() -> None:
    # Two 40-word chunks and a 12-word budget: a pool of 3 budgets (36 words) is the best chunk
    # alone, so the answer sentence in the second-ranked chunk could not be packed (the default
    # before bench/spans_qa.py's tuning sweep); the default pool (8 budgets) considers both.
    filler = " ".join(f"The ledger entry {i} lists ordinary cargo for that week." for i in range(4))
    answer = "The harbour master recorded nineteen whales near Ardmore in 1902."
    first = Candidate(1, filler, 0.9, sources=(Source("a.txt", 0, len(filler)),))
    other = " ".join(f"Bay {i} of the storehouse kept rope and lamp oil in spring." for i in range(4))
    second = Candidate(2, other + " " + answer, 0.8, sources=(Source("b.txt", 0, len(other) + 1 + len(answer)),))
    q = "How many whales did the harbour master record near Ardmore?"
    narrow = select_spans(q, [first, second], budget_tokens=12, count_tokens=words, pool=3)
    assert answer not in narrow.text
    sel = select_spans(q, [first, second], budget_tokens=12, count_tokens=words)
    assert sel.text == answer and sel.tokens_used <= 12


def test_split_sentences_abbreviations_initials_and_lines() -> None:
    t = "Mr. Brodie (b. 1799) met J. Smith on St. Kilda. Costs rose, e.g. for stone. Done!\nNext"
    got = [t[a:b] for a, b, _ in split_sentences(t)]
    assert got == ["Mr. Brodie (b. 1799) met J. Smith on St. Kilda.", "Costs rose, e.g. for stone.", "Done!", "Next"]


# -- clause units (unit="clause") ------------------------------------------------------------------

# One chunk whose answer sits in the second half of a 30-word sentence, between two short ones.
KEEPERS = (
    "Gulls nest on the cliffs. "
    "The keepers kept a careful log of the weather, the passing ships and the supplies that the "
    "boatmen brought out to the rock; the foghorn was added to the tower in 1902. "
    "Seals rest on the rocks below."
)


def _clauses(t: str) -> list[tuple[str, bool]]:
    return [(t[a:b], leans) for a, b, leans in split_clauses(t)]


def test_split_clauses_on_natural_boundaries() -> None:
    assert _clauses("The tower was built by Alan Brodie, who chose granite from Dalbeattie, and it stands tall.") == [
        ("The tower was built by Alan Brodie", False),
        ("who chose granite from Dalbeattie", True),
        ("and it stands tall.", True),
    ]
    # ; stands alone unless a pronoun or connective opens it; a colon's or a dash's right side
    # explains the left and leans on it; "but" after a comma leans.
    assert _clauses("The lamp burned paraffin oil; the lens came from Paris in crates.") == [
        ("The lamp burned paraffin oil", False),
        ("the lens came from Paris in crates.", False),
    ]
    assert _clauses("The lamp burned paraffin oil; it was lit every evening.")[1] == ("it was lit every evening.", True)
    assert _clauses("Three men kept the light: a principal and two assistants.") == [
        ("Three men kept the light", False),
        ("a principal and two assistants.", True),
    ]
    assert _clauses("The tower — the tallest on the coast — was finished in 1847 after six summers.") == [
        ("The tower — the tallest on the coast", False),  # "The tower" alone is too short a clause
        ("was finished in 1847 after six summers.", True),
    ]
    assert _clauses("The tower — the tallest one on this coast — was finished in 1847.")[0][0] == (
        "The tower — the tallest one on this coast"
    )
    assert _clauses("Work went on through the summer, but storms stopped it in October.")[1] == (
        "but storms stopped it in October.",
        True,
    )
    # Not inside parentheses, not at a hyphen or an unspaced en dash, not at a time, not into a
    # clause of fewer than four words, and a sentence opening with a pronoun leans as a whole.
    for whole in (
        "The keepers (three men, who served in shifts; and a cook) lived in the tower.",
        "The 33-yard run in the 1914–1918 war at 3:45 was long.",
        "The lens turned, and then stopped when the clockwork failed.",
    ):
        assert _clauses(whole) == [(whole, False)]
    assert _clauses("He built the tower, which still stands on the rock.")[0] == ("He built the tower", True)
    # Offsets inside a larger text, with its own start and end.
    t = "Intro. " + KEEPERS + " Tail."
    a = t.index("The keepers")
    b = t.index("1902.") + len("1902.")
    parts = split_clauses(t, a, b)
    # (a list's comma is no boundary: only a comma before one of the clause words is)
    assert [t[x:y] for x, y, _ in parts] == [
        "The keepers kept a careful log of the weather, the passing ships and the supplies that the "
        "boatmen brought out to the rock",
        "the foghorn was added to the tower in 1902.",
    ]
    assert parts[0][0] == a and parts[-1][1] == b
    # Brackets count from the sentence's start: an unclosed "(" before it, or a stray ")" in it,
    # does not stop (or allow) a cut inside the sentence's own parentheses.
    t = "Notes (see below. The lamp burned paraffin oil; the lens came from Paris in crates."
    a = t.index("The lamp")
    assert [t[x:y] for x, y, _ in split_clauses(t, a, len(t))] == [
        "The lamp burned paraffin oil",
        "the lens came from Paris in crates.",
    ]
    t = "Step 1) the lamp (paraffin, which the boats brought; and wicks) burned every single night."
    assert len(split_clauses(t)) == 1


def test_clause_units_fit_the_answer_where_sentences_cannot() -> None:
    doc, cand = doc_with(KEEPERS, at=900, page=4)
    q = "When was the foghorn added to the tower?"
    # 14 words: the 30-word sentence that holds the answer never fits; the short ones do.
    sentences = select_spans(q, [cand], budget_tokens=14, count_tokens=words)
    assert "1902" not in sentences.text and sentences.chunks and not sentences.chunks[0].truncated
    clauses = select_spans(q, [cand], budget_tokens=14, count_tokens=words, unit="clause")
    assert "the foghorn was added to the tower in 1902." in clauses.text
    assert clauses.tokens_used <= 14
    assert clauses.tokens_used == sum(words(c.text) for c in clauses.chunks)
    # The citation is the clause's own: offsets in the chunk and in the file, and the page.
    spans = [s for c in clauses.chunks for s in c.spans] + list(clauses.spans_dropped)
    assert any(s.text == "the foghorn was added to the tower in 1902." and s.why == "question" for s in spans)
    for s in spans:
        assert cand.text[s.start : s.end] == s.text
        assert doc[s.source.start : s.source.end] == s.text and s.source.page == 4


def test_clause_neighbour_rule_and_adjacent_clauses_as_written() -> None:
    text = (
        "The tower was built by Alan Brodie, who chose granite from the Dalbeattie quarries, "
        "and it stands 48 metres tall above the ledge."
    )
    q = "Which quarries did the granite come from?"
    # 22 words: cut at clause_tokens 10 (at the default 24 it would stay one sentence).
    sel = select_spans(
        q, [Candidate("c", text, 0.9)], budget_tokens=15, count_tokens=words, unit="clause", clause_tokens=10
    )
    # The relative clause brings its lead, and the pair reads as the sentence has it (comma and
    # all); the third clause is left out.
    assert sel.chunks[0].text == "The tower was built by Alan Brodie, who chose granite from the Dalbeattie quarries"
    assert [(s.text, s.why) for s in sel.chunks[0].spans] == [
        ("The tower was built by Alan Brodie", "neighbour"),
        ("who chose granite from the Dalbeattie quarries", "question"),
    ]
    # Clauses of one sentence that are not adjacent are joined as any gap is (after a ";" a
    # clause stands alone, so neither brings the one between).
    text2 = (
        "The light was first lit in 1847 by the keepers; a crowd came from the village to watch it; "
        "the lens turned once every thirty seconds."
    )
    sel = select_spans(
        "When was the light first lit and how often did the lens turn?",
        [Candidate("c", text2, 0.9)],
        budget_tokens=18,  # 10 + the joiner + 7
        count_tokens=words,
        unit="clause",
        clause_tokens=10,
    )
    assert (
        sel.chunks[0].text
        == f"The light was first lit in 1847 by the keepers{JOINER}the lens turned once every thirty seconds."
    )
    assert [s.why for s in sel.chunks[0].spans] == ["question", "question"] and sel.tokens_used == 18


def test_clause_units_take_the_sentence_vector_and_default_stays_sentences() -> None:
    class Counting(HashEmbedder):
        texts: list[str] = []

        def embed_documents(self, texts):
            Counting.texts += list(texts)
            return super().embed_documents(texts)

    _, cand = doc_with(KEEPERS)
    q = "When was the foghorn added to the tower?"
    scorer = SpanScorer(Counting(dim=64))
    select_spans(q, [cand], budget_tokens=14, count_tokens=words, scorer=scorer, unit="clause")
    # No clause is embedded: a clause's dense evidence is its sentence's (stored) vector.
    assert sorted(Counting.texts) == sorted(cand.text[a:b] for a, b, _ in split_sentences(cand.text))
    Counting.texts = []
    select_spans(q, [cand], budget_tokens=14, count_tokens=words, scorer=scorer, unit="clause", clause_embed=0.5)
    assert "the foghorn was added to the tower in 1902." in Counting.texts
    # The default packs whole sentences, exactly as unit="sentence" does, even past clause_tokens.
    for budget in (14, 40, 60):
        default = select_spans(q, [cand], budget_tokens=budget, count_tokens=words)
        explicit = select_spans(q, [cand], budget_tokens=budget, count_tokens=words, unit="sentence", clause_tokens=1)
        assert default == explicit
        whole = {cand.text[a:b] for a, b, _ in split_sentences(cand.text)}
        assert all(s.text in whole for c in default.chunks for s in c.spans)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**32 - 1), st.integers(0, 120), st.integers(4, 30))
def test_clause_units_never_over_budget_and_offsets_exact(seed, budget, clause_tokens) -> None:
    rnd = random.Random(seed)
    parts = [s + "." for s in LIGHTHOUSE.split(". ")] + [KEEPERS, "Visitors come by boat, which is slow: two hours."]
    cands = [
        Candidate(f"c{i}", " ".join(rnd.sample(parts, rnd.randint(1, 6))), rnd.uniform(0.3, 0.9))
        for i in range(rnd.randint(1, 5))
    ]
    sel = select_spans(
        "when was the foghorn added to the tower",
        cands,
        budget_tokens=budget,
        count_tokens=words,
        unit="clause",
        clause_tokens=clause_tokens,
    )
    assert sel.tokens_used <= budget
    assert sel.tokens_used == sum(words(c.text) for c in sel.chunks)
    by_id = {c.chunk_id: c.text for c in cands}
    for c in sel.chunks:
        for s in c.spans:
            assert by_id[s.chunk_id][s.start : s.end] == s.text
            assert s.text in c.text or c.truncated
    for s in sel.spans_dropped:
        assert by_id[s.chunk_id][s.start : s.end] == s.text


# -- the answer sentence, hand-written cases -----------------------------------------------------

# (question, the sentence that answers it — chosen by hand, not by the code)
CASES = [
    ("Who was the engineer of the lighthouse?", "Construction began in 1841 under the engineer Alan Brodie."),
    ("How often did supply boats come?", "Supplies came by boat every two weeks when the weather allowed."),
    (
        "Which steamer ran aground near the rock?",
        "A foghorn was added in 1902 after the steamer Halcyon ran aground nearby.",
    ),
    ("When did electric power replace paraffin?", "Electric power replaced the paraffin lamp in 1966."),
    ("Where is the light monitored from today?", "Today the light is monitored from the harbour office at Ardmore."),
    ("In which months do boat trips run?", "Boat trips to the rock run on calm days in July and August."),
]


@pytest.mark.parametrize(("question", "answer"), CASES)
def test_answer_sentence_is_picked_at_a_tight_budget(question, answer, tiny) -> None:
    b = PromptBuilder(tiny)
    _, cand = doc_with(LIGHTHOUSE)
    # 128 byte-tokens: room for about one sentence and its label, out of 24. Lexical evidence
    # only (no embedder): the words of these questions are in their answers.
    fixed = b.fixed_tokens(question)
    p = build_prompt(question, [cand], tokenizer=tiny, max_prompt_tokens=fixed + 128, builder=b, pack="spans")
    assert answer in p.selection.text
    assert p.n_tokens <= fixed + 128


@pytest.mark.slow
@pytest.mark.parametrize(
    ("question", "answer"),
    [
        *CASES,
        # No content word of the question is in the answer: only the embedding can find it.
        (
            "What happened to the building work in the cold season?",
            "In winter the sea made landing impossible, so work stopped from October to April.",
        ),
    ],
)
def test_answer_sentence_with_the_packaged_embedder(question, answer, packaged_scorer) -> None:
    _, cand = doc_with(LIGHTHOUSE)
    sel = select_spans(question, [cand], budget_tokens=20, count_tokens=words, scorer=packaged_scorer)
    assert answer in sel.text


def _one_chunk(text: str) -> object:
    return type("H", (), dict(chunk_id=1, score=0.9, sources=(), text=text))()


def test_answer_type_cue_prefers_the_sentence_with_what_the_question_asks_for() -> None:
    # The first sentence repeats the question's words; only the second holds a year.
    hit = _one_chunk("The harbour wall was rebuilt, the harbour wall again. Masons finished the harbour wall in 1887.")
    q = "When was the harbour wall rebuilt?"
    plain = select_spans(q, [hit], budget_tokens=9, count_tokens=words)
    cued = select_spans(q, [hit], budget_tokens=9, count_tokens=words, cue_weight=0.5)
    assert "1887" not in plain.text and "1887" in cued.text
    # "who" asks for a name the question does not already hold.
    hit = _one_chunk("The harbour wall was rebuilt by the harbour board. Work was led by Agnes Moray.")
    q = "Who rebuilt the harbour wall?"
    assert "Moray" not in select_spans(q, [hit], budget_tokens=9, count_tokens=words).text
    assert "Moray" in select_spans(q, [hit], budget_tokens=9, count_tokens=words, cue_weight=1.0).text
    # A question word that says nothing of the answer's kind: the cue changes nothing.
    q = "Why was the harbour wall rebuilt?"
    assert (
        select_spans(q, [hit], budget_tokens=9, count_tokens=words, cue_weight=0.5).text
        == select_spans(q, [hit], budget_tokens=9, count_tokens=words).text
    )


def test_context_weight_brings_the_sentence_after_the_matching_one_into_reach() -> None:
    # The question's words are in the first sentence of the pair; the answer follows it.
    hit = _one_chunk(
        "Gulls nest on the cliffs. The keeper logged the storm damage each night. "
        "Repairs took eleven weeks. Seals rest on the rocks below."
    )
    q = "What did the keeper log each night about the storm damage?"
    scores = {}
    for c in (0.0, 0.5):
        sel = select_spans(q, [hit], budget_tokens=30, count_tokens=words, context_weight=c)
        scores[c] = {s.text: s.score for p in sel.chunks for s in p.spans}
        scores[c].update({s.text: s.score for s in sel.spans_dropped})
    after, unrelated = "Repairs took eleven weeks.", "Seals rest on the rocks below."
    assert scores[0.0][after] == pytest.approx(scores[0.0][unrelated])
    assert scores[0.5][after] > scores[0.5][unrelated]


def test_cost_exponent_takes_evidence_per_token() -> None:
    # The long sentence has more evidence (both question words, twice) but costs 27 words; the
    # short one has less evidence at a fifth of the cost.
    hit = _one_chunk(
        "The old harbour wall by the town was rebuilt in stone after the great storm had broken the "
        "harbour wall and most of the quay along the front. Gulls nest on the cliffs. The harbour wall is tall."
    )
    q = "Which harbour wall was rebuilt?"
    long_, short = "The old harbour wall by the town", "The harbour wall is tall."
    plain = select_spans(q, [hit], budget_tokens=30, count_tokens=words)
    assert long_ in plain.text and short not in plain.text
    per_token = select_spans(q, [hit], budget_tokens=30, count_tokens=words, cost_exponent=0.5)
    assert short in per_token.text and long_ not in per_token.text
    assert per_token.tokens_used <= 30


@pytest.fixture(scope="module")
def packaged_scorer():
    from ragbudget.retrieval.embed import SentenceTransformerEmbedder

    return SpanScorer(SentenceTransformerEmbedder())


def test_span_scorer_caches_vectors_by_content() -> None:
    class Counting(HashEmbedder):
        calls = 0

        def embed_documents(self, texts):
            Counting.calls += len(texts)
            return super().embed_documents(texts)

    s = SpanScorer(Counting(dim=32))
    first = s.similarities("q", ["one", "two"])
    again = s.similarities("q", ["two", "one", "three"])
    assert again[:2] == [first[1], first[0]]
    assert Counting.calls == 3  # "one", "two", then only "three"


# -- settings and errors ---------------------------------------------------------------------------


def test_bad_settings_are_config_errors(tiny) -> None:
    with pytest.raises(ConfigError, match="pack must be one of chunks, spans"):
        build_prompt("q", [], tokenizer=tiny, max_prompt_tokens=500, pack="sentences")
    with pytest.raises(ConfigError, match="pool must be"):
        select_spans("q", [], budget_tokens=5, count_tokens=words, pool=0)
    with pytest.raises(ConfigError, match="weights must be"):
        select_spans("q", [], budget_tokens=5, count_tokens=words, weights=(0, 0, 0))
    with pytest.raises(ConfigError, match="order must be"):
        select_spans("q", [], budget_tokens=5, count_tokens=words, order="random")
    for knob in ("cue_weight", "context_weight"):
        for bad in (-0.1, 1.5, True, "0.2"):
            with pytest.raises(ConfigError, match=f"{knob} must be a number in"):
                select_spans("q", [], budget_tokens=5, count_tokens=words, **{knob: bad})
    for bad in (-0.5, True, "1"):
        with pytest.raises(ConfigError, match="cost_exponent must be a number ≥ 0"):
            select_spans("q", [], budget_tokens=5, count_tokens=words, cost_exponent=bad)
    with pytest.raises(ConfigError, match="unit must be one of sentence, clause"):
        select_spans("q", [], budget_tokens=5, count_tokens=words, unit="word")
    for bad in (0, 2.5, True):
        with pytest.raises(ConfigError, match="clause_tokens must be an integer ≥ 1"):
            select_spans("q", [], budget_tokens=5, count_tokens=words, clause_tokens=bad)
    for bad in (-0.1, 1.5, True):
        with pytest.raises(ConfigError, match="clause_embed must be a number in"):
            select_spans("q", [], budget_tokens=5, count_tokens=words, clause_embed=bad)
    from ragbudget.pipeline import Pipeline

    with pytest.raises(ConfigError, match="pack"):
        Pipeline("/nonexistent", pack="sentence")


def test_oversize_sentence_falls_back_to_a_cut_window() -> None:
    long = " ".join(f"w{i}" for i in range(50)) + " answer here."
    sel = select_spans("answer", [Candidate("c", long, 0.9)], budget_tokens=10, count_tokens=words)
    assert sel.tokens_used <= 10 and sel.chunks[0].truncated
    s = sel.chunks[0].spans[0]
    assert long[s.start : s.end] == s.text == sel.chunks[0].text and "answer" in s.text


# -- --explain ------------------------------------------------------------------------------------


def test_explain_shows_spans_costs_and_what_was_left_out() -> None:
    _, cand = doc_with(LIGHTHOUSE, at=1000)
    sel = select_spans("When was the foghorn added?", [cand], budget_tokens=40, count_tokens=words, chunk_overhead=3)
    report = {
        "budget": {},
        "plan": {},
        "pack": sel.pack,
        "selection": [p.to_dict() for p in sel.chunks],
        "dropped": [d.to_dict() for d in sel.dropped],
        "spans_dropped": [s.to_dict() | {"text": None} for s in sel.spans_dropped],
    }
    out = format_report(report)
    p = sel.chunks[0]
    assert f"chunk c1: {len(p.spans)} span(s), {p.n_tokens} tokens of text + 3 label" in out
    for s in p.spans:
        assert f"[{s.source.start}:{s.source.end}] p.3  {s.n_tokens} tokens  {s.why}" in out
    left = sel.spans_dropped
    assert f"Spans left out: {len(left)} sentence(s), {sum(s.n_tokens for s in left):,} tokens" in out
    assert f"chunk c1: {len(left)} over_budget" in out


def test_cli_ask_pack_spans_explain(tmp_path: Path, repo_data: Path) -> None:
    from _replay import Replay

    from ragbudget.cli.commands import cli as main
    from ragbudget.pipeline import Pipeline

    index_dir = tmp_path / "idx"
    Pipeline(index_dir, embedder="hash:256").index([repo_data])
    with Replay("tgi") as srv:
        args = [
            "ask",
            "How is the Project Leader elected?",
            "--engine",
            srv.url,
            "--index-dir",
            str(index_dir),
            "--max-new-tokens",
            "16",
            "--context-tokens",
            "120",
        ]
        result = CliRunner().invoke(main, [*args, "--pack", "spans", "--explain"])
        assert result.exit_code == 0, result.output
        assert "span(s)" in result.output and "tokens of text" in result.output
        assert "Spans left out:" in result.output
        bad = CliRunner().invoke(main, [*args, "--pack", "words"])
        assert bad.exit_code == 2 and "'words' is not one of 'chunks', 'spans'" in bad.output


def test_cli_chat_and_serve_take_pack(tmp_path: Path, repo_data: Path) -> None:
    """``--pack`` reaches the pipeline of ``chat`` (the report of a piped turn says what packed
    it) and is an option of ``serve`` with the same choices and default as ``ask``."""
    from _replay import Replay

    from ragbudget.cli.commands import cli as main
    from ragbudget.pipeline import Pipeline
    from ragbudget.prompt.spans import DEFAULT_PACK

    index_dir = tmp_path / "idx"
    Pipeline(index_dir, embedder="hash:256").index([repo_data])
    with Replay("tgi") as srv:
        args = [
            "chat",
            "--engine",
            srv.url,
            "--index-dir",
            str(index_dir),
            "--max-new-tokens",
            "16",
            "--context-tokens",
            "120",
            "--json",
        ]
        for pack in ("spans", "chunks"):
            result = CliRunner().invoke(main, [*args, "--pack", pack], input="How is the Project Leader elected?\n")
            assert result.exit_code == 0, result.output
            turn = json.loads(result.output.strip().splitlines()[-1])
            assert turn["answer"]["report"]["pack"] == pack
    for command in ("ask", "chat", "serve"):
        (opt,) = [p for p in main.commands[command].params if p.name == "pack"]
        assert opt.default == DEFAULT_PACK and list(opt.type.choices) == ["chunks", "spans"]


# -- composed costs: a served engine's counts ---------------------------------------------------------

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
    from ragbudget.prompt.spans import bm25

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


LISTS_AND_CLAUSES = (
    "Keepers' duties:\n- trim the wick — every four hours, day and night;\n- wind the clockwork\n"
    "  of the lens, which turned it.\n\nThe keepers kept a log; it survives in the museum, "
    "and visitors may read it. They wrote in ink (black ink only).\tEach entry was signed."
)


@pytest.mark.parametrize("unit", ["sentence", "clause"])
def test_span_pieces_are_everything_composed_packing_counts(unit) -> None:
    """With ``composed=True`` span packing counts nothing but the pieces :func:`span_pieces`
    lists (sentences, clauses, list items, newline and tab gaps): one batch counts them all."""
    from ragbudget.prompt.spans import span_pieces

    cands = [
        Candidate("a", LIGHTHOUSE, 0.9, sources=(Source("a.txt", 0, len(LIGHTHOUSE)),)),
        Candidate("b", LISTS_AND_CLAUSES, 0.8, sources=(Source("b.txt", 0, len(LISTS_AND_CLAUSES)),)),
    ]
    primed = {c.text for c in cands}  # the candidates themselves: counted before (build_prompt)
    asked: list[str] = []

    def prime(texts) -> None:
        asked.append("batch")
        primed.update(texts)

    def count(text: str) -> int:
        assert text in primed, f"counted outside the batch: {text!r}"
        return words(text)

    pieces = span_pieces(cands, unit=unit)
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
            unit=unit,
            clause_tokens=4,
        )
        assert sel.tokens_used <= budget
        # with a word counter the composed costs are the counts themselves
        assert [c.cost for c in sel.chunks] == [words(c.text) + 3 for c in sel.chunks]
    assert asked == ["batch"] * 3  # one prime a call, nothing counted one by one
    with pytest.raises(ConfigError, match="composed must be True or False"):
        select_spans("q", cands, budget_tokens=5, count_tokens=words, composed="yes")
