"""DeepSeek-V3 / Kimi K2 (MLA) to llama.cpp's ``deepseek2`` graph, checked by its consumers: gguf-py decodes every
tensor to moeq's values (MLA's kv_b split into llama.cpp's absorbed ``attn_k_b``/``attn_v_b``), llama.cpp itself
computes moeq's logits (the sigmoid router with its bias, groups and scale, the leading dense layers, shared
experts, YaRN), and moeq reads the file back to the same logits."""
import numpy as np
import pytest
import torch

import moeq
from moeq.export import export, export_checkpoint
from moeq.tiny import make_fp8_checkpoint

gguf = pytest.importorskip("gguf")
pytest.importorskip("xllamacpp")

from tests.test_gguf_export import assert_llama_cpp_agrees, gguf_types, gguf_values  # noqa: E402
from tests.test_gguf_stream import assert_same_gguf  # noqa: E402

YARN = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                            "mscale_all_dim": 1.0}, "max_position_embeddings": 256}


def mla_parts(m, i):
    """moeq's kv_b_proj of layer i as llama.cpp holds it: (k_b [heads, kv_lora, nope], v_b [heads, v, kv_lora])."""
    cfg, proj = m.config, m.model.layers[i].self_attn.kv_b_proj
    w = proj.qweight.dequantize(torch.float32) if hasattr(proj, "qweight") else proj.weight.float().detach()
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    kv = w.view(heads, nope + v, cfg.kv_lora_rank)
    return kv[:, :nope].transpose(1, 2).numpy(), kv[:, nope:].numpy()


@pytest.mark.parametrize("method,cfg", [
    ("q4_0", {}),
    ("q8_0", {"n_group": 2, "topk_group": 1, **YARN}),  # group-limited routing; YaRN with DeepSeek-V3's mscales
    ("q4_0", {"q_lora_rank": None}),  # DeepSeek-V2-Lite's plain q_proj
    ("none", {}),  # unquantized: kv_b kept, its halves written as stored
])
def test_deepseek_v3_to_llama_cpp(method, cfg, tiny_ckpt, tmp_path):
    src = tiny_ckpt("deepseek_v3", **cfg)
    m = moeq.load(src, quant=method, progress=False, dtype=torch.float32)
    summary = export(m, tmp_path / "g", "gguf", source=src)
    path = tmp_path / "g" / "model.gguf"
    assert summary["arch"] == "deepseek2" and summary["requantized"] == []
    types, got = gguf_types(path), gguf_values(path)
    quant = {"q4_0": "Q4_0", "q8_0": "Q8_0", "none": "F32"}[method]
    assert types["blk.1.ffn_gate_exps.weight"] == types["blk.0.ffn_gate.weight"] == quant  # dense lead layer
    assert types["blk.1.ffn_down_shexp.weight"] == types["blk.1.attn_v_b.weight"] == quant
    assert types["blk.1.attn_k_b.weight"] == types["blk.1.exp_probs_b.bias"] == "F32"
    assert "blk.1.attn_kv_b.weight" not in types and "blk.0.ffn_gate_inp.weight" not in types
    for i in range(m.config.num_hidden_layers):  # gguf-py decodes the split to exactly moeq's kv_b
        k_b, v_b = mla_parts(m, i)
        assert np.array_equal(got[f"blk.{i}.attn_k_b.weight"], k_b) and np.array_equal(
            got[f"blk.{i}.attn_v_b.weight"], v_b)
    bias = m.model.layers[1].mlp.gate.e_score_correction_bias
    assert np.array_equal(got["blk.1.exp_probs_b.bias"], bias.float().numpy())
    exp = m.model.layers[1].mlp.experts
    assert np.array_equal(got["blk.1.ffn_down_exps.weight"], exp.w2.dequantize(torch.float32).numpy()
                          if hasattr(exp, "w2") else exp.down_proj.float().detach().numpy())

    r = gguf.GGUFReader(path)
    field = lambda k: r.fields[k].contents()  # noqa: E731
    c = m.config
    assert field("deepseek2.leading_dense_block_count") == 1 and field("deepseek2.expert_gating_func") == 2
    assert field("deepseek2.attention.key_length_mla") == c.qk_nope_head_dim + c.qk_rope_head_dim
    assert field("deepseek2.attention.kv_lora_rank") == c.kv_lora_rank
    assert field("deepseek2.expert_weights_scale") == pytest.approx(c.routed_scaling_factor)
    assert field("deepseek2.expert_group_count") == (c.n_group or 1)
    if "rope_parameters" in cfg:
        assert field("deepseek2.rope.scaling.type") == "yarn" and field("deepseek2.rope.scaling.factor") == 4.0

    assert_llama_cpp_agrees(path, m, src)
    back = moeq.load(path, progress=False, dtype=torch.float32)  # moeq reads its deepseek2 file back
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, m(ids).logits, rtol=0, atol=1e-5)


