"""ragbudget.retrieval.changes: what a run changes — unchanged, touched, changed and deleted files;
runs add, removal is scoped to the given roots and guarded; a rebuild re-reads every root; a
file skipped for a missing dependency is retried once it is installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _corpus import (
    build,
    chunk_count,
    make_text,
    paths_in_index,
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


def test_unchanged_rerun_embeds_nothing_and_commits_nothing(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    s = build(ix, corpus)
    assert not s.committed and s.chunks_embedded == 0 and s.files_unchanged == 6
    assert s.files_indexed == 0 and s.generation == 1


def test_touched_file_is_not_re_embedded(ix: Index, corpus: Path) -> None:
    first = build(ix, corpus)
    st_ = (corpus / "doc2.txt").stat()
    os.utime(corpus / "doc2.txt", ns=(st_.st_atime_ns, st_.st_mtime_ns + 5_000_000_000))
    s = build(ix, corpus)
    assert s.chunks_embedded == 0 and s.files_unchanged == 6 and s.files_indexed == 0
    assert s.chunks_total == first.chunks_total
    # ... and the new mtime is recorded, so the next run is a pure stat again.
    assert not build(ix, corpus).committed


def test_changed_file_replaces_only_its_chunks(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    before = {
        h.chunk_id for h in Index.open(ix.path).get_chunks(range(1, 1000)) if not h.sources[0].path.endswith("doc1.txt")
    }
    text = (corpus / "doc1.txt").read_text()
    (corpus / "doc1.txt").write_text(text + "\nA brand new closing paragraph mentions quokkazz twice, quokkazz.\n")
    s = build(ix, corpus)
    assert s.files_indexed == 1 and s.files_unchanged == 5
    # Only chunks whose text changed are embedded: the earlier paragraphs keep their vectors.
    assert 1 <= s.chunks_embedded < 4
    after = Index.open(ix.path)
    kept = {h.chunk_id for h in after.get_chunks(range(1, 1000))}
    assert before <= kept
    assert "quokkazz" in after.search("quokkazz", k=1)[0].text
    assert after.verify().ok


def test_deleted_file_disappears(ix: Index, corpus: Path) -> None:
    build(ix, corpus)
    (corpus / "doc4.txt").unlink()
    s = build(ix, corpus)
    assert s.files_removed == 1 and s.chunks_removed > 0 and s.chunks_embedded == 0
    after = Index.open(ix.path)
    assert not any(p.endswith("doc4.txt") for p in paths_in_index(after))
    assert after.verify().ok


def test_indexing_a_second_folder_adds_to_the_first(ix: Index, tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a", n=3)
    b = write_corpus(tmp_path / "b", n=2, start_seed=50)
    build(ix, a)
    s = build(ix, b)
    assert s.files_added == 2 and s.files_removed == 0 and s.files_kept == 3
    idx = Index.open(ix.path)
    shown = {f.path for f in idx.sources()}
    assert shown == {"a/doc0.txt", "a/doc1.txt", "a/doc2.txt", "b/doc0.txt", "b/doc1.txt"}
    assert idx.roots() == ["a", "b"] and idx.stats()["roots"] == ["a", "b"]
    assert "marker1zz" in idx.search("marker1zz", k=1)[0].text
    assert idx.verify().ok


def test_removal_is_scoped_to_the_given_roots(ix: Index, tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a", n=6)
    b = write_corpus(tmp_path / "b", n=6, start_seed=50)
    build(ix, a)
    build(ix, b)
    (a / "doc1.txt").unlink()
    (b / "doc2.txt").unlink()
    s = build(ix, b)  # only b's vanished file goes; a's is kept until a is indexed again
    assert s.files_removed == 1 and s.files_kept == 6
    shown = {f.path for f in Index.open(ix.path).sources()}
    assert "b/doc2.txt" not in shown and "a/doc1.txt" in shown
    s = build(ix, a)
    assert s.files_removed == 1 and "a/doc1.txt" not in {f.path for f in Index.open(ix.path).sources()}
    # A single-file root scopes removal to that file.
    single = tmp_path / "single.txt"
    single.write_text(make_text(99, unique="singlezz"))
    build(ix, single)
    assert "single.txt" in {f.path for f in Index.open(ix.path).sources()}
    assert Index.open(ix.path).verify().ok


def test_prune_mirrors_exactly_the_given_paths(ix: Index, tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a", n=2)
    b = write_corpus(tmp_path / "b", n=2, start_seed=50)
    build(ix, a)
    build(ix, b)
    s = build(ix, b, prune=True)
    assert s.files_removed == 2 and s.files_kept == 0
    idx = Index.open(ix.path)
    assert {f.path for f in idx.sources()} == {"b/doc0.txt", "b/doc1.txt"}
    assert idx.roots() == ["b"]  # a root left without files is forgotten
    assert idx.verify().ok


def test_mass_removal_needs_an_explicit_flag(ix: Index, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", n=20)
    build(ix, corpus)
    gen = Index.open(ix.path).stats()["generation"]
    for i in range(6):  # 6 files (> 5) and 30 % (> 20 %)
        (corpus / f"doc{i}.txt").unlink()
    with pytest.raises(ConfigError, match=r"remove 6 of the 20 indexed file\(s\).*--allow-removal"):
        build(ix, corpus)
    assert Index.open(ix.path).stats()["generation"] == gen and chunk_count(ix) > 0
    s = build(ix, corpus, allow_removal=True)
    assert s.files_removed == 6 and s.committed
    # A few deletions are everyday editing: no flag needed.
    (corpus / "doc6.txt").unlink()
    assert build(ix, corpus).files_removed == 1


def test_emptied_root_never_empties_the_index(ix: Index, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "mnt", n=2)
    build(ix, corpus)
    for p in corpus.iterdir():  # an unmounted drive: the folder is there, its files are not
        p.unlink()
    before = chunk_count(ix)
    with pytest.raises(ConfigError, match="remove all 2 indexed"):
        build(ix, corpus)
    assert chunk_count(ix) == before
    s = build(ix, corpus, prune=True)  # the explicit mirror may empty it
    assert s.files_removed == 2 and s.chunks_total == 0


def test_rebuild_keeps_every_root_and_needs_them_all(ix: Index, tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a", n=2)
    b = write_corpus(tmp_path / "b", n=2, start_seed=50)
    build(ix, a)
    build(ix, b)
    s = build(ix, b, rebuild=True)
    assert s.rebuilt and s.files_indexed == 4 and s.files_removed == 0
    assert len(Index.open(ix.path).sources()) == 4
    # A settings change rebuilds too: still every root.
    s = build(ix, b, max_tokens=80, rechunk=True)
    assert s.rebuilt and len(Index.open(ix.path).sources()) == 4
    shutil.rmtree(a)
    with pytest.raises(InputPathError, match="'a'"):
        build(ix, b, max_tokens=80, rebuild=True)
    s = build(ix, b, max_tokens=80, rebuild=True, prune=True)
    assert {f.path for f in Index.open(ix.path).sources()} == {"b/doc0.txt", "b/doc1.txt"}


def test_files_under_an_unreadable_folder_are_kept(ix: Index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = write_corpus(tmp_path / "c", n=2)
    write_corpus(corpus / "sub", n=2, start_seed=30)
    build(ix, corpus)
    real_scandir = os.scandir

    def refusing(path):  # type: ignore[no-untyped-def]
        if str(path).endswith("sub"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    s = build(ix, corpus)
    assert s.files_removed == 0 and any(r == "unreadable" for _, r, _ in s.skipped)
    assert {"c/sub/doc0.txt", "c/sub/doc1.txt"} <= {f.path for f in Index.open(ix.path).sources()}


_RUN_WITH_DOCX = textwrap.dedent(
    """
    import json, sys
    if sys.argv[3] == "absent":
        # python-docx uninstalled, as far as this process can tell: `import docx` raises ImportError.
        sys.modules["docx"] = None
    from ragbudget.retrieval.embed import HashEmbedder
    from ragbudget.retrieval.index import Index
    s = Index(sys.argv[1]).build([sys.argv[2]], embedder=HashEmbedder(dim=64), min_tokens=20, max_tokens=120)
    print(json.dumps(s.to_dict()))
    """
)


def _build_in_child(ix: Index, corpus: Path, docx: str) -> dict:  # type: ignore[type-arg]
    out = subprocess.run(
        [sys.executable, "-c", _RUN_WITH_DOCX, str(ix.path), str(corpus), docx],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("touch", [False, True])
def test_a_file_skipped_for_a_missing_extra_is_retried_once_it_is_installed(
    ix: Index, tmp_path: Path, touch: bool
) -> None:
    pytest.importorskip("docx")
    corpus = write_corpus(tmp_path / "c", n=2)
    shutil.copy(Path(__file__).parent / "data" / "formats" / "social-contract.docx", corpus / "contract.docx")
    first = _build_in_child(ix, corpus, "absent")
    assert first["files_added"] == 2
    assert [(Path(s["path"]).name, s["reason"]) for s in first["skipped"]] == [("contract.docx", "missing_dependency")]
    assert "ragbudget[office]" in first["skipped"][0]["detail"]
    # Still missing: the skip stands, and nothing is re-read or written.
    still = _build_in_child(ix, corpus, "absent")
    assert not still["committed"] and still["files_unchanged"] == 2 and len(still["skipped"]) == 1
    if touch:  # a touched file is the same file: its skip stood on that alone before
        os.utime(corpus / "contract.docx", ns=(time.time_ns(), time.time_ns() + 10**9))
    # Installed: read now, though the file is unchanged.
    after = _build_in_child(ix, corpus, "present")
    assert after["committed"] and after["files_added"] == 1 and after["skipped"] == []
    assert any(f.path.endswith("contract.docx") and f.status == "indexed" for f in Index.open(ix.path).sources())
    assert Index.open(ix.path).search("Debian will remain 100% free", k=1)[0].sources[0].path.endswith(".docx")
    assert not _build_in_child(ix, corpus, "present")["committed"]  # and once only


def test_a_plan_on_its_own(tmp_path: Path) -> None:
    """plan_changes against a catalog, without a run: new files to read, then nothing, then a
    removal recorded in the catalog; the guard refuses to empty it."""
    from ragbudget.retrieval.catalog import SqliteCatalogWriter
    from ragbudget.retrieval.changes import plan_changes
    from ragbudget.retrieval.roots import Root

    corpus = write_corpus(tmp_path / "c", n=3)
    catalog = SqliteCatalogWriter.create(tmp_path / "meta.1.sqlite.tmp")
    given = [(str(corpus.resolve()), "dir")]

    def plan(**kw: bool):  # type: ignore[no-untyped-def]
        opts = {"prune": False, "allow_removal": False, **kw}
        return plan_changes(catalog, previous=None, given=given, paths=[str(corpus)], **opts)

    first = plan()
    assert [Path(p).name for p, *_ in first.todo] == ["doc0.txt", "doc1.txt", "doc2.txt"]
    assert first.roots == [Root(str(corpus.resolve()), "c", "dir")] and first.changed and first.seen == 3
    for path, size, mtime_ns, _ in first.todo:
        catalog.record_file(path, size, mtime_ns, None, "indexed", n_chunks=1)
    catalog.set_roots(first.roots)
    again = plan()
    assert again.todo == [] and again.unchanged == 3 and not again.changed
    (corpus / "doc1.txt").unlink()
    gone = plan()
    assert (
        gone.removed == 1
        and gone.changed
        and sorted(Path(p).name for p in catalog.file_states())
        == [
            "doc0.txt",
            "doc2.txt",
        ]
    )
    for p in corpus.iterdir():
        p.unlink()
    with pytest.raises(ConfigError, match="remove all 2 indexed"):
        plan()
    assert plan(allow_removal=True).removed == 2
