"""Corpus boilerplate: edge lines repeated across the documents of one format, judged per batch."""

from __future__ import annotations

import pytest

from ragbudget.input.boilerplate import BoilerplateFilter, strip_corpus_boilerplate
from ragbudget.types import Document


def _site(n: int) -> list[Document]:
    words = ["apples", "pears", "plums", "figs", "kiwis", "limes"]
    return [
        Document(
            path=f"{i}.html",
            pages=[f"Home | Products | Contact\n# About {words[i]}\n{words[i]} are good.\nShare on Mastodon"],
            meta={"format": "html"},
        )
        for i in range(n)
    ]


def test_corpus_boilerplate_removed_across_documents():
    out = strip_corpus_boilerplate(_site(5))
    assert [d.text for d in out][:2] == ["# About apples\napples are good.", "# About pears\npears are good."]
    assert out[0].meta["boilerplate_removed"] == 2
    # two documents are not a corpus: nothing is judged boilerplate
    assert [d.text for d in strip_corpus_boilerplate(_site(2))] == [d.text for d in _site(2)]


def test_corpus_boilerplate_is_per_format_and_keeps_numbers():
    versions = [
        Document(path=f"c{v}.txt", pages=[f"Constitution (v1.{v})\n\nText {v}."], meta={"format": "text"})
        for v in range(6)
    ]
    assert strip_corpus_boilerplate(versions) == versions
    mixed = _site(4) + [Document(path="x.txt", pages=["Home | Products | Contact\nplain"], meta={"format": "text"})]
    out = strip_corpus_boilerplate(mixed)
    assert out[-1].text == "Home | Products | Contact\nplain"


def test_boilerplate_filter_in_batches_and_roundtrip():
    filt = BoilerplateFilter()
    docs = _site(6)
    filt.observe(docs[:3])
    first = [filt.strip(d) for d in docs[:3]]
    assert all(not d.text.startswith("Home") for d in first)
    again = BoilerplateFilter.from_dict(filt.to_dict())
    assert again.patterns("html") == filt.patterns("html") == {"home | products | contact", "share on mastodon"}
    # a one-document-only line is never boilerplate, whatever the thresholds
    with pytest.raises(ValueError):
        BoilerplateFilter(min_docs=1)
