"""Where embedding runs: in this process, or on a Ray cluster.

The index builder (:mod:`ragbudget.retrieval.build`) loads, cleans, chunks and deduplicates in its own
process; the chunks it has to embed go to an :class:`EmbedExecutor`, which hands back
:class:`Shard` records (vectors for some of the texts, in any order). The builder appends every
shard to its embedding checkpoint as it arrives, so a run that fails part-way keeps what came back,
and then adds the vectors to the exact store in chunk-id order, as the local executor does: the
derived stores (HNSW, IVF) are trained at commit from the finished exact store, so they see the
same vectors in the same order whichever executor embedded them.

* :class:`LocalExecutor` — ``embedder.embed`` in this process, one shard per batch (the default);
* :class:`RayExecutor` — Ray Data ``map_batches`` over a pool of actors, each holding one copy of
  the embedder (the model loads once per actor), one GPU per actor when the cluster has GPUs.
  Needs the optional ``ray`` package (``pip install 'ragbudget[ray]'``); imported on first use.

The embedder is used through its public API only (``warm_up`` and ``embed`` returning an
:class:`~ragbudget.retrieval.embed.EmbedResult`), so faster embedders plug in unchanged.

>>> from ragbudget.retrieval.embed import HashEmbedder
>>> shards = list(LocalExecutor().embed(HashEmbedder(dim=8), ["a cat", "a dog", "a cow"], batch_size=2))
>>> [s.positions.tolist() for s in shards], shards[0].vectors.shape
([[0, 1], [2]], (2, 8))
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..errors import ConfigError, ExecutorError

if TYPE_CHECKING:
    import numpy as np

    from .embed import Embedder

__all__ = ["EXECUTORS", "EmbedExecutor", "LocalExecutor", "RayExecutor", "Shard", "make_executor"]

log = logging.getLogger(__name__)

#: The executor names ``Index.build(executor=...)`` and ``ragbudget index --executor`` accept.
EXECUTORS = ("local", "ray")

#: Chunks the builder gathers before one Ray job. Each job starts its actor pool and loads the
#: model once per actor (about a second for MiniLM), which is noise next to embedding 64k chunks,
#: while the texts of one round (~130 MB at 2 KB a chunk) stay bounded whatever the corpus.
RAY_ROUND = 65536

#: Seconds to wait for a TCP connection to the cluster's address before calling it unreachable.
#: Checked before ``ray.init``, which otherwise retries an unreachable address for minutes.
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True, kw_only=True)
class Shard:
    """Vectors for some of the texts handed to :meth:`EmbedExecutor.embed`.

    ``positions`` index into those texts (int64, no position twice across the shards of one call);
    ``vectors`` is ``(len(positions), dim)`` float32 with unit rows; ``windows[i]`` the windows the
    text at ``positions[i]`` needed; ``texts_fed`` what the model was given (window texts).
    """

    positions: np.ndarray
    vectors: np.ndarray
    windows: tuple[int, ...]
    texts_fed: int


@runtime_checkable
class EmbedExecutor(Protocol):
    """Runs the embedding of an index build. ``round_size`` is how many chunks the builder gathers
    before one :meth:`embed` call (``None``: its own ``embed_batch``)."""

    name: str
    round_size: int | None

    def check(self) -> None:
        """Fail fast, before the build reads any file, when the executor cannot run (an
        unreachable cluster); cheap, and it loads nothing."""
        ...

    def embed(self, embedder: Embedder, texts: Sequence[str], *, batch_size: int) -> Iterator[Shard]:
        """Embed ``texts`` in batches of at most ``batch_size``; yield every text once, in shards
        as they finish. Failures raise :class:`~ragbudget.errors.ExecutorError`."""
        ...

    def close(self) -> None:
        """Release what the executor opened (idempotent; the builder calls it when it is done)."""
        ...


class LocalExecutor:
    """Embeds in this process, ``batch_size`` texts per :meth:`Embedder.embed` call."""

    name = "local"
    round_size: int | None = None

    def embed(self, embedder: Embedder, texts: Sequence[str], *, batch_size: int) -> Iterator[Shard]:
        import numpy as np

        for start in range(0, len(texts), max(1, batch_size)):
            part = texts[start : start + batch_size]
            res = embedder.embed(part)
            yield Shard(
                positions=np.arange(start, start + len(part), dtype=np.int64),
                vectors=res.vectors,
                windows=tuple(res.windows),
                texts_fed=res.texts_fed,
            )

    def check(self) -> None:
        """Nothing to check: this process is always there."""

    def close(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        return "LocalExecutor()"


class _EmbedActor:
    """One Ray actor of the pool: holds its own copy of the embedder, loaded once."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        embedder.warm_up()

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        res = self.embedder.embed([str(t) for t in batch["text"]])
        n = len(res.windows)
        # texts_fed belongs to the batch, not to a row: carried on its first row, zeros after,
        # so the driver's sum over rows is exact however Ray Data regroups them.
        fed = np.zeros(n, dtype=np.int64)
        if n:
            fed[0] = res.texts_fed
        return {
            "pos": np.asarray(batch["pos"], dtype=np.int64),
            "vector": np.ascontiguousarray(res.vectors, dtype=np.float32),
            "windows": np.asarray(res.windows, dtype=np.int64),
            "fed": fed,
        }


