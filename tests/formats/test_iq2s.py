"""IQ2_S blocks (moeq.formats.iq2s): decoding equal to gguf-py's (llama.cpp's layout), the native dequantization and
gemv against the torch reference, the quantizer's choices optimal for the scales it stores, validation."""
import logging

import numpy as np
import pytest
import torch

from moeq import native
from moeq.config import IQ2S, METHODS
from moeq.errors import MoeqError
from moeq.formats import WEIGHT_TYPES, iq2s, rtn
from moeq.formats.iq2s import BLOCK_BYTES, GRID, QK, Iq2sWeight
from moeq.kernels.cpu_ops import iq2s_gemv

gguf = pytest.importorskip("gguf")
needs_native = pytest.mark.skipif(native.lib() is None, reason="no C compiler: the iq2s quantizer is native only")


def random_blocks(rows: int, k: int, seed: int) -> torch.Tensor:
    """Arbitrary IQ2_S bytes (every index, sign and scale pattern) with a finite, moderate fp16 d."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows, k // QK, BLOCK_BYTES), dtype=torch.uint8, generator=g)
    d = (torch.rand(rows, k // QK, generator=g) * 1e-3).to(torch.float16)
    b[..., 0:2] = d.view(torch.uint8).reshape(rows, k // QK, 2)
    return b.reshape(rows, -1)


def gguf_decode(blocks: torch.Tensor, shape) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.IQ2_S)).reshape(shape)


def test_grid_is_ggmls():
    gguf.quants.IQ2_S.init_grid()
    assert torch.equal(GRID.float(), torch.from_numpy(gguf.quants.IQ2_S.grid.reshape(1024, 8)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_equals_gguf_py_and_native(dtype):
    blocks = random_blocks(6, 512, 0)
    w = Iq2sWeight(blocks=blocks, shape=(6, 512), dtype=torch.bfloat16).validate()
    want = gguf_decode(blocks, (6, 512))
    assert torch.equal(w.dequantize_reference(torch.float32), want)
    assert torch.equal(w.dequantize_reference(dtype), want.to(dtype))
    if native.lib() is not None:
        got = w._dequantize_native(dtype, None)
        assert got is not None and torch.equal(got, want.to(dtype))
        if dtype == torch.bfloat16:  # the prompt GEMM's tiles (serial, vectorized where AVX512-BF16 is): same bits
            tile = torch.empty(6, 512, dtype=torch.bfloat16)
            native.lib().moeq_iq2s_rows_bf16(native.ptr(blocks), native.i64(6), native.i64(512), native.ptr(GRID),
                                             native.ptr(tile))
            assert torch.equal(tile.view(torch.int16), want.to(dtype).view(torch.int16))


@needs_native
def test_quantizer_points_are_the_best_at_one_block_scale_and_keep_the_blocks_energy():
    """Weights 0.25 sigma^2 + x^2 per 256 as llama.cpp's (no importance). Each block's points are the exact weighted
    argmin over all 1024 at its sub-block scales up to one common factor (the search's least-squares scale, before
    the energy step; found here by a scan), and its stored fp16 scale keeps the block's weighted energy (to fp16's
    rounding); the signs are the weights'."""
    torch.manual_seed(1)
    x = torch.randn(8, 512) * torch.rand(8, 1) * 0.05
    x[2, 7] = 0.4  # an outlier
    q = iq2s.quantize(x)
    y = q.dequantize_reference(torch.float32).double().reshape(8, 2, 32, 8)
    d, scales, index, _ = iq2s.unpack(q.blocks.reshape(8, 2, BLOCK_BYTES))
    c = (d[..., None] * (0.5 + scales.float()) * 0.25).repeat_interleave(2, -1).double()  # [8, 2, 32]
    xb = x.double().reshape(8, 2, 32, 8)
    sigma2 = 2 * xb.pow(2).sum((-1, -2)) / QK
    wt = 0.25 * sigma2[..., None, None] + xb.pow(2)
    energy = lambda v: (wt * v * v).sum((-1, -2))  # noqa: E731
    assert torch.allclose(energy(y), energy(xb), rtol=2.0 ** -9)
    best = torch.zeros(8, 2)
    for k in torch.linspace(0.8, 1.25, 181, dtype=torch.float64):
        err = (wt[..., None, :] * (xb.abs()[..., None, :] - k * c[..., None, None] * GRID.double()).pow(2)).sum(-1)
        chosen = err.gather(-1, index[..., None]).squeeze(-1)
        best = torch.maximum(best, (chosen <= err.min(-1).values * (1 + 1e-6) + 1e-15).double().mean(-1))
    assert (best >= 0.95).all(), best
    assert ((y * xb) >= 0).all()


