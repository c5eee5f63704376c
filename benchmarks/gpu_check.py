"""GPU check of moeq's Triton path, for a machine with one GPU, in well under 8 minutes:

1. the kernel tests (tests/kernels/test_triton_kernels.py) on the device;
2. device memory bandwidth (a large device-to-device copy);
3. kernel microbenchmark on Qwen3-30B-A3B's expert shapes (128 experts, top-8, hidden 2048, moe_intermediate 768)
   for 1, 8, 64 and 512 tokens, per format (rtn-int4 g128, nf4 b64 double quant, rtn-int8 g128): fused kernel time,
   weight bytes it reads (the routed experts only) per second vs the device bandwidth, and time vs
   dequantize-all-experts + bf16 grouped matmul (vLLM's bitsandbytes MoE approach) and vs bf16 experts; plus
   on-device quantization GB/s (in-flight quantization on the GPU);
4. end to end on the 4-layer Qwen3-30B-A3B slice (``moeq bench``'s model): decode tok/s at batch 1 and prefill
   tok/s at 512/2048 tokens, moeq rtn-int4 / nf4 (loaded with ``device="cuda"``, quantized on the GPU) vs
   transformers bf16 on the same GPU.

Writes JSON (default ``benchmarks/results/gpu.json``). ``--smoke`` runs tiny shapes on whatever is there (on CPU
through Triton's interpreter) to check the script itself.

    python benchmarks/gpu_check.py [--out FILE] [--layers 4] [--smoke] [--skip-tests] [--skip-e2e]
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


def grouped_bf16(w13, w2, x, idx, wts):
    """bf16 experts: pairs grouped by expert, one grouped GEMM per projection (torch._grouped_mm where present)."""
    t, a = idx.shape
    e = w13.shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
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


def micro(device, smoke: bool) -> dict:
    from moeq.formats import bnb4, rtn
    from moeq.kernels import triton_moe as tm

    e, h, i, k = (8, 128, 64, 2) if smoke else (128, 2048, 768, 8)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16  # interpreter: no bf16 tl.dot
    g = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.02).to(torch.bfloat16).to(device)
    w2 = (torch.randn(e, h, i, generator=g) * 0.02).to(torch.bfloat16).to(device)
    fmts = {"rtn-int4 g128": lambda w: rtn.quantize(w, 4, 128 if not smoke else 32),
            "nf4 b64 dq": lambda w: bnb4.quantize(w, "nf4", 64, True),
            "rtn-int8 g128": lambda w: rtn.quantize(w, 8, 128 if not smoke else 32)}
    reps = 3 if smoke else 20
    out = {"shape": {"experts": e, "hidden": h, "moe_inter": i, "top_k": k}, "formats": {}}
    w13c, w2c = w13.to(dtype), w2.to(dtype)
    for name, quant in fmts.items():
        tq = timed(lambda: (quant(w13), quant(w2)), device, 1 if smoke else 3)
        q13, q2 = quant(w13), quant(w2)
        l13, l2 = tm.kernel_layout(q13), tm.kernel_layout(q2)
        per_expert = (q13.nbytes + q2.nbytes) / e
        rows = []
        for tokens in ((1, 8) if smoke else (1, 8, 64, 512)):
            x = torch.randn(tokens, h, generator=g).to(dtype).to(device)
            logits = torch.randn(tokens, e, generator=g).to(device)
            wts, idx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
            wts = (wts / wts.sum(-1, keepdim=True)).to(dtype)
            active = int(torch.unique(idx).numel())
            t_fused = timed(lambda: tm.fused_moe(x, l13, l2, idx, wts), device, reps)
            t_deq = timed(lambda: grouped_bf16(q13.dequantize(dtype), q2.dequantize(dtype), x, idx, wts), device,
                          reps)
            t_bf16 = timed(lambda: grouped_bf16(w13c, w2c, x, idx, wts), device, reps)
            ref = grouped_bf16(q13.dequantize(dtype), q2.dequantize(dtype), x, idx, wts).float()
            got = tm.fused_moe(x, l13, l2, idx, wts).float()
            rows.append({"tokens": tokens, "active_experts": active, "fused_s": t_fused,
                         "dequant_all_bf16_s": t_deq, "bf16_experts_s": t_bf16,
                         "weight_bytes": active * per_expert, "weight_bytes_per_s": active * per_expert / t_fused,
                         "speedup_vs_dequant_all": t_deq / t_fused, "speedup_vs_bf16": t_bf16 / t_fused,
                         "max_rel_err_vs_dequant_ref": ((got - ref).abs().max() / ref.abs().max()).item()})
        out["formats"][name] = {"quantize_gb_per_s": (w13.numel() + w2.numel()) * 2 / tq / 1e9,
                                "bits_per_weight": 8 * (q13.nbytes + q2.nbytes) / (w13.numel() + w2.numel()),
                                "rows": rows}
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
        t0 = time.perf_counter()
        model = make().eval()
        load_s = time.perf_counter() - t0
        g = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        row = {"load_s": load_s}
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
        results[name] = row
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = results["transformers bf16"]
    for name, row in results.items():
        for key in [k for k in row if k.endswith("tok_s")]:
            row[key.replace("tok_s", "vs_bf16")] = row[key] / base[key]
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU via Triton's interpreter")
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
    report = {"device": name, "torch": torch.__version__, "smoke": args.smoke, "started": time.time()}
    if not args.skip_tests:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", str(ROOT / "tests/kernels/test_triton_kernels.py")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        report["kernel_tests"] = {"ok": r.returncode == 0, "seconds": time.perf_counter() - t0,
                                  "tail": r.stdout.strip().splitlines()[-1:] + r.stderr.strip().splitlines()[-3:]}
        print("kernel tests:", report["kernel_tests"], flush=True)
    report["bandwidth_bytes_per_s"] = bw = bandwidth(device)
    print(f"device bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    report["micro"] = micro(device, args.smoke)
    for fmt, v in report["micro"]["formats"].items():
        for r in v["rows"]:
            r["fraction_of_bandwidth"] = r["weight_bytes_per_s"] / bw
            print(f"{fmt:14s} T={r['tokens']:4d} fused {r['fused_s'] * 1e6:8.1f} us  "
                  f"{r['weight_bytes_per_s'] / 1e9:7.1f} GB/s ({100 * r['fraction_of_bandwidth']:.0f}% of bw)  "
                  f"x{r['speedup_vs_dequant_all']:.1f} vs dequant-all  x{r['speedup_vs_bf16']:.2f} vs bf16  "
                  f"err {r['max_rel_err_vs_dequant_ref']:.1e}", flush=True)
    if not args.skip_e2e:
        report["e2e"] = e2e(device, args.layers, args.smoke)
        for name, row in report["e2e"].items():
            print(name, {k: round(v, 2) for k, v in row.items()}, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print("wrote", out)
    return 0 if report.get("kernel_tests", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
