"""Full depth, real size: Qwen3-30B-A3B's shape (48 layers, 128 experts, vocab 151936; random weights) from the
checkpoint users download to 4 bits, then moeq and llama.cpp on the same GGUF weights, each system in its own process
so that one model is in memory at a time (a 24 GB machine holds one 30B model at 4 bits, not two).

Steps, each in a fresh process (peak RSS per step, from the kernel's VmHWM):
1. source — the model as Qwen3-30B-A3B-FP8 ships it (DeepSeek's layout: e4m3 weights + 128x128 block scales, ~31 GB
   at 48 layers; its bf16 form, 61 GB, would not fit this disk beside the outputs). With less free disk than source +
   GGUF + a margin, the layer count is scaled down and the JSON says so.
2. quantize + export in one streamed pass — ``moeq.export.export_checkpoint(SOURCE, OUT.gguf, "gguf", q4_0)``, what
   ``moeq export SOURCE OUT.gguf --format gguf --method q4_0`` runs: the FP8 checkpoint read tensor by tensor,
   re-quantized in flight (head and embeddings kept bf16), each decoder layer written as llama.cpp's Q4_0 blocks and
   freed as soon as it is complete, every Q4_0 tensor decoded back by gguf-py: seconds, GB/s of source read, peak RSS.
3. rounds, alternating: moeq (``moeq.load(GGUF)``: load seconds, time to the first token of a 32-token prompt,
   decode b1 of 128 tokens, prefill 512, peak RSS) and ``llama-bench -p 512 -n 128 -r 2`` on the same file.

    python benchmarks/bench_full_depth.py --out benchmarks/results/full_depth.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from llamacpp import build_flags, find_tool  # noqa: E402

from moeq import bench  # noqa: E402

GB = 1e9
SOURCE_PER_LAYER, GGUF_PER_LAYER, FIXED = 0.64 * GB, 0.36 * GB, 1.25 * GB  # FP8 / Q4_0 bytes; bf16 embed + head
MARGIN = 6 * GB

QUANTIZE = r"""
import json, sys, time
from pathlib import Path
from moeq import bench
from moeq.export import export_checkpoint
from moeq.tiny import tiny_tokenizer
src, gguf, method = sys.argv[1:4]
if not (Path(src) / "tokenizer.json").exists():  # random weights: a byte-level tokenizer (GGUF pads the vocabulary)
    tiny_tokenizer().save_pretrained(src)
t = time.perf_counter()
s = export_checkpoint(src, gguf, "gguf", quant=method, overwrite=True, progress=False)
sec = time.perf_counter() - t
read = sum(f.stat().st_size for f in Path(src).glob("*.safetensors"))
print(json.dumps({"seconds": sec, "source_gbps": read / sec / 1e9, "peak_rss_bytes": bench.peak_rss(),
                  "tensors": s["tensors"], "checked_by_gguf_py": s["checked_by_gguf_py"], "types": s["types"]}))
"""
MOEQ = r"""
import json, sys, time, torch
import moeq
from moeq import bench
t = time.perf_counter()
m = moeq.load(sys.argv[1], progress=False)
load_s = time.perf_counter() - t
rss_loaded = bench.peak_rss()
parts = bench.rss_parts()
ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(0))
t = time.perf_counter()
m.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
ttft = time.perf_counter() - t
out = {"load_seconds": load_s, "first_token_seconds": ttft, "rss_after_load_bytes": rss_loaded,
       "rss_anon_after_load_bytes": parts.get("anon"), "rss_file_after_load_bytes": parts.get("file"),
       "decode_tps": bench.decode_tps(m, 1, prompt=32, new=128, reps=2),
       "prefill512_tps": 512 / min(bench.prefill_seconds(m, 512, False) for _ in range(2))}
