"""Code tables of bitsandbytes' formats, built the same way bitsandbytes builds them (bit-identical fp32 values)."""
from __future__ import annotations

import torch

NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
FP4 = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)
QUANT_TYPES = ("nf4", "fp4")
# llama.cpp's IQ4_NL values (kvalues_iq4nl in ggml-common.h): a non-uniform 4-bit grid, value = block scale * entry
IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# moeq's 3-bit grid: every other IQ4_NL value from the bottom (measured on real weights against the other halving,
# Lloyd-Max points for a Gaussian and a weighted-Lloyd fit: lowest KL — benchmarks/README). Keeps IQ4_NL's asymmetry,
# which the scale search's two signs turn into a choice of the wider side per group.
NL3 = IQ4NL[0::2]
# moeq's 2-bit grid (experts at ~2.5 bits): a zero, two levels on one side and one on the other (the search's two
# signs pick the wider side per group). Chosen on the SmolLM2-MoE fixture among ten 4-level tables, as 2-bit experts
# in nl2-m (KL on 6144 held-out tokens): 1.68 nats against 5.5 for the Gaussian Lloyd-Max points (-127, -38, 38, 127)
# — without a zero every near-zero weight moves by a third of the group's peak — and 1.78-2.1 for the others with a
# zero; asymmetric int2 at group 16 (3.5 bits) 2.19.
NL2 = (-127, -42, 0, 60)
# OCP MXFP4's E2M1 values doubled (kvalues_mxfp4 in ggml-common.h): value = table[code] * 2^(e - 128) for a group's
# E8M0 exponent e (llama.cpp's GGML_E8M0_TO_FP32_HALF); code bit 3 is the sign, as in gpt-oss' *_blocks nibbles
MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def code4(quant_type: str) -> torch.Tensor:
    """The 16-entry fp32 code of ``quant_type`` (index = stored nibble)."""
    data = torch.tensor(NF4 if quant_type == "nf4" else FP4, dtype=torch.float32)
    return data / data.abs().max()


def dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map, used for double-quantized absmax (sorted, 256 fp32 values)."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1)
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist() + (-scale * means).tolist()
    if additional_items > 0:
        bounds = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)
        data += (scale * means).tolist() + (-scale * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)
