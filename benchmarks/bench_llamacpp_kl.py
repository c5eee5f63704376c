"""Rotation scored by llama.cpp itself: llama.cpp's own types (``llama-quantize``, with and without an importance
matrix) applied to the fixture and to moeq's rotated export of it, and moeq's own GGUF exports, every file scored by
``llama-perplexity --kl-divergence`` against the **unrotated** model's BF16 GGUF on the held-out text — the numbers a
llama.cpp user would get, computed by llama.cpp, with no moeq code on the scoring side.

    python benchmarks/bench_llamacpp_kl.py [--model DIR] [--types Q4_0:pure Q4_K_M:imatrix IQ4_XS:pure:imatrix ...]
                                           [--moeq iq4nl q4_0] [--chunks 12] [--out FILE]

The rotated model is ``moeq.rotate_`` in fp32, saved fp32, then exported to a BF16 GGUF like the base (its row
"unquantized" is what the rotation and that bf16 rounding cost). Each model gets its own importance matrix
(``llama-imatrix`` on the same calibration text as ``bench_accuracy.py``: the first 90% of the six novels, disjoint
from the scored last 10%), as a user quantizing the rotated file would make. ``llama-perplexity`` scores the second
half of each ``--ctx`` window (its own convention), so its KL is not the same number as ``bench_accuracy.py``'s;
rotated-vs-unrotated ratios within one table are what to read. Tools: benchmarks/llamacpp.py (``llama-perplexity``,
``llama-quantize``, ``llama-imatrix``).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import moeq
from moeq.io.writer import write_json

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import llamacpp  # noqa: E402
from bench_accuracy import DATA, _cpu, bf16_gguf, calibration_text, heldout_text  # noqa: E402

TYPES = ["Q4_0:pure", "Q4_0:pure:imatrix", "Q4_K_M", "Q4_K_M:imatrix", "IQ4_XS:pure", "IQ4_XS:pure:imatrix",
         "IQ4_XS:imatrix"]
FIELDS = {  # llama-perplexity's summary lines -> row keys
    "mean_kl": r"Mean\s+KLD:\s+([-\d.]+)", "median_kl": r"Median\s+KLD:\s+([-\d.]+)",
    "p99_kl": r"99\.0%\s+KLD:\s+([-\d.]+)",
    "ppl": r"Mean PPL\(Q\)\s+:\s+([-\d.]+)", "ref_ppl": r"Mean PPL\(base\)\s+:\s+([-\d.]+)",
    "top1": r"Same top p:\s+([-\d.]+)",
}


def parse(log: str) -> dict:
    """The KL summary ``llama-perplexity --kl-divergence`` prints (``top1`` as a fraction)."""
    out = {}
    for key, pat in FIELDS.items():
        m = re.search(pat, log)
        if m is None:
            raise RuntimeError(f"llama-perplexity printed no {key!r} line:\n{log[-2000:]}")
        out[key] = float(m.group(1))
    out["top1"] /= 100.0
    return out


def perplexity(exe: Path, model: Path, text: Path, kld: Path, ctx: int, chunks: int, base: bool = False) -> str:
    """``llama-perplexity`` on ``text`` (2 threads): ``base`` saves the model's logits to ``kld``, else scores the
    model's KL divergence from them."""
    cmd = [str(exe), "-m", str(model), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks), "-t", "2",
           "--kl-divergence-base", str(kld)] + ([] if base else ["--kl-divergence"])
    r = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    return r.stdout + r.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "moeq-fixtures-out" / "smollm2-moe-768"))
    ap.add_argument("--types", nargs="*", default=TYPES, metavar="TYPE[:pure][:imatrix]")
    ap.add_argument("--moeq", nargs="*", default=["iq4nl", "q4_0"], metavar="METHOD",
                    help="moeq methods exported to GGUF on both models (ones whose GGUF export is lossless: "
                         "q4_0, q8_0, iq4nl, iq4nl-dq, q5_0, mxfp4, ...)")
    ap.add_argument("--importance", nargs="*", default=["iq4nl"], metavar="METHOD",
                    help="moeq methods exported with data-free importance (moeq.load(..., importance=8192))")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=12, help="windows of --ctx tokens of the held-out text")
    ap.add_argument("--imatrix-chunks", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="the rotation's seed")
    ap.add_argument("--out", default=str(HERE / "results" / "llamacpp_kl_768.json"))
    args = ap.parse_args()
    tools = {t: llamacpp.find_tool(t) for t in ("llama-perplexity", "llama-quantize", "llama-imatrix")}
    if missing := [t for t, p in tools.items() if p is None]:
        sys.exit(f"{', '.join(missing)} not found (build steps in benchmarks/llamacpp.py)")
    from moeq.export import export  # noqa: PLC0415

    rows = []
    with tempfile.TemporaryDirectory(prefix="moeq-lckl-") as tmp:
        work = Path(tmp)
        text, calib = work / "heldout.txt", work / "calibration.txt"
        text.write_text("\n\n".join(heldout_text(sorted(DATA.glob("text_*.txt")))), encoding="utf-8")
        calib.write_text("\n\n".join(calibration_text(sorted(DATA.glob("text_*.txt")), args.imatrix_chunks * 512 * 6)),
                         encoding="utf-8")
        rot_dir = work / "rotated-fp32"
        m = moeq.load(args.model, dtype=torch.float32, progress=False)
        rotation = moeq.rotate_(m, seed=args.seed)
        moeq.save(m, rot_dir, source=args.model)
        del m
        sources = {"base": args.model, "rotated": str(rot_dir)}
        ggufs = {k: bf16_gguf(v, work / f"{k}-bf16") for k, v in sources.items()}
        kld = work / "base.kld"
        perplexity(tools["llama-perplexity"], ggufs["base"], text, kld, args.ctx, args.chunks, base=True)

        def score(label: str, model: str, path: Path, extra: dict) -> None:
            t0 = time.perf_counter()
            r = parse(perplexity(tools["llama-perplexity"], path, text, kld, args.ctx, args.chunks))
            bpw, types, _ = llamacpp.bits_per_weight(path)
            rows.append({"method": label, "model": model, "bits_per_weight": bpw, "ggml_types": types,
                         "score_seconds": time.perf_counter() - t0, **extra, **r})
            print(f"{label:55s} {bpw:.3f} bits  KL {r['mean_kl']:.4f}  top-1 {r['top1']:.2%}", flush=True)

        score("rotated: unquantized (BF16)", "rotated", ggufs["rotated"], {})
        imats = {}
        for model, path in ggufs.items():
            if any("imatrix" in s.split(":")[1:] for s in args.types):
                imats[model] = llamacpp.imatrix(tools["llama-imatrix"], path, calib, work / f"{model}-imatrix.gguf",
                                                args.imatrix_chunks)
            prefix = "" if model == "base" else "rotated: "
            for spec in args.types:
                qtype, *opts = spec.split(":")
                pure, weighted = "pure" in opts, "imatrix" in opts
                label = (f"{prefix}llama.cpp {qtype}{' --pure' if pure else ' (its mix)'}"
                         f"{' +imatrix' if weighted else ''}")
                out = llamacpp.quantize(tools["llama-quantize"], path, work / f"{model}-{spec.replace(':', '-')}.gguf",
                                        qtype, pure, imats[model] if weighted else None)
                score(label, model, out, {"imatrix": weighted})
            for name, imp in [*((n, 0) for n in args.moeq), *((n, 8192) for n in args.importance)]:
                t0 = time.perf_counter()
                q = moeq.load(sources[model], quant=name, dtype=torch.bfloat16, progress=False, importance=imp)
                tag = f"{name}{' +importance' if imp else ''}"
                dst = work / f"{model}-moeq-{tag.replace(' +', '-')}"
                export(q, dst, "gguf", source=sources[model])
                del q
                score(f"{prefix}moeq {tag} (GGUF export)", model, dst / "model.gguf",
                      {"quantize_seconds": time.perf_counter() - t0, "importance_tokens": imp})
    out = {"model": args.model, "ctx": args.ctx, "chunks": args.chunks,
           "tokens_scored": args.chunks * (args.ctx - args.ctx // 2), "text": "last 10% of the six ../shared/data "
           "novels (held out); imatrix text: their first 90%", "imatrix_chunks": args.imatrix_chunks,
           "rotation_seed": args.seed, "rotation": dataclasses.asdict(rotation), "tool": str(tools["llama-perplexity"]),
           "build": llamacpp.build_flags(tools["llama-perplexity"]), "cpu": _cpu(),
           "rows": rows}
    write_json(args.out, out)


if __name__ == "__main__":
    main()
