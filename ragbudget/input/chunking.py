"""Structure-aware chunking with exact token counts and exact character offsets.

One job: cutting a text into token-bounded chunks with exact offsets and counts (the boundary
finder and the exact-count arithmetic are one algorithm).

:func:`chunk_text` cuts a text into chunks of ``min_tokens``–``max_tokens`` tokens, preferring (in
this order) a heading, a blank-line paragraph break, a line break after a sentence or before a list
item, a sentence end inside a line, any other line break, a word boundary, and, only for a "word"
longer than ``max_tokens`` on its own, a token boundary. Every chunk satisfies
``text[c.start:c.end] == c.text`` and ``c.n_tokens == len(tokenizer.encode(c.text))``.

How it stays about as fast as one tokenizer pass
------------------------------------------------
The document is encoded **once** (tiktoken, into a numpy buffer); the character offset of every
token boundary is recovered from the byte length of each token id (a vectorised lookup), so the
token count between any two positions is a ``searchsorted``. Boundaries are found with a handful
of regular expressions over the whole text, and cuts are planned on those numbers.

BPE is not additive over concatenation in general, but tiktoken's ``cl100k_base`` first splits the
text with a regular expression and merges only inside each piece. At some positions the split is
provably *local*: cutting there gives the same pieces on both sides as in the whole text (see
:data:`_EXACT_POINT`: the end of a word followed by a space, a letter or digit followed by a line
break, the start of a line that has text). Between two such points the count read from the
whole-text encoding is exact, so a chunk's exact count only needs its first and last few
characters re-encoded. Other tokenizers (Hugging Face, o200k, custom) take the slower, equally
exact path: every chunk is re-encoded and shrunk if it ran over.
"""

from __future__ import annotations

import bisect
import functools
import gc
import itertools
import os
import re
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..settings import check_sizes
from ..tokens import TiktokenTokenizer, Tokenizer, get_tokenizer
from ..types import Chunk, Document

__all__ = ["chunk_document", "chunk_text", "chunk_texts"]

# Boundary levels: lower is preferred. Within the allowed window the chunker cuts at the best
# level present, and among equals at the last one (larger chunks, fewer of them), except for
# headings (the first one; see _Chunker._choose).
_HEADING, _PARAGRAPH, _LINE_SENTENCE, _SENTENCE, _LINE, _WORD, _TOKEN = range(7)

# Unicode White_Space, spelled out: Python's ``\s`` also matches U+001C..U+001F, which the
# tokenizer's regex (Rust ``\s``) does not, and the exactness argument depends on agreeing with it.
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_WS_NONL = "\t\x0b\x0c \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"

# Positions where cl100k's pre-tokenizer splits the text the same way whether or not the text is
# cut there (so token counts add up across the cut):
#  (a) after a non-space, before a space that is not a line break;
#  (b) after a letter or digit, before a line break (after punctuation, "[\r\n]*" glues the
#      newlines to the punctuation piece, so that is NOT such a point);
#  (c) after "\n", before spaces-then-text (a blank line or trailing spaces would merge pieces).
_EXACT_POINT = re.compile(rf"(?<=[^{_WS}])(?=[{_WS_NONL}])|(?<=[^\W_])(?=[\r\n])|(?<=\n)(?=[{_WS_NONL}]*[^{_WS}])")
# Below this many characters re-encoding a chunk is as cheap as patching its ends.
_FAST_MIN_CHARS = 64
# cl100k_base's pre-tokenizer pattern: the exact fast path is enabled only for this pattern.
_CL100K_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)

# Separators. Every pattern starts with a literal or a small class so that ``re`` can skip
# ahead quickly (a leading lookbehind or ``[ \t]*`` made one of these 20x slower than encoding).
# A candidate is (left end, next start, level); the left end may still have trailing spaces,
# which the planner strips.
_CLOSERS = "\"'”’)\\]»"
# A sentence end inside a line is terminal punctuation (+ closing quotes), spaces, then a
# capital, digit or opening quote (found with numpy in _candidates). Short words before the
# period are checked against common abbreviations here.
_ABBREV = re.compile(r"(?:^|[\s(])(?:[A-Z]|Mr|Mrs|Ms|Dr|St|vs|e\.g|i\.e|cf|No|Fig|\d{1,3})$")
_WORD_RE = re.compile(rf"[{_WS}]+")
_WORD_START = re.compile(rf"[{_WS}]+(?=[^{_WS}])")
_BLANK_BEFORE = re.compile(r"\n[ \t]*\n[ \t]*$")

