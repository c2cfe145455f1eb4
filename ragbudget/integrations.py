"""ragbudget's budgeted selection as a retriever of LangChain, LlamaIndex and Haystack.

A framework's own retriever returns its top-k and leaves the prompt to overflow or to be truncated
later; these return what :meth:`ragbudget.pipeline.Pipeline.retrieve` selects: the passages that
best answer the query *and* fit the context allowance computed from the GPU's memory, counted in
the generator's tokenizer after its chat template. Each returned document carries its source
(path, page, character offsets), score, chunk ids and token count in its metadata; the first one
also carries the budget (``tokens_allowed``, ``tokens_used``) and the candidates left out, with
their reasons.

Each framework is imported only when its adapter is asked for (none is a dependency of
ragbudget), and a missing one is a :class:`~ragbudget.errors.ConfigError` naming the package.

>>> from ragbudget import Pipeline                                          # doctest: +SKIP
>>> retriever = langchain_retriever(Pipeline(".ragbudget"), context_tokens=1024)  # doctest: +SKIP
>>> docs = retriever.invoke("How is the Project Leader elected?")           # doctest: +SKIP
>>> docs[0].metadata["path"], docs[0].metadata["ragbudget"]["tokens_allowed"]  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from .packing.select import SelectedChunk, Selection

__all__ = ["haystack_retriever", "langchain_retriever", "llamaindex_retriever", "passages"]

# The metadata a LlamaIndex synthesizer shows its LLM with each passage (a citation needs these).
_LLM_VISIBLE = ("path", "page", "label", "citation")
# What retrieve() takes; anything else is a typo better caught when the adapter is built.
_RETRIEVE_OPTIONS = frozenset({"context_tokens", "max_new_tokens", "history", "sources"})


def passages(selection: Selection) -> list[tuple[str, dict[str, Any]]]:
    """``(text, metadata)`` for each selected passage, in prompt order: the framework-neutral
    form every adapter builds its documents from. ``metadata["citation"]`` is the passage's
    number in ragbudget's own prompts (``[1]``, ``[2]`` …)."""
    out = []
    for i, chunk in enumerate(selection.chunks):
        out.append((chunk.text, _metadata(chunk, i + 1)))
    if out:
        out[0][1]["ragbudget"] = {
            "tokens_allowed": selection.tokens_allowed,
            "tokens_used": selection.tokens_used,
            "fill": round(selection.fill, 4),
            "candidates": selection.n_candidates,
            "dropped": [d.to_dict() for d in selection.dropped],
        }
    return out


def _metadata(chunk: SelectedChunk, citation: int) -> dict[str, Any]:
    first = chunk.sources[0].to_dict() if chunk.sources else {}
    return {
        **first,
        "score": round(float(chunk.score), 6),
        "citation": citation,
        "chunk_ids": [str(c) for c in chunk.chunk_ids],
        "n_tokens": chunk.n_tokens,
        "headings": list(chunk.headings),
        "truncated": chunk.truncated,
        # Exact duplicates dropped at ingestion: the same text also lives in these files.
        "duplicates": [s.to_dict() for s in chunk.sources[1:]],
    }


def _check_options(options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - _RETRIEVE_OPTIONS)
    if unknown:
        raise ConfigError(
            f"unknown retrieve option(s) {', '.join(unknown)}; the retrievers take "
            f"{', '.join(sorted(_RETRIEVE_OPTIONS))}"
        )
    return options


def _require(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"this adapter needs {package}, which is not installed ({e}); `pip install {package}`"
        ) from None


