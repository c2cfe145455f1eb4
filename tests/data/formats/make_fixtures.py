"""Rebuild the format fixtures from real text in ../shared/data with real tools.

Run from the repository root:  python tests/data/formats/make_fixtures.py [SHARED_DATA]
Needs pandoc (Debian 2.17), python-docx, python-pptx, pypdfium2, pypdf, Pillow, and for the
password-protected DOCX, msoffcrypto-tool (`msoffcrypto-tool -e -p secret in.docx out.docx`).
See README.md here for what each file holds.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
import sys
from email.message import EmailMessage
from email.utils import format_datetime, make_msgid
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = Path(sys.argv[1] if len(sys.argv) > 1 else HERE.parents[2] / ".." / "shared" / "data").resolve()
BUILD = HERE / "_build"


def social_contract_markdown() -> str:
    """Debian Social Contract v1.2 (doc-debian) as Markdown: sections as #, clauses as ##."""
    text = (SHARED / "versions" / "social-contract.1.2.txt").read_text()
    out: list[str] = []
    para: list[str] = []

    def flush() -> None:
        if para:
            out.append(" ".join(para) + "\n")
            para.clear()

    for line in text.splitlines():
        if not line.strip() or set(line.strip()) == {"_"}:
            flush()
            continue
        m = re.match(r"^ {4}(\d+)\. (.+)$", line)
        if not line.startswith(" "):
            flush()
            out.append(f"# {line.strip()}\n")
        elif m:
            flush()
            out.append(f"## {m.group(1)}. {m.group(2).strip()}\n")
        else:
            para.append(line.strip())
    flush()
    return "\n".join(out)


def pandoc(*args: str) -> None:
    subprocess.run(["pandoc", *args], check=True)


def docx_with_header(md: Path) -> None:
    import docx

    ref = BUILD / "reference.docx"
    pandoc("-o", str(ref), "--print-default-data-file", "reference.docx")
    doc = docx.Document(ref)
    section = doc.sections[0]
    section.header.is_linked_to_previous = False
    section.header.paragraphs[0].text = "Debian Social Contract - version 1.2"
    section.footer.is_linked_to_previous = False
    section.footer.paragraphs[0].text = "Published by the Debian Project"
    doc.save(ref)
    # A table in the body: the clause numbers and titles, from the same text.
    pandoc(str(md), "--reference-doc", str(ref), "-o", str(HERE / "social-contract.docx"))


def pptx_with_footer(md_text: str) -> None:
    """Slides per clause (## headings), speaker notes, then a footer text box on every slide."""
    import pptx
    from pptx.util import Pt

    slides_md = []
    for block in md_text.split("\n## ")[1:6]:
        title, _, body = block.partition("\n")
        sentences = re.split(r"(?<=\.) ", body.strip())
        slides_md.append(f"## {title}\n\n{sentences[0]}\n\n::: notes\n{' '.join(sentences[1:3])}\n:::\n")
    src = BUILD / "slides.md"
    src.write_text("% Debian Social Contract\n\n" + "\n".join(slides_md))
    out = HERE / "social-contract.pptx"
    pandoc(str(src), "-o", str(out))
    prs = pptx.Presentation(out)
    for slide in prs.slides:
        box = slide.shapes.add_textbox(Pt(20), prs.slide_height - Pt(40), Pt(400), Pt(30))
        box.text_frame.text = "Debian Social Contract - www.debian.org"
    prs.save(out)


def notebook(md: str) -> None:
    """pandoc writes the .ipynb (markdown + a code cell); then a PNG and a text output are added."""
    import pypdfium2

    src = BUILD / "nb.md"
    clauses = [b for b in md.split("\n## ")[1:4]]
    cells = [f"::: {{.cell .markdown}}\n# Reading the Social Contract\n:::\n"]
    cells += [f"::: {{.cell .markdown}}\n## {c.strip()}\n:::\n" for c in clauses[:2]]
    cells.append("::: {.cell .code}\n``` python\nprint(len(open('social-contract.txt').read().split()))\n```\n:::\n")
    src.write_text("\n".join(cells))
    out = HERE / "notebook.ipynb"
    pandoc(str(src), "-o", str(out))
    nb = json.loads(out.read_text())
    pdf = pypdfium2.PdfDocument(str(SHARED / "pdf" / "maint-guide.en.pdf"))
    img = pdf[0].render(scale=0.25, grayscale=True).to_pil()
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["execution_count"] = 1
            cell["outputs"] = [
                {"output_type": "stream", "name": "stdout", "text": ["1406 words in the Social Contract\n"]},
                {"output_type": "display_data", "metadata": {},
                 "data": {"image/png": base64.b64encode(buf.getvalue()).decode(), "text/plain": ["<Figure size 640x480>"]}},
            ]
    out.write_text(json.dumps(nb, indent=1))


