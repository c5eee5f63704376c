"""The Triton GPU kernels, run on CPU tensors by Triton's interpreter (``TRITON_INTERPRET=1``, set in conftest when
no GPU is present) and compared with the plain-torch reference; on a GPU the same tests run on the device.
Activations are fp32/fp16: the interpreter's bf16 ``tl.dot`` is wrong."""
import pytest
import torch

import moeq
from moeq.formats import bnb4, int8, rtn
from tests.kernels.reference import reference_moe

triton = pytest.importorskip("triton")
from moeq.kernels import gpu  # noqa: E402
from moeq.kernels import triton_moe as tm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4 if DEV == "cpu" else 1e-2  # a GPU's fp32 tl.dot runs in tf32
FORMATS = {
    "rtn4-g32": lambda w: rtn.quantize(w, 4, 32),
    "rtn4-asym-g64": lambda w: rtn.quantize(w, 4, 64, symmetric=False),
    "rtn4-signed-row": lambda w: rtn.quantize(w, 4, -1, grid="signed"),
    "rtn8-g128": lambda w: rtn.quantize(w, 8, 128),
    "rtn8-asym-g32": lambda w: rtn.quantize(w, 8, 32, symmetric=False),
    "nf4-b64-dq": lambda w: bnb4.quantize(w, "nf4", 64, True),
    "fp4-b32": lambda w: bnb4.quantize(w, "fp4", 32, False),
    "llm-int8": lambda w: int8.quantize(w),
    "q4_0": lambda w: rtn.quantize(w, 4, 32, grid="signed"),
    "iq4nl-g32": lambda w: rtn.quantize(w, 4, 32, grid="iq4nl"),
    "iq4nl-dq-g32": lambda w: rtn.quantize(w, 4, 32, grid="iq4nl", double_quant=True),
    "mxfp4": lambda w: rtn.quantize(w, 4, 32, grid="mxfp4"),
}


def problem(seed=0, e=6, h=128, i=128, t=7, a=2):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) * 0.05).bfloat16()
    x = torch.randn(t, h, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:a] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, a, generator=g), -1)
    return w13, w2, x, idx, wts


