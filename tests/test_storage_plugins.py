"""Storages: the registry that maps a location to its storage, the contract every storage passes
(tests/_storage_contract.py) on the two built-ins, and a storage from another package — a real
wheel built and pip-installed (``--target``, into a temporary folder: the shared environment
never sees it) that registers a class in the ``ragbudget.storages`` entry points, used by a fresh
interpreter through ``Pipeline``, ``Index``, ``open_storage`` and the CLI, with no edit in
ragbudget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _plugins import install_plugin, plugin_env
from _storage_contract import check_storage

from ragbudget.errors import ConfigError
from ragbudget.retrieval.storage import LocalStorage, open_storage, storage_class, storage_name, storage_names

ROOT = Path(__file__).resolve().parents[1]

PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "ragbudget-scratch-storage"
version = "0.1"

[project.entry-points."ragbudget.storages"]
scratch = "scratch_storage:ScratchStorage"
broken = "scratch_storage:NOT_A_STORAGE"
"""

MODULE = '''\
"""A third-party storage, written only against ragbudget's public storage contract
(``ragbudget.retrieval.storage``: the ``Storage`` protocol, and the ``LocalStorage`` it keeps its
files with; docs/storage.md, "Another storage"): ``scratch://NAME`` is an index in a per-user
scratch folder under ``$SCRATCH_STORAGE_ROOT`` (default: the system's temporary folder), for a
notebook or a CI job that wants an index gone at reboot without choosing where it lives."""
import os
import re
import tempfile
from pathlib import Path

from ragbudget.retrieval.storage import LocalStorage

NOT_A_STORAGE = object()


class ScratchStorage:
    def __init__(self, where):
        name = where.split("://", 1)[1].strip("/")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):  # a plugin's own exception: said in one line
            raise ValueError(f"scratch://NAME: NAME is 1 to 64 letters, digits, _ or -, got {name!r}")
        root = Path(os.environ.get("SCRATCH_STORAGE_ROOT") or tempfile.gettempdir())
        self._files = LocalStorage(root / f"ragbudget-scratch-{os.getuid()}" / name)
        self.where = where
        self.folder = self._files.folder

    def __repr__(self):
        return f"ScratchStorage({self.where!r})"

    def exists(self):
        return self._files.exists()

    def size_bytes(self, manifest):
        return self._files.size_bytes(manifest)

    def read_manifest(self):
        return self._files.read_manifest()

    def current_generation(self):
        return self._files.current_generation()

    def open(self, manifest, *, verify_checksums=True, search_store=True):
        return self._files.open(manifest, verify_checksums=verify_checksums, search_store=search_store)

    def open_for_writing(self, manifest):
        return self._files.open_for_writing(manifest)

    def lock(self):
        return self._files.lock()

    def begin(self, base, *, keep):
        return self._files.begin(base, keep=keep)

    def checkpoint(self, identity):
        return self._files.checkpoint(identity)
'''

# A fresh interpreter with the plugin installed: the storage is found by its URL's scheme, not
# imported before; the contract holds; a registration of something else is refused in one line.
SCRIPT = """\
import json, sys
from pathlib import Path
from ragbudget.errors import ConfigError
from ragbudget.retrieval.storage import open_storage, storage_name, storage_names
from _plugins import install_plugin, plugin_env
from _storage_contract import check_storage

out = {"names": storage_names(), "imported_early": "scratch_storage" in sys.modules}
out["name"] = storage_name("scratch://notes")
out["repr"] = repr(open_storage("scratch://notes"))
out["contract"] = check_storage("scratch://notes", Path(sys.argv[1]))
for bad in ("broken://x", "scratch://no/slashes"):
    try:
        open_storage(bad)
    except ConfigError as exc:
        out[bad] = str(exc)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin package, built and installed into a folder of its own (its ``sys.path``)."""
    files = {"pyproject.toml": PYPROJECT, "scratch_storage.py": MODULE}
    src, site = tmp_path_factory.mktemp("storage-plugin-src"), tmp_path_factory.mktemp("storage-plugin-site")
    return install_plugin(src, site, files)


def _env(plugin: Path, scratch: Path) -> dict[str, str]:
    return plugin_env(plugin, SCRATCH_STORAGE_ROOT=str(scratch))


@pytest.mark.model
def test_the_local_folder_passes_the_storage_contract(tmp_path: Path) -> None:
    seen = check_storage(str(tmp_path / "ix"), tmp_path / "docs")
    assert "is writing the index in" in seen["locked"]


@pytest.mark.model
def test_postgresql_passes_the_storage_contract(pg_url: str, tmp_path: Path) -> None:
    seen = check_storage(pg_url, tmp_path / "docs")
    assert seen["where"].startswith("postgresql://")


def test_a_location_names_its_storage_and_a_url_no_storage_takes_is_refused(tmp_path: Path) -> None:
    assert storage_names()[:2] == ["local", "postgresql"]
    assert storage_name(tmp_path) == "local" and storage_name("./s3:/x") == "local"
    assert storage_name("postgres://db/rag") == storage_name("dbname=rag host=db") == "postgresql"
    assert storage_class("local") is LocalStorage and isinstance(open_storage(tmp_path), LocalStorage)
    with pytest.raises(ConfigError) as exc:
        open_storage("s3://me:s3cret@bucket/rag")
    msg = str(exc.value)
    assert "s3:// URL and no installed storage takes it" in msg and "ragbudget.storages" in msg
    assert "s3cret" not in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="no storage 'nosuch'"):
        storage_class("nosuch")


def test_the_cli_refuses_a_url_no_storage_takes_in_one_line(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ragbudget.cli.commands import cli

    result = CliRunner().invoke(cli, ["stats", "--index", "s3://me:s3cret@bucket/rag"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "no installed storage takes it" in result.output and "s3cret" not in result.output


@pytest.mark.model
def test_an_installed_package_adds_a_storage(plugin: Path, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "docs")],
        capture_output=True,
        text=True,
        env=_env(plugin, tmp_path / "scratch"),
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["names"][:2] == ["local", "postgresql"] and {"scratch", "broken"} <= set(out["names"])
    assert out["imported_early"] is False  # named by its entry point, imported on use only
    assert out["name"] == "scratch" and out["repr"] == "ScratchStorage('scratch://notes')"
    assert out["contract"]["chunks"] >= 3  # and the whole contract held (_storage_contract)
    assert (tmp_path / "scratch" / f"ragbudget-scratch-{os.getuid()}" / "notes" / "manifest.json").is_file()
    assert "registered by ragbudget-scratch-storage" in out["broken://x"]
    assert "not a storage class" in out["broken://x"] and "\n" not in out["broken://x"]
    refused = out["scratch://no/slashes"]
    assert refused.startswith("the storage 'scratch' refused scratch://no/slashes: ValueError: scratch://NAME: NAME")
    assert "\n" not in refused


@pytest.mark.model
def test_the_cli_uses_an_installed_storage(plugin: Path, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\nThe Quillon pear ripens in late October.\n", encoding="utf-8")
    env = _env(plugin, tmp_path / "scratch")
    cli = [sys.executable, "-m", "ragbudget"]
    built = subprocess.run(
        cli + ["index", str(docs), "--index", "scratch://cli"], capture_output=True, text=True, env=env, timeout=600
    )
    assert built.returncode == 0, built.stderr[-3000:]
    stats = subprocess.run(
        cli + ["stats", "--index", "scratch://cli", "--json"], capture_output=True, text=True, env=env, timeout=300
    )
    assert stats.returncode == 0, stats.stderr[-3000:]
    assert json.loads(stats.stdout)["chunks"] >= 1
