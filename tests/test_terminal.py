"""The interactive chat loop (:mod:`ragbudget.cli.terminal`): slash commands handled locally, a
cancelled answer kept out of the history, and ``ragbudget chat`` driven on a pipe and at a real
pseudo-terminal (readline history, Ctrl-C) through tests/_chat_repl.py."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
from _fakes import FakeBackend, corpus_index

from ragbudget.chat import Conversation
from ragbudget.cli.terminal import run_chat
from ragbudget.pipeline import Pipeline

SYSTEM = "Answer from the documents and cite them"


def chat_pipeline(backend: FakeBackend | None = None) -> Pipeline:
    """A real Pipeline over the corpus index on a FakeBackend (a 4096-token window)."""
    return Pipeline(
        corpus_index(),
        backend=backend or FakeBackend(),
        max_new_tokens=40,
        system_prompt=SYSTEM,
        relevance_floor=0,
        evidence_floor=0,  # placeholder questions; declining is tests/test_evidence.py's subject
    )


def calls(pipe: Pipeline) -> list[dict[str, Any]]:
    """What the "model" was asked to answer, in order (not the chat's side requests)."""
    backend = pipe.backend
    assert isinstance(backend, FakeBackend)
    return backend.answer_calls


def history_of(call: dict[str, Any]) -> list[dict[str, str]]:
    """The history an answer's prompt carried: between the system prompt and the question."""
    assert call["messages"][0] == {"role": "system", "content": SYSTEM}
    return call["messages"][1:-1]


# --- run_chat over lines ---------------------------------------------------------------------------


@pytest.mark.model
def test_run_chat_reads_lines_and_handles_commands() -> None:
    pipe = chat_pipeline()
    chat = Conversation(pipe)
    out = io.StringIO()
    stdin = io.StringIO("How is the KV budget computed?\n\n/reset\nwhat about its footer?\n/exit\nnever asked\n")
    n = run_chat(chat, stdin, out.write)
    text = out.getvalue()
    assert n == 2 and len(calls(pipe)) == 2
    assert "Sources:" in text and "[1]" in text
    assert "memory:" in text and "summary" in text
    assert "conversation reset" in text
    assert history_of(calls(pipe)[1]) == []  # /reset forgot the first turn
    assert all(c["question"] != "never asked" for c in calls(pipe))


@pytest.mark.model
def test_run_chat_a_cancelled_answer_is_not_kept_in_the_history() -> None:
    class Cancelling(FakeBackend):
        def generate(self, prompt: Any, **kwargs: Any) -> Any:
            generation = super().generate(prompt, **kwargs)
            if "cancel me" in getattr(prompt, "question", ""):  # the answer, not a rewrite
                kwargs["cancel"].set()  # as a Ctrl-C in the middle of the answer does
            return generation

    pipe = chat_pipeline(Cancelling())
    chat = Conversation(pipe)
    out = io.StringIO()
    n = run_chat(chat, io.StringIO("What is MinHash?\nplease cancel me now\nand its shingles?\n"), out.write)
    assert n == 2 and len(calls(pipe)) == 3
    assert "(answer cancelled)" in out.getvalue()
    assert [t.question for t in chat.turns] == ["What is MinHash?", "and its shingles?"]
    assert history_of(calls(pipe)[2])  # the first turn is there ...
    assert "cancel me" not in str(history_of(calls(pipe)[2]))  # ... the cancelled one is not


# --- the REPL (`ragbudget chat` at a terminal and on a pipe) ------------------------------------------


def _slow_pipeline_cli(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Patch the CLI's Pipeline with the streaming one of tests/_chat_repl.py; return a function
    giving the questions its backend received."""
    import _chat_repl

    _chat_repl.BACKENDS.clear()
    monkeypatch.setattr("ragbudget.pipeline.Pipeline", _chat_repl.SlowPipeline)
    return lambda: [c["question"] for b in _chat_repl.BACKENDS for c in b.answer_calls]


def test_chat_slash_commands_are_handled_locally_and_never_reach_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from ragbudget.cli.commands import cli

    asked = _slow_pipeline_cli(monkeypatch)
    script = (
        "/sources\nWhat is MinHash?\n/help\n/sources\n/SOURCES\n/bogus\n/?\n"
        "/etc/fstab holds what?\n/reset\n/sources\n/quit\nnever asked\n"
    )
    result = CliRunner().invoke(cli, ["chat"], input=script)
    assert result.exit_code == 0, result.output
    out = result.output
    assert asked() == ["What is MinHash?", "/etc/fstab holds what?"]  # a path is a question, not a command
    first = out.splitlines()[0]
    assert (
        first == "ragbudget chat · fake/slow-model · 4000 tokens/turn (answer 64, history ≤ 30%) · /help for commands"
    )
    assert out.count("Commands (never sent to the model):") == 2 and "/reset" in out and "Ctrl-C" in out
    assert out.count("(no answer yet)") == 2  # before the first answer and after /reset
    top = "[1] docs/dedup.md"  # the best source of "What is MinHash?"
    first_turn = out[: out.index("You asked.", out.index("You asked.") + 1)]  # before the 2nd answer
    assert first_turn.count(top) == 1 + 2  # the answer's own block, then /sources twice
    assert "unknown command /bogus; /help lists the commands" in out
    assert "(conversation reset)" in out


def test_chat_json_mode_has_no_banner(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from click.testing import CliRunner

    from ragbudget.cli.commands import cli

    _slow_pipeline_cli(monkeypatch)
    result = CliRunner().invoke(cli, ["chat", "--json"], input="What is MinHash?\n/help\n")
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert json.loads(first)["question"] == "What is MinHash?"


class _Terminal:
    """A child process on a pseudo-terminal: what a user at a keyboard sees and types."""

    def __init__(self, argv: list[str], env: dict[str, str], *, sigint_ignored: bool = False) -> None:
        import os
        import pty
        import signal

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal (Ctrl-C = SIGINT)
            try:
                # An ignored SIGINT survives exec (a shell's `&` starts programs so): the chat must
                # take Ctrl-C all the same.
                signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored else signal.SIG_DFL)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.output = ""

    def expect(self, text: str, timeout: float = 30.0, *, after: int = 0) -> int:
        """Read until ``text`` appears after offset ``after``; return the offset just past it."""
        import os
        import select
        import time

        end = time.monotonic() + timeout
        while (i := self.output.find(text, after)) < 0:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{text!r} not seen in {timeout} s; terminal shows:\n{self.output[-3000:]}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:  # the child exited (EIO on Linux)
                    data = b""
                if not data:
                    raise AssertionError(f"{text!r} not seen before exit; terminal shows:\n{self.output[-3000:]}")
                self.output += data.decode("utf-8", "replace")
        return i + len(text)

    def send(self, keys: str) -> None:
        import os
        import time

        # The prompt is on screen a moment before readline has put the terminal in raw mode;
        # keys typed in between would be echoed by the tty itself (a user never types that fast).
        time.sleep(0.2)
        os.write(self.fd, keys.encode())

    def wait(self, timeout: float = 30.0) -> int:
        import os
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with contextlib.suppress(OSError):
                self.output += os.read(self.fd, 65536).decode("utf-8", "replace")
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, 9)
        raise AssertionError(f"chat did not exit; terminal shows:\n{self.output[-3000:]}")


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs a POSIX pseudo-terminal")
@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["sigint-default", "sigint-ignored-at-start"])
def test_chat_at_a_terminal_has_history_editing_and_ctrl_c_cancels_an_answer(
    tmp_path: Any, sigint_ignored: bool
) -> None:
    import json
    import os
    import sys
    from pathlib import Path

    driver = Path(__file__).with_name("_chat_repl.py")
    history = tmp_path / "cache" / "chat_history"
    env = {
        **os.environ,
        "TERM": "xterm",
        "RAGBUDGET_CHAT_HISTORY": str(history),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "INPUTRC": "/dev/null",
    }
    argv = [sys.executable, str(driver), "chat", "--index-dir", str(tmp_path / "idx")]
    term = _Terminal(argv, env, sigint_ignored=sigint_ignored)
    at = term.expect("/help for commands")
    at = term.expect("> ", after=at)
    term.send("What is MinHash?\r")
    at = term.expect("memory:", after=at)
    at = term.expect("> ", after=at)
    term.send("\x1b[A\r")  # arrow up: the previous question again, edited by readline
    at = term.expect("memory:", after=at)
    at = term.expect("> ", after=at)
    term.send("tell me slowly\r")
    at = term.expect("word3", after=at)  # the answer is streaming ...
    term.send("\x03")  # ... Ctrl-C cancels it and the chat goes on
    at = term.expect("(answer cancelled)", after=at)
    at = term.expect("> ", after=at)
    term.send("half a quest")
    term.expect("half a quest", after=at)
    term.send("\x03")  # Ctrl-C at the prompt drops the typed line
    at = term.expect("> ", after=at)
    term.send("/sources\r")
    at = term.expect("[1] docs/dedup.md", after=at)  # the last answer that was not cancelled
    at = term.expect("> ", after=at)
    term.send("\x04")  # Ctrl-D leaves
    assert term.wait() == 0
    out = term.output
    assert "^[[A" not in out
    assert "word59" not in out  # the slow answer did stop
    asked = json.loads(out[out.rindex("ASKED: ") + 7 :].splitlines()[0])
    assert asked == ["What is MinHash?", "What is MinHash?", "tell me slowly"]
    assert "What is MinHash?" in history.read_text()  # readline's history, kept for next time


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs a POSIX pseudo-terminal")
def test_chat_at_a_terminal_recalls_history_from_the_last_session_and_survives_a_readonly_file(tmp_path: Any) -> None:
    import json
    import os
    import sys
    from pathlib import Path

    driver = Path(__file__).with_name("_chat_repl.py")
    history = tmp_path / "chat_history"
    history.write_text("Who wrote the footer?\n")
    history.chmod(0o444)
    env = {
        **os.environ,
        "TERM": "xterm",
        "RAGBUDGET_CHAT_HISTORY": str(history),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "INPUTRC": "/dev/null",
    }
    term = _Terminal([sys.executable, str(driver), "chat"], env)
    at = term.expect("> ")
    term.send("\x1b[A\r")
    at = term.expect("memory:", after=at)
    at = term.expect("> ", after=at)
    term.send("/exit\r")
    assert term.wait() == 0
    out = term.output
    asked = json.loads(out[out.rindex("ASKED: ") + 7 :].splitlines()[0])
    assert asked == ["Who wrote the footer?"]
    assert "Error" not in out and "Traceback" not in out
    if os.geteuid() != 0:  # root writes through a read-only mode
        assert history.read_text() == "Who wrote the footer?\n"


# --- ragbudget index's progress ------------------------------------------------------------------


def _index_corpus(root: Any) -> Any:
    from _corpus import write_corpus

    return write_corpus(root / "docs", n=8)


def test_index_off_a_terminal_prints_plain_progress_lines_and_no_carriage_return(tmp_path: Any) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    docs = _index_corpus(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("RAGBUDGET_PROGRESS", None)
    argv = [sys.executable, "-m", "ragbudget", "index", str(docs), "--index-dir", str(tmp_path / "ix")]
    out = subprocess.run([*argv, "--embedder", "hash"], capture_output=True, text=True, env=env, check=True)
    both = out.stdout + out.stderr
    assert "\r" not in both  # a log, a pipe, CI: no bar redrawn in place
    lines = out.stderr.splitlines()
    # Each phase: where it started and where it ended, with its count and rate.
    assert any(ln.startswith("files: 0/8 files") for ln in lines), out.stderr
    assert any(ln.startswith("files: 8/8 files, ") and "/s" in ln for ln in lines), out.stderr
    assert any(ln.startswith("embedding: ") and " chunks, " in ln for ln in lines), out.stderr
    assert "files: 8 added" in out.stdout  # the summary is on stdout, the progress on stderr
    # --json keeps stderr quiet too.
    argv += ["--json", "--rebuild", "--embedder", "hash"]
    quiet = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_progress_lines_say_the_rate_and_what_is_left() -> None:
    import io

    from ragbudget.cli.terminal import Progress

    out = io.StringIO()
    with Progress(enabled=True, stream=out, every=0) as p:
        assert p.mode == "lines"
        p("files", 0, 40)
        p("files", 10, 40)
        p("files", 40, 40)
    lines = out.getvalue().splitlines()
    assert lines[0] == "files: 0/40 files"
    assert lines[1].startswith("files: 10/40 files, ") and lines[1].endswith(" left")
    assert lines[-1].startswith("files: 40/40 files, ") and "left" not in lines[-1]
    assert "\r" not in out.getvalue()


def test_progress_in_bytes_reads_in_megabytes() -> None:
    """``ragbudget models``' assembly and verification count bytes: a line says megabytes."""
    import io

    from ragbudget.cli.terminal import Progress

    out = io.StringIO()
    with Progress(enabled=True, stream=out, every=0) as p:
        p("assemble", 0, 491_400_064)
        p("assemble", 491_400_064, 491_400_064)
    lines = out.getvalue().splitlines()
    assert lines[0] == "assembling: 0/491 MB"
    assert lines[-1].startswith("assembling: 491/491 MB, ") and " MB/s" in lines[-1]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs a POSIX pseudo-terminal")
def test_index_at_a_terminal_draws_a_bar_per_phase_with_rate_and_eta(tmp_path: Any) -> None:
    import os
    import sys
    from pathlib import Path

    docs = _index_corpus(tmp_path)
    env = {**os.environ, "TERM": "xterm", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("RAGBUDGET_PROGRESS", None)
    argv = [sys.executable, "-m", "ragbudget", "index", str(docs), "--index-dir", str(tmp_path / "ix")]
    term = _Terminal([*argv, "--embedder", "hash"], env)
    import fcntl
    import struct
    import termios

    # A terminal has a size (a fresh pty is 0 columns wide, where tqdm draws nothing); the
    # child reads it seconds later, when its first bar opens.
    fcntl.ioctl(term.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    term.expect("files: 8 added", timeout=120)
    assert term.wait() == 0
    out = term.output
    # tqdm's bars: "files: 100%|████| 8/8 [00:01<00:00, 6.1file/s]" redrawn in place.
    assert "\r" in out and "8/8 [" in out and ("file/s]" in out or "s/file]" in out), out
    assert "embedding: " in out and ("chunk/s]" in out or "s/chunk]" in out), out
