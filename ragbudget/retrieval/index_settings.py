"""The settings an index records, and what a later run does with them.

It turns the settings a writing run was given (some, all or none) into the ones it uses,
against what the index's manifest records, and refuse a silent change.

An index records how it was cut (``chunking``: ``min_tokens``, ``max_tokens``, ``overlap``,
``tokenizer``), deduplicated (``dedup``: mode, ``near_threshold``, ``num_perm``, ``shingle``) and cleaned
(``cleaning``: ``clean``), and whether it stores sentence vectors. A later run uses every
recorded setting it is not given; a given one that differs changes the chunks, so the run
re-chunks every file and re-embeds the chunks whose text changed — the cost of a typo'd or
forgotten option, paid in minutes to hours of embedding. :func:`check_changes` refuses such a
run (naming each change, old -> new, and the chunks it would re-embed) unless it says
``rechunk=True`` (``--rechunk``) or ``rebuild=True``. Sentence vectors are not chunk settings:
switching them adds or drops vectors without re-chunking, so a given value applies at once.

>>> old = {"chunking": {"min_tokens": 100, "max_tokens": 200, "overlap": 0, "tokenizer": "cl100k_base"}}
>>> settings, _ = resolve(old, max_tokens=None, min_tokens=None)
>>> settings["chunking"]["max_tokens"], settings["dedup"]["mode"], settings["cleaning"]
(200, 'near', {'clean': True})
>>> changes(old, resolve(old, max_tokens=500)[0])
{'chunking': ['max_tokens 200 -> 500']}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError, IndexMismatchError, ModelError
from ..settings import ChunkSettings, DedupSettings, check_bool, from_keywords
from ..tokens import DEFAULT_ENCODING, Tokenizer, get_tokenizer

__all__ = ["changes", "check_changes", "describe", "recorded", "resolve"]

# Recorded field -> the keyword a caller passes to change it (the names a message shows).
_CHUNK_FIELDS = {"min_tokens": "min_tokens", "max_tokens": "max_tokens", "overlap": "overlap", "tokenizer": "tokenizer"}
_DEDUP_FIELDS = {"mode": "dedup", "threshold": "near_threshold", "num_perm": "num_perm", "shingle": "shingle"}
# The MinHash shingle an index used before it recorded one: its stored signatures hash 3-word
# shingles, so a later run must keep 3 (signatures of different shingles never match).
_SHINGLE_BEFORE_RECORDED = 3
_CLEAN_FIELDS = {"clean": "clean"}
_SECTIONS = (("chunking", _CHUNK_FIELDS), ("dedup", _DEDUP_FIELDS), ("cleaning", _CLEAN_FIELDS))


def _defaults() -> dict[str, dict[str, Any]]:
    """What a new index records when given nothing (the settings records' own defaults)."""
    c, d = ChunkSettings(), DedupSettings()
    return {
        "chunking": {
            "min_tokens": c.min_tokens,
            "max_tokens": c.max_tokens,
            "overlap": c.overlap,
            "tokenizer": DEFAULT_ENCODING,
        },
        "dedup": {"mode": d.mode, "threshold": d.near_threshold, "num_perm": d.num_perm, "shingle": d.shingle},
        "cleaning": {"clean": True},
    }


def recorded(manifest: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The settings ``manifest`` records, section by section; a field it lacks (an index written
    before the field was recorded: ``cleaning`` before this module, for one) reads as the default
    then in force, so an older index is neither refused nor rebuilt for what it never recorded."""
    out = _defaults()
    if manifest is None:
        return out
    for section, fields in _SECTIONS:
        entry = manifest.get(section)
        if isinstance(entry, Mapping):
            out[section].update({k: entry[k] for k in fields if k in entry})
    dups = manifest.get("dedup")
    if isinstance(dups, Mapping) and "shingle" not in dups:
        # Written before the shingle was recorded: not today's default, the one it was built with.
        out["dedup"]["shingle"] = _SHINGLE_BEFORE_RECORDED if dups.get("mode", "near") == "near" else None
    return out


def resolve(
    manifest: Mapping[str, Any] | None,
    *,
    chunking: ChunkSettings | None = None,
    min_tokens: int | None = None,
    max_tokens: int | None = None,
    overlap: int | None = None,
    sentence_vectors: bool | None = None,
    tokenizer: Any = None,
    dedup: str | DedupSettings | None = None,
    near_threshold: float | None = None,
    num_perm: int | None = None,
    clean: bool | None = None,
) -> tuple[dict[str, Any], Tokenizer]:
    """The settings a run uses (the ``settings`` dict :class:`~ragbudget.retrieval.build._Builder` writes
    to the manifest) and its tokenizer: each one given, else the one ``manifest`` records
    (``None``: no index yet), else the default. A record (``chunking=``, ``dedup=``) gives all its
    fields. Raises :class:`~ragbudget.errors.ConfigError` for a bad value or combination."""
    rec = recorded(manifest)
    flat: dict[str, Any] = {
        "min_tokens": min_tokens,
        "max_tokens": max_tokens,
        "overlap": overlap,
        "sentence_vectors": sentence_vectors,
    }
    if chunking is not None:
        sizes = from_keywords(ChunkSettings, chunking, "chunking", flat)
    else:
        given = {k: v for k, v in flat.items() if v is not None}
        kept: dict[str, Any] = {
            k: rec["chunking"][k] for k in ("min_tokens", "max_tokens", "overlap") if k not in given
        }
        # sentence_vectors not given stays None: the builder keeps what the index has (none for a
        # new one; build.py), so that rule is written once.
        try:
            sizes = ChunkSettings(**kept, **given)
        except ConfigError as exc:
            if manifest is None or not given:
                raise
            shown = ", ".join(f"{k}={v}" for k, v in kept.items() if k != "sentence_vectors")
            raise type(exc)(f"{exc} (the index records {shown}: pass those too to change them)") from None

    near = {"near_threshold": near_threshold, "num_perm": num_perm}
    # No keyword of its own: a DedupSettings record (dedup=) is how a caller picks another shingle.
    if isinstance(dedup, DedupSettings):
        dups = from_keywords(DedupSettings, dedup, "dedup", near)
    else:
        old = rec["dedup"]
        mode = dedup if dedup is not None else old["mode"]
        kw: dict[str, Any] = {"mode": mode}
        if mode == old["mode"] == "near":  # the recorded near-duplicate test, unless given another
            kw.update(near_threshold=old["threshold"], num_perm=old["num_perm"], shingle=old["shingle"])
        kw.update({k: v for k, v in near.items() if v is not None})
        dups = DedupSettings(**kw)

    tok = _tokenizer(tokenizer, rec["chunking"]["tokenizer"], manifest is not None)
    settings = {
        "chunking": {
            "min_tokens": sizes.min_tokens,
            "max_tokens": sizes.max_tokens,
            "overlap": sizes.overlap,
            "tokenizer": tok.name,
        },
        "dedup": {
            "mode": dups.mode,
            "threshold": dups.near_threshold if dups.mode == "near" else None,
            "num_perm": dups.num_perm if dups.mode == "near" else None,
            "shingle": dups.shingle if dups.mode == "near" else None,
        },
        "cleaning": {"clean": rec["cleaning"]["clean"] if clean is None else check_bool("clean", clean)},
        # Not a chunk setting: a change only adds or drops the sentence vectors (build.py).
        "sentences": sizes.sentence_vectors,
    }
    return settings, tok


def _tokenizer(given: Any, recorded_name: str, indexed: bool) -> Tokenizer:
    if given is not None or not indexed or recorded_name == DEFAULT_ENCODING:
        return get_tokenizer(given)
    # The index was cut with another tokenizer: a tiktoken encoding loads again by its name; a
    # Hugging Face tokenizer or a function recorded only by name cannot be rebuilt from it.
    try:
        return get_tokenizer(recorded_name)
    except ModelError:
        raise ConfigError(
            f"the index was chunked with tokenizer {recorded_name!r}, which cannot be loaded by that name; "
            f"pass the same tokenizer (tokenizer=...) to update it, or tokenizer={DEFAULT_ENCODING!r} with "
            "rechunk=True to re-chunk it with the default"
        ) from None


def changes(manifest: Mapping[str, Any] | None, settings: Mapping[str, Any]) -> dict[str, list[str]]:
    """The recorded chunking, dedup and cleaning settings ``settings`` changes, by section:
    ``{"chunking": ["max_tokens 200 -> 500"]}`` (empty for a new index). The near-duplicate test's
    fields are named only while both sides use one (``dedup near -> exact`` says it all)."""
    if manifest is None:
        return {}
    rec = recorded(manifest)
    out: dict[str, list[str]] = {}
    for section, fields in _SECTIONS:
        for field, name in fields.items():
            old, new = rec[section][field], settings[section][field]
            if old != new and (section != "dedup" or field == "mode" or None not in (old, new)):
                out.setdefault(section, []).append(f"{name} {old} -> {new}")
    return out


def describe(found: Mapping[str, list[str]]) -> str:
    """``changes(...)`` as one phrase: ``max_tokens 200 -> 500, dedup near -> exact``."""
    return ", ".join(c for section in found.values() for c in section)


def check_changes(manifest: Mapping[str, Any] | None, settings: Mapping[str, Any], *, allowed: bool) -> None:
    """Refuse, before anything is written, a run on an existing index whose settings change its
    chunks, unless ``allowed`` (``rechunk=True`` or ``rebuild=True``): one line naming each
    change and how many chunks it would re-embed (:class:`~ragbudget.errors.IndexMismatchError`)."""
    found = changes(manifest, settings)
    if allowed or not found:
        return
    assert manifest is not None
    counts = manifest.get("counts") or {}
    files, chunks = int(counts.get("files", 0)), int(counts.get("chunks", 0))
    if found.keys() & {"chunking", "cleaning"}:
        # The exact number needs every file read and cut again: a bound is what is known here.
        cost = (
            f"re-chunks its {files} indexed file(s) and re-embeds up to {chunks} chunk(s) "
            "(a chunk whose text comes out the same keeps its vector)"
        )
    else:
        cost = f"re-chunks its {files} indexed file(s) and re-embeds {_dedup_cost(manifest, settings)}"
    raise IndexMismatchError(
        f"this run would change the index's settings ({describe(found)}): that {cost}. Nothing was "
        "changed; pass --rechunk (rechunk=True) to apply the change, or leave these options out to keep "
        "the recorded settings"
    )


def _dedup_cost(manifest: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    """What a dedup-only change re-embeds: a chunk's text is unchanged, so its vector is reused
    (by content hash); only a near duplicate merged so far, standing alone under a stricter test,
    is a text the index has no vector for. Their number is bounded by the merged sources."""
    old, new = recorded(manifest)["dedup"], settings["dedup"]
    stricter = old["mode"] == "near" and (
        new["mode"] != "near"
        or new["threshold"] > old["threshold"]
        or new["num_perm"] != old["num_perm"]
        or new["shingle"] != old["shingle"]
    )
    counts = manifest.get("counts") or {}
    merged = max(0, int(counts.get("sources", 0)) - int(counts.get("chunks", 0)))
    if not stricter or not merged:
        return "no chunk (every text is already in the index: its vector is reused)"
    return f"up to {merged} chunk(s) (near duplicates merged so far that would stand alone)"