# Headings. Lines are pre-filtered with numpy on their first characters; these patterns are
# then matched (anchored) at the few line starts that could be headings.
_MD_HEAD = re.compile(r"[ ]{0,3}(#{1,6})[ \t]+(\S[^\n]*?)[ \t#]*(?=\n|\Z)")
_RST_UNDER = re.compile(r"([=\-~^\"'*+#`:.])\1{2,}[ \t]*(?=\n|\Z)")
_NUM_HEAD = re.compile(
    r"[ \t]{0,4}((?:\d{1,3}\.)*\d{1,3}\.?|[A-Z]\.(?:\d{1,3}\.)*\d{0,3})[ \t]+"
    r"([A-Z][^\n]{0,90}?)[ \t]*(?=\n[ \t]*\n|\n[=\-~^\"'*+#`:.]{3,}[ \t]*\n|\Z)"
)
_CHAPTER_HEAD = re.compile(
    r"[ \t]{0,4}((?:Chapter|CHAPTER|Appendix|APPENDIX|Part|PART)[ \t]+[0-9IVXLA-Z]{1,6}\b[^\n]{0,90})(?=\n|\Z)"
)
_CAPS_HEAD = re.compile(r"([A-Z][A-Z0-9 /&(),'-]{2,40})[ \t]*(?=\n(?:[ \t]+\S|[ \t]*\n))")
# A table-of-contents entry ("Appendix A GNU Free Documentation License . . 76", "1.2 Scope .... 5",
# "Preface ··· iii"): a dot leader (two or more dots, ellipses or middle dots, spaced or not) then
# a page number, arabic or roman, at the end of the line. It names a section that starts pages
# later, so taken for a heading it would label every chunk after the contents with the last
# entry. Never a heading, whatever pattern matched it; nor is a line holding a texinfo cross
# reference ("Chapter 7 [Reading data from files], page 33.": a sentence wrapped so that it starts
# like a chapter heading).
_TOC_ENTRY = re.compile(r"(?:[.…·][ \t]*){2,}(?:\d{1,4}|[ivxlcdm]{1,7}|[IVXLCDM]{1,7})[ \t]*$")
_NOT_A_HEADING = re.compile(rf"{_TOC_ENTRY.pattern}|\[[^\]\n]+\], pages? \d")


@dataclass(frozen=True)
class _Heading:
    start: int  # first character of the heading line
    depth: int
    title: str


def chunk_text(
    text: str,
    *,
    min_tokens: int = 300,
    max_tokens: int = 500,
    overlap: int = 0,
    tokenizer: Any = None,
) -> list[Chunk]:
    """Cut ``text`` into chunks of at most ``max_tokens`` tokens, preferring structural boundaries.

    Chunks hold between ``min_tokens`` and ``max_tokens`` tokens, except the last chunk of the
    text (a short tail is avoided when possible: cuts that would leave fewer than ``min_tokens``
    behind are used only when nothing else fits) and text that cannot be cut at a word boundary
    inside the window. ``overlap`` repeats about that many tokens of the previous chunk at the
    start of the next one (starting at a word). Leading and trailing whitespace is never part of
    a chunk; a text that is only whitespace gives no chunks. The result is deterministic.

    >>> text = "# Setup\\n\\nInstall it. Then run it.\\n\\n## Usage\\n\\nCall chunk_text on a string."
    >>> [(c.text, c.n_tokens, c.headings) for c in chunk_text(text, min_tokens=4, max_tokens=12)]
    [('# Setup\\n\\nInstall it. Then run it.', 10, ('Setup',)),
     ('## Usage\\n\\nCall chunk_text on a string.', 10, ('Setup', 'Usage'))]
    """
    check_sizes(min_tokens, max_tokens, overlap)
    tok = get_tokenizer(tokenizer)
    return _Chunker(text, tok, min_tokens, max_tokens, overlap).run()


def chunk_texts(
    texts: Sequence[str],
    *,
    min_tokens: int = 300,
    max_tokens: int = 500,
    overlap: int = 0,
    tokenizer: Any = None,
    workers: int = 1,
) -> list[list[Chunk]]:
    """:func:`chunk_text` over many texts, in order; ``workers > 1`` spreads them over processes.

    The boundary planning is Python and holds the GIL, so threads only overlap tiktoken's
    encoding; worker *processes* run whole texts side by side. They are used when the batch is
    large enough to repay starting them (:data:`PROCESS_MIN_CHARS`) and the tokenizer can be
    rebuilt from its name in a worker (tiktoken encodings: the default). Otherwise, e.g. with a
    Hugging Face tokenizer object, a thread pool is used. The result is the same either way.

    ``workers=1`` is one process but not always one thread: a text of at least
    :data:`PARALLEL_ENCODE_MIN_CHARS` characters is encoded by tiktoken in helper threads (at most
    one per core) while its boundaries are planned; worker processes turn that off, since they
    already use the cores.

    >>> [len(cs) for cs in chunk_texts(["One short text.", "", "Another one."], workers=2)]
    [1, 0, 1]
    """
    check_sizes(min_tokens, max_tokens, overlap)
    tok = get_tokenizer(tokenizer)
    texts = list(texts)
    if workers <= 1 or len(texts) < 2:
        return [_Chunker(t, tok, min_tokens, max_tokens, overlap).run() for t in texts]
    total = sum(map(len, texts))
    if isinstance(tok, TiktokenTokenizer) and total >= PROCESS_MIN_CHARS:
        return _chunk_in_processes(texts, tok.name, (min_tokens, max_tokens, overlap), workers)

    def one(t: str) -> list[Chunk]:
        return _Chunker(t, tok, min_tokens, max_tokens, overlap).run()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, texts))


