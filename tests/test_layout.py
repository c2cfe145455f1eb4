"""The layout in CONTRIBUTING.md is the code's: every module named there exists and every module is
named there; a package imports only from the packages below it (lazy imports inside functions,
``TYPE_CHECKING`` imports and ``importlib.import_module`` names included); and the modules of one
package import each other without cycles."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ragbudget"


# --- the layout block -----------------------------------------------------------------------------


def read_layout(text: str) -> list[tuple[str, list[str]]]:
    """``[(folder, [unit, ...]), ...]`` from the ```layout block, bottom layer first: one line a
    package, ``ragbudget/<folder>/  name (what), name (what)``. A unit is a module (``index``) or
    a sub-package (``formats/``). The root folder ``ragbudget/`` may take several lines (its
    records at the bottom, the orchestration above the stages, the public surface on top); any
    other folder takes one."""
    block = re.search(r"```layout\n(.*?)```", text, re.S)
    assert block, "CONTRIBUTING.md has no ```layout block"
    lines: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        m = re.fullmatch(r"ragbudget/((?:\w+/)*)\s+(.+)", line.strip())
        assert m, f"layout line not 'ragbudget/<folder>/  name (what), ...': {line!r}"
        folder = m.group(1).rstrip("/")
        assert folder == "" or all(f != folder for f, _ in lines), f"ragbudget/{folder}/ takes two lines"
        units = [n.strip() for n in re.sub(r"\([^()]*(?:\([^()]*\)[^()]*)*\)", "", m.group(2)).split(",")]
        for unit in units:
            key = f"{folder}/{unit}" if folder else unit
            assert re.fullmatch(r"\w+/?", unit), f"not a module name: {unit!r} in {line!r}"
            assert key not in seen, f"{key} is named twice in the layout"
            seen.add(key)
        lines.append((folder, units))
    return lines


def layers(layout: list[tuple[str, list[str]]]) -> dict[str, int]:
    """``{unit key: layer}``; a unit key is ``folder/name`` (``retrieval/index``,
    ``input/formats/``), a root module's is its name, and a stage package's own ``__init__``
    (``input/__init__``) sits on its folder's line."""
    out: dict[str, int] = {}
    for layer, (folder, units) in enumerate(layout):
        for unit in units:
            out[f"{folder}/{unit}" if folder else unit] = layer
        if folder:
            out[f"{folder}/__init__"] = layer
    return out


def folders(layout: list[tuple[str, list[str]]]) -> set[str]:
    return {folder for folder, _ in layout if folder}


# --- modules and their imports --------------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str, stage_folders: set[str]) -> str:
    """The layout unit of a dotted name inside the package: the module, the sub-package it is in,
    or, for a name that is no module (``ragbudget.Pipeline``), the package that exports it."""
    folder, here = "", PACKAGE
    for part in module.split(".")[1:]:
        if (here / part / "__init__.py").is_file():
            inner = f"{folder}/{part}" if folder else part
            if inner not in stage_folders:
                return f"{inner}/"
            folder, here = inner, here / part
        elif (here / f"{part}.py").is_file():
            return f"{folder}/{part}" if folder else part
        else:
            break
    return f"{folder}/__init__" if folder else "__init__"


