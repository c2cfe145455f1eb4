"""Pack sentences, not whole chunks: the question's spans inside the best retrieved chunks.

One job: sentence packing, from splitting and scoring a pool's sentences (with the vectors the
index stored) to the exact spans that fit.

A 300–500-token chunk does not fit a 256-token allowance at all, and in a larger one most of a
chunk is not about the question. :func:`select_spans` keeps chunks as the unit of retrieval and
provenance but packs at sentence granularity inside the best of them:

1. the chunks are filtered exactly as :func:`~ragbudget.prompt.select.select_chunks` filters them (cut-off,
   duplicates, relevance floor, redundancy), and the best few — until their whole text is
   ``pool`` × the budget — are split into sentences (and list items) with exact offsets;
2. each sentence gets evidence for the question: BM25 over the pool's sentences (lexical), cosine
   to the question with the index's embedder (dense; vectors cached by content hash, see
   :class:`SpanScorer`), and its chunk's retrieval value (a sentence of the best chunk starts
   ahead);
3. sentences are taken greedily by that evidence, discounted by MMR against what is already in
   (word overlap ≥ ``redundancy`` drops a sentence as ``redundant``), each admission counted
   exactly: the passage it joins is re-rendered and re-counted in the generator's tokens, label
   included, so the sum of passage costs never exceeds the budget — the same contract as whole
   chunks, which :func:`~ragbudget.prompt.prompt.build_prompt` then checks on the rendered chat template
   (on a served engine the passage's cost is composed from counted pieces instead, below);
4. a sentence that cannot stand alone brings its neighbour (the *neighbour rule*, below);
5. one passage per chunk: its chosen sentences in document order, consecutive ones as the document
   has them, gaps shown as `` … ``; passages of one file stay in document order.

**Composed costs** (``composed=True``; :func:`~ragbudget.prompt.prompt.build_prompt` asks for them when
counting is a request to a served engine): a trial passage is not counted; its cost is composed
from pieces counted beforehand, all in one batch (:func:`span_pieces`): every unit alone, plus
what each boundary adds — the gap before a unit that follows its neighbour, counted where the two
meet (the last word of one, the gap, the first word of the other: a merge across the gap is in
that count), the joiner's ``" …"`` and the space after it, the block's closing newline after the
last word, the chunk's label. It rests on one property of the pre-tokenizers of byte-level BPEs
(GPT-2, SmolLM2, Llama 3, Qwen, tiktoken's): no pre-token holds whitespace but at its start, so
tokens never span a word boundary and the pieces add up to the passage's own count. On the real
llama-server that held for every passage packed for 120 SQuAD questions (371 passages,
bench/results/spans_counts.json).
It is not a proof for every tokenizer: the caller renders the prompt and, in the rare case it is
over, packs again on a budget smaller by the excess (``PromptBuilder.assemble``). A request then
asks a served engine's tokenizer for the question's render, the counts of candidates and pieces
not counted before (kept by digest: none once a candidate has been seen) and the final render —
never once per trial passage. (One path still counts trial by trial: a budget no sentence fits,
where the best chunk is cut to a window of words.)

**Neighbour rule** (simple on purpose, so it can be predicted): a sentence whose first word is a
pronoun or a connective (``He``, ``It``, ``This``, ``They``, ``However``, ``But``, ``Also``, ``As a
result``, … — :data:`NEEDS_PREVIOUS`) comes with the sentence before it in the same chunk, and
that one with its own if it needs it too, up to :data:`MAX_CHAIN` sentences back; a list item
(a line starting ``-``, ``*``, ``•``, ``1.``, ``a)``) comes with its lead-in, the nearest sentence
before the list. Not covered: a pronoun later in a sentence, a lead-in in the previous chunk.

**Clause units** (``unit="clause"``, off by default): a sentence of more than ``clause_tokens``
tokens is cut into clauses (:func:`split_clauses`: at ``;``, ``:``, a dash, a comma before
``which``/``who``/``and``/``but``/…), each scored and packed as a sentence is, with exact offsets.
The neighbour rule carries over: a clause that follows a colon or a dash, or opens with a relative
pronoun, conjunction or pronoun, brings the clause before it (and so on back to its sentence's
head); those steps inside one sentence do not count against :data:`MAX_CHAIN`. A clause's dense
evidence is its sentence's stored vector (``clause_embed`` mixes in its own, embedded at question
time), its lexical evidence its own.

Cost: splitting, BM25 and the exact counts are milliseconds; embedding the pool's sentences is the
part that costs (the embedder's forward pass: 78–95% of a cold call, bench/spans_profile.py;
0.2–0.34× the generator's prefill of the same prompt on a 2-core CPU). So an index embeds every
chunk's sentences at build time (:meth:`ragbudget.retrieval.index.Index.sentence_vectors`) and
:class:`SpanScorer` reads them first: a question then embeds no sentence and span packing adds a
few milliseconds (bench/spans_speed.py). On a served engine, costs are composed (above): no
admission asks the engine anything.

Citations stay exact: every :class:`Span` has its offsets in the chunk's text (``chunk.text[start:
end] == span.text``) and in its file (``span.source``), and the page(s) of the chunk it came from
(exact when the chunk lies on one page; the index keeps no page breaks inside a chunk, so a chunk
over a page break gives its page range).
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from ..errors import ConfigError
from ..types import DEFAULT_PACK, PACKS, QUESTION_STOPWORDS, Source
from .select import (
    Dropped,
    SelectedChunk,
    Selection,
    _check_options,
    _Item,
    _order,
    _overhead_of,
    _prepare,
    _truncate,
    _words,
)

__all__ = [
    "DEFAULT_CLAUSE_TOKENS",
    "DEFAULT_PACK",
    "JOINER",
    "MAX_CHAIN",
    "NEEDS_PREVIOUS",
    "PACKS",
    "Span",
    "SpanScorer",
    "UNITS",
    "bm25",
    "needs_previous",
    "select_spans",
    "sentence_digest",
    "sentence_texts",
    "span_pieces",
    "split_clauses",
    "split_sentences",
]

#: Shown between two non-adjacent runs of sentences of one chunk: the reader (and the model) sees
#: that text was left out.
JOINER = " … "

#: How many sentences back the neighbour rule may reach from one chosen sentence (steps between
#: clauses of one sentence are not counted: a clause's lead is part of the same sentence).
MAX_CHAIN = 3

#: What :func:`select_spans` packs: whole sentences (the default), or with ``unit="clause"`` a
#: long sentence's clauses (:func:`split_clauses`), so that the half of a sentence that answers
#: can be packed without the half that does not. Sentences stay the default until the QA harness
#: says otherwise (BENCHMARKS.md, "Fourth round: clause units").
UNITS = ("sentence", "clause")
#: Default ``clause_tokens`` of :func:`select_spans`: with ``unit="clause"``, a sentence of more
#: than this many tokens is cut into clauses. A little under the median sentence (29 SmolLM2
#: tokens on squad-tune): a short sentence has little to drop, and cutting it only adds joiners.
#: On the tuning split 16, 24, 32 and 40 all gained the same two questions at 256 tokens; 32 and
#: 40 lost none at 512/1,024, 16 lost at both (bench/results/qa_spans_squad_tune_clause*.json).
DEFAULT_CLAUSE_TOKENS = 24
# A clause shorter than this many words is not cut off ("in 1066," is not a unit of meaning).
_MIN_CLAUSE_WORDS = 4
# The words after a comma that open a clause leaning on what came before it: relative pronouns,
# subordinators and coordinating conjunctions.
_CLAUSE_WORDS = (
    "which|who|whom|whose|where|when|while|whereas|although|though|because|since|"
    "and|but|or|nor|so|yet|including|until|unless|after|before"
)
# Clause boundaries inside a sentence: ``;`` and ``:`` (then space; so not "3:45"), a dash set
# off as a dash (em dash, spaced en dash, "--"; not the hyphen of "33-yard" nor "1914–1918"), a
# comma before one of _CLAUSE_WORDS. The match (punctuation and spaces) belongs to neither
# clause: an adjacent pair is rendered as the document has it, a lone clause reads without a
# dangling comma. After a ``colon``, ``dash`` or ``comma`` the right side leans on the left (it
# explains it, or opens with a clause word); after ``semi`` it may stand alone.
_CLAUSE_CUT = re.compile(
    r"(?P<semi>;)\s+"
    r"|(?P<colon>:)\s+"
    r"|\s*(?P<dash>—|–(?=\s)|--)\s*"
    rf"|(?P<comma>,)\s+(?=(?:{_CLAUSE_WORDS})\b)",
    re.IGNORECASE,
)

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

# Defaults of the evidence mix; the weights are renormalized over the parts that are present
# (no embedder: lexical and chunk only). Checked on the QA harness's tuning split (bench/
# spans_qa.py --split squad-tune --sweep, bench/results/qa_spans_squad_tune.json): 0.6/0.2/0.2,
# 0.2/0.6/0.2, 0.5/0.5/0 and 0.3/0.3/0.4 were none better on the mean over 128-1,024 tokens,
# so they stay.
_W_DENSE, _W_LEXICAL, _W_CHUNK = 0.4, 0.4, 0.2
#: Default ``pool`` of :func:`select_spans`: chunk text considered, as a multiple of the budget.
#: 8, not the first guess 3: at 128 tokens a pool of 3 budgets (384) is one 300-500-token chunk,
#: so an answer in the second-ranked chunk could never be packed. On the tuning split (150 questions, squad-tune;
#: bench/results/qa_spans_squad_tune*.json) recall at 128/256/512/1,024 tokens rose with the pool
#: — 2: 73.3/84.0/92.0/95.3, 3: 73.3/86.7/93.3/95.3, 4: 76.0/88.7/94.7/95.3, 5: 78.7/88.0/94.0/
#: 95.3, 8: 81.3/90.0/94.7/95.3 — at the price of more sentences embedded the first time.
#: ``max_chunks`` (12) caps it at large budgets; 6 (pool 3) or 20 (pool 5) changed nothing.
DEFAULT_POOL = 8.0
# A sentence's own token count ± the BPE merge at each end and the joiner: an admission whose
# estimate is further over the room than this is not counted exactly (it cannot fit).
_SLACK = 4
# Word sets this small say nothing about redundancy ("He died." is not a repeat of every other
# sentence with "died" in it).
_MIN_REDUNDANCY_WORDS = 3

_WORD = re.compile(r"\w+")
_SPACE = re.compile(r"[ \t]")
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
# Question words that say nothing about where the answer is (as select's _QSTOP, plus a few).
_STOP = QUESTION_STOPWORDS | {"he", "her", "his", "our", "she", "we"}


@dataclass(frozen=True)
class Span:
    """One sentence (or list item) of a chunk, chosen for the context or left out.

    ``start``/``end`` are offsets in the chunk's text (``chunk.text[start:end] == text``);
    ``source`` is the same text's place in its file (offsets and page(s)). ``score`` is the
    question's evidence for it (0–1), ``n_tokens`` its own count in the generator's tokens.
    ``why``: ``question`` (chosen on its own evidence) or ``neighbour`` (kept for a chosen
    sentence that needs it, see the module's neighbour rule); for a span left out,
    ``over_budget``, ``redundant`` or ``duplicate``.
    """

    chunk_id: Any
    start: int
    end: int
    text: str
    score: float
    n_tokens: int
    source: Source | None = None
    why: str = "question"

    def to_dict(self) -> dict[str, Any]:
        return {
            "chunk_id": self.chunk_id,
            "start": self.start,
            "end": self.end,
            "score": round(self.score, 6),
            "n_tokens": self.n_tokens,
            "why": self.why,
            "source": self.source.to_dict() if self.source else None,
            "text": self.text,
        }


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


def span_pieces(candidates: Iterable[Any], *, unit: str = "sentence") -> list[str]:
    """The texts :func:`select_spans` counts with ``composed=True`` when ``candidates`` are in its
    pool (see the module's *Composed costs*): the joiner's ``" …"``; each candidate's text
    without its outer whitespace, and its last word alone and before the block's closing newline;
    each unit (sentence or list item; with ``unit="clause"``, every clause too) alone, its first
    word alone and after a space, its last word alone and before a newline; and where two units
    meet, the last word of one, the gap and the first word of the other. Counted in one batch
    with the candidates (``build_prompt`` does), they leave packing nothing to ask a served engine.

    >>> from ragbudget.prompt.select import Candidate
    >>> span_pieces([Candidate("c", "It rained.\\nWe stayed in.", 1.0)])  # doctest: +NORMALIZE_WHITESPACE
    [' …', 'It rained.\\nWe stayed in.', ' in.', ' in.\\n', 'It rained.', 'It', ' It', ' rained.', ' rained.\\n',
     'We stayed in.', 'We', ' We', ' rained.\\nWe']
    """
    if unit not in UNITS:
        raise ConfigError(f"unit must be one of {', '.join(UNITS)}; got {unit!r}")
    out = [JOINER.rstrip()]
    for c in candidates:
        text = str(c.text)
        whole = text.strip()
        out += [whole, _tail(whole), _tail(whole) + "\n"]
        # Each sentence's ways of being packed: whole, and with unit="clause" as its clauses
        # (which sentences are cut depends on their counts, not known yet, so both are in).
        ways: list[list[tuple[int, int]]] = []
        for a, b, item in split_sentences(text):
            cut = [(x, y) for x, y, _ in split_clauses(text, a, b)] if unit == "clause" and not item else []
            ways.append([(a, b)] + (cut if len(cut) > 1 else []))
        for i, options in enumerate(ways):
            for a, b in options:
                u = text[a:b]
                out += [u, _head(u), " " + _head(u), _tail(u), _tail(u) + "\n"]
            # Next units: a clause after the one before it in its sentence; the sentence's first
            # unit (whole or its first clause) after the last of the sentence before (whole or
            # its last clause: both end where that sentence ends).
            pairs = list(pairwise(options[1:]))
            if i:
                before = ways[i - 1]
                pairs += [(x, y) for x in dict.fromkeys((before[0], before[-1])) for y in options[:2]]
            out += [_joint(text[x[0] : x[1]], text[x[1] : y[0]], text[y[0] : y[1]]) for x, y in pairs]
    return list(dict.fromkeys(out))


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


def split_clauses(text: str, start: int = 0, end: int | None = None) -> list[tuple[int, int, bool]]:
    """The clauses of the sentence ``text[start:end]``: ``(start, end, leans)`` in ``text``'s
    offsets, in order, covering the sentence but for the punctuation and spaces at each cut.

    A sentence is cut after ``;`` or ``:``, around a dash (``—``, a spaced ``–``, ``--``) and
    after a comma that a relative pronoun, subordinator or conjunction follows (``, which``,
    ``, because``, ``, and`` …); never inside parentheses or brackets, and never so that a clause
    has fewer than four words. ``leans``: the clause cannot stand without the one before it — it
    follows a colon or a dash, opens with one of those words, or starts with a pronoun or
    connective (:func:`needs_previous`; for the first clause: the sentence does).

    >>> t = "The tower, which is 48 metres tall, was lit in 1847; it used a paraffin lamp."
    >>> [(t[a:b], leans) for a, b, leans in split_clauses(t)]
    [('The tower, which is 48 metres tall, was lit in 1847', False), ('it used a paraffin lamp.', True)]
    """
    end = len(text) if end is None else end
    depth, opened = 0, start
    cuts: list[tuple[int, int, bool]] = []  # (left clause's end, right clause's start, right leans)
    for m in _CLAUSE_CUT.finditer(text, start, end):
        # Brackets opened in the sentence and not closed before the cut: it would fall inside a
        # parenthesis. A stray closer ("1)", "a)") opens nothing, so depth stays ≥ 0.
        for ch in text[opened : m.start()]:
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth = max(0, depth - 1)
        opened = m.start()
        if depth > 0 or m.end() >= end:
            continue
        cuts.append((m.start(), m.end(), m.lastgroup in ("colon", "dash", "comma")))
    out: list[tuple[int, int, bool]] = []
    a, leans = start, needs_previous(text[start:end])
    for left_end, right_start, right_leans in cuts:
        # Too short a clause on either side: the cut is skipped (the clause runs on).
        if len(text[a:left_end].split()) < _MIN_CLAUSE_WORDS:
            continue
        if len(text[right_start:end].split()) < _MIN_CLAUSE_WORDS:
            break
        out.append((a, left_end, leans))
        a = right_start
        leans = right_leans or needs_previous(text[right_start:end])
    out.append((a, end, leans))
    return out


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


def _stem(word: str) -> str:
    # A crude stemmer: plural and -ed/-ing endings off, then a 6-character prefix (as select's
    # oversize-chunk cut), so "supplies"/"supply", "boats"/"boat", "founded"/"founding" meet.
    if len(word) > 4:
        if word.endswith("ies"):
            word = word[:-3] + "y"
        elif word.endswith("s") and not word.endswith(("ss", "us", "is")):
            word = word[:-1]
        elif word.endswith("ing") and len(word) > 5:
            word = word[:-3]
        elif word.endswith("ed") and len(word) > 5:
            word = word[:-2]
    return word[:6]


def _term_list(text: str) -> list[str]:
    return [_stem(w) for w in _WORD.findall(text.lower()) if w not in _STOP and (len(w) > 2 or w.isdigit())]


def bm25(question: str, docs: Sequence[str], *, k1: float = 1.2, b: float = 0.75) -> list[float]:
    """Okapi BM25 of ``question`` against each of ``docs``, the docs themselves the collection
    (so a word in every sentence of the pool weighs almost nothing).

    >>> [round(x, 3) for x in bm25("capital of France", ["Paris is the capital.", "Lyon is big."])]
    [0.693, 0.0]
    """
    q = set(_term_list(question))
    terms = [_term_list(d) for d in docs]
    if not q or not docs:
        return [0.0] * len(docs)
    n = len(docs)
    avg = max(1e-9, sum(len(t) for t in terms) / n)
    df = {w: sum(1 for t in terms if w in t) for w in q}
    idf = {w: math.log(1.0 + (n - d + 0.5) / (d + 0.5)) for w, d in df.items()}
    out = []
    for t in terms:
        s = 0.0
        for w in q:
            tf = t.count(w)
            if tf:
                s += idf[w] * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(t) / avg))
        out.append(s)
    return out


class SpanScorer:
    """Dense evidence for sentences: cosine to the question with ``embedder`` (any
    :class:`~ragbudget.retrieval.embed.Embedder`), the sentences embedded in one batch per question and
    their vectors kept by content hash (up to ``cache_size``), so a chunk seen by an earlier
    question costs nothing again. Thread-safe.

    ``stored`` (e.g. :meth:`ragbudget.retrieval.index.Index.sentence_vectors`, which an index built with
    ``sentence_vectors=True`` holds for every chunk) maps chunk ids to ``(digests, vectors)`` —
    each sentence's :func:`sentence_digest` and its vector, embedded at build time with the same
    embedder — and is asked first (:meth:`preload`): a sentence found there is never embedded at
    question time. It must come from the same embedder as ``embedder`` (the caller's check: the
    pipeline passes the index's own). A chunk it does not know (an index built without them, the
    default) falls back to embedding on first use, through ``persist`` when given (the
    :class:`~ragbudget.retrieval.sentence_cache.SentenceCache` beside the index: a sentence any earlier
    question embedded, in any process, is read from there).

    >>> from ragbudget.retrieval.embed import HashEmbedder
    >>> s = SpanScorer(HashEmbedder())
    >>> sims = s.similarities("where is Paris", ["Paris is in France.", "Bread is baked."])
    >>> len(sims), s.cached, s.embedded
    (2, 3, 2)
    """

    def __init__(
        self,
        embedder: Any,
        *,
        cache_size: int = 50_000,
        stored: Callable[[Sequence[Any]], Mapping[Any, tuple[Sequence[bytes], Any]]] | None = None,
        persist: Any = None,
    ) -> None:
        if embedder is None:
            raise ConfigError("SpanScorer needs an embedder (e.g. the index's own: Index.embedder)")
        self.embedder = embedder
        self.cache_size = int(cache_size)
        self.stored = stored
        #: Vectors kept across processes (a :class:`~ragbudget.retrieval.sentence_cache.SentenceCache`:
        #: ``get(digests)`` and ``put({digest: vector})``): asked before a sentence is embedded,
        #: given every sentence embedded.
        self.persist = persist
        #: Sentences sent to the embedder so far (questions not counted): 0 when every sentence
        #: came from ``stored`` or a cache.
        self.embedded = 0
        #: Sentences found in ``persist`` instead of being embedded.
        self.persisted = 0
        self._cache: OrderedDict[bytes, Any] = OrderedDict()
        # Chunk ids already asked of ``stored`` (cleared when the cache evicts: their vectors may
        # be gone, so they are asked again rather than embedded).
        self._asked: set[Any] = set()
        self._lock = threading.Lock()

    @property
    def cached(self) -> int:
        """Vectors held."""
        return len(self._cache)

    def preload(self, chunk_ids: Iterable[Any]) -> int:
        """Take the sentence vectors of ``chunk_ids`` from ``stored`` into the cache (one lookup
        per chunk per scorer); returns how many vectors came in. No ``stored``: nothing."""
        import numpy as np

        if self.stored is None:
            return 0
        with self._lock:
            ids = [i for i in dict.fromkeys(chunk_ids) if i not in self._asked]
        if not ids:
            return 0
        got = self.stored(ids)
        n = 0
        with self._lock:
            self._asked.update(ids)
            for digests, vectors in got.values():
                mat = np.asarray(vectors, dtype=np.float32)
                for d, v in zip(digests, mat, strict=True):
                    key = b"d" + bytes(d)
                    if key not in self._cache:
                        self._cache[key] = v
                        n += 1
            self._evict()
        return n

    def _evict(self) -> None:
        if len(self._cache) > self.cache_size:
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self._asked.clear()

    def remember_query(self, question: str, vector: Any) -> None:
        """Keep ``question``'s vector, embedded by the caller with the same embedder (the search's
        query vector), so :meth:`similarities` does not embed the question again."""
        import numpy as np

        key = b"q" + _digest(question)
        with self._lock:
            self._cache[key] = np.asarray(vector, dtype=np.float32).reshape(-1)
            self._cache.move_to_end(key)  # the newest entry: the last one eviction reaches
            self._evict()

    def similarities(self, question: str, texts: Sequence[str]) -> list[float]:
        """Cosine of each of ``texts`` to ``question`` (vectors are unit length)."""
        import numpy as np

        keys = [b"q" + _digest(question)] + [b"d" + _digest(t) for t in texts]
        with self._lock:
            have = {k: self._cache[k] for k in keys if k in self._cache}
        todo = [i for i, k in enumerate(keys) if k not in have]
        if todo:
            qi = [i for i in todo if i == 0]
            di = list(dict.fromkeys(i for i in todo if i > 0 and keys[i] not in have))
            if qi:
                have[keys[0]] = np.asarray(self.embedder.embed_query(question), dtype=np.float32)
            # One text per digest: a sentence repeated in the pool is embedded once.
            first: dict[bytes, int] = {}
            for i in di:
                first.setdefault(keys[i], i)
            if first and self.persist is not None:
                # Embedded by an earlier question, maybe in another process: taken from there.
                found = self.persist.get([k[1:] for k in first])
                for k in [k for k in first if k[1:] in found]:
                    have[k] = found[k[1:]]
                    del first[k]
                self.persisted += len(found)
            if first:
                # Documents, not queries: the same side of the embedder the index's chunks used.
                vecs = self.embedder.embed_documents([texts[i - 1] for i in first.values()])
                self.embedded += len(first)
                for k, v in zip(first, vecs, strict=True):
                    # Rounded as an index and the cache keep them (float16), so a question scores
                    # the same whether its sentences were just embedded, cached or stored.
                    have[k] = np.asarray(v, dtype=np.float16).astype(np.float32)
                if self.persist is not None:
                    self.persist.put({k[1:]: have[k] for k in first})
            with self._lock:
                for i in todo:
                    self._cache[keys[i]] = have[keys[i]]
                self._evict()
        qv = have[keys[0]]
        return [float(np.dot(qv, have[k])) for k in keys[1:]]


def sentence_digest(text: str) -> bytes:
    """The 16-byte key of a sentence's vector: in :class:`SpanScorer`'s cache and in an index's
    stored sentence vectors (:meth:`ragbudget.retrieval.index.Index.sentence_vectors`)."""
    return _digest(text)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass(eq=False)
class _Unit:
    chunk: int  # index into the pool
    pos: int  # index among its chunk's units
    start: int
    end: int
    text: str
    item: bool
    n_tokens: int
    deps: tuple[int, ...] = ()  # positions in the same chunk it brings along
    words: frozenset[str] = frozenset()
    # The sentence it belongs to (its index in the chunk; a whole sentence is its own) and that
    # sentence's text: a clause's dense evidence starts from its sentence's stored vector.
    sentence: int = 0
    whole: str = ""
    leans: bool = False  # needs the unit before it (the neighbour rule)
    # With composed costs: what reading it after the unit before it adds to the two counted
    # apart (the gap, and a merge across it), after a joiner's space, and before the block's
    # closing newline (see _passage).
    joined: int = 0
    spaced: int = 0
    closed: int = 0
    score: float = 0.0
    red: float = 0.0  # max overlap with what is already chosen
    why: str = "over_budget"


def select_spans(
    question: str,
    candidates: Iterable[Any],
    *,
    budget_tokens: int,
    count_tokens: Callable[[str], int],
    chunk_overhead: int | Callable[[Any], int] = 0,
    scorer: SpanScorer | None = None,
    pool: float = DEFAULT_POOL,
    max_chunks: int = 12,
    weights: tuple[float, float, float] = (_W_DENSE, _W_LEXICAL, _W_CHUNK),
    cue_weight: float = 0.0,
    context_weight: float = 0.0,
    cost_exponent: float = 0.0,
    unit: str = "sentence",
    clause_tokens: int = DEFAULT_CLAUSE_TOKENS,
    clause_embed: float = 0.0,
    prime: Callable[[Sequence[str]], Any] | None = None,
    composed: bool = False,
    lambda_: float = 0.7,
    temperature: float = 0.02,
    order: str = "relevance",
    min_score: float | None = None,
    relevance_floor: float = 0.0,
    redundancy: float = 0.9,
    similarity: Callable[[Any, Any], float] | None = None,
    truncate_oversize: bool = True,
    merge_adjacent: bool = True,
    max_merge_gap: int = 2,
) -> Selection:
    """Pack the question's sentences from the best ``candidates`` under a hard token cap.

    Takes what :func:`~ragbudget.prompt.select.select_chunks` takes (same filtering, same costs:
    ``count_tokens(text) + chunk_overhead`` per passage, ``tokens_used <= budget_tokens``), and:
    ``scorer`` (a :class:`SpanScorer`; ``None``: lexical and chunk evidence only), ``pool`` (the
    chunks considered, in score order, stop once their summed cost reaches ``pool`` × the budget;
    at most ``max_chunks``), ``weights`` (dense, lexical, chunk) of the evidence, ``cue_weight``
    (the answer-type cue: a sentence holding what the question asks for — a number or date for
    "when"/"how many"/"what year", a name for "who" — gains this much; 0: off) and
    ``context_weight`` (a sentence's evidence mixed with its better neighbour's in the same
    chunk, so the sentence after the one that names the question's terms is in reach; 0: off),
    ``cost_exponent`` (α: sentences are taken by evidence ÷ tokens^α, the tokens being what the
    admission adds — the sentence and the neighbours it brings — so short dense sentences go
    first; 0: off, by evidence alone), ``unit`` (:data:`UNITS`: ``"sentence"``, or ``"clause"``
    to cut every sentence of more than ``clause_tokens`` tokens into its clauses with
    :func:`split_clauses` — each clause scored, packed and cited on its own, one that leans on its
    lead bringing it under the neighbour rule, adjacent ones rendered as the sentence has them;
    ``clause_embed`` in [0, 1] is the share of a clause's dense evidence taken from its own
    vector, embedded at question time, the rest being its sentence's stored one), ``prime`` (a
    batch counter to warm ``count_tokens``, e.g. a served engine's), ``composed`` (cost trial
    passages from their pieces, :func:`span_pieces`, counted in one ``prime`` batch, instead of
    counting each: see the module's *Composed costs*; the caller checks the rendered prompt). ``merge_adjacent`` and
    ``max_merge_gap`` are accepted for the same call shape; passages are per chunk here.

    >>> hits = [type("H", (), dict(chunk_id=1, score=0.9, sources=(), text=(
    ...     "Paris is the capital of France. It has 2 million people. Bread is cheap there.")))()]
    >>> sel = select_spans("How many million people?", hits, budget_tokens=11,
    ...                    count_tokens=lambda s: len(s.split()))
    >>> sel.chunks[0].text, [s.why for s in sel.chunks[0].spans]
    ('Paris is the capital of France. It has 2 million people.', ['neighbour', 'question'])
    """
    _check_options(
        order=order,
        budget_tokens=budget_tokens,
        temperature=temperature,
        lambda_=lambda_,
        relevance_floor=relevance_floor,
    )
    if not (isinstance(pool, (int, float)) and not isinstance(pool, bool) and pool > 0):
        raise ConfigError(f"pool must be a number > 0 (the budget multiple of chunk text to consider); got {pool!r}")
    if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
        raise ConfigError(f"max_chunks must be an integer ≥ 1; got {max_chunks!r}")
    if len(weights) != 3 or any(w < 0 for w in weights) or not any(weights):
        raise ConfigError(f"weights must be three numbers ≥ 0 (dense, lexical, chunk), not all 0; got {weights!r}")
    for name, w in (("cue_weight", cue_weight), ("context_weight", context_weight)):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1:
            raise ConfigError(f"{name} must be a number in [0, 1]; got {w!r}")
    if isinstance(cost_exponent, bool) or not isinstance(cost_exponent, (int, float)) or not cost_exponent >= 0:
        raise ConfigError(
            f"cost_exponent must be a number ≥ 0 (0: evidence alone, no per-token discount); got {cost_exponent!r}"
        )
    if unit not in UNITS:
        raise ConfigError(f"unit must be one of {', '.join(UNITS)}; got {unit!r}")
    if isinstance(clause_tokens, bool) or not isinstance(clause_tokens, int) or clause_tokens < 1:
        raise ConfigError(f"clause_tokens must be an integer ≥ 1; got {clause_tokens!r}")
    if isinstance(clause_embed, bool) or not isinstance(clause_embed, (int, float)) or not 0 <= clause_embed <= 1:
        raise ConfigError(f"clause_embed must be a number in [0, 1]; got {clause_embed!r}")
    if not isinstance(composed, bool):
        raise ConfigError(f"composed must be True or False; got {composed!r}")
    del merge_adjacent, max_merge_gap  # one passage per chunk; see the docstring
    overhead_of = _overhead_of(chunk_overhead)
    cands = list(candidates)
    kept, dropped = _prepare(
        cands,
        count_tokens,
        overhead_of,
        lambda_=lambda_,
        temperature=temperature,
        min_score=min_score,
        relevance_floor=relevance_floor,
        redundancy=redundancy,
        similarity=similarity,
    )

    # The pool: the best chunks, until their whole text is a few budgets' worth.
    chunks: list[_Item] = []
    total = 0
    for it in kept:
        if len(chunks) >= max_chunks or (chunks and total >= pool * budget_tokens):
            break
        chunks.append(it)
        total += it.cost
    outside = kept[len(chunks) :]

    units = _units(chunks, count_tokens, prime, unit=unit, clause_tokens=clause_tokens, composed=composed)
    # Composed costs: each chunk's label (its block's count less its stripped text's and the
    # closing newline's, as that follows the chunk's last word) and the joiner's " …"; _units
    # counted them with the pieces.
    compose = [(_label(it, count_tokens), count_tokens(JOINER.rstrip())) for it in chunks] if composed else None
    if scorer is not None and units:
        # Vectors stored at build time (an index's sentence vectors) before anything is embedded.
        scorer.preload(i for it in chunks for i in it.ids)
    _score(
        question,
        chunks,
        units,
        scorer,
        weights,
        cue_weight=cue_weight,
        context_weight=context_weight,
        clause_embed=clause_embed,
    )
    chosen = _pack(
        units,
        chunks,
        budget_tokens,
        count_tokens,
        overhead_of,
        lambda_,
        redundancy,
        cost_exponent=cost_exponent,
        compose=compose,
    )

    passages: list[tuple[_Item, SelectedChunk]] = []
    for ci, it in enumerate(chunks):
        mine = [u for u in units if u.chunk == ci and u.pos in chosen.get(ci, ())]
        if mine:
            passages.append((it, _passage(it, mine, count_tokens, overhead_of, compose[ci] if compose else None)))
    if not passages and chunks and budget_tokens > 0 and truncate_oversize:
        # Not even one sentence fits: the oversize-chunk cut (a window of words) of the best one.
        cut = _truncate(chunks[0], budget_tokens, count_tokens, overhead_of, question)
        if cut is not None:
            passages.append((chunks[0], _cut_passage(chunks[0], cut)))
            for u in units:
                if u.chunk == 0:
                    u.why = "over_budget"

    used_ids = {cid for _, p in passages for cid in p.chunk_ids}
    for it in [*chunks, *outside]:
        if it.ids[0] not in used_ids:
            dropped.append(Dropped(it.ids[0], "over_budget", it.score, it.n_tokens))
    left_out = tuple(
        _span(chunks[u.chunk], u, u.why)
        for u in units
        if not (u.pos in chosen.get(u.chunk, ()) and chunks[u.chunk].ids[0] in used_ids)
    )
    used = sum(p.cost for _, p in passages)
    # The invariant the whole library rests on; a violation is a bug here, not a user error.
    assert used <= budget_tokens, (used, budget_tokens)
    return Selection(
        chunks=tuple(_ordered(passages, order)),
        tokens_used=used,
        tokens_allowed=budget_tokens,
        dropped=tuple(dropped),
        order=order,
        n_candidates=len(cands),
        pack="spans",
        spans_dropped=left_out,
    )


def _units(
    chunks: Sequence[_Item],
    count_tokens: Callable[[str], int],
    prime: Callable[[Sequence[str]], Any] | None,
    *,
    unit: str = "sentence",
    clause_tokens: int = DEFAULT_CLAUSE_TOKENS,
    composed: bool = False,
) -> list[_Unit]:
    """Every chunk's sentences — or, with ``unit="clause"``, the clauses of those over
    ``clause_tokens`` — with their neighbour dependencies; a unit repeated from a better chunk
    (chunk overlap, quoted text) is marked ``duplicate`` and never packed. ``composed``: each
    unit's pieces are counted too (:func:`span_pieces`, all in one ``prime`` batch)."""
    split = [split_sentences(it.text) for it in chunks]
    if prime is not None and composed:
        prime(span_pieces(chunks, unit=unit))
    elif prime is not None:
        prime([it.text[a:b] for it, parts in zip(chunks, split, strict=True) for a, b, _ in parts])
    # (sentence index, start, end, list item, leans) per unit, per chunk.
    pieces: list[list[tuple[int, int, int, bool, bool]]] = []
    for it, parts in zip(chunks, split, strict=True):
        here: list[tuple[int, int, int, bool, bool]] = []
        for si, (a, b, item) in enumerate(parts):
            if unit == "clause" and not item and count_tokens(it.text[a:b]) > clause_tokens:
                here += [(si, x, y, False, leans) for x, y, leans in split_clauses(it.text, a, b)]
            else:
                here.append((si, a, b, item, needs_previous(it.text[a:b])))
        pieces.append(here)
    if prime is not None and unit == "clause" and not composed:
        prime([it.text[a:b] for it, here in zip(chunks, pieces, strict=True) for _, a, b, _, _ in here])
    out: list[_Unit] = []
    seen: set[str] = set()
    for ci, (it, parts, cut) in enumerate(zip(chunks, split, pieces, strict=True)):
        mine: list[_Unit] = []
        for pos, (si, a, b, item, leans) in enumerate(cut):
            text = it.text[a:b]
            whole = it.text[parts[si][0] : parts[si][1]]
            u = _Unit(
                ci, pos, a, b, text, item, count_tokens(text), words=_words(text), sentence=si, whole=whole, leans=leans
            )
            key = " ".join(text.split()).lower()
            if key in seen:
                u.why = "duplicate"
            seen.add(key)
            mine.append(u)
        for u in mine:
            u.deps = _deps(mine, u.pos)
            if composed:
                # Only the words at a unit's ends meet anything: its first word after a space or
                # the unit before it, its last before a newline (span_pieces counted them all).
                head, tail = _head(u.text), _tail(u.text)
                u.spaced = count_tokens(" " + head) - count_tokens(head)
                u.closed = count_tokens(tail + "\n") - count_tokens(tail)
                if u.pos:
                    prev = mine[u.pos - 1]
                    meet = _joint(prev.text, it.text[prev.end : u.start], u.text)
                    u.joined = count_tokens(meet) - count_tokens(_tail(prev.text)) - count_tokens(head)
        out += mine
    return out


def _deps(units: Sequence[_Unit], pos: int) -> tuple[int, ...]:
    """The positions ``units[pos]`` brings along under the neighbour rule (nearest first); at
    most :data:`MAX_CHAIN` sentences back, a clause's leads in its own sentence not counted."""
    deps: list[int] = []
    cur, back = pos, 0
    while back < MAX_CHAIN and cur > 0:
        u = units[cur]
        if u.item:
            # A list item's lead-in: the nearest unit before the list (not the items between).
            lead = cur - 1
            while lead >= 0 and units[lead].item:
                lead -= 1
            if lead < 0:
                break
            cur = lead
        elif u.leans:
            cur -= 1
        else:
            break
        back += units[cur].sentence != u.sentence
        deps.append(cur)
    return tuple(deps)


def _score(
    question: str,
    chunks: Sequence[_Item],
    units: list[_Unit],
    scorer: SpanScorer | None,
    weights: tuple[float, float, float],
    *,
    cue_weight: float = 0.0,
    context_weight: float = 0.0,
    clause_embed: float = 0.0,
) -> None:
    """Each unit's evidence in [0, 1]: a weighted mean of dense (cosine over the pool's best),
    lexical (BM25 over the pool's units, so a clause is weighed against clauses) and its chunk's
    value (already relative to the best); then, when asked, mixed with its better neighbour's
    (``context_weight``) and raised by the answer-type cue (``cue_weight``).

    A clause's dense evidence is its sentence's cosine — the vector the index stored, so nothing
    is embedded at question time — and its own lexical evidence tells it from the other clauses;
    ``clause_embed`` > 0 mixes in that share of the clause's own cosine (embedded on first use)."""
    if not units:
        return
    w_dense, w_lex, w_chunk = weights
    texts = [u.text for u in units]
    lex = bm25(question, texts)
    top_lex = max(lex)
    dense = [0.0] * len(units)
    if scorer is not None and w_dense > 0:
        dense = scorer.similarities(question, [u.whole for u in units])
        cut = [i for i, u in enumerate(units) if u.text != u.whole]
        if clause_embed > 0 and cut:
            own = scorer.similarities(question, [texts[i] for i in cut])
            for i, d in zip(cut, own, strict=True):
                dense[i] = (1 - clause_embed) * dense[i] + clause_embed * d
        dense = [max(0.0, d) for d in dense]
    else:
        w_dense = 0.0
    top_dense = max(dense)
    if top_lex <= 0:
        w_lex = 0.0
    if top_dense <= 0:
        w_dense = 0.0
    norm = (w_dense + w_lex + w_chunk) or 1.0
    own = []
    for u, d, x in zip(units, dense, lex, strict=True):
        parts = (
            w_dense * (d / top_dense if top_dense > 0 else 0.0)
            + w_lex * (x / top_lex if top_lex > 0 else 0.0)
            + w_chunk * chunks[u.chunk].value
        )
        own.append(parts / norm)
    if context_weight > 0:
        mixed = []
        for i, u in enumerate(units):
            near = [own[j] for j in (i - 1, i + 1) if 0 <= j < len(units) and units[j].chunk == u.chunk]
            mixed.append((1 - context_weight) * own[i] + context_weight * max(near, default=own[i]))
        own = mixed
    cue = _answer_cue(question) if cue_weight > 0 else None
    qwords = {w.lower() for w in _WORD.findall(question)}
    for i, u in enumerate(units):
        bonus = cue_weight if cue is not None and cue(u.text, qwords) else 0.0
        u.score = (own[i] + bonus) / (1.0 + cue_weight) if cue_weight > 0 else own[i]


# The answer-type cue: what a question word asks for, as a test on a sentence's text. Simple on
# purpose (English question words; a sentence either has such a token or not).
_NUMBER = re.compile(
    r"\d|\b(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|twenty|"
    r"thirty|forty|fifty|hundred|thousand|million|billion|dozen|half|century|"
    r"january|february|march|april|may|june|july|august|september|october|"
    r"november|december)\b",
    re.IGNORECASE,
)
_NUMERIC_Q = re.compile(
    r"\b(?:when|how (?:many|much|long|old|far|often|large|big|tall|high)|"
    r"what (?:year|date|decade|century|time|percentage|percent|age|number)|"
    r"which (?:year|date|decade|century))\b",
    re.IGNORECASE,
)
_PERSON_Q = re.compile(r"\b(?:who|whom|whose)\b", re.IGNORECASE)
_NAME = re.compile(r"(?<=\s)[A-Z][\w'’-]+")


def _answer_cue(question: str) -> Callable[[str, set[str]], bool] | None:
    """A test for sentences that hold the kind of thing ``question`` asks for, or ``None`` when
    its question word says nothing (what, which, why, how)."""
    if _NUMERIC_Q.search(question):
        return lambda text, _q: _NUMBER.search(text) is not None
    if _PERSON_Q.search(question):
        # A capitalized word past the first that the question does not already name.
        return lambda text, q: any(m.group(0).lower() not in q for m in _NAME.finditer(text))
    return None


def _pack(
    units: list[_Unit],
    chunks: Sequence[_Item],
    budget: int,
    count_tokens: Callable[[str], int],
    overhead_of: Callable[[Any], int],
    lambda_: float,
    redundancy: float,
    *,
    cost_exponent: float = 0.0,
    compose: Sequence[tuple[int, int]] | None = None,
) -> dict[int, set[int]]:
    """Greedy MMR over the units, every admission counted exactly (or, with ``compose``, costed
    from its pieces: see :func:`_passage`); ``{chunk: chosen positions}``.

    Greedy, not a knapsack: a unit's cost depends on what its chunk already holds (a gap costs a
    joiner, a neighbour may already be in), and best-first is what a tight budget needs."""
    by_chunk: dict[int, list[_Unit]] = {}
    for u in units:
        by_chunk.setdefault(u.chunk, []).append(u)
    chosen: dict[int, set[int]] = {}
    cost: dict[int, int] = {}
    room = budget
    todo = [u for u in units if u.why != "duplicate"]
    while todo:
        # The MMR value: evidence, less a share of the overlap with what is already chosen.
        def value(u: _Unit) -> tuple[float, int, int]:
            penalty = max(0.0, (u.red - 0.5) / 0.5)
            v = u.score * (1.0 - (1.0 - lambda_) * penalty)
            if cost_exponent > 0:
                # Evidence per token: what this admission adds (the unit and the neighbours it
                # brings that are not in yet), so a short sentence outranks a long one of like
                # evidence.
                have_u = chosen.get(u.chunk, ())
                n = sum(by_chunk[u.chunk][p].n_tokens for p in (u.pos, *u.deps) if p not in have_u)
                v /= max(1, n) ** cost_exponent
            return (v, -u.chunk, -u.pos)

        best = max(todo, key=value)
        todo.remove(best)
        if best.red >= redundancy:
            best.why = "redundant"
            continue
        have = chosen.get(best.chunk, set())
        new = [p for p in (best.pos, *best.deps) if p not in have]
        mine = by_chunk[best.chunk]
        if sum(mine[p].n_tokens for p in new) > room + _SLACK:
            continue  # stays over_budget: the room only shrinks
        trial = sorted(have | set(new))
        passage = _passage(
            chunks[best.chunk],
            [mine[p] for p in trial],
            count_tokens,
            overhead_of,
            compose[best.chunk] if compose is not None else None,
        )
        delta = passage.cost - cost.get(best.chunk, 0)
        if delta > room:
            continue
        room -= delta
        cost[best.chunk] = passage.cost
        chosen[best.chunk] = set(trial)
        for p in new:
            mine[p].why = "question" if p == best.pos else "neighbour"
        added = [mine[p] for p in new]
        todo = [u for u in todo if u not in added]
        for u in todo:
            for a in added:
                if min(len(u.words), len(a.words)) >= _MIN_REDUNDANCY_WORDS:
                    u.red = max(u.red, _containment(u.words, a.words))
        if todo and room + _SLACK < min(u.n_tokens for u in todo):
            break
    return chosen


def _containment(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / min(len(a), len(b))


def _passage(
    it: _Item,
    units: Sequence[_Unit],
    count_tokens: Callable[[str], int],
    overhead_of: Callable[[Any], int],
    compose: tuple[int, int] | None = None,
) -> SelectedChunk:
    """The passage of chunk ``it`` holding ``units`` (document order): consecutive units as the
    chunk has them, runs joined by :data:`JOINER`; counted exactly, label included. With
    ``compose`` (the chunk's label tokens and the joiner's ``" …"``), costed from the units'
    pieces instead (:func:`span_pieces`), nothing counted here: every unit alone; what the gap
    before each next unit of a run adds where the two meet; ``" …"`` and the space after it
    before each later run; the label; the block's closing newline after the last unit."""
    units = sorted(units, key=lambda u: u.pos)
    runs: list[tuple[int, int]] = []
    prev = -2
    for u in units:
        if runs and u.pos == prev + 1:
            runs[-1] = (runs[-1][0], u.end)
        else:
            runs.append((u.start, u.end))
        prev = u.pos
    text = JOINER.join(it.text[a:b] for a, b in runs)
    sources = (_narrow(it.sources[0], runs[0][0], runs[-1][1]),) + it.sources[1:] if it.sources else ()
    spans = tuple(_span(it, u, u.why) for u in units)
    if compose is not None:
        label, joiner = compose
        n = units[0].n_tokens
        for before, u in pairwise(units):
            n += u.n_tokens + (u.joined if u.pos == before.pos + 1 else joiner + u.spaced)
        cost = n + label + units[-1].closed
        return SelectedChunk(it.ids, text, it.score, n, cost, sources, it.headings, spans=spans)
    probe = SelectedChunk(it.ids, text, it.score, 0, 0, sources, it.headings, spans=spans)
    n = count_tokens(text)
    return SelectedChunk(it.ids, text, it.score, n, n + int(overhead_of(probe)), sources, it.headings, spans=spans)


def _label(it: _Item, count_tokens: Callable[[str], int]) -> int:
    """The tokens of chunk ``it``'s block that are neither its text nor the closing newline:
    the label line (and whatever else the builder's block adds), for composed costs."""
    whole = it.text.strip()
    closed = count_tokens(_tail(whole) + "\n") - count_tokens(_tail(whole))
    return it.cost - count_tokens(whole) - closed


def _cut_passage(it: _Item, cut: _Item) -> SelectedChunk:
    """The oversize cut of :func:`~ragbudget.prompt.select._truncate` as a passage with its one span."""
    if it.sources and cut.sources:
        start = cut.sources[0].start - it.sources[0].start
    else:
        start = it.text.find(cut.text)
    span = Span(
        it.ids[0],
        start,
        start + len(cut.text),
        cut.text,
        it.value,
        cut.n_tokens,
        cut.sources[0] if cut.sources else None,
        "question",
    )
    return SelectedChunk(
        cut.ids, cut.text, cut.score, cut.n_tokens, cut.cost, cut.sources, cut.headings, truncated=True, spans=(span,)
    )


def _span(it: _Item, u: _Unit, why: str) -> Span:
    src = _narrow(it.sources[0], u.start, u.end) if it.sources else None
    return Span(it.ids[0], u.start, u.end, u.text, u.score, u.n_tokens, src, why)


def _narrow(s: Source, start: int, end: int) -> Source:
    """``s`` (a chunk's place in its file) narrowed to chunk offsets ``[start, end)``."""
    a = min(s.end, s.start + start)
    return Source(s.path, a, min(s.end, s.start + end), s.page_start, s.page_end, s.label)


def _ordered(passages: list[tuple[_Item, SelectedChunk]], order: str) -> list[SelectedChunk]:
    """``order`` over files (a file ranks by its best passage), document order inside a file."""
    groups: dict[str, list[tuple[_Item, SelectedChunk]]] = {}
    for it, p in passages:
        key = p.sources[0].path if p.sources else f"\x00{it.rank}"
        groups.setdefault(key, []).append((it, p))
    heads = []
    for members in groups.values():
        members.sort(key=lambda m: (m[1].sources[0].start if m[1].sources else 0, m[0].rank))
        best = min(members, key=lambda m: m[0].rank)[0]
        heads.append(
            _Item(
                best.ids,
                "",
                max(m[0].score for m in members),
                best.sources if order == "document" else (),
                (),
                0,
                0,
                best.rank,
            )
        )
    out: list[SelectedChunk] = []
    by_head = dict(zip((id(h) for h in heads), groups.values(), strict=True))
    for h in _order(heads, order):
        out += [p for _, p in by_head[id(h)]]
    return out
