"""Structure-aware chunking with exact token counts and exact character offsets.

:func:`chunk_text` cuts a text into chunks of ``min_tokens``–``max_tokens`` tokens, preferring (in
this order) a heading, a blank-line paragraph break, a line break after a sentence or before a list
item, a sentence end inside a line, any other line break, a word boundary, and, only for a "word"
longer than ``max_tokens`` on its own, a token boundary. Every chunk satisfies
``text[c.start:c.end] == c.text`` and ``c.n_tokens == len(tokenizer.encode(c.text))``.

How it stays about as fast as one tokenizer pass
------------------------------------------------
The document is encoded **once** (tiktoken, into a numpy buffer); the character offset of every
token boundary is recovered from the byte length of each token id (a vectorised lookup), so the
token count between any two positions is a ``searchsorted``. Boundaries are found with a handful
of regular expressions over the whole text, and cuts are planned on those numbers.

BPE is not additive over concatenation in general, but tiktoken's ``cl100k_base`` first splits the
text with a regular expression and merges only inside each piece. At some positions the split is
provably *local*: cutting there gives the same pieces on both sides as in the whole text (see
:data:`_EXACT_POINT`: the end of a word followed by a space, a letter or digit followed by a line
break, the start of a line that has text). Between two such points the count read from the
whole-text encoding is exact, so a chunk's exact count only needs its first and last few
characters re-encoded. Other tokenizers (Hugging Face, o200k, custom) take the slower, equally
exact path: every chunk is re-encoded and shrunk if it ran over.
"""

from __future__ import annotations

import bisect
import functools
import gc
import itertools
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import numpy.typing as npt

from ..settings import ChunkSettings, check_sizes
from ..tokens import TiktokenTokenizer, Tokenizer, get_tokenizer
from ..types import Chunk, Document
from .boundaries import HEADING, find_boundaries, heading_paths

if TYPE_CHECKING:
    from tiktoken import Encoding

__all__ = ["chunk_document", "chunk_text", "chunk_texts"]

# What get_tokenizer takes: None (the default encoding), a tiktoken encoding's name, a Tokenizer,
# a callable, or a Hugging Face tokenizer object; the last is a third-party type, hence Any.
TokenizerSpec: TypeAlias = Any

# Unicode White_Space, spelled out: Python's ``\s`` also matches U+001C..U+001F, which the
# tokenizer's regex (Rust ``\s``) does not, and the exactness argument depends on agreeing with it.
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_WS_NONL = "\t\x0b\x0c \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"

# Positions where cl100k's pre-tokenizer splits the text the same way whether or not the text is
# cut there (so token counts add up across the cut):
#  (a) after a non-space, before a space that is not a line break;
#  (b) after a letter or digit, before a line break (after punctuation, "[\r\n]*" glues the
#      newlines to the punctuation piece, so that is NOT such a point);
#  (c) after "\n", before spaces-then-text (a blank line or trailing spaces would merge pieces).
_EXACT_POINT = re.compile(rf"(?<=[^{_WS}])(?=[{_WS_NONL}])|(?<=[^\W_])(?=[\r\n])|(?<=\n)(?=[{_WS_NONL}]*[^{_WS}])")
#: Below this many characters re-encoding a chunk is as cheap as patching its ends (the exact
#: fast path: whole-text counts, the chunk's ends re-encoded); 0 takes the fast path always.
FAST_MIN_CHARS = 64
# cl100k_base's pre-tokenizer pattern: the exact fast path is enabled only for this pattern.
_CL100K_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)

# Word boundaries, for the cut of a window without a structural boundary and for overlap starts.
_WORD_RE = re.compile(rf"[{_WS}]+")
_WORD_START = re.compile(rf"[{_WS}]+(?=[^{_WS}])")


