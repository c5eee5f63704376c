"""A MoE model's whole decode step as one native call, and greedy ``generate`` on it.

With every decoder layer on :class:`moeq.nn.decode.LayerForward` (its parts native), the rest of a step — the embedding,
the layer loop with its cache updates and router top-k, the final norm and the head — is Python and torch glue that
costs about as much per token as the layers' weights take to stream (README, "where the time goes"), and more with
more layers. ``moeq_decode_step`` (``native/csrc/model.c``) runs all of it in C over static KV caches; the routing
falls back to the router's own top-k in torch for a layer whose choice depends on a tie order.

:func:`install` gives a model a ``generate`` that takes this path for greedy decoding of up to
:data:`MAX_BATCH` sequences (left padding, end-of-sequence ids, ``min_new_tokens``, streamers) and hands every
other request — sampling, beams, logits processors, output scores — to transformers' own ``generate``. The prompt
runs through the model's own forward. Installed only where a probe step reproduces the model's own decode step.
"""
from __future__ import annotations

import copy
import ctypes
import logging

import torch
from torch import nn

from moeq import native
from moeq.errors import MoeqError
from moeq.nn import bf12, decode, finite, packed

log = logging.getLogger(__name__)
MAX_BATCH = 16  # sequences per native step (model.c's MOEQ_STEP_ROWS); a bf16/bf12 head as many as its native call takes on
# this CPU (decode.head_max_rows, bf12.max_rows: 16 with AVX512-BF16 or AMX tiles, 8 with AMX without them, else 4
# or 1), a quantized head what its plan allows
_CONFIG_FREE = {"max_new_tokens", "max_length", "min_new_tokens", "min_length", "pad_token_id", "eos_token_id",
                "bos_token_id", "decoder_start_token_id", "do_sample", "num_beams", "use_cache", "temperature", "top_p",
                "top_k", "min_p", "typical_p", "transformers_version", "_from_model_config", "_commit_hash",
                "_original_object_hash", "cache_implementation"}
_KWARGS_FREE = {"streamer", "generation_config", "attention_mask", "input_ids", "inputs"}


def _parts(model: nn.Module):
    """(embedding, layers, final norm, rotary, head, config) of a causal LM whose layers all run natively, or None."""
    inner = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    parts = [getattr(inner, n, None) for n in ("embed_tokens", "layers", "norm", "rotary_emb")]
    if inner is None or head is None or any(p is None for p in parts):
        return None
    emb, layers, norm, rotary = parts
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if (type(emb) is not nn.Embedding or emb.weight.dtype != torch.bfloat16 or emb.weight.device.type != "cpu"
            or not emb.weight.is_contiguous() or decode.NormForward.on(norm) is None
            or getattr(rotary, "rope_type", None) != "default" or len(layers) == 0):
        return None
    for mod in layers:
        if decode.LayerForward.on(mod) is None or hasattr(mod.mlp, "shared_expert"):
            return None
    return emb, layers, norm, rotary, head, cfg


