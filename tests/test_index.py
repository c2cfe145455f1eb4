"""The on-disk index: incremental runs, dedup sources, crash safety, corruption, locking, search.

Almost everything runs with the model-free :class:`HashEmbedder`; chunk sizes are kept small so a
few short files give many chunks.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ragbudget.errors import (
    ConfigError,
    IndexCorruptError,
    IndexLockedError,
    IndexMismatchError,
    IndexNotFoundError,
    InputPathError,
)
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import (
    Hit,
    Index,
    IndexSummary,
    _Lock,
)

EMB = HashEmbedder(dim=256)
OPTS = {"min_tokens": 20, "max_tokens": 60}
VOCAB = [
    f"{a}{b}"
    for a in ("ka", "lo", "mi", "nu", "pe", "ra", "su", "ti", "vo", "ze")
    for b in ("ba", "de", "fi", "go", "hu", "ja", "ke", "li", "mo", "ny")
]


def make_text(seed: int, n_paragraphs: int = 4, unique: str | None = None) -> str:
    rnd = random.Random(seed)
    paras = []
    for _ in range(n_paragraphs):
        words = [rnd.choice(VOCAB) for _ in range(rnd.randint(25, 45))]
        paras.append(" ".join(words).capitalize() + ".")
    if unique:
        paras.append(f"The unique marker {unique} appears only here.")
    return "\n\n".join(paras) + "\n"


def write_corpus(root: Path, n: int = 6, start_seed: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"doc{i}.txt").write_text(make_text(start_seed + i, unique=f"marker{i}zz"))
    return root


def build(ix: Index, corpus: Path, **kw: object) -> IndexSummary:
    opts = {"embedder": EMB, **OPTS, **kw}
    return ix.build([str(corpus)], **opts)  # type: ignore[arg-type]


def paths_in_index(ix: Index) -> set[str]:
    ix._load()
    assert ix._db is not None
    return {r[0] for r in ix._db.execute("SELECT DISTINCT path FROM sources")}


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture
def ix(tmp_path: Path) -> Index:
    return Index(tmp_path / "ix")


# --- basic build, search, summary ---------------------------------------------------------------


def test_build_search_and_summary(ix: Index, corpus: Path) -> None:
    s = build(ix, corpus)
    assert s.committed and s.generation == 1 and not s.rebuilt
    assert s.files_seen == 6 and s.files_indexed == 6
    assert s.chunks_total == s.chunks_added == s.chunks_embedded > 6
    json.dumps(s.to_dict())  # JSON-able for the CLI
    hits = Index.open(ix.path).search("marker3zz", k=3)
    assert hits and isinstance(hits[0], Hit)
    assert hits[0].sources[0].path == "corpus/doc3.txt"  # relative to the root, labelled by it
    assert "marker3zz" in hits[0].text
    src = hits[0].sources[0]
    file = Index.open(ix.path).absolute_path(src.path)
    assert file == str((corpus / "doc3.txt").resolve())
    assert Path(file).read_text()[src.start : src.end] == hits[0].text
    assert hits[0].score >= hits[-1].score
    d = hits[0].to_dict()
    assert d["sources"][0]["path"] == src.path and json.dumps(d)
    assert Index.open(ix.path).verify().ok


def test_stats_and_manifest_record_settings(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    st_ = Index.open(ix.path).stats()
    assert st_["embedder"] == "hash-256" and st_["dim"] == 256 and st_["pooling"] == "windows"
    assert st_["chunking"] == {"min_tokens": 20, "max_tokens": 60, "overlap": 0, "tokenizer": "cl100k_base"}
    m = json.loads((ix.path / "manifest.json").read_text())
    for key in ("faiss", "sqlite"):
        f = ix.path / m[key]["file"]
        assert hashlib.sha256(f.read_bytes()).hexdigest() == m[key]["sha256"]
    assert m["format_version"] == 1 and m["counts"]["chunks"] == st_["chunks"]


def test_open_missing_index_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(IndexNotFoundError, match="ragbudget index"):
        Index.open(tmp_path / "nothing")


def test_bad_options_are_config_errors(ix: Index, corpus: Path) -> None:
    with pytest.raises(ConfigError, match="dedup"):
        build(ix, corpus, dedup="fuzzy")
    with pytest.raises(ConfigError, match="approx"):
        build(ix, corpus, approx="ivf-magic")


def test_search_with_other_embedder_is_refused(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    with pytest.raises(IndexMismatchError, match="hash-256"):
        Index.open(ix.path).search("x", embedder=HashEmbedder(dim=32))
    with pytest.raises(ConfigError, match="dimension"):
        Index.open(ix.path).search_vector(np.ones(8, dtype=np.float32))


# --- incremental ---------------------------------------------------------------------------------


def test_unchanged_rerun_embeds_nothing_and_commits_nothing(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    s = build(ix, corpus)
    assert not s.committed and s.chunks_embedded == 0 and s.files_unchanged == 6
    assert s.files_indexed == 0 and s.generation == 1


def test_touched_file_is_not_re_embedded(ix: Index, corpus: Path) -> None:
    first = build(ix, corpus)
    st_ = (corpus / "doc2.txt").stat()
    os.utime(corpus / "doc2.txt", ns=(st_.st_atime_ns, st_.st_mtime_ns + 5_000_000_000))
    s = build(ix, corpus)
    assert s.chunks_embedded == 0 and s.files_unchanged == 6 and s.files_indexed == 0
    assert s.chunks_total == first.chunks_total
    # ... and the new mtime is recorded, so the next run is a pure stat again.
    assert not build(ix, corpus).committed


def test_changed_file_replaces_only_its_chunks(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    before = {
        h.chunk_id for h in Index.open(ix.path).get_chunks(range(1, 1000)) if not h.sources[0].path.endswith("doc1.txt")
    }
    text = (corpus / "doc1.txt").read_text()
    (corpus / "doc1.txt").write_text(text + "\nA brand new closing paragraph mentions quokkazz twice, quokkazz.\n")
    s = build(ix, corpus)
    assert s.files_indexed == 1 and s.files_unchanged == 5
    # Only chunks whose text changed are embedded: the earlier paragraphs keep their vectors.
    assert 1 <= s.chunks_embedded < 4
    after = Index.open(ix.path)
    kept = {h.chunk_id for h in after.get_chunks(range(1, 1000))}
    assert before <= kept
    assert "quokkazz" in after.search("quokkazz", k=1)[0].text
    assert after.verify().ok


def test_deleted_file_disappears(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    (corpus / "doc4.txt").unlink()
    s = build(ix, corpus)
    assert s.files_removed == 1 and s.chunks_removed > 0 and s.chunks_embedded == 0
    after = Index.open(ix.path)
    assert not any(p.endswith("doc4.txt") for p in paths_in_index(after))
    assert after.verify().ok


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


def test_neighbors_and_chunks_of(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    idx = Index.open(ix.path)
    path = str((corpus / "doc0.txt").resolve())
    seq = idx.chunks_of(path)
    assert len(seq) >= 3 and [s.start for s, _ in seq] == sorted(s.start for s, _ in seq)
    prev, nxt = idx.neighbors(seq[1][1])
    assert prev is not None and prev.chunk_id == seq[0][1]
    assert nxt is not None and nxt.chunk_id == seq[2][1]
    assert idx.neighbors(seq[0][1])[0] is None


def test_hnsw_option_matches_flat_on_small_index(ix: Index, corpus: Path) -> None:
    build(ix, corpus, approx="hnsw")
    approx = Index.open(ix.path)
    flat = Index.open(ix.path, use_approx=False)
    assert approx.stats()["approx"] == "hnsw" and approx.verify().ok
    for q in ("marker1zz", "kaba lode mifi", "unique marker"):
        a, f = approx.search(q, k=3), flat.search(q, k=3)
        assert a[0].chunk_id == f[0].chunk_id
        # Lower ranks may tie (hash vectors); the scores must still agree.
        assert np.allclose([h.score for h in a], [h.score for h in f], atol=1e-5)


# --- readers and writers ---------------------------------------------------------------------------


def test_reader_keeps_its_generation_while_a_writer_commits(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    reader = Index.open(ix.path)
    old = [h.chunk_id for h in reader.search("marker5zz", k=2)]
    (corpus / "doc5.txt").unlink()
    build(ix, corpus)
    assert [h.chunk_id for h in reader.search("marker5zz", k=2)] == old  # still the old generation
    reader.reload()
    assert not any("marker5zz" in h.text for h in reader.search("marker5zz", k=2))


def test_second_writer_fails_fast(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, time
            from ragbudget.retrieval.index import _Lock
            from pathlib import Path
            with _Lock(Path({str(ix.path)!r})):
                print("locked", flush=True)
                time.sleep(30)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        t = time.perf_counter()
        with pytest.raises(IndexLockedError, match=f"pid {holder.pid}"):
            build(ix, corpus)
        assert time.perf_counter() - t < 5  # fails fast, does not wait for the lock
        assert Index.open(ix.path).verify().ok  # readers are not blocked
    finally:
        holder.kill()
        holder.wait()
    build(ix, corpus)  # the lock died with its holder


def test_same_process_second_writer_is_locked_out(ix: Index, corpus: Path) -> None:
    ix.path.mkdir(parents=True)
    with _Lock(ix.path), pytest.raises(IndexLockedError):
        build(ix, corpus)


# --- corruption --------------------------------------------------------------------------------------


def _current(ix: Index, key: str) -> Path:
    m = json.loads((ix.path / "manifest.json").read_text())
    return ix.path / m[key]["file"]


def _tamper_sqlite(ix: Index, *statements: str) -> None:
    """Run SQL on the current metadata file and re-seal its manifest checksum, as a buggy writer
    would: the checksums pass, the content does not."""
    import sqlite3

    f = _current(ix, "sqlite")
    con = sqlite3.connect(f)
    for sql in statements:
        con.execute(sql)
    con.commit()
    con.close()
    m = json.loads((ix.path / "manifest.json").read_text())
    m["sqlite"].update(bytes=f.stat().st_size, sha256=hashlib.sha256(f.read_bytes()).hexdigest())
    (ix.path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("key", ["faiss", "sqlite"])
@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_damaged_file_raises_corrupt_error_naming_it(ix: Index, corpus: Path, key: str, damage: str) -> None:
    build(ix, corpus)
    f = _current(ix, key)
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        f.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 3] ^= 0x10
        f.write_bytes(bytes(data))
    with pytest.raises(IndexCorruptError, match=f.name):
        Index.open(ix.path).search("marker1zz")
    report = Index.open(ix.path).verify()
    assert not report.ok and f.name in report.problems[0]
    # The next build notices, rebuilds from the files, and the index is whole again.
    s = build(ix, corpus)
    assert s.rebuilt and "damaged" in s.rebuild_reason
    assert Index.open(ix.path).verify().ok


def test_garbage_manifest_is_a_corrupt_error(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    (ix.path / "manifest.json").write_text('{"format": "ragbudget-index", "generat')
    with pytest.raises(IndexCorruptError, match="manifest.json"):
        Index.open(ix.path)
    s = build(ix, corpus)
    assert s.rebuilt and s.generation == 2 and Index.open(ix.path).verify().ok


def test_verify_detects_id_mapping_problems(ix: Index, corpus: Path) -> None:
    """Checksums pass but the content is inconsistent (a buggy writer): verify says so."""
    build(ix, corpus)
    _tamper_sqlite(ix, "DELETE FROM chunks WHERE id = (SELECT MIN(id) FROM chunks)")
    report = Index.open(ix.path).verify()
    assert not report.ok
    assert any("without a chunk row" in p for p in report.problems)
    assert any("pointing at no chunk" in p for p in report.problems)


# --- kill -9 at random moments ---------------------------------------------------------------------

_CHILD = """
import sys
sys.path.insert(0, {tests!r})
import test_index as t
import faiss, ragbudget.input.chunking, ragbudget.input.dedup, ragbudget.input.loaders  # imported before "ready"
from ragbudget.retrieval.index import Index
print("ready", flush=True)
Index({ix!r}).build([{corpus!r}], embedder=t.EMB, batch_files=2, embed_batch=8, allow_removal=True,
                    store={store!r}, **t.OPTS)
