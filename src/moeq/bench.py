"""``moeq bench``: one process, one model, side by side — transformers bf16, transformers + bitsandbytes NF4, and moeq
presets — decode tok/s at batch 1/4/16, prefill tok/s, resident bytes, peak RSS, load seconds, and each moeq
config's roofline (measured memory bandwidth / weight bytes read per decoded token)."""
from __future__ import annotations

import gc
import json
import logging
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from moeq.errors import MoeqError
from moeq.native import pages

log = logging.getLogger(__name__)

# Qwen3-30B-A3B's exact layer shapes, cut to a few layers (the benchmark model).
QWEN3_30B_A3B = dict(hidden=2048, experts=128, top_k=8, moe_inter=768, heads=32, kv_heads=4, head_dim=128,
                     vocab=151936)


NAMED_METHODS = ("q4_0", "iq4nl", "iq4nl-dq", "nl3", "nl2", "q8_0", "fp8", "mxfp4")  # as `moeq METHOD` systems


def _presets(group_size: int = 128):
    import moeq  # noqa: PLC0415

    gs = group_size
    return {
        "moeq rtn-int4": moeq.QuantConfig(moeq.RTN(4, gs), rules={"lm_head": moeq.RTN(8, gs)}),
        "moeq rtn-int8": moeq.QuantConfig(moeq.RTN(8, gs), rules={"lm_head": moeq.RTN(8, gs)}),
        "moeq nf4": moeq.QuantConfig(moeq.NF4(), rules={"lm_head": moeq.RTN(8, gs)}),
        **{f"moeq {m}": moeq.QuantConfig(moeq.config.method(m), rules={"lm_head": moeq.RTN(8, gs)})
           for m in NAMED_METHODS},
    }


