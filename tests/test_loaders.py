"""Loading: scanning hostile folders, decoding, pagination, formats, corpus boilerplate."""

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
from hypothesis import assume, given, settings, strategies as st

from ragbudget.errors import LoadError
from ragbudget.input.loaders import (
    BoilerplateFilter,
    FileInfo,
    Skipped,
    decode_bytes,
    iter_documents,
    load_document,
    paginate_text,
    scan,
    strip_corpus_boilerplate,
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


def test_scan_include_exclude_and_links(tmp_path: Path):
    (tmp_path / "a.md").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    (tmp_path / "drafts").mkdir()
    (tmp_path / "drafts" / "c.md").write_text("c")
    (tmp_path / "alias.md").symlink_to(tmp_path / "a.md")
    only_md = scan(tmp_path, include=["*.md"], exclude=["drafts/*"])
    assert [f.rel for f in only_md.files] == ["a.md"]
    reasons = {s.rel: s.reason for s in only_md.skipped}
    assert reasons == {"alias.md": "duplicate", "b.txt": "excluded", "drafts": "excluded"}
    pruned = scan(tmp_path, exclude=["drafts"])
    assert {s.rel: s.reason for s in pruned.skipped} == {"alias.md": "duplicate", "drafts": "excluded"}
    no_links = scan(tmp_path, follow_symlinks=False)
    assert {s.rel: s.reason for s in no_links.skipped} == {"alias.md": "symlink"}
    # a file given directly, and a missing path
    direct = scan([tmp_path / "b.txt", tmp_path / "nope"])
    assert [f.rel for f in direct.files] == ["b.txt"]
    assert [s.reason for s in direct.skipped] == ["missing"]


def test_scan_walks_past_a_left_out_folder_without_a_word(tmp_path: Path):
    (tmp_path / "a.md").write_text("a")
    own = tmp_path / "idx"
    own.mkdir()
    for name in ("manifest.json", "meta.1.sqlite", "lock", "meta.2.sqlite.tmp", "notes.md"):
        (own / name).write_text("x")
    (tmp_path / "alias").symlink_to(own)  # another way in: the same folder
    (tmp_path / ".ragbudget").mkdir()  # an index folder that is not this one: listed as before
    found = scan(tmp_path, leave_out=[own])
    assert [f.rel for f in found.files] == ["a.md"]
    assert {s.rel: s.reason for s in found.skipped} == {".ragbudget": "ignored"}
    # Given as a root, or a file inside it given as one: nothing either.
    direct = scan([own, own / "notes.md", tmp_path / "a.md"], leave_out=[str(own)])
    assert [f.rel for f in direct.files] == ["a.md"] and direct.skipped == []
    # Without it, the folder is another index's (manifest, lock, a generation's SQLite file):
    # skipped whole as "ignored", never read.
    other = scan(tmp_path)
    assert [f.rel for f in other.files] == ["a.md"]
    assert {s.rel: s.reason for s in other.skipped} == {".ragbudget": "ignored", "alias": "ignored", "idx": "duplicate"}
    assert "a ragbudget index folder" in {s.detail for s in other.skipped}
    # A folder that merely holds a manifest.json is no index: its files are read.
    (own / "lock").unlink()
    assert any(f.rel.endswith("/manifest.json") for f in scan(tmp_path).files)


def test_skipped_is_printable_for_the_cli():
    s = Skipped(path="/x/y.bin", reason="binary", detail="NUL bytes", rel="y.bin")
    assert str(s) == "/x/y.bin: binary (NUL bytes)"
    assert s.to_dict() == {"path": "/x/y.bin", "rel": "y.bin", "reason": "binary", "detail": "NUL bytes"}


# --------------------------------------------------------------------------------------------------
# decoding


@pytest.mark.parametrize(
    ("data", "encoding", "text"),
    [
        ("naïve café".encode("utf-8-sig"), "utf-8", "naïve café"),
        ("naïve café".encode("utf-16"), "utf-16-le", "naïve café"),
        ("naïve café".encode("utf-16-be"), "utf-16-be", "naïve café"),  # no BOM: NUL pattern
        ("naïve café".encode("utf-16-le"), "utf-16-le", "naïve café"),
        ("naïve café".encode("utf-32"), "utf-32-le", "naïve café"),
        (
            "Café, naïve — “quoted” text for the detector.".encode("cp1252"),
            "cp1252",
            "Café, naïve — “quoted” text for the detector.",
        ),
    ],
)
def test_decode_bytes(data, encoding, text):
    assert decode_bytes(data) == (text, encoding, 0)


def test_invalid_utf8_is_replaced_and_counted():
    text, enc, replaced = decode_bytes(b"caf\xc3\xa9 \x80\x81 ok \xff")
    assert (text, enc, replaced) == ("café \ufffd\ufffd ok \ufffd", "utf-8", 3)


def test_binary_detection():
    with pytest.raises(LoadError) as info:
        decode_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00" * 100, path="a.out")
    assert info.value.reason == "binary"


# --------------------------------------------------------------------------------------------------
# pagination and formats


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


def test_html_main_text_headings_lists(tmp_path: Path):
    p = tmp_path / "page.htm"
    p.write_bytes(
        b"<!DOCTYPE html><html><head><meta charset='iso-8859-1'><title>Site</title>"
        b"<style>p{color:red}</style></head><body>"
        b"<header><a href='/'>Home</a> <a href='/b'>Blog</a></header>"
        b"<nav><ul><li>Menu</li></ul></nav>"
        b"<main><article><header><h1>Caf\xe9 review</h1><p>by Ann</p></header>"
        b"<h2>Coffee</h2><p>Strong <b>and</b> hot.</p><ul><li>one</li><li>two</li></ul>"
        b"<pre>code  keeps\n  spacing</pre><script>alert(1)</script>"
        b"<table><tr><td>a</td><td>b</td></tr></table></article></main>"
        b"<aside>Related posts</aside><footer>Copyright</footer></body></html>"
    )
    doc = load_document(p)
    assert doc.text == (
        "# Café review\n\nby Ann\n\n## Coffee\n\nStrong and hot.\n\n- one\n- two\n\ncode  keeps\n  spacing\n\na | b"
    )
    assert doc.meta["format"] == "html" and doc.meta["title"] == "Site"
    assert doc.meta["encoding"] == "iso8859-1"
    assert doc.meta["paginated"] is False


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


# --------------------------------------------------------------------------------------------------
# corpus boilerplate


def _site(n: int) -> list[Document]:
    words = ["apples", "pears", "plums", "figs", "kiwis", "limes"]
    return [
        Document(
            path=f"{i}.html",
            pages=[f"Home | Products | Contact\n# About {words[i]}\n{words[i]} are good.\nShare on Mastodon"],
            meta={"format": "html"},
        )
        for i in range(n)
    ]


def test_corpus_boilerplate_removed_across_documents():
    out = strip_corpus_boilerplate(_site(5))
    assert [d.text for d in out][:2] == ["# About apples\napples are good.", "# About pears\npears are good."]
    assert out[0].meta["boilerplate_removed"] == 2
    # two documents are not a corpus: nothing is judged boilerplate
    assert [d.text for d in strip_corpus_boilerplate(_site(2))] == [d.text for d in _site(2)]


def test_corpus_boilerplate_is_per_format_and_keeps_numbers():
    versions = [
        Document(path=f"c{v}.txt", pages=[f"Constitution (v1.{v})\n\nText {v}."], meta={"format": "text"})
        for v in range(6)
    ]
    assert strip_corpus_boilerplate(versions) == versions
    mixed = _site(4) + [Document(path="x.txt", pages=["Home | Products | Contact\nplain"], meta={"format": "text"})]
    out = strip_corpus_boilerplate(mixed)
    assert out[-1].text == "Home | Products | Contact\nplain"


def test_boilerplate_filter_in_batches_and_roundtrip():
    filt = BoilerplateFilter()
    docs = _site(6)
    filt.observe(docs[:3])
    first = [filt.strip(d) for d in docs[:3]]
    assert all(not d.text.startswith("Home") for d in first)
    again = BoilerplateFilter.from_dict(filt.to_dict())
    assert again.patterns("html") == filt.patterns("html") == {"home | products | contact", "share on mastodon"}
    # a one-document-only line is never boilerplate, whatever the thresholds
    with pytest.raises(ValueError):
        BoilerplateFilter(min_docs=1)


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
        "import sys, ragbudget.input.loaders, ragbudget.input.clean; "
        "bad = [m for m in ('torch', 'transformers', 'faiss', 'sentence_transformers', 'pypdfium2', 'lxml') "
        "if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_docstring_examples():
    import doctest

    import ragbudget.input.loaders

    assert doctest.testmod(ragbudget.input.loaders).failed == 0


_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cs"), blacklist_characters="\ufffd\ufeff"),
    min_size=1,
    max_size=60,
)


