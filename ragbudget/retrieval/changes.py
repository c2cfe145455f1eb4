"""What a writing run changes: its roots, the files it (re)reads, the files it removes.

Before a writing run (:mod:`ragbudget.retrieval.build`) reads a file, :func:`plan_changes` works
out the run's scope and what changed since the index was written. **Roots**: the paths given
join the recorded ones (:mod:`ragbudget.retrieval.roots`); a rebuild re-reads every recorded
root, and refuses to run while one is missing. **Scan**: one ``stat`` per file; a file whose size
and mtime match its row is not opened, one whose size matches is hashed and re-read only when its
content changed; a file skipped for a missing dependency is retried once that is installed.
**Removal**: only indexed files that vanished from under a given path are removed (all outside
them with ``prune``), files below a folder the walk could not read are kept, and a run that
would remove much of the index is refused before anything is written (the removal guard).

The catalog of the generation being written is edited to match (skipped entries recorded,
vanished files and the sources of changed ones dropped); the chunks those sources held become
orphans, removed or revived by the rest of the run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError, InputPathError
from .catalog import FileState
from .roots import Root, Roots, canonical_path, fallback_root, new_label
from .storage import Catalog, CatalogWriter, sha256_file

if TYPE_CHECKING:
    from ..input.scan import FileInfo

__all__ = ["REMOVAL_GUARD_FILES", "REMOVAL_GUARD_SHARE", "Plan", "final_roots", "plan_changes"]

log = logging.getLogger(__name__)

#: The removal guard: without ``allow_removal`` (``--allow-removal``) or ``prune``, a run may
#: remove at most ``REMOVAL_GUARD_FILES`` indexed files, or more only while they are at most
#: ``REMOVAL_GUARD_SHARE`` of the indexed files, and never all of them. Deleting a few notes is
#: everyday editing; a fifth of the corpus gone at once is far more often an unmounted drive, an
#: emptied or wrong folder than a real clean-up, and costs a full re-embed to undo.
REMOVAL_GUARD_FILES = 5
REMOVAL_GUARD_SHARE = 0.2


@dataclass(kw_only=True)
class Plan:
    """What :func:`plan_changes` found: the ``roots`` the index will know, the files to (re)read
    (``todo``: ``(path, size, mtime_ns, sha256 or None)``), the files indexed before the run,
    what it saw, skipped and kept, and whether it changed the catalog already."""

    roots: list[Root]
    todo: list[tuple[str, int, int, str | None]] = field(default_factory=list)
    old_indexed: set[str] = field(default_factory=set)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    seen: int = 0
    unchanged: int = 0
    removed: int = 0
    kept: int = 0
    changed: bool = False


def plan_changes(
    catalog: CatalogWriter,
    *,
    previous: Catalog | None,
    given: Sequence[tuple[str, str]],
    paths: Sequence[str],
    prune: bool,
    allow_removal: bool,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    max_bytes: int | None = None,
    own_dir: str | os.PathLike[str] | None = None,
    where: str = "",
) -> Plan:
    """Scan ``paths`` and edit ``catalog`` (the generation being written) to match; the
    :class:`Plan` of the rest of the run. ``previous``: the last generation's catalog when this
    run rebuilds from an empty one (``catalog`` then holds nothing yet), else ``None``.
    ``given``: ``(resolved path, kind)`` of the paths given (:func:`~ragbudget.retrieval.roots.check_roots`)."""
    rebuilding = previous is not None
    held = previous if previous is not None else catalog
    before_roots = held.roots()
    before = held.file_states()
    changed = False
    legacy = [p for p in before if not os.path.isabs(p)]
    if legacy:
        # Skipped entries of older versions were keyed by the path as typed (relative to
        # wherever that run started); they hold no chunks and are found again by a scan.
        catalog.drop_files(legacy)
        before = {p: v for p, v in before.items() if os.path.isabs(p)}
        changed = True
    if not before_roots and before:
        fallback = fallback_root(before)
        if fallback is not None:
            log.warning(
                "the index in %s records no roots (written by an older ragbudget); recording %s as the "
                "root of its files",
                where,
                fallback.label,
            )
            before_roots = [fallback]
    roots = list(before_roots)
    for real, kind in given:
        if not any(r.covers(real) for r in roots):
            roots.append(Root(real, new_label(real, {r.label for r in roots}), kind))
    scope = [Root(real, "", kind) for real, kind in given]
    scan_paths = list(paths)
    if rebuilding and not prune:
        # A rebuild re-reads every recorded root, not only the ones named this time.
        extra = [r for r in before_roots if not any(g.covers(r.path) for g in scope)]
        missing = [r for r in extra if not os.path.exists(r.path)]
        if missing:
            raise InputPathError(
                f"a rebuild re-reads every root of the index, and {len(missing)} of them are "
                f"missing: {', '.join(repr(r.label) for r in missing)} (its files are in the "
                "index). Nothing was changed; restore them, or pass prune=True (--prune) to "
                "rebuild from the given paths only",
                paths=tuple(r.label for r in missing),
            )
        extra.sort(key=lambda r: len(r.path))  # outer folders first: nested ones are walked once
        scan_paths += [r.path for r in extra]
        scope += extra
    plan = Plan(roots=roots, changed=changed)
    _Scan(catalog, plan, scope=scope, prune=prune, allow_removal=allow_removal).run(
        before if not rebuilding else {},
        before,
        scan_paths,
        include=include,
        exclude=exclude,
        max_bytes=max_bytes,
        own_dir=own_dir,
    )
    recorded = {(r.path, r.label, r.kind) for r in catalog.roots()}
    if {(r.path, r.label, r.kind) for r in final_roots(catalog, roots, given)} != recorded:
        plan.changed = True
    return plan


def final_roots(catalog: Catalog, roots: Sequence[Root], given: Sequence[tuple[str, str]]) -> list[Root]:
    """The roots to record: the ones given to this run, and earlier ones still holding a file."""
    named = {real for real, _ in given}
    paths = catalog.file_paths()
    return [r for r in roots if r.path in named or any(r.covers(p) for p in paths)]


class _Scan:
    """One scan against the recorded files: fills ``plan`` and edits ``catalog``."""

    def __init__(
        self, catalog: CatalogWriter, plan: Plan, *, scope: list[Root], prune: bool, allow_removal: bool
    ) -> None:
        self.catalog = catalog
        self.plan = plan
        self.scope = scope
        self.prune = prune
        self.allow_removal = allow_removal
        self.shielded: list[Root] = []  # folders the walk could not read: their files are kept
        self.available: dict[str, bool] = {}  # missing dependencies checked in this run

    def in_scope(self, path: str) -> bool:
        if any(r.covers(path) for r in self.shielded):
            return False
        return self.prune or any(r.covers(path) for r in self.scope)

    def run(
        self,
        known: dict[str, FileState],
        before: dict[str, FileState],
        scan_paths: list[str],
        *,
        include: Sequence[str] | None,
        exclude: Sequence[str] | None,
        max_bytes: int | None,
        own_dir: str | os.PathLike[str] | None,
    ) -> None:
        """``known``: the rows compared with (none on a rebuild: every file is read again);
        ``before``: what the index held (removals are counted and guarded against it)."""
        from ..input.loaders import DEFAULT_MAX_BYTES, scan

        plan = self.plan
        # The index never reads its own folder (manifest, SQLite, lock, temp files), wherever it is.
        found = scan(
            scan_paths,
            include=include,
            exclude=exclude,
            leave_out=[own_dir] if own_dir else [],
            max_bytes=max_bytes or DEFAULT_MAX_BYTES,
        )
        self.shielded += [
            Root(canonical_path(str(s.path)), "", "dir") for s in found.skipped if s.reason in ("unreadable", "missing")
        ]
        plan.old_indexed = {p for p, v in before.items() if v.status == "indexed"}
        seen: set[str] = set()
        plan.seen = len(found.files) + len(found.skipped)
        for s in found.skipped:
            path = canonical_path(str(s.path))
            seen.add(path)
            self._record_skip(path, str(s.reason), s.detail, known.get(path))
        retried = 0
        for f in found.files:
            path = str(f.path)
            seen.add(path)
            if self._compare_file(path, f, known.get(path)):
                retried += 1
        if retried:
            log.info("retrying %d file(s) skipped for a missing dependency that is installed now", retried)
        self._remove_vanished(known, seen, {str(f.path) for f in found.files})

    def _record_skip(self, path: str, why: str, detail: str, prev: FileState | None) -> None:
        """Note a skipped entry, and record it in the catalog unless its row already says so."""
        self.plan.skipped.append((path, why, detail))
        if prev is None or prev.status != "skipped" or prev.reason != why:
            if prev is not None and prev.status == "indexed":
                self.catalog.drop_sources(path)
            self.catalog.record_file(path, -1, -1, None, "skipped", why, detail)
            self.plan.changed = True

    def _compare_file(self, path: str, f: FileInfo, prev: FileState | None) -> bool:
        """Queue a found file to be read when new or changed; ``True`` when it is a dependency retry."""
        plan = self.plan
        if prev is not None and prev.status == "skipped" and prev.reason == "missing_dependency" and self._back(prev):
            # Skipped for want of a library or program that is installed now: read it again,
            # even unchanged (its size, mtime and hash say nothing about the dependency).
            plan.todo.append((path, f.size, f.mtime_ns, None))
            return True
        if prev is not None and prev.size == f.size and prev.mtime_ns == f.mtime_ns:
            self._unchanged(path, prev)
            return False
        if prev is not None and prev.size == f.size:
            try:
                digest = sha256_file(Path(path))
            except OSError as exc:
                plan.skipped.append((path, "unreadable", str(exc)))
                return False
            if digest == prev.sha256:
                # Touched but identical: record the new mtime, re-read nothing.
                self.catalog.touch_file(path, f.mtime_ns)
                plan.changed = True
                self._unchanged(path, prev)
                return False
            plan.todo.append((path, f.size, f.mtime_ns, digest))
        else:
            plan.todo.append((path, f.size, f.mtime_ns, None))
        return False

    def _remove_vanished(self, known: dict[str, FileState], seen: set[str], found_paths: set[str]) -> None:
        """Guard and count the removals, drop the vanished files and the sources of files to re-read."""
        plan, catalog = self.plan, self.catalog
        leaving = sorted(p for p in plan.old_indexed if p not in found_paths and self.in_scope(p))
        self._guard_removal(leaving)
        plan.removed = len(leaving)
        plan.kept = sum(1 for p in plan.old_indexed if not self.in_scope(p))
        gone = [p for p in known if p not in seen and self.in_scope(p)]
        catalog.drop_files(gone)
        for path, *_ in plan.todo:
            if path in known:
                catalog.drop_sources(path)
        if gone or plan.todo:
            plan.changed = True

    def _guard_removal(self, leaving: list[str]) -> None:
        """Refuse (before anything is written) a run that would remove much of the index,
        unless the caller said removal is meant."""
        n, total = len(leaving), len(self.plan.old_indexed)
        if not n or self.allow_removal or self.prune:
            return
        if n < total and (n <= REMOVAL_GUARD_FILES or n <= REMOVAL_GUARD_SHARE * total):
            return
        shown = Roots(self.plan.roots)
        examples = ", ".join(shown.display(p) for p in leaving[:3]) + (", ..." if n > 3 else "")
        what = "all" if n == total else f"{n} of the"
        raise ConfigError(
            f"this run would remove {what} {total} indexed file(s) ({examples}): they are no "
            "longer found under the given paths. Nothing was changed. If they were really "
            "deleted, run again with --allow-removal (allow_removal=True); check that the "
            "folder is the right one and is mounted"
        )

    def _back(self, prev: FileState) -> bool:
        """Whether the dependency a skipped file lacked is there now (checked once a run). A skip
        recorded before ``needs`` was (``None``) is retried once, and records it then."""
        needs = prev.needs
        if needs is None:
            return True
        if needs not in self.available:
            from ..input.formats import available

            self.available[needs] = available(needs)
        return self.available[needs]

    def _unchanged(self, path: str, prev: FileState) -> None:
        if prev.status == "indexed":
            self.plan.unchanged += 1
        else:
            self.plan.skipped.append((path, prev.reason or "skipped", prev.detail or ""))
