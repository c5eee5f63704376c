"""LLM.int8 parity with bitsandbytes' Int8Params and Linear8bitLt state dicts."""
import pytest
import torch

from moeq.formats import int8

bnb = pytest.importorskip("bitsandbytes")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(48, 64), (17, 33)])
def test_matches_int8params(dtype, shape):
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=dtype)
    p = bnb.nn.Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False)
    p = p._quantize("cpu")
    q = int8.quantize(w)
    assert torch.equal(q.weight, p.data)
    assert torch.equal(q.scb, p.SCB)
    ref = bnb.functional.int8_vectorwise_dequant(p.data, p.SCB)
    assert torch.equal(q.dequantize(torch.float32), ref)


def test_state_dict_matches_linear8bitlt():
    torch.manual_seed(1)
    lin = bnb.nn.Linear8bitLt(64, 32, bias=False, has_fp16_weights=False)
    w = torch.randn(32, 64, dtype=torch.float16)
    lin.weight = bnb.nn.Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False)
    lin = lin.to("cpu")
    theirs = lin.state_dict(prefix="m.")
    ours = int8.quantize(w).state_dict("m.")
    assert set(ours) == set(theirs)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    back = int8.Int8Weight.from_state_dict(theirs, "m.", dtype=torch.float16)
    assert torch.equal(back.dequantize(), int8.quantize(w).dequantize())


def test_stack_and_errors():
    w = torch.randn(3, 8, 16)
    q = int8.quantize(w)
    assert q.weight.shape == (3, 8, 16) and q.scb.shape == (3, 8)
    assert torch.equal(q[1].weight, int8.quantize(w[1]).weight)
    assert torch.equal(int8.quantize(torch.zeros(2, 8)).dequantize(), torch.zeros(2, 8))
    w[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="experts.w2.*non-finite"):
        int8.quantize(w, name="experts.w2")
    with pytest.raises(ValueError, match="SCB"):
        int8.Int8Weight.from_state_dict({"weight": torch.zeros(4, 8, dtype=torch.int8), "SCB": torch.ones(3)})
    sq = 10 * torch.log10(w[1:].pow(2).sum() / (w[1:] - q.dequantize(torch.float32)[1:]).pow(2).sum())
    assert sq > 38


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_dequant_equals_torch(dtype):
    torch.manual_seed(3)
    q = int8.quantize(torch.randn(3, 40, 256) * 0.05)
    assert torch.equal(q.dequantize(dtype), q.dequantize_reference(dtype))
