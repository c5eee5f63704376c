"""Cost of the NaN/Inf stop (moeq.nn.finite) on the moeq bench model (Qwen3-30B-A3B layer shapes, 4 layers, q4_0):
prompt of 512 tokens (last logits; all logits) and greedy decode, with the checks on and off in the same process, best
of 3 rounds. ``python benchmarks/bench_finite_guard.py --out benchmarks/results/finite_guard.json``"""
import argparse
import time, torch, json, sys
import moeq
from moeq import bench
from moeq.nn import finite
from pathlib import Path
ap = argparse.ArgumentParser()
ap.add_argument("--out", default=None)
args = ap.parse_args()
bench.write_model(Path.home() / ".cache" / "moeq-bench" / "ab-4L")
m = moeq.load(str(Path.home()/".cache/moeq-bench/ab-4L"), "q4_0", progress=False)
ids = torch.randint(0, 150000, (1, 512), generator=torch.Generator().manual_seed(0))
real = finite.finite
res = {}
def run(all_logits):
    kw = {} if all_logits else {"logits_to_keep": 1}
    with torch.no_grad():
        t = time.perf_counter(); m(ids, **kw); return time.perf_counter() - t
for r in range(3):
    for on in (True, False):
        finite.finite = real if on else (lambda t: True)
        for al in (False, True):
            res.setdefault(f"guard={on} all_logits={al}", []).append(run(al))
    finite.finite = real
    dec = {}
for on in (True, False):
    finite.finite = real if on else (lambda t: True)
    res[f"guard={on} sampled_decode_tps"] = bench.decode_tps(m, 1, prompt=32, new=64, reps=2)
finite.finite = real
out = {k: (min(v) if isinstance(v, list) else v) for k, v in res.items()}
cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")), "")
print(json.dumps(out, indent=1))
if args.out:
    Path(args.out).write_text(json.dumps({"cpu": cpu, "threads": torch.get_num_threads(), "seconds_or_tps": out},
                                         indent=1))
