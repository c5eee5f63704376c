"""GPTQ and AWQ int4/int8 checkpoints (``quant_method: "gptq"`` / ``"awq"``), e.g. Qwen3-30B-A3B-GPTQ-Int4 and AWQ MoE
releases: each quantized linear ``X`` — attention projections and every expert's ``gate/up/down_proj`` — stored as

- GPTQ: ``X.qweight`` int32 ``[K*bits/32, N]`` (codes packed along K, first code in the low bits), ``X.qzeros``
  int32 ``[G, N*bits/32]`` (packed along N), ``X.scales`` fp16 ``[G, N]``, ``X.g_idx`` int32 ``[K]`` (the group of
  each input), optional ``X.bias``. ``checkpoint_format: "gptq"`` (v1, the default) stores each zero point minus one;
  ``"gptq_v2"`` stores it as is.
- AWQ (``version: "gemm"``): ``X.qweight`` int32 ``[K, N/8]`` packed along N in AWQ's interleaved order (nibble i
  of a word holds output ``8j + [0, 2, 4, 6, 1, 3, 5, 7][i]``), ``X.qzeros`` int32 ``[G, N/8]`` in the same order,
  ``X.scales`` fp16 ``[G, N]``.

with ``W[n, k] = scales[g(k), n] * (q[k, n] - zeros[g(k), n])``. Both map bit for bit onto moeq's RTN layout — codes
repacked ``[N, K/2]`` low nibble first, the fp16 scales widened to fp32 (exact), zero points as uint8 ``[N, G]``:
the ``vllm`` grid where every zero point is the midpoint ``2^(bits-1)`` (symmetric GPTQ), ``asym`` otherwise — and
run on moeq's native kernels without re-rounding.

Act-order GPTQ (``desc_act: true``) whose ``g_idx`` is not ``k // group_size`` assigns inputs to groups out of
order; moeq's kernels read contiguous groups, so such a checkpoint loads only with a method: each weight is
dequantized exactly (fp32) and quantized in flight like a bf16 source. Without one it is refused with that advice.
Measured on real trained weights (``benchmarks/bench_act_order.py``): re-quantized to ``q8_0`` it is near-lossless
(KL 0.013 against its own weights), to a 4-bit method it costs about what a fresh 4-bit rounding does (0.21 iq4nl).
With a method, any GPTQ/AWQ checkpoint is re-quantized that way.
"""
from __future__ import annotations

import torch

from moeq.config import QuantConfig
from moeq.errors import MoeqError
from moeq.formats import RTNWeight
from moeq.formats.packing import pack
from moeq.io.safetensors_io import Checkpoint
from moeq.readers.source import stream
from moeq.readers.state import LoadState, compute_dtype

PARTS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output 8j + AWQ_ORDER[i]
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # output 8j + c sits in nibble AWQ_REVERSE[c]


def claims(found) -> bool:
    return bool(found.qc) and found.qc.get("quant_method") in ("gptq", "awq")


def settings(qc: dict) -> tuple[str, int, int, bool]:
    """(kind, bits, group size or -1, GPTQ v1 zero points) from the quantization_config, validated."""
    kind = qc["quant_method"]
    bits, gs = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    if type(bits) is not int or bits not in ((4, 8) if kind == "gptq" else (4,)):
        raise MoeqError(f"{kind} bits={bits!r}: moeq reads {'4- and 8-bit GPTQ' if kind == 'gptq' else '4-bit AWQ'}")
    if type(gs) is not int or not (gs == -1 or (gs > 0 and gs % 16 == 0 and gs <= 4096)):
        raise MoeqError(f"{kind} group_size={gs!r}: expected -1 or a multiple of 16 up to 4096")
    if kind == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or qc.get("zero_point", True) is not True:
            raise MoeqError(f"AWQ version={version!r} zero_point={qc.get('zero_point')!r}: moeq reads the GEMM layout "
                            "with zero points (AutoAWQ's default)")
        return kind, bits, gs, False
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise MoeqError(f"GPTQ checkpoint_format={fmt!r}: moeq reads 'gptq' (v1) and 'gptq_v2'")
    return kind, bits, gs, fmt == "gptq"


def groups(ckpt: Checkpoint) -> tuple[dict[str, list[str]], dict[str, str]]:
    """``{"X.weight": [X's keys]}`` for every quantized module ``X``, and ``{member key: "X.weight"}``."""
    heads = {}
    for k in ckpt.tensors:
        if k.endswith(".qweight"):
            prefix = k[: -len("qweight")]
            heads[prefix + "weight"] = [prefix + p for p in PARTS if prefix + p in ckpt.tensors]
    return heads, {m: h for h, ms in heads.items() for m in ms}


def _words(ckpt: Checkpoint, key: str, shape: tuple[int, int]) -> torch.Tensor:
    info = ckpt.tensors.get(key)
    if info is None:
        raise MoeqError(f"{key}: missing")
    if info.dtype != torch.int32 or tuple(info.shape) != shape:
        raise MoeqError(f"{info.file}: {key}: expected int32 {list(shape)}, got {info.dtype} {list(info.shape)}")
    return ckpt.read(key)


def _along_n(words: torch.Tensor, bits: int, awq: bool) -> torch.Tensor:
    """uint8 codes ``[R, N]`` of int32 words ``[R, N*bits/32]`` packed along N (AWQ: in its interleaved order)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    codes = ((words[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8)  # [R, N/per, per]: nibble i
    if awq:
        codes = codes[..., list(AWQ_REVERSE)]
    return codes.reshape(words.shape[0], -1)


def dequantize_reference(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """``W[n, k] = scales[g(k), n] * (q[k, n] - zeros[g(k), n])`` in fp32 from codes ``q [K, N]``, zero points and
    scales ``[G, N]`` and ``g_idx [K]`` — the producers' definition, used for act-order weights and in tests."""
    g = g_idx.long()
    return (scales.float()[g] * (q.float() - zeros.float()[g])).t().contiguous()


