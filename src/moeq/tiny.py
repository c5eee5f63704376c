"""Tiny random checkpoints of every supported MoE family, written with transformers' own ``save_pretrained`` (so
their on-disk layout is the real one), plus a small byte-level BPE tokenizer trained offline. Used by the demo,
the tests and the benchmarks; nothing here touches the network."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
from moeq.arch import tiny_configs
from moeq.errors import MoeqError

VOCAB = 384
_COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, tie_word_embeddings=False)
TINY: dict[str, dict] = tiny_configs()  # every MoE family's tiny config (its Arch row holds it)
DENSE: dict[str, dict] = tiny_configs(dense=True)  # dense families: linears only

_TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
         "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
         "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
         "considered the rightful property of some one or other of their daughters. ")


def tiny_config(model_type: str, **overrides):
    table = {**TINY, **DENSE}
    if model_type not in table:
        raise MoeqError(f"no tiny config for {model_type!r}; available: {sorted(table)}")
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **table[model_type], **overrides})
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, attr, None) is not None and not isinstance(getattr(cfg, attr), list):
            setattr(cfg, attr, min(getattr(cfg, attr), VOCAB - 1))
    return cfg


def tiny_tokenizer(kind: str = "bytelevel") -> PreTrainedTokenizerFast:
    """``bytelevel``: GPT-2-style byte-level BPE (Qwen, OLMoE); ``spm``: Llama/Mixtral-style BPE over ``▁``-joined
    text with ``<0xNN>`` byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: PLC0415

    if kind == "spm":  # trained on words like SentencePiece, saved in Llama's tokenizer.json form
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False)
        tok.train_from_iterator([_TEXT] * 4, trainer)
        tok.pre_tokenizer = None
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if kind != "bytelevel":
        raise MoeqError(f"unknown tiny tokenizer kind {kind!r}; valid: bytelevel, spm")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 2, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def make_checkpoint(model_type: str, out: str | os.PathLike, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                    fused_layout: bool = False, tokenizer: str = "bytelevel", **overrides) -> Path:
    """Write a random tiny model of ``model_type`` to ``out`` with ``save_pretrained`` (per-expert keys where the
    family stores them so); ``fused_layout`` instead writes the model's own 3-D expert params."""
    out = Path(out)
    torch.manual_seed(seed)
    cfg = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():  # transformers' init leaves some MoE params at zero/empty: give everything real values
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.05)
            elif "norm" in name or name.endswith("A_log") or name.endswith(".D"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    if fused_layout:
        from safetensors.torch import save_file  # noqa: PLC0415

        out.mkdir(parents=True, exist_ok=True)
        cfg.save_pretrained(out)
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(out)
    tiny_tokenizer(tokenizer).save_pretrained(out)
    return out


FP8_SKIP = ("embed_tokens", "lm_head", "norm", ".gate.weight", "router", "shared_expert_gate", "e_score_correction")


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 block quantization of ``[..., N, K]`` as transformers' ``Fp8Quantize`` computes it (moeq's ``fp8``
    rounding, :func:`moeq.formats.fp8.quantize`): per ``block`` tile ``scale = 448 / amax`` (1 for an all-zero tile),
    codes ``e4m3(w * scale)``, stored ``scale_inv = 1 / scale``; edge tiles cover what remains (``ceil`` tiles,
    DeepSeek's layout). Returns the e4m3 codes and ``scale_inv``."""
    from moeq.formats import fp8  # noqa: PLC0415

    q = fp8.quantize(w, block)
    return q.qdata.view(torch.float8_e4m3fn), q.scale


def make_fp8_checkpoint(model_type: str, out: str | os.PathLike, block: tuple[int, int] | None = (128, 128),
                        **kw) -> Path:
    """A tiny checkpoint in the FP8 block-scaled layout DeepSeek-V3 / Qwen3-*-FP8 ship (:func:`to_fp8` of a random
    tiny checkpoint)."""
    out = make_checkpoint(model_type, out, **kw)
    return to_fp8(out, out, block)


def rewrite(src: str | os.PathLike, out: str | os.PathLike, convert, quantization_config: dict) -> Path:
    """Write ``src`` (a checkpoint folder; ``out`` may be the same folder) shard by shard with each tensor replaced by
    ``convert(key, tensor)`` (a dict of the tensors written in its place), the index's weight map following, and
    ``quantization_config`` in its config.json: the one loop of the pre-quantized fixtures."""
    import json  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    renamed: dict[str, list[str]] = {}
    for f in sorted(src.iterdir()):
        if f.suffix != ".safetensors":
            if f.is_file() and src != out:
                shutil.copy2(f, out / f.name)
            continue
        new = {}
        for key, t in load_file(str(f)).items():
            parts = convert(key, t)
            new.update({k: v.contiguous() for k, v in parts.items()})
            if list(parts) != [key]:
                renamed[key] = list(parts)
        save_file(new, str(out / f.name), metadata={"format": "pt"})
        del new
    idx = out / "model.safetensors.index.json"
    if idx.exists():
        index = json.loads(idx.read_text())
        for key, parts in renamed.items():
            fname = index["weight_map"].pop(key)
            index["weight_map"].update({p: fname for p in parts})
        idx.write_text(json.dumps(index, indent=1))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def to_fp8(src: str | os.PathLike, out: str | os.PathLike, block: tuple[int, int] | None = (128, 128)) -> Path:
    """Write ``src`` (a bf16 checkpoint folder; ``out`` may be the same folder) in the FP8 block-scaled layout: every
    linear weight of the decoder layers (experts included; not the embeddings, head, norms or routers) as ``weight``
    F8_E4M3 + ``weight_scale_inv`` F32 (:func:`fp8_block_quantize`; ``block=None``: one scale per tensor), shard by
    shard, and ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block,
    "activation_scheme": "dynamic"}``."""
    return rewrite(src, out, lambda key, t: fp8_tensors(key, t, block), fp8_quantization_config(block))


def fp8_quantization_config(block: tuple[int, int] | None = (128, 128)) -> dict:
    """``config.json``'s ``quantization_config`` of a DeepSeek-layout FP8 checkpoint."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": None if block is None else list(block)}


def fp8_tensors(key: str, t: torch.Tensor, block: tuple[int, int] | None = (128, 128)) -> dict[str, torch.Tensor]:
    """What a DeepSeek-layout FP8 checkpoint holds in place of tensor ``key``: a decoder layer's linear weight as
    ``weight`` F8_E4M3 + ``weight_scale_inv`` F32 (:func:`fp8_block_quantize`; ``block=None``: one scale per
    tensor), anything else as it is."""
    if (t.ndim < 2 or not key.endswith(("weight", "experts.gate_up_proj", "experts.down_proj"))
            or any(s in key for s in FP8_SKIP)):  # linear weights, and transformers' fused expert stacks
        return {key: t}
    if block is None:
        scale = 448.0 / t.float().abs().amax().clamp_min(1e-12)
        return {key: (t.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn),
                key + "_scale_inv": (1.0 / scale).reshape(())}
    q, s = fp8_block_quantize(t, block)
    return {key: q, key + "_scale_inv": s}


def ct_fp8_scale(w: torch.Tensor, strategy: str, size: tuple[int, int] | int | None = None) -> torch.Tensor:
    """An absmax / 448 weight scale (bf16) of compressed-tensors' FP8 ``strategy``: ``tensor`` [1], ``channel``
    [N, 1], ``group`` [N, K / size], ``block`` [ceil(N / bn), ceil(K / bk)] (partial edge tiles)."""
    wf = w.float().abs()
    n, k = wf.shape
    if strategy == "tensor":
        s = wf.amax().reshape(1)
    elif strategy == "channel":
        s = wf.amax(1, keepdim=True)
    elif strategy == "group":
        s = wf.reshape(n, k // size, size).amax(-1)
    else:
        bn, bk = size
        p = torch.nn.functional.pad(wf, (0, -k % bk, 0, -n % bn))
        s = p.reshape(p.shape[0] // bn, bn, p.shape[1] // bk, bk).amax((1, 3))
    return (s.clamp_min(1e-8) / 448.0).to(torch.bfloat16)


def to_ct_fp8(src: str | os.PathLike, out: str | os.PathLike, strategy: str = "block",
              size: tuple[int, int] | int | None = (128, 128), ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """Write ``src`` (a bf16 checkpoint with per-expert linears on disk) as llm-compressor writes FP8 W8A16 with
    compressed-tensors: every decoder-layer linear weight (not routers, norms, embeddings or the ``ignore`` list)
    rounded by compressed-tensors' own ``quantize`` to F8_E4M3 ``weight`` + bf16 ``weight_scale``, and its
    ``QuantizationConfig`` (format ``float-quantized``) as the ``quantization_config``."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa
    from compressed_tensors.quantization.lifecycle.forward import quantize  # noqa: PLC0415

    extra = ({"block_structure": list(size)} if strategy == "block" else {"group_size": size} if strategy == "group"
             else {})
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy, **extra)

    def convert(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if (t.ndim != 2 or not key.endswith(".weight") or any(s in key for s in FP8_SKIP)
                or any(key.startswith(i + ".") for i in ignore)):
            return {key: t}
        scale = ct_fp8_scale(t, strategy, size)
        return {key: quantize(t, scale, None, args).to(torch.float8_e4m3fn), key + "_scale": scale}
    cfg = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                             format="float-quantized", ignore=[*ignore, "re:.*mlp.gate$"],
                             quantization_status="compressed")
    return rewrite(src, out, convert, cfg.model_dump(mode="json"))


