"""Bad checkpoints and outputs: a clear error naming the file/tensor/key, and nothing partial left on disk."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import moeq
from moeq.cli import main


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite(path, fn):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    sd = fn(sd)
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_shard(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt("mixtral"), tmp_path / "c")
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    idx = {"metadata": {}, "weight_map": {k: ("model-00001-of-00002.safetensors" if i % 2 else
                                              "model-00002-of-00002.safetensors") for i, k in enumerate(keys)}}
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        moeq.load(d, quant="rtn-int4", progress=False)


def test_truncated_header(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt("mixtral"), tmp_path / "c")
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[:100])
    with pytest.raises(ValueError, match=r"model.safetensors: truncated"):
        moeq.load(d, quant="rtn-int4", progress=False)


def test_truncated_data(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt("mixtral"), tmp_path / "c")
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[: len(raw) - 1000])
    with pytest.raises(ValueError, match=r"tensor .*truncated"):
        moeq.load(d, quant="rtn-int4", progress=False)


def test_shape_mismatch_names_key(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt("qwen3_moe"), tmp_path / "c")
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    rewrite(d, lambda sd: sd | {key: torch.zeros(64, 128, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=rf"{key}: shape \[64, 128\] does not match the config"):
        moeq.load(d, quant="nf4", progress=False)


def test_expert_count_mismatch(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt("qwen3_moe"), tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_local_experts"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"experts\.3\.\w+\.weight: expert index 3 out of range.*3 experts"):
        moeq.load(d, quant="rtn-int4", progress=False)
    cfg["num_local_experts"] = 6
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp.gate.weight: shape \[4, 128\] does not match the config"):
        moeq.load(d, quant="rtn-int4", progress=False)


def test_expert_missing_from_checkpoint(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt("qwen3_moe"), tmp_path / "c")
    rewrite(d, lambda sd: {k: v for k, v in sd.items() if ".layers.1.mlp.experts.2." not in k})
    with pytest.raises(ValueError, match=r"lacks expert weights: model.layers.1.mlp.experts: expert 2 gate"):
        moeq.load(d, quant="rtn-int4", progress=False)


def test_unexpected_and_missing_keys(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt("olmoe"), tmp_path / "c")
    rewrite(d, lambda sd: sd | {"model.layers.0.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"not used: model.layers.0.extra.weight"):
        moeq.load(d, quant="rtn-int4", progress=False)
    rewrite(d, lambda sd: {k: v for k, v in sd.items() if k not in ("model.layers.0.extra.weight",
                                                                      "model.layers.1.input_layernorm.weight")})
    with pytest.raises(ValueError, match=r"not filled by the checkpoint: model.layers.1.input_layernorm.weight"):
        moeq.load(d, quant="rtn-int4", progress=False)


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'; moeq supports: .*mixtral.*qwen3_moe"):
        moeq.load(tmp_path / "gpt2", quant="rtn-int4", progress=False)


def test_nan_weight_named(tiny_ckpt, tmp_path):
    d = copy_ckpt(tiny_ckpt("mixtral"), tmp_path / "c")
    key = "model.layers.0.block_sparse_moe.experts.1.w2.weight"

    def poison(sd):
        sd[key] = sd[key].clone()
        sd[key][3, 3] = float("nan")
        return sd

    rewrite(d, poison)
    with pytest.raises(ValueError, match=rf"{key}.*non-finite"):
        moeq.load(d, quant="rtn-int4", progress=False)


def test_out_exists_and_crash_mid_write(tiny_ckpt, tmp_path, monkeypatch, capsys):
    src = tiny_ckpt("mixtral")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert main(["quantize", str(src), str(out), "--method", "rtn-int4"]) == 2
    assert "exists" in capsys.readouterr().err and (out / "keep.txt").read_text() == "precious"

    import moeq.io.writer as writer

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    assert main(["quantize", str(src), str(out), "--method", "rtn-int4", "--overwrite"]) == 2  # not moeq's
    assert "not a moeq output" in capsys.readouterr().err and (out / "keep.txt").read_text() == "precious"

    prev = tmp_path / "prev"
    assert main(["quantize", str(src), str(prev), "--method", "rtn-int4"]) == 0
    before = {p.name: p.read_bytes() for p in prev.iterdir()}
    monkeypatch.setattr(writer, "save_file", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        main(["quantize", str(src), str(prev), "--method", "rtn-int4", "--overwrite"])
    assert {p.name: p.read_bytes() for p in prev.iterdir()} == before  # old output intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "prev"]  # no temp dir left behind
    new = tmp_path / "new"
    with pytest.raises(RuntimeError):
        main(["quantize", str(src), str(new), "--method", "nf4"])
    assert not new.exists()
