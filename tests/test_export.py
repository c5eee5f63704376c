"""Exports checked by their consumers' own libraries: compressed-tensors decompression and transformers loading,
bitsandbytes decoding and transformers+bitsandbytes loading; moeq reloads bnb exports bit-identically."""
import json

import pytest
import torch
from safetensors import safe_open

import moeq
from moeq.cli import main
from moeq.export import export
from tests.conftest import dequantized_reference

ct = pytest.importorskip("compressed_tensors")


def read_prefix(path, prefix):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


@pytest.mark.parametrize("method,args", [
    (moeq.RTN(4, 128), dict(num_bits=4, symmetric=True, strategy="group", group_size=128)),
    (moeq.RTN(4, 32, symmetric=False), dict(num_bits=4, symmetric=False, strategy="group", group_size=32)),
    (moeq.RTN(8, -1), dict(num_bits=8, symmetric=True, strategy="channel")),
])
def test_compressed_tensors_roundtrip(method, args, tiny_ckpt, tmp_path):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    src = tiny_ckpt("qwen3_moe")
    m = moeq.load(src, quant=method, progress=False)
    out = tmp_path / "ct"
    summary = export(m, out, "compressed-tensors", source=src)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and "lm_head" in qc["ignore"]
    assert "model.layers.0.mlp.gate" in qc["ignore"] and summary["config_groups"] == 1
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(type="int", **args))
    ex = m.model.layers[1].mlp.experts
    for e, kind, rows in ((2, "up_proj", slice(128, 256)), (0, "gate_proj", slice(0, 128))):
        sd = read_prefix(out, f"model.layers.1.mlp.experts.{e}.{kind}.")
        w = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
        assert torch.equal(w.to(torch.bfloat16), ex.w13.dequantize(torch.bfloat16)[e, rows])
    sd = read_prefix(out, "model.layers.0.self_attn.o_proj.")
    w = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
    assert torch.equal(w.to(torch.bfloat16), m.model.layers[0].self_attn.o_proj.qweight.dequantize(torch.bfloat16))


