"""Quantization formats: pure functions over the last dim, any leading dims (an expert stack is one call).

A format is one file here: a frozen :class:`PackedWeight` subclass (tensor fields declared with ``tensor_field``,
metadata fields, ``format`` name) and a ``quantize(w, ...) -> Weight`` function. Nothing here imports above
``moeq.native`` (the native library) and ``moeq.errors``.

Adding an RTN grid (a new value table or rounding on moeq's RTN storage, as ``mxfp4`` was added): a row in
:mod:`moeq.formats.grids` (values, bits, search, GGML block type), its rounding in ``rtn.quantize`` when it is not
one the table implies, a preset in :mod:`moeq.config`; the native codebook kernels, the describers and the GGUF
exporter and reader then take it from the row.

Adding a format (what rtn.py, bnb4.py, int8.py and fp8.py each follow):
1. ``formats/<name>.py``: the weight class with ``dequantize_reference`` (plain torch, the ground truth),
   ``_problems`` (shapes/dtypes/statistics checked against its metadata, see ``PackedWeight.problems``),
   ``__getitem__`` (one expert) and optionally ``_dequantize_native``; ``quantize`` ending in ``check_result``.
2. Its line in :data:`WEIGHT_TYPES` below (saved checkpoints name formats by ``format``).
3. A typed config in :mod:`moeq.config` (``@register`` dataclass with ``quantize``) and its named presets in
   ``METHODS``.
4. Optional fast paths, each one registry line per backend: a CPU gemv (``@register(fmt)`` in
   :mod:`moeq.kernels.cpu_ops`), a native weight description for the fused MoE kernels (``@describer(fmt)`` in
   :mod:`moeq.kernels.describe`; its C in ``moeq/native/csrc`` with an ``enum moeq_fmt`` entry mirrored by
   ``moeq.native.Fmt`` and its rows in the decode kernel table ``KERNELS`` in ``moe.c``), a Triton layout (``@layout(fmt)`` in :mod:`moeq.kernels.triton_moe`). Without them the
   format runs through dequantize + matmul.
5. Exporters: each exporter's ``SUPPORTS`` and ``_check`` say which formats it takes; add the format where the
   engine has the same layout.
6. Tests in ``tests/formats/test_<name>.py``: round trip and SQNR vs the reference, and parity with the engine's own
   library where one exists.
"""
from moeq.formats import bnb4, fp8, int8, iq2s, rtn
from moeq.formats.base import PackedWeight
from moeq.formats.bnb4 import Bnb4Weight
from moeq.formats.fp8 import Fp8Weight
from moeq.formats.int8 import Int8Weight
from moeq.formats.iq2s import Iq2sWeight
from moeq.formats.rtn import RTNWeight

WEIGHT_TYPES: dict[str, type[PackedWeight]] = {c.format: c for c in (RTNWeight, Bnb4Weight, Int8Weight, Fp8Weight, Iq2sWeight)}

__all__ = ["bnb4", "fp8", "int8", "iq2s", "rtn", "PackedWeight", "RTNWeight", "Bnb4Weight", "Int8Weight",
           "Fp8Weight", "Iq2sWeight", "WEIGHT_TYPES"]
