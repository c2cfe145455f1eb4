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

import functools
import math
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import PureWindowsPath
from typing import TYPE_CHECKING, Any

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

#: Patterns whose resolution is kept per open generation (a server answering questions about a
#: few products at a time), and the chunk ids they may hold in all (a set of a million ids is
#: about 40 MB: a few wide scopes, or many narrow ones).
SCOPES_KEPT = 64
SCOPE_IDS_KEPT = 2_000_000

#: A scope over EXACT_SCOPE_MAX chunks is searched through the index's store when it holds at
#: least one chunk in this many of the index; a rarer one is scored exactly.
WIDE_SHARE = 10


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


def scope_of(sources: Sources | None) -> tuple[str, ...] | None:
    """:func:`source_patterns` of ``sources``, or ``None`` (no scope: every file) for ``None``."""
    return None if sources is None else source_patterns(sources)


def is_absolute(pattern: str) -> bool:
    """Whether ``pattern`` (slashes normalized) names absolute paths: ``/...`` or ``C:/...``."""
    return pattern.startswith("/") or PureWindowsPath(pattern).is_absolute()


def _part(glob: str) -> str:
    """One path part of a glob as a regular expression: ``*`` and ``?`` stay within the part."""
    out, i = [], 0
    while i < len(glob):
        c = glob[i]
        close = glob.find("]", i + 2) if c == "[" else -1
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif close != -1:
            body = glob[i + 1 : close].replace("\\", "\\\\")
            body = "^" + body[1:] if body.startswith("!") else "\\" + body if body.startswith("^") else body
            out.append("[" + body + "]")
            i = close
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


@functools.lru_cache(maxsize=256)
def _pattern_re(pattern: str) -> re.Pattern[str]:
    """``pattern`` as a regular expression over a path: the file itself or any folder above it,
    whole parts only, as :meth:`PurePath.match` reads a pattern (a relative one from the right,
    an absolute one from the root); ``**`` is one part, like ``*``."""
    body = "/".join(_part(p) for p in pattern.split("/"))
    return re.compile(("^" if is_absolute(pattern) else "(?:^|/)") + body + "(?:/|$)")


def matches(pattern: str, stored: str, shown: str) -> bool:
    """Whether ``pattern`` names the file ``stored`` (its absolute path), shown as ``shown`` (its
    display path): the file itself or any folder above it."""
    target = stored.replace("\\", "/") if is_absolute(pattern) else shown
    return _pattern_re(pattern).search(target) is not None


def _resolve_one(gen: Generation, roots: Roots, pattern: str, paths: list[str]) -> Resolved:
    """The chunk ids of the files ``pattern`` names, and how many files it names."""
    named = [p for p in paths if matches(pattern, p, roots.display(p))]
    if len(named) == len(paths):  # every file (``*``, a root): every chunk, in one read
        return frozenset(int(i) for i in gen.catalog.chunk_ids().tolist()), len(named)
    return frozenset(cid for path in named for cid, _ in gen.catalog.sources_in(path)), len(named)


#: Each pattern's resolution: its chunk ids, and how many files it names.
Resolved = tuple[frozenset[int], int]


def resolve(
    gen: Generation, roots: Roots, patterns: tuple[str, ...], kept: dict[str, Resolved] | None = None
) -> frozenset[int]:
    """The ids of every chunk with a source in a file ``patterns`` names. Raises
    :class:`~ragbudget.errors.ConfigError` for a pattern that names no file the index knows, or
    only files that hold no indexed text (all skipped), so that a typo is not read as "the
    documents do not say". ``kept``: each pattern's resolution, read and filled (a generation's)."""
    paths: list[str] | None = None
    found: list[frozenset[int]] = []
    for pattern in patterns:
        got = kept.get(pattern) if kept is not None else None
        if got is None:
            paths = gen.catalog.file_paths() if paths is None else paths
            got = _resolve_one(gen, roots, pattern, paths)
            if kept is not None:
                with _KEPT_LOCK:  # requests in other threads resolve and evict too
                    held = sum(len(ids) for ids, _ in kept.values())
                    while kept and (len(kept) >= SCOPES_KEPT or held + len(got[0]) > SCOPE_IDS_KEPT):
                        dropped = kept.pop(next(iter(kept)), None)
                        held -= len(dropped[0]) if dropped is not None else 0
                    kept[pattern] = got
        ids, files = got
        if not files:
            shown = ", ".join(sorted(roots.labels())) or "none recorded"
            total = len(paths) if paths is not None else len(gen.catalog.file_paths())
            raise ConfigError(
                f"no indexed file matches the source {pattern!r} ({total} files, roots: {shown}); "
                "name a display path as the answers' sources show it, a folder, or a glob such as "
                "'reviews/*.txt' (`ragbudget sources` lists the files)"
            )
        if not ids:
            raise ConfigError(
                f"the {files} file(s) matching {pattern!r} hold no indexed text "
                "(skipped when the index was built: `ragbudget sources` says why)"
            )
        found.append(ids)
    return found[0] if len(found) == 1 else frozenset().union(*found)


#: Guards the eviction and insertion of kept resolutions (resolving itself runs outside it).
_KEPT_LOCK = threading.Lock()


def cached_scope(opened: Opened, patterns: tuple[str, ...]) -> frozenset[int]:
    """:func:`resolve` in the generation ``opened``, each pattern's resolution kept there (a
    generation never changes; a request scoped to several patterns reuses each one's)."""
    return resolve(opened.gen, opened.roots, patterns, kept=opened.scopes)


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


def query_row(vector: ArrayLike, manifest: Mapping[str, Any]) -> NDArray[np.float32]:
    """``vector`` as the one-row float32 matrix a store searches with; a one-line error when its
    dimension is not the index's (``manifest["dim"]``), before any store sees it."""
    import numpy as np

    q = np.ascontiguousarray(np.asarray(vector, dtype=np.float32).reshape(1, -1))
    dim = int(manifest["dim"])
    if q.shape[1] != dim:
        raise ConfigError(f"query vector has dimension {q.shape[1]}, the index has {dim}")
    return q


def dense_in(gen: Generation, vector: ArrayLike, k: int, scope: frozenset[int]) -> list[tuple[int, float]]:
    """``(chunk_id, cosine)`` of the ``k`` chunks of ``scope`` nearest ``vector``, best first."""
    total = _total(gen)
    q = query_row(vector, gen.manifest)
    if len(scope) > EXACT_SCOPE_MAX and len(scope) * WIDE_SHARE >= total > 0:
        # A wide scope: the store's own (fast, maybe approximate) search, for as many more
        # candidates as the scope is rarer than the index, twice over (at most 2 x WIDE_SHARE x k:
        # a rarer scope is scored exactly, in batches, rather than asking the store for thousands).
        want = min(total, k * 2 * math.ceil(total / len(scope)))
        scores, ids = gen.search.search(q, want)
        found = [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0 and int(i) in scope]
        if len(found) >= min(k, len(scope)):  # else too few (an IVF or pgvector store stops short)
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
    the whole index (so the scores are the index's), read deeper (four times, each time) until
    ``k`` of the scope are found or every match was read: a query word more common outside the
    scope than in it pushes the scope's matches down the ranking."""
    total = _total(gen)
    want = max(k, min(total, k * 2 * math.ceil(max(total, 1) / max(len(scope), 1))))
    trusted = bool(gen.manifest.get("lexical"))
    while True:
        pairs = gen.catalog.lexical(query, want, trusted=trusted)
        found = [(i, s) for i, s in pairs if i in scope]
        if len(found) >= k or len(pairs) < want or want >= total:
            return found[:k]
        want = min(total, want * 4)
