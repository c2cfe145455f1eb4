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
    "Hit": "types",
    "IndexSummary": "types",
    "RagBudgetError": "errors",
    "ConfigError": "errors",
    "ArgumentTypeError": "errors",
    "InputPathError": "errors",
    "LoadError": "errors",
    "ModelError": "errors",
    "SearchIndexError": "errors",
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
    "EngineTimeoutError": "errors",
    "ExecutorError": "errors",
    # settings records
    "RetrievalSettings": "settings",
    "MemorySettings": "settings",
    "QueueSettings": "settings",
    "EngineSettings": "settings",
    "HistorySettings": "settings",
    "ChunkSettings": "settings",
    "DedupSettings": "settings",
    "QuantizedCacheSettings": "settings",
    # stages
    "load_document": "loaders",
    "scan": "loaders",
    "strip_headers_footers": "clean",
    "chunk_text": "chunking",
    "chunk_document": "chunking",
    "content_hash": "dedup",
    "Deduplicator": "dedup",
    "get_tokenizer": "tokens",
    "Tokenizer": "tokens",
    "kv_cache_bytes": "kvcache",
    "plan_budget": "budget",
    "BudgetPlan": "budget",
    "select_chunks": "select",
    "Selection": "select",
    "select_spans": "spans",
    # stateful nouns
    "Index": "index",
    "Embedder": "embed",
    "SentenceTransformerEmbedder": "embed",
    "HashEmbedder": "embed",
    "Generator": "generate",
    "Generation": "generate",
    "Backend": "backend",
    "AdmissionController": "admission",
    "Pipeline": "pipeline",
    "Answer": "answer",
    "AnswerStream": "answer",
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
    # `X as X`: an explicit re-export (mypy --no-implicit-reexport, ruff F401).
    from .admission import AdmissionController as AdmissionController
    from .answer import (
        Answer as Answer,
        AnswerStream as AnswerStream,
    )
    from .backend import Backend as Backend
    from .budget import (
        BudgetPlan as BudgetPlan,
        plan_budget as plan_budget,
    )
    from .chat import Conversation as Conversation
    from .chunking import (
        chunk_document as chunk_document,
        chunk_text as chunk_text,
    )
    from .clean import strip_headers_footers as strip_headers_footers
    from .dedup import (
        Deduplicator as Deduplicator,
        content_hash as content_hash,
    )
    from .embed import (
        Embedder as Embedder,
        HashEmbedder as HashEmbedder,
        SentenceTransformerEmbedder as SentenceTransformerEmbedder,
    )
    from .errors import (
        ArgumentTypeError as ArgumentTypeError,
        BudgetError as BudgetError,
        ConfigError as ConfigError,
        EngineAuthError as EngineAuthError,
        EngineConnectionError as EngineConnectionError,
        EngineContextError as EngineContextError,
        EngineError as EngineError,
        EngineOverloadedError as EngineOverloadedError,
        EngineResponseError as EngineResponseError,
        EngineTimeoutError as EngineTimeoutError,
        ExecutorError as ExecutorError,
        IndexCorruptError as IndexCorruptError,
        IndexEmptyError as IndexEmptyError,
        IndexLockedError as IndexLockedError,
        IndexMismatchError as IndexMismatchError,
        IndexNotFoundError as IndexNotFoundError,
        InputPathError as InputPathError,
        LoadError as LoadError,
        ModelError as ModelError,
        OverloadedError as OverloadedError,
        RagBudgetError as RagBudgetError,
        RequestCancelled as RequestCancelled,
        SearchIndexError as SearchIndexError,
    )
    from .generate import (
        Generation as Generation,
        Generator as Generator,
    )
    from .index import Index as Index
    from .kvcache import kv_cache_bytes as kv_cache_bytes
    from .loaders import (
        load_document as load_document,
        scan as scan,
    )
    from .pipeline import Pipeline as Pipeline
    from .select import (
        Selection as Selection,
        select_chunks as select_chunks,
    )
    from .settings import (
        ChunkSettings as ChunkSettings,
        DedupSettings as DedupSettings,
        EngineSettings as EngineSettings,
        HistorySettings as HistorySettings,
        MemorySettings as MemorySettings,
        QuantizedCacheSettings as QuantizedCacheSettings,
        QueueSettings as QueueSettings,
        RetrievalSettings as RetrievalSettings,
    )
    from .spans import select_spans as select_spans
    from .tokens import (
        Tokenizer as Tokenizer,
        get_tokenizer as get_tokenizer,
    )
    from .types import (
        Chunk as Chunk,
        Document as Document,
        Hit as Hit,
        IndexSummary as IndexSummary,
        Source as Source,
    )
