"""Office documents: Word (``.docx``, python-docx), PowerPoint (``.pptx``, python-pptx), and
OpenDocument text (``.odt``, read from its zip and XML directly: no library needed).

Headers and footers are furniture *by construction* in these formats (a DOCX section header, an
ODT master-page footer, a slide-number placeholder): they are never read as body text, and the
lines left out are counted as ``furniture`` so the index summary reports them with the rest.
"""

from __future__ import annotations

import io
from collections import Counter
from typing import Any

from ...errors import LoadError
from ._base import Loaded, LoadOptions, require
from ._zip import open_zip, parse_xml, read_member

__all__ = ["read_docx", "read_odt", "read_pptx"]

# The Any parameters below are python-docx, python-pptx and lxml objects: optional libraries,
# imported on first use and without type stubs here, so their values are Any at this seam.


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _table_lines(rows: list[list[str]]) -> list[str]:
    """Rows of cell texts as ``a | b | c`` lines (empty rows dropped)."""
    return [" | ".join(cells) for cells in rows if any(cells)]


# --------------------------------------------------------------------------------------------------
# DOCX


def _docx_heading_level(paragraph: Any) -> int:
    name = (paragraph.style.name if paragraph.style is not None else "") or ""
    if name == "Title":
        return 1
    if name.startswith("Heading "):
        tail = name[len("Heading ") :]
        return min(6, int(tail)) if tail.isdigit() else 0
    return 0


def read_docx(data: bytes, path: str, *, options: LoadOptions, max_bytes: int, fmt: str) -> Loaded:
    """Body paragraphs and tables in reading order; headings as ``#`` lines; list items as ``-``.

    One page per non-empty paragraph or table, labelled ``paragraph N`` / ``table N``.
    Section headers and footers are left out and counted (distinct header/footer parts once).
    """
    zf = open_zip(data, path, what="Word document", max_bytes=max_bytes)
    zf.close()
    docx = require("docx", "office", path, "Word documents")
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    try:
        document = docx.Document(io.BytesIO(data))
    except Exception as exc:  # python-docx raises KeyError, ValueError, its own errors on damage
        raise LoadError(
            f"{path}: cannot read the Word document ({type(exc).__name__}: {exc})", path=path, reason="malformed"
        ) from exc
    pages: list[str] = []
    labels: list[str] = []
    n_par = n_tab = 0
    for block in document.iter_inner_content():
        if isinstance(block, Paragraph):
            text = _one_line(block.text)
            if not text:
                continue
            level = _docx_heading_level(block)
            ppr = block._p.pPr
            if level:
                text = "#" * level + " " + text
            elif ppr is not None and ppr.numPr is not None:
                text = "- " + text
            n_par += 1
            pages.append(text)
            labels.append(f"paragraph {n_par}")
        elif isinstance(block, Table):
            rows = []
            for row in block.rows:
                cells, seen = [], set()
                for cell in row.cells:  # a merged cell is returned once per grid column it spans
                    if id(cell._tc) in seen:
                        continue
                    seen.add(id(cell._tc))
                    cells.append(_one_line(cell.text))
                rows.append(cells)
            lines = _table_lines(rows)
            if lines:
                n_tab += 1
                pages.append("\n".join(lines))
                labels.append(f"table {n_tab}")
    furniture = 0
    seen_parts: set[str] = set()
    for section in document.sections:
        for part in (
            section.header,
            section.first_page_header,
            section.even_page_header,
            section.footer,
            section.first_page_footer,
            section.even_page_footer,
        ):
            if part.is_linked_to_previous:
                continue
            name = str(part.part.partname)
            if name in seen_parts:
                continue
            seen_parts.add(name)
            furniture += sum(1 for p in part.paragraphs if p.text.strip())
            furniture += sum(1 for t in part.tables for r in t.rows if any(c.text.strip() for c in r.cells))
    return Loaded(pages, labels, meta={"paragraphs": n_par, "tables": n_tab}, furniture=furniture)


# --------------------------------------------------------------------------------------------------
# PPTX


