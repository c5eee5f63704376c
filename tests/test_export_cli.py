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
