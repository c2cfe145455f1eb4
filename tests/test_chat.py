"""Conversation memory: one budget for history, context and output; summary folding; follow-ups.

A real :class:`~ragbudget.pipeline.Pipeline` over a small real index (tests/_fakes.py
``corpus_index``) generates on the shared model-free ``FakeBackend``: one token per word, a
ChatML-like template, a window of ``total`` tokens. It records every prompt the "model" got and
counts the ones that did not fit, so overruns are checked against what it actually received.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from _fakes import (
    FakeBackend,
    FakeGeneration,
    GeneratorStub,
    WordCounter,
    WordTokenizer as HFWordTokenizer,
    corpus_index,
)

from ragbudget.chat import (
    SUMMARY_PREFIX,
    Conversation,
    SummaryCache,
    Turn,
)
from ragbudget.errors import BudgetError, ConfigError
from ragbudget.generation.backend import Capacity, Sampling
from ragbudget.pipeline import Pipeline

# Nearly every test retrieves from the index built with the packaged MiniLM (tests/_needs.py).
pytestmark = pytest.mark.model

# --- the pipeline ---------------------------------------------------------------------------------


class ChatTemplate:
    """ChatML-like: every message costs its words plus two marker tokens."""

    chat_template = "chatml"

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, tokenize: bool = False, add_generation_prompt: bool = False
    ) -> str:
        assert tokenize is False
        out = "".join(f"<start>{m['role']} {m['content']} <end>\n" for m in messages)
        return out + ("<start>assistant " if add_generation_prompt else "")


SYSTEM = "Answer from the documents and cite them"
#: The system prompt of the summaries Conversation asks for (how the fake tells them apart).
SUMMARY_SYSTEM = "You keep a running summary"


#: ... and of the follow-up's rewrite.
REWRITE_SYSTEM = "You rewrite the user's latest question"


def _is_summary(messages: list[dict[str, str]]) -> bool:
    return messages[0]["content"].startswith(SUMMARY_SYSTEM)


def _is_rewrite(messages: list[dict[str, str]]) -> bool:
    return messages[0]["content"].startswith(REWRITE_SYSTEM)


def chat_pipeline(
    *,
    total: int = 400,
    max_new: int = 40,
    answer_words: int = 40,
    summary_words: int = 500,
    summary: Any = None,
    rewrite: Any = None,
    kv_tokens: int | None = None,
) -> Pipeline:
    """A real Pipeline whose FakeBackend has a ``total``-token window (and ``kv_tokens`` of KV, the
    admission capacity, when given). Answers are ``answer<n>-word<i>`` × ``answer_words``;
    summaries are the words of the transcript, ``summary_words`` of them (more than the cap
    allows: the cap is what keeps them short), or what ``summary(messages)`` returns; a
    follow-up's rewrite is what ``rewrite(messages)`` returns (a string)."""
    n = {"answers": 0}

    def reply(messages: list[dict[str, str]], max_new_tokens: int) -> Any:
        if _is_rewrite(messages):
            return str(rewrite(messages) if rewrite else "").split()[:max_new_tokens]
        if _is_summary(messages):
            if summary is not None:
                return summary(messages)
            return re.findall(r"\w+", messages[-1]["content"])[: min(summary_words, max_new_tokens)]
        n["answers"] += 1
        return [f"answer{n['answers']}-word{i}" for i in range(min(answer_words, max_new_tokens))]

    capacity = Capacity(
        max_context_tokens=total,
        max_context_source="fake",
        kv_tokens_total=kv_tokens,
        kv_total_source="fake" if kv_tokens else "",
    )
    backend = FakeBackend(WordCounter(), template=ChatTemplate(), reply=reply, capacity=capacity)
    # Placeholder questions ("Question number 3 about ...") the corpus answers loosely: no evidence
    # floor, so every first turn reaches the backend (declining: tests/test_evidence.py).
    return Pipeline(
        corpus_index(),
        backend=backend,
        max_new_tokens=max_new,
        system_prompt=SYSTEM,
        relevance_floor=0,
        evidence_floor=0,
    )


def fake(pipe: Pipeline) -> FakeBackend:
    backend = pipe.backend
    assert isinstance(backend, FakeBackend)
    return backend


def answers(pipe: Pipeline) -> list[dict[str, Any]]:
    """The answer generations the "model" got (not the summaries nor the rewrites)."""
    return [c for c in fake(pipe).calls if not _is_summary(c["messages"]) and not _is_rewrite(c["messages"])]


def rewrites(pipe: Pipeline) -> list[dict[str, Any]]:
    return [c for c in fake(pipe).calls if _is_rewrite(c["messages"])]


def summaries(pipe: Pipeline) -> list[dict[str, Any]]:
    return [c for c in fake(pipe).calls if _is_summary(c["messages"])]


def history_of(call: dict[str, Any]) -> list[dict[str, str]]:
    """The history an answer's prompt carried: between the system prompt and the question."""
    return call["messages"][1:-1]


def prompt_tokens(pipe: Pipeline, messages: list[dict[str, str]]) -> int:
    return fake(pipe).render(messages).n_tokens


def chunks(turn: Any) -> list[str]:
    """The corpus documents a turn's context held, by name."""
    return [src["path"].rsplit("/", 1)[-1].removesuffix(".md") for src in turn.sources]


# --- the budget ---------------------------------------------------------------------------------------


