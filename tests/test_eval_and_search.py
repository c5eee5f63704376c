"""Eval numbers against a hand computation; calibration-free optimizers never lose to plain rounding."""
import math

import pytest
import torch
from torch import nn

import moeq
from moeq.eval import EvalResult, evaluate, windows
from moeq.formats import bnb4, rtn
from moeq.metrics import sqnr_db


def heavy(shape, seed=0):
    torch.manual_seed(seed)
    return (torch.distributions.StudentT(3.0).sample(shape) * 0.02).to(torch.bfloat16)


@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (3, False), (8, True)])
def test_rtn_search_and_refine_never_worse(bits, sym):
    torch.manual_seed(bits)
    w = heavy((64, 512))
    base = rtn.quantize(w, bits, 64, sym)
    opt = rtn.quantize(w, bits, 64, sym, search=20, refine=2)
    e0 = (w.float() - base.dequantize(torch.float32)).pow(2).reshape(64, 8, 64).sum(-1)
    e1 = (w.float() - opt.dequantize(torch.float32)).pow(2).reshape(64, 8, 64).sum(-1)
    assert (e1 <= e0 * (1 + 1e-6)).all()  # per group, never worse
    assert sqnr_db(w, opt.dequantize()) > sqnr_db(w, base.dequantize()) + (0.2 if bits < 8 else 0.0)
    assert opt.qdata.shape == base.qdata.shape and opt.scale.dtype == base.scale.dtype  # same storage


@pytest.mark.parametrize("bits", [4, 3])
def test_hqq_never_worse_in_its_objective(bits):
    """HQQ-style half-quadratic steps: per group, mean |W - W_r| (HQQ's criterion) never above plain rounding and
    lower overall on heavy-tailed weights; storage unchanged."""
    w = heavy((64, 512), seed=bits)
    base = rtn.quantize(w, bits, 64, symmetric=False)
    opt = rtn.quantize(w, bits, 64, symmetric=False, hqq=20)
    e0 = (w.float() - base.dequantize(torch.float32)).abs().reshape(64, 8, 64).mean(-1)
    e1 = (w.float() - opt.dequantize(torch.float32)).abs().reshape(64, 8, 64).mean(-1)
    assert (e1 <= e0 * (1 + 1e-6)).all() and e1.mean() < 0.98 * e0.mean()
    assert opt.qdata.shape == base.qdata.shape and opt.zero.dtype == torch.uint8  # same storage
    assert opt.scale.dtype == base.scale.dtype
    with pytest.raises(ValueError, match="hqq fits a scale and a zero point: it needs an asymmetric grid"):
        rtn.quantize(w, bits, 64, symmetric=True, hqq=5)


def test_bnb4_absmax_search_never_worse_and_bnb_decodable():
    F = pytest.importorskip("bitsandbytes.functional")
    w = heavy((64, 512), seed=1)
    base = bnb4.quantize(w, "nf4", 64, False)
    opt = bnb4.quantize(w, "nf4", 64, False, search=20)
    e0 = (w.float() - base.dequantize(torch.float32)).pow(2).reshape(-1, 64).sum(-1)
    e1 = (w.float() - opt.dequantize(torch.float32)).pow(2).reshape(-1, 64).sum(-1)
    assert (e1 <= e0 * (1 + 1e-6)).all() and e1.sum() < 0.97 * e0.sum()
    sd = opt.state_dict("m.")
    qs = F.QuantState.from_dict({k[len("m.weight."):]: v for k, v in sd.items() if k != "m.weight"},
                                device=torch.device("cpu"))
    from tests.formats.test_bnb4 import bnb_reference_dequantize

    assert torch.equal(bnb_reference_dequantize(sd["m.weight"], qs), opt.dequantize())


class Fixed(nn.Module):
    """A 'model' whose logits at position t depend only on token t (for a hand-computed eval)."""

    def __init__(self, table):
        super().__init__()
        self.table = table
        self.config = type("C", (), {"get_text_config": lambda s: type("T", (), {"vocab_size": table.shape[1]})()})()

    def forward(self, ids):
        return type("O", (), {"logits": self.table[ids]})()


def test_eval_matches_hand_computation():
    torch.manual_seed(0)
    v = 7
    a, b = torch.randn(v, v), torch.randn(v, v)
    ids = torch.randint(0, v, (40,))
    res = evaluate(Fixed(a), Fixed(b), ids, ctx=8, progress=False)
    scored = [(t, ids[t + 1]) for t in range(39)][: res.tokens]
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    nll = -sum(la[ids[t], y].item() for t, y in scored) / len(scored)
    kl = [(lb[ids[t]].exp() * (lb[ids[t]] - la[ids[t]])).sum().item() for t, _ in scored]
    assert res.tokens == len(windows(40, 8)) * 4 + 4 and math.isclose(res.ppl, math.exp(nll), rel_tol=1e-5)
    assert math.isclose(res.mean_kl, sum(kl) / len(kl), rel_tol=1e-5)
    assert math.isclose(res.top1, sum(la[ids[t]].argmax() == lb[ids[t]].argmax() for t, _ in scored).item()
                        / len(scored), rel_tol=1e-6)
    same = evaluate(Fixed(a), Fixed(a), ids, ctx=8, progress=False)
    assert isinstance(same, EvalResult) and abs(same.mean_kl) < 1e-6 and same.top1 == 1.0


def test_eval_bad_input(tiny_ckpt):
    with pytest.raises(ValueError, match="text too short: 10 tokens"):
        windows(10, 512)
    m = moeq.load(tiny_ckpt("mixtral"), progress=False)
    other = moeq.load(tiny_ckpt("mixtral", vocab_size=400), progress=False)
    with pytest.raises(ValueError, match="vocabulary size mismatch: model 384 vs reference 400"):
        evaluate(m, other, torch.randint(0, 300, (600,)), ctx=64, progress=False)


def test_eval_cli(tiny_ckpt, tmp_path, capsys):
    import json

    from moeq.cli import main

    src = tiny_ckpt("mixtral")
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 30)
    assert main(["eval", str(src), "--ref", str(src), "--method", "rtn-int8", "--text", str(text), "--ctx", "64",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < r["mean_kl"] < 0.05 and r["top1"] > 0.8 and r["tokens"] > 100
    other = tmp_path / "other"
    import shutil

    shutil.copytree(src, other)
    tj = json.loads((src / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    (a, ia), (b, ib) = sorted(vocab.items(), key=lambda kv: kv[1])[-2:]
    vocab[a], vocab[b] = ib, ia  # same tokens and size, different ids
    (other / "tokenizer.json").write_text(json.dumps(tj))
    assert main(["eval", str(other), "--ref", str(src), "--text", str(text), "--ctx", "64"]) == 2
    assert "tokenizer mismatch" in capsys.readouterr().err
