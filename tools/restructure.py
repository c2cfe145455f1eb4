#!/usr/bin/env python3
"""Issue #32's mechanical move: the flat ``ragbudget/`` package into stage sub-packages.

Run from any checkout of this repository, with the project's Python (its ruff sorts and formats
what changed)::

    .venv/bin/python tools/restructure.py            # move, rewrite, generate; prints a summary
    .venv/bin/python tools/restructure.py --dry-run  # the same summary, nothing written

What it does, in order, each step a no-op when already done (a second run has nothing to do):

1. Checks that every module and folder directly in ``ragbudget/`` has a destination in
   :data:`MAPPING`, and refuses with the list of those that have none (a module another branch
   added: one line in :data:`MAPPING` places it).
2. ``git mv`` each module, sub-package and data folder to its place; symlinks into a moved folder
   (``data/model_configs``) follow it.
3. Rewrites every reference to a moved module in ``ragbudget/``, ``tests/``, ``bench/``,
   ``examples/``, ``tools/``, the top-level and ``data/`` Markdown files and ``pyproject.toml``:
   import statements (absolute, and relative ones recomputed for the new depth, a module imported
   by ``from pkg import mod`` included), dotted ``ragbudget.x.y`` expressions, and module paths in
   strings and comments (``importlib.import_module("ragbudget.x")``, ``mock.patch`` targets,
   ``python -m ragbudget.x``, ``:mod:`` references, doctest output, ``ragbudget/x.py`` paths),
   ``ragbudget/__init__``'s ``_EXPORTS`` table, and pyproject's package list, package data, mypy
   module names and entry point. Logger names given as literals (``getLogger("ragbudget.server")``)
   are names, not paths, and stay.
4. Generates what the new layout needs: each stage package's ``__init__`` (the package's one
   line; an old module whose name is a package now keeps its names there through
   ``ragbudget._compat.moved_attribute``), ``ragbudget/_compat.py`` (the old paths, one release,
   with a DeprecationWarning) installed by ``ragbudget/__init__``, ``tests/test_compat.py``,
   ``tests/test_layout.py`` (the order of the packages, cycles inside a package) and
   CONTRIBUTING.md's layout block (the folder listing, one line a package, the descriptions carried
   over from the old block). The generated Python files come from ``tools/restructure_files/``.
5. ``ruff check --select I --fix`` and ``ruff format`` on the Python files it changed.

It reads module names and import statements, never other code, so it can run again on a newer
main after other branches merge. It exits non-zero, saying why, on anything unexpected: a module
without a destination, a destination already taken, a file it cannot parse, a git or ruff failure.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# --------------------------------------------------------------------------------------------------
# The one table. Old name (a module ``x`` for ``ragbudget/x.py``; ``x/`` a sub-package or a data
# folder) -> (layer, new name). Adding a module is one line. A layer is a key of LAYERS; a name
# ending in "/" is a folder. Order inside a layer is the order CONTRIBUTING.md lists them in.
# --------------------------------------------------------------------------------------------------
MAPPING: dict[str, tuple[str, str]] = {
    # the root's records: below everything
    "types": ("records", "types"),
    "errors": ("records", "errors"),
    "settings": ("records", "settings"),
    "tokens": ("records", "tokens"),
    "relay": ("records", "relay"),
    # gpus is the device catalogue and size parsing (no torch for a named GPU): settings checks a
    # gpu= value against it when a record is built (issue #30 section 6), so it sits beside settings
    # rather than in memory/, which would make the records import a stage.
    "gpus": ("records", "gpus"),
    "_compat": ("records", "_compat"),  # generated here
    # input/
    "loaders": ("input", "loaders"),
    "formats/": ("input", "formats/"),
    "clean": ("input", "clean"),
    "chunking": ("input", "chunking"),
    "dedup": ("input", "dedup"),
    # memory/
    "models": ("memory", "models"),
    "model_configs/": ("memory", "model_configs/"),  # models' data, beside its loader
    "weights": ("memory", "weights"),
    "kvcache": ("memory", "kvcache"),
    "budget": ("memory", "budget"),
    "admission": ("memory", "admission"),
    # prompt/
    "select": ("prompt", "select"),
    "spans": ("prompt", "spans"),
    "prompt": ("prompt", "prompt"),
    "followup": ("prompt", "followup"),
    # retrieval/
    "embed": ("retrieval", "embed"),
    "executors": ("retrieval", "executors"),
    "vectors": ("retrieval", "vectors"),
    "lexical": ("retrieval", "lexical"),
    "index": ("retrieval", "index"),
    "build": ("retrieval", "build"),
    "index_settings": ("retrieval", "index_settings"),
    "encoders": ("retrieval", "encoders"),
    "sentence_cache": ("retrieval", "sentence_cache"),
    # generation/ (allowance and pacing too: they take Capacity and RequestBudget from the Backend
    # protocol and measure with the generator, so memory/ could not hold them without importing up)
    "backend": ("generation", "backend"),
    "generate": ("generation", "generate"),
    "batching": ("generation", "batching"),
    "engines/": ("generation", "engines/"),
    "allowance": ("generation", "allowance"),
    "pacing": ("generation", "pacing"),
    # the root's orchestration: above the stages
    "pipeline": ("orchestration", "pipeline"),
    "answer": ("orchestration", "answer"),
    "chat": ("orchestration", "chat"),
    "integrations": ("orchestration", "integrations"),
    # server/
    "server": ("server", "app"),
    "endpoints": ("server", "endpoints"),
    "engine_load": ("server", "engine_load"),
    "openai_api": ("server", "openai_api"),
    "metrics": ("server", "metrics"),
    "malloc": ("server", "malloc"),
    # cli/ (commands, not main: a cli/main.py holding a function main() would make
    # `from ragbudget.cli import main` the module or the function depending on import order)
    "cli": ("cli", "commands"),
    "cli_options": ("cli", "options"),
    "display": ("cli", "display"),
    "terminal": ("cli", "terminal"),
    # the root's public surface: on top
    "__init__": ("surface", "__init__"),
    "__main__": ("surface", "__main__"),
}

#: Layers, bottom first: layer -> (folder under ragbudget/, "" for the root; the package's one
#: line, its __init__ docstring). A package imports only from the layers below it.
LAYERS: dict[str, tuple[str, str]] = {
    "records": ("", ""),
    "input": ("input", "Files in: scanning, reading and decoding, page furniture, token-bounded chunks, duplicates."),
    "memory": ("memory", "What fits: model resolution, devices, KV cache bytes, the memory plan, admission control."),
    "prompt": ("prompt", "What goes in: whole chunks or sentences that fit, the chat prompt counted, follow-ups."),
    "retrieval": ("retrieval", "Finding passages: embedders, executors, vector and lexical search, the index."),
    "generation": (
        "generation",
        "Answers out: the Backend protocol, the local generator, batching, served engines, per-request room.",
    ),
    "orchestration": ("", ""),
    "server": ("server", "The OpenAI-compatible server: the app's wiring, its routes, the wire format, metrics."),
    "cli": ("cli", "The command line: the click commands, their shared options, display, the chat loop."),
    "surface": ("", ""),
}

#: Names an old flat module keeps, without a warning, once its name is a package: the console
#: entry point ``ragbudget.cli:main`` of installs made before the move.
QUIET: dict[str, tuple[str, ...]] = {"cli": ("main",)}

#: Layout descriptions of modules the old block could not describe.
DESCRIPTIONS: dict[str, str] = {"_compat": "old module paths for one release, with a DeprecationWarning"}

# --------------------------------------------------------------------------------------------------

PKG = "ragbudget"
HERE = Path(__file__).resolve().parent
FILES = HERE / "restructure_files"
#: Rewritten: Python files under these folders, these text files (and Markdown under data/).
PY_ROOTS = ("ragbudget", "tests", "bench", "examples", "tools")
TEXT_FILES = ("README.md", "CONTRIBUTING.md", "BENCHMARKS.md", "pyproject.toml")
SKIP_PARTS = ("tests/data", "bench/results")
#: Generated each run, never rewritten (they name the old paths on purpose).
GENERATED = ("ragbudget/_compat.py", "tests/test_compat.py", "tests/test_layout.py")
SELF = ("tools/restructure.py", "tools/restructure_files/")


class Refused(Exception):
    """Something unexpected: nothing (more) is written, the script exits 1."""


@dataclass
class Plan:
    root: Path
    moves: list[tuple[Path, Path]] = field(default_factory=list)  # (old, new), relative to root
    absent: list[str] = field(default_factory=list)
    present_at_start: set[str] = field(default_factory=set)  # old dotted names whose old file existed
    logger_names: set[str] = field(default_factory=set)
    pre_modules: set[str] = field(default_factory=set)  # dotted modules before the moves

    # -- names ----------------------------------------------------------------------------------
    @staticmethod
    def old_dotted(key: str) -> str:
        return f"{PKG}.{key.rstrip('/')}" if key != "__init__" else PKG

    @staticmethod
    def new_dotted(key: str) -> str:
        layer, name = MAPPING[key]
        folder = LAYERS[layer][0]
        parts = [PKG, *([folder] if folder else []), name.rstrip("/")]
        return ".".join(p for p in parts if p != "__init__")

    def moved(self) -> dict[str, str]:
        """Old dotted -> new dotted, for the entries that change place (modules and packages)."""
        out = {}
        for key in MAPPING:
            if key in ("__init__", "__main__"):
                continue
            old, new = self.old_dotted(key), self.new_dotted(key)
            if old != new:
                out[old] = new
        return out


# -- inventory and moves ---------------------------------------------------------------------------


def git(root: Path, *args: str, check: bool = True) -> str:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise Refused(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def source_path(root: Path, key: str) -> Path:
    name = key.rstrip("/")
    return root / PKG / (name if key.endswith("/") else f"{name}.py")


def dest_path(root: Path, key: str) -> Path:
    layer, name = MAPPING[key]
    folder = LAYERS[layer][0]
    base = root / PKG / folder if folder else root / PKG
    return base / (name.rstrip("/") if name.endswith("/") else f"{name}.py")


def modules_under(root: Path) -> set[str]:
    """Every dotted module and package under ragbudget/ as the tree is now."""
    out = set()
    for p in (root / PKG).rglob("*.py"):
        if "__pycache__" in p.parts:
            continue
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.add(".".join(parts))
    return out


def inventory(root: Path) -> Plan:
    plan = Plan(root=root)
    pkg = root / PKG
    if not (pkg / "__init__.py").is_file():
        raise Refused(f"{pkg} is not the ragbudget package: run from a checkout of the repository")
    known = set(MAPPING) | {f"{f}/" for f, _ in LAYERS.values() if f}
    unknown = []
    for entry in sorted(pkg.iterdir()):
        if entry.name in ("__pycache__", "py.typed") or entry.suffix == ".pyc":
            continue
        key = entry.stem if entry.suffix == ".py" else f"{entry.name}/" if entry.is_dir() else entry.name
        if key not in known:
            unknown.append(f"ragbudget/{entry.name}")
    if unknown:
        raise Refused(
            "no destination for: "
            + ", ".join(unknown)
            + "\n  add a line for each to MAPPING at the top of tools/restructure.py (old name -> layer, new name)"
        )
    for key in MAPPING:
        src, dst = source_path(root, key), dest_path(root, key)
        if src == dst:
            if not src.exists() and key != "_compat":
                plan.absent.append(key)
            continue
        if src.exists():
            if dst.exists():
                raise Refused(f"both {src.relative_to(root)} and {dst.relative_to(root)} exist: which one is it?")
            plan.moves.append((src.relative_to(root), dst.relative_to(root)))
            plan.present_at_start.add(plan.old_dotted(key))
        elif not dst.exists():
            plan.absent.append(key)
    plan.pre_modules = modules_under(root)
    return plan


def do_moves(plan: Plan, dry: bool) -> None:
    if dry:
        return
    root = plan.root
    for src, dst in plan.moves:
        (root / dst).parent.mkdir(parents=True, exist_ok=True)
        git(root, "mv", str(src), str(dst))
    # symlinks that pointed into a moved folder follow it (data/model_configs)
    for line in git(root, "ls-files", "-s").splitlines():
        mode, _, _, path = line.split(None, 3)
        if mode != "120000":
            continue
        link = root / path
        target = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(link)))
        for src, dst in plan.moves:
            if target == str(src) or target.startswith(f"{src}/"):
                new = str(dst) + target[len(str(src)) :]
                link.unlink()
                link.symlink_to(os.path.relpath(new, os.path.dirname(path)))
                git(root, "add", path)


# -- rewriting references --------------------------------------------------------------------------

DOTTED = re.compile(r"(?<![\w./-])ragbudget((?:\.[A-Za-z_]\w*)+)")
SLASHED = re.compile(r"(?<![\w./-])ragbudget/([A-Za-z_]\w*)(\.py\b|/|\b)")


class Rewriter:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.moved = plan.moved()
        self.post_modules = modules_under(plan.root)
        self.hits = 0  # references rewritten in strings, comments and text files

    def new_path(self, dotted: str) -> str:
        """The new dotted name of an old one; anything else (new, or never moved) unchanged."""
        parts = dotted.split(".")
        for i in range(len(parts), 1, -1):
            old = ".".join(parts[:i])
            new = self.moved.get(old)
            if new is None:
                continue
            if old in self.plan.present_at_start or self._resolves_shorter(parts, i):
                return new + dotted[len(old) :]
            return dotted
        return dotted

    def _resolves_shorter(self, parts: list[str], i: int) -> bool:
        # Already moved: an old path is one that does not resolve in the new tree as deep as the
        # moved prefix (``ragbudget.index`` does not; ``ragbudget.prompt.select`` does).
        k = len(parts)
        while k > 1 and ".".join(parts[:k]) not in self.post_modules:
            k -= 1
        return k < i

    def new_slashed(self, first: str, tail: str) -> str | None:
        """``ragbudget/<first><tail>`` as a path in the new tree, or None when it stays: a module
        file (tail ``.py``) or a folder (tail ``/`` or nothing: a sub-package or a data folder)."""
        if tail == ".py":
            if first not in MAPPING:
                return None
            old = Plan.old_dotted(first)
            new = self.new_path(old)
            return new.replace(".", "/") + tail if new != old else None
        key = f"{first}/"
        if key not in MAPPING:
            return None
        old = Plan.old_dotted(key)
        if old not in self.plan.present_at_start and (self.plan.root / PKG / first).exists():
            return None  # moved in an earlier run, or never moving: the path is right
        layer, name = MAPPING[key]
        folder = LAYERS[layer][0]
        new = "/".join([PKG, *([folder] if folder else []), name.rstrip("/")])
        return new + tail if new != f"{PKG}/{first}" else None

    def text(self, s: str, *, skip_loggers: bool) -> str:
        def dotted(m: re.Match[str]) -> str:
            name = m.group(0)
            after = m.string[m.end() : m.end() + 1]
            if skip_loggers and name in self.plan.logger_names and after == ":":
                return name  # a log line ("INFO ragbudget.server: ...") shows a logger name
            new = self.new_path(name)
            self.hits += new != name
            return new

        def slashed(m: re.Match[str]) -> str:
            new = self.new_slashed(m.group(1), m.group(2))
            self.hits += new is not None
            return new if new is not None else m.group(0)

        return SLASHED.sub(slashed, DOTTED.sub(dotted, s))


@dataclass
class Counts:
    imports: int = 0
    references: int = 0
    files: set[str] = field(default_factory=set)


def _line_offsets(data: bytes) -> list[int]:
    offs, pos = [0], 0
    for line in data.splitlines(keepends=True):
        pos += len(line)
        offs.append(pos)
    return offs


def _relative(from_pkg: str, target: str) -> str:
    a, b = from_pkg.split("."), target.split(".")
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return "." * (len(a) - k + 1) + ".".join(b[k:])


def rewrite_python(path: Path, rel: str, old_module: str | None, rw: Rewriter, counts: Counts) -> str | None:
    """The file's new text, or None when nothing changes. ``old_module`` is its dotted name before
    the moves (for relative imports), None outside the package."""
    data = path.read_bytes()
    text = data.decode("utf-8")
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise Refused(f"{rel}: cannot parse ({exc})") from exc
    offs = _line_offsets(data)

    def off(line: int, col: int) -> int:  # ast columns are UTF-8 byte offsets
        return offs[line - 1] + col

    is_pkg = path.name == "__init__.py"
    new_module = None
    if old_module is not None:
        parts = list(path.relative_to(rw.plan.root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        new_module = ".".join(parts)
    old_pkg = (old_module if is_pkg else old_module.rpartition(".")[0]) if old_module else None
    new_pkg = (new_module if is_pkg else new_module.rpartition(".")[0]) if new_module else None

    edits: list[tuple[int, int, bytes, str]] = []  # (start, end, replacement, kind)
    covered: list[tuple[int, int]] = []
    skip_strings: set[tuple[int, int]] = set()

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if fname == "getLogger" and node.args and isinstance(node.args[0], ast.Constant):
                skip_strings.add((node.args[0].lineno, node.args[0].col_offset))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and rel == f"{PKG}/__init__.py":
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            exports = any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets)
            if exports and isinstance(node.value, ast.Dict):
                for v in node.value.values:
                    if isinstance(v, ast.Constant) and isinstance(v.value, str):
                        new = rw.new_path(f"{PKG}.{v.value}")[len(PKG) + 1 :]
                        skip_strings.add((v.lineno, v.col_offset))
                        if new != v.value:
                            s, e = off(v.lineno, v.col_offset), off(v.end_lineno or v.lineno, v.end_col_offset or 0)
                            edits.append((s, e, repr(new).replace("'", '"').encode(), "ref"))

    def spell(target: str, level: int) -> str:
        return _relative(new_pkg, target) if level and new_pkg else target

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                if old_pkg is None:
                    continue
                base = old_pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != PKG and not target.startswith(f"{PKG}."):
                continue
            new_target = rw.new_path(target)
            groups: dict[str, list[tuple[str, str | None]]] = {}
            changed_names = False
            for a in node.names:
                sub = f"{target}.{a.name}"
                if a.name != "*" and sub in rw.plan.pre_modules:
                    new_sub = rw.new_path(sub)
                    parent, _, leaf = new_sub.rpartition(".")
                    asname = a.asname or (a.name if leaf != a.name else None)
                    groups.setdefault(parent, []).append((leaf, asname))
                    changed_names |= (leaf, asname) != (a.name, a.asname)
                else:
                    groups.setdefault(new_target, []).append((a.name, a.asname))
            start = off(node.lineno, node.col_offset)
            end = off(node.end_lineno or node.lineno, node.end_col_offset or 0)
            stmt = data[start:end].decode("utf-8")
            if len(groups) == 1 and not changed_names:
                (mod,) = groups
                m = re.match(r"from\s+(\.*[\w.]*)\s+import\b", stmt)
                if m is None:
                    raise Refused(f"{rel}:{node.lineno}: cannot read the import statement {stmt!r}")
                want = spell(mod, node.level)
                if want != m.group(1):
                    edits.append((start + m.start(1), start + m.end(1), want.encode(), "import"))
                    covered.append((start, end))
            else:
                if "#" in stmt:
                    print(f"  note: {rel}:{node.lineno}: comments inside the import statement are dropped")
                indent = " " * node.col_offset
                lines = []
                for mod, names in groups.items():
                    listed = ", ".join(f"{n} as {a}" if a else n for n, a in names)
                    lines.append(f"from {spell(mod, node.level)} import {listed}")
                edits.append((start, end, f"\n{indent}".join(lines).encode(), "import"))
                covered.append((start, end))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == PKG or not a.name.startswith(f"{PKG}."):
                    continue
                new = rw.new_path(a.name)
                if new != a.name:
                    s = off(a.lineno, a.col_offset)
                    edits.append((s, s + len(a.name.encode()), new.encode(), "import"))
                    covered.append((s, s + len(a.name.encode())))
        elif isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if not (isinstance(cur, ast.Name) and cur.id == PKG):
                continue
            dotted = ".".join([PKG, *reversed(chain)])
            new = rw.new_path(dotted)
            if new != dotted:
                edits.append(
                    (
                        off(node.lineno, node.col_offset),
                        off(node.end_lineno or 0, node.end_col_offset or 0),
                        new.encode(),
                        "chain",
                    )
                )

    # only the outermost chain of an attribute expression counts (a.b.c, not also a.b)
    chains = sorted((e for e in edits if e[3] == "chain"), key=lambda e: (e[0], -e[1]))
    outer: list[tuple[int, int, bytes, str]] = []
    for e in chains:
        if outer and outer[-1][0] <= e[0] and e[1] <= outer[-1][1]:
            continue
        outer.append(e)
    edits = [e for e in edits if e[3] != "chain"] + outer

    # strings and comments
    readline = io.BytesIO(data).readline
    try:
        tokens = list(tokenize.tokenize(readline))
    except (tokenize.TokenError, SyntaxError) as exc:
        raise Refused(f"{rel}: cannot tokenize ({exc})") from exc
    lines = text.splitlines(keepends=True)
    texts = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for tok in tokens:
        if tok.type not in texts:
            continue
        (sl, sc), (el, ec) = tok.start, tok.end
        # tokenize columns are characters; ast and our offsets are bytes
        bsc = len(lines[sl - 1][:sc].encode())
        if (sl, bsc) in skip_strings:
            continue
        new = rw.text(tok.string, skip_loggers=False)
        if new != tok.string:
            s = offs[sl - 1] + bsc
            e = offs[el - 1] + len(lines[el - 1][:ec].encode())
            if any(a <= s < b for a, b in covered):
                continue
            edits.append((s, e, new.encode(), "ref"))

    if not edits:
        return None
    edits.sort()
    out, pos = [], 0
    for s, e, rep, kind in edits:
        if s < pos:
            raise Refused(f"{rel}: overlapping edits at byte {s}")
        out.append(data[pos:s])
        out.append(rep)
        pos = e
        if kind == "import":
            counts.imports += 1
        else:
            counts.references += 1
    out.append(data[pos:])
    return b"".join(out).decode("utf-8")


def rewrite_pyproject(text: str, rw: Rewriter) -> str:
    """Module names, the package list (-> find), package data of moved data folders."""
    text = rw.text(text, skip_loggers=False)
    m = re.search(r"^\[tool\.setuptools\]\npackages = \[[^\]\n]*\]\n", text, re.M)
    if m:
        text = (
            text[: m.start()]
            + "[tool.setuptools.packages.find]\n"
            + "# every package under ragbudget/: the stages are sub-packages (issue #32)\n"
            + 'include = ["ragbudget", "ragbudget.*"]\n'
            + text[m.end() :]
        )
    elif "[tool.setuptools.packages.find]" not in text:
        raise Refused("pyproject.toml: no '[tool.setuptools]\\npackages = [...]' line and no packages.find table")
    sec = re.search(r"^\[tool\.setuptools\.package-data\]\n((?:[^\[\n].*\n|\n)*)", text, re.M)
    if sec:
        body = sec.group(1)
        entries: dict[str, list[str]] = {}
        order: list[str] = []
        for line in body.splitlines():
            lm = re.fullmatch(r'\s*("?)([\w.]+)\1\s*=\s*\[(.*)\]\s*', line)
            if not lm:
                if line.strip() and not line.strip().startswith("#"):
                    raise Refused(f"pyproject.toml: package-data line not understood: {line!r}")
                continue
            key, pats = lm.group(2), re.findall(r'"([^"]*)"', lm.group(3))
            for p in pats:
                first = p.split("/")[0]
                where = key
                if key == PKG and f"{first}/" in MAPPING and "/" in p:
                    layer, name = MAPPING[f"{first}/"]
                    folder = LAYERS[layer][0]
                    if folder and name.rstrip("/") == first:
                        where = f"{PKG}.{folder}"
                if where not in entries:
                    entries[where] = []
                    order.append(where)
                entries[where].append(p)
        new_body = "".join(
            (k if re.fullmatch(r"\w+", k) else f'"{k}"') + " = [" + ", ".join(f'"{p}"' for p in entries[k]) + "]\n"
            for k in order
        )
        new_body += "\n" * (len(body) - len(body.rstrip("\n")) - 1)  # the blank lines after it
        text = text[: sec.start(1)] + new_body + text[sec.end(1) :]
    return text


# -- generated files -------------------------------------------------------------------------------


def parse_descriptions(block: str) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """``({old name: what}, {(folder, new name): what})`` from a layout block in either format."""
    by_old: dict[str, str] = {}
    by_new: dict[tuple[str, str], str] = {}
    for line in block.splitlines():
        line = line.strip()
        if not line:
            continue
        m_old = re.fullmatch(r"\d+ [^:]+: (.+)", line)
        m_new = re.fullmatch(r"ragbudget/((?:\w+/)*)\s+(.+)", line)
        if m_old:
            folder, items = None, m_old.group(1)
        elif m_new:
            folder, items = m_new.group(1).rstrip("/"), m_new.group(2)
        else:
            continue
        depth, cur, parts = 0, "", []
        for ch in items:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "("
            depth -= ch == ")"
            cur += ch
        parts.append(cur)
        for part in parts:
            pm = re.fullmatch(r"\s*([\w/]+)\s*(?:\((.*)\))?\s*", part, re.S)
            if not pm:
                continue
            name, what = pm.group(1), (pm.group(2) or "").strip()
            if folder is None:
                by_old[name] = what
            else:
                by_new[(folder, name)] = what
    return by_old, by_new


def layout_block(root: Path, current: str) -> str:
    by_old, by_new = parse_descriptions(current)
    rows: list[tuple[str, list[str]]] = []
    missing = []
    for layer, (folder, _) in LAYERS.items():
        items = []
        for key, (lay, name) in MAPPING.items():
            if lay != layer or key.endswith("/") and not (dest_path(root, key) / "__init__.py").is_file():
                continue  # data folders are no layout units
            if not dest_path(root, key).exists() and key != "_compat":  # _compat: written after this
                continue
            what = by_new.get((folder, name)) or by_old.get(key) or DESCRIPTIONS.get(key)
            if not what:
                missing.append(key)
                continue
            items.append(f"{name} ({what})")
        rows.append((f"ragbudget/{folder + '/' if folder else ''}", items))
    if missing:
        raise Refused(f"no description for {', '.join(missing)}: add it to DESCRIPTIONS in tools/restructure.py")
    width = max(len(f) for f, _ in rows) + 2
    return "".join(f"{f.ljust(width)}{', '.join(items)}\n" for f, items in rows)


LAYOUT_INTRO = """## Layout

