"""Running header / footer ("page furniture") removal, and contents pages.

:func:`find_contents` finds the other navigation a book carries: its table of contents, lists of
figures, indexes (entries ending in a dot leader and a page number); the loader removes both.

:func:`strip_headers_footers` looks at the first and last few non-empty lines of every page (the
*edge zones*), masks what changes from page to page (digits, roman numerals, runs of whitespace),
and removes the lines that repeat across pages. It does better than exact-match n-gram heuristics
(Haystack's ``DocumentCleaner``) on real typeset documents:

* ``"Page 3 of 40"`` and ``"Page 4 of 40"`` share the key ``"page # of #"``;
* recto/verso layouts (a footer only on odd pages) are counted per page parity;
* running heads that change per chapter (``"Chapter 5: Arrays and matrices   25"``) repeat within a
  run of nearby pages;
* lines carrying the printed page number are recognised by the page-number *sequence*: the number
  minus the page index is the same on many pages (roman front matter gets its own sequence);
* section running heads that carry the current title and the page number (``"2.3. Copyright
  considerations  9"``, ``"2  CONTENTS"``, a one-page chapter's ``"Chapter 13: Packages  84"``)
  go even when their text occurs once: the page-number sequence vouches for the outermost line
  of the edge where the document prints its numbers. Lengths are measured with whitespace
  collapsed, so ``pdftotext -layout`` heads padded to the page width count as short.

Safety rules, each one a tested invariant:

* a line is removed only if its masked key is found in the edge zone of at least two pages of the
  document (or is a corpus-wide pattern passed in ``known``), or it is the outermost line of its
  page, on the document's page-number edge, and ends or starts with the number of a page-number
  sequence seen on at least three pages; nothing is removed from a 1-2 page document on its own;
* a line of numbers only ("12", "x", "2 11345") is removed only as a page number, never for
  merely repeating;
* lines are peeled from the page edges inwards and the first non-furniture line stops the peel, so
  at most :data:`ZONE` lines per edge go and body text in the middle of a page is never touched;
* deterministic, and the output is never longer than the input (lines are only deleted).

>>> body = ["Alpha beta.", "Gamma delta.", "Epsilon.", "Zeta eta.", "Theta iota."]
>>> pages = [f"ACME Manual\\n{b}\\n{b.upper()}\\nPage {i} of 5" for i, b in enumerate(body, 1)]
>>> strip_headers_footers(pages)[:2]
['Alpha beta.\\nALPHA BETA.', 'Gamma delta.\\nGAMMA DELTA.']
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, overload

__all__ = [
    "ZONE",
    "StripReport",
    "apply_report",
    "edge_keys",
    "find_contents",
    "find_known",
    "fold_line",
    "find_furniture",
    "mask_line",
    "strip_headers_footers",
    "trim_page",
]

#: Non-empty lines examined at the top and at the bottom of each page. Three covers a header plus
#: a rule/sub-header, and a footnote-free footer block; it is also the most a page can lose per edge.
ZONE = 3

# Share of all pages a key must reach to count as document-wide furniture. 30% keeps a header
# that is missing on chapter-opening pages, while ordinary lines never repeat that often at edges.
_GLOBAL_SHARE = 0.3
# Share of pages of one parity (recto or verso) for a one-sided header/footer.
_PARITY_SHARE = 0.5
# Running heads repeat on nearby pages; gap 2 lets a verso-only head skip the recto in between.
_RUN_GAP = 2
_RUN_MIN = 3
# A page-number sequence needs this many pages, covering at least half of its span.
_PAGENO_MIN = 3
_PAGENO_DENSITY = 0.5
# Share of the pages with text that stripping may empty before the result is distrusted.
_MAX_EMPTIED = 0.5
# Running heads are short; a long line carrying a matching number is more likely prose.
_PAGENO_MAX_LEN = 120

_DIGITS = re.compile(r"\d+")
_HAS_WORD = re.compile(r"[^\W_]|#")
_ROMAN = re.compile(r"^(?=[mdclxvi])m{0,3}(cm|cd|d?c{0,3})(xc|xl|l?x{0,3})(ix|iv|v?i{0,3})$", re.IGNORECASE)
_ROMAN_VALUES = {"i": 1, "v": 5, "x": 10, "l": 50, "c": 100, "d": 500, "m": 1000}


def mask_line(line: str) -> str:
    """The comparison key of a line: whitespace folded, case folded, numbers masked as ``#``.

    Digit runs and whole-word roman numerals become ``#`` so page numbers, dates and chapter
    numbers do not make two occurrences of the same header differ.

    >>> mask_line("52   Chapter 6. Package maintainer scripts")
    '# chapter #. package maintainer scripts'
    >>> mask_line("Debian New Maintainers' Guide  iv") == mask_line("Debian New Maintainers' Guide 3 / 57")
    False
    >>> mask_line("Page iv") == mask_line("Page 12")
    True
    """
    words = []
    for word in line.split():
        if _ROMAN.match(word) and (len(word) > 1 or word in "ivxIVX"):
            words.append("#")
        else:
            words.append(_DIGITS.sub("#", word.casefold()))
    return " ".join(words)


@dataclass(frozen=True)
class StripReport:
    """What :func:`strip_headers_footers` removed.

    ``removed`` is the number of lines deleted, ``patterns`` the distinct masked keys of those lines
    (sorted), ``per_page`` the count per page, and ``lines`` the ``(page_index, line_index)`` pairs
    (0-based; ``line_index`` into ``page.split("\\n")``) in order.
    """

    removed: int
    patterns: tuple[str, ...]
    per_page: tuple[int, ...]
    lines: tuple[tuple[int, int], ...]


def _roman_value(token: str) -> int | None:
    # Lower-case only: upper-case "I", "C", "MD" are words or initials far more often than numbers.
    if not token or not token.islower() or not _ROMAN.match(token):
        return None
    if len(token) == 1 and token not in "ivx":  # a lone "c", "d", "l", "m" is a letter
        return None
    total = 0
    for a, b in zip(token, token[1:] + " ", strict=True):
        va, vb = _ROMAN_VALUES[a], _ROMAN_VALUES.get(b, 0)
        total += -va if va < vb else va
    return total


def _number_tokens(line: str) -> list[tuple[str, int]]:
    """``(kind, value)`` for the number words where page numbers sit.

    Only the first and last word, and ``N`` in ``N / M`` or ``N of M``: a number inside a table row
    ("KERN_ERR  3  Error conditions") matches the page index by chance far too often.
    """
    words = line.split()
    picked = {0, len(words) - 1}
    for j in range(len(words) - 2):
        if words[j + 1].casefold() in ("/", "of") and words[j + 2].isdigit():
            picked.add(j)
    out = []
    for j in sorted(picked):
        w = words[j]
        if w.isascii() and w.isdigit() and len(w) <= 5:
            out.append(("arabic", int(w)))
        else:
            v = _roman_value(w)
            if v is not None and v <= 100:
                out.append(("roman", v))
    return out


def _zones(pages: Sequence[list[str]]) -> list[list[int]]:
    """Per page, the indices of the first and last :data:`ZONE` non-empty lines (top first)."""
    out = []
    for lines in pages:
        nonempty = [i for i, line in enumerate(lines) if line.strip()]
        top = nonempty[:ZONE]
        bottom = [i for i in nonempty[-ZONE:] if i not in top]
        out.append(top + bottom)
    return out


def _page_number_hits(pages: Sequence[list[str]], zones: Sequence[list[int]]) -> dict[tuple[int, int], str | None]:
    """Zone lines that carry the printed page number, found as dense (kind, offset) sequences.

    Maps each ``(page, line)`` to its edge, ``"top"`` or ``"bottom"``, when it is the outermost
    non-empty line there, else to None.
    """
    candidates: dict[tuple[str, int], set[int]] = defaultdict(set)
    per_line: dict[tuple[int, int], set[tuple[str, int]]] = {}
    for p, (lines, zone) in enumerate(zip(pages, zones, strict=True)):
        for i in zone:
            # Collapsed: pdftotext -layout pads a running head to the page width with spaces.
            if len(" ".join(lines[i].split())) > _PAGENO_MAX_LEN:
                continue
            keys = {(kind, value - p) for kind, value in _number_tokens(lines[i])}
            if keys:
                per_line[(p, i)] = keys
                for key in keys:
                    candidates[key].add(p)
    # One sequence per kind (arabic body, roman front matter): the offset seen on the most pages
    # (ties: the smaller offset), kept only if it is long and dense enough. Chapter numbers in
    # headings can line up with a second, sparse offset by chance; they never beat the real one.
    accepted = set()
    for kind in ("arabic", "roman"):
        options = [(len(pset), -abs(off), off) for (k, off), pset in candidates.items() if k == kind]
        if not options:
            continue
        _, _, off = max(options)
        pset = candidates[(kind, off)]
        span = max(pset) - min(pset) + 1
        if len(pset) >= _PAGENO_MIN and len(pset) >= _PAGENO_DENSITY * span:
            accepted.add((kind, off))
    # A page prints its number once: keep the matching line nearest a page edge (ties: the
    # footer), so a heading such as "Chapter 1" just under the "Guide 1 / 57" header is not taken.
    best: dict[int, tuple[int, int, int]] = {}
    for (p, i), keys in per_line.items():
        if not keys & accepted:
            continue
        nonempty = [j for j in zones[p]]
        pos = nonempty.index(i)
        from_top, from_bottom = pos, len(nonempty) - 1 - pos
        rank = (min(from_top, from_bottom), 0 if from_bottom <= from_top else 1, i)
        if p not in best or rank < best[p]:
            best[p] = rank
    out: dict[tuple[int, int], str | None] = {}
    for p, (depth, side, i) in best.items():
        out[(p, i)] = None if depth else ("bottom" if side == 0 else "top")
    return out


def _runs(pset: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for p in pset:
        if runs and p - runs[-1][-1] <= _RUN_GAP:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def find_furniture(
    pages: Sequence[str],
    *,
    known: Collection[str] = (),
    trust_page_numbers: bool = False,
) -> StripReport:
    """Find the header/footer lines of ``pages`` without changing them.

    ``known`` holds masked keys (see :func:`mask_line`) already established as boilerplate across
    a corpus (see ``ragbudget.input.loaders.BoilerplateFilter``); they count as furniture at page edges
    even in a one-page document. By default a line that carries the page number of a dense
    page-number sequence is furniture even when it occurs on one page only (a section-title
    footer, the lone ``1`` under the first page of a man page) if it is the outermost line of
    its page on the edge where the document's page numbers sit; ``trust_page_numbers=True``
    takes such a line anywhere in the edge zone.
    """
    split = [page.split("\n") for page in pages]
    zones = _zones(split)
    n = len(split)

    # key -> pages whose edge zone holds it; and every zone line with its key.
    key_pages: dict[str, set[int]] = defaultdict(set)
    keys: dict[tuple[int, int], str] = {}
    for p, (lines, zone) in enumerate(zip(split, zones, strict=True)):
        for i in zone:
            key = mask_line(lines[i])
            keys[(p, i)] = key
            key_pages[key].add(p)

    # Keys of the first and last non-empty line of each page.
    outermost = [{keys[(p, z[0])], keys[(p, z[-1])]} if z else set() for p, z in enumerate(zones)]
    pageno = _page_number_hits(split, zones) if n >= _PAGENO_MIN else {}
    pageno_keys: dict[str, set[int]] = defaultdict(set)
    for p, i in pageno:
        pageno_keys[keys[(p, i)]].add(p)
    furniture = _repeated_furniture(key_pages, n, known=known, outermost=outermost, pageno_keys=pageno_keys)
    # Section running heads ("2.3. Copyright considerations  9", "Chapter 13: Packages  84",
    # "2  CONTENTS") carry the current title, so their masked form is often on one page only.
    # The page-number sequence vouches for them when the line is the outermost one of its page,
    # on the edge where the document prints its numbers; the lone "1" under a man page's first
    # page goes the same way. A line that repeats and carries the number was taken above.
    # These go by position, not by key: a copy of the line elsewhere on the page stays.
    number_edges = _number_edges(pageno)
    pinned = {loc for loc, edge in pageno.items() if edge in number_edges}
    if trust_page_numbers:
        # Opt-in: the page-number sequence alone is enough, wherever in the edge zone the line
        # sits (under a fixed footer, on the other edge).
        pinned.update(pageno)
    removed, per_page = _peel(split, zones, lambda p, i: (keys[(p, i)], p) in furniture or (p, i) in pinned)
    patterns = tuple(sorted({keys[loc] for loc in removed}))
    return StripReport(removed=len(removed), patterns=patterns, per_page=tuple(per_page), lines=tuple(removed))


def _number_edges(pageno: Mapping[tuple[int, int], str | None]) -> set[str]:
    """The edge(s) where a document prints its page numbers: at least _PAGENO_MIN pages whose
    outermost line there carries the number."""
    edge_count: dict[str, int] = defaultdict(int)
    for edge in pageno.values():
        if edge:
            edge_count[edge] += 1
    return {edge for edge, count in edge_count.items() if count >= _PAGENO_MIN}


def _repeated_furniture(
    key_pages: Mapping[str, set[int]],
    n: int,
    *,
    known: Collection[str],
    outermost: Sequence[set[str]],
    pageno_keys: Mapping[str, set[int]],
) -> set[tuple[str, int]]:
    """The (key, page) pairs judged furniture because the key repeats: known across the corpus,
    on most pages, on most pages of one parity, in a run of outermost lines, or with the page
    number. Every rule but ``known`` needs the key on >= 2 pages of this document; the
    page-number rule in :func:`find_furniture` vouches for single outermost lines."""
    furniture: set[tuple[str, int]] = set()
    n_parity = [len(range(0, n, 2)), len(range(1, n, 2))]
    for key, pset in key_pages.items():
        if key in known:
            furniture.update((key, p) for p in pset)
            continue
        # Punctuation-only lines ("}", "---") repeat at page edges in code listings; a rule line
        # left in place costs nothing, a closing brace taken out breaks the code. A lone number
        # ("12", "x") or a row of numbers ("2 11345") goes only as a page number (below): as a
        # repeated key it also matches axis ticks, table cells, program output and listing
        # line numbers.
        if len(pset) < 2 or n < 3 or not _HAS_WORD.search(key) or set(key.split()) == {"#"}:
            continue
        # Short documents: 2 pages suffice up to 4 pages (a man page's header is on pages 2-3 of
        # 3); from 5 pages on, 2 agreeing pages are too easily a coincidence.
        if len(pset) >= (2 if n <= 4 else max(3, math.ceil(_GLOBAL_SHARE * n))):
            furniture.update((key, p) for p in pset)
            continue
        for parity in (0, 1):
            same = [p for p in pset if p % 2 == parity]
            if len(same) >= max(2, math.ceil(_PARITY_SHARE * n_parity[parity])):
                furniture.update((key, p) for p in same)
        # Runs are the riskiest rule (headings such as "CHAPTER" or "22.3 Version 4.6.1" also recur
        # on nearby pages), so a run head must be the outermost line of its page and not one word.
        if len(key.split()) >= 2:
            outer = sorted(p for p in pset if key in outermost[p])
            for run in _runs(outer):
                if len(run) >= _RUN_MIN:
                    furniture.update((key, p) for p in run)
        # Page-number evidence: the masked line repeats and its number follows the page sequence.
        if len(pageno_keys.get(key, ())) >= 2:
            furniture.update((key, p) for p in pageno_keys[key])
    return furniture


def _peel(
    split: Sequence[list[str]], zones: Sequence[Sequence[int]], is_furniture: Callable[[int, int], bool]
) -> tuple[list[tuple[int, int]], list[int]]:
    """The lines to remove, peeled inwards from each page's edges while ``is_furniture(page,
    line)`` holds, and their count per page — nothing at all when that would empty most pages."""
    removed: list[tuple[int, int]] = []
    per_page = []
    for p, lines in enumerate(split):
        nonempty = [i for i, line in enumerate(lines) if line.strip()]
        gone: list[int] = []
        # Peel inwards from each edge; the first non-furniture line ends the peel, so a repeated
        # line sitting between body lines is never taken.
        for order in (nonempty[:ZONE], list(reversed(nonempty[-ZONE:]))):
            for i in order:
                if i in gone:
                    break
                if is_furniture(p, i):
                    gone.append(i)
                else:
                    break
        gone.sort()
        per_page.append(len(gone))
        removed.extend((p, i) for i in gone)
    # Document-level brake: furniture is a few lines per page. If the rules would empty most of
    # the pages that have text, the "pages" are something else (repeated form letters, a table
    # split into tiny pages) and nothing is removed rather than gutting the document.
    with_text = [p for p, z in enumerate(zones) if z]
    n_lines = [sum(1 for line in lines if line.strip()) for lines in split]
    emptied = sum(1 for p in with_text if per_page[p] == n_lines[p])
    if with_text and emptied > _MAX_EMPTIED * len(with_text):
        return [], [0] * len(split)
    return removed, per_page


# Contents pages: a table of contents, a list of figures, an index. Their entries end in a dot
# leader and a page reference ("1.5 Registering native routines . . . . 27", "c . . . 8, 11, 27");
# three or more leader dots (or an ellipsis) so that a sentence ending in ".. 5" is not one.
_PAGE_REF = r"(?:\d{1,4}|[ivxlcdm]{1,7}|[IVXLCDM]{1,7})(?:[ \t]*[,–-][ \t]*(?:\d{1,4}|[ivxlcdm]{1,7}))*"
_LEADER_ENTRY = re.compile(rf"(?:(?:[.·][ \t]*){{3,}}|(?:…[ \t]*)+)[ \t]*{_PAGE_REF}[ \t]*$")
# An entry without a leader: a chapter line set in bold ("1 About this manual 3"), an index term
# ("signaling, 91"). Alone these are too common in prose and tables to mean anything; they go only
# inside a block of leader entries.
_LOOSE_ENTRY = re.compile(rf"\S.*?(?:[ \t]|,[ \t]*){_PAGE_REF}[ \t]*$")
_LEADER_CHARS = ("..", ". .", "…", "·")
_PAGE_REF_END = frozenset("0123456789ivxlcdmIVXLCDM")
# Contents lines are at most this share of a document's non-blank lines; past it the "contents"
# are the document (a price list, a menu) and nothing is removed.
_MAX_CONTENTS = 0.5
_CONTENTS_MIN = 3
_LABEL_WORDS = 6
_CONTINUATION_MAX = 120


def find_contents(pages: Sequence[str]) -> StripReport:
    """Find the contents, list-of-figures and index blocks of ``pages`` without changing them.

    They are navigation, not text: a chunk of contents lines names every section, so it ranked
    above the sections themselves for a query naming one, and the entries' titles read like
    headings. A block is a run of lines on one page holding at least :data:`_CONTENTS_MIN`
    entries that end in a dot leader and a page reference, where the entries (with those that
    have no leader, ``1 About this manual 3``) make at least half the lines; between them may
    stand short labels (``Table of Contents``, an index's letter ``R``), one or two lines of an
    entry wrapped over several, and blank lines. Removed: the block from its first entry to its
    last, the labels just above it (its title) when they start the page or follow a blank line,
    and the labels after it when they end the page. Any other line stops a block and is never
    removed; if the blocks would hold more than half the document's non-blank lines, nothing is
    removed (the document is a list, a menu or a price list, not a book with a contents page).

    ``StripReport.patterns`` is empty: contents lines differ from each other.

    >>> toc = "Contents\\n1 Intro . . . . 1\\n1.1 Scope . . . . 1\\n1.2 Terms . . . . 2"
    >>> body = "1 Intro\\n" + "A line of body text, long enough to be prose.\\n" * 5
    >>> report = find_contents([toc, body])
    >>> report.removed, report.per_page
    (4, (4, 0))
    """
    removed: list[tuple[int, int]] = []
    per_page = []
    nonblank = 0
    for p, page in enumerate(pages):
        lines = page.split("\n")
        nonblank += sum(1 for line in lines if line.strip())
        # Most pages have no leader line at all: plain string tests per line find the few that
        # may have one, and only those meet the regular expression (run over every line, it cost
        # as much as the header/footer pass).
        leaders = sum(
            1
            for line in lines
            if line.rstrip()[-1:] in _PAGE_REF_END
            and any(mark in line for mark in _LEADER_CHARS)
            and _LEADER_ENTRY.search(" ".join(line.split()))
        )
        gone = _contents_lines(lines) if leaders >= _CONTENTS_MIN else []
        per_page.append(len(gone))
        removed.extend((p, i) for i in gone)
    if len(removed) > _MAX_CONTENTS * nonblank:
        removed, per_page = [], [0] * len(pages)
    return StripReport(removed=len(removed), patterns=(), per_page=tuple(per_page), lines=tuple(removed))


def _contents_lines(lines: list[str]) -> list[int]:
    """Indices of the contents lines of one page (see :func:`find_contents`)."""
    kinds = []
    for line in lines:
        # Collapsed: pdftotext -layout pads an entry's title from its page number with spaces.
        text = " ".join(line.split())
        if not text:
            kinds.append("blank")
        elif _LEADER_ENTRY.search(text):
            kinds.append("entry")
        elif text[-1] in _PAGE_REF_END and len(text) <= _PAGENO_MAX_LEN and _LOOSE_ENTRY.match(text):
            kinds.append("loose")
        elif (
            len(text.split()) <= _LABEL_WORDS
            and len(text) <= 60
            and (
                text[-1] not in ".!?;:," or not any(ch.isalpha() for ch in text)  # an index's "!" group
            )
        ):
            kinds.append("label")
        else:
            kinds.append("other")
    # One or two lines between two entries are part of the block: an entry wrapped over lines
    # ("7.7 Relationships between source and binary packages - Build-Depends, ..." then the rest
    # and its leader).
    nonblank = [i for i, k in enumerate(kinds) if k != "blank"]
    for n, i in enumerate(nonblank):
        if kinds[i] not in ("entry", "loose"):
            continue
        for width in (1, 2):
            run, after = nonblank[n + 1 : n + 1 + width], nonblank[n + 1 + width : n + 2 + width]
            if (
                len(run) == width
                and after
                and kinds[after[0]] in ("entry", "loose")
                and all(kinds[k] == "other" and len(lines[k].strip()) <= _CONTINUATION_MAX for k in run)
            ):
                for k in run:
                    kinds[k] = "wrapped"
    out: list[int] = []
    i = 0
    while i < len(lines):
        if kinds[i] == "other":
            i += 1
            continue
        j = i
        while j < len(lines) and kinds[j] != "other":
            j += 1
        block = range(i, j)
        entries = [k for k in block if kinds[k] in ("entry", "loose")]
        strong = sum(1 for k in block if kinds[k] == "entry")
        filled = sum(1 for k in block if kinds[k] != "blank")
        if strong >= _CONTENTS_MIN and 2 * len(entries) >= filled:
            first, last = entries[0], entries[-1]
            # Its title: the labels just above the first entry, if they start the page or
            # follow a blank line; a label touching the line before the block may end that
            # paragraph, and stays with the labels up to the next blank line.
            top = first
            while top > i and kinds[top - 1] in ("label", "blank"):
                top -= 1
            if any(k != "blank" for k in kinds[:top]) and kinds[top] != "blank":
                blanks = [k for k in range(top, first) if kinds[k] == "blank"]
                top = blanks[0] if blanks else first
            while kinds[top] == "blank":
                top += 1
            # The labels after the last entry go when nothing follows them on the page: the
            # index's next letter, whose entries start the next page.
            bottom = last
            if all(k in ("label", "blank") for k in kinds[last + 1 :]):
                bottom = len(lines) - 1
            out.extend(k for k in range(top, bottom + 1) if kinds[k] != "blank")
        i = j
    return out


def fold_line(line: str) -> str:
    """Whitespace- and case-folded line, digits kept: the key for corpus-wide boilerplate.

    Digits are kept across documents because there they tell documents apart ("Constitution
    (v1.6)" vs "(v1.7)"); a navigation bar or licence footer repeats exactly.

    >>> fold_line("  Home |   Blog ")
    'home | blog'
    """
    return " ".join(line.split()).casefold()


def find_known(pages: Sequence[str], known: Collection[str]) -> StripReport:
    """Edge lines whose :func:`fold_line` key is in ``known`` (corpus boilerplate), peeled inwards.

    The same peel as :func:`find_furniture` (at most :data:`ZONE` lines per edge, stops at the
    first other line) with no per-document rule, so it may run on already-cleaned pages.
    """
    split = [page.split("\n") for page in pages]
    removed: list[tuple[int, int]] = []
    per_page = []
    patterns = set()
    for p, lines in enumerate(split):
        nonempty = [i for i, line in enumerate(lines) if line.strip()]
        gone: list[int] = []
        for order in (nonempty[:ZONE], list(reversed(nonempty[-ZONE:]))):
            for i in order:
                key = fold_line(lines[i])
                if i in gone or key not in known:
                    break
                gone.append(i)
                patterns.add(key)
        gone.sort()
        per_page.append(len(gone))
        removed.extend((p, i) for i in gone)
    return StripReport(
        removed=len(removed),
        patterns=tuple(sorted(patterns)),
        per_page=tuple(per_page),
        lines=tuple(removed),
    )


def apply_report(pages: Sequence[str], report: StripReport) -> list[str]:
    """Delete the lines listed in ``report`` from ``pages`` (the rest is left byte for byte)."""
    drop: dict[int, set[int]] = defaultdict(set)
    for p, i in report.lines:
        drop[p].add(i)
    out = []
    for p, page in enumerate(pages):
        if p not in drop:
            out.append(page)
            continue
        lines = page.split("\n")
        out.append("\n".join(line for i, line in enumerate(lines) if i not in drop[p]))
    return out


def trim_page(page: str) -> str:
    """``page`` without the blank lines at its edges: layout padding (groff pads to 66 lines, and
    stripping furniture leaves the blank lines around it). Inner blank lines separate paragraphs
    and stay.

    >>> trim_page("\\n\\nHeading\\n\\nBody.\\n\\n")
    'Heading\\n\\nBody.'
    """
    return page.strip("\n")


@overload
def strip_headers_footers(
    pages: Sequence[str],
    *,
    report: Literal[False] = ...,
    known: Collection[str] = ...,
    trust_page_numbers: bool = ...,
) -> list[str]: ...


@overload
def strip_headers_footers(
    pages: Sequence[str],
    *,
    report: Literal[True],
    known: Collection[str] = ...,
    trust_page_numbers: bool = ...,
) -> tuple[list[str], StripReport]: ...


def strip_headers_footers(
    pages: Sequence[str],
    *,
    report: bool = False,
    known: Collection[str] = (),
    trust_page_numbers: bool = False,
) -> list[str] | tuple[list[str], StripReport]:
    """Remove running headers, footers and page numbers from a document's pages.

    Returns the cleaned pages (same count, lines only deleted); with ``report=True`` returns
    ``(pages, StripReport)``. ``known`` (corpus-wide masked keys) and ``trust_page_numbers`` are
    described in :func:`find_furniture`; the module docstring gives the rules.

    >>> pages = ["Guide  1 / 3\\nalpha", "Guide  2 / 3\\nbeta", "Guide  3 / 3\\ngamma"]
    >>> strip_headers_footers(pages)
    ['alpha', 'beta', 'gamma']
    >>> strip_headers_footers(["Guide 1\\nalpha", "Guide 2\\nbeta"])  # too few pages to tell
    ['Guide 1\\nalpha', 'Guide 2\\nbeta']
    """
    found = find_furniture(pages, known=known, trust_page_numbers=trust_page_numbers)
    cleaned = apply_report(pages, found)
    return (cleaned, found) if report else cleaned


def edge_keys(pages: Iterable[str]) -> list[set[str]]:
    """Per page, the :func:`fold_line` keys of its edge-zone lines (for corpus-wide statistics)."""
    split = [page.split("\n") for page in pages]
    return [{fold_line(lines[i]) for i in zone} for lines, zone in zip(split, _zones(split), strict=True)]
