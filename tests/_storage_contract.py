"""What every storage must do, checked the same way on each: the local folder, PostgreSQL, and a
storage another package registers (tests/test_storage_plugins.py runs it in a fresh interpreter
with that package installed). Written against the public API only — ``open_storage`` and the
:class:`~ragbudget.retrieval.storage.Storage` contract, ``Pipeline`` and ``Index`` — so a plugin
author can run it on theirs: ``check_storage(location, folder)``.

An empty location is no index (one-line errors, nothing created by a reader); an index builds,
searches (scoped to a file too) and names its sources; a second run adds a file as a new generation that a reader
follows while a reader pinned before keeps its own; an unchanged run commits nothing; one writer
at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FACTS = {
    "harbour.md": "# Harbour\n\nThe keeper of the Port Ellery lighthouse is Maren Voss.\n",
    "orchard.md": "# Orchard\n\nThe orchard grows the Quillon pear, which ripens in late October.\n",
}
ADDED = ("bridge.md", "# Bridge\n\nThe Tessaly bridge has nine arches of red sandstone.\n")


def _top(pipe: Any, query: str) -> str:
    hits = pipe.search(query, k=1)
    assert hits, f"no hit for {query!r}"
    return Path(hits[0].sources[0].path).name


def check_storage(where: str, folder: Path) -> dict[str, Any]:
    """Run the contract on the (empty) location ``where`` with documents written into ``folder``;
    what was seen, for the caller's own asserts."""
    from ragbudget import Pipeline
    from ragbudget.errors import IndexLockedError, IndexNotFoundError
    from ragbudget.retrieval.index import Index
    from ragbudget.retrieval.storage import open_storage

    storage = open_storage(where)
    assert storage.exists() is False
    for call in (storage.read_manifest, storage.current_generation):
        try:
            call()
        except IndexNotFoundError as exc:
            assert "\n" not in str(exc)
        else:
            raise AssertionError(f"{call.__name__} on an empty location did not raise IndexNotFoundError")
    assert storage.exists() is False  # reading created nothing

    folder.mkdir(parents=True, exist_ok=True)
    for name, text in FACTS.items():
        (folder / name).write_text(text, encoding="utf-8")
    with Pipeline(index_dir=where) as pipe:
        first = pipe.index([folder])
        assert first.committed and first.generation == 1 and first.chunks_total >= 2
        assert storage.exists() and storage.current_generation() == 1
        manifest = storage.read_manifest()
        assert int(manifest["generation"]) == 1
        assert _top(pipe, "Who keeps the lighthouse?") == "harbour.md"
        assert _top(pipe, "When does the pear ripen?") == "orchard.md"
        # Scoped to one file, a search reads only that file's chunks (the storage's catalog
        # resolves the pattern; its exact rows score them).
        scoped = pipe.search("Who keeps the lighthouse?", k=3, sources="orchard.md")
        assert scoped and {Path(s.path).name for h in scoped for s in h.sources} == {"orchard.md"}

    reader = Index(where)
    with reader.pinned() as pinned:
        (folder / ADDED[0]).write_text(ADDED[1], encoding="utf-8")
        with Pipeline(index_dir=where) as pipe:
            second = pipe.index([folder])
            assert second.committed and second.generation == 2
            assert storage.current_generation() == 2
            assert _top(pipe, "How many arches does the bridge have?") == "bridge.md"
        # A reader pinned before the commit still reads its own generation, whole.
        assert pinned.number == 1
    with reader.pinned() as followed:
        assert followed.number == 2  # and the next request follows the writer
    assert Path(reader.search("red sandstone arches", k=1)[0].sources[0].path).name == "bridge.md"
    reader.close()

    with Pipeline(index_dir=where) as pipe:
        again = pipe.index([folder])
    assert storage.current_generation() == 2 and not again.committed  # nothing changed: nothing written

    with storage.lock():
        try:
            with open_storage(where).lock():
                pass
        except IndexLockedError as exc:
            locked = str(exc)
        else:
            raise AssertionError("a second writer took the lock")
    assert "\n" not in locked
    with open_storage(where).lock():  # released on exit
        pass
    return {"where": storage.where, "chunks": second.chunks_total, "locked": locked}
