"""What loading an act-order GPTQ checkpoint costs in accuracy. moeq's kernels read contiguous groups, so a GPTQ
checkpoint whose ``g_idx`` assigns inputs to groups out of order (``desc_act: true``) loads only with a method: each
weight is dequantized exactly and quantized again. This measures that second rounding on real trained weights.

The MoEfied SmolLM2 fixture (``../shared/fixtures``) is written as 4-bit GPTQ (symmetric, group 32) twice by
``moeq.tiny.to_gptq``: inputs in order, and act-order (inputs assigned to groups through a seeded permutation, as
``desc_act`` does; round-to-nearest within each group, not GPTQ's error feedback — the layout, not the optimizer, is
what is measured). Reference: the act-order checkpoint's own weights (dequantized, held bf16: ``--method none``).
Scored: KL and top-1 agreement against it on held-out Austen text (the last 10% of each book), for the act-order
checkpoint re-quantized with each method, and for the in-order checkpoint as stored (what a non-act-order GPTQ
loads as, for scale). Writes ``benchmarks/results/act_order.json``.

    python benchmarks/bench_act_order.py [--model DIR] [--tokens 8192] [--methods q4_0 iq4nl rtn-int4 q8_0]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import moeq  # noqa: E402
from bench_accuracy import DATA, heldout_text  # noqa: E402
from moeq.bench import cpu_summary  # noqa: E402
from moeq.eval import evaluate_many, tokenize  # noqa: E402
from moeq.io.writer import write_json  # noqa: E402
from moeq.tiny import to_gptq  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "moeq-fixtures-out" / "smollm2-moe"))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--methods", nargs="+", default=["q4_0", "iq4nl", "rtn-int4", "q8_0"])
    ap.add_argument("--out", default=str(HERE / "results" / "act_order.json"))
    args = ap.parse_args()
    src = Path(args.model)
    if not (src / "config.json").exists():
        sys.exit(f"{src}: build the fixture first (../shared/fixtures/README.md)")
    tok = AutoTokenizer.from_pretrained(src)
    ids = tokenize(tok, heldout_text(sorted(DATA.glob("text_*.txt"))))[: args.tokens]
    with tempfile.TemporaryDirectory() as tmp:
        act = to_gptq(src, Path(tmp) / "act", act_order=True)
        plain = to_gptq(src, Path(tmp) / "plain", act_order=False)
        ref = moeq.load(act, quant="none", progress=False)
        models = {f"act-order re-quantized: {m}": moeq.load(act, quant=m, progress=False) for m in args.methods}
        models["in-order GPTQ as stored (scale: another 4-bit rounding of the same weights)"] = moeq.load(
            plain, progress=False)
        res = evaluate_many(models, ref, ids, ctx=args.ctx, progress=False)
    rows = [{"model": k, "mean_kl": r.mean_kl, "p99_kl": r.p99_kl, "top1": r.top1, "ppl": r.ppl, "ref_ppl": r.ref_ppl,
             "tokens": r.tokens} for k, r in res.items()]
    for r in rows:
        print(f"{r['model']}: KL {r['mean_kl']:.4f} (p99 {r['p99_kl']:.3f}), top-1 {r['top1']:.3f}, "
              f"ppl {r['ppl']:.2f} vs {r['ref_ppl']:.2f}")
    write_json(args.out, {"cpu": cpu_summary(), "fixture": str(src), "gptq": "4-bit sym, group 32, v1",
                          "reference": "the act-order checkpoint's weights, dequantized, bf16", "rows": rows})
    print("wrote", args.out)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
