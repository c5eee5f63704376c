"""The README's headline tables, generated from the benchmark results in ``benchmarks/results/`` (never typed by
hand). Each table sits in the README between ``<!-- table: NAME -->`` and ``<!-- /table -->``.

    python benchmarks/tables.py --write README.md   # regenerate them
    python benchmarks/tables.py --check README.md   # exit 1 when the README is out of date (a test runs this)
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
LABELS = {"q4_0": "Q4_0 experts + attention, bf16 head", "q4_0+head:q8_0": "Q4_0 experts + attention, Q8_0 head",
          "rtn-int4+head:q8_0=q4_0+head:q8_0": "moeq `rtn-int4` + Q8_0 head; llama.cpp Q4_0 + Q8_0 head",
          "mxfp4": "MXFP4 experts + attention (same bytes both sides), bf16 head",
          "fp8=q8_0": "moeq FP8 e4m3 128x128 (`--method fp8`); llama.cpp Q8_0, bf16 heads"}
IMATRIX_ROWS = ["q4_0 (llama.cpp Q4_0 rounding)", "llama.cpp Q4_0 --pure +imatrix", "moeq iq4nl", "llama.cpp IQ4_NL --pure",
                "llama.cpp IQ4_NL --pure +imatrix", "moeq iq4nl-dq", "llama.cpp IQ4_XS --pure",
                "llama.cpp IQ4_XS --pure +imatrix", "moeq iq4nl-m", "llama.cpp IQ4_XS (its mix) +imatrix", "moeq nl3-m",
                "llama.cpp Q3_K_S (its mix) +imatrix", "moeq q5_0-m", "llama.cpp Q4_K_M (its mix)",
                "llama.cpp Q4_K_M (its mix) +imatrix", "rotated: moeq iq4nl", "rotated: llama.cpp IQ4_NL --pure"]
IMPORTANCE_ROWS = ["moeq q4_0-opt", "moeq q4_0-opt +importance", "moeq iq4nl", "moeq iq4nl +importance",
                   "moeq bpw 4.5", "moeq bpw 4.5 +importance", "llama.cpp IQ4_NL --pure +imatrix", "moeq iq4nl-dq",
                   "moeq iq4nl-dq +importance", "moeq bpw 4.3 +importance", "llama.cpp IQ4_XS --pure +imatrix",
                   "moeq iq4nl-m", "moeq iq4nl-m +importance", "moeq bpw 4.75 +importance", "moeq bpw 4.9 +importance",
                   "llama.cpp IQ4_XS (its mix) +imatrix", "moeq nl3", "moeq nl3 +importance", "moeq nl3-m",
                   "moeq nl3-m +importance", "moeq bpw 4.1 +importance"]
IMPORTANCE_768_ROWS = ["llama.cpp IQ4_XS --pure", "llama.cpp IQ4_XS --pure +imatrix", "moeq iq4nl-dq",
                       "moeq iq4nl-dq +importance", "moeq bpw 4.27 +importance (ladder from nl3)",
                       "moeq iq4nl +importance",
                       "llama.cpp IQ4_XS (its mix) +imatrix",
                       "moeq iq4nl-m +importance", "llama.cpp Q4_K_S --pure", "llama.cpp Q4_1 --pure",
                       "RTN-int4 asym g32 (integer zero point)", "llama.cpp Q4_K_M (its mix)",
                       "llama.cpp Q4_K_M (its mix) +imatrix", "moeq q5_0-m",
                       "llama.cpp Q3_K_S --pure +imatrix", "llama.cpp IQ3_S --pure +imatrix",
                       "llama.cpp IQ3_XXS (its mix) +imatrix", "moeq bpw 3.44 +importance", "moeq nl3 +importance",
                       "moeq bpw 3.52 +importance", "moeq bpw 3.56 +importance (ladder from nl3)",
                       "moeq bpw 3.56 +importance",
                       "llama.cpp Q3_K_S (its mix) +imatrix",
                       "llama.cpp IQ3_S (its mix) +imatrix", "moeq nl3-s +importance", "moeq nl3-m +importance"]
BPW_ROWS = ["moeq nl3 +importance", "moeq bpw 3.6", "moeq bpw 3.6 +importance", "moeq bpw 3.9",
            "moeq bpw 3.9 +importance", "moeq nl3-m", "moeq nl3-m +importance", "moeq bpw 4.1", "moeq bpw 4.1 +importance",
            "moeq iq4nl-dq", "moeq iq4nl-dq +importance", "moeq bpw 4.3", "moeq bpw 4.3 +importance",
            "llama.cpp IQ4_XS --pure +imatrix", "moeq iq4nl", "moeq iq4nl +importance", "moeq bpw 4.5",
            "moeq bpw 4.5 +importance", "llama.cpp IQ4_NL --pure +imatrix", "moeq iq4nl-m", "moeq iq4nl-m +importance",
            "moeq bpw 4.75", "moeq bpw 4.75 +importance", "moeq bpw 4.9", "moeq bpw 4.9 +importance",
            "llama.cpp IQ4_XS (its mix) +imatrix"]
ACCURACY_ROWS = ["moeq q4_0-opt", "llama.cpp Q4_0 --pure", "moeq iq4nl", "llama.cpp IQ4_NL --pure", "moeq iq4nl-dq",
                 "moeq iq4nl-m", "llama.cpp IQ4_NL (its mix)", "moeq nl3-m", "llama.cpp Q3_K_S (its mix)",
                 "llama.cpp Q3_K_M (its mix)",
                 "moeq q5_0-m", "llama.cpp Q4_K_M (its mix)", "moeq q8_0"]


def _cell(llama: float, moeq: float) -> str:
    return f"{llama:.1f} / {moeq:.1f} ({moeq / llama:.2f}x)"


def _medians(d: dict, method: str, system: str, key: str) -> float | None:
    vals = [r[system][key] for r in d["rounds"] if r["method"] == method and key in r.get(system, {})]
    return statistics.median(vals) if vals else None


def vs_llamacpp(name: str) -> str:
    """Best round (and the median in brackets) of each system, per pairing, from a ``bench_vs_llamacpp.py`` run."""
    d = json.loads((RESULTS / name).read_text())
    cpu = d["cpu"]["model"]
    seen = {k for b in d["best"].values() for k in b["moeq"]}
    keys = [("decode_tps", "decode b1")] + [(f"decode_b{n}_tps", f"decode b{n}") for n in (4, 8, 16)
                                           if f"decode_b{n}_tps" in seen] + [("prefill512_tps", "pp512"),
                                                                            ("prefill2048_tps", "pp2048")]
    anchors = [a for a in ("llama.cpp", "ik_llama.cpp") if any(a in b for b in d["best"].values())]
    who = "llama.cpp" if anchors == ["llama.cpp"] else "anchor"
    head = "| weights (both engines) | " + " | ".join(f"{h}: {who} / moeq tok/s" for _, h in keys) + " |"
    build = f"{d['isa']} builds" + (f"; llama.cpp {d['llama_build']}" if d.get("llama_build") else "") + (
        f"; ik_llama.cpp {d['ik_llama_build']}, run with -rtr -fmoe" if d.get("ik_llama_build") else "") + (
        "; moeq prefill on AMX tiles" if d.get("moeq_amx_tiles") else "")
    lines = [f"{d['threads']} threads, {cpu} ({build}; `benchmarks/results/{name}`); best round, "
             "median in brackets:", "", head, "|---" * (len(keys) + 1) + "|"]
    for method, best in d["best"].items():
        for anchor in anchors:
            if anchor not in best:
                continue
            cells = []
            for key, _ in keys:
                lb, mb = best[anchor].get(key), best["moeq"].get(key)
                if lb is None or mb is None:
                    cells.append("")
                    continue
                lm, mm = _medians(d, method, anchor, key), _medians(d, method, "moeq", key)
                cells.append(_cell(lb, mb) + (f" [{mm / lm:.2f}x]" if lm and mm else ""))
            label = LABELS.get(method, method) + (f" — vs {anchor}" if who == "anchor" else "")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def accuracy(name: str = "accuracy_vs_llamacpp.json", wanted: list[str] = ACCURACY_ROWS, seconds: bool = False) -> str:
    d = json.loads((RESULTS / name).read_text())
    rows = {r["method"]: r for r in d["rows"]}
    extra = " quantize s (2 cores) |" if seconds else ""
    lines = [f"{d['tokens']} held-out tokens, ctx {d['ctx']}, bf16 reference PPL {d['ref_ppl']:.2f} "
             f"(`benchmarks/results/{name}`; {d.get('cpu', 'CPU not recorded')}):", "",
             "| method | bits/weight | PPL | mean KL vs bf16 | top-1 agreement |" + extra,
             "|---|---|---|---|---|" + ("---|" if seconds else "")]
    for m in wanted:
        r = rows.get(m)
        if r is not None:
            tools = "llama-imatrix + llama-quantize" if "+imatrix" in m else "llama-quantize"
            secs = ((f" {tools} |" if m.startswith("llama.cpp") else
                     f" {r['quantize_seconds']:.1f} |") if seconds else "")
            lines.append(f"| {m} | {r['bits_per_weight']:.3f} | {r['ppl']:.2f} | {r['mean_kl']:.4f} | "
                         f"{100 * r['top1']:.1f}% |" + secs)
    return "\n".join(lines)


def accuracy_2bit(name: str = "accuracy_2bit_768.json") -> str:
    """2-bit experts with the rest of the model at 4-8 bits, both sides the same recipe: every row of the run, the
    experts' own bits per weight beside the whole quantized part's."""
    d = json.loads((RESULTS / name).read_text())
    lines = [f"{d['tokens']} held-out tokens, ctx {d['ctx']}, bf16 reference PPL {d['ref_ppl']:.2f} "
             f"(`benchmarks/results/{name}`; {d.get('cpu', 'CPU not recorded')}):", "",
             "| method | experts bits/weight | attention + experts bits/weight | PPL | mean KL vs bf16 | top-1 | "
             "quantize s (GB/s) |", "|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        if "mean_kl" not in r or r["method"].startswith("floor"):
            continue
        eb, secs, gbps = r.get("experts_bits_per_weight"), r.get("quantize_seconds"), r.get("quantize_gbps")
        speed = "" if secs is None else f"{secs:.0f}" + ("" if gbps is None else f" ({gbps:.3f})")
        lines.append(f"| {r['method']} | {'' if eb is None else f'{eb:.2f}'} | {r['bits_per_weight']:.2f} | "
                     f"{r['ppl']:.2f} | {r['mean_kl']:.3f} | {100 * r['top1']:.1f}% | {speed} |")
    return "\n".join(lines)


def llamacpp_kl(name: str = "llamacpp_kl_768.json") -> str:
    """``bench_llamacpp_kl.py``: each type on the model and on its rotation, scored by ``llama-perplexity
    --kl-divergence`` against the unrotated BF16 GGUF; the rotated file's KL over the unrotated one's."""
    d = json.loads((RESULTS / name).read_text())
    rows = {r["method"]: r for r in d["rows"]}
    lines = [f"llama-perplexity --kl-divergence, {d['chunks']} windows of {d['ctx']} (its KL over the second half of "
             f"each), against the unrotated BF16 GGUF (`benchmarks/results/{name}`; {d['cpu']}; llama.cpp build "
             f"{d['build']}):", "",
             "| type | bits/weight | KL | top-1 | rotated: KL | rotated: top-1 | rotated / plain KL |",
             "|---|---|---|---|---|---|---|"]
    floor = rows.get("rotated: unquantized (BF16)")
    if floor:
        lines.append(f"| unquantized (BF16) | 16 | 0 | 100% | {floor['mean_kl']:.4f} | {100 * floor['top1']:.1f}% | |")
    for m, r in rows.items():
        rot = rows.get(f"rotated: {m}")
        if m.startswith("rotated: ") or rot is None:
            continue
        lines.append(f"| {m} | {r['bits_per_weight']:.3f} | {r['mean_kl']:.4f} | {100 * r['top1']:.1f}% | "
                     f"{rot['mean_kl']:.4f} | {100 * rot['top1']:.1f}% | {rot['mean_kl'] / r['mean_kl']:.2f} |")
    return "\n".join(lines)


def exports(name: str = "exports.json") -> str:
    d = json.loads((RESULTS / name).read_text())
    lines = [f"{d['tokens']} held-out tokens, ctx {d['ctx']}, bf16 PPL {d['ref_ppl']:.2f} (`benchmarks/results/{name}`):",
             "", "| method | export | loaded by | PPL moeq / export | KL export vs moeq |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        fmt = r["format"] + (f" {r['layout']}" if r.get("layout") else "")
        lines.append(f"| {r['method']} | {fmt} | {r['consumer']} | {r['ppl_moeq']:.2f} / {r['ppl_export']:.2f} | "
                     f"{r['kl_export_vs_moeq']:.3f} |")
    return "\n".join(lines)


def gpu(name: str = "gpu.json") -> str:
    """The fused Triton MoE on Qwen3-30B-A3B's expert shapes, per format: GPU time at 1 and 512 tokens."""
    d = json.loads((RESULTS / name).read_text())
    bw = d["bandwidth_bytes_per_s"]
    lines = [f"{d['device']} (copy bandwidth {bw / 1e12:.2f} TB/s; `benchmarks/results/{name}`), one MoE layer "
             "(128 experts, top-8, hidden 2048, expert 768), kernels' GPU time:", "",
             "| weights | bits/weight | 1 token: us, share of bandwidth | 8 tokens: us | 512 tokens: us, vs bf16 "
             "grouped GEMM |", "|---|---|---|---|---|"]
    for fmt, v in d["micro"]["formats"].items():
        rows = {r["tokens"]: r for r in v["rows"]}
        one, eight, big = rows[1], rows[8], rows[512]
        bf16 = big["bf16_experts_graph_s"] or big["bf16_experts_s"]
        lines.append(f"| {fmt} | {v['bits_per_weight']:.2f} | {one['kernel_s'] * 1e6:.0f}, "
                     f"{one['weight_bytes_per_s'] / bw:.0%} | {eight['kernel_s'] * 1e6:.0f} | "
                     f"{big['kernel_s'] * 1e6:.0f}, {bf16 / big['kernel_s']:.2f}x |")
    return "\n".join(lines)


