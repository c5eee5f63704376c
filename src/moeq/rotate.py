"""Data-free residual-stream rotation (QuaRot-style, no calibration data): the same architecture with rotated weights.

An RMSNorm divides its input by its norm, which an orthogonal ``Q`` leaves unchanged; so once each norm's weight
``g`` is folded into the linears that read its output (``W diag(g)``, the norm's weight set to ones), the residual
stream can be carried rotated — ``x Q`` instead of ``x`` — with every reader of the stream taking ``W diag(g) Q``,
every writer ``Qᵀ W`` (biases ``b Q``), the embedding ``E Q`` and the head ``W diag(g_final) Q``. The logits are
unchanged up to rounding; the weights are not: rotating spreads each outlier input channel over all of them, so
round-to-nearest quantizers, moeq's and llama.cpp's alike, lose less. The result is a plain checkpoint of the same
family (tied embeddings come out untied: the head folds the final norm), which every moeq method and every GGUF type
quantizes and llama.cpp runs unmodified.

``Q = diag(s) H / sqrt(n)``: random signs ``s`` (seeded) times a Hadamard matrix ``H`` of the hidden size ``n``
(:func:`hadamard`: Sylvester for powers of two, Paley I ⊗ Sylvester when ``n = 2^j (q + 1)`` with ``q`` a prime
≡ 3 mod 4 — 576 = 8 x 72, 768 = 64 x 12, 2880 = 2880, 7168 = 32 x 224; a seeded random orthogonal matrix when no
such ``q`` exists, said in the result). Families: the decoder-layer layout of Llama/Mistral/Qwen2/Qwen3 (dense) and
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE (pre-norm layers, ``x * weight`` RMSNorms, softmax routers); anything else is
refused before a weight changes. Function preservation is checked on the model itself (logits of a probe before and
after, within the rounding of its dtype).
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch import nn

from moeq.arch import ROTATABLE, get_arch
from moeq.errors import MoeqError

log = logging.getLogger(__name__)

ATTN_READERS = ("q_proj", "k_proj", "v_proj")
MLP_READERS = ("gate_proj", "up_proj")  # dense MLPs and shared experts


@dataclasses.dataclass(frozen=True)
class Rotation:
    """What :func:`rotate_` did: the matrix kind (``"hadamard 8 x paley 72"`` or ``"random orthogonal"``), the seed,
    how many tensors changed, whether it untied the head, and the probe's worst relative logit change."""

    kind: str
    seed: int
    hidden: int
    tensors: int
    untied: bool
    probe_rel_err: float


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _paley(q: int) -> torch.Tensor:
    """Paley's construction I: a Hadamard matrix of order ``q + 1`` for a prime ``q ≡ 3 (mod 4)``."""
    residues = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in residues else -1.0 for a in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, chi[idx]
    return s + torch.eye(q + 1, dtype=torch.float64)


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_plan(n: int) -> tuple[int, int] | None:
    """``(paley_order, sylvester_order)`` with ``paley_order * sylvester_order == n`` (``paley_order`` 1 for a power
    of two), or None when neither construction reaches ``n``."""
    if n > 0 and n & (n - 1) == 0:
        return 1, n
    j = 0
    while n % (1 << j) == 0:
        m = n >> j
        if m == 1 or (m % 4 == 0 and (m - 1) % 4 == 3 and _is_prime(m - 1)):
            return m, 1 << j
        j += 1
    return None


