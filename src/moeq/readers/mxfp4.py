"""MXFP4 checkpoints (gpt-oss-20b/120b): ``quantization_config = {"quant_method": "mxfp4", ...}``; the experts as
``{gate_up,down}_proj_blocks`` (uint8 ``[E, N, K/32, 16]``: 32 E2M1 codes per group, two per byte, low nibble first)
and ``{gate_up,down}_proj_scales`` (uint8 ``[E, N, K/32]``: E8M0 exponents, value = E2M1 x 2^(e - 127)), ``N`` the
output rows (gpt-oss' gate_up rows interleave gate and up: gate at even rows); everything else bf16.

Without a method the experts load as moeq's ``mxfp4`` grid exactly as stored — the same bytes, each exponent as the
bf16 scale 2^(e - 128) of the doubled E2M1 table — and run on moeq's native codebook kernels; bit for bit the weights
transformers' own MXFP4 dequantization gives (tested). With a method, each expert is dequantized and quantized in
flight like a bf16 source. Validated before use: shapes against the config, dtypes, E8M0 255 (NaN) refused.
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn
from tqdm.auto import tqdm

from moeq.config import QuantConfig
from moeq.errors import MoeqError
from moeq.formats import RTNWeight
from moeq.formats.rtn import MX_GROUP
from moeq.readers.state import LoadState, compute_dtype

PACKED_RE = re.compile(r"(?P<mod>.+)\.(?P<param>gate_up_proj|down_proj)_(?P<part>blocks|scales)$")


def claims(found) -> bool:
    return bool(found.qc) and found.qc.get("quant_method") == "mxfp4"


def read_stack(ckpt, blocks_key: str, scales_key: str, dtype: torch.dtype) -> RTNWeight:
    """One ``[E, N, K]`` MXFP4 stack as an ``mxfp4`` RTN weight (validated)."""
    bi, si = ckpt.tensors[blocks_key], ckpt.tensors[scales_key]
    if bi.dtype != torch.uint8 or si.dtype != torch.uint8:
        raise MoeqError(f"{bi.file}: {blocks_key} / {scales_key}: MXFP4 blocks and scales are uint8, got "
                        f"{bi.dtype} / {si.dtype}")
    if len(bi.shape) != 4 or bi.shape[-1] != MX_GROUP // 2 or tuple(si.shape) != tuple(bi.shape[:-1]):
        raise MoeqError(f"{bi.file}: {blocks_key} {list(bi.shape)} / {scales_key} {list(si.shape)}: expected "
                        f"[E, N, K/32, 16] blocks and [E, N, K/32] scales")
    e, n, g, _ = bi.shape
    scale = ckpt.read(scales_key)  # E8M0 bytes: 2^(e - 127) x E2M1 = 2^(e - 128) x moeq's doubled table, as stored
    if bool((scale == 255).any()):
        raise MoeqError(f"{si.file}: {scales_key}: E8M0 exponent 255 (NaN)")
    qdata = ckpt.read(blocks_key).reshape(e, n, g * MX_GROUP // 2)
    return RTNWeight(qdata=qdata.contiguous(), scale=scale.contiguous(), zero=None, bits=4, group_size=MX_GROUP,
                     grid="mxfp4", shape=(e, n, g * MX_GROUP), dtype=dtype).validate(blocks_key)


def rows(w: RTNWeight, idx: slice) -> RTNWeight:
    """Rows ``idx`` of a 2-D weight (gate = even rows of gpt-oss' interleaved gate_up)."""
    return dataclasses.replace(w, qdata=w.qdata[idx].contiguous(), scale=w.scale[idx].contiguous(),
                               shape=(w.qdata[idx].shape[0], w.shape[1]))


def read(found, quant, dtype, progress: bool) -> nn.Module:
    """The :mod:`moeq.readers` entry."""
    ckpt, dtype = found.ckpt, compute_dtype(found.config, dtype)
    state = LoadState(found.path, ckpt, found.config, QuantConfig.of(quant or "none"), dtype,
                      quantize_linears=quant is not None, sink=found.sink, importance=found.importance)
    pairs: dict[tuple[str, str], dict[str, str]] = {}
    for key in ckpt.keys():
        m = PACKED_RE.match(key)
        if m:
            pairs.setdefault((m["mod"], m["param"]), {})[m["part"]] = key
    for key in tqdm(ckpt.keys(), desc="loading (MXFP4)", unit="tensor", disable=not progress):
        m = PACKED_RE.match(key)
        if m is None:
            state.route(key)
            continue
        parts = pairs[(m["mod"], m["param"])]
        if m["part"] != "blocks":
            if "blocks" not in parts:
                raise MoeqError(f"{found.path}: {key} has no {m['param']}_blocks")
            continue
        if "scales" not in parts:
            raise MoeqError(f"{found.path}: {key} has no {m['param']}_scales")
        mod = state.arch.rename(m["mod"])
        b = state.builders.get(mod)
        if b is None:
            raise MoeqError(f"{found.path}: {key}: {mod} is not an experts module of this model")
        w = read_stack(ckpt, parts["blocks"], parts["scales"], dtype)
        for e in range(w.shape[0]):
            we = w[e]
            pieces = ([("gate", rows(we, slice(0, None, 2))), ("up", rows(we, slice(1, None, 2)))]
                      if m["param"] == "gate_up_proj" else [("down", we)])
            for kind, piece in pieces:
                if quant is None:
                    b.put_packed(e, kind, piece, f"{key}[{e}]")
                else:
                    b.put(e, kind, piece.dequantize(dtype), f"{key}[{e}]")
        state.build_if_complete(mod)
    return state.finish()
