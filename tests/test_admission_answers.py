"""Admission's time model and the answer's length: what the first requests of a burst are priced
at before any answer has ended, and how that moves once answers end (issue #45's serve miss:
64 clients, answers of 6 tokens of 256, clients told to come back after 674 s of a burst that
the host drained in about a minute). Figures of the speed are the packaged Qwen 0.5B's as this
project's 2-core host measured them; a fake clock, no model."""

from __future__ import annotations

import pytest

from ragbudget.errors import OverloadedError
from ragbudget.memory.admission import AdmissionController
from ragbudget.memory.schedule import Learning, Throughput

#: prefill.json's entry for qwen2.5-coder-0.5b-instruct on this host (s/token, s/step).
QWEN = Throughput(
    prefill_a=0.0048, prefill_b=4.2e-7, decode_s=0.148, decode_extra_s=0.0397, batched=True, slowdown=1.13
)
PROMPT, NEW = 400, 256


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _burst(ctl: AdmissionController, clients: int) -> tuple[list, list[float]]:
    """``clients`` requests at once, each under its own key: the tickets, and the Retry-After of
    each one refused."""
    tickets, retries = [], []
    for i in range(clients):
        with ctl.returning(f"client-{i}"):
            try:
                tickets.append(ctl.enqueue(PROMPT + NEW, prompt_tokens=PROMPT))
            except OverloadedError as exc:
                retries.append(exc.retry_after)
    return tickets, retries


def _warmed(clock: Clock) -> AdmissionController:
    """A controller after serve's warm-up: one calibration answer that used its 16 tokens."""
    ctl = AdmissionController(20 * (PROMPT + NEW), max_queue=64, timeout=30.0, throughput=QWEN, clock=clock)
    warm = ctl.acquire(PROMPT + 16, prompt_tokens=PROMPT)
    clock.t += 5
    warm.finish(new_tokens=16)
    warm.release()
    return ctl


def test_learning_prices_a_return_at_the_floor_until_answers_as_long_were_allowed() -> None:
    learnt = Learning()
    learnt.answered(16, 16)  # the warm-up: its whole (tiny) cap
    assert learnt.expected_new_tokens(NEW) == NEW  # the worst case, for the start rule
    assert learnt.expected_new_tokens(NEW, soonest=True) == 13  # 5% of 256: nothing says more
    learnt.answered(6, NEW)  # a real answer: 6 of its 256
    # Tokens generated over tokens allowed: the warm-up's 16 weigh a sixteenth of the real one's.
    assert learnt.answer_share == pytest.approx((16 + 6) / (16 + NEW))
    assert learnt.expected_new_tokens(NEW, soonest=True) == learnt.expected_new_tokens(NEW) == 21


def test_the_longest_answers_ending_last_do_not_make_the_share() -> None:
    """A burst's long answers end last: 25 answers of 10 tokens, then 5 that ran to the cap.
    Every answer of the window weighs alike (0.2), where a moving average weighted to the latest
    read 0.69 at the next burst (the probe of 2026-12-07) and priced its answers 3.5 times long."""
    learnt = Learning()
    for done in [10] * 25 + [NEW] * 5:
        learnt.answered(done, NEW)
    assert learnt.answer_share == pytest.approx((25 * 10 + 5 * NEW) / (30 * NEW))
    for _ in range(Learning.ANSWER_WINDOW):  # the window moves on: old answers leave it
        learnt.answered(NEW, NEW)
    assert learnt.answer_share == 1.0


def test_a_burst_before_any_answer_ends_is_not_sent_back_for_the_worst_case() -> None:
    """64 clients at once after warm-up: the refused are told to come back within the time the
    host needs for answers of the floor's length, spaced out in the order they were refused —
    not after the whole max_new_tokens of everyone ahead (674 s in the measured burst)."""
    clock = Clock()
    ctl = _warmed(clock)
    tickets, retries = _burst(ctl, 64)
    assert len(retries) >= 30  # the worst case still decides who waits (the start rule)
    assert retries == sorted(retries)  # each told a later time than the one refused before it
    # Never later than the whole burst served one at a time with answers of the floor's length
    # (283 s here; the old pricing told 284 s to the first refused and 912 s to the last).
    one_by_one = 64 * (QWEN.prefill_seconds(PROMPT) + QWEN.decode_seconds(13)) * QWEN.slowdown
    assert max(retries) <= one_by_one, (retries, one_by_one)


def test_an_answer_that_ends_prices_every_answer_still_running_again() -> None:
    """The work ahead once the first answers end short: the requests already running and queued
    are priced at the share just learnt, not at the worst case they arrived under."""
    clock = Clock()
    ctl = _warmed(clock)
    tickets, _ = _burst(ctl, 24)
    ahead = ctl.stats().work_ahead_s
    assert ahead is not None and ahead > 20 * NEW * QWEN.decode_s  # every answer priced whole
    first = next(t for t in tickets if t.granted)
    clock.t += 10
    reservation = first.reservation()
    reservation.finish(new_tokens=6)
    reservation.release()
    after = ctl.stats().work_ahead_s
    assert after is not None and after < ahead / 5, (ahead, after)
