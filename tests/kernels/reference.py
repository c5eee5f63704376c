"""The plain reference the kernel tests compare fused MoE paths against."""
import torch


def reference_moe(d13, d2, x, idx, wts, act):
    """Token by token, expert by expert, from dequantized weights, in their dtype (fp32, or float64 for the
    differential matrix)."""
    i = d13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=d13.dtype)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            h = d13[e] @ x[t].to(d13.dtype)
            out[t] += wts[t, j].to(d13.dtype) * (d2[e] @ act(h[:i], h[i:]))
    return out
