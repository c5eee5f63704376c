"""Native forwards for the small per-layer modules of a CPU decode step: RMSNorms and softmax top-k routers.

At one token their work is a few thousand flops, yet transformers' forwards cost 20-200 µs each in torch op dispatch
(measured on the Qwen3-30B-A3B-shaped benchmark model: RMSNorm ~60 µs and router ~200 µs per layer inside a decode
step). At 48 layers that is tens of ms per token, as much as the weights take to stream. Each forward here is one
native call for bf16 CPU inputs of up to :data:`MAX_ROWS` rows and the module's own forward otherwise.

A fast forward is installed per module instance, and only after it reproduced that module's own output on a probe
input built from the module's real weights: a family whose norm or router differs (Gemma's ``1 + weight``, routers
with biases, sigmoid or grouped scoring) keeps its own forward.
"""
from __future__ import annotations

import ctypes
import logging
import types

import torch
from torch import nn

from moeq.kernels import cpu

log = logging.getLogger(__name__)
MAX_ROWS = 64
_NORM_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
_GEMV_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]


def _fn(name: str, argtypes: list):
    fn = getattr(cpu.lib(), name)
    if fn.argtypes is None:
        fn.argtypes = argtypes
    return fn


def _small_bf16(x: torch.Tensor, weight: torch.Tensor, n: int) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.is_contiguous() and x.shape[-1] == n
            and 0 < x.numel() // n <= MAX_ROWS)


def rms_norm(module: nn.Module, x: torch.Tensor, eps: float) -> torch.Tensor | None:
    """transformers' bf16 RMSNorm (fp32 statistics, normalized value rounded to bf16, times the weight) as one
    native call, or None outside its domain."""
    w = module.weight
    n = w.shape[-1]
    if w.dim() != 1 or not _small_bf16(x, w, n):
        return None
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty_like(x)
    _fn("moeq_rmsnorm_bf16", _NORM_ARGS)(x.data_ptr(), w.data_ptr(), x.numel() // n, n, eps, y.data_ptr())
    return y


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(x, weight)`` for a few bf16 rows as one native call (fp32 accumulation, rounded once), or None."""
    n, k = weight.shape
    if not _small_bf16(x, weight, k) or k % 32:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    if not _fn("moeq_bf16_gemv", _GEMV_ARGS)(x.data_ptr(), x.numel() // k, weight.data_ptr(), n, k, y.data_ptr()):
        return None
    return y


class _Norm:
    """The RMSNorm forward, bound per instance. Named ``forward`` so that a pickled module (``torch.save``) comes back
    with its class's own forward (a bound method pickles as a lookup of its name)."""

    @staticmethod
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        y = rms_norm(self, hidden_states, self._moeq_eps)
        return type(self).forward(self, hidden_states) if y is None else y


class _Router:
    """transformers' softmax top-k router (``(logits, scores, indices)``) with the logits from :func:`bf16_linear`;
    ``self._moeq_router = (renorm, cast)``: the top-k probabilities divided by their sum; scores returned in the
    logits' dtype. Bound per instance, named ``forward`` as :class:`_Norm`'s."""

    @staticmethod
    def forward(self: nn.Module, hidden_states: torch.Tensor):
        renorm, cast = self._moeq_router
        h = hidden_states.reshape(-1, self.hidden_dim)
        logits = bf16_linear(h, self.weight)
        if logits is None:
            return type(self).forward(self, hidden_states)
        values, indices = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        if renorm:
            values /= values.sum(dim=-1, keepdim=True)
        return logits, values.to(logits.dtype) if cast else values, indices


def _probe(n: int, rows: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(rows, n, generator=g) * torch.linspace(0.1, 3.0, rows)[:, None]).bfloat16()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to one bf16 rounding (summation order may differ from torch's)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= 2.0 ** -7 * torch.maximum(a.abs(), b.abs()) + 1e-6).all())


def _is_rms_norm(mod: nn.Module) -> float | None:
    w = getattr(mod, "weight", None)
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    if not type(mod).__name__.endswith("RMSNorm") or not isinstance(w, torch.Tensor) or w.dim() != 1:
        return None
    return float(eps) if isinstance(eps, (int, float)) else None


def _try_norm(mod: nn.Module, eps: float) -> bool:
    if mod.weight.dtype != torch.bfloat16 or mod.weight.device.type != "cpu":
        return False
    mod._moeq_eps = eps
    x = _probe(mod.weight.shape[0])
    with torch.no_grad():
        got, ref = rms_norm(mod, x, eps), type(mod).forward(mod, x)
    if got is None or not _close(got, ref):
        del mod._moeq_eps
        return False
    mod.forward = types.MethodType(_Norm.forward, mod)  # a bound method: deepcopy rebinds it to the copy
    return True


def _try_router(mod: nn.Module) -> bool:
    w = getattr(mod, "weight", None)
    if (not type(mod).__name__.endswith("TopKRouter") or not isinstance(w, torch.Tensor) or w.dim() != 2
            or w.dtype != torch.bfloat16 or w.device.type != "cpu" or not isinstance(getattr(mod, "top_k", None), int)
            or getattr(mod, "hidden_dim", None) != w.shape[1] or any(b is not None for b in mod._buffers.values())
            or any(n != "weight" for n, _ in mod.named_parameters(recurse=False))):
        return False
    x = _probe(w.shape[1], rows=8)
    with torch.no_grad():
        ref = type(mod).forward(mod, x)
        if not (isinstance(ref, tuple) and len(ref) == 3) or bf16_linear(x, w) is None:
            return False
        for renorm in (True, False):
            for cast in (True, False):
                mod._moeq_router = (renorm, cast)
                got = _Router.forward(mod, x)
                if (torch.equal(got[2], ref[2]) and _close(got[0], ref[0]) and got[1].dtype == ref[1].dtype
                        and torch.allclose(got[1].float(), ref[1].float(), rtol=2.0 ** -7, atol=1e-6)):
                    mod.forward = types.MethodType(_Router.forward, mod)
                    return True
    del mod._moeq_router
    return False


def install(model: nn.Module) -> dict[str, int]:
    """Give the model's bf16 RMSNorms and softmax top-k routers their native decode forwards where each reproduces
    the module's own output; returns how many of each got one. A no-op without the native kernels (AVX512-BF16)."""
    done = {"rms_norm": 0, "router": 0}
    if not cpu.has_dpbf16():
        return done
    for _, mod in model.named_modules():
        if "forward" in mod.__dict__:  # already installed (or replaced by someone else): leave it
            continue
        eps = _is_rms_norm(mod)
        if eps is not None:
            done["rms_norm"] += _try_norm(mod, eps)
        elif _try_router(mod):
            done["router"] += 1
    log.debug("native decode forwards: %s", done)
    return done