def test_ten_turns_over_budget_keep_answering_with_summary_and_no_overrun() -> None:
    pipe = chat_pipeline(total=400, max_new=40, answer_words=40)
    chat = Conversation(pipe, history_share=0.3, summary_max_tokens=30, recent_turns=2)
    questions = [f"Question number {i} about the PDF cleaner and the KV budget?" for i in range(10)]
    turns = [chat.ask(q) for q in questions]

    # History grew past its share: the summary engaged, and every turn still fits.
    assert any(t.budget.summary_updated for t in turns)
    assert chat.turns_summarized > 0 and chat.summary
    assert fake(pipe).overruns == 0
    for t, call in zip(turns, answers(pipe), strict=False):
        b = t.budget
        assert not b.overrun
        assert b.prompt + b.output <= b.total
        assert b.summary + b.recent <= b.history_allowed
        # The summary text is capped at 30; the rest is its prefix and the template markers.
        assert b.summary <= 30 + len(SUMMARY_PREFIX.split()) + 2
        assert b.context_used <= b.context_allowed
        assert call["question"] == t.question  # never truncated, never rewritten for the generator
        assert call["prompt_tokens"] == b.prompt
    # Without memory management, the 10th turn's verbatim history alone (9 turns x ~55 tokens)
    # would not fit the 400-token request; the summary is what made room.
    builder, history = pipe.prompt_builder, chat.history_messages(turns=[*_all_turns(turns)], summary="")
    full = builder.with_history(history).fixed_tokens(questions[-1]) - builder.fixed_tokens(questions[-1])
    assert full > 400
    # The most recent turns are verbatim in the last prompt, the summary comes first.
    last_history = history_of(answers(pipe)[-1])
    assert last_history[0]["content"].startswith(SUMMARY_PREFIX)
    assert last_history[-2] == {"role": "user", "content": questions[-2]}
    assert last_history[-1]["content"] == turns[-2].text


def _all_turns(turns: list[Any]) -> list[Any]:

    return [Turn(t.question, t.text) for t in turns]


def test_history_accounting_is_exact_after_the_template() -> None:
    pipe = chat_pipeline(total=2000, max_new=40, answer_words=12)
    chat = Conversation(pipe, history_share=0.5, recent_turns=5)
    chat.ask("What does the PDF cleaner strip?")
    turn = chat.ask("How is the KV budget computed from GPU memory?")
    call = answers(pipe)[-1]
    # Recompute the prompt without the history: the difference is what history really cost.
    without = prompt_tokens(pipe, [call["messages"][0], call["messages"][-1]])
    assert history_of(call) and turn.budget.summary + turn.budget.recent == call["prompt_tokens"] - without
    assert turn.budget.summary == 0 and turn.budget.turns_verbatim == 1


def test_report_shows_tokens_for_summary_recent_context_and_output() -> None:
    pipe = chat_pipeline()
    turn = Conversation(pipe).ask("How is the KV budget computed?")
    memory = turn.to_dict()["memory"]
    for key in ("summary", "recent", "context_used", "context_allowed", "output", "total", "prompt", "history"):
        assert key in memory
    assert memory["output"] == 40
    assert turn.answer.report["memory"] == memory


def test_history_share_is_configurable_and_retrieval_gets_the_rest() -> None:
    small, large = chat_pipeline(), chat_pipeline()
    a = Conversation(small, history_share=0.1)
    b = Conversation(large, history_share=0.6)
    for q in (
        "First question about dedup shingles?",
        "Second question about PDF headers?",
        "Third question about the KV budget?",
    ):
        ta, tb = a.ask(q), b.ask(q)
    assert ta.budget.history_allowed < tb.budget.history_allowed
    assert ta.budget.history <= ta.budget.history_allowed
    assert ta.budget.context_allowed > tb.budget.context_allowed
    # Unused history share is not wasted: it goes to retrieval.
    room = ta.budget.prompt_allowed - ta.budget.fixed
    assert ta.budget.context_allowed == room - ta.budget.history


def test_zero_history_share_keeps_no_history() -> None:
    pipe = chat_pipeline()
    chat = Conversation(pipe, history_share=0.0)
    chat.ask("What is MinHash used for?")
    turn = chat.ask("And the KV budget?")
    assert turn.budget.history == 0
    assert history_of(answers(pipe)[-1]) == []
    assert fake(pipe).overruns == 0


def test_summary_comes_from_the_generator_and_is_capped() -> None:
    pipe = chat_pipeline(total=300, max_new=40, answer_words=50)
    chat = Conversation(pipe, summary_max_tokens=20, recent_turns=1)
    for i in range(5):
        chat.ask(f"Question {i} on the KV budget and GPU memory?")
    assert summaries(pipe), "the summary must be written by the pipeline's generator"
    assert all(c["max_new_tokens"] <= 20 for c in summaries(pipe))
    assert WordCounter().count(chat.summary) <= 20
    # The summarization prompt also fits the one per-request budget.
    for c in summaries(pipe):
        assert prompt_tokens(pipe, c["messages"]) + c["max_new_tokens"] <= 300


def test_empty_generator_summary_falls_back_to_extractive() -> None:
    pipe = chat_pipeline(total=300, max_new=40, answer_words=50, summary=lambda messages: [])
    chat = Conversation(pipe, summary_max_tokens=40, recent_turns=1)
    for i in range(5):
        chat.ask(f"Question {i} on MinHash shingles?")
    assert chat.summary.startswith("Asked:")
    assert fake(pipe).overruns == 0


def test_custom_summarizer_and_reset() -> None:
    seen: list[int] = []

    def summarize(previous: str, turns: Any, cap: int) -> str:
        seen.append(len(turns))
        return f"{previous} folded {len(turns)}".strip()

    pipe = chat_pipeline(total=300, answer_words=50)
    chat = Conversation(pipe, summarizer=summarize, recent_turns=1)
    for i in range(6):
        chat.ask(f"Question {i} about PDF footers?")
    assert seen and chat.summary.startswith("folded")
    assert not summaries(pipe)
    chat.reset()
    assert chat.summary == "" and chat.turns == [] and chat.turns_summarized == 0
    chat.ask("Fresh start: what is dedup?")
    assert history_of(answers(pipe)[-1]) == []


def test_question_is_never_truncated_and_too_long_is_a_budget_error() -> None:
    pipe = chat_pipeline(total=200, max_new=40)
    long_q = " ".join(["word"] * 120) + "?"
    turn = Conversation(pipe).ask(long_q)
    assert answers(pipe)[-1]["question"] == long_q and turn.question == long_q
    with pytest.raises(BudgetError, match="question alone"):
        Conversation(pipe).ask(" ".join(["word"] * 400))


