"""Checkpoint readers: one file per checkpoint kind, one protocol, one dispatch.

Every reader is a :class:`Reader` row of :data:`READERS`: ``claims(found)`` says from what the checkpoint declares
(its file kind and config) whether it is this reader's, and ``read(found, quant, dtype, progress)`` builds the model.
:func:`read` asks the rows in order, once, and the first that claims the checkpoint reads it. The streaming readers
(bf16/fp16 sources, bitsandbytes, compressed-tensors, GGUF) place each tensor or packed weight through one
:class:`~moeq.readers.state.LoadState`; a saved moeq checkpoint is restored module by module
(:mod:`moeq.readers.saved`). Every packed weight a reader makes passes ``PackedWeight.from_untrusted`` /
``validate`` before anything runs on it.

Adding a checkpoint kind: ``readers/<kind>.py`` with its ``claims`` and ``read`` (streaming its tensors through
``LoadState``: plain ones with ``state.route(key)``, packed ones with ``state.put_packed(name, weight)``), its row in
:data:`READERS`, and its mutations in ``tests/untrusted/test_fuzz.py``.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from moeq.arch import mtp_keys
from moeq.errors import MoeqError
from moeq.io.safetensors_io import Checkpoint
from moeq.readers import bnb, compressed_tensors, fp8, gguf, gptq, mxfp4, saved, source
from moeq.readers.state import read_config

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Found:
    """What a checkpoint declares, read once for every reader to look at."""

    path: Path
    gguf_file: Path | None = None
    ckpt: Checkpoint | None = None
    config: object = None
    qc: dict | None = None  # config.json's quantization_config as a dict (None: none)
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    sink: object = None  # a :class:`~moeq.readers.state.Sink` taking each finished layer (streaming readers only)
    importance: object = None  # a :class:`~moeq.importance.Importance` for the quantizer (readers that quantize)
    skipped: int = 0  # multi-token-prediction tensors left unread (the model does not run them)


@dataclasses.dataclass(frozen=True)
class Reader:
    name: str
    claims: Callable[[Found], bool]
    read: Callable[[Found, object, torch.dtype | None, bool], nn.Module]
    streams: bool = True  # reads through LoadState, so takes a sink (Found.sink) and keeps one layer at a time


READERS: list[Reader] = [
    Reader("gguf", lambda f: f.gguf_file is not None, gguf.read, streams=False),
    Reader("moeq", saved.claims, saved.read, streams=False),
    Reader("compressed-tensors", compressed_tensors.claims, compressed_tensors.read),
    Reader("fp8", fp8.claims, fp8.read),
    Reader("mxfp4", mxfp4.claims, mxfp4.read),
    Reader("gptq/awq", gptq.claims, gptq.read),
    Reader("bitsandbytes", bnb.claims, bnb.read),
    Reader("source", source.claims, source.read),
]


def inspect(path: Path, device: torch.device) -> Found:
    """Read what ``path`` declares: a GGUF file moeq wrote, or a safetensors checkpoint and its config."""
    g = gguf.gguf_file(path)
    if g is not None:
        return Found(path, gguf_file=g, device=device)
    ckpt = Checkpoint(path)
    config = read_config(path)
    mtp = mtp_keys(config, ckpt.tensors)
    if mtp:  # never read: transformers' model has no place for them (the multi-token-prediction head)
        log.info("%s: skipping %d multi-token-prediction tensor(s) (%s, ...): the model does not run them", path,
                 len(mtp), mtp[0])
        for k in mtp:
            del ckpt.tensors[k]
    found_mtp = len(mtp)
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if callable(getattr(qc, "to_dict", None)) else qc
    if qc is not None and not isinstance(qc, dict):
        raise MoeqError(f"{path}/config.json: quantization_config must be an object, got {type(qc).__name__}")
    return Found(path, ckpt=ckpt, config=config, qc=qc or None, device=device, skipped=found_mtp)


def claim(found: Found) -> Reader:
    """The reader of a checkpoint: the first row of :data:`READERS` that claims it."""
    for reader in READERS:
        if reader.claims(found):
            return reader
    raise MoeqError(f"{found.path}: checkpoints quantized with quant_method={found.qc.get('quant_method')!r} are not "
                    "supported; moeq loads bf16/fp16, moeq, FP8 (block-scaled e4m3), MXFP4 (gpt-oss), GPTQ, AWQ, "
                    "bitsandbytes, compressed-tensors (pack-quantized, float-quantized FP8) and GGUF checkpoints")


def read(path: Path, quant, dtype: torch.dtype | None, progress: bool, device: torch.device, sink=None,
         importance=None) -> nn.Module:
    """Load ``path`` with its reader; ``sink`` (readers that stream): hand it each finished layer instead of keeping
    the model (what is returned is then the emptied skeleton); ``importance``: column statistics the quantizer
    weighs its search by (:mod:`moeq.importance`)."""
    found = inspect(path, device)
    reader = claim(found)
    found.importance = importance
    if sink is not None:
        if not reader.streams:
            raise MoeqError(f"{path}: a {reader.name} checkpoint is restored whole, not streamed layer by layer")
        found.sink = sink
    return reader.read(found, quant, dtype, progress)


def weight_count(path: Path) -> int:
    """Elements of a checkpoint's tensors as stored (packed formats count their bytes: an estimate from below)."""
    found = inspect(path, torch.device("cpu"))
    if found.ckpt is None:
        return 0
    return sum(math.prod(t.shape) for t in found.ckpt.tensors.values())


