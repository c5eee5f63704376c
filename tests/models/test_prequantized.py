"""Pre-quantized bitsandbytes checkpoints: transformers 4.x per-expert NF4/FP4/int8 fixtures (written by the real
writers, see tests/fixtures/make_bnb_fixtures.py) and transformers 5.x + bitsandbytes checkpoints."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import moeq
from moeq.nn import QuantExperts, QuantLinear

F = pytest.importorskip("bitsandbytes.functional")
FIX = Path(__file__).parent.parent / "fixtures" / "bnb"
ALL = sorted(p.name for p in FIX.iterdir() if p.is_dir())


def stored(d, prefix):
    """bitsandbytes' own decoding of one stored weight (its reference kernels for 4-bit)."""
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = [k for k in f.keys() if k == prefix + "weight" or k.startswith(prefix + "weight.") or k == prefix + "SCB"]
        sd = {k: f.get_tensor(k) for k in keys}
    if prefix + "SCB" in sd:
        return F.int8_vectorwise_dequant(sd[prefix + "weight"], sd[prefix + "SCB"])
    qs = F.QuantState.from_dict({k[len(prefix + "weight."):]: v for k, v in sd.items() if k != prefix + "weight"},
                                device=torch.device("cpu"))
    from tests.formats.test_bnb4 import bnb_reference_dequantize

    return bnb_reference_dequantize(sd[prefix + "weight"], qs).float()


@pytest.mark.parametrize("name", ALL)
def test_experts_equal_bitsandbytes_decoding(name):
    d = FIX / name
    m = moeq.load(d, progress=False)
    mixtral = name.startswith("mixtral")
    disk = "block_sparse_moe" if mixtral else "mlp"
    g, u, dn = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for layer in range(2):
        ex = m.model.layers[layer].mlp.experts
        assert isinstance(ex, QuantExperts)
        w13, w2 = deq(ex.w13), deq(ex.w2)
        for e in range(4):
            p = f"model.layers.{layer}.{disk}.experts.{e}."
            assert torch.equal(w13[e, :128], stored(d, p + g + ".")), (layer, e)
            assert torch.equal(w13[e, 128:], stored(d, p + u + "."))
            assert torch.equal(w2[e], stored(d, p + dn + "."))
    q = m.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantLinear)
    assert torch.equal(deq(q.qweight), stored(d, "model.layers.0.self_attn.q_proj."))


def deq(w):
    """bitsandbytes decodes 4-bit into the stored dtype and LLM.int8 into fp32: compare like with like."""
    return w.dequantize(torch.float32 if w.format == "int8" else None).float()


def test_double_quant_kept_compressed_and_fp4_table():
    m = moeq.load(FIX / "qwen2_moe-nf4-dq", progress=False)
    w13 = m.model.layers[0].mlp.experts.w13
    assert w13.absmax.dtype == torch.uint8 and w13.slices == 8  # per-expert gate/up states, not expanded
    assert w13.bits_per_weight < 4.2
    fp4 = moeq.load(FIX / "qwen2_moe-fp4", progress=False).model.layers[0].mlp.experts.w13
    assert fp4.quant_type == "fp4" and torch.equal(fp4.code, F.get_4bit_type("fp4", device="cpu"))


@pytest.mark.parametrize("name", ["qwen2_moe-nf4-dq", "mixtral-int8", "olmoe-nf4-skipgate"])
def test_moe_forward_vs_dequantized_reference(name, tmp_path):
    from tests.conftest import dequantized_clone

    m = moeq.load(FIX / name, dtype=torch.float32, progress=False)
    ref = dequantized_clone(m)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = m(ids).logits, ref(ids).logits
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    out = moeq.save(m, tmp_path / "saved")
    m2 = moeq.load(out, progress=False)
    s1, s2 = m.state_dict(), m2.state_dict()
    assert set(s1) == set(s2) and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_router_from_checkpoint_form():
    # 4.x Qwen2-MoE quantized its router gate: moeq decodes it with bitsandbytes' math
    m = moeq.load(FIX / "qwen2_moe-nf4-dq", progress=False)
    gate = m.model.layers[0].mlp.gate.weight
    assert torch.equal(gate.float(), stored(FIX / "qwen2_moe-nf4-dq", "model.layers.0.mlp.gate.").to(gate.dtype).float())
    # skipped via llm_int8_skip_modules: kept bf16 exactly as stored
    m = moeq.load(FIX / "olmoe-nf4-skipgate", progress=False)
    with safe_open(str(FIX / "olmoe-nf4-skipgate" / "model.safetensors"), "pt") as f:
        assert torch.equal(m.model.layers[1].mlp.gate.weight, f.get_tensor("model.layers.1.mlp.gate.weight"))
        assert not hasattr(m.lm_head, "qweight")  # kept (held in bf12 or not), exactly as stored
        assert torch.equal(m.lm_head.weight, f.get_tensor("lm_head.weight"))


