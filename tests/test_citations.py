"""Citations that hold (issue #43 §4): a marker stays only where its passage says what the answer
says, and an answer with none is cited with the passage that supports it."""

from __future__ import annotations

from pathlib import Path

import pytest
from _fakes import FakeGenerator

from ragbudget import Pipeline
from ragbudget.citations import MIN_SUPPORT, attribute

PASSAGES = [
    "Super Bowl 50 was played at Levi's Stadium in Santa Clara, California.",
    "The champion receives the Vince Lombardi Trophy, named after the coach.",
    "The Broncos defeated the Panthers 24-10.",
]


def test_an_uncited_answer_is_cited_with_the_passage_that_holds_it() -> None:
    c = attribute("The Vince Lombardi Trophy.", PASSAGES, question="Which trophy does the champion receive?")
    assert (c.text, c.cited, c.added) == ("The Vince Lombardi Trophy. [2]", (2,), " [2]")
    assert c.support[1] == 1.0 and c.support[0] == 0.0


def test_a_marker_whose_passage_does_not_hold_the_answer_is_dropped() -> None:
    # [1] is about the stadium, not the score; [7] is no source at all.
    c = attribute("The Broncos won 24-10 [1][7].", PASSAGES, question="What was the score?")
    assert c.text == "The Broncos won 24-10. [3]"
    assert [n for n, _ in c.dropped] == [1, 7] and c.cited == (3,)
    # A marker that holds stays where the model put it, and nothing is added.
    kept = attribute("Levi's Stadium [1] in Santa Clara.", PASSAGES, question="Where was it played?")
    assert (kept.text, kept.cited, kept.added, kept.dropped) == ("Levi's Stadium [1] in Santa Clara.", (1,), "", ())


def test_an_answer_no_passage_supports_cites_nothing() -> None:
    for text in ("I do not know.", "", "The moon is made of basalt and cheese."):
        c = attribute(text, PASSAGES, question="What is the moon made of?")
        assert c.cited == () and c.added == "" and all(s < MIN_SUPPORT for s in c.support)
    # A bare citation says nothing: its marker has no claim to hold, so it goes.
    assert attribute("[2]", PASSAGES).cited == ()


def test_question_words_do_not_count_as_support() -> None:
    # Every passage is "about the Super Bowl"; only the second holds what this answer adds.
    c = attribute(
        "The Super Bowl champion receives the Lombardi Trophy.",
        PASSAGES,
        question="What does the Super Bowl champion receive?",
    )
    assert c.cited == (2,)


@pytest.fixture(scope="module")
def indexed(tmp_path_factory: pytest.TempPathFactory, repo_data: Path) -> Path:
    index_dir = tmp_path_factory.mktemp("citations") / "idx"
    Pipeline(index_dir, embedder="hash:256").index([repo_data])
    return index_dir


def test_ask_cites_and_streams_the_citation_it_placed(indexed: Path) -> None:
    gen = FakeGenerator(answer="She was the first female recipient of the Nobel Prize.")
    pipe = Pipeline(indexed, generator=gen, gpu="16GiB")
    pieces: list[str] = []
    answer = pipe.ask("What was Maria Curie the first female recipient of?", on_text=pieces.append)
    n = answer.report["citations"]["cited"]
    assert len(n) == 1 and answer.text.endswith(f" [{n[0]}]")
    assert "Nobel Prize" in _passage_text(answer, n[0])
    # The stream ends with the placed marker, so the streamed text is the answer's text (the
    # fake streams each word with a space after it, which its final text does not have).
    assert pieces[-1].strip() == f"[{n[0]}]" and "".join(pieces).split() == answer.text.split()
    assert answer.to_dict()["report"]["citations"]["added"] == f" [{n[0]}]"


def _passage_text(answer: object, n: int) -> str:
    selection = answer.report["selection"]  # type: ignore[attr-defined]
    assert 1 <= n <= len(selection)
    src = answer.sources[n - 1]  # type: ignore[attr-defined]
    return (
        Path(src["path"]).read_text(encoding="utf-8")[src["start"] : src["end"]] if Path(src["path"]).is_file() else ""
    )


def test_an_answer_cut_by_the_callers_stop_strings_gets_nothing_after_its_stop(indexed: Path) -> None:
    # An OpenAI client's `stop` ends the text right before the stop: no marker is appended there,
    # while the markers the model wrote are still checked.
    c = attribute("The Vince Lombardi Trophy.", PASSAGES, question="Which trophy?", place=False)
    assert (c.text, c.cited, c.added) == ("The Vince Lombardi Trophy.", (), "")
    assert attribute("24-10 [1]", PASSAGES, question="Score?", place=False).text == "24-10"
    gen = FakeGenerator(answer="She was the first female recipient of the Nobel Prize.")
    pipe = Pipeline(indexed, generator=gen, gpu="16GiB")
    pieces: list[str] = []
    answer = pipe.ask("What was Maria Curie the first female recipient of?", on_text=pieces.append, stop=["zzz"])
    assert "[" not in answer.text and "[" not in "".join(pieces)
    assert answer.report["citations"]["added"] == ""
