"""MXFP4: moeq's ``mxfp4`` grid (OCP MX E2M1 codes, a power-of-two scale per 32) — quantized as llama.cpp's own
reference rounds it, dequantized as gguf-py decodes it — and gpt-oss MXFP4 checkpoints (written by
moeq.tiny.make_mxfp4_checkpoint after gpt-oss' published layout) loaded into it exactly as stored: bit for bit the
weights transformers' own MXFP4 dequantization gives."""
from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Mxfp4Config

import moeq
from moeq.config import METHODS
from moeq.export.gguf import ggml_blocks
from moeq.formats import RTNWeight
from moeq.formats.codebooks import MXFP4
from moeq.formats.packing import pack
from moeq.nn import QuantLinear
from moeq.tiny import make_mxfp4_checkpoint


@pytest.mark.parametrize("shape", [(64, 256), (3, 48, 96)])
def test_mxfp4_matches_llama_cpp_reference(shape):
    w = (torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16()
    w.view(-1)[:32] = 0  # an all-zero group
    q = METHODS["mxfp4"].quantize(w, "w")
    flat = w.float().reshape(-1, shape[-1]).numpy()
    ref_bytes = gguf.quants.quantize(flat, gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(ggml_blocks(q).reshape(ref_bytes.shape).numpy(), ref_bytes)  # same codes and exponents
    ref = gguf.quants.dequantize(ref_bytes, gguf.GGMLQuantizationType.MXFP4).reshape(shape)
    assert np.array_equal(q.dequantize(torch.float32).numpy(), ref)
    assert np.array_equal(q.dequantize_reference(torch.float32).numpy(), ref)
    assert q.bits_per_weight == 4.25 and q.scale.dtype == torch.uint8  # E8M0 bytes, as llama.cpp's MXFP4 blocks


def test_mxfp4_scales_must_be_e8m0():
    q = METHODS["mxfp4"].quantize(torch.randn(16, 64).bfloat16() * 0.1, "w")
    bad = RTNWeight(qdata=q.qdata, scale=q.group_scales() * 1.5, zero=None, bits=4, group_size=32, grid="mxfp4",
                    shape=q.shape, dtype=q.dtype)
    with pytest.raises(moeq.MoeqError, match="powers of two"):
        bad.validate("w")
    nan = q.scale.clone()
    nan[3, 1] = 255  # E8M0's NaN
    with pytest.raises(moeq.MoeqError, match="255"):
        dataclasses.replace(q, scale=nan).validate("w")
    with pytest.raises(moeq.MoeqError, match="scale"):  # exponent bytes are for the E8M0 grid only
        dataclasses.replace(q, grid="iq4nl").validate("w")


def test_every_e8m0_byte_decodes_exactly():
    """Every exponent an fp32 weight can hold, 0..252 (2^-128 .. 2^124; the two smallest are fp32 subnormals; 253
    and 254 overflow times the table's 12 and are refused), through the native dequantizer and the torch reference,
    against 2^(e - 128) computed in float64; a saved bf16 power-of-two scale (moeq checkpoints before the bytes)
    gives the same weights."""
    e = torch.arange(253, dtype=torch.uint8)
    k = 253 * 32
    codes = torch.randint(0, 16, (1, k), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    q = RTNWeight(qdata=pack(codes, 4), scale=e[None], zero=None, bits=4, group_size=32, grid="mxfp4", shape=(1, k),
                  dtype=torch.float32).validate("w")
    want = (torch.tensor(MXFP4, dtype=torch.float64)[codes.long()].reshape(253, 32)
            * torch.pow(2.0, e.double() - 128)[:, None]).reshape(1, k)
    assert torch.equal(q.group_scales().double(), torch.pow(2.0, e.double() - 128)[None])
    assert torch.equal(q.dequantize(torch.float32).double(), want)
    assert torch.equal(q.dequantize_reference(torch.float32).double(), want)
    legacy = dataclasses.replace(q, scale=q.group_scales().to(torch.bfloat16)).validate("w")
    assert legacy.scale_kind == 1 and torch.equal(legacy.dequantize(torch.float32), q.dequantize(torch.float32))


@pytest.mark.parametrize("rows", [1, 3, 8, 20])
def test_e8m0_bytes_through_every_linear_path(rows):
    """A linear whose groups span exponents 2^-32 .. 2^30 (the vector loads' lanes each hold another byte): the
    native forward (E8M0 bytes) equals the same weight with bf16 scales (the kernels' other scale kind) and the
    float64 product."""
    g = torch.Generator().manual_seed(rows)
    n, k = 64, 512
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    e = torch.randint(96, 159, (n, k // 32), generator=g, dtype=torch.uint8)
    q = RTNWeight(qdata=pack(codes, 4), scale=e, zero=None, bits=4, group_size=32, grid="mxfp4", shape=(n, k),
                  dtype=torch.bfloat16).validate("w")
    legacy = dataclasses.replace(q, scale=q.group_scales().to(torch.bfloat16))
    x = torch.randn(rows, k, generator=g).bfloat16()
    ref = x.double() @ q.dequantize_reference(torch.float64).t()
    with torch.no_grad():
        y, y_legacy = QuantLinear(q)(x), QuantLinear(legacy)(x)
    assert torch.equal(y, y_legacy)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 0.01, err


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    return make_mxfp4_checkpoint(tmp_path_factory.mktemp("gptoss") / "c")


def _reference(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                quantization_config=Mxfp4Config(dequantize=True)).eval()


def test_gpt_oss_mxfp4_loads_exactly(gptoss):
    m = moeq.load(gptoss, progress=False)
    ref = _reference(gptoss)
    for layer, rl in zip(m.model.layers, ref.model.layers):
        me, re_ = layer.mlp.experts, rl.mlp.experts
        assert me.w13.grid == "mxfp4" and me.w13.qdata.shape[-1] == me.hidden_dim // 2  # as stored: 4 bits/weight
        d13 = me.w13.dequantize(torch.bfloat16)
        i = me.intermediate_dim
        assert torch.equal(d13[:, :i], re_.gate_up_proj.data[..., 0::2].transpose(1, 2))  # gate: even columns
        assert torch.equal(d13[:, i:], re_.gate_up_proj.data[..., 1::2].transpose(1, 2))
        assert torch.equal(me.w2.dequantize(torch.bfloat16), re_.down_proj.data.transpose(1, 2))
        assert torch.equal(me.b13[:, :i], re_.gate_up_proj_bias.data[:, 0::2])
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        a, b = m(ids).logits.float(), ref(ids).logits.float()
    assert ((a - b).norm() / b.norm()).item() < 0.02  # the same weights; bf16 rounding of two expert forwards
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))


def test_gpt_oss_mxfp4_save_reload_and_requantize(gptoss, tmp_path):
    m = moeq.load(gptoss, progress=False)
    moeq.save(m, tmp_path / "s", source=gptoss)
    r = moeq.load(tmp_path / "s", progress=False)
    assert all(torch.equal(v, r.state_dict()[k]) for k, v in m.state_dict().items())
    q = moeq.load(gptoss, "q4_0", progress=False)  # experts: mxfp4 -> dequantized -> q4_0 in flight
    for layer, ml in zip(q.model.layers, m.model.layers):
        assert layer.mlp.experts.w13.grid == "signed"
        want = METHODS["q4_0"].quantize(ml.mlp.experts.w13.dequantize(torch.bfloat16), "w13")
        assert torch.equal(layer.mlp.experts.w13.qdata, want.qdata) and torch.equal(layer.mlp.experts.w13.scale,
                                                                                      want.scale)
        assert layer.self_attn.q_proj.qweight.grid == "signed"  # the bf16 linears quantized with the method too


@pytest.mark.parametrize("case,words", [("nan exponent", "255"), ("blocks shape", "expected"),
                                        ("scales dtype", "uint8"), ("no scales", "has no")])
def test_hostile_mxfp4_is_refused(gptoss, tmp_path, case, words):
    import shutil

    out = tmp_path / "c"
    shutil.copytree(gptoss, out)
    f = out / "model.safetensors"
    sd = load_file(str(f))
    key = next(k for k in sd if k.endswith("gate_up_proj_blocks"))
    skey = key.replace("_blocks", "_scales")
    if case == "nan exponent":
        sd[skey].view(-1)[3] = 255
    elif case == "blocks shape":
        sd[key] = sd[key][..., :8].contiguous()
    elif case == "scales dtype":
        sd[skey] = sd[skey].float()
    else:
        del sd[skey]
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(moeq.MoeqError, match=words):
        moeq.load(out, progress=False)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"


def test_inspect_names_the_source(gptoss, capsys):
    from moeq.cli import main

    assert main(["inspect", str(gptoss), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"]["reader"] == "mxfp4" and out["source"]["mxfp4_stacks"] == 4
    assert any(r["format"] == "rtn" and r["detail"].get("grid") == "mxfp4" for r in out["modules"])
