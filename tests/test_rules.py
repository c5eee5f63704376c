"""Rules in the names users see, a default that fits any model, and rules that cannot silently miss."""
import pytest
import torch

import moeq
from moeq.cli import main


def formats(model) -> dict:
    return {r["module"]: (r["format"], r["detail"]) for r in moeq.inspect(model)["modules"]}


def test_default_group_size_falls_back_per_tensor(tiny_ckpt):
    src = tiny_ckpt("qwen3_moe", hidden_size=96, head_dim=32)  # K=96: 128 does not divide it
    m = moeq.load(src, quant="rtn-int4", progress=False)
    f = formats(m)
    assert f["model.layers.0.mlp.experts.w13"][1]["group_size"] == 32  # largest halving of 128 dividing 96
    assert f["model.layers.0.mlp.experts.w2"][1]["group_size"] == 128  # K = 128 (expert intermediate) divides
    assert torch.isfinite(m(torch.tensor([[1, 2, 3]])).logits).all()
    assert moeq.RTN(4, 128).group_size_for(576) == 64 and moeq.RTN(4, 128).group_size_for(24) == -1


@pytest.mark.parametrize("pattern", ["*.block_sparse_moe.*", "*.block_sparse_moe.experts", "*.experts",
                                     "model.layers.0.block_sparse_moe.experts.0.w1"])
def test_rules_match_checkpoint_names(tiny_ckpt, pattern):
    m = moeq.load(tiny_ckpt("mixtral"), quant=moeq.QuantConfig(moeq.RTN(4, 64), rules={pattern: moeq.RTN(8, 64)}),
                  progress=False)
    assert formats(m)["model.layers.0.mlp.experts.w13"][1]["bits"] == 8


def test_w13_and_w2_separately(tiny_ckpt):
    src = tiny_ckpt("qwen3_moe")
    m = moeq.load(src, quant=moeq.QuantConfig(moeq.NF4(), rules={"*.experts.w2": moeq.RTN(8, 64)}), progress=False)
    f = formats(m)
    assert f["model.layers.1.mlp.experts.w13"][0] == "bnb4" and f["model.layers.1.mlp.experts.w2"][0] == "rtn"
    ref = moeq.load(src, progress=False)
    ids = torch.tensor([[5, 6, 7, 8]])
    out, want = m.generate(ids, max_new_tokens=4, do_sample=False), ref.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == want.shape


def test_mixed_slots_save_and_reload(tiny_ckpt, tmp_path):
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant=moeq.QuantConfig(moeq.NF4(), rules={"*.experts.w2": moeq.RTN(8, 64)}),
                  progress=False)
    moeq.save(m, tmp_path / "q")
    m2 = moeq.load(tmp_path / "q", progress=False)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(m(ids).logits, m2(ids).logits)


def test_unmatched_rule_is_an_error_with_close_names(tiny_ckpt):
    with pytest.raises(moeq.MoeqError, match=r"'\*\.mlp\.expert' matches no module.*close names"):
        moeq.load(tiny_ckpt("qwen3_moe"), quant=moeq.QuantConfig(moeq.RTN(), rules={"*.mlp.expert": moeq.NF4()}),
                  progress=False)
    with pytest.raises(moeq.MoeqError, match="earlier rule"):
        moeq.load(tiny_ckpt("qwen3_moe"), progress=False, quant=moeq.QuantConfig(
            moeq.RTN(4, 64), rules={"*.experts": moeq.NF4(), "*.layers.0.mlp.experts": moeq.RTN(8, 64)}))


def test_rule_on_tied_head_quantizes_it(tiny_ckpt):
    src = tiny_ckpt("qwen3_moe", tie_word_embeddings=True)
    m = moeq.load(src, quant=moeq.QuantConfig(moeq.RTN(4, 64), rules={"lm_head": moeq.RTN(8, 64)}), progress=False)
    assert isinstance(m.lm_head, moeq.nn.QuantLinear)
    emb = m.get_input_embeddings().weight
    assert emb.dtype == torch.bfloat16
    assert (m.lm_head.qweight.dequantize(torch.float32) - emb.float()).abs().max() < 0.02 * emb.float().abs().max()


def test_quantize_api_honours_rules_and_arch_keep(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_ckpt("qwen3_moe"), dtype=torch.bfloat16)
    moeq.quantize_(m, moeq.QuantConfig(moeq.RTN(4, 64), rules={"*.experts.w2": moeq.NF4()}))
    f = formats(m)
    assert f["model.layers.0.mlp.experts.w2"][0] == "bnb4" and f["model.layers.0.mlp.experts.w13"][0] == "rtn"


