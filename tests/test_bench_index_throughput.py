"""bench/index_throughput.py's arithmetic: each ragbudget row is set against both peers (the
documented torch chain and the tuning user's int8 ONNX one), as the peer's seconds over ragbudget's,
and the quantization config follows the CPU's flags as sentence-transformers' docs choose it."""

from __future__ import annotations

from _bench import load_bench

it = load_bench("index_throughput.py", "bench_index_throughput")


def _rows(*seconds: float) -> list[dict]:
    return [{"seconds": s, "cpu_seconds": 2 * s} for s in seconds]


def test_each_ragbudget_row_is_set_against_both_peers():
    out = it.summarize(
        {
            "ragbudget": _rows(10.0, 12.0, 11.0),
            "langchain": _rows(40.0, 44.0, 42.0),
            "langchain-onnx-int8": _rows(22.0, 23.0, 30.0),
        }
    )
    rb = out["ragbudget"]
    assert rb["median_seconds"] == 11.0 and rb["min_seconds"] == 10.0
    assert rb["x_peer_median"] == round(42.0 / 11.0, 3)
    assert rb["x_peer_min"] == 4.0
    assert rb["x_onnx_peer_median"] == round(23.0 / 11.0, 3)
    assert rb["x_onnx_peer_cpu"] == round(46.0 / 22.0, 3)
    assert "x_peer_median" not in out["langchain-onnx-int8"]


def test_a_run_without_the_onnx_peer_has_no_ratio_against_it():
    out = it.summarize({"ragbudget": _rows(10.0), "langchain": _rows(20.0)})
    assert out["ragbudget"]["x_peer_median"] == 2.0
    assert not any(k.startswith("x_onnx_peer") for k in out["ragbudget"])


def test_the_quantization_config_follows_the_cpu_flags(tmp_path):
    def cpu(flags: str) -> str:
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        return it.onnx_int8_config(str(path))

    assert cpu("fpu sse2 avx2 fma") == "avx2"
    assert cpu("avx2 avx512f avx512bw") == "avx512"
    assert cpu("avx2 avx512f avx512_vnni") == "avx512_vnni"