def test_transformers5_bnb_checkpoint_alignment(tiny_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    src = tiny_ckpt("qwen3_moe")
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(src, quantization_config=bnb, dtype=torch.float32).save_pretrained(tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    lin = theirs.model.layers[0].self_attn.q_proj
    w_theirs = F.dequantize_4bit(lin.weight.data, lin.weight.quant_state).float()  # before any forward repacks it
    ours = moeq.load(tmp_path, quant="none", dtype=torch.float32, progress=False)  # experts stay as stored
    assert torch.equal(ours.model.layers[0].self_attn.q_proj.qweight.dequantize(torch.float32), w_theirs)
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids).logits, theirs(ids).logits
    # bitsandbytes' CPU 4-bit matmul computes in reduced precision (~0.3% per layer): compare loosely
    assert (a - b).abs().max() <= 0.02 * b.abs().max()
    # in-flight: the bf16 experts take the checkpoint's own bnb settings
    inflight = moeq.load(tmp_path, progress=False)
    w13 = inflight.model.layers[0].mlp.experts.w13
    assert (w13.quant_type, w13.blocksize, w13.double_quant) == ("nf4", 64, True)
    custom = moeq.load(tmp_path, quant=moeq.FP4(128, False), progress=False).model.layers[0].mlp.experts.w13
    assert (custom.quant_type, custom.blocksize, custom.double_quant) == ("fp4", 128, False)


def _copy(name, tmp_path):
    d = tmp_path / name
    shutil.copytree(FIX / name, d)
    return d


def _edit(d, fn):
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    save_file(fn(sd), str(d / "model.safetensors"), metadata={"format": "pt"})


P = "model.layers.0.mlp.experts.1.up_proj.weight"


@pytest.mark.parametrize("mutation,msg", [
    (lambda sd: {k: v for k, v in sd.items() if k != P + ".quant_state.bitsandbytes__nf4"}, "quant_state JSON .*missing"),
    (lambda sd: sd | {P + ".quant_state.bitsandbytes__nf4": torch.tensor(list(b"{oops"), dtype=torch.uint8)},
     "unparsable"),
    (lambda sd: sd | {P + ".absmax": sd[P + ".absmax"][:-3]}, r"absmax: 253 values, expected 256"),
    (lambda sd: sd | {P: sd[P][:-2]}, "packed size .* does not match the declared shape"),
    (lambda sd: {k: v for k, v in sd.items() if ".layers.1.mlp.experts.3." not in k}, "lacks expert weights"),
])
def test_bad_prequantized_input(mutation, msg, tmp_path):
    d = _copy("qwen2_moe-nf4-dq", tmp_path)
    _edit(d, mutation)
    with pytest.raises(ValueError, match=msg):
        moeq.load(d, progress=False)


def test_bad_quant_type_and_dtype_strings(tmp_path):
    d = _copy("qwen2_moe-nf4-dq", tmp_path)
    for field, val, msg in (("quant_type", "nf5", "unknown quant_type"), ("dtype", "float8", "unknown dtype")):
        def mutate(sd, field=field, val=val):
            js = json.loads(bytes(sd[P + ".quant_state.bitsandbytes__nf4"].tolist()))
            js[field] = val
            return sd | {P + ".quant_state.bitsandbytes__nf4": torch.tensor(list(json.dumps(js).encode()),
                                                                          dtype=torch.uint8)}
        _edit(d, mutate)
        with pytest.raises(ValueError, match=msg):
            moeq.load(d, progress=False)
        shutil.rmtree(d)
        d = _copy("qwen2_moe-nf4-dq", tmp_path)


def test_gate_up_state_mismatch_is_an_error(tmp_path):
    d = _copy("qwen2_moe-nf4-dq", tmp_path)
    from moeq.formats import bnb4

    def requant(sd):
        w = torch.randn(128, 128, dtype=torch.bfloat16)
        new = bnb4.quantize(w, "nf4", 128, True).state_dict(P[: -len("weight")])
        return {k: v for k, v in sd.items() if not k.startswith(P)} | new

    _edit(d, requant)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: cannot join .*blocksize"):
        moeq.load(d, progress=False)
