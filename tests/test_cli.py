"""The CLI is a thin layer: quantize -> inspect -> generate round trip on a tiny checkpoint."""
import json

from moeq.cli import main


def test_quantize_inspect_generate(tiny_ckpt, tmp_path, capsys):
    src = tiny_ckpt("qwen2_moe")
    out = tmp_path / "q"
    assert main(["quantize", str(src), str(out), "--method", "rtn-int4", "--rule", "lm_head=rtn-int8",
                 "--rule", "*.shared_expert.*=none", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["bytes_after"] < 0.5 * summary["bytes_before"]
    assert 4.0 < summary["quantized_bits_per_weight"] < 5.0
    assert summary["peak_rss_bytes"] > 0 and summary["params_quantized"] > 0
    assert (out / "tokenizer.json").exists()
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    fmts = {r["module"]: r for r in info["modules"]}
    assert fmts["lm_head.weight"]["format"] == "rtn" and fmts["lm_head.weight"]["detail"]["bits"] == 8
    assert fmts["model.layers.0.mlp.experts.w13"]["detail"]["bits"] == 4
    assert fmts["model.layers.0.mlp.shared_expert.gate_proj.weight"]["format"] == "bfloat16"
    assert main(["inspect", str(out)]) == 0
    assert "bits/weight" in capsys.readouterr().out
    assert main(["generate", str(out), "-p", "a single man", "--max-new-tokens", "5"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("a single man") and "5 tokens" in cap.err
    assert main(["generate", str(src), "-p", "truth", "--method", "nf4", "--max-new-tokens", "3", "--sample"]) == 0
    assert "3 tokens" in capsys.readouterr().err


def test_bad_method_and_rule(tiny_ckpt, tmp_path, capsys):
    assert main(["quantize", str(tiny_ckpt("qwen2_moe")), str(tmp_path / "x"), "--rule", "lm_head"]) == 2
    assert "PATTERN=METHOD" in capsys.readouterr().err
