"""Old import paths, for one release: the stages moved into sub-packages (issue #32), so
``ragbudget.index`` is ``ragbudget.retrieval.index`` now. ``import ragbudget.index`` (and
``from ragbudget.index import Index``) still works and gives the very same module, with a
``DeprecationWarning`` naming the new path.

One meta-path finder over one table (:data:`ALIASES`: the moves of issue #32, made by a script
kept in the history, commit cf2a56c),
installed by ``ragbudget/__init__``: it costs a string test per import of a module and imports
nothing ahead of need. Private modules get no alias: ``import ragbudget.engines._base`` is a
``ModuleNotFoundError`` that names the new path. An old module whose name is a package now
(``ragbudget.prompt``, ``ragbudget.server``, ``ragbudget.cli``) keeps its names through that
package's ``__getattr__`` (:func:`moved_attribute`).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from types import FrameType, ModuleType
from typing import Any

__all__ = ["ALIASES", "install", "moved_attribute"]

#: Old module -> new module, for every public module that moved (the sub-modules of a moved
#: package follow it: ``ragbudget.formats.office`` -> ``ragbudget.input.formats.office``).
ALIASES: dict[str, str] = {
    "ragbudget.loaders": "ragbudget.input.loaders",
    "ragbudget.formats": "ragbudget.input.formats",
    "ragbudget.clean": "ragbudget.input.clean",
    "ragbudget.chunking": "ragbudget.input.chunking",
    "ragbudget.dedup": "ragbudget.input.dedup",
    "ragbudget.models": "ragbudget.memory.models",
    "ragbudget.weights": "ragbudget.memory.weights",
    "ragbudget.kvcache": "ragbudget.memory.kvcache",
    "ragbudget.budget": "ragbudget.memory.budget",
    "ragbudget.admission": "ragbudget.memory.admission",
    "ragbudget.select": "ragbudget.packing.select",
    "ragbudget.spans": "ragbudget.packing.spans",
    "ragbudget.followup": "ragbudget.prompt.followup",
    # Packing left the prompt package (issue #44: the prompt renders and counts, never selects).
    "ragbudget.prompt.select": "ragbudget.packing.select",
    "ragbudget.prompt.sentences": "ragbudget.packing.sentences",
    "ragbudget.prompt.pieces": "ragbudget.packing.pieces",
    "ragbudget.prompt.spans": "ragbudget.packing.spans",
    "ragbudget.embed": "ragbudget.retrieval.embed",
    "ragbudget.executors": "ragbudget.retrieval.executors",
    "ragbudget.vectors": "ragbudget.retrieval.vectors",
    "ragbudget.lexical": "ragbudget.retrieval.lexical",
    "ragbudget.index": "ragbudget.retrieval.index",
    "ragbudget.build": "ragbudget.retrieval.build",
    "ragbudget.index_settings": "ragbudget.retrieval.index_settings",
    "ragbudget.encoders": "ragbudget.retrieval.encoders",
    "ragbudget.sentence_cache": "ragbudget.retrieval.sentence_cache",
    "ragbudget.backend": "ragbudget.generation.backend",
    "ragbudget.generate": "ragbudget.generation.generate",
    "ragbudget.batching": "ragbudget.generation.batching",
    "ragbudget.engines": "ragbudget.generation.engines",
    "ragbudget.allowance": "ragbudget.generation.allowance",
    "ragbudget.pacing": "ragbudget.generation.pacing",
    "ragbudget.endpoints": "ragbudget.server.endpoints",
    "ragbudget.engine_load": "ragbudget.server.engine_load",
    "ragbudget.openai_api": "ragbudget.server.openai_api",
    "ragbudget.metrics": "ragbudget.server.metrics",
    "ragbudget.malloc": "ragbudget.server.malloc",
    "ragbudget.cli_options": "ragbudget.cli.options",
    "ragbudget.display": "ragbudget.cli.display",
    "ragbudget.terminal": "ragbudget.cli.terminal",
}

_PREFIX = __name__.rpartition(".")[0] + "."  # "ragbudget."


def _new_name(fullname: str) -> str | None:
    """The new path of an old one (longest moved prefix wins), else ``None``."""
    if not fullname.startswith(_PREFIX):
        return None
    old = fullname
    while old:
        new = ALIASES.get(old)
        if new is not None:
            return new + fullname[len(old) :]
        old = old.rpartition(".")[0]
    return None


def _stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the caller's import statement or attribute
    access, past the frames of the import machinery, of this module and of a package's
    ``__getattr__`` (3.12's ``skip_file_prefixes`` is not there on 3.10). ``warnings`` itself
    skips the ``importlib._bootstrap`` frames without counting them, so they are not counted."""

    def skipped_by_warnings(f: FrameType) -> bool:
        return "importlib" in f.f_code.co_filename and "_bootstrap" in f.f_code.co_filename

    def ours(f: FrameType) -> bool:
        name = f.f_globals.get("__name__", "")
        return f.f_code.co_name == "__getattr__" or name == __name__ or name.startswith("importlib")

    frame: FrameType | None = sys._getframe(1)  # the function that calls warnings.warn
    level = 1
    while frame is not None and ours(frame):
        frame = frame.f_back
        while frame is not None and skipped_by_warnings(frame):
            frame = frame.f_back
        level += 1
    return level


