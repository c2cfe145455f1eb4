"""Scanning: include/exclude globs, links, folders left out or another index's, skip records.

The hostile folder (FIFOs, loops, unreadable files) is scanned and loaded in tests/test_loaders.py.
"""

from __future__ import annotations

from pathlib import Path

from ragbudget.input.scan import FORMATS, SUPPORTED_EXTENSIONS, Skipped, format_of, scan


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


def test_format_of_reads_the_name_gzipped_or_not_in_any_case() -> None:
    assert format_of("README.MD") == ("markdown", False)
    assert format_of("notes.txt.gz") == ("text", True)
    assert format_of("deck.pptx.GZ") == ("pptx", True)
    assert format_of("archive.tar.gz") is None and format_of("noext") is None
    # every format is read under every name it has, and nothing else is
    assert frozenset(FORMATS) == SUPPORTED_EXTENSIONS
    assert all(format_of(f"x{ext}") == (fmt, False) for ext, fmt in FORMATS.items())
