"""The README's main job: what each format does to a synthetic expert stack (and, later, to a whole model)."""
from __future__ import annotations

import time

import torch

from moeq.config import BNB4, RTN, FormatConfig, Int8
from moeq.metrics import max_abs_err, sqnr_db

DEMO_FORMATS: tuple[FormatConfig, ...] = (
    RTN(8, 128), RTN(4, 128), RTN(4, 128, grid="signed"), RTN(4, 128, symmetric=False), RTN(4, 64, symmetric=False),
    RTN(3, 64, symmetric=False), RTN(2, 32, symmetric=False),
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
