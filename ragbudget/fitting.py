"""Where packing and rendering meet: pack the candidates into what the prompt leaves them,
render once, and — on the rare render that comes out over (a BPE merge across two blocks, a
composed span cost a token short) — ask the packer for less and render again.

The packer (:mod:`ragbudget.packing`) never renders and the renderer
(:class:`~ragbudget.prompt.prompt.PromptBuilder`) never selects: this is the one place that
calls both, for the pipeline's ``ask`` and for callers who hold their own candidates
(:func:`build_prompt`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .errors import BudgetError, ConfigError
from .packing.packer import Packer, make_packer
from .prompt.prompt import Prompt, PromptBuilder, prompt_too_small

if TYPE_CHECKING:
    from .packing.select import Retrieved
    from .packing.spans import SpanScorer

__all__ = ["MAX_RENDERS", "build_prompt", "fit_prompt", "texts_to_count"]

#: Renders after the first before a prompt that still comes out over gives up a passage for good:
#: each shrink takes at least one passage out or packs on a smaller budget, so this is a guard.
MAX_RENDERS = 64


def fit_prompt(
    question: str,
    candidates: Sequence[Retrieved],
    *,
    packer: Packer,
    builder: PromptBuilder,
    max_prompt_tokens: int,
    fixed_tokens: int | None = None,
    safety_margin: int = 0,
    on_step: Any = None,
) -> Prompt:
    """The prompt of ``question`` with the ``candidates`` that fit, ``n_tokens <=
    max_prompt_tokens`` exactly: :meth:`Packer.pack` into the tokens the fixed part (system
    prompt, history, question: ``fixed_tokens`` when the caller counted it) leaves, one
    :meth:`PromptBuilder.render`, and :meth:`Packer.shrink` then render again while it is over.
    ``on_step(name)`` is told each ``"pack"`` and ``"render"`` as it starts (the pipeline's
    record of a question's way). The system prompt and question are never cut: if they alone
    exceed the budget, :class:`~ragbudget.errors.BudgetError` says by how much. The prompt's
    :meth:`~ragbudget.prompt.prompt.Prompt.fewer` packs the candidates again with ``packer``
    into a smaller allowance (what generation asks after an OOM or an engine's "too long")."""
    step = on_step or (lambda name: None)
    cands = list(candidates)
    fixed = builder.fixed_tokens(question) if fixed_tokens is None else fixed_tokens
    if fixed > max_prompt_tokens:
        raise prompt_too_small(fixed, max_prompt_tokens)
    step("pack")
    selection = packer.pack(
        question, cands, budget_tokens=max(0, max_prompt_tokens - fixed - safety_margin), counter=builder
    )
    step("render")
    prompt = builder.render(question, selection, max_prompt_tokens=max_prompt_tokens, fixed_tokens=fixed)
    attempt = 0
    while not prompt.fits and prompt.passages and attempt < MAX_RENDERS:
        step("pack")
        selection = packer.shrink(
            question, cands, selection, over=prompt.n_tokens - max_prompt_tokens, attempt=attempt, counter=builder
        )
        attempt += 1
        step("render")
        prompt = builder.render(question, selection, max_prompt_tokens=max_prompt_tokens, fixed_tokens=fixed)
    if not prompt.fits and prompt.passages:
        raise BudgetError(
            f"the prompt still rendered {prompt.n_tokens} tokens, over the budget of {max_prompt_tokens}, after "
            f"{attempt} smaller selections; report it with the question: a tokenizer whose counts do not add up",
            needed=prompt.n_tokens,
            available=max_prompt_tokens,
        )
    if not prompt.fits:
        raise prompt_too_small(fixed, max_prompt_tokens)

    def refit(smaller: int) -> Prompt:
        # Asked once generation has begun (the OOM ladder, an engine that counted the prompt
        # over its window): the same candidates, packed by the same packer into the smaller
        # allowance and rendered once more, so generation never drops passages itself.
        return fit_prompt(
            question, cands, packer=packer, builder=builder, max_prompt_tokens=smaller, fixed_tokens=fixed
        )

    return replace(prompt, refit=refit)


def build_prompt(
    question: str,
    candidates: Iterable[Retrieved],
    *,
    tokenizer: Any = None,  # a Hugging Face tokenizer (third-party, untyped here), as PromptBuilder's
    max_prompt_tokens: int,
    system_prompt: str | None = None,
    safety_margin: int = 0,
    builder: PromptBuilder | None = None,
    pack: str = "chunks",
    span_scorer: SpanScorer | None = None,
    # Any: forwarded to select_chunks or select_spans, whose own signatures check them.
    **select_options: Any,
) -> Prompt:
    """Select the ``candidates`` that fit and render the prompt, ≤ ``max_prompt_tokens`` exactly:
    :func:`fit_prompt` with the packer ``pack`` names (:func:`~ragbudget.packing.packer.make_packer`),
    counted and rendered by ``builder``, or by a :class:`PromptBuilder` over ``tokenizer``.

    ``select_options`` go to :func:`~ragbudget.packing.select.select_chunks` (``order``,
    ``lambda_``, ``min_score``, ...) or :func:`~ragbudget.packing.spans.select_spans`.
    ``pack="spans"`` packs the question's sentences inside the best chunks instead of whole chunks
    (``span_scorer``, a :class:`~ragbudget.packing.spans.SpanScorer`, adds embedding evidence). The
    accounting is the same: every passage is a labeled block counted exactly, and the rendered
    prompt is checked.

    >>> p = build_prompt("Who?", index.search("Who?", 50), tokenizer=gen.tokenizer,
    ...                  max_prompt_tokens=plan.max_prompt_tokens)   # doctest: +SKIP
    >>> p.n_tokens <= plan.max_prompt_tokens                         # doctest: +SKIP
    True
    """
    if builder is None and tokenizer is None:
        raise ConfigError("build_prompt needs a tokenizer (or a builder that counts): got neither")
    b = builder or PromptBuilder(tokenizer, system_prompt=system_prompt)
    packer = make_packer(pack, scorer=span_scorer, **select_options)
    cands = list(candidates)
    # The question's fixed part is counted with the candidates (one request to an engine).
    b.prime(packer.texts_to_count(cands, b), questions=[question])
    return fit_prompt(
        question, cands, packer=packer, builder=b, max_prompt_tokens=max_prompt_tokens, safety_margin=safety_margin
    )


def texts_to_count(candidates: Sequence[Retrieved], *, builder: PromptBuilder, pack: str = "chunks") -> list[str]:
    """What packing ``candidates`` with ``pack`` will count (:meth:`Packer.texts_to_count`): to
    count ahead in one batch where a count costs a request (:meth:`PromptBuilder.prime`)."""
    return make_packer(pack).texts_to_count(list(candidates), builder)
