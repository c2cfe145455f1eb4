"""The ``ragbudget`` command: a thin click layer over the library.

Library errors (:class:`ragbudget.errors.RagBudgetError`) become a one-line message and exit code 1
here and only here (:func:`ragbudget.cli.options.user_errors`, which every command runs inside);
click's usage errors exit with 2. Commands that print data take ``--json``. The options several
commands share are :mod:`ragbudget.cli.options`; what a command prints is :mod:`ragbudget.cli.display`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import Any  # Any: sampling options as the generator takes them (keywords, see options.sampling_options)

import click

from ..retrieval.vectors import STORES
from ..settings import (
    DEDUP_MODES,
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_REQUEST_TIMEOUT,
    ChunkSettings,
    ClientTimeoutSettings,
    DedupSettings,
    EngineSettings,
    HistorySettings,
    MemorySettings,
    RetrievalSettings,
)
from ..types import DEFAULT_INDEX_DIR, WEIGHT_DTYPES
from .display import format_index_summary
from .models import models
from .options import (
    client_timeout_options,
    echo_json,
    engine_options,
    history_options,
    index_dir_option,
    memory_options,
    model_option,
    plan_options,
    retrieval_options,
    sampling_options,
    search_options,
    served_history_options,
    setting,
    source_option,
    user_errors,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ragbudget")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """ragbudget: RAG whose prompts always fit the GPU's memory."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    if verbose == 0:
        # transformers' per-tensor "Loading weights" bars drown the answer; -v brings them back.
        # (Read when transformers is first imported, which every command does lazily, later.)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        if "transformers" in sys.modules:  # already imported (an embedding host): tell it directly
            sys.modules["transformers"].utils.logging.disable_progress_bar()
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


# --- index / search / stats / verify -------------------------------------------------------------


@cli.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@index_dir_option
@click.option(
    "--embedder", default=None, help="sentence-transformers model id or path (default: packaged all-MiniLM-L6-v2)."
)
@click.option("--include", multiple=True, help="Glob of files to include (repeatable).")
@click.option("--exclude", multiple=True, help="Glob of files to exclude (repeatable).")
@click.option("--max-file-mb", default=50.0, show_default=True, type=float, help="Skip files larger than this.")
@click.option(
    "--min-tokens",
    default=None,
    type=click.IntRange(min=1),
    help=f"Smallest chunk, in tokens. Default: what the index records, else {setting(ChunkSettings, 'min_tokens')}.",
)
@click.option(
    "--max-tokens",
    default=None,
    type=click.IntRange(min=1),
    help=f"Largest chunk, in tokens. Default: what the index records, else {setting(ChunkSettings, 'max_tokens')}.",
)
@click.option(
    "--sentence-vectors/--no-sentence-vectors",
    default=None,
    help="--sentence-vectors stores every chunk's sentence vectors at build time (a second pass, about 1.1x the "
    "chunk embedding; about doubles the index on disk), so span packing embeds no sentence per question. "
    "--no-sentence-vectors leaves them out (and drops them from this index): span packing then embeds a "
    "sentence the first time a question needs it and keeps it in the cache beside the index. Default: what "
    "the index has (none for a new one); --pack chunks never needs them.",
)
@click.option("--rebuild", is_flag=True, help="Re-read and re-embed every indexed root (and PATHS) from scratch.")
@click.option(
    "--rechunk",
    is_flag=True,
    help="Apply chunking or dedup options that differ from the ones the index records (re-chunks every file, "
    "re-embeds the chunks whose text changes). Without it such a run is refused and changes nothing.",
)
@click.option(
    "--prune",
    is_flag=True,
    help="Mirror PATHS exactly: also remove indexed files that are not under them (other roots included).",
)
@click.option(
    "--allow-removal",
    is_flag=True,
    help="Allow a run that removes all indexed files, or more than 5 and over 20% of them.",
)
@click.option(
    "--store",
    # Not a click.Choice: a store may come from another package's ragbudget.stores entry point,
    # and listing those at import would cost every command; the build refuses an unknown name.
    default="auto",
    show_default=True,
    metavar="STORE",
    help=f"Vector store that answers searches: {', '.join(STORES)}, or one a package registers under the "
    "ragbudget.stores entry points. auto = exact while small, then HNSW, then IVF-PQ (recall@10 measured "
    "at build, shown by `stats`).",
)
@click.option(
    "--dedup",
    type=click.Choice(DEDUP_MODES),
    default=None,
    help=f"Duplicate chunk removal. Default: what the index records, else {setting(DedupSettings, 'mode')}.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--ipynb-outputs", is_flag=True, help="Also index the text outputs of notebook code cells.")
