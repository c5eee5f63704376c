"""Data-free bit allocation (moeq.allocate, moeq.load(..., bpw=)): per-tensor sensitivities measured with noise on
random token ids, each tensor's method chosen to fit a bits-per-weight budget."""
import itertools
import json

import pytest
import torch

import moeq
from moeq import MoeqError
from moeq import allocate
from moeq.cli import main as cli


def _kl(a, b, ids) -> float:
    with torch.no_grad():
        p = torch.log_softmax(a(ids).logits.float(), -1)
        q = torch.log_softmax(b(ids).logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def _synthetic() -> allocate.Sensitivity:
    ladder = ("a", "b", "c")
    bits = {"a": 3.0, "b": 4.0, "c": 8.0}
    err = {"a": 0.04, "b": 0.01, "c": 0.0001}
    tensors = [allocate.Tensor(f"t{i}", n, alpha, dict(err), dict(bits))
               for i, (n, alpha) in enumerate([(1000, 0.1), (1000, 5.0), (4000, 1.0), (500, 20.0)])]
    return allocate.Sensitivity(tensors, ladder, 0, 0)


def test_choice_fits_the_budget_and_spends_bits_where_they_buy_most():
    sens = _synthetic()
    total = sum(t.params for t in sens.tensors)
    prev = float("inf")
    for bpw in (3.0, 3.5, 4.0, 4.6, 5.5, 8.0):
        got = allocate.choose(sens, bpw)
        spent = sum(t.params * t.bits[got[t.name]] for t in sens.tensors) / total
        cost = sum(t.cost(got[t.name]) for t in sens.tensors)
        assert spent <= bpw + 1e-9
        assert cost <= prev + 1e-12  # more bits never predict more KL
        prev = cost
        # as good as the best assignment that fits, found by brute force, within 10%
        best = min(sum(t.cost(m) for t, m in zip(sens.tensors, ms))
                   for ms in itertools.product(sens.ladder, repeat=len(sens.tensors))
                   if sum(t.params * t.bits[m] for t, m in zip(sens.tensors, ms)) <= bpw * total + 1e-9)
        assert cost <= 1.1 * best + 1e-12
    got = allocate.choose(sens, 4.0)
    order = {"a": 0, "b": 1, "c": 2}
    assert order[got["t3"]] >= order[got["t1"]] >= order[got["t0"]]  # the sensitive, small tensors first
    with pytest.raises(MoeqError, match="below what the cheapest"):
        allocate.choose(sens, 2.5)


def test_measure_restores_the_weights_and_predicts_the_kl(tiny_ckpt):
    """The probe noise is undone; the predicted KL (sum of sensitivity x weight error) tracks the KL the chosen
    model really has on held-out random ids, and the allocation beats a single method at fewer bits."""
    src = tiny_ckpt("qwen3_moe")
    m = moeq.load(src, progress=False)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    sens = allocate.measure(m, tokens=512, progress=False)
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters())
    names = {t.name for t in sens.tensors}
    assert "model.layers.0.mlp.experts.w13" in names and "model.layers.1.self_attn.k_proj" in names
    for t in sens.tensors:
        assert t.alpha > 0 and all(t.error[a] > t.error[b] for a, b in zip(sens.ladder, sens.ladder[1:])
                                   if a in t.error and b in t.error and t.bits[a] < t.bits[b] and a != "iq4nl-dq")
    ids = torch.randint(0, m.config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(7))
    mixed = moeq.load(src, allocate.config(sens, 4.3), progress=False)
    predicted = allocate.summary(sens, 4.3)["predicted_kl"]
    real = _kl(m, mixed, ids)
    assert 0.33 * predicted < real < 3 * predicted
    assert moeq.inspect(mixed)["quantized_bits_per_weight"] <= 4.3 + 1e-6
    single = moeq.load(src, "iq4nl", progress=False)  # 4.5 bits everywhere
    assert real < _kl(m, single, ids)


