"""Dedup quality and cost: exact-after-normalization recall (Disfl-QA), near-duplicate recall and
precision on pairs normalization does not make identical, speed against datasketch, 100k scale.

    .venv/bin/python bench/dedup.py            # full: 100k synthetic chunks, 200-chunk embedder sample
    .venv/bin/python bench/dedup.py --quick    # 20k chunks, 50-chunk embedder sample

1. Disfl-QA: the 1,204 contexts are whitespace re-tokenisations of SQuAD dev paragraphs, identical
   to them after ragbudget's normalization, so this tests *exact* dedup: recall of the copies and
   false merges among the 2,067 distinct SQuAD paragraphs (also through the near path alone,
   every text given a distinct digest).
2. Speed against datasketch (:func:`speed`): MinHash + MinHashLSH at the same threshold, num_perm
   and shingles, with permutations reused across MinHash objects (``MinHash.bulk`` and
   ``permutations=``) and, for reference, without.
3. Near-duplicates that normalization does not make identical, recall and precision for
   ragbudget and datasketch on the same items (ground truth: difflib word ratio >= GT_RATIO,
   see the section comment): (a) paragraphs of consecutive Debian Constitution versions,
   (b) the PDF manuals' text (ragbudget's loader) against their plain-text twins, aligned by
   difflib, (c) SQuAD paragraphs with 1-20% of their words replaced/inserted/deleted among 1,000
   unrelated paragraphs.
4. Constitution v1.0-v1.9 chunked with chunk_text(min_tokens=50, max_tokens=400): chunks kept,
   how many carry all ten sources.
5. Cost: N chunks made by resampling real sentences (SQuAD + the manuals + man pages) into
   chunk-sized texts whose token lengths follow ragbudget's own chunk sizes on the corpus, with
   10% exact copies (re-spaced) and 10% near copies (~1.7% of the words replaced). dedup() time at N/4,
   N/2 and N (linear growth), against the time all-MiniLM-L6-v2 needs to embed the same chunks
   (timed on a sample, extrapolated). Raw result: bench/results/dedup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ragbudget
from chunking import SHARED, load_corpus

from ragbudget.input.chunking import chunk_text
from ragbudget.input.dedup import (
    DEFAULT_NUM_PERM,
    DEFAULT_SHINGLE,
    DEFAULT_THRESHOLD,
    Deduplicator,
    dedup,
)
from ragbudget.types import Chunk, Source


def squad_and_disfl() -> tuple[list[str], list[str], list[int]]:
    squad = json.loads((SHARED / "squad" / "squaddev_v1.1.json").read_text(encoding="utf-8"))
    paras = [p["context"] for art in squad["data"] for p in art["paragraphs"]]
    task = json.loads((SHARED / "disflqa" / "task.json").read_text(encoding="utf-8"))
    contexts = sorted({ex["input"].split("context: ", 1)[1] for ex in task["examples"]})
    by_letters = {"".join(p.split()): i for i, p in enumerate(paras)}
    gold = [by_letters["".join(c.split())] for c in contexts]
    return paras, contexts, gold


def quality() -> dict[str, object]:
    paras, contexts, gold = squad_and_disfl()
    pairs = [(Chunk(p, 0, len(p), 0), f"s{i}") for i, p in enumerate(paras)]
    pairs += [(Chunk(c, 0, len(c), 0), f"d{j}") for j, c in enumerate(contexts)]
    t0 = time.perf_counter()
    r = dedup(pairs)
    t_full = time.perf_counter() - t0
    home: dict[str, str] = {}
    false_merges = 0
    for it in r.items:
        squad_srcs = [s.path for s in it.sources if s.path.startswith("s")]
        false_merges += max(0, len(squad_srcs) - 1)
        for s in it.sources:
            home[s.path] = squad_srcs[0] if squad_srcs else s.path
    recall = sum(home[f"d{j}"] == f"s{g}" for j, g in enumerate(gold)) / len(contexts)
    # Near path alone: distinct digests disable the exact match.
    d = Deduplicator()
    t0 = time.perf_counter()
    near_false = sum(d.add(f"s{i}", p, digest=f"s{i}").kind != "new" for i, p in enumerate(paras))
    near_recall = sum(
        d.add(f"d{j}", c, digest=f"d{j}").duplicate_of == f"s{g}"
        for j, (c, g) in enumerate(zip(contexts, gold, strict=True))
    ) / len(contexts)
    t_near = time.perf_counter() - t0
    out: dict[str, object] = {
        "squad_paragraphs": len(paras),
        "disfl_contexts": len(contexts),
        "recall": recall,
        "false_merges": false_merges,
        "exact_removed": r.exact_removed,
        "near_removed": r.near_removed,
        "near_only_recall": near_recall,
        "near_only_false_merges": near_false,
        "ragbudget_batch_s": t_full,
        "ragbudget_incremental_near_s": t_near,
    }
    return out


def constitution() -> dict[str, object]:
    files = [SHARED / "versions" / f"constitution.1.{i}.txt" for i in range(10)]
    pairs = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        pairs += [(c, Source(f.name, c.start, c.end)) for c in chunk_text(text, min_tokens=50, max_tokens=400)]
    r = dedup(pairs)
    return {
        "chunks_in": len(pairs),
        "kept": len(r.items),
        "exact_removed": r.exact_removed,
        "near_removed": r.near_removed,
        "kept_with_all_10_sources": sum(len(it.sources) == 10 for it in r.items),
    }


# --- Near-duplicates that normalization does not make identical -----------------------------
#
# Ground truth, written without ragbudget's MinHash: two paragraphs are near-duplicates when the
# difflib ratio of their word sequences (lower-cased \w+ runs, autojunk off) is at least
# GT_RATIO. Items are paragraphs of at least MIN_WORDS words; an item whose ragbudget-normalized
# text already occurred in the set is left out (exact dedup's job, counted as "exact"), so every
# pair graded here differs after normalization. Recall: share of ground-truth pairs across the
# two sides that end in one dedup group. Precision: share of predicted pairs (any two items in one
# group) that the ground truth calls near-duplicates.

GT_RATIO = 0.8
MIN_WORDS = 20
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def gt_ratio(a: list[str], b: list[str]) -> float:
    import difflib

    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    if sm.real_quick_ratio() < GT_RATIO or sm.quick_ratio() < GT_RATIO:
        return 0.0  # an upper bound already below the line: not a near-duplicate
    return sm.ratio()


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if len(words(p)) >= MIN_WORDS]


def shingle_sets(texts: list[str], k: int = DEFAULT_SHINGLE) -> list[list[bytes]]:
    """Word k-grams of the words ragbudget's normalizer sees, for datasketch (same shingles)."""
    from ragbudget.input.dedup import _analyse

    out = []
    for text in texts:
        an = _analyse([text])
        ws = [an.cp[a:b].tobytes().decode("utf-32-le") for a, b in zip(an.word_starts, an.word_ends, strict=True)]
        out.append(sorted({" ".join(ws[i : i + k]).encode() for i in range(max(1, len(ws) - k + 1))}))
    return out


