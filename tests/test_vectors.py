"""Vector stores (ragbudget.retrieval.vectors): each kind on its own, and each behind an Index."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import ragbudget.retrieval.vectors as vectors
from ragbudget.errors import ConfigError
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Index
from ragbudget.retrieval.vectors import (
    RECALL_TARGET,
    FlatStore,
    StoreReport,
    VectorStore,
    choose_store,
    load_store,
    make_store,
    measure_recall,
)

KINDS = ("hnsw", "ivf-flat", "ivf-pq")


def clustered(n: int, dim: int = 32, seed: int = 0) -> np.ndarray:
    """Unit vectors around 20 centres: structured like embeddings, unlike uniform noise."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((20, dim)).astype(np.float32)
    x = centres[rng.integers(0, 20, n)] + 0.6 * rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def exact() -> FlatStore:
    flat = FlatStore(32)
    flat.add(np.arange(3000) * 7 + 3, clustered(3000))  # ids are not row numbers
    return flat


# --- the stores on their own ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_store_reaches_the_recall_target_and_round_trips(exact: FlatStore, kind: str, tmp_path: Path) -> None:
    store = make_store(kind, 32, exact=exact)
    assert isinstance(store, VectorStore) and isinstance(exact, VectorStore)
    report = store.finalize()
    assert isinstance(report, StoreReport) and report.kind == kind and report.n == 3000
    assert report.recall_at_10 is not None and report.recall_at_10 >= RECALL_TARGET
    assert report.queries == vectors.RECALL_QUERIES
    entry = store.save(tmp_path / "s.index")
    assert entry["kind"] == kind and entry["recall_at_10"] == round(report.recall_at_10, 4)
    back = load_store(tmp_path / "s.index", entry, exact=exact)
    q = exact.vectors(exact.ids()[:50])
    a, b = store.search(q, 10), back.search(q, 10)
    assert np.array_equal(a[1], b[1])
    assert measure_recall(back, exact) == (report.recall_at_10, report.queries)
    # A stored vector finds itself first; vectors() gives the exact rows by id.
    assert np.array_equal(a[1][:, 0], exact.ids()[:50])
    assert np.array_equal(back.vectors(exact.ids()[:3]), exact.vectors(exact.ids()[:3]))


def test_ivf_pq_scores_are_exact_cosines(exact: FlatStore) -> None:
    store = make_store("ivf", 32, exact=exact)
    store.finalize()
    assert store.kind == "ivf-pq" and store.params["pq_m"] * 8 == 32
    q = clustered(5, seed=9)
    scores, ids = store.search(q, 10)
    for r in range(5):
        want = exact.vectors(ids[r]) @ q[r]
        assert np.allclose(scores[r], want, atol=1e-6)
        assert list(scores[r]) == sorted(scores[r], reverse=True)


def test_flat_store_add_remove_vectors() -> None:
    flat = FlatStore(4)
    x = np.eye(4, dtype=np.float32)
    flat.add([10, 20, 30, 40], x)
    assert flat.ntotal == 4 and flat.remove([20, 99]) == 1
    assert flat.ids().tolist() == [10, 30, 40]
    assert np.array_equal(flat.vectors([40, 10]), x[[3, 0]])
    with pytest.raises(KeyError):
        flat.vectors([20])
    with pytest.raises(ConfigError):
        flat.add([1], np.zeros((1, 5), dtype=np.float32))
    _, ids = flat.search(x[2], 1)
    assert ids.tolist() == [[30]]


def test_derived_store_edits_go_through_the_exact_store() -> None:
    flat = FlatStore(32)
    flat.add(np.arange(500), clustered(500))
    store = make_store("hnsw", 32, exact=flat)
    store.add([1000], clustered(1, seed=5))
    assert store.remove([0, 1]) == 2 and flat.ntotal == 499
    store.finalize()
    assert store.ntotal == 499 and 0 not in set(store.search(flat.vectors([2]), 5)[1][0])


def test_tiny_and_empty_stores() -> None:
    for n in (0, 1, 5, 60):
        flat = FlatStore(16)
        if n:
            flat.add(np.arange(n), clustered(n, dim=16))
        for kind in KINDS:
            store = make_store(kind, 16, exact=flat)
            report = store.finalize()
            scores, ids = store.search(clustered(2, dim=16, seed=3), 3)
            assert ids.shape == (2, 3) and report.n == n
            if n:
                assert set(ids[ids >= 0].tolist()) <= set(range(n))


