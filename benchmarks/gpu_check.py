"""GPU check of moeq's Triton path, for a machine with one GPU, in well under 8 minutes:

1. the kernel tests (tests/kernels/test_triton_kernels.py) on the device;
2. device memory bandwidth (a large device-to-device copy); with ``--tune``, a small grid of block sizes per
   kernel (:func:`tune`), whose best configs the microbenchmarks then use (copy them into ``CONFIGS``);
3. kernel microbenchmark on Qwen3-30B-A3B's expert shapes (128 experts, top-8, hidden 2048, moe_intermediate 768)
   for 1, 8, 64 and 512 tokens, per format (every format the Triton layout takes, :func:`formats`):
   weight bytes it reads (the routed experts only) per second vs the device bandwidth, and time vs
   dequantize-all-experts + bf16 grouped matmul (vLLM's bitsandbytes MoE approach) and vs bf16 experts; plus
   on-device quantization GB/s (in-flight quantization on the GPU);
4. end to end on the 4-layer Qwen3-30B-A3B slice (``moeq bench``'s model): decode tok/s at batch 1 and prefill
   tok/s at 512/2048 tokens, moeq rtn-int4 / nf4 (loaded with ``device="cuda"``, quantized on the GPU) vs
   transformers bf16 on the same GPU.

Writes JSON (default ``benchmarks/results/gpu.json``). ``--smoke`` runs tiny shapes on whatever is there (on CPU
through Triton's interpreter) to check the script itself.

    python benchmarks/gpu_check.py [--out FILE] [--layers 4] [--smoke] [--tune] [--skip-tests] [--skip-e2e]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bandwidth(device) -> float:
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), device, 10)
    return 2 * n / t  # read + write


def graph_time(fns, device, reps: int = 10) -> float:
    """Seconds per call of the GPU work alone: ``fns`` (one call each, distinct routings so the weights they read
    are not all in L2) captured in one CUDA graph and replayed; launch overhead excluded. Eager on CPU."""
    if device.type != "cuda":
        return timed(lambda: [f() for f in fns], device, 1) / len(fns)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:  # warm-up: compile, allocate
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        g.replay()
        stop.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(stop) / 1e3 / len(fns))
    return best


def grouped_bf16(w13, w2, x, idx, wts):
    """bf16 experts: pairs grouped by expert, one grouped GEMM per projection (torch._grouped_mm where present)."""
    t, a = idx.shape
    e = w13.shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(e, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))  # no sync
    xs = x[order // a]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    i = w13.shape[1] // 2
    try:
        h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
        h = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    except (AttributeError, RuntimeError, NotImplementedError):
        y = torch.empty(xs.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for ex, n in enumerate(counts.tolist()):
            if n:
                h = xs[start:start + n] @ w13[ex].T
                h = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
                y[start:start + n] = h @ w2[ex].T
                start += n
    y = y * wts.reshape(-1)[order, None].to(y.dtype)
    out = torch.zeros(t, w2.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, order // a, y.float())
    return out.to(x.dtype)


def formats(smoke: bool) -> dict:
    """Every format the Triton layout takes: the 4-bit RTN grids (vLLM's, llama.cpp's Q4_0, the IQ4_NL and MXFP4
    codebooks — MXFP4 is also what gpt-oss checkpoints load into), bitsandbytes NF4, and the 8-bit ones."""
    from moeq.formats import bnb4, int8, rtn

    g = 32 if smoke else 128
    return {"rtn-int4 g128": lambda w: rtn.quantize(w, 4, g),
            "q4_0 (signed g32)": lambda w: rtn.quantize(w, 4, 32, grid="signed"),
            "iq4nl g32": lambda w: rtn.quantize(w, 4, 32, grid="iq4nl"),
            "mxfp4": lambda w: rtn.quantize(w, 4, 32, grid="mxfp4"),
            "nf4 b64 dq": lambda w: bnb4.quantize(w, "nf4", 64, True),
            "rtn-int8 g128": lambda w: rtn.quantize(w, 8, g),
            "llm.int8": lambda w: int8.quantize(w)}


def routings(tokens: int, e: int, k: int, device, count: int, dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(count):
        logits = torch.randn(tokens, e, generator=g).to(device)
        wts, idx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
        out.append((idx, (wts / wts.sum(-1, keepdim=True)).to(dtype)))
    return out


def shapes(smoke: bool):
    return (8, 128, 64, 2) if smoke else (128, 2048, 768, 8)


def tune(device, smoke: bool, kernels=("gemv", "gemm")) -> dict:
    """A small grid of block sizes per kernel on rtn-int4 g128 at Qwen3-30B-A3B's expert shapes: the GEMV at 1 token
    (decode), the grouped GEMM at 512 (prefill); then the batch size where the GEMM overtakes the GEMV."""
    import itertools

    from moeq.formats import rtn
    from moeq.kernels import triton_moe as tm

    e, h, i, k = shapes(smoke)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(1)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.02).to(torch.bfloat16).to(device)
    w2 = (torch.randn(e, h, i, generator=g) * 0.02).to(torch.bfloat16).to(device)
    q13, q2 = rtn.quantize(w13, 4, 32 if smoke else 128), rtn.quantize(w2, 4, 32 if smoke else 128)
    l13, l2 = tm.kernel_layout(q13), tm.kernel_layout(q2)
    if smoke:
        grids = {"gemv": [dict(block_n=n, block_k=kk, num_warps=4, num_stages=2) for n in (16, 32) for kk in (64,)],
                 "gemm": [dict(block_n=n, block_k=64, num_warps=4, num_stages=2) for n in (32, 64)]}
    else:
        grids = {"gemv": [dict(block_n=n, block_k=kk, num_warps=w, num_stages=st) for n, kk, w, st in
                          itertools.product((16, 32, 64), (256, 512), (4,), (2, 3))],
                 "gemm": [dict(block_n=n, block_k=kk, num_warps=w, num_stages=st) for n, kk, w, st in
                          itertools.product((64, 128), (64, 128), (4, 8), (3, 4))]}
    result = {}
    for kernel, tokens in (("gemv", 1), ("gemm", 8 if smoke else 512)):
        if kernel not in kernels:
            continue
        x = torch.randn(tokens, h, generator=g).to(dtype).to(device)
        routes = routings(tokens, e, k, device, 8, dtype, seed=tokens)
        rows = []
        for cfg in grids[kernel]:
            configs = {**tm.CONFIGS, kernel: cfg}
            try:
                t = graph_time([lambda r=r: tm.fused_moe(x, l13, l2, r[0], r[1], kernel=kernel, configs=configs)
                                for r in routes], device, 5)
            except Exception as exc:  # a config the compiler rejects (shared memory): skip it, say why
                rows.append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            rows.append({**cfg, "s": t})
        ok = [r for r in rows if "s" in r]
        if not ok:
            raise RuntimeError(f"tune {kernel}: every config failed: {rows}")
        best = min(ok, key=lambda r: r["s"])
        result[kernel] = {"tokens": tokens, "best": {kk: best[kk] for kk in grids[kernel][0]}, "best_s": best["s"],
                          "default_s": next((r["s"] for r in ok if all(r[kk] == v for kk, v in
                                                                        tm.CONFIGS[kernel].items())), None),
                          "grid": rows}
        print(f"tune {kernel} T={tokens}: best {result[kernel]['best']} {best['s'] * 1e6:.1f} us "
              f"(default {result[kernel]['default_s']})", flush=True)
    best_cfgs = {**tm.CONFIGS, **{kk: v["best"] for kk, v in result.items()}}
    cross = []
    for tokens in ((1, 2, 4) if smoke else (1, 2, 4, 8, 16)):
        x = torch.randn(tokens, h, generator=g).to(dtype).to(device)
        routes = routings(tokens, e, k, device, 8, dtype, seed=100 + tokens)
        row = {"tokens": tokens, "pairs": tokens * k}
        for kernel in ("gemv", "gemm"):
            row[kernel + "_s"] = graph_time([lambda r=r, kn=kernel: tm.fused_moe(x, l13, l2, r[0], r[1], kernel=kn,
                                                                                 configs=best_cfgs)
                                             for r in routes], device, 5)
        cross.append(row)
        print(f"crossover T={tokens}: gemv {row['gemv_s'] * 1e6:.1f} us, gemm {row['gemm_s'] * 1e6:.1f} us", flush=True)
    gemv_wins = [r["pairs"] for r in cross if r["gemv_s"] <= r["gemm_s"]]
    result["crossover"] = cross
    result["gemv_max_pairs"] = max(gemv_wins) if gemv_wins else 0
    return result


def micro(device, smoke: bool, configs: dict | None = None, gemv_max_pairs: int | None = None) -> dict:
    from moeq.kernels import triton_moe as tm

    if configs:
        tm.CONFIGS.update(configs)
    if gemv_max_pairs is not None:
        tm.GEMV_MAX_PAIRS = gemv_max_pairs
    e, h, i, k = shapes(smoke)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16  # interpreter: no bf16 tl.dot
    g = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.02).to(torch.bfloat16).to(device)
    w2 = (torch.randn(e, h, i, generator=g) * 0.02).to(torch.bfloat16).to(device)
    reps = 3 if smoke else 10
    out = {"shape": {"experts": e, "hidden": h, "moe_inter": i, "top_k": k}, "configs": dict(tm.CONFIGS),
           "gemv_max_pairs": tm.GEMV_MAX_PAIRS, "formats": {}}
    w13c, w2c = w13.to(dtype), w2.to(dtype)
    for name, quant in formats(smoke).items():
        tq = timed(lambda: (quant(w13), quant(w2)), device, 1 if smoke else 3)
        q13, q2 = quant(w13), quant(w2)
        l13, l2 = tm.kernel_layout(q13), tm.kernel_layout(q2)
        per_expert = (q13.nbytes + q2.nbytes) / e
        rows = []
        for tokens in ((1, 8) if smoke else (1, 8, 64, 512)):
            x = torch.randn(tokens, h, generator=g).to(dtype).to(device)
            routes = routings(tokens, e, k, device, 8, dtype, seed=tokens)
            idx, wts = routes[0]
            active = sum(int(torch.unique(r[0]).numel()) for r in routes) / len(routes)
            t_graph = graph_time([lambda r=r: tm.fused_moe(x, l13, l2, r[0], r[1]) for r in routes], device, reps)
            t_fused = timed(lambda: tm.fused_moe(x, l13, l2, idx, wts), device, reps)
            t_deq = timed(lambda: grouped_bf16(q13.dequantize(dtype), q2.dequantize(dtype), x, idx, wts), device,
                          reps)
            t_bf16 = timed(lambda: grouped_bf16(w13c, w2c, x, idx, wts), device, reps)
            try:  # torch._grouped_mm captured in a graph too, where this torch can
                t_bf16_graph = graph_time([lambda r=r: grouped_bf16(w13c, w2c, x, r[0], r[1]) for r in routes],
                                          device, reps)
            except RuntimeError as exc:
                print("bf16 graph:", str(exc)[:200], flush=True)
                t_bf16_graph = None
            ref = grouped_bf16(q13.dequantize(dtype), q2.dequantize(dtype), x, idx, wts).float()
            got = tm.fused_moe(x, l13, l2, idx, wts).float()
            rows.append({"tokens": tokens, "active_experts": active, "kernel_s": t_graph, "fused_eager_s": t_fused,
                         "dequant_all_bf16_s": t_deq, "bf16_experts_s": t_bf16, "bf16_experts_graph_s": t_bf16_graph,
                         "weight_bytes": active * per_expert, "weight_bytes_per_s": active * per_expert / t_graph,
                         "speedup_vs_dequant_all": t_deq / t_fused, "speedup_vs_bf16": t_bf16 / t_fused,
                         "max_rel_err_vs_dequant_ref": ((got - ref).abs().max() / ref.abs().max()).item()})
        out["formats"][name] = {"quantize_gb_per_s": (w13.numel() + w2.numel()) * 2 / tq / 1e9,
                                "bits_per_weight": 8 * (q13.nbytes + q2.nbytes) / (w13.numel() + w2.numel()),
                                "rows": rows}
        del q13, q2, l13, l2
    return out


def e2e(device, layers: int, smoke: bool) -> dict:
    from transformers import AutoModelForCausalLM

    import moeq
    from moeq.bench import _presets, write_model

    if smoke:
        from moeq.tiny import make_checkpoint

        path = make_checkpoint("qwen3_moe", Path(tempfile.mkdtemp()) / "tiny")
        presets = {"moeq rtn-int4": moeq.QuantConfig(moeq.RTN(4, 32)), "moeq nf4": moeq.QuantConfig(moeq.NF4())}
        lengths, new = (16, 32), 8
    else:
        path = write_model(Path(os.environ.get("MOEQ_BENCH_CACHE", Path.home() / ".cache" / "moeq-bench")) /
                           f"qwen3-30b-a3b-{layers}l", layers)
        presets = {k: v for k, v in _presets().items() if k in ("moeq rtn-int4", "moeq nf4")}
        lengths, new = (512, 2048), 64
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    systems = {"transformers bf16": lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)}
    for name, cfg in presets.items():
        systems[name] = lambda cfg=cfg: moeq.load(path, quant=cfg, dtype=dtype, device=device, progress=False)
    results = {}
    for name, make in systems.items():
        try:
            results[name] = e2e_row(make, device, lengths, new, smoke)
        except Exception as exc:  # one system failing keeps the others' numbers
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(name, results[name], flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = results["transformers bf16"]
    for name, row in results.items():
        for key in [k for k in row if k.endswith("tok_s") and k in base]:
            row[key.replace("tok_s", "vs_bf16")] = row[key] / base[key]
    return results


def e2e_row(make, device, lengths, new: int, smoke: bool) -> dict:
    t0 = time.perf_counter()
    model = make().eval()
    row = {"load_s": time.perf_counter() - t0}
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    with torch.no_grad():
        ids = torch.randint(0, vocab, (1, 32), generator=g).to(device)
        kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
        model.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        t = timed(lambda: model.generate(ids, **kw), device, 1 if smoke else 3)
        row["decode_b1_tok_s"] = new / t
        for n in lengths:
            x = torch.randint(0, vocab, (1, n), generator=g).to(device)
            t = timed(lambda: model(x), device, 1 if smoke else 3)
            row[f"prefill_{n}_tok_s"] = n / t
    del model
    return row


def summary(report: dict) -> dict:
    """The issue's bars, read off the rows: decode-sized (1-8 tokens) 4-bit kernels' fraction of the bandwidth and
    speedup vs dequantize-all, and 512-token time vs bf16 experts."""
    out = {}
    for fmt, v in report["micro"]["formats"].items():
        rows = {r["tokens"]: r for r in v["rows"]}
        dec = [rows[t] for t in (1, 8) if t in rows]
        big = rows.get(512)
        out[fmt] = {"bits_per_weight": v["bits_per_weight"],
                    "decode_min_fraction_of_bandwidth": min(r["fraction_of_bandwidth"] for r in dec),
                    "decode_min_speedup_vs_dequant_all": min(r["speedup_vs_dequant_all"] for r in dec),
                    "prefill512_speedup_vs_bf16": big["speedup_vs_bf16"] if big else None}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU via Triton's interpreter")
    ap.add_argument("--tune", nargs="?", const="gemv,gemm", default="",
                    help="search block sizes first (of these kernels) and use the best")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
        name = torch.cuda.get_device_name()
    elif args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, name = torch.device("cpu"), "cpu (Triton interpreter)"
    else:
        print("gpu_check: no GPU here (use --smoke to check the script on CPU)", file=sys.stderr)
        return 2
    import triton

    report = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "smoke": args.smoke,
              "started": time.time()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after every stage: a run cut short keeps what it measured
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, out)

    if not args.skip_tests:
        t0 = time.perf_counter()
        import importlib.util

        workers = ["-n", "8"] if importlib.util.find_spec("xdist") and device.type == "cuda" else []
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers,
                            str(ROOT / "tests/kernels/test_triton_kernels.py")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        lines = r.stdout.strip().splitlines()
        report["kernel_tests"] = {"ok": r.returncode == 0, "seconds": time.perf_counter() - t0,
                                  "tail": lines[-1:] if r.returncode == 0 else lines[-40:] + r.stderr.splitlines()[-5:]}
        print("kernel tests:", report["kernel_tests"], flush=True)
        save()
    report["bandwidth_bytes_per_s"] = bw = bandwidth(device)
    print(f"device bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    configs = gemv_max = None
    if args.tune:
        report["tune"] = tuned = tune(device, args.smoke, tuple(args.tune.split(",")))
        configs = {kk: tuned[kk]["best"] for kk in ("gemv", "gemm") if kk in tuned}
        gemv_max = tuned["gemv_max_pairs"]
        save()
    report["micro"] = micro(device, args.smoke, configs, gemv_max)
    for fmt, v in report["micro"]["formats"].items():
        for r in v["rows"]:
            r["fraction_of_bandwidth"] = r["weight_bytes_per_s"] / bw
            print(f"{fmt:18s} T={r['tokens']:4d} kernels {r['kernel_s'] * 1e6:8.1f} us "
                  f"{r['weight_bytes_per_s'] / 1e9:7.1f} GB/s ({100 * r['fraction_of_bandwidth']:.0f}% of bw)  "
                  f"eager {r['fused_eager_s'] * 1e6:8.1f} us  x{r['speedup_vs_dequant_all']:.1f} vs dequant-all  "
                  f"x{r['speedup_vs_bf16']:.2f} vs bf16  err {r['max_rel_err_vs_dequant_ref']:.1e}", flush=True)
    report["summary"] = summary(report)
    save()
    if not args.skip_e2e:
        report["e2e"] = e2e(device, args.layers, args.smoke)
    report["seconds"] = time.time() - report["started"]
    save()
    print("wrote", out)
    return 0 if report.get("kernel_tests", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