def groups_ragbudget(
    texts: list[str], threshold: float = DEFAULT_THRESHOLD, shingle: int = DEFAULT_SHINGLE
) -> list[int]:
    """Representative index of every item after ragbudget's batch dedup (first kept)."""
    pairs = [(Chunk(t, 0, len(t), 0), Source(str(i), 0, len(t))) for i, t in enumerate(texts)]
    r = dedup(pairs, threshold=threshold, shingle=shingle)
    rep = [0] * len(texts)
    for it in r.items:
        first = int(it.sources[0].path)
        for s in it.sources:
            rep[int(s.path)] = first
    return rep


def groups_datasketch(
    texts: list[str],
    threshold: float = DEFAULT_THRESHOLD,
    shingle: int = DEFAULT_SHINGLE,
    *,
    confirm: bool = False,
) -> list[int]:
    """The same with datasketch: MinHash.bulk (shared permutations) and MinHashLSH at the same
    threshold and num_perm, query then insert. By default used as documented (an LSH hit is a
    duplicate, bands datasketch picks for the threshold); ``confirm=True`` gives it ragbudget's
    two advantages: ragbudget's band layout (tuned for the threshold - 0.15) and a hit kept only
    when ``MinHash.jaccard`` is at least the threshold, the best one first."""
    from datasketch import MinHash, MinHashLSH

    from ragbudget.input.dedup import NearDupIndex

    mhs = MinHash.bulk(shingle_sets(texts, shingle), num_perm=DEFAULT_NUM_PERM)
    if confirm:
        ours = NearDupIndex(threshold, DEFAULT_NUM_PERM)
        lsh = MinHashLSH(num_perm=DEFAULT_NUM_PERM, params=(ours.bands, ours.rows))
    else:
        lsh = MinHashLSH(threshold=threshold, num_perm=DEFAULT_NUM_PERM)
    rep = list(range(len(texts)))
    for i, m in enumerate(mhs):
        hits = lsh.query(m)
        if confirm:
            # Best estimate first, ties to the earliest inserted (NearDupIndex's order).
            scored = sorted((-mhs[h].jaccard(m), h) for h in hits)
            hits = [h for neg, h in scored if -neg >= threshold][:1]
        if hits:
            rep[i] = rep[hits[0]] if confirm else rep[min(hits)]
        else:
            lsh.insert(i, m)
    return rep


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def grade(
    texts: list[str], rep: list[int], positives: set[tuple[int, int]], judged: dict[tuple[int, int], bool] | None = None
) -> dict[str, float | int]:
    """Recall over ``positives`` (pairs i < j), precision of all predicted pairs."""
    from itertools import combinations

    members: dict[int, list[int]] = {}
    for i, r in enumerate(rep):
        members.setdefault(r, []).append(i)
    predicted = {p for ms in members.values() for p in combinations(sorted(ms), 2)}
    ws: dict[int, list[str]] = {}
    good = 0
    for i, j in predicted:
        if (i, j) in positives or (judged is not None and judged.get((i, j))):
            good += 1
        elif judged is None or (i, j) not in judged:
            a = ws.setdefault(i, words(texts[i]))
            b = ws.setdefault(j, words(texts[j]))
            good += gt_ratio(a, b) >= GT_RATIO
    found = len(positives & predicted)
    return {
        "positives": len(positives),
        "found": found,
        "recall": found / len(positives) if positives else None,
        "predicted_pairs": len(predicted),
        "correct_pairs": good,
        "precision": good / len(predicted) if predicted else None,
    }  # None: nothing predicted