def write_model(out: Path, layers: int = 4, shape: dict = QWEN3_30B_A3B, seed: int = 0, fp8: bool = False) -> Path:
    """The benchmark checkpoint (random bf16, Qwen3-MoE format), written once, deterministically. ``fp8``: the same
    weights as the FP8 releases ship them (DeepSeek's layout, e4m3 + 128x128 block scales, as Qwen3-30B-A3B-FP8),
    half the disk."""
    from safetensors.torch import save_file  # noqa: PLC0415

    if (out / "done").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    s = shape
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": s["hidden"],
           "intermediate_size": 6144, "moe_intermediate_size": s["moe_inter"], "num_experts": s["experts"],
           "num_experts_per_tok": s["top_k"], "num_hidden_layers": layers, "num_attention_heads": s["heads"],
           "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "vocab_size": s["vocab"],
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "norm_topk_prob": True,
           "tie_word_embeddings": False, "dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": [],
           "rope_theta": 1000000.0}
    g = torch.Generator().manual_seed(seed)

    def rnd(*shp):
        return (torch.randn(*shp, generator=g) * 0.02).to(torch.bfloat16)

    h, e, i, hd = s["hidden"], s["experts"], s["moe_inter"], s["head_dim"]
    names = {}
    for li in range(layers):
        p = f"model.layers.{li}."
        shard = {p + "self_attn.q_proj.weight": rnd(s["heads"] * hd, h),
                 p + "self_attn.k_proj.weight": rnd(s["kv_heads"] * hd, h),
                 p + "self_attn.v_proj.weight": rnd(s["kv_heads"] * hd, h),
                 p + "self_attn.o_proj.weight": rnd(h, s["heads"] * hd),
                 p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
                 p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
                 p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                 p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                 p + "mlp.gate.weight": rnd(e, h)}
        for x in range(e):
            shard[p + f"mlp.experts.{x}.gate_proj.weight"] = rnd(i, h)
            shard[p + f"mlp.experts.{x}.up_proj.weight"] = rnd(i, h)
            shard[p + f"mlp.experts.{x}.down_proj.weight"] = rnd(h, i)
        if fp8:
            from moeq.tiny import fp8_tensors  # noqa: PLC0415

            shard = {k: v.contiguous() for key, t in shard.items() for k, v in fp8_tensors(key, t).items()}
        fname = f"model-layer{li:03d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        names.update({k: fname for k in shard})
    shard = {"model.embed_tokens.weight": rnd(s["vocab"], h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
             "lm_head.weight": rnd(s["vocab"], h)}
    save_file(shard, str(out / "model-embed.safetensors"), metadata={"format": "pt"})
    names.update({k: "model-embed.safetensors" for k in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    if fp8:
        from moeq.tiny import fp8_quantization_config  # noqa: PLC0415

        cfg["quantization_config"] = fp8_quantization_config()
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "done").write_text("ok")
    return out


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # noqa: PLC0415

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_parts() -> dict[str, int]:
    """Resident bytes now, split as the kernel counts them: ``anon`` (the process's own memory, which must fit in
    RAM) and ``file`` (pages of memory-mapped files, which the kernel drops and re-reads under pressure)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key = {"RssAnon:": "anon", "RssFile:": "file"}.get(line.split(" ")[0].split("\t")[0])
            if key:
                out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def memory_bandwidth(gb: float = 1.0, repeat: int = 5) -> float:
    """Read bandwidth in bytes/s: best of a few sums over a buffer far larger than the caches, on 2 MB pages where
    the kernel gives them, as moeq's weights are (:mod:`moeq.native.pages`)."""
    x = pages.empty((int(gb * 1e9) // 4,), torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def cpu_summary() -> dict:
    """The CPU the numbers were measured on (model name and the vector extensions moeq's kernels care about): these
    machines differ from day to day (AVX512-BF16 Zen 4, Sapphire Rapids with AMX, AVX2-only Zen 3)."""
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == "unknown":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "bmi2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512vbmi", "avx_vnni",
              "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
    return {"model": name, "flags": [f for f in wanted if f in flags]}


def model_bytes(model: nn.Module) -> tuple[int, int]:
    """(whole model, decoder layers) resident bytes of parameters and buffers."""
    total = layers = 0
    seen = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type == "meta" or id(t) in seen:
            continue
        seen.add(id(t))
        nb = t.numel() * t.element_size()
        total += nb
        if ".layers." in name:
            layers += nb
    return total, layers


def bytes_per_token(model: nn.Module, top_k: int, bf12_as_bf16: bool = False) -> float:
    """Weight bytes a decoded token reads: every non-expert 2-D weight except the embedding table (one row), plus
    top_k experts of each experts module (quantized or not). ``bf12_as_bf16``: a head moeq holds in bf12 counted at
    its bf16 size (what an engine reading the same bf16 weights from a GGUF reads)."""
    from moeq.nn import QuantExperts  # noqa: PLC0415
    from moeq.nn.bf12 import Bf12Linear  # noqa: PLC0415

    total = 0.0
    for name, mod in model.named_modules():
        if isinstance(mod, Bf12Linear) and bf12_as_bf16:
            total += mod.in_features * mod.out_features * 2
            continue
        if isinstance(mod, QuantExperts):
            total += (mod.packed("w13", raw=True).nbytes + mod.packed("w2", raw=True).nbytes) * top_k / mod.num_experts
            continue
        if name.endswith("experts") and hasattr(mod, "gate_up_proj"):
            per = sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
            total += per * top_k / mod.gate_up_proj.shape[0]
            continue
        if "experts" in name:
            continue
        for _, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            if "embed" in name:
                continue
            total += t.numel() * t.element_size()
    emb = model.get_input_embeddings().weight
    return total + emb.shape[1] * emb.element_size()


def best_seconds(fn, reps: int, warmup: int = 0) -> float:
    """Fastest of ``reps`` timed runs (after ``warmup`` untimed ones): these machines are shared, and interference only
    ever adds time."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _id_bound(model: nn.Module) -> int:
    return min(1000, model.config.get_text_config().vocab_size)


@torch.no_grad()
def decode_tps(model: nn.Module, batch: int, prompt: int = 32, new: int = 128, reps: int = 3) -> float:
    """Decode tokens/s: (time of ``new`` tokens - time of 1 token, i.e. the prompt) per decoded token, best of
    ``reps``."""
    ids = torch.randint(0, _id_bound(model), (batch, prompt), generator=torch.Generator().manual_seed(batch))
    kw = dict(do_sample=False, pad_token_id=0)
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
    first = best_seconds(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw), reps)
    full = best_seconds(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw), reps)
    return batch * (new - 1) / max(full - first, 1e-9)


@torch.no_grad()
def prefill_seconds(model: nn.Module, length: int, all_logits: bool) -> float:
    """One forward over a ``length``-token prompt. ``all_logits=False`` is what ``generate`` runs (logits of the last
    position only: the time to the first token); ``True`` also computes the other positions' logits (scoring)."""
    ids = torch.randint(0, _id_bound(model), (1, length), generator=torch.Generator().manual_seed(length))
    kw = {} if all_logits else {"logits_to_keep": 1}
    t0 = time.perf_counter()
    model(ids, **kw)
    return time.perf_counter() - t0


def paired_prefill(models: dict[str, nn.Module], lengths,
                   reps: int | None = None) -> dict[str, dict[str, float | list[float]]]:
    """Prefill of several models measured in alternation (A B A B ...), ``reps`` rounds (default 5 up to 1024
    tokens, 3 beyond). Per model: tok/s of its best round, and the seconds of every round (``..._seconds``), so callers
    can take ratios within a round: slow phases of a shared machine then hit both sides of each ratio alike."""
    out: dict[str, dict] = {name: {} for name in models}
    for n in lengths:
        for all_logits in (False, True):
            key = f"prefill{'_all_logits' if all_logits else ''}_tps_{n}"
            for m in models.values():
                prefill_seconds(m, 16, all_logits)  # warm-up
            secs: dict[str, list[float]] = {name: [] for name in models}
            for _ in range(reps or (5 if n <= 1024 else 3)):
                for name, m in models.items():
                    secs[name].append(prefill_seconds(m, n, all_logits))
            for name in models:
                out[name][key] = n / min(secs[name])
                out[name][key.replace("_tps_", "_seconds_")] = secs[name]
                log.info("%s %s: %.1f tok/s", name, key, out[name][key])
    return out


def _load_system(sysname: str, ckpt: Path, presets: dict) -> nn.Module:
    import moeq  # noqa: PLC0415

    if sysname == "transformers bf16":
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    if sysname == "transformers+bnb nf4":
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: PLC0415

        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=torch.bfloat16)
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, quantization_config=bnb).eval()
    return moeq.load(ckpt, quant=presets[sysname], progress=False)


BASELINE = "transformers bf16"


def run(ckpt: Path, systems: list[str], batches=(1, 4, 16), prefills=(512, 2048), new_tokens: int = 128,
        top_k: int = 8, group_size: int = 128) -> dict:
    """Phase 1, one system at a time (so peak RSS is its own): load seconds, bytes, decode tok/s, with a bandwidth
    probe just before and after its batch-1 decode for its roofline. Phase 2: prefill of every system in alternation
    with transformers bf16 (both resident), so prefill ratios come from paired measurements."""
    presets = _presets(group_size)
    valid = [BASELINE, "transformers+bnb nf4", *presets]
    bad = [s for s in systems if s not in valid]
    if bad:
        raise MoeqError(f"unknown system(s) {', '.join(map(repr, bad))}; valid: {', '.join(valid)}")
    results = {"checkpoint": str(ckpt), "threads": torch.get_num_threads(), "systems": []}
    for sysname in systems:
        gc.collect()
        reset_peak_rss()
        t0 = time.perf_counter()
        model = _load_system(sysname, ckpt, presets)
        load_s = time.perf_counter() - t0
        total, layers = model_bytes(model)
        row = {"system": sysname, "load_seconds": load_s, "model_bytes": total, "layer_bytes": layers}
        bw = memory_bandwidth()
        for b in batches:
            row[f"decode_tps_b{b}"] = decode_tps(model, b, new=new_tokens)
            log.info("%s decode b%d: %.2f tok/s", sysname, b, row[f"decode_tps_b{b}"])
            if b == 1:
                bw = max(bw, memory_bandwidth())
        k = getattr(model.config.get_text_config(), "num_experts_per_tok", None) or top_k
        bpt = bytes_per_token(model, k)
        row["memory_bandwidth_gbps"] = bw / 1e9
        row["bytes_per_token"] = bpt
        row["roofline_tps"] = bw / bpt
        row["roofline_fraction_b1"] = row["decode_tps_b1"] / row["roofline_tps"]
        row["peak_rss_bytes"] = peak_rss()
        results["systems"].append(row)
        del model
    results["memory_bandwidth_gbps"] = max(r["memory_bandwidth_gbps"] for r in results["systems"])
    if prefills:
        _prefill_phase(results, ckpt, presets, prefills)
    base = next((r for r in results["systems"] if r["system"] == BASELINE), None)
    if base:
        for r in results["systems"]:
            r["decode_b1_vs_bf16"] = r["decode_tps_b1"] / base["decode_tps_b1"]
            r["layer_bytes_vs_bf16"] = r["layer_bytes"] / base["layer_bytes"]
    return results


def _prefill_phase(results: dict, ckpt: Path, presets: dict, prefills) -> None:
    """Prefill of every system, each alternating with transformers bf16 when it is among them (kept loaded)."""
    rows = {r["system"]: r for r in results["systems"]}
    gc.collect()
    base = _load_system(BASELINE, ckpt, presets) if BASELINE in rows else None
    base_runs = []
    for name in (n for n in rows if n != BASELINE):
        gc.collect()
        models = ({BASELINE: base} if base is not None else {}) | {name: _load_system(name, ckpt, presets)}
        got = paired_prefill(models, prefills)
        del models
        rows[name].update(got[name])
        if base is None:
            continue
        base_runs.append(got[BASELINE])
        for key in (k for k in got[name] if "_seconds_" in k):
            # the ratio: median over rounds of bf16 seconds / this system's seconds, each from adjacent runs
            rows[name][key.replace("_seconds_", "_vs_bf16_")] = statistics.median(
                b / a for a, b in zip(got[name][key], got[BASELINE][key]))
    if base is not None:
        base_runs = base_runs or [paired_prefill({BASELINE: base}, prefills)[BASELINE]]
        for key in (k for k in base_runs[0] if "_tps_" in k):
            rows[BASELINE][key] = max(run[key] for run in base_runs)
            rows[BASELINE][key.replace("_tps_", "_vs_bf16_")] = 1.0
    del base


def table(results: dict) -> str:
    rows = results["systems"]
    bs = sorted({int(k.split("_b")[1]) for r in rows for k in r if k.startswith("decode_tps_b")})
    ps = sorted({int(k.rsplit("_", 1)[1]) for r in rows for k in r if k.startswith("prefill_tps_")})
    paired = any(k.startswith("prefill_vs_bf16_") for r in rows for k in r)
    head = (["system"] + [f"decode b{b} tok/s" for b in bs] + [f"prefill {p} tok/s" for p in ps]
            + ([f"prefill {p} × bf16" for p in ps] + [f"all-logits {p} × bf16" for p in ps] if paired else [])
            + ["decode b1 × bf16", "bandwidth GB/s", "roofline tok/s", "of roofline", "layers GB", "model GB",
               "peak RSS GB", "load s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["system"]] + [f"{r[f'decode_tps_b{b}']:.1f}" for b in bs]
        cells += [f"{r[f'prefill_tps_{p}']:.0f}" for p in ps]
        if paired:
            cells += [f"{r.get(f'prefill_vs_bf16_{p}', float('nan')):.2f}" for p in ps]
            cells += [f"{r.get(f'prefill_all_logits_vs_bf16_{p}', float('nan')):.2f}" for p in ps]
        cells += [f"{r.get('decode_b1_vs_bf16', float('nan')):.2f}", f"{r['memory_bandwidth_gbps']:.1f}",
                  f"{r['roofline_tps']:.1f}", f"{r['roofline_fraction_b1']:.0%}", f"{r['layer_bytes'] / 1e9:.2f}",
                  f"{r['model_bytes'] / 1e9:.2f}", f"{r['peak_rss_bytes'] / 1e9:.2f}", f"{r['load_seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + (
        "\n\nbandwidth: the best of probes just before and after each system's batch-1 decode (its roofline's); "
        "prefill = time to the first token (last-position logits, as generate runs it), best round; × bf16 columns: "
        "median over rounds of transformers bf16's seconds / the system's, the two run back to back in each round")
