"""ragbudget.retrieval.locations (issue #42 §2): both of libpq's forms are a database and never a
folder; what reaches libpq is the location as written (an empty-host URL stays one); what is
shown has every secret masked, exactly; a libpq message quoting a location loses its password."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import given, strategies as st

from ragbudget.errors import ConfigError
from ragbudget.retrieval.locations import hide_secrets, is_db_location, mask_location, split_location

SECRET = "s3cr3t-PW-42"


def libpq_quoted(value: str) -> str:
    """``value`` as a keyword/value string writes it: single-quoted, backslash and quote escaped."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@pytest.mark.parametrize(
    "where",
    [
        "postgresql://rag@db/rag",
        "postgres://db/rag",
        "POSTGRESQL://db/rag",
        "postgresql:///rag?host=/var/run/postgresql&user=rag",
        "host=/var/run/postgresql user=rag dbname=rag",
        "dbname=rag",
        "  service = rag",
        "sslmode=verify-full host=db",
        "ragbudget_schema=docs",
        f"password={SECRET}",
        f"notes password={SECRET}",  # a password: never a folder, even where the rest does not parse
        f"host=/x password='{SECRET}",  # a quote left open
    ],
)
def test_database_locations(where: str) -> None:
    assert is_db_location(where)


@pytest.mark.parametrize(
    "where",
    [".ragbudget", "/srv/index", "index dir", "./host=notes", "a=b", "/tmp/dbname=x", "notes=old", "", "C:\\index"],
)
def test_folders(where: str) -> None:
    assert not is_db_location(where)
    assert mask_location(where) == where


def test_a_keyword_newer_than_the_list_is_recognised_by_psycopgs_parser() -> None:
    from psycopg.conninfo import conninfo_to_dict

    # Every keyword of the libpq psycopg loaded parses; one our static list may lack still names
    # a database where psycopg is installed (and its first key is libpq's: never a folder).
    assert conninfo_to_dict("require_auth=scram-sha-256") and is_db_location("require_auth=scram-sha-256")


def test_the_masked_forms() -> None:
    assert mask_location(f"host=/run/postgresql user=rag password={SECRET} dbname=rag") == (
        "host=/run/postgresql user=rag password=*** dbname=rag"
    )
    assert mask_location(f"postgresql:///rag?host=/run/pg&user=rag&password={SECRET}") == (
        "postgresql:///rag?host=/run/pg&user=rag&password=***"
    )
    assert mask_location(f"postgresql://rag:{SECRET}@/rag?host=/run/pg") == "postgresql://rag:***@/rag?host=/run/pg"
    masked = mask_location(f"host=db sslpassword={SECRET} PASSWORD = {SECRET}")
    assert masked == "host=db sslpassword=*** PASSWORD = ***"
    # A password holding a raw '@', '/' or '?' (which libpq misreads): masked whole.
    for raw in (f"{SECRET}@x", f"{SECRET}/x", f"{SECRET}?x"):
        assert SECRET not in mask_location(f"postgresql://rag:{raw}@db/rag")
    # A string that does not parse: nothing from the first secret keyword on.
    assert mask_location(f"host=db password={SECRET} and more") == "host=db password=***"


@given(password=st.text(min_size=1, max_size=24).filter(lambda p: "\x00" not in p))
def test_any_password_is_masked_exactly_and_reaches_libpq_intact(password: str) -> None:
    from psycopg.conninfo import conninfo_to_dict

    kw = f"host=/run/pg user=rag password={libpq_quoted(password)} dbname=rag ragbudget_schema=docs"
    assert mask_location(kw) == "host=/run/pg user=rag password=*** dbname=rag ragbudget_schema=docs"
    conninfo, schema = split_location(kw)
    assert schema == "docs" and conninfo_to_dict(conninfo)["password"] == password
    url = f"postgresql://rag:{quote(password, safe='')}@/rag?host=/run/pg&ragbudget_schema=docs"
    assert mask_location(url) == "postgresql://rag:***@/rag?host=/run/pg&ragbudget_schema=docs"
    conninfo, schema = split_location(url)
    assert schema == "docs" and conninfo_to_dict(conninfo)["password"] == password


def test_what_reaches_libpq_is_the_location_as_written() -> None:
    # Python's urlunsplit writes postgresql:///rag as postgresql:/rag, which libpq refuses.
    assert split_location("postgresql:///rag?host=/var/run/postgresql&user=rag") == (
        "postgresql:///rag?host=/var/run/postgresql&user=rag",
        "ragbudget",
    )
    assert split_location("postgresql:///rag?ragbudget_schema=docs") == ("postgresql:///rag", "docs")
    assert split_location("dbname=rag ragbudget_schema='docs' user=rag") == ("dbname=rag user=rag", "docs")
    assert split_location("a='x'ragbudget_schema=d b=c") == ("a='x' b=c", "d")
    with pytest.raises(ConfigError, match="ragbudget_schema must be"):
        split_location("dbname=rag ragbudget_schema=Bad-Name")


def test_a_location_that_does_not_parse_is_one_line_without_the_password() -> None:
    for where in (f"host=db password={SECRET} oops", f"host=db password='{SECRET}", f"x password={SECRET}"):
        with pytest.raises(ConfigError) as err:
            split_location(where)
        assert SECRET not in str(err.value) and "\n" not in str(err.value) and "./NAME" in str(err.value)
    # A URL whose slashes a path library collapsed is refused with the form to use.
    with pytest.raises(ConfigError, match="postgresql://") as err:
        split_location(f"postgresql:/rag?host=/run/pg&password={SECRET}")
    assert SECRET not in str(err.value)


def test_libpqs_messages_lose_the_password() -> None:
    import psycopg

    for where in (f"postgresql://rag:{SECRET}%zz@/rag", f"postgresql://rag:{SECRET}@[db/rag"):
        with pytest.raises(psycopg.Error) as err:
            psycopg.connect(where)
        assert SECRET in str(err.value)  # libpq quotes it: what hide_secrets is for
        assert SECRET not in hide_secrets(str(err.value), where)
    assert hide_secrets("short passwords are left: ab", "postgresql://u:ab@db/x") == "short passwords are left: ab"
