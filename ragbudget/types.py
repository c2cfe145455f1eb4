"""Small frozen records passed between the pipeline stages.

Stages are functions (``load_document``, ``strip_headers_footers``, ``chunk_text``, ``dedup``,
``select``) and these are what they exchange (and :class:`Refittable`, the one thing generation
asks of a prompt besides its text: a smaller one). Nothing here imports a heavy library.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from .errors import ConfigError

__all__ = [
    "CACHE_KINDS",
    "DTYPE_BITS",
    "DEFAULT_INDEX_DIR",
    "DEFAULT_PACK",
    "DEFAULT_SPAN_FLOOR",
    "FUSIONS",
    "ORDERS",
    "PACKS",
    "PAGE_SEP",
    "QUESTION_STOPWORDS",
    "WEIGHT_DTYPES",
    "Chunk",
    "Document",
    "Hit",
    "IndexSummary",
    "IndexedFile",
    "Refittable",
    "Source",
    "VerifyReport",
    "dtype_bits",
]

#: KV cache layouts (transformers ``cache_implementation`` names): the one list the CLI, the
#: pipeline, the generator and the KV estimate accept. Here, not in kvcache, so that the CLI and
#: the pipeline name them without importing the memory model.
CACHE_KINDS = ("dynamic", "static", "offloaded", "quantized")

#: Bits per element of each dtype name the KV estimate, the weight count and the settings accept.
#: Here, not in kvcache, so that settings checks a ``kv_dtype`` without importing the memory model.
DTYPE_BITS = {
    "float32": 32, "fp32": 32, "float": 32,
    "float16": 16, "fp16": 16, "half": 16,
    "bfloat16": 16, "bf16": 16,
    "float8": 8, "fp8": 8, "fp8_e4m3": 8, "fp8_e5m2": 8, "float8_e4m3fn": 8, "float8_e5m2": 8,
    "int8": 8, "uint8": 8, "int4": 4, "nf4": 4, "fp4": 4, "int2": 2,
}  # fmt: skip


def dtype_bits(dtype: Any) -> int:
    """Bits per element of a dtype given as a string (``"bf16"``, ``"torch.float16"``, ``"fp8"``)
    or a ``torch.dtype``.

    >>> dtype_bits("bf16"), dtype_bits("torch.float32"), dtype_bits("fp8")
    (16, 32, 8)
    """
    name = str(dtype).lower().removeprefix("torch.")
    if name in DTYPE_BITS:
        return DTYPE_BITS[name]
    raise ConfigError(f"unknown dtype {dtype!r}; use one of fp32, fp16, bf16, fp8 (or int8/int4 for weights)")


#: ``weight_dtype`` overrides: the model dtypes, and quantized storage as the common tools write it
#: (``"fp8"`` vLLM's online FP8, ``"int8"`` bitsandbytes LLM.int8, ``"nf4"`` bitsandbytes NF4,
#: ``"int4"`` 4-bit with groups of 128 in AWQ's layout, ``"mxfp4"`` MoE experts in MXFP4, ``"gguf"``
#: a GGUF file's own tensor types). ``None``/``"auto"``: what the checkpoint says.
WEIGHT_DTYPES = ("auto", "fp32", "fp16", "bf16", "fp8", "int8", "int4", "nf4", "mxfp4", "gguf")

# The choice lists below belong to their stages (lexical, select, spans) but live here, like
# CACHE_KINDS, so that settings, which validates them, imports no stage: settings sits below the
# stages (CONTRIBUTING.md's layout).

#: Fusion methods of hybrid search: ``rrf`` (reciprocal rank fusion, Cormack et al. 2009) and
#: ``score`` (min-max normalized scores, weighted sum).
FUSIONS = ("rrf", "score")

#: Context orders. ``lost_in_middle`` puts the best passages at both ends of the context, where
#: models attend most (Liu et al. 2023, "Lost in the Middle").
ORDERS = ("relevance", "document", "lost_in_middle")

#: Packing modes: whole chunks (:func:`~ragbudget.packing.select.select_chunks`) or the question's
#: sentences inside the best chunks (:func:`~ragbudget.packing.spans.select_spans`).
PACKS = ("chunks", "spans")

#: What :class:`~ragbudget.pipeline.Pipeline` (and so ``ask``, ``chat`` and ``serve``) packs
#: unless told otherwise: spans, because on questions never tuned on they hold the answer more
#: often than whole chunks at every budget from 128 to 1,024 tokens (bench/spans_qa.py) and the
#: packaged model's answer F1 was not worse with them (bench/spans_f1.py; BENCHMARKS.md). The
#: stage functions (``build_prompt``, ``select_chunks``) keep whole chunks: without the index's
#: embedder a span scorer has only BM25, which was not measured.
DEFAULT_PACK = "spans"
#: Default ``span_floor``: span packing leaves out a sentence whose evidence is under this
#: fraction of the best sentence's, whatever room is left — the allowance is a cap, not a quota.
#: Filling it (0) made `ask`'s answers worse as the allowance grew: more weak sentences, a small
#: model answering from one of them. Chosen on squad-tune (bench/answers.py, 40 questions,
#: Qwen2.5-Coder-0.5B on llama-server; bench/results/answers_squad_tune_span_floor_*.json), F1 at
#: 256 / 512 / 1,024 tokens (answer in context): 0: 24.4 / 20.0 / 21.4 (88 / 92 / 95%); 0.4:
#: 23.3 / 23.2 / 21.9; 0.5: 23.9 / 24.5 / 25.6 (88 / 92 / 95%); 0.6: 27.1 / 29.3 / 31.5
#: (88 / 90 / 92%); 0.7: 31.0 / 31.5 / 33.3 (82 / 85 / 88%); 0.8: 30.2 / 30.2 / 30.0 (75 / 75 / 78%).
#: 0.6, not 0.7: most of the gain while the answer stays in the context nearly as often — 0.7
#: drops it from 6 to 7 points more questions' contexts, which a stronger reader would pay for.
DEFAULT_SPAN_FLOOR = 0.6

#: The index folder when none is named (the CLI's ``--index-dir``, ``Index``, ``Pipeline``); the
#: loaders never walk into a folder of this name.
DEFAULT_INDEX_DIR = ".ragbudget"

#: Question words that say nothing about where the answer is: the one list the lexical search, chunk
#: selection and span scoring start from (each adds its own few).
# fmt: off
QUESTION_STOPWORDS = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "been", "but", "by", "can", "could", "did", "do",
    "does", "for", "from", "had", "has", "have", "how", "i", "if", "in", "into", "is", "it", "its",
    "of", "on", "or", "so", "than", "that", "the", "their", "them", "then", "there", "these",
    "they", "this", "those", "to", "was", "were", "what", "when", "where", "which", "who", "whom",
    "whose", "why", "will", "with", "would", "you", "your",
))
# fmt: on

#: Pages are joined with a single newline: a sentence running over a page break stays one
#: paragraph for the chunker, while the page boundary offsets are still known exactly.
PAGE_SEP = "\n"


@dataclass(frozen=True)
class Document:
    """A loaded document: its pages (one page for unpaginated formats) and facts about it.

    ``text`` is the pages joined by :data:`PAGE_SEP`; ``page_starts[i]`` is the offset in ``text``
    where page ``i + 1`` begins, so any offset maps back to a 1-based page number.

    >>> d = Document(path="a.txt", pages=["one", "two"])
    >>> d.text, d.page_of(4)
    ('one\\ntwo', 2)
    """

    path: str
    pages: list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return PAGE_SEP.join(self.pages)

    @property
    def page_starts(self) -> list[int]:
        starts, pos = [], 0
        for page in self.pages:
            starts.append(pos)
            pos += len(page) + len(PAGE_SEP)
        return starts

    @property
    def paginated(self) -> bool:
        """True when the source had real pages (PDF, form feeds, fixed-length pages)."""
        return bool(self.meta.get("paginated", len(self.pages) > 1))

    def page_of(self, offset: int) -> int:
        """1-based page number holding character ``offset`` of ``text``."""
        return max(1, bisect.bisect_right(self.page_starts, offset))


@dataclass(frozen=True)
class Chunk:
    """A piece of a text, with exact offsets and token count.

    Invariant: ``text == source_text[start:end]`` and ``n_tokens == len(tokenizer.encode(text))``.
    ``headings`` is the heading path above the chunk; ``page_start``/``page_end`` are 1-based
    page numbers when the document has pages.
    """

    text: str
    start: int
    end: int
    n_tokens: int
    headings: tuple[str, ...] = ()
    page_start: int | None = None
    page_end: int | None = None


@dataclass(frozen=True)
class Source:
    """Where a (possibly deduplicated) chunk's text appears: file, character offsets, pages.

    ``label`` names the pages in the unit of the format when it has one (``slide 3``,
    ``cell 12``, ``rows 41-60``, ``chapter 2``, ``message <id>``; see
    :func:`ragbudget.input.formats.page_label`), else ``None`` and ``page`` is a printed page."""

    path: str
    start: int
    end: int
    page_start: int | None = None
    page_end: int | None = None
    label: str | None = None

    @property
    def page(self) -> int | None:
        return self.page_start

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "start": self.start,
            "end": self.end,
            "page": self.page_start,
            "page_end": self.page_end,
            "label": self.label,
        }


# Records of the index (ragbudget.retrieval.index re-exports them).


@dataclass(frozen=True)
class Hit:
    """A chunk returned by search (``score`` = cosine similarity) or fetched by id (``score`` 0).

    ``sources`` lists every place the text appears (exact and near duplicates), first the one whose
    text is stored.
    """

    chunk_id: int
    score: float
    text: str
    n_tokens: int
    headings: tuple[str, ...] = ()
    sources: tuple[Source, ...] = ()
    windows: int = 1

    @property
    def source(self) -> Source | None:
        """The first (text-owning) source."""
        return self.sources[0] if self.sources else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "chunk_id": self.chunk_id,
            "score": round(float(self.score), 6),
            "text": self.text,
            "n_tokens": self.n_tokens,
            "headings": list(self.headings),
            "sources": [s.to_dict() for s in self.sources],
            "windows": self.windows,
        }


@dataclass(frozen=True)
class IndexSummary:
    """What one :meth:`Index.build` run did. ``skipped`` holds ``(path, reason, detail)`` triples,
    ``warnings`` ``(path, message)`` pairs (e.g. a file decoded by a guessed legacy encoding); paths
    are display paths (see :attr:`Index.absolute_paths`).

    ``files_indexed`` = ``files_added`` (new to the index) + ``files_updated`` (changed, or
    re-read by a rebuild); ``files_removed`` counts indexed files that left the index;
    ``files_kept`` the indexed files under other roots, left untouched. ``chunks_reused`` counts
    vectors not embedded again, ``chunks_resumed`` the part of them taken from the checkpoint of
    an interrupted run. ``sentences_embedded``/``sentences_reused``/``sentence_seconds``: the
    sentence vectors stored for span packing (only chunks without them: see
    :meth:`Index.sentence_vectors`). ``furniture_lines_removed`` counts running heads, footers,
    page numbers and corpus boilerplate; ``contents_lines_removed`` the lines of contents,
    list-of-figures and index pages (:func:`ragbudget.input.clean.find_contents`).
    """

    files_seen: int = 0
    files_indexed: int = 0
    files_unchanged: int = 0
    files_removed: int = 0
    skipped: tuple[tuple[str, str, str], ...] = ()
    chunks_total: int = 0
    chunks_added: int = 0
    chunks_removed: int = 0
    chunks_embedded: int = 0
    chunks_reused: int = 0
    exact_duplicates: int = 0
    near_duplicates: int = 0
    furniture_lines_removed: int = 0
    windows_pooled: int = 0
    windows_embedded: int = 0
    seconds: float = 0.0
    embed_seconds: float = 0.0
    rebuilt: bool = False
    rebuild_reason: str = ""
    generation: int = 0
    committed: bool = False
    files_added: int = 0
    files_updated: int = 0
    files_kept: int = 0
    chunks_resumed: int = 0
    warnings: tuple[tuple[str, str], ...] = ()
    sentences_embedded: int = 0
    sentences_reused: int = 0
    sentence_seconds: float = 0.0
    contents_lines_removed: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["skipped"] = [{"path": p, "reason": r, "detail": x} for p, r, x in self.skipped]
        d["warnings"] = [{"path": p, "message": m} for p, m in self.warnings]
        d["seconds"] = round(self.seconds, 3)
        d["embed_seconds"] = round(self.embed_seconds, 3)
        d["sentence_seconds"] = round(self.sentence_seconds, 3)
        return d


@dataclass(frozen=True)
class IndexedFile:
    """One file the index knows (:meth:`Index.sources`): ``path`` is its display path,
    ``status`` ``"indexed"`` or ``"skipped"`` (``reason``/``detail`` say why), ``chunks`` the
    chunks cut from it (before dedup), ``pages`` its page count when it has real pages,
    ``warning`` e.g. a guessed text encoding."""

    path: str
    status: str
    chunks: int = 0
    pages: int | None = None
    size: int | None = None
    reason: str | None = None
    detail: str | None = None
    warning: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class VerifyReport:
    """Result of :meth:`Index.verify`: ``ok`` when ``problems`` is empty."""

    ok: bool
    problems: tuple[str, ...] = ()
    checked: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "problems": list(self.problems), "checked": dict(self.checked)}


@runtime_checkable
class Refittable(Protocol):
    """A prompt that whoever packed it can pack again into fewer tokens: what the local OOM
    ladder and a served engine's too-long retry ask for, so that generation never drops
    passages or renders a prompt itself. :class:`ragbudget.prompt.prompt.Prompt` is one; its
    :meth:`fewer` goes back to the packer that chose its passages (:mod:`ragbudget.fitting`),
    which packs into the smaller allowance and renders once more."""

    @property
    def n_tokens(self) -> int: ...

    @property
    def fixed_tokens(self) -> int:
        """The tokens no refit can take out (system prompt, history, question)."""
        ...

    def fewer(self, max_prompt_tokens: int) -> Refittable | None:
        """The prompt packed again into at most ``max_prompt_tokens`` (never below the fixed
        part); ``None`` when it has no passage to take out or no packer to ask."""
        ...
