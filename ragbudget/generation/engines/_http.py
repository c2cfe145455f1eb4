"""The one HTTP client every engine module shares: timeouts, auth, error mapping, bounded retry.

Everything that can go wrong on the wire becomes a typed one-line error naming the URL and what to
check (:mod:`ragbudget.errors`); nothing is retried forever:

* refused connection, unknown host, TLS failure, a dropped connection →
  :class:`~ragbudget.errors.EngineConnectionError` (its ``cause`` says which);
* no answer within the timeout (a hung server) → :class:`~ragbudget.errors.EngineTimeoutError`;
* 401 / 403 → :class:`~ragbudget.errors.EngineAuthError`;
* 429 / 503 (overloaded, or still loading) → up to ``Retry.attempts`` requests with exponential
  back-off and full jitter, waiting at least the server's ``Retry-After``, never more than
  ``Retry.max_wait`` seconds in all → :class:`~ragbudget.errors.EngineOverloadedError`;
* a body that is not JSON where JSON is promised → :class:`~ragbudget.errors.EngineResponseError`;
* any other error status → :class:`~ragbudget.errors.EngineResponseError` with the server's
  structured error in ``body``, unless the caller listed that status in ``allow`` (the engine
  modules do, to read a too-long error's figures).

Errors are classified by status code and structured fields only, never by message text.

Credentials in the URL (``http://user:pass@host``) are sent as HTTP basic auth and never appear in
``root``, a message or an error's ``url``: those reach logs, reports and the server's clients.
:meth:`HTTP.probing` makes the calls inside it quick looks (no back-off, a shorter time-out), for
the server's reading of the engine's health and load.

A stream given a ``cancel`` event is abandoned the moment it is set, not at the engine's next
byte: its socket is shut down from a watching thread, so a request cancelled while the engine
reads its prompt — or queues it, or hangs — is closed there at once, and the engine stops its
task (llama.cpp looks at the connection every second; vLLM aborts on disconnect). Issue #42 §5:
the stream was closed at the next byte only, and a request abandoned during a long prefill kept
its slot until then.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import random
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from ...errors import (
    ConfigError,
    EngineAuthError,
    EngineConnectionError,
    EngineError,
    EngineOverloadedError,
    EngineResponseError,
    EngineTimeoutError,
)

__all__ = ["HTTP", "Reply", "Retry", "error_message", "root_url"]

#: Seconds a reply may take where no time-out was given: the routes that answer at once (counts,
#: the template, figures, models); a generation's own time-out is drawn from the engine's speed
#: (:mod:`ragbudget.generation.engines._pacing`).
BASE_TIMEOUT_S = 30.0

#: How often a stream's watcher looks at its cancel event (``threading.Event`` cannot wake on
#: either of two events): a cancelled request is closed at the engine within this.
CANCEL_POLL_S = 0.05

#: Statuses that mean "busy, come back": TGI answers 429 when its queue is full; vLLM, SGLang and
#: Ollama 503 (Ollama's ErrMaxQueue, server/routes.go handleScheduleError); llama.cpp 503 while
#: its model loads (tools/server/server-http.cpp, "Loading model") and for "no slot available".
OVERLOAD_STATUSES = frozenset({429, 503})

#: POST routes that change nothing on the engine (token counts, chat templates, model facts): like
#: a GET, sent again when their connection was reset or dropped. A generation never is: the
#: engine may have started it.
IDEMPOTENT_POSTS = frozenset(
    {"/tokenize", "/v1/tokenize", "/detokenize", "/apply-template", "/chat_tokenize", "/api/show"}
)
#: How many times such a request is sent again after a reset or dropped connection, and the pause
#: before each (seconds; doubled each time): a listen queue drains in milliseconds.
RESET_RETRIES = 2
RESET_PAUSE_S = 0.05


@dataclass(frozen=True, kw_only=True)
class Retry:
    """Bounded back-off for overloaded engines: at most ``attempts`` requests, delays doubling
    from ``base_delay`` up to ``max_delay`` with full jitter, at least the server's
    ``Retry-After``, and never more than ``max_wait`` seconds of waiting in all."""

    attempts: int = 4
    base_delay: float = 0.5
    max_delay: float = 8.0
    max_wait: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_delay < 0 or self.max_delay < 0 or self.max_wait < 0:
            raise ConfigError("Retry needs attempts ≥ 1 and non-negative delays")


@dataclass(frozen=True)
class Reply:
    """A response the caller asked to see: status, parsed JSON (or ``None``), raw text, headers."""

    status: int
    data: Any
    text: str = field(repr=False)
    headers: Mapping[str, str] = field(repr=False, default_factory=dict)


def root_url(url: str) -> str:
    """The server root of an engine URL: one trailing ``/v1``, slashes and any credentials
    (``user:pass@``) dropped — what may be shown.

    >>> root_url("http://127.0.0.1:8000/v1/")
    'http://127.0.0.1:8000'
    >>> root_url("https://bob:s3cret@engine.example:8443/v1")
    'https://engine.example:8443'
    """
    return _split_url(url)[0]


def _split_url(url: str) -> tuple[str, tuple[str, str] | None]:
    """``(root, (user, password) or None)`` of an engine URL (see :func:`root_url`)."""
    parts = urlsplit(url.strip())
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number
        host = port = None
    if parts.scheme not in ("http", "https") or not host:
        raise ConfigError(f"engine URL must look like http://host:port[/v1]; got {_shown_url(url)!r}")
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    auth = (unquote(parts.username or ""), unquote(parts.password or "")) if parts.username is not None else None
    return f"{parts.scheme}://{netloc}{path}", auth


def _shown_url(url: str) -> str:
    """``url`` with any ``user:pass@`` masked, for an error message."""
    scheme, sep, rest = url.strip().partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def error_message(data: Any, text: str = "") -> str:
    """The human message inside an engine's error body, for display only (never parsed).

    Shapes: ``{"error": {"message": …}}`` (OpenAI, vLLM, llama.cpp), ``{"object": "error",
    "message": …}`` (SGLang), ``{"error": "…", "error_type": …}`` (TGI), ``{"error": "…"}``
    (Ollama).
    """
    if isinstance(data, Mapping):
        err = data.get("error")
        if isinstance(err, Mapping) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        if data.get("message"):
            return str(data["message"])
    return text.strip()[:200]


class _Abandon:
    """The connection of one stream, and whether it was abandoned: :meth:`abandon` shuts its
    socket down from another thread (a blocked read then returns at once), before the connection
    is made too (it is shut down as soon as it is)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.abandoned = False

    def trace(self, event: str, info: Mapping[str, Any]) -> None:
        """httpcore's ``trace`` extension: the new connection's network stream."""
        if event != "connection.connect_tcp.complete":
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        with self._lock:
            self._sock = sock if isinstance(sock, socket.socket) else None
            if self.abandoned:
                self._shut()

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True
            self._shut()

    def _shut(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):  # already closed: nothing left to stop
                self._sock.shutdown(socket.SHUT_RDWR)

    @contextlib.contextmanager
    def watching(self, cancel: threading.Event | None) -> Iterator[None]:
        """While the block runs, abandon the stream once ``cancel`` is set."""
        if cancel is None:
            yield
            return
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                if cancel.wait(CANCEL_POLL_S):
                    self.abandon()
                    return

        watcher = threading.Thread(target=watch, name="ragbudget-engine-cancel", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


class HTTP:
    """A thread-safe client for one engine root (``http://host:port``, no ``/v1``).

    ``api_key`` is sent as ``Authorization: Bearer``; ``timeout`` bounds every read (a server
    that stops answering raises after it) — ``None``: :data:`BASE_TIMEOUT_S`, unless a call gives
    its own (``timeout_given`` says which) — ``connect_timeout`` the connection. ``sleep`` (also
    the attribute :attr:`sleep`, settable on a connected backend's ``http``) waits out each
    back-off ``retry`` decides: :func:`time.sleep` unless a caller wants to see, shorten or log
    the waits.
    """

    def __init__(
        self,
        root: str,
        *,
        api_key: str | None = None,
        timeout: float | None = 30.0,
        connect_timeout: float = 5.0,
        retry: Retry | None = None,
        kind: str = "",
        sleep: Callable[[float], None] = time.sleep,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.root, auth = _split_url(root)
        self.kind = kind
        #: Whether ``timeout`` was given (``--engine-timeout``): it then bounds every reply, a
        #: generation's too, instead of the one drawn from the engine's speed.
        self.timeout_given = timeout is not None
        self.timeout = BASE_TIMEOUT_S if timeout is None else timeout
        self.connect_timeout = connect_timeout
        self.retry = retry or Retry()
        self.sleep = sleep  # the back-off's wait (see above)
        self._has_key = bool(api_key)
        self._probe = threading.local()  # .timeout set inside probing(): see there
        #: Requests sent, by route (``"/tokenize"``: how often the engine's tokenizer was asked).
        self.sent: Counter[str] = Counter()
        self._sent_lock = threading.Lock()
        self.closed = False
        headers = {"User-Agent": "ragbudget", "Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        basic = httpx.BasicAuth(*auth) if auth is not None and not api_key else None
        timeouts = httpx.Timeout(self.timeout, connect=connect_timeout)
        self._client = httpx.Client(
            headers=headers, timeout=timeouts, transport=transport, follow_redirects=False, auth=basic
        )
        # Streams get a connection of their own each (none is kept alive): its socket, seen as it
        # is made, is what a cancel shuts down (see the module docstring). One connection setup
        # a generation costs nothing beside the generation.
        self._streams = httpx.Client(
            headers=headers,
            timeout=timeouts,
            transport=transport,
            follow_redirects=False,
            auth=basic,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def close(self) -> None:
        self.closed = True
        self._client.close()
        self._streams.close()

    def _check_open(self, url: str) -> None:
        """A request after :meth:`close` is a ragbudget error naming what to do (httpx's own is a
        bare ``RuntimeError`` that no caller catches as an engine failure)."""
        if self.closed:
            raise EngineError(
                f"the connection to the engine at {self.root} was closed (close() ran on this backend "
                "or its pipeline); connect again: a new Pipeline(engine=...) or connect(...)",
                url=url,
                kind=self.kind,
            )

    def url(self, path: str) -> str:
        return self.root + path

    @contextlib.contextmanager
    def probing(self, timeout: float | None = None) -> Iterator[None]:
        """Calls made inside the block (in this thread) are quick looks at the engine: an
        overload answer (429/503, or llama.cpp loading its model) raises at once instead of
        backing off, and each reply may take ``timeout`` seconds (default: the client's). A
        look at the engine's health must say "busy" now, not after half a minute of retries."""
        before = getattr(self._probe, "timeout", None)
        self._probe.timeout = self.timeout if timeout is None else timeout
        try:
            yield
        finally:
            self._probe.timeout = before

    # -- one request ------------------------------------------------------------------------------
    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        allow: frozenset[int] | set[int] = frozenset(),
        expect: str = "json",
        timeout: float | None = None,
    ) -> Reply:
        """Send one request (retrying overload), map failures to typed errors, return the reply.

        ``expect`` is ``"json"`` (a 2xx body must parse) or ``"text"`` (Prometheus metrics).
        A status in ``allow`` is returned as is, with its JSON parsed when it parses.
        """
        url = self.url(path)
        self._check_open(url)
        waited, attempt, resets = 0.0, 0, 0
        probe = getattr(self._probe, "timeout", None)
        if timeout is None and probe is not None:
            timeout = probe
        while True:
            attempt += 1
            self._note_sent(path)
            try:
                resp = self._client.request(
                    method,
                    url,
                    json=body,
                    timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else self._timeouts(timeout),
                )
            except httpx.HTTPError as exc:
                if _was_reset(exc) and resets < RESET_RETRIES and _idempotent(method, path):
                    self.sleep(RESET_PAUSE_S * 2**resets)
                    resets += 1
                    continue
                raise self._transport_error(exc, url, timeout) from None
            status = resp.status_code
            if status in allow:
                return Reply(status, _maybe_json(resp.text), resp.text, dict(resp.headers))
            if 200 <= status < 300:
                if expect == "text":
                    return Reply(status, None, resp.text, dict(resp.headers))
                return Reply(status, self._json(resp, url), resp.text, dict(resp.headers))
            data = _maybe_json(resp.text)
            if status in OVERLOAD_STATUSES:
                delay = self._backoff(resp, attempt, waited, url, data)
                self.sleep(delay)
                waited += delay
                continue
            raise self._status_error(status, url, data, resp.text)

    def get(self, path: str, **kw: Any) -> Reply:
        return self.call("GET", path, **kw)

    def post(self, path: str, body: Any, **kw: Any) -> Reply:
        return self.call("POST", path, body, **kw)

    # -- streams ----------------------------------------------------------------------------------
    def stream(
        self,
        path: str,
        body: Any,
        *,
        mode: str = "sse",
        cancel: threading.Event | None = None,
        allow: frozenset[int] | set[int] = frozenset(),
        timeout: float | None = None,
    ) -> Iterator[Any]:
        """POST ``body`` and yield each event's JSON: ``mode="sse"`` reads ``data:`` lines until
        ``[DONE]`` (OpenAI streaming), ``"ndjson"`` one JSON object per line (Ollama).

        A status in ``allow`` yields one :class:`Reply` and stops (so the caller can read a
        too-long error). Overload before the first byte is retried like :meth:`call`. When
        ``cancel`` is set the stream is closed at once, even while the engine has sent nothing
        yet (see the module docstring), which makes the engine abort the request and free its
        slot; the stream then just ends. A read that outlasts ``timeout`` (default: the
        client's) raises, and closes the connection too.
        """
        url = self.url(path)
        self._check_open(url)
        waited, attempt = 0.0, 0
        while True:
            attempt += 1
            self._note_sent(path)
            conn = _Abandon()
            try:
                with (
                    conn.watching(cancel),
                    self._streams.stream(
                        "POST",
                        url,
                        json=body,
                        timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else self._timeouts(timeout),
                        extensions={"trace": conn.trace},
                    ) as resp,
                ):
                    status = resp.status_code
                    if status != 200:
                        resp.read()
                        data = _maybe_json(resp.text)
                        if status in allow:
                            yield Reply(status, data, resp.text, dict(resp.headers))
                            return
                        if status in OVERLOAD_STATUSES:
                            delay = self._backoff(resp, attempt, waited, url, data)
                            self.sleep(delay)
                            waited += delay
                            continue
                        raise self._status_error(status, url, data, resp.text)
                    for line in resp.iter_lines():
                        if cancel is not None and cancel.is_set():
                            return  # leaving the `with` closes the connection
                        line = line.strip()
                        if not line:
                            continue
                        if mode == "sse":
                            if not line.startswith("data:"):
                                continue  # comments (":" pings), event names, ids
                            line = line[len("data:") :].strip()
                            if line == "[DONE]":
                                return
                        try:
                            yield json.loads(line)
                        except json.JSONDecodeError:
                            raise EngineResponseError(
                                f"{url} streamed a line that is not JSON ({line[:80]!r}): is this "
                                "an OpenAI-compatible engine?",
                                url=url,
                                kind=self.kind,
                                status=status,
                                body=line[:200],
                            ) from None
                    return
            except httpx.HTTPError as exc:
                if conn.abandoned:
                    return  # cancelled: the connection was shut down on purpose
                raise self._transport_error(exc, url, timeout) from None

    # -- helpers -----------------------------------------------------------------------------------
    def _note_sent(self, path: str) -> None:
        with self._sent_lock:
            self.sent[path] += 1

    def _timeouts(self, timeout: float) -> httpx.Timeout:
        """A call's own read ``timeout``; connecting never takes longer than the client's."""
        return httpx.Timeout(timeout, connect=min(timeout, self.connect_timeout))

    def _json(self, resp: httpx.Response, url: str) -> Any:
        try:
            return json.loads(resp.text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            ctype = resp.headers.get("content-type", "no content-type")
            raise EngineResponseError(
                f"{url} answered {resp.status_code} with a body that is not JSON ({ctype}, "
                f"starting {resp.text[:40]!r}): is this the engine's address, not a proxy or a "
                "web page?",
                url=url,
                kind=self.kind,
                status=resp.status_code,
                body=resp.text[:200],
            ) from None

    def _backoff(self, resp: httpx.Response, attempt: int, waited: float, url: str, data: Any) -> float:
        r = self.retry
        if getattr(self._probe, "timeout", None) is not None:
            r = Retry(attempts=1)  # a probe says "overloaded" at once (see probing)
        retry_after = _retry_after(resp.headers.get("retry-after"))
        # Full jitter over the exponential step; the server's Retry-After is a floor, with a
        # little jitter on top so a crowd of clients does not return in the same instant.
        step = min(r.max_delay, r.base_delay * 2 ** (attempt - 1))
        delay = random.uniform(0, step)
        if retry_after is not None:
            delay = retry_after + random.uniform(0, 0.1 * retry_after + 0.05)
        if attempt >= r.attempts or waited + delay > r.max_wait:
            said = f"; it asked to retry after {retry_after:g} s" if retry_after is not None else ""
            raise EngineOverloadedError(
                f"{url} is overloaded ({resp.status_code}: {error_message(data, resp.text)}) "
                f"after {attempt} attempts and {waited:.1f} s of back-off{said}: retry later, "
                "lower concurrency, or add capacity",
                url=url,
                kind=self.kind,
                status=resp.status_code,
                body=data,
                attempts=attempt,
                retry_after=retry_after if retry_after is not None else max(delay, r.base_delay),
            )
        return delay

    def _status_error(self, status: int, url: str, data: Any, text: str) -> Exception:
        msg = error_message(data, text)
        if status in (401, 403):
            hint = (
                "the API key was refused: check the key in the variable named by --api-key-env (api_key=…)"
                if self._has_key
                else "the engine wants an API key: pass api_key=… (CLI: --api-key-env VAR)"
            )
            if status == 403:
                hint = "the key is not allowed to do this: check the key's permissions"
            return EngineAuthError(
                f"{url} answered {status} ({msg}): {hint}", url=url, kind=self.kind, status=status, body=data
            )
        return EngineResponseError(
            f"{url} answered {status}: {msg}",
            url=url,
            kind=self.kind,
            status=status,
            body=data if data is not None else text[:200],
        )

    def _transport_error(self, exc: httpx.HTTPError, url: str, timeout: float | None) -> EngineConnectionError:
        host = urlsplit(url).netloc
        if isinstance(exc, httpx.TimeoutException):
            connect = isinstance(exc, httpx.ConnectTimeout)
            t = self.timeout if timeout is None else timeout
            if connect:
                t = min(t, self.connect_timeout)
            what = "could not connect" if connect else "gave no answer"
            return EngineTimeoutError(
                f"{url} {what} within {t:g} s: the engine may be hung, still loading, or "
                "overloaded; check it is up (its /health) or raise the timeout (--engine-timeout)",
                url=url,
                kind=self.kind,
                timeout=t,
            )
        chain = list(_chain(exc))
        if any(isinstance(e, ssl.SSLError) for e in chain):
            cause = "tls"
            msg = (
                f"TLS handshake with {host} failed ({chain[-1]}): check http:// vs "
                "https:// and the server certificate (SSL_CERT_FILE)"
            )
        elif any(isinstance(e, socket.gaierror) for e in chain):
            cause = "dns"
            msg = f"cannot resolve host {host!r} for {url}: check the host name in the URL"
        elif any(isinstance(e, ConnectionRefusedError) for e in chain):
            cause = "refused"
            msg = f"connection to {url} refused: is the engine running and listening on {host}? check the host and port"
        elif isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
            cause = "dropped"
            msg = (
                f"{url} closed the connection mid-request ({type(exc).__name__}): check the "
                "engine's logs (it may have crashed or restarted)"
            )
        else:
            cause = "unreachable"
            msg = f"cannot reach {url} ({type(exc).__name__}: {exc}): check the URL"
        return EngineConnectionError(msg, url=url, kind=self.kind, cause=cause)


def _was_reset(exc: httpx.HTTPError) -> bool:
    """Whether the connection was reset or dropped (not a time-out, a refusal, DNS or TLS)."""
    if isinstance(exc, httpx.TimeoutException):
        return False
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return True
    return any(isinstance(e, (ConnectionResetError, BrokenPipeError)) for e in _chain(exc))


def _idempotent(method: str, path: str) -> bool:
    """Whether a request changes nothing on the engine, so a reset one may be sent again."""
    return method in ("GET", "HEAD") or path in IDEMPOTENT_POSTS


def _maybe_json(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:  # not delta-seconds: an HTTP date
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
    return max(0.0, when.timestamp() - time.time())
