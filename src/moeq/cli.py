"""``moeq`` command line: a thin layer over the Python API."""
from __future__ import annotations

import argparse
import json
import logging
import sys


def _table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    head = [h for _, h, _ in cols]
    body = [[format(r[k], f) if isinstance(r[k], (int, float)) and f else str(r[k]) for k, _, f in cols] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda xs: "  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(xs, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def cmd_demo(args) -> int:
    from moeq.demo import format_table, synthetic_stack

    shape = tuple(args.shape)
    print(f"Quantizing a synthetic bf16 expert stack {list(shape)} in every format:\n")
    rows = format_table(synthetic_stack(shape))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(_table(rows, [("format", "format", ""), ("bits_per_weight", "bits/w", ".3f"), ("sqnr_db", "SQNR dB", ".2f"),
                            ("max_abs_err", "max|err|", ".2e"), ("quantize_gbps", "quant GB/s", ".2f"),
                            ("dequantize_gbps", "dequant GB/s", ".2f")]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moeq", description="Calibration-free quantization for MoE language models")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the built-in default job")
    d.add_argument("--shape", type=int, nargs=3, default=[8, 1536, 2048], metavar=("E", "N", "K"))
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"moeq: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
