"""ragbudget.planning: what a pipeline's request may hold and the admission sized from it, asked
of the backend's capacity record and never of its class — the shared FakeBackend with a memory
plan takes the local path, without one the engine's."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragbudget import BudgetError, ConfigError, Pipeline

QUESTION = "What was Maria Curie the first female recipient of?"


@pytest.fixture(scope="module")
def indexed(tmp_path_factory: pytest.TempPathFactory, repo_data: Path) -> Path:
    """The repo's data/ corpus indexed once with the model-free hash embedder."""
    index_dir = tmp_path_factory.mktemp("planning") / "idx"
    Pipeline(index_dir, embedder="hash:256").index([repo_data])
    return index_dir


def test_any_backend_that_plans_its_memory_takes_the_local_path(indexed: Path) -> None:
    # The pipeline asks the backend's capacity record, never its class: a fake that reports a
    # memory plan (as LocalBackend does) is budgeted, admitted and reported exactly as the local
    # generator is — the plan per reserved answer length, the KV capacity, the memory report.
    from _fakes import FakeBackend

    backend = FakeBackend(memory_plan={"gpu": "357MiB", "concurrency": 2})
    pipe = Pipeline(indexed, backend=backend, gpu="357MiB", max_new_tokens=64)
    assert not pipe.served
    plan = pipe.plan_for(64)
    assert plan is backend.plans[64] and plan.limited_by == "memory"
    assert pipe.request_plan() is plan
    assert pipe.admission.capacity_tokens == plan.kv_capacity_tokens
    answer = pipe.ask(QUESTION)
    b = answer.report["budget"]
    assert b["max_new_tokens"] == 64 and b["kv_capacity_tokens"] == plan.kv_capacity_tokens
    assert "plan" in answer.report and "engine" not in answer.report
    assert backend.calls[-1]["max_new_tokens"] == 64
    with pytest.raises(ConfigError, match="plans from memory: use plan_for"):
        pipe.engine_plan()
    # A question the memory cannot hold is refused by the plan, naming memory.
    with pytest.raises(BudgetError, match="memory"):
        pipe.ask("why " * (plan.max_prompt_tokens + 10))
    # The same fake without a plan is an engine: its own figures, no memory plan.
    served = Pipeline(indexed, backend=FakeBackend(), max_new_tokens=64)
    assert served.served and "engine" in served.ask(QUESTION).report
    with pytest.raises(ConfigError, match="no memory plan"):
        served.plan_for(64)
