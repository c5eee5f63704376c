"""What every exporter shares: walking a moeq model module by module, splitting fused experts back into the
per-expert 2-D weights that checkpoint consumers expect, and writing atomically."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from moeq.arch import Arch
from moeq.formats import PackedWeight
from moeq.io.writer import unique_tensors
from moeq.nn import QuantExperts, QuantLinear


def expert_pieces(mod: QuantExperts) -> Iterator[tuple[int, str, PackedWeight]]:
    """(expert, "gate"|"up"|"down", 2-D packed weight) for every expert of a fused module."""
    i = mod.intermediate_dim
    w13, w2 = mod.w13, mod.w2
    for e in range(mod.num_experts):
        we = w13[e]
        yield e, "gate", we.row_slice(0, i)
        yield e, "up", we.row_slice(i, 2 * i)
        yield e, "down", w2[e]


def quantized_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, mod in model.named_modules():
        if isinstance(mod, (QuantExperts, QuantLinear)):
            yield name, mod


def plain_tensors(model: nn.Module, arch: Arch, skip_prefixes: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter/buffer that is not part of a quantized module, under its on-disk name."""
    for name, t in unique_tensors(model.state_dict().items()):  # tied weights written once
        if name.rpartition(".")[0] in skip_prefixes:  # quantized modules are written by the exporter itself
            continue
        yield arch.to_disk(name), t


def write_config(model: nn.Module, out: Path, quantization_config: dict | None) -> None:
    model.config.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    cfg_path.write_text(json.dumps(cfg, indent=2))