def test_a_conversation_on_a_backend_that_plans_its_memory_fits_each_turn_to_that_plan() -> None:
    # The shared fake on the local path (a memory plan in its capacity record): chat budgets each
    # turn by the plan for its reserved answer, refuses by memory, and the banner shows the plan.
    from ragbudget.cli.display import chat_banner

    backend = FakeBackend(WordCounter(), template=ChatTemplate(), memory_plan={"gpu": "357MiB"})
    # "Warsaw" is not in the corpus: no evidence floor, since the plan is what this test reads.
    pipe = Pipeline(
        corpus_index(), backend=backend, gpu="357MiB", max_new_tokens=40, relevance_floor=0, evidence_floor=0
    )
    chat = Conversation(pipe)
    turn = chat.ask("What is Warsaw known for?")
    plan = backend.plans[40]
    assert plan.limited_by == "memory" and not pipe.served
    assert turn.budget.total <= plan.max_context_tokens and not turn.budget.overrun
    assert turn.answer.report["budget"]["kv_capacity_tokens"] == plan.kv_capacity_tokens
    assert f"KV {plan.kv_bytes_per_token} B/token" in chat_banner(chat)
    with pytest.raises(BudgetError, match="the KV memory holds"):
        Conversation(pipe).ask(" ".join(["word"] * (plan.max_context_tokens + 10)))


def test_invalid_settings_are_config_errors() -> None:
    pipe = chat_pipeline()
    for kwargs in (
        {"history_share": 1.0},
        {"history_share": -0.1},
        {"summary_max_tokens": 0},
        {"recent_turns": -1},
        {"summary_role": "tool"},
    ):
        with pytest.raises(ConfigError):
            Conversation(pipe, **kwargs)
    with pytest.raises(ConfigError):
        Conversation(pipe).ask("   ")


# --- follow-ups -----------------------------------------------------------------------------------


FIRST = "How does trafilatura remove HTML boilerplate?"


def test_follow_up_retrieves_the_right_chunks() -> None:
    pipe = chat_pipeline(total=400, max_new=40)
    chat = Conversation(pipe)
    chat.ask(FIRST)
    turn = chat.ask("what about its footer?")
    assert "html" in turn.retrieval_query and "trafilatura" in turn.retrieval_query
    assert answers(pipe)[-1]["question"] == "what about its footer?"  # the generator gets it verbatim
    assert chunks(turn)[0] == "html-footer"  # the best passage is the right one
    # Without expansion the bare question's best passage is the PDF footer.
    plain = chat_pipeline(total=400, max_new=40)
    chat2 = Conversation(plain, expand_follow_ups=False)
    chat2.ask(FIRST)
    assert chunks(chat2.ask("what about its footer?"))[0] != "html-footer"


STANDALONE = "How does trafilatura treat the footer of an HTML page?"


def test_the_model_rewrites_a_follow_up_and_retrieval_searches_by_it() -> None:
    pipe = chat_pipeline(total=400, max_new=40, rewrite=lambda m: f"Standalone question: {STANDALONE}")
    chat = Conversation(pipe, rewrite_with_model=True)
    first = chat.ask(FIRST)
    assert rewrites(pipe) == [] and "follow_up" not in first.answer.report  # nothing before it to lean on
    turn = chat.ask("what about its footer?")
    [request] = rewrites(pipe)
    asked = request["messages"][-1]["content"]
    assert FIRST in asked and "answer1-word0" in asked and asked.index(FIRST) < asked.index("what about its footer?")
    assert request["max_new_tokens"] == 64 and request["stop"] == ["\n"]
    # The model's question, then the terms of the earlier one it lacks.
    assert turn.retrieval_query == f"{STANDALONE} remove boilerplate"
    assert answers(pipe)[-1]["question"] == "what about its footer?"  # the generator gets it verbatim
    assert chunks(turn)[0] == "html-footer"
    assert turn.answer.report["follow_up"] == {"retrieval_query": turn.retrieval_query, "written_by": "model"}
    assert turn.answer.report["timings"]["rewrite_s"] > 0
    assert fake(pipe).overruns == 0
    # A question that stands alone is searched as it is: no rewrite asked.
    alone = chat.ask("How does the PDF cleaner strip repeated page headers from the text layer?")
    assert len(rewrites(pipe)) == 1 and alone.retrieval_query == alone.question


def test_a_rewrite_that_answers_instead_falls_back_to_the_terms() -> None:
    pipe = chat_pipeline(total=400, max_new=40, rewrite=lambda m: "The footer is removed with the boilerplate.")
    chat = Conversation(pipe, rewrite_with_model=True)
    chat.ask(FIRST)
    turn = chat.ask("what about its footer?")
    assert len(rewrites(pipe)) == 1
    assert "trafilatura" in turn.retrieval_query and turn.retrieval_query.startswith("what about its footer?")
    follow_up = turn.answer.report["follow_up"]
    assert follow_up["written_by"] == "terms" and "no standalone question" in follow_up["fallback"]
    assert chunks(turn)[0] == "html-footer"


def test_a_rewrite_repeating_the_earlier_question_falls_back_to_the_terms() -> None:
    pipe = chat_pipeline(total=400, max_new=40, rewrite=lambda m: FIRST)
    chat = Conversation(pipe)
    chat.ask(FIRST)
    turn = chat.ask("what about its footer?")
    assert turn.retrieval_query.startswith("what about its footer?") and "trafilatura" in turn.retrieval_query
    assert "no standalone question" in turn.answer.report["follow_up"]["fallback"]


def test_the_rewrite_is_the_default_and_off_with_either_switch() -> None:
    for options, asked in (
        ({}, 1),
        ({"rewrite_with_model": False}, 0),
        ({"rewrite_with_model": True, "expand_follow_ups": False}, 0),
    ):
        pipe = chat_pipeline(total=400, max_new=40, rewrite=lambda m: STANDALONE)
        chat = Conversation(pipe, **options)
        chat.ask(FIRST)
        turn = chat.ask("what about its footer?")
        assert len(rewrites(pipe)) == asked, options
        assert turn.retrieval_query.startswith(STANDALONE) == bool(asked), options


def test_the_rewrite_sees_the_newest_exchanges_that_fit_its_request() -> None:
    pipe = chat_pipeline(total=400, max_new=40, rewrite=lambda m: STANDALONE)
    history: list[dict[str, str]] = []
    for i in range(4):
        history += [
            {"role": "user", "content": f"Question {i} about trafilatura and HTML pages?"},
            {"role": "assistant", "content": " ".join(f"a{i}-{k}" for k in range(150))},
        ]
    chat = Conversation.from_messages(pipe, history, rewrite_with_model=True, recent_turns=4)
    turn = chat.ask("what about its footer?")
    [request] = rewrites(pipe)
    asked = request["messages"][-1]["content"]
    # Each answer cut to 96 tokens, and only the newest exchanges that fit 400 - 64 tokens.
    assert "a3-95" in asked and "a3-96" not in asked and "Question 3" in asked and "Question 0" not in asked
    assert prompt_tokens(pipe, request["messages"]) + 64 <= 400
    assert fake(pipe).overruns == 0 and turn.retrieval_query.startswith(STANDALONE)