@click.option(
    "--json-fields",
    default="",
    metavar="KEYS",
    help="Comma-separated JSON key names or key paths (globs) whose strings are indexed; default: every string value.",
)
@click.option(
    "--ocr", is_flag=True, help="OCR PDF pages without a text layer (needs ragbudget[ocr] and tesseract-ocr)."
)
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Where chunks are embedded: this process, or Ray Data on a Ray cluster (needs ragbudget[ray]).",
)
@click.option(
    "--ray-address",
    default=None,
    metavar="ADDR",
    help="Ray cluster to join with --executor ray (host:port, ray://host:port or auto); default: $RAY_ADDRESS, else "
    "a local Ray started for this run.",
)
@click.option(
    "--embed-workers",
    default=None,
    type=click.IntRange(min=1),
    metavar="N",
    help="Embedding actors with --executor ray, one model copy each (default: one per GPU, else one per CPU of the "
    "cluster).",
)
@user_errors
def index(
    paths: tuple[str, ...],
    index_dir: str,
    embedder: str | None,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    max_file_mb: float,
    min_tokens: int | None,
    max_tokens: int | None,
    sentence_vectors: bool | None,
    rebuild: bool,
    rechunk: bool,
    prune: bool,
    allow_removal: bool,
    store: str,
    dedup: str | None,
    as_json: bool,
    ipynb_outputs: bool,
    json_fields: str,
    ocr: bool,
    executor: str,
    ray_address: str | None,
    embed_workers: int | None,
) -> None:
    """Add files and folders to the index, or update them (unchanged files cost one stat).

    Files indexed from other paths stay; a file that vanished from under PATHS is removed.
    A PATH that does not exist is an error and changes nothing. Chunking and dedup options left
    out keep what the index records; one that changes them is refused unless --rechunk is given.
    Changing --ipynb-outputs, --json-fields or --ocr re-reads only changed files: add --rebuild
    to apply them to all.

    --executor ray embeds on a Ray cluster (Ray Data over an actor pool); the index it writes is
    the one --executor local writes."""
    from ..errors import ConfigError
    from ..input.formats import LoadOptions, load_options
    from ..pipeline import Pipeline
    from ..retrieval.executors import RayExecutor
    from .terminal import Progress

    if executor != "ray" and (ray_address is not None or embed_workers is not None):
        raise ConfigError(
            "--ray-address and --embed-workers apply to --executor ray; add "
            "--executor ray, or leave them out to embed in this process"
        )
    run_on: str | RayExecutor = executor
    if executor == "ray":
        run_on = RayExecutor(address=ray_address or os.environ.get("RAY_ADDRESS") or None, workers=embed_workers)

    pipe = Pipeline(index_dir, embedder=embedder)
    fields = tuple(f.strip() for f in json_fields.split(",") if f.strip())
    # Index.build does not take loader options yet; load_options makes them the default of every
    # load_document call it makes (a context variable, same thread).
    with (
        load_options(LoadOptions(ipynb_outputs=ipynb_outputs, json_fields=fields, ocr=ocr)),
        Progress(enabled=not as_json) as progress,
    ):
        summary = pipe.index(
            list(paths),
            include=list(include) or None,
            exclude=list(exclude) or None,
            max_bytes=int(max_file_mb * 1024 * 1024),
            # Unset options are None: the index keeps what it records (index_settings.py).
            min_tokens=min_tokens,
            max_tokens=max_tokens,
            sentence_vectors=sentence_vectors,
            rebuild=rebuild,
            rechunk=rechunk,
            prune=prune,
            allow_removal=allow_removal,
            store=store,
            dedup=dedup,
            progress=progress,
            executor=run_on,
        )
    data = summary.to_dict()
    if as_json:
        echo_json(data)
        return
    click.echo(format_index_summary(data))


