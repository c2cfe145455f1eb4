"""ragbudget.retrieval.onnx: the ONNX Runtime backends' availability, their cached export and its
failures. (ONNX vectors against torch's, with the real model, are in test_embed.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ragbudget.memory.models import resolve_embedder
from ragbudget.retrieval.embed import SentenceTransformerEmbedder
from ragbudget.retrieval.onnx import INT8_FILE, available, cache_root, model_digest


def test_available_needs_both_the_runtime_and_the_quantizers_package() -> None:
    code = (
        "import sys; sys.modules['onnx'] = None\n"
        "from ragbudget.retrieval.onnx import available\n"
        "assert not available()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert isinstance(available(), bool)


def test_the_cache_follows_ragbudget_cache(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path))
    assert cache_root() == str(tmp_path / "onnx")


def test_without_onnxruntime_a_clear_error_or_torch() -> None:
    code = (
        "import sys; sys.modules['onnxruntime'] = None\n"
        "from ragbudget.retrieval.embed import SentenceTransformerEmbedder as S, embedder_from_spec\n"
        "from ragbudget.errors import ConfigError\n"
        "assert S().backend == 'torch', S().backend\n"
        "spec = S(backend='torch').spec()\n"
        "assert embedder_from_spec({**spec, 'backend': 'onnx'}).backend == 'torch'\n"
        "for make in (lambda: S(backend='onnx-int8'),\n"
        "             lambda: embedder_from_spec({**spec, 'backend': 'onnx-int8'})):\n"
        "    try:\n"
        "        make()\n"
        "    except ConfigError as exc:\n"
        "        assert \"pip install 'ragbudget[onnx]'\" in str(exc), exc\n"
        "    else:\n"
        "        raise SystemExit('no error')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.model
def test_a_damaged_cached_export_is_a_model_error(tmp_path, monkeypatch) -> None:
    import os

    from ragbudget.errors import ModelError

    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path))
    e = SentenceTransformerEmbedder(backend="onnx-int8")
    folder = resolve_embedder(None)  # the packaged MiniLM, whose export the embedder caches
    cache = tmp_path / "onnx" / model_digest(folder)
    cache.mkdir(parents=True)
    (cache / INT8_FILE).write_bytes(b"not an onnx file")
    with pytest.raises(ModelError, match="delete it"):
        e.warm_up()
    assert os.listdir(cache) == [INT8_FILE]  # no export attempted over a present file
