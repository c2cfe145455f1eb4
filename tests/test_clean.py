"""Header/footer stripping: exact cases, invariants (hypothesis), and measured quality on real
documents (the shared PDFs and man pages)."""

from __future__ import annotations

import gzip
import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from _furniture_truth import classify, score
from hypothesis import given, settings
from hypothesis import strategies as st

from ragbudget.clean import (
    StripReport,
    find_furniture,
    find_known,
    fold_line,
    mask_line,
    strip_headers_footers,
)

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "pe", "du"]


def _word(k: int) -> str:
    # a distinct digit-free word per k, so masked body lines never repeat across pages
    out = ""
    while True:
        out += _SYLLABLES[k % 10]
        k //= 10
        if not k:
            return out


def _body(i: int, n: int = 6) -> str:
    return "\n".join(f"The {_word(i * 100 + j)} line of body text, unique to its page." for j in range(n))


# --------------------------------------------------------------------------------------------------
# exact cases


def test_mask_line_folds_numbers_whitespace_and_case():
    assert mask_line("Page 3 of 40") == mask_line("page  4 of 40") == "page # of #"
    assert mask_line("52   Chapter 6. Package") == mask_line("53 Chapter 6. Package")
    assert mask_line("Guide iv") == mask_line("Guide 12") == "guide #"
    assert mask_line("Linux man-pages 6.03   2023-02-05   2") == "linux man-pages #.# #-#-# #"


def test_page_x_of_y_header_and_footer_removed():
    pages = [f"ACME Corp - Annual Report\n{_body(i)}\nPage {i + 1} of 5" for i in range(5)]
    out, rep = strip_headers_footers(pages, report=True)
    assert out == [_body(i) for i in range(5)]
    assert rep.removed == 10
    assert rep.per_page == (2,) * 5
    assert set(rep.patterns) == {"acme corp - annual report", "page # of #"}


def test_recto_verso_footers_alternate():
    # verso: "N  Chapter 2. Title"; recto: "2.3. Section title  N"; chapter openings: bare "N".
    pages = []
    for i in range(12):
        n = i + 1
        foot = f"{n}   Chapter 2. Archive" if n % 2 == 0 else f"2.3. Copyright considerations   {n}"
        pages.append(f"{_body(i)}\n{foot}")
    out, rep = strip_headers_footers(pages, report=True)
    assert out == [_body(i) for i in range(12)]


def test_running_heads_change_per_chapter():
    heads = ["Chapter 4: Factors"] * 4 + ["Chapter 5: Arrays and matrices"] * 5 + ["Chapter 6: Lists"] * 4
    pages = [f"{h}   {n + 20}\n{_body(n)}" for n, h in enumerate(heads)]
    assert strip_headers_footers(pages) == [_body(n) for n in range(len(heads))]


def test_running_heads_without_numbers_in_runs():
    heads = ["Part One: Getting Started"] * 4 + ["Part Two: Going Further"] * 4
    pages = [f"{h}\n{_body(n)}" for n, h in enumerate(heads)]
    assert strip_headers_footers(pages) == [_body(n) for n in range(8)]


def test_bare_page_numbers_and_roman_front_matter():
    front = [f"{_body(i)}\n{r}" for i, r in enumerate(["i", "ii", "iii", "iv"])]
    main = [f"{_body(10 + i)}\n{i + 1}" for i in range(8)]
    assert strip_headers_footers(front + main) == [_body(i) for i in range(4)] + [_body(10 + i) for i in range(8)]


def test_one_and_two_page_documents_untouched_without_corpus_patterns():
    one = ["Company Confidential\nhello\nPage 1 of 1"]
    two = ["Company Confidential\nhello\nPage 1 of 2", "Company Confidential\nworld\nPage 2 of 2"]
    assert strip_headers_footers(one) == one
    assert strip_headers_footers(two) == two
    # A corpus-wide pattern (masked key) is honoured even on one page.
    assert strip_headers_footers(one, known={"company confidential"}) == ["hello\nPage 1 of 1"]


def test_middle_page_of_three_page_document_survives():
    # Haystack's DocumentCleaner ignores first and last page, so on 3 pages the "longest common
    # n-gram" is the whole middle page, which it then deletes everywhere.
    pages = ["Intro text about apples.\nMore apples.", "Middle text about pears.\nMore pears.", "End text."]
    assert strip_headers_footers(pages) == pages


def test_repeated_line_between_body_lines_is_kept():
    pages = [f"Header X\nfirst {_word(i)}\nNote: see appendix\n{_body(i)}" for i in range(6)]
    out = strip_headers_footers(pages)
    # Header goes; the repeated note sits below a body line, so the peel stops before it.
    assert all(p.startswith(f"first {_word(i)}\nNote: see appendix") for i, p in enumerate(out))


