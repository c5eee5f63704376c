"""Checkpoints saved by moeq 0.1.0 before this layout (tests/fixtures/saved-0.1.0, written by commit 9072d96 with
its own code, with the logits that code computed) still load, bit for bit, and count as moeq outputs for
``--overwrite``."""
import shutil
from pathlib import Path

import pytest
import torch

import moeq
from moeq import native
from moeq.cli import main

OLD = Path(__file__).parent / "fixtures" / "saved-0.1.0"


@pytest.mark.parametrize("method", ["rtn-int4-asym", "nf4"])
def test_previous_layout_loads_identically(method, monkeypatch):
    ref = torch.load(OLD / "logits.pt")[method]  # computed with the AVX512 kernels of this machine kind
    # with the plan choices of the code that computed them: dequantize + matmul beyond 4 rows, the head in torch (since
    # then CPUs without AMX keep more rows in the native gemvs, which sum in another order)
    monkeypatch.setattr(native, "has_amx", lambda: True)
    m = moeq.load(OLD / method, progress=False)
    got = m(torch.tensor([[3, 10, 17, 24, 31, 38]])).logits.float()
    if native.has_dpbf16():
        assert torch.equal(got, ref)
    else:  # another ISA's kernels (e.g. MOEQ_NATIVE_MARCH=x86-64-v3) sum in another order
        assert (got - ref).abs().max() < 0.02 * ref.abs().max()


def test_previous_output_can_be_overwritten(tiny_ckpt, tmp_path):
    out = tmp_path / "old"
    shutil.copytree(OLD / "nf4", out)  # a 0.1.0 output: no marker file, only moeq's file names
    assert main(["quantize", str(tiny_ckpt("qwen3_moe")), str(out), "--overwrite"]) == 0
    assert moeq.inspect(moeq.load(out, progress=False))["modules"][0]["format"] == "rtn"
