"""Model-free stand-ins shared by the tests (like Haystack's mock components)."""

from __future__ import annotations

import contextlib
import io
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The class itself, bound now: tests replace ``ragbudget.pipeline.Pipeline`` (the CLI's) with
# factories that call corpus_index().
from ragbudget.pipeline import Pipeline as _Pipeline

__all__ = [
    "SLOT_ANSWER",
    "WINDOW",
    "FakeBackend",
    "FakeGeneration",
    "FakeGenerator",
    "GeneratorStub",
    "WordCounter",
    "WordTokenizer",
    "corpus_index",
    "fake",
    "fake_pipeline",
    "make_pdf",
    "printable_stop",
    "running",
    "words_reply",
]

_PIECE = re.compile(r"<\|[a-z_]+\|>|\w+|[^\w\s]|\s+")


class WordTokenizer:
    """HF-shaped tokenizer: one id per word, punctuation mark, whitespace run or ``<|marker|>``.

    ``chatml=True`` gives it a ChatML chat template like SmolLM2's; otherwise it has none and
    prompts use the plain ``System:/User:/Assistant:`` layout.
    """

    def __init__(self, *, chatml: bool = False) -> None:
        self.chat_template = "chatml" if chatml else None
        self.name_or_path = "chatml-words" if chatml else "word-tokenizer"
        self.vocab: dict[str, int] = {}
        self.inverse: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for piece in _PIECE.findall(text):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.vocab)
                self.inverse[self.vocab[piece]] = piece
            ids.append(self.vocab[piece])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.inverse[i] for i in ids)

    def apply_chat_template(
        self, messages: list[dict[str, str]], tokenize: bool = False, add_generation_prompt: bool = False
    ) -> str:
        out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def make_pdf(pages: list[str], password: str | None = None) -> bytes:
    """A small real PDF with one Helvetica text line per input line, written by pypdf."""
    from pypdf import PdfWriter
    from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject

    writer = PdfWriter()
    font = writer._add_object(
        DictionaryObject(
            {
                NameObject("/Type"): NameObject("/Font"),
                NameObject("/Subtype"): NameObject("/Type1"),
                NameObject("/BaseFont"): NameObject("/Helvetica"),
            }
        )
    )
    for text in pages:
        page = writer.add_blank_page(612, 792)
        page[NameObject("/Resources")] = DictionaryObject(
            {NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})}
        )
        stream = DecodedStreamObject()
        stream.set_data(
            b"".join(
                b"BT /F1 12 Tf 72 %d Td (%s) Tj ET\n" % (720 - 16 * i, line.encode())
                for i, line in enumerate(text.split("\n"))
            )
        )
        page[NameObject("/Contents")] = writer._add_object(stream)
    if password:
        writer.encrypt(user_password=password, owner_password=password + "-owner")
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


@dataclass
class GeneratorStub:
    """What a Pipeline reads from its generator before generating: the tokenizer (prompts are
    counted in it), and no model loaded. Fakes that also generate extend it."""

    tokenizer: Any = field(default_factory=WordTokenizer)
    loaded: bool = False
    model: Any = None
    config: Any = None
    model_ref: Any = field(default_factory=lambda: _Ref("fake/generator"))
    device: str = ""  # neither CPU nor GPU: no time cap on the context

    def warm_up(self) -> GeneratorStub:
        return self  # nothing to load

    @property
    def token_counter(self) -> Any:
        from ragbudget.tokens import HFTokenizer

        return HFTokenizer(self.tokenizer)


@dataclass(frozen=True)
class _Ref:
    id: str


class WordCounter:
    """One token per whitespace-separated word."""

    def count(self, text: str) -> int:
        return len(text.split())


def words_reply(n: int = 6) -> Any:
    """A reply of ``word0 word1 …``: ``n`` words (fewer when ``max_new_tokens`` is lower)."""
    return lambda messages, max_new_tokens: [f"word{i}" for i in range(min(n, max_new_tokens))]