def serve(name: str = "serve.json") -> str:
    """``moeq serve`` vs ``llama-server``: best round per concurrency, the median round's tok/s in brackets."""
    d = json.loads((RESULTS / name).read_text())
    flags = d["cpu"].get("flags", [])
    cpu = d["cpu"]["model"] + (" with AMX" if "amx_tile" in flags else "") + (
        ", AVX512-BF16" if "avx512_bf16" in flags else "")
    lines = [f"{d['threads']} threads, {cpu} (llama-server build: {d['llama_build']}; `benchmarks/results/{name}`); "
             f"{d['weights']}, {d['layers']}-layer Qwen3-30B-A3B shapes; {d['prompt_tokens']} tokens in, "
             f"{d['new_tokens']} out per request, streamed, greedy:", "",
             "| clients | llama-server / moeq tok/s (median) | TTFT p50 ms | ITL p50 ms | ITL p99 ms |", "|---|---|---|---|---|"]
    for n in d["best"]["moeq"]:
        lb, mb = d["best"]["llama-server"][n], d["best"]["moeq"][n]
        lm, mm = d["median"]["llama-server"][n], d["median"]["moeq"][n]
        lines.append(f"| {n} | {lb['tok_s']:.1f} / {mb['tok_s']:.1f} ({mb['tok_s'] / lb['tok_s']:.2f}x) "
                     f"[{mm['tok_s'] / lm['tok_s']:.2f}x] | {lb['ttft_p50_ms']:.0f} / {mb['ttft_p50_ms']:.0f} | "
                     f"{lb['itl_p50_ms']:.1f} / {mb['itl_p50_ms']:.1f} | {lb['itl_p99_ms']:.1f} / "
                     f"{mb['itl_p99_ms']:.1f} |")
    return "\n".join(lines)


