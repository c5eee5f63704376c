"""Residual-stream rotation: orthogonal matrices of the sizes models use, function preservation on every supported
family (norm weights folded, tied heads untied), the saved result a plain checkpoint that transformers and moeq's
quantizers take, and refusals that change nothing."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import moeq
from moeq import cli
from moeq.errors import MoeqError
from moeq.rotate import hadamard, hadamard_plan, rotate_, rotation_matrix
from moeq.tiny import make_checkpoint


@pytest.mark.parametrize("n,plan", [(64, (1, 64)), (2048, (1, 2048)), (576, (72, 8)), (768, (384, 2)),
                                    (2880, (2880, 1)), (7168, (3584, 2)), (40, (20, 2))])
def test_hadamard_orders(n, plan):
    assert hadamard_plan(n) == plan
    h = hadamard(n)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


def test_no_hadamard_falls_back_to_a_random_orthogonal_matrix():
    assert hadamard_plan(92) is None  # 92 = 4 x 23: 91, 45 and 22 + 1 are no Paley orders
    q, kind = rotation_matrix(92, seed=3)
    assert kind == "random orthogonal"
    assert torch.allclose(q @ q.T, torch.eye(92, dtype=torch.float64), atol=1e-12)
    q2, _ = rotation_matrix(92, seed=3)
    assert torch.equal(q, q2)  # seeded
    h, kind = rotation_matrix(576, seed=1)
    assert kind.startswith("hadamard") and torch.allclose(h @ h.T, torch.eye(576, dtype=torch.float64), atol=1e-12)


def _model(tmp_path, family, **overrides):
    path = make_checkpoint(family, tmp_path / family, **overrides)
    m = moeq.load(path, dtype=torch.float32, progress=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the tiny checkpoints' norms are ones: make them real, so folding them is tested
        for name, p in m.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("model.norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g) * 2)
    return path, m


def _logits(m, ids):
    with torch.no_grad():
        return m(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("family,tied", [("qwen3_moe", False), ("mixtral", True), ("qwen2_moe", False),
                                         ("olmoe", False), ("llama", True)])
def test_rotation_preserves_the_function(tmp_path, family, tied):
    _, m = _model(tmp_path, family, tie_word_embeddings=tied)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    before = _logits(m, ids)
    q_proj = m.model.layers[0].self_attn.q_proj.weight.clone()
    r = rotate_(m, seed=5)
    after = _logits(m, ids)
    assert torch.allclose(after, before, atol=1e-4 * float(before.abs().max()), rtol=0)
    assert r.untied == tied and r.probe_rel_err < 1e-4
    assert m.get_output_embeddings().weight.data_ptr() != m.get_input_embeddings().weight.data_ptr()
    assert not m.config.tie_word_embeddings
    assert (q_proj - m.model.layers[0].self_attn.q_proj.weight).abs().max() > 1e-3  # the weights did change
    norms = [p for n, p in m.named_parameters() if n.endswith(("layernorm.weight", "model.norm.weight"))]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)


def test_saved_rotation_is_a_plain_checkpoint(tmp_path):
    src, m = _model(tmp_path, "qwen3_moe", tie_word_embeddings=True)
    moeq.save(m, tmp_path / "orig", source=src)  # the real-norm model as the reference checkpoint
    ids = torch.randint(0, 300, (1, 11), generator=torch.Generator().manual_seed(2))
    ref = _logits(m, ids)
    assert cli.main(["rotate", str(tmp_path / "orig"), str(tmp_path / "rot"), "--dtype", "fp32", "--json"]) == 0
    cfg = json.loads((tmp_path / "rot" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"] is False
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "rot", dtype=torch.float32)
    assert torch.allclose(_logits(theirs, ids), ref, atol=1e-4 * float(ref.abs().max()), rtol=0)
    q = moeq.load(tmp_path / "rot", quant="q4_0", progress=False)  # any method quantizes the rotated model
    assert moeq.inspect(q)["quantized_params"] > 0
    assert torch.isfinite(_logits(q, ids)).all()


def test_refusals_change_nothing(tmp_path):
    _, m = _model(tmp_path, "qwen3_moe")
    snapshot = {k: v.clone() for k, v in m.state_dict().items()}

    def unchanged():
        return all(torch.equal(m.state_dict()[k], v) for k, v in snapshot.items())

    norm = m.model.layers[1].post_attention_layernorm
    norm.forward = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight)  # Gemma
    with pytest.raises(MoeqError, match="post_attention_layernorm.*does not compute"):
        rotate_(m)
    assert unchanged()
    del norm.forward
    m.model.layers[0].mlp.gate.register_parameter("bias", torch.nn.Parameter(torch.zeros(4)))
    with pytest.raises(MoeqError, match="router"):
        rotate_(m)
    assert unchanged()
    q = moeq.load(make_checkpoint("qwen3_moe", tmp_path / "q"), quant="q4_0", progress=False)
    with pytest.raises(MoeqError, match="unquantized"):
        rotate_(q)
    ds = moeq.load(make_checkpoint("deepseek_v3", tmp_path / "ds"), dtype=torch.float32, progress=False)
    with pytest.raises(MoeqError, match="not 'deepseek_v3'"):
        rotate_(ds)


def test_fold_only_scales_the_readers_by_their_norm(tmp_path):
    _, m = _model(tmp_path, "mixtral")
    g1 = m.model.layers[0].input_layernorm.weight.clone()
    q_proj = m.model.layers[0].self_attn.q_proj.weight.clone()
    ids = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(4))
    before = _logits(m, ids)
    r = rotate_(m, fold_only=True)
    assert r.kind.startswith("none")
    assert torch.allclose(m.model.layers[0].self_attn.q_proj.weight, q_proj * g1, rtol=1e-6, atol=0)
    assert torch.allclose(_logits(m, ids), before, atol=1e-4 * float(before.abs().max()), rtol=0)
