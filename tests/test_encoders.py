"""ragbudget.retrieval.encoders: the schedule every backend shares, the runners' token states and offsets,
and (slow) sentence vectors pooled from the real MiniLM's chunk pass against the pooling
definition worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ragbudget.memory.models import resolve_embedder
from ragbudget.packing.spans import split_sentences
from ragbudget.retrieval.embed import HashEmbedder, SentenceTransformerEmbedder
from ragbudget.retrieval.encoders import LightBert, Runner, schedule


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), max_size=60),
    max_rows=st.integers(1, 40),
    max_tokens=st.integers(1, 4000),
)
def test_schedule_batches_every_text_once_longest_first_within_the_budget(
    lengths: list[int], max_rows: int, max_tokens: int
) -> None:
    batches = schedule(lengths, max_rows=max_rows, max_tokens=max_tokens)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))  # each text once
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)  # sorted: no batch pads much
    for b in batches:
        width = max(lengths[i] for i in b)
        assert len(b) <= max_rows
        assert len(b) == 1 or len(b) * width <= max_tokens  # an over-long text goes alone


class _Echo(Runner):
    """A runner over the packaged MiniLM's tokenizer whose "model" is arithmetic: a token's state
    is its id and its position in its row, the vector the mean state. Shows which state lands
    where, whatever the batching and threads."""

    def __init__(self, *, max_rows: int, workers: int) -> None:
        layout = LightBert.open(resolve_embedder(None))  # the packaged MiniLM's files
        assert layout is not None
        super().__init__(layout)
        self.max_rows, self.workers = max_rows, workers

    def _run(self, ids, mask, *, tokens):  # type: ignore[no-untyped-def]
        states = np.zeros((*ids.shape, self.layout.dim), dtype=np.float32)
        states[..., 0] = ids
        states[..., 1] = np.arange(ids.shape[1])
        vec = (states * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
        return vec, states if tokens else None


def test_runner_hands_each_text_its_own_tokens_with_offsets_into_the_text() -> None:
    texts = ["  Leading space, then words.", "x", "The cat sat on the mat.\nIt purred!", "Ünïcödé café 東京"]
    ref, _ = _Echo(max_rows=1, workers=1).encode(texts)
    for rows, workers in ((1, 2), (3, 1), (3, 2), (64, 2)):
        vecs, states = _Echo(max_rows=rows, workers=workers).encode(texts, tokens=True)
        assert np.array_equal(vecs, ref)  # batching and threads change nothing
        assert states is not None
        for text, (offsets, st_) in zip(texts, states, strict=True):
            assert offsets.shape == (len(st_), 2) and (np.diff(offsets[:, 0]) > 0).all()
            pieces = [text[a:b] for a, b in offsets]
            # Content tokens only ([CLS]/[SEP] left out), at the characters they came from.
            assert "".join(pieces) == "".join(text.split())
            assert st_[0, 1] == 1  # the first content token sits after [CLS]


@settings(max_examples=60, deadline=None)
@given(
    sentences=st.lists(
        st.lists(st.sampled_from(["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]), min_size=1, max_size=9), max_size=12
    ),
    max_tokens=st.integers(3, 16),
)
def test_pooled_spans_count_every_token_once_across_overlapping_windows(
    sentences: list[list[str]], max_tokens: int
) -> None:
    # The hash embedder's pooled span is its words' sum: equal to the span embedded alone only
    # when each word is taken once, from one of the overlapping windows that hold it.
    text = " ".join(" ".join(words) + "." for words in sentences)
    spans = [(a, b) for a, b, _ in split_sentences(text)]
    e = HashEmbedder(dim=32, max_tokens=max_tokens)
    res = e.embed([text], spans=[spans])
    assert res.spans is not None and res.spans[0].shape == (len(spans), 32)
    want = HashEmbedder(dim=32).embed_documents([text[a:b] for a, b in spans])
    np.testing.assert_allclose(res.spans[0], want, atol=1e-6)
    assert np.array_equal(res.vectors, e.embed([text]).vectors)  # the chunk vector is unchanged


def test_an_embedder_that_cannot_pool_returns_no_spans() -> None:
    e = HashEmbedder(dim=16, pool_spans=False)
    res = e.embed(["It rained. We stayed in."], spans=[[(0, 10), (11, 24)]])
    assert res.spans is None and not e.pools_spans
    with pytest.raises(ValueError, match="one list per text"):
        HashEmbedder(dim=16).embed(["a", "b"], spans=[[(0, 1)]])


# --- the real packaged MiniLM ---------------------------------------------------------------------

HAND = "The cat sat on the mat. It purred."
# Worked out by hand from MiniLM's vocabulary (lower-cased word pieces, "." its own token): the
# first sentence is tokens 1-7 of "[CLS] the cat sat on the mat . it purred . [SEP]", the second
# tokens 8-11 ("it", "pu", "##rred", "."). A sentence's vector is the mean of those tokens' final
# states, made unit length: the model's own mean pooling, over the sentence's part of the text.
HAND_TOKENS = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", ".", "it", "pu", "##rred", ".", "[SEP]"]
HAND_SENTENCES = [(1, 8), (8, 12)]


def _by_hand() -> np.ndarray:
    import torch
    from transformers import AutoModel, AutoTokenizer

    from ragbudget.memory.models import resolve_embedder

    path = resolve_embedder(None)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(HAND, return_tensors="pt")["input_ids"]
    assert tok.convert_ids_to_tokens(ids[0]) == HAND_TOKENS
    with torch.inference_mode():
        h = AutoModel.from_pretrained(path)(input_ids=ids).last_hidden_state[0].numpy()
    rows = np.array([h[a:b].mean(axis=0) for a, b in HAND_SENTENCES])
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.mark.model
@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_pooled_sentence_vectors_equal_the_pooling_definition_worked_by_hand(backend: str) -> None:
    want = _by_hand()
    e = SentenceTransformerEmbedder(backend=backend)
    spans = [(a, b) for a, b, _ in split_sentences(HAND)]
    assert [HAND[a:b] for a, b in spans] == ["The cat sat on the mat.", "It purred."]
    res = e.embed([HAND], spans=[spans])
    assert res.spans is not None
    np.testing.assert_allclose(res.spans[0], want, atol=1e-5, rtol=0)  # float32: the same numbers
    # As an index would keep them (float16): equal to that rounding.
    np.testing.assert_allclose(res.spans[0].astype(np.float16), want, atol=2e-3, rtol=0)
    assert np.array_equal(res.vectors, e.embed([HAND]).vectors)  # the chunk vector is the same either way


@pytest.mark.model
def test_pooled_sentence_vectors_across_overlapping_windows_follow_the_definition() -> None:
    # Over several windows, a token is taken from the window holding it up to the middle of the
    # overlap: recomputed here with transformers itself, window by window.
    import torch
    from transformers import AutoModel, AutoTokenizer

    from ragbudget.memory.models import resolve_embedder

    path = resolve_embedder(None)
    tok, bert = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
    text = " ".join(f"Sentence {i} tells of the {w} harbour and its ships." for i, w in enumerate(["old", "new"] * 40))
    e = SentenceTransformerEmbedder(backend="torch")
    bounds = e.window_bounds([text])[0]
    assert len(bounds) >= 3
    offs, states = [], []
    for k, (a, b) in enumerate(bounds):
        enc = tok(text[a:b], return_offsets_mapping=True, return_special_tokens_mask=True, return_tensors="pt")
        with torch.inference_mode():
            h = bert(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state[0].numpy()
        lo = (bounds[k - 1][1] + a) / 2 if k else -1
        hi = (bounds[k + 1][0] + b) / 2 if k + 1 < len(bounds) else float("inf")
        pieces = zip(enc["offset_mapping"][0].tolist(), enc["special_tokens_mask"][0], h, strict=True)
        for (x, y), special, state in pieces:
            if not special and lo <= a + x < hi:
                offs.append((a + x, a + y))
                states.append(state)
    spans = [(a, b) for a, b, _ in split_sentences(text)]
    want = []
    for a, b in spans:
        v = np.mean([st_ for (x, y), st_ in zip(offs, states, strict=True) if x < b and y > a], axis=0)
        want.append(v / np.linalg.norm(v))
    got = e.embed([text], spans=[spans]).spans
    assert got is not None
    np.testing.assert_allclose(got[0], np.array(want), atol=1e-5, rtol=0)


@pytest.mark.model
def test_int8_pools_from_its_own_pass_and_keeps_its_vectors() -> None:
    # int8's sentence vectors come from int8 token states: close to the float definition, and
    # its chunk vectors are exactly what it gives without spans (one text per run).
    want = _by_hand()
    e = SentenceTransformerEmbedder(backend="onnx-int8")
    res = e.embed([HAND], spans=[[(a, b) for a, b, _ in split_sentences(HAND)]])
    assert res.spans is not None
    assert (res.spans[0] * want).sum(axis=1).min() > 0.97
    text = HAND + " " + "The committee met on a Tuesday to review the figures. " * 40
    spans = [(a, b) for a, b, _ in split_sentences(text)]
    long = e.embed([text], spans=[spans])
    assert long.windows[0] >= 2 and long.spans is not None and long.spans[0].shape == (len(spans), 384)
    assert np.array_equal(long.vectors, e.embed([text]).vectors)
