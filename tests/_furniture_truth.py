"""Hand-written ground truth of page furniture in the shared documents (``shared/data``).

Written by reading the pages (pypdfium2 text, as ragbudget's loader extracts it, and
``pdftotext -layout`` from poppler-utils 22.12.0; the man pages as rendered), never computed with
ragbudget: this module imports only :mod:`re`. Per document it lists, as data,

* how the printed page number follows the 0-based page index (roman front matter, arabic body);
* every furniture pattern: its kind, the page edge it sits on, the pages it occurs on, a regex
  over the whitespace-collapsed line, and whether it must be found on every one of those pages
  (a self-check: a pattern that misses a page it was read on is a wrong truth, not a figure).

Kinds: ``running_head`` (a fixed title line), ``running_foot`` (a fixed foot line),
``section_running_head`` (carries the current chapter/section title: LaTeX ``\\markright`` /
texinfo style, ``3.2. Administrative Duties 23``, ``2 CONTENTS``, ``Chapter 5: Arrays and
matrices 25``), ``page_number`` (the printed page number alone). Independently of the kind, a
line whose pattern has a ``(?P<n>…)`` group must carry the page's printed number there; those
lines are the *page-number lines* (bare numbers, ``Guide 3 / 57``, section heads, man footers).

Apart from the furniture, each document lists its *contents pages*: the table of contents, and
the index (R-intro's two, policy.pdf's one page). Their non-furniture lines are *contents lines*:
navigation, neither furniture nor body; a cleaner may remove them (``contents_removed``) or not.

Lines are matched from each page edge inwards (at most :data:`EDGE` lines per edge), stopping at
the first line no pattern of that edge matches, so a body line that happens to look like a head
in the middle of a page is never furniture. Body lines: the non-furniture lines of at least
:data:`BODY_MIN` characters once whitespace is collapsed (prose and code lines; short lines are
headings, list items, table cells and figure labels, where a cleaner's mistakes cost little and
extractor differences are largest).
"""

from __future__ import annotations

import re

__all__ = [
    "BODY_MIN",
    "DOCS",
    "EDGE",
    "KINDS",
    "MANPAGE",
    "classify",
    "contents_lines",
    "printed_number",
    "removed_lines",
    "score",
]

EDGE = 3
BODY_MIN = 40
KINDS = ("running_head", "running_foot", "section_running_head", "page_number")

_ROMAN = ["", "i", "ii", "iii", "iv", "v", "vi", "vii", "viii", "ix", "x"]

# policy.pdf: chapter-opening pages (first line "CHAPTER" + a spelled number, or "INDEX") carry no
# running head and only a bare page number at the bottom. Read off the pages.
_POLICY_OPENINGS = (
    12,
    16,
    22,
    28,
    40,
    58,
    66,
    76,
    88,
    102,
    112,
    120,
    126,
    128,
    132,
    138,
    140,
    142,
    144,
    146,
    150,
    156,
    190,
    192,
)
_POLICY_BODY = [p for p in range(10, 193) if p not in _POLICY_OPENINGS]
# R-intro.pdf: chapter/appendix-opening pages (and the preface, pages 6-7) print a bare number at
# the top instead of the running head.
_RINTRO_OPENINGS = (6, 7, 13, 19, 22, 25, 34, 38, 41, 48, 50, 60, 73, 88, 90, 93, 97, 105, 107, 110, 112)

