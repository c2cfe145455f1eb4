"""Loading a script of bench/ as a module for a test (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_bench(script: str, name: str) -> ModuleType:
    """``bench/<script>`` as the module ``name``, registered in ``sys.modules`` (dataclasses look
    their module up while a class is built)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
