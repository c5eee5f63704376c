"""The ``activations="int8"`` decode option (moeq/native/csrc/i8.c): activations quantized per block of 32 to int8
(llama.cpp's Q8_0 numerics) against the weights' 4-bit codes in integer dot products. Checked against an emulation
of exactly those numerics in float64 (equal after the output's bf16 rounding), against the default path (close, not
equal), through the fused MoE layer, the one-call linear and a whole model's decode; formats outside the kernels keep
the default numerics, with a warning."""
import logging

import pytest
import torch

import moeq
from moeq import native
from moeq.config import BNB4, RTN
from moeq.kernels import cpu_ops, describe, moe_cpu, plans

pytestmark = pytest.mark.skipif(not native.has_i8_dot(), reason="the int8-activation kernels need an AVX2 build")

INT8_CFGS = [RTN(4, 32, grid="signed"), RTN(4, 32), RTN(4, 64), RTN(4, 128), RTN(4, 32, grid="iq4nl", search=2),
             RTN(4, 32, grid="iq4nl", search=2, double_quant=True), RTN(4, 32, grid="mxfp4")]
VNNI = native.i8_level() >= 2  # AVX512-VNNI builds also take 8-bit symmetric weights (Q8_0)
if VNNI:
    INT8_CFGS += [RTN(8, 32, grid="signed"), RTN(8, 32), RTN(8, 128)]


