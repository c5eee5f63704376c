"""The native decode kernels as a table (``KERNELS`` in moeq/native/csrc/moe.c): every described weight comes planned —
its decode kernels ranked once, ending with a row that always runs — and a call through the plan computes exactly
what the same call ranks for itself (an unplanned description), for every method, with bf16 and fp32 activations."""
from __future__ import annotations

import ctypes

import pytest
import torch

from moeq import native
from moeq.config import METHODS
from moeq.kernels.describe import describe
from moeq.kernels.plans import experts_plan, linear_plan
from moeq.native import Fmt, Layers
from moeq.nn import QuantLinear

pytestmark = pytest.mark.skipif(native.lib() is None, reason="no C compiler: the native kernels are not built")

ALWAYS = {"il16", "fp8", "cb", "rtn4_bf16", "rtn", "bnb4", "iq2s"}  # the rows whose run never declines
METHOD_NAMES = [m for m in METHODS if m != "none"]


def _linear(method: str, n: int = 128, k: int = 256) -> QuantLinear:
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05).to(torch.bfloat16)
    return QuantLinear(METHODS[method].quantize(w, "linear"))


@pytest.mark.parametrize("method", METHOD_NAMES)
@pytest.mark.parametrize("dot", [True, False])
def test_every_description_is_planned_and_ends_with_a_row_that_always_runs(method, dot):
    m = _linear(method)
    keep: list = []
    stack = describe(m.packed("weight", raw=True), keep, dot_bf16=dot and native.has_simd())
    if stack is None:
        pytest.skip(f"{method}: outside the native formats (runs dequantize + matmul)")
    names = stack.kernel_names()
    assert names, f"{method}: described but not planned"
    assert names[-1] in ALWAYS and not set(names[:-1]) & ALWAYS, names
    expects_experts = (native.has_simd() and stack.fmt == Fmt.RTN and (stack.bits == 4 or bool(stack.lut))
                       and bool(stack.dot_bf16))
    assert bool(stack.layers & Layers.EXPERTS) == expects_experts
    assert bool(stack.layers & Layers.GEMM) == bool(native.lib().moeq_gemm_takes(ctypes.byref(stack)))


@pytest.mark.parametrize("method", METHOD_NAMES)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_a_planned_call_equals_the_unplanned_one(method, rows):
    """The plan is a decision taken early, not a different computation: zeroing ``kernels`` makes the C side rank the
    rows itself on every call; the outputs must be bit-identical."""
    m = _linear(method)
    plan = linear_plan(m)
    if plan is None or not native.has_simd():
        pytest.skip(f"{method}: no one-call native linear on this build")
    x = torch.randn(rows, plan.k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    L = native.lib()
    outs = []
    for planned in (True, False):
        stack = native.WStack.from_buffer_copy(plan.stack)
        if not planned:
            ctypes.memset(ctypes.addressof(stack.kernels), 0, native.MAX_KERNELS)
        y, scratch = torch.empty(rows, plan.n, dtype=torch.bfloat16), plan.scratch(rows)
        L.moeq_quant_linear_bf16(ctypes.byref(stack), native.ptr(x), native.i64(rows), None, native.ptr(y),
                                 native.ptr(scratch))
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    ref = x.float() @ m.packed("weight").dequantize(torch.float32).T
    assert ((outs[0].float() - ref).norm() / ref.norm()).item() < 0.02


def test_int8_activations_rank_their_kernel_first_then_the_default_ones():
    m = _linear("q4_0")
    keep: list = []
    stack = describe(m.packed("weight", raw=True), keep, dot_bf16=native.has_simd(), act_i8=True)
    if not native.has_i8_dot():
        pytest.skip("this build has no int8-activation kernels")
    names = stack.kernel_names()
    assert names[0] == "i8" and names[-1] in ALWAYS and len(names) >= 2  # a row that declines is never last
    assert stack.layers & Layers.I8


@pytest.mark.parametrize("method", ["q4_0", "q8_0", "fp8", "nf4"])
def test_experts_plans_carry_their_layer_kernels(method):
    from moeq.nn import QuantExperts  # noqa: PLC0415
    from moeq.nn.experts import Activation  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    fmt = METHODS[method]
    w13 = (torch.randn(4, 128, 128, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(4, 128, 64, generator=g) * 0.05).to(torch.bfloat16)
    ex = QuantExperts(fmt.quantize(w13, "w13", slices=4), fmt.quantize(w2, "w2", slices=4), Activation())
    plan = experts_plan(ex, native.has_simd())
    assert plan is not None and plan.w13.kernel_names() and plan.w2.kernel_names()
    assert bool(plan.w13.layers & plan.w2.layers & Layers.EXPERTS) == (native.has_simd() and method == "q4_0")
    # the prompt's grouped GEMM: RTN grids and FP8 tiles on AVX512-BF16 builds; NF4 runs dequantize + matmul
    assert bool(plan.w13.layers & Layers.GEMM) == (native.has_dpbf16() and method != "nf4")
