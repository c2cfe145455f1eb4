"""Do the int8 MiniLM's vectors depend on the CPU? The library's int8 export (7-bit weights,
``reduce_range``) against the same export with full 8-bit weights (what it shipped before), each run
natively and with AVX2 only, under ``qemu-x86_64 -cpu Haswell`` (AVX2, no AVX-512, no VNNI):

    apt-get install qemu-user        # Debian: qemu-x86_64 7.2 emulates AVX2 (TCG)
    python bench/int8_isa.py --texts 160

Why it matters: ONNX Runtime's uint8 × int8 kernel adds each pair of products in 16 bits on CPUs
without VNNI, which saturates with 8-bit weights; VNNI (and AMX) add in 32 bits. A vector that
depends on the CPU moves the evidence floor's decision (a question declined on one machine is
answered on another) and mixes two embeddings in an index built on one machine and searched on
another.

Texts: SQuAD dev articles at odd positions from 7 on (embed_speed.py's recall test split, never
used to choose the quantization), each paragraph (its first 600 characters: one window) and its
first question, through the library's query path (``embed_query``: one text per run, as int8
always runs). Reported per export and CPU: cosine to the float32 vectors (float32 run natively;
checked against the emulated float32 where ``--float-emulated`` is given), the cosine between the
native and the AVX2 vectors of each text, the share of texts whose vectors are identical, and how
far each question's cosine to its own paragraph moves between the two CPUs (what an evidence floor
compares). Speed: native milliseconds per 256-token text on one thread, each export.

Raw result: bench/results/int8_isa.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

#: The exports compared: the library's own (``_quantize_onnx``) and the same without reduce_range.
EXPORTS = ("library", "full8")
QEMU_CPU = "Haswell"


def texts(n: int) -> list[str]:
    from embed_speed import squad, test_articles

    out: list[str] = []
    for a in test_articles(squad()):
        for p in a["paragraphs"]:
            out += [p["context"][:600], p["qas"][0]["question"]]
            if len(out) >= n:
                return out[:n]
    return out


def export(kind: str, folder: Path) -> Path:
    """The float32 export (the library's own cache) quantized as ``kind`` says, into ``folder``."""
    from ragbudget.memory.models import resolve_embedder
    from ragbudget.retrieval import onnx

    fp32 = Path(onnx.onnx_file(resolve_embedder(None), quantized=False))
    if kind == "float32":
        return fp32
    out = folder / f"{kind}.onnx"
    if kind == "library":
        onnx._quantize_onnx(str(fp32), str(out))
    else:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(
            str(fp32), str(out), weight_type=QuantType.QInt8, per_channel=True, extra_options={"MatMulConstBOnly": True}
        )
    return out


def child(model: str, texts_file: str, out: str) -> None:
    """Embed the texts with ``model`` through the library's query path; save the vectors."""
    import numpy as np

    import ragbudget.retrieval.onnx as onnx_mod
    from ragbudget.retrieval.embed import SentenceTransformerEmbedder

    onnx_mod.onnx_file = lambda folder, quantized: model  # the export under test, not the cache's
    items = json.loads(Path(texts_file).read_text())
    e = SentenceTransformerEmbedder(backend="onnx" if model.endswith("model.onnx") else "onnx-int8")
    np.save(out, np.stack([e.embed_query(t) for t in items]))


def run_children(jobs: list[tuple[str, Path, Path, bool]], texts_file: Path) -> None:
    """Run the embedding children two at a time (one per core), emulated ones under qemu."""
    procs: list[subprocess.Popen] = []
    for name, model, out, emulated in jobs:
        cmd = [sys.executable, __file__, "--child", str(model), str(texts_file), str(out)]
        if emulated:
            cmd = ["qemu-x86_64", "-cpu", QEMU_CPU, *cmd]
        print("embedding:", name, flush=True)
        procs.append(subprocess.Popen(cmd, stderr=subprocess.DEVNULL))
        if len(procs) == 2:
            for p in procs:
                if p.wait() != 0:
                    raise SystemExit(f"a child failed: {p.args}")
            procs = []
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a child failed: {p.args}")


def ms_per_text(model: Path, rounds: int = 30) -> float:
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    s = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(1000, 20000, (1, 256)).astype(np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    s.run(["embedding"], feed)
    best = float("inf")
    for _ in range(3):  # best of three rounds: the least disturbed by other users of the host
        t = time.perf_counter()
        for _ in range(rounds):
            s.run(["embedding"], feed)
        best = min(best, (time.perf_counter() - t) / rounds)
    return round(1000 * best, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=160, help="paragraphs and questions, alternating")
    ap.add_argument("--float-emulated", action="store_true", help="also run float32 under qemu (slow)")
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "TEXTS", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default="int8_isa")
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    if shutil.which("qemu-x86_64") is None:
        raise SystemExit("needs qemu-x86_64 (Debian: apt-get install qemu-user) to run the AVX2 side")
    import numpy as np
    from _results import cpu, write

    isa = cpu().get("isa", [])
    if "avx512_vnni" not in isa and "amx_int8" not in isa:
        print("note: this CPU has no VNNI: native and emulated runs take the same kernel path")
    items = texts(args.texts)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tf = work / "texts.json"
        tf.write_text(json.dumps(items))
        models = {k: export(k, work) for k in ("float32", *EXPORTS)}
        jobs = [("float32 native", models["float32"], work / "float32-native.npy", False)]
        for k in EXPORTS:
            jobs += [(f"{k} native", models[k], work / f"{k}-native.npy", False)]
            jobs += [(f"{k} AVX2", models[k], work / f"{k}-avx2.npy", True)]
        if args.float_emulated:
            jobs.append(("float32 AVX2", models["float32"], work / "float32-avx2.npy", True))
        run_children(jobs, tf)
        vec = {p.stem: np.load(p) for p in work.glob("*.npy")}
        speed = {k: ms_per_text(models[k]) for k in ("float32", *EXPORTS)}

    def cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (a * b).sum(axis=1)

    q, p = slice(1, None, 2), slice(0, None, 2)
    ref = vec["float32-native"]
    exports: dict = {}
    for k in EXPORTS:
        nat, emu = vec[f"{k}-native"], vec[f"{k}-avx2"]
        across = cos(nat, emu)
        moved = np.abs(cos(nat[q], nat[p]) - cos(emu[q], emu[p]))
        exports[k] = {
            "cos_to_float32_native": {
                "mean": round(float(cos(nat, ref).mean()), 5),
                "min": round(float(cos(nat, ref).min()), 5),
            },
            "cos_to_float32_avx2": {
                "mean": round(float(cos(emu, ref).mean()), 5),
                "min": round(float(cos(emu, ref).min()), 5),
            },
            "cos_native_vs_avx2": {"mean": round(float(across.mean()), 6), "min": round(float(across.min()), 5)},
            "identical_pct": round(100.0 * float((np.abs(nat - emu).max(axis=1) == 0).mean()), 1),
            "question_paragraph_cos_moved": {
                "mean": round(float(moved.mean()), 5),
                "max": round(float(moved.max()), 4),
            },
            "ms_per_256_token_text": speed[k],
        }
        print(k, exports[k], flush=True)
    result: dict = {
        "texts": len(items),
        "split": "test: SQuAD dev articles at odd positions from 7 on (0-based); each paragraph's first 600 "
        "characters and its first question",
        "emulated_cpu": f"qemu-x86_64 -cpu {QEMU_CPU} (AVX2, FMA; no AVX-512, no VNNI)",
        "exports": exports,
        "float32_ms_per_256_token_text": speed["float32"],
        "seconds": round(time.perf_counter() - started, 1),
    }
    if args.float_emulated:
        d = np.abs(vec["float32-native"] - vec["float32-avx2"]).max()
        result["float32_native_vs_avx2_max_abs"] = float(d)
    write(args.out, result, packages=("onnxruntime", "onnx"))


if __name__ == "__main__":
    main()
