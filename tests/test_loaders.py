"""Loading: a hostile folder scanned and loaded, pagination, gzip, load errors, corpus batches.

Each step has its own file too: test_scan, test_decode, test_html, test_pdf, test_boilerplate
(and test_formats for the container formats).
"""

from __future__ import annotations

import builtins
import gzip
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _fakes import make_pdf

from ragbudget.errors import LoadError
from ragbudget.input.loaders import (
    FileInfo,
    Skipped,
    iter_documents,
    load_document,
    paginate_text,
    scan,
)
from ragbudget.types import Document


def _load_error(path, **kw) -> LoadError:
    with pytest.raises(LoadError) as info:
        load_document(path, **kw)
    return info.value


# --------------------------------------------------------------------------------------------------
# the hostile folder


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "good.txt").write_text("Plain text file.\nSecond line.\n")
    (root / "notes.md").write_text("# Notes\n\nSome *markdown* here.\n")
    (root / "page.html").write_text(
        "<html><head><title>T</title><script>var x=1;</script></head><body>"
        "<nav>Home | About</nav><h1>Hello</h1><p>World of HTML.</p><footer>(c) site</footer></body></html>"
    )
    (root / "doc.pdf").write_bytes(make_pdf(["First PDF page", "Second PDF page"]))
    with gzip.open(root / "zipped.txt.gz", "wt") as fh:
        fh.write("Compressed text inside.\n")
    (root / "sub").mkdir()
    (root / "sub" / "deep.rst").write_text("Title\n=====\n\nDeep file.\n")
    # the bad ones
    (root / "blob.txt").write_bytes(b"\x00\x01\x02binary\x00" * 50)
    (root / "latin.txt").write_bytes(b"ok \xff\xfe then caf\xc3\xa9 and more\n")  # invalid UTF-8
    (root / "wide.txt").write_bytes("UTF-16 text, with BOM.\n".encode("utf-16"))
    (root / "empty.md").write_bytes(b"")
    locked = root / "locked.txt"
    locked.write_text("secret")
    locked.chmod(0)
    (root / "loop").symlink_to(root, target_is_directory=True)
    (root / "self").symlink_to(root / "self")
    outside = tmp_path / "outside.txt"
    outside.write_text("outside the root")
    (root / "escape.txt").symlink_to(outside)
    os.mkfifo(root / "pipe.txt")
    (root / "huge.txt").write_bytes(b"x" * 5000)
    pdf = make_pdf(["Truncated document page"])
    (root / "truncated.pdf").write_bytes(pdf[: len(pdf) // 2])
    (root / "secret.pdf").write_bytes(make_pdf(["Encrypted page"], password="pw"))
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (root / ".hidden.txt").write_text("hidden")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main")
    return root


def _unreadable(monkeypatch, path: Path) -> None:
    """Make ``path`` unreadable even for root.

    Tests run as root in CI, and root ignores ``chmod 000``; so besides the chmod the test makes
    ``open`` raise ``PermissionError`` for that one file, which is exactly what a non-root user
    gets. The loader's handling of the error is what is under test, not the kernel's.
    """
    real_open = builtins.open
    target = os.path.realpath(path)

    def guarded(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.path.realpath(file) == target:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)


def test_hostile_folder_scan_and_load(hostile: Path, monkeypatch):
    _unreadable(monkeypatch, hostile / "locked.txt")
    started = time.monotonic()
    items = list(iter_documents(hostile, max_bytes=4096))
    elapsed = time.monotonic() - started
    docs = {Path(d.path).name: d for d in items if isinstance(d, Document)}
    skipped = {s.rel: s.reason for s in items if isinstance(s, Skipped)}

    assert set(docs) == {
        "good.txt",
        "notes.md",
        "page.html",
        "doc.pdf",
        "zipped.txt.gz",
        "deep.rst",
        "latin.txt",
        "wide.txt",
    }
    assert skipped == {
        ".git": "ignored",
        ".hidden.txt": "hidden",
        "blob.txt": "binary",
        "empty.md": "empty",
        "escape.txt": "outside_root",
        "huge.txt": "too_large",
        "image.png": "unsupported",
        "locked.txt": "unreadable",
        "loop": "symlink_loop",
        "pipe.txt": "special",
        "secret.pdf": "encrypted",
        "self": "symlink_loop",
        "truncated.pdf": "malformed",
    }
    assert docs["latin.txt"].meta["replaced_chars"] == 2
    assert "\ufffd\ufffd" in docs["latin.txt"].text and "café" in docs["latin.txt"].text
    assert docs["wide.txt"].text == "UTF-16 text, with BOM."
    assert docs["wide.txt"].meta["encoding"] == "utf-16-le"
    assert docs["doc.pdf"].pages == ["First PDF page", "Second PDF page"]
    assert docs["page.html"].text == "# Hello\n\nWorld of HTML."
    assert docs["zipped.txt.gz"].meta["compressed"] is True
    # Bounded time: nothing blocks on the FIFO or loops through the symlinks (generous bound,
    # the walk takes milliseconds; this guards against a hang, not a performance claim).
    assert elapsed < 60


def test_chmod_000_is_unreadable_for_non_root(hostile: Path, monkeypatch):
    locked = hostile / "locked.txt"
    if os.geteuid() != 0:  # a normal user meets the real permission error
        assert _load_error(locked).reason == "unreadable"
    _unreadable(monkeypatch, locked)
    err = _load_error(locked)
    assert err.reason == "unreadable" and "permission denied" in str(err)


def test_scan_lists_files_with_real_paths_and_sizes(hostile: Path):
    result = scan(hostile)
    infos = {f.rel: f for f in result.files}
    assert infos["sub/deep.rst"] == FileInfo(
        path=os.path.realpath(hostile / "sub" / "deep.rst"),
        size=(hostile / "sub" / "deep.rst").stat().st_size,
        mtime_ns=(hostile / "sub" / "deep.rst").stat().st_mtime_ns,
        rel="sub/deep.rst",
    )
    # the scan itself does not read files: binary and empty files are found at load time
    assert "blob.txt" in infos and "empty.md" in infos
    assert result.total_bytes == sum(f.size for f in result.files)


# --------------------------------------------------------------------------------------------------
# pagination, gzip, load errors


def test_form_feeds_make_pages_and_trailing_empty_page_dropped(tmp_path: Path):
    p = tmp_path / "paged.txt"
    p.write_text("one\fpage two\n\f")
    doc = load_document(p)
    assert doc.pages == ["one", "page two"]
    assert doc.meta["paginated"] is True and doc.meta["n_pages"] == 2
    assert doc.text == "one\npage two"


def test_fixed_length_pages_detected():
    pages = []
    for n in range(1, 5):
        lines = ["", "", "demo(1)            User Commands            demo(1)", ""]
        lines += [f"       {'abcdefgh'[n]}{'pqrstuvwxyz'[k % 11]}{k // 11} line of body text" for k in range(58)]
        lines += ["", f"demo 1.0                 2024-01-0{n}                 {n}", "", ""]
        assert len(lines) == 66
        pages.append("\n".join(lines))
    text = "\n".join(pages) + "\n"
    split, paginated = paginate_text(text)
    assert paginated and len(split) == 4
    # prose with a round number of lines is left alone (no repeated edges)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta", "lambda", "zeta"]
    prose = "\n".join(f"{words[k % 10]} {words[k // 10 % 10]} {words[k // 100]} prose" for k in range(198)) + "\n"
    assert paginate_text(prose) == ([prose], False)


def test_headers_footers_stripped_and_recorded_in_meta(tmp_path: Path):
    pages = [f"Widget Manual\n\nText {'abcdefgh'[i]} of page.\n\nPage {i + 1} of 6" for i in range(6)]
    p = tmp_path / "manual.txt"
    p.write_text("\f".join(pages))
    doc = load_document(p)
    assert doc.pages == [f"Text {'abcdefgh'[i]} of page." for i in range(6)]
    assert doc.meta["furniture_removed"] == 12
    assert doc.meta["furniture_patterns"] == ["page # of #", "widget manual"]
    raw = load_document(p, clean=False)
    assert raw.meta["furniture_removed"] == 0 and raw.pages[0].startswith("Widget Manual")


def test_gzip_members(tmp_path: Path):
    md = tmp_path / "notes.md.gz"
    md.write_bytes(gzip.compress(b"# Notes\n\nzipped markdown\n"))
    doc = load_document(md)
    assert doc.text == "# Notes\n\nzipped markdown" and doc.meta["format"] == "markdown"
    pdf = tmp_path / "d.pdf.gz"
    pdf.write_bytes(gzip.compress(make_pdf(["gzipped pdf page"])))
    assert load_document(pdf).pages == ["gzipped pdf page"]
    bomb = tmp_path / "bomb.txt.gz"
    bomb.write_bytes(gzip.compress(b"a" * 100_000))
    assert _load_error(bomb, max_bytes=10_000).reason == "too_large"
    broken = tmp_path / "broken.txt.gz"
    broken.write_bytes(b"\x1f\x8b\x08\x00garbage")
    assert _load_error(broken).reason == "malformed"
    assert _load_error(tmp_path / "x.2.gz").reason == "unsupported"


def test_load_errors_have_reasons(tmp_path: Path):
    assert _load_error(tmp_path / "missing.txt").reason == "unreadable"
    (tmp_path / "blank.txt").write_text("   \n\n")
    assert _load_error(tmp_path / "blank.txt").reason == "empty"
    (tmp_path / "fake.pdf").write_text("not a pdf at all")
    assert _load_error(tmp_path / "fake.pdf").reason == "malformed"
    (tmp_path / "noext").write_text("text")
    err = _load_error(tmp_path / "noext")
    assert err.reason == "unsupported" and ".md" in str(err)
    (tmp_path / "dir.txt").mkdir()
    assert _load_error(tmp_path / "dir.txt").reason == "unsupported"
    (tmp_path / "scan.pdf").write_bytes(make_pdf([""]))
    assert _load_error(tmp_path / "scan.pdf").reason == "empty"


# --------------------------------------------------------------------------------------------------
# a folder, in batches


def test_iter_documents_strips_corpus_boilerplate(tmp_path: Path):
    for i, fruit in enumerate(["apples", "pears", "plums", "figs"]):
        (tmp_path / f"p{i}.html").write_text(
            f"<body><div class=menu>Home | Products | Contact</div><h1>{fruit}</h1><p>{fruit} text</p></body>"
        )
    docs = [d for d in iter_documents(tmp_path) if isinstance(d, Document)]
    assert [d.text for d in docs] == [f"# {f}\n\n{f} text" for f in ["apples", "pears", "plums", "figs"]]
    # Batches are judged on what was seen so far: a first batch of 2 is not yet a corpus.
    docs = [d for d in iter_documents(tmp_path, batch_size=2) if isinstance(d, Document)]
    assert [d.text.startswith("Home") for d in docs] == [True, True, False, False]


# --------------------------------------------------------------------------------------------------
# real data and import weight


@pytest.mark.shared_data
def test_shared_corpus_loads(shared_data):
    items = list(iter_documents(shared_data / "manpages"))
    docs = [d for d in items if isinstance(d, Document)]
    assert not [s for s in items if isinstance(s, Skipped)]
    pages = [d for d in docs if d.meta["format"] == "text"]
    assert len(pages) == 40
    assert all(d.meta["paginated"] and d.meta["furniture_removed"] >= 2 * (d.meta["n_pages"] - 1) for d in pages)
    assert not any("System Calls Manual" in d.text for d in pages)
    # index.json (the pages' metadata) is read as JSON now: string values with their key paths.
    (meta,) = [d for d in docs if d.meta["format"] == "json"]
    assert meta.meta["page_labels"] and not meta.meta["furniture_removed"]


def test_import_is_light():
    code = (
        "import sys, ragbudget.input.loaders, ragbudget.input.clean, ragbudget.input.formats.epub, "
        "ragbudget.input.formats.mail, ragbudget.input.formats.office, ragbudget.input.formats.tabular; "
        "bad = [m for m in ('torch', 'transformers', 'faiss', 'sentence_transformers', 'pypdfium2', 'lxml') "
        "if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_steps_names_still_resolve_here():
    # scan, decode_bytes, BoilerplateFilter... were defined in loaders until the steps became
    # modules (issue #32): the old import path gives the very same objects.
    import ragbudget.input.loaders as loaders
    from ragbudget.input import boilerplate, decode, scan as scan_module

    for module in (scan_module, decode, boilerplate):
        for name in set(module.__all__) & set(loaders.__all__):
            assert getattr(loaders, name) is getattr(module, name), name
    assert {"scan", "decode_bytes", "BoilerplateFilter", "Skipped", "IGNORED_DIRS"} <= set(loaders.__all__)


def test_docstring_examples():
    import doctest

    import ragbudget.input.loaders

    assert doctest.testmod(ragbudget.input.loaders).failed == 0


def test_guessed_encoding_is_a_warning_in_meta(tmp_path: Path):
    (tmp_path / "notes.txt").write_bytes("Un café naïve à Zürich.\n".encode("cp1252"))
    (tmp_path / "plain.txt").write_text("Un café naïve à Zürich.\n", encoding="utf-8")
    doc = load_document(tmp_path / "notes.txt")
    assert doc.text == "Un café naïve à Zürich."
    assert "decoded as cp1252" in doc.meta["encoding_warning"]
    assert "encoding_warning" not in load_document(tmp_path / "plain.txt").meta
