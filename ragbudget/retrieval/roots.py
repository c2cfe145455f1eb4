"""The paths an index was given, and how the paths below them are shown.

Every folder or file passed to a writing run is a *root*: recorded with a short unique label (its
base name, ``-2``… on a clash) and its kind. Paths are stored absolute (they drive incremental
runs) and shown as *display paths*: the label of the most specific root covering them, then the
path below it (``notes/deep/guide.pdf``), so that nothing private reaches a prompt, a log or an
HTTP client. :func:`check_roots` vets the paths of a run before anything is written: a typo never
empties an index.

>>> roots = Roots([Root("/home/me/notes", "notes", "dir")])
>>> roots.display("/home/me/notes/deep/guide.pdf"), roots.absolute("notes/deep/guide.pdf")
('notes/deep/guide.pdf', '/home/me/notes/deep/guide.pdf')
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import InputPathError

__all__ = ["Root", "Roots", "canonical_path", "check_roots", "fallback_root", "is_under", "new_label"]


def is_under(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies below it (both absolute, resolved)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def canonical_path(path: str) -> str:
    """An absolute path whose folder is resolved but whose last part is kept (a broken link or a
    skipped entry keeps its own name): the key of a file's row."""
    path = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


@dataclass(frozen=True)
class Root:
    """A path given to a writing run: resolved absolute ``path``, short unique ``label`` shown
    instead of the path, ``kind`` ``dir`` or ``file``."""

    path: str
    label: str
    kind: str

    def covers(self, path: str) -> bool:
        return path == self.path or (self.kind == "dir" and is_under(path, self.path))


class Roots:
    """Maps stored absolute paths to display paths (``<root label>/<path below the root>``) and
    back. The most specific root wins when roots nest."""

    def __init__(self, roots: Iterable[Root] = ()) -> None:
        self.roots = sorted(roots, key=lambda r: (-len(r.path), r.path))
        self.by_label = {r.label: r for r in self.roots}
        self._shown: dict[str, str] = {}

    def root_of(self, path: str) -> Root | None:
        return next((r for r in self.roots if r.covers(path)), None)

    def display(self, path: str) -> str:
        shown = self._shown.get(path)
        if shown is None:
            r = self.root_of(path)
            if r is None:  # not under any root (never expected): the name alone, never the path
                shown = os.path.basename(path) or path
            elif path == r.path:
                shown = r.label
            else:
                shown = r.label + "/" + os.path.relpath(path, r.path).replace(os.sep, "/")
            self._shown[path] = shown
        return shown

    def absolute(self, path: str) -> str | None:
        """The stored absolute path of a display path (an absolute path is returned as is)."""
        if os.path.isabs(path):
            return path
        label, _, rest = path.partition("/")
        r = self.by_label.get(label)
        if r is None or (rest and r.kind != "dir"):
            return None
        return os.path.join(r.path, *rest.split("/")) if rest else r.path

    def labels(self) -> list[str]:
        return sorted(self.by_label)

    def scrub(self, text: str | None) -> str | None:
        """``text`` (an error detail) with every root's absolute path replaced by its label."""
        if text:
            for r in self.roots:
                text = text.replace(r.path, r.label)
        return text


def new_label(path: str, taken: set[str]) -> str:
    """The label of a new root at ``path``: its base name, with ``-2``, ``-3``… while taken."""
    base = os.path.basename(path.rstrip(os.sep)) or "root"
    label, n = base, 1
    while label in taken:
        n += 1
        label = f"{base}-{n}"
    return label


def fallback_root(paths: Iterable[str]) -> Root | None:
    """For an index written before roots were recorded: the common folder of its files."""
    files = [p for p in paths if os.path.isabs(p)]
    if not files:
        return None
    common = os.path.commonpath(files)
    if common in files:  # a single file (or one file and a path below it, impossible): its folder
        common = os.path.dirname(common)
    return Root(common, new_label(common, set()), "dir")


def check_roots(
    paths: Sequence[str], *, where: str, exists: bool, own_dir: str | os.PathLike[str] | None = None
) -> list[tuple[str, str]]:
    """``(resolved path, kind)`` of every path given to a writing run; raises
    :class:`~ragbudget.errors.InputPathError` naming each one that is missing, unreadable, not a
    file or folder, or the index's own folder ``own_dir`` (or inside it). Called before anything
    is written; ``where`` names the index and ``exists`` says whether there is one (the message
    says what was left as it was)."""
    good: list[tuple[str, str]] = []
    bad: list[tuple[str, str]] = []
    own = os.path.realpath(own_dir) if own_dir is not None else None
    for p in paths:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            bad.append((p, "no such file or folder"))
            continue
        except OSError as exc:
            bad.append((p, exc.strerror or str(exc)))
            continue
        if stat.S_ISDIR(st.st_mode):
            kind, mode = "dir", os.R_OK | os.X_OK
        elif stat.S_ISREG(st.st_mode):
            kind, mode = "file", os.R_OK
        else:
            bad.append((p, "not a file or folder"))
            continue
        if not os.access(p, mode):
            bad.append((p, "permission denied"))
            continue
        real = os.path.realpath(p)
        if own is not None and is_under(real, own):
            why = "it is the index's own folder or inside it (an index never reads its own files; use another "
            bad.append((p, why + "--index-dir)"))
            continue
        good.append((real, kind))
    if bad:
        what = "; ".join(f"{p!r}: {why}" for p, why in bad)
        state = f"the index in {where} is unchanged" if exists else f"no index was created in {where}"
        raise InputPathError(
            f"cannot index {what}. Nothing was indexed or removed ({state}); check the "
            "path, or pass only the files and folders that exist",
            paths=tuple(p for p, _ in bad),
        )
    return good