# Each pattern: (kind, edge "top"/"bottom", pages, must be on every one of them, regex, what I saw).
DOCS: dict[str, dict] = {
    "policy.pdf": {
        # Printed numbers: pages 2-9 are i-viii (roman, index - 1), pages 10-192 are 1-183.
        "printed": [(range(2, 10), "roman", -1), (range(10, 193), "arabic", -9)],
        # CONTENTS on pages 2-8 (i-vii; 9 is blank), the INDEX ("signaling, 91") on page 192.
        "contents": [*range(2, 9), 192],
        "patterns": [
            (
                "page_number",
                "bottom",
                range(2, 10),
                True,
                r"(?P<n>[ivx]+)",
                "table of contents pages 2-8 and blank page 9: roman number alone at the bottom "
                "(no head; the 'CONTENTS' at the top of page 2 is the contents' own title)",
            ),
            (
                "running_head",
                "top",
                _POLICY_BODY,
                True,
                r"Debian Policy Manual, Release 4\.6\.2\.0",
                "every non-opening page from 10 on, top: 'Debian Policy Manual, Release 4.6.2.0'",
            ),
            (
                "page_number",
                "bottom",
                _POLICY_OPENINGS + (152, 154),
                True,
                r"(?P<n>\d+)",
                "chapter openings and the two full-page flowcharts (152, 154): number alone",
            ),
            (
                "section_running_head",
                "bottom",
                [p for p in _POLICY_BODY if p % 2 == 1 and p != 143],
                True,
                r"(?P<n>\d+) ?(Chapter \d+\. .+|CONTENTS)",
                "verso (even printed number), bottom: 'N Chapter K. Chapter title' ('2 CONTENTS' "
                "on page 11, in the front matter's CONTENTS section)",
            ),
            (
                "section_running_head",
                "bottom",
                [143],
                True,
                r"(?P<n>134) ?Chapter 18\. .+|Manual\)",
                "blank verso page 143: the chapter head wraps over two lines, '134Chapter 18. "
                "Alternative versions … (from old Packaging' / 'Manual)'",
            ),
            (
                "section_running_head",
                "bottom",
                [p for p in _POLICY_BODY if p % 2 == 0 and p not in (152, 154)],
                True,
                r"(\d+(\.\d+)*\. .+|CONTENTS) (?P<n>\d+)",
                "recto (odd printed number), bottom: 'N.N. Section title N' ('CONTENTS 1' on page 10)",
            ),
        ],
    },
    "maint-guide.en.pdf": {
        # Page 0 is the cover (title and authors, no furniture); pages 1-5 are ii-vi; 6-62 are 1-57.
        "printed": [(range(1, 6), "roman", 1), (range(6, 63), "arabic", -5)],
        # "Contents" on pages 3-5 (iv-vi); no index.
        "contents": [3, 4, 5],
        "patterns": [
            (
                "running_head",
                "top",
                range(1, 6),
                True,
                r"Debian New Maintainers’ Guide (?P<n>[ivx]+)",
                "front matter, top: 'Debian New Maintainers’ Guide' + roman page number",
            ),
            (
                "running_head",
                "top",
                range(6, 63),
                True,
                r"Debian New Maintainers’ Guide (?P<n>\d+) / 57",
                "every body page, top: 'Debian New Maintainers’ Guide   N / 57' (nothing at the "
                "bottom; footnotes end the page)",
            ),
        ],
    },
    "R-intro.pdf": {
        # Page 0 title page, page 1 copyright page (no furniture); 2-5 are i-iv; 6-112 are 1-107.
        "printed": [(range(2, 6), "roman", -1), (range(6, 113), "arabic", -5)],
        # "Table of Contents" on pages 2-5; Appendix D (function and variable index) on 107-109
        # and Appendix E (concept index) on 110-111, dot leaders to page numbers.
        "contents": [2, 3, 4, 5, 107, 108, 109, 110, 111],
        "patterns": [
            ("page_number", "top", range(2, 6), True, r"(?P<n>[ivx]+)", "table of contents, top: roman number alone"),
            (
                "page_number",
                "top",
                _RINTRO_OPENINGS,
                True,
                r"(?P<n>\d+)",
                "chapter/appendix openings (and the preface), top: arabic number alone",
            ),
            (
                "section_running_head",
                "top",
                [p for p in range(8, 113) if p not in _RINTRO_OPENINGS],
                True,
                r"(Chapter \d+|Appendix [A-F]): .+ (?P<n>\d+)",
                "every other page, top: texinfo running head 'Chapter 5: Arrays and matrices 25' / "
                "'Appendix B: Invoking R 93', changing per chapter (several chapters span 1-2 pages)",
            ),
        ],
    },
}

# Every man page (groff -man -Tutf8, 66-line pages), read on close.2, open.2 and checked on all 40.
MANPAGE = {
    "printed": [(range(0, 1000), "arabic", 1)],
    "patterns": [
        (
            "page_number",
            "bottom",
            [0],
            True,
            r"(?P<n>1)",
            "page 1, bottom: '1' alone (page 1 has no head: it starts with NAME)",
        ),
        (
            "running_head",
            "top",
            range(1, 1000),
            True,
            r"[a-z_0-9]+\(2\) System Calls Manual [a-z_0-9]+\(2\)",
            "pages 2+, top: 'close(2)   System Calls Manual   close(2)'",
        ),
        (
            "running_foot",
            "bottom",
            range(1, 1000),
            True,
            r"Linux man-pages 6\.03 \d{4}-\d\d-\d\d (?P<n>\d+)",
            "pages 2+, bottom: 'Linux man-pages 6.03   <date of the page's source>   N'",
        ),
    ],
}


def _spec(name: str) -> dict:
    return DOCS.get(name, MANPAGE)


def printed_number(name: str, page: int) -> str | None:
    """The page number printed on 0-based ``page`` of document ``name`` (None: unnumbered)."""
    for pages, kind, offset in _spec(name)["printed"]:
        if page in pages:
            return _ROMAN[page + offset] if kind == "roman" else str(page + offset)
    return None


