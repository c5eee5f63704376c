"""``moeq.load``: build the model skeleton with parameters on the meta device, then stream the checkpoint one tensor
(or one expert slice) at a time, quantizing in flight. Also restores saved moeq checkpoints without re-quantizing.
Ends by checking that every checkpoint key was used and every parameter filled, naming any that were not."""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.activations import ACT2FN

from moeq.arch import FUSED_KEY_RE, Arch, get_arch
from moeq.config import QuantConfig
from moeq.convert import (
    ExpertsBuilder, activation_for, existing_bias, experts_dims, install_experts, is_experts, quantize_linear,
    set_module,
)
from moeq.formats import WEIGHT_TYPES
from moeq.formats.base import check_finite
from moeq.io.safetensors_io import Checkpoint
from moeq.nn import Activation, QuantExperts, QuantLinear, attention, decode
from moeq.nn.linear import canonicalize_head_input
from moeq.errors import CheckpointNotFound, MoeqError

log = logging.getLogger(__name__)
QUANT_METHOD = "moeq"


def release_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise, inflating RSS while streaming)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Create parameters on the meta device (buffers stay real: rotary tables etc. are computed at init)."""
    orig = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        orig(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = orig


def _skeleton(config, dtype: torch.dtype) -> nn.Module:
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        del config.quantization_config
    check_config(config)
    try:
        with meta_parameters():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except MoeqError:
        raise
    except Exception as e:  # transformers' own checks of an untrusted config.json, in whatever type it raises
        raise MoeqError(f"the model described by config.json cannot be built: {type(e).__name__}: {e}") from None
    finally:
        if qc is not None:
            config.quantization_config = qc
    return model


# config.json sizes that must be positive integers (when present), and the most any real model uses times ~100
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
          "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
          "num_local_experts", "n_routed_experts", "num_experts_per_tok", "max_position_embeddings")
_MAX_SIZE = 1 << 31


def check_config(config) -> None:
    """Refuse a config.json whose sizes are not positive integers or whose top-k exceeds its experts: clear
    errors instead of tracebacks (or hangs) deep inside the model constructor."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _SIZES:
        v = getattr(text, name, None)
        if v is None:
            continue
        if type(v) is not int or not 0 < v < _MAX_SIZE:
            raise MoeqError(f"config.json: {name} = {v!r} must be a positive integer below {_MAX_SIZE}")
    experts = next((getattr(text, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(text, n, None)), None)
    top_k = getattr(text, "num_experts_per_tok", None)
    if experts and top_k and top_k > experts:
        raise MoeqError(f"config.json: num_experts_per_tok = {top_k} exceeds the {experts} experts")


def _compute_dtype(config, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if d in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def _set_tensor(model: nn.Module, name: str, t: torch.Tensor, key: str) -> None:
    mod_name, _, attr = name.rpartition(".")
    try:
        mod = model.get_submodule(mod_name) if mod_name else model
    except AttributeError:
        raise MoeqError(f"{key}: no module {mod_name!r} in the model built from config.json (unexpected key)") from None
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise MoeqError(f"{key}: {int((~torch.isfinite(t)).sum())} non-finite value(s) (NaN/Inf)")
    cur = mod._parameters.get(attr, mod._buffers.get(attr))
    if cur is None:  # absent, or registered as None (e.g. a Linear built without bias): not the model's
        raise MoeqError(f"{key}: the model has no parameter or buffer {name!r} (unexpected key)")
    if cur.is_floating_point() and not t.is_floating_point():
        raise MoeqError(f"{key}: stored as {t.dtype}, but the model holds it as a floating-point tensor")
    if tuple(cur.shape) != tuple(t.shape):
        raise MoeqError(f"{key}: shape {list(t.shape)} does not match the config (expected {list(cur.shape)})")
    dtype = cur.dtype if cur.is_floating_point() else t.dtype
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(t.to(dtype), requires_grad=False)
    else:
        mod._buffers[attr] = t.to(dtype)


def _load_generation_config(model: nn.Module, path: Path) -> None:
    if (path / "generation_config.json").exists():
        with contextlib.suppress(Exception):
            model.generation_config = GenerationConfig.from_pretrained(path)


def _finish(model: nn.Module, unused: list[str], config) -> nn.Module:
    tie = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                  "tie_word_embeddings", False)
    lm = getattr(model, "lm_head", None)
    if tie and isinstance(lm, nn.Linear) and lm.weight.device.type == "meta":
        lm.weight = model.get_input_embeddings().weight
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing or unused:
        parts = []
        if missing:
            parts.append(f"{len(missing)} parameter(s) not filled by the checkpoint: {', '.join(missing[:10])}")
        if unused:
            parts.append(f"{len(unused)} checkpoint key(s) not used: {', '.join(unused[:10])}")
        raise MoeqError("; ".join(parts))
    model.eval()
    model.requires_grad_(False)
    canonicalize_head_input(model)
    attention.use(model)
    decode.install(model)
    return model


def load(path: str | os.PathLike, quant: QuantConfig | str | None = None, dtype: torch.dtype | None = None,
         progress: bool = True, device: str | torch.device | None = None) -> nn.Module:
    """Load a checkpoint directory: a moeq checkpoint as saved, or a bf16/fp16 one quantized in flight with
    ``quant`` (a :class:`QuantConfig`, a format config or a method name; None loads it unquantized).

    ``device`` (default CPU): where the model runs. On a GPU, source tensors stream from disk to the GPU one at a
    time and are quantized there; saved and pre-quantized checkpoints are moved once loaded."""
    from moeq.kernels.gpu import check_device  # noqa: PLC0415

    dev = check_device(device)
    model = _load(Path(path), quant, dtype, progress, dev)
    return model if dev.type == "cpu" else model.to(dev)


def _load(path: Path, quant, dtype, progress: bool, device: torch.device) -> nn.Module:
    ckpt = Checkpoint(path)
    _precheck_config_json(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # an untrusted file parsed by transformers: any failure is the file's
        raise MoeqError(f"{path}: cannot read config.json: {type(e).__name__}: {e}") from None
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if callable(getattr(qc, "to_dict", None)) else qc
    if qc is not None and not isinstance(qc, dict):
        raise MoeqError(f"{path}/config.json: quantization_config must be an object, got {type(qc).__name__}")
    if qc and qc.get("quant_method") == QUANT_METHOD:
        if quant is not None:
            raise MoeqError(f"{path} is already a moeq checkpoint ({qc.get('formats')}); load it without a method")
        return _load_saved(path, ckpt, config, qc, dtype, progress)
    if qc:
        from moeq.prequant import load_prequantized  # noqa: PLC0415

        return load_prequantized(path, ckpt, config, qc, quant, dtype, progress)
    ckpt.device = device  # in flight: each tensor is read onto the device and quantized there
    return _load_streaming(path, ckpt, config, QuantConfig.of(quant or "none"), dtype, progress)


def _precheck_config_json(path: Path) -> None:
    """What transformers would trip over with an unrelated traceback: config.json must be a JSON object, and its
    quantization_config (when present) an object too."""
    f = path / "config.json" if path.is_dir() else path.parent / "config.json"
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointNotFound(f"{f}: no config.json beside the weights") from None
    except (OSError, ValueError, RecursionError) as e:
        raise MoeqError(f"{f}: unreadable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise MoeqError(f"{f}: must hold a JSON object, got {type(cfg).__name__}")
    qc = cfg.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise MoeqError(f"{f}: quantization_config must be an object, got {type(qc).__name__}")


def _load_streaming(path: Path, ckpt: Checkpoint, config, qcfg: QuantConfig, dtype, progress: bool) -> nn.Module:
    arch = get_arch(config)
    dtype = _compute_dtype(config, dtype)
    model = _skeleton(config, dtype)
    builders, linears = _plan(model, arch, qcfg, config, dtype)
    unused: list[str] = []
    pending_bias: dict[str, torch.Tensor] = {}
    keys = ckpt.keys()
    for key in tqdm(keys, desc="loading+quantizing", unit="tensor", disable=not progress):
        _route(model, ckpt, key, arch, builders, linears, pending_bias, unused)
    for name, b in pending_bias.items():  # biases that arrived before their weight
        model.get_submodule(name).bias = nn.Parameter(b, requires_grad=False)
    incomplete = [m for b in builders.values() if not b.built for m in b.missing()]
    if incomplete:
        raise MoeqError(f"checkpoint {path} lacks expert weights: {'; '.join(incomplete[:10])}"
                         + (f" (+{len(incomplete) - 10} more)" if len(incomplete) > 10 else ""))
    model.config.quantization_config = quantization_config(model, qcfg)
    _load_generation_config(model, path)
    return _finish(model, unused, config)


def _plan(model: nn.Module, arch: Arch, qcfg: QuantConfig, config, dtype):
    builders: dict[str, ExpertsBuilder] = {}
    linears: dict[str, object] = {}
    for name, mod in model.named_modules():
        if is_experts(mod):
            builders[name] = ExpertsBuilder(name, mod, arch, qcfg.for_module(name), activation_for(arch, mod, config),
                                            dtype)
        elif isinstance(mod, nn.Linear):
            fmt = qcfg.for_module(name)
            if fmt.name != "none" and not any(re.fullmatch(_glob(p), name) for p in arch.keep):
                linears[name] = fmt
    return builders, linears


def _glob(p: str) -> str:
    return re.escape(p).replace(r"\*", ".*")


def _build_if_complete(model, builders, mod: str) -> None:
    """Swap in an experts module as soon as all its pieces arrived: bounded memory (one module's pieces at a time)."""
    b = builders[mod]
    if not b.built and not b.missing():
        install_experts(model, mod, b.build(), b.arch)
        release_memory()


def _read_float(ckpt: Checkpoint, key: str, index: int | None = None) -> torch.Tensor:
    """A weight or bias from a source checkpoint: it must be floating-point (integers would be quantized as values)."""
    info = ckpt.tensors[key]
    if not info.dtype.is_floating_point:
        raise MoeqError(f"{info.file}: tensor {key}: stored as {info.dtype}; a weight or bias must be floating-point")
    return ckpt.read(key, index)


def _route(model, ckpt: Checkpoint, key: str, arch: Arch, builders, linears, pending_bias, unused) -> None:
    name = arch.rename(key)
    m = arch.expert_key_re.match(name) or FUSED_KEY_RE.match(name)
    if m and m["mod"] in builders:
        b = builders[m["mod"]]
        if "e" in m.groupdict():
            b.put(int(m["e"]), arch.proj_kind(m["proj"]), _read_float(ckpt, key), key)
        elif m["bias"]:
            b.put_bias(m["param"], _read_float(ckpt, key), key)
        else:
            b.put_fused(m["param"], lambda e: _read_float(ckpt, key, e), ckpt.tensors[key].shape, key)
        _build_if_complete(model, builders, m["mod"])
        return
    mod_name, _, attr = name.rpartition(".")
    if mod_name in linears and attr == "weight":
        lin = model.get_submodule(mod_name)
        if tuple(lin.weight.shape) != tuple(ckpt.tensors[key].shape):
            raise MoeqError(f"{key}: shape {list(ckpt.tensors[key].shape)} does not match the config "
                            f"(expected {list(lin.weight.shape)})")
        w = _read_float(ckpt, key).to(lin.weight.dtype)
        bias = existing_bias(lin, pending_bias.pop(mod_name, None))
        set_module(model, mod_name, quantize_linear(mod_name, w, bias, linears.pop(mod_name)))
        return
    if mod_name in linears and attr == "bias":
        lin = model.get_submodule(mod_name)
        if lin.bias is None:  # the config builds this Linear without a bias
            unused.append(key)
            return
        if tuple(lin.bias.shape) != tuple(ckpt.tensors[key].shape):
            raise MoeqError(f"{key}: shape {list(ckpt.tensors[key].shape)} does not match the config "
                            f"(expected {list(lin.bias.shape)})")
        b = _read_float(ckpt, key)
        check_finite(b, key)
        pending_bias[mod_name] = b.to(lin.weight.dtype)
        return
    _set_or_note_unused(model, name, ckpt.read(key), key, unused)


def _set_or_note_unused(model: nn.Module, name: str, t: torch.Tensor, key: str, unused: list[str]) -> None:
    """Set a plain tensor; a key the model has no place for is collected (reported at the end), not fatal here."""
    try:
        _set_tensor(model, name, t, key)
    except ValueError as e:
        if "unexpected key" not in str(e):
            raise
        unused.append(key)


def quantization_config(model: nn.Module, qcfg: QuantConfig) -> dict:
    """The ``quantization_config`` a saved moeq checkpoint carries: method, version, rules and per-module formats."""
    from moeq import __version__  # noqa: PLC0415

    modules, labels = {}, set()
    for name, mod in model.named_modules():
        if isinstance(mod, (QuantExperts, QuantLinear)):
            entry = {"type": "experts" if isinstance(mod, QuantExperts) else "linear",
                     "slots": {k: dict(v) for k, v in mod._packed_meta.items()}}
            if isinstance(mod, QuantExperts):
                entry["activation"] = vars(mod.activation) | {}
                entry["bias"] = mod.b13 is not None
                entry["weight_on_input"] = mod.weight_on_input
            else:
                entry["bias"] = mod.bias is not None
            modules[name] = entry
            labels.update(v["format"] for v in entry["slots"].values())
    return {"quant_method": QUANT_METHOD, "version": __version__, "format_version": 1, "config": qcfg.to_dict(),
            "formats": sorted(labels), "modules": modules}


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


def _load_saved(path: Path, ckpt: Checkpoint, config, qc: dict, dtype, progress: bool) -> nn.Module:
    dtype = _compute_dtype(config, dtype)
    model = _skeleton(config, dtype)
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
            act = _saved_activation(f"{path}: {name}", entry.get("activation", {}))
            new = QuantExperts(slots["w13"], slots["w2"], act, b13, b2,
                               weight_on_input=entry.get("weight_on_input", False))
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
            _set_or_note_unused(model, key, ckpt.mmap(key), key, unused)
    _load_generation_config(model, path)
    return _finish(model, unused, config)


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
