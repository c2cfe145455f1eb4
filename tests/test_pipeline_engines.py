"""Pipeline and the CLI generating on a served engine, against the replay servers of every engine
kind (tests/_replay.py): the allowance comes from the engine's own figures, counting and the chat
template from the engine (or a stated local estimate), counts are cached in the index folder, and
engine errors are one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _replay import Replay, Resp
from click.testing import CliRunner

from ragbudget import Pipeline
from ragbudget.cli.commands import cli as main
from ragbudget.cli.display import format_report
from ragbudget.errors import ConfigError, EngineConnectionError
from ragbudget.generation.backend import SQLiteCountCache, text_digest
from ragbudget.generation.engines import KINDS
from ragbudget.pipeline import EnginePlan

QUESTION = "How is the Project Leader elected?"


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def indexed(tmp_path_factory: pytest.TempPathFactory, repo_data: Path) -> Path:
    index_dir = tmp_path_factory.mktemp("engines") / "idx"
    Pipeline(index_dir, embedder="hash:256").index([repo_data])
    return index_dir


def _index_copy(indexed: Path, tmp_path: Path) -> Path:
    """A private copy of the index (each test gets its own counts.sqlite)."""
    import shutil

    dst = tmp_path / "idx"
    shutil.copytree(indexed, dst, ignore=shutil.ignore_patterns("counts.sqlite*"))
    return dst


def _pipe(index_dir: Path, srv: Replay, **kw: Any) -> Pipeline:
    if srv.kind == "openai":
        kw.setdefault("engine_context_tokens", 2048)  # a generic server does not say
    return Pipeline(index_dir, engine=srv.url, max_new_tokens=32, **kw)


def test_ask_on_each_engine_fits_its_window_and_says_why(indexed: Path, tmp_path: Path, kind: str) -> None:
    index_dir = _index_copy(indexed, tmp_path)
    with Replay(kind) as srv:
        pipe = _pipe(index_dir, srv)
        assert pipe.served
        answer = pipe.ask(QUESTION)
        assert answer.text.startswith("The Project Leader")
        b = answer.report["budget"]
        assert b["prompt_tokens"] <= b["max_prompt_tokens"]
        assert b["prompt_tokens"] + b["max_new_tokens"] <= b["max_context_tokens"]
        assert b["context_tokens_used"] <= b["context_tokens_allowed"]
        assert answer.sources, "something fits"
        engine = answer.report["engine"]
        assert engine["engine"]["kind"] == kind
        # every figure printed with its source and age
        assert any("max context" in line or "max prompt" in line for line in engine["lines"])
        assert all("s old" in line for line in engine["lines"][1:-2] if not line.startswith("note"))
        # max_tokens is always sent, and it is the reserved output
        sent = srv.calls("POST", "/v1/chat/completions") or srv.calls("POST", "/api/chat")
        body = sent[-1]
        assert body.get("max_tokens", (body.get("options") or {}).get("num_predict")) == 32
        text = format_report(answer.report)
        assert text.startswith("Engine") and "limited by" in text
        # the prompt the engine counted is the one the plan counted, where it counts exactly
        if kind in ("vllm", "tgi", "llamacpp"):
            assert b["engine_prompt_tokens"] == b["prompt_tokens"]


def test_the_window_binds_the_prompt(indexed: Path, tmp_path: Path) -> None:
    index_dir = _index_copy(indexed, tmp_path)
    with Replay("llamacpp") as srv:  # 2048 per slot in the replay
        pipe = _pipe(index_dir, srv, relevance_floor=0, span_floor=0)
        plan = pipe.engine_plan(question=QUESTION)
        assert isinstance(plan, EnginePlan)
        assert plan.max_context_tokens <= 2048
        answer = pipe.ask(QUESTION)
        assert answer.report["budget"]["prompt_tokens"] + 32 <= 2048
        assert answer.report["budget"]["fill"] > 0.5  # the allowance is used, not left empty


def test_context_tokens_caps_the_context_on_an_engine(indexed: Path, tmp_path: Path) -> None:
    index_dir = _index_copy(indexed, tmp_path)
    with Replay("vllm") as srv:
        pipe = _pipe(index_dir, srv)
        answer = pipe.ask(QUESTION, context_tokens=100)
        b = answer.report["budget"]
        assert b["context_tokens_allowed"] <= 100 and b["context_limit"]["limit"] == "context_tokens"


def test_a_rerun_counts_nothing_twice(indexed: Path, tmp_path: Path) -> None:
    index_dir = _index_copy(indexed, tmp_path)
    with Replay("vllm") as srv:
        _pipe(index_dir, srv).ask(QUESTION)
        # /tokenize with "prompt" counts a text; with "messages" it renders the chat template
        first = [b["prompt"] for b in srv.calls("POST", "/tokenize") if "prompt" in b]
        assert first, "the chunks were counted on the engine"
        assert (index_dir / "counts.sqlite").exists()
        # a new pipeline (a new process would be the same): the chunk counts come from the file
        _pipe(index_dir, srv).ask(QUESTION)
        again = [b["prompt"] for b in srv.calls("POST", "/tokenize") if "prompt" in b][len(first) :]
        counted_twice = set(again) & set(first)
        assert not counted_twice, f"{len(counted_twice)} texts counted again"
        cache = SQLiteCountCache(index_dir / "counts.sqlite")
        assert len(cache) == len(set(first))
        assert cache.get_many("Qwen/Qwen3-8B", [text_digest(first[0])])


#: Questions that count the chunks of the repo's index (100 of its 106 are among their candidates),
#: then new ones whose candidates are all among those (checked, not assumed).
WARM_UP = (
    QUESTION,
    "What does the dup2 system call do?",
    "Where is Warsaw's old town?",
    "What was Maria Curie the first female recipient of?",
    "What is oxygen?",
    "What is packet switching?",
)
NEW = (
    "Who elects the Project Leader?",
    "What does the close system call return?",
    "When was the old town of Warsaw rebuilt?",
    "How can the Technical Committee be overruled?",
)


def test_a_new_question_over_counted_chunks_asks_the_tokenizer_at_most_twice(indexed: Path, tmp_path: Path) -> None:
    """Issue #30 §2: span packing (the default) used to count every trial passage with the
    engine. Once the chunks a question retrieves have been counted (by earlier questions), a
    new question asks llama.cpp's /tokenize twice: its render for the allowance, and the final
    prompt's; the sentences are costed from pieces counted with the chunks."""
    index_dir = _index_copy(indexed, tmp_path)
    with Replay("llamacpp") as srv:
        pipe = _pipe(index_dir, srv)
        fetch_k = pipe.retrieval.fetch_k
        counted: set[object] = set()
        for q in WARM_UP:
            pipe.ask(q)
            counted |= {h.chunk_id for h in pipe.search(q, fetch_k)}
        for q in NEW:
            assert {h.chunk_id for h in pipe.search(q, fetch_k)} <= counted, q  # every candidate counted
            before = len(srv.calls("POST", "/tokenize"))
            answer = pipe.ask(q)
            assert len(srv.calls("POST", "/tokenize")) - before <= 2, q
            b = answer.report["budget"]
            assert (
                b["prompt_tokens"] <= b["max_prompt_tokens"] and b["context_tokens_used"] <= b["context_tokens_allowed"]
            )
            assert answer.report["pack"] == "spans" and answer.report["selection"]