def _children(package: str) -> set[str]:
    """Every module and sub-package directly in ``package`` (dotted)."""
    here = PACKAGE.parent.joinpath(*package.split("."))
    out = {f"{package}.{p.stem}" for p in here.glob("*.py") if p.stem != "__init__"}
    return out | {f"{package}.{p.parent.name}" for p in here.glob("*/__init__.py")}


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every ``ragbudget`` module ``source`` imports, wherever the statement is: import
    statements, and ``importlib.import_module`` calls with a literal name (absolute, or relative
    to ``__name__``/``__package__``); an f-string ``f"{__name__}.{x}"`` or ``f".{x}"`` may name
    any module of that package, so it counts as importing each of them."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def resolve(name: str, level: int, anchor: str) -> str:
        base = anchor.split(".")
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([name] if name else []))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = resolve(node.module or "", node.level, package) if node.level else node.module or ""
            for a in node.names:  # ``from pkg import x``: x is a module of pkg, or a name pkg defines
                sub = f"{target}.{a.name}"
                found.add(sub if _is_module(sub) else target)
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            name, anchored = node.args[0], len(node.args) > 1 or any(k.arg == "package" for k in node.keywords)
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                text = name.value
                if text.startswith("."):
                    level = len(text) - len(text.lstrip("."))
                    found.add(resolve(text.lstrip("."), level, module if anchored else package))
                else:
                    found.add(text)
            elif isinstance(name, ast.JoinedStr) and name.values:
                first = name.values[0]
                if isinstance(first, ast.Constant) and str(first.value).startswith(".") and anchored:
                    found.update(_children(module if is_package else package))
                elif (
                    isinstance(first, ast.FormattedValue)
                    and isinstance(first.value, ast.Name)
                    and first.value.id in ("__name__", "__package__")
                ):
                    found.update(_children(module if is_package or first.value.id == "__package__" else package))
    return {m for m in found if m == "ragbudget" or m.startswith("ragbudget.")}


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module"
    )


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def package_sources() -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def import_edges(sources: dict[Path, str], stage_folders: set[str]) -> set[tuple[str, str, str]]:
    """``(importing module, imported module, where)`` for every import inside the package, both as
    dotted names."""
    edges = set()
    for path, source in sources.items():
        module = module_name(path)
        for target in imported_modules(source, module, path.name == "__init__.py"):
            edges.add((module, target, str(path.relative_to(ROOT))))
    return edges


def violations(sources: dict[Path, str], layout: list[tuple[str, list[str]]]) -> list[str]:
    rank, stage = layers(layout), folders(layout)
    out = []
    for module, target, where in sorted(import_edges(sources, stage)):
        here, there = unit_of(module, stage), unit_of(target, stage)
        if rank[there] > rank[here]:
            out.append(f"{where} (layer {rank[here]}, {here}) imports {target} (layer {rank[there]}, {there})")
    return out


# --- cycles inside a package ----------------------------------------------------------------------

#: Cycles between the modules of one package that exist today, each named by the import that
#: closes it (``(importer, imported)``; ``*`` is every module of that package) and what removes
#: it. Each waits for a split that must not run while other branches edit those modules (issue
#: #32's next step). An entry expires: once its import no longer closes a cycle the test asks for
#: its removal, and a cycle not listed here fails.
KNOWN_CYCLES: dict[tuple[str, str], str] = {}


def _existing(module: str) -> list[str]:
    """The parts (after ``ragbudget``) of the longest prefix of ``module`` that is a module."""
    parts = module.split(".")[1:]
    while parts and not _is_module(".".join(["ragbudget", *parts])):
        parts.pop()
    return parts


def nodes_of(module: str, stage_folders: set[str]) -> list[tuple[str, str]]:
    """``[(package, node), ...]``, innermost package first, up to the stage package (or the root)
    the module is in: its node in each package's graph, keyed like the layout. A module in a
    sub-package is one node of the package above it (``input/formats/epub`` is itself in
    ``input/formats`` and ``input/formats/`` in ``input``); a package's own ``__init__`` is
    ``<package>/__init__``."""
    parts = _existing(module)
    i = 0
    while i < len(parts) and "/".join(parts[: i + 1]) in stage_folders:
        i += 1
    stage, rest = parts[:i], parts[i:]
    if not rest:
        return [("/".join(stage), "/".join([*stage, "__init__"]))]
    is_package = (PACKAGE.joinpath(*parts) / "__init__.py").is_file()
    inner = rest if is_package else rest[:-1]
    out = [("/".join(stage + inner), "/".join([*stage, *rest, "__init__"] if is_package else [*stage, *rest]))]
    for k in range(len(inner) - 1, -1, -1):
        out.append(("/".join(stage + inner[:k]), "/".join(stage + inner[: k + 1]) + "/"))
    return out


