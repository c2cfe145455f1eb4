"""PDF pages: the text layer of each page with pypdfium2, then the pages without one counted,
read by OCR when asked (:mod:`ragbudget.input.formats.ocr`), and said either way.

Encrypted, truncated and damaged files are a ``LoadError`` with their reason; a scanned page is
never indexed silently as empty.
"""

from __future__ import annotations

from typing import Any

from ..errors import LoadError
from .formats import LoadOptions

__all__ = ["pdf_pages", "text_layer_check"]


def pdf_pages(data: bytes, path: str) -> list[str]:
    """Per-page text of a PDF with pypdfium2; encrypted or damaged files raise LoadError."""
    import pypdfium2

    if b"%PDF-" not in data[:1024]:
        raise LoadError(f"{path}: not a PDF (no %PDF- header)", path=path, reason="malformed")
    # A file cut short loses its trailer; pdfium may still "repair" it and return partial text
    # silently, so a missing end-of-file marker is treated as damage rather than guessed around.
    if b"%%EOF" not in data[-4096:]:
        raise LoadError(
            f"{path}: the PDF is truncated (no %%EOF marker at the end); re-download or re-export it",
            path=path,
            reason="malformed",
        )
    try:
        pdf = pypdfium2.PdfDocument(data)
    except pypdfium2.PdfiumError as exc:
        if "password" in str(exc).lower():
            raise LoadError(
                f"{path}: the PDF is encrypted with a password; decrypt it (e.g. qpdf --decrypt) before indexing",
                path=path,
                reason="encrypted",
            ) from exc
        raise LoadError(f"{path}: cannot open the PDF ({exc})", path=path, reason="malformed") from exc
    try:
        if len(pdf) == 0:
            raise LoadError(f"{path}: the PDF has no pages", path=path, reason="malformed")
        pages = []
        for i in range(len(pdf)):
            page = pdf[i]
            textpage = page.get_textpage()
            # pdfium marks a hyphen it removed at a line break as U+FFFE; the word is rejoined.
            pages.append(textpage.get_text_range().replace("\ufffe", ""))
            textpage.close()
            page.close()
        return pages
    except pypdfium2.PdfiumError as exc:
        raise LoadError(f"{path}: damaged PDF page ({exc})", path=path, reason="malformed") from exc
    finally:
        pdf.close()


def _pages_have(n: int, total: int) -> str:
    """``"1 of 114 pages has"`` / ``"3 of 114 pages have"``: the verb agrees with ``n``, the
    pages counted, not with the total.

    >>> _pages_have(1, 114), _pages_have(2, 3)
    ('1 of 114 pages has', '2 of 3 pages have')
    """
    return f"{n} of {total} pages {'has' if n == 1 else 'have'}"


def text_layer_check(
    pages: list[str], data: bytes, path: str, opts: LoadOptions, meta: dict[str, Any], warnings: list[str]
) -> list[str]:
    """Count PDF pages without a text layer, OCR them when asked, and say so either way.

    A scanned page is never indexed silently as empty: ``meta["pages_without_text"]`` counts
    them and a one-line warning names the share; with ``opts.ocr`` they are read by Tesseract
    (``meta["ocr_pages"]``), and a missing Tesseract is a warning, not a failure, since the pages
    with text are still worth indexing.
    """
    blank = [i for i, p in enumerate(pages) if not p.strip()]
    meta["pages_without_text"] = len(blank)
    if not blank:
        return pages
    if not opts.ocr:
        if len(blank) < len(pages):  # all blank: load_document raises "empty" with this advice
            warnings.append(
                f"{_pages_have(len(blank), len(pages))} no text layer (scanned?); not indexed without --ocr"
            )
        return pages
    from .formats.ocr import ocr_pdf_pages

    try:
        texts = ocr_pdf_pages(data, blank, path, lang=opts.ocr_lang)
    except LoadError as exc:
        warnings.append(
            f"{_pages_have(len(blank), len(pages))} no text layer and OCR failed: " + str(exc).removeprefix(f"{path}: ")
        )
        if len(blank) == len(pages):
            raise
        return pages
    pages = list(pages)
    for i, text in zip(blank, texts, strict=True):
        pages[i] = text
    meta["ocr_pages"] = len(blank)
    still = sum(1 for i in blank if not pages[i].strip())
    warnings.append(
        f"{_pages_have(len(blank), len(pages))} no text layer: read by OCR"
        + (f" ({still} gave no text)" if still else "")
    )
    return pages