One sub-package per stage, one module per concept: the block below is the folder listing, bottom
layer first, one line a package (the root package's modules sit on three lines: its records under
everything, the orchestration above the stages, the public surface on top). A module imports only
from its own line or one above it in this list (lazy imports inside functions, `TYPE_CHECKING`
imports and `importlib.import_module` names included), and the modules of one package import each
other without cycles; `tests/test_layout.py` parses every module's imports and checks this block
against the code, so a module added, removed or moved must be named here. `name/` stands for every
module of a sub-package.

"""


def contributing(text: str, root: Path) -> str:
    m = re.search(r"^## Layout\n.*?```layout\n(.*?)```\n", text, re.S | re.M)
    if not m:
        raise Refused("CONTRIBUTING.md: no '## Layout' section with a ```layout block")
    block = layout_block(root, m.group(1))
    return text[: m.start()] + LAYOUT_INTRO + "```layout\n" + block + "```\n" + text[m.end() :]


def package_init(folder: str, doc: str) -> str:
    """A stage package's __init__: its one line; for an old module that is this package's name
    now, its names through ``moved_attribute``."""
    namesake = next((k for k, (lay, _) in MAPPING.items() if k == folder and LAYERS[lay][0] == folder), None)
    if namesake is None:
        return f'"""{doc}"""\n'
    new = Plan.new_dotted(namesake)
    quiet = QUIET.get(namesake, ())
    none_for = f" (none for ``{'``, ``'.join(quiet)}``)" if quiet else ""
    return (
        f'"""{doc}\n\n'
        f"``{PKG}.{folder}`` was one module until the stages became packages (issue #32). Its names\n"
        f"live in :mod:`{new}` now, and resolve here too for one release, with a\n"
        f"DeprecationWarning{none_for}.\n"
        '"""\n\nfrom __future__ import annotations\n\nfrom typing import Any\n\n'
        "from .._compat import moved_attribute\n\n\n"
        "def __getattr__(name: str) -> Any:\n"
        f'    return moved_attribute(__name__, "{new}", name{f", quiet={quiet!r}" if quiet else ""})\n'
    )


