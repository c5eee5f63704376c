"""One MoE layer's expert pass on its own, to tell what bounds it: the native layer call of the decode step
(``moeq_layer_moe``) on the bench model (Qwen3-30B-A3B's expert shapes), with the routing chosen so that the active
experts get exactly ``m`` activation rows each, timed

- **cold**: each call routes to experts of another layer than the last call's, chosen at random (the 4 layers'
  experts are ~1.4 GB against a ~100 MB last-level cache): the weights stream from memory, as in a real step;
- **warm**: the same 8 experts of one layer every call (21 MB at 4.5 bits: they stay in the last-level cache):
  the rate the kernels compute at without DRAM.

Cold close to warm means the rows are compute-bound; warm far above cold means the memory side (streams, prefetch)
bounds them. ``MOEQ_HUGE_PAGES=0`` runs it with the weights (and the probe's buffer) on 4 KB pages, as before
:mod:`moeq.native.pages`. Cases alternate within each round; the read probe is taken in every round. Appends one
record per run to the JSON.

    python benchmarks/bench_expert_pass.py [--method q4_0] [--rounds 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from pathlib import Path

import torch

import moeq
from moeq import bench, native
from moeq.io.writer import write_json
from moeq.nn import engine

ROOT = Path(__file__).resolve().parents[1]


def _qconfig(method: str):
    from bench_vs_llamacpp import quant_config  # noqa: PLC0415

    return quant_config(method)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="q4_0")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=40, help="timed calls per case and round")
    ap.add_argument("--activations", choices=["default", "int8"], default="default")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "expert_pass.json"))
    args = ap.parse_args()
    src = bench.write_model(Path.home() / ".cache" / "moeq-bench" / f"qwen3-30b-a3b-shape-{args.layers}L-v151936",
                            args.layers)
    model = moeq.load(src, quant=_qconfig(args.method), progress=False)
    moeq.set_activations(model, args.activations)
    eng = engine.engine_of(model)
    m, keep, caches, state = eng.describe(8, 64, 64)
    L = native.lib()
    cfg = eng.cfg
    H, E, A, nl = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, len(eng.layers)
    lay = [ctypes.pointer(m.layers[i]) for i in range(nl)]
    ex = eng.layers[0].mlp.experts
    per_expert = sum(t.numel() * t.element_size() for t in list(ex.parameters()) + list(ex.buffers())) // E
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, H, generator=g) * 0.5).to(torch.bfloat16)
    out = torch.empty(8, H, dtype=torch.bfloat16)
    wt = torch.full((8, A), 1.0 / A)
    # (label, rows per expert, experts per call, cold, adjacent in memory)
    cases = [("1 row x 8 experts", 1, 8, True, False), ("1 row x 16 experts", 1, 16, True, False),
             ("1 row x 8 adjacent experts", 1, 8, True, True), ("2 rows x 8 experts", 2, 8, True, False),
             ("4 rows x 8 experts", 4, 8, True, False), ("1 row x 32 experts", 1, 32, True, False),
             ("1 row x 8 experts, warm", 1, 8, False, False), ("1 row x 16 experts, warm", 1, 16, False, False),
             ("2 rows x 8 experts, warm", 2, 8, False, False), ("4 rows x 8 experts, warm", 4, 8, False, False)]

    def routing(rows: int, n: int, adjacent: bool) -> tuple[int, torch.Tensor]:
        """(tokens, idx [tokens, A]): n distinct experts (one run of consecutive ones if ``adjacent``), each routed
        exactly ``rows`` tokens."""
        if adjacent:
            e0 = int(torch.randint(0, E - n + 1, (1,), generator=g))
            experts = torch.arange(e0, e0 + n)
        else:
            experts = torch.randperm(E, generator=g)[:n]
        toks = rows * n // A
        return toks, experts.repeat(rows).view(toks, A).contiguous()

    def run(rows: int, n: int, cold: bool, adjacent: bool) -> float:
        li = 0
        fixed = routing(rows, n, adjacent)
        total = 0.0
        for i in range(args.calls + 2):
            if cold:
                li = (li + 1) % nl
                toks, idx = routing(rows, n, adjacent)
            else:
                toks, idx = fixed
            t0 = time.perf_counter()
            L.moeq_layer_moe(lay[li], x.data_ptr(), x.data_ptr(), toks, idx.data_ptr(), wt.data_ptr(), None,
                             out.data_ptr())
            if i >= 2:  # two warm-up calls
                total += time.perf_counter() - t0
        return total / args.calls

    rounds = []
    for rnd in range(args.rounds):
        probe = bench.memory_bandwidth()
        res = {}
        for label, rows, n, cold, adjacent in cases:
            sec = run(rows, n, cold, adjacent)
            res[label] = {"ms": sec * 1e3, "gbps": n * per_expert / sec / 1e9, "rows": rows, "experts": n,
                          "cold": cold}
        probe = max(probe, bench.memory_bandwidth())
        rounds.append({"round": rnd, "bandwidth_gbps": probe / 1e9, "cases": res})
        print(json.dumps(rounds[-1]), flush=True)
    best = {label: max(r["cases"][label]["gbps"] for r in rounds) for label, *_ in cases}
    probe = max(r["bandwidth_gbps"] for r in rounds)
    threads = torch.get_num_threads()
    huge = os.environ.get("MOEQ_HUGE_PAGES", "1") != "0"
    print(f"\n{args.method}, activations {args.activations}, {threads} thread(s), 2 MB pages {huge}, "
          f"probe {probe:.1f} GB/s, {per_expert / 1e6:.2f} MB per expert")
    print("| case | GB/s (best round) | of probe |\n|---|---|---|")
    for label, v in best.items():
        print(f"| {label} | {v:.1f} | {v / probe:.0%} |")
    rec = {"what": __doc__.split("\n\n")[0], "method": args.method, "activations": args.activations,
           "threads": threads, "huge_pages": huge, "cpu": bench.cpu_summary(),
           "bytes_per_expert": per_expert, "rounds": rounds, "best_gbps": best, "probe_gbps": probe}
    path = Path(args.out)
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    write_json(path, {"runs": runs + [rec]})


if __name__ == "__main__":
    main()