def chunk_document(doc: Document, **kw: Any) -> list[Chunk]:
    """:func:`chunk_text` over ``doc.text``, with ``page_start``/``page_end`` set when paginated.

    Pages are 1-based and taken from :meth:`Document.page_of` of the chunk's first and last
    character, so a chunk running over a page break says so.

    >>> d = Document(path="a.txt", pages=["Page one has some text.", "Page two has more."])
    >>> [(c.page_start, c.page_end) for c in chunk_document(d, min_tokens=1, max_tokens=8)]
    [(1, 1), (2, 2)]
    """
    text = doc.text
    chunks = chunk_text(text, **kw)
    if not doc.paginated:
        return chunks
    starts = doc.page_starts
    out = []
    for c in chunks:
        first = max(1, bisect.bisect_right(starts, c.start))
        last = max(1, bisect.bisect_right(starts, max(c.start, c.end - 1)))
        out.append(Chunk(c.text, c.start, c.end, c.n_tokens, c.headings, page_start=first, page_end=last))
    return out


@functools.lru_cache(maxsize=4)
def _token_char_counts(enc: Any) -> np.ndarray:
    """For every token id: how many UTF-8 lead bytes (characters begun) its bytes hold.

    Summed over a text's tokens this gives character offsets of the token boundaries without
    decoding anything; a token ending inside a multi-byte character maps to that character's
    end (its lead byte was counted already).
    """
    counts = np.zeros(enc.n_vocab, dtype=np.int64)
    for b, rank in enc._mergeable_ranks.items():
        counts[rank] = sum(1 for byte in b if byte & 0xC0 != 0x80)
    return counts


def _fast_encoding(tok: Tokenizer) -> Any:
    """The tiktoken ``Encoding`` when the exact fast path applies, else ``None``."""
    if not isinstance(tok, TiktokenTokenizer):
        return None
    enc = tok._enc
    if getattr(enc, "_pat_str", None) != _CL100K_PAT or not hasattr(enc, "_mergeable_ranks"):
        return None
    return enc


