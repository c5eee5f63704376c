"""Triton kernels for GPUs: one grouped GEMM with the weight dequantized in registers inside the K loop, used for
the fused MoE forward (tokens sorted by expert once per layer, only experts with tokens get blocks) and, with one
"expert", for quantized linears.

Formats (``KernelWeight.qkind``): RTN 4-bit (low nibble first) and 8-bit codes, symmetric (implicit zero point
``2**(bits-1)``) or asymmetric (uint8 zero points), any group size; the 4-bit codebook grids (``iq4nl``, ``mxfp4``:
RTN packing, a 16-entry table, double-quantized scales resolved once at layout time); NF4/FP4 (high nibble first, 16-entry code table,
fp32 absmax per block, double quantization resolved once at layout time); LLM.int8 (int8 codes, per-row
``SCB/127``). The layout (:func:`kernel_layout`) is views of moeq's stored tensors (only double-quant absmax is
materialized), built once per module and device and cached on the module.

Two kernels share the in-register dequantization: a grouped GEMM over pairs sorted by expert (``tl.dot`` tiles;
prompts), and a per-pair GEMV for decode-sized batches (no sorting, no padding: each program reads one routed
expert's rows once, so a decode step is two launches). :data:`CONFIGS` holds the block sizes per kernel, decided
once (tuned on an H200 by ``benchmarks/gpu_check.py``).

Everything runs on CPU tensors under ``TRITON_INTERPRET=1`` (the test suite does that); note that the interpreter's
bf16 ``tl.dot`` is wrong, so tests use fp32/fp16 activations there.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from moeq.formats import Bnb4Weight, Int8Weight, PackedWeight, RTNWeight
from moeq.formats.int8 import INV127
from moeq.formats.rtn import CODEBOOKS
from moeq.kernels.registry import by_format

Q_RTN4, Q_RTN8, Q_BNB4, Q_INT8, Q_LUT4 = 0, 1, 2, 3, 4  # Q_LUT4: RTN packing, table values
ACT_NONE, ACT_SILU_GLU, ACT_GPTOSS = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class KernelWeight:
    """A ``[E, N, K]`` stack as the kernel reads it (views of the stored tensors)."""
    q: torch.Tensor  # uint8 [E, N, K/2] (4-bit) or [E, N, K] (8-bit)
    scale: torch.Tensor  # [E, N, G] (float)
    zero: torch.Tensor | None  # uint8 [E, N, G] (asymmetric RTN)
    lut: torch.Tensor | None  # fp32 [16] (NF4/FP4, codebook grids)
    qkind: int
    group: int
    n: int
    k: int

    @property
    def experts(self) -> int:
        return self.q.shape[0]


# how the Triton kernel reads packed weights of each format (one function per format)
_LAYOUTS, layout = by_format("Triton layout")


def kernel_layout(w: PackedWeight) -> KernelWeight | None:
    """The kernel's view of a 2-D ``[N, K]`` or 3-D ``[E, N, K]`` packed weight, or None when the kernel cannot
    read it (2/3-bit RTN, NF4/FP4 blocks that straddle rows); callers fall back to dequantize-per-expert."""
    shape = tuple(w.shape)
    fn = _LAYOUTS.get(w.format)
    if fn is None or len(shape) not in (2, 3):
        return None
    e, n, k = (1, *shape) if len(shape) == 2 else shape
    return fn(w, e, n, k)


@layout("rtn")
def _layout_rtn(w: RTNWeight, e: int, n: int, k: int) -> KernelWeight | None:
    if w.bits not in (4, 8) or k % 2:  # 2/3/5-bit: dequantize + matmul on GPU
        return None
    gs = k if w.group_size == -1 else w.group_size
    q = w.qdata.reshape(e, n, -1)
    zero = None if w.zero is None else w.zero.reshape(e, n, -1)
    if w.grid in CODEBOOKS:
        if w.bits != 4:
            return None
        lut = torch.tensor(CODEBOOKS[w.grid], dtype=torch.float32, device=q.device)
        scale = w.scale if w.scale.is_floating_point() else w.group_scales()  # int8 codes / E8M0 bytes resolved once
        return KernelWeight(q, scale.reshape(e, n, -1), None, lut, Q_LUT4, gs, n, k)
    return KernelWeight(q, w.scale.reshape(e, n, -1), zero, None, Q_RTN4 if w.bits == 4 else Q_RTN8, gs, n, k)


@layout("bnb4")
def _layout_bnb4(w: Bnb4Weight, e: int, n: int, k: int) -> KernelWeight | None:
    bs = w.blocksize
    per_slice = w.numel // w.slices
    if k % bs or per_slice % bs or per_slice % k:
        return None
    absmax = w.resolved_absmax().float().reshape(e, n, k // bs)
    return KernelWeight(w.packed.reshape(e, n, k // 2), absmax, None, w.code.float().contiguous(), Q_BNB4, bs, n, k)


@layout("int8")
def _layout_int8(w: Int8Weight, e: int, n: int, k: int) -> KernelWeight | None:
    if k % 2:  # the kernels read k in even/odd pairs
        return None
    scale = (w.scb.float() * INV127).reshape(e, n, 1)
    return KernelWeight(w.weight.reshape(e, n, k).view(torch.uint8), scale, None, None, Q_INT8, k, n, k)


@triton.jit
def _weight_tiles(q_ptr, s_ptr, z_ptr, lut_ptr, e, offs_n, k0, N, K, G,
                  QKIND: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``W[e, offs_n, k0:k0+BLOCK_K]ᵀ`` as two fp32 ``[BLOCK_K/2, BLOCK_N]`` tiles, the even and the odd k: a 4-bit
    byte holds one of each, so its tile loads contiguous bytes along k (coalesced) and splits nibbles in registers
    instead of loading each byte twice; callers multiply the even and odd activations. K and GROUP are even."""
    offs_j = tl.arange(0, BLOCK_K // 2)
    k_even = k0 + 2 * offs_j
    mask = (k_even[:, None] < K) & (offs_n[None, :] < N)
    if QKIND == 1 or QKIND == 3:  # 8-bit codes
        base = q_ptr + e * N * K + offs_n[None, :] * K + k_even[:, None]
        c0 = tl.load(base, mask=mask, other=0)
        c1 = tl.load(base + 1, mask=mask, other=0)
    else:
        half = K // 2
        byte = tl.load(q_ptr + e * N * half + offs_n[None, :] * half + (k0 // 2 + offs_j)[:, None], mask=mask,
                       other=0)
        if QKIND == 2:  # bitsandbytes: element 2j in the high nibble
            c0 = byte >> 4
            c1 = byte & 0xF
        else:  # RTN: element 2j in the low nibble
            c0 = byte & 0xF
            c1 = byte >> 4
    g = k_even[:, None] // GROUP
    s = tl.load(s_ptr + e * N * G + offs_n[None, :] * G + g, mask=mask, other=0.0).to(tl.float32)
    if QKIND == 2 or QKIND == 4:
        v0 = tl.load(lut_ptr + c0.to(tl.int32)) * s
        v1 = tl.load(lut_ptr + c1.to(tl.int32)) * s
    elif QKIND == 3:
        v0 = c0.to(tl.int8, bitcast=True).to(tl.float32) * s
        v1 = c1.to(tl.int8, bitcast=True).to(tl.float32) * s
    else:
        if HAS_ZERO:
            z = tl.load(z_ptr + e * N * G + offs_n[None, :] * G + g, mask=mask, other=0).to(tl.float32)
        elif QKIND == 0:
            z = 8.0
        else:
            z = 128.0
        v0 = (c0.to(tl.float32) - z) * s
        v1 = (c1.to(tl.float32) - z) * s
    return v0, v1


@triton.jit
def _gemv_partial(q_ptr, s_ptr, z_ptr, lut_ptr, a_ptr, e, offs_n, k0, N, K, G,
                  QKIND: tl.constexpr, GROUP: tl.constexpr, TILE_G: tl.constexpr, HAS_ZERO: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``sum_k W[e, offs_n, k] * a[k]`` over ``[k0, k0 + BLOCK_K)``, ``[BLOCK_N]``: the tile is held as
    ``[groups, pairs in a group, BLOCK_N]`` so codes times activations are summed per group first and each group's
    scale (and zero point) is loaded and applied once, not per weight. ``TILE_G``: the k-span sharing one scale
    inside the tile (the group size, or BLOCK_K when a group spans whole tiles)."""
    NG: tl.constexpr = BLOCK_K // TILE_G
    HP: tl.constexpr = TILE_G // 2
    k_even = k0 + tl.arange(0, NG)[:, None, None] * TILE_G + 2 * tl.arange(0, HP)[None, :, None]  # [NG, HP, 1]
    on = offs_n[None, None, :]
    kmask = k_even < K
    mask = kmask & (on < N)
    if QKIND == 1 or QKIND == 3:
        base = q_ptr + e * N * K + on * K + k_even
        c0 = tl.load(base, mask=mask, other=0)
        c1 = tl.load(base + 1, mask=mask, other=0)
    else:
        half = K // 2
        byte = tl.load(q_ptr + e * N * half + on * half + k_even // 2, mask=mask, other=0)
        if QKIND == 2:
            c0 = byte >> 4
            c1 = byte & 0xF
        else:
            c0 = byte & 0xF
            c1 = byte >> 4
    a0 = tl.load(a_ptr + k_even, mask=kmask, other=0.0).to(tl.float32)
    a1 = tl.load(a_ptr + k_even + 1, mask=kmask, other=0.0).to(tl.float32)
    if QKIND == 2 or QKIND == 4:
        d0 = tl.load(lut_ptr + c0.to(tl.int32))
        d1 = tl.load(lut_ptr + c1.to(tl.int32))
    elif QKIND == 3:
        d0 = c0.to(tl.int8, bitcast=True).to(tl.float32)
        d1 = c1.to(tl.int8, bitcast=True).to(tl.float32)
    elif HAS_ZERO:
        d0 = c0.to(tl.float32)
        d1 = c1.to(tl.float32)
    else:  # symmetric: the implicit zero point subtracted per weight (no cancellation)
        zc = 8.0 if QKIND == 0 else 128.0
        d0 = c0.to(tl.float32) - zc
        d1 = c1.to(tl.float32) - zc
    part = tl.sum(d0 * a0 + d1 * a1, axis=1)  # [NG, BLOCK_N]
    kg = k0 + tl.arange(0, NG) * TILE_G
    gmask = (kg[:, None] < K) & (offs_n[None, :] < N)
    gidx = e * N * G + offs_n[None, :] * G + (kg // GROUP)[:, None]
    sc = tl.load(s_ptr + gidx, mask=gmask, other=0.0).to(tl.float32)
    if HAS_ZERO:  # sum (c - z) a = sum c a - z sum a
        z = tl.load(z_ptr + gidx, mask=gmask, other=0).to(tl.float32)
        part = part - z * tl.sum(a0 + a1, axis=1)
    return tl.sum(part * sc, axis=0)


@triton.jit
def _activate(acc, acc_up, ACT: tl.constexpr):
    if ACT == 1:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    elif ACT == 2:  # gpt-oss: clamped swiglu, (up + 1) * gate * sigmoid(1.702 * gate)
        gate = tl.minimum(acc, 7.0)
        up = tl.minimum(tl.maximum(acc_up, -7.0), 7.0)
        acc = (up + 1.0) * (gate / (1.0 + tl.exp(-1.702 * gate)))
    return acc


@triton.jit
def _pair_gemv(a_ptr, out_ptr, q_ptr, s_ptr, z_ptr, lut_ptr, bias_ptr, expert_ptr, weight_ptr,
               N, K, G, stride_am, stride_om,
               TOP_K: tl.constexpr, A_BY_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr, ACT: tl.constexpr,
               HAS_BIAS: tl.constexpr, QKIND: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
               TILE_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Decode: ``out[pair, n] = act(A[row(pair)] @ W[expert(pair)]ᵀ + b) * w(pair)``, one pair per program row —
    no sorting or padding; a product-and-sum per tile instead of ``tl.dot`` (a single row would waste 15/16 of
    an MMA tile)."""
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ptr + p).to(tl.int64)
    if A_BY_PAIR:
        row = p.to(tl.int64)
    else:
        row = (p // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    N_W = N * 2 if ACT != 0 else N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if TILE_G > 0:  # scales per group (every power-of-two group size, per-row scales)
        for k0 in range(0, K, BLOCK_K):
            acc += _gemv_partial(q_ptr, s_ptr, z_ptr, lut_ptr, a_ptr + row * stride_am, e, offs_n, k0, N_W, K, G,
                                 QKIND, GROUP, TILE_G, HAS_ZERO, BLOCK_N, BLOCK_K)
            if ACT != 0:
                acc_up += _gemv_partial(q_ptr, s_ptr, z_ptr, lut_ptr, a_ptr + row * stride_am, e, offs_n + N, k0,
                                        N_W, K, G, QKIND, GROUP, TILE_G, HAS_ZERO, BLOCK_N, BLOCK_K)
    else:  # a group size that neither divides nor spans BLOCK_K (e.g. 48): a scale per weight
        for k0 in range(0, K, BLOCK_K):
            k_even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            a0 = tl.load(a_ptr + row * stride_am + k_even, mask=k_even < K, other=0.0).to(tl.float32)[:, None]
            a1 = tl.load(a_ptr + row * stride_am + k_even + 1, mask=k_even < K, other=0.0).to(tl.float32)[:, None]
            b0, b1 = _weight_tiles(q_ptr, s_ptr, z_ptr, lut_ptr, e, offs_n, k0, N_W, K, G, QKIND, GROUP, HAS_ZERO,
                                   BLOCK_N, BLOCK_K)
            acc += tl.sum(a0 * b0 + a1 * b1, axis=0)
            if ACT != 0:
                u0, u1 = _weight_tiles(q_ptr, s_ptr, z_ptr, lut_ptr, e, offs_n + N, k0, N_W, K, G, QKIND, GROUP,
                                       HAS_ZERO, BLOCK_N, BLOCK_K)
                acc_up += tl.sum(a0 * u0 + a1 * u1, axis=0)
    nmask = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * N_W + offs_n, mask=nmask, other=0.0).to(tl.float32)
        if ACT != 0:
            acc_up += tl.load(bias_ptr + e * N_W + N + offs_n, mask=nmask, other=0.0).to(tl.float32)
    acc = _activate(acc, acc_up, ACT)
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + p).to(tl.float32)
    tl.store(out_ptr + p * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _grouped_gemm(a_ptr, out_ptr, q_ptr, s_ptr, z_ptr, lut_ptr, bias_ptr, sorted_ptr, expert_ptr, weight_ptr,
                  n_pairs, N, K, G, stride_am, stride_om,
                  TOP_K: tl.constexpr, A_BY_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr, ACT: tl.constexpr,
                  HAS_BIAS: tl.constexpr, QKIND: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[pair, n] = act(A[row(pair)] @ W[expert]ᵀ + b) * w(pair)`` for blocks of pairs sharing one expert.

    With ``ACT`` set, N is the intermediate size I and the program computes gate rows ``n`` and up rows ``n + I``
    of ``w13 [E, 2I, K]`` together, writing ``act(gate) * up``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ptr + pid_m).to(tl.int64)  # int64: E*N*K overflows int32 on the largest MoEs
    if e < 0:  # a block past the last expert's padded rows
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < n_pairs
    if A_BY_PAIR:
        rows = pairs
    else:
        rows = pairs // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    N_W = N * 2 if ACT != 0 else N  # rows of the stored weight
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        amask = valid[:, None] & (k_even[None, :] < K)
        a0 = tl.load(a_ptr + rows[:, None] * stride_am + k_even[None, :], mask=amask, other=0.0)
        a1 = tl.load(a_ptr + rows[:, None] * stride_am + k_even[None, :] + 1, mask=amask, other=0.0)
        b0, b1 = _weight_tiles(q_ptr, s_ptr, z_ptr, lut_ptr, e, offs_n, k0, N_W, K, G, QKIND, GROUP, HAS_ZERO,
                               BLOCK_N, BLOCK_K)
        acc += tl.dot(a0, b0.to(a0.dtype))
        acc += tl.dot(a1, b1.to(a1.dtype))
        if ACT != 0:
            u0, u1 = _weight_tiles(q_ptr, s_ptr, z_ptr, lut_ptr, e, offs_n + N, k0, N_W, K, G, QKIND, GROUP,
                                   HAS_ZERO, BLOCK_N, BLOCK_K)
            acc_up += tl.dot(a0, u0.to(a0.dtype))
            acc_up += tl.dot(a1, u1.to(a1.dtype))
    nmask = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * N_W + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            acc_up += tl.load(bias_ptr + e * N_W + N + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    acc = _activate(acc, acc_up, ACT)
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & nmask[None, :])


# Block sizes per kernel, decided once (``benchmarks/gpu_check.py --tune`` on an H200, benchmarks/results/gpu.json;
# the interpreter ignores the launch options). "gemv" serves batches up to GEMV_MAX_PAIRS (token, expert) pairs,
# "gemm" the rest. "per_group": the GEMV's per-group sums (:func:`_gemv_partial`) — measured slower on the H200
# (51 vs 34 us per Qwen3-30B-A3B MoE layer at one token) than a scale per weight, so off.
CONFIGS = {
    "gemv": {"block_n": 16, "block_k": 512, "num_warps": 4, "num_stages": 2, "per_group": False},
    "gemm": {"block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3},
}
INTERPRETER = {"block_n": 64, "block_k": 64}  # CPU tensors (TRITON_INTERPRET=1): fewer, smaller programs, faster tests
GEMV_MAX_PAIRS = 128  # up to 16 tokens at top-8: the GEMV was faster at every size measured up to there (H200)
LINEAR_GEMV_MAX_ROWS = 4  # a dense linear's rows all read the same weight: few rows only


def block_m_for(pairs: int, experts: int) -> int:
    per_expert = pairs / max(experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def align_pairs(expert_of_pair: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert's run padded to a multiple of ``block_m`` (pad = ``n_pairs``), and the
    expert of every block (-1 past the end). No host sync: the block count is the static upper bound."""
    p = expert_of_pair.numel()
    dev = expert_of_pair.device
    flat = expert_of_pair.reshape(-1).long()
    counts = torch.zeros(experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pstart = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    pos = pstart[e_sorted] + torch.arange(p, device=dev) - start[e_sorted]
    max_blocks = (p + experts * (block_m - 1) + block_m - 1) // block_m
    sorted_ids = torch.full((max_blocks * block_m,), p, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=dev) * block_m
    ends = torch.cumsum(padded, 0)
    expert_ids = torch.searchsorted(ends, block_start, right=True)
    expert_ids = torch.where(expert_ids < experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids


def _for_device(a: torch.Tensor, cfg: dict) -> dict:
    return {**cfg, **INTERPRETER} if a.device.type == "cpu" else cfg


def _launch(a: torch.Tensor, cfg: dict) -> dict:
    if a.device.type == "cpu":
        return {}
    wide = a.element_size() == 4  # fp32 activations: twice the shared memory per pipelined stage
    return {"num_warps": cfg["num_warps"], "num_stages": min(cfg["num_stages"], 2) if wide else cfg["num_stages"]}


def _block_k(a: torch.Tensor, w: KernelWeight, cfg: dict) -> int:
    """K per iteration: ≥ 32 (each ``tl.dot`` takes half of it, and needs 16), ≤ 64 for fp32 activations."""
    bk = min(cfg["block_k"], 64) if a.element_size() == 4 and a.device.type != "cpu" else cfg["block_k"]
    return max(32, min(bk, triton.next_power_of_2(w.k)))


def _output(a: torch.Tensor, w: KernelWeight, n_pairs: int, act: int, out_dtype):
    """(contiguous activations, output width, the output): ``N' = I`` with a fused activation, else ``N``."""
    n = w.n // 2 if act != ACT_NONE else w.n
    return a.contiguous(), n, torch.empty(n_pairs, n, dtype=out_dtype or a.dtype, device=a.device)


def _weight_args(w: KernelWeight, bias: torch.Tensor | None) -> tuple:
    """The weight's pointers as the kernels take them; absent ones are the scale tensor (never read: the kernel's
    flags say which are present)."""
    dummy = w.scale
    return (w.q, w.scale, dummy if w.zero is None else w.zero, dummy if w.lut is None else w.lut,
            dummy if bias is None else bias)


def grouped_gemm(a: torch.Tensor, w: KernelWeight, sorted_ids: torch.Tensor, expert_ids: torch.Tensor, n_pairs: int,
                 block_m: int, top_k: int = 1, a_by_pair: bool = False, weights: torch.Tensor | None = None,
                 act: int = ACT_NONE, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """``[n_pairs, N']`` where ``N' = I`` with a fused activation (``w`` then holds gate and up rows), else ``N``."""
    cfg = _for_device(a, config or CONFIGS["gemm"])
    a, n, out = _output(a, w, n_pairs, act, out_dtype)
    if n_pairs == 0:
        return out
    grid = (expert_ids.numel(), triton.cdiv(n, cfg["block_n"]))
    has_bias = bias is not None
    q, scale, zero, lut, bias = _weight_args(w, bias)
    _grouped_gemm[grid](
        a, out, q, scale, zero, lut, bias, sorted_ids, expert_ids, weights if weights is not None else scale,
        n_pairs, n, w.k, w.scale.shape[-1], a.stride(0), out.stride(0),
        TOP_K=top_k, A_BY_PAIR=a_by_pair, MUL_WEIGHT=weights is not None, ACT=act, HAS_BIAS=has_bias,
        QKIND=w.qkind, GROUP=w.group, HAS_ZERO=w.zero is not None,
        BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_K=_block_k(a, w, cfg), **_launch(a, cfg))
    return out


def pair_gemv(a: torch.Tensor, w: KernelWeight, expert_of_pair: torch.Tensor, n_pairs: int, top_k: int = 1,
              a_by_pair: bool = False, weights: torch.Tensor | None = None, act: int = ACT_NONE,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
              config: dict | None = None) -> torch.Tensor:
    """:func:`grouped_gemm`'s result for decode-sized batches, pair by pair (``expert_of_pair``: int ``[n_pairs]``)."""
    cfg = _for_device(a, config or CONFIGS["gemv"])
    a, n, out = _output(a, w, n_pairs, act, out_dtype)
    if n_pairs == 0:
        return out
    block_k = _block_k(a, w, cfg)
    grid = (n_pairs, triton.cdiv(n, cfg["block_n"]))
    has_bias = bias is not None
    q, scale, zero, lut, bias = _weight_args(w, bias)
    _pair_gemv[grid](
        a, out, q, scale, zero, lut, bias, expert_of_pair, weights if weights is not None else scale,
        n, w.k, w.scale.shape[-1], a.stride(0), out.stride(0),
        TOP_K=top_k, A_BY_PAIR=a_by_pair, MUL_WEIGHT=weights is not None, ACT=act, HAS_BIAS=has_bias,
        QKIND=w.qkind, GROUP=w.group, HAS_ZERO=w.zero is not None,
        TILE_G=tile_group(w.group, w.k, block_k) if cfg.get("per_group", True) else 0,
        BLOCK_N=cfg["block_n"], BLOCK_K=block_k, **_launch(a, cfg))
    return out


def tile_group(group: int, k: int, block_k: int) -> int:
    """The k-span of a ``block_k`` tile that shares one scale (0: groups neither divide nor span the tile)."""
    if group <= block_k and block_k % group == 0 and group & (group - 1) == 0:
        return group
    if group % block_k == 0 or group >= k:
        return block_k
    return 0


def fused_moe(x: torch.Tensor, w13: KernelWeight, w2: KernelWeight, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor, act: int = ACT_SILU_GLU, b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None, weight_on_input: bool = False, act_fn=None,
              kernel: str | None = None, configs: dict | None = None) -> torch.Tensor:
    """Routed MoE ``[T, H]``: every (token, expert) pair through its expert only. ``act=ACT_NONE`` with
    ``act_fn(gate, up)`` runs any other activation between the two GEMMs in torch. ``kernel`` ("gemv"/"gemm")
    and ``configs`` override the choice by batch size and :data:`CONFIGS` (tests, tuning)."""
    t, top_k = top_k_index.shape
    n_pairs = t * top_k
    kernel = kernel or ("gemv" if n_pairs <= GEMV_MAX_PAIRS else "gemm")
    cfg = (configs or CONFIGS)[kernel]
    weights = top_k_weights.reshape(-1).contiguous()
    if kernel == "gemv":
        experts = top_k_index.reshape(-1)  # read as stored (int64): no conversion launch
        run = lambda a, w, **kw: pair_gemv(a, w, experts, n_pairs, config=cfg, **kw)  # noqa: E731
    else:
        block_m = block_m_for(n_pairs, w13.experts)
        sorted_ids, expert_ids = align_pairs(top_k_index, w13.experts, block_m)
        run = lambda a, w, **kw: grouped_gemm(a, w, sorted_ids, expert_ids, n_pairs, block_m, config=cfg, **kw)  # noqa: E731
    if weight_on_input:  # Llama 4: each expert's input scaled by its router score
        a = (x.repeat_interleave(top_k, 0) * weights[:, None].to(x.dtype)).contiguous()
        h = run(a, w13, a_by_pair=True, act=act, bias=b13)
    else:
        h = run(x, w13, top_k=top_k, act=act, bias=b13)
    if act == ACT_NONE:
        i = w13.n // 2
        h = act_fn(h[:, :i], h[:, i:]).contiguous()
    y = run(h, w2, a_by_pair=True, weights=None if weight_on_input else weights, bias=b2, out_dtype=torch.float32)
    return y.view(t, top_k, -1).sum(1).to(x.dtype)


def linear(x: torch.Tensor, w: KernelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W[N, K]ᵀ + bias`` with the weight dequantized in registers."""
    lead = x.shape[:-1]
    a = x.reshape(-1, x.shape[-1])
    m = a.shape[0]
    if m <= LINEAR_GEMV_MAX_ROWS:  # decode: each row reads the weight (from L2 after the first)
        y = pair_gemv(a, w, torch.zeros(m, dtype=torch.int32, device=x.device), m, a_by_pair=True, bias=bias)
        return y.reshape(*lead, w.n)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    blocks = triton.cdiv(m, block_m)
    sorted_ids = torch.full((blocks * block_m,), m, dtype=torch.int32, device=x.device)
    sorted_ids[:m] = torch.arange(m, dtype=torch.int32, device=x.device)
    expert_ids = torch.zeros(blocks, dtype=torch.int32, device=x.device)
    y = grouped_gemm(a, w, sorted_ids, expert_ids, m, block_m, bias=bias)
    return y.reshape(*lead, w.n)
