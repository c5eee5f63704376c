"""The state of one load: the model skeleton (parameters on the meta device) and what the checkpoint's tensors
are turned into as they stream in. Every source feeds the same object: a bf16/fp16 checkpoint (:meth:`LoadState.route`
per tensor, quantizing in flight) and a pre-quantized bitsandbytes one (:meth:`LoadState.route` for its plain tensors,
:meth:`LoadState.put_packed` for its quantized weights); a saved moeq checkpoint restores its modules directly
(:mod:`moeq.readers.saved`). All of them end in :func:`finish_model`, which checks that every checkpoint key was used and every
parameter filled, naming any that were not."""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import logging
from pathlib import Path
from typing import Iterator, Protocol

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from moeq.arch import FUSED_KEY_RE, Arch, get_arch
from moeq.config import FormatConfig, QuantConfig
from moeq.convert import ExpertsBuilder, activation_for, existing_bias, install_experts, plan, quantize_linear
from moeq.convert import set_module
from moeq.errors import CheckpointNotFound, MoeqError
from moeq.formats import PackedWeight
from moeq.formats.base import check_finite
from moeq.io.safetensors_io import Checkpoint
from moeq.native import pages
from moeq.nn import QuantLinear, attention, decode, engine
from moeq.nn.linear import canonicalize_head_input
from moeq.record import quantization_config

log = logging.getLogger(__name__)


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


def skeleton(config, dtype: torch.dtype) -> nn.Module:
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


# config.json sizes that must be positive integers (when present), each bounded well above any real model's so a
# hostile config cannot make the skeleton itself exhaust memory or time (65536 layers, a 2^31 vocabulary, ...)
_SIZES = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 19,
          "moe_intermediate_size": 1 << 19, "shared_expert_intermediate_size": 1 << 19, "num_hidden_layers": 1 << 10,
          "num_attention_heads": 1 << 10, "num_key_value_heads": 1 << 10, "head_dim": 1 << 12,
          "num_experts": 1 << 14, "num_local_experts": 1 << 14, "n_routed_experts": 1 << 14,
          "num_experts_per_tok": 1 << 14, "max_position_embeddings": 1 << 25}


def check_config(config) -> None:
    """Refuse a config.json whose sizes are not positive integers or whose top-k exceeds its experts: clear
    errors instead of tracebacks (or hangs) deep inside the model constructor."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name, most in _SIZES.items():
        v = getattr(text, name, None)
        if v is None:
            continue
        if type(v) is not int or not 0 < v <= most:
            raise MoeqError(f"config.json: {name} = {v!r} must be a positive integer up to {most}")
    experts = next((getattr(text, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(text, n, None)), None)
    top_k = getattr(text, "num_experts_per_tok", None)
    if experts and top_k and top_k > experts:
        raise MoeqError(f"config.json: num_experts_per_tok = {top_k} exceeds the {experts} experts")


def compute_dtype(config, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if d in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def precheck_config_json(path: Path) -> None:
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


def read_config(path: Path):
    """config.json through transformers, after :func:`precheck_config_json`; any failure is the file's."""
    precheck_config_json(path)
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # an untrusted file parsed by transformers: any failure is the file's
        raise MoeqError(f"{path}: cannot read config.json: {type(e).__name__}: {e}") from None


class UnexpectedKey(MoeqError):
    """A checkpoint key the model built from config.json has no place for."""


def set_tensor(model: nn.Module, name: str, t: torch.Tensor, key: str) -> None:
    mod_name, _, attr = name.rpartition(".")
    try:
        mod = model.get_submodule(mod_name) if mod_name else model
    except AttributeError:
        raise UnexpectedKey(f"{key}: no module {mod_name!r} in the model built from config.json") from None
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise MoeqError(f"{key}: {int((~torch.isfinite(t)).sum())} non-finite value(s) (NaN/Inf)")
    cur = mod._parameters.get(attr, mod._buffers.get(attr))
    if cur is None:  # absent, or registered as None (e.g. a Linear built without bias): not the model's
        raise UnexpectedKey(f"{key}: the model has no parameter or buffer {name!r}")
    if cur.is_floating_point() and not t.is_floating_point():
        raise MoeqError(f"{key}: stored as {t.dtype}, but the model holds it as a floating-point tensor")
    if tuple(cur.shape) != tuple(t.shape):
        raise MoeqError(f"{key}: shape {list(t.shape)} does not match the config (expected {list(cur.shape)})")
    dtype = cur.dtype if cur.is_floating_point() else t.dtype
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(t.to(dtype), requires_grad=False)
    else:
        mod._buffers[attr] = t.to(dtype)


