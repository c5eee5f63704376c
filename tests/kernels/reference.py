"""The plain references the kernel tests compare fused MoE paths and activation numerics against."""
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


def emulate_i16(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [m, K] @ w [N, K]^T with x as int16 per 32-chunk (power-of-two scale putting the chunk's largest in
    [2^14, 2^15), round to nearest even), in float64."""
    xb = x.double().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    _, e = torch.frexp(amax)
    inv = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), 15 - e), torch.zeros_like(amax))
    q = torch.round(xb * inv).clamp(-32767, 32767)
    xe = torch.where(inv > 0, q / torch.where(inv > 0, inv, torch.ones_like(inv)), torch.zeros_like(q))
    return xe.reshape(x.shape) @ w.double().T
