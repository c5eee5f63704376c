"""``moeq`` command line: a thin layer over the Python API (user-facing output lives here, not in the library)."""
from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time
from pathlib import Path

from safetensors import SafetensorError

from moeq.errors import MoeqError


def _table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    head = [h for _, h, _ in cols]
    body = [[format(r[k], f) if isinstance(r.get(k), (int, float)) and f else str(r.get(k, "")) for k, _, f in cols]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]

    def line(xs):
        return "  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(xs, widths)))

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _int_at_least(lo: int, hi: int = 1 << 31):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo} and {hi}, got {v}")
        return v
    return parse


def _float_in(lo: float, hi: float, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (lo < v if lo_open else lo <= v) or not v <= hi:
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {text}")
        return v
    return parse


def _group_size(text: str) -> int:
    v = _int_at_least(-1, 4096)(text)
    if v == 0 or v < -1:
        raise argparse.ArgumentTypeError("must be a positive group/block size or -1 (one group per row)")
    return v


def _nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _quant_config(args):
    import dataclasses  # noqa: PLC0415

    from moeq.config import MIXES, QuantConfig, method, mix

    rules = []
    for r in args.rule or []:
        pat, _, m = r.rpartition("=")
        m, _, gs = m.partition(":")
        if not pat.strip() or not m or (gs and not gs.lstrip("-").isdigit()):
            raise MoeqError(f"--rule {r!r}: expected PATTERN=METHOD[:GROUP], e.g. 'lm_head=rtn-int8' or "
                            "'*.experts.w2=rtn-int4:64'")
        rules.append((pat, method(m, int(gs) if gs else None)))  # a rule's own group size, not --group-size
    if args.method in MIXES:  # a named mix: the user's rules first, then the mix's own
        return dataclasses.replace(mix(args.method, args.group_size), rules=tuple(rules))
    return QuantConfig(method(args.method, args.group_size), tuple(rules))


def _quant_for(args, default: str | None = None):
    """(quant config or None, bpw) of a command: ``--bpw`` chooses every tensor's method itself (moeq.allocate), so
    it takes no --method, --rule or --group-size; otherwise --method (or ``default``) with its rules."""
    bpw = getattr(args, "bpw", None)
    if bpw is not None:
        if args.method or args.rule or args.group_size:
            raise MoeqError("--bpw chooses each tensor's method itself: give it without --method, --rule or "
                            "--group-size")
        return None, bpw
    args.method = args.method or default
    return (_quant_config(args) if args.method else None), None


def _tokenizer(path: str):
    from moeq.generation import load_tokenizer

    return load_tokenizer(path)


def _dtype(name: str | None):
    import torch

    return None if name is None else {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _warn_slow_search(qcfg, nbytes: int) -> None:
    """The slower searched presets (nf4-opt natively at ~0.2 GB/s; rtn-int4-opt and hqq in plain torch): measure the
    rate on a sample here and warn with an estimate for this checkpoint before the work starts."""
    import torch

    from moeq.config import RTN
    from moeq.formats.rtn import searched_natively

    def fast(c) -> bool:  # the codebook grids' weighted search runs natively (~0.5 GB/s on 2 cores)
        return isinstance(c, RTN) and searched_natively(c.grid, c.bits, c.symmetric, c.search)

    slow = [c for c in (qcfg.default, *(c for _, c in qcfg.all_rules)) if not fast(c)
            and (getattr(c, "search", 0) or getattr(c, "refine", 0) or getattr(c, "hqq", 0))]
    if not slow:
        return
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(torch.bfloat16)
    t0 = time.perf_counter()
    slow[0].quantize(w, name="sample")
    rate = w.numel() * 2 / max(time.perf_counter() - t0, 1e-9)  # bytes of bf16 weights per second
    print(f"moeq: warning: {slow[0].label()} searches each block at ~{rate / 1e9:.3f} GB/s on this "
          f"machine: about {nbytes / rate / 60:.0f} min for {nbytes / 1e9:.1f} GB of weights (the plain methods take "
          "seconds per GB)", file=sys.stderr)


def cmd_rotate(args) -> int:
    import dataclasses

    import moeq
    from moeq.io.writer import check_target

    out = Path(args.out)
    check_target(out, args.overwrite, [args.src])
    t0 = time.perf_counter()
    model = moeq.load(args.src, dtype=_dtype(args.dtype), progress=not args.json)
    rot = moeq.rotate_(model, seed=args.seed, fold_only=args.fold_only)
    moeq.save(model, out, overwrite=args.overwrite, source=args.src)
    summary = {"out": str(out), **dataclasses.asdict(rot), "seconds": time.perf_counter() - t0,
               "peak_rss_bytes": peak_rss_bytes()}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"rotated {rot.tensors} tensors ({rot.kind}, seed {rot.seed}{', head untied' if rot.untied else ''}); "
              f"probe logits within {rot.probe_rel_err:.2g} of the original; wrote {out} in {summary['seconds']:.1f} s")
    return 0


def cmd_imatrix(args) -> int:
    from moeq.loader import imatrix

    t0 = time.perf_counter()
    summary = imatrix(args.src, args.out, tokens=args.tokens, seed=args.seed, dtype=_dtype(args.dtype),
                      progress=not args.json, overwrite=args.overwrite, inputs=args.importance_inputs)
    summary |= {"seconds": time.perf_counter() - t0, "peak_rss_bytes": peak_rss_bytes()}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {summary['file']}: {summary['tensors']} tensors, measured on {summary['tokens']} tokens "
              f"({summary['inputs']}, seed {summary['seed']}, {summary['measured_on']} first pass) in {summary['seconds']:.1f} s; use it "
              f"as llama-quantize --imatrix {summary['file']}")
    return 0


