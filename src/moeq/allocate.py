"""Data-free bit allocation: each quantized tensor's method chosen to fit a bits-per-weight budget
(``moeq.load(src, bpw=3.8)``, ``moeq quantize SRC OUT --bpw 3.8``).

llama.cpp's mixes (Q4_K_M, IQ4_XS, ...) and moeq's own (``iq4nl-m``, ``nl3-m``) spend extra bits by fixed rules (k and
v projections, every down projection, "more-bits" layers). Here the choice is measured, per tensor, without data:

1. **Sensitivity** ``alpha_t``: the model is loaded in its compute dtype and, one tensor at a time, its weights get
   Gaussian noise (one seeded direction at the two relative mean squares ``||dW||^2 / ||W||^2`` of ``NOISE``);
   ``alpha_t`` is the slope of the mean KL of the noisy model's next-token distribution from the clean one's, over
   uniformly random token ids (seeded), between the two. A slope, not KL / noise: any change to a tensor, however
   small, flips some near-tied router choices downstream — a jump of the KL that every method pays alike (measured up
   to 0.03 nats for a first-layer tensor at 1e-9 noise on the real-weights fixture) and that would otherwise swamp
   the differences between methods. A tensor is an attention/shared-expert/dense linear or one layer's routed-experts slot (``w13`` or
   ``w2``, all experts together).
2. **Error** ``e_t(m)``: each candidate method ``m`` of the ladder quantizes the tensor as the load would; ``e_t(m)``
   is the relative squared weight error of what it gives back, and ``b_t(m)`` its exact bits per weight.
3. **Choice**: to first order (the additive error model HIGGS' "linearity theorem" states for small errors) the KL of
   the quantized model is ``sum_t alpha_t e_t(m_t)``; it is minimised subject to ``sum_t n_t b_t(m_t) <= bpw *
   sum_t n_t`` (``n_t`` weights): a knapsack, solved exactly by dynamic programming over the budget.

The result is an ordinary :class:`~moeq.config.QuantConfig` (the ladder's cheapest method as default, one rule per
tensor given another), saved with the model like any rule set; the same tensors then load streamed as usual. The
measurement needs the model once in its compute dtype in memory (a small or mid-size model; for larger ones write
the rules it prints for a smaller sibling or by hand).
"""
from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from moeq.config import QuantConfig, method
from moeq.errors import MoeqError

log = logging.getLogger(__name__)

LADDER = ("nl3-g32", "nl3", "iq4nl-dq", "iq4nl", "q5_0-opt", "q8_0")  # cheapest first; each a moeq method name
NOISE = (0.0025, 0.02)  # relative mean squares of the probe noise (about a 5-bit and a 3-bit grid's error)
TOKENS = 1024
SEQ = 256
BATCH = 4
BUCKETS = 20000  # budget resolution of the allocation (1/20000 of it)


@dataclasses.dataclass
class Tensor:
    """One unit of the allocation: ``name`` is the rule it gets (a linear's module name, or ``{experts}.w13|w2``)."""

    name: str
    params: int
    alpha: float = 0.0
    error: dict[str, float] = dataclasses.field(default_factory=dict)  # method -> relative squared weight error
    bits: dict[str, float] = dataclasses.field(default_factory=dict)  # method -> bits per weight

    def cost(self, m: str) -> float:
        return self.alpha * self.error[m]


@dataclasses.dataclass
class Sensitivity:
    """What :func:`measure` found: every tensor's ``alpha`` and ladder errors (reused for any budget)."""

    tensors: list[Tensor]
    ladder: tuple[str, ...]
    tokens: int
    seed: int

    def bits_range(self) -> tuple[float, float]:
        n = sum(t.params for t in self.tensors)
        lo = sum(t.params * min(t.bits.values()) for t in self.tensors) / n
        hi = sum(t.params * max(t.bits.values()) for t in self.tensors) / n
        return lo, hi


