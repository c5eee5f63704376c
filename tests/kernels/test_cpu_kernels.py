"""Native CPU matmul kernels vs the plain-torch reference (dequantize + F.linear)."""
import pytest
import torch

from moeq import native
from moeq.config import BNB4, RTN, Int8
from moeq.kernels import cpu_ops, linear, plans, reference


CONFIGS = [RTN(4, 128), RTN(4, 32), RTN(8, 64), RTN(4, 128, symmetric=False), RTN(8, -1, symmetric=False),
           RTN(4, 32, grid="iq4nl", search=3), RTN(4, 64, grid="iq4nl"), RTN(4, 32, grid="signed", search=2),
           RTN(5, 32, grid="signed", search=3), RTN(5, 128), RTN(4, 32, grid="iq4nl", search=2, double_quant=True),
           RTN(3, 16, grid="nl3", search=2, double_quant=True), RTN(3, 64, grid="nl3"), RTN(4, 16, grid="iq4nl"),
           RTN(2, 16, grid="nl2", search=2, double_quant=True), RTN(2, 32, grid="nl2"),
           RTN(4, 32, grid="mxfp4"), BNB4("nf4", 64, True), BNB4("fp4", 128, False), BNB4("nf4", 32, True), Int8()]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("rows", [1, 3, 8, 21])  # 21: three chunks of rows inside the kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_matches_reference(cfg, rows, dtype):
    torch.manual_seed(rows)
    w = (torch.randn(96, 256) * 0.05).to(dtype)
    q = cfg.quantize(w)
    x = torch.randn(rows, 256, dtype=dtype)
    bias = torch.randn(96, dtype=dtype)
    kernel = {"rtn": cpu_ops.rtn_gemv, "bnb4": cpu_ops.bnb4_gemv, "int8": cpu_ops.int8_gemv}[q.format]
    y = kernel(q, x, bias, max_rows=cpu_ops.MAX_ROWS)
    assert y is not None and y.dtype == dtype and y.shape == (rows, 96)
    ref = reference(q, x.float(), bias.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(y.float(), ref, atol=tol * ref.abs().max(), rtol=tol)


def test_dispatch_declines_big_batches_and_3d_inputs():
    q = RTN(4, 64).quantize(torch.randn(32, 128))
    limit = plans.rows_limit(q)  # AMX: dequantize + AMX matmul wins past a few rows; without it the gemv holds longer
    assert limit == (plans.ROWS_SMALL_WEIGHT if native.has_amx() else plans.ROWS_NO_AMX)
    assert cpu_ops.rtn_gemv(q, torch.randn(limit + 1, 128), None) is None
    assert cpu_ops.rtn_gemv(q, torch.randn(limit, 128), None) is not None
    assert cpu_ops.rtn_gemv(q, torch.randn(cpu_ops.MAX_ROWS + 1, 128), None, max_rows=999) is None
    x = torch.randn(2, 5, 128)  # [batch, seq, K] -> 10 rows: the reference path
    assert torch.allclose(linear(q, x), reference(q, x), atol=1e-5)
    x = torch.randn(1, 2, 128)
    assert linear(q, x).shape == (1, 2, 32)


def _count_fused(ex, monkeypatch) -> list:
    """Record calls of the native layer kernels (routed from the router's output, or from grouped pairs)."""
    calls = []
    for name in ("moe_forward", "moe_routed"):
        real = getattr(ex, name)
        monkeypatch.setattr(ex, name, lambda *args, real=real: calls.append(1) or real(*args))
    return calls


def _no_fused(ex, monkeypatch) -> None:
    """Decline the native layer kernels: the per-expert path (dequantize + matmul or gemv per expert)."""
    monkeypatch.setattr(ex, "moe_forward", lambda *args: None)
    monkeypatch.setattr(ex, "moe_routed", lambda *args: None)
    monkeypatch.setattr(ex, "moe_prefill", lambda *args: None)


@pytest.mark.parametrize("cfg", [RTN(4, 64), RTN(8, 128), RTN(4, 32, symmetric=False), BNB4("nf4", 64, True),
                                 BNB4("fp4", 32, False), RTN(4, 32, grid="iq4nl"), RTN(5, 32, grid="signed"),
                                 RTN(4, 32, grid="iq4nl", double_quant=True),
                                 RTN(3, 16, grid="nl3", double_quant=True), RTN(2, 16, grid="nl2", double_quant=True)],
                         ids=lambda c: c.label())
@pytest.mark.parametrize("t", [6, 40])  # 40 tokens: some experts get more rows than the fused path takes
def test_fused_moe_matches_per_expert_loop(cfg, t, monkeypatch):
    import moeq.nn.experts as ex
    from moeq.nn import Activation, QuantExperts

    torch.manual_seed(0)
    e, h, i, a = 8, 256, 128, 3
    gu, dn = torch.randn(e, 2 * i, h) * 0.05, torch.randn(e, h, i) * 0.05
    pieces = [[cfg.quantize(gu[x, :i]), cfg.quantize(gu[x, i:])] for x in range(e)]
    cls = type(pieces[0][0])
    mod = QuantExperts(cls.join(pieces), cls.join([[cfg.quantize(dn[x])] for x in range(e)]), Activation())
    x = torch.randn(t, h)
    idx = torch.stack([torch.randperm(e)[:a] for _ in range(t)])
    if t > 10:
        idx[:, 0] = 2  # expert 2 gets every token: the hybrid path (fused for the others)
        idx[:, 1:] = torch.stack([torch.randperm(e - 1)[: a - 1] + (torch.randperm(e - 1)[: a - 1] >= 2).long()
                                  for _ in range(t)])
        idx[:, 1:][idx[:, 1:] == 2] = 7
    wts = torch.rand(t, a)
    calls = _count_fused(ex, monkeypatch)
    fused = mod(x, idx, wts)
    assert calls  # the fused kernel ran (did not decline)
    _no_fused(ex, monkeypatch)
    loop = mod(x, idx, wts)
    assert torch.allclose(fused, loop, atol=1e-5 * loop.abs().max(), rtol=1e-4)
    monkeypatch.setattr(ex, "MAX_TOKENS_PER_PASS", 4)  # long prompts run in passes of tokens: same result
    passes = mod(x, idx, wts)
    assert passes.shape == loop.shape
    assert torch.allclose(passes, loop, atol=1e-5 * loop.abs().max(), rtol=1e-4)


@pytest.mark.parametrize("cfg", [RTN(4, 64), RTN(4, 64, symmetric=False), RTN(4, 32, symmetric=False), RTN(8, 128),
                                 RTN(4, 32, grid="iq4nl", search=3), RTN(4, 128, grid="iq4nl"), RTN(5, 32, grid="signed"),
                                 RTN(3, 16, grid="nl3", search=2, double_quant=True), RTN(3, 32, grid="nl3"),
                                 RTN(2, 16, grid="nl2", search=2, double_quant=True),
                                 BNB4("nf4", 64, True), BNB4("fp4", 128, False)], ids=lambda c: c.label())
@pytest.mark.parametrize("t", [1, 5])  # 1: every active expert has one row (the kernel's one-row loops)
def test_fused_moe_bf16_activations(cfg, t, monkeypatch):
    """bf16 models: 4-bit RTN experts run the expert-parallel AVX512-BF16 layer kernel, NF4/FP4 the bf16-dot gemv;
    equal to the per-expert
    loop (which rounds to bf16 between the matmuls as transformers does) within bf16 noise."""
    import moeq.nn.experts as ex
    from moeq.nn import Activation, QuantExperts

    torch.manual_seed(t)
    e, h, i, a = 8, 256, 128, 3
    gu, dn = torch.randn(e, 2 * i, h) * 0.05, torch.randn(e, h, i) * 0.05
    mod = QuantExperts(cfg.quantize(gu.bfloat16()), cfg.quantize(dn.bfloat16()), Activation())
    x = torch.randn(t, h).bfloat16()
    idx = torch.stack([torch.randperm(e)[:a] for _ in range(t)])
    wts = torch.rand(t, a).bfloat16()
    calls = _count_fused(ex, monkeypatch)
    fused = mod(x, idx, wts).float()
    assert calls and fused.dtype == torch.float32
    _no_fused(ex, monkeypatch)
    loop = mod(x, idx, wts).float()
    exact = torch.zeros(t, h)  # fp32 from the same dequantized weights
    d13, d2 = mod.w13.dequantize(torch.float32), mod.w2.dequantize(torch.float32)
    for r in range(t):
        for j in range(a):
            hh = d13[idx[r, j]] @ x[r].float()
            exact[r] += wts[r, j].float() * (d2[idx[r, j]] @ (torch.nn.functional.silu(hh[:i]) * hh[i:]))
    assert (fused - exact).abs().max() < 0.02 * exact.abs().max()
    assert (fused - exact).abs().max() <= 1.5 * (loop - exact).abs().max() + 1e-6  # no worse than transformers' way


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
def test_dequantize_into_buffer_matches_fresh(cfg):
    torch.manual_seed(0)
    q = cfg.quantize(torch.randn(3, 64, 256) * 0.05)
    for dtype in (torch.bfloat16, torch.float32):
        buf = torch.full(q.shape, float("nan"), dtype=dtype)
        assert q.dequantize(dtype, out=buf) is buf
        assert torch.equal(buf, q.dequantize(dtype))
    with pytest.raises(ValueError, match="shape"):
        q.dequantize(torch.bfloat16, out=torch.empty(3, 64, 255, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        q.dequantize(torch.float32, out=torch.empty(q.shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("cfg", [RTN(4, 64), RTN(8, 128, symmetric=False), Int8(), BNB4("nf4", 64, True)],
                         ids=lambda c: c.label())
def test_large_weights_dequantize_in_row_chunks(cfg, monkeypatch):
    """Weights above CHUNKED_ABOVE elements run DEQUANT_CHUNK elements at a time through one buffer: same result as
    whole, and no weight-sized dequantized temporary (bnb4 blocks may span rows: it stays whole)."""
    import moeq.kernels as kernels

    torch.manual_seed(1)
    q = cfg.quantize(torch.randn(200, 256) * 0.05)  # 200 rows: 7 chunks of 32 rows, the last one partial
    x, bias = torch.randn(2, 9, 256, dtype=torch.bfloat16), torch.randn(200, dtype=torch.bfloat16)
    whole = kernels.reference(q, x, bias)
    monkeypatch.setattr(kernels, "CHUNKED_ABOVE", 32 * 256)
    monkeypatch.setattr(kernels, "DEQUANT_CHUNK", 32 * 256)
    shapes = []
    real = type(q).dequantize
    monkeypatch.setattr(type(q), "dequantize", lambda self, *a, **k: shapes.append(self.shape) or real(self, *a, **k))
    y = kernels.reference(q, x, bias)
    assert y.shape == (2, 9, 200)
    assert torch.equal(y, whole)
    assert torch.equal(y.view(-1, 200), y.reshape(-1, 200))  # a view over tokens works, as the loss takes one
    if q.row_sliceable:
        assert shapes == [(32, 256)] * 6 + [(8, 256)]
    else:
        assert shapes == [(200, 256)]
    # a caller's buffer (the experts' per-layer one) takes the weight whole: no chunking, nothing allocated
    shapes.clear()
    buf = torch.empty(q.numel + 7, dtype=kernels.matmul_dtype(x.dtype, x.device))  # fp32 without bf16 GEMM
    assert torch.equal(kernels.reference(q, x, bias, buf), whole)
    assert shapes == [(200, 256)]


@pytest.mark.parametrize("cfg", [RTN(8, 128), RTN(8, 32, symmetric=False), RTN(4, 64), RTN(4, 32, symmetric=False)],
                         ids=lambda c: c.label())
@pytest.mark.parametrize("rows", [1, 5, 11])
@pytest.mark.parametrize("k,wdtype", [(512, torch.bfloat16), (1280, torch.float32), (2048, torch.bfloat16)])
def test_bf16_gemv_within_one_rounding_of_exact(cfg, rows, k, wdtype):
    """bf16 activations: the 4-bit AVX512-BF16 kernels' products are exact in fp32 (the 8-bit kernel's int16
    activations are exact within 2^7 of each group's largest, off by <= 2^-16 of it below), so the bf16 output is
    the exact result rounded once, plus fp32 accumulation error (2^-16 of sum |x w|: the codes' +128 offsets are
    summed too), far tighter than bf16 matmul noise."""
    if not cpu_ops.native.has_dpbf16():
        pytest.skip("built without AVX512-BF16: the fp32 path (tested above) serves bf16 inputs")
    torch.manual_seed(rows)
    w = torch.randn(160, k) * 0.05  # k / group: 1-64 groups per row, some counts not multiples of 16
    w[3, :40] *= 30  # outliers: large codes at both ends of the 8-bit range
    q = cfg.quantize(w.to(wdtype))  # bf16 or fp32 scales
    x = torch.randn(rows, k).bfloat16()
    y = cpu_ops.rtn_gemv(q, x, None, max_rows=cpu_ops.MAX_ROWS)
    assert y is not None and y.dtype == torch.bfloat16
    wd = q.dequantize(torch.float32).double()
    exact = x.double() @ wd.t()
    magnitude = x.double().abs() @ wd.abs().t()  # sum |x w|: what fp32 accumulation error scales with
    err = (y.double() - exact).abs()
    assert (err <= 2.0 ** -8 * exact.abs() + 2.0 ** -16 * magnitude).all(), (err - 2.0 ** -8 * exact.abs()).max()


@pytest.mark.parametrize("cfg", [RTN(4, 64), RTN(8, 64), BNB4("nf4", 64, True)], ids=lambda c: c.label())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_routed_decode_groups_pairs_like_argsort(cfg, dtype, monkeypatch):
    """The one-call decode path groups pairs in C; it must equal the Python grouping feeding the same kernel
    (bit for bit), run an expert with more than 8 rows in passes of 8 (equal to the general path within rounding),
    and decline an expert index out of range."""
    import moeq.nn.experts as ex
    from moeq.kernels import moe_cpu
    from moeq.nn import Activation, QuantExperts

    torch.manual_seed(1)
    e, h, i, a, t = 16, 256, 128, 4, 5
    mod = QuantExperts(cfg.quantize((torch.randn(e, 2 * i, h) * 0.05).to(dtype)),
                       cfg.quantize((torch.randn(e, h, i) * 0.05).to(dtype)), Activation())
    x = torch.randn(t, h).to(dtype)
    idx = torch.stack([torch.randperm(e)[:a] for _ in range(t)])
    wts = torch.rand(t, a).to(dtype)
    routed = moe_cpu.moe_routed(mod, x, idx, wts)
    assert routed is not None
    monkeypatch.setattr(ex, "moe_routed", lambda *args: None)
    grouped = mod(x, idx, wts)
    assert torch.equal(routed, grouped)
    monkeypatch.undo()
    crowded = torch.full((3, a), 5)  # expert 5 gets 12 rows: two passes (8, then 4)
    passes = moe_cpu.moe_routed(mod, x[:3], crowded, wts[:3])
    assert passes is not None
    _no_fused(ex, monkeypatch)
    loop = mod(x[:3], crowded, wts[:3]).float()
    monkeypatch.undo()
    assert torch.allclose(passes.float(), loop, atol=2e-2 * loop.abs().max())
    assert torch.allclose(mod(x[:3], crowded, wts[:3]).float(), loop, atol=2e-2 * loop.abs().max())
    assert moe_cpu.moe_routed(mod, x[:1], torch.tensor([[0, 1, 99, 2]]), wts[:1]) is None  # bad index: declined


@pytest.mark.parametrize("cfg", [RTN(4, 64), RTN(8, 32, symmetric=False), BNB4("nf4", 64, True)],
                         ids=lambda c: c.label())
def test_products_written_in_place_equal_fresh(cfg):
    """The many-rows expert path writes each product into its slice of one output (``out=``) and applies SiLU-GLU
    in place: bit-identical to fresh tensors."""
    from moeq.kernels import expert_linear
    from moeq.nn import Activation

    torch.manual_seed(3)
    w = cfg.quantize((torch.randn(4, 96, 128) * 0.05).bfloat16())
    x = torch.randn(40, 128).bfloat16()
    buf = torch.empty(w.numel // 4, dtype=torch.bfloat16)
    ys = torch.full((50, 96), float("nan"), dtype=torch.bfloat16)
    got = expert_linear(w, 2, x, None, buf, ys[5:45])
    assert got.data_ptr() == ys[5:45].data_ptr()
    assert torch.equal(ys[5:45], reference(w[2], x))
    assert ys[:5].isnan().all() and ys[45:].isnan().all()  # nothing written outside the slice
    bias = torch.randn(96).bfloat16()
    assert torch.equal(expert_linear(w, 1, x, bias, buf, torch.empty(40, 96, dtype=torch.bfloat16)),
                       reference(w[1], x, bias))
    h = torch.randn(40, 64).bfloat16()
    expect = Activation()(h[:, :32], h[:, 32:])
    assert torch.equal(Activation().glu_(h.clone(), 32), expect)


@pytest.mark.parametrize("cfg", [RTN(4, 128), RTN(4, 32, symmetric=False), RTN(8, 64, symmetric=False), RTN(8, 128),
                                 RTN(4, 32, grid="iq4nl", search=2), RTN(5, 32, grid="signed", search=2),
                                 RTN(4, 32, grid="iq4nl", search=2, double_quant=True),
                                 RTN(3, 16, grid="nl3", search=2, double_quant=True),
                                 RTN(2, 16, grid="nl2", double_quant=True),
                                 BNB4("nf4", 64, True), BNB4("fp4", 128, False), BNB4("nf4", 32, False)],
                         ids=lambda c: c.label())
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (2, 2)])  # (batch, tokens): [B, T, K] inputs
@pytest.mark.parametrize("bias", [False, True])
def test_quant_linear_one_call_path(cfg, shape, bias, monkeypatch):
    """bf16 QuantLinear at decode sizes (RTN, NF4/FP4) runs as one native call (layout, gemv, rounding, bias): equal
    to the Python kernel path within one bf16 rounding, also on a strided [B, 1, K] view; a new weight rebuilds the
    plan."""
    from moeq import native
    from moeq.nn import QuantLinear
    from moeq.nn.packed import set_packed

    if not native.has_simd():
        pytest.skip("needs a SIMD build (AVX512-BF16 or AVX2)")
    torch.manual_seed(sum(shape))
    n, k = 320, 512
    mod = QuantLinear(cfg.quantize(torch.randn(n, k).bfloat16()), torch.randn(n).bfloat16() if bias else None)
    full = torch.randn(shape[0], shape[1] + 3, k).bfloat16()
    x = full[:, -shape[1]:, :]  # a view with the whole prompt's batch stride, as transformers feeds the head
    taken = []
    real = cpu_ops.quant_linear_bf16
    monkeypatch.setattr(cpu_ops, "quant_linear_bf16", lambda *a: taken.append(1) or real(*a))
    y = mod(x)
    assert taken and real(mod, x) is not None and y.shape == (*shape, n) and y.dtype == torch.bfloat16
    ref = linear(mod.qweight, x.contiguous(), mod.bias).float()
    assert (y.float() - ref).abs().max() <= ref.abs().max() * 2 ** -7
    exact = x.float() @ mod.qweight.dequantize(torch.float32).t() + (0 if mod.bias is None else mod.bias.float())
    assert (y.float() - exact).abs().max() <= exact.abs().max() * 2 ** -7
    set_packed(mod, "weight", cfg.quantize(torch.randn(n, k).bfloat16()))
    y2 = mod(x).float()
    ref2 = linear(mod.qweight, x.contiguous(), mod.bias).float()
    assert (y2 - ref2).abs().max() <= ref2.abs().max() * 2 ** -7 and not torch.equal(y2, y.float())
    more = plans.rows_limit(mod.qweight) + 1  # more rows than pay off: the dequantize path
    assert real(mod, torch.randn(1, more, k).bfloat16()) is None
    assert real(mod, x.float()) is None  # fp32 activations: the Python kernel path


def test_rtn8_int16_activations_edge_cases():
    """The 8-bit kernel's int16 activations: a per-channel group longer than 4096 at the codes' extremes (int32
    chunks must not overflow), groups spanning 2^20 in magnitude, an all-zero group, and NaN/Inf (NaN out, not
    garbage)."""
    if not cpu_ops.native.has_dpbf16():
        pytest.skip("built without AVX512-BF16/VNNI")
    k = 8192
    w = torch.ones(64, k)
    w[:, 1::2] = -1.0  # every code at 0 or 255 (asymmetric grid spans [-1, 1])
    w[1::2] *= -1
    q = RTN(8, -1, symmetric=False).quantize(w.bfloat16())
    x = torch.full((2, k), 3.0e4).bfloat16()  # largest |x q| products in every lane
    x[1, 1::2] = -3.0e4
    y = cpu_ops.rtn_gemv(q, x, None, max_rows=cpu_ops.MAX_ROWS)
    exact = x.double() @ q.dequantize(torch.float32).double().t()
    assert ((y.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + 1e-3 * exact.abs().max()).all()

    q = RTN(8, 128).quantize((torch.randn(96, 512) * 0.05).bfloat16())
    x = torch.randn(3, 512)
    x[0, :128] *= torch.logspace(-6, 0, 128)  # one group spanning 2^20
    x[1, 128:256] = 0
    x = x.bfloat16()
    y = cpu_ops.rtn_gemv(q, x, None, max_rows=cpu_ops.MAX_ROWS).double()
    wd = q.dequantize(torch.float32).double()
    exact = x.double() @ wd.t()
    assert ((y - exact).abs() <= 2.0 ** -8 * exact.abs() + 2.0 ** -14 * (x.double().abs() @ wd.abs().t())).all()

    x[2, 300] = float("nan")
    x[0, 5] = float("inf")
    y = cpu_ops.rtn_gemv(q, x, None, max_rows=cpu_ops.MAX_ROWS)
    assert y[2].isnan().all() and y[0].isnan().all() and y[1].isfinite().all()


@pytest.mark.parametrize("cfg", [RTN(8, -1, symmetric=False), RTN(8, 32, grid="signed"), RTN(4, 128),
                                 RTN(4, 32, symmetric=False), RTN(4, 32, grid="iq4nl"), RTN(5, 32, grid="signed"),
                                 RTN(4, 32, grid="iq4nl", double_quant=True),
                                 RTN(3, 16, grid="nl3", double_quant=True), RTN(2, 16, grid="nl2", double_quant=True)],
                         ids=lambda c: c.label())
def test_one_call_linear_activation_edge_cases(cfg):
    """The decode linear's activation forms (bf16 on AVX512-BF16; int16 per 32 elements on AVX2, run by test_isa):
    the largest products in every lane over a long row (no integer overflow), a chunk spanning 2^20, an all-zero
    chunk, and NaN/Inf activations (non-finite out for that row, not garbage)."""
    from moeq import native
    from moeq.nn import QuantLinear

    if not native.has_simd():
        pytest.skip("needs a SIMD build (AVX512-BF16 or AVX2)")
    k = 4096
    w = torch.ones(64, k)
    w[:, 1::2] = -1.0
    w[1::2] *= -1
    mod = QuantLinear(cfg.quantize(w.bfloat16()))
    x = torch.full((2, k), 3.0e4).bfloat16()
    x[1, 1::2] = -3.0e4
    y = cpu_ops.quant_linear_bf16(mod, x)
    assert y is not None
    exact = x.double() @ mod.qweight.dequantize(torch.float32).double().t()
    assert ((y.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + 1e-3 * exact.abs().max()).all()

    torch.manual_seed(0)
    mod = QuantLinear(cfg.quantize((torch.randn(96, 512) * 0.05).bfloat16()))
    x = torch.randn(3, 512)
    x[0, :128] *= torch.logspace(-6, 0, 128)
    x[1, 128:256] = 0
    x = x.bfloat16()
    y = cpu_ops.quant_linear_bf16(mod, x).double()
    wd = mod.qweight.dequantize(torch.float32).double()
    exact = x.double() @ wd.t()
    assert ((y - exact).abs() <= 2.0 ** -8 * exact.abs() + 2.0 ** -14 * (x.double().abs() @ wd.abs().t())).all()
    x[2, 300] = float("nan")
    x[0, 5] = float("inf")
    y = cpu_ops.quant_linear_bf16(mod, x)  # NaN, or +-inf where the exact result is (codebooks have no zero value)
    assert y[2].isnan().all() and not y[0].isfinite().any() and y[1].isfinite().all()


@pytest.mark.parametrize("fast", [True, False])
def test_many_row_matmuls_of_bf16_models_run_in_fp32_without_bf16_gemm(fast, monkeypatch):
    """On CPUs without native bf16 GEMM (AVX2-only: torch's bf16 matmul ~5x slower than fp32), a bf16 model's
    prompt-sized matmuls — quantized linears and the experts' per-expert loop — dequantize to fp32 and round the
    product to bf16 once: the exact products' fp32 sum, rounded (what a bf16 GEMM with fp32 accumulation computes)."""
    from moeq import native
    from moeq.kernels import matmul_dtype
    from moeq.nn import Activation, QuantExperts

    monkeypatch.setattr(native, "fast_bf16_matmul", lambda: fast)
    assert matmul_dtype(torch.bfloat16, torch.device("cpu")) == (torch.bfloat16 if fast else torch.float32)
    assert matmul_dtype(torch.float32, torch.device("cpu")) == torch.float32
    torch.manual_seed(0)
    w = RTN(4, 32).quantize(torch.randn(256, 512).bfloat16())
    x, bias = torch.randn(40, 512).bfloat16(), torch.randn(256).bfloat16()
    y = reference(w, x, bias)
    exact = (x.float() @ w.dequantize(torch.float32).t() + bias.float())
    assert y.dtype == torch.bfloat16
    if not fast:
        assert torch.equal(y, exact.bfloat16())
    assert (y.float() - exact).abs().max() <= 2 ** -7 * exact.abs().max()
    e, h, i = 4, 128, 64
    mod = QuantExperts(RTN(4, 32).quantize(torch.randn(e, 2 * i, h).bfloat16() * 0.1),
                       RTN(4, 32).quantize(torch.randn(e, h, i).bfloat16() * 0.1), Activation())
    t = 40  # more rows per expert than the decode kernels take: the dequantize + matmul loop
    xs, idx, wts = torch.randn(t, h).bfloat16(), torch.randint(0, e, (t, 2)), torch.rand(t, 2).bfloat16()
    got = mod(xs, idx, wts).float()
    d13, d2 = mod.w13.dequantize(torch.float32), mod.w2.dequantize(torch.float32)
    want = torch.zeros(t, h)
    for r in range(t):
        for j in range(2):
            hh = (d13[idx[r, j]] @ xs[r].float()).bfloat16().float()
            a = (torch.nn.functional.silu(hh[:i]) * hh[i:]).bfloat16().float()
            want[r] += wts[r, j].float() * (d2[idx[r, j]] @ a).bfloat16().float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
