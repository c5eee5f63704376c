"""bnb4 parity with bitsandbytes: bytes, absmax, nested statistics, dequantized values."""
import json

import pytest
import torch

from moeq.formats import bnb4
from moeq.formats.codebooks import code4, dynamic_map

F = pytest.importorskip("bitsandbytes.functional")  # a test extra: installed by `make test`

SHAPES = [(40, 64), (7, 33), (3, 40, 64), (2, 5, 100, 30)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def bnb_reference_blockwise(x, code, blocksize):
    """bitsandbytes' own reference (PyTorch) blockwise kernel, bypassing its native CPU library."""
    ks = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(ks, x, code, blocksize)


def bnb_reference_dequantize(P, S):
    """bitsandbytes' reference (PyTorch) 4-bit dequantize kernel. Its native CPU kernel mis-assigns absmax blocks
    when blocks straddle rows (e.g. [40, 64] with blocksize 128, or [48, 80] with 64), so the reference is the
    ground truth."""
    absmax = S.absmax
    if S.nested:
        absmax = F.dequantize_blockwise(S.absmax, S.state2) + S.offset
    ks = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return torch.ops.bitsandbytes.dequantize_4bit.default.redispatch(
        ks, P, absmax.float(), S.blocksize, S.quant_type, S.shape, S.dtype)


def test_code_tables_match_bitsandbytes():
    assert torch.equal(dynamic_map(), F.create_dynamic_map())
    for qt in ("nf4", "fp4"):
        assert torch.equal(code4(qt), F.get_4bit_type(qt, device="cpu"))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", [32, 64, 128, 256, 512, 1024, 2048, 4096])
def test_single_tensor_parity(shape, dtype, quant_type, blocksize):
    torch.manual_seed(hash((shape, blocksize)) % 1000)
    w = torch.randn(shape, dtype=dtype)
    q = bnb4.quantize(w, quant_type, blocksize, double_quant=False, slices=1)
    P, S = F.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=False)
    assert torch.equal(q.packed.reshape(-1, 1), P)
    assert torch.equal(q.absmax[0], S.absmax)
    assert torch.equal(q.dequantize(), bnb_reference_dequantize(P, S))
    if shape[-1] % blocksize == 0:  # bitsandbytes' native CPU kernel is right only when blocks don't straddle rows
        assert torch.equal(q.dequantize(), F.dequantize_4bit(P, S))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", [32, 64, 4096])
def test_double_quant_parity(shape, dtype, quant_type, blocksize):
    torch.manual_seed(1)
    w = torch.randn(shape, dtype=dtype) * 0.02
    q = bnb4.quantize(w, quant_type, blocksize, double_quant=True, slices=1)
    P, S = F.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=True)
    assert torch.equal(q.packed.reshape(-1, 1), P)
    assert torch.equal(q.offset[0], S.offset)
    assert torch.equal(q.nested_absmax[0], S.state2.absmax)
    assert torch.equal(q.nested_code, S.state2.code)
    # The absmax codes equal bitsandbytes' reference kernel on the same (absmax - offset) input ...
    _, S0 = F.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=False)
    ref_codes, ref_absmax = bnb_reference_blockwise(S0.absmax - S.offset,
                                                    S.state2.code, 256)
    assert torch.equal(q.absmax[0], ref_codes)
    # ... and bitsandbytes' native CPU library (which approximates that search) agrees on >= 97% of them.
    theirs_absmax = F.dequantize_blockwise(S.absmax, S.state2) + S.offset
    assert (q.resolved_absmax()[0] == theirs_absmax).float().mean() >= 0.97
    # Decoding bitsandbytes' own state with our code gives its exact values.
    theirs = bnb4.Bnb4Weight.from_state_dict({f"weight.{k}" if k != "weight" else k: v
                                              for k, v in {"weight": P, **S.as_dict(packed=True)}.items()})
    assert torch.equal(theirs.dequantize(), bnb_reference_dequantize(P, S))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
def test_stack_per_expert_and_whole(quant_type, double_quant):
    torch.manual_seed(2)
    w = torch.randn(4, 48, 80, dtype=torch.bfloat16)
    q = bnb4.quantize(w, quant_type, 64, double_quant)
    assert q.slices == 4
    for e in range(4):
        P, S = F.quantize_4bit(w[e], blocksize=64, quant_type=quant_type, compress_statistics=double_quant)
        sd = q[e].state_dict("m.")
        assert torch.equal(sd["m.weight"], P)
        if double_quant:
            assert torch.equal(q.offset[e], S.offset) and torch.equal(q.nested_absmax[e], S.state2.absmax)
        else:
            assert torch.equal(q.absmax[e], S.absmax)
            assert torch.equal(q[e].dequantize(), bnb_reference_dequantize(P, S))
    assert torch.equal(q.dequantize()[2], q[2].dequantize())
    whole = bnb4.quantize(w, quant_type, 64, double_quant, slices=1)
    P, S = F.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=double_quant)
    assert torch.equal(whole.packed.reshape(-1, 1), P)
    assert whole.dequantize().shape == w.shape


