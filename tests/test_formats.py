"""Container and record formats (ragbudget.input.formats): real fixtures, provenance labels, hostile cases.

The fixtures in tests/data/formats/ were made from ../shared/data with pandoc and friends (see
the README there). Everything goes through ``load_document`` and, at the end, ``Index.build``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import zipfile
from pathlib import Path

import pytest

from ragbudget.errors import LoadError
from ragbudget.input.formats import LoadOptions, current_options, load_options, page_label
from ragbudget.input.loaders import SUPPORTED_EXTENSIONS, iter_documents, load_document, scan

DATA = Path(__file__).parent / "data" / "formats"


def _error(path: Path | str, **kw) -> LoadError:
    with pytest.raises(LoadError) as info:
        load_document(path, **kw)
    # Every reason is one line, never a traceback's worth.
    assert "\n" not in str(info.value)
    return info.value


# --------------------------------------------------------------------------------------------------
# each format: text, structure, provenance labels


def test_supported_extensions_include_the_new_formats():
    for ext in (".docx", ".pptx", ".odt", ".epub", ".ipynb", ".csv", ".tsv", ".json", ".jsonl", ".eml", ".mbox"):
        assert ext in SUPPORTED_EXTENSIONS
    result = scan(DATA)
    assert {Path(s.path).name for s in result.skipped} == {"make_fixtures.py"}


def test_docx_paragraphs_headings_and_section_furniture():
    doc = load_document(DATA / "social-contract.docx")
    labels = doc.meta["page_labels"]
    assert len(labels) == len(doc.pages) == doc.meta["paragraphs"] + doc.meta["tables"]
    assert labels[:2] == ["paragraph 1", "paragraph 2"]
    assert doc.pages[0] == "# Debian Social Contract"
    assert "## 1. Debian will remain 100% free" in doc.pages
    # Section header and footer (from the reference doc) are left out by construction, counted.
    assert "version 1.2" not in doc.text.lower().replace("version 1.2 ratified", "")
    assert "Published by the Debian Project" not in doc.text
    assert doc.meta["furniture_removed"] == 2
    assert doc.meta["paginated"] is True


def test_odt_like_docx():
    doc = load_document(DATA / "social-contract.odt")
    assert doc.pages[0] == "# Debian Social Contract"
    assert "## 1. Debian will remain 100% free" in doc.pages
    assert doc.meta["page_labels"][5] == "paragraph 6"
    assert len(doc.pages) == load_document(DATA / "social-contract.docx").meta["n_pages"]


def test_pptx_slides_notes_and_repeated_footer():
    doc = load_document(DATA / "social-contract.pptx")
    assert doc.meta["page_labels"] == [f"slide {i}" for i in range(1, 7)]
    assert doc.pages[1].startswith("# 1. Debian will remain 100% free")
    assert "Notes: We promise that the Debian system" in doc.pages[1]
    assert "www.debian.org" not in doc.text  # the footer box on every slide
    assert doc.meta["furniture_removed"] >= 6


def test_epub_chapters_in_spine_order():
    doc = load_document(DATA / "social-contract.epub")
    assert doc.meta["page_labels"] == ["chapter 1", "chapter 2", "chapter 3", "chapter 4"]
    assert doc.meta["chapter_titles"][2] == "“Social Contract” with the Free Software Community"
    assert doc.meta["chapter_titles"][3] == "The Debian Free Software Guidelines (DFSG)"
    assert "## 1. Debian will remain 100% free" in doc.pages[2]


def test_notebook_cells_and_optional_outputs():
    doc = load_document(DATA / "notebook.ipynb")
    assert doc.meta["page_labels"] == ["cell 1", "cell 2", "cell 3", "cell 4"]
    assert doc.pages[3].startswith("```") and "print(len(" in doc.pages[3]
    assert "1406 words" not in doc.text  # outputs are off by default
    assert doc.meta["binary_outputs"] == 1
    with_outputs = load_document(DATA / "notebook.ipynb", options=LoadOptions(ipynb_outputs=True))
    assert "1406 words in the Social Contract" in with_outputs.pages[3]
    # The PNG is never text; its "<Figure ...>" repr is not indexed either.
    assert "iVBOR" not in with_outputs.text and "<Figure" not in with_outputs.text
    assert with_outputs.meta["binary_outputs"] == 1


@pytest.mark.parametrize("name", ["squad-warsaw.csv", "squad-warsaw.tsv"])
def test_csv_rows_carry_their_header_names(name):
    doc = load_document(DATA / name)
    assert doc.meta["page_labels"] == ["rows 1-20", "rows 21-40", "rows 41-45"]
    assert doc.meta["rows"] == 45 and doc.meta["columns"] == ["id", "title", "question", "answer"]
    first = doc.pages[0].split("\n")[0]
    assert first == (
        "id: 5733a5f54776f41900660f45; title: Warsaw; "
        "question: What was Maria Curie the first female recipient of?; answer: Nobel Prize"
    )


def test_json_key_paths_and_field_choice():
    doc = load_document(DATA / "squad-warsaw.json")
    labels = doc.meta["page_labels"]
    assert labels[:3] == ["version", "data[0].title", "data[0].paragraphs[0].context"]
    i = labels.index("data[0].paragraphs[0].qas[0].question")
    assert doc.pages[i] == "What was Maria Curie the first female recipient of?"
    only = load_document(DATA / "squad-warsaw.json", options=LoadOptions(json_fields=("context",)))
    assert only.meta["page_labels"] == ["data[0].paragraphs[0].context", "data[0].paragraphs[1].context"]
    by_path = load_document(
        DATA / "squad-warsaw.json", options=LoadOptions(json_fields=("data.paragraphs.qas.question",))
    )
    assert all(lab.endswith(".question") for lab in by_path.meta["page_labels"])
    assert _error(DATA / "squad-warsaw.json", options=LoadOptions(json_fields=("nope",))).reason == "empty"


def test_jsonl_lines_and_a_bad_line(tmp_path):
    doc = load_document(DATA / "squad-warsaw.jsonl")
    assert doc.meta["page_labels"][:3] == ["line 1: title", "line 1: context", "line 1: questions[0]"]
    lines = (DATA / "squad-warsaw.jsonl").read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], '{"title": "cut', lines[1]]) + "\n")
    doc = load_document(bad)
    assert doc.meta["bad_lines"] == 1 and any(lab.startswith("line 3:") for lab in doc.meta["page_labels"])
    assert "1 of 3 lines are not valid JSON" in doc.meta["warnings"][0]


def test_mbox_messages_and_a_broken_one_in_the_middle():
    doc = load_document(DATA / "debian-vote.mbox")
    assert doc.meta["page_labels"] == [
        "message <constitution-1@lists.example.org>",
        "message <constitution-2@lists.example.org>",
        "message <constitution-4@lists.example.org>",
        "message <constitution-5@lists.example.org>",
    ]
    assert doc.meta["messages"] == 5 and doc.meta["messages_skipped"] == 1
    assert "1 of 5 messages could not be read" in doc.meta["warnings"][0] and "#3" in doc.meta["warnings"][0]
    assert doc.pages[0].startswith("From: Developer 1 <dev1@lists.example.org>\nDate: ")
    assert "\n> " in doc.pages[1]  # the quoted reply stays; near-dup folds it at index time
    assert doc.pages[2].startswith("From: Developer 4") and "<p>" not in doc.pages[2]  # HTML part read


def test_eml_single_message():
    doc = load_document(DATA / "delegates.eml")
    assert doc.meta["page_labels"] == ["message <constitution-5@lists.example.org>"]
    assert "Subject: Delegates" in doc.text


def test_eml_without_text_and_garbage(tmp_path):
    from email.message import EmailMessage

    m = EmailMessage()
    m["From"], m["Subject"], m["Message-ID"] = "a@example.org", "scan", "<a@example.org>"
    m.add_attachment(b"%PDF-1.4 ...", maintype="application", subtype="pdf", filename="scan.pdf")
    only_attachment = tmp_path / "scan.eml"
    only_attachment.write_bytes(m.as_bytes())
    assert _error(only_attachment).reason == "empty"
    garbage = tmp_path / "garbage.mbox"
    garbage.write_bytes(b"no separator line here\n" * 10)
    assert _error(garbage).reason == "malformed"


# --------------------------------------------------------------------------------------------------
# hostile cases: a reason, bounded in time and memory, never a traceback


def test_zip_bomb_disguised_as_docx_is_refused_before_reading(tmp_path):
    bomb = tmp_path / "bomb.docx"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("[Content_Types].xml", "<Types/>")
        with zf.open("word/document.xml", "w") as member:  # streamed: the test stays small too
            chunk = b"\0" * (1 << 20)
            for _ in range(8):
                member.write(chunk)
    assert bomb.stat().st_size < 100_000
    t0 = time.monotonic()
    err = _error(bomb)
    assert err.reason == "too_large" and "zip bomb" in str(err) and "expands" in str(err)
    err = _error(bomb, max_bytes=4 << 20)  # the declared total alone is over max_bytes
    assert err.reason == "too_large" and "over max_bytes" in str(err)
    assert time.monotonic() - t0 < 5


def test_password_protected_docx():
    err = _error(DATA / "protected.docx")
    assert err.reason == "encrypted" and "password" in str(err)


def test_password_protected_pptx():
    err = _error(DATA / "protected.pptx")
    assert err.reason == "encrypted" and "PowerPoint" in str(err)


def test_truncated_epub(tmp_path):
    data = (DATA / "social-contract.epub").read_bytes()
    cut = tmp_path / "cut.epub"
    cut.write_bytes(data[: len(data) // 2])
    err = _error(cut)
    assert err.reason == "malformed" and "truncated" in str(err)


def test_wrong_container_behind_an_office_name(tmp_path):
    text = tmp_path / "notes.docx"
    text.write_text("plain text saved with the wrong name " * 10)
    assert _error(text).reason == "malformed"
    deck = tmp_path / "deck.docx"
    deck.write_bytes((DATA / "social-contract.pptx").read_bytes())
    err = _error(deck)
    assert err.reason == "malformed" and "Word document" in str(err)


def test_csv_with_a_50_mb_single_field(tmp_path):
    big = tmp_path / "dump.csv"
    with open(big, "wb") as fh:
        fh.write(b'id,payload\n1,"')
        block = b"x" * (1 << 20)
        for _ in range(50):
            fh.write(block)
        fh.write(b'"\n2,small\n')
    t0 = time.monotonic()
    err = _error(big, max_bytes=64 << 20)
    assert err.reason == "too_large" and "a field is over" in str(err)
    assert time.monotonic() - t0 < 30
    # With the default 50 MiB max_bytes the file is refused before it is read at all.
    assert _error(big).reason == "too_large"


def test_notebook_damaged_or_old(tmp_path):
    bad = tmp_path / "bad.ipynb"
    bad.write_text('{"cells": [')
    assert _error(bad).reason == "malformed"
    old = tmp_path / "old.ipynb"
    old.write_text(json.dumps({"nbformat": 3, "worksheets": []}))
    err = _error(old)
    assert err.reason == "unsupported" and "nbconvert" in str(err)


def test_deeply_nested_json_and_encrypted_odt(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    assert _error(deep).reason == "malformed"
    odt = tmp_path / "locked.odt"
    with zipfile.ZipFile(DATA / "social-contract.odt") as src, zipfile.ZipFile(odt, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "META-INF/manifest.xml":  # what LibreOffice writes for a password
                data = data.replace(
                    b'full-path="content.xml" manifest:version="1.2" />',
                    b'full-path="content.xml"><manifest:encryption-data/></manifest:file-entry>',
                )
                assert b"encryption-data" in data
            dst.writestr(info, data)
    assert _error(odt).reason == "encrypted"


def test_missing_optional_library_is_a_one_line_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "docx", None)  # import docx now raises ImportError
    err = _error(DATA / "social-contract.docx")
    assert err.reason == "missing_dependency" and err.needs == "docx"  # what an index retries on
    assert "pip install 'ragbudget[office]'" in str(err)
    monkeypatch.setitem(sys.modules, "pptx", None)
    assert "ragbudget[office]" in str(_error(DATA / "social-contract.pptx"))


def test_compressed_formats_read_too(tmp_path):
    import gzip

    gz = tmp_path / "squad-warsaw.csv.gz"
    gz.write_bytes(gzip.compress((DATA / "squad-warsaw.csv").read_bytes()))
    assert load_document(gz).meta["page_labels"][0] == "rows 1-20"


# --------------------------------------------------------------------------------------------------
# options and labels


def test_load_options_context_and_validation():
    assert current_options() == LoadOptions()
    with load_options(LoadOptions(json_fields=("context",))):
        doc = load_document(DATA / "squad-warsaw.json")
    assert len(doc.pages) == 2
    assert len(load_document(DATA / "squad-warsaw.json").pages) > 2
    from ragbudget.errors import ConfigError

    with pytest.raises(ConfigError):
        LoadOptions(json_fields="context")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        LoadOptions(ocr_lang="eng; rm -rf /")


def test_page_label_ranges():
    labels = ["rows 1-20", "rows 21-40", "rows 41-45"]
    assert page_label(labels, 2, 3) == "rows 21-45"
    assert page_label(["paragraph 1", "table 1", "paragraph 2"], 1, 3) == "paragraphs 1-2"
    assert page_label(["paragraph 1", "table 1"], 1, 2) == "paragraph 1 - table 1"
    assert page_label(labels, 9) == "page 9"
    assert page_label(None, None) is None


def test_corpus_boilerplate_leaves_records_alone(tmp_path):
    # Four CSV exports sharing rows: a repeated row is data, not boilerplate.
    for i in range(4):
        shutil.copy(DATA / "squad-warsaw.csv", tmp_path / f"export{i}.csv")
    docs = [d for d in iter_documents(tmp_path) if not hasattr(d, "reason")]
    assert len(docs) == 4
    assert all(d.text == docs[0].text for d in docs)
    assert "boilerplate_removed" not in docs[0].meta


# --------------------------------------------------------------------------------------------------
# through the index: chunks, pages → labels, skip reasons and warnings


def test_index_a_folder_of_every_format(tmp_path):
    from ragbudget.retrieval.embed import HashEmbedder
    from ragbudget.retrieval.index import Index

    folder = tmp_path / "docs"
    shutil.copytree(DATA, folder, ignore=shutil.ignore_patterns("*.py", "*.md"))
    summary = Index(tmp_path / "idx").build([folder], embedder=HashEmbedder(dim=64), min_tokens=20, max_tokens=120)
    reasons = {Path(p).name: r for p, r, _ in summary.skipped}
    assert reasons == {"protected.docx": "encrypted", "protected.pptx": "encrypted"}
    assert summary.files_indexed == len(list(folder.iterdir())) - 2
    warned = {Path(p).name: m for p, m in summary.warnings}
    assert "2 of 3 pages have no text layer" in warned["policy-scanned.pdf"]
    assert "1 of 5 messages could not be read" in warned["debian-vote.mbox"]
    assert summary.furniture_lines_removed >= 2 + 6  # DOCX header/footer, PPTX footers
    ix = Index.open(tmp_path / "idx")
    cases = {
        "What was Maria Curie the first female recipient of": ("squad-warsaw.csv", "rows 1-"),
        "We promise that the Debian system and all its components": ("social-contract.pptx", "2"),
        "print(len(open('social-contract.txt').read().split()))": ("notebook.ipynb", "-4"),
        "Technical Committee": ("debian-vote.mbox", "message <constitution-4@lists.example.org>"),
    }
    for query, (name, label) in cases.items():
        hits = ix.search(query, k=50, embedder=HashEmbedder(dim=64), hybrid=True)
        found = [s for h in hits for s in h.sources if Path(s.path).name == name]
        assert found, query
        src = found[0]
        # Sources carry display paths relative to the indexed folder's parent; the index keeps
        # page numbers, and the file's page_labels (stored by the loader) turn them into labels.
        labels = load_document(tmp_path / src.path).meta["page_labels"]
        shown = page_label(labels, src.page_start, src.page_end)
        assert label in shown and shown.split()[0] in ("rows", "slide", "slides", "cells", "cell", "message"), shown
        # ... and the index hands that label out with the source itself.
        assert src.label == shown and src.to_dict()["label"] == shown
    # Formats without named pages carry no label; their page numbers stay what they were.
    pdf = [
        s
        for h in ix.search("Debian Policy", k=50, embedder=HashEmbedder(dim=64))
        for s in h.sources
        if s.path.endswith(".pdf")
    ]
    assert pdf and all(s.label is None for s in pdf)


def test_import_stays_light_and_docstrings_run():
    import doctest
    import subprocess

    import ragbudget.input.formats

    code = (
        "import sys, ragbudget, ragbudget.input.loaders, ragbudget.input.formats; "
        "print([m for m in ('docx', 'pptx', 'pytesseract', 'PIL', 'lxml') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert doctest.testmod(ragbudget.input.formats).failed == 0


def test_cli_index_flags_reach_the_loaders(tmp_path):
    from click.testing import CliRunner

    from ragbudget.cli.commands import cli

    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("notebook.ipynb", "squad-warsaw.json"):
        shutil.copy(DATA / name, docs / name)
    runner = CliRunner()
    result = runner.invoke(
        cli,
        [
            "index",
            str(docs),
            "--index-dir",
            str(tmp_path / "idx"),
            "--embedder",
            "hash:64",
            "--min-tokens",
            "5",
            "--max-tokens",
            "60",
            "--ipynb-outputs",
            "--json-fields",
            "context, question",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["files_indexed"] == 2
    hits = json.loads(
        runner.invoke(
            cli,
            ["search", "1406 words in the Social Contract", "--index-dir", str(tmp_path / "idx"), "-k", "3", "--json"],
        ).stdout
    )
    assert any("1406 words" in h["text"] for h in hits)  # the output was indexed
    hits = json.loads(
        runner.invoke(cli, ["search", "version 1.1", "--index-dir", str(tmp_path / "idx"), "-k", "50", "--json"]).stdout
    )
    assert not any(h["text"].strip() == "1.1" for h in hits)  # "version" is not a chosen field


def test_cli_search_shows_the_unit_of_the_format(tmp_path):
    from click.testing import CliRunner

    from ragbudget.cli.commands import cli

    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(DATA / "social-contract.pptx", docs / "deck.pptx")
    runner = CliRunner()
    result = runner.invoke(
        cli,
        [
            "index",
            str(docs),
            "--index-dir",
            str(tmp_path / "idx"),
            "--embedder",
            "hash:64",
            "--min-tokens",
            "20",
            "--max-tokens",
            "120",
        ],
    )
    assert result.exit_code == 0, result.output
    out = runner.invoke(
        cli, ["search", "We promise that the Debian system", "--index-dir", str(tmp_path / "idx"), "-k", "3"]
    ).output
    assert "docs/deck.pptx (slide" in out, out
    hits = json.loads(
        runner.invoke(cli, ["search", "We promise", "--index-dir", str(tmp_path / "idx"), "-k", "3", "--json"]).stdout
    )
    assert all(s["label"].startswith("slide") for h in hits for s in h["sources"])
