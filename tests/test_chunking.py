"""Chunking invariants (hypothesis, real tokenizer) and behaviour on real documents."""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import pytest
from _fakes import WordTokenizer as HFWordTokenizer
from hypothesis import HealthCheck, given, settings, strategies as st

from ragbudget.errors import ConfigError
from ragbudget.input import chunking
from ragbudget.input.chunking import chunk_document, chunk_text, chunk_texts
from ragbudget.tokens import get_tokenizer
from ragbudget.types import Document

TOK = get_tokenizer()

# Text built from pieces that stress the tokenizer's pre-split rules: every kind of whitespace
# (incl. U+001C..U+001F, which Python but not the tokenizer calls space), punctuation before
# line breaks, digits, contractions, combining marks, CJK, emoji.
_PIECES = st.sampled_from(
    [
        " ",
        "  ",
        "\n",
        "\n\n",
        "\r\n",
        "\t",
        "\x0b",
        "\x0c",
        "\x1c",
        "\x85",
        "\xa0",
        "\u2028",
        "\u3000",
        ".",
        ". ",
        "!",
        "?\n",
        ":",
        "'s",
        "'",
        '"',
        "(",
        ")",
        "#",
        "# ",
        "## ",
        "=",
        "===",
        "---",
        "1.",
        "1.2 ",
        "Chapter 5",
        "A",
        "the",
        "The",
        "word",
        "Über",
        "e\u0301",
        "é",
        "日本語",
        "😀",
        "123",
        "4567",
        "x" * 30,
        "-",
        "_",
        "/",
        "\\",
        "<|endoftext|>",
    ]
)
_TEXT = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(_PIECES, st.text(max_size=5)), max_size=120).map("".join),
)


def _check(text: str, chunks, lo: int, hi: int) -> None:
    prev_end = -1
    for c in chunks:
        assert text[c.start : c.end] == c.text
        assert c.text and c.text == c.text.strip()
        assert c.n_tokens == len(TOK.encode(c.text)), (c.text, c.n_tokens)
        assert c.n_tokens <= hi
        assert c.start >= prev_end  # ordered, no overlap (overlap=0)
        prev_end = c.end
    # Nothing but whitespace is left out.
    covered = "".join(text[a.end : b.start] for a, b in zip(chunks, chunks[1:], strict=False))
    assert covered.strip() == ""
    if chunks:
        assert text[: chunks[0].start].strip() == "" and text[chunks[-1].end :].strip() == ""
    else:
        assert text.strip() == ""


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_TEXT, lo=st.integers(0, 12), span=st.integers(8, 30))
def test_invariants_on_arbitrary_text(text: str, lo: int, span: int) -> None:
    hi = max(8, lo + span)
    chunks = chunk_text(text, min_tokens=lo, max_tokens=hi)
    _check(text, chunks, lo, hi)
    assert chunk_text(text, min_tokens=lo, max_tokens=hi) == chunks  # deterministic


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_TEXT, lo=st.integers(0, 40), span=st.integers(8, 80))
def test_exact_counts_from_patched_ends(text: str, lo: int, span: int) -> None:
    # Force the fast path (whole-text counts + re-encoded ends) even for tiny chunks, so the
    # exactness argument is exercised on every kind of boundary.
    old = chunking.FAST_MIN_CHARS
    chunking.FAST_MIN_CHARS = 0
    try:
        chunks = chunk_text(text * 3, min_tokens=lo, max_tokens=lo + span)
    finally:
        chunking.FAST_MIN_CHARS = old
    _check(text * 3, chunks, lo, lo + span)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_TEXT)
def test_parallel_piecewise_encoding_is_exact(text: str) -> None:
    # Encode in many pieces cut at line starts (as the threaded path does on big texts): the
    # chunks must be identical to the single-encode result.
    text = text * 4
    serial = chunk_text(text, min_tokens=5, max_tokens=30)
    old = (chunking.PARALLEL_ENCODE_MIN_CHARS, chunking.PARALLEL_PIECE_CHARS)
    chunking.PARALLEL_ENCODE_MIN_CHARS, chunking.PARALLEL_PIECE_CHARS = 0, 1
    try:
        with mock.patch.object(chunking, "cores", lambda: 8):  # more pieces than this machine
            parallel = chunk_text(text, min_tokens=5, max_tokens=30)
    finally:
        chunking.PARALLEL_ENCODE_MIN_CHARS, chunking.PARALLEL_PIECE_CHARS = old
    assert parallel == serial


def test_line_start_cuts_split_the_encoding_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    # Blank lines, indents and CRLF: a text encoded in pieces cut at line starts (8 here) is
    # chunked exactly as the text encoded whole.
    text = "Intro.\n\n  indented\nplain line\n\n\nAfter blanks \r\nCRLF line.\n" * 50
    whole = chunk_text(text, min_tokens=5, max_tokens=30)
    monkeypatch.setattr(chunking, "PARALLEL_ENCODE_MIN_CHARS", 0)
    monkeypatch.setattr(chunking, "PARALLEL_PIECE_CHARS", 1)
    monkeypatch.setattr(chunking, "cores", lambda: 8)
    assert chunk_text(text, min_tokens=5, max_tokens=30) == whole