def _units(model: nn.Module) -> list[tuple[str, list[torch.Tensor], callable]]:
    """(rule name, the parameters to perturb, a function giving moeq-layout weights to quantize) per tensor the
    default policy quantizes."""
    from moeq.arch import get_arch  # noqa: PLC0415
    from moeq.convert import down_weight, plan, split_gate_up  # noqa: PLC0415

    arch = get_arch(model.config)
    experts, linears = plan(model, arch, QuantConfig(method(LADDER[0])))
    units = []
    for name in experts:
        mod = model.get_submodule(name)

        def w13(mod=mod):
            return torch.stack([torch.cat(split_gate_up(arch, w)) for w in mod.gate_up_proj])

        def w2(mod=mod):
            return torch.stack([down_weight(arch, w) for w in mod.down_proj])

        units.append((f"{name}.w13", [mod.gate_up_proj], w13))
        units.append((f"{name}.w2", [mod.down_proj], w2))
    for name in linears:
        mod = model.get_submodule(name)
        units.append((name, [mod.weight], lambda mod=mod: mod.weight))
    for name, params, _ in units:
        for p in params:
            if not (isinstance(p, torch.Tensor) and p.is_floating_point() and p.device.type != "meta"):
                raise MoeqError(f"bit allocation: {name} is not held as floating-point weights (a pre-quantized "
                                "checkpoint?); it needs an unquantized (bf16/fp16/fp32/FP8) source")
    return units


@torch.no_grad()
def _kl(model: nn.Module, ids: torch.Tensor, ref: list[torch.Tensor]) -> float:
    total = 0.0
    for rows, lp in zip(ids.split(BATCH), ref):
        q = torch.log_softmax(model(rows, use_cache=False).logits.float(), -1)
        total += float((lp.exp() * (lp - q)).sum())
    return total / ids.numel()


def _columns(name: str, importance, w: torch.Tensor) -> torch.Tensor:
    """Column weights broadcastable onto the moeq-layout weight ``w`` (``[N, K]`` or ``[E, N, K]``): the importance
    statistic where measured (per expert for experts), else ones."""
    if importance is None:
        return torch.ones(w.shape[-1])
    if w.ndim == 3:
        mod, _, slot = name.rpartition(".")
        pair = importance.experts.get(mod)
        return torch.ones(w.shape[-1]) if pair is None else pair[1 if slot == "w2" else 0].float().unsqueeze(1)
    col = importance.linear(name)
    return torch.ones(w.shape[-1]) if col is None else col.float()


def _quantize(m: str, w: torch.Tensor, name: str, importance, cols: torch.Tensor):
    """``w`` as method ``m`` quantizes it in a load (with importance: per expert, each with its own columns)."""
    fmt = method(m)
    if importance is None or not fmt.uses_importance():
        return fmt.quantize(w, name=name)
    if w.ndim == 2:
        return fmt.quantize(w, name=name, importance=cols)
    parts = [fmt.quantize(w[e], name=f"{name}[{e}]", importance=cols[e, 0] if bool(cols[e, 0].any()) else None)
             for e in range(w.shape[0])]
    return type(parts[0]).join([[q] for q in parts])


