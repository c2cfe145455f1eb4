"""The prompt one request may hold: what a plan allows once the question is known.

Every backend answers one :class:`~ragbudget.generation.backend.Capacity` record; this module
reads it, so no caller asks which kind of backend it is. Where ragbudget plans the memory (the
record carries a :class:`~ragbudget.memory.budget.BudgetPlan`, the local generator's),
:func:`prompt_room` is what memory and the model's window allow for a question of ``fixed``
tokens, cut to the plan's time-to-first-token cap when there is one, and
:func:`question_too_long` the error when even the question does not fit, naming the limit that
binds. Where an engine holds its own memory, the allowance comes from the figures it reports
(:class:`EnginePlan`), and :func:`engine_admission` sizes admission control from them.
:func:`request_allowance`, :func:`request_plan` and :func:`admission_size` choose between the
two; :class:`~ragbudget.pipeline.Pipeline` and :class:`~ragbudget.chat.Conversation` decide by
them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from ..errors import BudgetError

if TYPE_CHECKING:
    from ..memory.budget import BudgetPlan
    from .backend import Backend, Capacity, RequestBudget

__all__ = [
    "MIN_TIME_CONTEXT",
    "UNLIMITED_TOKENS",
    "Allowance",
    "EnginePlan",
    "PlanReport",
    "RequestPlan",
    "admission_size",
    "engine_admission",
    "limit_phrase",
    "memory_max_prompt",
    "model_name",
    "plan_lines",
    "plan_report",
    "prompt_room",
    "question_room",
    "question_too_long",
    "request_allowance",
    "request_plan",
    "time_cap",
]


def model_name(model_id: str) -> str:
    """A model id as shown to people and clients: a hub id (``org/name``) as is, a local path
    by its file or folder name — llama-server names its model by the GGUF's absolute path,
    which says where the operator keeps files and nothing about the model.

    >>> model_name("/srv/models/SmolLM2-135M-Instruct-Q4_1.gguf"), model_name("Qwen/Qwen3-8B")
    ('SmolLM2-135M-Instruct-Q4_1.gguf', 'Qwen/Qwen3-8B')
    """
    import os

    if os.path.isabs(model_id) or model_id.startswith(".") or "\\" in model_id:
        return os.path.basename(model_id.rstrip("/\\").replace("\\", "/")) or model_id
    return model_id


@dataclass(frozen=True)
class EnginePlan:
    """The allowance of one request on a served engine: the engine's ``capacity`` (every figure
    with its source and age) and what :func:`~ragbudget.generation.backend.per_request_tokens` made of it
    (``budget``: the context tokens, and which limit binds). What :class:`Pipeline` plans with
    when it generates on an engine, where the local path has a
    :class:`~ragbudget.memory.budget.BudgetPlan`. ``model`` is the served model's name as shown
    (:func:`model_name`: a local path by its file name)."""

    capacity: Capacity
    budget: RequestBudget
    url: str
    kind: str
    detected: str
    model: str

    @property
    def max_new_tokens(self) -> int:
        return self.budget.max_new_tokens

    @property
    def max_prompt_tokens(self) -> int:
        """Prompt tokens one request may send (template, question, history and context)."""
        return self.budget.overhead_tokens + self.budget.context_tokens

    @property
    def max_context_tokens(self) -> int:
        """Prompt and answer of one request."""
        return self.max_prompt_tokens + self.budget.max_new_tokens

    @property
    def limited_by(self) -> str:
        """The limit that binds: the engine's ``"window"`` or its ``"kv"`` share."""
        return self.budget.binding

    @property
    def kv_bytes_per_token(self) -> int | None:
        """Not reported: the engine holds its KV cache in its own layout."""
        return None

    def lines(self) -> list[str]:
        """The plan as printed by ``budget --engine`` and ``ask --explain``: every figure with
        its source and age, then the allowance and the limit that binds."""
        b = self.budget
        out = [f"engine: {self.kind} at {self.url} ({self.detected}); model {self.model}"]
        out += self.capacity.describe()
        kv = (
            f"KV share {b.kv_share} tokens (÷ {b.sharing} sharing) → {b.kv_tokens} for context"
            if b.kv_share is not None
            else "KV: not reported (the window alone decides)"
        )
        out.append(f"window: {b.window_tokens + b.overhead_tokens} prompt tokens → {b.window_tokens} for context; {kv}")
        out.append(
            f"per request: {b.context_tokens} context tokens + {b.overhead_tokens} template "
            f"and question + {b.max_new_tokens} answer; limited by {b.binding} "
            f"({b.binding_tokens} tokens, {b.binding_source or 'unknown source'})"
            + (" — advisory: engine metrics may be stale" if b.advisory else "")
        )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": {"url": self.url, "kind": self.kind, "detected": self.detected, "model": self.model},
            "capacity": self.capacity.to_dict(),
            "request": self.budget.to_dict(),
            "lines": self.lines(),
        }


