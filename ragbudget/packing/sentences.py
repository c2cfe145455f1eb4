"""A chunk's sentences: where each one is (exact offsets, list items told apart), whether it leans
on the one before it, and the digest its vector is kept under.

What an index embeds per chunk at build time (:func:`sentence_texts`, :func:`sentence_digest`:
:mod:`ragbudget.retrieval.build`) and what span packing (:mod:`ragbudget.packing.spans`) scores
and packs, cut the same way in both places, so a question finds every vector the build stored.

>>> t = "Dr. Smith met J. K. Rowling. She left.\\nSteps:\\n- mix\\n- bake"
>>> [(t[a:b], needs_previous(t[a:b])) for a, b, _ in split_sentences(t)]
[('Dr. Smith met J. K. Rowling.', False), ('She left.', True), ('Steps:', False), ('- mix', False),
 ('- bake', False)]
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["NEEDS_PREVIOUS", "needs_previous", "sentence_digest", "sentence_texts", "split_sentences"]

#: First words that make a sentence lean on the one before it (lower case; multi-word ones too).
NEEDS_PREVIOUS = frozenset(
    (
        # pronouns and demonstratives
        "he",
        "she",
        "it",
        "they",
        "him",
        "his",
        "her",
        "hers",
        "its",
        "their",
        "theirs",
        "them",
        "this",
        "these",
        "that",
        "those",
        "such",
        "both",
        "neither",
        # connectives
        "however",
        "but",
        "and",
        "or",
        "nor",
        "so",
        "also",
        "then",
        "thus",
        "hence",
        "therefore",
        "moreover",
        "furthermore",
        "additionally",
        "instead",
        "meanwhile",
        "nevertheless",
        "nonetheless",
        "consequently",
        "otherwise",
        "likewise",
        "similarly",
        "still",
        "yet",
        "besides",
        "accordingly",
        "afterwards",
        "later",
        "here",
        "there,",
        "as a result",
        "in addition",
        "for example",
        "for instance",
        "in contrast",
        "in turn",
        "on the other hand",
        "by contrast",
        "after that",
        "at that time",
        "in this",
    )
)
_MULTI = tuple(sorted((p for p in NEEDS_PREVIOUS if " " in p), key=len, reverse=True))

_WORD = re.compile(r"\w+")
# A sentence ends at . ! ? (or the CJK ones), after any closing quotes/brackets, before spaces.
_END = re.compile(r"[.!?。！？][\"'”’)\]]*(?=\s)|[。！？]")
_LIST_ITEM = re.compile(r"[ \t]*(?:[-*•·–]|\d{1,3}[.)]|[a-zA-Z][.)])[ \t]+\S")
# Words before a period that do not end a sentence.
_ABBREV = frozenset(
    (
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "sr",
        "jr",
        "st",
        "mt",
        "vs",
        "etc",
        "e.g",
        "i.e",
        "eg",
        "ie",
        "no",
        "nos",
        "fig",
        "figs",
        "vol",
        "pp",
        "ed",
        "eds",
        "inc",
        "ltd",
        "co",
        "corp",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
        "approx",
        "ca",
        "cf",
        "al",
        "gen",
        "col",
        "lt",
        "sgt",
        "capt",
        "gov",
        "rev",
        "u.s",
        "u.k",
    )
)


def split_sentences(text: str) -> list[tuple[int, int, bool]]:
    """Sentences and list items of ``text``: ``(start, end, is_list_item)``, whitespace trimmed,
    in order. A line break always ends a unit; a period after a known abbreviation or a single
    capital (an initial) does not, nor one followed by a lower-case word.

    >>> t = "Dr. Smith met J. K. Rowling. She left.\\nSteps:\\n- mix\\n- bake"
    >>> [(t[a:b], item) for a, b, item in split_sentences(t)]
    [('Dr. Smith met J. K. Rowling.', False), ('She left.', False), ('Steps:', False), ('- mix', True),
     ('- bake', True)]
    """
    out: list[tuple[int, int, bool]] = []
    pos = 0
    for line in text.splitlines(keepends=True):
        lo, hi = pos, pos + len(line)
        pos = hi
        body = line.rstrip("\r\n")
        if not body.strip():
            continue
        item = bool(_LIST_ITEM.match(body))
        start = lo
        for m in _END.finditer(body):
            end = lo + m.end()
            if not _ends_sentence(text, lo + m.start(), end):
                continue
            _add(out, text, start, end, item)
            item = False  # only a line's first sentence is the list item
            start = end
        _add(out, text, start, lo + len(body), item)
    return out


def sentence_texts(text: str) -> list[str]:
    """The texts of :func:`split_sentences`' units of ``text``, in order: what an index embeds
    per chunk at build time, and what :func:`select_spans` scores.

    >>> sentence_texts("It rained. We stayed in.")
    ['It rained.', 'We stayed in.']
    """
    return [text[a:b] for a, b, _ in split_sentences(text)]


def _ends_sentence(text: str, dot: int, end: int) -> bool:
    if text[dot] != ".":
        return True
    word = re.search(r"[\w.]*$", text[max(0, dot - 12) : dot])
    before = word.group(0).lower() if word else ""
    if before in _ABBREV or (len(before) == 1 and before.isalpha()):
        return False
    nxt = re.match(r"\s*(\S)", text[end : end + 8])
    return not (nxt and nxt.group(1).islower())


def _add(out: list[tuple[int, int, bool]], text: str, a: int, b: int, item: bool) -> None:
    piece = text[a:b]
    stripped = piece.strip()
    if not stripped:
        return
    a += len(piece) - len(piece.lstrip())
    out.append((a, a + len(stripped), item))


def needs_previous(sentence: str) -> bool:
    """Whether ``sentence`` starts with a pronoun or connective (:data:`NEEDS_PREVIOUS`).

    >>> needs_previous("However, the plan failed."), needs_previous("The plan failed.")
    (True, False)
    """
    low = sentence.lstrip(" \t\"'“‘(").lower()
    if any(low.startswith(p) and not low[len(p) : len(p) + 1].isalnum() for p in _MULTI):
        return True
    m = _WORD.match(low)
    return m is not None and m.group(0) in NEEDS_PREVIOUS


def sentence_digest(text: str) -> bytes:
    """The 16-byte key of a sentence's vector: in :class:`SpanScorer`'s cache and in an index's
    stored sentence vectors (:meth:`ragbudget.retrieval.index.Index.sentence_vectors`)."""
    return _digest(text)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
