"""ragbudget.memory.cache: where ragbudget keeps what it computes once (converted and assembled
models, calibration), following the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragbudget.memory import models
from ragbudget.memory.cache import cache_dir


def test_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAGBUDGET_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "ragbudget"
    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    assert models.cache_dir is cache_dir  # the resolver's module names the same one
