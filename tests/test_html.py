"""HTML to text: main content, headings and lists, chrome dropped, hostile markup."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragbudget.errors import LoadError
from ragbudget.input.html import html_to_text
from ragbudget.input.loaders import load_document


def test_html_main_text_headings_lists(tmp_path: Path):
    p = tmp_path / "page.htm"
    p.write_bytes(
        b"<!DOCTYPE html><html><head><meta charset='iso-8859-1'><title>Site</title>"
        b"<style>p{color:red}</style></head><body>"
        b"<header><a href='/'>Home</a> <a href='/b'>Blog</a></header>"
        b"<nav><ul><li>Menu</li></ul></nav>"
        b"<main><article><header><h1>Caf\xe9 review</h1><p>by Ann</p></header>"
        b"<h2>Coffee</h2><p>Strong <b>and</b> hot.</p><ul><li>one</li><li>two</li></ul>"
        b"<pre>code  keeps\n  spacing</pre><script>alert(1)</script>"
        b"<table><tr><td>a</td><td>b</td></tr></table></article></main>"
        b"<aside>Related posts</aside><footer>Copyright</footer></body></html>"
    )
    doc = load_document(p)
    assert doc.text == (
        "# Café review\n\nby Ann\n\n## Coffee\n\nStrong and hot.\n\n- one\n- two\n\ncode  keeps\n  spacing\n\na | b"
    )
    assert doc.meta["format"] == "html" and doc.meta["title"] == "Site"
    assert doc.meta["encoding"] == "iso8859-1"
    assert doc.meta["paginated"] is False


def test_deeply_nested_html_is_malformed_not_a_crash(tmp_path: Path):
    p = tmp_path / "deep.html"
    p.write_text("<div>" * 20000 + "x" + "</div>" * 20000)
    try:
        doc = load_document(p)
    except LoadError as exc:
        assert exc.reason in ("malformed", "empty")
    else:
        assert "x" in doc.text


def test_a_page_without_headings_is_titled_and_empty_markup_is_a_reason() -> None:
    assert html_to_text("<title>Notes</title><body><p>One.</p><p>Two.</p></body>", "n.html") == (
        "# Notes\n\nOne.\n\nTwo.",
        "Notes",
    )
    for markup in ("", "<?xml version='1.0'?>  "):
        with pytest.raises(LoadError) as info:
            html_to_text(markup, "e.html")
        assert info.value.reason == "empty" and str(info.value) == "e.html: the HTML file has no content"
