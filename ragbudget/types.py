"""Small frozen records passed between the pipeline stages.

Stages are functions (``load_document``, ``strip_headers_footers``, ``chunk_text``, ``dedup``,
``select``) and these are what they exchange. Nothing here imports a heavy library.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PAGE_SEP", "Chunk", "Document", "Source"]

#: Pages are joined with a single newline: a sentence running over a page break stays one
#: paragraph for the chunker, while the page boundary offsets are still known exactly.
PAGE_SEP = "\n"


@dataclass(frozen=True)
class Document:
    """A loaded document: its pages (one page for unpaginated formats) and facts about it.

    ``text`` is the pages joined by :data:`PAGE_SEP`; ``page_starts[i]`` is the offset in ``text``
    where page ``i + 1`` begins, so any offset maps back to a 1-based page number.

    >>> d = Document(path="a.txt", pages=["one", "two"])
    >>> d.text, d.page_of(4)
    ('one\\ntwo', 2)
    """

    path: str
    pages: list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return PAGE_SEP.join(self.pages)

    @property
    def page_starts(self) -> list[int]:
        starts, pos = [], 0
        for page in self.pages:
            starts.append(pos)
            pos += len(page) + len(PAGE_SEP)
        return starts

    @property
    def paginated(self) -> bool:
        """True when the source had real pages (PDF, form feeds, fixed-length pages)."""
        return bool(self.meta.get("paginated", len(self.pages) > 1))

    def page_of(self, offset: int) -> int:
        """1-based page number holding character ``offset`` of ``text``."""
        return max(1, bisect.bisect_right(self.page_starts, offset))


@dataclass(frozen=True)
class Chunk:
    """A piece of a text, with exact offsets and token count.

    Invariant: ``text == source_text[start:end]`` and ``n_tokens == len(tokenizer.encode(text))``.
    ``headings`` is the heading path above the chunk; ``page_start``/``page_end`` are 1-based
    page numbers when the document has pages.
    """

    text: str
    start: int
    end: int
    n_tokens: int
    headings: tuple[str, ...] = ()
    page_start: int | None = None
    page_end: int | None = None


@dataclass(frozen=True)
class Source:
    """Where a (possibly deduplicated) chunk's text appears: file, character offsets, pages."""

    path: str
    start: int
    end: int
    page_start: int | None = None
    page_end: int | None = None

    @property
    def page(self) -> int | None:
        return self.page_start

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "start": self.start,
            "end": self.end,
            "page": self.page_start,
            "page_end": self.page_end,
        }
