"""FP8 e4m3 weights with one fp32 scale per ``(bn, bk)`` tile: the block-scaled layout DeepSeek-V3/R1, Kimi K2,
Qwen3-*-FP8 and GLM-4.5-FP8 ship (``weight`` F8_E4M3 + ``weight_scale_inv`` F32 ``[ceil(N/bn), ceil(K/bk)]``),
kept as stored: ``w[i, j] = e4m3(qdata[i, j]) * scale[i // bn, j // bk]``.

``qdata`` uint8 ``[..., N, K]`` holds the e4m3 bytes (sign, 4 exponent bits with bias 7, 3 mantissa bits; 0x7F/0xFF
are NaN and refused), ``scale`` fp32 ``[..., ceil(N/bn), ceil(K/bk)]``; a per-tensor scale is the one tile
``(N, K)``. 8 + 32/(bn*bk) bits/weight (8.002 at 128x128). Quantizing a float weight computes what transformers'
``Fp8Quantize`` does: per tile ``s = 448 / amax`` (1 for an all-zero tile), codes ``e4m3(w * s)``, stored ``1 / s``.
Pieces whose rows do not fall on tile boundaries (gate and up of ``I % bn != 0`` rows joined into ``w13``, a row
slice from inside a tile) take one scale row per weight row: the same values, a larger scale tensor.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from moeq.errors import MoeqError
from moeq.formats.base import (
    PackedWeight, bad_stats, check_finite, check_float, check_result, expect_tensor, tensor_field,
)

E4M3_MAX = 448.0
BLOCK = (128, 128)  # DeepSeek's tile; what ``quantize`` uses unless told


def tiles(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale shape of a ``[..., N, K]`` weight at ``block``."""
    n, k = shape[-2:]
    return (*shape[:-2], -(-n // block[0]), -(-k // block[1]))


def nan_codes(q: torch.Tensor) -> int:
    """How many e4m3 bytes are NaN (0x7F / 0xFF)."""
    return int(((q & 0x7F) == 0x7F).sum())


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
                         ) -> torch.Tensor:
    """``[..., N, K]`` e4m3 codes (as e4m3 or their uint8 bytes) times their tile's scale in fp32, then ``dtype``
    (plain torch: the ground truth of the native kernels)."""
    w = (q.view(torch.float8_e4m3fn) if q.dtype == torch.uint8 else q).to(torch.float32)
    s = scale.to(torch.float32)
    if s.dim() < 2 or s.numel() == 1:
        return w.mul_(s.reshape(())).to(dtype)
    n, k = w.shape[-2:]
    s = s.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]
    return w.mul_(s).to(dtype)


