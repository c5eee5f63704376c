"""How the native kernels read each packed format: one describer per format (``@describer(fmt)``) turns a weight or
expert stack into a ``moeq_wstack`` (:class:`moeq.native.WStack`), or None outside the kernels' domain. Plans
(:mod:`moeq.kernels.plans`) hold the descriptions; nothing here runs a kernel."""
from __future__ import annotations

import ctypes
import functools

import torch

from moeq import native
from moeq.formats import Bnb4Weight, Fp8Weight, Iq2sWeight, PackedWeight, RTNWeight, iq2s
from moeq.formats.rtn import CODEBOOK_BITS, CODEBOOKS, NATIVE_SCALE_DTYPES, grid_values, native_values
from moeq.kernels.registry import by_format
from moeq.native import Fmt, WStack


# how the native kernels read packed weights of each format (one function per format)
_DESCRIBERS, describer = by_format("native weight description")


def describe(w: PackedWeight, keep: list, dot_bf16: bool = False, act_i8: bool = False,
             il16: bool = False) -> WStack | None:
    """Describe an expert stack ``[E, N, K]`` (or one weight ``[N, K]``) for the native kernels, or None outside their
    formats (``keep`` holds the tensors alive). ``dot_bf16``: the model computes in bf16, so RTN 4/8-bit and NF4/FP4
    may take activations as bf16 (AVX512-BF16 dot products) or, on AVX2 builds, RTN and codebook grids as int16
    (``moeq_avx2_gemv_i16``). ``act_i8``: decode with int8 activations where :func:`takes_int8` (the explicit
    ``activations="int8"`` option). The description comes planned (:func:`moeq.native.plan`): the decode and layer
    kernels that take it are ranked once here, and the calls run that ranking."""
    fn = _DESCRIBERS.get(w.format)
    if fn is None or len(w.shape) not in (2, 3):
        return None
    e = w.shape[0] if len(w.shape) == 3 else 1
    n, k = w.shape[-2:]
    stack = fn(w, e, n, k, keep, dot_bf16)
    if stack is not None:
        stack._experts = e  # for the Python-side bounds checks (not a field the C side reads)
    if stack is not None and act_i8 and not il16:
        stack.act_i8 = int(takes_int8(w))
    if stack is not None and il16:  # w's codes and scales are in the il16 layout: only its kernels may read them
        stack.il16 = 1
        if not stack.lut:  # the symmetric 4-bit grids: value = scale * (q - 8), read through the signed table
            values, lut = codebook_tables("signed")
            keep += [values, lut]
            stack.lut, stack.values = lut.data_ptr(), values.data_ptr()
    if stack is not None and native.lib() is not None and not native.plan(stack):
        return None  # no decode kernel takes it on this build
    return stack


def il16_takes(module, slots: tuple[str, ...]) -> bool:
    """Whether a quantized module's weights (``slots``: QuantExperts' two stacks, QuantLinear's weight) can be held in
    the il16 decode layout: bf16 RTN weights on CPU inside ``moeq_il16_takes``' domain (AVX512-BF16 builds; AVX2
    builds at groups of a multiple of 32)."""
    L = native.lib()
    if L is None:
        return False
    keep: list = []
    for slot in slots:
        w = module.packed(slot, raw=True)
        if not isinstance(w, RTNWeight) or w.dtype != torch.bfloat16 or w.qdata.device.type != "cpu":
            return False
        stack = describe(w, keep, dot_bf16=True, il16=True)
        if stack is None or not L.moeq_il16_takes(ctypes.byref(stack)):
            return False
    return True


def takes_int8(w: PackedWeight) -> bool:
    """The int8-activation kernels (``moeq/native/csrc/i8.c``) take ``w``: RTN 4-bit symmetric (Q4_0, vLLM's int4) or
    a 4-bit codebook with integer values in [-127, 127] (IQ4_NL), and on AVX512-VNNI builds 8-bit symmetric RTN
    (Q8_0; fp32 or bf16 scales); groups of 32 or multiples of 64, K % 32 == 0."""
    if not native.has_i8_dot() or not isinstance(w, RTNWeight) or w.zero is not None or len(w.shape) not in (2, 3):
        return False
    k = w.shape[-1]
    gs = k if w.group_size == -1 else w.group_size
    if k % 32 or not (gs == 32 or (gs % 64 == 0 and k % gs == 0)):
        return False
    if w.bits == 8:
        return (native.i8_level() >= 2 and w.grid not in CODEBOOKS and w.scale_super is None
                and w.scale.dtype in (torch.float32, torch.bfloat16))
    if w.bits != 4:
        return False
    table = codebook_of(w, gs)
    if table is None or table == "signed":
        return True
    values = codebook_tables(table)[0][:16]
    return bool((values == values.round()).all() and values.abs().max() <= 127)


