"""Data-free activation importance: what llama.cpp's importance matrix measures, without calibration text.

llama.cpp's ``llama-imatrix`` runs calibration text through the model and keeps, for every quantized weight, the mean
square of each input column (``E[x_j^2]``, per expert for expert weights); the quantizer then weights each column's
rounding error by it. Most of that signal is structural — a few residual channels carry large activations whatever
the text, RMSNorm gains scale whole columns, experts see different inputs — so moeq measures the same statistic on
**uniformly random token ids** (seeded): no text, nothing a user must supply. On the real-weights fixture the
random-token statistic gives iq4nl the accuracy llama.cpp's IQ4_NL reaches with an imatrix from 100k tokens of text
(docs/accuracy.md).

:func:`collect` runs any causal LM (transformers' modules or moeq's quantized ones) on ``tokens`` random ids in
sequences of ``seq`` and returns an :class:`Importance`: per linear module ``[K]``, per experts module ``[E, H]``
for ``w13`` (the tokens routed to each expert) and ``[E, I]`` for ``w2`` (each expert's activation ``act(gate) *
up``, from its own weights). :func:`moeq.load` with ``importance=`` runs it on a first pass (``q8_0``, streamed like
any load; ``q4_0`` when a ``q8_0`` copy would not fit in memory: :func:`first_pass`) and quantizes the second pass with
it.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch
from torch import nn
from tqdm.auto import tqdm

from moeq.errors import MoeqError

log = logging.getLogger(__name__)

DEFAULT_TOKENS = 8192
SEQ = 512
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


@torch.no_grad()
def collect(model: nn.Module, tokens: int = DEFAULT_TOKENS, seed: int = 0, seq: int = SEQ,
            progress: bool = True) -> Importance:
    """Mean squared input columns of every linear and experts module of ``model`` (moeq's: its experts as
    :class:`QuantExperts`) over ``tokens`` uniformly random token ids (seeded), in sequences of ``seq``. The output
    head and routers are measured too (harmless: unused where not quantized)."""
    from moeq.nn.experts import QuantExperts  # noqa: PLC0415
    from moeq.nn.linear import QuantLinear  # noqa: PLC0415

    if tokens < seq or tokens % seq:
        raise MoeqError(f"importance tokens must be a positive multiple of {seq}, got {tokens}")
    vocab = model.get_input_embeddings().weight.shape[0]
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
    log.info("importance: %d linears, %d experts modules over %d random tokens", len(lin), len(exp), tokens)
    return Importance(lin, exp, tokens, seed)
