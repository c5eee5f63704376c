import os

import torch

if not torch.cuda.is_available():  # the Triton kernels run on CPU tensors through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

import moeq
from moeq.arch import get_arch
from moeq.convert import fill_experts_module
from moeq.tiny import make_checkpoint

HEAVY = ("isa", "packaging", "asan")  # the lanes that build native code or packages: also marked slow


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(m) for m in HEAVY):
            item.add_marker(pytest.mark.slow)


hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """tiny_ckpt(model_type, **overrides) -> path of a random tiny checkpoint written by save_pretrained (cached)."""
    cache = {}

    def make(model_type, fused_layout=False, **kw):
        key = (model_type, fused_layout, repr(sorted(kw.items())))  # values may be dicts (rope_parameters)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{model_type}{'_fused' if fused_layout else ''}")
            cache[key] = make_checkpoint(model_type, d, fused_layout=fused_layout, **kw)
        return cache[key]

    return make


def dequantized_reference(qmodel, src, dtype):
    """The same model run through transformers' own forward, with every quantized weight dequantized back."""
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).eval()
    arch = get_arch(ref.config)
    for name, mod in qmodel.named_modules():
        if isinstance(mod, moeq.nn.QuantExperts):
            fill_experts_module(ref.get_submodule(name), arch, mod.w13.dequantize(dtype), mod.w2.dequantize(dtype),
                                mod.b13, mod.b2)
        elif isinstance(mod, moeq.nn.QuantLinear):
            ref.get_submodule(name).weight.data = mod.qweight.dequantize(dtype)
    return ref


def dequantized_clone(qmodel):
    """A plain transformers model (built from qmodel's config) holding qmodel's weights dequantized."""
    import copy

    from moeq.readers.state import skeleton as _skeleton

    cfg = copy.deepcopy(qmodel.config)
    dtype = next(p for p in qmodel.parameters() if p.is_floating_point()).dtype
    ref = _skeleton(cfg, dtype)
    arch = get_arch(cfg)
    for name, mod in qmodel.named_modules():
        if isinstance(mod, moeq.nn.QuantExperts):
            fill_experts_module(ref.get_submodule(name), arch, mod.w13.dequantize(dtype), mod.w2.dequantize(dtype),
                                mod.b13, mod.b2)
        elif isinstance(mod, moeq.nn.QuantLinear):
            lin = ref.get_submodule(name)
            lin.weight = torch.nn.Parameter(mod.qweight.dequantize(dtype), requires_grad=False)
            if mod.bias is not None:
                lin.bias = torch.nn.Parameter(mod.bias.detach().clone(), requires_grad=False)
    qsd = qmodel.state_dict()
    for name, p in list(ref.named_parameters()):
        if p.device.type == "meta":
            mod_name, _, attr = name.rpartition(".")
            setattr(ref.get_submodule(mod_name), attr, torch.nn.Parameter(qsd[name].clone(), requires_grad=False))
    return ref.eval()
