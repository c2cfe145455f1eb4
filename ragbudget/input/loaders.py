"""Loading documents from disk: folder walking, decoding, pagination, format readers.

One job: files in, :class:`~ragbudget.types.Document` records out (walking, decoding and the
built-in readers share the skip reasons and the load options).

Three entry points:

* :func:`scan` walks files and folders and says which files can be loaded (:class:`FileInfo`) and
  which were skipped and why (:class:`Skipped`). It only ``stat``\\ s, so a FIFO never blocks it.
* :func:`load_document` reads one file into a :class:`~ragbudget.types.Document` (pages + meta),
  or raises :class:`~ragbudget.errors.LoadError` with a ``reason`` tag.
* :func:`iter_documents` does both for a folder, turning load errors into :class:`Skipped`, and
  strips boilerplate repeated across the corpus (:class:`BoilerplateFilter`).

Formats: ``.txt``/``.text``, ``.md``/``.markdown``, ``.rst``, ``.html``/``.htm``/``.xhtml``, ``.pdf``
here; ``.docx``, ``.pptx``, ``.odt``, ``.epub``, ``.ipynb``, ``.csv``/``.tsv``, ``.json``/``.jsonl``,
``.eml``/``.mbox`` through :mod:`ragbudget.input.formats` (one page per slide, cell, row block, chapter,
message..., named in ``meta["page_labels"]``); any of these gzip-compressed (``notes.md.gz``).

``LoadError.reason`` tags: ``binary``, ``too_large``, ``unreadable`` (permission or I/O error),
``empty``, ``encrypted``, ``malformed``, ``unsupported``, ``missing_dependency`` (an optional
library such as python-docx is not installed; the message names the extra). :class:`Skipped` reasons from :func:`scan`
add ``missing``, ``hidden``, ``ignored`` (VCS/cache folders, another index's folder), ``excluded`` (include/exclude
globs), ``special`` (FIFO, socket, device), ``symlink`` (links not followed), ``symlink_loop``,
``outside_root``, ``broken_link`` and ``duplicate`` (a file already reached by another path).

>>> import pathlib, tempfile
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> _ = (folder / "a.md").write_text("# Title\\n\\nSome text.\\n")
>>> _ = (folder / "logo.png").write_bytes(b"\\x89PNG\\r\\n")
>>> result = scan(folder)
>>> [f.rel for f in result.files], [(s.rel, s.reason) for s in result.skipped]
(['a.md'], [('logo.png', 'unsupported')])
>>> load_document(result.files[0].path).text
'# Title\\n\\nSome text.'
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import fnmatch
import gzip
import os
import re
import stat
import zlib
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ConfigError, LoadError
from ..types import DEFAULT_INDEX_DIR, Document
from .clean import apply_report, edge_keys, find_furniture, find_known
from .formats import FORMATS as _CONTAINER_FORMATS, LoadOptions, current_options

__all__ = [
    "DEFAULT_MAX_BYTES",
    "IGNORED_DIRS",
    "LOAD_ERROR_REASONS",
    "SCAN_SKIP_REASONS",
    "SUPPORTED_EXTENSIONS",
    "BoilerplateFilter",
    "FileInfo",
    "ScanResult",
    "Skipped",
    "decode_bytes",
    "iter_documents",
    "load_document",
    "paginate_text",
    "scan",
    "strip_corpus_boilerplate",
]

#: Files larger than this (bytes on disk, or decompressed for ``.gz``) are skipped as ``too_large``.
DEFAULT_MAX_BYTES = 50 * 1024 * 1024

_FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".rst": "rst",
    ".html": "html",
    ".htm": "html",
    ".xhtml": "html",
    ".pdf": "pdf",
    **_CONTAINER_FORMATS,
}
#: File name endings :func:`load_document` reads (each also with ``.gz`` appended).
SUPPORTED_EXTENSIONS = frozenset(_FORMATS)
#: Folder names never walked into (besides any name starting with a dot).
IGNORED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", "node_modules", DEFAULT_INDEX_DIR})

#: ``LoadError.reason`` values raised by :func:`load_document`.
LOAD_ERROR_REASONS = frozenset(
    {"binary", "too_large", "unreadable", "empty", "encrypted", "malformed", "unsupported", "missing_dependency"}
)
#: Extra :class:`Skipped` reasons produced by :func:`scan` itself.
SCAN_SKIP_REASONS = frozenset(
    {
        "missing",
        "hidden",
        "ignored",
        "excluded",
        "unsupported",
        "too_large",
        "special",
        "symlink",
        "symlink_loop",
        "outside_root",
        "broken_link",
        "duplicate",
        "unreadable",
    }
)

# Bytes inspected for binary detection and BOM-less UTF-16: enough to see past a short header.
_HEAD = 8192
# Fixed page lengths tried for text without form feeds: 66 is nroff/groff's default (11 in at
# 6 lines per inch), the others cover A4 and common printer settings.
_FIXED_PAGE_LENGTHS = (66, 72, 64, 60)


# --------------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class FileInfo:
    """A loadable file found by :func:`scan`.

    ``path`` is the resolved real path (the file's identity: the same file reached through two
    links is listed once); ``rel`` is the path as walked, relative to the scanned root (POSIX
    separators), for display and include/exclude matching.
    """

    path: str
    size: int
    mtime_ns: int
    rel: str = ""


@dataclass(frozen=True)
class Skipped:
    """A file or folder that was not loaded: ``reason`` is a short tag, ``detail`` says why.

    >>> str(Skipped(path="/d/x.bin", reason="binary", detail="NUL bytes in the first 8 KiB"))
    '/d/x.bin: binary (NUL bytes in the first 8 KiB)'
    """

    path: str
    reason: str
    detail: str = ""
    rel: str = ""

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" + (f" ({self.detail})" if self.detail else "")

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "rel": self.rel, "reason": self.reason, "detail": self.detail}


@dataclass(frozen=True)
class ScanResult:
    """What :func:`scan` found: loadable ``files`` (in walk order) and ``skipped`` entries."""

    files: list[FileInfo] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


# --------------------------------------------------------------------------------------------------
# scanning


def _format_of(name: str) -> tuple[str, bool] | None:
    """``(format, gzipped)`` from a file name, or None when unsupported."""
    lower = name.lower()
    gz = lower.endswith(".gz")
    if gz:
        lower = lower[:-3]
    fmt = _FORMATS.get(os.path.splitext(lower)[1])
    return (fmt, gz) if fmt else None


def _as_list(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    return [os.fspath(p) for p in paths]


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _matches(rel: str, patterns: Sequence[str]) -> bool:
    # fnmatch's "*" also matches "/", so "*.md" selects Markdown files at any depth; a pattern is
    # also tried against the bare file name so "README*" works without a leading "*/".
    base = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(rel, p) or fnmatch.fnmatchcase(base, p) for p in patterns)


# What marks a ragbudget index folder (ragbudget.retrieval.index's layout): its manifest, its writer's lock
# and a generation's SQLite file. A folder holding all three is another index (the one being
# written is left out by ``leave_out``): its files are the index's, never documents.
_INDEX_MARKS = ("manifest.json", "lock")
_INDEX_GENERATION = re.compile(r"meta\.\d+\.sqlite")


def _is_index_folder(entries: Sequence[os.DirEntry[str]]) -> bool:
    names = {e.name for e in entries}
    return all(m in names for m in _INDEX_MARKS) and any(_INDEX_GENERATION.fullmatch(n) for n in names)


def _inside(path: str, st: os.stat_result, folders: set[tuple[int, int]]) -> bool:
    """Whether ``path`` (stat ``st``) is one of ``folders`` or lies below one (by device, inode)."""
    if (st.st_dev, st.st_ino) in folders:
        return True
    parent = os.path.realpath(path)
    while True:
        up = os.path.dirname(parent)
        if up == parent:
            return False
        parent = up
        with contextlib.suppress(OSError):
            pst = os.stat(parent)
            if (pst.st_dev, pst.st_ino) in folders:
                return True


def scan(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    follow_symlinks: bool = True,
    leave_out: Iterable[str | os.PathLike[str]] = (),
) -> ScanResult:
    """Walk files and folders; list loadable files and everything skipped, with reasons.

    Folders are walked depth-first in name order (deterministic). Hidden entries (name starting
    with ``.``) and :data:`IGNORED_DIRS` are skipped. Symbolic links are followed only when they
    stay inside the scanned root and do not loop. Nothing is opened: FIFOs, sockets and devices
    are recognised by ``stat`` and skipped as ``special``. ``include``/``exclude`` are glob lists
    matched (``fnmatch``) on the path relative to the root and on the file name; a file must match
    one ``include`` pattern (when given) and no ``exclude`` pattern. The folders in ``leave_out``
    (an index's own folder, wherever it lies) are walked past without a word: neither read nor
    listed as skipped, whatever path or link leads to them; any other ragbudget index folder met
    is skipped as ``ignored``.

    >>> scan([]).files
    []
    """
    if max_bytes <= 0:
        raise ConfigError(f"max_bytes must be positive, got {max_bytes}; pass e.g. 50*1024*1024")
    include = list(include) if include else None
    exclude = list(exclude or ())
    files: list[FileInfo] = []
    skipped: list[Skipped] = []
    seen_files: set[str] = set()
    # Folders are told apart by (device, inode): no spelling of the path, relative or through a
    # link, reaches them. One stat per folder met, none per file.
    own: set[tuple[int, int]] = set()
    for folder in leave_out:
        with contextlib.suppress(OSError):
            st = os.stat(folder)
            own.add((st.st_dev, st.st_ino))

    def left_out(entry: os.DirEntry[str]) -> bool:
        try:
            if not entry.is_dir():
                return False
            st = entry.stat()
        except OSError:
            return False
        return (st.st_dev, st.st_ino) in own

    def skip(path: str, rel: str, reason: str, detail: str = "") -> None:
        skipped.append(Skipped(path=path, reason=reason, detail=detail, rel=rel))

    def consider_file(path: str, rel: str, st: os.stat_result) -> None:
        if include is not None and not _matches(rel, include):
            skip(path, rel, "excluded", "matches no include pattern")
            return
        if exclude and _matches(rel, exclude):
            skip(path, rel, "excluded", "matches an exclude pattern")
            return
        if _format_of(os.path.basename(path)) is None:
            ext = os.path.splitext(path)[1] or "(no extension)"
            skip(path, rel, "unsupported", f"extension {ext}")
            return
        if st.st_size > max_bytes:
            skip(path, rel, "too_large", f"{st.st_size} bytes > max_bytes={max_bytes}")
            return
        real = os.path.realpath(path)
        if real in seen_files:
            skip(path, rel, "duplicate", f"same file as {real}")
            return
        seen_files.add(real)
        files.append(FileInfo(path=real, size=st.st_size, mtime_ns=st.st_mtime_ns, rel=rel))

    def walk(dir_path: str, rel_dir: str, real_root: str, ancestors: tuple[str, ...]) -> None:
        try:
            with os.scandir(dir_path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            skip(dir_path, rel_dir or ".", "unreadable", exc.strerror or str(exc))
            return
        if _is_index_folder(entries):
            skip(dir_path, rel_dir or ".", "ignored", "a ragbudget index folder")
            return
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            path = os.path.join(dir_path, entry.name)
            if own and left_out(entry):
                continue
            if entry.name in IGNORED_DIRS:
                skip(path, rel, "ignored", "VCS or cache folder")
                continue
            if entry.name.startswith("."):
                skip(path, rel, "hidden")
                continue
            # An excluded name is dropped before anything else is asked of it (a link pointing
            # outside the root that the user excluded is not worth a warning).
            if exclude and (_matches(rel, exclude) or _matches(rel + "/", exclude)):
                skip(path, rel, "excluded", "matches an exclude pattern")
                continue
            is_link = entry.is_symlink()
            if is_link and not follow_symlinks:
                skip(path, rel, "symlink", "follow_symlinks=False")
                continue
            try:
                st = os.stat(path)  # follows links; never opens, so FIFOs cannot block
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    skip(path, rel, "symlink_loop", "link resolves to itself")
                elif is_link:
                    skip(path, rel, "broken_link", f"target missing: {os.readlink(path)}")
                else:
                    skip(path, rel, "unreadable", exc.strerror or str(exc))
                continue
            if is_link:
                real = os.path.realpath(path)
                if not _within(real, real_root):
                    skip(path, rel, "outside_root", f"link to {real}")
                    continue
                if stat.S_ISDIR(st.st_mode) and real in ancestors:
                    skip(path, rel, "symlink_loop", f"link to enclosing folder {real}")
                    continue
            if stat.S_ISDIR(st.st_mode):
                # A folder matching an exclude pattern ("build", "drafts/") is pruned whole
                # instead of listing every file below it as excluded.
                if exclude and (_matches(rel, exclude) or _matches(rel + "/", exclude)):
                    skip(path, rel, "excluded", "folder matches an exclude pattern")
                    continue
                real = os.path.realpath(path)
                if real in visited_dirs:
                    skip(path, rel, "duplicate", f"folder already walked as {real}")
                    continue
                visited_dirs.add(real)
                walk(path, rel, real_root, ancestors + (real,))
            elif stat.S_ISREG(st.st_mode):
                consider_file(path, rel, st)
            else:
                skip(path, rel, "special", "FIFO, socket or device")

    visited_dirs: set[str] = set()
    for root in _as_list(paths):
        try:
            st = os.stat(root)
        except OSError as exc:
            reason = "symlink_loop" if exc.errno == errno.ELOOP else "missing"
            skip(root, os.path.basename(root), reason, exc.strerror or str(exc))
            continue
        if own and _inside(root, st, own):
            continue
        if stat.S_ISDIR(st.st_mode):
            real_root = os.path.realpath(root)
            if real_root in visited_dirs:
                continue
            visited_dirs.add(real_root)
            walk(root, "", real_root, (real_root,))
        elif stat.S_ISREG(st.st_mode):
            consider_file(root, os.path.basename(root), st)
        else:
            skip(root, os.path.basename(root), "special", "FIFO, socket or device")
    return ScanResult(files=files, skipped=skipped)


# --------------------------------------------------------------------------------------------------
# decoding

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


def decode_bytes(data: bytes, *, path: str = "", html: bool = False) -> tuple[str, str, int]:
    """Decode file bytes to ``(text, encoding, replaced_chars)`` or raise ``LoadError("binary")``.

    Order: byte-order mark (UTF-8/16/32); BOM-less UTF-16 by NUL pattern; strict UTF-8; UTF-8 with
    replacements when the bytes hold real multi-byte UTF-8 sequences (a mostly-UTF-8 file with a
    few bad bytes); an HTML ``<meta charset>``; then a legacy code page: cp1252 (latin-1 when
    cp1252 leaves a byte undefined) unless charset-normalizer finds text that reads clearly
    better in another one (Cyrillic, Greek, Central European...). Every invalid byte becomes
    U+FFFD and is counted in ``replaced_chars``. :func:`load_document` records a guessed
    encoding or replaced bytes as ``meta["encoding_warning"]``.

    >>> decode_bytes("café".encode("utf-16"))[1:]
    ('utf-16-le', 0)
    >>> decode_bytes(b"ok \\xff\\xfe caf\\xc3\\xa9")
    ('ok \\ufffd\\ufffd café', 'utf-8', 2)
    >>> decode_bytes("Zürich café".encode("cp1252"))[1:]
    ('cp1252', 0)
    """
    text, encoding, replaced, _ = _decode(data, path=path, html=html)
    return text, encoding, replaced


def _decode(data: bytes, *, path: str, html: bool) -> tuple[str, str, int, bool]:
    """:func:`decode_bytes`, and whether the encoding was guessed (no BOM, not UTF-8, no charset
    declared)."""
    for bom, enc in _BOMS:
        if data.startswith(bom):
            text, replaced = _decode_counting(data[len(bom) :], enc)
            return text, enc, replaced, False
    head = data[:_HEAD]
    utf16 = _bomless_utf16(head)
    if utf16:
        text, replaced = _decode_counting(data, utf16)
        return text, utf16, replaced, False
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
        return data.decode("utf-8"), "utf-8", 0, False
    if _UTF8_MULTIBYTE.search(data):
        text, replaced = _decode_counting(data, "utf-8")
        return text, "utf-8", replaced, False
    if html:
        m = _META_CHARSET.search(head)
        if m:
            # An unknown or lying <meta charset> falls through to detection.
            with contextlib.suppress(LookupError, UnicodeError):
                enc = codecs.lookup(m.group(1).decode("ascii")).name
                text, replaced = _decode_counting(data, enc)
                return text, enc, replaced, False
    enc = _guess_legacy(data)
    text, replaced = _decode_counting(data, enc)
    return text, enc, replaced, True


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


# --------------------------------------------------------------------------------------------------
# pagination and text normalisation

_CONTROL = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f]")


def _normalise(text: str) -> str:
    """Newlines to ``\\n``, control characters out, trailing spaces off each line."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    return "\n".join(line.rstrip() for line in text.split("\n"))


def _trim_page(page: str) -> str:
    # Blank lines at a page's edges are layout padding (groff pads to 66 lines); inner blank
    # lines separate paragraphs and stay.
    return page.strip("\n")


def paginate_text(text: str) -> tuple[list[str], bool]:
    """Split plain text into pages: at form feeds, or at a detected fixed page length.

    Returns ``(pages, paginated)``. A final form feed does not start an empty page. Without form
    feeds, text whose line count is a whole number of 66/72/64/60-line pages is split that way
    when the split pages share a running header or footer (man pages rendered without ``\\f``).

    >>> paginate_text("one\\fthree\\f")
    (['one', 'three'], True)
    >>> paginate_text("no pages")
    (['no pages'], False)
    """
    if "\f" in text:
        pages = text.split("\f")
        if len(pages) > 1 and not pages[-1].strip():
            pages.pop()
        return pages, True
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for length in _FIXED_PAGE_LENGTHS:
        n_pages, rest = divmod(len(lines), length)
        if n_pages < 3 or rest:
            continue
        pages = ["\n".join(lines[i : i + length]) for i in range(0, len(lines), length)]
        # Accept the split only if it explains the layout: most pages then have furniture.
        per_page = find_furniture(pages).per_page
        if sum(1 for c in per_page if c) >= 2 / 3 * n_pages:
            return pages, True
    return [text], False


# --------------------------------------------------------------------------------------------------
# format readers

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


def _html_to_text(markup: str, path: str) -> tuple[str, str]:
    """Main text of an HTML page as Markdown-ish lines: ``# Heading``, ``- item``, paragraphs."""
    import lxml.etree
    import lxml.html

    markup = _XML_DECL.sub("", markup)
    if not markup.strip():
        raise LoadError(f"{path}: the HTML file has no content", path=path, reason="empty")
    try:
        root = lxml.html.document_fromstring(markup)
    except (lxml.etree.ParserError, ValueError) as exc:
        raise LoadError(f"{path}: cannot parse HTML ({exc})", path=path, reason="malformed") from exc
    title_el = root.find(".//title")
    title = " ".join((title_el.text_content() if title_el is not None else "").split())
    # Main content: the single <main>, else the single <article>, else <body>.
    body = root.find(".//body")
    container = body if body is not None else root
    for tag in ("main", "article"):
        found = root.findall(f".//{tag}")
        if len(found) == 1:
            container = found[0]
            break

    lines: list[str] = []
    buf: list[str] = []

    def flush() -> None:
        text = " ".join("".join(buf).split())
        buf.clear()
        if text and text != "-":
            lines.append(text)

    def block_break() -> None:
        flush()
        if lines and lines[-1] != "":
            lines.append("")

    def walk(el: Any, in_article: bool) -> None:
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
            block_break()
            text = " ".join(el.text_content().split())
            if text:
                lines.append("#" * _HEADINGS[tag] + " " + text)
                lines.append("")
        elif tag == "pre":
            block_break()
            lines.append(el.text_content().strip("\n"))
            lines.append("")
        elif tag == "br":
            flush()
        elif tag in _BLOCK_TAGS:
            if tag == "li":  # list items stay on consecutive lines
                flush()
                buf.append("- ")
            else:
                block_break()
            if el.text:
                buf.append(el.text)
            inner = in_article or tag in ("article", "main")
            for child in el:
                walk(child, inner)
            block_break() if tag != "li" else flush()
        else:
            if tag in ("td", "th") and buf:
                buf.append(" | ")
            if el.text:
                buf.append(el.text)
            for child in el:
                walk(child, in_article)
        if el.tail:
            buf.append(el.tail)

    try:
        walk(container, container.tag in ("article", "main"))
    except RecursionError as exc:  # thousands of nested elements: hostile or broken markup
        raise LoadError(f"{path}: HTML nested too deeply to read", path=path, reason="malformed") from exc
    flush()
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    if text and title and not any(line.startswith("#") for line in lines):
        text = f"# {title}\n\n{text}"
    return text, title


def _pdf_pages(data: bytes, path: str) -> list[str]:
    """Per-page text of a PDF with pypdfium2; encrypted or damaged files raise LoadError."""
    import pypdfium2

    if b"%PDF-" not in data[:1024]:
        raise LoadError(f"{path}: not a PDF (no %PDF- header)", path=path, reason="malformed")
    # A file cut short loses its trailer; pdfium may still "repair" it and return partial text
    # silently, so a missing end-of-file marker is treated as damage rather than guessed around.
    if b"%%EOF" not in data[-4096:]:
        raise LoadError(
            f"{path}: the PDF is truncated (no %%EOF marker at the end); re-download or re-export it",
            path=path,
            reason="malformed",
        )
    try:
        pdf = pypdfium2.PdfDocument(data)
    except pypdfium2.PdfiumError as exc:
        if "password" in str(exc).lower():
            raise LoadError(
                f"{path}: the PDF is encrypted with a password; decrypt it (e.g. qpdf --decrypt) before indexing",
                path=path,
                reason="encrypted",
            ) from exc
        raise LoadError(f"{path}: cannot open the PDF ({exc})", path=path, reason="malformed") from exc
    try:
        if len(pdf) == 0:
            raise LoadError(f"{path}: the PDF has no pages", path=path, reason="malformed")
        pages = []
        for i in range(len(pdf)):
            page = pdf[i]
            textpage = page.get_textpage()
            # pdfium marks a hyphen it removed at a line break as U+FFFE; the word is rejoined.
            pages.append(textpage.get_text_range().replace("\ufffe", ""))
            textpage.close()
            page.close()
        return pages
    except pypdfium2.PdfiumError as exc:
        raise LoadError(f"{path}: damaged PDF page ({exc})", path=path, reason="malformed") from exc
    finally:
        pdf.close()


def _read(path: str, max_bytes: int) -> tuple[bytes, os.stat_result, bool]:
    """File bytes (decompressed for ``.gz``, at most ``max_bytes``), its stat, and gz flag."""
    try:
        st = os.stat(path)
    except FileNotFoundError as exc:
        raise LoadError(f"{path}: no such file", path=path, reason="unreadable") from exc
    except OSError as exc:
        raise LoadError(f"{path}: cannot stat ({exc.strerror})", path=path, reason="unreadable") from exc
    if not stat.S_ISREG(st.st_mode):
        raise LoadError(
            f"{path}: not a regular file (folder, FIFO, socket or device)",
            path=path,
            reason="unsupported",
        )
    if st.st_size > max_bytes:
        raise LoadError(
            f"{path}: {st.st_size} bytes is over max_bytes={max_bytes}; raise max_bytes or split it",
            path=path,
            reason="too_large",
        )
    gz = path.lower().endswith(".gz")
    try:
        with open(path, "rb") as fh:
            if not gz:
                return fh.read(), st, gz
            # Read at most max_bytes + 1 decompressed bytes: a gzip bomb stops here.
            with gzip.GzipFile(fileobj=fh) as zf:
                data = zf.read(max_bytes + 1)
    except PermissionError as exc:
        raise LoadError(
            f"{path}: permission denied; make it readable (chmod +r) or exclude it",
            path=path,
            reason="unreadable",
        ) from exc
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise LoadError(f"{path}: damaged gzip data ({exc})", path=path, reason="malformed") from exc
    except OSError as exc:
        raise LoadError(f"{path}: read error ({exc.strerror or exc})", path=path, reason="unreadable") from exc
    if len(data) > max_bytes:
        raise LoadError(f"{path}: decompresses to more than max_bytes={max_bytes}", path=path, reason="too_large")
    return data, st, gz


def load_document(
    path: str | os.PathLike[str],
    *,
    clean: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    boilerplate: Collection[str] = (),
    trust_page_numbers: bool = False,
    options: LoadOptions | None = None,
) -> Document:
    """Read one file into a :class:`~ragbudget.types.Document`.

    ``pages`` are the PDF pages, form-feed pages, or detected fixed-length pages of plain text
    (one page otherwise). With ``clean=True`` running headers, footers and page numbers are
    removed by :func:`~ragbudget.input.clean.strip_headers_footers` (``boilerplate``: corpus-wide
    line keys from :meth:`BoilerplateFilter.patterns`, removed at page edges too). ``meta`` holds
    ``format``, ``encoding``, ``replaced_chars``, ``paginated``, ``n_pages``, ``size``, ``mtime``, ``mtime_ns``,
    ``compressed``, ``furniture_removed``, ``furniture_patterns``, for HTML ``title``, and
    ``encoding_warning`` when the text encoding was guessed or bytes had to be replaced.
    Formats read by :mod:`ragbudget.input.formats` add ``page_labels`` (one per page: ``slide 3``,
    ``cell 12``, ``rows 41-60``...), ``layout`` (False when pages are records that the
    header/footer detector must not touch) and their own counts. A PDF adds
    ``pages_without_text`` (and ``ocr_pages`` with ``options.ocr``). One-line notes for the index
    summary are in ``warnings`` (also joined into ``encoding_warning``, the key the index shows).
    ``options`` (:class:`~ragbudget.input.formats.LoadOptions`) defaults to the one set by
    :func:`~ragbudget.input.formats.load_options`.

    Raises :class:`~ragbudget.errors.LoadError` with ``reason`` in ``binary``, ``too_large``,
    ``unreadable``, ``empty``, ``encrypted``, ``malformed``, ``unsupported``.

    >>> import tempfile, os
    >>> fd, name = tempfile.mkstemp(suffix=".txt"); os.close(fd)
    >>> _ = open(name, "w").write("page one\\fpage two\\f")
    >>> doc = load_document(name)
    >>> doc.pages, doc.meta["paginated"], doc.meta["encoding"]
    (['page one', 'page two'], True, 'utf-8')
    """
    spath = os.fspath(path)
    kind = _format_of(os.path.basename(spath))
    if kind is None:
        raise LoadError(
            f"{spath}: unsupported file type; supported: "
            + ", ".join(sorted(SUPPORTED_EXTENSIONS))
            + " (optionally .gz)",
            path=spath,
            reason="unsupported",
        )
    fmt, _ = kind
    data, st, gz = _read(spath, max_bytes)
    if not data.strip():
        raise LoadError(f"{spath}: the file is empty", path=spath, reason="empty")

    opts = options if options is not None else current_options()
    meta: dict[str, Any] = {"format": fmt, "compressed": gz}
    warnings: list[str] = []
    furniture_by_format = 0
    layout = True  # pages are layout pages: run the repeated-line (furniture) detector on them
    if fmt == "pdf":
        raw_pages = _pdf_pages(data, spath)
        meta.update(encoding="pdf", replaced_chars=0, paginated=True)
        raw_pages = _text_layer_check(raw_pages, data, spath, opts, meta, warnings)
    elif fmt in _CONTAINER_FORMATS.values():
        from . import formats

        loaded = formats.read(fmt, data, spath, options=opts, max_bytes=max_bytes)
        raw_pages, layout, furniture_by_format = loaded.pages, loaded.clean, loaded.furniture
        warnings.extend(loaded.warnings)
        meta.update(loaded.meta)
        meta.update(paginated=True, page_labels=list(loaded.labels), layout=layout)
        meta.setdefault("encoding", "utf-8")
        meta.setdefault("replaced_chars", 0)
    else:
        text, encoding, replaced, guessed = _decode(data, path=spath, html=fmt == "html")
        meta.update(encoding=encoding, replaced_chars=replaced)
        notes = []
        if guessed:
            notes.append(f"not UTF-8: decoded as {encoding} (a guess; save it as UTF-8 to be sure)")
        if replaced:
            notes.append(f"{replaced} undecodable byte(s) replaced by U+FFFD")
        if notes:
            meta["encoding_warning"] = "; ".join(notes)
        if fmt == "html":
            text, title = _html_to_text(text, spath)
            meta["title"] = title
            raw_pages, meta["paginated"] = [text], False
        else:
            raw_pages, meta["paginated"] = paginate_text(text)

    pages = [_normalise(p) for p in raw_pages]
    removed: int = 0
    patterns: tuple[str, ...] = ()
    if clean and layout:
        report = find_furniture(pages, trust_page_numbers=trust_page_numbers)
        pages = apply_report(pages, report)
        removed, patterns = report.removed, report.patterns
        if boilerplate:
            extra = find_known(pages, boilerplate)
            pages = apply_report(pages, extra)
            meta["boilerplate_removed"] = extra.removed
            meta["boilerplate_patterns"] = list(extra.patterns)
    pages = [_trim_page(p) for p in pages]
    if not any(p.strip() for p in pages):
        if fmt == "pdf":
            detail = (
                f"no text layer on any of its {len(pages)} page(s): a scanned PDF; index it "
                "with OCR (ragbudget index --ocr, needs ragbudget[ocr] and tesseract-ocr)"
            )
        else:
            detail = "no text"
        raise LoadError(f"{spath}: {detail}", path=spath, reason="empty")
    meta.update(
        n_pages=len(pages),
        size=st.st_size,
        mtime=st.st_mtime,
        mtime_ns=st.st_mtime_ns,
        furniture_removed=removed + furniture_by_format,
        furniture_patterns=list(patterns),
    )
    if warnings:
        meta["warnings"] = warnings
        # The index surfaces ``encoding_warning`` as the file's one warning today; until it reads
        # ``warnings`` too, load warnings ride along there so the summary shows them.
        meta["encoding_warning"] = "; ".join(
            ([meta["encoding_warning"]] if meta.get("encoding_warning") else []) + warnings
        )
    return Document(path=spath, pages=pages, meta=meta)


def _pages_have(n: int, total: int) -> str:
    """``"1 of 114 pages has"`` / ``"3 of 114 pages have"``: the verb agrees with ``n``, the
    pages counted, not with the total.

    >>> _pages_have(1, 114), _pages_have(2, 3)
    ('1 of 114 pages has', '2 of 3 pages have')
    """
    return f"{n} of {total} pages {'has' if n == 1 else 'have'}"


def _text_layer_check(
    pages: list[str], data: bytes, path: str, opts: LoadOptions, meta: dict[str, Any], warnings: list[str]
) -> list[str]:
    """Count PDF pages without a text layer, OCR them when asked, and say so either way.

    A scanned page is never indexed silently as empty: ``meta["pages_without_text"]`` counts
    them and a one-line warning names the share; with ``opts.ocr`` they are read by Tesseract
    (``meta["ocr_pages"]``), and a missing Tesseract is a warning, not a failure, since the pages
    with text are still worth indexing.
    """
    blank = [i for i, p in enumerate(pages) if not p.strip()]
    meta["pages_without_text"] = len(blank)
    if not blank:
        return pages
    if not opts.ocr:
        if len(blank) < len(pages):  # all blank: load_document raises "empty" with this advice
            warnings.append(
                f"{_pages_have(len(blank), len(pages))} no text layer (scanned?); not indexed without --ocr"
            )
        return pages
    from .formats.ocr import ocr_pdf_pages

    try:
        texts = ocr_pdf_pages(data, blank, path, lang=opts.ocr_lang)
    except LoadError as exc:
        warnings.append(
            f"{_pages_have(len(blank), len(pages))} no text layer and OCR failed: " + str(exc).removeprefix(f"{path}: ")
        )
        if len(blank) == len(pages):
            raise
        return pages
    pages = list(pages)
    for i, text in zip(blank, texts, strict=True):
        pages[i] = text
    meta["ocr_pages"] = len(blank)
    still = sum(1 for i in blank if not pages[i].strip())
    warnings.append(
        f"{_pages_have(len(blank), len(pages))} no text layer: read by OCR"
        + (f" ({still} gave no text)" if still else "")
    )
    return pages


# --------------------------------------------------------------------------------------------------
# corpus boilerplate


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
        pages = [_trim_page(p) for p in apply_report(doc.pages, report)]
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


def iter_documents(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    clean: bool = True,
    batch_size: int = 64,
    boilerplate: BoilerplateFilter | None = None,
    **scan_options: Any,
) -> Iterator[Document | Skipped]:
    """Scan ``paths`` and load every file: yields :class:`Document` or :class:`Skipped`.

    Scan skips come first, then files in walk order; a file that fails to load is yielded as a
    :class:`Skipped` carrying the :class:`~ragbudget.errors.LoadError` reason. With ``clean=True``
    documents are loaded ``batch_size`` at a time and corpus boilerplate is stripped with
    ``boilerplate`` (a fresh :class:`BoilerplateFilter` by default) after observing the batch.
    ``scan_options`` go to :func:`scan` (``include``, ``exclude``, ``max_bytes``, ``follow_symlinks``).
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
    result = scan(paths, **scan_options)
    yield from result.skipped
    max_bytes = scan_options.get("max_bytes", DEFAULT_MAX_BYTES)
    filt = boilerplate if boilerplate is not None else BoilerplateFilter()
    batch: list[Document] = []

    def drain() -> Iterator[Document]:
        if clean:
            filt.observe(batch)
            yield from (filt.strip(d) for d in batch)
        else:
            yield from batch
        batch.clear()

    for info in result.files:
        try:
            doc = load_document(info.path, clean=clean, max_bytes=max_bytes)
        except LoadError as exc:
            yield Skipped(path=info.path, reason=exc.reason, detail=str(exc), rel=info.rel)
            continue
        batch.append(doc)
        if len(batch) >= batch_size:
            yield from drain()
    if batch:
        yield from drain()
