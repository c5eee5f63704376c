"""Exporters: write a moeq model in a format a serving engine reads, losslessly, atomically.

| format | consumers | takes |
|---|---|---|
| ``bnb`` | transformers + bitsandbytes (dense part), vLLM bitsandbytes, moeq | NF4/FP4 (double quant as stored), LLM.int8 |
| ``compressed-tensors`` | vLLM (Marlin/Triton MoE), transformers, compressed_tensors | RTN int4/int8, sym/asym, group/row |
"""
from __future__ import annotations

import os

from torch import nn

from moeq.arch import get_arch
from moeq.export import bnb, compressed_tensors
from moeq.io.writer import atomic_dir, copy_side_files

EXPORTERS = {"bnb": bnb, "compressed-tensors": compressed_tensors}


def export(model: nn.Module, out: str | os.PathLike, format: str, overwrite: bool = False,
           source: str | os.PathLike | None = None) -> dict:
    """Write ``model`` as ``format`` into ``out`` (atomically); returns a summary."""
    if format not in EXPORTERS:
        raise ValueError(f"unknown export format {format!r}; valid: {sorted(EXPORTERS)}")
    arch = get_arch(model.config)
    with atomic_dir(out, overwrite) as tmp:
        summary = EXPORTERS[format].export(model, tmp, arch)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        copy_side_files(source, tmp)
    return {"format": format, "out": str(out), **summary}
