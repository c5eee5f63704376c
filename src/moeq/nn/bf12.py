"""A bias-free bf16 ``nn.Linear`` held losslessly in 12 bits per weight (:mod:`moeq.formats.bf12`): the lm_head a
4-bit preset keeps in bf16 is ~80% of a Qwen3-30B-A3B-shaped decode step's bytes; held this way it is 3/4 of them,
and the native gemv unpacks it in registers to the exact bf16 weights (fp32 sums, rounded once, as
:func:`moeq.nn.decode.bf16_linear`).

Its ``state_dict`` holds ``weight`` (bf16, unpacked bit for bit) and ``load_state_dict`` takes one, so saving,
exporting and reloading see a plain linear. Forwards of up to :func:`max_rows` CPU bf16 rows are one native call;
others on CPU (a prompt's every position, other dtypes) unpack the weight a block of rows at a time. Moved to another
device (``model.to("cuda")``), it unpacks once there (its bf16 size again) and runs as a plain linear.
"""
from __future__ import annotations

import torch
from torch import nn

from moeq import native
from moeq.formats import bf12

UNIT = bf12.UNIT  # K must be a multiple
MAX_ROWS = 4  # AVX2 CPUs: past it a GEMM on unpacked blocks wins
MAX_ROWS_AMX = 8  # AMX without the tile kernel: the gemv 37 / 47 ms at 5 / 8 rows against 47 / 52 for the GEMM
MAX_ROWS_BF16 = 16  # AVX512-BF16 without AMX: the native gemv 36 / 70 ms at 8 / 16 rows against 78 (Zen 4); with AMX
# tiles from 6 rows the tile kernel (moeq_bf12_gemm_amx): 26 ms at 5-16 rows against the GEMM's 49 (Intel SPR)


def max_rows() -> int:
    """Rows one native call takes on this CPU (more: blocks unpacked for a GEMM); the native decode step's head
    (:mod:`moeq.nn.engine`) takes as many through the same kernel choice (``moeq_bf12_matmul``), so its logits are the
    forward's bit for bit."""
    if not native.has_dpbf16():
        return MAX_ROWS
    return MAX_ROWS_AMX if native.has_amx() and not native.amx_tiles() else MAX_ROWS_BF16


def serves_batches() -> bool:
    """Whether a bf12 head is the one to keep for batched decode on this CPU: with AMX tiles (the tile kernel: 24-26 ms
    at 6-16 rows of a 151936 x 2048 head, where torch's bf16 GEMM takes 29 reading 4/3 the bytes); elsewhere a bf16
    head's gemv wins past :data:`MAX_ROWS` rows (:func:`moeq.nn.decode.head_for_batches`)."""
    return native.amx_tiles()


BLOCK_WEIGHTS = 2 << 20  # weights unpacked at a time for many-row forwards (4 MB: stays in L2/L3 for the GEMM)
_FIELDS = bf12.Bf12._fields


