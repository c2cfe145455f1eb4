"""A request's place at admission control (ragbudget.memory.tickets): enqueue() then wait()."""

from __future__ import annotations

import pytest

from ragbudget.errors import ConfigError, OverloadedError
from ragbudget.memory.admission import AdmissionController


def test_a_ticket_is_a_place_taken_without_waiting() -> None:
    """enqueue() is acquire() in two halves: the place at once (admitted or queued), the wait
    after; a queued ticket holds no reservation, and one admitted holds the same one however
    often it is asked."""
    ctl = AdmissionController(1000, max_queue=1, timeout=5.0)
    first, second = ctl.enqueue(800, prompt_tokens=700), ctl.enqueue(800)
    assert first.granted and not second.granted and ctl.stats().queued == 1
    assert first.max_wait == second.max_wait == 5.0
    with pytest.raises(ConfigError, match="still queued.*call wait"):
        second.reservation()
    with pytest.raises(OverloadedError, match="queue limit 1"):
        ctl.enqueue(100)
    held = first.reservation()
    assert held is first.reservation() and first.wait() is held and held.tokens == 800
    held.release()
    assert second.granted and second.wait(0).tokens == 800
    second.reservation().release()
    assert ctl.stats().admitted_tokens == 0 and ctl.stats().running == 0
    # A wait that ends before its turn leaves the queue and is refused with a Retry-After.
    ctl.enqueue(1000)
    late = ctl.enqueue(500)
    with pytest.raises(OverloadedError, match="waited 0.0s") as err:
        late.wait(0)
    assert err.value.retry_after > 0 and ctl.stats().queued == 0 and ctl.stats().timed_out_total == 1
