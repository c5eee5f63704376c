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
    fmt = format_of(qc)
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


def format_of(qc: dict) -> str | None:
    """The checkpoint's format: the config's, or the one every config group names."""
    groups_ = qc.get("config_groups") if isinstance(qc.get("config_groups"), dict) else {}
    per = {g.get("format") for g in groups_.values() if isinstance(g, dict) and g.get("format")}
    return qc.get("format") or (per.pop() if len(per) == 1 else None)


def float_block(qc: dict, key: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The scale tile of a ``float-quantized`` (FP8 e4m3) weight from its config group: ``tensor`` one scale,
    ``channel`` one per row, ``group`` one per row and ``group_size`` inputs, ``block`` its ``block_structure``."""
    module = key[: -len(".weight")] if key.endswith(".weight") else key
    args = _weight_args(qc, module)
    strategy, k = args.get("strategy"), shape[-1]
    if args.get("num_bits") != 8 or args.get("type") != "float" or args.get("symmetric") is False:
        raise MoeqError(f"{module}: compressed-tensors float weights {args} are not FP8 e4m3 symmetric")
    if strategy == "tensor":
        return None
    if strategy == "channel":
        return 1, k
    if strategy == "group":
        gs = args.get("group_size")
        if type(gs) is not int or gs <= 0 or k % gs:
            raise MoeqError(f"{module}: FP8 group_size {gs!r} does not divide its {k} inputs")
        return 1, gs
    bs = args.get("block_structure")
    if strategy == "block" and isinstance(bs, list) and len(bs) == 2 and all(type(v) is int and 0 < v <= 1 << 16
                                                                             for v in bs):
        return bs[0], bs[1]
    raise MoeqError(f"{module}: compressed-tensors FP8 strategy {strategy!r} (block {bs!r}) is not one moeq reads")


def read(found, quant, dtype, progress: bool):
    """The :mod:`moeq.readers` entry: a compressed-tensors pack-quantized checkpoint, its packed weights become moeq
    RTN weights as they are; its other tensors (the ``ignore`` list) stay as the checkpoint holds them. A
    ``float-quantized`` (FP8) one reads as the FP8 checkpoints do: each weight dequantized exactly (e4m3 times its
    ``weight_scale`` in fp32) as the stream reaches it, kept or quantized in flight with ``quant``."""
    if format_of(found.qc) == "float-quantized":
        from moeq.readers import fp8  # noqa: PLC0415

        dtype = compute_dtype(found.config, dtype)
        src = fp8.Fp8Source(found.ckpt, None, dtype, found.path, suffix="_scale",
                            block_for=lambda key, shape: float_block(found.qc, key, shape))
        return fp8.read(found, quant, dtype, progress, source=src)
    if quant is not None:
        raise MoeqError(f"{found.path} is already quantized (compressed-tensors); load it without a method")
    dtype = compute_dtype(found.config, dtype)
    state = LoadState(found.path, found.ckpt, found.config, QuantConfig.of("none"), dtype, quantize_linears=False,
                      sink=found.sink)
    _, member = groups(found.ckpt)
    return stream(state, member, lambda head: read_weight(found.ckpt, found.qc, head, dtype), progress)
