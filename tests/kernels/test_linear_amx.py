"""Decode-step linears for a few rows on the AMX tile unit (``linear_amx`` in moe.c): an il16 weight's codes,
expanded through its table, are the B tiles of TDPBF16PS and all rows ride in one A tile. Checked against a float64
reference over the dequantized weights and against the gemv kernels it replaces (``moeq_set_linear_amx_rows(0)``),
for every 4-bit format in the il16 layout, every row count it takes, a row count N of blocks that does not divide
evenly over the threads, and widths whose group count is not a multiple of the four groups in flight."""
from __future__ import annotations

import ctypes

import pytest
import torch

from moeq import native
from moeq.config import method
from moeq.kernels import plans
from moeq.nn import QuantLinear

pytestmark = pytest.mark.skipif(not native.amx_tiles(), reason="needs a CPU with AMX tiles and Linux's permission "
                                "(Sapphire Rapids or later); the gemv kernels serve these rows elsewhere")
METHODS = ["q4_0", "iq4nl", "iq4nl-dq", "rtn-int4"]  # 4-bit without a zero point: the il16 decode layout
DECLINED = ["rtn-int4-asym", "q8_0", "rtn-int8", "nl3", "nl2", "fp8", "nf4"]  # row-major: the gemv kernels


@pytest.fixture
def rows_on():
    L = native.lib()
    yield L
    L.moeq_set_linear_amx_rows(4)


def _linear(name: str, n: int, k: int) -> QuantLinear:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 3] *= 20  # an outlier column
    return QuantLinear(method(name).quantize(w.to(torch.bfloat16), "linear"))


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("k", [256, 384])  # 8 / 12 groups of 32 (4 / 3 for rtn-int4's group 128): a last partial set
def test_linear_amx_matches_float64_and_the_gemv(name, k, rows_on):
    lin = _linear(name, 144, k)  # 9 blocks of 16 rows
    wd = lin.qweight.dequantize(torch.float64)
    assert rows_on.moeq_linear_amx_takes(ctypes_ws(lin), 8) == 1
    for m in (1, 2, 4, 7, 8, 16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        rows_on.moeq_set_linear_amx_rows(1)
        ya = _native(lin, x)
        rows_on.moeq_set_linear_amx_rows(0)
        yg = _native(lin, x)
        ref = x.double() @ wd.T
        ea = ((ya.double() - ref).norm() / ref.norm()).item()
        eg = ((yg.double() - ref).norm() / ref.norm()).item()
        assert torch.isfinite(ya).all() and ea < 0.01, (m, ea)
        assert ea <= eg * 1.2 + 1e-4, (m, ea, eg)  # the same weights and group sums: no worse than the gemv
        assert (ya.float() - yg.float()).abs().max() <= 0.01 * yg.float().abs().max()


def ctypes_ws(lin: QuantLinear):
    return ctypes.byref(plans.linear_plan(lin).stack)


def _native(lin: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """moeq_quant_linear_bf16 for all of x's rows (the module's own forward hands rows past its plan to torch)."""
    plan = plans.linear_plan(lin)
    y = torch.empty(x.shape[0], plan.n, dtype=torch.bfloat16)
    scratch = plan.scratch(x.shape[0])  # held for the call
    native.lib().moeq_quant_linear_bf16(ctypes_ws(lin), native.ptr(x), native.i64(x.shape[0]), native.ptr(None),
                                        native.ptr(y), native.ptr(scratch))
    return y


def test_linear_amx_declines_outside_its_rows_and_formats(rows_on):
    lin = _linear("q4_0", 64, 128)
    ws = ctypes_ws(lin)
    rows_on.moeq_set_linear_amx_rows(4)
    assert [rows_on.moeq_linear_amx_takes(ws, m) for m in (1, 3, 4, 16, 17)] == [0, 0, 1, 1, 0]
    rows_on.moeq_set_linear_amx_rows(0)
    assert rows_on.moeq_linear_amx_takes(ws, 8) == 0
    rows_on.moeq_set_linear_amx_rows(4)
    for name in DECLINED:
        lin = _linear(name, 64, 256)
        assert rows_on.moeq_linear_amx_takes(ctypes_ws(lin), 8) == 0, name
        x = torch.randn(8, 256).to(torch.bfloat16)  # the gemv still serves them
        ref = x.double() @ lin.qweight.dequantize(torch.float64).T
        assert ((_native(lin, x).double() - ref).norm() / ref.norm()).item() < 0.01, name


def test_batched_greedy_decode_on_the_tiles(tiny_ckpt, rows_on):
    """A tiny model's native batched decode (8 sequences: its attention linears on the tiles) gives the tokens it gives
    with the tile path off."""
    import moeq
    from moeq.nn import engine

    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="q4_0", progress=False)
    assert engine.engine_of(m) is not None
    attn = m.model.layers[0].self_attn.q_proj
    assert rows_on.moeq_linear_amx_takes(ctypes_ws(attn), 8) == 1
    ids = torch.randint(3, 100, (8, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, max_new_tokens=10)
    rows_on.moeq_set_linear_amx_rows(4)
    tiles = m.generate(ids, **kw)
    rows_on.moeq_set_linear_amx_rows(0)
    gemv = m.generate(ids, **kw)
    assert torch.equal(tiles, gemv)
