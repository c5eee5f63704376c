"""The differential matrix: every quantization method x compute dtype (bf16, fp16, fp32) x weight dtype (bf16 scales,
as a saved bf16 checkpoint holds them, or the compute dtype's) x every forward path the modules can take (native
with the decode layout it picks, native row-major, plain torch with no native library, Triton under the interpreter)
x row counts (1, 4, 17: decode, a batch, a prompt past the fused kernels' rows) against a float64 reference over the
dequantized weights, for fused experts and quantized linears. A path outside its domain must decline before it
touches memory; one that writes past its buffer crashes this test, and under the AddressSanitizer build
(``test_matrix_under_asan``) fails it with a report."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from moeq import native
from moeq.config import METHODS
from moeq.nn import QuantExperts, QuantLinear
from moeq.nn.experts import Activation
from tests.kernels.reference import reference_moe

E, H, I, A = 4, 128, 64, 2  # w13 [4, 128, 128], w2 [4, 128, 64]: inside every native kernel's domain (N % 16, K % 64)
ROWS = (1, 4, 17)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
METHOD_NAMES = [m for m in METHODS if m != "none"]
# relative L2 error vs float64 over the same dequantized weights: activation rounding only (bf16 ~2^-8 per element)
TOL = {torch.bfloat16: 0.02, torch.float16: 0.01, torch.float32: 0.01}


def _weights(wdtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(wdtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(wdtype)
    wl = (torch.randn(2 * I, H, generator=g) * 0.05).to(wdtype)
    return w13, w2, wl


def _build(method: str, wdtype: torch.dtype):
    fmt = METHODS[method]
    w13, w2, wl = _weights(wdtype)
    experts = QuantExperts(fmt.quantize(w13, "w13", slices=E), fmt.quantize(w2, "w2", slices=E), Activation())
    linear = QuantLinear(fmt.quantize(wl, "linear"))
    return experts, linear


def _ref_experts(m: QuantExperts, x, idx, wts) -> torch.Tensor:
    glu = lambda g, u: torch.nn.functional.silu(g) * u  # noqa: E731
    return reference_moe(m.w13.dequantize(torch.float64), m.w2.dequantize(torch.float64), x, idx, wts, glu)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all()
    return ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _problem(t: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, A, generator=g), -1).to(dtype)
    return x, idx, wts


def _run_paths(experts: QuantExperts, linear: QuantLinear, dtype: torch.dtype, paths: list[str]) -> list[str]:
    """Every (path, rows) case for one module pair and compute dtype; returns the failures (empty: all pass)."""
    bad = []
    for path in paths:
        for mod in (experts, linear):
            mod.decode_layout = "rows" if path == "rows" else "auto"
            mod.choose_kernel()
            if path == "triton":
                mod.kernel = "triton"
        for t in ROWS:
            x, idx, wts = _problem(t, dtype, seed=t)
            with torch.no_grad():
                ye = experts(x, idx, wts)
                yl = linear(x)
            assert ye.dtype == dtype and yl.dtype == dtype and ye.shape == (t, H) and yl.shape == (t, 2 * I)
            ref_l = x.double() @ linear.qweight.dequantize(torch.float64).T
            for what, y, ref in (("experts", ye, _ref_experts(experts, x, idx, wts)), ("linear", yl, ref_l)):
                if not torch.isfinite(y).all() or _rel(y, ref) > TOL[dtype]:
                    bad.append(f"{what} path={path} rows={t}: rel err "
                               f"{_rel(y, ref) if torch.isfinite(y).all() else 'non-finite'}")
    return bad


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_matrix(method, monkeypatch):
    """Native (auto layout and row-major) and plain-torch paths, every compute and weight dtype, 1/4/17 rows."""
    failures = []
    for wdtype in (torch.bfloat16, torch.float32):
        experts, linear = _build(method, wdtype)
        for dtype in DTYPES:
            failures += [f"w={wdtype} x={dtype} {f}" for f in _run_paths(experts, linear, dtype, ["auto", "rows"])]
    # the plain-torch path: no native library at all
    monkeypatch.setattr(native, "lib", lambda: None)
    for name in ("has_simd", "has_dpbf16", "has_i8_dot", "has_cb3_dot"):
        monkeypatch.setattr(native, name, lambda: False)
    experts, linear = _build(method, torch.bfloat16)
    for dtype in DTYPES:
        failures += [f"no-native x={dtype} {f}" for f in _run_paths(experts, linear, dtype, ["torch"])]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("method", ["q4_0", "rtn-int4-asym", "rtn-int8", "nf4", "int8"])
def test_matrix_triton_interpreter(method):
    """The Triton path on CPU tensors (fp32/fp16 activations: the interpreter's bf16 dot is wrong)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a GPU is present: the Triton path is tested on it by tests/kernels/test_triton_kernels.py")
    experts, linear = _build(method, torch.bfloat16)
    failures = []
    for dtype in (torch.float32, torch.float16):
        failures += [f"x={dtype} {f}" for f in _run_paths(experts, linear, dtype, ["triton"])]
    assert not failures, "\n".join(failures)


def _libasan() -> str | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    path = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


ASAN_METHODS = ("q4_0", "rtn-int4", "iq4nl-dq", "nl3", "nl2", "q5_0", "q8_0", "rtn-int4-asym", "nf4", "int8", "fp8", "mxfp4")


@pytest.mark.asan
@pytest.mark.skipif(_libasan() is None, reason="the C compiler has no AddressSanitizer runtime")
def test_matrix_under_asan(tmp_path):
    """The native-path matrix run against an AddressSanitizer build of the kernels: any write or read past a tensor's
    allocation fails it with ASan's report (it caught the il16 dequantizer writing fp32 into an fp16 buffer)."""
    env = dict(os.environ, MOEQ_NATIVE_SANITIZE="address", LD_PRELOAD=_libasan(), XDG_CACHE_HOME=str(tmp_path),
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=86", PYTHONMALLOC="malloc")
    iq2s = os.path.join(os.path.dirname(os.path.dirname(__file__)), "formats", "test_iq2s.py")
    prefill = os.path.join(os.path.dirname(__file__), "test_prefill_gemm.py")
    cases = [f"{__file__}::test_matrix[{m}]" for m in ASAN_METHODS] + [iq2s]  # IQ2_S needs K % 256: its own file
    here = os.path.dirname(__file__)
    # the 8-bit head's 16-row copy past 8 rows (passes of 8; a partial last block of rows)
    cases += [f"{here}/test_rows16.py::test_rows16_equals_the_numerics_and_the_row_major_kernels"
              "[default-100-576-rtn-int8-signed-g32]"]
    if native.has_dpbf16():  # the prompt GEMM's IQ2_S tiles, the bf12 head's tile form (AVX512-BF16 builds only)
        cases += [f"{prefill}::test_prefill_gemm_matches_float64[avx512-bf16-iq2s]",
                  f"{here}/test_bf12.py::test_gemv_equals_the_float64_product[16-moeq_bf12_gemm_bf16]"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-s", "-p", "no:cacheprovider", *cases],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:] + proc.stderr[-6000:])
    assert "passed" in proc.stdout
