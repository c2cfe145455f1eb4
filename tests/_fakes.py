"""Model-free stand-ins shared by the tests (like Haystack's mock components)."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FakeBackend", "GeneratorStub", "WordTokenizer", "make_pdf"]

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

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
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

    @property
    def token_counter(self) -> Any:
        from ragbudget.tokens import HFTokenizer

        return HFTokenizer(self.tokenizer)


@dataclass(frozen=True)
class _Ref:
    id: str


class FakeBackend:
    """The :class:`ragbudget.backend.Backend` protocol, model-free: ``counter.count(text)`` counts,
    a ``template`` with ``apply_chat_template`` renders (without one, each message costs its
    content plus 8 tokens, as a template-less local model), ``generate(prompt, max_new_tokens=…)``
    answers (``cancel`` is passed when it takes one), and ``capacity`` is what it says.

    The one fake generation backend of the tests: fake pipelines hand it to the faces that talk
    to the protocol (chat's history meter and summaries, the server's usage counts).
    """

    def __init__(self, counter: Any, *, template: Any = None, generate: Any = None,
                 capacity: Any = None, model_id: str = "fake/model") -> None:
        self.counter = counter
        self.template = template if getattr(template, "chat_template", None) else None
        self._generate = generate
        self._capacity = capacity
        self.model_id = model_id

    def count(self, texts: Any) -> list[int]:
        return [int(self.counter.count(t)) for t in texts]

    def render(self, messages: Any) -> Any:
        from ragbudget.backend import RenderedPrompt

        msgs = tuple(dict(m) for m in messages)
        if self.template is not None:
            text = self.template.apply_chat_template(list(msgs), tokenize=False,
                                                     add_generation_prompt=True)
            return RenderedPrompt(messages=msgs, n_tokens=self.counter.count(text), exact=True,
                                  source="fake template", text=text)
        n = sum(self.counter.count(m["content"]) + 8 for m in msgs)
        return RenderedPrompt(messages=msgs, n_tokens=n, exact=False, source="fake, 8 per message")

    def capacity(self) -> Any:
        from ragbudget.backend import Capacity

        return self._capacity or Capacity(max_context_tokens=4096, max_context_source="fake")

    def generate(self, prompt: Any, *, max_new_tokens: int, sampling: Any = None, stop: Any = None,
                 on_text: Any = None, cancel: Any = None) -> Any:
        import inspect

        from ragbudget.generate import Generation

        if self._generate is None:
            raise AssertionError("this fake backend does not generate")
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens}
        if cancel is not None and "cancel" in inspect.signature(self._generate).parameters:
            kwargs["cancel"] = cancel
        out = self._generate(prompt, **kwargs)
        if isinstance(out, Generation):
            return out
        text = str(getattr(out, "text", out) or "")
        return Generation(text=text, prompt_tokens=0, new_tokens=self.counter.count(text),
                          finish_reason=str(getattr(out, "finish_reason", "stop")), seconds=0.0)
