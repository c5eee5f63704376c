"""Reading moeq's own GGUF exports back (``moeq.load``, so ``inspect``/``eval``/``generate`` work on them), also after
llama.cpp's ``llama-quantize`` re-typed them (it keeps the metadata): the transformers config travels in the file
(``moeq.hf_config``). ``Q4_0``/``Q8_0`` blocks become moeq's symmetric RTN weights at group 32 exactly (fp16 block
scales, the ``signed`` grid: llama.cpp's arithmetic), ``IQ4_NL`` blocks its ``iq4nl`` grid exactly; F32/F16/BF16
tensors are read as stored, and every other type gguf-py can decode (K-quants, Q4_1/Q5_x, IQ types) is dequantized
into the compute dtype (the values llama.cpp computes with, rounded once to that dtype). Mixtral's q/k row
permutation for llama.cpp's RoPE is undone. Tensor names come from the same gguf-py name map the exporter writes
with. GGUF files from other tools (llama.cpp's converter, the Hub's uploaders) carry no transformers config: it is
rebuilt from their llama.cpp hyperparameters (:func:`config_from_metadata`) for the families moeq exports."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig

from moeq.arch import GGUF_FAMILIES
from moeq.errors import MoeqError
from moeq.formats import Iq2sWeight, RTNWeight
from moeq.formats.grids import GRIDS, from_ggml
from moeq.formats.packing import pack
from moeq.readers.state import LoadState, compute_dtype, set_tensor
from moeq.config import QuantConfig


PACKED = ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "MXFP4")  # GGML types moeq holds as they are (grids.from_ggml, group 32)
HELD = (*PACKED, "IQ2_S")  # ... and as their own block bytes (moeq.formats.iq2s)


def gguf_file(path: Path) -> Path | None:
    """The GGUF file a path names: the file itself, or ``model.gguf`` in a folder without safetensors weights."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "model.gguf").is_file() and not any(path.glob("*.safetensors")):
        return path / "model.gguf"
    return None


def _field_str(reader, key: str) -> str | None:
    f = reader.fields.get(key)
    return None if f is None else bytes(f.parts[f.data[0]]).decode("utf-8")


def read_config(path: Path):
    from moeq.export.gguf import HF_CONFIG_KEY, gguf_lib  # noqa: PLC0415

    try:
        reader = gguf_lib().GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - gguf-py's parser on an untrusted file: any failure is the file's
        raise MoeqError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    raw = _field_str(reader, HF_CONFIG_KEY)
    if raw is None:  # llama.cpp's converter, a Hub uploader: the config from the file's own llama.cpp metadata
        return reader, config_from_metadata(reader, path)
    try:
        d = json.loads(raw)
        config = AutoConfig.for_model(**d)
    except Exception as e:  # noqa: BLE001
        raise MoeqError(f"{path}: its {HF_CONFIG_KEY} is not a usable transformers config ({e})") from None
    return reader, config


# transformers config field <- llama.cpp metadata key (after "{arch}."), per family; "expert_ff" etc. below
_COMMON = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
           "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
           "max_position_embeddings": "context_length", "num_experts_per_tok": "expert_used_count",
           "rms_norm_eps": "attention.layer_norm_rms_epsilon"}