@settings(max_examples=100, deadline=None)
@given(words=st.lists(st.sampled_from(["alpha", "beta.", "Gamma", "delta,", "\n", "\n\n"]), max_size=400))
def test_word_text_never_splits_words(words: list[str]) -> None:
    text = " ".join(words)
    chunks = chunk_text(text, min_tokens=10, max_tokens=25)
    _check(text, chunks, 10, 25)
    for c in chunks:
        assert c.start == 0 or text[c.start - 1].isspace()
        assert c.end == len(text) or text[c.end].isspace()


@settings(max_examples=100, deadline=None)
@given(text=_TEXT, overlap=st.integers(1, 5))
def test_overlap_invariants(text: str, overlap: int) -> None:
    chunks = chunk_text(text, min_tokens=6, max_tokens=16, overlap=overlap)
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert a.start < b.start <= a.end + len(text)
    for c in chunks:
        assert text[c.start : c.end] == c.text and c.n_tokens == len(TOK.encode(c.text)) <= 16


def test_overlap_repeats_the_previous_tail() -> None:
    text = " ".join(f"word{i}" for i in range(400))
    chunks = chunk_text(text, min_tokens=40, max_tokens=60, overlap=10)
    assert len(chunks) > 3
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b.start < a.end  # overlapping
        assert 5 <= TOK.count(text[b.start : a.end]) <= 12


def test_generic_tokenizer_path_is_exact() -> None:
    # A bare callable forces the slow path (no whole-text offsets, re-encode every chunk).
    enc = TOK.encode
    text = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 40 + "\n\n") * 5
    chunks = chunk_text(text, min_tokens=50, max_tokens=80, tokenizer=lambda t: enc(t))
    _check(text, chunks, 50, 80)
    fast = chunk_text(text, min_tokens=50, max_tokens=80)
    assert [c.n_tokens for c in fast] and all(c.n_tokens <= 80 for c in fast)


def test_headings_are_preferred_and_recorded() -> None:
    body = "This sentence has a few words in it. " * 12
    text = "\n\n".join(["# Guide", "## Install", body, body, "## Usage", body, body, "### Details", body, body])
    chunks = chunk_text(text, min_tokens=100, max_tokens=220)
    starts = [c.text.split("\n")[0] for c in chunks]
    assert starts[0] == "# Guide"
    assert "## Usage" in starts and "### Details" in starts
    by_start = {c.text.split("\n")[0]: c.headings for c in chunks}
    assert by_start["## Usage"] == ("Guide", "Usage")
    assert by_start["### Details"] == ("Guide", "Usage", "Details")


def test_long_sentence_splits_at_words_and_giant_word_at_tokens() -> None:
    sentence = " ".join(["antidisestablishmentarianism"] * 200)
    chunks = chunk_text(sentence, min_tokens=20, max_tokens=50)
    _check(sentence, chunks, 20, 50)
    assert all(c.text.startswith("anti") and c.text.endswith("ism") for c in chunks)
    giant = "x" * 5000
    chunks = chunk_text(giant, min_tokens=20, max_tokens=50)
    _check(giant, chunks, 20, 50)
    assert "".join(c.text for c in chunks) == giant


def test_sizes_in_range_and_sentence_ends() -> None:
    para = "The quick brown fox jumps over the lazy dog near the river bank. " * 9
    text = "\n\n".join([para] * 60)
    chunks = chunk_text(text)
    assert all(300 <= c.n_tokens <= 500 for c in chunks[:-1])
    assert all(c.text.endswith(".") for c in chunks)


def test_small_text_is_one_chunk_and_blank_is_none() -> None:
    assert chunk_text("") == [] and chunk_text(" \n\t ") == []
    (c,) = chunk_text("  Hello there.  ")
    assert (c.text, c.start, c.end, c.n_tokens) == ("Hello there.", 2, 14, 3)


def test_bad_config_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="min_tokens"):
        chunk_text("x", min_tokens=600, max_tokens=500)
    with pytest.raises(ConfigError, match="max_tokens"):
        chunk_text("x", max_tokens=0)
    with pytest.raises(ConfigError, match="overlap"):
        chunk_text("x", min_tokens=10, max_tokens=20, overlap=15)


def test_chunk_document_pages() -> None:
    pages = [f"Page {i} says something. " * 20 for i in range(1, 6)]
    doc = Document(path="p.pdf", pages=pages, meta={"paginated": True})
    chunks = chunk_document(doc, min_tokens=50, max_tokens=120)
    text = doc.text
    for c in chunks:
        assert text[c.start : c.end] == c.text
        assert c.page_start == doc.page_of(c.start) and c.page_end == doc.page_of(c.end - 1)
    assert chunks[0].page_start == 1 and chunks[-1].page_end == 5
    assert chunk_document(Document(path="a.txt", pages=["one two"]))[0].page_start is None