out["peak_rss_bytes"] = bench.peak_rss()
print(json.dumps(out))
"""


def child(code: str, *args: str, timeout: int = 7200) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"child failed ({r.returncode}): {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def layers_that_fit(folder: Path, want: int, have_source: bool) -> int:
    free = shutil.disk_usage(folder).free + (0 if not have_source else FIXED + want * SOURCE_PER_LAYER)
    fit = int((free - MARGIN - 2 * FIXED) // (SOURCE_PER_LAYER + GGUF_PER_LAYER))
    return max(1, min(want, fit))


def llama_bench(exe: Path, gguf: Path, threads: int) -> dict:
    t = time.perf_counter()
    out = subprocess.run([str(exe), "-m", str(gguf), "-t", str(threads), "-p", "512", "-n", "128", "-r", "2",
                          "-o", "json"], capture_output=True, text=True, check=True, timeout=3600).stdout
    get = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in json.loads(out)}
    return {"decode_tps": get[(0, 128)], "prefill512_tps": get[(512, 0)], "seconds": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--method", default="q4_0")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "moeq-bench"))
    ap.add_argument("--keep-source", action="store_true", help="keep the FP8 source after the export")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "full_depth.json"))
    args = ap.parse_args()
    exe = find_tool("llama-bench")
    if exe is None:
        print("llama-bench not found: build it as benchmarks/llamacpp.py says; skipping")
        return
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    src = cache / f"qwen3-30b-a3b-fp8-{args.layers}L"
    layers = args.layers if (src / "done").exists() else layers_that_fit(cache, args.layers, False)
    note = "" if layers == args.layers else (f"scaled down from {args.layers} to {layers} layers: the free disk "
                                             f"holds no more source + GGUF")
    if note:
        print(note, flush=True)
        src = cache / f"qwen3-30b-a3b-fp8-{layers}L"
    gguf = cache / f"full-{layers}L-{args.method}.gguf"
    result = {"cpu": bench.cpu_summary(), "threads": args.threads, "layers": layers, "note": note,
              "method": args.method, "llama_bench": str(exe), "llama_cpp_build": build_flags(exe), "steps": {}}
    if not gguf.exists():
        if not (src / "done").exists():
            t = time.perf_counter()
            child("import json, sys; from pathlib import Path; from moeq import bench; "
                  "bench.write_model(Path(sys.argv[1]), int(sys.argv[2]), fp8=True); print(json.dumps({}))",
                  str(src), str(layers))
            result["steps"]["source"] = {"seconds": time.perf_counter() - t}
        result["steps"].setdefault("source", {})["bytes"] = sum(f.stat().st_size for f in src.iterdir())
        print(json.dumps(result["steps"]["source"]), flush=True)
        result["steps"]["quantize_export"] = child(QUANTIZE, str(src), str(gguf), args.method)
        result["steps"]["quantize_export"]["gguf_bytes"] = gguf.stat().st_size
        print(json.dumps(result["steps"]["quantize_export"]), flush=True)
        if not args.keep_source:
            shutil.rmtree(src)  # written by this script
    else:  # the GGUF of an earlier run: its steps (source, export) from that run's results
        old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
        if (old.get("layers"), old.get("method")) == (layers, args.method):
            result["steps"] = old.get("steps", {})
    rows = []
    for rnd in range(args.rounds):
        bw = bench.memory_bandwidth()
        theirs = llama_bench(exe, gguf, args.threads)
        ours = child(MOEQ, str(gguf))
        rows.append({"round": rnd, "llama.cpp": theirs, "moeq": ours, "bandwidth_gbps": bw / GB})
        print(json.dumps(rows[-1]), flush=True)
    result["rounds"] = rows
    for sysname in ("moeq", "llama.cpp"):
        for k in ("decode_tps", "prefill512_tps"):
            result.setdefault("best", {}).setdefault(sysname, {})[k] = max(r[sysname][k] for r in rows)
    result["ratio"] = {k: result["best"]["moeq"][k] / result["best"]["llama.cpp"][k]
                       for k in ("decode_tps", "prefill512_tps")}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["ratio"]))


if __name__ == "__main__":
    main()
