"""Forward passes of a BERT sentence model over many texts, on ONNX Runtime or torch.

One job: run the packaged kind of model (BERT, mean pooling over the tokens, L2 normalization:
the layout :class:`ragbudget.retrieval.embed._LightBert` reads) over a list of texts, and hand back each
text's unit vector and, when asked, the final states of its content tokens with their character
offsets. :mod:`ragbudget.retrieval.embed` turns those token states into sentence vectors (span pooling, or
"late chunking"): one forward pass gives a chunk's vector and every one of its sentences' vectors.

Both runners share one schedule (:func:`schedule`): every text tokenized once, sorted by length,
and cut into batches by padded tokens, so a batch pads only to its own longest neighbour and no
round of the caller pads again.

* :class:`OnnxBert` — ONNX Runtime on an export of the model written once into a cache folder
  (float32, or int8 weights); each session runs on one thread and ``workers`` threads run
  batches side by side (ORT releases the GIL): on a shared 2-core host one intra-op pool per
  session spent about twice the CPU time per window spinning for nothing (measured: 4.1 s of CPU
  for 64 windows against 2.1 s with two one-thread runs side by side). There are
  :data:`WORKERS_PER_CORE` workers per core: on a busy host the scheduler shares a core between
  runnable threads, and torch's OpenMP threads (the peers' runtime) stay runnable while they
  spin, so with one worker per core the embedding got about half the share of CPU that the peer
  got (0.44 of a core against 0.79 at load 8); two per core took 60 windows in a median 9.0 s
  against 11.5 s there, for 5% more CPU time. On an idle host the two just take turns.
* :class:`TorchBert` — the sentence-transformers model's own BERT module on torch (torch's own
  intra-op threads), for the same layout.

int8 runs one text per run (``max_rows=1``): dynamic quantization scales activations per tensor,
so padded neighbours would move a text's vector; one at a time, a vector is a function of its
text alone (a query equals the same text indexed).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConfigError, ModelError

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

__all__ = ["BertLayout", "OnnxBert", "TokenStates", "TorchBert", "schedule"]


class BertLayout(Protocol):
    """What an encoder reads of a model folder (:class:`ragbudget.retrieval.embed._LightBert` is
    one): the folder (``tokenizer.json``, the ONNX files), the window and the vector size. A
    protocol, so that this module never imports the embedder that imports it."""

    folder: str
    dim: int
    max_seq_length: int


#: Threads running batches per core this process may use (see the module docstring).
WORKERS_PER_CORE = 2

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


class _Runner:
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

    def _run(self, ids: np.ndarray, mask: np.ndarray, *, tokens: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Unit vectors ``(B, dim)`` of one padded batch, and the final states ``(B, T, dim)``
        when ``tokens``."""
        raise NotImplementedError

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
                for _ in pool.map(run, batches):  # re-raises a batch's error here
                    pass
        else:
            for rows in batches:
                run(rows)
        return out, (states if tokens else None)


class TorchBert(_Runner):
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


# --- ONNX Runtime ---------------------------------------------------------------------------------

#: Bumped when the export below changes, so an old cached file is not reused. 2: the graph also
#: outputs the token states (``token_states``); its ``embedding`` output is unchanged.
_EXPORT_VERSION = "2"
#: Checksums of model folders already hashed in this process (hashing 90 MB costs ~0.2 s).
_DIGESTS: dict[tuple[str, int, int], str] = {}


