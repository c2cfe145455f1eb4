"""Bytes to text: byte-order marks, BOM-less UTF-16, UTF-8 (strict, then with its few bad bytes
replaced), an HTML ``<meta charset>``, else the legacy code page the text reads best in.

Binary files are refused here (``LoadError("binary")``): every format reader that holds text
(plain text, HTML, the notebook, CSV and JSON readers, an EPUB's chapters) decodes through
:func:`decode_bytes`, so an invalid byte is replaced and counted the same way everywhere.
"""

from __future__ import annotations

import codecs
import contextlib
import re
from dataclasses import dataclass

from ..errors import LoadError

__all__ = ["Decoded", "decode", "decode_bytes"]

# Bytes inspected for binary detection and BOM-less UTF-16: enough to see past a short header.
_HEAD = 8192
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),  # before UTF-16 LE: it starts with the same two bytes
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
_ESCAPED = re.compile("[\udc80-\udcff]")
_UTF8_MULTIBYTE = re.compile(rb"[\xc2-\xf4][\x80-\xbf]+")
_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
# Single-byte code pages that tie on the same bytes; charset-normalizer ranks ties arbitrarily
# (it calls Windows-1252 French "cp775"), so the most common Western page wins a tie.
_PREFERRED_TIES = ("cp1252", "latin_1", "iso8859_15", "cp1250")
# Control bytes that never occur in text (NUL, and C0 controls other than \t \n \v \f \r \x1b).
_BINARY_BYTES = bytes(b for b in range(32) if b not in (8, 9, 10, 11, 12, 13, 27))


def _bomless_utf16(head: bytes) -> str | None:
    """Guess UTF-16 without a BOM from the NUL pattern of ASCII-heavy text."""
    if len(head) < 4:
        return None
    even, odd = head[0::2], head[1::2]
    nul_even, nul_odd = even.count(0) / len(even), odd.count(0) / len(odd)
    if nul_odd > 0.4 and nul_even < 0.05:
        return "utf-16-le"
    if nul_even > 0.4 and nul_odd < 0.05:
        return "utf-16-be"
    return None


def _decode_counting(data: bytes, encoding: str) -> tuple[str, int]:
    """Decode; each undecodable byte becomes U+FFFD and is counted (never silently dropped)."""
    text = data.decode(encoding, errors="surrogateescape")
    replaced = len(_ESCAPED.findall(text))
    if replaced:
        text = _ESCAPED.sub("\ufffd", text)
    return text, replaced


@dataclass(frozen=True)
class Decoded:
    """Text decoded from a file's bytes: ``encoding`` used, ``replaced`` invalid bytes (each now
    U+FFFD), and whether the encoding was ``guessed`` (no BOM, not UTF-8, no charset declared)."""

    text: str
    encoding: str
    replaced: int
    guessed: bool


def decode_bytes(data: bytes, *, path: str = "", html: bool = False) -> tuple[str, str, int]:
    """Decode file bytes to ``(text, encoding, replaced_chars)`` or raise ``LoadError("binary")``.

    Order: byte-order mark (UTF-8/16/32); BOM-less UTF-16 by NUL pattern; strict UTF-8; UTF-8 with
    replacements when the bytes hold real multi-byte UTF-8 sequences (a mostly-UTF-8 file with a
    few bad bytes); an HTML ``<meta charset>``; then a legacy code page: cp1252 (latin-1 when
    cp1252 leaves a byte undefined) unless charset-normalizer finds text that reads clearly
    better in another one (Cyrillic, Greek, Central European...). Every invalid byte becomes
    U+FFFD and is counted in ``replaced_chars``. :func:`~ragbudget.input.loaders.load_document` records a guessed
    encoding or replaced bytes as ``meta["encoding_warning"]``.

    >>> decode_bytes("café".encode("utf-16"))[1:]
    ('utf-16-le', 0)
    >>> decode_bytes(b"ok \\xff\\xfe caf\\xc3\\xa9")
    ('ok \\ufffd\\ufffd café', 'utf-8', 2)
    >>> decode_bytes("Zürich café".encode("cp1252"))[1:]
    ('cp1252', 0)
    """
    d = decode(data, path=path, html=html)
    return d.text, d.encoding, d.replaced


