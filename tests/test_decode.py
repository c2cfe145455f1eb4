"""Decoding: byte-order marks, BOM-less UTF-16, UTF-8 with bad bytes counted, legacy code pages,
binary files refused."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings, strategies as st

from ragbudget.errors import LoadError
from ragbudget.input.decode import Decoded, decode, decode_bytes

_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cs"), blacklist_characters="\ufffd\ufeff"),
    min_size=1,
    max_size=60,
)


@pytest.mark.parametrize(
    ("data", "encoding", "text"),
    [
        ("naïve café".encode("utf-8-sig"), "utf-8", "naïve café"),
        ("naïve café".encode("utf-16"), "utf-16-le", "naïve café"),
        ("naïve café".encode("utf-16-be"), "utf-16-be", "naïve café"),  # no BOM: NUL pattern
        ("naïve café".encode("utf-16-le"), "utf-16-le", "naïve café"),
        ("naïve café".encode("utf-32"), "utf-32-le", "naïve café"),
        (
            "Café, naïve — “quoted” text for the detector.".encode("cp1252"),
            "cp1252",
            "Café, naïve — “quoted” text for the detector.",
        ),
    ],
)
def test_decode_bytes(data, encoding, text):
    assert decode_bytes(data) == (text, encoding, 0)


def test_invalid_utf8_is_replaced_and_counted():
    text, enc, replaced = decode_bytes(b"caf\xc3\xa9 \x80\x81 ok \xff")
    assert (text, enc, replaced) == ("café \ufffd\ufffd ok \ufffd", "utf-8", 3)


def test_binary_detection():
    with pytest.raises(LoadError) as info:
        decode_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00" * 100, path="a.out")
    assert info.value.reason == "binary"


@settings(max_examples=100, deadline=None)
@given(_TEXT, st.lists(st.integers(min_value=0, max_value=200), max_size=5))
def test_invalid_bytes_are_counted_never_dropped(text, cuts):
    # 0xFF is never valid UTF-8; inserted between characters of a text that has real multi-byte
    # UTF-8, each one must come back as exactly one counted U+FFFD.
    assume(any(ord(c) > 127 for c in text))
    positions = sorted({min(c, len(text)) for c in cuts})
    pieces, prev = [], 0
    for pos in positions:
        pieces.append(text[prev:pos].encode("utf-8"))
        prev = pos
    pieces.append(text[prev:].encode("utf-8"))
    bad = b"\xff".join(pieces)
    assume(not bad.startswith((b"\xff\xfe", b"\xfe\xff")))
    try:
        decoded, encoding, replaced = decode_bytes(bad)
    except LoadError as exc:  # the NUL/UTF-16 heuristics may call odd inputs binary; never crash
        assert exc.reason == "binary"
        return
    assert encoding == "utf-8"
    assert replaced == len(positions)
    assert decoded.replace("\ufffd", "") == text


# Short Western texts give the detector almost nothing: it ranked mac_latin2, cp775 or even
# UTF-16 level with cp1252 and turned "café" into "cafť" or "Zürich" into CJK.
@pytest.mark.parametrize(
    "text",
    [
        "café",
        "naïve",
        "Zürich",
        "We met at the café.\n",
        "Meeting in Zürich\n",
        "Un café naïve à Zürich.",
        "The café in Zürich served a naïve crème brûlée.\n",
    ],
)
@pytest.mark.parametrize("legacy", ["cp1252", "latin-1"])
def test_weak_guesses_prefer_western_code_pages(text, legacy):
    decoded, encoding, replaced = decode_bytes(text.encode(legacy))
    assert decoded == text and replaced == 0
    assert encoding in ("cp1252", "latin_1")


@pytest.mark.parametrize(
    ("text", "legacy"),
    [
        ("Привет, как дела? Это простой текст на русском языке для проверки кодировки.\n", "cp1251"),
        ("Καλημέρα, αυτό είναι ένα απλό ελληνικό κείμενο για δοκιμή.\n", "cp1253"),
        ("Příliš žluťoučký kůň úpěl ďábelské ódy.\n", "cp1250"),
    ],
)
def test_clear_non_western_text_keeps_its_code_page(text, legacy):
    assert decode_bytes(text.encode(legacy)) == (text, legacy, 0)


def test_decode_says_when_the_encoding_was_a_guess() -> None:
    # What load_document turns into meta["encoding_warning"]: only a legacy code page chosen
    # without a BOM, valid UTF-8 or a declared charset is a guess.
    assert decode("Un café à Zürich.".encode("cp1252")) == Decoded("Un café à Zürich.", "cp1252", 0, True)
    assert decode("café".encode()).guessed is False
    assert decode(b"caf\xc3\xa9 \xff").guessed is False  # UTF-8 with a bad byte: replaced, not guessed
    assert decode("café".encode("utf-16")).guessed is False
    declared = b"<meta charset='iso-8859-1'><p>caf\xe9</p>"
    assert decode(declared, html=True) == Decoded("<meta charset='iso-8859-1'><p>café</p>", "iso8859-1", 0, False)
    assert decode(declared).guessed is True  # not read as HTML: the declaration is not looked for
