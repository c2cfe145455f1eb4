"""Vector stores (ragbudget.retrieval.vectors): each kind on its own, and each behind an Index."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import ragbudget.retrieval.vectors as vectors
from ragbudget.errors import ConfigError, IndexCorruptError
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
    assert report.tuned_on == "own vectors" and report.target == vectors.TUNE_TARGET  # no questions given
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
        # fewer vectors than k, tuned on questions: nothing to miss
        hnsw = make_store("hnsw", 16, exact=flat)
        report = hnsw.finalize(questions=clustered(3, dim=16, seed=4))  # type: ignore[call-arg]
        assert report.n == n and (n < 2 or report.questions_recall == 1.0)


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
    assert st["recall_at_10"] is not None
    if kind == "hnsw":  # tuned on pseudo-questions: they reach 0.99, or the ladder ended first
        assert st["recall_tuned_on"] == "pseudo-questions"
        assert st["recall_at_10_questions"] >= 0.99 or o.manifest["approx"]["ef_search"] == vectors.EF_LADDER[-1]
    else:
        assert st["recall_at_10"] >= RECALL_TARGET and st["recall_at_10_questions"] is None
    report = o.verify()
    assert report.ok, report.problems
    if kind != "flat":
        assert report.checked["recall_at_10"] == st["recall_at_10"]
        approx = o.manifest["approx"]
        assert approx["tuned_on"] == ("pseudo-questions" if kind == "hnsw" else "own vectors")
        assert o.manifest["store"]["tuned_on"] == approx["tuned_on"]
        assert ("recall_at_10_questions" in approx) == (kind == "hnsw")
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
    reached = m["approx"]["recall_at_10_questions"] >= 0.99 or m["approx"]["ef_search"] == vectors.EF_LADDER[-1]
    assert reached and m["approx"]["recall_queries"] > 0
    monkeypatch.setattr(vectors, "HNSW_MAX_BYTES", 0)
    ix.build([str(docs)], **OPTS)
    o = Index.open(ix.path)
    assert o.stats()["store"] == "ivf-pq" and o.verify().ok
    assert not any(p.name.startswith("hnsw.") and p.name.endswith(f".{s.generation}.index") for p in ix.path.iterdir())
    exact = Index.open(ix.path, use_approx=False)
    for q in ("marker5zz", "kaba lode"):
        assert o.search(q, 1)[0].score == pytest.approx(exact.search(q, 1)[0].score, abs=1e-5)


def test_an_unknown_store_is_refused(docs: Path, tmp_path: Path) -> None:
    ix = Index(tmp_path / "ix")
    with pytest.raises(ConfigError, match="store must be one of"):
        ix.build([str(docs)], store="annoy", **OPTS)
    assert not ix.path.exists()


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
    gen = Index.open(ix.path, use_approx=False).generation
    assert gen.search is gen.exact


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
    # One line from the build, naming the stores it knows and where another one comes from.
    assert "store must be one of auto, flat, hnsw" in r.output and "ragbudget.stores" in r.output
    assert "Traceback" not in r.output


# --- a store from another package: the ragbudget.stores entry points --------------------------------

_TINY = '''
"""A brute-force store over its own copy of the vectors, in a numpy file (no pickle)."""
import numpy as np
from ragbudget.retrieval.vectors import StoreReport, measure_recall


class TinyStore:
    kind = "tiny"

    def __init__(self, dim, *, exact=None, **params):
        self.dim, self.exact = dim, exact
        self._ids, self._x = np.zeros(0, np.int64), np.zeros((0, dim), np.float32)

    @property
    def ntotal(self):
        return len(self._ids)

    def add(self, ids, vectors):
        self._ids = np.concatenate([self._ids, np.asarray(ids, np.int64).reshape(-1)])
        self._x = np.vstack([self._x, np.asarray(vectors, np.float32).reshape(-1, self.dim)])

    def remove(self, ids):
        keep = ~np.isin(self._ids, np.asarray(ids, np.int64))
        n = int((~keep).sum())
        self._ids, self._x = self._ids[keep], self._x[keep]
        return n

    def search(self, queries, k):
        q = np.asarray(queries, np.float32).reshape(-1, self.dim)
        s = q @ self._x.T
        top = np.argsort(-s, axis=1, kind="stable")[:, :k]
        scores = np.full((len(q), k), -np.inf, np.float32)
        ids = np.full((len(q), k), -1, np.int64)
        scores[:, : top.shape[1]] = np.take_along_axis(s, top, axis=1)
        ids[:, : top.shape[1]] = self._ids[top]
        return scores, ids

    def vectors(self, ids):
        pos = {int(i): j for j, i in enumerate(self._ids)}
        return self._x[[pos[int(i)] for i in np.asarray(ids).reshape(-1)]]

    def ids(self):
        return self._ids.copy()

    def finalize(self):
        self._ids = self.exact.ids()
        self._x = self.exact.vectors(self._ids)
        recall, n = measure_recall(self, self.exact)
        return StoreReport(self.kind, self.ntotal, {}, recall, n)

    def save(self, path):
        with open(path, "wb") as f:
            np.savez(f, ids=self._ids, x=self._x)
        return {"kind": self.kind, "recall_at_10": 1.0, "recall_queries": 10}

    @classmethod
    def load(cls, path, entry, *, exact=None):
        with np.load(path, allow_pickle=False) as z:
            store = cls(int(z["x"].shape[1]), exact=exact)
            store._ids, store._x = z["ids"], z["x"]
        return store
'''

_PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "ragbudget-tinystore"
version = "0.1"

[project.entry-points."ragbudget.stores"]
tiny = "tinystore:TinyStore"

[tool.setuptools]
packages = ["tinystore"]
"""

