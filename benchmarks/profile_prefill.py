"""Where a prompt's time goes (issue #18), and what the native prompt kernels change: the bench model's forward over a
``--length``-token prompt (logits of the last position, as ``generate``'s first step), timed per module kind with
forward hooks (q/k/v/o linears, the rest of attention, experts, router, norms, head), with moeq's native prompt
kernels (``native/csrc/gemm.c``: the grouped expert GEMM and the causal attention) and without them (dequantize +
bf16 matmul per expert, transformers' sdpa), alternating in one process over rounds.

    python benchmarks/profile_prefill.py --method q4_0+head:q8_0 [--length 512] [--rounds 4]

Prints a table (ms per prompt, best round per part) and writes JSON to ``benchmarks/results/profile_prefill.json``."""
from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import moeq
import moeq.nn.attention as attention
import moeq.nn.experts as experts
from moeq import bench
from moeq.io.writer import write_json

ROOT = Path(__file__).resolve().parents[1]


def _kind(name: str) -> str | None:
    if name.endswith("self_attn"):
        return "attention (all)"
    if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")):
        return "q/k/v/o"
    if name.endswith("mlp.experts"):
        return "experts"
    if name.endswith("mlp.gate"):
        return "router"
    if "norm" in name:
        return "norms"
    return "head" if name == "lm_head" else None


def main() -> None:
    from bench_vs_llamacpp import quant_config  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="q4_0+head:q8_0")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "profile_prefill.json"))
    args = ap.parse_args()
    src = bench.write_model(Path.home() / ".cache" / "moeq-bench" / f"qwen3-30b-a3b-shape-{args.layers}L-v151936",
                            args.layers)
    model = moeq.load(src, quant=quant_config(args.method), progress=False)
    acc: dict[str, float] = collections.defaultdict(float)
    start: dict[str, float] = {}
    for name, mod in model.named_modules():
        kind = _kind(name)
        if kind is None:
            continue
        mod.register_forward_pre_hook(lambda m, a, name=name: start.__setitem__(name, time.perf_counter()))
        mod.register_forward_hook(
            lambda m, a, o, name=name, kind=kind: acc.__setitem__(kind, acc[kind] + time.perf_counter() - start[name]))
    kernels = {"native": (experts.moe_prefill, attention._native_prefill),
               "dequant+matmul, sdpa": (lambda *a: None, lambda *a: None)}
    rows: dict[str, list[dict]] = {k: [] for k in kernels}
    bench.prefill_seconds(model, 16, False)  # warm-up (builds the native library)
    for r in range(args.rounds):
        for label, (moe_fn, attn_fn) in kernels.items():
            experts.moe_prefill, attention._native_prefill = moe_fn, attn_fn
            acc.clear()
            total = bench.prefill_seconds(model, args.length, False)
            parts = {k: v * 1000 for k, v in acc.items()}
            parts["attention (rest)"] = parts["attention (all)"] - parts.get("q/k/v/o", 0.0)
            rows[label].append({"round": r, "total_ms": total * 1000, "parts_ms": parts})
            print({"round": r, "kernels": label, "total_ms": round(total * 1000, 1)}, flush=True)
    experts.moe_prefill, attention._native_prefill = kernels["native"]
    best = {label: min(rs, key=lambda x: x["total_ms"]) for label, rs in rows.items()}
    names = ["experts", "q/k/v/o", "attention (rest)", "norms", "router", "head"]
    print(f"\n{args.method}, prompt {args.length} tokens, best of {args.rounds} alternating rounds (ms)")
    print("| part | " + " | ".join(best) + " |")
    print("|---|" + "---|" * len(best))
    for n in ["total", *names]:
        vals = [b["total_ms"] if n == "total" else b["parts_ms"].get(n, 0.0) for b in best.values()]
        print(f"| {n} | " + " | ".join(f"{v:.0f}" for v in vals) + " |")
    write_json(Path(args.out), {"method": args.method, "length": args.length, "cpu": bench.cpu_summary(),
                                "rounds": rows, "best": best})


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    main()