@pytest.mark.parametrize("kernel", ["gemm", "gemv", "gemv-per-weight"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_moe_matches_reference(fmt, kernel):
    """Both kernels (the grouped GEMM for prompts, the per-pair GEMV for decode — its per-group sums and its
    per-weight-scale branch) on every format the layout takes."""
    w13, w2, x, idx, wts = problem()
    q13, q2 = FORMATS[fmt](w13), FORMATS[fmt](w2)
    l13, l2 = (tm.kernel_layout(q.to(DEV)) for q in (q13, q2))
    assert l13 is not None and l2 is not None, fmt
    configs = {**tm.CONFIGS, "gemv": {**tm.CONFIGS["gemv"], "per_group": kernel == "gemv"}}
    y = tm.fused_moe(x.to(DEV), l13, l2, idx.to(DEV), wts.to(DEV), kernel=kernel.split("-")[0], configs=configs).cpu()
    silu_glu = lambda g, u: torch.nn.functional.silu(g) * u  # noqa: E731
    ref = reference_moe(q13.dequantize(torch.float32), q2.dequantize(torch.float32), x, idx, wts, silu_glu)
    assert (y - ref).abs().max() < TOL * max(1.0, ref.abs().max().item())
    assert y.abs().max() > 0.05  # not trivially zero


@pytest.mark.parametrize("tokens,top_k", [(1, 1), (3, 4), (40, 2), (9, 4)])
def test_fused_moe_routing_shapes_and_empty_experts(tokens, top_k):
    """Decode- and prefill-sized batches; experts without tokens get no blocks; several BLOCK_M choices."""
    w13, w2, x, idx, wts = problem(seed=tokens, e=8, t=tokens, a=top_k)
    idx = idx % 5  # experts 5..7 never routed
    idx = torch.stack([torch.unique(r)[:top_k] if len(torch.unique(r)) >= top_k else r for r in idx])
    q13, q2 = rtn.quantize(w13, 4, 32), rtn.quantize(w2, 4, 32)
    y = tm.fused_moe(x.to(DEV), tm.kernel_layout(q13.to(DEV)), tm.kernel_layout(q2.to(DEV)), idx.to(DEV),
                     wts.to(DEV)).cpu()
    ref = reference_moe(q13.dequantize(torch.float32), q2.dequantize(torch.float32), x, idx, wts,
                        lambda g, u: torch.nn.functional.silu(g) * u)
    assert (y - ref).abs().max() < TOL * max(1.0, ref.abs().max().item())


def test_align_pairs_sorts_and_pads_by_expert():
    idx = torch.tensor([[3, 0], [3, 1], [0, 3]])
    sorted_ids, expert_ids = tm.align_pairs(idx, 5, 4)
    pairs = idx.reshape(-1)
    blocks = sorted_ids.view(-1, 4)
    for b, e in enumerate(expert_ids.tolist()):
        real = [p for p in blocks[b].tolist() if p < pairs.numel()]
        if e < 0:
            assert not real
        else:
            assert all(pairs[p] == e for p in real)
    got = sorted(p for p in sorted_ids.tolist() if p < pairs.numel())
    assert got == list(range(pairs.numel()))  # every pair exactly once
    assert set(expert_ids.tolist()) - {-1} == {0, 1, 3}  # no block for experts 2 and 4


@pytest.mark.parametrize("rows", [(3, 5), (2,)])  # 15 rows: grouped GEMM; 2: the decode GEMV
@pytest.mark.parametrize("fmt", ["rtn4-g32", "rtn4-asym-g64", "nf4-b64-dq", "llm-int8", "rtn8-g128", "iq4nl-g32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_matches_reference(fmt, dtype, rows):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(80, 256, generator=g) * 0.05).bfloat16()
    q = FORMATS[fmt](w)
    x = torch.randn(*rows, 256, generator=g).to(dtype)
    bias = torch.randn(80, generator=g).to(dtype)
    y = tm.linear(x.to(DEV), tm.kernel_layout(q.to(DEV)), bias.to(DEV)).cpu()
    ref = x.float() @ q.dequantize(torch.float32).T + bias.float()
    tol = TOL if dtype == torch.float32 else 2e-2
    assert y.dtype == dtype and (y.float() - ref).abs().max() < tol * ref.abs().max()


def test_module_paths_match_cpu_forward(tiny_ckpt):
    """QuantExperts/QuantLinear GPU entry points (layouts cached per module) equal the CPU forward; activations
    other than SiLU-GLU (gpt-oss' clamped swiglu, with expert biases) and Llama 4's weight-on-input too."""
    for model_type, method in (("qwen3_moe", "rtn-int4-asym"), ("mixtral", "nf4"), ("gpt_oss", "rtn-int8"),
                               ("llama4_text", "rtn-int4")):
        m = moeq.load(tiny_ckpt(model_type), quant=method, progress=False, dtype=torch.float32)
        ex = next(mod for mod in m.modules() if isinstance(mod, moeq.nn.QuantExperts))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(9, ex.hidden_dim, generator=g)
        a = 1 if ex.weight_on_input else 2
        idx = torch.stack([torch.randperm(ex.num_experts, generator=g)[:a] for _ in range(9)])
        wts = torch.rand(9, a, generator=g)
        want = ex(x, idx, wts)
        ex.to(DEV)
        got = gpu.experts_forward(ex, x.to(DEV), idx.to(DEV), wts.to(DEV)).cpu()
        assert (got - want).abs().max() < TOL * max(1.0, want.abs().max().item()), model_type
        assert len(ex._kernel_layouts) == 2
        gpu.experts_forward(ex, x.to(DEV), idx.to(DEV), wts.to(DEV))
        assert len(ex._kernel_layouts) == 2  # built once, reused
        lin = next(mod for mod in m.modules() if isinstance(mod, moeq.nn.QuantLinear))
        xl = torch.randn(4, lin.in_features, generator=g)
        want = lin(xl)
        lin.to(DEV)
        assert (gpu.linear_forward(lin, xl.to(DEV)).cpu() - want).abs().max() < TOL * max(1.0, want.abs().max())


def test_unsupported_layout_falls_back():
    w = (torch.randn(64, 128) * 0.05).bfloat16()
    assert tm.kernel_layout(rtn.quantize(w, 3, 64, symmetric=False)) is None  # 3-bit: dequantize path instead
    assert tm.kernel_layout(rtn.quantize(w, 2, 32, symmetric=False)) is None
    assert tm.kernel_layout(rtn.quantize(w, 3, 32, grid="nl3")) is None  # 3-bit codebook


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised on machines without a GPU")
def test_device_errors(tiny_ckpt):
    with pytest.raises(ValueError, match=r"device 'cuda': no GPU is usable here"):
        moeq.load(tiny_ckpt("mixtral"), quant="rtn-int4", device="cuda", progress=False)
    with pytest.raises(ValueError, match=r"device 'tpu' is not supported; use 'cpu' or 'cuda'"):
        moeq.load(tiny_ckpt("mixtral"), quant="rtn-int4", device="tpu", progress=False)
    m = moeq.load(tiny_ckpt("mixtral"), quant="rtn-int4", device="cpu", progress=False)
    assert next(m.parameters()).device.type == "cpu"


def test_linear_k_tail_and_odd_rows():
    """K not a multiple of BLOCK_K (160 = 2.5 tiles) and N not a multiple of BLOCK_N."""
    g = torch.Generator().manual_seed(2)
    q = rtn.quantize((torch.randn(70, 160, generator=g) * 0.05).bfloat16(), 4, 32, symmetric=False)
    x = torch.randn(33, 160, generator=g)
    y = tm.linear(x.to(DEV), tm.kernel_layout(q.to(DEV))).cpu()
    ref = x @ q.dequantize(torch.float32).T
    assert (y - ref).abs().max() < TOL * ref.abs().max()


@pytest.mark.parametrize("rows", [2, 33])
def test_linear_group_not_a_power_of_two(rows):
    """Group 48 neither divides nor spans a K tile: the GEMV takes its per-weight-scale branch, the GEMM its tiles."""
    g = torch.Generator().manual_seed(3)
    q = rtn.quantize((torch.randn(40, 192, generator=g) * 0.05).bfloat16(), 4, 48, symmetric=False)
    assert tm.tile_group(48, 192, 64) == 0
    x = torch.randn(rows, 192, generator=g)
    y = tm.linear(x.to(DEV), tm.kernel_layout(q.to(DEV))).cpu()
    ref = x @ q.dequantize(torch.float32).T
    assert (y - ref).abs().max() < TOL * ref.abs().max()


def test_tile_group():
    assert tm.tile_group(32, 2048, 128) == 32  # four groups per tile
    assert tm.tile_group(128, 2048, 128) == 128
    assert tm.tile_group(2048, 2048, 512) == 512  # per-row scale: the whole tile shares it
    assert tm.tile_group(768, 768, 512) == 512  # one group per row, K not a multiple of the tile
    assert tm.tile_group(1024, 4096, 512) == 512  # a group spans two tiles
    assert tm.tile_group(96, 768, 64) == 0
