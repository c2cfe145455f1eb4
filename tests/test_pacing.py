"""The time rules drawn from the generator's measured speed: which target is in force, when a
provisional speed is looked at again, and which generators admission can be tuned for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ragbudget.generation.pacing import Pacing
from ragbudget.memory.calibration import CPU_TTFT_TARGET


@dataclass
class Stand:
    """A generator stand-in: no model to load, a device of its own."""

    device: str = "cpu"
    loaded: bool = False
    model: Any = None


def test_the_target_in_force() -> None:
    assert Pacing(None).target(Stand("cpu")) == CPU_TTFT_TARGET  # the CPU default
    assert Pacing(None).target(Stand("cuda:0")) is None  # no cap on an accelerator
    assert Pacing(0.5).target(Stand("cuda:0")) == 0.5  # a given target applies anywhere
    assert Pacing(0.0).target(Stand("cpu")) is None  # 0 turns it off
    assert Pacing(None).target(None) is None and Pacing(None).target(Stand("")) is None  # device unknown


def test_a_provisional_speed_is_looked_at_again_at_most_every_recheck() -> None:
    p = Pacing(None)
    assert not p.due(0.0)  # nothing measured
    p.entry = {"a": 0.001, "b": 0.0, "decode_s": 0.05}
    assert not p.due(0.0)  # measured on an idle host: final
    p.entry["provisional"] = True
    assert p.due(0.0) and p.due(0.0)
    assert not p.due(3600.0)  # just looked


def test_admission_is_tuned_only_for_a_loaded_model() -> None:
    assert not Pacing.loaded(None)
    assert not Pacing.loaded(Stand(loaded=False, model=object()))
    assert not Pacing.loaded(Stand(loaded=True, model=None))
    assert Pacing.loaded(Stand(loaded=True, model=object()))


def test_the_plan_is_left_alone_without_a_target() -> None:
    from ragbudget.memory.budget import plan_budget

    plan = plan_budget("Qwen/Qwen3-8B", gpu="24GiB", max_new_tokens=256)
    assert Pacing(None).cap(Stand("cuda:0"), plan) is plan
    assert Pacing(None).cap(None, plan) is plan
