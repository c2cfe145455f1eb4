"""ragbudget.summaries: the summary cache the requests of one server share (bounded, keyed by an
unambiguous digest of the prefix it summarizes), the summary prompt and the extractive fallback.
How a conversation folds its turns with them is in test_chat.py."""

from __future__ import annotations

import pytest

from ragbudget.errors import ConfigError
from ragbudget.summaries import SummaryCache, Turn, extractive_summary, summary_messages


def test_summary_cache_is_bounded_and_validated() -> None:
    cache = SummaryCache(max_entries=2)
    root = SummaryCache.root("", 128)
    keys = [SummaryCache.extend(root, Turn(f"q{i}", f"a{i}")) for i in range(3)]
    for k in keys:
        cache.put(k, k[:8])
    assert len(cache) == 2 and cache.get(keys[0]) is None and cache.get(keys[2]) == keys[2][:8]
    assert SummaryCache.extend(root, Turn("ab", "c")) != SummaryCache.extend(root, Turn("a", "bc"))
    assert SummaryCache.root("", 128) != SummaryCache.root("", 64) != SummaryCache.root("x", 64)
    with pytest.raises(ConfigError, match="max_entries"):
        SummaryCache(0)


def test_the_longest_cached_prefix_is_found_in_one_lookup() -> None:
    cache = SummaryCache()
    root = SummaryCache.root("", 128)
    k1 = SummaryCache.extend(root, Turn("q1", "a1"))
    k2 = SummaryCache.extend(k1, Turn("q2", "a2"))
    k3 = SummaryCache.extend(k2, Turn("q3", "a3"))
    assert cache.longest([k1, k2, k3]) is None and cache.misses == 1
    cache.put(k2, "two folded")
    assert cache.longest([k1, k2, k3]) == (2, "two folded") and cache.hits == 1
    assert cache.longest([]) is None


def test_the_summary_prompt_and_the_extractive_fallback() -> None:
    msgs = summary_messages("Earlier.", ["User: hi", "Assistant: hello"], cap=100)
    assert msgs[0]["role"] == "system" and msgs[1]["role"] == "user"
    assert msgs[1]["content"].startswith("Summary so far: Earlier.") and "at most 60 words" in msgs[1]["content"]
    turns = [Turn("Who leads?", "The Project Leader. Elected yearly."), Turn("When?", "")]
    expected = "Before. Asked: Who leads? Answer: The Project Leader. Asked: When? Answer:"
    assert extractive_summary("Before.", turns) == expected
