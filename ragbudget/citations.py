"""Citations that hold: each ``[n]`` in an answer points at a passage that says what the answer
says (issue #43 §4).

Small instruct models asked to cite answer worse: on squad-tune, Qwen2.5-0.5B told to "cite the
sources by their number" answered a bare ``[1]`` to a quarter of the questions, copied a source's
label and text as its answer, and cited passages without the answer in them; asked only to answer,
it answered (bench/answers.py; the numbers are in BENCHMARKS.md). So the model is asked to answer,
and the citations are checked and placed here, after generation, from what the answer and the
passages share:

* the answer's *claim words* are its content words (stemmed, stop words out) that the question
  does not already hold — what the answer adds; ``support(passage)`` is the share of them the
  passage holds (all of the answer's content words when it adds none);
* a marker the model wrote (``[n]``) is kept when passage ``n`` supports the answer at least
  :data:`MIN_SUPPORT`, and dropped otherwise (a number past the sources, or a passage that does
  not hold the claim);
* an answer left with no marker is cited with the passage that supports it best, when one
  reaches :data:`MIN_SUPPORT`: the marker goes at the end of the answer, so that a streamed answer
  gets it as one last piece. An answer no passage supports ("I do not know") is cited with none.

>>> c = attribute("It was the Lombardi Trophy.", ["Super Bowl 50 was played in Santa Clara.",
...               "The winner receives the Vince Lombardi Trophy."], question="Which trophy is given?")
>>> c.text, c.cited
('It was the Lombardi Trophy. [2]', (2,))
>>> attribute("Paris [3].", ["Paris is in France."]).text   # [3] is no source: dropped, [1] cited
'Paris. [1]'
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MIN_SUPPORT", "Citations", "attribute"]

#: The share of an answer's claim words a passage must hold to be cited for it.
MIN_SUPPORT = 0.5
_MARKER = re.compile(r"\s*\[(\d{1,3})\]")


@dataclass(frozen=True, kw_only=True)
class Citations:
    """The answer with its citations checked and placed (``text``), the source numbers it cites
    (``cited``, 1-based, as ``Answer.sources``), the markers the model wrote that were dropped
    (``dropped``: ``(n, support)``), what was appended to the model's text (``added``: the piece a
    stream still needs) and each source's support (``support[i]`` for source ``i + 1``)."""

    text: str
    cited: tuple[int, ...]
    dropped: tuple[tuple[int, float], ...]
    added: str
    support: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "cited": list(self.cited),
            "dropped": [{"source": n, "support": round(s, 3)} for n, s in self.dropped],
            "added": self.added,
            "support": [round(s, 3) for s in self.support],
            "min_support": MIN_SUPPORT,
        }


def attribute(text: str, passages: Sequence[str], *, question: str = "", place: bool = True) -> Citations:
    """Check the ``[n]`` markers of ``text`` against ``passages`` (source ``n`` is
    ``passages[n - 1]``) and cite the best-supporting passage where none holds (module docstring).

    ``place=False`` appends nothing: a caller that passed stop strings decides where the text
    ends (an OpenAI client expects the text cut right before its stop, with nothing after it)."""
    from .packing.spans import content_terms

    claim = [w for w in content_terms(_MARKER.sub(" ", text))]
    asked = set(content_terms(question))
    words = [w for w in claim if w not in asked] or claim
    support = tuple(_share(words, set(content_terms(p))) for p in passages)
    written = [int(m.group(1)) for m in _MARKER.finditer(text)]
    kept = tuple(dict.fromkeys(n for n in written if 1 <= n <= len(passages) and support[n - 1] >= MIN_SUPPORT))
    dropped = tuple(
        (n, support[n - 1] if 1 <= n <= len(passages) else 0.0) for n in dict.fromkeys(written) if n not in kept
    )
    if dropped:  # the markers that do not hold go; the ones that do stay where the model put them
        bad = {n for n, _ in dropped}
        text = _MARKER.sub(lambda m: "" if int(m.group(1)) in bad else m.group(0), text)
    added = ""
    if place and not kept and support and max(support) >= MIN_SUPPORT:
        best = max(range(len(support)), key=lambda i: support[i]) + 1
        kept, added = (best,), f" [{best}]"
        text = text.rstrip() + added
    return Citations(text=text, cited=kept, dropped=dropped, added=added, support=support)


def _share(words: Sequence[str], passage: set[str]) -> float:
    return sum(1 for w in words if w in passage) / len(words) if words else 0.0
