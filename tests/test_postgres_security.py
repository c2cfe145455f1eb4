"""An index in PostgreSQL, the security side (issue #34 §5), on a real server (tests/_postgres.py):
the password reaches libpq from the URL, PGPASSWORD or PGPASSFILE and nowhere else (no message,
log, --json, stats or stored manifest shows it); a wrong password, an unreachable host, a
database without pgvector and a connection dropped mid-run are one line and exit code 1, the
previous generation intact."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from _corpus import EMB as EMB_, build, make_text, write_corpus
from _fakes import FakeBackend
from _postgres import PASSWORD, SECRET
from click.testing import CliRunner

from ragbudget import Pipeline
from ragbudget.cli.commands import cli as ragbudget_cli
from ragbudget.errors import IndexStorageError, RagBudgetError
from ragbudget.retrieval.index import Index

MASKED = "***"


def with_password(url: str, password: str = PASSWORD) -> str:
    user, rest = url.split("://", 1)[1].split("@", 1)
    return f"postgresql://{user}:{quote(password, safe='')}@{rest}"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ragbudget", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )


def one_line_error(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), run.stderr
    return lines[0]


def test_password_from_the_url_is_never_shown(
    pg_password_db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=2)
    url = with_password(pg_password_db)
    with caplog.at_level(logging.DEBUG):
        s = build(Index(url), corpus)
    assert s.committed
    ix = Index.open(url)
    assert PASSWORD not in repr(ix) and PASSWORD not in json.dumps(ix.stats())
    assert ix.stats()["index_dir"].startswith(f"postgresql://pwuser:{MASKED}@/")
    assert PASSWORD not in caplog.text and quote(PASSWORD, safe="") not in caplog.text
    import psycopg

    with psycopg.connect(url) as conn:
        body = json.dumps(conn.execute("SELECT body FROM ragbudget.manifest").fetchone())
    assert PASSWORD not in body and quote(PASSWORD, safe="") not in body and "pwuser" not in body
    run = cli("stats", "--index", url, "--json")
    assert run.returncode == 0, run.stderr
    assert PASSWORD not in run.stdout + run.stderr and quote(PASSWORD, safe="") not in run.stdout + run.stderr
    assert json.loads(run.stdout)["index_dir"].startswith(f"postgresql://pwuser:{MASKED}@/")


def test_password_from_pgpassword_and_from_pgpassfile(pg_password_db: str, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=2)
    run = cli("index", str(corpus), "--index", pg_password_db, "--json", env={"PGPASSWORD": PASSWORD})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["committed"] is True
    passfile = tmp_path / "pgpass"
    escaped = PASSWORD.replace("\\", "\\\\").replace(":", "\\:")
    passfile.write_text(f"*:*:*:pwuser:{escaped}\n")
    passfile.chmod(0o600)
    run = cli("verify", "--index", pg_password_db, "--json", env={"PGPASSFILE": str(passfile)})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["ok"] is True
    assert PASSWORD not in run.stdout + run.stderr


def test_a_wrong_password_is_one_line_and_exit_1(pg_password_db: str) -> None:
    wrong = "Wr0ng-pass"
    line = one_line_error(cli("search", "anything", "--index", with_password(pg_password_db, wrong)))
    assert "password authentication failed" in line and wrong not in line and MASKED in line
    line = one_line_error(cli("stats", "--index", pg_password_db, env={"PGPASSWORD": wrong}))
    assert "password authentication failed" in line and wrong not in line
    with pytest.raises(IndexStorageError, match="password authentication failed"):
        Index.open(with_password(pg_password_db, wrong))


def test_an_unreachable_host_is_one_line_and_exit_1() -> None:
    line = one_line_error(cli("search", "anything", "--index", "postgresql://me:hunter2@127.0.0.1:1/x"))
    assert "postgresql://me:***@127.0.0.1:1/x" in line and "hunter2" not in line
    line = one_line_error(cli("index", ".", "--index", "postgresql://127.0.0.1:1/x?connect_timeout=2"))
    assert "127.0.0.1" in line


def test_libpq_options_pass_through(pg_url: str) -> None:
    storage = Index(pg_url + "&application_name=rb_probe&options=-c%20statement_timeout%3D4321").storage
    conn = storage.connect(vectors=False)  # type: ignore[attr-defined]
    try:
        assert conn.execute("SHOW application_name").fetchone()[0] == "rb_probe"
        assert conn.execute("SHOW statement_timeout").fetchone()[0] == "4321ms"
    finally:
        conn.close()
    # A libpq option libpq refuses is libpq's one-line message, not ours to guess.
    with pytest.raises(IndexStorageError, match="sslmode"):
        Index.open(pg_url + "&sslmode=bogus")


def test_a_database_without_pgvector_whose_user_may_not_create_it(pg_server: Any, tmp_path: Path) -> None:
    import psycopg
    from _postgres import db_url

    with psycopg.connect(pg_server.get_uri(), autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS novector")
        conn.execute("CREATE DATABASE novector")
        if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'plainuser'").fetchone() is None:
            conn.execute("CREATE ROLE plainuser LOGIN")
    url = db_url(pg_server, "novector", user="plainuser")
    corpus = write_corpus(tmp_path / "corpus", n=1)
    line = one_line_error(cli("index", str(corpus), "--index", url))
    assert "has no pgvector and it could not be created" in line and "CREATE EXTENSION vector" in line


def test_a_connection_dropped_mid_run_leaves_the_previous_generation(pg_url: str, tmp_path: Path) -> None:
    import psycopg

    corpus = write_corpus(tmp_path / "corpus", n=6)
    first = build(Index(pg_url), corpus)
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(make_text(700 + i, unique=f"new{i}zz"))
    killed: list[int] = []

    def drop_connections(phase: str, done: int, total: int | None) -> None:
        if phase == "embed" and done > 0 and not killed:
            with psycopg.connect(pg_url, autocommit=True) as admin:
                killed.extend(
                    r[0]
                    for r in admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                )

    with pytest.raises(IndexStorageError) as err:
        build(Index(pg_url), corpus, progress=drop_connections, embed_batch=4)
    assert killed and "\n" not in str(err.value) and "failed" in str(err.value)
    ix = Index.open(pg_url)
    assert ix.manifest["generation"] == 1 and ix.stats()["chunks"] == first.chunks_total
    assert ix.search_lexical("new0zz", k=1) == [] and ix.search_lexical("marker0zz", k=1)
    assert ix.verify().ok
    again = build(Index(pg_url), corpus)
    assert again.committed and again.generation == 2


def test_cli_index_search_stats_verify_on_a_url(pg_url: str, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n=3)
    run = cli("index", str(corpus), "--index", pg_url, "--json", "--min-tokens", "20", "--max-tokens", "60")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["generation"] == 1
    run = cli("search", "marker2zz", "--index", pg_url, "--json", "-k", "1")
    assert run.returncode == 0, run.stderr
    assert "marker2zz" in run.stdout and "corpus/doc2.txt" in run.stdout
    run = cli("stats", "--index-dir", pg_url, "--json")
    assert run.returncode == 0 and json.loads(run.stdout)["lexical"] == "postgres-fts"
    run = cli("verify", "--index", pg_url)
    assert run.returncode == 0, run.stderr
    one_line_error(cli("search", "x", "--index", pg_url + "&ragbudget_schema=nothing_here"))
    line = one_line_error(cli("search", "x", "--index", pg_url + "&ragbudget_schema=Bad-Name"))
    assert "ragbudget_schema must be" in line


def test_a_reader_whose_connection_is_cut_reconnects_once(pg_url: str, tmp_path: Path) -> None:
    """A serving process outlives its connection (a server restart, an idle connection cut): the
    next query opens a new one; the generation it reads is the same."""
    import psycopg

    build(Index(pg_url), write_corpus(tmp_path / "corpus", n=3))
    reader = Index.open(pg_url)
    before = [(h.chunk_id, h.score) for h in reader.search("marker1zz", k=3, embedder=EMB_)]
    with psycopg.connect(pg_url, autocommit=True) as admin:
        cut = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    assert cut
    assert [(h.chunk_id, h.score) for h in reader.search("marker1zz", k=3, embedder=EMB_)] == before
    assert reader.search_lexical("marker2zz", k=1)


# --- issue #42 §2: libpq's keyword/value form and the empty-host URL, and no password anywhere ----

WRONG = "Wr0ng-PW-42"


def keywords(db: dict[str, str], password: str = SECRET, **more: str) -> str:
    """``db`` as a libpq keyword/value string."""
    pairs = {**db, "password": password, **more}
    return " ".join(f"{k}={v}" for k, v in pairs.items())


def empty_host_url(db: dict[str, str], password: str = SECRET) -> str:
    """``db`` as a URL with an empty host, the socket folder and the password as parameters."""
    return f"postgresql:///{db['dbname']}?host={db['host']}&user={db['user']}&password={password}"


def invoke(args: list[str]) -> Any:
    """``ragbudget ARGS`` in this process (its log records reach caplog); the click result."""
    return CliRunner().invoke(ragbudget_cli, args)


def names_under(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in root.rglob("*")]


def test_a_keyword_value_string_is_the_database_for_index_and_search(
    pg_secret_db: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    corpus = write_corpus(tmp_path / "corpus", n=3)
    kw = keywords(pg_secret_db)
    run = invoke(["index", str(corpus), "--index", kw, "--embedder", "hash:256", "--json"])
    assert run.exit_code == 0, run.output
    assert json.loads(run.stdout)["generation"] == 1
    run = invoke(["search", "marker2zz", "--index", kw, "--json", "-k", "1"])
    assert run.exit_code == 0, run.output
    assert "marker2zz" in run.stdout and "corpus/doc2.txt" in run.stdout
    stats = Index.open(kw).stats()
    assert stats["index_dir"] == keywords(pg_secret_db, MASKED) and stats["lexical"] == "postgres-fts"
    assert repr(Pipeline(kw)).startswith(f"Pipeline({keywords(pg_secret_db, MASKED)!r}")
    # ragbudget_schema works as a keyword too: another index in the same database.
    other = keywords(pg_secret_db, ragbudget_schema="docs")
    assert build(Index(other), corpus).committed
    assert Index.open(other).search_lexical("marker1zz", k=1) and Index.open(other).storage.schema == "docs"  # type: ignore[attr-defined]
    # No folder was made of the string: the only things here are the corpus.
    assert sorted(names_under(tmp_path)) == ["corpus", *(f"corpus/doc{i}.txt" for i in range(3))]


def test_a_url_with_an_empty_host_reaches_libpq_unchanged(pg_secret_db: dict[str, str], tmp_path: Path) -> None:
    url = empty_host_url(pg_secret_db)
    assert Pipeline(url).index_dir == url
    assert build(Index(url), write_corpus(tmp_path / "corpus", n=2)).committed
    assert Index.open(url).stats()["index_dir"] == empty_host_url(pg_secret_db, MASKED)
    run = invoke(["search", "marker1zz", "--index", url, "--json", "-k", "1"])
    assert run.exit_code == 0, run.output
    assert "marker1zz" in run.stdout


def secret_free(text: str) -> bool:
    return SECRET not in text and WRONG not in text


def test_no_password_in_any_output_log_file_or_folder_name(
    pg_secret_db: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every command that takes an index, on every form of location that holds a password — good,
    with a wrong password, on a server that is not there, and not parsing at all — in text and
    --json, with debug logging: the password is in no output, message, log record, repr, file or
    folder name, here or in the database's manifests."""
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.DEBUG)
    db, host = pg_secret_db, pg_secret_db["host"]
    corpus = write_corpus(tmp_path / "corpus", n=2)
    local = tmp_path / "local"
    build(Index(local), corpus)
    good = [keywords(db), f"postgresql://{db['user']}:{SECRET}@/{db['dbname']}?host={host}", empty_host_url(db)]
    bad = [
        keywords(db, WRONG),
        f"postgresql://{db['user']}:{WRONG}@/{db['dbname']}?host={host}",
        keywords({"host": "127.0.0.1", "port": "1", "dbname": "x"}, connect_timeout="2"),
        f"postgresql://{db['user']}:{SECRET}@127.0.0.1:1/x?connect_timeout=2",
        f"host={host} password={SECRET} oops",  # a word without '=': does not parse
        f"host={host} password='{SECRET}",  # a quote left open
        f"postgresql://{db['user']}:{SECRET}%zz@/{db['dbname']}?host={host}",  # libpq quotes the bad token
        f"postgresql://{db['user']}:{SECRET}@[db/x",  # ...and here the whole URI
        f"postgresql:/{db['dbname']}?host={host}&password={SECRET}",  # slashes a path library collapsed
    ]
    commands = [
        ["index", str(corpus), "--embedder", "hash:256"],
        ["index", str(corpus), "--embedder", "hash:256", "--json"],
        ["stats"],
        ["stats", "--json"],
        ["search", "marker1zz"],
        ["search", "marker1zz", "--json"],
        ["sources"],
        ["sources", "--json"],
        ["verify"],
        ["verify", "--json"],
        ["ask", "What is marker1zz?", "--engine", "http://127.0.0.1:1", "--json"],
    ]
    seen: list[str] = []
    for n, where in enumerate(good + bad):
        runs = [invoke(["-vv", *cmd, "--index", where]) for cmd in commands]
        runs += [invoke(["-vv", "copy", where, str(tmp_path / f"copy{n}")]), invoke(["-vv", "copy", str(local), where])]
        for cmd, run in zip([*commands, ["copy from"], ["copy to"]], runs, strict=True):
            seen.append(run.output + run.stderr + repr(run.exception))
            # A good location serves every command but ask (whose engine is not there).
            expected = 0 if where in good and cmd[0] != "ask" else 1
            assert run.exit_code == expected, (cmd, run.output)
            if expected:
                assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith("Error: "), run.output
        for make in (Pipeline, Index):
            try:
                seen.append(repr(make(where)))
            except Exception as exc:
                seen.append(f"{exc!r} {exc}")
        # The CLI's ask stops at its engine (not there); here a whole answer, report included.
        try:
            with Pipeline(where, backend=FakeBackend()) as pipe:
                seen.append(json.dumps(pipe.ask("What is marker1zz?").to_dict(), default=str))
            assert where in good
        except RagBudgetError as exc:
            assert where in bad
            seen.append(f"{exc!r} {exc}")
    seen += [r.getMessage() for r in caplog.records] + [caplog.text]
    assert all(secret_free(text) for text in seen), next(t for t in seen if not secret_free(t))
    # A copy from the database records where it came from: masked. No file or folder has the
    # password in its name or its bytes.
    copied = json.loads((tmp_path / "copy0" / "manifest.json").read_text())["copied_from"]["where"]
    assert copied == keywords(db, MASKED)
    for path in tmp_path.rglob("*"):
        assert secret_free(path.name) and "password" not in path.name
        assert not path.is_file() or SECRET.encode() not in path.read_bytes()
    import psycopg

    with psycopg.connect(keywords(db)) as conn:
        rows = conn.execute("SELECT body::text FROM ragbudget.manifest").fetchall()
    assert rows and all(secret_free(row[0]) for row in rows)
    # And in a process of its own: the one-line error and debug logging on the real stderr.
    for args in (
        ["-vv", "stats", "--index", good[0], "--json"],
        ["-vv", "search", "x", "--index", bad[0]],
        ["-vv", "index", str(corpus), "--index", bad[4]],
        ["-vv", "copy", good[1], str(tmp_path / "copied")],
    ):
        run = cli(*args)
        assert secret_free(run.stdout + run.stderr), run.stdout + run.stderr


