"""Refusals remembered as promises: made under the request's key, claimed once in their window,
forgotten after their grace, and played forward in the order they are due."""

from __future__ import annotations

import threading

from ragbudget.memory.promises import Promises, claimed, current_key, returning
from ragbudget.memory.schedule import Job


def test_a_promise_is_made_for_a_measured_job_or_a_keyed_request() -> None:
    book = Promises()
    book.make(None, retry=5.0, now=0.0)  # nothing measured, no key: nothing to keep or shape
    assert len(book) == 0 and book.behind() == ""
    book.make(Job(prefill=1.0, decode=1.0, cost=1), retry=5.0, now=0.0)
    with returning("k"):
        book.make(None, retry=7.0, now=1.0)
    assert [(p.key, p.due, p.made) for p in book] == [(None, 5.0, 0.0), ("k", 8.0, 1.0)]
    assert book.behind() == "; it comes back behind the 2 client(s) told to come back before it"


def test_a_promise_is_claimed_from_early_s_before_its_time_until_its_grace_after() -> None:
    book = Promises()
    with returning("k"):
        book.make(None, retry=10.0, now=0.0)
        book.make(None, retry=20.0, now=0.0)
    grace = 15.0
    assert book.claimable("k", now=8.9, grace=grace) is None
    first = book.claimable("k", now=9.0, grace=grace)  # Promises.EARLY_S early
    assert first is not None and first.due == 10.0
    assert book.claimable("other", now=9.0, grace=grace) is None
    assert book.claimable(None, now=9.0, grace=grace) is None
    book.claim(first)
    second = book.claimable("k", now=25.0, grace=grace)  # the earliest due one left
    assert second is not None and second.due == 20.0
    # Past its grace it is forgotten — unless a returning client holds it for its acquire.
    second.held_until = 40.0
    assert book.claimable("k", now=39.0, grace=grace) is second
    book.prune(now=40.0, grace=grace)
    assert len(book) == 0


def test_jobs_ahead_are_the_refused_clients_work_in_due_order() -> None:
    book = Promises()
    late, soon = Job(prefill=2.0, decode=1.0, cost=3, tokens=4), Job(prefill=1.0, decode=1.0, cost=1)
    book.make(late, retry=30.0, now=0.0)
    book.make(soon, retry=10.0, now=5.0)
    ahead = book.jobs_ahead()
    assert [(j.prefill, j.ready) for j in ahead] == [(1.0, 15.0), (2.0, 30.0)]
    assert (ahead[1].cost, ahead[1].tokens, ahead[1].served) == (3, 4, 0.0)  # copies, not served yet
    assert ahead[1] is not late
    # Only the clients refused before a given time (a queue time-out that waited since then).
    assert [j.prefill for j in book.jobs_ahead(before=5.0)] == [2.0]


def test_returning_is_per_thread_and_calls_on_claim() -> None:
    calls: list[str] = []
    seen: list[str | None] = []
    with returning("outer", on_claim=lambda: calls.append("outer")):
        with returning("inner"):
            assert current_key() == "inner"
            claimed()  # no on_claim in this block: nothing is called
        assert current_key() == "outer"
        worker = threading.Thread(target=lambda: seen.append(current_key()))
        worker.start()
        worker.join()
        claimed()
    assert current_key() is None and seen == [None] and calls == ["outer"]
