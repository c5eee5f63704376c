"""Where a native decode step's time goes (issue #18): the bench model's step taken apart into the native calls it
makes — per layer the q/k/v/o linears, attention, router, experts; the head — each timed in the order a step runs
them (so every weight is as cold as in a real step: the model is far larger than the caches), next to the whole
step and a plain read of the same bytes, all in one process, alternating over rounds.

    python benchmarks/profile_decode.py --method q4_0+head:q8_0 [--activations int8] [--rounds 5]

Prints a table (ms per token, GB/s of weight bytes, fraction of the read probe) and writes JSON to
``benchmarks/results/profile_decode.json``."""
from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

import torch

import moeq
from moeq import bench, native
from moeq.nn import engine
from moeq.io.writer import write_json

ROOT = Path(__file__).resolve().parents[1]


def _qconfig(method: str):
    from bench_vs_llamacpp import quant_config  # noqa: PLC0415

    return quant_config(method)


def _bytes(mod) -> int:
    return sum(t.numel() * t.element_size() for t in list(mod.parameters()) + list(mod.buffers()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="q4_0+head:q8_0")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--activations", choices=["default", "int8"], default="default")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    ap.add_argument("--tile-rows", type=int, default=None,
                    help="fewest rows an il16 linear takes on the AMX tile unit (moeq_set_linear_amx_rows; 0: never)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "profile_decode.json"))
    args = ap.parse_args()
    if args.tile_rows is not None:
        native.lib().moeq_set_linear_amx_rows(args.tile_rows)
    src = bench.write_model(Path.home() / ".cache" / "moeq-bench" / f"qwen3-30b-a3b-shape-{args.layers}L-v151936",
                            args.layers)
    model = moeq.load(src, quant=_qconfig(args.method), progress=False)
    moeq.set_activations(model, args.activations)
    eng = engine.engine_of(model)
    S = 64
    B = args.batch
    m, keep, caches, state = eng.describe(B, S + args.steps + 2, S + args.steps + 2)
    L = native.lib()
    layers = eng.layers
    nl = len(layers)
    cfg = eng.cfg
    H, E, A = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
    lay = [ctypes.pointer(m.layers[i]) for i in range(nl)]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(B, H, generator=g) * 0.5).to(torch.bfloat16)
    cs, sn = eng._rope(S + 1)
    cs, sn = cs[S:S + 1].contiguous(), sn[S:S + 1].contiguous()
    c0 = m.layers[0]
    q = torch.empty(B, c0.Hq * c0.D, dtype=torch.bfloat16)
    k = torch.empty(B, c0.Hkv * c0.D, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    r1, n2, out = (torch.empty(B, H, dtype=torch.bfloat16) for _ in range(3))
    rl = torch.empty(B, E, dtype=torch.bfloat16)
    ao = (torch.randn(B, c0.Hq * c0.D, generator=g) * 0.5).to(torch.bfloat16)
    o = torch.empty(B, H, dtype=torch.bfloat16)
    logits = torch.empty(B, m.V, dtype=torch.bfloat16)
    scratch = torch.empty(4 * B * (H + m.V) + (1 << 20))

    def lin(ws, xin, y):
        L.moeq_quant_linear_bf16(ctypes.byref(ws), xin.data_ptr(), B, None, y.data_ptr(), scratch.data_ptr())

    attn_b = sum(_bytes(getattr(layers[0].self_attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    exp_b = _bytes(layers[0].mlp.experts) * min(E, B * A) // E  # at most; fewer where rows share an expert
    parts = {"q/k/v": 0.0, "attention": 0.0, "o": 0.0, "router": 0.0, "experts": 0.0, "head": 0.0}
    nbytes = {"q/k/v": nl * (attn_b - _bytes(layers[0].self_attn.o_proj)), "o": nl * _bytes(layers[0].self_attn.o_proj),
              "router": nl * _bytes(layers[0].mlp.gate), "experts": nl * exp_b, "head": _bytes(eng.head),
              "attention": 0}
    rounds = []
    tok = torch.arange(B) * 37 + 5  # distinct tokens: the rows route to different experts, as in a real batch
    for rnd in range(args.rounds):
        bw = bench.memory_bandwidth()
        # the whole step, as generate runs it
        t0 = time.perf_counter()
        for i in range(args.steps):
            eng.step(m, tok, torch.full((B,), S + i), S + i + 1, None, state)
        step_ms = (time.perf_counter() - t0) / args.steps * 1e3
        # the same step in parts, each call timed
        t = dict.fromkeys(parts, 0.0)
        for i in range(args.steps):
            for li in range(nl):
                Ly = m.layers[li]
                t1 = time.perf_counter()
                lin(Ly.q, x, q), lin(Ly.k, x, k), lin(Ly.v, x, v)
                t2 = time.perf_counter()
                L.moeq_attn_decode_bf16(q.data_ptr(), caches[2 * li].data_ptr(), caches[2 * li + 1].data_ptr(), None,
                                        B, Ly.Hq, Ly.Hkv, S, Ly.D, Ly.scale, ao.data_ptr())
                t3 = time.perf_counter()
                lin(Ly.o, ao, o)
                t4 = time.perf_counter()
                L.moeq_bf16_gemv(x.data_ptr(), B, Ly.router, E, H, rl.data_ptr())
                t5 = time.perf_counter()
                idx = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(B)]).contiguous()
                wt = torch.full((B, A), 1.0 / A)
                L.moeq_layer_moe(lay[li], x.data_ptr(), x.data_ptr(), B, idx.data_ptr(), wt.data_ptr(), None,
                                 out.data_ptr())
                t6 = time.perf_counter()
                for name, dt in zip(("q/k/v", "attention", "o", "router", "experts"), (t2 - t1, t3 - t2, t4 - t3,
                                                                                      t5 - t4, t6 - t5)):
                    t[name] += dt
            t1 = time.perf_counter()
            if m.head12:
                L.moeq_bf12_matmul(m.head12, x.data_ptr(), B, logits.data_ptr())
            elif m.head:
                L.moeq_bf16_gemv(x.data_ptr(), B, m.head, m.V, H, logits.data_ptr())
            else:
                L.moeq_quant_linear_bf16(ctypes.byref(m.hq), x.data_ptr(), B, None, logits.data_ptr(),
                                         m.head_scratch)
            t["head"] += time.perf_counter() - t1
        t = {n: v / args.steps * 1e3 for n, v in t.items()}
        bw = max(bw, bench.memory_bandwidth())
        rounds.append({"round": rnd, "bandwidth_gbps": bw / 1e9, "step_ms": step_ms, "parts_ms": t})
        print(json.dumps(rounds[-1]), flush=True)
    best = min(rounds, key=lambda r: r["step_ms"])
    bw = best["bandwidth_gbps"]
    print(f"\n{args.method}, batch {B}, activations {args.activations}: step {best['step_ms']:.2f} ms "
          f"({B * 1e3 / best['step_ms']:.1f} tok/s), parts sum {sum(best['parts_ms'].values()):.2f} ms, probe {bw:.1f} GB/s")
    print("| part | ms/token | MB | GB/s | of probe |\n|---|---|---|---|---|")
    for n, ms in best["parts_ms"].items():
        mb = nbytes[n] / 1e6
        gbs = nbytes[n] / ms / 1e6 if ms else 0.0
        print(f"| {n} | {ms:.2f} | {mb:.0f} | {gbs:.1f} | {gbs / bw:.0%} |")
    write_json(Path(args.out), {"method": args.method, "batch": B, "activations": args.activations,
                                "tile_rows": args.tile_rows, "cpu": bench.cpu_summary(),
                                "bytes": nbytes, "rounds": rounds})


if __name__ == "__main__":
    main()