def collect(sides: list[list[str]]) -> tuple[list[str], list[int], int]:
    """Items of all sides in order, the side of each, and how many were exact after normalization."""
    from ragbudget.input.dedup import normalize

    seen: set[str] = set()
    texts, side, exact = [], [], 0
    for s, items in enumerate(sides):
        for t in items:
            n = normalize(t)
            if n in seen:
                exact += 1
                continue
            seen.add(n)
            texts.append(t)
            side.append(s)
    return texts, side, exact


def cross_positives(texts: list[str], side: list[int]) -> tuple[set[tuple[int, int]], list[float]]:
    ws = [words(t) for t in texts]
    pos, ratios = set(), []
    a_idx = [i for i, s in enumerate(side) if s == 0]
    for j, s in enumerate(side):
        if s != 1:
            continue
        for i in a_idx:
            r = gt_ratio(ws[i], ws[j])
            if r >= GT_RATIO:
                pos.add((min(i, j), max(i, j)))
                ratios.append(r)
    return pos, ratios


def add_up(parts: list[dict[str, float | int]]) -> dict[str, float | int]:
    tot = {k: sum(p[k] for p in parts) for k in ("positives", "found", "predicted_pairs", "correct_pairs")}
    tot["recall"] = tot["found"] / tot["positives"] if tot["positives"] else None
    tot["precision"] = tot["correct_pairs"] / tot["predicted_pairs"] if tot["predicted_pairs"] else None
    return tot


Systems = dict[str, Callable[[list[str]], list[int]]]
DEFAULT_SYSTEMS: Systems = {"ragbudget": groups_ragbudget, "datasketch": groups_datasketch}


