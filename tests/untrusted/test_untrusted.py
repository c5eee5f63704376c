"""Every case of issue #15 as a regression test: untrusted checkpoints and arguments get a clear MoeqError naming
the file/tensor/argument (exit 2 from the CLI), never a crash, a hang, a wrong result with exit 0, or lost data.
Loads run in a separate worker process (``isolated``), so a native crash fails only its own test."""
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moeq
from moeq.cli import main
from moeq.io.writer import MARKER
from tests.untrusted import mutate
from tests.untrusted.conftest import ROOT, assert_refused

BNB = ROOT / "tests" / "fixtures" / "bnb"
W13 = "model.layers.0.mlp.experts"
Q = "model.layers.0.self_attn.q_proj"


# ---- 1. --overwrite never deletes what moeq did not write ---------------------------------------------------------
def tree(p: Path) -> dict:
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


def test_overwrite_parent_of_source_refused(tiny_ckpt, tmp_path, capsys):
    parent = tmp_path / "models"
    src = mutate.copy(tiny_ckpt("qwen3_moe"), parent / "qwen")
    (parent / "notes.txt").write_text("mine")
    before = tree(parent)
    assert main(["quantize", str(src), str(parent), "--overwrite"]) == 2
    assert "source" in capsys.readouterr().err
    assert tree(parent) == before and sorted(p.name for p in tmp_path.iterdir()) == ["models"]


@pytest.mark.parametrize("target", [".", "~"])
def test_overwrite_cwd_or_home_refused(tiny_ckpt, tmp_path, monkeypatch, capsys, target):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x.txt").write_text("keep")
    assert main(["quantize", str(tiny_ckpt("qwen3_moe")), os.path.expanduser(target), "--overwrite"]) == 2
    assert "current, home or root" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.txt"]  # nothing written, nothing hidden left


def test_overwrite_foreign_folder_and_symlink_refused(tiny_ckpt, tmp_path, capsys):
    src = tiny_ckpt("qwen3_moe")
    other = mutate.copy(tiny_ckpt("mixtral"), tmp_path / "other-model")  # somebody's model, not moeq's output
    assert main(["quantize", str(src), str(other), "--overwrite"]) == 2
    assert "not a moeq output" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out)]) == 0
    (out / "my-notes.md").write_text("added by the user")
    assert main(["quantize", str(src), str(out), "--overwrite"]) == 2
    assert "my-notes.md" in capsys.readouterr().err and (out / "my-notes.md").exists()
    (out / "my-notes.md").unlink()
    link = tmp_path / "link"
    link.symlink_to(out)
    assert main(["quantize", str(src), str(link), "--overwrite"]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert link.is_symlink() and not list(tmp_path.glob(".link*"))
    assert main(["quantize", str(src), str(out), "--overwrite", "--method", "nf4"]) == 0  # a moeq output: replaced
    assert json.loads((out / "config.json").read_text())["quantization_config"]["formats"] == ["bnb4"]


def test_stale_temp_folders_cleaned_and_modes(tiny_ckpt, tmp_path):
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.tmp-{socket.gethostname()}-{dead.pid}-abcd1234"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    live = tmp_path / f".out.tmp-{socket.gethostname()}-{os.getpid()}-abcd1234"  # a live run's: left alone
    live.mkdir()
    old = os.umask(0o022)
    try:
        assert main(["quantize", str(tiny_ckpt("qwen3_moe")), str(tmp_path / "out")]) == 0
    finally:
        os.umask(old)
    assert not stale.exists() and live.exists()
    out = tmp_path / "out"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}
    assert MARKER in {p.name for p in out.iterdir()}


def test_disk_full_leaves_nothing(tiny_ckpt, tmp_path, monkeypatch, capsys):
    import errno

    import moeq.io.writer as writer

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))

    monkeypatch.setattr(writer, "save_file", full)
    assert main(["quantize", str(tiny_ckpt("qwen3_moe")), str(tmp_path / "out")]) == 2
    assert "No space left" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


# ---- 2. edited metadata / tensors of a moeq checkpoint ------------------------------------------------------------
def meta_edit(slot_key, value):
    def fn(cfg):
        mutate.modules(cfg)[W13]["slots"][slot_key[0]][slot_key[1]] = value
    return fn


