"""Loading a script of bench/ as a module for a test (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_bench(script: str, name: str, *, shadowed: Sequence[str] = ()) -> ModuleType:
    """``bench/<script>`` as the module ``name``, registered in ``sys.modules`` (dataclasses look
    their module up while a class is built).

    ``shadowed``: modules a bench script imports by a name the tests use too (bench/ puts itself
    on ``sys.path`` and has a ``_llama`` of its own, as tests/ does). While the script loads they
    are taken out of ``sys.modules``; afterwards ``sys.path`` and those names are put back as they
    were, and the script keeps its own references."""
    path = list(sys.path)
    kept = {m: sys.modules.pop(m) for m in shadowed if m in sys.modules}
    try:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        if shadowed:
            sys.path[:] = path
            for m in shadowed:
                sys.modules.pop(m, None)
            sys.modules.update(kept)
