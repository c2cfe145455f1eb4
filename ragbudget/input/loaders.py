"""Loading documents: a file's bytes read (decompressed, bounded), decoded, split into pages and
cleaned into a :class:`~ragbudget.types.Document`; a folder's files one batch at a time.

The steps live beside this module, each one job: :mod:`~ragbudget.input.scan` walks folders,
:mod:`~ragbudget.input.decode` turns bytes into text, :mod:`~ragbudget.input.html` and
:mod:`~ragbudget.input.pdf` read those formats, :mod:`ragbudget.input.formats` the container and
record formats, :mod:`~ragbudget.input.clean` strips page furniture and
:mod:`~ragbudget.input.boilerplate` what repeats across a corpus. Their public names resolve
here too.

Two entry points:

* :func:`load_document` reads one file into a :class:`~ragbudget.types.Document` (pages + meta),
  or raises :class:`~ragbudget.errors.LoadError` with a ``reason`` tag.
* :func:`iter_documents` scans a folder and loads it, turning load errors into
  :class:`~ragbudget.input.scan.Skipped`, and strips boilerplate repeated across the corpus.

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
>>> load_document(folder / "a.md").text
'# Title\\n\\nSome text.'
>>> [d.text for d in iter_documents(folder)]
['# Title\\n\\nSome text.']
"""

from __future__ import annotations

import gzip
import os
import re
import stat
import zlib
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

from ..errors import ConfigError, LoadError
from ..types import Document
from .boilerplate import BoilerplateFilter, strip_corpus_boilerplate
from .clean import apply_report, find_contents, find_furniture, find_known, trim_page
from .decode import decode, decode_bytes
from .formats import FORMATS as CONTAINER_FORMATS, LoadOptions, current_options, read as read_format
from .html import html_to_text
from .pdf import pdf_pages, text_layer_check
from .scan import (
    DEFAULT_MAX_BYTES,
    IGNORED_DIRS,
    SCAN_SKIP_REASONS,
    SUPPORTED_EXTENSIONS,
    FileInfo,
    ScanResult,
    Skipped,
    format_of,
    scan,
)

# The names of the steps (scan, decode_bytes, BoilerplateFilter...) are this module's public API
# too: they were defined here until the steps became modules of their own (issue #32).
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

#: ``LoadError.reason`` values raised by :func:`load_document`.
LOAD_ERROR_REASONS = frozenset(
    {"binary", "too_large", "unreadable", "empty", "encrypted", "malformed", "unsupported", "missing_dependency"}
)
# Fixed page lengths tried for text without form feeds: 66 is nroff/groff's default (11 in at
# 6 lines per inch), the others cover A4 and common printer settings.
_FIXED_PAGE_LENGTHS = (66, 72, 64, 60)


_CONTROL = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f]")


def _normalise(text: str) -> str:
    """Newlines to ``\\n``, control characters out, trailing spaces off each line."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    return "\n".join(line.rstrip() for line in text.split("\n"))


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


def _format_or_raise(spath: str) -> str:
    """The format name of ``spath``, or a ``LoadError`` (``unsupported``) naming the supported endings."""
    kind = format_of(os.path.basename(spath))
    if kind is None:
        raise LoadError(
            f"{spath}: unsupported file type; supported: "
            + ", ".join(sorted(SUPPORTED_EXTENSIONS))
            + " (optionally .gz)",
            path=spath,
            reason="unsupported",
        )
    fmt, _ = kind
    return fmt


def _container_pages(
    fmt: str, data: bytes, spath: str, opts: LoadOptions, max_bytes: int, meta: dict[str, Any], warnings: list[str]
) -> tuple[list[str], bool, int]:
    """Pages of a :mod:`ragbudget.input.formats` file, with its layout flag and furniture count."""
    loaded = read_format(fmt, data, spath, options=opts, max_bytes=max_bytes)
    raw_pages, layout, furniture_by_format = loaded.pages, loaded.clean, loaded.furniture
    warnings.extend(loaded.warnings)
    meta.update(loaded.meta)
    meta.update(paginated=True, page_labels=list(loaded.labels), layout=layout)
    meta.setdefault("encoding", "utf-8")
    meta.setdefault("replaced_chars", 0)
    return raw_pages, layout, furniture_by_format


def _text_pages(fmt: str, data: bytes, spath: str, meta: dict[str, Any]) -> list[str]:
    """Pages of a text, Markdown, reStructuredText or HTML file, noting its encoding in ``meta``."""
    decoded = decode(data, path=spath, html=fmt == "html")
    text = decoded.text
    meta.update(encoding=decoded.encoding, replaced_chars=decoded.replaced)
    notes = []
    if decoded.guessed:
        notes.append(f"not UTF-8: decoded as {decoded.encoding} (a guess; save it as UTF-8 to be sure)")
    if decoded.replaced:
        notes.append(f"{decoded.replaced} undecodable byte(s) replaced by U+FFFD")
    if notes:
        meta["encoding_warning"] = "; ".join(notes)
    if fmt == "html":
        text, title = html_to_text(text, spath)
        meta["title"] = title
        raw_pages, meta["paginated"] = [text], False
    else:
        raw_pages, meta["paginated"] = paginate_text(text)
    return raw_pages


def _raw_pages(
    fmt: str, data: bytes, spath: str, opts: LoadOptions, max_bytes: int, meta: dict[str, Any], warnings: list[str]
) -> tuple[list[str], bool, int]:
    """The file's pages before cleaning, whether they are layout pages, and furniture its format removed."""
    if fmt == "pdf":
        raw_pages = pdf_pages(data, spath)
        meta.update(encoding="pdf", replaced_chars=0, paginated=True)
        return text_layer_check(raw_pages, data, spath, opts, meta, warnings), True, 0
    if fmt in CONTAINER_FORMATS.values():
        return _container_pages(fmt, data, spath, opts, max_bytes, meta, warnings)
    return _text_pages(fmt, data, spath, meta), True, 0


