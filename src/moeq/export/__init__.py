"""Exporters: write a moeq model in a format a serving engine reads, losslessly, atomically.

| format | consumers | takes |
|---|---|---|
| ``bnb`` | transformers + bitsandbytes (dense part), vLLM bitsandbytes, moeq | NF4/FP4 (double quant as stored), LLM.int8 |
| ``compressed-tensors`` | vLLM (Marlin/Triton MoE), transformers, compressed_tensors | RTN int4/int8, sym/asym, group/row |
| ``gguf`` | llama.cpp (and its bindings, ollama, LM Studio) | mixtral/qwen2_moe/qwen3_moe/olmoe; Q4_0/Q8_0 exact from symmetric RTN g32, else re-quantized |

Adding an exporter: one module here with ``SUPPORTS`` (what it takes, for ``--help`` and errors), a ``_check`` that
refuses what the engine cannot load (naming the module and the command that works), and ``export(model, tmp, arch,
...) -> summary`` writing into the temporary directory :func:`export` hands it (atomic, like every output); then its
line in :data:`EXPORTERS` and a test that loads the result with the engine's own library.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

from moeq.arch import get_arch
from moeq.export import bnb, compressed_tensors, gguf
from moeq.export import check as check_mod
from moeq.export.common import quantized_modules
from moeq.importance import DEFAULT_INPUTS
from moeq.io.writer import atomic_dir, atomic_file, copy_side_files, model_sources
from moeq.errors import MoeqError

EXPORTERS = {"bnb": bnb, "compressed-tensors": compressed_tensors, "gguf": gguf}
HF_LAYOUT = {"bnb", "compressed-tensors"}  # formats that are a transformers checkpoint directory


def export(model: nn.Module, out: str | os.PathLike, format: str, overwrite: bool = False,
           source: str | os.PathLike | None = None, progress: bool = False, requantize: bool = False,
           layout: str = "transformers5", check: bool = True, max_kl: float = check_mod.MAX_KL,
           force: bool = False) -> dict:
    """Write ``model`` as ``format`` into ``out`` (atomically); returns a summary. ``source``: the checkpoint the
    model came from (tokenizer and side files are taken from it). ``layout`` (bnb): ``transformers5`` or
    ``transformers4`` (see :func:`moeq.export.bnb.export`). ``check``: load the written files as the consumer does and
    measure mean KL against ``model`` (``kl_vs_moeq`` in the summary), refusing past ``max_kl`` unless ``force``.
    ``gguf`` writes one file: ``out`` itself when it
    ends in ``.gguf``, else ``out/model.gguf``; ``requantize`` lets it round values with no exact GGUF type again."""
    if format not in EXPORTERS:
        raise MoeqError(f"unknown export format {format!r}; valid: {sorted(EXPORTERS)}")
    arch = get_arch(model.config)
    if format in HF_LAYOUT and not any(True for _ in quantized_modules(model)):
        raise MoeqError(f"the model has no quantized module: a {format} export of it would be a plain checkpoint "
                        "with an empty quantization config; quantize it first (e.g. moeq export SRC OUT --format "
                        f"{format} --method {'nf4' if format == 'bnb' else 'rtn-int4'})")
    sources = model_sources(model, source)
    if format == "gguf" and str(out).endswith(".gguf"):
        with atomic_file(out, overwrite, sources, ours=gguf.is_moeq_gguf) as tmp:
            summary = gguf.export(model, tmp.parent, arch, source=source, progress=progress, requantize=requantize,
                                  file=tmp.name)
            if check:
                summary["kl_vs_moeq"] = _judge(model, tmp, format, layout, source, max_kl, force)
        return {"format": format, "out": str(out), **summary, "file": Path(out).name}
    with atomic_dir(out, overwrite, sources) as tmp:
        if format in HF_LAYOUT:
            summary = (bnb.export(model, tmp, arch, layout=layout) if format == "bnb"
                       else EXPORTERS[format].export(model, tmp, arch))
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
            copy_side_files(source, tmp)
            if check:  # before the rename: a refused export leaves nothing behind
                summary["kl_vs_moeq"] = _judge(model, tmp, format, layout, source, max_kl, force)
        else:
            summary = EXPORTERS[format].export(model, tmp, arch, source=source, progress=progress,
                                               requantize=requantize)
            if check:
                summary["kl_vs_moeq"] = _judge(model, tmp / summary["file"], format, layout, source, max_kl, force)
    return {"format": format, "out": str(out), **summary}


def export_checkpoint(source: str | os.PathLike, out: str | os.PathLike, format: str, quant=None,
                      overwrite: bool = False, progress: bool = False, requantize: bool = False, dtype=None,
                      layout: str = "transformers5", check: bool = True, force: bool = False,
                      importance: int = 0, bpw: float | None = None, importance_inputs: str = DEFAULT_INPUTS) -> dict:
    """Read the checkpoint ``source`` (quantized in flight with ``quant``, as :func:`moeq.load` does) and write it as
    ``format``. A GGUF from any checkpoint read tensor by tensor (bf16/fp16, FP8, MXFP4, GPTQ/AWQ, bitsandbytes,
    compressed-tensors) is **streamed**: each decoder layer is written as soon as it is read and quantized, then
    freed — peak memory is about one layer, whatever the model's size (``peak_rss_bytes`` in the summary); ``check``
    then decodes every exactly-typed tensor back with gguf-py against moeq's values. Anything else is loaded whole,
    then written by :func:`export` (whose ``check`` compares the consumer's logits). ``importance``: as in
    :func:`moeq.load` (data-free column statistics from a first pass, on ``importance_inputs``; e.g. an IQ4_NL GGUF
    from ``iq4nl``; formats that need it, ``iq2s``, measure it unasked); ``bpw``:
    as in :func:`moeq.load` (each tensor's method chosen by data-free bit allocation; a GGUF has no exact type for
    ``nl3`` tensors, so a GGUF of a low budget needs ``requantize``)."""
    import resource  # noqa: PLC0415

    from moeq import readers  # noqa: PLC0415
    from moeq.config import QuantConfig  # noqa: PLC0415
    from moeq.io import hub  # noqa: PLC0415
    from moeq.io.writer import check_target  # noqa: PLC0415
    from moeq.loader import first_passes, load  # noqa: PLC0415

    if format not in EXPORTERS:
        raise MoeqError(f"unknown export format {format!r}; valid: {sorted(EXPORTERS)}")
    one_file = format == "gguf" and str(out).endswith(".gguf")
    if not one_file:
        check_target(Path(out), overwrite, [source])
    path = hub.resolve(source)
    if format != "gguf" or not readers.claim(readers.inspect(path, torch.device("cpu"))).streams:
        model = load(path, quant=quant, dtype=dtype, progress=progress, importance=importance, bpw=bpw,
                     importance_inputs=importance_inputs)
        return export(model, out, format, overwrite=overwrite, source=path, progress=progress, requantize=requantize,
                      layout=layout, check=check, force=force)
    quant, imp, _ = first_passes(path, QuantConfig.of(quant) if quant is not None else None, dtype, progress, bpw,
                                 importance, importance_inputs)

    def stream(file: Path) -> dict:
        sink = gguf.Stream(file, path, requantize=requantize, check=check, progress=progress)
        try:
            readers.read(path, quant, dtype, progress, torch.device("cpu"), sink=sink, importance=imp)
        finally:
            sink.close()
        return sink.summary()

    if one_file:
        with atomic_file(out, overwrite, [path], ours=gguf.is_moeq_gguf) as tmp:
            summary = stream(tmp) | {"file": Path(out).name}
    else:
        with atomic_dir(out, overwrite, [path]) as tmp:
            summary = stream(tmp / gguf.FILE)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"format": format, "out": str(out), **summary, "streamed": True, "peak_rss_bytes": peak}


def _judge(model: nn.Module, written: Path, format: str, layout: str, source, max_kl: float, force: bool):
    kl = check_mod.consumer_kl(model, written, format, layout, check_mod.sample_ids(model, source))
    if kl is not None and not math.isfinite(kl):  # a consumer computing NaN/Inf: never written, --force or not
        raise MoeqError(f"the {format} export, loaded as its consumer loads it, gives a non-finite KL ({kl}) "
                        "against moeq's model; refusing it")
    if kl is not None and kl > max_kl and not force:
        raise MoeqError(f"the {format} export, loaded as its consumer loads it, differs from moeq's model by mean KL "
                        f"{kl:.4g} nats (> {max_kl}); refusing it (--force writes it anyway)")
    return kl
