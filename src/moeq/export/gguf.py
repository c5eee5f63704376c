"""Export to GGUF for llama.cpp: expert stacks as 3-D ``blk.N.ffn_{gate,up,down}_exps``, llama.cpp's hyperparameter
and tokenizer metadata, tensors as ``Q4_0``/``Q8_0`` (or kept ``BF16``/``F16``/``F32``), written with the ``gguf``
package tensor by tensor (the model is never copied whole).

Lossless where the formats agree: llama.cpp's ``Q4_0``/``Q8_0`` blocks are symmetric RTN over 32 inputs with an fp16
scale, ``value = d * (q - 8)`` / ``value = d * q`` — exactly a moeq symmetric 4/8-bit RTN weight with group 32 (the
``q4_0``/``q8_0`` methods, or any ``vllm``/``signed`` grid), as long as its scales are fp16-representable (bf16 scales
of normal weights are); ``iq4nl`` is ``IQ4_NL`` the same way, and ``iq4nl-dq`` (int8 codes of a row scale) keeps its
codes with each group's scale rounded to fp16 (relative 2^-11). Everything else quantized (other groups, asymmetric or 2/3-bit RTN, NF4/FP4, LLM.int8) is
re-quantized from moeq's dequantized values with llama.cpp's own rounding (``gguf.quants``) — to ``Q4_0`` when it
had <= 4 bits, else ``Q8_0`` — and the summary lists every such tensor.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

from moeq.arch import ARCHS, GGUF_FAMILIES, Arch, GgufFamily
from moeq.export.common import expert_pieces, quantized_modules
from moeq.formats import Iq2sWeight, PackedWeight, RTNWeight
from moeq.formats.grids import GRIDS
from moeq.formats.rtn import e8m0_bytes
from moeq.nn import QuantExperts, QuantLinear
from moeq.errors import MoeqError
from moeq.version import __version__

log = logging.getLogger(__name__)
SUPPORTS = ("mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3 (Kimi K2), glm4_moe and gpt_oss models (any moeq format: symmetric 4/5/8-bit RTN with group 32 "
            "is written losslessly as Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4, iq2s as IQ2_S, everything else is re-quantized)")
FILE = "model.gguf"
MOEQ_KEY = "moeq.version"
HF_CONFIG_KEY = "moeq.hf_config"


def is_moeq_gguf(path: Path) -> bool:
    """A GGUF file that moeq wrote (its ``moeq.version`` key): what ``--overwrite`` may replace."""
    try:
        return MOEQ_KEY in gguf_lib().GGUFReader(str(path)).fields
    except Exception:  # noqa: BLE001 - not a readable GGUF file: not ours
        return False


def model_name(model: nn.Module) -> str:
    """A model's name for ``general.name``: its checkpoint folder's name (a Hub cache snapshot: the repo's name)."""
    p = Path(getattr(model.config, "_name_or_path", "") or "")
    if p.parent.name == "snapshots" and "--" in p.parent.parent.name:
        return p.parent.parent.name.split("--")[-1]
    return p.name or model.config.model_type


_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclasses.dataclass
class Planned:
    name: str
    qtype: object  # gguf.GGMLQuantizationType
    make: Callable[[], np.ndarray]  # the bytes/values as written, computed only when written
    shape: tuple[int, ...]  # numpy shape of what make() returns
    dtype: np.dtype
    nbytes: int
    note: str = ""  # "exact", "requantized from ...", "kept"
    logical: tuple[int, ...] = ()  # the shape in values (GGUF's dims, reversed)
    ref: Callable[[], np.ndarray] | None = None  # moeq's fp32 values of the first 2-D slice, for exact types
    parts: Callable[[], Iterator[np.ndarray]] | None = None  # a stack's slices one by one (the streamed writer's)


def gguf_lib():
    try:
        import gguf  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - gguf is a dependency of the export extra
        raise ImportError("--format gguf needs the gguf package: pip install 'moeq[gguf]'") from e
    return gguf


# ---------------------------------------------------------------------------------------------- tensor conversion
def ggml_type(w: PackedWeight) -> str | None:
    """``Q4_0``/``Q5_0``/``Q8_0``/``IQ4_NL``/``MXFP4``/``IQ2_S`` when ``w`` maps onto llama.cpp's blocks exactly, else
    None."""
    if isinstance(w, Iq2sWeight):
        return "IQ2_S"  # its blocks are ggml's block_iq2_s
    if not isinstance(w, RTNWeight) or w.zero is not None or w.group_size != 32:
        return None
    qtype = GRIDS[w.grid].ggml_type(w.bits) if w.grid in GRIDS else None
    if qtype is None or GRIDS[w.grid].ggml_head == "e8m0":  # E8M0 heads: the scales are validated powers of two
        return qtype
    if w.scale_super is not None:  # double-quantized: the codes as they are, code x row factor rounded to fp16
        return qtype if torch.isfinite(w.group_scales().to(torch.float16)).all() else None
    d = w.scale.to(torch.float16)
    if not (torch.isfinite(d).all() and torch.equal(d.to(w.scale.dtype), w.scale)):
        return None  # a scale fp16 cannot hold exactly (tiny/huge, or fp32 scales)
    return qtype


def ggml_blocks(w: RTNWeight | Iq2sWeight) -> torch.Tensor:
    """Q4_0/Q8_0/IQ4_NL block bytes ``[..., N, K/32 * (2 + 32*bits/8)]`` of a weight :func:`ggml_type` accepts
    (IQ4_NL has Q4_0's layout; its nibbles index the iq4nl table, which moeq's codes already do; MXFP4 too, after a
    one-byte E8M0 exponent instead of the fp16 scale); an iq2s weight's blocks as they are."""
    if isinstance(w, Iq2sWeight):
        return w.blocks
    if GRIDS[w.grid].ggml_head == "e8m0":
        e = w.scale if w.scale.dtype == torch.uint8 else e8m0_bytes(w.scale)  # scale = 2^(e - 128)
        codes = w.codes().unflatten(-1, (-1, 32))
        return torch.cat([e.unsqueeze(-1), codes[..., :16] | (codes[..., 16:] << 4)], dim=-1).flatten(-2)
    d = w.group_scales().to(torch.float16)  # exact for bf16 scales ggml_type accepts; double-quantized: rounded
    blocks = w.codes().unflatten(-1, (-1, 32))  # uint8 codes [..., N, K/32, 32], zero point 2**(bits-1)
    if w.bits == 5:  # Q5_0: qh (bit j = element j's fifth bit, little-endian uint32), then Q4_0's nibble layout
        low, hi = blocks & 15, (blocks >> 4).unflatten(-1, (4, 8))
        qh = sum(hi[..., i] << i for i in range(8)).to(torch.uint8)
        qs = torch.cat([qh, low[..., :16] | (low[..., 16:] << 4)], dim=-1)
    elif w.bits == 4:  # ggml: byte j holds element j (low nibble) and element j+16 (high nibble)
        qs = blocks[..., :16] | (blocks[..., 16:] << 4)
    else:
        qs = (blocks.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
    return torch.cat([d.unsqueeze(-1).view(torch.uint8), qs], dim=-1).flatten(-2)


def requantize(values: torch.Tensor, qtype: str) -> np.ndarray:
    """llama.cpp's own rounding (gguf.quants) of dequantized fp32 values."""
    gguf = gguf_lib()
    return gguf.quants.quantize(values.float().numpy(), gguf.GGMLQuantizationType[qtype])


def _packed_stack(ws: list[PackedWeight]) -> tuple[Callable[[], np.ndarray], str, str,
                                                   Callable[[], Iterator[np.ndarray]]]:
    """(make, qtype, note, parts) for a stack of 2-D packed weights written as one tensor (one for a linear): the
    stack's first weight's values are ``ws[0].dequantize(torch.float32)``, what gguf-py must decode the written
    bytes to. ``parts`` yields the stack's slices one at a time (the streamed writer never holds the whole stack)."""
    exact = {ggml_type(w) for w in ws}
    if len(exact) == 1 and None not in exact:
        qtype = exact.pop()
        dq = any(getattr(w, "scale_super", None) is not None for w in ws)
        note = "exact codes, double-quantized scales rounded to fp16 (2^-11)" if dq else "exact"

        def parts():
            return (ggml_blocks(w).numpy() for w in ws)
    else:
        qtype = "Q4_0" if max(w.bits for w in ws) <= 4 else "Q8_0"
        w0 = ws[0]
        note = f"requantized {type(w0).__name__}({getattr(w0, 'bits', '')}{getattr(w0, 'quant_type', '')}) -> {qtype}"

        def parts():
            return (requantize(w.dequantize(torch.float32), qtype) for w in ws)

    def make():
        arrs = list(parts())
        return np.stack(arrs) if len(arrs) > 1 else arrs[0]
    return make, qtype, note, parts


def _ref(w: PackedWeight) -> Callable[[], np.ndarray]:
    return lambda: w.dequantize(torch.float32).numpy()


def _plain(t: torch.Tensor, force_f32: bool) -> tuple[Callable[[], np.ndarray], str]:
    t = t.detach()
    if force_f32 or t.ndim == 1 or t.dtype == torch.float32:
        return (lambda: t.float().contiguous().numpy()), "F32"
    if t.dtype == torch.bfloat16:
        return (lambda: t.contiguous().view(torch.int16).numpy().view(np.uint16)), "BF16"
    if t.dtype == torch.float16:
        return (lambda: t.contiguous().numpy()), "F16"
    raise MoeqError(f"tensor of dtype {t.dtype} has no GGUF form")


# ---------------------------------------------------------------------------------------------------- planning
class Planner:
    def __init__(self, model: nn.Module, fam: GgufFamily):
        gguf = gguf_lib()
        cfg = model.config
        self.gguf, self.cfg, self.fam = gguf, cfg, fam
        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == fam.arch)  # "gpt-oss": GPT_OSS
        self.names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.plan: list[Planned] = []
        self.inter: int | None = None  # the experts' intermediate size, once an experts module is planned

    def gguf_name(self, module: str) -> str:
        name = self.names.get_name(module)
        if name is None:
            raise MoeqError(f"{module}: no llama.cpp {self.fam.arch} tensor corresponds to it; the GGUF export "
                             f"takes {SUPPORTS}")
        return name

    def _permute(self, name: str, make: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
        """convert_hf_to_gguf's q/k row permutation for llama.cpp's interleaved RoPE (rows only: lossless)."""
        if not self.fam.permute_qk or not re.search(r"\.attn_[qk]\.", name):
            return make
        heads = self.cfg.num_attention_heads if ".attn_q." in name else self.cfg.num_key_value_heads

        def permuted():
            a = make()
            n = a.shape[0]
            perm = np.arange(n).reshape(heads, 2, n // heads // 2).swapaxes(1, 2).reshape(-1)
            return a[perm]
        return permuted

    def add(self, name: str, make: Callable[[], np.ndarray], qtype: str, note: str, logical: tuple[int, ...],
            ref: Callable[[], np.ndarray] | None = None, parts: Callable[[], Iterator[np.ndarray]] | None = None):
        """Plan one tensor: ``logical`` is its shape in values; quantized types are written as block bytes. ``ref``:
        moeq's values of its first 2-D slice (exact types), which a consumer's decoding of the bytes must equal."""
        gq = self.gguf.GGMLQuantizationType[qtype]
        if qtype in ("F32", "F16", "BF16"):
            shape, dtype = tuple(logical), {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[qtype]
        else:
            block, type_size = self.gguf.GGML_QUANT_SIZES[gq]
            shape, dtype = tuple(logical[:-1]) + (logical[-1] // block * type_size,), np.uint8
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if ref is not None and len(logical) == 2:
            ref = self._permute(name, ref)
        self.plan.append(Planned(name, gq, self._permute(name, make), shape, np.dtype(dtype), nbytes, note,
                                 tuple(logical), ref, parts if len(logical) == 3 else None))

    def experts(self, module: str, mod: QuantExperts) -> None:
        if mod.b13 is not None and not self.fam.oai_moe:
            raise MoeqError(f"{module}: experts with biases have no llama.cpp {self.fam.arch} form")
        il = int(_LAYER.search(module + ".").group(1))
        pieces: dict[str, list[PackedWeight]] = {"gate": [], "up": [], "down": []}
        for _, kind, w in expert_pieces(mod):
            pieces[kind].append(w)
        self.inter = mod.intermediate_dim
        for kind, ws in pieces.items():
            make, qtype, note, parts = _packed_stack(ws)
            self.add(f"blk.{il}.ffn_{kind}_exps.weight", make, qtype, note, (len(ws), *ws[0].shape), _ref(ws[0]),
                     parts)
        if mod.b13 is not None:  # gpt-oss: [E, 2I] gate-then-up (moeq's order), [E, H]
            i = mod.intermediate_dim
            for kind, b in (("gate", mod.b13[:, :i]), ("up", mod.b13[:, i:]), ("down", mod.b2)):
                make, qtype = _plain(b, True)
                self.add(f"blk.{il}.ffn_{kind}_exps.bias", make, qtype, "kept", tuple(b.shape))

    def linear(self, module: str, mod: QuantLinear) -> None:
        if self.fam.mla and module.endswith(".kv_b_proj"):
            return self.mla_kv_b(module, mod.qweight)
        base = self.gguf_name(module)
        make, qtype, note, _ = _packed_stack([mod.qweight])
        self.add(base + ".weight", make, qtype, note, tuple(mod.qweight.shape), _ref(mod.qweight))
        if mod.bias is not None:
            make, qtype = _plain(mod.bias, True)
            self.add(base + ".bias", make, qtype, "kept", tuple(mod.bias.shape))

    def plain(self, key: str, t: torch.Tensor) -> None:
        m = re.match(r"^(?P<mod>.+\.experts)\.(?P<p>gate_up_proj|down_proj)(?P<bias>_bias)?$", key)
        if m:  # experts kept in the compute dtype, in the family's fused layout (transposed / interleaved: gpt-oss)
            il, arch = int(_LAYER.search(key).group(1)), ARCHS[self.cfg.model_type]
            if arch.transposed and not m["bias"]:
                t = t.transpose(1, 2)  # -> [E, 2I, H] / [E, H, I]
            if m["p"] == "down_proj":
                halves = {"down": t}
            elif arch.interleaved:
                halves = {"gate": t[:, 0::2], "up": t[:, 1::2]}
            else:
                halves = dict(zip(("gate", "up"), t.chunk(2, dim=1)))
            for kind, part in halves.items():
                make, qtype = _plain(part.contiguous(), bool(m["bias"]))
                self.add(f"blk.{il}.ffn_{kind}_exps.{'bias' if m['bias'] else 'weight'}", make, qtype, "kept",
                         tuple(part.shape))
            return
        if key.endswith(".self_attn.sinks"):  # gpt-oss' per-head attention sinks: blk.N.attn_sinks.weight
            make, qtype = _plain(t, True)
            return self.add(self.gguf_name(key) + ".weight", make, qtype, "kept", tuple(t.shape))
        module, _, suffix = key.rpartition(".")
        if self.fam.mla and module.endswith(".kv_b_proj") and suffix == "weight":
            return self.mla_kv_b(module, t)
        if suffix == "e_score_correction_bias":  # llama.cpp's expert-selection bias: blk.N.exp_probs_b.bias
            module, suffix = module + ".e_score_correction", "bias"
        base = self.gguf_name(module)
        router = base.endswith(("ffn_gate_inp", "ffn_gate_inp_shexp"))
        make, qtype = _plain(t, force_f32=router)  # llama.cpp computes router logits from F32 weights
        self.add(f"{base}.{suffix}", make, qtype, "kept", tuple(t.shape))


    def mla_kv_b(self, module: str, w: PackedWeight | torch.Tensor) -> None:
        """MLA's ``kv_b_proj`` ([heads x (nope + v), kv_lora]) as llama.cpp's absorbed attention reads it (what
        convert_hf_to_gguf writes): ``attn_v_b`` [heads, v, kv_lora], each head's v rows with their blocks intact, and
        ``attn_k_b`` [heads, kv_lora, nope], each head's k rows transposed. The transpose crosses the quantization
        groups, so a quantized kv_b's k part is written as its F32 values (exact: no second rounding)."""
        cfg = self.cfg
        heads, nope, v, rank = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if tuple(w.shape) != (heads * (nope + v), rank):
            raise MoeqError(f"{module}: shape {list(w.shape)} is not [heads x (qk_nope + v), kv_lora_rank] = "
                            f"[{heads * (nope + v)}, {rank}]")
        base = self.gguf_name(module)
        k_name, v_name = base.replace("attn_kv_b", "attn_k_b"), base.replace("attn_kv_b", "attn_v_b")
        values = w.dequantize(torch.float32) if isinstance(w, PackedWeight) else w.detach()
        k_rows = lambda: values.view(heads, nope + v, rank)[:, :nope].transpose(1, 2).contiguous()  # noqa: E731
        if isinstance(w, PackedWeight):
            make, qtype, note, parts = _packed_stack([w.row_slice(h * (nope + v) + nope, (h + 1) * (nope + v))
                                                      for h in range(heads)])
            self.add(v_name + ".weight", make, qtype, note, (heads, v, rank),
                     lambda: values[nope:nope + v].float().numpy(), parts)
            make, qtype = _plain(k_rows().float(), True)
            self.add(k_name + ".weight", make, qtype, "exact (F32 values: the transpose crosses the groups)",
                     (heads, rank, nope))
            return
        for name, part in ((v_name, values.view(heads, nope + v, rank)[:, nope:].contiguous()), (k_name, k_rows())):
            make, qtype = _plain(part, False)
            self.add(name + ".weight", make, qtype, "kept", tuple(part.shape))


def _distinct(items):
    """State-dict items with tied tensors kept once; on the meta device (a skeleton) ties are the same object."""
    seen: set = set()
    for name, t in items:
        key = id(t) if t.device.type == "meta" else \
            (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        yield name, t


ORDER = {"token_embd": 0, "output_norm": 2, "output": 3}


def _order(t: Planned):
    return (ORDER.get(t.name.split(".")[0], 1), int(t.name.split(".")[1]) if t.name.startswith("blk.") else -1, t.name)


def plan_module(p: Planner, root: nn.Module, prefix: str = "") -> list[Planned]:
    """Plan every tensor of ``root`` (the module named ``prefix``; the model when empty): quantized modules whole, then
    every parameter or buffer outside them. Returns the new entries, in file order."""
    start, pre = len(p.plan), prefix + "." if prefix else ""
    done = set()
    for name, mod in quantized_modules(root):
        full = pre + name if name else prefix
        done.add(full)
        (p.experts if isinstance(mod, QuantExperts) else p.linear)(full, mod)
    tied = getattr(p.cfg, "tie_word_embeddings", False)
    for key, t in _distinct(root.state_dict(prefix=pre, keep_vars=True).items()):
        if key.rpartition(".")[0] in done or (tied and key == "lm_head.weight"):
            continue
        p.plain(key, t)
    new = sorted(p.plan[start:], key=_order)
    p.plan[start:] = new
    return new


def plan(model: nn.Module, fam: GgufFamily) -> Planner:
    p = Planner(model, fam)
    plan_module(p, model)
    return p


# ------------------------------------------------------------------------------------------------- metadata
def _check(model: nn.Module) -> GgufFamily:
    cfg = model.config
    mt = cfg.model_type
    if mt not in GGUF_FAMILIES:
        raise MoeqError(f"{mt}: no llama.cpp architecture is mapped for it; the GGUF export takes {SUPPORTS}")
    fam = GGUF_FAMILIES[mt]
    problems = _rope_problems(cfg, fam)
    if getattr(cfg, "hidden_act", "silu") != "silu" and not fam.oai_moe:
        problems.append(f"hidden_act={cfg.hidden_act!r} (llama.cpp runs SiLU experts here)")
    ntp = getattr(cfg, "norm_topk_prob", None)
    if ntp is not None and fam.norm_topk is not None and bool(ntp) != fam.norm_topk:
        problems.append(f"norm_topk_prob={ntp} (llama.cpp's {fam.arch} graph always uses {fam.norm_topk})")
    if fam.oai_moe:
        want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_hidden_layers)]
        if list(getattr(cfg, "layer_types", None) or want) != want:
            problems.append("layer_types other than sliding/full alternating from layer 0 (llama.cpp's gpt-oss "
                            "pattern)")
        if float(getattr(cfg, "swiglu_limit", 7.0)) != 7.0:
            problems.append(f"swiglu_limit={cfg.swiglu_limit} (llama.cpp's gpt-oss clamps at 7.0)")
    if fam.mla and not getattr(cfg, "rope_interleave", True):
        problems.append("rope_interleave=False (llama.cpp's deepseek2 graph rotates interleaved pairs)")
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "mlp_only_layers", None) \
            or getattr(cfg, "decoder_sparse_step", 1) != 1 or getattr(cfg, "clip_qkv", None) is not None:
        problems.append("sliding-window attention, dense layers between MoE layers or clip_qkv")
    if mt == "olmoe" and cfg.num_key_value_heads != cfg.num_attention_heads:
        problems.append("grouped-query attention (llama.cpp's olmoe k-norm spans all heads)")
    if problems:
        raise MoeqError(f"this {mt} model cannot be expressed in llama.cpp's {fam.arch} graph: "
                         + "; ".join(problems))
    return fam


def _rope_problems(cfg, fam: GgufFamily) -> list[str]:
    """Plain RoPE maps everywhere; YaRN where the family's llama.cpp graph computes what transformers does
    (``GgufFamily.yarn``): "plain" (gpt-oss: attention factor 0.1 ln(factor) + 1 on both sides, no mscale pair) or
    "mscale" (DeepSeek-V3, Kimi K2: ``mscale == mscale_all_dim``, so transformers' rotary attention factor is 1 and
    the softmax scale carries ``mscale_all_dim``, as llama.cpp's ``yarn_log_mul`` does)."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return []
    if kind != "yarn" or fam.yarn is None:
        return [f"rope_type={kind!r} (plain RoPE is mapped, and YaRN for deepseek2 and gpt-oss)"]
    msad = rope.get("mscale_all_dim")
    pair = bool(msad) and float(rope.get("mscale", 1.0)) == float(msad) if fam.yarn == "mscale" else \
        not rope.get("mscale") and not msad
    if not pair or rope.get("attention_factor") is not None or not rope.get("factor") \
            or not rope.get("original_max_position_embeddings"):
        need = "mscale == mscale_all_dim" if fam.yarn == "mscale" else "no mscale pair"
        return [f"YaRN parameters {rope} (llama.cpp's {fam.arch} YaRN needs factor, original_max_position_embeddings "
                f"and {need}, without an explicit attention_factor)"]
    return []


def _rope_hparams(w, cfg) -> None:
    gguf = gguf_lib()
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    if rope.get("rope_type", "default") != "yarn":
        return
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast), ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
        if rope.get(key) is not None:
            add(float(rope[key]))
    if rope.get("mscale_all_dim"):
        w.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))  # llama.cpp's deepseek2 convention


def _mla_hparams(w, cfg) -> None:
    """deepseek2's attention keys (as convert_hf_to_gguf writes them): MLA as MQA over the compressed latent."""
    w.add_head_count_kv(1)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_q_lora_rank(cfg.q_lora_rank or 0)  # 0: a plain q_proj (llama.cpp reads the key unless it guesses "Lite")
    w.add_kv_lora_rank(cfg.kv_lora_rank)


def _sigmoid_router_hparams(w, cfg) -> None:
    """DeepSeek-style MoE (deepseek2, glm4moe): leading dense layers, shared experts, and the sigmoid router with its
    expert-selection bias, groups, scale and renormalization."""
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_shared_count(cfg.n_shared_experts or 0)
    w.add_expert_weights_scale(float(cfg.routed_scaling_factor))
    w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    w.add_expert_gating_func(gguf_lib().ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg.n_group or 1)
    w.add_expert_group_used_count(cfg.topk_group or 1)


def _hparams(w, model: nn.Module, p: Planner) -> None:
    cfg, gguf = model.config, p.gguf
    w.add_name(model_name(model))
    w.add_string(MOEQ_KEY, __version__)  # marks the file as moeq's (what --overwrite may replace)
    hf = {k: v for k, v in cfg.to_dict().items() if k not in ("quantization_config", "_name_or_path")}
    w.add_string(HF_CONFIG_KEY, json.dumps(hf))  # moeq reads its GGUF files back (moeq.readers.gguf)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    if p.fam.mla:
        _mla_hparams(w, cfg)
    else:
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_key_length(p.head_dim)
        w.add_value_length(p.head_dim)
        rope = getattr(cfg, "rope_parameters", None) or {}  # GLM-4.5 rotates the first half of each head
        w.add_rope_dimension_count(int(p.head_dim * float(rope.get("partial_rotary_factor", 1.0))))
    if p.fam.sigmoid_router:
        _sigmoid_router_hparams(w, cfg)
    _rope_hparams(w, cfg)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    n_exp = getattr(cfg, "num_local_experts", None) or getattr(cfg, "n_routed_experts", None) or cfg.num_experts
    w.add_expert_count(n_exp)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(p.inter or getattr(cfg, "moe_intermediate_size", cfg.intermediate_size))
    if p.fam.oai_moe:
        w.add_sliding_window(cfg.sliding_window)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_vocab_size(cfg.vocab_size)
    kinds = {}
    for t in p.plan:
        kinds[t.qtype.name] = kinds.get(t.qtype.name, 0) + t.nbytes
    main = max(kinds, key=kinds.get)
    w.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "BF16": gguf.LlamaFileType.MOSTLY_BF16, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "MXFP4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE}.get(
                         main, gguf.LlamaFileType.ALL_F32))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _pre_tokenizer(tok_json: Path, fam: GgufFamily) -> str:
    """llama.cpp's pre-tokenizer name: GPT-2's own regex when the tokenizer uses it, else the family's."""
    try:
        pre = json.loads(tok_json.read_text()).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return fam.pre
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    return fam.pre


def _merge_scores(tok_json: Path, tokens: list, scores: list[float]) -> list[float]:
    merges = json.loads(tok_json.read_text())["model"].get("merges", [])
    rank: dict[str, int] = {}
    for i, m in enumerate(merges):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        rank.setdefault(a + b, i)
    out = []
    for text, score in zip(tokens, scores):
        t = text.decode("utf-8") if isinstance(text, bytes) else text
        out.append(-float(rank[t]) if t in rank else (score if score <= -1000.0 else 0.0))
    return out


def _tokenizer(w, source: Path, n_vocab: int, fam: GgufFamily) -> str:
    gguf = gguf_lib()
    from gguf.vocab import BpeVocab, LlamaHfVocab, SpecialVocab  # noqa: PLC0415

    vocab, errors = None, []
    for cls in (BpeVocab, LlamaHfVocab):
        try:
            vocab = cls(source)
            break
        except (FileNotFoundError, ValueError, TypeError, KeyError, ImportError) as e:
            errors.append(f"{cls.__name__}: {e}")
    if vocab is None:
        raise MoeqError(f"{source}: no tokenizer GGUF can describe (a byte-level BPE or a byte-fallback BPE "
                         f"tokenizer.json is needed): {'; '.join(errors)}")
    tokens, scores, types = [], [], []
    for text, score, ttype in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(ttype)
    if vocab.tokenizer_model == "llama":  # llama.cpp merges by score: a token's score is minus the rank of the
        scores = _merge_scores(source / "tokenizer.json", tokens, scores)  # merge that makes it (HF BPE order)
    if len(tokens) > n_vocab:
        raise MoeqError(f"{source}: tokenizer has {len(tokens)} tokens, more than the model's vocab_size {n_vocab}")
    for i in range(len(tokens), n_vocab):  # embedding rows without a token (as convert_hf_to_gguf pads)
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model(vocab.tokenizer_model)
    if vocab.tokenizer_model == "gpt2":
        w.add_tokenizer_pre(_pre_tokenizer(source / "tokenizer.json", fam))
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    SpecialVocab(source, load_merges=vocab.tokenizer_model == "gpt2", n_vocab=n_vocab).add_to_gguf(w, quiet=True)
    return vocab.tokenizer_model


def _source_dir(model: nn.Module, source) -> Path:
    for cand in (source, getattr(model, "name_or_path", None), getattr(model.config, "_name_or_path", None)):
        if cand and (Path(cand) / "tokenizer.json").exists():
            return Path(cand)
    raise MoeqError("the GGUF export embeds the tokenizer: pass source= a checkpoint directory holding "
                     f"tokenizer.json (tried {source!r} and the model's own path)")


def export(model: nn.Module, out: Path, arch: Arch, source=None, progress: bool = False,
           requantize: bool = False, file: str = FILE) -> dict:
    """Write ``out/file``. Tensors llama.cpp cannot hold exactly (anything but symmetric 4/8-bit RTN at group 32)
    would be rounded a second time: refused unless ``requantize`` (the error names the command that exports
    losslessly instead)."""
    fam = _check(model)
    src = _source_dir(model, source)
    p = plan(model, fam)
    lossy = [t.name for t in p.plan if t.note.startswith("requantized")]
    if lossy and not requantize:
        raise MoeqError(
            f"{len(lossy)} tensor(s) ({', '.join(lossy[:3])}{', ...' if len(lossy) > 3 else ''}) have no exact GGUF "
            "type: exporting them would round moeq's already-rounded values a second time (measured to make NF4 "
            "models unusable in llama.cpp). Export losslessly from the bf16 source instead: moeq export SOURCE "
            "OUT.gguf --format gguf --method q4_0 (or q8_0); or pass --requantize to accept the double rounding")
    gguf = gguf_lib()
    w = gguf.GGUFWriter(out / file, fam.arch)
    _hparams(w, model, p)
    tokenizer_model = _tokenizer(w, src, model.config.vocab_size, fam)
    for t in p.plan:
        w.add_tensor_info(t.name, t.shape, t.dtype, t.nbytes, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    from tqdm.auto import tqdm  # noqa: PLC0415

    for t in tqdm(p.plan, desc="gguf", unit="tensor", disable=not progress):
        a = np.ascontiguousarray(t.make())
        if a.shape != t.shape or a.dtype != t.dtype:
            raise RuntimeError(f"{t.name}: produced {a.shape} {a.dtype}, planned {t.shape} {t.dtype}")
        w.write_tensor_data(a)
    w.close()
    requant = [f"{t.name}: {t.note}" for t in p.plan if t.note.startswith("requantized")]
    if requant:
        log.warning("GGUF export re-quantized %d tensors (%s, ...)", len(requant), requant[0])
    types: dict[str, int] = {}
    for t in p.plan:
        types[t.qtype.name] = types.get(t.qtype.name, 0) + 1
    return {"file": file, "arch": fam.arch, "tokenizer": tokenizer_model,
            "tensors": len(p.plan), "bytes": sum(t.nbytes for t in p.plan), "types": types,
            "requantized": requant, "kept_unquantized": [t.name for t in p.plan if t.note == "kept" and
                                                          len(t.shape) >= 2]}



# ------------------------------------------------------------------------------------------------ streamed export
class Stream:
    """A GGUF file written while its checkpoint streams in (a :class:`~moeq.readers.state.Sink`): each decoder layer
    is written as soon as the checkpoint has filled it, then freed, so peak memory is one layer, not the model.

    GGUF puts every tensor's type and offset in the header, before the data. The header's size does not depend on
    them (fixed-width fields), only on the tensor names and shapes and the metadata, which the skeleton already has:
    the data starts where that header ends, tensors are appended in the order their layers complete, and the header
    (tensor infos in that order, their real types and offsets) is written last, in the space kept for it.

    ``check``: every tensor written in an exact type is decoded back with gguf-py (llama.cpp's own Python library) —
    its first 2-D slice, bit for bit against moeq's values — while it is still in memory."""

    def __init__(self, file: Path, source: Path, requantize: bool = False, check: bool = True,
                 progress: bool = False):
        self.file, self.source, self.requantize, self.check = Path(file), Path(source), requantize, check
        self.written: list[Planned] = []
        self.checked = 0
        self.f = None
        self.bar = None
        self.progress = progress

    def _header(self, model: nn.Module, p: Planner, infos: list[Planned]):
        w = gguf_lib().GGUFWriter(None, self.fam.arch)
        _hparams(w, model, p)
        self.tokenizer = _tokenizer(w, self.source, model.config.vocab_size, self.fam)
        for t in infos:
            w.add_tensor_info(t.name, t.shape, t.dtype, t.nbytes, raw_dtype=t.qtype)
        return w

    @staticmethod
    def _emit(w, f) -> int:
        """Header, metadata and tensor infos into ``f`` at its position; returns the position after them."""
        w.fout, w.state = [f], gguf_lib().gguf_writer.WriterState.EMPTY
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.fout = None
        return f.tell()

    def start(self, model: nn.Module, linears: dict) -> None:
        import io  # noqa: PLC0415

        self.model, self.fam = model, _check(model)
        skel = plan(model, self.fam)  # names and shapes, from the meta skeleton
        infos = list(skel.plan)
        emb = next((t for t in infos if t.name == "token_embd.weight"), None)
        if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in linears and emb is not None:
            infos.append(dataclasses.replace(emb, name="output.weight"))  # a tied head quantized: its own copy
        self.expected = {t.name: t.logical for t in infos}
        w = self._header(model, skel, infos)
        self.alignment = w.data_alignment
        self.data_start = w.ggml_pad(self._emit(w, io.BytesIO()), self.alignment)
        self.p = Planner(model, self.fam)
        self.f = open(self.file, "wb")  # noqa: SIM115 - closed by finish/close
        self.f.seek(self.data_start)
        from tqdm.auto import tqdm  # noqa: PLC0415

        self.bar = tqdm(total=len(self.expected), desc="gguf", unit="tensor", disable=not self.progress)

    def write(self, unit: str, module: nn.Module) -> None:
        gguf = gguf_lib()
        for t in plan_module(self.p, module, unit):
            if t.note.startswith("requantized") and not self.requantize:
                raise MoeqError(f"{t.name}: {t.note}: it has no exact GGUF type, and exporting it would round moeq's "
                                "already-rounded values a second time; use --method q4_0 (or q8_0, iq4nl) for a "
                                "lossless GGUF, or pass --requantize to accept the double rounding")
            # a stack one slice at a time (a DeepSeek-V3 layer's gate blocks alone are 2.2 GB), else whole
            slices = t.parts() if t.parts is not None else iter([t.make()])
            want = t.shape[1:] if t.parts is not None else t.shape
            n = 0
            for a in slices:
                a = np.ascontiguousarray(a)
                if a.shape != want or a.dtype != t.dtype:
                    raise RuntimeError(f"{t.name}: produced {a.shape} {a.dtype}, planned {want} {t.dtype}")
                if n == 0 and self.check and t.ref is not None and t.note == "exact":
                    got = gguf.quants.dequantize(a if a.ndim == 2 else a[0], t.qtype)
                    if not np.array_equal(got, t.ref()):
                        raise MoeqError(f"{t.name}: gguf-py decodes the written {t.qtype.name} blocks to values "
                                        "that differ from moeq's; the file is not finished")
                    self.checked += 1
                a.tofile(self.f)
                n += 1
            if n != (t.shape[0] if t.parts is not None else 1):
                raise RuntimeError(f"{t.name}: {n} slices written, planned {t.shape}")
            self.f.write(bytes(gguf.GGUFWriter.ggml_pad(t.nbytes, self.alignment) - t.nbytes))
            self.written.append(dataclasses.replace(t, make=None, ref=None, parts=None))
            self.bar.update()
        self.p.plan = []

    def finish(self, model: nn.Module) -> None:
        got = {t.name: t.logical for t in self.written}
        missing = sorted(set(self.expected) - set(got))
        extra = sorted(set(got) - set(self.expected))
        wrong = [f"{n} {list(got[n])} (expected {list(self.expected[n])})" for n in sorted(set(got) & set(self.expected))
                 if tuple(got[n]) != tuple(self.expected[n])]
        if missing or extra or wrong:
            raise MoeqError("the streamed GGUF does not hold the model's tensors: "
                            + "; ".join(f"{k}: {', '.join(v[:5])}" for k, v in
                                        (("missing", missing), ("unexpected", extra), ("shape", wrong)) if v))
        self.p.plan = self.written
        w = self._header(self.model, self.p, self.written)
        self.f.seek(0)
        end = self._emit(w, self.f)
        if w.ggml_pad(end, self.alignment) != self.data_start:  # fixed-width fields: the same size, or a bug
            raise RuntimeError(f"GGUF header of {end} bytes does not end at its reserved {self.data_start}")
        self.f.write(bytes(self.data_start - end))
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.f is not None:
            self.f.close()
            self.f = None

    def summary(self) -> dict:
        types: dict[str, int] = {}
        for t in self.written:
            types[t.qtype.name] = types.get(t.qtype.name, 0) + 1
        requant = [f"{t.name}: {t.note}" for t in self.written if t.note.startswith("requantized")]
        return {"file": self.file.name, "arch": self.fam.arch, "tokenizer": self.tokenizer,
                "tensors": len(self.written), "bytes": sum(t.nbytes for t in self.written), "types": types,
                "requantized": requant, "checked_by_gguf_py": self.checked,
                "kept_unquantized": [t.name for t in self.written if t.note == "kept" and len(t.logical) >= 2]}
