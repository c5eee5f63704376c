"""FP8 checkpoint -> Q4_0 GGUF in one streamed command, against the same export from the bf16 checkpoint, on the
``moeq bench`` model (Qwen3-30B-A3B's layer shapes, 4 layers, vocab 151936): wall time, read GB/s and peak RSS of
``moeq export SRC model.gguf --format gguf --method q4_0`` (streamed layer by layer, every Q4_0 tensor decoded back by
gguf-py), each in a fresh process, and the load alone (``moeq.load(SRC, "q4_0")``). The FP8 checkpoint is the bench checkpoint in DeepSeek's
block-scaled layout (128x128 tiles, ``moeq.tiny.to_fp8``), written once.

    python benchmarks/bench_fp8_gguf.py --out benchmarks/results/fp8_gguf.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOAD = r"""
import json, resource, sys, time
import moeq
t = time.perf_counter()
m = moeq.load(sys.argv[1], "q4_0", progress=False)
print(json.dumps({"seconds": time.perf_counter() - t,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""
CHILD = r"""
import json, resource, sys, time
from moeq.cli import main
t = time.perf_counter()
rc = main(["export", sys.argv[1], sys.argv[2], "--format", "gguf", "--method", "q4_0", "--json", "--overwrite"])
print(json.dumps({"rc": rc, "seconds": time.perf_counter() - t,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def fp8_copy(src: Path, out: Path) -> Path:
    from moeq.tiny import to_fp8

    if not (out / "done").exists():
        to_fp8(src, out, (128, 128))
        (out / "done").write_text("1")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from moeq import bench

    cache = Path.home() / ".cache" / "moeq-bench"
    bf16 = bench.write_model(cache / "ab-4L")
    fp8 = fp8_copy(bf16, cache / "ab-4L-fp8")
    from moeq.tiny import tiny_tokenizer

    for d in (bf16, fp8):  # random weights, no tokenizer: a byte-level one for the GGUF (it pads its vocabulary)
        if not (d / "tokenizer.json").exists():
            tiny_tokenizer().save_pretrained(d)
    size = {k: sum(f.stat().st_size for f in p.glob("*.safetensors")) for k, p in (("bf16", bf16), ("fp8", fp8))}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind, src in (("fp8", fp8), ("bf16", bf16)):
                out = Path(tmp) / f"{kind}.gguf"
                p = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out)], capture_output=True, text=True)
                if p.returncode or not out.exists():
                    raise SystemExit(f"export of {src} failed:\n{p.stderr[-3000:]}")
                lines = p.stdout.strip().splitlines()
                res = json.loads(lines[-1])  # the child's own line; before it, the export's --json summary
                try:
                    summary = json.loads("\n".join(lines[:-1]))
                except ValueError:
                    summary = {}
                row = {"round": r, "source": kind, "source_bytes": size[kind], "gguf_bytes": out.stat().st_size,
                       **res, "read_gbps": size[kind] / res["seconds"] / 1e9,
                       **{k: summary.get(k) for k in ("streamed", "checked_by_gguf_py", "kl_vs_moeq")}}
                rows.append(row)
                print(json.dumps(row), flush=True)
                p = subprocess.run([sys.executable, "-c", LOAD, str(src)], capture_output=True, text=True, check=True)
                load = json.loads(p.stdout.strip().splitlines()[-1])
                rows.append({"round": r, "source": kind, "step": "load with q4_0 only", **load,
                             "read_gbps": size[kind] / load["seconds"] / 1e9})
                print(json.dumps(rows[-1]), flush=True)
    res = {"cpu": bench.cpu_summary(), "threads": os.cpu_count(), "model": "moeq bench: Qwen3-30B-A3B layer shapes, 4 layers",
           "rows": rows, "date": time.strftime("%Y-%m-%d")}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
