"""GPTQ and AWQ int4/int8 checkpoints (written by moeq.tiny.to_gptq after GPTQ's and AutoAWQ's published packing)
loaded into moeq's RTN layout bit for bit: every weight equals the producers' dequantization formula, decoded here
independently of the reader, and the model's logits equal transformers' own forward on those weights."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import moeq
from moeq.tiny import make_checkpoint, to_gptq
from tests.conftest import dequantized_reference


def _expected(path) -> dict[str, torch.Tensor]:
    """``{"X.weight": W}`` decoded from the files the plain way: bit by bit, no reader code."""
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    bits = qc["bits"]
    tensors = {}
    for f in path.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    per, mask = 32 // bits, (1 << bits) - 1
    out = {}
    for key in [k for k in tensors if k.endswith(".qweight")]:
        p = key[: -len("qweight")]
        words, zw, scales = tensors[key].long() & 0xFFFFFFFF, tensors[p + "qzeros"].long() & 0xFFFFFFFF, tensors[
            p + "scales"].float()
        if qc["quant_method"] == "awq":
            order = [0, 2, 4, 6, 1, 3, 5, 7]
            k, n = words.shape[0], words.shape[1] * 8
            q = torch.zeros(k, n, dtype=torch.long)
            z = torch.zeros(zw.shape[0], n, dtype=torch.long)
            for i in range(8):
                q[:, order[i]::8] = (words >> (4 * i)) & mask
                z[:, order[i]::8] = (zw >> (4 * i)) & mask
            g_idx = torch.arange(k) // qc["group_size"]
        else:
            k, n = words.shape[0] * per, words.shape[1]
            q = torch.zeros(k, n, dtype=torch.long)
            z = torch.zeros(zw.shape[0], n, dtype=torch.long)
            for i in range(per):
                q[i::per] = (words >> (bits * i)) & mask
                z[:, i::per] = (zw >> (bits * i)) & mask
            if qc["checkpoint_format"] == "gptq":
                z = (z + 1) & mask
            g_idx = tensors[p + "g_idx"].long()
        out[p + "weight"] = (scales[g_idx] * (q - z[g_idx]).float()).t()
    return out


def _moeq_weights(m) -> dict[str, torch.Tensor]:
    """moeq's weights under the checkpoint's per-expert / per-linear names, dequantized in fp32."""
    got = {}
    for name, mod in m.named_modules():
        if isinstance(mod, moeq.nn.QuantLinear):
            got[name + ".weight"] = mod.qweight.dequantize(torch.float32)
        elif isinstance(mod, moeq.nn.QuantExperts):
            w13, w2 = mod.w13.dequantize(torch.float32), mod.w2.dequantize(torch.float32)
            i = w13.shape[1] // 2
            for e in range(w13.shape[0]):
                got[f"{name}.{e}.gate_proj.weight"] = w13[e, :i]
                got[f"{name}.{e}.up_proj.weight"] = w13[e, i:]
                got[f"{name}.{e}.down_proj.weight"] = w2[e]
    return got


CASES = {
    "gptq-sym-v1": dict(kind="gptq", sym=True),
    "gptq-asym-v2": dict(kind="gptq", sym=False, v1=False),
    "gptq-int8": dict(kind="gptq", bits=8, sym=True),
    "gptq-g-row": dict(kind="gptq", group_size=-1, sym=False),
    "awq": dict(kind="awq", sym=False),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    src = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("gptq_src") / "c")
    return src, {name: to_gptq(src, tmp_path_factory.mktemp(name) / "c", **kw) for name, kw in CASES.items()}


@pytest.mark.parametrize("case", CASES)
def test_loads_bit_for_bit(checkpoints, case):
    src, ckpts = checkpoints
    path = ckpts[case]
    m = moeq.load(path, progress=False, dtype=torch.float32)
    want, got = _expected(path), _moeq_weights(m)
    assert set(want) == set(got)  # every quantized linear and expert of the checkpoint, nothing else
    for key, w in want.items():
        assert torch.equal(got[key], w), key
    ex = next(mod for mod in m.modules() if isinstance(mod, moeq.nn.QuantExperts))
    sym = CASES[case].get("sym")
    assert ex.w13.grid == ("vllm" if sym else "asym") and ex.w13.bits == CASES[case].get("bits", 4)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = dequantized_reference(m, src, torch.float32)
    with torch.no_grad():
        a, b = m(ids).logits, ref(ids).logits
    assert (a - b).abs().max() < 1e-3 * b.abs().max()


def test_bf16_model_decodes_natively(checkpoints):
    """The native CPU kernels run GPTQ weights as loaded (bf16 compute): greedy tokens equal the reference's."""
    src, ckpts = checkpoints
    m = moeq.load(ckpts["gptq-sym-v1"], progress=False)
    ref = dequantized_reference(m, src, torch.bfloat16)
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        la, lb = m(ids).logits.float(), ref(ids).logits.float()
    assert (la - lb).abs().max() < 0.05 * lb.abs().max()
    assert m.generate(ids, **kw).shape == (1, 12)


def test_act_order_needs_a_method(checkpoints, tmp_path):
    src, _ = checkpoints
    path = to_gptq(src, tmp_path / "ao", kind="gptq", act_order=True)
    with pytest.raises(moeq.MoeqError, match="act-order GPTQ.*--method"):
        moeq.load(path, progress=False)
    m = moeq.load(path, quant="rtn-int8", progress=False, dtype=torch.float32)
    want, got = _expected(path), _moeq_weights(m)
    for key, w in want.items():  # re-quantized from the exact dequantization: int8 error only
        assert (got[key] - w).abs().max() <= w.abs().amax(-1, keepdim=True).max() / 100, key


def test_requantize_in_flight(checkpoints):
    _, ckpts = checkpoints
    m = moeq.load(ckpts["awq"], quant="q4_0", progress=False, dtype=torch.float32)
    ex = next(mod for mod in m.modules() if isinstance(mod, moeq.nn.QuantExperts))
    assert ex.w13.grid == "signed" and ex.w13.group_size == 32


@pytest.mark.parametrize("patch,match", [
    (lambda qc: qc.update(bits=3), "bits=3"),
    (lambda qc: qc.update(group_size=100), "group_size=100"),
    (lambda qc: qc.update(checkpoint_format="marlin"), "checkpoint_format"),
])
def test_bad_config_is_a_clear_error(checkpoints, tmp_path, patch, match):
    import shutil

    _, ckpts = checkpoints
    d = tmp_path / "bad"
    shutil.copytree(ckpts["gptq-sym-v1"], d)
    cfg = json.loads((d / "config.json").read_text())
    patch(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(moeq.MoeqError, match=match):
        moeq.load(d, progress=False)


def test_inspect_names_the_reader(checkpoints):
    from moeq.readers import describe

    _, ckpts = checkpoints
    d = describe(ckpts["awq"])
    assert d["reader"] == "gptq/awq" and d["bits"] == 4 and d["group_size"] == 32 and d["quantized_weights"] > 0
