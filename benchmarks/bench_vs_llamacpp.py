"""moeq vs llama.cpp on the same weights, CPU, side by side (issue #18's head-to-head).

The `moeq bench` model (Qwen3-30B-A3B's layer shapes cut to --layers) is quantized by moeq with a GGUF-exact method
(q4_0 / q8_0: llama.cpp's own blocks, bf16 lm_head kept) and exported to GGUF losslessly; then, alternating over
rounds, llama.cpp's `llama-bench` (-t THREADS -p 512 -n 128) and moeq (decode b1 of 128 tokens after a 32-token
prompt, and a 512-token prefill to the first token) measure the same weights. Writes JSON and prints a table.

llama-bench is found with --llama-bench, or in the cache where benchmarks/llamacpp.py says how to build it.
Without it the script says so and exits 0.

--activations both (the default) measures moeq's decode twice: its default numerics and int8 activations
(moeq.set_activations; llama.cpp's own activation numerics for Q4_0).

--isa avx2 runs the same head-to-head for CPUs without AVX512: moeq's native library built with
MOEQ_NATIVE_MARCH=x86-64-v3 (AVX2 + FMA kernels) against llama.cpp's build-avx2 (-DGGML_NATIVE=OFF -DGGML_AVX512=OFF).
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
sys.path.insert(0, str(ROOT / "src"))

import moeq  # noqa: E402
from moeq import bench, config, native  # noqa: E402
from moeq.config import QuantConfig  # noqa: E402
from moeq.export import export  # noqa: E402
from moeq.io.writer import write_json  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from llamacpp import CACHE, build_flags, find_tool  # noqa: E402


def llama_bench(exe: Path, gguf: Path, threads: int, batched: Path | None, batches: list[int] = (4,),
                ik: bool = False) -> dict:
    """llama-bench's decode (tg128) and prefill (pp512, pp2048) and llama-batched-bench's aggregate decode; ``ik``:
    ik_llama.cpp's tools, run as its MoE users run them (fused MoE up/gate, its default, and run-time repacked
    rows: ``-rtr``)."""
    extra = ["-rtr", "1", "-fmoe", "1"] if ik else []
    out = subprocess.run([str(exe), "-m", str(gguf), "-t", str(threads), "-p", "512,2048", "-n", "128", "-r", "2",
                          *extra, "-o", "json"], capture_output=True, text=True, check=True, timeout=1800).stdout
    rows = json.loads(out[out.index("["):])
    get = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in rows}
    res = {"decode_tps": get[(0, 128)], "prefill512_tps": get[(512, 0)], "prefill2048_tps": get[(2048, 0)]}
    if batched is not None and batches:  # B sequences decoding together (aggregate tok/s), 32-token prompts as moeq's
        ctx = max(batches) * (32 + 128)
        cmd = [str(batched), "-m", str(gguf), "-t", str(threads), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp",
               "32", "-ntg", "128", "-npl", ",".join(map(str, batches))]
        if ik:  # no JSON output in the fork: its Markdown rows |PP|TG|B|N_KV|T_PP|S_PP|T_TG|S_TG|T|S|; its flash
            # attention (default on) aborts on several sequences here (GGML_ASSERT(S > 0), iqk_fa_templates.h): off
            with tempfile.TemporaryDirectory() as tmp:  # the fork writes llama.log into its working directory
                out = subprocess.run(cmd + ["-rtr", "-fa", "off"], capture_output=True, text=True, check=True,
                                     timeout=3600, cwd=tmp)
            for line in (out.stdout + out.stderr).splitlines():
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if len(cells) == 10 and cells[0].isdigit():
                    res[f"decode_b{int(cells[2])}_tps"] = float(cells[7])
            return res
        out = subprocess.run(cmd + ["--output-format", "jsonl"], capture_output=True, text=True, check=True,
                             timeout=3600).stdout
        for row in (json.loads(line) for line in out.splitlines() if line.startswith("{")):
            res[f"decode_b{row['pl']}_tps"] = row["speed_tg"]
    return res


def moeq_measure(model, prefill: bool = True, batches: list[int] = (4,)) -> dict:
    res = {"decode_tps": bench.decode_tps(model, 1, prompt=32, new=128, reps=2)}
    for b in batches:
        res[f"decode_b{b}_tps"] = bench.decode_tps(model, b, prompt=32, new=128, reps=2)
    if not prefill:
        return res
    pre = min(bench.prefill_seconds(model, 512, False) for _ in range(2))
    pre2k = min(bench.prefill_seconds(model, 2048, False) for _ in range(2))
    return res | {"prefill512_tps": 512 / pre, "prefill2048_tps": 2048 / pre2k}


def quant_config(method: str) -> QuantConfig:
    """A method name, or ``METHOD+head:HEAD`` for a quantized lm_head too (e.g. ``q4_0+head:q8_0``: llama.cpp's Q4_0
    with an ``output`` Q8_0, the issue's third pairing)."""
    base, _, head = method.partition("+head:")
    return QuantConfig(config.method(base), rules={"lm_head": config.method(head)}) if head else QuantConfig.of(base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the bench checkpoint (default: written by moeq.bench, cached)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--methods", nargs="+", default=["q4_0"],
                    help="methods, or METHOD+head:HEAD (see quant_config); OURS=THEIRS pairs different weights, e.g. "
                         "rtn-int4+head:q8_0=q4_0+head:q8_0 (moeq's rtn-int4 preset against llama.cpp's Q4_0)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="*", default=[4, 8, 16],
                    help="concurrent sequences for the aggregate decode rows (llama-batched-bench -npl)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--ik-llama-bench", default=None,
                    help="ik_llama.cpp's llama-bench (default: its cache build, see benchmarks/llamacpp.py; measured "
                         "beside llama.cpp in every round when found)")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native",
                    help="avx2: both systems built for AVX2 + FMA only (moeq: MOEQ_NATIVE_MARCH=x86-64-v3)")
    ap.add_argument("--activations", choices=["default", "int8", "both"], default="both",
                    help="moeq's decode numerics (moeq.set_activations): both adds a 'moeq int8' system (decode only: "
                         "prompts always take the default path)")
    ap.add_argument("--out", default=None, help="default benchmarks/results/vs_llamacpp[_avx2].json")
    args = ap.parse_args()
    build = "build" if args.isa == "native" else "build-avx2"
    if args.isa == "avx2":  # read when the native library is first built, below
        os.environ[native.ISA_ENV] = "x86-64-v3"
    out = args.out or str(ROOT / "benchmarks" / "results" / f"vs_llamacpp{'' if args.isa == 'native' else '_avx2'}.json")
    exe = find_tool("llama-bench", args.llama_bench, build)
    batched = find_tool("llama-batched-bench", None, build)
    if batched is None:
        print("llama-batched-bench not found (cmake --build build --target llama-batched-bench): no b4 rows")
    ik_exe = find_tool("llama-bench", args.ik_llama_bench, ik=True) if args.isa == "native" else None
    ik_batched = find_tool("llama-batched-bench", None, ik=True) if ik_exe is not None else None
    if ik_exe is None:
        print("ik_llama.cpp's llama-bench not found (benchmarks/llamacpp.py says how to build it): llama.cpp only")
    if exe is None or not exe.exists():
        print("llama-bench not found: build it as this script's docstring says (or pass --llama-bench); skipping")
        return
    src = Path(args.model) if args.model else bench.write_model(
        Path.home() / ".cache" / "moeq-bench" / f"qwen3-30b-a3b-shape-{args.layers}L-v151936", args.layers)
    rows = []
    for method in args.methods:
        ours, _, theirs = method.partition("=")
        theirs = theirs or ours
        gguf = CACHE / f"bench-{args.layers}L-{theirs.replace(':', '-')}.gguf"
        model = moeq.load(src, quant=quant_config(ours), progress=False)
        top_k = model.config.get_text_config().num_experts_per_tok
        bpt = bench.bytes_per_token(model, top_k)  # the weight bytes a batch-1 token reads
        other = model if theirs == ours else moeq.load(src, quant=quant_config(theirs), progress=False)
        # the same GGUF weights when the pair is one method; a bf16 head llama.cpp reads as bf16 (moeq: bf12)
        bpt_theirs = bench.bytes_per_token(other, top_k, bf12_as_bf16=True)
        if not gguf.exists():
            tok = src
            if not (src / "tokenizer.json").exists():  # the bench model has random weights and no tokenizer: a
                from moeq.tiny import tiny_tokenizer  # noqa: PLC0415  byte-level one (GGUF pads its vocabulary)

                tok = CACHE / "bench-tokenizer"
                tiny_tokenizer().save_pretrained(tok)
            export(other, gguf, "gguf", source=tok, check=False)  # lossless by construction (q4_0/q8_0)
        del other
        for rnd in range(args.rounds):
            t0 = time.time()
            bw = bench.memory_bandwidth()
            theirs = llama_bench(exe, gguf, args.threads, batched, args.batches)
            row = {"method": method, "round": rnd, "llama.cpp": theirs}
            if ik_exe is not None:
                row["ik_llama.cpp"] = llama_bench(ik_exe, gguf, args.threads, ik_batched, args.batches, ik=True)
            for mode in ("default", "int8") if args.activations == "both" else (args.activations,):
                moeq.set_activations(model, mode)
                row["moeq" if mode == "default" else "moeq int8"] = moeq_measure(model, prefill=mode == "default",
                                                                                 batches=args.batches)
            bw = max(bw, bench.memory_bandwidth())  # probed around both systems' runs in this round
            rows.append({**row, "bandwidth_gbps": bw / 1e9, "bytes_per_token": bpt, "roofline_tps": bw / bpt,
                         "bytes_per_token_llama.cpp": bpt_theirs, "roofline_tps_llama.cpp": bw / bpt_theirs,
                         "seconds": time.time() - t0})
            print(json.dumps(rows[-1]), flush=True)
        del model
    report(rows, {"model": str(src), "threads": args.threads, "isa": args.isa, "cpu": bench.cpu_summary(),
                  "moeq_simd_level": native.lib().moeq_simd_level(), "moeq_amx_tiles": native.amx_tiles(),
                  "llama_bench": str(exe), "llama_build": build_flags(exe)}
           | ({"ik_llama_bench": str(ik_exe), "ik_llama_build": build_flags(ik_exe)} if ik_exe is not None else {}),
           out)


