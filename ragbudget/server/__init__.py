"""The OpenAI-compatible server: the app's wiring, its routes, the wire format, metrics.

``ragbudget.server`` was one module until the stages became packages (issue #32). Its names
live in :mod:`ragbudget.server.app` now, and resolve here too for one release, with a
DeprecationWarning.
"""

from __future__ import annotations

from typing import Any

from .._compat import moved_attribute


def __getattr__(name: str) -> Any:
    return moved_attribute(__name__, "ragbudget.server.app", name)
