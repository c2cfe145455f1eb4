"""Conversation memory inside the one memory budget.

A conversation's history inside a request's budget: counting it after the chat template,
folding older turns into a summary (bounded in work and time, cancellable), and accounting for
where the tokens went. What a summary is and how it is kept across requests is
:mod:`ragbudget.summaries`.

A chat turn's prompt holds the earlier conversation, the retrieved context and the question, and
the KV cache must also hold the reserved output. All of it shares *one* per-request budget
(``pipeline.plan.max_context_tokens``)::

    total = fixed (chat template + system + question) + history + context + output

* the question of the current turn is never truncated (a question that alone does not fit is a
  :class:`~ragbudget.errors.BudgetError`);
* ``output`` is the reserved ``max_new_tokens``;
* ``history`` may take at most ``history_share`` of what is left after fixed and output (default
  0.3: retrieval is favoured); whatever history does not use goes to retrieval;
* when the verbatim turns do not fit that share, the older ones are folded into a rolling summary
  written by the same generator (capped at ``summary_max_tokens``); the last ``recent_turns`` stay
  verbatim as long as they fit;
* system messages a client sends with its history are instructions: like the question, they are
  never folded or cut (they count in ``fixed``).

The HTTP server uses the same machinery: :meth:`Conversation.from_messages` loads the history a
request carries (OpenAI ``messages``), and :meth:`Conversation.ask` fits, summarizes and answers.

History tokens are counted exactly in the generator's tokenizer *after* the chat template: the cost
of a set of messages is ``len(template(with them)) - len(template(without them))``, which includes
the role markers and separators the template adds around each message.

Follow-up questions ("what about its footer?") are expanded for retrieval with the salient terms of
the previous question(s), so the index sees what "its" refers to; the generator still gets the
question verbatim, with the conversation as history.

>>> from ragbudget.pipeline import Pipeline     # doctest: +SKIP
>>> chat = Conversation(Pipeline(".ragbudget"))  # doctest: +SKIP
>>> turn = chat.ask("How are page headers removed?")  # doctest: +SKIP
>>> turn = chat.ask("what about its footer?")         # doctest: +SKIP
>>> turn.budget.to_dict()                              # doctest: +SKIP
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import BudgetError, ConfigError, RequestCancelled
from .generation.allowance import limit_phrase, question_room
from .meter import Meter
from .prompt.followup import expand_query, is_follow_up, standalone_messages, standalone_query
from .retrieval.scope import Sources, scope_of
from .settings import HistorySettings, RecordField, from_keywords
from .summaries import (
    SUMMARY_PREFIX,
    Summarizer,
    SummaryCache,
    Turn,
    extractive_summary,
    summary_messages,
)

if TYPE_CHECKING:
    from .generation.allowance import RequestPlan
    from .pipeline import Answer, Pipeline

__all__ = [
    "SUMMARY_PREFIX",
    "ChatTurn",
    "Conversation",
    "SummaryCache",
    "Turn",
    "TurnBudget",
]

Message = dict[str, str]

# --- records --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnBudget:
    """Where the tokens of one turn went (all in the generator's tokens, after the chat template).

    ``summary + recent + context_used + fixed <= prompt_allowed`` and
    ``prompt + output <= total``; ``overrun`` is True when the pipeline reported a prompt that
    broke that bound (it should never happen; tests assert it).
    """

    total: int
    output: int
    prompt_allowed: int
    fixed: int
    history_allowed: int
    summary: int
    recent: int
    context_allowed: int
    context_used: int
    prompt: int
    turns_verbatim: int
    turns_summarized: int
    summary_updated: bool
    overrun: bool
    system: int = 0  # the client's system messages (part of ``fixed``: never cut)
    summary_cached: int = 0  # turns whose summary this turn took from a SummaryCache (no generate)
    #: Why the turns folded this turn were summarized by extraction (their questions and the first
    #: sentence of each answer) instead of by the generator: ``""`` when they were not.
    summary_fallback: str = ""
    #: What set ``total``: ``"time"`` (the context was cut to the time-to-first-token target at
    #: the measured prefill speed), ``"memory"``, ``"model"`` (the window), or a served
    #: engine's binding limit; ``""`` when the report did not say.
    limited_by: str = ""

    @property
    def history(self) -> int:
        return self.summary + self.recent

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "history": self.history}


@dataclass(frozen=True)
class ChatTurn:
    """The result of :meth:`Conversation.ask`: the pipeline's answer plus the memory accounting."""

    question: str
    retrieval_query: str
    answer: Answer
    budget: TurnBudget
    summary: str = ""
    cancelled: bool = False  # ``cancel`` was set: the answer is cut short and not kept in history

    @property
    def text(self) -> str:
        return self.answer.text

    @property
    def sources(self) -> list[dict[str, Any]]:
        return self.answer.sources

    def to_dict(self) -> dict[str, Any]:
        return {
            "question": self.question,
            "retrieval_query": self.retrieval_query,
            "answer": self.answer.to_dict(),
            "memory": self.budget.to_dict(),
            "summary": self.summary,
        }


# --- the conversation -----------------------------------------------------------------------------


@dataclass
class _State:
    turns: list[Turn] = field(default_factory=list)  # verbatim turns, oldest first
    summary: str = ""
    summarized: int = 0  # turns folded into the summary so far
    system: list[Message] = field(default_factory=list)  # the client's instructions, never folded
    # SummaryCache key of the current summary (None until the first fold looks it up).
    fold_key: str | None = None


@dataclass(frozen=True, kw_only=True)
class _Room:
    """One turn's room: the answer's reserve, the fixed part (question, template, the client's
    system messages), the prompt allowed and the request's total; ``left`` is for history and
    context together."""

    output: int
    system: int
    fixed: int
    prompt_allowed: int
    total: int

    @property
    def left(self) -> int:
        return self.prompt_allowed - self.fixed


class Conversation:
    """A multi-turn chat over a :class:`~ragbudget.pipeline.Pipeline`, inside its memory budget.

    ``history_share`` (0 ≤ share < 1) caps the history's part of the prompt room; the rest, and
    whatever history leaves unused, goes to retrieved context. ``recent_turns`` turns are kept
    verbatim when they fit; older ones are folded into a summary of at most
    ``summary_max_tokens`` tokens written by the pipeline's generator (or by ``summarizer(previous
    summary, turns, max_tokens)`` if given). ``max_new_tokens`` and ``context_tokens`` default to
    the pipeline's. ``expand_follow_ups`` rewrites follow-up questions for retrieval (see
    :func:`~ragbudget.prompt.followup.expand_query`). These five are the fields of ``history``, a
    :class:`~ragbudget.settings.HistorySettings`, given whole or as flat keywords (not both).
    :meth:`from_messages` starts from an existing history (what an HTTP
    request carries); a shared ``summary_cache`` (:class:`SummaryCache`) lets such one-request
    conversations reuse the summaries earlier requests wrote for the same older turns. ``sources``
    scopes every question to some files, as :meth:`Pipeline.ask <ragbudget.pipeline.Pipeline.ask>` does.

    >>> chat = Conversation(pipeline, history_share=0.3, recent_turns=2)  # doctest: +SKIP
    >>> chat.ask("What does the footer contain?").budget.summary          # doctest: +SKIP
    0
    """

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        history: HistorySettings | None = None,
        history_share: float | None = None,
        summary_max_tokens: int | None = None,
        recent_turns: int | None = None,
        max_new_tokens: int | None = None,
        context_tokens: int | None = None,
        expand_follow_ups: bool | None = None,
        rewrite_with_model: bool | None = None,
        summarizer: Summarizer | None = None,
        summary_role: str | None = None,
        summary_cache: SummaryCache | None = None,
        sources: Sources | None = None,
    ) -> None:
        # The history policy is one record (checked where it is built); its flat keywords are sugar.
        self.history = from_keywords(
            HistorySettings,
            history,
            "history",
            {
                "history_share": history_share,
                "summary_max_tokens": summary_max_tokens,
                "recent_turns": recent_turns,
                "expand_follow_ups": expand_follow_ups,
                "rewrite_with_model": rewrite_with_model,
                "summary_role": summary_role,
            },
        )
        self.pipeline = pipeline
        self.max_new_tokens = max_new_tokens
        self.context_tokens = context_tokens
        # Every question of the conversation is scoped to these files (Pipeline.ask's ``sources``).
        self.sources = scope_of(sources)
        self._summarizer = summarizer
        self.summary_cache = summary_cache
        self._cached_turns = 0
        self._meter = Meter(pipeline)
        self._state = _State()
        # Per turn (ask): the seconds spent writing summaries, why a fold fell back to the
        # extractive summary, and when the turn started (the summary's time budget).
        self._summary_s, self._fallback, self._started = 0.0, "", 0.0
        # Per turn: the seconds the follow-up's rewrite took, and why the terms stood in for it.
        self._rewrite_s, self._rewrite_fallback = 0.0, ""

    # The history settings by their flat names, read from ``history`` (read-only).
    history_share = RecordField("history")
    summary_max_tokens = RecordField("history")
    recent_turns = RecordField("history")
    expand_follow_ups = RecordField("history")
    rewrite_with_model = RecordField("history")
    summary_role = RecordField("history")

    @classmethod
    def from_messages(cls, pipeline: Pipeline, messages: Sequence[Message], **options: Any) -> Conversation:
        """A conversation whose history is ``messages`` (OpenAI-style ``{"role", "content"}``,
        oldest first, without the question to answer): each ``user`` message and the
        ``assistant`` reply after it form a turn; ``system`` messages are kept as instructions (a
        system message starting with :data:`SUMMARY_PREFIX` is taken back as the summary).
        ``options`` are the constructor's. The next :meth:`ask` folds whatever does not fit into
        the summary, as for a conversation held in memory.

        >>> chat = Conversation.from_messages(pipeline, [{"role": "user", "content": "Hi"},
        ...                                              {"role": "assistant", "content": "Hello"}])  # doctest: +SKIP
        >>> chat.ask("What about its footer?").budget.turns_verbatim  # doctest: +SKIP
        1
        """
        conv = cls(pipeline, **options)
        # Before anything is counted: each message is rendered through the chat template at
        # least once, so the limits bound the work one history can ask for.
        conv.history.check_size(
            messages=len(messages) + 1,
            chars=sum(len(c) for c in (m.get("content") for m in messages) if isinstance(c, str)),
        )
        state = conv._state
        question: str | None = None
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if not isinstance(content, str) or role not in ("system", "user", "assistant"):
                raise ConfigError(
                    f"history message {i} must have role system/user/assistant and text content; got {m!r}"
                )
            if role == "system":
                if content.startswith(SUMMARY_PREFIX) and not state.summary:
                    state.summary = content[len(SUMMARY_PREFIX) :]
                else:
                    state.system.append({"role": "system", "content": content})
            elif role == "user":
                if question is not None:  # two user messages in a row: the first got no answer
                    state.turns.append(Turn(question=question, answer=""))
                question = content
            else:
                state.turns.append(Turn(question=question or "", answer=content))
                question = None
        if question is not None:
            state.turns.append(Turn(question=question, answer=""))
        return conv

    # -- state --

    @property
    def turns(self) -> list[Turn]:
        """The turns kept verbatim, oldest first."""
        return list(self._state.turns)

    @property
    def summary(self) -> str:
        """The rolling summary of the turns folded so far ('' before the first fold)."""
        return self._state.summary

    @property
    def turns_summarized(self) -> int:
        return self._state.summarized

    def reset(self) -> None:
        """Forget the conversation (turns, summary and system messages)."""
        self._state = _State()

    def history_messages(self, turns: Sequence[Turn] | None = None, summary: str | None = None) -> list[Message]:
        """The chat messages standing for the conversation so far: the system messages, the
        summary, then the turns."""
        turns = self._state.turns if turns is None else turns
        summary = self._state.summary if summary is None else summary
        messages: list[Message] = list(self._state.system)
        if summary:
            messages.append({"role": self.history.summary_role, "content": SUMMARY_PREFIX + summary})
        for t in turns:
            # A turn loaded from a client's messages may lack one side (an assistant greeting
            # first, two user messages in a row); an empty message would only cost template tokens.
            if t.question or not t.answer:
                messages.append({"role": "user", "content": t.question})
            if t.answer or not t.question:
                messages.append({"role": "assistant", "content": t.answer})
        return messages

    def _history_cost(self, question: str, *, turns: Sequence[Turn] | None = None, summary: str | None = None) -> int:
        """Tokens of the summary and turns (not the system messages, which are fixed)."""
        system = self._state.system
        return self._meter.cost(self.history_messages(turns, summary), question) - (
            self._meter.cost(system, question) if system else 0
        )

    # -- one turn --

    def ask(
        self, question: str, *, on_text: Callable[[str], Any] | None = None, cancel: Any = None, **generate_options: Any
    ) -> ChatTurn:
        """Answer ``question`` with the conversation as history; fold older turns into the summary
        first when history would overflow its share. ``generate_options`` (``temperature``,
        ``top_p``, ``seed``, ``stop``, …) go to ``pipeline.ask`` for the answer; the summary is
        always written greedily. Raises :class:`~ragbudget.errors.BudgetError` when the question
        (with the client's system messages) alone leaves no room.

        Fitting the history is part of the turn's time: its seconds are the answer's
        ``timings["history_s"]`` (of which writing the summary, its wait for admission included,
        is ``summary_s``), inside ``total_s``. Setting ``cancel`` stops it too, between two
        counts or at the summary's next token; the turn is then cancelled, and the conversation
        keeps its turns (those a finished fold took are in its summary). A summary the measured
        speed says would end past the queue time-out (the time admission gives a first token) is
        not written: the turns are folded by extraction instead (``budget.summary_fallback``
        says why)."""
        if not isinstance(question, str) or not question.strip():
            raise ConfigError("the question is empty")
        t_start = self._started = time.perf_counter()
        self._summary_s, self._fallback, self._rewrite_s, self._rewrite_fallback = 0.0, "", 0.0, ""
        plan = self.pipeline.request_plan(self.max_new_tokens)
        # Written before any fold, from the turns the user saw: kept for the whole turn.
        try:
            rewritten = self._rewritten(question, cancel=cancel)
        except RequestCancelled:
            rewritten = ""  # the fit below sees it too, and the pipeline answers "cancelled"
        # The question's count and its candidates', in one request to a served engine: the
        # question is measured first here, and the answer's prompt is built from the candidates
        # (the turns are those before any fold; a fold that changes the query searches again).
        query = rewritten or self._retrieval_query(question)
        self.pipeline.prime(question, retrieval_query=query, sources=self.sources)
        room = self._room(question, plan)
        history_allowed = int(room.left * self.history.history_share)
        fitted = self._fitted_history(question, history_allowed, cancel=cancel, started=t_start)
        history, summary_tokens, history_tokens, summary_updated = fitted or ([], 0, 0, False)
        context_allowed = 0 if fitted is None else room.left - history_tokens
        if self.context_tokens is not None:
            context_allowed = min(context_allowed, self.context_tokens)
        history_s = time.perf_counter() - t_start - self._rewrite_s

        retrieval_query = rewritten or self._retrieval_query(question)
        answer = self.pipeline.ask(
            question,
            context_tokens=max(0, context_allowed),
            max_new_tokens=room.output,
            history=history or None,
            on_text=on_text,
            cancel=cancel,
            retrieval_query=retrieval_query if retrieval_query != question else None,
            sources=self.sources,
            **generate_options,
        )

        report = answer.report
        self._report_turn(report, history_s, retrieval_query if retrieval_query != question else "", bool(rewritten))
        budget = self._turn_budget(
            report.get("budget") or {},
            room,
            history_allowed=history_allowed,
            summary_tokens=summary_tokens,
            history_tokens=history_tokens,
            context_allowed=max(0, context_allowed),
            summary_updated=summary_updated,
        )
        report["memory"] = budget.to_dict()
        text = answer.text
        stopped = cancel is not None and cancel.is_set()
        if not stopped:
            # A cancelled answer is not part of the conversation: the next question is asked as if
            # it had never been written (its half is on the user's screen, not in the history).
            self._state.turns.append(Turn(question=question, answer=text, retrieval_query=retrieval_query))
        return ChatTurn(
            question=question,
            retrieval_query=retrieval_query,
            answer=answer,
            budget=budget,
            summary=self._state.summary,
            cancelled=stopped,
        )

    def _report_turn(self, report: dict[str, Any], history_s: float, query: str, rewritten: bool) -> None:
        """The turn's time from its start in ``report`` (the history's share and the rewrite were
        spent before the pipeline's own clock started), and how a follow-up was searched."""
        timings = report.setdefault("timings", {})
        timings["history_s"] = history_s
        if self._summary_s:
            timings["summary_s"] = self._summary_s
        if self._rewrite_s:
            timings["rewrite_s"] = self._rewrite_s
        timings["total_s"] = float(timings.get("total_s") or 0.0) + history_s + self._rewrite_s
        if query or self._rewrite_fallback:
            report["follow_up"] = {"retrieval_query": query, "written_by": "model" if rewritten else "terms"}
            if self._rewrite_fallback:
                report["follow_up"]["fallback"] = self._rewrite_fallback

    def _fitted_history(
        self, question: str, allowed: int, *, cancel: Any, started: float
    ) -> tuple[list[Message], int, int, bool] | None:
        """The history fitted into ``allowed`` tokens (older turns folded into the summary when it
        overflows): its messages, the summary's tokens, the whole history's, and whether the
        summary was written anew; ``None`` when the client left meanwhile."""
        try:
            summary_updated = self._fit(question, allowed, cancel=cancel, started=started)
        except RequestCancelled:
            # Left while the history was being fitted: no history, no context, and the pipeline
            # answers "cancelled" without generating (the conversation keeps its turns, or the
            # summary of those a finished fold took).
            return None
        summary_tokens = self._history_cost(question, turns=[]) if self._state.summary else 0
        return self.history_messages(), summary_tokens, self._history_cost(question), summary_updated

    def _room(self, question: str, plan: RequestPlan) -> _Room:
        """What one turn's prompt may hold once ``question`` (with the client's system messages)
        is in; a BudgetError when it leaves nothing."""
        output = plan.max_new_tokens
        system_tokens = self._meter.cost(self._state.system, question) if self._state.system else 0
        fixed = self._meter.fixed(question) + system_tokens
        # The pipeline's own rule (Pipeline.ask decides by it too): memory and the window bound
        # the question; a time cap never refuses one, it only shortens the context.
        prompt_allowed = question_room(plan, fixed, output)
        total = prompt_allowed + output
        if prompt_allowed - fixed <= 0:
            what = "the question and system messages" if system_tokens else "the question"
            raise BudgetError(
                f"{what} alone take {fixed} prompt tokens but the budget allows {prompt_allowed} "
                f"({total} per request{limit_phrase(plan)} minus {output} reserved "
                "for the answer); shorten the question, lower max_new_tokens, or plan for a larger "
                "GPU",
                needed=fixed + output,
                available=total,
            )
        return _Room(output=output, system=system_tokens, fixed=fixed, prompt_allowed=prompt_allowed, total=total)

    def _turn_budget(
        self,
        b: Mapping[str, Any],
        room: _Room,
        *,
        history_allowed: int,
        summary_tokens: int,
        history_tokens: int,
        context_allowed: int,
        summary_updated: bool,
    ) -> TurnBudget:
        """The turn's :class:`TurnBudget`, from its room, its history and the answer's budget ``b``."""
        context_used = int(b.get("context_tokens_used") or 0)
        prompt = int(b.get("prompt_tokens") or (room.fixed + history_tokens + context_used))
        return TurnBudget(
            total=room.total,
            output=room.output,
            prompt_allowed=room.prompt_allowed,
            fixed=room.fixed,
            history_allowed=history_allowed,
            summary=summary_tokens,
            recent=history_tokens - summary_tokens,
            context_allowed=context_allowed,
            context_used=context_used,
            prompt=prompt,
            turns_verbatim=len(self._state.turns),
            turns_summarized=self._state.summarized,
            summary_updated=summary_updated,
            summary_cached=self._cached_turns,
            overrun=prompt + room.output > room.total or history_tokens > history_allowed,
            system=room.system,
            limited_by=str(b.get("limited_by") or ""),
            summary_fallback=self._fallback,
        )

    def _retrieval_query(self, question: str) -> str:
        """What ``question`` is searched by when the model did not rewrite it: expanded by the
        recent turns' queries (a follow-up names what it is about there), unless
        ``expand_follow_ups`` is off."""
        return expand_query(question, self._previous_queries()) if self.history.expand_follow_ups else question

    def _previous_queries(self) -> list[str]:
        previous = [t.retrieval_query or t.question for t in self._state.turns[-max(1, self.history.recent_turns) :]]
        return [p for p in previous if p]

    # -- folding --

    def _fit(self, question: str, allowed: int, *, cancel: Any = None, started: float | None = None) -> bool:
        """Fold turns into the summary until summary + verbatim turns fit ``allowed`` tokens.
        Returns True when the summary changed. Raises :class:`~ragbudget.errors.RequestCancelled`
        when ``cancel`` is set (the state then holds only the folds that were complete).

        At most three folds, each one summary of at most ``summary_max_tokens`` tokens, and a
        bounded number of counts (a bisection, not a count per turn): however long the history,
        the work is a few generations and a few dozen renders of at most the history's length."""
        state = self._state
        self._cached_turns = 0
        self._started = time.perf_counter() if started is None else started
        _check_cancel(cancel)
        if self._history_cost(question) <= allowed:
            return False
        # 1. Everything older than the recent turns, in one summarization call.
        keep = min(self.history.recent_turns, len(state.turns))
        cut = len(state.turns) - keep
        resumed = self._resume_from_cache(cut)
        cut -= resumed
        changed = resumed > 0
        if changed and self._history_cost(question) <= allowed:
            return True
        if cut > 0:
            self._fold(state.turns[:cut], allowed, cancel=cancel)
            state.turns = state.turns[cut:]
            changed = True
            _check_cancel(cancel)
            if self._history_cost(question) <= allowed:
                return True
        # 2. The recent turns alone are too long: keep the newest of them that fit beside the
        # summary, fold the others in one more call.
        if state.turns:
            cut = len(state.turns) - self._fitting_suffix(question, allowed, cancel=cancel)
            if cut > 0:
                self._fold(state.turns[:cut], allowed, cancel=cancel)
                state.turns = state.turns[cut:]
                changed = True
                _check_cancel(cancel)
                if self._history_cost(question) <= allowed:
                    return True
        # 3. The new summary pushed them over again: fold what is left as well.
        if state.turns:
            self._fold(state.turns, allowed, cancel=cancel)
            state.turns = []
            changed = True
            _check_cancel(cancel)
            if self._history_cost(question) <= allowed:
                return True
        # Only the summary is left and it is still over: cut it to the room there is.
        overhead = self._history_cost(question, summary="x") - self._meter.count("x")
        state.summary = self._meter.truncate(state.summary, max(0, allowed - overhead - 4))
        while state.summary and self._history_cost(question) > allowed:
            _check_cancel(cancel)
            state.summary = self._meter.truncate(state.summary, self._meter.count(state.summary) - 4)
        self._set_summary(state.summary)
        return True

    def _fitting_suffix(self, question: str, allowed: int, *, cancel: Any = None) -> int:
        """How many of the newest verbatim turns fit ``allowed`` beside the summary: the cost
        grows with each turn kept, so a bisection finds it in log2(turns) counts."""
        turns = self._state.turns
        lo, hi = 0, len(turns)
        while lo < hi:
            _check_cancel(cancel)
            mid = (lo + hi + 1) // 2
            if self._history_cost(question, turns=turns[len(turns) - mid :]) <= allowed:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _fold(self, turns: Sequence[Turn], allowed: int, *, cancel: Any = None) -> None:
        state, cache = self._state, self.summary_cache
        cap = max(1, min(self.history.summary_max_tokens, allowed))
        key = None
        if cache is not None and state.fold_key is not None:
            key = state.fold_key
            for t in turns:
                key = SummaryCache.extend(key, t)
            cached = cache.get(key)
            if cached is not None:
                state.summarized += len(turns)
                self._cached_turns += len(turns)
                if self._meter.count(cached) <= cap:
                    state.summary, state.fold_key = cached, key
                else:  # written for a request with more room: cut it, and it is no longer that prefix
                    self._set_summary(self._meter.truncate(cached, cap))
                return
        complete = True
        if self._summarizer is not None:
            text = self._summarizer(state.summary, list(turns), cap)
        else:
            text, complete = self._generate_summary(state.summary, turns, cap, cancel=cancel)
        text = " ".join(text.split())
        if not text:
            text = extractive_summary(state.summary, turns)
            if complete:
                self._fallback = self._fallback or "the generator wrote no summary"
        state.summarized += len(turns)
        summary = self._meter.truncate(text, cap)
        # A summary cut short by the client leaving is not what this conversation would hold had
        # the client stayed: it is used for this request only, never cached.
        if key is not None and complete:
            state.summary, state.fold_key = summary, key
            cache.put(key, summary)  # type: ignore[union-attr]
        else:
            self._set_summary(summary)

    def _set_summary(self, summary: str) -> None:
        """Replace the summary by one no cached prefix stands for; later folds chain from it."""
        state = self._state
        state.summary = summary
        if state.fold_key is not None:
            state.fold_key = SummaryCache.root(summary, self.history.summary_max_tokens)

    def _resume_from_cache(self, cut: int) -> int:
        """Replace the oldest of the ``cut`` turns about to be folded by the longest prefix of
        them whose summary is cached (a request resending its conversation folds only what is new
        since the last one). Returns how many turns that took off."""
        state, cache = self._state, self.summary_cache
        if cache is None:
            return 0
        if state.fold_key is None:
            state.fold_key = SummaryCache.root(state.summary, self.history.summary_max_tokens)
        keys, key = [], state.fold_key
        for t in state.turns[:cut]:
            key = SummaryCache.extend(key, t)
            keys.append(key)
        found = cache.longest(keys)
        if found is None:
            return 0
        j, summary = found
        state.summary, state.fold_key = summary, keys[j - 1]
        state.summarized += j
        state.turns = state.turns[j:]
        self._cached_turns += j
        return j

    def _generate_summary(
        self, previous: str, turns: Sequence[Turn], cap: int, *, cancel: Any = None
    ) -> tuple[str, bool]:
        """Ask the pipeline's generator for the new summary, inside the same per-request budget.
        Returns the text and whether it was written to the end (not stopped by ``cancel``);
        ``""`` leaves the fold to the extractive summary. Raises
        :class:`~ragbudget.errors.RequestCancelled` when ``cancel`` is set before it generates."""
        _check_cancel(cancel)
        build = functools.partial(summary_messages, previous, cap=cap)
        room = self._side_room(cap)
        messages, n_prompt = self._meter.exchanges(turns, build, room, check=lambda: _check_cancel(cancel))
        if n_prompt > room:
            self._fallback = self._fallback or "not even one exchange fits the summarization prompt"
            return "", True
        text, complete, slow = self._side_request("summary", messages, n_prompt, cap, cancel=cancel)
        if slow:
            self._fallback = slow
        return text, complete

    def _rewritten(self, question: str, *, cancel: Any = None) -> str:
        """The follow-up ``question`` as the generator rewrites it to stand alone (LlamaIndex's
        condense step), from the summary and the recent turns; ``""`` when it is not asked to
        (``rewrite_with_model`` off, no history, a question that already stands alone) or wrote no
        usable question (``_rewrite_fallback`` says why; the terms stand in)."""
        state = self._state
        if not (self.history.rewrite_with_model and self.history.expand_follow_ups):
            return ""
        if not (state.turns or state.summary) or not is_follow_up(question):
            return ""
        cap, question = 64, self._meter.truncate(question, 192)  # a question, and room for the names it gains
        build = functools.partial(standalone_messages, question=question, summary=state.summary)
        recent, room = state.turns[-max(1, self.history.recent_turns) :], self._side_room(cap)
        messages, n_prompt = self._meter.exchanges(recent, build, room, check=lambda: _check_cancel(cancel))
        if n_prompt > room:
            self._rewrite_fallback = "the rewrite's prompt does not fit the request"
            return ""
        text, complete, slow = self._side_request("rewrite", messages, n_prompt, cap, cancel=cancel, stop=["\n"])
        _check_cancel(cancel)
        query = standalone_query(text, question, [t.question for t in recent]) if complete else ""
        if not query:
            self._rewrite_fallback = slow or f"the model wrote no standalone question ({text.strip()[:80]!r})"
            return ""
        return expand_query(question, self._previous_queries(), standalone=query)

    def _side_room(self, cap: int) -> int:
        """The prompt a side request writing ``cap`` tokens may hold: what one request may hold by
        the plan it is budgeted by now (memory, or the engine's window or KV share), less ``cap``."""
        return self.pipeline.request_plan(self.max_new_tokens).max_context_tokens - cap

    def _side_request(
        self, what: str, messages: list[Message], n_prompt: int, cap: int, *, cancel: Any, stop: list[str] | None = None
    ) -> tuple[str, bool, str]:
        """One short greedy request of the turn before its answer (the summary, the rewrite),
        admitted like any request: its text, whether it was written to the end (not stopped by
        ``cancel``), and why it was not asked at all (too slow; then ``""`` text)."""
        slow = self._too_slow(what, n_prompt, cap)
        if slow:
            return "", True, slow
        _check_cancel(cancel)
        t0 = time.perf_counter()
        try:
            # A client leaving while the request waits for KV memory leaves the queue too.
            with self.pipeline.admission.reserve(n_prompt + cap, prompt_tokens=n_prompt, cancel=cancel):
                result = self._meter.backend.generate(messages, max_new_tokens=cap, stop=stop, cancel=cancel)
        except RequestCancelled:
            return "", False, ""
        finally:
            if what == "summary":
                self._summary_s += time.perf_counter() - t0
            else:
                self._rewrite_s += time.perf_counter() - t0
        stopped = result.finish_reason == "cancelled" or (cancel is not None and cancel.is_set())
        return str(result.text or ""), not stopped, ""

    def _too_slow(self, what: str, prompt_tokens: int, cap: int) -> str:
        """Why writing a ``what`` (the summary, the rewrite) of ``prompt_tokens`` of prompt and
        ``cap`` tokens would not end within the queue time-out of the turn's start by admission's
        time model (its wait behind the work running, its prefill, ``cap`` decode steps, at the
        speed learnt), or ``""``: it comes before the answer's first token, which admission wants
        within that time. Nothing measured (a served engine): ``""``, and the time-out the caller
        sets (``cancel``) is the bound."""
        ctl = self.pipeline.admission
        thr, timeout = ctl.throughput, ctl.timeout
        if thr is None or timeout is None:
            return ""
        first = ctl.expected_first_token(prompt_tokens + cap, prompt_tokens=prompt_tokens) or 0.0
        expected = first + thr.decode_seconds(cap) * thr.slowdown
        left = timeout - (time.perf_counter() - self._started)
        if expected <= left:
            return ""
        return (
            f"a {cap}-token {what} of a {prompt_tokens}-token prompt would take about {expected:.1f} s at the "
            f"measured speed, past the {max(0.0, left):.1f} s left of the queue time-out of {timeout:g} s"
        )


def _check_cancel(cancel: Any) -> None:
    """Raise :class:`~ragbudget.errors.RequestCancelled` once ``cancel`` is set (a client left,
    or its request ran out of time): the history's loops look between two counts."""
    if cancel is not None and cancel.is_set():
        raise RequestCancelled("cancelled while fitting the conversation history")
