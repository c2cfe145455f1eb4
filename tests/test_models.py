"""ragbudget.memory.models: where models come from, configs without weights, and weight bytes from file
headers — each checked against files written here, with expected values computed by hand."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from ragbudget.errors import ModelError
from ragbudget.memory.models import (
    ModelRef,
    gguf_metadata,
    list_model_configs,
    load_model_config,
    resolve_generator,
    weights_bytes_from_files,
)


def _safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A header-only safetensors file (the data is never read by the code under test)."""
    header = {
        name: {"dtype": dtype, "shape": shape, "data_offsets": [0, 0]} for name, (dtype, shape) in tensors.items()
    }
    header["__metadata__"] = {"format": "pt"}  # type: ignore[assignment]
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_weight_bytes_from_safetensors_headers(tmp_path: Path) -> None:
    _safetensors(tmp_path / "a.safetensors", {"w": ("BF16", [1024, 512]), "b": ("F32", [512])})
    _safetensors(tmp_path / "b.safetensors", {"e": ("I8", [3, 5, 7]), "s": ("F8_E4M3", [10])})
    # 1024*512*2 + 512*4 + 3*5*7*1 + 10*1, by hand
    assert weights_bytes_from_files(tmp_path) == 1_048_576 + 2_048 + 105 + 10
    assert weights_bytes_from_files(tmp_path / "b.safetensors") == 115
    empty = tmp_path / "empty"
    empty.mkdir()
    assert weights_bytes_from_files(empty) is None


def test_gguf_metadata_and_config_from_a_written_gguf(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(3)
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_tensor("tok", np.zeros((10, 64), dtype=np.float32))  # 2,560 bytes
    w.add_tensor("out", np.zeros((8,), dtype=np.float16))  # 16 bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, tensor_bytes = gguf_metadata(path)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 3
    assert tensor_bytes == 10 * 64 * 4 + 8 * 2
    assert weights_bytes_from_files(path) == tensor_bytes
    cfg = load_model_config(str(path))
    assert (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["max_position_embeddings"],
    ) == (3, 64, 4, 2, 2048)
    ref = resolve_generator(str(path))
    assert ref == ModelRef(id=str(path), path=str(tmp_path), gguf_file="tiny.gguf") and ref.local
    assert resolve_generator(str(tmp_path)).gguf_file == "tiny.gguf"  # a folder holding one


def test_shipped_snapshots_match_by_id_name_and_base_name() -> None:
    ids = list_model_configs()
    assert "meta-llama/Llama-3.1-8B-Instruct" in ids
    full = load_model_config("meta-llama/Llama-3.1-8B-Instruct")
    assert load_model_config("llama-3.1-8b-instruct") == full  # no org, any case
    assert load_model_config("Llama-3.1-8B") == full  # without -Instruct
    assert full["num_key_value_heads"] == 8 and full["num_hidden_layers"] == 32


def test_unknown_models_and_bad_folders_say_what_to_do(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="close names: .*llama-3.1-8b"):
        load_model_config("llama-3.1-8x")
    with pytest.raises(ModelError, match="neither config.json nor a .gguf"):
        resolve_generator(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    assert resolve_generator(str(tmp_path)) == ModelRef(id=str(tmp_path), path=str(tmp_path))
    assert load_model_config(str(tmp_path))["hidden_size"] == 8
    assert ModelRef(id="org/x").source == "org/x" and not ModelRef(id="org/x").local


def test_a_config_that_is_not_a_json_object_is_a_clear_model_error(tmp_path: Path) -> None:
    # A truncated download or a hand-edited config.json: one line saying which file, not a
    # JSONDecodeError traceback, nor a list handed on as if it were a config.
    broken, listed = tmp_path / "broken", tmp_path / "listed"
    broken.mkdir()
    listed.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", ')
    (listed / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelError, match=r"cannot read the model config .*broken.config\.json"):
        load_model_config(str(broken))
    with pytest.raises(ModelError, match="holds a JSON list, not an object"):
        load_model_config(str(listed))
    with pytest.raises(ModelError, match="holds a JSON list"):
        load_model_config(str(listed / "config.json"))  # a .json file named directly
