"""Header/footer stripping: ragbudget vs Haystack's DocumentCleaner on real documents.

Documents: the 3 typeset PDFs of ``shared/data/pdf`` (369 pages, text extracted with ragbudget's
pypdfium2 loader, uncleaned) and the 40 groff-rendered man pages of ``shared/data/manpages``
(260 pages). The same pages go to both cleaners.

Ground truth (built here, independent of either cleaner):

* furniture: a line among the first/last 3 non-empty lines of a page whose digit-masked form
  repeats in those zones on >= 30% of the document's pages (and on >= 2);
* extended furniture: furniture plus a first/last-two line whose first or last word (or N in
  "N / M") is the page's printed page number - per-chapter running heads and section-title
  footers that a 30% rule cannot see (page-number offsets read off the documents);
* body: every other line of >= 40 characters.

A line counts as removed when it no longer appears, whole, among the cleaned page's lines
(per-page multiset of stripped lines, so a partial cut - Haystack removes substrings - counts as
"not removed" for furniture and as "lost" for body).

Haystack: ``DocumentCleaner(remove_repeated_substrings=True, remove_empty_lines=False,
remove_extra_whitespaces=False)`` on the pages joined by form feeds. The two whitespace options are
switched off because they rewrite every line (and join lines), which would make every body line
"lost"; what is measured is its header/footer logic (``_find_and_remove_header_footer``).

Haystack's choice among equally long common n-grams follows Python's set order, so its output
changes with ``PYTHONHASHSEED``; the bench re-runs it under seeds 0..N-1 (``--seeds``) and prints
the range.

Run: ``.venv/bin/python bench/clean.py`` (``--quick``: man pages and maint-guide only).
Writes ``bench/out/clean.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the ground truth is the tests' own definition

from ragbudget.clean import find_furniture  # noqa: E402
from ragbudget.loaders import load_document  # noqa: E402
from _furniture_truth import PDFS, ground_truth  # noqa: E402

SHARED = Path(os.environ.get("RAGBUDGET_SHARED_DATA", REPO.parent / "shared" / "data"))
def removed_positions(before: list[str], after: list[str]) -> set[tuple[int, int]]:
    """Positions of lines no longer present whole in the cleaned page (multiset, stripped)."""
    assert len(before) == len(after), "page count changed"
    out = set()
    for p, (b, a) in enumerate(zip(before, after)):
        left = Counter(line.strip() for line in a.split("\n"))
        for i, line in enumerate(b.split("\n")):
            key = line.strip()
            if left[key] > 0:
                left[key] -= 1
            else:
                out.add((p, i))
    return out


def ragbudget_clean(pages: list[str], trust: bool) -> list[str]:
    from ragbudget.clean import apply_report

    return apply_report(pages, find_furniture(pages, trust_page_numbers=trust))


def haystack_cleaner():
    from haystack import Document as HDocument
    from haystack.components.preprocessors import DocumentCleaner

    cleaner = DocumentCleaner(
        remove_repeated_substrings=True, remove_empty_lines=False, remove_extra_whitespaces=False
    )

    def run(pages: list[str]) -> list[str]:
        out = cleaner.run(documents=[HDocument(content="\f".join(pages))])["documents"][0].content
        return out.split("\f")

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="man pages and maint-guide only")
    parser.add_argument("--seeds", type=int, default=3,
                        help="re-run Haystack under PYTHONHASHSEED=0..N-1 (its output depends on set order)")
    parser.add_argument("--only-haystack", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not SHARED.is_dir():
        sys.exit(f"shared data not found at {SHARED}; set RAGBUDGET_SHARED_DATA")

    docs: dict[str, list[str]] = {}
    t0 = time.perf_counter()
    for name in (("maint-guide.en.pdf",) if args.quick else PDFS):
        docs[name] = load_document(SHARED / "pdf" / name, clean=False).pages
    for path in sorted((SHARED / "manpages").glob("*.txt")):
        docs[path.name] = load_document(path, clean=False).pages
    load_s = time.perf_counter() - t0

    cleaners = {"ragbudget": lambda p: ragbudget_clean(p, False),
                "ragbudget (trust_page_numbers)": lambda p: ragbudget_clean(p, True)}
    if args.only_haystack:
        cleaners = {}
    try:
        cleaners["haystack DocumentCleaner"] = haystack_cleaner()
        import haystack

        haystack_version = haystack.__version__
    except ImportError:
        haystack_version = None
        print("haystack-ai not installed (pip install -e '.[bench]'); peer column skipped")

    truth = {name: ground_truth(name, pages) for name, pages in docs.items()}
    results = {}
    for label, clean in cleaners.items():
        per_group: dict[str, Counter] = defaultdict(Counter)
        seconds = 0.0
        for name, pages in docs.items():
            t = time.perf_counter()
            cleaned = clean(pages)
            seconds += time.perf_counter() - t
            gone = removed_positions(pages, cleaned)
            furniture, extended, body = truth[name]
            group = "pdf" if name.endswith(".pdf") else "manpages"
            for g in (group, "all"):
                c = per_group[g]
                c["furniture"] += len(furniture)
                c["furniture_removed"] += len(furniture & gone)
                c["extended"] += len(extended)
                c["extended_removed"] += len(extended & gone)
                c["body"] += len(body)
                c["body_lost"] += len(body & gone)
                c["pages_emptied"] += sum(
                    1 for b, a in zip(pages, cleaned) if b.strip() and not a.strip()
                    and sum(1 for line in b.split("\n") if len(line.strip()) >= 40) >= 3
                )
        results[label] = {
            "seconds": round(seconds, 3),
            "groups": {
                g: {
                    **dict(c),
                    "removal_pct": round(100 * c["furniture_removed"] / max(1, c["furniture"]), 2),
                    "extended_removal_pct": round(100 * c["extended_removed"] / max(1, c["extended"]), 2),
                    "body_loss_pct": round(100 * c["body_lost"] / max(1, c["body"]), 3),
                }
                for g, c in per_group.items()
            },
        }

    if args.only_haystack:
        print(json.dumps(results["haystack DocumentCleaner"]["groups"]["all"]))
        return
    seeds = {}
    if "haystack DocumentCleaner" in results and args.seeds > 0:
        # Haystack picks among equally long common n-grams by iterating a set of strings, so its
        # output changes with Python's hash seed; each seed runs in a fresh interpreter.
        import subprocess

        for seed in range(args.seeds):
            cmd = [sys.executable, __file__, "--only-haystack"] + (["--quick"] if args.quick else [])
            env = {**os.environ, "PYTHONHASHSEED": str(seed)}
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            seeds[seed] = json.loads(out.strip().splitlines()[-1])
        results["haystack DocumentCleaner"]["hash_seeds"] = seeds

    n_pages = sum(len(p) for p in docs.values())
    print(f"{len(docs)} documents, {n_pages} pages (extraction {load_s:.1f}s, not counted below)")
    header = f"{'cleaner':32} {'group':9} {'furniture removed':>18} {'extended removed':>17} {'body lost':>10} {'pages wiped':>11} {'time s':>7}"
    print(header)
    print("-" * len(header))
    base = results["ragbudget"]["seconds"]
    for label, r in results.items():
        for g in ("pdf", "manpages", "all"):
            if g not in r["groups"]:
                continue
            c = r["groups"][g]
            t = f"{r['seconds']:7.2f}" if g == "all" else ""
            print(
                f"{label:32} {g:9} {c['removal_pct']:>7.2f}% ({c['furniture_removed']:>4}/{c['furniture']:<4})"
                f" {c['extended_removal_pct']:>7.2f}% ({c['extended_removed']:>4}/{c['extended']:<4})"
                f" {c['body_loss_pct']:>9.3f}% {c['pages_emptied']:>11} {t:>7}"
            )
    if seeds:
        lost = [c["body_loss_pct"] for c in seeds.values()]
        removal = [c["removal_pct"] for c in seeds.values()]
        print(f"haystack over PYTHONHASHSEED=0..{len(seeds) - 1}: furniture removed "
              f"{min(removal):.2f}-{max(removal):.2f}%, body lost {min(lost):.3f}-{max(lost):.3f}% "
              "(ragbudget is deterministic)")
    if "haystack DocumentCleaner" in results:
        h = results["haystack DocumentCleaner"]["seconds"]
        print(f"time ratio haystack / ragbudget: {h / max(base, 1e-9):.1f}x")
    out = REPO / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "documents": len(docs),
        "pages": n_pages,
        "quick": args.quick,
        "haystack_version": haystack_version,
        "results": results,
    }
    (out / "clean.json").write_text(json.dumps(payload, indent=2))
    print(f"wrote {out / 'clean.json'}")


if __name__ == "__main__":
    main()
