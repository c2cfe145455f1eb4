"""The QA-under-a-budget harness shared by ``bench/qa.py`` (and the span-packing work that follows it).

What it fixes, so that every system is measured on the same ground:

* **Splits** (:func:`load_split`). ``squad-tune`` and ``squad-test`` are disjoint sets of SQuAD v1.1
  dev articles: the seeded permutation of the 48 articles that ``bench/floor.py`` uses, ``tune``
  taking its head and ``test`` its tail (so floor.py's 6-article splits are subsets of these).
  ``amazon`` (SQuADShifts Amazon product reviews, one document per product) and ``coqa`` (CoQA
  stories, the first turn of each conversation: the one question that stands on its own) are
  report-only: nothing is ever chosen on them.
* **One multi-document index per split** (:class:`Corpus`): every document of the split chunked with
  the library's ``chunk_text`` (300–500 tokens by default), embedded once with the packaged MiniLM
  (vectors cached under ``bench/out/``), BM25 from the index's own FTS5 layout and query path.
* **One hybrid-ranked candidate list per question** (:meth:`Corpus.candidates`), built as
  ``Index.search(hybrid=True)`` builds it (top ``fetch_k`` dense and BM25 candidates, lexical-only
  ones given their real cosine, :func:`ragbudget.retrieval.lexical.fuse_scores`), and handed to *every* system,
  so that a difference between systems is packing, not retrieval.
* **Systems** (:func:`pack`): ``topk_truncate`` (the top 4 as labeled blocks, the whole cut to the
  budget: LangChain's default retriever then a cut), ``greedy_fill`` (blocks in rank order until
  the budget, the last one cut to fill it exactly) and ``ragbudget`` (``build_prompt``: the
  library's selection with its defaults, options overridable for sweeps). All are charged the
  same labeled-block costs in the generator's tokens.
* **Scores** (:func:`score`): answer-in-context (a gold answer, SQuAD-normalized, inside a selected
  passage *of the question's own document*: an answer string that happens to occur in another
  document does not count), the share of the allowance filled, and what was left out although it
  would have fit whole in the unused room (any retrieved candidate; one holding the answer).
  :func:`exact_match` / :func:`f1_score` are the official SQuAD ones; :func:`bootstrap_ci` gives
  a percentile 95% interval over questions.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import re
import sqlite3
import string
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from ragbudget.fitting import build_prompt  # noqa: E402
from ragbudget.input.chunking import chunk_text  # noqa: E402
from ragbudget.packing.select import Candidate, SelectedChunk, Selection  # noqa: E402
from ragbudget.pipeline import DEFAULT_RELEVANCE_FLOOR  # noqa: E402
from ragbudget.prompt.prompt import DEFAULT_SYSTEM_PROMPT, PromptBuilder  # noqa: E402
from ragbudget.retrieval.lexical import FTS_TOKENIZE, bm25, fuse_scores  # noqa: E402
from ragbudget.types import Source  # noqa: E402

DATA = Path(os.environ.get("RAGBUDGET_SHARED_DATA", ROOT.parent / "shared" / "data"))
SQUAD = DATA / "squad" / "squaddev_v1.1.json"
AMAZON = DATA / "squadshifts" / "amazon_reviews_v1.0.json"
COQA = DATA / "coqa" / "coqa.test.json"
OUT = ROOT / "bench" / "out"
SPLITS = ("squad-tune", "squad-test", "amazon", "coqa")
REPORT_SPLITS = ("squad-test", "amazon", "coqa")
BUDGETS = (128, 256, 512, 1024, 2048)
SYSTEMS = ("topk_truncate", "greedy_fill", "ragbudget")
#: Packers ``Packer.pack`` runs: the systems above and span packing (bench/spans_qa.py).
PACKERS = (*SYSTEMS, "ragbudget_spans")
#: The library's retrieval defaults (``Pipeline``/``Index.search``), stated once for the harness.
DEFAULT_RETRIEVAL = {"fusion": "score", "lexical_weight": 0.5, "fetch_k": 50}
QA_SYSTEM = DEFAULT_SYSTEM_PROMPT + " Reply with only the answer, a short phrase copied from the sources."


# -- official SQuAD v1.1 evaluation ---------------------------------------------------------------
def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: str, truth: str) -> float:
    p, t = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = collections.Counter(p) & collections.Counter(t)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(t)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def contains_answer(context: str, answers: Sequence[str]) -> bool:
    ctx = " " + normalize_answer(context) + " "
    return any(" " + normalize_answer(a) + " " in ctx for a in answers if normalize_answer(a))


def bootstrap_ci(values: Sequence[float], *, rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile 95% interval of the mean of ``values`` (questions resampled with replacement);
    pass per-question differences to get the interval of a paired difference."""
    v = np.asarray(values, dtype=float)
    if len(v) == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(rounds, len(v)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def mean_cell(cell: dict[str, Any], key: str, values: Sequence[float], *, ci_key: str | None = None) -> None:
    """``cell[key]``: the mean of ``values`` (``None`` when there are none); ``cell[ci_key]``
    (default ``key + "_ci95"``): its :func:`bootstrap_ci` — one summary cell of a per-question table."""
    cell[key] = float(np.mean(values)) if len(values) else None
    cell[ci_key or f"{key}_ci95"] = bootstrap_ci(values)


# -- data -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Question:
    qid: str
    text: str
    answers: tuple[str, ...]
    doc: int  # index into Split.docs


@dataclass(frozen=True)
class Split:
    name: str
    titles: tuple[str, ...]
    texts: tuple[str, ...]
    questions: tuple[Question, ...]
    note: str = ""


def _squad_docs(path: Path) -> list[tuple[str, str, list[tuple[str, str, tuple[str, ...]]]]]:
    data = json.loads(path.read_text(encoding="utf-8"))["data"]
    return [
        (
            a["title"],
            "\n\n".join(p["context"] for p in a["paragraphs"]),
            [
                (q["id"], q["question"], tuple(x["text"] for x in q["answers"]))
                for p in a["paragraphs"]
                for q in p["qas"]
            ],
        )
        for a in data
    ]


def _coqa_docs() -> list[tuple[str, str, list[tuple[str, str, tuple[str, ...]]]]]:
    """Each story with its first question. Gold answers: the free-form answers (main and
    additional) that occur in the story, else the rationale spans; yes/no/unknown answers are
    dropped (a "yes" occurs in any context, so its presence says nothing)."""
    out = []
    for item in json.loads(COQA.read_text(encoding="utf-8"))["data"]:
        story = item["story"]
        firsts = [a for a in item["answers"] if a["turn_id"] == 1]
        for extra in item.get("additional_answers", {}).values():
            firsts += [a for a in extra if a["turn_id"] == 1]
        norm_story = " " + normalize_answer(story) + " "
        free = [
            a["input_text"] for a in firsts if normalize_answer(a["input_text"]) not in ("", "yes", "no", "unknown")
        ]
        answers = [a for a in free if " " + normalize_answer(a) + " " in norm_story]
        if free and not answers:
            answers = [a["span_text"] for a in firsts if normalize_answer(a["span_text"])]
        q = next(q["input_text"] for q in item["questions"] if q["turn_id"] == 1)
        qs = [(f"{item['id']}:1", q, tuple(dict.fromkeys(answers)))] if answers else []
        out.append((f"{item['source']}_{item['id'][:8]}", story, qs))
    return out


def load_split(name: str, *, docs: int, seed: int = 0) -> Split:
    """The documents and questions of split ``name`` (see the module docstring); ``docs`` caps
    the documents (SQuAD: at most 24 per split, so that tune and test never meet)."""
    if name not in SPLITS:
        raise SystemExit(f"unknown split {name!r}; one of {', '.join(SPLITS)}")
    if name.startswith("squad"):
        if docs > 24:
            raise SystemExit(
                f"--docs {docs}: SQuAD dev has 48 articles, so at most 24 per split "
                "keeps squad-tune and squad-test disjoint"
            )
        data = _squad_docs(SQUAD)
    else:
        data = _squad_docs(AMAZON) if name == "amazon" else _coqa_docs()
    order = list(range(len(data)))
    # The permutation bench/floor.py draws (same seed, same list): its 6-article tune/test splits
    # are the first/last 6 of this order, so they sit inside these.
    random.Random(seed).shuffle(order)
    picked = sorted(order[-docs:] if name == "squad-test" else order[:docs])
    titles, texts, questions = [], [], []
    for d, i in enumerate(picked):
        title, text, qs = data[i]
        titles.append(title)
        texts.append(text)
        questions += [Question(qid, q, ans, d) for qid, q, ans in qs]
    note = {"coqa": "first turn of each conversation; yes/no/unknown answers dropped"}.get(name, "")
    return Split(name, tuple(titles), tuple(texts), tuple(questions), note)


def sample_questions(split: Split, n: int, seed: int = 0) -> list[Question]:
    """A seeded random sample of ``n`` questions (all when ``n`` is 0 or larger than the split)."""
    qs = list(split.questions)
    random.Random(seed).shuffle(qs)
    return qs[:n] if n else qs


# -- the index -------------------------------------------------------------------------------------
def _embedder() -> Any:
    from sentence_transformers import SentenceTransformer

    from ragbudget.memory.models import resolve_embedder

    return SentenceTransformer(resolve_embedder(), device="cpu")


def embed_cached(texts: Sequence[str], tag: str, model: Any = None) -> np.ndarray:
    """Unit vectors of ``texts`` (packaged MiniLM), cached in ``bench/out/`` by a digest of them."""
    key = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:16]
    path = OUT / f"qa_{tag}_{key}.npy"
    if path.is_file():
        arr = np.load(path)
        if arr.shape[0] == len(texts):
            return arr
    OUT.mkdir(parents=True, exist_ok=True)
    model = model or _embedder()
    arr = model.encode(list(texts), batch_size=32, normalize_embeddings=True, show_progress_bar=False)
    np.save(path, arr)
    return arr


