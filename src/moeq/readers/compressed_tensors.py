"""Reading compressed-tensors ``pack-quantized`` checkpoints (what ``moeq export --format compressed-tensors``
writes, and what llm-compressor produces for RTN-style int4/int8 weights) back into moeq's RTN weights, losslessly:
``weight_packed`` int32 words are moeq's packed bytes, ``weight_scale`` its scales, ``weight_zero_point`` its zero
points packed along the output dim. Everything read is validated like any other packed weight."""
from __future__ import annotations

import re

import torch

from moeq.config import QuantConfig
from moeq.errors import MoeqError
from moeq.formats import RTNWeight
from moeq.formats.packing import unpack
from moeq.io.safetensors_io import Checkpoint
from moeq.readers.source import stream
from moeq.readers.state import LoadState, compute_dtype

SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def _re_match(pattern: str, name: str) -> bool:
    """compressed-tensors' ``re:`` targets: ``re.match`` of the pattern against the module name (its own
    ``match_name``), not a glob. A pattern that does not compile is the checkpoint's error."""
    try:
        return re.match(pattern, name) is not None
    except re.error as e:
        raise MoeqError(f"compressed-tensors target 're:{pattern}' is not a regular expression: {e}") from None


def _weight_args(qc: dict, module: str) -> dict:
    """The ``weights`` settings of the config group that targets ``module`` (exact names first, then ``Linear``)."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise MoeqError("compressed-tensors quantization_config has no config_groups")
    fallback = None
    for g in groups.values():
        targets = g.get("targets") if isinstance(g, dict) else None
        if not isinstance(targets, list) or not isinstance(g.get("weights"), dict):
            raise MoeqError(f"compressed-tensors config group {g!r} malformed"[:300])
        if any(isinstance(t, str) and (t == module or (t.startswith("re:") and _re_match(t[3:], module)))
               for t in targets):
            return g["weights"]
        if "Linear" in targets:
            fallback = g["weights"]
    if fallback is None:
        raise MoeqError(f"{module}: no compressed-tensors config group targets it")
    return fallback


def groups(ckpt: Checkpoint) -> tuple[dict[str, list[str]], dict[str, str]]:
    """``{weight head "X.weight": [its keys]}`` for every packed weight, and ``{member key: head}``."""
    heads = {}
    for k in ckpt.tensors:
        if k.endswith(".weight_packed"):
            prefix = k[: -len("weight_packed")]
            heads[prefix + "weight"] = [prefix + s for s in SUFFIXES if prefix + s in ckpt.tensors]
    member = {m: h for h, ms in heads.items() for m in ms}
    return heads, member


def read_weight(ckpt: Checkpoint, qc: dict, head: str, dtype: torch.dtype) -> RTNWeight:
    prefix = head[: -len("weight")]
    module = prefix[:-1]
    args = _weight_args(qc, module)
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise MoeqError(f"compressed-tensors format {fmt!r} is not read by moeq (it reads pack-quantized)")
    bits, sym, strategy = args.get("num_bits"), args.get("symmetric"), args.get("strategy")
    if bits not in (4, 8) or args.get("type", "int") != "int" or not isinstance(sym, bool) or strategy not in (
            "group", "channel"):
        raise MoeqError(f"{module}: compressed-tensors weights {args} are not an RTN layout moeq reads "
                        "(int 4/8-bit, group or channel)")
    for s in ("weight_packed", "weight_scale", "weight_shape"):
        if prefix + s not in ckpt.tensors:
            raise MoeqError(f"{prefix}{s}: missing")
    shape_t = ckpt.read(prefix + "weight_shape")
    if shape_t.dtype not in (torch.int32, torch.int64) or shape_t.numel() != 2:
        raise MoeqError(f"{prefix}weight_shape: expected two integers, got {shape_t.dtype} {list(shape_t.shape)}")
    n, k = (int(v) for v in shape_t.tolist())
    packed = ckpt.read(prefix + "weight_packed")
    if packed.dtype != torch.int32 or packed.ndim != 2:
        raise MoeqError(f"{prefix}weight_packed: expected 2-D int32, got {packed.dtype} {list(packed.shape)}")
    gs = args.get("group_size") if strategy == "group" else -1
    if strategy == "group" and (type(gs) is not int or gs <= 0):
        raise MoeqError(f"{module}: group strategy without a valid group_size ({gs!r})")
    scale = ckpt.read(prefix + "weight_scale")
    if strategy == "channel":
        scale = scale.reshape(-1, 1) if scale.numel() == n else scale
    zero = None
    if sym and prefix + "weight_zero_point" in ckpt.tensors:
        raise MoeqError(f"{prefix}weight_zero_point: present, but the config says symmetric: true for {module} "
                        "(a symmetric weight has no zero points); the config and the tensors contradict each other")
    if not sym:
        if prefix + "weight_zero_point" not in ckpt.tensors:
            raise MoeqError(f"{prefix}weight_zero_point: missing for an asymmetric weight")
        zp = ckpt.read(prefix + "weight_zero_point")
        if zp.dtype != torch.int32 or zp.ndim != 2:
            raise MoeqError(f"{prefix}weight_zero_point: expected 2-D int32, got {zp.dtype} {list(zp.shape)}")
        ng = 1 if gs == -1 else (k // gs if k % gs == 0 else -1)
        want = (-(-n * bits // 32), ng)  # zero points packed along the output dim, 32 // bits per int32
        if ng <= 0 or tuple(zp.shape) != want:
            raise MoeqError(f"{prefix}weight_zero_point: shape {list(zp.shape)}, expected {list(want)} for a "
                            f"[{n}, {k}] weight at {bits} bits, group {gs}")
        zero = unpack(zp.t().contiguous().view(torch.uint8), bits).t()[:n].contiguous()  # [rows, G]
    w = RTNWeight(qdata=packed.contiguous().view(torch.uint8), scale=scale.contiguous(), zero=zero, bits=bits,
                  group_size=gs, grid="vllm" if sym else "asym", shape=(n, k),
                  dtype=scale.dtype if scale.dtype in (torch.bfloat16, torch.float16, torch.float32) else dtype)
    return w.validate(head)


def claims(found) -> bool:
    return bool(found.qc) and found.qc.get("quant_method") == "compressed-tensors"


def read(found, quant, dtype, progress: bool):
    """The :mod:`moeq.readers` entry: a compressed-tensors pack-quantized checkpoint, its packed weights become moeq
    RTN weights as they are; its other tensors (the ``ignore`` list) stay as the checkpoint holds them."""
    if quant is not None:
        raise MoeqError(f"{found.path} is already quantized (compressed-tensors); load it without a method")
    dtype = compute_dtype(found.config, dtype)
    state = LoadState(found.path, found.ckpt, found.config, QuantConfig.of("none"), dtype, quantize_linears=False)
    _, member = groups(found.ckpt)
    return stream(state, member, lambda head: read_weight(found.ckpt, found.qc, head, dtype), progress)
