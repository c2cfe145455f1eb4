"""Exact and near-duplicate removal: normalisation, MinHash/LSH, incremental dedup, real data."""

from __future__ import annotations

import json
import random
import re
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ragbudget.errors import ArgumentTypeError, ConfigError
from ragbudget.input.chunking import chunk_text
from ragbudget.input.dedup import (
    Deduplicator,
    NearDupIndex,
    content_hash,
    content_hashes,
    dedup,
    estimate_jaccard,
    minhash_signature,
    minhash_signatures,
    normalize,
)
from ragbudget.settings import DedupSettings
from ragbudget.types import Chunk, Source

_PUNCT = re.compile(r"\s*([^\w\s]|_)\s*")


def _reference_normalize(text: str) -> str:
    """The definition, written the slow obvious way."""
    t = unicodedata.normalize("NFKC", text).casefold()
    return re.sub(r"\s+", " ", _PUNCT.sub(r"\1", t)).strip()


_TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list(" \t\n\u00a0\u3000.,'\"()-_aAbBéÉß0123") + ["ﬁ", "Ａ", "😀", "\x00"]),
        st.characters(),
    ),
    max_size=60,
)


def test_normalize_examples() -> None:
    assert normalize("Earth ' s atmosphere") == normalize("Earth's atmosphere") == "earth's atmosphere"
    assert normalize("O 2 .") == normalize("O\n2.") == "o 2."
    assert normalize("  ＡＢＣ\t d ") == "abc d"
    assert normalize("") == ""


@settings(max_examples=400, deadline=None)
@given(text=_TEXT)
def test_normalize_matches_its_definition(text: str) -> None:
    assert normalize(text) == _reference_normalize(text)


@settings(max_examples=100, deadline=None)
@given(texts=st.lists(_TEXT, max_size=8))
def test_batch_functions_match_single_ones(texts: list[str]) -> None:
    assert content_hashes(texts) == [content_hash(t) for t in texts]
    sigs = minhash_signatures(texts)
    assert sigs.shape == (len(texts), 128) and sigs.dtype == np.uint32
    for t, s in zip(texts, sigs, strict=True):
        assert (minhash_signature(t) == s).all()


def test_signature_is_stable_and_roundtrips_as_bytes() -> None:
    sig = minhash_signature("The quick brown fox jumps over the lazy dog.")
    # Fixed values: stored signatures must stay valid across processes and versions, those of
    # the default 1-word shingles and those of the 3-word shingles every index built before the
    # shingle was recorded holds (index_settings keeps 3 for them).
    assert sig[:4].tolist() == [1637868567, 12502130, 673014762, 208077552]
    old = minhash_signature("The quick brown fox jumps over the lazy dog.", shingle=3)
    assert old[:4].tolist() == [783068368, 492356015, 9070134, 1070336084]
    assert (np.frombuffer(sig.tobytes(), dtype=np.uint32) == sig).all()
    assert (minhash_signature("the QUICK brown fox, jumps over the lazy dog") == sig).all()
    assert (minhash_signature("") == 0xFFFFFFFF).all()


def test_estimated_jaccard_tracks_true_jaccard() -> None:
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(5000)]
    errors = []
    for _ in range(40):
        base = rng.sample(vocab, 300)
        keep = rng.randint(100, 300)
        other = base[:keep] + rng.sample(vocab, 300 - keep)
        a, b = " ".join(base), " ".join(other)
        sa, sb = ({tuple(ws[i : i + 3]) for i in range(len(ws) - 2)} for ws in (base, other))
        true = len(sa & sb) / len(sa | sb)
        errors.append(abs(estimate_jaccard(minhash_signature(a), minhash_signature(b)) - true))
    # Standard error at 128 permutations is at most 0.044; no estimate should be far off.
    assert max(errors) < 0.15 and float(np.mean(errors)) < 0.05


