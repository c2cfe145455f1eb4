"""The LangChain, LlamaIndex and Haystack retrievers return exactly ragbudget's budgeted selection.

Model-free: a hash embedder and a word-level fake tokenizer; each framework's test skips when the
framework is not installed (they are in the ``dev`` extra, so CI runs them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _fakes import GeneratorStub

from ragbudget import ConfigError, Pipeline
from ragbudget.integrations import (
    haystack_retriever,
    langchain_retriever,
    llamaindex_retriever,
    passages,
)

TOPICS = {
    "leader.md": "# Project Leader\n\nThe Project Leader is elected by the developers each year. "
    "Voting uses the Condorcet method over a three week period.\n",
    "committee.md": "# Technical Committee\n\nThe Technical Committee decides technical disputes. "
    "It has up to eight members appointed by the committee itself.\n",
    "secretary.md": "# Project Secretary\n\nThe Project Secretary runs the votes and keeps the "
    "records of all general resolutions of the developers.\n",
    "delegates.md": "# Delegates\n\nDelegates are appointed by the Project Leader and may make "
    "decisions within their area of responsibility.\n",
}
QUESTION = "How is the Project Leader elected?"
CAP = 60  # context tokens: room for some of the four documents, not all


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory) -> Pipeline:
    docs = tmp_path_factory.mktemp("docs")
    for name, text in TOPICS.items():
        (docs / name).write_text(text * 3)
    pipe = Pipeline(tmp_path_factory.mktemp("idx") / "idx", embedder="hash:256", generator=GeneratorStub(), gpu="16GiB")
    pipe.index([docs])
    return pipe


def _expected(pipe: Pipeline) -> Any:
    sel = pipe.retrieve(QUESTION, context_tokens=CAP)
    assert 0 < len(sel.chunks) < len(TOPICS) and sel.dropped  # the cap really selects
    return sel


def _check_metadata(metas: list[dict[str, Any]], sel: Any) -> None:
    assert [m["citation"] for m in metas] == list(range(1, len(sel.chunks) + 1))
    assert all(Path(m["path"]).name in TOPICS and m["end"] > m["start"] for m in metas)
    assert sum(m["n_tokens"] for m in metas) <= metas[0]["ragbudget"]["tokens_used"] <= CAP
    report = metas[0]["ragbudget"]
    assert report["tokens_allowed"] == sel.tokens_allowed <= CAP
    assert {d["reason"] for d in report["dropped"]} <= {
        "duplicate",
        "below_cutoff",
        "below_relevance_floor",
        "redundant",
        "over_budget",
    }
    assert len(report["dropped"]) == len(sel.dropped)


def test_passages_are_the_selection_with_sources(pipe: Pipeline) -> None:
    sel = _expected(pipe)
    out = passages(sel)
    assert [t for t, _ in out] == [c.text for c in sel.chunks]
    _check_metadata([m for _, m in out], sel)
    assert "leader" in Path(out[0][1]["path"]).name


def test_langchain_retriever_in_a_chain(pipe: Pipeline) -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.runnables import RunnableLambda

    sel = _expected(pipe)
    retriever = langchain_retriever(pipe, context_tokens=CAP)
    docs = retriever.invoke(QUESTION)
    assert [d.page_content for d in docs] == [c.text for c in sel.chunks]
    _check_metadata([d.metadata for d in docs], sel)
    chain = retriever | RunnableLambda(lambda ds: "\n\n".join(d.page_content for d in ds))
    assert chain.invoke(QUESTION) == sel.text


def test_llamaindex_retriever(pipe: Pipeline) -> None:
    pytest.importorskip("llama_index.core")
    sel = _expected(pipe)
    nodes = llamaindex_retriever(pipe, context_tokens=CAP).retrieve(QUESTION)
    assert [n.node.get_content() for n in nodes] == [c.text for c in sel.chunks]
    assert [n.score for n in nodes] == [round(c.score, 6) for c in sel.chunks]
    _check_metadata([n.node.metadata for n in nodes], sel)
    # An LLM prompt built by LlamaIndex shows where each passage is from, not the bookkeeping.
    from llama_index.core.schema import MetadataMode

    shown = nodes[0].node.get_content(metadata_mode=MetadataMode.LLM)
    assert sel.chunks[0].text in shown and "leader.md" in shown and "citation: 1" in shown
    assert "tokens_allowed" not in shown and "chunk_ids" not in shown


def test_haystack_component_in_a_pipeline(pipe: Pipeline) -> None:
    haystack = pytest.importorskip("haystack")
    sel = _expected(pipe)
    hp = haystack.Pipeline()
    hp.add_component("retriever", haystack_retriever(pipe, context_tokens=CAP))
    docs = hp.run({"retriever": {"query": QUESTION}})["retriever"]["documents"]
    assert [d.content for d in docs] == [c.text for c in sel.chunks]
    _check_metadata([d.meta for d in docs], sel)


def test_retrievers_take_a_scope(pipe: Pipeline) -> None:
    pytest.importorskip("langchain_core")
    docs = langchain_retriever(pipe, context_tokens=CAP, sources="committee.md").invoke(QUESTION)
    assert docs and {Path(d.metadata["path"]).name for d in docs} == {"committee.md"}


def test_bad_options_and_missing_frameworks_are_config_errors(pipe: Pipeline) -> None:
    import subprocess
    import sys

    with pytest.raises(ConfigError, match="context_token"):
        langchain_retriever(pipe, context_token=10)
    # Frameworks that are not installed (None in sys.modules: importing them raises ImportError),
    # in a fresh process: this one has built its adapter classes already, once each.
    code = (
        "import sys\n"
        "sys.modules['haystack'] = sys.modules['langchain_core.retrievers'] = None\n"
        "from ragbudget import ConfigError\n"
        "from ragbudget.integrations import haystack_retriever, langchain_retriever\n"
        "for make in (haystack_retriever, langchain_retriever):\n"
        "    try:\n"
        "        make(object(), context_tokens=100)\n"
        "    except ConfigError as e:\n"
        "        print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert [line.split(", which")[0] for line in out] == [
        "this adapter needs haystack-ai",
        "this adapter needs langchain-core",
    ]
    assert out[0].endswith("`pip install haystack-ai`") and out[1].endswith("`pip install langchain-core`")
