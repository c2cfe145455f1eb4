"""ragbudget.calls: what a caller passes the pipeline is checked before any work, and each
refusal names the argument, what it got and what it takes (the pipeline's own tests check the
same through ``Pipeline``; these pin each check alone)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ragbudget.calls import check_call, check_options, check_parts, check_paths, check_question, stream_options
from ragbudget.errors import ArgumentTypeError, ConfigError


def test_a_question_is_non_empty_text() -> None:
    assert check_question("  why? ") == "  why? "
    with pytest.raises(ConfigError, match="the query is empty"):
        check_question(" \n", "query")
    with pytest.raises(ArgumentTypeError, match="question"):
        check_question(42)


def test_paths_are_one_path_or_a_list_of_them(tmp_path: Path) -> None:
    assert check_paths(tmp_path) == [tmp_path]
    assert check_paths(("a", tmp_path)) == ["a", tmp_path]
    with pytest.raises(ArgumentTypeError, match="got item 1: int 3"):
        check_paths(["a", 3])
    with pytest.raises(ArgumentTypeError, match="got dict"):
        check_paths({"a": 1})


def test_options_a_target_does_not_take_are_named_with_those_it_does() -> None:
    def target(paths: object, *, rebuild: bool = False, prune: bool = False, embedder: object = None) -> None: ...

    check_options("index", {"rebuild": True}, target, taken=("embedder",))
    with pytest.raises(ConfigError, match=r"chunk_size: not an option of index\(\); it takes rebuild, prune$"):
        check_options("index", {"chunk_size": 1}, target, taken=("embedder",))
    with pytest.raises(ConfigError, match="embedder: not an option"):  # set by the caller itself
        check_options("index", {"embedder": "x"}, target, taken=("embedder",))


def test_parts_given_as_names_say_which_keyword_takes_a_name() -> None:
    check_parts("hash", None, None)
    with pytest.raises(ArgumentTypeError, match="embedder must be a model name"):
        check_parts(3, None, None)
    with pytest.raises(ArgumentTypeError, match="to name a model, pass model="):
        check_parts(None, "gpt", None)
    with pytest.raises(ArgumentTypeError, match="pass engine=URL"):
        check_parts(None, None, "http://localhost:8000")


def test_callbacks_and_streams() -> None:
    check_call(print, threading.Event())
    with pytest.raises(ArgumentTypeError, match="on_text must be a callable"):
        check_call("print", None)
    with pytest.raises(ArgumentTypeError, match="cancel must be a threading.Event"):
        check_call(None, True)
    assert stream_options({"max_new_tokens": 8}) == {"max_new_tokens": 8}
    with pytest.raises(ConfigError, match="drop cancel, on_text"):
        stream_options({"on_text": print, "cancel": None})