def chunk_text(
    text: str,
    *,
    min_tokens: int = ChunkSettings.min_tokens,
    max_tokens: int = ChunkSettings.max_tokens,
    overlap: int = ChunkSettings.overlap,
    tokenizer: TokenizerSpec = None,
) -> list[Chunk]:
    """Cut ``text`` into chunks of at most ``max_tokens`` tokens, preferring structural boundaries.

    Chunks hold between ``min_tokens`` and ``max_tokens`` tokens, except the last chunk of the
    text (a short tail is avoided when possible: cuts that would leave fewer than ``min_tokens``
    behind are used only when nothing else fits) and text that cannot be cut at a word boundary
    inside the window. ``overlap`` repeats about that many tokens of the previous chunk at the
    start of the next one (starting at a word). Leading and trailing whitespace is never part of
    a chunk; a text that is only whitespace gives no chunks. The result is deterministic.

    >>> text = "# Setup\\n\\nInstall it. Then run it.\\n\\n## Usage\\n\\nCall chunk_text on a string."
    >>> [(c.text, c.n_tokens, c.headings) for c in chunk_text(text, min_tokens=4, max_tokens=12)]
    [('# Setup\\n\\nInstall it. Then run it.', 10, ('Setup',)),
     ('## Usage\\n\\nCall chunk_text on a string.', 10, ('Setup', 'Usage'))]
    """
    check_sizes(min_tokens, max_tokens, overlap)
    tok = get_tokenizer(tokenizer)
    return _Chunker(text, tok, min_tokens, max_tokens, overlap).run()


def chunk_texts(
    texts: Sequence[str],
    *,
    min_tokens: int = ChunkSettings.min_tokens,
    max_tokens: int = ChunkSettings.max_tokens,
    overlap: int = ChunkSettings.overlap,
    tokenizer: TokenizerSpec = None,
    workers: int = 1,
) -> list[list[Chunk]]:
    """:func:`chunk_text` over many texts, in order; ``workers > 1`` spreads them over processes.

    The boundary planning is Python and holds the GIL, so threads only overlap tiktoken's
    encoding; worker *processes* run whole texts side by side. They are used when the batch is
    large enough to repay starting them (:data:`PROCESS_MIN_CHARS`) and the tokenizer can be
    rebuilt from its name in a worker (tiktoken encodings: the default). Otherwise, e.g. with a
    Hugging Face tokenizer object, a thread pool is used. The result is the same either way.

    ``workers=1`` is one process but not always one thread: a text of at least
    :data:`PARALLEL_ENCODE_MIN_CHARS` characters is encoded by tiktoken in helper threads (at most
    one per core) while its boundaries are planned; worker processes turn that off, since they
    already use the cores.

    >>> [len(cs) for cs in chunk_texts(["One short text.", "", "Another one."], workers=2)]
    [1, 0, 1]
    """
    check_sizes(min_tokens, max_tokens, overlap)
    tok = get_tokenizer(tokenizer)
    texts = list(texts)
    if workers <= 1 or len(texts) < 2:
        return [_Chunker(t, tok, min_tokens, max_tokens, overlap).run() for t in texts]
    total = sum(map(len, texts))
    if isinstance(tok, TiktokenTokenizer) and total >= PROCESS_MIN_CHARS:
        return _chunk_in_processes(texts, tok.name, (min_tokens, max_tokens, overlap), workers)

    def one(t: str) -> list[Chunk]:
        return _Chunker(t, tok, min_tokens, max_tokens, overlap).run()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, texts))


def chunk_document(
    doc: Document,
    *,
    min_tokens: int = ChunkSettings.min_tokens,
    max_tokens: int = ChunkSettings.max_tokens,
    overlap: int = ChunkSettings.overlap,
    tokenizer: TokenizerSpec = None,
) -> list[Chunk]:
    """:func:`chunk_text` over ``doc.text``, with ``page_start``/``page_end`` set when paginated.

    Pages are 1-based and taken from :meth:`Document.page_of` of the chunk's first and last
    character, so a chunk running over a page break says so.

    >>> d = Document(path="a.txt", pages=["Page one has some text.", "Page two has more."])
    >>> [(c.page_start, c.page_end) for c in chunk_document(d, min_tokens=1, max_tokens=8)]
    [(1, 1), (2, 2)]
    """
    text = doc.text
    chunks = chunk_text(text, min_tokens=min_tokens, max_tokens=max_tokens, overlap=overlap, tokenizer=tokenizer)
    if not doc.paginated:
        return chunks
    starts = doc.page_starts
    out = []
    for c in chunks:
        first = max(1, bisect.bisect_right(starts, c.start))
        last = max(1, bisect.bisect_right(starts, max(c.start, c.end - 1)))
        out.append(Chunk(c.text, c.start, c.end, c.n_tokens, c.headings, page_start=first, page_end=last))
    return out