def test_cli_rule_keeps_its_own_group_size(tiny_ckpt, tmp_path, capsys):
    src = tiny_ckpt("qwen3_moe", hidden_size=96, head_dim=32)
    assert main(["quantize", str(src), str(tmp_path / "a"), "--method", "nf4", "--group-size", "32",
                 "--rule", "model.layers.0.*=rtn-int8", "--rule", "*.experts.w2=rtn-int4:64"]) == 0
    f = formats(moeq.load(tmp_path / "a", progress=False))
    assert f["model.layers.0.self_attn.q_proj.weight"][1]["group_size"] == 32  # rtn-int8's 128 -> 32 (K=96)
    assert f["model.layers.1.self_attn.q_proj.weight"][1]["blocksize"] == 32  # --group-size went to nf4 only
    assert f["model.layers.1.mlp.experts.w2"][1]["group_size"] == 64
    assert main(["quantize", str(src), str(tmp_path / "b"), "--rule", "*.nothing=nf4"]) == 2
    assert "matches no module" in capsys.readouterr().err and not (tmp_path / "b").exists()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_named_mixes(model_type, tiny_ckpt, tmp_path, capsys):
    """A mix (iq4nl-m/-l, q4_0-m) puts k,v (MLA: its kv projections) and, for -l, the experts' down at q8_0; its rules
    may match nothing in a family (no k_proj in MLA) while a user's rule stays strict, and comes first."""
    src = tiny_ckpt(model_type)
    f = formats(moeq.load(src, quant="iq4nl-l", progress=False))
    kv = [n for n in f if n.removesuffix(".weight").endswith(("k_proj", "v_proj", "kv_a_proj_with_mqa", "kv_b_proj"))]
    assert kv and all(f[n][1]["bits"] == 8 and f[n][1]["grid"] == "signed" for n in kv)
    downs = [n for n in f if n.endswith("experts.w2")]
    assert downs and all(f[n][1]["bits"] == 8 for n in downs)
    assert all(f[n][1]["grid"] == "iq4nl" for n in f if n.endswith("experts.w13"))
    f = formats(moeq.load(src, quant="q4_0-m", progress=False))
    assert all(f[n][1]["grid"] == "signed" and f[n][1]["bits"] == 4 for n in f if n.endswith("experts.w2"))
    f = formats(moeq.load(src, quant="q5_0-m", progress=False))  # 2 layers: llama.cpp gives layer 1 more bits
    downs = {n: f[n][1]["bits"] for n in f if n.endswith("experts.w2")}
    assert downs == {n: 8 if ".layers.1." in n else 5 for n in downs} and ".layers.1." in " ".join(downs)
    for name in ("nl3-s", "nl3-m"):  # 3-bit mixes: k,v 8-bit, o (and for -m every expert down) iq4nl-dq
        f = formats(moeq.load(src, quant=name, progress=False))
        assert all(f[n][1]["bits"] == 8 for n in kv)
        four = [n for n in f if n.removesuffix(".weight").endswith("o_proj") or (name == "nl3-m" and n.endswith("w2"))]
        assert four and all(f[n][1]["grid"] == "iq4nl" and f[n][1]["bits"] == 4 for n in four)
        three = [n for n in f if n.endswith("experts.w13") or (name == "nl3-s" and n.endswith("experts.w2"))]
        assert three and all(f[n][1]["grid"] == "nl3" and f[n][1]["bits"] == 3 for n in three)
    f = formats(moeq.load(src, quant="nl2-m", progress=False))  # 2-bit experts, the rest 4-bit, k,v 8-bit
    assert all(f[n][1]["bits"] == 8 for n in kv)
    two = [n for n in f if ".experts." in n]
    assert two and all(f[n][1]["grid"] == "nl2" and f[n][1]["bits"] == 2 for n in two)
    four = [n for n in f if ".experts." not in n and n not in kv and f[n][0] == "rtn"]
    assert four and all(f[n][1]["grid"] == "iq4nl" and f[n][1]["bits"] == 4 for n in four)
    assert main(["quantize", str(src), str(tmp_path / "x"), "--method", "iq4nl-m", "--rule", "*.nonexistent=q8_0"]) == 2
    assert "'*.nonexistent' matches no module" in capsys.readouterr().err and not (tmp_path / "x").exists()
    out = tmp_path / "y"
    assert main(["quantize", str(src), str(out), "--method", "iq4nl-m", "--rule", "*.experts=rtn-int8"]) == 0
    f = formats(moeq.load(out, progress=False))
    assert all(f[n][1]["bits"] == 8 for n in f if ".experts." in n) and all(f[n][1]["bits"] == 8 for n in kv)