def test_a_client_gone_before_the_rewrite_leaves_nothing_asked() -> None:
    import threading

    pipe = chat_pipeline(total=400, max_new=40, rewrite=lambda m: STANDALONE)
    chat = Conversation(pipe, rewrite_with_model=True)
    chat.ask(FIRST)
    cancel = threading.Event()
    cancel.set()
    turn = chat.ask("what about its footer?", cancel=cancel)
    assert turn.cancelled and rewrites(pipe) == [] and len(answers(pipe)) == 1


# --- the chat command (the CLI) --------------------------------------------------------------------


def test_chat_command_with_piped_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from ragbudget.cli.commands import cli

    made: list[Pipeline] = []

    def factory(*args: Any, **kwargs: Any) -> Pipeline:
        made.append(chat_pipeline())
        return made[-1]

    monkeypatch.setattr("ragbudget.pipeline.Pipeline", factory)
    result = CliRunner().invoke(
        cli,
        ["chat", "--history-share", "0.2", "--recent-turns", "1"],
        input="What is MinHash?\nand its shingles?\n/exit\n",
    )
    assert result.exit_code == 0, result.output
    assert len(answers(made[0])) == 2
    assert "Sources:" in result.output
    result = CliRunner().invoke(cli, ["chat", "--json"], input="What is MinHash?\n")
    assert result.exit_code == 0, result.output
    assert '"memory"' in result.output
    result = CliRunner().invoke(cli, ["chat", "--history-share", "1.5"], input="")
    assert result.exit_code == 2
    # --rewrite-follow-ups (the default): the follow-up is searched by the model's standalone
    # question; --expand-follow-ups: by the earlier question's terms.
    made.clear()
    monkeypatch.setattr(
        "ragbudget.pipeline.Pipeline",
        lambda *a, **kw: made.append(chat_pipeline(rewrite=lambda m: STANDALONE)) or made[-1],
    )
    result = CliRunner().invoke(
        cli, ["chat", "--rewrite-follow-ups", "--json"], input=f"{FIRST}\nwhat about its footer?\n"
    )
    assert result.exit_code == 0, result.output
    assert len(rewrites(made[0])) == 1 and f'"retrieval_query": "{STANDALONE} remove boilerplate"' in result.output
    result = CliRunner().invoke(
        cli, ["chat", "--expand-follow-ups", "--json"], input=f"{FIRST}\nwhat about its footer?\n"
    )
    assert result.exit_code == 0, result.output
    assert len(rewrites(made[1])) == 0 and '"retrieval_query": "what about its footer? trafilatura' in result.output


def test_sampling_flags_reach_the_pipeline_from_ask_and_chat(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from ragbudget.cli.commands import cli

    pipe = chat_pipeline()
    monkeypatch.setattr("ragbudget.pipeline.Pipeline", lambda *a, **kw: pipe)

    def seen() -> list[tuple[Any, Any]]:
        return [(c["sampling"], c["stop"]) for c in answers(pipe)]

    flags = ["--temperature", "0.8", "--top-p", "0.9", "--seed", "7", "--stop", "END", "--stop", "###"]
    result = CliRunner().invoke(cli, ["chat", *flags], input="What is MinHash?\nand its shingles?\n")
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli, ["ask", "What is MinHash?", "--no-stream", *flags])
    assert result.exit_code == 0, result.output
    expected = (Sampling(temperature=0.8, top_p=0.9, seed=7), ["END", "###"])
    assert seen() == [expected] * 3
    result = CliRunner().invoke(cli, ["ask", "What is MinHash?", "--no-stream"])
    assert result.exit_code == 0 and seen()[-1] == (Sampling(), None)
    assert CliRunner().invoke(cli, ["ask", "q", "--temperature", "-1"]).exit_code == 2


# --- history carried by a request (the HTTP server) ---------------------------------------------------


def _messages(n_turns: int, answer_words: int = 40) -> list[dict[str, str]]:
    out = [{"role": "system", "content": "Answer in English."}]
    for i in range(n_turns):
        out.append({"role": "user", "content": f"Question number {i} about the PDF cleaner and the KV budget?"})
        out.append({"role": "assistant", "content": " ".join(f"reply{i}-word{j}" for j in range(answer_words))})
    return out


def test_from_messages_loads_turns_system_messages_and_a_returned_summary() -> None:
    pipe = chat_pipeline()
    chat = Conversation.from_messages(
        pipe,
        [
            {"role": "assistant", "content": "Hello, ask me about the docs."},
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": SUMMARY_PREFIX + "the user asked about dedup"},
            {"role": "user", "content": "What is MinHash?"},
            {"role": "assistant", "content": "A signature."},
            {"role": "user", "content": "unanswered"},
        ],
        recent_turns=5,
    )
    assert chat.summary == "the user asked about dedup"
    assert [(t.question, t.answer) for t in chat.turns] == [
        ("", "Hello, ask me about the docs."),
        ("What is MinHash?", "A signature."),
        ("unanswered", ""),
    ]
    assert chat.history_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": SUMMARY_PREFIX + "the user asked about dedup"},
        {"role": "assistant", "content": "Hello, ask me about the docs."},
        {"role": "user", "content": "What is MinHash?"},
        {"role": "assistant", "content": "A signature."},
        {"role": "user", "content": "unanswered"},
    ]
    with pytest.raises(ConfigError):
        Conversation.from_messages(pipe, [{"role": "tool", "content": "x"}])


