"""Fused decode path for a whole MoE layer on CPU: one native call runs every routed expert (see
``moeq_moe_forward`` in moeq/native/csrc/moe.c). Declines (returns None) outside its domain, leaving the per-expert path."""
from __future__ import annotations

import ctypes

import torch

from moeq import native
from moeq.kernels.plans import MOE_MAX_ROWS, experts_plan
from moeq.native import Layers, WStack

MAX_ROWS = MOE_MAX_ROWS  # more rows per expert: dequantize + AMX bf16 matmul wins (measured)


def moe_forward(module, x: torch.Tensor, token_of: torch.Tensor, weight_of: torch.Tensor,
                counts: list[int]) -> torch.Tensor | None:
    """``sum_pairs weight * w2[e] @ silu-glu(w13[e] @ x[token])`` for a :class:`~moeq.nn.QuantExperts`' pairs grouped
    by expert (the default activations: a prompt's experts with few rows), or None."""
    L = native.lib()
    if L is None or x.device.type != "cpu" or max(counts) > MAX_ROWS:
        return None
    dot = x.dtype == torch.bfloat16 and native.has_simd()
    plan = experts_plan(module, dot, act=False)
    if plan is None:
        return None
    s13, s2 = plan.w13, plan.w2
    w13 = module.packed("w13", raw=True)
    e, two_i, h = w13.shape
    i = two_i // 2
    xf = x.float().contiguous()
    starts, tok, wts = _grouped(token_of, weight_of, counts)
    out = torch.zeros_like(xf)
    if _expert_parallel(s13, s2):
        scratch = _scratch(s13, s2, sum(1 for c in counts if c))
        L.moeq_moe_forward_rtn4_bf16(ctypes.byref(s13), ctypes.byref(s2), native.ptr(xf), native.i64(h), native.i64(i),
                                     native.ptr(tok), native.ptr(wts), native.ptr(starts), native.i64(e), native.ptr(out),
                                     native.ptr(scratch))
        return out.to(x.dtype)
    scratch = _scratch(s13, s2, 0)
    L.moeq_moe_forward(ctypes.byref(s13), ctypes.byref(s2), native.ptr(xf), native.i64(h), native.i64(i), native.ptr(tok),
                       native.ptr(wts), native.ptr(starts), native.i64(e), native.ptr(out), native.ptr(scratch))
    return out.to(x.dtype)


