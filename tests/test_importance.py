"""Data-free importance (moeq.importance): column statistics of text the model samples itself (or of random token
ids), measured on a q8_0 first pass (q4_0 where that would not fit), weigh the scale search of the second — what
llama.cpp's importance matrix does with calibration text."""
import numpy as np
import pytest
import torch

import moeq
from moeq import MoeqError
from moeq import importance as imp
from moeq.config import method
from moeq.formats import rtn
from moeq.nn.experts import QuantExperts


def test_importance_weighs_the_search_toward_heavy_columns():
    """Weighted by a column importance, the codebook search trades error on light columns for less on heavy ones:
    the importance-weighted squared error falls (what the search minimizes), the heavy columns' error falls."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g)
    importance = torch.rand(512, generator=g) ** 4 * 100 + 0.01
    heavy = importance > importance.quantile(0.9)
    cfg = method("iq4nl")
    assert cfg.uses_importance() and not method("q4_0").uses_importance()
    plain = cfg.quantize(w).dequantize(torch.float32)
    weighted = cfg.quantize(w, importance=importance).dequantize(torch.float32)
    e_plain, e_weighted = (w - plain) ** 2, (w - weighted) ** 2
    assert (e_weighted * importance).sum() < 0.9 * (e_plain * importance).sum()
    assert e_weighted[:, heavy].sum() < e_plain[:, heavy].sum()
    assert torch.equal(method("q4_0").quantize(w, importance=importance).qdata, method("q4_0").quantize(w).qdata)


def test_collect_measures_every_linear_and_each_expert(tiny_ckpt):
    m = moeq.load(tiny_ckpt("qwen3_moe"), "q4_0", progress=False)
    stats = imp.collect(m, tokens=1024, progress=False, inputs="random")
    cfg = m.config
    layer = m.model.layers[0]
    q = stats.linear("model.layers.0.self_attn.q_proj")
    assert q.shape == (cfg.hidden_size,) and bool((q > 0).all())
    w13, w2 = stats.experts["model.layers.0.mlp.experts"]
    assert w13.shape == (cfg.num_experts, cfg.hidden_size) and w2.shape == (cfg.num_experts, cfg.moe_intermediate_size)
    # the experts' input statistics add up to the layer's post-attention-norm input, top_k times over
    x = {}
    hook = layer.mlp.register_forward_pre_hook(lambda mod, a: x.setdefault("x", []).append(a[0].float()))
    ids = torch.randint(0, cfg.vocab_size, (2, imp.SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for rows in ids.split(imp.BATCH):
            m(rows, use_cache=False)
    hook.remove()
    xs = torch.cat([t.reshape(-1, cfg.hidden_size) for t in x["x"]])
    part = imp.collect(m, tokens=2 * imp.SEQ, progress=False, inputs="random")
    a, _ = part.experts["model.layers.0.mlp.experts"]
    torch.testing.assert_close(a.sum(0), cfg.num_experts_per_tok * (xs * xs).mean(0), rtol=1e-3, atol=1e-6)
    assert all(isinstance(mod, QuantExperts) for n, mod in m.named_modules() if n in stats.experts)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_load_with_importance(tiny_ckpt, tmp_path, arch):
    src = tiny_ckpt(arch)
    a = moeq.load(src, "iq4nl", importance=1024, progress=False, importance_inputs="random")
    b = moeq.load(src, "iq4nl", importance=1024, progress=False, importance_inputs="random")
    plain = moeq.load(src, "iq4nl", progress=False)
    wa, wp = a.model.layers[0].mlp.experts.w13, plain.model.layers[0].mlp.experts.w13
    assert torch.equal(wa.qdata, b.model.layers[0].mlp.experts.w13.qdata)  # seeded: the same bytes every time
    assert (wa.scale != wp.scale).float().mean() > 0.2
    assert a.config.quantization_config["importance"]["tokens"] == 1024
    assert a.config.quantization_config["importance"]["measured_on"] == "q8_0"
    moeq.save(a, tmp_path / "out", source=src)
    again = moeq.load(tmp_path / "out", progress=False)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert torch.equal(a(ids).logits, again(ids).logits)


def test_sampled_inputs_are_the_models_own_text(tiny_ckpt):
    """``inputs="self"``: each row from a seeded random first token, then tokens drawn from the model's own next-token
    distribution (made peaked here): far likelier under the model than uniformly random ids; seeded."""
    m = moeq.load(tiny_ckpt("qwen3_moe"), "q8_0", progress=False)
    m.lm_head.register_forward_hook(lambda mod, args, out: out * 40)  # peaked: what it samples is far from uniform
    ids = imp.sampled(m, 3, 64, seed=1, progress=False)
    assert ids.shape == (3, 64) and ids.dtype == torch.int64
    assert bool(((ids >= 0) & (ids < m.config.vocab_size)).all())
    assert torch.equal(ids, imp.sampled(m, 3, 64, seed=1, progress=False))
    assert not torch.equal(ids, imp.sampled(m, 3, 64, seed=2, progress=False))
    rand = torch.randint(0, m.config.vocab_size, (3, 64), generator=torch.Generator().manual_seed(0))

    def mean_logprob(x):
        with torch.no_grad():
            lp = torch.log_softmax(m(x, use_cache=False).logits[:, :-1].float(), -1)
        return float(lp.gather(-1, x[:, 1:, None]).mean())

    assert mean_logprob(ids) > mean_logprob(rand) + 2.0
    stats = imp.collect(m, tokens=imp.SEQ, progress=False, inputs="self")
    assert stats.inputs == "self" and stats.tokens == imp.SEQ
    with pytest.raises(MoeqError, match="inputs must be one of"):
        imp.collect(m, tokens=imp.SEQ, progress=False, inputs="text")


def test_load_records_and_uses_the_inputs(tiny_ckpt):
    src = tiny_ckpt("qwen3_moe")
    own = moeq.load(src, "iq4nl", importance=1024, progress=False)
    rand = moeq.load(src, "iq4nl", importance=1024, progress=False, importance_inputs="random")
    assert own.config.quantization_config["importance"]["inputs"] == imp.DEFAULT_INPUTS == "self"
    assert rand.config.quantization_config["importance"]["inputs"] == "random"
    w = lambda x: x.model.layers[0].mlp.experts.w13.scale  # noqa: E731
    assert not torch.equal(w(own), w(rand))  # the statistics differ with the inputs
    with pytest.raises(MoeqError, match="inputs must be one of"):
        moeq.load(src, "iq4nl", importance=1024, progress=False, importance_inputs="novels")


def test_first_pass_falls_back_to_q4_0_where_q8_0_does_not_fit(tiny_ckpt, monkeypatch):
    assert imp.first_pass(10**9, available=4 * 10**9) == "q8_0"
    assert imp.first_pass(10**9, available=10**9) == "q4_0"  # 1.06 GB > 60% of 1 GB
    src = tiny_ckpt("qwen3_moe")
    n = moeq.readers.weight_count(src)
    assert n > 0
    monkeypatch.setattr(imp, "available_memory", lambda: n)  # a machine where the q8_0 copy would not fit
    m = moeq.load(src, "iq4nl", importance=512, progress=False, importance_inputs="random")
    assert m.config.quantization_config["importance"]["measured_on"] == "q4_0"
    monkeypatch.undo()
    big = moeq.load(src, "iq4nl", importance=512, progress=False, importance_inputs="random")
    assert big.config.quantization_config["importance"]["measured_on"] == "q8_0"
    w = lambda x: x.model.layers[0].mlp.experts.w13.scale  # noqa: E731
    assert not torch.equal(w(m), w(big))  # the statistics differ with the first pass


def test_importance_refusals(tiny_ckpt):
    src = tiny_ckpt("qwen3_moe")
    with pytest.raises(MoeqError, match="searches its scales"):
        moeq.load(src, "q4_0", importance=1024, progress=False)
    with pytest.raises(MoeqError, match="searches its scales"):
        moeq.load(src, None, importance=1024, progress=False)
    for bad in (100, 0.5, -512):
        with pytest.raises(MoeqError, match="multiple of"):
            moeq.load(src, "iq4nl", importance=bad, progress=False)


def test_cli_quantize_with_importance(tiny_ckpt, tmp_path, capsys):
    from moeq.cli import main

    src = tiny_ckpt("qwen3_moe")
    assert main(["quantize", str(src), str(tmp_path / "out"), "--method", "iq4nl", "--importance", "1024",
                 "--importance-inputs", "random"]) == 0
    got = moeq.load(tmp_path / "out", progress=False).config.quantization_config["importance"]
    assert got["tokens"] == 1024 and got["inputs"] == "random"
    assert main(["quantize", str(src), str(tmp_path / "bad"), "--method", "q4_0", "--importance", "1024"]) == 2
    assert "searches its scales" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_gguf_export_with_importance_is_the_loaded_model(tiny_ckpt, tmp_path):
    """``moeq export SRC x.gguf --method iq4nl --importance N`` (streamed): an IQ4_NL GGUF holding exactly the
    weights ``moeq.load(..., importance=N)`` quantizes, as gguf-py decodes them."""
    gguf = pytest.importorskip("gguf")
    from moeq.export import export_checkpoint

    src = tiny_ckpt("mixtral")
    out = tmp_path / "m.gguf"
    summary = export_checkpoint(src, out, "gguf", quant="iq4nl", importance=1024, importance_inputs="random")
    assert summary["streamed"]
    m = moeq.load(src, "iq4nl", importance=1024, progress=False, importance_inputs="random")
    want = m.model.layers[0].self_attn.v_proj.qweight.dequantize(torch.float32)
    t = next(t for t in gguf.GGUFReader(out).tensors if t.name == "blk.0.attn_v.weight")
    assert t.tensor_type.name == "IQ4_NL"
    got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).float().reshape(want.shape)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_streamed_gguf_export_measures_importance_for_iq2s_itself(tiny_ckpt, tmp_path):
    """A streamed GGUF export of a format that needs importance (iq2s) measures it unasked, as moeq.load does: the
    file holds exactly the IQ2_S blocks of the loaded model."""
    gguf = pytest.importorskip("gguf")
    from moeq.export import export_checkpoint

    if not iq2s_native():
        pytest.skip("no C compiler: the iq2s quantizer is native only")
    src = tiny_ckpt("mixtral", hidden_size=256, intermediate_size=256)
    out = tmp_path / "m.gguf"
    assert export_checkpoint(src, out, "gguf", quant="iq2s", importance_inputs="random")["streamed"]
    m = moeq.load(src, "iq2s", progress=False, importance_inputs="random")
    assert m.config.quantization_config["importance"]["inputs"] == "random"
    want = m.model.layers[0].mlp.experts.w2.blocks  # [E, N, K/256 * 82]: ggml's block_iq2_s bytes
    t = next(t for t in gguf.GGUFReader(out).tensors if t.name == "blk.0.ffn_down_exps.weight")
    assert t.tensor_type.name == "IQ2_S"
    assert np.array_equal(np.asarray(t.data).reshape(-1), want.numpy().reshape(-1))


def iq2s_native() -> bool:
    from moeq import native

    return native.lib() is not None
