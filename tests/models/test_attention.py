"""The decode-step attention path vs transformers' sdpa: same math (fp32 here), masks honoured, fallbacks taken."""
import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import moeq
from moeq.nn import attention


class _Mod(nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("mask", [None, "bool", "float", "per_head"])
def test_decode_attention_matches_sdpa(hq, hkv, mask):
    torch.manual_seed(hq + hkv)
    b, s, d = 3, 17, 32
    q, k, v = torch.randn(b, hq, 1, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    m = None
    if mask is not None:
        keep = torch.ones(b, 1 if mask != "per_head" else hq, 1, s, dtype=torch.bool)
        keep[1, ..., :5] = False  # left padding of the second sequence
        keep[2, ..., 3] = False
        m = keep if mask != "float" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    mod = _Mod(hq // hkv)
    ours, _ = attention.attention_forward(mod, q, k, v, m, scaling=0.3)
    ref, _ = sdpa_attention_forward(mod, q, k, v, m, scaling=0.3)
    assert ours.shape == ref.shape == (b, 1, hq, d)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5)
    if m is not None:  # the mask matters: masked keys changed the answer
        free, _ = attention.attention_forward(mod, q, k, v, None, scaling=0.3)
        assert not torch.allclose(free[1], ours[1], atol=1e-3)


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 32), (4, 4, 64), (6, 1, 16)])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_native_bf16_decode_attention(hq, hkv, d, mask):
    """bf16 decode steps run natively over the cache as it is: equal to the fp32 torch path within one bf16 rounding;
    per-head masks keep the torch path."""
    from moeq import native

    if not native.has_simd():
        pytest.skip("needs a SIMD build (AVX512-BF16 or AVX2)")
    torch.manual_seed(hq * d)
    b, s = 3, 23
    q = (torch.randn(b, hq, 1, d) * 2).bfloat16()
    k, v = torch.randn(b, hkv, s, d).bfloat16(), torch.randn(b, hkv, s, d).bfloat16()
    m = None
    if mask is not None:
        keep = torch.ones(b, 1, 1, s, dtype=torch.bool)
        keep[1, ..., :6] = False
        keep[2, ..., 4] = False
        m = keep if mask == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    mod = _Mod(hq // hkv)
    native = attention._native(q, k, v, m, 0.25)
    assert native is not None and native.dtype == torch.bfloat16 and native.shape == (b, 1, hq, d)
    ours, _ = attention.attention_forward(mod, q, k, v, m, scaling=0.25)
    assert torch.equal(ours, native)
    ref, _ = attention.attention_forward(mod, q.float(), k.float(), v.float(), m, scaling=0.25)  # fp32 torch path
    assert ((native.float() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-5 * ref.abs().max()).all()
    if m is not None:
        assert attention._native(q, k, v, m.expand(b, hq, 1, s), 0.25) is None  # per-head mask: torch path


def test_prefill_and_unusual_inputs_take_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(k) or ("sdpa", None))
    mod = _Mod(2)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    assert attention.attention_forward(mod, q, k, k, None)[0] == "sdpa"  # 5 query tokens: prefill
    q1 = q[:, :, :1]
    assert attention.attention_forward(mod, q1, k, k, None, dropout=0.1)[0] == "sdpa"
    assert attention.attention_forward(mod, q1, k, k, None, s_aux=torch.zeros(4))[0] == "sdpa"  # sinks
    assert len(calls) == 3
    assert attention.attention_forward(mod, q1, k, k, None)[0] != "sdpa"


def test_loaded_model_decodes_like_sdpa(tiny_ckpt):
    """A padded batch through generate: per-step logits with the decode path equal sdpa's (fp32 model)."""
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="rtn-int8", dtype=torch.float32, progress=False)
    assert m.config._attn_implementation == attention.NAME
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, :3] = 0
    kw = dict(attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        ours = m.generate(ids, **kw)
        m.set_attn_implementation("sdpa")
        ref = m.generate(ids, **kw)
    assert torch.equal(ours.sequences, ref.sequences)
    for a, b in zip(ours.logits, ref.logits):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_dense_head_gets_standard_strides(tiny_ckpt):
    """transformers slices the last position as a strided [B, 1, K] view; moeq's dense head copies it to standard
    strides first (torch's CPU bf16 linear is ~15x slower on that view when the weight does not require grad)."""
    from moeq.nn.linear import _canonical_input

    head = torch.nn.Linear(16, 40, bias=False).bfloat16().requires_grad_(False)
    hidden = torch.randn(3, 7, 16).bfloat16()
    view = hidden[:, -1:, :]
    (fixed,) = _canonical_input(head, (view,))
    assert fixed.stride() == (16, 16, 1) and torch.equal(fixed, view)
    assert _canonical_input(head, (hidden,)) is None  # already standard: untouched, no copy
    m = moeq.load(tiny_ckpt("qwen3_moe", tie_word_embeddings=True), quant="rtn-int4", progress=False)
    out_head = m.get_output_embeddings()
    assert isinstance(out_head, torch.nn.Linear) and out_head._forward_pre_hooks  # tied: dense, hooked
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        last = m(ids, logits_to_keep=1).logits
        full = m(ids).logits
    assert torch.allclose(last[:, 0].float(), full[:, -1].float(), atol=1e-2)


def _causal64(q, k, v, scale):
    """float64 causal attention (query i sees keys <= i), grouped heads; [B, L, Hq, D]."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    L = q.shape[2]
    s.masked_fill_(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ vv).transpose(1, 2)


@pytest.mark.parametrize("b,hq,hkv,L,d", [(1, 8, 2, 70, 64), (2, 4, 4, 33, 32), (1, 6, 1, 200, 96),
                                          (1, 16, 4, 31, 128)])
def test_native_prefill_attention_matches_float64(b, hq, hkv, L, d):
    """A causal bf16 prompt without a mask runs the native flash-style kernel (key blocks of 32, 16 query rows per
    task: lengths on and off those sizes, grouped and plain heads): within bf16 rounding of the float64 result, no
    further from it than torch's own kernel, through the attention interface as transformers calls it (where it is
    the faster kernel: CPUs without AMX)."""
    from moeq import native

    if not native.has_dpbf16():
        pytest.skip("the prefill kernel needs AVX512-BF16 (others keep transformers' sdpa)")
    torch.manual_seed(L + d)
    q = (torch.randn(b, hq, L, d) * 1.5).bfloat16()
    k, v = torch.randn(b, hkv, L, d).bfloat16(), torch.randn(b, hkv, L, d).bfloat16()
    mod = _Mod(hq // hkv)
    ours = attention._native_prefill(mod, q, k, v, None, 0.0, 0.2, {})
    assert ours is not None and ours.dtype == torch.bfloat16 and ours.shape == (b, L, hq, d)
    exact = _causal64(q, k, v, 0.2)
    ref, _ = sdpa_attention_forward(mod, q, k, v, None, scaling=0.2)
    via, _ = attention.attention_forward(mod, q, k, v, None, scaling=0.2)
    assert torch.equal(via, ref if native.has_amx() else ours)  # with AMX torch's own kernel is the faster one
    err = (ours.double() - exact).abs()
    assert (err <= 2.0 ** -8 * exact.abs() + 2.0 ** -9 * v.double().abs().max()).all()
    assert err.max() <= (ref.double() - exact).abs().max() * 1.5 + 1e-6


def test_native_prefill_attention_domain():
    """NaN in a visible score gives that row NaN (as torch's kernel), a future key's NaN changes nothing earlier;
    masks, fp32, dropout and a non-causal module keep transformers' sdpa; an empty static cache's extra keys are
    cropped as sdpa_attention_forward crops them."""
    from moeq import native

    if not native.has_dpbf16():
        pytest.skip("the prefill kernel needs AVX512-BF16")
    torch.manual_seed(0)
    b, hq, hkv, L, d = 1, 4, 2, 40, 32
    q = torch.randn(b, hq, L, d).bfloat16()
    k, v = torch.randn(b, hkv, L, d).bfloat16(), torch.randn(b, hkv, L, d).bfloat16()
    mod = _Mod(2)
    k2 = k.clone()
    k2[0, 0, 20, 3] = float("nan")  # seen by queries >= 20 of kv head 0 (q heads 0, 1)
    out = attention._native_prefill(mod, q, k2, v, None, 0.0, None, {})
    assert out[0, 20:, :2].isnan().all() and not out[0, :20].isnan().any() and not out[0, :, 2:].isnan().any()
    mask = torch.ones(b, 1, L, L, dtype=torch.bool).tril()
    assert attention._native_prefill(mod, q, k, v, mask, 0.0, None, {}) is None
    assert attention._native_prefill(mod, q.float(), k.float(), v.float(), None, 0.0, None, {}) is None
    assert attention._native_prefill(mod, q, k, v, None, 0.1, None, {}) is None
    assert attention._native_prefill(mod, q, k, v, None, 0.0, None, {"is_causal": False}) is None
    extra = torch.cat([k, torch.randn(b, hkv, 8, d).bfloat16()], 2), torch.cat([v, torch.randn(b, hkv, 8, d).bfloat16()], 2)
    cropped = attention._native_prefill(mod, q, *extra, None, 0.0, None, {})
    ref, _ = sdpa_attention_forward(mod, q, *extra, None)
    assert torch.equal(cropped, attention._native_prefill(mod, q, k, v, None, 0.0, None, {}))
    assert (cropped.float() - ref.float()).abs().max() < 0.02
