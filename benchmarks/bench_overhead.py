"""Per-call Python overhead of moeq's quantized modules on the decode path, where the weights are tiny and the time
is dispatch: a QuantExperts step (1 token, top-2 of 4 experts), a QuantLinear row, and one sampled decode token of a
tiny Qwen3-MoE (transformers' own generate loop over moeq's modules, the path sampling takes). Run it against two
source trees side by side, alternating, to compare a refactor with the commit before it:

    python benchmarks/bench_overhead.py --trees /path/to/old/src src --rounds 5 --out benchmarks/results/overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
import moeq
from moeq.nn import QuantExperts, QuantLinear
from moeq.tiny import make_checkpoint
torch.manual_seed(0)
src = make_checkpoint("qwen3_moe", sys.argv[1])
m = moeq.load(src, "q4_0", progress=False)
ex = next(x for x in m.modules() if isinstance(x, QuantExperts))
lin = next(x for x in m.modules() if isinstance(x, QuantLinear))
x = torch.randn(1, ex.hidden_dim).bfloat16()
idx, wts = torch.tensor([[0, 2]]), torch.tensor([[0.6, 0.4]]).bfloat16()
def per_call(fn, n=3000):
    for _ in range(200): fn()
    t = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - t) / n * 1e6
out = {}
with torch.no_grad():
    out["experts_step_us"] = per_call(lambda: ex(x, idx, wts))
    out["linear_row_us"] = per_call(lambda: lin(x))
    ids = torch.tensor([[5, 6, 7, 8]])
    kw = dict(do_sample=True, top_k=0, temperature=1.0, pad_token_id=0)
    m.generate(ids, max_new_tokens=8, **kw)
    t = time.perf_counter(); m.generate(ids, max_new_tokens=65, **kw); a = time.perf_counter() - t
    t = time.perf_counter(); m.generate(ids, max_new_tokens=1, **kw); b = time.perf_counter() - t
    out["sampled_token_ms"] = (a - b) / 64 * 1e3
print(json.dumps(out))
"""


def run(tree: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
        r = subprocess.run([sys.executable, "-c", CHILD, tmp], env=env, capture_output=True, text=True, check=True)
        return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=["src"], help="source trees (their src/ folder), alternated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = {t: [] for t in args.trees}
    for _ in range(args.rounds):
        for t in args.trees:
            rows[t].append(run(t))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from moeq.bench import cpu_summary  # noqa: PLC0415

    summary = {t: {k: {"best": min(r[k] for r in rs), "median": sorted(r[k] for r in rs)[len(rs) // 2]}
                   for k in rs[0]} for t, rs in rows.items()}
    res = {"cpu": cpu_summary(), "threads": os.cpu_count(), "rounds": rows, "summary": summary}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