CASES_SAVED = {
    "w13 shape larger (rtn)": ("rtn-int4", meta_edit(("w13", "shape"), [4, 512, 128]), ["w13", "shape"]),
    "w13 shape larger (int8)": ("int8", meta_edit(("w13", "shape"), [4, 512, 256]), ["w13", "shape"]),
    "group_size 0": ("rtn-int4", meta_edit(("w13", "group_size"), 0), ["w13", "group_size"]),
    "bits 8 on 4-bit data": ("rtn-int4", meta_edit(("w13", "bits"), 8), ["w13", "qdata"]),
    "group size not dividing K": ("rtn-int4", meta_edit(("w2", "group_size"), 48), ["w2"]),
    "missing meta key": ("rtn-int4", lambda c: mutate.modules(c)[W13]["slots"]["w13"].pop("bits"), ["lacks", "bits"]),
    "string bits": ("rtn-int4", meta_edit(("w13", "bits"), "4"), ["bits"]),
    "unknown format": ("nf4", meta_edit(("w13", "format"), "int5"), ["unknown format"]),
    "module not in model": ("rtn-int4", lambda c: mutate.modules(c).update(
        {"model.layers.9.mlp.experts": mutate.modules(c)[W13]}), ["model.layers.9"]),
    "bad activation": ("rtn-int4", lambda c: mutate.modules(c)[W13].update(activation={"kind": "glu", "act": "rm"}),
                       ["activation"]),
    "weight_on_input flipped (fuzz)": ("rtn-int4", lambda c: mutate.modules(c)[W13].update(weight_on_input=True),
                                       ["contradict"]),
    "another valid activation": ("rtn-int4", lambda c: mutate.modules(c)[W13].update(
        activation={"kind": "glu", "act": "gelu", "alpha": 1.702, "limit": 7.0}), ["contradict"]),
    "modules not an object": ("rtn-int4", lambda c: c["quantization_config"].update(modules=[1, 2]), ["modules"]),
}


@pytest.mark.parametrize("case", sorted(CASES_SAVED))
def test_saved_metadata_edits(saved, isolated, tmp_path, case):
    method, edit, words = CASES_SAVED[case]
    d = mutate.copy(saved(method)[0], tmp_path / "c")
    mutate.edit_config(d, edit)
    assert_refused(isolated.load(d), *words)


def shrink(key, n=1):
    def fn(sd):
        sd[key] = sd[key].reshape(-1)[: sd[key].numel() - n].clone()
    return fn


def drop(key):
    return lambda sd: sd.pop(key)


def fill(key, value, count=1):
    def fn(sd):
        t = sd[key].clone()
        t.view(-1)[:count] = value
        sd[key] = t
    return fn


CASES_TENSORS = {
    "truncated qdata": ("rtn-int4", shrink(f"{W13}.w13_qdata", 64), ["w13", "qdata"]),
    "scales of the wrong shape": ("rtn-int4", lambda sd: sd.update(
        {f"{W13}.w2_scale": sd[f"{W13}.w2_scale"].reshape(-1).repeat(2)[:-4].clone()}), ["w2", "scale"]),
    "asym without its zero": ("rtn-int4-asym", drop(f"{W13}.w13_zero"), ["w13", "zero"]),
    "zero above 15": ("rtn-int4-asym", fill(f"{W13}.w13_zero", 200), ["w13", "zero"]),
    "short NF4 code table": ("nf4", shrink(f"{W13}.w13_code", 8), ["w13", "code"]),
    "short absmax": ("nf4", shrink(f"{W13}.w2_absmax", 3), ["w2", "absmax"]),
    "short nested code": ("nf4", shrink(f"{W13}.w2_nested_code", 200), ["w2", "nested_code"]),
    "short SCB": ("int8", shrink(f"{W13}.w13_scb"), ["w13", "SCB"]),
    "NaN scale": ("rtn-int4", fill(f"{W13}.w13_scale", float("nan")), ["w13", "scale", "non-finite"]),
    "Inf SCB": ("int8", fill(f"{W13}.w2_scb", float("inf")), ["w2", "SCB", "non-finite"]),
    "huge scale": ("rtn-int8", fill(f"{Q}.weight_scale", 3e38), ["q_proj", "scale"]),
    "negative absmax": ("fp4", fill(f"{Q}.weight_nested_absmax", -1.0), ["q_proj", "nested_absmax"]),
    "NaN norm": ("rtn-int4", fill("model.norm.weight", float("nan")), ["model.norm.weight", "non-finite"]),
    "qdata as int32": ("rtn-int4", lambda sd: sd.update({f"{Q}.weight_qdata": sd[f"{Q}.weight_qdata"].int()}),
                       ["q_proj", "qdata", "dtype"]),
}


