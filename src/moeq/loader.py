"""``moeq.load``: one entry for every checkpoint moeq reads. :mod:`moeq.readers` decides once which reader a
checkpoint is (a saved moeq checkpoint, a bf16/fp16 source, bitsandbytes, compressed-tensors, a moeq GGUF file);
every streaming reader ends in :class:`~moeq.readers.state.LoadState`'s ``finish``: every checkpoint key used, every
parameter filled, or an error naming them."""
from __future__ import annotations

import dataclasses
import logging
import os

import torch
from torch import nn

from moeq import readers
from moeq.config import QuantConfig
from moeq.errors import MoeqError
from moeq.importance import DEFAULT_INPUTS
from moeq.io import hub
from moeq.nn import finite

log = logging.getLogger(__name__)
AUTO_IMPORTANCE_TOKENS = 8192  # the importance a format that needs it gets when the caller asked for none


def load(path: str | os.PathLike, quant: QuantConfig | str | None = None, dtype: torch.dtype | None = None,
         progress: bool = True, device: str | torch.device | None = None, activations: str = "default",
         importance: int = 0, bpw: float | None = None, importance_inputs: str = DEFAULT_INPUTS) -> nn.Module:
    """Load a checkpoint directory (or a Hub id already in the local Hugging Face cache): a moeq checkpoint as
    saved, or a bf16/fp16 one quantized in flight with ``quant`` (a :class:`QuantConfig`, a format config or a method name; None loads it unquantized).

    ``device`` (default CPU): where the model runs. On a GPU, source tensors stream from disk to the GPU one at a
    time and are quantized there; saved and pre-quantized checkpoints are moved once loaded.

    ``activations``: the CPU decode kernels' numerics, ``"default"`` or ``"int8"`` (see :func:`moeq.set_activations`).

    ``importance`` (tokens, e.g. 8192; 0: off): data-free importance (:mod:`moeq.importance`) — a first streamed pass
    quantizes the checkpoint with ``q8_0`` (``q4_0`` where that does not fit), runs that many tokens through it and
    keeps each quantized weight's mean squared input columns; the second pass quantizes with ``quant`` weighing its
    scale search by them. ``importance_inputs``: ``"self"`` (text the first-pass model samples itself from random
    first tokens) or ``"random"`` (uniformly random token ids: faster, worse at 2 bits). For methods whose quantizer
    searches (``iq4nl*``, ``nl3*``, ``q4_0-opt``, ``iq2s*``); no text needed. Formats unusable without it (``iq2s``:
    no zero level) get it at :data:`AUTO_IMPORTANCE_TOKENS` when 0.

    ``bpw`` (bits per quantized weight, e.g. 3.8): data-free bit allocation (:mod:`moeq.allocate`) — the model is
    first loaded unquantized, each tensor's sensitivity measured on random token ids, and each tensor's method chosen
    from :data:`moeq.allocate.LADDER` to fit the budget; ``quant`` must then be None.

    The model raises :class:`moeq.nn.finite.NonFiniteError` (a :class:`MoeqError`) at the first layer that turns finite
    input into NaN/Inf, rather than return non-finite logits (:mod:`moeq.nn.finite`)."""
    from moeq.kernels.gpu import check_device  # noqa: PLC0415

    from moeq.api import ACTIVATIONS, set_activations  # noqa: PLC0415

    if activations not in ACTIVATIONS:
        raise MoeqError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    dev = check_device(device)
    src = hub.resolve(path)
    quant, imp, allocation = first_passes(src, quant, dtype, progress, bpw, importance, importance_inputs)
    model = finite.install(readers.read(src, quant, dtype, progress, dev, importance=imp))
    qc = getattr(model.config, "quantization_config", None)
    if imp is not None and isinstance(qc, dict):  # saved with the model: how its scales were chosen
        qc["importance"] = {"tokens": imp.tokens, "seed": imp.seed, "inputs": imp.inputs,
                            "measured_on": imp.measured_on}
    if allocation is not None and isinstance(qc, dict):  # saved with the model: how its methods were chosen
        qc["allocation"] = allocation
    if activations != "default":
        set_activations(model, activations)
    return model if dev.type == "cpu" else model.to(dev)




def first_passes(src, quant, dtype, progress: bool, bpw: float | None, importance: int, inputs: str):
    """What a load (or a streamed export) runs before its quantizing pass: the data-free importance when asked for
    (``importance`` tokens) or when a format of ``quant`` needs it (:data:`AUTO_IMPORTANCE_TOKENS`), and with ``bpw``
    the bit allocation (weighing each tensor's error by the importance). Returns ``(quant, importance, allocation)``:
    the config to quantize with, the :class:`moeq.importance.Importance` or None, the allocation's summary or None."""
    if bpw is not None:  # the importance first: the allocation then weighs each tensor's error by it too
        imp = importance_for(src, "iq4nl", dtype, progress, importance, inputs) if importance else None
        quant, allocation = allocate_for(src, quant, dtype, progress, bpw, imp)
        return quant, imp, allocation
    if not importance and needs_importance(quant):
        importance = AUTO_IMPORTANCE_TOKENS
        log.info("%s needs column importance: measuring moeq's data-free statistic on %d tokens first",
                 quant if isinstance(quant, str) else "this config", importance)
    return quant, importance_for(src, quant, dtype, progress, importance, inputs) if importance else None, None


