"""The prompt-sized MoE path (``moeq_moe_prefill``, native/csrc/gemm.c): per expert a grouped GEMM from the packed
codes with the tokens in the vector lanes, its products on AVX512-BF16 or on the AMX tile unit. Checked against
float64 sums over the same bf16-rounded weights the torch path (dequantize + matmul) multiplies, and against that path
itself; the AMX products against the AVX512-BF16 ones on the same machine (skipped where the CPU, the build or Linux
gives no AMX tiles)."""
import pytest
import torch

from moeq import native
from moeq.config import BNB4, FP8, IQ2S, RTN
from moeq.kernels import moe_cpu

pytestmark = pytest.mark.skipif(not native.has_dpbf16(), reason="the grouped GEMM needs AVX512-BF16 (others keep "
                                                                 "dequantize + matmul, tested elsewhere)")

# the 4-bit fast tile (RTN sym/asym, 16-value codebooks, int8 scale codes; groups 32 and 64k), the general one
# (8-bit, 5-bit, 3-bit, groups of 16) and FP8's
CONFIGS = [RTN(4, 32), RTN(4, 128), RTN(4, 64, symmetric=False), RTN(4, 32, grid="iq4nl"),
           RTN(4, 32, grid="iq4nl", double_quant=True), RTN(4, 32, grid="mxfp4"), RTN(8, 64), RTN(8, 32, symmetric=False),
           RTN(4, 16, grid="iq4nl"), RTN(5, 32, grid="signed"), RTN(3, 16, grid="nl3", double_quant=True), RTN(2, 16, grid="nl2", double_quant=True),
           # FP8 e4m3 tiles: DeepSeek's 128x128, tiles a 16-row weight tile straddles, and a width the vector
           # conversion does not take (40: the scalar path) with partial edge tiles
           FP8((128, 128)), FP8((24, 32)), FP8((48, 40)),
           # llama.cpp's IQ2_S blocks (a lattice point per 8 weights, signs, 4-bit sub-block scales)
           IQ2S()]


@pytest.fixture(params=["avx512-bf16", "amx"])
def products(request):
    """Which unit multiplies the dequantized tiles (moeq_set_amx), restored after the test."""
    L = native.lib()
    if request.param == "amx" and not native.amx_tiles():
        pytest.skip("no AMX tiles here (CPU, build or Linux permission): the AVX512-BF16 products serve")
    L.moeq_set_amx(int(request.param == "amx"))
    yield request.param
    L.moeq_set_amx(1)


def _module(cfg, e=8, h=256, i=None, seed=0):
    from moeq.nn import Activation, QuantExperts

    i = i or (256 if isinstance(cfg, IQ2S) else 128)  # IQ2_S blocks: both widths multiples of 256

    g = torch.Generator().manual_seed(seed)
    gu, dn = torch.randn(e, 2 * i, h, generator=g) * 0.05, torch.randn(e, h, i, generator=g) * 0.05
    gu[1, 5, :40] *= 20  # outliers: large codes at both ends
    return QuantExperts(cfg.quantize(gu.bfloat16()), cfg.quantize(dn.bfloat16()), Activation())


