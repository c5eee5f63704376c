"""The native library built for CPUs without AVX512-BF16 — ``MOEQ_NATIVE_MARCH=x86-64-v3`` (AVX2: most laptops and
desktops) and ``skylake-avx512`` (AVX512F/BW/DQ/VL without BF16 or VBMI: Skylake-SP, Cascade Lake) — passes the kernel
and format tests too, and its decode forwards (AVX2 + FMA rows, with the AVX512F-only kernels beside them on the
second) match the modules' own: the paths those users take are checked on an AVX512-BF16 machine (an AVX2-only one
runs the first and compiles the others)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

NOT_TRITON = "not triton"  # the Triton interpreter's matrix rows do not touch the native build: run once, not per ISA

ROOT = Path(__file__).resolve().parents[1]
NEEDS = {"x86-64-v3": {"avx2", "fma", "bmi2", "f16c"}, "skylake-avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl"},
         "cooperlake": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"}, "x86-64": set()}


def runs_here(march: str, tmp_path: Path) -> bool:
    """Whether this CPU executes a ``march`` build (the machines these tests run on differ: Zen 4 with AVX512-BF16,
    Zen 3 with AVX2 only). Where it cannot, the build is still compiled (not loaded: its code would fault), so a
    kernel that no longer compiles for those CPUs fails here too."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        missing = NEEDS[march] - set(flags.split(":", 1)[1].split())
    except (OSError, StopIteration):
        missing = {"a readable /proc/cpuinfo"}
    if not missing:
        return True
    env = dict(os.environ, MOEQ_NATIVE_MARCH=march, XDG_CACHE_HOME=str(tmp_path / "cache"))
    code = ("import shutil; from moeq import native; so = native._build(shutil.which('cc') or shutil.which('gcc')); "
            "assert so is not None and so.stat().st_size > 0; print('built')")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "built" in r.stdout, r.stderr[-2000:]
    return False


@pytest.mark.isa
@pytest.mark.parametrize("march", ["x86-64-v3", "skylake-avx512"])
def test_avx2_build_passes_kernel_tests(tmp_path, march):
    if not runs_here(march, tmp_path):
        pytest.skip(f"the {march} build compiled (checked); this CPU cannot run it")
    env = dict(os.environ, MOEQ_NATIVE_MARCH=march, XDG_CACHE_HOME=str(tmp_path / "cache"))
    code = ("from moeq import native; assert native.lib() is not None and not native.has_dpbf16() and "
            "native.lib().moeq_simd_level() == 1; print('avx2')")  # the AVX2 rows, not plain C
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "avx2" in r.stdout, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "tests/kernels/test_cpu_kernels.py", "tests/kernels/test_int8_activations.py",
                        "tests/kernels/test_rows16.py", "tests/kernels/test_il16.py", "tests/kernels/test_bf12.py",
                        "tests/kernels/test_matrix.py", "tests/kernels/test_kernel_plan.py", "tests/formats",
                        "tests/test_compat.py",
                        "tests/models/test_decode_forwards.py", "tests/models/test_attention.py", "-m", "not slow",
                        "-k", NOT_TRITON], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]


@pytest.mark.isa
def test_plain_build_links_and_passes_kernel_tests(tmp_path):
    """The baseline x86-64 build (no AVX2: what the plain-C paths serve) links with every symbol defined — the
    SIMD-only helpers stay behind their guards — and its kernels match the references."""
    if not runs_here("x86-64", tmp_path):
        pytest.skip("the x86-64 build compiled (checked); this CPU cannot run it")
    env = dict(os.environ, MOEQ_NATIVE_MARCH="x86-64", XDG_CACHE_HOME=str(tmp_path / "cache"))
    code = "from moeq import native; assert native.lib() is not None and native.lib().moeq_simd_level() == 0; print('plain')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "plain" in r.stdout, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "tests/kernels/test_cpu_kernels.py", "tests/kernels/test_bf12.py",
                        "tests/kernels/test_matrix.py", "tests/kernels/test_kernel_plan.py", "-m", "not slow", "-k",
                        NOT_TRITON], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:]


@pytest.mark.isa
def test_bf16_build_without_vbmi_runs_the_3bit_rows(tmp_path):
    """AVX512-BF16 without VBMI (``cooperlake``): the 3-bit codebook rows unpack their 24-bit words in scalar code
    instead of vpermb/vpmultishiftqb, and match the reference like the VBMI form (the 2-bit rows too)."""
    if not runs_here("cooperlake", tmp_path):
        pytest.skip("the cooperlake build compiled (checked); this CPU cannot run it")
    env = dict(os.environ, MOEQ_NATIVE_MARCH="cooperlake", XDG_CACHE_HOME=str(tmp_path / "cache"))
    code = ("from moeq import native; assert native.has_dpbf16() and not native.has_cb3_dot(); print('bf16')")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "bf16" in r.stdout, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "nl3 or nl2",
                        "tests/kernels/test_cpu_kernels.py", "tests/formats"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:]


def test_bad_march_is_refused(monkeypatch):
    from moeq import MoeqError, native

    monkeypatch.setenv("MOEQ_NATIVE_MARCH", "x86-64; rm -rf /")
    with pytest.raises(MoeqError, match="MOEQ_NATIVE_MARCH"):
        native.march()