def allocate_for(src, quant, dtype, progress: bool, bpw: float, importance=None):
    """The first pass of a ``bpw=`` load: :func:`moeq.allocate.measure` on the checkpoint loaded unquantized (its
    errors weighted by ``importance`` when given), then the budget's :class:`QuantConfig` and its summary."""
    from moeq import allocate  # noqa: PLC0415

    if quant is not None:
        raise MoeqError(f"bpw chooses each tensor's method itself (from {', '.join(allocate.LADDER)}); give no method "
                        f"with it, got {quant!r}")
    if isinstance(bpw, bool) or not isinstance(bpw, (int, float)) or not 2.0 <= bpw <= 16.0:
        raise MoeqError(f"bpw must be a number of bits per weight between 2 and 16, got {bpw!r}")
    first = finite.install(readers.read(src, None, dtype, progress, torch.device("cpu")))
    try:
        sens = allocate.measure(first, progress=progress, importance=importance)
    finally:
        del first
    return allocate.config(sens, float(bpw)), allocate.summary(sens, float(bpw)) | {
        "importance_weighted": importance is not None}


def needs_importance(quant) -> bool:
    """Whether any format of ``quant`` is unusable without column importance (``iq2s``)."""
    if quant is None:
        return False
    qcfg = QuantConfig.of(quant)
    return any(f.needs_importance() for f in (qcfg.default, *(f for _, f in qcfg.all_rules)))


def importance_for(src, quant, dtype, progress: bool, tokens: int, inputs: str = DEFAULT_INPUTS):
    """The first pass of an ``importance=`` load: :func:`moeq.importance.collect` on the checkpoint loaded with
    :func:`moeq.importance.first_pass`'s method, on the CPU."""
    from moeq import importance as imp  # noqa: PLC0415

    qcfg = QuantConfig.of(quant) if quant is not None else None
    if qcfg is None or not any(f.uses_importance() for f in (qcfg.default, *(f for _, f in qcfg.all_rules))):
        raise MoeqError(f"importance needs a method whose quantizer searches its scales (iq4nl, iq4nl-m, nl3, "
                        f"q4_0-opt, ...); {quant!r} has none")
    return measure(src, dtype, progress, tokens, inputs=inputs)


def measure(src, dtype, progress: bool, tokens: int, seed: int = 0, then=None, inputs: str = DEFAULT_INPUTS):
    """:func:`moeq.importance.collect` on the checkpoint loaded with :func:`moeq.importance.first_pass`'s method, on
    the CPU; ``then(first_model, importance)`` runs before the first-pass model is freed (the imatrix writer names
    llama.cpp's tensors from it). Returns the importance."""
    from moeq import importance as imp  # noqa: PLC0415

    if type(tokens) is not int or tokens < imp.SEQ or tokens % imp.SEQ:
        raise MoeqError(f"importance: a positive multiple of {imp.SEQ} tokens, got {tokens!r}")
    imp.check_inputs(inputs)
    method = imp.first_pass(readers.weight_count(src))
    first = finite.install(readers.read(src, method, dtype, progress, torch.device("cpu")))
    try:
        got = dataclasses.replace(imp.collect(first, tokens, seed=seed, progress=progress, inputs=inputs),
                                  measured_on=method)
        if then is not None:
            then(first, got)
        return got
    finally:
        del first


def imatrix(path: str | os.PathLike, out: str | os.PathLike, tokens: int = 8192, seed: int = 0,
            dtype: torch.dtype | None = None, progress: bool = True, overwrite: bool = False,
            inputs: str = DEFAULT_INPUTS) -> dict:
    """llama.cpp's importance matrix for a checkpoint, without calibration text: moeq's data-free statistic
    (:mod:`moeq.importance`, ``tokens`` random ids) written as the GGUF imatrix file ``llama-quantize --imatrix``
    reads (:mod:`moeq.export.imatrix`). Returns the writer's summary."""
    from moeq.export import imatrix as writer  # noqa: PLC0415

    src = hub.resolve(path)
    writer.check_target(out, overwrite)  # before the measurement, not after it
    done: dict = {}
    measure(src, dtype, progress, tokens, seed,
            then=lambda model, imp: done.update(writer.write(model, imp, out, overwrite=overwrite)), inputs=inputs)
    return done
