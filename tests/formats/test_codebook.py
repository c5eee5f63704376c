"""4-bit codebook grids (``iq4nl``: llama.cpp's IQ4_NL values) and the importance-weighted scale search
(``moeq_cb4_search``) on the ``iq4nl`` and ``signed`` grids: parity with gguf's own IQ4_NL/Q4_0 decoders, the native
search against its plain-torch twin, what the search promises (exact fp16/bf16 scales, lower weighted error than
llama.cpp's plain Q4_0 rounding, nearest codes), and bad input."""
import numpy as np
import pytest
import torch

from moeq.config import RTN
from moeq.errors import MoeqError
from moeq.formats import rtn
from moeq.formats.codebooks import IQ4NL
from moeq.formats.search import codebook_search

gguf = pytest.importorskip("gguf")


def _weights(rows=64, k=512, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g) * 0.02
    w[:, ::37] *= 8  # outliers, as trained weights have
    return w.to(dtype)


def _werr(w, q, weighting="x2"):
    x = w.float()
    wt = {"x2": x * x, "mse": torch.ones_like(x), "row": (x * x).mean(-1, keepdim=True) + x * x}[weighting]
    return float((wt * (q.dequantize(torch.float32) - x) ** 2).sum())


@pytest.mark.parametrize("grid,qtype,bits", [("iq4nl", "IQ4_NL", 4), ("signed", "Q4_0", 4), ("signed", "Q5_0", 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gguf_decodes_the_blocks_to_moeq_values(grid, qtype, bits, dtype):
    from moeq.export.gguf import ggml_blocks, ggml_type
    from moeq.readers.gguf import _rtn_from_blocks

    w = _weights(dtype=dtype)
    q = rtn.quantize(w, bits, 32, True, grid, search=5)
    back = _rtn_from_blocks(ggml_blocks(q).numpy(), bits, tuple(w.shape), "w", grid)
    assert torch.equal(back.qdata, q.qdata) and torch.equal(back.scale.float(), q.scale.float())
    assert ggml_type(q) == qtype
    theirs = gguf.quants.dequantize(ggml_blocks(q).numpy(), gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(theirs.reshape(w.shape), q.dequantize(torch.float32).numpy())
    assert torch.equal(q.dequantize(torch.float32), q.dequantize_reference(torch.float32))  # native == torch
    assert torch.equal(q.dequantize(torch.bfloat16), q.dequantize_reference(torch.bfloat16))


@pytest.mark.parametrize("grid,bits", [("iq4nl", 4), ("signed", 4), ("signed", 5), ("nl3", 3), ("nl2", 2)])
@pytest.mark.parametrize("weighting", ["x2", "row", "mse"])
def test_native_search_matches_torch_twin(grid, bits, weighting):
    w = _weights(rows=48, k=256, seed=1)
    a = rtn.quantize(w, bits, 32, True, grid, search=7, weighting=weighting)
    b = rtn.quantize(w, bits, 32, True, grid, search=7, weighting=weighting, native=False)
    vals = torch.tensor(rtn.grid_values(grid, bits), dtype=torch.float32)
    codes, scale = codebook_search(w.float(), 32, vals, 7, rtn.WEIGHTINGS[weighting])
    assert torch.equal(b.scale, scale) and torch.equal(b.codes(), codes)  # the fallback is the twin itself
    # a symmetric table (nl2) fits a group equally well with either sign of its scale: that tie may break either way
    mag = (lambda t: t.abs()) if grid == "nl2" else (lambda t: t)
    same = (mag(a.scale) == mag(b.scale)).float().mean()
    # sums in another order may tip a near-tie candidate (32 levels: more candidates land on equal errors)
    assert same > (0.85 if bits == 5 else 0.99)
    ea, eb = _werr(w, a, weighting), _werr(w, b, weighting)
    assert abs(ea - eb) <= 1e-3 * eb


@pytest.mark.parametrize("grid", ["iq4nl", "signed"])
def test_search_scales_codes_and_error(grid):
    w = _weights(seed=2)
    q = rtn.quantize(w, 4, 32, True, grid, search=7)
    s = q.scale
    assert s.dtype == torch.bfloat16 and torch.equal(s.to(torch.float16).to(torch.bfloat16), s)  # exact in both
    # every code is the nearest table value to x / scale, or (winning candidate kept) at most one step away
    vals = torch.tensor(rtn.grid_values(grid), dtype=torch.float32)
    y = w.float().view(64, -1, 32) / s.float().unsqueeze(-1)
    nearest = (y.unsqueeze(-1) - vals).abs().argmin(-1)
    assert ((q.codes().view(64, -1, 32).long() - nearest).abs() <= 1).all()
    assert (q.codes().view(64, -1, 32).long() == nearest).float().mean() > 0.95
    plain = rtn.quantize(w, 4, 32, True, "signed")  # llama.cpp's Q4_0 rounding
    assert _werr(w, q) < (0.9 if grid == "iq4nl" else 0.99) * _werr(w, plain)
    more = rtn.quantize(w, 4, 32, True, grid, search=15)
    assert _werr(w, more) <= _werr(w, q) * 1.001  # more candidates: never worse (beyond rounding of sums)


def test_iq4nl_beats_q4_0_and_importance_steers_the_error():
    w = _weights(seed=3)
    iq = rtn.quantize(w, 4, 32, True, "iq4nl", search=7, weighting="mse")
    q40 = rtn.quantize(w, 4, 32, True, "signed", search=7, weighting="mse")
    assert _werr(w, iq, "mse") < _werr(w, q40, "mse")  # the non-linear grid fits Gaussian-like weights better
    imp = torch.ones(512)
    imp[:32] = 1000.0  # the first block of every row matters most
    a = rtn.quantize(w, 4, 32, True, "iq4nl", search=7, weighting="mse")
    b = rtn.quantize(w, 4, 32, True, "iq4nl", search=7, weighting="mse", importance=imp)
    err = lambda q: float(((q.dequantize(torch.float32) - w.float())[:, :32] ** 2).sum())  # noqa: E731
    assert err(b) <= err(a)
    assert torch.equal(a.scale[:, 1:], b.scale[:, 1:])  # other blocks: weights scale uniformly, same choice


def test_zero_and_non_finite_groups():
    w = _weights(rows=4, k=64)
    w[1, :32] = 0
    q = rtn.quantize(w, 4, 32, True, "iq4nl")
    assert q.scale[1, 0] == 0 and torch.equal(q.dequantize()[1, :32], torch.zeros(32, dtype=torch.bfloat16))
    assert (q.codes()[1, :32] == IQ4NL.index(1)).all()  # the value nearest zero
    w[2, 5] = float("nan")
    with pytest.raises(MoeqError, match="experts.0.w1"):
        rtn.quantize(w, 4, 32, True, "iq4nl", name="experts.0.w1")
    with pytest.raises(MoeqError, match="importance"):
        rtn.quantize(_weights(rows=4, k=64), 4, 32, True, "iq4nl", importance=torch.ones(63))


def test_configs_and_stored_weights_refuse_nonsense():
    for bad in (dict(bits=8), dict(symmetric=False), dict(refine=2)):
        with pytest.raises(MoeqError, match="codebook"):
            RTN(**{"bits": 4, "group_size": 32, "grid": "iq4nl", **bad})
    with pytest.raises(MoeqError, match="weighting"):
        RTN(4, 32, grid="signed", search=7, weighting="l1")
    q = rtn.quantize(_weights(rows=4, k=64), 4, 32, True, "iq4nl")
    import dataclasses

    with pytest.raises(MoeqError, match="4-bit codebook"):
        dataclasses.replace(q, bits=8, qdata=torch.zeros(4, 64, dtype=torch.uint8)).validate("x")
    huge = dataclasses.replace(q, scale=torch.full_like(q.scale, 3e36))  # 127 * 3e36 overflows bf16
    assert huge.problems()


@pytest.mark.parametrize("qtype,grid,bits", [("IQ4_NL", "iq4nl", 4), ("Q4_0", "signed", 4), ("Q5_0", "signed", 5)])
def test_against_llama_cpp_own_quantizer(qtype, grid, bits):
    """llama.cpp's own quantizer (the code llama-quantize runs, without an importance matrix) on the same weights:
    its blocks decode (gguf-py) to a larger error than moeq's search under the same criterion (llama.cpp's x^2, or
    plain MSE), and its plain Q4_0 rounding is moeq's q4_0 bit for bit."""
    pytest.importorskip("xllamacpp")
    from tests.llama_cpp import quantize as llama_quantize

    w = _weights(rows=128, k=1024, seed=4, dtype=torch.float32)
    x = w.numpy()
    theirs = gguf.quants.dequantize(llama_quantize(x, qtype), gguf.GGMLQuantizationType[qtype]).reshape(x.shape)
    for weighting, wt in (("x2", x * x), ("mse", np.ones_like(x))):  # llama.cpp's own criterion, and plain MSE
        mine = rtn.quantize(w, bits, 32, True, grid, search=7, weighting=weighting).dequantize(torch.float32).numpy()
        assert (wt * (mine - x) ** 2).sum() < (wt * (theirs - x) ** 2).sum()
    if grid == "signed":
        from moeq.export.gguf import ggml_blocks

        plain = rtn.quantize(w.half().float(), bits, 32, True, "signed")  # fp16-exact inputs keep scales fp16-exact
        assert np.array_equal(ggml_blocks(plain).numpy().reshape(128, -1), llama_quantize(w.half().float().numpy(), qtype))


def test_five_bit_planes():
    from moeq.formats import packing

    c = torch.randint(0, 32, (3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    p = packing.pack(c, 5)
    assert p.shape == (3, 5, 40) and torch.equal(packing.unpack(p, 5), c)
    assert torch.equal(p[..., :32], packing.pack(c & 15, 4))  # the nibble plane is the 4-bit layout
    assert p[0, 0, 32] == sum(((int(c[0, 0, i]) >> 4) & 1) << i for i in range(8))  # fifth bits, LSB first


def test_groups_wider_than_the_kernel_buffers():
    """One group per row (group_size -1) wider than the native kernel's 4096-value buffers takes the torch twin."""
    w = _weights(rows=2, k=8192, seed=5)
    q = rtn.quantize(w, 4, -1, True, "iq4nl", search=3)
    vals = torch.tensor(rtn.grid_values("iq4nl"), dtype=torch.float32)
    codes, scale = codebook_search(w.float(), 8192, vals, 3, rtn.WEIGHTINGS["x2"])
    assert torch.equal(q.codes(), codes) and torch.equal(q.scale, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_double_quantized_scales(dtype):
    """iq4nl-dq: int8 codes of one bf16 factor per row, 4.25 + 16/K bits; the native re-rounding of the codes equals
    its torch twin bit for bit, native and reference dequantization agree, and the error stays within 1% of the
    bf16-scale weight's (what 8 instead of 16 bits per group cost), far below group 64's."""
    import dataclasses

    w = _weights(rows=64, k=576).to(dtype)
    full = rtn.quantize(w, 4, 32, True, "iq4nl", search=7, weighting="row")
    dq = rtn.quantize(w, 4, 32, True, "iq4nl", search=7, weighting="row", double_quant=True)
    assert dq.scale.dtype == torch.int8 and dq.scale_super.dtype == torch.bfloat16 and dq.scale_super.shape == (64,)
    assert dq.bits_per_weight == pytest.approx(4 + 8 / 32 + 16 / 576)
    assert int(dq.scale.abs().max()) == 127  # each row's largest group scale is its factor's full code
    twin = rtn._double_quant(full, w, native_ok=False)
    assert torch.equal(twin.qdata, dq.qdata) and torch.equal(twin.scale, dq.scale)
    assert torch.equal(dq.dequantize(torch.float32), dq.dequantize_reference(torch.float32))

    def err(q):
        return float(((q.dequantize(torch.float32) - w.float()) ** 2).mean())

    g64 = rtn.quantize(w, 4, 64, True, "iq4nl", search=7, weighting="row")
    assert err(dq) <= 1.01 * err(full) < err(g64)
    w[3] = 0  # an all-zero row: factor 0, codes 0, the value nearest zero
    z = rtn.quantize(w, 4, 32, True, "iq4nl", double_quant=True)
    assert z.scale_super[3] == 0 and (z.scale[3] == 0).all() and (z.dequantize()[3] == 0).all()
    for bad in (dataclasses.replace(dq, scale_super=-dq.scale_super),
                dataclasses.replace(dq, scale_super=torch.full_like(dq.scale_super, float("nan"))),
                dataclasses.replace(dq, scale_super=dq.scale_super[:10]),
                dataclasses.replace(dq, scale_super=None),  # int8 codes without their factor
                dataclasses.replace(dq, scale=dq.scale.to(torch.bfloat16)),  # a factor for bf16 scales
                dataclasses.replace(dq, grid="signed")):
        assert bad.problems()
    with pytest.raises(MoeqError, match="double_quant"):
        RTN(4, 32, grid="signed", double_quant=True)
    with pytest.raises(MoeqError, match="double_quant"):
        rtn.quantize(w, 4, 32, True, "vllm", double_quant=True)


@pytest.mark.parametrize("grid,bits", [("iq4nl", 4), ("signed", 5), ("nl3", 3), ("nl2", 2)])
def test_requant_kernel_matches_nearest_value(grid, bits):
    """moeq_cb4_requant (the codes for given double-quantized scales) picks the nearest table value of w / scale,
    ties to the lower one, for 8-, 16- and 32-value tables, including a zero scale."""
    from moeq import native
    from moeq.formats.packing import packed_size, unpack

    L = native.lib()
    if L is None:
        pytest.skip("no native library")
    rows, k, gs = 8, 256, 32
    w = _weights(rows=rows, k=k, dtype=torch.float32)
    values = torch.tensor(rtn.grid_values(grid, bits), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    sc = torch.randint(-127, 128, (rows, k // gs), generator=g, dtype=torch.int8)
    sc[0, 0] = 0
    sup = (w.abs().amax(-1) / values.abs().max() / 64).to(torch.bfloat16)
    q = torch.empty(rows, packed_size(k, bits), dtype=torch.uint8)
    padded = rtn.native_values(grid, bits)  # the kernels read 16 values
    L.moeq_cb4_requant(native.ptr(w), 0, rows, k, gs, native.ptr(padded), values.numel(), native.ptr(sc),
                       native.ptr(sup), native.ptr(q))
    scale = (sc.float() * sup.float().unsqueeze(-1)).repeat_interleave(gs, -1)
    v = w * torch.where(scale != 0, 1 / torch.where(scale != 0, scale, 1.0), 0.0)
    want = torch.bucketize(v, (values[1:] + values[:-1]) / 2)
    assert torch.equal(unpack(q, bits).long(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nl3_three_bit_codebook(dtype):
    """nl3: every other IQ4_NL value, 3-bit codes eight per 24-bit word; the native search, double quantization and
    dequantization equal their torch twins; at group 16 with double-quantized scales (3.5 + 16/K bits) its weighted
    error is far below 3-bit RTN's at group 32 (3.5 bits as well) and above iq4nl's; the config refuses other widths."""
    import dataclasses

    from moeq.formats.codebooks import NL3

    assert NL3 == (-127, -83, -49, -22, 1, 25, 53, 89) and set(NL3) <= set(IQ4NL)
    w = _weights(rows=64, k=512).to(dtype)
    q = rtn.quantize(w, 3, 16, True, "nl3", search=7, weighting="row", double_quant=True)
    assert q.qdata.shape == (64, 512 * 3 // 8) and q.bits_per_weight == pytest.approx(3.5 + 16 / 512)
    twin = rtn.quantize(w, 3, 16, True, "nl3", search=7, weighting="row", double_quant=True, native=False)
    assert (twin.codes() == q.codes()).float().mean() > 0.99  # sums in another order may tip a near tie
    full = rtn.quantize(w, 3, 16, True, "nl3", search=7, weighting="row")
    assert torch.equal(rtn._double_quant(full, w, native_ok=False).qdata, q.qdata)  # native requant == torch
    assert torch.equal(q.dequantize(torch.float32), q.dequantize_reference(torch.float32))
    assert torch.equal(q.dequantize(torch.bfloat16), q.dequantize_reference(torch.bfloat16))
    vals = torch.tensor(NL3, dtype=torch.float32)
    by_hand = vals[q.codes().long()].view(64, -1, 16) * q.group_scales().unsqueeze(-1)
    assert torch.equal(by_hand.flatten(-2), q.dequantize_reference(torch.float32))
    asym = rtn.quantize(w, 3, 32, False)  # 3 + 16/32 + 8/32 bits
    iq4 = rtn.quantize(w, 4, 32, True, "iq4nl", search=7, weighting="row")
    assert _werr(w, iq4, "row") < _werr(w, q, "row") < 0.8 * _werr(w, asym, "row")
    with pytest.raises(MoeqError, match="3-bit codebook"):
        RTN(4, 16, grid="nl3")
    with pytest.raises(MoeqError, match="3-bit codebook"):
        rtn.quantize(w, 4, 16, True, "nl3")
    with pytest.raises(MoeqError, match="4-bit codebook"):
        RTN(3, 16, grid="iq4nl")
    assert dataclasses.replace(q, bits=4).problems()  # stored 3-bit codes claimed as 4-bit
    nan = full.scale.clone()
    nan[5, 2] = float("nan")  # the search's mark of a group it could not fit (x^2 overflowed)
    for native_ok in (True, False):  # both forms carry it into the row factor, so validation refuses the weight
        d = rtn._double_quant(dataclasses.replace(full, scale=nan), w, native_ok=native_ok)
        assert d.scale_super[5].isnan() and not d.scale_super[:5].isnan().any() and d.problems()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nl2_two_bit_codebook(dtype):
    """nl2: four levels with a zero, 2-bit codes four per byte; the native search, double quantization and
    dequantization equal their torch twins; at group 16 with double-quantized scales (2.5 + 16/K bits) its weighted
    error is below 2-bit RTN's with zero points at group 32 (2.75 bits) and above nl3's."""
    from moeq.formats.codebooks import NL2
    from moeq.formats.packing import unpack

    assert NL2 == (-127, -42, 0, 60)
    w = _weights(rows=64, k=512).to(dtype)
    q = rtn.quantize(w, 2, 16, True, "nl2", search=7, weighting="x2", double_quant=True)
    assert q.qdata.shape == (64, 512 // 4) and q.bits_per_weight == pytest.approx(2.5 + 16 / 512)
    assert torch.equal(unpack(q.qdata, 2), q.codes()) and int(q.codes().max()) <= 3
    twin = rtn.quantize(w, 2, 16, True, "nl2", search=7, weighting="x2", double_quant=True, native=False)
    # the same values (fitted in another summation order; a tie between the scale's two signs may break either way)
    same = (twin.dequantize(torch.float32) == q.dequantize(torch.float32)).float().mean()
    assert same > 0.99  # sums in another order may tip a near tie
    full = rtn.quantize(w, 2, 16, True, "nl2", search=7, weighting="x2")
    assert torch.equal(rtn._double_quant(full, w, native_ok=False).qdata, q.qdata)  # native requant == torch
    assert torch.equal(q.dequantize(torch.float32), q.dequantize_reference(torch.float32))
    assert torch.equal(q.dequantize(torch.bfloat16), q.dequantize_reference(torch.bfloat16))
    vals = torch.tensor(NL2, dtype=torch.float32)
    by_hand = vals[q.codes().long()].view(64, -1, 16) * q.group_scales().unsqueeze(-1)
    assert torch.equal(by_hand.flatten(-2), q.dequantize_reference(torch.float32))
    asym = rtn.quantize(w, 2, 32, False)  # 2 + 16/32 + 8/32 bits
    nl3 = rtn.quantize(w, 3, 16, True, "nl3", search=7, weighting="x2", double_quant=True)
    assert _werr(w, nl3, "x2") < _werr(w, q, "x2") < 0.8 * _werr(w, asym, "x2")
    with pytest.raises(MoeqError, match="2-bit codebook"):
        RTN(3, 16, grid="nl2")
