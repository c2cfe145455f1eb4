"""The interactive chat loop of ``ragbudget chat``: lines in, answers and memory reports out.

:func:`run_chat` reads questions (stdin, one per line, or :class:`TerminalLines` with readline
editing and a history file), handles the slash commands of :data:`CHAT_HELP` itself, sends
everything else to a :class:`~ragbudget.chat.Conversation`, and writes each turn with
:mod:`ragbudget.cli.display`. The conversation's memory policy lives in :mod:`ragbudget.chat`; this
module is only the terminal around it (signals, readline, the command words). :class:`Progress`
is the other thing drawn on a terminal: ``ragbudget index``'s progress bars.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import FrameType, ModuleType
from typing import IO, TYPE_CHECKING, Any  # Any: tqdm bars (no types), sampling keywords, a signal handler's result

from ..errors import RagBudgetError
from .display import format_sources, format_turn

if TYPE_CHECKING:
    from ..chat import ChatTurn, Conversation

__all__ = ["CHAT_HELP", "Progress", "TerminalLines", "run_chat"]

#: What ``/help`` prints. Commands are handled here and never reach the model.
CHAT_HELP = """\
Commands (never sent to the model):
  /help           this list
  /sources        the sources of the last answer
  /reset          forget the conversation
  /exit, /quit    leave (Ctrl-D too)
Ctrl-C stops the answer being written and keeps the conversation; at the prompt it clears the line.
Anything else is a question; Up/Down recall earlier ones.
"""

# A slash command is one word: "/etc/fstab holds what?" is a question, "/sourcs" a typo.
_COMMAND = re.compile(r"/[A-Za-z?]+")


class TerminalLines:
    """The lines typed at a terminal, for :func:`run_chat`: readline editing (arrows, Ctrl-R) and a
    history kept in ``history_file`` across sessions. Ctrl-C clears the line being typed, Ctrl-D
    (end of input) ends the iteration. A history file that cannot be read or written (missing,
    read-only) only means no history is kept; a platform without ``readline`` gets plain input.
    """

    def __init__(
        self,
        prompt: str = "> ",
        *,
        history_file: str | None = None,
        write: Callable[[str], object] | None = None,
        history_length: int = 1000,
    ) -> None:
        self.prompt = prompt
        self.history_file = history_file
        self._write = write or (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
        self._readline: ModuleType | None = None
        try:
            import readline
        except ImportError:  # Windows without pyreadline: input() still works, without history
            return
        self._readline = readline
        readline.set_history_length(history_length)
        if history_file:
            # First session, or unreadable: start with an empty history.
            with contextlib.suppress(OSError):
                readline.read_history_file(history_file)

    def save(self) -> None:
        """Write the history file (its folder is created); errors are ignored."""
        if self._readline is None or not self.history_file:
            return
        with contextlib.suppress(OSError):  # read-only home, full disk: history is a convenience
            os.makedirs(os.path.dirname(self.history_file) or ".", exist_ok=True)
            self._readline.write_history_file(self.history_file)

    def __iter__(self) -> Iterator[str]:
        # Ctrl-C at the prompt must drop the typed line even in a process started with SIGINT
        # ignored (a non-interactive shell's `&`, some IDE runners and test harnesses pass that on
        # through exec): the prompt raises KeyboardInterrupt while it waits, as an interactive
        # Python does, and the disposition it found is put back when the chat ends.
        previous = _interruptible()
        try:
            while True:
                try:
                    line = input(self.prompt)
                except KeyboardInterrupt:  # Ctrl-C at the prompt: drop what was typed
                    self._write("\n")
                    continue
                except EOFError:  # Ctrl-D
                    self._write("\n")
                    return
                yield line
        finally:
            if previous is not None:
                import signal

                signal.signal(signal.SIGINT, previous)
            self.save()


def _interruptible() -> Callable[[int, FrameType | None], Any] | int | None:
    """SIGINT raises KeyboardInterrupt from here on (main thread only); returns the handler it
    replaced, or None when nothing was changed."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        return None
    return signal.signal(signal.SIGINT, signal.default_int_handler)


