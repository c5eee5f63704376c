"""moeq vs llama.cpp on the same weights, CPU, side by side (issue #18's head-to-head).

The `moeq bench` model (Qwen3-30B-A3B's layer shapes cut to --layers) is quantized by moeq with a GGUF-exact method
(q4_0 / q8_0: llama.cpp's own blocks, bf16 lm_head kept) and exported to GGUF losslessly; then, alternating over
rounds, llama.cpp's `llama-bench` (-t THREADS -p 512 -n 128) and moeq (decode b1 of 128 tokens after a 32-token
prompt, and a 512-token prefill to the first token) measure the same weights. Writes JSON and prints a table.

llama-bench is found with --llama-bench, or in the cache where benchmarks/llamacpp.py says how to build it.
Without it the script says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import moeq  # noqa: E402
from moeq import bench  # noqa: E402
from moeq.export import export  # noqa: E402
from moeq.io.writer import write_json  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from llamacpp import CACHE, find_tool  # noqa: E402


def llama_bench(exe: Path, gguf: Path, threads: int) -> dict:
    out = subprocess.run([str(exe), "-m", str(gguf), "-t", str(threads), "-p", "512", "-n", "128", "-r", "2",
                          "-o", "json"], capture_output=True, text=True, check=True, timeout=1800).stdout
    rows = json.loads(out)
    get = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in rows}
    return {"decode_tps": get[(0, 128)], "prefill512_tps": get[(512, 0)]}


def moeq_measure(model) -> dict:
    dec = bench.decode_tps(model, 1, prompt=32, new=128, reps=2)
    pre = min(bench.prefill_seconds(model, 512, False) for _ in range(2))
    return {"decode_tps": dec, "prefill512_tps": 512 / pre}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the bench checkpoint (default: written by moeq.bench, cached)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--methods", nargs="+", default=["q4_0"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vs_llamacpp.json"))
    args = ap.parse_args()
    exe = find_tool("llama-bench", args.llama_bench)
    if exe is None or not exe.exists():
        print("llama-bench not found: build it as this script's docstring says (or pass --llama-bench); skipping")
        return
    src = Path(args.model) if args.model else bench.write_model(
        Path.home() / ".cache" / "moeq-bench" / f"qwen3-30b-a3b-shape-{args.layers}L-v151936", args.layers)
    rows = []
    for method in args.methods:
        gguf = CACHE / f"bench-{args.layers}L-{method}.gguf"
        model = moeq.load(src, quant=method, progress=False)
        if not gguf.exists():
            tok = src
            if not (src / "tokenizer.json").exists():  # the bench model has random weights and no tokenizer: a
                from moeq.tiny import tiny_tokenizer  # noqa: PLC0415  byte-level one (GGUF pads its vocabulary)

                tok = CACHE / "bench-tokenizer"
                tiny_tokenizer().save_pretrained(tok)
            export(model, gguf, "gguf", source=tok, check=False)  # lossless by construction (q4_0/q8_0)
        for rnd in range(args.rounds):
            t0 = time.time()
            theirs = llama_bench(exe, gguf, args.threads)
            mine = moeq_measure(model)
            rows.append({"method": method, "round": rnd, "llama.cpp": theirs, "moeq": mine,
                         "seconds": time.time() - t0})
            print(json.dumps(rows[-1]), flush=True)
        del model
    best = {}
    for r in rows:
        b = best.setdefault(r["method"], {"llama.cpp": {}, "moeq": {}})
        for sys_ in ("llama.cpp", "moeq"):
            for k, v in r[sys_].items():
                b[sys_][k] = max(b[sys_].get(k, 0.0), v)
    res = {"model": str(src), "threads": args.threads, "llama_bench": str(exe), "rounds": rows, "best": best}
    write_json(args.out, res)
    print("\n| weights | llama.cpp decode tok/s | moeq decode tok/s | moeq / llama.cpp | llama.cpp prefill 512 tok/s | "
          "moeq prefill 512 tok/s | moeq / llama.cpp |\n|---|---|---|---|---|---|---|")
    for method, b in best.items():
        lc, mq = b["llama.cpp"], b["moeq"]
        print(f"| {method}, bf16 lm_head | {lc['decode_tps']:.1f} | {mq['decode_tps']:.1f} | "
              f"{mq['decode_tps'] / lc['decode_tps']:.2f} | {lc['prefill512_tps']:.0f} | {mq['prefill512_tps']:.0f} | "
              f"{mq['prefill512_tps'] / lc['prefill512_tps']:.2f} |")


if __name__ == "__main__":
    main()
