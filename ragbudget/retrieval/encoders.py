"""Forward passes of a BERT sentence model: one query in numpy, many texts on torch (or ONNX Runtime).

The packaged kind of model (BERT, mean pooling over the tokens, L2 normalization: the layout
:class:`LightBert` reads from a sentence-transformers folder) is run three ways: a query by
:meth:`LightBert.encode` (numpy, no torch import: a question is a dozen tokens), a list of texts
by a :class:`Runner` — :class:`TorchBert` here (the sentence-transformers model's own BERT
module on torch's intra-op threads) or :class:`~ragbudget.retrieval.onnx.OnnxBert` (ONNX Runtime
on a cached export, :mod:`ragbudget.retrieval.onnx`). A runner hands back each text's unit vector
and, when asked, the final states of its content tokens with their character offsets;
:mod:`ragbudget.retrieval.embed` turns those token states into sentence vectors (span pooling, or
"late chunking"): one forward pass gives a chunk's vector and every one of its sentences' vectors.

Both runners share one schedule (:func:`schedule`): every text tokenized once, sorted by length,
and cut into batches by padded tokens, so a batch pads only to its own longest neighbour and no
round of the caller pads again.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

__all__ = ["BATCH_TOKENS", "BertLayout", "LightBert", "Runner", "TokenStates", "TorchBert", "schedule"]


class BertLayout(Protocol):
    """What a runner reads of a model folder (:class:`LightBert` is one): the folder
    (``tokenizer.json``, the weights the ONNX export reads), the window and the vector size."""

    folder: str
    dim: int
    max_seq_length: int


#: Padded tokens per batch of the batched runners: 32 windows of 256 word pieces, the batch
#: sentence-transformers runs by default, so a full batch costs what it did before.
BATCH_TOKENS = 8192

#: One text's content tokens: character offsets ``(T, 2)`` int64 in the text as given (special
#: tokens left out) and their final hidden states ``(T, dim)`` float32.
TokenStates = tuple["np.ndarray", "np.ndarray"]


def schedule(lengths: Sequence[int], *, max_rows: int, max_tokens: int = BATCH_TOKENS) -> list[list[int]]:
    """Positions of ``lengths`` in batches: longest first, texts of about one length together,
    each batch at most ``max_rows`` texts and (its longest × its rows) ≤ ``max_tokens`` padded
    tokens; a text longer than ``max_tokens`` alone.

    >>> schedule([3, 10, 4, 9], max_rows=8, max_tokens=20)
    [[1, 3], [2, 0]]
    >>> schedule([3, 10, 4], max_rows=1)
    [[1], [2], [0]]
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep their order
    out: list[list[int]] = []
    batch: list[int] = []
    for i in order:
        # Sorted longest first, so a batch's first text sets its width.
        if batch and (len(batch) >= max_rows or (len(batch) + 1) * lengths[batch[0]] > max_tokens):
            out.append(batch)
            batch = []
        batch.append(i)
    if batch:
        out.append(batch)
    return out


