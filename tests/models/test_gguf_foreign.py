"""GGUF files moeq did not write (llama.cpp's converter, the Hub's uploaders: no ``moeq.*`` keys): the transformers
config is rebuilt from the file's llama.cpp metadata, and the model computes what the same file computes when moeq
wrote it. The files here are moeq's own exports rewritten by gguf-py without moeq's keys — llama.cpp's converter
writes the same tensors and metadata (checked against it in benchmarks/bench_accuracy.py, where it runs)."""
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import moeq
from moeq.errors import MoeqError
from moeq.export import export


def strip(src: Path, dst: Path, drop=lambda key: key.startswith("moeq."), arch: str | None = None,
          extra: dict | None = None) -> Path:
    """``src`` rewritten by gguf-py without the metadata keys ``drop`` selects (and with ``extra`` uint32 keys)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch or r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or drop(f.name):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for k, v in (extra or {}).items():
        w.add_uint32(k, v)
    for t in r.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(np.asarray(t.data))
    w.close()
    return dst


@pytest.mark.parametrize("family,kw,method", [("qwen3_moe", {"norm_topk_prob": True}, "q4_0"),
                                              ("mixtral", {}, None), ("mixtral", {"tie_word_embeddings": True}, "q8_0"),
                                              ("qwen2_moe", {}, "q4_0"), ("olmoe", {"num_key_value_heads": 4}, None)])
def test_foreign_gguf_loads_as_moeqs_own(tiny_ckpt, tmp_path, family, kw, method):
    src = tiny_ckpt(family, **kw)
    export(moeq.load(src, quant=method, progress=False), tmp_path / "ours", "gguf", source=src)
    theirs = strip(tmp_path / "ours" / "model.gguf", tmp_path / "theirs.gguf")
    assert "moeq.hf_config" not in gguf.GGUFReader(theirs).fields
    a = moeq.load(tmp_path / "ours" / "model.gguf", progress=False)
    b = moeq.load(theirs, progress=False)
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
              "num_experts_per_tok", "tie_word_embeddings"):
        assert getattr(b.config, k) == getattr(a.config, k), k
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_foreign_gguf_refusals(tiny_ckpt, tmp_path):
    src = tiny_ckpt("qwen3_moe", norm_topk_prob=True)
    export(moeq.load(src, quant="q4_0", progress=False), tmp_path / "ours", "gguf", source=src)
    ours = tmp_path / "ours" / "model.gguf"
    with pytest.raises(MoeqError, match="'gemma2' is not one moeq maps"):
        moeq.load(strip(ours, tmp_path / "a.gguf", arch="gemma2"), progress=False)
    with pytest.raises(MoeqError, match="qwen3moe.expert_count is missing"):
        moeq.load(strip(ours, tmp_path / "b.gguf", lambda k: k.startswith("moeq.") or k.endswith("expert_count")),
                  progress=False)
    with pytest.raises(MoeqError, match="rope.scaling"):
        moeq.load(strip(ours, tmp_path / "c.gguf", extra={"qwen3moe.rope.scaling.original_context_length": 64}),
                  progress=False)