#: Six questions as the issue's user asked them (#42 §5), each retrieving chunks none before it did
#: among its candidates.
SIX = (
    QUESTION,
    "What does the dup2 system call do?",
    "Where is Warsaw's old town?",
    "What was Maria Curie the first female recipient of?",
    "What is oxygen?",
    "What is packet switching?",
)


@pytest.mark.parametrize("through", ["ask", "conversation"])
def test_a_new_question_asks_the_engines_tokenizer_at_most_twice_template_included(
    indexed: Path, tmp_path: Path, through: str
) -> None:
    """Issue #42 §5: in front of llama.cpp, 5 requests to its tokenizer for the first question,
    then 3 ``/tokenize`` and 2 ``/apply-template`` for each new one. Now, after the first, a new
    question — with candidates never counted — asks at most twice, ``/apply-template`` counted
    (its fixed part goes with its candidates, the template is learnt once per system prompt),
    and a repeated one not at all; through ``Pipeline.ask`` and through a conversation, as
    ``serve`` asks. Exact all the same: the engine's count of what it was sent is ours."""
    from ragbudget.chat import Conversation

    index_dir = _index_copy(indexed, tmp_path)
    with Replay("llamacpp") as srv:
        pipe = _pipe(index_dir, srv)

        def tokenizer() -> int:
            return len(srv.calls("POST", "/tokenize")) + len(srv.calls("POST", "/apply-template"))

        def ask(q: str) -> Any:
            return pipe.ask(q) if through == "ask" else Conversation(pipe).ask(q).answer

        def asked(q: str) -> int:
            before = tokenizer()
            answer = ask(q)
            b = answer.report["budget"]
            assert b["prompt_tokens"] == b["engine_prompt_tokens"] <= b["max_prompt_tokens"], q
            return tokenizer() - before

        searcher = Pipeline(index_dir)
        seen: set[object] = set()
        for i, q in enumerate(SIX):
            fresh = {h.chunk_id for h in searcher.search(q, pipe.retrieval.fetch_k)}
            assert i == 0 or fresh - seen, q  # each new question brings candidates never counted
            seen |= fresh
        first = [asked(q) for q in SIX]
        again = [asked(q) for q in SIX]
    print(f"requests to the tokenizer, /apply-template included: {first} new, {again} repeated")
    assert max(first[1:]) <= 2, first
    assert again == [0] * len(SIX), again


