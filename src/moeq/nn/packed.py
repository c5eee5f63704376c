"""Hold a :class:`PackedWeight` inside an ``nn.Module``: its tensors as buffers (so ``.to()``, ``state_dict`` and
safetensors see them), its metadata as a plain attribute. Buffer names are ``{slot}_{field}``."""
from __future__ import annotations


from torch import nn

from moeq.formats import WEIGHT_TYPES, PackedWeight


def set_packed(module: nn.Module, slot: str, q: PackedWeight) -> None:
    meta = getattr(module, "_packed_meta", None)
    if meta is None:
        meta = {}
        module._packed_meta = meta
    old = meta.get(slot)
    if old is not None:
        for field in WEIGHT_TYPES[old["format"]].tensor_names():
            module._buffers.pop(f"{slot}_{field}", None)
    for field, t in q.tensors().items():
        module.register_buffer(f"{slot}_{field}", t, persistent=True)
    meta[slot] = {"format": q.format, **q.meta()}


def get_packed(module: nn.Module, slot: str) -> PackedWeight:
    meta = dict(module._packed_meta[slot])
    cls = WEIGHT_TYPES[meta.pop("format")]
    tensors = {f: module._buffers.get(f"{slot}_{f}") for f in cls.tensor_names()}
    return cls.from_parts(tensors, meta)


def packed_meta(module: nn.Module) -> dict[str, dict]:
    """``{slot: {"format": ..., **meta}}`` of a module holding packed weights (a copy; empty for other modules)."""
    return {slot: dict(meta) for slot, meta in getattr(module, "_packed_meta", {}).items()}


def packed_slots(module: nn.Module) -> dict[str, PackedWeight]:
    """``{slot: PackedWeight}`` of a module holding packed weights (empty for other modules)."""
    return {slot: get_packed(module, slot) for slot in getattr(module, "_packed_meta", {})}
