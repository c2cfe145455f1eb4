"""A griffe extension for the API reference: the package's docstrings are written for ``help()``
and Sphinx-style readers (``:class:`~ragbudget.errors.ConfigError```, ``>>>`` examples), and
mkdocstrings renders Markdown. Each docstring is rewritten once, where griffe loads it:

* a cross-reference role becomes a link to that object when the site documents it, and plain
  code otherwise (an autorefs reference marked ``optional``: no warning for an internal name);
* a run of ``>>>`` lines (with their ``...`` continuations and expected output) becomes a fenced
  ``pycon`` block, instead of Markdown's nested block quotes.

``mkdocs.yml`` names it in mkdocstrings' ``extensions``.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")


def _role(scope: str, m: re.Match[str]) -> str:
    """The autorefs reference of one role: the name as written, or (for a short name such as
    ``:meth:`ask```) first as a member of ``scope``, the object's class or module."""
    short, target = m.group(1), m.group(2)
    title = target.rsplit(".", 1)[-1] if short else target
    first, second = (target, "") if target.startswith("ragbudget.") else (f"{scope}.{target}", target)
    slug = f' slug="{html.escape(second)}"' if second else ""
    return f'<autoref identifier="{html.escape(first)}"{slug} optional><code>{html.escape(title)}</code></autoref>'


def _doctests(text: str) -> str:
    """Fence each run of ``>>>`` lines, with the lines that follow it up to a blank line."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            block = []
            while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
                block.append(lines[i][len(indent) :])
                i += 1
            if out and out[-1].strip():
                out.append("")  # a fence needs a blank line before it when it follows a paragraph
            out += [f"{indent}```pycon", *(indent + b for b in block), f"{indent}```"]
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def rewrite(text: str, scope: str = "") -> str:
    """A docstring's reST roles and doctest blocks as Markdown (fenced code kept as it is);
    ``scope`` is where a short name is looked up first."""
    parts = re.split(r"(^\s*```.*?^\s*```[ \t]*$)", text, flags=re.M | re.S)
    return "".join(
        p if p.lstrip().startswith("```") else _ROLE.sub(lambda m: _role(scope, m), _doctests(p)) for p in parts
    )


class RstToMarkdown(griffe.Extension):
    """Rewrite every docstring griffe loads (:func:`rewrite`)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            scope = obj if obj.is_class or obj.is_module or obj.parent is None else obj.parent
            obj.docstring.value = rewrite(obj.docstring.value, scope.path)
