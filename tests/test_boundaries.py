"""Where a text may be cut: headings (and what is never one), cut points and their levels.

The chunker's choice among them (headings first, then the best level, exact counts) is tested in
tests/test_chunking.py.
"""

from __future__ import annotations

from ragbudget.input.boundaries import LEVELS, Heading, find_boundaries, heading_paths
from ragbudget.input.chunking import chunk_text


def _cuts(text: str) -> list[tuple[str, str, str]]:
    """``(what ends there, what starts next, level)`` for each cut point of ``text``."""
    b = find_boundaries(text)
    return [
        (text[: int(e)][-8:], text[int(n) : int(n) + 4], LEVELS[int(lv)])
        for e, n, lv in zip(b.ends, b.nexts, b.levels, strict=True)
    ]


def test_cut_points_and_their_levels() -> None:
    text = (
        "Mr. Smith met J. K. Rowling. She left (as planned). Then:\n1. mix\n  - bake\n"
        "it ends e.g. here. And here.\n\n\n   Next para."
    )
    # Not cut: after "Mr.", the initials "J." "K.", nor "e.g." before a lower-case word. A line
    # break after a sentence or before a list item beats a plain one; a blank-line run is one
    # paragraph break, the next chunk starting at the text after it.
    assert _cuts(text) == [
        ("Rowling.", "She ", "sentence"),
        ("lanned).", "Then", "sentence"),
        ("). Then:", "1. m", "line_sentence"),
        (":\n1. mix", "- ba", "line_sentence"),
        ("  - bake", "it e", "line"),
        ("g. here.", "And ", "sentence"),
        ("nd here.", "Next", "paragraph"),
        (" here.\n\n", "Next", "line"),
    ]
    assert len(find_boundaries("").ends) == len(find_boundaries("one line.").ends) == 0


def test_headings_are_cut_points_with_their_depth() -> None:
    text = "Intro. Read on.\n\n## Usage\nCall it.\n\nCHAPTER 2 The end\nFin."
    b = find_boundaries(text)
    assert [(text[h.start : h.start + 9], h.depth, h.title) for h in b.headings] == [
        ("## Usage\n", 2, "Usage"),
        ("CHAPTER 2", 1, "CHAPTER 2 The end"),
    ]
    assert [c for c in _cuts(text) if c[2] == "heading"] == [
        ("Read on.", "## U", "heading"),
        ("Call it.", "CHAP", "heading"),
    ]


def test_heading_paths_follow_depth() -> None:
    heads = [Heading(0, 1, "A"), Heading(5, 2, "B"), Heading(9, 3, "C"), Heading(12, 2, "D"), Heading(20, 1, "E")]
    assert heading_paths(heads) == [("A",), ("A", "B"), ("A", "B", "C"), ("A", "D"), ("E",)]


def test_rst_and_numbered_headings() -> None:
    text = (
        "1. About this manual\n********************\n\n"
        + "Intro text that goes on. " * 30
        + "\n\n\n1.1. Scope\n==========\n\n"
        + "Scope text that goes on. " * 30
        + "\n\n2. Decision-making bodies\n\n   Each decision is made by one of these:\n"
        "    1. The Developers, by way of General Resolution;\n    2. The Project Leader.\n"
    )
    chunks = chunk_text(text, min_tokens=20, max_tokens=200)
    heads = {c.headings for c in chunks}
    assert ("1. About this manual", "1.1. Scope") in heads
    assert ("2. Decision-making bodies",) in heads


def test_table_of_contents_lines_are_never_headings() -> None:
    # A texinfo-style contents page (dot leaders, page numbers), then the body: the last entry
    # must not become the heading of every chunk that follows it.
    toc = "\n".join(
        [
            "Table of Contents",
            "",
            "Preface . . . . . . . . . . . . . . . . . . . . . . . . . . 1",
            "1 Introduction and preliminaries . . . . . . . . . . . . . 2",
            "",
            "1.1 The R environment. . . . . . . . . . . . . . . . . . . . 2",
            "",
            "Appendix A GNU Free Documentation License . . 76",
            "Appendix B Concept index..........................  80",
            "Index \u2026\u2026\u2026 ix",
            "",
        ]
    )
    body = "The environment evaluates each expression as it is typed. " * 20
    # A cross reference wrapped to the start of a line reads like a chapter heading too.
    xref = body + "See\nChapter 7 [Reading data from files], page 33.\n\n"
    text = toc + "\n" + "\n\n".join([body, xref, "Chapter 2 Simple manipulations", body, body])
    chunks = chunk_text(text, min_tokens=40, max_tokens=150)
    heads = {h for c in chunks for h in c.headings}
    assert "Chapter 2 Simple manipulations" in heads  # a real chapter heading still counts
    assert not [h for h in heads if "." * 2 in h.replace(" ", "") or "\u2026" in h or "Appendix" in h], heads
    assert all(c.headings == () for c in chunks if c.start < text.index("Chapter 2"))


