"""A question scoped to some files (ragbudget.retrieval.scope): which chunks a pattern names, the
scoped search (dense exactly or through the store, BM25, fused) against brute force over the
scope, and the scope through Pipeline.search/retrieve/ask, Conversation and the server's parsing.
The CLI's ``--source`` is in test_cli.py, the server's ``sources`` end to end in test_server.py,
every storage's scoped search in the storage contract (_storage_contract.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from _corpus import EMB, build, make_text, write_corpus
from _fakes import FakeGenerator

import ragbudget.retrieval.scope as scope_mod
from ragbudget import Pipeline
from ragbudget.chat import Conversation
from ragbudget.errors import ArgumentTypeError, ConfigError
from ragbudget.retrieval.index import Index
from ragbudget.retrieval.scope import matches, source_patterns
from ragbudget.server.openai_api.errors import APIError
from ragbudget.server.openai_api.parsing import MAX_SOURCES, parse_chat, parse_retrieve

# --- patterns ---------------------------------------------------------------------------------------


def test_patterns_are_checked_and_normalized() -> None:
    assert source_patterns("reviews/a.txt") == ("reviews/a.txt",)
    assert source_patterns(["a/", " b\\c.md ", "a"]) == ("a", "b/c.md")  # trailing slash, Windows slash, repeats
    for bad, error in (("", ConfigError), ([], ConfigError), (["x", "  "], ConfigError)):
        with pytest.raises(error):
            source_patterns(bad)
    for bad_type in (b"x", 3, ["x", 4], None):
        with pytest.raises(ArgumentTypeError, match="sources"):
            source_patterns(bad_type)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pattern", "named"),
    [
        ("reviews/B001.txt", True),  # the display path
        ("B001.txt", True),  # a relative pattern matches from the right
        ("reviews", True),  # a folder: everything under it
        ("reviews/B00*.txt", True),
        ("*.txt", True),
        ("*", True),
        ("B002.txt", False),
        ("views/B001.txt", False),  # parts are whole: no substring match
        ("reviews/*.md", False),
        ("*/B001.txt/x", False),
        ("/data/corpus/reviews/B001.txt", True),  # absolute: the stored path
        ("/data/corpus/reviews/*.txt", True),
        ("/data/corpus", True),
        ("/data/other/reviews/B001.txt", False),
        ("/reviews/B001.txt", False),  # absolute patterns never read the display path
        ("reviews/B00[12].txt", True),
        ("reviews/B00[!1].txt", False),
        ("reviews/B00?.txt", True),
        ("re*/B001.txt", True),
        ("**/B001.txt", True),  # ** is one part, as PurePath.match reads it
        ("reviews/**", True),
        ("r.views", False),  # a dot is a dot
    ],
)
def test_what_a_pattern_names(pattern: str, named: bool) -> None:
    assert matches(pattern, "/data/corpus/reviews/B001.txt", "reviews/B001.txt") is named


@pytest.mark.parametrize(
    ("pattern", "named"), [("C:/data/corpus", True), ("C:/data/corpus/reviews/*.txt", True), ("C:/other", False)]
)
def test_windows_absolute_patterns_read_the_stored_path(pattern: str, named: bool) -> None:
    assert matches(pattern, "C:\\data\\corpus\\reviews\\B001.txt", "reviews/B001.txt") is named


# --- the index -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def products(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twelve "product" files in two folders, each with a unique marker, indexed once (hash
    embedder, lexical table, small chunks so each file has several)."""
    root = tmp_path_factory.mktemp("scope")
    corpus = root / "shop"
    for i in range(12):
        folder = corpus / ("kitchen" if i < 6 else "garden")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"item{i:02d}.txt").write_text(make_text(100 + i, n_paragraphs=6, unique=f"tag{i}qq"))
    build(Index(root / "ix"), corpus)
    return root


def _brute_force(ix: Index, query: str, ids: frozenset[int], k: int) -> list[int]:
    """The ``k`` chunks of ``ids`` nearest ``query`` by exact cosine, computed here from the stored rows."""
    q = EMB.embed_query(query)
    rows = {i: ix.generation.exact.vectors([i])[0] for i in ids}
    return [i for i, _ in sorted(((i, float(v @ q)) for i, v in rows.items()), key=lambda p: -p[1])[:k]]


def _files(hits: list) -> set[str]:
    return {s.path for h in hits for s in h.sources}


