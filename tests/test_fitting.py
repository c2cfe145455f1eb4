"""fit_prompt and build_prompt: pack into what the fixed part leaves, render once, and only when
a render comes out over, ask the packer for less and render again — the renderer never selects."""

from __future__ import annotations

from typing import Any

import pytest
from _fakes import WordTokenizer

from ragbudget.errors import BudgetError, ConfigError
from ragbudget.fitting import build_prompt, fit_prompt
from ragbudget.packing.packer import make_packer
from ragbudget.packing.select import Candidate, Selection
from ragbudget.prompt.prompt import Prompt, PromptBuilder
from ragbudget.types import Source

FACTS = [
    "The lighthouse was lit in 1847 and used a paraffin lamp.",
    "A foghorn was added in 1902 and sounded twice a minute.",
    "The station was automated in 1988 when the keepers left.",
]
CANDS = [Candidate(f"c{i}", t, 0.9 - i / 10, sources=(Source(f"f{i}.txt", 0, len(t)),)) for i, t in enumerate(FACTS)]
Q = "When was the lighthouse lit?"


class Merging(PromptBuilder):
    """A builder whose render costs ``surcharge`` tokens more than its parts (as a BPE merge
    across two blocks could), noting each render."""

    def __init__(self, surcharge: int) -> None:
        super().__init__(WordTokenizer(chatml=True))
        self.surcharge, self.renders = surcharge, 0

    def render(self, question: str, selection: Selection, **kw: Any) -> Prompt:
        self.renders += 1
        p = super().render(question, selection, **kw)
        extra = self.surcharge if selection.chunks else 0
        return Prompt(**{**p.__dict__, "input_ids": p.input_ids + (0,) * extra})


def test_a_prompt_that_fits_is_packed_and_rendered_once() -> None:
    b = Merging(surcharge=0)
    steps: list[str] = []
    fixed = b.fixed_tokens(Q)
    p = fit_prompt(
        Q, CANDS, packer=make_packer("chunks"), builder=b, max_prompt_tokens=fixed + 200, on_step=steps.append
    )
    assert steps == ["pack", "render"] and b.renders == 1
    assert p.fits and len(p.passages) == 3 and p.n_tokens == fixed + p.selection.tokens_used


def test_a_render_over_the_allowance_asks_the_packer_for_less() -> None:
    b = Merging(surcharge=1)
    fixed = b.fixed_tokens(Q)
    # Room for all three at their counted cost: the surcharged render is one over.
    used = fit_prompt(Q, CANDS, packer=make_packer("chunks"), builder=Merging(0), max_prompt_tokens=fixed + 200)
    budget = fixed + used.selection.tokens_used
    steps: list[str] = []
    p = fit_prompt(Q, CANDS, packer=make_packer("chunks"), builder=b, max_prompt_tokens=budget, on_step=steps.append)
    assert steps == ["pack", "render", "pack", "render"]
    assert p.fits and len(p.passages) == 2 and "1988" not in p.selection.text  # the lowest-scored went
    assert [d.reason for d in p.selection.dropped] == ["over_budget"]


def test_the_fixed_part_alone_over_the_budget_is_a_budget_error() -> None:
    b = Merging(surcharge=0)
    fixed = b.fixed_tokens(Q)
    with pytest.raises(BudgetError, match=f"alone take {fixed} tokens"):
        fit_prompt(Q, CANDS, packer=make_packer("chunks"), builder=b, max_prompt_tokens=fixed - 1)
    p = fit_prompt(Q, CANDS, packer=make_packer("chunks"), builder=b, max_prompt_tokens=fixed)
    assert p.fits and p.passages == ()


def test_build_prompt_takes_a_tokenizer_or_a_builder_and_a_known_pack() -> None:
    p = build_prompt(Q, CANDS, tokenizer=WordTokenizer(chatml=True), max_prompt_tokens=400, pack="spans")
    assert p.fits and p.selection.pack == "spans" and "1847" in p.selection.text
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        build_prompt(Q, CANDS, max_prompt_tokens=400)
    with pytest.raises(ConfigError, match="pack must be one of"):
        build_prompt(Q, CANDS, tokenizer=WordTokenizer(), max_prompt_tokens=400, pack="sentences")


def test_a_render_that_stays_over_is_said_apart_from_a_question_too_long(monkeypatch: pytest.MonkeyPatch) -> None:
    import ragbudget.fitting as fitting

    monkeypatch.setattr(fitting, "MAX_RENDERS", 1)
    b = Merging(surcharge=500)  # every render with a passage is far over
    fixed = b.fixed_tokens(Q)
    with pytest.raises(BudgetError, match="still rendered .* after 1 smaller selections") as exc:
        fit_prompt(Q, CANDS, packer=make_packer("chunks"), builder=b, max_prompt_tokens=fixed + 200)
    assert "alone take" not in str(exc.value)
