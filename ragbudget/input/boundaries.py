"""Where a text may be cut: its headings (Markdown ``#``, reStructuredText underlines, numbered
``1.2 Title`` between blank lines or continuing the numbering of the titles before it,
``Chapter 3``, ALL-CAPS lines; never a table-of-contents entry, nor a comment or a directive in
code) and every structural cut point with its level — a heading, a blank-line paragraph break, a
line break after a sentence or before a list item, a sentence end inside a line, any other line
break.

What the chunker (:mod:`ragbudget.input.chunking`) plans its cuts on, apart from the token
arithmetic that makes the cuts exact. Found without a Python loop per line or per sentence: the
text's code points in a numpy array, a few vectorised tests on the characters around each
newline and each full stop, and regular expressions only at the few places those leave (a line
that may be a heading, a short word that may be an abbreviation).

>>> text = "Intro. Read on.\\n\\n## Usage\\nCall it:\\n- one"
>>> b = find_boundaries(text)
>>> [(h.depth, h.title) for h in b.headings]
[(2, 'Usage')]
>>> [(text[: int(e)][-6:], LEVELS[int(lv)]) for e, lv in zip(b.ends, b.levels)]
[('Intro.', 'sentence'), ('ad on.', 'heading'), ('d on.\\n', 'line'), (' Usage', 'line'),
 ('ll it:', 'line_sentence')]
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "HEADING",
    "LEVELS",
    "LINE",
    "LINE_SENTENCE",
    "PARAGRAPH",
    "SENTENCE",
    "Boundaries",
    "Heading",
    "find_boundaries",
    "heading_paths",
]

IntArray = npt.NDArray[np.int64]
CodePoints = npt.NDArray[np.uint32]
Mask = npt.NDArray[np.bool_]

#: Cut levels, lower is preferred. Within the allowed window the chunker cuts at the best level
#: present, and among equals at the last one (larger chunks, fewer of them), except for headings
#: (the first one). Below these it falls back to a word boundary, then a token boundary.
HEADING, PARAGRAPH, LINE_SENTENCE, SENTENCE, LINE = range(5)
#: The levels' names, by level.
LEVELS = ("heading", "paragraph", "line_sentence", "sentence", "line")


def find_boundaries(text: str) -> Boundaries:
    """The headings of ``text`` and every structural cut point in it (:class:`Boundaries`)."""
    lines = _lines(text)
    headings = _headings(text, lines)
    ends, nexts, levels = _cut_points(text, lines, headings)
    return Boundaries(tuple(headings), ends, nexts, levels)


# Separators. Every pattern starts with a literal or a small class so that ``re`` can skip
# ahead quickly (a leading lookbehind or ``[ \t]*`` made one of these 20x slower than encoding).
# A candidate is (left end, next start, level); the left end may still have trailing spaces,
# which the planner strips.
_CLOSERS = "\"'”’)\\]»"
# A sentence end inside a line is terminal punctuation (+ closing quotes), spaces, then a
# capital, digit or opening quote (found with numpy in _cut_points). Short words before the
# period are checked against common abbreviations here.
_ABBREV = re.compile(r"(?:^|[\s(])(?:[A-Z]|Mr|Mrs|Ms|Dr|St|vs|e\.g|i\.e|cf|No|Fig|\d{1,3})$")
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
# What a "#" line's title or a neighbouring line looks like when it is code, not prose (see
# _markdown_headings). Each alternative is a shape seen in the manuals' listings: C
# preprocessor directives; statement, block and continuation ends; R, S and Python prompts
# ("> f(x)", "S> n <- 3", ">>> "), shell prompts and variables; assignments ("CFLAGS += -O2",
# "version=3", "x <- 1", "export A='b'"); a call alone on its line ("library(MASS) # attach");
# shell and Make control lines; a "#" glued to its word ("#include", "#!/bin/sh", "#su -c").
# Prose lines match none of these at their start, and a heading's title does not end in ; { \ ( [ ,.
_CODE_TITLE = re.compile(
    r"(?:include[ \t]*[<\"]|define[ \t]+[A-Za-z_]|(?:ifn?def|undef)[ \t]+\w+$|endif\b|pragma[ \t]|elif[ \t])"
    r"|.*(?:[;{\\(\[,]$|==|!=|<-|&&|\|\|)"
)
_CODE_LINE = re.compile(
    r"#[^\s#]"
    r"|.*(?:[;{\\(\[]|(?<![%}])\})$"
    r"|[A-Za-z]{0,8}>[ \t]*[\w.$]+(?:\(|[ \t]*<-|[ \t]*=(?!=))"
    r"|>>>[ \t]|\$[ \t]+[a-z./]|\$[A-Za-z_{(]"
    r"|(?:export|local|my|our|const|let|var|declare|set)[ \t]+[\w$@%-]+[ \t]*="
    r"|[A-Za-z_][\w.]*(?:\[[^\]\n]*\])?[ \t]*(?:[-+*/.:?|&]?=(?!=)|<-)"
    r"|[\w.$:]+\(.*[)};][ \t]*(?:(?:#|//).*)?$"
    r"|(?:if|for|while|until|case|elif)\b.*;[ \t]*(?:then|do)$"
    r"|(?:fi|done|esac|then|do|else|endif|endef)$"
    r"|(?:ifeq|ifneq|ifdef|ifndef)[ \t]*\("
    r"|(?:echo|sudo|apt-get|pip|git|mkdir|chmod|cd)[ \t]+\S"
)
# A numbered title as a text layer gives it: at the margin, "4.9.2 debian/rules and Rules-Requires-Root",
# "2 Simple manipulations; numbers and vectors", "B.1 Invoking R from the command line", alone on
# its line (see _numbered_sequence).
_SEQ_HEAD = re.compile(r"[ \t]{0,2}((?:\d{1,3}|[A-Z](?=\.\d))(?:\.\d{1,3})*)(\.?)[ \t]+([^\W\d_][^\n]{0,89})(?=\n|\Z)")
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
class Heading:
    """A heading line: where it starts (its first character, indentation included), its depth
    (1 for a chapter or ``#``) and its title."""

    start: int
    depth: int
    title: str


@dataclass(frozen=True)
class Boundaries:
    """Where a text may be cut, and its headings (in text order).

    ``ends[i]``/``nexts[i]``/``levels[i]``: a cut point's left end (the text before it may still
    end in spaces), where the next chunk would start, and its level (:data:`HEADING` ... :data:`LINE`,
    lower is better), sorted by ``ends``, one per left end.
    """

    headings: tuple[Heading, ...]
    ends: IntArray
    nexts: IntArray
    levels: IntArray


@dataclass(frozen=True)
class _Lines:
    """A text's code points and lines, as the numpy passes below read them.

    ``pad``: the code points, then NUL padding (reads past the end of the text see it, which no
    test below accepts); ``n`` the text's length; ``nl`` the newline offsets; line ``i`` starts at
    ``starts[i]`` (0, then one past each newline) and has its first non-blank at ``first[i]``.
    """

    pad: CodePoints
    n: int
    nl: IntArray
    starts: IntArray
    first: IntArray


def _lines(text: str) -> _Lines:
    raw = text.encode("utf-32-le", errors="surrogatepass")
    cp = np.frombuffer(raw, dtype=np.uint32)
    n = len(cp)
    pad = np.zeros(n + 4, dtype=np.uint32)
    pad[:n] = cp
    nl = np.flatnonzero(cp == 10).astype(np.int64, copy=False)
    starts = np.empty(len(nl) + 1, dtype=np.int64)
    starts[0] = 0
    starts[1:] = nl + 1
    return _Lines(pad, n, nl, starts, _skip(pad, starts, _is_blank))


def _headings(text: str, lines: _Lines) -> list[Heading]:
    pad, starts, first = lines.pad, lines.starts, lines.first
    indent = first - starts
    c0, c1 = pad[first], pad[first + 1]
    upper0 = (c0 >= 65) & (c0 <= 90)
    digit0 = (c0 >= 48) & (c0 <= 57)
    s0 = pad[starts]
    found: dict[int, Heading] = {}
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
        found[prev_start] = Heading(prev_start, depth, title)
    for start, depth, title in _markdown_headings(text, lines, np.flatnonzero((c0 == 35) & (indent <= 3))):
        found[start] = Heading(start, depth, title)
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
        found[start] = Heading(start, depth, f"{m.group(1)} {title}".strip())
    lead = digit0 | (upper0 & (c1 == 46))  # "2.1 Title", "B.1 Title"
    for start, depth, title in _numbered_sequence(text, lines, np.flatnonzero((indent <= 2) & lead)):
        found.setdefault(start, Heading(start, depth, title))
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
                    found[start] = Heading(start, 1, m.group(1).strip())
    return [found[k] for k in sorted(found) if not _NOT_A_HEADING.search(found[k].title)]


def _line(text: str, lines: _Lines, i: int) -> str:
    """Line ``i`` of ``text`` (without its newline); ``""`` past either end."""
    if i < 0 or i >= len(lines.starts):
        return ""
    end = int(lines.nl[i]) if i < len(lines.nl) else lines.n
    return text[int(lines.starts[i]) : end]


def _markdown_headings(text: str, lines: _Lines, rows: IntArray) -> list[tuple[int, int, str]]:
    """``(start, depth, title)`` of the ``#`` lines among ``rows`` that are Markdown headings.

    A ``#`` line is also a comment in shell, R, Python, Perl and Make, and a C preprocessor line
    (``# include <x.h>``, ``# define``). PDF text layers and plain-text exports drop a listing's
    fence and indentation, so those lines reach the left margin inside the code they annotate;
    taken for headings they named every chunk after them, for dozens of pages (one R comment in
    "Writing R Extensions" headed 56 chunks). So a ``#`` line is a heading only when its title
    reads like one (words, not a directive or a statement), it is outside any fenced block, and
    the lines touching it (no blank line between) do not look like code. A run of ``#`` lines
    stands or falls together: one comment among code condemns the comment block it belongs to.
    """
    if not rows.size:
        return []
    fences = _fenced_spans(text)
    verdict: dict[int, tuple[int, int, str] | None] = {}
    for i in rows.tolist():
        m = _MD_HEAD.match(text, int(lines.starts[i]))
        if m is None:
            continue
        title = m.group(2).strip()
        ok = (
            any(ch.isalnum() for ch in title)
            and not _CODE_TITLE.match(title)
            and not any(a <= m.start() < b for a, b in fences)
            and not _looks_like_code(_line(text, lines, i - 1))
            and not _looks_like_code(_line(text, lines, i + 1))
        )
        verdict[i] = (m.start(), len(m.group(1)), title) if ok else None
    # A "#" line between two code lines was condemned above; the comment lines above or below
    # it (touching it, no blank line between) go with it.
    out = []
    for i, heading in verdict.items():
        if heading is None:
            continue
        run = [i]
        for step in (-1, 1):
            j = i + step
            while j in verdict or _line(text, lines, j).lstrip().startswith("#"):
                run.append(j)
                j += step
        if all(verdict.get(j, True) is not None for j in run):
            out.append(heading)
    return out


def _numbered_sequence(text: str, lines: _Lines, rows: IntArray) -> list[tuple[int, int, str]]:
    """``(start, depth, title)`` of the numbered section titles that follow one another.

    A PDF's text layer has no blank line around a heading ("1.5 Using R interactively" sits
    between two lines of prose), so the blank-line test of the numbered pattern above misses
    every section of a typeset manual. What marks them instead is their numbering: each one
    continues the last (a next sibling, a first child, the next section of an ancestor). Among
    the lines shaped like a numbered title, the longest chain that continues itself is taken,
    if it has three or more and some of them are subsections ("2.1"): a page number, a footnote
    or a table row that happens to start with a number breaks the chain, or sits outside it.
    A number may skip one (a heading the text layer wrapped or lost), never more, except that a
    chapter's first section may follow a few chapters without numbered sections. Appendix
    sections ("B.1 Invoking R from the command line") make a chain of their own.
    """
    arabic: list[tuple[int, tuple[int, ...], str]] = []
    lettered: list[tuple[int, tuple[int, ...], str]] = []
    for i in rows.tolist():
        m = _SEQ_HEAD.match(text, int(lines.starts[i]))
        if m is None:
            continue
        number, dot, title = m.group(1), m.group(2), m.group(3).rstrip()
        # "3. Mix the flour": a one-level number with a full stop is a list item's.
        if (dot and "." not in number) or title[-1] in ",;:" or len(title.split()) > 14:
            continue
        if _NOT_A_HEADING.search(title):
            continue
        parts = number.split(".")
        if parts[0].isdigit():
            arabic.append((m.start(), tuple(int(x) for x in parts), f"{number}{dot} {title}"))
        else:  # "B.1": appendix B's first section
            lettered.append((m.start(), (ord(parts[0]) - 64, *(int(x) for x in parts[1:])), f"{number}{dot} {title}"))
    return sorted(_longest_chain(arabic) + _longest_chain(lettered))


def _longest_chain(cands: list[tuple[int, tuple[int, ...], str]]) -> list[tuple[int, int, str]]:
    """The longest run of ``cands`` (start, number, title) whose numbers continue one another,
    as ``(start, depth, title)``; empty when it is shorter than 3 or has no subsection."""
    if len(cands) < 3:
        return []
    # Longest chain by dynamic programming, O(depth^2) per candidate: the best chain ending at
    # a line with a given number (a first child's parent), and at one with a given prefix (a
    # later sibling of that prefix's last level, whatever depth the line before it had). Among
    # chains of one length the one with fewer skipped numbers wins: "4.1 control" then
    # "4.2 copyright", not the listing line "4 Maintainer: ..." between them.
    score = [(1, 0)] * len(cands)  # (length, -numbers skipped)
    back = [-1] * len(cands)
    exact: dict[tuple[int, ...], int] = {}
    prefix: dict[tuple[int, ...], int] = {}
    for i, (_, q, _) in enumerate(cands):
        preds: list[tuple[int, int]] = []  # (candidate, numbers skipped to reach q from it)
        for lv in range(len(q)):
            if not all(x == 1 for x in q[lv + 1 :]):
                continue
            if lv > 0 and 1 <= q[lv] <= 2:  # q is a first child of q[:lv] (or its second)
                preds.append((exact.get(q[:lv], -1), q[lv] - 1))
            # q is a later sibling at level lv. A chapter may have no numbered section at all
            # (policy.pdf's chapters 18 and 19), so "20.1" may follow "17.2": a first section
            # may skip up to 9 chapters, anything else one number.
            for skip in range(1, 10 if lv == 0 and len(q) > 1 else 3):
                preds.append((prefix.get((*q[:lv], q[lv] - skip), -1), skip - 1))
        for j, skipped in preds:
            if j >= 0:
                key = (score[j][0] + 1, score[j][1] - skipped)
                if (key, j) > (score[i], back[i]):
                    score[i], back[i] = key, j
        exact[q] = i
        for k in range(1, len(q) + 1):
            best = prefix.get(q[:k], -1)
            if best < 0 or score[i] >= score[best]:
                prefix[q[:k]] = i
    # The longest chain; among equals the last (a contents list without page numbers comes first).
    end = max(range(len(cands)), key=lambda i: (score[i], i))
    chain = []
    while end >= 0:
        chain.append(cands[end])
        end = back[end]
    if len(chain) < 3 or all(len(q) == 1 for _, q, _ in chain):
        return []
    return [(start, len(q), title) for start, q, title in reversed(chain)]


def _fenced_spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of each ```` ``` ```` / ``~~~`` fenced block (an unclosed one runs to the end)."""
    # The runs of backticks or tildes are found with str.find, then checked for opening their
    # line: a regular expression (a multiline "^", or an alternation) scans character by
    # character and cost as much as the rest of this module.
    runs = []
    for mark in ("```", "~~~"):
        at = text.find(mark)
        while at >= 0:
            end = at + 3
            while end < len(text) and text[end] == mark[0]:
                end += 1
            line_start = text.rfind("\n", 0, at) + 1
            if at - line_start <= 3 and not text[line_start:at].strip(" "):
                runs.append((line_start, end, text[at:end]))
            at = text.find(mark, end)
    spans = []
    open_at, fence = -1, ""
    for line_start, end, run in sorted(runs):
        if open_at < 0:
            open_at, fence = line_start, run
        elif run[0] == fence[0] and len(run) >= len(fence):
            spans.append((open_at, end))
            open_at = -1
    if open_at >= 0:
        spans.append((open_at, len(text)))
    return spans


def _looks_like_code(line: str) -> bool:
    line = line.strip()
    return bool(line) and _CODE_LINE.match(line) is not None


def _cut_points(text: str, lines: _Lines, headings: Sequence[Heading]) -> tuple[IntArray, IntArray, IntArray]:
    """All structural cut points: (left end, next start, level), sorted by left end."""
    ends: list[int] = []
    nexts: list[int] = []
    levels: list[int] = []
    for cuts in (_line_cuts(lines), _sentence_cuts(text, lines.pad), _heading_cuts(text, headings)):
        ends += cuts[0]
        nexts += cuts[1]
        levels += cuts[2]
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


_Cuts = tuple[list[int], list[int], list[int]]


def _line_cuts(lines: _Lines) -> _Cuts:
    """Cut points at line breaks (a sentence or list item ending a line ranks higher) and at
    blank lines."""
    ends: list[int] = []
    nexts: list[int] = []
    levels: list[int] = []
    # Line and paragraph breaks, vectorised over the code points (a Python loop per line
    # cost as much as the whole tokenizer pass).
    pad, n, nl, first = lines.pad, lines.n, lines.nl, lines.first
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
    levels.extend(np.where((good | listy)[line], LINE_SENTENCE, LINE).tolist())
    # Blank lines: one candidate per blank run (its first newline), the next chunk starts
    # at the next text.
    para = np.flatnonzero((cq == 10) & (prev != 10))
    nxt = _skip(pad, q[para], _is_space)
    para_ok = nxt < n
    ends.extend(nl[para[para_ok]].tolist())
    nexts.extend(nxt[para_ok].tolist())
    levels.extend([PARAGRAPH] * int(para_ok.sum()))
    return ends, nexts, levels


def _sentence_cuts(text: str, pad: CodePoints) -> _Cuts:
    """Cut points at sentence ends inside lines."""
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
    return after[ok].tolist(), nxt[ok].tolist(), [SENTENCE] * int(ok.sum())


def _heading_cuts(text: str, headings: Sequence[Heading]) -> _Cuts:
    """Cut points before each heading line."""
    n_text = len(text)
    ends: list[int] = []
    nexts: list[int] = []
    levels: list[int] = []
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
            levels.append(HEADING)
    return ends, nexts, levels


# str.isspace for every code point up to U+3000 (nothing above it is a space).
_SPACE_TABLE = np.array([chr(i).isspace() for i in range(0x3001)], dtype=bool)


def _is_space(cp: CodePoints) -> Mask:
    return _SPACE_TABLE[np.minimum(cp, 0x3000)] & (cp <= 0x3000)


def _is_alnum_ascii(c: CodePoints) -> Mask:
    return ((c >= 48) & (c <= 57)) | ((c >= 65) & (c <= 90)) | ((c >= 97) & (c <= 122))


class _CharSet:
    """Membership test of code-point arrays in a small character set (a lookup table)."""

    def __init__(self, chars: str) -> None:
        self.size = max(map(ord, chars)) + 1
        self.table = np.zeros(self.size + 1, dtype=bool)
        self.table[[ord(c) for c in chars]] = True

    def __call__(self, cp: CodePoints) -> Mask:
        out: Mask = self.table[np.minimum(cp, self.size)]
        return out


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


def _is_upper(cp: CodePoints) -> Mask:
    return _UPPER_TABLE[np.minimum(cp, 0x24F)] & (cp < 0x250)


def _is_alpha(cp: CodePoints) -> Mask:
    return _ALPHA_TABLE[np.minimum(cp, 0x24F)] & (cp < 0x250)


def _is_blank(cp: CodePoints) -> Mask:
    out: Mask = (cp == 32) | (cp == 9)
    return out


def _skip(pad: CodePoints, pos: IntArray, pred: Callable[[CodePoints], Mask]) -> IntArray:
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


# "1.3.1. Early history": a heading's number, which says its depth.
_NUMBER_PREFIX = re.compile(r"((?:\d+\.)*\d+)\.?\s")


def heading_paths(headings: Iterable[Heading]) -> list[tuple[str, ...]]:
    """The heading path in effect at each heading (that heading included)."""
    stack: list[Heading] = []
    out = []
    for h in headings:
        while stack and stack[-1].depth >= h.depth:
            stack.pop()
        stack.append(h)
        out.append(tuple(x.title for x in stack))
    return out