def cmd_quantize(args) -> int:
    import moeq

    from moeq.io.safetensors_io import Checkpoint
    from moeq.io.writer import check_target

    out = Path(args.out)
    check_target(out, args.overwrite, [args.src])  # before hours of work, not after

    src_bytes = sum(i.nbytes for i in Checkpoint(args.src).tensors.values())
    qcfg, bpw = _quant_for(args, "rtn-int4")
    if qcfg is not None:
        _warn_slow_search(qcfg, src_bytes)
    t0 = time.perf_counter()
    model = moeq.load(args.src, quant=qcfg, dtype=_dtype(args.dtype), progress=not args.json,
                      device=args.device, importance=args.importance, bpw=bpw,
                      importance_inputs=args.importance_inputs)
    moeq.save(model, out, overwrite=args.overwrite, source=args.src)
    secs = time.perf_counter() - t0
    info = moeq.inspect(model)
    summary = {"out": str(out), "method": args.method or f"bpw {bpw}", "params_quantized": info["quantized_params"],
               "bytes_before": src_bytes, "bytes_after": info["total_bytes"],
               "bits_per_weight": info["bits_per_weight"],
               "quantized_bits_per_weight": info["quantized_bits_per_weight"], "seconds": secs,
               "peak_rss_bytes": peak_rss_bytes()}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {out}: {summary['params_quantized']:,} params quantized, "
              f"{src_bytes / 1e6:.1f} MB -> {summary['bytes_after'] / 1e6:.1f} MB "
              f"({summary['bits_per_weight']:.2f} bits/weight overall, "
              f"{summary['quantized_bits_per_weight']:.2f} in quantized modules), {secs:.1f} s, "
              f"peak RSS {summary['peak_rss_bytes'] / 1e9:.2f} GB")
    return 0