#: Context tokens a time cap always leaves: room for the best chunk whole (the default chunker
#: makes 300-500 tokens). A speed probed on a busy host can be 10-15x too slow (seen in CI: 15 ms a
#: token where the idle host gives 1.2), and the 256 tokens this was before left SmolLM2 a cut
#: window it could not answer from ("The answer is: [4] Warsaw.md"); at 384 and 512 it answered
#: the three demo questions. A slow first token beats an answer from nothing.
MIN_TIME_CONTEXT = 512


def prompt_room(plan: BudgetPlan, fixed: int, max_new_tokens: int) -> int:
    """The prompt tokens a request may hold when its question (with the system prompt, history
    and chat template) costs ``fixed``, by ``plan``: what memory and the model's window allow —
    a question past that is a :class:`~ragbudget.errors.BudgetError` naming the limit — cut to
    the plan's time cap when there is one, which never refuses a question and always leaves room
    for the best passage whole. :meth:`~ragbudget.pipeline.Pipeline.ask` and
    :class:`~ragbudget.chat.Conversation` both decide by it.

    >>> from ragbudget.memory.budget import cap_plan_for_time, plan_budget
    >>> plan = cap_plan_for_time(plan_budget("Qwen/Qwen3-8B", gpu="24GiB", max_new_tokens=256),
    ...                          {"a": 0.001, "b": 0.0}, 1.0)
    >>> prompt_room(plan, 100, 256), prompt_room(plan, 1500, 256)   # 1,000 in time; +512 past it
    (1000, 2012)
    """
    memory = memory_max_prompt(plan)
    if fixed > memory:
        raise question_too_long(plan, fixed, max_new_tokens)
    if plan.time_prompt_tokens is None or plan.ttft_target_s is None:
        return memory
    return min(memory, fixed + max(MIN_TIME_CONTEXT, plan.time_prompt_tokens - fixed))


def memory_max_prompt(plan: BudgetPlan) -> int:
    """The prompt tokens memory and the window allow, before any time cap."""
    total = plan.memory_max_context_tokens or plan.max_context_tokens
    return total - plan.max_new_tokens


