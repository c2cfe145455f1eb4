"""Which sentence evidence would hold the answer more often at a tight budget? A study of span
packing's *ranking* on the tuning split only (issue #18: recall at 256 tokens).

``select_spans`` ranks a pool's sentences by a weighted mix of dense cosine (the index's MiniLM),
BM25 over the pool's sentences and the chunk's retrieval value, then packs greedily. This script
keeps everything else of ``build_prompt(pack="spans")`` as ``bench/spans_qa.py`` runs it (same
index, candidates, costs, pool, neighbour rule, exact counts and greedy packer) and replaces only
the sentence scores, by patching ``ragbudget.packing.spans._score`` here (the library is not changed), to
measure scoring variants that need no new model:

* fusion: min-max or z-scored dense and lexical, reciprocal-rank fusion;
* the chunk prior: lighter, by rank, or a softer exponential of the chunk's score;
* lexical: Porter stemming (nltk's, study only) instead of the library's crude stemmer;
* dense: the question's keywords embedded instead of the question, sentence vectors averaged
  with their neighbours';
* a logistic regression over 15 per-sentence features (the above and length, position, the
  answer-type cue, question-term coverage), trained on answer-holding sentences at 256 tokens,
  scored by 5-fold cross-validation over questions (a question is never scored by a model that
  saw it): what a learned mix of these signals could reach;
* ``oracle``: a sentence holding a gold answer ranked first, i.e. the ceiling of sentence choice
  inside the pool; ``oracle (library score)`` the same over the library's own scores (no
  features computed, so it is cheap for any ``--select``, e.g. ``pool=12``: the ceiling of
  sentence choice in that pool).

``--select key=value,…`` passes ``select_spans`` options to every variant (as ``spans_qa.py
--extra``); ``--variants a,b`` runs only those (the logistic regression's training, and the
features the misses' diagnosis records, only when needed).

It also records, per question at 256 tokens, the default rank of the best answer-holding sentence
(and its dense and lexical ranks), for the misses.

    python bench/spans_rank.py --docs 12 --questions 150
    python bench/spans_rank.py --docs 12 --questions 150 --select pool=12 \
        --variants "default,oracle (library score)" --out bench/out/spans_rank_pool12.json

(``bench/results/spans_rank_squad_tune_clause.json`` was made with ``--select unit=clause``, the
clause units that BENCHMARKS.md's fourth round did not adopt; that option is gone since issue #32,
so the file reproduces at commit cf2a56c.)

Writes ``bench/results/spans_rank_squad_tune.json`` (squad-tune only: this chooses nothing that
is reported without a held-out run). ``--split squad-test`` or ``amazon`` runs only the default
and the oracles there: the ceiling of sentence choice on a reporting split, which chooses nothing.
"""

from __future__ import annotations

import argparse
import math
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _qa_harness as H  # noqa: E402  (sets the offline environment first)
import numpy as np  # noqa: E402

import ragbudget.packing.spans as S  # noqa: E402

BUDGETS = (128, 256, 512, 1024)
VARIANTS = [
    "default",
    "dense min-max",
    "z-scores",
    "RRF dense+lexical",
    "RRF dense+lexical+chunk",
    "chunk prior 1/(1+rank)",
    "chunk prior exp(Δscore/0.05)",
    "Porter BM25",
    "question keywords embedded",
    "neighbour-averaged vectors",
    "logistic regression (5-fold CV)",
    "oracle",
    "oracle (library score)",
]
_W = re.compile(r"\w+")

# The answer-type cue, one of the logistic regression's features: what a question word asks for,
# as a test on a sentence's text (English question words; a sentence has such a token or not). It
# was a select_spans option (cue_weight) until issue #32 removed it, not adopted (BENCHMARKS.md,
# span packing's second round); it lives on here as a study feature only.
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


def _nm(v: np.ndarray) -> np.ndarray:
    """Over the pool's best (the library's normalization)."""
    return v / v.max() if v.max() > 0 else v * 0


def _minmax(v: np.ndarray) -> np.ndarray:
    r = v.max() - v.min()
    return (v - v.min()) / r if r > 0 else v * 0


def _z(v: np.ndarray) -> np.ndarray:
    s = v.std()
    return (v - v.mean()) / s if s > 0 else v * 0


def _rrf(v: np.ndarray, k: int = 60) -> np.ndarray:
    return 1.0 / (k + np.argsort(np.argsort(-v, kind="stable")))


