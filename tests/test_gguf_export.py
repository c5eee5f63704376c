"""GGUF export checked by its consumers: the ``gguf`` package's reader and dequantizer (values equal moeq's), and
llama.cpp itself through xllamacpp's C API (greedy tokens equal moeq's, logits close)."""
import json

import numpy as np
import pytest
import torch

import moeq
from moeq.io.writer import MARKER
from transformers import AutoTokenizer
from moeq.cli import main
from moeq.export import export

gguf = pytest.importorskip("gguf")
pytest.importorskip("xllamacpp")

from tests.llama_cpp import LlamaCpp  # noqa: E402

# llama.cpp's graphs fix what transformers leaves configurable: its qwen3moe always renormalizes the top-k weights,
# its olmoe k-norm spans all heads (no grouped-query attention)
OVERRIDES = {"qwen3_moe": {"norm_topk_prob": True}, "olmoe": {"num_key_value_heads": 4}}
PROMPT = [5, 17, 42, 99, 7]


def gguf_values(path) -> dict[str, np.ndarray]:
    r = gguf.GGUFReader(path)
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in r.tensors}


def gguf_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def moeq_greedy(model, prompt, steps):
    x, out, logits = torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(steps):
            lg = model(x).logits[0, -1].float()
            logits.append(lg.numpy())
            out.append(int(lg.argmax()))
            x = torch.cat([x, torch.tensor([[out[-1]]])], 1)
    return out, logits


