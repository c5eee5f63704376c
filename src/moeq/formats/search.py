"""Calibration-free improvements over plain rounding, all producing the same storage as plain RTN / bnb4 (so the
same kernels and exporters serve them):

- ``clip search``: per group, try ``n`` shrunken ranges (``alpha * absmax``, or ``alpha * [min, max]``) and keep the
  one with the least squared reconstruction error (the grid search of llama.cpp's k-quants / AWQ-free "MSE clip");
- ``refine``: alternate least squares on the group's (scale, zero) given its codes, then re-round the codes
  (a data-free relative of HQQ's half-quadratic updates, restricted to the integer zero point the layout stores);
- ``hqq``: HQQ's half-quadratic splitting (Badri & Shaji, 2023; the hqq library's ``optimize_weights_proximal``)
  with an L_p (p < 1) outlier term, refitting scale and the stored integer zero point (see :func:`hqq`);
- NF4/FP4 ``absmax`` search: bitsandbytes decodes ``code * absmax``; storing a smaller absmax per block clips the
  outliers and spends the 16 codes on the bulk — bnb's format and decoder are unchanged.

All work on fp32 ``[R, G, gs]`` groups and never increase the error of the plain-rounding start point (squared
error for clip search/refine/absmax search, mean absolute error — HQQ's own criterion — for ``hqq``).
"""
from __future__ import annotations

import torch


def _round_codes(g: torch.Tensor, s: torch.Tensor, z: torch.Tensor, maxq: int) -> torch.Tensor:
    safe = torch.where(s == 0, torch.ones_like(s), s)
    return ((g / safe).round() + z).clamp(0, maxq)


def _err(g, q, s, z):
    return (g - (q - z) * s).pow(2).sum(-1, keepdim=True)


def rtn_search(g: torch.Tensor, bits: int, symmetric: bool, storage: torch.dtype, start: tuple,
               candidates: int = 20, refine: int = 0, min_alpha: float = 0.8):
    """Improve plain RTN of groups ``g [R, G, gs]`` (fp32). ``start`` = (codes, scale, zero) of plain RTN
    (zero a tensor even when symmetric). Returns the best (codes, scale, zero) found, scale in ``storage`` dtype."""
    maxq = (1 << bits) - 1
    half = float(1 << (bits - 1))
    q0, s0, z0 = start
    best_q, best_s, best_z = q0.float(), s0.float(), z0.float()
    best_e = _err(g, best_q, best_s, best_z)
    lo = g.amin(-1, keepdim=True).clamp(max=0)
    hi = g.amax(-1, keepdim=True).clamp(min=0)
    amax = torch.maximum(-lo, hi)
    for i in range(1, candidates + 1):
        a = 1.0 - (1.0 - min_alpha) * i / candidates
        if symmetric:
            s = (a * amax * 2.0 / maxq).to(storage).float()
            z = torch.full_like(s, half)
        else:
            s = (a * (hi - lo) / maxq).to(storage).float()
            z = (-a * lo / torch.where(s == 0, torch.ones_like(s), s)).round().clamp(0, maxq)
        q = _round_codes(g, s, z, maxq)
        e = _err(g, q, s, z)
        better = e < best_e
        best_q, best_s, best_z, best_e = (torch.where(better, q, best_q), torch.where(better, s, best_s),
                                          torch.where(better, z, best_z), torch.minimum(e, best_e))
    for _ in range(refine):
        q = best_q
        if symmetric:
            c = q - half
            den = c.pow(2).sum(-1, keepdim=True)
            s = torch.where(den > 0, (g * c).sum(-1, keepdim=True) / den.clamp(min=1e-30), best_s)
            s = s.to(storage).float()
            z = best_z
        else:
            qm, wm = q.mean(-1, keepdim=True), g.mean(-1, keepdim=True)
            var = (q - qm).pow(2).mean(-1, keepdim=True)
            s = torch.where(var > 0, ((q - qm) * (g - wm)).mean(-1, keepdim=True) / var.clamp(min=1e-30), best_s)
            s = s.clamp(min=0).to(storage).float()
            safe = torch.where(s == 0, torch.ones_like(s), s)
            z = (qm - wm / safe).round().clamp(0, maxq)
        q = _round_codes(g, s, z, maxq)
        e = _err(g, q, s, z)
        better = e < best_e
        best_q, best_s, best_z, best_e = (torch.where(better, q, best_q), torch.where(better, s, best_s),
                                          torch.where(better, z, best_z), torch.minimum(e, best_e))
    return best_q.to(torch.uint8), best_s.to(storage).squeeze(-1), best_z.squeeze(-1)


