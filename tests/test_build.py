"""ragbudget.retrieval.build, the writer end to end: options checked first, duplicates as sources,
settings changes, long chunks, skipped files, progress, boilerplate, dedup modes, and random
edit sequences that keep ids and rows one to one."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from _corpus import (
    EMB,
    VOCAB,
    _twin_corpus,
    build,
    make_text,
    write_corpus,
)
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ragbudget.errors import (
    ConfigError,
)
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Index


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture
def ix(tmp_path: Path) -> Index:
    return Index(tmp_path / "ix")


def test_bad_options_are_config_errors(ix: Index, corpus: Path) -> None:
    with pytest.raises(ConfigError, match="dedup"):
        build(ix, corpus, dedup="fuzzy")
    with pytest.raises(ConfigError, match="store must be one of"):
        build(ix, corpus, store="ivf-magic")


def test_duplicate_sources_are_all_kept_and_shrink_on_delete(ix: Index, tmp_path: Path) -> None:
    corpus = tmp_path / "dups"
    corpus.mkdir()
    text = make_text(7, unique="shared9zz")
    (corpus / "a.txt").write_text(text)
    (corpus / "b.txt").write_text(text)
    (corpus / "c.txt").write_text(text.replace("  ", " ") + "\n")  # whitespace-only difference
    s = build(ix, corpus)
    n_chunks = s.chunks_total
    assert s.exact_duplicates >= 2 * n_chunks - 1 and s.chunks_embedded == n_chunks
    hit = Index.open(ix.path).search("shared9zz", k=1)[0]
    assert {Path(x.path).name for x in hit.sources} == {"a.txt", "b.txt", "c.txt"}
    owner = Path(Index.open(ix.path).absolute_path(hit.sources[0].path) or "")
    owner.unlink()  # the file whose text the chunk holds
    s = build(ix, corpus)
    assert s.chunks_total == n_chunks and s.chunks_embedded == 0
    hit2 = Index.open(ix.path).search("shared9zz", k=1)[0]
    assert hit2.chunk_id == hit.chunk_id and len(hit2.sources) == 2
    assert owner.name not in {Path(x.path).name for x in hit2.sources}
    assert Index.open(ix.path).verify().ok


def test_near_duplicates_attach_as_sources(ix: Index, tmp_path: Path) -> None:
    corpus = tmp_path / "near"
    corpus.mkdir()
    words = [VOCAB[(i * 7) % len(VOCAB)] for i in range(55)]
    (corpus / "v1.txt").write_text(" ".join(words) + " final.\n")
    words[30] = "changedzz"
    (corpus / "v2.txt").write_text(" ".join(words) + " final.\n")
    s = build(ix, corpus, min_tokens=5, max_tokens=200)
    assert s.near_duplicates == 1 and s.chunks_total == 1
    assert len(Index.open(ix.path).get_chunks([1])[0].sources) == 2
    s = build(ix, corpus, min_tokens=5, max_tokens=200, dedup="exact", rechunk=True)
    assert s.rebuilt and "dedup" in s.rebuild_reason and s.chunks_total == 2
    assert s.chunks_embedded == 1  # the identical-text vector was reused from the old index


def test_settings_change_triggers_rebuild_with_reason(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    s = build(ix, corpus, max_tokens=80, rechunk=True)
    assert s.rebuilt and "chunking" in s.rebuild_reason and s.committed
    s = build(ix, corpus, max_tokens=80, embedder=HashEmbedder(dim=32))
    assert s.rebuilt and "embedder changed" in s.rebuild_reason
    assert s.chunks_embedded == s.chunks_total
    assert Index.open(ix.path).stats()["dim"] == 32
    s = build(ix, corpus, max_tokens=80, embedder=HashEmbedder(dim=32), rebuild=True)
    assert s.rebuilt and "requested" in s.rebuild_reason


def test_tail_of_a_long_chunk_is_retrievable(ix: Index, tmp_path: Path) -> None:
    corpus = tmp_path / "long"
    corpus.mkdir()
    filler = " ".join(f"filler{i}" for i in range(120))
    (corpus / "long.txt").write_text(filler + " The tailfactzz sits at the very end.\n")
    (corpus / "other.txt").write_text(" ".join(f"other{i}" for i in range(20)) + "\n")
    # A 30-word model window: the 125-word chunk needs 5 windows, and its tail must count.
    emb = HashEmbedder(dim=256, max_tokens=30)
    s = ix.build([str(corpus)], embedder=emb, min_tokens=10, max_tokens=400)
    assert s.windows_pooled == 1 and s.windows_embedded > s.chunks_embedded
    hit = Index.open(ix.path).search("tailfactzz", k=1)[0]
    assert "tailfactzz" in hit.text and hit.windows >= 4 and hit.score > 0.05
    assert Index.open(ix.path).stats()["windowed_chunks"] == 1


def test_skipped_files_are_reported(ix: Index, corpus: Path) -> None:
    (corpus / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    s = build(ix, corpus)
    assert any(p.endswith("blob.bin") for p, _, _ in s.skipped)
    assert s.files_seen == 7 and s.files_indexed == 6
    assert Index.open(ix.path).verify().ok


def test_progress_callback_phases(ix: Index, corpus: Path) -> None:
    events: list[tuple[str, int, int | None]] = []
    build(ix, corpus, progress=lambda phase, done, total=None: events.append((phase, done, total)))
    phases = [e[0] for e in events]
    assert phases.index("files") < phases.index("embed") < phases.index("write")
    assert ("files", 6, 6) in events
    embeds = [e for e in events if e[0] == "embed"]
    assert embeds[-1][1] == embeds[-1][2]


def test_corpus_boilerplate_is_stripped_at_index_time(tmp_path: Path) -> None:
    """A navigation line on every page of a site is not content: it never reaches a chunk."""
    site = tmp_path / "site"
    site.mkdir()
    topics = ["lighthouses", "glaciers", "volcanoes", "tides", "comets"]
    for i, topic in enumerate(topics):
        body = " ".join(f"Paragraph {j} about {topic} and their history." for j in range(40))
        (site / f"page{i}.md").write_text(
            f"Home | Products | Pricing | Contact us today\n\n# {topic.title()}\n\n{body}\n"
        )
    summary = Index(tmp_path / "idx").build([site], embedder=EMB, min_tokens=20, max_tokens=200)
    assert summary.files_indexed == 5
    assert summary.furniture_lines_removed >= 5
    with Index.open(tmp_path / "idx") as idx:
        texts = [h.text for h in idx.search("glaciers history", k=50)]
    assert texts and not any("Pricing" in t for t in texts)
    assert any("glaciers" in t for t in texts)


@pytest.mark.shared_data
def test_a_typeset_manual_is_indexed_by_its_sections_without_its_contents_pages(
    shared_data: Path, tmp_path: Path
) -> None:
    """Issue #42 §6 on a real texinfo manual (R-intro.pdf, the R manual in the shared data; the
    issue saw the same on "Writing R Extensions"): chunks are headed by the sections they are in,
    never by a code comment; the table of contents and the indexes are not chunks, and a query
    naming a section finds the section, not the contents line that lists it. Hash embedder with
    BM25 (hybrid), no model."""
    pdf = shared_data / "pdf" / "R-intro.pdf"
    summary = Index(tmp_path / "idx").build([pdf], embedder=EMB)
    assert summary.contents_lines_removed >= 450  # 4 contents pages, 5 index pages
    with Index.open(tmp_path / "idx") as idx:
        chunks = idx.get_chunks(cid for _, cid in idx.chunks_of(str(pdf)))
        heads = [h for c in chunks for h in c.headings]
        # Every heading is a numbered section or an appendix: no "# comment" of an R listing
        # ("my personal functions" headed 39 chunks, "make the bins smaller, make a plot of
        # density" 11), no "# include <...>".
        odd = {h for h in heads if not re.match(r"(\d+(\.\d+)*|[A-F]\.\d+|Appendix [A-F]) \S", h)}
        assert heads and not odd, sorted(odd)
        section = {c.headings[-1] for c in chunks if c.source and c.source.page_start == 33 and c.headings}
        assert "5.9 The concatenation function, c(), with arrays" in section
        # No chunk is a contents or an index page: none holds a dot leader.
        assert not [c.text[:80] for c in chunks if re.search(r"(\. ?){6,}\d", c.text)]
        for query, title in [
            ("data permanency and removing objects", "1.11 Data permanency and removing objects"),
            ("recall and correction of previous commands", "1.9 Recall and correction of previous commands"),
        ]:
            top = idx.search(query, k=1, hybrid=True)[0]
            assert top.headings[-1] == title, (query, top.headings, top.text[:80])
            assert title in top.text


def test_guessed_encoding_is_a_warning_in_the_summary(ix: Index, corpus: Path) -> None:
    (corpus / "legacy.txt").write_bytes(("Le café de Zürich est naïve. " * 10).encode("cp1252"))
    s = build(ix, corpus)
    assert [(p, "cp1252" in m) for p, m in s.warnings] == [("corpus/legacy.txt", True)]
    assert s.to_dict()["warnings"][0]["path"] == "corpus/legacy.txt"
    idx = Index.open(ix.path)
    assert "café de Zürich" in idx.search("Zürich café", k=1)[0].text
    assert "cp1252" in next(f for f in idx.sources() if f.path == "corpus/legacy.txt").warning


def test_dedup_none_keeps_byte_identical_chunks_apart(ix: Index, tmp_path: Path) -> None:
    corpus = _twin_corpus(tmp_path / "c")
    kept = build(ix, corpus, dedup="none")
    assert kept.exact_duplicates == 0 and kept.near_duplicates == 0
    by_text: dict[str, int] = {}
    o = Index.open(ix.path)
    db = o.generation.catalog.db
    for (text,) in db.execute("SELECT text FROM chunks"):
        by_text[text] = by_text.get(text, 0) + 1
    assert max(by_text.values()) == 2  # the shared paragraph: one chunk per file, not merged
    assert all(len(h.sources) == 1 for h in o.get_chunks([r[0] for r in db.execute("SELECT id FROM chunks")]))
    merged = build(Index(tmp_path / "ix2"), corpus, dedup="exact")
    assert merged.exact_duplicates >= 1
    assert merged.chunks_total == kept.chunks_total - merged.exact_duplicates


@pytest.mark.parametrize("mode", ["none", "exact", "near"])
def test_every_mode_stores_the_normalized_content_hash(ix: Index, corpus: Path, mode: str) -> None:
    from ragbudget.input.dedup import content_hash

    build(ix, corpus, dedup=mode)
    rows = Index.open(ix.path).generation.catalog.db.execute("SELECT text, content_hash FROM chunks").fetchall()
    assert rows and all(h == content_hash(t) for t, h in rows)


def test_dedup_none_revives_a_changed_files_chunks_without_embedding(ix: Index, tmp_path: Path) -> None:
    corpus = _twin_corpus(tmp_path / "c")
    build(ix, corpus, dedup="none")
    a = corpus / "a.txt"
    a.write_text(a.read_text() + "\n" + make_text(99, n_paragraphs=1))
    s = build(ix, corpus, dedup="none")
    assert s.chunks_reused >= 2 and s.chunks_embedded <= 2
    assert Index.open(ix.path).verify().ok


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = Path(tempfile.mkdtemp(prefix="rb-sm-"))
        self.corpus = self.tmp / "c"
        self.corpus.mkdir()
        self.ix = Index(self.tmp / "ix")
        self.n = 0

    @rule(seed=st.integers(0, 50), dup=st.booleans())
    def add_file(self, seed: int, dup: bool) -> None:
        self.n += 1
        # dup=True reuses a seed shared with other files, so duplicates come and go.
        (self.corpus / f"f{self.n}.txt").write_text(make_text(seed % 3 if dup else seed, 2))

    @rule(data=st.data())
    def delete_file(self, data: st.DataObject) -> None:
        files = sorted(self.corpus.glob("*.txt"))
        if files:
            data.draw(st.sampled_from(files)).unlink()

    @rule(data=st.data(), seed=st.integers(0, 50))
    def change_file(self, data: st.DataObject, seed: int) -> None:
        files = sorted(self.corpus.glob("*.txt"))
        if files:
            data.draw(st.sampled_from(files)).write_text(make_text(seed, 3))

    @rule()
    def reindex(self) -> None:
        # Random deletions may take every file at once: removal is meant here.
        s = build(self.ix, self.corpus, embed_batch=4, allow_removal=True)
        assert s.chunks_embedded <= s.chunks_added

    @invariant()
    def ids_map_one_to_one(self) -> None:
        if not self.ix.exists:
            return
        idx = Index.open(self.ix.path)
        report = idx.verify()
        assert report.ok, report.problems
        assert report.checked["vectors"] == report.checked["chunks"]
        # Every FAISS id has exactly one lexical (FTS) row, with the chunk's text, and no other.
        gen = idx.generation
        fts = [r[0] for r in gen.catalog.db.execute("SELECT rowid FROM chunks_fts")]
        assert sorted(fts) == sorted(gen.exact.ids().tolist())
        assert report.checked["lexical_rows"] == report.checked["chunks"]
        idx.close()

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


IndexMachine.TestCase.settings = settings(
    max_examples=12,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

test_index_state_machine = IndexMachine.TestCase
