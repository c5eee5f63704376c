"""CPU attention: transformers' ``sdpa`` with cheaper paths for one query token and for a causal prompt.

torch's CPU ``scaled_dot_product_attention`` is a flash kernel built for long queries and costs several times more
for a single query token against a short cache than the same product as three small fp32 ops — scores for each kv
head's group of query heads, softmax, weighted values — which also compute in fp32 rather than bf16. bf16 inputs with
at most one mask row per sequence go further: one native call that reads the cache in place (the README's "where the
time goes" has the measured costs). A causal prompt without a mask (bf16, AVX512-BF16) runs a native flash-style
kernel (:func:`_native_prefill`: torch's CPU flash kernel reaches ~10% of the dot-product peak there; with AMX torch's
kernel is the faster one and runs). Everything
else (padded batches, dropout, softcap, position bias, attention sinks, CUDA) is transformers' own
``sdpa_attention_forward``, and masks are built by its ``sdpa_mask``.

Registered with transformers' attention and mask interfaces under :data:`NAME`; :func:`use` switches a model that
runs ``sdpa`` to it.
"""
from __future__ import annotations


import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from moeq import native

NAME = "moeq_sdpa"


def _plain(dropout: float, kwargs: dict) -> bool:
    """Plain softmax attention: no dropout, softcap, position bias, attention sinks or returned weights (what the
    native paths compute)."""
    return (dropout == 0.0 and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
            and kwargs.get("s_aux") is None and not kwargs.get("output_attentions", False))


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """``query [B, Hq, 1, D]``, ``key/value [B, Hkv, S, D]`` -> ``([B, 1, Hq, D], None)`` like ``sdpa``."""
    b, hq, q_len, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    simple = (q_len == 1 and query.device.type == "cpu" and _plain(dropout, kwargs) and hq % hkv == 0
              and value.shape[-1] == d
              and (attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[-1] == s
                                              and attention_mask.shape[1] in (1, hq) and attention_mask.shape[2] == 1)))
    if not simple:
        # with AMX torch's flash kernel multiplies on the tile unit: a 512-token prompt of 32 query / 4 kv heads of
        # 128 in 8.6 ms against the native AVX512-BF16 kernel's 23 ms (Sapphire Rapids, 2 threads)
        out = None if native.has_amx() else _native_prefill(module, query, key, value, attention_mask, dropout,
                                                                 scaling, kwargs)
        if out is not None:
            return out, None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    g = hq // hkv
    scale = d ** -0.5 if scaling is None else scaling
    out = _native(query, key, value, attention_mask, scale)
    if out is not None:
        return out, None
    q = query.reshape(b, hkv, g, d).float()
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, S]
    if attention_mask is not None:
        m = attention_mask.reshape(b, hkv if attention_mask.shape[1] == hq else 1, -1, s)
        if m.dtype == torch.bool:
            scores.masked_fill_(~m, float("-inf"))
        else:
            scores.add_(m.float())
    out = torch.matmul(torch.softmax(scores, dim=-1), value.float())  # [B, Hkv, G, D]
    return out.reshape(b, hq, 1, d).transpose(1, 2).to(query.dtype), None


def additive_mask(mask: torch.Tensor | None, b: int, s: int) -> torch.Tensor | None | bool:
    """A one-query step's attention mask as additive fp32 ``[b, s]`` (None: no mask), or False when it is not one row
    per sequence over the ``s`` keys (per-head masks and the like keep the torch path)."""
    if mask is None:
        return None
    if mask.dim() != 4 or tuple(mask.shape) != (b, 1, 1, s):
        return False
    m = mask.reshape(b, s)
    return (torch.zeros(b, s).masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else m.float()).contiguous()


def _native(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor | None:
    """bf16 inputs with no mask or one mask row per sequence: one native call reading the cache in place (the torch ops
    below convert the whole cache to fp32 first)."""
    b, hq, _, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    if (query.dtype != torch.bfloat16 or key.dtype != torch.bfloat16 or value.dtype != torch.bfloat16
            or d % 16 or value.shape != key.shape or not native.has_simd()):
        return None
    add = additive_mask(mask, b, s)
    if add is False:
        return None
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    out = torch.empty(b, 1, hq, d, dtype=torch.bfloat16)
    native.func("moeq_attn_decode_bf16")(q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                              None if add is None else add.data_ptr(), b, hq, hkv, s, d, scale,
                                              out.data_ptr())
    return out


def _native_prefill(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                    kwargs: dict) -> torch.Tensor | None:
    """A causal prompt without a mask (what ``sdpa`` runs with ``is_causal``), bf16, on AVX512-BF16:
    ``moeq_attn_prefill_bf16`` (flash-style, fp32 softmax; native/csrc/gemm.c), ``[B, L, Hq, D]``; else None. Keys
    beyond the queries are cropped first, as ``sdpa_attention_forward`` does (an empty static cache)."""
    b, hq, q_len, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if not (q_len > 1 and causal and attention_mask is None and _plain(dropout, kwargs) and s >= q_len
            and query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == torch.bfloat16
            and hq % hkv == 0 and d % 32 == 0 and d <= 512 and value.shape == key.shape and native.has_dpbf16()):
        return None
    q, k, v = query.contiguous(), key[:, :, :q_len].contiguous(), value[:, :, :q_len].contiguous()
    out = torch.empty(b, q_len, hq, d, dtype=torch.bfloat16)
    scale = d ** -0.5 if scaling is None else scaling
    rc = native.lib().moeq_attn_prefill_bf16(native.ptr(q), native.ptr(k), native.ptr(v), native.i64(b),
                                             native.i64(hq), native.i64(hkv), native.i64(q_len), native.i64(d),
                                             float(scale), native.ptr(out))
    if rc == -1:
        raise MemoryError("moeq_attn_prefill_bf16: could not allocate its scratch")
    return out if rc == 1 else None


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use(model: nn.Module) -> None:
    """Switch a model (and its sub-configs) from ``sdpa`` to the decode-step path; leave any other choice alone."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa" and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
