"""Tiny random checkpoints of every supported MoE family, written with transformers' own ``save_pretrained`` (so
their on-disk layout is the real one), plus a small byte-level BPE tokenizer trained offline. Used by the demo,
the tests and the benchmarks; nothing here touches the network."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
from moeq.errors import MoeqError

VOCAB = 384
_COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, tie_word_embeddings=False)
TINY: dict[str, dict] = {
    "mixtral": dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                      num_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(intermediate_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                      head_dim=32),
    "olmoe": dict(intermediate_size=128, num_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(intermediate_size=256, moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=128,
                        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, n_group=1, topk_group=1),
    "phimoe": dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
    "jamba": dict(intermediate_size=128, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                  attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0, mamba_d_state=8,
                  mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False),
    "llama4_text": dict(intermediate_size=128, intermediate_size_mlp=256, num_local_experts=4, num_experts_per_tok=1,
                        head_dim=32, interleave_moe_layer_step=1),
    "gpt_oss": dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, head_dim=32,
                    sliding_window=64, layer_types=["sliding_attention", "full_attention"]),
}
DENSE: dict[str, dict] = {"llama": dict(intermediate_size=256)}  # dense families: linears only

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