def test_load_with_bpw_saves_its_choice(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(allocate, "TOKENS", allocate.SEQ)
    src = tiny_ckpt("qwen3_moe")
    m = moeq.load(src, bpw=3.9, progress=False)
    rec = m.config.quantization_config["allocation"]
    assert rec["target_bpw"] == 3.9 and rec["bpw"] <= 3.9 and rec["ladder"] == list(allocate.LADDER)
    assert moeq.inspect(m)["quantized_bits_per_weight"] <= 3.9 + 1e-6
    assert len({r["detail"].get("grid") for r in moeq.inspect(m)["modules"] if "grid" in r["detail"]}) > 1
    moeq.save(m, tmp_path / "out")
    back = moeq.load(tmp_path / "out", progress=False)
    assert back.config.quantization_config["allocation"] == rec
    ids = torch.randint(0, m.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(m(ids).logits, back(ids).logits)
    with pytest.raises(MoeqError, match="give no method"):
        moeq.load(src, "iq4nl", bpw=4.0, progress=False)
    with pytest.raises(MoeqError, match="between 2 and 16"):
        moeq.load(src, bpw=1.0, progress=False)


def test_cli_bpw(tiny_ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(allocate, "TOKENS", allocate.SEQ)
    src = tiny_ckpt("mixtral")
    assert cli(["quantize", str(src), str(tmp_path / "q"), "--bpw", "4.3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["method"] == "bpw 4.3" and summary["quantized_bits_per_weight"] <= 4.3 + 1e-6
    assert cli(["quantize", str(src), str(tmp_path / "r"), "--bpw", "4.3", "--method", "q4_0"]) != 0
    assert "without --method" in capsys.readouterr().err


def test_importance_weights_the_errors(tiny_ckpt, monkeypatch):
    """With importance the errors are those of weights quantized with it, weighted by its columns (as the load
    quantizes them); with uniform importance they equal the unweighted errors of those weights."""
    from moeq import importance as imp

    monkeypatch.setattr(allocate, "TOKENS", allocate.SEQ)
    src = tiny_ckpt("qwen3_moe")
    m = moeq.load(src, progress=False)
    stats = imp.collect(moeq.load(src, imp.FIRST_PASS, progress=False), tokens=imp.SEQ, progress=False)
    plain = {t.name: t for t in allocate.measure(m, progress=False).tensors}
    weighted = {t.name: t for t in allocate.measure(m, progress=False, importance=stats).tensors}
    name = "model.layers.0.self_attn.q_proj"
    w = m.get_submodule(name).weight.float()
    cols = stats.linear(name)
    q = moeq.config.method("iq4nl").quantize(w.bfloat16(), importance=cols).dequantize(torch.float32)
    want = float((cols * (q - w) ** 2).sum() / (cols * w ** 2).sum())
    assert weighted[name].error["iq4nl"] == pytest.approx(want, rel=1e-5)
    assert weighted[name].error["iq4nl"] != pytest.approx(plain[name].error["iq4nl"], rel=1e-3)
    ones = imp.Importance({k: torch.ones_like(v) for k, v in stats.linears.items()},
                          {k: (torch.ones_like(a), torch.ones_like(b)) for k, (a, b) in stats.experts.items()},
                          stats.tokens, stats.seed)
    uniform = {t.name: t for t in allocate.measure(m, progress=False, importance=ones).tensors}
    for t in uniform.values():  # q8_0 has no search: the same weights, so the same error and sensitivity
        assert t.error["q8_0"] == pytest.approx(plain[t.name].error["q8_0"], rel=1e-4)
        assert t.alpha == pytest.approx(plain[t.name].alpha, rel=2e-2)
    got = moeq.load(src, bpw=4.3, importance=imp.SEQ, progress=False)
    rec = got.config.quantization_config["allocation"]
    assert rec["importance_weighted"] and rec["bpw"] <= 4.3


def test_group_32_rung_opens_budgets_below_nl3(tiny_ckpt):
    """The ladder's cheapest rung (nl3 at group 32: 0.25 bits less than nl3) makes budgets under nl3's bits
    reachable; a load at such a budget keeps to it and mixes the rung with dearer methods where they buy most."""
    src = tiny_ckpt("qwen3_moe")
    m = moeq.load(src, progress=False)
    sens = allocate.measure(m, tokens=256, progress=False)
    n = sum(t.params for t in sens.tensors)
    nl3 = sum(t.params * t.bits["nl3"] for t in sens.tensors) / n
    lo, _ = sens.bits_range()
    assert lo < nl3 - 0.2
    budget = (lo + nl3) / 2
    got = allocate.choose(sens, budget)
    assert got and "nl3-g32" in got.values() and len(set(got.values())) > 1
    mixed = moeq.load(src, allocate.config(sens, budget), progress=False)
    assert moeq.inspect(mixed)["quantized_bits_per_weight"] <= budget + 1e-6
    with pytest.raises(MoeqError, match="below what the cheapest"):
        allocate.choose(sens, lo - 0.05)