@needs_native
@pytest.mark.parametrize("tail", ["gaussian", "student-t"])
def test_lower_error_than_the_scalar_2_bit_grid(tail):
    """The lattice codebook against nl2 (moeq's 4-level scalar grid at 2.5 bits, the same x^2-weighted search): lower
    error at 2.5625 bits under the weights both searches minimize (0.25 sigma^2 + x^2 per 256). (Unweighted, heavy
    tails are level: IQ2_S has no zero level, so a group's small weights pay for its large ones.)"""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 1024, generator=g) if tail == "gaussian" else torch.distributions.StudentT(4).sample((64, 1024))
    x = (x * 0.02).bfloat16()
    xf = x.float().view(64, 4, 256)
    wt = 0.25 * 2 * xf.pow(2).mean(-1, keepdim=True) + xf.pow(2)
    errs = []
    for q in (iq2s.quantize(x), METHODS["nl2"].quantize(x)):
        e = q.dequantize(torch.float32).view(64, 4, 256) - xf
        errs.append(float((wt * e * e).sum() / (wt * xf * xf).sum()))
    assert errs[0] < 0.8 * errs[1], errs


@needs_native
def test_importance_moves_error_off_the_important_columns():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=g) * 0.02
    imp = torch.ones(512)
    imp[0::4] = 100.0  # one column in four inside every group of 8: the points, not only the scales, must follow
    plain = (iq2s.quantize(x).dequantize(torch.float32) - x)[:, 0::4].pow(2).sum()
    for weighting in iq2s.WEIGHTINGS:
        weighted = (iq2s.quantize(x, imp, weighting).dequantize(torch.float32) - x)[:, 0::4].pow(2).sum()
        assert weighted < 0.5 * plain, weighting


@needs_native
def test_zero_blocks_and_zero_importance_columns():
    x = torch.zeros(2, 512)
    x[1, 256:] = torch.linspace(-1, 1, 256)
    imp = torch.ones(512)
    imp[300:310] = 0.0
    q = iq2s.quantize(x, imp)
    y = q.dequantize(torch.float32)
    assert torch.equal(y[0], torch.zeros(512)) and torch.equal(y[1, :256], torch.zeros(256))
    err = (y[1] - x[1]).abs()
    err[300:310] = 0.0  # columns of no importance may take any point
    assert torch.isfinite(y).all() and err.max() < 0.1, err.max()


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_gemv_against_the_reference(rows):
    """int8 activations per 256 (AVX512-VNNI) or fp32: within 2^-6 of the fp32 product with the decoded weight."""
    g = torch.Generator().manual_seed(4)
    w = Iq2sWeight(blocks=random_blocks(40, 768, 5), shape=(40, 768), dtype=torch.float32).validate()
    x = torch.randn(rows, 768, generator=g)
    x[0, :256] = 0.0  # an all-zero activation block
    bias = torch.randn(40, generator=g)
    y = iq2s_gemv(w, x, bias, max_rows=8)
    want = x @ w.dequantize_reference(torch.float32).T + bias
    assert y is not None and y.shape == (rows, 40)
    assert (y - want).norm() <= 2.0 ** -6 * want.norm()
    x[-1, 300] = float("nan")  # a non-finite activation reaches its row's outputs (it is not rounded away)
    y = iq2s_gemv(w, x, None, max_rows=8)
    assert torch.isnan(y[-1]).all() and (rows == 1 or torch.isfinite(y[:-1]).all())