@torch.no_grad()
def measure(model: nn.Module, ladder: tuple[str, ...] = LADDER, tokens: int | None = None, seed: int = 0,
            progress: bool = True, importance=None) -> Sensitivity:
    """Every tensor's sensitivity and ladder errors on ``model`` (unquantized, as :func:`moeq.load` without a method
    returns it), over ``tokens`` random ids (default :data:`TOKENS`). ``importance`` (:class:`moeq.importance.
    Importance`): the errors are then the importance-weighted ones of weights quantized with it, as the load will
    (``sum_k c_k dW_k^2 / sum_k c_k W_k^2`` over input columns ``k``), and the probe's size is measured the same way."""
    tokens = TOKENS if tokens is None else tokens
    for m in ladder:
        method(m)  # an unknown name fails here, before any work
    if tokens < SEQ or tokens % SEQ:
        raise MoeqError(f"bit allocation: tokens must be a positive multiple of {SEQ}, got {tokens}")
    units = _units(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens // SEQ, SEQ), generator=gen)
    ref = [torch.log_softmax(model(rows, use_cache=False).logits.float(), -1) for rows in ids.split(BATCH)]
    out = []
    for name, params, weight in tqdm(units, desc="sensitivity", unit="tensor", disable=not progress):
        t = Tensor(name, sum(p.numel() for p in params))
        kept = [p.detach().clone() for p in params]
        rms2 = [float(p.float().pow(2).mean()) for p in params]
        dirs = [torch.randn(p.shape, generator=gen) * math.sqrt(r) for p, r in zip(params, rms2)]
        kl = []
        for level in NOISE:  # one direction at two sizes: the slope, without the jump any change makes
            for p, k, d in zip(params, kept, dirs):
                p.copy_((k.float() + d * math.sqrt(level)).to(p.dtype))
            kl.append(_kl(model, ids, ref))
        for p, k in zip(params, kept):
            p.copy_(k)
        w = weight().float()
        cols = _columns(name, importance, w)
        norm = float((cols * w.pow(2)).sum())
        # the probe's weighted relative error per unit of level: its expectation over the direction (exact to
        # ~1/sqrt(weights)); 1 without importance
        probe = rms2[0] * float(cols.expand_as(w).sum()) / max(norm, 1e-30)
        t.alpha = max(kl[1] - kl[0], 0.0) / ((NOISE[1] - NOISE[0]) * probe)
        for m in ladder:
            try:
                q = _quantize(m, w.to(params[0].dtype), name, importance, cols)
            except MoeqError as e:  # a shape this method cannot take: not a candidate for this tensor
                log.info("bit allocation: %s cannot take %s (%s)", m, name, e)
                continue
            t.error[m] = float((cols * (q.dequantize(torch.float32) - w).pow(2)).sum()) / max(norm, 1e-30)
            t.bits[m] = q.bits_per_weight
        if not t.error:
            raise MoeqError(f"bit allocation: no method of {list(ladder)} can quantize {name} {list(w.shape)}")
        out.append(t)
    log.info("bit allocation: %d tensors measured over %d random tokens", len(out), tokens)
    return Sensitivity(out, tuple(ladder), tokens, seed)


def choose(sens: Sensitivity, bpw: float) -> dict[str, str]:
    """The method of each tensor: least predicted KL with at most ``bpw`` bits per quantized weight — a knapsack
    solved exactly by dynamic programming over the budget in ``BUCKETS`` steps (each choice's bits rounded up, so
    the budget is never exceeded)."""
    lo, hi = sens.bits_range()
    total = sum(t.params for t in sens.tensors)
    if bpw < lo - 1e-9:
        raise MoeqError(f"bpw {bpw}: below what the cheapest methods of {list(sens.ladder)} give this model "
                        f"({lo:.3f} bits per weight)")
    if bpw >= hi:
        return {t.name: min(t.error, key=t.cost) for t in sens.tensors}
    base = {t.name: min(t.bits[m] for m in t.error) for t in sens.tensors}
    spare = bpw * total - sum(t.params * base[t.name] for t in sens.tensors)  # bits for upgrades over the cheapest
    step = max(spare, 0.0) / BUCKETS or 1.0
    dp = np.full(BUCKETS + 1, np.inf)
    dp[0] = 0.0
    picks, options = [], []
    for t in sens.tensors:
        opts = sorted((math.ceil(t.params * (t.bits[m] - base[t.name]) / step - 1e-6), t.cost(m), m) for m in t.error)
        new = np.full(BUCKETS + 1, np.inf)
        pick = np.zeros(BUCKETS + 1, dtype=np.int8)
        for j, (w, c, _) in enumerate(opts):
            if w > BUCKETS or (w > 0 and spare <= 0):
                continue
            cand = np.full(BUCKETS + 1, np.inf)
            cand[w:] = dp[: BUCKETS + 1 - w] + c
            better = cand < new
            new[better] = cand[better]
            pick[better] = j
        dp = new
        picks.append(pick)
        options.append(opts)
    b = int(np.argmin(dp))
    got = {}
    for t, pick, opts in zip(reversed(sens.tensors), reversed(picks), reversed(options)):
        w, _, m = opts[pick[b]]
        got[t.name] = m
        b -= w
    return got


def config(sens: Sensitivity, bpw: float) -> QuantConfig:
    """:func:`choose` as a :class:`QuantConfig`: the ladder's cheapest method by default, a rule per tensor given
    another."""
    got = choose(sens, bpw)
    base = sens.ladder[0]
    rules = tuple((name, method(m)) for name, m in got.items() if m != base)
    return QuantConfig(method(base), rules)


def summary(sens: Sensitivity, bpw: float) -> dict:
    """What the allocation predicts and spends, for the saved record and the CLI."""
    got = choose(sens, bpw)
    total = sum(t.params for t in sens.tensors)
    count: dict[str, int] = {}
    for m in got.values():
        count[m] = count.get(m, 0) + 1
    return {"target_bpw": bpw, "bpw": sum(t.params * t.bits[got[t.name]] for t in sens.tensors) / total,
            "predicted_kl": sum(t.cost(got[t.name]) for t in sens.tensors), "ladder": list(sens.ladder),
            "tensors_per_method": count, "tokens": sens.tokens, "seed": sens.seed, "noise": list(NOISE),
            "inputs": "uniform random token ids"}
