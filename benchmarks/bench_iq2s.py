"""IQ2_S against the other 2- and 4-bit rows at Qwen3-30B-A3B's expert shapes, eight experts' rows as one weight per
call (gate+up 8 x 1536 x 2048, down 8 x 2048 x 768: the work of a decode step's routed experts, each call long enough
that the call overhead is noise), weights from memory (more of them than the L3 holds, cycled through): Gweights/s and
GB/s of the native GEMV (``moeq.kernels.linear``) at 1 and 4 rows beside the read probe, all in one run; and quantize
speed (bf16 GB/s). Results: ``benchmarks/results/iq2s_speed.json``.

    python benchmarks/bench_iq2s.py --out benchmarks/results/iq2s_speed.json
    MOEQ_NATIVE_MARCH=x86-64-v3 python benchmarks/bench_iq2s.py --out benchmarks/results/iq2s_speed_avx2.json
"""
from __future__ import annotations

import argparse
import time

import torch

from moeq.bench import cpu_summary, memory_bandwidth
from moeq.config import METHODS
from moeq.io.writer import write_json
from moeq.kernels import linear

SHAPES = {"w13": (8 * 1536, 2048), "w2": (8 * 2048, 768)}


def gemv_rate(ws: list, k: int, rows: int, reps: int) -> float:
    """Weights/s of ``linear`` over a cycle of experts (each read once per pass: from memory)."""
    x = torch.randn(rows, k).bfloat16()
    for w in ws[:2]:
        linear(w, x)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for w in ws:
            linear(w, x)
        best = min(best, time.perf_counter() - t)
    return len(ws) * ws[0].numel / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", type=int, default=24, help="weights cycled through (more than the L3 holds)")
    ap.add_argument("--methods", nargs="*", default=["iq2s", "nl2", "q4_0"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    out = {"cpu": cpu_summary(), "probe_gbps": memory_bandwidth() / 1e9, "rows": []}
    for kind, (n, k) in SHAPES.items():
        src = torch.randn(n, k).bfloat16() * 0.02
        for name in args.methods:
            t = time.perf_counter()
            q = METHODS[name].quantize(src, importance=torch.ones(k) if name == "iq2s" else None)
            qsecs = time.perf_counter() - t
            ws = [q] + [type(q)(**{f: (v.clone() if isinstance(v, torch.Tensor) else v)
                                   for f, v in vars(q).items()}) for _ in range(args.weights - 1)]
            for rows in (1, 4):
                rate = gemv_rate(ws, k, rows, args.reps)
                out["rows"].append({"method": name, "weight": kind, "shape": [n, k], "rows": rows,
                                    "bits_per_weight": q.bits_per_weight, "gweights_per_s": rate / 1e9,
                                    "gbps": rate * q.bits_per_weight / 8 / 1e9,
                                    "quantize_bf16_gbps": n * k * 2 / qsecs / 1e9})
                r = out["rows"][-1]
                print(f"{kind} {name:5s} {rows} rows: {r['gweights_per_s']:.2f} Gweights/s {r['gbps']:.1f} GB/s "
                      f"(probe {out['probe_gbps']:.1f}); quantize {r['quantize_bf16_gbps']:.4f} GB/s", flush=True)
    out["probe_gbps_after"] = memory_bandwidth() / 1e9
    if args.out:
        write_json(args.out, out)


if __name__ == "__main__":
    main()