def test_chunk_texts_matches_chunk_text() -> None:
    texts = ["alpha beta. " * 100, "", "gamma\n\ndelta " * 50]
    one = [chunk_text(t, min_tokens=10, max_tokens=40) for t in texts]
    assert chunk_texts(texts, min_tokens=10, max_tokens=40, workers=2) == one


_PROCESS_CHECK = """
import json, sys
import multiprocessing as mp
from ragbudget.input import chunking
from ragbudget.input.chunking import chunk_text, chunk_texts

method = sys.argv[1]
if method == "spawn":  # as on a platform without fork, or with a threaded parent
    mp.get_all_start_methods = lambda: ["spawn"]
used = []
real = mp.get_context
mp.get_context = lambda m=None: (used.append(m), real(m))[1]
chunking.PROCESS_MIN_CHARS = 0
texts = [("Sentence number %d is here. " % i) * (40 + 13 * i) for i in range(7)] + ["", "x"]
one = [chunk_text(t, min_tokens=20, max_tokens=60) for t in texts]
print(json.dumps({"same": chunk_texts(texts, min_tokens=20, max_tokens=60, workers=2) == one,
                  "used": used}))
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_chunk_texts_in_processes(method: str) -> None:
    """Worker processes give exactly the sequential result, in input order, with either start
    method. Run in a fresh interpreter: fork is chosen only while no other thread runs, and a
    test session has threads left by other tests."""
    import json
    import multiprocessing as mp
    import subprocess
    import sys

    if method not in mp.get_all_start_methods():
        pytest.skip(f"{method} start method not available")
    out = subprocess.run(
        [sys.executable, "-c", _PROCESS_CHECK, method], capture_output=True, text=True, timeout=300, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"same": True, "used": [method]}


def test_chunk_texts_avoids_fork_while_other_threads_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing as mp
    import threading

    started, stop = threading.Event(), threading.Event()
    other = threading.Thread(target=lambda: (started.set(), stop.wait()), daemon=True)
    other.start()
    started.wait()
    used: list[str] = []
    real = mp.get_context
    monkeypatch.setattr(mp, "get_context", lambda m=None: (used.append(m), real(m))[1])
    monkeypatch.setattr(chunking, "PROCESS_MIN_CHARS", 0)
    texts = ["One sentence here. " * 200, "Another text. " * 150]
    one = [chunk_text(t, min_tokens=20, max_tokens=60) for t in texts]
    try:
        assert chunk_texts(texts, min_tokens=20, max_tokens=60, workers=2) == one
    finally:
        stop.set()
    assert used and used[0] != "fork"


def test_chunk_texts_other_tokenizer_uses_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer object that a worker process cannot rebuild by name stays in this process."""
    monkeypatch.setattr(chunking, "PROCESS_MIN_CHARS", 0)
    import concurrent.futures

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", lambda *a, **k: pytest.fail("used processes"))
    from ragbudget.tokens import HFTokenizer

    tok = HFTokenizer(HFWordTokenizer())
    texts = ["word " * 300, "more words here " * 100]
    one = [chunk_text(t, min_tokens=20, max_tokens=60, tokenizer=tok) for t in texts]
    assert chunk_texts(texts, min_tokens=20, max_tokens=60, tokenizer=tok, workers=2) == one


@pytest.mark.shared_data
def test_a_gnu_manual_pdf_has_no_contents_line_for_a_heading(shared_data: Path) -> None:
    # R-intro.pdf (texinfo, GNU style): its contents pages end with "Appendix F References . . .
    # 107", which used to head 26 of its 150 chunks; "Chapter 7 [Reading data from files], page
    # 33." (a cross reference starting a line) headed 31 more.
    from ragbudget.input.loaders import load_document

    doc = load_document(shared_data / "pdf" / "R-intro.pdf")
    chunks = chunk_document(doc)
    heads = [h for c in chunks for h in c.headings]
    leaders = [h for h in heads if re.search(r"(\.\s*){2,}\d+\s*$", h) or "], page" in h]
    assert not leaders, sorted(set(leaders))
    assert "Appendix B Invoking R" in heads  # the appendix itself, where it starts, still heads it


@pytest.mark.shared_data
def test_real_documents(shared_data: Path) -> None:
    files = sorted((shared_data / "pdf" / "twins").glob("*.txt"))
    files += sorted((shared_data / "manpages").glob("*.txt"))[:5]
    files += sorted((shared_data / "versions").glob("constitution.1.9.txt"))
    total = inside = 0
    for f in files:
        text = f.read_text(encoding="utf-8")
        chunks = chunk_text(text)
        for c in chunks:
            assert text[c.start : c.end] == c.text and c.n_tokens <= 500
        for c in chunks[::7]:  # exact counts, spot-checked (every chunk is checked above)
            assert c.n_tokens == TOK.count(c.text)
        total += len(chunks) - 1
        inside += sum(300 <= c.n_tokens <= 500 for c in chunks[:-1])
    assert inside / total >= 0.95
