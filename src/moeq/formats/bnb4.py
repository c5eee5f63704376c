"""bitsandbytes-compatible 4-bit blockwise quantization (NF4/FP4, optional double quantization).

Bit-identical with ``bitsandbytes.functional.quantize_4bit`` (whose CPU path is bitsandbytes' PyTorch reference):
blocks of ``blocksize`` consecutive values of the flattened tensor, fp32 ``absmax`` per block, the value scaled by
``1/absmax`` and mapped to the nearest code (ties to the lower code), two codes per byte with the EVEN element in the
HIGH nibble. Double quantization subtracts the mean of the absmax values and quantizes them with bitsandbytes'
signed dynamic 8-bit map in blocks of 256 (its reference kernel's arithmetic; bitsandbytes' native CPU library
approximates that step and can differ by a code or so).

Slices: a weight is made of ``slices`` equal, independent pieces of the flattened tensor (each its own blocks,
absmax mean and nested blocks), exactly as if each were quantized by its own ``quantize_4bit`` call. An expert stack
``[E, N, K]`` is quantized per expert by default (``slices=E``), as per-expert checkpoints store it; ``slices=1``
treats the stack as one tensor. A fused ``w13`` holds ``2E`` slices (gate and up of each expert).

Tensors: ``packed`` uint8 ``[S, ceil(n/2)]``; ``absmax`` fp32 ``[S, nb]`` (or uint8 codes with double quant);
``offset`` fp32 ``[S]``, ``nested_absmax`` fp32 ``[S, ceil(nb/256)]``, ``nested_code`` fp32 ``[256]``;
``code`` fp32 ``[16]``; ``n = numel/S`` and ``nb = ceil(n/blocksize)``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import ClassVar

import torch

from moeq.formats.base import (
    PackedWeight, bad_stats, check_finite, check_result, check_float, choice_error, dtype_name, expect_tensor, parse_dtype,
    row_chunks, tensor_field,
)
from moeq.formats.codebooks import QUANT_TYPES, code4, dynamic_map
from moeq.errors import MoeqError

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
NESTED_BLOCKSIZE = 256


@dataclasses.dataclass(frozen=True, repr=False)
class Bnb4Weight(PackedWeight):
    packed: torch.Tensor = tensor_field()  # uint8 [S, ceil(n/2)]
    absmax: torch.Tensor = tensor_field()  # fp32 [S, nb] or uint8 [S, nb] (double quant)
    code: torch.Tensor = tensor_field()  # fp32 [16]
    offset: torch.Tensor | None = tensor_field(optional=True)  # fp32 [S]
    nested_absmax: torch.Tensor | None = tensor_field(optional=True)  # fp32 [S, ceil(nb/256)]
    nested_code: torch.Tensor | None = tensor_field(optional=True)  # fp32 [256]
    quant_type: str = "nf4"
    blocksize: int = 64
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.bfloat16

    format = "bnb4"
    bits: ClassVar[int] = 4  # per code (RTN: a field): what a requantizing exporter aims at

    _META_TYPES = {"quant_type": str, "blocksize": int}

    @property
    def slices(self) -> int:
        return self.packed.shape[0]

    def _problems(self) -> list[str]:
        if self.quant_type not in QUANT_TYPES:
            return [f"quant_type {self.quant_type!r} not in {list(QUANT_TYPES)}"]
        if self.blocksize not in BLOCKSIZES:
            return [f"blocksize {self.blocksize!r} not in {list(BLOCKSIZES)}"]
        if self.packed is None or self.packed.ndim != 2 or self.packed.shape[0] < 1:
            return ["packed must be a 2-D [slices, bytes] tensor"]
        s = self.packed.shape[0]
        if self.numel % s:
            return [f"{self.numel} values cannot be split in {s} slices"]
        n = self.numel // s
        nb = -(-n // self.blocksize)
        dq = self.offset is not None
        if dq != (self.nested_absmax is not None) or dq != (self.nested_code is not None):
            return ["double quantization needs offset, nested_absmax and nested_code together"]
        f32 = (torch.float32,)
        out = expect_tensor(self.packed, "packed", (s, (n + 1) // 2), (torch.uint8,))
        out += expect_tensor(self.absmax, "absmax", (s, nb), (torch.uint8,) if dq else f32)
        out += expect_tensor(self.code, "code (quant_map)", (16,), f32)
        if dq:
            out += expect_tensor(self.offset, "offset (nested_offset)", (s,), f32)
            out += expect_tensor(self.nested_absmax, "nested_absmax", (s, -(-nb // NESTED_BLOCKSIZE)), f32)
            out += expect_tensor(self.nested_code, "nested_code (nested_quant_map)", (256,), f32)
        if out:
            return out
        limit = torch.finfo(self.dtype).max
        out = bad_stats(self.code, "code (quant_map)", 1.0)  # bitsandbytes' tables lie in [-1, 1]
        if not dq:
            return out + bad_stats(self.absmax, "absmax", limit, nonneg=True)
        out += bad_stats(self.nested_code, "nested_code (nested_quant_map)", 1.0)
        out += bad_stats(self.nested_absmax, "nested_absmax", limit, nonneg=True)
        out += bad_stats(self.offset, "offset (nested_offset)", limit)
        if not out and float(self.nested_absmax.max()) + float(self.offset.abs().max()) > limit:
            out.append("nested_absmax + offset exceed the compute dtype's range")
        return out

    @property
    def double_quant(self) -> bool:
        return self.offset is not None

    def slice(self, i: int | slice) -> Bnb4Weight:
        """Slices ``i`` (an index or a range) as a weight of their own, sharing storage."""
        s = slice(i, i + 1) if isinstance(i, int) else i
        start, stop, _ = s.indices(self.slices)
        per = self.numel // self.slices
        count = stop - start
        shape = (count * per,) if count != 1 else (per,)
        return dataclasses.replace(
            self, packed=self.packed[s], absmax=self.absmax[s],
            offset=None if self.offset is None else self.offset[s],
            nested_absmax=None if self.nested_absmax is None else self.nested_absmax[s], shape=shape,
        )

    def __getitem__(self, idx: int) -> Bnb4Weight:
        """The weight at ``idx`` of the leading (expert) dim; needs slices aligned with that dim."""
        lead = self.shape[0]
        if self.slices % lead:
            raise MoeqError(f"cannot index a {self.slices}-slice bnb4 weight of shape {self.shape} by its first "
                             f"dim: its statistics cross that dim (quantize per expert to index it)")
        k = self.slices // lead
        w = self.slice(slice(idx * k, (idx + 1) * k))
        return dataclasses.replace(w, shape=self.shape[1:])

    row_sliceable = False  # blocks may span rows: only whole slices can be cut out

    def row_slice(self, start: int, stop: int) -> Bnb4Weight:
        """Rows ``start:stop`` of a 2-D weight; they must be whole slices (blocks never cross a slice)."""
        n, k = self.shape
        per_rows = n // self.slices
        if start % per_rows or stop % per_rows:
            raise MoeqError(f"rows {start}:{stop} of a bnb4 weight of shape {self.shape} with {self.slices} "
                             f"slice(s) cross a slice boundary; its blocks cannot be split there")
        w = self.slice(slice(start // per_rows, stop // per_rows))
        return dataclasses.replace(w, shape=(stop - start, k))

    @classmethod
    def _join(cls, groups: list[list[Bnb4Weight]], shape: tuple[int, ...]) -> Bnb4Weight:
        pieces = [p for g in groups for p in g]
        if len({p.numel // p.slices for p in pieces}) != 1:
            raise MoeqError("bnb4 pieces must all hold equal-size slices to be joined (e.g. gate and up of equal "
                             f"shape); got {[p.shape for p in pieces]}")
        per_slice = ("packed", "absmax", "offset", "nested_absmax")
        tensors = {n: torch.cat([getattr(p, n) for p in pieces], 0) for n in per_slice
                   if getattr(pieces[0], n) is not None}
        return dataclasses.replace(pieces[0], **tensors, shape=shape)

    def resolved_absmax(self) -> torch.Tensor:
        """fp32 ``[S, nb]`` absmax, undoing double quantization (as bitsandbytes' ``dequantize_4bit``)."""
        if self.offset is None:
            return self.absmax
        from moeq import native  # noqa: PLC0415

        s, nb = self.absmax.shape
        L = native.lib()
        if L is not None and native.usable(self.absmax, self.nested_absmax, self.nested_code, self.offset):
            out = torch.empty(s, nb, dtype=torch.float32)
            L.moeq_bnb4_resolve_absmax(native.ptr(self.absmax), native.ptr(self.nested_absmax), native.ptr(self.nested_code),
                                       native.ptr(self.offset), native.i64(s), native.i64(nb), native.ptr(out))
            return out
        nn_ = self.nested_absmax.shape[1]
        vals = self.nested_code[self.absmax.long()]  # [S, nb]
        vals = torch.nn.functional.pad(vals, (0, nn_ * NESTED_BLOCKSIZE - nb)).view(s, nn_, NESTED_BLOCKSIZE)
        vals = (vals * self.nested_absmax.unsqueeze(-1)).view(s, -1)[:, :nb]
        return vals + self.offset.unsqueeze(-1)

    def codes(self) -> torch.Tensor:
        """uint8 nibble codes ``[S, n]``."""
        n = self.numel // self.slices
        return torch.stack([self.packed >> 4, self.packed & 0xF], dim=-1).flatten(-2)[:, :n]

    def _dequantize_native(self, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor | None:
        """Values computed in fp32, then cast (as bitsandbytes does); whole blocks per slice only."""
        from moeq import native  # noqa: PLC0415

        L = native.lib()
        if L is None or (self.numel // self.slices) % self.blocksize or not native.usable(self.packed, self.absmax):
            return None
        absmax = self.resolved_absmax().contiguous()
        code = self.code.float().contiguous()
        out = torch.empty(self.shape, dtype=dtype) if out is None else out
        native.fits((self.packed, self.numel // 2), (absmax, self.numel // self.blocksize * 4), (code, 64))
        native.fits_out(out, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32, self.numel)
        L.moeq_bnb4_dequant(native.ptr(self.packed), native.ptr(absmax), native.ptr(code), native.i64(self.numel),
                            native.i64(self.blocksize), native.ptr(out), int(dtype == torch.bfloat16))
        return out

    def dequantize_reference(self, dtype: torch.dtype | None = None, absmax: torch.Tensor | None = None):
        """Plain-torch dequantization (the ground truth of the native kernel)."""
        s = self.slices
        n = self.numel // s
        bs = self.blocksize
        absmax = self.resolved_absmax() if absmax is None else absmax
        nb = absmax.shape[1]
        dtype = dtype or self.dtype
        table = _pair_table(self.code.float()).to(self.packed.device)
        if n % bs == 0:
            pb, ab = self.packed.reshape(-1, bs // 2), absmax.reshape(-1, 1)
            out = torch.empty(pb.shape[0], bs, dtype=dtype, device=pb.device)
            for a, b in row_chunks(pb.shape[0], bs):
                vals = torch.index_select(table, 0, pb[a:b].reshape(-1).int()).view(b - a, bs)
                out[a:b] = vals * ab[a:b]
            return out.reshape(self.shape)
        vals = torch.index_select(table, 0, self.packed.reshape(-1).int()).view(s, -1)[:, :n]  # fp32 [S, n]
        vals = torch.nn.functional.pad(vals, (0, nb * bs - n))
        out = (vals.view(s, nb, bs) * absmax.unsqueeze(-1)).view(s, -1)[:, :n]
        return out.reshape(self.shape).to(dtype)

    # ---- bitsandbytes / transformers serialization -------------------------------------------------------------
    def quant_state_json(self) -> dict:
        d = {"quant_type": self.quant_type, "blocksize": self.blocksize, "dtype": dtype_name(self.dtype),
             "shape": list(self.shape)}
        if self.offset is not None:
            d.update(nested_blocksize=NESTED_BLOCKSIZE, nested_dtype="float32", nested_offset=self.offset.item())
        return d

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The exact keys a transformers+bitsandbytes checkpoint holds for one ``Linear4bit`` (``prefix`` ends
        with the module name and a dot)."""
        if self.slices != 1:
            raise MoeqError(f"a bnb state dict holds one tensor; this weight has {self.slices} slices: "
                             "use .slice(i) or [expert] first")
        sd = {
            f"{prefix}weight": self.packed.reshape(-1, 1),
            f"{prefix}weight.absmax": self.absmax.reshape(-1),
            f"{prefix}weight.quant_map": self.code,
        }
        if self.offset is not None:
            sd[f"{prefix}weight.nested_absmax"] = self.nested_absmax.reshape(-1)
            sd[f"{prefix}weight.nested_quant_map"] = self.nested_code
        blob = json.dumps(self.quant_state_json()).encode()
        sd[f"{prefix}weight.quant_state.bitsandbytes__{self.quant_type}"] = torch.tensor(list(blob), dtype=torch.uint8)
        return sd

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor], prefix: str = "") -> Bnb4Weight:
        """Inverse of :meth:`state_dict`; validates every piece and names the key at fault."""
        key = f"{prefix}weight"
        qs_keys = [k for k in sd if k.startswith(f"{key}.quant_state.bitsandbytes__")]
        if not qs_keys:
            raise MoeqError(f"{key}: quant_state tensor (weight.quant_state.bitsandbytes__nf4|fp4) is missing")
        if len(qs_keys) > 1:
            raise MoeqError(f"{key}: several quant_state tensors {sorted(qs_keys)}")
        qs_key = qs_keys[0]
        blob = sd[qs_key]
        if blob.dtype != torch.uint8 or blob.ndim != 1 or blob.numel() > 1 << 16:
            raise MoeqError(f"{qs_key}: expected a 1-D uint8 JSON blob of at most 64 KiB, got {blob.dtype} "
                            f"{list(blob.shape)}")
        try:
            qs = json.loads(bytes(blob.tolist()).decode())
            quant_type, blocksize = qs["quant_type"], int(qs["blocksize"])
            shape, dtype = tuple(int(x) for x in qs["shape"]), parse_dtype(qs["dtype"], f"{qs_key}: ")
        except ValueError as e:
            if "unknown dtype" in str(e):
                raise
            raise MoeqError(f"{qs_key}: quant_state JSON is unparsable: {e}") from None
        except (KeyError, TypeError, AttributeError, OverflowError) as e:
            raise MoeqError(f"{qs_key}: quant_state JSON lacks a field or is malformed: {e!r}") from None
        if not isinstance(quant_type, str) or not shape or any(d <= 0 for d in shape) or math.prod(shape) > 1 << 48:
            raise MoeqError(f"{qs_key}: quant_type {quant_type!r} / shape {list(shape)} invalid")
        if quant_type not in QUANT_TYPES:
            raise MoeqError(f"{qs_key}: unknown quant_type {quant_type!r}; valid: {list(QUANT_TYPES)}")
        if blocksize not in BLOCKSIZES:
            raise MoeqError(f"{qs_key}: unsupported blocksize {blocksize}; valid: {list(BLOCKSIZES)}")
        if qs_key.rsplit("__", 1)[1] != quant_type:
            raise MoeqError(f"{qs_key}: key says {qs_key.rsplit('__', 1)[1]} but its JSON says {quant_type}")
        for k in (key, f"{key}.absmax"):
            if k not in sd:
                raise MoeqError(f"{k}: missing from the checkpoint")
        n = math.prod(shape)
        nb = -(-n // blocksize)
        packed = sd[key]
        if packed.dtype != torch.uint8:  # some writers store the packed bytes under another 1-byte dtype
            if packed.element_size() != 1:
                raise MoeqError(f"{key}: packed 4-bit data must be 1-byte elements, got {packed.dtype}")
            packed = packed.contiguous().view(torch.uint8)
        stats = {k: sd[k] for k in (f"{key}.absmax", f"{key}.quant_map", f"{key}.nested_absmax",
                                    f"{key}.nested_quant_map") if k in sd}
        dq_declared = "nested_offset" in qs
        for k, t in stats.items():
            want = torch.uint8 if k.endswith(".absmax") and dq_declared else torch.float32
            if t.dtype != want:
                raise MoeqError(f"{k}: dtype {t.dtype}, expected {want}"
                                + (" (double-quantized absmax codes)" if want == torch.uint8 else ""))
        if packed.numel() != (n + 1) // 2:
            raise MoeqError(f"{key}: packed size {packed.numel()} bytes does not match the declared shape "
                             f"{list(shape)} ({(n + 1) // 2} bytes expected)")
        absmax = sd[f"{key}.absmax"].reshape(-1)
        if absmax.numel() != nb:
            raise MoeqError(f"{key}.absmax: {absmax.numel()} values, expected {nb} for shape {list(shape)} "
                             f"and blocksize {blocksize}")
        offset = nested_absmax = nested_code = None
        if "nested_offset" in qs:
            for k in (f"{key}.nested_absmax", f"{key}.nested_quant_map"):
                if k not in sd:
                    raise MoeqError(f"{k}: missing although the quant_state declares double quantization")
            try:
                offset = torch.tensor([float(qs["nested_offset"])], dtype=torch.float32)
                nested_bs = int(qs.get("nested_blocksize", NESTED_BLOCKSIZE))
            except (TypeError, ValueError, OverflowError) as e:
                raise MoeqError(f"{qs_key}: nested_offset / nested_blocksize malformed: {e!r}") from None
            if nested_bs != NESTED_BLOCKSIZE:
                raise MoeqError(f"{qs_key}: nested_blocksize {nested_bs} unsupported (only 256)")
            nested_absmax = sd[f"{key}.nested_absmax"].float().reshape(1, -1)
            if nested_absmax.shape[1] != -(-nb // NESTED_BLOCKSIZE):
                raise MoeqError(f"{key}.nested_absmax: {nested_absmax.shape[1]} values, expected "
                                 f"{-(-nb // NESTED_BLOCKSIZE)}")
            nested_code = sd[f"{key}.nested_quant_map"].float()
            absmax = absmax.to(torch.uint8)
        else:
            absmax = absmax.float()
        code = sd.get(f"{key}.quant_map", code4(quant_type)).float()
        return cls(packed=packed.reshape(1, -1), absmax=absmax.reshape(1, -1), code=code.reshape(-1), offset=offset,
                   nested_absmax=nested_absmax, nested_code=None if nested_code is None else nested_code.reshape(-1),
                   quant_type=quant_type, blocksize=blocksize, shape=shape, dtype=dtype).validate(key)


def _bounds(quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    code = code4(quant_type)
    order = torch.argsort(code)
    return (code[order[:-1]] + code[order[1:]]) / 2, order


def _blockwise_scaled(x: torch.Tensor, blocksize: int, clamp_tail: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 ``[S, n]`` -> (scaled values in [-1, 1] ``[S, nb*blocksize]`` zero-padded, absmax ``[S, nb]``).

    Full blocks are scaled by ``x * (1/absmax)``, a trailing partial block by ``x / absmax``: the exact arithmetic of
    bitsandbytes' reference kernel. Its 4-bit kernel stores an all-zero trailing block's absmax as 1e-38
    (``clamp_tail``); its native blockwise kernel, which makes the nested statistics, stores 0."""
    s, n = x.shape
    full = n // blocksize
    rem = n - full * blocksize
    head = x[:, : full * blocksize].reshape(s, full, blocksize)
    absmax = head.abs().amax(-1)
    scaled = torch.clamp(head * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(-1), -1, 1).reshape(s, -1)
    if rem:
        tail = x[:, full * blocksize:]
        am_raw = tail.abs().amax(-1, keepdim=True)
        am = am_raw.clamp(min=1e-38)
        absmax = torch.cat([absmax, am if clamp_tail else am_raw], dim=1)
        tail_scaled = torch.nn.functional.pad(torch.clamp(tail / am, -1, 1), (0, blocksize - rem))
        scaled = torch.cat([scaled, tail_scaled], dim=1)
    return scaled, absmax


def quantize_blockwise8(x: torch.Tensor, code: torch.Tensor, blocksize: int = NESTED_BLOCKSIZE):
    """Nearest-code 8-bit blockwise quantization of fp32 ``[S, n]`` (bitsandbytes' reference arithmetic)."""
    n = x.shape[1]
    scaled, absmax = _blockwise_scaled(x, blocksize, clamp_tail=False)
    q = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2).to(torch.uint8)
    return q[:, :n], absmax


def _quantize_native(w, blocksize, bounds, order, packed, absmax) -> bool:
    from moeq import native  # noqa: PLC0415

    L = native.lib()
    w = w.contiguous()
    if L is None or not native.usable(w, packed, absmax):
        return False
    order8, bounds = order.to(torch.uint8).contiguous(), bounds.contiguous()  # held for the call
    L.moeq_bnb4_quantize(native.ptr(w), int(w.dtype == torch.bfloat16), native.i64(w.numel() // blocksize),
                         native.i64(blocksize), native.ptr(bounds), native.ptr(order8), native.ptr(packed),
                         native.ptr(absmax))
    return True


def _quantize_search(w, blocksize, quant_type, candidates, packed, absmax, name, native: bool = True) -> None:
    """bnb4 with a searched (smaller) absmax per block; see :mod:`moeq.formats.search`. Whole blocks only. Native
    (``moeq_bnb4_quantize_search``) when it can, else plain torch (its reference)."""
    from moeq.formats.search import bnb4_absmax_search  # noqa: PLC0415

    if (w.numel() // packed.shape[0]) % blocksize:
        raise MoeqError(f"tensor {name or '<unnamed>'}: absmax search needs whole blocks of {blocksize}")
    bounds, order = (t.to(w.device) for t in _bounds(quant_type))
    code_sorted = code4(quant_type).to(w.device)[order]
    if native and w.dtype in (torch.bfloat16, torch.float32) and w.device.type == "cpu":
        from moeq import native as nat  # noqa: PLC0415

        L, wc = nat.lib(), w.contiguous()
        tables = bounds.contiguous(), order.to(torch.uint8).contiguous(), code_sorted.contiguous()  # alive for the call
        if L is not None and nat.usable(wc, packed, absmax, *tables):
            L.moeq_bnb4_quantize_search(
                nat.ptr(wc), int(wc.dtype == torch.bfloat16), nat.i64(wc.numel() // blocksize), nat.i64(blocksize),
                *(nat.ptr(t) for t in tables), int(candidates), 0.6, nat.ptr(packed), nat.ptr(absmax))
            if not torch.isfinite(absmax).all():  # the kernel marks blocks holding NaN/Inf
                check_finite(w, name)
            return
    check_finite(w, name)
    blocks, pb, ab = w.reshape(-1, blocksize), packed.view(-1, blocksize // 2), absmax.view(-1)
    for a, b in row_chunks(blocks.shape[0], blocksize):
        x = blocks[a:b].float()
        am = bnb4_absmax_search(x, x.abs().amax(-1), code_sorted, bounds, candidates)
        scaled = torch.clamp(x * (1.0 / am.clamp(min=1e-38)).unsqueeze(-1), -1, 1)
        pb[a:b] = _codes_packed(scaled, bounds, order, quant_type)
        ab[a:b] = am


def _codes_packed(scaled: torch.Tensor, bounds: torch.Tensor, order: torch.Tensor, quant_type: str) -> torch.Tensor:
    """Scaled values ``[R, 2m]`` -> packed bytes ``[R, m]`` (nearest code, ties low; even element HIGH nibble)."""
    q = torch.bucketize(scaled, bounds, out_int32=True)
    if quant_type != "nf4":
        q = order[q]
    q = q.to(torch.uint8)
    return (q[:, 0::2] << 4) | q[:, 1::2]


def _pair_table(code: torch.Tensor) -> torch.Tensor:
    """fp32 ``[256, 2]``: the two decoded values (high nibble, low nibble) of every byte."""
    b = torch.arange(256)
    return torch.stack([code[b >> 4], code[b & 0xF]], dim=-1)


def quantize(
    w: torch.Tensor,
    quant_type: str = "nf4",
    blocksize: int = 64,
    double_quant: bool = True,
    slices: int | None = None,
    name: str | None = None,
    native: bool = True,
    search: int = 0,
) -> Bnb4Weight:
    """Quantize ``w`` like ``bitsandbytes.functional.quantize_4bit(w_slice, blocksize, compress_statistics=
    double_quant, quant_type)`` for each of ``slices`` equal pieces (default: per leading index for ndim >= 3)."""
    if quant_type not in QUANT_TYPES:
        raise choice_error("quant_type", quant_type, QUANT_TYPES)
    if blocksize not in BLOCKSIZES:
        raise choice_error("blocksize", blocksize, BLOCKSIZES)
    check_float(w, name)
    if slices is None:
        slices = w.shape[0] if w.ndim >= 3 else 1
    if slices < 1 or w.numel() % slices:
        raise MoeqError(f"tensor {name or '<unnamed>'}: {w.numel()} values cannot be split in {slices} slices")
    n = w.numel() // slices
    nb = -(-n // blocksize)
    bounds, order = (t.to(w.device) for t in _bounds(quant_type))
    packed = torch.empty(slices, (n + 1) // 2, dtype=torch.uint8, device=w.device)
    absmax = torch.empty(slices, nb, dtype=torch.float32, device=w.device)
    if search:
        _quantize_search(w, blocksize, quant_type, search, packed, absmax, name, native)
    elif native and n % blocksize == 0 and w.dtype in (torch.bfloat16, torch.float32) and _quantize_native(
            w, blocksize, bounds, order, packed, absmax):
        if not torch.isfinite(absmax).all():  # the kernel marks blocks holding NaN/Inf
            check_finite(w, name)
    elif check_finite(w, name) or n % blocksize == 0:  # common case: every slice is whole blocks -> work on cache-sized runs of blocks
        blocks, pb, ab = w.reshape(-1, blocksize), packed.view(-1, blocksize // 2), absmax.view(-1)
        for a, b in row_chunks(blocks.shape[0], blocksize):
            scaled, am = _blockwise_scaled(blocks[a:b].float(), blocksize)
            pb[a:b] = _codes_packed(scaled, bounds, order, quant_type)
            ab[a:b] = am.view(-1)
    else:
        x = w.reshape(slices, n)
        for a, b in row_chunks(slices, n):
            scaled, am = _blockwise_scaled(x[a:b].float(), blocksize)
            packed[a:b] = _codes_packed(scaled[:, : n + (n & 1)], bounds, order, quant_type)  # odd n: pad code 0.0
            absmax[a:b] = am
    offset = nested_absmax = nested_code = None
    if double_quant:
        offset = absmax.mean(dim=1)
        nested_code = dynamic_map().to(w.device)
        absmax, nested_absmax = quantize_blockwise8(absmax - offset.unsqueeze(-1), nested_code)
    return check_result(Bnb4Weight(packed=packed, absmax=absmax, code=code4(quant_type).to(w.device), offset=offset,
                                   nested_absmax=nested_absmax, nested_code=nested_code, quant_type=quant_type,
                                   blocksize=blocksize, shape=tuple(w.shape), dtype=w.dtype), w, name)