print("done", flush=True)
"""


def _file_sets(corpus: Path) -> set[str]:
    return {str(p.resolve()) for p in corpus.glob("*.txt")}


@pytest.mark.parametrize("store", ["auto", "ivf"])  # the exact store alone, and with IVF-PQ
def test_kill_minus_9_at_random_moments_never_breaks_the_index(tmp_path: Path, store: str) -> None:
    rnd = random.Random(1234)
    corpus = write_corpus(tmp_path / "corpus", n=24)
    ixdir = tmp_path / "ix"
    build(Index(ixdir), corpus, store=store)
    code = _CHILD.format(tests=str(Path(__file__).parent), ix=str(ixdir), corpus=str(corpus), store=store)
    # Time one full run (after imports) to aim the kills inside the indexing itself.
    for i in range(24):
        (corpus / f"doc{i}.txt").write_text(make_text(1000 + i, unique=f"warm{i}zz"))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    t = time.perf_counter()
    assert child.stdout.readline().strip() == "done"
    full = time.perf_counter() - t
    child.wait()
    kills = 0
    for trial in range(10):
        before = paths_in_index(Index.open(ixdir))
        # Mutate the corpus: rewrite some files, delete one, add one.
        for p in rnd.sample(sorted(corpus.glob("*.txt")), 6):
            p.write_text(make_text(rnd.randrange(10**6), unique=f"t{trial}zz"))
        victims = sorted(corpus.glob("*.txt"))
        victims[rnd.randrange(len(victims))].unlink()
        (corpus / f"new{trial}.txt").write_text(make_text(5000 + trial))
        after = _file_sets(corpus)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(rnd.uniform(0.0, 1.1 * full))
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            kills += 1
        child.communicate()
        idx = Index.open(ixdir)
        report = idx.verify()
        assert report.ok, (trial, report.problems)
        now = paths_in_index(idx)
        assert now == before or now <= after, trial  # the old index or the new one, never a mix
        idx.close()
    assert kills >= 5  # most trials really were killed mid-run
    # Killed runs leave their deletions pending: the catch-up run may remove many files at once.
    stale = paths_in_index(Index.open(ixdir)) != _file_sets(corpus)
    s = build(Index(ixdir), corpus, allow_removal=True, store=store)
    assert Index.open(ixdir).verify().ok and paths_in_index(Index.open(ixdir)) == _file_sets(corpus)
    leftovers = [p.name for p in ixdir.iterdir() if p.name.endswith(".tmp")]
    # It commits exactly when a killed run left the index behind the folder.
    assert not leftovers and s.committed == stale


# --- property: random edit sequences keep ids and rows one-to-one ------------------------------------


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
        assert idx._db is not None and idx._flat is not None
        fts = [r[0] for r in idx._db.execute("SELECT rowid FROM chunks_fts")]
        assert sorted(fts) == sorted(idx._flat.ids().tolist())
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


# --- lexical (FTS5) search and hybrid fusion ---------------------------------------------------------


HOSTILE = [
    '"',
    '""',
    "'",
    'he said "hi',
    "AND",
    "OR NOT",
    "NEAR(a b, 2)",
    "*",
    "a*",
    "^start",
    "text: foo",
    "col:x OR",
    "(((",
    ")",
    "- -",
    "\\",
    "\x00",
    "",
    "   ",
    "?!",
    "🙂 émigré",
    'marker3zz" OR "x',
    "SELECT * FROM chunks; --",
    "{a b}",
    "a + b",
    "NOT marker3zz",
]


def test_hostile_queries_never_raise(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    o = Index.open(ix.path)
    for q in HOSTILE:
        assert isinstance(o.search_lexical(q, k=3), list)
        if q.strip():
            assert isinstance(o.search(q, k=3, hybrid=True), list)
    assert o.search_lexical('NOT marker3zz"', k=1)[0].text.count("marker3zz") == 1


@pytest.mark.parametrize("fusion", ["rrf", "score"])
def test_random_text_queries_never_raise(tmp_path_factory: pytest.TempPathFactory, fusion: str) -> None:
    import math

    from hypothesis import given

    root = tmp_path_factory.mktemp("fz")
    ix = Index(root / "ix")
    build(ix, write_corpus(root / "c", n=2))
    o = Index.open(ix.path)

    @settings(max_examples=200, deadline=None)
    @given(st.text(max_size=60))
    def run(q: str) -> None:
        hits = o.search_lexical(q, k=3)
        assert all(math.isfinite(h.score) for h in hits)
        if q.strip():
            assert all(math.isfinite(h.score) for h in o.search(q, k=3, hybrid=True, fusion=fusion))

    run()


def test_hybrid_search_finds_and_scores(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    o = Index.open(ix.path)
    assert o.has_lexical and o.stats()["lexical"] == "sqlite-fts5"
    lex = o.search_lexical("marker4zz", k=3)
    assert lex and "marker4zz" in lex[0].text and lex[0].score > 0
    dense = o.search("marker4zz", k=10)
    for fusion in ("rrf", "score"):
        hyb = o.search("marker4zz", k=10, hybrid=True, fusion=fusion)
        assert "marker4zz" in hyb[0].text
        assert [h.score for h in hyb] == sorted((h.score for h in hyb), reverse=True)
        # Fused scores stay on the dense cosine scale (selection's temperature assumes it).
        lo, hi = min(h.score for h in dense), max(h.score for h in dense)
        assert all(lo - 1e-6 <= h.score <= hi + 1e-6 for h in hyb)
    # lexical_weight=0 or hybrid=False: the dense search exactly.
    assert [h.chunk_id for h in o.search("marker4zz", k=10, hybrid=True, lexical_weight=0)] == [
        h.chunk_id for h in dense
    ]
    with pytest.raises(ConfigError):
        o.search("x", hybrid=True, fusion="max")
    with pytest.raises(ConfigError):
        o.search("x", hybrid=True, lexical_weight=1.5)


def _strip_fts(ix: Index) -> None:
    """Make the current generation look like one written before the FTS table existed."""
    import sqlite3

    f = _current(ix, "sqlite")
    con = sqlite3.connect(f)
    for t in ("chunks_fts_ai", "chunks_fts_ad", "chunks_fts_au"):
        con.execute(f"DROP TRIGGER {t}")
    con.execute("DROP TABLE chunks_fts")
    con.commit()
    con.execute("VACUUM")
    con.close()
    m = json.loads((ix.path / "manifest.json").read_text())
    m["sqlite"].update(bytes=f.stat().st_size, sha256=hashlib.sha256(f.read_bytes()).hexdigest())
    m.pop("lexical", None)
    m["counts"].pop("lexical_rows", None)
    (ix.path / "manifest.json").write_text(json.dumps(m))


def test_index_without_fts_table_opens_and_is_upgraded(
    ix: Index, corpus: Path, caplog: pytest.LogCaptureFixture
) -> None:
    build(ix, corpus)
    _strip_fts(ix)
    o = Index.open(ix.path)
    assert not o.has_lexical
    assert o.verify().ok and o.verify().checked["lexical_rows"] is None
    with caplog.at_level("WARNING", logger="ragbudget.retrieval.index"):
        hits = o.search("marker2zz", k=3, hybrid=True)
    assert "marker2zz" in hits[0].text
    assert "without the lexical (FTS5) table" in caplog.text and "ragbudget index" in caplog.text
    assert "marker2zz" in o.search_lexical("marker2zz", k=1)[0].text
    o.close()
    # The next run stores the table even though no file changed; nothing is re-embedded.
    s = build(ix, corpus)
    assert s.committed and s.chunks_embedded == 0 and s.generation == 2
    o = Index.open(ix.path)
    assert o.has_lexical and o.verify().ok
    assert o.verify().checked["lexical_rows"] == o.stats()["chunks"]


def test_no_fts5_falls_back_to_dense(
    ix: Index, corpus: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import ragbudget.retrieval.lexical as mod

    monkeypatch.setattr(mod, "_fts5_ok", False)
    monkeypatch.setattr(mod, "_fts5_warned", False)
    with caplog.at_level("WARNING", logger="ragbudget.retrieval.index"):
        build(ix, corpus)
    assert "has no FTS5" in caplog.text
    o = Index.open(ix.path)
    assert o.stats()["lexical"] is None and not o.has_lexical
    assert [h.chunk_id for h in o.search("marker1zz", k=5, hybrid=True)] == [
        h.chunk_id for h in o.search("marker1zz", k=5)
    ]
    assert o.search_lexical("marker1zz") == [] and o.verify().ok
    o.close()


def test_index_updated_without_fts5_is_repaired_by_the_next_run(
    ix: Index, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ragbudget.retrieval.lexical as mod

    build(ix, corpus)
    monkeypatch.setattr(mod, "_fts5_ok", False)
    (corpus / "doc0.txt").write_text(make_text(99, unique="fresh7zz"))
    (corpus / "doc1.txt").unlink()
    s = build(ix, corpus)  # a Python without FTS5: triggers dropped, the table goes stale
    assert s.committed and Index.open(ix.path).stats()["lexical"] is None
    monkeypatch.setattr(mod, "_fts5_ok", True)
    o = Index.open(ix.path)
    assert not o.has_lexical  # the stale table is not trusted: built in memory instead
    assert "fresh7zz" in o.search_lexical("fresh7zz", k=1)[0].text
    assert not o.search_lexical("marker1zz", k=1)
    o.close()
    (corpus / "doc2.txt").write_text(make_text(98))
    build(ix, corpus)  # FTS5 again: the table is rebuilt from the chunks
    o = Index.open(ix.path)
    report = o.verify()
    assert o.has_lexical and report.ok and report.checked["lexical_rows"] == report.checked["chunks"]
    assert "fresh7zz" in o.search_lexical("fresh7zz", k=1)[0].text


def test_verify_detects_fts_out_of_sync(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    _tamper_sqlite(
        ix,
        "DELETE FROM chunks_fts WHERE rowid = (SELECT MIN(id) FROM chunks)",
        "INSERT INTO chunks_fts(rowid, text) VALUES (999999, 'stray')",
        "UPDATE chunks_fts SET text = 'changed' WHERE rowid = (SELECT MAX(id) FROM chunks)",
    )
    problems = " | ".join(Index.open(ix.path).verify().problems)
    assert "without a lexical (FTS) row" in problems
    assert "lexical (FTS) row(s) without a chunk row" in problems
    assert "text differs" in problems


# --- roots: a typo never empties an index; runs add; removal is scoped and guarded --------------


def chunk_count(ix: Index) -> int:
    return int(Index.open(ix.path).stats()["chunks"])


def test_missing_root_is_an_error_and_changes_nothing(ix: Index, corpus: Path, tmp_path: Path) -> None:
    build(ix, corpus)
    before, gen = chunk_count(ix), Index.open(ix.path).stats()["generation"]
    files_before = sorted(p.name for p in ix.path.iterdir())
    with pytest.raises(InputPathError, match="corpuz.*no such file") as err:
        ix.build([str(tmp_path / "corpuz")], embedder=EMB, **OPTS)
    assert isinstance(err.value, ConfigError) and "unchanged" in str(err.value)
    assert chunk_count(ix) == before and Index.open(ix.path).stats()["generation"] == gen
    assert sorted(p.name for p in ix.path.iterdir()) == files_before
    # One good path next to a missing one: still nothing is done.
    with pytest.raises(InputPathError):
        ix.build([str(corpus), str(tmp_path / "nope.txt")], embedder=EMB, **OPTS)
    assert Index.open(ix.path).stats()["generation"] == gen


def test_missing_root_into_a_new_folder_creates_nothing(tmp_path: Path) -> None:
    target = tmp_path / "new-index"
    with pytest.raises(InputPathError, match="no index was created"):
        Index(target).build([str(tmp_path / "missing")], embedder=EMB)
    assert not target.exists()


def test_special_and_unreadable_roots_are_errors(tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(InputPathError, match="not a file or folder"):
        Index(tmp_path / "ix").build([str(tmp_path / "pipe")], embedder=EMB)
    # Tests may run as root, who reads everything: refuse the folder the way the kernel would.
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, **kw: False if str(p) == str(corpus) else real_access(p, mode, **kw)
    )
    with pytest.raises(InputPathError, match="permission denied"):
        Index(tmp_path / "ix").build([str(corpus)], embedder=EMB)
    assert not (tmp_path / "ix").exists()


def test_indexing_a_second_folder_adds_to_the_first(ix: Index, tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a", n=3)
    b = write_corpus(tmp_path / "b", n=2, start_seed=50)
    build(ix, a)
    s = build(ix, b)
    assert s.files_added == 2 and s.files_removed == 0 and s.files_kept == 3
    idx = Index.open(ix.path)
    shown = {f.path for f in idx.sources()}
    assert shown == {"a/doc0.txt", "a/doc1.txt", "a/doc2.txt", "b/doc0.txt", "b/doc1.txt"}
    assert idx.roots() == ["a", "b"] and idx.stats()["roots"] == ["a", "b"]
    assert "marker1zz" in idx.search("marker1zz", k=1)[0].text
    assert idx.verify().ok


def test_removal_is_scoped_to_the_given_roots(ix: Index, tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a", n=6)
    b = write_corpus(tmp_path / "b", n=6, start_seed=50)
    build(ix, a)
    build(ix, b)
    (a / "doc1.txt").unlink()
    (b / "doc2.txt").unlink()
    s = build(ix, b)  # only b's vanished file goes; a's is kept until a is indexed again
    assert s.files_removed == 1 and s.files_kept == 6
    shown = {f.path for f in Index.open(ix.path).sources()}
    assert "b/doc2.txt" not in shown and "a/doc1.txt" in shown
    s = build(ix, a)
    assert s.files_removed == 1 and "a/doc1.txt" not in {f.path for f in Index.open(ix.path).sources()}
    # A single-file root scopes removal to that file.
    single = tmp_path / "single.txt"
    single.write_text(make_text(99, unique="singlezz"))
    build(ix, single)
    assert "single.txt" in {f.path for f in Index.open(ix.path).sources()}
    assert Index.open(ix.path).verify().ok


def test_prune_mirrors_exactly_the_given_paths(ix: Index, tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a", n=2)
    b = write_corpus(tmp_path / "b", n=2, start_seed=50)
    build(ix, a)
    build(ix, b)
    s = build(ix, b, prune=True)
    assert s.files_removed == 2 and s.files_kept == 0
    idx = Index.open(ix.path)
    assert {f.path for f in idx.sources()} == {"b/doc0.txt", "b/doc1.txt"}
    assert idx.roots() == ["b"]  # a root left without files is forgotten
    assert idx.verify().ok


def test_mass_removal_needs_an_explicit_flag(ix: Index, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", n=20)
    build(ix, corpus)
    gen = Index.open(ix.path).stats()["generation"]
    for i in range(6):  # 6 files (> 5) and 30 % (> 20 %)
        (corpus / f"doc{i}.txt").unlink()
    with pytest.raises(ConfigError, match=r"remove 6 of the 20 indexed file\(s\).*--allow-removal"):
        build(ix, corpus)
    assert Index.open(ix.path).stats()["generation"] == gen and chunk_count(ix) > 0
    s = build(ix, corpus, allow_removal=True)
    assert s.files_removed == 6 and s.committed
    # A few deletions are everyday editing: no flag needed.
    (corpus / "doc6.txt").unlink()
    assert build(ix, corpus).files_removed == 1


def test_emptied_root_never_empties_the_index(ix: Index, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "mnt", n=2)
    build(ix, corpus)
    for p in corpus.iterdir():  # an unmounted drive: the folder is there, its files are not
        p.unlink()
    before = chunk_count(ix)
    with pytest.raises(ConfigError, match="remove all 2 indexed"):
        build(ix, corpus)
    assert chunk_count(ix) == before
    s = build(ix, corpus, prune=True)  # the explicit mirror may empty it
    assert s.files_removed == 2 and s.chunks_total == 0


def test_rebuild_keeps_every_root_and_needs_them_all(ix: Index, tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a", n=2)
    b = write_corpus(tmp_path / "b", n=2, start_seed=50)
    build(ix, a)
    build(ix, b)
    s = build(ix, b, rebuild=True)
    assert s.rebuilt and s.files_indexed == 4 and s.files_removed == 0
    assert len(Index.open(ix.path).sources()) == 4
    # A settings change rebuilds too: still every root.
    s = build(ix, b, max_tokens=80, rechunk=True)
    assert s.rebuilt and len(Index.open(ix.path).sources()) == 4
    shutil.rmtree(a)
    with pytest.raises(InputPathError, match="'a'"):
        build(ix, b, max_tokens=80, rebuild=True)
    s = build(ix, b, max_tokens=80, rebuild=True, prune=True)
    assert {f.path for f in Index.open(ix.path).sources()} == {"b/doc0.txt", "b/doc1.txt"}


def test_paths_are_shown_relative_to_their_root(ix: Index, tmp_path: Path) -> None:
    notes = tmp_path / "home" / "me" / "notes"
    (notes / "deep").mkdir(parents=True)
    (notes / "deep" / "guide.txt").write_text(make_text(3, unique="guidezz"))
    (notes / "top.txt").write_text(make_text(4))
    (notes / "blob.bin").write_bytes(b"\x00" * 64)
    s = build(ix, notes)
    private = str(tmp_path)
    assert private not in json.dumps(s.to_dict())
    idx = Index.open(ix.path)
    hit = idx.search("guidezz", k=1)[0]
    assert hit.sources[0].path == "notes/deep/guide.txt"
    for h in idx.search("kaba lode", k=10) + idx.get_chunks(range(1, 100)):
        assert private not in json.dumps(h.to_dict())
    assert private not in json.dumps([f.to_dict() for f in idx.sources()])
    # Lookups take the display path (and still the absolute one).
    seq = idx.chunks_of("notes/deep/guide.txt")
    assert seq and seq == idx.chunks_of(str((notes / "deep" / "guide.txt").resolve()))
    assert idx.neighbors(seq[0][1], path="notes/deep/guide.txt")[0] is None
    assert idx.absolute_path("notes/deep/guide.txt") == str((notes / "deep" / "guide.txt").resolve())
    assert idx.absolute_path("elsewhere/x.txt") is None
    # The local opt-in: absolute paths.
    local = Index.open(ix.path, absolute_paths=True)
    assert local.search("guidezz", k=1)[0].sources[0].path == str((notes / "deep" / "guide.txt").resolve())


def test_roots_with_the_same_name_get_distinct_labels(ix: Index, tmp_path: Path) -> None:
    one = write_corpus(tmp_path / "x" / "docs", n=1)
    two = write_corpus(tmp_path / "y" / "docs", n=1, start_seed=40)
    build(ix, one)
    build(ix, two)
    assert {f.path for f in Index.open(ix.path).sources()} == {"docs/doc0.txt", "docs-2/doc0.txt"}
    # A folder inside a recorded root adds no root: paths keep their form.
    sub = one / "sub"
    sub.mkdir()
    (sub / "n.txt").write_text(make_text(77))
    build(ix, sub)
    assert "docs/sub/n.txt" in {f.path for f in Index.open(ix.path).sources()}


def _drop_roots(ix: Index) -> None:
    """Make the current generation look like one written before roots were recorded."""
    import sqlite3

    m = json.loads((ix.path / "manifest.json").read_text())
    db_path = ix.path / m["sqlite"]["file"]
    con = sqlite3.connect(db_path)
    con.execute("DROP TABLE roots")
    for col in ("n_pages", "warning"):  # the files table of that time (SQLite >= 3.35)
        con.execute(f"ALTER TABLE files DROP COLUMN {col}")
    con.commit()
    con.close()
    m["sqlite"]["bytes"] = db_path.stat().st_size
    m["sqlite"]["sha256"] = hashlib.sha256(db_path.read_bytes()).hexdigest()
    m.pop("roots", None)
    (ix.path / "manifest.json").write_text(json.dumps(m))


def test_index_without_roots_opens_with_a_fallback_and_is_upgraded(
    ix: Index, corpus: Path, caplog: pytest.LogCaptureFixture
) -> None:
    build(ix, corpus)
    _drop_roots(ix)
    with caplog.at_level("WARNING", logger="ragbudget.retrieval.index"):
        idx = Index.open(ix.path)
        assert idx.search("marker2zz", k=1)[0].sources[0].path == "corpus/doc2.txt"
        assert {f.path for f in idx.sources()} == {f"corpus/doc{i}.txt" for i in range(6)}
    assert any("records no roots" in r.getMessage() for r in caplog.records)
    assert idx.verify().ok
    s = build(ix, corpus)  # nothing changed on disk, but the roots get recorded
    assert s.committed and s.files_unchanged == 6 and s.chunks_embedded == 0
    caplog.clear()
    with caplog.at_level("WARNING", logger="ragbudget.retrieval.index"):
        assert Index.open(ix.path).roots() == ["corpus"]
        assert all(f.pages is None and f.chunks > 0 for f in Index.open(ix.path).sources())
    assert not any("records no roots" in r.getMessage() for r in caplog.records)


def test_sources_lists_files_with_chunk_counts(ix: Index, corpus: Path) -> None:
    (corpus / "blob.bin").write_bytes(b"\x00\x01" * 50)
    (corpus / "paged.txt").write_text("first page text here\fsecond page text here\f")
    build(ix, corpus)
    files = {f.path: f for f in Index.open(ix.path).sources()}
    assert files["corpus/doc0.txt"].status == "indexed" and files["corpus/doc0.txt"].chunks >= 3
    assert files["corpus/doc0.txt"].pages is None
    assert files["corpus/paged.txt"].pages == 2
    assert files["corpus/blob.bin"].status == "skipped" and files["corpus/blob.bin"].reason == "unsupported"


# --- a killed build resumes from its checkpoint ------------------------------------------------------

_KILLED_CHILD = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import test_index as t
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Index

class Dies(HashEmbedder):
    calls = 0
    def embed(self, texts, **kw):
        Dies.calls += 1
        if Dies.calls == 3:  # two batches are embedded and checkpointed, the third never ends
            os.kill(os.getpid(), signal.SIGKILL)
        return super().embed(texts, **kw)

Index({ix!r}).build([{corpus!r}], embedder=Dies(dim=256), embed_batch=8, **t.OPTS)
"""


