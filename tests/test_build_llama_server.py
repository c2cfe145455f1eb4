"""tools/build-llama-server: a portable llama-server build (issue #30 §8). A ``-march=native`` build
on a CPU with AMX (Sapphire Rapids class) compiled ggml's AMX kernels in and crashed with SIGSEGV
in ``ggml_backend_amx_mul_mat`` at warm-up on every start; the build now targets an x86-64
instruction-set level with AVX-512 and AMX off, and its cache key names that level, not the CPU's
flags. These tests read the script's plan with made-up ``/proc/cpuinfo`` files; nothing is built
(``PYTHON=false`` stops a build at its first step, should one start). That the binary it builds
starts and answers is what tests/test_llamacpp_server.py checks against it."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "build-llama-server"
HASWELL = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 popcnt"
SAPPHIRE_RAPIDS = HASWELL + " avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8 avx_vnni"
NEHALEM = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt"

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 levels are planned on x86-64")


def run(tmp_path: Path, *args: str, flags: str = SAPPHIRE_RAPIDS) -> subprocess.CompletedProcess[str]:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    env = dict(os.environ, CPUINFO=str(cpuinfo), RAGBUDGET_CACHE=str(tmp_path / "cache"), PYTHON="false")
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def test_an_amx_cpu_gets_a_portable_build_without_amx_or_native(tmp_path: Path) -> None:
    plan = run(tmp_path, "--plan")
    assert plan.returncode == 0, plan.stderr
    key, cmake = plan.stdout.splitlines()
    assert key == "key: 0.3.36-x86_64-avx2"
    flags = cmake.removeprefix("cmake: ").split()
    for off in ("NATIVE", "AMX_TILE", "AMX_INT8", "AMX_BF16", "AVX512", "AVX512_VNNI", "AVX512_BF16"):
        assert f"-DGGML_{off}=OFF" in flags
    for on in ("AVX2", "FMA", "F16C", "BMI2"):
        assert f"-DGGML_{on}=ON" in flags
    assert not any("march" in f for f in flags)


def test_the_key_is_the_level_not_the_cpu(tmp_path: Path) -> None:
    # A cache built on the AMX machine is the one a Haswell uses, and the other way round.
    assert run(tmp_path, "--plan", flags=HASWELL).stdout == run(tmp_path, "--plan").stdout
    older = run(tmp_path, "--plan", flags=NEHALEM).stdout
    assert older.startswith("key: 0.3.36-x86_64-sse42") and "-DGGML_AVX2=OFF" in older


def test_cached_answers_without_building(tmp_path: Path) -> None:
    missing = run(tmp_path, "--cached")
    assert (missing.returncode, missing.stdout) == (1, "")
    assert not (tmp_path / "cache" / "llama-server").exists()  # nothing started
    binary = tmp_path / "cache" / "llama-server" / "0.3.36-x86_64-avx2" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert run(tmp_path, "--cached").stdout.strip() == str(binary)
    assert run(tmp_path, "--cached", flags=NEHALEM).returncode == 1  # another level, another build


def test_a_wrong_argument_is_refused(tmp_path: Path) -> None:
    wrong = run(tmp_path, "--natve")
    assert wrong.returncode == 2 and "unknown argument" in wrong.stderr
