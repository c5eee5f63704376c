"""One-row decode linears per format, in the ISA the native library is built for (run it twice, the second time with
MOEQ_NATIVE_MARCH=x86-64-v3 and its own XDG_CACHE_HOME, for the AVX2 build): Gweights/s of a QuantLinear at one bf16
row on 4096x2048 and 1536x2048 weights (best of 100 calls, cache-warm: a compute bound, not a bandwidth one), and
the bf16 head's gemv against torch's. Appends one record per run to benchmarks/results/gemv_isa.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from moeq import native  # noqa: E402
from moeq.bench import best_seconds  # noqa: E402
from moeq.config import BNB4, RTN  # noqa: E402
from moeq.nn import decode  # noqa: E402
from moeq.nn.linear import QuantLinear  # noqa: E402

FORMATS = {"q4_0": RTN(4, 32, grid="signed"), "rtn-int4 g128": RTN(4, 128), "iq4nl": RTN(4, 32, grid="iq4nl"),
           "q5_0": RTN(5, 32, grid="signed"), "q8_0": RTN(8, 32, grid="signed"), "nf4": BNB4("nf4", 64, True),
           "iq4nl-dq": RTN(4, 32, grid="iq4nl", double_quant=True), "nl3": RTN(3, 16, grid="nl3", double_quant=True),
           "nl2": RTN(2, 16, grid="nl2", double_quant=True)}


def main() -> None:
    torch.manual_seed(0)
    level = {2: "avx512-bf16", 1: "avx2", 0: "plain C"}[native.lib().moeq_simd_level()]
    rec = {"isa": level, "march": native.march(), "gweights_per_s": {}}
    for name, cfg in FORMATS.items():
        for n, k in [(4096, 2048), (1536, 2048)]:
            mod = QuantLinear(cfg.quantize(torch.randn(n, k).bfloat16()))
            x = torch.randn(1, 1, k).bfloat16()
            rec["gweights_per_s"][f"{name} {n}x{k}"] = n * k / best_seconds(lambda: mod(x), 100, warmup=3) / 1e9
    w = torch.randn(151936 // 4, 2048).bfloat16()
    x = torch.randn(1, 2048).bfloat16()
    gb = w.numel() * 2 / 1e9
    native_head = decode.bf16_linear(x, w) is not None  # None: no SIMD build, heads stay on torch
    rec["bf16_head_gbps"] = gb / best_seconds(lambda: decode.bf16_linear(x, w), 20, warmup=3) if native_head else None
    rec["torch_bf16_head_gbps"] = gb / best_seconds(lambda: torch.nn.functional.linear(x, w), 20, warmup=3)
    out = ROOT / "benchmarks" / "results" / "gemv_isa.json"
    runs = json.loads(out.read_text())["runs"] if out.exists() else []
    runs.append(rec)
    out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
