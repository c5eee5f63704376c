"""RTN: vLLM-exact symmetric bytes (golden vectors), packing round trips, grids' SQNR, bad input."""
import pytest
import torch

from moeq.formats import packing, rtn


def test_golden_int4_hand_computed():
    # one group of 8 (group_size=-1), fp32: absmax 1.5 -> scale 1.5*2/15 = 0.2
    w = torch.tensor([[1.5, -1.5, 0.1, -0.1, 0.3, 0.5, -0.7, 0.0]])
    q = rtn.quantize(w, bits=4, group_size=-1)
    # x/scale = 7.5, -7.5, 0.5, -0.5, 1.5, 2.5, -3.5, 0 -> round-half-even 8,-8,0,-0,2,2,-4,0 -> +8, clamp 15
    codes = [15, 0, 8, 8, 10, 10, 4, 8]
    assert q.codes().tolist() == [codes]
    # packed: even index in the LOW nibble
    assert q.qdata.tolist() == [[15 | 0 << 4, 8 | 8 << 4, 10 | 10 << 4, 4 | 8 << 4]]
    assert torch.allclose(q.scale, torch.tensor([[0.2]]))
    expect = (torch.tensor(codes, dtype=torch.float32) - 8) * q.scale[0, 0]
    assert torch.equal(q.dequantize()[0], expect)
    assert q.dequantize()[0, 0].item() == pytest.approx(1.4, abs=1e-6)  # the +absmax clip: 7*0.2


def test_golden_int8_bf16_arithmetic():
    # bf16 in -> bf16 scale computed as bf16(bf16(absmax*2)/255), division in bf16
    w = torch.tensor([[0.5, -0.25, 0.125, 0.3]], dtype=torch.bfloat16)
    q = rtn.quantize(w, bits=8, group_size=-1)
    scale = (torch.tensor(0.5, dtype=torch.bfloat16) * 2.0) / 255
    assert q.scale.dtype == torch.bfloat16 and q.scale.item() == scale.item()
    expect = ((w / scale).round() + 128).clamp(0, 255).to(torch.uint8)
    assert torch.equal(q.qdata, expect)
    assert q.qdata.shape == (1, 4)


def _reference_vllm_symmetric(w, bits, gs):
    """Element-by-element statement of vLLM's rtn_quantize math, in the weight's dtype."""
    n, k = w.shape
    gs = k if gs == -1 else gs
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, k // gs, dtype=w.dtype)
    for r in range(n):
        for g in range(k // gs):
            x = w[r, g * gs:(g + 1) * gs]
            s = torch.max(x.min().abs(), x.max().abs()) * 2.0 / (2 ** bits - 1)
            scales[r, g] = s
            codes[r, g * gs:(g + 1) * gs] = ((x / s).round() + 2 ** (bits - 1)).clamp(0, 2 ** bits - 1).to(torch.uint8)
    if bits == 4:
        codes = codes[:, ::2] | (codes[:, 1::2] << 4)
    return codes, scales


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, -1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_symmetric_matches_vllm_math(bits, gs, dtype):
    torch.manual_seed(bits * 100 + gs)
    w = (torch.randn(6, 128) * 0.05).to(dtype)
    q = rtn.quantize(w, bits=bits, group_size=gs)
    codes, scales = _reference_vllm_symmetric(w, bits, gs)
    assert torch.equal(q.qdata, codes)
    assert torch.equal(q.scale, scales)
    assert q.qdata.shape == ((6, 64) if bits == 4 else (6, 128))


def test_stack_is_one_call_and_indexes_per_expert():
    w = torch.randn(3, 16, 64, dtype=torch.bfloat16)
    q = rtn.quantize(w, bits=4, group_size=32)
    assert q.qdata.shape == (3, 16, 32) and q.scale.shape == (3, 16, 2)
    for e in range(3):
        qe = rtn.quantize(w[e], bits=4, group_size=32)
        assert torch.equal(q[e].qdata, qe.qdata) and torch.equal(q[e].dequantize(), qe.dequantize())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_roundtrip(bits):
    torch.manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (3, 5, 64), dtype=torch.uint8)
    p = packing.pack(codes, bits)
    assert p.shape == (3, 5, packing.packed_size(64, bits))
    assert torch.equal(packing.unpack(p, bits), codes)


def test_pack_layout_2_and_3_bit():
    c = torch.tensor([[1, 2, 3, 0, 7, 6, 5, 4]], dtype=torch.uint8)
    assert packing.pack(c[:, :4], 2).tolist() == [[1 | 2 << 2 | 3 << 4 | 0 << 6]]
    word = sum(int(v) << (3 * i) for i, v in enumerate(c[0]))
    assert packing.pack(c, 3).tolist() == [[word & 255, word >> 8 & 255, word >> 16 & 255]]


def sqnr(w, w_hat):
    return (10 * torch.log10(w.float().pow(2).sum() / (w.float() - w_hat.float()).pow(2).sum())).item()