def test_system_messages_are_fixed_never_folded() -> None:
    pipe = chat_pipeline(total=400, max_new=40, answer_words=40)
    turn = Conversation.from_messages(pipe, _messages(8), summary_max_tokens=30).ask("And the footer?")
    b = turn.budget
    history = history_of(answers(pipe)[-1])
    assert history[0] == {"role": "system", "content": "Answer in English."}
    assert history[1]["content"].startswith(SUMMARY_PREFIX)
    assert b.turns_summarized + b.turns_verbatim == 8 and b.turns_summarized >= 6 and b.system > 0
    assert not b.overrun and fake(pipe).overruns == 0 and b.summary + b.recent <= b.history_allowed
    # A system prompt that leaves no room is refused, not cut.
    huge = [{"role": "system", "content": "rule " * 400}]
    with pytest.raises(BudgetError, match="system messages"):
        Conversation.from_messages(pipe, huge).ask("hi?")


def test_generate_options_reach_the_pipeline_but_not_the_summary() -> None:
    pipe = chat_pipeline(total=400, max_new=40)
    Conversation.from_messages(pipe, _messages(8)).ask("Next?", temperature=0.5, seed=3, stop=["END"])
    assert [(c["sampling"], c["stop"]) for c in answers(pipe)] == [(Sampling(temperature=0.5, seed=3), ["END"])]
    # The summary is written greedily, without the answer's stop strings.
    assert summaries(pipe) and all(c["sampling"] is None and c["stop"] is None for c in summaries(pipe))


def _resend(cache: SummaryCache | None, turns: int, **options: Any) -> tuple[Pipeline, list[Any]]:
    """A client that resends its whole conversation every turn (one ``from_messages`` per
    request, as the HTTP server does), sharing ``cache`` between requests."""
    pipe = chat_pipeline(total=400, max_new=40, answer_words=40)
    messages: list[dict[str, str]] = [{"role": "system", "content": "Answer in English."}]
    results = []
    for i in range(turns):
        question = f"Question number {i} about the PDF cleaner and the KV budget?"
        turn = Conversation.from_messages(pipe, messages, summary_cache=cache, **options).ask(question)
        results.append(turn)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": turn.text}]
    return pipe, results


def test_summary_cache_makes_resent_histories_fold_like_one_conversation() -> None:
    """With the cache, each request folds only the turns that are new since the last one, and the
    prompts are the ones an in-memory conversation builds; without it, every request summarizes
    all of its older turns again."""
    options = {"summary_max_tokens": 30, "recent_turns": 2}
    memory_pipe = chat_pipeline(total=400, max_new=40, answer_words=40)
    chat = Conversation.from_messages(memory_pipe, [{"role": "system", "content": "Answer in English."}], **options)
    for i in range(10):
        chat.ask(f"Question number {i} about the PDF cleaner and the KV budget?")

    cache = SummaryCache()
    cached_pipe, turns = _resend(cache, 10, **options)
    plain_pipe, _ = _resend(None, 10, **options)

    assert [history_of(c) for c in answers(cached_pipe)] == [history_of(c) for c in answers(memory_pipe)]
    assert len(summaries(cached_pipe)) == len(summaries(memory_pipe))
    assert fake(cached_pipe).overruns == 0 and not any(t.budget.overrun for t in turns)
    # After the first fold every request resumes from the cache and folds one new turn only.
    folded = [t for t in turns if t.budget.turns_summarized]
    assert folded[0].budget.summary_cached == 0
    assert all(t.budget.summary_cached == t.budget.turns_summarized - 1 for t in folded[1:])
    assert cache.hits == len(folded) - 1
    for call in summaries(cached_pipe)[1:]:
        assert call["messages"][-1]["content"].count("User: ") == 1
    # Without the cache the same requests re-summarize the whole prefix each time.
    old_turns = sum(c["messages"][-1]["content"].count("User: ") for c in summaries(plain_pipe))
    assert old_turns > 2 * sum(c["messages"][-1]["content"].count("User: ") for c in summaries(cached_pipe))


def test_summary_cache_serves_a_retried_request_without_generating() -> None:
    cache = SummaryCache()
    pipe = chat_pipeline(total=400, max_new=40, answer_words=40)
    first = Conversation.from_messages(pipe, _messages(8), summary_max_tokens=30, summary_cache=cache).ask("Next?")
    calls = len(summaries(pipe))
    assert calls and first.budget.summary_cached == 0
    again = Conversation.from_messages(pipe, _messages(8), summary_max_tokens=30, summary_cache=cache).ask("Next?")
    assert len(summaries(pipe)) == calls  # no new summary was written
    assert again.summary == first.summary and again.budget.summary_cached == first.budget.turns_summarized
    assert history_of(answers(pipe)[-1]) == history_of(answers(pipe)[-2])
    # Another cap, another root: a summary written for 30 tokens is not reused for 20.
    Conversation.from_messages(pipe, _messages(8), summary_max_tokens=20, summary_cache=cache).ask("Next?")
    assert len(summaries(pipe)) > calls
    # An edited earlier turn is another prefix too.
    edited = _messages(8)
    edited[1]["content"] = "A different first question about dedup?"
    before = len(summaries(pipe))
    turn = Conversation.from_messages(pipe, edited, summary_max_tokens=30, summary_cache=cache).ask("Next?")
    assert len(summaries(pipe)) == before + calls and turn.budget.summary_cached == 0


def test_a_summary_cut_short_by_a_leaving_client_is_never_cached() -> None:
    import threading

    cache = SummaryCache()
    cancel = threading.Event()

    def leaving(messages: Any) -> Any:
        """The client disconnects during the summary: the backend stops early, as the real ones
        do (partial text, finish_reason "cancelled", no exception)."""
        yield "Summary"
        cancel.set()
        yield "never"

    pipe = chat_pipeline(total=400, max_new=40, answer_words=40, summary=leaving)
    Conversation.from_messages(pipe, _messages(8), summary_max_tokens=30, summary_cache=cache).ask(
        "Next?", cancel=cancel
    )
    assert len(summaries(pipe)) == 1 and len(cache) == 0
    # Already gone before the summary: nothing is generated for it, and nothing cached.
    Conversation.from_messages(pipe, _messages(8), summary_max_tokens=30, summary_cache=cache).ask(
        "Next?", cancel=cancel
    )
    assert len(summaries(pipe)) == 1 and len(cache) == 0
    # The retry of a client that stays gets a real summary, not the one cut short.
    retry_pipe = chat_pipeline(total=400, max_new=40, answer_words=40)
    turn = Conversation.from_messages(retry_pipe, _messages(8), summary_max_tokens=30, summary_cache=cache).ask("Next?")
    assert turn.budget.summary_cached == 0 and summaries(retry_pipe) and turn.summary != "Summary"
    assert len(cache) > 0


