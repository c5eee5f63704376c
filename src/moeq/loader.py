"""``moeq.load``: one entry for every checkpoint moeq reads. A saved moeq checkpoint is restored as saved
(:mod:`moeq.saved`); a bf16/fp16 checkpoint and a pre-quantized bitsandbytes one stream through the same loop, one
tensor (or expert slice) at a time into a :class:`~moeq.load_state.LoadState`, quantizing in flight, and end in its
``finish``: every checkpoint key used, every parameter filled, or an error naming them."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from moeq import ctread, ggufread, prequant
from moeq.config import QuantConfig
from moeq.errors import MoeqError
from moeq.io import hub
from moeq.nn import finite
from moeq.io.safetensors_io import Checkpoint
from moeq.load_state import LoadState, compute_dtype, read_config
from moeq.record import QUANT_METHOD
from moeq.saved import restore


def load(path: str | os.PathLike, quant: QuantConfig | str | None = None, dtype: torch.dtype | None = None,
         progress: bool = True, device: str | torch.device | None = None, activations: str = "default") -> nn.Module:
    """Load a checkpoint directory (or a Hub id already in the local Hugging Face cache): a moeq checkpoint as
    saved, or a bf16/fp16 one quantized in flight with ``quant`` (a :class:`QuantConfig`, a format config or a method name; None loads it unquantized).

    ``device`` (default CPU): where the model runs. On a GPU, source tensors stream from disk to the GPU one at a
    time and are quantized there; saved and pre-quantized checkpoints are moved once loaded.

    ``activations``: the CPU decode kernels' numerics, ``"default"`` or ``"int8"`` (see :func:`moeq.set_activations`).

    The model raises :class:`moeq.nn.finite.NonFiniteError` (a :class:`MoeqError`) at the first layer that turns finite
    input into NaN/Inf, rather than return non-finite logits (:mod:`moeq.nn.finite`)."""
    from moeq.kernels.gpu import check_device  # noqa: PLC0415

    from moeq.api import ACTIVATIONS, set_activations  # noqa: PLC0415

    if activations not in ACTIVATIONS:
        raise MoeqError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    dev = check_device(device)
    model = finite.install(_load(hub.resolve(path), quant, dtype, progress, dev))
    if activations != "default":
        set_activations(model, activations)
    return model if dev.type == "cpu" else model.to(dev)


def _load(path: Path, quant, dtype, progress: bool, device: torch.device) -> nn.Module:
    if ggufread.gguf_file(path) is not None:  # moeq's own GGUF export
        if quant is not None:
            raise MoeqError(f"{path} is already quantized (GGUF); load it without a method")
        return ggufread.load(path, dtype)
    ckpt = Checkpoint(path)
    config = read_config(path)
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if callable(getattr(qc, "to_dict", None)) else qc
    if qc is not None and not isinstance(qc, dict):
        raise MoeqError(f"{path}/config.json: quantization_config must be an object, got {type(qc).__name__}")
    if qc and qc.get("quant_method") == QUANT_METHOD:
        if quant is not None:
            raise MoeqError(f"{path} is already a moeq checkpoint ({qc.get('formats')}); load it without a method")
        return restore(path, ckpt, config, qc, dtype, progress)
    if qc and qc.get("quant_method") == "compressed-tensors":
        return _load_compressed_tensors(path, ckpt, config, qc, quant, dtype, progress)
    if qc:
        return _load_prequantized(path, ckpt, config, qc, quant, dtype, progress)
    ckpt.device = device  # in flight: each tensor is read onto the device and quantized there
    state = LoadState(path, ckpt, config, QuantConfig.of(quant or "none"), compute_dtype(config, dtype))
    for key in tqdm(ckpt.keys(), desc="loading+quantizing", unit="tensor", disable=not progress):
        state.route(key)
    return state.finish()


def _load_prequantized(path: Path, ckpt: Checkpoint, config, qc: dict, quant, dtype, progress: bool) -> nn.Module:
    """A bitsandbytes checkpoint (see :mod:`moeq.prequant`): its quantized weights are placed as they are, its
    plain tensors stream through the same route as a bf16 checkpoint's (bf16 experts quantized in flight with the
    checkpoint's own settings unless ``quant`` says otherwise; bf16 linears kept as the checkpoint holds them)."""
    if qc.get("quant_method") != "bitsandbytes":
        raise MoeqError(f"{path}: checkpoints quantized with quant_method={qc.get('quant_method')!r} are not "
                        "supported; moeq loads bf16/fp16, moeq and bitsandbytes checkpoints")
    dtype = prequant.compute_dtype(qc, dtype) or compute_dtype(config, None)
    qcfg = QuantConfig.of(quant if quant is not None else prequant.inflight_config(qc))
    state = LoadState(path, ckpt, config, qcfg, dtype, quantize_linears=False)
    groups, member = prequant.quantized_groups(ckpt)
    return _stream(state, member, lambda head: prequant.read_packed(ckpt, head, groups[head], dtype), progress)


def _stream(state: LoadState, member: dict[str, str], read_packed, progress: bool) -> nn.Module:
    """The one loop of a checkpoint holding packed weights: each weight's keys (``member``: key -> its weight) are
    read together once and placed as packed; every other tensor takes the plain route."""
    done: set[str] = set()
    for key in tqdm(state.ckpt.keys(), desc="loading", unit="tensor", disable=not progress):
        head = member.get(key)
        if head is None:
            state.route(key)
        elif head not in done:
            done.add(head)
            state.put_packed(head, read_packed(head))
    return state.finish()


def _load_compressed_tensors(path: Path, ckpt: Checkpoint, config, qc: dict, quant, dtype, progress: bool) -> nn.Module:
    """A compressed-tensors pack-quantized checkpoint (see :mod:`moeq.ctread`): its packed weights become moeq RTN
    weights as they are; its other tensors (the ``ignore`` list) stay as the checkpoint holds them."""
    if quant is not None:
        raise MoeqError(f"{path} is already quantized (compressed-tensors); load it without a method")
    dtype = compute_dtype(config, dtype)
    state = LoadState(path, ckpt, config, QuantConfig.of("none"), dtype, quantize_linears=False)
    _, member = ctread.groups(ckpt)
    return _stream(state, member, lambda head: ctread.read_weight(ckpt, qc, head, dtype), progress)