def package_graphs(edges: Iterable[tuple[str, str, str]], stage_folders: set[str]) -> dict[str, set[tuple[str, str]]]:
    """``{package: {(node, node), ...}}``: the imports between the modules of each package (a
    sub-package one node of the package above it). Imports between stage packages, or between a
    stage package and the root, are the layer check's business."""
    graphs: dict[str, set[tuple[str, str]]] = {}
    for module, target, _ in edges:
        theirs = dict(nodes_of(target, stage_folders))
        for package, node in nodes_of(module, stage_folders):
            other = theirs.get(package)
            if other is not None and other != node:
                graphs.setdefault(package, set()).add((node, other))
    return graphs


def cycles(graph: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    succ: dict[str, list[str]] = {}
    for a, b in sorted(graph):
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return sorted(out)


def _allowed(edge: tuple[str, str], known: Iterable[tuple[str, str]]) -> tuple[str, str] | None:
    for a, b in known:
        if edge[0] == a and (edge[1] == b or (b.endswith("/*") and edge[1].startswith(b[:-1]))):
            return (a, b)
    return None


def cycle_findings(
    sources: dict[Path, str], layout: list[tuple[str, list[str]]], known: dict[tuple[str, str], str]
) -> list[str]:
    """A line for each cycle inside a package that no entry of ``known`` closes, and for each
    entry of ``known`` that closes no cycle any more."""
    stage = folders(layout)
    graphs = package_graphs(import_edges(sources, stage), stage)
    out, used = [], set()
    for package, graph in sorted(graphs.items()):
        in_cycles = {n for comp in cycles(graph) for n in comp}
        kept = set()
        for edge in graph:
            rule = _allowed(edge, known)
            if rule and edge[0] in in_cycles and edge[1] in in_cycles:
                used.add(rule)
            else:
                kept.add(edge)
        for comp in cycles(kept):
            out.append(f"ragbudget/{package + '/' if package else ''}: cycle between {', '.join(comp)}")
    for rule in sorted(set(known) - used):
        out.append(f"KNOWN_CYCLES entry {rule} closes no cycle any more: remove it")
    return out


@pytest.fixture(scope="module")
def layout() -> list[tuple[str, list[str]]]:
    return read_layout((ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8"))


def test_every_module_is_named_and_every_name_exists(layout: list[tuple[str, list[str]]]) -> None:
    stage = folders(layout)
    units = {unit_of(module_name(p), stage) for p in PACKAGE.rglob("*.py")}
    named = set(layers(layout))
    assert sorted(units - named) == [], "modules missing from CONTRIBUTING.md's layout"
    implicit = {f"{f}/__init__" for f in stage}  # a stage package's __init__ need not be named
    assert sorted(named - units - implicit) == [], "CONTRIBUTING.md's layout names modules that do not exist"
    for folder in stage:
        assert (PACKAGE / folder / "__init__.py").is_file(), f"ragbudget/{folder}/ is not a package"


def test_no_module_imports_a_higher_layer(layout: list[tuple[str, list[str]]]) -> None:
    assert violations(package_sources(), layout) == []


def test_a_lazy_typing_or_importlib_import_of_a_higher_layer_is_caught(layout: list[tuple[str, list[str]]]) -> None:
    # The check itself: a stage reaching up to the pipeline inside a function body, a record
    # module naming a stage only for typing, and a stage naming a face to importlib are reported.
    sources = package_sources()
    select, types = PACKAGE / "packing" / "select.py", PACKAGE / "types.py"
    sources[select] += (
        "\n\ndef _peek():\n    from ..pipeline import Pipeline\n    return Pipeline\n"
        "\n\ndef _face():\n    return importlib.import_module('ragbudget.server.app')\n"
    )
    sources[types] += "\nif TYPE_CHECKING:\n    from .retrieval.index import Index\n"
    rank = layers(layout)
    found = violations(sources, layout)
    assert found == [
        f"ragbudget/packing/select.py (layer {rank['packing/select']}, packing/select) imports ragbudget.pipeline "
        f"(layer {rank['pipeline']}, pipeline)",
        f"ragbudget/packing/select.py (layer {rank['packing/select']}, packing/select) imports ragbudget.server.app "
        f"(layer {rank['server/app']}, server/app)",
        f"ragbudget/types.py (layer {rank['types']}, types) imports ragbudget.retrieval.index "
        f"(layer {rank['retrieval/index']}, retrieval/index)",
    ]


def test_the_layout_block_is_strict() -> None:
    with pytest.raises(AssertionError, match="named twice"):
        read_layout("```layout\nragbudget/  x (one)\nragbudget/  x (again)\n```")
    with pytest.raises(AssertionError, match="takes two lines"):
        read_layout("```layout\nragbudget/a/  x (one)\nragbudget/a/  y (two)\n```")
    with pytest.raises(AssertionError, match="not 'ragbudget/"):
        read_layout("```layout\n0 foundation: x\n```")


def test_no_cycle_inside_a_package(layout: list[tuple[str, list[str]]]) -> None:
    assert cycle_findings(package_sources(), layout, KNOWN_CYCLES) == []


def test_the_cycle_check_sees_lazy_imports_and_sub_packages(layout: list[tuple[str, list[str]]]) -> None:
    # spans imports select; select importing spans back inside a function is a cycle, and so is a
    # served engine's module imported by the backend protocol (generation/ holds engines/).
    sources = package_sources()
    sources[PACKAGE / "packing" / "select.py"] += "\n\ndef _back():\n    from .spans import select_spans\n"
    sources[PACKAGE / "generation" / "backend.py"] += "\n\ndef _back():\n    from .engines import _base\n"
    found = cycle_findings(sources, layout, KNOWN_CYCLES)
    assert "ragbudget/packing/: cycle between packing/select, packing/spans" in found
    backend_cycle = "ragbudget/generation/: cycle between generation/backend, generation/engines/"
    assert any(f.startswith(backend_cycle) for f in found)
    # an allowance that closes nothing is reported, so that the list only shrinks
    assert cycle_findings(package_sources(), layout, {**KNOWN_CYCLES, ("cli/display", "cli/terminal"): "x"}) == [
        "KNOWN_CYCLES entry ('cli/display', 'cli/terminal') closes no cycle any more: remove it"
    ]


# --- module size: no module past 800 lines, and no exemption (issue #32) ---------------------------

MAX_LINES = 800


def oversized(sources: dict[Path, str]) -> list[str]:
    """``path (n lines)`` for each module over :data:`MAX_LINES` lines. There is no way to
    exempt one (the "One job:" docstring line that used to clear a module is gone, issue #32): a
    module past the limit is split along a real seam."""
    out = []
    for path, source in sources.items():
        n = len(source.splitlines())
        if n > MAX_LINES:
            out.append(f"{path.relative_to(ROOT)} ({n} lines)")
    return out


def test_no_module_is_over_800_lines() -> None:
    assert oversized(package_sources()) == [], "split these along a real seam (issue #32)"


#: The longest a function may be, docstring included (issue #44 §4: 28 were longer; each was
#: split where it did more than one thing).
MAX_FUNCTION_LINES = 80


def long_functions(sources: dict[Path, str]) -> list[str]:
    """``path:line name (n lines)`` for each function or method over :data:`MAX_FUNCTION_LINES`."""
    out = []
    for path, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_is_over_80_lines() -> None:
    assert long_functions(package_sources()) == [], "split where a function does more than one thing (issue #44)"


def test_the_function_size_check_sees_methods_and_nested_functions() -> None:
    relay = PACKAGE / "relay.py"
    body = "".join(f"        x{i} = {i}\n" for i in range(80))
    grown = relay.read_text(encoding="utf-8") + f"\n\nclass Grown:\n    def step(self):\n{body}"
    assert long_functions({relay: grown}) == [f"ragbudget/relay.py:{len(grown.splitlines()) - 80} step (81 lines)"]
    nested = relay.read_text(encoding="utf-8") + f"\n\ndef outer():\n    def inner():\n{body}    return inner\n"
    assert [x.split()[1] for x in long_functions({relay: nested})] == ["outer", "inner"]


def test_the_size_check_has_no_exemption() -> None:
    # A module grown past the limit is reported, whatever its docstring says.
    relay = PACKAGE / "relay.py"
    grown = (
        relay.read_text(encoding="utf-8").replace(
            "\n\n>>> relay = Relay(", "\n\nOne job: relaying a worker's output.\n\n>>> relay = Relay(", 1
        )
        + "x = 1\n" * 801
    )
    assert "One job:" in grown
    assert oversized({relay: grown}) == [f"ragbudget/relay.py ({len(grown.splitlines())} lines)"]
    assert oversized({relay: relay.read_text(encoding="utf-8")}) == []


# --- a test file for every module -----------------------------------------------------------------

#: Modules whose test file still carries the module's name from before the sub-packages (written
#: by the move to sub-packages, issue #32): ``{unit: test file}``.
TESTED_BY: dict[str, str] = {
    "server/app": "test_server.py",
    "cli/commands": "test_cli.py",
    "cli/options": "test_cli_options.py",
    "retrieval/durable": "test_storage.py",  # the local index's durable writes, tested through its commits
    "memory/activations": "test_gpu_check.py",  # graded against an H200's measurements, on any machine
}


def modules_without_a_test_file(package: Path, tests: Path, stage_folders: set[str]) -> list[str]:
    """Each module of the root or of a stage package (not an ``__init__``/``__main__``) without
    ``tests/test_<module>.py`` or ``tests/test_<package>_<module>.py``, and each sub-package of
    one (``generation/engines/``) without ``tests/test_<sub-package>.py``."""
    out = []
    for folder in ["", *sorted(stage_folders)]:
        here = package / folder if folder else package
        units = [p.stem for p in here.glob("*.py") if p.stem not in ("__init__", "__main__")]
        subs = [p.name for p in here.iterdir() if (p / "__init__.py").is_file()]
        units += [s for s in subs if f"{folder}/{s}".lstrip("/") not in stage_folders]
        for unit in units:
            key = f"{folder}/{unit}" if folder else unit
            names = {f"test_{unit.lstrip('_')}.py", f"test_{folder.replace('/', '_')}_{unit}.py", TESTED_BY.get(key)}
            if not any(n and (tests / n).is_file() for n in names):
                out.append(f"{key} (tests/test_{unit.lstrip('_')}.py)")
    return sorted(out)


def test_every_module_has_its_test_file(layout: list[tuple[str, list[str]]]) -> None:
    assert modules_without_a_test_file(PACKAGE, ROOT / "tests", folders(layout)) == []


def test_the_test_file_check_sees_modules_and_sub_packages(tmp_path: Path) -> None:
    pkg, tests = tmp_path / "pkg", tmp_path / "tests"
    (pkg / "stage" / "engines").mkdir(parents=True)
    tests.mkdir()
    for name in ("__init__.py", "__main__.py", "_hidden.py", "stage/__init__.py", "stage/one.py"):
        (pkg / name).write_text("")
    for name in ("stage/engines/__init__.py", "stage/engines/two.py"):
        (pkg / name).write_text("")
    assert modules_without_a_test_file(pkg, tests, {"stage"}) == [
        "_hidden (tests/test_hidden.py)",
        "stage/engines (tests/test_engines.py)",
        "stage/one (tests/test_one.py)",
    ]
    for name in ("test_hidden.py", "test_stage_one.py", "test_engines.py"):
        (tests / name).write_text("")
    assert modules_without_a_test_file(pkg, tests, {"stage"}) == []


# --- tests use public behaviour ---------------------------------------------------------------------

#: Private names the tests may still touch, ``(test file, name): why``. Each is a hook that
#: cannot be public without changing what a user gets: keep this short, and make a hook public
#: (a keyword, a settings field, a property) before adding to it.
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {
    # The shim for the module paths from before the sub-packages: the private module is what
    # test_compat tests (its imports and warnings), and it goes with the old paths.
    ("test_compat.py", "_compat"): "ragbudget._compat is the subject of the test",
    # tests/_replay.py's own Replay (a test helper, not ragbudget) guards its connections.
    ("_replay.py", "_lock"): "the test helper Replay's own lock",
    # bench/_figures.py (the figure checker bench/report.py imports), not ragbudget's
    # EngineLoad._figures: the same name, another module.
    ("test_bench_report.py", "_figures"): "bench/report.py's figure checker module, bench/_figures.py",
    # A module's doctests are the module's own: running those of the engines' private modules
    # needs the modules themselves.
    # The lazy-export table *is* what the test checks (each name from the module defining it).
    ("test_public_api.py", "_EXPORTS"): "ragbudget's lazy-export table is the subject",
}

#: Left from issue #33 §4, now none: a test that needs a hook gets a public one (``set_fts5``,
#: ``gguf_bar_only_on_a_terminal`` were the last). Keep it empty: a private use needs a reason in
#: PRIVATE_ALLOWED (test_the_private_allow_lists_hold_no_stale_entry fails on a stale line).
PRIVATE_NOT_YET: dict[tuple[str, str], str] = {}


def private_names(sources: Iterable[str]) -> set[str]:
    """Every private name (one leading underscore, not a dunder) the sources define: functions,
    classes, methods, module or class globals, and ``self._x`` attributes."""
    out: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                out.add(node.attr)
            elif isinstance(node, ast.alias):
                out.add((node.asname or node.name).split(".")[-1])
    return {n for n in out if _private(n)}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def private_uses(source: str, private: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` for each private name of ``private`` the test ``source`` reaches into:
    ``obj._name`` (other than ``self``/``cls``: a test's own class may keep private state),
    ``setattr``/``getattr``/``delattr``/``monkeypatch.setattr(obj, "_name", ...)`` and
    ``monkeypatch.setattr("ragbudget.x._name", ...)``, and ``from ragbudget... import _name``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in private:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            # setattr(obj, "_x"), monkeypatch.setattr(obj, "_x", v), mock.patch.object(obj, "_x"),
            # and the dotted forms monkeypatch.setattr("ragbudget.m._x", v), mock.patch("...").
            if name in ("setattr", "getattr", "delattr", "hasattr", "object", "patch"):
                for i, arg in enumerate(node.args[:2]):
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        last = arg.value.rsplit(".", 1)[-1]
                        if last in private and (i == 1 or arg.value.startswith("ragbudget.")):
                            found.append((node.lineno, last))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ragbudget"):
            found += [(node.lineno, a.name) for a in node.names if a.name in private]
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, part)
                for a in node.names
                if a.name.startswith("ragbudget.")
                for part in a.name.split(".")
                if part in private
            ]
    return sorted(set(found))


def private_findings(tests: Path, private: set[str], allowed: dict[tuple[str, str], str]) -> list[str]:
    return [
        f"{path.name}:{line} touches {name}, private to ragbudget: test through public behaviour, "
        "or give the code a public hook (CONTRIBUTING.md, Checks)"
        for path in sorted(tests.glob("*.py"))
        for line, name in private_uses(path.read_text(encoding="utf-8"), private)
        if (path.name, name) not in allowed
    ]


def test_no_test_touches_a_private_name_of_ragbudget() -> None:
    private = private_names(package_sources().values())
    assert private_findings(ROOT / "tests", private, {**PRIVATE_ALLOWED, **PRIVATE_NOT_YET}) == []


def test_the_private_allow_lists_hold_no_stale_entry() -> None:
    private = private_names(package_sources().values())
    used = {(p.name, name) for p in (ROOT / "tests").glob("*.py") for _, name in private_uses(p.read_text(), private)}
    assert set(PRIVATE_ALLOWED) - used == set() and set(PRIVATE_NOT_YET) - used == set()


def test_the_private_check_sees_attributes_patches_and_imports(tmp_path: Path) -> None:
    private = private_names(["class A:\n    def _hook(self): ...\n    def __init__(self):\n        self._x = 1\n"])
    assert private == {"_hook", "_x"}
    (tmp_path / "test_a.py").write_text(
        "from ragbudget.m import _hook\n"
        "a._x\n"
        "a._other\n"  # not ragbudget's: another library's private name is not this check's business
        "self._x\n"
        "monkeypatch.setattr(a, '_hook', None)\n"
        "monkeypatch.setattr('ragbudget.m._hook', None)\n"
        "getattr(a, '_x')\n"
        "a.__class__\n"
        "mock.patch.object(a, '_hook', None)\n"
        "mock.patch('ragbudget.m._x')\n"
    )
    got = private_findings(tmp_path, private, {})
    assert [f.split(" touches ")[0] for f in got] == [
        "test_a.py:1",
        "test_a.py:2",
        "test_a.py:5",
        "test_a.py:6",
        "test_a.py:7",
        "test_a.py:9",
        "test_a.py:10",
    ]
    assert private_findings(tmp_path, private, {("test_a.py", "_hook"): "why", ("test_a.py", "_x"): "why"}) == []


# -- local or served: one contract (issue #44 §2) -----------------------------------------------------
def backend_classes(sources: dict[Path, str]) -> set[str]:
    """The concrete backends generation/ defines: LocalBackend, ServedBackend and every class
    of generation/engines/ built on a backend."""
    names = {"LocalBackend", "ServedBackend"}
    for path, text in sources.items():
        if "engines" in path.parts:
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef) and any("Backend" in ast.unparse(b) for b in node.bases):
                    names.add(node.name)
    return names


def kind_questions(path: Path, text: str, classes: set[str]) -> list[str]:
    """Where a module asks which kind of backend it has: names a concrete backend class, asks a
    pipeline whether it is ``served``, or looks for an attribute on a backend by ``getattr``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Name) and node.id in classes:
            found.append(f"{path.name}:{node.lineno} names {node.id}")
        elif isinstance(node, ast.alias) and node.name.rsplit(".", 1)[-1] in classes:
            found.append(f"{path.name}:{node.lineno} imports {node.name}")
        elif isinstance(node, ast.Attribute) and node.attr in classes:
            found.append(f"{path.name}:{node.lineno} names {node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "served" and "memory" not in path.parts:
            found.append(f"{path.name}:{node.lineno} asks .served")  # memory/'s Job.served is work done
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and "backend" in ast.unparse(node.args[0]).lower()
        ):
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)[:60]}")
    return found


def test_no_module_outside_generation_asks_which_backend_it_has() -> None:
    # The Backend protocol (generation/backend.py) is the contract: the pipeline, chat, prompt,
    # the server and the CLI call it and never ask which kind of backend answers.
    sources = package_sources()
    classes = backend_classes(sources)
    assert {"LocalBackend", "ServedBackend", "VLLMBackend"} <= classes, classes
    outside = {p: t for p, t in sources.items() if "generation" not in p.parts}
    assert [q for p, t in sorted(outside.items()) for q in kind_questions(p, t, classes)] == []


def test_the_backend_kind_check_sees_names_imports_served_and_getattr() -> None:
    text = (
        "from ragbudget.generation.engines import ServedBackend\n"
        "def f(pipeline, backend):\n"
        "    if isinstance(pipeline.backend, ServedBackend) or pipeline.served:\n"
        "        return getattr(pipeline.backend, 'http', None)\n"
        "    return hasattr(backend, 'prefetch')\n"
    )
    found = kind_questions(Path("ragbudget/server/x.py"), text, {"ServedBackend"})
    assert len(found) == 5, found
    assert kind_questions(Path("ragbudget/memory/schedule.py"), "job.served += 1\n", set()) == []