def compat_source(plan: Plan) -> str:
    template = (FILES / "_compat.py").read_text(encoding="utf-8")
    marker = "ALIASES: dict[str, str] = {}\n"
    if marker not in template:
        raise Refused("tools/restructure_files/_compat.py has no 'ALIASES: dict[str, str] = {}' line")
    folders = {f for f, _ in LAYERS.values() if f}
    rows = []
    for key in MAPPING:
        name = key.rstrip("/")
        dst = dest_path(plan.root, key)
        if key in ("__init__", "__main__") or name.startswith("_") or name in folders:
            continue  # the surface stays; private modules get no alias; a package's namesake: its __getattr__
        if not dst.exists() or key.endswith("/") and not (dst / "__init__.py").is_file():
            continue  # not in this tree, or a data folder
        old, new = plan.old_dotted(key), plan.new_dotted(key)
        if old != new:
            rows.append(f'    "{old}": "{new}",\n')
    return template.replace(marker, "ALIASES: dict[str, str] = {\n" + "".join(rows) + "}\n")


def layout_test_source(plan: Plan) -> str:
    template = (FILES / "test_layout.py").read_text(encoding="utf-8")
    marker = "TESTED_BY: dict[str, str] = {}\n"
    if marker not in template:
        raise Refused("tools/restructure_files/test_layout.py has no 'TESTED_BY: dict[str, str] = {}' line")
    rows = []
    for key, (layer, name) in MAPPING.items():
        folder = LAYERS[layer][0]
        if key.endswith("/") or name == key or not folder:
            continue
        if (plan.root / "tests" / f"test_{key}.py").is_file() and dest_path(plan.root, key).exists():
            rows.append(f'    "{folder}/{name}": "test_{key}.py",\n')
    return template.replace(marker, "TESTED_BY: dict[str, str] = {\n" + "".join(rows) + "}\n")