def test_punctuation_only_lines_are_not_furniture():
    pages = [f"Manual\n{_body(i)}\n}}" for i in range(6)]
    out = strip_headers_footers(pages)
    assert all(p.endswith("}") for p in out)
    assert not any(p.startswith("Manual") for p in out)


def test_brake_when_stripping_would_empty_most_pages():
    pages = ["Form A\nsigned", "Form A\nsigned", "Form A\nsigned", "Form A\nsigned"]
    assert strip_headers_footers(pages) == pages


def test_numbers_inside_a_line_are_not_page_numbers():
    # Table rows whose middle number happens to match the page index are not page numbers, even
    # when page numbers are trusted (only the first/last word, or N in "N / M", counts).
    pages = [f"{_body(i)}\nKERN_LEVEL {i + 1} conditions {_word(i)}" for i in range(6)]
    assert strip_headers_footers(pages, trust_page_numbers=True) == pages


def test_trust_page_numbers_takes_unique_section_footers():
    pages = [f"Manual, Release 4\n{_body(i)}\n{i + 1}.1. Section {_word(i)} title {i + 1}" for i in range(6)]
    strict = strip_headers_footers(pages)
    assert all(re.search(r"title \d+$", p) for p in strict)  # unique masked forms are kept
    trusted = strip_headers_footers(pages, trust_page_numbers=True)
    assert trusted == [_body(i) for i in range(6)]


def test_one_page_number_line_per_page():
    # "Chapter 1" under "Guide 1 / 5" carries the same number; only the outermost line goes.
    pages = [f"Guide {i + 1} / 5\n" + ("Chapter 1\n" if i == 0 else "") + _body(i) for i in range(5)]
    out = strip_headers_footers(pages, trust_page_numbers=True)
    assert out[0].startswith("Chapter 1\n")


def test_report_lines_point_at_removed_lines():
    pages = [f"Head\n\n{_body(i)}\n\nfoot {i + 1}" for i in range(4)]
    rep = find_furniture(pages)
    assert isinstance(rep, StripReport)
    for p, i in rep.lines:
        assert pages[p].split("\n")[i] in ("Head", f"foot {p + 1}")


def test_find_known_uses_exact_folded_lines():
    pages = ["Home | Blog\n# Post\ntext", "Home|Blog\ntext"]
    rep = find_known(pages, {fold_line("Home  | Blog")})
    assert rep.lines == ((0, 0),)


# --------------------------------------------------------------------------------------------------
# invariants

_LINES = st.sampled_from(
    ["Manual v2", "Page 1 of 9", "Page 7 of 9", "12", "iv", "}", "", "   ", "Chapter 3: Intro  14",
     "alpha beta", "gamma", "delta epsilon 3", "Copyright 2024 ACME"]
) | st.text(alphabet="abcxyz019 .-", max_size=20)
_PAGES = st.lists(st.lists(_LINES, max_size=8).map("\n".join), max_size=9)


@settings(max_examples=150, deadline=None)
@given(_PAGES)
def test_strip_is_deterministic_and_never_grows(pages):
    a, rep = strip_headers_footers(pages, report=True)
    b = strip_headers_footers(list(pages))
    assert a == b
    assert len(a) == len(pages)
    for before, after in zip(pages, a):
        assert len(after) <= len(before)
        # lines only deleted: the output lines are a subsequence of the input lines
        it = iter(before.split("\n"))
        assert all(any(x == y for y in it) for x in after.split("\n")) or after == ""
    assert rep.removed == sum(rep.per_page) == len(rep.lines)


@settings(max_examples=150, deadline=None)
@given(_PAGES)
def test_never_removes_a_line_whose_masked_form_is_on_one_page(pages):
    rep = find_furniture(pages)
    on_pages: dict[str, set[int]] = defaultdict(set)
    for p, page in enumerate(pages):
        for line in page.split("\n"):
            on_pages[mask_line(line)].add(p)
    for p, i in rep.lines:
        assert len(on_pages[mask_line(pages[p].split("\n")[i])]) >= 2
    if len(pages) <= 2:
        assert rep.removed == 0


# --------------------------------------------------------------------------------------------------
# measured on the shared real documents, graded by the hand-written truth (tests/_furniture_truth.py)

