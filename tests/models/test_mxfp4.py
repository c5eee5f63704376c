"""MXFP4: moeq's ``mxfp4`` grid (OCP MX E2M1 codes, a power-of-two scale per 32) — quantized as llama.cpp's own
reference rounds it, dequantized as gguf-py decodes it — and gpt-oss MXFP4 checkpoints (written by
moeq.tiny.make_mxfp4_checkpoint after gpt-oss' published layout) loaded into it exactly as stored: bit for bit the
weights transformers' own MXFP4 dequantization gives."""
from __future__ import annotations

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
    assert q.bits_per_weight == 4.5


def test_mxfp4_scales_must_be_e8m0():
    q = METHODS["mxfp4"].quantize(torch.randn(16, 64).bfloat16() * 0.1, "w")
    bad = RTNWeight(qdata=q.qdata, scale=q.scale * 1.5, zero=None, bits=4, group_size=32, grid="mxfp4",
                    shape=q.shape, dtype=q.dtype)
    with pytest.raises(moeq.MoeqError, match="powers of two"):
        bad.validate("w")


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