def _clean_pages(
    pages: list[str], boilerplate: Collection[str], trust_page_numbers: bool, meta: dict[str, Any]
) -> tuple[list[str], int, tuple[str, ...]]:
    """Pages without running heads, contents pages and known boilerplate; furniture removed and its patterns."""
    report = find_furniture(pages, trust_page_numbers=trust_page_numbers)
    pages = apply_report(pages, report)
    # After the running heads are gone, so that a contents page's own "Contents  iii" head
    # does not stand between its title and its first entry.
    contents = find_contents(pages)
    pages = apply_report(pages, contents)
    meta["contents_removed"] = contents.removed
    if boilerplate:
        extra = find_known(pages, boilerplate)
        pages = apply_report(pages, extra)
        meta["boilerplate_removed"] = extra.removed
        meta["boilerplate_patterns"] = list(extra.patterns)
    return pages, report.removed, report.patterns


def _no_text_error(spath: str, fmt: str, n_pages: int) -> LoadError:
    """The ``empty`` error for a file whose pages hold no text (a scanned PDF says how to OCR it)."""
    if fmt == "pdf":
        detail = (
            f"no text layer on any of its {n_pages} page(s): a scanned PDF; index it "
            "with OCR (ragbudget index --ocr, needs ragbudget[ocr] and tesseract-ocr)"
        )
    else:
        detail = "no text"
    return LoadError(f"{spath}: {detail}", path=spath, reason="empty")


def _add_warnings(meta: dict[str, Any], warnings: list[str]) -> None:
    """Put load ``warnings`` in ``meta``, joined into ``encoding_warning`` too."""
    meta["warnings"] = warnings
    # The index surfaces ``encoding_warning`` as the file's one warning today; until it reads
    # ``warnings`` too, load warnings ride along there so the summary shows them.
    meta["encoding_warning"] = "; ".join(
        ([meta["encoding_warning"]] if meta.get("encoding_warning") else []) + warnings
    )


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
    line keys from :meth:`~ragbudget.input.boilerplate.BoilerplateFilter.patterns`, removed at
    page edges too), then contents and index pages by :func:`~ragbudget.input.clean.find_contents`.
    ``meta`` holds
    ``format``, ``encoding``, ``replaced_chars``, ``paginated``, ``n_pages``, ``size``, ``mtime``, ``mtime_ns``,
    ``compressed``, ``furniture_removed``, ``furniture_patterns``, ``contents_removed`` (the lines
    of contents, list-of-figures and index pages, :func:`~ragbudget.input.clean.find_contents`),
    for HTML ``title``, and
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
    fmt = _format_or_raise(spath)
    data, st, gz = _read(spath, max_bytes)
    if not data.strip():
        raise LoadError(f"{spath}: the file is empty", path=spath, reason="empty")

    opts = options if options is not None else current_options()
    meta: dict[str, Any] = {"format": fmt, "compressed": gz}
    warnings: list[str] = []
    # layout: whether pages are layout pages, to run the repeated-line (furniture) detector on
    raw_pages, layout, furniture_by_format = _raw_pages(fmt, data, spath, opts, max_bytes, meta, warnings)

    pages = [_normalise(p) for p in raw_pages]
    removed: int = 0
    patterns: tuple[str, ...] = ()
    if clean and layout:
        pages, removed, patterns = _clean_pages(pages, boilerplate, trust_page_numbers, meta)
    pages = [trim_page(p) for p in pages]
    if not any(p.strip() for p in pages):
        raise _no_text_error(spath, fmt, len(pages))
    meta.update(
        n_pages=len(pages),
        size=st.st_size,
        mtime=st.st_mtime,
        mtime_ns=st.st_mtime_ns,
        furniture_removed=removed + furniture_by_format,
        furniture_patterns=list(patterns),
    )
    if warnings:
        _add_warnings(meta, warnings)
    return Document(path=spath, pages=pages, meta=meta)


def iter_documents(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    clean: bool = True,
    batch_size: int = 64,
    boilerplate: BoilerplateFilter | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    follow_symlinks: bool = True,
    leave_out: Iterable[str | os.PathLike[str]] = (),
) -> Iterator[Document | Skipped]:
    """Scan ``paths`` and load every file: yields :class:`Document` or :class:`Skipped`.

    Scan skips come first, then files in walk order; a file that fails to load is yielded as a
    :class:`Skipped` carrying the :class:`~ragbudget.errors.LoadError` reason. With ``clean=True``
    documents are loaded ``batch_size`` at a time and corpus boilerplate is stripped with
    ``boilerplate`` (a fresh :class:`~ragbudget.input.boilerplate.BoilerplateFilter` by default)
    after observing the batch. ``include``, ``exclude``, ``max_bytes``, ``follow_symlinks`` and
    ``leave_out`` are :func:`~ragbudget.input.scan.scan`'s (``max_bytes`` bounds each file's read
    too).
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
    result = scan(
        paths,
        include=include,
        exclude=exclude,
        max_bytes=max_bytes,
        follow_symlinks=follow_symlinks,
        leave_out=leave_out,
    )
    yield from result.skipped
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