class Study:
    def __init__(self, corpus: H.Corpus, emb: H.IndexEmbedder) -> None:
        from nltk.stem import PorterStemmer

        self.corpus, self.emb, self.porter = corpus, emb, PorterStemmer()
        self.q: H.Question | None = None  # the question being packed
        self.variant = "default"
        self.models: dict[int, object] = {}  # fold -> fitted model
        self.fold: dict[str, int] = {}
        self.collect: list | None = None  # (features, labels) at the training budget
        self._kw: dict[str, np.ndarray] = {}

    def _porter_bm25(self, question: str, docs: list[str], k1: float = 1.2, b: float = 0.75) -> np.ndarray:
        def terms(t: str) -> list[str]:
            return [
                self.porter.stem(w) for w in _W.findall(t.lower()) if w not in S._STOP and (len(w) > 2 or w.isdigit())
            ]

        q, ts = set(terms(question)), [terms(d) for d in docs]
        n, avg = len(docs), max(1e-9, sum(map(len, ts)) / len(docs))
        idf = {w: math.log(1 + (n - d + 0.5) / (d + 0.5)) for w in q for d in [sum(1 for t in ts if w in t)]}
        return np.array(
            [
                sum(
                    idf[w] * t.count(w) * (k1 + 1) / (t.count(w) + k1 * (1 - b + b * len(t) / avg)) for w in q if w in t
                )
                for t in ts
            ]
        )

    def features(self, question: str, chunks: list, units: list) -> dict[str, np.ndarray]:
        texts = [u.text for u in units]
        vecs = self.emb.embed_documents(texts)
        qv = self.emb.embed_query(question)
        if question not in self._kw:
            self._kw[question] = self.emb.embed_query(
                " ".join(w for w in _W.findall(question) if w.lower() not in S._STOP)
            )
        ctx = vecs.copy()
        for i, u in enumerate(units):
            for j in (i - 1, i + 1):
                if 0 <= j < len(units) and units[j].chunk == u.chunk:
                    ctx[i] += 0.5 * vecs[j]
        ctx /= np.linalg.norm(ctx, axis=1, keepdims=True)
        cue = _answer_cue(question)
        qwords = {w.lower() for w in _W.findall(question)}
        qt = set(S._term_list(question))
        tsets = [set(S._term_list(t)) for t in texts]
        cscore = np.array([chunks[u.chunk].score for u in units])
        return {
            "dense": vecs @ qv,
            "dense_kw": vecs @ self._kw[question],
            "dense_ctx": ctx @ qv,
            "lex": np.array(S.bm25(question, texts)),
            "lex_porter": self._porter_bm25(question, texts),
            "cval": np.array([chunks[u.chunk].value for u in units]),
            "crank": np.array([float(u.chunk) for u in units]),
            "csoft": np.exp((cscore - cscore.max()) / 0.05),
            "ntok": np.array([float(u.n_tokens) for u in units]),
            "pos0": np.array([float(u.pos == 0) for u in units]),
            "needs_prev": np.array([float(S.needs_previous(t)) for t in texts]),
            "cue": np.array([float(cue is not None and cue(t, qwords)) for t in texts]),
            "coverage": np.array([len(qt & t) / max(1, len(qt)) for t in tsets]),
            "novelty": np.array([1 - len(qt & t) / max(1, len(t)) for t in tsets]),
        }

    @staticmethod
    def matrix(f: dict[str, np.ndarray]) -> np.ndarray:
        d = np.maximum(0, f["dense"])
        return np.column_stack(
            [
                _nm(d),
                _z(f["dense"]),
                _nm(f["lex"]),
                _nm(f["lex_porter"]),
                60 * _rrf(f["dense"]),
                60 * _rrf(f["lex"]),
                f["cval"],
                1 / (1 + f["crank"]),
                np.log(f["ntok"]),
                f["cue"],
                f["coverage"],
                f["novelty"],
                _z(f["dense_ctx"]),
                f["pos0"],
                f["needs_prev"],
            ]
        )

    def labels(self, chunks: list, units: list) -> np.ndarray:
        q = self.q
        assert q is not None
        return np.array(
            [self.corpus.docs[chunks[u.chunk].ids[0]] == q.doc and H.contains_answer(u.text, q.answers) for u in units]
        )

    def scores(self, question: str, chunks: list, units: list) -> np.ndarray | None:
        v = self.variant
        if v == "default":
            return None
        if v == "oracle (library score)":
            return np.array([u.score for u in units]) + 10.0 * self.labels(chunks, units)
        f = self.features(question, chunks, units)
        d, dn, ln, c = f["dense"], _nm(np.maximum(0, f["dense"])), _nm(f["lex"]), f["cval"]
        if v == "dense min-max":
            return 0.4 * _minmax(d) + 0.4 * ln + 0.2 * c
        if v == "z-scores":
            return 0.4 * _z(d) + 0.4 * _z(f["lex"]) + 0.2 * c
        if v == "RRF dense+lexical":
            return _rrf(d) + _rrf(f["lex"])
        if v == "RRF dense+lexical+chunk":
            return _rrf(d) + _rrf(f["lex"]) + _rrf(c)
        if v == "chunk prior 1/(1+rank)":
            return 0.4 * dn + 0.4 * ln + 0.2 / (1 + f["crank"])
        if v == "chunk prior exp(Δscore/0.05)":
            return 0.4 * dn + 0.4 * ln + 0.2 * f["csoft"]
        if v == "Porter BM25":
            return 0.4 * dn + 0.4 * _nm(f["lex_porter"]) + 0.2 * c
        if v == "question keywords embedded":
            return 0.4 * _nm(np.maximum(0, f["dense_kw"])) + 0.4 * ln + 0.2 * c
        if v == "neighbour-averaged vectors":
            return 0.4 * _nm(np.maximum(0, f["dense_ctx"])) + 0.4 * ln + 0.2 * c
        if v == "logistic regression (5-fold CV)":
            assert self.q is not None
            m = self.models[self.fold[self.q.qid]]
            return m.predict_proba(self.matrix(f))[:, 1]  # type: ignore[attr-defined]
        if v == "oracle":
            return 0.4 * dn + 0.4 * ln + 0.2 * c + 10.0 * self.labels(chunks, units)
        raise SystemExit(f"unknown variant {v!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--split",
        choices=H.SPLITS,
        default="squad-tune",
        help="squad-tune for the variants; a reporting split only for the default and the oracles (its ceiling)",
    )
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--questions", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/spans_rank_<split>.json")
    ap.add_argument("--select", default="", help="select_spans options for every variant, e.g. pool=12")
    ap.add_argument("--variants", default="", help="comma-separated subset of the variants (default: all)")
    args = ap.parse_args()
    from spans_qa import configs  # its --extra parser, so both scripts read options alike

    select = {}
    if args.select:
        cfg = configs(argparse.Namespace(sweep=False, extra=[args.select]))
        select = cfg[f"ragbudget_spans_{args.select}"]["select"]
    variants = [v for v in args.variants.split(",") if v] or VARIANTS
    if variants[0] != "default" or not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants: 'default' first, then any of {', '.join(VARIANTS[1:])}")
    # A reporting split measures the ceiling of sentence choice (what any ranking of these
    # candidates could reach); a variant chosen by its figures there would be tuned on it.
    if args.split != "squad-tune" and not set(variants) <= {"default", "oracle", "oracle (library score)"}:
        raise SystemExit(f"--split {args.split}: only the default and the oracles (variants are tuned on squad-tune)")
    out = args.out or H.ROOT / "bench" / "results" / f"spans_rank_{args.split.replace('-', '_')}.json"
    # The learned mix needs every unit's features at 256 tokens; nothing else does.
    train = "logistic regression (5-fold CV)" in variants
    t_start = time.time()

    from sklearn.linear_model import LogisticRegression

    from ragbudget.generation.generate import Generator

    gen = Generator()
    split = H.load_split(args.split, docs=args.docs, seed=args.seed)
    questions = H.sample_questions(split, args.questions, seed=args.seed)
    corpus = H.Corpus.build(split, questions)
    emb = corpus.sentence_embedder()
    packer = H.Packer(gen.tokenizer, span_scorer=S.SpanScorer(emb))
    cands = {q.qid: corpus.candidates(q, **H.DEFAULT_RETRIEVAL) for q in questions}
    study = Study(corpus, emb)
    original = S._score
    diag: list[dict] = []

    def patched(question, chunks, units, scorer, weights, **kw):  # type: ignore[no-untyped-def]
        original(question, chunks, units, scorer, weights, **kw)
        if study.collect is not None and units:
            y = study.labels(chunks, units)
            s = np.array([u.score for u in units])
            if train:
                f = study.features(question, chunks, units)
                study.collect.append((study.matrix(f), y))
            if y.any():
                rank = lambda v: [int((v > v[i]).sum()) for i in np.flatnonzero(y)]  # noqa: E731
                best = int(np.argmin(rank(s)))
                diag[-1].update(
                    answer_rank=rank(s)[best],
                    n_units=len(units),
                    answer_tokens=units[int(np.flatnonzero(y)[best])].n_tokens,
                )
                if train:
                    diag[-1].update(dense_rank=rank(f["dense"])[best], lexical_rank=rank(f["lex"])[best])
        s = study.scores(question, chunks, units)
        if s is not None:
            s = np.asarray(s, dtype=float)
            lo, hi = s.min(), s.max()
            # Into (0, 1]: the packer's MMR discount multiplies the score, so it must be positive.
            s = 0.01 + 0.99 * (s - lo) / (hi - lo) if hi > lo else np.ones_like(s)
            for u, x in zip(units, s, strict=True):
                u.score = float(x)

    S._score = patched

    def run(variant: str) -> dict[int, list[int]]:
        study.variant = variant
        hits: dict[int, list[int]] = {b: [] for b in BUDGETS}
        for q in questions:
            study.q = q
            for b in BUDGETS:
                p = packer.pack("ragbudget_spans", q.text, cands[q.qid], b, **select)
                hits[b].append(int(H.score(corpus, q, p)["recall"]))
        return hits

    # Training data (and the misses' diagnosis) at 256 tokens with the default scores.
    study.collect = []
    study.variant = "default"
    for q in questions:
        study.q = q
        diag.append({"qid": q.qid, "question": q.text})
        p = packer.pack("ragbudget_spans", q.text, cands[q.qid], 256, **select)
        diag[-1]["hit_256"] = int(H.score(corpus, q, p)["recall"])
    data = study.collect
    study.collect = None
    order = [q.qid for q in questions]
    random.Random(args.seed).shuffle(order)
    study.fold = {qid: i % 5 for i, qid in enumerate(order)}
    for k in range(5 if train else 0):
        rows = [data[i] for i, q in enumerate(questions) if study.fold[q.qid] != k]
        x = np.vstack([r[0] for r in rows])
        y = np.concatenate([r[1] for r in rows])
        study.models[k] = LogisticRegression(max_iter=2000).fit(x, y)

    table, per_question, paired = {}, {}, {}
    for v in variants:
        t = time.time()
        hits = run(v)
        per_question[v] = hits
        table[v] = {b: 100 * float(np.mean(h)) for b, h in hits.items()}
        base = per_question["default"]
        paired[v] = {
            b: {
                "won": sum(1 for a, c in zip(h, base[b], strict=True) if a > c),
                "lost": sum(1 for a, c in zip(h, base[b], strict=True) if a < c),
            }
            for b, h in hits.items()
        }
        print(
            f"{v:<34}"
            + "".join(f"{b:>6}: {table[v][b]:5.1f} (+{paired[v][b]['won']}/-{paired[v][b]['lost']})" for b in BUDGETS)
            + f"  {time.time() - t:.0f}s",
            flush=True,
        )
    S._score = original

    misses = [d for d in diag if not d["hit_256"]]
    result = {
        "split": args.split,
        "documents": list(split.titles),
        "questions": len(questions),
        "setup": (
            "bench/spans_qa.py's index, candidates and build_prompt(pack='spans') (library defaults: pool 8, "
            "relevance floor 0.5); only the sentence scores replaced per variant (ragbudget.packing.spans._score "
            "patched "
            "in this script); scores min-max scaled into (0.01, 1] before the packer; logistic regression: "
            "sklearn defaults over 15 features, trained on answer-holding sentences of the 256-token pools, "
            "5 folds over questions"
        ),
        "budgets": list(BUDGETS),
        "variants": variants,
        "select": select,
        "table": table,
        "won_lost_vs_default": paired,
        "per_question_recall": per_question,
        "question_ids": [q.qid for q in questions],
        "misses_at_256": misses,
        "answer_in_pool_at_256": sum(1 for d in diag if "answer_rank" in d),
        "seconds": round(time.time() - t_start, 1),
        "args": vars(args),
    }
    from _results import write

    write(out.stem, result, folder=out.parent, packages=("sentence-transformers", "scikit-learn", "nltk"))


if __name__ == "__main__":
    main()
