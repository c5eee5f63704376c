"""Native decode forwards for RMSNorms and softmax top-k routers (moeq.nn.decode): installed only where they
reproduce the module's own forward, equal to it within one bf16 rounding, the module's own forward outside their
domain, and the same generated tokens end to end."""
import copy
import io

import pytest
import torch
from torch import nn

import moeq
from moeq import native
from moeq.nn import decode
from moeq.nn.bf12 import Bf12Linear

pytestmark = pytest.mark.skipif(not native.has_simd(), reason="native decode forwards need AVX512-BF16 or AVX2")


def _installed(model):
    return [n for n, m in model.named_modules() if "forward" in m.__dict__]


def _own(model):
    for m in model.modules():
        m.__dict__.pop("forward", None)


@pytest.mark.parametrize("arch,routers,layers", [("qwen3_moe", True, True), ("mixtral", True, True),
                                                 ("olmoe", True, True), ("qwen2_moe", True, True),
                                                 ("llama", False, False)])
def test_installed_forwards_match_the_modules_own(tiny_ckpt, arch, routers, layers):
    """Norms, routers, attention and heads get native forwards; whole decoder layers (two native calls per decode
    step) where every part runs natively: Qwen3-MoE, Mixtral, OLMoE (q/k norms over the whole projection) and Qwen2-MoE
    (q/k/v biases, a gated shared expert), not dense Llama; each layer compared in generate below."""
    m = moeq.load(tiny_ckpt(arch), quant="rtn-int4", progress=False)
    names = _installed(m)
    fused = [n for n in names if type(m.get_submodule(n)).__name__.endswith("DecoderLayer")]
    assert len(fused) == (m.config.num_hidden_layers if layers else 0)
    names = [n for n in names if n not in fused]
    norms = [n for n, mod in m.named_modules() if type(mod).__name__.endswith("RMSNorm")]
    assert set(norms) <= set(names) and norms
    assert any("gate" in n or "router" in n for n in names) == routers
    attn = [n for n in names if n.endswith("self_attn")]
    assert len(attn) == m.config.num_hidden_layers  # Llama-style attention: all of them (compared in generate below)
    # the bf16 head the default policy keeps, untied: held in bf12 (12 bits per weight, the same weights), one native
    # gemv at 1-4 rows; compared with F.linear on its unpacked weight in tests/kernels/test_bf12.py
    assert isinstance(m.lm_head, Bf12Linear) and "lm_head" not in names
    g = torch.Generator().manual_seed(1)
    for name in names:
        if name in attn:
            continue
        mod = m.get_submodule(name)
        n = mod.weight.shape[-1]
        for shape in [(1, 1, n), (3, 1, n), (2, 5, n)]:
            x = (torch.randn(*shape, generator=g) * 2).bfloat16()
            got, ref = mod(x), type(mod).forward(mod, x)
            for a, b in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
                assert a.dtype == b.dtype and a.shape == b.shape, name
                if a.dtype == torch.int64:
                    assert torch.equal(a, b), name
                else:
                    assert ((a.float() - b.float()).abs() <= 2 ** -7 * b.float().abs() + 1e-6).all(), name
        big = torch.randn(2, decode.MAX_ROWS, n, generator=g).bfloat16()  # over MAX_ROWS: the module's own forward
        out, ref = mod(big), type(mod).forward(mod, big)
        assert all(torch.equal(a, b) for a, b in zip(out if isinstance(out, tuple) else (out,),
                                                     ref if isinstance(ref, tuple) else (ref,)))


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "llama"])
def test_generate_unchanged(tiny_ckpt, arch):
    """Greedy tokens and per-step logits with the native forwards equal the modules' own, also for a left-padded
    batch (the attention mask reaches the native attention)."""
    m = moeq.load(tiny_ckpt(arch), quant="rtn-int4", progress=False)
    ids = torch.randint(3, 100, (3, 7), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, :3] = 0
    kw = dict(attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    fast = m.generate(ids, **kw)
    _own(m)
    ref = m.generate(ids, **kw)
    assert torch.equal(fast.sequences, ref.sequences)
    for a, b in zip(fast.logits, ref.logits):
        assert torch.allclose(a, b, atol=2e-2 * b.abs().max(), rtol=0)


def test_copies_and_pickles_rebind(tiny_ckpt):
    """A model copied or pickled after decoding (native plans cached on its modules) still works."""
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="rtn-int4", progress=False)
    assert _installed(m)
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    fast = m.generate(ids, **kw)
    c = copy.deepcopy(m)
    norm = c.model.norm
    assert norm.forward.mod is norm  # bound to the copy, not to the original
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    p = torch.load(buf, weights_only=False)
    _own(m)
    assert torch.equal(fast, m.generate(ids, **kw))
    assert torch.equal(fast, c.generate(ids, **kw))
    assert torch.equal(fast, p.generate(ids, **kw))


