"""The native decode loop (moeq.nn.engine): greedy ``generate`` through one native call per step gives the tokens of
transformers' own ``generate``, and every other request goes to transformers."""
from __future__ import annotations

import pytest
import torch

import moeq
from moeq import native
from moeq.errors import MoeqError
from moeq.kernels import plans
from moeq.nn import decode, engine

pytestmark = pytest.mark.skipif(not native.has_simd(), reason="the native decode loop needs AVX512-BF16 or AVX2")


def _own(model):
    """transformers' own modules everywhere (no native forward, no native loop)."""
    for m in model.modules():
        m.__dict__.pop("forward", None)


def _steps(monkeypatch):
    calls = {"step": 0, "route": 0}
    step, route = engine.Engine.step, decode.RouterForward.route

    def counted_step(self, *a):
        calls["step"] += 1
        return step(self, *a)

    def counted_route(*a):
        calls["route"] += 1
        return route(*a)

    monkeypatch.setattr(engine.Engine, "step", counted_step)
    monkeypatch.setattr(decode.RouterForward, "route", counted_route)
    return calls


def _batch():
    ids = torch.randint(3, 100, (3, 7), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, :3] = 0  # left padding
    return ids, am


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_greedy_generate_equals_transformers(tiny_ckpt, arch, monkeypatch):
    """Same tokens as transformers' own generate on its own modules: a left-padded batch, min_new_tokens with
    end-of-sequence ids banned, and a stop at an end-of-sequence id with the finished row padded."""
    m = moeq.load(tiny_ckpt(arch), quant="rtn-int4", progress=False)
    assert engine.engine_of(m) is not None
    calls = _steps(monkeypatch)
    ids, am = _batch()
    kw = dict(attention_mask=am, do_sample=False, pad_token_id=0)
    fast = m.generate(ids, max_new_tokens=12, **kw)
    assert calls["step"] == 11  # the first token comes from the prompt's forward
    eos = int(fast[0, 7 + 2])  # row 0 emits it at its third new token
    fast_eos = m.generate(ids, max_new_tokens=12, eos_token_id=eos, **kw)
    fast_min = m.generate(ids, max_new_tokens=6, min_new_tokens=6, eos_token_id=eos, **kw)
    _own(m)
    assert torch.equal(fast, m.generate(ids, max_new_tokens=12, **kw))
    ref_eos = m.generate(ids, max_new_tokens=12, eos_token_id=eos, **kw)
    assert torch.equal(fast_eos, ref_eos) and fast_eos[0, 10:].eq(0).all()  # row 0 padded after its end
    assert torch.equal(fast_min, m.generate(ids, max_new_tokens=6, min_new_tokens=6, eos_token_id=eos, **kw))
    assert not fast_min[:, 7:].eq(eos).any()


def test_step_logits_match_the_models_own_steps(tiny_ckpt):
    """Each native step's logits equal the model's own decode step (transformers' forward with its cache) within
    bf16 rounding, step after step."""
    from transformers import DynamicCache

    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="rtn-int4", progress=False)
    eng = engine.engine_of(m)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    md, keep, caches, state = eng.describe(2, 12, 12)
    am = torch.ones(2, 6, dtype=torch.int64)
    got0 = eng.prefill(ids[:, :6], am, caches)
    _own(m)
    cache = DynamicCache(config=m.config)
    with torch.no_grad():
        ref = m(ids[:, :6], cache=cache, use_cache=True).logits[:, -1]
        assert decode.close(got0, ref)
        for i in range(6, 12):
            got = eng.step(md, ids[:, i].contiguous(), torch.tensor([i, i]), i + 1, None, state)
            ref = m(ids[:, i:i + 1], cache=cache, use_cache=True).logits[:, -1]
            assert ((got.float() - ref.float()).abs() <= 2 ** -6 * ref.float().abs().max()).all()


def test_routing_ties_take_the_routers_own_top_k(tiny_ckpt, monkeypatch):
    """Identical router rows make every router logit equal: each layer's top-k choice is a tie, which the native step
    hands to the router's own torch top-k (its tie order), and the tokens stay transformers' own."""
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="rtn-int4", progress=False)
    for layer in m.model.layers:
        w = layer.mlp.gate.weight
        w.data.copy_(w.data[:1].expand_as(w))
    calls = _steps(monkeypatch)
    ids, am = _batch()
    kw = dict(attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0)
    fast = m.generate(ids, **kw)
    assert calls["route"] == 4 * m.config.num_hidden_layers  # every layer of every native step
    _own(m)
    assert torch.equal(fast, m.generate(ids, **kw))


def test_int8_activations_take_the_native_loop(tiny_ckpt, monkeypatch):
    """With int8 activations the native loop runs the same int8 kernels as the layers' forwards: same tokens."""
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="q4_0", progress=False)
    moeq.set_activations(m, "int8")
    calls = _steps(monkeypatch)
    ids, am = _batch()
    kw = dict(attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0)
    fast = m.generate(ids, **kw)
    assert calls["step"] == 7
    assert torch.equal(fast, type(m).generate(m, ids, **kw))