SOURCE_ACTIONS = {  # what loading does with a checkpoint kind's weights: (without a method, with --method M)
    "gguf": ("GGML blocks moeq holds (Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4) run as stored; other types decoded by gguf-py",
             "refused: already quantized"),
    "moeq": ("run as saved", "refused: already quantized"),
    "fp8": ("FP8 weights dequantized (x scale tile) to the compute dtype", "M = fp8: 2-D FP8 weights kept as stored "
            "(e4m3 codes + scale tiles, native kernels); any other M: FP8 weights dequantized and re-quantized with M "
            "in flight"),
    "mxfp4": ("experts run as stored (moeq's mxfp4 grid)", "experts dequantized and re-quantized with M; bf16 linears "
              "quantized with M"),
    "compressed-tensors": ("pack-quantized weights run as stored (RTN); float-quantized (FP8) weights dequantized "
                           "(x weight_scale) to the compute dtype", "pack-quantized: refused (already quantized); "
                           "float-quantized: M = fp8 keeps the FP8 weights as stored, any other M re-quantizes them "
                           "in flight"),
    "gptq/awq": ("int4/int8 weights run as stored (RTN: vllm grid or asym, exact); act-order GPTQ refused",
                 "weights dequantized exactly and re-quantized with M in flight"),
    "bitsandbytes": ("4/8-bit states run as stored; bf16 experts quantized with the checkpoint's settings",
                     "bf16 tensors quantized with M; stored states run as stored"),
    "source": ("kept in the compute dtype", "quantized with M in flight (experts, attention; routers, norms, "
               "embeddings and the head kept by the default policy)"),
}


def describe(path: Path) -> dict:
    """What a checkpoint is and what loading it does (``moeq inspect``'s "source" section)."""
    found = inspect(path, torch.device("cpu"))
    reader = next((r for r in READERS if r.claims(found)), None)  # unclaimed: described, not refused
    name = reader.name if reader else (found.qc or {}).get("quant_method", "unknown")
    out = {"reader": name, "quant_method": (found.qc or {}).get("quant_method")}
    if name == "fp8":
        out["weight_block_size"] = fp8.block_size(found.qc, path)
        out["fp8_weights"] = sum(1 for i in found.ckpt.tensors.values() if i.dtype == torch.float8_e4m3fn)
    elif name == "compressed-tensors":
        out["format"] = compressed_tensors.format_of(found.qc)
        out["fp8_weights"] = sum(1 for i in found.ckpt.tensors.values() if i.dtype == torch.float8_e4m3fn)
    elif name == "mxfp4":
        out["mxfp4_stacks"] = sum(1 for k in found.ckpt.tensors if k.endswith("_blocks"))
    elif name == "gptq/awq":
        kind, bits, gs, _ = gptq.settings(found.qc)
        out.update(bits=bits, group_size=gs, quantized_weights=len(gptq.groups(found.ckpt)[0]))
    if found.ckpt is not None:
        out["tensors"] = len(found.ckpt.tensors)
    if found.skipped:
        out["skipped_mtp_tensors"] = found.skipped
    without, with_method = SOURCE_ACTIONS.get(name, ("refused", "refused"))
    out["without_method"], out["with_method"] = without, with_method
    return out
