"""Walking files and folders: which files can be loaded (:class:`FileInfo`), and which were
skipped and why (:class:`Skipped`), without opening any.

:func:`scan` only ``stat``\\ s, so a FIFO never blocks it; links are followed only inside the
scanned root and never round a loop; a file reached by two paths is listed once; another
ragbudget index's folder is skipped, the index's own folder walked past.

>>> import pathlib, tempfile
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> _ = (folder / "a.md").write_text("# Title\\n")
>>> _ = (folder / "logo.png").write_bytes(b"\\x89PNG\\r\\n")
>>> result = scan(folder)
>>> [f.rel for f in result.files], [(s.rel, s.reason) for s in result.skipped]
(['a.md'], [('logo.png', 'unsupported')])
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..types import DEFAULT_INDEX_DIR
from .formats import FORMATS as CONTAINER_FORMATS

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FORMATS",
    "IGNORED_DIRS",
    "SCAN_SKIP_REASONS",
    "SUPPORTED_EXTENSIONS",
    "FileInfo",
    "ScanResult",
    "Skipped",
    "format_of",
    "scan",
]

#: Files larger than this (bytes on disk, or decompressed for ``.gz``) are skipped as ``too_large``.
DEFAULT_MAX_BYTES = 50 * 1024 * 1024

#: File name ending → format name, for every format :func:`~ragbudget.input.loaders.load_document` reads.
FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".rst": "rst",
    ".html": "html",
    ".htm": "html",
    ".xhtml": "html",
    ".pdf": "pdf",
    **CONTAINER_FORMATS,
}
#: File name endings :func:`~ragbudget.input.loaders.load_document` reads (each also with ``.gz`` appended).
SUPPORTED_EXTENSIONS = frozenset(FORMATS)
#: Folder names never walked into (besides any name starting with a dot).
IGNORED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", "node_modules", DEFAULT_INDEX_DIR})

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


def format_of(name: str) -> tuple[str, bool] | None:
    """``(format, gzipped)`` from a file name, or None when unsupported.

    >>> format_of("notes.MD.gz"), format_of("slides.pptx"), format_of("logo.png")
    (('markdown', True), ('pptx', False), None)
    """
    lower = name.lower()
    gz = lower.endswith(".gz")
    if gz:
        lower = lower[:-3]
    fmt = FORMATS.get(os.path.splitext(lower)[1])
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


@dataclass
class _ScanState:
    """One :func:`scan` call's options and what its walk has found so far."""

    include: list[str] | None
    exclude: list[str]
    max_bytes: int
    follow_symlinks: bool
    own: set[tuple[int, int]]
    files: list[FileInfo] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    seen_files: set[str] = field(default_factory=set)
    visited_dirs: set[str] = field(default_factory=set)

    def skip(self, path: str, rel: str, reason: str, detail: str = "") -> None:
        """Record ``path`` as skipped for ``reason``."""
        self.skipped.append(Skipped(path=path, reason=reason, detail=detail, rel=rel))


def _own_folders(leave_out: Iterable[str | os.PathLike[str]]) -> set[tuple[int, int]]:
    """The (device, inode) of each folder in ``leave_out`` that can be stat'ed."""
    # Folders are told apart by (device, inode): no spelling of the path, relative or through a
    # link, reaches them. One stat per folder met, none per file.
    own: set[tuple[int, int]] = set()
    for folder in leave_out:
        with contextlib.suppress(OSError):
            st = os.stat(folder)
            own.add((st.st_dev, st.st_ino))
    return own


def _is_left_out(entry: os.DirEntry[str], own: set[tuple[int, int]]) -> bool:
    """Whether ``entry`` is a folder among ``own`` (by device, inode)."""
    try:
        if not entry.is_dir():
            return False
        st = entry.stat()
    except OSError:
        return False
    return (st.st_dev, st.st_ino) in own


def _consider_file(state: _ScanState, path: str, rel: str, st: os.stat_result) -> None:
    """List a regular file as loadable, or skip it (include/exclude, format, size, duplicate)."""
    if state.include is not None and not _matches(rel, state.include):
        state.skip(path, rel, "excluded", "matches no include pattern")
        return
    if state.exclude and _matches(rel, state.exclude):
        state.skip(path, rel, "excluded", "matches an exclude pattern")
        return
    if format_of(os.path.basename(path)) is None:
        ext = os.path.splitext(path)[1] or "(no extension)"
        state.skip(path, rel, "unsupported", f"extension {ext}")
        return
    if st.st_size > state.max_bytes:
        state.skip(path, rel, "too_large", f"{st.st_size} bytes > max_bytes={state.max_bytes}")
        return
    real = os.path.realpath(path)
    if real in state.seen_files:
        state.skip(path, rel, "duplicate", f"same file as {real}")
        return
    state.seen_files.add(real)
    state.files.append(FileInfo(path=real, size=st.st_size, mtime_ns=st.st_mtime_ns, rel=rel))