@pytest.mark.parametrize("act", ["default", "int8"])
def test_a_q8_0_head_decodes_through_its_16_row_copy(tiny_ckpt, act, monkeypatch):
    """An 8-bit head gets its decode copy by 16 output rows when the loop is installed (the head's forward and the
    native step share it: same tokens as transformers' generate on moeq's modules); without the loop, none."""
    from moeq.config import QuantConfig, method
    from moeq.kernels import plans

    cfg = QuantConfig(method("q4_0"), rules={"lm_head": method("q8_0")})
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant=cfg, progress=False)
    moeq.set_activations(m, act)
    calls = _steps(monkeypatch)
    ids, am = _batch()
    kw = dict(attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0)
    fast = m.generate(ids, **kw)
    assert calls["step"] == 7
    stack = plans.linear_plan(m.lm_head).stack
    if native.lib().moeq_rows16_size(stack):
        assert stack.rows16 and stack.rows16_layout == (2 if act == "int8" and native.i8_level() >= 2 else 1)
    assert torch.equal(fast, type(m).generate(m, ids, **kw))
    m.__dict__.pop("generate")
    plans.set_rows16(m.lm_head, False)
    assert plans.linear_plan(m.lm_head).stack.rows16 is None


@pytest.mark.parametrize("kw", [dict(do_sample=True), dict(num_beams=2), dict(output_scores=True,
                                                                             return_dict_in_generate=True),
                                dict(repetition_penalty=1.3), dict(logits_processor=[])])
def test_other_requests_go_to_transformers(tiny_ckpt, kw, monkeypatch):
    """Sampling, beams, scores, penalties and custom processors are transformers' own generate, unchanged."""
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="rtn-int4", progress=False)
    calls = _steps(monkeypatch)
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    args = dict(max_new_tokens=4, pad_token_id=0, **kw)
    torch.manual_seed(0)
    got = m.generate(ids, **args)
    torch.manual_seed(0)
    ref = type(m).generate(m, ids, **args)
    assert calls["step"] == 0
    got, ref = (got.sequences, ref.sequences) if hasattr(got, "sequences") else (got, ref)
    assert torch.equal(got, ref)


def test_inputs_outside_the_loop(tiny_ckpt):
    """Right padding, token ids outside the vocabulary and too many sequences are not the native loop's; a token out
    of range reaching the native step itself is an error, not a read outside the embedding."""
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="rtn-int4", progress=False)
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    right = torch.ones_like(ids)
    right[0, -1] = 0
    vocab = m.config.vocab_size
    assert engine._request(m, (ids,), {"attention_mask": right}) is None
    assert engine._request(m, (ids.clamp(max=vocab - 1) + vocab,), {}) is None
    assert engine._request(m, (ids.repeat(engine.MAX_BATCH // 2 + 1, 1),), {}) is None  # one past the step's rows
    assert engine._request(m, (ids,), {"max_new_tokens": 3, "do_sample": False}) is not None
    eng = engine.engine_of(m)
    md, keep, caches, state = eng.describe(1, 8, 8)
    for tok, pos in [(vocab, 0), (-1, 0), (1, 8)]:
        with pytest.raises(MoeqError):
            eng.step(md, torch.tensor([tok]), torch.tensor([pos]), 1, None, state)


@pytest.mark.parametrize("method", ["q4_0", "rtn-int4"])
def test_eight_sequences_take_the_native_step(tiny_ckpt, method, monkeypatch):
    """8 left-padded sequences: one native call per step where the head's native gemv takes 8 rows on this CPU (a
    quantized head's plan; a kept bf12 head wherever AVX512-BF16, a bf16 one without AMX), the same tokens as
    transformers' own generate on its own modules."""
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant=method, progress=False)
    eng = engine.engine_of(m)
    assert eng is not None
    if eng._head(8) is None:
        pytest.skip(f"{type(m.lm_head).__name__} head: no native 8-row gemv on this CPU")
    calls = _steps(monkeypatch)
    ids = torch.randint(3, 100, (8, 9), generator=torch.Generator().manual_seed(5))
    am = torch.ones_like(ids)
    am[2, :4] = 0
    am[5, :1] = 0
    kw = dict(attention_mask=am, do_sample=False, pad_token_id=0)
    fast = m.generate(ids, max_new_tokens=10, **kw)
    assert calls["step"] == 9
    _own(m)
    # the step runs every linear's gemv on its 8 rows (each row's bits as alone); on AMX the modules' own forwards
    # hand small weights past 4 rows to dequantize + AMX matmul: the reference takes the gemv up to 8 rows there too
    monkeypatch.setattr(plans, "ROWS_SMALL_WEIGHT", max(plans.ROWS_SMALL_WEIGHT, 8))
    for mod in m.modules():
        plans.invalidate(mod)
    assert torch.equal(fast, m.generate(ids, max_new_tokens=10, **kw))