def _busy_pipeline(**chat_options: Any) -> Pipeline:
    """A pipeline whose admission holds 1,000 KV tokens (a 60 s queue time-out)."""
    return Pipeline(
        corpus_index(),
        backend=fake(chat_pipeline(kv_tokens=1000, **chat_options)),
        max_new_tokens=40,
        system_prompt=SYSTEM,
        relevance_floor=0,
        queue_timeout=60.0,
    )


def _left_while_queued(pipe: Pipeline, chat: Conversation, question: str) -> Any:
    """The turn of ``question`` asked while the GPU is busy, its client leaving once a request
    of the turn waits in admission's queue."""
    import threading

    held = pipe.admission.acquire(1000)  # the GPU is busy
    cancel, done = threading.Event(), []
    t = threading.Thread(target=lambda: done.append(chat.ask(question, cancel=cancel)))
    t.start()
    while pipe.admission.stats().queued == 0:
        threading.Event().wait(0.005)
    cancel.set()
    t.join(timeout=10)  # not the 60 s admission timeout
    held.release()
    assert done
    return done[0]


def test_a_summary_waiting_for_memory_leaves_the_queue_when_the_client_leaves() -> None:
    from ragbudget.memory.admission import AdmissionController

    pipe = _busy_pipeline()
    assert isinstance(pipe.admission, AdmissionController) and pipe.admission.capacity_tokens == 1000
    cache = SummaryCache()
    # The rewrite off: the summary is the request that waits (the rewrite's wait: the test below).
    chat = Conversation.from_messages(
        pipe, _messages(8), summary_max_tokens=30, summary_cache=cache, rewrite_with_model=False
    )
    turn = _left_while_queued(pipe, chat, "Next?")
    assert not summaries(pipe) and len(cache) == 0
    assert turn.summary.startswith("Asked:")  # the extractive fallback, for this request only


def test_a_rewrite_waiting_for_memory_leaves_the_queue_when_the_client_leaves() -> None:
    pipe = _busy_pipeline(rewrite=lambda m: STANDALONE)
    chat = Conversation.from_messages(pipe, _messages(2))
    turn = _left_while_queued(pipe, chat, "what about its footer?")
    assert turn.cancelled and not rewrites(pipe) and not answers(pipe)
    assert chat.turns == Conversation.from_messages(pipe, _messages(2)).turns  # nothing kept of it


# --- a hostile history: bounded, counted, cancellable ---------------------------------------------


def _long_history(n_messages: int, words: int = 25) -> list[dict[str, str]]:
    """``n_messages`` alternating user/assistant messages of ``words`` words each."""
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": " ".join(f"m{i}w{j}" for j in range(words))}
        for i in range(n_messages)
    ]


def test_a_history_at_the_limits_is_fitted_with_a_bounded_number_of_counts() -> None:
    # 2,047 messages of 25 words, 460,000 characters (the default limits take them): each render walks all of them,
    # so folding must not render once per turn (it rendered ~1,000 times, minutes on a real
    # tokenizer: issue #30's 10,000 messages pinned a server for ten minutes).
    pipe = chat_pipeline(total=4000, max_new=40, answer_words=10)
    chat = Conversation.from_messages(pipe, _long_history(2047), summary_max_tokens=30)
    before = fake(pipe).counted
    turn = chat.ask("How is the KV budget computed?")
    assert not turn.budget.overrun and turn.budget.turns_summarized > 1000
    assert len(summaries(pipe)) <= 3  # one fold of the older turns, at most two more
    assert fake(pipe).counted - before < 400  # a few renders per fold and bisection, not one per turn
    # What the summarization prompt held: the newest exchanges older than the two recent turns
    # (2044-2045 and the lone 2046) that fit it.
    transcript = summaries(pipe)[0]["messages"][-1]["content"]
    assert "m2043w0" in transcript and "m2044w0" not in transcript and "m0w0" not in transcript


def test_fitting_the_history_is_counted_in_the_timings() -> None:
    pipe = chat_pipeline(total=400, max_new=40, answer_words=40)
    turn = Conversation.from_messages(pipe, _messages(8), summary_max_tokens=30).ask("Next?")
    timings = turn.answer.report["timings"]
    assert summaries(pipe) and 0 < timings["summary_s"] <= timings["history_s"]
    parts = ("history_s", "retrieve_s", "select_s", "queue_s", "generate_s")
    assert timings["total_s"] >= sum(timings[k] for k in parts)
    # No fold, no summary time; the history's counting is still there.
    turn = Conversation.from_messages(pipe, _messages(1), summary_max_tokens=30).ask("Next?")
    assert "summary_s" not in turn.answer.report["timings"] and turn.answer.report["timings"]["history_s"] > 0


def test_cancel_stops_fitting_the_history_between_two_counts() -> None:
    import threading

    pipe = chat_pipeline(total=4000, max_new=40, answer_words=10)
    backend = fake(pipe)
    cancel = threading.Event()
    renders = {"n": 0, "after": 0}
    render = backend.render

    def counting_render(messages: Any) -> Any:
        # The client leaves during the tenth render of the history.
        renders["n"] += 1
        if cancel.is_set():
            renders["after"] += 1
        if renders["n"] == 10:
            cancel.set()
        return render(messages)

    backend.render = counting_render  # type: ignore[method-assign]
    chat = Conversation.from_messages(pipe, _long_history(2047), summary_max_tokens=30)
    kept = chat.turns
    turn = chat.ask("How is the KV budget computed?", cancel=cancel)
    assert turn.cancelled and turn.answer.finish_reason == "cancelled"
    # The loop looked at cancel at once (it used to render ~1,000 times more); what is left is
    # the pipeline rendering the cancelled answer's prompt, without the history.
    assert renders["after"] <= 6
    assert not summaries(pipe) and not answers(pipe)  # nothing was generated for a client that left
    assert chat.turns == kept and not chat.summary  # the conversation keeps what it had