def install_hook(text: str) -> str | None:
    """ragbudget/__init__ installs the alias finder (once, right after its imports)."""
    if "_compat.install()" in text:
        return None
    tree = ast.parse(text)
    last = None
    for node in tree.body:  # the first block of imports (after the docstring)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            last = node
        elif last is not None:
            break
    if last is None:
        raise Refused("ragbudget/__init__.py: no import statement to put the alias finder after")
    lines = text.splitlines(keepends=True)
    at = last.end_lineno or last.lineno
    hook = (
        "\nfrom . import _compat\n\n"
        "# The module paths from before the sub-packages still import, with a DeprecationWarning, for one release.\n"
        "_compat.install()\n"
    )
    return "".join(lines[:at]) + hook + "".join(lines[at:])


# -- the run ---------------------------------------------------------------------------------------


def files_to_rewrite(root: Path) -> tuple[list[str], list[str]]:
    tracked = git(root, "ls-files").splitlines()
    py, txt = [], []
    for rel in tracked:
        if any(rel == g for g in GENERATED) or any(rel == s or rel.startswith(s) for s in SELF):
            continue
        if any(rel.startswith(s + "/") for s in SKIP_PARTS):
            continue
        if rel.endswith(".py") and rel.split("/")[0] in PY_ROOTS:
            py.append(rel)
        elif rel in TEXT_FILES or (rel.startswith("data/") and rel.endswith(".md")):
            txt.append(rel)
    return py, txt


