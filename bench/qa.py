"""QA under a context budget on SQuAD v1.1 dev: ragbudget selection vs truncation baselines.

Each SQuAD article's paragraphs are joined into one long document, chunked with
``ragbudget.chunking.chunk_text`` and embedded with the packaged all-MiniLM-L6-v2. For each question,
retrieval runs over the chunks of the question's own article (so "first N tokens of the document"
is a fair baseline). For context budgets of 256/512/1,024/2,048 *generator* (SmolLM2) tokens:

* ``first_n``        the first N tokens of the article (one labeled block);
* ``topk_truncate``  the top ``--top-k`` hits (4, LangChain's retriever default) as labeled
                     blocks, the whole cut to the budget (the usual "top-k, then truncate");
* ``greedy_fill``    hits by similarity as labeled blocks until the budget, the last one cut
                     mid-way to fill exactly (a budget-aware top-k: k grows with the budget);
* ``ragbudget_dense`` :func:`ragbudget.prompt.build_prompt` (knapsack selection, exact
                     accounting) over the dense hits only (``Pipeline(hybrid=False)``);
* ``ragbudget``      the same over hybrid hits, as ``Index.search(hybrid=True)`` makes them: the
                     top ``--fetch-k`` dense and BM25 candidates (SQLite FTS5, the index's own
                     query escaping) fused by :func:`ragbudget.index.fuse_scores`.

The three baselines rank by dense similarity only, as the frameworks they stand for do by default.
``--sweep`` also reports ragbudget's recall for both fusion methods and several lexical weights.

Recall = a gold answer (official SQuAD normalization) appears in the selected context. Overruns are
counted on the real rendered prompt (``len(input_ids) > fixed + N``). Then SmolLM2-135M answers a
fixed random sample of questions with the 1,024-token ragbudget prompt (EM/F1, official
normalization), and optionally with the full article when it fits its 8,192-token window.

    .venv/bin/python bench/qa.py --quick
    .venv/bin/python bench/qa.py --articles 8 --gen-n 200 --gen-seconds 1800
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import re
import string
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np

from ragbudget.chunking import chunk_text
from ragbudget.index import FTS_TOKENIZE, FUSIONS, _bm25, fuse_scores
from ragbudget.models import resolve_embedder
from ragbudget.prompt import DEFAULT_SYSTEM_PROMPT, PromptBuilder, build_prompt
from ragbudget.select import Candidate
from ragbudget.types import Source

SQUAD = Path(os.environ.get("RAGBUDGET_SHARED_DATA", ROOT.parent / "shared" / "data")) / "squad" / "squaddev_v1.1.json"
OUT = ROOT / "bench" / "out"
BUDGETS = (256, 512, 1024, 2048)
QA_SYSTEM = DEFAULT_SYSTEM_PROMPT + " Reply with only the answer, a short phrase copied from the sources."


# -- official SQuAD v1.1 evaluation (normalize_answer, exact match, token F1) -------------------
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


def contains_answer(context: str, answers: list[str]) -> bool:
    ctx = " " + normalize_answer(context) + " "
    return any(" " + normalize_answer(a) + " " in ctx for a in answers if normalize_answer(a))


# -- data ----------------------------------------------------------------------------------------
def load_articles(n: int, seed: int) -> list[dict]:
    data = json.loads(SQUAD.read_text())["data"]
    rnd = random.Random(seed)
    picked = sorted(rnd.sample(range(len(data)), min(n, len(data))))
    out = []
    for i in picked:
        art = data[i]
        text = "\n\n".join(p["context"] for p in art["paragraphs"])
        qs = [(q["question"], [a["text"] for a in q["answers"]])
              for p in art["paragraphs"] for q in p["qas"]]
        out.append({"title": art["title"], "text": text, "questions": qs})
    return out


def embed(texts: list[str], cache: Path) -> np.ndarray:
    if cache.is_file():
        arr = np.load(cache)
        if arr.shape[0] == len(texts):
            return arr
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(resolve_embedder(), device="cpu")
    arr = model.encode(texts, batch_size=32, normalize_embeddings=True, show_progress_bar=False)
    np.save(cache, arr)
    return arr


def summary(rows: list[dict]) -> dict:
    """n, EM and F1 (in %), mean prompt tokens and seconds of a list of answered questions."""
    if not rows:
        return {"n": 0}
    return {"n": len(rows), "em": 100 * np.mean([r["em"] for r in rows]),
            "f1": 100 * np.mean([r["f1"] for r in rows]),
            "mean_prompt_tokens": float(np.mean([r["prompt_tokens"] for r in rows])),
            "mean_seconds": float(np.mean([r["seconds"] for r in rows]))}


def print_generation(gen_rows: list[dict], full_rows: list[dict], *, budget: int, max_new_tokens: int,
                     skipped: int | None = None) -> None:
    """EM/F1 with the budgeted context and with the full article, and — since only some articles
    fit the window — the budgeted context again on exactly the questions the full article answered."""
    gs, fs = summary(gen_rows), summary(full_rows)
    print(f"\nSmolLM2-135M-Instruct answers (greedy, max_new_tokens={max_new_tokens}, CPU)")

    def line(label: str, st: dict) -> None:
        print(f"  {label:<34} n={st['n']:>3} EM {st['em']:4.1f} F1 {st['f1']:5.1f} "
              f"(mean prompt {st['mean_prompt_tokens']:5.0f} tokens, {st['mean_seconds']:4.1f} s/answer)")

    if gs["n"]:
        line(f"ragbudget {budget}-token context:", gs)
        in_context = np.mean([r["recall"] for r in gen_rows if "recall" in r] or [np.nan])
        print(f"  {'':<34} answer in the selected context: {100 * in_context:.1f}%")
    if fs["n"]:
        line("full article (where it fits):", fs)
        if skipped:
            print(f"  {'':<34} {skipped} questions skipped: their article is over the window")
        by_question = {r["question"]: r for r in gen_rows}
        paired = [by_question[r["question"]] for r in full_rows if r["question"] in by_question]
        if paired:
            line("ragbudget, the same questions:", summary(paired))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 articles, 60 questions, 3 answers")
    ap.add_argument("--articles", type=int, default=8, help="SQuAD articles (of 48) to use")
    ap.add_argument("--max-questions", type=int, default=0, help="cap on questions (0: all)")
    ap.add_argument("--fetch-k", type=int, default=50)
    ap.add_argument("--temperature", type=float, default=None,
                    help="select_chunks temperature (default: the library's)")
    ap.add_argument("--top-k", type=int, default=4, help="k of the top-k-then-truncate baseline")
    ap.add_argument("--fusion", choices=FUSIONS, default="score", help="hybrid fusion method")
    ap.add_argument("--lexical-weight", type=float, default=0.5, help="hybrid lexical weight")
    ap.add_argument("--sweep", action="store_true",
                    help="also measure ragbudget recall for every fusion x lexical weight")
    ap.add_argument("--chunk-min", type=int, default=40)
    ap.add_argument("--chunk-max", type=int, default=160)
    ap.add_argument("--gen-n", type=int, default=200, help="questions answered by SmolLM2")
    ap.add_argument("--gen-seconds", type=float, default=1500, help="stop generating after this")
    ap.add_argument("--gen-budget", type=int, default=1024)
    ap.add_argument("--full-n", type=int, default=0, help="also answer with the full article")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", type=Path, default=None, metavar="QA_JSON",
                    help="print the EM/F1 summary of an earlier run's qa.json and exit")
    args = ap.parse_args()
    if args.report is not None:
        r = json.loads(args.report.read_text())
        print_generation(r["generation_rows"], r["full_rows"], budget=r["args"]["gen_budget"],
                         max_new_tokens=r["args"]["max_new_tokens"], skipped=r.get("full_skipped_too_long"))
        return
    if args.quick:
        args.articles, args.max_questions, args.full_n = 2, 100, 0
        args.gen_n = min(args.gen_n, 2)
    OUT.mkdir(parents=True, exist_ok=True)
    t_start = time.time()


    from ragbudget.generate import Generator

    gen = Generator()
    print("loading the generator (SmolLM2-135M-Instruct)...", flush=True)
    tok = gen.tokenizer
    builder = PromptBuilder(tok, system_prompt=QA_SYSTEM)
    count = builder.count

    articles = load_articles(args.articles, args.seed)
    chunks_per_article, all_texts = [], []
    for a in articles:
        cs = chunk_text(a["text"], min_tokens=args.chunk_min, max_tokens=args.chunk_max)
        chunks_per_article.append(cs)
        all_texts += [c.text for c in cs]
    key = hashlib.sha256(("\x00".join(all_texts)).encode()).hexdigest()[:16]
    t0 = time.time()
    vecs = embed(all_texts, OUT / f"qa_emb_{key}.npy")
    print(f"{len(articles)} articles, {len(all_texts)} chunks embedded in {time.time() - t0:.1f}s",
          flush=True)

    questions = [(ai, q, ans) for ai, a in enumerate(articles) for q, ans in a["questions"]]
    rnd = random.Random(args.seed)
    rnd.shuffle(questions)
    if args.max_questions:
        questions = questions[: args.max_questions]
    from sentence_transformers import SentenceTransformer

    qmodel = SentenceTransformer(resolve_embedder(), device="cpu")
    t0 = time.time()
    qvecs = qmodel.encode([q for _, q, _ in questions], batch_size=64, normalize_embeddings=True,
                          show_progress_bar=False)
    print(f"{len(questions)} questions embedded in {time.time() - t0:.1f}s", flush=True)

    sel_opts = {} if args.temperature is None else {"temperature": args.temperature}
    # BM25 per article, in the index's own FTS5 table layout and query path.
    import sqlite3

    fts = []
    for cs in chunks_per_article:
        db = sqlite3.connect(":memory:")
        db.execute(f"CREATE VIRTUAL TABLE chunks_fts USING fts5(text, tokenize='{FTS_TOKENIZE}')")
        db.executemany("INSERT INTO chunks_fts(rowid, text) VALUES (?, ?)",
                       [(j, c.text) for j, c in enumerate(cs)])
        fts.append(db)
    sweep = [(f, w) for f in FUSIONS for w in (0.3, 0.5, 0.7)] if args.sweep else []
    sweep_recall = {f"{f}@{w}": {b: 0 for b in BUDGETS} for f, w in sweep}
    offsets = np.cumsum([0] + [len(c) for c in chunks_per_article])
    first_ids = {}  # article → token ids of the article text (generator tokenizer)
    strategies = ("first_n", "topk_truncate", "greedy_fill", "ragbudget_dense", "ragbudget")
    recall = {s: {b: 0 for b in BUDGETS} for s in strategies}
    fill = {b: [] for b in BUDGETS}
    overruns = {b: 0 for b in BUDGETS}
    checked = 0
    t0 = time.time()
    gen_prompts = {}
    for qi, (ai, q, answers) in enumerate(questions):
        cs = chunks_per_article[ai]
        lo, hi = offsets[ai], offsets[ai + 1]
        scores = vecs[lo:hi] @ qvecs[qi]
        order = np.argsort(-scores)[: args.fetch_k]
        title = articles[ai]["title"]
        hits = [Candidate(f"{ai}:{j}", cs[j].text, float(scores[j]),
                          sources=(Source(f"{title}.txt", cs[j].start, cs[j].end),)) for j in order]
        lexical = dict(_bm25(fts[ai], q, args.fetch_k))

        def hybrid(method: str, weight: float, scores: np.ndarray = scores, order: np.ndarray = order,
                   lexical: dict = lexical, ai: int = ai, cs: list = cs, title: str = title
                   ) -> list[Candidate]:
            # As Index.search(hybrid=True): top fetch_k of each, lexical-only ones get their cosine.
            dense = {int(j): float(scores[j]) for j in order}
            dense.update({j: float(scores[j]) for j in lexical if j not in dense})
            fused = fuse_scores(dense, lexical, method=method, lexical_weight=weight)
            return [Candidate(f"{ai}:{j}", cs[j].text, sc,
                              sources=(Source(f"{title}.txt", cs[j].start, cs[j].end),))
                    for j, sc in fused[: args.fetch_k]]

        hyb = hybrid(args.fusion, args.lexical_weight)
        swept = {f"{f}@{w}": hybrid(f, w) for f, w in sweep}
        fixed = builder.fixed_tokens(q)
        if ai not in first_ids:
            first_ids[ai] = tok.encode(articles[ai]["text"], add_special_tokens=False)
        for b in BUDGETS:
            # first N: one labeled block holding the article's first tokens.
            label = builder.overhead(Candidate("x", "", 0, sources=hits[0].sources), max_id=1)
            first = tok.decode(first_ids[ai][: max(0, b - label)])
            recall["first_n"][b] += contains_answer(first, answers)
            # greedy fill / top-k then truncate: blocks in score order, the last one cut.
            for name, pool in (("greedy_fill", hits), ("topk_truncate", hits[: args.top_k])):
                room, parts = b, []
                for h in pool:
                    over = builder.overhead(h, max_id=len(pool))
                    cost = count(h.text) + over
                    if cost <= room:
                        parts.append(h.text)
                        room -= cost
                    else:
                        if room - over > 0:
                            ids = tok.encode(h.text, add_special_tokens=False)
                            parts.append(tok.decode(ids[: room - over]))
                        break
                recall[name][b] += contains_answer("\n".join(parts), answers)
            # ragbudget: exact selection + rendered prompt (dense-only hits, then hybrid hits).
            pd = build_prompt(q, hits, tokenizer=tok, max_prompt_tokens=fixed + b, builder=builder,
                              **sel_opts)
            recall["ragbudget_dense"][b] += contains_answer(pd.selection.text, answers)
            for name, pool in swept.items():
                ps = build_prompt(q, pool, tokenizer=tok, max_prompt_tokens=fixed + b,
                                  builder=builder, **sel_opts)
                sweep_recall[name][b] += contains_answer(ps.selection.text, answers)
            checked += 1
            if pd.n_tokens > fixed + b or pd.selection.tokens_used > pd.selection.tokens_allowed:
                overruns[b] += 1
            p = build_prompt(q, hyb, tokenizer=tok, max_prompt_tokens=fixed + b, builder=builder,
                             **sel_opts)
            recall["ragbudget"][b] += contains_answer(p.selection.text, answers)
            fill[b].append(p.selection.fill)
            checked += 1
            if p.n_tokens > fixed + b or p.selection.tokens_used > p.selection.tokens_allowed:
                overruns[b] += 1
            if b == args.gen_budget:
                gen_prompts[qi] = p
        if (qi + 1) % 200 == 0:
            print(f"  {qi + 1}/{len(questions)} questions ({time.time() - t0:.0f}s)", flush=True)
    n = len(questions)
    rec = {s: {b: 100.0 * v / n for b, v in d.items()} for s, d in recall.items()}

    print(f"\nanswer recall in the selected context, {n} questions, {len(articles)} SQuAD dev "
          "articles (retrieval within the question's own article)")
    print(f"ragbudget = hybrid ({args.fusion}, lexical_weight={args.lexical_weight}); "
          "ragbudget_dense = the same selection over dense hits only")
    print(f"{'budget':>7} {'first_n':>8} {f'top{args.top_k}_trunc':>11} {'greedy_fill':>11} "
          f"{'rb_dense':>9} {'ragbudget':>10} {'vs first':>9} {'vs topk':>8} {'vs greedy':>9} "
          f"{'vs dense':>9} {'fill':>6} {'overruns':>9}")
    for b in BUDGETS:
        r = rec["ragbudget"][b]
        print(f"{b:>7} {rec['first_n'][b]:>7.1f}% {rec['topk_truncate'][b]:>10.1f}% "
              f"{rec['greedy_fill'][b]:>10.1f}% {rec['ragbudget_dense'][b]:>8.1f}% {r:>9.1f}% "
              f"{r - rec['first_n'][b]:>+9.1f} {r - rec['topk_truncate'][b]:>+8.1f} "
              f"{r - rec['greedy_fill'][b]:>+9.1f} {r - rec['ragbudget_dense'][b]:>+9.1f} "
              f"{100 * np.mean(fill[b]):>5.1f}% {overruns[b]:>9}")
    sweep_rec = {k: {b: 100.0 * v / n for b, v in d.items()} for k, d in sweep_recall.items()}
    if sweep_rec:
        print("\nragbudget recall by fusion@lexical_weight")
        for k, d in sweep_rec.items():
            print(f"  {k:>9}: " + "  ".join(f"{b}: {d[b]:5.1f}%" for b in BUDGETS))
    print(f"prompts checked for overruns: {checked}, overruns: {sum(overruns.values())}")

    # -- generation ---------------------------------------------------------------------------
    gen_rows = []
    sample = [qi for qi in range(len(questions))][: args.gen_n]
    t0 = time.time()
    for qi in sample:
        if time.time() - t0 > args.gen_seconds:
            break
        _, q, answers = questions[qi]
        p = gen_prompts[qi]
        g = gen.generate(p, max_new_tokens=args.max_new_tokens)
        pred = re.sub(r"\[\d+\]", "", g.text).strip()
        gen_rows.append({"question": q, "answers": answers, "prediction": pred,
                         "em": max(exact_match(pred, a) for a in answers),
                         "f1": max(f1_score(pred, a) for a in answers),
                         "prompt_tokens": g.prompt_tokens, "new_tokens": g.new_tokens,
                         "seconds": g.seconds, "recall": contains_answer(p.selection.text, answers)})
        if len(gen_rows) % 10 == 0:
            print(f"  answered {len(gen_rows)} ({time.time() - t0:.0f}s)", flush=True)
    full_rows = []
    skipped_full = 0
    t1 = time.time()
    window = int(getattr(gen.config, "max_position_embeddings", 8192))
    for qi in sample[: args.full_n]:
        if time.time() - t1 > args.gen_seconds:
            break
        ai, q, answers = questions[qi]
        whole = Candidate("all", articles[ai]["text"], 1.0,
                          sources=(Source(f"{articles[ai]['title']}.txt", 0, len(articles[ai]["text"])),))
        p = build_prompt(q, [whole], tokenizer=tok, max_prompt_tokens=window - args.max_new_tokens,
                         builder=builder, truncate_oversize=False)
        if not p.passages:
            skipped_full += 1
            continue  # the article does not fit the window
        g = gen.generate(p, max_new_tokens=args.max_new_tokens)
        pred = re.sub(r"\[\d+\]", "", g.text).strip()
        full_rows.append({"question": q, "prediction": pred, "prompt_tokens": g.prompt_tokens,
                          "em": max(exact_match(pred, a) for a in answers),
                          "f1": max(f1_score(pred, a) for a in answers), "seconds": g.seconds})

    gs, fs = summary(gen_rows), summary(full_rows)
    print_generation(gen_rows, full_rows, budget=args.gen_budget, max_new_tokens=args.max_new_tokens,
                     skipped=skipped_full)

    result = {
        "questions": n, "articles": [a["title"] for a in articles], "chunks": len(all_texts),
        "retrieval": f"within the question's own article (MiniLM cosine), fetch_k={args.fetch_k}",
        "chunking": f"ragbudget.chunking.chunk_text min={args.chunk_min} max={args.chunk_max} cl100k",
        "hybrid": {"fusion": args.fusion, "lexical_weight": args.lexical_weight},
        "budgets": list(BUDGETS), "recall": rec, "sweep_recall": sweep_rec,
        "fill": {b: float(np.mean(v)) for b, v in fill.items()},
        "overruns": overruns, "prompts_checked": checked,
        "generation": gs, "generation_full_article": fs, "generation_rows": gen_rows,
        "full_rows": full_rows, "full_skipped_too_long": skipped_full, "args": vars(args),
        "seconds": time.time() - t_start,
    }
    sys.path.insert(0, str(ROOT / "bench"))
    from _results import write

    write("qa_quick" if args.quick else "qa", result, folder=OUT if args.quick else None)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        names = {"first_n": "first N tokens",
                 "topk_truncate": f"top-{args.top_k}, then truncate",
                 "greedy_fill": "by similarity until full, last cut",
                 "ragbudget_dense": "ragbudget, dense only",
                 "ragbudget": "ragbudget (hybrid + knapsack)"}
        for s, label in names.items():
            ax.plot(BUDGETS, [rec[s][b] for b in BUDGETS], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(BUDGETS, [str(b) for b in BUDGETS])
        ax.set_xlabel("context budget (SmolLM2 tokens)")
        ax.set_ylabel("answer in context (%)")
        ax.set_title(f"SQuAD dev, {n} questions, {len(articles)} articles")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        # Only a full run replaces the committed plot; --quick writes into the ignored bench/out.
        png = OUT / "qa_recall_quick.png" if args.quick else ROOT / "bench" / "qa_recall.png"
        fig.savefig(png, dpi=120)
        print(f"plot: {png.relative_to(ROOT)}")
    except ImportError:
        print("matplotlib not installed: no plot")
    print(f"({time.time() - t_start:.0f}s)")


if __name__ == "__main__":
    main()
