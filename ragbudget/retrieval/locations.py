"""Where an index lives, as its caller wrote it: a folder, or a PostgreSQL database in either of
libpq's two forms — a URL (``postgresql://…`` or ``postgres://…``, the empty-host form
``postgresql:///rag?host=/run/postgresql`` included) or a keyword/value string
(``host=/run/postgresql dbname=rag user=rag``), as psycopg and SQLAlchemy accept them.

Three jobs, each done here once:

* :func:`is_db_location` — which form a string is. A keyword/value string is never a folder
  name: one that starts with a libpq keyword (``host=``, ``dbname=``, …), that psycopg's own
  parser accepts, or that names a password anywhere is a database (a folder whose name starts
  with ``host=`` is written ``./host=…``).
* :func:`split_location` — what reaches libpq: the location byte for byte (libpq decodes and
  checks it), less ragbudget's own ``ragbudget_schema`` parameter, which names the schema.
* :func:`mask_location` — what a message, a log line, a repr, ``stats``, ``--json`` or a
  manifest shows: every secret (the password of a URL's user part, a ``password=``,
  ``sslpassword=`` or similar parameter or keyword) replaced by ``***``. :func:`hide_secrets`
  does the same to a message libpq wrote, which may quote a piece of the location it could not
  parse (``invalid percent-encoded token: "…"``).
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote

from ..errors import ConfigError

__all__ = [
    "DEFAULT_SCHEMA",
    "SCHEMA_PARAM",
    "hide_secrets",
    "is_db_location",
    "mask_location",
    "split_location",
]

DEFAULT_SCHEMA = "ragbudget"
#: ragbudget's own parameter (in a URL's query or as a keyword): the schema that holds the index.
SCHEMA_PARAM = "ragbudget_schema"
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
#: A URL's scheme and the slashes after it (``postgresql:/rag``, a URL a path library collapsed,
#: is caught here too and refused with the form to use rather than taken for a folder).
_SCHEME = re.compile(r"postgres(?:ql)?:(//)?", re.IGNORECASE)
#: Any URL (an installed storage's: ``scratch://…``, ``s3://…``): masked as a PostgreSQL one.
_ANY_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
MASK = "***"

#: libpq's connection keywords (PostgreSQL 17's list; a newer libpq's own are recognised through
#: psycopg's parser where psycopg is installed).
_KEYWORDS = frozenset(
    (
        "host",
        "hostaddr",
        "port",
        "dbname",
        "user",
        "password",
        "passfile",
        "require_auth",
        "channel_binding",
        "connect_timeout",
        "client_encoding",
        "options",
        "application_name",
        "fallback_application_name",
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
        "tcp_user_timeout",
        "replication",
        "gssencmode",
        "sslmode",
        "requiressl",
        "sslnegotiation",
        "sslcompression",
        "sslcert",
        "sslkey",
        "sslkeylogfile",
        "sslpassword",
        "sslcertmode",
        "sslrootcert",
        "sslcrl",
        "sslcrldir",
        "sslsni",
        "requirepeer",
        "ssl_min_protocol_version",
        "ssl_max_protocol_version",
        "min_protocol_version",
        "max_protocol_version",
        "krbsrvname",
        "gsslib",
        "gssdelegation",
        "service",
        "target_session_attrs",
        "load_balance_hosts",
        "scram_client_key",
        "scram_server_key",
        "oauth_issuer",
        "oauth_client_id",
        "oauth_client_secret",
        "oauth_scope",
    )
) | {SCHEMA_PARAM}
#: The keywords whose values are secrets: never shown.
_SECRETS = frozenset(
    {"password", "sslpassword", "oauth_client_secret", "scram_client_key", "scram_server_key"}
    # No libpq keyword: what another storage's URL may carry (an object store's, a service's).
    | {"token", "access_token", "secret", "api_key", "apikey", "access_key", "secret_key", "signature", "sig"}
    | {"x-amz-signature", "x-amz-credential", "x-amz-security-token"}
)

# libpq's keyword/value grammar (fe-connect.c, conninfo_parse): a keyword, optional blanks, '=',
# optional blanks, then a value: single-quoted (backslash escapes any character, the closing
# quote ends it) or bare (up to the next blank, a backslash escaping any character). Pairs need
# no blank between them after a quoted value.
_VALUE = r"""(?:'(?:[^'\\]|\\[\s\S])*'|(?!')(?:[^\s\\]|\\[\s\S]?)*)"""
_PAIR = re.compile(r"\s*([^\s=]+)\s*=\s*(" + _VALUE + ")")
_FIRST_KEY = re.compile(r"\s*([^\s=]+)\s*=")
#: A secret keyword anywhere in a string (at its start or after a blank): such a string is never
#: a folder name, whether it parses or not.
_SECRET_KEY = re.compile(r"(?:^|\s)(?:" + "|".join(sorted(_SECRETS)) + r")\s*=", re.IGNORECASE)


def _text(where: object) -> str | None:
    if isinstance(where, str):
        return where
    if isinstance(where, os.PathLike):
        path = os.fspath(where)
        return path if isinstance(path, str) else None
    return None


def _is_url(text: str) -> bool:
    return _SCHEME.match(text) is not None


def _authority_start(url: str) -> int:
    m = _SCHEME.match(url) or _ANY_URL.match(url)
    return 0 if m is None else m.end()


def _pairs(text: str) -> list[re.Match[str]] | None:
    """``text``'s keyword/value pairs as libpq reads them, or ``None`` where libpq would refuse
    it (a word without ``=``, a quote left open)."""
    pairs, pos = [], 0
    while text[pos:].strip():
        m = _PAIR.match(text, pos)
        if m is None:
            return None
        pairs.append(m)
        pos = m.end()
    return pairs


def _unescape(value: str) -> str:
    """A keyword's value as libpq reads it: quotes taken off, backslash escapes resolved."""
    if value.startswith("'"):
        value = value[1:-1]
    return re.sub(r"\\([\s\S])", r"\1", value)