def test_a_scoped_search_returns_the_k_best_of_the_scope_and_nothing_else(products: Path) -> None:
    ix = Index.open(products / "ix")
    everything = ix.search("tag3qq marker", k=5)
    assert "shop/kitchen/item03.txt" in _files(everything[:1])
    scoped = ix.search("tag3qq marker", k=5, sources="item07.txt")
    assert _files(scoped) == {"shop/garden/item07.txt"}
    ids = ix.chunks_in("item07.txt")
    assert {h.chunk_id for h in scoped} == set(_brute_force(ix, "tag3qq marker", ids, 5))
    assert len(scoped) == min(5, len(ids))  # never fewer than the scope holds
    assert scoped[0].score >= scoped[-1].score
    # A folder, a glob and a list of them name the union of their files.
    assert _files(ix.search("marker", k=50, sources="kitchen")) <= {f"shop/kitchen/item{i:02d}.txt" for i in range(6)}
    assert ix.chunks_in(["item01.txt", "garden/item1*.txt"]) == ix.chunks_in("item01.txt") | ix.chunks_in(
        ["item10.txt", "item11.txt"]
    )
    assert ix.chunks_in("shop") == ix.chunks_in("*") == frozenset(ix.generation.catalog.chunk_ids().tolist())


def test_hybrid_scoped_search_fuses_within_the_scope(products: Path) -> None:
    ix = Index.open(products / "ix")
    # BM25 alone would rank item03's marker first; scoped to the garden it never appears.
    hits = ix.search("tag3qq", k=8, hybrid=True, sources="garden")
    assert hits and _files(hits) <= {f"shop/garden/item{i:02d}.txt" for i in range(6, 12)}
    lexical_first = ix.search("tag9qq", k=3, hybrid=True, sources="garden")
    assert "shop/garden/item09.txt" in _files(lexical_first[:1])


