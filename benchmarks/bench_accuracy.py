"""Accuracy of calibration-free methods on real trained weights: the MoEfied SmolLM2 fixture of ../shared/fixtures
(build it with ../shared/fixtures/build_smollm2_moe.sh), held-out Austen text (last 10% of each book, which the
fixture's router never saw). One run, one reference pass per window for all methods.

Experts and attention are quantized (default policy: router, embeddings, lm_head kept). The fixture's dims
(hidden 576, expert 192) are not multiples of 128, so the "128" column uses group 192 (576 = 3 x 192), the
nearest size dividing every dim; bnb blocks of 128 run over the flattened tensor as bitsandbytes does.

    python benchmarks/bench_accuracy.py [--model DIR] [--max-tokens 6144] [--ctx 512] [--only NAME...] [--merge]
                                        [--dtype float32] [--out FILE]

``--dtype float32`` runs the reference and every model in fp32 and adds a row for the unquantized model in bf16:
the KL that bf16 arithmetic alone costs against the fp32 reference (the floor under any bf16 number). ``--model``
may also be the fixture's dense sibling (``smollm2-dense``): the same trained weights without routing.

The hqq-library rows need the hqq package (``DISABLE_CUDA=1 pip install hqq``); without it they are skipped.

llama.cpp rows (``--llamacpp TYPE[:pure] ...``, default :data:`LLAMACPP_TYPES`; ``--llamacpp`` alone: none): the
fixture as a BF16 GGUF (moeq's export, checked tensor for tensor against llama.cpp's own ``convert_hf_to_gguf.py``
when that runs), re-typed by ``llama-quantize`` without an importance matrix (``:pure``: ``--pure``, one type on every
tensor; token embeddings/output kept BF16 as moeq keeps them), read back by ``moeq.load`` (gguf-py decodes every type
into the bf16 model) and scored in the same pass as moeq's rows; bits/weight over the same tensors (attention q, k,
v, o and experts). Tools missing (see benchmarks/llamacpp.py): those rows are skipped with a message.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

import moeq
from moeq.bench import cpu_summary
from moeq.config import BNB4, FP4, IQ2S, METHODS, NF4, RTN, Int8, QuantConfig, presets
from moeq.errors import MoeqError
from moeq.eval import DECODE_CHUNK, evaluate_many, tokenize
from moeq.importance import INPUT_TEXT, INPUTS
from moeq.io.writer import write_json

HERE = Path(__file__).parent
DATA = HERE.parent.parent / "shared" / "data"
# ``:moeq-imatrix`` (uniformly random token ids), ``:moeq-imatrix-self`` (text the model samples itself)
MOEQ_IMATRIX = {"moeq-imatrix": "random", "moeq-imatrix-self": "self"}
IMPORTANCE_LABEL = {"random": "", "self": " (self-sampled)"}
MOEQ_IMATRIX_TOKENS = 8192  # ``:moeq-imatrix``: moeq's data-free statistic (moeq imatrix), as its importance= loads
sys.path.insert(0, str(HERE))
import llamacpp  # noqa: E402

LLAMACPP_TYPES = ["Q4_0", "Q4_0:pure", "IQ4_NL", "IQ4_NL:pure", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q3_K_M", "Q3_K_S",
                  "Q3_K_S:pure", "IQ3_S", "Q5_0", "Q5_0:pure", "Q6_K", "Q8_0"]


IQ4R = RTN(4, 32, grid="iq4nl", search=7, weighting="row")
Q80 = RTN(8, 32, grid="signed")
MORE = [i for i in range(30) if i < 30 // 8 or i >= 7 * 30 // 8 or (i - 30 // 8) % 3 == 2]  # llama.cpp use_more_bits


def methods() -> dict[str, QuantConfig]:
    m = {
        "vLLM RTN-int4 sym g64": RTN(4, 64), "vLLM RTN-int4 sym g192": RTN(4, 192),
        "RTN-int4 asym g64": RTN(4, 64, False), "RTN-int4 asym g192": RTN(4, 192, False),
        "RTN-int4 signed g64": RTN(4, 64, grid="signed"),
        "RTN-int4 sym g64 +clip": RTN(4, 64, search=20),
        "RTN-int4 asym g64 +clip+refine": RTN(4, 64, False, search=20, refine=2),
        "RTN-int4 asym g192 +clip+refine": RTN(4, 192, False, search=20, refine=2),
        "NF4 b64 dq": NF4(64, True), "NF4 b128 dq": NF4(128, True),
        "NF4 b64 dq +absmax search": BNB4("nf4", 64, True, search=20),
        "NF4 b32 dq": NF4(32, True), "NF4 b32 dq +absmax search": BNB4("nf4", 32, True, search=20),
        "FP4 b64 dq": FP4(64, True), "FP4 b128 dq": FP4(128, True),
        "RTN-int8 g64": RTN(8, 64), "RTN-int8 g192": RTN(8, 192), "LLM.int8": Int8(),
        "RTN-int3 asym g64": RTN(3, 64, False),
        "RTN-int3 asym g64 +clip+refine": RTN(3, 64, False, search=20, refine=2),
        "RTN-int4 asym g64 +hqq": RTN(4, 64, False, hqq=20),
        "RTN-int4 asym g192 +hqq": RTN(4, 192, False, hqq=20),
        "RTN-int3 asym g64 +hqq": RTN(3, 64, False, hqq=20),
        "RTN-int3 asym g32": RTN(3, 32, False), "RTN-int3 asym g32 +hqq": RTN(3, 32, False, hqq=20),
        "RTN-int3 asym g32 +clip+refine": RTN(3, 32, False, search=20, refine=2),
        "3-bit experts g32 +hqq, attention int8": QuantConfig(RTN(3, 32, False, hqq=20),
                                                              rules={"*.self_attn.*": RTN(8, 64)}),
        "preset balanced": presets()["balanced"],
        "q4_0 (llama.cpp Q4_0 rounding)": RTN(4, 32, grid="signed"),
        # blocks of 32 as the fixture's source (Q4_1), but an integer zero point where Q4_1 keeps a float minimum
        "RTN-int4 asym g32 (integer zero point)": RTN(4, 32, False),
        "ablation: iq4nl, llama.cpp's x^2 weights": RTN(4, 32, grid="iq4nl", search=7, weighting="x2"),
        "ablation: iq4nl, unweighted": RTN(4, 32, grid="iq4nl", search=7, weighting="mse"),
        "ablation: iq4nl, no search": RTN(4, 32, grid="iq4nl", search=0, weighting="row"),
        "ablation: iq4nl, search 15": RTN(4, 32, grid="iq4nl", search=15, weighting="row"),
        "ablation: iq4nl, search 5": RTN(4, 32, grid="iq4nl", search=5, weighting="row"),
        "iq4nl g64": RTN(4, 64, grid="iq4nl", search=7, weighting="row"),
        "iq4nl g64, llama.cpp's x^2 weights": RTN(4, 64, grid="iq4nl", search=7, weighting="x2"),
        "iq4nl, k,v,o q8_0": QuantConfig(IQ4R, rules={"*.k_proj": Q80, "*.v_proj": Q80, "*.o_proj": Q80}),
        "iq4nl, k,v q8_0, down q8_0 in llama.cpp's more-bits layers": QuantConfig(
            IQ4R, rules={"*.k_proj": Q80, "*.v_proj": Q80, **{f"model.layers.{i}.mlp.experts.w2": Q80 for i in MORE}}),
        "iq4nl, attention q8_0": QuantConfig(IQ4R, rules={"*.self_attn.*": Q80}),
        "iq4nl, attention + down q8_0": QuantConfig(IQ4R, rules={"*.self_attn.*": Q80, "*.experts.w2": Q80}),
        **{f"moeq {n}": n for n in ("q4_0-opt", "q4_0-m", "iq4nl", "iq4nl-dq", "iq4nl-m", "iq4nl-l", "q8_0", "nf4-opt", "q5_0",
                                    "q5_0-opt", "q5_0-m", "nl3", "nl3-s", "nl3-m", "nl2-m", "iq2s-m")},
        "iq2s experts, attention iq4nl, k/v q8_0 (llama.cpp's 2-bit rows' recipe)": QuantConfig(
            IQ4R, rules={"*.experts": IQ2S(), **{p: Q80 for p in ("*.k_proj", "*.v_proj")}}),
        "iq2s experts, q iq4nl, o q5_0-opt, k/v q8_0 (llama.cpp's IQ4_NL mix: o Q5_1)": QuantConfig(
            IQ4R, rules={"*.experts": IQ2S(), "*.o_proj": METHODS["q5_0-opt"],
                         **{p: Q80 for p in ("*.k_proj", "*.v_proj")}}),
        "iq2s experts (importance alone as weights), attention iq4nl, k/v q8_0": QuantConfig(
            IQ4R, rules={"*.experts": IQ2S(weighting="mse"), **{p: Q80 for p in ("*.k_proj", "*.v_proj")}}),
        "iq2s-m, importance alone as weights": QuantConfig(
            RTN(4, 32, grid="iq4nl", search=7, weighting="row", double_quant=True),
            rules={"*.experts": IQ2S(weighting="mse"), **{p: Q80 for p in ("*.k_proj", "*.v_proj")}}),
        "2-bit experts: RTN-int2 asym g32 (2.75 bits), the rest as nl2-m": QuantConfig(
            RTN(4, 32, grid="iq4nl", search=7, weighting="row", double_quant=True),
            rules={"*.experts": RTN(2, 32, False), **{p: Q80 for p in ("*.k_proj", "*.v_proj")}}),
        "nl3 g32 (3.25 + 16/K bits)": RTN(3, 32, grid="nl3", search=7, weighting="x2", double_quant=True),
        "ablation: nl3, row weights (sigma^2 + x^2)": RTN(3, 16, grid="nl3", search=7, weighting="row",
                                                          double_quant=True),
        "artefact: RTN-int4 asym g32 (source grid)": RTN(4, 32, False),
    }
    return {k: QuantConfig.of(v) for k, v in m.items()}


FLOOR = "floor: unquantized model computed in bf16"
HQQ_LIB = {"hqq library 4-bit g64 (fp16 scale+zero)": (4, 64), "hqq library 3-bit g64 (fp16 scale+zero)": (3, 64)}


def hqq_library_model(path: str, nbits: int, group_size: int, dtype: torch.dtype = torch.bfloat16):
    """The same weights quantized by the hqq library itself (HQQ's optimizer, its defaults: axis 1, L_p 0.7,
    rounded zero at 4 bits; fp16 scale and zero per group), dequantized back into the bf16 model."""
    from hqq.core.quantize import Quantizer

    m = moeq.load(path, dtype=dtype, progress=False)

    def qdq(w):
        wq, meta = Quantizer.quantize(w.float(), nbits=nbits, channel_wise=True, group_size=group_size,
                                      optimize=True, round_zero=nbits == 4, axis=1, bitpack=False, device="cpu")
        meta["compute_dtype"] = torch.float32
        return Quantizer.dequantize(wq, meta).to(w.dtype)

    n = 0
    with torch.no_grad():
        for name, mod in m.named_modules():
            if hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj"):
                for p in (mod.gate_up_proj, mod.down_proj):
                    for e in range(p.shape[0]):
                        p[e] = qdq(p[e])
                        n += p[e].numel()
            elif name.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj"):
                mod.weight.copy_(qdq(mod.weight))
                n += mod.weight.numel()
    return m, n, nbits + 32 / group_size


def experts_bpw(info: dict) -> float:
    """Bits per weight of the routed experts alone (``moeq.inspect``'s module rows)."""
    rows = [r for r in info["modules"] if ".experts." in r["module"]]
    n = sum(int(torch.tensor(r["shape"]).prod()) for r in rows)
    return 8.0 * sum(r["bytes"] for r in rows) / max(n, 1)


def _row(method: str, secs: float, bpw: float, params: int) -> dict:
    """A table row before evaluation: how long quantizing took (bf16 bytes quantized per second) and its size."""
    return {"method": method, "quantize_seconds": secs, "bits_per_weight": bpw, "quantized_params": params,
            "quantize_gbps": params * 2 / secs / 1e9 if secs else 0.0}


def bf16_gguf(model_dir: str, out: Path) -> Path:
    """The checkpoint as a BF16 GGUF (moeq's export): what llama.cpp's tools quantize and score."""
    from moeq.export import export  # noqa: PLC0415

    export(moeq.load(model_dir, dtype=torch.bfloat16, progress=False), out, "gguf", source=model_dir)
    return out / "model.gguf"


def llamacpp_models(model_dir: str, specs: list[str], dtype: torch.dtype, work: Path, label: str = "",
                    imatrix_chunks: int = 200) -> tuple[dict, dict, dict]:
    """llama.cpp's types on the same fixture (see the module docstring): models, rows, and what was checked about
    the conversion. A spec is ``TYPE[:pure][:imatrix|:moeq-imatrix|:moeq-imatrix-self][:experts]``; the importance
    matrix (computed once per model, by ``llama-imatrix`` on :func:`calibration_text`) is what the Hub's GGUF
    uploaders use;
    ``moeq-imatrix`` is moeq's data-free one (``moeq imatrix``) on random token ids, ``moeq-imatrix-self`` on text
    the model samples itself (no text either way)."""
    exe = llamacpp.find_tool("llama-quantize")
    if exe is None:
        print("skipping llama.cpp rows: llama-quantize not found (build steps in benchmarks/llamacpp.py)")
        return {}, {}, {}
    work.mkdir(parents=True, exist_ok=True)
    src = bf16_gguf(model_dir, work / "moeq-bf16")
    info: dict = {"llama_quantize": str(exe), "build": llamacpp.build_flags(exe)}
    try:
        theirs = llamacpp.convert(Path(model_dir), work / "converter-bf16.gguf")
        info["converter_tensors_identical"] = llamacpp.same_tensors(src, theirs)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"convert_hf_to_gguf.py did not run ({e}); using moeq's BF16 export unchecked")
        info["converter_tensors_identical"] = None
    imat = None
    if any("imatrix" in s.split(":")[1:] for s in specs):
        tool = llamacpp.find_tool("llama-imatrix")
        if tool is None:
            print("skipping the imatrix rows: llama-imatrix not found")
            specs = [s for s in specs if "imatrix" not in s.split(":")[1:]]
        else:
            text = work / "calibration.txt"
            books = calibration_text(sorted(DATA.glob("text_*.txt")), imatrix_chunks * 512 * 6)  # ~4.5 chars/token
            text.write_text("\n\n".join(books), encoding="utf-8")
            t0 = time.perf_counter()
            imat = llamacpp.imatrix(tool, src, text, work / "imatrix.gguf", imatrix_chunks)
            info["imatrix"] = {"text": "equal shares of the first 90% of the six ../shared/data novels (disjoint "
                                       "from the scored last 10%)",
                               "chunks": imatrix_chunks, "ctx": 512, "tokens": imatrix_chunks * 512,
                               "seconds": time.perf_counter() - t0}
    free = {}
    for opt, inputs in MOEQ_IMATRIX.items():  # moeq's data-free statistic as llama.cpp's imatrix
        if not any(opt in s.split(":")[1:] for s in specs):
            continue
        from moeq.loader import imatrix  # noqa: PLC0415

        free[opt] = work / f"{opt}.gguf"
        t0 = time.perf_counter()
        imatrix(model_dir, free[opt], tokens=MOEQ_IMATRIX_TOKENS, progress=False, overwrite=free[opt].exists(),
                inputs=inputs)
        info[opt.replace("-", "_")] = {"text": f"none: {INPUT_TEXT[inputs]} (moeq imatrix --importance-inputs "
                                               f"{inputs})", "tokens": MOEQ_IMATRIX_TOKENS,
                                       "seconds": time.perf_counter() - t0}
    models, rows = {}, {}
    for spec in specs:
        qtype, *opts = spec.split(":")
        pure, experts = "pure" in opts, "experts" in opts
        weighted = next((o for o in ("imatrix", *MOEQ_IMATRIX) if o in opts), None)
        name = (f"{label}llama.cpp {qtype}" + (" experts, attention IQ4_NL, k/v Q8_0" if experts else
                                               " --pure" if pure else " (its mix)")
                + {"imatrix": " +imatrix", "moeq-imatrix": " +moeq imatrix (no text)",
                   "moeq-imatrix-self": " +moeq imatrix (self-sampled, no text)", None: ""}[weighted])
        t0 = time.perf_counter()
        tag = {"imatrix": "-imat", "moeq-imatrix": "-mimat", "moeq-imatrix-self": "-simat", None: ""}[weighted]
        out = llamacpp.quantize(exe, src, work / f"{qtype}{'-pure' if pure else ''}{tag}"
                                f"{'-experts' if experts else ''}.gguf", qtype, pure,
                                imat if weighted == "imatrix" else free.get(weighted), experts)
        secs = time.perf_counter() - t0
        bpw, types, params = llamacpp.bits_per_weight(out)
        models[name] = moeq.load(out, dtype=dtype, progress=False)
        rows[name] = _row(name, secs, bpw, params) | {"ggml_types": types, "imatrix": weighted is not None,
                                                      "imatrix_source": weighted,
                                                      "experts_bits_per_weight": llamacpp.bits_per_weight(
                                                          out, ("_exps.",))[0]}
    return models, rows, info