def report(rows: list[dict], meta: dict, out: Path) -> None:
    """The best round per method and system into ``out`` (JSON, with every round) and a Markdown table on stdout."""
    best = {}
    for r in rows:
        b = best.setdefault(r["method"], {"llama.cpp": {}, "moeq": {}, "roofline_tps": 0.0, "roofline_tps_llama.cpp": 0.0})
        b["roofline_tps"] = max(b["roofline_tps"], r["roofline_tps"])
        b["roofline_tps_llama.cpp"] = max(b["roofline_tps_llama.cpp"], r.get("roofline_tps_llama.cpp", r["roofline_tps"]))
        for sys_ in ("llama.cpp", "ik_llama.cpp", "moeq", "moeq int8"):
            for k, v in r.get(sys_, {}).items():
                cell = b.setdefault(sys_, {})
                cell[k] = max(cell.get(k, 0.0), v)
    write_json(out, {**meta, "rounds": rows, "best": best})
    seen = {k for b in best.values() for k in b["moeq"]}
    keys = [("decode_tps", "decode b1")] + [(f"decode_b{n}_tps", f"decode b{n}") for n in (4, 8, 16)
                                           if f"decode_b{n}_tps" in seen] + [("prefill512_tps", "prefill 512"),
                                                                            ("prefill2048_tps", "prefill 2048")]
    print("\n| weights | " + " | ".join(f"{label} llama.cpp / moeq tok/s (ratio)" for _, label in keys)
          + " | b1 roofline tok/s (llama.cpp / moeq fraction) |\n|---" * 1 + "|---" * (len(keys) + 1) + "|")
    for method, b in best.items():
        for sys_, anchor in (("moeq", "llama.cpp"), ("moeq int8", "llama.cpp"), ("moeq", "ik_llama.cpp")):
            if sys_ not in b or anchor not in b:
                continue
            lc, mq = b[anchor], b[sys_]
            cells = [f"{lc[k]:.1f} / {mq[k]:.1f} ({mq[k] / lc[k]:.2f})" if k in lc and k in mq else "n/a"
                     for k, _ in keys]
            roof, roof_lc = b["roofline_tps"], b["roofline_tps_llama.cpp"]
            ours, _, theirs = method.partition("=")
            head = ours.partition("+head:")[2] or "bf16"
            act = ", int8 activations" if sys_ == "moeq int8" else ""
            vs = f" ({anchor}: {theirs})" if theirs else f" (vs {anchor})" if anchor != "llama.cpp" else ""
            roofs = f"{roof:.0f}" if round(roof) == round(roof_lc) else f"{roof_lc:.0f} / {roof:.0f}"
            print(f"| {ours.partition('+head:')[0]}, {head} lm_head{act}{vs} | " + " | ".join(cells)
                  + f" | {roofs} ({lc['decode_tps'] / roof_lc:.0%} / {mq['decode_tps'] / roof:.0%}) |")


if __name__ == "__main__":
    main()
