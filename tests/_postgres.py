"""A real PostgreSQL server with pgvector for the tests of an index in a database (pgserver: the
server binaries and pgvector in a wheel, started as a child process in a temporary folder).

``pg_server`` starts one per test session (per pytest-xdist worker: each has its own folder and
socket); ``pg_url`` gives each test a fresh database on it, so tests never see each other's
schemas. Both skip when pgserver is not installed (the ``dev`` extra installs it). No mock of the
database anywhere: every test talks to this server.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

_N = itertools.count()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Any]:
    pgserver = pytest.importorskip("pgserver")
    pytest.importorskip("psycopg")
    pytest.importorskip("pgvector")
    with tempfile.TemporaryDirectory(prefix="rb-pg-") as folder:
        srv = pgserver.get_server(folder, cleanup_mode="stop")
        try:
            yield srv
        finally:
            srv.cleanup()


def db_url(srv: Any, dbname: str, user: str = "postgres", password: str = "") -> str:
    """The URL of database ``dbname`` on ``srv`` (over its Unix socket)."""
    base = srv.get_uri()  # postgresql://postgres:@/postgres?host=/tmp/...
    host = base.split("?host=", 1)[1]
    return f"postgresql://{user}:{password}@/{dbname}?host={host}"


@pytest.fixture
def pg_url(pg_server: Any) -> str:
    """A fresh, empty database on the session's server, as a URL."""
    import psycopg

    name = f"t{next(_N)}"
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.execute(f"CREATE DATABASE {name}")
    return db_url(pg_server, name)


#: The password of the role ``pg_password_db`` connects as (checked with scram-sha-256).
PASSWORD = "S3cret-'pw'\\x"
PW_USER = "pwuser"
#: The password of the role ``pg_secret_db`` connects as: plain letters, digits and dashes, so it
#: reads the same in a URL, a keyword/value string, JSON and a log line, and a search for it in
#: any output finds it however that output escapes text.
SECRET = "s3cr3t-PW-42"
SECRET_USER = "kwuser"


@pytest.fixture(scope="session")
def pg_password_server(pg_server: Any) -> Any:
    """The session's server, also asking ``pwuser`` for a password (a scram-sha-256 line above
    pgserver's trust lines in pg_hba.conf, reloaded)."""
    import psycopg
    from psycopg import sql

    hba = pg_server.pgdata / "pg_hba.conf"
    text = hba.read_text()
    lines = "".join(f"local all {user} scram-sha-256\n" for user in (PW_USER, SECRET_USER))
    if lines not in text:
        hba.write_text(lines + text)
    with psycopg.connect(pg_server.get_uri(), autocommit=True) as conn:
        conn.execute("SELECT pg_reload_conf()")
        for user, password in ((PW_USER, PASSWORD), (SECRET_USER, SECRET)):
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (user,)).fetchone() is None:
                conn.execute(f"CREATE ROLE {user} LOGIN")
            # A utility statement takes no bind parameters: the password goes in as a quoted literal.
            conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(user), sql.Literal(password)))
    return pg_server


@pytest.fixture
def pg_password_db(pg_password_server: Any) -> str:
    """A fresh database owned by ``pwuser`` (pgvector created in it), as a URL without a password."""
    import psycopg

    name = f"t{next(_N)}"
    with psycopg.connect(pg_password_server.get_uri(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} OWNER {PW_USER}")
    with psycopg.connect(db_url(pg_password_server, name), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION vector")
    host = pg_password_server.get_uri().split("?host=", 1)[1]
    return f"postgresql://{PW_USER}@/{name}?host={host}"


@pytest.fixture
def pg_secret_db(pg_password_server: Any) -> dict[str, str]:
    """A fresh database owned by ``kwuser`` (password :data:`SECRET`; pgvector created in it), as
    libpq's keywords without the password: ``host`` (the server's socket folder), ``dbname``,
    ``user``."""
    import psycopg

    name = f"t{next(_N)}"
    with psycopg.connect(pg_password_server.get_uri(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} OWNER {SECRET_USER}")
    with psycopg.connect(db_url(pg_password_server, name), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION vector")
    return {"host": pg_password_server.get_uri().split("?host=", 1)[1], "dbname": name, "user": SECRET_USER}
