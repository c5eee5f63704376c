"""Property-based fuzzing of everything moeq reads (hypothesis, seeded, a bounded number of examples per run).

Each example mutates a valid checkpoint (safetensors header bytes, tensors' shapes/dtypes/presence/special values,
config.json sizes, a saved moeq checkpoint's per-module metadata, a bitsandbytes quant_state JSON and statistics) and
loads it in the isolated worker, which also runs a prefill and two decode steps through the native kernels. The
property: the load raises MoeqError, or it succeeds and reproduces the unmutated checkpoint's logits exactly. A crash,
another exception type, or different logits with no error fails the example.

Budget: ``MOEQ_FUZZ_EXAMPLES`` examples per target (default 12, CI); run e.g. ``MOEQ_FUZZ_EXAMPLES=400 pytest
tests/untrusted/test_fuzz.py`` for a long run. Examples are derandomized (the same ones every run) unless
``MOEQ_FUZZ_SEED`` is set.
"""
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.untrusted import mutate
from tests.untrusted.conftest import ROOT

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("MOEQ_FUZZ_EXAMPLES", "12"))
SEED = os.environ.get("MOEQ_FUZZ_SEED")
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=SEED is None, database=None, print_blob=True,
                suppress_health_check=list(HealthCheck))
BNB = ROOT / "tests" / "fixtures" / "bnb"

INTERESTING_INTS = [-(1 << 40), -1, 0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 48, 64, 127, 128, 256, 4096, 65536, 1 << 31,
                    1 << 40]
json_scalar = st.one_of(st.sampled_from(INTERESTING_INTS), st.integers(), st.text(max_size=8),
                        st.sampled_from([float("nan"), float("inf"), -0.5, 1e300, 2.5]), st.booleans(), st.none())
json_value = st.one_of(json_scalar, st.lists(st.sampled_from(INTERESTING_INTS), max_size=4),
                       st.dictionaries(st.text(max_size=4), json_scalar, max_size=2))
SPECIAL = [float("nan"), float("inf"), float("-inf")]
ST_DTYPES = {"BF16": (2, "f"), "F16": (2, "f"), "F32": (4, "f"), "F64": (8, "f"), "U8": (1, "i"), "I8": (1, "i"),
             "I32": (4, "i"), "BOOL": (1, "b"), "Q4": None, "": None}
DTYPES = [torch.uint8, torch.int8, torch.int32, torch.float32, torch.bfloat16, torch.float16]


# ---- mutations: each takes (hypothesis data, checkpoint dir) and edits the copy in place -------------------------
def m_header(data, d: Path) -> None:
    path = d / mutate.ST
    header, blob = mutate.read_raw(path)
    names = sorted(k for k in header if k != "__metadata__")
    kind = data.draw(st.sampled_from(["offset", "shape", "dtype", "length", "truncate", "append", "pad", "flip"]))
    hb = None
    if kind in ("offset", "shape", "dtype"):
        e = header[data.draw(st.sampled_from(names))]
        if kind == "offset":
            i = data.draw(st.integers(0, 1))
            e["data_offsets"][i] += data.draw(st.sampled_from([-64, -2, -1, 1, 2, 64, 1 << 40]))
        elif kind == "shape" and e["shape"]:
            i = data.draw(st.integers(0, len(e["shape"]) - 1))
            e["shape"][i] = data.draw(st.one_of(st.sampled_from(INTERESTING_INTS), json_scalar))
        else:  # another size or kind (BF16 -> F16 would be a valid file with other values)
            was = ST_DTYPES.get(e["dtype"])
            e["dtype"] = data.draw(st.sampled_from([k for k, v in ST_DTYPES.items() if v is None or v != was]))
    elif kind == "length":
        hb = json.dumps(header).encode()
        raw = mutate.ST
        path.write_bytes((len(hb) + data.draw(st.sampled_from([-3, -1, 1, 5, 1 << 33]))).to_bytes(8, "little")
                         + hb + blob)
        return
    elif kind == "truncate":
        blob = blob[: len(blob) - data.draw(st.integers(1, 4096))]
    elif kind == "append":
        blob = blob + bytes(data.draw(st.integers(1, 64)))
    elif kind == "pad":  # trailing spaces in the header: a valid, equivalent file
        hb = json.dumps(header).encode() + b" " * data.draw(st.integers(1, 7))
    else:
        hb = bytearray(json.dumps(header).encode())
        i = data.draw(st.integers(0, len(hb) - 1))
        hb[i] = data.draw(st.integers(0, 255))
        hb = bytes(hb)
    mutate.write_raw(path, header, blob, hb)


