"""The 8-bit experts' decode layer in one parallel region (``moeq_moe_rtn8_layer``, gemv.c): the bits of the
per-expert path it replaces (``moeq_moe_forward``: the same bf16 rounding, int16 activations and group sums, the
experts summed in expert order), within bf16 rounding of a float64 reference, with a zero point and without."""
from __future__ import annotations

import pytest
import torch

from moeq import native
from moeq.config import RTN, method
from moeq.kernels import moe_cpu
from moeq.nn import QuantExperts
from moeq.nn.experts import Activation
from tests.kernels.reference import reference_moe

pytestmark = pytest.mark.skipif(not native.has_i8_dot(), reason="the 8-bit decode kernels need AVX512-BF16 + VNNI")
E, H, I, A = 6, 256, 192, 2


def _experts(name: str) -> QuantExperts:
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(torch.bfloat16)
    fmt = RTN(8, 64, symmetric=False) if name == "rtn-int8-asym g64" else method(name)
    return QuantExperts(fmt.quantize(w13, "w13", slices=E), fmt.quantize(w2, "w2", slices=E), Activation())


@pytest.mark.parametrize("name", ["q8_0", "rtn-int8", "rtn-int8-asym g64"])
@pytest.mark.parametrize("t", [1, 3, 8])
def test_rtn8_layer_is_the_per_expert_path(name, t):
    m = _experts(name)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, A, generator=g), -1)
    layer = moe_cpu.moe_routed(m, x, idx, wts)  # moeq_moe_routed: the one-region 8-bit layer
    assert layer is not None
    order = torch.argsort(idx.flatten(), stable=True)
    counts = torch.bincount(idx.flatten(), minlength=E).tolist()
    per_expert = moe_cpu.moe_forward(m, x, order // A, wts.flatten()[order], counts)  # moeq_moe_forward
    assert per_expert is not None and torch.equal(layer, per_expert)
    glu = lambda a, b: torch.nn.functional.silu(a) * b  # noqa: E731
    ref = reference_moe(m.w13.dequantize(torch.float64), m.w2.dequantize(torch.float64), x, idx, wts, glu)
    assert ((layer.double() - ref).norm() / ref.norm()).item() < 0.02