def time_cap(plan: BudgetPlan, fixed: int, *, device: str, speed: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The context cap ``plan``'s time-to-first-token target sets for a question of ``fixed``
    tokens (``{"limit": "time", "tokens": …}`` with the target, the ``device`` and the prefill
    ``speed`` fit it came from), or ``None`` when the plan has no time target."""
    if plan.time_prompt_tokens is None or plan.ttft_target_s is None:
        return None
    prompt_tokens = plan.time_prompt_tokens
    # A question is never cut, and a context too small for one passage answers from nothing:
    # the cap keeps room for at least the best chunk whole.
    cap = max(MIN_TIME_CONTEXT, prompt_tokens - fixed)
    speed = speed or {}
    return {
        "limit": "time",
        "tokens": cap,
        "ttft_target_s": plan.ttft_target_s,
        "device": device,
        "prefill_tokens_in_target": prompt_tokens,
        "prefill_fit": {k: speed[k] for k in ("a", "b") if k in speed},
    }


#: Admission capacity when a served engine says nothing of its KV cache or slots.
UNLIMITED_TOKENS = 2**62


def engine_admission(cap: Capacity) -> tuple[int, str]:
    """The KV tokens admission control may hand out on a served engine, and where that figure
    comes from: the engine's KV tokens when it reports them, else its window × request slots,
    else :data:`UNLIMITED_TOKENS` (fail open — the engine queues and refuses itself)."""
    if cap.kv_tokens_total:
        return cap.kv_tokens_total, (f"{cap.kv_tokens_total} KV tokens ({cap.kv_total_source})")
    if cap.max_context_tokens and cap.max_concurrent:
        return cap.max_context_tokens * cap.max_concurrent, (
            f"{cap.max_context_tokens} tokens × {cap.max_concurrent} requests "
            f"({cap.max_context_source}; {cap.max_concurrent_source})"
        )
    return UNLIMITED_TOKENS, (
        f"open: the {cap.engine_kind or 'engine'} reports no KV cache size nor request slots, "
        "so ragbudget admits every request (the engine queues and refuses them itself)"
    )


def question_too_long(plan: BudgetPlan, fixed: int, max_new_tokens: int) -> BudgetError:
    """The error for a question (with system prompt, history and chat template: ``fixed``
    tokens) that leaves no room: it names the limit that binds — the model's window, whatever
    the memory, or the KV memory of this GPU at this concurrency — with its number."""
    window = plan.model_max_tokens
    what = "the question (with the system prompt, history and chat template)"
    if fixed + max_new_tokens > window:
        if fixed >= window:
            fix = "shorten the question or history"
        else:
            fix = (
                f"shorten the question or history, or lower max_new_tokens (--max-new-tokens) "
                f"to at most {window - fixed:,}"
            )
        return BudgetError(
            f"{what} is {fixed:,} tokens and {max_new_tokens:,} are reserved for the answer, but "
            f"the model window is {window:,} tokens ({plan.model}: max_position_embeddings); "
            f"{fix}",
            needed=fixed + max_new_tokens,
            available=window,
            limit="window",
        )
    return BudgetError(
        f"{what} is {fixed:,} tokens and {max_new_tokens:,} are reserved for the answer, but the "
        f"KV memory holds {memory_max_prompt(plan) + plan.max_new_tokens:,} tokens per request ({plan.model} on "
        f"{plan.gpu_name}, {plan.usable_bytes / 2**30:.2f} GiB usable, concurrency "
        f"{plan.concurrency}); shorten the question or history, lower max_new_tokens or "
        "concurrency, use a quantized/fp8 or offloaded KV cache, or a GPU with more memory",
        needed=fixed + max_new_tokens,
        available=memory_max_prompt(plan) + plan.max_new_tokens,
        limit="memory",
    )


# -- one record, either plan -----------------------------------------------------------------------

#: What a request is budgeted by: ragbudget's memory plan, or an engine's figures.
RequestPlan = Union["BudgetPlan", EnginePlan]


@dataclass(frozen=True, kw_only=True)
class Allowance:
    """What one request may hold: the ``plan`` it is budgeted by, the prompt tokens it may send
    (``max_prompt_tokens``: template, system prompt, history, question and context), and the cap
    set on its context (``limit``: ``{"limit": "context_tokens", "tokens": …}`` asked for, or
    ``{"limit": "time", …}`` by the plan's time-to-first-token target; ``None``: none)."""

    plan: RequestPlan
    max_prompt_tokens: int
    limit: dict[str, Any] | None


def engine_plan(backend: Backend, capacity: Capacity, budget: RequestBudget) -> EnginePlan:
    """The :class:`EnginePlan` of ``backend``'s figures: where it answers and how its kind was
    decided come with the record (a backend in this process is named by its repr)."""
    return EnginePlan(
        capacity=capacity,
        budget=budget,
        url=capacity.url or repr(backend),
        kind=capacity.engine_kind or "engine",
        detected=capacity.detected or "given: backend=",
        model=model_name(backend.model_id),
    )


def request_plan(
    backend: Backend, capacity: Capacity, *, max_new_tokens: int, overhead: Callable[[], int]
) -> RequestPlan:
    """The plan a request of ``max_new_tokens`` is budgeted by: the memory plan where ragbudget
    plans the backend's memory (``capacity.plan``), else the engine's figures and what they
    leave once the template, system prompt, history and question are in (``overhead()``,
    counted only then: a memory plan needs no tokenizer)."""
    from .backend import per_request_tokens

    if capacity.plan is not None:
        return capacity.plan
    budget = per_request_tokens(capacity, max_new_tokens=max_new_tokens, overhead_tokens=overhead())
    return engine_plan(backend, capacity, budget)


def request_allowance(
    backend: Backend, capacity: Capacity, *, fixed: int, max_new_tokens: int, context_tokens: int | None = None
) -> Allowance:
    """What a request whose template, system prompt, history and question cost ``fixed`` tokens
    may hold, by ``capacity``: a question memory or the window cannot hold is a
    :class:`~ragbudget.errors.BudgetError` naming the limit. ``context_tokens`` pins the context
    below that; on a memory plan with a time target, the time cap shortens it otherwise (and
    never refuses a question)."""
    from .backend import per_request_tokens

    plan = capacity.plan
    limit: dict[str, Any] | None
    if plan is None:
        budget = per_request_tokens(capacity, max_new_tokens=max_new_tokens, overhead_tokens=fixed)
        eplan = engine_plan(backend, capacity, budget)
        limit = None if context_tokens is None else {"limit": "context_tokens", "tokens": context_tokens}
        max_prompt = eplan.max_prompt_tokens
        if context_tokens is not None:
            max_prompt = min(max_prompt, fixed + context_tokens)
        return Allowance(plan=eplan, max_prompt_tokens=max_prompt, limit=limit)
    max_prompt = memory_max_prompt(plan)
    prompt_room(plan, fixed, max_new_tokens)  # refuses a question memory cannot hold
    if context_tokens is not None:
        limit = {"limit": "context_tokens", "tokens": context_tokens}
    else:
        limit = time_cap(plan, fixed, device=capacity.device, speed=capacity.speed)
    if limit is not None:
        max_prompt = min(max_prompt, fixed + limit["tokens"])
    return Allowance(plan=plan, max_prompt_tokens=max_prompt, limit=limit)


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """What an answer's report takes from the plan it was budgeted by, whichever kind it is, so
    that no caller asks: the budget keys only that kind knows (``before``: a memory plan's KV
    figures; ``after``: the engine's own count of the prompt), the plan's own entry (``{"plan":
    …}`` or ``{"engine": …}``), the tokens reserved for the answer, the limit that binds, and
    whether the out-of-memory ladder's steps belong to the report (ragbudget ran the model)."""

    before: dict[str, Any]
    after: dict[str, Any]
    entry: dict[str, Any]
    max_new_tokens: int
    limited_by: str
    oom_ladder: bool
    #: What set the allowance, in words a one-line summary shows whatever the kind: the served
    #: engine (``"vllm at http://…"``) or the memory plan (``"2048 KV bytes/token"``).
    planned_by: str


def plan_report(plan: RequestPlan, *, engine_prompt_tokens: int | None = None) -> PlanReport:
    """:class:`PlanReport` of ``plan`` (``engine_prompt_tokens``: what a served engine counted)."""
    if isinstance(plan, EnginePlan):
        b = plan.budget
        return PlanReport(
            before={},
            after={"engine_prompt_tokens": engine_prompt_tokens or None},
            entry={"engine": plan.to_dict()},
            max_new_tokens=b.max_new_tokens,
            limited_by=b.binding,
            oom_ladder=False,
            planned_by=f"{plan.kind} at {plan.url}",
        )
    return PlanReport(
        before={"kv_bytes_per_token": plan.kv_bytes_per_token, "kv_capacity_tokens": plan.kv_capacity_tokens},
        after={},
        entry={"plan": plan.to_dict()},
        max_new_tokens=plan.max_new_tokens,
        limited_by=plan.limited_by,
        oom_ladder=True,
        planned_by=f"{plan.kv_bytes_per_token} KV bytes/token",
    )


def question_room(plan: RequestPlan, fixed: int, max_new_tokens: int) -> int:
    """The prompt tokens a request may hold once its question (with system prompt, history and
    template) costs ``fixed``: :func:`prompt_room` on a memory plan, an engine plan's prompt
    allowance otherwise."""
    if isinstance(plan, EnginePlan):
        return plan.max_prompt_tokens
    return prompt_room(plan, fixed, max_new_tokens)


def admission_size(capacity: Capacity) -> tuple[int, str]:
    """The KV tokens admission control may hand out, and where that figure comes from: the
    memory plan's KV capacity, or what the engine reports (:func:`engine_admission`)."""
    if capacity.plan is not None:
        tokens = capacity.plan.kv_capacity_tokens
        return tokens, f"{tokens} KV tokens (memory plan)"
    return engine_admission(capacity)


def limit_phrase(plan: RequestPlan) -> str:
    """What sets the tokens per request, as the plan says (``""`` when it names no single
    limit), to end a sentence: ``": the model window (…)"``."""
    if isinstance(plan, EnginePlan):
        b = plan.budget
        return f": the engine's {b.binding} limit ({b.binding_source})"
    if plan.limited_by == "model":
        return f": the model window ({plan.model}: max_position_embeddings)"
    if plan.limited_by == "memory":
        return f": the KV memory on {plan.gpu_name} at concurrency {plan.concurrency}"
    return ""


def plan_lines(plan: RequestPlan) -> list[str]:
    """The plan in a few lines, for a log: an engine's every figure with its source and age, or
    the memory plan's tokens per request and KV capacity."""
    if isinstance(plan, EnginePlan):
        return plan.lines()
    return [
        f"memory plan: {plan.max_context_tokens} tokens per request, KV capacity {plan.kv_capacity_tokens} "
        f"tokens (limited by {plan.limited_by})"
    ]
