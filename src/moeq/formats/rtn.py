"""Round-to-nearest group-wise integer quantization (vLLM's RTN layout and math, plus better grids).

Groups are consecutive runs of ``group_size`` values along the last (input) dim; leading dims are rows/experts.

Storage (same for every grid, so the same kernels serve all of them):
- ``qdata`` uint8 ``[..., N, packed_size(K)]``: codes packed by :mod:`moeq.formats.packing`
  (4-bit: even index in the LOW nibble, exactly vLLM's ``rtn_quantize`` bytes).
- ``scale`` ``[..., N, K // group_size]`` in the weight's dtype.
- ``zero`` uint8 ``[..., N, K // group_size]`` for asymmetric grids, else None (implicit ``2**(bits-1)``).
Dequantization: ``(q - zero) * scale``.

Grids:
- ``"vllm"`` (symmetric default): ``scale = absmax*2/(2**b-1)`` computed in the weight's dtype, exactly as vLLM.
  It reconstructs a group's positive max at ~0.933*absmax (4-bit) and never uses code 0.
- ``"signed"`` (symmetric): ``scale = -signed_absmax / 2**(b-1)``; the largest-magnitude value lands exactly on code 0
  and the step is 2**(b-1)/(2**b-1)*2 = ~6% finer at 4 bits. Same storage; the scale may be negative.
- ``"iq4nl"`` (4-bit, symmetric): a non-uniform codebook, value = ``scale * IQ4NL[q]`` (llama.cpp's IQ4_NL values,
  -127..113), no zero point; the GGUF export writes IQ4_NL blocks from it losslessly at group 32.
- ``"nl3"`` (3-bit, symmetric): the same with every other IQ4_NL value (-127, -83, -49, -22, 1, 25, 53, 89), codes
  packed eight per 24-bit word; moeq's 3-bit format (at group 16 with double-quantized scales: 3.5 + 16/K bits).
- asymmetric (``symmetric=False``): min/max (widened to include 0) over ``2**b-1`` steps with an integer zero point.

Double-quantized scales (``double_quant=True``, codebook grids): ``scale`` holds int8 codes and ``scale_super``
``[..., N]`` one bf16 factor per row, group scale = ``code * scale_super`` (the row's largest |scale| / 127 rounded to
bf16, codes rounded to nearest; the search's codes are then re-rounded to the stored scales): 8 bits per group
instead of 16 — 4.25 + 16/K bits per weight at group 32, where ``iq4nl`` at group 64 (4.25) loses a third of its
accuracy.

Importance-weighted scale search (``search > 0`` on the ``signed`` grid, always on ``iq4nl`` and ``nl3``; native, see
``moeq_cb4_search``): per group, the scale minimizing ``sum w (x - d v[q])^2`` over candidate scales, with per-weight
importance ``w`` from the weights alone (``x^2``, llama.cpp's choice without an importance matrix; ``row``:
``sigma^2 + x^2``; ``mse``: 1). Its scales are exact in both bf16 and fp16 (lossless GGUF export, bf16 kernels).
"""
from __future__ import annotations

import dataclasses

import torch

from moeq.formats.base import (
    PackedWeight, bad_stats, check_finite, check_result, check_float, choice_error, expect_tensor, row_chunks, tensor_field,
)
from moeq.formats.codebooks import MXFP4
from moeq.formats.grids import GRIDS as GRID_TABLE
from moeq.formats.grids import grid as grid_row
from moeq.formats.packing import codes_per_unit, pack, packed_size, unpack
from moeq.errors import MoeqError

BITS = (2, 3, 4, 5, 8)
GROUP_SIZES = (32, 64, 128, 256, -1)  # the common ones; any multiple of 16 up to 4096 is accepted too


def valid_group_size(gs: int) -> bool:
    return gs == -1 or (16 <= gs <= 4096 and gs % 16 == 0)


