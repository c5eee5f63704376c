"""CLI conventions users expect: --version, -v anywhere, defaults and examples in --help, --json a flag everywhere,
eval over several models in one run with its inputs recorded."""
import json

import pytest

from moeq.cli import build_parser, main

COMMANDS = ["quantize", "generate", "chat", "inspect", "export", "eval", "bench", "demo"]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("moeq ")


def test_verbose_before_or_after_the_command():
    p = build_parser()
    assert p.parse_args(["-v", "inspect", "m"]).verbose and p.parse_args(["inspect", "m", "-v"]).verbose
    assert not p.parse_args(["inspect", "m"]).verbose


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_has_defaults_and_examples(cmd, capsys):
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    text = capsys.readouterr().out
    assert "default" in text
    if cmd not in ("bench", "demo"):
        assert "example" in text


def test_eval_several_models_and_records_inputs(tiny_ckpt, tmp_path, capsys):
    src = tiny_ckpt("qwen3_moe")
    q = tmp_path / "q"
    assert main(["quantize", str(src), str(q), "--method", "rtn-int8"]) == 0
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 20)
    capsys.readouterr()
    # --text before the models: the models are not swallowed by it
    assert main(["eval", "--text", str(text), str(q), str(src), "--ref", str(src), "--ctx", "32", "--json",
                 "--json-out", str(tmp_path / "r.json")]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["model"] for r in rows] == [str(q), str(src)]
    assert rows[1]["mean_kl"] == 0 and rows[0]["mean_kl"] > 0
    assert all(r["reference"] == str(src) and r["texts"] == [str(text)] and r["ctx"] == 32 for r in rows)
    assert json.loads((tmp_path / "r.json").read_text()) == rows


def test_demo_json_is_a_flag():
    args = build_parser().parse_args(["demo", "--json"])
    assert args.json is True and args.json_out is None


def test_bench_default_output_is_not_the_cwd():
    args = build_parser().parse_args(["bench"])
    assert args.out is None  # results go to a timestamped file in --cache (printed), never ./benchmarks/results


def test_searched_method_warns_with_an_estimate(tiny_ckpt, tmp_path, capsys):
    assert main(["quantize", str(tiny_ckpt("qwen3_moe")), str(tmp_path / "o"), "--method", "nf4-opt"]) == 0
    err = capsys.readouterr().err
    assert "nf4-b32-dq-s20 searches each block at" in err and "GB/s" in err and "min for" in err
    assert main(["quantize", str(tiny_ckpt("qwen3_moe")), str(tmp_path / "q"), "--method", "iq4nl"]) == 0
    assert "warning" not in capsys.readouterr().err  # the native weighted search runs at ~0.5 GB/s: no warning
    assert main(["quantize", str(tiny_ckpt("qwen3_moe")), str(tmp_path / "p"), "--method", "nf4"]) == 0
    assert "warning" not in capsys.readouterr().err
