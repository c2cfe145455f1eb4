"""A question scoped to some files: which chunks a pattern names, and search within them.

Users of a corpus that mixes many subjects in one index — one file of reviews a product, one
manual a release — ask about one of them; the peers' answer is a metadata filter (LlamaIndex
``MetadataFilters`` on ``file_path``, LangChain's ``filter`` search argument). Here the filter is
over where the text came from, which every index records: ``sources`` is a display path (as
``Source.path`` shows it: ``reviews/B00X.txt``), a folder (``reviews``: everything under it), or
a glob over either (``reviews/B00*.txt``, ``*.md``), each matched as
:meth:`pathlib.PurePath.match` does: a relative pattern from the right, ``*`` within one part of
the path. An absolute pattern is matched against the stored absolute paths (a local user's). A
chunk is in scope when any of its sources is (a duplicate kept from two files is in both).

Dense search within a scope scores the scope's own vectors exactly when it is small (what FAISS's
documentation advises for a selective filter: an approximate store searched first and filtered
after can return fewer than ``k``), and otherwise searches the store for proportionally more
candidates, filters them, and falls back to the exact scores when too few survive. BM25 reads
proportionally more candidates the same way. So a scoped search returns the ``k`` best chunks of
the scope, never a chunk outside it, and never fewer than the scope holds; a chunk kept from
several files lists its sources in scope first, so that it is cited from the file asked about.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from ..errors import ArgumentTypeError, ConfigError

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import ArrayLike, NDArray

    from ..types import Hit
    from .reader import Opened
    from .roots import Roots
    from .storage import Generation

#: What a caller passes as ``sources``: one pattern or a list of them.
Sources = str | Sequence[str]

#: A scope of at most this many chunks is scored exactly (one matrix product over its rows:
#: ~15 MB of float32 MiniLM vectors, a few milliseconds), whatever store the index searches with.
EXACT_SCOPE_MAX = 10_000

#: Scopes kept per open generation (a server answering questions about a few products at a time).
SCOPES_KEPT = 64


def source_patterns(sources: Sources) -> tuple[str, ...]:
    """``sources`` as a tuple of patterns, checked: one string, or a list of them, none empty."""
    items = [sources] if isinstance(sources, str) else sources
    if isinstance(items, (bytes, bytearray)) or not isinstance(items, Sequence):
        raise ArgumentTypeError(f"sources must be a path pattern or a list of them, got {type(sources).__name__}")
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ArgumentTypeError(f"sources must be path patterns (strings), got {type(item).__name__}")
        pattern = item.strip().replace("\\", "/").rstrip("/")
        if not pattern:
            raise ConfigError("a source pattern is empty; name a file, a folder or a glob such as 'reviews/*.txt'")
        out.append(pattern)
    if not out:
        raise ConfigError("sources is an empty list; leave it out to search every file")
    return tuple(dict.fromkeys(out))


def matches(pattern: str, stored: str, shown: str) -> bool:
    """Whether ``pattern`` names the file ``stored`` (its absolute path), shown as ``shown`` (its
    display path): the file itself or any folder above it, by :meth:`PurePath.match`."""
    target = PurePosixPath(stored.replace("\\", "/") if pattern.startswith("/") else shown)
    if str(target) == pattern:
        return True
    try:
        return any(p.match(pattern) for p in (target, *target.parents) if str(p) not in (".", "/"))
    except ValueError:  # a pattern PurePath cannot read ("a//b" is normalized, but be safe)
        return False


def resolve(gen: Generation, roots: Roots, patterns: tuple[str, ...]) -> frozenset[int]:
    """The ids of every chunk with a source in a file ``patterns`` names. Raises
    :class:`~ragbudget.errors.ConfigError` for a pattern that names no file the index knows, and
    for files that hold no indexed text (all skipped), so that a typo is not read as "the
    documents do not say"."""
    catalog = gen.catalog
    paths = catalog.file_paths()
    chosen: dict[str, None] = {}
    for pattern in patterns:
        named = [p for p in paths if matches(pattern, p, roots.display(p))]
        if not named:
            shown = ", ".join(sorted(roots.labels())) or "none recorded"
            raise ConfigError(
                f"no indexed file matches the source {pattern!r} ({len(paths)} files, roots: {shown}); "
                "name a display path as the answers' sources show it, a folder, or a glob such as "
                "'reviews/*.txt' (`ragbudget sources` lists the files)"
            )
        chosen.update(dict.fromkeys(named))
    ids = frozenset(cid for path in chosen for cid, _ in catalog.sources_in(path))
    if not ids:
        raise ConfigError(
            f"the {len(chosen)} file(s) matching {', '.join(map(repr, patterns))} hold no indexed text "
            "(skipped when the index was built: `ragbudget sources` says why)"
        )
    return ids


