"""FP8 block-scaled checkpoints (DeepSeek-V3/R1, Kimi K2, Qwen3-*-FP8, GLM-4.5-FP8, MiniMax-M2):
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bn, bk], ...}``; each quantized
linear stored as ``weight`` (F8_E4M3, ``[N, K]`` or fused ``[E, N, K]``) and ``weight_scale_inv`` (F32/BF16,
``[ceil(N/bn), ceil(K/bk)]``, with the same leading dims), ``w[i, j] = fp8[i, j] * scale_inv[i // bn, j // bk]``.

The checkpoint is read through :class:`Fp8Source`, a view of it in which every FP8 weight is a floating-point
tensor: each is dequantized when the stream reaches it (fused expert stacks one expert at a time): the e4m3 value
times its fp32 scale in fp32, then the compute dtype — bit for bit the weights transformers' own FP8 dequantization
gives (tested). The one streaming loop (:class:`~moeq.readers.state.LoadState`) then
places or quantizes it like a bf16 source tensor, so an FP8 checkpoint loads as bf16 (no method) or quantized in
flight to any moeq method; with the ``fp8`` method (:class:`~moeq.formats.fp8.Fp8Weight`) each 2-D FP8 weight is
kept as stored instead — its codes and scales, nothing rounded — and runs on the native FP8 kernels. ``moeq export
FP8-DIR model.gguf --format gguf --method q4_0`` never holds more than one dequantized tensor besides the quantized
model. Scales are validated before use: shape, finite, positive, and
small enough that no dequantized weight can overflow the compute dtype (shapes and dtypes from the headers before
anything is read, values as each scale is read); e4m3 NaN codes are refused.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from tqdm.auto import tqdm

from moeq.config import FP8, QuantConfig
from moeq.errors import MoeqError
from moeq.formats import fp8 as fp8_format
from moeq.formats.fp8 import Fp8Weight
from moeq.io.safetensors_io import Checkpoint, TensorInfo
from moeq.readers.state import LoadState, compute_dtype

log = logging.getLogger(__name__)
E4M3_MAX = 448.0
SCALE = "_scale_inv"  # weight -> weight_scale_inv
ACTIVATION_KEYS = (".input_scale", ".activation_scale", ".input_zero_point")  # static activation scales: weight-only moeq has no use


def claims(found) -> bool:
    return bool(found.qc) and found.qc.get("quant_method") == "fp8"


def block_size(qc: dict, where) -> tuple[int, int] | None:
    """The config's ``weight_block_size`` (None: one scale per tensor), validated."""
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise MoeqError(f"{where}: FP8 fmt {fmt!r} is not read (moeq reads e4m3 weights)")
    bs = qc.get("weight_block_size")
    if bs is None:
        return None
    if (not isinstance(bs, (list, tuple)) or len(bs) != 2
            or not all(type(v) is int and 1 <= v <= 1 << 16 for v in bs)):
        raise MoeqError(f"{where}: weight_block_size must be two integers in 1..65536, got {bs!r}")
    return int(bs[0]), int(bs[1])


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...]:
    if block is None:
        return ()
    n, k = shape[-2:]
    return (*shape[:-2], -(-n // block[0]), -(-k // block[1]))


def dequantize_reference(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None,
                         dtype: torch.dtype) -> torch.Tensor:
    """``[..., N, K]`` e4m3 codes times their block's scale, computed in fp32, then cast to ``dtype`` (plain torch:
    the ground truth of the native kernel)."""
    return fp8_format.dequantize_reference(q, scale_inv, block or (1, 1), dtype)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype,
               name: str = "an FP8 weight") -> torch.Tensor:
    """:func:`dequantize_reference`'s values, natively where it applies (``moeq_fp8_dequant``: one pass, ~2x the
    torch passes), refusing e4m3 NaN codes (0x7F/0xFF) by ``name``."""
    if block is not None and q.device.type == "cpu" and q.dim() >= 2 and q.numel() and scale_inv.dim() == q.dim():
        written = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        try:
            out = fp8_format.dequantize_native(q.contiguous().view(torch.uint8), scale_inv.float().contiguous(), block,
                                               written)
        except MoeqError:
            raise MoeqError(f"{name}: NaN codes in an FP8 weight") from None
        if out is not None:
            return out if written == dtype else out.to(dtype)
    if torch.isnan(q.float()).any():
        raise MoeqError(f"{name}: NaN codes in an FP8 weight")
    return dequantize_reference(q, scale_inv, block, dtype)


@dataclasses.dataclass
class Fp8Source:
    """A :class:`Checkpoint` seen as a floating-point source: FP8 weights read dequantized (their scales hidden from
    the key list), everything else as stored. ``suffix``: the scale's key after the weight's (``_scale_inv`` in
    DeepSeek's layout, ``_scale`` in compressed-tensors'; both multiply); ``block_for``: a weight's scale tile
    ``(rows, cols)`` (None: one scale) when it differs per weight (compressed-tensors' per-group strategies), else
    ``block`` for all."""

    ckpt: Checkpoint
    block: tuple[int, int] | None
    dtype: torch.dtype
    path: object
    suffix: str = SCALE
    block_for: object = None  # Callable[[str, tuple[int, ...]], tuple[int, int] | None]

    def __post_init__(self):
        self.fp8: dict[str, str] = {}  # weight key -> its scale key
        self.blocks: dict[str, tuple[int, int] | None] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for key, info in self.ckpt.tensors.items():
            if key.endswith(self.suffix) or key.endswith(ACTIVATION_KEYS):
                continue
            if info.dtype == torch.float8_e4m3fn:
                skey = key + self.suffix
                if skey not in self.ckpt.tensors:
                    raise MoeqError(f"{info.file}: {key} is FP8 but {skey} is missing")
                self.blocks[key] = self.block if self.block_for is None else self.block_for(key, tuple(info.shape))
                self._check_scale(key, info, self.ckpt.tensors[skey])
                self.fp8[key] = skey
                info = dataclasses.replace(info, dtype=self.dtype)
            elif info.dtype in (torch.float8_e5m2,):
                raise MoeqError(f"{info.file}: {key}: F8_E5M2 weights are not read (moeq reads e4m3)")
            self.tensors[key] = info
        orphans = [k for k in self.ckpt.tensors if k.endswith(self.suffix) and not k.endswith(ACTIVATION_KEYS)
                   and k[: -len(self.suffix)] not in self.fp8]
        if orphans:
            raise MoeqError(f"{self.path}: scales without an FP8 weight: {orphans[:5]}")
        skipped = [k for k in self.ckpt.tensors if k.endswith(ACTIVATION_KEYS)]
        if skipped:
            log.info("%s: %d static activation scales ignored (moeq quantizes weights only)", self.path, len(skipped))

    def _check_scale(self, key: str, info: TensorInfo, sinfo: TensorInfo) -> None:
        if len(info.shape) < 2:
            raise MoeqError(f"{info.file}: {key}: an FP8 weight must have at least 2 dims, got {list(info.shape)}")
        block = self.blocks[key]
        want = scale_shape(info.shape, block)
        got = tuple(sinfo.shape)
        if block is None and got in ((), (1,)):
            pass
        elif got != want:
            raise MoeqError(f"{sinfo.file}: {sinfo.name}: shape {list(got)}, expected {list(want)} for the "
                            f"{list(info.shape)} weight {key} at block {block}")
        if sinfo.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise MoeqError(f"{sinfo.file}: {sinfo.name}: scales stored as {sinfo.dtype}; expected F32/BF16/F16")

    def _check_values(self, sinfo: TensorInfo, s: torch.Tensor) -> None:
        """A scale tensor's values, checked when it is read (before its weight is dequantized)."""
        s = s.float()
        limit = torch.finfo(self.dtype).max / E4M3_MAX
        if not torch.isfinite(s).all() or (s <= 0).any() or (s > limit).any():
            raise MoeqError(f"{sinfo.file}: {sinfo.name}: scales must be finite, positive and at most {limit:.3g} "
                            f"(a larger one overflows {self.dtype}); min {s.min().item():.3g}, "
                            f"max {s.max().item():.3g}")

    def keys(self) -> list[str]:
        return [k for k in self.ckpt.keys() if k in self.tensors]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    @property
    def device(self):
        return self.ckpt.device

    @device.setter
    def device(self, value) -> None:
        self.ckpt.device = value

    def read(self, key: str, index: int | None = None) -> torch.Tensor:
        if key not in self.fp8:
            return self.ckpt.read(key, index)
        q = self.ckpt.read(key, index)
        block = self.blocks[key]
        s = self.ckpt.read(self.fp8[key], index if block is not None and len(self.tensors[key].shape) > 2 else None)
        self._check_values(self.ckpt.tensors[self.fp8[key]], s)
        return dequantize(q, s, block, self.dtype, f"{self.tensors[key].file}: {key}")

    def mmap(self, key: str) -> torch.Tensor:
        return self.read(key)

    def read_packed(self, key: str) -> Fp8Weight:
        """An FP8 weight as stored (codes and scales, validated): what an ``fp8`` plan keeps without rounding."""
        q, block = self.ckpt.read(key), self.blocks[key]
        s = self.ckpt.read(self.fp8[key])
        self._check_values(self.ckpt.tensors[self.fp8[key]], s)
        return fp8_format.from_checkpoint(q, s, block, self.dtype, f"{self.tensors[key].file}: {key}")


def read(found, quant, dtype, progress: bool, source=None) -> nn.Module:
    """The :mod:`moeq.readers` entry: an FP8 checkpoint as its dequantized weights (no method: the compute dtype) or
    quantized in flight with ``quant``. ``source``: an :class:`Fp8Source` already set up (other producers' layouts)."""
    dtype = compute_dtype(found.config, dtype)
    src = source or Fp8Source(found.ckpt, block_size(found.qc, found.path), dtype, found.path)
    src.device = found.device
    state = LoadState(found.path, src, found.config, QuantConfig.of(quant or "none"), dtype, sink=found.sink,
                      importance=found.importance)
    kept = 0
    for key in tqdm(src.keys(), desc="loading+quantizing (FP8)", unit="tensor", disable=not progress):
        if key in src.fp8 and len(src.tensors[key].shape) == 2 and isinstance(state.planned(key), FP8):
            state.put_packed(key, src.read_packed(key))  # kept as stored: codes and scales, no rounding
            kept += 1
        else:
            state.route(key)
    log.info("%s: %d FP8 e4m3 weights (block %s): %d kept as stored, the rest dequantized in flight", found.path,
             len(src.fp8), sorted(set(src.blocks.values()), key=str), kept)
    return state.finish()