def test_a_summary_past_the_time_budget_is_folded_by_extraction_instead() -> None:
    from ragbudget.memory.admission import Throughput

    pipe = chat_pipeline(total=400, max_new=40, answer_words=40)
    # A measured speed at which a 30-token summary takes 30 s, against the 30 s queue time-out
    # that a first token gets: the summary would leave the answer no time.
    pipe.admission.configure(throughput=Throughput(prefill_a=0.001, decode_s=1.0))
    turn = Conversation.from_messages(pipe, _messages(8), summary_max_tokens=30).ask("Next?")
    assert not summaries(pipe) and answers(pipe)
    assert turn.summary.startswith("Asked:") and not turn.budget.overrun
    why = turn.budget.summary_fallback
    assert re.search(r"a 30-token summary of a \d+-token prompt would take about 3\d\.\d s", why)
    assert turn.answer.report["memory"]["summary_fallback"] == turn.budget.summary_fallback
    # At a speed that leaves the answer its time, the generator writes it.
    fast = chat_pipeline(total=400, max_new=40, answer_words=40)
    fast.admission.configure(throughput=Throughput(prefill_a=0.001, decode_s=0.01))
    turn = Conversation.from_messages(fast, _messages(8), summary_max_tokens=30).ask("Next?")
    assert summaries(fast) and turn.budget.summary_fallback == ""


def test_a_history_over_the_limits_is_refused_before_anything_is_counted() -> None:
    from ragbudget.settings import HistorySettings

    pipe = chat_pipeline()
    limits = HistorySettings(max_history_chars=100)
    with pytest.raises(ConfigError, match="has 2049 messages, more than the limit of 2048"):
        Conversation.from_messages(pipe, _long_history(2048, words=1))
    with pytest.raises(ConfigError, match="hold 101 characters, more than the limit of 100"):
        Conversation.from_messages(pipe, [{"role": "user", "content": "x" * 101}], history=limits)
    assert fake(pipe).counted == 0
    Conversation.from_messages(pipe, [{"role": "user", "content": "x" * 100}], history=limits)


@pytest.fixture
def chat_server() -> Any:
    from ragbudget.server.app import background_server, create_app

    def start(pipe: Any, **options: Any) -> Any:
        return background_server(create_app(pipe, **options))

    return start


def test_http_ten_turns_over_budget_are_summarized_with_no_overrun(chat_server: Any) -> None:
    """The client resends the whole conversation each turn (as OpenAI clients do); the server folds
    what does not fit into a summary instead of dropping turns, and every prompt fits."""
    import openai

    pipe = chat_pipeline(total=400, max_new=40, answer_words=40)
    messages: list[dict[str, str]] = [{"role": "system", "content": "Answer in English."}]
    memories = []
    with chat_server(pipe, summary_max_tokens=30, recent_turns=2) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for i in range(10):
            question = f"Question number {i} about the PDF cleaner and the KV budget?"
            messages.append({"role": "user", "content": question})
            stream = i % 2 == 1
            if stream:
                chunks = list(c.chat.completions.create(model="ragbudget", messages=messages, stream=True))
                text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                extra = chunks[-1].model_extra or {}
            else:
                resp = c.chat.completions.create(model="ragbudget", messages=messages)
                text, extra = resp.choices[0].message.content or "", resp.model_extra or {}
            memories.append(extra["ragbudget"]["memory"])
            messages.append({"role": "assistant", "content": text})
    assert fake(pipe).overruns == 0
    for m in memories:
        assert not m["overrun"] and m["prompt"] + m["output"] <= m["total"]
        for key in ("summary", "recent", "context_used", "output", "turns_summarized"):
            assert key in m
    assert memories[-1]["turns_summarized"] >= 7 and memories[-1]["summary"] > 0
    assert memories[0]["turns_summarized"] == 0 and memories[0]["summary"] == 0
    last = history_of(answers(pipe)[-1])
    assert last[0]["content"] == "Answer in English." and last[1]["content"].startswith(SUMMARY_PREFIX)
    assert last[-2]["content"] == messages[-4]["content"]  # the most recent turns stay verbatim
    assert summaries(pipe)  # the summaries came from the generator


@pytest.mark.parametrize("cache_size", [1024, 0])
def test_http_summaries_are_cached_between_requests(chat_server: Any, cache_size: int) -> None:
    """A client resending its conversation pays for folding only its new turns; the counter in
    /metrics says how many turns came from the cache. ``summary_cache_size=0`` turns it off."""
    import httpx

    pipe = chat_pipeline(total=400, max_new=40, answer_words=40)
    messages: list[dict[str, str]] = []
    cached = []
    with chat_server(pipe, summary_max_tokens=30, recent_turns=2, summary_cache_size=cache_size) as url:
        for i in range(8):
            messages.append(
                {"role": "user", "content": f"Question number {i} about the PDF cleaner and the KV budget?"}
            )
            r = httpx.post(url + "/v1/chat/completions", timeout=30, json={"model": "ragbudget", "messages": messages})
            assert r.status_code == 200, r.text
            cached.append(r.json()["ragbudget"]["memory"]["summary_cached"])
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        scraped = httpx.get(url + "/metrics", timeout=30).text
    counter = int(re.search(r"^ragbudget_summary_cache_turns_total (\d+)$", scraped, re.M).group(1))
    assert counter == sum(cached)
    transcripts = [c["messages"][-1]["content"].count("User: ") for c in summaries(pipe)]
    if cache_size:
        assert counter > 0 and all(n == 1 for n in transcripts[1:])
    else:
        assert counter == 0 and max(transcripts) > 2


def test_http_follow_up_is_expanded_for_retrieval(chat_server: Any) -> None:
    import httpx

    pipe = chat_pipeline(total=400, max_new=40)
    with chat_server(pipe) as url:
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=30,
            json={
                "model": "ragbudget",
                "messages": [
                    {"role": "user", "content": FIRST},
                    {"role": "assistant", "content": "It extracts the main text of the page."},
                    {"role": "user", "content": "what about its footer?"},
                ],
            },
        )
    assert r.status_code == 200, r.text
    assert answers(pipe)[-1]["question"] == "what about its footer?"
    assert r.json()["sources"][0]["path"] == "docs/html-footer.md"  # the bare question finds the PDF one


