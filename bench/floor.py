"""Choose ``relevance_floor``: answer recall vs context tokens when a large budget is filled.

``ragbudget ask`` on a multi-document index gives the selector the whole context allowance
(about 7,800 SmolLM2 tokens on a CPU host), and without a floor the knapsack fills it down to
passages that have nothing to do with the question. This measures, for several floors (a fraction
of the best candidate's fused score; 0 = no floor), the share of questions whose gold answer is in
the selected context and the context tokens spent, at the default allowance and at 1,024 tokens.

Setup (as ``bench/qa.py``, but retrieval over a *pool* of articles, as an index of several
documents is searched): SQuAD dev articles joined into one document each, chunked with
``chunk_text`` (ragbudget's defaults, 300–500 tokens, like ``ragbudget index``), embedded with the
packaged all-MiniLM-L6-v2, BM25 from the index's own FTS5 layout, fused with
``ragbudget.retrieval.lexical.fuse_scores`` (score fusion, weight 0.5: the defaults), ``fetch_k`` 50.

Splits: ``--split tune`` (the floor is chosen here), ``--split test`` (other SQuAD dev articles,
never tuned on) and ``--split amazon`` (SQuADShifts Amazon reviews: report only).

    .venv/bin/python bench/floor.py --split tune --articles 6 --max-questions 300
    .venv/bin/python bench/floor.py --split test --articles 6 --max-questions 300
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import numpy as np  # noqa: E402
from qa import OUT, ROOT, SQUAD, contains_answer, embed  # noqa: E402  (sets the offline env)

from ragbudget.fitting import build_prompt  # noqa: E402
from ragbudget.input.chunking import chunk_text  # noqa: E402
from ragbudget.packing.select import Candidate  # noqa: E402
from ragbudget.prompt.prompt import PromptBuilder  # noqa: E402
from ragbudget.retrieval.lexical import FTS_TOKENIZE, bm25, fuse_scores  # noqa: E402
from ragbudget.types import Source  # noqa: E402

AMAZON = SQUAD.parent.parent / "squadshifts" / "amazon_reviews_v1.0.json"
FLOORS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def split_articles(split: str, n: int, seed: int) -> list[dict]:
    """Disjoint SQuAD dev article sets: a seeded permutation of the 48 articles, ``tune`` takes
    the first ``n``, ``test`` the last ``n``; ``amazon`` the first ``n`` of a permutation of the
    SQuADShifts Amazon products."""
    path = AMAZON if split == "amazon" else SQUAD
    data = json.loads(path.read_text())["data"]
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    picked = order[-n:] if split == "test" else order[:n]
    out = []
    for i in sorted(picked):
        art = data[i]
        out.append(
            {
                "title": art["title"],
                "text": "\n\n".join(p["context"] for p in art["paragraphs"]),
                "questions": [
                    (q["question"], [a["text"] for a in q["answers"]]) for p in art["paragraphs"] for q in p["qas"]
                ],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=("tune", "test", "amazon"), default="tune")
    ap.add_argument("--articles", type=int, default=6)
    ap.add_argument("--max-questions", type=int, default=300)
    ap.add_argument("--fetch-k", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=256, help="as ask's default")
    ap.add_argument("--window", type=int, default=8192, help="SmolLM2's max_position_embeddings")
    ap.add_argument(
        "--budgets", default="default,1024", help="context budgets; 'default' = window - max_new_tokens - fixed prompt"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    t_start = time.time()

    from ragbudget.generation.generate import Generator
    from ragbudget.memory.models import resolve_embedder

    gen = Generator()
    tok = gen.tokenizer
    builder = PromptBuilder(tok)
    articles = split_articles(args.split, args.articles, args.seed)
    texts, sources = [], []
    for a in articles:
        for c in chunk_text(a["text"]):
            texts.append(c.text)
            sources.append(Source(f"{a['title']}.txt", c.start, c.end))
    import hashlib

    key = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:16]
    OUT.mkdir(parents=True, exist_ok=True)
    vecs = embed(texts, OUT / f"floor_emb_{key}.npy")
    db = sqlite3.connect(":memory:")
    db.execute(f"CREATE VIRTUAL TABLE chunks_fts USING fts5(text, tokenize='{FTS_TOKENIZE}')")
    db.executemany("INSERT INTO chunks_fts(rowid, text) VALUES (?, ?)", list(enumerate(texts)))

    questions = [(q, ans) for a in articles for q, ans in a["questions"]]
    random.Random(args.seed).shuffle(questions)
    questions = questions[: args.max_questions]
    from sentence_transformers import SentenceTransformer

    qvecs = SentenceTransformer(resolve_embedder(), device="cpu").encode(
        [q for q, _ in questions], batch_size=64, normalize_embeddings=True, show_progress_bar=False
    )
    print(f"{args.split}: {len(articles)} articles, {len(texts)} chunks, {len(questions)} questions", flush=True)

    budgets = [b for b in args.budgets.split(",")]
    rows: dict[str, dict[str, list]] = {
        f"{b}@{f}": {"recall": [], "tokens": [], "passages": []} for b in budgets for f in FLOORS
    }
    for qi, (q, answers) in enumerate(questions):
        scores = vecs @ qvecs[qi]
        order = np.argsort(-scores)[: args.fetch_k]
        dense = {int(j): float(scores[j]) for j in order}
        lexical = dict(bm25(db, q, args.fetch_k))
        dense.update({j: float(scores[j]) for j in lexical if j not in dense})
        fused = fuse_scores(dense, lexical)[: args.fetch_k]
        hits = [Candidate(j, texts[j], s, sources=(sources[j],)) for j, s in fused]
        fixed = builder.fixed_tokens(q)
        for b in budgets:
            room = args.window - args.max_new_tokens - fixed if b == "default" else int(b)
            for f in FLOORS:
                p = build_prompt(
                    q, hits, tokenizer=tok, max_prompt_tokens=fixed + room, builder=builder, relevance_floor=f
                )
                r = rows[f"{b}@{f}"]
                r["recall"].append(contains_answer(p.selection.text, answers))
                r["tokens"].append(p.selection.tokens_used)
                r["passages"].append(len(p.selection.chunks))
        if (qi + 1) % 50 == 0:
            print(f"  {qi + 1}/{len(questions)} ({time.time() - t_start:.0f}s)", flush=True)

    table = {
        k: {
            "recall": 100 * float(np.mean(v["recall"])),
            "mean_context_tokens": float(np.mean(v["tokens"])),
            "mean_passages": float(np.mean(v["passages"])),
        }
        for k, v in rows.items()
    }
    print(f"\n{'budget':>8} {'floor':>5} {'recall':>7} {'ctx tokens':>10} {'passages':>8}")
    for k, v in table.items():
        b, f = k.split("@")
        print(f"{b:>8} {f:>5} {v['recall']:6.1f}% {v['mean_context_tokens']:10.0f} {v['mean_passages']:8.1f}")

    result = {
        "split": args.split,
        "articles": [a["title"] for a in articles],
        "chunks": len(texts),
        "questions": len(questions),
        "floors": list(FLOORS),
        "results": table,
        "setup": "pooled hybrid retrieval (MiniLM + FTS5 BM25, score fusion 0.5), fetch_k "
        f"{args.fetch_k}, chunk_text defaults, budgets in SmolLM2 tokens",
        "seconds": round(time.time() - t_start, 1),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    from _results import write

    out = args.out or (ROOT / "bench" / "results" / f"floor_{args.split}.json")
    write(out.stem, result, folder=out.parent)


if __name__ == "__main__":
    main()
