"""The il16 decode layout of 4-bit expert stacks (moeq/native/csrc/il16_rows.h, moeq.nn.packed.set_il16): the layout
functions, the native kernels reading it against a float64 reference and against the row-major kernels, and that
everything outside those kernels (state_dict, get_packed, load_state_dict, int8 activations, other dtypes) sees the
row-major layout."""
from __future__ import annotations

import pytest
import torch

import moeq
from moeq import native
from moeq.formats import rtn
from moeq.kernels import plans
from moeq.formats.packing import from_il16, to_il16
from moeq.nn import QuantExperts
from moeq.nn.experts import Activation
from tests.kernels.reference import emulate_i16

pytestmark = pytest.mark.skipif(not native.has_simd(), reason="the il16 kernels need AVX512-BF16 or AVX2")
AVX2 = not native.has_dpbf16()  # the AVX2 build (tests/test_isa.py runs this file against it): groups of 32k only

E, H, I = 6, 128, 64  # w13 [6, 128, 128], w2 [6, 128, 64]
FORMATS = {
    "q4_0": dict(bits=4, group_size=32, grid="signed"),
    "rtn-int4-g128": dict(bits=4, group_size=128, grid="vllm"),
    "iq4nl-g16": dict(bits=4, group_size=16, grid="iq4nl"),
    "iq4nl-dq": dict(bits=4, group_size=32, grid="iq4nl", double_quant=True),
    "mxfp4": dict(bits=4, group_size=32, grid="mxfp4"),  # E8M0 scale bytes
}


def _experts(fmt: str, seed: int = 0) -> QuantExperts:
    g = torch.Generator().manual_seed(seed)
    kw = dict(FORMATS[fmt])
    gs = min(kw["group_size"], I)
    kw["group_size"] = gs
    w13 = rtn.quantize((torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16(), **kw)
    w2 = rtn.quantize((torch.randn(E, H, I, generator=g) * 0.05).bfloat16(), **kw)
    return QuantExperts(w13, w2, Activation())


def _reference(m: QuantExperts, x, idx, wts) -> torch.Tensor:
    """float64 over the row-major weights dequantized (bf16-rounded, as the kernels read them)."""
    w13, w2 = m.w13.dequantize(torch.bfloat16).double(), m.w2.dequantize(torch.bfloat16).double()
    xd = x.double()
    out = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        for a in range(idx.shape[1]):
            e = int(idx[t, a])
            h = w13[e] @ xd[t]
            act = torch.nn.functional.silu(h[:I]) * h[I:]
            out[t] += float(wts[t, a]) * (w2[e] @ act.bfloat16().double())
    return out


def _route(t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(t)])
    return x, idx, torch.rand(t, 2, generator=g).bfloat16()


def test_layout_functions_invert_and_place_units_as_documented():
    codes = torch.randint(0, 256, (3, 32, 40), dtype=torch.uint8)
    scales = torch.randn(3, 32, 5)
    il = to_il16(codes, 2)
    assert il.shape == codes.shape and torch.equal(from_il16(il, 2), codes)
    assert torch.equal(from_il16(to_il16(scales, 1), 1), scales)
    flat = il.reshape(3, 2, 20, 16, 2)  # [E][N/16][K/4][16][2]
    for e, b, c, r in ((0, 0, 0, 0), (1, 1, 7, 13), (2, 1, 19, 15)):
        assert torch.equal(flat[e, b, c, r], codes[e, 16 * b + r, 2 * c:2 * c + 2])
    s = to_il16(scales, 1).reshape(3, 2, 5, 16)
    assert s[2, 1, 3, 9] == scales[2, 25, 3]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_il16_kernels_match_float64_and_the_row_major_kernels(fmt, tokens):
    """Decode (one row per expert, several rows per expert) and prefill (the grouped GEMM unpacking il16 blocks)."""
    m = _experts(fmt)
    if AVX2 and FORMATS[fmt]["group_size"] % 32:
        assert not m.il16("w13")  # outside the AVX2 kernels' domain
        return
    assert m.il16("w13") and m.il16("w2")
    x, idx, wts = _route(tokens, tokens)
    got = m(x, idx, wts).double()
    ref = _reference(m, x, idx, wts)
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= 0.02 * scale  # bf16 output and intermediate rounding
    m.decode_layout = "rows"
    assert not m.il16("w13")
    rows = m(x, idx, wts).double()
    assert (got - rows).abs().max() <= 8e-3 * scale  # the same weights, fp32 sums in another order
    # many rows per expert, beyond the row-major gemv's limit on this CPU: the same dequantized tiles and products
    if tokens == 40 and FORMATS[fmt]["grid"] != "vllm" and 40 * 2 // E > plans.rows_limit(m.w13):
        assert (got - rows).abs().max() <= 4e-3 * scale


