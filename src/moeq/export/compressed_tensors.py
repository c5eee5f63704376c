"""Export RTN models to compressed-tensors ``pack-quantized`` (what vLLM's compressed-tensors MoE path and the
``compressed_tensors`` library read): per-expert ``weight_packed`` int32 / ``weight_scale`` / ``weight_shape`` (+
``weight_zero_point`` for asymmetric grids). Lossless: compressed-tensors packs 4-bit codes low nibble first and
8-bit codes one per byte, offset by 2**(bits-1) — exactly moeq's RTN bytes, so ``weight_packed`` is ``qdata``
reinterpreted as int32, and its symmetric int4 grid is vLLM's (scale = absmax/7.5, zero point 8)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from moeq.arch import Arch
from moeq.export.common import expert_pieces, plain_tensors, quantized_modules, write_config
from moeq.formats import RTNWeight
from moeq.formats.rtn import CODEBOOKS
from moeq.io.writer import write_shards
from moeq.nn import QuantExperts
from moeq.nn.packed import packed_meta
from moeq.errors import MoeqError

SUPPORTS = "RTN int4/int8 weights on integer grids (symmetric or asymmetric, group size or per-row)"


def weight_args(w: RTNWeight) -> dict:
    gs = w.group_size
    return {"num_bits": w.bits, "type": "int", "symmetric": w.zero is None,
            "strategy": "channel" if gs == -1 else "group", "group_size": None if gs == -1 else gs,
            "dynamic": False, "observer": "minmax", "actorder": None, "block_structure": None}


def _check(model: nn.Module, arch: Arch) -> None:
    for name, mod in quantized_modules(model):
        for slot, meta in packed_meta(mod).items():
            if meta["format"] != "rtn" or meta["bits"] not in (4, 8) or meta["grid"] in CODEBOOKS:
                what = meta["format"] + (f" {meta['bits']}-bit grid {meta['grid']}" if meta["format"] == "rtn" else "")
                raise MoeqError(f"{name}.{slot}: {what} has no compressed-tensors pack-quantized form; it takes "
                                 f"{SUPPORTS} (NF4/FP4/LLM.int8 models export with --format bnb)")
        if isinstance(mod, QuantExperts) and mod.b13 is not None:
            raise MoeqError(f"{name}: experts with biases are not exported to compressed-tensors")


def pack_state(w: RTNWeight, prefix: str) -> list[tuple[str, torch.Tensor]]:
    n, k = w.shape
    if (k * w.bits) % 32:
        raise MoeqError(f"{prefix}weight: {k} inputs x {w.bits} bits is not a whole number of int32 words")
    out = [(prefix + "weight_packed", w.qdata.contiguous().view(torch.int32)),
           (prefix + "weight_scale", w.scale.contiguous() if w.group_size != -1 else w.scale.reshape(n, 1)),
           (prefix + "weight_shape", torch.tensor([n, k], dtype=torch.int64))]
    if w.zero is not None:  # signed zero point, packed along the output dim like compressed-tensors does
        from moeq.formats.packing import pack  # noqa: PLC0415

        z = w.zero.to(torch.int32)  # unsigned codes == signed + 2**(bits-1)
        rows = z.shape[0]
        if (rows * w.bits) % 32:
            raise MoeqError(f"{prefix}weight_zero_point: {rows} rows cannot be packed in whole int32 words")
        zp = pack(z.t().contiguous().to(torch.uint8), w.bits).contiguous().view(torch.int32).t().contiguous()
        out.append((prefix + "weight_zero_point", zp))
    return out


def export(model: nn.Module, out: Path, arch: Arch) -> dict:
    _check(model, arch)
    groups: dict[tuple, list[str]] = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    quantized = set()
    for name, mod in quantized_modules(model):
        quantized.add(name)
        if isinstance(mod, QuantExperts):
            for e, kind, w in expert_pieces(mod):
                key = arch.disk_expert_key(name, e, kind)
                tensors += pack_state(w, key + ".")
                groups.setdefault(tuple(sorted(weight_args(w).items(), key=str)), []).append(key)
        else:
            key = arch.to_disk(name)
            tensors += pack_state(mod.qweight, key + ".")
            if mod.bias is not None:
                tensors.append((key + ".bias", mod.bias.detach()))
            groups.setdefault(tuple(sorted(weight_args(mod.qweight).items(), key=str)), []).append(key)
    ignore = []
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if name in quantized or not isinstance(w, torch.Tensor) or w.ndim != 2 or "embed" in name:
            continue
        ignore.append(arch.to_disk(name))
    tensors += list(plain_tensors(model, arch, quantized))
    tensors.sort(key=lambda kv: kv[0])
    # the largest group targets every Linear; the others name their modules (exact names win over class names)
    ordered = sorted(groups.items(), key=lambda kv: -len(kv[1]))
    config_groups = {}
    for i, (args, names) in enumerate(ordered):
        config_groups[f"group_{i}"] = {"targets": ["Linear"] if i == 0 else sorted(names), "weights": dict(args),
                                       "input_activations": None, "output_activations": None,
                                       "format": "pack-quantized"}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": config_groups, "ignore": sorted(ignore), "kv_cache_scheme": None,
          "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}, "version": "0.20.0"}
    write_shards(iter(tensors), out, {"format": "pt"})
    write_config(model, out, qc)
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
            "config_groups": len(config_groups), "kept_unquantized": sorted(ignore)}
