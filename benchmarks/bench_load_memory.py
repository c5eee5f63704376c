"""Peak RSS of streaming in-flight quantization vs the issue's bound:
    peak RSS <= final quantized model bytes + 2 x largest checkpoint tensor + 1.5 GB
on a Qwen3-30B-A3B-shaped checkpoint (hidden 2048, 128 experts, moe_intermediate 768) cut to N layers, whose bf16
size exceeds that bound several times over. The checkpoint is written once (random weights, sharded, streamed to
disk shard by shard) into a cache dir. The load runs in a child process so its peak RSS is its own.

    python benchmarks/bench_load_memory.py [--layers 12] [--method rtn-int4] [--cache ~/.cache/moeq-bench]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

H, E, I, VOCAB, HEADS, KV, HD = 2048, 128, 768, 32000, 32, 4, 128


def config(layers: int) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
            "intermediate_size": 6144, "moe_intermediate_size": I, "num_experts": E, "num_experts_per_tok": 8,
            "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
            "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "norm_topk_prob": True,
            "tie_word_embeddings": False, "dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": []}


def tensors(layers: int):
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    yield "model.embed_tokens.weight", rnd(VOCAB, H)
    for li in range(layers):
        p = f"model.layers.{li}."
        yield p + "self_attn.q_proj.weight", rnd(HEADS * HD, H)
        yield p + "self_attn.k_proj.weight", rnd(KV * HD, H)
        yield p + "self_attn.v_proj.weight", rnd(KV * HD, H)
        yield p + "self_attn.o_proj.weight", rnd(H, HEADS * HD)
        yield p + "self_attn.q_norm.weight", torch.ones(HD, dtype=torch.bfloat16)
        yield p + "self_attn.k_norm.weight", torch.ones(HD, dtype=torch.bfloat16)
        yield p + "input_layernorm.weight", torch.ones(H, dtype=torch.bfloat16)
        yield p + "post_attention_layernorm.weight", torch.ones(H, dtype=torch.bfloat16)
        yield p + "mlp.gate.weight", rnd(E, H)
        for e in range(E):
            yield p + f"mlp.experts.{e}.gate_proj.weight", rnd(I, H)
            yield p + f"mlp.experts.{e}.up_proj.weight", rnd(I, H)
            yield p + f"mlp.experts.{e}.down_proj.weight", rnd(H, I)
    yield "model.norm.weight", torch.ones(H, dtype=torch.bfloat16)
    yield "lm_head.weight", rnd(VOCAB, H)


def write_checkpoint(out: Path, layers: int, shard_bytes: int = 1 << 30) -> None:
    if (out / "done").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    shard, size, n, weight_map = {}, 0, 0, {}

    def flush():
        nonlocal shard, size, n
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, size, n = {}, 0, n + 1

    for k, t in tensors(layers):
        if size + t.numel() * 2 > shard_bytes and shard:
            flush()
        shard[k] = t
        size += t.numel() * 2
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config(layers)))
    (out / "done").write_text("ok")


CHILD = """
import json, sys, time, torch, moeq
from moeq.io.safetensors_io import Checkpoint
t0 = time.perf_counter()
m = moeq.load(sys.argv[1], quant=sys.argv[2], progress=False)
secs = time.perf_counter() - t0
info = moeq.inspect(m)
ck = Checkpoint(sys.argv[1])
print(json.dumps({"seconds": secs, "model_bytes": info["total_bytes"],
                  "checkpoint_bytes": sum(i.nbytes for i in ck.tensors.values()),
                  "largest_tensor_bytes": max(i.nbytes for i in ck.tensors.values())}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--method", default="rtn-int4")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/moeq-bench"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "load_memory.json"))
    args = ap.parse_args()
    ck = Path(args.cache) / f"qwen3moe-shape-{args.layers}L"
    t0 = time.perf_counter()
    write_checkpoint(ck, args.layers)
    gen_s = time.perf_counter() - t0
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ck), args.method], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    bound = res["model_bytes"] + 2 * res["largest_tensor_bytes"] + 1.5e9
    res.update(method=args.method, layers=args.layers, peak_rss_bytes=peak, bound_bytes=bound,
               within_bound=peak <= bound, checkpoint_over_bound=res["checkpoint_bytes"] / bound,
               load_gbps=res["checkpoint_bytes"] / res["seconds"] / 1e9, generate_seconds=gen_s)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("| method | bf16 checkpoint | quantized model | largest tensor | bound | peak RSS | within | load |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.method} | {res['checkpoint_bytes'] / 1e9:.2f} GB | {res['model_bytes'] / 1e9:.2f} GB | "
          f"{res['largest_tensor_bytes'] / 1e9:.3f} GB | {bound / 1e9:.2f} GB | {peak / 1e9:.2f} GB | "
          f"{'yes' if res['within_bound'] else 'NO'} ({res['checkpoint_over_bound']:.1f}x bound on disk) | "
          f"{res['seconds']:.0f} s ({res['load_gbps']:.2f} GB/s) |")


if __name__ == "__main__":
    main()
