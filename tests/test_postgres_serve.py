"""``ragbudget serve --index postgresql://…`` end to end: a real server process on an index in a
real PostgreSQL (tests/_postgres.py) answering through the real llama-server, and the per-request
index check reusing one database connection instead of opening one per request."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _corpus import EMB
from _fakes import stop_server

from ragbudget.retrieval.index import Index

pytestmark = [pytest.mark.server, pytest.mark.postgres]

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"


def sessions(url: str) -> int:
    """Connections ever established to the URL's database (pg_stat_database.sessions, counted by
    the server itself: public, and independent of ragbudget's code)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT sessions FROM pg_stat_database WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row[0])


def free_port() -> int:
    with socket.socket() as probe:  # loopback only; a tiny race with other processes
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_serve(url: str, engine: str, port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "ragbudget", "serve", "--index", url, "--engine", engine, "--port", str(port)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_up(proc: subprocess.Popen[str], base: str, timeout: float = 90) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"ragbudget serve exited {proc.returncode}: {proc.communicate()[1][-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    pytest.fail("ragbudget serve did not become healthy in time: " + stop_server(proc)[-2000:])


@contextlib.contextmanager
def serving(url: str, engine: str) -> Iterator[str]:
    """One ``ragbudget serve`` on ``url``, healthy: its base URL; it must stop cleanly."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_serve(url, engine, port)
    try:
        wait_up(proc, base)
        yield base
    finally:
        err = stop_server(proc)
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err


def test_serve_on_a_database_answers_citing_a_chunk_on_one_connection(pg_url: str, llama_server: str) -> None:
    Index(pg_url).build([str(DATA)], embedder=EMB)
    with serving(pg_url, llama_server) as base:
        body: dict[str, Any] = {
            "model": "ragbudget",
            "messages": [{"role": "user", "content": "Who discovered oxygen?"}],
            "max_tokens": 16,
        }
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["choices"][0]["message"]["content"].strip()
        cited = answer["sources"]
        assert cited and cited[0]["path"] and cited[0]["chunk_ids"], cited
        assert answer["ragbudget"]["index"] == {"generation": 1}  # which generation it cites
        # The chunk it cites is a row of the database's current generation.
        import psycopg

        with psycopg.connect(pg_url, autocommit=True) as conn:
            n = conn.execute(
                "SELECT COUNT(*) FROM ragbudget.chunks WHERE id = ANY(%s) AND gen_to IS NULL",
                (cited[0]["chunk_ids"],),
            ).fetchone()
        assert n is not None and n[0] == len(cited[0]["chunk_ids"])

        # Every request checks the index is still there: N requests must not open N connections.
        time.sleep(1.2)  # a backend's connection counts reach the statistics within a second
        before = sessions(pg_url)
        n_requests = 20
        for _ in range(n_requests):
            assert httpx.get(base + "/health", timeout=10).status_code == 200
            got = httpx.post(base + "/v1/retrieve", json={"query": "oxygen", "k": 2}, timeout=30)
            assert got.status_code == 200, got.text
        time.sleep(1.2)
        opened = sessions(pg_url) - before - 1  # less the probe's own connection
        assert opened <= 2, f"{2 * n_requests} requests opened {opened} database connections"


def test_a_server_follows_two_reindexes_without_a_restart(pg_url: str, llama_server: str, tmp_path: Path) -> None:
    """A long-running server answers from each new commit: after two re-indexes (by which time
    the rows of the generation it opened are deleted) it retrieves the newest text and its
    answers cite the newest generation, with no error and no restart."""
    import shutil

    docs = tmp_path / "docs"
    shutil.copytree(DATA / "squad", docs / "squad")
    Index(pg_url).build([str(docs)], embedder=EMB)
    with serving(pg_url, llama_server) as base:
        for generation, word in ((1, None), (2, "Zorblaxian"), (3, "Quentarine")):
            if word is not None:
                (docs / "squad" / "added.md").write_text(f"# Added\n\nThe {word} archive holds oxygen notes.\n")
                Index(pg_url).build([str(docs)], embedder=EMB)
            query = f"{word or 'oxygen'} archive"
            got = httpx.post(base + "/v1/retrieve", json={"query": query, "k": 3}, timeout=60)
            assert got.status_code == 200, got.text
            if word is not None:
                found = [h["text"] for h in got.json()["data"]]
                assert any(word in t for t in found), (generation, found)
            body = {"model": "ragbudget", "messages": [{"role": "user", "content": query}], "max_tokens": 4}
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["ragbudget"]["index"] == {"generation": generation}


def test_two_servers_answer_a_burst_while_a_third_process_reindexes(
    pg_url: str, llama_server: str, tmp_path: Path
) -> None:
    """Two ``ragbudget serve`` processes on one database answer 16 concurrent chat requests while
    ``ragbudget index`` commits a changed folder: no 5xx, and each answer's chunks are all rows of
    the one generation it reports."""
    import shutil
    import threading

    docs = tmp_path / "docs"
    shutil.copytree(DATA / "squad", docs / "squad")
    Index(pg_url).build([str(docs)], embedder=EMB)
    ports = [free_port(), free_port()]
    procs = [start_serve(pg_url, llama_server, p) for p in ports]
    results: list[tuple[int, dict[str, Any]]] = []
    lock = threading.Lock()
    try:
        for proc, port in zip(procs, ports, strict=True):
            wait_up(proc, f"http://127.0.0.1:{port}")
        go = threading.Barrier(17)

        def client(i: int) -> None:
            base = f"http://127.0.0.1:{ports[i % 2]}"
            body = {"model": "ragbudget", "messages": [{"role": "user", "content": "Who discovered oxygen?"}]}
            body["max_tokens"] = 4
            go.wait()
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            for _ in range(8):
                if r.status_code != 429:
                    break
                time.sleep(int(r.headers.get("retry-after", "1")))
                r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            with lock:
                results.append((r.status_code, r.json() if r.status_code == 200 else {"text": r.text}))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        (docs / "squad" / "added.md").write_text("# Added\n\nOxygen was also studied by Lavoisier in Paris.\n")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        go.wait()
        indexer = subprocess.run(
            [sys.executable, "-m", "ragbudget", "index", str(docs), "--index", pg_url, "--embedder", "hash:256"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        for t in threads:
            t.join(timeout=180)
        assert indexer.returncode == 0, indexer.stderr[-2000:]
    finally:
        errs = [stop_server(p) for p in procs]
    assert all("Traceback" not in e for e in errs), errs
    assert len(results) == 16
    assert not [s for s, _ in results if s >= 500], results
    answers = [a for s, a in results if s == 200]
    assert answers, results
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        assert conn.execute("SELECT generation FROM ragbudget.manifest").fetchone() == (2,)
        for a in answers:
            g = a["ragbudget"]["index"]["generation"]
            ids = sorted({i for src in a["sources"] for i in src["chunk_ids"]})
            seen = conn.execute(
                "SELECT COUNT(DISTINCT id) FROM ragbudget.chunks WHERE id = ANY(%s) AND gen_from <= %s "
                "AND (gen_to IS NULL OR gen_to > %s)",
                (ids, g, g),
            ).fetchone()
            assert ids and seen == (len(ids),), (g, ids)
