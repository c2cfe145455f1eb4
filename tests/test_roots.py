"""ragbudget.retrieval.roots: the paths given to a run are checked before anything is written, recorded
with labels, and every path the index shows is a display path below its root."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from _corpus import (
    EMB,
    OPTS,
    build,
    chunk_count,
    make_text,
    write_corpus,
)

from ragbudget.errors import (
    ConfigError,
    InputPathError,
)
from ragbudget.retrieval.index import Index


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture
def ix(tmp_path: Path) -> Index:
    return Index(tmp_path / "ix")


def test_missing_root_is_an_error_and_changes_nothing(ix: Index, corpus: Path, tmp_path: Path) -> None:
    build(ix, corpus)
    before, gen = chunk_count(ix), Index.open(ix.path).stats()["generation"]
    files_before = sorted(p.name for p in ix.path.iterdir())
    with pytest.raises(InputPathError, match="corpuz.*no such file") as err:
        ix.build([str(tmp_path / "corpuz")], embedder=EMB, **OPTS)
    assert isinstance(err.value, ConfigError) and "unchanged" in str(err.value)
    assert chunk_count(ix) == before and Index.open(ix.path).stats()["generation"] == gen
    assert sorted(p.name for p in ix.path.iterdir()) == files_before
    # One good path next to a missing one: still nothing is done.
    with pytest.raises(InputPathError):
        ix.build([str(corpus), str(tmp_path / "nope.txt")], embedder=EMB, **OPTS)
    assert Index.open(ix.path).stats()["generation"] == gen


def test_missing_root_into_a_new_folder_creates_nothing(tmp_path: Path) -> None:
    target = tmp_path / "new-index"
    with pytest.raises(InputPathError, match="no index was created"):
        Index(target).build([str(tmp_path / "missing")], embedder=EMB)
    assert not target.exists()


def test_special_and_unreadable_roots_are_errors(tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(InputPathError, match="not a file or folder"):
        Index(tmp_path / "ix").build([str(tmp_path / "pipe")], embedder=EMB)
    # Tests may run as root, who reads everything: refuse the folder the way the kernel would.
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, **kw: False if str(p) == str(corpus) else real_access(p, mode, **kw)
    )
    with pytest.raises(InputPathError, match="permission denied"):
        Index(tmp_path / "ix").build([str(corpus)], embedder=EMB)
    assert not (tmp_path / "ix").exists()


def test_paths_are_shown_relative_to_their_root(ix: Index, tmp_path: Path) -> None:
    notes = tmp_path / "home" / "me" / "notes"
    (notes / "deep").mkdir(parents=True)
    (notes / "deep" / "guide.txt").write_text(make_text(3, unique="guidezz"))
    (notes / "top.txt").write_text(make_text(4))
    (notes / "blob.bin").write_bytes(b"\x00" * 64)
    s = build(ix, notes)
    private = str(tmp_path)
    assert private not in json.dumps(s.to_dict())
    idx = Index.open(ix.path)
    hit = idx.search("guidezz", k=1)[0]
    assert hit.sources[0].path == "notes/deep/guide.txt"
    for h in idx.search("kaba lode", k=10) + idx.get_chunks(range(1, 100)):
        assert private not in json.dumps(h.to_dict())
    assert private not in json.dumps([f.to_dict() for f in idx.sources()])
    # Lookups take the display path (and still the absolute one).
    seq = idx.chunks_of("notes/deep/guide.txt")
    assert seq and seq == idx.chunks_of(str((notes / "deep" / "guide.txt").resolve()))
    assert idx.neighbors(seq[0][1], path="notes/deep/guide.txt")[0] is None
    assert idx.absolute_path("notes/deep/guide.txt") == str((notes / "deep" / "guide.txt").resolve())
    assert idx.absolute_path("elsewhere/x.txt") is None
    # The local opt-in: absolute paths.
    local = Index.open(ix.path, absolute_paths=True)
    assert local.search("guidezz", k=1)[0].sources[0].path == str((notes / "deep" / "guide.txt").resolve())


def test_roots_with_the_same_name_get_distinct_labels(ix: Index, tmp_path: Path) -> None:
    one = write_corpus(tmp_path / "x" / "docs", n=1)
    two = write_corpus(tmp_path / "y" / "docs", n=1, start_seed=40)
    build(ix, one)
    build(ix, two)
    assert {f.path for f in Index.open(ix.path).sources()} == {"docs/doc0.txt", "docs-2/doc0.txt"}
    # A folder inside a recorded root adds no root: paths keep their form.
    sub = one / "sub"
    sub.mkdir()
    (sub / "n.txt").write_text(make_text(77))
    build(ix, sub)
    assert "docs/sub/n.txt" in {f.path for f in Index.open(ix.path).sources()}


def _drop_roots(ix: Index) -> None:
    """Make the current generation look like one written before roots were recorded."""
    import sqlite3

    m = json.loads((ix.path / "manifest.json").read_text())
    db_path = ix.path / m["sqlite"]["file"]
    con = sqlite3.connect(db_path)
    con.execute("DROP TABLE roots")
    for col in ("n_pages", "warning"):  # the files table of that time (SQLite >= 3.35)
        con.execute(f"ALTER TABLE files DROP COLUMN {col}")
    con.commit()
    con.close()
    m["sqlite"]["bytes"] = db_path.stat().st_size
    m["sqlite"]["sha256"] = hashlib.sha256(db_path.read_bytes()).hexdigest()
    m.pop("roots", None)
    (ix.path / "manifest.json").write_text(json.dumps(m))


def test_index_without_roots_opens_with_a_fallback_and_is_upgraded(
    ix: Index, corpus: Path, caplog: pytest.LogCaptureFixture
) -> None:
    build(ix, corpus)
    _drop_roots(ix)
    with caplog.at_level("WARNING", logger="ragbudget.retrieval.index"):
        idx = Index.open(ix.path)
        assert idx.search("marker2zz", k=1)[0].sources[0].path == "corpus/doc2.txt"
        assert {f.path for f in idx.sources()} == {f"corpus/doc{i}.txt" for i in range(6)}
    assert any("records no roots" in r.getMessage() for r in caplog.records)
    assert idx.verify().ok
    s = build(ix, corpus)  # nothing changed on disk, but the roots get recorded
    assert s.committed and s.files_unchanged == 6 and s.chunks_embedded == 0
    caplog.clear()
    with caplog.at_level("WARNING", logger="ragbudget.retrieval.index"):
        assert Index.open(ix.path).roots() == ["corpus"]
        assert all(f.pages is None and f.chunks > 0 for f in Index.open(ix.path).sources())
    assert not any("records no roots" in r.getMessage() for r in caplog.records)


def test_display_paths_and_back() -> None:
    from ragbudget.retrieval.roots import Root, Roots, fallback_root, new_label

    roots = Roots([Root("/home/me/notes", "notes", "dir"), Root("/home/me/notes/deep", "deep", "dir")])
    # The most specific root wins; a path under no root shows its name alone, never its folder.
    assert roots.display("/home/me/notes/deep/a.txt") == "deep/a.txt"
    assert roots.display("/home/me/notes/b.txt") == "notes/b.txt"
    assert roots.display("/etc/secret.txt") == "secret.txt"
    assert roots.absolute("notes/x/y.md") == "/home/me/notes/x/y.md" and roots.absolute("other/y.md") is None
    assert roots.scrub("cannot read /home/me/notes/deep/a.txt") == "cannot read deep/a.txt"
    assert new_label("/a/docs/", {"docs", "docs-2"}) == "docs-3"
    assert fallback_root(["/a/b/c.txt", "/a/b/d/e.txt"]) == Root("/a/b", "b", "dir")
    file_root = Roots([Root("/a/one.txt", "one.txt", "file")])
    assert file_root.display("/a/one.txt") == "one.txt" and file_root.absolute("one.txt/x") is None


def test_check_roots_without_an_own_folder(tmp_path: Path) -> None:
    from ragbudget.retrieval.roots import check_roots

    (tmp_path / "a.txt").write_text("x")
    got = check_roots([str(tmp_path), str(tmp_path / "a.txt")], where="db://x", exists=False)
    assert got == [(str(tmp_path.resolve()), "dir"), (str((tmp_path / "a.txt").resolve()), "file")]
    with pytest.raises(InputPathError, match="no index was created in db://x"):
        check_roots([str(tmp_path / "nope")], where="db://x", exists=False)
    with pytest.raises(InputPathError, match="own folder"):
        check_roots([str(tmp_path / "a.txt")], where="here", exists=True, own_dir=tmp_path)