def qk_perm(n, heads):
    return np.arange(n).reshape(heads, 2, n // heads // 2).swapaxes(1, 2).reshape(-1)


def expected_values(m) -> dict[str, np.ndarray]:
    """What every written tensor must decode to: moeq's own dequantized weights, under llama.cpp's names."""
    cfg, exp = m.config, {}
    permute = cfg.model_type == "mixtral"
    exp["token_embd.weight"] = m.model.embed_tokens.weight.float()
    exp["output_norm.weight"] = m.model.norm.weight.float()
    exp["output.weight"] = m.lm_head.weight.float()
    for i, layer in enumerate(m.model.layers):
        ex = layer.mlp.experts
        w13 = ex.w13.dequantize(torch.float32)
        exp[f"blk.{i}.ffn_gate_exps.weight"] = w13[:, : ex.intermediate_dim]
        exp[f"blk.{i}.ffn_up_exps.weight"] = w13[:, ex.intermediate_dim:]
        exp[f"blk.{i}.ffn_down_exps.weight"] = ex.w2.dequantize(torch.float32)
        exp[f"blk.{i}.ffn_gate_inp.weight"] = layer.mlp.gate.weight.float()
        exp[f"blk.{i}.attn_norm.weight"] = layer.input_layernorm.weight.float()
        exp[f"blk.{i}.ffn_norm.weight"] = layer.post_attention_layernorm.weight.float()
        att = layer.self_attn
        for proj, key, heads in (("q_proj", "attn_q", cfg.num_attention_heads),
                                 ("k_proj", "attn_k", cfg.num_key_value_heads), ("v_proj", "attn_v", 0),
                                 ("o_proj", "attn_output", 0)):
            w = getattr(att, proj).qweight.dequantize(torch.float32)
            exp[f"blk.{i}.{key}.weight"] = w[qk_perm(w.shape[0], heads)] if permute and heads else w
            b = getattr(getattr(att, proj), "bias", None)
            if b is not None:
                exp[f"blk.{i}.{key}.bias"] = b.float()
        for norm, key in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            if hasattr(att, norm):
                exp[f"blk.{i}.{key}.weight"] = getattr(att, norm).weight.float()
        if hasattr(layer.mlp, "shared_expert"):
            for proj in ("gate", "up", "down"):
                exp[f"blk.{i}.ffn_{proj}_shexp.weight"] = getattr(
                    layer.mlp.shared_expert, f"{proj}_proj").qweight.dequantize(torch.float32)
            exp[f"blk.{i}.ffn_gate_inp_shexp.weight"] = layer.mlp.shared_expert_gate.weight.float()
    return {k: v.detach().numpy() for k, v in exp.items()}


@pytest.mark.parametrize("model_type,method", [
    ("mixtral", "q4_0"), ("qwen2_moe", "q4_0"), ("qwen3_moe", "q8_0"), ("olmoe", "q4_0"), ("mixtral", "q8_0"),
    ("mixtral", "iq4nl"), ("olmoe", "q4_0-opt"), ("qwen2_moe", "q5_0-opt"), ("qwen3_moe", "iq4nl-dq"),
    ("mixtral", "mxfp4")])
def test_gguf_lossless_and_llama_cpp_runs_it(model_type, method, tiny_ckpt, tmp_path):
    src = tiny_ckpt(model_type, **OVERRIDES.get(model_type, {}))
    m = moeq.load(src, quant=method, progress=False, dtype=torch.float32)
    out = tmp_path / "gguf"
    summary = export(m, out, "gguf", source=src)
    path = out / "model.gguf"
    assert summary["requantized"] == [] and sorted(p.name for p in out.iterdir()) == [MARKER, "model.gguf"]
    qtype = {"iq4nl": "IQ4_NL", "iq4nl-dq": "IQ4_NL", "q4_0-opt": "Q4_0", "q5_0-opt": "Q5_0"}.get(method,
                                                                                                  method.upper())
    types = gguf_types(path)
    assert types["blk.1.ffn_gate_exps.weight"] == types["blk.0.attn_q.weight"] == qtype
    assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["token_embd.weight"] == "F32"
    got, want = gguf_values(path), expected_values(m)
    assert set(got) == set(want)
    for name, w in want.items():  # every tensor decodes (by gguf's own dequantizer) to exactly moeq's values
        assert got[name].shape == w.shape, name
        if method == "iq4nl-dq":  # the same codes; each group's scale (int8 code x row factor) rounded to fp16
            assert (np.abs(got[name] - w) <= 2.0 ** -11 * np.abs(w)).all(), name
        else:
            assert np.array_equal(got[name], w), name
    assert got["blk.0.ffn_down_exps.weight"].shape == (4, 128, 128)

    r = gguf.GGUFReader(path)
    arch = summary["arch"]
    field = lambda k: r.fields[k].contents()  # noqa: E731
    assert field("general.architecture") == arch and field(f"{arch}.expert_count") == 4
    assert field(f"{arch}.expert_used_count") == 2 and field("tokenizer.ggml.model") == "gpt2"
    assert len(field("tokenizer.ggml.tokens")) == m.config.vocab_size

    assert_llama_cpp_agrees(path, m, src)


def assert_llama_cpp_exact(path, m):
    """F32 weights (no activation rounding inside llama.cpp's matmuls): llama.cpp's greedy tokens are moeq's and its
    logits equal moeq's to float rounding (0.2% of the largest) at every step checked."""
    mine, logits = moeq_greedy(m, PROMPT, 16)
    llama = LlamaCpp(path)
    try:
        assert llama.greedy(PROMPT, 16) == mine
        for step in (0, 8, 15):
            theirs = llama.logits(PROMPT + mine[:step])
            assert np.abs(theirs - logits[step]).max() < 0.002 * np.abs(logits[step]).max()
    finally:
        llama.close()


def assert_llama_cpp_agrees(path, m, src):
    """llama.cpp loads the file, tokenizes as transformers does, and computes moeq's logits and greedy tokens."""
    llama = LlamaCpp(path)
    try:
        assert llama.n_vocab == m.config.vocab_size
        text = "It is a truth universally acknowledged, that a single man... 42 times!"
        assert llama.tokenize(text) == AutoTokenizer.from_pretrained(src)(text, add_special_tokens=False).input_ids
        mine, my_logits = moeq_greedy(m, PROMPT, 16)
        theirs_greedy = llama.greedy(PROMPT, 16)
        # teacher-forced: llama.cpp's logits at every step of moeq's sequence are moeq's, up to llama.cpp's 8-bit
        # activation rounding inside its quantized matmuls
        for step in (0, 7, 15):
            theirs = llama.logits(PROMPT + mine[:step])
            assert np.abs(theirs - my_logits[step]).max() < 0.03 * np.abs(my_logits[step]).max()
        # greedy sequences agree, except from a step where moeq's top two logits lie within that rounding
        split = next((s for s, (a, b) in enumerate(zip(mine, theirs_greedy)) if a != b), None)
        if split is not None:
            top2 = np.sort(my_logits[split])[-2:]
            assert top2[1] - top2[0] < 0.03 * np.abs(my_logits[split]).max(), (split, mine, theirs_greedy)
    finally:
        llama.close()


@pytest.mark.parametrize("method,requant", [("rtn-int4", "Q4_0"), ("nf4", "Q4_0"), ("int8", "Q8_0"), ("nl3", "Q4_0"),
                                           ("nl2", "Q4_0")])
def test_gguf_refuses_double_rounding_unless_asked(method, requant, tiny_ckpt, tmp_path):
    src = tiny_ckpt("qwen3_moe", **OVERRIDES["qwen3_moe"])
    m = moeq.load(src, quant=method, progress=False, dtype=torch.float32)
    out = tmp_path / "g"
    with pytest.raises(moeq.MoeqError, match=r"round moeq's already-rounded values a second time.*--method q4_0"):
        export(m, out, "gguf", source=src)  # refused by default, naming the lossless command
    assert not out.exists()
    summary = export(m, out, "gguf", source=src, requantize=True)
    n_quantized = 2 * (3 + 4)  # per layer: 3 expert stacks + q/k/v/o
    assert len(summary["requantized"]) == n_quantized
    assert all(f"-> {requant}" in r for r in summary["requantized"])
    path = out / "model.gguf"
    assert gguf_types(path)["blk.0.ffn_up_exps.weight"] == requant
    got = gguf_values(path)
    ex = m.model.layers[0].mlp.experts
    up = ex.w13.dequantize(torch.float32)[:, ex.intermediate_dim:].numpy()
    qt = gguf.GGMLQuantizationType[requant]
    assert np.array_equal(got["blk.0.ffn_up_exps.weight"], gguf.quants.dequantize(gguf.quants.quantize(up, qt), qt))
    llama = LlamaCpp(path)
    try:
        mine, logits = moeq_greedy(m, PROMPT, 1)
        theirs = llama.logits(PROMPT)  # re-quantized twice (moeq's format, then Q4_0/Q8_0): similar, not equal
        assert np.isfinite(theirs).all() and np.corrcoef(theirs, logits[0])[0, 1] > 0.9
    finally:
        llama.close()


def test_gguf_bf16_experts_and_cli(tiny_ckpt, tmp_path, capsys):
    src = tiny_ckpt("qwen2_moe")
    q = tmp_path / "q"
    assert main(["quantize", str(src), str(q), "--method", "q4_0"]) == 0
    capsys.readouterr()
    assert main(["export", str(q), str(tmp_path / "g"), "--format", "gguf", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["format"] == "gguf" and summary["types"]["Q4_0"] == 2 * (3 + 4 + 3)  # + shared expert
    assert summary["requantized"] == [] and "output.weight" in summary["kept_unquantized"]
    # experts kept in bf16 (a rule) are written as BF16 stacks, values unchanged
    keep = moeq.QuantConfig(moeq.RTN(4, 32, grid="signed"), rules={"*.experts": moeq.Keep()})
    m = moeq.load(src, quant=keep, progress=False)
    export(m, tmp_path / "bf", "gguf", source=src)
    path = tmp_path / "bf" / "model.gguf"
    assert gguf_types(path)["blk.1.ffn_gate_exps.weight"] == "BF16"
    got = gguf_values(path)["blk.1.ffn_down_exps.weight"]
    assert np.array_equal(got, m.model.layers[1].mlp.experts.down_proj.float().detach().numpy())
    llama = LlamaCpp(path)
    llama.close()


def test_gguf_errors(tiny_ckpt, tmp_path):
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="q4_0", progress=False)  # norm_topk_prob=False
    with pytest.raises(ValueError, match=r"norm_topk_prob=False \(llama.cpp's qwen3moe graph always uses True\)"):
        export(m, tmp_path / "x", "gguf", source=tiny_ckpt("qwen3_moe"))
    assert not (tmp_path / "x").exists()
    o = moeq.load(tiny_ckpt("olmoe"), quant="q4_0", progress=False)
    with pytest.raises(ValueError, match="grouped-query attention"):
        export(o, tmp_path / "x", "gguf", source=tiny_ckpt("olmoe"))
    d = moeq.load(tiny_ckpt("phimoe"), quant="q4_0", progress=False)
    with pytest.raises(ValueError, match=r"phimoe: no llama.cpp architecture .* takes mixtral, qwen2_moe"):
        export(d, tmp_path / "x", "gguf")
    mx = moeq.load(tiny_ckpt("mixtral"), quant="q4_0", progress=False)
    mx.config._name_or_path = mx.name_or_path = ""
    with pytest.raises(ValueError, match="embeds the tokenizer: pass source="):
        export(mx, tmp_path / "x", "gguf", source=tmp_path)
    assert not (tmp_path / "x").exists()


def test_gguf_sentencepiece_style_tokenizer(tiny_ckpt, tmp_path):
    """Mixtral/Llama tokenizers (BPE over ``▁``-joined text, ``<0xNN>`` byte fallback) become llama.cpp's ``llama``
    vocabulary; llama.cpp tokenizes text exactly as transformers does."""
    src = tiny_ckpt("mixtral", tokenizer="spm")
    m = moeq.load(src, quant="q4_0", progress=False)
    summary = export(m, tmp_path / "g", "gguf", source=src)
    assert summary["tokenizer"] == "llama"
    hf = AutoTokenizer.from_pretrained(src)
    llama = LlamaCpp(tmp_path / "g" / "model.gguf")
    try:
        for text in ("It is a truth universally acknowledged, that a single man... 42 times!",
                     "héllo wörld ✓ zzq", " two  spaces and\nnewline", "neighbourhood of the surrounding families"):
            assert llama.tokenize(text) == hf(text, add_special_tokens=False).input_ids, text
    finally:
        llama.close()


def test_gguf_iq2s_lossless_llama_cpp_runs_it_and_moeq_reads_it_back(tiny_ckpt, tmp_path):
    """IQ2_S blocks (moeq's search) written as they are: gguf-py decodes them to moeq's values, llama.cpp's own
    engine computes moeq's logits from them, and moeq reads the file back holding the same blocks (no decoding)."""
    from moeq.formats import Iq2sWeight
    src = tiny_ckpt("mixtral", hidden_size=256, intermediate_size=256)
    m = moeq.load(src, quant="iq2s", progress=False, dtype=torch.float32)
    out = tmp_path / "gguf"
    summary = export(m, out, "gguf", source=src)
    path = out / "model.gguf"
    assert summary["requantized"] == []
    types = gguf_types(path)
    assert types["blk.0.ffn_down_exps.weight"] == types["blk.1.attn_q.weight"] == "IQ2_S"
    got, want = gguf_values(path), expected_values(m)
    for name, w in want.items():
        assert np.array_equal(got[name], w), name
    assert_llama_cpp_agrees(path, m, src)
    back = moeq.load(path, progress=False, dtype=torch.float32)
    ex, ex0 = back.model.layers[0].mlp.experts, m.model.layers[0].mlp.experts
    assert isinstance(ex.w13, Iq2sWeight) and torch.equal(ex.w13.blocks, ex0.w13.blocks)
    assert isinstance(back.model.layers[1].self_attn.o_proj.qweight, Iq2sWeight)
    x = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.allclose(back(x).logits, m(x).logits, rtol=1e-4, atol=1e-4)
