"""Calibration-free 3-bit ideas, screened on the real-weights fixture before any of them gets a storage format and
kernels: each variant fake-quantizes (quantize -> dequantize, in torch) exactly the weights moeq quantizes
(attention q/k/v/o and the fused expert stacks) and is evaluated against the bf16 model on held-out text.

Variants (all 3-bit codes, per-group scale/offset along the input dim):
- RTN asymmetric (min/max), and with a per-group MSE clip search;
- a per-tensor 8-level codebook fitted by Lloyd-Max to the min/max-normalized weights (non-uniform grid, asym),
  and its symmetric (absmax) counterpart;
- block-Hadamard incoherence processing (QuIP#/QuaRot-style rotation of the input dim in blocks of 64, undone on the
  activations at run time) before RTN / Lloyd;
- data-free channel scaling by the preceding RMSNorm weight (|gamma|^alpha folded into the norm, AWQ-like without
  data) for the projections that read a norm's output;
- 4-bit asymmetric g64 as a point of reference.

    python benchmarks/explore_3bit.py [--model DIR] [--max-tokens 2560]
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench_accuracy import DATA, HERE, heldout_text
from moeq.eval import evaluate_many, tokenize


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rtn_asym(g: torch.Tensor, bits: int, clip: float = 1.0) -> torch.Tensor:
    mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    c, h = (mn + mx) / 2, (mx - mn) / 2 * clip
    maxq = 2**bits - 1
    s = (2 * h / maxq).clamp(min=1e-12)
    z = torch.round(-(c - h) / s)
    return (torch.clamp(torch.round(g / s) + z, 0, maxq) - z) * s


def rtn_asym_search(g: torch.Tensor, bits: int) -> torch.Tensor:
    best, best_err = None, None
    for c in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7):
        d = rtn_asym(g, bits, c)
        e = ((d - g) ** 2).sum(-1, keepdim=True)
        if best is None:
            best, best_err = d, e
        else:
            better = e < best_err
            best, best_err = torch.where(better, d, best), torch.minimum(e, best_err)
    return best


def lloyd(u: torch.Tensor, n: int, iters: int = 30) -> torch.Tensor:
    """Lloyd-Max levels in [0, 1] for samples u (a random subset of at most 2M)."""
    u = u.flatten()
    if u.numel() > 2_000_000:
        u = u[torch.randperm(u.numel(), generator=torch.Generator().manual_seed(0))[:2_000_000]]
    lv = torch.linspace(0, 1, n)
    for _ in range(iters):
        idx = torch.bucketize(u, (lv[1:] + lv[:-1]) / 2)
        cnt = torch.zeros(n).scatter_add_(0, idx, torch.ones_like(u))
        tot = torch.zeros(n).scatter_add_(0, idx, u)
        lv = torch.where(cnt > 0, tot / cnt.clamp(min=1), lv)
    return lv


def codebook_asym(g: torch.Tensor, bits: int) -> torch.Tensor:
    mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    r = (mx - mn).clamp(min=1e-12)
    u = (g - mn) / r
    lv = lloyd(u, 2**bits)
    return lv[torch.bucketize(u, (lv[1:] + lv[:-1]) / 2)] * r + mn


def codebook_sym(g: torch.Tensor, bits: int) -> torch.Tensor:
    am = g.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    u = g / am
    lv = lloyd((u + 1) / 2, 2**bits) * 2 - 1
    return lv[torch.bucketize(u, (lv[1:] + lv[:-1]) / 2)] * am


def quantized_params(model):
    for name, p in model.named_parameters():
        if name.endswith(("gate_up_proj", "down_proj")) or name.endswith(
                tuple(f"self_attn.{x}_proj.weight" for x in "qkvo")):
            yield name, p


def norm_before(model, name: str) -> torch.Tensor | None:
    """The RMSNorm weight whose output this projection reads (None for o_proj / down_proj)."""
    layer = model.model.layers[int(name.split(".layers.")[1].split(".")[0])]
    if name.endswith(tuple(f"self_attn.{x}_proj.weight" for x in "qkv")):
        return layer.input_layernorm.weight.detach().float()
    if name.endswith("gate_up_proj"):
        return layer.post_attention_layernorm.weight.detach().float()
    return None


@torch.no_grad()
def fake_quantize(model, fn, group: int, rotate: int = 0, alpha: float = 0.0) -> float:
    """Replace each quantized weight by fn's reconstruction; returns the relative squared error."""
    err = tot = 0.0
    for name, p in quantized_params(model):
        w = p.data.float()
        k = w.shape[-1]
        s = torch.ones(k)
        gamma = norm_before(model, name)
        if alpha and gamma is not None:
            s = gamma.abs().clamp(min=1e-3) ** alpha
            s = s / s.mean()
        v = w * s
        if rotate:
            h = hadamard(rotate)
            v = (v.reshape(*w.shape[:-1], k // rotate, rotate) @ h.T).reshape(w.shape)
        d = fn(v.reshape(*w.shape[:-1], k // group, group)).reshape(w.shape)
        if rotate:
            d = (d.reshape(*w.shape[:-1], k // rotate, rotate) @ h).reshape(w.shape)
        d = d / s
        err += ((d - w) ** 2).sum().item()
        tot += (w**2).sum().item()
        p.data.copy_(d.to(p.dtype))
    return err / tot


@torch.no_grad()
def allocate(model, frac4: float, how: str, group: int = 64) -> dict[str, int]:
    """Bits per tensor (3 or 4), about ``frac4`` of the parameters at 4 bits. ``how="stat"``: data-free, by the
    weight statistic 'squared-error saved per parameter by the 4th bit' (||W-Q3(W)||^2 - ||W-Q4(W)||^2) / numel;
    ``"attention"``: attention first; ``"early"``: the first layers first (positional baselines)."""
    items = []
    for name, p in quantized_params(model):
        w = p.data.float()
        g = w.reshape(*w.shape[:-1], w.shape[-1] // group, group)
        gain = ((rtn_asym(g, 3) - g) ** 2).sum().item() - ((rtn_asym(g, 4) - g) ** 2).sum().item()
        layer = int(name.split(".layers.")[1].split(".")[0])
        key = {"stat": -gain / w.numel(), "attention": (0 if "self_attn" in name else 1, layer),
               "early": (layer, 0 if "self_attn" in name else 1)}[how]
        items.append((key, name, w.numel()))
    total, bits, acc = sum(n for _, _, n in items), {}, 0
    for _, name, n in sorted(items):
        bits[name] = 4 if acc + n <= frac4 * total + 1 else 3
        acc += n if bits[name] == 4 else 0
    return bits


@torch.no_grad()
def fake_quantize_mixed(model, bits: dict[str, int], group: int = 64) -> tuple[float, float]:
    err = tot = n4 = n = 0.0
    for name, p in quantized_params(model):
        w = p.data.float()
        d = rtn_asym(w.reshape(*w.shape[:-1], w.shape[-1] // group, group), bits[name]).reshape(w.shape)
        err += ((d - w) ** 2).sum().item()
        tot += (w**2).sum().item()
        n4 += w.numel() * (bits[name] == 4)
        n += w.numel()
        p.data.copy_(d.to(p.dtype))
    return err / tot, n4 / n


MIXED = {  # name: (fraction of parameters at 4 bits, how); 3/4-bit asym g64
    "mixed 3/4 g64, 25% 4-bit: attention": (0.25, "attention"),
    "mixed 3/4 g64, 25% 4-bit: data-free statistic": (0.25, "stat"),
    "mixed 3/4 g64, 50% 4-bit: first layers": (0.5, "early"),
    "mixed 3/4 g64, 50% 4-bit: data-free statistic": (0.5, "stat"),
}

VARIANTS = {  # name: (fn, group, hadamard block, norm alpha, bits/weight with bf16 scale + 8-bit zero per group)
    "RTN-int3 asym g32": (lambda g: rtn_asym(g, 3), 32, 0, 0.0),
    "RTN-int3 asym g32 + MSE clip search": (lambda g: rtn_asym_search(g, 3), 32, 0, 0.0),
    "Lloyd 3-bit codebook asym g32": (lambda g: codebook_asym(g, 3), 32, 0, 0.0),
    "Lloyd 3-bit codebook sym g32": (lambda g: codebook_sym(g, 3), 32, 0, 0.0),
    "Hadamard-64 + RTN-int3 asym g32": (lambda g: rtn_asym(g, 3), 32, 64, 0.0),
    "Hadamard-64 + Lloyd 3-bit asym g32": (lambda g: codebook_asym(g, 3), 32, 64, 0.0),
    "norm scaling a=0.25 + RTN-int3 asym g32": (lambda g: rtn_asym(g, 3), 32, 0, 0.25),
    "norm scaling a=0.5 + RTN-int3 asym g32": (lambda g: rtn_asym(g, 3), 32, 0, 0.5),
    "RTN-int3 asym g64": (lambda g: rtn_asym(g, 3), 64, 0, 0.0),
    "reference point: RTN-int4 asym g64": (lambda g: rtn_asym(g, 4), 64, 0, 0.0),
    "reference point: norm scaling a=0.25 + RTN-int4 asym g64": (lambda g: rtn_asym(g, 4), 64, 0, 0.25),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "moeq-fixtures-out" / "smollm2-moe"))
    ap.add_argument("--max-tokens", type=int, default=2560)
    ap.add_argument("--out", default=str(HERE / "results" / "explore_3bit.json"))
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tokenize(tok, heldout_text(sorted(DATA.glob("text_*.txt"))))
    ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    models, rows = {}, {}
    for name, (fn, group, rotate, alpha) in VARIANTS.items():
        m = copy.deepcopy(ref)
        t0 = time.perf_counter()
        rel = fake_quantize(m, fn, group, rotate, alpha)
        models[name] = m
        rows[name] = {"variant": name, "relative_weight_mse": rel, "seconds": time.perf_counter() - t0}
    for name, (frac4, how) in MIXED.items():
        m = copy.deepcopy(ref)
        rel, got = fake_quantize_mixed(m, allocate(m, frac4, how))
        models[name] = m
        rows[name] = {"variant": name, "relative_weight_mse": rel, "fraction_4bit": got,
                      "bits_per_weight": 3.375 + got}
    for name, r in evaluate_many(models, ref, ids, ctx=512, max_tokens=args.max_tokens).items():
        rows[name].update(r.to_dict())
    Path(args.out).write_text(json.dumps({"model": args.model, "rows": list(rows.values())}, indent=1))
    print("| variant | relative weight MSE | PPL (ref) | mean KL | top-1 |\n|---|---|---|---|---|")
    for r in rows.values():
        print(f"| {r['variant']} | {r['relative_weight_mse']:.4f} | {r['ppl']:.1f} ({r['ref_ppl']:.1f}) | "
              f"{r['mean_kl']:.3f} | {r['top1']:.1%} |")


if __name__ == "__main__":
    main()