class Runner(abc.ABC):
    """Tokenization, the schedule and unpacking shared by both runners; a subclass runs one
    padded batch (:meth:`_run`)."""

    #: Texts per batch (int8: 1, see the module docstring) and threads running batches.
    max_rows: int = 32
    workers: int = 1

    def __init__(self, layout: BertLayout) -> None:
        import os

        from tokenizers import Tokenizer

        self.layout = layout
        # Its own tokenizer: truncation configured once, the layout's shared one is never touched.
        self.tokenizer = Tokenizer.from_file(os.path.join(layout.folder, "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(layout.max_seq_length)

    @abc.abstractmethod
    def _run(self, ids: np.ndarray, mask: np.ndarray, *, tokens: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Unit vectors ``(B, dim)`` of one padded batch, and the final states ``(B, T, dim)``
        when ``tokens``."""

    def encode(self, texts: Sequence[str], *, tokens: bool = False) -> tuple[np.ndarray, list[TokenStates] | None]:
        """One unit vector per text (as sentence-transformers encodes it: stripped, cut to
        ``max_seq_length`` with the special tokens), and with ``tokens`` each text's
        :data:`TokenStates`."""
        import numpy as np

        stripped = [str(t).strip() for t in texts]
        # Offsets are of the stripped text; the leading whitespace moves them back onto the text.
        leads = [len(str(t)) - len(str(t).lstrip()) for t in texts]
        encs = self.tokenizer.encode_batch(stripped)
        lengths = [len(e.ids) for e in encs]
        out = np.empty((len(texts), self.layout.dim), dtype=np.float32)
        states: list[Any] = [None] * len(texts)

        def run(rows: list[int]) -> None:
            width = lengths[rows[0]]
            ids = np.zeros((len(rows), width), dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for r, i in enumerate(rows):
                ids[r, : lengths[i]] = encs[i].ids
                mask[r, : lengths[i]] = 1
            vecs, hidden = self._run(ids, mask, tokens=tokens)
            out[rows] = vecs
            if hidden is None:
                return
            for r, i in enumerate(rows):
                keep = np.array(encs[i].special_tokens_mask, dtype=bool) == 0
                offsets = np.array(encs[i].offsets, dtype=np.int64).reshape(-1, 2)[keep] + leads[i]
                states[i] = (offsets, np.ascontiguousarray(hidden[r, : lengths[i]][keep], dtype=np.float32))

        batches = schedule(lengths, max_rows=self.max_rows)
        if self.workers > 1 and len(batches) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(self.workers, thread_name_prefix="ragbudget-embed") as pool:
                list(pool.map(run, batches))  # waits for every batch; re-raises a batch's error here
        else:
            for rows in batches:
                run(rows)
        return out, (states if tokens else None)


class TorchBert(Runner):
    """The sentence-transformers model's BERT (``model[0]``) on torch, pooled and normalized as
    its Pooling and Normalize modules do: the same vectors as ``model.encode`` to float32
    rounding, and the token states it pools."""

    def __init__(self, layout: BertLayout, st_model: Any, *, max_rows: int = 32) -> None:
        super().__init__(layout)
        first = st_model[0]
        self.bert = getattr(first, "auto_model", None) or first.model
        self.bert.eval()
        self.max_rows = max_rows

    def _run(self, ids: np.ndarray, mask: np.ndarray, *, tokens: bool) -> tuple[np.ndarray, np.ndarray | None]:
        import torch

        device = next(self.bert.parameters()).device
        t_ids = torch.from_numpy(ids).to(device)
        t_mask = torch.from_numpy(mask).to(device)
        with torch.inference_mode():
            h = self.bert(
                input_ids=t_ids, attention_mask=t_mask, token_type_ids=torch.zeros_like(t_ids)
            ).last_hidden_state
            m = t_mask.unsqueeze(-1).to(h.dtype)
            v = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            v = torch.nn.functional.normalize(v, p=2.0, dim=1)
        return v.float().cpu().numpy(), (h.float().cpu().numpy() if tokens else None)


# --- a light path for one query -----------------------------------------------------------------

# sentence-transformers module types of a plain BERT + mean pooling + normalize model (the packaged
# all-MiniLM-L6-v2 and most of its family), the layout the light path reproduces.
_ST = "sentence_transformers.models."
_LIGHT_MODULES = (_ST + "Transformer", _ST + "Pooling", _ST + "Normalize")


def _read_json(path: Any) -> Any:
    import json

    with open(path, encoding="utf-8") as f:
        return json.load(f)


class LightBert:
    """A folder holding a BERT sentence-transformers model with mean pooling and normalization,
    read without sentence-transformers, transformers or torch: its ``dim`` and window size come
    from its config files, its tokenizer is ``tokenizer.json`` through the ``tokenizers`` library
    (the same Rust tokenizer transformers wraps), and :meth:`encode` runs the BERT forward pass in
    numpy from ``model.safetensors``, one text at a time (no padding), in float64.

    Importing torch and sentence-transformers costs seconds per process; a query is a dozen
    tokens. The vectors equal sentence-transformers' to float32 rounding (|Δ| < 1e-6 on unit
    vectors; tests/test_embed.py checks it against the real model). :meth:`open` returns ``None``
    for any other layout, and the embedder then loads sentence-transformers as before.
    """

    def __init__(self, folder: str, dim: int, max_seq_length: int, tokenizer: Any, config: dict[str, Any]) -> None:
        self.folder = folder
        self.dim = dim
        self.max_seq_length = max_seq_length
        self.tokenizer = tokenizer
        self.config = config
        post = tokenizer.post_processor
        self.specials = int(post.num_special_tokens_to_add(False)) if post else 0
        self._weights: dict[str, Any] | None = None

    @classmethod
    def open(cls, folder: str) -> LightBert | None:
        import os

        try:
            modules = _read_json(os.path.join(folder, "modules.json"))
            types = tuple(m.get("type") for m in modules)
            if types != _LIGHT_MODULES or modules[0].get("path", "") != "":
                return None
            pooling = _read_json(os.path.join(folder, modules[1]["path"], "config.json"))
            modes = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v]
            if modes != ["pooling_mode_mean_tokens"]:
                return None
            config = _read_json(os.path.join(folder, "config.json"))
            st_config = _read_json(os.path.join(folder, "sentence_bert_config.json"))
            if (
                config.get("model_type") != "bert"
                or config.get("hidden_act") != "gelu"
                or config.get("position_embedding_type", "absolute") != "absolute"
                or st_config.get("do_lower_case")
                or not st_config.get("max_seq_length")
                or int(pooling["word_embedding_dimension"]) != int(config["hidden_size"])
                or not os.path.isfile(os.path.join(folder, "model.safetensors"))
            ):
                return None
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        except Exception:  # noqa: BLE001 - a missing file, odd JSON, no tokenizers: not this layout
            return None  # anything unexpected: the full sentence-transformers path decides
        max_len = min(int(st_config["max_seq_length"]), int(config.get("max_position_embeddings", 512)))
        tokenizer.no_padding()
        tokenizer.no_truncation()
        return cls(folder, int(pooling["word_embedding_dimension"]), max_len, tokenizer, config)

    def token_spans(self, texts: Sequence[str]) -> list[list[tuple[int, int]]]:
        encs = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [[(int(a), int(b)) for a, b in e.offsets] for e in encs]

    def _load(self) -> dict[str, Any]:
        if self._weights is None:
            import os

            from safetensors.numpy import load_file

            raw = load_file(os.path.join(self.folder, "model.safetensors"))
            # Checkpoints differ by a "bert." prefix; float64 keeps the sums closer to exact than
            # either float32 implementation, so both round to the same float32 vector.
            # The word embedding table (most of the bytes) stays float32: rows are converted as used.
            self._weights = {
                k.removeprefix("bert."): v if k.endswith("word_embeddings.weight") else v.astype("float64")
                for k, v in raw.items()
            }
        return self._weights

    def encode(self, texts: Sequence[str]) -> Any:
        import math

        import numpy as np

        w = self._load()
        cfg = self.config
        heads = int(cfg["num_attention_heads"])
        eps = float(cfg.get("layer_norm_eps", 1e-12))

        def erf(x: Any) -> Any:  # numpy has no erf; math.erf is exact and ~50 ns a call via map
            return np.fromiter(map(math.erf, x.ravel()), np.float64, x.size).reshape(x.shape)

        def norm(x: Any, name: str) -> Any:
            mu = x.mean(-1, keepdims=True)
            var = ((x - mu) ** 2).mean(-1, keepdims=True)
            return (x - mu) / np.sqrt(var + eps) * w[name + ".weight"] + w[name + ".bias"]

        def dense(x: Any, name: str) -> Any:
            return x @ w[name + ".weight"].T + w[name + ".bias"]

        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            # As sentence-transformers: stripped, cut to max_seq_length with the special tokens
            # ([CLS] … [SEP]) added after the cut. The shared tokenizer is never reconfigured, so
            # concurrent queries (the server's threads) are safe.
            enc = self.tokenizer.encode(str(text).strip(), add_special_tokens=False)
            if len(enc.ids) > self.max_seq_length - self.specials:
                enc.truncate(self.max_seq_length - self.specials)
            ids = self.tokenizer.post_process(enc).ids
            n = len(ids)
            x = (
                w["embeddings.word_embeddings.weight"][ids].astype(np.float64)
                + w["embeddings.position_embeddings.weight"][:n]
                + w["embeddings.token_type_embeddings.weight"][0]
            )
            x = norm(x, "embeddings.LayerNorm")
            for layer in range(int(cfg["num_hidden_layers"])):
                p = f"encoder.layer.{layer}."
                d = x.shape[1] // heads
                q, k, v = (
                    dense(x, p + f"attention.self.{m}").reshape(n, heads, d).transpose(1, 0, 2)
                    for m in ("query", "key", "value")
                )
                scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)
                scores = np.exp(scores - scores.max(-1, keepdims=True))
                ctx = (scores / scores.sum(-1, keepdims=True)) @ v
                ctx = ctx.transpose(1, 0, 2).reshape(n, heads * d)
                x = norm(dense(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
                h = dense(x, p + "intermediate.dense")
                h = 0.5 * h * (1.0 + erf(h / math.sqrt(2.0)))  # exact GELU, as BERT's "gelu"
                x = norm(dense(h, p + "output.dense") + x, p + "output.LayerNorm")
            v = x.mean(axis=0)
            out[i] = v / max(float(np.linalg.norm(v)), 1e-12)
        return out