def _prompts(args) -> list[str]:
    """The prompts of a generate run: -p TEXT, -p - (stdin), or --prompt-file F (one prompt per line; - is stdin)."""
    if args.prompt_file is not None:
        try:
            text = sys.stdin.read() if args.prompt_file == "-" else Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise MoeqError(f"--prompt-file {args.prompt_file}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise MoeqError(f"--prompt-file {args.prompt_file}: not UTF-8 text (byte {e.start}: "
                            f"{e.object[e.start:e.start + 1]!r}); save it as UTF-8") from None
        prompts = [line for line in text.splitlines() if line.strip()]
    else:
        prompts = [sys.stdin.read() if args.prompt == "-" else args.prompt]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise MoeqError("no prompt: give -p TEXT, -p - (stdin) or --prompt-file FILE with non-empty lines")
    return prompts


def _sampling(args):
    from moeq.generation import Sampling

    return Sampling(args.sample, args.temperature, args.top_p, args.top_k)


def _load_for_generation(args):
    import moeq

    model = moeq.load(args.model, quant=_quant_config(args) if args.method else None, dtype=_dtype(args.dtype),
                      progress=False, device=args.device, importance=getattr(args, "importance", 0),
                      importance_inputs=args.importance_inputs)
    return model, _tokenizer(args.model)


def cmd_generate(args) -> int:
    import torch
    from transformers import TextStreamer

    from moeq.generation import encode, fit_context, has_chat_template, stop_ids

    prompts = _prompts(args)
    model, tok = _load_for_generation(args)
    kw = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id or (stop_ids(tok, model) or [0])[0],
              **_sampling(args).kwargs())
    for i, prompt in enumerate(prompts):
        torch.manual_seed(args.seed)
        ids = encode(tok, prompt, chat=not args.no_chat).to(args.device)
        if len(prompts) > 1:
            print(f"=== prompt {i + 1}/{len(prompts)}", file=sys.stderr)
        if args.no_chat or not has_chat_template(tok):  # a raw completion continues the prompt: show it
            print(prompt, end="", flush=True)
        streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        t0 = time.perf_counter()
        out = model.generate(ids, streamer=streamer, **kw | {
            "max_new_tokens": fit_context(model, ids.shape[1], args.max_new_tokens)})
        dt = time.perf_counter() - t0
        n = out.shape[1] - ids.shape[1]
        print(f"[{n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from moeq.serve import serve

    return serve(args.model, host=args.host, port=args.port, quant=_quant_config(args) if args.method else None,
                 dtype=_dtype(args.dtype), device=args.device, name=args.name, api_key=args.api_key,
                 max_concurrency=args.max_concurrency, max_queue=args.max_queue, context=args.ctx,
                 log_level="info" if args.verbose else "warning")


def cmd_chat(args) -> int:
    import torch
    from transformers import TextStreamer

    from moeq.generation import encode, fit_context, has_chat_template, stop_ids

    model, tok = _load_for_generation(args)
    if not has_chat_template(tok):
        raise MoeqError(f"{args.model}: the tokenizer has no chat template; use 'moeq generate' for plain text")
    kw = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id or (stop_ids(tok, model) or [0])[0],
              **_sampling(args).kwargs())
    history = [{"role": "system", "content": args.system}] if args.system else []
    torch.manual_seed(args.seed)
    print("moeq chat: /reset clears the conversation, /exit or Ctrl-D leaves", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        ids = encode(tok, history).to(args.device)
        try:
            new = fit_context(model, ids.shape[1], args.max_new_tokens)
        except MoeqError as e:  # the conversation outgrew the context: this turn is refused, the session goes on
            history.pop()
            print(f"moeq: {e} (/reset starts over)", file=sys.stderr)
            continue
        out = model.generate(ids, streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True),
                             **kw | {"max_new_tokens": new})
        history.append({"role": "assistant",
                        "content": tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()})


def cmd_inspect(args) -> int:
    import moeq

    from moeq import readers
    from moeq.io import hub

    source = readers.describe(hub.resolve(args.model))
    info = moeq.inspect(moeq.load(args.model, progress=False))
    if args.json:
        print(json.dumps(info | {"source": source}, indent=1))
        return 0
    extra = ", ".join(f"{k}={v}" for k, v in source.items() if k not in ("reader", "without_method", "with_method"))
    print(f"source: {source['reader']} ({extra})\n  loaded without a method: {source['without_method']}\n"
          f"  with --method M: {source['with_method']}\n")
    rows = [r | {"detail": ",".join(f"{k}={v}" for k, v in r["detail"].items() if k != "dtype")} for r in info["modules"]]
    print(_table(rows, [("module", "module", ""), ("format", "format", ""), ("detail", "settings", ""),
                        ("bits_per_weight", "bits/w", ".3f"), ("bytes", "bytes", ",")]))
    print(f"\nquantized: {info['quantized_params']:,} params, {info['quantized_bytes']:,} bytes "
          f"({info['quantized_bits_per_weight']:.3f} bits/weight); unquantized: {info['unquantized_params']:,} "
          f"params, {info['unquantized_bytes']:,} bytes; total {info['total_bytes']:,} bytes, "
          f"{info['bits_per_weight']:.3f} bits/weight")
    return 0


def cmd_export(args) -> int:
    from moeq.export import export_checkpoint

    quant, bpw = _quant_for(args)
    summary = export_checkpoint(args.model, args.out, args.format, quant=quant,
                                overwrite=args.overwrite, progress=not args.json, requantize=args.requantize,
                                dtype=_dtype(args.dtype), layout=args.layout, force=args.force,
                                importance=args.importance, bpw=bpw, importance_inputs=args.importance_inputs)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"wrote {summary['out']} ({args.format}): {summary['tensors']} tensors, {summary['bytes'] / 1e6:.1f} MB")
    if summary.get("kl_vs_moeq") is not None:
        print(f"loaded as its consumer loads it: mean KL vs moeq's model {summary['kl_vs_moeq']:.3g} nats")
    if summary.get("streamed"):
        print(f"streamed layer by layer: peak RSS {summary['peak_rss_bytes'] / 2**30:.2f} GiB; "
              f"{summary['checked_by_gguf_py']} tensors decoded back by gguf-py equal to moeq's values")
    requant = summary.get("requantized", [])
    print(f"re-quantized ({len(requant)}):" + "".join(f"\n  {r}" for r in requant) if requant else
          "no value re-quantized (lossless)")
    kept = summary.get("kept_unquantized", [])
    print(f"kept unquantized ({len(kept)}): " + (", ".join(kept) if kept else "nothing"))
    return 0


