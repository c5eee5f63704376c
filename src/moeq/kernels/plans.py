"""Native plans: a quantized module's weights described once for the native kernels, shared by every caller (the
module's own forward, the fused decoder layer in :mod:`moeq.nn.decode`, the whole-step engine in
:mod:`moeq.nn.engine`).

A plan is built on first use and kept in the module until something replaces the buffers it points into: only
:func:`invalidate` (called by :mod:`moeq.nn.packed` when a slot is set or its layout changes, by the modules'
``_apply`` after ``.to()``, and when the decode options change) drops it. No call re-derives it or its cache key.
"""
from __future__ import annotations

import ctypes
import dataclasses

import torch

from moeq import native
from moeq.kernels.describe import describe
from moeq.kernels.registry import kernels_for
from moeq.native import Fmt, Layers, WStack, pages

MOE_MAX_ROWS = 8  # the fused MoE kernels' rows per expert; more: dequantize + AMX bf16 matmul wins (measured)
LINEAR_MAX_ROWS = 64  # what the linear kernels accept (rows of x in chunks of 8, the weight row re-read from L1)
# Measured crossover vs dequantize + AMX bf16 matmul: the gemv costs ~linear in rows, the dequantize ~linear in
# weight size — cheap while the weight is cache-sized, memory-bound for lm_head-sized ones.
ROWS_SMALL_WEIGHT = 4
ROWS_LARGE_WEIGHT = 24
LARGE_WEIGHT = 1 << 25  # elements
# Without AMX torch's bf16 matmul is no match for the gemv at these sizes: Qwen3-30B-A3B's q_proj in Q4_0 at 8 / 16 /
# 32 rows, 0.45 / 0.89 / 1.77 ms against 1.42 / 1.76 / 2.39 ms dequantized (Zen 4, 2 threads).
ROWS_NO_AMX = 32
# An il16 weight's rows on the AMX tile unit (moeq_linear_amx): the native call takes up to 16 rows (Qwen3-30B-A3B's
# q_proj in Q4_0, 2 Sapphire Rapids threads: 0.41 ms at 8 and 16 rows against 1.8 dequantized + matmul)
TILE_ROWS = 16
_SLOTS = ("_plan_linear", "_plan_experts", "_plan_routes")


def rows_limit(w) -> int:
    """How many rows the native gemv of ``w`` takes before dequantize + matmul wins (on this CPU)."""
    if not native.has_amx():
        return ROWS_NO_AMX
    return ROWS_LARGE_WEIGHT if w.numel >= LARGE_WEIGHT else ROWS_SMALL_WEIGHT


@dataclasses.dataclass(frozen=True)
class LinearPlan:
    """A quantized linear's weight described for ``moeq_quant_linear_bf16``."""

    stack: WStack
    keep: list  # the tensors the description points into, held alive
    n: int
    k: int
    max_rows: int  # the native call's rows; more go to dequantize + matmul
    per_row: int  # scratch floats per row besides x and y
    extra: int  # scratch floats per call (NF4/FP4: the resolved block scales)

    def scratch(self, rows: int) -> torch.Tensor:
        return torch.empty(rows * (self.k + self.n + self.per_row) + self.extra + 64)


@dataclasses.dataclass(frozen=True)
class ExpertsPlan:
    """A QuantExperts' two stacks described for the fused MoE kernels, as held (row-major or il16)."""

    w13: WStack
    w2: WStack
    keep: list


@dataclasses.dataclass(frozen=True)
class ExpertsRoute:
    """Which forwards a QuantExperts runs for inputs of one dtype, decided once (:func:`experts_route`): ``decode``
    (every routed expert of a few-token step in one native call), ``fused`` (a prompt's experts with few rows in one
    native call), ``prefill`` (its experts with many rows through the native grouped GEMM); anything else runs
    per expert (dequantize + matmul)."""

    decode: bool
    fused: bool
    prefill: bool


def _cached(module, slot_name: str, key, build):
    """``build()`` once per ``key`` in the module's plan slot ``slot_name`` (until :func:`invalidate`)."""
    slot = native.plan_slot(module, slot_name)
    if slot.value is None:
        slot.value = {}
    if key not in slot.value:
        slot.value[key] = build()
    return slot.value[key]


def experts_route(module, dtype: torch.dtype) -> ExpertsRoute:
    """The :class:`ExpertsRoute` of a :class:`~moeq.nn.QuantExperts` on CPU for ``dtype`` inputs."""
    def build() -> ExpertsRoute:
        on = module.kernel == "native" and native.lib() is not None
        dot = dtype == torch.bfloat16 and native.has_simd()
        decode = on and experts_plan(module, dot) is not None
        return ExpertsRoute(decode=decode, fused=decode and experts_plan(module, dot, False) is not None,
                            prefill=on and dtype == torch.bfloat16 and _gemm_takes(experts_plan(module, True)))
    return _cached(module, "_plan_routes", dtype, build)


def _gemm_takes(plan: ExpertsPlan | None) -> bool:
    """The prompt's grouped GEMM (``moeq_moe_prefill``) takes both stacks (as planned: AVX512-BF16 builds)."""
    return plan is not None and bool(plan.w13.layers & plan.w2.layers & Layers.GEMM)


