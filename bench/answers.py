"""What a user gets: answers from ``ragbudget``'s own ``ask`` path against a LangChain "stuff" chain
and a LlamaIndex query engine, at the same context budgets, on one real engine and model (#43 §2-4).

Ground (each system as its users run it, on the same documents, engine, model and answer cap):

* **Documents**: ``--docs`` articles of the split written as Markdown files (``# title`` then the
  paragraphs) into one folder; each system indexes that folder its own way. **Unanswerable
  questions** (``--unanswerable``): questions about other articles of the same split, which are not
  in the folder — a system should decline them.
* **ragbudget**: ``Pipeline(index, engine=URL)``: ``index(folder)`` with every default (chunking,
  packaged MiniLM, BM25), then ``ask(q, context_tokens=B, max_new_tokens=N)`` — its own prompt,
  labels, packing, relevance floor, abstention and engine handling. ``ragbudget_chunks``: the same
  with ``pack="chunks"``; ``ragbudget_fill``: with ``span_floor=0`` (the allowance filled).
* **peers** (``bench/answers_peers.py``, in a virtual environment of their own: ``--peers-python``):
  ``langchain`` (the RAG tutorial's stuff chain: 400-token splitter, MiniLM, FAISS, top 4, the
  tutorial's prompt, the context cut to B tokens) and ``llamaindex`` (``VectorStoreIndex`` defaults,
  ``compact`` synthesizer, its window set so it packs B tokens of context).
* **Engine**: one ``llama-server`` (``--slots`` slots, ``-t --threads``) serving ``--model`` (a
  packaged model name, e.g. ``qwen2.5-coder-1.5b-instruct``, or a GGUF path), greedy, at most
  ``--max-new-tokens`` new tokens; requests one at a time unless ``--slots`` says otherwise.

Scores, on answerable questions: SQuAD v1.1 EM and token F1 (max over gold answers; ``[n]``
citation markers removed first) with paired bootstrap 95% intervals of ragbudget's row minus each
peer's (``_qa_harness.bootstrap_ci``); the wrongly-declined rate. On unanswerable questions: the
declined rate. A reply *declines* when it says the sources do not hold the answer
(:data:`DECLINE`, a pattern written for this benchmark, applied alike to every system). **Citation
precision** (ragbudget's rows; the peers do not cite): of the ``[n]`` markers in answers to
answerable questions, the share whose passage (the cited source's text, read back from the file by
its offsets) contains a gold answer. Failed requests are counted per system.

    python bench/answers.py --split squad-tune --docs 12 --questions 60 --unanswerable 15 \\
        --model qwen2.5-coder-0.5b-instruct --budgets 256,1024,2048 --peers-python /path/to/venv/bin/python

Writes ``bench/results/answers_<split>_<model>.json`` with every answer. Each system's cells are
kept in ``bench/out/`` as they are asked, keyed by what they depend on (for ragbudget: its code's
git tree, so only a clean ragbudget/ is kept), so that a cut run asks only what is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _qa_harness as H  # noqa: E402  (sets the offline environment first)
import numpy as np  # noqa: E402
from _llama import llama_server  # noqa: E402

#: ``ragbudget_fill``: span packing filling the allowance (``span_floor=0``, the default before commit
#: 90df21d), to show what the span floor changes on a split.
RAGBUDGET_ROWS = {"ragbudget": {}, "ragbudget_chunks": {"pack": "chunks"}, "ragbudget_fill": {"span_floor": 0.0}}
PEER_ROWS = ("langchain", "llamaindex")
#: A reply that says the sources do not hold the answer. Written for this benchmark from how
#: instruct models decline ("I don't know", "the context does not mention …", "not provided"),
#: applied to every system alike; it is not the library's own test.
DECLINE = re.compile(
    r"\b(?:i\s+(?:do\s*n[o']t|don't|cannot|can't|am\s+unable\s+to)\s+(?:know|find|answer|determine|say)"
    r"|(?:does|do)\s*n[o']t\s+(?:contain|mention|include|provide|say|specify|state|have)"
    r"|(?:is|are)\s+not\s+(?:mentioned|provided|given|stated|specified|included|available|found|in\s+the)"
    r"|no\s+(?:information|mention|answer|relevant)"
    r"|not\s+(?:in|found\s+in)\s+the\s+(?:documents?|sources?|context|provided)"
    r"|unable\s+to\s+(?:find|answer|determine)|cannot\s+be\s+(?:answered|determined|found))",
    re.IGNORECASE,
)
CITATION = re.compile(r"\[(\d+)\]")


def declines(text: str) -> bool:
    return bool(DECLINE.search(text)) or not text.strip()


def clean(text: str) -> str:
    return " ".join(CITATION.sub(" ", text).split())


def best(fn: Any, pred: str, answers: tuple[str, ...]) -> float:
    return max(fn(pred, a) for a in answers) if answers else 0.0


def question_set(
    split: str, docs: int, n_answerable: int, n_unanswerable: int, seed: int = 0, *, scoped: bool = False
) -> tuple[H.Split, list[int], list[dict[str, Any]]]:
    """The split's article pool, the ``docs`` articles indexed (a seeded draw) and the questions:
    ``n_answerable`` about indexed articles, then ``n_unanswerable`` about the others. ``scoped``:
    each answerable question carries its article's file as ``source`` (what every system is
    limited to), and none about the others is drawn (no file of theirs to limit them to)."""
    import random

    pool = H.load_split(split, docs=24 if split.startswith("squad") else 60, seed=seed)
    order = list(range(len(pool.titles)))
    random.Random(seed).shuffle(order)
    indexed, held_out = sorted(order[:docs]), set(order[docs:])
    qs = H.sample_questions(pool, 0, seed=seed)
    answerable = [q for q in qs if q.doc in indexed][:n_answerable]
    unanswerable = [q for q in qs if q.doc in held_out][:n_unanswerable]
    if scoped:
        unanswerable = []
    questions = [
        {"qid": q.qid, "text": q.text, "answers": list(q.answers), "answerable": i < len(answerable)}
        | ({"source": f"{doc_stem(pool.titles[q.doc]) or f'doc{q.doc}'}.md"} if scoped else {})
        for i, q in enumerate(answerable + unanswerable)
    ]
    return pool, indexed, questions


def doc_stem(title: str) -> str:
    """The file name (without ``.md``) an article's title is written under."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", title)[:80]


