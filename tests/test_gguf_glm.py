"""GLM-4.5 (``glm4_moe``) to llama.cpp's ``glm4moe`` graph, checked by llama.cpp itself: partial rotary heads,
q/k norms and biases, the sigmoid router with its bias, groups and scale, the leading dense layers and shared
experts; moeq reads the file back, and a converter-written file with its appended multi-token-prediction block."""
import gguf
import numpy as np
import pytest
import torch

import moeq
from moeq.export import export, export_checkpoint
from moeq.tiny import make_fp8_checkpoint

pytest.importorskip("xllamacpp")

from tests.test_gguf_export import assert_llama_cpp_agrees, assert_llama_cpp_exact, gguf_types  # noqa: E402

FULL = {"use_qk_norm": True, "attention_bias": True, "n_group": 2, "topk_group": 1}


def test_glm4_moe_graph_maps_exactly(tiny_ckpt, tmp_path):
    """F32 weights (no activation rounding in llama.cpp's matmuls): llama.cpp's logits equal moeq's to float
    rounding, greedy tokens equal."""
    src = tiny_ckpt("glm4_moe", **FULL)
    m = moeq.load(src, progress=False, dtype=torch.float32)
    summary = export(m, tmp_path / "g", "gguf", source=src)
    path = tmp_path / "g" / "model.gguf"
    assert summary["arch"] == "glm4moe"
    r = gguf.GGUFReader(path)
    assert r.fields["glm4moe.rope.dimension_count"].contents() == m.config.head_dim // 2
    assert r.fields["glm4moe.leading_dense_block_count"].contents() == 1
    types = gguf_types(path)
    assert types["blk.1.exp_probs_b.bias"] == types["blk.0.attn_q.bias"] == types["blk.1.attn_k_norm.weight"] == "F32"
    assert_llama_cpp_exact(path, m)


@pytest.mark.parametrize("method", ["q4_0", "iq4nl"])
def test_glm4_moe_quantized(method, tiny_ckpt, tmp_path):
    src = tiny_ckpt("glm4_moe", **FULL)
    m = moeq.load(src, quant=method, progress=False, dtype=torch.float32)
    summary = export(m, tmp_path / "g", "gguf", source=src)
    assert summary["requantized"] == []
    path = tmp_path / "g" / "model.gguf"
    assert gguf_types(path)["blk.1.ffn_up_exps.weight"] == {"q4_0": "Q4_0", "iq4nl": "IQ4_NL"}[method]
    assert_llama_cpp_agrees(path, m, src)
    back = moeq.load(path, progress=False, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, m(ids).logits, rtol=0, atol=1e-5)  # the same weights


def with_nextn_block(src, dst):
    """``src`` as llama.cpp's converter writes GLM-4.5 (no moeq keys; the NextN layer appended as one more block)."""
    r = gguf.GGUFReader(src)
    n = r.fields["glm4moe.block_count"].contents()
    w = gguf.GGUFWriter(dst, "glm4moe")
    for f in r.fields.values():
        if f.name.startswith(("GGUF.", "moeq.")) or f.name in ("general.architecture", "glm4moe.block_count"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    w.add_block_count(n + 1)
    w.add_uint32("glm4moe.nextn_predict_layers", 1)
    h = r.fields["glm4moe.embedding_length"].contents()
    extra = {f"blk.{n}.nextn.eh_proj.weight": np.ones((h, 2 * h), np.float32),
             f"blk.{n}.nextn.enorm.weight": np.ones(h, np.float32),
             f"blk.{n}.attn_norm.weight": np.ones(h, np.float32)}
    for t in r.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    for name, a in extra.items():
        w.add_tensor_info(name, a.shape, a.dtype, a.nbytes, gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(np.asarray(t.data))
    for a in extra.values():
        w.write_tensor_data(a)
    w.close()
    return dst


def test_foreign_glm4_moe_gguf_with_nextn_block(tiny_ckpt, tmp_path):
    src = tiny_ckpt("glm4_moe", **FULL)
    export(moeq.load(src, quant="q4_0", progress=False), tmp_path / "ours", "gguf", source=src)
    theirs = with_nextn_block(tmp_path / "ours" / "model.gguf", tmp_path / "theirs.gguf")
    a = moeq.load(tmp_path / "ours" / "model.gguf", progress=False)
    b = moeq.load(theirs, progress=False)
    for k in ("num_hidden_layers", "use_qk_norm", "attention_bias", "first_k_dense_replace", "n_group", "topk_group",
              "routed_scaling_factor", "norm_topk_prob", "n_shared_experts", "head_dim"):
        assert getattr(b.config, k) == getattr(a.config, k), k
    assert b.config.rope_parameters["partial_rotary_factor"] == 0.5
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_glm4_moe_fp8_release_streams_to_gguf(tmp_path):
    src = make_fp8_checkpoint("glm4_moe", tmp_path / "fp8", block=(128, 128), **FULL)
    s = export_checkpoint(src, tmp_path / "s.gguf", "gguf", quant="q4_0")
    assert s["streamed"] and s["requantized"] == []
    m = moeq.load(src, quant="q4_0", progress=False)
    assert_llama_cpp_agrees(tmp_path / "s.gguf", m.float(), src)
