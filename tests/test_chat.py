"""Conversation memory: one budget for history, context and output; summary folding; follow-ups.

A model-free fake pipeline (word tokenizer with a ChatML-like template) stands in for the real one;
it lays out its prompt the way ragbudget's prompt does (system, history, context + question) and
records every prompt it built, so overruns are checked against what the "model" actually got.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _fakes import FakeBackend, GeneratorStub
from _fakes import WordTokenizer as HFWordTokenizer

from ragbudget.chat import (
    SUMMARY_PREFIX,
    Conversation,
    SummaryCache,
    Turn,
    _Meter,
    expand_query,
    fit_history,
    is_follow_up,
)
from ragbudget.errors import BudgetError, ConfigError

# --- fakes ----------------------------------------------------------------------------------------


class WordTokenizer:
    """One token per whitespace-separated word; ids from a growing vocabulary."""

    name = "words"

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)

    def count(self, text: str) -> int:
        return len(text.split())


class ChatTemplate:
    """ChatML-like: every message costs its words plus two marker tokens."""

    chat_template = "chatml"

    def apply_chat_template(self, messages: list[dict[str, str]], *, tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        assert tokenize is False
        out = "".join(f"<start>{m['role']} {m['content']} <end>\n" for m in messages)
        return out + ("<start>assistant " if add_generation_prompt else "")


@dataclass
class FakeGeneration:
    text: str


class FakeGenerator:
    def __init__(self, summary_words: int = 500, summary_text: str | None = None) -> None:
        self.tokenizer = ChatTemplate()
        self.token_counter = WordTokenizer()
        self.calls: list[dict[str, Any]] = []
        self.summary_words = summary_words
        self.summary_text = summary_text

    def generate(self, messages: list[dict[str, str]], *, max_new_tokens: int) -> FakeGeneration:
        self.calls.append({"messages": messages, "max_new_tokens": max_new_tokens})
        if self.summary_text is not None:
            return FakeGeneration(self.summary_text)
        # A long-winded "summary": the words of the transcript, more than the cap allows, so the
        # cap is what keeps it short.
        words = re.findall(r"\w+", messages[-1]["content"])
        return FakeGeneration(" ".join(words[: self.summary_words]))


@dataclass
class FakePlan:
    max_context_tokens: int
    max_new_tokens: int


@dataclass
class FakeAnswer:
    text: str
    sources: list[dict[str, Any]]
    report: dict[str, Any]
    finish_reason: str = "stop"


CORPUS = {
    "pdf-headers": "The PDF cleaner strips running page headers that repeat at the top of PDF pages",
    "pdf-footer": "The PDF cleaner also removes the page footer with page numbers at the bottom of PDF pages",
    "html-footer": "HTML boilerplate such as the site footer and navigation links is removed by trafilatura",
    "kv-budget": "The KV cache budget is computed from free GPU memory and bytes per token",
    "dedup": "Near duplicate chunks are removed with MinHash signatures over word shingles",
}

SYSTEM = "Answer from the documents and cite them"


@dataclass
class FakePipeline:
    """Builds its prompt as [system, *history, user(context + question)] and checks the budget."""

    total: int = 400
    max_new: int = 40
    answer_words: int = 40
    generator: FakeGenerator = field(default_factory=FakeGenerator)
    calls: list[dict[str, Any]] = field(default_factory=list)
    overruns: int = 0

    def __post_init__(self) -> None:
        self.plan = FakePlan(self.total, self.max_new)

    @property
    def backend(self) -> FakeBackend:
        gen = self.generator
        return FakeBackend(gen.token_counter, template=gen.tokenizer, generate=gen.generate)

    def _render(self, messages: list[dict[str, str]]) -> int:
        text = self.generator.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.generator.token_counter.count(text)

    def ask(self, question: str, *, context_tokens: int | None = None, max_new_tokens: int | None = None,
            on_text: Any = None, cancel: Any = None, history: list[dict[str, str]] | None = None,
            retrieval_query: str | None = None) -> FakeAnswer:
        max_new = max_new_tokens or self.max_new
        history = list(history or [])
        query = set(re.findall(r"\w+", (retrieval_query or question).lower()))
        ranked = sorted(CORPUS.items(), key=lambda kv: (-len(query & set(re.findall(r"\w+", kv[1].lower()))), kv[0]))
        chosen: list[tuple[str, str]] = []
        used = 0
        for cid, text in ranked:
            cost = len(text.split()) + 2  # "[n]" label + separator
            if context_tokens is not None and used + cost > context_tokens:
                continue
            trial = chosen + [(cid, text)]
            if self._prompt_tokens(question, history, trial) + max_new > self.total:
                continue
            chosen, used = trial, used + cost
        prompt = self._prompt_tokens(question, history, chosen)
        if prompt + max_new > self.total:
            self.overruns += 1
        self.calls.append({"question": question, "history": history, "retrieval_query": retrieval_query,
                           "chunks": [c for c, _ in chosen], "context_tokens": context_tokens, "prompt": prompt})
        n = len(self.calls)
        text = " ".join(f"answer{n}-word{i}" for i in range(self.answer_words))
        if on_text:
            on_text(text)
        return FakeAnswer(
            text=text,
            sources=[{"path": cid, "start": 0, "end": 1, "page": None, "score": 1.0} for cid, _ in chosen],
            report={"budget": {"context_tokens_allowed": context_tokens, "context_tokens_used": used,
                               "prompt_tokens": prompt, "max_new_tokens": max_new, "kv_bytes_per_token": 1}},
        )

    @staticmethod
    def _user(question: str, chunks: list[tuple[str, str]]) -> str:
        ctx = " ".join(f"[{i}] {t} |" for i, (_, t) in enumerate(chunks, 1))
        return f"{ctx} Question: {question}" if chunks else f"Question: {question}"

    def _prompt_tokens(self, question: str, history: list[dict[str, str]], chunks: list[tuple[str, str]]) -> int:
        messages = [{"role": "system", "content": SYSTEM}, *history,
                    {"role": "user", "content": self._user(question, chunks)}]
        return self._render(messages)


# --- the budget ---------------------------------------------------------------------------------------


def test_ten_turns_over_budget_keep_answering_with_summary_and_no_overrun() -> None:
    pipe = FakePipeline(total=400, max_new=40, answer_words=40)
    chat = Conversation(pipe, history_share=0.3, summary_max_tokens=30, recent_turns=2)
    questions = [f"Question number {i} about the PDF cleaner and the KV budget?" for i in range(10)]
    turns = [chat.ask(q) for q in questions]

    # History grew past its share: the summary engaged, and every turn still fits.
    assert any(t.budget.summary_updated for t in turns)
    assert chat.turns_summarized > 0 and chat.summary
    assert pipe.overruns == 0
    for t, call in zip(turns, pipe.calls):
        b = t.budget
        assert not b.overrun
        assert b.prompt + b.output <= b.total
        assert b.summary + b.recent <= b.history_allowed
        # The summary text is capped at 30; the rest is its prefix and the template markers.
        assert b.summary <= 30 + len(SUMMARY_PREFIX.split()) + 2
        assert b.context_used <= b.context_allowed
        assert call["question"] == t.question  # never truncated, never rewritten for the generator
        assert call["prompt"] == b.prompt
    # Without memory management, the 10th turn's verbatim history alone (9 turns x ~55 tokens)
    # would not fit the 400-token request; the summary is what made room.
    full = _Meter(pipe).cost(chat.history_messages(turns=[*_all_turns(turns)], summary=""), questions[-1])
    assert full > 400
    # The most recent turns are verbatim in the last prompt, the summary comes first.
    last_history = pipe.calls[-1]["history"]
    assert last_history[0]["content"].startswith(SUMMARY_PREFIX)
    assert last_history[-2] == {"role": "user", "content": questions[-2]}
    assert last_history[-1]["content"] == turns[-2].text


def _all_turns(turns: list[Any]) -> list[Any]:
    from ragbudget.chat import Turn

    return [Turn(t.question, t.text) for t in turns]


def test_history_accounting_is_exact_after_the_template() -> None:
    pipe = FakePipeline(total=2000, max_new=40, answer_words=12)
    chat = Conversation(pipe, history_share=0.5, recent_turns=5)
    chat.ask("What does the PDF cleaner strip?")
    turn = chat.ask("How is the KV budget computed from GPU memory?")
    call = pipe.calls[-1]
    # Recompute the prompt without the history: the difference is what history really cost.
    without = pipe._prompt_tokens(call["question"], [], [(c, CORPUS[c]) for c in call["chunks"]])
    assert turn.budget.summary + turn.budget.recent == call["prompt"] - without
    assert turn.budget.summary == 0 and turn.budget.turns_verbatim == 1


def test_report_shows_tokens_for_summary_recent_context_and_output() -> None:
    pipe = FakePipeline()
    turn = Conversation(pipe).ask("How is the KV budget computed?")
    memory = turn.to_dict()["memory"]
    for key in ("summary", "recent", "context_used", "context_allowed", "output", "total", "prompt", "history"):
        assert key in memory
    assert memory["output"] == 40
    assert turn.answer.report["memory"] == memory


def test_history_share_is_configurable_and_retrieval_gets_the_rest() -> None:
    small, large = FakePipeline(), FakePipeline()
    a = Conversation(small, history_share=0.1)
    b = Conversation(large, history_share=0.6)
    for q in ("First question about dedup shingles?", "Second question about PDF headers?",
              "Third question about the KV budget?"):
        ta, tb = a.ask(q), b.ask(q)
    assert ta.budget.history_allowed < tb.budget.history_allowed
    assert ta.budget.history <= ta.budget.history_allowed
    assert ta.budget.context_allowed > tb.budget.context_allowed
    # Unused history share is not wasted: it goes to retrieval.
    room = ta.budget.prompt_allowed - ta.budget.fixed
    assert ta.budget.context_allowed == room - ta.budget.history


def test_zero_history_share_keeps_no_history() -> None:
    pipe = FakePipeline()
    chat = Conversation(pipe, history_share=0.0)
    chat.ask("What is MinHash used for?")
    turn = chat.ask("And the KV budget?")
    assert turn.budget.history == 0
    assert pipe.calls[-1]["history"] == []
    assert pipe.overruns == 0


def test_summary_comes_from_the_generator_and_is_capped() -> None:
    pipe = FakePipeline(total=300, max_new=40, answer_words=50)
    chat = Conversation(pipe, summary_max_tokens=20, recent_turns=1)
    for i in range(5):
        chat.ask(f"Question {i} on the KV budget and GPU memory?")
    assert pipe.generator.calls, "the summary must be written by the pipeline's generator"
    assert all(c["max_new_tokens"] <= 20 for c in pipe.generator.calls)
    assert pipe.generator.token_counter.count(chat.summary) <= 20
    # The summarization prompt also fits the one per-request budget.
    for c in pipe.generator.calls:
        assert pipe._render(c["messages"]) + c["max_new_tokens"] <= 300


def test_empty_generator_summary_falls_back_to_extractive() -> None:
    pipe = FakePipeline(total=300, max_new=40, answer_words=50, generator=FakeGenerator(summary_text=""))
    chat = Conversation(pipe, summary_max_tokens=40, recent_turns=1)
    for i in range(5):
        chat.ask(f"Question {i} on MinHash shingles?")
    assert chat.summary.startswith("Asked:")
    assert pipe.overruns == 0


def test_custom_summarizer_and_reset() -> None:
    seen: list[int] = []

    def summarize(previous: str, turns: Any, cap: int) -> str:
        seen.append(len(turns))
        return f"{previous} folded {len(turns)}".strip()

    pipe = FakePipeline(total=300, answer_words=50)
    chat = Conversation(pipe, summarizer=summarize, recent_turns=1)
    for i in range(6):
        chat.ask(f"Question {i} about PDF footers?")
    assert seen and chat.summary.startswith("folded")
    assert not pipe.generator.calls
    chat.reset()
    assert chat.summary == "" and chat.turns == [] and chat.turns_summarized == 0
    chat.ask("Fresh start: what is dedup?")
    assert pipe.calls[-1]["history"] == []


def test_question_is_never_truncated_and_too_long_is_a_budget_error() -> None:
    pipe = FakePipeline(total=200, max_new=40)
    long_q = " ".join(["word"] * 120) + "?"
    turn = Conversation(pipe).ask(long_q)
    assert pipe.calls[-1]["question"] == long_q and turn.question == long_q
    with pytest.raises(BudgetError, match="question alone"):
        Conversation(pipe).ask(" ".join(["word"] * 400))


def test_invalid_settings_are_config_errors() -> None:
    pipe = FakePipeline()
    for kwargs in ({"history_share": 1.0}, {"history_share": -0.1}, {"summary_max_tokens": 0},
                   {"recent_turns": -1}, {"summary_role": "tool"}):
        with pytest.raises(ConfigError):
            Conversation(pipe, **kwargs)
    with pytest.raises(ConfigError):
        Conversation(pipe).ask("   ")


# --- follow-ups -----------------------------------------------------------------------------------


def test_follow_up_retrieves_the_right_chunks() -> None:
    pipe = FakePipeline(total=400, max_new=40)
    chat = Conversation(pipe, context_tokens=22)  # room for one chunk: the top one must be right
    chat.ask("How does the PDF cleaner strip page headers?")
    turn = chat.ask("what about its footer?")
    assert "pdf" in turn.retrieval_query and "cleaner" in turn.retrieval_query
    assert pipe.calls[-1]["question"] == "what about its footer?"
    assert pipe.calls[-1]["chunks"] == ["pdf-footer"]
    # Without expansion the bare question ties with the HTML footer (alphabetical tie-break).
    plain = FakePipeline(total=400, max_new=40)
    chat2 = Conversation(plain, context_tokens=22, expand_follow_ups=False)
    chat2.ask("How does the PDF cleaner strip page headers?")
    chat2.ask("what about its footer?")
    assert plain.calls[-1]["chunks"] != ["pdf-footer"]


def test_follow_up_without_retrieval_query_support_is_put_in_the_question() -> None:
    class OldPipeline(FakePipeline):
        def ask(self, question: str, *, context_tokens: int | None = None, max_new_tokens: int | None = None,
                on_text: Any = None, cancel: Any = None, history: Any = None) -> FakeAnswer:
            return super().ask(question, context_tokens=context_tokens, max_new_tokens=max_new_tokens,
                               history=history)

    pipe = OldPipeline()
    chat = Conversation(pipe)
    chat.ask("How does the PDF cleaner strip page headers?")
    chat.ask("what about its footer?")
    asked = pipe.calls[-1]["question"]
    assert asked.startswith("what about its footer?") and "pdf" in asked


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("what about its footer?", True),
        ("And the R manual?", True),
        ("Why is that?", True),
        ("How are they removed?", True),
        ("footers?", True),
        ("How does the chunker split long Markdown sections into pieces?", False),
        ("Which system calls return EINTR when interrupted by a signal handler?", False),
    ],
)
def test_is_follow_up(question: str, expected: bool) -> None:
    assert is_follow_up(question) is expected


def test_expand_query_uses_newest_previous_question_first() -> None:
    q = expand_query("what about its footer?", ["KV budget basics?", "How are PDF page headers stripped?"])
    assert q.startswith("what about its footer? pdf page headers stripped")
    assert expand_query("Which system calls return EINTR on signals?", ["PDF headers?"]) == (
        "Which system calls return EINTR on signals?")
    assert expand_query("what about it?", []) == "what about it?"


@settings(max_examples=80, deadline=None)
@given(st.text(min_size=1, max_size=80), st.lists(st.text(max_size=80), max_size=3))
def test_expand_query_keeps_the_question_intact(question: str, previous: list[str]) -> None:
    out = expand_query(question, previous, max_terms=10)
    assert out.startswith(question)
    assert len(out.split()) <= len(question.split()) + 10


# --- stateless fitting (the server's policy) -------------------------------------------------------


def test_fit_history_drops_oldest_first_and_keeps_system() -> None:
    pipe = FakePipeline(total=200, max_new=40)
    history = [{"role": "system", "content": "Be brief."}]
    for i in range(10):
        history += [{"role": "user", "content": f"question {i} " + "x " * 10},
                    {"role": "assistant", "content": f"answer {i} " + "y " * 10}]
    kept, dropped = fit_history(pipe, history, "final question?", share=0.3)
    assert dropped > 0 and kept
    assert kept[0] == {"role": "system", "content": "Be brief."}
    assert kept[-1] == history[-1]
    meter = _Meter(pipe)
    fixed = meter.render([{"role": "system", "content": "system"}, {"role": "user", "content": "final question?"}])
    assert meter.cost(kept, "final question?") <= int((200 - 40 - fixed) * 0.3)
    assert fit_history(pipe, history[:3], "q?", share=0.9) == (history[:3], 0)


def test_fit_history_leaves_fakes_without_a_plan_alone() -> None:
    history = [{"role": "user", "content": "hi"}]
    assert fit_history(object(), history, "q?") == (history, 0)


# --- the chat loop and the CLI --------------------------------------------------------------------


def test_run_chat_reads_lines_and_handles_commands() -> None:
    import io

    from ragbudget.chat import run_chat

    pipe = FakePipeline()
    chat = Conversation(pipe)
    out = io.StringIO()
    stdin = io.StringIO("How is the KV budget computed?\n\n/reset\nwhat about its footer?\n/exit\nnever asked\n")
    n = run_chat(chat, stdin, out.write)
    text = out.getvalue()
    assert n == 2 and len(pipe.calls) == 2
    assert "Sources:" in text and "[1]" in text
    assert "memory:" in text and "summary" in text
    assert "conversation reset" in text
    assert pipe.calls[1]["history"] == []  # /reset forgot the first turn
    assert all(c["question"] != "never asked" for c in pipe.calls)


def test_chat_command_with_piped_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from ragbudget.cli import cli

    made: list[FakePipeline] = []

    def factory(*args: Any, **kwargs: Any) -> FakePipeline:
        made.append(FakePipeline())
        return made[-1]

    monkeypatch.setattr("ragbudget.pipeline.Pipeline", factory)
    result = CliRunner().invoke(cli, ["chat", "--history-share", "0.2", "--recent-turns", "1"],
                                input="What is MinHash?\nand its shingles?\n/exit\n")
    assert result.exit_code == 0, result.output
    assert len(made[0].calls) == 2
    assert "Sources:" in result.output
    result = CliRunner().invoke(cli, ["chat", "--json"], input="What is MinHash?\n")
    assert result.exit_code == 0, result.output
    assert '"memory"' in result.output
    result = CliRunner().invoke(cli, ["chat", "--history-share", "1.5"], input="")
    assert result.exit_code == 2


def test_sampling_flags_reach_the_pipeline_from_ask_and_chat(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from ragbudget.cli import cli

    seen: list[dict[str, Any]] = []

    class OptionsPipeline(FakePipeline):
        def ask(self, question: str, **kwargs: Any) -> FakeAnswer:
            seen.append({k: kwargs.pop(k) for k in ("temperature", "top_p", "seed", "stop") if k in kwargs})
            return super().ask(question, **kwargs)

    monkeypatch.setattr("ragbudget.pipeline.Pipeline", lambda *a, **kw: OptionsPipeline())
    flags = ["--temperature", "0.8", "--top-p", "0.9", "--seed", "7", "--stop", "END", "--stop", "###"]
    result = CliRunner().invoke(cli, ["chat", *flags], input="What is MinHash?\nand its shingles?\n")
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli, ["ask", "What is MinHash?", "--no-stream", *flags])
    assert result.exit_code == 0, result.output
    expected = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "stop": ["END", "###"]}
    assert seen == [expected] * 3
    result = CliRunner().invoke(cli, ["ask", "What is MinHash?", "--no-stream"])
    assert result.exit_code == 0 and seen[-1] == {}
    assert CliRunner().invoke(cli, ["ask", "q", "--temperature", "-1"]).exit_code == 2


# --- history carried by a request (the HTTP server) ---------------------------------------------------


def _messages(n_turns: int, answer_words: int = 40) -> list[dict[str, str]]:
    out = [{"role": "system", "content": "Answer in English."}]
    for i in range(n_turns):
        out.append({"role": "user", "content": f"Question number {i} about the PDF cleaner and the KV budget?"})
        out.append({"role": "assistant", "content": " ".join(f"reply{i}-word{j}" for j in range(answer_words))})
    return out


def test_from_messages_loads_turns_system_messages_and_a_returned_summary() -> None:
    pipe = FakePipeline()
    chat = Conversation.from_messages(pipe, [
        {"role": "assistant", "content": "Hello, ask me about the docs."},
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": SUMMARY_PREFIX + "the user asked about dedup"},
        {"role": "user", "content": "What is MinHash?"},
        {"role": "assistant", "content": "A signature."},
        {"role": "user", "content": "unanswered"},
    ], recent_turns=5)
    assert chat.summary == "the user asked about dedup"
    assert [(t.question, t.answer) for t in chat.turns] == [
        ("", "Hello, ask me about the docs."), ("What is MinHash?", "A signature."), ("unanswered", "")]
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
    pipe = FakePipeline(total=400, max_new=40, answer_words=40)
    turn = Conversation.from_messages(pipe, _messages(8), summary_max_tokens=30).ask("And the footer?")
    b = turn.budget
    history = pipe.calls[-1]["history"]
    assert history[0] == {"role": "system", "content": "Answer in English."}
    assert history[1]["content"].startswith(SUMMARY_PREFIX)
    assert b.turns_summarized + b.turns_verbatim == 8 and b.turns_summarized >= 6 and b.system > 0
    assert not b.overrun and pipe.overruns == 0 and b.summary + b.recent <= b.history_allowed
    # A system prompt that leaves no room is refused, not cut.
    huge = [{"role": "system", "content": "rule " * 400}]
    with pytest.raises(BudgetError, match="system messages"):
        Conversation.from_messages(pipe, huge).ask("hi?")


def test_generate_options_reach_the_pipeline_but_not_the_summary() -> None:
    seen: list[dict[str, Any]] = []

    class OptionsPipeline(FakePipeline):
        def ask(self, question: str, **kwargs: Any) -> FakeAnswer:
            seen.append({k: kwargs.pop(k) for k in ("temperature", "seed", "stop") if k in kwargs})
            return super().ask(question, **kwargs)

    pipe = OptionsPipeline(total=400, max_new=40)
    Conversation.from_messages(pipe, _messages(8)).ask("Next?", temperature=0.5, seed=3, stop=["END"])
    assert seen == [{"temperature": 0.5, "seed": 3, "stop": ["END"]}]
    assert pipe.generator.calls and all(set(c) == {"messages", "max_new_tokens"} for c in pipe.generator.calls)


def _resend(cache: SummaryCache | None, turns: int, **options: Any) -> tuple[FakePipeline, list[Any]]:
    """A client that resends its whole conversation every turn (one ``from_messages`` per
    request, as the HTTP server does), sharing ``cache`` between requests."""
    pipe = FakePipeline(total=400, max_new=40, answer_words=40)
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
    memory_pipe = FakePipeline(total=400, max_new=40, answer_words=40)
    chat = Conversation(memory_pipe, **options)
    chat._state.system.append({"role": "system", "content": "Answer in English."})
    for i in range(10):
        chat.ask(f"Question number {i} about the PDF cleaner and the KV budget?")

    cache = SummaryCache()
    cached_pipe, turns = _resend(cache, 10, **options)
    plain_pipe, _ = _resend(None, 10, **options)

    assert [c["history"] for c in cached_pipe.calls] == [c["history"] for c in memory_pipe.calls]
    assert len(cached_pipe.generator.calls) == len(memory_pipe.generator.calls)
    assert cached_pipe.overruns == 0 and not any(t.budget.overrun for t in turns)
    # After the first fold every request resumes from the cache and folds one new turn only.
    folded = [t for t in turns if t.budget.turns_summarized]
    assert folded[0].budget.summary_cached == 0
    assert all(t.budget.summary_cached == t.budget.turns_summarized - 1 for t in folded[1:])
    assert cache.hits == len(folded) - 1
    for call in cached_pipe.generator.calls[1:]:
        assert call["messages"][-1]["content"].count("User: ") == 1
    # Without the cache the same requests re-summarize the whole prefix each time.
    old_turns = sum(c["messages"][-1]["content"].count("User: ") for c in plain_pipe.generator.calls)
    assert old_turns > 2 * sum(c["messages"][-1]["content"].count("User: ") for c in cached_pipe.generator.calls)


def test_summary_cache_serves_a_retried_request_without_generating() -> None:
    cache = SummaryCache()
    pipe = FakePipeline(total=400, max_new=40, answer_words=40)
    first = Conversation.from_messages(pipe, _messages(8), summary_max_tokens=30, summary_cache=cache).ask("Next?")
    calls = len(pipe.generator.calls)
    assert calls and first.budget.summary_cached == 0
    again = Conversation.from_messages(pipe, _messages(8), summary_max_tokens=30, summary_cache=cache).ask("Next?")
    assert len(pipe.generator.calls) == calls  # no new summary was written
    assert again.summary == first.summary and again.budget.summary_cached == first.budget.turns_summarized
    assert pipe.calls[-1]["history"] == pipe.calls[-2]["history"]
    # Another cap, another root: a summary written for 30 tokens is not reused for 20.
    Conversation.from_messages(pipe, _messages(8), summary_max_tokens=20, summary_cache=cache).ask("Next?")
    assert len(pipe.generator.calls) > calls
    # An edited earlier turn is another prefix too.
    edited = _messages(8)
    edited[1]["content"] = "A different first question about dedup?"
    before = len(pipe.generator.calls)
    turn = Conversation.from_messages(pipe, edited, summary_max_tokens=30, summary_cache=cache).ask("Next?")
    assert len(pipe.generator.calls) == before + calls and turn.budget.summary_cached == 0


def test_a_summary_cut_short_by_a_leaving_client_is_never_cached() -> None:
    import threading

    class Leaving(FakeGenerator):
        """The client disconnects during the summary: the generator stops early, as the real one
        does (partial text, finish_reason "cancelled", no exception)."""

        def __init__(self, cancel: threading.Event) -> None:
            super().__init__()
            self.cancel = cancel

        def generate(self, messages: list[dict[str, str]], *, max_new_tokens: int, cancel: Any = None) -> Any:
            self.calls.append({"messages": messages, "max_new_tokens": max_new_tokens})
            self.cancel.set()
            return type("G", (), {"text": "Summary", "finish_reason": "cancelled"})()

    cache = SummaryCache()
    cancel = threading.Event()
    pipe = FakePipeline(total=400, max_new=40, answer_words=40, generator=Leaving(cancel))
    Conversation.from_messages(pipe, _messages(8), summary_max_tokens=30, summary_cache=cache).ask(
        "Next?", cancel=cancel)
    assert len(pipe.generator.calls) == 1 and len(cache) == 0
    # Already gone before the summary: nothing is generated for it, and nothing cached.
    Conversation.from_messages(pipe, _messages(8), summary_max_tokens=30, summary_cache=cache).ask(
        "Next?", cancel=cancel)
    assert len(pipe.generator.calls) == 1 and len(cache) == 0
    # The retry of a client that stays gets a real summary, not the one cut short.
    retry_pipe = FakePipeline(total=400, max_new=40, answer_words=40)
    turn = Conversation.from_messages(retry_pipe, _messages(8), summary_max_tokens=30,
                                      summary_cache=cache).ask("Next?")
    assert turn.budget.summary_cached == 0 and retry_pipe.generator.calls and turn.summary != "Summary"
    assert len(cache) > 0


def test_a_summary_waiting_for_memory_leaves_the_queue_when_the_client_leaves() -> None:
    import threading

    from ragbudget.admission import AdmissionController

    pipe = FakePipeline(total=400, max_new=40, answer_words=40)
    pipe.admission = AdmissionController(1000, timeout=60.0)  # type: ignore[attr-defined]
    held = pipe.admission.acquire(1000)  # the GPU is busy
    cache, cancel, done = SummaryCache(), threading.Event(), []
    chat = Conversation.from_messages(pipe, _messages(8), summary_max_tokens=30, summary_cache=cache)
    t = threading.Thread(target=lambda: done.append(chat.ask("Next?", cancel=cancel)))
    t.start()
    while pipe.admission.stats().queued == 0:
        threading.Event().wait(0.005)
    cancel.set()
    t.join(timeout=10)  # not the 60 s admission timeout
    held.release()
    assert done and not pipe.generator.calls and len(cache) == 0
    assert done[0].summary.startswith("Asked:")  # the extractive fallback, for this request only


def test_summary_cache_is_bounded_and_validated() -> None:
    cache = SummaryCache(max_entries=2)
    root = SummaryCache.root("", 128)
    keys = [SummaryCache.extend(root, Turn(f"q{i}", f"a{i}")) for i in range(3)]
    for k in keys:
        cache.put(k, k[:8])
    assert len(cache) == 2 and cache.get(keys[0]) is None and cache.get(keys[2]) == keys[2][:8]
    assert SummaryCache.extend(root, Turn("ab", "c")) != SummaryCache.extend(root, Turn("a", "bc"))
    assert SummaryCache.root("", 128) != SummaryCache.root("", 64) != SummaryCache.root("x", 64)
    with pytest.raises(ConfigError, match="max_entries"):
        SummaryCache(0)


@pytest.fixture
def chat_server() -> Any:
    from ragbudget.server import background_server, create_app

    def start(pipe: Any, **options: Any) -> Any:
        return background_server(create_app(pipe, **options))

    return start


def test_http_ten_turns_over_budget_are_summarized_with_no_overrun(chat_server: Any) -> None:
    """The client resends the whole conversation each turn (as OpenAI clients do); the server folds
    what does not fit into a summary instead of dropping turns, and every prompt fits."""
    import openai

    pipe = FakePipeline(total=400, max_new=40, answer_words=40)
    messages: list[dict[str, str]] = [{"role": "system", "content": "Answer in English."}]
    memories = []
    with chat_server(pipe, summary_max_tokens=30, recent_turns=2) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for i in range(10):
            messages.append({"role": "user", "content": f"Question number {i} about the PDF cleaner and the KV budget?"})
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
    assert pipe.overruns == 0
    for m in memories:
        assert not m["overrun"] and m["prompt"] + m["output"] <= m["total"]
        for key in ("summary", "recent", "context_used", "output", "turns_summarized"):
            assert key in m
    assert memories[-1]["turns_summarized"] >= 7 and memories[-1]["summary"] > 0
    assert memories[0]["turns_summarized"] == 0 and memories[0]["summary"] == 0
    last = pipe.calls[-1]["history"]
    assert last[0]["content"] == "Answer in English." and last[1]["content"].startswith(SUMMARY_PREFIX)
    assert last[-2]["content"] == messages[-4]["content"]  # the most recent turns stay verbatim
    assert pipe.generator.calls  # the summaries came from the generator


@pytest.mark.parametrize("cache_size", [1024, 0])
def test_http_summaries_are_cached_between_requests(chat_server: Any, cache_size: int) -> None:
    """A client resending its conversation pays for folding only its new turns; the counter in
    /metrics says how many turns came from the cache. ``summary_cache_size=0`` turns it off."""
    import httpx

    pipe = FakePipeline(total=400, max_new=40, answer_words=40)
    messages: list[dict[str, str]] = []
    cached = []
    with chat_server(pipe, summary_max_tokens=30, recent_turns=2, summary_cache_size=cache_size) as url:
        for i in range(8):
            messages.append({"role": "user", "content": f"Question number {i} about the PDF cleaner and the KV budget?"})
            r = httpx.post(url + "/v1/chat/completions", timeout=30, json={"model": "ragbudget", "messages": messages})
            assert r.status_code == 200, r.text
            cached.append(r.json()["ragbudget"]["memory"]["summary_cached"])
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        scraped = httpx.get(url + "/metrics", timeout=30).text
    counter = int(re.search(r"^ragbudget_summary_cache_turns_total (\d+)$", scraped, re.M).group(1))
    assert counter == sum(cached)
    transcripts = [c["messages"][-1]["content"].count("User: ") for c in pipe.generator.calls]
    if cache_size:
        assert counter > 0 and all(n == 1 for n in transcripts[1:])
    else:
        assert counter == 0 and max(transcripts) > 2


def test_http_follow_up_is_expanded_for_retrieval(chat_server: Any) -> None:
    import httpx

    pipe = FakePipeline(total=400, max_new=40)
    with chat_server(pipe) as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "ragbudget", "context_tokens": 22, "messages": [
                {"role": "user", "content": "How does the PDF cleaner strip page headers?"},
                {"role": "assistant", "content": "It drops lines repeated at the top of pages."},
                {"role": "user", "content": "what about its footer?"}]})
    assert r.status_code == 200, r.text
    assert pipe.calls[-1]["question"] == "what about its footer?"
    assert "pdf" in pipe.calls[-1]["retrieval_query"] and pipe.calls[-1]["chunks"] == ["pdf-footer"]


def test_http_question_too_long_for_the_budget_is_a_400(chat_server: Any) -> None:
    import httpx

    pipe = FakePipeline(total=200, max_new=40)
    with chat_server(pipe) as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "ragbudget", "messages": [{"role": "user", "content": "word " * 400}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert pipe.calls == []


# --- with the real Pipeline (hash embedder, fake ChatML generator) ---------------------------------

def ChatMLTokenizer() -> HFWordTokenizer:  # noqa: N802 - reads as the class it stands for
    return HFWordTokenizer(chatml=True)


@dataclass
class RealishGeneration:
    text: str
    prompt_tokens: int
    new_tokens: int
    max_new_tokens: int
    finish_reason: str = "length"
    oom_steps: tuple = ()
    prompt: Any = None


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

    def generate(self, prompt: Any, *, max_new_tokens: int, on_text: Any = None, cancel: Any = None,
                 **_: Any) -> RealishGeneration:
        if isinstance(prompt, list):  # a summary request (chat messages)
            self.summaries += 1
            text = " ".join(re.findall(r"\w+", prompt[-1]["content"])[: max_new_tokens])
            return RealishGeneration(text, 0, max_new_tokens, max_new_tokens)
        self.prompts.append(prompt)
        words = [f"detail{i}" for i in range(max_new_tokens // 2)]
        text = " ".join(words)
        if on_text:
            on_text(text)
        return RealishGeneration(text, prompt.n_tokens, len(self.tokenizer.encode(text)), max_new_tokens,
                                 prompt=prompt)


@pytest.fixture(scope="module")
def hash_index(tmp_path_factory: pytest.TempPathFactory, repo_data: Any) -> Any:
    pytest.importorskip("ragbudget.dedup")  # the indexer needs it (landing in parallel)
    from ragbudget.pipeline import Pipeline

    index_dir = tmp_path_factory.mktemp("chat") / "idx"
    Pipeline(index_dir, embedder="hash:256").index([repo_data])
    return index_dir


def test_ten_turns_with_the_real_pipeline_and_prompt_builder(hash_index: Any) -> None:
    from ragbudget.pipeline import Pipeline

    gen = ChatMLGenerator()
    # 0.3 GiB for SmolLM2-135M leaves a few hundred tokens per request: history overflows fast.
    pipe = Pipeline(hash_index, generator=gen, gpu="0.3GiB", max_new_tokens=48)
    total = pipe.plan.max_context_tokens
    assert total < 1000
    chat = Conversation(pipe, history_share=0.3, summary_max_tokens=24, recent_turns=2)
    questions = ["What is the Debian social contract?", "What does it promise about free software?",
                 "How many versions of it are there?", "Who wrote the constitution?",
                 "What about its amendments?", "What is Warsaw known for?", "And its university?",
                 "Which system call creates a pipe?", "What does it return on error?", "Thanks, and dup2?"]
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


# --- the real default models (slow) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def real_pipeline(tmp_path_factory: pytest.TempPathFactory, repo_data: Any) -> Any:
    from ragbudget.pipeline import Pipeline

    index_dir = tmp_path_factory.mktemp("chat-real") / "idx"
    Pipeline(index_dir).index([repo_data / "manpages"])  # packaged MiniLM; a small corpus
    # 0.6 GiB for SmolLM2-135M (fp32 on CPU, 0.5 GiB of weights): ~500 tokens per request (and short CPU prefills).
    return Pipeline(index_dir, gpu="0.6GiB", max_new_tokens=12)


@pytest.mark.slow
def test_real_models_conversation_with_summary_and_follow_up(real_pipeline: Any) -> None:
    chat = Conversation(real_pipeline, history_share=0.08, summary_max_tokens=16, recent_turns=1)
    questions = ["Which system call creates a pipe?", "What does it return on error?", "what about close?"]
    turns = [chat.ask(q) for q in questions]
    total = real_pipeline.plan.max_context_tokens
    for t in turns:
        report = t.answer.report["budget"]
        assert not t.budget.overrun and report["prompt_tokens"] + 12 <= total
        assert report["fixed_prompt_tokens"] == t.budget.fixed + t.budget.summary + t.budget.recent
        assert t.text.strip()
    assert turns[0].sources
    assert chat.turns_summarized > 0 and chat.summary
    assert real_pipeline.generator.token_counter.count(chat.summary) <= 16
    assert turns[1].retrieval_query != questions[1]  # the follow-up was expanded for retrieval


# --- the REPL (`ragbudget chat` at a terminal and on a pipe) ------------------------------------------


def _slow_pipeline_cli(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Patch the CLI's Pipeline with the fake streaming one of tests/_chat_repl.py; return the
    list of questions it receives."""
    import _chat_repl

    _chat_repl.ASKED.clear()
    monkeypatch.setattr("ragbudget.pipeline.Pipeline", _chat_repl.SlowPipeline)
    return _chat_repl.ASKED