def full_depth(name: str = "full_depth.json") -> str:
    """``bench_full_depth.py``: the full 48-layer Qwen3-30B-A3B shape, from its FP8 checkpoint to a streamed GGUF,
    then both engines on that file (best round, median in brackets)."""
    d = json.loads((RESULTS / name).read_text())
    q = d["steps"]["quantize_export"]
    gb = 1e9
    src = d["steps"]["source"]["bytes"] / gb
    lines = [f"{d['threads']} threads, {d['cpu']['model']} (llama.cpp: {d['llama_cpp_build'].split(',')[0]} build; "
             f"`benchmarks/results/{name}`); {d['layers']} layers, 128 experts, top-8, vocab 151936, "
             f"{d['method']} experts + attention, bf16 head:", "",
             "| step | llama.cpp | moeq |", "|---|---|---|",
             f"| FP8 checkpoint ({src:.1f} GB) to {d['method']} GGUF ({q['gguf_bytes'] / gb:.1f} GB) | two steps through "
             f"a ~{src * 2:.0f} GB BF16 GGUF (`convert_hf_to_gguf.py`, `llama-quantize`; not run: disk) | "
             f"{q['seconds']:.0f} s, one streamed pass, peak RSS {q['peak_rss_bytes'] / gb:.2f} GB |"]
    m = [r["moeq"] for r in d["rounds"]]
    best = min(m, key=lambda r: r["load_seconds"])
    anon = best.get("rss_anon_after_load_bytes")
    lines.append(f"| load the GGUF; first token of a 32-token prompt | not timed by `llama-bench` | "
                 f"{best['load_seconds']:.0f} s; "
                 f"{best['first_token_seconds']:.2f} s" + (f"; resident {anon / gb:.1f} GB" if anon else "") + " |")
    for key, label in (("decode_tps", "decode b1 tok/s"), ("prefill512_tps", "pp512 tok/s")):
        lb, mb = d["best"]["llama.cpp"][key], d["best"]["moeq"][key]
        lm = statistics.median(r["llama.cpp"][key] for r in d["rounds"])
        mm = statistics.median(r["moeq"][key] for r in d["rounds"])
        lines.append(f"| {label} | {lb:.1f} | {mb:.1f} ({mb / lb:.2f}x) [{mm / lm:.2f}x] |")
    return "\n".join(lines)


