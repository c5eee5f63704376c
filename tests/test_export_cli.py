"""export as users call it: bf16 -> GGUF in one command to a file name, names that say what the model is, refusals
that say what works, and output listings that say everything."""
import json

import gguf
import pytest

import moeq
from moeq.cli import main
from moeq.export import export


def test_bf16_to_gguf_file_in_one_command(tiny_ckpt, tmp_path, capsys):
    src = tiny_ckpt("qwen3_moe", norm_topk_prob=True)
    out = tmp_path / "tiny.gguf"
    assert main(["export", str(src), str(out), "--format", "gguf", "--method", "q4_0"]) == 0
    text = capsys.readouterr().out
    assert "no value re-quantized (lossless)" in text and "kept unquantized (" in text
    r = gguf.GGUFReader(str(out))
    name = r.fields["general.name"]
    assert bytes(name.parts[name.data[0]]).decode() == src.name  # the model's folder, not the CLI path
    assert "moeq.version" in r.fields
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]  # one file, nothing left beside it
    assert main(["export", str(src), str(out), "--format", "gguf", "--method", "q8_0", "--overwrite"]) == 0
    foreign = tmp_path / "other.gguf"
    foreign.write_bytes(b"not moeq's")
    assert main(["export", str(src), str(foreign), "--format", "gguf", "--method", "q4_0", "--overwrite"]) == 2
    assert "only a file moeq wrote" in capsys.readouterr().err and foreign.read_bytes() == b"not moeq's"


def test_unquantized_export_refused(tiny_ckpt, tmp_path):
    m = moeq.load(tiny_ckpt("qwen3_moe"), progress=False)
    for fmt in ("compressed-tensors", "bnb"):
        with pytest.raises(moeq.MoeqError, match="no quantized module"):
            export(m, tmp_path / fmt, fmt)
        assert not (tmp_path / fmt).exists()


def test_export_lists_every_requantized_tensor(tiny_ckpt, tmp_path, capsys):
    src = tiny_ckpt("qwen3_moe", norm_topk_prob=True)
    assert main(["export", str(src), str(tmp_path / "g"), "--format", "gguf", "--method", "nf4", "--requantize"]) == 0
    text = capsys.readouterr().out
    n = int(text.split("re-quantized (")[1].split(")")[0])
    assert n == 14 and text.count("-> Q4_0") == n
    assert main(["export", str(src), str(tmp_path / "h"), "--format", "gguf", "--method", "nf4", "--json"]) == 2


def test_exports_are_judged_by_their_consumer(tiny_ckpt, tmp_path, capsys):
    src = tiny_ckpt("qwen3_moe")
    m = moeq.load(src, quant="rtn-int4", progress=False)
    assert export(m, tmp_path / "ct", "compressed-tensors", source=src)["kl_vs_moeq"] == 0.0  # lossless
    n = moeq.load(src, quant="nf4", progress=False)
    assert export(n, tmp_path / "b4", "bnb", source=src, layout="transformers4")["kl_vs_moeq"] == 0.0
    kl = export(n, tmp_path / "b5", "bnb", source=src)["kl_vs_moeq"]  # transformers + bitsandbytes' own kernels
    assert 0 <= kl < 0.05
    if kl > 0:  # past a threshold: refused, nothing written; --force writes it
        with pytest.raises(moeq.MoeqError, match="refusing it"):
            export(n, tmp_path / "strict", "bnb", source=src, max_kl=kl / 2)
        assert not (tmp_path / "strict").exists()
        export(n, tmp_path / "strict", "bnb", source=src, max_kl=kl / 2, force=True)
    g = moeq.load(tiny_ckpt("qwen3_moe", norm_topk_prob=True), quant="q4_0", progress=False)
    assert export(g, tmp_path / "g.gguf", "gguf", source=src)["kl_vs_moeq"] == 0.0  # read back exactly
    nf = moeq.load(tiny_ckpt("qwen3_moe", norm_topk_prob=True), quant="nf4", progress=False)
    assert export(nf, tmp_path / "r.gguf", "gguf", source=src, requantize=True)["kl_vs_moeq"] > 0  # double rounding
    with pytest.raises(moeq.MoeqError, match="refusing it"):
        export(nf, tmp_path / "r2.gguf", "gguf", source=src, requantize=True, max_kl=1e-9)
    assert not (tmp_path / "r2.gguf").exists()
    assert main(["export", str(src), str(tmp_path / "cli"), "--format", "compressed-tensors", "--method",
                 "rtn-int8"]) == 0
    assert "mean KL vs moeq's model 0 nats" in capsys.readouterr().out


def test_moeq_reads_its_compressed_tensors_export(tiny_ckpt, tmp_path, capsys):
    import torch

    src = tiny_ckpt("mixtral")
    for method in ("rtn-int4", "rtn-int4-asym", "rtn-int8"):
        m = moeq.load(src, quant=method, progress=False)
        export(m, tmp_path / method, "compressed-tensors", source=src)
        back = moeq.load(tmp_path / method, progress=False)
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        assert torch.equal(m(ids).logits, back(ids).logits)
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 10)
    ct = tmp_path / "rtn-int4"
    assert main(["inspect", str(ct)]) == 0 and "rtn" in capsys.readouterr().out
    assert main(["eval", str(ct), "--ref", str(src), "--text", str(text), "--ctx", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mean_kl"] > 0
    assert main(["generate", str(ct), "-p", "truth", "--max-new-tokens", "3"]) == 0


@pytest.mark.parametrize("family,kw", [("qwen3_moe", {"norm_topk_prob": True}), ("mixtral", {})])
def test_moeq_reads_its_gguf_export(family, kw, tiny_ckpt, tmp_path, capsys):
    import torch

    src = tiny_ckpt(family, **kw)
    for method in ("q4_0", "q8_0"):
        m = moeq.load(src, quant=method, progress=False)
        out = tmp_path / f"{method}.gguf"
        export(m, out, "gguf", source=src)
        back = moeq.load(out, progress=False)  # exact: the config travels in the file, q/k permutation undone
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        assert torch.equal(m(ids).logits, back(ids).logits)
    g = tmp_path / "q4_0.gguf"
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 10)
    assert main(["inspect", str(g)]) == 0 and "rtn" in capsys.readouterr().out
    assert main(["eval", str(g), "--ref", str(src), "--text", str(text), "--ctx", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mean_kl"] > 0
    assert main(["generate", str(g), "-p", "truth", "--max-new-tokens", "3"]) == 0


def test_foreign_gguf_is_refused_clearly(tmp_path):
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(moeq.MoeqError, match="'llama' without experts is not one moeq maps"):
        moeq.load(tmp_path / "x.gguf", progress=False)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(40))
    with pytest.raises(moeq.MoeqError, match="not a readable GGUF"):
        moeq.load(tmp_path / "junk.gguf", progress=False)