def _psycopg_accepts(text: str) -> bool:
    """Whether psycopg's own parser (libpq's, so a newer libpq's keywords too) reads ``text`` as
    a non-empty keyword/value string; ``False`` without psycopg."""
    try:
        import psycopg
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        return False
    try:
        return bool(conninfo_to_dict(text))
    except (psycopg.Error, ValueError):
        return False


def is_db_location(where: object) -> bool:
    """Whether ``where`` names an index in PostgreSQL rather than a folder: a ``postgresql://``
    or ``postgres://`` URL, or a libpq keyword/value string.

    >>> is_db_location("postgresql:///rag?host=/run/postgresql"), is_db_location("host=/run/postgresql dbname=rag")
    (True, True)
    >>> is_db_location(".ragbudget"), is_db_location("./host=notes")
    (False, False)
    """
    text = _text(where)
    if text is None:
        return False
    if _is_url(text):
        return True
    first = _FIRST_KEY.match(text)
    if first is not None and first.group(1).lower() in _KEYWORDS:
        return True
    # A password never names a folder: a string holding one is a database location, refused
    # in one line (masked) if it does not parse, rather than a folder created with the
    # password in its name.
    if _SECRET_KEY.search(text):
        return True
    # Only a string that starts like a keyword pair reaches psycopg: a folder never imports it.
    return first is not None and _psycopg_accepts(text)


def _url_userinfo_end(url: str) -> int:
    """Where a URL's user part ends (the index of its ``@``), or -1. The last ``@`` of the URL:
    a password holding a raw ``@``, ``/`` or ``?`` (which libpq itself misreads) is then masked
    whole, at the cost of masking more than the password when a later part holds an ``@``."""
    return url.rfind("@", _authority_start(url))


def _mask_url(url: str) -> str:
    start = _authority_start(url)
    at = _url_userinfo_end(url)
    if at >= 0 and ":" in url[start:at]:
        user = url[start:at].partition(":")[0]
        url = f"{url[:start]}{user}:{MASK}{url[at:]}"
    elif at >= 0 and _SCHEME.match(url) is None:
        # Another storage's URL with a user part and no password: a token (scheme://TOKEN@host).
        url = f"{url[:start]}{MASK}{url[at:]}"
    head, q, query = url.partition("?")
    if not q:
        return url
    pieces = []
    for piece in query.split("&"):
        key, eq, _ = piece.partition("=")
        pieces.append(f"{key}={MASK}" if eq and unquote(key).lower() in _SECRETS else piece)
    return f"{head}?{'&'.join(pieces)}"


def _mask_keywords(text: str) -> str:
    pairs = _pairs(text)
    if pairs is None:
        # It does not parse, so where a value ends is a guess: everything from the first secret
        # keyword on is left out.
        m = _SECRET_KEY.search(text)
        return text if m is None else text[: m.end()] + MASK
    out, pos = [], 0
    for m in pairs:
        if m.group(1).lower() in _SECRETS:
            out.append(text[pos : m.start(2)] + MASK)
            pos = m.end(2)
    return "".join(out) + text[pos:]