class _CtrlC:
    """While active (main thread only), the first Ctrl-C sets ``cancel`` — the answer stops at its
    next token, or leaves the admission queue — instead of killing the program; a second one
    raises ``KeyboardInterrupt`` for whatever does not watch ``cancel`` (a model still loading)."""

    def __init__(self, cancel: threading.Event) -> None:
        self.cancel = cancel
        # What signal.signal returned: the handler to put back (a function, SIG_DFL/SIG_IGN, or None
        # for one not installed from Python).
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.cancel.is_set():
            raise KeyboardInterrupt
        self.cancel.set()

    def __enter__(self) -> _CtrlC:
        import signal

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def run_chat(
    conversation: Conversation,
    lines: Iterable[str],
    write: Callable[[str], object],
    *,
    as_json: bool = False,
    stream: bool = False,
    prompt: str | None = None,
    generate_options: dict[str, Any] | None = None,
    banner: str | None = None,
    show_path: Callable[[str], str] = str,
) -> int:
    """Read questions from ``lines`` (stdin, one per line, or :class:`TerminalLines`) and
    ``write`` answers with citations and the turn's memory report. Lines starting with a slash
    command (``/help``, ``/sources``, ``/reset``, ``/exit``, ``/quit``; :data:`CHAT_HELP`) are
    handled here and never sent to the model; an unknown one says so. Ctrl-C while an answer is
    being written cancels that answer (it is not kept in the history) and the loop goes on; so do
    errors of one turn (too long, overloaded). With ``as_json`` each turn is one JSON line.
    ``prompt`` is written before each read (for line sources that do not prompt themselves),
    ``banner`` once at the start. ``generate_options`` (temperature, seed, stop, …) go to every
    answer. Returns the number of questions answered."""
    options = dict(generate_options or {})
    answered = 0
    last: ChatTurn | None = None
    if banner:
        write(banner + "\n")
    if prompt:
        write(prompt)
    for raw in lines:
        line = raw.strip()
        word = line.split(maxsplit=1)[0] if line else ""
        if line and _COMMAND.fullmatch(word):
            command = word.lower()
            if command in ("/exit", "/quit"):
                break
            if command in ("/help", "/?"):
                write(CHAT_HELP)
            elif command == "/reset":
                conversation.reset()
                last = None
                write("(conversation reset)\n")
            elif command == "/sources":
                if last is None:
                    write("(no answer yet)\n")
                elif not last.sources:
                    write("(the last answer had no sources)\n")
                else:
                    write(format_sources(last.sources, show_path) + "\n")
            else:
                write(f"unknown command {word}; /help lists the commands\n")
        elif line:  # a question (an empty line just asks for the prompt again)
            cancel = threading.Event()
            try:
                with _CtrlC(cancel):
                    if stream and not as_json:
                        turn = conversation.ask(line, on_text=write, cancel=cancel, **options)
                        write("\n" if turn.cancelled else "\n\n")
                    else:
                        turn = conversation.ask(line, cancel=cancel, **options)
                        if not as_json and not turn.cancelled:
                            write(turn.text + "\n\n")
            except KeyboardInterrupt:  # a second Ctrl-C, while nothing was watching `cancel`
                write("\n(answer cancelled)\n")
            except RagBudgetError as exc:
                write(f"Error: {exc}\n")
            else:
                if turn.cancelled:
                    write("(answer cancelled)\n")
                else:
                    answered += 1
                    last = turn
                    if as_json:
                        write(json.dumps(turn.to_dict(), ensure_ascii=False, default=str) + "\n")
                    else:
                        write(format_turn(turn, show_path) + "\n\n")
        if prompt:
            write(prompt)
    return answered


