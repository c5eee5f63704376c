"""The streamed GGUF export (``moeq export SRC OUT.gguf --format gguf --method M`` from any checkpoint read tensor by
tensor): the same file content as exporting the loaded model, one decoder layer held at a time, every exact tensor
decoded back by gguf-py, and refusals that leave nothing behind."""
import numpy as np
import gguf
import pytest
import torch

import moeq
from moeq import readers
from moeq.export import export, export_checkpoint
from moeq.export import gguf as gguf_export
from moeq.nn import QuantExperts, QuantLinear
from moeq.readers.state import Written
from moeq.tiny import make_fp8_checkpoint


def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def _fields(path):
    return {k: (v.types, [bytes(v.parts[i]) for i in v.data]) for k, v in gguf.GGUFReader(str(path)).fields.items()
            if not k.startswith("GGUF.")}


def assert_same_gguf(streamed, whole):
    """Same metadata, same tensors (name, type, shape, bytes); only the order in the file may differ."""
    a, b = _tensors(streamed), _tensors(whole)
    assert a.keys() == b.keys()
    for n in a:
        assert (a[n].tensor_type, list(a[n].shape)) == (b[n].tensor_type, list(b[n].shape)), n
        assert np.array_equal(np.asarray(a[n].data), np.asarray(b[n].data)), n
    assert _fields(streamed) == _fields(whole)


@pytest.mark.parametrize("arch,method", [("qwen3_moe", "q4_0"), ("mixtral", "q8_0"), ("qwen2_moe", "iq4nl")])
def test_streamed_equals_the_loaded_models_export(tiny_ckpt, tmp_path, arch, method):
    src = tiny_ckpt(arch, **({"norm_topk_prob": True} if arch == "qwen3_moe" else {}))
    s = export_checkpoint(src, tmp_path / "s.gguf", "gguf", quant=method)
    model = moeq.load(src, quant=method, progress=False)
    export(model, tmp_path / "m.gguf", "gguf", source=src)
    assert_same_gguf(tmp_path / "s.gguf", tmp_path / "m.gguf")
    assert s["streamed"] and s["requantized"] == [] and s["peak_rss_bytes"] > 0
    n_quant = sum(1 for _, m in model.named_modules() if isinstance(m, QuantLinear)) + \
        3 * sum(1 for _, m in model.named_modules() if isinstance(m, QuantExperts))
    assert s["checked_by_gguf_py"] == n_quant > 0  # every quantized tensor decoded back by gguf-py
    back = moeq.load(tmp_path / "s.gguf", progress=False)  # moeq reads the streamed file as it reads its own
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_fp8_source_streams_to_gguf(tmp_path):
    src = make_fp8_checkpoint("qwen3_moe", tmp_path / "fp8", block=(128, 128), norm_topk_prob=True)
    export_checkpoint(src, tmp_path / "s.gguf", "gguf", quant="q4_0")
    export(moeq.load(src, quant="q4_0", progress=False), tmp_path / "m.gguf", "gguf", source=src, check=False)
    assert_same_gguf(tmp_path / "s.gguf", tmp_path / "m.gguf")


def test_tied_embeddings_with_a_quantized_head(tiny_ckpt, tmp_path):
    src = tiny_ckpt("qwen3_moe", norm_topk_prob=True, tie_word_embeddings=True)
    for name, q in [("plain", "q4_0"), ("head", moeq.QuantConfig(moeq.RTN(4, 32, grid="signed"),
                                                                 rules={"lm_head": moeq.RTN(8, 32, grid="signed")}))]:
        export_checkpoint(src, tmp_path / f"{name}-s.gguf", "gguf", quant=q)
        export(moeq.load(src, quant=q, progress=False), tmp_path / f"{name}-m.gguf", "gguf", source=src)
        assert_same_gguf(tmp_path / f"{name}-s.gguf", tmp_path / f"{name}-m.gguf")
        has_head = "output.weight" in _tensors(tmp_path / f"{name}-s.gguf")
        assert has_head == (name == "head")  # tied: llama.cpp reuses token_embd unless the head has its own copy


class Spy(gguf_export.Stream):
    """Records, at each layer written, how many decoder layers still hold quantized weights."""

    def start(self, model, linears):
        self.root, self.held = model, []
        super().start(model, linears)

    def write(self, unit, module):
        layers = [m for m in self.root.model.layers if not isinstance(m, Written)]
        self.held.append(sum(any(isinstance(x, (QuantExperts, QuantLinear)) for x in m.modules()) for m in layers))
        super().write(unit, module)


def test_one_layer_in_memory_at_a_time(tiny_ckpt, tmp_path):
    src = tiny_ckpt("qwen3_moe", norm_topk_prob=True, num_hidden_layers=4)
    spy = Spy(tmp_path / "x.gguf", src)
    readers.read(src, moeq.QuantConfig.of("q4_0"), None, False, torch.device("cpu"), sink=spy)
    spy.close()
    assert len(spy.held) >= 4 and max(spy.held) == 1  # each layer freed once written


def test_refusals_leave_nothing(tiny_ckpt, tmp_path):
    src = tiny_ckpt("qwen3_moe", norm_topk_prob=True)
    with pytest.raises(moeq.MoeqError, match="round moeq's already-rounded values"):
        export_checkpoint(src, tmp_path / "nf4.gguf", "gguf", quant="nf4")
    assert list(tmp_path.iterdir()) == []
    s = export_checkpoint(src, tmp_path / "nf4.gguf", "gguf", quant="nf4", requantize=True)
    assert len(s["requantized"]) == 14 and s["checked_by_gguf_py"] == 0  # re-rounded: not bit-exact by design


def test_a_checkpoint_missing_a_tensor_is_named(tiny_ckpt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt("qwen3_moe", norm_topk_prob=True), src)
    f = next(src.glob("*.safetensors"))
    t = load_file(f)
    del t["model.layers.1.self_attn.o_proj.weight"]
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(moeq.MoeqError, match=r"model\.layers\.1"):
        export_checkpoint(src, tmp_path / "out.gguf", "gguf", quant="q4_0")
    assert not (tmp_path / "out.gguf").exists() and not list(tmp_path.glob(".out.gguf*"))


def test_saved_moeq_checkpoints_export_whole(tiny_ckpt, tmp_path):
    src = tiny_ckpt("qwen3_moe", norm_topk_prob=True)
    moeq.save(moeq.load(src, quant="q4_0", progress=False), tmp_path / "saved", source=src)
    s = export_checkpoint(tmp_path / "saved", tmp_path / "a.gguf", "gguf")
    assert "streamed" not in s and s["kl_vs_moeq"] == 0.0  # loaded whole, judged by the consumer's logits


def test_llama_cpp_runs_the_streamed_file_as_the_whole_one(tiny_ckpt, tmp_path):
    """llama.cpp itself: the streamed file (tensors in the order their layers completed) computes the same logits as
    the loaded model's export."""
    from tests.llama_cpp import LlamaCpp

    src = tiny_ckpt("mixtral")
    export_checkpoint(src, tmp_path / "s.gguf", "gguf", quant="q4_0")
    export(moeq.load(src, quant="q4_0", progress=False), tmp_path / "m.gguf", "gguf", source=src)
    prompt = [1, 17, 42, 99, 5]
    a, b = LlamaCpp(tmp_path / "s.gguf"), LlamaCpp(tmp_path / "m.gguf")
    ta, la = a._run(prompt, 6)
    tb, lb = b._run(prompt, 6)
    assert ta == tb and all(np.array_equal(x, y) for x, y in zip(la, lb)) and np.isfinite(la[0]).all()
