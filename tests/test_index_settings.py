"""An index keeps its settings: a later run uses the recorded chunking, dedup and cleaning
settings unless told otherwise, and one that would change them is refused (naming each change and
what it would re-embed) unless it says ``rechunk=True`` / ``--rechunk``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ragbudget.cli.commands import cli
from ragbudget.errors import ConfigError, IndexMismatchError
from ragbudget.retrieval.embed import HashEmbedder
from ragbudget.retrieval.index import Index
from ragbudget.retrieval.index_settings import changes, check_changes, recorded, resolve
from ragbudget.settings import DedupSettings

EMB = HashEmbedder(dim=64)
WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ra") for b in ("ba", "de", "fi", "go", "hu", "ja")]


def _corpus(root: Path, n: int = 4) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        paras = [" ".join(WORDS[(i * 7 + j * 5 + k) % len(WORDS)] for k in range(40)) + "." for j in range(6)]
        (root / f"doc{i}.txt").write_text(f"Document {i}.\n\n" + "\n\n".join(paras) + "\n")
    return root


def _manifest(ix: Index) -> dict[str, Any]:
    return json.loads((ix.path / "manifest.json").read_text())


def _max_chunk_tokens(ix: Index) -> int:
    db = Index.open(ix.path).generation.catalog.db
    return int(db.execute("SELECT MAX(n_tokens) FROM chunks").fetchone()[0])


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return _corpus(tmp_path / "pyd")


@pytest.fixture
def ix(tmp_path: Path) -> Index:
    return Index(tmp_path / "idx")


# --- the Python API ------------------------------------------------------------------------------


def test_a_plain_run_keeps_the_recorded_chunking_and_dedup(ix: Index, corpus: Path) -> None:
    first = ix.build([corpus], embedder=EMB, min_tokens=20, max_tokens=40, dedup="exact")
    assert first.chunks_total > 4
    plain = ix.build([corpus], embedder=EMB)  # no settings given: nothing changes, nothing is written
    assert not plain.committed and not plain.rebuilt and plain.chunks_embedded == 0
    m = _manifest(ix)
    assert (m["chunking"]["min_tokens"], m["chunking"]["max_tokens"], m["dedup"]["mode"]) == (20, 40, "exact")
    # A changed file is cut with the recorded sizes, not the defaults (300/500).
    (corpus / "doc0.txt").write_text((corpus / "doc0.txt").read_text() + "\n" + " ".join(WORDS * 4) + ".\n")
    edited = ix.build([corpus], embedder=EMB)
    assert edited.committed and not edited.rebuilt and edited.files_updated == 1
    assert _max_chunk_tokens(ix) <= 40
    assert _manifest(ix)["chunking"] == m["chunking"] and _manifest(ix)["dedup"] == m["dedup"]


def test_a_changing_run_is_refused_naming_the_change_and_its_cost(ix: Index, corpus: Path) -> None:
    ix.build([corpus], embedder=EMB, min_tokens=20, max_tokens=40)
    before = _manifest(ix)
    with pytest.raises(IndexMismatchError) as err:
        ix.build([corpus], embedder=EMB, max_tokens=80)
    msg = str(err.value)
    chunks, files = before["counts"]["chunks"], before["counts"]["files"]
    assert "max_tokens 40 -> 80" in msg and "min_tokens" not in msg  # only what changes
    assert f"re-chunks its {files} indexed file(s) and re-embeds up to {chunks} chunk(s)" in msg
    assert "--rechunk" in msg and "Nothing was changed" in msg and "\n" not in msg
    assert _manifest(ix) == before  # refused before anything was written
    applied = ix.build([corpus], embedder=EMB, max_tokens=80, rechunk=True)
    assert applied.rebuilt and "max_tokens 40 -> 80" in applied.rebuild_reason
    assert _manifest(ix)["chunking"]["max_tokens"] == 80 and _manifest(ix)["chunking"]["min_tokens"] == 20
    # rebuild=True re-embeds everything anyway: it may change settings too.
    again = ix.build([corpus], embedder=EMB, max_tokens=60, rebuild=True)
    assert again.rebuilt and _manifest(ix)["chunking"]["max_tokens"] == 60


def test_a_dedup_change_says_it_re_embeds_nothing_and_does_so(ix: Index, tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "c", n=2)
    (corpus / "copy.txt").write_text((corpus / "doc0.txt").read_text())  # exact duplicates
    ix.build([corpus], embedder=EMB, min_tokens=20, max_tokens=40, dedup="exact")
    with pytest.raises(
        IndexMismatchError,
        match=r"dedup exact -> none\): that re-chunks its 3 indexed file\(s\) "
        r"and re-embeds no chunk",
    ):
        ix.build([corpus], embedder=EMB, dedup="none")
    s = ix.build([corpus], embedder=EMB, dedup="none", rechunk=True)
    assert s.rebuilt and s.chunks_embedded == 0 and s.chunks_total > _manifest(ix)["counts"]["files"]


def test_near_dedup_keeps_its_recorded_threshold(ix: Index, corpus: Path) -> None:
    ix.build([corpus], embedder=EMB, min_tokens=20, max_tokens=40, near_threshold=0.9, num_perm=64)
    assert not ix.build([corpus], embedder=EMB, dedup="near").committed  # the mode alone: same test
    assert _manifest(ix)["dedup"] == {"mode": "near", "threshold": 0.9, "num_perm": 64, "shingle": 1}
    with pytest.raises(IndexMismatchError, match=r"near_threshold 0.9 -> 0.8"):
        ix.build([corpus], embedder=EMB, near_threshold=0.8)


def test_an_index_from_before_the_shingle_was_recorded_keeps_its_3_word_shingles(ix: Index, corpus: Path) -> None:
    # Its stored signatures hash 3-word shingles: new chunks must be hashed alike to be compared.
    ix.build([corpus], embedder=EMB, min_tokens=20, max_tokens=40, dedup=DedupSettings(shingle=3))
    m = _manifest(ix)
    del m["dedup"]["shingle"]
    (ix.path / "manifest.json").write_text(json.dumps(m))
    assert recorded(m)["dedup"]["shingle"] == 3
    assert resolve(m)[0]["dedup"]["shingle"] == 3 and changes(m, resolve(m)[0]) == {}
    assert not ix.build([corpus], embedder=EMB).committed  # neither refused nor rebuilt
    (corpus / "more.txt").write_text("A new file about something the corpus never mentions.\n")
    assert ix.build([corpus], embedder=EMB).committed
    assert _manifest(ix)["dedup"]["shingle"] == 3  # recorded now, still 3
    with pytest.raises(IndexMismatchError, match="shingle 3 -> 1"):
        ix.build([corpus], embedder=EMB, dedup=DedupSettings())
    # A manifest without near dedup has no shingle to keep.
    assert recorded({"dedup": {"mode": "exact", "threshold": None, "num_perm": None}})["dedup"]["shingle"] is None


def test_cleaning_is_recorded_and_kept(ix: Index, corpus: Path) -> None:
    ix.build([corpus], embedder=EMB, min_tokens=20, max_tokens=40, clean=False)
    assert _manifest(ix)["cleaning"] == {"clean": False}
    assert Index.open(ix.path).stats()["cleaning"] == {"clean": False}
    assert not ix.build([corpus], embedder=EMB).committed
    with pytest.raises(IndexMismatchError, match="clean False -> True"):
        ix.build([corpus], embedder=EMB, clean=True)


def test_an_index_from_before_cleaning_was_recorded_is_neither_refused_nor_rebuilt(ix: Index, corpus: Path) -> None:
    ix.build([corpus], embedder=EMB, min_tokens=20, max_tokens=40)
    m = _manifest(ix)
    del m["cleaning"]
    (ix.path / "manifest.json").write_text(json.dumps(m))
    assert not ix.build([corpus], embedder=EMB).committed
    assert not ix.build([corpus], embedder=EMB, clean=True).committed  # what it was built with


def test_a_given_size_is_checked_against_the_recorded_ones(ix: Index, corpus: Path) -> None:
    ix.build([corpus], embedder=EMB, min_tokens=20, max_tokens=40)
    with pytest.raises(ConfigError, match=r"min_tokens must be between 0 and max_tokens \(40\).*records max_tokens=40"):
        ix.build([corpus], embedder=EMB, min_tokens=100, rechunk=True)


def test_a_tokenizer_recorded_only_by_name_must_be_passed_again(ix: Index, corpus: Path) -> None:
    def words(text: str) -> list[int]:
        return [len(w) for w in text.split()]

    ix.build([corpus], embedder=EMB, min_tokens=20, max_tokens=40, tokenizer=words)
    assert _manifest(ix)["chunking"]["tokenizer"] == "words"
    with pytest.raises(ConfigError, match="chunked with tokenizer 'words'.*pass the same tokenizer"):
        ix.build([corpus], embedder=EMB)
    assert not ix.build([corpus], embedder=EMB, tokenizer=words).committed
    # What the message offers instead works: the default tokenizer, by name, with rechunk.
    s = ix.build([corpus], embedder=EMB, tokenizer="cl100k_base", rechunk=True)
    assert s.rebuilt and "tokenizer words -> cl100k_base" in s.rebuild_reason


def test_resolve_and_changes_without_an_index() -> None:
    settings, tok = resolve(None)
    assert settings["chunking"] == {"min_tokens": 300, "max_tokens": 500, "overlap": 0, "tokenizer": tok.name}
    assert settings["dedup"] == {"mode": "near", "threshold": 0.8, "num_perm": 128, "shingle": 1}
    # sentences not given: None, and the builder keeps what the index has (none for a new one)
    assert settings["cleaning"] == {"clean": True} and settings["sentences"] is None
    assert changes(None, settings) == {}
    check_changes(None, settings, allowed=False)  # a new index: nothing to refuse
    assert recorded({"dedup": {"mode": "exact", "threshold": None, "num_perm": None}})["dedup"]["mode"] == "exact"


def test_changes_name_the_near_test_only_when_both_sides_have_one() -> None:
    old = {"dedup": {"mode": "near", "threshold": 0.8, "num_perm": 128}}
    assert changes(old, resolve(old, dedup="exact")[0]) == {"dedup": ["dedup near -> exact"]}
    assert changes(old, resolve(old, num_perm=64)[0]) == {"dedup": ["num_perm 128 -> 64"]}


# --- the CLI: the tester's session -------------------------------------------------------------


def _index(runner: CliRunner, index_dir: Path, *args: str) -> Any:
    return runner.invoke(cli, ["index", *args, "--index-dir", str(index_dir), "--embedder", "hash:64", "--json"])


def test_cli_index_keeps_its_settings_and_needs_rechunk_to_change_them(tmp_path: Path) -> None:
    runner = CliRunner()
    pyd, idx = _corpus(tmp_path / "pyd"), tmp_path / "idx"
    first = _index(runner, idx, str(pyd), "--max-tokens", "40", "--min-tokens", "20")
    assert first.exit_code == 0, first.output
    n_chunks = json.loads(first.stdout)["chunks_total"]
    # The tester's second command: a dedup change is refused, in one line, naming it and its cost.
    refused = _index(runner, idx, str(pyd), "--dedup", "exact")
    assert refused.exit_code == 1 and refused.output.startswith("Error: ") and refused.output.count("\n") == 1
    assert "dedup near -> exact" in refused.output and "--rechunk" in refused.output
    assert "Traceback" not in refused.output
    # A plain run re-chunks nothing and re-embeds nothing: the recorded 20/40 hold.
    plain = _index(runner, idx, str(pyd))
    assert plain.exit_code == 0, plain.output
    out = json.loads(plain.stdout)
    assert not out["rebuilt"] and out["chunks_embedded"] == 0 and out["chunks_total"] == n_chunks
    stats = json.loads(runner.invoke(cli, ["stats", "--index-dir", str(idx), "--json"]).stdout)
    chunking, dedup = stats["chunking"], stats["dedup"]
    assert (chunking["min_tokens"], chunking["max_tokens"], dedup["mode"]) == (20, 40, "near")
    # --rechunk applies it; the next plain run keeps the new setting.
    applied = _index(runner, idx, str(pyd), "--dedup", "exact", "--rechunk")
    assert applied.exit_code == 0, applied.output
    out = json.loads(applied.stdout)
    assert out["rebuilt"] and "dedup near -> exact" in out["rebuild_reason"]
    again = _index(runner, idx, str(pyd))
    assert again.exit_code == 0 and not json.loads(again.stdout)["rebuilt"]
    stats = json.loads(runner.invoke(cli, ["stats", "--index-dir", str(idx), "--json"]).stdout)
    assert stats["dedup"]["mode"] == "exact" and stats["chunking"]["max_tokens"] == 40
    assert "--rechunk" in runner.invoke(cli, ["index", "--help"]).output
