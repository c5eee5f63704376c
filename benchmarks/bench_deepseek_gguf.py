"""DeepSeek-V3's FP8 release to a llama.cpp GGUF in one streamed command, at DeepSeek-V3's real layer shapes (hidden
7168, 256 routed experts of 2048 + one shared, MLA with q_lora 1536 / kv_lora 512, 128 heads, vocab 129280, YaRN,
sigmoid router with 8 groups) — the conversion llama.cpp users do today through a ~1.3 TB bf16 copy. Kimi K2 has the
same layout (384 experts).

Steps, each in a fresh process (peak RSS from the kernel's VmHWM):
1. source — random weights in the layout DeepSeek ships (e4m3 + 128x128 ``weight_scale_inv`` tiles for every
   decoder linear, router and norms bf16, ``e_score_correction_bias`` fp32), sharded, one dense layer then MoE layers
   (``--layers``, scaled down to the free disk; the release has 3 dense + 58 MoE layers and a NextN layer).
2. ``moeq.export.export_checkpoint(SOURCE, OUT.gguf, "gguf", quant="q4_0")`` — what ``moeq export SOURCE OUT.gguf
   --format gguf --method q4_0`` runs: seconds, source GB/s, peak RSS, tensors decoded back by gguf-py.
3. llama.cpp's ``llama-bench`` runs the file (``-p 64 -n 16``: proof it loads and computes at these shapes), and moeq
   loads it back and decodes (tok/s).

    python benchmarks/bench_deepseek_gguf.py --out benchmarks/results/deepseek_gguf.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_full_depth import QUANTIZE, child  # noqa: E402
from llamacpp import build_flags, find_tool  # noqa: E402

from moeq import bench  # noqa: E402

GB = 1e9
DSV3 = dict(hidden=7168, inter=18432, moe_inter=2048, experts=256, heads=128, q_lora=1536, kv_lora=512, nope=128,
            rope=64, v=128, vocab=129280)
SOURCE = {"dense": 0.59 * GB, "moe": 11.6 * GB, "fixed": 3.71 * GB}  # FP8 bytes; bf16 embeddings + head
GGUF = {"dense": 0.34 * GB, "moe": 6.6 * GB, "fixed": 3.71 * GB}
MARGIN = 6 * GB

WRITE = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from moeq.tiny import fp8_quantization_config, fp8_tensors, tiny_tokenizer
out, layers, s = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
g = torch.Generator().manual_seed(0)
rnd = lambda *shp: (torch.randn(*shp, generator=g) * 0.02).to(torch.bfloat16)
ones = lambda n: torch.ones(n, dtype=torch.bfloat16)
names = {}
def save(name, shard):
    shard = {k: v.contiguous() for key, t in shard.items() for k, v in fp8_tensors(key, t).items()}
    save_file(shard, str(out / name), metadata={"format": "pt"})
    names.update({k: name for k in shard})
h, hd = s["hidden"], s["nope"] + s["rope"]
for li in range(layers):
    p = f"model.layers.{li}."
    shard = {p + "self_attn.q_a_proj.weight": rnd(s["q_lora"], h), p + "self_attn.q_a_layernorm.weight": ones(s["q_lora"]),
             p + "self_attn.q_b_proj.weight": rnd(s["heads"] * hd, s["q_lora"]),
             p + "self_attn.kv_a_proj_with_mqa.weight": rnd(s["kv_lora"] + s["rope"], h),
             p + "self_attn.kv_a_layernorm.weight": ones(s["kv_lora"]),
             p + "self_attn.kv_b_proj.weight": rnd(s["heads"] * (s["nope"] + s["v"]), s["kv_lora"]),
             p + "self_attn.o_proj.weight": rnd(h, s["heads"] * s["v"]),
             p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h)}
    if li == 0:
        shard.update({p + "mlp.gate_proj.weight": rnd(s["inter"], h), p + "mlp.up_proj.weight": rnd(s["inter"], h),
                      p + "mlp.down_proj.weight": rnd(h, s["inter"])})
        save(f"model-{li:02d}-attn.safetensors", shard)
        continue
    i = s["moe_inter"]
    shard.update({p + "mlp.gate.weight": rnd(s["experts"], h),
                  p + "mlp.shared_experts.gate_proj.weight": rnd(i, h), p + "mlp.shared_experts.up_proj.weight": rnd(i, h),
                  p + "mlp.shared_experts.down_proj.weight": rnd(h, i)})
    save(f"model-{li:02d}-attn.safetensors", shard)
    save_file({p + "mlp.gate.e_score_correction_bias": torch.randn(s["experts"], generator=g) * 0.01},
              str(out / f"model-{li:02d}-bias.safetensors"), metadata={"format": "pt"})
    names[p + "mlp.gate.e_score_correction_bias"] = f"model-{li:02d}-bias.safetensors"
    for c in range(0, s["experts"], 32):  # 32 experts a shard (~1.4 GB), as the release shards them
        save(f"model-{li:02d}-experts{c:03d}.safetensors",
             {p + f"mlp.experts.{e}.{k}.weight": rnd(*((i, h) if k != "down_proj" else (h, i)))
              for e in range(c, c + 32) for k in ("gate_proj", "up_proj", "down_proj")})
save_file({"model.embed_tokens.weight": rnd(s["vocab"], h), "model.norm.weight": ones(h),
           "lm_head.weight": rnd(s["vocab"], h)}, str(out / "model-embed.safetensors"), metadata={"format": "pt"})
names.update({k: "model-embed.safetensors" for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")})
(out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": h,
       "intermediate_size": s["inter"], "moe_intermediate_size": s["moe_inter"], "n_routed_experts": s["experts"],
       "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
       "norm_topk_prob": True, "first_k_dense_replace": 1, "num_hidden_layers": layers,
       "num_attention_heads": s["heads"], "num_key_value_heads": s["heads"], "q_lora_rank": s["q_lora"],
       "kv_lora_rank": s["kv_lora"], "qk_nope_head_dim": s["nope"], "qk_rope_head_dim": s["rope"],
       "v_head_dim": s["v"], "vocab_size": s["vocab"], "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
       "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
       "hidden_act": "silu", "tie_word_embeddings": False, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
       "quantization_config": fp8_quantization_config()}
(out / "config.json").write_text(json.dumps(cfg, indent=1))
tiny_tokenizer().save_pretrained(out)  # random weights: a byte-level tokenizer (the GGUF pads its vocabulary)
(out / "done").write_text("ok")
print(json.dumps({}))
"""

