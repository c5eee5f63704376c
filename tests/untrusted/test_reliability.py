"""Valid input never crashes moeq, finite input never yields silent NaN/Inf, --overwrite never deletes what moeq did
not write, dependency failures are one-line errors, contradictions and future versions are refused, and the native
kernel cache is never loaded when it is not what moeq built."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moeq
from moeq import native
from moeq.cli import main
from moeq.export import export
from moeq.io.writer import MARKER
from moeq.nn.finite import NonFiniteError
from tests.conftest import dequantized_reference

ROOT = Path(__file__).resolve().parents[2] / "src"


def _saved(tiny_ckpt, tmp_path, arch: str, method: str) -> Path:
    out = tmp_path / f"{arch}-{method}"
    moeq.save(moeq.load(tiny_ckpt(arch), method, progress=False), out, source=tiny_ckpt(arch))
    return out


def _logits(model, t: int) -> torch.Tensor:
    ids = torch.arange(3, 3 + t)[None] % 300
    with torch.no_grad():
        return model(ids).logits.float()


# ---- valid checkpoints in fp16/fp32 compute ------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("method", ["q4_0", "rtn-int4", "iq4nl", "iq4nl-dq"])
def test_saved_4bit_checkpoint_runs_in_fp16_and_fp32(tiny_ckpt, tmp_path, arch, method):
    """A saved bf16 checkpoint whose experts take the il16 layout, run with fp16/fp32 compute at 1, 4 and 17 tokens:
    the il16 per-expert path used to write fp32 into an fp16 buffer (a heap overflow). Judged against transformers'
    own fp32 forward over the same dequantized weights (not against bf16 compute: there one of these 17 tokens routes
    differently, in transformers' bf16 forward as in moeq's)."""
    out = _saved(tiny_ckpt, tmp_path, arch, method)
    for dtype, tol in ((torch.float16, 0.02), (torch.float32, 0.01)):
        m = moeq.load(out, dtype=dtype, progress=False)
        ref = dequantized_reference(m, tiny_ckpt(arch), torch.float32)
        for t in (1, 4, 17):
            a, b = _logits(m, t), _logits(ref, t)
            assert torch.isfinite(a).all()
            assert ((a - b).norm() / b.norm()).item() < tol, (dtype, t)


def test_fp16_source_config_in_flight(tiny_ckpt, tmp_path):
    """A source whose config says torch_dtype float16, quantized in flight (fp16 scales, fp16 compute)."""
    src = Path(tiny_ckpt("qwen3_moe", dtype=torch.float16))
    m = moeq.load(src, "q4_0", progress=False)
    for t in (1, 4, 17):
        assert torch.isfinite(_logits(m, t)).all()


def test_cli_generate_fp16_exits_zero(tiny_ckpt, tmp_path, capsys):
    out = _saved(tiny_ckpt, tmp_path, "qwen3_moe", "q4_0")
    assert main(["generate", str(out), "-p", "hello there", "--dtype", "fp16", "--max-new-tokens", "5",
                 "--no-chat"]) == 0


# ---- finite statistics whose product overflows ---------------------------------------------------------------------
def _tamper(path: Path, key_part: str, value: float) -> str:
    f = path / "model.safetensors"
    sd = load_file(f)
    key = next(k for k in sd if key_part in k)
    sd[key].view(-1)[0] = value
    save_file(sd, str(f), metadata={"format": "pt", "producer": "moeq"})
    return key


@pytest.mark.parametrize("method,key,value", [("iq4nl", "experts.w13_scale", 2.5e36),
                                              ("q5_0", "q_proj.weight_scale", 1e37),
                                              ("iq4nl-dq", "experts.w2_scale_super", 2e34),
                                              ("q4_0", "lm_head.weight", 3e38),
                                              ("int8", "q_proj.weight_scb", 1e38)])
def test_overflowing_statistics_stop_with_an_error(tiny_ckpt, tmp_path, method, key, value, capsys):
    out = _saved(tiny_ckpt, tmp_path, "qwen3_moe", method)
    _tamper(out, key, value)
    m = moeq.load(out, progress=False)
    with pytest.raises(NonFiniteError, match="produced (NaN|Inf|values whose float32 squares overflow)"):
        for t in (1, 4, 17):
            _logits(m, t)
        m.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=8, do_sample=False)
    rc = main(["generate", str(out), "-p", "hello there, how are you", "--max-new-tokens", "8", "--no-chat"])
    err = capsys.readouterr().err
    assert rc == 2 and "moeq: error:" in err and "Traceback" not in err


def test_bnb_nested_absmax_overflow_stops(tiny_ckpt, tmp_path):
    out = tmp_path / "bnb"
    export(moeq.load(tiny_ckpt("qwen3_moe"), "nf4", progress=False), out, format="bnb", check=False)
    f = out / "model.safetensors"
    sd = load_file(f)
    key = next(k for k in sd if k.endswith("nested_absmax"))
    sd[key].view(-1)[0] = 1e38
    save_file(sd, str(f), metadata={"format": "pt"})
    m = moeq.load(out, progress=False)
    with pytest.raises(NonFiniteError):
        for t in (1, 4, 17):
            _logits(m, t)


def test_finite_models_are_not_flagged(tiny_ckpt):
    m = moeq.load(tiny_ckpt("qwen3_moe"), "q4_0", progress=False)
    out = m.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 9)


# ---- --overwrite never deletes what moeq did not write -------------------------------------------------------------
@pytest.mark.parametrize("listed", [["data"], ["notes.txt"], ["model.safetensors", "data"]])
def test_forged_marker_cannot_delete_a_user_folder(tiny_ckpt, tmp_path, listed, capsys):
    out = _saved(tiny_ckpt, tmp_path, "qwen3_moe", "q4_0")
    (out / "data").mkdir()
    (out / "data" / "thesis.tex").write_text("years of work")
    if "notes.txt" in listed:
        (out / "notes.txt").write_text("mine")
    marker = json.loads((out / MARKER).read_text())
    marker["files"] = sorted(set(marker["files"]) | set(listed))
    (out / MARKER).write_text(json.dumps(marker))
    rc = main(["quantize", str(tiny_ckpt("qwen3_moe")), str(out), "--method", "q4_0", "--overwrite"])
    assert rc == 2 and "moeq: error:" in capsys.readouterr().err
    assert (out / "data" / "thesis.tex").read_text() == "years of work"
    assert "notes.txt" not in listed or (out / "notes.txt").read_text() == "mine"


def test_overwrite_of_a_real_output_still_works(tiny_ckpt, tmp_path):
    out = _saved(tiny_ckpt, tmp_path, "qwen3_moe", "q4_0")
    assert main(["quantize", str(tiny_ckpt("qwen3_moe")), str(out), "--method", "rtn-int4", "--overwrite"]) == 0
    assert moeq.inspect(moeq.load(out, progress=False))["modules"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")]  # nothing left beside it


# ---- dependency failures and bad text: one line, exit 2 ------------------------------------------------------------
def test_disk_full_during_save_is_one_line(tiny_ckpt, tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    from moeq.io import writer

    def full(*a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                              "\"No space left on device\" })")

    monkeypatch.setattr(writer, "save_file", full)
    out = tmp_path / "out"
    rc = main(["quantize", str(tiny_ckpt("qwen3_moe")), str(out), "--method", "q4_0"])
    err = capsys.readouterr().err
    assert rc == 2 and "No space left" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("moeq: error:")]) == 1
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_non_utf8_prompt_file(tiny_ckpt, tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"caf\xe9 au lait\n")
    rc = main(["generate", str(tiny_ckpt("qwen3_moe")), "--prompt-file", str(f), "--method", "q4_0"])
    err = capsys.readouterr().err
    assert rc == 2 and "UTF-8" in err and "Traceback" not in err


def test_prompt_longer_than_context_is_refused(tiny_ckpt, capsys):
    rc = main(["generate", str(tiny_ckpt("qwen3_moe")), "-p", "word " * 2000, "--method", "q4_0", "--no-chat"])
    err = capsys.readouterr().err
    assert rc == 2 and "context" in err and "256" in err


def test_budget_past_context_is_cut(tiny_ckpt, capsys, caplog):
    rc = main(["generate", str(tiny_ckpt("qwen3_moe")), "-p", "word " * 50, "--method", "q4_0", "--no-chat",
               "--max-new-tokens", "1000"])
    assert rc == 0
    assert "exceed the model's context" in caplog.text


def test_eval_ctx_past_context(tiny_ckpt, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged. " * 200)
    rc = main(["eval", str(tiny_ckpt("qwen3_moe")), "--ref", str(tiny_ckpt("qwen3_moe")), "--text", str(text),
               "--ctx", "1024", "--method", "q4_0"])
    assert rc == 2 and "context" in capsys.readouterr().err


# ---- contradictions and the future ---------------------------------------------------------------------------------
def _ct_export(tiny_ckpt, tmp_path, method="rtn-int4-asym") -> Path:
    out = tmp_path / "ct"
    export(moeq.load(tiny_ckpt("qwen3_moe"), method, progress=False), out, format="compressed-tensors",
                check=False)
    return out


def test_ct_symmetric_with_zero_points_is_refused(tiny_ckpt, tmp_path):
    out = _ct_export(tiny_ckpt, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    for g in cfg["quantization_config"]["config_groups"].values():
        g["weights"]["symmetric"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(moeq.MoeqError, match="weight_zero_point.*symmetric"):
        moeq.load(out, progress=False)


def test_ct_zero_points_with_extra_rows_are_refused(tiny_ckpt, tmp_path):
    out = _ct_export(tiny_ckpt, tmp_path)
    f = next(out.glob("*.safetensors"))
    sd = load_file(f)
    key = next(k for k in sd if k.endswith("weight_zero_point"))
    sd[key] = torch.cat([sd[key], sd[key]])
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(moeq.MoeqError, match="weight_zero_point: shape"):
        moeq.load(out, progress=False)


@pytest.mark.parametrize("edit", ["format_version", "config_version"])
def test_versions_from_the_future_are_refused(tiny_ckpt, tmp_path, edit):
    out = _saved(tiny_ckpt, tmp_path, "qwen3_moe", "q4_0")
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    if edit == "format_version":
        qc["format_version"] = 99
    else:
        qc["config"]["version"] = 99
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(moeq.MoeqError, match="newer moeq"):
        moeq.load(out, progress=False)


# ---- the native kernel cache ---------------------------------------------------------------------------------------
def _fake_cc(tmp_path: Path) -> Path:
    """A 'compiler' that writes the library this session already built (a real build takes half a minute): what a
    build puts in the cache, without the wait; counts its link steps (one per build, after one compile per source)."""
    real = native.lib()._name
    cc = tmp_path / "fakecc"
    calls = tmp_path / "calls"
    cc.write_text(f"#!/bin/sh\nlink=1\nwhile [ $# -gt 0 ]; do case \"$1\" in -c) link=0;; -o) out=\"$2\";; esac; "
                  f"shift; done\ncp {real} \"$out\"\n[ $link = 1 ] && echo x >> {calls}\nexit 0\n")
    cc.chmod(0o755)
    return cc


def _load_in_child(tmp_path: Path, cache: Path, cc: Path) -> subprocess.CompletedProcess:
    code = "from moeq import native\nL = native.lib()\nassert L is not None\nprint(L._name)"
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), CC=str(cc), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(native.lib() is None, reason="needs the native library built once")
def test_kernel_cache_garbage_truncated_and_concurrent(tmp_path):
    cc = _fake_cc(tmp_path)
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", "from moeq import native\nassert native.lib() is not None"],
                              env=dict(os.environ, XDG_CACHE_HOME=str(cache), CC=str(cc), PYTHONPATH=str(ROOT)),
                              stderr=subprocess.PIPE) for _ in range(3)]  # three builders into one empty cache
    assert all(p.wait(300) == 0 for p in procs)
    so = Path(_load_in_child(tmp_path, cache, cc).stdout.strip())
    assert so.parent == cache / "moeq" / "kernels" and so.with_suffix(".sha256").exists()
    assert not [p for p in so.parent.iterdir() if p.is_dir()]  # no temporary folders left
    assert (so.parent.stat().st_mode & 0o777) == 0o700
    n_calls = len((tmp_path / "calls").read_text().split())
    for damage in (lambda b: b[: len(b) // 3], lambda b: b"\x7fELF" + os.urandom(len(b) - 4)):
        so.write_bytes(damage(so.read_bytes()))
        r = _load_in_child(tmp_path, cache, cc)
        assert r.returncode == 0 and "rebuilding" in r.stderr, r.stderr[-2000:]
        assert len((tmp_path / "calls").read_text().split()) == n_calls + 1  # rebuilt, not loaded
        n_calls += 1


@pytest.mark.skipif(native.lib() is None, reason="needs the native library built once")
def test_kernel_cache_writable_by_others_is_not_used(tmp_path):
    cc = _fake_cc(tmp_path)
    cache = tmp_path / "cache"
    (cache / "moeq" / "kernels").mkdir(parents=True)
    (cache / "moeq" / "kernels").chmod(0o777)
    r = _load_in_child(tmp_path, cache, cc)
    assert r.returncode == 0 and "writable by" in r.stderr
    assert not Path(r.stdout.strip()).is_relative_to(cache)
    assert not list((cache / "moeq" / "kernels").iterdir())


def test_no_world_writable_files_in_the_real_cache():
    L = native.lib()
    if L is None:
        pytest.skip("no native library")
    so = Path(L._name)
    for p in (so, so.with_suffix(".sha256"), so.parent):
        if p.exists():
            assert not p.stat().st_mode & 0o022, p


def test_export_judge_refuses_a_non_finite_consumer(tiny_ckpt, tmp_path, monkeypatch):
    """A consumer whose logits come out NaN is refused even with --force (a NaN KL compares False against the bar)."""
    from moeq.export import check as check_mod

    monkeypatch.setattr(check_mod, "consumer_kl", lambda *a, **k: float("nan"))
    m = moeq.load(tiny_ckpt("qwen3_moe"), "rtn-int4", progress=False)
    for force in (False, True):
        with pytest.raises(moeq.MoeqError, match="non-finite KL"):
            export(m, tmp_path / f"ct{force}", format="compressed-tensors", force=force)
        assert not (tmp_path / f"ct{force}").exists()


def test_ct_regex_targets_pick_their_group(tiny_ckpt, tmp_path):
    """llm-compressor writes ``re:`` targets as regular expressions (compressed-tensors' ``re.match``), not globs:
    the experts' group must be the one whose regex names them, not the ``Linear`` fallback."""
    out = _ct_export(tiny_ckpt, tmp_path, "rtn-int4")
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    (name, group), = [(k, g) for k, g in qc["config_groups"].items()]
    wrong = json.loads(json.dumps(group))
    wrong["weights"]["group_size"] = 64  # a Linear fallback that does not fit the tensors
    group["targets"] = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$", r"re:.*self_attn\.[qkvo]_proj$"]
    wrong["targets"] = ["Linear"]
    qc["config_groups"] = {"group_1": wrong, name: group}
    (out / "config.json").write_text(json.dumps(cfg))
    m = moeq.load(out, progress=False)
    ref = moeq.load(tiny_ckpt("qwen3_moe"), "rtn-int4", progress=False)
    assert torch.equal(m.model.layers[0].mlp.experts.w13.qdata, ref.model.layers[0].mlp.experts.w13.qdata)
    bad = json.loads(json.dumps(cfg))
    bad["quantization_config"]["config_groups"][name]["targets"] = ["re:(unclosed"]
    (out / "config.json").write_text(json.dumps(bad))
    with pytest.raises(moeq.MoeqError, match="not a regular expression"):
        moeq.load(out, progress=False)


@pytest.mark.skipif(native.lib() is None, reason="the native RMSNorm")
def test_native_rmsnorm_turns_an_unsquarable_row_into_nan():
    """A residual row past ~1e19 (finite in bf16) overflows the fp32 sum of squares: the native decode step's
    RMSNorm gives NaN for that row (the step's logits check then stops), not the zeros 1/sqrt(inf) would; the other
    rows are untouched and equal transformers' norm."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    from moeq.nn.decode import rms_norm

    norm = Qwen3MoeRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(64).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    x[1, 5] = 3e37
    y = rms_norm(norm, x, 1e-6)
    assert y is not None and torch.isnan(y[1]).all()
    assert torch.equal(y[[0, 2]], norm(x[[0, 2]]))
