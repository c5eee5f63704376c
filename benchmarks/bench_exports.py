"""Exports judged by what their consumer computes, on real trained weights (the SmolLM2-MoE fixture of
../shared/fixtures): for each method, moeq's own model of it and its export as the engine loads it (transformers +
bitsandbytes for bnb, transformers + compressed-tensors for compressed-tensors, llama.cpp through the xllamacpp
wheel for GGUF) are scored on held-out Austen text against the bf16 model: PPL, mean KL, and the export's KL against
moeq's model. The target: no export more than a few percent worse in PPL than moeq's own model of it.

    python benchmarks/bench_exports.py --model FIXTURE/smollm2-moe --text ../shared/data/text_*.txt
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import moeq  # noqa: E402
from moeq.eval import windows  # noqa: E402
from moeq.export import export  # noqa: E402
from moeq.io.writer import write_json  # noqa: E402

CASES = [("nf4", "bnb", "transformers5"), ("nf4", "bnb", "transformers4"), ("int8", "bnb", "transformers5"),
         ("rtn-int4", "compressed-tensors", None), ("rtn-int8", "compressed-tensors", None),
         ("q4_0", "gguf", None), ("q8_0", "gguf", None), ("iq4nl", "gguf", None), ("q4_0-m", "gguf", None),
         ("q5_0-m", "gguf", None)]


def heldout_ids(tok, texts: list[str], tokens: int) -> torch.Tensor:
    text = "\n".join(t[int(len(t) * 0.9):] for t in texts)  # the fixture's router saw the first 90%
    return tok(text, return_tensors="pt").input_ids[0][:tokens]


def hf_logprobs(model, ids: torch.Tensor, ctx: int) -> list[torch.Tensor]:
    """Per-window log-probs of the scored positions (second halves after the first window), as moeq.eval scores."""
    out = []
    with torch.no_grad():
        for start, end, first in windows(ids.numel(), ctx):
            out.append(torch.log_softmax(model(ids[start:end - 1][None]).logits[0, first:].float(), -1))
    return out


def llama_logprobs(path: Path, ids: torch.Tensor, ctx: int) -> list[torch.Tensor]:
    """The same windows scored by llama.cpp, one token per decode step (its logits at every position)."""
    from tests.llama_cpp import LlamaCpp  # noqa: PLC0415

    llama = LlamaCpp(path)
    lib = llama.lib
    out = []
    try:
        for start, end, first in windows(ids.numel(), ctx):
            c = lib.llama_init_from_model(llama.model, lib.llama_context_default_params())
            rows = []
            try:
                for t in ids[start:end - 1].tolist():
                    buf = (ctypes.c_int32 * 1)(t)
                    if lib.llama_decode(c, lib.llama_batch_get_one(buf, 1)) != 0:
                        raise RuntimeError("llama_decode failed")
                    rows.append(np.ctypeslib.as_array(lib.llama_get_logits_ith(c, -1), (llama.n_vocab,)).copy())
            finally:
                lib.llama_free(c)
            out.append(torch.log_softmax(torch.from_numpy(np.stack(rows[first:])).float(), -1))
    finally:
        llama.close()
    return out


def score(lps: list[torch.Tensor], ref: list[torch.Tensor], ids: torch.Tensor, ctx: int) -> dict:
    nll, kls, n = 0.0, [], 0
    for (start, end, first), lp, lr in zip(windows(ids.numel(), ctx), lps, ref):
        t = ids[start + 1:end][first:]
        v = min(lp.shape[-1], lr.shape[-1])
        lp, lr = lp[:, :v], lr[:, :v]
        nll -= lp.gather(-1, t[:, None]).sum().item()
        kls.append((lr.exp() * (lr - lp)).sum(-1))
        n += t.numel()
    return {"ppl": math.exp(nll / n), "mean_kl": torch.cat(kls).mean().item(), "tokens": n}


def kl_between(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    v = min(a[0].shape[-1], b[0].shape[-1])
    return torch.cat([(x[:, :v].exp() * (x[:, :v] - y[:, :v])).sum(-1) for x, y in zip(a, b)]).mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", nargs="+", required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "exports.json"))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    src = Path(args.model)
    tok = AutoTokenizer.from_pretrained(src)
    ids = heldout_ids(tok, [Path(t).read_text(encoding="utf-8") for t in args.text], args.tokens)
    ref_lp = hf_logprobs(moeq.load(src, progress=False), ids, args.ctx)
    base = score(ref_lp, ref_lp, ids, args.ctx)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method, fmt, layout in CASES:
            t0 = time.time()
            m = moeq.load(src, quant=method, progress=False)
            mine = hf_logprobs(m, ids, args.ctx)
            out = Path(tmp) / f"{method}-{fmt}-{layout}" if fmt != "gguf" else Path(tmp) / f"{method}.gguf"
            summary = export(m, out, fmt, source=src, **({"layout": layout} if layout else {}))
            if fmt == "gguf":
                consumer, theirs = "llama.cpp (xllamacpp)", llama_logprobs(out, ids, args.ctx)
            elif fmt == "bnb" and layout == "transformers4":
                consumer, theirs = "moeq", hf_logprobs(moeq.load(out, progress=False), ids, args.ctx)
            else:
                consumer = "transformers + " + ("bitsandbytes" if fmt == "bnb" else "compressed-tensors")
                try:
                    theirs = hf_logprobs(AutoModelForCausalLM.from_pretrained(out).eval(), ids, args.ctx)
                except Exception as e:  # noqa: BLE001 - recorded: the consumer cannot load it
                    consumer = f"moeq (transformers failed: {type(e).__name__}: {str(e)[:160]})"
                    theirs = hf_logprobs(moeq.load(out, progress=False), ids, args.ctx)
            s_m, s_e = score(mine, ref_lp, ids, args.ctx), score(theirs, ref_lp, ids, args.ctx)
            rows.append({"method": method, "format": fmt, "layout": layout, "consumer": consumer,
                         "bits_per_weight": moeq.inspect(m)["bits_per_weight"], "ppl_moeq": s_m["ppl"],
                         "ppl_export": s_e["ppl"], "ppl_ratio": s_e["ppl"] / s_m["ppl"], "kl_moeq": s_m["mean_kl"],
                         "kl_export": s_e["mean_kl"], "kl_export_vs_moeq": kl_between(mine, theirs),
                         "kl_vs_moeq_at_export": summary.get("kl_vs_moeq"), "seconds": time.time() - t0})
            print(json.dumps(rows[-1]), flush=True)
    res = {"model": str(src), "tokens": base["tokens"], "ctx": args.ctx, "ref_ppl": base["ppl"], "rows": rows}
    write_json(args.out, res)
    print(f"\nbf16 PPL {base['ppl']:.3f} on {base['tokens']} held-out tokens\n")
    print("| method | export | consumer | PPL moeq | PPL export | ratio | KL export vs moeq |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['format']}{' ' + r['layout'] if r['layout'] else ''} | {r['consumer']} | "
              f"{r['ppl_moeq']:.3f} | {r['ppl_export']:.3f} | {r['ppl_ratio']:.4f} | {r['kl_export_vs_moeq']:.2e} |")


if __name__ == "__main__":
    main()
