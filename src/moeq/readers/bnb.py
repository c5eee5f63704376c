"""Pre-quantized bitsandbytes checkpoints (4-bit NF4/FP4 with or without double quant, and LLM.int8), including
transformers 4.x per-expert MoE checkpoints that transformers 5 cannot load. This module reads what such a
checkpoint declares; :func:`moeq.loader.load` places it.

What is quantized how is decided from the checkpoint's own tensors (a ``weight.quant_state.*`` sibling means 4-bit,
an int8 ``weight`` with an ``SCB`` sibling means 8-bit), never from the model type: per-expert states become slices of
the fused ``w13``/``w2`` stacks (each keeps its own blocks, absmax mean and nested statistics; nothing is expanded
to fp32), quantized ``nn.Linear`` weights become :class:`QuantLinear`, and a quantized weight whose module is not a
Linear in transformers 5 (routers) is dequantized once, exactly as bitsandbytes would, into the compute dtype.
bf16 tensors (e.g. experts that transformers 5 + bitsandbytes left unquantized, or ``llm_int8_skip_modules``) are
quantized in flight with the checkpoint's own settings unless ``quant`` says otherwise.
"""
from __future__ import annotations

import torch

from moeq.config import BNB4, FormatConfig, Int8, QuantConfig
from moeq.errors import MoeqError
from moeq.formats import Bnb4Weight, Int8Weight, PackedWeight
from moeq.io.safetensors_io import Checkpoint
from moeq.readers.source import stream
from moeq.readers.state import LoadState
from moeq.readers.state import compute_dtype as config_dtype

QS = ".quant_state.bitsandbytes__"


def bnb_bits(qc: dict) -> int:
    """4 or 8: which bitsandbytes mode a quantization_config declares (its flags must be booleans and agree)."""
    flags = {k: qc.get(k) for k in ("load_in_4bit", "_load_in_4bit", "load_in_8bit", "_load_in_8bit")}
    bad = {k: v for k, v in flags.items() if v is not None and not isinstance(v, bool)}
    if bad:
        raise MoeqError(f"quantization_config: {bad} must be true or false")
    four = bool(flags["load_in_4bit"] or flags["_load_in_4bit"])
    eight = bool(flags["load_in_8bit"] or flags["_load_in_8bit"])
    if four == eight:
        raise MoeqError("bitsandbytes quantization_config must set exactly one of load_in_4bit and load_in_8bit, "
                        f"got {flags}")
    return 4 if four else 8


def inflight_config(qc: dict) -> FormatConfig:
    """The checkpoint's own bitsandbytes settings, for tensors it holds in bf16."""
    if bnb_bits(qc) == 4:
        qt, bs, dq = (qc.get("bnb_4bit_quant_type", "nf4"), qc.get("bnb_4bit_blocksize", 64) or 64,
                      qc.get("bnb_4bit_use_double_quant", False))
        if not isinstance(qt, str) or type(bs) is not int or not isinstance(dq, bool):
            raise MoeqError(f"quantization_config: bnb_4bit_quant_type {qt!r}, bnb_4bit_blocksize {bs!r} or "
                            f"bnb_4bit_use_double_quant {dq!r} malformed")
        return BNB4(qt, bs, dq)
    return Int8()


def compute_dtype(qc: dict, dtype: torch.dtype | None) -> torch.dtype | None:
    """The compute dtype: ``dtype`` if given, else a 4-bit checkpoint's ``bnb_4bit_compute_dtype``, else None (the
    caller falls back to the model config's)."""
    if dtype is not None:
        return dtype
    name = qc.get("bnb_4bit_compute_dtype") if bnb_bits(qc) == 4 else None
    if isinstance(name, str) and name.removeprefix("torch.") in ("bfloat16", "float16", "float32"):
        return getattr(torch, name.removeprefix("torch."))
    return None


def quantized_groups(ckpt: Checkpoint) -> tuple[dict[str, list[str]], dict[str, str]]:
    """``{weight key: [its keys]}`` for every bnb-quantized weight, and ``{member key: weight key}``."""
    keys = set(ckpt.tensors)
    groups: dict[str, list[str]] = {}
    for k in keys:
        if QS in k:
            head = k.split(QS)[0]
            if head not in keys:
                raise MoeqError(f"{k}: quant state without its weight {head}")
            groups[head] = [head] + sorted(x for x in keys if x.startswith(head + "."))
        elif k.endswith(".SCB"):
            prefix = k[: -len("SCB")]
            head = prefix + "weight"
            if head not in keys:
                raise MoeqError(f"{k}: SCB without its weight {head}")
            if ckpt.tensors[head].dtype != torch.int8:
                raise MoeqError(f"{head}: has an SCB sibling but dtype {ckpt.tensors[head].dtype}, expected int8")
            groups[head] = [head, k] + ([prefix + "weight_format"] if prefix + "weight_format" in keys else [])
    for head in keys:  # a uint8 [n, 1] weight without a quant state is a broken 4-bit tensor
        if head.endswith(".weight") and head not in groups and ckpt.tensors[head].dtype == torch.uint8 and (
                f"{head}.absmax" in keys):
            raise MoeqError(f"{head}: 4-bit weight whose quant_state JSON "
                             f"({head}.quant_state.bitsandbytes__nf4|fp4) is missing")
    member = {m: h for h, ms in groups.items() for m in ms}
    return groups, member


def read_packed(ckpt: Checkpoint, head: str, members: list[str], dtype: torch.dtype) -> PackedWeight:
    sd = {k: ckpt.read(k) for k in members}
    if any(QS in k for k in members):
        return Bnb4Weight.from_state_dict(sd, head[: -len("weight")])
    return Int8Weight.from_state_dict(sd, head[: -len("weight")], dtype=dtype)


def claims(found) -> bool:
    return bool(found.qc) and found.qc.get("quant_method") == "bitsandbytes"


def read(found, quant, dtype, progress: bool):
    """The :mod:`moeq.readers` entry: its quantized weights are placed as they are, its plain tensors stream through
    the same route as a bf16 checkpoint's (bf16 experts quantized in flight with the checkpoint's own settings unless
    ``quant`` says otherwise; bf16 linears kept as the checkpoint holds them)."""
    qc, ckpt = found.qc, found.ckpt
    dtype = compute_dtype(qc, dtype) or config_dtype(found.config, None)
    qcfg = QuantConfig.of(quant if quant is not None else inflight_config(qc))
    state = LoadState(found.path, ckpt, found.config, qcfg, dtype, quantize_linears=False, sink=found.sink)
    groups, member = quantized_groups(ckpt)
    return stream(state, member, lambda head: read_packed(ckpt, head, groups[head], dtype), progress)
