"""Fused decode path for a whole MoE layer on CPU: one native call runs every routed expert (see
``moeq_moe_forward`` in cpu_kernels.c). Declines (returns None) outside its domain, leaving the per-expert path."""
from __future__ import annotations

import ctypes

import torch

from moeq.formats import Bnb4Weight, PackedWeight, RTNWeight
from moeq.kernels import cpu

MAX_ROWS = 8  # more rows per expert: dequantize + AMX bf16 matmul wins (measured)


class WStack(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int), ("dot_bf16", ctypes.c_int), ("q", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("scale_bf16", ctypes.c_int), ("zero", ctypes.c_void_p),
                ("bits", ctypes.c_int), ("gs", ctypes.c_int64), ("code", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("nested_absmax", ctypes.c_void_p), ("nested_code", ctypes.c_void_p), ("spe", ctypes.c_int64),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64)]


def _stack(w: PackedWeight, keep: list, dot_bf16: bool = False) -> WStack | None:
    """Describe an expert stack ``[E, N, K]`` for the kernel (``keep`` holds the tensors alive). ``dot_bf16``: the
    model computes in bf16, so 4-bit RTN and NF4/FP4 may take activations as bf16 (AVX512-BF16 dot products)."""
    e, n, k = w.shape
    if isinstance(w, RTNWeight):
        gs = k if w.group_size == -1 else w.group_size
        if w.bits not in (4, 8) or gs % 32 or w.scale.dtype not in (torch.bfloat16, torch.float32):
            return None
        if not cpu.usable(w.qdata, w.scale, w.zero):
            return None
        keep += [w.qdata, w.scale, w.zero]
        return WStack(0, int(dot_bf16 and w.bits == 4), w.qdata.data_ptr(), w.scale.data_ptr(),
                      int(w.scale.dtype == torch.bfloat16),
                      0 if w.zero is None else w.zero.data_ptr(), w.bits, gs, None, None, None, None, 1, n, k)
    if isinstance(w, Bnb4Weight):
        spe = w.slices // e if w.slices % e == 0 else 0
        if spe == 0 or k % w.blocksize or w.blocksize % 32 or (n * k // spe) % w.blocksize:
            return None
        code = w.code.float().contiguous()
        tensors = [w.packed, w.absmax, code, w.offset, w.nested_absmax, w.nested_code]
        if not cpu.usable(*tensors):
            return None
        keep += tensors
        dq = w.offset is not None
        return WStack(1, int(dot_bf16 and w.blocksize % 64 == 0), w.packed.data_ptr(), w.absmax.data_ptr(), int(dq),
                      None, 4, w.blocksize, code.data_ptr(),
                      w.offset.data_ptr() if dq else None, w.nested_absmax.data_ptr() if dq else None,
                      w.nested_code.data_ptr() if dq else None, spe, n, k)
    return None


def moe_forward(w13: PackedWeight, w2: PackedWeight, x: torch.Tensor, token_of: torch.Tensor,
                weight_of: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
    """``sum_pairs weight * w2[e] @ silu-glu(w13[e] @ x[token])`` for pairs grouped by expert, or None."""
    L = cpu.lib()
    if L is None or x.device.type != "cpu" or max(counts) > MAX_ROWS:
        return None
    keep: list = []
    dot = x.dtype == torch.bfloat16 and cpu.has_dpbf16()
    s13, s2 = _stack(w13, keep, dot), _stack(w2, keep, dot)
    if s13 is None or s2 is None:
        return None
    e, two_i, h = w13.shape
    i = two_i // 2
    xf = x.float().contiguous()
    starts = torch.zeros(e + 1, dtype=torch.int64)
    starts[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    tok = token_of.to(torch.int64).contiguous()
    wts = weight_of.float().contiguous()
    out = torch.zeros_like(xf)
    if s13.fmt == s2.fmt == 0 and s13.dot_bf16 and s2.dot_bf16:  # 4-bit RTN, bf16 x: parallel across experts
        active = sum(1 for c in counts if c)
        scratch = torch.empty(active * 8 * (h // 2 + h // 16 + 2 * i + i // 2 + i // 16 + h) + 64)
        L.moeq_moe_forward_rtn4_bf16(ctypes.byref(s13), ctypes.byref(s2), cpu.ptr(xf), cpu.i64(h), cpu.i64(i),
                                     cpu.ptr(tok), cpu.ptr(wts), cpu.ptr(starts), cpu.i64(e), cpu.ptr(out),
                                     cpu.ptr(scratch))
        return out.to(x.dtype)
    kmax, nmax = max(h, i), max(two_i, h)
    scratch = torch.empty(8 * h * 2 + 8 * 3 * i + 2 * 8 * kmax + 8 * (kmax // 16 + 1) + nmax * kmax // 32 + 64)
    L.moeq_moe_forward(ctypes.byref(s13), ctypes.byref(s2), cpu.ptr(xf), cpu.i64(h), cpu.i64(i), cpu.ptr(tok),
                       cpu.ptr(wts), cpu.ptr(starts), cpu.i64(e), cpu.ptr(out), cpu.ptr(scratch))
    return out.to(x.dtype)