@cli.command()
@click.argument("query")
@index_dir_option
@click.option("-k", "k", default=5, show_default=True, type=click.IntRange(min=1), help="How many hits to show.")
@click.option(
    "--absolute-paths", is_flag=True, help="Show absolute file paths instead of paths relative to the indexed roots."
)
@click.option("--json", "as_json", is_flag=True, help="Print the hits as JSON.")
@source_option
@search_options
@user_errors
def search(
    query: str,
    index_dir: str,
    k: int,
    absolute_paths: bool,
    as_json: bool,
    sources: tuple[str, ...] | None,
    retrieval: RetrievalSettings,
) -> None:
    """Show the chunks closest to QUERY, with score, source, offsets and page."""
    from ..pipeline import Pipeline

    pipe = Pipeline(index_dir, retrieval=retrieval)
    hits = pipe.search(query, k=k, sources=sources)

    def where(path: str) -> str:
        # Sources carry display paths (root label + path below it); the local opt-in maps them back.
        return (pipe.store.absolute_path(path) or path) if absolute_paths else path

    if as_json:
        data = [h.to_dict() for h in hits]
        for d in data:
            for src in d["sources"]:
                src["path"] = where(src["path"])
        echo_json(data)
        return
    for rank, hit in enumerate(hits, 1):
        src = hit.sources[0]
        page = f" ({src.label})" if src.label else f" p.{src.page_start}" if src.page_start else ""
        more = f" (+{len(hit.sources) - 1} duplicate source(s))" if len(hit.sources) > 1 else ""
        click.echo(f"{rank}. {hit.score:.3f}  {where(src.path)}{page} [{src.start}:{src.end}]{more}")
        snippet = " ".join(hit.text.split())
        click.echo(f"   {snippet[:200]}{'…' if len(snippet) > 200 else ''}")


@cli.command()
@index_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
@user_errors
def stats(index_dir: str, as_json: bool) -> None:
    """Counts and settings of the index."""
    from ..retrieval.index import Index

    data = Index.open(index_dir).stats()
    if as_json:
        echo_json(data)
        return
    for key, value in data.items():
        click.echo(f"{key}: {value}")


@cli.command()
@click.argument("source")
@click.argument("dest")
@click.option("--json", "as_json", is_flag=True, help="Print the copy's summary as JSON.")
@user_errors
def copy(source: str, dest: str, as_json: bool) -> None:
    """Copy the index in SOURCE to DEST without re-embedding: a folder or a postgresql:// URL
    each (docs/postgres.md). DEST keeps its previous generation for its readers; the copy
    searches exactly (add --store on a later `index` run to derive another store)."""
    from ..retrieval.copy import copy_index
    from ..retrieval.storage import open_storage

    m = copy_index(open_storage(source), open_storage(dest))
    data = {"generation": m["generation"], "chunks": m["counts"]["chunks"], "copied_from": m["copied_from"]}
    if as_json:
        echo_json(data)
        return
    click.echo(f"copied {data['chunks']} chunks into {open_storage(dest).where} (generation {data['generation']})")


_QUIET_SKIPS = ("hidden", "ignored", "excluded")  # left out on purpose: counted, not listed


