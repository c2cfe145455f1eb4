"""The Ray executor (ragbudget.retrieval.executors.RayExecutor): the index it writes is the local executor's,
and its failures are one-line errors that leave the previous generation in place.

Runs on one small local Ray cluster shared by the whole session (``ray_cluster`` in conftest.py,
2 CPUs). The model-free :class:`HashEmbedder` keeps most of it fast; the packaged MiniLM, whose
vectors move with batch composition, is behind ``slow``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ragbudget.errors import ConfigError, ExecutorError
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.executors import LocalExecutor, RayExecutor, make_executor
from ragbudget.retrieval.index import Index
from ragbudget.retrieval.vectors import FlatStore

REPO = Path(__file__).resolve().parents[1]
MANPAGES = REPO / "data" / "manpages"
QUERIES = (
    "what happens when writing to a pipe with no reader",
    "close a file descriptor",
    "errors returned by pipe",
    "O_NONBLOCK flag",
    "file locks released on close",
)
# Small chunks: two man pages give ~100 of them, enough for several Ray batches and an IVF store.
SMALL = {"min_tokens": 20, "max_tokens": 60, "embed_batch": 16}
MARKER = "XYZZY-KILL-THE-WORKER"


class DyingEmbedder(HashEmbedder):
    """A HashEmbedder whose worker process dies (``os._exit``, as an OOM kill or a lost node
    would end it) when it is asked to embed a text holding :data:`MARKER`. Same id and vectors
    as HashEmbedder otherwise, so its checkpoint is a HashEmbedder's."""

    def embed(self, texts: Any) -> Any:
        if any(MARKER in t for t in texts):
            os._exit(1)
        return super().embed(texts)


class DyingOnceEmbedder(HashEmbedder):
    """A HashEmbedder whose worker dies once: the first process to embed removes ``flag`` and
    exits, as a preempted node would; after that it embeds like HashEmbedder."""

    def __init__(self, dim: int, flag: Path) -> None:
        super().__init__(dim)
        self.flag = str(flag)

    def embed(self, texts: Any) -> Any:
        try:
            os.remove(self.flag)
        except FileNotFoundError:
            return super().embed(texts)
        os._exit(1)


def corpus(root: Path) -> Path:
    docs = root / "docs"
    shutil.copytree(MANPAGES, docs)
    return docs


def contents(path: Path) -> dict[str, Any]:
    """What an index holds: chunk rows, sources, vectors by id, and search results."""
    idx = Index(path)
    m = idx.manifest
    flat = FlatStore.load(path / m["faiss"]["file"], m["faiss"])
    ids = np.sort(flat.ids())
    with sqlite3.connect(path / m["sqlite"]["file"]) as db:
        chunks = db.execute("SELECT id, text, windows FROM chunks ORDER BY id").fetchall()
        sources = db.execute('SELECT chunk_id, path, start, "end" FROM sources ORDER BY chunk_id, ord').fetchall()
    hits = [[(h.chunk_id, round(h.score, 5)) for h in idx.search(q, k=5)] for q in QUERIES]
    out = {"manifest": m, "chunks": chunks, "sources": sources, "ids": ids, "vectors": flat.vectors(ids), "hits": hits}
    idx.close()
    return out


def same_index(a: dict[str, Any], b: dict[str, Any], *, atol: float) -> None:
    assert a["chunks"] == b["chunks"] and a["chunks"]
    assert a["sources"] == b["sources"]
    assert a["ids"].tolist() == b["ids"].tolist()
    np.testing.assert_allclose(a["vectors"], b["vectors"], atol=atol, rtol=0)
    assert a["manifest"]["counts"] == b["manifest"]["counts"]
    assert a["manifest"]["store"]["kind"] == b["manifest"]["store"]["kind"]


# -- equality with the local executor -----------------------------------------------------------


@pytest.mark.parametrize("store", ["flat", "ivf-flat"])
def test_ray_index_equals_the_local_one(ray_cluster: Any, tmp_path: Path, store: str) -> None:
    docs = corpus(tmp_path)
    local = Index(tmp_path / "local").build([str(docs)], embedder=HashEmbedder(dim=64), store=store, **SMALL)
    # Two actors for the exact store (shards from both, in any order), one for IVF.
    workers = 2 if store == "flat" else 1
    ray = Index(tmp_path / "ray").build(
        [str(docs)], embedder=HashEmbedder(dim=64), store=store, executor=RayExecutor(workers=workers), **SMALL
    )
    assert ray.chunks_embedded == local.chunks_embedded > 3 * SMALL["embed_batch"]
    for key in ("chunks_added", "windows_pooled", "windows_embedded", "exact_duplicates", "near_duplicates"):
        assert getattr(ray, key) == getattr(local, key), key
    a, b = contents(tmp_path / "local"), contents(tmp_path / "ray")
    # The hash embedder is deterministic per text: the vectors are the same bits.
    same_index(a, b, atol=0.0)
    assert a["hits"] == b["hits"]
    assert b["manifest"]["store"]["kind"] == store
    assert not (tmp_path / "ray" / "embed.checkpoint").exists()  # spent after the commit


