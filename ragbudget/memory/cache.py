"""ragbudget's own cache folder: converted and assembled models, calibration, the prefill speed.

One definition, below both the model resolver (:mod:`ragbudget.memory.models`, which re-exports
it) and the packaged models it resolves (:mod:`ragbudget.memory.packaged`).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """ragbudget's own cache (converted GGUF models, assembled packaged models, calibration):
    ``$RAGBUDGET_CACHE``, else ``ragbudget`` in ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    root = os.environ.get("RAGBUDGET_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ragbudget"
    )
    return Path(root)
