"""bf12: a bf16 weight ``[N, K]`` held losslessly in 12 bits per weight — an in-memory layout of kept bf16 linears
(the lm_head), never saved: state dicts and exports see the bf16 weight it unpacks to, bit for bit.

A bf16 value is two bytes, ``hi = sign << 7 | exponent >> 1`` and ``lo = (exponent & 1) << 7 | mantissa``. ``lo``
is kept whole. Per row, ``base = max(0, max(hi & 0x7f) - 7)``; a weight whose ``e = hi & 0x7f`` is in
``base+1 .. base+7`` (or any ``e`` when ``base == 0``) keeps the nibble ``sign << 3 | (e - base)``, code 0 meaning
``hi = sign << 7`` (zeros). Every other weight — more than ~2^13 below its row's largest, or subnormal; 0.03% of a
151936 x 2048 head — is stored as a signed zero and listed as an exception (column, exact value), added after the
row's sum. Where the bytes sit (per 128-column unit, the order one byte unpack puts in natural column order) is
documented in ``moeq/native/csrc/bf12.c``; :func:`positions` is that order.

:func:`pack_reference` / :func:`unpack_reference` are the plain-torch definition the native pack, unpack and gemv
are tested against; :func:`pack` / :func:`unpack` take the native ones when the library is built.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from moeq import native
from moeq.errors import MoeqError
from moeq.native import pages

UNIT = 128  # columns per unit: K must be a multiple
_CHUNK = 8192  # rows per chunk of the torch reference (bounds its int32 temporaries)


class Bf12(NamedTuple):
    """The packed arrays (``moeq_bf12`` in ``moeq.h``): lo uint8 [N, K], hi uint8 [N, K/2], base uint8 [N],
    xptr int32 [N+1], xcol int32 [X], xval bf16 [X]."""
    lo: torch.Tensor
    hi: torch.Tensor
    base: torch.Tensor
    xptr: torch.Tensor
    xcol: torch.Tensor
    xval: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.lo.shape[0], self.lo.shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)

    def describe(self) -> native.Bf12:
        """The ctypes struct native calls take (the tensors must outlive it)."""
        n, k = self.shape
        return native.Bf12(lo=self.lo.data_ptr(), hi=self.hi.data_ptr(), base=self.base.data_ptr(),
                           xptr=self.xptr.data_ptr(), xcol=self.xcol.data_ptr(), xval=self.xval.data_ptr(), N=n, K=k)


def positions() -> torch.Tensor:
    """``[128]`` int64: the lo-byte offset of each column of a unit (halves of 64; within a half, per 128-bit lane
    the columns of its low 8 bytes come from the first 32, those of its high 8 bytes from the last 32)."""
    c = torch.arange(UNIT)
    d = c % 64
    lane = torch.where(d < 32, d // 8, (d - 32) // 8)
    return (c // 64) * 64 + lane * 16 + torch.where(d < 32, 0, 8) + d % 8


def check(w: torch.Tensor) -> None:
    if w.dtype != torch.bfloat16 or w.dim() != 2 or w.shape[1] % UNIT or w.device.type != "cpu":
        raise MoeqError(f"bf12 packs a 2-D CPU bf16 weight with a multiple of {UNIT} columns, got "
                        f"{tuple(w.shape)} {w.dtype} on {w.device.type}")


def _fields(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bits as int32, e = hi & 0x7f, sign, base per row) of a bf16 block."""
    bits = w.view(torch.int16).to(torch.int32) & 0xFFFF
    e = (bits >> 8) & 0x7F
    base = (e.amax(dim=1, keepdim=True) - 7).clamp(min=0)
    return bits, e, bits >> 15, base


