"""PDF pages: text layers, scanned pages counted and said (read by OCR when asked)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _fakes import make_pdf

from ragbudget.errors import LoadError
from ragbudget.input.formats import LoadOptions
from ragbudget.input.loaders import load_document
from ragbudget.input.pdf import pdf_pages

DATA = Path(__file__).parent / "data" / "formats"


def _load_error(path: Path | str, **kw) -> LoadError:
    with pytest.raises(LoadError) as info:
        load_document(path, **kw)
    assert "\n" not in str(info.value)  # one line, never a traceback's worth
    return info.value


def test_pdf_meta(tmp_path: Path):
    p = tmp_path / "d.pdf"
    p.write_bytes(make_pdf(["alpha", "beta", "gamma"]))
    doc = load_document(p)
    assert doc.pages == ["alpha", "beta", "gamma"]
    assert doc.page_of(doc.text.index("gamma")) == 3
    assert {k: doc.meta[k] for k in ("format", "encoding", "paginated", "n_pages", "replaced_chars")} == {
        "format": "pdf",
        "encoding": "pdf",
        "paginated": True,
        "n_pages": 3,
        "replaced_chars": 0,
    }
    assert doc.meta["size"] == p.stat().st_size and doc.meta["mtime_ns"] == p.stat().st_mtime_ns


def test_scanned_pdf_pages_are_reported_not_silently_empty(tmp_path):
    doc = load_document(DATA / "policy-scanned.pdf")
    assert doc.meta["pages_without_text"] == 2 and doc.meta["n_pages"] == 3
    assert doc.meta["warnings"] == ["2 of 3 pages have no text layer (scanned?); not indexed without --ocr"]
    assert "2 of 3 pages have no text layer" in doc.meta["encoding_warning"]  # what the index shows
    pypdf = pytest.importorskip("pypdf")
    writer = pypdf.PdfWriter()
    for page in pypdf.PdfReader(DATA / "policy-scanned.pdf").pages[1:]:
        writer.add_page(page)
    only_scans = tmp_path / "scan.pdf"
    with open(only_scans, "wb") as fh:
        writer.write(fh)
    err = _load_error(only_scans)
    assert err.reason == "empty" and "no text layer on any of its 2 page(s)" in str(err) and "--ocr" in str(err)
    # One scanned page beside a page with text: the verb agrees with the one.
    writer = pypdf.PdfWriter()
    for page in pypdf.PdfReader(DATA / "policy-scanned.pdf").pages[:2]:
        writer.add_page(page)
    one_scan = tmp_path / "one-scan.pdf"
    with open(one_scan, "wb") as fh:
        writer.write(fh)
    assert load_document(one_scan).meta["warnings"] == [
        "1 of 2 pages has no text layer (scanned?); not indexed without --ocr"
    ]


@pytest.mark.slow
def test_ocr_reads_the_scanned_pages():
    pytest.importorskip("pytesseract")
    if shutil.which("tesseract") is None:
        pytest.skip("tesseract-ocr is not installed")
    doc = load_document(DATA / "policy-scanned.pdf", options=LoadOptions(ocr=True))
    assert doc.meta["ocr_pages"] == 2
    assert "Each package must have a priority value" in doc.pages[1]
    assert "BINARY PACKAGES" in doc.pages[2]


def test_damaged_pdfs_each_have_their_reason() -> None:
    good = make_pdf(["one page"])
    assert pdf_pages(good, "ok.pdf") == ["one page"]
    cases = {
        b"plain text, no header": ("malformed", "not a PDF (no %PDF- header)"),
        good[: len(good) // 2]: ("malformed", "the PDF is truncated"),
        make_pdf(["secret"], password="pw"): ("encrypted", "decrypt it (e.g. qpdf --decrypt)"),
    }
    for data, (reason, words) in cases.items():
        with pytest.raises(LoadError) as info:
            pdf_pages(data, "x.pdf")
        assert info.value.reason == reason and words in str(info.value), str(info.value)
