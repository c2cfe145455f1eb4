"""The settings records: each field checked once where the record is built (one error per bad
field, the library's own error types), frozen and keyword-only, and the flat keywords of the
public entry points only sugar for them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ragbudget.errors import ArgumentTypeError, ConfigError
from ragbudget.settings import (
    ChunkSettings,
    ClientTimeoutSettings,
    DedupSettings,
    EngineSettings,
    HistorySettings,
    MemorySettings,
    QuantizedCacheSettings,
    QueueSettings,
    RetrievalSettings,
)

RECORDS = (
    RetrievalSettings,
    MemorySettings,
    QueueSettings,
    EngineSettings,
    HistorySettings,
    ChunkSettings,
    DedupSettings,
    QuantizedCacheSettings,
    ClientTimeoutSettings,
)

# (record, the one bad field, the error, what its message says)
BAD = [
    (RetrievalSettings, {"fetch_k": 0}, ConfigError, "fetch_k must be ≥ 1, got 0"),
    (RetrievalSettings, {"fetch_k": "50"}, ArgumentTypeError, r"fetch_k must be an int.*int\(\)"),
    (RetrievalSettings, {"hybrid": "no"}, ArgumentTypeError, "hybrid must be True or False"),
    (RetrievalSettings, {"lexical_weight": 1.5}, ConfigError, r"lexical_weight must be in \[0, 1\].*hybrid=False"),
    (RetrievalSettings, {"lexical_weight": -0.1}, ConfigError, "lexical_weight must be ≥ 0"),
    (RetrievalSettings, {"fusion": "max"}, ConfigError, "fusion must be one of rrf, score; got 'max'"),
    (RetrievalSettings, {"order": "random"}, ConfigError, "order must be one of relevance"),
    (RetrievalSettings, {"pack": "pages"}, ConfigError, "pack must be one of chunks, spans"),
    (RetrievalSettings, {"fill_remainder": True}, ConfigError, "pack='chunks'"),
    (RetrievalSettings, {"relevance_floor": 2}, ConfigError, r"relevance_floor must be in \[0, 1\], got 2"),
    (RetrievalSettings, {"relevance_floor": float("nan")}, ConfigError, "relevance_floor must be in"),
    (RetrievalSettings, {"span_floor": -0.5}, ConfigError, r"span_floor must be in \[0, 1\], got -0.5"),
    (RetrievalSettings, {"evidence_floor": 1.5}, ConfigError, r"evidence_floor must be in \[0, 1\], got 1.5"),
    (MemorySettings, {"gpu": ["24GiB"]}, ArgumentTypeError, "gpu must be 'auto', a GPU name"),
    (MemorySettings, {"gpu": "potato"}, ConfigError, "unknown GPU 'potato'"),
    (MemorySettings, {"gpu": 24}, ConfigError, r"gpu=24 has no unit, so it is bytes.*pass '24GiB'"),
    (MemorySettings, {"gpu": "0xH100"}, ConfigError, "GPU count must be ≥ 1"),
    (MemorySettings, {"kv_dtype": "potato"}, ConfigError, "kv_dtype must be a dtype such as fp16.*got 'potato'"),
    (MemorySettings, {"concurrency": 0}, ConfigError, "concurrency must be ≥ 1"),
    (MemorySettings, {"max_new_tokens": 2.5}, ArgumentTypeError, "max_new_tokens must be an int"),
    (MemorySettings, {"kv_dtype": 8}, ArgumentTypeError, "kv_dtype must be str"),
    (MemorySettings, {"cache": "paged"}, ConfigError, "cache must be one of dynamic, static"),
    (MemorySettings, {"utilization": 0}, ConfigError, r"utilization must be in \(0, 1\]"),
    (MemorySettings, {"ttft_target": -1}, ConfigError, "ttft_target must be ≥ 0"),
    (QueueSettings, {"size": -1}, ConfigError, "queue_size must be ≥ 0"),
    (QueueSettings, {"timeout": "30"}, ArgumentTypeError, "queue_timeout must be a number"),
    (EngineSettings, {"url": b"http://h"}, ArgumentTypeError, "engine must be str.*decode it"),
    (EngineSettings, {"kind": "triton"}, ConfigError, "engine_kind must be auto or one of vllm, sglang"),
    (EngineSettings, {"api_key": "k", "api_key_env": "KEY"}, ConfigError, "api_key or api_key_env, not both"),
    (EngineSettings, {"context_tokens": 1}, ConfigError, "engine_context_tokens must be ≥ 2"),
    (EngineSettings, {"timeout": 0}, ConfigError, r"engine_timeout must be > 0"),
    (HistorySettings, {"history_share": 1.0}, ConfigError, r"history_share must be in \[0, 1\), got 1.0"),
    (HistorySettings, {"summary_max_tokens": 0}, ConfigError, "summary_max_tokens must be ≥ 1"),
    (HistorySettings, {"recent_turns": -1}, ConfigError, "recent_turns must be ≥ 0"),
    (HistorySettings, {"expand_follow_ups": 1}, ArgumentTypeError, "expand_follow_ups must be True or False"),
    (HistorySettings, {"rewrite_with_model": "yes"}, ArgumentTypeError, "rewrite_with_model must be True or False"),
    (HistorySettings, {"summary_role": "tool"}, ConfigError, "summary_role must be one of system, user"),
    (HistorySettings, {"max_messages": 0}, ConfigError, "max_messages must be ≥ 1"),
    (HistorySettings, {"max_history_chars": "1e6"}, ArgumentTypeError, "max_history_chars must be an int"),
    (ClientTimeoutSettings, {"header_timeout": -1}, ConfigError, "header_timeout must be ≥ 0, got -1"),
    (ClientTimeoutSettings, {"body_idle_timeout": float("nan")}, ConfigError, "body_idle_timeout must be ≥ 0"),
    (ClientTimeoutSettings, {"body_timeout": "30"}, ArgumentTypeError, "body_timeout must be a number"),
    (ChunkSettings, {"max_tokens": 4}, ConfigError, "max_tokens must be an integer >= 8"),
    (ChunkSettings, {"min_tokens": 600}, ConfigError, "lower min_tokens or raise max_tokens"),
    (ChunkSettings, {"overlap": 300}, ConfigError, r"overlap must be between 0 and max_tokens // 2 \(250\)"),
    (ChunkSettings, {"overlap": 1.5}, ArgumentTypeError, "overlap must be an int"),
    (ChunkSettings, {"sentence_vectors": "no"}, ArgumentTypeError, "sentence_vectors must be True or False"),
    (DedupSettings, {"mode": "fuzzy"}, ConfigError, "dedup must be one of near, exact, none"),
    (DedupSettings, {"near_threshold": 0}, ConfigError, r"near_threshold must be in \(0, 1\]"),
    (DedupSettings, {"num_perm": 1}, ConfigError, "num_perm must be ≥ 2"),
    (DedupSettings, {"shingle": 0}, ConfigError, "shingle must be ≥ 1"),
    (QuantizedCacheSettings, {"quant_backend": "int4"}, ConfigError, "quant_backend must be one of quanto"),
    (QuantizedCacheSettings, {"nbits": 3}, ConfigError, "quanto quantizes the KV cache to 2, 4 bits"),
    (QuantizedCacheSettings, {"q_group_size": 0}, ConfigError, "q_group_size must be ≥ 1"),
    (QuantizedCacheSettings, {"residual_length": -1}, ConfigError, "residual_length must be ≥ 0"),
    (QuantizedCacheSettings, {"quant_backend": "hqq", "q_axis": -1}, ConfigError, "hqq groups along axis 0 or 1"),
]


@pytest.mark.parametrize(
    ("cls", "kwargs", "error", "match"), BAD, ids=[f"{c.__name__}-{'-'.join(k)}" for c, k, _, _ in BAD]
)
def test_a_bad_field_is_refused_when_the_record_is_built(
    cls: type, kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match) as e:
        cls(**kwargs)
    assert "\n" not in str(e.value)  # one line, for the CLI to print
    assert isinstance(e.value, ConfigError)  # one except clause catches every bad setting


def test_every_field_of_every_record_is_checked() -> None:
    # A field added to a record without a check (nor a case above) is caught here.
    checked = {(cls, name) for cls, kwargs, _, _ in BAD for name in kwargs}
    unchecked_by_design = {(EngineSettings, "tokenizer")}  # a name, a folder or a tokenizer object
    for cls in RECORDS:
        for f in dataclasses.fields(cls):
            assert (cls, f.name) in checked | unchecked_by_design, f"{cls.__name__}.{f.name} has no bad-value case"


@pytest.mark.parametrize("cls", RECORDS)
def test_records_are_frozen_keyword_only_and_equal_by_value(cls: type) -> None:
    record = cls()
    first = dataclasses.fields(cls)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, first.name, getattr(record, first.name))
    with pytest.raises(TypeError):
        cls(getattr(record, first.name))  # positional
    assert cls() == record and hash(cls()) == hash(record)
    # replace() builds a new record, so it is checked again.
    with pytest.raises(ConfigError):
        dataclasses.replace(record, **{f.name: object() for f in dataclasses.fields(cls)[:1]})


def test_numbers_are_stored_as_the_type_they_mean() -> None:
    r = RetrievalSettings(lexical_weight=1, relevance_floor=0)
    assert isinstance(r.lexical_weight, float) and isinstance(r.relevance_floor, float)
    assert MemorySettings(utilization=1).utilization == 1.0
    assert type(QueueSettings(timeout=5).timeout) is float


def test_the_engine_key_is_never_shown() -> None:
    s = EngineSettings(url="http://127.0.0.1:9/v1", api_key="sk-secret")
    assert "sk-secret" not in repr(s) and "sk-secret" not in str(s)
    assert s.api_key == "sk-secret"


# -- the flat keywords are sugar for the records ----------------------------------------------------


def test_flat_keywords_and_records_build_equal_pipelines(tmp_path: Path) -> None:
    from ragbudget.pipeline import Pipeline

    flat = Pipeline(
        tmp_path,
        fetch_k=20,
        fusion="rrf",
        lexical_weight=0.3,
        pack="chunks",
        fill_remainder=True,
        gpu="24GiB",
        concurrency=3,
        max_new_tokens=64,
        cache="static",
        ttft_target=0,
        queue_size=5,
        queue_timeout=2,
        engine="http://127.0.0.1:9/v1",
        engine_kind="vllm",
        engine_timeout=5,
    )
    records = Pipeline(
        tmp_path,
        retrieval=RetrievalSettings(fetch_k=20, fusion="rrf", lexical_weight=0.3, pack="chunks", fill_remainder=True),
        memory=MemorySettings(gpu="24GiB", concurrency=3, max_new_tokens=64, cache="static", ttft_target=0),
        queue=QueueSettings(size=5, timeout=2),
        engine=EngineSettings(url="http://127.0.0.1:9/v1", kind="vllm", timeout=5),
    )
    for name in ("retrieval", "memory", "queue", "engine"):
        assert getattr(flat, name) == getattr(records, name), name
    assert repr(flat) == repr(records)
    # Defaults are the records' defaults.
    plain = Pipeline(tmp_path)
    assert (plain.retrieval, plain.memory, plain.queue, plain.engine) == (
        RetrievalSettings(),
        MemorySettings(),
        QueueSettings(),
        EngineSettings(),
    )
    # The flat names still read the settings, from the records, and cannot be changed.
    assert (flat.fetch_k, flat.concurrency, flat.queue_size, flat.queue_timeout) == (20, 3, 5, 2.0)
    with pytest.raises(AttributeError, match=r"dataclasses.replace\(old.retrieval, fetch_k=...\)"):
        flat.fetch_k = 5  # type: ignore[misc]


def test_flat_and_record_search_the_same(tmp_path: Path) -> None:
    from ragbudget.pipeline import Pipeline

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"n{i}.txt").write_text(f"Note {i} about harbours, tides and ships. " * 20)
    (docs / "zebra.txt").write_text("The quagga was a subspecies of zebra. " * 20)
    Pipeline(tmp_path / "idx", embedder="hash:64").index([docs])

    def ranked(pipe: Pipeline) -> list[tuple[int, float]]:
        return [(h.chunk_id, round(h.score, 6)) for h in pipe.search("quagga zebra", k=4)]

    flat = ranked(Pipeline(tmp_path / "idx", fusion="rrf", lexical_weight=0.8))
    record = ranked(Pipeline(tmp_path / "idx", retrieval=RetrievalSettings(fusion="rrf", lexical_weight=0.8)))
    assert flat == record != ranked(Pipeline(tmp_path / "idx", hybrid=False))


@pytest.mark.parametrize(
    ("record", "flat"),
    [
        ({"retrieval": RetrievalSettings()}, {"fetch_k": 10}),
        ({"memory": MemorySettings()}, {"concurrency": 2}),
        ({"queue": QueueSettings()}, {"queue_size": 2}),
        ({"engine": EngineSettings(url="http://127.0.0.1:9/v1")}, {"engine_kind": "vllm"}),
    ],
)
def test_a_record_with_its_flat_keywords_is_refused(
    tmp_path: Path, record: dict[str, Any], flat: dict[str, Any]
) -> None:
    from ragbudget.pipeline import Pipeline

    (keyword,), (name,) = record, flat
    with pytest.raises(ConfigError, match=f"pass {keyword}=.*or its keywords \\({name}\\), not both"):
        Pipeline(tmp_path, **record, **flat)


def test_a_record_of_the_wrong_kind_is_a_type_error(tmp_path: Path) -> None:
    from ragbudget.pipeline import Pipeline

    with pytest.raises(ArgumentTypeError, match="retrieval must be a RetrievalSettings, got MemorySettings"):
        Pipeline(tmp_path, retrieval=MemorySettings())  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="memory must be a MemorySettings, got dict"):
        Pipeline(tmp_path, memory={"concurrency": 2})  # type: ignore[arg-type]


@pytest.mark.model
def test_conversation_history_record_or_keywords() -> None:
    from ragbudget.chat import Conversation
    from ragbudget.pipeline import Pipeline

    pipe = Pipeline(".nowhere")
    flat = Conversation(pipe, history_share=0.5, recent_turns=1, summary_role="user")
    record = Conversation(pipe, history=HistorySettings(history_share=0.5, recent_turns=1, summary_role="user"))
    assert flat.history == record.history and flat.recent_turns == 1 and record.history_share == 0.5
    with pytest.raises(ConfigError, match=r"pass history=HistorySettings\(...\) or its keywords \(recent_turns\)"):
        Conversation(pipe, history=HistorySettings(), recent_turns=3)


def test_index_build_chunk_and_dedup_records(tmp_path: Path) -> None:
    from ragbudget.retrieval.embed import HashEmbedder
    from ragbudget.retrieval.index import Index

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Harbours hold ships at low tide. " * 60)
    with pytest.raises(ConfigError, match=r"chunking=ChunkSettings\(...\) or its keywords \(max_tokens\)"):
        Index(tmp_path / "x").build([docs], embedder=HashEmbedder(32), chunking=ChunkSettings(), max_tokens=200)
    with pytest.raises(ConfigError, match=r"dedup=DedupSettings\(...\) or its keywords \(num_perm\)"):
        Index(tmp_path / "x").build([docs], embedder=HashEmbedder(32), dedup=DedupSettings(), num_perm=64)
    with pytest.raises(ConfigError, match="near_threshold must be in"):
        Index(tmp_path / "x").build([docs], embedder=HashEmbedder(32), near_threshold=1.5)
    assert not (tmp_path / "x").exists()  # refused before anything was written
    flat = Index(tmp_path / "flat").build(
        [docs], embedder=HashEmbedder(32), min_tokens=50, max_tokens=100, dedup="exact"
    )
    record = Index(tmp_path / "rec").build(
        [docs],
        embedder=HashEmbedder(32),
        chunking=ChunkSettings(min_tokens=50, max_tokens=100),
        dedup=DedupSettings(mode="exact"),
    )
    assert flat.chunks_total == record.chunks_total > 1
    a, b = Index.open(tmp_path / "flat").stats(), Index.open(tmp_path / "rec").stats()
    assert (a["chunking"], a["dedup"]) == (b["chunking"], b["dedup"])
    assert a["chunking"]["max_tokens"] == 100 and a["dedup"]["mode"] == "exact"


def test_estimate_kv_quantized_record_or_keywords() -> None:
    from ragbudget.memory.kvcache import estimate_kv

    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "torch_dtype": "bfloat16",
    }
    q = QuantizedCacheSettings(quant_backend="hqq", nbits=2, q_group_size=32, residual_length=16, q_axis=1)
    flat = estimate_kv(
        cfg,
        1000,
        cache="quantized",
        quant_backend="hqq",
        nbits=2,
        q_group_size=32,
        residual_length=16,
        q_axis=1,
        normalize=False,
    )
    record = estimate_kv(cfg, 1000, cache="quantized", quantized=q, normalize=False)
    assert flat == record
    assert record.steady_bytes < estimate_kv(cfg, 1000, cache="quantized", normalize=False).steady_bytes
    with pytest.raises(ConfigError, match=r"quantized=QuantizedCacheSettings\(...\) or its keywords \(nbits\)"):
        estimate_kv(cfg, 10, cache="quantized", quantized=q, nbits=4)


def test_connect_takes_the_engine_record_whole() -> None:
    from ragbudget.generation.engines import connect

    with pytest.raises(ConfigError, match=r"or its keywords \(kind\), not both"):
        connect(EngineSettings(url="http://127.0.0.1:9/v1"), kind="vllm")
    with pytest.raises(ConfigError, match="needs the engine's URL"):
        connect(EngineSettings())
    with pytest.raises(ConfigError, match="engine_kind must be auto or one of"):
        connect("http://127.0.0.1:9/v1", kind="triton")


def test_the_records_are_exported_from_ragbudget() -> None:
    import ragbudget

    for cls in RECORDS:
        assert getattr(ragbudget, cls.__name__) is cls and cls.__name__ in ragbudget.__all__


def test_a_history_over_its_limits_is_refused_naming_the_limit_the_value_and_the_flag() -> None:
    limits = HistorySettings(max_messages=3, max_history_chars=100)
    limits.check_size(messages=3, chars=100)  # at the limits: accepted
    with pytest.raises(
        ConfigError, match=r"has 4 messages, more than the limit of 3 \(max_messages; serve --max-messages\)"
    ):
        limits.check_size(messages=4, chars=0)
    with pytest.raises(
        ConfigError, match=r"hold 101 characters, more than the limit of 100 \(max_history_chars; serve"
    ):
        limits.check_size(messages=1, chars=101)
    # The defaults take what a real chat sends: a thousand exchanges, 512,000 characters.
    HistorySettings().check_size(messages=2048, chars=512_000)
