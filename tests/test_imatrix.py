"""llama.cpp's importance matrix without text (``moeq imatrix``, moeq.export.imatrix): the GGUF imatrix file
llama-quantize reads — its keys, one ``in_sum2``/``counts`` pair per tensor of the model's own GGUF export with
llama-quantize's size (columns x experts), values that divide back to moeq's statistic — and no file moeq did not
write replaced."""
import json

import numpy as np
import pytest
import torch

import moeq
from moeq import MoeqError
from moeq import importance as imp
from moeq.loader import imatrix

gguf = pytest.importorskip("gguf")


def _read(path):
    r = gguf.GGUFReader(str(path))
    kv = {k: f for k, f in r.fields.items()}
    tensors = {t.name: t for t in r.tensors}
    return r, kv, tensors


def _str(f):
    return bytes(f.parts[f.data[0]]).decode("utf-8")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_imatrix_matches_the_export_and_the_statistic(tiny_ckpt, tmp_path, arch):
    from moeq.export import export_checkpoint

    src = tiny_ckpt(arch, **({"norm_topk_prob": True} if arch == "qwen3_moe" else {}))  # llama.cpp's graph
    out = tmp_path / "m.imatrix.gguf"
    summary = imatrix(src, out, tokens=1024, seed=3, progress=False, inputs="random")
    _, kv, tensors = _read(out)
    assert _str(kv["general.type"]) == "imatrix"
    assert _str(kv["imatrix.datasets"]).startswith("moeq data-free: 1024 tokens of uniform random token ids, seed 3")
    assert summary["inputs"] == "random"
    assert int(kv["imatrix.chunk_count"].parts[-1][0]) == 2 and int(kv["imatrix.chunk_size"].parts[-1][0]) == 512
    names = {n.removesuffix(".in_sum2") for n in tensors if n.endswith(".in_sum2")}
    assert names == {n.removesuffix(".counts") for n in tensors if n.endswith(".counts")}
    assert summary["tensors"] == len(names)

    # every quantized tensor of the model's GGUF export has an entry of llama-quantize's size (ne0 * ne2)
    export_checkpoint(src, tmp_path / "m.gguf", "gguf", quant="q8_0")
    quantized = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors
                 if t.tensor_type.name == "Q8_0" and t.name != "output.weight"}
    assert quantized and set(quantized) <= names
    cfg = moeq.load(src, progress=False).config
    for name, t in quantized.items():
        ne = [int(v) for v in t.shape]  # gguf-py: ne0 first
        sums = tensors[name + ".in_sum2"].data
        counts = tensors[name + ".counts"].data
        want_mats = ne[2] if len(ne) == 3 else 1
        assert sums.shape == (want_mats, ne[0]) and counts.shape == (want_mats, 1), name
        assert sums.dtype == np.float32 and counts.dtype == np.float32
        if len(ne) == 3:
            assert want_mats == getattr(cfg, "num_experts", None) or want_mats == cfg.num_local_experts

    # the values: sums / counts is the statistic moeq measures (same seed, same first pass)
    first = moeq.load(src, imp.first_pass(10**6), progress=False)
    stats = imp.collect(first, tokens=1024, seed=3, progress=False, inputs="random")
    q = tensors["blk.0.attn_q.weight.in_sum2"].data[0] / tensors["blk.0.attn_q.weight.counts"].data[0, 0]
    torch.testing.assert_close(torch.from_numpy(q), stats.linear("model.layers.0.self_attn.q_proj"),
                               rtol=1e-5, atol=0)
    (inputs, mids), = [v for k, v in stats.experts.items() if ".layers.0." in k]
    for kind, want in (("gate", inputs), ("up", inputs), ("down", mids)):
        s = tensors[f"blk.0.ffn_{kind}_exps.weight.in_sum2"].data
        c = tensors[f"blk.0.ffn_{kind}_exps.weight.counts"].data
        reached = want.any(1).numpy()
        assert (c[:, 0] == np.where(reached, 1024.0, 0.0)).all()  # an expert no token reached: count 0
        torch.testing.assert_close(torch.from_numpy(s[reached] / c[reached]), want[torch.from_numpy(reached)],
                                   rtol=1e-5, atol=0)


def test_imatrix_replaces_only_its_own_files(tiny_ckpt, tmp_path):
    src = tiny_ckpt("qwen3_moe")
    foreign = tmp_path / "notes.gguf"
    foreign.write_bytes(b"not moeq's")
    for overwrite in (False, True):
        with pytest.raises(MoeqError, match="notes.gguf"):
            imatrix(src, foreign, tokens=512, progress=False, overwrite=overwrite)
        assert foreign.read_bytes() == b"not moeq's"
    with pytest.raises(MoeqError, match="directory"):
        imatrix(src, tmp_path, tokens=512, progress=False)
    ours = tmp_path / "a.imatrix.gguf"
    imatrix(src, ours, tokens=512, seed=1, progress=False)
    with pytest.raises(MoeqError, match="exists"):
        imatrix(src, ours, tokens=512, progress=False)
    imatrix(src, ours, tokens=512, seed=2, progress=False, overwrite=True)
    assert "seed 2" in _str(_read(ours)[1]["imatrix.datasets"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.imatrix.gguf", "notes.gguf"]  # no temporaries left
    with pytest.raises(MoeqError, match="multiple of 512"):
        imatrix(src, tmp_path / "b.gguf", tokens=700, progress=False)


def test_cli_imatrix(tiny_ckpt, tmp_path, capsys):
    from moeq.cli import main

    out = tmp_path / "m.imatrix.gguf"
    assert main(["imatrix", str(tiny_ckpt("mixtral")), str(out), "--tokens", "512", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["file"] == str(out) and summary["tokens"] == 512 and summary["tensors"] > 0
    assert _read(out)[2]