def _shrink_lp(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """HQQ's generalized soft-thresholding: the proximal operator of ``|x|^p / beta``, p < 1."""
    a = x.abs()
    return torch.sign(x) * (a - a.pow(p - 1) / beta).clamp(min=0)


def hqq(g: torch.Tensor, bits: int, s: torch.Tensor, z: torch.Tensor, storage: torch.dtype, iters: int = 20,
        lp_norm: float = 0.7, beta: float = 10.0, kappa: float = 1.01) -> tuple[torch.Tensor, ...]:
    """Half-quadratic splitting (HQQ, Badri & Shaji 2023) for asymmetric groups ``g [R, G, gs]`` (fp32) starting
    from scale ``s`` and integer zero ``z`` (``[R, G, 1]``).

    HQQ's own update moves only the zero point, as a real number: with the integer zero point this layout stores
    (vLLM's / compressed-tensors' asymmetric format) it rounds back to plain RTN (measured: identical error).
    So each step here takes HQQ's sparse outlier term ``W_e = shrink_lp(W - W_r)`` (an L_p, p < 1, fit that lets a
    few weights err) and refits *scale and integer zero* by least squares to the de-outliered target ``W - W_e``,
    then re-rounds the codes; beta grows by kappa (HQQ's defaults). Per group the iterate with the lowest mean
    |W - W_r| (HQQ's criterion) is kept, so it is never worse than the start. Returns (codes, scale, zero)."""
    maxq = (1 << bits) - 1
    q = _round_codes(g, s, z, maxq)

    def l1(q, s, z):
        return (g - (q - z) * s).abs().mean(-1, keepdim=True)

    best_q, best_s, best_z, best_e = q, s, z, l1(q, s, z)
    for _ in range(iters):
        target = g - _shrink_lp(g - (q - z) * s, beta, lp_norm)
        qm, tm = q.mean(-1, keepdim=True), target.mean(-1, keepdim=True)
        var = (q - qm).pow(2).mean(-1, keepdim=True)
        s = torch.where(var > 0, ((q - qm) * (target - tm)).mean(-1, keepdim=True) / var.clamp(min=1e-30), s)
        s = s.clamp(min=1e-12).to(storage).float()
        z = (qm - tm / s).round().clamp(0, maxq)
        q = _round_codes(g, s, z, maxq)
        beta *= kappa
        e = l1(q, s, z)
        better = e < best_e
        best_q, best_s, best_z = (torch.where(better, q, best_q), torch.where(better, s, best_s),
                                  torch.where(better, z, best_z))
        best_e = torch.minimum(e, best_e)
    return best_q, best_s, best_z


def bnb4_absmax_search(blocks: torch.Tensor, absmax: torch.Tensor, code_sorted: torch.Tensor, bounds: torch.Tensor,
                       candidates: int = 20, min_alpha: float = 0.6) -> torch.Tensor:
    """Per block of ``blocks [B, bs]`` (fp32), the stored absmax (<= the true one) minimizing the squared error of
    bitsandbytes' nearest-code decoding. Returns fp32 ``[B]``."""
    def err(am):
        scaled = (blocks * (1.0 / am.clamp(min=1e-38))[:, None]).clamp(-1, 1)  # bitsandbytes' x * (1/absmax)
        q = torch.bucketize(scaled, bounds)
        return (blocks - code_sorted[q] * am[:, None]).pow(2).sum(-1)

    best, best_e = absmax.clone(), err(absmax)
    for i in range(1, candidates + 1):
        am = absmax * (1.0 - (1.0 - min_alpha) * i / candidates)
        e = err(am)
        better = e < best_e
        best, best_e = torch.where(better, am, best), torch.minimum(e, best_e)
    return best


def codebook_search(rows: torch.Tensor, gs: int, values: torch.Tensor, ntry: int, weighting: int,
                    colw: torch.Tensor | None = None):
    """Plain-torch twin of ``moeq_cb4_search`` (the native library's importance-weighted scale search for codebook
    grids of 8, 16 or 32 sorted ``values``; see its comment): ``rows [R, K]`` fp32 -> (codes uint8 ``[R, K]``, bf16
    scales ``[R, K/gs]``, exact in fp16 too). Same candidates, criterion and rounding; sums may differ in the last
    bits (order)."""
    r, k = rows.shape
    g = rows.view(r, k // gs, gs)
    mid = (values[:-1] + values[1:]) / 2
    if weighting == 0:
        wt = torch.ones_like(g)
    elif weighting == 1:
        wt = g * g
    else:
        wt = (rows * rows).mean(-1).view(r, 1, 1) + g * g
    if colw is not None:
        wt = wt * colw.view(1, k // gs, gs)
    idx = g.abs().argmax(-1, keepdim=True)
    mx = g.gather(-1, idx)
    safe_mx = torch.where(mx == 0, torch.ones_like(mx), mx)

    def codes(id_):
        return torch.bucketize((g * id_).contiguous(), mid)

    best = torch.full_like(mx, -1.0)
    d = torch.zeros_like(mx)
    best_q = torch.zeros(g.shape, dtype=torch.int64, device=g.device)
    v0 = float(values[0])
    for s in (1.0, -1.0):
        for t in range(-ntry, ntry + 1):
            id_ = torch.tensor(s * v0 * (1.0 - t / 127.0), dtype=torch.float32) * (1.0 / safe_mx)
            q = codes(id_)
            v = values[q]
            sqx, sq2 = (wt * v * g).sum(-1, keepdim=True), (wt * v * v).sum(-1, keepdim=True)
            better = (sq2 > 0) & (sqx * sqx > best * sq2)
            dn = torch.where(better, sqx / torch.where(sq2 > 0, sq2, torch.ones_like(sq2)), d)
            best = torch.where(better, dn * sqx, best)
            d, best_q = dn, torch.where(better, q, best_q)
    none = best < 0  # every weight 0: plain max mapping
    d = torch.where(none, mx / v0, d)
    best_q = torch.where(none, codes(torch.where(d != 0, 1 / torch.where(d != 0, d, 1), 0)), best_q)
    ds = d.to(torch.bfloat16).to(torch.float16).float()
    q2 = codes(torch.where(ds != 0, 1 / torch.where(ds != 0, ds, torch.ones_like(ds)), torch.zeros_like(ds)))

    def err(q):
        return (wt * (g - ds * values[q]).pow(2)).sum(-1, keepdim=True)

    q = torch.where(err(q2) <= err(best_q), q2, best_q)
    zero = mx == 0
    zi = int(values.abs().argmin())
    q = torch.where(zero, torch.full_like(q, zi), q)
    ds = torch.where(zero, torch.zeros_like(ds), ds)
    return q.to(torch.uint8).view(r, k), ds.squeeze(-1).to(torch.bfloat16)