def write_docs(split: H.Split, indexed: list[int], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for d in indexed:
        name = doc_stem(split.titles[d]) or f"doc{d}"
        (folder / f"{name}.md").write_text(f"# {split.titles[d].replace('_', ' ')}\n\n{split.texts[d]}\n", "utf-8")


def source_text(src: dict[str, Any], files: dict[str, str]) -> str:
    """The text a cited source holds, read back from its file by the offsets the answer gives."""
    text = files.get(Path(str(src.get("path"))).name, "")
    spans = src.get("spans") or [src]
    return " ".join(text[int(s["start"]) : int(s["end"])] for s in spans if s.get("start") is not None)


def changed_since(commit: str, paths: tuple[str, ...]) -> str:
    """What under ``paths`` differs from ``commit`` (``git diff`` to the working tree: the files,
    or git's error for a commit it does not know), "" when nothing does."""
    diff = subprocess.run(
        ["git", "diff", "--name-only", commit, "--", *paths], cwd=H.ROOT, capture_output=True, text=True
    )
    return diff.stdout.strip().replace("\n", ", ") or (diff.stderr.strip() if diff.returncode else "")


def reused_cells(
    raw: Path, args: argparse.Namespace, documents: list[str], questions: list[dict[str, Any]], budgets: list[int]
) -> list[dict[str, Any]]:
    """ragbudget's cells from an earlier raw result, when nothing they depend on changed: the
    library's code (``git diff`` from the result's commit to HEAD, and the working tree, both
    empty under ragbudget/), the model and answer cap. Only the cells of this run's questions and
    budgets are kept; the caller asks for the rest (a larger sample of the same seeded draw asks
    only its new questions). Otherwise a one-line exit: re-run without ``--reuse``."""
    old = json.loads(raw.read_text(encoding="utf-8"))
    commit = str(old["versions"]["ragbudget_commit"])
    same_code = not commit.endswith("+dirty") and not changed_since(commit, ("ragbudget",))
    same_run = (
        old["split"] == args.split
        and old["documents_indexed"] == [str(t) for t in documents]
        and Path(old["model"]).name == Path(gguf_path(args.model)).name
        and old["max_new_tokens"] == args.max_new_tokens
    )
    if not (same_code and same_run):
        why = "ragbudget/ changed since " + commit if not same_code else "other documents, model or cap"
        raise SystemExit(f"--reuse {raw}: {why}; run without --reuse")
    rows = [s for s in args.systems if s in RAGBUDGET_ROWS]
    qids = {q["qid"] for q in questions}
    cells = [
        c
        for c in old["cells"]
        if c["system"] in rows and c["budget"] in budgets and c["qid"] in qids and "error" not in c
    ]
    print(f"ragbudget: {len(cells)} cells reused from {raw.name} (commit {commit}, the same library code)")
    return cells


def answer_fields(a: Any, files: dict[str, str]) -> dict[str, Any]:
    """A cell's fields from a ragbudget ``Answer``: the reply, the text of each source it was
    given (read back from ``files``), the context and prompt tokens, and whether it declined."""
    return {
        "answer": a.text,
        "finish_reason": a.finish_reason,
        "contexts": [source_text(s, files) for s in a.sources],
        "context_tokens": a.report["budget"].get("context_tokens_used"),
        "prompt_tokens": a.report["budget"].get("prompt_tokens"),
        "declined_by_library": a.declined,
    }


def ask_once(
    pipe: Any, q: dict[str, Any], budget: int, max_new_tokens: int, files: dict[str, str], row: str
) -> dict[str, Any]:
    """``ragbudget ask``: one question, ``budget`` tokens of context, the answer cap (``row``'s
    options are its pipeline's, :data:`RAGBUDGET_ROWS`), limited to the question's ``source``
    file when it names one (``--scoped``: ``ragbudget ask --source FILE``)."""
    answer = pipe.ask(q["text"], context_tokens=budget, max_new_tokens=max_new_tokens, sources=q.get("source"))
    return answer_fields(answer, files)


def ragbudget_cells(
    args: argparse.Namespace,
    url: str,
    docs: Path,
    documents: list[str],
    questions: list[dict[str, Any]],
    budgets: list[int],
    rows: list[str],
    ask: Any = None,
) -> list[dict[str, Any]]:
    """ragbudget's cells: each row's pipeline on the engine, each question asked at each budget
    by ``ask(pipe, question, budget, max_new_tokens, files, row)`` (the cell's fields; default
    :func:`ask_once`, ``Pipeline.ask``), after the cells ``--reuse`` takes from an earlier run."""
    from ragbudget import Pipeline

    ask = ask or ask_once

    known = reused_cells(args.reuse, args, documents, questions, budgets) if args.reuse else []
    left = left_cells(args)
    done = {(c["system"], c["budget"], c["qid"]) for c in known}
    done |= {(r, b, q["qid"]) for r, b in left for q in questions}
    cache = ragbudget_cache(args, documents, ask)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no bench/out/ yet
    for c in kept_cells(cache, rows, budgets, questions, done):
        known.append(c)
        done.add((c["system"], c["budget"], c["qid"]))
    if all((r, b, q["qid"]) in done for r in rows for b in budgets for q in questions):
        return known

    files = {p.name: p.read_text(encoding="utf-8") for p in docs.glob("*.md")}
    index_dir = docs.parent / "ragbudget-index"
    t0 = time.perf_counter()
    Pipeline(index_dir).index([docs])
    print(f"ragbudget index: {time.perf_counter() - t0:.1f} s", flush=True)
    out = list(known)
    for row in rows:
        with Pipeline(index_dir, engine=url, engine_timeout=args.timeout, **RAGBUDGET_ROWS[row]) as pipe:
            for b in budgets:
                for q in questions:
                    if (row, b, q["qid"]) in done:
                        continue
                    cell: dict[str, Any] = {"system": row, "budget": b, "qid": q["qid"]}
                    t = time.perf_counter()
                    try:
                        cell.update(ask(pipe, q, b, args.max_new_tokens, files, row))
                    except Exception as exc:  # noqa: BLE001 - a failed request is a result
                        cell["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    cell["seconds"] = round(time.perf_counter() - t, 2)
                    out.append(cell)
                    if cache is not None and "error" not in cell:
                        with cache.open("a", encoding="utf-8") as kept:
                            kept.write(json.dumps(cell) + "\n")
                    _progress(out)
    return out


def ragbudget_cache(args: argparse.Namespace, documents: list[str], ask: Any) -> Path | None:
    """Where ragbudget's cells are kept as they are asked (``bench/out/``), so that a cut run
    asks only what is missing: keyed by everything an answer depends on — the library's code (the
    git tree of ragbudget/ at HEAD), the rows' options and the asking function's module, the split's
    documents, the model, the answer cap, the engine's threads and slots (greedy decoding's
    arithmetic follows the thread count) and time-out. ``None`` (nothing kept) while ragbudget/
    has uncommitted changes: no key would name that code."""
    import inspect

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=H.ROOT, capture_output=True, text=True).stdout.strip()

    tree = git("rev-parse", "HEAD:ragbudget")
    if not tree or git("status", "--porcelain", "--", "ragbudget"):
        return None
    material = [
        tree,
        json.dumps(RAGBUDGET_ROWS, sort_keys=True, default=str),
        # The asking function's whole module: the options it gives each row live there too.
        inspect.getsource(inspect.getmodule(ask or ask_once)),  # type: ignore[arg-type]
        args.split,
        [str(d) for d in documents],
        Path(gguf_path(args.model)).name,
        args.max_new_tokens,
        args.threads,
        args.slots,
        args.timeout,
    ]
    if getattr(args, "scoped", False):  # a question asked of its own file is another cell
        material.append("scoped")
    key = hashlib.sha256(json.dumps(material).encode()).hexdigest()[:12]
    return H.OUT / f"answers_ragbudget_{key}.jsonl"


def kept_cells(
    cache: Path | None,
    rows: list[str],
    budgets: list[int],
    questions: list[dict[str, Any]],
    done: set[tuple[str, int, str]],
) -> list[dict[str, Any]]:
    """The cells ``cache`` holds for these rows, budgets and questions that ``done`` lacks (each
    once; a failed request is asked again)."""
    if cache is None or not cache.is_file():
        return []
    wanted = {(r, b, q["qid"]) for r in rows for b in budgets for q in questions} - done
    out: dict[tuple[str, int, str], dict[str, Any]] = {}
    for line in cache.read_text(encoding="utf-8").splitlines():
        c = json.loads(line)
        cell = (c["system"], c["budget"], c["qid"])
        if cell in wanted and "error" not in c:
            out[cell] = c
    if out:
        print(f"ragbudget: {len(out)} cells kept from an earlier run of the same code ({cache.name})", flush=True)
    return list(out.values())


def peer_cells(
    args: argparse.Namespace,
    url: str,
    docs: Path,
    gguf: str,
    questions: list[dict[str, Any]],
    budgets: list[int],
    *,
    chat: bool = False,
) -> list[dict[str, Any]]:
    """The peers' cells, from their cache (``bench/out/``) or asked of ``answers_peers.py``;
    ``chat``: each question carries its ``history`` and the peers answer through their chat
    setups (kept in a cache of their own)."""
    systems = [s for s in args.systems if s in PEER_ROWS]
    if not systems:
        return []
    if not args.peers_python:
        raise SystemExit("--peers-python: the peers run in their own virtual environment (see answers_peers.py)")
    # The peers' answers depend on nothing ragbudget changes: kept per split, model, documents
    # and cap (bench/out/), so a run that changes only ragbudget asks the engine only for it.
    material: list[Any] = [sorted(p.name for p in docs.glob("*.md")), Path(gguf).name, args.max_new_tokens]
    material += ["chat"] if chat else []
    material += ["scoped"] if getattr(args, "scoped", False) else []
    key = hashlib.sha256(json.dumps(material).encode()).hexdigest()[:12]
    cache = H.OUT / f"answers_peers_{key}.jsonl"
    known = {}
    if cache.is_file() and not args.fresh_peers:
        for line in cache.read_text(encoding="utf-8").splitlines():
            c = json.loads(line)
            if "error" not in c:
                known[(c["system"], c["budget"], c["qid"])] = c
    if args.peers_from:
        for c in earlier_peer_cells(args.peers_from, args, docs, gguf, chat=chat):
            known.setdefault((c["system"], c["budget"], c["qid"]), c)
    left = left_cells(args)
    wanted = [(s, b) for s in systems for b in budgets if (s, b) not in left]
    out = [known[(s, b, q["qid"])] for s, b in wanted for q in questions if (s, b, q["qid"]) in known]
    todo = [q for q in questions if any((s, b, q["qid"]) not in known for s, b in wanted)]
    if not todo:
        return out
    job = {
        "docs": str(docs),
        "engine": url,
        "gguf": gguf,
        # The cells to ask: each (system, budget) with a question missing; the peers' process
        # asks question by question, so a run cut short leaves whole questions for --questions N.
        "cells": [[s, b] for s, b in wanted if any((s, b, q["qid"]) not in known for q in todo)],
        "known": sorted({f"{s}@{b}@{q['qid']}" for s, b in wanted for q in todo if (s, b, q["qid"]) in known}),
        "questions": todo,
        "max_new_tokens": args.max_new_tokens,
        "timeout_s": args.timeout,
        "chat": chat,
    }
    H.OUT.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [args.peers_python, str(HERE / "answers_peers.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(job))
    proc.stdin.close()
    fresh: list[dict[str, Any]] = []
    with cache.open("a", encoding="utf-8") as kept:
        for line in proc.stdout:
            if line.startswith("{"):
                c = json.loads(line)
                if (c["system"], c["budget"], c["qid"]) in known:
                    continue
                fresh.append(c)
                kept.write(json.dumps(c) + "\n")
                kept.flush()
                _progress(fresh)
    if proc.wait():
        raise SystemExit(f"the peers' process failed ({proc.returncode}); answered {len(fresh)} cells")
    return out + fresh


#: What the peers' answers depend on in this repository: their script and their pinned environment.
PEER_CODE = ("bench/answers_peers.py", "bench/peers/answers.txt")


def earlier_peer_cells(
    raw: Path, args: argparse.Namespace, docs: Path, gguf: str, *, chat: bool = False
) -> list[dict[str, Any]]:
    """The peers' cells of an earlier raw result (``--peers-from``), when nothing they depend on
    changed since: the peers' script and pinned environment (:data:`PEER_CODE`, ``git diff`` from
    the result's commit and the working tree both empty), the split, the documents, the model, the
    answer cap and chat or not. They are what ``bench/out/``'s cache would hold had the run been on
    this machine: the peers call nothing of ragbudget. Otherwise a one-line exit."""
    old = json.loads(raw.read_text(encoding="utf-8"))
    commit = str(old["versions"]["ragbudget_commit"])
    if commit.endswith("+dirty"):  # the peers' code may have been among the uncommitted changes
        raise SystemExit(f"--peers-from {raw}: measured with uncommitted changes ({commit}); run without it")
    if why := changed_since(commit, PEER_CODE):
        raise SystemExit(f"--peers-from {raw}: the peers' code changed since {commit} ({why}); run without it")
    indexed = sorted(p.stem for p in docs.glob("*.md"))
    same = (
        old.get("split") == args.split
        # articles' titles here, story files (``*.md``) in answers_chat.py's
        and sorted(doc_stem(str(t)).removesuffix(".md") for t in old.get("documents_indexed", [])) == indexed
        and Path(old.get("model", "")).name == Path(gguf).name
        and old.get("max_new_tokens") == args.max_new_tokens
        # answers_chat.py's raw results say so in "mode" (and, since, in "chat" too)
        and (bool(old.get("chat")) or str(old.get("mode", "")).startswith("chat")) == chat
        and bool(old.get("scoped")) == bool(getattr(args, "scoped", False))
    )
    if not same:
        raise SystemExit(f"--peers-from {raw}: another split, documents, model, cap, chat or scope; run without it")
    cells = [c for c in old["cells"] if c["system"] in PEER_ROWS and "error" not in c and c.get("answer") is not None]
    print(f"peers: {len(cells)} cells taken from {raw.name} (asked at {commit}; their code unchanged)", flush=True)
    return cells


def _progress(cells: list[dict[str, Any]]) -> None:
    if len(cells) % 20 == 0:
        c = cells[-1]
        print(f"  {c['system']} @{c['budget']}: {len(cells)} cells", flush=True)


def score_cell(cell: dict[str, Any], q: dict[str, Any]) -> dict[str, Any]:
    answer = cell.get("answer")
    if answer is None:
        return {"failed": True}
    out: dict[str, Any] = {"failed": False, "declined": declines(answer)}
    if q["answerable"]:
        pred = clean(answer)
        out["em"] = best(H.exact_match, pred, tuple(q["answers"]))
        out["f1"] = best(H.f1_score, pred, tuple(q["answers"]))
        out["in_context"] = any(H.contains_answer(c, q["answers"]) for c in cell.get("contexts", []))
        cited = [int(n) for n in CITATION.findall(answer)]
        contexts = cell.get("contexts", [])
        if cited and cell["system"] in RAGBUDGET_ROWS:
            holds = [1 <= n <= len(contexts) and H.contains_answer(contexts[n - 1], q["answers"]) for n in cited]
            out["citations"], out["citations_holding"] = len(holds), sum(holds)
    return out


def summarize(cells: list[dict[str, Any]], questions: list[dict[str, Any]], systems: list[str], budgets: list[int]):
    by_q = {q["qid"]: q for q in questions}
    table: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for c in cells:
        table.setdefault((c["system"], c["budget"]), {})[c["qid"]] = score_cell(c, by_q[c["qid"]])
    answerable = [q["qid"] for q in questions if q["answerable"]]
    unanswerable = [q["qid"] for q in questions if not q["answerable"]]
    summary: dict[str, Any] = {}
    for (s, b), got in sorted(table.items()):
        cell: dict[str, Any] = {"n_answerable": len(answerable), "n_unanswerable": len(unanswerable)}
        ok = [got[qid] for qid in answerable if qid in got]
        cell["failed"] = sum(1 for g in got.values() if g["failed"])
        # A failed request scores 0 (the user got no answer): every row is over the same questions.
        H.mean_cell(cell, "f1", [100 * g.get("f1", 0.0) for g in ok])
        H.mean_cell(cell, "em", [100 * g.get("em", 0.0) for g in ok])
        H.mean_cell(cell, "in_context", [100 * g.get("in_context", False) for g in ok])
        cell["wrongly_declined_pct"] = 100 * np.mean([g.get("declined", False) for g in ok]) if ok else None
        un = [got[qid] for qid in unanswerable if qid in got]
        cell["declined_unanswerable_pct"] = 100 * np.mean([g.get("declined", False) for g in un]) if un else None
        cites = sum(g.get("citations", 0) for g in ok)
        cell["citations"] = cites
        cell["citation_precision_pct"] = 100 * sum(g.get("citations_holding", 0) for g in ok) / cites if cites else None
        cell["answers_citing_pct"] = 100 * np.mean([bool(g.get("citations")) for g in ok]) if ok else None
        summary[f"{s}@{b}"] = cell
    # Paired differences on answerable questions: ragbudget at each budget minus each peer row.
    diffs: dict[str, Any] = {}
    for s in (r for r in systems if r in RAGBUDGET_ROWS):
        for b in budgets:
            for p in systems:
                if p == s or (s, b) not in table:
                    continue
                for pb in budgets:
                    if (p, pb) not in table or (p in RAGBUDGET_ROWS and pb != b):
                        continue
                    a, z = table[(s, b)], table[(p, pb)]
                    vals = [100 * (a[q].get("f1", 0.0) - z[q].get("f1", 0.0)) for q in answerable if q in a and q in z]
                    if vals:
                        lo, hi = H.bootstrap_ci(vals)
                        diffs[f"{s}@{b} - {p}@{pb}"] = {
                            "f1_diff": float(np.mean(vals)),
                            "ci95": [lo, hi],
                            "n": len(vals),
                        }
    return summary, diffs


def print_summary(summary: dict[str, Any], diffs: dict[str, Any]) -> None:
    """A run's figures on the console, a line per system and budget, then the paired differences
    (both answers benchmarks; seconds per question where the summary has them)."""
    for key, c in summary.items():
        declined = "" if c.get("n_unanswerable") == 0 else f"declined(unans) {c['declined_unanswerable_pct']}% "
        pace = f" {c['seconds_per_question']:.1f} s/question" if "seconds_per_question" in c else ""
        print(
            f"{key:>24}: F1 {c['f1']:.1f} EM {c['em']:.1f} in-context {c['in_context']:.0f}% {declined}"
            f"wrongly-declined {c['wrongly_declined_pct']:.1f}% cite-prec {c['citation_precision_pct']} "
            f"failed {c['failed']}{pace}"
        )
    for key, d in diffs.items():
        print(f"{key:>40}: {d['f1_diff']:+.1f} ({d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f})")


def add_run_options(ap: argparse.ArgumentParser, *, systems: str) -> None:
    """The options every answers benchmark takes (this one and ``answers_chat.py``): budgets,
    systems, model and engine, the peers' environment and cache, reuse, seed and output."""
    ap.add_argument("--budgets", default="256,1024,2048")
    ap.add_argument("--systems", default=systems)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="packaged model name or GGUF path")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600, help="engine time-out a request, every system")
    ap.add_argument("--peers-python", default=None)
    ap.add_argument("--fresh-peers", action="store_true", help="ask the peers again (their answers are kept)")
    ap.add_argument(
        "--reuse",
        type=Path,
        default=None,
        metavar="RAW",
        help="ragbudget's cells from RAW when its library code is HEAD's (only the missing cells are asked)",
    )
    ap.add_argument(
        "--peers-from",
        type=Path,
        default=None,
        metavar="RAW",
        help="the peers' cells from RAW when their code, documents, model and cap are the same (the rest asked)",
    )
    ap.add_argument(
        "--leave",
        default="",
        metavar="SYSTEM@BUDGET,...",
        help="cells not asked (e.g. a slow peer at a budget no comparison needs); the tables leave them out",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)


def left_cells(args: argparse.Namespace) -> set[tuple[str, int]]:
    """``--leave``'s (system, budget) pairs; a one-line exit on a malformed entry."""
    out = set()
    for item in (x.strip() for x in args.leave.split(",") if x.strip()):
        system, _, budget = item.partition("@")
        if not budget.isdigit():
            raise SystemExit(f"--leave {item!r}: want SYSTEM@BUDGET, e.g. llamaindex@256")
        out.add((system, int(budget)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=("squad-tune", "squad-test", "amazon"), default="squad-tune")
    ap.add_argument("--docs", type=int, default=12, help="articles indexed")
    ap.add_argument("--questions", type=int, default=60, help="answerable questions (seeded sample)")
    ap.add_argument("--unanswerable", type=int, default=15, help="questions about articles not indexed")
    ap.add_argument(
        "--scoped",
        action="store_true",
        help="ask each question of its own article only, as a product page asks of its product's reviews: "
        "ragbudget with sources= (ask --source), LangChain and LlamaIndex with their metadata filters; "
        "no unanswerable questions (no file of theirs to scope to)",
    )
    add_run_options(ap, systems="ragbudget,ragbudget_chunks,langchain,llamaindex")
    ap.add_argument("--plot", type=Path, nargs=2, metavar=("RAW", "PNG"), help="draw a raw result; nothing is run")
    ap.add_argument(
        "--table", type=Path, metavar="RAW", help="print a raw result as BENCHMARKS.md's table; nothing is run"
    )
    args = ap.parse_args()
    if args.plot:
        plot(*args.plot)
        return
    if args.table:
        print(table(json.loads(args.table.read_text(encoding="utf-8"))))
        return
    budgets = [int(b) for b in args.budgets.split(",")]
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in args.systems if s not in RAGBUDGET_ROWS and s not in PEER_ROWS]
    if unknown:
        raise SystemExit(f"--systems: unknown {', '.join(unknown)}")
    gguf = gguf_path(args.model)
    t_start = time.time()

    pool, indexed, questions = question_set(
        args.split, args.docs, args.questions, args.unanswerable, args.seed, scoped=args.scoped
    )
    answerable = [q for q in questions if q["answerable"]]
    unanswerable = [q for q in questions if not q["answerable"]]
    print(f"{args.split}: {len(indexed)} articles indexed, {len(answerable)} + {len(unanswerable)} questions")
    with tempfile.TemporaryDirectory(prefix="answers-") as tmp:
        docs = Path(tmp) / "docs"
        write_docs(pool, indexed, docs)
        slot = max(budgets) + 1024 + args.max_new_tokens  # the largest context, templates, question, answer
        with llama_server(Path(tmp), model=gguf, slots=args.slots, slot_tokens=slot, threads=args.threads) as url:
            print(f"llama-server at {url} ({Path(gguf).name})", flush=True)
            ours = [s for s in args.systems if s in RAGBUDGET_ROWS]
            titles = [pool.titles[d] for d in indexed]
            cells = ragbudget_cells(args, url, docs, titles, questions, budgets, ours)
            H.OUT.mkdir(parents=True, exist_ok=True)
            (H.OUT / "answers_last_ragbudget.json").write_text(json.dumps(cells), encoding="utf-8")
            cells += peer_cells(args, url, docs, gguf, questions, budgets)
    summary, diffs = summarize(cells, questions, args.systems, budgets)
    print_summary(summary, diffs)
    from _results import write

    model_name = Path(gguf).stem.lower().replace("-", "_").replace(".", "_")
    result = {
        "split": args.split,
        "scoped": args.scoped,
        "documents_indexed": [pool.titles[d] for d in indexed],
        "questions_answerable": len(answerable),
        "questions_unanswerable": len(unanswerable),
        "budgets": budgets,
        "systems": args.systems,
        "model": Path(gguf).name,
        "engine": {"server": "llama.cpp llama-server", "slots": args.slots, "threads": args.threads},
        "max_new_tokens": args.max_new_tokens,
        "summary": summary,
        "paired_f1_differences": diffs,
        "questions": questions,
        "cells": cells,
        "seconds": round(time.time() - t_start, 1),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    out = args.out or (H.ROOT / "bench" / "results" / f"answers_{args.split.replace('-', '_')}_{model_name}.json")
    write(out.stem, result, folder=out.parent, packages=("sentence-transformers", "tokenizers"))


LABELS = {
    "ragbudget": "`ragbudget ask` (span packing, the default)",
    "ragbudget_chunks": "`ragbudget ask --pack chunks`",
    "ragbudget_fill": "`ragbudget ask --span-floor 0` (the allowance filled)",
    "langchain": "LangChain stuff chain (tutorial setup)",
    "llamaindex": "LlamaIndex query engine (`compact`)",
}


def table(result: dict[str, Any], labels: dict[str, str] = LABELS) -> str:
    """The per-system table of a raw result: F1 and EM with 95% intervals, the answer in the
    context, declining, citation precision and failures, one row per system and budget — each
    figure followed by its pointer into the raw result (``bench/_figures.py``: the row's
    ``<!-- raw: #/summary/SYSTEM@BUDGET -->``, then ``<!-- f1 -->`` …), so the table pasted into
    BENCHMARKS.md is checked by ``bench/report.py --check``."""
    lines = [
        "| system | context tokens | F1 (95% interval) | EM | answer in context | unanswerable declined "
        "| answerable wrongly declined | citation precision | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(x: float | None, key: str) -> str:
        return "—" if x is None else f"{x:.1f}%<!-- {key} -->"

    for system in result["systems"]:
        for b in result["budgets"]:
            c = result["summary"].get(f"{system}@{b}")
            if c is None or c["f1"] is None:
                continue
            lo, hi = c["f1_ci95"]
            cite = pct(c["citation_precision_pct"], "citation_precision_pct")
            if c["citation_precision_pct"] is not None:
                cite += f" of {c['citations']}<!-- citations -->"
            lines.append(
                f"| <!-- raw: #/summary/{system}@{b} -->{labels.get(system, system)} | {b:,} "
                f"| {c['f1']:.1f}<!-- f1 --> ({lo:.1f}<!-- f1_ci95/0 -->–{hi:.1f}<!-- f1_ci95/1 -->) "
                f"| {c['em']:.1f}<!-- em --> | {pct(c['in_context'], 'in_context')} "
                f"| {pct(c['declined_unanswerable_pct'], 'declined_unanswerable_pct')} "
                f"| {pct(c['wrongly_declined_pct'], 'wrongly_declined_pct')} | {cite} | {c['failed']}<!-- failed --> |"
            )
    return "\n".join(lines)


def plot(raw: Path, out: Path) -> None:
    """F1 against context tokens, one line per system (with its 95% interval as a band), from a
    raw result: ``python bench/answers.py --plot bench/results/answers_<...>.json docs/answers_f1.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(raw.read_text(encoding="utf-8"))
    summary, budgets = result["summary"], result["budgets"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for system in result["systems"]:
        cells = [summary.get(f"{system}@{b}") for b in budgets]
        if not all(cells):
            continue
        f1 = [c["f1"] for c in cells]
        ax.plot(budgets, f1, marker="o", label=system)
        ax.fill_between(budgets, [c["f1_ci95"][0] for c in cells], [c["f1_ci95"][1] for c in cells], alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("context tokens per request (KV bytes scale with them)")
    ax.set_ylabel("answer F1 (SQuAD v1.1)")
    n = result["questions_answerable"]
    ax.set_title(f"{result['split']}, {n} answerable questions, {result['model']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


def gguf_path(model: str) -> str:
    if Path(model).is_file():
        return model
    try:
        from ragbudget.memory.models import resolve_generator

        ref = resolve_generator(model)
        path = Path(ref.path) / (ref.gguf_file or "")
        if path.is_file():
            return str(path)
    except Exception as exc:  # noqa: BLE001 - said below
        raise SystemExit(f"--model {model}: {exc}") from None
    raise SystemExit(f"--model {model}: no GGUF file found")


if __name__ == "__main__":
    main()