def test_near_dup_index_confirms_candidates() -> None:
    def minhash_signature(text: str) -> np.ndarray:
        # 3-word shingles: "far" below has the same words in reverse order, which the default
        # word sets cannot tell apart; the index's confirmation is what is tested here.
        return minhash_signatures([text], shingle=3)[0]

    words = [f"token{i}" for i in range(200)]
    base = " ".join(words)
    near = " ".join(words[:190] + ["changed"] * 10)
    far = " ".join(reversed(words))
    idx = NearDupIndex(threshold=0.8)
    idx.insert("base", minhash_signature(base))
    idx.insert("far", minhash_signature(far))
    assert len(idx) == 2 and "base" in idx
    assert idx.query(minhash_signature(near)) == ["base"]
    # One-row bands make everything a candidate: confirmation must still reject the far one.
    loose = NearDupIndex(threshold=0.8, bands=128)
    loose.insert("far", minhash_signature(far))
    assert loose.query(minhash_signature(base)) == []
    idx.remove("base")
    idx.remove("missing")
    assert idx.query(minhash_signature(near)) == [] and len(idx) == 1
    with pytest.raises(ConfigError, match="num_perm"):
        idx.query(np.zeros(64, dtype=np.uint32))
    with pytest.raises(ConfigError, match="threshold"):
        NearDupIndex(threshold=0.0)


@pytest.mark.parametrize(
    ("threshold", "num_perm", "error", "message"),
    [
        (0.0, 128, ConfigError, "threshold must be in (0, 1], got 0.0"),
        (1.5, 128, ConfigError, "threshold must be in (0, 1], got 1.5"),
        (float("nan"), 128, ConfigError, "threshold must be in (0, 1], got nan"),
        ("0.8", 128, ArgumentTypeError, "threshold must be a number, got str '0.8'"),
        (0.8, 1, ConfigError, "num_perm must be ≥ 2, got 1"),
        (0.8, 64.0, ArgumentTypeError, "num_perm must be an int ≥ 2, got float 64.0"),
    ],
)
def test_near_dup_index_and_dedup_settings_share_one_range_check(
    threshold: object, num_perm: object, error: type, message: str
) -> None:
    # One rule, one wording: the index names its own parameter (threshold), the record its field.
    with pytest.raises(error) as direct:
        NearDupIndex(threshold, num_perm)  # type: ignore[arg-type]
    with pytest.raises(error) as record:
        DedupSettings(near_threshold=threshold, num_perm=num_perm)  # type: ignore[arg-type]
    assert str(direct.value) == message
    assert str(record.value) == message.replace("threshold", "near_threshold")


def test_near_dup_index_takes_the_checked_values() -> None:
    idx = NearDupIndex(1, 64)
    assert idx.threshold == 1.0 and isinstance(idx.threshold, float) and idx.num_perm == 64


def test_query_orders_best_first() -> None:
    words = [f"x{i}" for i in range(300)]
    idx = NearDupIndex(threshold=0.5)
    idx.insert("90", minhash_signature(" ".join(words[:270] + ["y"] * 30)))
    idx.insert("100", minhash_signature(" ".join(words)))
    scored = idx.query_scored(minhash_signature(" ".join(words)))
    assert [k for k, _ in scored] == ["100", "90"] and scored[0][1] == 1.0


def test_deduplicator_incremental_add_and_remove() -> None:
    text = " ".join(f"word{i}" for i in range(120))
    d = Deduplicator(threshold=0.8)
    assert d.add("a", text).kind == "new"
    e = d.add("b", text.upper() + " ")
    assert (e.kind, e.duplicate_of, e.similarity) == ("exact", "a", 1.0)
    # 2 of 120 words replaced and 3 added: a word-set Jaccard of 118/125, never estimated as 1.0.
    n = d.add("c", text.replace("word7 ", "word997 ").replace("word1 ", "word991 ") + " word999 word998 word996")
    assert n.kind == "near" and n.duplicate_of == "a" and 0.8 <= n.similarity < 1.0
    assert d.add("z", "something else entirely, unrelated to the rest").kind == "new"
    assert d.members("a") == ["a", "b", "c"] and len(d) == 4
    # Removing the kept copy promotes the next one; the others follow it.
    moved = dict(d.remove("a"))
    assert moved["b"].kind == "new" and moved["c"].duplicate_of == "b"
    assert d.representative("c") == "b" and "a" not in d
    d.remove("c")
    assert d.members("b") == ["b"]


