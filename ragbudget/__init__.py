"""ragbudget — retrieval-augmented generation that never runs out of GPU memory.

From the memory actually free on the target GPU down to which chunks go into the prompt:

>>> import ragbudget
>>> rb = ragbudget.Pipeline(".ragbudget")          # doctest: +SKIP
>>> rb.index(["docs/"])                            # doctest: +SKIP
>>> answer = rb.ask("How do I appoint a delegate?")  # doctest: +SKIP
>>> answer.text, answer.report["budget"]           # doctest: +SKIP

``import ragbudget`` is light: torch, transformers, faiss and sentence-transformers are imported
only when a model or an index is first used. Public names resolve lazily from their modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it. One flat package, one module per concept.
_EXPORTS: dict[str, str] = {
    # records and errors
    "Document": "types",
    "Chunk": "types",
    "Source": "types",
    "RagBudgetError": "errors",
    "ConfigError": "errors",
    "ArgumentTypeError": "errors",
    "InputPathError": "errors",
    "LoadError": "errors",
    "ModelError": "errors",
    "IndexError_": "errors",
    "IndexNotFoundError": "errors",
    "IndexEmptyError": "errors",
    "IndexCorruptError": "errors",
    "IndexLockedError": "errors",
    "IndexMismatchError": "errors",
    "BudgetError": "errors",
    "OverloadedError": "errors",
    "RequestCancelled": "errors",
    "EngineError": "errors",
    "EngineConnectionError": "errors",
    "EngineAuthError": "errors",
    "EngineResponseError": "errors",
    "EngineContextError": "errors",
    "EngineOverloadedError": "errors",
    "ExecutorError": "errors",
    # stages
    "load_document": "loaders",
    "scan": "loaders",
    "strip_headers_footers": "clean",
    "chunk_text": "chunking",
    "chunk_document": "chunking",
    "content_hash": "dedup",
    "Deduplicator": "dedup",
    "get_tokenizer": "tokens",
    "kv_cache_bytes": "kvcache",
    "plan_budget": "budget",
    "BudgetPlan": "budget",
    "select_chunks": "select",
    "Selection": "select",
    "select_spans": "spans",
    # stateful nouns
    "Index": "index",
    "SentenceTransformerEmbedder": "embed",
    "HashEmbedder": "embed",
    "Generator": "generate",
    "AdmissionController": "admission",
    "Pipeline": "pipeline",
    "Answer": "pipeline",
    "AnswerStream": "pipeline",
    "Conversation": "chat",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ragbudget' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # cache: the next access skips __getattr__
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .admission import AdmissionController
    from .budget import BudgetPlan, plan_budget
    from .chat import Conversation
    from .chunking import chunk_document, chunk_text
    from .clean import strip_headers_footers
    from .dedup import Deduplicator, content_hash
    from .embed import HashEmbedder, SentenceTransformerEmbedder
    from .errors import (
        ArgumentTypeError,
        BudgetError,
        ConfigError,
        EngineAuthError,
        EngineConnectionError,
        EngineContextError,
        EngineError,
        EngineOverloadedError,
        EngineResponseError,
        ExecutorError,
        IndexCorruptError,
        IndexEmptyError,
        IndexError_,
        IndexLockedError,
        IndexMismatchError,
        IndexNotFoundError,
        InputPathError,
        LoadError,
        ModelError,
        OverloadedError,
        RagBudgetError,
        RequestCancelled,
    )
    from .generate import Generator
    from .index import Index
    from .kvcache import kv_cache_bytes
    from .loaders import load_document, scan
    from .pipeline import Answer, AnswerStream, Pipeline
    from .select import Selection, select_chunks
    from .spans import select_spans
    from .tokens import get_tokenizer
    from .types import Chunk, Document, Source
