"""Hold a :class:`PackedWeight` inside an ``nn.Module``: its tensors as buffers (so ``.to()``, ``state_dict`` and
safetensors see them), its metadata as a plain attribute. Buffer names are ``{slot}_{field}``.

A slot may be held in the il16 decode layout (:func:`set_il16`: 4-bit codes and scales interleaved by 16 rows, the
native decode kernels' layout, ``moeq/native/csrc/il16_rows.h``) instead of row-major — the same bytes permuted, no
second copy. Everything outside those kernels sees the row-major layout: :func:`get_packed` (unless ``raw``) and
``state_dict`` return it, and ``load_state_dict`` takes it (hooks installed by :func:`set_il16`)."""
from __future__ import annotations

import torch
from torch import nn

from moeq.formats import WEIGHT_TYPES, PackedWeight
from moeq.formats.packing import from_il16, to_il16
from moeq.kernels import plans

IL16_UNITS = {"qdata": 2, "scale": 1}  # the RTN fields il16 permutes: 2-byte units of codes, one scale per unit


def set_packed(module: nn.Module, slot: str, q: PackedWeight) -> None:
    meta = getattr(module, "_packed_meta", None)
    if meta is None:
        meta = {}
        module._packed_meta = meta
    old = meta.get(slot)
    if old is not None:
        for field in WEIGHT_TYPES[old["format"]].tensor_names():
            module._buffers.pop(f"{slot}_{field}", None)
    il16_slots(module).discard(slot)
    for field, t in q.tensors().items():
        module.register_buffer(f"{slot}_{field}", t, persistent=True)
    meta[slot] = {"format": q.format, **q.meta()}
    plans.invalidate(module)


def get_packed(module: nn.Module, slot: str, raw: bool = False) -> PackedWeight:
    """The slot's weight, row-major (an il16 slot permuted back into new tensors), or with ``raw`` its buffers as
    they are (the native kernels' view; :func:`is_il16` says which layout)."""
    meta = dict(module._packed_meta[slot])
    cls = WEIGHT_TYPES[meta.pop("format")]
    tensors = {f: module._buffers.get(f"{slot}_{f}") for f in cls.tensor_names()}
    if not raw and slot in il16_slots(module):
        tensors = {f: from_il16(t, IL16_UNITS[f]) if f in IL16_UNITS else t for f, t in tensors.items()}
    return cls.from_parts(tensors, meta)


def holds(module: nn.Module, slot: str) -> bool:
    """Whether ``module`` holds a packed weight in ``slot`` — without building it (``hasattr(m, "qweight")`` on a
    QuantLinear would permute an il16 weight back into new tensors just to answer)."""
    return slot in module.__dict__.get("_packed_meta", {})


def packed_meta(module: nn.Module) -> dict[str, dict]:
    """``{slot: {"format": ..., **meta}}`` of a module holding packed weights (a copy; empty for other modules)."""
    return {slot: dict(meta) for slot, meta in getattr(module, "_packed_meta", {}).items()}


def packed_slots(module: nn.Module) -> dict[str, PackedWeight]:
    """``{slot: PackedWeight}`` of a module holding packed weights, row-major (empty for other modules)."""
    return {slot: get_packed(module, slot) for slot in getattr(module, "_packed_meta", {})}


def il16_slots(module: nn.Module) -> set[str]:
    slots = module.__dict__.get("_il16_slots")
    if slots is None:
        slots = module.__dict__["_il16_slots"] = set()
    return slots


def is_il16(module: nn.Module, slot: str) -> bool:
    return slot in il16_slots(module)


def set_il16(module: nn.Module, slot: str, on: bool) -> None:
    """Hold the slot (an RTN weight) in the il16 layout (``on``) or row-major: its codes and scales are permuted into
    new buffers (the old ones are freed once nothing else holds them)."""
    if on == is_il16(module, slot):
        return
    _install_hooks(module)
    fn = to_il16 if on else from_il16
    for field, unit in IL16_UNITS.items():
        key = f"{slot}_{field}"
        module._buffers[key] = fn(module._buffers[key], unit)
    (il16_slots(module).add if on else il16_slots(module).discard)(slot)
    plans.invalidate(module)


