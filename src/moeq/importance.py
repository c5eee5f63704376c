"""Data-free activation importance: what llama.cpp's importance matrix measures, without calibration text.

llama.cpp's ``llama-imatrix`` runs calibration text through the model and keeps, for every quantized weight, the mean
square of each input column (``E[x_j^2]``, per expert for expert weights); the quantizer then weights each column's
rounding error by it. Much of that signal is structural — a few residual channels carry large activations whatever
the text, RMSNorm gains scale whole columns, experts see different inputs — but not all of it: at 2 bits the inputs
matter. moeq measures the statistic with no text supplied, on one of two inputs (``inputs``):

- ``"self"`` (the default): text the model samples itself (temperature 1, no truncation), each sequence from a seeded
  uniformly random first token — in the model's own distribution, so its hidden states look like those of real text.
- ``"random"``: uniformly random token ids (seeded): one batched forward, no sampling.

On the real-weights fixture (docs/accuracy.md) the two are level at 4 bits (iq4nl +importance: both at the accuracy
llama.cpp's IQ4_NL reaches with an imatrix from 100k tokens of text), while for IQ2_S experts the sampled text
recovers most of what calibration text gives over random ids.

:func:`collect` runs any causal LM (transformers' modules or moeq's quantized ones) on ``tokens`` such ids in
sequences of ``seq`` and returns an :class:`Importance`: per linear module ``[K]``, per experts module ``[E, H]``
for ``w13`` (the tokens routed to each expert) and ``[E, I]`` for ``w2`` (each expert's activation ``act(gate) *
up``, from its own weights). :func:`moeq.load` with ``importance=`` runs it on a first pass (``q8_0``, streamed like
any load; ``q4_0`` when a ``q8_0`` copy would not fit in memory: :func:`first_pass`) and quantizes the second pass with
it.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os

import torch
from torch import nn
from tqdm.auto import tqdm

from moeq.errors import MoeqError

log = logging.getLogger(__name__)

DEFAULT_TOKENS = 8192
SEQ = 512
INPUTS = ("self", "random")
INPUT_TEXT = {"self": "text the model sampled itself", "random": "uniform random token ids"}
DEFAULT_INPUTS = "self"
GEN_BATCH = 16  # sequences sampled together (inputs="self")
BATCH = 4  # sequences per forward (each experts module dequantizes its gate/up stack once per forward)
# The model the statistics are measured on when loading. On the real-weights fixture (iq4nl +importance, KL vs bf16):
# measured on q8_0 0.121, on q4_0 0.129 (each half of the model q8_0 recovers half the gap), so q8_0 unless it does not
# fit; q4_0 (half the memory) then.
FIRST_PASS = "q8_0"
SMALL_PASS = "q4_0"
MEMORY_SHARE = 0.6  # of the memory available now that the first-pass model may take


def available_memory() -> int:
    """Bytes of memory available now (Linux ``MemAvailable``; else the free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def first_pass(weights: int, available: int | None = None) -> str:
    """The method of the first pass for a checkpoint of ``weights`` elements: :data:`FIRST_PASS` when its copy
    (8.5 bits a weight) takes at most :data:`MEMORY_SHARE` of the available memory, else :data:`SMALL_PASS`."""
    available = available_memory() if available is None else available
    if weights * 8.5 / 8 <= MEMORY_SHARE * available:
        return FIRST_PASS
    log.info("importance: a %s first pass (%.1f GB) would not fit in %.1f GB available; measuring on %s",
             FIRST_PASS, weights * 8.5 / 8 / 1e9, available / 1e9, SMALL_PASS)
    return SMALL_PASS


@dataclasses.dataclass
class Importance:
    """Mean square of each input column: ``linears[name]`` ``[K]``; ``experts[name]`` (``[E, H]``, ``[E, I]``)."""

    linears: dict[str, torch.Tensor]
    experts: dict[str, tuple[torch.Tensor, torch.Tensor]]
    tokens: int
    seed: int
    measured_on: str = FIRST_PASS  # the first pass's method (what the saved config records)
    inputs: str = DEFAULT_INPUTS  # what ran through the model (INPUTS)

    def linear(self, name: str) -> torch.Tensor | None:
        return self.linears.get(name)

    def expert(self, name: str, e: int, kind: str) -> torch.Tensor | None:
        """Expert ``e``'s columns for ``kind`` (``gate``/``up``: its input; ``down``: its activation); None for an
        expert no token reached (the quantizer's own weighting then)."""
        pair = self.experts.get(name)
        if pair is None:
            return None
        row = pair[1 if kind == "down" else 0][e]
        return row if bool(row.any()) else None


class _Stats:
    def __init__(self):
        self.linears: dict[str, torch.Tensor] = {}
        self.experts: dict[str, list[torch.Tensor]] = {}

    def linear_hook(self, name: str):
        def hook(mod, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            s = (x * x).sum(0)
            self.linears[name] = s if name not in self.linears else self.linears[name] + s
        return hook

    def experts_hook(self, name: str):
        def hook(mod, args, kwargs):
            x = (args[0] if args else kwargs["hidden_states"]).detach()
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            x = x.reshape(-1, x.shape[-1]).float()
            n_exp = mod.num_experts
            if name not in self.experts:
                self.experts[name] = [torch.zeros(n_exp, x.shape[1]), torch.zeros(n_exp, mod.intermediate_dim)]
            acc_in, acc_mid = self.experts[name]
            w13 = None
            for e in torch.unique(idx).tolist():
                if not 0 <= e < n_exp:
                    continue
                xe = x[(idx == e).any(-1)]
                acc_in[e] += (xe * xe).sum(0)
                if w13 is None:  # gate rows then up rows, every expert, once per call
                    w13 = mod.w13.dequantize(torch.bfloat16)
                h = xe @ w13[e].float().t()
                if mod.b13 is not None:
                    h = h + mod.b13[e].float()
                a = mod.activation(h[:, :mod.intermediate_dim], h[:, mod.intermediate_dim:])
                acc_mid[e] += (a * a).sum(0)
        return hook


def cached_forward(model: nn.Module, ids: torch.Tensor, cache):
    """``model(ids)`` over the KV cache ``cache`` (a transformers ``DynamicCache``, extended in place), under the
    keyword the installed transformers names it (``cache``; ``past_key_values`` before 5.2x)."""
    key = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    return model(ids, **{key: cache}, use_cache=True)


def check_inputs(inputs) -> str:
    if inputs not in INPUTS:
        raise MoeqError(f"importance inputs must be one of {', '.join(INPUTS)}, got {inputs!r}")
    return inputs


@torch.no_grad()
def sampled(model: nn.Module, rows: int, seq: int, seed: int, progress: bool = True) -> torch.Tensor:
    """``[rows, seq]`` token ids the model samples itself (temperature 1, no truncation), each row from a seeded
    uniformly random first token: text in the model's own distribution, with no text supplied."""
    from transformers import DynamicCache  # noqa: PLC0415

    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in tqdm(range(0, rows, GEN_BATCH), desc="importance: sampling", unit="batch", disable=not progress):
        b = min(GEN_BATCH, rows - n)
        ids = torch.empty(b, seq, dtype=torch.int64)
        ids[:, :1] = torch.randint(0, vocab, (b, 1), generator=g)
        cache = DynamicCache(config=model.config)
        for t in range(1, seq):
            p = torch.softmax(cached_forward(model, ids[:, t - 1:t], cache).logits[:, -1].float(), -1)
            p = torch.where(torch.isfinite(p), p, torch.zeros_like(p))
            ids[:, t:t + 1] = torch.multinomial(p + (p.sum(-1, keepdim=True) == 0), 1, generator=g)
        out.append(ids)
    return torch.cat(out)


@torch.no_grad()
def collect(model: nn.Module, tokens: int = DEFAULT_TOKENS, seed: int = 0, seq: int = SEQ,
            progress: bool = True, inputs: str = DEFAULT_INPUTS) -> Importance:
    """Mean squared input columns of every linear and experts module of ``model`` (moeq's: its experts as
    :class:`QuantExperts`) over ``tokens`` token ids in sequences of ``seq``: uniformly random ids (``inputs="random"``,
    seeded) or text the model samples itself (``"self"``: :func:`sampled`). The output head and routers are measured
    too (harmless: unused where not quantized)."""
    from moeq.nn.experts import QuantExperts  # noqa: PLC0415
    from moeq.nn.linear import QuantLinear  # noqa: PLC0415

    if tokens < seq or tokens % seq:
        raise MoeqError(f"importance tokens must be a positive multiple of {seq}, got {tokens}")
    check_inputs(inputs)
    vocab = model.get_input_embeddings().weight.shape[0]
    if inputs == "self":
        ids = sampled(model, tokens // seq, seq, seed, progress)
    else:
        ids = torch.randint(0, vocab, (tokens // seq, seq), generator=torch.Generator().manual_seed(seed))
    stats = _Stats()
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, QuantExperts):
            hooks.append(mod.register_forward_pre_hook(stats.experts_hook(name), with_kwargs=True))
        elif isinstance(mod, (nn.Linear, QuantLinear)):
            hooks.append(mod.register_forward_pre_hook(stats.linear_hook(name)))
    try:
        for rows in tqdm(ids.split(BATCH), desc="importance", unit="batch", disable=not progress):
            model(rows, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    missing = [n for n, m in model.named_modules() if isinstance(m, QuantExperts) and n not in stats.experts]
    if missing:  # a forward that bypassed the module would leave its experts unweighted without a word
        raise MoeqError(f"importance: experts modules {missing[:3]} were not called by the model's forward")
    lin = {k: v / tokens for k, v in stats.linears.items()}
    exp = {k: (a / tokens, b / tokens) for k, (a, b) in stats.experts.items()}
    log.info("importance: %d linears, %d experts modules over %d tokens (%s)", len(lin), len(exp), tokens,
             INPUT_TEXT[inputs])
    return Importance(lin, exp, tokens, seed, inputs=inputs)