@pytest.mark.parametrize("case", sorted(CASES_TENSORS))
def test_saved_tensor_edits(saved, isolated, tmp_path, case):
    method, edit, words = CASES_TENSORS[case]
    d = mutate.copy(saved(method)[0], tmp_path / "c")
    mutate.edit_tensors(d, edit)
    assert_refused(isolated.load(d), *words)


def test_inspect_and_export_refuse_damage(saved, isolated, tmp_path):
    d = mutate.copy(saved("rtn-int4")[0], tmp_path / "c")
    mutate.edit_config(d, meta_edit(("w13", "shape"), [4, 512, 128]))
    for argv in (["inspect", d], ["export", d, tmp_path / "e", "--format", "compressed-tensors"]):
        r = isolated.cli(*argv)
        assert r["rc"] == 2 and "w13" in r["err"] and "Traceback" not in r["err"], r
    assert not (tmp_path / "e").exists()


# ---- 3. pre-quantized bitsandbytes checkpoints ---------------------------------------------------------------------
BNB_E = "model.layers.0.mlp.experts.0.gate_proj.weight"


def qs_edit(field, value):
    def fn(sd):
        qk, qs = mutate.quant_state(sd, BNB_E)
        qs[field] = value
        mutate.set_quant_state(sd, qk, qs)
    return fn


CASES_BNB = {
    "quant_map length 0": ("qwen2_moe-nf4-dq", lambda sd: sd.update({f"{BNB_E}.quant_map": torch.zeros(0)}),
                           [BNB_E, "quant_map"]),
    "quant_map length 4": ("qwen2_moe-fp4", lambda sd: sd.update({f"{BNB_E}.quant_map": sd[f"{BNB_E}.quant_map"][:4]}),
                           [BNB_E, "quant_map"]),
    "nested map length 8": ("qwen2_moe-nf4-dq", lambda sd: sd.update(
        {f"{BNB_E}.nested_quant_map": sd[f"{BNB_E}.nested_quant_map"][:8]}), [BNB_E, "nested"]),
    "NaN nested_offset": ("qwen2_moe-nf4-dq", qs_edit("nested_offset", float("nan")), [BNB_E, "offset"]),
    "Inf nested_offset": ("qwen2_moe-nf4-dq", qs_edit("nested_offset", float("inf")), [BNB_E, "offset"]),
    "string nested_offset": ("qwen2_moe-nf4-dq", qs_edit("nested_offset", {"a": 1}), [BNB_E, "nested_offset"]),
    "NaN nested_absmax": ("qwen2_moe-nf4-dq", fill(f"{BNB_E}.nested_absmax", float("nan")), [BNB_E, "nested_absmax"]),
    "quant_state shape lies": ("qwen2_moe-nf4-dq", qs_edit("shape", [128, 256]), [BNB_E]),
    "quant_state not JSON": ("qwen2_moe-nf4-dq", lambda sd: sd.update(
        {mutate.quant_state(sd, BNB_E)[0]: torch.tensor([1, 2, 255], dtype=torch.uint8)}), [BNB_E, "quant_state"]),
    "NaN SCB": ("mixtral-int8", fill("model.layers.0.block_sparse_moe.experts.0.w1.SCB", float("nan")),
                ["experts.0.w1", "SCB"]),
    "short SCB": ("qwen2_moe-int8", shrink("model.layers.0.mlp.experts.0.up_proj.SCB"), ["up_proj", "SCB"]),
}


@pytest.mark.parametrize("case", sorted(CASES_BNB))
def test_prequantized_bnb_edits(isolated, tmp_path, case):
    fixture, edit, words = CASES_BNB[case]
    d = mutate.copy(BNB / fixture, tmp_path / "c")
    mutate.edit_tensors(d, edit)
    assert_refused(isolated.load(d), *words)


# ---- 4. CLI ranges: exit 2 with one line, never a hang or a traceback ---------------------------------------------
@pytest.mark.parametrize("argv", [
    ["eval", "M", "--ref", "M", "--text", "t.txt", "--ctx", "0"],
    ["eval", "M", "--ref", "M", "--text", "t.txt", "--ctx", "1"],
    ["eval", "M", "--ref", "M", "--text", "t.txt", "--ctx", "-5"],
    ["generate", "M", "-p", ""],
    ["generate", "M", "-p", "hi", "--top-p", "0"],
    ["generate", "M", "-p", "hi", "--temperature", "-1"],
    ["generate", "M", "-p", "hi", "--max-new-tokens", "0"],
    ["quantize", "M", "O", "--group-size", "0"],
    ["bench", "--layers", "0"],
    ["demo", "--shape", "0", "8", "8"],
])
def test_cli_ranges(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_group_size_for_int8_refused(tiny_ckpt, tmp_path, capsys):
    assert main(["quantize", str(tiny_ckpt("qwen3_moe")), str(tmp_path / "o"), "--method", "int8",
                 "--group-size", "64"]) == 2
    assert "--group-size" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_eval_ctx_checked_in_the_api():
    from moeq.eval import windows

    for ctx in (0, 1, -3):
        with pytest.raises(moeq.MoeqError, match="ctx"):
            windows(100, ctx)


# ---- 5. safetensors headers as strict as safetensors' own ----------------------------------------------------------
def header_edit(fn):
    def run(d):
        path = d / mutate.ST
        header, data = mutate.read_raw(path)
        out = fn(header, data)
        header, data, hb = out if isinstance(out, tuple) else (header, data, None)
        mutate.write_raw(path, header, data, hb)
    return run


def ordered(h):
    """Tensor names in data order."""
    return sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])


