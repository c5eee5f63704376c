"""The saved moeq checkpoint format: ``config.json``'s ``quantization_config`` (:func:`quantization_config` writes
it) lists every quantized module with its slots' formats and metadata; its tensors are ``{module}.{slot}_{field}``.
:func:`restore` rebuilds such a checkpoint without re-quantizing, memory-mapped, validating every packed weight and
its shapes against the model config before anything runs on it."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers.activations import ACT2FN

from moeq.arch import get_arch
from moeq.config import QuantConfig
from moeq.convert import activation_for, experts_dims, install_experts, is_experts, set_module
from moeq.errors import MoeqError
from moeq.formats import WEIGHT_TYPES
from moeq.io.safetensors_io import Checkpoint
from moeq.readers.state import compute_dtype, finish_model, load_generation_config, set_or_note_unused, skeleton
from moeq.nn import Activation, QuantExperts, QuantLinear
from moeq.record import FORMAT_VERSION, QUANT_METHOD
from moeq.version import __version__

def _saved_entry(path: Path, name: str, entry) -> tuple[str, dict, bool]:
    """Check one ``modules`` entry of a saved moeq config: its type, slots and flags, naming the module at fault."""
    where = f"{path}: quantization_config.modules[{name!r}]"
    if not isinstance(entry, dict) or entry.get("type") not in ("experts", "linear"):
        raise MoeqError(f"{where}: expected an object with type 'experts' or 'linear'")
    slots = entry.get("slots")
    want = {"w13", "w2"} if entry["type"] == "experts" else {"weight"}
    if not isinstance(slots, dict) or set(slots) != want:
        raise MoeqError(f"{where}: slots must be exactly {sorted(want)}")
    for key in ("bias", "weight_on_input"):
        if not isinstance(entry.get(key, False), bool):
            raise MoeqError(f"{where}: {key} must be true or false")
    return entry["type"], slots, bool(entry.get("bias"))


def _saved_activation(where: str, spec) -> Activation:
    fields = {f.name: f.type for f in dataclasses.fields(Activation)}
    if not isinstance(spec, dict) or set(spec) - set(fields):
        raise MoeqError(f"{where}: activation must be an object with keys among {sorted(fields)}")
    act = Activation(**spec)
    if act.kind not in ("glu", "gptoss") or not isinstance(act.act, str) or act.act not in ACT2FN or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in (act.alpha, act.limit)):
        raise MoeqError(f"{where}: activation {spec} is not one moeq knows")
    return act


def claims(found) -> bool:
    return bool(found.qc) and found.qc.get("quant_method") == QUANT_METHOD


def read(found, quant, dtype, progress: bool) -> nn.Module:
    """The :mod:`moeq.readers` entry: a saved moeq checkpoint, restored as saved (no method)."""
    if quant is not None:
        raise MoeqError(f"{found.path} is already a moeq checkpoint ({found.qc.get('formats')}); load it without "
                        "a method")
    return restore(found.path, found.ckpt, found.config, found.qc, dtype, progress)


def check_versions(path: Path, qc: dict) -> None:
    """A saved checkpoint's layout (``format_version``) and its recorded config must be ones this moeq reads: a
    newer one is refused ("written by a newer moeq") rather than read as if it were the old layout."""
    fv = qc.get("format_version", 1)
    if type(fv) is not int or fv < 1:
        raise MoeqError(f"{path}: quantization_config.format_version must be a positive integer, got {fv!r}")
    if fv > FORMAT_VERSION:
        raise MoeqError(f"{path}: saved in layout version {fv}, written by a newer moeq (this one, {__version__}, "
                        f"reads up to {FORMAT_VERSION}); upgrade moeq")
    if "config" in qc:
        try:
            QuantConfig.from_dict(qc["config"])
        except MoeqError as e:
            raise MoeqError(f"{path}: quantization_config.config: {e}") from None


def restore(path: Path, ckpt: Checkpoint, config, qc: dict, dtype, progress: bool) -> nn.Module:
    check_versions(path, qc)
    dtype = compute_dtype(config, dtype)
    model = skeleton(config, dtype)
    arch = get_arch(config)
    modules = qc.get("modules", {})
    if not isinstance(modules, dict):
        raise MoeqError(f"{path}: quantization_config.modules must be an object")
    used: set[str] = set()
    for name, entry in tqdm(modules.items(), desc="mapping", unit="module", disable=not progress):
        kind, slot_meta, has_bias = _saved_entry(path, name, entry)
        try:
            target = model.get_submodule(name)
        except AttributeError:
            raise MoeqError(f"{path}: quantization_config names module {name!r}, which the model built from "
                            "config.json does not have") from None
        slots = {}
        for slot, meta in slot_meta.items():
            where = f"{path}: {name}.{slot}"
            fmt = meta.get("format") if isinstance(meta, dict) else None
            if not isinstance(fmt, str) or fmt not in WEIGHT_TYPES:
                raise MoeqError(f"{where}: unknown format {fmt!r}; valid: {sorted(WEIGHT_TYPES)}")
            cls = WEIGHT_TYPES[fmt]
            tensors = {}
            for field in cls.tensor_names():
                key = f"{name}.{slot}_{field}"
                if key in ckpt:
                    tensors[field] = ckpt.mmap(key)
                    used.add(key)
            meta = {k: v for k, v in meta.items() if k != "format"}
            slots[slot] = cls.from_untrusted(tensors, meta, where)
        if kind == "experts":
            if not is_experts(target):
                raise MoeqError(f"{path}: {name} is saved as experts but is not an experts module in this model")
            e, h, i = experts_dims(target, arch)
            _expect_shape(path, name, "w13", slots["w13"].shape, (e, 2 * i, h))
            _expect_shape(path, name, "w2", slots["w2"].shape, (e, h, i))
            b13 = b2 = None
            if has_bias:
                b13, b2 = (_saved_tensor(path, ckpt, f"{name}.{b}", shape, dtype, used)
                           for b, shape in (("b13", (e, 2 * i)), ("b2", (e, h))))
            # what the record says must be what the model config defines (the config is the model)
            act = _saved_activation(f"{path}: {name}", entry.get("activation", {}))
            want_act, want_woi = activation_for(arch, target, config), arch.weight_on_input
            if act != want_act or entry.get("weight_on_input", False) != want_woi:
                raise MoeqError(f"{path}: {name}: saved activation {vars(act)} / weight_on_input "
                                f"{entry.get('weight_on_input', False)} contradict the model config "
                                f"({vars(want_act)} / {want_woi})")
            new = QuantExperts(slots["w13"], slots["w2"], act, b13, b2, weight_on_input=want_woi)
            install_experts(model, name, new, arch)
        else:
            if not isinstance(target, nn.Linear):
                raise MoeqError(f"{path}: {name} is saved as a linear but is not an nn.Linear in this model")
            _expect_shape(path, name, "weight", slots["weight"].shape, tuple(target.weight.shape))
            bias = None
            if has_bias:
                bias = _saved_tensor(path, ckpt, f"{name}.bias", (target.out_features,), dtype, used)
            set_module(model, name, QuantLinear(slots["weight"], bias))
    unused = []
    for key in ckpt.keys():
        if key not in used:
            set_or_note_unused(model, key, ckpt.mmap(key), key, unused)
    load_generation_config(model, path)
    return finish_model(model, unused, config)


def _expect_shape(path: Path, name: str, slot: str, got: tuple, want: tuple) -> None:
    if tuple(got) != tuple(want):
        raise MoeqError(f"{path}: {name}.{slot}: declared shape {list(got)} does not match the model config "
                        f"(expected {list(want)})")


def _saved_tensor(path: Path, ckpt: Checkpoint, key: str, shape: tuple, dtype: torch.dtype, used: set) -> torch.Tensor:
    if key not in ckpt:
        raise MoeqError(f"{path}: tensor {key} is missing")
    t = ckpt.mmap(key)
    if tuple(t.shape) != tuple(shape) or not t.is_floating_point():
        raise MoeqError(f"{path}: tensor {key}: {t.dtype} {list(t.shape)}, expected a float tensor {list(shape)}")
    if not torch.isfinite(t).all():
        raise MoeqError(f"{path}: tensor {key}: non-finite value(s) (NaN/Inf)")
    used.add(key)
    return t if t.dtype == dtype else t.to(dtype)
