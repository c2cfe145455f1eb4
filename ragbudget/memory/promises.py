"""Refusals remembered: a request refused for time, or because something in front of the
controller is full, is told when to come back (``Retry-After``), and that time is kept as a
*promise*: a request expected back then.

Promises do two things for :class:`~ragbudget.memory.admission.AdmissionController`:

* they space out the refusals: the next client refused is told a time after the clients sent back
  before it (the simulator plays their work forward from their promised times), instead of
  sending every client back at the same second;
* a client that honoured its ``Retry-After`` is served. A refusal's promise can carry a *key*
  (the server uses a hash of the request body, which a client retrying the same request sends
  again). A request made with that key (:func:`returning`) from ``EARLY_S`` before the promised
  time until ``LATE_S`` (or one queue time-out, if longer) after it *claims* the promise: it is
  never refused for time, it joins the FIFO queue, and it waits there for its turn up to half an
  hour instead of one queue time-out — so a client that honoured ``Retry-After`` is served even
  when the host ran slower than measured, and still within a bounded time.

New arrivals are judged by the work really running and queued (an unkeyed caller cannot be told
from a returning one), so a promise never holds the host idle.

>>> book = Promises()
>>> with returning("body-hash"):
...     book.make(None, retry=30.0, now=100.0)
>>> book.claimable("body-hash", now=128.0, grace=10.0) is None   # too early
True
>>> book.claimable("body-hash", now=129.0, grace=10.0).due       # one second early at most
130.0
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .schedule import Job

__all__ = ["Promise", "Promises", "returning"]

# The key of a request made under returning(): read by the controller in the same thread (or
# task), so the key need not travel through every layer between the server's request and the
# pipeline's reservation.
_RETURNING: contextvars.ContextVar[str | None] = contextvars.ContextVar("ragbudget_returning", default=None)
# Called (no arguments) when a returning request claimed its place and waits in the queue: the
# server then commits a streamed answer to 200 and keeps the connection alive while it waits.
_ON_CLAIM: contextvars.ContextVar[Callable[[], object] | None] = contextvars.ContextVar(
    "ragbudget_on_claim", default=None
)


@contextlib.contextmanager
def returning(key: str | None, *, on_claim: Callable[[], object] | None = None) -> Iterator[None]:
    """Requests made inside the block (in this thread or task) carry ``key``: refused, they leave a
    promise under it; coming back with it at the promised time, they claim it. ``None`` is a
    request without a key. ``on_claim`` is called when such a request claimed its place and has
    to wait for it in the queue (:func:`claimed`)."""
    token, claim = _RETURNING.set(key), _ON_CLAIM.set(on_claim)
    try:
        yield
    finally:
        _ON_CLAIM.reset(claim)
        _RETURNING.reset(token)


def current_key() -> str | None:
    """The key of :func:`returning` the request being made now carries, or ``None``."""
    return _RETURNING.get()


def claimed() -> None:
    """Tell the caller (``returning(on_claim=)``) that its request claimed its place and waits."""
    callback = _ON_CLAIM.get()
    if callback is not None:
        callback()


@dataclass(eq=False)
class Promise:
    """A client told to come back at ``due`` (the controller's clock)."""

    due: float
    job: Job | None = field(repr=False)  # None without a throughput (no time model to shape)
    key: str | None = None  # the refused request's key: its return claims the promise
    held_until: float = float("-inf")  # seen back (hold): kept for its acquire until then
    made: float = float("-inf")  # when the refusal was made (see jobs_ahead)


class Promises:
    """The promises made and not yet claimed or expired. Not locked itself: the controller calls
    it under its own lock."""

    #: A returning client may come this many seconds before its promised time (Retry-After is
    #: whole seconds, and clients round and sleep imprecisely).
    EARLY_S = 1.0
    #: A promise stays claimable this long after its time at least (or one queue time-out, if
    #: longer: the controller's ``grace``): a client's own work and sleep make it late by a little.
    LATE_S = 10.0

    def __init__(self) -> None:
        self._items: list[Promise] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Promise]:
        return iter(list(self._items))

    def behind(self) -> str:
        """What a time refusal's Retry-After also waits for, in words: the clients sent back
        before it, who come first (so it says more than the first token's excess over the
        time-out); empty when there are none."""
        if not self._items:
            return ""
        return f"; it comes back behind the {len(self._items)} client(s) told to come back before it"

    def make(self, job: Job | None, retry: float, now: float) -> None:
        """Remember a refusal told to come back in ``retry`` seconds (under the key of
        :func:`returning`). Without a job (nothing measured) only a keyed refusal is remembered:
        its return is kept a place, and there is no time model for it to shape."""
        key = _RETURNING.get()
        if job is not None or key is not None:
            self._items.append(Promise(due=now + retry, job=job, key=key, made=now))

    def claimable(self, key: str | None, now: float, grace: float) -> Promise | None:
        """The promise a request with ``key`` arriving ``now`` would claim: the earliest due one
        under that key whose time has come (``EARLY_S`` early at most)."""
        if key is None:
            return None
        self.prune(now, grace)
        due = [p for p in self._items if p.key == key and p.due - self.EARLY_S <= now]
        return min(due, key=lambda p: p.due) if due else None

    def claim(self, promise: Promise) -> None:
        """``promise`` is kept: its client is back (once per refusal)."""
        self._items.remove(promise)

    def prune(self, now: float, grace: float) -> None:
        """Forget the promises ``grace`` seconds past their time (and past any hold): a client
        that never comes back stops shaping the others' Retry-After."""
        self._items = [p for p in self._items if max(p.due + grace, p.held_until) > now]

    def jobs_ahead(self, before: float = float("inf")) -> list[Job]:
        """The work of the clients sent back (refused before ``before``), in the order they are
        due, each ready no earlier than its time: for the simulator, so that the next refusal is
        told a time after theirs."""
        return [
            Job(
                prefill=p.job.prefill,
                decode=p.job.decode,
                cost=p.job.cost,
                tokens=p.job.tokens,
                ready=p.due,
                new_max=p.job.new_max,
            )
            for p in sorted(self._items, key=lambda p: p.due)
            if p.job is not None and p.made < before
        ]