class Engine:
    """The native decode path of one model: its description for ``moeq_decode_step`` (rebuilt when a layer's plan
    changes, e.g. after :func:`moeq.set_activations`), RoPE tables, and per-call static caches."""

    def __init__(self, model: nn.Module, parts) -> None:
        self.model = model
        self.emb, self.layers, self.norm, self.rotary, self.head, self.cfg = parts
        self._tables = (0, None, None)

    def _head(self, batch: int):
        """(bf16 weight, None) or (None, (plan, scratch)) or (native.Bf12, None) for the head at ``batch`` rows; None
        when unsupported."""
        from moeq.kernels import plans  # noqa: PLC0415

        head = self.head
        if isinstance(head, bf12.Bf12Linear):
            return (head.describe(), None) if batch <= min(MAX_BATCH, bf12.max_rows()) else None
        if decode.HeadForward.on(head) is not None:
            ok = (head.bias is None and batch <= min(MAX_BATCH, max(decode.HEAD_MAX_ROWS, decode.head_max_rows()))
                  and head.in_features % 32 == 0)
            return (head.weight, None) if ok else None
        if packed.holds(head, "weight") and head.bias is None:
            plan = plans.linear_plan(head)
            if plan is None or batch > plan.max_rows:
                return None
            return None, (plan, plan.scratch(batch))
        return None

    def max_rows(self) -> int:
        """The most sequences one native step takes with this model's head (0: none)."""
        return next((b for b in range(MAX_BATCH, 0, -1) if self._head(b) is not None), 0)

    def _rope(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's cos/sin for positions 0 .. ``positions``-1 (``[P, D]`` bf16), as the module gives
        them for each position (elementwise in the position: one call for all equals one per step)."""
        if self._tables[0] < positions:
            p = max(positions, 2 * self._tables[0])
            x = torch.zeros(1, 1, self.cfg.hidden_size, dtype=torch.bfloat16)
            cos, sin = self.rotary(x, torch.arange(p)[None])
            self._tables = (p, cos[0].contiguous(), sin[0].contiguous())
        return self._tables[1], self._tables[2]

    def describe(self, batch: int, capacity: int, positions: int):
        """(native.Model, keep-alive, caches, step state) for ``batch`` sequences of up to ``capacity`` tokens, or
        None."""
        plans = [decode.LayerForward.on(mod).plan() for mod in self.layers]
        head = self._head(batch)
        if any(p is None for p in plans) or head is None:
            return None
        cfgs = (native.Layer * len(plans))(*[p[0] for p in plans])
        c0 = plans[0][0]
        caches = [torch.zeros(batch, p[0].Hkv, capacity, p[0].D, dtype=torch.bfloat16) for p in plans for _ in (0, 1)]
        kc = (ctypes.c_void_p * len(plans))(*[c.data_ptr() for c in caches[0::2]])
        vc = (ctypes.c_void_p * len(plans))(*[c.data_ptr() for c in caches[1::2]])
        cos, sin = self._rope(positions)
        weight, qhead = head
        m = native.Model(layers=cfgs, L=len(plans), H=c0.H, vocab=self.emb.weight.shape[0],
                         V=self.head.out_features, P=cos.shape[0], B=batch, Sc=capacity,
                         embed=self.emb.weight.data_ptr(), norm=self.norm.weight.data_ptr(), eps=decode.NormForward.on(self.norm).eps,
                         head=weight.data_ptr() if isinstance(weight, torch.Tensor) else None,
                         cos=cos.data_ptr(), sin=sin.data_ptr(), kc=kc, vc=vc)
        if isinstance(weight, native.Bf12):
            m.head12 = ctypes.pointer(weight)
        if qhead is not None:
            m.hq, m.head_scratch = qhead[0].stack, qhead[1].data_ptr()
        keep = (plans, cfgs, kc, vc, cos, sin, head)
        state = torch.empty(batch, 3 * m.H + max(c.E for c in cfgs), dtype=torch.bfloat16)  # moeq_decode_step's
        return m, keep, caches, state

    def step(self, m, tokens: torch.Tensor, pos: torch.Tensor, s: int, mask: torch.Tensor | None,
             state: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` (bf16) of one decode step; the cache slot ``s - 1`` is written."""
        b = tokens.shape[0]
        logits = torch.empty(b, m.V, dtype=torch.bfloat16)
        L = native.lib()
        args = (ctypes.byref(m), b, tokens.data_ptr(), pos.data_ptr(), s, None if mask is None else mask.data_ptr())
        at = L.moeq_decode_step(*args, 0, None, None, state.data_ptr(), logits.data_ptr())
        while at >= 0:  # a routing tie: the router's own top-k (torch's order), then the step goes on
            gate = self.layers[at].mlp.gate
            h, e = m.H, gate.weight.shape[0]
            weights, idx = decode.RouterForward.on(gate).route(state.view(-1)[3 * b * h:3 * b * h + b * e].view(b, e))
            at = L.moeq_decode_step(*args, at, idx.data_ptr(), weights.data_ptr(), state.data_ptr(),
                                    logits.data_ptr())
        if at != -1:
            raise MoeqError("the native decode step failed (a token or position out of range, or out of memory)")
        finite.check(logits, "the native decode step (a layer or the head)")
        return logits

    def prefill(self, ids: torch.Tensor, attention_mask: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:
        """The prompt through the model's own forward (positions from the mask, as ``generate`` computes them); its
        keys/values copied into the static caches. Returns the last position's logits ``[B, V]``; None when the
        cache the forward built is not one full-attention layer per decoder layer."""
        from transformers import DynamicCache  # noqa: PLC0415

        cache = DynamicCache(config=self.model.config)
        pos = (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)
        out = self.model(input_ids=ids, attention_mask=attention_mask, position_ids=pos, cache=cache,
                         use_cache=True, logits_to_keep=1)
        full = decode.full_layer()
        layers = getattr(cache, "layers", None)
        if not isinstance(layers, list) or len(layers) != len(self.layers) or any(type(x) is not full for x in layers):
            return None
        t = ids.shape[1]
        for i, layer in enumerate(layers):
            caches[2 * i][:, :, :t].copy_(layer.keys)
            caches[2 * i + 1][:, :, :t].copy_(layer.values)
        return out.logits[:, -1]

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, attention_mask: torch.Tensor, new: int, min_new: int, eos: list[int],
                 pad: int | None, streamer):
        """Greedy decoding as transformers' ``generate`` does it (same tokens); None when this model or request is
        outside the native step (the caller then runs transformers' own)."""
        b, t = ids.shape
        described = self.describe(b, t + new, t + new)
        if described is None:
            return None
        m, keep, caches, state = described
        window = getattr(self.cfg, "sliding_window", None) if getattr(self.cfg, "use_sliding_window", True) else None
        if window is not None and t + new > window:
            return None
        logits = self.prefill(ids, attention_mask, caches)
        if logits is None:
            return None
        if streamer is not None:
            streamer.put(ids.cpu())
        valid = attention_mask.long().sum(-1)
        mask = torch.zeros(b, t + new)
        mask[:, :t].masked_fill_(attention_mask == 0, float("-inf"))
        done = torch.zeros(b, dtype=torch.bool)
        ban = torch.tensor(eos, dtype=torch.int64)
        out = []
        L = native.lib()
        for i in range(new):
            logits = logits.contiguous()
            nb = len(eos) if i < min_new else 0
            nxt = torch.empty(b, dtype=torch.int64)
            L.moeq_argmax_bf16(logits.data_ptr(), b, logits.shape[1], ban.data_ptr(), nb, nxt.data_ptr())
            if pad is not None:
                nxt = torch.where(done, torch.tensor(pad), nxt)
            out.append(nxt)
            if streamer is not None:
                streamer.put(nxt.cpu())
            if eos:
                done |= torch.isin(nxt, ban)
                if bool(done.all()):
                    break
            if i + 1 == new:
                break
            logits = self.step(m, nxt, valid + i, t + i + 1, mask, state)
        if streamer is not None:
            streamer.end()
        return torch.cat([ids, torch.stack(out, 1)], 1)


def _request(model: nn.Module, args: tuple, kwargs: dict):
    """The greedy request ``(ids, attention_mask, new, min_new, eos, pad, streamer)`` a ``generate`` call makes, or
    None when it asks for anything else (which transformers' own ``generate`` serves)."""
    if len(args) > 1 or set(kwargs) - _KWARGS_FREE - _CONFIG_FREE:
        return None
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    gc = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    unused = gc.update(**{k: v for k, v in kwargs.items() if k in _CONFIG_FREE})
    if unused:
        return None
    base = type(gc)().to_dict()
    if any(v != base.get(k) and (v or base.get(k)) for k, v in gc.to_dict().items() if k not in _CONFIG_FREE):
        return None
    if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.int64 or ids.device.type != "cpu"
            or ids.shape[1] == 0 or gc.do_sample or (gc.num_beams or 1) != 1 or gc.use_cache is False):
        return None
    b, t = ids.shape
    am = kwargs.get("attention_mask")
    if am is None:
        am = torch.ones_like(ids)
    if (not isinstance(am, torch.Tensor) or am.shape != ids.shape or not bool(((am == 0) | (am == 1)).all())
            or not bool((am.sum(-1) > 0).all())):
        return None
    if bool((am.cummax(-1).values != am).any()):  # not left padding: a 0 after a 1
        return None
    new = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or 20) - t
    if new < 1:
        return None
    eos = gc.eos_token_id
    eos = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else None)
    min_new = max(gc.min_new_tokens or 0, (gc.min_length or 0) - t) if eos else 0
    vocab = model.get_input_embeddings().weight.shape[0]
    if not 0 < b <= MAX_BATCH or int(ids.min()) < 0 or int(ids.max()) >= vocab:
        return None
    return ids.contiguous(), am.to(torch.int64).contiguous(), int(new), int(min_new), eos, pad, kwargs.get("streamer")