def set_or_note_unused(model: nn.Module, name: str, t: torch.Tensor, key: str, unused: list[str]) -> None:
    """Set a plain tensor; a key the model has no place for is collected (reported at the end), not fatal here."""
    try:
        set_tensor(model, name, t, key)
    except UnexpectedKey:
        unused.append(key)


def load_generation_config(model: nn.Module, path: Path) -> None:
    if (path / "generation_config.json").exists():
        with contextlib.suppress(Exception):
            model.generation_config = GenerationConfig.from_pretrained(path)


def tied_embeddings(config) -> bool:
    return bool(getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                        "tie_word_embeddings", False))


def check_filled(model: nn.Module, unused: list[str]) -> None:
    """Every parameter filled and every checkpoint key used, or an error naming them."""
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing or unused:
        parts = []
        if missing:
            parts.append(f"{len(missing)} parameter(s) not filled by the checkpoint: {', '.join(missing[:10])}")
        if unused:
            parts.append(f"{len(unused)} checkpoint key(s) not used: {', '.join(unused[:10])}")
        raise MoeqError("; ".join(parts))


def finish_model(model: nn.Module, unused: list[str], config) -> nn.Module:
    lm = getattr(model, "lm_head", None)
    if tied_embeddings(config) and isinstance(lm, nn.Linear) and lm.weight.device.type == "meta":
        lm.weight = model.get_input_embeddings().weight
    check_filled(model, unused)
    model.eval()
    model.requires_grad_(False)
    canonicalize_head_input(model)
    attention.use(model)
    decode.install(model)
    engine.install(model)
    pages.back(model)  # the weights as built, on 2 MB pages where the kernel allows
    return model


def read_float(ckpt: Checkpoint, key: str, index: int | None = None) -> torch.Tensor:
    """A weight or bias from a source checkpoint: it must be floating-point (integers would be quantized as values)."""
    info = ckpt.tensors[key]
    if not info.dtype.is_floating_point:
        raise MoeqError(f"{info.file}: tensor {key}: stored as {info.dtype}; a weight or bias must be floating-point")
    return ckpt.read(key, index)


class Sink(Protocol):
    """Where a streamed load hands each finished part of the model instead of keeping it (a GGUF file written
    while the checkpoint is read: :class:`moeq.export.gguf.Stream`)."""

    def start(self, model: nn.Module, linears: dict) -> None:
        """The skeleton (parameters on the meta device) and the linears the load will quantize, before any tensor."""

    def write(self, unit: str, module: nn.Module) -> None:
        """A complete decoder layer or top-level module, named ``unit``; freed once this returns."""

    def finish(self, model: nn.Module) -> None:
        """Every unit written."""


class Written(nn.Module):
    """What stays of a unit a :class:`Sink` took: nothing (a later key for it is reported as unused)."""


