"""OCR for PDF pages without a text layer: pdfium renders the page, Tesseract reads it.

Off by default (``LoadOptions(ocr=True)``, ``ragbudget index --ocr``): it is slow (seconds per
page) and needs the ``ocr`` extra (pytesseract, Pillow) plus the ``tesseract`` program
(Debian: ``apt install tesseract-ocr``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...errors import LoadError
from ._base import require

__all__ = ["OCR_DPI", "OCR_TIMEOUT_S", "ocr_pdf_pages"]

#: Render resolution: Tesseract reads text 20-30 px high best: 200 dpi puts 10 pt text near 28 px,
#: and costs half the time of 300 dpi.
OCR_DPI = 200
#: Seconds Tesseract may spend on one page before the page is given up (a bounded run).
OCR_TIMEOUT_S = 120


def ocr_pdf_pages(data: bytes, pages: Sequence[int], path: str, *, lang: str = "eng") -> list[str]:
    """Text of the 0-based ``pages`` of the PDF in ``data``, read by Tesseract."""
    pytesseract = require("pytesseract", "ocr", path, "scanned PDF pages")
    import pypdfium2

    try:
        pytesseract.get_tesseract_version()
    except Exception as exc:  # pytesseract raises its own TesseractNotFoundError / OSError
        raise LoadError(
            f"{path}: OCR needs the tesseract program (apt install tesseract-ocr)",
            path=path,
            reason="missing_dependency",
            needs="program:tesseract",
        ) from exc
    pdf = pypdfium2.PdfDocument(data)
    out = []
    try:
        for i in pages:
            page = pdf[i]
            image = page.render(scale=OCR_DPI / 72, grayscale=True).to_pil()
            page.close()
            try:
                out.append(pytesseract.image_to_string(image, lang=lang, timeout=OCR_TIMEOUT_S))
            except RuntimeError as exc:  # pytesseract's timeout
                raise LoadError(
                    f"{path}: OCR of page {i + 1} took over {OCR_TIMEOUT_S} s", path=path, reason="too_large"
                ) from exc
            except pytesseract.TesseractError as exc:
                raise LoadError(
                    f"{path}: tesseract failed on page {i + 1} ({exc.message.strip()[:200]})",
                    path=path,
                    reason="malformed",
                ) from exc
    finally:
        pdf.close()
    return out