def near_versions(systems: Systems = DEFAULT_SYSTEMS) -> dict[str, object]:
    """(a) Each Constitution version's paragraphs against the next version's."""
    texts_by_v = [(SHARED / "versions" / f"constitution.1.{i}.txt").read_text(encoding="utf-8") for i in range(10)]
    graded: dict[str, list[dict[str, float | int]]] = {name: [] for name in systems}
    steps = []
    for v in range(9):
        texts, side, exact = collect([paragraphs(texts_by_v[v]), paragraphs(texts_by_v[v + 1])])
        pos, ratios = cross_positives(texts, side)
        step: dict[str, object] = {
            "step": f"1.{v}->1.{v + 1}",
            "items": len(texts),
            "exact_left_out": exact,
            "positives": len(pos),
        }
        for name, fn in systems.items():
            step[name] = g = grade(texts, fn(texts), pos)
            graded[name].append(g)
        step["positive_ratios"] = ratios
        steps.append(step)
    return {**{name: add_up(gs) for name, gs in graded.items()}, "steps": steps}


def pdf_twin_pairs(pdf_path: Path, twin_path: Path) -> list[tuple[str, str]]:
    """(PDF text, twin paragraph) for every twin paragraph, aligned by difflib over word streams.

    The PDF is read with ragbudget's loader (pypdfium2, furniture stripped): that is the input,
    not the grader. The twin's paragraphs (blank-line separated) are mapped through the matching
    blocks of one word-level SequenceMatcher over the two whole texts; the PDF side of a paragraph
    is the PDF text from its first to its last aligned word. Paragraphs with fewer than half of
    their words aligned have no counterpart and are left out.
    """
    import difflib

    from ragbudget.input.loaders import load_document

    pdf = load_document(pdf_path).text
    twin = twin_path.read_text(encoding="utf-8")
    pw = [(m.start(), m.end()) for m in _WORD.finditer(pdf)]
    tw = [(m.start(), m.end()) for m in _WORD.finditer(twin)]
    sm = difflib.SequenceMatcher(
        None, [twin[a:b].lower() for a, b in tw], [pdf[a:b].lower() for a, b in pw], autojunk=False
    )
    to_pdf: dict[int, int] = {}
    for blk in sm.get_matching_blocks():
        for k in range(blk.size):
            to_pdf[blk.a + k] = blk.b + k
    starts = [a for a, _ in tw]
    import bisect

    out = []
    for m in re.finditer(r"\S(?:.|\n(?!\s*\n))*", twin):  # blank-line separated paragraphs
        i = bisect.bisect_left(starts, m.start())
        j = bisect.bisect_left(starts, m.end())
        if j - i < MIN_WORDS:
            continue
        mapped = [to_pdf[k] for k in range(i, j) if k in to_pdf]
        if len(mapped) < (j - i) / 2:
            continue
        out.append((pdf[pw[min(mapped)][0] : pw[max(mapped)][1]], m.group().strip()))
    return out


def near_pdf_twins(systems: Systems = DEFAULT_SYSTEMS) -> dict[str, object]:
    """(b) PDF text (ragbudget's loader) against the plain-text twin, paragraph by paragraph."""
    graded: dict[str, list[dict[str, float | int]]] = {name: [] for name in systems}
    per = {}
    for pdf_name, twin_name in (("policy.pdf", "policy.txt"), ("maint-guide.en.pdf", "maint-guide.en.txt")):
        t0 = time.perf_counter()
        pairs = pdf_twin_pairs(SHARED / "pdf" / pdf_name, SHARED / "pdf" / "twins" / twin_name)
        texts, _side, exact = collect([[p for p, _ in pairs], [t for _, t in pairs]])
        index = {t: i for i, t in enumerate(texts)}
        pos, judged, ratios, below = set(), {}, [], 0
        for p, t in pairs:
            if p in index and t in index and index[p] != index[t]:
                i, j = sorted((index[p], index[t]))
                r = gt_ratio(words(p), words(t))
                if r >= GT_RATIO:
                    pos.add((i, j))
                    ratios.append(r)
                else:
                    below += 1
                    judged[(i, j)] = False
        doc: dict[str, object] = {
            "aligned_paragraphs": len(pairs),
            "items": len(texts),
            "exact_left_out": exact,
            "positives": len(pos),
            "aligned_below_ratio": below,
        }
        for name, fn in systems.items():
            doc[name] = g = grade(texts, fn(texts), pos)
            graded[name].append(g)
        doc["positive_ratios"] = ratios
        doc["seconds"] = time.perf_counter() - t0
        per[pdf_name] = doc
    return {**{name: add_up(gs) for name, gs in graded.items()}, "documents": per}


