"""A quantized ``nn.Linear``: packed ``weight [N, K]`` plus an optional bias in the compute dtype."""
from __future__ import annotations

import torch
from torch import nn

from moeq.formats import PackedWeight
from moeq.kernels import CHUNKED_ABOVE, cpu_ops, linear, plans
from moeq.kernels.describe import il16_takes
from moeq.nn.packed import DecodeLayout, get_packed, set_packed


class QuantLinear(DecodeLayout, nn.Module):
    IL16_SLOTS = ("weight",)

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        set_packed(self, "weight", weight)
        # registered even when None, so a loader can fill it by name
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
        self._init_layout()
        self.choose_kernel()

    def choose_kernel(self) -> str:
        """Pick the forward for where the weight lives, once (at build and after ``.to()``): ``triton`` on CUDA,
        ``native`` on CPU (the one-call bf16 decode linear, then the registered gemv kernels), else ``torch``; then
        the layout (:meth:`~moeq.nn.packed.DecodeLayout.choose_layout`)."""
        dev = self.slot_device("weight").type
        self.kernel = "triton" if dev == "cuda" else "native" if dev == "cpu" else "torch"
        self.choose_layout()
        return self.kernel

    def _il16_takes(self) -> bool:  # heads over CHUNKED_ABOVE stay row-major (their prompt path dequantizes in chunks)
        return self.out_features * self.in_features <= CHUNKED_ABOVE and il16_takes(self, self.IL16_SLOTS)

    @property
    def qweight(self) -> PackedWeight:
        """The weight, row-major (a permuted copy while held in the il16 decode layout)."""
        return get_packed(self, "weight")

    def extra_repr(self) -> str:
        layout = "il16" if self.il16("weight") else "rows"
        return (f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}, layout={layout}, "
                f"weight={self.packed('weight', raw=True)!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "triton":
            from moeq.kernels import gpu  # noqa: PLC0415

            y = gpu.linear_forward(self, x)
            if y is not None:
                return y
        elif x.device.type == "cpu":
            route = plans.linear_route(self, x.dtype)
            y = cpu_ops.quant_linear_bf16(self, x) if route.one_call else None
            if y is None and route.il16_prompt:
                y = cpu_ops.il16_linear(self, x)
            if y is not None:
                return y
            return linear(self.qweight, x, self.bias, kernels=route.gemv)
        return linear(self.qweight, x, self.bias)


def _canonical_input(module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook: give a dense ``nn.Linear`` its input with standard strides. transformers feeds the head
    ``hidden[:, -1:, :]``, a ``[B, 1, K]`` view whose batch stride is the whole prompt's; torch 2.13's CPU bf16 linear
    with a weight that does not require grad takes a path on it that is an order of magnitude slower (README,
    Benchmarks). Copying those B rows is free by comparison."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.device.type != "cpu":
        return None
    expected, step = [], 1
    for size in reversed(x.shape):
        expected.append(step)
        step *= size
    if tuple(reversed(expected)) == x.stride():
        return None
    return (x.clone(memory_format=torch.contiguous_format), *args[1:])


def canonicalize_head_input(model: nn.Module) -> None:
    """Install :func:`_canonical_input` on the model's output head when it stays a dense ``nn.Linear`` (tied
    embeddings, or a head left unquantized)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear) and _canonical_input not in head._forward_pre_hooks.values():
        head.register_forward_pre_hook(_canonical_input)