def test_outside_the_kernels_the_weights_are_row_major(tmp_path):
    m = _experts("iq4nl-dq")
    rows = _experts("iq4nl-dq")
    rows.decode_layout = "rows"
    assert m.il16("w13") and not rows.il16("w13")
    raw = m.packed("w13", raw=True)
    assert not torch.equal(raw.qdata, rows.w13.qdata)  # held permuted ...
    assert torch.equal(m.w13.qdata, rows.w13.qdata) and torch.equal(m.w13.scale, rows.w13.scale)  # ... seen in order
    sd, sd_rows = m.state_dict(), rows.state_dict()
    assert sd.keys() == sd_rows.keys() and all(torch.equal(sd[k], sd_rows[k]) for k in sd)
    # loading a row-major state dict into an il16 module keeps it il16 and computes the same
    other = _experts("iq4nl-dq", seed=1)
    assert other.il16("w13")
    other.load_state_dict(sd_rows)
    assert other.il16("w13") and torch.equal(other.packed("w13", raw=True).qdata, raw.qdata)
    x, idx, wts = _route(2, 5)
    assert torch.equal(other(x, idx, wts), m(x, idx, wts))


def test_int8_activations_and_other_dtypes_take_row_major():
    m = _experts("q4_0")
    x, idx, wts = _route(1, 7)
    base = m(x, idx, wts)
    m.activations = "int8"
    assert not m.il16("w13")
    m.activations = "default"
    assert m.il16("w13") and torch.equal(m(x, idx, wts), base)
    m.float()  # fp32 activations: no il16 kernels for them; the module computes from the row-major weights
    y = m(x.float(), idx, wts.float())
    ref = _reference(m, x, idx, wts)
    assert (y.double() - ref).abs().max() <= 0.02 * ref.abs().max()


def test_nan_activations_give_nan_rows():
    m = _experts("q4_0")
    x, idx, wts = _route(3, 9)
    x[1, 5] = float("nan")
    y = m(x, idx, wts)
    assert y[1].isnan().all() and not y[0].isnan().any() and not y[2].isnan().any()


def test_stacks_outside_the_domain_stay_row_major():
    g = torch.Generator().manual_seed(0)
    w13 = rtn.quantize((torch.randn(4, 192, 128, generator=g) * 0.05).bfloat16(), bits=4, group_size=32, grid="signed")
    w2 = rtn.quantize((torch.randn(4, 128, 96, generator=g) * 0.05).bfloat16(), bits=4, group_size=32, grid="signed")
    assert not QuantExperts(w13, w2, Activation()).il16("w13")  # K = 96: not a multiple of 64
    w2a = rtn.quantize((torch.randn(4, 128, 64, generator=g) * 0.05).bfloat16(), bits=4, group_size=32, symmetric=False)
    w13a = rtn.quantize((torch.randn(4, 128, 128, generator=g) * 0.05).bfloat16(), bits=4, group_size=32,
                        symmetric=False)
    assert not QuantExperts(w13a, w2a, Activation()).il16("w13")  # zero points


