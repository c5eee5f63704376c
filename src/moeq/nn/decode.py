"""Native forwards for the small per-layer modules of a CPU decode step: RMSNorms, softmax top-k routers and the
glue of Llama-style attention (RoPE, cache update, the attention itself).

At one token their work is a few thousand flops, yet transformers' forwards cost tens to hundreds of µs each in torch
op dispatch (README, "where the time goes"); over a model's layers that is as much per token as the weights take to
stream. Each forward here is one
native call for bf16 CPU inputs of up to :data:`MAX_ROWS` rows and the module's own forward otherwise.

A fast forward is installed per module instance, and only after it reproduced that module's own output on a probe
input built from the module's real weights: a family whose norm or router differs (Gemma's ``1 + weight``, routers
with biases, sigmoid or grouped scoring, attention with clipped or partial-rotary projections) keeps its own forward.
"""
from __future__ import annotations

import copy
import ctypes
import inspect
import itertools
import logging

import torch
from torch import nn

from moeq import native
from moeq.errors import MoeqError
from moeq.nn import attention, bf12, packed

log = logging.getLogger(__name__)
MAX_ROWS = 64


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
    native.func("moeq_rmsnorm_bf16")(x.data_ptr(), w.data_ptr(), x.numel() // n, n, eps, y.data_ptr())
    return y


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(x, weight)`` for a few bf16 rows as one native call (fp32 accumulation, rounded once), or None."""
    n, k = weight.shape
    if not _small_bf16(x, weight, k) or k % 32:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    gemv = native.func("moeq_bf16_gemv")
    if not gemv(x.data_ptr(), x.numel() // k, weight.data_ptr(), n, k, y.data_ptr()):
        return None
    return y


class Installed:
    """A native forward installed on one module instance as its ``forward``: moeq's own object, holding the module
    and what the module's probe decided, so that moeq stores nothing else on (transformers') modules. Anything
    outside its domain runs the class's own forward. A deep copy of the module gets one bound to the copy; a pickled
    module (``torch.save``) comes back with its class's own forward (this object pickles as a lookup of ``forward``).
    ``name``: the method it replaces."""

    name = "forward"

    def __init__(self, mod: nn.Module) -> None:
        self.mod = mod

    def __call__(self, *args, **kwargs):
        return self.run(self.mod, *args, **kwargs)

    def run(self, mod: nn.Module, *args, **kwargs):
        raise NotImplementedError

    def __reduce__(self):
        return getattr, (self.mod, self.name)

    def __deepcopy__(self, memo):
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    @classmethod
    def on(cls, mod: nn.Module | None):
        """The forward of this kind installed on ``mod``, or None."""
        fwd = getattr(mod, "__dict__", {}).get(cls.name)
        return fwd if isinstance(fwd, cls) else None

    def install(self) -> bool:
        setattr(self.mod, self.name, self)
        return True


class NormForward(Installed):
    """The RMSNorm forward (:func:`rms_norm`) with the module's epsilon."""

    def __init__(self, mod: nn.Module, eps: float) -> None:
        super().__init__(mod)
        self.eps = eps

    def run(self, mod: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        y = rms_norm(mod, hidden_states, self.eps)
        return type(mod).forward(mod, hidden_states) if y is None else y


class RouterForward(Installed):
    """transformers' softmax top-k router (``(logits, scores, indices)``) with the logits from :func:`bf16_linear`;
    ``renorm``: the top-k probabilities divided by their sum; ``cast``: scores returned in the logits' dtype."""

    def __init__(self, mod: nn.Module, renorm: bool, cast: bool) -> None:
        super().__init__(mod)
        self.renorm, self.cast = renorm, cast

    def run(self, mod: nn.Module, hidden_states: torch.Tensor):
        h = hidden_states.reshape(-1, mod.hidden_dim)
        logits = bf16_linear(h, mod.weight)
        if logits is None:
            return type(mod).forward(mod, hidden_states)
        values, indices = self.top_k(logits)
        return logits, values, indices

    def top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's scores and indices from its logits."""
        values, indices = torch.topk(torch.softmax(logits.float(), dim=-1), self.mod.top_k, dim=-1)
        if self.renorm:
            values /= values.sum(dim=-1, keepdim=True)
        return values.to(logits.dtype) if self.cast else values, indices

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`top_k` as the native MoE step takes it: fp32 weights (the router's values, exactly) and int64
        indices."""
        values, indices = self.top_k(logits)
        return values.float().contiguous(), indices.contiguous()


HEAD_MAX_ROWS = 4  # AVX2: the gemv re-reads each weight row from L1 per x row; past ~4 rows torch's GEMM wins
HEAD_MAX_ROWS_BF16 = 16  # AVX512-BF16: two weight rows per pass, faster than torch's GEMM up to ~12 rows, level at 16


def head_max_rows() -> int:
    """Rows the native bf16 head takes on this CPU: one on AMX CPUs (oneDNN's AMX GEMM wins from 2 rows), 16 with
    AVX512-BF16 (measured 1.2x torch's GEMM at 8 rows, level at 16, on Zen 4), else 4."""
    return 1 if native.has_amx() else HEAD_MAX_ROWS_BF16 if native.has_dpbf16() else HEAD_MAX_ROWS


class HeadForward(Installed):
    """A bf16 output head (``nn.Linear`` without bias, e.g. the lm_head the default policy keeps, or tied
    embeddings) for up to :func:`head_max_rows` rows as one native gemv at memory speed; torch's CPU bf16 gemv reads
    a 150k-row head several times slower."""

    def run(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // mod.in_features
        if rows <= head_max_rows():  # batch-invariant: a row's logits have the same bits in any batch up to it
            y = bf16_linear(x, mod.weight)
            if y is not None:
                return y
        return type(mod).forward(mod, x)


def _head_close(got: torch.Tensor | None, ref: torch.Tensor) -> bool:
    """One bf16 rounding of each output, plus summation-order noise on outputs that cancel to near zero."""
    if got is None or got.shape != ref.shape:
        return False
    g, r = got.float(), ref.float()
    tol = 2.0 ** -7 * torch.maximum(g.abs(), r.abs()) + 2.0 ** -12 * r.abs().amax(-1, keepdim=True)
    return bool(((g - r).abs() <= tol).all())


def head_for_batches(model: nn.Module) -> bool:
    """Hold a bf12 head as plain bf16 again (the native gemv up to :func:`head_max_rows` rows, torch's GEMM beyond):
    for batched decode, where bf12's forward past :data:`~moeq.nn.bf12.MAX_ROWS` rows unpacks blocks for a GEMM
    (68 vs 32 ms at 8 rows for a 151936 x 2048 head, 2 threads, Intel SPR) at the cost of 1/3 more head bytes at one
    row. Returns whether it changed the head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, bf12.Bf12Linear) or not hasattr(model, "set_output_embeddings"):
        return False
    plain = nn.Linear(head.in_features, head.out_features, bias=False, dtype=torch.bfloat16, device="meta")
    plain.weight = nn.Parameter(head.unpack(), requires_grad=False)
    model.set_output_embeddings(plain)
    try_head(model, compact=False)
    return True


def _untied(model: nn.Module, head: nn.Linear) -> bool:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    emb_w = getattr(emb, "weight", None)
    shared = isinstance(emb_w, torch.Tensor) and emb_w.data_ptr() == head.weight.data_ptr()
    return not getattr(cfg, "tie_word_embeddings", False) and not shared


def try_head(model: nn.Module, compact: bool = True) -> bool:
    """The bf16 head's native forward: held in bf12 (:class:`~moeq.nn.bf12.Bf12Linear`, 3/4 of the bytes, the same
    weights) when ``compact``, it is untied from the embeddings and ``K % 128 == 0``, else the bf16 gemv on its own
    weight."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (type(head) is not nn.Linear or head.bias is not None or "forward" in head.__dict__
            or head.weight.dtype != torch.bfloat16 or head.weight.device.type != "cpu"
            or not head.weight.is_contiguous() or head.in_features % 32):
        return False
    x = _probe(head.in_features, rows=HEAD_MAX_ROWS)
    with torch.no_grad():
        ref = nn.functional.linear(x, head.weight)
        if (compact and head.in_features % bf12.UNIT == 0 and _untied(model, head)
                and hasattr(model, "set_output_embeddings")):
            packed = bf12.Bf12Linear.from_linear(head, max_fraction=0.8)  # None: outliers, too many exceptions
            if packed is not None and _head_close(packed(x), ref):
                model.set_output_embeddings(packed)
                return True
        if not _head_close(bf16_linear(x, head.weight), ref):
            return False
    return HeadForward(head).install()


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place, one token: ``x [B, 1, H, D]`` (contiguous bf16) = x cos + rotate_half(x) sin, ``cos/sin [B, 1, D]``,
    with torch's bf16 rounding of each product and of the sum."""
    b, _, h, d = x.shape
    native.func("moeq_rope_bf16")(x.data_ptr(), b, h, d, cos.data_ptr(), sin.data_ptr())


class AttentionForward(Installed):
    """transformers' Llama-style attention forward (q/k/v projections, optional q/k RMSNorms per head or over the
    whole projection, RoPE, cache update, attention, o projection) for one bf16 token, with RoPE and the attention
    native; ``qk_norm`` is "none", "head" or "full"."""

    def __init__(self, mod: nn.Module, qk_norm: str) -> None:
        super().__init__(mod)
        self.qk_norm = qk_norm

    def run(self, mod: nn.Module, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
            cache=None, **kwargs):
        b, t, _ = hidden_states.shape if hidden_states.dim() == 3 else (0, 0, 0)
        d = mod.head_dim
        cos, sin = position_embeddings if position_embeddings is not None else (None, None)
        if (t != 1 or cache is None or cos is None or mod.training or hidden_states.dtype != torch.bfloat16
                or hidden_states.device.type != "cpu" or cos.dtype != torch.bfloat16 or cos.shape != (b, 1, d)
                or kwargs.get("output_attentions")):
            return type(mod).forward(mod, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        norm = self.qk_norm
        q, k, v = mod.q_proj(hidden_states), mod.k_proj(hidden_states), mod.v_proj(hidden_states)
        if norm == "full":
            q, k = mod.q_norm(q), mod.k_norm(k)
        q, k, v = (z.reshape(b, 1, -1, d) for z in (q, k, v))
        if norm == "head":
            q, k = mod.q_norm(q), mod.k_norm(k)
        q, k = q.contiguous(), k.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        rope_(q, cos, sin)
        rope_(k, cos, sin)
        keys, values = cache.update(k.transpose(1, 2), v.transpose(1, 2), mod.layer_idx, kwargs=kwargs)
        out, _ = attention.attention_forward(mod, q.transpose(1, 2), keys, values, attention_mask,
                                             scaling=mod.scaling, **kwargs)
        return mod.o_proj(out.reshape(b, 1, -1)), None


def _probe(n: int, rows: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(rows, n, generator=g) * torch.linspace(0.1, 3.0, rows)[:, None]).bfloat16()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
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
    x = _probe(mod.weight.shape[0])
    with torch.no_grad():
        got, ref = rms_norm(mod, x, eps), type(mod).forward(mod, x)
    return got is not None and close(got, ref) and NormForward(mod, eps).install()


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
                fwd = RouterForward(mod, renorm, cast)
                got = fwd.run(mod, x)
                if (torch.equal(got[2], ref[2]) and close(got[0], ref[0]) and got[1].dtype == ref[1].dtype
                        and torch.allclose(got[1].float(), ref[1].float(), rtol=2.0 ** -7, atol=1e-6)):
                    return fwd.install()
    return False


def _try_attention(mod: nn.Module, model: nn.Module, rotary: nn.Module | None) -> bool:
    """Install :class:`AttentionForward` where it reproduces the module's own decode step on a probe: three tokens of
    prefill, then one step at position 3, each against its own cache."""
    from transformers import DynamicCache  # noqa: PLC0415

    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if (rotary is None or not type(mod).__name__.endswith("Attention") or not all(hasattr(mod, n) for n in names)
            or not isinstance(getattr(mod, "head_dim", None), int)
            or not isinstance(getattr(mod, "layer_idx", None), int)
            or getattr(model.config, "_attn_implementation", None) != attention.NAME
            or getattr(getattr(mod, "config", None), "clip_qkv", None) is not None):
        return False
    t = next(itertools.chain(mod.parameters(), mod.buffers()), None)
    if t is None or t.device.type != "cpu" or getattr(model, "dtype", None) != torch.bfloat16:
        return False
    has_norm = hasattr(mod, "q_norm") and hasattr(mod, "k_norm")
    width = mod.q_proj.out_features if hasattr(mod.q_proj, "out_features") else None
    norm_dim = getattr(getattr(mod, "q_norm", None), "weight", torch.empty(0)).shape[-1] if has_norm else None
    variant = "none" if not has_norm else "head" if norm_dim == mod.head_dim else "full" if norm_dim == width else None
    if variant is None:
        return False
    hidden = mod.q_proj.in_features if hasattr(mod.q_proj, "in_features") else None
    if hidden is None:
        return False
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 4, hidden, generator=g)).bfloat16()
    pos = torch.arange(4)[None].expand(2, 4)
    fwd = AttentionForward(mod, variant)
    try:  # a probe: a module this forward cannot run keeps its own
        with torch.no_grad():
            cos, sin = rotary(x, pos)
            caches = [DynamicCache(config=model.config) for _ in range(2)]
            for c in caches:
                type(mod).forward(mod, x[:, :3], (cos[:, :3], sin[:, :3]), None, cache=c)
            ref, _ = type(mod).forward(mod, x[:, 3:], (cos[:, 3:], sin[:, 3:]), None, cache=caches[0])
            got, _ = fwd.run(mod, x[:, 3:], (cos[:, 3:], sin[:, 3:]), None, cache=caches[1])
    except (RuntimeError, ValueError, TypeError, AttributeError, IndexError) as e:
        log.debug("%s keeps its own forward: %s", type(mod).__name__, e)
        got = ref = None
    return got is not None and close(got, ref) and fwd.install()


MAX_LAYER_ROWS = 8  # the MoE kernel's rows per expert: B tokens of one step route each expert at most B times


def layer_plan(mod: nn.Module, slot: native.PlanSlot):
    """The decoder layer described for ``moeq_layer_pre/attn/moe`` (``native.Layer``, tensors kept alive), built once
    into ``slot`` and reused while the layer's weights stay the same tensors; None when a part is outside the native
    forms (or its norms, router and attention do not run natively)."""
    from moeq.kernels import plans as native_plans  # noqa: PLC0415

    attn, mlp = mod.self_attn, mod.mlp
    a, router_fwd = AttentionForward.on(attn), RouterForward.on(mlp.gate)
    n1, n2 = NormForward.on(mod.input_layernorm), NormForward.on(mod.post_attention_layernorm)
    if a is None or router_fwd is None or n1 is None or n2 is None:
        return None
    norm = a.qk_norm in ("head", "full")
    qn = NormForward.on(attn.q_norm) if norm else None
    if norm and (qn is None or NormForward.on(attn.k_norm) is None or NormForward.on(attn.k_norm).eps != qn.eps):
        return None
    projs = [getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    plans = [native_plans.linear_plan(p) if packed.holds(p, "weight") else None for p in projs]  # biases: bf16
    experts = (native_plans.experts_plan(mlp.experts, True) if getattr(mlp.experts, "kernel", None) == "native"
               else None)
    if None in plans or experts is None:
        return None
    key = tuple(map(id, plans)) + (id(experts),)  # the parts' plans: rebuilt only when one of them is
    if slot.value is not None and slot.value[0] == key:
        return slot.value[1]
    router = mlp.gate
    ln1, ln2 = mod.input_layernorm, mod.post_attention_layernorm
    biases = [None if p.bias is None else p.bias.data_ptr() for p in projs]
    keep = [ln1.weight, ln2.weight, router.weight, plans, experts, [p.bias for p in projs]]
    cfg = native.Layer(
        bq=biases[0], bk=biases[1], bv=biases[2], bo=biases[3],
        ln1=ln1.weight.data_ptr(), ln2=ln2.weight.data_ptr(), router=router.weight.data_ptr(),
        qn=attn.q_norm.weight.data_ptr() if norm else None, kn=attn.k_norm.weight.data_ptr() if norm else None,
        eps1=n1.eps, eps2=n2.eps, eps_qk=qn.eps if norm else 0.0,
        scale=float(attn.scaling), H=router.weight.shape[1], Hq=projs[0].out_features // attn.head_dim,
        Hkv=projs[1].out_features // attn.head_dim, D=attn.head_dim, E=router.weight.shape[0], topk=router.top_k,
        renorm=int(router_fwd.renorm), cast=int(router_fwd.cast), qk_full=int(a.qk_norm == "full"),
        q=plans[0].stack, k=plans[1].stack, v=plans[2].stack, o=plans[3].stack, w13=experts.w13, w2=experts.w2)
    slot.value = (key, (cfg, keep))
    return slot.value[1]


class LayerForward(Installed):
    """A MoE decoder layer's decode step (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE style) as three native calls —
    norms, projections, q/k norms, RoPE; then, after the cache update, attention, o projection, residual, norm, router
    logits; then, after the router's own top-k in torch (its tie order; and Qwen2-MoE's gated shared expert through
    its own modules), the experts and the residual — instead of a dozen module calls and their torch glue. Installed
    per layer by :func:`_try_layer` where it reproduced the layer's own step; anything else runs the class's own
    forward. ``arg_names``: the class forward's positional parameters after ``hidden_states`` (families order them
    differently); ``slot``: the layer's native description (:func:`layer_plan`)."""

    def __init__(self, mod: nn.Module, arg_names: tuple[str, ...]) -> None:
        super().__init__(mod)
        self.arg_names = arg_names
        self.slot = native.PlanSlot()

    def plan(self):
        return layer_plan(self.mod, self.slot)

    def run(self, mod: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
        named = dict(zip(self.arg_names, args), **kwargs)
        cache = named.pop("cache", None) or named.pop("past_key_values", None)
        attention_mask, position_embeddings = named.pop("attention_mask", None), named.pop("position_embeddings", None)
        named.pop("position_ids", None)
        named.pop("use_cache", None)
        b, t, h = hidden_states.shape if hidden_states.dim() == 3 else (0, 0, 0)
        attn = mod.self_attn
        cos, sin = position_embeddings if position_embeddings is not None else (None, None)
        if (t != 1 or not 0 < b <= MAX_LAYER_ROWS or cache is None or cos is None or mod.training
                or hidden_states.dtype != torch.bfloat16 or hidden_states.device.type != "cpu"
                or cos.dtype != torch.bfloat16 or cos.shape != (b, 1, attn.head_dim) or named.get("output_attentions")):
            return type(mod).forward(mod, hidden_states, *args, **kwargs)
        layers = getattr(cache, "layers", None)
        full = isinstance(layers, list) and attn.layer_idx < len(layers) and type(layers[attn.layer_idx]) is full_layer()
        if not full:  # a static, sliding-window or quantized cache: its update returns other shapes
            return type(mod).forward(mod, hidden_states, *args, **kwargs)
        s = cache.get_seq_length(attn.layer_idx) + 1
        add = attention.additive_mask(attention_mask, b, s)
        plan = self.plan() if add is not False else None
        if plan is None:
            return type(mod).forward(mod, hidden_states, *args, **kwargs)
        cfg = plan[0]
        x = hidden_states.contiguous()
        q = torch.empty(b, cfg.Hq, cfg.D, dtype=torch.bfloat16)
        k = torch.empty(b, 1, cfg.Hkv, cfg.D, dtype=torch.bfloat16)
        v = torch.empty(b, 1, cfg.Hkv, cfg.D, dtype=torch.bfloat16)
        L = native.lib()
        cs, sn = cos.contiguous(), sin.contiguous()
        L.moeq_layer_pre(ctypes.byref(cfg), x.data_ptr(), b, cs.data_ptr(), sn.data_ptr(), q.data_ptr(), k.data_ptr(),
                         v.data_ptr())
        # `named` holds what the attention module would pass on to the cache
        keys, values = cache.update(k.transpose(1, 2), v.transpose(1, 2), attn.layer_idx, kwargs=named)
        keys, values = keys.contiguous(), values.contiguous()
        if keys.shape != (b, cfg.Hkv, s, cfg.D) or values.shape != keys.shape:
            raise MoeqError(f"layer {attn.layer_idx}: the cache returned keys {tuple(keys.shape)} for a step at "
                            f"position {s - 1}; the native layer expected {(b, cfg.Hkv, s, cfg.D)}")
        r1, n2 = torch.empty(b, 1, h, dtype=torch.bfloat16), torch.empty(b, h, dtype=torch.bfloat16)
        logits = torch.empty(b, cfg.E, dtype=torch.bfloat16)
        if L.moeq_layer_attn(ctypes.byref(cfg), x.data_ptr(), b, q.data_ptr(), keys.data_ptr(), values.data_ptr(), s,
                             None if add is None else add.data_ptr(), r1.data_ptr(), n2.data_ptr(), logits.data_ptr()):
            raise MoeqError(f"layer {attn.layer_idx}: out of memory in the native decode step")
        mlp = mod.mlp
        weights, idx = RouterForward.on(mlp.gate).route(logits)  # the router's own top-k (torch's tie order)
        extra = None
        if hasattr(mlp, "shared_expert"):  # Qwen2-MoE: sigmoid(shared_expert_gate(h)) * shared_expert(h), its modules
            shared = mlp.shared_expert(n2)
            extra = (torch.sigmoid(mlp.shared_expert_gate(n2)) * shared).contiguous()
        out = torch.empty(b, 1, h, dtype=torch.bfloat16)
        if L.moeq_layer_moe(ctypes.byref(cfg), r1.data_ptr(), n2.data_ptr(), b, idx.data_ptr(), weights.data_ptr(),
                            None if extra is None else extra.data_ptr(), out.data_ptr()):
            raise MoeqError(f"layer {attn.layer_idx}: the native MoE step declined its routing (cannot happen for "
                            f"{b} <= {MAX_LAYER_ROWS} tokens)")
        return out


def full_layer() -> type:
    from transformers.cache_utils import DynamicLayer  # noqa: PLC0415

    return DynamicLayer


def _try_layer(mod: nn.Module, rotary: nn.Module | None) -> bool:
    """Install :class:`LayerForward` on a decoder layer whose parts already run natively (norms, attention, router, experts,
    quantized projections with bf16 biases or none) where it reproduces the layer's own decode step on a probe: three
    tokens of prefill, then one step at position 3, each against its own cache."""
    from transformers import DynamicCache  # noqa: PLC0415

    attn, mlp = getattr(mod, "self_attn", None), getattr(mod, "mlp", None)
    ln1, ln2 = getattr(mod, "input_layernorm", None), getattr(mod, "post_attention_layernorm", None)
    if (rotary is None or attn is None or mlp is None or ln1 is None or ln2 is None
            or AttentionForward.on(attn) is None or NormForward.on(ln1) is None or NormForward.on(ln2) is None
            or RouterForward.on(getattr(mlp, "gate", None)) is None or not hasattr(mlp, "experts")
            or set(dict(mlp.named_children())) not in ({"gate", "experts"},
                                                        {"gate", "experts", "shared_expert", "shared_expert_gate"})):
        return False
    router = mlp.gate.weight
    projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if router.shape[1] % 32 or any(p.bias.dtype != torch.bfloat16 for p in projs if getattr(p, "bias", None) is not None):
        return False
    if hasattr(mlp, "shared_expert_gate") and not (type(mlp.shared_expert_gate) is nn.Linear
                                                   and mlp.shared_expert_gate.out_features == 1):
        return False
    params = list(inspect.signature(type(mod).forward).parameters)[2:]  # after self, hidden_states
    fwd = LayerForward(mod, tuple(p for p in params if p not in ("args", "kwargs")))
    if fwd.plan() is None:
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, router.shape[1], generator=g).bfloat16()
    pos = torch.arange(4)[None].expand(2, 4)
    config = getattr(attn, "config", None)
    try:  # a probe: a layer this forward cannot run keeps its own
        with torch.no_grad():
            cos, sin = rotary(x, pos)
            caches = [DynamicCache(config=config) for _ in range(2)]

            def step(fwd, i, c):
                return fwd(mod, x[:, i], attention_mask=None, position_ids=pos[:, i], cache=c, use_cache=True,
                           position_embeddings=(cos[:, i], sin[:, i]))
            for c in caches:
                step(type(mod).forward, slice(0, 3), c)
            ref = step(type(mod).forward, slice(3, 4), caches[0])
            got = step(fwd.run, slice(3, 4), caches[1])
    except (RuntimeError, ValueError, TypeError, AttributeError, IndexError, MoeqError) as e:
        log.debug("%s keeps its own forward: %s", type(mod).__name__, e)
        got = ref = None
    ref = ref[0] if isinstance(ref, tuple) else ref
    return isinstance(ref, torch.Tensor) and close(got, ref) and fwd.install()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM: the ``layers`` list of its base model (transformers' layout)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else getattr(model, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def install(model: nn.Module) -> dict[str, int]:
    """Give the model's bf16 RMSNorms, softmax top-k routers, Llama-style attention modules and bf16 output head their
    native decode forwards, then whole MoE decoder layers, where each reproduces the module's own output; returns how
    many of each got one. A no-op without SIMD native kernels (AVX512-BF16, or AVX2 + FMA)."""
    done = {"rms_norm": 0, "router": 0, "attention": 0, "head": 0, "layer": 0}
    if not native.has_simd():
        return done
    done["head"] = int(try_head(model))
    rotary = next((m for n, m in model.named_modules() if n.endswith("rotary_emb")), None)
    for _, mod in model.named_modules():
        if "forward" in mod.__dict__:  # already installed (or replaced by someone else): leave it
            continue
        eps = _is_rms_norm(mod)
        if eps is not None:
            done["rms_norm"] += _try_norm(mod, eps)
        elif _try_router(mod):
            done["router"] += 1
        elif _try_attention(mod, model, rotary):
            done["attention"] += 1
    for mod in decoder_layers(model):  # whole decoder layers, once their parts run natively
        if "forward" not in mod.__dict__:
            done["layer"] += _try_layer(mod, rotary)
    log.debug("native decode forwards: %s", done)
    return done

