"""Exact and near-duplicate chunk removal that keeps every source of a removed copy.

Exact: :func:`content_hash` over :func:`normalize`-d text (NFKC, casefold, whitespace folded,
spacing around punctuation removed), so ``Earth ' s atmosphere`` and ``Earth's atmosphere`` are
one text. Near: MinHash over word shingles with LSH banding (:class:`NearDupIndex`): candidates
come from band buckets (sub-linear, never all pairs) and are *confirmed* by the Jaccard
similarity estimated from the two signatures, so a bucket collision alone never merges chunks.

Signatures are computed with numpy for many texts at once (:func:`minhash_signatures`): the
shingle hashes come from one prefix polynomial hash over the whole batch and the 128 hash
functions are one broadcast multiply-add, which is far faster than a per-shingle Python loop.
They are stable across processes and machines (no Python ``hash``), so the indexer can store
them and rebuild the LSH index without the text.
"""

from __future__ import annotations

import contextlib
import hashlib
import unicodedata
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError
from ..settings import DedupSettings
from ..types import Chunk, Source

__all__ = [
    "DEFAULT_NUM_PERM",
    "DEFAULT_SHINGLE",
    "DEFAULT_THRESHOLD",
    "DedupDecision",
    "DedupItem",
    "DedupResult",
    "Deduplicator",
    "NearDupIndex",
    "content_hash",
    "content_hashes",
    "dedup",
    "estimate_jaccard",
    "minhash_signature",
    "minhash_signatures",
    "normalize",
    "optimal_bands",
]

#: Defaults picked by measurement. Threshold 0.8 on 1-word shingles (each text's set of words),
#: chosen by bench/dedup_sweep.py on the squad-tune paragraphs with copies edited at 2-20%: the
#: highest recall with no false merge (difflib truth) at 0.8 nor at 0.75. Word 3-grams at 0.8
#: (the default before) caught 27% of the copies on the reporting split against 88.5% now: one
#: edited word breaks up to three 3-grams but only one word, so 5% edits left a 3-gram Jaccard
#: near 0.75 and 10% near 0.55; on the tuning sets no pair the truth calls distinct reached a
#: word-set Jaccard of 0.75. Every Disfl-QA copy still scores 1.0. 128 permutations: standard error
#: <= 0.044 of the Jaccard estimate; signatures cost about 1/4 of the dedup time.
#: (All three are DedupSettings' defaults: one definition, the settings record's.)
DEFAULT_THRESHOLD = DedupSettings.near_threshold
DEFAULT_NUM_PERM = DedupSettings.num_perm
DEFAULT_SHINGLE = DedupSettings.shingle

# Hash family constants (fixed: signatures must be identical in every process). The seed makes
# them reproducible; changing it invalidates stored signatures.
_SEED = 0x5EED_D5D0
_BASE = np.uint64(0x100000001B3)  # odd: invertible modulo 2**64
_BASE_INV = np.uint64(pow(0x100000001B3, -1, 1 << 64))
_SHINGLE_MULT = np.uint64(0x9E3779B97F4A7C15)
# Texts are analysed in batches of about this many characters (numpy buffers stay ~100 MB).
_BATCH_CHARS = 2_000_000

# str.isspace / str.isalnum for every BMP code point (astral characters are classified one
# by one; they are rare). Built on first use (~65k calls, a few tens of ms).
_TABLES: tuple[np.ndarray, np.ndarray] | None = None