def test_chat_slash_commands_are_handled_locally_and_never_reach_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from ragbudget.cli import cli

    asked = _slow_pipeline_cli(monkeypatch)
    script = ("/sources\nWhat is MinHash?\n/help\n/sources\n/SOURCES\n/bogus\n/?\n"
              "/etc/fstab holds what?\n/reset\n/sources\n/quit\nnever asked\n")
    result = CliRunner().invoke(cli, ["chat"], input=script)
    assert result.exit_code == 0, result.output
    out = result.output
    assert asked == ["What is MinHash?", "/etc/fstab holds what?"]  # a path is a question, not a command
    first = out.splitlines()[0]
    assert first.startswith("ragbudget chat · fake/slow-model · 4000 tokens/turn (answer 64, history ≤ 30%)")
    assert "KV 1234 B/token" in first and "/help" in first
    assert out.count("Commands (never sent to the model):") == 2 and "/reset" in out and "Ctrl-C" in out
    assert out.count("(no answer yet)") == 2  # before the first answer and after /reset
    assert out.count("[1] /docs/1.md") == 1 + 2  # the answer's own block, then /sources twice
    assert "unknown command /bogus; /help lists the commands" in out
    assert "(conversation reset)" in out


def test_chat_json_mode_has_no_banner(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from click.testing import CliRunner

    from ragbudget.cli import cli

    _slow_pipeline_cli(monkeypatch)
    result = CliRunner().invoke(cli, ["chat", "--json"], input="What is MinHash?\n/help\n")
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert json.loads(first)["question"] == "What is MinHash?"


def test_run_chat_a_cancelled_answer_is_not_kept_in_the_history() -> None:
    import io

    from ragbudget.chat import run_chat

    class CancellingPipeline(FakePipeline):
        def ask(self, question: str, **kwargs: Any) -> FakeAnswer:
            answer = super().ask(question, **kwargs)
            if "cancel me" in question:
                kwargs["cancel"].set()  # as a Ctrl-C in the middle of the answer does
            return answer

    pipe = CancellingPipeline()
    chat = Conversation(pipe)
    out = io.StringIO()
    n = run_chat(chat, io.StringIO("What is MinHash?\nplease cancel me now\nand its shingles?\n"), out.write)
    assert n == 2 and len(pipe.calls) == 3
    assert "(answer cancelled)" in out.getvalue()
    assert [t.question for t in chat.turns] == ["What is MinHash?", "and its shingles?"]
    assert "cancel me" not in str(pipe.calls[2]["history"])


class _Terminal:
    """A child process on a pseudo-terminal: what a user at a keyboard sees and types."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        import os
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal (Ctrl-C = SIGINT)
            try:
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.output = ""

    def expect(self, text: str, timeout: float = 30.0, *, after: int = 0) -> int:
        """Read until ``text`` appears after offset ``after``; return the offset just past it."""
        import os
        import select
        import time

        end = time.monotonic() + timeout
        while (i := self.output.find(text, after)) < 0:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{text!r} not seen in {timeout} s; terminal shows:\n{self.output[-3000:]}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:  # the child exited (EIO on Linux)
                    data = b""
                if not data:
                    raise AssertionError(f"{text!r} not seen before exit; terminal shows:\n{self.output[-3000:]}")
                self.output += data.decode("utf-8", "replace")
        return i + len(text)

    def send(self, keys: str) -> None:
        import os
        import time

        # The prompt is on screen a moment before readline has put the terminal in raw mode;
        # keys typed in between would be echoed by the tty itself (a user never types that fast).
        time.sleep(0.2)
        os.write(self.fd, keys.encode())

    def wait(self, timeout: float = 30.0) -> int:
        import os
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                self.output += os.read(self.fd, 65536).decode("utf-8", "replace")
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, 9)
        raise AssertionError(f"chat did not exit; terminal shows:\n{self.output[-3000:]}")


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs a POSIX pseudo-terminal")
def test_chat_at_a_terminal_has_history_editing_and_ctrl_c_cancels_an_answer(tmp_path: Any) -> None:
    import json
    import os
    import sys
    from pathlib import Path

    driver = Path(__file__).with_name("_chat_repl.py")
    history = tmp_path / "cache" / "chat_history"
    env = {**os.environ, "TERM": "xterm", "RAGBUDGET_CHAT_HISTORY": str(history),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "INPUTRC": "/dev/null"}
    term = _Terminal([sys.executable, str(driver), "chat", "--index-dir", str(tmp_path / "idx")], env)
    at = term.expect("/help for commands")
    at = term.expect("> ", after=at)
    term.send("What is MinHash?\r")
    at = term.expect("memory:", after=at)
    at = term.expect("> ", after=at)
    term.send("\x1b[A\r")  # arrow up: the previous question again, edited by readline
    at = term.expect("memory:", after=at)
    at = term.expect("> ", after=at)
    term.send("tell me slowly\r")
    at = term.expect("word3", after=at)  # the answer is streaming ...
    term.send("\x03")  # ... Ctrl-C cancels it and the chat goes on
    at = term.expect("(answer cancelled)", after=at)
    at = term.expect("> ", after=at)
    term.send("half a quest")
    term.expect("half a quest", after=at)
    term.send("\x03")  # Ctrl-C at the prompt drops the typed line
    at = term.expect("> ", after=at)
    term.send("/sources\r")
    at = term.expect("[1] /docs/2.md", after=at)  # the last answer that was not cancelled
    at = term.expect("> ", after=at)
    term.send("\x04")  # Ctrl-D leaves
    assert term.wait() == 0
    out = term.output
    assert "^[[A" not in out
    assert "word399" not in out  # the slow answer did stop
    asked = json.loads(out[out.rindex("ASKED: ") + 7:].splitlines()[0])
    assert asked == ["What is MinHash?", "What is MinHash?", "tell me slowly"]
    assert "What is MinHash?" in history.read_text()  # readline's history, kept for next time


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs a POSIX pseudo-terminal")
def test_chat_at_a_terminal_recalls_history_from_the_last_session_and_survives_a_readonly_file(tmp_path: Any) -> None:
    import json
    import os
    import sys
    from pathlib import Path

    driver = Path(__file__).with_name("_chat_repl.py")
    history = tmp_path / "chat_history"
    history.write_text("Who wrote the footer?\n")
    history.chmod(0o444)
    env = {**os.environ, "TERM": "xterm", "RAGBUDGET_CHAT_HISTORY": str(history),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "INPUTRC": "/dev/null"}
    term = _Terminal([sys.executable, str(driver), "chat"], env)
    at = term.expect("> ")
    term.send("\x1b[A\r")
    at = term.expect("memory:", after=at)
    at = term.expect("> ", after=at)
    term.send("/exit\r")
    assert term.wait() == 0
    out = term.output
    asked = json.loads(out[out.rindex("ASKED: ") + 7:].splitlines()[0])
    assert asked == ["Who wrote the footer?"]
    assert "Error" not in out and "Traceback" not in out
    if os.geteuid() != 0:  # root writes through a read-only mode
        assert history.read_text() == "Who wrote the footer?\n"
