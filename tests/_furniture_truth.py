"""The ground truth of header/footer stripping on the shared documents, built from the pages
themselves. One definition, used by tests/test_clean.py and bench/clean.py."""

from __future__ import annotations

import math
import re
from collections import defaultdict

from ragbudget.clean import mask_line

__all__ = ["PDFS", "ground_truth"]

PDFS = ("policy.pdf", "maint-guide.en.pdf", "R-intro.pdf")
# Printed page number of 0-based PDF page i, read off the documents (README of shared/data):
# (arabic offset, range of roman front-matter pages, roman offset).
_PAGE_NUMBERS = {
    "policy.pdf": (-9, range(2, 10), -1),
    "maint-guide.en.pdf": (-5, range(1, 6), 1),
    "R-intro.pdf": (-5, range(2, 6), -1),
}
_ROMAN = ["", "i", "ii", "iii", "iv", "v", "vi", "vii", "viii", "ix", "x"]


def _printed(name: str, i: int) -> str:
    if name not in _PAGE_NUMBERS:
        return str(i + 1)  # man pages: plain 1, 2, 3
    arabic, front, roman = _PAGE_NUMBERS[name]
    return _ROMAN[i + roman] if i in front else str(i + arabic)


def ground_truth(name: str, pages: list[str]) -> tuple[set, set, set]:
    """(furniture, extended furniture, body) as sets of (page, line) positions.

    * furniture: a line among the first/last 3 non-empty lines of a page whose digit-masked form
      repeats in those zones on >= 30% of the pages (and >= 2), and has a letter or digit;
    * extended: furniture plus a first/last-two line whose first or last word (or N in "N / M")
      is the page's printed number (section-title footers, per-chapter running heads);
    * body: lines of >= 40 characters that are not extended furniture.
    """
    zones, key_pages = [], defaultdict(set)
    for p, page in enumerate(pages):
        lines = page.split("\n")
        ne = [i for i, line in enumerate(lines) if line.strip()]
        zones.append((set(ne[:3] + ne[-3:]), set(ne[:2] + ne[-2:])))
        for i in zones[-1][0]:
            key_pages[mask_line(lines[i])].add(p)
    need = max(2, math.ceil(0.3 * len(pages)))
    furniture, extended, body = set(), set(), set()
    for p, page in enumerate(pages):
        printed = _printed(name, p)
        for i, line in enumerate(page.split("\n")):
            key, words = mask_line(line), line.split()
            if i in zones[p][0] and len(key_pages[key]) >= need and re.search(r"[^\W_]|#", key):
                furniture.add((p, i))
                extended.add((p, i))
                continue
            if i in zones[p][1] and len(line.strip()) <= 120 and (
                printed in (words[0], words[-1])
                or (len(words) >= 3 and words[-3] == printed and words[-2] == "/")
            ):
                extended.add((p, i))
                continue
            if len(line.strip()) >= 40:
                body.add((p, i))
    return furniture, extended, body