def _install_hooks(module: nn.Module) -> None:
    if module.__dict__.get("_il16_hooks"):
        return
    module._register_state_dict_hook(_state_dict_row_major)
    module._register_load_state_dict_pre_hook(_load_into_il16, with_module=True)
    module.__dict__["_il16_hooks"] = True


def _state_dict_row_major(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    for slot in il16_slots(module):
        for field, unit in IL16_UNITS.items():
            key = prefix + f"{slot}_{field}"
            if key in state:
                t = state[key]
                state[key] = from_il16(t.detach() if isinstance(t, torch.Tensor) else t, unit)


def _load_into_il16(module: nn.Module, state: dict, prefix: str, *args) -> None:
    for slot in il16_slots(module):
        for field, unit in IL16_UNITS.items():
            key = prefix + f"{slot}_{field}"
            if key in state and isinstance(state[key], torch.Tensor) and state[key].shape == module._buffers[
                    f"{slot}_{field}"].shape:
                state[key] = to_il16(state[key], unit)


class DecodeLayout:
    """Mixin of the quantized modules (QuantLinear, QuantExperts): the decode options ``activations`` and
    ``decode_layout``, and the il16 choice for the slots in ``IL16_SLOTS``. The subclass sets ``self.kernel`` and
    defines ``_il16_takes()`` (whether its native kernels take those slots in il16)."""

    IL16_SLOTS: tuple[str, ...] = ()

    def _init_layout(self, decode_layout: str = "auto") -> None:
        self.__dict__["_activations"] = "default"
        self.__dict__["_decode_layout"] = decode_layout

    def packed(self, slot: str, raw: bool = False) -> PackedWeight:
        """A slot's weight, row-major (a permuted copy while held in il16), or with ``raw`` as held (the native
        kernels' view; see :meth:`il16`)."""
        return get_packed(self, slot, raw)

    def slot_device(self, slot: str) -> torch.device:
        """Where the slot's tensors live (read from its buffers, without assembling the weight)."""
        return next(t for k, t in self._buffers.items() if k.startswith(slot + "_") and t is not None).device

    def il16(self, slot: str) -> bool:
        """Whether the slot is held in the il16 decode layout (``moeq/native/csrc/il16_rows.h``)."""
        return is_il16(self, slot)

    @property
    def activations(self) -> str:
        """Decode numerics: ``"default"`` or ``"int8"`` (:func:`moeq.set_activations`' option)."""
        return self.__dict__["_activations"]

    @activations.setter
    def activations(self, mode: str) -> None:
        self.__dict__["_activations"] = mode
        plans.invalidate(self)
        self.choose_layout()

    @property
    def decode_layout(self) -> str:
        """``"auto"``: 4-bit weights take the il16 decode layout where :meth:`choose_layout` finds its kernels;
        ``"rows"``: always row-major (e.g. to compare the two)."""
        return self.__dict__["_decode_layout"]

    @decode_layout.setter
    def decode_layout(self, layout: str) -> None:
        if layout not in ("auto", "rows"):
            raise ValueError(f"decode_layout must be 'auto' or 'rows', got {layout!r}")
        self.__dict__["_decode_layout"] = layout
        self.choose_layout()

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)  # .to(), .float(), ...: new buffers, so new plans
        plans.invalidate(self)
        self.choose_kernel()
        return out

    def choose_layout(self) -> bool:
        """Hold the slots in the il16 decode layout (the same bytes permuted: 16 output rows per vector, 1.2-1.8x the
        row-major decode kernels) where every kernel the module then runs reads it: the native CPU kernel, the
        default activations, bf16 weights, AVX512-BF16 builds, symmetric 4-bit weights with N % 16 == 0 and
        K % 64 == 0 (``moeq_il16_takes``); otherwise row-major. Returns whether il16 is on."""
        on = (self.decode_layout == "auto" and getattr(self, "kernel", None) == "native"
              and self.activations == "default" and self._il16_takes())
        for slot in self.IL16_SLOTS:
            set_il16(self, slot, on)
        return on

    def _il16_takes(self) -> bool:
        return False