def _model_digest(folder: str) -> str:
    import os

    weights = os.path.join(folder, "model.safetensors")
    st = os.stat(weights)
    key = (os.path.realpath(weights), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256(f"ragbudget-onnx-{_EXPORT_VERSION}".encode())
        for name in ("config.json", "tokenizer.json", "model.safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        _DIGESTS[key] = h.hexdigest()[:16]
    return _DIGESTS[key]


def _cache_root() -> str:
    import os

    base = os.environ.get("RAGBUDGET_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ragbudget"
    )
    return os.path.join(base, "onnx")


def _export_onnx(folder: str, out: str) -> None:
    """Write the model (BERT, mean pooling over the attention mask, L2 normalization: what the
    sentence-transformers modules of this layout compute) as one ONNX graph with two outputs:
    ``embedding`` (the unit vectors) and ``token_states`` (BERT's last hidden states, for span
    pooling)."""
    import warnings

    import torch
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    # Eager attention: the SDPA mask builder of transformers 5 traces into shape constants.
    hf_logging.disable_progress_bar()  # a one-off export prints no weight-loading bar
    try:
        bert = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    finally:
        hf_logging.enable_progress_bar()

    class MeanPooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            h = self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=torch.zeros_like(input_ids)
            ).last_hidden_state
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            v = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(v, p=2.0, dim=1), h

    # Two rows of different lengths, so the traced graph keeps batch, length and padding dynamic.
    ids = torch.tensor([[101, 2023, 2003, 1037, 102], [101, 7592, 102, 0, 0]])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        # The TorchScript exporter: the dynamo one needs onnxscript and gives the same graph here.
        torch.onnx.export(
            MeanPooled(),
            (ids, (ids != 0).long()),
            out,
            input_names=["input_ids", "attention_mask"],
            output_names=["embedding", "token_states"],
            dynamic_axes={
                "input_ids": {0: "batch", 1: "tokens"},
                "attention_mask": {0: "batch", 1: "tokens"},
                "embedding": {0: "batch"},
                "token_states": {0: "batch", 1: "tokens"},
            },
            opset_version=17,
            dynamo=False,
        )


def _quantize_onnx(src: str, out: str) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # Per-channel int8 weights on the weight MatMuls only: per-tensor scales, or quantizing the
    # attention products (both inputs dynamic), cost ~0.05 of cosine to the float vectors on
    # SQuAD paragraphs; this keeps ~0.994 (bench/embed_speed.py measures what that does to recall).
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer logs a "consider pre-processing" hint to root
    try:
        quantize_dynamic(
            src, out, weight_type=QuantType.QInt8, per_channel=True, extra_options={"MatMulConstBOnly": True}
        )
    finally:
        root.setLevel(level)


def _onnx_file(folder: str, *, quantized: bool) -> str:
    """The cached ONNX export of ``folder`` (int8 or float32), written once, atomically: each
    file goes to a private temporary name and is renamed into place, so a concurrent or killed
    export never leaves a half-written model to load."""
    import os

    cache = os.path.join(_cache_root(), _model_digest(folder))
    fp32 = os.path.join(cache, "model.onnx")
    want = os.path.join(cache, "model.int8.onnx") if quantized else fp32
    if os.path.isfile(want):
        return want
    try:
        os.makedirs(cache, exist_ok=True)
        tmp = f"{want}.{os.getpid()}.tmp"
        if not os.path.isfile(fp32):
            ftmp = f"{fp32}.{os.getpid()}.tmp"
            try:
                log.info("exporting the embedding model to ONNX (once per model) into %s", cache)
                _export_onnx(folder, ftmp)
                os.replace(ftmp, fp32)
            finally:
                if os.path.exists(ftmp):
                    os.unlink(ftmp)
        if quantized:
            try:
                _quantize_onnx(fp32, tmp)
                os.replace(tmp, want)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    except OSError as exc:
        raise ModelError(
            f"could not write the ONNX export of {folder!r} to {cache!r}: {exc}; "
            "set RAGBUDGET_CACHE to a writable folder"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - exporter/quantizer errors are many types
        raise ModelError(
            f"could not export {folder!r} to ONNX ({type(exc).__name__}: {exc}); use backend='torch'"
        ) from exc
    return want


def _threads() -> int:
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class OnnxBert(_Runner):
    """A :class:`~ragbudget.retrieval.embed.BertLayout`-layout model on ONNX Runtime: the tokenizer from
    ``tokenizer.json``, the graph from :func:`_onnx_file`. One-thread session, ``workers``
    (:data:`WORKERS_PER_CORE` per core this process may use) batches at a time; int8 one text
    per batch."""

    def __init__(self, layout: BertLayout, session: Any, *, quantized: bool = False, max_rows: int = 32) -> None:
        super().__init__(layout)
        self.session = session
        self.quantized = quantized
        self.max_rows = 1 if quantized else max_rows
        self.workers = WORKERS_PER_CORE * _threads()
        outputs = {o.name for o in session.get_outputs()}
        if "token_states" not in outputs:  # a graph from before span pooling: vectors only
            raise ModelError(
                "the cached ONNX export has no token_states output (written by an older version); "
                "delete it to export it again"
            )

    @classmethod
    def load(cls, layout: BertLayout, *, quantized: bool, max_rows: int = 32) -> OnnxBert:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise ConfigError(
                "the ONNX backend needs onnxruntime and onnx: pip install 'ragbudget[onnx]' (or use backend='torch')"
            ) from exc
        path = _onnx_file(layout.folder, quantized=quantized)
        opts = ort.SessionOptions()
        # One thread per run: the runner runs ``workers`` batches side by side instead (see the
        # module docstring for why an intra-op pool loses on a shared CPU).
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        try:
            session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - a damaged cache file
            raise ModelError(f"could not load the ONNX model {path!r} ({exc}); delete it to export it again") from exc
        return cls(layout, session, quantized=quantized, max_rows=max_rows)

    def _run(self, ids: np.ndarray, mask: np.ndarray, *, tokens: bool) -> tuple[np.ndarray, np.ndarray | None]:
        feed = {"input_ids": ids, "attention_mask": mask}
        if not tokens:
            return self.session.run(["embedding"], feed)[0], None
        vecs, hidden = self.session.run(["embedding", "token_states"], feed)
        return vecs, hidden