def negative_offset(h, d):
    e = h[ordered(h)[1]]
    e["data_offsets"] = [-64, e["data_offsets"][1] - 64]


def overlapping(h, d):
    a, b = (h[k] for k in ordered(h)[:2])
    b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + b["data_offsets"][1] - b["data_offsets"][0]]


def float_shape(h, d):
    e = h[ordered(h)[0]]
    e["shape"] = [float(x) for x in e["shape"]]


def negative_shape(h, d):
    e = h[ordered(h)[0]]
    e["shape"] = [-1, -e["shape"][0]]


def duplicate_key(h, d):
    return h, d, json.dumps(h).encode()[:-1] + b', "__metadata__": {}}'


CASES_HEADER = {
    "negative offset": (negative_offset, ["data_offsets"]),
    "overlapping tensors": (overlapping, ["tensor"]),
    "float shape": (float_shape, ["shape"]),
    "negative shape": (negative_shape, ["shape"]),
    "trailing bytes": (lambda h, d: (h, d + b"\0" * 16, None), ["after the last tensor"]),
    "list header": (lambda h, d: (h, d, json.dumps([1, 2]).encode()), ["JSON object"]),
    "non-string metadata": (lambda h, d: h.update({"__metadata__": {"format": 1}}), ["__metadata__"]),
    "duplicate key": (duplicate_key, ["duplicate"]),
    "unknown dtype": (lambda h, d: h[ordered(h)[0]].update(dtype="Q4"), ["dtype"]),
}


@pytest.mark.parametrize("case", sorted(CASES_HEADER))
def test_strict_headers(tiny_ckpt, isolated, tmp_path, case):
    edit, words = CASES_HEADER[case]
    d = mutate.copy(tiny_ckpt("qwen3_moe"), tmp_path / "c")
    header_edit(edit)(d)
    assert_refused(isolated.load(d, quant="rtn-int4"), "model.safetensors", *words)


def test_index_shard_outside_the_folder(tiny_ckpt, isolated, tmp_path):
    d = mutate.copy(tiny_ckpt("qwen3_moe"), tmp_path / "c")
    keys = list(mutate.tensors(d))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "../../etc/model.safetensors" for k in keys}}))
    assert_refused(isolated.load(d, quant="rtn-int4"), "plain file names")


# ---- 6. finite but huge weights -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["rtn-int4", "rtn-int8"])
def test_huge_weights_refused_when_quantizing(tiny_ckpt, isolated, tmp_path, method):
    """vLLM's grid computes absmax * 2 in the weight's dtype: it overflows bf16 for |w| ~ 3e38. An error naming the
    tensor, never Inf scales."""
    d = mutate.copy(tiny_ckpt("qwen3_moe"), tmp_path / "c")
    key = "model.layers.1.mlp.experts.2.down_proj.weight"
    mutate.edit_tensors(d, fill(key, 3e38, count=5))
    assert_refused(isolated.load(d, quant=method), key)


@pytest.mark.parametrize("method", ["rtn-int4", "rtn-int4-asym", "rtn-int8", "rtn-int3", "nf4", "fp4", "int8",
                                    "nf4-opt", "rtn-int4-opt", "q4_0", "iq4nl", "q4_0-opt", "q5_0-opt", "nl3"])
