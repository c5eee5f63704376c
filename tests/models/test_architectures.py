"""Every supported architecture end to end: in-flight load, logits vs transformers' forward on the dequantized
weights, identical greedy tokens, save -> reload bit-identical."""
import pytest
import torch

import moeq
from moeq.nn import QuantExperts, QuantLinear
from moeq.tiny import DENSE, TINY
from tests.conftest import dequantized_reference


@pytest.mark.parametrize("model_type", sorted(TINY) + sorted(DENSE))
def test_arch_end_to_end(model_type, tiny_ckpt, tmp_path):
    src = tiny_ckpt(model_type)
    m = moeq.load(src, quant="rtn-int4", dtype=torch.float32, progress=False)
    n_experts = sum(isinstance(x, QuantExperts) for x in m.modules())
    assert (n_experts == 0) == (model_type in DENSE)
    assert sum(isinstance(x, QuantLinear) for x in m.modules()) >= 4
    ref = dequantized_reference(m, src, torch.float32)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = m(ids).logits, ref(ids).logits
    assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()
    # greedy decoding with the KV cache: identical tokens for 16 steps
    prompt = ids[:1, :6]
    ga = m.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    gb = ref.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(ga, gb)
    # save -> load: bit-identical without re-quantizing
    out = moeq.save(m, tmp_path / "q", source=src)
    m2 = moeq.load(out, progress=False)
    sd1, sd2 = m.state_dict(), m2.state_dict()
    assert set(sd1) == set(sd2)
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    with torch.no_grad():
        assert torch.equal(m2(ids).logits, a)


@pytest.mark.parametrize("method", ["rtn-int8", "rtn-int4-asym", "rtn-int4-signed", "nf4", "fp4", "int8", "rtn-int3",
                                    "iq4nl", "q4_0-opt", "q5_0-opt", "nl3", "nl2"])
def test_formats_in_a_model(method, tiny_ckpt, tmp_path):
    src = tiny_ckpt("qwen2_moe")
    m = moeq.load(src, quant=method, dtype=torch.float32, progress=False)
    ref = dequantized_reference(m, src, torch.float32)
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = m(ids).logits, ref(ids).logits
    assert (a - b).abs().max() < 1e-4 * b.abs().max()
    m2 = moeq.load(moeq.save(m, tmp_path / "q"), progress=False)
    with torch.no_grad():
        assert torch.equal(m2(ids).logits, m(ids).logits)


def test_quantized_logits_close_to_bf16(tiny_ckpt):
    src = tiny_ckpt("mixtral")
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = moeq.load(src, progress=False)(ids).logits.float()
        q8 = moeq.load(src, quant="rtn-int8", progress=False)(ids).logits.float()
        q4 = moeq.load(src, quant="rtn-int4", progress=False)(ids).logits.float()
    err8, err4 = (q8 - full).abs().mean(), (q4 - full).abs().mean()
    assert err8 < err4 < 0.5 * full.abs().mean()


def test_fused_layout_checkpoint_equals_per_expert(tiny_ckpt):
    a = moeq.load(tiny_ckpt("mixtral"), quant="nf4", progress=False)
    b = moeq.load(tiny_ckpt("mixtral", fused_layout=True), quant="nf4", progress=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_quantize_in_memory_equals_streaming(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    src = tiny_ckpt("gpt_oss")
    streamed = moeq.load(src, quant="nf4", progress=False)
    mem = moeq.quantize_(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16), moeq.NF4())
    sa, sb = streamed.state_dict(), mem.state_dict()
    assert set(sa) == set(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_unquantized_load_matches_transformers(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    src = tiny_ckpt("deepseek_v3")
    m = moeq.load(src, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 300, (1, 8))
    with torch.no_grad():
        assert torch.equal(m(ids).logits, ref(ids).logits)