# the grids a config names (``asym`` is the symmetric=False form); their rows in moeq.formats.grids
GRIDS = tuple(n for n, g in GRID_TABLE.items() if g.symmetric)
CODEBOOKS = {n: g.table for n, g in GRID_TABLE.items() if g.codebook}  # value = scale * table[code]
CODEBOOK_BITS = {n: g.bits[0] for n, g in GRID_TABLE.items() if g.codebook}
MX_GROUP = GRID_TABLE["mxfp4"].group_size  # OCP MX blocks; each scale 2^(e - 128), e in 0..254 (E8M0, NaN excluded)
# scale dtypes the native kernels read (scale kinds 0-3, ``load_scale`` in moeq.h); fp16 scales take torch
NATIVE_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.uint8)
WEIGHTINGS = {"mse": 0, "x2": 1, "row": 2}  # importance of each weight in the scale search (moeq_cb4_search)


def e8m0_scales(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes (uint8, 0..254) as their fp32 scales ``2^(e - 128)``, exactly (2^-127, 2^-128: subnormal)."""
    i = e.to(torch.int32)
    bits = torch.where(i >= 2, (i - 1) << 23, torch.bitwise_left_shift(torch.full_like(i, 0x00200000), i.clamp(max=1)))
    return bits.view(torch.float32)


def e8m0_bytes(d: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales ``2^(e - 128)`` (validated) as their E8M0 exponent bytes ``e``."""
    return (torch.frexp(d.float())[1] + 127).to(torch.uint8)  # d = 0.5 * 2^(frexp exponent)


def mx_scale_problems(scale: torch.Tensor, group_size: int) -> list[str]:
    """An mxfp4 weight's scales must be what an E8M0 byte encodes: 2^(e - 128) for e in 0..254, at group 32 — held
    as those bytes (uint8), or as the powers of two themselves (float: moeq checkpoints saved before the bytes)."""
    if group_size != MX_GROUP:
        return [f"grid 'mxfp4' has group_size {MX_GROUP}, not {group_size}"]
    if not scale.numel():
        return []
    if scale.dtype == torch.uint8:
        return ["mxfp4 scale holds E8M0 exponent 255 (NaN)"] if int(scale.max()) == 255 else []
    mant, exp = torch.frexp(scale.float())
    if not bool(((mant == 0.5) & (exp >= -127) & (exp <= 127)).all()):
        return ["mxfp4 scales must be powers of two 2^-128 .. 2^126 (E8M0 exponents 0..254)"]
    return []


def quantize_mx(w: torch.Tensor, name: str | None = None) -> RTNWeight:
    """OCP MXFP4 as llama.cpp's ``quantize_row_mxfp4_ref`` (gguf-py ``MXFP4.quantize_blocks``) rounds it: per group
    of 32, ``e = floor(log2(amax)) - 2 + 127`` (0 for an all-zero group; clamped to 0..254), scale ``d = 2^(e - 128)``
    and each code the first nearest entry of the doubled E2M1 table. Scales stored as their E8M0 bytes ``e``."""
    check_finite(w, name)
    lead, k = w.shape[:-1], w.shape[-1]
    g = w.reshape(-1, k // MX_GROUP, MX_GROUP).float()
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 2 + 127,
                    torch.zeros_like(amax)).clamp(0, 254)
    d = torch.ldexp(torch.ones_like(amax), (e - 128).to(torch.int32))
    table = torch.tensor(MXFP4, dtype=torch.float32, device=w.device)
    codes = torch.empty(g.shape, dtype=torch.uint8, device=w.device)
    for a, b in row_chunks(g.shape[0], k):
        err = (d[a:b, :, None, None] * table - g[a:b, ..., None]).abs()
        codes[a:b] = err.argmin(-1).to(torch.uint8)  # first minimum, as numpy's argmin in gguf-py
    return RTNWeight(qdata=pack(codes.reshape(*lead, k), 4), scale=e.to(torch.uint8).reshape(*lead, k // MX_GROUP),
                     zero=None, bits=4, group_size=MX_GROUP, grid="mxfp4", shape=tuple(w.shape), dtype=w.dtype)


def searched_natively(grid: str, bits: int, symmetric: bool, search: int) -> bool:
    """Whether :func:`quantize` takes the importance-weighted codebook search (native, ~0.5 GB/s) for these
    settings (:meth:`moeq.formats.grids.Grid.searched`)."""
    g = GRID_TABLE.get(grid)
    return symmetric and g is not None and g.searched(bits, search)


def grid_values(grid: str, bits: int = 4) -> tuple[int, ...] | None:
    """The values a symmetric grid decodes codes 0.. to, in units of the scale (None: asymmetric)."""
    g = GRID_TABLE.get(grid)
    return None if g is None else g.values(bits)


def native_values(grid: str, bits: int) -> torch.Tensor:
    """A symmetric grid's values as the native kernels take them: fp32, padded with its last value to at least 16
    (their vector loads read 16)."""
    v = grid_values(grid, bits)
    return torch.tensor(v + (v[-1],) * max(0, 16 - len(v)), dtype=torch.float32)


@dataclasses.dataclass(frozen=True, repr=False)
class RTNWeight(PackedWeight):
    qdata: torch.Tensor = tensor_field()  # uint8 [..., N, packed K]
    scale: torch.Tensor = tensor_field()  # [..., N, G] weight dtype
    zero: torch.Tensor | None = tensor_field(optional=True)  # uint8 [..., N, G] (asymmetric only)
    scale_super: torch.Tensor | None = tensor_field(optional=True)  # bf16 [..., N]: scale holds int8 codes of it
    bits: int = 4
    group_size: int = 128
    grid: str = "vllm"  # "vllm" | "signed" | "asym"
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.bfloat16
    format = "rtn"

    _META_TYPES = {"bits": int, "group_size": int, "grid": str}

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    @property
    def scale_kind(self) -> int:
        """How the native kernels read ``scale`` (``load_scale`` in moeq.h): 0 fp32, 1 bf16, 2 int8 codes, 3 E8M0
        bytes."""
        if self.scale.dtype == torch.uint8:
            return 3
        return 2 if self.scale_super is not None else int(self.scale.dtype == torch.bfloat16)

    def group_scales(self) -> torch.Tensor:
        """The group scales as fp32 ``[..., N, G]`` (double-quantized: code x row factor, exact in fp32; E8M0 bytes:
        their powers of two)."""
        if self.scale.dtype == torch.uint8:
            return e8m0_scales(self.scale)
        if self.scale_super is None:
            return self.scale.float()
        return self.scale.float() * self.scale_super.float().unsqueeze(-1)

    def _problems(self) -> list[str]:
        k, lead = self.shape[-1], self.shape[:-1]
        if self.bits not in BITS:
            return [f"bits {self.bits!r} not in {list(BITS)}"]
        if not valid_group_size(self.group_size):
            return [f"group_size {self.group_size!r} is not a multiple of 16 up to 4096 or -1"]
        gs = k if self.group_size == -1 else self.group_size
        if k % gs or k % codes_per_unit(self.bits):
            return [f"K={k} is not a multiple of group_size {gs} and of {codes_per_unit(self.bits)} "
                    f"({self.bits}-bit packing)"]
        row = GRID_TABLE.get(self.grid) if isinstance(self.grid, str) else None
        if row is None:
            return [f"grid {self.grid!r} not in {sorted(GRID_TABLE)}"]
        if self.bits not in row.bits:
            return [f"grid {self.grid!r} is a {row.bits[0]}-bit codebook, not {self.bits}-bit" if row.codebook
                    else f"grid {self.grid!r} takes bits {list(row.bits)}, not {self.bits}"]
        if row.symmetric == (self.zero is not None):
            return ["an asymmetric grid needs its zero points" if self.zero is None else
                    f"zero points given for the symmetric grid {self.grid!r}"]
        out = expect_tensor(self.qdata, "qdata", (*lead, packed_size(k, self.bits)), (torch.uint8,))
        if self.scale_super is not None:
            if not row.double_quant:
                return [f"double-quantized scales (scale_super) are not for grid {self.grid!r}"]
            out += expect_tensor(self.scale, "scale", (*lead, k // gs), (torch.int8,))
            out += expect_tensor(self.scale_super, "scale_super", lead, (torch.bfloat16,))
            if out:
                return out
            reach = 127 * max(abs(v) for v in row.table)
            return bad_stats(self.scale_super, "scale_super", torch.finfo(self.dtype).max / reach, nonneg=True)
        e8m0 = row.ggml_head == "e8m0" and self.scale.dtype == torch.uint8  # the exponent bytes themselves
        out += expect_tensor(self.scale, "scale", (*lead, k // gs),
                             (torch.uint8,) if e8m0 else (torch.bfloat16, torch.float16, torch.float32))
        if row.ggml_head == "e8m0" and not out:  # the format's scales are E8M0 exponents
            out += mx_scale_problems(self.scale, self.group_size)
        if self.zero is not None:
            out += expect_tensor(self.zero, "zero", (*lead, k // gs), (torch.uint8,))
        if out:
            return out
        maxq = (1 << self.bits) - 1
        if self.zero is not None and self.zero.numel() and int(self.zero.max()) > maxq:
            out.append(f"zero holds points above {maxq}, the {self.bits}-bit maximum")
        reach = maxq if self.zero is not None else 1 << (self.bits - 1)  # the largest |q - zero|
        if row.codebook:
            reach = max(abs(v) for v in row.table)
        scales = self.group_scales() if e8m0 else self.scale
        return out + bad_stats(scales, "scale", torch.finfo(self.dtype).max / reach)

    def __getitem__(self, idx: int) -> RTNWeight:
        """The weight of one index along the leading (expert) dim, as views."""
        z = None if self.zero is None else self.zero[idx]
        sup = None if self.scale_super is None else self.scale_super[idx]
        return dataclasses.replace(self, qdata=self.qdata[idx], scale=self.scale[idx], zero=z, scale_super=sup,
                                   shape=self.shape[1:])

    def codes(self) -> torch.Tensor:
        return unpack(self.qdata, self.bits)

    def _dequantize_native(self, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor | None:
        from moeq import native  # noqa: PLC0415

        if (self.bits not in (4, 5, 8) and self.grid not in CODEBOOKS) or self.scale.dtype not in NATIVE_SCALE_DTYPES:
            return None
        if self.bits == 5 and self.zero is not None:
            return None
        L = native.lib()
        if L is None or not native.usable(self.qdata, self.scale, self.zero, self.scale_super):
            return None
        k = self.shape[-1]
        gs = k if self.group_size == -1 else self.group_size
        out = torch.empty(self.shape, dtype=dtype) if out is None else out
        rows, ng = self.numel // k, k // gs
        native.fits((self.qdata, rows * packed_size(k, self.bits)), (self.scale, rows * ng * self.scale.element_size()),
                 (self.zero, rows * ng), (self.scale_super, rows * 2))
        native.fits_out(out, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32, self.numel)
        if self.grid in CODEBOOKS or self.bits == 5:
            values = native_values(self.grid, self.bits)
            L.moeq_cb4_dequant(native.ptr(self.qdata), native.ptr(self.scale), self.scale_kind,
                               native.ptr(self.scale_super), native.ptr(values), self.bits, native.i64(rows),
                               native.i64(k), native.i64(gs), native.ptr(out), int(dtype == torch.bfloat16))
            return out
        L.moeq_rtn_dequant(native.ptr(self.qdata), native.ptr(self.scale), int(self.scale.dtype == torch.bfloat16),
                           native.ptr(self.zero), self.bits, native.i64(self.numel // k), native.i64(k), native.i64(gs),
                           native.ptr(out), int(dtype == torch.bfloat16))
        return out

    def dequantize_reference(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Plain-torch dequantization (the ground truth of the native kernel)."""
        k = self.shape[-1]
        gs = k if self.group_size == -1 else self.group_size
        dtype = dtype or self.dtype
        qd = self.qdata.reshape(-1, self.qdata.shape[-1])
        sc = (self.scale if self.scale.is_floating_point() else self.group_scales()).reshape(-1, k // gs)
        zr = None if self.zero is None else self.zero.reshape(-1, k // gs)
        out = torch.empty(qd.shape[0], k, dtype=dtype, device=qd.device)
        # (q - z) is exact in bf16 and the product is rounded once either way, so bf16 math equals fp32 math here
        cdt = torch.bfloat16 if dtype == sc.dtype == torch.bfloat16 else torch.float32
        for a, b in row_chunks(qd.shape[0], k):
            q = unpack(qd[a:b], self.bits).unflatten(-1, (k // gs, gs))  # [r, G, gs]
            if self.grid in CODEBOOKS:  # table values are integers below 256: exact in bf16
                v = torch.tensor(CODEBOOKS[self.grid], dtype=cdt, device=q.device)[q.long()]
            else:
                v = q.to(cdt) - (float(1 << (self.bits - 1)) if zr is None else zr[a:b].to(cdt).unsqueeze(-1))
            out[a:b] = (v * sc[a:b].to(cdt).unsqueeze(-1)).flatten(-2)
        return out.reshape(self.shape)


def _groups(w: torch.Tensor, group_size: int, name: str | None) -> tuple[torch.Tensor, int]:
    k = w.shape[-1]
    gs = k if group_size == -1 else group_size
    if k % gs:
        raise MoeqError(
            f"tensor {name or '<unnamed>'}: last dim {k} is not divisible by group_size {group_size}; "
            f"use a group size dividing {k} or group_size=-1 (one group per row)"
        )
    return w.unflatten(-1, (k // gs, gs)), gs  # [..., N, G, gs]


def quantize(
    w: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    symmetric: bool = True,
    grid: str = "vllm",
    name: str | None = None,
    native: bool = True,
    search: int = 0,
    refine: int = 0,
    hqq: int = 0,
    weighting: str = "x2",
    importance: torch.Tensor | None = None,
    double_quant: bool = False,
) -> RTNWeight:
    """Quantize ``w [..., N, K]`` group-wise along K. ``name`` only labels errors; ``native=False`` forces the
    plain-torch path (the native kernel's ground truth; both give identical bytes). ``search`` (number of clip
    candidates) and ``refine`` (least-squares rounds) turn on the calibration-free improvements of
    :mod:`moeq.formats.search`; ``hqq`` (iterations, asymmetric grids) runs HQQ-style half-quadratic
    optimization after them. On the 4/5-bit ``signed`` grid ``search`` is instead the importance-weighted scale
    search (``2*search+1`` candidates per sign, weights ``weighting``, times ``importance`` per input column when
    given, e.g. the preceding norm's scale squared; see the module docstring); the codebook grids (``iq4nl``,
    ``nl3``) always run it (``search`` 0: the refit at llama.cpp's starting scale only; llama.cpp's IQ4_NL tries 7).
    The storage stays the same."""
    if bits not in BITS:
        raise choice_error("RTN bits", bits, BITS)
    if not valid_group_size(group_size):
        raise MoeqError(f"unsupported RTN group_size {group_size}; valid choices: a multiple of 16 up to 4096 "
                         f"(e.g. {list(GROUP_SIZES[:-1])}) or -1 (one group per row)")
    if grid not in GRIDS:
        raise choice_error("RTN grid", grid, GRIDS)
    row = grid_row(grid) if symmetric or grid_row(grid).codebook else GRID_TABLE["asym"]
    check_float(w, name)
    if w.shape[-1] % codes_per_unit(bits):
        raise MoeqError(f"tensor {name or '<unnamed>'}: last dim {w.shape[-1]} must be a multiple of "
                         f"{codes_per_unit(bits)} for {bits}-bit packing")
    _groups(w, group_size, name)  # validates divisibility
    k = w.shape[-1]
    gs = k if group_size == -1 else group_size
    problem = row.problem(bits, symmetric, search, refine, hqq, double_quant, group_size)
    if problem:
        raise MoeqError(problem)
    if weighting not in WEIGHTINGS:
        raise choice_error("search weighting", weighting, tuple(WEIGHTINGS))
    if importance is not None:
        importance = importance.detach().float().contiguous().cpu()
        if importance.shape != (w.shape[-1],) or not bool(torch.isfinite(importance).all() & (importance >= 0).all()):
            raise MoeqError(f"tensor {name or '<unnamed>'}: importance must be {w.shape[-1]} finite values >= 0, got "
                            f"shape {tuple(importance.shape)}")
    if grid == "mxfp4":
        return check_result(quantize_mx(w, name), w, name)
    if searched_natively(grid, bits, symmetric, search):
        q = _codebook_search(w, grid, bits, gs, search, weighting, group_size, name, importance, native)
        if not torch.isfinite(q.scale).all():  # the kernel marks groups holding NaN/Inf
            check_finite(w, name)
        if double_quant:
            q = _double_quant(q, w, native)
        return check_result(q, w, name)
    if search and symmetric and grid != "vllm":
        raise MoeqError(f"search on grid={grid!r} is the 4/5-bit codebook search; {bits}-bit has none")
    if (native and not (search or refine or hqq) and (grid == "vllm" or not symmetric) and bits in (4, 8)
            and w.dtype in (torch.bfloat16, torch.float32) and gs <= 4096):
        native = _quantize_native(w, bits, gs, symmetric)
        if native is not None:
            qdata, scale, zero = native
            if not torch.isfinite(scale).all():  # the kernel marks groups holding NaN/Inf
                check_finite(w, name)
            return check_result(RTNWeight(qdata=qdata, scale=scale, zero=zero, bits=bits, group_size=group_size,
                                          grid="vllm" if symmetric else "asym", shape=tuple(w.shape), dtype=w.dtype),
                                w, name)
    if (native and not (search or refine or hqq) and symmetric and grid == "signed" and bits in (4, 5, 8)
            and w.dtype in (torch.bfloat16, torch.float32) and gs <= 4096):
        got = _quantize_signed_native(w, bits, gs)
        if got is not None:
            if not torch.isfinite(got[1]).all():  # the kernel marks groups holding NaN/Inf
                check_finite(w, name)
            return check_result(RTNWeight(qdata=got[0], scale=got[1], zero=None, bits=bits, group_size=group_size,
                                          grid="signed", shape=tuple(w.shape), dtype=w.dtype), w, name)
    check_finite(w, name)
    rows = w.reshape(-1, k)
    qdata = torch.empty(rows.shape[0], packed_size(k, bits), dtype=torch.uint8, device=w.device)
    scale = torch.empty(rows.shape[0], k // gs, dtype=w.dtype, device=w.device)
    zero = None if symmetric else torch.empty(rows.shape[0], k // gs, dtype=torch.uint8, device=w.device)
    for a, b in row_chunks(rows.shape[0], k):  # cache-sized pieces: ~3x faster than whole-tensor passes
        g = rows[a:b].unflatten(-1, (k // gs, gs))
        q, s, z = _quantize_rows(g, bits, symmetric, grid)
        if search or refine:
            from moeq.formats.search import rtn_search  # noqa: PLC0415

            z0 = z.float() if z is not None else torch.full(s.shape, float(1 << (bits - 1)), device=s.device)
            q, s, z2 = rtn_search(g.float(), bits, symmetric, w.dtype, (q, s.unsqueeze(-1), z0.unsqueeze(-1)),
                                  candidates=search, refine=refine)
            z = None if symmetric else z2.to(torch.uint8)
        if hqq:
            from moeq.formats.search import hqq as hqq_opt  # noqa: PLC0415

            qf, sf, zf = hqq_opt(g.float(), bits, s.float().unsqueeze(-1), z.float().unsqueeze(-1), w.dtype, iters=hqq)
            q, s, z = qf.to(torch.uint8), sf.squeeze(-1).to(w.dtype), zf.squeeze(-1).to(torch.uint8)
        qdata[a:b] = pack(q.flatten(-2), bits)
        scale[a:b] = s
        if zero is not None:
            zero[a:b] = z
    lead = w.shape[:-1]
    return check_result(RTNWeight(
        qdata=qdata.reshape(*lead, -1),
        scale=scale.reshape(*lead, -1),
        zero=None if zero is None else zero.reshape(*lead, -1),
        bits=bits,
        group_size=group_size,
        grid="asym" if not symmetric else grid,
        shape=tuple(w.shape),
        dtype=w.dtype,
    ), w, name)


def _quantize_native(w: torch.Tensor, bits: int, gs: int, symmetric: bool = True):
    from moeq import native  # noqa: PLC0415

    L = native.lib()
    w = w.contiguous()
    if L is None or not native.usable(w):
        return None
    k = w.shape[-1]
    rows = w.numel() // k
    qdata = torch.empty(*w.shape[:-1], packed_size(k, bits), dtype=torch.uint8)
    scale = torch.empty(*w.shape[:-1], k // gs, dtype=w.dtype)
    if symmetric:
        L.moeq_rtn_quantize_sym(native.ptr(w), int(w.dtype == torch.bfloat16), native.i64(rows), native.i64(k), native.i64(gs),
                                bits, native.ptr(qdata), native.ptr(scale))
        return qdata, scale, None
    zero = torch.empty(*w.shape[:-1], k // gs, dtype=torch.uint8)
    L.moeq_rtn_quantize_asym(native.ptr(w), int(w.dtype == torch.bfloat16), native.i64(rows), native.i64(k), native.i64(gs), bits,
                             native.ptr(qdata), native.ptr(scale), native.ptr(zero))
    return qdata, scale, zero


def _quantize_signed_native(w: torch.Tensor, bits: int, gs: int):
    from moeq import native  # noqa: PLC0415

    L = native.lib()
    w = w.contiguous()
    if L is None or w.device.type != "cpu" or not native.usable(w):
        return None
    k = w.shape[-1]
    qdata = torch.empty(*w.shape[:-1], packed_size(k, bits), dtype=torch.uint8)
    scale = torch.empty(*w.shape[:-1], k // gs, dtype=w.dtype)
    L.moeq_rtn_quantize_signed(native.ptr(w), int(w.dtype == torch.bfloat16), native.i64(w.numel() // k), native.i64(k),
                               native.i64(gs), bits, native.ptr(qdata), native.ptr(scale))
    return qdata, scale


def _quantize_rows(g: torch.Tensor, bits: int, symmetric: bool, grid: str):
    """g ``[R, G, gs]`` -> (uint8 codes ``[R, G, gs]``, scale ``[R, G]``, zero ``[R, G]`` or None)."""
    maxq = (1 << bits) - 1
    half = 1 << (bits - 1)
    zero = None
    if not symmetric:
        gf = g.float()
        lo = gf.amin(-1, keepdim=True).clamp(max=0)
        hi = gf.amax(-1, keepdim=True).clamp(min=0)
        scale = ((hi - lo) / maxq).to(g.dtype)
        s = scale.float()
        s = torch.where(s == 0, 1.0, s)
        zero_f = (-lo / s).round().clamp(0, maxq)
        q = ((gf / s).round() + zero_f).clamp(0, maxq)
        zero = zero_f.squeeze(-1).to(torch.uint8)
    elif grid == "vllm":
        # Exactly vLLM's arithmetic, in the weight's own dtype.
        scale = g.abs().amax(-1, keepdim=True) * 2.0 / maxq
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)  # all-zero group -> code `half` -> exact 0
        q = ((g / safe).round() + half).clamp(0, maxq)
    else:  # llama.cpp quantize_row_q4_0_ref arithmetic: d = peak / -half in fp32, codes floor(x * (1/d) + half + 0.5)
        # (8 bits: the same rule, peak on code 0; llama.cpp Q8_0 itself uses amax / 127)
        idx = g.abs().argmax(-1, keepdim=True)
        peak = g.gather(-1, idx).float()
        d = -peak / half
        scale = d.to(g.dtype)
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))
        q = (g.float() * inv + (half + 0.5)).floor().clamp(0, maxq)
    return q.to(torch.uint8), scale.squeeze(-1), zero


def _codebook_search(w: torch.Tensor, grid: str, bits: int, gs: int, ntry: int, weighting: str, group_size: int,
                     name: str | None, importance: torch.Tensor | None, native_ok: bool) -> RTNWeight:
    """Symmetric codebook grids (``iq4nl``; ``signed`` at 4 or 5 bits) through the importance-weighted scale search:
    native (``moeq_cb4_search``), else its plain-torch twin :func:`moeq.formats.search.codebook_search`."""
    from moeq import native  # noqa: PLC0415

    k = w.shape[-1]
    values = torch.tensor(grid_values(grid, bits), dtype=torch.float32, device=w.device)
    padded = native_values(grid, bits)
    wc = w.contiguous()
    L = native.lib() if w.device.type == "cpu" and native_ok else None
    if (L is not None and wc.dtype in (torch.bfloat16, torch.float32) and gs % 16 == 0 and gs <= 4096
            and native.usable(wc)):  # the kernel's per-group buffers hold 4096 values
        rows = wc.numel() // k
        qdata = torch.empty(*w.shape[:-1], packed_size(k, bits), dtype=torch.uint8)
        scale = torch.empty(*w.shape[:-1], k // gs, dtype=torch.bfloat16)
        L.moeq_cb4_search(native.ptr(wc), int(wc.dtype == torch.bfloat16), native.i64(rows), native.i64(k), native.i64(gs),
                          native.ptr(padded), values.numel(), int(ntry), WEIGHTINGS[weighting], native.ptr(importance),
                          native.ptr(qdata), native.ptr(scale))
    else:
        from moeq.formats.search import codebook_search  # noqa: PLC0415

        check_finite(w, name)
        rows = wc.reshape(-1, k)
        qdata = torch.empty(rows.shape[0], packed_size(k, bits), dtype=torch.uint8, device=w.device)
        scale = torch.empty(rows.shape[0], k // gs, dtype=torch.bfloat16, device=w.device)
        for a, b in row_chunks(rows.shape[0], k):
            q, s = codebook_search(rows[a:b].float(), gs, values.to(w.device), ntry, WEIGHTINGS[weighting],
                                   None if importance is None else importance.to(w.device))
            qdata[a:b] = pack(q, bits)
            scale[a:b] = s
        qdata, scale = qdata.reshape(*w.shape[:-1], -1), scale.reshape(*w.shape[:-1], -1)
    return RTNWeight(qdata=qdata, scale=scale.to(w.dtype), zero=None, bits=bits, group_size=group_size, grid=grid,
                     shape=tuple(w.shape), dtype=w.dtype)


def _double_quant(q: RTNWeight, w: torch.Tensor, native_ok: bool = True) -> RTNWeight:
    """``q``'s group scales as int8 codes of one bf16 factor per row (the row's largest |scale| / 127), and its codes
    re-rounded to the nearest table value at those scales: natively (``moeq_cb4_scale_codes``, ``moeq_cb4_requant``)
    or in plain torch (the twin)."""
    from moeq import native  # noqa: PLC0415

    k, gs = q.shape[-1], q.group_size if q.group_size != -1 else q.shape[-1]
    rows, ng = q.numel // k, k // gs
    values = torch.tensor(grid_values(q.grid, q.bits), dtype=torch.float32)
    wc = w.contiguous()
    L = native.lib() if w.device.type == "cpu" and native_ok else None
    qdata = torch.empty(rows, packed_size(k, q.bits), dtype=torch.uint8)
    if L is not None and wc.dtype in (torch.bfloat16, torch.float32) and native.usable(wc) and gs <= 4096:
        s16 = q.scale.reshape(rows, ng).to(torch.bfloat16).contiguous()  # the search's scales: exact in bf16
        codes = torch.empty(rows, ng, dtype=torch.int8)
        sup = torch.empty(rows, dtype=torch.bfloat16)
        L.moeq_cb4_scale_codes(native.ptr(s16), native.i64(rows), native.i64(ng), native.ptr(codes), native.ptr(sup))
        padded = native_values(q.grid, q.bits)  # held for the call
        L.moeq_cb4_requant(native.ptr(wc), int(wc.dtype == torch.bfloat16), native.i64(rows), native.i64(k),
                           native.i64(gs), native.ptr(padded), values.numel(), native.ptr(codes), native.ptr(sup),
                           native.ptr(qdata))
    else:
        s = q.scale.float().reshape(rows, ng)
        sup = (s.abs().amax(-1) / 127).to(torch.bfloat16)
        f = sup.float().unsqueeze(-1)
        codes = torch.where(f > 0, s / torch.where(f > 0, f, 1.0), 0.0).round().clamp(-127, 127).to(torch.int8)
        mid = (values[1:] + values[:-1]) / 2
        scale = (codes.float() * f).unsqueeze(-1)  # [rows, G, 1]
        x = wc.reshape(rows, ng, gs).float().cpu()
        inv = torch.where(scale != 0, 1.0 / torch.where(scale != 0, scale, 1.0), 0.0)
        qdata = pack(torch.bucketize(x * inv, mid).to(torch.uint8).flatten(-2), q.bits)
    lead = q.shape[:-1]
    return dataclasses.replace(q, qdata=qdata.reshape(*lead, -1), scale=codes.reshape(*lead, -1),
                               scale_super=sup.reshape(lead))
