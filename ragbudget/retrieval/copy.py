"""Copy an index between storages without re-embedding: a local folder into PostgreSQL or back.

:func:`copy_index` reads the source's current generation through the storage seam (its catalog
and its exact vectors) and writes it as the destination's next generation, under the
destination's writer lock and through its atomic commit: chunks, sources, files, roots, sentence
vectors and vectors, nothing embedded. Chunk ids are the destination's own (a local catalog
numbers rows as it inserts them; texts, sources and vectors are the same, so exact search answers
the same chunks with the same scores). The copy searches exactly; a ``ragbudget index`` run with
``--store`` on the destination derives an approximate store from the copied vectors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import IndexCorruptError, IndexNotFoundError
from .rows import encode_sentence_rows

if TYPE_CHECKING:
    from .storage import Generation, Manifest, Storage

__all__ = ["copy_index"]

log = logging.getLogger(__name__)

#: Manifest entries a storage writes for itself at commit (or that name its files): not copied.
_STORAGE_KEYS = ("format", "format_version", "generation", "faiss", "approx", "sqlite", "lexical", "storage")
#: Chunks read and written per round (bounded memory on a large index).
_ROUND = 2048


def copy_index(source: Storage, dest: Storage, *, progress: Callable[[int, int], None] | None = None) -> Manifest:
    """Copy ``source``'s current generation into ``dest`` as its next generation; its manifest.
    ``progress(done, total)`` after each round of chunks."""
    import numpy as np

    from .vectors import FlatStore

    m = source.read_manifest()
    src = source.open(m, search_store=False)
    try:
        with dest.lock():
            base = _current(dest)
            writer = dest.begin(base, keep=False)
            try:
                cat = writer.catalog
                dim = int(m["dim"])
                labels = src.catalog.page_labels()
                rows = {f.path: f for f in src.catalog.files()}
                for path, st in src.catalog.file_states().items():
                    f = rows[path]
                    cat.record_file(
                        path,
                        st.size,
                        st.mtime_ns,
                        st.sha256,
                        st.status,
                        st.reason,
                        st.detail,
                        n_chunks=f.n_chunks,
                        furniture=f.furniture,
                        pages=f.n_pages,
                        warning=f.warning,
                        page_labels=labels.get(path),
                        needs=st.needs,
                    )
                cat.set_roots(src.catalog.roots())
                ids = np.sort(src.catalog.chunk_ids())
                exact = FlatStore(dim)
                sentences = dict(m.get("sentences") or {})
                dtype = str(sentences.get("dtype", "float16"))
                for lo in range(0, len(ids), _ROUND):
                    part = [int(i) for i in ids[lo : lo + _ROUND]]
                    chunks, keys = src.catalog.chunks(part), src.catalog.chunk_keys(part)
                    sources = src.catalog.sources(part)
                    new: dict[int, int] = {}
                    for old in part:
                        c = chunks[old]
                        h, minhash = keys[old]
                        cid = cat.add_chunk(c.text, c.n_tokens, c.headings, h, minhash)
                        new[old] = cid
                        for s in sources.get(old, ()):
                            cat.add_source(cid, s)
                    cat.set_windows((new[i], chunks[i].windows) for i in part)
                    exact.add(np.array([new[i] for i in part], dtype=np.int64), src.exact.vectors(part))
                    stored = src.catalog.sentence_vectors(part, dim=dim, dtype=dtype)
                    cat.put_sentence_vectors(
                        (new[i], *encode_sentence_rows(d, v, dtype)) for i, (d, v) in stored.items()
                    )
                    if progress is not None:
                        progress(min(lo + _ROUND, len(ids)), len(ids))
                fields: dict[str, Any] = {k: v for k, v in m.items() if k not in _STORAGE_KEYS}
                fields["store"] = {"requested": "flat", "kind": "flat", "recall_at_10": 1.0}
                fields["counts"] = {**cat.counts(), "vectors": exact.ntotal}
                fields["copied_from"] = {"where": source.where, "generation": m["generation"]}
                return writer.commit(fields, exact=exact, search=None)
            finally:
                writer.close()
                if base is not None:
                    base.close()
    finally:
        src.close()


def _current(dest: Storage) -> Generation | None:
    """The destination's current generation (kept for its readers while the copy is written),
    or ``None``."""
    try:
        return dest.open(dest.read_manifest(), search_store=False)
    except (IndexNotFoundError, IndexCorruptError):
        return None