def expert_pass(name: str = "expert_pass.json") -> str:
    """``bench_expert_pass.py``: one layer's routed experts, weights and probe on 4 KB pages then on 2 MB pages (the
    last run of each), GB/s of expert bytes (best round) and the fraction of that run's read probe."""
    d = json.loads((RESULTS / name).read_text())
    last = {r["huge_pages"]: r for r in d["runs"]}
    small, huge = last[False], last[True]
    lines = [f"{huge['threads']} threads, {huge['cpu']['model']}, `{huge['method']}` experts "
             f"({huge['bytes_per_expert'] / 1e6:.2f} MB each; `benchmarks/results/{name}`); read probe "
             f"{small['probe_gbps']:.1f} GB/s on 4 KB pages, {huge['probe_gbps']:.1f} on 2 MB pages:", "",
             "| expert pass | 4 KB pages GB/s (of probe) | 2 MB pages GB/s (of probe) |", "|---|---|---|"]
    for case, v in huge["best_gbps"].items():
        w = small["best_gbps"][case]
        lines.append(f"| {case} | {w:.1f} ({w / small['probe_gbps']:.0%}) | {v:.1f} ({v / huge['probe_gbps']:.0%}) |")
    return "\n".join(lines)


def deepseek_gguf(name: str = "deepseek_gguf.json") -> str:
    """``bench_deepseek_gguf.py``: DeepSeek-V3's FP8 release layout at its real layer shapes to a q4_0 GGUF in one
    streamed pass, then llama.cpp and moeq on that file."""
    d = json.loads((RESULTS / name).read_text())
    q, gb = d["steps"]["quantize_export"], 1e9
    src = d["steps"]["source"]["bytes"] / gb
    lc, mq = d.get("llama.cpp", {}), d["moeq"]
    lines = [f"{d['threads']} threads, {d['cpu']['model']}, {d['date']} (llama.cpp: {lc.get('build', 'not run')}; "
             f"`benchmarks/results/{name}`); DeepSeek-V3's shapes, {d['layers']} layers (1 dense, "
             f"{d['layers'] - 1} MoE of {d['shape']['experts']} experts), {d['method']} experts + attention, bf16 "
             "embeddings and head:", "",
             "| step | result |", "|---|---|",
             f"| FP8 checkpoint ({src:.1f} GB) to {d['method']} GGUF ({q['gguf_bytes'] / gb:.1f} GB), one streamed "
             f"pass | {q['seconds']:.0f} s ({q['source_gbps']:.2f} GB/s of FP8 read), peak RSS "
             f"{q['peak_rss_bytes'] / gb:.1f} GB, {q['checked_by_gguf_py']} tensors decoded back by gguf-py |"]
    if lc:
        lines.append(f"| llama.cpp runs the file (`llama-bench -p 64 -n 16`) | decode {lc['decode_tps']:.1f} tok/s, "
                     f"pp64 {lc['prefill64_tps']:.0f} tok/s |")
    lines.append(f"| moeq loads it back | {mq['load_seconds']:.0f} s; first token {mq['first_token_seconds']:.2f} s; "
                 f"decode {mq['decode_tps']:.1f} tok/s |")
    return "\n".join(lines)


