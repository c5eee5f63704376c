"""Matmuls with packed weights. One entry point per use; a kernel per format is chosen at call time.

``reference`` (plain torch: dequantize the one weight needed, then ``F.linear``) is the ground truth every fast
kernel is tested against. Fast kernels register with :func:`register` and may decline a call (return None).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moeq.formats import PackedWeight

Kernel = Callable[[PackedWeight, torch.Tensor, torch.Tensor | None], torch.Tensor | None]
_KERNELS: dict[str, list[Kernel]] = {}


def register(fmt: str):
    def deco(fn: Kernel) -> Kernel:
        _KERNELS.setdefault(fmt, []).append(fn)
        return fn
    return deco


def reference(w: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ dequant(w)[N, K].T + bias`` in x's dtype."""
    return F.linear(x, w.dequantize(x.dtype), bias)


def linear(w: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    for k in _KERNELS.get(w.format, ()):
        y = k(w, x, bias)
        if y is not None:
            return y
    return reference(w, x, bias)


def expert_linear(w: PackedWeight, e: int, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Expert ``e`` of a stacked weight ``[E, N, K]`` applied to ``x [n, K]``; touches only that expert."""
    return linear(w[e], x, bias)


def _register_builtin() -> None:
    from moeq.kernels import cpu_ops  # noqa: F401,PLC0415  (registers the native CPU kernels)


_register_builtin()
