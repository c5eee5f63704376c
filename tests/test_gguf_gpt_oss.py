"""gpt-oss to llama.cpp's ``gpt-oss`` graph, checked by its consumers: the MXFP4 experts of the checkpoint as
downloaded go into the GGUF as the same bytes (gguf-py decodes them to moeq's values), with the expert and router
biases, attention sinks, sliding-window layers and YaRN; llama.cpp computes moeq's logits; moeq reads the file back,
and a converter-written file (no moeq keys) too."""
import numpy as np
import pytest
import torch

import moeq
from moeq.export import export, export_checkpoint
from moeq.tiny import make_mxfp4_checkpoint

gguf = pytest.importorskip("gguf")
pytest.importorskip("xllamacpp")

from tests.models.test_gguf_foreign import strip  # noqa: E402
from tests.test_gguf_export import assert_llama_cpp_agrees, assert_llama_cpp_exact, gguf_types, gguf_values  # noqa: E402
from tests.test_gguf_stream import assert_same_gguf  # noqa: E402


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    return make_mxfp4_checkpoint(tmp_path_factory.mktemp("gptoss") / "c")


def expert_values(m, i):
    ex = m.model.layers[i].mlp.experts
    w13, n = ex.w13.dequantize(torch.float32), ex.intermediate_dim
    return {"gate": w13[:, :n], "up": w13[:, n:], "down": ex.w2.dequantize(torch.float32)}, ex


def test_gpt_oss_mxfp4_checkpoint_to_llama_cpp(gptoss, tmp_path):
    m = moeq.load(gptoss, progress=False, dtype=torch.float32)  # MXFP4 experts as stored, the rest as shipped
    summary = export(m, tmp_path / "g", "gguf", source=gptoss)
    path = tmp_path / "g" / "model.gguf"
    assert summary["arch"] == "gpt-oss" and summary["requantized"] == []
    types, got = gguf_types(path), gguf_values(path)
    for i in range(m.config.num_hidden_layers):
        want, ex = expert_values(m, i)
        for kind, w in want.items():  # the checkpoint's MXFP4 blocks, decoded by gguf-py to moeq's values
            assert types[f"blk.{i}.ffn_{kind}_exps.weight"] == "MXFP4"
            assert np.array_equal(got[f"blk.{i}.ffn_{kind}_exps.weight"], w.numpy())
        n = ex.intermediate_dim
        for kind, b in (("gate", ex.b13[:, :n]), ("up", ex.b13[:, n:]), ("down", ex.b2)):
            assert np.array_equal(got[f"blk.{i}.ffn_{kind}_exps.bias"], b.float().numpy())
        att = m.model.layers[i].self_attn
        assert np.array_equal(got[f"blk.{i}.attn_sinks.weight"], att.sinks.float().detach().numpy())
        assert np.array_equal(got[f"blk.{i}.ffn_gate_inp.bias"], m.model.layers[i].mlp.router.bias.float().numpy())
    r = gguf.GGUFReader(path)
    field = lambda k: r.fields[k].contents()  # noqa: E731
    assert field("gpt-oss.attention.sliding_window") == m.config.sliding_window
    assert field("gpt-oss.rope.scaling.type") == "yarn" and field("gpt-oss.rope.scaling.factor") == 32.0

    assert_llama_cpp_agrees(path, m, gptoss)
    back = moeq.load(path, progress=False, dtype=torch.float32)  # moeq reads its gpt-oss file back
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, m(ids).logits, rtol=0, atol=0)

    # the checkpoint streamed to GGUF without loading it whole: the same file
    s = export_checkpoint(gptoss, tmp_path / "s.gguf", "gguf")
    assert s["streamed"] and s["requantized"] == []
    export(moeq.load(gptoss, progress=False), tmp_path / "m.gguf", "gguf", source=gptoss)
    assert_same_gguf(tmp_path / "s.gguf", tmp_path / "m.gguf")


def test_gpt_oss_graph_maps_exactly(tiny_ckpt, tmp_path):
    """Unquantized (F32 weights: no activation rounding inside llama.cpp's matmuls), llama.cpp's logits equal
    moeq's to float rounding at every step — sliding-window layers with a 4-token window over a 20-token sequence,
    sinks, YaRN and the clamped SwiGLU experts included."""
    src = tiny_ckpt("gpt_oss", sliding_window=4)
    m = moeq.load(src, progress=False, dtype=torch.float32)
    export(m, tmp_path / "g", "gguf", source=src)
    assert gguf_types(tmp_path / "g" / "model.gguf")["blk.0.ffn_gate_exps.weight"] == "F32"
    assert_llama_cpp_exact(tmp_path / "g" / "model.gguf", m)


@pytest.mark.parametrize("method", ["q8_0", "mxfp4"])
def test_gpt_oss_quantized_in_llama_cpp(method, tiny_ckpt, tmp_path):
    src = tiny_ckpt("gpt_oss")
    m = moeq.load(src, quant=method, progress=False, dtype=torch.float32)
    summary = export(m, tmp_path / "g", "gguf", source=src)
    assert summary["requantized"] == [] and gguf_types(tmp_path / "g" / "model.gguf")[
        "blk.1.attn_q.weight"] == method.upper()
    assert_llama_cpp_agrees(tmp_path / "g" / "model.gguf", m, src)


def test_gpt_oss_refusals(tiny_ckpt, tmp_path):
    for kw, match in (({"swiglu_limit": 5.0}, "swiglu_limit=5.0"),
                      ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types")):
        src = tiny_ckpt("gpt_oss", **kw)
        m = moeq.load(src, quant="q8_0", progress=False)
        with pytest.raises(moeq.MoeqError, match=match):
            export(m, tmp_path / "x", "gguf", source=src)
        assert not (tmp_path / "x").exists()


def test_foreign_gpt_oss_gguf_loads_as_moeqs_own(gptoss, tmp_path):
    export(moeq.load(gptoss, progress=False), tmp_path / "ours", "gguf", source=gptoss)
    theirs = strip(tmp_path / "ours" / "model.gguf", tmp_path / "theirs.gguf")
    a = moeq.load(tmp_path / "ours" / "model.gguf", progress=False)
    b = moeq.load(theirs, progress=False)
    for k in ("head_dim", "num_local_experts", "intermediate_size", "sliding_window", "layer_types", "rope_parameters"):
        assert getattr(b.config, k) == getattr(a.config, k), k
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
