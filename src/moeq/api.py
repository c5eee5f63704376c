"""The public verbs: ``quantize_`` (in memory), ``save`` (atomic) and ``inspect`` (what is quantized how)."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from moeq.arch import get_arch
from moeq.config import FormatConfig, QuantConfig
from moeq.errors import MoeqError
from moeq.convert import ExpertsBuilder, activation_for, install_experts, plan, quantize_linear, set_module
from moeq.formats import PackedWeight
from moeq.io.writer import atomic_dir, copy_side_files, model_sources, unique_tensors, write_shards
from moeq.native import pages
from moeq.record import quantization_config
from moeq.nn.bf12 import Bf12Linear
from moeq.nn.packed import packed_slots

log = logging.getLogger(__name__)


@torch.no_grad()
def quantize_(model: nn.Module, config: QuantConfig | FormatConfig | str) -> nn.Module:
    """Quantize a transformers MoE model in place: experts modules become :class:`QuantExperts` (fused ``w13``/``w2``),
    ``nn.Linear`` modules become :class:`QuantLinear`, following ``config``'s rules and the default policy."""
    qcfg = QuantConfig.of(config)
    arch = get_arch(model.config)
    experts, linears = plan(model, arch, qcfg)
    targets = [(n, m) for n, m in model.named_modules()]
    for name, mod in targets:
        if name in experts:
            fmt, fmt2 = experts[name]
            if fmt.name == "none":
                continue
            b = ExpertsBuilder(name, mod, arch, fmt, activation_for(arch, mod, model.config), mod.gate_up_proj.dtype,
                               fmt2)
            b.put_fused("gate_up_proj", lambda i: mod.gate_up_proj.data[i], tuple(mod.gate_up_proj.shape), name)
            b.put_fused("down_proj", lambda i: mod.down_proj.data[i], tuple(mod.down_proj.shape), name)
            if b.has_bias:
                b.put_bias("gate_up_proj", mod.gate_up_proj_bias.data, name)
                b.put_bias("down_proj", mod.down_proj_bias.data, name)
            install_experts(model, name, b.build(), arch)
        elif name in linears:
            bias = None if mod.bias is None else mod.bias.data
            set_module(model, name, quantize_linear(name, mod.weight.data, bias, linears[name]))
    model.config.quantization_config = quantization_config(model, qcfg)
    return model


def save(model: nn.Module, out: str | os.PathLike, overwrite: bool = False, source: str | os.PathLike | None = None,
         shard_bytes: int | None = None) -> Path:
    """Write ``model`` (quantized or not) as safetensors + config.json into ``out`` atomically; tokenizer and
    generation files are copied from ``source`` when given."""
    out = Path(out)
    qc = getattr(model.config, "quantization_config", None)
    with atomic_dir(out, overwrite, model_sources(model, source)) as tmp:
        items = list(unique_tensors(model.state_dict().items()))  # tied weights saved once
        kw = {} if shard_bytes is None else {"shard_bytes": shard_bytes}
        write_shards(iter(items), tmp, {"format": "pt", "producer": "moeq"}, **kw)
        model.config.save_pretrained(tmp)
        if qc is not None:  # transformers may drop unknown quantization configs: write ours verbatim
            cfg_path = tmp / "config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["quantization_config"] = qc
            cfg_path.write_text(json.dumps(cfg, indent=2))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        copy_side_files(source, tmp)
    return out


ACTIVATIONS = ("default", "int8")


def set_activations(model: nn.Module, mode: str) -> dict[str, list[str]]:
    """Choose the activations' numerics of the CPU decode kernels (1-8 rows per weight): ``"default"`` (the model's
    dtype: bf16 or fp32 activations, the numerics moeq is tested against transformers with) or ``"int8"`` (each
    activation row quantized per block of 32 to int8, as llama.cpp's Q4_0/Q8_0 dot products take it: integer dot
    products, faster on CPUs where the default rows are compute-bound; its accuracy cost is reported by ``moeq eval
    --activations int8``). Weights outside the int8 kernels (asymmetric RTN, NF4/FP4, 3/5-bit grids, LLM.int8) keep
    the default numerics; a warning names them. Prompts (more rows) always take the default path. Returns the module
    names per numerics."""
    from moeq.kernels.describe import takes_int8  # noqa: PLC0415
    from moeq.nn import QuantExperts, QuantLinear  # noqa: PLC0415

    if mode not in ACTIVATIONS:
        raise MoeqError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {mode!r}")
    out: dict[str, list[str]] = {"int8": [], "default": []}
    for name, mod in model.named_modules():
        if not isinstance(mod, (QuantLinear, QuantExperts)):
            continue
        mod.activations = mode
        if mode == "int8":
            ws = [mod.qweight] if isinstance(mod, QuantLinear) else [mod.packed(s, raw=True) for s in ("w13", "w2")]
            out["int8" if all(takes_int8(w) for w in ws) else "default"].append(name)
        else:
            out["default"].append(name)
    if mode == "int8" and out["default"]:
        log.warning("int8 activations: %d quantized modules keep the default numerics (their formats are outside the "
                    "int8 kernels), e.g. %s", len(out["default"]), ", ".join(out["default"][:3]))
    pages.back(model)  # weights laid out anew for these numerics: on 2 MB pages again
    return out


def packed_weights(model: nn.Module) -> dict[str, PackedWeight]:
    out = {}
    for name, mod in model.named_modules():
        for slot, w in packed_slots(mod).items():
            out[f"{name}.{slot}"] = w
    return out


def inspect(model: nn.Module) -> dict:
    """Per-module format, bits/weight and bytes; totals for quantized, unquantized and all weights."""
    rows = []
    q_bytes = q_params = 0
    for name, w in packed_weights(model).items():
        rows.append({"module": name, "format": w.format, "detail": {k: v for k, v in w.meta().items() if k != "shape"},
                     "shape": list(w.shape), "bits_per_weight": w.bits_per_weight, "bytes": w.nbytes})
        q_bytes += w.nbytes
        q_params += w.numel
    seen = set()
    other_bytes = other_params = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        other_bytes += p.numel() * p.element_size()
        other_params += p.numel()
        if p.ndim >= 2:
            rows.append({"module": name, "format": str(p.dtype).removeprefix("torch."), "detail": {},
                         "shape": list(p.shape), "bits_per_weight": 8.0 * p.element_size(),
                         "bytes": p.numel() * p.element_size()})
    for name, mod in model.named_modules():  # kept bf16 heads held in bf12: bf16 as saved, 12 bits in memory
        if isinstance(mod, Bf12Linear):
            n = mod.in_features * mod.out_features
            other_bytes += 2 * n
            other_params += n
            rows.append({"module": f"{name}.weight", "format": "bfloat16",
                         "detail": {"in_memory": "bf12", "bytes_in_memory": mod.nbytes()},
                         "shape": [mod.out_features, mod.in_features], "bits_per_weight": 16.0, "bytes": 2 * n})
    total_params = q_params + other_params
    return {"modules": rows, "quantized_params": q_params, "quantized_bytes": q_bytes,
            "unquantized_params": other_params, "unquantized_bytes": other_bytes,
            "total_bytes": q_bytes + other_bytes,
            "bits_per_weight": 8.0 * (q_bytes + other_bytes) / max(total_params, 1),
            "quantized_bits_per_weight": 8.0 * q_bytes / max(q_params, 1)}