def dequantize_native(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`dequantize_reference`'s values by ``moeq_fp8_dequant`` (one pass) into ``out`` or a new ``dtype``
    (bf16 or fp32) tensor: ``q`` contiguous uint8 e4m3 bytes, ``scale`` contiguous fp32 tiles. None without the
    native library; e4m3 NaN codes raise."""
    from moeq import native  # noqa: PLC0415

    L = native.lib()
    if L is None or q.dim() < 2 or not native.usable(q, scale):
        return None
    n, k = q.shape[-2:]
    lead = q.numel() // (n * k)
    out = torch.empty(q.shape, dtype=dtype) if out is None else out
    native.fits((q, q.numel()), (scale, lead * math.prod(tiles((n, k), block)) * 4))
    native.fits_out(out, dtype, q.numel())
    if L.moeq_fp8_dequant(native.ptr(q), native.ptr(scale), lead, n, k, block[0], block[1], native.ptr(out),
                          int(dtype == torch.bfloat16)):
        raise MoeqError("e4m3 NaN codes (0x7F/0xFF) in an FP8 weight")
    return out


@dataclasses.dataclass(frozen=True, repr=False)
class Fp8Weight(PackedWeight):
    qdata: torch.Tensor = tensor_field()  # uint8 e4m3 bytes [..., N, K]
    scale: torch.Tensor = tensor_field()  # fp32 [..., ceil(N/bn), ceil(K/bk)]: the multiplier (scale_inv)
    block: tuple[int, int] = BLOCK
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.bfloat16
    format = "fp8"
    bits: ClassVar[int] = 8  # per code (RTN: a field): what a requantizing exporter aims at
    _META_TYPES = {"block": list}

    def _problems(self) -> list[str]:
        b = self.block
        if (not isinstance(b, tuple) or len(b) != 2 or any(type(v) is not int or not 1 <= v <= 1 << 24 for v in b)):
            return [f"block {b!r} is not two positive integers"]
        if len(self.shape) < 2:
            return [f"an fp8 weight is [..., N, K]; shape {list(self.shape)}"]
        out = expect_tensor(self.qdata, "qdata", self.shape, (torch.uint8,))
        out += expect_tensor(self.scale, "scale", tiles(self.shape, b), (torch.float32,))
        if out:
            return out
        out = bad_stats(self.scale, "scale", torch.finfo(self.dtype).max / E4M3_MAX, nonneg=True)
        bad = nan_codes(self.qdata)
        return out + ([f"qdata holds {bad} e4m3 NaN code(s) (0x7F/0xFF)"] if bad else [])

    def __getitem__(self, idx: int) -> Fp8Weight:
        return dataclasses.replace(self, qdata=self.qdata[idx], scale=self.scale[idx], shape=self.shape[1:])

    def per_row(self) -> Fp8Weight:
        """The same values with one scale row per weight row (block ``(1, bk)``)."""
        if self.block[0] == 1:
            return self
        n = self.shape[-2]
        s = self.scale.repeat_interleave(self.block[0], dim=-2)[..., :n, :].contiguous()
        return dataclasses.replace(self, scale=s, block=(1, self.block[1]))

    def row_slice(self, start: int, stop: int) -> Fp8Weight:
        if len(self.shape) != 2:
            raise MoeqError(f"row_slice needs a 2-D weight, got shape {self.shape}")
        bn = self.block[0]
        w = self if start % bn == 0 else self.per_row()
        bn = w.block[0]
        return dataclasses.replace(w, qdata=w.qdata[start:stop], scale=w.scale[start // bn: -(-stop // bn)],
                                   shape=(stop - start, self.shape[1]))

    @classmethod
    def _join(cls, groups: list[list[Fp8Weight]], shape: tuple[int, ...]) -> Fp8Weight:
        bn = groups[0][0].block[0]
        if any(p.shape[0] % bn for g in groups for p in g[:-1]):  # a piece ends inside a tile
            groups = [[p.per_row() for p in g] for g in groups]
        first = groups[0][0]
        return dataclasses.replace(
            first, shape=shape,
            qdata=torch.stack([torch.cat([p.qdata for p in g]) for g in groups]),
            scale=torch.stack([torch.cat([p.scale for p in g]) for g in groups]))

    def _dequantize_native(self, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor | None:
        return dequantize_native(self.qdata, self.scale, self.block, dtype, out)

    def dequantize_reference(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_reference(self.qdata, self.scale, self.block, dtype or self.dtype)


def from_checkpoint(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype,
                    where: str) -> Fp8Weight:
    """A checkpoint's e4m3 weight and its scale (``block`` None: one scale for the tensor) as stored, validated."""
    n, k = q.shape[-2:]
    if block is None:
        block, scale = (n, k), scale.reshape(*q.shape[:-2], 1, 1)
    return Fp8Weight(qdata=q.contiguous().view(torch.uint8), scale=scale.float().contiguous(), block=tuple(block),
                     shape=tuple(q.shape), dtype=dtype).validate(where)


def quantize(w: torch.Tensor, block: tuple[int, int] = BLOCK, name: str | None = None) -> Fp8Weight:
    """``[..., N, K]`` to e4m3 with one scale per ``block`` tile, as transformers' ``Fp8Quantize``."""
    check_float(w, name)
    check_finite(w, name)
    if w.dim() < 2:
        raise MoeqError(f"tensor {name or '<unnamed>'}: fp8 quantizes [..., N, K] weights, got {list(w.shape)}")
    n, k = w.shape[-2:]
    bn, bk = block
    tn, tk = -(-n // bn), -(-k // bk)
    wp = torch.nn.functional.pad(w.float(), (0, tk * bk - k, 0, tn * bn - n))
    t = wp.unflatten(-1, (tk, bk)).unflatten(-3, (tn, bn))  # [..., tn, bn, tk, bk]
    amax = t.abs().amax(dim=(-3, -1))
    s = torch.where(amax > 0, E4M3_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.ones_like(amax))
    q = (t * s[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.flatten(-4, -3).flatten(-2)[..., :n, :k].contiguous().view(torch.uint8)
    return check_result(Fp8Weight(qdata=q, scale=(1.0 / s).float().contiguous(), block=(bn, bk),
                                  shape=tuple(w.shape), dtype=w.dtype), w, name)