def q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of 32: d = amax / 127, q = rint(x / d) (llama.cpp's quantize_row_q8_0, d kept in fp32)."""
    xb = x.float().reshape(*x.shape[:-1], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round((xb * inv).clamp(-127, 127)), d


def emulate(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [m, K] @ w [N, K]^T with x through q8, in float64."""
    q, d = q8(x)
    wb = w.double().reshape(w.shape[0], -1, 32)
    return torch.einsum("mbk,nbk,mb->mn", q.double(), wb, d[..., 0].double())


def _linear(cfg, n: int, k: int, seed: int = 0):
    from moeq.nn import QuantLinear

    torch.manual_seed(seed)
    return QuantLinear(cfg.quantize((torch.randn(n, k) * 0.05).bfloat16()))


# rows ending in part of a chunk (64 elements on AVX2, 128 on AVX512-VNNI): 544, 576, 608 leave 32, 64, 96
@pytest.mark.parametrize("cfg,k", [(c, 512) for c in INT8_CFGS] + [(c, k) for c in INT8_CFGS if c.group_size == 32
                                                                   for k in (544, 576, 608)]
                         + [(RTN(4, 64), 576), (RTN(4, 192), 576)],
                         ids=lambda v: v.label() if hasattr(v, "label") else str(v))
@pytest.mark.parametrize("m", [1, 2, 4])
def test_linear_equals_the_int8_numerics(cfg, k, m):
    mod = _linear(cfg, 96, k, seed=m)
    x = torch.randn(m, k).bfloat16()
    default = mod(x).float()
    mod.activations = "int8"
    y = mod(x).float()
    assert plans.linear_plan(mod).stack.act_i8 == 1
    want = emulate(mod.qweight.dequantize(torch.float32), x).float()
    # equal up to the fp32 summation order: at most one bf16 rounding apart, nearly everywhere bit-equal
    assert ((y - want).abs() <= want.abs() * 2 ** -7 + 1e-6).all()
    assert (y == want.bfloat16().float()).float().mean() > 0.97
    assert not torch.equal(y, default)  # the option changes the numerics: int8, not bf16, activations
    assert (y - default).abs().max() < 0.03 * default.abs().max()
    mod.activations = "default"
    assert torch.equal(mod(x).float(), default)  # and switching back rebuilds the plan


@pytest.mark.skipif(not VNNI, reason="8-bit weights take int8 activations on AVX512-VNNI builds")
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [512, 576, 2048])  # 576: a partial last step of the scales (18 blocks)
def test_q8_0_four_rows_equal_the_int8_numerics(scale_dtype, k):
    """Four sequences through an 8-bit weight with groups of 32 (the 4-row kernel, which reduces the rows' sums before
    converting them), described directly with bf16 or fp32 scales: llama.cpp's numerics, as one row at a time."""
    import ctypes

    g = torch.Generator().manual_seed(k)
    n = 80
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).to(scale_dtype)
    w = (codes.float() - 128).reshape(n, -1, 32) * scale.float()[..., None]
    ws = native.WStack(fmt=0, q=codes.data_ptr(), scale=scale.data_ptr(), scale_bf16=int(scale_dtype == torch.bfloat16),
                       bits=8, gs=32, spe=1, N=n, K=k, act_i8=1, dot_bf16=1)
    L = native.lib()

    def run(x):
        y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        scratch = torch.empty(8 * (k + n) * 4 + n * k // 32 + 4096)
        L.moeq_quant_linear_bf16(ctypes.byref(ws), x.data_ptr(), x.shape[0], None, y.data_ptr(), scratch.data_ptr())
        return y.float()

    x = (torch.randn(4, k, generator=g) * torch.linspace(0.1, 4, 4)[:, None]).bfloat16()
    x[2, :32] = 0  # an all-zero block: d = 0
    y = run(x)
    want = emulate(w.reshape(n, k), x).float()
    assert ((y - want).abs() <= want.abs() * 2 ** -7 + 1e-6).all()
    assert (y == want.bfloat16().float()).float().mean() > 0.97
    rows = torch.cat([run(x[i:i + 1].contiguous()) for i in range(4)])
    assert ((y - rows).abs() <= rows.abs() * 2 ** -7 + 1e-6).all()


def test_weight_and_activation_edge_values():
    """Zero, tiny (subnormal block scales), huge and NaN activations: the int8 rows follow the emulation; a NaN or
    infinite activation falls back to the default path, which carries it through."""
    mod = _linear(RTN(4, 32, grid="signed"), 64, 256)
    mod.activations = "int8"
    w = mod.qweight.dequantize(torch.float32)
    x = torch.randn(3, 256)
    x[0, :32] = 0  # an all-zero block
    x[1, 32:64] = 1e-38  # its scale is subnormal: 1/d overflows
    x[2, 64:96] = 3e38
    x = x.bfloat16()
    y = mod(x).float()
    want = emulate(w, x).float()
    noise = 1e-5 * emulate(w.abs(), x.abs()).float()  # fp32 sums of terms up to 1e38 cancel only to their ulps
    assert torch.isfinite(y).all() and ((y - want).abs() <= want.abs() * 2 ** -7 + noise).all()
    x[1, 5] = float("nan")
    y = mod(x[1:2]).float()
    mod.activations = "default"
    assert torch.isnan(y).all() and torch.isnan(mod(x[1:2]).float()).all()


@pytest.mark.parametrize("cfg", [RTN(4, 32, grid="signed"), RTN(4, 128), RTN(4, 32, grid="iq4nl", search=2)],
                         ids=lambda c: c.label())
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp32: fp32 scales
def test_moe_layer_equals_the_int8_numerics(cfg, t, dtype):
    from moeq.nn import Activation, QuantExperts

    torch.manual_seed(t)
    e, h, i, a = 8, 256, 160, 3
    mod = QuantExperts(cfg.quantize((torch.randn(e, 2 * i, h) * 0.05).to(dtype)),
                       cfg.quantize((torch.randn(e, h, i) * 0.05).to(dtype)), Activation())
    mod.activations = "int8"
    x = torch.randn(t, h).to(dtype)
    idx = torch.stack([torch.randperm(e)[:a] for _ in range(t)])
    wts = torch.rand(t, a).to(dtype)
    plan = plans.experts_plan(mod, dtype == torch.bfloat16)
    assert plan.w13.act_i8 == 1 and plan.w2.act_i8 == 1
    y = mod(x, idx, wts).float()
    d13, d2 = mod.w13.dequantize(torch.float32), mod.w2.dequantize(torch.float32)
    want = torch.zeros(t, h, dtype=torch.float64)
    for r in range(t):
        for j in range(a):
            hh = emulate(d13[idx[r, j]], x[r:r + 1])[0]
            act = torch.nn.functional.silu(hh[:i]) * hh[i:]
            want[r] += wts[r, j].double() * emulate(d2[idx[r, j]], act.float()[None])[0]
    # the intermediate is fp32 in the kernel, float64 here: a rounding may land a code one step apart; bf16 models
    # round the layer's output once more
    assert (y - want.float()).abs().max() < (2e-3 if dtype == torch.float32 else 2e-3 + 2 ** -8) * want.abs().max()
    mod.activations = "default"
    default = mod(x, idx, wts).float()
    assert not torch.equal(y, default) and (y - default).abs().max() < 0.03 * default.abs().max()


def test_formats_outside_the_kernels_keep_the_default_numerics(caplog):
    """Asymmetric RTN, NF4, 3-bit and 8-bit asymmetric (and, on AVX2 builds, 8-bit) weights: ``takes_int8`` says no,
    the plan keeps act_i8 off, outputs equal the default path's, and set_activations names those modules in a
    warning."""
    from torch import nn

    cfgs = [RTN(4, 32, symmetric=False), RTN(8, 32, symmetric=False), BNB4("nf4", 64, False), RTN(3, 32, grid="nl3")]
    cfgs += [] if VNNI else [RTN(8, 32)]
    mods = [_linear(c, 64, 256, seed=j) for j, c in enumerate(cfgs)]
    x = torch.randn(1, 256).bfloat16()
    before = [m(x) for m in mods]
    model = nn.Sequential(*mods, _linear(RTN(4, 32, grid="signed"), 64, 256))
    with caplog.at_level(logging.WARNING, logger="moeq.api"):
        taken = moeq.set_activations(model, "int8")
    assert taken["int8"] == [str(len(cfgs))] and taken["default"] == [str(j) for j in range(len(cfgs))]
    assert "keep the default numerics" in caplog.text
    for m, b in zip(mods, before):
        assert not describe.takes_int8(m.qweight) and torch.equal(m(x), b)
    with pytest.raises(moeq.MoeqError, match="activations must be one of"):
        moeq.set_activations(model, "int4")


def test_load_option_decodes_a_model_with_int8_activations(tiny_ckpt):
    """``moeq.load(..., activations="int8")``: a q4_0 model decodes through the int8 kernels (the fused decoder layers
    included); its logits stay close to the default numerics' and differ from them."""
    src = tiny_ckpt("qwen3_moe")
    ids = torch.randint(0, 200, (1, 6))
    runs = {}
    for mode in ("default", "int8"):
        m = moeq.load(src, quant="q4_0", progress=False, activations=mode)
        mods = [mod for mod in m.modules() if hasattr(mod, "activations")]
        assert mods and all(mod.activations == mode for mod in mods)
        out = m.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
        runs[mode] = torch.stack(out.logits).float()
    a, b = runs["default"], runs["int8"]
    assert not torch.equal(a, b)
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert kl.max() < 0.05
    with pytest.raises(moeq.MoeqError, match="activations must be one of"):
        moeq.load(src, progress=False, activations="fp8")


def test_decode_shaped_eval_and_the_cli_option(tiny_ckpt, tmp_path, capsys):
    """``evaluate(..., chunk=N)`` scores the model N tokens per forward over a KV cache: with the default numerics it
    agrees with the full-prompt forward (the same model, other kernels); ``moeq eval --activations int8`` scores that
    way and reports the option, its KL against the reference small but not zero."""
    import json

    from moeq.cli import main
    from moeq.eval import DECODE_CHUNK, evaluate, logits

    src = tiny_ckpt("qwen3_moe")
    m = moeq.load(src, quant="q4_0", progress=False)
    ids = torch.randint(0, 200, (1, 21))
    full, chunked = logits(m, ids).float(), logits(m, ids, DECODE_CHUNK).float()
    assert chunked.shape == full.shape and (chunked - full).abs().max() < 0.05 * full.abs().max()
    ref = moeq.load(src, progress=False)
    stream = torch.randint(0, 200, (200,))
    a, b = evaluate(m, ref, stream, ctx=32, progress=False), evaluate(m, ref, stream, ctx=32, progress=False, chunk=3)
    assert a.tokens == b.tokens and abs(a.mean_kl - b.mean_kl) < 0.2 * a.mean_kl + 1e-4
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 30)
    assert main(["eval", str(src), "--ref", str(src), "--method", "q4_0", "--activations", "int8", "--text",
                 str(text), "--ctx", "48", "--max-tokens", "160", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["activations"] == "int8" and r["chunk"] == DECODE_CHUNK and 0 < r["mean_kl"] < 0.05
    with pytest.raises(SystemExit):  # argparse names the valid choices
        main(["eval", str(src), "--ref", str(src), "--activations", "int4", "--text", str(text)])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
