"""A quantized ``nn.Linear``: packed ``weight [N, K]`` plus an optional bias in the compute dtype."""
from __future__ import annotations

import torch
from torch import nn

from moeq.formats import PackedWeight
from moeq.kernels import linear
from moeq.nn.packed import get_packed, set_packed


class QuantLinear(nn.Module):
    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        set_packed(self, "weight", weight)
        # registered even when None, so a loader can fill it by name
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))

    @property
    def qweight(self) -> PackedWeight:
        return get_packed(self, "weight")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, weight={self.qweight!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            from moeq.kernels import gpu  # noqa: PLC0415

            y = gpu.linear_forward(self, x)
            if y is not None:
                return y
        return linear(self.qweight, x, self.bias)