def cmd_eval(args) -> int:
    import moeq
    from moeq.eval import DECODE_CHUNK, check_compatible, evaluate_many, tokenize

    texts = []
    for f in args.text:
        try:
            texts.append(Path(f).read_text(encoding="utf-8", errors="replace"))
        except OSError as e:
            raise MoeqError(f"--text {f}: {e.strerror}") from None
    ref_tok = _tokenizer(args.ref)
    quant, bpw = _quant_for(args)
    ref = moeq.load(args.ref, dtype=_dtype(args.dtype), progress=not args.json)
    models = {}
    for path in args.model:
        tok = _tokenizer(path)
        models[path] = moeq.load(path, quant=quant, dtype=_dtype(args.dtype), progress=not args.json,
                                 activations=args.activations, importance=args.importance, bpw=bpw,
                                 importance_inputs=args.importance_inputs)
        check_compatible(models[path], ref, tok, ref_tok)
    # int8 activations change the decode kernels only (at most a few rows per weight): score them decode-shaped
    chunk = args.chunk or (DECODE_CHUNK if args.activations != "default" else None)
    results = evaluate_many(models, ref, tokenize(ref_tok, texts), ctx=args.ctx, max_tokens=args.max_tokens,
                            progress=not args.json, chunks={p: chunk for p in models} if chunk else None)
    rows = []
    for path, res in results.items():
        info = moeq.inspect(models[path])
        rows.append({"model": path, "method": args.method or (f"bpw {bpw}" if bpw else None), "reference": args.ref, "texts": list(args.text),
                     "ctx": args.ctx, "activations": args.activations, "chunk": chunk, **res.to_dict(), "bits_per_weight": info["bits_per_weight"],
                     "quantized_bits_per_weight": info["quantized_bits_per_weight"]})
    if args.json:
        print(json.dumps(rows if len(rows) > 1 else rows[0]))
    else:
        print(f"reference {args.ref}: PPL {rows[0]['ref_ppl']:.3f}; {rows[0]['tokens']} tokens in "
              f"{rows[0]['windows']} windows of {args.ctx}\n")
        print(_table(rows, [("model", "model", ""), ("ppl", "PPL", ".3f"), ("mean_kl", "mean KL", ".4g"),
                            ("p99_kl", "p99 KL", ".4g"), ("top1", "top-1", ".2%"),
                            ("quantized_bits_per_weight", "bits/w (quantized)", ".3f")]))
    if args.json_out:
        from moeq.io.writer import write_json  # noqa: PLC0415

        write_json(args.json_out, rows)
    return 0


