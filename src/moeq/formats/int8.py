"""LLM.int8 row-wise weights, bit-identical with bitsandbytes' ``Int8Params`` quantization.

``weight`` int8 ``[..., N, K] = round(W_fp16 * (127 / row_absmax))`` and ``scb`` fp32 ``[..., N]`` (bitsandbytes'
``SCB``); dequantization is ``weight * scb * (1/127)``. bitsandbytes casts the weight to fp16 first; so do we.
An all-zero row gets ``scb = 0`` and zero codes (bitsandbytes would produce undefined codes there).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from moeq.formats.base import (
    PackedWeight, bad_stats, check_finite, check_result, check_float, expect_tensor, row_chunks, tensor_field,
)
from moeq.errors import MoeqError

INV127 = 7.874015718698502e-3  # bitsandbytes' reciprocal of 127


@dataclasses.dataclass(frozen=True, repr=False)
class Int8Weight(PackedWeight):
    weight: torch.Tensor = tensor_field()  # int8 [..., N, K]
    scb: torch.Tensor = tensor_field()  # fp32 [..., N]
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.bfloat16
    format = "int8"
    bits: ClassVar[int] = 8  # per code (RTN: a field): what a requantizing exporter aims at

    def _problems(self) -> list[str]:
        out = expect_tensor(self.weight, "weight", self.shape, (torch.int8,))
        out += expect_tensor(self.scb, "SCB", self.shape[:-1], (torch.float32,))
        return out or bad_stats(self.scb, "SCB", torch.finfo(self.dtype).max, nonneg=True)

    def __getitem__(self, idx: int) -> Int8Weight:
        return dataclasses.replace(self, weight=self.weight[idx], scb=self.scb[idx], shape=self.shape[1:])

    def _dequantize_native(self, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor | None:
        from moeq import native  # noqa: PLC0415

        L = native.lib()
        if L is None or not native.usable(self.weight, self.scb) or not torch.isfinite(self.scb).all():
            return None
        out = torch.empty(self.shape, dtype=dtype) if out is None else out
        k = self.shape[-1]
        native.fits((self.weight, self.numel), (self.scb, self.numel // k * 4))
        native.fits_out(out, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32, self.numel)
        L.moeq_int8_dequant(native.ptr(self.weight), native.ptr(self.scb), native.i64(self.numel // k), native.i64(k),
                            native.ptr(out), int(dtype == torch.bfloat16))
        return out

    def dequantize_reference(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Plain-torch dequantization (the ground truth of the native kernel)."""
        k = self.shape[-1]
        w, s = self.weight.reshape(-1, k), self.scb.reshape(-1, 1)
        out = torch.empty(w.shape, dtype=dtype or self.dtype, device=w.device)
        for a, b in row_chunks(w.shape[0], k):
            out[a:b] = w[a:b] * s[a:b] * INV127
        return out.reshape(self.shape)

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """transformers+bitsandbytes ``Linear8bitLt`` keys (2-D weights only)."""
        if self.weight.ndim != 2:
            raise MoeqError(f"a bnb int8 state dict holds a 2-D weight; got shape {self.shape}: index [expert] first")
        return {f"{prefix}weight": self.weight, f"{prefix}SCB": self.scb,
                f"{prefix}weight_format": torch.tensor(0, dtype=torch.uint8)}

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor], prefix: str = "",
                        dtype: torch.dtype = torch.bfloat16) -> Int8Weight:
        w, scb = sd.get(f"{prefix}weight"), sd.get(f"{prefix}SCB")
        if w is None or scb is None:
            missing = [k for k in (f"{prefix}weight", f"{prefix}SCB") if sd.get(k) is None]
            raise MoeqError(f"int8 weight: missing {missing}")
        if w.dtype != torch.int8:
            raise MoeqError(f"{prefix}weight: expected int8, got {w.dtype}")
        if w.ndim < 2 or w.numel() == 0:
            raise MoeqError(f"{prefix}weight: expected a non-empty [..., N, K] int8 weight, got {list(w.shape)}")
        if scb.dtype != torch.float32:
            raise MoeqError(f"{prefix}SCB: dtype {scb.dtype}, expected float32")
        if scb.shape != w.shape[:-1]:
            raise MoeqError(f"{prefix}SCB: shape {tuple(scb.shape)} does not match weight rows {tuple(w.shape[:-1])}")
        fmt = sd.get(f"{prefix}weight_format")
        if fmt is not None and (fmt.numel() != 1 or fmt.is_floating_point() or fmt.dtype == torch.bool):
            raise MoeqError(f"{prefix}weight_format: expected one integer, got {fmt.dtype} {list(fmt.shape)}")
        if fmt is not None and int(fmt.reshape(-1)[0]) != 0:
            raise MoeqError(f"{prefix}weight_format: only row-major (0) is supported, got {int(fmt.reshape(-1)[0])}")
        return cls(weight=w, scb=scb, shape=tuple(w.shape), dtype=dtype).validate(f"{prefix}weight")


def quantize(w: torch.Tensor, name: str | None = None) -> Int8Weight:
    check_float(w, name)
    check_finite(w, name)
    k = w.shape[-1]
    rows = w.reshape(-1, k)
    q = torch.empty(rows.shape, dtype=torch.int8, device=w.device)
    scb = torch.empty(rows.shape[0], dtype=torch.float32, device=w.device)
    for a, c in row_chunks(rows.shape[0], k):
        b = rows[a:c].to(torch.float16)
        if not torch.isfinite(b).all():
            raise MoeqError(f"tensor {name or '<unnamed>'} overflows fp16 (|w| > 65504), which LLM.int8 requires")
        s = b.abs().amax(-1).float()
        safe = torch.where(s == 0, 1.0, s)
        q[a:c] = torch.round(b * (127.0 / safe).unsqueeze(-1))
        scb[a:c] = s
    return check_result(Int8Weight(weight=q.reshape(w.shape), scb=scb.reshape(w.shape[:-1]), shape=tuple(w.shape),
                                   dtype=w.dtype), w, name)
