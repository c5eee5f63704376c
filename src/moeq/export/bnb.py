"""Export to the transformers + bitsandbytes layout: per-expert 4-bit (NF4/FP4, double quant as stored) or LLM.int8
keys under the family's classic names, a ``quantization_config`` with ``quant_method: bitsandbytes``. Lossless:
the packed bytes and statistics are moeq's own (per-expert slices are exactly bitsandbytes states)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from moeq.arch import Arch
from moeq.export.common import expert_pieces, plain_tensors, quantized_modules, write_config
from moeq.io.writer import write_shards
from moeq.convert import module_layout
from moeq.nn import QuantExperts
from moeq.nn.packed import packed_slots
from moeq.errors import MoeqError

SUPPORTS = "NF4/FP4 (any blocksize, double quant or not) and LLM.int8 weights"


def _check(model: nn.Module, arch: Arch) -> tuple[str, dict]:
    kinds = set()
    for name, mod in quantized_modules(model):
        for slot, w in packed_slots(mod).items():
            fmt = w.format
            if fmt == "bnb4":
                kinds.add(("bnb4", w.quant_type, w.double_quant))
            elif fmt == "int8":
                kinds.add(("int8",))
            else:
                raise MoeqError(f"{name}.{slot}: format {fmt!r} has no bitsandbytes layout; the bnb export takes "
                                 f"{SUPPORTS} (re-quantize with --method nf4|fp4|int8, or export rtn models with "
                                 "--format compressed-tensors)")
        if isinstance(mod, QuantExperts) and not arch.per_expert_on_disk:
            raise MoeqError(f"{name}: {arch.model_types[0]} checkpoints hold fused 3-D experts, which bitsandbytes "
                             "never quantized; no bitsandbytes layout exists for them")
        if isinstance(mod, QuantExperts) and mod.b13 is not None:
            raise MoeqError(f"{name}: experts with biases have no per-expert bitsandbytes layout")
    if len(kinds) != 1:
        raise MoeqError(f"a bitsandbytes checkpoint has one global setting; this model mixes {sorted(kinds)}")
    kind = kinds.pop()
    if kind[0] == "int8":
        qc = {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False, "_load_in_8bit": True,
              "_load_in_4bit": False, "llm_int8_threshold": 6.0, "llm_int8_has_fp16_weight": False,
              "llm_int8_enable_fp32_cpu_offload": False}
    else:
        dtype = str(next(p for p in model.parameters() if p.is_floating_point()).dtype).removeprefix("torch.")
        qc = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "_load_in_4bit": True,
              "_load_in_8bit": False, "bnb_4bit_quant_type": kind[1], "bnb_4bit_use_double_quant": kind[2],
              "bnb_4bit_compute_dtype": dtype, "bnb_4bit_quant_storage": "uint8", "llm_int8_threshold": 6.0,
              "llm_int8_has_fp16_weight": False, "llm_int8_enable_fp32_cpu_offload": False}
    return kind[0], qc


LAYOUTS = ("transformers5", "transformers4")


def export(model: nn.Module, out: Path, arch: Arch, layout: str = "transformers5") -> dict:
    """``transformers5`` (default): what transformers 5 + bitsandbytes loads with a plain ``from_pretrained`` —
    quantized Linears in bitsandbytes' layout, experts as transformers 5's fused bf16 params (its bitsandbytes
    integration quantizes only nn.Linear, so quantized experts have no place there: they are written dequantized,
    the values moeq computes with). ``transformers4``: per-expert quantized weights, transformers 4.x names, the
    layout vLLM's bitsandbytes loader and transformers 4.x read (and moeq, losslessly); transformers 5 cannot."""
    if layout not in LAYOUTS:
        raise MoeqError(f"unknown bnb layout {layout!r}; valid: {list(LAYOUTS)}")
    _, qc = _check(model, arch)
    skip = []  # unquantized nn.Linear modules, as transformers+bitsandbytes names them
    quantized = {name for name, _ in quantized_modules(model)}
    for name, mod in model.named_modules():  # unquantized Linears and routers (Linears in transformers 4.x)
        w = getattr(mod, "weight", None)
        if name in quantized or not isinstance(w, torch.Tensor) or w.ndim != 2 or "embed" in name:
            continue
        skip.append(arch.to_disk(name))
    qc["llm_int8_skip_modules"] = sorted(set(skip)) or None
    tensors: list[tuple[str, torch.Tensor]] = []
    n_experts, dense_experts = 0, []
    for name, mod in quantized_modules(model):
        if isinstance(mod, QuantExperts) and layout == "transformers5":
            dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
            gate_up, down, _ = module_layout(arch, mod.w13.dequantize(dtype), mod.w2.dequantize(dtype))
            tensors += [(arch.to_disk(name) + ".gate_up_proj", gate_up), (arch.to_disk(name) + ".down_proj", down)]
            dense_experts.append(name)
        elif isinstance(mod, QuantExperts):
            for e, kind, w in expert_pieces(mod):
                tensors += _state(w, arch.disk_expert_key(name, e, kind) + ".")
            n_experts += mod.num_experts
        else:
            tensors += _state(mod.qweight, arch.to_disk(name) + ".")
            if mod.bias is not None:
                tensors.append((arch.to_disk(name) + ".bias", mod.bias.detach()))
    tensors += list(plain_tensors(model, arch, quantized))
    tensors.sort(key=lambda kv: kv[0])
    write_shards(iter(tensors), out, {"format": "pt"})
    write_config(model, out, qc)
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
            "experts_split": n_experts, "layout": layout, "experts_dequantized": dense_experts,
            "kept_unquantized": qc["llm_int8_skip_modules"] or []}


def _state(w, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """The keys transformers + bitsandbytes hold for one weight (its format's own ``state_dict``; SUPPORTS admits
    only formats that have one)."""
    return [(k, v.contiguous()) for k, v in w.state_dict(prefix).items()]
