"""compressed-tensors ``float-quantized`` (FP8 W8A16, what llm-compressor writes): checkpoints rounded by
compressed-tensors' own ``quantize``, read by moeq bit for bit as compressed-tensors' own ``dequantize`` gives them, in
each strategy (tensor, channel, group, block with partial edge tiles); kept, or quantized in flight."""
import json

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize
from safetensors import safe_open

import moeq
from moeq.errors import MoeqError
from moeq.tiny import make_checkpoint, to_ct_fp8

STRATEGIES = [("tensor", None), ("channel", None), ("group", 16), ("block", (48, 64))]  # 48x64: partial tiles


def _reference(path, strategy, size) -> dict[str, torch.Tensor]:
    """Every FP8 weight as compressed-tensors dequantizes it (bf16)."""
    extra = ({"block_structure": list(size)} if strategy == "block" else {"group_size": size} if strategy == "group"
             else {})
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy, **extra)
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                if t.dtype == torch.float8_e4m3fn:
                    out[k] = dequantize(t, h.get_tensor(k + "_scale"), None, args, dtype=torch.bfloat16)
    return out


@pytest.mark.parametrize("strategy,size", STRATEGIES)
def test_ct_fp8_reads_bit_exact(tmp_path, strategy, size):
    src = make_checkpoint("mixtral", tmp_path / "src", intermediate_size=80)  # 80 rows: a partial 48-row tile
    ckpt = to_ct_fp8(src, tmp_path / "ct", strategy, size)
    ref = _reference(ckpt, strategy, size)
    assert any(".experts.0.w1.weight" in k for k in ref) and any("q_proj" in k for k in ref)
    m = moeq.load(ckpt, progress=False)
    sd = m.state_dict()
    for key, want in ref.items():
        if ".experts." in key:  # per-expert w1/w3/w2 on disk -> the fused stacks
            layer, e, proj = key.split(".block_sparse_moe.experts.")[0], *key.split(".experts.")[1].split(".")[:2]
            e = int(e)
            gu, down = sd[f"{layer}.mlp.experts.gate_up_proj"], sd[f"{layer}.mlp.experts.down_proj"]
            i = down.shape[-1]
            got = {"w1": gu[e, :i], "w3": gu[e, i:], "w2": down[e]}[proj]
        else:
            got = sd[key]
        assert torch.equal(got, want), key
    own = moeq.load(src, progress=False).state_dict()
    assert torch.equal(sd["lm_head.weight"], own["lm_head.weight"])  # ignored: kept as stored
    assert torch.equal(sd["model.layers.0.mlp.gate.weight"], own["model.layers.0.mlp.gate.weight"])  # the router
    q = moeq.load(ckpt, quant="q4_0", progress=False)  # re-quantized in flight from the exact weights
    assert moeq.inspect(q)["quantized_params"] > 0
    ids = torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(q(ids).logits).all() and torch.isfinite(m(ids).logits).all()


def test_ct_fp8_refusals(tmp_path):
    src = make_checkpoint("qwen3_moe", tmp_path / "src")
    ckpt = to_ct_fp8(src, tmp_path / "ct", "group", 32)
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 48  # does not divide 128
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(MoeqError, match="group_size 48 does not divide"):
        moeq.load(ckpt, progress=False)
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=32, num_bits=4)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(MoeqError, match="not FP8 e4m3"):
        moeq.load(ckpt, progress=False)
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8, strategy="block",
                                                                             block_structure=[128, 128])
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(MoeqError, match="expected"):  # the scales' shape no longer matches the weights
        moeq.load(ckpt, progress=False)
