"""ragbudget.server.engine_load: a served engine's health and load as the server sees it, against the
replay servers (tests/_replay.py); tests/test_server.py drives it through the app (engine gone,
loading, back), tests/test_served_real.py against a real llama-server killed mid-run."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
from _fakes import corpus_index
from _replay import Replay, Resp

from ragbudget import Pipeline
from ragbudget.server.engine_load import EngineLoad


@pytest.mark.model
def test_a_hung_engine_never_holds_up_a_look_at_it(tmp_path: Path) -> None:
    """One reading of the engine at a time, and nobody waits for it: while one thread waits on an
    engine that does not answer, another look returns the last figures at once; the reading
    that times out makes the engine unavailable, with the cause."""
    index_dir = tmp_path / "idx"
    shutil.copytree(corpus_index(), index_dir)
    with Replay("llamacpp") as srv:
        pipe = Pipeline(index_dir, engine=srv.url, engine_timeout=2.0)
        pipe.backend.CAPACITY_TTL_S = 0  # type: ignore[attr-defined]  # every look asks the engine
        load = EngineLoad(pipe, ttl=0.0)
        first = load.read()
        assert first[0] is not None and load.error is None and load.kind == "llamacpp" and load.url == srv.url
        srv.push("GET", "/props", Resp(delay=4.0, json={}))
        reader = threading.Thread(target=load.read)
        reader.start()
        deadline = time.monotonic() + 30
        while not srv.calls("GET", "/props")[1:] and time.monotonic() < deadline:
            time.sleep(0.01)  # until the reader waits on the engine
        t0 = time.perf_counter()
        meanwhile = load.read()
        waited = time.perf_counter() - t0
        reader.join()
    assert waited < 0.5 and meanwhile == first
    assert load.error is not None and load.state()["cause"] == "timeout"
    assert load.state()["status"] == "unavailable" and "gave no answer within 2 s" in load.state()["error"]


@pytest.mark.model
def test_the_server_watches_an_engine_elsewhere_through_the_backend_contract(tmp_path: Path) -> None:
    """Whether there is an engine to watch, how it is looked at and what was sent to it are
    asked of the :class:`~ragbudget.generation.backend.Backend` protocol (``url``,
    ``probing()``, ``capacity(fresh=True)``, ``requests_sent()``), never of its class: a backend
    in this process has nothing to watch; one with a URL is watched, whatever its class."""
    from _fakes import FakeBackend

    from ragbudget.generation.local import local_backend
    from ragbudget.settings import MemorySettings

    index_dir = tmp_path / "idx"
    shutil.copytree(corpus_index(), index_dir)
    local = local_backend(None, model=None, memory=MemorySettings())
    assert (local.url, local.requests_sent()) == ("", None)
    with local.probing():
        pass
    assert EngineLoad.watching(Pipeline(index_dir, backend=FakeBackend(memory_plan={"gpu": "16GiB"}))) is None

    class Counted(FakeBackend):
        looks: list[bool] = []

        def probing(self):  # type: ignore[no-untyped-def]
            import contextlib

            @contextlib.contextmanager
            def look():  # type: ignore[no-untyped-def]
                self.looks.append(True)
                yield

            return look()

        def capacity(self, *, max_new_tokens=None, fresh=False):  # type: ignore[no-untyped-def]
            assert fresh, "the server's look keeps its own interval: it asks for a fresh reading"
            return super().capacity(max_new_tokens=max_new_tokens, fresh=fresh)

        def requests_sent(self):  # type: ignore[no-untyped-def]
            return {"/metrics": len(self.looks)}

    remote = Counted(url="http://engine.invalid:8000")
    load = EngineLoad.watching(Pipeline(index_dir, backend=remote), ttl=0.0)
    assert load is not None and load.sent() is None  # not read yet: nothing asked of the backend
    cap, why = load.read()
    assert cap is not None and why == "" and remote.looks == [True]
    assert (load.url, load.kind, load.sent()) == ("http://engine.invalid:8000", "fake", {"/metrics": 1})
