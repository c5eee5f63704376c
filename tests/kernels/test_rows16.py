"""The decode copy of an 8-bit head interleaved by 16 output rows (moeq/native/csrc/rows16.c): both numerics (int16
activations by default, int8 with ``activations="int8"``) against float64 emulations of exactly those numerics, and
against the row-major kernels it replaces at up to 8 rows; rows past a multiple of 16, partial scale steps, groups
over 32; the copy's layout read back code by code; the native decode engine giving it to the head."""
import ctypes

import pytest
import torch

from moeq import native
from moeq.config import RTN
from moeq.kernels import plans
from tests.kernels.reference import emulate_i16

pytestmark = pytest.mark.skipif(
    native.lib() is None or native.lib().moeq_rows16_size(ctypes.byref(native.WStack(
        fmt=0, bits=8, gs=32, N=16, K=32, q=1, scale=1, scale_bf16=1))) == 0,
    reason="the 16-row kernels need an AVX512-VNNI or AVX2 build")


def emulate_i8(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x through llama.cpp's Q8_0 (d = amax / 127 in fp32, q = rint(x / d)), then @ w^T in float64."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round((xb * inv).clamp(-127, 127))
    return (q.double() * d.double()).reshape(x.shape) @ w.double().T


def _run(mod, x: torch.Tensor) -> torch.Tensor:
    """The module's one-call native linear (``moeq_quant_linear_bf16``, as its forward and the decode step call it)
    at any row count (the copy 8 rows per pass; the module's forward takes it up to its plan's limit: 4 rows for
    small weights)."""
    plan = plans.linear_plan(mod)
    stack, n, k = plan.stack, plan.n, plan.k
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    scratch = torch.empty(max(8, x.shape[0]) * (k + n) * 4 + n * k // 32 + 4096)
    native.lib().moeq_quant_linear_bf16(ctypes.byref(stack), x.data_ptr(), x.shape[0], None, y.data_ptr(),
                                        scratch.data_ptr())
    return y.float()


def _head(cfg, n: int, k: int, seed: int):
    from moeq.nn import QuantLinear

    torch.manual_seed(seed)
    return QuantLinear(cfg.quantize((torch.randn(n, k) * 0.05).bfloat16()))


@pytest.mark.parametrize("cfg", [RTN(8, 32, grid="signed"), RTN(8, 32), RTN(8, 128)], ids=lambda c: c.label())
@pytest.mark.parametrize("n,k", [(100, 576), (48, 2048)])  # 100: a last block of 4 rows; 576: 18 chunks
@pytest.mark.parametrize("act", ["default", "int8"])
def test_rows16_equals_the_numerics_and_the_row_major_kernels(cfg, n, k, act):
    k += k % cfg.group_size and 64  # groups of 128: 640 (5 groups)
    mod = _head(cfg, n, k, seed=n + k)
    mod.activations = act
    w = mod.qweight.dequantize(torch.float32)
    i8 = act == "int8" and native.i8_level() >= 2  # AVX2 builds take 8-bit weights with the default numerics
    emulate = emulate_i8 if i8 else emulate_i16
    for m in (1, 2, 3, 4, 8, 9, 20):  # past 8 rows: passes of 8 over the copy
        x = (torch.randn(m, k) * torch.linspace(0.2, 3, m)[:, None]).bfloat16()
        x[0, 32:64] = 0  # an all-zero chunk
        plans.set_rows16(mod, False)
        row_major = _run(mod, x)
        assert plans.linear_plan(mod).stack.rows16 is None
        plans.set_rows16(mod, True)
        y = _run(mod, x)
        if m <= 4:
            assert torch.equal(mod(x).float(), y)  # the module's forward: the same call
        stack = plans.linear_plan(mod).stack
        assert stack.rows16 and stack.rows16_layout == (2 if i8 else 1)
        want = emulate(w, x).float()
        # exact integer sums per 32 columns, fp32 accumulation: within a bf16 rounding, nearly all bit-equal
        assert ((y - want).abs() <= want.abs() * 2 ** -7 + 1e-6).all(), (m, (y - want).abs().max())
        assert (y == want.bfloat16().float()).float().mean() > 0.97
        if m <= 8 or not i8:  # the row-major int8 row takes up to 8 rows (past it: the default numerics)
            assert ((y - row_major).abs() <= row_major.abs() * 2 ** -7 + 1e-6).all()
        if m > 8:  # each row the bits it has in a batch of up to 8
            assert torch.equal(y, torch.cat([_run(mod, x[m0:m0 + 8]) for m0 in range(0, m, 8)]))
    plans.set_rows16(mod, False)


def test_rows16_layout_holds_every_code_and_scale():
    """The copy read back: each (row, column) code and each (row, group) scale where the layout puts it; rows past
    N zero."""
    n, k, gs = 20, 128, 64
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // gs, generator=g).bfloat16()
    ws = native.WStack(fmt=0, q=codes.data_ptr(), scale=scale.data_ptr(), scale_bf16=1, bits=8, gs=gs, spe=1, N=n,
                       K=k, dot_bf16=1)
    L = native.lib()
    size = L.moeq_rows16_size(ctypes.byref(ws))
    assert size == 32 * (k + k // gs * 2)
    for layout, width in ((1, 2), (2, 4)):
        buf = torch.full((size,), 7, dtype=torch.uint8)
        assert L.moeq_rows16_pack(ctypes.byref(ws), layout, buf.data_ptr()) == 1
        c = buf[:32 * k].view(2, k // 32, 32 // width, 16, width)  # [block, chunk, column step, row, column]
        got = c.permute(0, 3, 1, 2, 4).reshape(32, k)
        want = codes ^ 0x80 if layout == 1 else codes  # int16 layout: code - 128 as int8
        assert torch.equal(got[:n], want)
        assert (got[n:] == (0 if layout == 1 else 128)).all()
        s = buf[32 * k:].view(torch.bfloat16).view(2, k // gs, 16).permute(0, 2, 1).reshape(32, k // gs)
        assert torch.equal(s[:n], scale) and (s[n:] == 0).all()
    ws.zero = codes.data_ptr()  # asymmetric: outside the domain
    assert L.moeq_rows16_size(ctypes.byref(ws)) == 0
    assert L.moeq_rows16_pack(ctypes.byref(ws), 1, buf.data_ptr()) == 0


def test_rows16_declines_what_it_does_not_hold():
    """More than 8 rows, a NaN in int8 mode, or a layout of the other numerics: the gemv writes nothing and returns
    0 (the linear's decode call splits more rows into passes of 8; otherwise the row-major path runs)."""
    mod = _head(RTN(8, 32, grid="signed"), 64, 256, seed=1)
    plans.set_rows16(mod, True)
    stack = plans.linear_plan(mod).stack
    L = native.lib()
    x = torch.randn(9, 256)
    y = torch.full((9, 64), 5.0)
    assert L.moeq_rows16_gemv(ctypes.byref(stack), x.data_ptr(), 9, y.data_ptr()) == 0
    assert L.moeq_rows16_gemv(ctypes.byref(stack), x.data_ptr(), 0, y.data_ptr()) == 0
    assert L.moeq_rows16_gemv(ctypes.byref(stack), x.data_ptr(), 8, y.data_ptr()) == 1
    stack.act_i8 = 1  # int16 layout, int8 numerics asked: declined
    y.fill_(5.0)
    assert L.moeq_rows16_gemv(ctypes.byref(stack), x.data_ptr(), 2, y.data_ptr()) == 0 and (y == 5).all()
    mod.activations = "int8"
    x = torch.randn(2, 256).bfloat16()
    x[1, 3] = float("nan")
    y = mod(x).float()
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()
