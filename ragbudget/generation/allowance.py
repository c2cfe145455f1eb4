"""The prompt one request may hold: what a plan allows once the question is known.

A local pipeline plans from memory (:class:`~ragbudget.memory.budget.BudgetPlan`): :func:`prompt_room`
is what memory and the model's window allow for a question of ``fixed`` tokens, cut to the
plan's time-to-first-token cap when there is one, and :func:`question_too_long` the error when
even the question does not fit, naming the limit that binds. On a served engine the allowance
comes from the engine's own figures (:class:`EnginePlan`), and :func:`engine_admission` sizes
admission control from them. :class:`~ragbudget.pipeline.Pipeline` and
:class:`~ragbudget.chat.Conversation` both decide by these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import BudgetError

if TYPE_CHECKING:
    from ..memory.budget import BudgetPlan
    from .backend import Capacity, RequestBudget

__all__ = [
    "MIN_TIME_CONTEXT",
    "UNLIMITED_TOKENS",
    "EnginePlan",
    "engine_admission",
    "memory_max_prompt",
    "model_name",
    "prompt_room",
    "question_too_long",
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
    >>> prompt_room(plan, 100, 256), prompt_room(plan, 1500, 256)   # 1,000 in time; +256 past it
    (1000, 1756)
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


def time_cap(plan: BudgetPlan, fixed: int, *, device: str, speed: dict[str, Any] | None) -> dict[str, Any] | None:
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