@settings(max_examples=100, deadline=None)
@given(_TEXT, st.lists(st.integers(min_value=0, max_value=200), max_size=5))
def test_invalid_bytes_are_counted_never_dropped(text, cuts):
    # 0xFF is never valid UTF-8; inserted between characters of a text that has real multi-byte
    # UTF-8, each one must come back as exactly one counted U+FFFD.
    assume(any(ord(c) > 127 for c in text))
    positions = sorted({min(c, len(text)) for c in cuts})
    pieces, prev = [], 0
    for pos in positions:
        pieces.append(text[prev:pos].encode("utf-8"))
        prev = pos
    pieces.append(text[prev:].encode("utf-8"))
    bad = b"\xff".join(pieces)
    assume(not bad.startswith((b"\xff\xfe", b"\xfe\xff")))
    try:
        decoded, encoding, replaced = decode_bytes(bad)
    except LoadError as exc:  # the NUL/UTF-16 heuristics may call odd inputs binary; never crash
        assert exc.reason == "binary"
        return
    assert encoding == "utf-8"
    assert replaced == len(positions)
    assert decoded.replace("\ufffd", "") == text


def test_deeply_nested_html_is_malformed_not_a_crash(tmp_path: Path):
    p = tmp_path / "deep.html"
    p.write_text("<div>" * 20000 + "x" + "</div>" * 20000)
    try:
        doc = load_document(p)
    except LoadError as exc:
        assert exc.reason in ("malformed", "empty")
    else:
        assert "x" in doc.text