def test_http_question_too_long_for_the_budget_is_a_400(chat_server: Any) -> None:
    import httpx

    pipe = chat_pipeline(total=200, max_new=40)
    with chat_server(pipe) as url:
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=30,
            json={"model": "ragbudget", "messages": [{"role": "user", "content": "word " * 400}]},
        )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert answers(pipe) == []


# --- with the real Pipeline (hash embedder, fake ChatML generator) ---------------------------------


def ChatMLTokenizer() -> HFWordTokenizer:  # noqa: N802 - reads as the class it stands for
    return HFWordTokenizer(chatml=True)


@dataclass
class ChatMLGenerator(GeneratorStub):
    """The Generator surface Pipeline and Conversation use; answers are long on purpose."""

    tokenizer: HFWordTokenizer = field(default_factory=ChatMLTokenizer)
    prompts: list[Any] = field(default_factory=list)
    summaries: int = 0

    @property
    def token_counter(self) -> Any:
        from ragbudget.tokens import HFTokenizer

        return HFTokenizer(self.tokenizer)

    def generate(
        self, prompt: Any, *, max_new_tokens: int, on_text: Any = None, cancel: Any = None, **_: Any
    ) -> FakeGeneration:
        if isinstance(prompt, list):  # a summary request (chat messages)
            self.summaries += 1
            text = " ".join(re.findall(r"\w+", prompt[-1]["content"])[:max_new_tokens])
            return FakeGeneration(text, 0, max_new_tokens, max_new_tokens, finish_reason="length")
        self.prompts.append(prompt)
        words = [f"detail{i}" for i in range(max_new_tokens // 2)]
        text = " ".join(words)
        if on_text:
            on_text(text)
        return FakeGeneration(
            text,
            prompt.n_tokens,
            len(self.tokenizer.encode(text)),
            max_new_tokens,
            finish_reason="length",
            prompt=prompt,
        )


@pytest.fixture(scope="module")
def hash_index(tmp_path_factory: pytest.TempPathFactory, repo_data: Any) -> Any:
    from ragbudget.pipeline import Pipeline

    index_dir = tmp_path_factory.mktemp("chat") / "idx"
    Pipeline(index_dir, embedder="hash:256").index([repo_data])
    return index_dir


def test_ten_turns_with_the_real_pipeline_and_prompt_builder(hash_index: Any) -> None:
    from ragbudget.pipeline import Pipeline

    gen = ChatMLGenerator()
    # 344 MiB for SmolLM2-135M leaves a few hundred tokens per request: history overflows fast.
    pipe = Pipeline(hash_index, generator=gen, gpu="344MiB", max_new_tokens=48)
    total = pipe.plan.max_context_tokens
    assert total < 1000
    chat = Conversation(pipe, history_share=0.3, summary_max_tokens=24, recent_turns=2)
    questions = [
        "What is the Debian social contract?",
        "What does it promise about free software?",
        "How many versions of it are there?",
        "Who wrote the constitution?",
        "What about its amendments?",
        "What is Warsaw known for?",
        "And its university?",
        "Which system call creates a pipe?",
        "What does it return on error?",
        "Thanks, and dup2?",
    ]
    for q in questions:
        turn = chat.ask(q)
        b = turn.budget
        report = turn.answer.report["budget"]
        assert not b.overrun
        assert report["prompt_tokens"] + 48 <= total
        # Exact: the pipeline's own fixed part (system + history + question, template included)
        # is what Conversation measured as fixed + summary + recent.
        assert report["fixed_prompt_tokens"] == b.fixed + b.summary + b.recent
        assert b.summary + b.recent <= b.history_allowed
        assert gen.prompts[-1].question == q  # the question reached the prompt whole
    assert chat.turns_summarized > 0 and gen.summaries > 0
    assert chat.summary and pipe.admission.stats().admitted_tokens == 0
    # The banner of a local pipeline names its memory plan's figures.
    from ragbudget.cli.display import chat_banner

    plan = pipe.plan
    assert chat_banner(chat) == (
        f"ragbudget chat · {plan.model.rsplit('/', 1)[-1] if plan.model.startswith('/') else plan.model}"
        f" · {total} tokens/turn (answer 48, history ≤ 30%) · KV {plan.kv_bytes_per_token} "
        "B/token · /help for commands"
    )


# --- the real default models (slow) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def real_pipeline(tmp_path_factory: pytest.TempPathFactory, repo_data: Any) -> Any:
    from ragbudget.pipeline import Pipeline

    index_dir = tmp_path_factory.mktemp("chat-real") / "idx"
    Pipeline(index_dir).index([repo_data / "manpages"])  # packaged MiniLM; a small corpus
    # 651 MiB for SmolLM2-135M (fp32 on CPU, 0.5 GiB of weights; 0.6 GiB + the 33 MiB cuBLAS
    # workspace ÷ 0.9): ~500 tokens per request (and short CPU prefills).
    return Pipeline(index_dir, gpu="651MiB", max_new_tokens=12)


@pytest.mark.model
def test_real_models_conversation_with_summary_and_follow_up(real_pipeline: Any) -> None:
    chat = Conversation(real_pipeline, history_share=0.08, summary_max_tokens=16, recent_turns=1)
    questions = ["Which system call creates a pipe?", "What does it return on error?", "what about close?"]
    turns = [chat.ask(q) for q in questions]
    # Memory is the hard limit; a time cap (on a CPU) may bind below it, and never cuts a turn's
    # context under one whole passage (allowance.MIN_TIME_CONTEXT): each turn stays inside its
    # own budget, and that budget inside memory.
    plan = real_pipeline.plan
    memory = plan.memory_max_context_tokens or plan.max_context_tokens
    for t in turns:
        report = t.answer.report["budget"]
        assert not t.budget.overrun and report["prompt_tokens"] + 12 <= t.budget.total <= memory, (t.budget, plan)
        assert report["fixed_prompt_tokens"] == t.budget.fixed + t.budget.summary + t.budget.recent
        assert t.text.strip()
    assert turns[0].sources
    assert chat.turns_summarized > 0 and chat.summary
    assert real_pipeline.generator.token_counter.count(chat.summary) <= 16
    assert turns[1].retrieval_query != questions[1]  # the follow-up was expanded for retrieval
