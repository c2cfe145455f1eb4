"""A question's way through the stages (issue #44 §1): ``Pipeline.ask`` walks search → plan →
pack → render → admit → generate → answer, each once, in that order — checked on real asks by
watching the real components (the index's search, the backend's capacity, the packer, the
renderer, admission and generation), locally and on a served engine, and on the
:class:`~ragbudget.request.RequestContext` record the walk fills."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _fakes import FakeGenerator
from _replay import Replay

from ragbudget import Pipeline
from ragbudget.packing.packer import ChunkPacker, SpanPacker
from ragbudget.request import STAGES, RequestContext

QUESTION = "How is the Project Leader elected?"


@pytest.fixture(scope="module")
def indexed(tmp_path_factory: pytest.TempPathFactory, repo_data: Path) -> Path:
    index_dir = tmp_path_factory.mktemp("walk") / "idx"
    Pipeline(index_dir, embedder="hash:256").index([repo_data])
    return index_dir


def _spy(calls: list[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return fn(*args, **kwargs)

    return wrapped


def _watch(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call the walk makes into a stage's component, in order."""
    calls: list[str] = []

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return _spy(calls, name, fn)

    store, backend, builder, admission = pipe.store, pipe.backend, pipe.prompt_builder, pipe.admission
    monkeypatch.setattr(store, "search", spy("search", store.search))
    monkeypatch.setattr(backend, "capacity", spy("capacity", backend.capacity))
    monkeypatch.setattr(builder, "render", spy("render", builder.render))
    monkeypatch.setattr(admission, "acquire", spy("admit", admission.acquire))
    monkeypatch.setattr(backend, "generate", spy("generate", backend.generate))
    for cls in (ChunkPacker, SpanPacker):
        monkeypatch.setattr(cls, "pack", spy("pack", cls.pack))
        monkeypatch.setattr(cls, "shrink", spy("shrink", cls.shrink))
    return calls


@pytest.mark.parametrize("pack", ["spans", "chunks"])
def test_a_question_walks_each_stage_once_in_order(indexed: Path, monkeypatch: pytest.MonkeyPatch, pack: str) -> None:
    pipe = Pipeline(indexed, generator=FakeGenerator(), gpu="16GiB", pack=pack)
    pipe.ask(QUESTION)  # the first request loads what it needs (and reads the capacity once before)
    calls = _watch(pipe, monkeypatch)
    answer = pipe.ask(QUESTION)
    assert calls == ["search", "capacity", "pack", "render", "admit", "generate"]
    assert answer.report["stages"] == list(STAGES)
    b = answer.report["budget"]
    assert b["prompt_tokens"] == b["fixed_prompt_tokens"] + b["context_tokens_used"]
    assert set(answer.report["timings"]) >= {"retrieve_s", "plan_s", "select_s", "queue_s", "generate_s", "total_s"}


def test_on_a_served_engine_the_walk_is_the_same(
    indexed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index_dir = tmp_path / "idx"
    shutil.copytree(indexed, index_dir)
    with Replay("vllm") as srv:
        pipe = Pipeline(index_dir, engine=srv.url, max_new_tokens=32)
        pipe.ask(QUESTION)
        calls = _watch(pipe, monkeypatch)
        answer = pipe.ask(QUESTION)
    assert answer.text.startswith("The Project Leader")
    assert calls == ["search", "capacity", "pack", "render", "admit", "generate"]
    assert answer.report["stages"] == list(STAGES)


def test_stored_sentence_vectors_are_read_in_the_search_not_while_packing(
    repo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An index that stores its sentences' vectors: the search stage reads the candidates' vectors
    # (one lookup, the generation pinned); neither the evidence measure nor span packing reaches
    # back into the index for them.
    index_dir = tmp_path / "idx"
    Pipeline(index_dir, embedder="hash:256").index([repo_data], sentence_vectors=True)
    pipe = Pipeline(index_dir, generator=FakeGenerator(), gpu="16GiB", pack="spans", evidence_floor=0.01)
    pipe.ask("Who may vote?")
    calls = _watch(pipe, monkeypatch)
    scorer = pipe.span_scorer
    assert scorer is not None and scorer.stored is not None
    monkeypatch.setattr(scorer, "stored", _spy(calls, "sentence vectors", scorer.stored))
    embedded = scorer.embedded
    pipe.ask(QUESTION)
    assert calls[:2] == ["search", "sentence vectors"] and calls.count("sentence vectors") == 1
    assert calls[2:] == ["capacity", "pack", "render", "admit", "generate"]
    assert scorer.embedded == embedded  # every sentence scored came from the index


def test_a_declined_question_stops_after_the_search(indexed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = Pipeline(indexed, generator=FakeGenerator(), gpu="16GiB", evidence_floor=0.99)
    pipe.ask(QUESTION)
    calls = _watch(pipe, monkeypatch)
    answer = pipe.ask("What colour is the moon's far side at noon?")
    assert answer.report["evidence"]["declined"] and calls == ["search"]  # no plan, no prompt, no model call
    assert answer.report["stages"] == ["search", "answer"]


def test_the_context_record_times_its_stages_in_order() -> None:
    ctx = RequestContext(question="q", query="q", max_new_tokens=8)
    with ctx.timed("search", "retrieve_s"):
        pass
    ctx.enter("plan")
    assert ctx.stages == ["search", "plan"] and ctx.timings["retrieve_s"] >= 0
    assert ctx.finish()["total_s"] >= ctx.timings["retrieve_s"]
