"""Model-free stand-ins shared by the tests (like Haystack's mock components)."""

from __future__ import annotations

import re

__all__ = ["WordTokenizer"]

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
