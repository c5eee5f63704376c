"""The serving batch's decode step, bit for bit: 8 rows decoded together (one ``[8, 1]`` step over their joined
caches, as the scheduler runs it) give each row exactly the logits it gets alone — on CPUs whose kernels keep one
path at every batch size up to 16 rows (AVX512-BF16 without AMX: the bf16 head's gemv, the quantized linears' gemv,
the fused MoE). Elsewhere the head or the linears change kernels with the batch size (docs/serve.md)."""
import pytest
import torch

from moeq import native

pytestmark = pytest.mark.skipif(native.lib() is None or not native.has_dpbf16() or native.has_amx(),
                                reason="batch-invariant decode needs AVX512-BF16 without AMX (this CPU differs)")


@pytest.mark.parametrize("method", ["q4_0", "rtn-int4"])
def test_eight_rows_decode_exactly_as_alone(tiny_model, method):
    from transformers import DynamicCache

    from moeq.serve import loader

    m, _, _, _ = loader(str(tiny_model), quant=method, batch=8)()
    g = torch.Generator().manual_seed(0)
    b, t = 8, 12
    vocab = m.config.vocab_size
    ids, nxt = torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, 1), generator=g)

    def prompt(i):
        c = DynamicCache(config=m.config)
        m(input_ids=ids[i:i + 1], attention_mask=torch.ones(1, t, dtype=torch.long), cache=c, use_cache=True,
          logits_to_keep=1)
        return c

    with torch.inference_mode():
        alone = []
        for i in range(b):
            out = m(input_ids=nxt[i:i + 1], position_ids=torch.tensor([[t]]), cache=prompt(i), use_cache=True)
            alone.append(out.logits[0, -1])
        caches = [prompt(i) for i in range(b)]
        joined = DynamicCache(config=m.config)
        for layer in range(len(caches[0].layers)):
            joined.update(torch.cat([c.layers[layer].keys for c in caches]),
                          torch.cat([c.layers[layer].values for c in caches]), layer)
        out = m(input_ids=nxt, attention_mask=torch.ones(b, t + 1, dtype=torch.long),
                position_ids=torch.full((b, 1), t), cache=joined, use_cache=True).logits[:, -1]
    for i in range(b):
        assert torch.equal(out[i].view(torch.int16), alone[i].view(torch.int16)), i