def test_state_dict_keys_and_json_match_bitsandbytes():
    w = torch.randn(64, 96, dtype=torch.bfloat16)
    q = bnb4.quantize(w, "nf4", 64, True)
    P, S = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    theirs = {"p.weight": P, **{f"p.weight.{k}": v for k, v in S.as_dict(packed=True).items()}}
    ours = q.state_dict("p.")
    assert set(ours) == set(theirs)
    key = "p.weight.quant_state.bitsandbytes__nf4"
    assert torch.equal(ours[key], theirs[key])  # same JSON bytes
    for k in ("p.weight", "p.weight.nested_absmax", "p.weight.nested_quant_map", "p.weight.quant_map"):
        assert torch.equal(ours[k], theirs[k]), k
    back = bnb4.Bnb4Weight.from_state_dict(ours, "p.")
    assert torch.equal(back.dequantize(), q.dequantize())


def test_sqnr_floor():
    torch.manual_seed(3)
    for w in (torch.randn(256, 512), torch.distributions.StudentT(4.0).sample((256, 512))):
        for qt, floor in (("nf4", 18.0), ("fp4", 15.0)):
            err = w - bnb4.quantize(w, qt, 64, True).dequantize()
            sqnr = 10 * torch.log10(w.pow(2).sum() / err.pow(2).sum())
            assert sqnr > floor, (qt, sqnr)


def test_bits_per_weight():
    w = torch.randn(8, 256, 512, dtype=torch.bfloat16)
    assert abs(bnb4.quantize(w, "nf4", 64, False).bits_per_weight - 4.5) < 0.01
    assert abs(bnb4.quantize(w, "nf4", 64, True).bits_per_weight - 4.127) < 0.01


def test_bad_input():
    w = torch.randn(16, 64)
    w[3, 5] = float("nan")
    with pytest.raises(ValueError, match="layer.w.*non-finite"):
        bnb4.quantize(w, name="layer.w")
    with pytest.raises(ValueError, match=r"valid choices: \[32, 64"):
        bnb4.quantize(torch.randn(4, 64), blocksize=48)
    with pytest.raises(ValueError, match="nf4"):
        bnb4.quantize(torch.randn(4, 64), quant_type="int4")
    z = bnb4.quantize(torch.zeros(4, 64), "fp4", 64, True)
    assert torch.equal(z.dequantize(), torch.zeros(4, 64, dtype=torch.float32))


def test_from_state_dict_errors():
    sd = bnb4.quantize(torch.randn(32, 64), "nf4", 64, True).state_dict("x.")
    qs = "x.weight.quant_state.bitsandbytes__nf4"
    with pytest.raises(ValueError, match="quant_state.*missing"):
        bnb4.Bnb4Weight.from_state_dict({k: v for k, v in sd.items() if k != qs}, "x.")
    bad = dict(sd, **{qs: torch.tensor(list(b"{not json"), dtype=torch.uint8)})
    with pytest.raises(ValueError, match="unparsable"):
        bnb4.Bnb4Weight.from_state_dict(bad, "x.")
    js = json.loads(bytes(sd[qs].tolist()))
    for field, val, msg in (("quant_type", "nf5", "unknown quant_type"), ("dtype", "float8", "unknown dtype"),
                            ("shape", [32, 66], "packed size")):
        blob = json.dumps({**js, field: val}).encode()
        with pytest.raises(ValueError, match=msg):
            bnb4.Bnb4Weight.from_state_dict(dict(sd, **{qs: torch.tensor(list(blob), dtype=torch.uint8)}), "x.")
    with pytest.raises(ValueError, match="x.weight.absmax"):
        bnb4.Bnb4Weight.from_state_dict(dict(sd, **{"x.weight.absmax": sd["x.weight.absmax"][:-1]}), "x.")


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("blocksize", [32, 64, 256])
def test_native_kernels_equal_torch(quant_type, dtype, blocksize):
    torch.manual_seed(5)
    w = (torch.randn(4, 32, 256) * 0.03).to(dtype)
    w[1, :2] = 0
    a = bnb4.quantize(w, quant_type, blocksize, True, native=True)
    b = bnb4.quantize(w, quant_type, blocksize, True, native=False)
    for n in ("packed", "absmax", "offset", "nested_absmax"):
        assert torch.equal(getattr(a, n), getattr(b, n)), n
    for out in (torch.bfloat16, torch.float32):
        assert torch.equal(a.dequantize(out), a.dequantize_reference(out))
    w[3, 7, 9] = float("inf")
    with pytest.raises(ValueError, match="w13.*non-finite"):
        bnb4.quantize(w, quant_type, blocksize, name="w13")


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_absmax_search_equals_torch(quant_type, dtype):
    """nf4-opt's absmax search natively (moeq_bnb4_quantize_search) gives its plain-torch reference's bytes, up to a
    near-tie between two candidates (sums in another order), and never a larger error."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(3, 64, 512, generator=g) * 0.02).to(dtype)
    w[0, 0, :32] = 0
    a = bnb4.quantize(w, quant_type, 32, True, search=20)
    b = bnb4.quantize(w, quant_type, 32, True, search=20, native=False)
    assert (a.packed == b.packed).float().mean() > 0.999 and (a.absmax == b.absmax).float().mean() > 0.999
    err = lambda q: float(((q.dequantize(torch.float32) - w.float()) ** 2).sum())  # noqa: E731
    assert abs(err(a) - err(b)) <= 1e-4 * err(b)
    plain = bnb4.quantize(w, quant_type, 32, True)
    assert err(a) < err(plain)
    w[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="w13.*non-finite"):
        bnb4.quantize(w, quant_type, 32, True, search=20, name="w13")
