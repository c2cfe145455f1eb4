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

from . import _compat

# The module paths from before the sub-packages still import, with a DeprecationWarning, for one release.
_compat.install()

__version__ = "0.1.0"

# name -> the module that defines it, relative to this package.
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
    "IndexStorageError": "errors",
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
    "ClientTimeoutSettings": "settings",
    "ChunkSettings": "settings",
    "DedupSettings": "settings",
    "QuantizedCacheSettings": "settings",
    # stages
    "load_document": "input.loaders",
    "scan": "input.scan",
    "strip_headers_footers": "input.clean",
    "chunk_text": "input.chunking",
    "chunk_document": "input.chunking",
    "content_hash": "input.dedup",
    "Deduplicator": "input.dedup",
    "get_tokenizer": "tokens",
    "Tokenizer": "tokens",
    "kv_cache_bytes": "memory.kvcache",
    "plan_budget": "memory.budget",
    "BudgetPlan": "memory.budget",
    "select_chunks": "packing.select",
    "Selection": "packing.select",
    "select_spans": "packing.spans",
    # stateful nouns
    "Index": "retrieval.index",
    "Embedder": "retrieval.embed",
    "SentenceTransformerEmbedder": "retrieval.embed",
    "HashEmbedder": "retrieval.embed",
    "Generator": "generation.generate",
    "Generation": "generation.generate",
    "Backend": "generation.backend",
    "AdmissionController": "memory.admission",
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
    from .answer import (
        Answer as Answer,
        AnswerStream as AnswerStream,
    )
    from .chat import Conversation as Conversation
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
        IndexStorageError as IndexStorageError,
        InputPathError as InputPathError,
        LoadError as LoadError,
        ModelError as ModelError,
        OverloadedError as OverloadedError,
        RagBudgetError as RagBudgetError,
        RequestCancelled as RequestCancelled,
        SearchIndexError as SearchIndexError,
    )
    from .generation.backend import Backend as Backend
    from .generation.generate import (
        Generation as Generation,
        Generator as Generator,
    )
    from .input.chunking import (
        chunk_document as chunk_document,
        chunk_text as chunk_text,
    )
    from .input.clean import strip_headers_footers as strip_headers_footers
    from .input.dedup import (
        Deduplicator as Deduplicator,
        content_hash as content_hash,
    )
    from .input.loaders import load_document as load_document
    from .input.scan import scan as scan
    from .memory.admission import AdmissionController as AdmissionController
    from .memory.budget import (
        BudgetPlan as BudgetPlan,
        plan_budget as plan_budget,
    )
    from .memory.kvcache import kv_cache_bytes as kv_cache_bytes
    from .packing.select import (
        Selection as Selection,
        select_chunks as select_chunks,
    )
    from .packing.spans import select_spans as select_spans
    from .pipeline import Pipeline as Pipeline
    from .retrieval.embed import (
        Embedder as Embedder,
        HashEmbedder as HashEmbedder,
        SentenceTransformerEmbedder as SentenceTransformerEmbedder,
    )
    from .retrieval.index import Index as Index
    from .settings import (
        ChunkSettings as ChunkSettings,
        ClientTimeoutSettings as ClientTimeoutSettings,
        DedupSettings as DedupSettings,
        EngineSettings as EngineSettings,
        HistorySettings as HistorySettings,
        MemorySettings as MemorySettings,
        QuantizedCacheSettings as QuantizedCacheSettings,
        QueueSettings as QueueSettings,
        RetrievalSettings as RetrievalSettings,
    )
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