def test_the_local_path_has_no_engine_plan(indexed: Path) -> None:
    from _fakes import GeneratorStub

    pipe = Pipeline(indexed, generator=GeneratorStub(), gpu="16GiB")  # type: ignore[arg-type]
    assert not pipe.served
    with pytest.raises(ConfigError, match="plan_for"):
        pipe.engine_plan()


def test_engine_pipelines_refuse_what_they_cannot_do(indexed: Path, tmp_path: Path) -> None:
    index_dir = _index_copy(indexed, tmp_path)
    with Replay("vllm") as srv:
        pipe = _pipe(index_dir, srv)
        with pytest.raises(ConfigError, match="no memory plan"):
            pipe.plan_for(32)
        with pytest.raises(ConfigError, match="no local generator"):
            pipe.generator  # noqa: B018
        with pytest.raises(ConfigError, match="top_k"):
            pipe.ask(QUESTION, top_k=5)
    with pytest.raises(ConfigError, match="not both"):
        Pipeline(index_dir, engine="http://127.0.0.1:9", generator=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="engine_kind"):
        Pipeline(index_dir, engine="http://127.0.0.1:9", engine_kind="nope")


def test_an_unreachable_engine_is_one_typed_error(indexed: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipe = Pipeline(_index_copy(indexed, tmp_path), engine=f"http://127.0.0.1:{port}")
    with pytest.raises(EngineConnectionError) as err:
        pipe.ask(QUESTION)
    assert f"127.0.0.1:{port}" in str(err.value) and "\n" not in str(err.value)


def test_streaming_and_cancel_go_through_the_engine(indexed: Path, tmp_path: Path) -> None:
    index_dir = _index_copy(indexed, tmp_path)
    with Replay("llamacpp") as srv:
        pipe = _pipe(index_dir, srv)
        with pipe.stream(QUESTION) as stream:
            pieces = list(stream)
        assert "".join(pieces).strip() == stream.answer.text
        assert srv.calls("POST", "/v1/chat/completions")[-1]["stream"] is True


# -- the CLI ---------------------------------------------------------------------------------------
def test_cli_budget_engine_prints_figures_with_sources(indexed: Path, tmp_path: Path, kind: str) -> None:
    index_dir = _index_copy(indexed, tmp_path)
    with Replay(kind) as srv:
        args = ["budget", "--engine", srv.url, "--index-dir", str(index_dir), "--max-new-tokens", "64"]
        if kind == "openai":
            args += ["--engine-context-tokens", "2048"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert f"engine: {kind} at {srv.url}" in result.output
        assert "s old" in result.output and "per request:" in result.output
        assert "limited by" in result.output
        as_json = CliRunner().invoke(main, [*args, "--json"])
        assert as_json.exit_code == 0, as_json.output
        import json

        doc = json.loads(as_json.output)
        assert doc["request"]["context_tokens"] > 0 and doc["engine"]["kind"] == kind


def test_cli_ask_engine_explain(indexed: Path, tmp_path: Path) -> None:
    index_dir = _index_copy(indexed, tmp_path)
    with Replay("tgi") as srv:
        result = CliRunner().invoke(
            main,
            [
                "ask",
                QUESTION,
                "--engine",
                srv.url,
                "--index-dir",
                str(index_dir),
                "--max-new-tokens",
                "16",
                "--explain",
            ],
        )
        assert result.exit_code == 0, result.output
        assert "The Project Leader" in result.output
        assert "Engine" in result.output and "engine: tgi" in result.output


def test_cli_ask_prints_one_budget_line_for_an_engine(indexed: Path, tmp_path: Path) -> None:
    # The same line as on a local model (test_cli), led by what set the allowance (issue #44 §2:
    # the CLI does not ask which kind of backend answered).
    index_dir = _index_copy(indexed, tmp_path)
    with Replay("vllm") as srv:
        args = ["ask", QUESTION, "--engine", srv.url, "--index-dir", str(index_dir), "--max-new-tokens", "16"]
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    line = [x for x in result.output.splitlines() if x.startswith("budget: ")]
    assert len(line) == 1 and line[0].startswith(f"budget: vllm at {srv.url}, context ")
    assert "tokens (limited by " in line[0] and line[0].endswith("--explain for every figure and its source")


def test_cli_engine_errors_are_one_line(indexed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    index_dir = _index_copy(indexed, tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = CliRunner().invoke(
        main, ["ask", QUESTION, "--engine", f"http://127.0.0.1:{port}", "--index-dir", str(index_dir)]
    )
    assert result.exit_code == 1
    assert f"127.0.0.1:{port}" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    monkeypatch.delenv("RB_TEST_KEY", raising=False)
    with Replay("vllm", api_key="sekrit") as srv:
        result = CliRunner().invoke(
            main, ["ask", QUESTION, "--engine", srv.url, "--index-dir", str(index_dir), "--api-key-env", "RB_TEST_KEY"]
        )
        assert result.exit_code == 1 and "RB_TEST_KEY" in result.output
        monkeypatch.setenv("RB_TEST_KEY", "wrong")
        result = CliRunner().invoke(
            main, ["ask", QUESTION, "--engine", srv.url, "--index-dir", str(index_dir), "--api-key-env", "RB_TEST_KEY"]
        )
        assert result.exit_code == 1 and srv.url in result.output
        assert len(result.output.strip().splitlines()) == 1
        monkeypatch.setenv("RB_TEST_KEY", "sekrit")
        result = CliRunner().invoke(
            main,
            [
                "ask",
                QUESTION,
                "--engine",
                srv.url,
                "--index-dir",
                str(index_dir),
                "--api-key-env",
                "RB_TEST_KEY",
                "--no-stream",
            ],
        )
        assert result.exit_code == 0, result.output
        srv.push(
            "POST",
            "/v1/chat/completions",
            Resp(status=500, json={"error": {"message": "boom", "type": "InternalServerError", "code": 500}}),
        )
        result = CliRunner().invoke(
            main,
            [
                "ask",
                QUESTION,
                "--engine",
                srv.url,
                "--index-dir",
                str(index_dir),
                "--api-key-env",
                "RB_TEST_KEY",
                "--no-stream",
            ],
        )
        assert result.exit_code == 1 and "Traceback" not in result.output


def test_a_generic_server_without_a_window_says_which_option_to_pass(indexed: Path, tmp_path: Path) -> None:
    index_dir = _index_copy(indexed, tmp_path)
    with Replay("openai") as srv:
        pipe = Pipeline(index_dir, engine=srv.url, max_new_tokens=32)
        with pytest.raises(ConfigError, match="engine_context_tokens"):
            pipe.ask(QUESTION)
        result = CliRunner().invoke(main, ["budget", "--engine", srv.url, "--index-dir", str(index_dir)])
        assert result.exit_code == 1 and "--engine-context-tokens" in result.output


def test_engine_options_without_an_engine_are_a_usage_error() -> None:
    result = CliRunner().invoke(main, ["ask", "q", "--engine-kind", "vllm"])
    assert result.exit_code == 2 and "need --engine URL" in result.output
    result = CliRunner().invoke(main, ["ask", "q", "--engine-timeout", "5"])
    assert result.exit_code == 2 and "--engine-timeout need --engine URL" in result.output


@pytest.mark.parametrize("command", ["budget", "ask", "chat", "serve"])
def test_every_command_with_engine_takes_engine_timeout(command: str) -> None:
    from ragbudget.settings import EngineSettings

    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0 and "--engine URL" in result.output
    # the default is the settings record's (None): drawn from the engine's speed, as the help says
    assert EngineSettings().timeout is None and "--engine-timeout" in result.output
    assert "[default: from the engine's measured speed" in " ".join(result.output.split())


def test_engine_timeout_bounds_each_engine_reply(indexed: Path, tmp_path: Path) -> None:
    """``--engine-timeout 1`` reaches the engine's client: a reply 4 s late is an engine time-out
    after a second, in one line, not an answer after the default 30 s allows it."""
    index_dir = _index_copy(indexed, tmp_path)
    with Replay("llamacpp") as srv:
        srv.push("POST", "/v1/chat/completions", Resp(delay=4.0, json={}))
        args = ["ask", QUESTION, "--engine", srv.url, "--index-dir", str(index_dir), "--no-stream"]
        result = CliRunner().invoke(main, [*args, "--max-new-tokens", "16", "--engine-timeout", "1"])
    assert result.exit_code == 1 and "gave no answer within 1 s" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_budget_engine_names_the_model_not_its_path(indexed: Path, tmp_path: Path) -> None:
    """llama-server names its model by the GGUF's absolute path: ``budget --engine`` shows the
    file name, in text and JSON."""
    import json

    index_dir = _index_copy(indexed, tmp_path)
    with Replay("llamacpp") as srv:
        srv.engine.model = "/srv/private-models/SmolLM2-135M-Instruct-Q4_1.gguf"
        args = ["budget", "--engine", srv.url, "--index-dir", str(index_dir)]
        text = CliRunner().invoke(main, args)
        as_json = CliRunner().invoke(main, [*args, "--json"])
    assert text.exit_code == 0 and as_json.exit_code == 0, text.output + as_json.output
    assert "model SmolLM2-135M-Instruct-Q4_1.gguf" in text.output
    assert json.loads(as_json.output)["engine"]["model"] == "SmolLM2-135M-Instruct-Q4_1.gguf"
    assert "private-models" not in text.output + as_json.output


def test_serve_engine_says_what_admission_is_sized_from(indexed: Path, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from ragbudget.server.app import create_app

    index_dir = _index_copy(indexed, tmp_path)
    with Replay("llamacpp") as srv:
        pipe = _pipe(index_dir, srv)
        with TestClient(create_app(pipe)) as client:
            health = client.get("/health").json()
            assert health["status"] == "ok" and "GET /props" in health["admission"]
            r = client.post(
                "/v1/chat/completions",
                json={"model": "ragbudget", "max_tokens": 16, "messages": [{"role": "user", "content": QUESTION}]},
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["message"]["content"].startswith("The Project Leader")
            assert body["sources"] and body["usage"]["completion_tokens"] <= 16
            sent = srv.calls("POST", "/v1/chat/completions")[-1]
            assert sent["max_tokens"] == 16
    with Replay("openai") as srv:  # reports no KV cache and no slots: admission fails open
        pipe = _pipe(index_dir, srv)
        with TestClient(create_app(pipe)) as client:
            health = client.get("/health").json()
            assert health["admission"].startswith("open") and "capacity_tokens" not in health