_FROM_GGUF = {  # model_type -> its own fields
    "mixtral": {"num_local_experts": "expert_count",
                "intermediate_size": ("expert_feed_forward_length", "feed_forward_length")},
    "qwen3_moe": {"num_experts": "expert_count", "moe_intermediate_size": "expert_feed_forward_length",
                  "intermediate_size": "feed_forward_length"},
    "qwen2_moe": {"num_experts": "expert_count", "moe_intermediate_size": "expert_feed_forward_length",
                  "intermediate_size": "feed_forward_length",
                  "shared_expert_intermediate_size": "expert_shared_feed_forward_length"},
    "olmoe": {"num_experts": "expert_count",
              "intermediate_size": ("expert_feed_forward_length", "feed_forward_length")},
    "deepseek_v3": {"n_routed_experts": "expert_count", "moe_intermediate_size": "expert_feed_forward_length",
                    "intermediate_size": "feed_forward_length", "n_shared_experts": "expert_shared_count",
                    "first_k_dense_replace": "leading_dense_block_count", "kv_lora_rank": "attention.kv_lora_rank",
                    "q_lora_rank": "attention.q_lora_rank", "qk_rope_head_dim": "rope.dimension_count",
                    "v_head_dim": "attention.value_length_mla", "routed_scaling_factor": "expert_weights_scale",
                    "norm_topk_prob": "expert_weights_norm", "n_group": "expert_group_count",
                    "topk_group": "expert_group_used_count"},
    "glm4_moe": {"n_routed_experts": "expert_count", "moe_intermediate_size": "expert_feed_forward_length",
                 "intermediate_size": "feed_forward_length", "n_shared_experts": "expert_shared_count",
                 "first_k_dense_replace": "leading_dense_block_count", "routed_scaling_factor": "expert_weights_scale",
                 "norm_topk_prob": "expert_weights_norm", "n_group": "expert_group_count",
                 "topk_group": "expert_group_used_count"},
    "gpt_oss": {"num_local_experts": "expert_count", "intermediate_size": "expert_feed_forward_length",
                "sliding_window": "attention.sliding_window"},
}
_OPTIONAL = {"max_position_embeddings", "rms_norm_eps", "shared_expert_intermediate_size", "q_lora_rank",
             "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group"}
# deepseek2's YaRN keys (convert_hf_to_gguf's DeepSeek-V3 / Kimi K2 files); any other rope scaling is refused
_YARN_KEYS = ("type", "factor", "original_context_length", "yarn_log_multiplier", "yarn_beta_fast", "yarn_beta_slow")


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    v = f.parts[f.data[0]]
    return bytes(v).decode("utf-8") if f.types and f.types[0].name == "STRING" else v.tolist()[0]


