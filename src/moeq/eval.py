"""``moeq.eval``: perplexity of a model and a reference, and how far the model's next-token distribution drifts from
the reference's (per-token KL(ref || model), mean and p99; top-1 agreement), over sliding windows of real text.

Windows of ``ctx`` tokens advance by ``ctx // 2``; the first window scores all its positions, later ones only their
second half, so every token is scored once with at least ``ctx // 2`` tokens of context (the usual strided PPL)."""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from tqdm.auto import tqdm
from moeq.errors import MoeqError
from moeq.generation import context_length
from moeq.importance import cached_forward

DECODE_CHUNK = 4  # tokens per decode-shaped forward: every decode kernel takes this many rows (the one-call linear's
# limit for large weights)


@dataclasses.dataclass
class EvalResult:
    ppl: float
    ref_ppl: float
    mean_kl: float
    p99_kl: float
    top1: float
    tokens: int
    windows: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def windows(n: int, ctx: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position within the window) covering ``n`` tokens."""
    if type(ctx) is not int or ctx < 2:
        raise MoeqError(f"ctx must be an integer >= 2 (windows advance by ctx // 2), got {ctx!r}")
    if n < ctx + 1:
        raise MoeqError(f"text too short: {n} tokens, need at least ctx + 1 = {ctx + 1} for one window "
                         f"(give more text or a smaller --ctx)")
    stride = ctx // 2
    out = [(0, ctx + 1, 0)]
    start = stride
    while start + ctx + 1 <= n:
        out.append((start, start + ctx + 1, ctx - stride))
        start += stride
    return out


def check_compatible(model: nn.Module, ref: nn.Module, tokenizer=None, ref_tokenizer=None) -> None:
    vm, vr = model.config.get_text_config().vocab_size, ref.config.get_text_config().vocab_size
    if vm != vr:
        raise MoeqError(f"vocabulary size mismatch: model {vm} vs reference {vr}; KL needs the same vocabulary")
    if tokenizer is None or ref_tokenizer is None:
        return
    mine, theirs = tokenizer.get_vocab(), ref_tokenizer.get_vocab()
    # the same token -> id everywhere they overlap, and nothing extra inside the reference's id range (a GGUF
    # tokenizer adds padding tokens past the real vocabulary; those are never produced from text)
    clash = [t for t, i in theirs.items() if mine.get(t, i) != i]
    missing = [t for t in theirs if t not in mine]
    extra = [t for t, i in mine.items() if t not in theirs and i < len(theirs)]
    if clash or missing or extra:
        raise MoeqError("tokenizer mismatch between MODEL and REF: their vocabularies differ, so token ids mean "
                        f"different things (e.g. {(clash + missing + extra)[:3]}); evaluate models that share a "
                        "tokenizer")


def logits(model: nn.Module, inp: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """``model(inp).logits``; with ``chunk``, decode-shaped: ``chunk`` tokens per forward over a KV cache, so every
    weight sees at most ``chunk`` rows — the decode kernels' domain (what ``activations="int8"`` changes)."""
    if chunk is None:
        return model(inp).logits
    from transformers import DynamicCache  # noqa: PLC0415

    cache = DynamicCache(config=model.config)
    return torch.cat([cached_forward(model, inp[:, i:i + chunk], cache).logits
                      for i in range(0, inp.shape[1], chunk)], 1)


