"""bench/abstain.py --scoped: a question weighed within its own file (answerable) and within
another indexed file (unanswerable: the other file does not hold it), and the rates a floor gives
over such rows. A small hash-embedder index, no model."""

from __future__ import annotations

from pathlib import Path

from _bench import load_bench
from _corpus import build, make_text
from _fakes import FakeGenerator

from ragbudget import Pipeline
from ragbudget.retrieval.index import Index

abstain = load_bench("abstain.py", "bench_abstain", shadowed=("_llama", "answers"))


def test_the_other_file_is_the_next_one_and_wraps(tmp_path: Path) -> None:
    for name in ("b.md", "a.md", "c.md"):
        (tmp_path / name).write_text("x")
    assert abstain.other_file("a.md", tmp_path) == "b.md"
    assert abstain.other_file("c.md", tmp_path) == "a.md"  # after the last, the first


def test_scoped_evidence_reads_only_the_scope(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"doc{i}.md").write_text(make_text(10 + i, n_paragraphs=4, unique=f"mark{i}zz"))
    build(Index(tmp_path / "ix"), docs)
    pipe = Pipeline(tmp_path / "ix", generator=FakeGenerator(), gpu="16GiB")  # type: ignore[arg-type]
    question = "Where does mark1zz appear?"
    own = abstain.evidence(pipe, question, sources="doc1.md")
    other = abstain.evidence(pipe, question, sources=abstain.other_file("doc1.md", docs))
    # The sentence holding the marker is in doc1 only: weighed within doc2 the question finds less.
    assert own["sentence"] > other["sentence"]
    assert own["sentence"] == abstain.evidence(pipe, question)["sentence"]  # as the whole index finds


def test_rates_count_declines_under_the_floor() -> None:
    rows = [
        {"answerable": True, "sentence": 0.6},
        {"answerable": True, "sentence": 0.3},
        {"answerable": False, "sentence": 0.2},
        {"answerable": False, "sentence": 0.5},
    ]
    assert abstain.rates(rows, "sentence", 0.45) == (50.0, 50.0)  # (unanswerable declined, answerable wrongly)
    assert abstain.rates(rows, "sentence", 0.0) == (0.0, 0.0)
