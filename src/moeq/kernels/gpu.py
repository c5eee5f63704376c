"""Device selection and the GPU forward paths. Triton is imported only here, and only when a module runs on a GPU
(or a test asks for the kernels): CPU-only installs never need it."""
from __future__ import annotations

import importlib.util

import torch

from moeq.formats import PackedWeight
from moeq.errors import MoeqError


def check_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch.device, or a clear error when this machine/install cannot run on it."""
    unsupported = f"device {str(device)!r} is not supported; use 'cpu' or 'cuda' (a CUDA or ROCm GPU)"
    try:
        dev = torch.device(device if device is not None else "cpu")
    except RuntimeError:
        raise MoeqError(unsupported) from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise MoeqError(unsupported)
    if not torch.cuda.is_available():
        raise MoeqError(f"device {str(dev)!r}: no GPU is usable here (torch {torch.__version__} was built "
                         f"{'without CUDA' if torch.version.cuda is None and torch.version.hip is None else 'with CUDA'}"
                         f", torch.cuda.is_available() is False)")
    if importlib.util.find_spec("triton") is None:
        raise ImportError(f"device {str(dev)!r} needs Triton for moeq's GPU kernels: pip install 'moeq[gpu]'")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise MoeqError(f"device {str(dev)!r}: only {torch.cuda.device_count()} GPU(s) present")
    return dev


def layout(module: torch.nn.Module, slot: str, w: PackedWeight):
    """The kernel layout of ``module``'s packed ``slot``, built once per storage and cached on the module."""
    from moeq.kernels import triton_moe  # noqa: PLC0415

    cache = module.__dict__.setdefault("_kernel_layouts", {})
    first = next(iter(w.tensors().values()))
    key = (slot, first.device, first.data_ptr())
    if key not in cache:
        for stale in [k for k in cache if k[0] == slot]:  # the module moved or was reloaded
            del cache[stale]
        cache[key] = triton_moe.kernel_layout(w)
    return cache[key]


def experts_forward(mod, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor | None:
    """Fused Triton MoE for a :class:`moeq.nn.QuantExperts`, or None when a weight's layout is not supported."""
    from moeq.kernels import triton_moe as tm  # noqa: PLC0415

    l13, l2 = layout(mod, "w13", mod.w13), layout(mod, "w2", mod.w2)
    if l13 is None or l2 is None:
        return None
    act, fn = tm.ACT_NONE, mod.activation
    if fn.kind == "glu" and fn.act == "silu":
        act = tm.ACT_SILU_GLU
    elif fn.kind == "gptoss" and (fn.alpha, fn.limit) == (1.702, 7.0):
        act = tm.ACT_GPTOSS
    return tm.fused_moe(hidden_states, l13, l2, top_k_index, top_k_weights, act=act, b13=mod.b13, b2=mod.b2,
                        weight_on_input=mod.weight_on_input, act_fn=fn)


def linear_forward(mod, x: torch.Tensor) -> torch.Tensor | None:
    from moeq.kernels import triton_moe as tm  # noqa: PLC0415

    lw = layout(mod, "weight", mod.qweight)
    return None if lw is None else tm.linear(x, lw, mod.bias)
