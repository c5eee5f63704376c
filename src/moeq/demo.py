"""The README's main job: what each format does to a synthetic expert stack (and, later, to a whole model)."""
from __future__ import annotations

import time

import torch

from moeq.config import BNB4, RTN, FormatConfig, Int8
from moeq.metrics import max_abs_err, sqnr_db

DEMO_FORMATS: tuple[FormatConfig, ...] = (
    RTN(8, 128), RTN(4, 128), RTN(4, 128, grid="signed"), RTN(4, 128, symmetric=False), RTN(4, 64, symmetric=False),
    RTN(3, 64, symmetric=False), RTN(2, 32, symmetric=False),
    RTN(4, 32, grid="signed"), RTN(4, 32, grid="signed", search=7, weighting="row"),
    RTN(4, 32, grid="iq4nl", search=7, weighting="row"),
    RTN(4, 32, grid="iq4nl", search=7, weighting="row", double_quant=True),
    RTN(5, 32, grid="signed", search=7, weighting="row"),
    BNB4("nf4", 64, False), BNB4("nf4", 64, True), BNB4("fp4", 64, True), Int8(),
)


def synthetic_stack(shape=(8, 1536, 2048), seed: int = 0) -> torch.Tensor:
    """Expert-like weights: gaussian rows with per-row scale spread and a few heavy-tailed outliers."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w *= torch.exp(0.3 * torch.randn(*shape[:-1], 1, generator=g))
    outliers = torch.rand(shape, generator=g) < 1e-3
    w = torch.where(outliers, w * 8, w)
    return w.to(torch.bfloat16)


def format_table(w: torch.Tensor, formats=DEMO_FORMATS) -> list[dict]:
    rows = []
    for cfg in formats:
        t0 = time.perf_counter()
        q = cfg.quantize(w, name="demo.experts")
        tq = time.perf_counter() - t0
        t0 = time.perf_counter()
        w_hat = q.dequantize(torch.bfloat16)
        td = time.perf_counter() - t0
        gb = w.numel() * w.element_size() / 1e9
        rows.append({"format": cfg.label(), "bits_per_weight": q.bits_per_weight, "sqnr_db": sqnr_db(w, w_hat),
                     "max_abs_err": max_abs_err(w, w_hat), "quantize_gbps": gb / tq, "dequantize_gbps": gb / td})
    return rows


DEMO_METHODS = ("none", "rtn-int8", "rtn-int4", "rtn-int4-asym", "nf4", "fp4", "int8")


def model_table(arch: str = "qwen3_moe", methods=DEMO_METHODS, new_tokens: int = 16) -> list[dict]:
    """Random ``arch`` checkpoint -> each method loaded in flight -> size, decode speed, KL/top-1 vs bf16."""
    import tempfile  # noqa: PLC0415

    import moeq  # noqa: PLC0415
    from moeq.metrics import kl_top1  # noqa: PLC0415
    from moeq.tiny import make_checkpoint  # noqa: PLC0415

    rows = []
    with tempfile.TemporaryDirectory() as d:
        make_checkpoint(arch, d, hidden_size=256, num_hidden_layers=4, **_wider(arch))
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 300, (4, 64), generator=g)
        prompt = ids[:1, :8]
        ref_logits = None
        for m in methods:
            model = moeq.load(d, quant=m, progress=False)
            with torch.no_grad():
                logits = model(ids).logits.float()
            if ref_logits is None:
                ref_logits = logits
            kl, top1 = kl_top1(ref_logits, logits)
            model.generate(prompt, max_new_tokens=2, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            dt = time.perf_counter() - t0
            info = moeq.inspect(model)
            rows.append({"method": "bf16" if m == "none" else m, "bytes": info["total_bytes"],
                         "bits_per_weight": info["bits_per_weight"], "decode_tok_s": new_tokens / dt,
                         "mean_kl": kl.mean().item(), "top1": top1.mean().item(),
                         "sample": " ".join(map(str, out[0, 8:14].tolist())) + " ..."})
    return rows


def _wider(arch: str) -> dict:
    key = {"qwen2_moe": "moe_intermediate_size", "qwen3_moe": "moe_intermediate_size",
           "deepseek_v3": "moe_intermediate_size"}.get(arch, "intermediate_size")
    return {key: 256}