def _split_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a cluster address to probe, or ``None`` for one Ray resolves itself
    (``auto``, ``local``)."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        if address in ("auto", "local"):
            return None
        raise ConfigError(f"a Ray address is 'host:port', 'ray://host:port', 'auto' or 'local'; got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _one_line(exc: BaseException) -> str:
    """The gist of a Ray failure in one line: the root cause's type and first line, without the
    remote traceback Ray puts in the message."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None) or exc.__cause__
        if not isinstance(inner, BaseException):
            break
        exc = inner
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # Ray's own messages start with a header line; the useful line is the last non-traceback one.
    keep = next((ln for ln in reversed(lines) if not ln.startswith(("File ", "Traceback", "^"))), "")
    keep = keep or (lines[0] if lines else "")
    return f"{type(exc).__name__}: {keep[:300]}" if keep else type(exc).__name__


class RayExecutor:
    """Embeds on a Ray cluster: Ray Data ``map_batches`` over an actor pool.

    ``address`` is the cluster to join (``host:port`` of a head node, ``ray://host:port`` for Ray
    Client, ``auto``); ``None`` joins the Ray this process is already connected to, or else starts
    a local one for the build and stops it after. An address is checked with a TCP connection
    first (:data:`CONNECT_TIMEOUT_S`), so a wrong one fails in seconds, before anything is indexed.
    ``workers`` is the actor pool size (default: one per GPU when the cluster has GPUs, else one
    per CPU), each actor holding one copy of the model; on CPUs the cluster's CPUs are shared
    between the actors. ``retries`` is how often a dead actor is restarted and its batch retried
    before the build fails (Ray Data's default, forever, would hang a build on a batch that kills
    its worker every time). The workers import ragbudget and the embedder's packages: a remote
    cluster needs them installed.

    >>> RayExecutor(workers=2)
    RayExecutor(address=None, workers=2)
    """

    name = "ray"

    def __init__(
        self, *, address: str | None = None, workers: int | None = None, round_size: int = RAY_ROUND, retries: int = 2
    ) -> None:
        if workers is not None and workers < 1:
            raise ConfigError(f"embed workers must be >= 1, got {workers}")
        if round_size < 1:
            raise ConfigError(f"round_size must be >= 1, got {round_size}")
        if retries < 0:
            raise ConfigError(f"retries must be >= 0, got {retries}")
        self.address = address or None
        self.workers = workers
        self.round_size: int | None = round_size
        self.retries = retries
        self._probe = _split_address(self.address) if self.address else None
        self._owned = False  # this executor called ray.init: it calls ray.shutdown

    def __repr__(self) -> str:
        return f"RayExecutor(address={self.address!r}, workers={self.workers!r})"

    def check(self) -> None:
        """Fail now, with a one-line :class:`~ragbudget.errors.ExecutorError`, if the cluster's
        address does not accept connections (no Ray import)."""
        if self._probe is None:
            return
        host, port = self._probe
        try:
            # A probe: connect, then hang up at once.
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise ExecutorError(
                f"cannot reach the Ray cluster at {self.address!r}: {exc.strerror or exc} "
                f"(no answer on {host}:{port} within {CONNECT_TIMEOUT_S:g} s); start it with "
                "`ray start --head`, or fix --ray-address"
            ) from None

    def _ray(self) -> Any:
        try:
            import ray
            import ray.data  # the Data library is a separate extra of ray
        except ImportError as exc:
            raise ExecutorError(
                f"the Ray executor needs Ray Data, which is not installed ({exc}): pip install 'ragbudget[ray]'"
            ) from None
        return ray

    def _connect(self) -> Any:
        ray = self._ray()
        if ray.is_initialized():
            if self.address is not None and not self._owned:
                raise ExecutorError(
                    f"this process is already connected to a Ray cluster, so it cannot join "
                    f"{self.address!r}; pass no address to use the connected one, or call "
                    "ray.shutdown() first"
                )
            return ray
        self.check()
        try:
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ...
            where = f"at {self.address!r}" if self.address else "(a local one)"
            raise ExecutorError(f"could not start or join the Ray cluster {where}: {_one_line(exc)}") from None
        self._owned = True
        return ray

    def pool(self, resources: Mapping[str, float]) -> tuple[int, float | None, float | None]:
        """``(actors, CPUs per actor, GPUs per actor)`` this executor embeds with on a cluster
        of ``resources`` (what ``ray.cluster_resources()`` returns; :meth:`embed` asks the
        connected cluster as it is then). ``None``: not asked for (Ray's default).

        >>> RayExecutor(workers=3).pool({"CPU": 8.0})
        (3, 2.0, None)
        >>> RayExecutor().pool({"CPU": 16.0, "GPU": 2.0})
        (2, None, 1.0)
        """
        res = resources
        cpus, gpus = float(res.get("CPU", 1.0)), int(res.get("GPU", 0))
        if gpus:
            # A GPU each, CPUs left to Ray's default (Ray Data calls asking for both experimental).
            return self.workers or gpus, None, 1.0
        n = self.workers or max(1, int(cpus))
        # Each actor gets an equal share of the CPUs (Ray sets its torch threads to it); more
        # actors than CPUs still run, a fraction of a CPU each.
        return n, max(cpus // n, 1.0) if n <= cpus else cpus / n, None

    def embed(self, embedder: Embedder, texts: Sequence[str], *, batch_size: int) -> Iterator[Shard]:
        import numpy as np

        if not texts:
            return
        ray = self._connect()
        workers, cpus, gpus = self.pool(ray.cluster_resources())
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # the builder reports progress per shard
        batch_size = max(1, batch_size)
        n_blocks = min(len(texts), -(-len(texts) // batch_size))  # one block per batch
        workers = min(workers, n_blocks)  # an actor without a batch would only load the model
        data_log = logging.getLogger("ray.data")
        level = data_log.level
        data_log.setLevel(logging.ERROR)  # per-job INFO lines and a warning about the bars
        try:
            ds = ray.data.from_items([{"pos": i, "text": t} for i, t in enumerate(texts)], override_num_blocks=n_blocks)
            with warnings.catch_warnings():
                # max_restarts and max_task_retries have no named parameter in Ray 2.60 yet.
                warnings.simplefilter("ignore")
                ds = ds.map_batches(
                    _EmbedActor,
                    fn_constructor_args=(embedder,),
                    batch_size=batch_size,
                    batch_format="numpy",
                    compute=ray.data.ActorPoolStrategy(size=workers),
                    num_cpus=cpus,
                    num_gpus=gpus,
                    max_restarts=self.retries,
                    max_task_retries=self.retries,
                )
            for b in ds.iter_batches(batch_size=None, batch_format="numpy"):
                yield Shard(
                    positions=np.asarray(b["pos"], dtype=np.int64),
                    vectors=np.asarray(b["vector"], dtype=np.float32),
                    windows=tuple(int(w) for w in b["windows"]),
                    texts_fed=int(np.asarray(b["fed"]).sum()),
                )
        except GeneratorExit:
            raise
        except Exception as exc:
            if isinstance(exc, ExecutorError):
                raise
            raise ExecutorError(f"the Ray embedding job failed: {_one_line(exc)}") from None
        finally:
            data_log.setLevel(level)

    def close(self) -> None:
        """Disconnect from (or stop) the cluster if this executor connected to (or started) it;
        a connection the caller made is left alone."""
        if self._owned:
            self._owned = False
            with contextlib.suppress(Exception):
                import ray

                ray.shutdown()


def make_executor(executor: str | EmbedExecutor | None) -> EmbedExecutor:
    """The executor a name stands for (``"local"``, ``"ray"``: a :class:`RayExecutor` with its
    defaults), or ``executor`` itself when it already is one."""
    if executor is None or executor == "local":
        return LocalExecutor()
    if executor == "ray":
        return RayExecutor(address=os.environ.get("RAY_ADDRESS") or None)
    if isinstance(executor, str):
        raise ConfigError(f"executor must be one of {', '.join(EXECUTORS)} or an EmbedExecutor; got {executor!r}")
    if not isinstance(executor, EmbedExecutor):
        raise ConfigError(
            f"executor must be one of {', '.join(EXECUTORS)} or an EmbedExecutor "
            f"(with name, round_size, check, embed and close); got {type(executor).__name__}"
        )
    return executor