def _select(pipeline: Any, query: str, options: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return passages(pipeline.retrieve(query, **options))


# --- LangChain ------------------------------------------------------------------------------------


@functools.cache
def _langchain_class() -> type:
    retrievers = _require("langchain_core.retrievers", "langchain-core")
    documents = _require("langchain_core.documents", "langchain-core")
    from pydantic import ConfigDict

    class RagBudgetRetriever(retrievers.BaseRetriever):  # type: ignore[misc, name-defined]
        """LangChain retriever over :meth:`ragbudget.pipeline.Pipeline.retrieve`."""

        model_config = ConfigDict(arbitrary_types_allowed=True)
        pipeline: Any
        options: dict[str, Any] = {}

        def _get_relevant_documents(self, query: str, *, run_manager: Any = None) -> list[Any]:
            return [
                documents.Document(page_content=text, metadata=meta)
                for text, meta in _select(self.pipeline, query, self.options)
            ]

    return RagBudgetRetriever


def langchain_retriever(pipeline: Any, **options: Any) -> Any:
    """A LangChain ``BaseRetriever`` (``.invoke(query) -> list[Document]``, usable in LCEL
    chains) returning the passages ragbudget selects for the budget. ``options``:
    ``context_tokens``, ``max_new_tokens``, ``history``, ``sources`` (as :meth:`Pipeline.retrieve`)."""
    return _langchain_class()(pipeline=pipeline, options=_check_options(options))


# --- LlamaIndex -----------------------------------------------------------------------------------


@functools.cache
def _llamaindex_class() -> type:
    retrievers = _require("llama_index.core.retrievers", "llama-index-core")
    schema = _require("llama_index.core.schema", "llama-index-core")

    class RagBudgetRetriever(retrievers.BaseRetriever):  # type: ignore[misc, name-defined]
        """LlamaIndex retriever over :meth:`ragbudget.pipeline.Pipeline.retrieve`."""

        def __init__(self, pipeline: Any, options: dict[str, Any]) -> None:
            super().__init__()
            self._pipeline, self._options = pipeline, options

        def _retrieve(self, query_bundle: Any) -> list[Any]:
            out = []
            for text, meta in _select(self._pipeline, query_bundle.query_str, self._options):
                node = schema.TextNode(text=text, metadata=meta, id_="|".join(meta["chunk_ids"]))
                # LlamaIndex's synthesizers paste metadata into their prompts: show the LLM where
                # the passage is from, keep the bookkeeping (and the budget report) out of it.
                hidden = [k for k in meta if k not in _LLM_VISIBLE]
                node.excluded_llm_metadata_keys = hidden
                node.excluded_embed_metadata_keys = list(meta)
                out.append(schema.NodeWithScore(node=node, score=meta["score"]))
            return out

    return RagBudgetRetriever


def llamaindex_retriever(pipeline: Any, **options: Any) -> Any:
    """A LlamaIndex ``BaseRetriever`` (``.retrieve(query) -> list[NodeWithScore]``, usable in a
    ``RetrieverQueryEngine``) returning the passages ragbudget selects for the budget."""
    return _llamaindex_class()(pipeline, _check_options(options))


# --- Haystack -------------------------------------------------------------------------------------


@functools.cache
def _haystack_class() -> type:
    haystack = _require("haystack", "haystack-ai")

    @haystack.component
    class RagBudgetRetriever:
        """Haystack 2 component: ``run(query) -> {"documents": [...]}``."""

        def __init__(self, pipeline: Any, options: dict[str, Any]) -> None:
            self.pipeline, self.options = pipeline, options

        # haystack is a module imported at run time, so mypy cannot read its Document as a type.
        @haystack.component.output_types(documents=list[haystack.Document])  # type: ignore[name-defined,untyped-decorator]
        def run(self, query: str) -> dict[str, Any]:
            docs = [
                haystack.Document(content=text, meta=meta, score=meta["score"])
                for text, meta in _select(self.pipeline, query, self.options)
            ]
            return {"documents": docs}

    return RagBudgetRetriever


def haystack_retriever(pipeline: Any, **options: Any) -> Any:
    """A Haystack 2 component (``run(query) -> {"documents": list[Document]}``) to put before a
    ``PromptBuilder`` in a Haystack ``Pipeline``, returning the passages ragbudget selects.

    It holds a live :class:`~ragbudget.pipeline.Pipeline` (loaded models, an open index), so a
    Haystack pipeline containing it is built in code: ``Pipeline.dumps()``/YAML cannot save it."""
    return _haystack_class()(pipeline, _check_options(options))
