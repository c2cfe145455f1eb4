"""Opening the zip containers (DOCX, PPTX, ODT, EPUB) without trusting them.

A zip bomb is refused *before* anything is decompressed, from the sizes the archive declares:
too many members, a declared total over the loader's ``max_bytes``, or a member that expands more
than :data:`MAX_RATIO` times. Declared sizes can lie, but :mod:`zipfile` stops a member at its
declared size (and then fails its CRC check), so memory stays bounded by what was checked.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from typing import Any

from ...errors import LoadError

#: Most members a container may hold (a long book has a few hundred).
MAX_MEMBERS = 10_000
#: Largest expansion of one member. Text XML compresses 5-20×; a bomb's members 1000× and more.
#: Small members (under :data:`_RATIO_FLOOR` bytes) are not judged: tiny runs compress oddly.
MAX_RATIO = 200
_RATIO_FLOOR = 1 << 20

# The start of an OLE compound file: what Office writes for a *password-protected* .docx/.pptx
# (the encrypted zip sits inside an "EncryptedPackage" stream) and for the old binary .doc/.ppt.
OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"


def _ole_reason(data: bytes, path: str, what: str) -> LoadError:
    if "EncryptedPackage".encode("utf-16-le") in data:
        return LoadError(
            f"{path}: the {what} is protected by a password; save an unprotected copy to index it",
            path=path,
            reason="encrypted",
        )
    return LoadError(
        f"{path}: an old binary Office file with a {what} name; re-save it in the current format",
        path=path,
        reason="unsupported",
    )


def open_zip(data: bytes, path: str, *, what: str, max_bytes: int) -> zipfile.ZipFile:
    """Open ``data`` as a zip after the bomb checks; every failure is a one-line ``LoadError``."""
    if data.startswith(OLE_MAGIC):
        raise _ole_reason(data, path, what)
    if not data.startswith(b"PK"):
        raise LoadError(f"{path}: not a {what} (not a zip container)", path=path, reason="malformed")
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
        infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as exc:
        raise LoadError(f"{path}: damaged or truncated {what} ({exc})", path=path, reason="malformed") from exc
    check_sizes(infos, path, what=what, max_bytes=max_bytes)
    if any(info.flag_bits & 0x1 for info in infos):
        raise LoadError(
            f"{path}: the {what} is encrypted; save an unprotected copy to index it", path=path, reason="encrypted"
        )
    return zf


def check_sizes(infos: list[zipfile.ZipInfo], path: str, *, what: str, max_bytes: int) -> None:
    """Refuse archives whose declared sizes say "bomb": see the module docstring."""
    if len(infos) > MAX_MEMBERS:
        raise LoadError(
            f"{path}: {len(infos)} members in the {what} (limit {MAX_MEMBERS}); refused as a zip bomb",
            path=path,
            reason="too_large",
        )
    total = sum(i.file_size for i in infos)
    if total > max_bytes:
        raise LoadError(
            f"{path}: the {what} expands to {total} bytes, over max_bytes={max_bytes}; refused (zip bomb?)",
            path=path,
            reason="too_large",
        )
    for i in infos:
        if i.file_size > _RATIO_FLOOR and i.file_size > MAX_RATIO * max(1, i.compress_size):
            raise LoadError(
                f"{path}: member {i.filename} expands {i.file_size // max(1, i.compress_size)}× "
                f"(limit {MAX_RATIO}×); refused as a zip bomb",
                path=path,
                reason="too_large",
            )


def read_member(zf: zipfile.ZipFile, name: str, path: str, *, what: str) -> bytes:
    """One member's bytes; a missing or damaged member is a ``malformed`` LoadError."""
    try:
        return zf.read(name)
    except KeyError as exc:
        raise LoadError(f"{path}: the {what} has no {name}", path=path, reason="malformed") from exc
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, zlib.error) as exc:
        raise LoadError(f"{path}: damaged {what} member {name} ({exc})", path=path, reason="malformed") from exc


def parse_xml(data: bytes, path: str, *, what: str) -> Any:
    """Parse XML with lxml, no network, no entity expansion (billion laughs), huge trees refused.
    Returns lxml's root element (Any: lxml ships no type stubs here)."""
    import lxml.etree

    parser = lxml.etree.XMLParser(
        resolve_entities=False, no_network=True, huge_tree=False, load_dtd=False, recover=False
    )
    try:
        return lxml.etree.fromstring(data, parser)
    except lxml.etree.XMLSyntaxError as exc:
        raise LoadError(f"{path}: damaged XML in the {what} ({exc})", path=path, reason="malformed") from exc
