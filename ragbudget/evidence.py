"""Whether the documents hold an answer at all: the evidence a question found, and the floor under
which ``ask`` says "not in the documents" without calling the model (no prefill, no KV).

**The evidence** is the best cosine between the question and one sentence of the top
:data:`TOP_HITS` retrieved chunks (the sentence vectors span packing scores with, so in the
default ``pack="spans"`` it costs nothing more). A chunk's cosine is a poor test: a 400-token
chunk that holds the answer in one sentence scores like one that does not, because the rest of
its text dilutes its vector; the one sentence that answers scores high.

**The floor** is a cosine, so it belongs to one embedder's geometry: it is set where it was
measured (:data:`CALIBRATED_FLOORS`, by ``bench/abstain.py`` on the squad-tune split: the highest
floor that wrongly declined at most 2% of answerable questions; reported on squad-test and
SQuADShifts Amazon in BENCHMARKS.md) and off for an embedder no one measured, unless
``evidence_floor`` sets one. ``evidence_floor=0`` turns it off.

>>> e = Evidence(score=0.31, floor=0.45, source="calibrated")
>>> e.declined, e.to_dict()["declined"]
(True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .packing.spans import SpanScorer
    from .types import Hit

__all__ = ["CALIBRATED_FLOORS", "DECLINED_TEXT", "TOP_HITS", "Evidence", "evidence_floor", "measure_evidence"]

#: Chunks whose sentences are compared with the question.
TOP_HITS = 5
#: The floor per embedder (its id, without the ``+int8``-style backend suffix): the best sentence
#: cosine under which a question is declined. all-MiniLM-L6-v2: ``bench/abstain.py`` on
#: squad-tune, 150 answerable and 150 unanswerable questions (bench/results/abstain.json).
CALIBRATED_FLOORS: dict[str, float] = {"all-MiniLM-L6-v2": 0.45}
#: What a declined question is answered.
DECLINED_TEXT = "The documents do not contain an answer to this question."


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """What a question found: ``score`` (the best sentence cosine, see the module docstring),
    ``floor`` (``None``: no floor applies) and where the floor came from (``source``)."""

    score: float
    floor: float | None
    source: str

    @property
    def declined(self) -> bool:
        """Whether the question is declined: its evidence is under the floor."""
        return self.floor is not None and self.score < self.floor

    def to_dict(self) -> dict[str, Any]:
        return {
            "score": round(self.score, 4),
            "floor": self.floor,
            "floor_source": self.source,
            "declined": self.declined,
        }


def evidence_floor(setting: float | None, embedder_id: str) -> tuple[float | None, str]:
    """The floor that applies, and why: ``setting`` when given (0: off), else the one measured
    for ``embedder_id``, else none.

    >>> evidence_floor(None, "all-MiniLM-L6-v2+int8")[0], evidence_floor(None, "hash-64")[0]
    (0.45, None)
    >>> evidence_floor(0.0, "all-MiniLM-L6-v2")
    (None, 'evidence_floor=0: off')
    """
    if setting is not None:
        return (setting, f"evidence_floor={setting:g}") if setting > 0 else (None, "evidence_floor=0: off")
    base = embedder_id.split("+", 1)[0]
    floor = CALIBRATED_FLOORS.get(base)
    if floor is None:
        return None, f"off: no floor measured for the embedder {embedder_id!r} (set evidence_floor to use one)"
    return floor, f"measured for {base} (bench/abstain.py, squad-tune)"


def measure_evidence(question: str, hits: Sequence[Hit], scorer: SpanScorer) -> float:
    """The best cosine between ``question`` and a sentence of the top :data:`TOP_HITS` hits (0.0
    when nothing was retrieved)."""
    from .packing.sentences import sentence_texts

    sentences = [s for h in hits[:TOP_HITS] for s in sentence_texts(h.text)]
    if not sentences:
        return 0.0
    return max(scorer.similarities(question, sentences))