def edit(text: str, frac: float, pool: list[str], rng: random.Random) -> str:
    """Replace, insert or delete (chosen uniformly) round(frac × words) words, at least one."""
    ws = text.split()
    for _ in range(max(1, round(frac * len(ws)))):
        op = rng.choice(("replace", "insert", "delete"))
        k = rng.randrange(len(ws))
        if op == "replace":
            ws[k] = rng.choice(pool)
        elif op == "insert":
            ws.insert(k, rng.choice(pool))
        elif len(ws) > 1:
            del ws[k]
    return " ".join(ws)


EDIT_LEVELS = (0.01, 0.02, 0.05, 0.10, 0.15, 0.20)


def near_edits(n_base: int = 300, n_neg: int = 1000, seed: int = 0) -> dict[str, object]:
    """(c) SQuAD paragraphs and copies with k% of their words edited, among unrelated paragraphs."""
    from ragbudget.input.dedup import normalize

    paras, _, _ = squad_and_disfl()
    rng = random.Random(seed)
    picked = rng.sample(range(len(paras)), n_base + n_neg)
    base = [paras[i] for i in picked[:n_base]]
    neg = [paras[i] for i in picked[n_base:]]
    pool = [w for p in neg for w in p.split() if w.isalpha()]
    levels = {}
    for frac in EDIT_LEVELS:
        r = random.Random(f"{seed}-{frac}")
        copies = []
        for b in base:
            c = edit(b, frac, pool, r)
            while normalize(c) == normalize(b):  # an edit normalization undoes: edit again
                c = edit(b, frac, pool, r)
            copies.append(c)
        texts = base + neg + copies  # originals first: a copy is the later occurrence
        off = n_base + n_neg
        pos = {(i, off + i) for i in range(n_base)}
        judged = {p: True for p in pos}
        ratios = [gt_ratio(words(b), words(c)) for b, c in zip(base, copies, strict=True)]
        levels[f"{frac:.0%}"] = {
            "ragbudget": grade(texts, groups_ragbudget(texts), pos, judged),
            "datasketch": grade(texts, groups_datasketch(texts), pos, judged),
            "mean_gt_ratio": sum(ratios) / len(ratios),
            "share_over_gt_ratio": sum(x >= GT_RATIO for x in ratios) / len(ratios),
        }
    return {"base": n_base, "unrelated": n_neg, "levels": levels}


