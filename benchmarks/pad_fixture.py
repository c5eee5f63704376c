"""A second real-weights fixture whose widths are multiples of 256 (issue #20's 3-bit and K-quant rows): the
MoEfied SmolLM2 of ../shared/fixtures with its hidden size zero-padded 576 -> 768 and each expert 192 -> 256 rows.

The padded model computes the same function up to one bf16 rounding of the norm weights: padded channels are zero
everywhere (embeddings, every projection's extra rows and columns, norm weights), an RMSNorm over 768 channels of
which 192 are zero sees mean(x^2) * 576/768, so its weights are scaled by sqrt(576/768) and its eps by 576/768, and
the experts' extra neurons have zero gate, up and down weights (SiLU(0) * 0 = 0). Attention keeps its 9 x 64 heads
(q/k/v now read 768 inputs; o_proj's 576 inputs stay: llama.cpp keeps a fallback type there). The real weights are
untouched, so every quantizer sees them in blocks aligned as llama.cpp's 256-element super-blocks need.

    python benchmarks/pad_fixture.py /tmp/fx/smollm2-moe /tmp/fx/smollm2-moe-768
"""
from __future__ import annotations

import argparse
import math
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def pad(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros(shape, dtype=t.dtype)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--expert", type=int, default=256)
    args = ap.parse_args()
    src, out = Path(args.src), Path(args.out)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    cfg = AutoConfig.from_pretrained(src)
    h0, i0, h, i = cfg.hidden_size, cfg.intermediate_size, args.hidden, args.expert
    ratio = h0 / h
    sd = model.state_dict()
    new = {}
    for name, t in sd.items():
        if name.endswith("norm.weight"):  # RMSNorm over the padded width: weights scaled by sqrt(h0/h)
            new[name] = pad((t.float() * math.sqrt(ratio)).to(t.dtype), (h,))
        elif t.dim() == 2 and name.endswith(("embed_tokens.weight", "lm_head.weight")):
            new[name] = pad(t, (t.shape[0], h))
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            new[name] = pad(t, (t.shape[0], h))
        elif name.endswith("o_proj.weight"):
            new[name] = pad(t, (h, t.shape[1]))
        elif name.endswith("gate.weight") and t.dim() == 2 and t.shape[1] == h0:  # the router
            new[name] = pad(t, (t.shape[0], h))
        elif "experts" in name and t.dim() == 3:  # fused [E, 2I, H] gate_up / [E, H, I] down
            if t.shape[1] == 2 * i0:
                g, u = t[:, :i0], t[:, i0:]
                new[name] = torch.cat([pad(g, (t.shape[0], i, h)), pad(u, (t.shape[0], i, h))], dim=1)
            else:
                new[name] = pad(t, (t.shape[0], h, i))
        else:
            raise SystemExit(f"unhandled tensor {name} {tuple(t.shape)}")
    cfg.hidden_size, cfg.intermediate_size = h, i
    cfg.rms_norm_eps = cfg.rms_norm_eps * ratio
    padded = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = padded.load_state_dict(new, strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise SystemExit(f"state mismatch: missing {missing}, unexpected {unexpected}")
    padded.tie_weights()
    padded.save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    with torch.no_grad():
        ids = torch.arange(3, 67)[None]
        a, b = model(ids).logits.float(), padded(ids).logits.float()
    print(f"wrote {out}: logits max |diff| {float((a - b).abs().max()):.4f} of max |logit| {float(a.abs().max()):.2f}")


if __name__ == "__main__":
    main()