@dataclass
class Corpus:
    """All documents of a split in one index: chunks, their vectors and an FTS5 table."""

    split: Split
    texts: list[str]
    docs: list[int]  # document of each chunk
    sources: list[Source]
    vecs: np.ndarray
    db: sqlite3.Connection
    qvecs: dict[str, np.ndarray] = field(default_factory=dict)
    model: Any = None  # the embedder the chunks were embedded with

    @classmethod
    def build(
        cls, split: Split, questions: Sequence[Question], *, chunk_min: int = 300, chunk_max: int = 500
    ) -> Corpus:
        texts, docs, sources = [], [], []
        for d, (title, text) in enumerate(zip(split.titles, split.texts, strict=True)):
            for c in chunk_text(text, min_tokens=chunk_min, max_tokens=chunk_max):
                texts.append(c.text)
                docs.append(d)
                sources.append(Source(f"{title}.txt", c.start, c.end))
        model = _embedder()
        vecs = embed_cached(texts, "chunks", model)
        qv = embed_cached([q.text for q in questions], "questions", model)
        db = sqlite3.connect(":memory:")
        db.execute(f"CREATE VIRTUAL TABLE chunks_fts USING fts5(text, tokenize='{FTS_TOKENIZE}')")
        db.executemany("INSERT INTO chunks_fts(rowid, text) VALUES (?, ?)", list(enumerate(texts)))
        return cls(split, texts, docs, sources, vecs, db, {q.qid: qv[i] for i, q in enumerate(questions)}, model)

    def sentence_embedder(self, *, cached: bool = True) -> IndexEmbedder:
        """The index's embedder for :class:`ragbudget.packing.spans.SpanScorer`. ``cached``: the vectors
        of every sentence of every chunk (as ``split_sentences`` cuts them) and of the questions
        come from ``bench/out/`` (computed once per split), so sweeps do not re-embed; ``False``:
        every text goes to the model, for timing what span packing costs the first time."""
        if not cached:
            return IndexEmbedder(self.model)
        from ragbudget.packing.spans import split_sentences

        sents = sorted({t[a:b] for t in self.texts for a, b, _ in split_sentences(t)})
        vecs = embed_cached(sents, "sentences", self.model)
        known = dict(zip(sents, vecs, strict=True))
        by_qid = {q.qid: q.text for q in self.split.questions}
        known.update({by_qid[qid]: v for qid, v in self.qvecs.items()})
        return IndexEmbedder(self.model, known)

    def candidates(
        self, q: Question, *, fusion: str = "score", lexical_weight: float = 0.5, fetch_k: int = 50, hybrid: bool = True
    ) -> list[Candidate]:
        """The ranked candidate list, as ``Index.search(q, fetch_k, hybrid=...)`` returns it."""
        scores = self.vecs @ self.qvecs[q.qid]
        order = np.argsort(-scores, kind="stable")[:fetch_k]
        dense = {int(j): float(scores[j]) for j in order}
        lexical = dict(bm25(self.db, q.text, fetch_k)) if hybrid and lexical_weight > 0 else {}
        if lexical:
            dense.update({j: float(scores[j]) for j in lexical if j not in dense})
            ranked = fuse_scores(dense, lexical, method=fusion, lexical_weight=lexical_weight)[:fetch_k]
        else:
            ranked = [(int(j), float(scores[j])) for j in order]
        return [Candidate(j, self.texts[j], s, sources=(self.sources[j],)) for j, s in ranked]


