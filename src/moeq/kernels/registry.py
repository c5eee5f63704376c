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


def kernels_for(fmt: str) -> list[Kernel] | tuple[()]:
    """The registered kernels of ``fmt`` (the registry's own list: read it, don't change it)."""
    return KERNELS.get(fmt, ())


def by_format(what: str):
    """A one-function-per-format table and its registering decorator (``@decorator(fmt)``), for the per-backend
    knowledge of a format (its native description, its Triton layout)."""
    table: dict[str, Callable] = {}

    def register_one(fmt: str):
        def deco(fn):
            if fmt in table:
                raise ValueError(f"{what} for format {fmt!r} registered twice")
            table[fmt] = fn
            return fn
        return deco

    return table, register_one
