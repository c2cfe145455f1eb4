"""MkDocs hooks of the docs site (``mkdocs.yml``'s ``hooks``): the repository files the pages link to.

The pages live in ``docs/`` and are read on GitHub as they are, so they link to files beside the
folder as ``../BENCHMARKS.md`` or ``../bench/results/load.json``. MkDocs sees only ``docs/``, and
in ``--strict`` a link out of it is an error. So every repository file a page links to (and,
for a Markdown file brought in, every file it links to in turn) joins the site under ``repo/``,
and each link is rewritten to where that file now is: ``BENCHMARKS.md`` becomes a page of the
site, a JSON result a file to download. A link to a file that does not exist is left as it is,
for MkDocs to report.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

#: Where the repository's own files go in the site.
PREFIX = "repo/"
#: An inline Markdown link or image target: ``](target)`` or ``](target "title")``.
_LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)


def _repo_path(file: File) -> str:
    """The file's path in the repository: ``docs/x.md`` for a page of docs/, ``X`` for one brought in."""
    return file.src_uri[len(PREFIX) :] if file.src_uri.startswith(PREFIX) else "docs/" + file.src_uri


def _targets(text: str) -> list[str]:
    return [m.group(2) for m in _LINK.finditer(_FENCE.sub("", text))]


def _resolve(source: str, target: str) -> tuple[str, str] | None:
    """``(repository path, #anchor)`` of a relative link written in the file ``source``; None for
    an external or absolute link, or one to the page itself."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("/", "#")):
        return None
    path, hash_, anchor = target.partition("#")
    return posixpath.normpath(posixpath.join(posixpath.dirname(source), path)), hash_ + anchor


def on_files(files: Files, config: Any) -> Files:
    root = Path(config["docs_dir"]).parent
    queue = [f for f in files if f.src_uri.endswith(".md")]
    seen = {_repo_path(f) for f in files}
    while queue:
        page = queue.pop()
        for target in _targets(Path(page.abs_src_path).read_text(encoding="utf-8")):
            resolved = _resolve(_repo_path(page), target)
            if resolved is None:
                continue
            path = resolved[0]
            if path in seen or path.startswith(("docs/", "../")) or not (root / path).is_file():
                continue
            seen.add(path)
            added = File.generated(config, PREFIX + path, abs_src_path=str(root / path))
            files.append(added)
            if path.endswith(".md"):
                queue.append(added)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    here = page.file.src_uri
    source = _repo_path(page.file)

    def relink(m: re.Match[str]) -> str:
        resolved = _resolve(source, m.group(2))
        if resolved is None:
            return m.group(0)
        path, anchor = resolved
        site = path[len("docs/") :] if path.startswith("docs/") else PREFIX + path
        if files.get_file_from_path(site) is None:
            return m.group(0)  # not in the site: MkDocs reports the link as written
        new = posixpath.relpath(site, posixpath.dirname(here) or ".")
        return m.group(1) + new + anchor + m.group(3)

    # Fenced code is shown as written; only the prose between the fences is relinked.
    out, last = [], 0
    for fence in _FENCE.finditer(markdown):
        out += [_LINK.sub(relink, markdown[last : fence.start()]), fence.group(0)]
        last = fence.end()
    out.append(_LINK.sub(relink, markdown[last:]))
    return "".join(out)
