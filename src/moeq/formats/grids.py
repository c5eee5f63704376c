"""The RTN grids as data: one :class:`Grid` row per grid — how its codes decode, which bit widths and settings it
takes, which importance-weighted search it runs, and which GGML block type holds it exactly. Everything that used to
ask "which grid is this?" by name (the quantizer's checks, the config's, the native describers, the GGUF exporter and
reader) asks the row instead; adding a grid is adding a row (and, for a new GGML header, its case in the exporter).

Storage is the same for every grid (``RTNWeight``: packed codes, a scale per group, zero points for ``asym``), so
the same kernels serve all of them: value = scale * (code - 2^(bits-1)) for the integer grids, scale * table[code]
for the codebook grids, scale * (code - zero) for ``asym``.
"""
from __future__ import annotations

import dataclasses

from moeq.errors import MoeqError
from moeq.formats.codebooks import IQ4NL, MXFP4, NL2, NL3


@dataclasses.dataclass(frozen=True)
class Grid:
    name: str
    bits: tuple[int, ...]  # the bit widths it takes
    symmetric: bool = True  # False: zero points per group (``asym``)
    table: tuple[int, ...] | None = None  # codebook grids: value = scale * table[code]
    search: str = "never"  # importance-weighted scale search: "never", "optional" (search > 0) or "always"
    double_quant: bool = False  # int8 codes of a per-row bf16 scale allowed
    group_size: int | None = None  # a group size the format itself fixes (OCP MX: 32)
    ggml: tuple[tuple[int, str], ...] = ()  # (bits, GGML type) held exactly at group 32
    ggml_head: str = "f16"  # the GGML block's scale field: "f16" or "e8m0" (one exponent byte)

    @property
    def codebook(self) -> bool:
        return self.table is not None

    def ggml_type(self, bits: int) -> str | None:
        return dict(self.ggml).get(bits)

    def values(self, bits: int) -> tuple[int, ...] | None:
        """What codes 0.. decode to in units of the scale (None: asymmetric)."""
        if self.table is not None:
            return self.table
        return tuple(range(-(1 << (bits - 1)), 1 << (bits - 1))) if self.symmetric else None

    def searched(self, bits: int, search: int) -> bool:
        """Whether quantizing runs the importance-weighted codebook search (native, ~0.5 GB/s)."""
        return self.search == "always" or (self.search == "optional" and bool(search) and bits in (4, 5))

    def problem(self, bits: int, symmetric: bool, search: int = 0, refine: int = 0, hqq: int = 0,
                double_quant: bool = False, group_size: int | None = None) -> str | None:
        """Why these settings do not fit the grid (None: they do) — the one check the quantizer and config share."""
        if self.codebook and (bits not in self.bits or not symmetric or refine or hqq):
            return (f"grid {self.name!r} is a symmetric {self.bits[0]}-bit codebook: use bits={self.bits[0]}, "
                    "symmetric=True, no refine/hqq")
        if bits not in self.bits:
            return f"grid {self.name!r} takes bits {list(self.bits)}, not {bits}"
        if symmetric != self.symmetric:
            return f"grid {self.name!r} is {'symmetric' if self.symmetric else 'asymmetric'}"
        if double_quant and not self.double_quant:
            return f"double_quant (int8 codes of a per-row scale) is not for grid {self.name!r}"
        if refine and self.name not in ("vllm", "asym"):
            return f"refine works on the 'vllm' symmetric grid or asymmetric grids, not grid={self.name!r}"
        if hqq and self.symmetric:
            return "hqq fits a scale and a zero point: it needs an asymmetric grid (symmetric=False)"
        if self.group_size is not None and group_size is not None and group_size != self.group_size:
            return f"grid {self.name!r} has group_size {self.group_size}, not {group_size}"
        if self.name == "mxfp4" and search:
            return "grid 'mxfp4' has power-of-two scales: no search"
        return None


_BITS = (2, 3, 4, 5, 8)
_EXACT = ((4, "Q4_0"), (5, "Q5_0"), (8, "Q8_0"))
GRIDS: dict[str, Grid] = {g.name: g for g in (
    Grid("vllm", _BITS, ggml=_EXACT),  # vLLM's rtn_quantize: scale = max|w| / (2^(bits-1) - 1)
    Grid("signed", _BITS, search="optional", ggml=_EXACT),  # llama.cpp's Q4_0/Q5_0/Q8_0: the block's peak on -2^(b-1)
    Grid("asym", _BITS, symmetric=False),
    Grid("iq4nl", (4,), table=IQ4NL, search="always", double_quant=True, ggml=((4, "IQ4_NL"),)),
    Grid("nl3", (3,), table=NL3, search="always", double_quant=True),
    Grid("nl2", (2,), table=NL2, search="always", double_quant=True),
    Grid("mxfp4", (4,), table=MXFP4, group_size=32, ggml=((4, "MXFP4"),), ggml_head="e8m0"),
)}


def grid(name: str) -> Grid:
    g = GRIDS.get(name) if isinstance(name, str) else None
    if g is None:
        raise MoeqError(f"unsupported RTN grid {name!r}; valid choices: {sorted(GRIDS)}")
    return g


def from_ggml(qtype: str) -> tuple[Grid, int] | None:
    """The grid and bits moeq holds a GGML block type in, exactly (None: not one of them)."""
    for g in (GRIDS["signed"], GRIDS["iq4nl"], GRIDS["mxfp4"]):
        for bits, t in g.ggml:
            if t == qtype:
                return g, bits
    return None