_PDFS = ("policy.pdf", "maint-guide.en.pdf", "R-intro.pdf")
_LAYOUT = Path(__file__).parent / "data" / "pdftotext"
# Floors under the measured figures (bench/results/clean.json), per extractor.
FURNITURE_MIN = {"pypdfium2": 0.91, "pdftotext": 0.89, "groff": 0.91}
PAGENO_MIN = {"pypdfium2": 0.88, "pdftotext": 0.85, "groff": 0.84}
TRUSTED_MIN = {"pypdfium2": 0.99, "pdftotext": 0.92, "groff": 1.0}


@pytest.fixture(scope="session")
def real_pages(shared_data) -> dict[tuple[str, str], tuple[list[str], Path]]:
    """Uncleaned pages per (extractor, document), with the file the loader reads.

    ``pypdfium2``: ragbudget's loader; ``pdftotext``: ``pdftotext -layout`` output (poppler-utils
    22.12.0, committed in tests/data/pdftotext), raw ``\\f`` pages; ``groff``: the man pages.
    """
    from ragbudget.loaders import load_document

    out = {}
    for name in _PDFS:
        out[("pypdfium2", name)] = (load_document(shared_data / "pdf" / name, clean=False).pages,
                                    shared_data / "pdf" / name)
        gz = _LAYOUT / (name[:-4] + ".layout.txt.gz")
        out[("pdftotext", name)] = (gzip.decompress(gz.read_bytes()).decode().split("\f")[:-1], gz)
    for path in sorted((shared_data / "manpages").glob("*.txt")):
        out[("groff", path.name)] = (path.read_text(encoding="utf-8").split("\f")[:-1], path)
    return out


def _measure(real_pages, extractor: str, clean) -> Counter:
    tot: Counter = Counter()
    for (ex, name), (pages, path) in real_pages.items():
        if ex == extractor:
            before, after = clean(pages, path)
            tot.update(score(name, before, after))
    return tot


def _strip(**options):
    return lambda pages, path: (pages, strip_headers_footers(pages, **options))


def _loader(pages, path):
    from ragbudget.loaders import load_document

    return load_document(path, clean=False).pages, load_document(path).pages


def _pct(c: Counter, what: str, of: str) -> float:
    return c[what] / c[of]


@pytest.mark.shared_data
def test_truth_fits_every_extraction(real_pages):
    # The hand-written patterns are found on every page they were read on, in both extractions.
    assert len(real_pages) == 46
    for (ex, name), (pages, _) in real_pages.items():
        furniture, body, misses = classify(name, pages)
        assert not misses, (ex, name, misses[:3])
        assert furniture and body
    pdf = {ex: sum(len(classify(n, p)[0]) for (e, n), (p, _) in real_pages.items() if e == ex)
           for ex in ("pypdfium2", "pdftotext")}
    assert pdf == {"pypdfium2": 524, "pdftotext": 524}


@pytest.mark.shared_data
@pytest.mark.parametrize("extractor", ["pypdfium2", "pdftotext", "groff"])
@pytest.mark.parametrize("path", ["strip", "loader"])
def test_real_documents_furniture_removed_body_kept(real_pages, extractor, path):
    c = _measure(real_pages, extractor, _strip() if path == "strip" else _loader)
    assert _pct(c, "body_removed", "body") <= 0.005, c
    assert _pct(c, "furniture_removed", "furniture") >= FURNITURE_MIN[extractor], c
    assert _pct(c, "page_number_lines_removed", "page_number_lines") >= PAGENO_MIN[extractor], c
    assert c["running_head_removed"] == c["running_head"], c
    assert c["running_foot_removed"] == c["running_foot"], c


@pytest.mark.shared_data
@pytest.mark.parametrize("extractor", ["pypdfium2", "pdftotext", "groff"])
def test_real_documents_trusting_page_numbers(real_pages, extractor):
    c = _measure(real_pages, extractor, _strip(trust_page_numbers=True))
    assert _pct(c, "body_removed", "body") <= 0.005, c
    assert _pct(c, "furniture_removed", "furniture") >= TRUSTED_MIN[extractor], c


@pytest.mark.shared_data
def test_real_documents_known_running_heads(real_pages):
    policy = strip_headers_footers(real_pages[("pypdfium2", "policy.pdf")][0])
    assert not any("Debian Policy Manual, Release 4.6.2.0" in p for p in policy[12:])
    rintro = strip_headers_footers(real_pages[("pypdfium2", "R-intro.pdf")][0])
    assert not any(p.startswith("Chapter 5: Arrays and matrices") for p in rintro)
    close = strip_headers_footers(real_pages[("groff", "close.2.txt")][0])
    assert not any("System Calls Manual" in p or "Linux man-pages 6.03" in p for p in close)
    assert close[0].lstrip().startswith("NAME")


def test_docstring_examples():
    import doctest

    import ragbudget.clean

    assert doctest.testmod(ragbudget.clean).failed == 0
