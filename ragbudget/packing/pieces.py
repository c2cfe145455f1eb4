"""Composed costs: a span passage's token count added up from pieces counted beforehand, in one batch.

Span packing (:func:`~ragbudget.packing.spans.select_spans`) tries many passages per question. A
local tokenizer counts each trial in microseconds; on a served engine each count is a request.
With ``composed=True`` (:class:`~ragbudget.packing.packer.SpanPacker` asks for it when counting is
a request, :attr:`~ragbudget.prompt.prompt.PromptBuilder.batch_counts`) a trial passage is not
counted; its cost is composed from pieces counted beforehand, all in one batch
(:func:`span_pieces`): every unit (sentence or list item) alone, plus what each boundary adds —
the gap before a unit that follows its neighbour, counted where the two meet (the last word of
one, the gap, the first word of the other: a merge across the gap is in that count), the
joiner's ``" …"`` and the space after it, the block's closing newline after the last word, the
chunk's label.

It rests on one property of the pre-tokenizers of byte-level BPEs (GPT-2, SmolLM2, Llama 3, Qwen,
tiktoken's): no pre-token holds whitespace but at its start, so tokens never span a word boundary
and the pieces add up to the passage's own count. On the real llama-server that held for every
passage packed for 120 SQuAD questions (371 passages, bench/results/spans_counts.json). It is not a
proof for every tokenizer: the caller renders the prompt and, in the rare case it is over, packs
again on a budget smaller by the excess (``SpanPacker.shrink``, from
:func:`~ragbudget.fitting.fit_prompt`). A request then asks a served engine's tokenizer for the
question's render, the counts of candidates and pieces not counted before (kept by digest: none once
a candidate has been seen) and the final render — never once per trial passage. (One path still
counts trial by trial: a budget no sentence fits, where the best chunk is cut to a window of words.)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise
from typing import Protocol

from .sentences import split_sentences

__all__ = ["JOINER", "span_pieces"]

#: Shown between two non-adjacent runs of sentences of one chunk: the reader (and the model) sees
#: that text was left out.
JOINER = " … "

_SPACE = re.compile(r"[ \t]")


class HasText(Protocol):
    """A candidate chunk as :func:`span_pieces` reads it: its text."""

    @property
    def text(self) -> str: ...


class Costed(Protocol):
    """A unit of a passage with its composed costs (span packing's ``_Unit``)."""

    @property
    def pos(self) -> int: ...

    @property
    def n_tokens(self) -> int: ...

    @property
    def joined(self) -> int: ...

    @property
    def spaced(self) -> int: ...


def span_pieces(candidates: Iterable[HasText]) -> list[str]:
    """The texts :func:`~ragbudget.packing.spans.select_spans` counts with ``composed=True`` when
    ``candidates`` are in its pool (see the module's docstring): the joiner's ``" …"``; each
    candidate's text without its outer whitespace, and its last word alone and before the block's
    closing newline; each unit (sentence or list item) alone, its first word alone and after a
    space, its last word alone and before a newline; and where two units meet, the last word of
    one, the gap and the first word of the other. Counted in one batch with the candidates
    (``build_prompt`` does), they leave packing nothing to ask a served engine.

    >>> from ragbudget.packing.select import Candidate
    >>> span_pieces([Candidate("c", "It rained.\\nWe stayed in.", 1.0)])  # doctest: +NORMALIZE_WHITESPACE
    [' …', 'It rained.\\nWe stayed in.', ' in.', ' in.\\n', 'It rained.', 'It', ' It', ' rained.', ' rained.\\n',
     'We stayed in.', 'We', ' We', ' rained.\\nWe']
    """
    out = [JOINER.rstrip()]
    for c in candidates:
        text = c.text
        whole = text.strip()
        out += [whole, _tail(whole), _tail(whole) + "\n"]
        prev: tuple[int, int] | None = None
        for a, b, _ in split_sentences(text):
            u = text[a:b]
            out += [u, _head(u), " " + _head(u), _tail(u), _tail(u) + "\n"]
            if prev is not None:
                out.append(_joint(text[prev[0] : prev[1]], text[prev[1] : a], u))
            prev = (a, b)
    return list(dict.fromkeys(out))


def unit_edges(
    text: str, prev: tuple[int, int] | None, start: int, end: int, count_tokens: Callable[[str], int]
) -> tuple[int, int, int]:
    """``(joined, spaced, closed)`` of the unit ``text[start:end]``: what reading it right after
    the unit ``text[prev[0]:prev[1]]`` adds to the two counted apart (the gap, and a merge across
    it; 0 when it is the chunk's first), what its first word costs more after a space (a joiner's),
    and what its last word costs more before the block's closing newline. Only the words at a
    unit's ends meet anything; every text counted here is one of :func:`span_pieces`."""
    unit = text[start:end]
    head, tail = _head(unit), _tail(unit)
    spaced = count_tokens(" " + head) - count_tokens(head)
    closed = count_tokens(tail + "\n") - count_tokens(tail)
    joined = 0
    if prev is not None:
        before = text[prev[0] : prev[1]]
        meet = _joint(before, text[prev[1] : start], unit)
        joined = count_tokens(meet) - count_tokens(_tail(before)) - count_tokens(head)
    return joined, spaced, closed


def label_tokens(text: str, cost: int, count_tokens: Callable[[str], int]) -> int:
    """The tokens of a chunk's block (``cost`` in all, for ``text``) that are neither its text nor
    the closing newline: the label line (and whatever else the builder's block adds)."""
    whole = text.strip()
    closed = count_tokens(_tail(whole) + "\n") - count_tokens(_tail(whole))
    return cost - count_tokens(whole) - closed


def composed_tokens(units: Sequence[Costed], joiner: int) -> int:
    """The passage text's count, composed: ``units`` (in document order) alone, what the gap
    before each next unit of a run adds where the two meet, and ``joiner`` (the ``" …"``'s
    tokens) with the space after it before each later run."""
    n = units[0].n_tokens
    for before, u in pairwise(units):
        n += u.n_tokens + (u.joined if u.pos == before.pos + 1 else joiner + u.spaced)
    return n


def _head(unit: str) -> str:
    """The unit's first word: up to its first whitespace (a unit holds no line break)."""
    m = _SPACE.search(unit)
    return unit[: m.start()] if m else unit


def _tail(unit: str) -> str:
    """The unit's last word with the whitespace character before it (it opens the last
    pre-token: ``" ?\\w+"``), or the whole unit when it has no whitespace."""
    i = max(unit.rfind(" "), unit.rfind("\t"))
    return unit[i:] if i > 0 else unit


def _joint(before: str, gap: str, after: str) -> str:
    """Where two units meet: the last word of ``before``, the ``gap``, the first of ``after``."""
    return _tail(before) + gap + _head(after)
