"""ragbudget.types: the frozen records passed between stages."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ragbudget.types import PAGE_SEP, Chunk, Document, Hit, Source


def test_document_maps_every_offset_to_its_page() -> None:
    d = Document(path="a.pdf", pages=["first page", "p2", "", "last"])
    assert d.text == PAGE_SEP.join(d.pages)
    for page, start in enumerate(d.page_starts, 1):
        assert d.text[start:].startswith(d.pages[page - 1])
        assert d.page_of(start) == page or d.pages[page - 1] == ""  # an empty page owns no offset
    assert d.page_of(0) == 1 and d.page_of(len(d.text)) == 4
    assert d.paginated
    single = Document(path="a.txt", pages=["x"])
    assert not single.paginated and single.page_of(0) == 1
    assert Document(path="a.txt", pages=["x", "y"], meta={"paginated": False}).paginated is False


def test_records_are_frozen() -> None:
    c = Chunk(text="abc", start=0, end=3, n_tokens=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.text = "x"  # type: ignore[misc]


def test_hit_serializes_its_sources_and_names_the_owning_one() -> None:
    owner = Source(path="docs/a.md", start=10, end=20, page_start=2, page_end=3, label=None)
    dup = Source(path="docs/b.md", start=0, end=10)
    hit = Hit(chunk_id=7, score=0.12345678, text="t", n_tokens=1, headings=("H",), sources=(owner, dup))
    assert hit.source is owner and owner.page == 2
    d = hit.to_dict()
    assert d["score"] == 0.123457 and d["headings"] == ["H"]
    assert d["sources"][0] == {"path": "docs/a.md", "start": 10, "end": 20, "page": 2, "page_end": 3, "label": None}
    assert json.loads(json.dumps(d)) == d  # JSON-able as is
    assert Hit(chunk_id=1, score=0.0, text="", n_tokens=0).source is None