def calibration_text(files: list[Path], chars: int, frac: float = 0.9) -> list[str]:
    """The importance matrix's text: an equal share of ``chars`` from each book, taken from its first ``frac`` (past
    the first 5%: front matter), so disjoint from :func:`heldout_text`."""
    out = []
    for f in files:
        t = f.read_text(encoding="utf-8", errors="replace")
        start = int(len(t) * 0.05)
        out.append(t[start:min(start + chars // len(files), int(len(t) * frac))])
    return out


def _cpu() -> str:
    c = cpu_summary()
    return f"{c['model']}{' (AMX)' if 'amx_tile' in c['flags'] else ''}, {torch.get_num_threads()} threads"


def heldout_text(files: list[Path], frac: float = 0.1) -> list[str]:
    out = []
    for f in files:
        t = f.read_text(encoding="utf-8", errors="replace")
        out.append(t[int(len(t) * (1 - frac)):])
    return out


def rotated_models(args, dtype: torch.dtype, work: Path) -> tuple[dict, dict, dict]:
    """The model rotated by :func:`moeq.rotate_` (in fp32, saved fp32, so the rotation adds no rounding of its own),
    unquantized and with each ``--rotate`` method, and llama.cpp's ``--rotate-llamacpp`` types on its GGUF."""
    src = moeq.load(args.model, dtype=torch.float32, progress=False)
    rot = moeq.rotate_(src)
    moeq.save(src, work / "model", source=args.model)
    del src
    path = str(work / "model")
    label = "rotated: unquantized"
    models, rows = {label: moeq.load(path, dtype=dtype, progress=False)}, {label: _row(label, 0.0, 16.0, 0)}
    for name in args.rotate:
        label = f"rotated: {name}"
        t0 = time.perf_counter()
        m = moeq.load(path, quant=methods()[name], dtype=dtype, progress=False)
        secs = time.perf_counter() - t0
        info = moeq.inspect(m)
        models[label] = m
        rows[label] = _row(label, secs, info["quantized_bits_per_weight"], info["quantized_params"])
    lc_models, lc_rows, lc_info = (llamacpp_models(path, args.rotate_llamacpp, dtype, work / "llamacpp", "rotated: ",
                                                   args.imatrix_chunks) if args.rotate_llamacpp else ({}, {}, {}))
    return {**models, **lc_models}, {**rows, **lc_rows}, {"rotation": dataclasses.asdict(rot), "llamacpp": lc_info}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "moeq-fixtures-out" / "smollm2-moe"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=6144)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", default=str(HERE / "results" / "accuracy.json"))
    ap.add_argument("--merge", action="store_true", help="update/append these rows in --out instead of rewriting")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="compute dtype of the reference and of every model")
    ap.add_argument("--llamacpp", nargs="*", default=None,
                    metavar="TYPE[:pure][:imatrix|:moeq-imatrix|:moeq-imatrix-self]",
                    help=f"llama.cpp rows (default {' '.join(LLAMACPP_TYPES)}; none when given without types); "
                         ":imatrix weights the type by llama-imatrix's importance matrix, :moeq-imatrix by moeq's "
                         "data-free one (moeq imatrix, no text) on random ids, :moeq-imatrix-self on self-sampled "
                         "text; :experts quantizes only the expert stacks to TYPE")
    ap.add_argument("--imatrix-chunks", type=int, default=200, help="llama-imatrix windows of 512 tokens")
    ap.add_argument("--rotate", nargs="*", default=None, metavar="METHOD",
                    help="also score these methods (names of methods()) on the model rotated by moeq.rotate_ "
                         "(rotated in fp32, saved fp32): rows 'rotated: ...', with the rotated unquantized model")
    ap.add_argument("--rotate-llamacpp", nargs="*", default=[],
                    metavar="TYPE[:pure][:imatrix|:moeq-imatrix|:moeq-imatrix-self]",
                    help="llama.cpp types applied to the rotated model (its own BF16 GGUF and importance matrix)")
    ap.add_argument("--activations", nargs="*", default=None, metavar="METHOD",
                    help="also score these methods decode-shaped (DECODE_CHUNK tokens per forward over a KV cache), "
                         "with the default and with int8 activations (moeq.set_activations)")
    ap.add_argument("--importance", nargs="*", default=[], metavar="METHOD",
                    help="also score these methods (names of methods()) quantized with data-free importance "
                         "(moeq.load(..., importance=TOKENS), on --importance-inputs)")
    ap.add_argument("--importance-tokens", type=int, default=8192)
    ap.add_argument("--importance-inputs", nargs="+", choices=list(INPUTS), default=["random"],
                    help="the --importance rows' inputs (moeq.load(importance_inputs=)): random token ids (rows "
                         "'METHOD +importance'), text the model samples itself (rows 'METHOD +importance "
                         "(self-sampled)')")
    ap.add_argument("--bpw", nargs="*", type=float, default=[], metavar="BITS",
                    help="also score data-free bit allocation (moeq.allocate: sensitivities measured once on the "
                         "reference model, each tensor's method chosen for each budget): rows 'moeq bpw BITS', and "
                         "with --bpw-importance also 'moeq bpw BITS +importance'")
    ap.add_argument("--bpw-ladder", nargs="*", default=None, metavar="METHOD",
                    help="the allocation's candidate methods, cheapest first (default moeq.allocate.LADDER); rows "
                         "of another ladder say 'ladder from CHEAPEST'")
    ap.add_argument("--bpw-importance", action="store_true")
    ap.add_argument("--bpw-importance-only", action="store_true", help="only the 'moeq bpw BITS +importance' rows")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tokenize(tok, heldout_text(sorted(DATA.glob("text_*.txt"))))
    ref = moeq.load(args.model, dtype=dtype, progress=False)
    models, rows = {}, {}
    if dtype == torch.float32:
        name = FLOOR
        models[name] = moeq.load(args.model, dtype=torch.bfloat16, progress=False)
        rows[name] = _row(name, 0.0, 16.0, 0)
    for name, cfg in methods().items():
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        m = moeq.load(args.model, quant=cfg, dtype=dtype, progress=False)
        secs = time.perf_counter() - t0
        info = moeq.inspect(m)
        models[name] = m
        rows[name] = _row(name, secs, info["quantized_bits_per_weight"], info["quantized_params"]) | {
            "experts_bits_per_weight": experts_bpw(info)}
    for name, inputs in ((n, i) for n in args.importance for i in args.importance_inputs):
        label = f"{name} +importance{IMPORTANCE_LABEL[inputs]}"
        t0 = time.perf_counter()
        m = moeq.load(args.model, quant=methods()[name], dtype=dtype, progress=False,
                      importance=args.importance_tokens, importance_inputs=inputs)
        secs = time.perf_counter() - t0  # both passes and the statistics' forward (and sampling)
        info = moeq.inspect(m)
        models[label] = m
        rows[label] = {**_row(label, secs, info["quantized_bits_per_weight"], info["quantized_params"]),
                       "importance_tokens": args.importance_tokens, "importance_inputs": inputs}
    if args.bpw:
        from moeq import allocate  # noqa: PLC0415

        from moeq.loader import importance_for  # noqa: PLC0415

        bpw_inputs = args.importance_inputs[0]  # the bpw rows' importance: the first of --importance-inputs
        measured, ladder = {}, tuple(args.bpw_ladder or allocate.LADDER)
        sources = (args.importance_tokens,) if args.bpw_importance_only else (
            (0, args.importance_tokens) if args.bpw_importance else (0,))
        for imp in sources:
            t0 = time.perf_counter()  # as moeq.load(bpw=, importance=): statistics first, errors weighted by them
            stats = importance_for(Path(args.model), "iq4nl", dtype, False, imp, bpw_inputs) if imp else None
            measured[imp] = (allocate.measure(ref, ladder, progress=False, importance=stats), time.perf_counter() - t0)
        for bits in args.bpw:
            for imp, (sens, measure_secs) in measured.items():  # measure_secs: shared by every budget, in each row
                label = (f"moeq bpw {bits:g}" + (f" +importance{IMPORTANCE_LABEL[bpw_inputs]}" if imp else "")
                         + (f" (ladder from {ladder[0]})" if ladder != allocate.LADDER else ""))
                try:
                    cfg, plan = allocate.config(sens, bits), allocate.summary(sens, bits)
                except MoeqError as e:  # a budget outside the ladder's range: the other budgets still run
                    print(f"{label}: {e}", file=sys.stderr)
                    continue
                t0 = time.perf_counter()
                m = moeq.load(args.model, quant=cfg, dtype=dtype, progress=False, importance=imp,
                              importance_inputs=bpw_inputs)
                secs = measure_secs + time.perf_counter() - t0
                info = moeq.inspect(m)
                models[label] = m
                rows[label] = {**_row(label, secs, info["quantized_bits_per_weight"], info["quantized_params"]),
                               "allocation": plan, "allocate_seconds": measure_secs} | (
                    {"importance_tokens": imp, "importance_inputs": bpw_inputs} if imp else {})
    for name, (nbits, gs) in HQQ_LIB.items():
        if args.only and name not in args.only:
            continue
        try:
            t0 = time.perf_counter()
            m, n, bpw = hqq_library_model(args.model, nbits, gs, dtype)
        except ImportError:
            print(f"skipping {name}: the hqq library is not installed")
            continue
        secs = time.perf_counter() - t0
        models[name] = m
        rows[name] = _row(name, secs, bpw, n)
    chunks = {}
    for name in args.activations or []:
        cfg = methods()[name]
        for mode, label in (("default", f"{name}, decode-shaped"), ("int8", f"{name}, int8 activations")):
            m = moeq.load(args.model, quant=cfg, dtype=dtype, progress=False, activations=mode)
            info = moeq.inspect(m)
            models[label], chunks[label] = m, DECODE_CHUNK
            rows[label] = {**_row(label, 0.0, info["quantized_bits_per_weight"], info["quantized_params"]),
                           "activations": mode, "chunk": DECODE_CHUNK}
    specs = LLAMACPP_TYPES if args.llamacpp is None else args.llamacpp
    if args.only is not None:
        specs = [t for t in specs if f"llama.cpp {t.split(':')[0]}" in " ".join(args.only)]
    with tempfile.TemporaryDirectory(prefix="moeq-acc-") as work:
        lc_models, lc_rows, lc_info = (llamacpp_models(args.model, specs, dtype, Path(work) / "base",
                                                       imatrix_chunks=args.imatrix_chunks) if specs else ({}, {}, {}))
        if args.rotate is not None:
            r_models, r_rows, r_info = rotated_models(args, dtype, Path(work) / "rotated")
            lc_models.update(r_models)
            lc_rows.update(r_rows)
            lc_info = {**lc_info, "rotated": r_info}
    models.update(lc_models)
    rows.update(lc_rows)
    res = evaluate_many(models, ref, ids, ctx=args.ctx, max_tokens=args.max_tokens, chunks=chunks)
    for k, r in res.items():
        rows[k].update(r.to_dict())
    if args.merge and Path(args.out).exists():
        prev = json.loads(Path(args.out).read_text())
        old = {r["method"]: r for r in prev["rows"]}
        old.update(rows)
        rows = old
        lc_info = {**prev.get("llamacpp", {}), **lc_info}  # keep what the file says of rows this run did not make
    base = rows.get("vLLM RTN-int4 sym g192")
    for r in rows.values():
        if base:
            r["kl_vs_vllm_g192"] = r["mean_kl"] / base["mean_kl"]
    out = {"model": args.model, "dtype": args.dtype, "ctx": args.ctx, "tokens": next(iter(res.values())).tokens,
           "ref_ppl": next(iter(res.values())).ref_ppl, "llamacpp": lc_info, "cpu": _cpu(), "rows": list(rows.values())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, out)
    print(f"reference ({args.dtype}) PPL {out['ref_ppl']:.3f} on {out['tokens']} held-out tokens, ctx {args.ctx}\n")
    print("| method | bits/weight | PPL | mean KL | p99 KL | top-1 | KL × vLLM g192 | quantize s (GB/s) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows.values():
        print(f"| {r['method']} | {r['bits_per_weight']:.3f} | {r['ppl']:.3f} | {r['mean_kl']:.4f} | "
              f"{r['p99_kl']:.3f} | {r['top1']:.2%} | {r.get('kl_vs_vllm_g192', float('nan')):.2f} | "
              f"{r['quantize_seconds']:.1f} ({r['quantize_gbps']:.2f}) |")


if __name__ == "__main__":
    main()
