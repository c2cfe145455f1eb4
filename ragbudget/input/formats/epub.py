"""EPUB books: the zip container, its package document's spine, each spine item through the HTML
reader :mod:`ragbudget.input.html` (main text, ``#`` headings, navigation dropped)."""

from __future__ import annotations

import posixpath
from urllib.parse import unquote

from ...errors import LoadError
from ..decode import decode_bytes
from ..html import html_to_text
from ._base import Loaded, LoadOptions
from ._zip import open_zip, parse_xml, read_member

__all__ = ["read_epub"]

_CONTAINER_NS = {"c": "urn:oasis:names:tc:opendocument:xmlns:container"}
_OPF_NS = {"opf": "http://www.idpf.org/2007/opf"}
_HTML_TYPES = {"application/xhtml+xml", "text/html", "application/x-dtbook+xml"}


def read_epub(data: bytes, path: str, *, options: LoadOptions, max_bytes: int, fmt: str) -> Loaded:
    """One page per spine document with text, in reading order, labelled ``chapter N``
    (N counts the spine documents that hold text). The EPUB 3 navigation document and
    ``linear="no"`` items (pop-ups, answer keys) are left out; the chapter's first heading, if
    any, is in ``meta["chapter_titles"]``. DRM-encrypted books (``META-INF/encryption.xml``
    naming content files) are refused as ``encrypted``."""
    what = "EPUB book"
    zf = open_zip(data, path, what=what, max_bytes=max_bytes)
    with zf:
        names = set(zf.namelist())
        if "META-INF/encryption.xml" in names:
            enc = read_member(zf, "META-INF/encryption.xml", path, what=what)
            # Font obfuscation (IDPF/Adobe) also lives here and is harmless; only encrypted
            # content documents are DRM.
            if b"EncryptedData" in enc and any(ext in enc for ext in (b".xhtml", b".html", b".htm")):
                raise LoadError(
                    f"{path}: the EPUB is DRM-protected (encrypted chapters); export a DRM-free copy to index it",
                    path=path,
                    reason="encrypted",
                )
        container = parse_xml(read_member(zf, "META-INF/container.xml", path, what=what), path, what=what)
        rootfile = container.find(".//c:rootfile", _CONTAINER_NS)
        if rootfile is None or not rootfile.get("full-path"):
            raise LoadError(f"{path}: the EPUB names no package document", path=path, reason="malformed")
        opf_path = rootfile.get("full-path")
        opf = parse_xml(read_member(zf, opf_path, path, what=what), path, what=what)
        base = posixpath.dirname(opf_path)
        manifest = {}
        for item in opf.iterfind(".//opf:manifest/opf:item", _OPF_NS):
            manifest[item.get("id")] = item
        pages: list[str] = []
        labels: list[str] = []
        titles: list[str] = []
        spine = opf.findall(".//opf:spine/opf:itemref", _OPF_NS)
        if not spine:
            raise LoadError(f"{path}: the EPUB has an empty spine", path=path, reason="malformed")
        for ref in spine:
            item = manifest.get(ref.get("idref"))
            if item is None or ref.get("linear") == "no":
                continue
            if "nav" in (item.get("properties") or "").split():
                continue
            if item.get("media-type") not in _HTML_TYPES:
                continue
            href = posixpath.normpath(posixpath.join(base, unquote(item.get("href") or "")))
            markup, _, _ = decode_bytes(read_member(zf, href, path, what=what), path=path, html=True)
            try:
                text, _title = html_to_text(markup, path)
            except LoadError as exc:
                if exc.reason == "empty":
                    continue
                raise
            if not text.strip():
                continue
            pages.append(text)
            labels.append(f"chapter {len(pages)}")
            titles.append(next((ln.lstrip("#").strip() for ln in text.splitlines() if ln.startswith("#")), ""))
    # Reflowable XHTML has no running heads to strip, and the repeated-line detector would take
    # the book title off chapters that open with it: the pages are not layout pages.
    return Loaded(pages, labels, meta={"chapters": len(pages), "chapter_titles": titles})