def m_tensor(data, d: Path, stats_only: bool = False) -> None:
    sd = mutate.tensors(d)
    names = sorted(sd)
    key = data.draw(st.sampled_from(names))
    t = sd[key]
    kind = data.draw(st.sampled_from(["drop", "rename", "add", "shrink", "grow", "reshape", "dtype", "special"]))
    if kind == "drop":
        del sd[key]
    elif kind == "rename":
        sd[data.draw(st.sampled_from(names)) + data.draw(st.sampled_from(["", "_x", ".weight", "_zero", "_scale"]))] = \
            sd.pop(key)
    elif kind == "add":
        sd[key.rpartition(".")[0] + "." + data.draw(st.sampled_from(["zero", "w13_zero", "bias", "x"]))] = t.clone()
    elif kind in ("shrink", "grow") and t.numel():
        k = data.draw(st.integers(1, max(1, t.numel() // 2)))
        flat = t.reshape(-1)
        sd[key] = flat[:-k].clone() if kind == "shrink" else torch.cat([flat, flat[:k]])
    elif kind == "reshape" and t.ndim >= 1:
        shapes = [(t.numel(),), (1, t.numel()), tuple(reversed(t.shape)), (*t.shape, 1)]
        sd[key] = t.reshape(data.draw(st.sampled_from(shapes))).clone()
    elif kind == "dtype":  # across kinds (float <-> integer): a float-to-float cast is a valid, different file
        sd[key] = t.to(data.draw(st.sampled_from([x for x in DTYPES if x.is_floating_point != t.is_floating_point()])))
    elif kind == "special" and t.is_floating_point() and t.numel():
        t = t.clone()
        idx = data.draw(st.integers(0, t.numel() - 1))
        if t.dtype == torch.float8_e4m3fn:  # e4m3 has no Inf (a cast saturates it to 448, a valid value): its NaNs
            t.view(torch.uint8).view(-1)[idx] = data.draw(st.sampled_from([0x7F, 0xFF]))
        else:
            t.view(-1)[idx] = data.draw(st.sampled_from(SPECIAL + [-1.0] * (
                "absmax" in key or "SCB" in key or "scb" in key or "scale_inv" in key)))
        sd[key] = t
    mutate.save_tensors(d, sd)


SIZES = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_local_experts"]


def m_config(data, d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    kind = data.draw(st.sampled_from(["size", "top_k", "delete", "qc"]))
    present = [k for k in SIZES if k in cfg]
    if kind == "size" and present:
        cfg[data.draw(st.sampled_from(present))] = data.draw(st.one_of(st.sampled_from(INTERESTING_INTS), json_value))
    elif kind == "top_k":  # only values no model can have (a valid smaller top-k is a different, valid model)
        n = cfg.get("num_experts") or cfg.get("num_local_experts") or 4
        cfg["num_experts_per_tok"] = data.draw(st.one_of(st.integers(n + 1, 1000), st.integers(-5, 0), st.text()))
    elif kind == "delete" and present:
        del cfg[data.draw(st.sampled_from(present))]
    elif kind == "qc":
        qc = cfg.get("quantization_config")
        if isinstance(qc, dict) and qc:
            key = data.draw(st.sampled_from(sorted(qc)))
            if key in ("bnb_4bit_compute_dtype", "llm_int8_threshold", "llm_int8_skip_modules", "version",
                       "format_version", "config", "formats"):
                return  # settings that do not describe stored data (or are informational)
            qc[key] = data.draw(json_value)
        else:
            cfg["quantization_config"] = data.draw(json_value)
    (d / "config.json").write_text(json.dumps(cfg))


def m_saved_meta(data, d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    modules = cfg["quantization_config"]["modules"]
    name = data.draw(st.sampled_from(sorted(modules)))
    entry = modules[name]
    if data.draw(st.booleans()):
        slot = entry["slots"][data.draw(st.sampled_from(sorted(entry["slots"])))]
        key = data.draw(st.sampled_from(sorted(slot) + ["extra"]))
    else:
        slot, key = entry, data.draw(st.sampled_from(sorted(entry) + ["extra"]))
    if key in slot and data.draw(st.booleans()):
        del slot[key]
    elif key == "shape" and isinstance(slot.get("shape"), list):
        i = data.draw(st.integers(0, len(slot["shape"]) - 1))
        slot["shape"][i] = data.draw(st.sampled_from(INTERESTING_INTS))
    else:
        slot[key] = data.draw(json_value)
    (d / "config.json").write_text(json.dumps(cfg, allow_nan=True))


def m_quant_state(data, d: Path) -> None:
    sd = mutate.tensors(d)
    heads = sorted(k.split(".quant_state.")[0] for k in sd if ".quant_state." in k)
    if not heads:
        return m_tensor(data, d)
    qk, qs = mutate.quant_state(sd, data.draw(st.sampled_from(heads)))
    key = data.draw(st.sampled_from(sorted(qs) + ["extra"]))
    if key in qs and data.draw(st.booleans()):
        del qs[key]
    elif key == "nested_offset":  # another finite offset is a valid file with other values: only invalid ones
        qs[key] = data.draw(st.one_of(st.sampled_from(SPECIAL), st.text(max_size=4), st.none(), st.lists(json_scalar)))
    else:
        qs[key] = data.draw(json_value)
    sd[qk] = torch.tensor(list(json.dumps(qs, allow_nan=True).encode()), dtype=torch.uint8)
    mutate.save_tensors(d, sd)


def check(isolated, ckpt: Path, ref: Path, mutation, data, quant=None, dtype=None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = mutate.copy(ckpt, Path(tmp) / "c")
        mutation(data, d)
        reply = isolated.load(d, quant=quant, ref=ref, dtype=dtype)
    event(f"{mutation.__name__}: {reply['outcome']}")  # --hypothesis-show-statistics: how often each outcome
    assert reply["outcome"] in ("error", "ok"), reply
    if reply["outcome"] == "ok":
        assert reply["equal"], f"loaded without an error but computes different logits: {reply}"


# ---- the properties -----------------------------------------------------------------------------------------------
SAVED_METHODS = ["rtn-int4", "rtn-int4-asym", "rtn-int8", "nf4", "int8", "iq4nl", "iq4nl-dq", "nl3", "q5_0", "q4_0",
                 "q8_0", "fp8"]
COMPUTE = [None, None, "float16", "float32"]  # the saved bf16 compute, and fp16/fp32 over the same bf16 scales


@FUZZ
@given(data=st.data())
def test_fuzz_saved_checkpoints(saved, isolated, data):
    dtype = data.draw(st.sampled_from(COMPUTE), label="dtype")
    ckpt, ref = saved(data.draw(st.sampled_from(SAVED_METHODS), label="method"), dtype=dtype)
    mutation = data.draw(st.sampled_from([m_header, m_tensor, m_saved_meta, m_saved_meta, m_config]), label="how")
    check(isolated, ckpt, ref, mutation, data, dtype=dtype)


@pytest.fixture(scope="module")
def bnb_refs(isolated, tmp_path_factory):
    out = {}
    for name in ("qwen2_moe-nf4-dq", "qwen2_moe-fp4", "mixtral-int8", "olmoe-nf4-skipgate"):
        ref = tmp_path_factory.mktemp("bnbref") / f"{name}.pt"
        r = isolated.load(BNB / name, save=ref)
        assert r["outcome"] == "ok" and r["finite"], r
        out[name] = ref
    return out


@FUZZ
@given(data=st.data())
def test_fuzz_prequantized_bnb(bnb_refs, isolated, data):
    name = data.draw(st.sampled_from(sorted(bnb_refs)), label="fixture")
    mutation = data.draw(st.sampled_from([m_quant_state, m_quant_state, m_tensor, m_header, m_config]), label="how")
    check(isolated, BNB / name, bnb_refs[name], mutation, data)


@pytest.fixture(scope="module")
def source_ref(tiny_ckpt, isolated, tmp_path_factory):
    src = tiny_ckpt("qwen3_moe")
    ref = tmp_path_factory.mktemp("srcref") / "ref.pt"
    r = isolated.load(src, quant="rtn-int4", save=ref)
    assert r["outcome"] == "ok" and r["finite"], r
    return src, ref


@FUZZ
@given(data=st.data())
def test_fuzz_source_in_flight(source_ref, isolated, data):
    src, ref = source_ref
    mutation = data.draw(st.sampled_from([m_header, m_tensor, m_config]), label="how")
    check(isolated, src, ref, mutation, data, quant="rtn-int4")


def _reference(isolated, tmp_path_factory, src, quant=None):
    """(a checkpoint, the logits file of its unmutated load in the isolated worker)."""
    ref = tmp_path_factory.mktemp("ref") / "ref.pt"
    r = isolated.load(src, quant=quant, save=ref)
    assert r["outcome"] == "ok" and r["finite"], r
    return src, ref


@pytest.fixture(scope="module", params=["deepseek:q4_0", "deepseek:fp8", "ct-group:fp8"])
def fp8_ref(request, isolated, tmp_path_factory):
    """An FP8 checkpoint and the method it loads with: DeepSeek's layout (tiles with partial edges) quantized in
    flight or kept as stored; compressed-tensors' group-scaled FP8 (llm-compressor's layout) kept as stored."""
    from moeq.tiny import make_checkpoint, make_fp8_checkpoint, to_ct_fp8

    kind, quant = request.param.split(":")
    d = tmp_path_factory.mktemp("fp8src")
    if kind == "deepseek":
        src = make_fp8_checkpoint("qwen3_moe", d / "c", block=(48, 80))
    else:
        src = to_ct_fp8(make_checkpoint("mixtral", d / "bf16"), d / "c", "group", 32)
    return (*_reference(isolated, tmp_path_factory, src, quant), quant)


@FUZZ
@given(data=st.data())
def test_fuzz_fp8_source(fp8_ref, isolated, data):
    """FP8 checkpoints (e4m3 codes; scale_inv tiles with partial edges, or compressed-tensors' group scales), quantized
    in flight or kept as stored."""
    src, ref, quant = fp8_ref
    mutation = data.draw(st.sampled_from([m_header, m_tensor, m_tensor, m_config]), label="how")
    check(isolated, src, ref, mutation, data, quant=quant)


@pytest.fixture(scope="module")
def mxfp4_ref(isolated, tmp_path_factory):
    from moeq.tiny import make_mxfp4_checkpoint

    return _reference(isolated, tmp_path_factory, make_mxfp4_checkpoint(tmp_path_factory.mktemp("mxsrc") / "c"))


@FUZZ
@given(data=st.data())
def test_fuzz_mxfp4_source(mxfp4_ref, isolated, data):
    """A gpt-oss MXFP4 checkpoint (uint8 E2M1 blocks and E8M0 scales, bf16 biases and attention), loaded as stored."""
    src, ref = mxfp4_ref
    mutation = data.draw(st.sampled_from([m_header, m_tensor, m_tensor, m_config]), label="how")
    check(isolated, src, ref, mutation, data)


@pytest.fixture(scope="module", params=["gptq", "awq"])
def gptq_ref(request, isolated, tmp_path_factory):
    from moeq.tiny import make_checkpoint, to_gptq

    src = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("gptqsrc") / "c")
    out = to_gptq(src, tmp_path_factory.mktemp("gptq") / "c", kind=request.param, sym=False)
    return _reference(isolated, tmp_path_factory, out)


@FUZZ
@given(data=st.data())
def test_fuzz_gptq_awq(gptq_ref, isolated, data):
    """GPTQ (v1 zero points, g_idx) and AWQ (interleaved nibbles) int32 words, fp16 scales, loaded as stored."""
    src, ref = gptq_ref
    mutation = data.draw(st.sampled_from([m_header, m_tensor, m_tensor, m_config]), label="how")
    check(isolated, src, ref, mutation, data)


def m_gguf(data, d: Path) -> None:
    """Structural damage to a GGUF file: its counts/version, its tensor-info table (types, dims, offsets), a
    truncated or extended tail. (Not the values inside metadata strings: another number in the stored transformers
    config is a valid, different model.)"""
    import gguf  # noqa: PLC0415

    path = d / "model.gguf"
    raw = bytearray(path.read_bytes())
    r = gguf.GGUFReader(str(path))
    info_start = min(int(t.field.offset) for t in r.tensors)
    info_end = max(int(t.field.offset) + sum(int(p.nbytes) for p in t.field.parts) for t in r.tensors)
    kind = data.draw(st.sampled_from(["head", "info", "truncate", "append"]))
    if kind in ("head", "info"):
        lo, hi = (4, 24) if kind == "head" else (info_start, info_end - 1)
        i = data.draw(st.integers(lo, hi))
        raw[i] = data.draw(st.integers(0, 255))
    elif kind == "truncate":
        del raw[len(raw) - data.draw(st.integers(1, 4096)):]
    else:
        raw += bytes(data.draw(st.integers(1, 64)))
    path.write_bytes(bytes(raw))


GGUF_FAMILIES = {"qwen3_moe": ({"norm_topk_prob": True}, "q4_0"),  # llama.cpp graphs with their own readers:
                 "deepseek_v3": ({}, "q4_0"),  # MLA's kv_b split, sigmoid router bias
                 "gpt_oss": ({}, "mxfp4"),  # expert biases, sinks, YaRN, sliding window
                 "glm4_moe": ({"use_qk_norm": True}, "iq4nl")}  # partial rotary, qk-norm


@pytest.fixture(scope="module")
def gguf_refs(tiny_ckpt, isolated, tmp_path_factory):
    """Each family's moeq GGUF export and its logits, and the same file without moeq's keys (as llama.cpp's converter
    writes it: the config from its llama.cpp metadata)."""
    import moeq  # noqa: PLC0415
    from moeq.export import export  # noqa: PLC0415
    from tests.models.test_gguf_foreign import strip  # noqa: PLC0415

    out = {}
    for family, (kw, method) in GGUF_FAMILIES.items():
        src = tiny_ckpt(family, **kw)
        d = tmp_path_factory.mktemp(f"ggufref-{family}")
        export(moeq.load(src, quant=method, progress=False), d / "g", "gguf", source=src)
        (d / "f").mkdir()
        strip(d / "g" / "model.gguf", d / "f" / "model.gguf")
        for kind in ("g", "f"):
            r = isolated.load(d / kind, save=d / f"{kind}.pt")
            assert r["outcome"] == "ok" and r["finite"], (family, kind, r)
            out[(family, kind)] = d / kind, d / f"{kind}.pt"
    return out


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_readback(gguf_refs, isolated, data):
    ckpt, ref = gguf_refs[(data.draw(st.sampled_from(sorted(GGUF_FAMILIES)), label="family"), "g")]
    check(isolated, ckpt, ref, m_gguf, data)


@FUZZ
@given(data=st.data())
def test_fuzz_foreign_gguf(gguf_refs, isolated, data):
    ckpt, ref = gguf_refs[(data.draw(st.sampled_from(sorted(GGUF_FAMILIES)), label="family"), "f")]
    check(isolated, ckpt, ref, m_gguf, data)


