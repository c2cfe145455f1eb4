"""ONNX Runtime for the packaged kind of embedding model: the export, its int8 quantization, the runner.

:class:`OnnxBert` runs a :class:`~ragbudget.retrieval.encoders.BertLayout` model (BERT, mean
pooling, normalization) on ONNX Runtime, through the schedule every runner shares
(:class:`~ragbudget.retrieval.encoders.Runner`). Its graph is an export of the model's own files
(:func:`onnx_file`: torch, once per model, float32 or int8 weights), written atomically into a
cache folder keyed by a digest of those files (``~/.cache/ragbudget/onnx/<digest>/``;
``RAGBUDGET_CACHE`` moves it). The ONNX backends need ``pip install 'ragbudget[onnx]'``
(:func:`available`).

Each session runs on one thread and ``workers`` threads run batches side by side (ORT releases
the GIL): on a shared 2-core host one intra-op pool per session spent about twice the CPU time per
window spinning for nothing (measured: 4.1 s of CPU for 64 windows against 2.1 s with two
one-thread runs side by side). There are :data:`WORKERS_PER_CORE` workers per core: on a busy host
the scheduler shares a core between runnable threads, and torch's OpenMP threads (the peers'
runtime) stay runnable while they spin, so with one worker per core the embedding got about half
the share of CPU that the peer got (0.44 of a core against 0.79 at load 8); two per core took 60
windows in a median 9.0 s against 11.5 s there, for 5% more CPU time. On an idle host the two just
take turns.

int8 runs one text per run (``max_rows=1``): dynamic quantization scales activations per tensor,
so padded neighbours would move a text's vector; one at a time, a vector is a function of its
text alone (a query equals the same text indexed).

int8 weights use 7 bits (``reduce_range``), so a vector does not depend on the CPU either. ONNX
Runtime multiplies uint8 activations by int8 weights; without VNNI (AVX2, AVX-512 before Cascade
Lake) its kernel adds each pair of products in 16 bits, which saturates with 8-bit weights
(255 × 127 × 2 > 32,767), while VNNI and AMX add in 32 bits. With 8-bit weights the same text's
vectors on AVX2 and on AVX-512 VNNI had a cosine of 0.9934 (mean), and a question's cosine to
its paragraph, what the evidence floor compares, moved by up to 0.033; with 7 bits
(255 × 64 × 2 < 32,767) they agree to 0.99995 (half of them bit for bit; the rest differ in
rounding) and that cosine moves by 0.0003 on average, for 0.0008 of cosine to the float vectors
on VNNI (0.9941 against 0.9949; AVX2 gains 0.0008) at the same speed (bench/int8_isa.py, AVX2
under ``qemu-x86_64 -cpu Haswell``; bench/results/int8_isa.json).
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ModelError
from .encoders import BertLayout, Runner

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

__all__ = ["INT8_FILE", "WORKERS_PER_CORE", "OnnxBert", "available", "cache_root", "model_digest", "onnx_file"]

#: Threads running batches per core this process may use (see the module docstring).
WORKERS_PER_CORE = 2


def available() -> bool:
    """Whether the ONNX backends can run here: ``onnxruntime`` and ``onnx`` importable."""
    import importlib.util

    # Both: the runtime runs the model, onnx (its quantizer's dependency) writes the int8 file.
    try:
        return all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx"))
    except (ImportError, ValueError):  # a module blocked in sys.modules (None) has no spec
        return False


#: Bumped when the export below changes, so an old cached file is not reused. 2: the graph also
#: outputs the token states (``token_states``); its ``embedding`` output is unchanged.
_EXPORT_VERSION = "2"
#: The int8 export's file name; a new name for each change to the quantization, so a cached file
#: quantized the old way is never reused (``model.int8.onnx``: 8-bit weights, before ``reduce_range``).
INT8_FILE = "model.int8.r7.onnx"
#: Checksums of model folders already hashed in this process (hashing 90 MB costs ~0.2 s).
_DIGESTS: dict[tuple[str, int, int], str] = {}


def model_digest(folder: str) -> str:
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


def cache_root() -> str:
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
    # transformers' logging helpers are untyped (the third-party seam).
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # a one-off export prints no weight-loading bar
    try:
        bert = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    finally:
        hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]

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
    # 7-bit weights (reduce_range): the same sums on every x86-64 (see the module docstring).
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer logs a "consider pre-processing" hint to root
    try:
        quantize_dynamic(
            src,
            out,
            weight_type=QuantType.QInt8,
            per_channel=True,
            reduce_range=True,
            extra_options={"MatMulConstBOnly": True},
        )
    finally:
        root.setLevel(level)


def onnx_file(folder: str, *, quantized: bool) -> str:
    """The cached ONNX export of ``folder`` (int8 or float32), written once, atomically: each
    file goes to a private temporary name and is renamed into place, so a concurrent or killed
    export never leaves a half-written model to load."""
    import os

    cache = os.path.join(cache_root(), model_digest(folder))
    fp32 = os.path.join(cache, "model.onnx")
    want = os.path.join(cache, INT8_FILE) if quantized else fp32
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


class OnnxBert(Runner):
    """A :class:`~ragbudget.retrieval.embed.BertLayout`-layout model on ONNX Runtime: the tokenizer from
    ``tokenizer.json``, the graph from :func:`onnx_file`. One-thread session, ``workers``
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
        path = onnx_file(layout.folder, quantized=quantized)
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
