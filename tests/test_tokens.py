"""ragbudget.tokens: the tokenizer protocol and get_tokenizer's resolution of each spec."""

from __future__ import annotations

import pytest
from _fakes import WordTokenizer

from ragbudget.errors import ConfigError
from ragbudget.tokens import HFTokenizer, TiktokenTokenizer, Tokenizer, get_tokenizer


def test_default_is_offline_cl100k_and_round_trips() -> None:
    tok = get_tokenizer()
    assert isinstance(tok, TiktokenTokenizer) and isinstance(tok, Tokenizer)
    text = "Marie Curie won the Nobel Prize in 1903 — and again in 1911."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.count(text) == len(ids) > 5
    assert tok.encode_batch([text, "hi"]) == [ids, tok.encode("hi")]
    assert get_tokenizer() is tok  # cached: one BPE table per process


def test_a_string_names_the_encoding_with_or_without_prefix() -> None:
    assert get_tokenizer("tiktoken:cl100k_base") is get_tokenizer("cl100k_base")


def test_hf_tokenizer_counts_without_special_tokens() -> None:
    words = WordTokenizer(chatml=True)  # HF-shaped: has apply_chat_template
    tok = get_tokenizer(words)
    assert isinstance(tok, HFTokenizer) and tok.hf is words
    assert tok.count("the cat sat") == 5  # three words, two spaces
    assert tok.decode(tok.encode("the cat sat")) == "the cat sat"


def test_a_bare_callable_counts_but_cannot_decode() -> None:
    def split_ids(text: str) -> list[int]:
        return [len(w) for w in text.split()]

    tok = get_tokenizer(split_ids)
    assert tok.count("one two three") == 3 and tok.encode("ab c") == [2, 1]
    with pytest.raises(ConfigError, match="cannot decode"):
        tok.decode([1])


def test_an_unusable_spec_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot use int as a tokenizer"):
        get_tokenizer(42)
