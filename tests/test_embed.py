"""Embedders: shapes, normalization, windowing that covers every token, pooling that sees the tail."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragbudget.embed import (
    EmbedResult,
    HashEmbedder,
    SentenceTransformerEmbedder,
    embedder_from_spec,
)
from ragbudget.errors import ConfigError

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
    e = SentenceTransformerEmbedder()
    assert e._model is None and e.id == "all-MiniLM-L6-v2"
    assert "SentenceTransformerEmbedder" in repr(e)


def test_importing_embed_and_index_stays_light() -> None:
    code = (
        "import sys, ragbudget.embed, ragbudget.index; "
        "heavy = [m for m in ('torch', 'transformers', 'faiss', 'sentence_transformers') "
        "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# --- the real packaged MiniLM ------------------------------------------------------------------


@pytest.fixture(scope="session")
def minilm() -> SentenceTransformerEmbedder:
    e = SentenceTransformerEmbedder()
    e.warm_up()
    return e


@pytest.mark.slow
def test_minilm_short_text_matches_plain_encode(minilm: SentenceTransformerEmbedder) -> None:
    texts = ["A short sentence about cats.", "Another one, about the sea."]
    ours = minilm.embed(texts)
    plain = minilm.model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    assert ours.windows == (1, 1)
    assert np.allclose(ours.vectors, plain, atol=1e-5)
    assert minilm.dim == 384 and minilm.max_tokens <= 254
    minilm.warm_up()  # idempotent


@pytest.mark.slow
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
    truncating = SentenceTransformerEmbedder(pooling="truncate")
    truncating._model = minilm.model  # share the loaded weights
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
    assert e.spec()["dim"] == 384 and e._model is None
    assert SentenceTransformerEmbedder(light=False)._lite() is None


@pytest.mark.slow
def test_minilm_light_query_path_equals_sentence_transformers(minilm: SentenceTransformerEmbedder) -> None:
    # The query path without torch gives sentence-transformers' vectors to float32 rounding, with
    # the same tokens, windows, dimension and window size.
    texts = ["What is MinHash?", "  leading and trailing  ", "Ünïcödé naïve café 東京 🙂", "x",
             "\n\nnew\tlines\n", FILLER * 3, FILLER * 14 + TAIL_FACT, "[CLS] [SEP] [MASK] <b>tags</b> & 42"]
    light = SentenceTransformerEmbedder()
    assert light._lite() is not None
    assert (light.dim, light.max_tokens) == (minilm.dim, minilm.max_tokens)
    assert light.windows_of(texts) == minilm.windows_of(texts)
    got = np.array([light.embed_query(t) for t in texts])
    want = np.array([minilm.embed_query(t) for t in texts])
    assert got.dtype == np.float32 and light._model is None
    assert np.abs(got - want).max() < 1e-6
    assert (got * want).sum(axis=1).min() > 1 - 1e-6
    # Past the model's 256 tokens both cut the same way ([CLS] + 254 pieces + [SEP]).
    lite = light._lite()
    assert lite is not None
    cut = lite.encode([FILLER * 14 + TAIL_FACT])
    plain = minilm.model.encode([FILLER * 14 + TAIL_FACT], normalize_embeddings=True, convert_to_numpy=True)
    assert np.abs(cut - plain).max() < 1e-6
