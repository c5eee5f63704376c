"""bf16/fp16/fp32 safetensors sources: every tensor streamed once through :class:`~moeq.readers.state.LoadState`,
quantized in flight with the requested method (3-D expert tensors one expert slice at a time); and :func:`stream`,
the one loop every checkpoint holding packed weights shares."""
from __future__ import annotations

from typing import Callable

from torch import nn
from tqdm.auto import tqdm

from moeq.config import QuantConfig
from moeq.formats import PackedWeight
from moeq.readers.state import LoadState, compute_dtype


def claims(found) -> bool:
    return found.ckpt is not None and not found.qc


def read(found, quant, dtype, progress: bool) -> nn.Module:
    found.ckpt.device = found.device  # in flight: each tensor is read onto the device and quantized there
    state = LoadState(found.path, found.ckpt, found.config, QuantConfig.of(quant or "none"),
                      compute_dtype(found.config, dtype), sink=found.sink, importance=found.importance)
    for key in tqdm(found.ckpt.keys(), desc="loading+quantizing", unit="tensor", disable=not progress):
        state.route(key)
    return state.finish()


def stream(state: LoadState, member: dict[str, str], read_packed: Callable[[str], PackedWeight],
           progress: bool, dense: bool = False) -> nn.Module:
    """The one loop of a checkpoint holding packed weights: each weight's keys (``member``: key -> its weight) are
    read together once and placed as packed; every other tensor takes the plain route. ``dense``: ``read_packed``
    returns the weight dequantized, placed as a source tensor (quantized in flight by the load's method)."""
    done: set[str] = set()
    for key in tqdm(state.ckpt.keys(), desc="loading", unit="tensor", disable=not progress):
        head = member.get(key)
        if head is None:
            state.route(key)
        elif head not in done:
            done.add(head)
            (state.put_dense if dense else state.put_packed)(head, read_packed(head))
    return state.finish()