@pytest.mark.parametrize("dist", ["gauss", "student"])
def test_sqnr_floors_and_grid_ordering(dist):
    torch.manual_seed(0)
    w = torch.randn(128, 1024) if dist == "gauss" else torch.distributions.StudentT(3.0).sample((128, 1024))
    floors = {2: 2.0, 3: 9.0, 4: 15.0, 8: 38.0}
    for bits, floor in floors.items():
        for sym, grid in ((True, "vllm"), (True, "signed"), (False, "vllm")):
            s = sqnr(w, rtn.quantize(w, bits, 64, sym, grid).dequantize())
            assert s > floor, (bits, sym, grid, s)
    # the better grids beat vLLM's at 4 bits
    base = sqnr(w, rtn.quantize(w, 4, 64).dequantize())
    assert sqnr(w, rtn.quantize(w, 4, 64, grid="signed").dequantize()) > base
    assert sqnr(w, rtn.quantize(w, 4, 64, symmetric=False).dequantize()) > base


def test_asymmetric_dequant_formula():
    w = torch.tensor([[0.0, 0.1, 0.2, 1.5]])
    q = rtn.quantize(w, bits=4, group_size=-1, symmetric=False)
    assert q.zero is not None and q.zero.tolist() == [[0]]
    assert torch.allclose(q.dequantize(), w, atol=0.05)
    assert q.dequantize()[0, 3].item() == pytest.approx(1.5)


def test_bad_input():
    w = torch.randn(4, 64)
    w[1, 1] = float("inf")
    with pytest.raises(ValueError, match="blk.0.w1.*non-finite"):
        rtn.quantize(w, group_size=32, name="blk.0.w1")
    for sym, grid in ((True, "vllm"), (False, "vllm"), (True, "signed")):
        w2 = torch.randn(3, 8, 128, dtype=torch.bfloat16)
        w2[2, 5, 77] = float("nan")
        with pytest.raises(ValueError, match="experts.w13.*non-finite"):
            rtn.quantize(w2, 4, 64, sym, grid, name="experts.w13")
    with pytest.raises(ValueError, match="not divisible by group_size 128"):
        rtn.quantize(torch.randn(4, 192), group_size=128)
    with pytest.raises(ValueError, match=r"valid choices: \[2, 3, 4, 5, 8\]"):
        rtn.quantize(torch.randn(4, 64), bits=6)
    with pytest.raises(ValueError, match="valid choices"):
        rtn.quantize(torch.randn(4, 64), group_size=40)
    for sym, grid in ((True, "vllm"), (True, "signed"), (False, "vllm")):
        z = torch.zeros(4, 64, dtype=torch.bfloat16)
        z[0, :32] = 1.0
        out = rtn.quantize(z, 4, 32, sym, grid).dequantize()
        assert torch.isfinite(out).all() and torch.equal(out[1:], torch.zeros(3, 64, dtype=torch.bfloat16))


def test_bits_per_weight_and_state_roundtrip():
    w = torch.randn(2, 64, 256, dtype=torch.bfloat16)
    q = rtn.quantize(w, 4, 128)
    assert q.bits_per_weight == pytest.approx(4 + 16 / 128)
    back = rtn.RTNWeight.from_parts(q.tensors(), q.meta())
    assert torch.equal(back.dequantize(), q.dequantize())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 128, -1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_kernels_equal_torch(bits, gs, dtype):
    torch.manual_seed(7)
    w = (torch.randn(3, 40, 256) * torch.rand(3, 40, 1) * 0.1).to(dtype)
    w[0, 0, :128] = 0  # an all-zero group
    a, b = rtn.quantize(w, bits, gs, native=True), rtn.quantize(w, bits, gs, native=False)
    assert torch.equal(a.qdata, b.qdata) and torch.equal(a.scale, b.scale)
    for out in (torch.bfloat16, torch.float32):
        assert torch.equal(a.dequantize(out), a.dequantize_reference(out))
    asym = rtn.quantize(w, bits, gs, symmetric=False)
    asym_ref = rtn.quantize(w, bits, gs, symmetric=False, native=False)
    for n in ("qdata", "scale", "zero"):
        assert torch.equal(getattr(asym, n), getattr(asym_ref, n)), n
    assert torch.equal(asym.dequantize(torch.bfloat16), asym.dequantize_reference(torch.bfloat16))
    for sb in (bits, 5):  # the signed grid (llama.cpp's Q4_0/Q5_0/Q8_0 arithmetic), 5-bit planes included
        sg, sg_ref = rtn.quantize(w, sb, gs, grid="signed"), rtn.quantize(w, sb, gs, grid="signed", native=False)
        assert torch.equal(sg.qdata, sg_ref.qdata) and torch.equal(sg.scale, sg_ref.scale)
        assert torch.equal(sg.dequantize(torch.float32), sg.dequantize_reference(torch.float32))