def _routing(t, e, a, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:a] for _ in range(t)])
    idx[:, 0] = 2  # expert 2 in every token: more pairs than one pass of the kernel takes (96)
    idx[:, 1:][idx[:, 1:] == 2] = 7
    idx[: t // 2, 1:][idx[: t // 2, 1:] == 5] = 6  # expert 5 gets few rows: the decode kernel takes it
    return idx, torch.rand(t, a, generator=g).bfloat16()


def _exact(mod, x, idx, wts):
    """float64 from the bf16-rounded weights, and sum_j w_j |W2| |a_j| (what the bf16 rounding of a scales with)."""
    d13, d2 = (w.dequantize(torch.bfloat16).double() for w in (mod.w13, mod.w2))
    i = mod.intermediate_dim
    exact, mag = torch.zeros(x.shape, dtype=torch.float64), torch.zeros(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e, wt = idx[r, j], float(wts[r, j])
            hh = d13[e] @ x[r].double()
            act = torch.nn.functional.silu(hh[:i]) * hh[i:]
            exact[r] += wt * (d2[e] @ act)
            mag[r] += abs(wt) * (d2[e].abs() @ act.abs())
    return exact, mag


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
def test_prefill_gemm_matches_float64(cfg, monkeypatch, products):
    import moeq.nn.experts as ex

    torch.manual_seed(0)  # the inputs independent of the tests before (their order, -k selections)
    mod = _module(cfg)
    t, a = 110, 3
    x = torch.randn(t, 256).bfloat16()
    idx, wts = _routing(t, 8, a)
    ran = []
    real = ex.moe_prefill
    monkeypatch.setattr(ex, "moe_prefill", lambda *args: ran.append(r := real(*args)) or r)
    y = mod(x, idx, wts)
    assert ran and ran[0] is not None and y.dtype == torch.bfloat16  # the kernel took it (did not decline)
    exact, mag = _exact(mod, x, idx, wts)
    err = (y.double() - exact).abs()
    # the output rounded once to bf16, the SiLU-GLU output rounded to bf16 before the down projection, fp32 sums
    assert (err <= 2.0 ** -8 * exact.abs() + 2.0 ** -8 * mag + 1e-6).all(), (err - 2.0 ** -8 * exact.abs()).max()
    monkeypatch.setattr(ex, "moe_prefill", lambda *args: None)
    loop = mod(x, idx, wts)  # dequantize + bf16 matmul per expert (bf16 between the steps): no more accurate
    loop_err = (loop.double() - exact).abs()
    # on average no less accurate; the single worst element of two roundings may land either way
    assert err.mean() <= 1.02 * loop_err.mean() and err.max() <= 1.25 * loop_err.max() + 1e-6


def test_prefill_gemm_token_blocks_and_passes(products):
    """Experts of 9..130 rows (token blocks of 16, 32, 48, a pass of 96 and a remainder): each expert's rows
    equal those it gives alone, so no token leaks into another's block or pass."""
    mod = _module(RTN(4, 32, grid="iq4nl"), e=4)
    torch.manual_seed(3)
    counts = [9, 33, 130, 48]
    token_of = torch.cat([torch.randperm(150)[:c] for c in counts])
    weight_of = torch.rand(len(token_of))
    x = torch.randn(150, 256).bfloat16()
    y = moe_cpu.moe_prefill(mod, x, token_of, weight_of, counts)
    assert y is not None and y.dtype == torch.float32
    start, want = 0, torch.zeros_like(y)
    for e, c in enumerate(counts):
        alone = [c if j == e else 0 for j in range(4)]
        part = moe_cpu.moe_prefill(mod, x, token_of[start:start + c], weight_of[start:start + c], alone)
        want += part
        start += c
    assert torch.allclose(y, want, rtol=1e-6, atol=1e-6)


def test_prefill_gemm_declines_outside_its_domain():
    mod = _module(RTN(4, 32))
    x = torch.randn(20, 256).bfloat16()
    tok, wt, counts = torch.arange(20), torch.ones(20), [20] + [0] * 7
    assert moe_cpu.moe_prefill(mod, x.float(), tok, wt, counts) is None  # bf16 activations only
    assert moe_cpu.moe_prefill(_module(BNB4("nf4", 64, True)), x, tok, wt, counts) is None  # NF4: dequant + matmul
    bad = tok.clone()
    bad[3] = 20  # a token index past the batch: refused before any read
    assert moe_cpu.moe_prefill(mod, x, bad, wt, counts) is None
    assert moe_cpu.moe_prefill(mod, x, tok, wt, counts) is not None


@pytest.mark.parametrize("cfg", [RTN(4, 32), RTN(8, 64), RTN(4, 32, grid="iq4nl", double_quant=True), FP8((128, 128)),
                                 IQ2S()],
                         ids=lambda c: c.label())
def test_amx_products_match_avx512(cfg):
    """The tile unit computes the same products as the AVX512-BF16 dot products (fp32 sums in another order), for
    every token-block count (1-4 blocks of 16 in a pass of 96: 9..200 rows per expert)."""
    if not native.amx_tiles():
        pytest.skip("no AMX tiles here (CPU, build or Linux permission): nothing to compare")
    L = native.lib()
    mod = _module(cfg, e=4)
    torch.manual_seed(5)
    counts = [9, 40, 200, 64]
    token_of = torch.cat([torch.randperm(220)[:c] for c in counts])
    weight_of = torch.rand(len(token_of))
    x = torch.randn(220, 256).bfloat16()
    try:
        L.moeq_set_amx(0)
        ref = moe_cpu.moe_prefill(mod, x, token_of, weight_of, counts)
    finally:
        L.moeq_set_amx(1)
    got = moe_cpu.moe_prefill(mod, x, token_of, weight_of, counts)
    assert got is not None and ref is not None
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= 1e-2 * scale  # bf16 SiLU-GLU rounding between the two projections may flip
    assert ((got - ref).norm() / ref.norm()) < 2e-3