def classify(name: str, pages: list[str]) -> tuple[dict, set, list]:
    """Ground truth for one extraction of document ``name``.

    Returns ``(furniture, body, misses)``: ``furniture`` maps ``(page, line_index)`` to
    ``(kind, carries_page_number)``; ``body`` is the set of body line positions; ``misses`` lists
    ``(pattern note, page)`` where a pattern read on that page was not found (must be empty).
    ``line_index`` indexes ``page.split("\\n")``.
    """
    spec = _spec(name)
    furniture: dict[tuple[int, int], tuple[str, bool]] = {}
    found: set[tuple[int, int]] = set()  # (pattern index, page)
    for p, page in enumerate(pages):
        lines = page.split("\n")
        nonempty = [i for i, line in enumerate(lines) if line.strip()]
        for edge, order in (("top", nonempty[:EDGE]), ("bottom", nonempty[::-1][:EDGE])):
            for i in order:
                if (p, i) in furniture:
                    break
                text = " ".join(lines[i].split())
                hit = None
                for k, (kind, where, on, _, regex, _) in enumerate(spec["patterns"]):
                    if where != edge or p not in on:
                        continue
                    m = re.fullmatch(regex, text)
                    if m and (m.groupdict().get("n") in (None, printed_number(name, p))):
                        hit = (k, kind, m.groupdict().get("n") is not None)
                        break
                if hit is None:
                    break
                furniture[(p, i)] = (hit[1], hit[2])
                found.add((hit[0], p))
    misses = [
        (note, p)
        for k, (_, _, on, every, _, note) in enumerate(spec["patterns"])
        for p in on
        if every and p < len(pages) and (k, p) not in found
    ]
    contents = set(spec.get("contents", ()))
    body = {
        (p, i)
        for p, page in enumerate(pages)
        if p not in contents
        for i, line in enumerate(page.split("\n"))
        if (p, i) not in furniture and len(" ".join(line.split())) >= BODY_MIN
    }
    return furniture, body, misses


def contents_lines(name: str, pages: list[str], furniture: dict) -> set:
    """Positions of the contents lines of ``pages``: the non-empty, non-furniture lines of the
    document's contents pages (a table of contents, an index)."""
    on = set(_spec(name).get("contents", ()))
    return {
        (p, i)
        for p, page in enumerate(pages)
        if p in on
        for i, line in enumerate(page.split("\n"))
        if line.strip() and (p, i) not in furniture
    }


def removed_lines(before: list[str], after: list[str]) -> tuple[set, set]:
    """``(gone, cut)``: positions of ``before`` lines absent whole from their cleaned page.

    Per-page multiset of whitespace-stripped lines, so a cleaner may also trim blank edges or
    re-indent. ``cut`` holds the absent lines of which a part is left (a cleaner that removes
    substrings leaves ``" 5 / 57"`` of ``"Guide 5 / 57"``); ``gone`` the others. A cut furniture
    line is not removed; a cut body line is lost.
    """
    if len(before) != len(after):
        raise ValueError(f"page count changed: {len(before)} -> {len(after)}")
    gone, cut = set(), set()
    for p, (b, a) in enumerate(zip(before, after, strict=True)):
        left: dict[str, int] = {}
        for line in a.split("\n"):
            left[line.strip()] = left.get(line.strip(), 0) + 1
        absent = []
        for i, line in enumerate(b.split("\n")):
            if left.get(line.strip(), 0) > 0:
                left[line.strip()] -= 1
            else:
                absent.append((i, line.strip()))
        residue = [r for r, k in left.items() if k > 0 and r]
        for i, line in absent:
            # a cleaner that cuts keeps the start or the end of the line
            kept = any(line.startswith(r) or line.endswith(r) for r in residue)
            (cut if kept else gone).add((p, i))
    return gone, cut


def score(name: str, before: list[str], after: list[str]) -> dict[str, int]:
    """Counts for one document: ``<kind>`` / ``<kind>_removed`` per kind, ``furniture``,
    ``page_number_lines`` (lines carrying the printed number), ``body`` and their ``_removed``;
    ``furniture_cut``: furniture lines only partly removed (not counted as removed);
    ``contents`` / ``contents_removed``: the lines of the contents pages (not furniture, not body);
    ``other_removed``: removed or cut non-empty lines that are neither furniture, contents nor body
    (short lines: headings, list items, figure labels — wrongly removed, but not counted as body
    loss)."""
    furniture, body, misses = classify(name, before)
    if misses:
        raise AssertionError(f"{name}: the truth does not fit this extraction: {misses[:3]}")
    gone, cut = removed_lines(before, after)
    out = {key: 0 for kind in KINDS for key in (kind, kind + "_removed")}
    out.update(furniture=0, furniture_removed=0, page_number_lines=0, page_number_lines_removed=0)
    out["furniture_cut"] = len(set(furniture) & cut)
    for pos, (kind, numbered) in furniture.items():
        hit = int(pos in gone)
        out[kind] += 1
        out[kind + "_removed"] += hit
        out["furniture"] += 1
        out["furniture_removed"] += hit
        if numbered:
            out["page_number_lines"] += 1
            out["page_number_lines_removed"] += hit
    out["body"] = len(body)
    out["body_removed"] = len(body & (gone | cut))
    contents = contents_lines(name, before, furniture)
    out["contents"] = len(contents)
    out["contents_removed"] = len(contents & gone)
    lines = [page.split("\n") for page in before]
    out["other_removed"] = sum(
        1 for p, i in (gone | cut) - body - contents if (p, i) not in furniture and lines[p][i].strip()
    )
    return out