@pytest.mark.model
def test_ray_index_with_minilm_equals_the_local_one(ray_cluster: Any, tmp_path: Path) -> None:
    from ragbudget.retrieval.embed import SentenceTransformerEmbedder

    docs = corpus(tmp_path)
    Index(tmp_path / "local").build([str(docs)], embedder=SentenceTransformerEmbedder(), **SMALL)
    Index(tmp_path / "ray").build(
        [str(docs)], embedder=SentenceTransformerEmbedder(), executor=RayExecutor(workers=2), **SMALL
    )
    a, b = contents(tmp_path / "local"), contents(tmp_path / "ray")
    # Batches are composed differently on the actors (padding changes the float sums): equal
    # within float tolerance, and the same chunks answer the fixed queries in the same order.
    same_index(a, b, atol=1e-5)
    assert [[i for i, _ in q] for q in a["hits"]] == [[i for i, _ in q] for q in b["hits"]]
    for qa, qb in zip(a["hits"], b["hits"], strict=True):
        np.testing.assert_allclose([s for _, s in qa], [s for _, s in qb], atol=1e-4)


class ReversedExecutor(LocalExecutor):
    """The local executor with its shards handed back last first, as a cluster may finish them."""

    def embed(self, embedder: Any, texts: Any, *, batch_size: int) -> Any:
        return reversed(list(super().embed(embedder, texts, batch_size=batch_size)))


def test_shards_may_come_back_in_any_order(tmp_path: Path) -> None:
    # The builder places each shard's vectors by its positions: a cluster's completion order
    # must not move a vector to another chunk. Rounds of 64 chunks, batches of 16: four shards.
    docs = corpus(tmp_path)
    Index(tmp_path / "local").build([str(docs)], embedder=HashEmbedder(dim=64), **SMALL)
    rev = ReversedExecutor()
    rev.round_size = 64
    Index(tmp_path / "rev").build([str(docs)], embedder=HashEmbedder(dim=64), executor=rev, **SMALL)
    a, b = contents(tmp_path / "local"), contents(tmp_path / "rev")
    same_index(a, b, atol=0.0)
    assert a["hits"] == b["hits"]


def test_ray_shards_hold_the_vectors_of_their_positions(ray_cluster: Any) -> None:
    texts = [f"text {i} about topic {i % 7}" for i in range(50)]
    emb = HashEmbedder(dim=32)
    shards = list(RayExecutor(workers=2).embed(emb, texts, batch_size=8))
    assert sorted(p for s in shards for p in s.positions.tolist()) == list(range(50))
    for s in shards:
        want = emb.embed([texts[p] for p in s.positions])
        np.testing.assert_array_equal(s.vectors, want.vectors)
        assert s.windows == want.windows
    assert sum(s.texts_fed for s in shards) == 50


# -- failures -----------------------------------------------------------------------------------


