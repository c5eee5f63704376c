"""Shared machinery for packed weights: tensor fields declared once, everything else derived.

A packed weight is a frozen dataclass. Fields created with :func:`tensor_field` hold tensors; the rest is metadata
(shape, dtype, bits, ...). ``to()``, ``tensors()``, ``nbytes`` and ``repr`` all derive from that declaration.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Self

import torch
from moeq.errors import MoeqError

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def tensor_field(optional: bool = False) -> Any:
    return dataclasses.field(default=None if optional else dataclasses.MISSING, metadata={"tensor": True})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, where: str = "") -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise MoeqError(f"{where}unknown dtype {name!r}; valid: {sorted(_DTYPES)}") from None


def check_finite(w: torch.Tensor, name: str | None) -> None:
    """Refuse NaN/Inf weights: they would silently poison every value sharing their scale."""
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).sum().item()
        raise MoeqError(f"tensor {name or '<unnamed>'} has {bad} non-finite value(s) (NaN/Inf); refusing it")


def check_result(q: "PackedWeight", w: torch.Tensor, name: str | None) -> "PackedWeight":
    """A freshly quantized weight must be sound: finite weights can still give non-finite or unrepresentable
    scales/statistics (|w| near the dtype's maximum). Refuse rather than hand back a NaN model."""
    found = q.problems()
    if found:
        peak = float(w.detach().abs().max()) if w.numel() else 0.0
        raise MoeqError(f"tensor {name or '<unnamed>'}: quantizing to {q.format} gives an unusable result "
                        f"(max |w| = {peak:.3g}): " + "; ".join(found[:3]))
    return q


def check_float(w: torch.Tensor, name: str | None) -> None:
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise MoeqError(f"tensor {name or '<unnamed>'}: expected a bf16/fp16/fp32 weight, got {w.dtype}")
    if w.ndim < 1 or w.numel() == 0:
        raise MoeqError(f"tensor {name or '<unnamed>'}: empty or 0-d weight of shape {tuple(w.shape)}")


def check_out(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A caller-owned dequantization buffer must be contiguous and exactly of the weight's shape and dtype."""
    if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous()):
        raise MoeqError(f"dequantize out= buffer must be a contiguous {dtype} tensor of shape {tuple(shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")


def row_chunks(rows: int, row_len: int, target: int = 1 << 18):
    """Ranges of rows holding about ``target`` elements: work on cache-sized pieces, bounded temporaries."""
    step = max(1, target // max(row_len, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def expect_tensor(t: Any, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> list[str]:
    """Problems of tensor field ``name`` against its expected shape and dtypes (one entry, or none)."""
    if t is None:
        return [f"{name} is missing"]
    if t.dtype not in dtypes:
        return [f"{name} has dtype {dtype_name(t.dtype)}, expected {'/'.join(dtype_name(d) for d in dtypes)}"]
    if tuple(t.shape) != tuple(shape):
        return [f"{name} has shape {list(t.shape)}, expected {list(shape)}"]
    return []


def bad_stats(t: torch.Tensor, name: str, limit: float, nonneg: bool = False) -> list[str]:
    """Statistics (scales, absmax, offsets) must be finite, within ``limit`` in magnitude, and >= 0 if ``nonneg``."""
    if t.numel() == 0:
        return []
    tf = t.float() if t.dtype != torch.float64 else t
    if not torch.isfinite(tf).all():
        return [f"{name} holds {int((~torch.isfinite(tf)).sum())} non-finite value(s)"]
    hi = float(tf.abs().max())
    if hi > limit:
        return [f"{name} holds |value| {hi:.3g}, beyond the {limit:.3g} this weight can represent"]
    if nonneg and float(tf.min()) < 0:
        return [f"{name} holds negative value(s)"]
    return []


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
        """Rebuild a weight from :meth:`tensors` and :meth:`meta` (trusted: its own module state). Untrusted parts
        (a file's) go through :meth:`from_untrusted`, which validates them."""
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.metadata.get("tensor"):
                kw[f.name] = tensors.get(f.name)
            elif f.name in meta:
                v = meta[f.name]
                kw[f.name] = parse_dtype(v) if f.name.endswith("dtype") else tuple(v) if isinstance(v, list) else v
        return cls(**kw)

    @classmethod
    def from_untrusted(cls, tensors: dict[str, torch.Tensor], meta: Any, where: str) -> Self:
        """:meth:`from_parts` for metadata and tensors read from a file: every metadata key must be present, of
        the right type and known; then :meth:`validate` checks the tensors against it. Errors name ``where``."""
        if not isinstance(meta, dict):
            raise MoeqError(f"{where}: metadata must be a JSON object, got {type(meta).__name__}")
        names = set(cls.meta_names())
        unknown, missing = sorted(set(meta) - names), sorted(names - set(meta))
        if unknown or missing:
            raise MoeqError(f"{where}: {cls.format} metadata " + "; ".join(
                ([f"lacks {missing}"] if missing else []) + ([f"has unknown keys {unknown}"] if unknown else [])))
        for n in names:
            v, want = meta[n], cls._META_TYPES.get(n, str)
            if n == "shape":
                ok = isinstance(v, list) and all(type(x) is int for x in v)
            elif n.endswith("dtype"):
                ok = isinstance(v, str)
            else:
                ok = type(v) is want
            if not ok:
                raise MoeqError(f"{where}: metadata {n}={v!r} has the wrong type")
        parse_dtype(meta["dtype"], f"{where}: ")  # a known dtype name, named in the error otherwise
        return cls.from_parts(tensors, meta).validate(where)

    _META_TYPES: ClassVar[dict[str, type]] = {}  # metadata field -> its JSON type (default str)

    def problems(self) -> list[str]:
        """What is wrong with this weight's tensors given its metadata (empty when it is sound): byte counts,
        shapes, dtypes, code tables, and statistics that are non-finite or would dequantize past the compute
        dtype's range. Cheap: shape arithmetic plus one pass over the (small) statistics tensors."""
        out = []
        shape = getattr(self, "shape", ())
        if not isinstance(shape, tuple) or not shape or any(type(d) is not int or d <= 0 for d in shape):
            return [f"declared shape {shape!r} is not a non-empty list of positive integers"]
        if math.prod(shape) > 1 << 48:
            return [f"declared shape {list(shape)} is implausibly large"]
        if getattr(self, "dtype", None) not in _DTYPES.values():
            out.append(f"dtype {getattr(self, 'dtype', None)} is not one of {sorted(_DTYPES)}")
        devices = set()
        for n in self.tensor_names():
            t = getattr(self, n)
            if t is not None and not isinstance(t, torch.Tensor):
                out.append(f"{n} is not a tensor")
            elif t is not None:
                devices.add(t.device)
        if len(devices) > 1:
            out.append(f"tensors on several devices {sorted(map(str, devices))}")
        return out + (self._problems() if not out else [])

    def _problems(self) -> list[str]:
        """Format-specific checks (see :meth:`problems`)."""
        return []

    def validate(self, where: str = "") -> Self:
        """Raise :class:`MoeqError` naming ``where`` when :meth:`problems` finds anything; return ``self``."""
        found = self.problems()
        if found:
            raise MoeqError(f"{where or type(self).__name__}: invalid {self.format} weight: " + "; ".join(found[:4])
                            + (f" (+{len(found) - 4} more)" if len(found) > 4 else ""))
        return self

    @classmethod
    def join(cls, groups: list[list[Self]]) -> Self:
        """Stack ``E`` groups of 2-D pieces ``[N_j, K]`` into one ``[E, sum N_j, K]`` weight (e.g. gate and up of
        each expert into ``w13``). Row-indexed formats concatenate rows; bnb4 concatenates its slices."""
        first = groups[0][0]
        for g in groups:
            for p in g:
                if p.meta() | {"shape": None} != first.meta() | {"shape": None} or len(p.shape) != 2:
                    raise MoeqError(f"cannot join {type(p).__name__} pieces with different settings: "
                                     f"{p.meta()} vs {first.meta()}")
        rows = [sum(p.shape[0] for p in g) for g in groups]
        if len(set(rows)) != 1 or len({p.shape[1] for g in groups for p in g}) != 1:
            raise MoeqError(f"cannot join pieces of uneven shapes: {[[p.shape for p in g] for g in groups]}")
        return cls._join(groups, (len(groups), rows[0], first.shape[1]))

    @classmethod
    def _join(cls, groups: list[list[Self]], shape: tuple[int, ...]) -> Self:
        """Each tensor preallocated whole and filled group by group; a group's entry in ``groups`` is emptied once
        copied, so pieces the caller no longer holds are freed as the join goes (peak: the result and one group, not
        the pieces and the result — a DeepSeek-V3 layer's experts are 6.6 GB at 4 bits)."""
        first = groups[0][0]
        names = [n for n in cls.tensor_names() if getattr(first, n) is not None]
        tensors = {}
        for n in names:
            t = getattr(first, n)
            rows = sum(getattr(p, n).shape[0] for p in groups[0])
            tensors[n] = torch.empty((len(groups), rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
        for i in range(len(groups)):
            for n in names:
                torch.cat([getattr(p, n) for p in groups[i]], 0, out=tensors[n][i])
            groups[i] = []
        return dataclasses.replace(first, **tensors, shape=shape)

    @classmethod
    def concat_rows(cls, parts: list[Self]) -> Self:
        """``[E, N_j, K]`` stacks of one format and settings -> one ``[E, sum N_j, K]`` (e.g. every expert's gate
        rows then its up rows): each tensor concatenated along its rows (dim 1). Row-indexed formats only."""
        first = parts[0]
        if not cls.row_sliceable:
            raise MoeqError(f"{cls.__name__} stacks cannot be joined by rows")
        for p in parts:
            if p.meta() | {"shape": None} != first.meta() | {"shape": None} or len(p.shape) != 3 or (
                    p.shape[0], p.shape[2]) != (first.shape[0], first.shape[2]):
                raise MoeqError(f"cannot join {type(p).__name__} stacks of different settings or shapes: "
                                f"{p.meta()} vs {first.meta()}")
            if any(t.dim() != 3 or t.shape[:2] != p.shape[:2] for t in p.tensors().values()):
                raise MoeqError(f"{cls.__name__} stacks do not hold one row of each tensor per weight row")
        tensors = {n: torch.cat([getattr(p, n) for p in parts], 1) for n in cls.tensor_names()
                   if getattr(first, n) is not None}
        return dataclasses.replace(first, **tensors, shape=(first.shape[0], sum(p.shape[1] for p in parts),
                                                            first.shape[2]))

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
            raise MoeqError(f"row_slice needs a 2-D weight, got shape {self.shape}")
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