def speed(rounds: int) -> dict[str, object]:
    """ragbudget batch dedup vs datasketch on SQuAD dev paragraphs + Disfl-QA contexts.

    Same texts, same word shingles of the default size, made for datasketch before the clock
    starts (it is timed on MinHash + LSH only, ragbudget on everything including normalizing and shingling), same
    threshold and num_perm. datasketch three ways: a fresh ``MinHash(num_perm)`` per text (what
    this script did before: new permutations every time), ``MinHash(num_perm, permutations=...,
    scheme=...)`` sharing one object's permutations, and ``MinHash.bulk`` (its documented way to
    hash many sets: one initialised MinHash copied per set). Interleaved rounds; ratios are
    medians of per-round ratios.
    """
    from datasketch import MinHash, MinHashLSH

    paras, contexts, _ = squad_and_disfl()
    texts = paras + contexts
    sh = shingle_sets(texts)

    def lsh_pass(mhs) -> None:  # type: ignore[no-untyped-def]
        lsh = MinHashLSH(threshold=DEFAULT_THRESHOLD, num_perm=DEFAULT_NUM_PERM)
        for i, m in enumerate(mhs):
            if not lsh.query(m):
                lsh.insert(i, m)

    def fresh() -> None:
        mhs = []
        for s in sh:
            m = MinHash(num_perm=DEFAULT_NUM_PERM)
            m.update_batch(s)
            mhs.append(m)
        lsh_pass(mhs)

    def shared() -> None:
        proto = MinHash(num_perm=DEFAULT_NUM_PERM)
        mhs = []
        for s in sh:
            m = MinHash(num_perm=DEFAULT_NUM_PERM, permutations=proto.permutations, scheme=proto.scheme)
            m.update_batch(s)
            mhs.append(m)
        lsh_pass(mhs)

    def bulk() -> None:
        lsh_pass(MinHash.bulk(sh, num_perm=DEFAULT_NUM_PERM))

    def ours() -> None:
        dedup([(Chunk(t, 0, len(t), 0), str(i)) for i, t in enumerate(texts)])

    runs = {
        "ragbudget dedup (all of it)": ours,
        "datasketch, fresh permutations per MinHash": fresh,
        "datasketch, permutations= shared": shared,
        "datasketch, MinHash.bulk": bulk,
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    import statistics

    base = times["ragbudget dedup (all of it)"]
    out: dict[str, object] = {"texts": len(texts), "rounds": rounds}
    for k, ts in times.items():
        out[k] = {
            "median_s": statistics.median(ts),
            "seconds": ts,
            "ragbudget_x": statistics.median(t / b for t, b in zip(ts, base, strict=True)),
        }
    ds = [k for k in runs if k.startswith("datasketch")]
    fastest = min(ds, key=lambda k: out[k]["median_s"])  # type: ignore[index]
    out["fastest_datasketch"] = fastest
    return out


def synthetic(n: int, seed: int = 0) -> list[str]:
    """n chunk-sized texts resampled from real sentences, 10% exact + 10% near copies."""
    rng = random.Random(seed)
    docs = [t for _, t in load_corpus(False)]
    sentences = [s.strip() for t in docs for s in re.split(r"(?<=[.!?])\s+", t) if len(s.split()) >= 4]
    sizes = [c.n_tokens for t in docs[:60] for c in chunk_text(t)]
    out: list[str] = []
    while len(out) < n:
        r = rng.random()
        if out and r < 0.1:  # exact copy, re-spaced
            out.append(re.sub(r" ", "  ", rng.choice(out), count=3))
        elif out and r < 0.2:  # near copy: replace ~1.7% of the words
            words = rng.choice(out).split()
            for _ in range(max(1, len(words) // 60)):
                words[rng.randrange(len(words))] = rng.choice(["alpha", "beta", "gamma", "delta"])
            out.append(" ".join(words))
        else:
            target = rng.choice(sizes) * 0.75  # ~0.75 words per cl100k token
            words: list[str] = []
            parts = []
            while len(words) < target:
                s = rng.choice(sentences)
                parts.append(s)
                words += s.split()
            out.append(" ".join(parts))
    return out


def embedder_seconds_per_chunk(texts: list[str]) -> float:
    from sentence_transformers import SentenceTransformer

    from ragbudget.memory.models import resolve_embedder

    model = SentenceTransformer(resolve_embedder(), device="cpu")
    model.encode(texts[:8], batch_size=32)  # warm-up
    t0 = time.perf_counter()
    model.encode(texts, batch_size=32)
    return (time.perf_counter() - t0) / len(texts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="20k chunks, 50-chunk embedder sample")
    ap.add_argument("--n", type=int, default=None, help="number of synthetic chunks")
    ap.add_argument("--no-embedder", action="store_true", help="skip the embedder timing")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the datasketch timing")
    ap.add_argument("--skip-peer", action="store_true", help="no datasketch timing, no near-dup sets")
    args = ap.parse_args()
    n = args.n or (20_000 if args.quick else 100_000)
    results: dict[str, object] = {
        "threshold": DEFAULT_THRESHOLD,
        "num_perm": DEFAULT_NUM_PERM,
        "shingle": DEFAULT_SHINGLE,
        "cpu_count": os.cpu_count(),
    }

    q = quality()
    results["quality"] = q
    print(
        f"Disfl-QA (identical to their SQuAD paragraph after normalization: an exact-dedup test) "
        f"recall {q['recall']:.2%} (near path alone {q['near_only_recall']:.2%}); "
        f"false merges among {q['squad_paragraphs']} SQuAD paragraphs: {q['false_merges']} "
        f"(near alone {q['near_only_false_merges']})",
        flush=True,
    )
    if not args.skip_peer:
        sp = speed(args.rounds)
        results["speed"] = sp
        for k, v in sp.items():
            if isinstance(v, dict):
                print(f"  {k:44} {v['median_s']:6.2f} s   ragbudget x {v['ragbudget_x']:.2f}")
        print(f"  fastest datasketch: {sp['fastest_datasketch']}", flush=True)
        near: dict[str, object] = {"gt_ratio": GT_RATIO, "min_words": MIN_WORDS}
        for name, fn in (
            ("constitution_versions", near_versions),
            ("pdf_vs_twin", near_pdf_twins),
            ("squad_edits", near_edits),
        ):
            t0 = time.perf_counter()
            near[name] = res = fn()
            if "levels" in res:
                for lvl, v in res["levels"].items():  # type: ignore[union-attr]
                    print(
                        f"  edits {lvl:>4}: mean ratio {v['mean_gt_ratio']:.3f}; ragbudget recall "
                        f"{pct(v['ragbudget']['recall'])} precision {pct(v['ragbudget']['precision'])}; "
                        f"datasketch recall {pct(v['datasketch']['recall'])} precision "
                        f"{pct(v['datasketch']['precision'])}"
                    )
            else:
                rb, ds = res["ragbudget"], res["datasketch"]  # type: ignore[index]
                print(
                    f"  {name}: {rb['positives']} pairs; ragbudget recall {pct(rb['recall'])} "
                    f"precision {pct(rb['precision'])} ({rb['predicted_pairs']} pairs); datasketch "
                    f"recall {pct(ds['recall'])} precision {pct(ds['precision'])} "
                    f"({ds['predicted_pairs']} pairs)"
                )
            print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        results["near_duplicates"] = near
    c = constitution()
    results["constitution"] = c
    print(
        f"Constitution v1.0-v1.9: {c['chunks_in']} chunks -> {c['kept']} kept "
        f"({c['exact_removed']} exact, {c['near_removed']} near), "
        f"{c['kept_with_all_10_sources']} with all ten sources"
    )

    texts = synthetic(n)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    scale = []
    for m in (n // 4, n // 2, n):
        pairs = [(Chunk(t, 0, len(t), 0), f"doc{i // 20}") for i, t in enumerate(texts[:m])]
        t0 = time.perf_counter()
        r = dedup(pairs)
        dt = time.perf_counter() - t0
        scale.append(
            {
                "chunks": m,
                "seconds": dt,
                "us_per_chunk": dt / m * 1e6,
                "exact_removed": r.exact_removed,
                "near_removed": r.near_removed,
            }
        )
        print(
            f"dedup {m:>7} chunks: {dt:6.1f}s ({dt / m * 1e6:.0f} us/chunk), "
            f"exact {r.exact_removed}, near {r.near_removed}"
        )
    results["scale"] = scale
    results["synthetic_mb"] = mb
    if not args.no_embedder:
        sample = random.Random(1).sample(texts, 50 if args.quick else 200)
        per = embedder_seconds_per_chunk(sample)
        est = per * n
        share = scale[-1]["seconds"] / est
        results["embedder"] = {
            "sample": len(sample),
            "s_per_chunk": per,
            "estimated_s": est,
            "dedup_share": share,
            "threads": os.cpu_count(),
        }
        print(f"all-MiniLM-L6-v2: {per * 1000:.1f} ms/chunk -> {est:.0f}s for {n} chunks; dedup is {share:.1%} of that")
    from _results import write

    write("dedup", results, packages=("datasketch",))


if __name__ == "__main__":
    main()
