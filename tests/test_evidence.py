"""Declining what the documents do not hold (issue #43 §3): under the evidence floor, ``ask``
answers "not in the documents" without calling the model, and says so in every face."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _fakes import FakeGenerator
from click.testing import CliRunner

from ragbudget import Pipeline
from ragbudget.cli.commands import cli
from ragbudget.evidence import CALIBRATED_FLOORS, DECLINED_TEXT, Evidence, evidence_floor

ON_TOPIC = "What was Maria Curie the first female recipient of?"


@pytest.fixture(scope="module")
def indexed(tmp_path_factory: pytest.TempPathFactory, repo_data: Path) -> Path:
    index_dir = tmp_path_factory.mktemp("evidence") / "idx"
    Pipeline(index_dir, embedder="hash:256").index([repo_data])
    return index_dir


def _pipe(index_dir: Path, **kw: Any) -> tuple[Pipeline, FakeGenerator]:
    gen = FakeGenerator()
    return Pipeline(index_dir, generator=gen, gpu="16GiB", **kw), gen


def test_the_floor_comes_from_the_setting_else_the_embedder() -> None:
    assert evidence_floor(None, "all-MiniLM-L6-v2+int8") == (
        CALIBRATED_FLOORS["all-MiniLM-L6-v2"],
        evidence_floor(None, "all-MiniLM-L6-v2")[1],
    )
    floor, why = evidence_floor(None, "BAAI/bge-small-en-v1.5")
    assert floor is None and "no floor measured" in why  # a cosine floor belongs to one embedder
    assert evidence_floor(0.3, "hash-64") == (0.3, "evidence_floor=0.3")
    assert evidence_floor(0.0, "all-MiniLM-L6-v2")[0] is None
    assert Evidence(score=0.5, floor=None, source="").declined is False
    assert Evidence(score=0.2, floor=0.3, source="").declined is True


def test_under_the_floor_ask_declines_without_calling_the_model(indexed: Path) -> None:
    pipe, gen = _pipe(indexed, evidence_floor=0.999)  # a hash embedder's sentences never reach it
    pieces: list[str] = []
    answer = pipe.ask(ON_TOPIC, on_text=pieces.append)
    assert answer.declined and answer.text == DECLINED_TEXT and "".join(pieces) == DECLINED_TEXT
    assert not gen.prompts  # no prompt rendered for the model, nothing generated
    assert answer.sources == [] and answer.report["budget"]["kv_tokens_reserved"] == 0
    e = answer.report["evidence"]
    assert e["declined"] and e["floor"] == 0.999 and 0 <= e["score"] < 0.999
    doc = answer.to_dict()
    assert doc["declined"] is True and doc["answer"] == DECLINED_TEXT
    # Over the floor the model answers, and the report carries the evidence it cleared.
    pipe, gen = _pipe(indexed, evidence_floor=0.01)
    answer = pipe.ask(ON_TOPIC)
    assert not answer.declined and gen.prompts and answer.report["evidence"]["score"] >= 0.01
    # No floor for an uncalibrated embedder (hash): nothing measured, nothing declined.
    pipe, gen = _pipe(indexed)
    answer = pipe.ask(ON_TOPIC)
    assert not answer.declined and answer.report["evidence"] is None and gen.prompts


def test_the_cli_says_it_declined(indexed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ragbudget.generation.generate as generate

    monkeypatch.setattr(generate, "Generator", lambda *a, **k: FakeGenerator())
    runner = CliRunner()
    args = ["ask", ON_TOPIC, "--index-dir", str(indexed), "--gpu", "16GiB", "--evidence-floor", "0.999"]
    text = runner.invoke(cli, args)
    assert text.exit_code == 0, text.output
    assert DECLINED_TEXT in text.output and "declined without generating" in text.output
    assert "--evidence-floor 0 always generates" in text.output
    doc = json.loads(runner.invoke(cli, [*args, "--json"]).stdout)
    assert doc["declined"] is True and doc["report"]["evidence"]["floor"] == 0.999
    explained = runner.invoke(cli, [*args, "--explain"])
    assert "Evidence" in explained.output and "under the evidence floor 0.999" in explained.output


@pytest.mark.model
def test_the_packaged_embedder_declines_what_the_documents_do_not_hold(tmp_path: Path, repo_data: Path) -> None:
    """The default floor, measured for the packaged MiniLM: an unrelated question is declined,
    the demo question is not."""
    index_dir = tmp_path / "idx"
    Pipeline(index_dir).index([repo_data], exclude=["model_configs"])
    pipe, gen = _pipe(index_dir)
    off = pipe.ask("What is the melting point of tungsten carbide in kelvin?")
    assert off.declined and not gen.prompts, off.report["evidence"]
    on = pipe.ask(ON_TOPIC)
    assert not on.declined and gen.prompts, on.report["evidence"]
    assert on.report["evidence"]["floor"] == CALIBRATED_FLOORS["all-MiniLM-L6-v2"]


@pytest.mark.server
def test_the_server_answers_a_declined_question_and_says_why(indexed: Path) -> None:
    import httpx
    import openai
    from _fakes import FakeBackend, running

    backend = FakeBackend()
    pipe = Pipeline(indexed, backend=backend, evidence_floor=0.999)
    with running(pipe) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60)
        messages = [{"role": "user", "content": ON_TOPIC}]
        whole = client.chat.completions.create(model="ragbudget", messages=messages)
        chunks = list(client.chat.completions.create(model="ragbudget", messages=messages, stream=True))
        metrics = httpx.get(f"{url}/metrics").text
    assert whole.choices[0].message.content == DECLINED_TEXT and whole.choices[0].finish_reason == "stop"
    extra = whole.model_extra or {}
    assert extra["sources"] == [] and extra["ragbudget"]["evidence"]["declined"] is True
    assert whole.usage is not None and whole.usage.prompt_tokens == 0 and whole.usage.completion_tokens == 0
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == DECLINED_TEXT
    assert (chunks[-1].model_extra or {})["ragbudget"]["evidence"]["declined"] is True
    assert not backend.calls  # the model was never asked
    assert "ragbudget_declined_total 2" in metrics


def test_calibration_asks_past_the_floor(indexed: Path) -> None:
    """serve's warm-up calibration asks a question whose answer it reads: a declined one would
    measure nothing (no prefill, no decode)."""
    from ragbudget.memory.admission import Throughput

    pipe, gen = _pipe(indexed, evidence_floor=0.5)
    assert pipe.evidence(Pipeline.CALIBRATION_QUESTION).declined  # the fixed question would be
    pipe.admission.configure(throughput=Throughput(prefill_a=1e-5, decode_s=0.005))
    answer = pipe.calibrate()
    assert answer is not None and not answer.declined and gen.prompts