def test_yarn_without_llama_cpp_arithmetic_is_refused(tiny_ckpt, tmp_path):
    """transformers' YaRN with mscale != mscale_all_dim scales the rotary part; llama.cpp's deepseek2 cannot: refused,
    naming the parameters, nothing written. The same for pairs rotated as halves (rope_interleave=False)."""
    rope = {**YARN["rope_parameters"], "mscale": 0.707}
    for kw, match in (({"rope_parameters": rope, "max_position_embeddings": 256}, "mscale == mscale_all_dim"),
                      ({"rope_interleave": False}, "rope_interleave=False")):
        src = tiny_ckpt("deepseek_v3", **kw)
        m = moeq.load(src, quant="q4_0", progress=False)
        with pytest.raises(moeq.MoeqError, match=match):
            export(m, tmp_path / "x", "gguf", source=src)
        assert not (tmp_path / "x").exists()


def test_deepseek_fp8_streams_to_gguf(tmp_path):
    """DeepSeek's own FP8 block-scaled checkpoint to a q4_0 GGUF in one streamed pass (no bf16 copy): the same file
    as exporting the loaded model, and llama.cpp runs it."""
    src = make_fp8_checkpoint("deepseek_v3", tmp_path / "fp8", block=(128, 128))
    s = export_checkpoint(src, tmp_path / "s.gguf", "gguf", quant="q4_0")
    assert s["streamed"] and s["requantized"] == [] and s["peak_rss_bytes"] > 0
    m = moeq.load(src, quant="q4_0", progress=False)
    export(m, tmp_path / "m.gguf", "gguf", source=src, check=False)
    assert_same_gguf(tmp_path / "s.gguf", tmp_path / "m.gguf")
    assert gguf_types(tmp_path / "s.gguf")["blk.1.ffn_up_exps.weight"] == "Q4_0"
    assert_llama_cpp_agrees(tmp_path / "s.gguf", m.float(), src)


@pytest.mark.parametrize("method,cfg", [("q4_0", {**YARN, "n_group": 2, "topk_group": 1}), (None, {"q_lora_rank": None})])
def test_foreign_deepseek2_gguf_loads_as_moeqs_own(method, cfg, tiny_ckpt, tmp_path):
    """A deepseek2 file without moeq's keys (what llama.cpp's converter writes): the DeepSeek-V3 config rebuilt from
    llama.cpp's MLA, router and YaRN metadata computes exactly what moeq's own file computes."""
    from tests.models.test_gguf_foreign import strip

    src = tiny_ckpt("deepseek_v3", **cfg)
    export(moeq.load(src, quant=method, progress=False), tmp_path / "ours", "gguf", source=src)
    theirs = strip(tmp_path / "ours" / "model.gguf", tmp_path / "theirs.gguf")
    a = moeq.load(tmp_path / "ours" / "model.gguf", progress=False)
    b = moeq.load(theirs, progress=False)
    for k in ("num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts", "first_k_dense_replace",
              "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group", "moe_intermediate_size"):
        assert getattr(b.config, k) == getattr(a.config, k), k
    assert b.config.rope_parameters["rope_type"] == a.config.rope_parameters["rope_type"]
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