def ruff() -> str:
    for cand in (Path(sys.executable).parent / "ruff", shutil.which("ruff")):
        if cand and Path(cand).is_file():
            return str(cand)
    raise Refused("ruff not found next to this Python or on PATH: run the script with the project's venv Python")


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="say what would change, write nothing")
    ap.add_argument("--root", type=Path, default=HERE.parent, help="the repository (default: this script's)")
    ap.add_argument("--verbose", action="store_true", help="list every file written")
    args = ap.parse_args(list(argv) if argv is not None else None)
    root: Path = args.root.resolve()
    try:
        return run(root, dry=args.dry_run, verbose=args.verbose)
    except Refused as exc:
        print(f"restructure: refused: {exc}", file=sys.stderr)
        return 1


def run(root: Path, *, dry: bool, verbose: bool) -> int:
    plan = inventory(root)
    py, txt = files_to_rewrite(root)
    # each Python file under ragbudget/: its dotted name before the moves and its path after
    before: dict[str, str | None] = {}
    after: dict[str, str] = {}
    for rel in py:
        new_rel = rel
        for src, dst in plan.moves:
            if rel == str(src) or rel.startswith(f"{src}/"):
                new_rel = str(dst) + rel[len(str(src)) :]
        after[rel] = new_rel
        if rel.startswith(f"{PKG}/"):
            parts = list(Path(rel).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            before[rel] = ".".join(parts)
        else:
            before[rel] = None
    ruff_bin = ruff()
    do_moves(plan, dry)
    if dry:
        # rewriting needs the moved tree; a dry run reports the moves only
        print(f"restructure (dry run): would move {len(plan.moves)} modules and folders:")
        for src, dst in plan.moves:
            print(f"  {src} -> {dst}")
        return 0

    rw = Rewriter(plan)
    counts = Counts()
    written: list[str] = []
    # logger literals first, so that Markdown log lines keep their names
    for rel in py:
        if rel.startswith(f"{PKG}/"):
            for node in ast.walk(ast.parse((root / after[rel]).read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.Call)
                    and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "getLogger"
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).startswith(f"{PKG}.")
                ):
                    plan.logger_names.add(str(node.args[0].value))
    for rel in py:
        path = root / after[rel]
        new = rewrite_python(path, after[rel], before[rel], rw, counts)
        if new is not None:
            path.write_text(new, encoding="utf-8")
            written.append(after[rel])
    for rel in txt:
        path = root / rel
        old = path.read_text(encoding="utf-8")
        if rel == "pyproject.toml":
            new = rewrite_pyproject(old, rw)
        else:
            new = rw.text(old, skip_loggers=True)
        if rel == "CONTRIBUTING.md":
            new = contributing(new, root)
        if new != old:
            path.write_text(new, encoding="utf-8")
            written.append(rel)

    generated: dict[str, str] = {}
    for folder, doc in LAYERS.values():
        if folder:
            generated[f"{PKG}/{folder}/__init__.py"] = package_init(folder, doc)
    generated[f"{PKG}/_compat.py"] = compat_source(plan)
    generated["tests/test_compat.py"] = (FILES / "test_compat.py").read_text(encoding="utf-8")
    generated["tests/test_layout.py"] = layout_test_source(plan)
    init = root / PKG / "__init__.py"
    hooked = install_hook(init.read_text(encoding="utf-8"))
    if hooked is not None:
        generated[f"{PKG}/__init__.py"] = hooked
    for rel, content in generated.items():
        path = root / rel
        if path.exists() and path.read_text(encoding="utf-8") == content:
            continue
        # a generated file is compared after ruff has formatted it: format the candidate first
        formatted = _ruff_text(ruff_bin, root, rel, content)
        if path.exists() and path.read_text(encoding="utf-8") == formatted:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
        written.append(rel)

    counts.references += rw.hits
    changed_py = sorted({w for w in written if w.endswith(".py")})
    if changed_py:
        for cmd in (
            [ruff_bin, "check", "--select", "I", "--fix", "--quiet", *changed_py],
            [ruff_bin, "format", "--quiet", *changed_py],
        ):
            done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise Refused(f"{' '.join(cmd[:3])} failed:\n{done.stdout}{done.stderr}")
        wrap_long_lines(ruff_bin, root, changed_py)
    if written:
        git(root, "add", "-A", "--", *sorted(set(written)), PKG)
    counts.files = set(written)
    moved = len(plan.moves)
    if verbose:
        for w in sorted(set(written)):
            print(f"  wrote {w}")
    if plan.absent:
        print(f"restructure: not in this tree (skipped): {', '.join(sorted(plan.absent))}")
    if not moved and not written:
        print("restructure: nothing to do (the layout is in place)")
    else:
        print(
            f"restructure: moved {moved} modules and folders, rewrote {counts.imports} imports and "
            f"{counts.references} other references in {len(counts.files)} files"
        )
    return 0