class ClippedAttention(nn.Module):  # OLMoE-style clip_qkv: not a variant the native forward computes
    def __init__(self):
        super().__init__()
        self.q_proj = self.k_proj = self.v_proj = self.o_proj = nn.Linear(64, 64).bfloat16()
        self.head_dim, self.layer_idx = 16, 0
        self.config = type("C", (), {"clip_qkv": 8.0})()


class GemmaStyleRMSNorm(nn.Module):  # (1 + weight): a variant the native forward does not compute
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n).bfloat16())
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1.0 + self.weight.float()) * h.to(x.dtype)


class SigmoidTopKRouter(nn.Module):  # sigmoid scoring: no softmax variant reproduces it
    def __init__(self):
        super().__init__()
        self.top_k, self.hidden_dim = 2, 64
        self.weight = nn.Parameter(torch.randn(8, 64).bfloat16())

    def forward(self, h):
        logits = nn.functional.linear(h.reshape(-1, 64), self.weight)
        v, i = torch.topk(torch.sigmoid(logits.float()), 2, dim=-1)
        return logits, v, i


def test_variants_keep_their_own_forward():
    model = nn.Sequential(GemmaStyleRMSNorm(64), SigmoidTopKRouter(), ClippedAttention())
    assert decode.install(model) == {"rms_norm": 0, "router": 0, "attention": 0, "head": 0, "layer": 0}
    assert not _installed(model)


def test_fp32_modules_left_alone(tiny_ckpt):
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="rtn-int8", dtype=torch.float32, progress=False)
    assert not _installed(m)


def test_fused_layers_leave_other_caches_to_the_layers_own_forward(tiny_ckpt):
    """A static cache (its update returns the whole preallocated length) runs the layers' own forward: the same
    tokens as without the native forwards, no error."""
    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="rtn-int4", progress=False)
    assert any(type(mod).__name__.endswith("DecoderLayer") for n, mod in m.named_modules() if "forward" in mod.__dict__)
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    static = m.generate(ids, cache_implementation="static", **kw)
    dynamic = m.generate(ids, **kw)
    _own(m)
    assert torch.equal(static, m.generate(ids, **kw)) and torch.equal(dynamic, static)


def test_fused_layers_batches_beyond_the_moe_kernel(tiny_ckpt):
    """More sequences than the MoE kernel's 8 rows per expert take the layers' own forward: the same tokens as
    without any native forward, for a 9-sequence batch."""
    m = moeq.load(tiny_ckpt("mixtral"), quant="rtn-int4", progress=False)
    ids = torch.randint(3, 100, (9, 4), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    fast = m.generate(ids, **kw)
    _own(m)
    assert torch.equal(fast, m.generate(ids, **kw))


def test_decode_step_builds_no_row_major_copies(tiny_ckpt, monkeypatch):
    """A decode step through the model's forward reads the il16 decode layout as held: nothing permutes a weight
    back to row-major per step (asking ``hasattr(linear, "qweight")`` once did, costing a third of each step)."""
    from transformers import DynamicCache

    from moeq.nn import packed

    m = moeq.load(tiny_ckpt("qwen3_moe"), quant="rtn-int4", progress=False)
    held = [mod for mod in m.modules() if packed.holds(mod, "weight") and packed.is_il16(mod, "weight")]
    assert held  # the tiny model's projections are in the il16 layout
    calls = []
    real = packed.from_il16
    monkeypatch.setattr(packed, "from_il16", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        cache = DynamicCache(config=m.config)
        m(input_ids=torch.tensor([[5, 6, 7]]), cache=cache, use_cache=True)
        calls.clear()
        for i in range(3):
            m(input_ids=torch.tensor([[8 + i]]), position_ids=torch.tensor([[3 + i]]), cache=cache, use_cache=True)
    assert calls == []


def test_head_for_batches_keeps_the_weights(tiny_ckpt):
    """The serving choice for batches: a bf12 head held as bf16 again — the same weights exactly, the same logits up
    to summation order, at every row count."""
    from moeq.nn import bf12, decode

    m = moeq.load(tiny_ckpt("qwen3_moe", hidden_size=128), quant="rtn-int4", progress=False)
    head = m.get_output_embeddings()
    assert isinstance(head, bf12.Bf12Linear)
    want = head.unpack()
    ids = torch.randint(3, 200, (6, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = m(ids).logits.float()
        assert decode.head_for_batches(m)
        after = m(ids).logits.float()
    new = m.get_output_embeddings()
    assert type(new) is torch.nn.Linear and torch.equal(new.weight, want)
    assert (before - after).abs().max() <= 2 ** -7 * before.abs().max()
    assert not decode.head_for_batches(m)  # already plain