def test_a_wide_scope_searches_the_store_then_falls_back_to_exact(
    products: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ix = Index.open(products / "ix")
    ids = ix.chunks_in("kitchen")
    want = _brute_force(ix, "tag2qq marker", ids, 6)
    exact = [h.chunk_id for h in ix.search("tag2qq marker", k=6, sources="kitchen")]
    # Past the exact limit: the store's search, over-fetched and filtered (flat here: the same order).
    monkeypatch.setattr(scope_mod, "EXACT_SCOPE_MAX", 3)
    calls: list[int] = []
    store = ix.generation.search
    real = store.search

    def counted(q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        calls.append(k)
        return real(q, k)

    monkeypatch.setattr(store, "search", counted)
    through_store = [h.chunk_id for h in ix.search("tag2qq marker", k=6, sources="kitchen")]
    assert calls and calls[0] >= 6 * 2  # over-fetched by how rare the scope is
    # The same chunks (the hash embedder ties some scores, which FAISS and numpy order apart).
    assert set(through_store) == set(exact) == set(want) and len(want) == 6
    # Past the limit but under a tenth of the index: scored exactly, the store not asked.
    before = len(calls)
    assert len(ix.chunks_in("item07.txt")) * 10 < len(ix.generation.catalog.chunk_ids())
    ix.search("tag2qq marker", k=3, sources="item07.txt")
    assert len(calls) == before
    # A store that returns too few of the scope's chunks: the exact scores answer instead.
    monkeypatch.setattr(store, "search", lambda q, k: real(q, 1))
    assert [h.chunk_id for h in ix.search("tag2qq marker", k=6, sources="kitchen")] == exact


def test_bm25_in_a_scope_reads_past_the_matches_outside_it(tmp_path: Path) -> None:
    """A word common outside the scope fills the top of the whole index's BM25 ranking: the scoped
    read goes deeper until it finds the scope's own matches (it used to stop at the first depth)."""
    for folder in ("a", "b"):
        (tmp_path / "c" / folder).mkdir(parents=True)
        for i in range(30):
            # a/: short, the word three times (BM25's best); b/: the word once in a longer text.
            text = (
                "The zebra zebra zebra grazes. " if folder == "a" else make_text(700 + i, n_paragraphs=1) + " A zebra. "
            )
            (tmp_path / "c" / folder / f"f{i}.txt").write_text(text + f"Item {folder}{i}.\n")
    build(Index(tmp_path / "ix"), tmp_path / "c")
    ix = Index.open(tmp_path / "ix")
    gen = ix.generation
    top = gen.catalog.lexical("zebra", 20, trusted=True)
    assert not any(i in ix.chunks_in("b") for i, _ in top)  # the premise: the first read holds none of b's
    found = scope_mod.lexical_in(gen, "zebra", 5, ix.chunks_in("b"))
    assert len(found) == 5 and all(i in ix.chunks_in("b") for i, _ in found)


def test_scopes_resolved_from_many_threads_at_once_never_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many requests resolving and evicting kept patterns of one generation at once (a server
    asked about many products): no error from the eviction, and never more kept than the limit.
    The catalog answers at once, so that the threads meet in the cache."""
    import sys
    import threading
    from types import SimpleNamespace

    files = [f"/r/p{n}" for n in range(200)]
    catalog = SimpleNamespace(file_paths=lambda: files, sources_in=lambda path: [(int(path[4:]), None)])
    gen = SimpleNamespace(catalog=catalog)
    roots = SimpleNamespace(display=lambda path: path[1:], labels=lambda: ["r"])
    monkeypatch.setattr(scope_mod, "SCOPES_KEPT", 8)
    kept: dict = {}
    errors: list[BaseException] = []

    def ask_many(seed: int) -> None:
        try:
            for i in range(400):
                n = (seed * 37 + i) % 200
                assert scope_mod.resolve(gen, roots, (f"p{n}",), kept=kept) == {n}  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 (the test's subject: any failure)
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: a race shows
    try:
        threads = [threading.Thread(target=ask_many, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == [] and 0 < len(kept) <= 8


def test_kept_resolutions_are_bounded_by_their_ids_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    files = [f"/r/p{n}" for n in range(10)]
    catalog = SimpleNamespace(
        file_paths=lambda: files, sources_in=lambda path: [(int(path[4:]) * 100 + j, None) for j in range(100)]
    )
    roots = SimpleNamespace(display=lambda path: path[1:], labels=lambda: ["r"])
    monkeypatch.setattr(scope_mod, "SCOPE_IDS_KEPT", 250)  # room for two files' 100 chunks each
    kept: dict = {}
    for n in range(6):
        assert len(scope_mod.resolve(SimpleNamespace(catalog=catalog), roots, (f"p{n}",), kept=kept)) == 100  # type: ignore[arg-type]
    assert list(kept) == ["p4", "p5"]  # the oldest dropped first


def test_a_wrong_query_vector_is_a_config_error_scoped_too(products: Path) -> None:
    ix = Index.open(products / "ix")
    for scope in (None, "item01.txt"):
        with pytest.raises(ConfigError, match="dimension 10"):
            ix.search("x", query_vector=np.ones(10, dtype=np.float32), sources=scope)


def test_a_pattern_that_names_nothing_is_a_one_line_error(products: Path) -> None:
    ix = Index.open(products / "ix")
    with pytest.raises(ConfigError, match=r"no indexed file matches the source 'item99\.txt' \(12 files") as e:
        ix.search("x", sources=["item01.txt", "item99.txt"])
    assert "\n" not in str(e.value) and "ragbudget sources" in str(e.value)


def test_a_scope_follows_a_new_generation(products: Path, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(products, root)
    reader = Index.open(root / "ix")
    before = reader.chunks_in("kitchen")
    (root / "shop" / "kitchen" / "item99.txt").write_text(make_text(999, unique="tag99qq"))
    build(Index(root / "ix"), root / "shop")
    after = reader.chunks_in("kitchen")  # the reader follows the commit; the scope is resolved again
    assert before < after and reader.chunks_in("item99.txt") <= after
    # (The copy's files are a second root, labelled apart from the original's.)
    assert {Path(f).name for f in _files(reader.search("tag99qq", k=1, sources="kitchen"))} == {"item99.txt"}


def test_a_duplicate_kept_from_two_files_is_in_both_scopes(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", n=3)
    shutil.copy(corpus / "doc1.txt", corpus / "copy_of_doc1.txt")
    build(Index(tmp_path / "ix"), corpus)
    ix = Index.open(tmp_path / "ix")
    assert ix.chunks_in("doc1.txt") == ix.chunks_in("copy_of_doc1.txt")
    # Cited from the file asked about: its source first, the other kept after it.
    for name in ("copy_of_doc1.txt", "doc1.txt"):
        hit = ix.search("marker1zz", k=1, sources=name)[0]
        assert [s.path for s in hit.sources] == [
            f"c/{name}",
            "c/doc1.txt" if name != "doc1.txt" else "c/copy_of_doc1.txt",
        ]
    assert ix.search("marker1zz", k=1, sources="c")[0].sources == ix.search("marker1zz", k=1)[0].sources


# --- the pipeline ----------------------------------------------------------------------------------


def _pipe(products: Path, **kw: object) -> tuple[Pipeline, FakeGenerator]:
    gen = FakeGenerator()
    return Pipeline(products / "ix", generator=gen, gpu="16GiB", **kw), gen  # type: ignore[arg-type]


def test_ask_reads_searches_and_cites_only_the_scope(products: Path) -> None:
    pipe, gen = _pipe(products, evidence_floor=0)
    answer = pipe.ask("tag4qq marker", sources=["garden/item08.txt"])
    assert {s["path"] for s in answer.sources} == {"shop/garden/item08.txt"}
    assert "tag4qq" not in gen.prompts[-1].messages[-1]["content"].replace("tag4qq marker", "")
    index = answer.report["index"]
    assert index["sources"] == ["garden/item08.txt"]
    assert index["chunks_in_scope"] == len(pipe.store.chunks_in("garden/item08.txt"))
    # Unscoped, the answer's file leads, and the report names no scope.
    free = pipe.ask("tag4qq marker")
    assert free.sources[0]["path"] == "shop/kitchen/item04.txt" and "sources" not in free.report["index"]
    sel = pipe.retrieve("tag4qq marker", sources="item08.txt", context_tokens=200)
    assert sel.chunks and {s.path for c in sel.chunks for s in c.sources} == {"shop/garden/item08.txt"}
    assert _files(pipe.search("tag4qq", k=4, sources="item08.txt")) == {"shop/garden/item08.txt"}


def test_a_scope_that_does_not_hold_the_answer_is_declined_without_the_model(products: Path) -> None:
    # The evidence floor weighs the scope's sentences alone: the marker is in item04, not item08.
    pipe, gen = _pipe(products, evidence_floor=0.9)
    answer = pipe.ask("The unique marker tag4qq appears only here.", sources="item08.txt")
    assert answer.declined and not gen.prompts
    assert answer.report["index"]["sources"] == ["item08.txt"]
    found = pipe.ask("The unique marker tag4qq appears only here.", sources="kitchen")
    assert not found.declined and found.sources[0]["path"] == "shop/kitchen/item04.txt"


def test_bad_sources_fail_before_anything_runs(products: Path) -> None:
    pipe, gen = _pipe(products)
    with pytest.raises(ConfigError, match="no indexed file matches"):
        pipe.ask("tag4qq", sources="item404.txt")
    with pytest.raises(ArgumentTypeError):
        pipe.ask("tag4qq", sources=[3])  # type: ignore[list-item]
    assert not gen.prompts


def test_a_conversation_keeps_its_scope_for_every_turn(products: Path) -> None:
    pipe, _ = _pipe(products, evidence_floor=0)
    chat = Conversation(pipe, sources="item10.txt")
    for question in ("tag2qq marker?", "and tag5qq?"):
        turn = chat.ask(question)
        assert {s["path"] for s in turn.answer.sources} == {"shop/garden/item10.txt"}
        assert turn.answer.report["index"]["sources"] == ["item10.txt"]


# --- the server's parsing --------------------------------------------------------------------------


def _chat(**extra: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "is it loud?"}], **extra}


def test_the_server_reads_sources_as_a_pattern_or_a_list() -> None:
    assert parse_chat(_chat(), ["m"]).sources is None
    assert parse_chat(_chat(sources="reviews/B001.txt"), ["m"]).sources == ("reviews/B001.txt",)
    assert parse_chat(_chat(sources=["a", "b/"]), ["m"]).sources == ("a", "b")
    assert parse_retrieve({"query": "q", "k": 3, "sources": ["x/*.md"]}).sources == ("x/*.md",)
    for bad, code in (
        (3, "invalid_type"),
        (["a", None], "invalid_type"),
        ({"path": "a"}, "invalid_type"),
        ([], "invalid_value"),
        ([""], "invalid_value"),
        (["a"] * (MAX_SOURCES + 1), "invalid_value"),
        ("x" * 2000, "invalid_value"),
        ("/home/someone/reviews", "invalid_value"),  # a client never probes the server's own paths
        (["reviews", "C:\\Users"], "invalid_value"),
    ):
        with pytest.raises(APIError) as e:
            parse_chat(_chat(sources=bad), ["m"])
        assert e.value.status == 400 and e.value.param == "sources" and e.value.code == code, bad