def test_auto_rule() -> None:
    assert choose_store("auto", 0, 384) == "flat"
    per = 384 * 4
    assert choose_store("auto", vectors.FLAT_MAX_BYTES // per, 384) == "flat"
    assert choose_store("auto", vectors.FLAT_MAX_BYTES // per + 1, 384) == "hnsw"
    assert choose_store("auto", vectors.HNSW_MAX_BYTES // per + 1, 384) == "ivf-pq"
    assert choose_store("ivf", 5, 8) == "ivf-pq" and choose_store("hnsw", 5, 8) == "hnsw"
    with pytest.raises(ConfigError, match="store must be one of"):
        choose_store("annoy", 5, 8)


# --- behind an Index ------------------------------------------------------------------------------

EMB = HashEmbedder(dim=64)
OPTS = {"embedder": EMB, "min_tokens": 4, "max_tokens": 12}
WORDS = [a + b for a in ("ka", "lo", "mi", "nu", "pe", "ra", "su", "ti") for b in ("ba", "de", "fi", "go", "hu", "ja")]


def corpus(root: Path, n: int = 24, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        paras = [" ".join(rng.choice(WORDS, 10)) + "." for _ in range(6)]
        (root / f"doc{i}.txt").write_text("\n\n".join(paras) + f"\n\nmarker{i}zz end.\n")
    return root


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return corpus(tmp_path_factory.mktemp("docs") / "c")


@pytest.mark.parametrize("store", ["flat", "hnsw", "ivf", "ivf-flat"])
def test_index_with_each_store(docs: Path, tmp_path: Path, store: str) -> None:
    flat_ix = Index(tmp_path / "flat")
    flat_ix.build([str(docs)], store="flat", **OPTS)
    ix = Index(tmp_path / "ix")
    s = ix.build([str(docs)], store=store, **OPTS)
    kind = choose_store(store, s.chunks_total, 64)
    o = Index.open(ix.path)
    st = o.stats()
    assert st["store"] == kind and st["store_requested"] == store
    assert st["recall_at_10"] is not None and st["recall_at_10"] >= RECALL_TARGET
    report = o.verify()
    assert report.ok, report.problems
    if kind != "flat":
        assert report.checked["recall_at_10"] == st["recall_at_10"]
        assert (ix.path / f"{kind}.{s.generation}.index").is_file()
    f = Index.open(flat_ix.path)
    assert o.search("marker3zz", 1)[0].chunk_id == f.search("marker3zz", 1)[0].chunk_id
    for q in ("kaba lode", "marker17zz nugo", "tiba suja rade"):  # hash vectors tie: compare scores
        assert o.search(q, 1)[0].score == pytest.approx(f.search(q, 1)[0].score, abs=1e-5)
        assert o.search(q, 3, hybrid=True)[0].score == pytest.approx(f.search(q, 3, hybrid=True)[0].score, abs=1e-5)


def test_auto_switches_by_size_and_changing_the_store_needs_no_embedding(
    docs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ix = Index(tmp_path / "ix")
    s = ix.build([str(docs)], **OPTS)  # store="auto" is the default
    assert Index.open(ix.path).stats()["store"] == "flat"
    assert not ix.build([str(docs)], **OPTS).committed  # unchanged: nothing to write
    monkeypatch.setattr(vectors, "FLAT_MAX_BYTES", 0)  # as if the corpus had outgrown a scan
    s2 = ix.build([str(docs)], **OPTS)
    assert s2.committed and s2.chunks_embedded == 0 and s2.generation == s.generation + 1
    m = Index.open(ix.path).manifest
    assert m["approx"]["kind"] == "hnsw" and m["store"]["requested"] == "auto"
    assert m["approx"]["recall_at_10"] >= RECALL_TARGET and m["approx"]["recall_queries"] > 0
    monkeypatch.setattr(vectors, "HNSW_MAX_BYTES", 0)
    ix.build([str(docs)], **OPTS)
    o = Index.open(ix.path)
    assert o.stats()["store"] == "ivf-pq" and o.verify().ok
    assert not any(p.name.startswith("hnsw.") and p.name.endswith(f".{s.generation}.index") for p in ix.path.iterdir())
    exact = Index.open(ix.path, use_approx=False)
    for q in ("marker5zz", "kaba lode"):
        assert o.search(q, 1)[0].score == pytest.approx(exact.search(q, 1)[0].score, abs=1e-5)


def test_approx_hnsw_is_an_alias_of_store_hnsw(docs: Path, tmp_path: Path) -> None:
    ix = Index(tmp_path / "ix")
    ix.build([str(docs)], approx="hnsw", **OPTS)
    assert Index.open(ix.path).stats()["store"] == "hnsw"
    with pytest.raises(ConfigError, match="store must be one of"):
        ix.build([str(docs)], store="annoy", **OPTS)


def test_verify_re_measures_recall(docs: Path, tmp_path: Path) -> None:
    ix = Index(tmp_path / "ix")
    ix.build([str(docs)], store="ivf-flat", **OPTS)
    mpath = ix.path / "manifest.json"
    m = json.loads(mpath.read_text())
    assert m["approx"]["nlist"] >= 2
    # A store searched with fewer cells than it was tuned for: recall falls below the record.
    m["approx"]["nprobe"] = 1
    m["approx"]["recall_at_10"] = 1.0
    mpath.write_text(json.dumps(m))
    report = Index.open(ix.path).verify()
    assert not report.ok and any("recall@10" in p for p in report.problems)
    assert report.checked["recall_at_10"] < 0.98


def test_use_approx_false_searches_exactly(docs: Path, tmp_path: Path) -> None:
    ix = Index(tmp_path / "ix")
    ix.build([str(docs)], store="ivf", **OPTS)
    o = Index.open(ix.path, use_approx=False)
    o._load()
    assert o._search is o._flat


FIXTURE = Path(__file__).parent / "data" / "index_v1"


def test_index_written_by_the_previous_version_opens(tmp_path: Path) -> None:
    """tests/data/index_v1 was written by ragbudget before vector stores (commit 0489d4c) with
    approx="hnsw": a manifest with `faiss` and `hnsw` entries and no recall."""
    shutil.copytree(FIXTURE / "index", tmp_path / "ix")
    o = Index.open(tmp_path / "ix")
    st = o.stats()
    assert st["store"] == "hnsw" and st["recall_at_10"] is None and st["chunks"] == 6
    report = o.verify()
    assert report.ok, report.problems
    assert "recall_at_10" not in report.checked
    hit = o.search("guild founded by merchants", 1, embedder=HashEmbedder())[0]
    assert "guild" in hit.text
    docs = shutil.copytree(FIXTURE / "corpus", tmp_path / "corpus")
    s = Index(tmp_path / "ix").build([str(docs)], embedder=HashEmbedder(), min_tokens=5, max_tokens=30, store="hnsw")
    assert s.chunks_embedded == 0
    o = Index.open(tmp_path / "ix")
    assert o.verify().ok and o.stats()["recall_at_10"] == 1.0


def test_cli_store_option_and_stats(docs: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ragbudget.cli.commands import cli

    runner = CliRunner()
    ixdir = str(tmp_path / "ix")
    r = runner.invoke(
        cli,
        [
            "index",
            str(docs),
            "--index-dir",
            ixdir,
            "--embedder",
            "hash:64",
            "--min-tokens",
            "4",
            "--max-tokens",
            "12",
            "--store",
            "ivf",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["stats", "--index-dir", ixdir, "--json"])
    st = json.loads(r.output)
    assert st["store"] == "ivf-pq" and st["store_requested"] == "ivf"
    assert st["recall_at_10"] >= RECALL_TARGET
    r = runner.invoke(cli, ["verify", "--index-dir", ixdir])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["index", str(docs), "--index-dir", ixdir, "--store", "annoy"])
    assert r.exit_code != 0 and "annoy" in r.output


def test_mapped_flat_store_reads_rows_by_id(exact: FlatStore, tmp_path: Path) -> None:
    exact.save(tmp_path / "f.index")
    mapped = FlatStore.load(tmp_path / "f.index", mmap=True)
    ids = exact.ids()[[5, 0, 2999, 17]]
    assert mapped.ntotal == 3000 and mapped._index is None  # rows come without loading faiss
    assert np.array_equal(mapped.vectors(ids), exact.vectors(ids))
    with pytest.raises(KeyError):
        mapped.vectors([4])  # ids are 7·i + 3
    q = exact.vectors(ids)
    assert np.array_equal(mapped.search(q, 3)[1], exact.search(q, 3)[1])  # maps on demand
    assert np.array_equal(mapped.ids(), exact.ids())
