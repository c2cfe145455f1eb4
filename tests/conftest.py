"""Shared fixtures: where the shared real data lives, and model-free fakes.

Real models sit behind the ``slow`` marker (they are small and run in CI too); CUDA tests behind
``gpu`` and skip cleanly without a device.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The embedded default models are installed packages; never wait on an unreachable hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"
SHARED = Path(os.environ.get("RAGBUDGET_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def repo_data() -> Path:
    """The small corpus shipped in the repo's ``data/`` folder."""
    return DATA


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (real documents written by others); skips when absent."""
    if not SHARED.is_dir():
        pytest.skip(f"shared data not found at {SHARED}")
    return SHARED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing or broken: no GPU tests either way
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