class NativeGenerate(decode.Installed):
    """``generate`` installed per model, holding its :class:`Engine`: the native greedy path where :func:`_request`
    accepts the call and the engine the model, transformers' own otherwise."""

    name = "generate"

    def __init__(self, model: nn.Module, engine: Engine) -> None:
        super().__init__(model)
        self.engine = engine

    def run(self, model: nn.Module, *args, **kwargs):
        eng = self.engine if _parts(model) is not None else None  # a layer may have lost its native forward since
        req = _request(model, args, kwargs) if eng is not None else None
        out = eng.generate(*req) if req is not None else None
        return type(model).generate(model, *args, **kwargs) if out is None else out


def engine_of(model: nn.Module) -> Engine | None:
    """The native decode engine installed on ``model`` (:func:`install`), or None."""
    gen = NativeGenerate.on(model)
    return None if gen is None else gen.engine


def current(model: nn.Module) -> Engine | None:
    """An engine over ``model``'s modules as they are now (a server may have swapped its head since :func:`install`
    probed it), where :func:`install` gave the model one; else None."""
    if engine_of(model) is None:
        return None
    parts = _parts(model)
    return None if parts is None else Engine(model, parts)


def _probe(model: nn.Module, eng: Engine) -> bool:
    """Whether one native step reproduces the model's own decode step (3-token prompt, then one token), logits within
    bf16 rounding."""
    from transformers import DynamicCache  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    vocab = eng.emb.weight.shape[0]
    ids = torch.randint(0, min(vocab, 1000), (1, 4), generator=g)
    am = torch.ones(1, 3, dtype=torch.int64)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :3], cache=cache, use_cache=True, logits_to_keep=1)
        ref = model(input_ids=ids[:, 3:], cache=cache, use_cache=True).logits[:, -1]
        described = eng.describe(1, 4, 4)
        if described is None:
            return False
        m, keep, caches, state = described
        if eng.prefill(ids[:, :3], am, caches) is None:
            return False
        got = eng.step(m, ids[0, 3:].contiguous(), torch.tensor([3]), 4, None, state)
    return decode.close(got.float(), ref.float())


def install(model: nn.Module) -> bool:
    """Give ``model`` the native greedy ``generate`` (see the module) where its layers all run natively and a probe
    step matches its own; returns whether it did."""
    if not native.has_simd() or "generate" in model.__dict__ or not hasattr(model, "generate"):
        return False
    parts = _parts(model)
    if parts is None:
        return False
    from moeq.kernels import plans  # noqa: PLC0415

    eng = Engine(model, parts)
    head = parts[4]
    if packed.holds(head, "weight"):  # the head's decode copy by 16 rows (its forward and the step share the plan)
        plans.set_rows16(head, True)
    try:
        ok = _probe(model, eng)
    except (RuntimeError, ValueError, TypeError, AttributeError, IndexError, MoeqError) as e:
        log.debug("no native decode loop: %s", e)
        ok = False
    if not ok:
        plans.set_rows16(head, False)
        return False
    return NativeGenerate(model, eng).install()