def read_weight(ckpt: Checkpoint, qc: dict, head: str, dtype: torch.dtype, exact: bool):
    """Module ``X``'s weight as an RTN weight, bit for bit (or, with ``exact=False`` — a method will re-quantize it
    — its fp32 dequantization, which is also what act-order weights need)."""
    kind, bits, gs, v1 = settings(qc)
    prefix = head[: -len("weight")]
    info = ckpt.tensors[prefix + "qweight"]
    if info.dtype != torch.int32 or len(info.shape) != 2:
        raise MoeqError(f"{info.file}: {prefix}qweight: expected 2-D int32, got {info.dtype} {list(info.shape)}")
    sc = ckpt.tensors.get(prefix + "scales")
    if sc is None or len(sc.shape) != 2 or sc.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise MoeqError(f"{prefix}scales: expected a 2-D float tensor [groups, out features]"
                        + ("" if sc is None else f", got {sc.dtype} {list(sc.shape)}"))
    per = 32 // bits
    if kind == "awq":
        k, n = info.shape[0], info.shape[1] * per
    else:
        k, n = info.shape[0] * per, info.shape[1]
    g = 1 if gs == -1 else k // gs
    if (gs != -1 and k % gs) or tuple(sc.shape) != (g, n) or n % per:
        raise MoeqError(f"{prefix}scales: shape {list(sc.shape)}, expected {[g, n]} for a [{n}, {k}] weight at group "
                        f"size {gs}")
    words = ckpt.read(prefix + "qweight")
    if kind == "awq":
        q = _along_n(words, bits, awq=True)  # [K, N]
    else:
        q = None  # GPTQ codes are read as bytes below, without unpacking
    zeros = _along_n(_words(ckpt, prefix + "qzeros", (g, n // per)), bits, awq=kind == "awq")  # [G, N]
    if v1:
        zeros = ((zeros.to(torch.int32) + 1) & ((1 << bits) - 1)).to(torch.uint8)
    scales = ckpt.read(prefix + "scales")
    if not bool(torch.isfinite(scales).all()):
        raise MoeqError(f"{prefix}scales: non-finite values")
    natural = torch.arange(k, dtype=torch.int32) // (k if gs == -1 else gs)
    g_idx = natural
    if prefix + "g_idx" in ckpt.tensors:
        gi = ckpt.tensors[prefix + "g_idx"]
        if gi.dtype not in (torch.int32, torch.int64) or tuple(gi.shape) != (k,):
            raise MoeqError(f"{gi.file}: {prefix}g_idx: expected int32 [{k}], got {gi.dtype} {list(gi.shape)}")
        g_idx = ckpt.read(prefix + "g_idx").to(torch.int32)
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= g:
            raise MoeqError(f"{prefix}g_idx: group indices outside 0..{g - 1}")
    in_order = bool(torch.equal(g_idx, natural))
    if not exact or not in_order:
        if exact:
            raise MoeqError(f"{prefix}g_idx: act-order GPTQ (inputs assigned to groups out of order) does not map onto "
                            "moeq's contiguous groups; load it with a method to re-quantize it (each weight is "
                            "dequantized exactly first): --method q8_0 keeps it near-lossless (8.5 bits/weight), a "
                            "4-bit method such as --method iq4nl costs another 4-bit rounding")
        if q is None:
            q = _along_k(words, bits)
        return dequantize_reference(q, zeros, scales, g_idx)
    if kind == "awq":
        qdata = pack(q.t().contiguous(), bits)  # [N, K/2]
    else:
        qdata = words.t().contiguous().view(torch.uint8)  # [N, K*bits/8]: byte j holds codes 2j (low), 2j+1
    mid = 1 << (bits - 1)
    sym = bool((zeros == mid).all())
    w = RTNWeight(qdata=qdata, scale=scales.float().t().contiguous(), zero=None if sym else zeros.t().contiguous(),
                  bits=bits, group_size=gs, grid="vllm" if sym else "asym", shape=(n, k), dtype=dtype)
    return w.validate(head)


def _along_k(words: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[K, N]`` of GPTQ's int32 words ``[K*bits/32, N]`` packed along K."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    codes = ((words[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)).to(torch.uint8)  # [K/per, per, N]
    return codes.reshape(-1, words.shape[1])


def read(found, quant, dtype, progress: bool):
    """The :mod:`moeq.readers` entry: without a method every quantized weight loads as it is stored (RTN, exact);
    with one, each is dequantized exactly and quantized in flight. Other tensors stay as the checkpoint holds them
    (the modules the producer left unquantized: embeddings, head, routers, norms)."""
    settings(found.qc)
    dtype = compute_dtype(found.config, dtype)
    state = LoadState(found.path, found.ckpt, found.config, QuantConfig.of(quant or "none"), dtype,
                      quantize_linears=quant is not None, sink=found.sink, importance=found.importance)
    _, member = groups(found.ckpt)
    if quant is None:
        return stream(state, member, lambda head: read_weight(found.ckpt, found.qc, head, dtype, True), progress)
    return stream(state, member, lambda head: read_weight(found.ckpt, found.qc, head, dtype, False), progress,
                  dense=True)