@describer("rtn")
def _describe_rtn(w: RTNWeight, e: int, n: int, k: int, keep: list, dot_bf16: bool) -> WStack | None:
    gs = k if w.group_size == -1 else w.group_size
    table = codebook_of(w, gs)
    small = gs == 16 and table is not None  # codebooks at group 16 (AVX512-BF16 rows; AVX2: the 2/3-bit ones)
    if ((w.bits not in (4, 8) and table is None) or (gs % 32 and not small)
            or w.scale.dtype not in NATIVE_SCALE_DTYPES or (w.scale.dtype == torch.uint8 and table is None)):
        return None
    if (w.scale_super is not None) != (w.scale.dtype == torch.int8) or (
            w.scale_super is not None and table is None):  # int8 scale codes: the codebook rows only
        return None
    if not native.usable(w.qdata, w.scale, w.zero, w.scale_super):
        return None
    ng = e * n * (k // gs)
    native.fits((w.qdata, e * n * (k * w.bits // 8)), (w.scale, ng * w.scale.element_size()), (w.zero, ng),
                (w.scale_super, e * n * 2))
    keep += [w.qdata, w.scale, w.zero, w.scale_super]
    values = lut = None
    if table is not None:  # value = scale * table[code]; the bf16 kernels need x in 64-chunks and gs 32 or 64k (16:
        # AVX512-BF16, and on AVX2 the 2/3-bit rows; the other AVX2 rows scale whole 32-chunks)
        values, lut = codebook_tables(table)
        keep += [values, lut]
        dot_bf16 = dot_bf16 and k % 64 == 0 and (gs == 32 or gs % 64 == 0 or (small and (
            native.has_dpbf16() or w.bits in (2, 3))))  # AVX2: its 2/3-bit rows take group 16
    return WStack(fmt=Fmt.RTN, dot_bf16=int(dot_bf16), q=w.qdata.data_ptr(), scale=w.scale.data_ptr(),
                  scale_bf16=w.scale_kind, absmax_u8=0, zero=native.ptr(w.zero), bits=w.bits, gs=gs, spe=1, N=n, K=k,
                  values=native.ptr(values), lut=native.ptr(lut), scale_super=native.ptr(w.scale_super))


def codebook_of(w: RTNWeight, gs: int) -> str | None:
    """Which table the codebook kernels read ``w`` with, or None for the RTN kernels: the codebook grids, and the
    symmetric 4-bit grids (value = scale * (q - 8)) at group 32 — llama.cpp's Q4_0 blocks, where the codebook rows
    (no zero-point term, two scales per 64-chunk) beat the RTN rows (decode b4 1.3x on the bench model, measured;
    at group 128 the two were within noise, so the RTN rows stay)."""
    if w.grid in CODEBOOKS:
        return w.grid
    if w.bits == 4 and w.zero is None and gs == 32:
        return "signed"
    if w.bits == 5 and w.zero is None:  # the 5-bit grids only run as codebooks (value = scale * (q - 16))
        return "signed5"
    return None


@functools.cache
def codebook_tables(grid: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A codebook's values (fp32, :func:`~moeq.formats.rtn.native_values`: 16, or 32 for ``signed5``) and, for the
    AVX512-BF16 kernels, as 32 bf16 words (the table repeated: 16 values twice, 8 values four times)."""
    table = grid_values("signed", 5) if grid == "signed5" else grid_values(grid)
    values = native_values("signed", 5) if grid == "signed5" else native_values(grid, CODEBOOK_BITS.get(grid, 4))
    lut = torch.tensor(table, dtype=torch.float32).to(torch.bfloat16).view(torch.int16)
    return values, lut.repeat(32 // lut.numel()).contiguous()


@describer("bnb4")
def _describe_bnb4(w: Bnb4Weight, e: int, n: int, k: int, keep: list, dot_bf16: bool) -> WStack | None:
    spe = w.slices // e if w.slices % e == 0 else 0
    if spe == 0 or k % w.blocksize or w.blocksize % 32 or (n * k // spe) % w.blocksize:
        return None
    code = w.code.float().contiguous()
    absmax = w.absmax.contiguous()  # a view across slices may be strided; it is 1/64 of the codes or less
    tensors = [w.packed, absmax, code, w.offset, w.nested_absmax, w.nested_code]
    if not native.usable(*tensors):
        return None
    dq = w.offset is not None
    nb = e * n * k // w.blocksize
    native.fits((w.packed, e * n * k // 2), (absmax, nb * (1 if dq else 4)), (code, 64))
    if dq:
        native.fits((w.offset, w.slices * 4), (w.nested_code, 1024),
                    (w.nested_absmax, w.slices * -(-(nb // w.slices) // 256) * 4))
    keep += tensors
    return WStack(fmt=Fmt.BNB4, dot_bf16=int(dot_bf16 and w.blocksize % 64 == 0), q=w.packed.data_ptr(),
                  scale=absmax.data_ptr(), scale_bf16=0, absmax_u8=int(dq), zero=None, bits=4, gs=w.blocksize,
                  code=code.data_ptr(), offset=native.ptr(w.offset), nested_absmax=native.ptr(w.nested_absmax),
                  nested_code=native.ptr(w.nested_code), spe=spe, N=n, K=k)


@describer("iq2s")
def _describe_iq2s(w: Iq2sWeight, e: int, n: int, k: int, keep: list, dot_bf16: bool) -> WStack | None:
    if not native.usable(w.blocks) or k % iq2s.QK:
        return None
    native.fits((w.blocks, e * n * (k // iq2s.QK) * iq2s.BLOCK_BYTES))
    keep += [w.blocks, iq2s.GRID]
    return WStack(fmt=Fmt.IQ2S, dot_bf16=0, q=w.blocks.data_ptr(), scale=iq2s.GRID.data_ptr(), scale_bf16=0,
                  absmax_u8=0, zero=None, bits=2, gs=iq2s.QK, spe=1, N=n, K=k)


@describer("fp8")
def _describe_fp8(w: Fp8Weight, e: int, n: int, k: int, keep: list, dot_bf16: bool) -> WStack | None:
    bn, bk = w.block
    tiles = -(-n // bn) * -(-k // bk)
    if not native.usable(w.qdata, w.scale) or w.scale.numel() != e * tiles:
        return None
    native.fits((w.qdata, e * n * k), (w.scale, e * tiles * 4))
    keep += [w.qdata, w.scale]
    return WStack(fmt=Fmt.FP8, dot_bf16=int(dot_bf16), q=w.qdata.data_ptr(), scale=w.scale.data_ptr(), scale_bf16=0,
                  absmax_u8=0, zero=None, bits=8, gs=bk, spe=1, N=n, K=k, bn=bn)