class IndexEmbedder:
    """The split index's sentence-transformers model behind the two methods of ragbudget's
    ``Embedder`` that :class:`~ragbudget.packing.spans.SpanScorer` calls (unit vectors, documents and
    queries alike: MiniLM has no query prefix); texts in ``known`` are not re-embedded."""

    def __init__(self, model: Any, known: dict[str, np.ndarray] | None = None) -> None:
        self.model = model
        self.known = known or {}
        self.embedded = 0  # texts that went to the model

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        todo = [t for t in dict.fromkeys(texts) if t not in self.known]
        if todo:
            vecs = self.model.encode(todo, batch_size=32, normalize_embeddings=True, show_progress_bar=False)
            self.embedded += len(todo)
            fresh = dict(zip(todo, vecs, strict=True))
        else:
            fresh = {}
        return np.stack([self.known[t] if t in self.known else fresh[t] for t in texts])

    def embed_query(self, text: str) -> np.ndarray:
        return self.embed_documents([text])[0]


# -- systems ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Packed:
    """What one system put in the context for one question at one budget."""

    passages: tuple[tuple[int, str], ...]  # (chunk id, text), cut text where a system cut
    used: int  # tokens charged (texts + labels), ≤ allowed
    allowed: int
    left_fit: tuple[int, ...]  # candidates not used that would have fit whole in allowed - used
    prompt: Any = None  # the ragbudget Prompt (for generation), else None


