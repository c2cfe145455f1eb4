"""Follow-up questions: whether a question leans on earlier turns, and its retrieval query.

"what about its footer?" means nothing to an index on its own. :func:`is_follow_up` tells such a
question (a pronoun or demonstrative, an opener like "what about", or three content words or
fewer); :func:`expand_query` appends the salient terms of the previous questions to it, so
retrieval sees what "its" refers to. :func:`standalone_messages` is the request that has the
generator write the follow-up as a question that stands alone instead (what LlamaIndex's
``condense_plus_context`` and LangChain's history-aware retriever do), and
:func:`standalone_query` reads its answer back, or refuses it. The generator still gets the
question verbatim (with the conversation as history, see :mod:`ragbudget.chat`); only the index
sees the expansion or the rewrite. Pure functions of their text: no tokenizer, no model.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["expand_query", "is_follow_up", "standalone_messages", "standalone_query"]

_WORD = re.compile(r"[\w][\w'-]*")
# Words that point back at something said before; a question using them, or a very short one, is
# treated as a follow-up. Deliberately small: a false positive only adds a few related terms to
# the retrieval query, a false negative retrieves for the bare question.
_ANAPHORA = frozenset(
    [
        "it",
        "its",
        "it's",
        "this",
        "that",
        "these",
        "those",
        "they",
        "them",
        "their",
        "theirs",
        "he",
        "him",
        "his",
        "she",
        "her",
        "hers",
        "there",
        "former",
        "latter",
        "same",
        "above",
        "previous",
        "earlier",
        "one",
        "ones",
    ]
)
_FOLLOW_UP_OPENERS = ("what about", "how about", "and", "also", "what else", "anything else", "same for")
_STOPWORDS = frozenset(
    [
        "a",
        "about",
        "above",
        "after",
        "again",
        "against",
        "all",
        "am",
        "an",
        "and",
        "any",
        "are",
        "as",
        "at",
        "be",
        "because",
        "been",
        "before",
        "being",
        "below",
        "between",
        "both",
        "but",
        "by",
        "can",
        "could",
        "did",
        "do",
        "does",
        "doing",
        "down",
        "during",
        "each",
        "few",
        "for",
        "from",
        "further",
        "had",
        "has",
        "have",
        "having",
        "here",
        "how",
        "i",
        "if",
        "in",
        "into",
        "is",
        "just",
        "me",
        "more",
        "most",
        "my",
        "no",
        "nor",
        "not",
        "now",
        "of",
        "off",
        "on",
        "once",
        "only",
        "or",
        "other",
        "our",
        "out",
        "over",
        "own",
        "same",
        "should",
        "so",
        "some",
        "such",
        "than",
        "that",
        "the",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "through",
        "to",
        "too",
        "under",
        "until",
        "up",
        "very",
        "was",
        "we",
        "were",
        "what",
        "when",
        "where",
        "which",
        "while",
        "who",
        "whom",
        "why",
        "will",
        "with",
        "would",
        "you",
        "your",
        "yours",
        "it",
        "its",
        "it's",
        "their",
        "them",
        "he",
        "she",
        "his",
        "her",
        "please",
        "tell",
        "explain",
        "describe",
        "give",
        "show",
        "know",
        "say",
        "said",
        "also",
        "else",
        "anything",
        "something",
        "thing",
        "things",
        "get",
        "got",
    ]
)


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def is_follow_up(question: str) -> bool:
    """True when ``question`` leans on earlier turns: it uses a pronoun or demonstrative
    ("its footer"), opens like a continuation ("what about ..."), or has at most three content
    words.

    >>> is_follow_up("what about its footer?"), is_follow_up("How does dedup treat PDF copies of text files?")
    (True, False)
    """
    words = _words(question)
    if not words:
        return False
    lowered = " ".join(words)
    if any(lowered == opener or lowered.startswith(opener + " ") for opener in _FOLLOW_UP_OPENERS):
        return True
    if any(w in _ANAPHORA for w in words):
        return True
    return len([w for w in words if w not in _STOPWORDS]) <= 3


def expand_query(question: str, previous: Sequence[str], *, max_terms: int = 24, standalone: str = "") -> str:
    """The retrieval query for ``question``: itself when it stands alone, else itself followed by
    the salient terms (content words, first occurrence order, newest question first) of the
    ``previous`` retrieval queries that it does not already contain. With ``standalone`` (the
    model's rewrite of the follow-up, :func:`standalone_query`), that question followed by the
    terms neither holds: the rewrite names what "it" is, the terms keep the topic where the model
    only repeated the question or dropped a word the passage has.

    >>> expand_query("what about its footer?", ["How are page headers stripped from PDFs?"])
    'what about its footer? page headers stripped pdfs'
    >>> expand_query("what about its footer?", ["How are page headers stripped from PDFs?"],
    ...              standalone="How are page footers stripped from PDFs?")
    'How are page footers stripped from PDFs? headers'
    """
    if standalone:
        question, seen = standalone, set(_words(standalone)) | set(_words(question))
    elif not previous or not is_follow_up(question):
        return question
    else:
        seen = set(_words(question))
    terms: list[str] = []
    for prev in reversed(previous):  # newest first: the most likely referent
        for w in _words(prev):
            if w in _STOPWORDS or w in seen or len(w) < 2:
                continue
            seen.add(w)
            terms.append(w)
            if len(terms) >= max_terms:
                break
        if len(terms) >= max_terms:
            break
    return f"{question} {' '.join(terms)}" if terms else question


# Written after the peers' own prompts (LlamaIndex's condense prompt, LangChain's
# contextualize-question prompt): name what the pronouns point at, never answer.
_STANDALONE_SYSTEM = (
    "You rewrite the user's latest question so that it can be understood without the conversation: "
    "replace pronouns and vague references (it, they, he, she, that, there, the first one) with the "
    "names and things they refer to in the conversation. Do not answer the question. If it already "
    "stands alone, repeat it. Reply with the rewritten question only, on one line."
)
_LABEL = re.compile(r"^\s*(?:standalone|rewritten|reformulated|new)?\s*question\s*:\s*", re.IGNORECASE)
# A line of the transcript copied back ("User: ...", "The user asked: ..."), not a rewrite.
_TRANSCRIPT = re.compile(r"^\s*(?:user|assistant|the user(?:\s+asked)?)\s*:", re.IGNORECASE)


def standalone_messages(lines: Sequence[str], question: str, *, summary: str = "") -> list[dict[str, str]]:
    """The chat messages asking the generator to rewrite ``question`` as a standalone question,
    given the conversation before it as ``lines`` ("User: ...", "Assistant: ...", oldest first)
    after the ``summary`` of older turns, if there is one.

    >>> system, user = standalone_messages(["User: Who wrote Emma?", "Assistant: Jane Austen."], "When was she born?")
    >>> print(user["content"])
    Conversation:
    User: Who wrote Emma?
    Assistant: Jane Austen.
    <BLANKLINE>
    Latest question: When was she born?
    <BLANKLINE>
    Standalone question:
    """
    head = [f"Summary of the earlier conversation: {summary}"] if summary else []
    user = "Conversation:\n" + "\n".join([*head, *lines]) + f"\n\nLatest question: {question}\n\nStandalone question:"
    return [{"role": "system", "content": _STANDALONE_SYSTEM}, {"role": "user", "content": user}]


def standalone_query(text: str, question: str, earlier: Sequence[str] = ()) -> str:
    """The standalone question the generator wrote (``text``) for ``question``, or ``""`` when it
    is not one: empty, far longer than a question, a statement where a question was asked (the
    model answered or explained instead), a line of the transcript copied back, or one of the
    ``earlier`` questions of the conversation repeated (small models often write the previous
    question instead of this one). The caller then falls back to :func:`expand_query`.

    >>> standalone_query('Standalone question: "When was Jane Austen born?"', "When was she born?")
    'When was Jane Austen born?'
    >>> standalone_query("Jane Austen was born in 1775.", "When was she born?")
    ''
    >>> standalone_query("Who wrote Emma?", "When was she born?", earlier=["Who wrote Emma?"])
    ''
    """
    line = next((ln for ln in text.strip().splitlines() if ln.strip()), "")
    if _TRANSCRIPT.match(line):
        return ""
    for _ in range(2):  # a label inside markup ("**Rewritten question:** ..."), then quotes around the question
        line = _LABEL.sub("", line.strip().strip("\"'`*").strip())
    if not line:
        return ""
    words, asked = _words(line), _words(question)
    # A standalone question names a few more things than the follow-up: twenty words past it is
    # an answer or an explanation; so is a statement written for a question asked with a "?".
    if len(words) > len(asked) + 20:
        return ""
    if question.rstrip().endswith("?") and "?" not in line:
        return ""
    if words != asked and any(words == _words(e) for e in earlier):
        return ""
    return line