@torch.no_grad()
def evaluate(model: nn.Module, ref: nn.Module, ids: torch.Tensor, ctx: int = 512, max_tokens: int | None = None,
             progress: bool = True, chunk: int | None = None) -> EvalResult:
    """Evaluate on token ids ``[n]`` (already tokenized, e.g. by :func:`tokenize`); ``chunk``: the model (not the
    reference) runs decode-shaped (:func:`logits`)."""
    ids = ids.reshape(-1)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    check_compatible(model, ref)
    wins = windows(ids.numel(), ctx)
    nll = nll_ref = 0.0
    kls, agree = [], 0
    count = 0
    for start, end, first in tqdm(wins, desc="eval", unit="window", disable=not progress):
        x = ids[start:end].unsqueeze(0)
        inp, tgt = x[:, :-1], x[0, 1:]
        lp = torch.log_softmax(logits(model, inp, chunk)[0, first:].float(), -1)
        lr = torch.log_softmax(ref(inp).logits[0, first:].float(), -1)
        t = tgt[first:]
        nll -= lp.gather(-1, t[:, None]).sum().item()
        nll_ref -= lr.gather(-1, t[:, None]).sum().item()
        kl = (lr.exp() * (lr - lp)).sum(-1)
        kls.append(kl)
        agree += (lp.argmax(-1) == lr.argmax(-1)).sum().item()
        count += t.numel()
    kl = torch.cat(kls)
    if not torch.isfinite(kl).all():
        raise MoeqError("non-finite KL: the model produced NaN/Inf logits")
    return EvalResult(ppl=math.exp(nll / count), ref_ppl=math.exp(nll_ref / count), mean_kl=kl.mean().item(),
                      p99_kl=torch.quantile(kl, 0.99).item() if kl.numel() < 2**24 else kl.sort().values[
                          int(0.99 * (kl.numel() - 1))].item(),
                      top1=agree / count, tokens=count, windows=len(wins))


def tokenize(tokenizer, texts: list[str]) -> torch.Tensor:
    """Concatenate documents (separated by the EOS token when the tokenizer has one) into one id stream."""
    parts = []
    for t in texts:
        parts.append(torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"], dtype=torch.long))
        if tokenizer.eos_token_id is not None:
            parts.append(torch.tensor([tokenizer.eos_token_id]))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@torch.no_grad()
def evaluate_many(models: dict[str, nn.Module], ref: nn.Module, ids: torch.Tensor, ctx: int = 512,
                  max_tokens: int | None = None, progress: bool = True,
                  chunks: dict[str, int] | None = None) -> dict[str, EvalResult]:
    """:func:`evaluate` for several models against one reference, running the reference once per window; ``chunks``:
    the models run decode-shaped, by name (:func:`logits`)."""
    chunks = chunks or {}
    if any(type(c) is not int or c < 1 for c in chunks.values()):
        raise MoeqError(f"decode chunks must be integers >= 1, got {chunks}")
    ids = ids.reshape(-1)[:max_tokens] if max_tokens else ids.reshape(-1)
    for m in models.values():
        check_compatible(m, ref)
    limit = context_length(ref)
    if limit is not None and ctx > limit:
        raise MoeqError(f"--ctx {ctx} is longer than the model's context of {limit} tokens "
                        f"(max_position_embeddings): give --ctx {limit} or less")
    wins = windows(ids.numel(), ctx)
    acc = {k: {"nll": 0.0, "kl": [], "agree": 0} for k in models}
    nll_ref, count = 0.0, 0
    for start, end, first in tqdm(wins, desc="eval", unit="window", disable=not progress):
        x = ids[start:end].unsqueeze(0)
        inp, t = x[:, :-1], x[0, 1:][first:]
        lr = torch.log_softmax(ref(inp).logits[0, first:].float(), -1)
        nll_ref -= lr.gather(-1, t[:, None]).sum().item()
        pr, top_r = lr.exp(), lr.argmax(-1)
        for k, m in models.items():
            lp = torch.log_softmax(logits(m, inp, chunks.get(k))[0, first:].float(), -1)
            a = acc[k]
            a["nll"] -= lp.gather(-1, t[:, None]).sum().item()
            a["kl"].append((pr * (lr - lp)).sum(-1))
            a["agree"] += (lp.argmax(-1) == top_r).sum().item()
        count += t.numel()
    out = {}
    for k, a in acc.items():
        kl = torch.cat(a["kl"])
        out[k] = EvalResult(ppl=math.exp(a["nll"] / count), ref_ppl=math.exp(nll_ref / count),
                            mean_kl=kl.mean().item(), p99_kl=kl.sort().values[int(0.99 * (kl.numel() - 1))].item(),
                            top1=a["agree"] / count, tokens=count, windows=len(wins))
    return out