class Packer:
    """Runs the systems for one generator tokenizer and system prompt."""

    def __init__(self, tokenizer: Any, *, system_prompt: str = QA_SYSTEM, span_scorer: Any = None) -> None:
        self.tok = tokenizer
        self.builder = PromptBuilder(tokenizer, system_prompt=system_prompt)
        self.span_scorer = span_scorer  # a ragbudget.packing.spans.SpanScorer, for ragbudget_spans

    def cost(self, c: Any, max_id: int) -> int:
        return self.builder.count(c.text) + self.builder.overhead(c, max_id=max_id)

    def _cut(self, text: str, n: int) -> str:
        ids = self.tok.encode(text, add_special_tokens=False)
        return self.tok.decode(ids[:n]) if n > 0 else ""

    def _fill(self, pool: Sequence[Candidate], budget: int, max_id: int) -> Packed:
        """Blocks in rank order until ``budget``; the first that does not fit is cut to fill it."""
        room, parts, used_ids = budget, [], set()
        for c in pool:
            cost = self.cost(c, max_id)
            if cost <= room:
                parts.append((c.chunk_id, c.text))
                used_ids.add(c.chunk_id)
                room -= cost
                continue
            over = self.builder.overhead(c, max_id=max_id)
            if room - over > 0:
                cut = self._cut(c.text, room - over)
                # BPE can merge differently after the cut: shave until it fits the room.
                while cut and self.builder.count(cut) + over > room:
                    cut = self._cut(cut, self.builder.count(cut) - 1)
                if cut:
                    parts.append((c.chunk_id, cut))
                    used_ids.add(c.chunk_id)
                    room -= self.builder.count(cut) + over
            break
        return Packed(tuple(parts), budget - room, budget, ())

    def pack(
        self,
        system: str,
        question: str,
        cands: Sequence[Candidate],
        budget: int,
        *,
        top_k: int = 4,
        **select_options: Any,
    ) -> Packed:
        """Run ``system`` (``topk_truncate``, ``greedy_fill``, ``ragbudget`` or
        ``ragbudget_spans``) at ``budget`` context tokens; ``select_options`` override ragbudget's
        selection defaults (``select_chunks``'s, or ``select_spans``'s for span packing)."""
        max_id = max(9, len(cands))
        if system in ("greedy_fill", "topk_truncate"):
            p = self._fill(cands[:top_k] if system == "topk_truncate" else cands, budget, max_id)
        elif system in ("ragbudget", "ragbudget_spans"):
            if system == "ragbudget":
                # The committed figures are with fill_remainder on (an option, off in the library
                # until answers are measured with it); --ablate's ragbudget_no_fill row is the default.
                opts = {"relevance_floor": DEFAULT_RELEVANCE_FLOOR, "fill_remainder": True, **select_options}
            else:
                # Span packing as Pipeline(pack="spans") runs it: one SpanScorer for the whole
                # split (sentence vectors shared across questions and budgets), library defaults
                # unless a sweep overrides them.
                if self.span_scorer is None:
                    raise SystemExit("ragbudget_spans needs Packer(span_scorer=SpanScorer(...))")
                opts = {
                    "relevance_floor": DEFAULT_RELEVANCE_FLOOR,
                    "pack": "spans",
                    "span_scorer": self.span_scorer,
                    **select_options,
                }
            fixed = self.builder.fixed_tokens(question)
            prompt = build_prompt(
                question, cands, tokenizer=self.tok, max_prompt_tokens=fixed + budget, builder=self.builder, **opts
            )
            sel = prompt.selection
            # A merged passage holds several chunks; it is listed under its first chunk's id
            # (same document: merging only joins neighbours in one file).
            parts = tuple((c.chunk_ids[0], c.text) for c in sel.chunks)
            used_ids = {cid for c in sel.chunks for cid in c.chunk_ids}
            left = self._left_fit(cands, used_ids, budget - sel.tokens_used, max_id)
            return Packed(parts, sel.tokens_used, budget, left, prompt)
        else:
            raise SystemExit(f"unknown system {system!r}; one of {', '.join(PACKERS)}")
        used_ids = {cid for cid, _ in p.passages}
        return Packed(p.passages, p.used, budget, self._left_fit(cands, used_ids, budget - p.used, max_id))

    def _left_fit(self, cands: Sequence[Candidate], used: set, room: int, max_id: int) -> tuple[int, ...]:
        return tuple(c.chunk_id for c in cands if c.chunk_id not in used and self.cost(c, max_id) <= room)

    def prompt_of(self, question: str, packed: Packed, cands: Sequence[Candidate]) -> Any:
        """A rendered prompt for any system's context (the same layout ragbudget's prompt has)."""
        if packed.prompt is not None:
            return packed.prompt
        by_id = {c.chunk_id: c for c in cands}
        chunks = tuple(
            SelectedChunk(
                chunk_ids=(cid,),
                text=text,
                score=by_id[cid].score,
                n_tokens=self.builder.count(text),
                cost=0,
                sources=by_id[cid].sources,
            )
            for cid, text in packed.passages
        )
        sel = Selection(chunks=chunks, tokens_used=packed.used, tokens_allowed=packed.allowed)
        fixed = self.builder.fixed_tokens(question)
        # Numbering is by position here, as in ragbudget's prompt; allow the label slack (max_id).
        return self.builder.render(question, sel, max_prompt_tokens=fixed + packed.allowed + 8, fixed_tokens=fixed)