class _AliasLoader:
    """Loads an old path as the module that lives at the new one (one object under two names)."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: Any = None

    def create_module(self, spec: Any) -> ModuleType:
        warnings.warn(
            f"{spec.name} is {self.new} now; the old path works until the next release",
            DeprecationWarning,
            stacklevel=_stacklevel(),
        )
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system has just set the alias spec on the shared module object; give it its
        # own back, so that reload(), pickling and tools see the real module.
        module.__spec__ = self.spec


class _AliasFinder:
    """First on ``sys.meta_path``: claims the old paths only, every other name falls through."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = _new_name(fullname)
        if new is None:
            return None
        if any(part.startswith("_") for part in fullname.split(".")[1:]):
            raise ModuleNotFoundError(f"{fullname} is private and moved to {new}; import it from there", name=fullname)
        from importlib.machinery import ModuleSpec  # already loaded by the import system: free

        # typed Any: importlib.abc.Loader, its nominal type, would cost `import ragbudget` ~10 ms
        loader: Any = _AliasLoader(new)
        return ModuleSpec(fullname, loader)


_FINDER = _AliasFinder()


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once, however often ``ragbudget`` is imported)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)


def moved_attribute(package: str, module: str, name: str, quiet: tuple[str, ...] = ()) -> Any:
    """For a package's (or a module's) ``__getattr__``: ``package.name`` where ``name`` is one
    that the flat module ``package`` used to define and ``module`` defines now, with a
    ``DeprecationWarning`` (none for the names in ``quiet``, which stay). Sub-modules, private and dunder names are an
    ``AttributeError`` as usual, so imports and tools that probe a module behave."""
    missing = AttributeError(f"module {package!r} has no attribute {name!r}")
    if name.startswith("_"):
        raise missing
    parent = sys.modules[package]
    here = getattr(parent, "__path__", ())  # a module (no sub-modules) keeps moved names too
    if any(os.path.exists(os.path.join(p, f"{name}.py")) or os.path.isdir(os.path.join(p, name)) for p in here):
        raise missing  # a sub-module not imported yet: the import system loads it
    try:
        value = getattr(importlib.import_module(module), name)
    except AttributeError:
        raise missing from None
    if name not in quiet:
        warnings.warn(
            f"{package}.{name} is {module}.{name} now; the old path works until the next release",
            DeprecationWarning,
            stacklevel=_stacklevel(),
        )
    setattr(parent, name, value)  # once: the next access (IMPORT_FROM after the import probe) is plain
    return value