def test_comments_and_directives_in_code_are_not_markdown_headings() -> None:
    # A PDF's text layer (and a plain-text export) drops a listing's fence and indentation: a C
    # "# include", an R, shell or Make "# comment" reaches the margin among the code it annotates.
    # Taken for headings they used to name every chunk after them, for dozens of pages.
    listing = "\n".join(
        [
            "Memory is allocated on the stack with alloca.",
            "# include <alloca.h>",
            "# include <fcntl.h>",
            "static void f(int n)",
            "{",
            "    char *buf = alloca(n);",
            "}",
            "A package can use rgl when it is installed:",
            "if (require(rgl)) {",
            "    plot3d(x)",
            "} else {",
            "    # do something else not involving rgl.",
            "    plot(x)",
            "}",
            "> hist(eruptions)",
            "## make the bins smaller, make a plot of density",
            "> hist(eruptions, seq(1.6, 5.2, 0.2), prob=TRUE)",
            "for i in /usr/bin/foo /usr/sbin/bar; do",
            "# only do something when no setting exists",
            "if ! dpkg-statoverride --list $i >/dev/null 2>&1; then",
            "Here are its contents:",
            "# watch control file for uscan",
            "version=3",
            "#!/bin/sh",
            "# (C) 2011 Foo Bar, GPL2+",
            'echo "Hello!"',
        ]
    )
    markdown = "\n".join(
        [
            "# Guide",
            "Read this first.",
            "",
            "## Install",
            "",
            "```bash",
            "# Create a virtual env (you can use yours as well)",
            "python -m venv .env",
            "```",
            "",
            "## Why a budget?",
            "Because a prompt has a size.",
        ]
    )
    assert [h.title for h in find_boundaries(listing).headings] == []
    assert [h.title for h in find_boundaries(markdown).headings] == ["Guide", "Install", "Why a budget?"]
    prose = "The package compiles native code and registers its routines. " * 30
    chunks = chunk_text("\n".join([prose, listing, prose, prose]), min_tokens=40, max_tokens=120)
    assert {h for c in chunks for h in c.headings} == set()


def test_numbered_titles_of_a_pdf_text_layer_are_headings() -> None:
    # pypdfium2 gives a typeset manual's section titles with no blank line around them, so the
    # blank-line rule for "1.2 Title" finds none; their numbering, one continuing the last, does.
    prose = "The environment evaluates each expression as it is typed and prints its value. " * 8
    text = "\n".join(
        [
            "1 Introduction and preliminaries",
            "1.1 The R environment",
            prose,
            "1.2 Related software and documentation",
            prose,
            "It has three steps:",
            "1. Mix the flour",
            "2. Add the water",
            "3. Bake it",
            "2 Simple manipulations; numbers and vectors",
            "2.1 Vectors and assignment",
            prose,
            "12 Ordinary files are reset when the package is reinstalled",  # a footnote
            "2.2 Vector arithmetic",
            prose,
            "1 Source: gentoo",  # a listing with line numbers
            "2 Section: unknown",
            "3 Priority: optional",
            "2.3 Generating regular sequences",
            prose,
        ]
    )
    b = find_boundaries(text)
    assert [(h.depth, h.title) for h in b.headings] == [
        (1, "1 Introduction and preliminaries"),
        (2, "1.1 The R environment"),
        (2, "1.2 Related software and documentation"),
        (1, "2 Simple manipulations; numbers and vectors"),
        (2, "2.1 Vectors and assignment"),
        (2, "2.2 Vector arithmetic"),
        (2, "2.3 Generating regular sequences"),
    ]
    chunks = chunk_text(text, min_tokens=40, max_tokens=150)
    last = chunks[-1]
    assert last.headings == ("2 Simple manipulations; numbers and vectors", "2.3 Generating regular sequences")
    # Lines that only look numbered, with nothing continuing them, stay body text.
    assert find_boundaries("\n".join(["3 Apples were sold", prose, "7 Pears", prose])).headings == ()


def test_a_chapter_without_numbered_sections_does_not_break_the_numbering() -> None:
    # policy.pdf: chapters 18 and 19 have no numbered section, so "20.1" follows "17.2" (the
    # chapter titles themselves are spelled out, "CHAPTER / TWENTY"); the sections after them
    # are headings still. Anything but a chapter's first section skips one number at most.
    prose = "A maintainer script must not fail when it runs twice in a row on one system. " * 8
    titles = ["17.1 Automatic handling", "17.2 Fully-featured handling", "20.1 Introduction", "20.2 Change Goals"]
    text = "\n".join(line for t in titles for line in (t, prose))
    assert [h.title for h in find_boundaries(text).headings] == titles
    stray = "\n".join(["1.1 Scope", prose, "1.2 Terms", prose, "1.3 Authors", prose, "1.7 Translations", prose])
    assert [h.title for h in find_boundaries(stray).headings] == ["1.1 Scope", "1.2 Terms", "1.3 Authors"]


def test_appendix_sections_make_a_chain_of_their_own() -> None:
    # R-intro.pdf's appendices: "Appendix B Invoking R" (a chapter heading), then "B.1 ...".
    prose = "The command line takes options that set the size of the workspace and the memory. " * 8
    titles = ["14.4 Compression and Archives", "B.1 Invoking R from the command line", "B.2 Invoking R under Windows"]
    titles += ["C.1 Preliminaries", "C.2 Editing actions"]
    text = "\n".join(["14.2 Filepaths", prose, "14.3 System commands", prose])
    text += "\n" + "\n".join(line for t in titles for line in (t, prose))
    heads = find_boundaries(text).headings
    assert [(h.depth, h.title) for h in heads] == [
        (2, "14.2 Filepaths"),
        (2, "14.3 System commands"),
        *((2, t) for t in titles),
    ]