def _dropped_by_name(state: _ScanState, entry: os.DirEntry[str], path: str, rel: str) -> bool:
    """Whether ``entry`` is passed over before any stat: left out, ignored, hidden or excluded."""
    if state.own and _is_left_out(entry, state.own):
        return True
    if entry.name in IGNORED_DIRS:
        state.skip(path, rel, "ignored", "VCS or cache folder")
        return True
    if entry.name.startswith("."):
        state.skip(path, rel, "hidden")
        return True
    # An excluded name is dropped before anything else is asked of it (a link pointing
    # outside the root that the user excluded is not worth a warning), and a folder matching a
    # pattern ("build", "drafts/") is pruned whole instead of listing every file below it.
    if state.exclude and (_matches(rel, state.exclude) or _matches(rel + "/", state.exclude)):
        state.skip(path, rel, "excluded", "matches an exclude pattern")
        return True
    return False


def _stat_entry(state: _ScanState, path: str, rel: str, is_link: bool) -> os.stat_result | None:
    """``path``'s stat (links followed), or None after skipping it with the reason it failed."""
    try:
        return os.stat(path)  # follows links; never opens, so FIFOs cannot block
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            state.skip(path, rel, "symlink_loop", "link resolves to itself")
        elif is_link:
            state.skip(path, rel, "broken_link", f"target missing: {os.readlink(path)}")
        else:
            state.skip(path, rel, "unreadable", exc.strerror or str(exc))
        return None


def _link_rejected(
    state: _ScanState, path: str, rel: str, st: os.stat_result, real_root: str, ancestors: tuple[str, ...]
) -> bool:
    """Whether a followed link is skipped: it leads outside the root or to an enclosing folder."""
    real = os.path.realpath(path)
    if not _within(real, real_root):
        state.skip(path, rel, "outside_root", f"link to {real}")
        return True
    if stat.S_ISDIR(st.st_mode) and real in ancestors:
        state.skip(path, rel, "symlink_loop", f"link to enclosing folder {real}")
        return True
    return False


def _enter_folder(state: _ScanState, path: str, rel: str, real_root: str, ancestors: tuple[str, ...]) -> None:
    """Walk a sub-folder unless it was already walked (an excluded one never gets here)."""
    real = os.path.realpath(path)
    if real in state.visited_dirs:
        state.skip(path, rel, "duplicate", f"folder already walked as {real}")
        return
    state.visited_dirs.add(real)
    _walk(state, path, rel, real_root, ancestors + (real,))


def _visit_entry(
    state: _ScanState, entry: os.DirEntry[str], dir_path: str, rel_dir: str, real_root: str, ancestors: tuple[str, ...]
) -> None:
    """Take one folder entry: skip it with a reason, list it as a file, or walk into it."""
    rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
    path = os.path.join(dir_path, entry.name)
    if _dropped_by_name(state, entry, path, rel):
        return
    is_link = entry.is_symlink()
    if is_link and not state.follow_symlinks:
        state.skip(path, rel, "symlink", "follow_symlinks=False")
        return
    st = _stat_entry(state, path, rel, is_link)
    if st is None:
        return
    if is_link and _link_rejected(state, path, rel, st, real_root, ancestors):
        return
    if stat.S_ISDIR(st.st_mode):
        _enter_folder(state, path, rel, real_root, ancestors)
    elif stat.S_ISREG(st.st_mode):
        _consider_file(state, path, rel, st)
    else:
        state.skip(path, rel, "special", "FIFO, socket or device")


def _walk(state: _ScanState, dir_path: str, rel_dir: str, real_root: str, ancestors: tuple[str, ...]) -> None:
    """Walk one folder's entries in name order, unless it is unreadable or another index's folder."""
    try:
        with os.scandir(dir_path) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        state.skip(dir_path, rel_dir or ".", "unreadable", exc.strerror or str(exc))
        return
    if _is_index_folder(entries):
        state.skip(dir_path, rel_dir or ".", "ignored", "a ragbudget index folder")
        return
    for entry in entries:
        _visit_entry(state, entry, dir_path, rel_dir, real_root, ancestors)


def _scan_root(state: _ScanState, root: str) -> None:
    """Take one path given to :func:`scan`: walk a folder, consider a file, or skip it."""
    try:
        st = os.stat(root)
    except OSError as exc:
        reason = "symlink_loop" if exc.errno == errno.ELOOP else "missing"
        state.skip(root, os.path.basename(root), reason, exc.strerror or str(exc))
        return
    if state.own and _inside(root, st, state.own):
        return
    if stat.S_ISDIR(st.st_mode):
        real_root = os.path.realpath(root)
        if real_root in state.visited_dirs:
            return
        state.visited_dirs.add(real_root)
        _walk(state, root, "", real_root, (real_root,))
    elif stat.S_ISREG(st.st_mode):
        _consider_file(state, root, os.path.basename(root), st)
    else:
        state.skip(root, os.path.basename(root), "special", "FIFO, socket or device")


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
    state = _ScanState(
        include=list(include) if include else None,
        exclude=list(exclude or ()),
        max_bytes=max_bytes,
        follow_symlinks=follow_symlinks,
        own=_own_folders(leave_out),
    )
    for root in _as_list(paths):
        _scan_root(state, root)
    return ScanResult(files=state.files, skipped=state.skipped)
