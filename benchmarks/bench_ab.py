"""Side-by-side speed of two source trees on the ``moeq bench`` model (Qwen3-30B-A3B's layer shapes, 4 layers):
decode b1/b4/b8 and prefill 512 with ``q4_0`` and ``rtn-int4``, each tree in its own process, alternating over rounds —
the check that a refactor left speed unchanged.

    python benchmarks/bench_ab.py --trees /path/to/old/src src --rounds 2 --out benchmarks/results/refactor_ab.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, torch
import moeq
from moeq import bench
m = moeq.load(sys.argv[1], sys.argv[2], progress=False)
out = {"decode_b1_tps": bench.decode_tps(m, 1, prompt=32, new=64, reps=2),
       "decode_b4_tps": bench.decode_tps(m, 4, prompt=32, new=64, reps=2),
       "decode_b8_tps": bench.decode_tps(m, 8, prompt=32, new=64, reps=2),
       "prefill512_tps": 512 / min(bench.prefill_seconds(m, 512, False) for _ in range(2))}
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", required=True)
    ap.add_argument("--methods", nargs="+", default=["q4_0", "rtn-int4"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="the bench checkpoint (default: written by moeq.bench, cached)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.trees[-1]).resolve()))
    from moeq import bench  # noqa: PLC0415

    ckpt = Path(args.model) if args.model else bench.write_model(Path.home() / ".cache" / "moeq-bench" / "ab-4L")
    rows = []
    for r in range(args.rounds):
        for method in args.methods:
            for tree in args.trees:
                env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
                p = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), method], env=env, capture_output=True,
                                   text=True, check=True)
                rows.append({"round": r, "method": method, "tree": tree, **json.loads(p.stdout.strip().splitlines()[-1])})
                print(json.dumps(rows[-1]), flush=True)
    best = {}
    for row in rows:
        b = best.setdefault(f"{row['method']} {row['tree']}", {})
        for k, v in row.items():
            if k.endswith("_tps"):
                b[k] = max(b.get(k, 0), v)
    res = {"cpu": bench.cpu_summary(), "threads": os.cpu_count(), "rounds": rows, "best": best}
    print(json.dumps(best, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
