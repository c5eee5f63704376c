"""What a quantized model records about itself: ``config.json``'s ``quantization_config`` for the moeq format
(method, versions, rules and every quantized module's slots with their formats and metadata). Written for every
model moeq builds or loads; :mod:`moeq.readers.saved` reads it back."""
from __future__ import annotations

from torch import nn

from moeq.config import QuantConfig
from moeq.nn import QuantExperts, QuantLinear
from moeq.nn.packed import packed_meta
from moeq.version import __version__

QUANT_METHOD = "moeq"
FORMAT_VERSION = 1  # the saved layout: tensors {module}.{slot}_{field}, this record in config.json


def quantization_config(model: nn.Module, qcfg: QuantConfig) -> dict:
    """The ``quantization_config`` a saved moeq checkpoint carries: method, version, rules and per-module formats."""
    modules, labels = {}, set()
    for name, mod in model.named_modules():
        if isinstance(mod, (QuantExperts, QuantLinear)):
            entry = {"type": "experts" if isinstance(mod, QuantExperts) else "linear",
                     "slots": packed_meta(mod)}
            if isinstance(mod, QuantExperts):
                entry["activation"] = vars(mod.activation) | {}
                entry["bias"] = mod.b13 is not None
                entry["weight_on_input"] = mod.weight_on_input
            else:
                entry["bias"] = mod.bias is not None
            modules[name] = entry
            labels.update(v["format"] for v in entry["slots"].values())
    return {"quant_method": QUANT_METHOD, "version": __version__, "format_version": FORMAT_VERSION, "config": qcfg.to_dict(),
            "formats": sorted(labels), "modules": modules}