@pytest.mark.server
def test_serve_shows_no_password(pg_secret_db: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ragbudget serve`` opens its index before anything else: with a wrong password it refuses
    to start; with the right one it opens the index, then refuses an engine that is not there.
    Neither line, nor its debug log, holds the password."""
    monkeypatch.chdir(tmp_path)  # where a string taken for a folder would be created
    build(Index(keywords(pg_secret_db)), write_corpus(tmp_path / "corpus", n=2))
    for password, says in ((WRONG, "password authentication failed"), (SECRET, "127.0.0.1:1")):
        where = keywords(pg_secret_db, password)
        run = cli("-vv", "serve", "--index", where, "--engine", "http://127.0.0.1:1", "--port", "0")
        assert run.returncode == 1 and says in run.stderr.splitlines()[-1], run.stderr
        assert secret_free(run.stdout + run.stderr), run.stderr


def test_without_psycopg_a_database_location_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    """Where psycopg is not installed, a keyword/value string is still no folder: the command
    says which extra installs psycopg, without the password, and creates nothing."""
    corpus = write_corpus(tmp_path / "corpus", n=1)
    where = f"host=/var/run/postgresql dbname=rag user=rag password={SECRET}"
    code = "import sys; sys.modules['psycopg'] = None; from ragbudget.cli.commands import main; main(sys.argv[1:])"
    for args in (["stats", "--index", where], ["index", str(corpus), "--index", where, "--embedder", "hash:256"]):
        run = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=180, cwd=tmp_path
        )
        line = one_line_error(run)
        assert "pip install 'ragbudget[postgres]'" in line and secret_free(run.stdout + run.stderr), line
    assert names_under(tmp_path) == ["corpus", "corpus/doc0.txt"]