def test_validation_names_the_tensor_and_the_problem():
    good = random_blocks(2, 256, 6)
    with pytest.raises(MoeqError, match="multiple of 256"):
        Iq2sWeight(blocks=good, shape=(2, 128)).validate("t")
    with pytest.raises(MoeqError, match="blocks has shape"):
        Iq2sWeight(blocks=good[:, :80], shape=(2, 256)).validate("t")
    bad = good.clone()
    bad[1, 0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # fp16 +inf
    with pytest.raises(MoeqError, match="non-finite"):
        Iq2sWeight(blocks=bad, shape=(2, 256)).validate("layer.w")
    huge = good.clone()
    huge[0, 0:2] = torch.tensor([0xFF, 0x7B], dtype=torch.uint8)  # 65504: decodes past fp16's range
    with pytest.raises(MoeqError, match="beyond"):
        Iq2sWeight(blocks=huge, shape=(2, 256), dtype=torch.float16).validate("layer.w")
    meta = {"shape": [2, 256], "dtype": "bfloat16"}
    assert WEIGHT_TYPES["iq2s"].from_untrusted({"blocks": good}, meta, "f").shape == (2, 256)
    with pytest.raises(MoeqError, match="f: invalid iq2s"):
        WEIGHT_TYPES["iq2s"].from_untrusted({"blocks": good[:1]}, meta, "f")


def test_quantize_refuses_what_it_cannot_hold():
    with pytest.raises(MoeqError, match="multiple of 256"):
        iq2s.quantize(torch.randn(4, 200), name="w")
    with pytest.raises(MoeqError, match="non-finite"):
        iq2s.quantize(torch.full((1, 256), float("nan")), name="w")
    with pytest.raises(MoeqError, match="importance"):
        iq2s.quantize(torch.randn(1, 256), importance=torch.full((256,), -1.0), name="w")


@needs_native
def test_config_falls_back_where_the_width_is_not_a_multiple_of_256(caplog):
    w = torch.randn(4, 192).bfloat16()
    with caplog.at_level(logging.INFO, logger="moeq.config"):
        q = IQ2S().quantize(w, name="experts.w2")
    assert isinstance(q, rtn.RTNWeight) and q.grid == "nl2" and "experts.w2" in caplog.text
    assert isinstance(IQ2S().quantize(torch.randn(4, 256).bfloat16()), Iq2sWeight)
    with pytest.raises(MoeqError, match="fallback"):
        IQ2S(fallback="iq2s")
    with pytest.raises(MoeqError, match="weighting"):
        IQ2S(weighting="abs")
    assert IQ2S.from_dict(IQ2S(weighting="mse").to_dict()) == IQ2S(weighting="mse")
    assert np.isclose(iq2s.quantize(torch.randn(3, 256)).bits_per_weight, 82 * 8 / 256)


@needs_native
def test_load_measures_importance_for_iq2s_itself(tiny_ckpt):
    """iq2s is unusable without column importance: moeq.load measures the data-free statistic when none was asked
    for, and records it in the checkpoint's quantization_config; the model's experts hold IQ2_S blocks."""
    import moeq
    from moeq.loader import AUTO_IMPORTANCE_TOKENS, needs_importance

    assert needs_importance("iq2s-m") and needs_importance("iq2s") and not needs_importance("iq4nl")
    src = tiny_ckpt("qwen3_moe", hidden_size=256, moe_intermediate_size=256)
    m = moeq.load(src, quant="iq2s-m", progress=False)
    assert m.config.quantization_config["importance"]["tokens"] == AUTO_IMPORTANCE_TOKENS
    assert m.config.quantization_config["importance"]["inputs"] == "self"  # the model's own text: the default
    experts = m.model.layers[0].mlp.experts
    assert isinstance(experts.w13, Iq2sWeight) and isinstance(experts.w2, Iq2sWeight)
    with torch.no_grad():
        assert torch.isfinite(m(torch.tensor([[1, 2, 3]])).logits).all()


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_experts_and_linear_against_float64(dtype, monkeypatch):
    """IQ2_S expert stacks and linears on every path they take — the fused native decode kernels (planned row
    ``iq2s``), the per-expert loop past them, plain torch without the native library — at 1, 4 and 17 rows, against a
    float64 reference over the decoded weights. On AVX512-VNNI the activations are rounded to int8 per 256 (absmax
    / 127, as llama.cpp's q8_K): ~0.7% per rounding on Gaussian rows, twice in an expert (its input, and the GLU's
    heavier-tailed output): bounds 2% for a linear, 4% for the experts."""
    from moeq.kernels.describe import describe
    from moeq.nn import QuantExperts, QuantLinear
    from moeq.nn.experts import Activation
    from tests.kernels.reference import reference_moe

    e, h, i, a = 4, 256, 256, 2
    g = torch.Generator().manual_seed(7)
    w13, w2, wl = (torch.randn(*s, generator=g) * 0.05 for s in ((e, 2 * i, h), (e, h, i), (2 * i, h)))
    imp = torch.rand(h, generator=g) + 0.5
    experts = QuantExperts(iq2s.quantize(w13, imp), iq2s.quantize(w2, imp), Activation())
    linear = QuantLinear(iq2s.quantize(wl, imp))
    assert describe(experts.w13, []).kernel_names() == ["iq2s"]

    def check():
        for t in (1, 4, 17):
            x = torch.randn(t, h, generator=g).to(dtype)
            idx = torch.stack([torch.randperm(e, generator=g)[:a] for _ in range(t)])
            wts = torch.softmax(torch.randn(t, a, generator=g), -1).to(dtype)
            with torch.no_grad():
                ye, yl = experts(x, idx, wts), linear(x)
            glu = lambda gt, u: torch.nn.functional.silu(gt) * u  # noqa: E731
            ref_e = reference_moe(experts.w13.dequantize(torch.float64), experts.w2.dequantize(torch.float64), x, idx,
                                  wts, glu)
            ref_l = x.double() @ linear.qweight.dequantize(torch.float64).T
            for y, ref, tol in ((ye, ref_e, 0.04), (yl, ref_l, 0.02)):
                assert y.dtype == dtype and torch.isfinite(y).all()
                assert (y.double() - ref).norm() <= tol * ref.norm(), (t, float((y.double() - ref).norm() / ref.norm()))

    check()
    monkeypatch.setattr(native, "lib", lambda: None)
    for name in ("has_simd", "has_dpbf16", "has_i8_dot", "has_cb3_dot"):
        monkeypatch.setattr(native, name, lambda: False)
    experts.choose_kernel()
    linear.choose_kernel()
    check()