def wrap_long_lines(ruff_bin: str, root: Path, files: list[str]) -> None:
    """A longer module path can push a line past ruff's limit, which ruff format does not fix in a
    string or a comment. A string literal alone on its line (a part of an implicit concatenation)
    is split in two at a space, a comment line wrapped onto the next; the file's AST must come out
    the same. Any other long line is refused with its place."""
    done = subprocess.run(
        [ruff_bin, "check", "--select", "E501", "--output-format", "json", "--quiet", *files],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    found = json.loads(done.stdout or "[]")
    by_file: dict[str, list[int]] = {}
    for f in found:
        by_file.setdefault(os.path.relpath(f["filename"], root), []).append(f["location"]["row"])
    limit = 120  # pyproject's [tool.ruff] line-length
    stuck = []
    for rel, rows in sorted(by_file.items()):
        path = root / rel
        text = path.read_text(encoding="utf-8")
        before = ast.dump(ast.parse(text))
        lines = text.splitlines(keepends=True)
        for row in sorted(rows, reverse=True):
            line = lines[row - 1].rstrip("\n")
            body = line.lstrip()
            indent = line[: len(line) - len(body)]
            s = re.fullmatch(r"([rRbBuUfF]{0,2})([\"'])((?:(?!\2).|\\\2)*)\2([,)\s]*)", body)
            c = re.fullmatch(r"#\s?(.*)", body)
            room = limit - len(indent)
            if s:
                prefix, q, content, tail = s.groups()
                cut = _cut(content, room - len(prefix) - 2, braces="f" in prefix.lower())
                new = [f"{indent}{prefix}{q}{content[:cut]}{q}\n", f"{indent}{prefix}{q}{content[cut:]}{q}{tail}\n"]
            elif c:
                cut = _cut(c.group(1), room - 2, braces=False)
                new = [f"{indent}# {c.group(1)[:cut].rstrip()}\n", f"{indent}# {c.group(1)[cut:]}\n"]
            else:
                cut, new = 0, []
            if not cut:
                stuck.append(f"{rel}:{row}")
                continue
            lines[row - 1 : row] = new
        text = "".join(lines)
        if ast.dump(ast.parse(text)) != before:
            raise Refused(f"{rel}: wrapping its long lines would change the code; shorten them by hand")
        path.write_text(text, encoding="utf-8")
    if stuck:
        raise Refused(
            "lines over the limit after the rewrite, not a string or a comment line: "
            + ", ".join(stuck)
            + "\n  shorten them on the old layout (a commit before the move) and run again"
        )


def _cut(text: str, room: int, *, braces: bool) -> int:
    """Where to split ``text`` so that its first part (ending in a space) fits ``room``: 0 if
    nowhere (outside an f-string's ``{...}`` when ``braces``)."""
    depth = 0
    best = 0
    for i, ch in enumerate(text):
        if braces:
            depth += (ch == "{") - (ch == "}")
        if i + 1 > room:
            break
        if ch == " " and depth == 0 and i + 1 < len(text):
            best = i + 1
    return best


def _ruff_text(ruff_bin: str, root: Path, rel: str, content: str) -> str:
    if not rel.endswith(".py"):
        return content
    for cmd in ([ruff_bin, "check", "--select", "I", "--fix", "--quiet"], [ruff_bin, "format", "--quiet"]):
        done = subprocess.run(
            [*cmd, "--stdin-filename", rel, "-"], cwd=root, input=content, capture_output=True, text=True, check=False
        )
        if done.returncode == 0 and done.stdout:
            content = done.stdout
    return content


if __name__ == "__main__":
    sys.exit(main())
