"""The fp8 format (e4m3 codes, one fp32 scale per tile): transformers' own quantizer and dequantizer as the
reference, the native dequantization and GEMV against plain torch, tile-straddling slices and joins."""
import pytest
import torch

from moeq import kernels, native
from moeq.config import METHODS, FP8, FormatConfig
from moeq.errors import MoeqError
from moeq.formats import WEIGHT_TYPES, Fp8Weight, fp8

SHAPES = [((300, 520), (128, 128)), ((64, 256), (48, 80)), ((96, 130), (96, 130)), ((80, 192), (32, 64)),
          ((3, 40, 72), (16, 32))]


@pytest.mark.parametrize("shape,block", SHAPES)
def test_quantize_is_transformers_arithmetic(shape, block):
    """Per tile s = 448 / amax, codes e4m3(w * s), stored 1 / s (transformers' Fp8Quantize; the tiny fixtures' writer
    uses this quantizer and tests/models/test_fp8.py checks it against Fp8Quantize itself), recomputed here in plain
    torch over the padded tiles."""
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=torch.bfloat16) * 0.05
    q = fp8.quantize(w, block)
    n, k = shape[-2:]
    for i in range(0, n, block[0]):
        for j in range(0, k, block[1]):
            tile = w[..., i:i + block[0], j:j + block[1]].float()
            s = 448.0 / tile.abs().amax(dim=(-2, -1), keepdim=True)
            codes = (tile * s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(q.qdata[..., i:i + block[0], j:j + block[1]], codes)
            assert torch.equal(q.scale[..., i // block[0], j // block[1]], (1.0 / s).reshape(s.shape[:-2]))
    assert q.bits_per_weight == 8 + 32 * q.scale.numel() / q.numel
    err = (q.dequantize(torch.float32) - w.float()).norm() / w.float().norm()
    assert err < 0.04  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("shape,block", SHAPES)
def test_native_dequantize_equals_reference(shape, block):
    torch.manual_seed(1)
    q = fp8.quantize(torch.randn(shape), block)
    for dt in (torch.float32, torch.bfloat16):
        assert torch.equal(q.dequantize(dt), q.dequantize_reference(dt))


@pytest.mark.skipif(native.lib() is None, reason="no C compiler: the native library is not built")
@pytest.mark.parametrize("shape,block", SHAPES[:4])
@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_gemv_equals_reference(shape, block, m, xdtype):
    """fp32 activations: the fp16-conversion kernel; bf16 ones: the AVX512-BF16 kernel where the build has it (bk and
    K multiples of 32), else the same fp32 kernel. Products are exact either way; sums in fp32."""
    torch.manual_seed(2)
    q = fp8.quantize(torch.randn(shape), block)
    x = torch.randn(m, shape[1]).to(xdtype)
    out = torch.empty(m, shape[0], dtype=torch.float32)
    args = (native.ptr(q.qdata), native.ptr(q.scale), shape[0], shape[1], block[0], block[1], native.ptr(out))
    ref = x.float() @ q.dequantize_reference(torch.float32).t()
    if xdtype == torch.float32:
        native.lib().moeq_fp8_gemv(native.ptr(x), m, *args)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    else:  # taken exactly inside its domain (then exact products), declined outside it (fp32 kernel)
        domain = native.has_dpbf16() and shape[1] % 32 == 0 and block[1] % 32 == 0
        assert bool(native.lib().moeq_fp8_gemv_bf16(native.ptr(x), m, *args)) == domain
        if domain:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    y = kernels.cpu_ops.fp8_gemv(q, x, None, max_rows=16)  # past the rows a small weight takes by default
    assert y is not None and y.dtype == xdtype
    torch.testing.assert_close(y.float(), ref, rtol=1e-2 if xdtype == torch.bfloat16 else 1e-5, atol=1e-4)
    bias = torch.randn(shape[0]).to(xdtype)
    torch.testing.assert_close(kernels.linear(q, x, bias).float(), (ref + bias.float()).to(xdtype).float(),
                               rtol=1e-2 if xdtype == torch.bfloat16 else 1e-5,
                               atol=0.5 if xdtype == torch.bfloat16 else 1e-4)  # bf16: y and y + bias each rounded


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_every_e4m3_code_through_the_gemv(xdtype):
    """Every finite code (subnormals, both signs, 448) against torch's own e4m3 decoding, through both kernels."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].repeat(2)[:256].reshape(2, 128)  # every finite code, both rows
    w = Fp8Weight(qdata=codes.contiguous(), scale=torch.tensor([[0.5]]), block=(2, 128), shape=(2, 128))
    x = torch.randn(1, 128).to(xdtype)
    ref = x.float() @ (codes.view(torch.float8_e4m3fn).float() * 0.5).t()
    out = torch.empty(1, 2)
    args = (native.ptr(w.qdata), native.ptr(w.scale), 2, 128, 2, 128, native.ptr(out))
    if xdtype == torch.bfloat16 and native.lib().moeq_fp8_gemv_bf16(native.ptr(x), 1, *args):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    xf = x.float().contiguous()
    native.lib().moeq_fp8_gemv(native.ptr(xf), 1, *args)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_slices_and_joins_off_tile_boundaries():
    torch.manual_seed(3)
    gate, up = fp8.quantize(torch.randn(40, 64), (16, 32)), fp8.quantize(torch.randn(40, 64), (16, 32))
    joined = Fp8Weight.join([[gate, up], [up, gate]])  # 40 rows: the second piece starts inside a tile
    assert joined.shape == (2, 80, 64) and joined.block == (1, 32)
    ref = torch.cat([gate.dequantize(torch.float32), up.dequantize(torch.float32)])
    assert torch.equal(joined[0].dequantize(torch.float32), ref)
    assert torch.equal(joined[0].row_slice(40, 80).dequantize(torch.float32), ref[40:])
    aligned = Fp8Weight.join([[fp8.quantize(torch.randn(32, 64), (16, 32))] * 2])
    assert aligned.block == (16, 32) and aligned.scale.shape == (1, 4, 2)
    inner = gate.row_slice(5, 37)
    assert torch.equal(inner.dequantize(torch.float32), gate.dequantize(torch.float32)[5:37])


def test_saved_metadata_round_trip_and_hostile_parts():
    q = fp8.quantize(torch.randn(48, 64), (16, 32))
    back = WEIGHT_TYPES["fp8"].from_untrusted(q.tensors(), q.meta(), "t")
    assert torch.equal(back.dequantize(torch.float32), q.dequantize(torch.float32))
    nan = q.qdata.clone()
    nan[3, 5] = 0x7F
    with pytest.raises(MoeqError, match="NaN"):
        WEIGHT_TYPES["fp8"].from_untrusted({**q.tensors(), "qdata": nan}, q.meta(), "t")
    with pytest.raises(MoeqError, match="scale"):
        WEIGHT_TYPES["fp8"].from_untrusted({**q.tensors(), "scale": q.scale[:1]}, q.meta(), "t")
    with pytest.raises(MoeqError, match="block"):
        WEIGHT_TYPES["fp8"].from_untrusted(q.tensors(), {**q.meta(), "block": [0, 32]}, "t")
    with pytest.raises(MoeqError, match="scale"):
        WEIGHT_TYPES["fp8"].from_untrusted({**q.tensors(), "scale": q.scale * float("inf")}, q.meta(), "t")


def test_config_round_trip():
    assert isinstance(METHODS["fp8"], FP8) and METHODS["fp8"].block == (128, 128)
    cfg = FormatConfig.from_dict(FP8((64, 32)).to_dict())
    assert cfg == FP8((64, 32))
    with pytest.raises(MoeqError, match="block"):
        FP8((0, 3))


@pytest.mark.skipif(native.lib() is None, reason="no C compiler: the native library is not built")
def test_experts_take_the_fused_native_decode():
    """fp8 expert stacks are described for the one-call MoE kernels (moe.c's FP8 row): decode runs every routed
    expert in one native call, equal to dequantize + matmul per expert."""
    from moeq.kernels.plans import experts_route
    from moeq.nn import QuantExperts
    from moeq.nn.experts import Activation
    torch.manual_seed(4)
    e, i, h = 4, 48, 64  # 48 rows: gate/up tiles of 32 straddle the seam
    w13 = fp8.quantize(torch.randn(e, 2 * i, h) * 0.05, (32, 32))
    w2 = fp8.quantize(torch.randn(e, h, i) * 0.05, (32, 32))
    m = QuantExperts(w13, w2, Activation())
    assert experts_route(m, torch.float32).decode
    x = torch.randn(3, h)
    idx = torch.tensor([[0, 2], [1, 3], [2, 2]])
    wts = torch.rand(3, 2)
    y = m(x, idx, wts)
    ref = torch.zeros(3, h)
    for t in range(3):
        for j in range(2):
            a = w13[int(idx[t, j])].dequantize(torch.float32) @ x[t]
            g = torch.nn.functional.silu(a[:i]) * a[i:]
            ref[t] += wts[t, j] * (w2[int(idx[t, j])].dequantize(torch.float32) @ g)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
