"""ragbudget.errors: the one error tree — drawn in its docstring as it is, refining the builtins a
caller would catch, and every error carrying the structured fields its docstring promises."""

from __future__ import annotations

import pytest

import ragbudget
from ragbudget.errors import (
    BudgetError,
    EngineContextError,
    EngineError,
    EngineOverloadedError,
    InputPathError,
    LoadError,
    OverloadedError,
    RagBudgetError,
)


def test_errors_refine_builtins() -> None:
    assert issubclass(ragbudget.ConfigError, ValueError)
    assert issubclass(ragbudget.IndexNotFoundError, LookupError)
    assert issubclass(ragbudget.BudgetError, ragbudget.RagBudgetError)


def _subclass_tree(root: type) -> dict[str, str]:
    """Each error under ``root`` (recursively) -> the ragbudget error it refines directly."""
    tree: dict[str, str] = {}
    for sub in root.__subclasses__():
        if sub.__module__ == "ragbudget.errors":
            tree[sub.__name__] = root.__name__
            tree.update(_subclass_tree(sub))
    return tree


def _docstring_tree(doc: str) -> dict[str, str]:
    """The tree drawn in a docstring (``├── Name`` / ``└── Name`` lines, nested by indentation),
    as child -> parent."""
    import re

    tree: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in doc.splitlines():
        m = re.match(r"^(\s*)(?:((?:│   |    )*)[├└]── )?([A-Z]\w*Error|RagBudgetError|RequestCancelled)\b", line)
        if not m or not (m.group(2) is not None or line.strip() == "RagBudgetError"):
            continue
        name = m.group(3)
        depth = len(m.group(1)) + len(m.group(2) or "") + (4 if m.group(2) is not None else 0)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            tree[name] = stack[-1][1]
        stack.append((depth, name))
    return tree


def test_the_error_tree_in_the_docstring_is_the_class_tree() -> None:
    # The docstring is where a user looks for what to catch: every error must be drawn there,
    # under the error it refines (a new class, a moved one or a renamed one fails here).
    from ragbudget import errors

    drawn = _docstring_tree(errors.__doc__ or "")
    real = _subclass_tree(errors.RagBudgetError)
    assert len(real) >= 20
    # ragbudget errors may refine two ragbudget errors (EngineContextError is an EngineError and a
    # BudgetError); the tree draws them under their first base.
    real = {name: getattr(errors, name).__mro__[1].__name__ for name in real}
    assert drawn == real


def test_an_engine_context_error_carries_every_budget_error_field() -> None:
    # `except BudgetError as e` code reads needed/available/unit/limit whichever error it got.
    e = EngineContextError(
        "prompt too long for http://x/v1/chat/completions",
        url="http://x/v1/chat/completions",
        kind="llamacpp",
        status=400,
        n_prompt_tokens=700,
        n_ctx=512,
        max_new_tokens=16,
        source="llama.cpp exceed_context_size_error",
    )
    assert isinstance(e, BudgetError) and isinstance(e, EngineError)
    assert (e.needed, e.available, e.unit, e.limit) == (716, 512, "tokens", "engine")
    assert (e.url, e.kind, e.status, e.n_ctx) == ("http://x/v1/chat/completions", "llamacpp", 400, 512)
    assert EngineContextError("no figures").needed is None


def test_overload_errors_say_when_to_retry() -> None:
    e = EngineOverloadedError("busy", url="http://x", status=503, retry_after=2.5, attempts=4)
    assert isinstance(e, OverloadedError) and isinstance(e, EngineError)
    assert (e.retry_after, e.attempts, e.status) == (2.5, 4, 503)
    assert OverloadedError("queue full").retry_after == 1.0


@pytest.mark.parametrize(
    ("error", "fields"),
    [
        (BudgetError("too big", needed=10, available=4, unit="bytes", limit="window"), ("needed", "unit", "limit")),
        (InputPathError("missing", paths=("a", "b")), ("paths",)),
        (LoadError("bad pdf", path="x.pdf", reason="encrypted"), ("path", "reason")),
    ],
)
def test_errors_keep_their_fields_and_their_one_line_message(error: RagBudgetError, fields: tuple[str, ...]) -> None:
    assert all(getattr(error, f) not in (None, "", ()) for f in fields)
    assert "\n" not in str(error) and isinstance(error, ragbudget.RagBudgetError)