def test_a_worker_killed_mid_job_keeps_the_previous_generation(ray_cluster: Any, tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    path = tmp_path / "idx"
    first = Index(path).build([str(docs)], embedder=HashEmbedder(dim=64), **SMALL)
    before = contents(path)
    # New files: ~20 chunks, then (last in scan order) the text that kills its worker every time.
    (docs / "more.txt").write_text(" ".join(f"word{j} token{j}." for j in range(240)))
    (docs / "zz-last.txt").write_text(f"The final note. {MARKER} ends the job.\n")
    # Rounds of 16 chunks: the first round finishes (and is checkpointed) before the marker's
    # round starts. No restarts: a restarted actor would die on the same batch again (the
    # bounded restarts themselves cost an actor start each, seconds on a 2-CPU cluster).
    dying = RayExecutor(workers=1, round_size=16, retries=0)
    with pytest.raises(ExecutorError) as err:
        Index(path).build([str(docs)], embedder=DyingEmbedder(dim=64), executor=dying, **SMALL)
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert "Ray embedding job failed" in msg and "generation 1 stays" in msg, msg
    after = contents(path)
    assert after["manifest"]["generation"] == first.generation == 1
    same_index(before, after, atol=0.0)
    assert before["hits"] == after["hits"]
    assert Index(path).verify().ok
    assert (path / "embed.checkpoint").exists()
    # A re-run resumes from what the failed job returned and writes what a local run writes.
    again = Index(path).build(
        [str(docs)], embedder=HashEmbedder(dim=64), executor=RayExecutor(workers=1, round_size=16), **SMALL
    )
    assert again.committed and again.generation == 2
    assert again.chunks_resumed >= 16 and again.chunks_embedded >= 1, again
    assert again.chunks_resumed + again.chunks_embedded == again.chunks_added
    Index(tmp_path / "local").build([str(docs)], embedder=HashEmbedder(dim=64), **SMALL)
    fresh, resumed = contents(tmp_path / "local"), contents(path)
    np.testing.assert_array_equal(
        np.array([v for _, v in sorted(zip([t for _, t, _ in fresh["chunks"]], fresh["vectors"], strict=True))]),
        np.array([v for _, v in sorted(zip([t for _, t, _ in resumed["chunks"]], resumed["vectors"], strict=True))]),
    )


def test_a_worker_that_dies_once_is_restarted_and_the_index_is_the_same(ray_cluster: Any, tmp_path: Path) -> None:
    docs = corpus(tmp_path)
    flag = tmp_path / "die-once"
    flag.touch()
    got = Index(tmp_path / "ray").build(
        [str(docs)], embedder=DyingOnceEmbedder(64, flag), executor=RayExecutor(workers=1, retries=1), **SMALL
    )
    assert not flag.exists()  # a worker did die
    assert got.committed and got.chunks_embedded == got.chunks_added
    Index(tmp_path / "local").build([str(docs)], embedder=HashEmbedder(dim=64), **SMALL)
    a, b = contents(tmp_path / "local"), contents(tmp_path / "ray")
    same_index(a, b, atol=0.0)
    assert a["hits"] == b["hits"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_cluster_is_a_one_line_cli_error(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ragbudget.cli.commands import cli

    docs = corpus(tmp_path)
    path = tmp_path / "idx"
    Index(path).build([str(docs)], embedder=HashEmbedder(dim=64), **SMALL)
    manifest = (path / "manifest.json").read_text()
    (docs / "new.txt").write_text("A new file that would need embedding.\n")
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    res = CliRunner().invoke(
        cli, ["index", str(docs), "--index-dir", str(path), "--executor", "ray", "--ray-address", address]
    )
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: cannot reach the Ray cluster at "), res.output
    assert address in lines[0] and "--ray-address" in lines[0]
    assert (path / "manifest.json").read_text() == manifest
    assert not (path / "embed.checkpoint").exists()


def test_ray_flags_need_the_ray_executor(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ragbudget.cli.commands import cli

    docs = corpus(tmp_path)
    res = CliRunner().invoke(cli, ["index", str(docs), "--index-dir", str(tmp_path / "idx"), "--embed-workers", "2"])
    assert res.exit_code == 1 and "apply to --executor ray" in res.output, res.output
    assert not (tmp_path / "idx").exists()
    res = CliRunner().invoke(
        cli, ["index", str(docs), "--index-dir", str(tmp_path / "idx"), "--executor", "ray", "--embed-workers", "0"]
    )
    assert res.exit_code == 2 and "--embed-workers" in res.output, res.output


def test_executor_arguments_are_checked() -> None:
    assert isinstance(make_executor("local"), LocalExecutor)
    assert isinstance(make_executor("ray"), RayExecutor)
    ex = RayExecutor()
    assert make_executor(ex) is ex
    with pytest.raises(ConfigError, match="executor must be one of local, ray"):
        make_executor("dask")
    with pytest.raises(ConfigError, match="EmbedExecutor"):
        make_executor(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'host:port'"):
        RayExecutor(address="head-node")
    with pytest.raises(ConfigError, match="workers must be >= 1"):
        RayExecutor(workers=0)


def test_ray_is_imported_only_by_the_ray_executor() -> None:
    code = (
        "import sys, ragbudget, ragbudget.retrieval.build, ragbudget.cli.commands, ragbudget.retrieval.executors, "
        "ragbudget.retrieval.index\n"
        "from ragbudget.retrieval.executors import RayExecutor\n"
        "RayExecutor(workers=2)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json\n" + code],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_pool_shares_the_cluster_cpus(ray_cluster: Any) -> None:
    # The 2-CPU test cluster: one actor per CPU by default, the CPUs split between the actors
    # asked for (Ray sets each actor's torch threads to its share); no GPU asked for without GPUs.
    resources = ray_cluster.cluster_resources()
    assert RayExecutor().pool(resources) == (2, 1.0, None)
    assert RayExecutor(workers=1).pool(resources) == (1, 2.0, None)
    assert RayExecutor(workers=4).pool(resources) == (4, 0.5, None)


def test_the_pool_takes_a_gpu_an_actor_where_the_cluster_has_gpus() -> None:
    assert RayExecutor().pool({"CPU": 16.0, "GPU": 2.0}) == (2, None, 1.0)
    assert RayExecutor(workers=1).pool({"CPU": 16.0, "GPU": 2.0}) == (1, None, 1.0)
    assert RayExecutor().pool({}) == (1, 1.0, None)  # a cluster reporting no CPU: one actor


def test_doctests() -> None:
    import doctest

    import ragbudget.retrieval.executors

    assert doctest.testmod(ragbudget.retrieval.executors).failed == 0


def test_joining_another_cluster_from_a_connected_process_is_refused(ray_cluster: Any) -> None:
    # ray.init would quietly keep the first connection: the build would run on the wrong cluster.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        ex = RayExecutor(address=address)
        ex.check()  # something listens: the probe passes
        with pytest.raises(ExecutorError, match="already connected to a Ray cluster"):
            list(ex.embed(HashEmbedder(dim=8), ["text"], batch_size=1))
    assert ray_cluster.is_initialized()  # the shared cluster is untouched
