"""Fast matmul kernels per packed format: each registers with :func:`register` and may decline a call (return None),
leaving the next kernel or the plain-torch reference (:func:`moeq.kernels.reference`)."""
from __future__ import annotations

from typing import Callable

import torch

from moeq.formats import PackedWeight

Kernel = Callable[[PackedWeight, torch.Tensor, torch.Tensor | None], torch.Tensor | None]
KERNELS: dict[str, list[Kernel]] = {}


def register(fmt: str):
    """Register a kernel for packed weights of format ``fmt`` (tried in registration order)."""
    def deco(fn: Kernel) -> Kernel:
        KERNELS.setdefault(fmt, []).append(fn)
        return fn
    return deco


def kernels_for(fmt: str) -> tuple[Kernel, ...]:
    return tuple(KERNELS.get(fmt, ()))
