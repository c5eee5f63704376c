"""Native small-batch (decode) matmuls for the packed formats, registered with :mod:`moeq.kernels`.

Each declines (returns None) outside its domain (non-CPU tensors, more rows than pay off — see ``_rows`` —,
unsupported layouts), leaving the reference path: dequantize (natively, fast) + ``F.linear`` (AMX bf16 for many rows)."""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from moeq.formats import Bnb4Weight, Fp8Weight, Int8Weight, Iq2sWeight, RTNWeight, iq2s
from moeq.formats.rtn import CODEBOOKS, NATIVE_SCALE_DTYPES
from moeq import native
from moeq.kernels.registry import register
from moeq.kernels.describe import codebook_of, codebook_tables
from moeq.kernels.moe_cpu import il16_dequant
from moeq.kernels.plans import LINEAR_MAX_ROWS as MAX_ROWS
from moeq.kernels.plans import linear_plan, rows_limit

def _rows(w, x: torch.Tensor, limit: int | None):
    k = w.shape[-1]
    if x.device.type != "cpu" or len(w.shape) != 2 or x.shape[-1] != k:
        return None
    m = x.numel() // k
    return m if 0 < m <= min(MAX_ROWS, rows_limit(w) if limit is None else limit) else None


def _finish(y: torch.Tensor, x: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], n)


