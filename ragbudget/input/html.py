"""HTML to text: the page's main content (the single ``<main>`` or ``<article>``, else ``<body>``),
page chrome dropped (scripts, navigation, forms, a body-level header and footer, hidden
elements), headings as ``#`` lines, list items as ``- `` lines and table cells joined by ``|``.

The one HTML reader: ``.html`` files, an EPUB's chapters and a mail's HTML part all go through
:func:`html_to_text`. lxml is imported on first use.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import LoadError

__all__ = ["html_to_text"]

_DROP_TAGS = frozenset(
    {
        "script",
        "style",
        "noscript",
        "template",
        "nav",
        "iframe",
        "svg",
        "canvas",
        "button",
        "select",
        "form",
        "object",
        "embed",
        "head",
        "title",
        "meta",
        "link",
        "aside",
    }
)
# header/footer are page chrome at body level, but an <article>'s own <header> holds its title.
_CHROME_TAGS = frozenset({"header", "footer"})
_BLOCK_TAGS = frozenset(
    {
        "p",
        "div",
        "section",
        "article",
        "main",
        "ul",
        "ol",
        "li",
        "dl",
        "dt",
        "dd",
        "table",
        "thead",
        "tbody",
        "tfoot",
        "tr",
        "blockquote",
        "figure",
        "figcaption",
        "address",
        "hr",
        "body",
        "html",
        "header",
        "footer",
        "details",
        "summary",
        "caption",
    }
)
_HEADINGS = {f"h{i}": i for i in range(1, 7)}
_XML_DECL = re.compile(r"^\s*<\?xml[^>]*\?>", re.IGNORECASE)


def html_to_text(markup: str, path: str) -> tuple[str, str]:
    """``(text, title)`` of an HTML page: its main text as Markdown-ish lines (``# Heading``,
    ``- item``, paragraphs), and its ``<title>``. Raises ``LoadError`` (``empty``, ``malformed``).

    >>> html_to_text("<title>T</title><nav>Home</nav><h2>Hi</h2><p>Some <b>bold</b> text.</p>", "x.html")
    ('## Hi\\n\\nSome bold text.', 'T')
    """
    root = _parse(markup, path)
    title_el = root.find(".//title")
    title = " ".join((title_el.text_content() if title_el is not None else "").split())
    container = _main_container(root)
    writer = _TextWriter()
    try:
        writer.walk(container, container.tag in ("article", "main"))
    except RecursionError as exc:  # thousands of nested elements: hostile or broken markup
        raise LoadError(f"{path}: HTML nested too deeply to read", path=path, reason="malformed") from exc
    writer.flush()
    lines = writer.lines
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    if text and title and not any(line.startswith("#") for line in lines):
        text = f"# {title}\n\n{text}"
    return text, title


# An lxml element or tree (lxml ships no type stubs: its values are Any here).
def _parse(markup: str, path: str) -> Any:
    """The parsed document; a LoadError when it is empty or cannot be parsed."""
    import lxml.etree
    import lxml.html

    markup = _XML_DECL.sub("", markup)
    if not markup.strip():
        raise LoadError(f"{path}: the HTML file has no content", path=path, reason="empty")
    try:
        return lxml.html.document_fromstring(markup)
    except (lxml.etree.ParserError, ValueError) as exc:
        raise LoadError(f"{path}: cannot parse HTML ({exc})", path=path, reason="malformed") from exc


def _main_container(root: Any) -> Any:
    """Main content: the single <main>, else the single <article>, else <body>."""
    body = root.find(".//body")
    container = body if body is not None else root
    for tag in ("main", "article"):
        found = root.findall(f".//{tag}")
        if len(found) == 1:
            return found[0]
    return container


class _TextWriter:
    """An element tree written out as Markdown-ish lines: headings, list items, paragraphs and
    preformatted blocks, the page's chrome (navigation, hidden parts) left out."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.buf: list[str] = []

    def flush(self) -> None:
        """End the line being written (a lone list dash is no line)."""
        text = " ".join("".join(self.buf).split())
        self.buf.clear()
        if text and text != "-":
            self.lines.append(text)

    def block_break(self) -> None:
        """End the line, and leave one blank line after it."""
        self.flush()
        if self.lines and self.lines[-1] != "":
            self.lines.append("")

    def walk(self, el: Any, in_article: bool) -> None:
        """Write ``el`` and what it holds (``in_article``: inside <article> or <main>, where
        chrome tags hold content)."""
        lines, buf = self.lines, self.buf
        tag = el.tag.lower() if isinstance(el.tag, str) else None
        hidden = tag is not None and (
            el.get("hidden") is not None
            or el.get("aria-hidden") == "true"
            or (el.get("role") or "") in ("navigation", "banner", "contentinfo")
        )
        if tag is None or tag in _DROP_TAGS or hidden or (tag in _CHROME_TAGS and not in_article):
            if tag is not None and el.tail:
                buf.append(el.tail)
            return
        if tag in _HEADINGS:
            self.block_break()
            text = " ".join(el.text_content().split())
            if text:
                lines.append("#" * _HEADINGS[tag] + " " + text)
                lines.append("")
        elif tag == "pre":
            self.block_break()
            lines.append(el.text_content().strip("\n"))
            lines.append("")
        elif tag == "br":
            self.flush()
        elif tag in _BLOCK_TAGS:
            if tag == "li":  # list items stay on consecutive lines
                self.flush()
                buf.append("- ")
            else:
                self.block_break()
            if el.text:
                buf.append(el.text)
            inner = in_article or tag in ("article", "main")
            for child in el:
                self.walk(child, inner)
            self.block_break() if tag != "li" else self.flush()
        else:
            if tag in ("td", "th") and buf:
                buf.append(" | ")
            if el.text:
                buf.append(el.text)
            for child in el:
                self.walk(child, in_article)
        if el.tail:
            buf.append(el.tail)