_USE_TINY = """
import json, sys
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Index
from ragbudget.retrieval.vectors import store_names
ix, docs = sys.argv[1], sys.argv[2]
if sys.argv[3] == "build":
    s = Index(ix).build([docs], embedder=HashEmbedder(dim=64), min_tokens=4, max_tokens=12, store="tiny")
    assert s.committed, s
o, exact = Index.open(ix), Index.open(ix, use_approx=False)
for q in ("marker3zz", "kaba lode mifi"):  # scores agree (hash vectors tie: ids may swap)
    got, want = o.search(q, k=3), exact.search(q, k=3)
    assert [round(h.score, 5) for h in got] == [round(h.score, 5) for h in want], (got, want)
    assert got[0].score > 0 and "marker3zz" in o.search("marker3zz", k=1)[0].text
print(json.dumps({"names": list(store_names()), "stats": o.stats(), "ok": o.verify().ok,
                  "store": type(o.generation.search).__name__}))
"""


def _install_tiny(tmp_path: Path) -> dict[str, str]:
    """The tiny store's package pip-installed into a folder of this test; the environment of a
    child process that sees it."""
    from _plugins import install_plugin, plugin_env

    files = {"pyproject.toml": _PYPROJECT, "tinystore/__init__.py": _TINY}
    return plugin_env(install_plugin(tmp_path / "pkg", tmp_path / "site", files))


def test_a_store_from_another_package_is_held_by_postgresql(docs: Path, tmp_path: Path, pg_url: str) -> None:
    """The same store on an index in PostgreSQL: built by the writer, its saved bytes kept in the
    database with their checksum, loaded back by a reader in another process; damaged bytes are
    refused in one line."""
    import subprocess
    import sys

    import psycopg

    env = _install_tiny(tmp_path)

    def child(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-c", _USE_TINY, pg_url, str(docs), *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)

    built = child("build")
    assert built.returncode == 0, built.stderr
    got = json.loads(built.stdout)
    assert got["ok"] and got["store"] == "TinyStore" and got["stats"]["store"] == "tiny"
    reread = child("read")
    assert reread.returncode == 0 and json.loads(reread.stdout)["store"] == "TinyStore", reread.stderr
    with psycopg.connect(pg_url.replace("postgresql://postgres:@", "postgresql://postgres@"), autocommit=True) as conn:
        (n,) = conn.execute("SELECT count(*) FROM ragbudget.search_stores").fetchone()  # type: ignore[misc]
        assert n == 1
        conn.execute("UPDATE ragbudget.search_stores SET data = data || '\\x00'::bytea")
    damaged = child("read")
    assert damaged.returncode != 0 and "tiny store of generation 1" in damaged.stderr
    assert "fails its sha256 checksum" in damaged.stderr


def test_a_store_from_another_package_is_found_through_its_entry_point(docs: Path, tmp_path: Path) -> None:
    """A package installed with a ``ragbudget.stores`` entry point (pip install --target into a
    folder of this test, put on the path of child processes only) is a store like the built-in
    ones: ``store="tiny"`` builds it, a reader loads it back, ``verify`` checks it; without the
    package, the index still opens on its exact store and says what is missing."""
    import subprocess
    import sys

    env = _install_tiny(tmp_path)
    ix = tmp_path / "ix"

    def child(*args: str, with_env: dict[str, str] = env) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", _USE_TINY, str(ix), str(docs), *args],
            capture_output=True,
            text=True,
            env=with_env,
            timeout=300,
        )

    built = child("build")
    assert built.returncode == 0, built.stderr
    got = json.loads(built.stdout)
    assert got["names"][-1] == "tiny" and got["ok"] and got["store"] == "TinyStore"
    assert got["stats"]["store"] == "tiny" and got["stats"]["recall_at_10"] == 1.0
    assert (ix / "tiny.1.index").is_file()
    reread = child("read")  # another process: loaded back through the entry point
    assert reread.returncode == 0 and json.loads(reread.stdout)["store"] == "TinyStore", reread.stderr
    # The CLI takes it too (`--store` is not limited to the built-in names).
    cli_ix = tmp_path / "cli-ix"
    args = ["index", str(docs), "--index-dir", str(cli_ix), "--embedder", "hash:64", "--min-tokens", "4"]
    by_cli = subprocess.run(
        [sys.executable, "-m", "ragbudget", *args, "--max-tokens", "12", "--store", "tiny", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert by_cli.returncode == 0, by_cli.stdout + by_cli.stderr
    assert (cli_ix / "tiny.1.index").is_file()
    # Without the package: the search store cannot be read (a clear error naming it), the exact one can.
    Index.open(ix, use_approx=False).verify()
    with pytest.raises(IndexCorruptError, match="'tiny' that no installed package provides"):
        Index.open(ix).search("guild", k=1, embedder=HashEmbedder(dim=64))
    assert Index.open(ix, use_approx=False).search("guild", k=1, embedder=HashEmbedder(dim=64))
    assert "tiny" not in vectors.store_names()
