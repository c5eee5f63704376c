"""Checkpoints that ship a multi-token-prediction (NextN) head — DeepSeek-V3/R1, Kimi K2 and GLM-4.5 as
``model.layers.{num_hidden_layers}.*``, Qwen3-Next as ``mtp.*`` — are valid input: transformers' models do not run
that head (they ignore its keys on load), and moeq loads such checkpoints to the same model as without it, from
bf16 and from DeepSeek's FP8 release layout, and streams them to GGUF."""
import json

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

import moeq
from moeq.export import export_checkpoint
from moeq.formats.fp8 import Fp8Weight
from moeq.tiny import make_checkpoint, to_fp8


def add_mtp_shard(src, model_type):
    """``src`` with a second shard holding an MTP head (a copy of the last layer plus the NextN projections, as the
    releases lay it out) and the index listing both shards."""
    sd = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    last, n = cfg["num_hidden_layers"] - 1, cfg["num_hidden_layers"]
    prefix = "mtp.layers.0." if model_type == "qwen3_next" else f"model.layers.{n}."
    mtp = {k.replace(f"model.layers.{last}.", prefix): v.clone() for k, v in sd.items()
           if k.startswith(f"model.layers.{last}.")}
    h = cfg["hidden_size"]
    head = "mtp." if model_type == "qwen3_next" else prefix
    mtp.update({head + "eh_proj.weight": torch.randn(h, 2 * h, dtype=torch.bfloat16),
                head + "enorm.weight": torch.ones(h, dtype=torch.bfloat16),
                head + "hnorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    save_file(mtp, str(src / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {**{k: "model.safetensors" for k in sd},
                                            **{k: "model-mtp.safetensors" for k in mtp}}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    if model_type != "qwen3_next":
        cfg["num_nextn_predict_layers"] = 1
        (src / "config.json").write_text(json.dumps(cfg))
    return src


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe", "qwen3_next"])
def test_mtp_head_is_skipped_not_fatal(model_type, tmp_path):
    plain = make_checkpoint(model_type, tmp_path / "plain")
    with_mtp = add_mtp_shard(make_checkpoint(model_type, tmp_path / "mtp"), model_type)
    a = moeq.load(plain, quant="q4_0", progress=False, dtype=torch.float32)
    b = moeq.load(with_mtp, quant="q4_0", progress=False, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_deepseek_fp8_release_layout_with_mtp_streams_to_gguf(tmp_path):
    """DeepSeek-V3's release as downloaded: FP8 block-scaled, sharded, with its NextN layer."""
    src = to_fp8(add_mtp_shard(make_checkpoint("deepseek_v3", tmp_path / "ds"), "deepseek_v3"), tmp_path / "fp8")
    assert any("model.layers.2." in k for k in json.loads((src / "model.safetensors.index.json").read_text())[
        "weight_map"])
    m = moeq.load(src, quant="fp8", progress=False)  # kept as stored, natively
    assert isinstance(m.model.layers[1].self_attn.q_a_proj.qweight, Fp8Weight)
    s = export_checkpoint(src, tmp_path / "ds.gguf", "gguf", quant="q4_0")
    names = [t.name for t in gguf.GGUFReader(tmp_path / "ds.gguf").tensors]
    assert s["streamed"] and "blk.1.ffn_up_exps.weight" in names and not any(n.startswith("blk.2.") for n in names)


def test_inspect_counts_the_skipped_head(tmp_path, capsys):
    from moeq.cli import main

    src = add_mtp_shard(make_checkpoint("deepseek_v3", tmp_path / "ds"), "deepseek_v3")
    assert main(["inspect", str(src), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    n_mtp = sum(k.startswith("model.layers.2.") for k in json.loads(
        (src / "model.safetensors.index.json").read_text())["weight_map"])
    assert out["source"]["skipped_mtp_tensors"] == n_mtp > 0