@pytest.mark.parametrize("peak", [3e38, 1e38, 6e4])
def test_huge_weights_error_or_sound(method, peak):
    """Every method either refuses a weight with huge finite values (naming it) or returns a sound result: finite,
    in-range statistics and a dequantized weight within the format's error of the input (never Inf/NaN)."""
    w = torch.randn(2, 64, 256) * 0.02
    w[0, 3, :5] = peak
    w[1, 7, 100] = -peak
    w = w.to(torch.bfloat16)
    try:
        q = moeq.method(method).quantize(w, name="the.weight")
    except moeq.MoeqError as e:
        assert "the.weight" in str(e)
        return
    assert q.problems() == []
    deq = q.dequantize(torch.float32)
    assert torch.isfinite(deq).all()
    big = w.float().abs() > 1
    assert ((deq[big] - w.float()[big]).abs() / w.float()[big].abs()).max() < 0.35


# ---- 7. an unwritable kernel cache falls back to plain torch -------------------------------------------------------
def test_unwritable_cache_falls_back(tiny_ckpt, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    code = ("import moeq\nfrom moeq import native\nassert native.lib() is None\n"
            f"m = moeq.load({str(tiny_ckpt('qwen3_moe'))!r}, quant='rtn-int4', progress=False)\n"
            "import torch\nprint(m(torch.tensor([[1, 2, 3]])).logits.isfinite().all().item())")
    env = dict(os.environ, XDG_CACHE_HOME=str(blocker), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-3000:]
    assert "plain-torch" in r.stderr


# ---- minor cases ---------------------------------------------------------------------------------------------------
CASES_CONFIG = {
    "top-k above experts": (lambda c: c.update(num_experts_per_tok=99), ["num_experts_per_tok"]),
    "negative vocab": (lambda c: c.update(vocab_size=-5), ["vocab_size"]),
    "string sizes": (lambda c: c.update(hidden_size="128"), ["hidden_size"]),
    "quantization_config string": (lambda c: c.update(quantization_config="moeq"), ["quantization_config"]),
    "config not JSON object": (lambda c: [1, 2], ["config.json"]),
}


@pytest.mark.parametrize("case", sorted(CASES_CONFIG))
def test_config_edits(tiny_ckpt, isolated, tmp_path, case):
    edit, words = CASES_CONFIG[case]
    d = mutate.copy(tiny_ckpt("qwen3_moe"), tmp_path / "c")
    mutate.edit_config(d, edit)
    assert_refused(isolated.load(d, quant="rtn-int4"), *words)


def test_unmutated_loads_equal(saved, isolated):
    """The harness itself: an untouched copy loads and reproduces its reference logits exactly."""
    for method in ("rtn-int4", "nf4", "int8", "rtn-int4-asym"):
        ckpt, ref = saved(method)
        r = isolated.load(ckpt, ref=ref)
        assert r["outcome"] == "ok" and r["equal"] and r["finite"], (method, r)


@pytest.mark.parametrize("key,value", [("num_hidden_layers", 65536), ("vocab_size", 1 << 30), ("hidden_size", 1 << 20)])
def test_config_sizes_cannot_exhaust_memory(tiny_ckpt, isolated, tmp_path, key, value):
    d = mutate.copy(tiny_ckpt("qwen3_moe"), tmp_path / "c")
    mutate.edit_config(d, lambda c: c.update({key: value}))
    assert_refused(isolated.load(d, quant="rtn-int4"), key)


def test_gguf_zero_dim_and_overlap_refused(tiny_ckpt, isolated, tmp_path):
    """Found by the GGUF fuzz target: a tensor dim flipped to 0 crashed the bf16 view; an offset aimed at another
    tensor's bytes would silently duplicate it."""
    import gguf as ggufpy

    from moeq.export import export

    src = tiny_ckpt("qwen3_moe", norm_topk_prob=True)
    d = tmp_path / "g"
    export(moeq.load(src, quant="q4_0", progress=False), d, "gguf", source=src)
    f = d / "model.gguf"
    good = f.read_bytes()
    r = ggufpy.GGUFReader(str(f))
    t = next(t for t in r.tensors if t.tensor_type.name == "BF16")
    dim_off = int(t.field.offset) + sum(int(p.nbytes) for p in t.field.parts[:3])  # name len, name, n_dims
    raw = bytearray(good)
    raw[dim_off:dim_off + 8] = bytes(8)
    f.write_bytes(bytes(raw))
    assert_refused(isolated.load(d), t.name)
    a, b = r.tensors[0], r.tensors[1]
    raw = bytearray(good)
    pos = int(a.field.offset) + sum(int(p.nbytes) for p in a.field.parts[:-1])
    raw[pos:pos + 8] = int(b.data_offset - r.data_offset).to_bytes(8, "little")
    f.write_bytes(bytes(raw))
    reply = isolated.load(d)
    assert reply["outcome"] == "error" and ("overlaps" in reply["msg"] or "do not hold" in reply["msg"]), reply