def pack_reference(w: torch.Tensor) -> Bf12:
    """Plain torch: the definition."""
    check(w)
    n, k = w.shape
    lo = torch.empty(n, k, dtype=torch.uint8)
    hi = torch.empty(n, k // 2, dtype=torch.uint8)
    base = torch.empty(n, dtype=torch.uint8)
    counts, cols, vals = [], [], []
    dest = (torch.arange(k // UNIT)[:, None] * UNIT + positions()[None]).reshape(-1)  # column -> lo offset
    for r0 in range(0, n, _CHUNK):
        bits, e, sign, b = _fields(w[r0:r0 + _CHUNK].contiguous())
        rows = bits.shape[0]
        exc = (b > 0) & (e <= b) & ((bits & 0x7FFF) != 0)
        keep = ~exc & ((e > b) | (b == 0))
        code = torch.where(keep, e - b, 0)
        low = torch.where(keep, bits & 0xFF, 0)
        nib = (sign << 3) | code
        lo_rows = torch.empty(rows, k, dtype=torch.int32)
        lo_rows[:, dest] = low
        nib_rows = torch.empty(rows, k, dtype=torch.int32)
        nib_rows[:, dest] = nib
        units = nib_rows.view(rows, k // UNIT, 2, 64)
        lo[r0:r0 + rows] = lo_rows.to(torch.uint8)
        hi[r0:r0 + rows] = (units[:, :, 0] | (units[:, :, 1] << 4)).reshape(rows, k // 2).to(torch.uint8)
        base[r0:r0 + rows] = b[:, 0].to(torch.uint8)
        counts.append(exc.sum(dim=1))
        r, c = exc.nonzero(as_tuple=True)  # row-major: each row's columns ascending
        cols.append(c.to(torch.int32))
        vals.append(w[r0:r0 + _CHUNK][r, c])
    xptr = torch.zeros(n + 1, dtype=torch.int32)
    xptr[1:] = torch.cat(counts).cumsum(0).to(torch.int32) if counts else 0
    return Bf12(lo, hi, base, xptr, torch.cat(cols) if cols else torch.zeros(0, dtype=torch.int32),
                torch.cat(vals) if vals else torch.zeros(0, dtype=torch.bfloat16))


def unpack_reference(p: Bf12) -> torch.Tensor:
    """Plain torch: the bf16 weight ``[N, K]``, exactly."""
    n, k = p.shape
    dev = p.lo.device
    src = (torch.arange(k // UNIT, device=dev)[:, None] * UNIT + positions().to(dev)[None]).reshape(-1)
    nib = torch.stack([p.hi.to(torch.int32) & 15, p.hi.to(torch.int32) >> 4], dim=2)  # [N, K/2, 2]: half 0, half 1
    nib = nib.view(n, k // UNIT, 64, 2).transpose(2, 3).reshape(n, k)[:, src]
    code = nib & 7
    hib = ((nib >> 3) << 7) | torch.where(code > 0, code + p.base.to(torch.int32)[:, None], 0)
    bits = (hib << 8) | p.lo.to(torch.int32)[:, src]
    out = bits.to(torch.int16).view(torch.bfloat16).clone()
    rows = torch.repeat_interleave(torch.arange(n, device=dev), (p.xptr[1:] - p.xptr[:-1]).long())
    out[rows, p.xcol.long()] = p.xval
    return out


def pack(w: torch.Tensor, max_bytes: int | None = None) -> Bf12 | None:
    """:func:`pack_reference`, natively when the library is built (two passes: codes and counts, then exceptions).
    None when the result would exceed ``max_bytes`` or 2^31 - 1 exceptions — decided from the first pass's counts,
    before the exception lists are allocated (a weight of outliers could otherwise list ~all of its values, at 6
    bytes each)."""
    check(w)
    L = native.lib()
    if L is None:
        p = pack_reference(w)
        return p if max_bytes is None or p.nbytes() <= max_bytes else None
    w = w.contiguous()
    n, k = w.shape
    lo = pages.empty((n, k), torch.uint8)  # a head's 12 bits per weight: streamed every step, so on 2 MB pages
    hi = pages.empty((n, k // 2), torch.uint8)
    base = torch.empty(n, dtype=torch.uint8)
    counts = torch.empty(n, dtype=torch.int32)
    L.moeq_bf12_pack(w.data_ptr(), n, k, lo.data_ptr(), hi.data_ptr(), base.data_ptr(), counts.data_ptr())
    total = int(counts.sum(dtype=torch.int64))
    size = lo.numel() + hi.numel() + base.numel() + 4 * (n + 1) + 6 * total
    if total >= 2 ** 31 or (max_bytes is not None and size > max_bytes):
        return None
    xptr = torch.zeros(n + 1, dtype=torch.int32)
    xptr[1:] = counts.cumsum(0)
    xcol = torch.empty(total, dtype=torch.int32)
    xval = torch.empty(total, dtype=torch.bfloat16)
    L.moeq_bf12_exceptions(w.data_ptr(), n, k, base.data_ptr(), xptr.data_ptr(), xcol.data_ptr(), xval.data_ptr())
    return Bf12(lo, hi, base, xptr, xcol, xval)


def unpack(p: Bf12, rows: slice | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 weight (or ``rows`` of it, a step-1 slice), natively when the library is built; into ``out`` (a
    contiguous bf16 ``[rows, K]``) when given."""
    n, k = p.shape
    n0, n1, _ = (rows or slice(None)).indices(n)
    shape = (max(n1 - n0, 0), k)
    if out is not None and (tuple(out.shape) != shape or out.dtype != torch.bfloat16 or not out.is_contiguous()):
        raise MoeqError(f"bf12.unpack: out must be a contiguous bf16 tensor of shape {shape}")
    L = native.lib()
    if L is None:
        w = unpack_reference(p)[n0:n1]
        return w if out is None else out.copy_(w)
    out = torch.empty(shape, dtype=torch.bfloat16) if out is None else out
    if n1 > n0:
        L.moeq_bf12_unpack(p.describe(), n0, n1, out.data_ptr())
    return out