def config_from_metadata(reader, path: Path):
    """The transformers config of a GGUF file moeq did not write (llama.cpp's ``convert_hf_to_gguf.py``, the Hub's
    uploaders), from its llama.cpp hyperparameters; the family from ``general.architecture`` (llama.cpp's ``llama``
    graph with experts is Mixtral). Anything the mapped families cannot express is refused, naming the key."""

    arch = _field(reader, "general.architecture")
    by_arch = {f.arch: mt for mt, f in GGUF_FAMILIES.items()}
    mt = by_arch.get(arch)
    if mt is None or (mt == "mixtral" and not _field(reader, f"{arch}.expert_count")):
        raise MoeqError(f"{path}: GGUF architecture {arch!r}{' without experts' if mt else ''} is not one moeq maps "
                        f"(it reads {', '.join(f'{f.arch} ({m})' for m, f in GGUF_FAMILIES.items())}); run it with "
                        "llama.cpp")
    fam = GGUF_FAMILIES[mt]
    mla, oss, glm = fam.mla, fam.oai_moe, mt == "glm4_moe"  # the last: its transformers config's own fields
    unsupported = [k for k in reader.fields if (k.startswith(f"{arch}.rope.scaling.") and not (
        fam.yarn and k.split("rope.scaling.")[1] in _YARN_KEYS)) or (k.endswith(".sliding_window") and not oss)
        or (k.startswith(f"{arch}.attention.sliding_window") and not oss)
        or (k == f"{arch}.leading_dense_block_count" and not fam.sigmoid_router)]
    if (mla or (glm and _field(reader, f"{arch}.expert_gating_func") is not None)) \
            and _field(reader, f"{arch}.expert_gating_func") != 2:
        unsupported.append(f"{arch}.expert_gating_func={_field(reader, f'{arch}.expert_gating_func')} (sigmoid, 2, "
                           "is DeepSeek-V3's router)")
    if mla and not _field(reader, f"{arch}.attention.key_length_mla"):
        unsupported.append(f"{arch}.attention.key_length_mla missing (a pre-MLA file with attn_kv_b whole)")
    if unsupported:
        raise MoeqError(f"{path}: {', '.join(unsupported)}: not expressible in the transformers {mt} model moeq "
                        "builds; run it with llama.cpp")
    d: dict = {}
    for field, keys in {**_COMMON, **_FROM_GGUF[mt]}.items():
        keys = (keys,) if isinstance(keys, str) else keys
        v = next((x for x in (_field(reader, f"{arch}.{k}") for k in keys) if x is not None), None)
        if v is None and field not in _OPTIONAL:
            raise MoeqError(f"{path}: GGUF metadata {arch}.{keys[0]} is missing (needed for {field})")
        if v is not None:
            d[field] = v
    heads = d["num_attention_heads"]
    head_dim = _field(reader, f"{arch}.attention.key_length") or d["hidden_size"] // heads
    if mla:  # MLA as llama.cpp's MQA over the latent: transformers' heads are the decompressed ones
        d["num_key_value_heads"] = heads
        d["qk_nope_head_dim"] = _field(reader, f"{arch}.attention.key_length_mla") - d["qk_rope_head_dim"]
        d["q_lora_rank"] = d.get("q_lora_rank") or None
        d["norm_topk_prob"] = bool(d.get("norm_topk_prob", False))
        d.setdefault("routed_scaling_factor", 1.0)
    elif mt != "mixtral" or head_dim != d["hidden_size"] // heads:
        d["head_dim"] = head_dim
    if glm:  # GLM-4.5: qk-norm, q/k/v biases and the rotated share of each head, from what the file holds
        d["use_qk_norm"] = any(t.name.endswith("attn_q_norm.weight") for t in reader.tensors)
        d["attention_bias"] = any(t.name.endswith("attn_q.bias") for t in reader.tensors)
        d["norm_topk_prob"] = bool(d.get("norm_topk_prob", False))
        d.setdefault("routed_scaling_factor", 1.0)
    nextn = _field(reader, f"{arch}.nextn_predict_layers") or 0
    if nextn:  # the converter appends the multi-token-prediction layers as the last blocks: not run (skipped)
        if not isinstance(nextn, int) or not 0 < nextn < int(d["num_hidden_layers"]):
            raise MoeqError(f"{path}: {arch}.nextn_predict_layers={nextn!r} is not a count of blocks below "
                            f"block_count={d['num_hidden_layers']}")
        d["num_hidden_layers"] -= nextn
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    d["vocab_size"] = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if d["vocab_size"] is None:
        raise MoeqError(f"{path}: neither {arch}.vocab_size nor a token list says the vocabulary size")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": float(_field(reader, f"{arch}.rope.freq_base")
                                                                        or 10000.0)}
    rot = _field(reader, f"{arch}.rope.dimension_count")
    if glm and rot and rot != head_dim:
        d["rope_parameters"]["partial_rotary_factor"] = rot / head_dim
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        needed = _YARN_KEYS[1:4] if mla else _YARN_KEYS[1:3]
        if scaling != "yarn" or not all(_field(reader, f"{arch}.rope.scaling.{k}") for k in needed):
            raise MoeqError(f"{path}: {arch}.rope.scaling.type={scaling!r} without the YaRN {', '.join(needed)} moeq "
                            "maps; run it with llama.cpp")
        d["rope_parameters"].update(
            rope_type="yarn", factor=float(_field(reader, f"{arch}.rope.scaling.factor")),
            original_max_position_embeddings=int(_field(reader, f"{arch}.rope.scaling.original_context_length")),
            **{k: float(v) for k in ("beta_fast", "beta_slow")
               if (v := _field(reader, f"{arch}.rope.scaling.yarn_{k}")) is not None})
        if mla:  # DeepSeek's mscale pair, as 0.1 x mscale_all_dim
            msad = 10.0 * float(_field(reader, f"{arch}.rope.scaling.yarn_log_multiplier"))
            d["rope_parameters"].update(mscale=msad, mscale_all_dim=msad)
        if oss:  # gpt-oss' YaRN as it ships (transformers' default would round the correction range)
            d["rope_parameters"]["truncate"] = False
    if oss:  # llama.cpp's gpt-oss pattern: sliding-window attention on even layers
        d["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(d["num_hidden_layers"])]
    d["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    if mt in ("qwen3_moe", "qwen2_moe", "olmoe"):
        d["norm_topk_prob"] = GGUF_FAMILIES[mt].norm_topk
    if mt == "qwen2_moe":
        d["qkv_bias"] = any(t.name.endswith("attn_q.bias") for t in reader.tensors)
    for tok in ("bos", "eos", "padding"):
        v = _field(reader, f"tokenizer.ggml.{tok}_token_id")
        if v is not None:
            d["pad_token_id" if tok == "padding" else f"{tok}_token_id"] = v
    try:
        return AutoConfig.for_model(mt, **d)
    except Exception as e:  # noqa: BLE001 - values of an untrusted file
        raise MoeqError(f"{path}: its llama.cpp metadata make no valid {mt} config ({e})") from None


def _unpermute(a: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of the exporter's q/k row permutation."""
    n = a.shape[0]
    perm = np.arange(n).reshape(heads, 2, n // heads // 2).swapaxes(1, 2).reshape(-1)
    out = np.empty_like(a)
    out[perm] = a
    return out


def _rtn_from_blocks(blocks: np.ndarray, bits: int, shape: tuple[int, ...], name: str,
                     grid: str = "signed") -> RTNWeight:
    """Q4_0/Q8_0/IQ4_NL block bytes ``[..., N, K/32 * (2 + 32 * bits / 8)]`` -> RTN weight (inverse of
    ``ggml_blocks``; IQ4_NL: the ``iq4nl`` grid, its nibbles index the same table)."""
    e8m0 = GRIDS[grid].ggml_head == "e8m0"
    head = 1 if e8m0 else 2  # MXFP4: an E8M0 exponent byte; the others an fp16 scale
    per = head + 32 * bits // 8
    native = _unpack_native(blocks, bits, head, shape) if bits in (4, 8) else None
    if native is not None:
        qdata, heads = native
        return _rtn_weight(qdata, heads, e8m0, bits, shape, name, grid)
    b = torch.from_numpy(np.array(blocks, copy=True)).reshape(*shape[:-1], shape[-1] // 32, per)
    qs = b[..., head:]
    if bits == 5:  # Q5_0: qh (4 bytes, bit j = element j's fifth bit), then the Q4_0 nibble layout
        hi = torch.stack([(qs[..., :4] >> i) & 1 for i in range(8)], dim=-1).flatten(-2)
        codes = torch.cat([qs[..., 4:] & 0xF, qs[..., 4:] >> 4], dim=-1) | (hi << 4)
        qdata = pack(codes.flatten(-2), 5)
    elif bits == 4:  # byte j: element j (low nibble), element j+16 (high nibble)
        codes = torch.cat([qs & 0xF, qs >> 4], dim=-1)
        qdata = (codes[..., 0::2] | (codes[..., 1::2] << 4)).flatten(-2)
    else:
        qdata = (qs.contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8).flatten(-2)
    return _rtn_weight(qdata, b[..., :head].contiguous(), e8m0, bits, shape, name, grid)


def _unpack_native(blocks: np.ndarray, bits: int, head: int, shape: tuple[int, ...]
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """4/8-bit blocks -> (codes ``[..., N, K * bits / 8]``, scale bytes ``[..., N, K/32, head]``) by
    ``moeq_ggml_unpack``, one pass straight from the memory-mapped file; None without the native library."""
    from moeq import native  # noqa: PLC0415

    L = native.lib()
    nb = math.prod(shape) // 32
    if L is None or not blocks.flags.c_contiguous or blocks.nbytes != nb * (head + 32 * bits // 8):
        return None
    codes = torch.empty(*shape[:-1], shape[-1] * bits // 8, dtype=torch.uint8)
    heads = torch.empty(*shape[:-1], shape[-1] // 32, head, dtype=torch.uint8)
    L.moeq_ggml_unpack(blocks.ctypes.data, nb, bits, head, native.ptr(codes), native.ptr(heads))
    return codes, heads


def _rtn_weight(qdata: torch.Tensor, heads: torch.Tensor, e8m0: bool, bits: int, shape: tuple[int, ...], name: str,
                grid: str) -> RTNWeight:
    """Codes in moeq's order and each block's scale bytes ``[..., N, K/32, head]`` -> the RTN weight."""
    if e8m0:  # the exponent bytes as they are (ggml's E8M0_TO_FP32_HALF x doubled table = moeq's 2^(e - 128))
        scale = heads[..., 0]
        if bool((scale == 255).any()):
            raise MoeqError(f"{name}: MXFP4 exponent 255 (E8M0 NaN)")
    else:
        d = heads.view(torch.float16).squeeze(-1)  # [..., N, K/32]
        scale = d.to(torch.bfloat16) if torch.equal(d.to(torch.bfloat16).to(d.dtype), d) else d.float()
    return RTNWeight(qdata=qdata.contiguous(), scale=scale.contiguous(), zero=None, bits=bits, group_size=32,
                     grid=grid, shape=tuple(shape), dtype=torch.bfloat16).validate(name)


def _join_kv_b(parts: dict[str, torch.Tensor], cfg, name: str) -> torch.Tensor:
    """MLA's kv_b_proj [heads x (nope + v), kv_lora] from llama.cpp's attn_k_b [heads, kv_lora, nope] and attn_v_b
    [heads, v, kv_lora] (decoded values; kept dense in the compute dtype, as the split crossed its groups)."""
    heads, nope, v, rank = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    k, val = parts["k"], parts["v"]
    if tuple(k.shape) != (heads, rank, nope) or tuple(val.shape) != (heads, v, rank):
        raise MoeqError(f"{name}: attn_k_b {list(k.shape)} / attn_v_b {list(val.shape)} are not [{heads}, {rank}, "
                        f"{nope}] / [{heads}, {v}, {rank}]")
    return torch.cat([k.transpose(1, 2), val], dim=1).reshape(heads * (nope + v), rank)


def _check_tiling(file: Path, reader) -> None:
    """Tensor data ranges must lie inside the file and not overlap (an offset aimed at another tensor's bytes would
    silently duplicate it): GGUF has no such check of its own."""
    size = file.stat().st_size
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in reader.tensors)
    names = [n for _, _, n in spans]
    if len(set(names)) != len(names):
        raise MoeqError(f"{file}: a tensor name appears twice")
    end = 0
    for a, b, name in spans:
        if a < end or b > size:
            raise MoeqError(f"{file}: tensor {name}: data range {a}..{b} overlaps another tensor or leaves the file")
        end = b


def read(found, quant, dtype: torch.dtype | None, progress: bool) -> nn.Module:
    """The :mod:`moeq.readers` entry: a GGUF file moeq wrote (already quantized: no method)."""
    if quant is not None:
        raise MoeqError(f"{found.path} is already quantized (GGUF); load it without a method")
    return load(found.gguf_file, dtype)


def load(path: Path, dtype: torch.dtype | None = None) -> nn.Module:
    from moeq.export.gguf import Planner, gguf_lib  # noqa: PLC0415

    gguf = gguf_lib()
    file = gguf_file(path)
    reader, config = read_config(file)
    if config.model_type not in GGUF_FAMILIES:
        raise MoeqError(f"{file}: model_type {config.model_type!r} is not one moeq exports to GGUF")
    dtype = compute_dtype(config, dtype)
    state = LoadState(file.parent, None, config, QuantConfig.of("none"), dtype, quantize_linears=False)
    model, arch, fam = state.model, state.arch, GGUF_FAMILIES[config.model_type]
    planner = Planner(model, fam)
    targets: dict[str, tuple[str, str]] = {}  # gguf tensor name -> (kind, HF name)
    for name, mod in model.named_modules():
        if name in state.builders:
            il = int(name.split(".layers.")[1].split(".")[0])
            for kind in ("gate", "up", "down"):
                targets[f"blk.{il}.ffn_{kind}_exps.weight"] = ("experts." + kind, name)
                if state.builders[name].has_bias:  # gpt-oss
                    targets[f"blk.{il}.ffn_{kind}_exps.bias"] = ("bias." + kind, name)
            continue
        base = planner.names.get_name(name)
        if base is not None and fam.mla and name.endswith(".kv_b_proj"):
            for part in ("k", "v"):  # the exporter's split of MLA's kv_b (Planner.mla_kv_b), joined again below
                targets[base.replace("attn_kv_b", f"attn_{part}_b") + ".weight"] = (f"mla.{part}", f"{name}.weight")
            continue
        for pname, _ in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            if pname == "sinks":  # gpt-oss' attention sinks
                targets[f"{planner.names.get_name(name + '.sinks')}.weight"] = ("plain", f"{name}.{pname}")
            elif pname == "e_score_correction_bias":  # llama.cpp's expert-selection bias
                targets[f"{planner.names.get_name(name + '.e_score_correction')}.bias"] = ("plain", f"{name}.{pname}")
            elif base is not None:
                targets[f"{base}.{pname}"] = ("linear" if isinstance(mod, nn.Linear) else "plain", f"{name}.{pname}")
    _check_tiling(file, reader)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    seen, mla, biases = set(), {}, {}
    n_layers = config.num_hidden_layers
    nextn = _field(reader, f"{fam.arch}.nextn_predict_layers") or 0
    for t in reader.tensors:
        blk = re.match(r"^blk\.(\d+)\.", t.name)
        if nextn and blk and int(blk[1]) >= n_layers:
            continue  # a multi-token-prediction block (converter-written GLM-4.5): the model does not run it
        if t.name not in targets:
            raise MoeqError(f"{file}: tensor {t.name} has no place in the {config.model_type} model")
        kind, hf = targets[t.name]
        seen.add(t.name)
        qtype = t.tensor_type.name
        data = np.asarray(t.data)
        logical = tuple(int(x) for x in reversed(t.shape.tolist()))  # gguf lists dims innermost first
        if fam.permute_qk and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = config.num_attention_heads if ".attn_q." in t.name else config.num_key_value_heads
            data = _unpermute(data, heads)
        gtype = gguf.GGMLQuantizationType[qtype]
        if gtype not in gguf.GGML_QUANT_SIZES:
            raise MoeqError(f"{file}: tensor {t.name} has GGML type {qtype}, which gguf-py cannot size")
        block, per = gguf.GGML_QUANT_SIZES[gtype]
        if not logical or min(logical) <= 0 or logical[-1] % block or (
                data.nbytes != math.prod(logical[:-1]) * (logical[-1] // block) * per):
            raise MoeqError(f"{file}: tensor {t.name}: {data.nbytes} bytes of {qtype} do not hold shape "
                            f"{list(logical)}")
        packed = qtype in HELD and not kind.startswith("mla.")
        if packed and kind.startswith("experts."):  # a layer's experts are packed only all together (llama.cpp's
            blk = t.name.split(".ffn_")[0]           # mixes may give down another type than gate/up)
            gate, up, down = (types.get(f"{blk}.ffn_{k}_exps.weight") for k in ("gate", "up", "down"))
            packed = gate == up and gate in HELD and down in HELD
        if packed:
            if qtype == "IQ2_S":
                blocks = torch.from_numpy(np.array(data, copy=True)).reshape(*logical[:-1], -1)
                w = Iq2sWeight(blocks=blocks, shape=logical, dtype=dtype).validate(f"{file}: tensor {t.name}")
            else:
                row, bits = from_ggml(qtype)
                w = _rtn_from_blocks(data, bits, logical, t.name, row.name)
            if kind.startswith("experts."):
                state.put_packed_stack(hf, kind.split(".")[1], w, t.name)
            else:
                state.put_packed(hf, w)
            continue
        if qtype in ("F32", "F16", "BF16"):
            arr = torch.from_numpy(np.array(data, copy=True))
            tensor = arr.view(torch.bfloat16) if qtype == "BF16" else arr
        else:
            try:
                arr = gguf.quants.dequantize(np.ascontiguousarray(data).reshape(-1, data.shape[-1]), gtype)
            except NotImplementedError:
                raise MoeqError(f"{file}: tensor {t.name} has GGML type {qtype}, which gguf-py cannot decode"
                                ) from None
            tensor = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
            if not torch.isfinite(tensor).all():
                raise MoeqError(f"{file}: tensor {t.name}: its {qtype} blocks decode to non-finite values")
        tensor = tensor.reshape(logical)
        if kind.startswith("bias."):  # the experts' biases, in the family's fused layout (gpt-oss: interleaved)
            got = biases.setdefault(hf, {})
            got[kind[5:]] = tensor.to(dtype)
            if "down" in got:
                state.builders[hf].put_bias("down_proj", got.pop("down"), t.name)
            if "gate" in got and "up" in got:
                gate, up = got.pop("gate"), got.pop("up")
                fused = torch.stack([gate, up], -1).flatten(-2) if arch.interleaved else torch.cat([gate, up], -1)
                state.builders[hf].put_bias("gate_up_proj", fused, t.name)
            state.build_if_complete(hf)
            continue
        if kind.startswith("mla."):
            mla.setdefault(hf, {})[kind[4:]] = tensor.float()
            if len(mla[hf]) == 2:
                set_tensor(model, hf, _join_kv_b(mla.pop(hf), config, hf).to(dtype), t.name)
            continue
        tensor = tensor.to(dtype)
        if kind.startswith("experts."):
            for e in range(logical[0]):
                state.builders[hf].put(e, kind.split(".")[1], tensor[e], t.name)
            state.build_if_complete(hf)
        else:
            set_tensor(model, hf, tensor, t.name)
    return state.finish()
