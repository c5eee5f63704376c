"""The README's Python API example runs as written (placeholders replaced by a tiny checkpoint and a temp folder;
the GPU line runs on the CPU where no GPU is present)."""
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_api_block() -> str:
    text = README.read_text()
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_python_api_example_runs(tiny_ckpt, tmp_path):
    code = python_api_block()
    src = tiny_ckpt("qwen3_moe")
    code = code.replace('"path/to/Qwen3-30B-A3B"', repr(str(src))).replace('"qwen3-30b-moeq"', repr(str(tmp_path / "q")))
    code = code.replace("model.generate(...)", "model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)")
    if not torch.cuda.is_available():
        code = code.replace('device="cuda"', 'device="cpu"')
    ns = {"torch": torch, "w": torch.randn(4, 256, 512, dtype=torch.bfloat16)}
    exec(compile(code, "README.md (Python API)", "exec"), ns)  # noqa: S102 - the README's own example
    assert ns["w_hat"].shape == (4, 256, 512) and ns["w_hat"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.experts.0.gate_proj.weight.absmax" in ns["sd"]


def test_readme_tables_are_generated_from_the_results():
    """The headline tables are benchmarks/tables.py's output over benchmarks/results/*.json, not typed by hand."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(README.parent / "benchmarks" / "tables.py"), "--check", str(README)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "<!-- table: vs_llamacpp -->\n2 threads" in README.read_text()


def test_readme_is_short_and_docs_hold_no_work_history():
    assert len(README.read_text().splitlines()) <= 400
    for f in [README, *sorted((README.parent / "docs").glob("*.md"))]:
        text = f.read_text()
        assert not re.search(r"issue #\d|#\d\d\b|[Ss]ession \d|this session|previous session", text), f.name
        for link in re.findall(r"\]\((docs/[^)]+)\)", text):
            assert (README.parent / link).exists(), (f.name, link)