TABLES = {"vs_llamacpp": lambda: vs_llamacpp("vs_llamacpp_zen4.json"),
          "vs_llamacpp_avx2": lambda: vs_llamacpp("vs_llamacpp_avx2_zen4.json"),
          "vs_llamacpp_spr": lambda: vs_llamacpp("vs_llamacpp_spr.json"),
          "vs_llamacpp_spr_tiles": lambda: vs_llamacpp("vs_llamacpp_spr_tiles.json"),
          "vs_llamacpp_spr_ik": lambda: vs_llamacpp("vs_llamacpp_spr_ik.json"),
          "vs_llamacpp_avx2_spr": lambda: vs_llamacpp("vs_llamacpp_avx2_spr.json"),
          "accuracy": accuracy, "accuracy_imatrix": lambda: accuracy("accuracy_imatrix.json", IMATRIX_ROWS),
          "accuracy_importance": lambda: accuracy("accuracy_importance.json", IMPORTANCE_ROWS, seconds=True),
          "accuracy_importance_768": lambda: accuracy("accuracy_imatrix_768.json", IMPORTANCE_768_ROWS,
                                                      seconds=True),
          "accuracy_bpw": lambda: accuracy("accuracy_importance.json", BPW_ROWS, seconds=True),
          "accuracy_2bit": accuracy_2bit, "llamacpp_kl": llamacpp_kl,
          "accuracy_selfsampled": lambda: accuracy_2bit("accuracy_selfsampled_768.json"),
          "exports": exports, "gpu": gpu, "serve": serve, "serve_zen4": lambda: serve("serve_zen4.json"),
          "full_depth": full_depth, "deepseek_gguf": deepseek_gguf, "expert_pass": expert_pass,
          "hub_formats_spr": lambda: vs_llamacpp("mxfp4_fp8_vs_llamacpp_spr.json"),
          "vs_llamacpp_spr_ik_pairings": lambda: vs_llamacpp("vs_llamacpp_spr_ik_pairings.json")}
BLOCK = re.compile(r"(<!-- table: (\w+) -->\n)(.*?)(<!-- /table -->)", re.S)


def render(text: str) -> str:
    return BLOCK.sub(lambda m: m[1] + TABLES[m[2]]() + "\n" + m[4], text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE")
    mode.add_argument("--check", metavar="FILE")
    args = ap.parse_args()
    path = Path(args.write or args.check)
    text = path.read_text()
    new = render(text)
    if args.write:
        path.write_text(new)
        return 0
    if new != text:
        print(f"{path}: tables out of date; run python benchmarks/tables.py --write {path}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
