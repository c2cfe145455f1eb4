"""Boilerplate repeated across the documents of one corpus: a site's navigation line on every
one-page HTML file, a licence footer on every note, which per-document furniture stripping
(:mod:`ragbudget.input.clean`, within one document's pages) cannot see.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from ..errors import ConfigError
from ..types import Document
from .clean import apply_report, edge_keys, find_known, trim_page

__all__ = ["BoilerplateFilter", "strip_corpus_boilerplate"]


class BoilerplateFilter:
    """Strips page-edge lines repeated across many documents of one corpus (per format).

    Per-document stripping cannot see a site navigation line on every one-page HTML file, or a
    licence footer on every note. This filter counts, per format, in how many documents each
    masked edge line occurs (for a multi-page document only lines on at least half its pages
    count, so a man page's ``NAME`` heading on page 1 is not boilerplate). A line seen in at least
    ``min_docs`` documents and ``min_share`` of the documents of that format is boilerplate.
    Removal follows the per-document safety rules: peeled from page edges only, at most
    :data:`~ragbudget.input.clean.ZONE` lines per edge, never a line found in one document only.

    Batches: call :meth:`observe` on each batch before :meth:`strip` on it; statistics grow as
    batches arrive (the first batch is judged on itself). :meth:`to_dict`/:meth:`from_dict` keep
    the counts across incremental index runs.

    >>> docs = [Document(path=f"{i}.html", pages=[f"Home | Blog | About\\n# Post {i}\\nText {i}."],
    ...                  meta={"format": "html"}) for i in range(4)]
    >>> [d.text for d in strip_corpus_boilerplate(docs)][:2]
    ['# Post 0\\nText 0.', '# Post 1\\nText 1.']

    Keys are :func:`~ragbudget.input.clean.fold_line` (digits kept): across documents, numbers tell
    them apart ("Constitution (v1.6)" vs "(v1.7)") while navigation lines repeat exactly.
    """

    def __init__(self, *, min_docs: int = 3, min_share: float = 0.4) -> None:
        if min_docs < 2:
            raise ConfigError(f"min_docs must be at least 2 (a line in one document is content), got {min_docs}")
        if not 0 < min_share <= 1:
            raise ConfigError(f"min_share must be in (0, 1], got {min_share}")
        self.min_docs = min_docs
        self.min_share = min_share
        self._docs: Counter[str] = Counter()
        self._df: Counter[tuple[str, str]] = Counter()

    def __repr__(self) -> str:
        return (
            f"BoilerplateFilter(min_docs={self.min_docs}, min_share={self.min_share}, docs={sum(self._docs.values())})"
        )

    @staticmethod
    def _doc_keys(doc: Document) -> set[str]:
        if doc.meta.get("layout") is False:
            return set()  # rows, cells, paragraphs: a line repeated across files is content
        per_page = edge_keys(doc.pages)
        if not per_page:
            return set()
        counts: Counter[str] = Counter(k for keys in per_page for k in keys)
        need = max(1, (len(per_page) + 1) // 2)
        return {k for k, c in counts.items() if c >= need}

    def observe(self, docs: Iterable[Document]) -> None:
        """Add documents to the statistics."""
        for doc in docs:
            fmt = str(doc.meta.get("format", "text"))
            self._docs[fmt] += 1
            for key in self._doc_keys(doc):
                self._df[(fmt, key)] += 1

    def patterns(self, fmt: str = "text") -> frozenset[str]:
        """The masked keys currently judged boilerplate for documents of format ``fmt``."""
        need = max(self.min_docs, self.min_share * self._docs[fmt])
        return frozenset(
            key for (f, key), c in self._df.items() if f == fmt and c >= need and re.search(r"[^\W_]", key)
        )

    def strip(self, doc: Document) -> Document:
        """A copy of ``doc`` without edge lines matching the corpus boilerplate of its format."""
        known = self.patterns(str(doc.meta.get("format", "text")))
        if not known or doc.meta.get("layout") is False:
            return doc
        report = find_known(doc.pages, known)
        if not report.removed:
            return doc
        pages = [trim_page(p) for p in apply_report(doc.pages, report)]
        if not any(p.strip() for p in pages):
            return doc  # a document made only of "boilerplate" is the content itself
        meta = dict(doc.meta)
        meta["boilerplate_removed"] = meta.get("boilerplate_removed", 0) + report.removed
        meta["boilerplate_patterns"] = sorted(set(meta.get("boilerplate_patterns", [])) | set(report.patterns))
        return replace(doc, pages=pages, meta=meta)

    def to_dict(self) -> dict[str, Any]:
        return {
            "min_docs": self.min_docs,
            "min_share": self.min_share,
            "docs": dict(self._docs),
            "df": [[f, k, c] for (f, k), c in sorted(self._df.items())],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BoilerplateFilter:
        filt = cls(min_docs=int(data["min_docs"]), min_share=float(data["min_share"]))
        filt._docs.update({str(k): int(v) for k, v in data["docs"].items()})
        for f, k, c in data["df"]:
            filt._df[(str(f), str(k))] = int(c)
        return filt


def strip_corpus_boilerplate(docs: Sequence[Document], *, min_docs: int = 3, min_share: float = 0.4) -> list[Document]:
    """Remove page-edge lines repeated across the documents of one batch (see :class:`BoilerplateFilter`)."""
    filt = BoilerplateFilter(min_docs=min_docs, min_share=min_share)
    filt.observe(docs)
    return [filt.strip(d) for d in docs]