def score(corpus: Corpus, q: Question, packed: Packed) -> dict[str, float]:
    """Answer in a passage of the question's own document; fill; left-out-that-fits figures."""
    own = [t for cid, t in packed.passages if corpus.docs[cid] == q.doc]
    hit = contains_answer("\n\n".join(own), q.answers)
    lost = any(corpus.docs[c] == q.doc and contains_answer(corpus.texts[c], q.answers) for c in packed.left_fit)
    return {
        "recall": float(hit),
        "fill": packed.used / packed.allowed if packed.allowed else 1.0,
        "left_fit": float(bool(packed.left_fit)),
        "answer_left_fit": float(lost and not hit),
    }


def answerable(corpus: Corpus, q: Question) -> bool:
    """Whether a gold answer occurs in some chunk of the question's document at all."""
    return any(corpus.docs[j] == q.doc and contains_answer(t, q.answers) for j, t in enumerate(corpus.texts))


def mean(rows: Sequence[dict[str, float]], key: str) -> float:
    return float(np.mean([r[key] for r in rows])) if rows else float("nan")


def run_grid(
    corpus: Corpus,
    packer: Packer,
    questions: Sequence[Question],
    configs: dict[str, dict],
    budgets: Sequence[int] = BUDGETS,
    progress: Callable[[int], None] | None = None,
) -> dict[str, dict[int, list[dict[str, float]]]]:
    """Score every config on every question and budget. A config is ``{"system": ...,
    "retrieval": {fusion, lexical_weight, fetch_k, hybrid}, "select": {...}}``; candidate lists
    are computed once per distinct retrieval setting and shared by the configs that use it; a
    config's own ``"budgets"`` replace ``budgets`` for it."""
    out: dict[str, dict[int, list[dict[str, float]]]] = {
        k: {b: [] for b in cfg.get("budgets", budgets)} for k, cfg in configs.items()
    }
    for qi, q in enumerate(questions):
        lists: dict[str, list[Candidate]] = {}
        for name, cfg in configs.items():
            r = {**DEFAULT_RETRIEVAL, "hybrid": True, **cfg.get("retrieval", {})}
            key = json.dumps(r, sort_keys=True)
            if key not in lists:
                lists[key] = corpus.candidates(q, **r)
            cands = lists[key]
            for b in cfg.get("budgets", budgets):
                p = packer.pack(cfg["system"], q.text, cands, b, **cfg.get("select", {}))
                out[name][b].append(score(corpus, q, p))
        if progress:
            progress(qi + 1)
    return out


def grid_tables(grid: dict[str, dict[int, list[dict[str, Any]]]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """From :func:`run_grid`'s rows: per system and budget the mean recall, fill, left-fit and
    answer-left-fit in %, and per question the 0/1 recall (for paired bootstrap intervals)."""
    table = {
        name: {
            b: {k: 100 * mean(rows, k) for k in ("recall", "fill", "left_fit", "answer_left_fit")}
            for b, rows in by_b.items()
        }
        for name, by_b in grid.items()
    }
    per_question = {
        name: {b: [int(r["recall"]) for r in rows] for b, rows in by_b.items()} for name, by_b in grid.items()
    }
    return table, per_question