def cached_scope(opened: Opened, patterns: tuple[str, ...]) -> frozenset[int]:
    """:func:`resolve` in the generation ``opened``, kept there (a generation never changes)."""
    got = opened.scopes.get(patterns)
    if got is None:
        got = resolve(opened.gen, opened.roots, patterns)
        if len(opened.scopes) >= SCOPES_KEPT:
            opened.scopes.pop(next(iter(opened.scopes)))
        opened.scopes[patterns] = got
    return got


def _total(gen: Generation) -> int:
    """The vectors the generation searches (its manifest's count)."""
    return int((gen.manifest.get("counts") or {}).get("vectors") or 0)


def in_scope_first(hits: list[Hit], patterns: tuple[str, ...], roots: Roots) -> list[Hit]:
    """``hits`` with each one's sources in scope listed first: a chunk kept from two files is
    cited from the one the question was scoped to (the other stays listed after it)."""
    out = []
    for hit in hits:
        inside = [s for s in hit.sources if _named(patterns, s.path, roots)]
        first = inside + [s for s in hit.sources if s not in inside]
        out.append(hit if first == list(hit.sources) else replace(hit, sources=tuple(first)))
    return out


def _named(patterns: tuple[str, ...], path: str, roots: Roots) -> bool:
    stored = roots.absolute(path) or path
    return any(matches(p, stored, roots.display(stored)) for p in patterns)


def dense_in(gen: Generation, vector: ArrayLike, k: int, scope: frozenset[int]) -> list[tuple[int, float]]:
    """``(chunk_id, cosine)`` of the ``k`` chunks of ``scope`` nearest ``vector``, best first."""
    import numpy as np

    total = _total(gen)
    q = np.asarray(vector, dtype=np.float32).reshape(1, -1)
    if len(scope) > EXACT_SCOPE_MAX and total > 0:
        # A wide scope: the store's own (fast, maybe approximate) search, for as many more
        # candidates as the scope is rarer than the index, twice over.
        want = min(total, k * 2 * math.ceil(total / len(scope)))
        scores, ids = gen.search.search(np.ascontiguousarray(q), want)
        found = [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0 and int(i) in scope]
        if len(found) >= k or want >= total:
            return found[:k]
    return _exact_top(gen, q[0], sorted(scope), k)


def _exact_top(gen: Generation, q: NDArray[np.float32], ids: list[int], k: int) -> list[tuple[int, float]]:
    import numpy as np

    best: list[tuple[int, float]] = []
    for lo in range(0, len(ids), EXACT_SCOPE_MAX):
        part = ids[lo : lo + EXACT_SCOPE_MAX]
        try:
            rows = gen.exact.vectors(part)
        except KeyError:  # an id without a vector (verify reports such an index): score the rest
            known = set(gen.exact.ids().tolist())
            part = [i for i in part if i in known]
            rows = gen.exact.vectors(part)
        scores = rows @ q
        top = np.argsort(-scores, kind="stable")[:k]
        best.extend((int(part[j]), float(scores[j])) for j in top)
    best.sort(key=lambda p: -p[1])
    return best[:k]


def lexical_in(gen: Generation, query: str, k: int, scope: frozenset[int]) -> list[tuple[int, float]]:
    """``(chunk_id, bm25)`` of the ``k`` best BM25 chunks of ``scope``: the catalog's ranking over
    the whole index (so the scores are the index's), read deep enough to find ``k`` in the scope."""
    total = _total(gen)
    want = min(max(total, k), k * 2 * math.ceil(max(total, 1) / max(len(scope), 1)))
    pairs = gen.catalog.lexical(query, want, trusted=bool(gen.manifest.get("lexical")))
    return [(i, s) for i, s in pairs if i in scope][:k]