def test_dedup_keeps_every_source() -> None:
    a = Chunk("Earth's atmosphere is mostly nitrogen and oxygen, with traces of argon.", 0, 70, 15)
    b = Chunk("Earth ' s atmosphere is mostly nitrogen and oxygen , with traces of argon .", 9, 84, 18)
    c = Chunk("A completely different chunk about something else.", 0, 51, 9, page_start=2, page_end=2)
    r = dedup([(a, "x.txt"), (c, "y.pdf"), (b, Source("z.txt", 9, 84, 3, 3))])
    assert (len(r.items), r.exact_removed, r.near_removed, r.removed) == (2, 1, 0, 1)
    first = r.items[0]
    assert first.chunk is a
    assert [s.path for s in first.sources] == ["x.txt", "z.txt"] and first.sources[1].page == 3
    assert r.items[1].sources == (Source("y.pdf", 0, 51, 2, 2),)
    assert dedup([]).items == []
    with pytest.raises(ConfigError, match="source"):
        dedup([(a, 3)])


LIGHTHOUSE = (
    "The lighthouse at Cape Wrath was built in 1828 by Robert Stevenson, whose family designed most "
    "of the beacons along the Scottish coast. Its white tower stands on a cliff of Lewisian gneiss "
    "and rises twenty metres above the keepers' cottages, which housed three families until the "
    "light was automated in 1998. Supplies arrived by boat from Kinlochbervie twice a month, and in "
    "winter gales the keepers could be cut off for weeks. Today a small café serves walkers who "
    "cross the Kyle of Durness on a ferry and ride the minibus along eleven miles of single-track road."
)


def test_defaults_catch_a_paragraph_with_five_percent_of_its_words_edited() -> None:
    # bench/dedup_sweep.py's edit, by hand: 5 of the 98 words replaced. Word 3-grams (the default
    # before) lose up to 3 shingles an edit, an estimated Jaccard under 0.8; the default word
    # sets lose one word each.
    words = LIGHTHOUSE.split()
    for k, new in ((7, "Thomas"), (25, "granite"), (44, "two"), (63, "weekly"), (81, "terrace")):
        words[k] = new
    edited = " ".join(words)
    # Another paragraph of the same article, sharing its names and subject: not a copy.
    sibling = (
        "Robert Stevenson's lighthouse at Cape Wrath was automated in 1998 and the keepers left the "
        "cottages. The tower is white, twenty metres tall, and its light can be seen twenty-two "
        "nautical miles out at sea; the fog signal built in 1894 was silenced in 2001. Walkers reach "
        "the cape from Durness by the ferry across the Kyle and a minibus in summer."
    )
    r = dedup([(Chunk(t, 0, len(t), 0), f"{i}.txt") for i, t in enumerate((LIGHTHOUSE, sibling, edited))])
    assert (len(r.items), r.near_removed) == (2, 1)
    assert [s.path for s in r.items[0].sources] == ["0.txt", "2.txt"]
    assert [s.path for s in r.items[1].sources] == ["1.txt"]


def test_near_false_keeps_near_copies() -> None:
    text = " ".join(f"word{i}" for i in range(120))
    pairs = [(Chunk(text, 0, 1, 1), "a"), (Chunk(text + " extra", 0, 1, 1), "b")]
    assert len(dedup(pairs).items) == 1
    assert len(dedup(pairs, near=False).items) == 2