class Progress:
    """``ragbudget index``'s and ``ragbudget models``' progress, driven by the library's callback
    ``(phase, done, total)``.

    On a terminal: one tqdm bar per phase (files read, chunks embedded, sentence vectors, writing)
    with its count, rate and ETA. Anywhere else (a log file, a pipe, CI): plain lines — when a
    phase starts, at most one every ``every`` seconds while it runs, and where it ended — each
    with its count, rate and ETA, and never a carriage return. ``stream`` is where it writes
    (stderr); ``RAGBUDGET_PROGRESS=bars|lines|off`` overrides the choice.
    """

    #: What each phase counts, and what it is called in a line.
    UNITS = {
        "files": "file",
        "embed": "chunk",
        "sentences": "chunk",
        "write": "step",
        "assemble": "byte",
        "verify": "byte",
    }
    LABELS = {
        "files": "files",
        "embed": "embedding",
        "sentences": "sentence vectors",
        "write": "writing",
        "assemble": "assembling",
        "verify": "verifying",
    }

    def __init__(self, *, enabled: bool, stream: IO[str] | None = None, every: float = 10.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        mode = os.environ.get("RAGBUDGET_PROGRESS", "").strip().lower()
        if not enabled or mode == "off":
            self.mode = "off"
        elif mode in ("bars", "lines"):
            self.mode = mode
        else:
            isatty = getattr(self.stream, "isatty", None)
            self.mode = "bars" if isatty is not None and isatty() else "lines"
        self.enabled = self.mode != "off"
        self.every = float(every)
        self._bars: dict[str, Any] = {}  # tqdm bars: tqdm ships no types
        self._lines: dict[str, _Phase] = {}

    def __enter__(self) -> Progress:
        return self

    def __call__(self, phase: str, done: int, total: int | None = None) -> None:
        if self.mode == "bars":
            self._bar(phase, done, total)
        elif self.mode == "lines":
            self._line(phase, done, total)

    def _bar(self, phase: str, done: int, total: int | None) -> None:
        from tqdm import tqdm

        bar = self._bars.get(phase)
        if bar is None:
            unit = self.UNITS.get(phase, "")
            # Bytes read best scaled (491M, 1.1G) in powers of 1024, as tqdm's download bars do.
            scale = {"unit": "B", "unit_scale": True, "unit_divisor": 1024} if unit == "byte" else {"unit": unit}
            bar = self._bars[phase] = tqdm(
                total=total, desc=self.LABELS.get(phase, phase), leave=True, file=self.stream, **scale
            )
        if total is not None and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)  # update(), not n=: tqdm's rate and ETA come from its updates

    def _line(self, phase: str, done: int, total: int | None) -> None:
        import time

        now = time.monotonic()
        state = self._lines.get(phase)
        if state is None:
            state = self._lines[phase] = _Phase(start=now, done=done, total=total, printed=now)
            self._write(phase, state, now)
            return
        state.done, state.total = done, total
        if now - state.printed >= self.every:
            state.printed = now
            self._write(phase, state, now)

    def _write(self, phase: str, state: _Phase, now: float, *, end: bool = False) -> None:
        start, done, total = state.start, state.done, state.total
        unit = self.UNITS.get(phase, "item")
        if unit == "byte":  # counted in bytes, read in megabytes
            text = (
                f"{self.LABELS.get(phase, phase)}: {done / 1e6:,.0f}"
                + (f"/{total / 1e6:,.0f}" if total else "")
                + " MB"
            )
        else:
            text = f"{self.LABELS.get(phase, phase)}: {done:,}" + (f"/{total:,}" if total else "") + f" {unit}s"
        elapsed = now - start
        if done and elapsed > 0:
            rate = done / elapsed
            if unit == "byte":
                text += f", {rate / 1e6:,.0f} MB/s"
            else:
                text += f", {rate:.3g} {unit}/s" if rate >= 1 else f", {1 / rate:.3g} s/{unit}"
            if total and done < total and not end:
                text += f", about {_duration((total - done) / rate)} left"
            elif end:
                text += f", {_duration(elapsed)}"
        self.stream.write(f"{text}\n")
        self.stream.flush()

    def __exit__(self, *exc: object) -> None:
        import time

        for bar in self._bars.values():
            bar.close()
        now = time.monotonic()
        for phase, state in self._lines.items():  # where each phase ended, and how long it took
            self._write(phase, state, now, end=True)


@dataclass(kw_only=True)
class _Phase:
    """A phase's progress as :class:`Progress` prints it in lines (times are monotonic)."""

    start: float  # when the phase was first seen
    done: int
    total: int | None
    printed: float  # when its last line was printed


def _duration(seconds: float) -> str:
    """``seconds`` for a progress line: ``42 s``, ``3 min 05 s``, ``1 h 02 min``.

    >>> _duration(42.4), _duration(185), _duration(3725)
    ('42 s', '3 min 05 s', '1 h 02 min')
    """
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"