@cli.command()
@index_dir_option
@click.option("--all", "show_all", is_flag=True, help="Also list hidden, VCS and excluded paths.")
@click.option(
    "--absolute-paths", is_flag=True, help="Show absolute file paths instead of paths relative to the indexed roots."
)
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@user_errors
def sources(index_dir: str, show_all: bool, absolute_paths: bool, as_json: bool) -> None:
    """List the files the index holds: path, status, chunks and pages, one line each."""
    from ..retrieval.index import Index

    idx = Index.open(index_dir, absolute_paths=absolute_paths)
    files = idx.sources()
    shown = [f for f in files if show_all or f.reason not in _QUIET_SKIPS]
    if as_json:
        echo_json([f.to_dict() for f in shown])
        return
    click.echo(f"{'chunks':>6}  {'pages':>5}  {'status':<20}  path")
    for f in shown:
        status = f.status if f.status == "indexed" else f"{f.status}: {f.reason}"
        pages = str(f.pages) if f.pages else "-"
        note = f"  ({f.warning})" if f.warning else ""
        click.echo(f"{f.chunks:>6}  {pages:>5}  {status:<20}  {f.path}{note}")
    indexed = sum(1 for f in files if f.status == "indexed")
    left_out = len(files) - len(shown)
    click.echo(
        f"{indexed} file(s) indexed, {len(files) - indexed} skipped; "
        f"{sum(f.chunks for f in files)} chunks cut from them, "
        f"{idx.stats().get('chunks', 0)} in the index after dedup"
        + (f" ({left_out} hidden, VCS or excluded path(s) not listed; --all lists them)" if left_out else "")
    )


@cli.command()
@index_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (exit code 1 still means a problem).")
@user_errors
def verify(index_dir: str, as_json: bool) -> None:
    """Check checksums and id mappings of the index; exit 1 when it is damaged."""
    from ..retrieval.index import Index

    report = Index.open(index_dir).verify()
    data = report.to_dict()
    if as_json:
        echo_json(data)
    else:
        click.echo("index OK" if report.ok else "index DAMAGED")
        for problem in data.get("problems", []):
            click.echo(f"  {problem}")
    if not report.ok:
        sys.exit(1)


# --- budget / ask ----------------------------------------------------------------------------------


@cli.command()
@model_option
@plan_options
@click.option(
    "--context-tokens", default=None, type=click.IntRange(min=1), help="Plan for this context length per request."
)
@click.option(
    "--plot", "plot_path", default=None, type=click.Path(dir_okay=False), help="Write a PNG of the memory plan."
)
@click.option(
    "--weight-dtype",
    default=None,
    type=click.Choice(WEIGHT_DTYPES),
    help="How the weights are stored (default auto: the checkpoint's quantization_config, else its dtype); "
    "int4 = 4-bit groups of 128 (AWQ layout), nf4/int8 = bitsandbytes, fp8, mxfp4 (MoE experts), "
    "gguf (the file's types).",
)
@click.option(
    "--tensor-parallel",
    default=None,
    type=click.IntRange(min=1),
    help="Split the model over N identical GPUs as vLLM does (same as --gpu NxNAME); figures in bytes are per GPU.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option(
    "--index-dir",
    default=DEFAULT_INDEX_DIR,
    show_default=True,
    envvar="RAGBUDGET_INDEX_DIR",
    type=click.Path(file_okay=False),
    help="With --engine: where token counts are cached (when the folder exists).",
)
@engine_options
@user_errors
def budget(
    model: str | None,
    memory: MemorySettings,
    context_tokens: int | None,
    plot_path: str | None,
    weight_dtype: str | None,
    tensor_parallel: int | None,
    as_json: bool,
    index_dir: str,
    engine: EngineSettings | None,
) -> None:
    """The memory plan: KV bytes per token, capacity, tokens per request, concurrency.

    --gpu 2xH100 (or --tensor-parallel 2) plans tensor-parallel serving; --weight-dtype plans a
    quantized storage the checkpoint does not declare.

    With --engine URL: the engine's own figures (each with its source and age) and the context
    one request may use, with the limit that binds."""
    from ..memory.budget import plan_budget
    from .display import format_plan

    if engine is not None:
        from ..pipeline import Pipeline

        if plot_path:
            raise click.UsageError("--plot draws a memory plan; an engine's plan is its figures")
        if weight_dtype or tensor_parallel:
            raise click.UsageError("--weight-dtype and --tensor-parallel plan memory; an engine reports its own")
        eplan = Pipeline(index_dir, model=model, memory=memory, engine=engine).engine_plan()
        if as_json:
            echo_json(eplan.to_dict())
        else:
            click.echo("\n".join(eplan.lines()))
            if context_tokens is not None and context_tokens < eplan.budget.context_tokens:
                click.echo(f"context capped at {context_tokens} tokens (--context-tokens)")
        return

    plan = plan_budget(
        model,
        gpu=memory.gpu,
        concurrency=memory.concurrency,
        max_new_tokens=memory.max_new_tokens,
        context_tokens=context_tokens,
        kv_dtype=memory.kv_dtype,
        cache=memory.cache,
        utilization=memory.utilization,
        weight_dtype=weight_dtype,
        tensor_parallel=tensor_parallel,
    )
    if plot_path:
        from .display import plot_plan

        plot_plan(plan, plot_path)
    if as_json:
        echo_json(plan.to_dict())
    else:
        click.echo(format_plan(plan))
        if plot_path:
            click.echo(f"plot written to {plot_path}")