class FakeBackend:
    """The :class:`ragbudget.generation.backend.Backend` protocol, model-free, for a real
    :class:`~ragbudget.pipeline.Pipeline` (``Pipeline(index_dir, backend=FakeBackend(…))``, which
    then plans, admits and budgets history exactly as on a served engine — or, with
    ``memory_plan``, exactly as on the local generator).

    * counting: ``counter.count(text)`` (default: one token per word); rendering: ``template``'s
      ``apply_chat_template`` when it has a ``chat_template`` (exact), else each message's content
      plus 8 tokens, as a template-less local model;
    * ``capacity``: the :class:`~ragbudget.generation.backend.Capacity` it reports (settable; default a
      4096-token window and nothing else). ``memory_plan`` (a dict of
      :func:`~ragbudget.memory.budget.plan_budget` keywords, e.g. ``{"gpu": "16GiB"}``) makes it
      plan its memory as the local generator does: ``capacity(max_new_tokens=n)`` is then the
      default model's plan for ``n`` (``Capacity.plan``), and the pipeline budgets by it;
    * generation: ``reply(messages, max_new_tokens)`` gives the answer's pieces (default
      :func:`words_reply`); they stream one at a time to ``on_text``, ``token_delay`` seconds
      apart, ``cancel`` is looked at before each (``finish_reason "cancelled"``), a ``stop``
      string ends the answer before it; ``"length"`` when the answer took all ``max_new_tokens``.
      ``fail`` (settable) is raised instead of answering;
    * what it saw: ``calls`` (``messages``, ``question``, ``answer`` (not a conversation's side
      request: ``answer_calls``), ``max_new_tokens``, ``sampling``, ``stop``), ``cancelled``
      (questions stopped by ``cancel``), ``running``/``peak_running``
      (answers being written at once), ``overruns`` (prompts that, with their ``max_new_tokens``,
      did not fit ``capacity.max_context_tokens``), ``counted`` (count and render calls),
      ``prefetched`` (prefetch calls);
    * where it runs: an engine elsewhere (``url`` ``http://fake.invalid``, whose health and load
      the server watches), or in this process with ``memory_plan`` (``url`` ``""``), as the
      built-in backends of each kind; ``url=`` sets it.
    """

    kind = "fake"

    def __init__(
        self,
        counter: Any = None,
        *,
        template: Any = None,
        reply: Any = None,
        capacity: Any = None,
        model_id: str = "fake/model",
        token_delay: float = 0.0,
        fail: BaseException | None = None,
        memory_plan: dict[str, Any] | None = None,
        url: str | None = None,
    ) -> None:
        import threading

        self.counter = counter if counter is not None else WordCounter()
        self.template = template if getattr(template, "chat_template", None) else None
        self.reply = reply if reply is not None else words_reply()
        self.capacity_figures = capacity
        self.model_id = model_id
        self.token_delay = token_delay
        self.fail = fail
        self.memory_plan = memory_plan
        self.plans: dict[int, Any] = {}  # the memory plan per max_new_tokens, with memory_plan
        self.calls: list[dict[str, Any]] = []
        self.cancelled: list[str] = []
        self.running = self.peak_running = self.overruns = 0
        self.counted = 0  # count() and render() calls: the work of building a prompt
        self.prefetched = 0
        self.url = url if url is not None else ("" if memory_plan is not None else "http://fake.invalid")
        self._lock = threading.Lock()

    @property
    def answer_calls(self) -> list[dict[str, Any]]:
        """The ``calls`` that asked for an answer (not a conversation's summary or rewrite)."""
        return [c for c in self.calls if c["answer"]]

    def count(self, texts: Any) -> list[int]:
        self.counted += 1
        return [int(self.counter.count(t)) for t in texts]

    def render(self, messages: Any) -> Any:
        from ragbudget.generation.backend import RenderedPrompt

        self.counted += 1
        msgs = tuple(dict(m) for m in messages)
        if self.template is not None:
            text = self.template.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)
            return RenderedPrompt(
                messages=msgs, n_tokens=self.counter.count(text), exact=True, source="fake template", text=text
            )
        n = sum(self.counter.count(m["content"]) + 8 for m in msgs)
        return RenderedPrompt(messages=msgs, n_tokens=n, exact=False, source="fake, 8 per message")

    def probing(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def requests_sent(self) -> Any:
        return None

    def prefetch(self, texts: Any, chats: Any = ()) -> None:
        self.prefetched += 1

    def capacity(self, *, max_new_tokens: int | None = None, fresh: bool = False) -> Any:
        from ragbudget.generation.backend import Capacity

        if self.memory_plan is None:
            return self.capacity_figures or Capacity(max_context_tokens=4096, max_context_source="fake")
        from ragbudget.memory.budget import plan_budget

        n = 256 if max_new_tokens is None else max_new_tokens
        if n not in self.plans:
            self.plans[n] = plan_budget(max_new_tokens=n, **self.memory_plan)
        plan = self.plans[n]
        return Capacity(
            max_context_tokens=plan.max_context_tokens,
            max_context_source="fake plan",
            kv_tokens_total=plan.kv_capacity_tokens,
            kv_total_source="fake plan",
            engine_kind="fake-local",
            plan=plan,
        )

    def warm_up(self) -> None:
        pass

    def close(self) -> None:
        pass

    def template_overhead(self, system_prompt: str | None = None) -> int:
        from ragbudget.generation.backend import render_overhead

        return render_overhead(self, system_prompt)

    def prompt_builder(self, system_prompt: str | None = None) -> Any:
        from ragbudget.prompt.prompt import EnginePromptBuilder

        return EnginePromptBuilder(self, system_prompt=system_prompt)

    def tune(self, admission: Any) -> bool:
        return False  # no model, no measured speed: admission counts KV tokens only

    def refresh_speed(self, *, idle: Any, recheck_s: float) -> bool:
        return False

    def generate(
        self,
        prompt: Any,
        *,
        max_new_tokens: int,
        sampling: Any = None,
        stop: Any = None,
        on_text: Any = None,
        cancel: Any = None,
    ) -> Any:
        from ragbudget.generation.backend import prompt_messages
        from ragbudget.generation.generate import Generation
        from ragbudget.prompt.prompt import Prompt

        messages = prompt_messages(prompt)
        question = prompt.question if isinstance(prompt, Prompt) else messages[-1]["content"]
        n_prompt = self.render(messages).n_tokens
        with self._lock:
            self.calls.append(
                {
                    "messages": messages,
                    "question": question,
                    # The pipeline's answer comes as a built Prompt; a side request of a
                    # conversation (its summary, a follow-up's rewrite) as bare chat messages.
                    "answer": isinstance(prompt, Prompt),
                    "sampling": sampling,
                    "stop": stop,
                    "max_new_tokens": max_new_tokens,
                    "prompt_tokens": n_prompt,
                }
            )
            window = self.capacity().max_context_tokens
            if window is not None and n_prompt + max_new_tokens > window:
                self.overruns += 1
        if self.fail is not None:
            raise self.fail
        with self._lock:
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
        out: list[str] = []
        finish = "stop"
        try:
            for i, piece in enumerate(self.reply(messages, max_new_tokens)):
                stopped = cancel is not None and (
                    cancel.wait(self.token_delay) if self.token_delay else cancel.is_set()
                )
                if stopped:
                    self.cancelled.append(question)
                    finish = "cancelled"
                    break
                if self.token_delay and cancel is None:
                    time.sleep(self.token_delay)
                if stop and piece.strip() in stop:
                    break
                text = piece if i == 0 else " " + piece
                out.append(text)
                if on_text is not None:
                    on_text(text)
            else:
                if len(out) >= max_new_tokens:
                    finish = "length"
        finally:
            with self._lock:
                self.running -= 1
        text = "".join(out)
        return Generation(
            text=text, prompt_tokens=n_prompt, new_tokens=len(out), finish_reason=finish, seconds=0.0, cache="served"
        )


#: The documents of :func:`corpus_index`: one short file each, one chunk each.
CORPUS = {
    "pdf-headers": "The PDF cleaner strips running page headers that repeat at the top of PDF pages",
    "pdf-footer": "The PDF cleaner also removes the page footer with page numbers at the bottom of PDF pages",
    "html-footer": "HTML boilerplate such as the site footer and navigation links is removed by trafilatura",
    "kv-budget": "The KV cache budget is computed from free GPU memory and bytes per token",
    "dedup": "Near duplicate chunks are removed with MinHash signatures over word shingles",
    "leader": "The Project Leader is elected every year by the developers",
}


def corpus_index(embedder: str | None = None) -> Any:
    """A real index of :data:`CORPUS` (``docs/<name>.md``) with the packaged MiniLM embedder (or
    ``embedder``, e.g. ``"hash:256"`` for a subprocess that should not load a model), built once
    per test process into a temporary folder (removed at exit); its path. Read-only: a test that
    changes an index copies it first."""
    import atexit
    import shutil
    import tempfile
    from pathlib import Path

    if embedder not in _CORPUS_INDEX:
        root = Path(tempfile.mkdtemp(prefix="rb-corpus-"))
        atexit.register(shutil.rmtree, root, True)
        docs = root / "docs"
        docs.mkdir()
        for name, text in CORPUS.items():
            (docs / f"{name}.md").write_text(text + ".\n")
        _Pipeline(root / "idx", embedder=embedder).index([docs])
        _CORPUS_INDEX[embedder] = root / "idx"
    return _CORPUS_INDEX[embedder]


_CORPUS_INDEX: dict[str | None, Any] = {}


def printable_stop(text: str) -> str:
    """Two printable characters from the middle of ``text``, ASCII letters/digits first (the
    byte-level tiny model also emits control and replacement characters, which no stop string
    can hold; what it emits depends on the prompt, so any other printable pair will do)."""
    pairs = [text[i : i + 2] for i in range(3, len(text) - 1)]
    for pair in pairs:
        if pair.isascii() and pair.isalnum():
            return pair
    for pair in pairs:
        if pair.isprintable() and not any(c.isspace() or c == "\ufffd" for c in pair):
            return pair
    raise AssertionError(f"no printable pair in {text!r}")


@dataclass
class FakeGeneration:
    text: str
    prompt_tokens: int
    new_tokens: int
    max_new_tokens: int
    finish_reason: str = "stop"
    oom_steps: tuple = ()
    prompt: Any = None
    measurement: Any = None  # a fake measures no CUDA peak


@dataclass
class FakeGenerator:
    """Stands in for ragbudget.generation.generate.Generator: records prompts, answers with a fixed text."""

    answer: str = "The Nobel Prize [1]."
    delay: float = 0.0
    word_delay: float = 0.0  # between streamed words (a slow model, for cancellation tests)
    cancelled: int = 0
    tokenizer: WordTokenizer = field(default_factory=WordTokenizer)
    prompts: list[Any] = field(default_factory=list)
    loaded: bool = False
    model: Any = None
    config: Any = None
    device: str = ""  # neither CPU nor GPU: no time cap unless a test says so
    model_ref: Any = field(default_factory=lambda: _Ref("fake/generator"))

    def warm_up(self) -> FakeGenerator:
        return self  # nothing to load

    @property
    def token_counter(self) -> Any:
        """Its tokenizer as the real generator's counter (what the local backend renders side
        requests, a summary or a follow-up's rewrite, with)."""
        from ragbudget.tokens import HFTokenizer

        return HFTokenizer(self.tokenizer)

    def generate(
        self, prompt: Any, *, max_new_tokens: int, on_text: Any = None, cancel: Any = None, **_: Any
    ) -> FakeGeneration:
        self.prompts.append(prompt)
        # A side request (a summary, a follow-up's rewrite) comes as chat messages, not rendered.
        n_prompt = getattr(prompt, "n_tokens", None)
        if n_prompt is None:
            n_prompt = sum(len(self.tokenizer.encode(m["content"])) for m in prompt)
        if self.delay:
            time.sleep(self.delay)
        # Like the real generator, cancel is checked at every token, streamed or not.
        for word in self.answer.split(" "):
            if cancel is not None and cancel.is_set():
                self.cancelled += 1
                return FakeGeneration(
                    self.answer, n_prompt, 0, max_new_tokens, finish_reason="cancelled", prompt=prompt
                )
            if on_text:
                on_text(word + " ")
            if self.word_delay:
                time.sleep(self.word_delay)
        return FakeGeneration(self.answer, n_prompt, len(self.answer.split()), max_new_tokens, prompt=prompt)


# --- a real Pipeline on the FakeBackend, and a real server in front of it (test_server, test_examples)

#: With a 1,000-token window and 700 tokens reserved for each answer, one request reserves more
#: than a third of two windows: ``slots`` windows of KV admit exactly ``slots`` requests at once.
WINDOW, SLOT_ANSWER = 1000, 700


def fake_pipeline(
    *,
    words: int = 6,
    token_delay: float = 0.0,
    slots: int | None = None,
    max_queue: int = 4,
    timeout: float = 2.0,
    max_new_tokens: int | None = None,
    fail: BaseException | None = None,
    index_dir: Path | None = None,
) -> _Pipeline:
    """A real Pipeline over the corpus index, generating on a FakeBackend that answers ``words``
    words, ``token_delay`` seconds apart. ``slots``: the backend reports a window of
    :data:`WINDOW` tokens and that many request slots, so admission admits that many requests at
    once (each reserving :data:`SLOT_ANSWER` tokens of answer); None: no limit reported."""
    from ragbudget.generation.backend import Capacity

    capacity = (
        Capacity(
            max_context_tokens=WINDOW, max_context_source="fake", max_concurrent=slots, max_concurrent_source="fake"
        )
        if slots
        else None
    )
    backend = FakeBackend(reply=words_reply(words), capacity=capacity, token_delay=token_delay, fail=fail)
    if max_new_tokens is None:
        max_new_tokens = SLOT_ANSWER if slots else 256
    # The library's default packing (spans): the index stores every chunk's sentence vectors at
    # build time, so a question embeds no sentence and the server tests' short client time-outs
    # hold (they packed whole chunks while a chunk's first use embedded its sentences).
    # The server tests ask placeholder questions ("runs", "waits") that the corpus does not
    # answer: no evidence floor, so each reaches admission and the backend (declining is
    # tests/test_evidence.py's subject).
    return _Pipeline(
        index_dir or corpus_index(),
        backend=backend,
        max_new_tokens=max_new_tokens,
        queue_size=max_queue,
        queue_timeout=timeout,
        evidence_floor=0,
    )


def fake(pipe: _Pipeline) -> FakeBackend:
    """The pipeline's FakeBackend (what the "model" received)."""
    backend = pipe.backend
    assert isinstance(backend, FakeBackend)
    return backend


@contextlib.contextmanager
def running(pipe: _Pipeline, **options: Any) -> Iterator[str]:
    """``pipe`` served by a real uvicorn server on a loopback port for the block; its URL."""
    from ragbudget.server.app import background_server, create_app

    with background_server(create_app(pipe, **options)) as url:
        yield url


def stop_server(proc: Any) -> str:
    """Stop a ``ragbudget serve`` subprocess the way a user does (Ctrl-C, then a kill after 20 s)
    and return its stderr."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err
