"""Default quantization policy, per-module rules, and a forward that touches only the routed experts."""
import torch
from torch import nn

import moeq
import moeq.nn.experts as experts_mod
from moeq import native
from moeq.nn import QuantExperts, QuantLinear


def kinds(model):
    return {n: type(m).__name__ for n, m in model.named_modules()}


def test_default_policy(tiny_ckpt):
    m = moeq.load(tiny_ckpt("qwen2_moe"), quant="rtn-int4", progress=False)
    k = kinds(m)
    assert k["model.layers.0.mlp.experts"] == "QuantExperts"
    assert k["model.layers.0.self_attn.q_proj"] == "QuantLinear"
    assert k["model.layers.0.mlp.shared_expert.gate_proj"] == "QuantLinear"
    assert k["model.layers.0.mlp.shared_expert_gate"] == "Linear"  # the shared-expert gate stays
    # kept bf16; untied, so held losslessly in 12 bits per weight where the native decode forwards run
    assert k["lm_head"] == ("Bf12Linear" if native.has_simd() else "Linear")
    assert m.lm_head.weight.dtype == torch.bfloat16
    assert isinstance(m.model.embed_tokens, nn.Embedding)
    assert m.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16  # router in compute dtype


def test_mamba_layers_stay_in_compute_dtype(tiny_ckpt):
    m = moeq.load(tiny_ckpt("jamba"), quant="rtn-int4", progress=False)
    mamba = [n for n, x in m.named_modules() if ".mamba." in n and isinstance(x, nn.Linear)]
    assert mamba and not any(".mamba." in n for n, x in m.named_modules() if isinstance(x, QuantLinear))


def test_rules_override_policy(tiny_ckpt):
    cfg = moeq.QuantConfig(moeq.RTN(4, 128), rules={"lm_head": moeq.RTN(bits=8), "*.self_attn.*": moeq.Keep(),
                                                    "*.experts": moeq.NF4()})
    m = moeq.load(tiny_ckpt("mixtral"), quant=cfg, progress=False)
    assert isinstance(m.lm_head, QuantLinear) and m.lm_head.qweight.bits == 8
    assert isinstance(m.model.layers[1].self_attn.o_proj, nn.Linear)
    assert m.model.layers[0].mlp.experts.w13.format == "bnb4"
    qc = m.config.quantization_config
    assert qc["quant_method"] == "moeq" and set(qc["formats"]) == {"bnb4", "rtn"}
    assert moeq.QuantConfig.from_dict(qc["config"]) == cfg
    m_keep = moeq.load(tiny_ckpt("mixtral"), quant=moeq.QuantConfig(moeq.RTN(), rules={"*.experts": moeq.Keep()}),
                       progress=False)
    assert not any(isinstance(x, QuantExperts) for x in m_keep.modules())


def test_forward_touches_only_routed_experts(tiny_ckpt, monkeypatch):
    m = moeq.load(tiny_ckpt("olmoe", num_experts=8), quant="nf4", progress=False)
    fused_counts = []
    real_fused, real_routed = experts_mod.moe_forward, experts_mod.moe_routed
    monkeypatch.setattr(experts_mod, "moe_routed", lambda *a: None)  # the grouped path below
    monkeypatch.setattr(experts_mod, "moe_forward", lambda *a: fused_counts.append(a[-1]) or None)  # force per-expert
    used, shapes = [], []
    real_linear = experts_mod.expert_linear
    monkeypatch.setattr(experts_mod, "expert_linear",
                        lambda w, e, x, b=None, buf=None, out=None: used.append(e) or real_linear(w, e, x, b, buf, out))
    from moeq.formats import Bnb4Weight

    orig = Bnb4Weight.dequantize
    monkeypatch.setattr(Bnb4Weight, "dequantize",
                        lambda self, dtype=None, out=None: shapes.append(self.shape) or orig(self, dtype, out))
    routed = []
    block = m.model.layers[0].mlp
    h = block.gate.register_forward_hook(lambda mod, inp, out: routed.append(out[2].flatten().tolist()))
    ids = torch.tensor([[5]])  # one token: top-2 of 8 experts per layer
    with torch.no_grad():
        m(ids, use_cache=False)  # no cache: the modules' path (a decode step would take the fused native layer)
    h.remove()
    n_layers = len(m.model.layers)
    assert len(used) == 2 * 2 * n_layers  # w13 and w2 of 2 experts per layer
    assert set(used[:4]) == set(routed[0])
    assert all(len(s) == 2 for s in shapes)  # never a whole [E, N, K] stack
    # the fused native path gets exactly the same per-expert row counts (it skips experts with none)
    assert [i for i, c in enumerate(fused_counts[0]) if c] == sorted(set(routed[0]))
    monkeypatch.setattr(experts_mod, "moe_forward", real_fused)
    with torch.no_grad():
        grouped_logits = m(ids, use_cache=False).logits
    monkeypatch.setattr(experts_mod, "moe_routed", real_routed)
    with torch.no_grad():
        fused_logits = m(ids, use_cache=False).logits
    assert torch.equal(fused_logits, grouped_logits)  # routed in C or grouped in Python: the same kernel call
    monkeypatch.setattr(experts_mod, "moe_routed", lambda *a: None)
    monkeypatch.setattr(experts_mod, "moe_forward", lambda *a: None)
    with torch.no_grad():
        loop_logits = m(ids, use_cache=False).logits
    assert torch.allclose(fused_logits.float(), loop_logits.float(), atol=2e-2)
    with torch.no_grad():  # with a cache the decode step is the fused native layer: the same logits
        layer_logits = m(ids).logits
    assert torch.allclose(layer_logits.float(), fused_logits.float(), atol=2e-2 * fused_logits.abs().max())


def test_experts_forward_matches_dense_loop():
    torch.manual_seed(0)
    from moeq.config import RTN
    from moeq.nn import Activation

    e, h, i, t, a = 6, 64, 32, 9, 2
    gu, dn = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    w13, w2 = RTN(8, 32).quantize(gu), RTN(8, 32).quantize(dn)
    mod = QuantExperts(w13, w2, Activation("glu", "silu"))
    x = torch.randn(t, h)
    idx = torch.stack([torch.randperm(e)[:a] for _ in range(t)])
    wts = torch.rand(t, a)
    out = mod(x, idx, wts)
    g, d = w13.dequantize(torch.float32), w2.dequantize(torch.float32)
    ref = torch.zeros(t, h)
    for tok in range(t):
        for j in range(a):
            ex = idx[tok, j]
            y = x[tok] @ g[ex].T
            y = torch.nn.functional.silu(y[:i]) * y[i:]
            ref[tok] += wts[tok, j] * (y @ d[ex].T)
    assert torch.allclose(out, ref, atol=1e-5 * ref.abs().max(), rtol=1e-4)


def test_generation_sampling_and_cache(tiny_ckpt):
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="rtn-int4", progress=False)
    prompt = torch.tensor([[1, 17, 42, 99]])
    g1 = m.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, use_cache=True)
    g2 = m.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(g1, g2)
    torch.manual_seed(3)
    s1 = m.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=True, top_p=0.9, temperature=1.0)
    torch.manual_seed(3)
    s2 = m.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=True, top_p=0.9, temperature=1.0)
    assert torch.equal(s1, s2) and s1.shape == (1, 12)