@pytest.mark.shared_data
def test_disflqa_copies_found_and_squad_paragraphs_kept(shared_data: Path) -> None:
    squad = json.loads((shared_data / "squad" / "squaddev_v1.1.json").read_text(encoding="utf-8"))
    paras = [p["context"] for art in squad["data"] for p in art["paragraphs"]]
    task = json.loads((shared_data / "disflqa" / "task.json").read_text(encoding="utf-8"))
    contexts = sorted({ex["input"].split("context: ", 1)[1] for ex in task["examples"]})
    by_letters = {"".join(p.split()): i for i, p in enumerate(paras)}
    gold = [by_letters["".join(c.split())] for c in contexts]
    pairs = [(Chunk(p, 0, len(p), 0), f"squad/{i}") for i, p in enumerate(paras)]
    pairs += [(Chunk(c, 0, len(c), 0), f"disfl/{j}") for j, c in enumerate(contexts)]
    r = dedup(pairs)
    # No two distinct SQuAD paragraphs merged (one pair shares ~71% of its shingles).
    squad_keys = [[s.path for s in it.sources if s.path.startswith("squad/")] for it in r.items]
    assert all(len(k) == 1 for k in squad_keys) and len(r.items) == len(paras)
    # Every Disfl-QA context landed with its own SQuAD paragraph.
    home = {s.path: k[0] for it, k in zip(r.items, squad_keys, strict=True) for s in it.sources}
    found = sum(home[f"disfl/{j}"] == f"squad/{g}" for j, g in enumerate(gold))
    assert found / len(contexts) >= 0.99
    # Near path alone (exact disabled by making every text distinct) still finds them.
    d = Deduplicator()
    for i, p in enumerate(paras):
        d.add(f"s{i}", p, digest=f"s{i}")
    near_hits = sum(
        d.add(f"d{j}", c, digest=f"d{j}").duplicate_of == f"s{g}"
        for j, (c, g) in enumerate(zip(contexts, gold, strict=True))
    )
    assert near_hits / len(contexts) >= 0.99


@pytest.mark.shared_data
def test_constitution_versions(shared_data: Path) -> None:
    files = [shared_data / "versions" / f"constitution.1.{i}.txt" for i in range(10)]
    pairs = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        for c in chunk_text(text, min_tokens=50, max_tokens=400):
            pairs.append((c, Source(f.name, c.start, c.end)))
    r = dedup(pairs)

    def items(title: str):
        return [it for it in r.items if it.chunk.text.startswith(title)]

    # 3.2 is byte-identical in all ten versions: one chunk, ten sources.
    (same,) = items("3.2. Composition and appointment")
    assert sorted(s.path for s in same.sources) == sorted(f.name for f in files)
    assert same.near_similarity == 1.0
    # 2.1 differs only by "Chairman" -> "Chair": merged as a near duplicate.
    (renamed,) = items("2.1. General rules")
    assert len(renamed.sources) == 10 and renamed.near_similarity < 1.0
    # 5.2 changed materially in v1.4 (nine -> six weeks, new nomination rules): kept apart.
    changed = items("5.2. Appointment")
    assert len(changed) >= 2
    groups = [{s.path for s in it.sources} for it in changed]
    assert not any("constitution.1.0.txt" in g and "constitution.1.9.txt" in g for g in groups)


def test_deduplicator_without_exact_keeps_identical_texts_and_check_adds_nothing() -> None:
    from ragbudget.errors import ConfigError
    from ragbudget.input.dedup import Deduplicator, content_hash

    text = "The quick brown fox jumps over the lazy dog"
    keep_all = Deduplicator(near=False, exact=False)
    a, b = keep_all.add("a", text), keep_all.add("b", text)
    assert (a.kind, b.kind) == ("new", "new") and a.content_hash == b.content_hash == content_hash(text)
    d = Deduplicator()
    d.add("a", text)
    probe = d.check("the quick  brown fox jumps over the lazy dog")
    assert probe.kind == "exact" and probe.duplicate_of == "a" and len(d) == 1
    assert d.add("b", decision=probe).kind == "exact" and d.members("a") == ["a", "b"]
    with pytest.raises(ConfigError):
        Deduplicator(near=True, exact=False)