def hadamard(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``n`` (±1 entries, ``H Hᵀ = n I``, float64), or None (see :func:`hadamard_plan`)."""
    p = hadamard_plan(n)
    if p is None:
        return None
    m, s = p
    h = _sylvester(s) if m == 1 else torch.kron(_paley(m - 1), _sylvester(s))
    if not torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64)):  # the construction, checked once
        raise MoeqError(f"internal error: the Hadamard construction of order {n} is not orthogonal")
    return h


def rotation_matrix(n: int, seed: int = 0) -> tuple[torch.Tensor, str]:
    """The orthogonal ``Q`` [n, n] (float64) and its kind: signs (seeded) times a normalized Hadamard matrix, or a
    seeded random orthogonal matrix where no Hadamard construction here reaches ``n``."""
    g = torch.Generator().manual_seed(seed)
    h = hadamard(n)
    if h is None:
        q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))[None, :], "random orthogonal"
    signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1
    m, s = hadamard_plan(n)
    kind = f"hadamard {n}" if m == 1 else f"hadamard paley {m} x sylvester {s}"
    return signs[:, None] * h / math.sqrt(n), kind


def _norm_weight(norm: nn.Module | None, where: str) -> torch.Tensor:
    """The weight of an ``x / rms(x) * weight`` RMSNorm (checked on a probe in float64), else refused."""
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if (norm is None or not type(norm).__name__.endswith("RMSNorm") or not isinstance(w, torch.Tensor) or w.dim() != 1
            or not isinstance(eps, float) or getattr(norm, "bias", None) is not None):
        raise MoeqError(f"{where}: not an RMSNorm with a weight only ({type(norm).__name__}); rotation refused")
    x = torch.randn(3, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    with torch.no_grad():
        got = norm(x).double()
    xf = x.double()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    if not torch.allclose(got, want, rtol=2.0 ** -6, atol=1e-5 * float(want.abs().max())):
        raise MoeqError(f"{where}: {type(norm).__name__} does not compute x / rms(x) * weight; rotation refused")
    return w


class _Rotator:
    """Rewrites tensors in place (same storage: plans holding their pointers stay valid), in float32 per slice."""

    def __init__(self, q: torch.Tensor):
        self.q = q.float()
        self.count = 0

    def read(self, w: torch.Tensor, g: torch.Tensor | None, dim: int = -1) -> None:
        """A reader of the stream along ``dim`` (its input dim): ``W diag(g) Q``."""
        scale = None if g is None else g.float()
        for sl in _slices(w):
            x = sl.float().movedim(dim, -1)
            x = (x * scale if scale is not None else x) @ self.q
            sl.copy_(x.movedim(-1, dim))
        self.count += 1

    def write(self, w: torch.Tensor, dim: int = 0) -> None:
        """A writer into the stream along ``dim`` (its output dim): ``Qᵀ W`` (a bias: ``b Q``)."""
        for sl in _slices(w):
            x = sl.float().movedim(dim, -1)
            sl.copy_((x @ self.q).movedim(-1, dim))
        self.count += 1


def _slices(w: torch.Tensor):
    """3-D expert stacks one expert at a time (bounded float32 scratch); others whole."""
    return [w[i] for i in range(w.shape[0])] if w.dim() == 3 else [w]


def _families_layers(model: nn.Module):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise MoeqError("rotation needs a causal LM with model.layers (transformers' decoder layout)")
    return inner, layers


def _experts_dims(experts: nn.Module, hidden: int, transposed: bool, where: str) -> tuple[int, int]:
    """The reading dim of one expert's ``gate_up_proj`` slice and the writing dim of its ``down_proj`` slice
    (``[out, in]``, or ``[in, out]`` for the families that store them transposed)."""
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor) or gu.dim() != 3 or down.dim() != 3:
        raise MoeqError(f"{where}: experts without fused gate_up_proj/down_proj stacks; rotation refused")
    read, write = (0, 1) if transposed else (1, 0)
    if gu.shape[1 + read] != hidden or down.shape[1 + write] != hidden or hasattr(experts, "gate_up_proj_bias"):
        raise MoeqError(f"{where}: experts of shapes {tuple(gu.shape)} / {tuple(down.shape)} (or with biases) do not "
                        f"read and write the hidden size {hidden}; rotation refused")
    return read, write


def _plan(model: nn.Module) -> list:
    """Every tensor the rotation touches, as (action, tensor, norm weight or None, dim), all checked before any
    changes; raises MoeqError for anything outside the supported layout."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if cfg.model_type not in ROTATABLE:
        raise MoeqError(f"rotation supports {', '.join(ROTATABLE)}; not {cfg.model_type!r}")
    if any(hasattr(m, "qweight") or type(m).__name__.startswith("Quant") for m in model.modules()):
        raise MoeqError("rotate the unquantized model (then quantize it): this one holds quantized modules")
    inner, layers = _families_layers(model)
    hidden = cfg.hidden_size
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if type(emb) is not nn.Embedding or type(head) is not nn.Linear or head.bias is not None:
        raise MoeqError("rotation needs an nn.Embedding input and a bias-free nn.Linear head")
    acts = [("write", emb.weight, None, -1)]  # embedding rows: E Q
    for i, layer in enumerate(layers):
        where = f"model.layers.{i}"
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        g1 = _norm_weight(getattr(layer, "input_layernorm", None), f"{where}.input_layernorm")
        g2 = _norm_weight(getattr(layer, "post_attention_layernorm", None), f"{where}.post_attention_layernorm")
        if attn is None or mlp is None or set(n for n, _ in layer.named_children()) != {
                "self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}:
            raise MoeqError(f"{where}: not a pre-norm decoder layer (self_attn, mlp, two norms); rotation refused")
        for n in ATTN_READERS:
            lin = getattr(attn, n, None)
            if type(lin) is not nn.Linear or lin.in_features != hidden:
                raise MoeqError(f"{where}.self_attn.{n}: not a plain nn.Linear reading the hidden state")
            acts.append(("read", lin.weight, g1, -1))
        o = getattr(attn, "o_proj", None)
        if type(o) is not nn.Linear or o.out_features != hidden:
            raise MoeqError(f"{where}.self_attn.o_proj: not a plain nn.Linear writing the hidden state")
        acts.append(("write", o.weight, None, 0))
        if o.bias is not None:
            acts.append(("write", o.bias, None, -1))
        acts += _mlp_actions(mlp, g2, hidden, get_arch(cfg).transposed, f"{where}.mlp")
        acts += [("norm", g1, None, 0), ("norm", g2, None, 0)]
    gf = _norm_weight(getattr(inner, "norm", None), "model.norm")
    acts += [("head", head.weight, gf, -1), ("norm", gf, None, 0)]
    return acts


def _mlp_actions(mlp: nn.Module, g: torch.Tensor, hidden: int, transposed: bool, where: str) -> list:
    acts = []
    children = dict(mlp.named_children())
    if "experts" not in children:  # a dense SwiGLU MLP
        return _dense_mlp(mlp, g, hidden, where)
    router = children.get("gate")
    rw = getattr(router, "weight", None)
    if (not isinstance(rw, torch.Tensor) or rw.dim() != 2 or rw.shape[1] != hidden
            or any(n != "weight" for n, _ in router.named_parameters())):
        raise MoeqError(f"{where}.gate: not a bias-free router reading the hidden state; rotation refused")
    acts.append(("read", rw, g, -1))
    r, w = _experts_dims(children["experts"], hidden, transposed, f"{where}.experts")
    acts += [("read", children["experts"].gate_up_proj, g, r), ("write", children["experts"].down_proj, None, w)]
    extra = set(children) - {"gate", "experts"}
    if extra == {"shared_expert", "shared_expert_gate"}:  # Qwen2-MoE
        acts += _dense_mlp(children["shared_expert"], g, hidden, f"{where}.shared_expert")
        sg = children["shared_expert_gate"]
        if type(sg) is not nn.Linear or sg.bias is not None or sg.in_features != hidden:
            raise MoeqError(f"{where}.shared_expert_gate: not a bias-free nn.Linear; rotation refused")
        acts.append(("read", sg.weight, g, -1))
    elif extra:
        raise MoeqError(f"{where}: unknown MoE parts {sorted(extra)}; rotation refused")
    return acts


def _dense_mlp(mlp: nn.Module, g: torch.Tensor, hidden: int, where: str) -> list:
    parts = [getattr(mlp, n, None) for n in (*MLP_READERS, "down_proj")]
    if any(type(p) is not nn.Linear or p.bias is not None for p in parts) or parts[2].out_features != hidden:
        raise MoeqError(f"{where}: not a bias-free gate/up/down MLP; rotation refused")
    return [("read", parts[0].weight, g, -1), ("read", parts[1].weight, g, -1), ("write", parts[2].weight, None, 0)]


def _probe_logits(model: nn.Module) -> torch.Tensor:
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.double()


def rotate_(model: nn.Module, seed: int = 0, fold_only: bool = False) -> Rotation:
    """Rotate ``model``'s residual stream in place (see the module): an unquantized transformers model of a supported
    family. ``fold_only``: ``Q = I`` — only the norms' weights folded into the linears that read them (the weights a
    quantizer then sees carry each input channel's norm scale, as its output error does). Every tensor is checked
    before the first changes; the logits of a probe are compared before and after (within its dtype's rounding)
    and a mismatch raises :class:`MoeqError`."""
    acts = _plan(model)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = cfg.hidden_size
    q, kind = (torch.eye(n, dtype=torch.float64), "none (norms folded)") if fold_only else rotation_matrix(n, seed)
    before = _probe_logits(model)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    untied = head.weight is emb.weight or head.weight.data_ptr() == emb.weight.data_ptr()
    if untied:  # the head folds the final norm: it cannot stay the embedding
        head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
        acts = [a if a[0] != "head" else ("head", head.weight, a[2], a[3]) for a in acts]
        model.config.tie_word_embeddings = False
        if cfg is not model.config:
            cfg.tie_word_embeddings = False
    rot = _Rotator(q)
    with torch.no_grad():
        for action, t, g, dim in acts:
            if action == "read" or action == "head":
                rot.read(t, g, dim)
            elif action == "write":
                rot.write(t, dim)
            else:
                t.fill_(1.0)
    after = _probe_logits(model)
    err = float((after - before).abs().max() / before.abs().max().clamp_min(1e-30))
    tol = 0.25 if next(model.parameters()).dtype in (torch.bfloat16, torch.float16) else 1e-3
    if not math.isfinite(err) or err > tol:
        raise MoeqError(f"rotation did not preserve the model's function (largest logit change {err:.3g} of the "
                        "largest logit): the model's layout is not the one this rotation assumes")
    for c in {id(model.config): model.config, id(cfg): cfg}.values():  # a plain checkpoint now, for every tool
        if getattr(c, "quantization_config", None) is not None:
            del c.quantization_config
    log.info("rotated the residual stream (%s, seed %d): %d tensors, probe logits within %.2g", kind, seed,
             rot.count, err)
    return Rotation(kind=kind, seed=seed, hidden=cfg.hidden_size, tensors=rot.count, untied=untied,
                    probe_rel_err=err)