# Short Western texts give the detector almost nothing: it ranked mac_latin2, cp775 or even
# UTF-16 level with cp1252 and turned "café" into "cafť" or "Zürich" into CJK.
@pytest.mark.parametrize(
    "text",
    [
        "café",
        "naïve",
        "Zürich",
        "We met at the café.\n",
        "Meeting in Zürich\n",
        "Un café naïve à Zürich.",
        "The café in Zürich served a naïve crème brûlée.\n",
    ],
)
@pytest.mark.parametrize("legacy", ["cp1252", "latin-1"])
def test_weak_guesses_prefer_western_code_pages(text, legacy):
    decoded, encoding, replaced = decode_bytes(text.encode(legacy))
    assert decoded == text and replaced == 0
    assert encoding in ("cp1252", "latin_1")


@pytest.mark.parametrize(
    ("text", "legacy"),
    [
        ("Привет, как дела? Это простой текст на русском языке для проверки кодировки.\n", "cp1251"),
        ("Καλημέρα, αυτό είναι ένα απλό ελληνικό κείμενο για δοκιμή.\n", "cp1253"),
        ("Příliš žluťoučký kůň úpěl ďábelské ódy.\n", "cp1250"),
    ],
)
def test_clear_non_western_text_keeps_its_code_page(text, legacy):
    assert decode_bytes(text.encode(legacy)) == (text, legacy, 0)


def test_guessed_encoding_is_a_warning_in_meta(tmp_path: Path):
    (tmp_path / "notes.txt").write_bytes("Un café naïve à Zürich.\n".encode("cp1252"))
    (tmp_path / "plain.txt").write_text("Un café naïve à Zürich.\n", encoding="utf-8")
    doc = load_document(tmp_path / "notes.txt")
    assert doc.text == "Un café naïve à Zürich."
    assert "decoded as cp1252" in doc.meta["encoding_warning"]
    assert "encoding_warning" not in load_document(tmp_path / "plain.txt").meta