def test_compressed_tensors_loads_in_transformers(tiny_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_ckpt("mixtral")
    m = moeq.load(src, quant="rtn-int4", progress=False)
    export(m, tmp_path / "ct", "compressed-tensors")
    t = AutoModelForCausalLM.from_pretrained(tmp_path / "ct").eval()
    ref = dequantized_reference(m, src, torch.bfloat16)
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = t(ids).logits.float(), ref(ids).logits.float(), m(ids).logits.float()
    assert torch.equal(a, b)  # transformers decompresses exactly moeq's dequantized weights
    assert (a - c).abs().max() < 0.02 * a.abs().max()  # and moeq's own kernels agree within bf16 noise


def test_bnb_export_roundtrip_and_consumers(tiny_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    import bitsandbytes.functional as F

    src = tiny_ckpt("mixtral")
    m = moeq.load(src, quant="nf4", progress=False)
    out = tmp_path / "bnb"
    export(m, out, "bnb", source=src, layout="transformers4")
    m2 = moeq.load(out, progress=False)
    s1, s2 = m.state_dict(), m2.state_dict()
    assert set(s1) == set(s2) and all(torch.equal(s1[k], s2[k]) for k in s1)
    sd = read_prefix(out, "model.layers.1.block_sparse_moe.experts.3.w3.weight")
    qs = F.QuantState.from_dict({k[1:]: v for k, v in sd.items() if k}, device=torch.device("cpu"))
    from tests.formats.test_bnb4 import bnb_reference_dequantize

    theirs = bnb_reference_dequantize(sd[""], qs)
    assert torch.equal(theirs, m.model.layers[1].mlp.experts.w13.dequantize()[3, 128:])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["bnb_4bit_quant_type"] == "nf4" and qc["bnb_4bit_use_double_quant"] is True
    assert "lm_head" in qc["llm_int8_skip_modules"]
    # transformers + bitsandbytes loads the dense part (experts kept bf16 here, which transformers 5 can read)
    dense = moeq.load(src, quant=moeq.QuantConfig(moeq.NF4(), rules={"*.experts": moeq.Keep()}), progress=False)
    export(dense, tmp_path / "dense", "bnb")
    t = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    assert type(t.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    ids = torch.randint(0, 300, (1, 8))
    with torch.no_grad():
        a, b = t(ids).logits.float(), dense(ids).logits.float()
    assert (a - b).abs().max() < 0.03 * b.abs().max()


@pytest.mark.parametrize("family,method", [("mixtral", "nf4"), ("qwen3_moe", "fp4"), ("qwen2_moe", "int8")])
def test_bnb_export_loads_in_transformers5(family, method, tiny_ckpt, tmp_path):
    """The default bnb layout loads with plain from_pretrained on the pinned transformers 5 + bitsandbytes: quantized
    Linears become bitsandbytes modules, experts its fused bf16 params holding moeq's dequantized values."""
    from transformers import AutoModelForCausalLM

    src = tiny_ckpt(family)
    m = moeq.load(src, quant=method, progress=False)
    out = tmp_path / "bnb"
    summary = export(m, out, "bnb", source=src)
    assert summary["layout"] == "transformers5" and summary["experts_dequantized"]
    t = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(t.model.layers[0].self_attn.q_proj).__name__ in ("Linear4bit", "Linear8bitLt")
    ex = m.model.layers[1].mlp.experts
    assert torch.equal(t.model.layers[1].mlp.experts.down_proj, ex.w2.dequantize(torch.bfloat16))
    ids = torch.randint(0, 300, (1, 8))
    with torch.no_grad():
        a, b = t(ids).logits.float(), m(ids).logits.float()
    # same weights, different kernels (bf16 rounding order; a near-tied router can flip): close, not equal
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


def test_export_errors_and_cli(tiny_ckpt, tmp_path, capsys):
    src = tiny_ckpt("qwen2_moe")
    m = moeq.load(src, quant="nf4", progress=False)
    with pytest.raises(ValueError, match=r"bnb4 has no compressed-tensors.*--format bnb"):
        export(m, tmp_path / "x", "compressed-tensors")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match=r"unknown export format 'gguff'; valid"):
        export(m, tmp_path / "x", "gguff")
    r = moeq.load(src, quant="rtn-int4", progress=False)
    with pytest.raises(ValueError, match=r"format 'rtn' has no bitsandbytes layout"):
        export(r, tmp_path / "x", "bnb")
    g = moeq.load(tiny_ckpt("gpt_oss"), quant="nf4", progress=False)
    with pytest.raises(ValueError, match="fused 3-D experts"):
        export(g, tmp_path / "x", "bnb")
    q = tmp_path / "q"
    assert main(["quantize", str(src), str(q), "--method", "rtn-int8"]) == 0
    capsys.readouterr()
    assert main(["export", str(q), str(tmp_path / "ct"), "--format", "compressed-tensors", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["format"] == "compressed-tensors" and summary["tensors"] > 0
    assert (tmp_path / "ct" / "tokenizer.json").exists()
    assert main(["export", str(q), str(tmp_path / "ct"), "--format", "compressed-tensors"]) == 2


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "phimoe"])
def test_compressed_tensors_every_expert_of_each_family(model_type, tiny_ckpt, tmp_path):
    """Every expert projection of every layer decompresses (compressed_tensors' own code) to moeq's values."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from moeq.arch import get_arch
    from moeq.export.common import expert_pieces

    src = tiny_ckpt(model_type)
    m = moeq.load(src, quant=moeq.RTN(4, 32, symmetric=False), progress=False)
    out = tmp_path / "ct"
    export(m, out, "compressed-tensors", source=src)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        type="int", num_bits=4, symmetric=False, strategy="group", group_size=32))
    arch, n = get_arch(m.config), 0
    for name, mod in m.named_modules():
        if isinstance(mod, moeq.nn.QuantExperts):
            for e, kind, w in expert_pieces(mod):
                sd = read_prefix(out, arch.disk_expert_key(name, e, kind) + ".")
                got = PackedQuantizationCompressor.decompress(sd, scheme)["weight"].to(torch.bfloat16)
                assert torch.equal(got, w.dequantize(torch.bfloat16)), (name, e, kind)
                n += 1
    assert n == 3 * 4 * sum(isinstance(x, moeq.nn.QuantExperts) for x in m.modules()) > 0
