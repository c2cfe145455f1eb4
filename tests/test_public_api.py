"""The curated public surface: complete, from its defining modules, resolvable, and light to import."""

from __future__ import annotations

import subprocess
import sys

import ragbudget


def test_every_error_is_exported() -> None:
    # A new error class that users cannot import from `ragbudget` cannot be caught by name.
    import inspect

    from ragbudget import errors

    defined = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == errors.__name__
    }
    assert defined, "ragbudget.errors defines no error classes"
    assert defined - set(ragbudget.__all__) == set()


def test_each_export_comes_from_the_module_that_defines_it() -> None:
    # `_EXPORTS` maps a name to its defining module; a stale entry (a name moved or re-exported
    # elsewhere) would make `ragbudget.X` a different object than the one the docs describe.
    for name, module in ragbudget._EXPORTS.items():
        value = getattr(ragbudget, name)
        if hasattr(value, "__module__"):
            assert value.__module__ == f"ragbudget.{module}", (name, value.__module__)


def test_every_exported_name_resolves() -> None:
    for name in ragbudget.__all__:
        assert getattr(ragbudget, name) is not None, name


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        ragbudget.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


HEAVY = ("torch", "transformers", "faiss", "sentence_transformers")
FRAMEWORKS = ("langchain_core", "llama_index", "haystack")  # only when an adapter is asked for


def test_import_is_light() -> None:
    # A fresh interpreter: importing the package and touching the light stages must not pull in
    # the heavy libraries (they cost seconds and gigabytes; a CLI --help must stay instant).
    code = (
        "import sys, ragbudget\n"
        "ragbudget.Document; ragbudget.chunk_text; ragbudget.strip_headers_footers\n"
        "ragbudget.load_document; ragbudget.kv_cache_bytes; ragbudget.plan_budget\n"
        "ragbudget.select_chunks; ragbudget.Pipeline; ragbudget.Index; ragbudget.Generator\n"
        "import ragbudget.cli.commands, ragbudget.integrations\n"
        f"print([m for m in {HEAVY + FRAMEWORKS!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_what_a_pipeline_returns_is_importable_from_ragbudget() -> None:
    # A user annotating `hits: list[ragbudget.Hit] = rb.search(q)` should not need to know which
    # module defines each record.
    import re

    from ragbudget.pipeline import Pipeline

    typing_names = {"None", "Any", "Sequence", "Iterator", "AsyncIterator", "Callable", "Mapping", "PathLike"}
    needed: set[str] = set()
    for name in (
        "index",
        "search",
        "ask",
        "aask",
        "stream",
        "astream",
        "plan",
        "plan_for",
        "embedder",
        "backend",
        "generator",
        "admission",
        "store",
    ):
        attr = getattr(Pipeline, name)
        func = attr.fget if isinstance(attr, property) else attr
        needed |= set(re.findall(r"\b[A-Z]\w*", func.__annotations__["return"])) - typing_names
    assert {
        "Hit",
        "IndexSummary",
        "Answer",
        "AnswerStream",
        "BudgetPlan",
        "Embedder",
        "Backend",
        "Generator",
        "AdmissionController",
        "Index",
    } <= needed
    assert needed - set(ragbudget.__all__) == set()
    for name in ("Generation", "Tokenizer", "Embedder"):  # what those objects hand back in turn
        assert name in ragbudget.__all__


OPTIONAL = (
    "fastapi",
    "uvicorn",
    "sse_starlette",
    "matplotlib",
    "docx",
    "pptx",
    "pytesseract",
    "PIL",
    "ray",
    "onnxruntime",
    "onnx",
    "langchain_core",
    "llama_index",
    "haystack",
    "openai",
    "psutil",
    "optimum",
)


def test_every_module_imports_without_the_optional_extras() -> None:
    # `--doctest-modules` imports every module of the package; one that imported an extra at the
    # top would fail collection on a machine without it (and break `import ragbudget.x` there).
    import pkgutil

    names = sorted(
        m.name for m in pkgutil.walk_packages(ragbudget.__path__, "ragbudget.") if m.name != "ragbudget.__main__"
    )
    assert "ragbudget.server.app" in names and "ragbudget.input.formats.office" in names
    code = (
        "import importlib, sys\n"
        f"for m in {OPTIONAL!r}: sys.modules[m] = None  # `import m` raises ImportError\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
