"""ragbudget.generation.decoding without a model: the streamer holds back partial stop strings
and repeated lines, and a line repeated three times in a row ends the answer (issue #30). The
same rules inside real generation are in test_generate.py and test_batching.py."""

from __future__ import annotations

import pytest


class _CharTokenizer:
    """One token per character (ids are code points)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def _stream(text: str, stop: list[str]) -> list[str]:
    import torch

    from ragbudget.generation.decoding import CallbackStreamer

    pieces: list[str] = []
    s = CallbackStreamer(_CharTokenizer(), pieces.append, 0, stop)
    for ch in text:
        s.put(torch.tensor([ord(ch)]))
    s.end()
    return pieces


def test_streamer_holds_back_partial_stop_strings() -> None:
    # "EN" could start "END": held back until the next character decides.
    assert _stream("abcENxyz", ["END"]) == ["a", "b", "c", "ENx", "y", "z"]
    assert _stream("abcENDxyz", ["END"]) == ["a", "b", "c"]
    assert "".join(_stream("say ###stop now", ["##s", "top"])) == "say #"
    # A partial stop at the very end is text: the generation ended without completing it.
    assert "".join(_stream("abcEN", ["END"])) == "abcEN"
    assert "".join(_stream("abc", [])) == "abc"


# --- a line repeated in a row ends the answer (issue #30) ------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Intro\nSame\nSame\nSame\n", (10, 10)),  # the third copy: cut after the first
        ("Intro\nSame\n\n  Same \n\nSame\n", (10, 10)),  # blank lines and spaces do not hide it
        ("Intro\nSame\nSame\nSame", (None, 10)),  # the third not finished: held, not cut
        ("Intro\nSame\nSame\n", (None, 10)),  # two copies: the second is held back
        ("Intro\nSame\nSame\nOther", (None, 21)),  # twice is meant: released once a new line starts
        ("Same\nOther\nSame\nSame\n", (None, 15)),  # copies must follow each other
        ("One\nTwo\n", (None, 7)),  # a line ending is held until the next line starts
        ("One\nTwo\nTh", (None, 10)),
        ("no newline yet", (None, 14)),
        ("", (None, 0)),
    ],
)
def test_line_repeats_cuts_at_the_third_copy_and_holds_back_copies(text, expected) -> None:
    from ragbudget.generation.decoding import line_repeats

    assert line_repeats(text) == expected
    assert line_repeats("A\nA\n", times=2) == (1, 1)  # the count is the caller's


def test_a_stream_never_shows_a_repeated_line_and_stops_at_the_third() -> None:
    from ragbudget.generation.decoding import CallbackStreamer

    pieces: list[str] = []
    s = CallbackStreamer(_CharTokenizer(), pieces.append, 0)
    for ch in "Intro\nSame\nSame\nSame\nSame\n":
        s.feed([ord(ch)])
    s.end()
    assert "".join(pieces) == "Intro\nSame" and s.stopped
    # Twice in a row is text: the held copy comes out once the next line differs.
    assert "".join(_stream("A\nB\nB\nC\n", [])) == "A\nB\nB\nC\n"