class LoadState:
    """One streaming load: the skeleton, the experts builders and quantized linears it plans, and what the
    checkpoint's tensors have filled so far. ``quantize_linears=False`` keeps bf16 linears as the checkpoint holds
    them (a pre-quantized checkpoint's skip list). ``sink``: each decoder layer (and each top-level module) goes to
    it as soon as the checkpoint has filled it, and is freed: peak memory is one layer, not the model."""

    def __init__(self, path: Path, ckpt: Checkpoint, config, qcfg: QuantConfig, dtype: torch.dtype,
                 quantize_linears: bool = True, sink: Sink | None = None, importance=None):
        self.path, self.ckpt, self.config, self.qcfg, self.dtype = path, ckpt, config, qcfg, dtype
        self.importance = importance  # moeq.importance.Importance: the quantizer's column weights, or None
        self.arch: Arch = get_arch(config)
        self.model = skeleton(config, dtype)
        experts, linears = plan(self.model, self.arch, qcfg)
        self.builders: dict[str, ExpertsBuilder] = {
            name: ExpertsBuilder(name, self.model.get_submodule(name), self.arch, f13,
                                 activation_for(self.arch, self.model.get_submodule(name), config), dtype, f2,
                                 importance)
            for name, (f13, f2) in experts.items()}
        self.linears: dict[str, object] = linears if quantize_linears else {}
        self.pending_bias: dict[str, torch.Tensor] = {}
        self.unused: list[str] = []
        self._since_trim = 0  # source bytes freed since the last release_memory
        self.sink = sink
        if sink is not None:
            for b in self.builders.values():  # written as built, never run: no decode-layout copy of each stack
                b.decode_layout = "rows"
            self.layers = next((n for n, m in self.model.named_modules()
                                if isinstance(m, nn.ModuleList) and n.rpartition(".")[2] == "layers"), None)
            self.written: set[str] = set()
            head = _head_name(self.model)
            # a head tied to the embeddings but quantized gets its own copy at the end: the embeddings wait for it
            self.held = {_embeddings_name(self.model), head} if tied_embeddings(config) and head in self.linears \
                else set()
            sink.start(self.model, self.linears)

    def _unit(self, name: str) -> str:
        """The part of the model a tensor belongs to: its decoder layer, else its module."""
        if self.layers and name.startswith(self.layers + "."):
            return ".".join(name.split(".")[: self.layers.count(".") + 2])
        return name.rpartition(".")[0]

    def _complete(self, unit: str) -> bool:
        def under(n):
            return n == unit or n.startswith(unit + ".")
        if any(under(n) and not b.built for n, b in self.builders.items()) or any(map(under, self.linears)) \
                or any(map(under, self.pending_bias)):
            return False
        try:
            mod = self.model.get_submodule(unit) if unit else self.model
        except AttributeError:
            return False
        return not any(t.device.type == "meta" for t in itertools.chain(mod.parameters(), mod.buffers()))

    def _settle(self, name: str, force: bool = False) -> None:
        """Hand the unit holding ``name`` to the sink once complete, and free it."""
        if self.sink is None:
            return
        unit = self._unit(name)
        if not unit or unit in self.written or (unit in self.held and not force) or not self._complete(unit):
            return
        self.sink.write(unit, self.model.get_submodule(unit))
        set_module(self.model, unit, Written())
        self.written.add(unit)
        release_memory()

    TRIM_EVERY = 256 << 20

    def _freed(self, nbytes: int) -> None:
        """Source buffers of ``nbytes`` were just freed between the kept quantized pieces: every 256 MB, hand the
        holes back to the OS (glibc keeps them; a DeepSeek-V3 layer's export peaked at twice its size without)."""
        self._since_trim += nbytes
        if self._since_trim >= self.TRIM_EVERY:
            self._since_trim = 0
            release_memory()

    def build_if_complete(self, mod: str) -> None:
        """Swap in an experts module as soon as all its pieces arrived: bounded memory (one module's pieces)."""
        b = self.builders[mod]
        if not b.built and not b.missing():
            install_experts(self.model, mod, b.build(), b.arch)
            release_memory()
            self._settle(mod + ".down_proj")  # its layer may be complete now (experts read last: MXFP4 stacks)

    def route(self, key: str) -> None:
        """One plain tensor of the checkpoint: an expert piece (quantized at once), a linear's weight (quantized) or
        bias, or any other parameter/buffer (set; a key the model has no place for is noted and reported)."""
        name = self.arch.rename(key)
        m = self.arch.expert_key_re.match(name) or FUSED_KEY_RE.match(name)
        if m and m["mod"] in self.builders:
            b = self.builders[m["mod"]]
            if "e" in m.groupdict():
                b.put(int(m["e"]), self.arch.proj_kind(m["proj"]), read_float(self.ckpt, key), key)
                self._freed(self.ckpt.tensors[key].nbytes)
            elif m["bias"]:
                b.put_bias(m["param"], read_float(self.ckpt, key), key)
            else:
                b.put_fused(m["param"], lambda e: read_float(self.ckpt, key, e), self.ckpt.tensors[key].shape, key)
            self.build_if_complete(m["mod"])
            self._settle(name)
            return
        mod_name, _, attr = name.rpartition(".")
        if mod_name in self.linears and attr == "weight":
            self._quantize_linear(mod_name, key, self.ckpt.tensors[key].shape, lambda: read_float(self.ckpt, key))
            return
        if mod_name in self.linears and attr == "bias":
            lin = self.model.get_submodule(mod_name)
            if lin.bias is None:  # the config builds this Linear without a bias
                self.unused.append(key)
                return
            if tuple(lin.bias.shape) != tuple(self.ckpt.tensors[key].shape):
                raise MoeqError(f"{key}: shape {list(self.ckpt.tensors[key].shape)} does not match the config "
                                f"(expected {list(lin.bias.shape)})")
            b = read_float(self.ckpt, key)
            check_finite(b, key)
            self.pending_bias[mod_name] = b.to(lin.weight.dtype)
            return
        set_or_note_unused(self.model, name, self.ckpt.read(key), key, self.unused)
        self._settle(name)

    def planned(self, key: str) -> FormatConfig | None:
        """The format this load's plan gives the weight ``key`` (an expert piece's slot, a planned linear's), None
        for a tensor the plan leaves in the compute dtype or places as it is."""
        name = self.arch.rename(key)
        m = self.arch.expert_key_re.match(name)
        if m and m["mod"] in self.builders and "e" in m.groupdict():
            b = self.builders[m["mod"]]
            return b.fmt2 if self.arch.proj_kind(m["proj"]) == "down" else b.fmt
        mod_name, _, attr = name.rpartition(".")
        return self.linears.get(mod_name) if attr == "weight" else None

    def _quantize_linear(self, mod_name: str, key: str, shape, weight) -> None:
        """A planned linear's weight (``weight()`` reads it once its shape checked), quantized by its plan."""
        lin = self.model.get_submodule(mod_name)
        if tuple(lin.weight.shape) != tuple(shape):
            raise MoeqError(f"{key}: shape {list(shape)} does not match the config (expected {list(lin.weight.shape)})")
        bias = existing_bias(lin, self.pending_bias.pop(mod_name, None))
        set_module(self.model, mod_name, quantize_linear(mod_name, weight().to(lin.weight.dtype), bias,
                                                         self.linears.pop(mod_name), self.importance))
        self._settle(mod_name + ".weight")

    def put_packed_stack(self, mod: str, kind: str, q: PackedWeight, key: str) -> None:
        """One kind (gate/up/down) of the experts module ``mod``, quantized for every expert as one ``[E, N, K]``
        weight (a GGUF file's ``ffn_*_exps`` tensors)."""
        if mod not in self.builders:
            raise MoeqError(f"{key}: {mod!r} is not an experts module of the model built from config.json")
        self.builders[mod].put_packed_stack(kind, q, key)
        self.build_if_complete(mod)
        self._settle(mod + ".down_proj")

    def put_packed(self, head: str, q: PackedWeight) -> None:
        """An already-quantized weight (a pre-quantized checkpoint's): an expert slice, a quantized Linear, or — when
        transformers 5 holds that module as a plain weight (routers) — dequantized once into the compute dtype."""
        name = self.arch.rename(head)
        m = self.arch.expert_key_re.match(name)
        if m and m["mod"] in self.builders:
            self.builders[m["mod"]].put_packed(int(m["e"]), self.arch.proj_kind(m["proj"]), q, head)
            self.build_if_complete(m["mod"])
            self._settle(name)
            return
        if FUSED_KEY_RE.match(name):
            raise MoeqError(f"{head}: quantized fused 3-D experts are not a bitsandbytes layout moeq knows")
        mod_name = name[: -len(".weight")]
        try:
            mod = self.model.get_submodule(mod_name)
        except AttributeError:
            raise MoeqError(f"{head}: no module {mod_name!r} in the model built from config.json") from None
        if isinstance(mod, nn.Linear):
            if tuple(q.shape) != tuple(mod.weight.shape):
                raise MoeqError(f"{head}: quantized shape {list(q.shape)} does not match the config "
                                f"(expected {list(mod.weight.shape)})")
            bias = existing_bias(mod, self.pending_bias.pop(mod_name, None))
            set_module(self.model, mod_name, QuantLinear(q, bias))
            self.linears.pop(mod_name, None)  # placed as stored: the plan for it is done
            self._settle(name)
            return
        log.info("%s: quantized in the checkpoint, dequantized into %s (its module is not a Linear)", head, self.dtype)
        set_tensor(self.model, name, q.dequantize(self.dtype), head)
        self._settle(name)

    def put_dense(self, head: str, w: torch.Tensor) -> None:
        """A weight the reader computed (a pre-quantized one dequantized exactly, to be re-quantized): placed as a
        source tensor of that name would be — an expert piece or a planned linear quantized by the load's method,
        anything else set in the compute dtype."""
        name = self.arch.rename(head)
        m = self.arch.expert_key_re.match(name)
        if m and m["mod"] in self.builders:
            self.builders[m["mod"]].put(int(m["e"]), self.arch.proj_kind(m["proj"]), w, head)
            self._freed(w.numel() * w.element_size())
            self.build_if_complete(m["mod"])
            self._settle(name)
            return
        mod_name = name[: -len(".weight")]
        if mod_name in self.linears:
            self._quantize_linear(mod_name, head, w.shape, lambda: w)
            return
        set_tensor(self.model, name, w.to(self.dtype), head)
        self._settle(name)

    def _quantize_tied_head(self) -> None:
        """A rule quantizing a head tied to the embeddings (the checkpoint holds no lm_head weight): the head gets its
        own quantized copy of the embedding matrix, the embeddings stay in the compute dtype."""
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        name = _head_name(self.model)
        if name not in self.linears or not isinstance(head, nn.Linear) or head.weight.device.type != "meta":
            return
        emb = self.model.get_input_embeddings().weight
        if emb.device.type == "meta" or tuple(emb.shape) != tuple(head.weight.shape):
            return
        log.info("%s is tied to the embeddings: quantizing its own copy (%s)", name, self.linears[name].label())
        set_module(self.model, name, quantize_linear(name, emb.detach(), head.bias, self.linears.pop(name),
                                                     self.importance))

    def finish(self) -> nn.Module:
        """Biases that arrived before their weight, complete experts, the saved-format quantization_config, the
        generation config, then :func:`finish_model`."""
        for name, b in self.pending_bias.items():
            self.model.get_submodule(name).bias = nn.Parameter(b, requires_grad=False)
        self._quantize_tied_head()
        incomplete = [m for b in self.builders.values() if not b.built for m in b.missing()]
        if incomplete:
            raise MoeqError(f"checkpoint {self.path} lacks expert weights: {'; '.join(incomplete[:10])}"
                            + (f" (+{len(incomplete) - 10} more)" if len(incomplete) > 10 else ""))
        if self.sink is not None:
            return self._finish_streamed()
        self.model.config.quantization_config = quantization_config(self.model, self.qcfg)
        load_generation_config(self.model, self.path)
        return finish_model(self.model, self.unused, self.config)

    def _finish_streamed(self) -> nn.Module:
        """The held units (embeddings and a tied head quantized from them), then the checks of
        :func:`finish_model` on what is left (a unit never completed keeps its meta parameters: named there)."""
        for unit in sorted(self.held):
            self._settle(unit + ".weight", force=True)
        head = _head_name(self.model)
        if tied_embeddings(self.config) and head and head not in self.written:  # llama.cpp ties it to the embeddings
            set_module(self.model, head, Written())
        check_filled(self.model, self.unused)
        self.sink.finish(self.model)
        return self.model


def _head_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None


def _embeddings_name(model: nn.Module) -> str | None:
    emb = model.get_input_embeddings()
    return next((n for n, m in model.named_modules() if m is emb), None)