def test_a_loaded_model_decodes_the_same_tokens_in_both_layouts(tiny_ckpt):
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="q4_0", progress=False)
    experts = [x for x in m.modules() if isinstance(x, QuantExperts)]
    assert experts and all(x.il16("w13") for x in experts)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=10)
    fast = m.generate(ids, **kw)
    for x in experts:
        x.decode_layout = "rows"
    assert torch.equal(fast, m.generate(ids, **kw))


@pytest.mark.parametrize("fmt", ["q4_0", "rtn-int4-g128", "iq4nl-dq"])
def test_a_quantized_linear_in_il16(fmt):
    """Decode rows (the one-call linear) and a prompt (dequantized natively from il16, then one matmul) against the
    row-major module; its state_dict stays row-major."""
    from moeq.nn import QuantLinear  # noqa: PLC0415

    kw = dict(FORMATS[fmt])
    g = torch.Generator().manual_seed(4)
    w = rtn.quantize((torch.randn(96, 256, generator=g) * 0.05).bfloat16(), **kw)
    bias = (torch.randn(96, generator=g) * 0.1).bfloat16()
    m, rows = QuantLinear(w, bias), QuantLinear(w, bias)
    rows.decode_layout = "rows"
    assert m.il16("weight") and not rows.il16("weight")
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), rows.state_dict().values()))
    ref_w = w.dequantize(torch.bfloat16).double()
    for t in (1, 3, 40):
        x = torch.randn(t, 256, generator=g).bfloat16()
        y, y_rows = m(x).double(), rows(x).double()
        ref = x.double() @ ref_w.t() + bias.double()
        assert (y - ref).abs().max() <= 0.01 * ref.abs().max()
        assert (y - y_rows).abs().max() <= 4e-3 * ref.abs().max()
        if t == 40:  # the same dequantized weight and matmul
            assert torch.equal(y, y_rows)


@pytest.mark.skipif(AVX2, reason="the AVX512 build's several-rows form (AVX2 builds always take int16 activations)")
@pytest.mark.parametrize("fmt", ["q4_0", "rtn-int4-g128", "mxfp4"])  # grids with an exact zero
@pytest.mark.parametrize("i16", [True, False])
def test_several_rows_take_int16_activations_where_set(fmt, i16):
    """With the int16 rows on (CPUs with AMX: moeq.native sets it at load) an il16 linear computes 2-3 rows with the
    activations as int16 per 32 columns and exact integer sums (vpdpwssd), one row with the exact bf16 activations;
    off (elsewhere) every row count is exact bf16 (batch-invariant). Made visible: one chunk holds a large activation
    against a zero weight column and small ones beside it, which int16 rounds to steps of 1/64."""
    L = native.lib()
    L.moeq_set_il16_i16(int(i16))
    try:
        _several_rows(fmt, i16)
    finally:
        L.moeq_set_il16_i16(int(native.has_amx()))


def _several_rows(fmt: str, i16: bool) -> None:
    from moeq.nn import QuantLinear  # noqa: PLC0415

    g = torch.Generator().manual_seed(5)
    wf = torch.randn(64, 256, generator=g) * 0.05
    wf[:, 0] = 0
    w = rtn.quantize(wf.bfloat16(), **FORMATS[fmt])
    m = QuantLinear(w)
    assert m.il16("weight")
    wd = w.dequantize(torch.float32)
    assert bool((wd[:, 0] == 0).all())
    for rows in (1, 2, 3):
        x = torch.zeros(rows, 256)
        x[:, 0] = 300.0
        x[:, 1:32] = torch.randn(rows, 31, generator=g) * 0.02
        x = x.bfloat16()
        y = m(x).float()
        exact = (x.double() @ wd.double().T).float()
        i16_want = emulate_i16(wd, x).float()
        assert (exact - i16_want).abs().max() > 0.02 * exact.abs().max()  # the two numerics differ visibly here
        want = i16_want if rows > 1 and i16 else exact
        assert ((y - want).abs() <= want.abs() * 2 ** -7 + 1e-4 * want.abs().max()).all(), (rows, (y - want).abs().max())
