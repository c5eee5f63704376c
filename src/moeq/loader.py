"""``moeq.load``: one entry for every checkpoint moeq reads. :mod:`moeq.readers` decides once which reader a
checkpoint is (a saved moeq checkpoint, a bf16/fp16 source, bitsandbytes, compressed-tensors, a moeq GGUF file);
every streaming reader ends in :class:`~moeq.readers.state.LoadState`'s ``finish``: every checkpoint key used, every
parameter filled, or an error naming them."""
from __future__ import annotations

import os

import torch
from torch import nn

from moeq import readers
from moeq.config import QuantConfig
from moeq.errors import MoeqError
from moeq.io import hub
from moeq.nn import finite


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
    model = finite.install(readers.read(hub.resolve(path), quant, dtype, progress, dev))
    if activations != "default":
        set_activations(model, activations)
    return model if dev.type == "cpu" else model.to(dev)