def _char_classes(cp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(is space, is letter/digit) for every code point."""
    global _TABLES
    if _TABLES is None:
        chars = [chr(i) for i in range(0x10000)]
        _TABLES = (
            np.array([c.isspace() for c in chars], dtype=bool),
            np.array([c.isalnum() for c in chars], dtype=bool),
        )
    space_t, word_t = _TABLES
    space = space_t.take(cp, mode="clip")
    word = word_t.take(cp, mode="clip")
    if len(cp) and int(cp.max()) > 0xFFFF:
        astral = np.flatnonzero(cp > 0xFFFF)
        for v in np.unique(cp[astral]).tolist():
            at = astral[cp[astral] == v]
            space[at] = chr(v).isspace()
            word[at] = chr(v).isalnum()
    return space, word


@dataclass
class _Analysis:
    """Batch analysis of texts (NFKC, casefolded): canonical characters and word spans."""

    cp: np.ndarray  # code points of all texts, each followed by one NUL separator
    keep: np.ndarray  # increasing indices into cp of the canonical form's characters
    keep_space: np.ndarray  # positions in ``keep`` that render as a plain space
    keep_bounds: np.ndarray  # text i's canonical chars are keep[keep_bounds[i]:keep_bounds[i+1]]
    keep_ends: np.ndarray
    word_starts: np.ndarray
    word_ends: np.ndarray
    word_bounds: np.ndarray  # text i's words are [word_bounds[i], word_bounds[i+1])
    n_texts: int


def _fold(text: str) -> str:
    # NFKC is the identity on ASCII and casefold is lower(): skip the Unicode machinery.
    return text.lower() if text.isascii() else unicodedata.normalize("NFKC", text).casefold()


def _analyse(texts: Sequence[str]) -> _Analysis:
    folded = [_fold(t) for t in texts]
    # Each text is followed by a NUL: it is neither space nor letter, so no canonical space and
    # no word ever spans two texts.
    joined = "\x00".join(folded) + "\x00"
    cp = np.frombuffer(joined.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
    lengths = np.fromiter((len(t) + 1 for t in folded), dtype=np.int64, count=len(folded))
    text_starts = np.zeros(len(folded) + 1, dtype=np.int64)
    np.cumsum(lengths, out=text_starts[1:])
    space, word = _char_classes(cp)
    # Canonical form: every non-space character, plus one space wherever whitespace separates
    # two letters/digits (spaces next to punctuation are dropped: "Earth ' s" -> "earth's").
    nonspace = np.flatnonzero(~space)
    need_space = np.zeros(len(nonspace), dtype=bool)
    if len(nonspace) > 1:
        need_space[1:] = (nonspace[1:] - nonspace[:-1] > 1) & word[nonspace[1:]] & word[nonspace[:-1]]
    # A kept space is represented by the whitespace character just before the next kept
    # character, so ``keep`` stays increasing (and searchable); it renders as U+0020.
    pos = np.arange(len(nonspace)) + np.cumsum(need_space)
    keep = np.empty(len(nonspace) + int(need_space.sum()), dtype=np.int64)
    keep[pos] = nonspace
    keep_space = pos[need_space] - 1
    keep[keep_space] = nonspace[need_space] - 1
    keep_bounds = keep.searchsorted(text_starts[:-1])
    keep_ends = keep.searchsorted(text_starts[1:] - 1)  # each text's NUL is kept: stop before
    # Words: maximal runs of letters/digits.
    prev = np.zeros(len(cp), dtype=bool)
    prev[1:] = word[:-1]
    nxt = np.zeros(len(cp), dtype=bool)
    nxt[:-1] = word[1:]
    word_starts = np.flatnonzero(word & ~prev)
    word_ends = np.flatnonzero(word & ~nxt) + 1
    word_bounds = word_starts.searchsorted(text_starts)
    return _Analysis(
        cp,
        keep,
        keep_space,
        keep_bounds,
        keep_ends,
        word_starts,
        word_ends,
        word_bounds,
        len(folded),
    )


def _canonical_raw(an: _Analysis) -> list[bytes]:
    """UTF-32-LE bytes of each text's canonical form."""
    chars = an.cp[an.keep]
    chars[an.keep_space] = 32
    raw = chars.tobytes()
    b = (an.keep_bounds * 4).tolist()
    e = (an.keep_ends * 4).tolist()
    return [raw[i:j] for i, j in zip(b, e, strict=True)]


def normalize(text: str) -> str:
    """Canonical form for exact dedup: NFKC, casefold, no space around punctuation, single spaces.

    >>> normalize("Earth ' s  Atmosphere ( see  O 2 . )")
    "earth's atmosphere(see o 2.)"
    """
    return _canonical_raw(_analyse([text]))[0].decode("utf-32-le", errors="surrogatepass")


def _digest(raw: bytes) -> str:
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def content_hash(text: str) -> str:
    """Hex digest (32 chars) of :func:`normalize`-d text: equal for exact duplicates.

    It is BLAKE2b-128 of the UTF-32-LE bytes of the normalised text (UTF-32 because that is the
    batch code's native layout; the value is fixed, so stored hashes stay valid).

    >>> content_hash("Earth ' s atmosphere") == content_hash("earth's   atmosphere")
    True
    """
    return _digest(_canonical_raw(_analyse([text]))[0])


def content_hashes(texts: Sequence[str]) -> list[str]:
    """:func:`content_hash` of many texts (vectorised; same values)."""
    return _fingerprints(texts, num_perm=1, shingle=1, sigs=False)[0]


def _batches(texts: Sequence[str]) -> Iterable[Sequence[str]]:
    i = 0
    while i < len(texts):
        j, size = i, 0
        while j < len(texts) and (j == i or size + len(texts[j]) <= _BATCH_CHARS):
            size += len(texts[j])
            j += 1
        yield texts[i:j]
        i = j


def _perm_params(num_perm: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(_SEED)
    a = rng.integers(1, 2**32, size=num_perm, dtype=np.uint64).astype(np.uint32) | np.uint32(1)
    b = rng.integers(0, 2**32, size=num_perm, dtype=np.uint64).astype(np.uint32)
    return a, b


_PARAMS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


_POWER_CACHE: dict[int, np.ndarray] = {}


def _powers(base: np.uint64, n: int) -> np.ndarray:
    """``base**k mod 2**64`` for k < n (cached and grown as needed; read-only)."""
    cached = _POWER_CACHE.get(int(base))
    if cached is None or len(cached) < n:
        cached = _POWER_CACHE[int(base)] = _compute_powers(base, max(n, _BATCH_CHARS + 2))
    return cached[:n]


def _compute_powers(base: np.uint64, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.uint64)
    out[0] = 1
    if n > 1:
        out[1:] = base
        np.cumprod(out[1:], out=out[1:])  # wraps modulo 2**64, which is what we want
    return out


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: spreads polynomial-hash bits over all 64 bits (in place)."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _shingle_hashes(an: _Analysis, shingle: int) -> tuple[np.ndarray, np.ndarray]:
    """32-bit hashes of every word ``shingle``-gram of every text, and each text's offsets.

    Word hashes come from one prefix polynomial hash over all code points (a word's hash is a
    difference of two prefix values times an inverse power), and a shingle combines its
    words' hashes: no per-word Python work. Punctuation and spacing are ignored, so
    ``Earth ' s`` and ``Earth's`` give the same words; a text with 1..k-1 words gets one
    shingle of all its words; a text without words gets none.
    """
    n_texts = an.n_texts
    ws, we = an.word_starts, an.word_ends
    if len(ws) == 0:
        return np.zeros(0, dtype=np.uint32), np.zeros(n_texts + 1, dtype=np.int64)
    cp = an.cp.astype(np.uint64) + np.uint64(1)
    n = len(cp)
    pw = _powers(_BASE, n + 1)
    prefix = np.zeros(n + 1, dtype=np.uint64)
    np.cumsum(cp * pw[:n], out=prefix[1:])
    inv = _powers(_BASE_INV, n + 1)
    wh = (prefix[we] - prefix[ws]) * inv[ws]
    wh ^= (we - ws).astype(np.uint64) * _SHINGLE_MULT
    _mix(wh)
    counts = np.diff(an.word_bounds)
    k_eff = np.minimum(counts, shingle)
    n_sh = np.where(counts > 0, counts - k_eff + 1, 0)
    sh_offsets = np.zeros(n_texts + 1, dtype=np.int64)
    np.cumsum(n_sh, out=sh_offsets[1:])
    total = int(sh_offsets[-1])
    text_of = np.repeat(np.arange(n_texts), n_sh)
    first = an.word_bounds[:-1][text_of] + (np.arange(total) - sh_offsets[:-1][text_of])
    k_of = k_eff[text_of]
    h = wh[first].copy()
    for j in range(1, shingle):
        more = k_of > j
        h[more] = h[more] * _SHINGLE_MULT + wh[first[more] + j]
    h ^= k_of.astype(np.uint64)
    _mix(h)
    return (h >> np.uint64(32)).astype(np.uint32), sh_offsets


def minhash_signatures(
    texts: Sequence[str], *, num_perm: int = DEFAULT_NUM_PERM, shingle: int = DEFAULT_SHINGLE
) -> np.ndarray:
    """MinHash signatures of many texts: a ``(len(texts), num_perm)`` uint32 array.

    Hash function ``i`` maps a (well-mixed, 32-bit) shingle hash ``x`` to
    ``(a_i * x + b_i) mod 2**32`` with ``a_i`` odd: a bijection per function, 32-bit numpy
    arithmetic (half the memory traffic of 64-bit). A text without words gets all
    ``0xFFFFFFFF`` (it is similar to nothing; :class:`NearDupIndex` ignores it).

    >>> s = minhash_signatures(["the cat sat on the mat", "The cat sat on the mat!"])
    >>> s.shape, bool((s[0] == s[1]).all())
    ((2, 128), True)
    """
    if num_perm < 1 or shingle < 1:
        raise ConfigError(f"num_perm and shingle must be >= 1, got {num_perm} and {shingle}")
    return _fingerprints(texts, num_perm=num_perm, shingle=shingle, digests=False)[1]


def _fingerprints(
    texts: Sequence[str], *, num_perm: int, shingle: int, digests: bool = True, sigs: bool = True
) -> tuple[list[str], np.ndarray]:
    """Content hashes and MinHash signatures of ``texts`` from one analysis per batch."""
    if num_perm not in _PARAMS:
        _PARAMS[num_perm] = _perm_params(num_perm)
    a, b = _PARAMS[num_perm]
    out = np.full((len(texts), num_perm if sigs else 0), 0xFFFFFFFF, dtype=np.uint32)
    hashes: list[str] = []
    i = 0
    for batch in _batches(texts):
        an = _analyse(batch)
        if digests:
            hashes.extend(_digest(c) for c in _canonical_raw(an))
        if sigs:
            h, offsets = _shingle_hashes(an, shingle)
            _signatures_into(out[i : i + len(batch)], h, offsets, a, b)
        i += len(batch)
    return hashes, out


def _signatures_into(out: np.ndarray, h: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    if len(h) == 0:
        return
    # Layout (num_perm, shingles): each text's shingles are contiguous in every row, so the
    # per-text minimum is a reduceat along rows (6x faster than the transposed layout).
    # Blocks of ~4 MB stay in cache through multiply, add and reduce (measured 1.5-2x faster
    # than 32 MB blocks on a 2-core machine).
    step = max(1, 1_000_000 // len(a))
    text_of = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    buf = np.empty((len(a), min(step, len(h))), dtype=np.uint32)
    for s in range(0, len(h), step):
        e = min(len(h), s + step)
        v = buf[:, : e - s]
        np.multiply(a[:, None], h[None, s:e], out=v)
        v += b[:, None]
        t = text_of[s:e]
        seg = np.concatenate(([0], np.flatnonzero(t[1:] != t[:-1]) + 1))
        part = np.minimum.reduceat(v, seg, axis=1).T
        rows = t[seg]
        out[rows] = np.minimum(out[rows], part)


def minhash_signature(text: str, *, num_perm: int = DEFAULT_NUM_PERM, shingle: int = DEFAULT_SHINGLE) -> np.ndarray:
    """MinHash signature (uint32, ``num_perm`` values) of one text; see :func:`minhash_signatures`.

    Store it with ``sig.tobytes()`` and restore with ``np.frombuffer(raw, dtype=np.uint32)``.
    """
    sig: np.ndarray = minhash_signatures([text], num_perm=num_perm, shingle=shingle)[0]
    return sig


def estimate_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """Share of equal MinHash values: an unbiased estimate of the shingle-set Jaccard."""
    if sig_a.shape != sig_b.shape:
        raise ConfigError(f"signatures differ in length ({sig_a.shape} vs {sig_b.shape})")
    return float(np.count_nonzero(sig_a == sig_b)) / len(sig_a)


def optimal_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) minimising false positives + false negatives around ``threshold``.

    Same criterion as datasketch: the area under the candidate-probability curve
    ``1 - (1 - s**r)**b`` below the threshold plus the area above it of its complement.
    Bands that do not use all ``num_perm`` values are allowed.
    """
    s = np.linspace(0.0, 1.0, 1001)
    best, best_err = (1, num_perm), float("inf")
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            p = 1.0 - (1.0 - s**r) ** b
            fp = np.trapezoid(np.where(s < threshold, p, 0.0), s)
            fn = np.trapezoid(np.where(s >= threshold, 1.0 - p, 0.0), s)
            if fp + fn < best_err:
                best, best_err = (b, r), fp + fn
    return best


_BANDS_CACHE: dict[tuple[float, int], tuple[int, int]] = {}


class NearDupIndex:
    """LSH index over MinHash signatures with confirmed queries.

    A query looks up the signature's band buckets (cost independent of the index size) and
    keeps only candidates whose estimated Jaccard is at least ``threshold``, best first (ties:
    earliest inserted).

    >>> idx = NearDupIndex(threshold=0.8)
    >>> idx.insert("a", minhash_signature("one two three four five six seven eight"))
    >>> idx.query(minhash_signature("One two three four five six seven eight."))
    ['a']
    """

    def __init__(
        self,
        threshold: float = DEFAULT_THRESHOLD,
        num_perm: int = DEFAULT_NUM_PERM,
        *,
        bands: int | None = None,
    ) -> None:
        from ..settings import check_near_dedup  # the rule DedupSettings checks, written once

        threshold, num_perm = check_near_dedup(threshold, num_perm, threshold_name="threshold")
        self.threshold = threshold
        self.num_perm = num_perm
        if bands is None:
            # Bands tuned for a threshold 0.15 lower: a pair right at ``threshold`` becomes a
            # candidate with probability >= 0.94 (0.40 with bands tuned for the threshold
            # itself), and the signature comparison removes the extra candidates.
            key = (round(threshold, 4), num_perm)
            if key not in _BANDS_CACHE:
                _BANDS_CACHE[key] = optimal_bands(max(0.05, threshold - 0.15), num_perm)
            self.bands, self.rows = _BANDS_CACHE[key]
        else:
            if not 1 <= bands <= num_perm:
                raise ConfigError(f"bands must be between 1 and num_perm ({num_perm}), got {bands}")
            self.bands, self.rows = bands, num_perm // bands
        self._buckets: list[dict[int, list[Hashable]]] = [{} for _ in range(self.bands)]
        self._sigs: dict[Hashable, np.ndarray] = {}
        self._keys: dict[Hashable, tuple[int, ...]] = {}
        self._order: dict[Hashable, int] = {}
        self._counter = 0
        rng = np.random.default_rng(_SEED + 1)
        self._band_mult = rng.integers(1, 2**63, size=self.rows, dtype=np.uint64) | np.uint64(1)

    def __len__(self) -> int:
        return len(self._sigs)

    def __contains__(self, key: object) -> bool:
        return key in self._sigs

    def band_keys(self, sigs: np.ndarray) -> np.ndarray:
        """Bucket key of every band of every signature: ``(n, bands)`` uint64 (vectorised)."""
        sigs = np.atleast_2d(sigs)
        if sigs.shape[1] != self.num_perm:
            raise ConfigError(
                f"signature has {sigs.shape[1]} values, index expects {self.num_perm}; "
                "use the same num_perm for signatures and index"
            )
        used = sigs[:, : self.bands * self.rows].astype(np.uint64)
        parts = used.reshape(len(sigs), self.bands, self.rows) * self._band_mult
        return _mix(parts.sum(axis=2, dtype=np.uint64))

    def _check(self, sig: np.ndarray) -> np.ndarray:
        sig = np.asarray(sig)
        if sig.dtype != np.uint32:
            sig = sig.astype(np.uint32)
        if sig.shape != (self.num_perm,):
            raise ConfigError(
                f"signature has shape {sig.shape}, index expects ({self.num_perm},); "
                "use the same num_perm for signatures and index"
            )
        return sig

    def insert(self, key: Hashable, sig: np.ndarray, *, band_keys: Sequence[int] | None = None) -> None:
        """Add ``key`` with signature ``sig`` (replacing an earlier entry with that key)."""
        sig = self._check(sig)
        if key in self._sigs:
            self.remove(key)
        keys = band_keys if band_keys is not None else self.band_keys(sig)[0].tolist()
        self._insert(key, sig, keys)

    def _insert(self, key: Hashable, sig: np.ndarray, keys: Sequence[int]) -> None:
        """insert() without argument checks (for the batch path)."""
        self._sigs[key] = sig
        self._keys[key] = tuple(keys)
        self._order[key] = self._counter
        self._counter += 1
        if sig[0] == 0xFFFFFFFF and _empty(sig):
            return  # a text without words is similar to nothing
        for bucket, k in zip(self._buckets, keys, strict=True):
            members = bucket.get(k)
            if members is None:
                bucket[k] = [key]
            else:
                members.append(key)

    def remove(self, key: Hashable) -> None:
        """Forget ``key``; unknown keys are ignored."""
        sig = self._sigs.pop(key, None)
        if sig is None:
            return
        keys = self._keys.pop(key)
        self._order.pop(key, None)
        for bucket, k in zip(self._buckets, keys, strict=True):
            members = bucket.get(k)
            if members is not None:
                with contextlib.suppress(ValueError):
                    members.remove(key)
                if not members:
                    del bucket[k]

    def query_scored(self, sig: np.ndarray, *, band_keys: Sequence[int] | None = None) -> list[tuple[Hashable, float]]:
        """Confirmed near-duplicates of ``sig`` with their estimated Jaccard, best first."""
        sig = self._check(sig)
        keys = band_keys if band_keys is not None else self.band_keys(sig)[0].tolist()
        return self._query(sig, keys)

    def _query(self, sig: np.ndarray, keys: Sequence[int]) -> list[tuple[Hashable, float]]:
        """query_scored() without argument checks (for the batch path)."""
        if sig[0] == 0xFFFFFFFF and _empty(sig):
            return []
        cands: list[Hashable] = []
        for bucket, k in zip(self._buckets, keys, strict=True):
            members = bucket.get(k)
            if members:
                cands.extend(members)
        if not cands:
            return []
        cand_list = list(dict.fromkeys(cands))  # unique, in a deterministic order
        mat = np.stack([self._sigs[c] for c in cand_list])
        sims = np.count_nonzero(mat == sig, axis=1) / self.num_perm
        hits = [(c, float(x)) for c, x in zip(cand_list, sims.tolist(), strict=True) if x >= self.threshold]
        hits.sort(key=lambda cs: (-cs[1], self._order[cs[0]]))
        return hits

    def query(self, sig: np.ndarray) -> list[Hashable]:
        """Keys of the confirmed near-duplicates of ``sig``, most similar first."""
        return [k for k, _ in self.query_scored(sig)]


def _empty(sig: np.ndarray) -> bool:
    return bool(sig[0] == 0xFFFFFFFF and (sig == 0xFFFFFFFF).all())


@dataclass(frozen=True)
class DedupDecision:
    """What :meth:`Deduplicator.add` decided for one chunk.

    ``kind`` is ``"new"`` (kept), ``"exact"`` (same normalised text as ``duplicate_of``) or
    ``"near"`` (estimated Jaccard ``similarity`` with ``duplicate_of`` at least the threshold).
    """

    kind: str
    duplicate_of: Hashable | None
    similarity: float
    signature: np.ndarray | None = field(default=None, compare=False, repr=False)
    content_hash: str = ""


class Deduplicator:
    """Incremental exact + near-duplicate detection with removal.

    Every added key is either a *representative* (kept) or a duplicate of one. Removing a
    representative promotes its remaining duplicates (the first becomes the new representative,
    the others are re-decided against it and the rest of the index), so incremental deletes
    never orphan a copy that is still on disk.

    >>> d = Deduplicator()
    >>> d.add("a", "The quick brown fox jumps over the lazy dog").kind
    'new'
    >>> d.add("b", "the quick  brown fox jumps over the lazy dog").kind
    'exact'

    ``exact=False`` (with ``near=False``: the indexer's ``dedup="none"``) keeps every text, even
    byte-identical ones; the content hash is still computed, by the same function, so callers
    can find a text again (e.g. to reuse its vector). :meth:`check` decides without adding.
    """

    def __init__(
        self,
        *,
        threshold: float = DEFAULT_THRESHOLD,
        num_perm: int = DEFAULT_NUM_PERM,
        shingle: int = DEFAULT_SHINGLE,
        near: bool = True,
        exact: bool = True,
    ) -> None:
        if near and not exact:
            raise ConfigError("near-duplicate removal includes exact: pass exact=True with near=True")
        self.index = NearDupIndex(threshold, num_perm)
        self.threshold, self.num_perm, self.shingle, self.near = threshold, num_perm, shingle, near
        self.exact = exact
        self._by_hash: dict[str, Hashable] = {}  # content hash -> representative
        self._info: dict[Hashable, tuple[str, np.ndarray | None]] = {}  # key -> (hash, sig)
        self._rep: dict[Hashable, Hashable] = {}  # key -> its representative
        self._members: dict[Hashable, list[Hashable]] = {}  # representative -> keys, itself first

    def __len__(self) -> int:
        return len(self._info)

    def __contains__(self, key: object) -> bool:
        return key in self._info

    def representative(self, key: Hashable) -> Hashable:
        """The kept key that ``key`` is a copy of (``key`` itself when it is kept)."""
        return self._rep[key]

    def members(self, key: Hashable) -> list[Hashable]:
        """All keys represented by representative ``key`` (itself first)."""
        return list(self._members.get(key, []))

    def add(
        self,
        key: Hashable,
        text: str = "",
        *,
        signature: np.ndarray | None = None,
        digest: str | None = None,
        decision: DedupDecision | None = None,
    ) -> DedupDecision:
        """Decide whether ``text`` (stored under ``key``) is new, an exact or a near duplicate.

        ``signature``/``digest`` may be passed when already computed (e.g. restored from disk);
        ``decision``, from :meth:`check` on the same text (nothing added in between), is taken
        as is — a caller that needs the decision before it has a key (the indexer: a new
        chunk's row id) decides once, not twice.
        """
        if key in self._info:
            self.remove(key)
        if decision is None:
            decision = self.check(text, signature=signature, digest=digest)
        return self._place(key, decision.content_hash, decision.signature, decision)

    def check(self, text: str = "", *, signature: np.ndarray | None = None, digest: str | None = None) -> DedupDecision:
        """What :meth:`add` would decide for ``text``, without adding it."""
        h = digest or content_hash(text)
        sig = signature
        # Exact copies get a signature too: one may be promoted when its original is removed.
        if self.near and sig is None:
            sig = minhash_signature(text, num_perm=self.num_perm, shingle=self.shingle)
        return self._decide(h, sig)

    def _decide(self, h: str, sig: np.ndarray | None) -> DedupDecision:
        rep = self._by_hash.get(h) if self.exact else None
        if rep is not None:
            decision = DedupDecision("exact", rep, 1.0, sig, h)
        else:
            decision = DedupDecision("new", None, 0.0, sig, h)
            if self.near and sig is not None:
                hits = self.index.query_scored(sig)
                if hits:
                    rep, sim = hits[0]
                    decision = DedupDecision("near", rep, sim, sig, h)
        return decision

    def _place(
        self, key: Hashable, h: str, sig: np.ndarray | None, decision: DedupDecision | None = None
    ) -> DedupDecision:
        if decision is None:
            decision = self._decide(h, sig)
        self._info[key] = (h, sig)
        if decision.kind == "new":
            self._rep[key] = key
            self._members[key] = [key]
            self._by_hash.setdefault(h, key)
            if self.near and sig is not None:
                self.index.insert(key, sig)
        else:
            self._rep[key] = decision.duplicate_of
            self._members[decision.duplicate_of].append(key)
        return decision

    def remove(self, key: Hashable) -> list[tuple[Hashable, DedupDecision]]:
        """Forget ``key``. When it was kept, its copies are re-placed; returns their decisions."""
        if key not in self._info:
            return []
        h, _ = self._info.pop(key)
        rep = self._rep.pop(key)
        if rep != key:
            self._members[rep].remove(key)
            return []
        orphans = [k for k in self._members.pop(key) if k != key]
        self.index.remove(key)
        if self._by_hash.get(h) == key:
            del self._by_hash[h]
        out = []
        for k in orphans:
            kh, ksig = self._info.pop(k)
            del self._rep[k]
            out.append((k, self._place(k, kh, ksig)))
        return out


@dataclass(frozen=True)
class DedupItem:
    """A kept chunk with every place its text (or a near copy) appears."""

    chunk: Chunk
    sources: tuple[Source, ...]
    content_hash: str
    signature: np.ndarray | None = field(default=None, compare=False, repr=False)
    near_similarity: float = 1.0  # lowest similarity among the near copies merged into it


@dataclass(frozen=True)
class DedupResult:
    """Output of :func:`dedup`: kept items in first-seen order, and what was removed."""

    items: list[DedupItem]
    exact_removed: int
    near_removed: int

    @property
    def removed(self) -> int:
        return self.exact_removed + self.near_removed


def _as_source(chunk: Chunk, src: object) -> Source:
    if isinstance(src, Source):
        return src
    if isinstance(src, str):
        return Source(src, chunk.start, chunk.end, chunk.page_start, chunk.page_end)
    raise ConfigError(f"dedup() takes (Chunk, Source) or (Chunk, path) pairs; got a {type(src).__name__} source")


def dedup(
    chunks_with_sources: Iterable[tuple[Chunk, Source | str]],
    *,
    threshold: float = DEFAULT_THRESHOLD,
    num_perm: int = DEFAULT_NUM_PERM,
    shingle: int = DEFAULT_SHINGLE,
    near: bool = True,
) -> DedupResult:
    """Remove exact and near duplicates from ``(chunk, source)`` pairs, keeping all sources.

    ``source`` is a :class:`~ragbudget.types.Source` or a path (then the chunk's offsets and
    pages are used). The first occurrence of each text is kept; its ``sources`` list every
    occurrence, duplicates included, in input order.

    >>> a = Chunk("Earth's atmosphere is mostly nitrogen.", 0, 38, 8)
    >>> b = Chunk("Earth ' s atmosphere is mostly nitrogen .", 5, 46, 10)
    >>> r = dedup([(a, "x.txt"), (b, "y.txt")])
    >>> len(r.items), r.exact_removed, [s.path for s in r.items[0].sources]
    (1, 1, ['x.txt', 'y.txt'])
    """
    pairs = [(c, _as_source(c, s)) for c, s in chunks_with_sources]
    if not pairs:
        return DedupResult([], 0, 0)
    if num_perm < 2 or shingle < 1:
        raise ConfigError(f"num_perm must be >= 2 and shingle >= 1, got {num_perm} and {shingle}")
    # One analysis of every text gives both the content hash and the signature. Signatures of
    # exact copies are computed too (wasted for them), which is cheaper than a second pass.
    hashes, mat = _fingerprints([c.text for c, _ in pairs], num_perm=num_perm, shingle=shingle, sigs=near)
    first_of: dict[str, int] = {}
    for i, h in enumerate(hashes):
        first_of.setdefault(h, i)
    uniq = sorted(first_of.values())
    sigs: dict[int, np.ndarray] = {}
    band_keys: dict[int, list[int]] = {}
    index = NearDupIndex(threshold, num_perm)
    if near:
        bk = index.band_keys(mat[uniq]).tolist()
        for row, i in enumerate(uniq):
            sigs[i] = mat[i]
            band_keys[i] = bk[row]
    rep_of: dict[int, int] = {}
    sim_of: dict[int, float] = {}
    exact = near_n = 0
    for i, h in enumerate(hashes):
        if first_of[h] != i:
            rep_of[i] = rep_of[first_of[h]]
            exact += 1
            continue
        if near:
            hits = index._query(sigs[i], band_keys[i])
            if hits:
                # The index holds only this call's keys: the positions ``i`` this loop inserts.
                rep = hits[0][0]
                assert isinstance(rep, int)
                rep_of[i] = rep
                sim_of[rep] = min(sim_of.get(rep, 1.0), hits[0][1])
                near_n += 1
                continue
            index._insert(i, sigs[i], band_keys[i])
        rep_of[i] = i
    sources: dict[int, list[Source]] = {}
    for i, (_, src) in enumerate(pairs):
        sources.setdefault(rep_of[i], []).append(src)
    items = [
        DedupItem(pairs[i][0], tuple(sources[i]), hashes[i], sigs.get(i), sim_of.get(i, 1.0)) for i in sorted(sources)
    ]
    return DedupResult(items, exact, near_n)