def make_mxfp4_checkpoint(out: str | os.PathLike, **kw) -> Path:
    """A tiny gpt-oss checkpoint in the MXFP4 layout gpt-oss ships: each expert stack ``{gate_up,down}_proj`` (held
    by transformers as ``[E, in, out]``) as ``*_blocks`` uint8 ``[E, out, in/32, 16]`` and ``*_scales`` uint8 E8M0
    ``[E, out, in/32]``, rounded as llama.cpp's MXFP4 reference (:func:`moeq.formats.rtn.quantize_mx`); everything
    else bf16; ``quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}``."""
    import json  # noqa: PLC0415

    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    from moeq.formats.rtn import quantize_mx  # noqa: PLC0415

    out = make_checkpoint("gpt_oss", out, fused_layout=True, **kw)
    f = out / "model.safetensors"
    sd = load_file(str(f))
    new = {}
    for key, t in sd.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = t.transpose(1, 2).contiguous()  # [E, out, in]
            q = quantize_mx(w)
            e, n, k = w.shape
            new[key + "_blocks"] = q.qdata.reshape(e, n, k // 32, 16).contiguous()
            new[key + "_scales"] = q.scale.contiguous()  # E8M0 bytes
        else:
            new[key] = t
    save_file(new, str(f), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _int32(x: torch.Tensor) -> torch.Tensor:
    """int64 words below 2^32 as int32 with the same bits."""
    return torch.where(x >= 2 ** 31, x - 2 ** 32, x).to(torch.int32).contiguous()


def int_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool,
                 g_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GPTQ/AWQ-style integer quantization of ``w [N, K]`` (round to nearest, no calibration): codes ``[K, N]``,
    zero points and fp16 scales ``[G, N]``; input ``k`` in group ``g_idx[k]`` (default ``k // group_size``).
    Symmetric: zero point ``2^(bits-1)``, scale ``2 max|w| / (2^bits - 1)``; asymmetric: min/max."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    g_idx = torch.arange(k) // gs if g_idx is None else g_idx.long()
    groups = k // gs
    maxq = (1 << bits) - 1
    wt = w.float().t()  # [K, N]
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n)
    for g in range(groups):
        cols = wt[g_idx == g]
        if sym:
            s = (2 * cols.abs().amax(0) / maxq).clamp_min(1e-8)
            z = torch.full((n,), float(1 << (bits - 1)))
        else:
            lo, hi = cols.amin(0).clamp(max=0), cols.amax(0).clamp(min=0)
            s = ((hi - lo) / maxq).clamp_min(1e-8)
            z = torch.round(-lo / s).clamp(0, maxq)
        scales[g], zeros[g] = s.half().float(), z
    q = torch.clamp(torch.round(wt / scales[g_idx]) + zeros[g_idx], 0, maxq).to(torch.uint8)
    return q, zeros.to(torch.uint8), scales.half()


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, bits: int, v1: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's int32 words: codes ``[K, N]`` packed along K (code ``k = per*r + i`` at bit ``bits*i`` of row ``r``),
    zero points ``[G, N]`` along N; v1 (``checkpoint_format: "gptq"``) stores each zero point minus one."""
    per = 32 // bits
    mask = (1 << bits) - 1
    qk = q.to(torch.int64).reshape(-1, per, q.shape[1])
    qweight = sum(qk[:, i] << (bits * i) for i in range(per))
    z = zeros.to(torch.int64)
    if v1:
        z = (z - 1) & mask
    zn = z.reshape(z.shape[0], -1, per)
    qzeros = sum(zn[..., i] << (bits * i) for i in range(per))
    return _int32(qweight), _int32(qzeros)


def pack_awq(q: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's GEMM words: codes ``[K, N]`` and zero points ``[G, N]`` packed along N, nibble ``i`` of word ``j``
    holding column ``8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]``."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def words(x: torch.Tensor) -> torch.Tensor:
        xs = x.to(torch.int64).reshape(x.shape[0], -1, 8)
        return _int32(sum(xs[..., order[i]] << (4 * i) for i in range(8)))
    return words(q), words(zeros)


def to_gptq(src: str | os.PathLike, out: str | os.PathLike, kind: str = "gptq", bits: int = 4,
            group_size: int = 32, sym: bool = True, act_order: bool = False, v1: bool = True) -> Path:
    """Write ``src`` (a bf16 checkpoint with per-expert keys) in the GPTQ or AWQ (GEMM) layout: every linear of the
    decoder layers (experts included; not the embeddings, head, norms or routers) as ``qweight``/``qzeros``/
    ``scales`` (+ GPTQ's ``g_idx``; ``act_order``: inputs assigned to groups through a seeded permutation, as
    ``desc_act`` does), with the matching ``quantization_config``."""
    gen = torch.Generator().manual_seed(0)

    def convert(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if t.ndim != 2 or not key.endswith(".weight") or any(s in key for s in FP8_SKIP):
            return {key: t}
        n, k = t.shape
        gs = k if group_size == -1 else group_size
        g_idx = (torch.argsort(torch.randperm(k, generator=gen)) // gs) if act_order else torch.arange(k) // gs
        q, zeros, scales = int_quantize(t, bits, group_size, sym, g_idx)
        p = key[: -len("weight")]
        if kind == "awq":
            qweight, qzeros = pack_awq(q, zeros)
            return {p + "qweight": qweight, p + "qzeros": qzeros, p + "scales": scales}
        qweight, qzeros = pack_gptq(q, zeros, bits, v1)
        return {p + "qweight": qweight, p + "qzeros": qzeros, p + "scales": scales, p + "g_idx": g_idx.to(torch.int32)}
    if kind == "awq":
        qc = {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True, "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": act_order,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    return rewrite(src, out, convert, qc)