def squad_tables() -> None:
    """A CSV, a TSV, a JSON and a JSONL slice of SQuAD v1.1 dev (article 'Warsaw')."""
    import csv

    data = json.loads((SHARED / "squad" / "squaddev_v1.1.json").read_text())
    art = next(a for a in data["data"] if a["title"] == "Warsaw")
    rows = [(qa["id"], art["title"], qa["question"], qa["answers"][0]["text"])
            for p in art["paragraphs"][:12] for qa in p["qas"]][:45]
    for name, delim in (("squad-warsaw.csv", ","), ("squad-warsaw.tsv", "\t")):
        with open(HERE / name, "w", newline="") as fh:
            w = csv.writer(fh, delimiter=delim)
            w.writerow(["id", "title", "question", "answer"])
            w.writerows(rows)
    sub = {"version": data["version"], "data": [{"title": art["title"], "paragraphs": art["paragraphs"][:2]}]}
    (HERE / "squad-warsaw.json").write_text(json.dumps(sub, ensure_ascii=False, indent=1))
    with open(HERE / "squad-warsaw.jsonl", "w") as fh:
        for p in art["paragraphs"][2:5]:
            fh.write(json.dumps({"title": art["title"], "context": p["context"],
                                 "questions": [q["question"] for q in p["qas"][:2]]}, ensure_ascii=False) + "\n")


def mail() -> None:
    """An mbox of four messages quoting the Debian Constitution (one reply quotes its parent,
    one is HTML only) with a damaged message in the middle; and one .eml."""
    text = (SHARED / "versions" / "constitution.1.9.txt").read_text()
    paras = [" ".join(p.split()) for p in text.split("\n\n") if len(p.split()) > 40][:6]
    when = datetime(2024, 3, 1, 9, 0, tzinfo=timezone.utc)
    msgs = []

    def msg(n: int, subject: str, body: str, html: bool = False, reply_to: EmailMessage | None = None) -> EmailMessage:
        m = EmailMessage()
        m["From"] = f"Developer {n} <dev{n}@lists.example.org>"
        m["To"] = "debian-vote@lists.example.org"
        m["Subject"] = subject
        m["Date"] = format_datetime(when.replace(hour=9 + n))
        m["Message-ID"] = f"<constitution-{n}@lists.example.org>"
        if reply_to is not None:
            m["In-Reply-To"] = reply_to["Message-ID"]
        if html:
            m.set_content("<html><body><h1>" + subject + "</h1><p>" + body + "</p></body></html>", subtype="html")
        else:
            m.set_content(body)
        return m

    first = msg(1, "Question about the Project Leader", paras[0] + "\n\n" + paras[1])
    quoted = "\n".join("> " + line for line in first.get_content().splitlines())
    reply = msg(2, "Re: Question about the Project Leader", paras[2] + "\n\nOn 1 March, Developer 1 wrote:\n" + quoted, reply_to=first)
    html = msg(4, "Technical Committee", paras[3], html=True)
    last = msg(5, "Delegates", paras[4])
    # The damaged message: a multipart whose base64 part is cut off mid-line and whose
    # charset is unknown, as a crashed mailer leaves it.
    broken = (b"From dev3@lists.example.org Fri Mar  1 12:00:00 2024\n"
              b"From: Developer 3 <dev3@lists.example.org>\nSubject: =?x-unknown?B?broken?=\n"
              b"Message-ID: <constitution-3@lists.example.org>\n"
              b"Content-Type: multipart/mixed; boundary=\"XX\"\n\n--XX\n"
              b"Content-Type: text/plain; charset=x-unknown-charset\nContent-Transfer-Encoding: base64\n\n"
              b"VGhpcyBtZXNz\x00\x00YWdlIGlz\n")
    out = b""
    for m in (first, reply):
        out += b"From dev@lists.example.org Fri Mar  1 09:00:00 2024\n" + m.as_bytes(unixfrom=False) + b"\n"
    out += broken + b"\n"
    for m in (html, last):
        out += b"From dev@lists.example.org Fri Mar  1 13:00:00 2024\n" + m.as_bytes(unixfrom=False) + b"\n"
    (HERE / "debian-vote.mbox").write_bytes(out)
    (HERE / "delegates.eml").write_bytes(last.as_bytes())


def scanned_pdf() -> None:
    """Policy manual pages 20, 21 and 23: page 20 keeps its text layer; 21 and 23 (prose) are
    rendered to images (150 dpi, grayscale JPEG) and put back as image-only pages, as a scanner
    makes them."""
    import pypdf
    import pypdfium2

    src = SHARED / "pdf" / "policy.pdf"
    pdf = pypdfium2.PdfDocument(str(src))
    images = [pdf[i].render(scale=150 / 72, grayscale=True).to_pil() for i in (20, 22)]
    img_pdf = BUILD / "scan.pdf"
    images[0].save(img_pdf, "PDF", resolution=150.0, save_all=True, append_images=images[1:], quality=50)
    writer = pypdf.PdfWriter()
    writer.add_page(pypdf.PdfReader(str(src)).pages[19])
    for page in pypdf.PdfReader(str(img_pdf)).pages:
        writer.add_page(page)
    with open(HERE / "policy-scanned.pdf", "wb") as fh:
        writer.write(fh)


def main() -> None:
    BUILD.mkdir(exist_ok=True)
    md = social_contract_markdown()
    src = BUILD / "social-contract.md"
    src.write_text("% Debian Social Contract\n\n" + md)
    docx_with_header(src)
    pandoc(str(src), "-o", str(HERE / "social-contract.odt"))
    pandoc(str(src), "--epub-chapter-level", "1", "-o", str(HERE / "social-contract.epub"))
    pptx_with_footer(md)
    notebook(md)
    squad_tables()
    mail()
    scanned_pdf()
    tool = shutil.which("msoffcrypto-tool")
    if tool:
        for ext in ("docx", "pptx"):
            subprocess.run([tool, "-e", "-p", "secret", str(HERE / f"social-contract.{ext}"),
                            str(HERE / f"protected.{ext}")], check=True)
    shutil.rmtree(BUILD)


if __name__ == "__main__":
    main()
