"""Bit packing of unsigned integer codes along the last dimension (pure functions, any leading dims).

Layouts (codes ``c[k]`` along the last dim, all little-endian / least-significant first):
- 8 bits: one code per byte.
- 4 bits: ``byte[j] = c[2j] | c[2j+1] << 4`` (even index in the LOW nibble, as vLLM's RTN).
- 2 bits: ``byte[j] = c[4j] | c[4j+1] << 2 | c[4j+2] << 4 | c[4j+3] << 6``.
- 3 bits: eight codes form a 24-bit word ``sum(c[8j+i] << 3i)`` stored as three bytes, low byte first.
- 5 bits: two planes, the 4-bit layout of the low four bits (``K/2`` bytes), then the fifth bits LSB first
  (``K/8`` bytes: bit ``i`` of byte ``j`` is ``c[8j+i] >> 4``) — per group of 32, llama.cpp Q5_0's ``qh`` word.
The last dim must be a multiple of ``codes_per_unit(bits)`` (1, 2, 4 or 8).
"""
from __future__ import annotations

import torch

from moeq.formats.base import choice_error
from moeq.errors import MoeqError
from moeq.native import pages

PACK_BITS = (2, 3, 4, 5, 8)


def codes_per_unit(bits: int) -> int:
    """How many codes share one packed unit (a byte, or 3 bytes for 3-bit)."""
    return {2: 4, 3: 8, 4: 2, 5: 8, 8: 1}[bits]


def packed_size(k: int, bits: int) -> int:
    return {2: k // 4, 3: k // 8 * 3, 4: k // 2, 5: k // 8 * 5, 8: k}[bits]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., K]`` (values < 2**bits) -> packed uint8 ``[..., packed_size(K, bits)]``."""
    if bits not in PACK_BITS:
        raise choice_error("bit width", bits, PACK_BITS)
    k = codes.shape[-1]
    n = codes_per_unit(bits)
    if k % n:
        raise MoeqError(f"{bits}-bit packing needs the last dim to be a multiple of {n}, got {k}")
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 5:
        c = codes.to(torch.uint8)
        hi = (c >> 4).unflatten(-1, (k // 8, 8))
        plane = hi[..., 0]
        for i in range(1, 8):
            plane = plane | (hi[..., i] << i)
        return torch.cat([pack(c & 0xF, 4), plane], dim=-1)
    c = codes.to(torch.uint8).unflatten(-1, (k // n, n))  # [..., K/n, n]
    if bits == 4:
        return c[..., 0] | (c[..., 1] << 4)
    if bits == 2:
        return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)
    # 3-bit: 8 codes -> 24-bit word -> 3 bytes
    w = c.to(torch.int32)
    word = w[..., 0]
    for i in range(1, 8):
        word = word | (w[..., i] << (3 * i))
    out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)  # [..., K/8, 3]
    return out.to(torch.uint8).flatten(-2)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: packed uint8 ``[..., P]`` -> uint8 codes ``[..., K]``."""
    if bits not in PACK_BITS:
        raise choice_error("bit width", bits, PACK_BITS)
    if bits == 8:
        return packed
    if bits == 5:
        k = packed.shape[-1] // 5 * 8
        low = unpack(packed[..., : k // 2], 4)
        hi = torch.stack([(packed[..., k // 2:] >> i) & 1 for i in range(8)], dim=-1).flatten(-2)
        return low | (hi << 4)
    if bits == 4:
        return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    if bits == 2:
        return torch.stack([(packed >> s) & 0x3 for s in (0, 2, 4, 6)], dim=-1).flatten(-2)
    b = packed.unflatten(-1, (-1, 3)).to(torch.int32)  # [..., K/8, 3]
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    return torch.stack([(word >> (3 * i)) & 0x7 for i in range(8)], dim=-1).flatten(-2).to(torch.uint8)


# The il16 decode layout of 4-bit stacks (moeq/native/csrc/il16_rows.h): within each block of 16 rows, the
# [16 rows, units] grid transposed to [units, 16 rows]; a unit is 2 bytes of packed 4-bit codes (4 elements) or one
# group's scale. Pure permutations of a tensor's last two dims (N % 16 == 0), exactly invertible.
_WORDS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _units(t: torch.Tensor, unit: int) -> tuple[torch.Tensor, int]:
    """``t`` with each unit of ``unit`` elements as one wider integer where one exists (2.5x faster permutes of
    2-byte units than moving bytes), and the unit's length in that view."""
    word = _WORDS.get(unit * t.element_size())
    if unit > 1 and word is not None and t.is_contiguous():
        return t.view(word), 1
    return t, unit


def to_il16(t: torch.Tensor, unit: int) -> torch.Tensor:
    """``[..., N, C]`` (``C % unit == 0``) in il16's order, same shape: per 16-row block ``[16, C/unit, unit]`` ->
    ``[C/unit, 16, unit]``."""
    v, u = _units(t, unit)
    *lead, n, c = v.shape
    src = v.reshape(*lead, n // 16, 16, c // u, u).transpose(-3, -2)
    if v.device.type != "cpu":
        return src.contiguous().view(t.dtype).reshape(t.shape)
    out = pages.empty(src.shape, v.dtype)  # the decode copy of a stack: on 2 MB pages from its first write
    out.copy_(src)
    return out.view(t.dtype).reshape(t.shape)


def from_il16(t: torch.Tensor, unit: int) -> torch.Tensor:
    """The inverse of :func:`to_il16`."""
    v, u = _units(t, unit)
    *lead, n, c = v.shape
    return v.reshape(*lead, n // 16, c // u, 16, u).transpose(-3, -2).contiguous().view(t.dtype).reshape(t.shape)