@cli.command()
@click.argument("question")
@index_dir_option
@model_option
@memory_options
@click.option(
    "--context-tokens",
    default=None,
    type=click.IntRange(min=1),
    help="Cap the retrieved context below what memory allows.",
)
@click.option("--explain", is_flag=True, help="Print the budget report as a table.")
@click.option("--no-stream", is_flag=True, help="Print the answer at the end instead of streaming it.")
@click.option(
    "--absolute-paths", is_flag=True, help="Show absolute file paths instead of paths relative to the indexed roots."
)
@click.option("--json", "as_json", is_flag=True, help="Print the answer, its sources and its report as JSON.")
@source_option
@sampling_options
@retrieval_options
@engine_options
@user_errors
def ask(
    question: str,
    index_dir: str,
    model: str | None,
    memory: MemorySettings,
    context_tokens: int | None,
    explain: bool,
    no_stream: bool,
    absolute_paths: bool,
    as_json: bool,
    sources: tuple[str, ...] | None,
    sampling: dict[str, Any],
    retrieval: RetrievalSettings,
    engine: EngineSettings | None,
) -> None:
    """Answer QUESTION from the index within the memory budget, citing sources."""
    from ..pipeline import Pipeline
    from .display import budget_line, format_evidence, format_report, format_sources

    streaming = not as_json and not no_stream
    on_text = (lambda piece: click.echo(piece, nl=False)) if streaming else None
    # Closed before anything is printed after the answer: the batching loop stops here, not
    # at interpreter exit (see ragbudget.generation.batching, "stopping at exit").
    with Pipeline(index_dir, model=model, memory=memory, retrieval=retrieval, engine=engine) as pipe:
        answer = pipe.ask(question, context_tokens=context_tokens, sources=sources, on_text=on_text, **sampling)
        if absolute_paths:  # the prompt only ever saw display paths; the local user may want files
            for src in answer.sources:
                src["path"] = pipe.store.absolute_path(src["path"]) or src["path"]
    if as_json:
        echo_json(answer.to_dict())
        return
    # An answer cut by max_new_tokens ends mid-sentence: mark it, and say what to raise.
    cut = answer.finish_reason == "length"
    if streaming:
        click.echo(" […]" if cut else "")
    else:
        click.echo(answer.text + (" […]" if cut else ""))
    if cut:
        reserved = answer.report.get("budget", {}).get("max_new_tokens") or memory.max_new_tokens
        click.echo(f"(answer cut at max_new_tokens={reserved}; raise --max-new-tokens)")
    click.echo()
    if answer.declined:  # nothing was retrieved well enough to read, and nothing generated
        click.echo(format_report(answer.report) if explain else format_evidence(answer.report["evidence"]))
        return
    click.echo(format_sources(answer.sources))
    if explain:
        click.echo()
        click.echo(format_report(answer.report))
    else:
        click.echo(f"\n{budget_line(answer.report['budget'])}")


# --- chat / serve ----------------------------------------------------------------------------------


