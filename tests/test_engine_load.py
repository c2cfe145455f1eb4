"""ragbudget.server.engine_load: a served engine's health and load as the server sees it, against the
replay servers (tests/_replay.py); tests/test_server.py drives it through the app (engine gone,
loading, back), tests/test_served_real.py against a real llama-server killed mid-run."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

from _fakes import corpus_index
from _replay import Replay, Resp

from ragbudget import Pipeline
from ragbudget.server.engine_load import EngineLoad


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
