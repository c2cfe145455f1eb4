"""How the real-engine tests start ``llama-server`` (tests/_llama.py ``start_server``): a start that
crashes by a signal is tried again, a clean failure is not, and a crash that repeats fails with
every try's log. Run against a stand-in script (no llama.cpp needed), so these always run."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from _llama import ServerStartError, start_server

# The stand-in: the n-th start (counted in a file) crashes with SIGSEGV while n <= CRASHES,
# exits 2 when MODE is "bad-flags", else serves GET /health on --port like llama-server.
STAND_IN = textwrap.dedent(
    """\
    #!{python}
    import http.server, os, signal, sys
    state = {state!r}
    n = int(open(state).read()) + 1 if os.path.exists(state) else 1
    open(state, "w").write(str(n))
    if {mode!r} == "bad-flags":
        print("error: invalid argument", flush=True)
        sys.exit(2)
    if n <= {crashes}:
        print("init: llama threadpool init, n_threads = 2", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b'{{"status":"ok"}}')
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def _stand_in(tmp_path: Path, *, crashes: int, mode: str = "serve") -> tuple[str, Path]:
    state = tmp_path / "starts"
    script = tmp_path / "llama-server"
    script.write_text(STAND_IN.format(python=sys.executable, state=str(state), crashes=crashes, mode=mode))
    script.chmod(0o755)
    return str(script), state


def _stop(proc) -> None:  # type: ignore[no-untyped-def]
    proc.terminate()
    proc.wait(timeout=15)


def test_a_crash_while_starting_is_retried_and_reported(tmp_path: Path) -> None:
    binary, state = _stand_in(tmp_path, crashes=2)
    proc, url, crashes = start_server(binary, "model.gguf", tmp_path, tries=3)
    try:
        assert state.read_text() == "3"
        assert len(crashes) == 2 and all("exited with -11" in c for c in crashes)
        assert url.startswith("http://127.0.0.1:")
    finally:
        _stop(proc)


def test_a_crash_that_repeats_fails_with_its_log(tmp_path: Path) -> None:
    binary, state = _stand_in(tmp_path, crashes=5)
    with pytest.raises(ServerStartError, match=r"exited with -11 \(try 3 of 3\).*threadpool init"):
        start_server(binary, "model.gguf", tmp_path, tries=3)
    assert state.read_text() == "3"


def test_a_clean_failure_is_not_retried(tmp_path: Path) -> None:
    binary, state = _stand_in(tmp_path, crashes=0, mode="bad-flags")
    with pytest.raises(ServerStartError, match=r"exited with 2 \(try 1 of 3\).*invalid argument"):
        start_server(binary, "model.gguf", tmp_path, tries=3)
    assert state.read_text() == "1"
