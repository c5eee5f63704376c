"""Error metrics shared by the demo, benchmarks and eval."""
from __future__ import annotations

import math

import torch


def sqnr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when exact)."""
    w, w_hat = w.float(), w_hat.float()
    noise = (w - w_hat).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(w.pow(2).sum().item() / noise)


def max_abs_err(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return (w.float() - w_hat.float()).abs().max().item()


def kl_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(ref || model) in nats and top-1 agreement, over the last dim."""
    lp_ref = torch.log_softmax(ref_logits.float(), -1)
    lp = torch.log_softmax(logits.float(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    return kl, (ref_logits.argmax(-1) == logits.argmax(-1)).float()
