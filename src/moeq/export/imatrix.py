"""llama.cpp's importance matrix file, from moeq's data-free statistic: the GGUF ``imatrix`` file that
``llama-imatrix`` writes and ``llama-quantize --imatrix`` reads, measured on random token ids instead of calibration
text (:mod:`moeq.importance`). llama.cpp refuses its 1-2-bit IQ types without an importance matrix and weighs every
other type's rounding by one when given; with this file a user gets both for a checkpoint without any text.

The file holds, per quantized tensor (llama.cpp's name, e.g. ``blk.0.ffn_gate_exps.weight``), ``NAME.in_sum2``
(F32 ``[nmat, columns]``: the sum over tokens of each input column's square; ``nmat`` is the expert count for
expert stacks, 1 otherwise) and ``NAME.counts`` (F32 ``[nmat, 1]``), plus ``general.type = imatrix`` and the
``imatrix.datasets`` / ``imatrix.chunk_count`` / ``imatrix.chunk_size`` keys ``llama-quantize`` requires. llama.cpp
divides the sums by the counts. moeq's expert statistic is a sum over the tokens routed to each expert divided by all
tokens, so every count is the token total: per expert that is a constant factor away from llama-imatrix's per-expert
mean, which changes nothing for a quantizer that weighs one row's columns against each other (all of llama.cpp's).
An expert no random token reached gets count 0 (llama.cpp then weighs its columns equally)."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from pathlib import Path

import numpy as np
from torch import nn

from moeq.errors import MoeqError
from moeq.arch import GGUF_FAMILIES
from moeq.export.gguf import SUPPORTS, Planner, gguf_lib
from moeq.importance import INPUT_TEXT, SEQ, Importance
from moeq.io.writer import umask

log = logging.getLogger(__name__)

_LAYER = re.compile(r"\.layers\.(\d+)\.")
DATASET = "moeq data-free"  # how the datasets key of a file moeq wrote starts: the only files --overwrite replaces


def _ours(path: Path) -> bool:
    """Whether ``path`` is an imatrix file moeq wrote (then --overwrite may replace it; nothing else is)."""
    try:
        r = gguf_lib().GGUFReader(str(path))
        f = r.fields.get("imatrix.datasets")
        return f is not None and bytes(f.parts[f.data[0]]).decode("utf-8").startswith(DATASET)
    except Exception:  # noqa: BLE001 - any file that does not parse is not ours
        return False


def check_target(out: str | Path, overwrite: bool) -> Path:
    """``out`` as a path moeq may write the imatrix to: new, or (``overwrite``) an imatrix file moeq wrote."""
    out = Path(out)
    if out.is_dir():
        raise MoeqError(f"{out} is a directory; the imatrix is one file (e.g. model.imatrix.gguf)")
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise MoeqError(f"{out} exists; pass overwrite=True (--overwrite) to replace an imatrix moeq wrote")
        if out.is_symlink() or not _ours(out):
            raise MoeqError(f"{out} is not an imatrix file moeq wrote: not replacing it")
    return out


def entries(model: nn.Module, imp: Importance) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """llama.cpp tensor name -> (sums ``[nmat, columns]``, counts ``[nmat, 1]``), float32, for every linear and experts
    module of ``model`` that ``imp`` measured and llama.cpp's graph for this architecture holds."""
    fam = GGUF_FAMILIES.get(model.config.model_type)
    if fam is None:  # names only: a model llama.cpp's graph runs differently still has its tensors named
        raise MoeqError(f"{model.config.model_type}: no llama.cpp architecture is mapped for it; the imatrix takes "
                         f"{SUPPORTS.split(' (')[0]}")
    planner = Planner(model, fam)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, (inputs, mids) in imp.experts.items():
        found = _LAYER.search(name + ".")
        if found is None:
            raise MoeqError(f"importance: experts module {name!r} is not inside a numbered layer")
        il = int(found.group(1))
        pairs = {}
        for which, stat in (("in", inputs), ("mid", mids)):
            mean = stat.double().numpy()
            counts = np.where(mean.any(axis=1), float(imp.tokens), 0.0)[:, None]
            pairs[which] = ((mean * imp.tokens).astype(np.float32), counts.astype(np.float32))
        for kind, which in (("gate", "in"), ("up", "in"), ("down", "mid")):
            out[f"blk.{il}.ffn_{kind}_exps.weight"] = pairs[which]
    skipped = []
    for name, stat in imp.linears.items():
        if name.endswith(".kv_b_proj"):  # MLA: llama.cpp splits it into attn_k_b / attn_v_b with other inputs
            skipped.append(name)
            continue
        gname = planner.names.get_name(name)
        if gname is None:
            skipped.append(name)
            continue
        sums = stat.double().numpy()[None, :] * imp.tokens
        out[gname + ".weight"] = (sums.astype(np.float32), np.full((1, 1), float(imp.tokens), np.float32))
    if skipped:
        log.info("imatrix: %d measured linears have no llama.cpp tensor of their own (%s ...)", len(skipped),
                 ", ".join(skipped[:3]))
    for gname, (sums, _) in out.items():
        if not np.isfinite(sums).all():
            raise MoeqError(f"imatrix: the statistic for {gname} is not finite (a NaN/Inf activation on the first "
                             f"pass)")
    return out


def write(model: nn.Module, imp: Importance, out: str | Path, overwrite: bool = False) -> dict:
    """Write the imatrix file for ``model`` (the first-pass model ``imp`` was measured on, or any moeq model of the same
    checkpoint) to ``out``, atomically. Returns a summary (tensors, tokens, file)."""
    out = check_target(out, overwrite)
    ents = entries(model, imp)
    if not ents:
        raise MoeqError("imatrix: no measured tensor maps to a llama.cpp tensor")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    os.close(fd)
    try:
        w = gguf_lib().GGUFWriter(tmp, arch="imatrix")  # general.architecture: not read back by llama.cpp
        w.add_string("general.type", "imatrix")
        w.add_array("imatrix.datasets", [f"{DATASET}: {imp.tokens} tokens of {INPUT_TEXT[imp.inputs]}, seed "
                                         f"{imp.seed}, measured on {imp.measured_on}"])
        w.add_uint32("imatrix.chunk_count", imp.tokens // SEQ)
        w.add_uint32("imatrix.chunk_size", SEQ)
        for gname in sorted(ents):  # llama-imatrix's order: sorted names
            sums, counts = ents[gname]
            w.add_tensor(gname + ".in_sum2", np.ascontiguousarray(sums))
            w.add_tensor(gname + ".counts", np.ascontiguousarray(counts))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    log.info("imatrix: %d tensors over %d tokens (%s) -> %s", len(ents), imp.tokens, INPUT_TEXT[imp.inputs], out)
    return {"file": str(out), "tensors": len(ents), "tokens": imp.tokens, "seed": imp.seed,
            "inputs": imp.inputs, "measured_on": imp.measured_on}
