"""Matmuls with packed weights. One entry point per use; a kernel per format is chosen at call time.

``reference`` (plain torch: dequantize the one weight needed, then ``F.linear``) is the ground truth every fast
kernel is tested against. Fast kernels register in :mod:`moeq.kernels.registry` and may decline a call (return None).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeq.formats import PackedWeight
from moeq.kernels import cpu_ops  # noqa: F401  (registers the native CPU kernels)
from moeq.kernels.cpu_ops import matmul_dtype  # noqa: F401
from moeq.kernels.registry import kernels_for, register  # noqa: F401


# Weights above CHUNKED_ABOVE elements (lm_head-sized) are dequantized DEQUANT_CHUNK elements at a time into one
# reused buffer (4 MiB in bf16: stays in cache) instead of into a weight-sized temporary, which made a quantized
# lm_head slower than the bf16 one. Smaller weights (experts, attention) run whole: their matmuls are slower split.
CHUNKED_ABOVE = 1 << 24
DEQUANT_CHUNK = 1 << 21


def reference(w: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None = None,
              buf: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ dequant(w)[N, K].T + bias`` in x's dtype. ``buf``: an optional flat scratch tensor of x's
    dtype — or of :func:`matmul_dtype`'s — with at least ``w.numel`` elements to dequantize into (callers looping over
    experts reuse one); ``out``: an optional ``[n, N]`` destination for a 2-D ``x`` (the product is written there, not
    copied)."""
    cd = matmul_dtype(x.dtype, x.device)
    if cd != x.dtype:  # bf16 on a CPU without bf16 GEMM: fp32 products and sums, rounded once
        y = reference(w, x.to(cd), None if bias is None else bias.to(cd), buf)
        return y.to(x.dtype) if out is None else out.copy_(y)
    if buf is not None and buf.dtype == x.dtype and buf.numel() >= w.numel:
        wd = w.dequantize(x.dtype, out=buf[: w.numel].view(w.shape))
        if out is not None and x.dim() == 2:
            return torch.mm(x, wd.t(), out=out) if bias is None else torch.addmm(bias, x, wd.t(), out=out)
        y = F.linear(x, wd, bias)
    elif len(w.shape) == 2 and w.numel > CHUNKED_ABOVE and w.row_sliceable:
        y = _reference_chunked(w, x, bias)
    else:
        y = F.linear(x, w.dequantize(x.dtype), bias)
    return y if out is None else out.copy_(y)


def _reference_chunked(w: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Row chunks of ``w`` dequantized into one cache-sized buffer; each chunk's products land directly in rows of the
    transposed output (contiguous writes, no copy), returned as a ``[..., N]`` view of it."""
    n, k = w.shape
    rows = max(1, DEQUANT_CHUNK // k)
    buf = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, k)
    yt = torch.empty(n, x2.shape[0], dtype=x.dtype, device=x.device)  # [N, M]
    for a in range(0, n, rows):
        b = min(n, a + rows)
        wa = w.row_slice(a, b).dequantize(x.dtype, out=buf[: b - a])
        if bias is None:
            torch.mm(wa, x2.t(), out=yt[a:b])
        else:
            torch.addmm(bias[a:b, None], wa, x2.t(), out=yt[a:b])
    return yt.t().reshape(*x.shape[:-1], n)


def linear(w: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None = None,
           buf: torch.Tensor | None = None, out: torch.Tensor | None = None, kernels=None) -> torch.Tensor:
    """``x @ w.T + bias`` through the first of ``kernels`` (a module's route, decided once; default: the format's
    registered kernels) that takes it, else :func:`reference`."""
    for k in kernels_for(w.format) if kernels is None else kernels:
        y = k(w, x, bias)
        if y is not None:
            return y if out is None else out.copy_(y)
    return reference(w, x, bias, buf, out)


def expert_linear(w: PackedWeight, e: int, x: torch.Tensor, bias: torch.Tensor | None = None,
                  buf: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Expert ``e`` of a stacked weight ``[E, N, K]`` applied to ``x [n, K]``; touches only that expert."""
    return linear(w[e], x, bias, buf, out)