def decode(data: bytes, *, path: str = "", html: bool = False) -> Decoded:
    """:func:`decode_bytes` as a :class:`Decoded` record, which also says whether the encoding was
    guessed (what :func:`~ragbudget.input.loaders.load_document` warns about).

    >>> decode("Zürich".encode("cp1252")).guessed, decode(b"plain").guessed
    (True, False)
    """
    for bom, enc in _BOMS:
        if data.startswith(bom):
            text, replaced = _decode_counting(data[len(bom) :], enc)
            return Decoded(text, enc, replaced, False)
    head = data[:_HEAD]
    utf16 = _bomless_utf16(head)
    if utf16:
        text, replaced = _decode_counting(data, utf16)
        return Decoded(text, utf16, replaced, False)
    if b"\x00" in head:
        raise LoadError(
            f"{path}: looks binary (NUL bytes in the first {_HEAD} bytes); binary files are read "
            "only in the formats listed in the README - exclude it or convert it to text",
            path=path,
            reason="binary",
        )
    controls = sum(head.count(bytes([b])) for b in _BINARY_BYTES)
    if head and controls > 0.1 * len(head):
        raise LoadError(
            f"{path}: looks binary ({controls} control bytes in the first {len(head)} bytes)",
            path=path,
            reason="binary",
        )
    with contextlib.suppress(UnicodeDecodeError):
        return Decoded(data.decode("utf-8"), "utf-8", 0, False)
    if _UTF8_MULTIBYTE.search(data):
        text, replaced = _decode_counting(data, "utf-8")
        return Decoded(text, "utf-8", replaced, False)
    if html:
        m = _META_CHARSET.search(head)
        if m:
            # An unknown or lying <meta charset> falls through to detection.
            with contextlib.suppress(LookupError, UnicodeError):
                enc = codecs.lookup(m.group(1).decode("ascii")).name
                text, replaced = _decode_counting(data, enc)
                return Decoded(text, enc, replaced, False)
    enc = _guess_legacy(data)
    text, replaced = _decode_counting(data, enc)
    return Decoded(text, enc, replaced, True)


# How much worse than the detector's best guess the Western reading may look (charset-normalizer's
# "mess" ratio, 0 = clean) and still win: short or plain texts give the detector almost nothing,
# and it then ranks exotic pages (mac_latin2, cp775, even UTF-16) level with cp1252, which turned
# "café" into "cafť". Text really written in another page reads far messier as cp1252 (Russian
# in cp1251 scores > 0.3, Polish in cp1250 > 1), so the margin only settles near-ties.
_WESTERN_MARGIN = 0.02
# Mess is measured on the start of the text: enough to judge, bounded for big files.
_MESS_SAMPLE = 65536


def _guess_legacy(data: bytes) -> str:
    """The code page of text that is not UTF-8: cp1252 (latin-1 if cp1252 leaves a byte
    undefined) unless the detector's best guess reads clearly cleaner."""
    try:
        western, text = "cp1252", data.decode("cp1252")
    except UnicodeDecodeError:
        western, text = "latin_1", data.decode("latin-1")
    try:
        import charset_normalizer
        from charset_normalizer.md import mess_ratio
    except ImportError:  # optional in spirit: the commonest legacy page
        return western
    # UTF-16/32 without a BOM was ruled out by the NUL-pattern test before we got here.
    matches = [
        m
        for m in charset_normalizer.from_bytes(data)
        if not codecs.lookup(m.encoding).name.startswith(("utf_16", "utf_32"))
    ]
    if not matches:
        return western
    best = min(m.chaos for m in matches)
    if mess_ratio(text[:_MESS_SAMPLE], 1.0) <= best + _WESTERN_MARGIN:
        return western
    tied = {codecs.lookup(m.encoding).name for m in matches if m.chaos <= best + 1e-9}
    for enc in _PREFERRED_TIES:
        if codecs.lookup(enc).name in tied:
            return codecs.lookup(enc).name
    return codecs.lookup(min(matches, key=lambda m: m.chaos).encoding).name