@functools.lru_cache(maxsize=4)
def _token_char_counts(enc: Encoding) -> npt.NDArray[np.int64]:
    """For every token id: how many UTF-8 lead bytes (characters begun) its bytes hold.

    Summed over a text's tokens this gives character offsets of the token boundaries without
    decoding anything; a token ending inside a multi-byte character maps to that character's
    end (its lead byte was counted already).
    """
    counts = np.zeros(enc.n_vocab, dtype=np.int64)
    for b, rank in enc._mergeable_ranks.items():
        counts[rank] = sum(1 for byte in b if byte & 0xC0 != 0x80)
    return counts


def _fast_encoding(tok: Tokenizer) -> Encoding | None:
    """The tiktoken ``Encoding`` when the exact fast path applies, else ``None``."""
    if not isinstance(tok, TiktokenTokenizer):
        return None
    enc: Encoding = tok._enc
    if getattr(enc, "_pat_str", None) != _CL100K_PAT or not hasattr(enc, "_mergeable_ranks"):
        return None
    return enc


class _Chunker:
    """One text's chunking state; :meth:`run` returns the chunks."""

    def __init__(self, text: str, tok: Tokenizer, lo: int, hi: int, overlap: int) -> None:
        self.text, self.tok, self.lo, self.hi, self.overlap = text, tok, lo, hi, overlap
        self.enc = _fast_encoding(tok)

    # -- token positions -------------------------------------------------------------------

    def _token_boundaries(self) -> npt.NDArray[np.int64]:
        """Character offset of every token boundary (``tb[0] == 0``, ``tb[-1] == len(text)``)."""
        text = self.text
        if self.enc is not None:
            ids = self.enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
            tb = np.zeros(len(ids) + 1, dtype=np.int64)
            np.cumsum(_token_char_counts(self.enc)[ids], out=tb[1:])
            return tb
        # Generic tokenizer: count per line and spread each line's tokens evenly over its
        # characters. Only used for planning; final counts are re-encoded exactly.
        points = [0]
        pos = 0
        for line in text.splitlines(keepends=True):
            n = self.tok.count(line)
            for k in range(1, n + 1):
                points.append(pos + round(len(line) * k / n))
            pos += len(line)
        if len(points) > 1:
            points[-1] = len(text)
        return np.asarray(points, dtype=np.int64)

    # -- exact counts --------------------------------------------------------------------------

    def _count(self, s: int, e: int) -> int:
        """Exact token count of ``text[s:e]``."""
        text = self.text
        if self.enc is None or e - s < FAST_MIN_CHARS:
            return self.tok.count(text[s:e])
        # A chunk that starts a line starts at an exact point; one that ends a sentence inside
        # a line, a word before a line break, or the text, ends at one: that end needs no
        # re-encoding (when it is also a token boundary, checked below).
        s_exact = s == 0 or (text[s - 1] == "\n" and not text[s].isspace())
        e_exact = (
            e == len(text)
            or (not text[e - 1].isspace() and text[e] in _WS_NONL_CHARS)
            or (text[e - 1].isascii() and text[e - 1].isalnum() and text[e] in "\r\n")
        )
        # Otherwise the first and last exact points strictly inside the chunk; between them the
        # whole-text encoding is exact (module docstring), so only the two ends are re-encoded.
        # The usual point is a word end before a plain space, found with str.find; the regex is
        # the fallback for text without such spaces.
        p1 = s if s_exact else _space_point(text, s + 1, e, last=False)
        p2 = e if e_exact else _space_point(text, s + 1, e, last=True)
        if p1 < 0 or p2 < 0:
            head = _EXACT_POINT.search(text, s + 1, min(e, s + 400))
            tail = None
            for m in _EXACT_POINT.finditer(text, max(s + 1, e - 400), e):
                tail = m
            if head is None or tail is None:
                return self.tok.count(text[s:e])
            p1, p2 = head.start(), tail.start()
        if p2 <= p1:
            return self.tok.count(text[s:e])
        if p2 < e and not self._exact_inside(p2, e):
            return self.tok.count(text[s:e])
        tb = self.tb
        # A token ending inside a multi-byte character maps to that character's end, so a
        # position may appear more than once in tb: the last one has every such token before it.
        k1 = int(tb.searchsorted(p1, side="right")) - 1
        k2 = int(tb.searchsorted(p2, side="right")) - 1
        if tb[k1] != p1 or tb[k2] != p2:  # not a token boundary: the argument does not hold
            return self.tok.count(text[s:e])
        head_n = self.tok.count(text[s:p1]) if p1 > s else 0
        tail_n = self.tok.count(text[p2:e]) if p2 < e else 0
        return head_n + (k2 - k1) + tail_n

    def _exact_inside(self, p: int, e: int) -> bool:
        """A type-(c) point must see its line's text before ``e``; (a)/(b) are local."""
        if self.text[p - 1] != "\n":
            return True
        q = p
        while q < e and self.text[q] in " \t\x0b\x0c\x85\xa0":
            q += 1
        return q < e

    # -- planning ----------------------------------------------------------------------------

    def _ti(self, pos: int) -> int:
        return int(self.tb.searchsorted(pos))

    def run(self) -> list[Chunk]:
        text = self.text
        stripped = text.strip()
        if not stripped:
            return []
        doc_start = len(text) - len(text.lstrip())
        doc_end = len(text.rstrip())
        if self.enc is not None and len(text) >= PARALLEL_ENCODE_MIN_CHARS:
            # tiktoken releases the GIL: the text is encoded in helper threads (in pieces cut at
            # line starts, where the encoding provably splits the same way, so the ids are
            # those of one whole-text encode) while this thread finds the boundaries.
            pool = _encode_pool()
            pieces = min(cores(), len(text) // PARALLEL_PIECE_CHARS + 1)
            cuts = [0, *_line_start_cuts(text, pieces), len(text)]
            enc = self.enc
            futures = [
                pool.submit(enc.encode_to_numpy, text[a:b], allowed_special=set(), disallowed_special=())
                for a, b in itertools.pairwise(cuts)
            ]
            found = find_boundaries(text)
            ids = np.concatenate([f.result() for f in futures])
            self.tb = tb = np.zeros(len(ids) + 1, dtype=np.int64)
            np.cumsum(_token_char_counts(enc)[ids], out=tb[1:])
        else:
            self.tb = tb = self._token_boundaries()
            found = find_boundaries(text)
        headings = found.headings
        c_ti = tb.searchsorted(found.ends).tolist()
        c_end, c_next, c_lvl = found.ends.tolist(), found.nexts.tolist(), found.levels.tolist()
        t_end = self._ti(doc_end)
        head_pos = [h.start for h in headings]
        paths = heading_paths(headings)

        chunks: list[Chunk] = []
        s = doc_start
        guard = 0
        while s < doc_end:
            guard += 1
            if guard > 4 * len(text) + 10:  # cannot happen; a safety net against a planning bug
                raise RuntimeError("chunker made no progress")
            t_s = self._ti(s)
            budget = self.hi
            while True:
                e, nxt = self._choose(s, t_s, t_end, doc_end, budget, c_end, c_next, c_lvl, c_ti)
                # Separators are whitespace runs, but odd spaces (U+001C..) may sit at their
                # edges: chunks neither start nor end with whitespace.
                while e > s + 1 and text[e - 1].isspace():
                    e -= 1
                while nxt < doc_end and text[nxt].isspace():
                    nxt += 1
                n = self._count(s, e)
                if n <= self.hi:
                    break
                # The plan used whole-text counts; the exact count ran over: shrink and retry.
                budget -= max(1, n - self.hi)
                if budget < 1:
                    e, nxt, n = self._token_cut(s, 1)
                    break
            hi = bisect.bisect_right(head_pos, s) - 1
            chunks.append(Chunk(text[s:e], s, e, n, paths[hi] if hi >= 0 else ()))
            if nxt >= doc_end:
                break
            s = self._overlap_start(s, e, nxt) if self.overlap else nxt
        return chunks

    def _choose(
        self,
        s: int,
        t_s: int,
        t_end: int,
        doc_end: int,
        budget: int,
        c_end: list[int],
        c_next: list[int],
        c_lvl: list[int],
        c_ti: list[int],
    ) -> tuple[int, int]:
        """Pick the end of the chunk starting at ``s``: returns (end, start of the next chunk)."""
        if t_end - t_s <= budget:
            return doc_end, doc_end
        lo_t = t_s + min(self.lo, budget)
        hi_t = t_s + budget
        # Plain lists and bisect: the window holds a few dozen candidates, and numpy's per-call
        # overhead cost more than the loop.
        i = bisect.bisect_right(c_end, s)
        j0 = max(i, bisect.bisect_left(c_ti, lo_t))  # c_ti is sorted like c_end
        j1 = max(i, bisect.bisect_right(c_ti, hi_t))
        if j1 > j0:
            # Best level wins, the last one among equals; cuts leaving fewer than min_tokens
            # behind (a tiny tail) only when nothing else is in the window.
            # Headings are the exception: the *first* one past min_tokens, so a chunk boundary
            # depends only on the text just before it, and chunks of two versions of a
            # document re-align at every section (what cross-version dedup needs).
            tail_ok = t_end - self.lo
            best_key, k = None, j0
            for j in range(j0, j1):
                lvl = c_lvl[j]
                key = (lvl + (0 if c_ti[j] <= tail_ok else 100), j if lvl == HEADING else -j)
                if best_key is None or key < best_key:
                    best_key, k = key, j
            return c_end[k], c_next[k]
        # No structural boundary in the window: cut at the last word boundary that fits.
        e, nxt = self._word_cut(s, hi_t)
        if e is not None:
            return e, nxt
        # A single "word" longer than the budget: cut at a token boundary.
        e, nxt, _ = self._token_cut(s, budget)
        return e, nxt

    def _word_cut(self, s: int, hi_t: int) -> tuple[int | None, int]:
        tb = self.tb
        limit = int(tb[min(hi_t, len(tb) - 1)])
        best = None
        for m in _WORD_RE.finditer(self.text, s + 1, limit + 1):
            if m.start() <= limit and m.start() > s:
                best = m
        if best is None:
            return None, 0
        return best.start(), best.end()

    def _token_cut(self, s: int, budget: int) -> tuple[int, int, int]:
        """Cut after at most ``budget`` tokens from ``s``; exact by re-encoding."""
        tb = self.tb
        t_s = self._ti(s)
        k = budget
        while True:
            e = int(tb[min(t_s + k, len(tb) - 1)])
            e = max(e, s + 1)
            n = self.tok.count(self.text[s:e])
            if n <= self.hi or e == s + 1:
                break
            k -= max(1, n - self.hi)
        nxt = e
        while nxt < len(self.text) and self.text[nxt] in _WS_CHARS:
            nxt += 1
        # Do not end inside whitespace: the next chunk starts at text.
        e2 = len(self.text[s:e].rstrip()) + s
        if e2 > s:
            n = self.tok.count(self.text[s:e2]) if e2 != e else n
            e = e2
        return e, nxt, n

    def _overlap_start(self, s: int, e: int, nxt: int) -> int:
        """Start of the next chunk: a word start about ``overlap`` tokens before ``e``."""
        t_target = self._ti(e) - self.overlap
        pos = int(self.tb[max(0, t_target)])
        pos = max(pos, s + 1)
        if pos >= e:
            return nxt
        m = _WORD_START.search(self.text, pos - 1, e)
        if m is None or m.end() >= e:
            return nxt
        return max(m.end(), s + 1)


def _space_point(text: str, lo: int, hi: int, *, last: bool) -> int:
    """The first (or last) plain space in ``text[lo:hi]`` right after a non-space — a word end
    before a space, an exact point of type (a) — or -1 (none within 32 tries)."""
    p = text.rfind(" ", lo, hi) if last else text.find(" ", lo, hi)
    for _ in range(32):
        if p < 0 or not text[p - 1].isspace():
            return p
        p = text.rfind(" ", lo, p) if last else text.find(" ", p + 1, hi)
    return -1


_WS_NONL_CHARS = frozenset("\t\x0b\x0c \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {
    chr(c) for c in range(0x2000, 0x200B)
}
_WS_CHARS = _WS_NONL_CHARS | {"\n", "\r"}


#: Texts at least this long are encoded in helper threads while boundaries are found.
PARALLEL_ENCODE_MIN_CHARS = 20_000
#: ...in pieces of about this many characters (at most one per core).
PARALLEL_PIECE_CHARS = 100_000


@functools.lru_cache(maxsize=1)
def cores() -> int:
    """The cores a big text's encoding is spread over (one helper thread and one piece each, up
    to 8 threads): ``os.cpu_count()``."""
    return os.cpu_count() or 1


def _line_start_cuts(text: str, pieces: int) -> list[int]:
    """Up to ``pieces - 1`` increasing cut positions right after a newline and before text.

    Cutting there splits tiktoken's pre-tokenisation exactly (a newline-ending piece on the
    left, a fresh piece on the right), so encoding the parts gives the whole text's ids.
    """
    cuts: list[int] = []
    n = len(text)
    for i in range(1, pieces):
        p = text.find("\n", max(i * n // pieces, cuts[-1] if cuts else 0))
        while p != -1 and (p + 1 >= n or text[p + 1].isspace()):
            p = text.find("\n", p + 1)
        if p == -1:
            break
        if not cuts or p + 1 > cuts[-1]:
            cuts.append(p + 1)
    return cuts


@functools.lru_cache(maxsize=1)
def _encode_pool() -> ThreadPoolExecutor:
    # Tasks in this pool never wait on other tasks, so sharing it between chunk_texts workers
    # cannot deadlock.
    return ThreadPoolExecutor(max_workers=min(8, cores()), thread_name_prefix="rb-enc")


# A forked child inherits the cached pool object but not its threads: forget it there.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_encode_pool.cache_clear)


#: :func:`chunk_texts` uses worker processes only for batches of at least this many characters:
#: below it, starting them costs more than they save.
PROCESS_MIN_CHARS = 1_000_000


def _chunk_in_processes(
    texts: list[str], encoding: str, sizes: tuple[int, int, int], workers: int
) -> list[list[Chunk]]:
    """Chunk ``texts`` in ``workers`` processes; results come back in input order."""
    import multiprocessing as mp
    import threading
    from concurrent.futures import ProcessPoolExecutor

    # Batches of whole texts (their positions), a few per worker so a long document does not
    # leave the others idle at the end.
    total = sum(map(len, texts))
    target = max(64_000, total // (workers * 8))
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # longest first
    batches: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in order:
        current.append(i)
        size += len(texts[i])
        if size >= target:
            batches.append(current)
            current, size = [], 0
    if current:
        batches.append(current)
    # fork shares the loaded encoding and the texts with the workers for free (a fresh
    # interpreter needs about a second to import and load the encoding), but forking a process
    # that runs other threads can deadlock the child on a lock held at that moment, so it is
    # used only while no other thread runs (this module's idle encode helpers hold no lock while
    # they wait for work).
    methods = mp.get_all_start_methods()
    others = [
        t for t in threading.enumerate() if t is not threading.current_thread() and not t.name.startswith("rb-enc")
    ]
    forked = "fork" in methods and not others
    ctx = mp.get_context("fork" if forked else "forkserver" if "forkserver" in methods else "spawn")
    # Workers get positions (and, unless forked, the texts) and send back offsets, counts and
    # headings only: the parent slices the chunk texts itself.
    jobs = [[(i, None if forked else texts[i]) for i in batch] for batch in batches]
    out: list[list[Chunk]] = [[] for _ in texts]
    _FORK_TEXTS[:] = [texts] if forked else []
    if forked:
        # A forked child shares the parent's heap copy-on-write; its garbage collector would
        # walk (and so copy) every object of a large parent. Frozen objects are not walked.
        gc.freeze()
    try:
        with ProcessPoolExecutor(
            max_workers=min(workers, len(batches)),
            mp_context=ctx,
            initializer=_process_init,
            initargs=(encoding,),
        ) as pool:
            for part in pool.map(_chunk_batch, jobs, [sizes] * len(jobs)):
                for i, spans in part:
                    t = texts[i]
                    out[i] = [Chunk(t[s:e], s, e, n, h) for s, e, n, h in spans]
    finally:
        _FORK_TEXTS.clear()
        if forked:
            gc.unfreeze()
    return out


_WORKER_TOKENIZER: list[Tokenizer] = []
_FORK_TEXTS: list[list[str]] = []  # the batch's texts, seen by forked workers


def _process_init(encoding: str) -> None:
    # Each worker is one of ``workers`` processes already: no helper encode threads inside it.
    global PARALLEL_ENCODE_MIN_CHARS
    PARALLEL_ENCODE_MIN_CHARS = 1 << 62
    _WORKER_TOKENIZER[:] = [get_tokenizer(encoding)]


def _chunk_batch(
    batch: list[tuple[int, str | None]], sizes: tuple[int, int, int]
) -> list[tuple[int, list[tuple[int, int, int, tuple[str, ...]]]]]:
    tok = _WORKER_TOKENIZER[0]
    lo, hi, overlap = sizes
    out = []
    for i, text in batch:
        t = _FORK_TEXTS[0][i] if text is None else text
        chunks = _Chunker(t, tok, lo, hi, overlap).run()
        out.append((i, [(c.start, c.end, c.n_tokens, c.headings) for c in chunks]))
    return out