def test_killed_first_build_resumes_without_re_embedding(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=12)
    ixdir = tmp_path / "ix"
    code = _KILLED_CHILD.format(tests=str(Path(__file__).parent), ix=str(ixdir), corpus=str(corpus))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert not (ixdir / "manifest.json").exists() and (ixdir / "embed.checkpoint").is_file()
    s = build(Index(ixdir), corpus, embed_batch=8)
    assert s.chunks_resumed == 16 and s.chunks_reused == 16
    assert s.chunks_embedded == s.chunks_total - 16 > 0
    assert not (ixdir / "embed.checkpoint").exists()  # spent once committed
    clean = tmp_path / "clean"
    ref = build(Index(clean), corpus, embed_batch=8)
    assert ref.chunks_total == s.chunks_total
    got, want = Index.open(ixdir), Index.open(clean)
    assert got.verify().ok
    ids = range(1, s.chunks_total + 1)
    assert [h.to_dict() for h in got.get_chunks(ids)] == [h.to_dict() for h in want.get_chunks(ids)]
    got._load()
    want._load()
    for i in ids:
        assert np.array_equal(got._flat.vectors([i]), want._flat.vectors([i]))


def test_checkpoint_of_another_embedder_is_dropped(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=3)
    ixdir = tmp_path / "ix"
    code = _KILLED_CHILD.format(tests=str(Path(__file__).parent), ix=str(ixdir), corpus=str(corpus))
    code = code.replace("embed_batch=8", "embed_batch=2")
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (ixdir / "embed.checkpoint").is_file()
    s = Index(ixdir).build([str(corpus)], embedder=HashEmbedder(dim=64), embed_batch=2, **OPTS)
    assert s.chunks_resumed == 0 and s.chunks_embedded == s.chunks_total
    assert not (ixdir / "embed.checkpoint").exists()