@cli.command()
@index_dir_option
@model_option
@memory_options
@history_options
@click.option(
    "--context-tokens",
    default=None,
    type=click.IntRange(min=1),
    help="Cap the retrieved context below what memory allows.",
)
@click.option("--no-stream", is_flag=True, help="Print each answer at the end instead of streaming it.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per turn.")
@source_option
@sampling_options
@retrieval_options
@engine_options
@user_errors
def chat(
    index_dir: str,
    model: str | None,
    memory: MemorySettings,
    history: HistorySettings,
    context_tokens: int | None,
    no_stream: bool,
    as_json: bool,
    sources: tuple[str, ...] | None,
    sampling: dict[str, Any],
    retrieval: RetrievalSettings,
    engine: EngineSettings | None,
) -> None:
    """Multi-turn chat inside the memory budget: a REPL at a terminal (line editing, history,
    /help), one question per line when stdin is piped."""
    from ..chat import Conversation
    from ..memory.models import cache_dir
    from ..pipeline import Pipeline
    from .display import chat_banner
    from .terminal import TerminalLines, run_chat

    pipe = Pipeline(index_dir, model=model, memory=memory, retrieval=retrieval, engine=engine)
    conversation = Conversation(pipe, history=history, context_tokens=context_tokens, sources=sources)
    if sources:  # a pattern that names no file: one error now, not one at every turn
        pipe.store.chunks_in(sources)

    def write(text: str) -> None:
        click.echo(text, nl=False)
        sys.stdout.flush()  # streamed pieces show as they come

    interactive = sys.stdin.isatty()
    # sys.stdin, not click.get_text_stream (deprecated in click 8.5): CliRunner swaps it too.
    lines: Iterable[str] = sys.stdin
    if interactive:
        history_file = os.environ.get("RAGBUDGET_CHAT_HISTORY") or str(cache_dir() / "chat_history")
        lines = TerminalLines("> ", history_file=history_file, write=write)
    try:
        run_chat(
            conversation,
            lines,
            write,
            as_json=as_json,
            stream=interactive and not no_stream,
            generate_options=sampling,
            banner=None if as_json else chat_banner(conversation),
        )
    finally:
        if isinstance(lines, TerminalLines):
            lines.save()  # also when the loop ended on /exit, not only on Ctrl-D
        pipe.close()


@cli.command()
@index_dir_option
@model_option
@memory_options
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="Address to bind (loopback by default).")
@click.option(
    "--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on."
)
@click.option(
    "--api-key",
    default=None,
    envvar="RAGBUDGET_API_KEY",
    help="Require 'Authorization: Bearer KEY' (env RAGBUDGET_API_KEY).",
)
@click.option(
    "--model-name", default=None, help="Model id clients send (default: the generator's id; 'ragbudget' always works)."
)
@served_history_options
@click.option(
    "--request-timeout",
    default=DEFAULT_REQUEST_TIMEOUT,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds one chat request may take in all (history, retrieval, queue, answer); then 503. 0: none.",
)
@client_timeout_options
@click.option(
    "--expose-plan",
    is_flag=True,
    help="Send the memory plan and host memory figures (GPU, free/usable bytes) in responses.",
)
@retrieval_options
@engine_options
@user_errors
def serve(
    index_dir: str,
    model: str | None,
    memory: MemorySettings,
    host: str,
    port: int,
    api_key: str | None,
    model_name: str | None,
    history: HistorySettings,
    request_timeout: float,
    client_timeouts: ClientTimeoutSettings,
    expose_plan: bool,
    retrieval: RetrievalSettings,
    engine: EngineSettings | None,
) -> None:
    """OpenAI-compatible HTTP server (/v1/chat/completions, /v1/retrieve, /metrics) with KV admission.

    Refuses to start (exit 1) when the index is missing or damaged or the port cannot be bound.
    A request's max_tokens above --max-new-tokens is answered 400, as on OpenAI past a model's limit.
    A client slower to send its request than the three time-outs allow is answered 408 and cut off."""
    from ..pipeline import Pipeline
    from ..server.app import serve as run_server

    with Pipeline(index_dir, model=model, memory=memory, retrieval=retrieval, engine=engine) as pipe:
        run_server(
            pipe,
            host=host,
            port=port,
            api_key=api_key,
            model_name=model_name,
            history=history,
            request_timeout=request_timeout,
            client_timeouts=client_timeouts,
            expose_plan=expose_plan,
        )


cli.add_command(models)  # ragbudget models list|fetch|verify|path (cli/models.py)


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``ragbudget``)."""
    cli.main(args=argv, prog_name="ragbudget")


if __name__ == "__main__":  # pragma: no cover
    main()