@dataclasses.dataclass(frozen=True)
class LinearRoute:
    """Which forwards a QuantLinear on CPU runs for inputs of one dtype, decided once (:func:`linear_route`):
    ``one_call`` (the whole decode linear in one native call, bf16), ``il16_prompt`` (a prompt over an il16 weight:
    dequantized natively from il16, then one matmul), ``gemv`` (the format's registered native gemv kernels, tried
    for the few-row inputs they take); everything else is dequantize + matmul."""

    one_call: bool
    il16_prompt: bool
    gemv: tuple


def linear_route(module, dtype: torch.dtype) -> LinearRoute:
    """The :class:`LinearRoute` of a :class:`~moeq.nn.QuantLinear` on CPU for ``dtype`` inputs."""
    def build() -> LinearRoute:
        on = module.kernel == "native" and native.lib() is not None
        plan = linear_plan(module) if on and dtype == torch.bfloat16 else None
        return LinearRoute(one_call=plan is not None and native.has_simd(),
                           il16_prompt=plan is not None and module.il16("weight"),
                           gemv=tuple(kernels_for(module.packed("weight", raw=True).format)) if on else ())
    return _cached(module, "_plan_routes", dtype, build)


def invalidate(module) -> None:
    """Drop the module's plans (its buffers were replaced or its decode options changed)."""
    for name in _SLOTS:
        native.plan_slot(module, name).value = None


def set_rows16(module, on: bool) -> None:
    """Give a quantized linear's plan (or take away) its decode copy by 16 rows (the native engine's head)."""
    module.__dict__["_rows16"] = bool(on)
    invalidate(module)


def linear_plan(module) -> LinearPlan | None:
    """The :class:`LinearPlan` of a :class:`~moeq.nn.QuantLinear`, or None when its weight is outside the native
    formats (or its bias is not bf16)."""
    slot = native.plan_slot(module, "_plan_linear")
    if slot.value is None:
        slot.value = (_build_linear(module),)
    return slot.value[0]


def _build_linear(module) -> LinearPlan | None:
    bias = module.bias
    act = getattr(module, "activations", "default") == "int8"
    w, keep, il16 = module.packed("weight", raw=True), [], module.il16("weight")
    stack = describe(w, keep, dot_bf16=True, act_i8=act, il16=il16) if len(w.shape) == 2 else None
    if stack is None or not (bias is None or (bias.dtype == torch.bfloat16 and native.usable(bias))):
        return None
    n, k = w.shape
    extra = n * k // stack.gs if stack.fmt == Fmt.BNB4 else 0
    if module.__dict__.get("_rows16"):
        _attach_rows16(stack, keep)
    rows = rows_limit(w)
    L = native.lib()
    if L is not None and L.moeq_linear_amx_takes(ctypes.byref(stack), TILE_ROWS):
        rows = max(rows, TILE_ROWS)  # on the tile unit up to 16 rows: 0.41 ms against 1.8 dequantized at 8-16 rows
    return LinearPlan(stack, keep, n, k, min(LINEAR_MAX_ROWS, rows), 2 * k + k // 16 + 1, extra)


def _attach_rows16(stack: WStack, keep: list) -> None:
    """Give an 8-bit symmetric weight's description a second copy of its codes interleaved by 16 output rows
    (``native/csrc/rows16.c``), in the layout of the numerics it runs (int8 activations or the default), which its
    gemv then takes 8 rows per pass: 1.2-3x the row-major kernel on a 151936x2048 Q8_0 head. Costs the weight's
    size again in memory, so moeq builds it for the output head only. Nothing is attached where the build has no
    such kernel or the weight is outside its domain."""
    L = native.lib()
    size = L.moeq_rows16_size(ctypes.byref(stack)) if L is not None else 0
    if size <= 0:
        return
    buf = pages.empty((size,), torch.uint8)  # streamed every decode step: on 2 MB pages from its first write
    layout = 2 if stack.act_i8 else 1
    if L.moeq_rows16_pack(ctypes.byref(stack), layout, buf.data_ptr()):
        stack.rows16, stack.rows16_layout = buf.data_ptr(), layout
        keep.append(buf)
        native.plan(stack)  # the rows16 kernel ranks first now


def experts_plan(module, dot: bool, act: bool | None = None) -> ExpertsPlan | None:
    """The :class:`ExpertsPlan` of a :class:`~moeq.nn.QuantExperts` for bf16 activations (``dot``: the model computes
    in bf16 on a SIMD build) or not, with int8 activations (``act``; default: the module's option); None outside the
    kernels' formats (il16 stacks only have bf16-activation kernels)."""
    act = getattr(module, "activations", "default") == "int8" if act is None else act

    def build() -> ExpertsPlan | None:
        keep: list = []
        stacks = [describe(module.packed(s, raw=True), keep, dot, act, il16=module.il16(s)) for s in ("w13", "w2")]
        ok = None not in stacks and not any(st.il16 and not st.dot_bf16 for st in stacks)
        return ExpertsPlan(stacks[0], stacks[1], keep) if ok else None
    return _cached(module, "_plan_experts", (dot, act), build)


__all__ = ["LinearPlan", "ExpertsPlan", "ExpertsRoute", "LinearRoute", "linear_plan", "experts_plan", "linear_route",
           "experts_route", "invalidate", "set_rows16", "rows_limit", "LINEAR_MAX_ROWS", "MOE_MAX_ROWS"]
