"""The command line: the click commands, their shared options, display, the chat loop.

``ragbudget.cli`` was one module until the stages became packages (issue #32). Its names
live in :mod:`ragbudget.cli.commands` now, and resolve here too for one release, with a
DeprecationWarning (none for ``main``).
"""

from __future__ import annotations

from typing import Any

from .._compat import moved_attribute


def __getattr__(name: str) -> Any:
    return moved_attribute(__name__, "ragbudget.cli.commands", name, quiet=("main",))
