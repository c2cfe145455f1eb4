"""ragbudget._compat: the module paths from before the sub-packages (issue #32) still import, for one
release, as the very same modules, with a DeprecationWarning that names the new path and points
at the caller's line; private modules get no alias. Each case runs in a fresh interpreter, where
nothing has imported the new paths yet."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ragbudget import _compat

ROOT = Path(__file__).resolve().parent.parent


def run(code: str) -> dict[str, Any]:
    """Run ``code`` (which sets ``out``) in a new interpreter with every warning recorded."""
    script = (
        "import json, sys, warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        + "".join(f"    {line}\n" for line in code.splitlines())
        + "out['warnings'] = [[w.category.__name__, str(w.message), w.filename] for w in caught]\n"
        "print('OUT ' + json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, cwd=ROOT, timeout=120
    )
    assert "OUT " in done.stdout, done.stdout + done.stderr
    result: dict[str, Any] = json.loads(done.stdout.rsplit("OUT ", 1)[1])
    return result


def test_an_old_module_path_is_the_new_module_with_a_warning_at_the_caller() -> None:
    out = run(
        "out = {}\n"
        "from ragbudget.index import Index\n"
        "import ragbudget.retrieval.index as new\n"
        "out['same'] = Index is new.Index and sys.modules['ragbudget.index'] is new\n"
        "out['spec'] = new.__spec__.name\n"
        "import ragbudget.index\n"  # the second import is the cached module: no second warning
    )
    assert out["same"] and out["spec"] == "ragbudget.retrieval.index"
    assert out["warnings"] == [
        [
            "DeprecationWarning",
            "ragbudget.index is ragbudget.retrieval.index now; the old path works until the next release",
            "<string>",
        ]
    ]


def test_a_moved_package_brings_its_public_modules_and_not_its_private_ones() -> None:
    out = run(
        "out = {}\n"
        "import ragbudget.formats.office\n"
        "out['same'] = sys.modules['ragbudget.formats.office'] is sys.modules['ragbudget.input.formats.office']\n"
        "try:\n"
        "    import ragbudget.engines._base\n"
        "except ModuleNotFoundError as exc:\n"
        "    out['private'] = str(exc)\n"
    )
    assert out["same"]
    assert out["private"] == (
        "ragbudget.engines._base is private and moved to ragbudget.generation.engines._base; import it from there"
    )
    # each old path warns once: the package, then its module
    assert [w[1].split(" is ")[0] for w in out["warnings"]] == [
        "ragbudget.formats",
        "ragbudget.formats.office",
        "ragbudget.engines",
    ]


def test_an_old_module_that_is_a_package_now_keeps_its_names() -> None:
    # ragbudget.prompt was the prompt module; it is the prompt package now, whose modules import as
    # usual while the old module's names resolve with a warning. The CLI's entry point stays quiet.
    out = run(
        "out = {}\n"
        "from ragbudget.prompt import Prompt, select\n"
        "import ragbudget.prompt.prompt as new\n"
        "out['same'] = Prompt is new.Prompt and select is sys.modules['ragbudget.packing.select']\n"
        "from ragbudget.cli import main\n"
        "import ragbudget.cli.commands as commands\n"
        "out['main'] = main is commands.main\n"
        "try:\n"
        "    from ragbudget.prompt import no_such_name\n"
        "except ImportError as exc:\n"
        "    out['missing'] = type(exc).__name__\n"
    )
    assert out["same"] and out["main"] and out["missing"] == "ImportError"
    assert out["warnings"] == [
        [
            "DeprecationWarning",
            "ragbudget.prompt.Prompt is ragbudget.prompt.prompt.Prompt now; the old path works until the next release",
            "<string>",
        ],
        [
            # Packing left the prompt package (issue #44): its old module path warns the same way.
            "DeprecationWarning",
            "ragbudget.prompt.select is ragbudget.packing.select now; the old path works until the next release",
            "<string>",
        ],
    ]


def test_import_ragbudget_stays_light_and_the_new_paths_do_not_warn() -> None:
    out = run(
        "out = {}\n"
        "before = set(sys.modules)\n"
        "import ragbudget\n"
        "out['loaded'] = sorted(m for m in set(sys.modules) - before if m.startswith('ragbudget'))\n"
        "import ragbudget.memory.budget, ragbudget.generation.engines, ragbudget.server.app\n"
    )
    assert out["loaded"] == ["ragbudget", "ragbudget._compat"]
    assert out["warnings"] == []


def test_every_alias_names_a_module_that_exists_and_none_hides_one() -> None:
    assert _compat.ALIASES, "the alias table is empty"
    for old, new in _compat.ALIASES.items():
        assert importlib.util.find_spec(new) is not None, new
        path = ROOT.joinpath(*old.split("."))
        assert not path.with_suffix(".py").exists() and not path.is_dir(), f"{old} is a real module: no alias"


def test_the_names_packing_took_from_the_prompt_module_still_resolve_with_a_warning() -> None:
    out = run(
        "out = {}\n"
        "from ragbudget.prompt.prompt import build_prompt, texts_to_count, select_chunks\n"
        "import ragbudget.fitting, ragbudget.packing.select\n"
        "out['same'] = build_prompt is ragbudget.fitting.build_prompt\n"
        "out['same'] &= select_chunks is ragbudget.packing.select.select_chunks\n"
        "from ragbudget.retrieval.storage import FORMAT_VERSION\n"
        "out['version'] = FORMAT_VERSION\n"
    )
    assert out["same"] and out["version"] == 1
    said = [w[1].split(" is ")[0] for w in out["warnings"]]
    assert said == [
        "ragbudget.prompt.prompt.build_prompt",
        "ragbudget.prompt.prompt.texts_to_count",
        "ragbudget.prompt.prompt.select_chunks",
        "ragbudget.retrieval.storage.FORMAT_VERSION",
    ]


def test_every_old_path_in_the_tables_leads_to_a_module_and_name_that_exist() -> None:
    # The tables are data the import graph cannot see (importlib with a variable): checked here,
    # so a move or a rename that forgets them fails at once instead of at a user's import.
    import importlib
    import importlib.util

    from ragbudget._compat import ALIASES
    from ragbudget.prompt import prompt as prompt_module

    for old, new in ALIASES.items():
        assert importlib.util.find_spec(new) is not None, f"{old} -> {new}: no such module"
        parts = old.split(".")
        assert not (ROOT.joinpath(*parts).with_suffix(".py").exists() or ROOT.joinpath(*parts).is_dir()), (
            f"{old} is a module of its own again: its alias would shadow nothing"
        )
    for name, target in prompt_module.MOVED.items():
        assert hasattr(importlib.import_module(target), name), f"ragbudget.prompt.prompt.{name} -> {target}"