def read_pptx(data: bytes, path: str, *, options: LoadOptions, max_bytes: int, fmt: str) -> Loaded:
    """One page per slide (``slide N``): title as ``#``, text frames, tables, pictures' alt text
    and speaker notes (``Notes:``). Footer, slide-number and date placeholders are furniture; the
    master and layout shapes (logos, footers) are not part of a slide's own shapes and so never
    read. Text repeated on most slides' edges is then removed by the page furniture detector."""
    zf = open_zip(data, path, what="PowerPoint file", max_bytes=max_bytes)
    zf.close()
    pptx = require("pptx", "office", path, "PowerPoint files")
    from pptx.enum.shapes import MSO_SHAPE_TYPE, PP_PLACEHOLDER

    furniture_types = {PP_PLACEHOLDER.FOOTER, PP_PLACEHOLDER.SLIDE_NUMBER, PP_PLACEHOLDER.DATE}
    try:
        prs = pptx.Presentation(io.BytesIO(data))
        slides = list(prs.slides)
    except Exception as exc:  # python-pptx raises KeyError, ValueError, its own errors on damage
        raise LoadError(
            f"{path}: cannot read the PowerPoint file ({type(exc).__name__}: {exc})", path=path, reason="malformed"
        ) from exc
    pages: list[str] = []
    labels: list[str] = []
    furniture = 0

    def shape_lines(shape: Any, out: list[str]) -> int:
        """Append a shape's text lines; return the furniture lines skipped."""
        if shape.is_placeholder:
            try:
                kind = shape.placeholder_format.type
            except ValueError:
                kind = None
            if kind in furniture_types:
                return sum(
                    1 for line in (shape.text_frame.text.splitlines() if shape.has_text_frame else []) if line.strip()
                )
        if shape.shape_type == MSO_SHAPE_TYPE.GROUP:
            return sum(shape_lines(s, out) for s in _reading_order(shape.shapes))
        if shape.has_text_frame:
            for para in shape.text_frame.paragraphs:
                text = _one_line("".join(r.text for r in para.runs) or "")
                if text:
                    out.append(("  " * para.level + "- " + text) if para.level else text)
        if getattr(shape, "has_table", False) and shape.has_table:
            rows = [[_one_line(c.text) for c in row.cells] for row in shape.table.rows]
            out.extend(_table_lines(rows))
        if shape.shape_type == MSO_SHAPE_TYPE.PICTURE:
            alt = _one_line(
                shape._element.xpath("./p:nvPicPr/p:cNvPr/@descr")[0]
                if shape._element.xpath("./p:nvPicPr/p:cNvPr/@descr")
                else ""
            )
            if alt:
                out.append(f"[image: {alt}]")
        return 0

    titles: list[str] = []
    bodies: list[list[str]] = []
    notes: list[str] = []
    for slide in slides:
        lines: list[str] = []
        title = slide.shapes.title
        titles.append(_one_line(title.text_frame.text) if title is not None and title.has_text_frame else "")
        for shape in _reading_order(slide.shapes):
            if title is not None and shape.shape_id == title.shape_id:
                continue
            furniture += shape_lines(shape, lines)
        bodies.append(lines)
        frame = slide.notes_slide.notes_text_frame if slide.has_notes_slide else None
        text = frame.text.strip() if frame is not None else ""
        notes.append("Notes: " + "\n".join(_one_line(t) for t in text.splitlines() if t.strip()) if text else "")
    # Text placed by hand on most slides (a footer box, a logo's alt text) is furniture like the
    # master's: a body line on at least 3 slides and half of them is dropped. Titles and notes
    # are never judged (a deck may repeat a section title on purpose).
    per_line = Counter(line for lines in bodies for line in set(lines))
    repeated = {line for line, c in per_line.items() if c >= max(3, (len(slides) + 1) // 2)}
    for n, (title_text, lines, note) in enumerate(zip(titles, bodies, notes, strict=True), 1):
        kept = [line for line in lines if line not in repeated]
        furniture += len(lines) - len(kept)
        page = ([f"# {title_text}"] if title_text else []) + kept + ([note] if note else [])
        pages.append("\n".join(page))
        labels.append(f"slide {n}")
    return Loaded(pages, labels, meta={"slides": len(slides)}, furniture=furniture, clean=True)


def _reading_order(shapes: Any) -> list[Any]:
    """Shapes top to bottom, then left to right (XML order is z-order, not reading order)."""
    return sorted(shapes, key=lambda s: ((s.top or 0) // 20000, s.left or 0))


# --------------------------------------------------------------------------------------------------
# ODT

_NS = {
    "office": "urn:oasis:names:tc:opendocument:xmlns:office:1.0",
    "text": "urn:oasis:names:tc:opendocument:xmlns:text:1.0",
    "table": "urn:oasis:names:tc:opendocument:xmlns:table:1.0",
    "style": "urn:oasis:names:tc:opendocument:xmlns:style:1.0",
}
_T = "{" + _NS["text"] + "}"
_TB = "{" + _NS["table"] + "}"
_OFFICE = "{" + _NS["office"] + "}"


def _odf_text(el: Any) -> str:
    """The text of a paragraph-like element: ``text:s`` spaces, tabs and line breaks honoured,
    notes' bodies and annotations left out (they are not in the reading flow)."""
    parts: list[str] = []

    def walk(node: Any) -> None:
        if node.text:
            parts.append(node.text)
        for child in node:
            tag = child.tag if isinstance(child.tag, str) else ""
            if tag == _T + "s":
                parts.append(" " * int(child.get(_T + "c", "1") or 1))
            elif tag in (_T + "tab", _T + "line-break"):
                parts.append(" ")
            elif tag not in (_T + "note", _OFFICE + "annotation", _T + "bookmark-ref"):
                walk(child)  # notes, comments and bookmark references are not body text
            if child.tail:
                parts.append(child.tail)

    walk(el)
    return _one_line("".join(parts))


def read_odt(data: bytes, path: str, *, options: LoadOptions, max_bytes: int, fmt: str) -> Loaded:
    """OpenDocument text: like DOCX, one page per paragraph (``paragraph N``) or table
    (``table N``); ``text:h`` outline levels become ``#`` headings; master-page headers and
    footers (in ``styles.xml``) are counted as furniture and never read."""
    zf = open_zip(data, path, what="OpenDocument file", max_bytes=max_bytes)
    with zf:
        names = set(zf.namelist())
        if "META-INF/manifest.xml" in names and b"encryption-data" in read_member(
            zf, "META-INF/manifest.xml", path, what="OpenDocument file"
        ):
            raise LoadError(
                f"{path}: the OpenDocument file is protected by a password; save an unprotected copy to index it",
                path=path,
                reason="encrypted",
            )
        root = parse_xml(read_member(zf, "content.xml", path, what="OpenDocument file"), path, what="OpenDocument file")
        styles = (
            parse_xml(read_member(zf, "styles.xml", path, what="OpenDocument file"), path, what="OpenDocument file")
            if "styles.xml" in names
            else None
        )
    body = root.find("office:body/office:text", _NS)
    if body is None:
        raise LoadError(f"{path}: not an OpenDocument text (no office:text body)", path=path, reason="unsupported")
    pages: list[str] = []
    labels: list[str] = []
    counts = {"paragraph": 0, "table": 0}

    def add(kind: str, text: str) -> None:
        if text.strip():
            counts[kind] += 1
            pages.append(text)
            labels.append(f"{kind} {counts[kind]}")

    def walk(container: Any, depth: int = 0) -> None:
        for el in container:
            tag = el.tag if isinstance(el.tag, str) else ""
            if tag == _T + "h":
                level = min(6, max(1, int(el.get(_T + "outline-level", "1") or 1)))
                text = _odf_text(el)
                add("paragraph", "#" * level + " " + text if text else "")
            elif tag == _T + "p":
                text = _odf_text(el)
                # pandoc and LibreOffice mark a document title by paragraph style, not text:h.
                title = (el.get(_T + "style-name") or "") == "Title"
                add("paragraph", "# " + text if title and text else text)
            elif tag == _T + "list":
                for item in el.iter(_T + "list-item"):
                    for p in item:
                        if p.tag in (_T + "p", _T + "h"):
                            text = _odf_text(p)
                            add("paragraph", "- " + text if text else "")
            elif tag == _TB + "table":
                rows = [[_odf_text(c) for c in row.iter(_TB + "table-cell")] for row in el.iter(_TB + "table-row")]
                add("table", "\n".join(_table_lines(rows)))
            elif tag == _T + "section" and depth < 50:
                walk(el, depth + 1)

    walk(body)
    furniture = 0
    if styles is not None:
        for kind in ("header", "footer", "header-left", "footer-left", "header-first", "footer-first"):
            for part in styles.iter("{" + _NS["style"] + "}" + kind):
                furniture += sum(1 for p in part.iter(_T + "p") if _odf_text(p))
    return Loaded(
        pages, labels, meta={"paragraphs": counts["paragraph"], "tables": counts["table"]}, furniture=furniture
    )
