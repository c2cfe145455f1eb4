"""Model-free stand-ins for the generator tests: a byte-level tokenizer and a tiny random Llama.

A real tokenizer class (``PreTrainedTokenizerFast``) with a ChatML template, one token per byte
and no merges: fast, deterministic, and it encodes ``<|im_start|>`` as a special token exactly as
SmolLM2's does.
"""

from __future__ import annotations

from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS,
    )
    hf.chat_template = CHATML
    return hf


def tiny_model(vocab_size: int = 259, seed: int = 0) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


#: What :func:`as_on_cuda` makes a CPU generation report.
CUDA_PEAK, CUDA_NAME = 123_456_789, "FakeGPU 80GB"


def as_on_cuda(generator: Any, monkeypatch: Any) -> None:
    """Make ``generator`` (a real :class:`~ragbudget.generation.generate.Generator`) report its runs as a
    CUDA device would: the measured peak (:data:`CUDA_PEAK`) and the device name, the two things
    only CUDA has; the model still generates for real on the CPU."""
    import torch

    class Peak:  # the generator's peak meter, as on CUDA: a figure after each run
        def reset(self, device: str) -> None:
            pass

        def read(self, device: str) -> int:
            return CUDA_PEAK

    monkeypatch.setattr(generator, "peak_meter", Peak())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: CUDA_NAME)