class Bf12Linear(nn.Module):
    """``packed`` (:class:`moeq.formats.bf12.Bf12`) as a linear layer: buffers ``lo, hi, base, xptr, xcol, xval``
    (not persistent: the state dict holds the bf16 ``weight``), ``in_features`` / ``out_features``, ``bias`` None."""

    def __init__(self, packed: bf12.Bf12):
        super().__init__()
        self.out_features, self.in_features = packed.shape
        self.register_parameter("bias", None)
        self._set(packed)

    @classmethod
    def from_linear(cls, linear: nn.Linear, max_fraction: float | None = None) -> Bf12Linear | None:
        """The linear in bf12; None when that would exceed ``max_fraction`` of its bf16 bytes (outliers)."""
        if linear.bias is not None:
            raise ValueError("Bf12Linear holds bias-free linears")
        w = linear.weight.detach()
        limit = None if max_fraction is None else int(max_fraction * w.numel() * 2)
        p = bf12.pack(w, max_bytes=limit)
        return None if p is None else cls(p)

    def _set(self, p: bf12.Bf12) -> None:
        for name, t in zip(_FIELDS, p):  # xval as int16 bits: a model.to(dtype) leaves them alone
            self.register_buffer(name, t.view(torch.int16) if name == "xval" else t, persistent=False)

    @property
    def packed(self) -> bf12.Bf12:
        return bf12.Bf12(*(self.xval.view(torch.bfloat16) if n == "xval" else getattr(self, n) for n in _FIELDS))

    @property
    def weight(self) -> torch.Tensor:
        """The bf16 weight, unpacked: a new tensor at each access (writing to it changes nothing; load_state_dict
        does), for code that reads ``.weight`` as it would an ``nn.Linear``'s."""
        return self.unpack()

    def nbytes(self) -> int:
        return self.packed.nbytes()

    def describe(self) -> native.Bf12:
        """The native struct (keep this module alive while it is used)."""
        return self.packed.describe()

    def unpack(self, rows: slice | None = None) -> torch.Tensor:
        """The bf16 weight (or ``rows`` of it), exactly."""
        p = self.packed
        if p.lo.device.type != "cpu":
            return bf12.unpack_reference(p)[rows or slice(None)]
        return bf12.unpack(p, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if x.shape[-1] == self.in_features else 0
        if (0 < rows <= max_rows() and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and self.lo.device.type == "cpu" and native.has_simd()):
            xc = x.contiguous()
            y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.bfloat16)
            if native.lib().moeq_bf12_matmul(self.describe(), xc.data_ptr(), rows, y.data_ptr()):
                return y
        if self.lo.device.type != "cpu":  # e.g. after model.to("cuda"): unpacked once there, then a plain linear
            dense = self.__dict__.get("_dense")
            if dense is None or dense.device != x.device or dense.dtype != x.dtype:
                self.__dict__["_dense"] = dense = self.unpack().to(device=x.device, dtype=x.dtype)
            return nn.functional.linear(x, dense)
        # many rows: blocks of rows unpacked into one cache-sized buffer, each multiplied into rows of the transposed
        # output (no strided copy); the logits come back as its transposed view
        x2 = x.reshape(-1, self.in_features)
        n, block = self.out_features, max(1, BLOCK_WEIGHTS // self.in_features)
        yt = torch.empty(n, x2.shape[0], dtype=x.dtype)
        buf = torch.empty(min(block, n), self.in_features, dtype=torch.bfloat16)
        p = self.packed
        for n0 in range(0, n, block):
            w = bf12.unpack(p, slice(n0, n0 + block), out=buf[:min(block, n - n0)])
            torch.mm(w if x.dtype == torch.bfloat16 else w.to(x.dtype), x2.t(), out=yt[n0:n0 + w.shape[0]])
        return yt.t().view(*x.shape[:-1], n)

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_dense", None)
        return super()._apply(fn, *args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.unpack()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        w = state_dict[key]
        shape = (self.out_features, self.in_features)
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != shape or w.dtype != torch.bfloat16:
            error_msgs.append(f"{key}: expected a bf16 tensor of shape {shape}, got "
                              f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
            return
        p = bf12.pack(w.detach().to("cpu"))
        if p is None:
            error_msgs.append(f"{key}: over 2^31 values outside bf12's exponent window")
            return
        self._set(p)
        self.__dict__.pop("_dense", None)
        for name in state_dict:
            if name.startswith(prefix) and name != key and "." not in name[len(prefix):]:
                unexpected_keys.append(name)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias=False, layout=bf12, "
                f"exceptions={int(self.xptr[-1])}")


def to_linear(mod: Bf12Linear) -> nn.Linear:
    """The plain bf16 ``nn.Linear`` back (the A/B switch for benchmarks, or for code that needs ``.weight``)."""
    lin = nn.Linear(mod.in_features, mod.out_features, bias=False, device="meta")
    lin.weight = nn.Parameter(mod.unpack(), requires_grad=False)
    return lin
