"""Quantize/dequantize throughput of every format on a [128, 1536, 2048] bf16 expert stack, side by side with
bitsandbytes' quantize_4bit/dequantize_4bit on the same tensor in the same run. Writes
benchmarks/results/formats.json and prints a markdown table (pasted into the README)."""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from moeq.config import BNB4, RTN, Int8, method
from moeq.demo import synthetic_stack
from moeq.io.writer import write_json


def timed(fn, repeat: int = 2):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=3, default=[128, 1536, 2048])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "formats.json"))
    args = ap.parse_args()
    w = synthetic_stack(tuple(args.shape))
    gb = w.numel() * 2 / 1e9
    rows = []
    bnb_q = bnb_dq = None
    try:
        import bitsandbytes.functional as F

        tq, (P, S) = timed(lambda: F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True), 1)
        td, _ = timed(lambda: F.dequantize_4bit(P, S))
        bnb_q, bnb_dq = gb / tq, gb / td
        rows.append({"format": "bitsandbytes nf4-b64-dq", "quantize_gbps": bnb_q, "dequantize_gbps": bnb_dq})
        del P, S
    except ImportError:
        pass
    for cfg in (RTN(4, 128), RTN(4, 128, symmetric=False), RTN(8, 128), BNB4("nf4", 64, True), BNB4("fp4", 64, True),
                Int8(), *(method(n) for n in ("q4_0", "q8_0", "q4_0-opt", "iq4nl", "iq4nl-dq", "q5_0", "q5_0-opt",
                                               "nf4-opt", "nl3"))):
        tq, q = timed(lambda: cfg.quantize(w), 1)
        td, _ = timed(lambda: q.dequantize(torch.bfloat16))
        r = {"format": cfg.label(), "quantize_gbps": gb / tq, "dequantize_gbps": gb / td, "seconds": tq,
             "bits_per_weight": q.bits_per_weight}
        if bnb_q:
            r["quantize_vs_bnb"] = r["quantize_gbps"] / bnb_q
            r["dequantize_vs_bnb"] = r["dequantize_gbps"] / bnb_dq
        rows.append(r)
        del q
    res = {"shape": args.shape, "input_gb": gb, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "machine": platform.processor() or platform.machine(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, res)
    print("| format | quantize GB/s | dequantize GB/s | quantize × bnb | dequantize × bnb |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['quantize_gbps']:.2f} | {r['dequantize_gbps']:.2f} | "
              f"{r.get('quantize_vs_bnb', 1):.1f} | {r.get('dequantize_vs_bnb', 1):.2f} |")


if __name__ == "__main__":
    main()