def _grouped(token_of: torch.Tensor, weight_of: torch.Tensor,
             counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert as the native layer kernels take them: each expert's first pair (``[E + 1]``, int64),
    the pairs' tokens (int64) and weights (fp32)."""
    starts = torch.zeros(len(counts) + 1, dtype=torch.int64)
    starts[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    return starts, token_of.to(torch.int64).contiguous(), weight_of.float().contiguous()


def _expert_parallel(s13: WStack, s2: WStack) -> bool:
    """4-bit RTN and codebook experts with bf16 activations (AVX512-BF16 or AVX2): the layer kernel parallel across
    experts."""
    return bool(s13.layers & s2.layers & Layers.EXPERTS)


def _scratch(s13: WStack, s2: WStack, active: int) -> torch.Tensor:
    h, i = s13.K, s2.K
    if _expert_parallel(s13, s2):
        return torch.empty(active * 8 * (h // 2 + h // 16 + 2 * i + i // 2 + i // 16 + h) + 64)
    kmax, nmax = max(h, i), max(2 * i, h)
    return torch.empty(8 * h * 2 + 8 * 3 * i + 2 * 8 * kmax + 8 * (kmax // 16 + 1) + nmax * kmax // 32 + 64)


def moe_routed(module, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor | None:
    """A decode step's whole MoE layer from the router's output ``top_k_index/top_k_weights [T, A]`` in one native
    call (pairs grouped by expert inside), or None when outside the kernel's domain (then the caller groups the pairs
    itself and takes :func:`moe_forward` or the per-expert path)."""
    L = native.lib()
    t, a = top_k_index.shape
    if L is None or x.device.type != "cpu" or t > MAX_ROWS:
        return None
    plan = experts_plan(module, x.dtype == torch.bfloat16 and native.has_simd())
    if plan is None:
        return None
    s13, s2 = plan.w13, plan.w2
    xf = x.float().contiguous()
    idx = top_k_index.to(torch.int64).contiguous()
    wts = top_k_weights.float().contiguous()
    out = torch.zeros_like(xf)
    scratch = _scratch(s13, s2, min(module.num_experts, t * a))
    if L.moeq_moe_routed(ctypes.byref(s13), ctypes.byref(s2), native.ptr(xf), native.i64(s13.K), native.i64(s2.K),
                         native.ptr(idx), native.ptr(wts), native.i64(t), native.i64(a), native.i64(module.num_experts),
                         native.ptr(out), native.ptr(scratch)):
        return None
    return out.to(x.dtype)


def moe_prefill(module, x: torch.Tensor, token_of: torch.Tensor, weight_of: torch.Tensor,
                counts: list[int]) -> torch.Tensor | None:
    """Experts with many rows each (a prompt) through ``moeq_moe_prefill`` (``native/csrc/gemm.c``): per expert a
    grouped GEMM from the packed codes — 16 dequantized rows at a time, the tokens in the vector lanes — and the
    SiLU-GLU and weighted sum in fp32. Returns the fp32 ``[T, H]`` sum over the given pairs (grouped by expert,
    ``counts`` per expert), or None outside its domain (no AVX512-BF16, bf16 activations only, RTN 4/8-bit and
    codebook grids), leaving dequantize + matmul per expert."""
    L = native.lib()
    if L is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or not native.has_dpbf16():
        return None
    plan = experts_plan(module, True)
    if plan is None:
        return None
    s13, s2 = plan.w13, plan.w2
    t, h = x.shape
    xb = x.contiguous()
    starts, tok, wts = _grouped(token_of, weight_of, counts)
    out = torch.zeros(t, h, dtype=torch.float32)
    rc = L.moeq_moe_prefill(ctypes.byref(s13), ctypes.byref(s2), native.ptr(xb), native.i64(t), native.i64(h),
                            native.i64(s2.K), native.ptr(tok), native.ptr(wts), native.ptr(starts),
                            native.i64(len(counts)), native.ptr(out))
    if rc == -1:
        raise MemoryError("moeq_moe_prefill: could not allocate its scratch")
    return out if rc == 1 else None


def held_stacks(module) -> tuple[WStack, WStack] | None:
    """A QuantExperts' two stacks described as held (row-major or il16) for the bf16 kernels, default activations."""
    plan = experts_plan(module, True, act=False)
    return None if plan is None else (plan.w13, plan.w2)


def il16_dequant(stack: WStack, e: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Expert ``e`` of an il16 stack (described as held) dequantized natively into a row-major ``[N, K]`` tensor of
    ``dtype`` (``out``: a contiguous buffer with room for it, reused across experts): the row-major dequantizers'
    values. The kernel writes bf16 or fp32; any other ``dtype`` (fp16 models) is dequantized to fp32 and cast (exact:
    the values are fp32 products), so no buffer is ever written in an element size it was not allocated for."""
    if e < 0 or e >= max(1, stack_experts(stack)):
        raise IndexError(f"il16_dequant: expert {e} out of range")
    n = stack.N * stack.K
    native_dtype = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    if out is None or out.dtype != native_dtype or out.numel() < n or not out.is_contiguous():
        out = torch.empty(n, dtype=native_dtype)
    native.fits_out(out, native_dtype, n)
    out = out.view(-1)[:n].view(stack.N, stack.K)
    rc = native.lib().moeq_il16_dequant(ctypes.byref(stack), native.i64(e), native.ptr(out),
                                        int(native_dtype == torch.bfloat16))
    if rc == -1:
        raise MemoryError("moeq_il16_dequant: could not allocate its scratch")
    if rc != 1:
        raise RuntimeError("moeq_il16_dequant declined an il16 stack")
    return out if native_dtype == dtype else out.to(dtype)


def stack_experts(stack: WStack) -> int:
    """How many experts a described stack holds (0 when unknown: a described single weight)."""
    return int(getattr(stack, "_experts", 0))