MOEQ = r"""
import json, sys, time, torch
import moeq
from moeq import bench
t = time.perf_counter()
m = moeq.load(sys.argv[1], progress=False)
load_s = time.perf_counter() - t
ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(0))
t = time.perf_counter()
out = m.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
ttft = time.perf_counter() - t
print(json.dumps({"load_seconds": load_s, "first_token_seconds": ttft,
                  "decode_tps": bench.decode_tps(m, 1, prompt=32, new=16, reps=1), "peak_rss_bytes": bench.peak_rss()}))
"""


def layers_that_fit(folder: Path, want: int) -> int:
    free = shutil.disk_usage(folder).free - MARGIN - SOURCE["fixed"] - GGUF["fixed"] - SOURCE["dense"] - GGUF["dense"]
    return max(2, min(want, 1 + int(free // (SOURCE["moe"] + GGUF["moe"]))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2, help="1 dense + (layers - 1) MoE layers")
    ap.add_argument("--method", default="q4_0")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "moeq-bench"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "deepseek_gguf.json"))
    args = ap.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    layers = layers_that_fit(cache, args.layers)
    note = "" if layers == args.layers else f"scaled down from {args.layers} to {layers} layers (free disk)"
    src, gguf = cache / f"deepseek-v3-fp8-{layers}L", cache / f"deepseek-v3-{layers}L-{args.method}.gguf"
    result = {"cpu": bench.cpu_summary(), "threads": args.threads, "layers": layers, "note": note,
              "shape": DSV3, "method": args.method, "date": time.strftime("%Y-%m-%d"), "steps": {}}
    t = time.perf_counter()
    child(WRITE, str(src), str(layers), json.dumps(DSV3))
    result["steps"]["source"] = {"seconds": time.perf_counter() - t,
                                 "bytes": sum(f.stat().st_size for f in src.glob("*.safetensors"))}
    print(json.dumps(result["steps"]["source"]), flush=True)
    try:
        result["steps"]["quantize_export"] = child(QUANTIZE, str(src), str(gguf), args.method)
    finally:
        shutil.rmtree(src)  # written by this script
    result["steps"]["quantize_export"]["gguf_bytes"] = gguf.stat().st_size
    print(json.dumps(result["steps"]["quantize_export"]), flush=True)
    exe = find_tool("llama-bench")
    try:
        if exe is not None:
            out = subprocess.run([str(exe), "-m", str(gguf), "-t", str(args.threads), "-p", "64", "-n", "16", "-r",
                                  "1", "-o", "json"], capture_output=True, text=True, check=True, timeout=3600).stdout
            got = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in json.loads(out)}
            result["llama.cpp"] = {"build": build_flags(exe), "decode_tps": got[(0, 16)], "prefill64_tps": got[(64, 0)]}
            print(json.dumps(result["llama.cpp"]), flush=True)
        result["moeq"] = child(MOEQ, str(gguf))
        print(json.dumps(result["moeq"]), flush=True)
    finally:
        gguf.unlink()  # written by this script
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