def cmd_bench(args) -> int:
    from moeq import bench

    shape = dict(bench.QWEN3_30B_A3B, **({"vocab": args.vocab} if args.vocab else {}))
    ckpt = Path(args.model) if args.model else bench.write_model(
        Path(args.cache) / f"qwen3-30b-a3b-shape-{args.layers}L-v{shape['vocab']}", args.layers, shape)
    res = bench.run(ckpt, args.systems, batches=tuple(args.batches), prefills=tuple(args.prefill),
                    new_tokens=args.new_tokens, group_size=args.group_size)
    out = Path(args.out) if args.out else Path(args.cache) / f"cpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    from moeq.io.writer import write_json  # noqa: PLC0415

    write_json(out, res)
    print(bench.table(res))
    print(f"\nresults: {out}", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from moeq.demo import format_table, model_table, synthetic_stack

    print(f"1) A random {args.arch} MoE checkpoint, loaded with in-flight quantization, vs its bf16 self:\n")
    rows = model_table(args.arch)
    print(_table(rows, [("method", "method", ""), ("bytes", "bytes", ","), ("bits_per_weight", "bits/w", ".2f"),
                        ("decode_tok_s", "decode tok/s", ".1f"), ("mean_kl", "mean KL", ".2e"),
                        ("top1", "top-1 agree", ".3f"), ("sample", "greedy tokens", "")]))
    shape = tuple(args.shape)
    print(f"\n2) Every format on a synthetic bf16 expert stack {list(shape)}:\n")
    frows = format_table(synthetic_stack(shape))
    print(_table(frows, [("format", "format", ""), ("bits_per_weight", "bits/w", ".3f"), ("sqnr_db", "SQNR dB", ".2f"),
                         ("max_abs_err", "max|err|", ".2e"), ("quantize_gbps", "quant GB/s", ".2f"),
                         ("dequantize_gbps", "dequant GB/s", ".2f")]))
    if args.json:
        print(json.dumps({"model": rows, "formats": frows}))
    if args.json_out:
        from moeq.io.writer import write_json  # noqa: PLC0415

        write_json(args.json_out, {"model": rows, "formats": frows})
    return 0


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """--help shows every option's default (where it has one) and keeps the examples' line breaks."""

    def _get_help_string(self, action):
        h = action.help or ""
        if ("%(default)" not in h and "default" not in h and action.option_strings
                and action.default not in (None, False, argparse.SUPPRESS)):
            h += " (default: %(default)s)"
        return h


def build_parser() -> argparse.ArgumentParser:
    from moeq.config import METHODS, MIXES
    from moeq.importance import DEFAULT_INPUTS, INPUTS

    from moeq.version import __version__

    p = argparse.ArgumentParser(prog="moeq", description="Calibration-free quantization for MoE language models",
                                epilog="examples:\n  moeq quantize Qwen/Qwen3-30B-A3B qwen-rtn4 --method rtn-int4\n"
                                "  moeq generate qwen-rtn4 -p 'Why is the sky blue?'\n  moeq chat qwen-rtn4\n"
                                "  moeq export qwen-rtn4 out --format compressed-tensors\n"
                                "run 'moeq COMMAND -h' for each command's options and defaults",
                                formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"moeq {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log what moeq does (also after the command)")
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    add_parser = sub.add_parser

    def sub_parser(*a, **k):  # every command takes -v too, and shows its defaults in --help
        k.setdefault("formatter_class", _Formatter)
        return add_parser(*a, parents=[common], **k)

    sub.add_parser = sub_parser

    def inputs_arg(sp):
        sp.add_argument("--importance-inputs", choices=list(INPUTS), default=DEFAULT_INPUTS,
                        help="what the importance pass runs: self = text the model samples itself from random first "
                        "tokens (closest to real text; sequential sampling), random = uniformly random token ids "
                        "(one batched forward)")

    def importance_arg(sp):
        sp.add_argument("--importance", type=int, default=0, metavar="TOKENS",
                        help="data-free importance for methods that search their scales (iq4nl*, nl3*, q4_0-opt, "
                        "iq2s*; iq2s measures it unasked): a q8_0 first pass runs TOKENS tokens (e.g. 8192; see "
                        "--importance-inputs) and the --method pass weighs each weight column by its mean squared "
                        "input, as llama.cpp's imatrix does with calibration text (0: off)")
        inputs_arg(sp)

    def bpw_arg(sp):
        sp.add_argument("--bpw", type=_float_in(2.0, 16.0), default=None, metavar="BITS",
                        help="data-free bit allocation instead of one --method: each tensor's method chosen from "
                        "nl3-g32 / nl3 / iq4nl-dq / iq4nl / q5_0-opt / q8_0 by its measured sensitivity (noise on "
                        "random token ids) to fit BITS per quantized weight, e.g. 3.8 or 4.3 (loads the model "
                        "unquantized first)")

    def method_args(sp, default):
        sp.add_argument("--method", default=default, choices=sorted([*METHODS, *MIXES]), metavar="METHOD",
                        help=f"quantization method: {', '.join(sorted(METHODS))}; or a mix (a 4-bit default with "
                        f"k,v [and experts' down] at q8_0): {', '.join(sorted(MIXES))}"
                        + (f" (default: {default})" if default else " (default: load as stored)"))
        sp.add_argument("--group-size", type=_group_size, default=None,
                        help="RTN group / bnb block size of --method (default: the method's; a tensor it does not "
                        "divide falls back to the largest halving that does, or one group per row)")
        sp.add_argument("--rule", action="append", metavar="PATTERN=METHOD[:GROUP]",
                        help="per-module override (repeatable, first match wins): a glob on module, checkpoint or "
                        "inspect names, e.g. 'lm_head=rtn-int8', '*.block_sparse_moe.*=nf4', '*.experts.w2=rtn-int8', "
                        "'*.self_attn.*=rtn-int8:64' (a rule keeps its method's group size unless it gives one); a "
                        "rule that matches nothing is an error")
        sp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="compute dtype")
        sp.add_argument("--device", default="cpu",
                        help="cpu (default) or cuda[:N]: on a GPU, tensors stream to it and are quantized there")

    q = sub.add_parser("quantize", help="quantize a checkpoint in flight and save it",
                       epilog="examples:\n  moeq quantize Qwen3-30B-A3B qwen-rtn4\n"
                       "  moeq quantize mistralai/Mixtral-8x7B-v0.1 mixtral-nf4 --method nf4 --rule 'lm_head=rtn-int8'\n"
                       "  moeq quantize SRC OUT --method rtn-int4 --rule '*.self_attn.*=rtn-int8' --overwrite")
    q.add_argument("src", help="a bf16/fp16, FP8 (block-scaled), MXFP4 (gpt-oss) or bitsandbytes checkpoint folder, "
                               "or a Hub id in the local cache")
    q.add_argument("out", help="output folder (written atomically)")
    method_args(q, "rtn-int4")
    q.set_defaults(method=None)  # rtn-int4 unless --bpw (cmd_quantize)
    importance_arg(q)
    bpw_arg(q)
    q.add_argument("--overwrite", action="store_true", help="replace a previous moeq output at OUT (nothing else)")
    q.add_argument("--json", action="store_true", help="print the summary as JSON")
    q.set_defaults(func=cmd_quantize)

    r = sub.add_parser("rotate", help="rotate the residual stream (data-free, function-preserving) and save the "
                       "same architecture: then quantize it with any moeq method or GGUF type",
                       epilog="examples:\n  moeq rotate Qwen3-30B-A3B qwen-rot\n  moeq quantize qwen-rot qwen-rot-iq4 "
                       "--method iq4nl\n  moeq rotate SRC OUT --dtype fp32   (the rotation exact, twice the bytes)")
    r.add_argument("src", help="an unquantized bf16/fp16/fp32 checkpoint folder (Llama/Mistral/Qwen2/Qwen3 dense, "
                               "Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), or a Hub id in the local cache")
    r.add_argument("out", help="output folder (written atomically)")
    r.add_argument("--seed", type=int, default=0, help="seed of the Hadamard's random signs (default: %(default)s)")
    r.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="dtype of the rotated weights (default: the checkpoint's)")
    r.add_argument("--fold-only", action="store_true",
                   help="no rotation: only fold each RMSNorm's weight into the linears that read it")
    r.add_argument("--overwrite", action="store_true", help="replace a previous moeq output at OUT (nothing else)")
    r.add_argument("--json", action="store_true", help="print the summary as JSON")
    r.set_defaults(func=cmd_rotate)

    im = sub.add_parser("imatrix", help="llama.cpp's importance matrix without calibration text (for llama-quantize "
                        "--imatrix: its IQ1/IQ2 types need one)",
                        description="Measures llama-imatrix's statistic (each quantized tensor's mean squared input "
                        "columns, per expert for expert stacks) on text the model samples itself (or uniformly random "
                        "token ids) through a q8_0 first pass (q4_0 when that does not fit in memory), and writes it as the GGUF imatrix file "
                        "llama-quantize reads.",
                        epilog="examples:\n  moeq imatrix Qwen3-30B-A3B qwen.imatrix.gguf\n  llama-quantize --imatrix "
                        "qwen.imatrix.gguf qwen-bf16.gguf qwen-iq2_s.gguf IQ2_S",
                        formatter_class=_Formatter)
    im.add_argument("src", help="a bf16/fp16 checkpoint folder of an architecture moeq exports to GGUF, or a Hub id "
                                "in the local cache")
    im.add_argument("out", help="the imatrix file to write (e.g. model.imatrix.gguf; written atomically)")
    im.add_argument("--tokens", type=_int_at_least(512), default=8192,
                    help="tokens to measure on, a multiple of 512 (default: %(default)s)")
    im.add_argument("--seed", type=int, default=0, help="seed of the random or sampled tokens (default: %(default)s)")
    inputs_arg(im)
    im.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                    help="compute dtype of the first pass (default: the checkpoint's)")
    im.add_argument("--overwrite", action="store_true", help="replace an imatrix file moeq wrote (nothing else)")
    im.add_argument("--json", action="store_true", help="print the summary as JSON")
    im.set_defaults(func=cmd_imatrix)

    def sampling_args(sp, max_new: int):
        sp.add_argument("--max-new-tokens", type=_int_at_least(1, 1 << 20), default=max_new,
                        help="tokens to generate (default: %(default)s)")
        method_args(sp, None)
        importance_arg(sp)
        sp.add_argument("--sample", action="store_true", help="sample (default: greedy); implied by the options below")
        sp.add_argument("--temperature", type=_float_in(0.0, 100.0, lo_open=True), default=None,
                        help="sampling temperature (implies --sample; default 0.8 when sampling)")
        sp.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=None,
                        help="nucleus sampling (implies --sample; default 0.95 when sampling)")
        sp.add_argument("--top-k", type=_int_at_least(1), default=None, help="top-k sampling (implies --sample)")
        sp.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")

    g = sub.add_parser("generate", help="generate text, streamed token by token",
                       epilog="examples:\n  moeq generate qwen-moeq -p 'Why is the sky blue?'\n"
                       "  moeq generate qwen-moeq --prompt-file prompts.txt --temperature 0.7\n"
                       "  echo 'Once upon a time' | moeq generate qwen-moeq -p - --no-chat",
                       formatter_class=_Formatter)
    g.add_argument("model")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", type=_nonempty, help="the prompt ('-' reads it from stdin)")
    src.add_argument("--prompt-file", help="one prompt per line ('-': stdin)")
    g.add_argument("--no-chat", action="store_true",
                   help="raw text completion (default: the tokenizer's chat template when it has one)")
    sampling_args(g, 32)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat (streamed; the tokenizer's chat template)",
                       epilog="example:\n  moeq chat qwen-moeq --system 'You are terse.'",
                       formatter_class=_Formatter)
    c.add_argument("model")
    c.add_argument("--system", default=None, help="a system prompt")
    sampling_args(c, 256)
    c.set_defaults(func=cmd_chat)

    sv = sub.add_parser("serve", help="an OpenAI-compatible server with continuous batching and a chat page",
                        epilog="examples:\n  moeq serve qwen-moeq\n  moeq serve Qwen3-30B-A3B --method q4_0 --port 8080 "
                        "--api-key \"$KEY\"\n  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: "
                        "application/json' -d '{\"model\": \"qwen-moeq\", \"messages\": [{\"role\": \"user\", "
                        "\"content\": \"Hi\"}]}'", formatter_class=_Formatter)
    sv.add_argument("model", help="anything 'moeq generate' takes (served under its folder name)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    sv.add_argument("--port", type=_int_at_least(0, 65535), default=8000)
    method_args(sv, None)
    sv.add_argument("--max-concurrency", type=_int_at_least(1, 64), default=8,
                    help="requests decoding together (rows of one batched step)")
    sv.add_argument("--max-queue", type=_int_at_least(0, 1 << 16), default=None,
                    help="requests waiting beyond those (more get 429; default: 4 x --max-concurrency)")
    sv.add_argument("--ctx", type=_int_at_least(16), default=None,
                    help="context length per request (default: the model's max_position_embeddings)")
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    sv.add_argument("--name", default=None, help="the model id clients use (default: the folder's name)")
    sv.set_defaults(func=cmd_serve)

    i = sub.add_parser("inspect", help="what is quantized how", epilog="example:\n  moeq inspect qwen-rtn4 --json")
    i.add_argument("model", help="a moeq checkpoint (or any checkpoint moeq loads)")
    i.add_argument("--json", action="store_true", help="print the report as JSON (default: a table)")
    i.set_defaults(func=cmd_inspect)

    from moeq.export import EXPORTERS, bnb, compressed_tensors, gguf

    e = sub.add_parser("export", help="write a moeq model for another engine",
                       description="Formats: bnb = transformers+bitsandbytes layout (vLLM bitsandbytes, transformers "
                       f"dense part; takes {bnb.SUPPORTS}); compressed-tensors = pack-quantized (vLLM Marlin/Triton "
                       f"MoE, transformers; takes {compressed_tensors.SUPPORTS}); gguf = one model.gguf for llama.cpp "
                       f"(takes {gguf.SUPPORTS}). bnb and compressed-tensors exports are lossless; gguf is lossless "
                       "for symmetric RTN with group 32 (--method q4_0 / q8_0) and refuses to round other formats "
                       "a second time unless --requantize.",
                       epilog="examples:\n  moeq export qwen-moeq out-ct --format compressed-tensors\n"
                       "  moeq export Qwen3-30B-A3B qwen.gguf --format gguf --method q4_0   # bf16 -> GGUF, lossless",
                       formatter_class=_Formatter)
    e.add_argument("model", help="a moeq checkpoint, or a bf16, FP8 or MXFP4 source with --method (quantized in "
                                 "flight)")
    e.add_argument("out", help="output folder; for gguf also a file name ending in .gguf")
    e.add_argument("--format", required=True, choices=sorted(EXPORTERS))
    method_args(e, None)
    importance_arg(e)
    bpw_arg(e)
    e.add_argument("--layout", choices=["transformers5", "transformers4"], default="transformers5",
                   help="bnb: transformers5 loads with transformers 5 + bitsandbytes (quantized Linears; experts as "
                   "its fused bf16 params, which its bitsandbytes path never quantizes); transformers4 keeps every "
                   "expert quantized per expert (vLLM bitsandbytes, transformers 4.x, moeq; not transformers 5)")
    e.add_argument("--force", action="store_true",
                   help="write the export even if, loaded as its consumer loads it, it differs from moeq's model by "
                   "more than the KL threshold (0.05 nats)")
    e.add_argument("--requantize", action="store_true",
                   help="gguf: round tensors with no exact GGUF type again (refused by default)")
    e.add_argument("--overwrite", action="store_true", help="replace a previous moeq output at OUT")
    e.add_argument("--json", action="store_true", help="print the summary as JSON")
    e.set_defaults(func=cmd_export)

    ev = sub.add_parser("eval", help="perplexity, KL(ref||model) and top-1 agreement on real text",
                        epilog="examples:\n  moeq eval qwen-rtn4 qwen-nf4 --ref Qwen3-30B-A3B --text book.txt\n"
                        "  moeq eval Qwen3-30B-A3B --method nf4 --ref Qwen3-30B-A3B --text a.txt --text b.txt --json",
                        formatter_class=_Formatter)
    ev.add_argument("model", nargs="+", help="one or more models, each scored against the same reference run")
    ev.add_argument("--ref", required=True, help="reference model (e.g. the bf16 source)")
    ev.add_argument("--text", action="append", required=True, metavar="FILE", help="a text file (repeatable)")
    ev.add_argument("--ctx", type=_int_at_least(2, 1 << 20), default=512, help="window length in tokens")
    ev.add_argument("--max-tokens", type=_int_at_least(3), default=None, help="score at most this many tokens")
    method_args(ev, None)
    importance_arg(ev)
    bpw_arg(ev)
    ev.add_argument("--activations", choices=["default", "int8"], default="default",
                    help="the decode kernels' activation numerics (moeq.set_activations); int8 scores decode-shaped "
                         "(moeq.eval.DECODE_CHUNK tokens per forward over a KV cache) unless --chunk says otherwise")
    ev.add_argument("--chunk", type=_int_at_least(1, 64), default=None, metavar="N",
                    help="score decode-shaped: N tokens per forward over a KV cache (the decode kernels' rows)")
    ev.add_argument("--json", action="store_true", help="print the results as JSON")
    ev.add_argument("--json-out", metavar="FILE", help="also write the results as JSON to FILE")
    ev.set_defaults(func=cmd_eval)

    b = sub.add_parser("bench", help="CPU speed side by side: transformers bf16, transformers+bnb, moeq presets")
    b.add_argument("--model", help="checkpoint dir (default: Qwen3-30B-A3B shapes cut to --layers, generated once)")
    b.add_argument("--layers", type=_int_at_least(1, 1024), default=4, help="decoder layers of the benchmark model")
    b.add_argument("--vocab", type=_int_at_least(2, 1 << 24), default=None, help="vocabulary size (default: Qwen3's)")
    b.add_argument("--cache", default=str(Path.home() / ".cache" / "moeq-bench"), help="where the model and results go")
    b.add_argument("--systems", nargs="+", default=["transformers bf16", "transformers+bnb nf4", "moeq rtn-int4",
                                                     "moeq rtn-int8", "moeq nf4"], help="systems measured side by side")
    b.add_argument("--batches", type=_int_at_least(1, 4096), nargs="+", default=[1, 4, 16], help="decode batch sizes")
    b.add_argument("--prefill", type=_int_at_least(1, 1 << 20), nargs="+", default=[512, 2048], help="prefill lengths")
    b.add_argument("--new-tokens", type=_int_at_least(1, 1 << 20), default=128, help="decoded tokens per run")
    b.add_argument("--group-size", type=_group_size, default=128, help="RTN group of the moeq presets")
    b.add_argument("--out", default=None, help="results JSON (default: a timestamped file in --cache, printed)")
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("demo", help="the built-in default job")
    d.add_argument("--arch", default="qwen3_moe", help="architecture of the random demo checkpoint")
    d.add_argument("--shape", type=_int_at_least(1, 1 << 16), nargs=3, default=[8, 1536, 2048], metavar=("E", "N", "K"),
                   help="synthetic expert stack shape")
    d.add_argument("--json", action="store_true", help="also print the results as JSON")
    d.add_argument("--json-out", metavar="FILE", help="also write the results as JSON to FILE")
    d.set_defaults(func=cmd_demo)
    return p


def _resolve_models(args) -> None:
    """Hub ids become their local cache snapshot (tokenizer and side files come from there too)."""
    from moeq.io.hub import resolve

    for attr in ("model", "src", "ref"):
        if isinstance(getattr(args, attr, None), str):
            setattr(args, attr, str(resolve(getattr(args, attr))))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        _resolve_models(args)
        return args.func(args)
    except (MoeqError, OSError, UnicodeError, SafetensorError) as e:  # bad input, missing/unwritable files, disk
        # full (safetensors reports it as its own error type), undecodable text: one line, nothing left
        msg = str(e) if not isinstance(e, OSError) or not e.filename else f"{e.filename}: {e.strerror}"
        msg = f"not valid UTF-8 text ({e})" if isinstance(e, UnicodeDecodeError) else msg
        print(f"moeq: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moeq: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