def mask_location(where: str | os.PathLike[str]) -> str:
    """``where`` as messages, logs, reprs, ``stats`` and manifests show it: a database
    location's secrets replaced by ``***`` (a folder is shown as it is).

    >>> mask_location("postgresql://me:s3cret@db.example:5432/rag?sslmode=require&password=x")
    'postgresql://me:***@db.example:5432/rag?sslmode=require&password=***'
    >>> mask_location("host=/run/postgresql user=rag password='s3 cret' dbname=rag")
    'host=/run/postgresql user=rag password=*** dbname=rag'
    >>> mask_location("objects://me:s3cret@store.example/rag?token=x")
    'objects://me:***@store.example/rag?token=***'
    >>> mask_location("objects://T0KEN@store.example/rag?X-Amz-Signature=abc")
    'objects://***@store.example/rag?X-Amz-Signature=***'
    """
    text = _text(where)
    if text is None:
        return str(where)
    if _is_url(text) or _ANY_URL.match(text):  # another storage's URL: the same parts are secret
        return _mask_url(text)
    if is_db_location(text):
        return _mask_keywords(text)
    return text


def _schema(value: str) -> str:
    if not _SCHEMA_NAME.match(value):
        raise ConfigError(
            f"{SCHEMA_PARAM} must be a lower-case SQL name (letters, digits, _; at most 63), got {value!r}; "
            f"e.g. ?{SCHEMA_PARAM}=docs in a URL, {SCHEMA_PARAM}=docs in a keyword/value string"
        )
    return value


def split_location(where: str) -> tuple[str, str]:
    """``(conninfo for libpq, schema)`` of a database location: the ``ragbudget_schema``
    parameter or keyword taken out, every other byte left as it was (libpq decodes and checks
    the rest; an empty-host URL stays one).

    >>> split_location("postgresql:///rag?host=/run/postgresql&ragbudget_schema=docs")
    ('postgresql:///rag?host=/run/postgresql', 'docs')
    >>> split_location("dbname=rag ragbudget_schema=docs user=rag")
    ('dbname=rag user=rag', 'docs')
    """
    if _is_url(where):
        m = _SCHEME.match(where)
        if m is None or not m.group(1):
            raise ConfigError(
                f"the index location {mask_location(where)} is not a PostgreSQL URL: one starts with postgresql:// "
                "(postgresql:///DBNAME?host=/socket/dir for a local socket); a path library may have collapsed the "
                "slashes: pass the URL as a string"
            )
        head, q, query = where.partition("?")
        schema, kept = DEFAULT_SCHEMA, []
        for piece in query.split("&") if q else []:
            key, _, value = piece.partition("=")
            if key == SCHEMA_PARAM:
                schema = unquote(value)
            else:
                kept.append(piece)
        return (f"{head}?{'&'.join(kept)}" if kept else head), _schema(schema)
    pairs = _pairs(where)
    if pairs is None:
        # No piece of the string in the message: a word libpq would stop at may be the second
        # half of a password with a blank in it.
        raise ConfigError(
            f"the index location {mask_location(where)} looks like a PostgreSQL keyword/value string but does not "
            "parse: write key=value pairs separated by blanks, a value holding blanks or quotes in single quotes "
            "(\\' for a quote, \\\\ for a backslash); a folder of that name as ./NAME"
        )
    schema, conninfo, pos = DEFAULT_SCHEMA, "", 0
    for pair in pairs:
        if pair.group(1) == SCHEMA_PARAM:
            schema = _unescape(pair.group(2))
            conninfo += where[pos : pair.start()]
            pos = pair.end()
    return (conninfo + where[pos:]).strip(), _schema(schema)


def hide_secrets(message: str, where: str) -> str:
    """``message`` (libpq's, about ``where``) with ``where`` and each of its secrets replaced by
    their masked form: libpq quotes the piece of a location it could not parse (``invalid
    percent-encoded token: "…"``, a whole URI for an unclosed ``[``), password included.

    >>> hide_secrets('invalid percent-encoded token: "pa%zz"', "postgresql://me:pa%zz@db/rag")
    'invalid percent-encoded token: "***"'
    """
    secrets: set[str] = set()
    if _is_url(where):
        start = _authority_start(where)
        at = _url_userinfo_end(where)
        # The password as this module masks it, and as libpq reads it (up to the first '@').
        for end in (at, where.find("@", start)):
            if end >= 0 and ":" in where[start:end]:
                secrets.add(where[start:end].partition(":")[2])
        for piece in where.partition("?")[2].split("&"):
            key, eq, value = piece.partition("=")
            if eq and unquote(key).lower() in _SECRETS:
                secrets.add(value)
    else:
        for m in _pairs(where) or []:
            if m.group(1).lower() in _SECRETS:
                secrets.update((m.group(2), _unescape(m.group(2))))
    secrets |= {unquote(s) for s in secrets}
    message = message.replace(where, mask_location(where))
    # Longest first, so a secret holding another is replaced whole. Three characters at least:
    # replacing every "a" of a message would hide nothing and garble the rest.
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= 3:
            message = message.replace(secret, MASK)
    return message