def _perm64(x2d: torch.Tensor) -> torch.Tensor:
    """bf16 rows as the AVX512-BF16 4-bit kernels read them: each 64-chunk as (even elements, odd elements)."""
    m, k = x2d.shape
    return x2d.view(m, k // 64, 32, 2).transpose(-1, -2).contiguous()


def _even_odd(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return xf[:, 0::2].contiguous(), xf[:, 1::2].contiguous()


@register("rtn")
def rtn_gemv(w: RTNWeight, x: torch.Tensor, bias: torch.Tensor | None,
             max_rows: int | None = None) -> torch.Tensor | None:
    m = _rows(w, x, max_rows)
    L = native.lib()
    if m is None or L is None or w.scale.dtype not in NATIVE_SCALE_DTYPES:
        return None
    if w.bits not in (4, 5, 8) and w.grid not in CODEBOOKS:  # 2/3-bit RTN: dequantize + matmul
        return None
    if not native.usable(w.qdata, w.scale, w.zero, w.scale_super):
        return None
    n, k = w.shape
    gs = k if w.group_size == -1 else w.group_size
    native.fits((w.qdata, n * k * w.bits // 8), (w.scale, n * (k // gs) * w.scale.element_size()), (w.zero, n * (k // gs)),
                (w.scale_super, n * 2))
    table = codebook_of(w, gs)
    if table is not None:
        return _codebook_gemv(L, table, w, x, m, n, k, gs, bias)
    if w.scale_super is not None:  # int8 scale codes: only the codebook kernels read them
        return None
    if w.bits == 5:
        return None
    if x.dtype == torch.bfloat16 and gs % 32 == 0 and native.has_dpbf16():  # AVX512-BF16 dot products
        xb = x.reshape(m, k).contiguous()
        y = torch.empty(m, n, dtype=torch.float32)
        if w.bits == 8:
            if not L.moeq_rtn8_gemv_bf16(native.ptr(xb), native.i64(m), native.ptr(w.qdata), native.ptr(w.scale),
                                         int(w.scale.dtype == torch.bfloat16), native.ptr(w.zero), native.i64(n),
                                         native.i64(k), native.i64(gs), native.ptr(y)):
                return None
            return _finish(y, x, n, bias)
        xsum = xb.float().view(m, k // gs, gs).sum(-1).contiguous()
        p64 = gs % 64 == 0
        xb = _perm64(xb) if p64 else xb
        L.moeq_rtn4_gemv_bf16(native.ptr(xb), native.ptr(xsum), native.i64(m), native.ptr(w.qdata), native.ptr(w.scale),
                              int(w.scale.dtype == torch.bfloat16), native.ptr(w.zero), native.i64(n), native.i64(k),
                              native.i64(gs), native.ptr(y), int(p64))
        return _finish(y, x, n, bias)
    xf = x.reshape(m, k).float().contiguous()
    xsum = xf.view(m, k // gs, gs).sum(-1).contiguous()
    xe, xo = _even_odd(xf) if w.bits == 4 else (xf, None)
    y = torch.empty(m, n, dtype=torch.float32)
    L.moeq_rtn_gemv(native.ptr(xe), native.ptr(xo), native.ptr(xsum), native.i64(m), native.ptr(w.qdata), native.ptr(w.scale),
                    int(w.scale.dtype == torch.bfloat16), native.ptr(w.zero), w.bits, native.i64(n), native.i64(k), native.i64(gs),
                    native.ptr(y))
    return _finish(y, x, n, bias)


def _codebook_gemv(L, table: str, w: RTNWeight, x: torch.Tensor, m: int, n: int, k: int, gs: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """Codebook grids (value = scale * table[code]): AVX512-BF16 dot products on bf16 activations in 64-chunks
    (gs 16, 32 or a multiple of 64), else the fp32 kernel."""
    values, lut = codebook_tables(table)
    y = torch.empty(m, n, dtype=torch.float32)
    sb, sup = w.scale_kind, native.ptr(w.scale_super)
    if x.dtype == torch.bfloat16 and k % 64 == 0 and (gs in (16, 32) or gs % 64 == 0) and native.has_dpbf16():
        xb = _perm64(x.reshape(m, k).contiguous())
        if L.moeq_cb4_gemv_bf16(native.ptr(xb), native.i64(m), native.ptr(w.qdata), native.ptr(w.scale), sb, sup,
                                native.ptr(lut), native.i64(n), native.i64(k), native.i64(gs), w.bits, native.ptr(y)):
            return _finish(y, x, n, bias)
    xf = x.reshape(m, k).float().contiguous()
    L.moeq_cb4_gemv(native.ptr(xf), native.i64(m), native.ptr(w.qdata), native.ptr(w.scale), sb, sup, native.ptr(values),
                    native.i64(n), native.i64(k), native.i64(gs), w.bits, native.ptr(y))
    return _finish(y, x, n, bias)


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the many-row matmuls of a ``dtype`` model run in: fp32 for bf16 on CPUs without native bf16 GEMM
    (:func:`moeq.native.fast_bf16_matmul`), else ``dtype``."""
    slow = dtype == torch.bfloat16 and device.type == "cpu" and not native.fast_bf16_matmul()
    return torch.float32 if slow else dtype


def il16_linear(module, x: torch.Tensor) -> torch.Tensor | None:
    """A :class:`~moeq.nn.QuantLinear` held in the il16 decode layout at more rows than its decode kernels take (a
    prompt): the weight dequantized natively from il16 (the row-major dequantizers' values), then one matmul as
    :func:`moeq.kernels.reference` computes it. None for non-bf16 activations (the caller takes the row-major
    weight)."""
    plan = linear_plan(module)
    if plan is None or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    bias, cd = module.bias, matmul_dtype(x.dtype, x.device)
    wd = il16_dequant(plan.stack, 0, cd)
    if cd != x.dtype:
        return F.linear(x.to(cd), wd, None if bias is None else bias.to(cd)).to(x.dtype)
    return F.linear(x, wd, bias)


def quant_linear_bf16(module, x: torch.Tensor) -> torch.Tensor | None:
    """A :class:`~moeq.nn.QuantLinear`'s decode path for bf16 activations (RTN 4/8-bit, codebook grids, NF4/FP4):
    the whole linear (activation layout, gemv, rounding, bias) in one native call, or None outside its domain. With
    AVX512-BF16 the kernels take the activations as bf16; with AVX2 as int16 per 32 elements (RTN, codebooks; exact
    for bf16 values within 2^7 of their chunk's largest) or fp32 (NF4/FP4)."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or not native.has_simd():
        return None
    plan = linear_plan(module)
    if plan is None or x.shape[-1] != plan.k:
        return None
    m = x.numel() // plan.k
    if not 0 < m <= plan.max_rows:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(*x.shape[:-1], plan.n, dtype=torch.bfloat16)
    scratch = plan.scratch(m)
    native.lib().moeq_quant_linear_bf16(ctypes.byref(plan.stack), native.ptr(x), native.i64(m), native.ptr(module.bias),
                                        native.ptr(y), native.ptr(scratch))
    return y


@register("bnb4")
def bnb4_gemv(w: Bnb4Weight, x: torch.Tensor, bias: torch.Tensor | None,
              max_rows: int | None = None) -> torch.Tensor | None:
    m = _rows(w, x, max_rows)
    L = native.lib()
    if m is None or L is None or w.shape[-1] % w.blocksize or (w.numel // w.slices) % w.blocksize:
        return None
    n, k = w.shape
    absmax = w.resolved_absmax().contiguous()
    code = w.code.float().contiguous()
    if not native.usable(w.packed, absmax):
        return None
    native.fits((w.packed, n * k // 2), (absmax, n * k // w.blocksize * 4), (code, 64))
    y = torch.empty(m, n, dtype=torch.float32)
    if x.dtype == torch.bfloat16 and w.blocksize % 64 == 0 and native.has_dpbf16():
        xb = _perm64(x.reshape(m, k))
        L.moeq_bnb4_gemv_bf16(native.ptr(xb), native.i64(m), native.ptr(w.packed), native.ptr(absmax), native.ptr(code),
                              native.i64(n), native.i64(k), native.i64(w.blocksize), native.ptr(y))
        return _finish(y, x, n, bias)
    xe, xo = _even_odd(x.reshape(m, k).float())
    L.moeq_bnb4_gemv(native.ptr(xe), native.ptr(xo), native.i64(m), native.ptr(w.packed), native.ptr(absmax), native.ptr(code),
                     native.i64(n), native.i64(k), native.i64(w.blocksize), native.ptr(y))
    return _finish(y, x, n, bias)


@register("int8")
def int8_gemv(w: Int8Weight, x: torch.Tensor, bias: torch.Tensor | None,
              max_rows: int | None = None) -> torch.Tensor | None:
    m = _rows(w, x, max_rows)
    L = native.lib()
    if m is None or L is None or not native.usable(w.weight, w.scb):
        return None
    n, k = w.shape
    native.fits((w.weight, n * k), (w.scb, n * 4))
    xf = x.reshape(m, k).float().contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    L.moeq_int8_gemv(native.ptr(xf), native.i64(m), native.ptr(w.weight), native.ptr(w.scb), native.i64(n), native.i64(k), native.ptr(y))
    return _finish(y, x, n, bias)


@register("fp8")
def fp8_gemv(w: Fp8Weight, x: torch.Tensor, bias: torch.Tensor | None,
             max_rows: int | None = None) -> torch.Tensor | None:
    m = _rows(w, x, max_rows)
    L = native.lib()
    if m is None or L is None or not native.usable(w.qdata, w.scale):
        return None
    n, k = w.shape
    native.fits((w.qdata, n * k), (w.scale, w.scale.numel() * 4))
    if w.scale.numel() != -(-n // w.block[0]) * -(-k // w.block[1]):
        return None
    y = torch.empty(m, n, dtype=torch.float32)
    args = (native.ptr(w.qdata), native.ptr(w.scale), native.i64(n), native.i64(k), native.i64(w.block[0]),
            native.i64(w.block[1]), native.ptr(y))
    if x.dtype == torch.bfloat16:  # bf16 activations (exact): the AVX512-BF16 kernel where the build has it
        xb = x.reshape(m, k).contiguous()
        if L.moeq_fp8_gemv_bf16(native.ptr(xb), native.i64(m), *args):
            return _finish(y, x, n, bias)
    xf = x.reshape(m, k).float().contiguous()
    L.moeq_fp8_gemv(native.ptr(xf), native.i64(m), *args)
    return _finish(y, x, n, bias)


@register("iq2s")
def iq2s_gemv(w: Iq2sWeight, x: torch.Tensor, bias: torch.Tensor | None,
              max_rows: int | None = None) -> torch.Tensor | None:
    """IQ2_S rows: int8 activations per 256 against the grid bytes (AVX512-VNNI), fp32 elsewhere."""
    m = _rows(w, x, max_rows)
    L = native.lib()
    if m is None or L is None or not native.usable(w.blocks):
        return None
    n, k = w.shape
    native.fits((w.blocks, n * (k // iq2s.QK) * iq2s.BLOCK_BYTES))
    xf = x.reshape(m, k).float().contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    if not L.moeq_iq2s_gemv(native.ptr(xf), native.i64(m), native.ptr(w.blocks), native.i64(n), native.i64(k),
                            native.ptr(iq2s.GRID), native.ptr(y)):
        return None
    return _finish(y, x, n, bias)
