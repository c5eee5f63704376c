"""Shared machinery for packed weights: tensor fields declared once, everything else derived.

A packed weight is a frozen dataclass. Fields created with :func:`tensor_field` hold tensors; the rest is metadata
(shape, dtype, bits, ...). ``to()``, ``tensors()``, ``nbytes`` and ``repr`` all derive from that declaration.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Self

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def tensor_field(optional: bool = False) -> Any:
    return dataclasses.field(default=None if optional else dataclasses.MISSING, metadata={"tensor": True})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, where: str = "") -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"{where}unknown dtype {name!r}; valid: {sorted(_DTYPES)}") from None


def check_finite(w: torch.Tensor, name: str | None) -> None:
    """Refuse NaN/Inf weights: they would silently poison every value sharing their scale."""
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).sum().item()
        raise ValueError(f"tensor {name or '<unnamed>'} has {bad} non-finite value(s) (NaN/Inf); refusing to quantize")


def check_float(w: torch.Tensor, name: str | None) -> None:
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"tensor {name or '<unnamed>'}: expected a bf16/fp16/fp32 weight, got {w.dtype}")
    if w.ndim < 1 or w.numel() == 0:
        raise ValueError(f"tensor {name or '<unnamed>'}: empty or 0-d weight of shape {tuple(w.shape)}")


def check_out(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A caller-owned dequantization buffer must be contiguous and exactly of the weight's shape and dtype."""
    if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"dequantize out= buffer must be a contiguous {dtype} tensor of shape {tuple(shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")


def row_chunks(rows: int, row_len: int, target: int = 1 << 18):
    """Ranges of rows holding about ``target`` elements: work on cache-sized pieces, bounded temporaries."""
    step = max(1, target // max(row_len, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def choice_error(what: str, value: Any, valid: Any) -> ValueError:
    return ValueError(f"unsupported {what} {value!r}; valid choices: {list(valid)}")


@dataclasses.dataclass(frozen=True, repr=False)
class PackedWeight:
    """Base of every quantized-weight dataclass. ``shape``/``dtype`` describe the original (logical) weight."""

    format: ClassVar[str] = ""

    @classmethod
    def tensor_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("tensor"))

    @classmethod
    def meta_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get("tensor"))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that make up this weight (optional ones omitted when absent)."""
        return {n: t for n in self.tensor_names() if (t := getattr(self, n)) is not None}

    def meta(self) -> dict[str, Any]:
        """JSON-able metadata; with :meth:`tensors` it fully reconstructs the weight via :meth:`from_parts`."""
        out = {}
        for n in self.meta_names():
            v = getattr(self, n)
            out[n] = dtype_name(v) if isinstance(v, torch.dtype) else list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_parts(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Self:
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.metadata.get("tensor"):
                kw[f.name] = tensors.get(f.name)
            elif f.name in meta:
                v = meta[f.name]
                kw[f.name] = parse_dtype(v) if f.name.endswith("dtype") else tuple(v) if isinstance(v, list) else v
        return cls(**kw)

    @classmethod
    def join(cls, groups: list[list[Self]]) -> Self:
        """Stack ``E`` groups of 2-D pieces ``[N_j, K]`` into one ``[E, sum N_j, K]`` weight (e.g. gate and up of
        each expert into ``w13``). Row-indexed formats concatenate rows; bnb4 concatenates its slices."""
        first = groups[0][0]
        for g in groups:
            for p in g:
                if p.meta() | {"shape": None} != first.meta() | {"shape": None} or len(p.shape) != 2:
                    raise ValueError(f"cannot join {type(p).__name__} pieces with different settings: "
                                     f"{p.meta()} vs {first.meta()}")
        rows = [sum(p.shape[0] for p in g) for g in groups]
        if len(set(rows)) != 1 or len({p.shape[1] for g in groups for p in g}) != 1:
            raise ValueError(f"cannot join pieces of uneven shapes: {[[p.shape for p in g] for g in groups]}")
        return cls._join(groups, (len(groups), rows[0], first.shape[1]))

    @classmethod
    def _join(cls, groups: list[list[Self]], shape: tuple[int, ...]) -> Self:
        tensors = {}
        for n in cls.tensor_names():
            if getattr(groups[0][0], n) is None:
                continue
            tensors[n] = torch.stack([torch.cat([getattr(p, n) for p in g], 0) for g in groups])
        return dataclasses.replace(groups[0][0], **tensors, shape=shape)

    row_sliceable = True  # any row range of a 2-D weight is a valid weight (see Bnb4Weight)

    def dequantize(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight's values in ``dtype`` (default: the original dtype); ``out``: a caller-owned buffer of the
        weight's shape and that dtype to write them into. Native CPU kernel when it applies, else plain torch."""
        dtype = dtype or self.dtype
        check_out(out, self.shape, dtype)
        y = self._dequantize_native(dtype, out) if dtype in (torch.bfloat16, torch.float32) else None
        if y is None:
            y = self.dequantize_reference(dtype)
            y = y if out is None else out.copy_(y)
        return y

    def _dequantize_native(self, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor | None:
        """Into ``out`` (or a new tensor) with the native CPU kernel; None where it does not apply."""
        return None

    def dequantize_reference(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Plain-torch dequantization (the ground truth of the native kernels)."""
        raise NotImplementedError

    def row_slice(self, start: int, stop: int) -> Self:
        """Rows ``start:stop`` of a 2-D weight (e.g. the gate half of one expert's ``w13``), sharing storage."""
        if len(self.shape) != 2:
            raise ValueError(f"row_slice needs a 2-D weight, got shape {self.shape}")
        return dataclasses.replace(self, **{n: t[start:stop] for n, t in self.tensors().items()},
                                   shape=(stop - start, self.shape[1]))

    def to(self, device: torch.device | str) -> Self:
        return dataclasses.replace(self, **{n: t.to(device) for n, t in self.tensors().items()})

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors().values())).device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # type: ignore[attr-defined]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / self.numel

    def __repr__(self) -> str:
        ts = ", ".join(f"{n}={tuple(t.shape)}:{dtype_name(t.dtype)}" for n, t in self.tensors().items())
        ms = ", ".join(f"{n}={v}" for n, v in self.meta().items())
        return f"{type(self).__name__}({ms}; {ts}; {self.bits_per_weight:.3f} bits/weight)"