class _Chunker:
    """One text's chunking state; :meth:`run` returns the chunks."""

    def __init__(self, text: str, tok: Tokenizer, lo: int, hi: int, overlap: int) -> None:
        self.text, self.tok, self.lo, self.hi, self.overlap = text, tok, lo, hi, overlap
        self.enc = _fast_encoding(tok)
        self._line_cache: tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray] | None = None

    # -- token positions -------------------------------------------------------------------

    def _token_boundaries(self) -> np.ndarray:
        """Character offset of every token boundary (``tb[0] == 0``, ``tb[-1] == len(text)``)."""
        text = self.text
        if self.enc is not None:
            ids = self.enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
            tb = np.zeros(len(ids) + 1, dtype=np.int64)
            np.cumsum(_token_char_counts(self.enc)[ids], out=tb[1:])
            return tb
        # Generic tokenizer: count per line and spread each line's tokens evenly over its
        # characters. Only used for planning; final counts are re-encoded exactly.
        points = [0]
        pos = 0
        for line in text.splitlines(keepends=True):
            n = self.tok.count(line)
            for k in range(1, n + 1):
                points.append(pos + round(len(line) * k / n))
            pos += len(line)
        if len(points) > 1:
            points[-1] = len(text)
        return np.asarray(points, dtype=np.int64)

    # -- boundaries --------------------------------------------------------------------------

    def _lines(self) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]:
        """(padded code points, length, newline offsets, line starts, first non-blank of each line).

        Line ``i`` starts at ``starts[i]`` (0, then one past each newline); reads past the end
        of the text see NUL padding, which no test below accepts.
        """
        cached = self._line_cache
        if cached is None:
            raw = self.text.encode("utf-32-le", errors="surrogatepass")
            cp = np.frombuffer(raw, dtype=np.uint32)
            n = len(cp)
            pad = np.zeros(n + 4, dtype=np.uint32)
            pad[:n] = cp
            nl = np.flatnonzero(cp == 10)
            starts = np.empty(len(nl) + 1, dtype=np.int64)
            starts[0] = 0
            starts[1:] = nl + 1
            first = _skip(pad, starts, _is_blank)
            cached = self._line_cache = (pad, n, nl, starts, first)
        return cached

    def _headings(self) -> list[_Heading]:
        text = self.text
        pad, _n, _nl, starts, first = self._lines()
        indent = first - starts
        c0, c1 = pad[first], pad[first + 1]
        upper0 = (c0 >= 65) & (c0 <= 90)
        digit0 = (c0 >= 48) & (c0 <= 57)
        s0 = pad[starts]
        found: dict[int, _Heading] = {}
        rst_levels: dict[str, int] = {}
        under = _is_underline(s0) & (pad[starts + 1] == s0) & (pad[starts + 2] == s0)
        for i in np.flatnonzero(under[1:]) + 1:
            line_start = int(starts[i])
            m = _RST_UNDER.match(text, line_start)
            if m is None:
                continue
            # The title is the line above the underline (overline-only lines have no text).
            prev_start = int(starts[i - 1])
            title = text[prev_start : line_start - 1].strip()
            mark = m.group(0).strip()
            if (
                not title
                or text[prev_start].isspace()
                or len(mark) < len(title)
                or len(title) > 120
                or not any(ch.isalnum() for ch in title)
            ):
                continue
            depth = rst_levels.setdefault(mark[0], len(rst_levels) + 1)
            num = _NUMBER_PREFIX.match(title)
            if num:  # "1.3.1. Early history": the number says the depth better than the style
                depth = num.group(1).count(".") + 1
            found[prev_start] = _Heading(prev_start, depth, title)
        for i in np.flatnonzero((c0 == 35) & (indent <= 3)):
            m = _MD_HEAD.match(text, int(starts[i]))
            if m:
                found[m.start()] = _Heading(m.start(), len(m.group(1)), m.group(2).strip())
        numbered = (indent <= 4) & (digit0 | (upper0 & (c1 == 46)))
        for i in np.flatnonzero(numbered):
            start = int(starts[i])
            if start in found:
                continue
            m = _NUM_HEAD.match(text, start)
            if m is None:
                continue
            # A numbered heading stands alone: blank line (or start of text) before it too,
            # which tells "1. Introduction" from the first item of a numbered list.
            pre = text[max(0, start - 200) : start]
            if start > 0 and not _BLANK_BEFORE.search(pre) and (start > 200 or pre.strip()):
                continue
            title = m.group(2)
            if title[-1] in ".,;:" or len(title) > 80:
                continue
            depth = m.group(1).rstrip(".").count(".") + 1
            found[start] = _Heading(start, depth, f"{m.group(1)} {title}".strip())
        # "Chapter", "Appendix", "Part" (any case) and ALL-CAPS lines: check two characters
        # before running a regex (most lines of prose start with a capital too).
        chapter = (indent <= 4) & _is_chapter0(c0) & _is_chapter1(c1)
        caps = (indent == 0) & upper0 & (_is_upper(c1) | ((c1 >= 48) & (c1 <= 57)))
        for mask, rx in ((chapter, _CHAPTER_HEAD), (caps, _CAPS_HEAD)):
            for i in np.flatnonzero(mask):
                start = int(starts[i])
                if start not in found:
                    m = rx.match(text, start)
                    if m:
                        found[start] = _Heading(start, 1, m.group(1).strip())
        return [found[k] for k in sorted(found) if not _NOT_A_HEADING.search(found[k].title)]

    def _candidates(self, headings: list[_Heading]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All structural cut points: (left end, next start, level), sorted by left end."""
        text = self.text
        n_text = len(text)
        ends: list[int] = []
        nexts: list[int] = []
        levels: list[int] = []
        # Line and paragraph breaks, vectorised over the code points (a Python loop per line
        # cost as much as the whole tokenizer pass).
        pad, n, nl, _starts, first = self._lines()
        q = first[1:]  # first non-blank character of the line after each newline
        cq = pad[q]
        line = (q < n) & ~_is_space(cq)  # the next line has text (not blank, not the end)
        prev = pad[nl - 1]  # nl - 1 == -1 reads the padding: "no character"
        prev2 = pad[nl - 2]
        good = _is_sent_end(prev) | (_is_closer(prev) & _is_sent_end(prev2))
        # A list item starting the next line: "- x", "* x", "1. x", "12) x", "(a) x", "a) x".
        c0, c1, c2, c3 = cq, pad[q + 1], pad[q + 2], pad[q + 3]
        blank1, blank2, blank3 = _is_blank(c1), _is_blank(c2), _is_blank(c3)
        digit0, digit1 = (c0 >= 48) & (c0 <= 57), (c1 >= 48) & (c1 <= 57)
        closer1, closer2 = (c1 == 46) | (c1 == 41), (c2 == 46) | (c2 == 41)
        listy = (_is_bullet(c0) & blank1) | (digit0 & closer1 & blank2)
        listy |= digit0 & digit1 & closer2 & blank3
        listy |= (c0 == 40) & _is_alnum_ascii(c1) & (c2 == 41) & blank3
        listy |= _is_alnum_ascii(c0) & (c1 == 41) & blank2
        ends.extend(nl[line].tolist())
        nexts.extend(q[line].tolist())
        levels.extend(np.where((good | listy)[line], _LINE_SENTENCE, _LINE).tolist())
        # Blank lines: one candidate per blank run (its first newline), the next chunk starts
        # at the next text.
        para = np.flatnonzero((cq == 10) & (prev != 10))
        nxt = _skip(pad, q[para], _is_space)
        para_ok = nxt < n
        ends.extend(nl[para[para_ok]].tolist())
        nexts.extend(nxt[para_ok].tolist())
        levels.extend([_PARAGRAPH] * int(para_ok.sum()))
        # Sentence ends inside lines, vectorised too: terminal punctuation, closing quotes,
        # spaces, then a capital or digit (optionally after an opening quote or bracket).
        punct = np.flatnonzero((pad == 46) | (pad == 33) | (pad == 63))
        after = _skip(pad, punct + 1, _is_closer)
        gap = _is_blank(pad[after])
        punct, after = punct[gap], after[gap]
        nxt = _skip(pad, after, _is_blank)
        c = pad[nxt]
        opener = _is_opener(c)
        c = np.where(opener, pad[nxt + 1], c)
        ok = _is_upper(c) | ((c >= 48) & (c <= 57))
        # Not sentence ends: initials ("J. Smith", "U.S. Army") and list markers ("  1. The").
        x1, x2, x3 = pad[punct - 1], pad[punct - 2], pad[punct - 3]
        ok &= ~(_is_upper(x1) & ~_is_alpha(x2))
        digit1, digit2 = (x1 >= 48) & (x1 <= 57), (x2 >= 48) & (x2 <= 57)
        edge2, edge3 = _is_blank(x2) | (x2 == 10) | (x2 == 0), _is_blank(x3) | (x3 == 10) | (x3 == 0)
        ok &= ~(digit1 & (edge2 | (digit2 & edge3)))
        # Short words may be abbreviations ("Mr.", "e.g.", "Fig."): checked one by one.
        short = ok & _is_alpha(x1) & ~(_is_alpha(x2) & _is_alpha(x3) & _is_alpha(pad[punct - 4]))
        for k in np.flatnonzero(short):
            p0 = int(punct[k])
            if _ABBREV.search(text, max(0, p0 - 6), p0):
                ok[k] = False
        ends.extend(after[ok].tolist())
        nexts.extend(nxt[ok].tolist())
        levels.extend([_SENTENCE] * int(ok.sum()))
        for h in headings:
            # The heading line may be indented: the next chunk starts at its first character.
            first_char = h.start
            while first_char < n_text and text[first_char] in " \t":
                first_char += 1
            end = h.start
            while end > 0 and text[end - 1].isspace():
                end -= 1
            if 0 < end < first_char:
                ends.append(end)
                nexts.append(first_char)
                levels.append(_HEADING)
        if not ends:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        e = np.asarray(ends, dtype=np.int64)
        nx = np.asarray(nexts, dtype=np.int64)
        lv = np.asarray(levels, dtype=np.int64)
        # One candidate per left end, keeping the best level (and its widest separator).
        order = np.lexsort((-nx, lv, e))
        e, nx, lv = e[order], nx[order], lv[order]
        keep = np.ones(len(e), dtype=bool)
        keep[1:] = e[1:] != e[:-1]
        return e[keep], nx[keep], lv[keep]

    # -- exact counts --------------------------------------------------------------------------

    def _count(self, s: int, e: int) -> int:
        """Exact token count of ``text[s:e]``."""
        text = self.text
        if self.enc is None or e - s < _FAST_MIN_CHARS:
            return self.tok.count(text[s:e])
        # A chunk that starts a line starts at an exact point; one that ends a sentence inside
        # a line, a word before a line break, or the text, ends at one: that end needs no
        # re-encoding (when it is also a token boundary, checked below).
        s_exact = s == 0 or (text[s - 1] == "\n" and not text[s].isspace())
        e_exact = (
            e == len(text)
            or (not text[e - 1].isspace() and text[e] in _WS_NONL_CHARS)
            or (text[e - 1].isascii() and text[e - 1].isalnum() and text[e] in "\r\n")
        )
        # Otherwise the first and last exact points strictly inside the chunk; between them the
        # whole-text encoding is exact (module docstring), so only the two ends are re-encoded.
        # The usual point is a word end before a plain space, found with str.find; the regex is
        # the fallback for text without such spaces.
        p1 = s if s_exact else _space_point(text, s + 1, e, last=False)
        p2 = e if e_exact else _space_point(text, s + 1, e, last=True)
        if p1 < 0 or p2 < 0:
            head = _EXACT_POINT.search(text, s + 1, min(e, s + 400))
            tail = None
            for m in _EXACT_POINT.finditer(text, max(s + 1, e - 400), e):
                tail = m
            if head is None or tail is None:
                return self.tok.count(text[s:e])
            p1, p2 = head.start(), tail.start()
        if p2 <= p1:
            return self.tok.count(text[s:e])
        if p2 < e and not self._exact_inside(p2, e):
            return self.tok.count(text[s:e])
        tb = self.tb
        # A token ending inside a multi-byte character maps to that character's end, so a
        # position may appear more than once in tb: the last one has every such token before it.
        k1 = int(tb.searchsorted(p1, side="right")) - 1
        k2 = int(tb.searchsorted(p2, side="right")) - 1
        if tb[k1] != p1 or tb[k2] != p2:  # not a token boundary: the argument does not hold
            return self.tok.count(text[s:e])
        head_n = self.tok.count(text[s:p1]) if p1 > s else 0
        tail_n = self.tok.count(text[p2:e]) if p2 < e else 0
        return head_n + (k2 - k1) + tail_n

    def _exact_inside(self, p: int, e: int) -> bool:
        """A type-(c) point must see its line's text before ``e``; (a)/(b) are local."""
        if self.text[p - 1] != "\n":
            return True
        q = p
        while q < e and self.text[q] in " \t\x0b\x0c\x85\xa0":
            q += 1
        return q < e

    # -- planning ----------------------------------------------------------------------------

    def _ti(self, pos: int) -> int:
        return int(self.tb.searchsorted(pos))

    def run(self) -> list[Chunk]:
        text = self.text
        stripped = text.strip()
        if not stripped:
            return []
        doc_start = len(text) - len(text.lstrip())
        doc_end = len(text.rstrip())
        if self.enc is not None and len(text) >= PARALLEL_ENCODE_MIN_CHARS:
            # tiktoken releases the GIL: the text is encoded in helper threads (in pieces cut at
            # line starts, where the encoding provably splits the same way, so the ids are
            # those of one whole-text encode) while this thread finds the boundaries.
            pool = _encode_pool()
            pieces = min(_cpus(), len(text) // PARALLEL_PIECE_CHARS + 1)
            cuts = [0, *_line_start_cuts(text, pieces), len(text)]
            enc = self.enc
            futures = [
                pool.submit(enc.encode_to_numpy, text[a:b], allowed_special=set(), disallowed_special=())
                for a, b in itertools.pairwise(cuts)
            ]
            headings = self._headings()
            c_end, c_next, c_lvl = self._candidates(headings)
            ids = np.concatenate([f.result() for f in futures])
            self.tb = tb = np.zeros(len(ids) + 1, dtype=np.int64)
            np.cumsum(_token_char_counts(enc)[ids], out=tb[1:])
        else:
            self.tb = tb = self._token_boundaries()
            headings = self._headings()
            c_end, c_next, c_lvl = self._candidates(headings)
        c_ti = tb.searchsorted(c_end).tolist()
        c_end, c_next, c_lvl = c_end.tolist(), c_next.tolist(), c_lvl.tolist()
        t_end = self._ti(doc_end)
        head_pos = [h.start for h in headings]
        paths = _heading_paths(headings)

        chunks: list[Chunk] = []
        s = doc_start
        guard = 0
        while s < doc_end:
            guard += 1
            if guard > 4 * len(text) + 10:  # cannot happen; a safety net against a planning bug
                raise RuntimeError("chunker made no progress")
            t_s = self._ti(s)
            budget = self.hi
            while True:
                e, nxt = self._choose(s, t_s, t_end, doc_end, budget, c_end, c_next, c_lvl, c_ti)
                # Separators are whitespace runs, but odd spaces (U+001C..) may sit at their
                # edges: chunks neither start nor end with whitespace.
                while e > s + 1 and text[e - 1].isspace():
                    e -= 1
                while nxt < doc_end and text[nxt].isspace():
                    nxt += 1
                n = self._count(s, e)
                if n <= self.hi:
                    break
                # The plan used whole-text counts; the exact count ran over: shrink and retry.
                budget -= max(1, n - self.hi)
                if budget < 1:
                    e, nxt, n = self._token_cut(s, 1)
                    break
            hi = bisect.bisect_right(head_pos, s) - 1
            chunks.append(Chunk(text[s:e], s, e, n, paths[hi] if hi >= 0 else ()))
            if nxt >= doc_end:
                break
            s = self._overlap_start(s, e, nxt) if self.overlap else nxt
        return chunks

    def _choose(self, s, t_s, t_end, doc_end, budget, c_end, c_next, c_lvl, c_ti):  # type: ignore[no-untyped-def]
        """Pick the end of the chunk starting at ``s``: returns (end, start of the next chunk)."""
        if t_end - t_s <= budget:
            return doc_end, doc_end
        lo_t = t_s + min(self.lo, budget)
        hi_t = t_s + budget
        # Plain lists and bisect: the window holds a few dozen candidates, and numpy's per-call
        # overhead cost more than the loop.
        i = bisect.bisect_right(c_end, s)
        j0 = max(i, bisect.bisect_left(c_ti, lo_t))  # c_ti is sorted like c_end
        j1 = max(i, bisect.bisect_right(c_ti, hi_t))
        if j1 > j0:
            # Best level wins, the last one among equals; cuts leaving fewer than min_tokens
            # behind (a tiny tail) only when nothing else is in the window.
            # Headings are the exception: the *first* one past min_tokens, so a chunk boundary
            # depends only on the text just before it, and chunks of two versions of a
            # document re-align at every section (what cross-version dedup needs).
            tail_ok = t_end - self.lo
            best_key, k = None, j0
            for j in range(j0, j1):
                lvl = c_lvl[j]
                key = (lvl + (0 if c_ti[j] <= tail_ok else 100), j if lvl == _HEADING else -j)
                if best_key is None or key < best_key:
                    best_key, k = key, j
            return c_end[k], c_next[k]
        # No structural boundary in the window: cut at the last word boundary that fits.
        e, nxt = self._word_cut(s, hi_t)
        if e is not None:
            return e, nxt
        # A single "word" longer than the budget: cut at a token boundary.
        e, nxt, _ = self._token_cut(s, budget)
        return e, nxt

    def _word_cut(self, s: int, hi_t: int) -> tuple[int | None, int]:
        tb = self.tb
        limit = int(tb[min(hi_t, len(tb) - 1)])
        best = None
        for m in _WORD_RE.finditer(self.text, s + 1, limit + 1):
            if m.start() <= limit and m.start() > s:
                best = m
        if best is None:
            return None, 0
        return best.start(), best.end()

    def _token_cut(self, s: int, budget: int) -> tuple[int, int, int]:
        """Cut after at most ``budget`` tokens from ``s``; exact by re-encoding."""
        tb = self.tb
        t_s = self._ti(s)
        k = budget
        while True:
            e = int(tb[min(t_s + k, len(tb) - 1)])
            e = max(e, s + 1)
            n = self.tok.count(self.text[s:e])
            if n <= self.hi or e == s + 1:
                break
            k -= max(1, n - self.hi)
        nxt = e
        while nxt < len(self.text) and self.text[nxt] in _WS_CHARS:
            nxt += 1
        # Do not end inside whitespace: the next chunk starts at text.
        e2 = len(self.text[s:e].rstrip()) + s
        if e2 > s:
            n = self.tok.count(self.text[s:e2]) if e2 != e else n
            e = e2
        return e, nxt, n

    def _overlap_start(self, s: int, e: int, nxt: int) -> int:
        """Start of the next chunk: a word start about ``overlap`` tokens before ``e``."""
        t_target = self._ti(e) - self.overlap
        pos = int(self.tb[max(0, t_target)])
        pos = max(pos, s + 1)
        if pos >= e:
            return nxt
        m = _WORD_START.search(self.text, pos - 1, e)
        if m is None or m.end() >= e:
            return nxt
        return max(m.end(), s + 1)


def _space_point(text: str, lo: int, hi: int, *, last: bool) -> int:
    """The first (or last) plain space in ``text[lo:hi]`` right after a non-space — a word end
    before a space, an exact point of type (a) — or -1 (none within 32 tries)."""
    p = text.rfind(" ", lo, hi) if last else text.find(" ", lo, hi)
    for _ in range(32):
        if p < 0 or not text[p - 1].isspace():
            return p
        p = text.rfind(" ", lo, p) if last else text.find(" ", p + 1, hi)
    return -1


# str.isspace for every code point up to U+3000 (nothing above it is a space).
_SPACE_TABLE = np.array([chr(i).isspace() for i in range(0x3001)], dtype=bool)


def _is_space(cp: np.ndarray) -> np.ndarray:
    return _SPACE_TABLE[np.minimum(cp, 0x3000)] & (cp <= 0x3000)


def _is_alnum_ascii(c: np.ndarray) -> np.ndarray:
    return ((c >= 48) & (c <= 57)) | ((c >= 65) & (c <= 90)) | ((c >= 97) & (c <= 122))


class _CharSet:
    """Membership test of code-point arrays in a small character set (a lookup table)."""

    def __init__(self, chars: str) -> None:
        self.size = max(map(ord, chars)) + 1
        self.table = np.zeros(self.size + 1, dtype=bool)
        self.table[[ord(c) for c in chars]] = True

    def __call__(self, cp: np.ndarray) -> np.ndarray:
        return self.table[np.minimum(cp, self.size)]


_is_closer = _CharSet(_CLOSERS)
_is_opener = _CharSet("\"'“‘([«")
_is_sent_end = _CharSet(".!?:;")
_is_bullet = _CharSet("-*•+–")
_is_chapter0 = _CharSet("CAP")
_is_chapter1 = _CharSet("hHpPaA")
_is_underline = _CharSet("=-~^\"'*+#`:.")
# ASCII and Latin letters (up to U+024F): enough for sentence starts and abbreviation checks.
_UPPER_TABLE = np.array([chr(i).isupper() for i in range(0x250)], dtype=bool)
_ALPHA_TABLE = np.array([chr(i).isalpha() for i in range(0x250)], dtype=bool)


def _is_upper(cp: np.ndarray) -> np.ndarray:
    return _UPPER_TABLE[np.minimum(cp, 0x24F)] & (cp < 0x250)


def _is_alpha(cp: np.ndarray) -> np.ndarray:
    return _ALPHA_TABLE[np.minimum(cp, 0x24F)] & (cp < 0x250)


def _is_blank(cp: np.ndarray) -> np.ndarray:
    return (cp == 32) | (cp == 9)


def _skip(pad: np.ndarray, pos: np.ndarray, pred: Any) -> np.ndarray:
    """Advance each position while ``pred(pad[pos])``; the NUL padding stops every walk.

    Short runs (indentation) are walked a step at a time on the positions still moving; after
    8 steps the few left (page breaks padded with long blank runs) look ahead 64 characters at a
    time, so a long run costs a few small passes, never one over the whole text.
    """
    pos = pos.copy()
    active = np.flatnonzero(pred(pad[pos]))
    steps = 0
    last = len(pad) - 1  # padding: pred is false there
    while active.size:
        if steps >= 8:
            window = pred(pad[np.minimum(pos[active, None] + _LOOKAHEAD, last)])
            stopped = ~window.all(axis=1)
            pos[active] += np.where(stopped, (~window).argmax(axis=1), len(_LOOKAHEAD))
            active = active[~stopped]
            continue
        pos[active] += 1
        active = active[pred(pad[pos[active]])]
        steps += 1
    return pos


_LOOKAHEAD = np.arange(64)


_NUMBER_PREFIX = re.compile(r"((?:\d+\.)*\d+)\.?\s")
_WS_NONL_CHARS = frozenset("\t\x0b\x0c \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {
    chr(c) for c in range(0x2000, 0x200B)
}
_WS_CHARS = _WS_NONL_CHARS | {"\n", "\r"}


#: Texts at least this long are encoded in helper threads while boundaries are found.
PARALLEL_ENCODE_MIN_CHARS = 20_000
#: ...in pieces of about this many characters (at most one per core).
PARALLEL_PIECE_CHARS = 100_000


@functools.lru_cache(maxsize=1)
def _cpus() -> int:
    return os.cpu_count() or 1


def _line_start_cuts(text: str, pieces: int) -> list[int]:
    """Up to ``pieces - 1`` increasing cut positions right after a newline and before text.

    Cutting there splits tiktoken's pre-tokenisation exactly (a newline-ending piece on the
    left, a fresh piece on the right), so encoding the parts gives the whole text's ids.
    """
    cuts: list[int] = []
    n = len(text)
    for i in range(1, pieces):
        p = text.find("\n", max(i * n // pieces, cuts[-1] if cuts else 0))
        while p != -1 and (p + 1 >= n or text[p + 1].isspace()):
            p = text.find("\n", p + 1)
        if p == -1:
            break
        if not cuts or p + 1 > cuts[-1]:
            cuts.append(p + 1)
    return cuts


@functools.lru_cache(maxsize=1)
def _encode_pool() -> ThreadPoolExecutor:
    # Tasks in this pool never wait on other tasks, so sharing it between chunk_texts workers
    # cannot deadlock.
    return ThreadPoolExecutor(max_workers=min(8, _cpus()), thread_name_prefix="rb-enc")


# A forked child inherits the cached pool object but not its threads: forget it there.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_encode_pool.cache_clear)


#: :func:`chunk_texts` uses worker processes only for batches of at least this many characters:
#: below it, starting them costs more than they save.
PROCESS_MIN_CHARS = 1_000_000


def _chunk_in_processes(
    texts: list[str], encoding: str, sizes: tuple[int, int, int], workers: int
) -> list[list[Chunk]]:
    """Chunk ``texts`` in ``workers`` processes; results come back in input order."""
    import multiprocessing as mp
    import threading
    from concurrent.futures import ProcessPoolExecutor

    # Batches of whole texts (their positions), a few per worker so a long document does not
    # leave the others idle at the end.
    total = sum(map(len, texts))
    target = max(64_000, total // (workers * 8))
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # longest first
    batches: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in order:
        current.append(i)
        size += len(texts[i])
        if size >= target:
            batches.append(current)
            current, size = [], 0
    if current:
        batches.append(current)
    # fork shares the loaded encoding and the texts with the workers for free (a fresh
    # interpreter needs about a second to import and load the encoding), but forking a process
    # that runs other threads can deadlock the child on a lock held at that moment, so it is
    # used only while no other thread runs (this module's idle encode helpers hold no lock while
    # they wait for work).
    methods = mp.get_all_start_methods()
    others = [
        t for t in threading.enumerate() if t is not threading.current_thread() and not t.name.startswith("rb-enc")
    ]
    forked = "fork" in methods and not others
    ctx = mp.get_context("fork" if forked else "forkserver" if "forkserver" in methods else "spawn")
    # Workers get positions (and, unless forked, the texts) and send back offsets, counts and
    # headings only: the parent slices the chunk texts itself.
    jobs = [[(i, None if forked else texts[i]) for i in batch] for batch in batches]
    out: list[list[Chunk]] = [[] for _ in texts]
    _FORK_TEXTS[:] = [texts] if forked else []
    if forked:
        # A forked child shares the parent's heap copy-on-write; its garbage collector would
        # walk (and so copy) every object of a large parent. Frozen objects are not walked.
        gc.freeze()
    try:
        with ProcessPoolExecutor(
            max_workers=min(workers, len(batches)),
            mp_context=ctx,
            initializer=_process_init,
            initargs=(encoding,),
        ) as pool:
            for part in pool.map(_chunk_batch, jobs, [sizes] * len(jobs)):
                for i, spans in part:
                    t = texts[i]
                    out[i] = [Chunk(t[s:e], s, e, n, h) for s, e, n, h in spans]
    finally:
        _FORK_TEXTS.clear()
        if forked:
            gc.unfreeze()
    return out


_WORKER_TOKENIZER: list[Tokenizer] = []
_FORK_TEXTS: list[list[str]] = []  # the batch's texts, seen by forked workers


def _process_init(encoding: str) -> None:
    # Each worker is one of ``workers`` processes already: no helper encode threads inside it.
    global PARALLEL_ENCODE_MIN_CHARS
    PARALLEL_ENCODE_MIN_CHARS = 1 << 62
    _WORKER_TOKENIZER[:] = [get_tokenizer(encoding)]


def _chunk_batch(
    batch: list[tuple[int, str | None]], sizes: tuple[int, int, int]
) -> list[tuple[int, list[tuple[int, int, int, tuple[str, ...]]]]]:
    tok = _WORKER_TOKENIZER[0]
    lo, hi, overlap = sizes
    out = []
    for i, text in batch:
        t = _FORK_TEXTS[0][i] if text is None else text
        chunks = _Chunker(t, tok, lo, hi, overlap).run()
        out.append((i, [(c.start, c.end, c.n_tokens, c.headings) for c in chunks]))
    return out


def _heading_paths(headings: Iterable[_Heading]) -> list[tuple[str, ...]]:
    """The heading path in effect at each heading (that heading included)."""
    stack: list[_Heading] = []
    out = []
    for h in headings:
        while stack and stack[-1].depth >= h.depth:
            stack.pop()
        stack.append(h)
        out.append(tuple(x.title for x in stack))
    return out
