"""What a reader holds: the generation it opened, those that calls in flight still pin, and
following a writer's commits.

A long-running reader (``ragbudget serve``, a notebook, two servers on one database) must answer
from what the last ``ragbudget index`` committed, without a restart, and each request must read
*one* generation from its search to its last chunk, or the chunk ids of one would be looked up in
another. :class:`Reader` does both: :meth:`Reader.follow` compares the committed generation's
number with its own (a ``stat`` of the manifest locally, one small row in PostgreSQL) and opens
the new one beside the old; :meth:`Reader.pinned` makes the calling thread read one generation for
a whole block. An old generation is closed when the last call pinning it ends (its files, or its
rows, are kept by the writer for one more generation: :mod:`ragbudget.retrieval.storage`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .roots import Roots
    from .storage import Generation, Storage

__all__ = ["Opened", "Reader"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Opened:
    """One open generation as a reader holds it: with its roots and page labels (read once), how
    many calls pin it now, and whether a newer one replaced it (closed when ``users`` drops to 0)."""

    gen: Generation
    roots: Roots
    page_labels: dict[str, list[str]] | None = None
    #: ``{source pattern: (chunk ids, files named)}`` of the scopes searched in this generation (:mod:`.scope`).
    scopes: dict[str, tuple[frozenset[int], int]] = field(default_factory=dict)
    users: int = 0
    retired: bool = False


class Reader:
    """The generations one :class:`~ragbudget.retrieval.index.Index` has open. ``opener`` opens
    the generation committed now (the index's own: checksums, roots, retries)."""

    def __init__(self, storage: Storage, opener: Callable[[], Opened]) -> None:
        self.storage = storage
        self._opener = opener
        self._cur: Opened | None = None  # the newest opened: what an unpinned call reads
        self._pin = threading.local()  # this thread's pinned generation
        self._opening = False  # a thread is opening a newer generation
        self._refused: int | None = None  # a newer generation not followed (warned once)
        self._lock = threading.RLock()

    def held(self) -> Opened | None:
        """This thread's pinned generation, else the one open (``None``: none open yet)."""
        pinned: Opened | None = getattr(self._pin, "opened", None)
        return pinned if pinned is not None else self._cur

    def opened(self) -> Opened:
        """This thread's pinned generation, else the one open, else the committed one, opened."""
        opened = self.held()
        if opened is not None:
            return opened
        with self._lock:
            if self._cur is None:
                self._cur = self._opener()
            return self._cur

    def follow(self) -> bool:
        """Open the committed generation if it is newer than the one open; ``True`` if it moved.
        One generation written with another embedder or dimension is not followed: the queries
        would be embedded for the wrong space (logged once; ``Index.reload`` opens it)."""
        cur = self._cur
        if cur is None:
            return False  # nothing open yet: the next use opens the newest anyway
        newest = self.storage.current_generation()
        if newest == cur.gen.number or newest == self._refused:
            return False
        with self._lock:
            if self._cur is not cur or self._opening:
                return self._cur is not cur  # another thread moved it, or is moving it now
            self._opening = True
        try:
            # Opened outside the lock: loading a large generation takes a while, and requests go
            # on reading the old one meanwhile.
            fresh = self._opener()
        finally:
            with self._lock:
                self._opening = False
        old, new = cur.gen.manifest, fresh.gen.manifest
        if (new["embedder"].get("id"), new["dim"]) != (old["embedder"].get("id"), old["dim"]):
            fresh.gen.close()
            self._refused = fresh.gen.number
            log.warning(
                "the index in %s has a generation %d built with embedder %r (dimension %s); this reader "
                "opened generation %d, built with %r (dimension %s), and keeps answering from it: "
                "restart it to serve the new one",
                self.storage.where,
                fresh.gen.number,
                new["embedder"].get("id"),
                new["dim"],
                cur.gen.number,
                old["embedder"].get("id"),
                old["dim"],
            )
            return False
        with self._lock:
            if self._cur is not cur:  # released or reloaded meanwhile: ours is not needed
                fresh.gen.close()
                return True
            self._cur = fresh
            _retire(cur)
        log.info("the index in %s moved from generation %d to %d", self.storage.where, cur.gen.number, fresh.gen.number)
        return True

    @contextlib.contextmanager
    def pinned(self) -> Iterator[Generation]:
        """:meth:`follow`, then one generation for this thread until the block ends (nested
        blocks share the outer one's)."""
        held: Opened | None = getattr(self._pin, "opened", None)
        if held is not None:
            yield held.gen
            return
        self.follow()
        with self._lock:
            opened = self.opened()
            opened.users += 1
        self._pin.opened = opened
        try:
            yield opened.gen
        finally:
            self._pin.opened = None
            with self._lock:
                opened.users -= 1
                if opened.retired and opened.users == 0:
                    opened.gen.close()

    def release(self) -> None:
        """Let go of the generation open (reopened on next use); calls pinning it keep it until
        they end."""
        with self._lock:
            cur, self._cur = self._cur, None
            self._refused = None
            if cur is not None:
                _retire(cur)


def _retire(opened: Opened) -> None:
    """No longer the generation new calls read: closed now, or by the last call pinning it."""
    opened.retired = True
    if opened.users == 0:
        opened.gen.close()
