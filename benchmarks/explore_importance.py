"""Where data-free importance comes from and how the search should use it (the study behind ``moeq.importance``).

On the MoEfied SmolLM2 fixture (../shared/fixtures), attention and experts fake-quantized with iq4nl (group 32,
search 7) and scored on held-out text against the bf16 model. The per-column statistic ``E[x^2]`` (per expert for
experts: the routed tokens' inputs for gate/up, ``act(gate) * up`` for down) is measured from:
  - calibration text (the novels' first 90%, as llama-imatrix is fed in bench_accuracy),
  - uniformly random token ids (seeded),
  - text the model samples itself from BOS,
  - random token ids through a q4_0 copy of the model (what ``moeq.load(importance=...)`` does: its first pass);
and weighs the search either on its own (``mse`` x importance) or on top of moeq's default per-weight weighting
(``row``: sigma^2 + x^2; ``x2``). Writes benchmarks/results/explore_importance.json.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from bench_accuracy import DATA, _cpu, calibration_text, heldout_text  # noqa: E402

from moeq.eval import evaluate_many, tokenize  # noqa: E402
from moeq.formats import rtn  # noqa: E402
from moeq.io.writer import write_json  # noqa: E402


def fake(w: torch.Tensor, imp: torch.Tensor | None, weighting: str, grid: str = "iq4nl") -> torch.Tensor:
    if grid == "signed":
        q = rtn.quantize(w.float(), 4, 32, True, "signed")
    else:
        q = rtn.quantize(w.float(), 4, 32, True, grid, search=7, weighting=weighting if imp is not None else "row",
                         importance=imp)
    return q.dequantize(torch.float32).to(w.dtype)


@torch.no_grad()
def collect(model, seqs: torch.Tensor) -> list[dict]:
    """Per decoder layer: attention input, o_proj input, experts' inputs [E, H] and activations [E, I]."""
    top_k = model.config.num_experts_per_tok
    stats = [{"attn": 0, "o": 0, "in": None, "mid": None} for _ in model.model.layers]
    hooks = []
    for st, layer in zip(stats, model.model.layers):
        def pre_attn(mod, args, kwargs, st=st):
            x = kwargs.get("hidden_states", args[0] if args else None).float()
            st["attn"] = st["attn"] + (x.reshape(-1, x.shape[-1]) ** 2).sum(0)

        def pre_o(mod, args, st=st):
            st["o"] = st["o"] + (args[0].float().reshape(-1, args[0].shape[-1]) ** 2).sum(0)

        def pre_mlp(mod, args, st=st, layer=layer):
            x = args[0].float().reshape(-1, args[0].shape[-1])
            idx = layer.mlp.gate(args[0].reshape(-1, args[0].shape[-1]))[2]
            gu = layer.mlp.experts.gate_up_proj.float()
            n = gu.shape[1] // 2
            if st["in"] is None:
                st["in"], st["mid"] = torch.zeros(gu.shape[0], x.shape[1]), torch.zeros(gu.shape[0], n)
            for e in range(gu.shape[0]):
                xe = x[(idx == e).any(-1)]
                h = F.linear(xe, gu[e])
                st["in"][e] += (xe ** 2).sum(0)
                st["mid"][e] += ((F.silu(h[:, :n]) * h[:, n:]) ** 2).sum(0)
        hooks += [layer.self_attn.register_forward_pre_hook(pre_attn, with_kwargs=True),
                  layer.self_attn.o_proj.register_forward_pre_hook(pre_o),
                  layer.mlp.register_forward_pre_hook(pre_mlp)]
    assert top_k >= 1
    for s in seqs:
        model(s[None])
    for h in hooks:
        h.remove()
    return stats


def build(ref, stats: list[dict] | None, weighting: str, grid: str = "iq4nl"):
    m = copy.deepcopy(ref)
    for i, layer in enumerate(m.model.layers):
        st = None if stats is None else stats[i]
        a, e = layer.self_attn, layer.mlp.experts
        for p in (a.q_proj, a.k_proj, a.v_proj):
            p.weight.data = fake(p.weight.data, None if st is None else st["attn"], weighting, grid)
        a.o_proj.weight.data = fake(a.o_proj.weight.data, None if st is None else st["o"], weighting, grid)
        n_exp = e.gate_up_proj.shape[0]
        e.gate_up_proj.data = torch.stack([fake(e.gate_up_proj.data[j], None if st is None else st["in"][j] + 1e-9,
                                                weighting, grid) for j in range(n_exp)])
        e.down_proj.data = torch.stack([fake(e.down_proj.data[j], None if st is None else st["mid"][j] + 1e-9,
                                             weighting, grid) for j in range(n_exp)])
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "moeq-fixtures-out" / "smollm2-moe"))
    ap.add_argument("--tokens", type=int, default=8192, help="statistics tokens (sequences of 512)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="scored held-out tokens")
    ap.add_argument("--out", default=str(HERE / "results" / "explore_importance.json"))
    args = ap.parse_args()
    ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    files = sorted(DATA.glob("text_*.txt"))
    n = args.tokens // 512
    calib = tokenize(tok, calibration_text(files, 400_000))[: n * 512].view(n, 512)
    rand = torch.randint(0, ref.config.vocab_size, (n, 512), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    bos = torch.full((n, 1), tok.bos_token_id if tok.bos_token_id is not None else 1)
    with torch.no_grad():
        gen = ref.generate(bos, attention_mask=torch.ones_like(bos), do_sample=True, max_new_tokens=511,
                           min_new_tokens=511, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0)[:, :512]
    q40 = build(ref, None, "row", grid="signed")
    t0 = time.perf_counter()
    sources = {"calibration text": collect(ref, calib), "random tokens": collect(ref, rand),
               "self-generated text": collect(ref, gen), "random tokens through q4_0": collect(q40, rand)}
    collect_s = (time.perf_counter() - t0) / len(sources)
    del q40
    models = {"no importance (iq4nl as shipped: row weighting)": build(ref, None, "row")}
    for src, st in sources.items():
        for wt in ("row", "mse") if src != "random tokens through q4_0" else ("mse",):
            models[f"{src}, {wt} x importance"] = build(ref, st, wt)
    models["random tokens, x2 x importance"] = build(ref, sources["random tokens"], "x2")
    ids = tokenize(tok, heldout_text(files))
    res = evaluate_many(models, ref, ids, ctx=512, max_tokens=args.max_tokens, progress=False)
    rows = [{"variant": k, **r.to_dict()} for k, r in res.items()]
    for r in rows:
        print(f"{r['variant']:55s} KL {r['mean_kl']:.4f}  PPL {r['ppl']:.2f}  top-1 {r['top1']:.1%}")
    write_json(args.out, {"model": args.model, "method": "iq4nl g32 search 7 (attention + experts)",
                          "statistics_tokens": args.tokens, "scored_tokens": res[next(iter(res))].tokens,
                          "collect_seconds_each": collect_s, "cpu": _cpu(), "rows": rows})


if __name__ == "__main__":
    main()