def test_guessed_encoding_is_a_warning_in_the_summary(ix: Index, corpus: Path) -> None:
    (corpus / "legacy.txt").write_bytes(("Le café de Zürich est naïve. " * 10).encode("cp1252"))
    s = build(ix, corpus)
    assert [(p, "cp1252" in m) for p, m in s.warnings] == [("corpus/legacy.txt", True)]
    assert s.to_dict()["warnings"][0]["path"] == "corpus/legacy.txt"
    idx = Index.open(ix.path)
    assert "café de Zürich" in idx.search("Zürich café", k=1)[0].text
    assert "cp1252" in next(f for f in idx.sources() if f.path == "corpus/legacy.txt").warning


def test_files_under_an_unreadable_folder_are_kept(ix: Index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = write_corpus(tmp_path / "c", n=2)
    write_corpus(corpus / "sub", n=2, start_seed=30)
    build(ix, corpus)
    real_scandir = os.scandir

    def refusing(path):  # type: ignore[no-untyped-def]
        if str(path).endswith("sub"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    s = build(ix, corpus)
    assert s.files_removed == 0 and any(r == "unreadable" for _, r, _ in s.skipped)
    assert {"c/sub/doc0.txt", "c/sub/doc1.txt"} <= {f.path for f in Index.open(ix.path).sources()}


# --- dedup: one hash function for every mode ----------------------------------------------------------


def _twin_corpus(root: Path) -> Path:
    """Two files sharing one byte-identical paragraph, plus a file of their own each."""
    root.mkdir(parents=True, exist_ok=True)
    shared = make_text(77, n_paragraphs=1)
    (root / "a.txt").write_text(make_text(1, n_paragraphs=2) + "\n" + shared)
    (root / "b.txt").write_text(make_text(2, n_paragraphs=2) + "\n" + shared)
    return root


def test_dedup_none_keeps_byte_identical_chunks_apart(ix: Index, tmp_path: Path) -> None:
    corpus = _twin_corpus(tmp_path / "c")
    kept = build(ix, corpus, dedup="none")
    assert kept.exact_duplicates == 0 and kept.near_duplicates == 0
    by_text: dict[str, int] = {}
    o = Index.open(ix.path)
    o._load()
    assert o._db is not None
    for (text,) in o._db.execute("SELECT text FROM chunks"):
        by_text[text] = by_text.get(text, 0) + 1
    assert max(by_text.values()) == 2  # the shared paragraph: one chunk per file, not merged
    assert all(len(h.sources) == 1 for h in o.get_chunks([r[0] for r in o._db.execute("SELECT id FROM chunks")]))
    merged = build(Index(tmp_path / "ix2"), corpus, dedup="exact")
    assert merged.exact_duplicates >= 1
    assert merged.chunks_total == kept.chunks_total - merged.exact_duplicates


@pytest.mark.parametrize("mode", ["none", "exact", "near"])
def test_every_mode_stores_the_normalized_content_hash(ix: Index, corpus: Path, mode: str) -> None:
    from ragbudget.input.dedup import content_hash

    build(ix, corpus, dedup=mode)
    o = Index.open(ix.path)
    o._load()
    assert o._db is not None
    rows = o._db.execute("SELECT text, content_hash FROM chunks").fetchall()
    assert rows and all(h == content_hash(t) for t, h in rows)


@pytest.mark.parametrize(("first", "then"), [("none", "exact"), ("exact", "none"), ("none", "near")])
def test_changing_dedup_reuses_every_vector(ix: Index, tmp_path: Path, first: str, then: str) -> None:
    corpus = _twin_corpus(tmp_path / "c")
    build(ix, corpus, dedup=first)
    s = build(ix, corpus, dedup=then, rechunk=True)
    assert s.rebuilt and "dedup" in s.rebuild_reason
    assert s.chunks_embedded == 0 and s.chunks_reused == s.chunks_added
    assert Index.open(ix.path).verify().ok


def test_dedup_none_revives_a_changed_files_chunks_without_embedding(ix: Index, tmp_path: Path) -> None:
    corpus = _twin_corpus(tmp_path / "c")
    build(ix, corpus, dedup="none")
    a = corpus / "a.txt"
    a.write_text(a.read_text() + "\n" + make_text(99, n_paragraphs=1))
    s = build(ix, corpus, dedup="none")
    assert s.chunks_reused >= 2 and s.chunks_embedded <= 2
    assert Index.open(ix.path).verify().ok


# --- a file skipped for a missing dependency is retried once it is installed -------------------

_RUN_WITH_DOCX = textwrap.dedent(
    """
    import json, sys
    if sys.argv[3] == "absent":
        # python-docx uninstalled, as far as this process can tell: `import docx` raises ImportError.
        sys.modules["docx"] = None
    from ragbudget.retrieval.embed import HashEmbedder
    from ragbudget.retrieval.index import Index
    s = Index(sys.argv[1]).build([sys.argv[2]], embedder=HashEmbedder(dim=64), min_tokens=20, max_tokens=120)
    print(json.dumps(s.to_dict()))
    """
)


def _build_in_child(ix: Index, corpus: Path, docx: str) -> dict:  # type: ignore[type-arg]
    out = subprocess.run(
        [sys.executable, "-c", _RUN_WITH_DOCX, str(ix.path), str(corpus), docx],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("touch", [False, True])
def test_a_file_skipped_for_a_missing_extra_is_retried_once_it_is_installed(
    ix: Index, tmp_path: Path, touch: bool
) -> None:
    pytest.importorskip("docx")
    corpus = write_corpus(tmp_path / "c", n=2)
    shutil.copy(Path(__file__).parent / "data" / "formats" / "social-contract.docx", corpus / "contract.docx")
    first = _build_in_child(ix, corpus, "absent")
    assert first["files_added"] == 2
    assert [(Path(s["path"]).name, s["reason"]) for s in first["skipped"]] == [("contract.docx", "missing_dependency")]
    assert "ragbudget[office]" in first["skipped"][0]["detail"]
    # Still missing: the skip stands, and nothing is re-read or written.
    still = _build_in_child(ix, corpus, "absent")
    assert not still["committed"] and still["files_unchanged"] == 2 and len(still["skipped"]) == 1
    if touch:  # a touched file is the same file: its skip stood on that alone before
        os.utime(corpus / "contract.docx", ns=(time.time_ns(), time.time_ns() + 10**9))
    # Installed: read now, though the file is unchanged.
    after = _build_in_child(ix, corpus, "present")
    assert after["committed"] and after["files_added"] == 1 and after["skipped"] == []
    assert any(f.path.endswith("contract.docx") and f.status == "indexed" for f in Index.open(ix.path).sources())
    assert Index.open(ix.path).search("Debian will remain 100% free", k=1)[0].sources[0].path.endswith(".docx")
    assert not _build_in_child(ix, corpus, "present")["committed"]  # and once only
