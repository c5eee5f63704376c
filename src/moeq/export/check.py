"""Judging an export by what its consumer computes: load the written files the way the consumer does (moeq for
compressed-tensors and the transformers-4 bnb layout, transformers + bitsandbytes for the transformers-5 bnb layout,
the GGUF file's own weights read back for gguf) and measure the mean KL(moeq's model || export) over a short built-in public-domain text (or the caller's ids)."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from moeq.errors import MoeqError

log = logging.getLogger(__name__)
# Jane Austen, Pride and Prejudice (1813), chapter 1: public domain
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
        "the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" said his lady to him "
        "one day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that he had not. \"But "
        "it is,\" returned she; \"for Mrs. Long has just been here, and she told me all about it.\" Mr. Bennet made "
        "no answer. \"Do you not want to know who has taken it?\" cried his wife impatiently. \"You want to tell me, "
        "and I have no objection to hearing it.\" This was invitation enough.")
MAX_KL = 0.05  # mean nats; a lossless export measures 0 (or bf16 kernel noise, ~1e-4)


def sample_ids(model: nn.Module, source: str | Path | None, tokens: int = 160) -> torch.Tensor:
    """The built-in text as token ids (the source's tokenizer), else a fixed pseudo-random id sequence."""
    vocab = model.config.get_text_config().vocab_size
    if source is not None and (Path(source) / "tokenizer.json").exists():
        try:
            from transformers import AutoTokenizer  # noqa: PLC0415

            ids = AutoTokenizer.from_pretrained(source)(TEXT, return_tensors="pt").input_ids[0][:tokens]
            if ids.numel() > 8 and int(ids.max()) < vocab:
                return ids
        except Exception as e:  # noqa: BLE001 - a tokenizer problem only changes which ids are measured
            log.info("export check: tokenizer unusable (%s), using fixed ids", e)
    return torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))


def mean_kl(model: nn.Module, other: nn.Module, ids: torch.Tensor) -> float:
    """Mean KL(model || other) per position over one window of ``ids``."""
    with torch.no_grad():
        lp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
        lq = torch.log_softmax(other(ids[None]).logits[0].float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    if not torch.isfinite(kl).all():
        raise MoeqError("the exported model computes non-finite logits")
    return float(kl.mean())


def consumer_kl(model: nn.Module, written: Path, format: str, layout: str, ids: torch.Tensor) -> float | None:
    """KL of the export as its consumer loads it."""
    if format == "compressed-tensors" or (format == "bnb" and layout == "transformers4"):
        from moeq.loader import load  # noqa: PLC0415

        return mean_kl(model, load(written, progress=False), ids)
    if format == "bnb":
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        return mean_kl(model, AutoModelForCausalLM.from_pretrained(written).eval(), ids)
    if format == "gguf":  # the GGUF's own weights, read back exactly (llama.cpp itself is checked in the tests)
        from moeq.readers import gguf  # noqa: PLC0415

        return mean_kl(model, gguf.load(written), ids)
    return None
